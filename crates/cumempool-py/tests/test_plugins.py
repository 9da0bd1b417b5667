"""The plug-ins against the real libraries (skipped where a library is missing)."""

import pathlib
import subprocess
import sys
import threading

import pytest

import cumempool as cm
from conftest import library, run_in_new_process


def test_torch_mem_pool_serves_tensors_and_reports_statistics(gpu):
    torch = library("torch")
    import cumempool.torch as cmt

    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    pool = cmt.mem_pool(cache)
    try:
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(1 << 18, device="cuda")
        assert cmt.statistics()["current_bytes"] >= 1 << 20
        assert float(x.sum()) == float(1 << 18)
        del x
        torch.cuda.synchronize()
    finally:
        del pool
        torch.cuda.empty_cache()
        cmt.stop()


def test_torch_use_mem_pool_serves_the_backward_pass_too(gpu):
    # torch.cuda.use_mem_pool serves the calling thread, and autograd runs a CUDA backward pass
    # on a thread of its own: the gradients came from PyTorch's native allocator. Under
    # cumempool.torch.use_mem_pool every byte PyTorch reserves for the step is the plug-in's.
    # Each scope in a process of its own, so nothing is reserved before the step.
    library("torch")
    code = """
import sys, threading, torch, cumempool as cm, cumempool.torch as cmt
mp = cmt.mem_pool(cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0), max_size=1 << 30))))
scope = cmt.use_mem_pool if sys.argv[1] == "cumempool" else torch.cuda.use_mem_pool
threads = set()
with scope(mp):
    w = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    loss = (w @ w).relu().sum()
    loss.grad_fn.register_hook(lambda *_: threads.add(threading.get_ident()))
    loss.backward()
    torch.cuda.synchronize()
    reserved, served = torch.cuda.memory_reserved(), cmt.statistics(mp)["current_bytes"]
print(threads == {threading.get_ident()}, reserved, served, torch._C._is_multithreading_enabled())
"""
    same_thread, reserved, served, restored = run_in_new_process(code, args=["cumempool"]).split()
    assert same_thread == "True", "the backward pass ran on another thread"
    assert int(served) >= 3 * (16 << 20) and int(reserved) == int(served), "PyTorch reserved memory the plug-in did not serve"
    assert restored == "True", "multithreaded backward was left off after the block"
    # Without it (why it exists): the backward pass ran on autograd's thread, outside the pool.
    same_thread, reserved, served, _ = run_in_new_process(code, args=["torch"]).split()
    assert same_thread == "False" and int(reserved) > int(served)


def test_torch_use_mem_pool_warm_ups_then_a_capture(gpu):
    # The recipe the docs give: warm up inside cumempool.torch.use_mem_pool (backward on this
    # thread), then capture with backward kept on this thread, whose cuBLAS handles the warm-ups
    # made; replays compute what the eager steps did. Its own process: a failed capture poisons
    # the context.
    library("torch")
    code = """
import torch, cumempool as cm, cumempool.torch as cmt
from torch.autograd.grad_mode import set_multithreading_enabled
mp = cmt.mem_pool(cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0), max_size=1 << 30))))
torch.manual_seed(0)
side = torch.cuda.Stream()
with cmt.use_mem_pool(mp):
    model = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    eager = model.weight.grad.clone()
model.zero_grad(set_to_none=True)
graph = torch.cuda.CUDAGraph()
with set_multithreading_enabled(False), torch.cuda.graph(graph, pool=mp.id):
    model(x).square().sum().backward()
graph.replay()
torch.cuda.synchronize()
print(torch.allclose(model.weight.grad, eager, rtol=1e-4, atol=1e-5))
"""
    assert run_in_new_process(code) == "True"


def test_torch_segments_made_in_a_capture_are_ordinary_memory_eager_tensors_can_use(gpu):
    # PyTorch keeps a segment the plug-in gives and may hand a block of it to an eager tensor
    # of the same pool after the capture: it must be the pool's ordinary memory, under its cap,
    # not graph memory, which belongs to the graph's launches and which no pool counts (before
    # the fix the segment was graph memory and the pool's counters missed it). Run in its own
    # process: a fault would poison the context.
    library("torch")
    code = """
import torch, cumempool as cm, cumempool.torch as cmt
pool = cm.MemPool(cm.Route.device(0), max_size=1 << 30)
mp = cmt.mem_pool(pool)
x = torch.ones(1 << 10, device="cuda")
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, pool=mp.id):
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a new segment, in the capture
    t.fill_(3)
    y = x * 2
    del t
counted = pool.used_mem_current >= 64 << 20  # ordinary memory: under the pool's cap
with torch.cuda.use_mem_pool(mp):
    z = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the block the capture freed
z.fill_(7)
torch.cuda.synchronize()
eager_ok = int(z[-1]) == 7 and int(z.sum(dtype=torch.int64)) == 7 * (64 << 20)
del z
graph.replay()
torch.cuda.synchronize()
print(counted, eager_ok, bool((y == 2).all()))
"""
    assert run_in_new_process(code).split() == ["True", "True", "True"]


