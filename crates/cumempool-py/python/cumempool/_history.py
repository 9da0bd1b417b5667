"""A record of what the plug-in libraries allocate and free through cumempool, and a snapshot
of it in the format PyTorch's memory viewer reads (``torch.cuda.memory._dump_snapshot``'s
pickle, opened with ``torch.cuda._memory_viz`` or pytorch.org/memory_viz).

What is recorded: every allocation and free that CuPy and Numba make through cumempool's
plug-ins (and so under a budget), with its library, device, stream, size, time and, with
``stacks="python"``, the Python stack that asked for it. What PyTorch allocates through routing
reaches the pool without passing through cumempool and is not recorded (``usage()`` counts it
as the pool's use less what the plug-ins counted).

Off, it costs the plug-ins one read of a module global per allocation.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

_lock = threading.Lock()
# Whether the calling thread holds `_lock` (in `_locked`).
_holding = threading.local()
# Records not made yet, oldest first, each with the recorder it belongs to and the step that
# makes it: noted here, and made under `_lock` by the next call that takes it. Either may be
# noted by a finalizer inside a collection that a call holding `_lock` set off (by making an
# object), on the same thread: waiting for the lock there would wait forever.
_pending: deque[tuple[_Recorder, Callable[[_Recorder], None]]] = deque()


@contextlib.contextmanager
def _locked():
    """`_lock`, held, with the records noted before made first (so a free is recorded before an
    allocation that reuses its address)."""
    # Marked before the lock is taken, so no moment holding it is unmarked (a record noted while
    # marked waits in `_pending` for `_record_pending` below).
    _holding.on = True
    try:
        with _lock:
            _record_pending()
            yield
    finally:
        _holding.on = False


@dataclass
class _Live:
    library: str
    size: int
    stream: int
    frames: list[dict[str, Any]]
    source: Any = None  # the resource it was drawn from, where the plug-in said


class _Recorder:
    def __init__(self, stacks: bool, max_entries: int):
        self.stacks = stacks
        self.max_entries = max_entries
        self.traces: dict[int, deque[dict[str, Any]]] = {}
        self.live: dict[tuple[int, int], _Live] = {}

    def trace(self, device: int) -> deque[dict[str, Any]]:
        found = self.traces.get(device)
        if found is None:
            found = self.traces[device] = deque(maxlen=self.max_entries)
        return found


# The recorder while recording, else None: the plug-ins read this one global.
recording: _Recorder | None = None


def record_history(enabled: bool = True, *, stacks: str | None = "python", max_entries: int = 100_000) -> None:
    """Starts (or, with ``enabled=False``, stops) recording the allocations and frees the
    plug-in libraries make through cumempool, with their library, stream, size and, with
    ``stacks="python"``, the Python stack; ``stacks=None`` records no stack (cheaper). The last
    ``max_entries`` events of each device are kept; allocations still live are always known.
    Starting again clears what was recorded."""
    global recording
    if not enabled:
        with _locked():
            recording = None
            _pending.clear()
        return
    if stacks not in ("python", None):
        raise ValueError(f"stacks={stacks!r}: record 'python' stacks or None")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"max_entries must be a whole number of events more than 0, not {max_entries!r}")
    # Made before the lock: a collection its making sets off may record frees, which take it.
    made = _Recorder(stacks == "python", max_entries)
    with _locked():
        recording = made
        _pending.clear()


# This package's folder: its frames are left out of recorded stacks.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _origin(library: str) -> dict[str, Any]:
    """The frame that names the library (the viewer shows it as the allocation's origin)."""
    return {"filename": f"<{library}>", "line": 0, "name": f"{library} allocation (through cumempool)"}


def _frames(library: str) -> list[dict[str, Any]]:
    """The calling Python stack, innermost first, without this package's frames, after the frame
    that names the library. Source lines are not read (only file, line and function)."""
    frames = [_origin(library)]
    for entry in traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False):
        if entry.filename.startswith(_PACKAGE):
            continue
        frames.append({"filename": entry.filename, "line": entry.lineno or 0, "name": entry.name})
    return frames


