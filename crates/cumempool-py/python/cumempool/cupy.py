"""CuPy plug-in: an allocator for ``cupy.cuda.set_allocator`` that allocates from a cumempool
pool or resource on CuPy's current stream.

>>> import cupy, cumempool as cm, cumempool.cupy as cmc
>>> pool = cm.MemPool(cm.Route.device(0))
>>> cupy.cuda.set_allocator(cmc.Allocator(cm.CachingResource(cm.PoolResource(pool))).malloc)

``Allocator(...)`` itself is an allocator too; its ``malloc``, like CuPy's own
``MemoryPool().malloc``, is the faster one to install: CuPy calls it without making an
argument tuple.

Routing alone needs no plug-in: ``cupy.cuda.MemoryAsyncPool("current")`` draws from the
device's current pool, and ``MemoryAsyncPool(pool.handle)`` from a given one.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

from . import _history, errors
from ._native import Buffer, MemPool, Resource, Stream, _CupyAllocatorBase, _in_relaxed_capture_mode, _wait_for_device
from ._sources import resource_of
from .errors import InvalidDeviceError

_out_of_memory_class = None


def out_of_memory_error():
    """The class the allocator raises at its resource's limit: a subclass of both
    ``cupy.cuda.memory.OutOfMemoryError`` (what CuPy code catches, and what CuPy's own memory
    pool retries after freeing its cached blocks for) and :class:`cumempool.OutOfMemoryError`.
    Its message is cumempool's; ``__cause__`` is the cumempool error itself, whose ``code``,
    ``name`` and ``function`` it carries too."""
    global _out_of_memory_class
    if _out_of_memory_class is None:
        import cupy

        class OutOfMemoryError(cupy.cuda.memory.OutOfMemoryError, errors.OutOfMemoryError):
            __doc__ = out_of_memory_error.__doc__

            def __init__(self, size: int, cause: errors.OutOfMemoryError, report: str | None = None):
                cupy.cuda.memory.OutOfMemoryError.__init__(self, size, 0, 0)
                self.args = (str(cause) if report is None else f"{cause}\n{report}",)
                for name in ("code", "name", "function", "reason"):
                    setattr(self, name, getattr(cause, name, None))
                self.report = report

            def __str__(self):
                return self.args[0]

            def __reduce__(self):
                # CuPy's class takes (size, total, limit), and this class is made at run time: it
                # pickles as cumempool's own, with the message and the driver's fields.
                fields = {name: getattr(self, name) for name in ("code", "name", "function", "reason", "report")}
                return (errors.OutOfMemoryError, self.args, fields)

        OutOfMemoryError.__module__ = __name__
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _out_of_memory_class = OutOfMemoryError
    return _out_of_memory_class


class Allocator(_CupyAllocatorBase):
    """``allocator(size) -> cupy.cuda.MemoryPointer`` over ``source``, and the same as
    ``allocator.malloc(size)``, the form to install (``cupy.cuda.set_allocator(allocator.malloc)``,
    as CuPy's pools are: CuPy then calls it without an argument tuple); the memory goes back (on
    the stream it was allocated on) when CuPy lets go of it. ``malloc`` is the native call
    itself: a subclass that overrides ``__call__`` is installed as the object (or overrides
    ``malloc`` too).

    It allocates on CuPy's current stream, and holds the CuPy stream object only while memory
    allocated on it, or a block a cache keeps for it, is alive.

    It serves the resource's device only: under ``cupy.cuda.Device(n)`` for another device it
    raises :class:`cumempool.InvalidDeviceError` (make an allocator per device).

    At the resource's limit (a pool's ``max_size``, a :class:`cumempool.Limit`) it raises
    :func:`out_of_memory_error`'s class, which is CuPy's ``OutOfMemoryError`` and
    cumempool's at once.

    CUDA graphs (``stream.begin_capture()`` ... ``end_capture()``): memory asked for while
    CuPy's current stream captures comes from the resource too, counted and capped, and is kept
    for the graph (which uses those addresses at every launch) until you call
    :meth:`release_captured` after the graphs that use it are gone. Memory an allocator let go
    of before that still keeps (a temporary given to ``cupy.cuda.using_allocator``, a closed
    budget's) stays allocated until the process ends: a graph may still launch on it."""

    # The call itself is native (`_CupyAllocatorBase.__call__`): the common case never enters
    # Python; the rest comes to `_serve_in_python`, and failures to `_failed`.
    def __new__(cls, source: MemPool | Resource):
        import cupy

        return super().__new__(
            cls,
            resource_of(source),
            cupy.cuda.runtime.getDevice,
            cupy.cuda.get_current_stream,
            cupy.cuda.UnownedMemory,
            cupy.cuda.MemoryPointer,
            vars(_history),
        )

    def __init__(self, source: MemPool | Resource):
        # `self.resource`, the resource drawn from, is the native part's.
        # Each buffer served to a capture, with a weak reference to the lease CuPy's memory
        # object holds it by: the buffer is given back only once the lease is gone too.
        self._captured: list[tuple[Buffer, weakref.ref[_Lease]]] = []
        # A graph may launch, and an array made in its capture live, after this allocator is
        # gone: what it still keeps for them then is kept until the process ends. The list is
        # only ever changed in place, so the finalizer hands over what it holds at that time.
        weakref.finalize(self, _KEPT_FOR_GRAPHS_OF_COLLECTED_ALLOCATORS.extend, self._captured)
        # CuPy's streams seen capturing, asked again before the device is waited for (a capture
        # does not survive that wait); let go of once seen not capturing.
        self._capturing: list[Any] = []
        self._side: Stream | None = None
        # What serves CuPy on another device (the budget's fallback), else refused.
        self._elsewhere: Callable[[int], Any] | None = None

    def __reduce__(self):
        # A copy draws from the same resource, with the same fallback for other devices, and
        # no memory of its own kept for graphs yet.
        return (type(self), (self.resource,), {"_elsewhere": self._elsewhere})

    @property
    def captured_bytes(self) -> int:
        """The bytes kept for CUDA graphs captured through this allocator."""
        return sum(buffer.size for buffer, _ in self._captured)

    def release_captured(self) -> None:
        """Gives back the memory kept for graphs captured through this allocator. Call it only
        once every graph captured with it is gone (no launch may follow), and while no stream of
        the device captures (the device is synchronised first, which a capture refuses, so that
        launches queued before and the work on arrays the graphs made are done with it); memory an array still holds (one a capture made and the caller
        kept) stays kept until a later call finds it let go of.

        While a stream this allocator saw capturing still captures, or any blocking stream of the
        device does (CuPy's streams are blocking by default), it raises
        :class:`cumempool.StreamCapturingError` and keeps everything: the wait would invalidate
        that capture."""
        if any(stream.is_capturing() for stream in self._capturing):
            raise errors.StreamCapturingError(
                "release_captured waits for the device, and a stream this allocator served a capture "
                "on still captures, which the wait would invalidate: call it after the capture ends"
            )
        _wait_for_device(self.resource.device)
        self._capturing = []
        # Removed one by one, in place: a buffer another thread's capture adds meanwhile stays.
        for entry in list(self._captured):
            buffer, lease = entry
            if lease() is None:
                try:
                    self._captured.remove(entry)
                except ValueError:
                    continue  # another thread's release_captured took it
                buffer.close()

    def _for_a_capture(self, size: int) -> _Lease:
        """Memory for a stream that captures: from the resource on a stream of the allocator's
        own (so neither the allocation nor the cache's reuse lands in the graph), waited for,
        and kept until :meth:`release_captured`; CuPy holds it by the lease returned."""
        side = self._side
        if side is None:
            side = self._side = Stream(self.resource.device)
        # In relaxed mode: a capture in global or thread-local mode forbids this thread an
        # allocation on another stream, and would be invalidated by it.
        buffer = _in_relaxed_capture_mode(lambda: self.resource.alloc(size, side))
        side.synchronize()  # ready before any launch of the graph, on any stream
        lease = _Lease(buffer)
        self._captured.append((buffer, weakref.ref(lease)))
        return lease

    def _failed(self, size: int, error: BaseException):
        """What a call of ``size`` bytes that failed with ``error`` comes to. Out of memory, it
        is tried once more after a garbage collection, as CuPy's own pool does (an array only a
        reference cycle keeps may hold the memory), and returns what that serves; else raises
        CuPy's class (with the budget's report where a budget is in force). Anything else is
        raised as it is."""
        try:
            raise error
        except errors.OutOfMemoryError as caught:
            gc.collect()
            try:
                return self._serve_step_by_step(size)
            except errors.OutOfMemoryError:
                pass
            # Raised while the error is handled: a failure to build CuPy's class keeps it as its
            # context.
            raise out_of_memory_error()(size, caught, _budget_report(self.resource)) from caught
        finally:
            # The error's traceback holds this frame, which would hold the error: a cycle that
            # keeps the failed call's frames, and the caller's arrays in them, until the
            # garbage collector runs.
            del error

    def _serve_in_python(self, size: int):
        """The call step by step, where the native steps cannot serve it: another device
        current, a capturing stream, or recording on."""
        try:
            return self._serve_step_by_step(size)
        except errors.OutOfMemoryError as error:
            return self._failed(size, error)

    def _serve_step_by_step(self, size: int):
        import cupy

        current = cupy.cuda.runtime.getDevice()
        if current != self.resource.device:
            if self._elsewhere is not None:
                return self._elsewhere(size)
            raise InvalidDeviceError(
                f"this allocator serves device {self.resource.device} and CuPy's current device is "
                f"device {current}: give each device an Allocator of its own resource"
            )
        stream = cupy.cuda.get_current_stream()
        handle = getattr(stream, "ptr", None)
        # The legacy stream never captures, and asked while a blocking stream captures it answers
        # with an error: the core's allocation on it asks the driver the right question.
        is_capturing = None if handle in (0, 1) else getattr(stream, "is_capturing", None)
        owner: Buffer | _Lease
        if is_capturing is not None and is_capturing():
            if not any(seen is stream for seen in self._capturing):
                self._capturing.append(stream)
            owner = self._for_a_capture(size)
        else:
            if handle in (0, 1, 2):
                # A default stream (null, legacy, per-thread) by its handle, which names the
                # current device's, allocated as the native call allocates there: a block the
                # cache holds is served beside a blocking capture elsewhere, and a refusal is in
                # the same words.
                owner = self._alloc_on_default_stream(size, handle)
            else:
                owner = self.resource.alloc(size, stream)
            if _history.recording is not None:
                owner = _history.traced(owner, "cupy", owner.device, size, stream.ptr, self.resource)
        memory = cupy.cuda.UnownedMemory(owner.ptr, size, owner, owner.device)
        return cupy.cuda.MemoryPointer(memory, 0)


def _budget_report(resource: Resource) -> str | None:
    """The budget's report for ``resource``'s device, where the budget in force gave it."""
    from . import _budget

    return _budget.report_if_drawn_from(resource, resource.device)


# What allocators collected before `release_captured` kept for graphs (which may still launch):
# allocated until the process ends.
_KEPT_FOR_GRAPHS_OF_COLLECTED_ALLOCATORS: list[tuple[Buffer, weakref.ref[_Lease]]] = []


class _Lease:
    """What CuPy's memory object holds for memory served to a capture: the buffer stays with the
    allocator too (for the graph), and the lease's end tells :meth:`Allocator.release_captured`
    that no array uses the memory any more. The lease holds the buffer as well, so an array keeps
    its memory whatever becomes of the allocator."""

    __slots__ = ("ptr", "device", "_buffer", "__weakref__")

    def __init__(self, buffer: Buffer):
        self.ptr = buffer.ptr
        self.device = buffer.device
        self._buffer = buffer
