"""What works without a GPU: routes, locations, the exception hierarchy, argument checks and
the driver's absence reported as a typed error."""

import pathlib
import re
import subprocess
import sys

import pytest

import cumempool as cm


def test_routes_compare_hash_and_print_like_the_rust_ones():
    assert cm.Route.device(0) == cm.Route(cm.Location.device(0))
    assert hash(cm.Route.host()) == hash(cm.Route(cm.Location.host(), cm.AllocationType.PINNED))
    assert cm.Route.managed().location == cm.Location.unspecified()
    assert cm.Route.managed().allocation_type == cm.AllocationType.MANAGED
    assert str(cm.Route.device(1)) == "(device 1, pinned)"
    assert cm.Route.host().is_host_accessible and not cm.Route.device(0).is_host_accessible
    assert len({cm.Route.device(0), cm.Route.device(0), cm.Route.host_numa(0)}) == 2


def test_routes_locations_and_allocation_types_pickle_and_copy_as_values():
    import copy
    import pickle

    values = [
        cm.Route.device(1),
        cm.Route.host(),
        cm.Route.host_numa(3),
        cm.Route.managed(),
        cm.Route.managed(cm.Location.device(0)),
        cm.Location.host_numa_current(),
        cm.Location.unspecified(),
        cm.AllocationType.MANAGED,
        cm.AllocationType.PINNED,
    ]
    for value in values:
        again = pickle.loads(pickle.dumps(value))
        assert again == value and type(again) is type(value), value
        assert copy.deepcopy(value) == value


def test_a_route_that_cannot_exist_is_refused_when_made():
    with pytest.raises(cm.InvalidRouteError, match="managed memory only") as caught:
        cm.Route(cm.Location.unspecified(), cm.AllocationType.PINNED)
    assert isinstance(caught.value, ValueError)


def test_wrong_types_and_sizes_raise_type_and_overflow_errors():
    with pytest.raises(TypeError):
        cm.Route.device("0")
    with pytest.raises(TypeError):
        cm.MemPool("device 0")
    with pytest.raises(OverflowError):
        cm.Route.locality_domain(0, 256)
    with pytest.raises(OverflowError):
        cm.Route.device(1 << 40)


def test_the_hierarchy_mirrors_the_rust_errors():
    assert issubclass(cm.OutOfMemoryError, MemoryError)
    assert issubclass(cm.LimitExceededError, cm.OutOfMemoryError)
    assert issubclass(cm.ClosedError, ValueError)
    assert issubclass(cm.CumempoolOSError, OSError)
    for name in ("DriverTooOldError", "RouteRefusedError", "SharingRefusedError", "LoadError", "DriverError"):
        assert issubclass(getattr(cm, name), cm.CumempoolError)


def test_without_a_driver_every_driver_call_raises_load_error():
    if cm.has_driver():
        pytest.skip("a driver is present")
    with pytest.raises(cm.LoadError, match="libcuda"):
        cm.MemPool(cm.Route.device(0))
    with pytest.raises(cm.LoadError):
        cm.Stream(0)


