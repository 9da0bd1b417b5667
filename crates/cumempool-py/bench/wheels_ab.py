"""Two builds of cumempool on one GPU in one call: the alloc+free pair rows and the alternated
CuPy loop of workloads.py, run for each build in turn, `--repeats` times, so that a change is
measured against the build before it on the same machine, minutes apart. Each build is a
directory a wheel was installed into:

    python3 -m pip install --no-index --no-deps --target /tmp/before BEFORE.whl
    python3 -m pip install --no-index --no-deps --target /tmp/after AFTER.whl
    python3 crates/cumempool-py/bench/wheels_ab.py before=/tmp/before after=/tmp/after --repeats 2

Each repeat runs workloads.py's `pairs` and `cupy-interleaved` children once per build, in the
order given; the figures printed pool every repeat's rounds (pairs: medians of all rounds and of
the per-round ratios; the CuPy loop: median per-cycle ratios to the default MemoryPool, with
quartiles). `--dry-run` runs the protocol with workloads.py's made-up figures (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402 (the bench directory, put on the path above)

CHILDREN = {"pairs": "pairs", "cupy-interleaved": "interleaved"}


def run_child(child: str, site: str, dry_run: bool) -> dict:
    """One child of workloads.py with `site` first on the path; its result, or its failure."""
    with tempfile.TemporaryDirectory() as scratch:
        result = pathlib.Path(scratch) / "result.json"
        command = [sys.executable, str(HERE / "workloads.py"), "--child", child, "--result", str(result)]
        if dry_run:
            command.append("--dry-run")
        path = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
        out = subprocess.run(command, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=600)
        if not result.exists():
            return {"errors": {child: f"exit status {out.returncode}: {out.stderr.strip()[-2000:]}"}}
        return json.loads(result.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", metavar="NAME=DIR", help="a name and the directory a wheel was installed into")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    builds = []
    for build in args.builds:
        name, sep, site = build.partition("=")
        if not sep or not name:
            parser.error(f"{build!r} is not NAME=DIR (for example after=/tmp/after)")
        builds.append((name, site))
    seconds = {name: {key: {} for key in CHILDREN.values()} for name, _ in builds}
    block_iterations = {name: 0 for name, _ in builds}
    failed = False
    for repeat in range(args.repeats):
        for name, site in builds:
            for child, key in CHILDREN.items():
                result = run_child(child, site, args.dry_run)
                for where, error in result.get("errors", {}).items():
                    print(f"{name}: {where} failed: {error.splitlines()[-1] if error else ''}")
                    failed = True
                if repeat == 0 and child == "pairs" and "environment" in result:
                    print(f"{name}: {result['environment']}")
                for row, values in result.get(key, {}).get("seconds", {}).items():
                    seconds[name][key].setdefault(row, []).extend(values)
                if key == "interleaved" and key in result:
                    block_iterations[name] = result[key]["block_iterations"]
    for name, _ in builds:
        pairs = seconds[name]["pairs"]
        rounds = len(next(iter(pairs.values()), []))
        pooled = {"pairs": {"seconds": pairs, "size_bytes": 1 << 20, "rounds": rounds, "pairs_per_round": "each child's"}}
        print(f"== {name}, {args.repeats} repeats pooled")
        for line in workloads.pair_table(workloads.pair_figures(pooled), pooled):
            print(line)
        loop = seconds[name]["interleaved"]
        cycles = len(next(iter(loop.values()), []))
        alternated = {"interleaved": {"seconds": loop, "cycles": cycles, "block_iterations": block_iterations[name]}}
        for line in workloads.interleaved_table(workloads.interleaved_figures(alternated), alternated):
            print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
