"""The cache and the adaptors from Python."""

import pytest

import cumempool as cm


def test_the_cache_answers_repeat_allocations_without_the_driver(gpu, stream):
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    for _ in range(100):
        cache.alloc(1 << 20, stream).close()
    stats = cache.stats()
    assert stats["misses"] <= 2 and stats["hits"] >= 98, stats
    cache.release()
    assert cache.stats()["cached_bytes"] == 0


def test_statistics_limit_tracking_and_the_out_of_memory_callback(gpu, stream):
    base = cm.PoolResource(cm.MemPool(cm.Route.device(0)))
    stats = cm.Statistics(base)
    limit = cm.Limit(stats, 4 << 20)
    tracking = cm.Tracking(limit)
    calls = []
    held = [tracking.alloc(2 << 20, stream), tracking.alloc(2 << 20, stream)]

    def on_oom(requested, attempt):
        calls.append((requested, attempt))
        if attempt == 1:
            held.pop().close()
            return True
        return False

    guarded = cm.OnOutOfMemory(tracking, on_oom)
    more = guarded.alloc(2 << 20, stream)
    assert calls == [(2 << 20, 1)]
    assert tracking.outstanding_bytes == 4 << 20 and limit.in_use == 4 << 20
    assert stats.usage()["peak_bytes"] == 4 << 20
    with pytest.raises(cm.LimitExceededError) as caught:
        limit.alloc(1, stream)
    assert isinstance(caught.value, MemoryError)
    more.close()
    held.clear()
    assert stats.usage()["current_bytes"] == 0


def test_a_host_cache_keeps_the_host_kind(gpu, stream):
    np = pytest.importorskip("numpy")
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.host())))
    buffer = cache.alloc(32, stream)
    assert buffer.memory_kind == "host" and buffer.__dlpack_device__() == (3, 0)
    buffer.fill(1)
    stream.synchronize()
    assert np.asarray(buffer).sum() == 32


def test_an_out_of_memory_callback_may_release_the_cache_above_it(gpu, stream):
    # The callback runs inside the cache's allocation, with the GIL held; release() releases
    # the GIL for its driver calls. The pool below must not release it a second time.
    # The driver rounds a device pool's maximum up to its granularity (32 MiB on an H200), so
    # the sizes are chosen against 32 MiB.
    pool = cm.MemPool(cm.Route.device(0), max_size=32 << 20)
    calls = []

    def on_oom(requested, attempt):
        calls.append(requested)
        cache.release()
        return attempt < 2

    cache = cm.CachingResource(cm.OnOutOfMemory(cm.PoolResource(pool), on_oom))
    cache.alloc(24 << 20, stream).close()
    assert cache.stats()["cached_bytes"] >= 24 << 20
    buffer = cache.alloc(12 << 20, stream)  # cannot fit beside the cached block
    assert calls and buffer.size == 12 << 20
    assert cache.stats()["cached_bytes"] == 0


def test_another_librarys_stream_is_one_stream_to_the_cache(gpu, stream):
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    lent = cm.Stream(0)

    class Lent:  # a new object per call, as torch.cuda.current_stream() gives
        def __cuda_stream__(self):
            return (0, lent.handle)

    for _ in range(20):
        cache.alloc(1 << 20, Lent()).close()
        cache.alloc(1 << 20, lent.handle).close()
    stats = cache.stats()
    assert stats["streams"] == 1 and stats["hits"] >= 38, stats
    assert cm.Stream.borrow(Lent()) is cm.Stream.borrow(lent.handle)
