"""One budget every library obeys (``python -m cumempool run --budget``, ``cumempool.budget``),
and who holds what under it (``cumempool.usage``, the out-of-memory report). The parsing, the
command line and the import hooks run anywhere; the libraries under the budget on the GPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import cumempool as cm
import cumempool._native as native
from conftest import library
from cumempool import _budget
from cumempool.errors import InvalidDeviceError
from test_cupy_capture_host import FAKE_CUPY, _with_fake_cupy
from test_resource_alloc_under_capture import STAND_IN_CAPTURE, run_on_stand_in

MIB = 1 << 20


def test_sizes_are_read_as_people_write_them():
    assert cm.parse_size("8GiB") == 8 << 30
    assert cm.parse_size("512 MiB") == 512 << 20
    assert cm.parse_size("1.5GB") == 1_500_000_000
    assert cm.parse_size(4096) == 4096
    for wrong in ("8 parsecs", "", "-1GiB", "GiB"):
        with pytest.raises(ValueError, match="is not a size"):
            cm.parse_size(wrong)
    with pytest.raises(ValueError, match="more than 0"):
        cm.parse_size(0)
    with pytest.raises(TypeError):
        cm.parse_size(True)


def _run(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "cumempool", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_the_command_says_what_is_missing():
    out = _run("run", "--", "script.py")
    assert out.returncode != 0 and "give the budget: --budget 8GiB" in out.stderr
    out = _run("run", "--budget", "8 parsecs", "--", "script.py")
    assert out.returncode != 0 and "is not a size" in out.stderr
    out = _run("run", "--budget", "1GiB")
    assert out.returncode != 0 and "name the program to run" in out.stderr
    out = _run("run", "--device", "zero=1GiB", "--", "script.py")
    assert out.returncode != 0 and "--device takes N=SIZE" in out.stderr


def test_a_library_is_set_up_right_after_its_first_import(tmp_path):
    # The hook CuPy's and Numba's plug-ins are installed by: run once, after the module's code.
    (tmp_path / "lately_imported.py").write_text("ORDER = ['imported']\n")
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from cumempool import _budget
        _budget._after_import("lately_imported", lambda module: module.ORDER.append("set up"))
        import lately_imported
        import lately_imported
        print(*lately_imported.ORDER)
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["imported", "set", "up"]


def test_pytorch_is_put_on_its_cudamallocasync_backend_unless_the_script_chose_another():
    code = "import os; from cumempool import _budget; _budget._choose_torch_backend(); print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    for before, after in (
        (None, "backend:cudaMallocAsync"),
        ("expandable_segments:True", "expandable_segments:True,backend:cudaMallocAsync"),
        ("backend:native", "backend:native"),
    ):
        env = {name: value for name, value in os.environ.items() if name not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if before is not None:
            env["PYTORCH_CUDA_ALLOC_CONF"] = before
        out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == after
        assert ("budget does not cover" in out.stderr) == (before == "backend:native")


# The script of the issue: PyTorch, CuPy and Numba, knowing nothing of cumempool (until it prints
# what usage() says at the end). Each fills the budget and gets its own error; each allocates
# again once the others free; then each holds a known share.
THREE_LIBRARIES = """
import json, sys
import torch, cupy
from numba import cuda

MIB = 1 << 20
CHUNK = 64 * MIB

def fill(alloc, own_error):
    held = []
    try:
        while len(held) < 64:
            held.append(alloc())
    except own_error as error:
        return held, type(error).__module__ + "." + type(error).__qualname__
    return held, None

libraries = {
    "torch": (lambda: torch.empty(CHUNK, dtype=torch.uint8, device="cuda"), torch.OutOfMemoryError),
    "cupy": (lambda: cupy.empty(CHUNK, dtype=cupy.uint8), cupy.cuda.memory.OutOfMemoryError),
    "numba": (lambda: cuda.device_array(CHUNK, dtype="uint8"), MemoryError),
}
results = {}
for name, (alloc, own_error) in libraries.items():
    held, error = fill(alloc, own_error)
    torch.cuda.synchronize()
    results[name] = {"chunks": len(held), "error": error}
    del held
    cuda.current_context().deallocations.clear()  # Numba defers its frees
    torch.cuda.synchronize()
