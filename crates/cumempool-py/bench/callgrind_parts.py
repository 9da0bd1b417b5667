"""Where a Python call's instructions go, by part, from two callgrind runs of one script that
differ only in how many calls they make (``cache_pair_on_stand_in.py --pairs 10000`` and
``--pairs 30000``, say): the difference of each function's own instructions, divided by the
difference in calls, summed into cumempool's code, PyO3's call machinery, Python's object
allocation and collection, the interpreter, thread-local lookups and the C library.

    python3 crates/cumempool-py/bench/callgrind_parts.py /tmp/pair10000.out 10000 /tmp/pair30000.out 30000

Needs ``callgrind_annotate`` (valgrind) on PATH. Counts are this host's instructions, not a GPU's
times.
"""

import argparse
import re
import subprocess

# The first part whose pattern a function's name (with its file and object) matches.
PARTS = [
    ("thread-local lookups (__tls_get_addr)", r"tls_get_addr"),
    ("PyO3's call machinery", r"pyo3::"),
    ("cumempool", r"cumempool"),
    ("Python's objects (allocation, freeing, GC)", r"obmalloc|typeobject\.c|gcmodule|pycore_object|Objects/object\.c"),
    ("Python's interpreter and other objects", r"Python-3|libpython"),
    ("the C library", r"libc\.so|libc-"),
]
LINE = re.compile(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(.*)")


def own_counts(path: str) -> dict[str, int]:
    """Each function's own instructions in a callgrind output file."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", path],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    counts = {}
    for line in text.splitlines():
        match = LINE.match(line)
        if match and "PROGRAM TOTALS" not in match.group(2) and not match.group(2).startswith("file:"):
            counts[match.group(2).strip()] = int(match.group(1).replace(",", ""))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fewer", help="callgrind output of the run with fewer calls")
    parser.add_argument("fewer_calls", type=int)
    parser.add_argument("more", help="callgrind output of the run with more calls")
    parser.add_argument("more_calls", type=int)
    parser.add_argument("--top", type=int, default=12, help="also list this many functions, most first")
    args = parser.parse_args()
    fewer, more = own_counts(args.fewer), own_counts(args.more)
    calls = args.more_calls - args.fewer_calls
    if calls <= 0:
        parser.error("the second run must make more calls than the first")
    per_call = {name: (more.get(name, 0) - fewer.get(name, 0)) / calls for name in fewer.keys() | more.keys()}
    parts = dict.fromkeys([name for name, _ in PARTS] + ["other"], 0.0)
    for name, count in per_call.items():
        part = next((part for part, pattern in PARTS if re.search(pattern, name)), "other")
        parts[part] += count
    print(f"instructions per call ({calls} calls apart)")
    for part, count in parts.items():
        print(f"  {count:8.0f}  {part}")
    print(f"  {sum(parts.values()):8.0f}  in all")
    print("functions, most first")
    for name, count in sorted(per_call.items(), key=lambda item: -item[1])[: args.top]:
        print(f"  {count:8.0f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
