"""One budget every CUDA library of the process obeys, and who holds what under it.

``budget(8 << 30)`` (or ``python -m cumempool run --budget 8GiB -- script.py``) makes one pool of
at most that size per device current for the device's route, and has each library draw from it
in the way that keeps it at its own speed:

- PyTorch: its ``cudaMallocAsync`` backend (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``,
  set before PyTorch is imported), which allocates from the device's current pool on every
  thread, autograd's backward thread included;
- CuPy: cumempool's allocator plug-in over the budget's pool, installed when CuPy is imported;
- Numba: cumempool's External Memory Manager, installed when ``numba.cuda`` is imported;
- cuda.core: its default ``DeviceMemoryResource`` wraps the device's current pool: routing alone.

Over the budget each library raises its own out-of-memory error (``torch.OutOfMemoryError``,
CuPy's ``OutOfMemoryError``, a ``MemoryError`` for Numba, ``CUDA_ERROR_OUT_OF_MEMORY`` for
cuda.core), and memory one library frees is the others' at once. :func:`usage` says who holds
what; :func:`report` is the text an out-of-memory error carries.
"""

from __future__ import annotations

import importlib.abc
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from ._native import MemPool, PoolResource, Route, RouteGuard, Statistics, set_current_pool

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(size: int | str) -> int:
    """Bytes from ``size``: an int, or a number with a unit (``"8GiB"``, ``"512 MiB"``,
    ``"1.5GB"``; binary units are powers of 1024, decimal ones of 1000)."""
    if isinstance(size, bool):
        raise TypeError("a size is an int of bytes or a string such as '8GiB', not a bool")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"a budget must be more than 0 bytes, not {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"a size is an int of bytes or a string such as '8GiB', not {type(size).__name__}")
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{size!r} is not a size: write a number of bytes, or one with a unit such as '8GiB', '512MiB' or '2GB'")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a budget must be more than 0 bytes, not {size!r}")
    return value


@dataclass
class _Device:
    """The budget of one device: its pool, the route change that made it current, and the
    resource each plug-in library draws through (counted per library)."""

    ordinal: int
    limit: int
    pool: MemPool
    guard: RouteGuard
    libraries: dict[str, Statistics] = field(default_factory=dict)

    def resource(self, library: str) -> Statistics:
        counted = self.libraries.get(library)
        if counted is None:
            counted = self.libraries[library] = Statistics(PoolResource(self.pool))
        return counted


class Budget:
    """The process's budget: one capped pool per device, current for the device's route.
    Made by :func:`budget`; :meth:`close` puts the previous pools back."""

    def __init__(self, devices: dict[int, _Device]):
        self._devices = devices

    @property
    def devices(self) -> dict[int, int]:
        """The limit of each device, in bytes."""
        return {ordinal: device.limit for ordinal, device in self._devices.items()}

    def pool(self, device: int) -> MemPool:
        """The pool that holds ``device``'s budget."""
        return self._device(device).pool

    def resource(self, library: str, device: int) -> Statistics:
        """The resource a plug-in library draws through on ``device``: the budget's pool,
        counted for that library."""
        return self._device(device).resource(library)

    def _device(self, device: int) -> _Device:
        found = self._devices.get(device)
        if found is None:
            from .errors import InvalidDeviceError

            raise InvalidDeviceError(f"device {device} has no budget: the budget covers devices {sorted(self._devices)}")
        return found

    def close(self) -> None:
        """Puts back the pools that were current before (what the libraries allocated stays
        valid: the pools live while their memory does)."""
        global _active
        for device in self._devices.values():
            device.guard.restore()
        with _lock:
            if _active is self:
                _active = None

    def __repr__(self) -> str:
        limits = ", ".join(f"{d}: {device.limit}" for d, device in sorted(self._devices.items()))
        return f"Budget({{{limits}}})"


_lock = threading.Lock()
_active: Budget | None = None


def active() -> Budget | None:
    """The budget in force, if any."""
    return _active


