"""Real workloads on every allocator a user would compare, in one run on device 0: a PyTorch
training step (eager, and captured once in a CUDA graph and replayed), a burst of small
short-lived PyTorch tensors, and a CuPy loop of temporaries; then the alloc+free pair ratios
of a Python pair through a cumempool pool against the same pairs looped in Rust, and of the
cumempool cache against CuPy's default MemoryPool.

    PYTHONPATH=.gpu/py python3 crates/cumempool-py/bench/workloads.py --json-out workloads.json
    python3 crates/cumempool-py/bench/workloads.py --quick        (a smoke run of about a minute)
    python3 crates/cumempool-py/bench/workloads.py --dry-run      (no GPU: the protocol, made-up numbers)

The allocators. PyTorch: its native caching allocator; PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync;
the routing recipe of docs/python.md (that backend drawing from a cumempool
MemPool(Route.device(0), max_size=8 GiB) made current with set_current_pool) as documented, and
with the routed pool's release_threshold raised to its size; the plug-in (cumempool.torch.mem_pool
with torch.cuda.use_mem_pool) over the pool and over CachingResource(PoolResource(pool)); and the
plug-in over the cache in cumempool.torch.use_mem_pool, which also runs the backward pass on the
calling thread (torch.cuda.use_mem_pool serves the calling thread only, and autograd runs backward
on a thread of its own), beside native PyTorch with the same switch (which alone saves a cuBLAS
workspace: that row's targets are read against it). CuPy: its
default MemoryPool, MemoryAsyncPool, and the plug-in (cumempool.cupy.Allocator) over the cache and
over the pool; and the default MemoryPool a second time, in a process of its own, whose ratio to
the first is the run's noise (an A/A test) for the CuPy loop's ratios. Once per run, the CuPy loop
also runs with its allocators alternated block by block in one process (the default MemoryPool,
another MemoryPool, the plug-in over the cache, the budget's plug-in), so that each ratio compares
blocks milliseconds apart in the same process (--no-interleaved leaves it out).

Method. Each configuration runs in a fresh process (this script with --child; the backend variable
is set before PyTorch starts), in interleaved rounds: round r runs every configuration once, in an
order rotated by r, so drift hits all alike. A child times each iteration (a training step or a
replay followed by a synchronisation; a burst of 1000 tensors; a block of CuPy iterations) and
reports the median; the table shows the median over rounds and, against the library's own
baseline (PyTorch native, CuPy's default MemoryPool; the routing recipe also against
cudaMallocAsync), the median of the per-round ratios. Peak memory is read after the eager training
step, the first workload of a fresh process: PyTorch's max_memory_reserved() (which counts a
MemPool's segments too), the routed pool's reserved high-water mark where PyTorch reads 0, and the
cumempool pool's own high-water marks beside. Every configuration must compute the same losses
and checksums (seeded, dropout 0; a tolerance for the losses, exact for the burst): a mismatch,
or a configuration that fails, ends the run with exit status 1. The targets are printed as
PASS/FAIL lines: measurements, not tests. Rounds stop early once the next would pass --budget.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

MIB = 1 << 20
CAP = 8 << 30  # every cumempool pool here: MemPool(Route.device(0), max_size=CAP)
BACKEND_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
ASYNC_BACKEND = "backend:cudaMallocAsync"

# The training step: a 4-layer TransformerEncoder, SGD, mean squared error against a fixed target.
D_MODEL, NHEAD, LAYERS, BATCH, SEQ = 512, 8, 4, 16, 256
GRAPH_WARMUP_STEPS = 3  # on a side stream before the capture, as PyTorch's documentation asks
GRAPH_WARM_REPLAYS = 3
# The burst: this many tensors of 4 KiB..1 MiB (float32), each filled, scaled and summed.
BURST_TENSORS = 1000
# The CuPy loop: an elementwise chain and a sum over this many float32.
LOOP_ELEMENTS = 1 << 20

LOSS_RTOL = 1e-3  # memory-efficient attention's backward may sum in any order
LOOP_RTOL = 1e-6


@dataclass(frozen=True)
class Counts:
    """Iterations per child (warm-up ones are not timed) and the pair microbench's sizes."""

    step_warmup: int
    steps: int
    replays: int
    burst_warmup: int
    bursts: int
    loop_block: int
    loop_blocks: int
    pairs: int
    pair_rounds: int


FULL = Counts(
    step_warmup=5, steps=40, replays=40, burst_warmup=2, bursts=12, loop_block=300, loop_blocks=10, pairs=20000, pair_rounds=15
)
QUICK = Counts(
    step_warmup=2, steps=8, replays=8, burst_warmup=1, bursts=3, loop_block=100, loop_blocks=4, pairs=4000, pair_rounds=5
)


@dataclass(frozen=True)
class Config:
    """One allocator set-up; `library` says which workloads its child runs."""

    key: str
    label: str
    library: str
    backend: str | None = None  # PYTORCH_CUDA_ALLOC_CONF for the child (unset when None)
    optional: bool = False  # its failure is reported but does not fail the run


CONFIGS = [
    Config("torch-native", "torch native caching allocator", "torch"),
    Config("torch-async", "torch backend:cudaMallocAsync", "torch", ASYNC_BACKEND),
    Config("torch-recipe", "routing recipe (as documented)", "torch", ASYNC_BACKEND),
    Config("torch-recipe-threshold", "routing recipe, threshold raised", "torch", ASYNC_BACKEND),
    Config("torch-plugin-pool", "plug-in over the pool", "torch"),
    Config("torch-plugin-cache", "plug-in over the cache", "torch"),
    Config("torch-plugin-cache-backward", "plug-in over the cache, backward too", "torch"),
    # Native again with the backward pass on the calling thread, as the row above runs it: the
    # threading mode alone moves the peak (each thread's cuBLAS handle has its own workspace).
    Config("torch-native-backward", "native, backward on the calling thread", "torch"),
    Config("torch-budget", "cumempool.budget (routing)", "torch", ASYNC_BACKEND),
    Config("cupy-default", "CuPy default MemoryPool", "cupy"),
    # The baseline again, in a process of its own: its ratio is this run's noise (an A/A test).
    Config("cupy-default-again", "CuPy default MemoryPool, again (noise)", "cupy"),
    Config("cupy-async", "CuPy MemoryAsyncPool", "cupy"),
    Config("cupy-plugin-cache", "plug-in over the cache", "cupy"),
    Config("cupy-plugin-pool", "plug-in over the pool", "cupy"),
    Config("cupy-budget", "cumempool.budget (plug-in)", "cupy"),
    Config("cupy-budget-recording", "cumempool.budget, recording stacks", "cupy"),
    Config("cupy-budget-recording-nostacks", "cumempool.budget, recording, no stacks", "cupy"),
]
PAIRS = Config("pairs", "alloc+free pairs", "cumempool")
# The CuPy loop with its allocators alternated block by block inside one process: each cycle runs
# one block on each, so a ratio compares blocks a few milliseconds apart, on the same process's
# placement and clocks (the fresh processes of the rounds differ by more than the allocators do).
INTERLEAVED = Config("cupy-interleaved", "CuPy loop, allocators alternated in one process", "cupy", optional=True)
INTERLEAVED_CYCLES = {"full": 40, "quick": 8}
INTERLEAVED_ROWS = (
    "default MemoryPool",
    "default MemoryPool, another (A/A)",
    "plug-in over the cache",
    "cumempool.budget (plug-in)",
)
BY_KEY = {c.key: c for c in [*CONFIGS, PAIRS, INTERLEAVED]}
BASELINE = {"torch": "torch-native", "cupy": "cupy-default"}
WORKLOADS = {"torch": ("step", "burst", "graph"), "cupy": ("loop",)}
# Relative tolerance of each workload's checksum across configurations and rounds.
TOLERANCE = {"step": LOSS_RTOL, "graph": LOSS_RTOL, "burst": 0.0, "loop": LOOP_RTOL}