kept = {
    "torch": [torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")],
    "cupy": [cupy.empty(64 * MIB, dtype=cupy.uint8)],
    "numba": [cuda.device_array(32 * MIB, dtype="uint8")],
}
torch.cuda.synchronize()
import cumempool
usage = cumempool.usage()
try:
    cupy.empty(2048 * MIB, dtype=cupy.uint8)
except cupy.cuda.memory.OutOfMemoryError as error:
    results["report"] = getattr(error, "report", None)
print(json.dumps({"results": results, "usage": {str(k): v for k, v in usage.items()}}))
"""


def test_on_the_gpu_three_libraries_share_one_budget(gpu, tmp_path):
    for name in ("torch", "cupy", "numba"):
        library(name)
    script = tmp_path / "three_libraries.py"
    script.write_text(THREE_LIBRARIES)
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = _run("run", "--budget", "1GiB", "--device", "0=1GiB", "--", str(script), env=env)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    results, usage = answer["results"], answer["usage"]["0"]
    errors = {name: results[name]["error"] for name in ("torch", "cupy", "numba")}
    assert errors["torch"] == "torch.OutOfMemoryError", errors
    assert errors["cupy"].endswith("OutOfMemoryError") and "cupy" in errors["cupy"], errors
    assert errors["numba"] is not None, errors
    for name in ("torch", "cupy", "numba"):
        # 1 GiB in 64 MiB chunks, each library after the others freed: the whole budget, or
        # one chunk less where a library keeps a little of its own.
        assert results[name]["chunks"] >= 14, results
    held = {name: usage["libraries"][name]["bytes"] for name in usage["libraries"]}
    # CuPy and Numba through their plug-ins, counted; PyTorch through routing, the pool's use
    # less what they counted (PyTorch's own counters read 0 under routing): nothing unattributed.
    assert held["cupy"] == 64 * MIB and held["numba"] == 32 * MIB, usage
    assert held["torch"] == 128 * MIB and usage["libraries"]["torch"]["counted"] == "routed", usage
    assert held["unattributed"] == 0, usage
    assert usage["limit"] == 1 << 30 and usage["used"] == 224 * MIB, usage
    assert usage["libraries"]["cupy"]["share"] == pytest.approx(1 / 16)
    report = results["report"]
    assert report is not None and "torch" in report.splitlines()[1], report
    print(report)


TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist
import cumempool
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(x)
world = dist.get_world_size()
exact = bool((x == world * (world + 1) / 2).all().item())
try:
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    capped = False
except torch.OutOfMemoryError:
    capped = True
usage = cumempool.usage()
print("rank", rank, "exact", exact, "capped", capped, "budgeted", sorted(usage), "backend", torch.cuda.memory.get_allocator_backend())
dist.destroy_process_group()
"""


def test_on_the_gpu_torchrun_gives_each_rank_its_budget_and_all_reduce_is_exact(gpu, tmp_path):
    library("torch")
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "-m",
        "cumempool",
        "run",
        "--budget",
        "1GiB",
        "--",
        str(script),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert line.split() == ["rank", "0", "exact", "True", "capped", "True", "budgeted", "[0]", "backend", "cudaMallocAsync"], line


def test_on_the_gpu_a_program_dying_of_pytorch_out_of_memory_gets_the_report(gpu, tmp_path):
    library("torch")
    script = tmp_path / "too_much.py"
    script.write_text("import torch\nx = torch.empty(2 << 30, dtype=torch.uint8, device='cuda')\n")
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    out = _run("run", "--budget", "1GiB", "--", str(script), env=env)
    assert out.returncode != 0 and "OutOfMemoryError" in out.stderr
    assert "cumempool budget of device 0" in out.stderr and "to go on:" in out.stderr, out.stderr[-2000:]


def test_on_the_gpu_cupys_out_of_memory_names_its_largest_allocation_and_its_stack(gpu, tmp_path):
    # The report names the library holding the most memory and, while recording with stacks,
    # where its largest allocation was asked for: the script's function, file and line.
    library("cupy")
    script = tmp_path / "largest.py"
    script.write_text(
        "import cupy, cumempool\n"
        "cumempool.record_history(stacks='python')\n"
        "def load_weights():\n"
        "    return cupy.empty(192 << 20, dtype=cupy.uint8)\n"
        "weights = load_weights()\n"
        "small = [cupy.empty(1 << 20, dtype=cupy.uint8) for _ in range(4)]\n"
        "try:\n"
        "    cupy.empty(128 << 20, dtype=cupy.uint8)\n"
        "except cupy.cuda.memory.OutOfMemoryError as error:\n"
        "    print(error.report)\n"
    )
    out = _run("run", "--budget", "256MiB", "--", str(script))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[1].split()[0] == "cupy", out.stdout
    assert lines[2].split()[:4] == ["largest", "live:", "192.0", "MiB"], out.stdout
    assert lines[2].split()[4:] == ["at", "largest.py:4", "in", "load_weights", "<", "largest.py:5", "in", "<module>"], out.stdout


def test_on_the_gpu_a_budget_closed_inside_cupys_using_allocator_puts_cupys_pool_back(gpu, tmp_path):
    # With CuPy's own `using_allocator` and `set_allocator`: closed inside the scope, the budget
    # still takes its allocator out of CuPy's global one, and CuPy's default pool serves again.
    library("cupy")
    script = tmp_path / "scoped_close.py"
    script.write_text(
        "import cupy, cumempool\n"
        "before = cupy.cuda.get_allocator()\n"
        "budget = cumempool.budget(devices={0: '64MiB'})\n"
        "installed = cupy.cuda.get_allocator()\n"
        "with cupy.cuda.using_allocator(before):\n"
        "    budget.close()\n"
        "x = cupy.ones(1 << 20, dtype=cupy.uint8)\n"
        "print(installed is not before, cupy.cuda.get_allocator() is before, int(x.sum()))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", str(1 << 20)], out.stdout


# Review findings on the import hook, each run in a fresh process with a package of its own.
HOOKED = """
import importlib.util, sys, warnings
sys.path.insert(0, sys.argv[1])
from cumempool import _budget
calls = []
_budget._after_import("hooked", lambda module: calls.append(module.__name__))
"""


def _hooked(tmp_path, code, extra=""):
    package = tmp_path / "hooked"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    (package / "data.txt").write_text("packaged\n")
    out = subprocess.run(
        [sys.executable, *extra.split(), "-c", HOOKED + textwrap.dedent(code), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_a_lookup_before_the_import_does_not_use_the_hook_up(tmp_path):
    words = _hooked(
        tmp_path,
        """
        assert importlib.util.find_spec("hooked") is not None   # "is it installed?"
        import hooked
        print(calls)
        """,
    )
    assert words == ["['hooked']"]


def test_a_hooked_package_still_reads_its_own_data(tmp_path):
    words = _hooked(
        tmp_path,
        """
        import importlib.resources, hooked
        print(importlib.resources.files("hooked").joinpath("data.txt").read_text().strip(), type(hooked.__loader__).__name__)
        """,
    )
    assert words == ["packaged", "SourceFileLoader"]


def test_a_failing_setup_does_not_fail_the_import(tmp_path):
    words = _hooked(
        tmp_path,
        """
        _budget._finder.waiting["hooked"] = lambda module: warnings.warn("setting up failed")
        import hooked
        print(hooked.VALUE)
        """,
        extra="-W error",
    )
    assert words == ["1"]


def test_a_script_runs_as_python_would_run_it(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(
        "import os, sys\nprint(os.path.isabs(__file__), sys.argv[0], sys.path[0] == os.path.dirname(os.path.realpath(__file__)))\nsys.exit(3)\n"
    )
    code = "import sys; from cumempool import __main__ as m; sys.exit(m.run_program(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "where.py", "a"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 3, out.stderr
    assert out.stdout.split() == ["True", "where.py", "True"]


def test_recording_checks_its_arguments_only_when_it_starts():
    with pytest.raises(ValueError, match="max_entries"):
        cm.record_history(max_entries=2.5)
    cm.record_history(enabled=False, stacks="anything")  # stopping takes no options


def test_the_devices_of_a_budget_follow_local_rank(stand_in_libcuda):
    # The stand-in driver shows one device.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import os
        from cumempool import _budget
        for rank in (None, "0", "3", "x"):
            if rank is None:
                os.environ.pop("LOCAL_RANK", None)
            else:
                os.environ["LOCAL_RANK"] = rank
            try:
                print(sorted(_budget._limits("1GiB", None)))
            except ValueError as error:
                print("refused", "torchrun sets it" in str(error))
        """,
    )
    assert words == ["[0]", "[0]", "[0]", "refused", "True"], "one GPU per rank: the rank's is device 0"


def test_a_resource_drawn_for_torch_keeps_its_counted_bytes_beside_the_routed_ones(stand_in_libcuda):
    # A program may draw from the budget as "torch" itself (`Budget.resource("torch", 0)`, for
    # `cumempool.torch.mem_pool`): while PyTorch also uses the route, neither figure replaces
    # the other. A stand-in `torch` on the cudaMallocAsync backend.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import sys, types
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(
            is_initialized=lambda: True,
            memory=types.SimpleNamespace(get_allocator_backend=lambda: "cudaMallocAsync"),
        )
        sys.modules["torch"] = torch
        budget = cm.budget(devices={0: "1MiB"})
        held = budget.resource("torch", 0).alloc(4096)
        direct = cm.PoolResource(budget.pool(0)).alloc(8192)  # drawn past cumempool's counting
        libraries = cm.usage()[0]["libraries"]
        print(libraries["torch"]["bytes"], libraries["torch (routed)"]["bytes"], libraries["unattributed"]["bytes"])
        print([(segment["address"], segment["total_size"]) for segment in cm.snapshot()["segments"]])
        held.close(); direct.close(); budget.close()
        """,
    )
    assert words[:3] == ["4096", "8192", "0"], "the bytes counted for torch were replaced by the routed remainder"
    assert "".join(words[3:]) == "[(0,8192)]", "the snapshot lost PyTorch's routed bytes"


def test_cupys_cache_is_counted_apart_and_given_back_when_another_library_needs_it(stand_in_libcuda):
    # CuPy draws through a cache under the budget (its temporaries would each cost a pool
    # allocation and free): what the cache keeps free is in the pool's use, so it is counted as
    # CuPy's "cached", never as unattributed or as PyTorch's; a plug-in library that finds the
    # pool full gets the cache's blocks back; `release_cached` gives them back for the rest.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import os
        os.environ["STAND_IN_POOL_LIMIT"] = str(1 << 20)  # the pool's maximum size, as the GPU's
        budget = cm.budget(devices={0: "1MiB"})
        stream = cm.Stream(0)
        cupy_side = budget.resource("cupy", 0)
        cupy_side.alloc(8192, stream).close()
        held = cm.usage()[0]["libraries"]
        print(held["cupy"]["bytes"], held["cupy"]["cached"], held["unattributed"]["bytes"])
        big = budget.resource("numba", 0).alloc((1 << 20) - 4096, stream)  # fits once the cache lets go
        held = cm.usage()[0]["libraries"]
        print(held["cupy"]["cached"], held["numba"]["bytes"], held["unattributed"]["bytes"])
        big.close()
        cupy_side.alloc(8192, stream).close()
        print(budget.release_cached(), cm.usage()[0]["libraries"]["cupy"]["cached"])
        print("bound", cupy_side.__repr__().count("max_cached=16384"))
        budget.close()
        """,
    )
    assert words[:3] == ["0", "8192", "0"], "the cache's free block was not counted as CuPy's"
    assert words[3:6] == ["0", str((1 << 20) - 4096), "0"], "the full pool did not take the cache's block back"
    assert words[6:8] == ["8192", "0"], "release_cached did not give the cache's block back"
    assert words[8:] == ["bound", "1"], "the cache keeps more than a 64th of the budget"


def test_what_cupys_cache_rounds_up_is_counted_as_cupys(stand_in_libcuda):
    # The cache allocates a size class from the pool (here 40 MiB for 32 MiB and a byte): those
    # bytes are CuPy's, and the counts add up to the pool's use, nothing unattributed.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        budget = cm.budget(devices={0: "64MiB"})
        held = budget.resource("cupy", 0).alloc((32 << 20) + 1, cm.Stream(0))
        of_device = cm.usage()[0]
        libraries = of_device["libraries"]
        print(of_device["used"], libraries["cupy"]["bytes"], libraries["cupy"]["count"], libraries["unattributed"]["bytes"])
        held.close()
        budget.close()
        print(cm.usage(), budget.pool(0).used_mem_current)
        """,
    )
    used, cupy, count, unattributed = map(int, words[:4])
    assert used > (32 << 20) + 1 and cupy == used and count == 1, words
    assert unattributed == 0, "the cache's rounding was counted as unattributed"
    assert words[4:] == ["{}", "0"], "closing the budget left the cache's blocks in the pool"


def test_a_failed_release_closes_the_budget_and_keeps_no_frames(stand_in_libcuda):
    # A cache's release that fails: the error reaches the caller without keeping the frames it
    # passed (and the caller's arrays in them) until the garbage collector runs, and `close()`
    # still takes the budget out of force, so another can be made.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import gc, weakref
        gc.disable()
        budget = cm.budget(devices={0: "1MiB"})
        class Failing:
            def stats(self):
                return {"cached_bytes": 0}
            def release(self):
                raise RuntimeError("the release failed")
        budget._devices[0].caches["cupy"] = Failing()
        class Held:
            pass
        def caller():
            held = Held()
            try:
                budget.release_cached()
            except RuntimeError:
                return weakref.ref(held)
        print(caller()() is None)
        try:
            budget.close()
        except RuntimeError:
            pass
        print(cm._budget.active() is None)
        cm.budget(devices={0: "1MiB"}).close()
        print("again")
        """,
    )
    assert words == ["True", "True", "again"], words


FAKE_NUMBA = """
import collections, sys, types
numba = types.ModuleType("numba")
numba_cuda = types.ModuleType("numba.cuda")
cudadrv = types.ModuleType("numba.cuda.cudadrv")
driver = types.ModuleType("numba.cuda.cudadrv.driver")
driver.MemoryInfo = collections.namedtuple("MemoryInfo", "free total")
class HostOnlyCUDAMemoryManager:
    def __init__(self, context=None):
        self.context = context
class MemoryPointer:
    def __init__(self, context, pointer, size, finalizer=None):
        self.ptr, self.size, self.free = pointer.value, size, finalizer
numba_state = {}
def set_memory_manager(cls):
    cls(context=None).interface_version
    numba_state["manager"] = cls
class Context:
    # As numba.cuda.cudadrv.driver.Context.__init__: the manager is made once, with the context
    # (Numba's first CUDA use), from the class set at that moment.
    device = types.SimpleNamespace(id=0)
    def __init__(self):
        self.memory_manager = numba_state["manager"](context=self)
numba_cuda.HostOnlyCUDAMemoryManager = HostOnlyCUDAMemoryManager
numba_cuda.MemoryPointer = MemoryPointer
numba_cuda.set_memory_manager = set_memory_manager
numba.cuda, numba_cuda.cudadrv, cudadrv.driver = numba_cuda, cudadrv, driver
sys.modules.update({"numba": numba, "numba.cuda": numba_cuda, "numba.cuda.cudadrv": cudadrv, "numba.cuda.cudadrv.driver": driver})
os.environ.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
"""


def test_numba_follows_the_budget_in_force_not_the_first_one(stand_in_libcuda):
    # Numba fixes a context's manager when the context is made, once per device for the
    # process: so the manager draws from the budget in force at each allocation. After the
    # first budget is closed, a second one counts and caps what Numba allocates, and the closed
    # budget's pool gets none of it.
    words = run_on_stand_in(
        stand_in_libcuda,
        FAKE_NUMBA
        + """
first = cm.budget(devices={0: "1MiB"})
context = Context()  # Numba's first CUDA use, under the first budget
context.memory_manager.memalloc(4096).free()
first.close()
second = cm.budget(devices={0: "1MiB"})
held = context.memory_manager.memalloc(4096)
numba = cm.usage()[0]["libraries"].get("numba")
print(numba["bytes"] if numba else "uncounted", first._devices[0].libraries["numba"].usage()["current_bytes"])
held.free()
second.close()
""",
    )
    assert words == ["4096", "0"], "Numba drew from the closed budget's pool, outside the budget in force"


# ---- budget(): a failure after the budget was put in force -------------------------------------


def test_a_budget_that_raises_is_not_left_in_force(stand_in_libcuda):
    # `budget()` makes the pools current before choosing PyTorch's backend, whose warning is an
    # exception under `-W error` / `simplefilter("error")`: a call that raises leaves no budget
    # in force (no pool current, no half-installed hook), so a later `budget()` is not refused.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
import warnings
from cumempool import _budget
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:native"
warnings.simplefilter("error")
try:
    cm.budget(devices={0: "1MiB"})
    print("made")
except UserWarning:
    print("raised")
print(_budget.active() is None)
warnings.simplefilter("ignore")
try:
    cm.budget(devices={0: "1MiB"}).close()
    print("again")
except RuntimeError:
    print("refused")
""",
    )
    assert words == ["raised", "True", "again"], words


# ---- the out-of-memory report belongs to the budget's own resources ----------------------------


def test_an_allocator_of_the_programs_own_does_not_carry_the_budgets_report(stand_in_libcuda):
    # A CuPy allocator the program made over its own Limit, while a budget is in force: its
    # out-of-memory error carries no budget report (the budget did not refuse it, and "make
    # the budget larger" would be wrong advice).
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
class CupyOutOfMemory(Exception):
    pass
cupy.cuda.memory.OutOfMemoryError = CupyOutOfMemory
budget = cm.budget(devices={0: "1MiB"})
own = cmc.Allocator(cm.Limit(cm.PoolResource(cm.MemPool(cm.Route.device(0))), 4096))
try:
    own(8192)
except CupyOutOfMemory as error:
    print(error.report is None, "cumempool budget" in str(error))
budget.close()
""",
    )
    assert words == ["True", "False"], "the budget's report was put on an error of a resource outside the budget"


# After FAKE_CUPY: CuPy's allocator choice as CuPy 14.2 makes it. `using_allocator` shows its
# thread the scoped allocator (`get_allocator`) and refuses to set the global one there
# (`set_allocator` raises ValueError); `own_pool` is the default pool's `malloc`, CuPy's global
# allocator until something else is set.
SCOPED_CUPY = """
import contextlib, threading, warnings
class Pool:
    def malloc(self, size):
        return "own"
the_pool = Pool()
own_pool = the_pool.malloc
chosen = {"global": own_pool}
scoped = threading.local()
def get_allocator():
    local = getattr(scoped, "allocator", None)
    return chosen["global"] if local is None else local
def set_allocator(allocator):
    if getattr(scoped, "allocator", None) is not None:
        raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
    chosen["global"] = allocator
@contextlib.contextmanager
def using_allocator(allocator):
    before, scoped.allocator = getattr(scoped, "allocator", None), allocator
    try:
        yield
    finally:
        scoped.allocator = before
cupy.cuda.get_allocator, cupy.cuda.set_allocator, cupy.cuda.using_allocator = get_allocator, set_allocator, using_allocator
cupy.get_default_memory_pool = lambda: the_pool
"""


def test_a_budget_closed_inside_cupys_using_allocator_takes_its_allocator_out_of_cupys_global(stand_in_libcuda):
    # Closed inside a scope, the budget must still put CuPy's global allocator back, or every
    # later CuPy allocation would draw from the closed budget.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
budget = cm.budget(devices={0: "1MiB"})
print("installed", chosen["global"] is not own_pool)
with cupy.cuda.using_allocator(lambda size: None):
    budget.close()
print("put back", chosen["global"] == own_pool)
""",
    )
    assert words == ["installed", "True", "put", "back", "True"], words


