"""bench/workloads.py's parent/child protocol, without a GPU: with --dry-run each configuration
still runs in a process of its own and writes a result file, and the parent builds the tables,
the targets, the checks and the JSON from them; a checksum that differs fails the run."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "bench" / "workloads.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], capture_output=True, text=True, timeout=300)


def test_a_dry_run_goes_through_every_configuration(tmp_path):
    out = run("--rounds", "2", "--json-out", str(tmp_path / "w.json"))
    assert out.returncode == 0, out.stderr + out.stdout
    document = json.loads((tmp_path / "w.json").read_text())
    keys = {c["key"] for c in document["configs"]}
    assert {"torch-native", "torch-recipe", "torch-recipe-threshold", "torch-plugin-cache", "cupy-default", "cupy-plugin-cache"} <= keys
    assert document["rounds_run"] == 2 and document["status"] == 0 and not document["checks"]["mismatches"]
    for config in document["configs"]:
        assert len(config["runs"]) == 2, config["key"]
    recipe = next(c for c in document["configs"] if c["key"] == "torch-recipe")["summary"]
    assert recipe["step.median_s"]["ratio_vs_async"] is not None
    assert all(t["pass"] is not None for t in document["targets"]), document["targets"]
    assert "PASS" in out.stdout and "result: ok" in out.stdout


def test_a_checksum_that_differs_fails_the_run():
    out = run("--quick", "--no-pairs", "--dry-run-skew", "torch-plugin-pool")
    assert out.returncode == 1, out.stdout
    assert "MISMATCH step: torch-plugin-pool" in out.stdout
