"""Shared fixtures: GPU tests skip without a driver, and fail instead with
CUMEMPOOL_REQUIRE_GPU=1 (as the Rust suite does); tests that change routing restore it."""

import ctypes
import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import cumempool as cm

# Routing is process-wide: tests that change it run one at a time.
ROUTING_LOCK = threading.Lock()


def _driver_error():
    try:
        cm.init()
        if cm.Device.count() == 0:
            return "the driver sees no device"
    except cm.CumempoolError as error:
        return str(error)
    return None


@pytest.fixture(scope="session")
def gpu():
    """Device 0, or a skip (a failure with CUMEMPOOL_REQUIRE_GPU=1) without a GPU."""
    error = _driver_error()
    if error is not None:
        if os.environ.get("CUMEMPOOL_REQUIRE_GPU") == "1":
            pytest.fail(f"CUMEMPOOL_REQUIRE_GPU=1 but no GPU can be used: {error}")
        pytest.skip(f"requires a CUDA GPU: {error}")
    return cm.Device(0)


@pytest.fixture
def stream(gpu):
    return cm.Stream(gpu.ordinal)


@pytest.fixture
def routing(gpu):
    """Serialises tests that change a route, and resets device 0's and the host's routes."""
    with ROUTING_LOCK:
        yield
        for route in (cm.Route.device(0), cm.Route.host()):
            cm.reset_current_pool(route)


def library(name):
    """The library `name`, or a skip (a failure with CUMEMPOOL_REQUIRE_GPU=1 only for a GPU
    host that should have it: there the libraries are installed)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        if os.environ.get("CUMEMPOOL_REQUIRE_GPU") == "1" and os.environ.get("CUMEMPOOL_REQUIRE_LIBRARIES") == "1":
            pytest.fail(f"{name} is required here: {error}")
        pytest.skip(f"{name} is not installed: {error}")


def libcuda():
    """The driver library itself, through ctypes, or a skip where it cannot be loaded."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        pytest.skip(f"no libcuda: {error}")


def run_in_new_process(code: str, args: list[str] = ()) -> str:
    """Runs `code` in a new Python process (`sys.argv[1:]` being `args`); its stdout, stripped,
    after asserting it exited 0."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# The one stand-in libcuda (and libnccl) of the Rust tests, which the host tests run on too.
STAND_IN = pathlib.Path(__file__).resolve().parents[3] / "tests" / "src"


@pytest.fixture(scope="session")
def stand_in_libcuda(tmp_path_factory):
    """The stand-in driver (tests/src/stand_in_driver.c, documented in stand_in_driver.rs),
    compiled once per session; its path, for `CUMEMPOOL_LIBCUDA`. Its state is per process, so
    each scenario runs in a process of its own (`run_on_driver`)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    sources = [STAND_IN / "stand_in_driver.c", STAND_IN / "stand_in_nccl.c"]
    if compiler is None or not all(source.exists() for source in sources):
        pytest.skip("no C compiler, or no stand-in driver source beside these tests")
    library = tmp_path_factory.mktemp("stand_in") / "libstandin.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-pthread", "-o", str(library), *map(str, sources)], check=True)
    return str(library)


def run_on_driver(library: str, code: str) -> list:
    """Runs `code` (dedented) in a new Python process whose driver is `library` (a stand-in
    libcuda); its stdout words, after asserting it exited 0."""
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=library)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()
