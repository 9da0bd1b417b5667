"""Lifetimes: memory that array views still use, calls racing close() on other threads, and
the streams other libraries lend, held exactly while something here uses them."""

import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest

import cumempool as cm
from conftest import library


def _run(code, timeout=120):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_close_keeps_memory_a_numpy_array_still_uses(gpu):
    # NumPy (through __array_interface__) holds the Buffer, not the memory: close() must leave
    # the memory to the Buffer's end, or the array reads what the pool handed out next.
    pytest.importorskip("numpy")
    out = _run(
        "import cumempool as cm, numpy as np\n"
        "pool = cm.MemPool(cm.Route.host()); s = cm.Stream(0)\n"
        "b = pool.alloc(4096, s); b.fill(5); s.synchronize()\n"
        "a = np.asarray(b)\n"
        "b.close()\n"
        "c = pool.alloc(4096, s); c.fill(9); s.synchronize()\n"
        "print(int(a[0]), int(a[-1]))\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5 5"


def test_close_keeps_memory_a_cupy_array_still_uses(gpu, stream):
    # As above, through __cuda_array_interface__ on the device.
    cupy = library("cupy")
    pool = cm.MemPool(cm.Route.device(0))
    b = pool.alloc(4096, stream)
    b.fill(5)
    a = cupy.asarray(b)
    b.close()
    c = pool.alloc(4096, stream)
    c.fill(9)
    stream.synchronize()
    assert int(a[0]) == 5 and int(a[-1]) == 5
    del c


def test_close_racing_a_copy_on_another_thread_closes(gpu, stream):
    # close() while another thread copies with the GIL released closes (the copy keeps the
    # memory until it is done); later copies raise ClosedError, never PyO3's RuntimeError.
    buffer = cm.MemPool(cm.Route.device(0)).alloc(256 << 20, stream)
    failures = _close_while_another_thread_uses(buffer, lambda: buffer.to_bytes(), 20, 0.05)
    assert failures == [] and buffer.closed


def test_pool_close_racing_an_alloc_on_another_thread_closes(gpu, stream):
    # MemPool.close() while another thread allocates with the GIL released closes; the
    # allocation in flight finishes, later ones raise ClosedError.
    pool = cm.MemPool(cm.Route.device(0))
    failures = _close_while_another_thread_uses(pool, lambda: pool.alloc(1 << 20, stream).close(), 2000, 0.01)
    assert failures == [] and pool.closed


def _close_while_another_thread_uses(target, use, times, after):
    """Calls `use()` `times` times on a thread and `target.close()` here `after` seconds in;
    what either raised other than ClosedError on the thread."""
    started = threading.Event()
    failures = []

    def user():
        started.set()
        try:
            for _ in range(times):
                use()
        except cm.ClosedError:
            pass
        except Exception as error:  # noqa: BLE001
            failures.append(error)

    thread = threading.Thread(target=user)
    thread.start()
    started.wait()
    time.sleep(after)
    try:
        target.close()
    except Exception as error:  # noqa: BLE001
        failures.append(error)
    thread.join()
    return failures


def test_a_viewed_buffer_gives_its_memory_back_when_collected(gpu):
    # After close(), the memory an array view kept goes back once the view lets go.
    np = pytest.importorskip("numpy")
    pool = cm.MemPool(cm.Route.host())
    s = cm.Stream(0)
    b = pool.alloc(1 << 20, s)
    a = np.asarray(b)
    b.close()
    b.close()  # closing again keeps what the view uses
    assert pool.used_mem_current >= 1 << 20
    with pytest.raises(cm.ClosedError):
        b.to_bytes()
    del a, b
    gc.collect()
    s.synchronize()
    assert pool.used_mem_current == 0


def test_a_resource_lets_go_of_a_lent_stream_with_its_last_buffer(gpu):
    # A lent stream's object is held while memory allocated on it lives, and no longer.
    own = cm.Stream(0)

    class Lender:
        def __cuda_stream__(self):
            return (0, own.handle)

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    lender = Lender()
    lent = weakref.ref(lender)
    stats.alloc(256, lender).close()
    del lender
    gc.collect()
    assert lent() is None


def test_a_block_cached_after_release_keeps_its_lent_stream(gpu):
    # A block cached for a lent stream keeps the lender (and so its CUDA stream) alive, even
    # when it is cached after a release(); the next release() lets go of both.
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))

    class Lender:
        def __init__(self):
            self.stream = cm.Stream(0)  # destroyed with the lender

        def __cuda_stream__(self):
            return (0, self.stream.handle)

    lender = Lender()
    lent = weakref.ref(lender)
    buffer = cache.alloc(1 << 20, lender)
    cache.release()
    buffer.close()
    del buffer, lender
    gc.collect()
    assert cache.stats()["cached_blocks"] == 0 or lent() is not None
    cache.release()
    gc.collect()
    assert lent() is None, "release() gave the block back but kept the lender"


def test_the_cupy_allocator_lets_go_of_cupy_streams(gpu):
    # The CuPy allocator holds a CuPy stream only while memory allocated on it lives.
    cupy = library("cupy")
    import cumempool.cupy as cmc

    allocator = cmc.Allocator(cm.MemPool(cm.Route.device(0)))
    s = cupy.cuda.Stream(non_blocking=True)
    lent = weakref.ref(s)
    with cupy.cuda.using_allocator(allocator):
        with s:
            a = cupy.zeros(256, dtype=cupy.uint8)
        del a
    s.synchronize()
    del s
    gc.collect()
    assert lent() is None


def test_closed_buffers_kept_by_views_and_capsules_at_exit_do_not_crash_the_interpreter(gpu):
    # Memory a view keeps after close(), a capsule no consumer took, and a lent stream held by
    # a cache all outlive the interpreter's last collection without a crash or a hang.
    pytest.importorskip("numpy")
    out = _run(
        "import cumempool as cm, numpy as np, threading\n"
        "pool = cm.MemPool(cm.Route.host()); s = cm.Stream(0)\n"
        "b = pool.alloc(4096, s); a = np.asarray(b); b.close()\n"
        "cap = pool.alloc(64, s).__dlpack__()\n"
        "class Lender:\n"
        "    def __init__(self): self.s = cm.Stream(0)\n"
        "    def __cuda_stream__(self): return (0, self.s.handle)\n"
        "cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))\n"
        "cache.alloc(1 << 20, Lender()).close()\n"
        "t = threading.Thread(target=lambda: pool.alloc(64, s).to_bytes()); t.start(); t.join()\n"
        "import builtins; builtins.kept = (a, cap, cache)\n"
        "print('done')\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
