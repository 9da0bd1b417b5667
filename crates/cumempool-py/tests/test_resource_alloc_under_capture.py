"""A resource's alloc on a stream another library captures into a CUDA graph."""

import ctypes

import pytest

import cumempool as cm


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        pytest.skip(f"no libcuda: {error}")


def test_a_resource_alloc_on_a_capturing_stream_is_refused(gpu, stream):
    # What alloc allocates on a capturing stream is the graph's memory (an allocation node): a
    # Buffer holding it would be freed outside the graph, refused before a launch (each launch
    # then allocating memory nothing frees) or unordered after one.
    cuda = _libcuda()
    begin, end = cuda.cuStreamBeginCapture_v2, cuda.cuStreamEndCapture
    begin.argtypes = [ctypes.c_void_p, ctypes.c_int]
    end.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    cuda.cuGraphDestroy.argtypes = [ctypes.c_void_p]
    pool = cm.MemPool(cm.Route.device(0))
    cache = cm.CachingResource(cm.PoolResource(pool))
    handle = stream.handle
    assert begin(handle, 2) == 0  # relaxed, as another library's capture
    try:
        for resource in (cache, cm.PoolResource(pool)):
            with pytest.raises(cm.StreamCapturingError):
                resource.alloc(4096, handle)  # the lender's handle, as torch or CuPy pass it
    finally:
        graph = ctypes.c_void_p()
        ended = end(handle, ctypes.byref(graph))
        if graph.value:
            cuda.cuGraphDestroy(graph)
    assert ended == 0, "the refusal left the capture intact"
    assert pool.used_mem_current == 0
    cache.alloc(4096, stream).close()