def test_the_package_imports_without_torch_cupy_or_cuda_core():
    code = (
        "import sys, cumempool, cumempool.torch, cumempool.cupy, cumempool.cuda_core; "
        "print(any(m in sys.modules for m in ('torch', 'cupy', 'cuda.core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_native_library_exports_the_torch_functions():
    import ctypes

    library = ctypes.CDLL(cm.native_library_path())
    assert library.cumempool_torch_alloc and library.cumempool_torch_free
    library.cumempool_torch_alloc.restype = ctypes.c_void_p
    library.cumempool_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    # Nothing served: PyTorch's out-of-memory answer (null), never a crash.
    assert library.cumempool_torch_alloc(1 << 20, 0, None) is None


class _StandInTorch:
    """The two PyTorch context managers `cumempool.torch.use_mem_pool` composes, recording what
    they saw: `set_multithreading_enabled`, as PyTorch's, sets its thread's flag when made and
    puts it back on exit; `use_mem_pool` raises on entry for the pool named "refused"."""

    def __init__(self, monkeypatch):
        import contextlib
        import types

        self.seen = []
        seen = self.seen

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            if pool == "refused":
                raise RuntimeError("beginAllocateToPool: already recording to this pool")
            seen.append(("pool", pool, device))
            try:
                yield
            finally:
                seen.append(("pool done",))

        class set_multithreading_enabled:
            def __init__(self, mode):
                seen.append(("multithreading", mode))

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                seen.append(("multithreading done",))

        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(use_mem_pool=use_mem_pool)
        grad_mode = types.ModuleType("torch.autograd.grad_mode")
        grad_mode.set_multithreading_enabled = set_multithreading_enabled
        autograd = types.ModuleType("torch.autograd")
        autograd.grad_mode = grad_mode
        for name, module in (("torch", torch), ("torch.autograd", autograd), ("torch.autograd.grad_mode", grad_mode)):
            monkeypatch.setitem(sys.modules, name, module)


def test_torch_use_mem_pool_enters_pytorchs_scope_with_backward_on_the_calling_thread(monkeypatch):
    import cumempool.torch as cmt

    torch = _StandInTorch(monkeypatch)
    with cmt.use_mem_pool("a pool", 1):
        assert torch.seen == [("pool", "a pool", 1), ("multithreading", False)]
    assert torch.seen[2:] == [("multithreading done",), ("pool done",)]


def test_torch_use_mem_pool_puts_both_back_when_its_block_raises(monkeypatch):
    import cumempool.torch as cmt

    torch = _StandInTorch(monkeypatch)
    with pytest.raises(KeyError, match="from the block"), cmt.use_mem_pool("a pool"):
        raise KeyError("from the block")
    assert torch.seen == [("pool", "a pool", None), ("multithreading", False), ("multithreading done",), ("pool done",)]


def test_torch_use_mem_pool_refused_by_pytorch_leaves_multithreading_alone(monkeypatch):
    # PyTorch's switch changes its thread's flag when made: made before PyTorch's scope refused
    # the pool, it would have left the backward pass on the calling thread for good.
    import cumempool.torch as cmt

    torch = _StandInTorch(monkeypatch)
    with pytest.raises(RuntimeError, match="already recording"), cmt.use_mem_pool("refused"):
        pass
    assert torch.seen == []


ROOT = pathlib.Path(__file__).resolve().parents[3]
CORE_ERRORS = ROOT / "crates" / "cumempool" / "src" / "error.rs"
BINDING_ERRORS = ROOT / "crates" / "cumempool-py" / "src" / "errors.rs"


def _variants(source: str, enum: str) -> list[str]:
    body = source.split(f"pub enum {enum} {{", 1)[1]
    depth, end = 1, 0
    while end < len(body):
        depth += {"{": 1, "}": -1}.get(body[end], 0)
        if depth == 0:
            break
        end += 1
    body = re.sub(r"#\[error\((?:[^()]|\([^()]*\))*\)\]", "", body[:end])
    return re.findall(r"^    ([A-Z][A-Za-z]+)\b", body, flags=re.MULTILINE)


def test_every_core_error_variant_has_its_own_python_class():
    # A variant left to the catch-all raises a bare CumempoolError no `except` can tell apart
    # (a pool.alloc on a stream torch or CuPy is capturing, say).
    if not (CORE_ERRORS.is_file() and BINDING_ERRORS.is_file()):
        pytest.skip("needs the Rust sources (a source checkout)")
    variants = _variants(CORE_ERRORS.read_text(), "Error")
    assert "OutOfMemory" in variants and "Driver" in variants
    mapping = BINDING_ERRORS.read_text().split("fn core_class", 1)[1].split("fn alloc_class", 1)[0]
    unmapped = [v for v in variants if not re.search(rf"E::{v}\b", mapping)]
    assert unmapped == [], f"cumempool::Error variants without a Python class: {unmapped}"


def test_capture_errors_have_their_classes():
    assert issubclass(cm.StreamCapturingError, cm.CumempoolError)
    assert issubclass(cm.CaptureRefusedError, cm.CumempoolError)
    assert "StreamCapturingError" in cm.errors.__all__ and "CaptureRefusedError" in cm.errors.__all__
