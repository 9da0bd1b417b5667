"""One budget every CUDA library of the process obeys, and who holds what under it.

``budget(8 << 30)`` (or ``python -m cumempool run --budget 8GiB -- script.py``) makes one pool of
at most that size per device current for the device's route, and has each library draw from it
in the way that keeps it at its own speed:

- PyTorch: its ``cudaMallocAsync`` backend (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``,
  set before PyTorch is imported), which allocates from the device's current pool on every
  thread, autograd's backward thread included;
- CuPy: cumempool's allocator plug-in over a cache of the budget's pool, installed when CuPy is
  imported (CuPy's own pool caches too: the cache keeps at most a 64th of the budget, 64 MiB at
  most, and gives its blocks back when an allocation of CuPy's or Numba's would otherwise fail);
- Numba: cumempool's External Memory Manager, installed when ``numba.cuda`` is imported;
- cuda.core: its default ``DeviceMemoryResource`` wraps the device's current pool: routing alone.

Over the budget each library raises its own out-of-memory error (``torch.OutOfMemoryError``,
CuPy's ``OutOfMemoryError``, a ``MemoryError`` for Numba, ``CUDA_ERROR_OUT_OF_MEMORY`` for
cuda.core), and memory one library frees is the others' at once; what CuPy's cache keeps is
given back when the other plug-in libraries need it, and PyTorch and cuda.core, which allocate
through routing past any code of cumempool's, get it from :meth:`Budget.release_cached`. :func:`usage` says who holds what; :func:`report`
is the text an out-of-memory error carries.
"""

from __future__ import annotations

import importlib.abc
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, TypeVar

