"""Where the CuPy loop of temporaries spends its time, allocator by allocator (needs a GPU, CuPy
and cumempool importable).

The loop is workloads.py's: ``y = ((x * 2 + 1) ** 2 - x) / (x + 1)`` and its sum over 1M float32.
Each allocator runs it twice: plain (the loop's time per iteration, and its ratio to CuPy's
default ``MemoryPool``), and with every allocator call timed (the calls per iteration and the
time inside them; frees happen when CuPy lets go of an array and are not inside that figure).
"Python lambda over MemoryPool" is CuPy's pool behind one Python frame, which shows what a frame
per allocation costs the loop.

    PYTHONPATH=.gpu/py python3 crates/cumempool-py/bench/cupy_loop_breakdown.py [--repeats 2]
"""

import argparse
import os
import statistics
import sys
import time

import cupy

import cumempool as cm
import cumempool.cupy as cmc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import loop_block  # noqa: E402 (beside this script)

ELEMENTS = 1 << 20


def run(allocate, iterations: int, rounds: int) -> tuple[float, float, float]:
    """Median seconds per iteration plain; allocator calls and seconds inside them per
    iteration, timed."""
    calls = [0, 0.0]

    def timed(size):
        start = time.perf_counter()
        pointer = allocate(size)
        calls[1] += time.perf_counter() - start
        calls[0] += 1
        return pointer

    medians = []
    for through in (allocate, timed):
        with cupy.cuda.using_allocator(through):
            x = cupy.arange(ELEMENTS, dtype=cupy.float32) / ELEMENTS
            total = cupy.zeros((), dtype=cupy.float64)
            stream = cupy.cuda.get_current_stream()
            per_round = []
            for r in range(rounds + 1):  # the first warms up
                calls[0], calls[1] = 0, 0.0
                seconds = loop_block(cupy, x, total, iterations, stream)
                if r:
                    per_round.append((seconds, calls[0] / iterations, calls[1] / iterations))
            del x, total
        medians.append(per_round)
    plain = statistics.median(p[0] for p in medians[0])
    return plain, medians[1][0][1], statistics.median(p[2] for p in medians[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="times the whole table is measured")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    pool = cm.MemPool(cm.Route.device(0))
    memory_pool = cupy.cuda.MemoryPool()
    allocators = [
        ("CuPy MemoryPool", memory_pool.malloc),
        ("Python lambda over MemoryPool", lambda size: memory_pool.malloc(size)),
        ("plug-in over the cache", cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))),
        ("plug-in over the pool", cmc.Allocator(pool)),
        ("CuPy MemoryAsyncPool", cupy.cuda.MemoryAsyncPool().malloc),
    ]
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"CuPy loop, {name}, driver {cm.driver_version()}, medians of {args.rounds} rounds of {args.iterations}")
    for _ in range(args.repeats):
        base = None
        for label, allocate in allocators:
            plain, calls, inside = run(allocate, args.iterations, args.rounds)
            base = base or plain
            print(
                f"  {label:32s} {plain * 1e6:8.2f} us/iter  {plain / base:6.3f}x  {calls:4.1f} allocations  {inside * 1e6:6.2f} us inside them"
            )


if __name__ == "__main__":
    main()
