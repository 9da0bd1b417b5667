"""CuPy plug-in: an allocator for ``cupy.cuda.set_allocator`` that allocates from a cumempool
pool or resource on CuPy's current stream.

>>> import cupy, cumempool as cm, cumempool.cupy as cmc
>>> pool = cm.MemPool(cm.Route.device(0))
>>> cupy.cuda.set_allocator(cmc.Allocator(cm.CachingResource(cm.PoolResource(pool))))

Routing alone needs no plug-in: ``cupy.cuda.MemoryAsyncPool("current")`` draws from the
device's current pool, and ``MemoryAsyncPool(pool.handle)`` from a given one.
"""

from __future__ import annotations

from ._native import MemPool, PoolResource, Resource
from .errors import InvalidDeviceError


class Allocator:
    """``allocator(size) -> cupy.cuda.MemoryPointer`` over ``source``; the memory goes back
    (on the stream it was allocated on) when CuPy lets go of it.

    CuPy's current stream is passed to cumempool as it is: cumempool finds the same stream
    again by its handle and device (one stream to a cache) and holds the CuPy stream object
    only while memory allocated on it, or a block a cache keeps for it, is alive.

    It serves the resource's device only: under ``cupy.cuda.Device(n)`` for another device it
    raises :class:`cumempool.InvalidDeviceError` (make an allocator per device), since CuPy
    would use the memory on that device's streams, unordered with the ones it was given on."""

    def __init__(self, source: MemPool | Resource):
        self.resource = PoolResource(source) if isinstance(source, MemPool) else source

    def __call__(self, size: int):
        import cupy

        current = cupy.cuda.runtime.getDevice()
        if current != self.resource.device:
            raise InvalidDeviceError(
                f"this allocator serves device {self.resource.device} and CuPy's current device is "
                f"device {current}: give each device an Allocator of its own resource"
            )
        buffer = self.resource.alloc(size, cupy.cuda.get_current_stream())
        memory = cupy.cuda.UnownedMemory(buffer.ptr, size, buffer, buffer.device)
        return cupy.cuda.MemoryPointer(memory, 0)
