"""The caller's current context on the paths beyond a binding's own call: a new Stream, a DLPack
capsule that frees the last of a buffer, a cache giving blocks back, the PyTorch plug-in's C
functions and the mapping of another process's allocation. Each must leave current what the
caller had (its own context, another device's, or none), as the bindings' other calls do."""

import ctypes
import multiprocessing
import subprocess
import sys

import pytest

import cumempool as cm
import test_plugins
from conftest import libcuda


class _OwnContext:
    """A context of the caller's own, current on this thread while the block runs (what CuPy or
    a runtime user on another device looks like to the bindings: not the primary context)."""

    def __init__(self):
        self.cuda = libcuda()
        self.create = getattr(self.cuda, "cuCtxCreate_v2", None)
        if self.create is None:
            pytest.skip("libcuda lacks cuCtxCreate_v2")
        self.mine = ctypes.c_void_p()

    def __enter__(self):
        device = ctypes.c_int()
        assert self.cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
        assert self.create(ctypes.byref(self.mine), 0, device) == 0  # made current on this thread
        return self

    def __exit__(self, *_):
        self.cuda.cuCtxDestroy_v2(self.mine)
        return False

    def is_current(self):
        current = ctypes.c_void_p()
        assert self.cuda.cuCtxGetCurrent(ctypes.byref(current)) == 0
        return current.value == self.mine.value


def test_creating_a_stream_puts_back_the_callers_context(gpu):
    # cuStreamCreate needs the device's context current; code around the bindings (CuPy, the
    # runtime's current device) reads what is current, so the caller's must be put back.
    with _OwnContext() as own:
        stream = cm.Stream(0)
        assert own.is_current(), "Stream(0) left the device's primary context current"
        stream.synchronize()


def test_a_capsule_freeing_the_last_of_a_legacy_buffer_puts_back_the_callers_context(gpu):
    # A DLPack capsule (or the consumer that took its tensor) may be the last holder of a buffer's
    # memory: its free on the legacy stream makes the stream's context current, wherever the
    # consumer lets go (any thread, any context).
    with _OwnContext() as own:
        buffer = cm.MemPool(cm.Route.device(0)).alloc(4096)  # the legacy stream of device 0
        capsule = buffer.__dlpack__(stream=-1)
        buffer.close()  # the capsule now holds the memory
        assert own.is_current()
        del capsule  # no consumer took it: its destructor frees the memory
        assert own.is_current(), "the capsule's free left the primary context current"


def test_a_cache_giving_legacy_blocks_back_puts_back_the_callers_context(gpu):
    # Blocks a cache keeps for the legacy stream go back on that stream in release(), when the
    # cache is collected, and when another stream's allocation makes it give blocks back (out of
    # memory, eviction): each free makes the stream's context current.
    with _OwnContext() as own:
        pool = cm.MemPool(cm.Route.device(0))
        cache = cm.CachingResource(cm.PoolResource(pool))
        cache.alloc(4096).close()  # cached for the legacy stream of device 0
        assert pool.used_mem_current > 0, "the cache kept no block"
        assert own.is_current()
        cache.release()
        assert own.is_current(), "release() left the primary context current"
        cache.alloc(4096).close()
        assert own.is_current()
        del cache  # the cache gives its block back when collected
        assert own.is_current(), "collecting the cache left the primary context current"


TORCH_HOOKS = test_plugins.TORCH_HOOKS + (
    "cuda = ctypes.CDLL('libcuda.so.1')\n"
    "def current():\n"
    "    c = ctypes.c_void_p(); assert cuda.cuCtxGetCurrent(ctypes.byref(c)) == 0; return c.value\n"
)


def test_the_torch_functions_put_back_the_callers_context(gpu):
    # PyTorch's default stream is handle 0, the legacy stream, and PyTorch frees without a device
    # guard: a free that left cuda:1's context current while cuda:0 was would switch the thread's
    # current device (torch.cuda.current_device() reads it).
    if getattr(libcuda(), "cuCtxCreate_v2", None) is None:
        pytest.skip("libcuda lacks cuCtxCreate_v2")
    code = TORCH_HOOKS + (
        "cmt.serve(cm.MemPool(cm.Route.device(0)))\n"
        "dev, mine = ctypes.c_int(), ctypes.c_void_p()\n"
        "assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0\n"
        "assert cuda.cuCtxCreate_v2(ctypes.byref(mine), 0, dev) == 0\n"
        "p = lib.cumempool_torch_alloc(1 << 20, 0, None); assert p\n"
        "after_alloc = current() == mine.value\n"
        "assert cuda.cuCtxSetCurrent(mine) == 0\n"
        "lib.cumempool_torch_free(p, 1 << 20, 0, None)\n"
        "after_free = current() == mine.value\n"
        "cmt.stop()\n"
        "print(after_alloc, after_free)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True", "(after alloc, after free) the caller's context was current: " + out.stdout


def import_with_a_context_of_its_own(conn):
    """Child of the import test (spawned): receives a pool and an allocation, maps it on a new
    stream with a context of its own current, and sends back whether that context was still
    current after the mapping and after its close."""
    import ctypes

    import cumempool as cm

    cuda = ctypes.CDLL("libcuda.so.1")
    pool = cm.MemPool.receive(conn)
    shared = cm.SharedAllocation.from_bytes(conn.recv_bytes())
    stream = cm.Stream(0)
    device, mine, current = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuCtxCreate_v2(ctypes.byref(mine), 0, device) == 0
    mapped = pool.import_buffer(shared, stream)
    cuda.cuCtxGetCurrent(ctypes.byref(current))
    after_import = current.value == mine.value
    cuda.cuCtxSetCurrent(mine)
    mapped.close()
    stream.synchronize()
    cuda.cuCtxGetCurrent(ctypes.byref(current))
    after_close = current.value == mine.value
    cuda.cuCtxDestroy_v2(mine)
    conn.send((after_import, after_close))


def test_mapping_another_processs_allocation_puts_back_the_callers_context(gpu, stream):
    # cuMemPoolImportPointer needs the stream's context current, on any stream (not only the
    # legacy one).
    if getattr(libcuda(), "cuCtxCreate_v2", None) is None:
        pytest.skip("libcuda lacks cuCtxCreate_v2")
    pool = cm.MemPool(cm.Route.device(0), handle_types=cm.HandleTypes.POSIX_FILE_DESCRIPTOR)
    buffer = pool.alloc(4096, stream)
    context = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
    parent, child = context.Pipe()
    process = context.Process(target=import_with_a_context_of_its_own, args=(child,))
    process.start()
    child.close()
    try:
        pool.send(parent)
        parent.send_bytes(buffer.export().to_bytes())
        assert parent.poll(120), "the child did not answer"
        after_import, after_close = parent.recv()
    finally:
        parent.close()
        process.join(120)
        if process.is_alive():
            process.kill()
            process.join()
    buffer.close()
    assert after_close, "closing the mapping left another context current"
    assert after_import, "import_buffer left the stream's context current"