def test_a_budget_made_inside_cupys_using_allocator_puts_cupy_on_the_budget(stand_in_libcuda):
    # Made inside a scope, the budget reads and sets CuPy's global allocator, not the scoped one:
    # no false "CuPy has an allocator of its own" (a scoped lambda), no refusal (the default
    # pool's own `malloc` scoped), and the allocator it gives is the one installed.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
warnings.simplefilter("error")
for scope in (lambda size: "scoped", own_pool):
    with cupy.cuda.using_allocator(scope):
        budget = cm.budget(devices={0: "1MiB"})
    print("installed", chosen["global"] is not own_pool, chosen["global"].__self__ is budget.cupy_allocator(0))
    budget.close()
    print("put back", chosen["global"] == own_pool)
""",
    )
    assert words == ["installed", "True", "True", "put", "back", "True"] * 2, words


# A `cupy` package on disk, imported after the budget is made (through the import hook), with
# what the budget's allocator reads of CuPy 14.2 and its global allocator choice, kept in a
# submodule (as CuPy keeps it in `cupy.cuda.memory`): a failed import of the package leaves it.
CUPY_PACKAGE = """
import os, time, types
from cupy._state import _pool, _chosen
def get_allocator():
    time.sleep(float(os.environ.get("SLOW_CUPY", "0")))
    return _chosen[0]
def get_default_memory_pool():
    return _pool
class OutOfMemoryError(MemoryError):
    pass
cuda = types.SimpleNamespace(
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    runtime=types.SimpleNamespace(getDevice=lambda: 0),
    get_current_stream=lambda: None,
    UnownedMemory=lambda ptr, size, owner, device: (ptr, size, owner, device),
    MemoryPointer=lambda memory, offset: memory,
    get_allocator=get_allocator,
    set_allocator=lambda allocator: _chosen.__setitem__(0, allocator),
)
"""
CUPY_STATE = """
class Pool:
    def malloc(self, size):
        return "own"
_pool = Pool()
_chosen = [_pool.malloc]
"""


def _cupy_package(tmp_path):
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(CUPY_PACKAGE)
    (tmp_path / "cupy" / "_state.py").write_text(CUPY_STATE)


def _run_with_cupy_package(stand_in_libcuda, tmp_path, code, env=()):
    """Runs `code` (dedented) with the `cupy` package on disk importable; its stdout words."""
    _cupy_package(tmp_path)
    code = "import sys\nsys.path.insert(0, sys.argv[1])\n" + textwrap.dedent(code)
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=stand_in_libcuda, **dict(env))
    try:
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("hung") from None
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_cupy_imported_after_the_budget_is_put_on_it_without_waiting_on_its_own_import(stand_in_libcuda, tmp_path):
    # The budget installs CuPy's allocator from inside CuPy's import, whose module lock the
    # importing thread holds: work done for it on another thread must not import CuPy (that
    # thread would wait for the lock, and the importing thread for it, forever).
    words = _run_with_cupy_package(
        stand_in_libcuda,
        tmp_path,
        """
        import cumempool as cm
        budget = cm.budget(devices={0: "1MiB"})
        import cupy
        allocator = cupy.cuda.get_allocator()
        print(allocator.__self__ is budget.cupy_allocator(0), allocator(4096)[1])
        budget.close()
        print(cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc)
        """,
    )
    assert words == ["True", "4096", "True"], words


def test_a_budget_closed_after_cupys_import_failed_while_it_installed_puts_cupys_pool_back(stand_in_libcuda, tmp_path):
    # ^C while the import hook installs the budget's allocator: CuPy's import fails (importlib
    # takes `cupy` out of `sys.modules`) after the allocator was installed in CuPy's state, which
    # outlives the failed import. Closing must still put CuPy's pool back there.
    words = _run_with_cupy_package(
        stand_in_libcuda,
        tmp_path,
        """
        import threading
        import cumempool as cm
        budget = cm.budget(devices={0: "1MiB"})
        join, joins = threading.Thread.join, [0]
        def interrupted(self, timeout=None):
            joins[0] += 1
            if joins[0] == 2:  # the first reads CuPy's allocator, the second installs the budget's
                raise KeyboardInterrupt
            return join(self, timeout)
        threading.Thread.join = interrupted
        try:
            import cupy
        except KeyboardInterrupt:
            print("interrupted", "cupy" in sys.modules)
        threading.Thread.join = join
        budget.close()
        import cupy
        print(cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc)
        """,
    )
    assert words == ["interrupted", "False", "True"], words


def test_a_budget_closed_while_another_thread_imports_cupy_is_not_installed_after(stand_in_libcuda, tmp_path):
    # CuPy imported on one thread (its import installs the budget's allocator, slowly) while
    # another closes the budget: the install and the close's put-back do not interleave, so
    # CuPy does not end on the closed budget's allocator.
    words = _run_with_cupy_package(
        stand_in_libcuda,
        tmp_path,
        """
        import threading, time
        import cumempool as cm
        budget = cm.budget(devices={0: "1MiB"})
        importing = threading.Thread(target=lambda: __import__("cupy"))
        importing.start()
        time.sleep(0.2)
        budget.close()
        importing.join()
        import cupy
        print(cm.active() is None, cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc)
        """,
        env={"SLOW_CUPY": "0.5"},
    )
    assert words == ["True", "True"], words


def test_a_budget_closed_by_a_finalizer_at_exit_puts_cupys_allocator_back_without_hanging(stand_in_libcuda):
    # At the interpreter's shutdown no thread may start (Python 3.12 refuses; 3.10 and 3.11
    # start one that never runs, and wait for it forever): closing then puts CuPy's allocator
    # back on the closing thread, where no scope can be open.
    # (The finalizer holds all it uses: module globals may be gone when it runs.)
    code = """
