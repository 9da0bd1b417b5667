"""Buffers: their arguments, DLPack streams, the devices and contexts their calls use, and the
order of their frees."""

import ctypes
import threading

import pytest

import cumempool as cm
from conftest import libcuda, library


def test_copy_from_refuses_what_is_not_bytes_like(gpu, stream):
    # bytes(3) is three zero bytes: an int must raise, not overwrite the buffer's start.
    buffer = cm.MemPool(cm.Route.device(0)).alloc(8, stream)
    buffer.copy_from(b"abcdefgh")
    with pytest.raises(TypeError):
        buffer.copy_from(3)
    with pytest.raises(TypeError):
        buffer.copy_from("text")
    assert buffer.to_bytes() == b"abcdefgh"
    buffer.copy_from(memoryview(b"XY"))
    assert buffer.to_bytes(3) == b"XYc"


def test_a_buffer_copied_into_itself_is_refused_before_the_driver(gpu, stream):
    # cuMemcpyAsync is undefined for overlapping ranges: the copy is refused, the bytes untouched.
    buffer = cm.MemPool(cm.Route.device(0)).alloc(64, stream)
    buffer.copy_from(b"a" * 64)
    with pytest.raises(cm.OverlappingCopyError, match="overlap") as caught:
        buffer.copy_from_buffer(buffer)
    assert isinstance(caught.value, ValueError)
    assert buffer.to_bytes() == b"a" * 64
    other = cm.MemPool(cm.Route.device(0)).alloc(64, stream)
    other.copy_from_buffer(buffer)  # separate buffers still copy
    assert other.to_bytes() == b"a" * 64


def test_dlpack_refuses_stream_zero(gpu, stream):
    # DLPack forbids stream=0 for CUDA memory (it could mean None, 1 or 2).
    buffer = cm.MemPool(cm.Route.device(0)).alloc(16, stream)
    with pytest.raises(ValueError):
        buffer.__dlpack__(stream=0)
    with pytest.raises(ValueError):
        buffer.__dlpack__(stream=-2)
    other = cm.Stream(0)
    for accepted in (None, -1, 1, 2, stream.handle, other.handle):
        assert type(buffer.__dlpack__(stream=accepted)).__name__ == "PyCapsule"


def test_calls_put_back_the_callers_context(gpu, stream):
    # The caller's current context (its own, or another device's) is what CuPy and the runtime
    # work on next: a copy, or work on a legacy stream, makes the buffer's current only while it
    # runs.
    cuda = libcuda()
    create = getattr(cuda, "cuCtxCreate_v2", None)
    if create is None:
        pytest.skip("libcuda lacks cuCtxCreate_v2")
    pool = cm.MemPool(cm.Route.device(0))
    resource = cm.PoolResource(pool)
    buffer = pool.alloc(64, stream)
    legacy = pool.alloc(64)
    device, mine, current = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert create(ctypes.byref(mine), 0, device) == 0  # made current on this thread
    try:
        for step, call in [
            ("copy_from", lambda: buffer.copy_from(b"x" * 64)),
            ("to_bytes", lambda: buffer.to_bytes(1)),
            ("fill", lambda: legacy.fill(1)),
            ("copy_from_buffer", lambda: legacy.copy_from_buffer(buffer)),
            ("__dlpack__", lambda: buffer.__dlpack__(stream=1)),
            ("alloc on the legacy stream", lambda: pool.alloc(16).close()),
            ("a resource's alloc on the legacy stream", lambda: resource.alloc(16).close()),
            ("synchronize on the legacy stream", lambda: cm.Stream.legacy(0).synchronize()),
        ]:
            call()
            assert cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
            assert current.value == mine.value, f"{step} left another context current"
        assert legacy.to_bytes(1) == b"x"
    finally:
        cuda.cuCtxDestroy_v2(mine)


def test_close_with_a_stream_frees_only_after_that_streams_work(gpu):
    # Buffer.close(stream): work queued on `stream` before the close must finish before the
    # memory is handed out again (what cuda.core's deallocate(ptr, size, stream) asks).
    cuda = libcuda()
    pool = cm.MemPool(cm.Route.device(0))
    mine, other = cm.Stream(0), cm.Stream(0)
    n = 1 << 20
    buffer = pool.alloc(n, mine)
    ptr = buffer.ptr
    gate = threading.Event()
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: gate.wait(10))
    launch = cuda.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    assert launch(other.handle, ctypes.cast(callback, ctypes.c_void_p), None) == 0
    memset = cuda.cuMemsetD8Async
    memset.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    assert memset(ptr, 7, n, other.handle) == 0  # queued behind the gate on `other`
    try:
        buffer.close(other)
        assert buffer.closed
        again = pool.alloc(n, mine)
        if again.ptr != ptr:
            pytest.skip("the pool did not hand the freed block out again on its stream")
        again.fill(1)
    finally:
        threading.Timer(0.3, gate.set).start()
    other.synchronize()
    assert again.to_bytes(16) == b"\x01" * 16, "the memset on `other` landed in memory freed before it ran"
    buffer.close(other)  # closing again does nothing


def _two_devices():
    if cm.Device.count() < 2:
        pytest.skip("needs two GPUs")


def test_a_buffer_reports_the_device_of_its_memory(gpu):
    # A device-0 pool's memory allocated on a device-1 stream is device 0's memory: DLPack and
    # the array interface must say device 0, or torch and CuPy make cuda:1 arrays over it.
    _two_devices()
    if not cm.Device(1).can_access_peer(cm.Device(0)):
        pytest.skip("device 1 cannot access device 0's memory")
    pool = cm.MemPool(cm.Route.device(0))
    pool.set_access(cm.Device(1), cm.Access.READ_WRITE)
    buffer = pool.alloc(256, cm.Stream(1))
    assert buffer.device == 0 and buffer.__dlpack_device__() == (2, 0)
    resource = cm.PoolResource(pool)
    buffer = resource.alloc(256, cm.Stream(1))
    assert buffer.device == 0 and buffer.__dlpack_device__() == (2, 0)


def test_legacy_streams_of_two_devices_are_two_streams(gpu):
    # The legacy streams of devices 0 and 1 are both handle 0, yet two streams: a copy between
    # buffers on them is ordered after the source's work.
    _two_devices()
    cupy = library("cupy")
    src = cm.MemPool(cm.Route.device(0)).alloc(1 << 20)  # device 0's legacy stream
    dst = cm.MemPool(cm.Route.device(1)).alloc(1 << 20)  # device 1's legacy stream
    assert src.stream is not dst.stream
    src.fill(0)
    dst.fill(0)
    src.stream.synchronize()
    gate = threading.Event()
    with cupy.cuda.Device(0):
        cupy.cuda.Stream.null.launch_host_func(lambda _: gate.wait(10), None)
    src.fill(7)  # queued behind the gate on device 0's legacy stream
    threading.Timer(0.3, gate.set).start()
    dst.copy_from_buffer(src)
    assert dst.to_bytes(16) == b"\x07" * 16, "the copy ran before the source's fill"


def test_legacy_handles_of_another_library_are_the_devices_legacy_stream(gpu):
    # 0 and CU_STREAM_LEGACY (1) name the legacy stream of whichever context is current: as a
    # stream argument they are the device's one legacy Stream, not a borrowed handle.
    pool = cm.MemPool(cm.Route.device(0))

    class Legacy:
        def __cuda_stream__(self):
            return (0, 1)

    a, b, c = pool.alloc(16), pool.alloc(16, 0), pool.alloc(16, Legacy())
    assert a.stream is b.stream is c.stream is cm.Stream.legacy(0) is cm.Stream.borrow(1, device=0)
