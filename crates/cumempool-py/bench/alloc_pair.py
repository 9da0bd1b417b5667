"""One 1 MiB alloc+free pair from Python, per allocator, in one run on one device and one
stream kind (a non-blocking stream of device 0): a cumempool pool, the cumempool cache over it,
cuda.core's DeviceMemoryResource, CuPy's MemoryAsyncPool and torch.empty (cudaMallocAsync
backend when PYTORCH_CUDA_ALLOC_CONF asks for it, else PyTorch's caching allocator). Each row is
the median over rounds of the mean time per pair; libraries that are missing are left out.

With --breakdown the same run also times the pieces of a cumempool pair apart: the floor of a
native call, the stream argument's conversion (for each kind of stream present), a GIL release
and reacquire, a Buffer made and closed without a driver call, the alloc alone and the close
alone (in batches), and the same pairs looped in Rust with the GIL released once (the floor the
Python pair stands on).

    python3 crates/cumempool-py/bench/alloc_pair.py [--pairs N] [--rounds R] [--json] [--breakdown]
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


def measure_batched(alloc, pairs: int, rounds: int, batch: int = 64) -> tuple[float, float]:
    """Medians over `rounds` of the mean seconds per `alloc()` and per `close()` of what it
    returned, timed apart in batches of `batch` (all allocated, then all closed)."""
    clock = time.perf_counter
    batches = max(1, pairs // batch)
    allocs, closes = [], []
    for round_ in range(rounds + 1):
        spent_alloc = spent_close = 0.0
        for _ in range(batches):
            start = clock()
            buffers = [alloc() for _ in range(batch)]
            middle = clock()
            for buffer in buffers:
                buffer.close()
            spent_close += clock() - middle
            spent_alloc += middle - start
        if round_:  # the first round warms up
            allocs.append(spent_alloc / (batches * batch))
            closes.append(spent_close / (batches * batch))
    return statistics.median(allocs), statistics.median(closes)


class _Nothing:
    def close(self):
        pass


# Why a row that needs the benchmark hooks is not measured: a wheel built as users build it
# (`pip install ./crates/cumempool-py`) has none.
HOOKS_MISSING = (
    "this cumempool wheel has no benchmark hooks (_native._bench_*): build it with the cargo "
    "feature bench-hooks, e.g. `maturin build --release -m crates/cumempool-py/Cargo.toml "
    "--features bench-hooks` (the GPU pack's wheel, `cargo xtask gpu-pack`, has them)"
)


def bench_hooks_or_none():
    """The native module where it has the benchmark hooks (`_native._bench_*`, only in a wheel
    built with the cargo feature `bench-hooks`), else None."""
    from cumempool import _native as native

    return native if hasattr(native, "_bench_noop") else None


def bench_hooks():
    """The native module, once it is known to have the benchmark hooks; stops the run (with
    `HOOKS_MISSING`) where it has none."""
    native = bench_hooks_or_none()
    if native is None:
        raise SystemExit(HOOKS_MISSING)
    return native


def breakdown_rows(stream, pairs: int, rounds: int, libraries: dict):
    """(piece, microseconds, note) for the pieces of a cumempool pair."""
    native = bench_hooks()

    def timed(call):
        return measure(call, pairs, rounds) * 1e6

    pool = cm.MemPool(cm.Route.device(0))
    cache = cm.CachingResource(cm.PoolResource(pool))
    nothing = _Nothing()
    yield "empty Python lambda", timed(lambda: None), "the loop's own floor"
    yield "empty native call", timed(native._bench_noop), "floor of any method"
    yield "native call with alloc's arguments", timed(lambda: native._bench_args(SIZE, stream)), "no conversion"
    yield "GIL release + reacquire", timed(native._bench_detach), "py.detach(|| ())"
    # The int handle is another stream's: reading a stream's handle marks the stream as one other
    # code may capture, and every cache operation on it then asks the driver (the rows below on
    # `lent` show that cost); `stream` stays as the table measured it.
    lent = cm.Stream(0)
    streams = [("cumempool.Stream", stream), ("None (legacy)", None), ("int handle", lent.handle)]
    for name, make in libraries.get("streams", []):
        streams.append((name, make()))
    for name, obj in streams:
        yield f"stream conversion: {name}", timed(lambda obj=obj: native._bench_stream(obj)), ""
    for name, make in libraries.get("fresh_streams", []):
        yield f"making {name}", timed(make), "the library's own cost"
        yield f"stream conversion: {name}", timed(lambda make=make: native._bench_stream(make())), "includes making it"
    yield "Buffer made + closed, no driver call", timed(lambda: pool.alloc(0, stream).close()), "pool.alloc(0)"
    alloc, close = measure_batched(lambda: nothing, pairs, rounds)
    yield "batch loop floor: alloc / close", alloc * 1e6, f"close {close * 1e6:.3f} us"
    alloc, close = measure_batched(lambda: pool.alloc(SIZE, stream), pairs, rounds)
    yield "pool alloc alone", alloc * 1e6, "batches of 64, loop included"
    yield "pool close alone", close * 1e6, "batches of 64, loop included"
    for _ in range(2):  # the cache keeps blocks for a batch
        measure_batched(lambda: cache.alloc(SIZE, stream), 64, 1)
    before = cache.stats()
    alloc, close = measure_batched(lambda: cache.alloc(SIZE, stream), pairs, rounds)
    after = cache.stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    rate = hits / max(1, hits + misses)
    yield "cache alloc alone", alloc * 1e6, f"batches of 64, loop included; hit rate {rate:.3f}"
    yield "cache close alone", close * 1e6, "batches of 64, loop included"
    yield "pool pair", timed(lambda: pool.alloc(SIZE, stream).close()), "as in the table"
    yield "cache pair", timed(lambda: cache.alloc(SIZE, stream).close()), "as in the table"
    yield "pool pair, let go", timed(lambda: pool.alloc(SIZE, stream)), "the Buffer dropped, not closed"
    yield "cache pair, let go", timed(lambda: cache.alloc(SIZE, stream)), "as CuPy's pair lets go"
    for name, obj in streams[1:]:
        yield f"cache pair on {name}", timed(lambda obj=obj: cache.alloc(SIZE, obj).close()), ""
    rust = native._bench_rust_pairs(pool, SIZE, stream, pairs) / 1e3
    yield "pool pair in Rust", rust, "GIL released once for all pairs"
    rust = native._bench_rust_pairs(cache, SIZE, stream, pairs) / 1e3
    yield "cache pair in Rust", rust, "GIL released once for all pairs"
    yield "cache pair, handle given out", timed(lambda: cache.alloc(SIZE, lent).close()), "a capture question per call"
    rust = native._bench_rust_pairs(cache, SIZE, lent, pairs) / 1e3
    yield "cache pair in Rust, handle given out", rust, "the same, looped in Rust"
    lent.synchronize()
    stream.synchronize()
    yield from cupy_plugin_pieces(cache, timed)


def cupy_plugin_pieces(cache, timed):
    """(piece, microseconds, note) for the steps of the CuPy plug-in's call, on a non-blocking
    CuPy stream made current, beside CuPy's own MemoryPool pair: where CuPy is installed."""
    try:
        import cupy
    except ImportError:
        return
    import cumempool.cupy as cmc

    memory_pool = cupy.cuda.MemoryPool()
    plugin = cmc.Allocator(cache)
    plugin = getattr(plugin, "malloc", plugin)  # as installed (builds before `malloc`: the object)
    with cupy.cuda.Stream(non_blocking=True) as s:
        owner = cache.alloc(SIZE, s)
        yield "CuPy: MemoryPool pair", timed(lambda: memory_pool.malloc(SIZE)), "CuPy's own, the target"
        yield "CuPy: plug-in pair over the cache", timed(lambda: plugin(SIZE)), "as in the table"
        yield "CuPy: runtime.getDevice()", timed(cupy.cuda.runtime.getDevice), "the device check"
        yield "CuPy: get_current_stream()", timed(cupy.cuda.get_current_stream), ""
        yield "CuPy: stream.is_capturing()", timed(s.is_capturing), "a driver query"
        yield "CuPy: cache pair on the CuPy stream", timed(lambda: cache.alloc(SIZE, s).close()), "stream memo included"
        yield "CuPy: owner.ptr + owner.device", timed(lambda: (owner.ptr, owner.device)), ""
        unowned, pointer = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer
        yield (
            "CuPy: MemoryPointer(UnownedMemory(...))",
            timed(lambda: pointer(unowned(owner.ptr, SIZE, owner, 0), 0)),
            "CuPy's objects",
        )
        owner.close()
        s.synchronize()