import os, types
from cumempool import _budget
chosen = {"global": "installed"}
cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
    get_allocator=lambda chosen=chosen: chosen["global"],
    set_allocator=lambda allocator, chosen=chosen: chosen.__setitem__("global", allocator),
))
class PutBack:
    def __init__(self):
        self.write, self.put_back, self.cupy, self.chosen = os.write, _budget._put_back_cupy_allocator, cupy, chosen
    def __del__(self):
        self.put_back(self.cupy, "previous", "installed")
        self.write(1, ("put back " + self.chosen["global"] + chr(10)).encode())
keeper = PutBack()
print("exiting", flush=True)
"""
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=stand_in_libcuda)
    try:
        out = subprocess.run([sys.executable, "-c", STAND_IN_CAPTURE + code], capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        raise AssertionError("closing at exit hung") from None
    assert out.stdout.split() == ["exiting", "put", "back", "previous"], (out.stdout, out.stderr[-2000:])


def test_a_budget_that_cannot_start_a_thread_to_close_says_what_cupy_keeps(stand_in_libcuda):
    # Inside a scope only a thread of its own can put CuPy's global allocator back; where none
    # can start, closing says so (and what to call), and the budget is out of force anyway.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
budget = cm.budget(devices={0: "1MiB"})
def refuse(self):
    raise RuntimeError("can't start new thread")
threading.Thread.start = refuse
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with cupy.cuda.using_allocator(lambda size: None):
        budget.close()
said = " ".join(str(w.message) for w in caught)
print(len(caught), "cupy.cuda.set_allocator" in said and "can't start new thread" in said, cm.active() is None)
""",
    )
    assert words == ["1", "True", "True"], words


# After SCOPED_CUPY: `interrupt(n)` makes the n-th `Thread.join` from now raise
# KeyboardInterrupt before it waits (as a ^C there would), and the n-th read of CuPy's
# allocator from now take half a second.
INTERRUPTED = """
import time
join, get = threading.Thread.join, cupy.cuda.get_allocator
def interrupt(n):
    joins, reads = [0], [0]
    def interrupted(self, timeout=None):
        joins[0] += 1
        if joins[0] == n:
            raise KeyboardInterrupt
        return join(self, timeout)
    def slow():
        reads[0] += 1
        if reads[0] == n:
            time.sleep(0.5)
        return get()
    threading.Thread.join, cupy.cuda.get_allocator = interrupted, slow
"""


def test_a_close_interrupted_while_it_puts_cupys_allocator_back_leaves_no_budget_in_force(stand_in_libcuda):
    # A KeyboardInterrupt while closing waits for its thread: the budget is out of force all
    # the same, CuPy's allocator is put back before the interrupt goes on (a slow thread would
    # otherwise put it back over the next budget's), and a new budget is put on CuPy.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
budget = cm.budget(devices={0: "1MiB"})
"""
        + INTERRUPTED
        + """
interrupt(1)
try:
    budget.close()
except KeyboardInterrupt:
    print("interrupted")
print(cm.active() is None, chosen["global"] is own_pool)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    again = cm.budget(devices={0: "1MiB"})
print(len(caught), chosen["global"].__self__ is again.cupy_allocator(0))
again.close()
""",
    )
    assert words == ["interrupted", "True", "True", "0", "True"], words


def test_a_budget_interrupted_while_it_installs_cupys_allocator_puts_it_back(stand_in_libcuda):
    # Interrupted while it waits for the thread that installs CuPy's allocator, `budget()` closes
    # the half-made budget, which puts back CuPy's allocator once the thread installed it.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + INTERRUPTED
        + """
interrupt(2)  # the first reads CuPy's allocator, the second installs the budget's
try:
    cm.budget(devices={0: "1MiB"})
except KeyboardInterrupt:
    print("interrupted")
time.sleep(1)
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["interrupted", "True", "True"], words


# After SCOPED_CUPY and INTERRUPTED, code run where a signal handler (SIGTERM's, say) or a
# finalizer would run while the budget waits for its thread. `before_join(n, then)` runs `then()`
# on the waiting thread as the n-th `Thread.join` from now begins. `after_join(n, then)` runs it
# at the start of the first function of cumempool._budget called once the n-th `Thread.join`
# from now has returned: where CPython runs a signal handler that became due just as the
# budget's thread ended (or a finalizer the collector ran there), which may come after the budget
# looked at the state the handler changes. `close_now` closes the budget in force,
# `interrupt_now` raises as a ^C would.
JOIN_HOOKS = """
import os, sys
from cumempool import _budget
def before_join(n, then):
    joins = [0]
    def waiting(self, timeout=None):
        joins[0] += 1
        if joins[0] == n:
            threading.Thread.join = join
            then()
        return join(self, timeout)
    threading.Thread.join = waiting
def after_join(n, then):
    joins = [0]
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == _budget.__file__:
            sys.settrace(None)
            then()
        return None
    def joined(self, timeout=None):
        joins[0] += 1
        answer = join(self, timeout)
        if joins[0] == n:
            threading.Thread.join = join
            sys.settrace(tracer)
        return answer
    threading.Thread.join = joined
def close_now():
    cm.active().close()
    print("closed inside")
def interrupt_now():
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("step", [1, 2], ids=["reading CuPy's allocator", "installing the budget's"])
def test_a_budget_closed_on_the_thread_installing_cupys_allocator_does_not_hang_and_puts_it_back(stand_in_libcuda, step):
    # A close while the budget waits for its thread that reads (the first join) or installs
    # (the second) CuPy's allocator, on the same thread: a signal handler or a finalizer. It must
    # neither wait for the install to end (which waits for it: a hang) nor leave CuPy on the
    # closed budget once the install ends.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + INTERRUPTED
        + JOIN_HOOKS
        + f"before_join({step}, close_now)\n"
        + """
budget = cm.budget(devices={0: "1MiB"})
threading.Thread.join = join
print(cm.active() is None, chosen["global"] is own_pool)
again = cm.budget(devices={0: "1MiB"})
print(chosen["global"].__self__ is again.cupy_allocator(0))
again.close()
print(chosen["global"] is own_pool)
""",
    )
    assert words == ["closed", "inside", "True", "True", "True", "True"], words


def test_a_budget_made_on_the_thread_installing_another_budgets_cupy_allocator_leaves_cupy_off_it(stand_in_libcuda):
    # The handler closes the budget being installed and makes another: two choices of CuPy's
    # allocator at once on one thread could end either way, so the second warns and stays out of
    # CuPy, and the first puts CuPy's pool back once its install is over.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + INTERRUPTED
        + JOIN_HOOKS
        + """
made = []
def closing_and_making():
    cm.active().close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made.append(cm.budget(devices={0: "1MiB"}))
    print(len(caught), "CuPy stays outside this budget" in str(caught[0].message))
before_join(2, closing_and_making)
first = cm.budget(devices={0: "1MiB"})
print(cm.active() is made[0], chosen["global"] is own_pool, made[0].cupy_allocator(0) is None)
made[0].close()
""",
    )
    assert words == ["1", "True", "True", "True", "True"], words


def test_an_interrupt_as_close_leaves_cupys_choice_leaves_it_free_for_other_threads_and_later_budgets(stand_in_libcuda):
    # ^C just as close() has put CuPy's allocator back, handled as it leaves the CuPy lock: the
    # lock must not stay taken (another thread's close or CuPy import would wait for it forever)
    # nor this thread count as inside it (every later budget would stay off CuPy, every later
    # close leave CuPy's allocator to an install that is not running).
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + INTERRUPTED
        + JOIN_HOOKS
        + """
budget = cm.budget(devices={0: "1MiB"})
after_join(1, interrupt_now)  # close's put-back waits for its thread once
try:
    budget.close()
except KeyboardInterrupt:
    print("interrupted")