def note_alloc(library: str, device: int, address: int, size: int, stream: int, source: Any = None) -> None:
    """Records an allocation a plug-in made (while recording). Never waits for a lock the
    calling thread holds (a finalizer run by a collection inside a recording call): the
    allocation is then recorded by the next call."""
    recorder = recording
    if recorder is None:
        return
    frames = _frames(library) if recorder.stacks else [_origin(library)]
    now = _now()
    # Each allocation is its own segment in the snapshot, so the viewer sees it mapped first.
    events = [
        {"action": action, "addr": address, "size": size, "stream": stream, "time_us": now, "frames": frames, "library": library}
        for action in ("segment_alloc", "alloc")
    ]
    live = _Live(library, size, stream, frames, source)

    def record(current: _Recorder) -> None:
        current.live[(device, address)] = live
        current.trace(device).extend(events)

    _note(recorder, record)


def note_free(library: str, device: int, address: int, size: int, stream: int) -> None:
    """Records the free of an allocation a plug-in made: requested now, completed in stream
    order (the viewer shows both). Never waits for a lock the calling thread holds (a
    finalizer run by a collection inside a recording call): the free is then recorded by the
    next call."""
    recorder = recording
    if recorder is None:
        return
    now = _now()

    def record(current: _Recorder) -> None:
        live = current.live.pop((device, address), None)
        if live is None:
            return  # allocated before this recording began: its allocation is not in it either
        current.trace(device).extend(
            {
                "action": action,
                "addr": address,
                "size": size,
                "stream": stream,
                "time_us": now,
                "frames": live.frames,
                "library": library,
            }
            for action in ("free_requested", "free_completed", "segment_free")
        )

    _note(recorder, record)


def _note(recorder: _Recorder, record: Callable[[_Recorder], None]) -> None:
    """Has `record` made for `recorder`: now, under `_lock`, unless the calling thread holds it
    already; then by the next call that takes it."""
    _pending.append((recorder, record))
    if not getattr(_holding, "on", False):
        with _locked():
            pass


def _record_pending() -> None:
    """Makes the records noted so far, under `_lock`; those of an earlier recording are let go
    of."""
    while _pending:
        try:
            recorder, record = _pending.popleft()
        except IndexError:
            return  # another thread took the last one (noted on a thread not holding the lock)
        if recorder is recording:
            record(recorder)


def traced(owner: Any, library: str, device: int, size: int, stream: int, source: Any = None) -> Any:
    """``owner`` (a Buffer a plug-in hands to its library) recorded: the allocation now, the
    free when the library lets go of what is returned. Returns ``owner`` itself when not
    recording."""
    if recording is None:
        return owner
    note_alloc(library, device, owner.ptr, size, stream, source)
    holder = _Traced(owner)
    weakref.finalize(holder, note_free, library, device, owner.ptr, size, stream)
    return holder


class _Traced:
    """What a library holds in place of a Buffer while recording: the buffer, and a weak
    reference point whose end records the free."""

    __slots__ = ("buffer", "ptr", "device", "__weakref__")

    def __init__(self, buffer: Any):
        self.buffer, self.ptr, self.device = buffer, buffer.ptr, buffer.device


def largest_live(device: int, drawn_from: Any = None) -> dict[str, _Live] | None:
    """Each library's largest allocation recorded live on ``device`` (by its library), of those
    ``drawn_from(source)`` accepts, or None when not recording."""
    recorder = recording
    if recorder is None:
        return None
    if getattr(_holding, "on", False):
        entries = list(recorder.live.items())  # this thread holds _lock already: never wait on itself
    else:
        with _locked():
            entries = list(recorder.live.items())
    largest: dict[str, _Live] = {}
    for (of_device, _), live in entries:
        if of_device != device or (drawn_from is not None and not drawn_from(live.source)):
            continue
        known = largest.get(live.library)
        if known is None or live.size > known.size:
            largest[live.library] = live
    return largest


