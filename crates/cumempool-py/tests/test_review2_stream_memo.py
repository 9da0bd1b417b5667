"""The memo of lent streams: a handle the driver gives to a new stream after the old one was
closed, and memory whose last holder is a DLPack capsule."""

import gc
import weakref

import pytest

import cumempool as cm


class Lender:
    """Another library's stream object, as cuda.core's `Stream` is: `close()` destroys the
    CUDA stream while the object lives on."""

    def __init__(self, stream):
        self.stream = stream

    def close(self):
        self.stream = None  # the last holder of the owned Stream: cuStreamDestroy

    def __cuda_stream__(self):
        if self.stream is None:
            raise RuntimeError("this stream is closed")
        return (0, self.stream.handle)


def test_a_new_stream_with_a_closed_streams_handle_is_held_by_its_buffers(gpu):
    # Defect: the memo keys lent streams by (handle, device) on the premise that "a held object
    # keeps its stream alive, so no other stream has its handle meanwhile". An object can close
    # its stream while held (cuda.core's Stream.close(); a block a cache keeps or a Stream the
    # caller keeps holds the object). The driver then hands the handle to a new stream, and
    # passing the new stream's object finds the closed one's entry: its buffers hold the
    # closed object, not the new one, so the new stream can be destroyed (its object
    # collected) under memory still ordered on it.
    # Fix: on a (handle, device) hit for an object that is not the entry's, check that the
    # entry's object still names that handle (ask `__cuda_stream__` again; a closed one
    # raises) and replace the entry when it does not; or have the stream hold every object
    # that lent it.
    pool = cm.MemPool(cm.Route.device(0))
    first = Lender(cm.Stream(0))
    handle = first.stream.handle
    kept = cm.Stream.borrow(first)  # keeps the memo's entry (as a cached block would)
    first.close()
    spares = []
    for _ in range(256):
        fresh = cm.Stream(0)
        if fresh.handle == handle:
            break
        spares.append(fresh)
    else:
        pytest.skip("the driver did not hand the closed stream's handle out again")
    second = Lender(fresh)
    del fresh
    buffer = pool.alloc(4096, second)
    try:
        assert buffer.stream.owner is second, "the buffer holds the closed stream's object, not its own stream's"
    finally:
        buffer.close()
        second.stream.synchronize()
    del kept, spares


def test_a_closed_stream_object_passed_again_is_asked_for_its_handle(gpu):
    # Defect: the memo of recent objects answers by identity alone ("the same object again
    # needs no attribute lookup"). An object that closed its stream since (cuda.core's
    # Stream.close()) gets its old Stream back: the allocation is ordered on the destroyed
    # handle, which by now may name another stream (made below), instead of the object's
    # error. With a handle not yet reused, the driver gets a destroyed stream.
    # Fix: as for the test above, an identity hit must still confirm the handle (ask
    # `__cuda_stream__`, or drop objects from the memo once a call through them fails).
    pool = cm.MemPool(cm.Route.device(0))
    first = Lender(cm.Stream(0))
    handle = first.stream.handle
    kept = cm.Stream.borrow(first)  # the memo holds `first` now
    first.close()
    spares = []
    for _ in range(256):
        fresh = cm.Stream(0)
        if fresh.handle == handle:
            break
        spares.append(fresh)
    else:
        pytest.skip("the driver did not hand the closed stream's handle out again")
    # Only the destroyed stream's object is passed: it raises when asked for its handle.
    with pytest.raises(RuntimeError, match="closed"):
        pool.alloc(4096, first).close()
    fresh.synchronize()
    del kept, spares


def test_a_lent_stream_is_let_go_of_when_a_capsule_frees_the_last_buffer(gpu):
    # Defect: `close()` and collection give a buffer's memory back through `Core::release`,
    # which forgets the memo's entry for a lent stream nothing else uses (`streams::let_go`).
    # When a DLPack capsule (or its consumer) is the last holder, the deleter drops the core
    # directly: the memo keeps the lender's object (and so its CUDA stream) until 64 other
    # streams or 8 other objects push it out.
    # Fix: have the deleter hand the core to `Core::release` when it can take the GIL (the
    # interpreter is alive), so the memo entry is let go of as for close(); or prune unused
    # entries on a memo miss (see the next test).
    own = cm.Stream(0)

    class Borrowed:
        def __cuda_stream__(self):
            return (0, own.handle)

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    lender = Borrowed()
    lent = weakref.ref(lender)
    buffer = stats.alloc(256, lender)
    capsule = buffer.__dlpack__(stream=-1)
    buffer.close()  # the capsule holds the memory now
    del buffer, lender
    del capsule  # no consumer took it: its destructor gives the memory back
    assert stats.usage()["current_count"] == 0
    _lend_another()
    gc.collect()
    assert lent() is None, "the memo still holds the lender after the capsule gave the memory back"


def test_a_stream_borrowed_and_dropped_lets_go_of_its_lender(gpu):
    # Defect: `Stream.borrow(obj)` memoizes the lent stream and nothing lets go of the entry
    # when the caller drops the Stream: no buffer passes through `let_go`. The lender's object
    # (and its CUDA stream) lives on until 64 other streams or 8 other objects push it out,
    # against "the lending library's object lives as long as its stream is used here, and no
    # longer".
    # Fix: prune entries nothing else uses (`streams::prune_unused`) on a memo miss, before a
    # new entry is added (at most 64 entries to look at, only when a new stream is lent).
    lender = Lender(cm.Stream(0))
    lent = weakref.ref(lender)
    cm.Stream.borrow(lender)
    del lender
    _lend_another()
    gc.collect()
    assert lent() is None, "the memo still holds a lender whose Stream was dropped"


def _lend_another():
    """Lends the memo one more stream (a miss), for a fix that prunes on a miss."""
    other = Lender(cm.Stream(0))
    cm.Stream.borrow(other)
