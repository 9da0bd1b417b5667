"""PyTorch plug-in: a ``torch.cuda.MemPool`` whose memory comes from a cumempool pool or
resource (a cache, say), through the C functions this package's native library exports for
``torch.cuda.memory.CUDAPluggableAllocator``.

>>> import torch, cumempool as cm, cumempool.torch as cmt
>>> pool = cm.MemPool(cm.Route.device(0), max_size=1 << 30)
>>> torch_pool = cmt.mem_pool(cm.CachingResource(cm.PoolResource(pool)))
>>> with cmt.use_mem_pool(torch_pool):   # torch.cuda.use_mem_pool, backward pass included
...     x = torch.empty(1 << 20, device="cuda")
>>> cmt.statistics()   # what the plug-in served: PyTorch's own counters do not see it

Threads: ``torch.cuda.use_mem_pool`` serves the calling thread only, and autograd runs a CUDA
backward pass on a thread of its own, whose tensors then come from PyTorch's native allocator.
:func:`use_mem_pool` also runs the backward passes begun inside it on the calling thread
(``torch.autograd.grad_mode.set_multithreading_enabled(False)``, a public PyTorch interface), so
that the whole training step draws from the pool. Other threads are not served.

Each pool :func:`mem_pool` makes keeps its source. Up to ``TORCH_SLOTS`` (64) pools over
distinct sources live at once (pools over the same source share one); past that, :func:`mem_pool`
raises ``RuntimeError``.

Routing alone needs no plug-in: with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` PyTorch
allocates from the device's current pool, which ``cumempool.set_current_pool`` sets.

Streams: a stream lent through ``torch.cuda.ExternalStream`` must live until PyTorch gave back
the segments allocated on it (``torch.cuda.empty_cache()``, or the pool gone) and the served
resource's ``release()`` ran after that (or to the end of the process); PyTorch's own streams
need nothing.

Frees: PyTorch gives a segment back only once no tensor uses it, but a CUDA graph replayed on
any stream may still read it, so the plug-in waits for the device before it gives memory back,
as PyTorch's own ``cudaFree`` does. Segments are given back rarely (``torch.cuda.empty_cache()``,
a pool's end, an out-of-memory retry). The wait would invalidate a capture underway on the
device; while the plug-in sees one it keeps the memory instead (docs/python.md says which
captures it cannot see).

CUDA graphs: a segment the plug-in gives while PyTorch's stream captures (``torch.cuda.graph``) is
ordinary memory of its source, allocated beside the capture and waited for, since PyTorch may
later hand it to an eager tensor of the same pool: the pool's ``max_size`` and counters govern it.
Memory PyTorch frees while a capture is underway (its out-of-memory retry can) may still be used
by that graph at every launch: it is kept until :func:`release_captured`, which you call once
the graphs are gone.

How it works: ``docs/internals-python.md``, "The torch plug-in".
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import _native
from ._native import MemPool, Resource, Statistics
from ._sources import resource_of

if TYPE_CHECKING:
    import torch as _torch  # private: the module does not import PyTorch until it is used

ALLOC_SYMBOL = "cumempool_torch_alloc"
FREE_SYMBOL = "cumempool_torch_free"
TORCH_SLOTS: int = _native.TORCH_SLOTS

_served: Statistics | None = None
# The pluggable allocator over each allocation function (`serve`'s, each slot's), made once, under
# `_making`: PyTorch's `MemPool` keeps only a raw pointer to its allocator, so the one stored here
# must be the one every pool over the function was made over (two made at once, the second
# stored, would free the first under its pool).
_pluggable_allocators: dict[str, object] = {}
_making = threading.Lock()
# The slot binding `(slot, generation)` of each pool `mem_pool` made, while the pool lives.
_bindings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# What `statistics()` without an argument reports: the last `mem_pool` binding, or `serve`'s.
_last: tuple[int, int] | None = None


def serve(source: MemPool | Resource) -> Statistics:
    """Makes the exported C functions ``cumempool_torch_alloc``/``_free`` serve ``source`` (a
    pool or a resource), counted by a :class:`cumempool.Statistics` that is returned. For
    callers of the C functions themselves: :func:`mem_pool` binds a function of its own."""
    global _served, _last
    resource = resource_of(source)
    stats = Statistics(resource)
    _native.torch_serve(stats)
    _served = stats
    _last = None
    return stats


def allocator():
    """The ``CUDAPluggableAllocator`` over ``cumempool_torch_alloc`` (what :func:`serve` chose),
    made once. Not for ``torch.cuda.memory.change_current_allocator``: a pluggable allocator
    made current has no ``record_stream`` function, so ``Tensor.record_stream`` (which NCCL
    process groups rely on) would do nothing and memory could be reused while another stream
    still reads it. Inside a ``MemPool``, PyTorch's caching allocator keeps recorded streams
    itself."""
    return _pluggable(ALLOC_SYMBOL)


def _slot_allocator(slot: int):
    """The ``CUDAPluggableAllocator`` over slot ``slot``'s allocation function."""
    return _pluggable(f"{ALLOC_SYMBOL}_{slot}")


