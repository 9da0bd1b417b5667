"""Orderings a buffer makes with another stream (`Buffer.close(stream)`, `__dlpack__(stream=)`)
when that stream captures into a CUDA graph: an event wait between a capturing stream and one
that does not capture either joins the buffer's stream to the capture (its free then recorded
into the other library's graph, and the capture ended unjoined) or is refused by the driver with
CUDA_ERROR_STREAM_CAPTURE_ISOLATION, invalidating the capture. Both are refused with
StreamCapturingError before the wait, the capture left intact. On the stand-in libcuda of the
Rust tests, which models captures and joins, and on the GPU with PyTorch's own capture."""

import pytest

import cumempool as cm
from conftest import library
from test_resource_alloc_under_capture import run_on_stand_in


@pytest.mark.parametrize("source", ["pool", "cache"])
def test_closing_after_a_capturing_stream_is_refused_and_the_capture_left_intact(stand_in_libcuda, source):
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        resource = pool if "SOURCE" == "pool" else cm.CachingResource(cm.PoolResource(pool))
        s = cm.Stream(0)
        buffer = resource.alloc(1 << 20, s)
        producer = cm.Stream(0)
        handle = producer.handle
        assert begin(handle, 2) == 0  # another library's capture, relaxed
        try:
            buffer.close(producer)
            print("closed")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), buffer.closed)
        buffer.close(producer)  # after the capture: ordered and freed
        print(buffer.closed)
        """.replace("SOURCE", source),
    )
    assert words == ["refused", "0", "False", "True"], "refused, the capture intact, the buffer still open"


def test_a_dlpack_export_to_a_capturing_consumer_is_refused_and_the_capture_left_intact(stand_in_libcuda):
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        buffer = pool.alloc(1 << 20, cm.Stream(0))
        consumer = cm.Stream(0)
        handle = consumer.handle
        assert begin(handle, 2) == 0
        try:
            buffer.__dlpack__(stream=handle)
            print("exported")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)))
        capsule = buffer.__dlpack__(stream=handle)  # after the capture: exported
        print("exported")
        """,
    )
    assert words == ["refused", "0", "exported"]


def test_torch_from_dlpack_under_a_graph_capture_leaves_the_capture_intact(gpu):
    # The consumer is PyTorch inside torch.cuda.graph: it passes its capturing stream.
    torch = library("torch")
    buffer = cm.MemPool(cm.Route.device(0)).alloc(1 << 20, cm.Stream(0))
    graph = torch.cuda.CUDAGraph()
    static = torch.zeros(16, device="cuda")
    refused = []
    with torch.cuda.graph(graph):
        static += 1
        try:
            torch.from_dlpack(buffer)
        except cm.StreamCapturingError:
            refused.append(True)
    assert refused == [True]
    graph.replay()  # the capture ended intact
    torch.cuda.synchronize()
    assert int(static.sum()) == 16


def test_cuda_core_deallocate_on_a_capturing_stream_keeps_the_buffer_for_a_later_one(stand_in_libcuda):
    # cuda.core's Buffer.close(stream) under a capture of `stream`: refused, and the memory
    # (which the graph's work uses) stays, to be freed by a later deallocate, not at once.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import sys, types
        core = types.ModuleType("cuda.core")
        class MemoryResource: pass
        class Buffer:
            @staticmethod
            def from_handle(ptr, size, mr): return (ptr, size)
        core.MemoryResource, core.Buffer = MemoryResource, Buffer
        sys.modules["cuda"] = types.ModuleType("cuda"); sys.modules["cuda.core"] = core
        import cumempool.cuda_core as cmcc
        pool = cm.MemPool(cm.Route.device(0))
        mr = cmcc.MemoryResource(pool)
        ptr, size = mr.allocate(4096, cm.Stream(0))
        producer = cm.Stream(0)
        handle = producer.handle
        assert begin(handle, 2) == 0
        try:
            mr.deallocate(ptr, size, producer)
        except cm.StreamCapturingError:
            print("refused")
        print(pool.used_mem_current)
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)))
        mr.deallocate(ptr, size, producer)
        print(pool.used_mem_current)
        """,
    )
    assert words == ["refused", "4096", "0", "0"], "refused, the memory kept, freed by the later deallocate"