class Skip(Exception):
    """A configuration this machine cannot run (a missing hook): reported, not a failure."""


# ---------------------------------------------------------------------------------------------
# Children: one configuration, every workload of its library, a JSON result file.


def median_of(times: list[float]) -> float:
    return statistics.median(times) if times else math.nan


class TorchAllocator:
    """What one PyTorch configuration sets up. `scope()` is where the workloads allocate,
    `graph_pool` the pool a capture allocates from (None: PyTorch's own private pool), and
    `memory()` the readings."""

    def __init__(self, key: str, torch, cm):
        self.key, self.torch, self.cm = key, torch, cm
        self.pool = self.guard = self.mem_pool = self.budget = None
        route = cm.Route.device(0)
        if key == "torch-budget":
            # What `python -m cumempool run --budget` makes, before PyTorch's first allocation
            # (PyTorch is imported already, on the backend the child's environment chose).
            self.budget = cm.budget(devices={0: CAP})
            self.pool = self.budget.pool(0)
        elif key.startswith("torch-recipe"):
            # Before PyTorch's first allocation, as the recipe says.
            self.pool = cm.MemPool(route, max_size=CAP)
            self.documented_threshold = self.pool.release_threshold
            if key == "torch-recipe-threshold":
                self.pool.release_threshold = CAP
            self.guard = cm.set_current_pool(route, self.pool)
        if key.endswith("-backward") and not hasattr(torch.autograd.grad_mode, "set_multithreading_enabled"):
            raise Skip("this PyTorch has no torch.autograd.grad_mode.set_multithreading_enabled")
        if key.startswith("torch-plugin"):
            import cumempool.torch as cmt

            self.pool = cm.MemPool(route, max_size=CAP)
            source = self.pool if key == "torch-plugin-pool" else cm.CachingResource(cm.PoolResource(self.pool))
            self.mem_pool = cmt.mem_pool(source)
        self.backend = torch.cuda.memory.get_allocator_backend()
        wanted = "cudaMallocAsync" if BY_KEY[key].backend == ASYNC_BACKEND else "native"
        if self.backend != wanted:
            self.close()
            raise RuntimeError(f"PyTorch runs the {self.backend} backend where {key} needs {wanted}")

    @property
    def graph_pool(self):
        return None if self.mem_pool is None else self.mem_pool.id

    @contextlib.contextmanager
    def scope(self):
        if self.key == "torch-native-backward":
            with self.capture_threads():
                yield
        elif self.mem_pool is None:
            yield
        elif self.key == "torch-plugin-cache-backward":
            import cumempool.torch as cmt

            with cmt.use_mem_pool(self.mem_pool):  # the backward pass on this thread, in the pool
                yield
        else:
            with self.torch.cuda.use_mem_pool(self.mem_pool):
                yield

    def capture_threads(self):
        """Where the capture's backward pass runs: on the thread its warm-ups ran it on, whose
        cuBLAS handles they made (a handle made during a capture invalidates it)."""
        if self.key.endswith("-backward"):
            from torch.autograd.grad_mode import set_multithreading_enabled

            return set_multithreading_enabled(False)
        return contextlib.nullcontext()

    def memory(self) -> dict:
        torch, cm = self.torch, self.cm
        found = {"torch_max_reserved": torch.cuda.max_memory_reserved(), "torch_max_allocated": torch.cuda.max_memory_allocated()}
        peak = found["torch_max_reserved"]
        if self.pool is not None:
            found["pool_reserved_high"] = self.pool.reserved_mem_high
            found["pool_used_high"] = self.pool.used_mem_high
            found["pool_release_threshold"] = self.pool.release_threshold
        if self.guard is not None:
            found["documented_release_threshold"] = self.documented_threshold
        if self.guard is not None or self.budget is not None:
            peak = found["pool_reserved_high"]  # PyTorch's statistics read the pool it set up
        elif self.backend == "cudaMallocAsync":
            found["default_pool_reserved_high"] = cm.default_pool(cm.Route.device(0)).reserved_mem_high
            peak = max(peak, found["default_pool_reserved_high"])
        if self.mem_pool is not None:
            import cumempool.torch as cmt

            usage = cmt.statistics()
            found["plugin_peak"] = usage.get("peak_bytes", 0)
            found["plugin_total"] = usage.get("total_bytes", 0)
        found["peak_reserved"] = peak
        return found

    def close(self):
        torch = self.torch
        try:
            torch.cuda.synchronize()
            if self.mem_pool is not None:
                import cumempool.torch as cmt

                self.mem_pool = None
                torch.cuda.empty_cache()
                cmt.stop()
            if self.guard is not None or self.budget is not None:
                torch.cuda.empty_cache()
        finally:
            if self.guard is not None:
                self.guard.restore()
            if self.budget is not None:
                self.budget.close()


def torch_model(torch):
    """The seeded model, batch, target and optimizer, built on the CPU (the same numbers for
    every configuration) and moved to the device, where the configuration allocates them."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D_MODEL, NHEAD, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).cuda()
    x = torch.randn(BATCH, SEQ, D_MODEL).cuda()
    y = torch.randn(BATCH, SEQ, D_MODEL).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.01), x, y


def train_step(torch, model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def timed(torch, run, times: int) -> tuple[list[float], object]:
    """Seconds of each of `times` calls of `run`, each followed by a synchronisation, and the
    last call's value."""
    spent, value = [], None
    for _ in range(times):
        start = time.perf_counter()
        value = run()
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - start)
    return spent, value


