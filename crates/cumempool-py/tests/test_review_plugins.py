"""Adversarial review (issue 20): the allocator plug-ins. Each test names the defect it shows;
all fail before a fix."""

import subprocess
import sys
import threading

import pytest

import cumempool as cm
from conftest import library

TORCH_HOOKS = (
    "import ctypes, cumempool as cm, cumempool.torch as cmt\n"
    "lib = ctypes.CDLL(cm.native_library_path())\n"
    "lib.cumempool_torch_alloc.restype = ctypes.c_void_p\n"
    "lib.cumempool_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
    "lib.cumempool_torch_free.restype = None\n"
    "lib.cumempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
)


def test_review_an_out_of_memory_callback_that_stops_the_torch_plugin_deadlocks(gpu):
    # DEFECT (hang): plugins.rs cumempool_torch_alloc holds SERVED's read lock across
    # resource.allocate; an OnOutOfMemory callback that calls cumempool.torch.stop() or serve()
    # (torch_serve takes the write lock) deadlocks on the same thread. torch_serve also waits
    # for the write lock holding the GIL, so a callback on another thread (waiting for the GIL
    # while that thread holds the read lock) deadlocks the two threads the same way.
    # Fix: clone the Arc out of SERVED and drop the guard before allocating; detach in torch_serve.
    code = TORCH_HOOKS + (
        "pool = cm.MemPool(cm.Route.device(0))\n"
        "def on_oom(requested, attempt):\n"
        "    cmt.stop()\n"
        "    return False\n"
        "cmt.serve(cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 1 << 20), on_oom))\n"
        "s = cm.Stream(0)\n"
        "print(lib.cumempool_torch_alloc(2 << 20, 0, s.handle))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("cumempool_torch_alloc deadlocked when its out-of-memory callback called stop()")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_review_torch_hooks_key_streams_by_handle_across_devices(gpu):
    # DEFECT (wrong result, multi-GPU): plugins.rs stream_for keys STREAMS by the raw handle
    # only. PyTorch's default stream is handle 0 on every device, so once device 0 was served,
    # device 1's allocations and frees on handle 0 are ordered on device 0's legacy stream (its
    # context is made current), unordered with device 1's work. Key by (device, handle).
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


def test_review_cuda_core_deallocate_ignores_the_stream_it_is_given(gpu):
    # DEFECT (wrong result, a race): cuda_core.py deallocate(ptr, size, stream) ignores `stream`
    # and frees on the allocation stream, so work cuda.core's user queued on `stream` (what
    # Buffer.close(stream) promises to wait for) can still write the memory after the pool gave
    # it to the next allocation. Fix: make the allocation stream wait for `stream` (an event)
    # before the free, or free on `stream`.
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
