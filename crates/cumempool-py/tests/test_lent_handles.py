"""A stream's raw handle handed out of the package (`Stream.handle`, `__cuda_stream__`,
`__int__`, `repr`, a buffer's `__cuda_array_interface__`) may be captured into a CUDA graph by
the library it goes to: the stream is then marked as one that may capture, so a cache asks the
driver before it hands out a block cached before the capture (which graph work would then write
while eager code holds it). On the stand-in libcuda of the Rust tests, which models captures,
and on the GPU with PyTorch's own capture."""

import pytest

import cumempool as cm
from conftest import library
from test_resource_alloc_under_capture import run_on_stand_in

# How each way out gives the raw handle of `s`, a Stream cumempool created.
WAYS_OUT = {
    "handle": "s.handle",
    "__cuda_stream__": "s.__cuda_stream__()[1]",
    "__int__": "int(s)",
    "repr": "int(repr(s).split('handle=')[1].split()[0], 16)",
    "__cuda_array_interface__": "lent_through_array_interface(s)",
}


@pytest.mark.parametrize("way", sorted(WAYS_OUT))
def test_a_capture_begun_on_a_lent_handle_is_seen_by_a_cache(stand_in_libcuda, way):
    served, ended = run_on_stand_in(
        stand_in_libcuda,
        """
        def lent_through_array_interface(s):
            buffer = cache.alloc(64, s)
            handle = buffer.__cuda_array_interface__["stream"]
            buffer.close()
            return handle
        pool = cm.MemPool(cm.Route.device(0))
        cache = cm.CachingResource(cm.PoolResource(pool))
        s = cm.Stream(0)
        warm = cache.alloc(1 << 20, s)
        cached = warm.ptr
        warm.close()
        handle = WAY_OUT
        assert begin(handle, 2) == 0  # another library's capture, relaxed
        try:
            again = cache.alloc(1 << 20, s)
            print("same" if again.ptr == cached else "fresh")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)))
        """.replace("WAY_OUT", WAYS_OUT[way]),
    )
    assert served != "same", f"after {way}, a capture on the handle got the block cached before it"
    assert ended == "0", "the capture was left intact"


def test_the_legacy_stream_is_not_marked_by_its_handle(stand_in_libcuda):
    # The legacy stream cannot be captured: reading its handle keeps its uses free of driver
    # queries (a cache hit on it still makes no call).
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        s = cm.Stream.legacy(0)
        print(s.handle, int(s), s.__cuda_stream__()[1])
        """,
    )
    assert words == ["0", "0", "0"]


def test_torch_capturing_a_lent_stream_does_not_get_a_cached_block(gpu):
    # The reproduction of issue 29 on the GPU: a cache warmed on a cumempool stream, then that
    # stream captured by PyTorch through torch.cuda.ExternalStream(s.handle).
    torch = library("torch")
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    s = cm.Stream(0)
    with cache.alloc(1 << 20, s) as warm:
        cached = warm.ptr
    s.synchronize()
    torch.cuda.synchronize()
    external = torch.cuda.ExternalStream(s.handle, device=torch.device("cuda", 0))
    graph = torch.cuda.CUDAGraph()
    outcome = []
    with torch.cuda.graph(graph, stream=external, capture_error_mode="relaxed"):
        try:
            outcome.append(cache.alloc(1 << 20, s).ptr == cached and "same")
        except cm.StreamCapturingError:
            outcome.append("refused")
        (torch.zeros(16, device="cuda") + 1).sum()
    assert outcome != ["same"], "the capture got the block cached before it"
    graph.replay()
    torch.cuda.synchronize()
    del graph
    cache.alloc(1 << 20, s).close()  # eager use after the capture works again
    cache.release()


def test_a_default_streams_object_is_one_per_device_and_a_device_not_there_keeps_none(stand_in_libcuda):
    # One object per device and kind, found again without a lock; an ordinal the driver refuses
    # (one past the lock-free slots, and one inside them) leaves nothing behind, and asks again.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        print(cm.Stream.legacy(0) is cm.Stream.legacy(0), cm.Stream.borrow(2) is cm.Stream.borrow(2))
        for device in (70, 5, 70, 5):
            try:
                cm.Stream.legacy(device)
                print("made")
            except cm.CumempoolError as error:
                print(type(error).__name__)
        """,
    )
    assert words[:2] == ["True", "True"]
    assert len(set(words[2:])) == 1 and words[2] != "made", words
