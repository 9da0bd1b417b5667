"""The plug-ins against the real libraries (skipped where a library is missing)."""

import pathlib

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


def test_cupy_allocator_on_the_current_stream(gpu):
    cupy = library("cupy")
    import cumempool.cupy as cmc

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    with cupy.cuda.using_allocator(cmc.Allocator(stats)):
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
