"""Pools, routing and buffers on the GPU."""

import gc

import pytest

import cumempool as cm
from conftest import run_in_new_process


def test_a_capped_pool_raises_out_of_memory_as_memory_error(gpu, stream):
    with cm.MemPool(cm.Route.device(0), max_size=32 << 20) as pool:
        kept = [pool.alloc(8 << 20, stream) for _ in range(4)]
        with pytest.raises(MemoryError) as caught:
            pool.alloc(8 << 20, stream)
        assert isinstance(caught.value, cm.OutOfMemoryError)
        assert caught.value.code == 2 and caught.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        assert pool.used_mem_current >= 32 << 20
        del kept


def test_attributes_read_and_write(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    pool.release_threshold = 1 << 20
    assert pool.release_threshold == 1 << 20
    pool.reuse_allow_opportunistic = False
    assert pool.reuse_allow_opportunistic is False
    assert pool.reserved_mem_current >= 0
    assert isinstance(pool.handle, int) and pool.handle != 0
    assert "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD" in dict(pool.attributes())
    pool.trim_to(0)
    assert pool.access(gpu) == cm.Access.READ_WRITE


def test_13_2_attributes_raise_too_old_on_an_older_driver(gpu):
    pool = cm.MemPool(cm.Route.device(0), max_size=64 << 20)
    if cm.driver_version() >= (13, 2):
        assert pool.max_pool_size == 64 << 20
        assert pool.location == cm.Location.device(0)
    else:
        with pytest.raises(cm.DriverTooOldError, match="13.2"):
            pool.max_pool_size
        with pytest.raises(cm.DriverTooOldError):
            pool.location


def test_set_current_pool_as_context_manager_and_guard(gpu, routing):
    route = cm.Route.device(0)
    pool = cm.MemPool(route)
    assert cm.is_default(route)
    with cm.set_current_pool(route, pool):
        assert cm.current_pool_handle(route) == pool.handle
        assert not cm.is_default(route)
        inner = cm.MemPool(route)
        guard = cm.set_current_pool(route, inner)
        assert cm.current_pool_handle(route) == inner.handle
        guard.restore()
        assert cm.current_pool_handle(route) == pool.handle
    assert cm.is_default(route)
    cm.set_current_pool(route, pool).keep()
    assert cm.current_pool_handle(route) == pool.handle
    cm.reset_current_pool(route)
    assert cm.current_pool_handle(route) == cm.default_pool(route).handle


def test_a_pool_of_another_route_is_refused(gpu, routing):
    with pytest.raises(cm.PoolRouteMismatchError):
        cm.set_current_pool(cm.Route.host(), cm.MemPool(cm.Route.device(0)))


def test_use_after_close_raises_closed_error(gpu, stream):
    pool = cm.MemPool(cm.Route.device(0))
    buffer = pool.alloc(4096, stream)
    pool.close()
    pool.close()
    with pytest.raises(cm.ClosedError):
        pool.alloc(1, stream)
    assert buffer.to_bytes(4) is not None  # the buffer keeps the pool alive
    buffer.close()
    with pytest.raises(cm.ClosedError):
        buffer.ptr


def test_bad_sizes_and_streams(gpu, stream):
    pool = cm.MemPool(cm.Route.device(0))
    with pytest.raises(OverflowError):
        pool.alloc(-1, stream)
    with pytest.raises(OverflowError):
        pool.alloc(1 << 70, stream)
    with pytest.raises(cm.OutOfMemoryError):
        pool.alloc(1 << 60, stream)
    with pytest.raises(TypeError):
        pool.alloc(16, "stream")
    pool.alloc(16, 2).close()  # the per-thread default stream's handle: served (test_per_thread_stream.py)


def test_buffers_copy_fill_and_read_back(gpu, stream):
    pool = cm.MemPool(cm.Route.device(0))
    a = pool.alloc(8, stream)
    a.copy_from(b"abcdefgh")
    assert a.to_bytes() == b"abcdefgh"
    a.copy_from(bytearray(b"XY"))
    assert a.to_bytes(3) == b"XYc"
    b = pool.alloc(8, cm.Stream(0))
    b.copy_from_buffer(a)
    assert b.to_bytes() == b"XYcdefgh"
    b.fill(7)
    assert b.to_bytes() == bytes([7] * 8)
    with pytest.raises(cm.DoesNotFitError):
        a.copy_from(b"0123456789")


def test_cuda_array_interface_and_dlpack_device(gpu, stream):
    buffer = cm.MemPool(cm.Route.device(0)).alloc(1024, stream)
    cai = buffer.__cuda_array_interface__
    assert cai["shape"] == (1024,) and cai["typestr"] == "|u1" and cai["version"] == 3
    assert cai["data"] == (buffer.ptr, False) and cai["stream"] == stream.handle
    assert buffer.__dlpack_device__() == (2, 0)
    assert type(buffer.__dlpack__(max_version=(1, 0))).__name__ == "PyCapsule"
    with pytest.raises(AttributeError):
        buffer.__array_interface__
    legacy = cm.MemPool(cm.Route.device(0)).alloc(16)
    assert legacy.__cuda_array_interface__["stream"] == 1


def test_numpy_reads_host_pool_memory_without_a_copy(gpu, stream):
    np = pytest.importorskip("numpy")
    buffer = cm.MemPool(cm.Route.host()).alloc(16, stream)
    buffer.fill(3)
    stream.synchronize()
    array = np.asarray(buffer)
    assert array.dtype == np.uint8 and array.tolist() == [3] * 16
    array[0] = 9
    assert buffer.to_bytes(1) == b"\x09"
    assert buffer.__dlpack_device__() == (3, 0)
    if hasattr(np, "from_dlpack"):
        assert np.from_dlpack(buffer)[0] == 9


def test_a_dlpack_capsule_outlives_its_buffer(gpu, stream):
    np = pytest.importorskip("numpy")
    buffer = cm.MemPool(cm.Route.host()).alloc(8, stream)
    buffer.fill(5)
    stream.synchronize()
    array = np.from_dlpack(buffer)
    buffer.close()
    del buffer
    gc.collect()
    assert array.tolist() == [5] * 8


def test_a_buffer_alive_at_exit_does_not_crash_the_interpreter(gpu):
    code = (
        "import cumempool as cm, numpy as np\n"
        "pool = cm.MemPool(cm.Route.host())\n"
        "s = cm.Stream(0)\n"
        "b = pool.alloc(64, s)\n"
        "keep = np.from_dlpack(b)\n"
        "cap = pool.alloc(64, s).__dlpack__()\n"
        "import builtins; builtins.leaked = (b, keep, cap, s)\n"
        "print('done')\n"
    )
    assert run_in_new_process(code) == "done"


def test_streams_of_any_kind(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    own = cm.Stream(0)

    class Foreign:
        def __cuda_stream__(self):
            return (0, own.handle)

    buffer = pool.alloc(64, Foreign())
    assert buffer.stream.handle == own.handle and buffer.stream.owner is not None
    assert pool.alloc(64, own.handle).stream.handle == own.handle
    assert pool.alloc(64, cm.Stream.borrow(own)).stream.handle == own.handle
