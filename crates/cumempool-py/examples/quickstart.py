"""cumempool quick start for PyTorch and CuPy users: one capped pool serves both libraries,
buffers pass between them without a copy, and the pool's counters see it all.

    python3 crates/cumempool-py/examples/quickstart.py     (needs a GPU, torch and cupy)
"""

import cupy
import torch

import cumempool as cm
import cumempool.cupy as cmc
import cumempool.torch as cmt

route = cm.Route.device(0)
pool = cm.MemPool(route, max_size=1 << 30)  # at most 1 GiB from device 0
cache = cm.CachingResource(cm.PoolResource(pool))  # freed blocks come back without the driver

# PyTorch: tensors made inside use_mem_pool come from the cache (so from the pool).
torch_pool = cmt.mem_pool(cache)
with torch.cuda.use_mem_pool(torch_pool):
    x = torch.ones(1 << 20, device="cuda")
print("PyTorch holds", cmt.statistics()["current_bytes"], "bytes of the pool")

# CuPy: allocations go to the cache on CuPy's current stream.
with cupy.cuda.using_allocator(cmc.Allocator(cache).malloc):
    y = cupy.arange(1 << 20, dtype=cupy.float32)
    print("CuPy sum", float(y.sum()))

# A buffer of your own on PyTorch's current stream, read by both without a copy (DLPack).
buffer = pool.alloc(16, torch.cuda.current_stream())
buffer.fill(7)
t = torch.from_dlpack(buffer)  # a uint8 tensor over the buffer's memory
c = cupy.from_dlpack(buffer)
assert int(t.sum()) == int(c.sum()) == 7 * 16

# No plug-in at all: while the pool is current for device 0, libraries that allocate with
# cudaMallocAsync from the current pool draw from it (PyTorch does too when started with
# PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync).
with cm.set_current_pool(route, pool):
    with cupy.cuda.using_allocator(cupy.cuda.MemoryAsyncPool("current").malloc):
        z = cupy.zeros(1 << 20, dtype=cupy.uint8)
        assert pool.used_mem_current >= 1 << 20
        del z

print("pool: used", pool.used_mem_current, "reserved", pool.reserved_mem_current, "cache", cache.stats())

# Let go in order: tensors and arrays, then PyTorch's pool, then the plug-in.
del x, y, t, c
buffer.close()
torch.cuda.synchronize()
del torch_pool
torch.cuda.empty_cache()
cmt.stop()
print("done")
