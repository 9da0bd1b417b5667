"""Numba plug-in: an External Memory Manager (EMM) that draws Numba's device arrays from a
cumempool pool or resource.

>>> import cumempool as cm, cumempool.numba as cmn
>>> pool = cm.MemPool(cm.Route.device(0), max_size=1 << 30)
>>> cmn.use(pool)                        # before Numba creates its context (its first CUDA use)
>>> from numba import cuda
>>> a = cuda.device_array(1 << 20)       # drawn from `pool`

Numba's ``memalloc`` takes no stream: memory is allocated and freed on the legacy default
stream of the source's device, which waits for the work queued on Numba's default stream and on
every blocking stream (``cuda.stream()``). Work queued on a non-blocking stream
(``CU_STREAM_NON_BLOCKING``, or the per-thread default stream) must be done before the last
reference to an array goes. Host allocations (``cuda.pinned_array``, ``cuda.mapped_array``) and
pinning stay with Numba. Importing this module does not import Numba.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from . import _history
from ._native import Device, MemPool, Resource
from ._sources import resource_of
from .errors import InvalidDeviceError, OutOfMemoryError


def _numba_cuda() -> Any:
    try:
        from numba import cuda
    except ImportError as error:
        raise ImportError(f"cumempool.numba needs Numba's CUDA target (pip install numba-cuda): {error}") from error
    return cuda


def manager(source: MemPool | Resource) -> type:
    """A ``numba.cuda.HostOnlyCUDAMemoryManager`` subclass allocating from ``source`` (a MemPool
    or a Resource), for ``numba.cuda.set_memory_manager``. Each call makes a new class."""
    resource = resource_of(source)

    def resource_for(ordinal: int) -> Resource:
        if ordinal != resource.device:
            raise InvalidDeviceError(
                f"Numba asked for memory on device {ordinal}, but this memory manager's "
                f"resource serves device {resource.device}: install a manager per device "
                "or allocate under that device"
            )
        return resource

    return manager_for(resource_for)


def manager_for(resource_for: Callable[[int], Resource]) -> type:
    """As :func:`manager`, drawing on each device from ``resource_for(ordinal)`` (a budget's
    resource of that device). An out-of-memory error under a budget carries its report
    (``err.report``, and in the message)."""
    cuda = _numba_cuda()
    from numba.cuda.cudadrv.driver import MemoryInfo

    base: Any = cuda.HostOnlyCUDAMemoryManager

    class CumempoolNumbaManager(base):
        """Numba's device allocations from a cumempool resource, on the legacy default stream
        of its device; host allocations and pinning are Numba's own."""

        def initialize(self) -> None:
            pass  # the resource is ready when the class is made

        def memalloc(self, size: int) -> Any:
            device = self.context.device.id
            resource = resource_for(device)
            try:
                buffer = resource.alloc(size, None)
            except OutOfMemoryError as error:
                _with_budget_report(error, resource, device)
                raise
            # The finalizer holds the buffer: closing it frees the memory on the legacy stream.
            finalizer: Callable[[], None] = buffer.close
            if _history.recording is not None:
                finalizer = _recorded(buffer, device, size, resource)
            return cuda.MemoryPointer(self.context, ctypes.c_void_p(buffer.ptr), size, finalizer=finalizer)

        def get_ipc_handle(self, memory: Any) -> Any:
            raise NotImplementedError(
                "pool memory has no legacy IPC handle: share it with a MemPool created with "
                "handle_types=cumempool.HandleTypes.POSIX_FILE_DESCRIPTOR and Buffer.export()"
            )

        def get_memory_info(self) -> Any:
            free, total = Device(self.context.device.id).memory_info()
            return MemoryInfo(free=free, total=total)

        @property
        def interface_version(self) -> int:
            return 1

    return CumempoolNumbaManager


def _recorded(buffer: Any, device: int, size: int, source: Any = None) -> Callable[[], None]:
    """Records the allocation (legacy stream, handle 0) and returns the finalizer that records
    the free, then closes the buffer."""
    _history.note_alloc("numba", device, buffer.ptr, size, 0, source)

    def close() -> None:
        _history.note_free("numba", device, buffer.ptr, size, 0)
        buffer.close()

    return close


def _with_budget_report(error: Exception, resource: Any, device: int) -> None:
    """Adds the budget's report to an out-of-memory error, where the budget in force gave
    ``resource``."""
    from . import _budget

    report = _budget.report_if_drawn_from(resource, device)
    if report is None:
        return
    error.report = report  # type: ignore[attr-defined]
    error.args = (f"{error.args[0] if error.args else error}\n{report}",) + tuple(error.args[1:])


def use(source: MemPool | Resource) -> type:
    """Makes Numba allocate device memory from ``source``: ``set_memory_manager(manager(source))``.
    Call it before Numba's first CUDA use (Numba creates its context then, with the manager in
    force at that moment). Returns the manager class."""
    cls = manager(source)
    _numba_cuda().set_memory_manager(cls)
    return cls