def where(live: _Live, frames: int = 3) -> str:
    """Where an allocation was asked for, innermost frame first, outside the allocating
    library's own files: ``"train.py:42 in step < train.py:80 in main"``, or what to do to know
    it."""
    stack = live.frames[1:]  # after the frame that names the library (`_origin`)
    # The library's own frames (`cupy.empty` in cupy/_creation/basic.py) say less than the
    # caller's: left out where any other frame is left.
    inside = f"{os.sep}{live.library}{os.sep}"
    stack = [frame for frame in stack if inside not in frame["filename"]] or stack
    # Below the script, `python -m` (and `cumempool run`, whose own frames are never recorded)
    # leaves runpy's frames: the launcher's, not the caller's code.
    stack = [frame for frame in stack if not _launcher(frame["filename"])]
    if not stack:
        return "no stack recorded (record_history(stacks='python') records it)"
    shown = " < ".join(f"{os.path.basename(frame['filename'])}:{frame['line']} in {frame['name']}" for frame in stack[:frames])
    return f"at {shown}" + (" < ..." if len(stack) > frames else "")


def _launcher(filename: str) -> bool:
    """Whether a frame is runpy's, which runs a script or module for ``python -m``."""
    return filename == "<frozen runpy>" or os.path.basename(filename) == "runpy.py"


def _now() -> int:
    return time.time_ns() // 1000


# The frame of the block that stands for PyTorch's bytes under a budget.
_ROUTED_TORCH = {
    "filename": "<torch>",
    "line": 0,
    "name": "torch allocations through routing (the budget pool's use less what cumempool counted; not recorded one by one)",
}


def snapshot() -> dict[str, Any]:
    """The live allocations and the recorded events, as PyTorch's memory snapshot
    (``segments`` with their ``blocks``, ``device_traces``), each allocation a segment of one
    block whose first frame names its library; with ``cumempool``: the budget's usage and each
    live allocation's library. Under a budget, what PyTorch holds through routing is one more
    segment, at address 0, of ``usage()``'s ``torch`` bytes: in the segments, not in the
    traces (its allocations are not seen one by one)."""
    from ._budget import usage

    recorder = recording
    with _locked():
        live = dict(recorder.live) if recorder is not None else {}
        traces = {device: list(events) for device, events in recorder.traces.items()} if recorder is not None else {}
    held = usage()
    routed = {
        device: held_bytes
        for device, of_device in held.items()
        if (held_bytes := sum(entry["bytes"] for entry in of_device["libraries"].values() if entry.get("counted") == "routed"))
    }
    devices = max([*traces, *(device for device, _ in live), *routed, -1]) + 1
    # PyTorch's share under a budget, which reaches the pool through routing and is not
    # recorded allocation by allocation: one block at address 0 (no allocation has it), so the
    # viewer shows PyTorch's bytes beside the others'.
    for device, size in routed.items():
        live[(device, 0)] = _Live("torch", size, 0, [_ROUTED_TORCH])
    segments = []
    for (device, address), allocation in sorted(live.items()):
        block = {
            "address": address,
            "size": allocation.size,
            "requested_size": allocation.size,
            "state": "active_allocated",
            "frames": allocation.frames,
        }
        segments.append(
            {
                "device": device,
                "address": address,
                "total_size": allocation.size,
                "allocated_size": allocation.size,
                "active_size": allocation.size,
                "requested_size": allocation.size,
                "stream": allocation.stream,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": allocation.frames,
                "blocks": [block],
            }
        )
    return {
        "segments": segments,
        "device_traces": [traces.get(device, []) for device in range(devices)],
        "allocator_settings": {},
        "cumempool": {
            "usage": held,
            "libraries": {f"{device}:{address:#x}": allocation.library for (device, address), allocation in live.items()},
        },
    }


def dump_snapshot(path: str) -> None:
    """Writes :func:`snapshot` to ``path`` as PyTorch's ``_dump_snapshot`` does (a pickle), for
    ``torch.cuda._memory_viz``, pytorch.org/memory_viz, or ``python -m cumempool plot``."""
    data = snapshot()
    with open(path, "wb") as file:
        pickle.dump(data, file, protocol=4)  # what the viewer's unpickler reads


def load_snapshot(path: str) -> dict[str, Any]:
    """A snapshot :func:`dump_snapshot` (or PyTorch) wrote. It is a pickle: load only files you
    trust, as with any pickle."""
    with open(path, "rb") as file:
        data = pickle.load(file)
    if not isinstance(data, dict) or "device_traces" not in data:
        raise ValueError(f"{path} is not a memory snapshot (no device_traces): write one with cumempool.dump_snapshot")
    return data
