"""The benches that count instructions on the stand-in driver still run (a few calls each)."""

import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize(
    ("script", "arguments", "says"),
    [
        ("cache_pair_on_stand_in.py", ["--pairs", "50"], "50 cache pairs:"),
        ("cupy_call_on_stand_in.py", ["--calls", "50"], "50 calls and frees:"),
    ],
)
def test_a_stand_in_bench_runs(stand_in_libcuda, script, arguments, says):
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=stand_in_libcuda)
    out = subprocess.run([sys.executable, str(BENCH / script), *arguments], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(says), out.stdout
