"""Routing alone (no plug-in): a 256 MiB capped pool made current for device 0 serves PyTorch
(cudaMallocAsync backend), CuPy's MemoryAsyncPool("current") and cuda.core's
DeviceMemoryResource(0), each filling it and then raising its own out-of-memory error."""

import os
import subprocess
import sys
import textwrap

import pytest

import cumempool as cm
from conftest import library

CAP = 256 << 20
CHUNK = 16 << 20


def test_torch_with_the_cuda_malloc_async_backend(gpu):
    library("torch")
    code = textwrap.dedent(
        f"""
        import cumempool as cm, torch
        pool = cm.MemPool(cm.Route.device(0), max_size={CAP})
        with cm.set_current_pool(cm.Route.device(0), pool):
            kept = []
            try:
                while True:
                    kept.append(torch.empty({CHUNK}, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                pass
            print(len(kept), pool.used_mem_current)
        """
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, used = map(int, out.stdout.split())
    assert count == CAP // CHUNK and used == CAP


def test_cupy_memory_async_pool_current(gpu, routing):
    cupy = library("cupy")
    pool = cm.MemPool(cm.Route.device(0), max_size=CAP)
    with cm.set_current_pool(cm.Route.device(0), pool):
        with cupy.cuda.using_allocator(cupy.cuda.MemoryAsyncPool("current").malloc):
            kept = []
            with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
                while True:
                    kept.append(cupy.empty(CHUNK, dtype=cupy.uint8))
            assert len(kept) == CAP // CHUNK and pool.used_mem_current == CAP
            del kept
        cupy.cuda.get_current_stream().synchronize()


def test_cuda_core_device_memory_resource(gpu, routing):
    library("cuda.core")
    try:
        from cuda.core import Device, DeviceMemoryResource
    except ImportError:
        from cuda.core.experimental import Device, DeviceMemoryResource
    device = Device(0)
    device.set_current()
    stream = device.create_stream()
    pool = cm.MemPool(cm.Route.device(0), max_size=CAP)
    with cm.set_current_pool(cm.Route.device(0), pool):
        mr = DeviceMemoryResource(0)
        kept = []
        with pytest.raises(Exception, match="(?i)out.of.memory|OUT_OF_MEMORY"):
            while True:
                kept.append(mr.allocate(CHUNK, stream=stream))
        assert len(kept) == CAP // CHUNK and pool.used_mem_current == CAP
        for buf in kept:
            buf.close(stream)
        stream.sync()
