"""Streams as values a Python user expects: equality and hashing by the driver stream, close()
and `with`, and the current device as the default (as PyTorch, CuPy and cuda.core take it)."""

import ctypes

import pytest

import cumempool as cm
from conftest import libcuda


def test_streams_compare_by_the_stream_they_name(gpu):
    a, b = cm.Stream(0), cm.Stream(0)
    assert a == a and a != b
    again = cm.Stream.borrow(a.handle, 0)
    assert again == a and hash(again) == hash(a), "the same driver stream, another object"
    assert cm.Stream.legacy(0) == cm.Stream.borrow(0, 0)
    assert len({a, b, again}) == 2


def test_a_closed_stream_refuses_its_uses_and_its_buffers_still_free_on_it(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    with cm.Stream(0) as s:
        buffer = pool.alloc(1 << 20, s)
    assert s.closed
    with pytest.raises(cm.ClosedError):
        s.synchronize()
    with pytest.raises(cm.ClosedError):
        pool.alloc(64, s)
    buffer.fill(1)  # the buffer keeps the driver stream alive
    buffer.close()
    legacy = cm.Stream.legacy(0)
    legacy.close()  # a shared stream belongs to no one object: close does nothing
    assert not legacy.closed
    legacy.synchronize()


def test_the_default_device_is_the_current_one(gpu):
    cuda = libcuda()
    assert cm.Stream().device == cm.Device().ordinal
    count = cm.Device.count()
    if count < 2:
        return
    context = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 1) == 0
    previous = ctypes.c_void_p()
    cuda.cuCtxGetCurrent(ctypes.byref(previous))
    try:
        assert cuda.cuCtxSetCurrent(context) == 0
        assert cm.Device().ordinal == 1 and cm.Stream().device == 1
    finally:
        cuda.cuCtxSetCurrent(previous)
        cuda.cuDevicePrimaryCtxRelease(1)