def torch_step(torch, alloc: TorchAllocator, counts: Counts) -> dict:
    with alloc.scope():
        model, optimizer, x, y = torch_model(torch)
        for _ in range(counts.step_warmup):
            train_step(torch, model, optimizer, x, y)
        torch.cuda.synchronize()
        spent, loss = timed(torch, functools.partial(train_step, torch, model, optimizer, x, y), counts.steps)
        checksum = loss.item()
        del model, optimizer, x, y, loss
    torch.cuda.synchronize()
    return {"median_s": median_of(spent), "iterations": len(spent), "checksum": checksum, "memory": alloc.memory()}


def burst_sizes() -> list[int]:
    rng = random.Random(0)
    return [rng.randint(1024, 256 * 1024) for _ in range(BURST_TENSORS)]  # float32: 4 KiB..1 MiB


def torch_burst(torch, alloc: TorchAllocator, counts: Counts) -> dict:
    sizes = burst_sizes()

    def burst():
        total = torch.zeros((), dtype=torch.float64, device="cuda")
        for n in sizes:
            t = torch.ones(n, device="cuda")
            total += (t * 2.0 + 1.0).sum(dtype=torch.float64)
        return total

    with alloc.scope():
        timed(torch, burst, counts.burst_warmup)
        spent, total = timed(torch, burst, counts.bursts)
        checksum = total.item()
        del total
    expected = 3.0 * sum(sizes)
    if checksum != expected:
        raise AssertionError(f"the burst summed {checksum!r} where {expected!r} is right")
    return {"median_s": median_of(spent), "iterations": len(spent), "checksum": checksum, "memory": alloc.memory()}


def torch_graph(torch, alloc: TorchAllocator, counts: Counts) -> dict:
    with alloc.scope():
        model, optimizer, x, y = torch_model(torch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_STEPS):
                train_step(torch, model, optimizer, x, y)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    # Outside the scope: PyTorch refuses a second diversion to the pool the capture uses.
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with alloc.capture_threads(), torch.cuda.graph(graph, pool=alloc.graph_pool):
        static_loss = torch.nn.functional.mse_loss(model(x), y)
        static_loss.backward()
        optimizer.step()
    timed(torch, graph.replay, GRAPH_WARM_REPLAYS)
    spent, _ = timed(torch, graph.replay, counts.replays)
    checksum = static_loss.item()
    del graph, static_loss, model, optimizer, x, y, side
    torch.cuda.synchronize()
    return {"median_s": median_of(spent), "iterations": len(spent), "checksum": checksum}


def torch_child(key: str, counts: Counts, result: dict):
    import torch

    import cumempool as cm

    result["environment"] = environment(cm, torch=torch.__version__)
    alloc = TorchAllocator(key, torch, cm)
    result["backend"] = alloc.backend
    try:
        # The eager step first: its peak is read in a fresh process.
        run_workloads(result, {"step": torch_step, "burst": torch_burst, "graph": torch_graph}, torch, alloc, counts)
    finally:
        alloc.close()


def loop_block(cupy, x, total, iterations: int, stream) -> float:
    """`iterations` of the CuPy loop of temporaries, summed into `total` in place: seconds per
    iteration, `stream` synchronised at the end."""
    start = time.perf_counter()
    for _ in range(iterations):
        y = ((x * 2.0 + 1.0) ** 2 - x) / (x + 1.0)
        total += y.sum(dtype=cupy.float64)
    del y
    stream.synchronize()
    return (time.perf_counter() - start) / iterations


def installed_form(allocator):
    """What `cupy.cuda.set_allocator` is given for a plug-in allocator: its `malloc`, which CuPy
    calls without making an argument tuple (the object itself in builds that have no `malloc`,
    so that wheels_ab.py can measure a build before it)."""
    return getattr(allocator, "malloc", allocator)


def cupy_child(key: str, counts: Counts, result: dict):
    import cupy

    import cumempool as cm
    import cumempool.cupy as cmc

    result["environment"] = environment(cm, cupy=cupy.__version__)
    pool = memory_pool = budget = None
    if key.startswith("cupy-budget"):
        # What `python -m cumempool run --budget` installs for CuPy (CuPy is imported already:
        # the budget installs its allocator at once).
        budget = cm.budget(devices={0: CAP})
        pool = budget.pool(0)
        if key.startswith("cupy-budget-recording"):
            cm.record_history(True, stacks=None if key.endswith("nostacks") else "python")
        allocator = cupy.cuda.get_allocator()
    elif key in ("cupy-default", "cupy-default-again"):
        memory_pool = cupy.cuda.MemoryPool()
        allocator = memory_pool.malloc
    elif key == "cupy-async":
        allocator = cupy.cuda.MemoryAsyncPool().malloc
    else:
        pool = cm.MemPool(cm.Route.device(0), max_size=CAP)
        allocator = installed_form(
            cmc.Allocator(pool if key == "cupy-plugin-pool" else cm.CachingResource(cm.PoolResource(pool)))
        )

    def loop(_, __, counts):
        with cupy.cuda.using_allocator(allocator):
            x = cupy.arange(LOOP_ELEMENTS, dtype=cupy.float32) / LOOP_ELEMENTS
            total = cupy.zeros((), dtype=cupy.float64)
            stream = cupy.cuda.get_current_stream()
            spent, sampled = [], 0
            for block in range(counts.loop_blocks + 1):  # the first warms up (and compiles)
                seconds = loop_block(cupy, x, total, counts.loop_block, stream)
                if block:
                    spent.append(seconds)
                if memory_pool is not None:
                    sampled = max(sampled, memory_pool.total_bytes())
            checksum = float(total)
            del x, total
        memory = {}
        if memory_pool is not None:
            memory["memory_pool_total_high_sampled"] = sampled
            memory["peak_reserved"] = sampled
        elif pool is None:
            memory["peak_reserved"] = memory["default_pool_reserved_high"] = cm.default_pool(cm.Route.device(0)).reserved_mem_high
        else:
            memory["peak_reserved"] = memory["pool_reserved_high"] = pool.reserved_mem_high
            memory["pool_used_high"] = pool.used_mem_high
            memory["pool_release_threshold"] = pool.release_threshold
        return {
            "median_s": median_of(spent),
            "iterations": len(spent) * counts.loop_block,
            "checksum": checksum,
            "memory": memory,
        }

    try:
        run_workloads(result, {"loop": loop}, None, None, counts)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        if budget is not None:
            cm.record_history(False)
            budget.close()


