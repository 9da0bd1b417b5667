"""Adversarial review (issue 20): buffers, DLPack arguments, streams and contexts. Each test
names the defect it shows; all fail before a fix."""

import ctypes
import threading

import pytest

import cumempool as cm
from conftest import library


def test_review_copy_from_an_int_writes_zero_bytes(gpu, stream):
    # DEFECT (wrong result): buffers.rs copy_from turns any non-bytes argument into bytes with
    # bytes(data), and bytes(3) is three zero bytes: copy_from(3) overwrites the buffer's start
    # instead of raising TypeError (and copy_from(1 << 40) tries to build a 1 TiB object).
    # Fix: accept bytes and buffer-protocol objects only (PyBuffer / memoryview(data)).
    buffer = cm.MemPool(cm.Route.device(0)).alloc(8, stream)
    buffer.copy_from(b"abcdefgh")
    with pytest.raises(TypeError):
        buffer.copy_from(3)
    assert buffer.to_bytes() == b"abcdefgh"


def test_review_dlpack_refuses_stream_zero(gpu, stream):
    # DEFECT (poor error): DLPack forbids stream=0 on CUDA (it could mean None, 1 or 2);
    # buffers.rs __dlpack__ / order_before take it as the legacy stream. Raise ValueError.
    buffer = cm.MemPool(cm.Route.device(0)).alloc(16, stream)
    with pytest.raises(ValueError):
        buffer.__dlpack__(stream=0)


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        pytest.skip(f"no libcuda: {error}")


def test_review_copies_leave_the_buffers_context_current(gpu, stream):
    # DEFECT (wrong result for the caller's next CUDA call): buffers.rs Core::copy (to_bytes,
    # copy_from, copy_from_buffer) makes the buffer's primary context current on the calling
    # thread and leaves it there, replacing whatever the caller had current (a context of its
    # own, or another device's: CuPy and the runtime then work on the wrong device). Fix: bind
    # for the call and restore the previous context (as cumempool's context-preserving drops do).
    cuda = _libcuda()
    create = getattr(cuda, "cuCtxCreate_v2", None)
    if create is None:
        pytest.skip("libcuda lacks cuCtxCreate_v2")
    buffer = cm.MemPool(cm.Route.device(0)).alloc(64, stream)
    device, mine, current = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert create(ctypes.byref(mine), 0, device) == 0  # made current on this thread
    try:
        buffer.copy_from(b"x" * 64)
        assert cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
        assert current.value == mine.value, "copy_from left another context current"
        assert buffer.to_bytes(1) == b"x"
        assert cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
        assert current.value == mine.value, "to_bytes left another context current"
    finally:
        cuda.cuCtxDestroy_v2(mine)


def _two_devices():
    if cm.Device.count() < 2:
        pytest.skip("needs two GPUs")


def test_review_a_buffer_reports_the_device_of_its_memory(gpu):
    # DEFECT (wrong result, multi-GPU): pools.rs MemPool.alloc and resources.rs alloc set the
    # buffer's device to the *stream's* device; a device-0 pool's memory allocated on a device-1
    # stream (which the driver allows) is exported as (kDLCUDA, 1), so torch/CuPy make a cuda:1
    # tensor over device-0 memory. Take the device from the pool's route (or cuPointerGetAttribute).
    _two_devices()
    if not cm.Device(1).can_access_peer(cm.Device(0)):
        pytest.skip("device 1 cannot access device 0's memory")
    pool = cm.MemPool(cm.Route.device(0))
    pool.set_access(cm.Device(1), cm.Access.READ_WRITE)
    buffer = pool.alloc(256, cm.Stream(1))
    assert buffer.device == 0 and buffer.__dlpack_device__() == (2, 0)


def test_review_legacy_streams_of_two_devices_are_not_one_stream(gpu):
    # DEFECT (wrong result, a race, multi-GPU): buffers.rs order_before compares raw handles, so
    # the legacy streams of devices 0 and 1 (both handle 0) count as the same stream and
    # copy_from_buffer between them is not ordered after the source's work; `0 | 1` also names
    # the producer's device's legacy stream, not the consumer's. Compare contexts too.
    _two_devices()
    cupy = library("cupy")
    src = cm.MemPool(cm.Route.device(0)).alloc(1 << 20)  # device 0's legacy stream
    dst = cm.MemPool(cm.Route.device(1)).alloc(1 << 20)  # device 1's legacy stream
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
