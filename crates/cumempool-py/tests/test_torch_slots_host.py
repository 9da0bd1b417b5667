"""`cumempool.torch.mem_pool` on the stand-in libcuda of the Rust tests, with a stand-in
for the part of PyTorch it uses (no GPU, no torch): `CUDAPluggableAllocator` loads the named C
functions with ctypes, as PyTorch loads them with dlsym, and a `MemPool` allocates through them."""

import textwrap

import pytest

from test_fake_driver import _run_after

FAKE_TORCH = {
    "__init__.py": "from . import cuda\n",
    "cuda/__init__.py": textwrap.dedent(
        """
        from . import memory

        class MemPool:
            # PyTorch's MemPool: allocations in it call the allocator's functions, with the
            # device and stream and nothing naming the pool.
            def __init__(self, allocator):
                self._allocator = allocator

            def alloc(self, size):
                return self._allocator.alloc_fn(size, 0, None)

            def free(self, ptr, size):
                self._allocator.free_fn(ptr, size, 0, None)
        """
    ),
    "cuda/memory.py": textwrap.dedent(
        """
        import ctypes

        class CUDAPluggableAllocator:
            def __init__(self, path, alloc_fn_name, free_fn_name):
                lib = ctypes.CDLL(path)
                self.alloc_fn = getattr(lib, alloc_fn_name)
                self.alloc_fn.restype = ctypes.c_void_p
                self.alloc_fn.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
                self.free_fn = getattr(lib, free_fn_name)
                self.free_fn.restype = None
                self.free_fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

            def allocator(self):
                return self
        """
    ),
}


@pytest.fixture(scope="module")
def fake_torch(tmp_path_factory):
    """Python that puts the stand-in `torch` first on the path and imports the plug-in."""
    root = tmp_path_factory.mktemp("fake_torch")
    for name, text in FAKE_TORCH.items():
        path = root / "torch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return f"import sys\nsys.path.insert(0, {str(root)!r})\nimport cumempool.torch as cmt\n"


def test_pools_over_two_sources_each_allocate_from_their_own(stand_in_libcuda, fake_torch):
    # PyTorch gives the allocation function no pool id: a MemPool made before another over
    # another source must still allocate from its own source.
    lines = _run_after(
        stand_in_libcuda,
        fake_torch,
        """
        a = cm.Statistics(cm.PoolResource(pool))
        b = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
        pa = cmt.mem_pool(a)
        pb = cmt.mem_pool(b)
        x = pa.alloc(1 << 20)
        y = pb.alloc(2 << 20)
        print(a.usage()["current_bytes"], b.usage()["current_bytes"])
        pa.free(x, 1 << 20)
        pb.free(y, 2 << 20)
        print(a.usage()["current_bytes"], b.usage()["current_bytes"])
        cmt.stop()
        """,
    )
    assert lines[0:2] == ["1048576", "2097152"], "a MemPool allocated from the source of a later one"
    assert lines[2:4] == ["0", "0"], "a block did not go back to its own source"


def test_pools_over_one_source_share_a_slot(stand_in_libcuda, fake_torch):
    lines = _run_after(
        stand_in_libcuda,
        fake_torch,
        """
        source = cm.CachingResource(cm.PoolResource(pool))
        first, second = cmt.mem_pool(source), cmt.mem_pool(source)
        print(first._allocator is second._allocator)
        as_pool = cmt.mem_pool(pool)  # a MemPool is a source of its own
        print(as_pool._allocator is first._allocator)
        x, y = first.alloc(64), as_pool.alloc(128)
        print(cmt.statistics(second)["current_bytes"], cmt.statistics(as_pool)["current_bytes"])
        print(cmt.statistics()["current_bytes"])  # the last pool made
        first.free(x, 64)
        as_pool.free(y, 128)
        cmt.stop()
        print(cmt.statistics(first), cmt.statistics())
        """,
    )
    assert lines[0:2] == ["True", "False"]
    assert lines[2:5] == ["64", "128", "128"], "the plug-in's statistics of each pool"
    assert lines[5:7] == ["{}", "{}"], "statistics after stop()"