print(cm.active() is None, chosen["global"] is own_pool)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    again = cm.budget(devices={0: "1MiB"})
print(len(caught), again.cupy_allocator(0) is not None)
closing = threading.Thread(target=again.close, daemon=True)
closing.start()
closing.join(5)
print(closing.is_alive(), chosen["global"] is own_pool)
sys.stdout.flush()
os._exit(0)  # a thread that hangs must not hang the exit
""",
    )
    assert words == ["interrupted", "True", "True", "0", "True", "False", "True"], words


def test_a_close_handled_as_the_install_leaves_cupys_choice_puts_cupys_allocator_back(stand_in_libcuda):
    # A handler that closes the budget, run once the install's thread has set CuPy's allocator
    # but after the install looked whether it was closed meanwhile (as it leaves the CuPy lock):
    # the close, nested, leaves the put-back to the install, which must still do it.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + INTERRUPTED
        + JOIN_HOOKS
        + """
after_join(2, close_now)  # the install reads CuPy's allocator (the first join), then sets it
budget = cm.budget(devices={0: "1MiB"})
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["closed", "inside", "True", "True"], words


def test_a_handler_that_closes_and_raises_during_cupys_import_leaves_cupys_pool(stand_in_libcuda, tmp_path):
    # A SIGINT or SIGTERM handler that closes the budget and raises (KeyboardInterrupt,
    # SystemExit), run while CuPy's import installs the budget's allocator: the close, nested,
    # leaves the put-back to the install, and the install is left by the exception. CuPy's
    # state outlives the failed import: its pool must be put back there.
    words = _run_with_cupy_package(
        stand_in_libcuda,
        tmp_path,
        """
        import threading
        import cumempool as cm
        budget = cm.budget(devices={0: "1MiB"})
        join, joins = threading.Thread.join, [0]
        def closed_then_interrupted(self, timeout=None):
            joins[0] += 1
            if joins[0] == 2:  # the first reads CuPy's allocator, the second installs the budget's
                budget.close()
                raise KeyboardInterrupt
            return join(self, timeout)
        threading.Thread.join = closed_then_interrupted
        try:
            import cupy
        except KeyboardInterrupt:
            print("interrupted")
        threading.Thread.join = join
        import cupy
        print(cm.active() is None, cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc)
        """,
    )
    assert words == ["interrupted", "True", "True"], words


def test_a_close_while_the_budget_makes_a_librarys_resource_on_the_same_thread_does_not_hang(stand_in_libcuda):
    # A finalizer (or a signal handler) that closes the budget while this thread makes CuPy's
    # resource of the budget, under the budget's lock: close takes that lock last, and must not
    # wait for this thread forever.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import os, sys
from cumempool import _budget
bound = _budget.cache_bound
def closing_bound(limit):
    _budget.cache_bound = bound
    cm.active().close()
    print("closed inside")
    return bound(limit)
_budget.cache_bound = closing_bound
made = []
maker = threading.Thread(target=lambda: made.append(cm.budget(devices={0: "1MiB"})), daemon=True)
maker.start()
maker.join(5)
print(maker.is_alive(), cm.active() is None, chosen["global"] is own_pool)
sys.stdout.flush()
os._exit(0)  # a thread that hangs must not hang the exit
""",
    )
    assert words == ["closed", "inside", "False", "True", "True"], words


def test_the_budgets_cupy_allocator_is_none_where_cupy_kept_its_own_and_refused_off_the_budget(stand_in_libcuda):
    # Budget.cupy_allocator(device): None while CuPy draws outside the budget (not imported yet,
    # or an allocator of the program's own kept), InvalidDeviceError for a device the budget
    # does not cover, as Budget.pool() and Budget.resource() answer.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
warnings.simplefilter("ignore")
chosen["global"] = lambda size: "mine"
budget = cm.budget(devices={0: "1MiB"})
print(budget.cupy_allocator(0))
try:
    budget.cupy_allocator(1)
except cm.InvalidDeviceError as error:
    print("refused", "device 1" in str(error))
budget.close()
""",
    )
    assert words == ["None", "refused", "True"], words


# After FAKE_CUPY: a budget of 1 MiB over a pool of that size, and `allocate`, the CuPy allocator
# the budget installed, whose out-of-memory is `CupyOutOfMemory`.
BUDGETED_CUPY = """
class CupyOutOfMemory(Exception):
    pass
cupy.cuda.memory.OutOfMemoryError = CupyOutOfMemory
os.environ["STAND_IN_POOL_LIMIT"] = str(1 << 20)
cupy.cuda.get_allocator = lambda: None
cupy.get_default_memory_pool = lambda: types.SimpleNamespace(malloc=None)
installed = []
cupy.cuda.set_allocator = installed.append
budget = cm.budget(devices={0: "1MiB"})
allocate = installed[-1]
"""


def test_the_report_names_the_largest_allocation_of_each_library_with_its_stack(stand_in_libcuda):
    # Recorded with stacks, the out-of-memory report shows under each library its largest live
    # allocation and where it was asked for; not recorded, it says how to have them.
    words = _with_fake_cupy(
        stand_in_libcuda,
        BUDGETED_CUPY
        + """
def load_weights():
    return allocate(512 << 10)
def reports(n):
    try:
        allocate(n)
    except CupyOutOfMemory as error:
        return error.report.splitlines()
small = allocate(4096)
print("not", any("not recorded (cumempool.record_history()" in line for line in reports(1 << 20)))
cm.record_history(stacks="python")
weights = load_weights()
lines = reports(1 << 20)
at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["cupy"])
print("largest", *lines[at + 1].split()[:8])
cm.record_history(False)
budget.close()
""",
    )
    assert words[:2] == ["not", "True"], "the report did not say how to record the largest allocations"
    largest, where = words[2:7], words[7:]
    assert largest == ["largest", "largest", "live:", "512.0", "KiB"], words
    assert where[0] == "at" and where[1].startswith("<string>:") and where[2:] == ["in", "load_weights"], words


def test_cupy_under_the_budget_collects_garbage_before_it_runs_out(stand_in_libcuda):
    # CuPy's own pool (SingleDeviceMemoryPool._try_malloc) frees its blocks, then runs
    # gc.collect() and tries again before raising OutOfMemoryError: an array kept only by a
    # reference cycle never makes a CuPy program run out. Under the budget the plug-in raises at
    # once, so a program that fits with CuPy's pool dies under a budget of the same size.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import gc
class CupyOutOfMemory(Exception):
    def __init__(self, size, total, limit=0):
        super().__init__(size)
cupy.cuda.memory.OutOfMemoryError = CupyOutOfMemory
os.environ["STAND_IN_POOL_LIMIT"] = str(1 << 20)  # the pool's maximum size, as the GPU's
budget = cm.budget(devices={0: "1MiB"})
allocator = cmc.Allocator(budget.resource("cupy", 0))
class Node:
    pass
node = Node()
node.self, node.array = node, allocator(768 << 10)  # an array only a cycle keeps
del node
gc.disable()  # the collector has not come round yet
try:
    kept = allocator(768 << 10)
    print("allocated")
except CupyOutOfMemory:
    print("out-of-memory")
budget.close()
""",
    )
    assert words[-1] == "allocated", "CuPy ran out under the budget where its own pool collects the cycle and fits"


def test_a_resource_drawn_for_torch_can_serve_the_torch_plug_in(stand_in_libcuda):
    # `Budget.resource("torch", 0)` is for `cumempool.torch`, whose allocations run where no
    # Python callback may: it must not wrap the pool in an OnOutOfMemory callback.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import cumempool.torch as cmt
        budget = cm.budget(devices={0: "64MiB"})
        try:
            cmt.serve(budget.resource("torch", 0))
            print("served")
            cmt.stop()
        except ValueError as error:
            print("refused")
        budget.close()
        """,
    )
    assert words == ["served"], "the budget's resource for torch cannot be given to cumempool.torch"


