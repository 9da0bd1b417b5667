"""examples/one_budget.py: PyTorch (cudaMallocAsync backend), CuPy (MemoryAsyncPool("current"))
and cuda.core (DeviceMemoryResource(0)) share one capped pool made current for device 0; each
fills it and raises its own out-of-memory error, the others allocate again once it has freed, and
the pool's counters show each library's share (the script asserts all of it)."""

import os
import pathlib
import subprocess
import sys

from conftest import library

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "one_budget.py"


def test_one_budget_for_three_libraries(gpu):
    for name in ("torch", "cupy", "cuda.core"):
        library(name)
    # A process of its own: PyTorch reads its backend when imported, and routing is process-wide.
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    out = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr + out.stdout
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "done", out.stdout
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and "MiB" in line}
    assert "OutOfMemoryError" in rows["PyTorch"] and "torch" in rows["PyTorch"], out.stdout
    assert "cupy.cuda.memory.OutOfMemoryError" in rows["CuPy"], out.stdout
    assert "CUDAError" in rows["cuda.core"], out.stdout
    for name, mib in (("PyTorch", 384), ("CuPy", 256), ("cuda.core", 128)):
        assert rows[name].split()[1] == str(mib), rows[name]