def interleaved_child(counts: Counts, cycles: int, result: dict):
    """The CuPy loop on each of INTERLEAVED_ROWS in turn, a block of `counts.loop_block`
    iterations each, for `cycles` cycles (the first warms up), in an order rotated each cycle:
    the seconds per iteration of every block, by row and cycle."""
    import cupy

    import cumempool as cm
    import cumempool.cupy as cmc

    result["environment"] = environment(cm, cupy=cupy.__version__)
    budget = cm.budget(devices={0: CAP})
    try:
        pool = cm.MemPool(cm.Route.device(0), max_size=CAP)
        allocators = dict(
            zip(
                INTERLEAVED_ROWS,
                (
                    cupy.cuda.MemoryPool().malloc,
                    cupy.cuda.MemoryPool().malloc,
                    installed_form(cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))),
                    cupy.cuda.get_allocator(),  # what the budget installed for CuPy
                ),
                strict=True,
            )
        )
        seconds: dict[str, list[float]] = {row: [] for row in INTERLEAVED_ROWS}
        checksums: dict[str, float] = {}
        with cupy.cuda.using_allocator(allocators[INTERLEAVED_ROWS[0]]):
            x = cupy.arange(LOOP_ELEMENTS, dtype=cupy.float32) / LOOP_ELEMENTS
        stream = cupy.cuda.get_current_stream()
        for cycle in range(cycles + 1):
            shift = cycle % len(INTERLEAVED_ROWS)
            for row in INTERLEAVED_ROWS[shift:] + INTERLEAVED_ROWS[:shift]:
                with cupy.cuda.using_allocator(allocators[row]):
                    total = cupy.zeros((), dtype=cupy.float64)
                    stream.synchronize()
                    spent = loop_block(cupy, x, total, counts.loop_block, stream)
                    if cycle:  # the first cycle warms up (and compiles)
                        seconds[row].append(spent)
                    checksums[row] = float(total)
                    del total
        del x
        stream.synchronize()
        result["interleaved"] = {"block_iterations": counts.loop_block, "cycles": cycles, "seconds": seconds}
        first = checksums[INTERLEAVED_ROWS[0]]
        differ = {row: value for row, value in checksums.items() if abs(value - first) > LOOP_RTOL * abs(first)}
        if differ:
            result["errors"]["interleaved"] = f"the rows' sums differ from {first!r}: {differ!r}"
    finally:
        budget.close()


def pairs_child(counts: Counts, result: dict):
    """The pair ratios: a Python pool pair against the same pairs looped in Rust, the cache pair
    (and the CuPy plug-in's pair over the cache) against CuPy's default MemoryPool pair. Each
    cumempool pair is timed two ways: freed by `close()`, and let go of (the Buffer dropped at
    once, which frees it), as CuPy's pair lets go of its MemoryPointer. Each round times each
    side once, so the ratios are medians of per-round ratios."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import alloc_pair

    import cumempool as cm

    # The Rust loop needs the benchmark hooks; without them (a user's wheel) the other rows run.
    native = alloc_pair.bench_hooks_or_none()

    result["environment"] = environment(cm)
    size, pairs = alloc_pair.SIZE, counts.pairs
    stream = cm.Stream(0)
    pool = cm.MemPool(cm.Route.device(0))
    cache = cm.CachingResource(cm.PoolResource(pool))
    rows: dict[str, list[float]] = {"pool pair": [], "pool pair, let go": []}
    if native is not None:
        rows["pool pair in Rust"] = []
    else:
        result["rust_pairs_skipped"] = alloc_pair.HOOKS_MISSING
    rows["cache pair"], rows["cache pair, let go"] = [], []
    try:
        import cupy
    except ImportError as error:
        cupy = None
        result["cupy_skipped"] = f"CuPy is not installed: {error}"
    if cupy is not None:
        import cumempool.cupy as cmc

        result["environment"]["cupy"] = cupy.__version__
        memory_pool = cupy.cuda.MemoryPool()
        plugin = installed_form(cmc.Allocator(cache))
        rows["CuPy default MemoryPool pair"], rows["CuPy plug-in pair over the cache"] = [], []
        cupy_stream = cupy.cuda.Stream(non_blocking=True)
    # CuPy's current stream (for its rows only: cumempool's rows name their stream).
    with cupy_stream if cupy is not None else contextlib.nullcontext():
        for _ in range(counts.pair_rounds):
            rows["pool pair"].append(alloc_pair.measure(lambda: pool.alloc(size, stream).close(), pairs, 1))
            rows["pool pair, let go"].append(alloc_pair.measure(lambda: pool.alloc(size, stream), pairs, 1))
            if native is not None:
                rows["pool pair in Rust"].append(native._bench_rust_pairs(pool, size, stream, pairs) / 1e9)
            rows["cache pair"].append(alloc_pair.measure(lambda: cache.alloc(size, stream).close(), pairs, 1))
            rows["cache pair, let go"].append(alloc_pair.measure(lambda: cache.alloc(size, stream), pairs, 1))
            if cupy is not None:
                rows["CuPy default MemoryPool pair"].append(alloc_pair.measure(lambda: memory_pool.malloc(size), pairs, 1))
                rows["CuPy plug-in pair over the cache"].append(alloc_pair.measure(lambda: plugin(size), pairs, 1))
        if cupy is not None:
            cupy_stream.synchronize()
    stream.synchronize()
    result["pairs"] = {"size_bytes": size, "pairs_per_round": pairs, "rounds": counts.pair_rounds, "seconds": rows}


def run_workloads(result: dict, workloads: dict, library, alloc, counts: Counts):
    """Runs each workload, keeping its figures or its error (the others still run)."""
    for name, run in workloads.items():
        try:
            result["workloads"][name] = run(library, alloc, counts)
        except Exception:  # noqa: BLE001 (reported to the parent, which fails the run)
            result["errors"][name] = traceback.format_exc(limit=8)


def environment(cm, **versions) -> dict:
    try:
        from importlib.metadata import version

        package = version("cumempool")
    except Exception:  # noqa: BLE001 (a source tree without metadata)
        package = "unknown"
    found = {
        "device": cm.Device(0).name,
        "driver": ".".join(map(str, cm.driver_version())),
        "python": sys.version.split()[0],
        "cumempool": package,
    }
    found.update(versions)
    return found


def dry_child(key: str, counts: Counts, result: dict, skew: str | None):
    """Made-up figures in the shape a real child writes (no GPU, no library imported)."""
    config = BY_KEY[key]
    factor = 1.0 + 0.01 * [c.key for c in CONFIGS + [PAIRS, INTERLEAVED]].index(key)
    checksum = {"step": 0.75, "graph": 0.74, "burst": 3.0 * sum(burst_sizes()), "loop": 1234.5}
    result["environment"] = {"device": "(dry run)", "driver": "-", "python": sys.version.split()[0], "cumempool": "-"}
    if key == INTERLEAVED.key:
        cycles = INTERLEAVED_CYCLES["quick" if counts is QUICK else "full"]
        result["interleaved"] = {
            "block_iterations": counts.loop_block,
            "cycles": cycles,
            "seconds": {row: [1e-4 * (1.0 + 0.01 * i)] * cycles for i, row in enumerate(INTERLEAVED_ROWS)},
        }
        return
    if key == "pairs":
        seconds = {
            "pool pair": 1.3e-6,
            "pool pair, let go": 1.25e-6,
            "pool pair in Rust": 1.2e-6,
            "cache pair": 0.3e-6,
            "cache pair, let go": 0.25e-6,
            "CuPy default MemoryPool pair": 2e-6,
            "CuPy plug-in pair over the cache": 0.6e-6,
        }
        result["pairs"] = {
            "size_bytes": MIB,
            "pairs_per_round": counts.pairs,
            "rounds": 2,
            "seconds": {k: [v, v] for k, v in seconds.items()},
        }
        return
    for name in WORKLOADS[config.library]:
        value = checksum[name] * (1.5 if key == skew else 1.0)
        memory = {"peak_reserved": int(1000 * MIB * factor)}
        result["workloads"][name] = {"median_s": 0.01 * factor, "iterations": 1, "checksum": value, "memory": memory}


def child_main(args) -> int:
    counts = QUICK if args.quick else FULL
    result = {"config": args.child, "workloads": {}, "errors": {}, "skipped": None}
    try:
        if args.dry_run:
            dry_child(args.child, counts, result, args.dry_run_skew)
        elif args.child == "pairs":
            pairs_child(counts, result)
        elif args.child == INTERLEAVED.key:
            interleaved_child(counts, INTERLEAVED_CYCLES["quick" if args.quick else "full"], result)
        elif BY_KEY[args.child].library == "torch":
            torch_child(args.child, counts, result)
        else:
            cupy_child(args.child, counts, result)
    except Skip as reason:
        result["skipped"] = str(reason)
    except Exception:  # noqa: BLE001 (reported to the parent, which fails the run)
        result["errors"]["child"] = traceback.format_exc(limit=8)
    with open(args.result, "w") as out:
        json.dump(result, out)
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: rounds of children, then the tables, the targets and the checks.


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def child_command(key: str, result_path: str, args) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--child", key, "--result", result_path]
    if args.quick:
        command.append("--quick")
    if args.dry_run:
        command.append("--dry-run")
        if args.dry_run_skew:
            command += ["--dry-run-skew", args.dry_run_skew]
    return command


def child_environment(config: Config) -> dict:
    env = dict(os.environ)
    env.pop(BACKEND_VARIABLE, None)  # every configuration gets only its own setting
    if config.backend:
        env[BACKEND_VARIABLE] = config.backend
    return env


def run_child(config: Config, args, timeout: float) -> dict:
    """The child's result, with `failure` set where it did not finish cleanly."""
    with tempfile.TemporaryDirectory(prefix="cumempool-workloads-") as tmp:
        path = os.path.join(tmp, "result.json")
        command = child_command(config.key, path, args)
        try:
            out = subprocess.run(command, env=child_environment(config), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"config": config.key, "workloads": {}, "errors": {}, "failure": f"timed out after {timeout:.0f} s"}
        try:
            with open(path) as file:
                result = json.load(file)
        except (OSError, ValueError):
            result = {"config": config.key, "workloads": {}, "errors": {}}
        if out.returncode != 0 or "skipped" not in result:
            tail = "\n".join(out.stderr.strip().splitlines()[-15:])
            # A child that wrote its figures and then failed (at teardown, say) still failed.
            result["failure"] = f"exit status {out.returncode}{'' if 'skipped' in result else ', no result'}:\n{tail}"
        return result