def _choose(env_extra, printed="PYTORCH_CUDA_ALLOC_CONF"):
    """The budget's choice of PyTorch's backend in a process of its own, with ``env_extra`` set;
    ``printed``, as it left it, is the output."""
    code = (
        "import os, warnings; warnings.simplefilter('always'); from cumempool import _budget; "
        f"_budget._choose_torch_backend(); print(os.environ.get({printed!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_pytorch_alloc_conf_naming_another_backend_is_kept_with_a_warning():
    # PyTorch 2.9+ reads PYTORCH_ALLOC_CONF (the device-generic name) as well as
    # PYTORCH_CUDA_ALLOC_CONF. A backend chosen there is the script's choice: kept, warned about,
    # as for PYTORCH_CUDA_ALLOC_CONF, and no backend is set beside it (which of the two wins
    # depends on the PyTorch version).
    out = _choose({"PYTORCH_ALLOC_CONF": "backend:native"})
    assert out.returncode == 0, out.stderr
    assert "budget does not cover" in out.stderr, (out.stdout, out.stderr)
    assert out.stdout.strip() == "None", "PYTORCH_CUDA_ALLOC_CONF was set over the script's own choice"
    # Without a backend there, the backend goes where PyTorch reads its settings.
    out = _choose({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_ALLOC_CONF")
    assert out.returncode == 0 and "budget does not cover" not in out.stderr, out.stderr
    assert out.stdout.strip() == "expandable_segments:True,backend:cudaMallocAsync", out.stdout


FAKE_TORCH = """
# As c10 does: the backend is read from the environment once, when PyTorch loads.
import os, re, types
_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
_found = re.search(r"backend\\s*:\\s*(\\w+)", _conf)
_backend = _found.group(1) if _found else "native"
cuda = types.SimpleNamespace(
    is_initialized=lambda: True, memory=types.SimpleNamespace(get_allocator_backend=lambda: _backend)
)
"""


def test_a_script_that_sets_the_allocator_conf_itself_is_warned_about(stand_in_libcuda, tmp_path):
    # The common first lines of a training script: it overwrites what the budget set, PyTorch
    # loads on its native allocator, and every tensor is outside the budget (and outside
    # usage()), with no word said. docs/python.md: a script that chose an allocator itself keeps
    # it "with a warning".
    _assert_torch_outside_the_budget_is_warned_about(stand_in_libcuda, tmp_path, {})


def _assert_torch_outside_the_budget_is_warned_about(stand_in_libcuda, tmp_path, env_extra):
    """Runs, under `cumempool run --budget`, a script that sets PYTORCH_CUDA_ALLOC_CONF to
    `expandable_segments:True` and imports FAKE_TORCH (with `env_extra` in the environment):
    PyTorch must load on its native allocator, and a warning must say it is outside the budget."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (tmp_path / "train.py").write_text(
        "import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
        "import torch\nprint(torch.cuda.memory.get_allocator_backend())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "LOCAL_RANK")}
    env.update(env_extra, CUMEMPOOL_LIBCUDA=stand_in_libcuda)
    out = subprocess.run(
        [sys.executable, "-W", "always", "-m", "cumempool", "run", "--budget", "1MiB", "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["native"], "precondition: PyTorch loaded outside the budget"
    assert "budget" in out.stderr.lower(), "PyTorch escaped the budget and nothing said so"


def test_torch_reading_its_cuda_variable_without_the_backend_is_warned_about(stand_in_libcuda, tmp_path):
    # The environment had PYTORCH_ALLOC_CONF only, so the budget put the backend there alone; the
    # script then sets PYTORCH_CUDA_ALLOC_CONF (which this PyTorch reads first, as FAKE_TORCH
    # does) and PyTorch runs its native allocator: the other variable's cudaMallocAsync must not
    # keep the warning back.
    _assert_torch_outside_the_budget_is_warned_about(
        stand_in_libcuda, tmp_path, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    )


def test_the_report_shows_no_allocation_from_outside_the_budget_as_the_budgets(stand_in_libcuda):
    # The report's largest live allocations are the budget's own: not those of a CuPy allocator
    # over the program's own pool on the same device.
    words = _with_fake_cupy(
        stand_in_libcuda,
        BUDGETED_CUPY
        + """
own = cmc.Allocator(cm.MemPool(cm.Route.device(0)))  # the program's own pool, outside the budget
cm.record_history(stacks="python")
small = allocate(4096)
def outside_the_budget():
    return own(512 << 10)
big = outside_the_budget()
try:
    allocate(2 << 20)
except CupyOutOfMemory as error:
    lines = error.report.splitlines()
at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["cupy"])
print(*lines[at + 1].split()[:4])
cm.record_history(False)
budget.close()
""",
    )
    assert words[2:4] != ["512.0", "KiB"], f"the report shows an allocation outside the budget as the budget's: {words}"


# A budget whose CuPy allocator (`allocate`) records (without stacks), and a collection hook
# `finalizer_like(phase, info)` the test defines, called as a `__del__` run by a collection
# would be: while a recording call of this thread may hold the recorder's lock. 20 allocations
# with the collector set to run at nearly every object made; then `finish`, the test's code.
UNDER_THE_RECORDER_LOCK = """
import faulthandler, gc
faulthandler.dump_traceback_later(10, exit=True)
from cumempool import _history
cm.record_history(stacks=None)
%s
gc.callbacks.append(finalizer_like)
gc.set_threshold(1)
kept = [allocate(4096) for _ in range(20)]
gc.set_threshold(700)
gc.callbacks.remove(finalizer_like)
%s
"""


def _under_the_recorder_lock(stand_in_libcuda, hook, finish):
    """The stdout words of UNDER_THE_RECORDER_LOCK with `hook` and `finish` (exit 0 asserted)."""
    code = (
        STAND_IN_CAPTURE + FAKE_CUPY + BUDGETED_CUPY + UNDER_THE_RECORDER_LOCK % (textwrap.dedent(hook), textwrap.dedent(finish))
    )
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=stand_in_libcuda)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout.split()


def test_an_out_of_memory_report_made_where_the_recorder_lock_is_held_does_not_hang(stand_in_libcuda):
    # Code a collection runs while this thread holds the recorder's lock (a finalizer, in a
    # collection that a recording call set off by making an object) allocates through CuPy and
    # runs out: the report must not wait for that lock, which this thread holds.
    hook = """
    outcome = []
    def finalizer_like(phase, info):
        if phase == "start" and _history._lock.locked() and not outcome:
            outcome.append("ran")
            try:
                allocate(2 << 20)
            except CupyOutOfMemory:
                outcome.append("out-of-memory")
    """
    assert _under_the_recorder_lock(stand_in_libcuda, hook, "print(*outcome)") == ["ran", "out-of-memory"]


def test_an_allocation_made_where_the_recorder_lock_is_held_is_recorded_without_hanging(stand_in_libcuda):
    # As above, with an allocation that succeeds: it is recorded by the next call that takes the
    # lock, after whatever was noted before it, and the thread never waits on itself.
    hook = """
    made = []
    def finalizer_like(phase, info):
        if phase == "start" and _history._lock.locked() and not made:
            made.append(allocate(12288))
    """
    finish = """
    sizes = [segment["total_size"] for segment in cm.snapshot()["segments"]]
    print(len(made), sizes.count(12288), sizes.count(4096))
    """
    assert _under_the_recorder_lock(stand_in_libcuda, hook, finish) == ["1", "1", "20"]


# ---- the command line ----------------------------------------------------------------------------


def _cli(stand_in_libcuda, tmp_path, *args):
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=stand_in_libcuda)
    env.pop("LOCAL_RANK", None)
    argv = [str(script) if arg == "SCRIPT" else arg for arg in args]
    return subprocess.run(
        [sys.executable, "-m", "cumempool", "run", *argv], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )


@pytest.mark.parametrize("size", ["99999999999999999999TiB", "9" * 400])
def test_an_oversized_budget_is_refused_with_a_message_not_a_traceback(stand_in_libcuda, tmp_path, size):
    # A size past what a device can address is refused with a message naming the command, not
    # a traceback out of cumempool's internals (an OverflowError, before).
    out = _cli(stand_in_libcuda, tmp_path, "--budget", size, "--", "SCRIPT")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and "python -m cumempool run:" in out.stderr, out.stderr[-800:]


def test_a_budget_given_beside_devices_is_checked_or_refused(stand_in_libcuda, tmp_path):
    # `--budget` beside `--device` is parsed (an invalid size is refused, never ignored), and a
    # device named twice is refused.
    out = _cli(stand_in_libcuda, tmp_path, "--budget", "8 parsecs", "--device", "0=1MiB", "--", "SCRIPT")
    assert out.returncode != 0, "an invalid --budget was ignored"
    out = _cli(stand_in_libcuda, tmp_path, "--device", "0=1MiB", "--device", "0=2GiB", "--", "SCRIPT")
    assert out.returncode != 0, "device 0 named twice: the second size silently won"


def test_a_missing_script_is_reported_as_python_reports_it(stand_in_libcuda, tmp_path):
    # As `python missing.py`: "can't open file ...", exit status 2, no traceback.
    out = _cli(stand_in_libcuda, tmp_path, "--budget", "1MiB", "--", str(tmp_path / "missing.py"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-800:])


def test_a_program_dying_of_cuda_cores_out_of_memory_gets_the_report(stand_in_libcuda, tmp_path):
    # cuda.core raises `CUDAError("CUDA_ERROR_OUT_OF_MEMORY: ...")` (test_one_budget.py expects
    # "CUDAError" for it), a class whose name does not say out-of-memory: the runner knows it
    # by the driver's error name in its message, and prints the report.
    script = tmp_path / "core_oom.py"
    script.write_text("class CUDAError(Exception):\n    pass\nraise CUDAError('CUDA_ERROR_OUT_OF_MEMORY: out of memory')\n")
    out = _cli(stand_in_libcuda, tmp_path, "--budget", "1MiB", "--", str(script))
    assert out.returncode == 1 and "CUDA_ERROR_OUT_OF_MEMORY" in out.stderr, out.stderr[-800:]
    assert "cumempool budget of device 0" in out.stderr, "no report for cuda.core's out-of-memory error"


# ---- on the GPU: Numba used before the budget -------------------------------------------------

NUMBA_BEFORE = """
import warnings
from numba import cuda
import cumempool as cm
first = cuda.device_array(16, dtype="uint8")  # Numba's first CUDA use: its context, its manager
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cm.budget(devices={0: "64MiB"})
try:
    big = cuda.device_array(128 << 20, dtype="uint8")
    escaped = True
except MemoryError:
    escaped = False
print(escaped, any("numba" in str(w.message).lower() for w in caught))
"""


def test_on_the_gpu_numba_used_before_the_budget_is_capped_or_warned_about(gpu, tmp_path):
    # Numba fixes a context's memory manager when the context is made; `budget()` after that
    # installs the manager for later contexts only, so Numba's allocations there stay outside
    # the budget: a warning says so, as for PyTorch imported before the budget.
    library("numba")
    out = subprocess.run([sys.executable, "-c", NUMBA_BEFORE], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    escaped, warned = out.stdout.split()[-2:]
    assert escaped == "False" or warned == "True", "Numba allocated past the budget and nothing said so"


def test_no_warning_that_numba_is_outside_a_second_budget_it_follows(stand_in_libcuda):
    # A context made under a first budget got the budgets' manager, which asks for the budget
    # in force at every allocation: under a second budget Numba draws from it, and no warning
    # says it stays outside (that is for a context made with another manager).
    words = run_on_stand_in(
        stand_in_libcuda,
        FAKE_NUMBA
        + """
import warnings
driver.driver = types.SimpleNamespace(devices={})  # numba.cuda.cudadrv.driver.driver
first = cm.budget(devices={0: "1MiB"})
context = Context()  # Numba's first CUDA use, under the first budget
# As Numba's Device.get_primary_context records it on the device Driver.devices holds.
driver.driver.devices[0] = types.SimpleNamespace(primary_context=context)
first.close()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    second = cm.budget(devices={0: "1MiB"})
held = context.memory_manager.memalloc(4096)
warned = any("Numba made its context" in str(w.message) for w in caught)
print(cm.usage()[0]["libraries"]["numba"]["bytes"], warned)
held.free()
second.close()
""",
    )
    assert words[0] == "4096", "precondition: Numba's context follows the second budget"
    assert words[1] == "False", "a warning said Numba stays outside the budget it draws from"


def test_numba_without_a_budget_draws_from_the_default_pool_and_keeps_no_pool_of_the_programs(stand_in_libcuda):
    # After a budget closed, Numba's context keeps the budgets' manager: it draws from the
    # device's default pool (the driver's, never destroyed), never from a pool the program made
    # current meanwhile, which it would keep alive after the program let go of it.
    words = run_on_stand_in(
        stand_in_libcuda,
        FAKE_NUMBA
        + """
from cumempool import _native
route = cm.Route.device(0)
first = cm.budget(devices={0: "1MiB"})
context = Context()  # Numba's context: its manager is the budgets'
first.close()
# The stand-in driver has no default or current pools: these stand for the driver's answers.
the_default, asked = cm.MemPool(route), []
_native.default_pool = lambda route: asked.append("default") or the_default
_native.current_pool = lambda route: asked.append("current") or cm.MemPool(route)
_native.current_pool_handle = lambda route: asked.append("current") or 0
for _ in range(3):
    context.memory_manager.memalloc(4096).free()
print(asked)
""",
    )
    assert words == ["['default']"], f"asked for {words}: once for the default pool, kept, never the current one"


def test_sizes_per_device_stand_in_for_the_budgets_on_their_devices(stand_in_libcuda):
    # `--budget 1GiB --device 0=2GiB`: the budget covers its devices (every visible one here),
    # and a device named has its own size in place of it; named alone, only that device.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
from cumempool import _budget
os.environ.pop("LOCAL_RANK", None)
count = cm.Device.count()
both = _budget._limits("1MiB", {0: "2MiB"})
print(both[0] == 2 << 20, all(both[d] == 1 << 20 for d in range(1, count)), len(both) == count)
print(_budget._limits(None, {0: "2MiB"}))
""",
    )
    assert words == ["True", "True", "True", "{0:", "2097152}"], words


# ---- `--budget` beside `--device`: every combination, with two devices standing in -------------


class _Devices:
    """Stands in for `cumempool._native.Device` where only the count is asked."""

    visible = 2

    @staticmethod
    def count():
        return _Devices.visible


@pytest.fixture
def two_devices(monkeypatch):
    # `_each_device` imports `Device` from `._native` at each call: a module attribute.
    monkeypatch.setattr(native, "Device", _Devices)
    _Devices.visible = 2
    return monkeypatch


# ---- `_limits`: every combination ------------------------------------------------------------


def test_total_only_devices_only_and_both(two_devices):
    two_devices.delenv("LOCAL_RANK", raising=False)
    assert _budget._limits("1MiB", None) == {0: MIB, 1: MIB}
    assert _budget._limits(None, {1: "2MiB"}) == {1: 2 * MIB}
    assert _budget._limits("1MiB", {1: "2MiB"}) == {0: MIB, 1: 2 * MIB}
    assert _budget._limits("1MiB", {}) == {0: MIB, 1: MIB}
    with pytest.raises(ValueError, match="give the budget"):
        _budget._limits(None, {})


def test_a_device_named_twice_is_refused_whatever_the_key_type(two_devices):
    two_devices.delenv("LOCAL_RANK", raising=False)
    for devices in ({0: "1MiB", "0": "2MiB"}, {"00": "1MiB", 0: "2MiB"}, {" 1": "1MiB", 1: "2MiB"}):
        with pytest.raises(ValueError, match="given a size twice"):
            _budget._limits("1MiB", devices)
        with pytest.raises(ValueError, match="given a size twice"):
            _budget._limits(None, devices)


def test_under_local_rank_a_named_device_is_added_beside_the_ranks_device(two_devices):
    # Under torchrun, rank 0 given `--budget 8GiB --device 1=4GiB` has a budget on device 1 too
    # (docs/python.md: "a budget of its own on another"); rank 1's replaces its size.
    two_devices.setenv("LOCAL_RANK", "0")
    assert _budget._limits("8GiB", {1: "4GiB"}) == {0: 8 << 30, 1: 4 << 30}
    two_devices.setenv("LOCAL_RANK", "1")
    assert _budget._limits("8GiB", {1: "4GiB"}) == {1: 4 << 30}


def test_an_invalid_local_rank_fails_both_but_not_devices_alone(two_devices):
    two_devices.setenv("LOCAL_RANK", "x")
    assert _budget._limits(None, {0: "1MiB"}) == {0: MIB}
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        _budget._limits("1MiB", {0: "1MiB"})


def test_a_local_rank_past_the_devices_beside_device_advises_leaving_the_budget_out(two_devices):
    # `--budget 8GiB --device 0=8GiB` with LOCAL_RANK=5 on a 2-GPU process: --budget names no
    # device, and the way on is to give the sizes per device alone, which the message says for
    # the command and for budget(devices=...).
    two_devices.setenv("LOCAL_RANK", "5")
    with pytest.raises(InvalidDeviceError) as refused:
        _budget._limits("8GiB", {0: "8GiB"})
    message = str(refused.value)
    assert "without --budget" in message and "budget(devices=" in message, message


def test_budget_beside_device_through_the_command_on_the_stand_in(stand_in_libcuda, tmp_path):
    # The command itself: both given, device 0's size wins; a named device past the visible
    # count is refused with the command's prefix, no traceback.
    script = tmp_path / "s.py"
    script.write_text("from cumempool import _budget\nprint(_budget.active().devices)\n")

    def cli(*args):
        return _cli(stand_in_libcuda, tmp_path, *args, "--", str(script))

    out = cli("--budget", "1MiB", "--device", "0=2MiB")
    assert out.returncode == 0 and out.stdout.strip() == "{0: 2097152}", out.stderr[-600:]
    out = cli("--budget", "1MiB", "--device", "1=2MiB")
    assert out.returncode != 0 and "python -m cumempool run:" in out.stderr and "Traceback" not in out.stderr
    out = cli("--budget", "1MiB", "--device", "0=2MiB", "--device", "00=3MiB")
    assert out.returncode != 0 and "given twice" in out.stderr


def test_a_failed_budget_leaves_no_route_changed_on_the_stand_in(stand_in_libcuda):
    # `--budget` covers device 0, `--device 1=` names a device the stand-in lacks: device 0's
    # pool was made current first; the failure puts the previous pool back.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        from cumempool import _budget
        os.environ.pop("LOCAL_RANK", None)
        before = cm.current_pool(cm.Route.device(0))
        try:
            cm.budget("1MiB", devices={1: "2MiB"})
            print("made")
        except cm.CumempoolError:
            print("refused")
        print(cm.current_pool(cm.Route.device(0)).handle == before.handle, _budget.active() is None)
        """,
    )
    assert words == ["refused", "True", "True"], words


def test_the_budget_installs_its_cupy_allocators_malloc_and_puts_back_the_one_before(stand_in_libcuda):
    # One device: the allocator's `malloc` (CuPy calls it without an argument tuple), the same
    # object until `close()`, which then finds it installed and puts back what was there.
    words = _with_fake_cupy(
        stand_in_libcuda,
        BUDGETED_CUPY
        + """
import cumempool.cupy as cmc
print(type(allocate.__self__) is cmc.Allocator, allocate.__name__, allocate(4096) is not None)
cupy.cuda.get_allocator = lambda: installed[-1]
budget.close()
print(installed[-1])
""",
    )
    assert words == ["True", "malloc", "True", "None"]


def test_the_budgets_cupy_allocator_releases_what_cupys_graphs_kept(stand_in_libcuda):
    # The budget installs its allocator's `malloc`; the allocator itself, whose
    # release_captured() gives back the memory kept for CuPy's graphs, is the budget's to give.
    words = _with_fake_cupy(
        stand_in_libcuda,
        BUDGETED_CUPY
        + """
allocator = cm.active().cupy_allocator(0)
print(allocate.__self__ is allocator)
s = capture(); x = allocate(4096); print(end_capture(s)); del x
print(allocator.captured_bytes)
allocator.release_captured()
print(allocator.captured_bytes)
budget.close()
""",
    )
    assert words == ["True", "0", "4096", "0"], words


def test_what_the_report_says_to_call_for_the_caches_blocks_can_be_called(stand_in_libcuda):
    # The report's advice names `cumempool.active().release_cached()`: a call the user can make
    # as written, which gives the cached block back.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import re
        import cumempool
        budget = cm.budget(devices={0: "1MiB"})
        budget.resource("cupy", 0).alloc(8192, cm.Stream(0)).close()
        call = re.search(r"\\((cumempool\\.[^ ]*\\(\\))\\)", cm.budget_report(0)).group(1)
        print(call, cumempool.active() is budget, eval(call, {"cumempool": cumempool}))
        budget.close()
        print(cumempool.active())
        """,
    )
    assert words == ["cumempool.active().release_cached()", "True", "8192", "None"], words