def test_a_slot_is_free_again_once_its_pool_and_blocks_are_gone(stand_in_libcuda, fake_torch):
    lines = _run_after(
        stand_in_libcuda,
        fake_torch,
        """
        pools = [cmt.mem_pool(cm.Statistics(cm.PoolResource(pool))) for _ in range(cmt.TORCH_SLOTS)]
        def one_more():
            try:
                return cmt.mem_pool(cm.Statistics(cm.PoolResource(pool)))
            except RuntimeError as error:
                print("full" if "slots are bound" in str(error) else error)
        one_more()
        block = pools[0].alloc(64)
        del pools[0]
        gc.collect()
        one_more()  # its block still holds the slot: PyTorch's pool lives as long
        pools[-1].free(block, 64)  # any pool's free finds the block's source
        extra = one_more()
        block = extra.alloc(64)
        print(extra is not None, block is not None)
        one_more()
        cmt.stop()
        print(extra.alloc(64))  # stopped
        one_more()  # a pool kept keeps its slot: it must never reach a later source
        del pools, extra
        gc.collect()
        again = [cmt.mem_pool(cm.Statistics(cm.PoolResource(pool))) for _ in range(cmt.TORCH_SLOTS - 1)]
        one_more()  # the block allocated before stop() still holds its slot
        again[0].free(block, 64)
        print(one_more() is not None)
        cmt.stop()
        """,
    )
    assert lines[0] == "full", "more slots than exported functions"
    assert lines[1] == "full", "a slot was unbound while a block it allocated lived"
    assert lines[2:4] == ["True", "True"], "the slot was not freed when its pool and blocks were gone"
    assert lines[4] == "full"
    assert lines[5] == "None", "a pool allocated after stop()"
    assert lines[6] == "full", "stop() let a pool still alive lose its slot"
    assert lines[7] == "full", "a slot was freed while a block it allocated lived"
    assert lines[8] == "True", "slots were not freed once their pools and blocks were gone"


# A stand-in for the part of PyTorch `cumempool.torch` uses (test_torch_slots_host.py's), where, as
# in PyTorch, a MemPool keeps only a raw pointer to its allocator (`_MemPool.__init__` takes a
# `CUDAAllocator*`, torch/csrc/cuda/MemPool.cpp, and nothing keeps the Python
# `CUDAPluggableAllocator` alive): here a weak reference, which fails loudly where PyTorch would
# call through a dangling pointer. `CUDAPluggableAllocator.__init__` lets a second thread in
# (a switch PyTorch's own `__init__`, which calls ctypes and the C++ side, allows at any
# bytecode), waiting up to a second for it.
DANGLING_TORCH = {
    "__init__.py": "from . import cuda\n",
    "cuda/__init__.py": textwrap.dedent(
        """
        import weakref
        from . import memory

        class MemPool:
            def __init__(self, allocator):
                self._allocator = weakref.ref(allocator)  # PyTorch: a raw pointer

            def alloc(self, size):
                allocator = self._allocator()
                if allocator is None:
                    raise RuntimeError("use after free: the pool's allocator was destroyed")
                return allocator.alloc_fn(size, 0, None)
        """
    ),
    "cuda/memory.py": textwrap.dedent(
        """
        import ctypes, threading

        both_in = threading.Barrier(2)

        class CUDAPluggableAllocator:
            def __init__(self, path, alloc_fn_name, free_fn_name):
                try:
                    both_in.wait(timeout=1)
                except threading.BrokenBarrierError:
                    pass
                lib = ctypes.CDLL(path)
                self.alloc_fn = getattr(lib, alloc_fn_name)
                self.alloc_fn.restype = ctypes.c_void_p
                self.alloc_fn.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

            def allocator(self):
                return self
        """
    ),
}


@pytest.fixture(scope="module")
def dangling_torch(tmp_path_factory):
    root = tmp_path_factory.mktemp("dangling_torch")
    for name, text in DANGLING_TORCH.items():
        path = root / "torch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return f"import sys\nsys.path.insert(0, {str(root)!r})\nimport cumempool.torch as cmt\n"


def test_pools_made_at_once_over_one_source_keep_their_allocator_alive(stand_in_libcuda, dangling_torch):
    # Two threads make the first pools over one source at once: both share its slot. Each pool
    # must be made over the one allocator the module keeps for the slot: PyTorch's MemPool keeps
    # only a raw pointer to its allocator, so one made over a second allocator, which nothing
    # keeps, would call a destroyed object.
    lines = _run_after(
        stand_in_libcuda,
        dangling_torch,
        """
        import threading
        source = cm.Statistics(cm.PoolResource(pool))
        pools = []
        threads = [threading.Thread(target=lambda: pools.append(cmt.mem_pool(source))) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        gc.collect()
        for torch_pool in pools:
            try:
                print(bool(torch_pool.alloc(64)))
            except RuntimeError as error:
                print("dangling")
        cmt.stop()
        """,
    )
    assert lines == ["True", "True"], "a MemPool's allocator was destroyed while the pool lives"
