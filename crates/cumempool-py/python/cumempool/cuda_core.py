"""cuda.core plug-in: a ``cuda.core.MemoryResource`` over a cumempool pool or resource.

>>> from cuda.core import Device
>>> import cumempool as cm, cumempool.cuda_core as cmcc
>>> mr = cmcc.MemoryResource(cm.MemPool(cm.Route.device(0)))
>>> buf = mr.allocate(1 << 20, stream=Device(0).create_stream())

Routing alone needs no plug-in: ``DeviceMemoryResource(0)`` without options wraps the device's
current pool, which ``cumempool.set_current_pool`` sets.
"""

from __future__ import annotations

from typing import Any

from ._native import MemPool, Resource, Stream
from ._sources import resource_of


def _base() -> Any:
    try:
        from cuda.core import MemoryResource as base
    except ImportError:  # older cuda.core releases kept it under experimental
        from cuda.core.experimental import MemoryResource as base
    return base


def _buffer_type() -> Any:
    try:
        from cuda.core import Buffer
    except ImportError:
        from cuda.core.experimental import Buffer
    return Buffer


def _make_class() -> type:
    base: Any = _base()

    class CumempoolMemoryResource(base):
        """Allocates from ``source`` on the stream cuda.core gives; each ``Buffer`` it returns
        gives its memory back through ``deallocate``."""

        def __init__(self, source: MemPool | Resource):
            self._resource = resource_of(source)
            self._live: dict[int, object] = {}

        def allocate(self, size, stream=None):
            s = Stream.borrow(stream) if stream is not None else None
            buffer = self._resource.alloc(size, s)
            self._live[buffer.ptr] = buffer
            return _buffer_type().from_handle(buffer.ptr, size, mr=self)

        def deallocate(self, ptr, size, stream=None):
            # Freed on `stream`: the memory is free only once the work queued there is done
            # (what cuda.core's Buffer.close(stream) promises). Taken out of `_live` before the
            # memory goes back: once it has, another thread may be handed the same address and
            # hold it there. A close that is refused (StreamCapturingError, `stream` capturing a
            # graph whose work uses the memory) frees nothing, so the buffer is held again and a
            # later deallocate frees it.
            buffer = self._live.pop(int(ptr), None)
            if buffer is None:
                return
            try:
                buffer.close(stream)
            except BaseException:
                self._live[int(ptr)] = buffer
                raise

        @property
        def is_device_accessible(self) -> bool:
            return True

        @property
        def is_host_accessible(self) -> bool:
            return self._resource.memory_kind != "device"

        @property
        def device_id(self) -> int:
            return self._resource.device

    return CumempoolMemoryResource


_class: type | None = None


def _implementation() -> type:
    """The cuda.core subclass, made on first use so that importing this module does not import
    cuda.core."""
    global _class
    if _class is None:
        try:
            _class = _make_class()
        except ImportError as error:
            raise ImportError(f"cumempool.cuda_core.MemoryResource needs cuda.core (pip install cuda-core): {error}") from error
    return _class


class _MadeOnFirstUse(type):
    """The metaclass of ``MemoryResource``: calling the class makes an instance of the cuda.core
    subclass, and ``isinstance`` and ``issubclass`` look at that subclass (before it exists no
    object can be one)."""

    def __call__(cls, source: MemPool | Resource) -> Any:
        return _implementation()(source)

    def __instancecheck__(cls, instance: object) -> bool:
        return _class is not None and isinstance(instance, _class)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return subclass is cls or (_class is not None and issubclass(subclass, _class))


class MemoryResource(metaclass=_MadeOnFirstUse):
    """A ``cuda.core`` ``MemoryResource`` over ``source`` (a MemPool or a Resource):
    ``MemoryResource(source)`` returns an instance of a subclass of cuda.core's
    ``MemoryResource``, made on first use, so importing this module does not import cuda.core.
    ``isinstance(x, MemoryResource)`` tells whether ``x`` is one."""

    def __init__(self, source: MemPool | Resource) -> None: ...

    def allocate(self, size: int, stream: object = None) -> object:
        """A cuda.core ``Buffer`` of ``size`` bytes ordered on ``stream``."""
        raise NotImplementedError  # never called: instances are of the cuda.core subclass

    def deallocate(self, ptr: int, size: int, stream: object = None) -> None:
        """Frees ``ptr`` on ``stream``."""
        raise NotImplementedError  # never called: instances are of the cuda.core subclass