def _pluggable(alloc_symbol: str):
    """The ``CUDAPluggableAllocator`` over the exported allocation function ``alloc_symbol`` and
    the free function, made once."""
    with _making:
        found = _pluggable_allocators.get(alloc_symbol)
        if found is None:
            import torch.cuda.memory

            found = torch.cuda.memory.CUDAPluggableAllocator(_native.__file__, alloc_symbol, FREE_SYMBOL)
            _pluggable_allocators[alloc_symbol] = found
        return found


def mem_pool(source: MemPool | Resource):
    """A ``torch.cuda.MemPool`` served from ``source``, for ``torch.cuda.use_mem_pool``. It keeps
    ``source`` whatever pools are made later; pools over the same source share one slot."""
    global _last
    import torch

    resource = resource_of(source)
    slot, generation = _native.torch_bind(source, resource)
    try:
        pool = torch.cuda.MemPool(_slot_allocator(slot).allocator())
        # The slot is held while the pool lives; its blocks hold it after (the native side
        # counts them), since PyTorch keeps a pool's memory until the last block is freed.
        weakref.finalize(pool, _native.torch_unbind, slot, generation)
    except BaseException:
        _native.torch_unbind(slot, generation)
        raise
    _bindings[pool] = (slot, generation)
    _last = (slot, generation)
    return pool


@contextlib.contextmanager
def use_mem_pool(pool: _torch.cuda.MemPool, device: int | _torch.device | None = None) -> Iterator[None]:
    """``torch.cuda.use_mem_pool(pool, device)`` that serves the backward pass too: inside it,
    autograd runs each backward pass on the calling thread
    (``torch.autograd.grad_mode.set_multithreading_enabled(False)``), where ``pool`` serves the
    allocations on ``device`` (the current device by default), the backward pass's gradients and
    temporaries among them, rather than PyTorch's native allocator. ``pool`` is any
    ``torch.cuda.MemPool`` (:func:`mem_pool` makes one over a cumempool source).

    Not served, as with PyTorch's: other threads, and other devices (a backward pass over
    several devices runs them one after another on this thread, each other device from PyTorch's
    allocator). Reentrant backward passes nested deeper than autograd's recursion limit move to
    autograd's thread pool, which is not served either.

    A CUDA graph captured after warm-ups inside it is captured outside the block (PyTorch
    refuses a capture into another pool inside it) with its backward pass on this thread too
    (``with set_multithreading_enabled(False), torch.cuda.graph(g, pool=pool.id)``): cuBLAS
    handles are made per thread, on first use, and making one during a capture fails."""
    import torch
    from torch.autograd.grad_mode import set_multithreading_enabled

    # PyTorch's scope first: the switch is set when made, so it is made only once the scope holds.
    with torch.cuda.use_mem_pool(pool, device), set_multithreading_enabled(False):
        yield


def statistics(pool=None) -> dict:
    """Bytes and allocations the plug-in has served (current, peak, total): through ``pool``, a
    ``torch.cuda.MemPool`` :func:`mem_pool` made (with every other pool over its source), or
    without one, through the last pool :func:`mem_pool` made or what :func:`serve` chose.
    Empty once :func:`stop` ran."""
    binding = _last if pool is None else _bindings.get(pool)
    if pool is not None and binding is None:
        raise ValueError(f"{pool!r} was not made by cumempool.torch.mem_pool")
    if binding is not None:
        return _native.torch_usage(*binding) or {}
    if _served is None:
        return {}
    return _served.usage()


def release_captured() -> int:
    """Gives back the memory PyTorch freed while a CUDA graph capture was underway, which the
    plug-in keeps because the graph may use it at every launch; returns the bytes given back.
    Call it once the graphs captured meanwhile are gone (deleted or reset, no replay to come).
    Each device is waited for first; while a capture is underway on one, its memory stays kept
    and the driver's refusal is raised (``StreamCapturingError``)."""
    return _native.torch_release_captured()


def captured_bytes() -> int:
    """The bytes PyTorch freed during captures that the plug-in keeps until
    :func:`release_captured`."""
    return _native.torch_captured_bytes()


def stop() -> None:
    """Stops serving: later allocations through the plug-in (``cumempool_torch_alloc`` and every
    pool :func:`mem_pool` made) fail as out of memory, and the sources are let go of. Memory
    already allocated still goes back to its source when PyTorch frees it (or, for memory freed
    during a capture, at :func:`release_captured`). A pool's slot is free again once the pool
    and its blocks are gone, kept ones included, so a pool kept never reaches a later source."""
    global _served, _last
    _native.torch_serve(None)
    _native.torch_stop_slots()
    _served = None
    _last = None