from . import _history
from ._native import CachingResource, MemPool, OnOutOfMemory, PoolResource, Route, RouteGuard, Statistics, set_current_pool

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
        if size > _MOST_BYTES:
            raise ValueError(f"a budget of {size} bytes is more than a device can address (at most 2**64 - 1 bytes)")
        return size
    if not isinstance(size, str):
        raise TypeError(f"a size is an int of bytes or a string such as '8GiB', not {type(size).__name__}")
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{size!r} is not a size: write a number of bytes, or one with a unit such as '8GiB', '512MiB' or '2GB'")
    # Exact (a float would round a 17-digit byte count and overflow a long one).
    value = int(Fraction(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a budget must be more than 0 bytes, not {size!r}")
    if value > _MOST_BYTES:
        raise ValueError(f"{size!r} is more bytes than a device can address (at most 2**64 - 1)")
    return value


# The most bytes a size can be: a pool's sizes are 64-bit.
_MOST_BYTES = (1 << 64) - 1


# The libraries whose plug-in draws through a cache: CuPy allocates a temporary per operation,
# which CuPy's own pool serves from its cache; a pool allocation and free per temporary would
# cost a driver call each.
_CACHED_LIBRARIES = frozenset({"cupy"})

# The libraries whose plug-in refuses a resource that calls Python (`cumempool.torch`).
_NO_PYTHON_CALLBACKS = frozenset({"torch"})

# The most a library's cache keeps: free blocks that the libraries allocating through routing
# cannot have until released. CuPy's temporaries cycle through a few blocks, so a small cache
# serves them.
_MOST_CACHED = 64 << 20


def cache_bound(limit: int) -> int:
    """The bytes of free blocks a library's cache under a budget of ``limit`` bytes keeps: a
    64th of the budget, and 64 MiB at most."""
    return min(limit // 64, _MOST_CACHED)


def _release(caches: list[CachingResource]) -> int:
    """Releases every cache, even where one fails (the first failure is raised after); the
    bytes given back."""
    released, failure = 0, None
    for cache in caches:
        before = cache.stats()["cached_bytes"]
        try:
            cache.release()
        except Exception as error:  # noqa: BLE001 - raised below, after the other caches
            failure = failure or error
        released += max(0, before - cache.stats()["cached_bytes"])
    if failure is not None:
        try:
            raise failure
        finally:
            # This frame would hold its own exception: a cycle (exception, traceback, frame)
            # that keeps the caller's locals until the garbage collector runs.
            del failure
    return released


@dataclass
class _Device:
    """The budget of one device: its pool, the route change that made it current, and per
    plug-in library the resource it draws through (``tops``) and what counts it, right above
    the pool (``libraries``): what a library's cache holds (its free blocks, its size classes'
    rounding) is the library's, so the counts add up to the pool's use. A library without a
    cache (but PyTorch, whose plug-in takes no Python callback) draws through a hook that has the
    caches give their blocks back when the pool is full."""

    ordinal: int
    limit: int
    pool: MemPool
    guard: RouteGuard
    libraries: dict[str, Statistics] = field(default_factory=dict)
    caches: dict[str, CachingResource] = field(default_factory=dict)
    tops: dict[str, Any] = field(default_factory=dict)

    def resource(self, library: str) -> Any:
        # Made outside `_lock`, which is taken only to check and keep: code that runs while it
        # is made (a finalizer, a signal handler) may wait for a lock another thread holds while
        # that thread waits for `_lock` (CuPy's lock, whose holder's nested call asks for a
        # resource), and both would wait forever.
        top = self.tops.get(library)
        if top is not None:
            return top
        cache = None
        if library in _CACHED_LIBRARIES:
            # A cache gives its own blocks back when the pool below is full.
            counted = Statistics(PoolResource(self.pool))
            top = cache = CachingResource(counted, max_cached=cache_bound(self.limit))
        elif library in _NO_PYTHON_CALLBACKS:
            # Its plug-in allocates where no Python may run (PyTorch's allocator lock held,
            # maybe without the GIL): counted, with no hook.
            counted = top = Statistics(PoolResource(self.pool))
        else:
            counted = top = Statistics(OnOutOfMemory(PoolResource(self.pool), self._release_caches_once))
        with _lock:
            # Another thread, or a finalizer or signal handler run while this one was made, may
            # have made the library's resource meanwhile and handed it out: that one stays the
            # library's (this one, never used, goes).
            made = self.tops.get(library)
            if made is not None:
                return made
            if cache is not None:
                self.caches[library] = cache
            self.libraries[library] = counted
            self.tops[library] = top
        return top

    def release_cached(self) -> int:
        """Gives the caches' free blocks back to the pool; the bytes given back."""
        # No lock: an out-of-memory callback calls this, possibly inside a `with _lock` block
        # of this thread (a finalizer that allocates), and a list copy is one step.
        return _release(list(self.caches.values()))

    def _release_caches_once(self, _requested: int, attempt: int) -> bool:
        """An ``OnOutOfMemory`` callback: the pool is full, so the caches give their blocks back
        and the allocation is tried once more, where they held any."""
        return attempt == 1 and self.release_cached() > 0


class Budget:
    """The process's budget: one capped pool per device, current for the device's route.
    Made by :func:`budget`; :meth:`close` puts the previous pools back."""

    def __init__(self, devices: dict[int, _Device]):
        self._devices = devices
        self._outside: dict[int, Any] = {}
        # What closing puts back: CuPy (the module the budget installed in, which a failed
        # import may have taken out of `sys.modules` since), its allocator before the budget's,
        # and the budget's own.
        self._cupy: tuple[Any, Any, Any] | None = None
        # Set under `_cupy_choice` by close(): no allocator of this budget's is installed after.
        self._closed = False
        # The CuPy allocators the budget made, by device (installed as their `malloc`).
        self._cupy_allocators: dict[int, Any] = {}

    @property
    def devices(self) -> dict[int, int]:
        """The limit of each device, in bytes."""
        return {ordinal: device.limit for ordinal, device in self._devices.items()}

    def pool(self, device: int) -> MemPool:
        """The pool that holds ``device``'s budget."""
        return self._device(device).pool

    def resource(self, library: str, device: int) -> Any:
        """The resource a plug-in library draws through on ``device``: the budget's pool,
        counted for that library (through a cache for CuPy; for ``"torch"``, one
        ``cumempool.torch`` accepts, without the hook that has the caches give their blocks back
        when the pool is full)."""
        return self._device(device).resource(library)

    def resource_or_outside(self, library: str, device: int) -> Any:
        """As :meth:`resource` on a device of the budget; on another device, a resource over
        that device's current pool, outside the budget (as CuPy's default pool is for CuPy)."""
        if device in self._devices:
            return self.resource(library, device)
        from ._native import current_pool

        return _kept(self._outside, device, lambda: PoolResource(current_pool(Route.device(device))))

    def gave(self, resource: Any) -> bool:
        """Whether ``resource`` is one this budget gave a library to draw through."""
        return any(top is resource for device in self._devices.values() for top in list(device.tops.values()))

    def _device(self, device: int) -> _Device:
        found = self._devices.get(device)
        if found is None:
            from .errors import InvalidDeviceError

            raise InvalidDeviceError(f"device {device} has no budget: the budget covers devices {sorted(self._devices)}")
        return found

    def cupy_allocator(self, device: int) -> Any:
        """The :class:`cumempool.cupy.Allocator` the budget serves CuPy through on ``device``
        (installed as its ``malloc``): its ``release_captured()`` gives back the memory kept
        for CuPy's CUDA graphs, once they are gone, and ``captured_bytes`` says how much that
        is. None while CuPy is not on the budget (not imported yet, or an allocator of the
        program's own kept); ``InvalidDeviceError`` for a device the budget does not cover."""
        self._device(device)
        return self._cupy_allocators.get(device)

    def release_cached(self) -> int:
        """Gives the free blocks the libraries' caches keep back to the budget's pools, for the
        other libraries; the bytes given back."""
        return _release([cache for device in self._devices.values() for cache in list(device.caches.values())])

    def close(self) -> None:
        """Puts back the pools that were current before (what the libraries allocated stays
        valid: the pools live while their memory does)."""
        global _active
        for device in self._devices.values():
            device.guard.restore()
        try:
            # What the caches keep free goes back to the pools, which live on while memory
            # drawn from them does.
            self.release_cached()
        finally:
            # Closed even where a release failed or CuPy's allocator could not be put back:
            # the budget is out of force either way.
            try:
                # Held here already: a signal handler or finalizer running inside this thread's
                # own install or close, which puts back once the allocator it waits for is set.
                nested = _cupy_choice_held_here()
                with _cupy_choice:
                    try:
                        if not nested:
                            _holder_is_putting_back_left(False)
                        self._closed = True
                        if nested and not _holder_putting_back_left:
                            _left_to_put_back.append(self)
                        elif self._cupy is not None:
                            _put_back_cupy_allocator(*self._cupy)
                    finally:
                        if not nested:
                            _put_back_left()
            finally:
                if nested:
                    # Not `_lock`: another thread may hold it and wait for `_cupy_choice`, which
                    # this thread holds (a finalizer there closing a budget while that thread
                    # makes a library's resource): both would wait forever. The compare and
                    # clear is not one step then: a budget made on a third thread between a
                    # second close of this one and this line would be left out of `active()`.
                    if _active is self:
                        _active = None
                else:
                    with _lock:
                        if _active is self:
                            _active = None

    def __repr__(self) -> str:
        limits = ", ".join(f"{d}: {device.limit}" for d, device in sorted(self._devices.items()))
        return f"Budget({{{limits}}})"


# Reentrant: a finalizer (the collector runs them wherever an allocation sets it off) or a signal
# handler that closes a budget may run while this thread holds it, making a library's resource
# (`_Device.resource`) or the budget itself; close() takes it last, and would wait for this
# thread forever.
_lock = threading.RLock()
_active: Budget | None = None


def _kept(table: dict[int, Any], key: int, make: Callable[[], Any]) -> Any:
    """``table[key]``, made by ``make()`` where missing: made outside `_lock` and kept under it,
    the first one kept winning (as `_Device.resource` makes a library's resource)."""
    found = table.get(key)
    if found is not None:
        return found
    made = make()
    with _lock:
        return table.setdefault(key, made)


# Set under `_lock` while `budget()` makes the pools of a budget (so by the thread that holds it).
_making = False


# Taken around a budget's install of its CuPy allocator and around close()'s put-back, so that
# a close on one thread and an install on another (CuPy imported there) do not interleave. Taken
# only by `with` on the lock itself, whose entry and exit are each one call into C: an interrupt
# (a signal handler's exception) cannot come between the acquire and the code that would let go
# of it, as it could in a Python `__enter__` or `__exit__` (the lock would stay taken, and the
# thread seem inside it, for good). Reentrant: a signal handler or finalizer that closes a budget
# on the thread that holds it (while that thread waits for its own thread to read or set CuPy's
# allocator) must not wait for it, which would never end. Such a nested close leaves its put-back
# in `_left_to_put_back`, which the holder runs last before it lets go (`_put_back_left`),
# whatever the code it was running found or raised.
_cupy_choice = threading.RLock()
_left_to_put_back: list[Budget] = []
# Set (under `_cupy_choice`) once its holder has made its own change of CuPy's allocator and
# puts back what nested closes left (`_put_back_left`): a close nested from then on puts back
# itself, as no change of the holder's is pending, and the holder may have taken its last look
# at `_left_to_put_back` (a handler due as that look returns runs before the lock is let go of).
# Cleared by each outermost holder as it takes the lock.
_holder_putting_back_left = False


def _holder_is_putting_back_left(putting: bool) -> None:
    global _holder_putting_back_left
    _holder_putting_back_left = putting


def _cupy_choice_held_here() -> bool:
    """Whether this thread holds `_cupy_choice` (the nested code must leave CuPy's allocator to
    the holder, which looks at what it left once its own change is made)."""
    return bool(_cupy_choice._is_owned())  # type: ignore[attr-defined]


def _put_back_left() -> None:
    """Puts back CuPy's allocator for the budgets closed inside this thread's hold of
    `_cupy_choice`: the last thing the outermost holder does under it (a close nested in this
    call adds to the list, which the loop takes then; a close nested once it began, or after it
    returned, puts back itself)."""
    _holder_is_putting_back_left(True)
    while _left_to_put_back:
        closed = _left_to_put_back.pop()
        if closed._cupy is not None:
            _put_back_cupy_allocator(*closed._cupy)


def _put_back_cupy_allocator(cupy: Any, previous: Any, installed: Any) -> None:
    """Makes ``previous`` CuPy's global allocator again where the budget's ``installed`` still
    is (an allocator the program set since stays). Where no thread of its own can start for it
    (see :func:`_outside_cupys_scopes`), done here, with a warning: inside a scope here, CuPy
    keeps the closed budget's allocator."""

    def put_back() -> None:
        if cupy.cuda.get_allocator() is installed:
            cupy.cuda.set_allocator(previous)

    try:
        _outside_cupys_scopes(put_back)
    except _NoThread as error:
        try:
            put_back()
        except ValueError:  # inside a scope of the budget's own allocator
            pass
        warnings.warn(
            f"cumempool could not put CuPy's allocator from before the budget back on a thread of its own ({error}): "
            "if the budget was closed inside cupy.cuda.using_allocator, CuPy keeps the closed budget's allocator; "
            "call cupy.cuda.set_allocator() outside the scope to choose another",
            stacklevel=3,
        )


class _NoThread(Exception):
    """No thread could start (the reason is the message)."""


_T = TypeVar("_T")


def _outside_cupys_scopes(work: Callable[[], _T], *, again: bool = True) -> _T:
    """``work()``, which reads or sets CuPy's global allocator, run where no
    ``cupy.cuda.using_allocator`` scope hides it: inside one, CuPy shows its thread the scoped
    allocator instead of the global one and refuses to set the global one there. So it runs on a
    thread of its own, or on the calling thread once the interpreter shuts down (no thread can
    run then; Python 3.10 and 3.11 would wait for one forever, and no scope is open). Raises
    :class:`_NoThread` where a thread could not start otherwise, and what ``work`` raised.

    ``work`` calls CuPy's ``get_allocator`` and ``set_allocator`` only, and imports nothing:
    the budget installs CuPy's allocator from inside CuPy's first import, whose module lock the
    calling thread holds while it waits here, so an import of CuPy on the other thread would
    wait for it forever."""
    if sys.is_finalizing():
        return work()
    done: list[_T] = []
    failed: list[BaseException] = []
    # Held by the thread while it runs `work`; `given_up` set under it by a caller interrupted
    # in `Thread.start`, so that `work` is over, or never runs, when that caller goes on.
    running = threading.Lock()
    given_up: list[bool] = []

    def run() -> None:
        with running:
            if given_up:
                return
            try:
                done.append(work())
            except BaseException as error:  # raised on the calling thread below
                failed.append(error)

    thread = threading.Thread(target=run, name="cumempool-cupy-allocator")
    try:
        thread.start()
    except RuntimeError as error:
        raise _NoThread(str(error)) from error
    except BaseException:
        # Interrupted (KeyboardInterrupt) while `start` waited for the thread to begin. Once it
        # has begun (alive, or over) it runs `work`: waited for as below. Before, whether it will
        # run cannot be told from the Thread (its OS thread may exist without having set its
        # `ident`: it waits for the GIL; and `join()` raises RuntimeError until it has begun), so
        # the gate: work that has begun meanwhile is waited for, work that has not never runs
        # (an install left running set CuPy's allocator after the half-made budget's close had
        # put it back), and is done once more on a thread of its own (a close's put-back given
        # up left CuPy on the closed budget); where that start is interrupted too, given up.
        if thread.is_alive() or done or failed:
            thread.join()
        else:
            with running:
                given_up.append(True)
            if again and not done and not failed:
                try:
                    _outside_cupys_scopes(work, again=False)
                except _NoThread:
                    pass  # the interrupt goes on, `work` not done, as where it came before `start`
        raise
    try:
        thread.join()
    except BaseException:
        # Interrupted (KeyboardInterrupt): `work` is two calls into CuPy, waited for so that
        # it never changes CuPy's allocator after the caller has gone on.
        thread.join()
        raise
    if failed:
        raise failed[0]
    return done[0]


def active() -> Budget | None:
    """The budget in force, if any."""
    return _active


def report_if_drawn_from(resource: Any, device: int) -> str | None:
    """The report of ``device`` where ``resource`` is one the budget in force gave a library;
    None for a resource of the program's own, which the budget did not refuse."""
    budget_now = _active
    if budget_now is None or not budget_now.gave(resource):
        return None
    return report(device)


def budget(total: int | str | None = None, *, devices: dict[int, int | str] | None = None) -> Budget:
    """Puts every CUDA library of the process on one budget: ``total`` bytes on each device
    (``"8GiB"`` or an int), and the sizes ``devices`` names (``{0: "8GiB", 1: "4GiB"}``) for
    their devices. ``total`` covers the device ``LOCAL_RANK`` names (one rank of ``torchrun``),
    else every visible device; without ``total``, only the devices ``devices`` names. Call it
    before the libraries allocate (before PyTorch is imported, for PyTorch): what they
    allocated before stays outside the budget.

    A script that chose an allocator itself is not overridden: a ``PYTORCH_CUDA_ALLOC_CONF``
    naming another backend, ``NUMBA_CUDA_MEMORY_MANAGER``, or a CuPy allocator other than
    CuPy's default pool is kept, with a warning that the library is outside the budget.
    """
    global _active, _making
    limits = _limits(total, devices)
    with _lock:
        if _making:
            # The lock is reentrant: this call runs inside another `budget()` on this thread
            # (a signal handler, a finalizer), which has checked `_active` already.
            raise RuntimeError("a budget is being made on this thread (this call runs inside it): make it after")
        if _active is not None:
            raise RuntimeError(f"a budget is in force already ({_active!r}): close it first")
        made: dict[int, _Device] = {}
        made_budget: Budget | None = None
        _making = True
        try:
            for ordinal, limit in limits.items():
                route = Route.device(ordinal)
                pool = MemPool(route, max_size=limit)
                made[ordinal] = _Device(ordinal, limit, pool, set_current_pool(route, pool))
            made_budget = _active = Budget(made)
        except BaseException:
            # Out of force again where an interrupt came once it was in force.
            if made_budget is not None and _active is made_budget:
                _active = None
            for device in made.values():
                device.guard.restore()
            raise
        finally:
            _making = False
    try:
        _choose_torch_backend()
        _after_import("cupy", _install_cupy)
        _after_import("numba.cuda", _install_numba)
    except BaseException:
        # A warning made an error (`-W error`), say: the budget is not left half in force.
        made_budget.close()
        raise
    return made_budget


def _limits(total: int | str | None, devices: dict[int, int | str] | None) -> dict[int, int]:
    """Each device's limit: ``total`` on the devices it covers alone (the ``LOCAL_RANK``
    device, else every visible one), then each size ``devices`` names for its device, in place
    of ``total``'s or beside it; without ``total``, only the devices named."""
    if total is None and not devices:
        raise ValueError("give the budget: budget('8GiB'), or per device: budget(devices={0: '8GiB'})")
    limits = {} if total is None else _each_device(parse_size(total))
    named: set[int] = set()
    for ordinal, size in (devices or {}).items():
        if int(ordinal) in named:
            raise ValueError(f"device {int(ordinal)} is given a size twice: give each device once")
        named.add(int(ordinal))
        limits[int(ordinal)] = parse_size(size)
    return limits


def _each_device(size: int) -> dict[int, int]:
    """``size`` on the device ``LOCAL_RANK`` names (one rank of ``torchrun``), else on every
    visible device."""
    from ._native import Device
    from .errors import InvalidDeviceError

    count = Device.count()
    if count == 0:
        raise InvalidDeviceError("no CUDA device is visible to this process, so there is nothing to put on a budget")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return {ordinal: size for ordinal in range(count)}
    try:
        rank = int(local_rank, 10)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local_rank!r} is not a rank: torchrun sets it to 0, 1, ...") from None
    if rank < count:
        return {rank: size}
    if count == 1:
        return {0: size}  # one GPU per rank (CUDA_VISIBLE_DEVICES set per rank): the rank's is device 0
    raise InvalidDeviceError(
        f"LOCAL_RANK={rank} names no device: this process sees {count}; give each device's size alone, "
        "without a budget for every device (--device N=SIZE without --budget; budget(devices={N: size}))"
    )


# ---- PyTorch: the cudaMallocAsync backend, chosen before import -------------------------------


# Where PyTorch reads its allocator's settings: both names from 2.9 on (which one wins where
# both are set has changed between versions, so the budget reads and writes both).
_TORCH_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _torch_settings() -> dict[str, str]:
    """PyTorch's allocator settings in the environment, by variable."""
    return {name: os.environ[name] for name in _TORCH_SETTINGS if os.environ.get(name)}


def _backend_named(setting: str) -> str | None:
    found = re.search(r"backend\s*:\s*(\w+)", setting)
    return found.group(1) if found else None


def _other_backend(settings: dict[str, str]) -> tuple[str, str] | None:
    """The first variable that names a backend other than ``cudaMallocAsync``, and that backend."""
    for name, setting in settings.items():
        backend = _backend_named(setting)
        if backend is not None and backend != "cudaMallocAsync":
            return name, backend
    return None


def _choose_torch_backend() -> None:
    settings = _torch_settings()
    other = _other_backend(settings)
    if other is not None:
        name, backend = other
        warnings.warn(
            f"{name}={settings[name]!r} chooses PyTorch's {backend} allocator, which the "
            "budget does not cover; leave the backend out (or name cudaMallocAsync) to put PyTorch on it",
            stacklevel=3,
        )
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        if _allocator_backend(torch) == "cudaMallocAsync":
            return  # imported before, on the backend the budget needs: routing reaches it
        warnings.warn(
            "PyTorch was imported before the budget: it keeps the allocator it chose then; make the budget "
            "before importing torch (python -m cumempool run does)",
            stacklevel=3,
        )
        return
    for name in settings or ("PYTORCH_CUDA_ALLOC_CONF",):
        if _backend_named(settings.get(name, "")) is None:
            os.environ[name] = ",".join(filter(None, [settings.get(name, ""), "backend:cudaMallocAsync"]))
    # The program may change the settings before it imports torch (a training script's first
    # lines often do): what PyTorch reads then is checked when it loads.
    _after_import("torch", _check_torch_settings)


def _check_torch_settings(_torch: Any) -> None:
    """Warns, when PyTorch loads under a budget, where the settings it reads no longer put it on
    the ``cudaMallocAsync`` backend (read from the environment, as PyTorch reads them, without
    asking PyTorch anything)."""
    if _active is None:
        return
    settings = _torch_settings()
    # Which variable PyTorch reads first has changed between versions: each one set must name it.
    if settings and all(_backend_named(setting) == "cudaMallocAsync" for setting in settings.values()):
        return
    other = _other_backend(settings)
    lacking = next((name for name, setting in settings.items() if _backend_named(setting) is None), "PYTORCH_CUDA_ALLOC_CONF")
    name = other[0] if other is not None else lacking
    _warn_safely(
        f"PyTorch loaded with {name}={settings.get(name, '')!r}, changed by the program after the budget was "
        "made: PyTorch runs its own allocator, outside the budget and usage(); keep backend:cudaMallocAsync in "
        "it to put PyTorch on the budget"
    )


# ---- CuPy and Numba: plug-ins installed when the library is imported ------------------------


def _install_cupy(cupy: Any) -> None:
    budget_now = _active
    if budget_now is None:
        return
    if _cupy_choice_held_here():
        # A signal handler or finalizer made this budget inside another's choice of CuPy's
        # allocator on this thread, which is not over: two choices at once could end either way.
        warnings.warn(
            "cumempool was choosing CuPy's allocator on this thread when the budget was made (from a signal "
            "handler or a finalizer): CuPy stays outside this budget",
            stacklevel=2,
        )
        return
    try:
        current = _outside_cupys_scopes(cupy.cuda.get_allocator)
    except _NoThread:
        current = cupy.cuda.get_allocator()
    default = getattr(cupy.get_default_memory_pool(), "malloc", None)
    if (
        current is not None
        and default is not None
        and getattr(current, "__self__", None) is not getattr(default, "__self__", None)
    ):
        warnings.warn("CuPy has an allocator of its own already: it stays, outside the budget", stacklevel=2)
        return
    from .cupy import Allocator

    allocators = {ordinal: Allocator(budget_now.resource("cupy", ordinal)) for ordinal in budget_now.devices}

    def outside(size: int) -> Any:
        return cupy.get_default_memory_pool().malloc(size)  # a device outside the budget

    def allocate(size: int) -> Any:
        allocator = allocators.get(cupy.cuda.runtime.getDevice())
        return outside(size) if allocator is None else allocator(size)

    installed: Callable[[int], Any] = allocate
    if len(allocators) == 1:
        # One device (one rank's): its allocator's own `malloc`, one call less per allocation,
        # which CuPy makes without an argument tuple. Kept, so that `close()` finds it installed.
        (only,) = allocators.values()
        only._elsewhere = outside
        installed = only.malloc

    def install() -> bool:
        if cupy.cuda.get_allocator() is not current:
            return False  # another thread set one meanwhile: the program's own
        cupy.cuda.set_allocator(installed)
        return True

    with _cupy_choice:
        try:
            _holder_is_putting_back_left(False)
            if budget_now._closed:
                return
            # Known to the budget before it is installed, so that a close after an interruption
            # here puts back what was installed (close changes CuPy's allocator only where it is
            # `installed`).
            budget_now._cupy_allocators = allocators
            budget_now._cupy = (cupy, current, installed)
            try:
                done = _outside_cupys_scopes(install)
            except _NoThread:
                done = install()  # right unless a scope is open on this thread, where CuPy refuses
            if not done:
                budget_now._cupy_allocators, budget_now._cupy = {}, None
        finally:
            # A close on this thread while it waited (a signal handler, a finalizer, before or
            # after the install was seen done, or one that raised out of the wait) left the
            # put-back to this install.
            _put_back_left()
    if not done:
        warnings.warn("CuPy has an allocator of its own already: it stays, outside the budget", stacklevel=2)


def _install_numba(numba_cuda: Any) -> None:
    budget_now = _active
    if budget_now is None:
        return
    if os.environ.get("NUMBA_CUDA_MEMORY_MANAGER"):
        warnings.warn("NUMBA_CUDA_MEMORY_MANAGER names a memory manager: it stays, outside the budget", stacklevel=2)
        return
    from .numba import manager_for

    # Numba keeps the manager a context was made with for the context's life (one per device,
    # for the process): so the manager asks for the budget in force at each allocation, and
    # without one draws from the device's default pool (`_numba_resource`).
    follows_the_budgets = manager_for(_numba_resource)
    follows_the_budgets.serves_cumempool_budgets = True  # type: ignore[attr-defined]
    numba_cuda.set_memory_manager(follows_the_budgets)
    made = _numba_contexts_made()
    if made:
        warnings.warn(
            f"Numba made its context of device(s) {made} before the budget: a context keeps the memory "
            "manager it was made with, so Numba's allocations there stay outside the budget "
            "(start the budget before Numba's first CUDA use)",
            stacklevel=2,
        )


def _numba_contexts_made() -> list[int]:
    """The devices Numba has made its (primary) context of already with a memory manager other
    than the budgets' (a context made under an earlier budget follows the budget in force);
    none where Numba's driver object does not say (a Numba without these attributes)."""
    try:
        from numba.cuda.cudadrv import driver as numba_driver

        # Numba's `Driver.devices` holds each device it opened, and a device's
        # `primary_context` is set once Numba made its context (a plain attribute: reading it
        # initialises nothing).
        opened = dict(vars(numba_driver.driver).get("devices") or {})
        return sorted(
            number
            for number, device in opened.items()
            if (context := getattr(device, "primary_context", None)) is not None
            and not getattr(getattr(context, "memory_manager", None), "serves_cumempool_budgets", False)
        )
    except Exception:
        return []


def _numba_resource(ordinal: int) -> Any:
    budget_now = _active
    if budget_now is not None:
        return budget_now.resource_or_outside("numba", ordinal)
    # No budget in force (Numba's context was made under one that closed): the device's default
    # pool, which the driver owns and no program destroys, as no pool was chosen for Numba.
    from ._native import default_pool

    return _kept(_outside_any_budget, ordinal, lambda: PoolResource(default_pool(Route.device(ordinal))))


# Numba's resource per device where no budget is in force.
_outside_any_budget: dict[int, Any] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a function on a module right after it is first imported (CuPy's and Numba's
    allocator settings must be made before the program's first allocation, and importing them
    early would slow every program that never uses them).

    It only wraps the loader the finders after it choose (numba-cuda, say, puts `numba.cuda`
    elsewhere with a finder of its own), and hands the module its real loader back before the
    module's code runs. A function is used up only once its module has loaded: a lookup that
    loads nothing (`importlib.util.find_spec`) or a failed import leaves it waiting. What the
    function raises is reported as a warning, never as the import's failure."""

    def __init__(self) -> None:
        self.waiting: dict[str, Callable[[Any], None]] = {}
        self._looking = threading.local()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting or getattr(self._looking, "name", None) == name:
            return None
        self._looking.name = name
        try:
            spec = self._spec_from_the_others(name, path, target)
        finally:
            self._looking.name = None
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThen(spec.loader, name, self)
        return spec

    def _spec_from_the_others(self, name: str, path: Any, target: Any) -> Any:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                return spec
        return None

    def loaded(self, name: str, module: Any) -> None:
        """Runs (once) what waits for `name`, now that `module` has loaded."""
        then = self.waiting.pop(name, None)
        if then is None:
            return
        try:
            then(module)
        except Exception as error:  # a setup that fails must not fail the program's import
            _warn_safely(f"cumempool could not put {name} on the budget: {error}")


def _warn_safely(message: str) -> None:
    """A warning that reaches the user even where warnings are errors (`-W error`)."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    except Exception:
        print(f"warning: {message}", file=sys.stderr)


class _LoaderThen(importlib.abc.Loader):
    """The real loader, and then the finder's function; forwards every other request."""

    def __init__(self, loader: Any, name: str, finder: _AfterImport) -> None:
        self.loader, self.name, self.finder = loader, name, finder

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module, and whoever reads its data later, see the real loader.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.loaded(self.name, module)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.loader, attribute)


_finder = _AfterImport()


def _after_import(name: str, then: Callable[[Any], None]) -> None:
    _finder.waiting[name] = then
    if name in sys.modules:
        _finder.loaded(name, sys.modules[name])
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


# ---- who holds what -------------------------------------------------------------------------


def usage() -> dict[int, dict[str, Any]]:
    """Per device of the budget: ``limit``, the pool's ``used`` and ``reserved`` bytes, and per
    library the bytes in use, the peak, the count of live allocations and the share of the
    limit. The plug-in libraries (``cupy``, ``numba``) are counted allocation by allocation, as
    the pool serves them: CuPy's bytes are its cache's size classes, and ``cached`` what its
    cache keeps free (in the pool's use, not in ``bytes``; ``peak`` includes it).

    PyTorch draws through routing (its ``cudaMallocAsync`` backend), which passes no code of
    cumempool's, and its own counters read the pool it configured, not the budget's: so while
    PyTorch uses the route, ``torch`` is the pool's use less what the plug-ins counted, marked
    ``"counted": "routed"``, with no peak or count; its ``includes`` names what else could draw
    from the route directly and so is counted with it (cuda.core's default resource when
    cuda.core is loaded, and any direct ``cudaMallocAsync``). Without PyTorch on the route, that
    remainder is ``unattributed``, never dropped. Empty without a budget."""
    budget_now = _active
    if budget_now is None:
        return {}
    answer: dict[int, dict[str, Any]] = {}
    torch_routed = _torch_on_the_route()
    direct = (["cuda.core default resource"] if "cuda.core" in sys.modules else []) + ["direct cudaMallocAsync"]
    for ordinal, device in budget_now._devices.items():
        used, reserved = device.pool.used_mem_current, device.pool.reserved_mem_current
        libraries: dict[str, dict[str, Any]] = {}
        for name, counted in sorted(device.libraries.items()):
            # Counted right above the pool: a cache's free blocks are in it, and set apart.
            counts = counted.usage()
            cache = device.caches.get(name)
            cache_stats = cache.stats() if cache is not None else {"cached_bytes": 0, "cached_blocks": 0}
            cached = min(cache_stats["cached_bytes"], counts["current_bytes"])
            libraries[name] = {
                "bytes": counts["current_bytes"] - cached,
                "peak": counts["peak_bytes"],
                "count": max(0, counts["current_count"] - cache_stats["cached_blocks"]),
                "cached": cached,
            }
        remainder = max(0, used - sum(held["bytes"] + held["cached"] for held in libraries.values()))
        if torch_routed:
            # A resource the program drew for "torch" itself (`Budget.resource`) keeps its own
            # counted entry beside the routed one.
            routed_name = "torch" if "torch" not in libraries else "torch (routed)"
            libraries[routed_name] = {
                "bytes": remainder,
                "peak": None,
                "count": None,
                "cached": 0,
                "counted": "routed",
                "includes": direct,
            }
            remainder = 0
        libraries["unattributed"] = {"bytes": remainder, "peak": None, "count": None, "cached": 0, "includes": direct}
        for held in libraries.values():
            held["share"] = held["bytes"] / device.limit
        answer[ordinal] = {"limit": device.limit, "used": used, "reserved": reserved, "libraries": libraries}
    return answer


def _torch_on_the_route() -> bool:
    """Whether PyTorch has used CUDA with its ``cudaMallocAsync`` backend, which draws from the
    device's current pool: the budget's. Process-wide: on a device of the budget PyTorch never
    used, the routed bytes are another direct user's, which the figure's ``includes`` names."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized() and _allocator_backend(torch) == "cudaMallocAsync"


def _allocator_backend(torch: Any) -> str | None:
    """The allocator backend PyTorch runs (``"native"``, ``"cudaMallocAsync"``), or None where
    it cannot say."""
    try:
        return str(torch.cuda.memory.get_allocator_backend())
    except (AttributeError, RuntimeError):
        return None


def report(device: int | None = None) -> str:
    """What an out-of-memory error under the budget says: the limit, who holds what (with each
    library's largest live allocation and its stack while :func:`record_history` records),
    reserved against used, and what to do. For ``device`` (default: every device of the
    budget)."""
    figures = usage()
    if not figures:
        return "no cumempool budget is in force"
    if device is not None and device not in figures:
        return f"device {device} has no cumempool budget (the budget covers devices {sorted(figures)})"
    lines = []
    for ordinal, of_device in sorted(figures.items()):
        if device is not None and ordinal != device:
            continue
        limit, used, reserved = of_device["limit"], of_device["used"], of_device["reserved"]
        lines.append(f"cumempool budget of device {ordinal}: {size_text(used)} of {size_text(limit)} in use ({used / limit:.0%})")
        holders = sorted(of_device["libraries"].items(), key=lambda item: -item[1]["bytes"])
        largest = _history.largest_live(ordinal, _active.gave if _active is not None else None)
        for name, held in holders:
            if held["bytes"] == 0 and name == "unattributed":
                continue
            count = f" in {held['count']} allocations" if held["count"] is not None else ""
            if held["cached"]:
                count += f", and {size_text(held['cached'])} its cache keeps free"
            how = ""
            if held.get("counted") == "routed":
                how = f" (through routing: the pool's use less what cumempool counted, {' and '.join(held['includes'])} included)"
            elif name == "unattributed":
                how = f" (drawn from the pool directly: {' or '.join(held['includes'])})"
            lines.append(f"  {name:<14} {size_text(held['bytes']):>10} ({held['share']:.0%}){count}{how}")
            if largest is not None and name in largest:
                allocation = largest[name]
                lines.append(f"      largest live: {size_text(allocation.size)} {_history.where(allocation)}")
        if largest is None:
            lines.append(
                "  largest allocations: not recorded (cumempool.record_history() records them, with their Python stacks)"
            )
        if reserved > used:
            lines.append(
                f"  reserved {size_text(reserved)} against {size_text(used)} used: {size_text(reserved - used)} held by the pool but free (fragmentation or freed blocks not yet reused)"
            )
        top = holders[0] if holders and holders[0][1]["bytes"] else None
        if top is None:
            advice = "free memory"
        elif top[0] == "unattributed":
            advice = f"free what is drawn from the pool directly ({' or '.join(top[1]['includes'])})"
        elif top[1].get("counted") == "routed":
            advice = f"free what {top[0]} holds (or what else draws from the pool directly: {' or '.join(top[1]['includes'])})"
        else:
            advice = f"free what {top[0]} holds"
        cached = sum(held["cached"] for held in of_device["libraries"].values())
        if cached:
            advice += f", give back the {size_text(cached)} the caches keep (cumempool.active().release_cached())"
        lines.append(f"  to go on: {advice}, make the budget larger (--budget / cumempool.budget), or use smaller batches")
    return "\n".join(lines)


def size_text(n: float) -> str:
    """Bytes as people read them: ``"1.5 GiB"``, ``"64.0 MiB"``, ``"12 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