def test_torch_a_segment_a_graph_used_goes_back_only_after_its_replays(gpu):
    # PyTorch frees a graph's segment on the stream it was allocated on, while a replay on
    # another stream may still write it: the plug-in waits for the device first, so memory the
    # pool hands out next is not written by the replay. Its own process: a replay may fault.
    library("torch")
    code = """
import torch, cumempool as cm, cumempool.torch as cmt
pool = cm.MemPool(cm.Route.device(0), max_size=1 << 30)
mp = cmt.mem_pool(pool)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, pool=mp.id):
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(300_000_000)  # long enough that the replay is still running below
    t.fill_(3)
address = t.data_ptr()
graph.replay()  # on the current stream, not the capture's
del t, graph, mp
torch.cuda.empty_cache()  # the segment goes back through the plug-in
stream = cm.Stream(0)
buffer = pool.alloc(64 << 20, stream)
buffer.fill(7)
stream.synchronize()
torch.cuda.synchronize()
data = buffer.to_bytes()
print(buffer.ptr == address, data.count(7) == len(data))
"""
    reused, intact = run_in_new_process(code).split()
    if reused != "True":
        pytest.skip("the pool handed out other memory: nothing to check")
    assert intact == "True", "a replay wrote memory the pool had handed out again"


def test_torch_and_cupy_read_buffers_through_dlpack_and_the_array_interface(gpu, stream):
    torch = library("torch")
    buffer = cm.MemPool(cm.Route.device(0)).alloc(16, stream)
    buffer.fill(4)
    t = torch.from_dlpack(buffer)
    assert t.dtype == torch.uint8 and t.device.type == "cuda" and int(t.sum()) == 64
    t[0] = 1
    assert buffer.to_bytes(1) == b"\x01"
    t2 = torch.as_tensor(buffer, device="cuda")
    assert int(t2[0]) == 1


@pytest.mark.parametrize("installed", ["object", "malloc"])
def test_cupy_allocator_on_the_current_stream(gpu, installed):
    # Installed as the object (called with an argument tuple) or as its `malloc` (without one).
    cupy = library("cupy")
    import cumempool.cupy as cmc

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    allocator = cmc.Allocator(stats)
    with cupy.cuda.using_allocator(allocator.malloc if installed == "malloc" else allocator):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = cupy.arange(1 << 16, dtype=cupy.float32)
            assert float(a.sum()) == float(sum(range(1 << 16)))
        assert stats.usage()["current_bytes"] >= 1 << 18
        del a
    s.synchronize()
    assert stats.usage()["current_bytes"] == 0
    b = cm.MemPool(cm.Route.device(0)).alloc(8)
    b.fill(2)
    assert int(cupy.from_dlpack(b).sum()) == 16
    assert int(cupy.asarray(b).sum()) == 16


def test_cupy_allocator_on_cupys_null_stream(gpu):
    # CuPy's null stream names its device -1 ("the current device"): the allocation goes to the
    # resource's device, on that device's legacy stream.
    cupy = library("cupy")
    import cumempool.cupy as cmc

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    assert cupy.cuda.get_current_stream().ptr == 0
    with cupy.cuda.using_allocator(cmc.Allocator(stats)):
        a = cupy.arange(1 << 16, dtype=cupy.float32)
        assert float(a.sum()) == float(sum(range(1 << 16)))
        assert stats.usage()["current_bytes"] >= 1 << 18
        del a
    cupy.cuda.Device(0).synchronize()
    assert stats.usage()["current_bytes"] == 0


def test_cupys_memory_object_shares_its_buffer_in_a_copy_refuses_pickling_and_goes_at_exit(gpu):
    # A copy of CuPy's memory object holds the same Buffer (the memory stays while either
    # lives); a deep copy or a pickle would need a second Buffer over the same memory, and is
    # refused. Arrays alive at exit are let go of as the interpreter tears CuPy down.
    library("cupy")
    code = """
import copy, gc, pickle
import cupy, cumempool as cm, cumempool.cupy as cmc
stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
cupy.cuda.set_allocator(cmc.Allocator(stats))
kept = cupy.arange(1 << 16, dtype=cupy.float32)
memory = cupy.arange(1 << 16, dtype=cupy.float32).data.mem
twin = copy.copy(memory)
for refused in (lambda: copy.deepcopy(memory), lambda: pickle.dumps(memory)):
    try:
        refused()
    except TypeError:
        print("refused")
del memory
gc.collect()
print(stats.usage()["current_bytes"] == 2 * (1 << 18))
del twin
gc.collect()
print(stats.usage()["current_bytes"] == 1 << 18)
"""
    assert run_in_new_process(code).split() == ["refused", "refused", "True", "True"]