def ratio_series(runs: dict, key: str, base: str, pick) -> list[float]:
    """Per-round ratios of `pick(result)` for `key` over `base`, rounds where both have it."""
    ratios = []
    for round_, result in runs.get(key, {}).items():
        other = runs.get(base, {}).get(round_)
        a, b = pick(result), (pick(other) if other else None)
        if a is not None and b:
            ratios.append(a / b)
    return ratios


def picker(workload: str, field: str):
    def pick(result):
        figures = result.get("workloads", {}).get(workload)
        if not figures:
            return None
        value = figures.get(field) if field != "peak_reserved" else figures.get("memory", {}).get("peak_reserved")
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value

    return pick


def summarise(runs: dict, configs: list[Config]) -> dict:
    """Per configuration and workload: the median over rounds and the median per-round ratio to
    the library's baseline (and, for the recipe, to cudaMallocAsync)."""
    summary = {}
    for config in configs:
        if config.library not in BASELINE:
            continue
        base = BASELINE[config.library]
        entry = {}
        for workload in WORKLOADS[config.library]:
            fields = {"median_s": picker(workload, "median_s")}
            if workload in ("step", "loop"):
                fields["peak_reserved"] = picker(workload, "peak_reserved")
            for field, pick in fields.items():
                values = [v for v in (pick(r) for r in runs.get(config.key, {}).values()) if v is not None]
                figures = {"median": statistics.median(values) if values else None, "rounds": len(values)}
                ratios = ratio_series(runs, config.key, base, pick)
                figures["ratio"] = statistics.median(ratios) if ratios else None
                figures["ratios"] = ratios
                if config.key.startswith("torch-recipe"):
                    vs_async = ratio_series(runs, config.key, "torch-async", pick)
                    figures["ratio_vs_async"] = statistics.median(vs_async) if vs_async else None
                if config.key == "torch-plugin-cache-backward":
                    vs_same = ratio_series(runs, config.key, "torch-native-backward", pick)
                    figures["ratio_vs_native_backward"] = statistics.median(vs_same) if vs_same else None
                entry[f"{workload}.{field}"] = figures
        summary[config.key] = entry
    return summary


def check_checksums(runs: dict, configs: list[Config]) -> tuple[list[str], list[str]]:
    """(lines saying what agreed, lines naming each mismatch)."""
    agreed, mismatches = [], []
    for library, workloads in WORKLOADS.items():
        keys = [c.key for c in configs if c.library == library]
        for workload in workloads:
            values = [
                (key, round_, result["workloads"][workload]["checksum"])
                for key in keys
                for round_, result in sorted(runs.get(key, {}).items())
                if workload in result.get("workloads", {})
            ]
            if not values:
                continue
            base = [v for v in values if v[0] == BASELINE[library]] or values
            reference = base[0][2]
            tolerance = TOLERANCE[workload]
            bad = [v for v in values if not (math.isfinite(v[2]) and abs(v[2] - reference) <= tolerance * abs(reference))]
            for key, round_, value in bad:
                mismatches.append(
                    f"MISMATCH {workload}: {key} round {round_ + 1} computed {value!r}, {base[0][0]} {reference!r} (rtol {tolerance})"
                )
            if not bad:
                agreed.append(
                    f"{workload}: {len(values)} results of {len({v[0] for v in values})} configurations agree (rtol {tolerance}): {reference!r}"
                )
    return agreed, mismatches