def test_an_interrupt_as_the_install_starts_its_thread_leaves_cupy_off_the_closed_budget(stand_in_libcuda):
    # ^C while `Thread.start` waits for the install's thread to run (the thread runs already):
    # `budget()` closes the half-made budget, whose put-back must not come before the install
    # that thread still makes, or CuPy keeps the closed budget's allocator for good.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import time
start, get = threading.Thread.start, cupy.cuda.get_allocator
starts, reads = [0], [0]
def interrupted_start(self):
    starts[0] += 1
    start(self)
    if starts[0] == 2:  # the install's thread (the first reads CuPy's allocator), started
        raise KeyboardInterrupt
def slow():
    reads[0] += 1
    if reads[0] == 2:  # the install's look at CuPy's allocator, before it sets its own
        time.sleep(0.5)
    return get()
threading.Thread.start, cupy.cuda.get_allocator = interrupted_start, slow
try:
    cm.budget(devices={0: "1MiB"})
except KeyboardInterrupt:
    print("interrupted")
threading.Thread.start = start
time.sleep(1)
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["interrupted", "True", "True"], words


def test_a_close_interrupted_as_it_starts_its_thread_still_puts_cupys_allocator_back(stand_in_libcuda):
    # ^C while `Thread.start` waits for the put-back's thread to run (it runs already): the
    # put-back is waited for, not given up, so CuPy is off the closed budget when the interrupt
    # goes on.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import time