def test_cuda_core_memory_resource(gpu):
    library("cuda.core")
    import cumempool.cuda_core as cmcc

    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    device = Device(0)
    device.set_current()
    stream = device.create_stream()
    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    mr = cmcc.MemoryResource(stats)
    buf = mr.allocate(1 << 20, stream=stream)
    assert int(buf.size) == 1 << 20 and stats.usage()["current_bytes"] == 1 << 20
    buf.close(stream)
    assert stats.usage()["current_bytes"] == 0
    assert mr.device_id == 0 and mr.is_device_accessible and not mr.is_host_accessible


def test_the_quick_start_runs(gpu):
    library("torch")
    library("cupy")
    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    out = run_in_new_process(example.read_text())
    assert out.endswith("done"), out


TORCH_HOOKS = (
    "import ctypes, cumempool as cm, cumempool.torch as cmt\n"
    "lib = ctypes.CDLL(cm.native_library_path())\n"
    "lib.cumempool_torch_alloc.restype = ctypes.c_void_p\n"
    "lib.cumempool_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
    "lib.cumempool_torch_free.restype = None\n"
    "lib.cumempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
)


def test_torch_hooks_key_streams_by_handle_and_device(gpu):
    # PyTorch's default stream is handle 0 on every device and means each device's own legacy
    # stream: the plug-in keys streams by (handle, device).
    if cm.Device.count() < 2:
        pytest.skip("needs two GPUs")
    code = TORCH_HOOKS + (
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "def make_current(ordinal):\n"
        "    dev, ctx = ctypes.c_int(), ctypes.c_void_p()\n"
        "    assert cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0\n"
        "    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0\n"
        "    assert cuda.cuCtxSetCurrent(ctx) == 0\n"
        "cmt.serve(cm.MemPool(cm.Route.device(0)))\n"
        "p = lib.cumempool_torch_alloc(1 << 20, 0, None); assert p\n"
        "lib.cumempool_torch_free(p, 1 << 20, 0, None)\n"
        "cmt.serve(cm.MemPool(cm.Route.device(1)))\n"
        "make_current(1)\n"
        "p = lib.cumempool_torch_alloc(1 << 20, 1, None); assert p\n"
        "d = ctypes.c_int(-1); cuda.cuCtxGetDevice(ctypes.byref(d))\n"
        "lib.cumempool_torch_free(p, 1 << 20, 1, None)\n"
        "print(d.value)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1", "device 1's legacy-stream allocation ran in device 0's context"


def test_cuda_core_deallocate_frees_on_the_stream_it_is_given(gpu):
    # deallocate(ptr, size, stream) frees on `stream`: work queued there before (what cuda.core's
    # Buffer.close(stream) promises to wait for) finishes before the memory is handed out again.
    library("cuda.core")
    cupy = library("cupy")
    import cumempool.cuda_core as cmcc

    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    device = Device(0)
    device.set_current()
    a = device.create_stream()
    b = cupy.cuda.Stream(non_blocking=True)

    class Lent:
        def __cuda_stream__(self):
            return (0, b.ptr)

    b_core = device.create_stream(Lent())
    pool = cm.MemPool(cm.Route.device(0))
    mr = cmcc.MemoryResource(pool)
    n = 1 << 20
    buf = mr.allocate(n, stream=a)
    ptr = int(buf.handle)
    gate = threading.Event()
    b.launch_host_func(lambda _: gate.wait(10), None)
    cupy.cuda.runtime.memsetAsync(ptr, 7, n, b.ptr)  # queued behind the gate on b
    try:
        mr.deallocate(ptr, n, stream=b_core)
        a_cm = cm.Stream.borrow(a)
        again = pool.alloc(n, a_cm)
        if again.ptr != ptr:
            pytest.skip("the pool did not hand the freed block out again on its stream")
        again.fill(1)
    finally:
        threading.Timer(0.3, gate.set).start()
    b.synchronize()
    assert again.to_bytes(16) == b"\x01" * 16, "b's memset landed in memory freed before it ran"


def _cupy_capture_setup():
    """CuPy, a pool, the plug-in over a cache of it, and a non-blocking CuPy stream to capture."""
    cupy = library("cupy")
    import cumempool.cupy as cmc

    pool = cm.MemPool(cm.Route.device(0))
    return cupy, pool, cmc.Allocator(cm.CachingResource(cm.PoolResource(pool))), cupy.cuda.Stream(non_blocking=True)


@pytest.mark.parametrize("global_mode", [False, True], ids=["relaxed", "global"])
def test_cupy_graph_capture_through_the_plug_in_replays_and_keeps_its_memory(gpu, global_mode):
    # A capture in global mode prohibits unsafe calls on this thread: the plug-in's side stream
    # (its allocation, a cache's bookkeeping, its synchronize) must not invalidate it.
    cupy, pool, allocator, s = _cupy_capture_setup()
    n = 1 << 16
    with cupy.cuda.using_allocator(allocator.malloc), s:  # installed as the docs say
        x = cupy.arange(n, dtype=cupy.float32)
        out = cupy.zeros((), dtype=cupy.float32)
        s.synchronize()
        used_before = pool.used_mem_current
        s.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal if global_mode else None)
        try:
            cupy.sum(x * 2 + 1, out=out)  # temporaries allocated and freed inside the capture
        finally:
            graph = s.end_capture()  # ended even on a failure, or every later test would fail
        assert allocator.captured_bytes >= 2 * 4 * n, "the temporaries are kept for the graph"
        assert pool.used_mem_current >= used_before + allocator.captured_bytes, "counted against the pool"
        graph.launch(s)
        s.synchronize()
        assert float(out) == float(2 * (n * (n - 1) // 2) + n)
        # Eager temporaries now never get the graph's blocks.
        kept = {b.ptr for b, _ in allocator._captured}
        eager = [cupy.empty(4 * n, dtype=cupy.uint8) for _ in range(8)]
        assert not kept & {e.data.ptr for e in eager}
        x.fill(1)
        graph.launch(s)
        s.synchronize()
        assert float(out) == float(3 * n), "the replay reads the new input"
        del graph, eager
    allocator.release_captured()
    assert allocator.captured_bytes == 0


def test_cupy_release_captured_keeps_an_array_the_capture_made(gpu):
    # `y` is made inside the capture and kept: releasing the graphs' memory must leave its
    # memory to it, and no eager allocation may get it while it lives.
    cupy, pool, allocator, s = _cupy_capture_setup()
    n = 1 << 16
    with cupy.cuda.using_allocator(allocator), s:
        x = cupy.arange(n, dtype=cupy.float32)
        s.begin_capture()
        try:
            y = x * 2
        finally:
            graph = s.end_capture()
        graph.launch(s)
        del graph
        allocator.release_captured()
        assert y.data.ptr in {b.ptr for b, _ in allocator._captured}, "y's memory is still kept"
        eager = [cupy.full(n, 7, dtype=cupy.float32) for _ in range(8)]
        assert y.data.ptr not in {e.data.ptr for e in eager}
        assert float(y.sum()) == float(n * (n - 1))
        del y, eager
    allocator.release_captured()
    assert allocator.captured_bytes == 0


def test_a_cache_keeps_its_legacy_stream_block_while_a_cupy_stream_captures(gpu):
    # The host tests of the stand-in driver (test_torch_plugin_frees_host.py,
    # test_per_thread_stream.py) with the real driver and CuPy: a block cached on the legacy
    # stream while CuPy captures on a blocking stream of its own. An allocation that needs
    # that block's room is refused (freeing it on the legacy stream would invalidate CuPy's
    # capture), the capture ends intact, and the room is made once it is over; a cache let go
    # of during a capture keeps such a block allocated, and the capture ends intact too.
    library("cupy")
    code = """
import cupy, cumempool as cm
MIB = 1 << 20
pool = cm.MemPool(cm.Route.device(0))
cache = cm.CachingResource(cm.Limit(cm.PoolResource(pool), 64 * MIB))
cache.alloc(40 * MIB, None).close()  # cached on the legacy stream
cached = cache.stats()["cached_blocks"]
stream = cupy.cuda.Stream()  # a blocking stream
x = cupy.zeros(16, dtype=cupy.float32)
stream.synchronize()
side = cm.Stream(0)
stream.begin_capture()
with stream:
    x += 1  # in place: nothing allocated during the capture
try:
    cache.alloc(48 * MIB, side).close()
    refused = "served"
except cm.OutOfMemoryError:
    refused = "refused"
graph = stream.end_capture()  # raises where the capture was invalidated
cupy.cuda.runtime.deviceSynchronize()
cache.alloc(48 * MIB, side).close()  # the block's room, once the capture is over
side.synchronize()
cache.alloc(8 * MIB, None).close()  # cached on the legacy stream again
stream.begin_capture()
with stream:
    x += 1
del cache  # let go of during the capture: the legacy block stays allocated, the side one goes
graph = stream.end_capture()
side.synchronize()
cupy.cuda.runtime.deviceSynchronize()
print(cached, refused, pool.used_mem_current == 8 * MIB)
"""
    assert run_in_new_process(code).split()[-3:] == ["1", "refused", "True"]
