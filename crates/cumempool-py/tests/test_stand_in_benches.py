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


def test_the_two_builds_bench_runs_its_protocol_without_a_gpu(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH / "wheels_ab.py"), f"before={tmp_path}", f"after={tmp_path}", "--repeats", "1", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    for name in ("before", "after"):
        assert f"== {name}, 1 repeats pooled" in out.stdout
    assert "cache pair / CuPy MemoryPool pair" in out.stdout
    assert "plug-in over the cache" in out.stdout


def test_the_two_builds_bench_refuses_a_build_without_its_directory():
    out = subprocess.run([sys.executable, str(BENCH / "wheels_ab.py"), "after"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'after' is not NAME=DIR" in out.stderr
