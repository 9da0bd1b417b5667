"""The per-thread default stream (handle 2: CuPy's `Stream.ptds`, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM,
cuda.core's CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM) is served as the device's legacy stream,
which is ordered with every thread's per-thread stream both ways, so memory allocated on one
thread's may be freed from any thread."""

import ctypes
import os
import subprocess
import sys
import threading

import pytest

import cumempool as cm
from conftest import library
from test_resource_alloc_under_capture import capture_functions, run_on_stand_in


def test_the_per_thread_stream_is_served_as_one_object_per_device(stand_in_libcuda):
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import threading, types
        pool = cm.MemPool(cm.Route.device(0))
        cache = cm.CachingResource(cm.PoolResource(pool))
        ptds = types.SimpleNamespace(ptr=2, device_id=0)  # what CuPy's Stream.ptds names
        per_thread = cm.Stream.borrow(2, device=0)
        print(cm.Stream.borrow(2).handle, per_thread is cm.Stream.borrow(2), per_thread != cm.Stream.legacy(0))
        buffers = [pool.alloc(64, 2), cache.alloc(64, ptds), pool.alloc(64, ptds)]
        print(all(b.stream is per_thread for b in buffers))
        # Freed from another thread: on the legacy stream, ordered after every thread's work.
        closed = []
        freer = threading.Thread(target=lambda: closed.extend(b.close() or b for b in buffers))
        freer.start(); freer.join()
        print(len(closed) == 3)
        """,
    )
    assert words == ["2", "True", "True", "True", "True"], "handle 2 was refused or not served as one stream"


def refused_while_the_per_thread_stream_captures(refused) -> None:
    """Begins a relaxed capture on this thread's per-thread stream, checks that `refused()`
    raises StreamCapturingError, and that the capture was left intact (it ends with a graph)."""
    cuda, begin, end = capture_functions()
    cm.Stream.legacy(0).synchronize()  # the primary context is current for the capture below
    assert begin(2, 2) == 0  # relaxed, on this thread's per-thread stream
    try:
        with pytest.raises(cm.StreamCapturingError):
            refused()
    finally:
        graph = ctypes.c_void_p()
        ended = end(2, ctypes.byref(graph))
        if graph.value:
            cuda.cuGraphDestroy(graph)
    assert ended == 0, "the refusal left the capture intact"


def test_a_capture_on_the_per_thread_stream_is_refused_and_left_intact(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    pool.alloc(64, 2).close()
    refused_while_the_per_thread_stream_captures(lambda: pool.alloc(64, 2))


def test_a_dlpack_export_to_a_capturing_per_thread_stream_is_refused_and_leaves_it_intact(gpu):
    buffer = cm.MemPool(cm.Route.device(0)).alloc(64, cm.Stream(0))
    # The consumer would record work on the memory into its graph, which outlives the buffer.
    refused_while_the_per_thread_stream_captures(lambda: buffer.__dlpack__(stream=2))
    buffer.__dlpack__(stream=2)  # no capture: exported after a wait


def test_cupy_allocates_on_its_per_thread_stream(gpu):
    cupy = library("cupy")
    import cumempool.cupy as cmc

    pool = cm.MemPool(cm.Route.device(0))
    with cupy.cuda.Stream.ptds, cupy.cuda.using_allocator(cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))):
        x = cupy.arange(1 << 16, dtype=cupy.float32)
        assert float(x.sum()) == float(sum(range(1 << 16)))
        # Freed from another thread than the one whose per-thread stream it was made on.
        holder = [x]
        del x
        freer = threading.Thread(target=holder.clear)
        freer.start()
        freer.join()
    cupy.cuda.Stream.ptds.synchronize()


@pytest.mark.parametrize(
    "variable, code",
    [
        (
            "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM",
            "import cupy, cumempool as cm, cumempool.cupy as cmc\n"
            "cupy.cuda.set_allocator(cmc.Allocator(cm.MemPool(cm.Route.device(0))))\n"
            "print(int(cupy.arange(100).sum()))",
        ),
        (
            "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM",
            "import cuda.core as cc, cumempool as cm, cumempool.cuda_core as cmcc\n"
            "dev = cc.Device(0); dev.set_current()\n"
            "mr = cmcc.MemoryResource(cm.MemPool(cm.Route.device(0)))\n"
            "b = mr.allocate(4950, stream=dev.default_stream); b.close(); print(4950)",
        ),
    ],
)
def test_a_library_under_its_per_thread_default_stream_allocates(gpu, variable, code):
    library("cupy" if variable.startswith("CUPY") else "cuda.core")
    env = dict(os.environ, **{variable: "1"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4950"]


DROP_DURING_CAPTURE = """
import gc
pool = cm.MemPool(cm.Route.device(0))
cache = cm.CachingResource(cm.PoolResource(pool))
cache.alloc(1 << 20, None).close()  # the legacy stream: cached there
print(cache.stats()["cached_blocks"])
assert begin(2, 2) == 0  # this thread's per-thread stream (blocking) captures, relaxed mode
cache.release()  # the fix: skipped while the capture is underway
print(cache.stats()["cached_blocks"])
del cache  # the program lets go of the cache (or the collector does) during the capture
gc.collect()
graph = ctypes.c_void_p()
print(end(2, ctypes.byref(graph)), pool.used_mem_current)
"""


def test_dropping_a_cache_during_a_blocking_capture_leaves_the_capture_intact(stand_in_libcuda):
    # A cache let go of (by the program or the collector) while a blocking stream captures
    # keeps its legacy-stream blocks allocated: freed there, the driver would refuse them and
    # invalidate the capture (the stand-in models driver 580).
    words = run_on_stand_in(stand_in_libcuda, DROP_DURING_CAPTURE)
    assert words[:2] == ["1", "1"], "precondition: cached on the legacy stream, kept by release()"
    assert words[2] == "0", f"the cache's drop invalidated the capture (cuStreamEndCapture answered {words[2]})"