def fmt(value, scale=1.0, digits=3, width=9) -> str:
    return f"{value * scale:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


# Table columns: (summary entry, heading, scale, digits, width); each is followed by its ratio.
TORCH_COLUMNS = (
    ("step.median_s", "step ms", 1e3, 3, 9),
    ("graph.median_s", "replay ms", 1e3, 3, 11),
    ("burst.median_s", "burst ms", 1e3, 3, 10),
    ("step.peak_reserved", "peak MiB", 1 / MIB, 1, 10),
)
CUPY_COLUMNS = (("loop.median_s", "us/iter", 1e6, 2, 9), ("loop.peak_reserved", "peak MiB", 1 / MIB, 1, 10))


def table_rows(summary: dict, configs: list[Config], library: str, columns) -> list[str]:
    """The heading and a row per configuration of `library`: each column's median and ratio."""
    rows = [f"  {'configuration':<38}" + "".join(f"{heading:>{width}}{'x':>7}" for _, heading, _, _, width in columns)]
    for config in configs:
        if config.library == library and config.key in summary:
            s = summary[config.key]
            cells = (
                fmt(s[name]["median"], scale, digits, width) + fmt(s[name]["ratio"], 1, 3, 7)
                for name, _, scale, digits, width in columns
            )
            rows.append(f"  {config.label:<38}" + "".join(cells))
    return rows


def torch_table(summary: dict, configs: list[Config], runs: dict) -> list[str]:
    lines = [
        f"PyTorch: training step (TransformerEncoder {LAYERS} layers, d_model {D_MODEL}, nhead {NHEAD}, batch {BATCH} x {SEQ}, SGD),",
        f"its CUDA graph replayed, a burst of {BURST_TENSORS} tensors of 4 KiB..1 MiB; medians, x = ratio to torch native",
        *table_rows(summary, configs, "torch", TORCH_COLUMNS),
    ]
    recipe = [c for c in configs if c.key.startswith("torch-recipe") and c.key in summary]
    for config in recipe:
        s = summary[config.key]
        parts = [
            f"{w} {fmt(s[f'{n}.median_s']['ratio_vs_async'], 1, 3, 0)}x"
            for w, n in (("step", "step"), ("replay", "graph"), ("burst", "burst"))
        ]
        lines.append(f"  {config.label} against backend:cudaMallocAsync: " + ", ".join(parts))
    if "torch-plugin-cache-backward" in summary and "torch-native-backward" in summary:
        s = summary["torch-plugin-cache-backward"]
        parts = [
            f"{w} {fmt(s[n]['ratio_vs_native_backward'], 1, 3, 0)}x"
            for w, n in (
                ("step", "step.median_s"),
                ("replay", "graph.median_s"),
                ("burst", "burst.median_s"),
                ("peak", "step.peak_reserved"),
            )
        ]
        lines.append(
            "  plug-in over the cache, backward too, against native with backward on the calling thread: " + ", ".join(parts)
        )
    shares = []
    for config in configs:
        if config.key.startswith("torch-plugin") and config.key in runs:
            fractions = []
            for result in runs[config.key].values():
                memory = result.get("workloads", {}).get("step", {}).get("memory", {})
                if memory.get("torch_max_reserved"):
                    fractions.append(memory.get("plugin_peak", 0) / memory["torch_max_reserved"])
            if fractions:
                shares.append(f"{config.label} {statistics.median(fractions) * 100:.0f}%")
    if shares:
        lines.append("  the plug-in's peak bytes in PyTorch's reserved peak, eager step (torch.cuda.use_mem_pool serves the")
        lines.append("  calling thread only; backward runs on autograd's own thread unless kept on it): " + ", ".join(shares))
    return lines


def cupy_table(summary: dict, configs: list[Config]) -> list[str]:
    return [
        f"CuPy: a loop of temporaries (elementwise chain + sum over {LOOP_ELEMENTS >> 20}M float32); medians, x = ratio to the default MemoryPool",
        *table_rows(summary, configs, "cupy", CUPY_COLUMNS),
    ]


def interleaved_figures(interleaved: dict | None) -> dict:
    """Per row of the alternated CuPy loop: the median seconds per iteration, and the median,
    first and third quartiles of its per-cycle ratio to the default MemoryPool's block."""
    if not interleaved or "interleaved" not in interleaved:
        return {}
    seconds = interleaved["interleaved"]["seconds"]
    base = seconds.get(INTERLEAVED_ROWS[0], [])
    found = {}
    for row, values in seconds.items():
        ratios = sorted(v / b for v, b in zip(values, base, strict=False) if b)
        if not values or not ratios:
            continue
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        found[row] = {
            "median_s": statistics.median(values),
            "ratio": statistics.median(ratios),
            "q1": quartiles[0],
            "q3": quartiles[2],
        }
    return found


def _first_and_last(text: str) -> str:
    """A failure in one line: its first line, and its last where they differ (a traceback's
    cause)."""
    lines = text.strip().splitlines() or [""]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def interleaved_table(figures: dict, interleaved: dict | None) -> list[str]:
    if not figures:
        failure = (interleaved or {}).get("failure") or next(iter((interleaved or {}).get("errors", {}).values()), None)
        return (
            []
            if interleaved is None
            else [
                f"CuPy loop, allocators alternated in one process: not measured ({_first_and_last(str(failure)) if failure else 'no result'})"
            ]
        )
    meta = interleaved["interleaved"]
    lines = [
        f"CuPy loop, allocators alternated block by block in one process ({meta['cycles']} cycles of "
        f"{meta['block_iterations']}-iteration blocks); x = median per-cycle ratio to the default MemoryPool's block",
        f"  {'configuration':<38}{'us/iter':>9}{'x':>8}   interquartile x",
    ]
    for row in INTERLEAVED_ROWS:
        if row in figures:
            f = figures[row]
            lines.append(f"  {row:<38}{f['median_s'] * 1e6:9.2f}{f['ratio']:8.3f}   {f['q1']:.3f}-{f['q3']:.3f}")
    return lines