def library_streams() -> dict:
    """Other libraries' streams on device 0, where the library is installed: objects made once
    (`streams`) and objects made per call (`fresh_streams`)."""
    found = {"streams": [], "fresh_streams": []}
    try:
        import torch

        s = torch.cuda.Stream()
        found["streams"].append(("torch.cuda.Stream", lambda: s))
        found["fresh_streams"].append(("torch.cuda.current_stream()", torch.cuda.current_stream))
    except Exception:  # noqa: BLE001 (missing or unusable: left out)
        pass
    try:
        import cupy

        c = cupy.cuda.Stream(non_blocking=True)
        found["streams"].append(("cupy.cuda.Stream", lambda: c))
    except Exception:  # noqa: BLE001
        pass
    try:
        try:
            from cuda.core import Device
        except ImportError:
            from cuda.core.experimental import Device
        d = Device(0)
        d.set_current()
        k = d.create_stream()
        found["streams"].append(("cuda.core Stream", lambda: k))
    except Exception:  # noqa: BLE001
        pass
    return found


def cumempool_rows(stream):
    pool = cm.MemPool(cm.Route.device(0))
    yield "cumempool pool", lambda: pool.alloc(SIZE, stream).close()
    cache = cm.CachingResource(cm.PoolResource(pool))
    yield "cumempool cache", lambda: cache.alloc(SIZE, stream).close()
    # Let go of instead of closed, as the CuPy and PyTorch rows let go of what they allocate.
    yield "cumempool cache, let go", lambda: cache.alloc(SIZE, stream)


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
    parser.add_argument("--breakdown", action="store_true", help="also time the pieces of a cumempool pair")
    args = parser.parse_args()
    if args.breakdown:
        bench_hooks()  # refused before any row is measured, not after

    stream = cm.Stream(0)
    rows = []
    for name, pair in [*cumempool_rows(stream), *cuda_core_rows(), *cupy_rows(), *torch_rows()]:
        rows.append({"allocator": name, "us_per_pair": measure(pair, args.pairs, args.rounds) * 1e6})
    stream.synchronize()
    pieces = []
    if args.breakdown:
        for piece, us, note in breakdown_rows(stream, args.pairs, args.rounds, library_streams()):
            pieces.append({"piece": piece, "us": us, "note": note})
    report = {
        "size_bytes": SIZE,
        "pairs_per_round": args.pairs,
        "rounds": args.rounds,
        "driver": ".".join(map(str, cm.driver_version())),
        "device": cm.Device(0).name,
        "python": sys.version.split()[0],
        "rows": rows,
    }
    if args.breakdown:
        report["breakdown"] = pieces
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"1 MiB alloc+free pairs, {report['device']}, driver {report['driver']}, median of {args.rounds} rounds")
        for row in rows:
            print(f"  {row['allocator']:<32} {row['us_per_pair']:8.3f} us")
        if pieces:
            print("where a cumempool pair's time goes (medians, us per call)")
            for piece in pieces:
                print(f"  {piece['piece']:<52} {piece['us']:8.3f}  {piece['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
