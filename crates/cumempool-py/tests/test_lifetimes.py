"""Adversarial review (issue 20): lifetimes across the GIL, buffers outliving what they hold,
streams other libraries lend. Each test names the defect it shows; all fail before a fix."""

import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest

import cumempool as cm
from conftest import library


def _run(code, timeout=120):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_review_close_frees_memory_an_array_interface_consumer_still_uses(gpu):
    # DEFECT (UB, use after free): buffers.rs Buffer::close drops the core even when NumPy (via
    # __array_interface__) or CuPy/torch/Numba (via __cuda_array_interface__) hold the Buffer as
    # their array's owner; only DLPack capsules keep the core. The array then reads memory the
    # pool gave to the next allocation (or that went back to the OS: a segfault).
    pytest.importorskip("numpy")
    out = _run(
        "import cumempool as cm, numpy as np\n"
        "pool = cm.MemPool(cm.Route.host()); s = cm.Stream(0)\n"
        "b = pool.alloc(4096, s); b.fill(5); s.synchronize()\n"
        "a = np.asarray(b)\n"
        "b.close()\n"
        "c = pool.alloc(4096, s); c.fill(9); s.synchronize()\n"
        "print(int(a[0]), int(a[-1]))\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5 5"


def test_review_close_frees_memory_a_cupy_array_still_uses(gpu, stream):
    # DEFECT (UB, use after free): as above, through __cuda_array_interface__ on the device.
    cupy = library("cupy")
    pool = cm.MemPool(cm.Route.device(0))
    b = pool.alloc(4096, stream)
    b.fill(5)
    a = cupy.asarray(b)
    b.close()
    c = pool.alloc(4096, stream)
    c.fill(9)
    stream.synchronize()
    assert int(a[0]) == 5 and int(a[-1]) == 5
    del c


def test_review_close_racing_a_copy_on_another_thread(gpu, stream):
    # DEFECT (poor error): Buffer is a mutable pyclass and close() takes &mut self; while another
    # thread copies with the GIL released (holding a shared borrow), close() raises PyO3's
    # RuntimeError("Already borrowed") instead of closing once the copy is done (or the copy
    # raising ClosedError). MemPool.close racing MemPool.alloc does the same (pools.rs).
    buffer = cm.MemPool(cm.Route.device(0)).alloc(256 << 20, stream)
    started = threading.Event()
    failures = []

    def reader():
        started.set()
        try:
            for _ in range(20):
                buffer.to_bytes()
        except cm.ClosedError:
            pass
        except Exception as error:  # noqa: BLE001
            failures.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait()
    time.sleep(0.05)
    try:
        buffer.close()
    except Exception as error:  # noqa: BLE001
        failures.append(error)
    thread.join()
    assert failures == [] and buffer.closed


def test_review_a_resource_keeps_every_lent_stream_forever(gpu):
    # DEFECT (leak): resources.rs ResourceBase::remember holds every lent stream an alloc() saw
    # until release(), which only CachingResource has: a Statistics, Limit, Tracking or
    # PoolResource keeps every CuPy/cuda.core stream object (and its CUDA stream) for its life.
    own = cm.Stream(0)

    class Lender:
        def __cuda_stream__(self):
            return (0, own.handle)

    stats = cm.Statistics(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
    lender = Lender()
    lent = weakref.ref(lender)
    stats.alloc(256, lender).close()
    del lender
    gc.collect()
    assert lent() is None


def test_review_a_block_cached_after_release_does_not_keep_its_stream(gpu):
    # DEFECT (UB): CachingResource.release() forgets the lent streams (resources.rs
    # forget_streams) while buffers on them are still out; when such a buffer closes, its block
    # is cached for that stream again, but nothing keeps the lender alive any more. The lender
    # destroys its CUDA stream and the cache later frees (or reuses) the block on a destroyed
    # handle. Invariant: a block cached for a lent stream keeps the lender alive.
    cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))

    class Lender:
        def __init__(self):
            self.stream = cm.Stream(0)  # destroyed with the lender

        def __cuda_stream__(self):
            return (0, self.stream.handle)

    lender = Lender()
    lent = weakref.ref(lender)
    buffer = cache.alloc(1 << 20, lender)
    cache.release()
    buffer.close()
    del buffer, lender
    gc.collect()
    assert cache.stats()["cached_blocks"] == 0 or lent() is not None
    cache.release()


def test_review_the_cupy_allocator_keeps_every_cupy_stream(gpu):
    # DEFECT (leak): cupy.py Allocator._streams maps (device, ptr) to a Stream holding the CuPy
    # stream object and is never pruned: every CuPy stream used once under the allocator (and
    # its CUDA stream) lives as long as the allocator (plus the native leak above).
    cupy = library("cupy")
    import cumempool.cupy as cmc

    allocator = cmc.Allocator(cm.MemPool(cm.Route.device(0)))
    s = cupy.cuda.Stream(non_blocking=True)
    lent = weakref.ref(s)
    with cupy.cuda.using_allocator(allocator):
        with s:
            a = cupy.zeros(256, dtype=cupy.uint8)
        del a
    s.synchronize()
    del s
    gc.collect()
    assert lent() is None
