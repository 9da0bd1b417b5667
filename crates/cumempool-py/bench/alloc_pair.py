"""One 1 MiB alloc+free pair from Python, per allocator, in one run on one device and one
stream kind (a non-blocking stream of device 0): a cumempool pool, the cumempool cache over it,
cuda.core's DeviceMemoryResource, CuPy's MemoryAsyncPool and torch.empty (cudaMallocAsync
backend when PYTORCH_CUDA_ALLOC_CONF asks for it, else PyTorch's caching allocator). Each row is
the median over rounds of the mean time per pair; libraries that are missing are left out.

    python3 crates/cumempool-py/bench/alloc_pair.py [--pairs N] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import cumempool as cm

SIZE = 1 << 20


def measure(pair, pairs: int, rounds: int) -> float:
    """The median over `rounds` of the mean seconds per call of `pair`."""
    for _ in range(min(pairs, 1000)):
        pair()
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(pairs):
            pair()
        results.append((time.perf_counter() - start) / pairs)
    return statistics.median(results)


def cumempool_rows(stream):
    pool = cm.MemPool(cm.Route.device(0))
    yield "cumempool pool", lambda: pool.alloc(SIZE, stream).close()
    cache = cm.CachingResource(cm.PoolResource(pool))
    yield "cumempool cache", lambda: cache.alloc(SIZE, stream).close()


def cuda_core_rows():
    try:
        from cuda.core import Device, DeviceMemoryResource
    except ImportError:
        try:
            from cuda.core.experimental import Device, DeviceMemoryResource
        except ImportError:
            return
    device = Device(0)
    device.set_current()
    s = device.create_stream()
    mr = DeviceMemoryResource(0)
    yield "cuda.core DeviceMemoryResource", lambda: mr.allocate(SIZE, stream=s).close(s)


def cupy_rows():
    try:
        import cupy
    except ImportError:
        return
    pool = cupy.cuda.MemoryAsyncPool()
    s = cupy.cuda.Stream(non_blocking=True)
    s.use()

    def pair():
        pool.malloc(SIZE)  # freed on the current stream when the pointer is dropped

    yield "CuPy MemoryAsyncPool", pair


def torch_rows():
    try:
        import torch
    except ImportError:
        return
    s = torch.cuda.Stream()
    torch.cuda.set_stream(s)
    yield "torch.empty + del", lambda: torch.empty(SIZE, dtype=torch.uint8, device="cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20000, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds; the median is reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    stream = cm.Stream(0)
    rows = []
    for name, pair in [*cumempool_rows(stream), *cuda_core_rows(), *cupy_rows(), *torch_rows()]:
        rows.append({"allocator": name, "us_per_pair": measure(pair, args.pairs, args.rounds) * 1e6})
    stream.synchronize()
    report = {
        "size_bytes": SIZE,
        "pairs_per_round": args.pairs,
        "rounds": args.rounds,
        "driver": ".".join(map(str, cm.driver_version())),
        "device": cm.Device(0).name,
        "python": sys.version.split()[0],
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"1 MiB alloc+free pairs, {report['device']}, driver {report['driver']}, median of {args.rounds} rounds")
        for row in rows:
            print(f"  {row['allocator']:<32} {row['us_per_pair']:8.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
