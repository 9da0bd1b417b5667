"""PyTorch plug-in: a ``torch.cuda.MemPool`` whose memory comes from a cumempool pool or
resource (a cache, say), through the C functions this package's native library exports for
``torch.cuda.memory.CUDAPluggableAllocator``.

>>> import torch, cumempool as cm, cumempool.torch as cmt
>>> pool = cm.MemPool(cm.Route.device(0), max_size=1 << 30)
>>> torch_pool = cmt.mem_pool(cm.CachingResource(cm.PoolResource(pool)))
>>> with torch.cuda.use_mem_pool(torch_pool):
...     x = torch.empty(1 << 20, device="cuda")
>>> cmt.statistics()   # what the plug-in served: PyTorch's own counters do not see it

One resource serves new allocations at a time (the exported functions are process-wide);
``serve`` switches it, and each allocation still goes back to the resource it came from. Routing alone needs no plug-in: with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``
PyTorch allocates from the device's current pool, which ``cumempool.set_current_pool`` sets.

Streams: PyTorch passes raw handles, which the plug-in borrows for the life of the process, and a
cache it serves gives blocks back on the handle they were freed on, later. PyTorch's own streams
are never destroyed. A stream lent through ``torch.cuda.ExternalStream`` must live until the
served resource's ``release()`` ran after its last tensor was freed (or to the end of the process).

Sizes: a free uses the size recorded at allocation, never the one PyTorch passes.

CUDA graphs: under ``torch.cuda.graph(g, pool=...)`` (any capture of the stream PyTorch
allocates on), what the plug-in allocates while the stream captures is recorded into the graph
as an allocation node. That memory is the graph's, not the pool's: the pool's ``max_size`` and
counters, and a ``Limit`` below the served resource, do not govern it.
"""

from __future__ import annotations

from . import _native
from ._native import MemPool, PoolResource, Resource, Statistics

ALLOC_SYMBOL = "cumempool_torch_alloc"
FREE_SYMBOL = "cumempool_torch_free"

_served: Statistics | None = None
_allocator = None


def serve(source: MemPool | Resource) -> Statistics:
    """Makes the exported C functions serve ``source`` (a pool or a resource), counted by a
    :class:`cumempool.Statistics` that is returned."""
    global _served
    resource = PoolResource(source) if isinstance(source, MemPool) else source
    stats = Statistics(resource)
    _native.torch_serve(stats)
    _served = stats
    return stats


def allocator():
    """The ``CUDAPluggableAllocator`` over this package's native library (made once), for
    ``torch.cuda.MemPool`` as :func:`mem_pool` makes it. Not for
    ``torch.cuda.memory.change_current_allocator``: a pluggable allocator made current has no
    ``record_stream`` function, so ``Tensor.record_stream`` (which NCCL process groups rely on)
    would do nothing and memory could be reused while another stream still reads it. Inside a
    ``MemPool``, PyTorch's caching allocator keeps recorded streams itself."""
    global _allocator
    if _allocator is None:
        import torch.cuda.memory

        _allocator = torch.cuda.memory.CUDAPluggableAllocator(_native.__file__, ALLOC_SYMBOL, FREE_SYMBOL)
    return _allocator


def mem_pool(source: MemPool | Resource):
    """A ``torch.cuda.MemPool`` served from ``source``, for ``torch.cuda.use_mem_pool``."""
    import torch

    serve(source)
    return torch.cuda.MemPool(allocator().allocator())


def statistics() -> dict:
    """Bytes and allocations the plug-in has served (current, peak, total)."""
    if _served is None:
        return {}
    return _served.usage()


def stop() -> None:
    """Stops serving: later allocations through the plug-in fail as out of memory."""
    global _served
    _native.torch_serve(None)
    _served = None
