"""``python -m cumempool``: run a program on one budget.

    python -m cumempool run --budget 8GiB [--device N=SIZE ...] [--report] -- script.py args...
    python -m cumempool plot SNAPSHOT -o usage.svg
    python -m cumempool run --budget 8GiB -- -m package.module args...
    torchrun --nproc-per-node 2 -m cumempool run --budget 8GiB -- train.py

The program runs unmodified in this process, with every CUDA library it imports (PyTorch, CuPy,
Numba, cuda.core) drawing from one pool per device capped at the budget
(:func:`cumempool.budget`). Under ``torchrun`` each rank gets its own budget on its own device
(``LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import builtins
import io
import os
import runpy
import sys
import types

from . import _budget
from .errors import CumempoolError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cumempool", description="Run a program on one CUDA memory budget.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a Python program with every CUDA library drawing from one capped pool per device",
        description="Run a Python program with every CUDA library it imports drawing from one capped pool per device.",
    )
    run.add_argument("--budget", help="the limit of each device, such as 8GiB or 512MiB")
    run.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="N=SIZE",
        help="the limit of device N (repeatable): in place of --budget's on a device it covers, beside it on another; without --budget, only the devices named have a budget",
    )
    run.add_argument("--report", action="store_true", help="print who held what under the budget when the program ends")
    run.add_argument("program", nargs=argparse.REMAINDER, help="-- script.py args..., or -- -m module args...")
    plot = commands.add_parser(
        "plot",
        help="draw bytes in use per library over time from a snapshot (cumempool.dump_snapshot)",
        description="Draw bytes in use per library over time from a snapshot, with each device's budget marked.",
    )
    plot.add_argument("snapshot", help="a snapshot written by cumempool.dump_snapshot")
    plot.add_argument("-o", "--output", required=True, help="usage.svg, usage.html, or usage.png (needs matplotlib)")
    return parser


def _devices(pairs: list[str], total: str | None) -> dict[int, int | str] | None:
    if not pairs:
        return None
    devices: dict[int, int | str] = {}
    for pair in pairs:
        ordinal, _, size = pair.partition("=")
        try:
            number = int(ordinal, 10)
        except ValueError:
            number = -1
        if number < 0 or not size:
            raise SystemExit(f"--device takes N=SIZE, such as --device 0=8GiB; got {pair!r}")
        if number in devices:
            raise SystemExit(f"--device {number} is given twice: give each device once")
        devices[number] = size
    return devices


def _plot_command(snapshot: str, output: str) -> int:
    from . import _history, _plot

    try:
        _plot.write(_history.load_snapshot(snapshot), output)
    except (OSError, ValueError, ImportError) as error:
        raise SystemExit(f"python -m cumempool plot: {error}") from None
    print(f"wrote {output}")
    return 0


def run_program(program: list[str]) -> int:
    """Runs `program` (`script.py args...` or `-m module args...`) in this process as `python`
    would: `__main__`, an absolute `__file__`, `sys.argv`, and the script's real folder first on
    the path (unless `-P` / PYTHONSAFEPATH asks for none). Its `SystemExit` passes through."""
    if program[0] == "-m":
        if len(program) < 2:
            raise SystemExit("-m needs a module name: -- -m package.module args...")
        sys.argv = program[1:]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        return 0
    path = program[0]
    if not os.path.exists(path):
        # As `python missing.py` says it, with its exit status.
        print(
            f"python -m cumempool run: can't open file {os.path.abspath(path)!r}: [Errno 2] No such file or directory",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.argv = list(program)
    if not getattr(sys.flags, "safe_path", False):  # -P, Python 3.11 and newer
        sys.path[0] = os.path.dirname(os.path.realpath(path))
    if not os.path.isfile(path):
        runpy.run_path(path, run_name="__main__")  # a folder or a zip with __main__.py
        return 0
    absolute = os.path.abspath(path)
    with io.open_code(absolute) as file:
        code = compile(file.read(), absolute, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__file__ = absolute
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
    return 0


def _report_safely() -> str:
    """The budget's report, or why there is none: never an error that would hide the program's."""
    try:
        return _budget.report()
    except Exception as error:
        return f"(cumempool could not make the budget's report: {error})"


def _is_out_of_memory(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is an out-of-memory
    error: PyTorch's, CuPy's, Numba's and cumempool's classes by name, cuda.core's `CUDAError`
    (and any driver error) by the driver's name in its message."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if type(found).__name__.endswith("OutOfMemoryError"):
            return True
        try:
            if "CUDA_ERROR_OUT_OF_MEMORY" in str(found):
                return True
        except Exception:
            pass  # an error whose message cannot be made
        found = found.__cause__ or found.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        return _plot_command(args.snapshot, args.output)
    program = list(args.program)
    if program[:1] == ["--"]:
        program = program[1:]
    if not program:
        raise SystemExit("name the program to run: python -m cumempool run --budget 8GiB -- script.py args...")
    if args.budget is None and not args.device:
        raise SystemExit("give the budget: --budget 8GiB, or --device N=SIZE for each device")
    try:
        _budget.budget(args.budget, devices=_devices(args.device, args.budget))
    except (ValueError, TypeError, OverflowError, CumempoolError) as error:
        raise SystemExit(f"python -m cumempool run: {error}") from None
    try:
        run_program(program)
    except BaseException as error:
        # A program that dies of an out-of-memory error (PyTorch's, CuPy's, Numba's) says who
        # held what under the budget: PyTorch's own error cannot carry the report.
        if _is_out_of_memory(error):
            report = _report_safely()
            try:
                error.report = report  # type: ignore[attr-defined]
            except AttributeError:
                pass
            print(report, file=sys.stderr)
        raise
    finally:
        if args.report:
            print(_report_safely(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
