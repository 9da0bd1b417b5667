"""What a Python user sees without reading the Rust: the version, real enums, class names,
signatures, reprs, and plug-ins that say what they need. Host tests, except those taking `gpu`."""

import enum
import importlib.metadata
import inspect
import pickle
import sys
import textwrap
import types

import pytest

import cumempool as cm
import cumempool.cuda_core as cmcc
from conftest import library, run_in_new_process


def test_the_version_is_the_package_metadata():
    assert cm.__version__ == importlib.metadata.version("cumempool")


def test_allocation_type_and_access_are_enums_that_iterate_and_pickle():
    for cls, names in ((cm.AllocationType, ["PINNED", "MANAGED"]), (cm.Access, ["NONE", "READ", "READ_WRITE"])):
        assert issubclass(cls, enum.Enum)
        assert [m.name for m in cls] == names
        for member in cls:
            assert pickle.loads(pickle.dumps(member)) is member
            assert cls[member.name] is member


def test_handle_types_combine_and_stay_handle_types():
    both = cm.HandleTypes.POSIX_FILE_DESCRIPTOR | cm.HandleTypes.FABRIC
    assert isinstance(both, cm.HandleTypes) and issubclass(cm.HandleTypes, enum.IntFlag)
    assert cm.HandleTypes.POSIX_FILE_DESCRIPTOR in both
    assert int(cm.HandleTypes.NONE) == 0
    assert pickle.loads(pickle.dumps(both)) == both


def test_routes_take_and_return_allocation_type_members():
    route = cm.Route(cm.Location.host(), cm.AllocationType.PINNED)
    assert route.allocation_type is cm.AllocationType.PINNED
    assert cm.Route.managed().allocation_type is cm.AllocationType.MANAGED
    assert cm.Route(cm.Location.host()) == route
    with pytest.raises(TypeError, match="AllocationType.PINNED"):
        cm.Route(cm.Location.host(), 1)


def test_classes_have_their_python_names():
    for cls in (cm.PoolResource, cm.CachingResource, cm.Statistics, cm.Limit, cm.Route, cm.MemPool):
        assert cls.__name__ == getattr(cm, cls.__name__).__name__
    assert cm.PoolResource.__name__ == "PoolResource"
    assert issubclass(cm.PoolResource, cm.Resource)


def test_route_signature_shows_its_real_default():
    signature = inspect.signature(cm.Route)
    assert str(signature) == "(location, allocation_type=None)"


@pytest.mark.parametrize(
    "value",
    [
        cm.Location.device(3),
        cm.Location.host(),
        cm.Location.host_numa(1),
        cm.Location.host_numa_current(),
        cm.Location.unspecified(),
        cm.Route.device(0),
        cm.Route.host_numa(2),
        cm.Route.managed(cm.Location.device(1)),
    ],
)
def test_reprs_are_python_that_makes_the_value_again(value):
    assert eval(repr(value), vars(cm)) == value


def test_route_repr_reads_as_its_constructor():
    assert repr(cm.Route.device(0)) == "Route(Location.device(0), AllocationType.PINNED)"


def test_cuda_core_memory_resource_is_a_class_isinstance_works_without_cuda_core(monkeypatch):
    monkeypatch.setattr(cmcc, "_class", None)
    # cuda.core cannot be imported (also where another test imported it already).
    for name in ("cuda", "cuda.core", "cuda.core.experimental"):
        monkeypatch.setitem(sys.modules, name, None)
    assert isinstance(cmcc.MemoryResource, type)
    assert not isinstance(object(), cmcc.MemoryResource)
    with pytest.raises(ImportError, match="cuda-core"):
        cmcc.MemoryResource(None)


def test_cuda_core_memory_resource_instances_are_of_the_cuda_core_subclass(monkeypatch):
    class FakeMemoryResource:  # cuda.core's abstract base, as far as the plug-in needs it
        pass

    core = types.ModuleType("cuda.core")
    core.MemoryResource = FakeMemoryResource
    cuda = types.ModuleType("cuda")
    cuda.core = core
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.core", core)
    monkeypatch.setattr(cmcc, "_class", None)

    class FakeResource:  # a cumempool Resource, as far as construction needs it
        pass

    resource = cmcc.MemoryResource(FakeResource())
    assert isinstance(resource, cmcc.MemoryResource)
    assert isinstance(resource, FakeMemoryResource)
    assert issubclass(type(resource), cmcc.MemoryResource)
    assert not isinstance(FakeMemoryResource(), cmcc.MemoryResource)


def test_the_numba_plug_in_imports_without_numba_and_names_what_is_missing(monkeypatch):
    import cumempool.numba as cmn

    monkeypatch.setitem(sys.modules, "numba", None)
    with pytest.raises(ImportError, match="numba-cuda"):
        cmn.use(None)


def test_resources_print_their_stack(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    stack = cm.CachingResource(cm.Limit(cm.PoolResource(pool), 1 << 20), max_cached=4096)
    assert repr(stack) == f"CachingResource(Limit(PoolResource({pool!r}), 1048576), max_cached=4096)"
    assert repr(pool).startswith(
        "<cumempool.MemPool handle=0x"
    ) and "route=Route(Location.device(0), AllocationType.PINNED) owned=True>" in repr(pool)
    assert repr(cm.Stream(0)).startswith("<cumempool.Stream handle=0x") and repr(cm.Stream(0)).endswith("device=0 owned=True>")


def test_pool_access_takes_and_returns_access_members(gpu):
    pool = cm.MemPool(cm.Route.device(0))
    assert pool.access(gpu) is cm.Access.READ_WRITE
    pool.set_access(gpu, cm.Access.READ_WRITE)
    with pytest.raises(TypeError, match="cumempool.Access"):
        pool.set_access(gpu, 3)


def test_numba_device_arrays_come_from_the_pool(gpu):
    library("numba.cuda")
    out = run_in_new_process(
        textwrap.dedent(
            """
            import numpy as np
            import cumempool as cm, cumempool.numba as cmn
            pool = cm.MemPool(cm.Route.device(0))
            cmn.use(pool)
            from numba import cuda

            @cuda.jit
            def iota(a):
                i = cuda.grid(1)
                if i < a.size:
                    a[i] = i

            a = cuda.device_array(1 << 20, dtype=np.int32)
            assert pool.used_mem_current >= 4 << 20, pool.used_mem_current
            expected = np.arange(1 << 20, dtype=np.int32)
            try:
                iota.forall(a.size)(a)
                kernel = "ran"
            except AttributeError as error:
                # numba-cuda's own compiler may not load beside a newer NumPy (0.30 against
                # NumPy without np.row_stack): the memory is then checked with copies.
                kernel = f"not compiled ({error})"
                a.copy_to_device(expected)
            host = a.copy_to_host()
            assert (host == expected).all()
            del a
            cuda.synchronize()
            print(kernel)
            print(pool.used_mem_current)
            """
        )
    )
    kernel, used = out.splitlines()[-2:]
    print("numba kernel:", kernel)
    assert used == "0"