def budget(total: int | str | None = None, *, devices: dict[int, int | str] | None = None) -> Budget:
    """Puts every CUDA library of the process on one budget: ``total`` bytes on each device
    (``"8GiB"`` or an int), or the sizes ``devices`` names (``{0: "8GiB", 1: "4GiB"}``). Without
    ``devices``, the budget covers the device ``LOCAL_RANK`` names (one rank of ``torchrun``),
    else every visible device. Call it before the libraries allocate (before PyTorch is
    imported, for PyTorch): what they allocated before stays outside the budget.

    A script that chose an allocator itself is not overridden: a ``PYTORCH_CUDA_ALLOC_CONF``
    naming another backend, ``NUMBA_CUDA_MEMORY_MANAGER``, or a CuPy allocator other than
    CuPy's default pool is kept, with a warning that the library is outside the budget.
    """
    global _active
    limits = _limits(total, devices)
    with _lock:
        if _active is not None:
            raise RuntimeError(f"a budget is in force already ({_active!r}): close it first")
        made: dict[int, _Device] = {}
        try:
            for ordinal, limit in limits.items():
                route = Route.device(ordinal)
                pool = MemPool(route, max_size=limit)
                made[ordinal] = _Device(ordinal, limit, pool, set_current_pool(route, pool))
        except BaseException:
            for device in made.values():
                device.guard.restore()
            raise
        _active = Budget(made)
    _choose_torch_backend()
    _after_import("cupy", _install_cupy)
    _after_import("numba.cuda", _install_numba)
    return _active


def _limits(total: int | str | None, devices: dict[int, int | str] | None) -> dict[int, int]:
    if devices:
        return {int(ordinal): parse_size(size) for ordinal, size in devices.items()}
    if total is None:
        raise ValueError("give the budget: budget('8GiB'), or per device: budget(devices={0: '8GiB'})")
    size = parse_size(total)
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit():
        return {int(local_rank): size}
    from ._native import Device

    return {ordinal: size for ordinal in range(Device.count())}


# ---- PyTorch: the cudaMallocAsync backend, chosen before import -------------------------------


def _choose_torch_backend() -> None:
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    backend = re.search(r"backend\s*:\s*(\w+)", setting)
    if backend is not None and backend.group(1) != "cudaMallocAsync":
        warnings.warn(
            f"PYTORCH_CUDA_ALLOC_CONF={setting!r} chooses PyTorch's {backend.group(1)} allocator, which the "
            "budget does not cover; leave the backend out (or name cudaMallocAsync) to put PyTorch on it",
            stacklevel=3,
        )
        return
    if "torch" in sys.modules:
        warnings.warn(
            "PyTorch was imported before the budget: it keeps the allocator it chose then; make the budget "
            "before importing torch (python -m cumempool run does)",
            stacklevel=3,
        )
        return
    if backend is None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [setting, "backend:cudaMallocAsync"]))


# ---- CuPy and Numba: plug-ins installed when the library is imported ------------------------


def _install_cupy(cupy: Any) -> None:
    budget_now = _active
    if budget_now is None:
        return
    current = cupy.cuda.get_allocator()
    default = getattr(cupy.get_default_memory_pool(), "malloc", None)
    if current is not None and default is not None and getattr(current, "__self__", None) is not getattr(default, "__self__", None):
        warnings.warn("CuPy has an allocator of its own already: it stays, outside the budget", stacklevel=2)
        return
    from .cupy import Allocator

    allocators = {ordinal: Allocator(budget_now.resource("cupy", ordinal)) for ordinal in budget_now.devices}

    def allocate(size: int) -> Any:
        device = cupy.cuda.runtime.getDevice()
        allocator = allocators.get(device)
        if allocator is None:
            return cupy.get_default_memory_pool().malloc(size)  # a device outside the budget
        return allocator(size)

    cupy.cuda.set_allocator(allocate)


