"""The CuPy plug-in's call without a GPU, for counting its instructions: CuPy's call of
``cumempool.cupy.Allocator`` over a cache, on CuPy's null stream, made ``--calls`` times against
the stand-in driver (tests/src/stand_in_driver.c) and a stand-in ``cupy`` module whose stream,
``UnownedMemory`` and ``MemoryPointer`` look like CuPy 14.2's. Run it under callgrind and read the
allocator's own cost per call, with device 0's primary context current as CuPy leaves it; the
wall time it prints is this host's, not a GPU's:

    cc -O2 -shared -fPIC -pthread -o /tmp/libstandin.so tests/src/stand_in_driver.c tests/src/stand_in_nccl.c
    CUMEMPOOL_LIBCUDA=/tmp/libstandin.so valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \\
        python3 crates/cumempool-py/bench/cupy_call_on_stand_in.py --calls 10000
    callgrind_annotate --inclusive=yes --tree=calling /tmp/cg.out | grep -A12 '\\* .*CupyAllocatorBase::__pymethod___call__'

The ``call1`` line under the call is CuPy's two constructors (this module's stand-ins, not
CuPy's); the rest is the plug-in's own work.

With ``--real-cupy`` the memory objects are CuPy's own (an installed CuPy, which imports without
a GPU; its device and stream calls, which need one, are the stand-ins): the count then includes
CuPy's constructors and destructors as the GPU host runs them. Set ``OPENBLAS_NUM_THREADS=1``
(NumPy's idle BLAS threads are counted too) and ``PYTHONHASHSEED=0`` (the seed moves the count),
and take the difference between two runs (``--calls 10000`` and ``30000``) as the per-call count.
"""

import argparse
import ctypes
import os
import sys
import time
import types


class NullStream:
    """As CuPy 14.2's ``Stream.null``: the legacy stream, named by ``ptr`` and the stream
    protocol, with ``device_id`` -1 (the current device)."""

    ptr = 0
    device_id = -1

    def __cuda_stream__(self):
        return (0, self.ptr)


class UnownedMemory:
    __slots__ = ("ptr", "size", "owner", "device_id")

    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    __slots__ = ("mem", "ptr")

    def __init__(self, mem, offset):
        self.mem, self.ptr = mem, mem.ptr + offset


def stand_in_cupy() -> types.ModuleType:
    null = NullStream()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        get_current_stream=lambda: null,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
    )
    return cupy


def real_cupy() -> types.ModuleType:
    """The installed CuPy, with its current device and stream answered by the stand-ins (its own
    calls need the CUDA runtime, and a GPU)."""
    import cupy

    null = NullStream()
    cupy.cuda.runtime.getDevice = lambda: 0
    cupy.cuda.get_current_stream = lambda: null
    return cupy


def primary_context_current() -> None:
    """Makes device 0's primary context current on this thread, as CuPy's runtime leaves it
    (CUMEMPOOL_LIBCUDA names the stand-in, which exports these entry points)."""
    lib = ctypes.CDLL(os.environ["CUMEMPOOL_LIBCUDA"])
    retain = ctypes.c_void_p()
    status = ctypes.c_int()
    found = lib.cuGetProcAddress_v2(b"cuDevicePrimaryCtxRetain", ctypes.byref(retain), 13000, 0, ctypes.byref(status))
    if found != 0 or not retain.value:
        raise RuntimeError("the stand-in driver has no cuDevicePrimaryCtxRetain")
    context = ctypes.c_void_p()
    if ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)(retain.value)(ctypes.byref(context), 0) != 0:
        raise RuntimeError("cuDevicePrimaryCtxRetain failed")
    if lib.cuCtxSetCurrent(context) != 0:
        raise RuntimeError("cuCtxSetCurrent failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--method", action="store_true", help="call allocator.malloc, as the budget installs it")
    parser.add_argument("--real-cupy", action="store_true", help="CuPy's own memory objects (CuPy installed)")
    args = parser.parse_args()
    sys.modules["cupy"] = real_cupy() if args.real_cupy else stand_in_cupy()
    primary_context_current()
    import cumempool as cm
    import cumempool.cupy as cmc

    allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0)))))
    for _ in range(100):  # the cache's first block, and the memo's entries
        del_me = allocator(args.size)
        del del_me
    start = time.perf_counter()
    call = allocator.malloc if args.method else allocator
    for _ in range(args.calls):
        pointer = call(args.size)
        del pointer
    spent = time.perf_counter() - start
    print(f"{args.calls} calls and frees: {spent / args.calls * 1e9:.0f} ns each on this host (stand-in driver)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
