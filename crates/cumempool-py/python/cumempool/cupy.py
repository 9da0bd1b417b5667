"""CuPy plug-in: an allocator for ``cupy.cuda.set_allocator`` that allocates from a cumempool
pool or resource on CuPy's current stream.

>>> import cupy, cumempool as cm, cumempool.cupy as cmc
>>> pool = cm.MemPool(cm.Route.device(0))
>>> cupy.cuda.set_allocator(cmc.Allocator(cm.CachingResource(cm.PoolResource(pool))))

Routing alone needs no plug-in: ``cupy.cuda.MemoryAsyncPool("current")`` draws from the
device's current pool, and ``MemoryAsyncPool(pool.handle)`` from a given one.
"""

from __future__ import annotations

from ._native import MemPool, PoolResource, Resource, Stream


class Allocator:
    """``allocator(size) -> cupy.cuda.MemoryPointer`` over ``source``; the memory goes back
    (on the stream it was allocated on) when CuPy lets go of it."""

    def __init__(self, source: MemPool | Resource):
        self.resource = PoolResource(source) if isinstance(source, MemPool) else source
        self._streams: dict[tuple[int, int], Stream] = {}

    def _stream(self, cupy_stream) -> Stream:
        # One cumempool Stream per CuPy stream, so a cache sees the same stream every time;
        # it holds the CuPy stream object.
        key = (cupy_stream.device_id, cupy_stream.ptr)
        stream = self._streams.get(key)
        if stream is None or stream.owner is not cupy_stream:
            stream = Stream.borrow(cupy_stream) if cupy_stream.ptr else Stream.legacy(cupy_stream.device_id)
            self._streams[key] = stream
        return stream

    def __call__(self, size: int):
        import cupy

        stream = cupy.cuda.get_current_stream()
        buffer = self.resource.alloc(size, self._stream(stream))
        memory = cupy.cuda.UnownedMemory(buffer.ptr, size, buffer, buffer.device)
        return cupy.cuda.MemoryPointer(memory, 0)