def pair_figures(pairs: dict | None) -> dict:
    """Medians (seconds) of each pair row and the per-round ratios the targets use."""
    if not pairs or "pairs" not in pairs:
        return {}
    seconds = pairs["pairs"]["seconds"]
    found = {name: statistics.median(values) for name, values in seconds.items() if values}

    def ratio(a, b):
        if a not in seconds or b not in seconds:
            return None
        per_round = [x / y for x, y in zip(seconds[a], seconds[b], strict=False) if y]
        return statistics.median(per_round) if per_round else None

    found["pool/rust"] = ratio("pool pair", "pool pair in Rust")
    found["pool let go/rust"] = ratio("pool pair, let go", "pool pair in Rust")
    found["cache/cupy"] = ratio("cache pair", "CuPy default MemoryPool pair")
    found["cache let go/cupy"] = ratio("cache pair, let go", "CuPy default MemoryPool pair")
    found["plugin/cupy"] = ratio("CuPy plug-in pair over the cache", "CuPy default MemoryPool pair")
    return found


def pair_table(figures: dict, pairs: dict | None) -> list[str]:
    if not figures:
        return [
            "alloc+free pairs: not measured"
            + (f" ({pairs['failure'].splitlines()[0]})" if pairs and pairs.get("failure") else "")
        ]
    meta = pairs["pairs"]
    lines = [
        f"alloc+free pairs of {meta['size_bytes'] >> 20} MiB, medians of {meta['rounds']} rounds of {meta['pairs_per_round']} pairs"
    ]
    for name in (
        "pool pair",
        "pool pair, let go",
        "pool pair in Rust",
        "cache pair",
        "cache pair, let go",
        "CuPy default MemoryPool pair",
        "CuPy plug-in pair over the cache",
    ):
        if name in figures:
            lines.append(f"  {name:<38}{figures[name] * 1e6:9.3f} us")
    lines.append(
        f"  Python pool pair / Rust loop {fmt(figures['pool/rust'], 1, 3, 0)}x; cache pair / CuPy MemoryPool pair "
        f"{fmt(figures['cache/cupy'], 1, 3, 0)}x; CuPy plug-in pair / MemoryPool pair {fmt(figures['plugin/cupy'], 1, 3, 0)}x"
    )
    lines.append(
        f"  let go instead of closed: pool pair / Rust loop {fmt(figures['pool let go/rust'], 1, 3, 0)}x; "
        f"cache pair / CuPy MemoryPool pair {fmt(figures['cache let go/cupy'], 1, 3, 0)}x"
    )
    if pairs.get("rust_pairs_skipped"):
        lines.append(f"  Rust loop row skipped: {pairs['rust_pairs_skipped']}")
    if pairs.get("cupy_skipped"):
        lines.append(f"  CuPy rows skipped: {pairs['cupy_skipped']}")
    return lines


def targets(summary: dict, figures: dict, alternated: dict | None = None) -> list[dict]:
    """The issue's targets, each a measurement against its limit (value None: not measured)."""
    alternated = alternated or {}

    def get(key, name, field="ratio"):
        return summary.get(key, {}).get(name, {}).get(field)

    found = [
        (
            "routing recipe (as documented) step <= 1.05x cudaMallocAsync",
            get("torch-recipe", "step.median_s", "ratio_vs_async"),
            1.05,
        ),
        (
            "routing recipe, threshold raised, step <= 1.05x cudaMallocAsync",
            get("torch-recipe-threshold", "step.median_s", "ratio_vs_async"),
            1.05,
        ),
        ("plug-in over the pool step <= 1.03x torch native", get("torch-plugin-pool", "step.median_s"), 1.03),
        ("plug-in over the cache step <= 1.03x torch native", get("torch-plugin-cache", "step.median_s"), 1.03),
        ("plug-in over the pool graph replay <= 1.02x native", get("torch-plugin-pool", "graph.median_s"), 1.02),
        ("plug-in over the cache graph replay <= 1.02x native", get("torch-plugin-cache", "graph.median_s"), 1.02),
        ("plug-in over the pool peak reserved <= 1.05x native", get("torch-plugin-pool", "step.peak_reserved"), 1.05),
        ("plug-in over the cache peak reserved <= 1.05x native", get("torch-plugin-cache", "step.peak_reserved"), 1.05),
        (
            "plug-in over the cache, backward too, step <= 1.03x native with backward on the calling thread",
            get("torch-plugin-cache-backward", "step.median_s", "ratio_vs_native_backward"),
            1.03,
        ),
        (
            "plug-in over the cache, backward too, peak reserved <= 1.05x native with backward on the calling thread",
            get("torch-plugin-cache-backward", "step.peak_reserved", "ratio_vs_native_backward"),
            1.05,
        ),
        ("CuPy plug-in over the cache loop <= 0.90x default MemoryPool", get("cupy-plugin-cache", "loop.median_s"), 0.90),
        ("budget: PyTorch step <= 1.03x torch native", get("torch-budget", "step.median_s"), 1.03),
        ("budget: CuPy loop <= 1.0x default MemoryPool", get("cupy-budget", "loop.median_s"), 1.00),
        (
            "budget: CuPy loop, alternated in one process, <= 1.0x",
            alternated.get("cumempool.budget (plug-in)", {}).get("ratio"),
            1.00,
        ),
        (
            "CuPy plug-in over the cache loop, alternated in one process, <= 0.90x",
            alternated.get("plug-in over the cache", {}).get("ratio"),
            0.90,
        ),
        ("Python pool pair <= 1.15x the Rust loop", figures.get("pool/rust"), 1.15),
        ("cache pair <= 0.30x CuPy default MemoryPool pair", figures.get("cache/cupy"), 0.30),
        ("Python pool pair, let go, <= 1.15x the Rust loop", figures.get("pool let go/rust"), 1.15),
        (
            "cache pair, let go as CuPy's pair is, <= 0.30x CuPy default MemoryPool pair",
            figures.get("cache let go/cupy"),
            0.30,
        ),
    ]
    return [
        {"target": name, "value": value, "limit": limit, "pass": None if value is None else value <= limit}
        for name, value, limit in found
    ]


def problems_of(result: dict, round_: int | None, say) -> list[dict]:
    """The child's failures (a workload's error, its set-up's, or its process's), each said in
    full on the progress stream."""
    problems = dict(result.get("errors", {}))
    if result.get("failure"):
        problems["process"] = result["failure"]
    found = []
    for where, text in problems.items():
        found.append({"config": result["config"], "round": round_, "where": where, "error": text})
        when = "" if round_ is None else f" round {round_ + 1}"
        say(f"  {result['config']}{when} failed in {where}:\n{text}")
    return found