def _install_numba(numba_cuda: Any) -> None:
    budget_now = _active
    if budget_now is None:
        return
    if os.environ.get("NUMBA_CUDA_MEMORY_MANAGER"):
        warnings.warn("NUMBA_CUDA_MEMORY_MANAGER names a memory manager: it stays, outside the budget", stacklevel=2)
        return
    from .numba import manager_for

    numba_cuda.set_memory_manager(manager_for(lambda ordinal: budget_now.resource("numba", ordinal)))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after it is first imported (CuPy's and Numba's
    allocator settings must be made before the program's first allocation, and importing them
    early would slow every program that never uses them)."""

    def __init__(self) -> None:
        self.waiting: dict[str, Callable[[Any], None]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        then = self.waiting.pop(name, None)
        if then is None:
            return None
        # The finders after this one decide where the module comes from (numba-cuda, say, puts
        # `numba.cuda` elsewhere with a finder of its own); this one only wraps the loader.
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThen(spec.loader, then)
                return spec
        return None


class _LoaderThen(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[Any], None]) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then(module)


_finder = _AfterImport()


def _after_import(name: str, then: Callable[[Any], None]) -> None:
    if name in sys.modules:
        then(sys.modules[name])
        return
    _finder.waiting[name] = then
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


# ---- who holds what -------------------------------------------------------------------------


def usage() -> dict[int, dict[str, Any]]:
    """Per device of the budget: ``limit``, the pool's ``used`` and ``reserved`` bytes, and per
    library the bytes in use, the peak, the count of live allocations and the share of the
    limit. The plug-in libraries (``cupy``, ``numba``) are counted allocation by allocation.
    What the routed libraries draw (PyTorch's ``cudaMallocAsync`` backend, cuda.core's default
    resource) and any direct ``cudaMallocAsync`` on the device reach the pool without passing
    through cumempool, and PyTorch's own statistics read the default pool under routing (0), so
    they are ``unattributed``, never dropped; its ``via`` lists the routed libraries loaded.
    Empty without a budget."""
    budget_now = _active
    if budget_now is None:
        return {}
    answer: dict[int, dict[str, Any]] = {}
    routed = [name for name in ("torch", "cuda.core") if _loaded(name)]
    for ordinal, device in budget_now._devices.items():
        used, reserved = device.pool.used_mem_current, device.pool.reserved_mem_current
        libraries: dict[str, dict[str, Any]] = {}
        for name, counted in sorted(device.libraries.items()):
            counts = counted.usage()
            libraries[name] = {"bytes": counts["current_bytes"], "peak": counts["peak_bytes"], "count": counts["current_count"]}
        attributed = sum(held["bytes"] for held in libraries.values())
        libraries["unattributed"] = {"bytes": max(0, used - attributed), "peak": None, "count": None, "via": routed}
        for held in libraries.values():
            held["share"] = held["bytes"] / device.limit
        answer[ordinal] = {"limit": device.limit, "used": used, "reserved": reserved, "libraries": libraries}
    return answer


def _loaded(name: str) -> bool:
    """Whether the routed library ``name`` is imported (and, for PyTorch, has used CUDA)."""
    module = sys.modules.get(name)
    if module is None:
        return False
    if name == "torch":
        return bool(module.cuda.is_initialized())
    return True


def report(device: int | None = None) -> str:
    """What an out-of-memory error under the budget says: the limit, who holds what, reserved
    against used, and what to do. For ``device`` (default: every device of the budget)."""
    figures = usage()
    if not figures:
        return "no cumempool budget is in force"
    lines = []
    for ordinal, of_device in sorted(figures.items()):
        if device is not None and ordinal != device:
            continue
        limit, used, reserved = of_device["limit"], of_device["used"], of_device["reserved"]
        lines.append(f"cumempool budget of device {ordinal}: {_size(used)} of {_size(limit)} in use ({used / limit:.0%})")
        holders = sorted(of_device["libraries"].items(), key=lambda item: -item[1]["bytes"])
        for name, held in holders:
            if held["bytes"] == 0 and name == "unattributed":
                continue
            count = f" in {held['count']} allocations" if held["count"] is not None else ""
            via = f" (routed: {', '.join(held['via'])}, or direct cudaMallocAsync)" if held.get("via") else ""
            lines.append(f"  {name:<13} {_size(held['bytes']):>10} ({held['share']:.0%}){count}{via}")
        if reserved > used:
            lines.append(f"  reserved {_size(reserved)} against {_size(used)} used: {_size(reserved - used)} held by the pool but free (fragmentation or freed blocks not yet reused)")
        top = holders[0] if holders and holders[0][1]["bytes"] else None
        if top is None:
            advice = "free memory"
        elif top[0] == "unattributed":
            advice = f"free what {' or '.join(top[1]['via']) or 'the routed libraries'} hold{'s' if len(top[1]['via']) == 1 else ''}"
        else:
            advice = f"free what {top[0]} holds"
        lines.append(f"  to go on: {advice}, make the budget larger (--budget / cumempool.budget), or use smaller batches")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
