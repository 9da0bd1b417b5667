"""The picture: allocations and frees recorded from the plug-ins (``record_history``), the
snapshot in PyTorch's memory-viewer format (``snapshot``, ``dump_snapshot``) and the plot
command. The format and the plot run anywhere; the libraries and PyTorch's viewer on the GPU."""

import gc
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import cumempool as cm
from cumempool import _history, _plot
from conftest import library

MIB = 1 << 20


class _Owner:
    """Stands in for a Buffer a plug-in hands its library."""

    def __init__(self, ptr, device=0):
        self.ptr, self.device = ptr, device


@pytest.fixture
def recording():
    cm.record_history(stacks="python")
    yield
    cm.record_history(enabled=False)


def test_off_it_records_nothing_and_returns_the_owner_itself():
    cm.record_history(enabled=False)
    owner = _Owner(0x1000)
    assert _history.traced(owner, "cupy", 0, 64, 7) is owner
    assert cm.snapshot()["segments"] == [] and cm.snapshot()["device_traces"] == []


def test_an_allocation_is_a_segment_until_its_holder_lets_go(recording):
    holder = _history.traced(_Owner(0x2000), "cupy", 0, 4 * MIB, 7)
    _history.note_alloc("numba", 0, 0x9000_0000, MIB, 0)
    data = cm.snapshot()
    by_address = {segment["address"]: segment for segment in data["segments"]}
    assert set(by_address) == {0x2000, 0x9000_0000}
    cupy_segment = by_address[0x2000]
    assert cupy_segment["total_size"] == 4 * MIB and cupy_segment["stream"] == 7
    assert cupy_segment["blocks"][0]["state"] == "active_allocated"
    frames = cupy_segment["blocks"][0]["frames"]
    assert frames[0]["filename"] == "<cupy>"
    assert any(frame["name"].startswith("test_an_allocation") for frame in frames), "the Python stack that asked"
    del holder
    gc.collect()
    data = cm.snapshot()
    assert [segment["address"] for segment in data["segments"]] == [0x9000_0000]
    actions = [event["action"] for event in data["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]


def test_stacks_none_records_the_library_only(recording):
    cm.record_history(stacks=None)
    _history.note_alloc("cupy", 0, 0x3000, 64, 0)
    (segment,) = cm.snapshot()["segments"]
    assert segment["blocks"][0]["frames"] == [{"filename": "<cupy>", "line": 0, "name": "cupy allocation (through cumempool)"}]


def test_where_an_allocation_was_asked_for_is_the_callers_code_not_the_librarys():
    def frame(filename, line, name):
        return {"filename": filename, "line": line, "name": name}

    library_frame = frame(os.path.join("site-packages", "cupy", "_creation", "basic.py"), 22, "empty")
    stack = [_history._origin("cupy"), library_frame, frame("/job/train.py", 42, "step"), frame("/job/train.py", 80, "main")]
    assert _history.where(_history._Live("cupy", 1, 0, stack)) == "at train.py:42 in step < train.py:80 in main"
    only_the_library = [_history._origin("cupy"), library_frame]
    assert _history.where(_history._Live("cupy", 1, 0, only_the_library)) == "at basic.py:22 in empty"
    deep = [_history._origin("numba")] + [frame("/job/a.py", n, "f") for n in range(5)]
    assert _history.where(_history._Live("numba", 1, 0, deep)).endswith("a.py:2 in f < ...")
    assert "record_history(stacks='python')" in _history.where(_history._Live("cupy", 1, 0, [_history._origin("cupy")]))


def test_where_an_allocation_was_asked_for_leaves_out_the_launchers_frames(tmp_path):
    # Under `python -m cumempool run` (or any `python -m`), runpy's frames sit below the
    # script's: they are the launcher's, not the caller's code. Found on the GPU, where the
    # report of a script under `cumempool run` ended in `<frozen runpy>:88 in _run_code`.
    (tmp_path / "launched.py").write_text(
        textwrap.dedent(
            """
            import cumempool
            from cumempool import _history
            cumempool.record_history(stacks="python")
            def load():
                _history.note_alloc("cupy", 0, 0x1000, 4096, 0)
            load()
            print(_history.where(_history.largest_live(0)["cupy"]))
            """
        )
    )
    out = subprocess.run([sys.executable, "-m", "launched"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "at launched.py:6 in load < launched.py:7 in <module>", out.stdout


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="stacks="):
        cm.record_history(stacks="native")
    with pytest.raises(ValueError, match="max_entries"):
        cm.record_history(max_entries=0)


def test_a_snapshot_round_trips_and_plots_without_dependencies(recording, tmp_path):
    _history.note_alloc("cupy", 0, 0x4000, 8 * MIB, 0)
    _history.note_alloc("numba", 0, 0x8000_0000, 2 * MIB, 0)
    _history.note_free("cupy", 0, 0x4000, 8 * MIB, 0)
    path = tmp_path / "snapshot.pickle"
    cm.dump_snapshot(str(path))
    data = pickle.loads(path.read_bytes())
    assert data["cumempool"]["libraries"] == {"0:0x80000000": "numba"}
    lines = _plot.series(data)[0]
    assert lines["cupy"][-1][1] == 0 and lines["numba"][-1][1] == 2 * MIB
    for suffix in ("svg", "html"):
        out = tmp_path / f"usage.{suffix}"
        done = subprocess.run(
            [sys.executable, "-m", "cumempool", "plot", str(path), "-o", str(out)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        text = out.read_text()
        assert "<svg" in text and ">cupy<" in text and ">numba<" in text
    wrong = subprocess.run(
        [sys.executable, "-m", "cumempool", "plot", str(path), "-o", str(tmp_path / "usage.bmp")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode != 0 and "write .svg, .html or .png" in wrong.stderr


def test_plotting_a_file_that_is_no_snapshot_says_so(tmp_path):
    path = tmp_path / "not.pickle"
    path.write_bytes(pickle.dumps({"hello": 1}))
    done = subprocess.run(
        [sys.executable, "-m", "cumempool", "plot", str(path), "-o", str(tmp_path / "x.svg")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "is not a memory snapshot" in done.stderr


# On the GPU: CuPy and Numba under a budget, recorded, beside PyTorch; the snapshot opened with
# PyTorch's own viewer code.
RECORDED = """
import sys, torch, cupy
from numba import cuda
import cumempool
cumempool.record_history(stacks="python")
MIB = 1 << 20
def cupy_work():
    return [cupy.empty(16 * MIB, dtype=cupy.uint8) for _ in range(3)]
def numba_work():
    return cuda.device_array(8 * MIB, dtype="uint8")
kept = cupy_work(), numba_work(), torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
temporary = cupy_work()
del temporary
torch.cuda.synchronize()
cumempool.dump_snapshot(sys.argv[1])
"""


def test_on_the_gpu_the_snapshot_opens_in_pytorchs_viewer_and_plots(gpu, tmp_path):
    for name in ("torch", "cupy", "numba"):
        library(name)
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    snapshot = tmp_path / "snapshot.pickle"
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = subprocess.run(
        [sys.executable, "-m", "cumempool", "run", "--budget", "1GiB", "--", str(script), str(snapshot)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = pickle.loads(snapshot.read_bytes())
    libraries = sorted(set(data["cumempool"]["libraries"].values()))
    assert libraries == ["cupy", "numba", "torch"], data["cumempool"]
    # Three CuPy arrays and one Numba array, recorded; PyTorch's bytes through routing as one.
    assert len(data["segments"]) == 5, data["segments"]
    torch_segment = next(segment for segment in data["segments"] if segment["address"] == 0)
    assert torch_segment["total_size"] == 32 * MIB and torch_segment["frames"][0]["filename"] == "<torch>", torch_segment
    viewer = textwrap.dedent(
        """
        import pickle, sys
        from torch.cuda import _memory_viz as viz
        data = pickle.load(open(sys.argv[1], "rb"))
        print(len(viz.trace_plot(data)) > 0, len(viz.segment_plot(data)) > 0)
        print("summary:", viz.segsum(data).splitlines()[-1 - viz.legend.count(chr(10))])
        print("trace:", viz.trace(data).count(" = "))
        """
    )
    shown = subprocess.run([sys.executable, "-c", viewer, str(snapshot)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.splitlines()[0] == "True True", shown.stdout
    print(shown.stdout)
    png = tmp_path / "usage.png"
    plotted = subprocess.run(
        [sys.executable, "-m", "cumempool", "plot", str(snapshot), "-o", str(png)], capture_output=True, text=True, timeout=120
    )
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out_dir = os.environ.get("CUMEMPOOL_KEEP_PLOT")
    if out_dir:
        import shutil

        shutil.copy(png, os.path.join(out_dir, "usage.png"))
        shutil.copy(snapshot, os.path.join(out_dir, "snapshot.pickle"))


def test_a_free_from_an_earlier_recording_is_not_counted(recording):
    holder = _history.traced(_Owner(0x5000), "cupy", 0, MIB, 0)
    cm.record_history(stacks=None)  # started again: the allocation above is not in this record
    _history.note_alloc("numba", 0, 0x6000, MIB, 0)
    del holder
    gc.collect()
    data = cm.snapshot()
    assert [event["action"] for event in data["device_traces"][0]] == ["segment_alloc", "alloc"]
    assert all(value >= 0 for points in _plot.series(data)[0].values() for _, value in points)


def test_without_stacks_no_stack_is_walked(recording, monkeypatch):
    cm.record_history(stacks=None)
    monkeypatch.setattr(_history.traceback, "walk_stack", lambda frame: pytest.fail("walked the stack"))
    _history.note_alloc("cupy", 0, 0x7000, 64, 0)


def test_pytorchs_routed_bytes_are_one_segment_of_the_snapshot(recording, monkeypatch):
    from cumempool import _budget

    routed = {"bytes": 48 * MIB, "peak": None, "count": None, "counted": "routed", "includes": []}
    figures = {0: {"limit": 1 << 30, "used": 64 * MIB, "reserved": 64 * MIB, "libraries": {"torch": routed}}}
    monkeypatch.setattr(_budget, "usage", lambda: figures)
    _history.note_alloc("cupy", 0, 0x7000, 16 * MIB, 0)
    data = cm.snapshot()
    by_address = {segment["address"]: segment for segment in data["segments"]}
    assert sorted(by_address) == [0, 0x7000]
    assert by_address[0]["total_size"] == 48 * MIB and by_address[0]["frames"][0]["filename"] == "<torch>"
    assert data["cumempool"]["libraries"]["0:0x0"] == "torch"
    # The traces keep only what was recorded one by one.
    assert {event["addr"] for event in data["device_traces"][0]} == {0x7000}
    assert (0, 0) not in _history.recording.live, "the recorder's own record is left as it was"


# Recorded allocations whose holders sit in reference cycles (a CuPy array kept by a traceback's
# frame): `traced_in_a_cycle(i)` records one and lets go of it, for the collector to free.
TRACED_CYCLES = """
import gc
import cumempool as cm
from cumempool import _history
class Owner:  # a Buffer the CuPy plug-in hands CuPy
    def __init__(self, ptr):
        self.ptr, self.device = ptr, 0
def traced_in_a_cycle(i):
    holder = _history.traced(Owner(0x1000 + 64 * i), "cupy", 0, 64, 0)
    cycle = [holder]
    cycle.append(cycle)
cm.record_history(stacks=None)
"""


def _without_hanging(code: str, timeout: float, what: str) -> None:
    try:
        out = subprocess.run(
            [sys.executable, "-c", TRACED_CYCLES + textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} hung: a finalizer run inside it waited for the history lock its thread held")
    assert out.returncode == 0 and out.stdout.split() == ["done"], out.stderr


def test_recording_does_not_hang_when_the_collector_frees_a_recorded_allocation():
    # `note_alloc`, `note_free` and `snapshot` make Python objects while they hold the history's
    # lock; a collection set off there may free a recorded allocation caught in a cycle, and its
    # finalizer records the free: it must not wait for the lock its own thread holds. The
    # default collector thresholds reach that within the first thousand allocations.
    _without_hanging(
        """
    for i in range(20000):
        traced_in_a_cycle(i)
    print("done")
    """,
        60,
        "recording",
    )


def test_starting_the_recording_again_does_not_hang_when_a_collection_frees_a_recorded_allocation():
    # Starting the recording again makes a new recorder. A collection set off by making it (on
    # Python 3.12+ a pending collection runs at the start of the next Python call, the
    # recorder's `__init__`) may free a recorded allocation caught in a cycle, whose finalizer
    # records the free: it must not wait for the lock `record_history` holds. The collection
    # is run at that point by hand, so the test does not depend on the Python version.
    _without_hanging(
        """
    traced_in_a_cycle(0)
    class Recorder(_history._Recorder):
        def __init__(self, *args):
            gc.collect()  # where CPython 3.12+ runs a pending collection: this call's start
            super().__init__(*args)
    _history._Recorder = Recorder
    cm.record_history(stacks=None)  # "Starting again clears what was recorded"
    print("done")
    """,
        30,
        "record_history()",
    )
