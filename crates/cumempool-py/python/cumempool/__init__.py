"""cumempool: CUDA stream-ordered memory pools, routes and allocators, from Python.

The package is a thin front over the Rust crates ``cumempool`` and ``cumempool-alloc``:
every rule is checked in Rust and every error is one of :mod:`cumempool.errors`.

>>> import cumempool as cm
>>> pool = cm.MemPool(cm.Route.device(0), max_size=256 << 20)
>>> with cm.set_current_pool(cm.Route.device(0), pool):
...     ...  # torch (cudaMallocAsync backend), CuPy MemoryAsyncPool("current") and
...          # cuda.core's DeviceMemoryResource(0) now draw from `pool`
>>> buffer = pool.alloc(1 << 20, cm.Stream(0))

The plug-ins import their library only when used: :mod:`cumempool.torch`,
:mod:`cumempool.cupy`, :mod:`cumempool.cuda_core` and :mod:`cumempool.numba`.
"""

from __future__ import annotations

from . import errors
from ._native import (
    Access,
    AllocationType,
    Buffer,
    CachingResource,
    Device,
    HandleTypes,
    Limit,
    Location,
    MemPool,
    OnOutOfMemory,
    PoolResource,
    Resource,
    Route,
    RouteGuard,
    SharedAllocation,
    Statistics,
    Stream,
    Tracking,
    __version__,
    bindings_version,
    current_pool,
    current_pool_handle,
    default_pool,
    driver_version,
    init,
    is_default,
    reset_current_pool,
    set_current_pool,
)
from ._budget import Budget, active, budget, parse_size, usage
from ._budget import report as budget_report
from ._history import dump_snapshot, record_history, snapshot
from .errors import *  # noqa: F401,F403  (the exception classes, at the top level too)


def native_library_path() -> str:
    """The path of the native shared library, which also exports the C allocation functions
    PyTorch's ``CUDAPluggableAllocator`` loads (``cumempool_torch_alloc``/``_free``)."""
    from . import _native

    return _native.__file__


def has_driver() -> bool:
    """Whether a CUDA driver can be loaded and initialised here."""
    try:
        init()
    except errors.CumempoolError:
        return False
    return True


__all__ = [
    "Access",
    "AllocationType",
    "Budget",
    "Buffer",
    "CachingResource",
    "Device",
    "HandleTypes",
    "Limit",
    "Location",
    "MemPool",
    "OnOutOfMemory",
    "PoolResource",
    "Resource",
    "Route",
    "RouteGuard",
    "SharedAllocation",
    "Statistics",
    "Stream",
    "Tracking",
    "__version__",
    "active",
    "bindings_version",
    "budget",
    "budget_report",
    "current_pool",
    "current_pool_handle",
    "default_pool",
    "driver_version",
    "dump_snapshot",
    "errors",
    "has_driver",
    "init",
    "is_default",
    "native_library_path",
    "parse_size",
    "record_history",
    "reset_current_pool",
    "set_current_pool",
    "snapshot",
    "usage",
]
__all__ += errors.__all__
