"""How PyTorch reads its allocator settings, the facts the budget's handling of
``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` rests on (needs a GPU and PyTorch; each
case runs in a fresh process, since PyTorch reads the settings once).

    PYTHONPATH=.gpu/py python3 crates/cumempool-py/bench/torch_settings.py

Each line: the case, then the backend PyTorch ran (or the last line of its error).
"""

import os
import subprocess
import sys
import tempfile

SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
BACKEND = "torch.cuda.memory.get_allocator_backend()"
ASYNC, NATIVE = "backend:cudaMallocAsync", "backend:native"

# (what the case shows, the environment at start, the program)
CASES = [
    ("PYTORCH_ALLOC_CONF alone names cudaMallocAsync", {"PYTORCH_ALLOC_CONF": ASYNC}, f"import torch; print({BACKEND})"),
    (
        "both set: PYTORCH_ALLOC_CONF native, PYTORCH_CUDA_ALLOC_CONF cudaMallocAsync",
        {"PYTORCH_ALLOC_CONF": NATIVE, "PYTORCH_CUDA_ALLOC_CONF": ASYNC},
        f"import torch; print({BACKEND})",
    ),
    (
        "both set: PYTORCH_ALLOC_CONF cudaMallocAsync, PYTORCH_CUDA_ALLOC_CONF native",
        {"PYTORCH_ALLOC_CONF": ASYNC, "PYTORCH_CUDA_ALLOC_CONF": NATIVE},
        f"import torch; print({BACKEND})",
    ),
    (
        "a backend named after the import, before the first CUDA use",
        {},
        f"import os, torch; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = '{ASYNC}'; torch.zeros(1, device='cuda'); print({BACKEND})",
    ),
    (
        "the backend asked at import, then one named, then CUDA used",
        {},
        f"import os, torch; {BACKEND}; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = '{ASYNC}'; "
        f"torch.zeros(1, device='cuda'); print({BACKEND})",
    ),
    (
        "cudaMallocAsync at import, expandable_segments:True (no backend) set after it",
        {"PYTORCH_CUDA_ALLOC_CONF": ASYNC},
        "import os, torch; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'; "
        f"torch.zeros(1, device='cuda'); print({BACKEND})",
    ),
    (
        "cudaMallocAsync at import, PYTORCH_ALLOC_CONF=expandable_segments:True set after it",
        {"PYTORCH_CUDA_ALLOC_CONF": ASYNC},
        "import os, torch; os.environ['PYTORCH_ALLOC_CONF'] = 'expandable_segments:True'; "
        f"torch.zeros(1, device='cuda'); print({BACKEND})",
    ),
    (
        "expandable_segments:True beside backend:cudaMallocAsync",
        {"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:True,{ASYNC}"},
        f"import torch; torch.zeros(1, device='cuda'); print({BACKEND})",
    ),
]

UNDER_THE_BUDGET = """
import os, torch
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
torch.zeros(1, device="cuda")
print(torch.cuda.memory.get_allocator_backend())
"""


def _last_line(out: subprocess.CompletedProcess) -> str:
    lines = (out.stdout + out.stderr).strip().splitlines()
    return lines[-1][:200] if lines else f"(no output, exit status {out.returncode})"


def main() -> None:
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    clean = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    for what, settings, program in CASES:
        out = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, env={**clean, **settings}, timeout=120
        )
        print(f"{what}: {_last_line(out)}")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "after_import.py")
        with open(script, "w") as file:
            file.write(UNDER_THE_BUDGET)
        command = [sys.executable, "-m", "cumempool", "run", "--budget", "1GiB", "--", script]
        out = subprocess.run(command, capture_output=True, text=True, env=clean, timeout=120)
        print(f"under cumempool run, expandable_segments:True set after the import: {_last_line(out)}")


if __name__ == "__main__":
    main()
