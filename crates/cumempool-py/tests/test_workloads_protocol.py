"""bench/workloads.py's parent/child protocol, without a GPU: with --dry-run each configuration
still runs in a process of its own and writes a result file, and the parent builds the tables,
the targets, the checks and the JSON from them; a checksum that differs fails the run."""

import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "workloads.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=300)


def test_a_dry_run_goes_through_every_configuration(tmp_path):
    out = run("--rounds", "2", "--json-out", str(tmp_path / "w.json"))
    assert out.returncode == 0, out.stderr + out.stdout
    document = json.loads((tmp_path / "w.json").read_text())
    keys = {c["key"] for c in document["configs"]}
    assert {
        "torch-native",
        "torch-recipe",
        "torch-recipe-threshold",
        "torch-plugin-cache",
        "cupy-default",
        "cupy-default-again",
        "cupy-plugin-cache",
    } <= keys
    assert document["rounds_run"] == 2 and document["status"] == 0 and not document["checks"]["mismatches"]
    for config in document["configs"]:
        assert len(config["runs"]) == 2, config["key"]
    recipe = next(c for c in document["configs"] if c["key"] == "torch-recipe")["summary"]
    assert recipe["step.median_s"]["ratio_vs_async"] is not None
    assert all(t["pass"] is not None for t in document["targets"]), document["targets"]
    assert "PASS" in out.stdout and "result: ok" in out.stdout
    # The CuPy loop with its allocators alternated in one process: its table, figures and targets.
    assert "allocators alternated block by block in one process" in out.stdout
    alternated = document["interleaved_figures"]
    assert alternated["default MemoryPool"]["ratio"] == 1.0 and "cumempool.budget (plug-in)" in alternated
    assert any("alternated in one process" in t["target"] and t["pass"] is not None for t in document["targets"])


def test_a_checksum_that_differs_fails_the_run():
    out = run("--quick", "--no-pairs", "--dry-run-skew", "torch-plugin-pool")
    assert out.returncode == 1, out.stdout
    assert "MISMATCH step: torch-plugin-pool" in out.stdout


# A `cumempool` whose native module has no benchmark hooks, as a wheel built without the cargo
# feature `bench-hooks` (`pip install ./crates/cumempool-py`); its objects do nothing.
_HOOKLESS_CUMEMPOOL = """
class _Idle:
    def __init__(self, *args, **kwargs): pass
    def __getattr__(self, name): return lambda *args, **kwargs: _Idle()
    name = "stand-in"
Device = Stream = MemPool = CachingResource = PoolResource = _Idle
class Route:
    @staticmethod
    def device(ordinal): return _Idle()
def driver_version(): return (13, 0)
"""


def test_the_pairs_child_runs_without_the_benchmark_hooks_and_says_what_it_skipped(tmp_path):
    package = tmp_path / "site" / "cumempool"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_HOOKLESS_CUMEMPOOL)
    (package / "_native.py").write_text("")
    (tmp_path / "site" / "cupy.py").write_text("raise ImportError('no CuPy here')\n")
    result = tmp_path / "pairs.json"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", "pairs", "--quick", "--result", str(result)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
    )
    assert out.returncode == 0 and result.exists(), out.stderr
    written = json.loads(result.read_text())
    assert not written["errors"], written["errors"]
    assert set(written["pairs"]["seconds"]) == {
        "pool pair",
        "pool pair, let go",
        "cache pair",
        "cache pair, let go",
    }, written["pairs"]
    assert "bench-hooks" in written["rust_pairs_skipped"]


@pytest.fixture
def workloads(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("workloads")


def test_the_alternated_figures_are_the_median_per_cycle_ratio_and_quartiles(workloads):
    rows = workloads.INTERLEAVED_ROWS
    seconds = {rows[0]: [1.0, 2.0, 4.0, 1.0], rows[2]: [2.0, 2.0, 8.0, 1.0]}
    figures = workloads.interleaved_figures({"interleaved": {"seconds": seconds}})
    assert figures[rows[0]]["ratio"] == 1.0
    assert figures[rows[2]]["ratio"] == 1.5  # ratios 2, 1, 2, 1: per cycle, not of medians
    assert figures[rows[2]]["median_s"] == 2.0
    one = workloads.interleaved_figures({"interleaved": {"seconds": {rows[0]: [1.0], rows[3]: [0.9]}}})
    assert one[rows[3]]["q1"] == one[rows[3]]["q3"] == pytest.approx(0.9)


def test_the_alternated_loop_is_an_optional_configuration(workloads):
    assert workloads.BY_KEY[workloads.INTERLEAVED.key].optional


def test_the_table_line_of_a_failed_alternated_child_says_why(workloads):
    # A child that raised writes its traceback as errors["child"] (exit 0, so no "failure"):
    # the table's one line names the cause, the traceback's last line.
    child = {
        "config": "cupy-interleaved",
        "workloads": {},
        "errors": {"child": 'Traceback (most recent call last):\n  File "w.py", line 1\nRuntimeError: boom\n'},
        "skipped": None,
    }
    lines = workloads.interleaved_table(workloads.interleaved_figures(child), child)
    assert len(lines) == 1 and "boom" in lines[0], lines


def test_a_failed_alternated_child_does_not_fail_the_run(workloads, monkeypatch, capsys):
    # The parent with a dry run of the rounds and an alternated child that failed (its process
    # died): reported as an optional configuration's failure, the run still ok.
    real = workloads.run_child

    def run_child(config, args, timeout):
        if config.key == workloads.INTERLEAVED.key:
            return {"config": config.key, "workloads": {}, "errors": {}, "failure": "exit status -11, no result:\nSegfault"}
        return real(config, args, timeout)

    monkeypatch.setattr(workloads, "run_child", run_child)
    monkeypatch.setattr(sys, "argv", ["workloads.py", "--dry-run", "--rounds", "1", "--only", "cupy-default", "--no-pairs"])
    status = workloads.main()
    out = capsys.readouterr().out
    assert status == 0, out
    assert "FAILED (optional configuration) cupy-interleaved" in out and "not measured (exit status -11" in out, out
