"""A cache pair from Python without a GPU, for counting its instructions: ``cache.alloc(size,
stream)`` and ``close()`` of the returned ``Buffer`` on a ``cumempool.Stream``, ``--pairs`` times,
against the stand-in driver (tests/src/stand_in_driver.c). Run it twice under callgrind and take
the difference as the per-pair count (the setup cancels out); the wall time it prints is this
host's, not a GPU's:

    cc -O2 -shared -fPIC -pthread -o /tmp/libstandin.so tests/src/stand_in_driver.c tests/src/stand_in_nccl.c
    for n in 10000 30000; do PYTHONHASHSEED=0 CUMEMPOOL_LIBCUDA=/tmp/libstandin.so valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/pair$n.out python3 crates/cumempool-py/bench/cache_pair_on_stand_in.py --pairs $n; done
"""

import argparse
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument(
        "--free-by-drop",
        action="store_true",
        help="let go of each Buffer instead of calling close() (as CuPy's pair lets go of its pointer)",
    )
    args = parser.parse_args()
    import cumempool as cm

    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    stream = cm.Stream(0)
    for _ in range(100):  # the pool's block, then the cache's
        cache.alloc(args.size, stream).close()
    alloc, size = cache.alloc, args.size
    start = time.perf_counter()
    if args.free_by_drop:
        for _ in range(args.pairs):
            alloc(size, stream)
    else:
        for _ in range(args.pairs):
            buffer = alloc(size, stream)
            buffer.close()
    spent = time.perf_counter() - start
    print(f"{args.pairs} cache pairs: {spent / args.pairs * 1e9:.0f} ns each on this host (stand-in driver)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