def parent_main(args) -> int:
    counts = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 5)
    budget = args.budget or (60.0 if args.quick else 300.0)
    timeout = 120.0 if args.quick else 240.0
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731 (progress, not the report)
    lines, skipped = [], []
    if not args.dry_run and not has_module("cumempool"):
        print("cumempool is not importable: install the wheel or set PYTHONPATH (e.g. PYTHONPATH=.gpu/py)", file=sys.stderr)
        return 2
    configs = []
    for config in CONFIGS:
        if args.only and not any(part in config.key for part in args.only.split(",")):
            continue
        if not args.dry_run and not has_module(config.library):
            skipped.append(f"skipped {config.key}: {config.library} is not installed")
            continue
        configs.append(config)
    for line in skipped:
        say(line)
    if args.dry_run:
        print("DRY RUN: children write made-up figures; no GPU or library is used")
        for config in [*configs, PAIRS, INTERLEAVED]:
            setting = f"{BACKEND_VARIABLE}={config.backend}" if config.backend else f"{BACKEND_VARIABLE} unset"
            print(f"  {config.key:<24} {config.label:<38} {setting}{'  (optional)' if config.optional else ''}")
    started = time.monotonic()
    runs: dict[str, dict[int, dict]] = {}
    failures = []
    pairs = None
    if not args.no_pairs:
        say("alloc+free pairs ...")
        pairs = run_child(PAIRS, args, timeout)
        failures += problems_of(pairs, None, say)
    interleaved = None
    if not args.no_interleaved and any(c.library == "cupy" for c in configs):
        say("the CuPy loop, allocators alternated in one process ...")
        interleaved = run_child(INTERLEAVED, args, timeout)
        failures += problems_of(interleaved, None, say)
    rounds_run, round_seconds = 0, 0.0
    for round_ in range(rounds):
        elapsed = time.monotonic() - started
        if round_ and elapsed + round_seconds > budget:
            say(f"stopping after {round_} rounds: another would end past the {budget:.0f} s budget")
            break
        begun = time.monotonic()
        shift = round_ % max(1, len(configs))
        for config in configs[shift:] + configs[:shift]:
            if any(line.startswith(f"skipped {config.key}:") for line in skipped):
                continue
            say(f"round {round_ + 1}/{rounds}: {config.key} ...")
            result = run_child(config, args, timeout)
            if result.get("skipped"):
                skipped.append(f"skipped {config.key}: {result['skipped']}")
                continue
            runs.setdefault(config.key, {})[round_] = result
            failures += problems_of(result, round_, say)
        round_seconds = time.monotonic() - begun
        rounds_run = round_ + 1
    summary = summarise(runs, configs)
    figures = pair_figures(pairs)
    environment_found = next(
        (r["environment"] for results in runs.values() for r in results.values() if r.get("environment")),
        (pairs or {}).get("environment", {}),
    )
    versions = {}
    for result in [r for results in runs.values() for r in results.values()] + [pairs or {}]:
        for name in ("torch", "cupy"):
            if result.get("environment", {}).get(name):
                versions.setdefault(name, result["environment"][name])
    versions = "".join(f", {name} {version}" for name, version in versions.items())
    lines.append(
        f"workloads on {environment_found.get('device', '?')}, driver {environment_found.get('driver', '?')}, "
        f"python {environment_found.get('python', '?')}{versions}, "
        f"{rounds_run} round{'s' if rounds_run != 1 else ''}{' (quick)' if args.quick else ''}, a fresh process per configuration per round"
    )
    lines += skipped
    if any(c.library == "torch" for c in configs):
        lines += torch_table(summary, configs, runs)
    if any(c.library == "cupy" for c in configs):
        lines += cupy_table(summary, configs)
    alternated = interleaved_figures(interleaved)
    lines += interleaved_table(alternated, interleaved)
    lines += pair_table(figures, pairs)
    found_targets = targets(summary, figures, alternated)
    lines.append("targets (measurements, not tests)")
    for t in found_targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        lines.append(
            f"  {verdict}  {t['target']:<64} {fmt(t['value'], 1, 3, 0) + 'x' if t['value'] is not None else 'not measured'}"
        )
    agreed, mismatches = check_checksums(runs, configs)
    lines.append("checks")
    lines += [f"  {line}" for line in agreed + mismatches]
    hard = [f for f in failures if not BY_KEY[f["config"]].optional]
    for failure in failures:
        when = "" if failure["round"] is None else f" round {failure['round'] + 1}"
        kind = "FAILED" if failure in hard else "FAILED (optional configuration)"
        lines.append(f"  {kind} {failure['config']}{when}, {failure['where']}: {failure['error'].strip().splitlines()[-1]}")
    wall = time.monotonic() - started
    lines.append(f"wall time {wall:.0f} s")
    status = 1 if mismatches or hard else 0
    lines.append("result: " + ("ok" if status == 0 else "FAILED (a mismatch or a configuration that failed; see above)"))
    print("\n".join(lines))
    if args.json_out:
        document = {
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "dry_run": args.dry_run,
            "quick": args.quick,
            "rounds_asked": rounds,
            "rounds_run": rounds_run,
            "budget_s": budget,
            "wall_s": wall,
            "environment": environment_found,
            "counts": asdict(counts),
            "model": {
                "layers": LAYERS,
                "d_model": D_MODEL,
                "nhead": NHEAD,
                "batch": BATCH,
                "seq": SEQ,
                "dropout": 0.0,
                "optimizer": "SGD lr 0.01",
            },
            "cap_bytes": CAP,
            "configs": [
                {**asdict(c), "summary": summary.get(c.key), "runs": {str(r): v for r, v in runs.get(c.key, {}).items()}}
                for c in configs
            ],
            "pairs": pairs,
            "pair_figures": figures,
            "interleaved": interleaved,
            "interleaved_figures": alternated,
            "targets": found_targets,
            "checks": {"agreed": agreed, "mismatches": mismatches},
            "failures": failures,
            "skipped": skipped,
            "status": status,
        }
        with open(args.json_out, "w") as out:
            json.dump(document, out, indent=2)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="one round of few iterations (a smoke run of about a minute)")
    parser.add_argument("--rounds", type=int, help="rounds of every configuration (default 5, --quick 1)")
    parser.add_argument("--budget", type=float, help="seconds after which no new round starts (default 300, --quick 60)")
    parser.add_argument("--json-out", metavar="FILE", help="also write every figure as JSON to FILE")
    parser.add_argument(
        "--only", metavar="KEYS", help="comma-separated parts of configuration keys to run (e.g. torch-native,cupy)"
    )
    parser.add_argument("--no-pairs", action="store_true", help="leave out the alloc+free pair ratios")
    parser.add_argument(
        "--no-interleaved", action="store_true", help="leave out the CuPy loop with its allocators alternated in one process"
    )
    parser.add_argument("--dry-run", action="store_true", help="run the parent/child protocol with made-up figures (no GPU)")
    parser.add_argument("--dry-run-skew", metavar="KEY", help=argparse.SUPPRESS)  # a wrong checksum, for the protocol's test
    parser.add_argument("--child", choices=sorted(BY_KEY), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if not args.result:
            parser.error("--child needs --result FILE")
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