start, run = threading.Thread.start, threading.Thread.run
budget = cm.budget(devices={0: "1MiB"})
def interrupted_start(self):
    start(self)
    raise KeyboardInterrupt
def late_run(self):  # the thread begins its work after the interrupt
    time.sleep(0.3)
    run(self)
threading.Thread.start, threading.Thread.run = interrupted_start, late_run
try:
    budget.close()
except KeyboardInterrupt:
    print("interrupted")
threading.Thread.start, threading.Thread.run = start, run
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["interrupted", "True", "True"], words


def test_a_close_handled_once_the_install_has_put_back_what_was_left_still_puts_cupys_allocator_back(
    stand_in_libcuda,
):
    # A handler that closes the budget, run as the install's last look at what nested closes
    # left (`_put_back_left`) returns, before it lets go of CuPy's lock (where CPython runs a
    # signal handler due at the end of a call): the close, nested, must not leave its put-back
    # to a look that is over.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import sys
from cumempool import _budget
def tracer(frame, event, arg):
    if event == "call" and frame.f_code is _budget._put_back_left.__code__:
        def on_return(frame, event, arg):
            if event == "return":
                sys.settrace(None)
                cm.active().close()
                print("closed inside")
            return on_return
        return on_return
    return None
sys.settrace(tracer)
budget = cm.budget(devices={0: "1MiB"})
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["closed", "inside", "True", "True"], words


def test_a_librarys_resource_made_inside_its_own_making_is_the_one_the_budget_keeps(stand_in_libcuda):
    # A finalizer (or a signal handler) that asks for CuPy's resource of the budget while this
    # thread makes it, under the budget's (reentrant) lock: both must get the one resource the
    # budget keeps, counts and gives back, not two caches of which the budget forgets one.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
from cumempool import _budget
bound = _budget.cache_bound
inner = []
def asking_bound(limit):
    _budget.cache_bound = bound
    inner.append(cm.active().resource("cupy", 0))
    return bound(limit)
budget = cm.budget(devices={0: "1MiB"})
device = budget._devices[0]
device.tops.clear(); device.caches.clear(); device.libraries.clear()
_budget.cache_bound = asking_bound
outer = budget.resource("cupy", 0)
print(outer is inner[0], budget.gave(inner[0]), len(device.caches))
budget.close()
""",
    )
    assert words == ["True", "True", "1"], words


def test_a_budget_made_inside_the_making_of_another_leaves_one_budget_in_force(stand_in_libcuda):
    # A signal handler (or finalizer) that makes a budget while this thread makes one, under the
    # budget's (reentrant) lock: one of the two must be refused, not both made with the first
    # one's check passed, two sets of pools current and only the last in `active()`.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
from cumempool import _budget
set_pool = _budget.set_current_pool
made = []
def making_inside(route, pool):
    _budget.set_current_pool = set_pool
    try:
        made.append(cm.budget(devices={0: "1MiB"}))
    except RuntimeError:
        print("refused inside")
    return set_pool(route, pool)
_budget.set_current_pool = making_inside
try:
    made.append(cm.budget(devices={0: "2MiB"}))
except RuntimeError:
    print("refused outside")
print(len(made), all(cm.active() is budget for budget in made))
for budget in made:
    budget.close()
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["refused", "inside", "1", "True", "True", "True"], words


def test_an_interrupt_as_the_install_starts_a_thread_that_has_not_set_its_ident_leaves_cupy_off_the_closed_budget(
    stand_in_libcuda,
):
    # ^C while `Thread.start` waits for the install's thread, which exists (its OS thread was
    # made) but has not run its bootstrap yet (it waits for the GIL): its `ident` is None until
    # it does. `budget()` closes the half-made budget, whose put-back finds nothing to put back;
    # the thread's install must not set the closed budget's allocator after that.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import time, _thread
start = threading.Thread.start
starts = [0]
def interrupted_start(self):
    starts[0] += 1
    if starts[0] != 2:  # the first reads CuPy's allocator, the second installs the budget's
        return start(self)
    with threading._active_limbo_lock:
        threading._limbo[self] = self
    bootstrap = self._bootstrap
    def late():  # the OS thread, waiting for the GIL before its bootstrap sets its ident
        time.sleep(0.3)
        bootstrap()
    _thread.start_new_thread(late, ())
    raise KeyboardInterrupt  # ^C in `self._started.wait()`
threading.Thread.start = interrupted_start
try:
    cm.budget(devices={0: "1MiB"})
except KeyboardInterrupt:
    print("interrupted")
threading.Thread.start = start
time.sleep(1)
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["interrupted", "True", "True"], words


def test_an_interrupt_as_the_install_starts_a_thread_that_has_set_its_ident_but_not_started_leaves_cupy_off_the_closed_budget(
    stand_in_libcuda,
):
    # ^C while `Thread.start` waits, once the thread has set its ident but before it sets
    # `_started` (the next lines of its bootstrap): `join()` there raises RuntimeError ("cannot
    # join thread before it is started"), which must neither replace the interrupt nor leave the
    # install to run after the half-made budget's close.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + """
import time, _thread
start = threading.Thread.start
starts = [0]
def interrupted_start(self):
    starts[0] += 1
    if starts[0] != 2:
        return start(self)
    with threading._active_limbo_lock:
        threading._limbo[self] = self
    self._set_ident()  # as the bootstrap's first line does
    bootstrap = self._bootstrap
    def late():
        time.sleep(0.3)
        bootstrap()
    _thread.start_new_thread(late, ())
    raise KeyboardInterrupt
threading.Thread.start = interrupted_start
try:
    cm.budget(devices={0: "1MiB"})
except KeyboardInterrupt:
    print("interrupted")
except RuntimeError as error:
    print("RuntimeError", repr(str(error)))
threading.Thread.start = start
time.sleep(1)
print(cm.active() is None, chosen["global"] is own_pool)
""",
    )
    assert words == ["interrupted", "True", "True"], words


@pytest.mark.parametrize("nested", ["budget.close()", 'budget.resource("cupy", 0)'], ids=["close", "resource"])
def test_calls_nested_in_each_lock_on_two_threads_do_not_hang(stand_in_libcuda, nested):
    # Two finalizers (or a finalizer and a signal handler), on two threads: one closes the
    # budget while thread A makes Numba's resource, the other closes it, or asks for CuPy's
    # resource, while thread C holds CuPy's lock (its close waits for the put-back's thread).
    # A's close waits for CuPy's lock; C's nested call must not then wait for the budget's
    # lock, which A must not hold while it makes a resource.
    words = _with_fake_cupy(
        stand_in_libcuda,
        SCOPED_CUPY
        + f"NESTED = {nested!r}\n"
        + """
import os, sys, time
from cumempool import _budget
budget = cm.budget(devices={0: "1MiB"})
join, pool_resource = threading.Thread.join, _budget.PoolResource
go, in_lock = threading.Event(), threading.Event()
def finalizer_under_the_lock(pool):
    _budget.PoolResource = pool_resource
    in_lock.set()
    budget.close()  # a finalizer run where thread A holds `_lock`
    return pool_resource(pool)
def making():
    go.wait()
    _budget.PoolResource = finalizer_under_the_lock
    budget.resource("numba", 0)
def joining(self, timeout=None):
    if self.name == "cumempool-cupy-allocator":
        threading.Thread.join = join
        go.set()
        in_lock.wait(5)
        time.sleep(0.3)  # A's close waits for CuPy's lock, which this thread holds
        eval(NESTED)  # a finalizer run where this thread holds CuPy's lock
    return join(self, timeout)
threading.Thread.join = joining
a = threading.Thread(target=making, daemon=True)
c = threading.Thread(target=budget.close, daemon=True)
a.start(); c.start()
join(c, 5); join(a, 5)
print(a.is_alive(), c.is_alive(), cm.active() is None, chosen["global"] is own_pool)
sys.stdout.flush()
os._exit(0)  # a thread that hangs must not hang the exit
""",
    )
    assert words == ["False", "False", "True", "True"], words
