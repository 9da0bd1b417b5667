"""Every operation a Buffer queues on a stream or between two streams (fill, the copies, a
close after another stream's work, a DLPack export to a consumer) goes through the core crate's
checked operation (`cumempool::Block`): while a stream involved captures a CUDA graph for
another library, it is refused with StreamCapturingError before the driver sees anything, and
the capture is left intact with nothing of cumempool's recorded into it. On the stand-in libcuda
(no GPU), and on the GPU with the shapes a user meets: torch.cuda.graph, CuPy's
Stream.begin_capture, cuda.core's graph builder and a raw cuStreamBeginCapture through ctypes."""

import contextlib
import ctypes
import os
import textwrap

import pytest

import cumempool as cm
from conftest import libcuda, library, run_in_new_process
from test_resource_alloc_under_capture import run_on_stand_in

# Each operation, as a user calls it, on `buffer` (ordered on the capturing stream `captured`),
# with `other` a buffer on a stream that does not capture and `consumer` a handle of that stream.
OPERATIONS = {
    "fill": "buffer.fill(7)",
    "to_bytes": "buffer.to_bytes()",
    "copy_from": "buffer.copy_from(b'x' * 64)",
    "copy_from_buffer into it": "buffer.copy_from_buffer(other)",
    "copy_from_buffer out of it": "other.copy_from_buffer(buffer)",
    "close after its own stream": "buffer.close(captured)",
    "close after another stream": "buffer.close(other.stream)",
    "dlpack to another stream": "buffer.__dlpack__(stream=consumer)",
}

# The stand-in's log of memsets and copies, read to see that nothing was queued.
QUEUED = """
log = (ctypes.c_char * 65536).in_dll(lib, "call_log")
log_len = ctypes.c_int.in_dll(lib, "call_log_len")
def queued():
    lines = log.raw[: log_len.value].decode().splitlines()
    return sum(1 for line in lines if line.startswith(("memset", "memcpy")))
"""


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_an_operation_on_a_capturing_lent_stream_is_refused_before_the_driver(stand_in_libcuda, operation):
    words = run_on_stand_in(
        stand_in_libcuda,
        QUEUED
        + textwrap.dedent(
            """
            pool = cm.MemPool(cm.Route.device(0))
            captured = cm.Stream(0)
            buffer = pool.alloc(1 << 16, captured)
            other = pool.alloc(1 << 16, cm.Stream(0))
            consumer = other.stream.handle
            handle = captured.handle  # lent to another library, which captures it
            assert begin(handle, 2) == 0
            before = queued()
            try:
                OPERATION
                print("accepted")
            except cm.StreamCapturingError:
                print("refused")
            graph = ctypes.c_void_p()
            print(queued() - before, end(handle, ctypes.byref(graph)), buffer.closed)
            """
        ).replace("OPERATION", OPERATIONS[operation]),
    )
    assert words == ["refused", "0", "0", "False"], "refused, nothing queued, the capture intact, the buffer open"


def test_the_per_thread_stream_saved_as_an_object_is_checked_at_each_use(stand_in_libcuda):
    # `Stream.borrow(2)` kept and used later, while the thread's per-thread stream captures
    # (CuPy's Stream.ptds.begin_capture()): legacy-stream work then would be refused by the
    # driver, invalidating the capture.
    words = run_on_stand_in(
        stand_in_libcuda,
        QUEUED
        + """
pool = cm.MemPool(cm.Route.device(0))
per_thread = cm.Stream.borrow(2, 0)
buffer = pool.alloc(4096, per_thread)
on_legacy = pool.alloc(4096, cm.Stream.legacy(0))
print(per_thread.handle)
assert begin(2, 1) == 0  # thread-local mode, as CuPy's ptds capture
refused = []
uses = (
    lambda: pool.alloc(4096, per_thread),
    lambda: buffer.fill(0),
    lambda: cm.PoolResource(pool).alloc(64, per_thread),
    lambda: on_legacy.__dlpack__(stream=2),  # a consumer on the capturing per-thread stream
    lambda: on_legacy.close(per_thread),
)
for use in uses:
    try:
        use()
        refused.append("accepted")
    except cm.StreamCapturingError:
        refused.append("refused")
print(*refused)
graph = ctypes.c_void_p()
print(end(2, ctypes.byref(graph)))
buffer.fill(0)  # after the capture
print("filled")
""",
    )
    assert words == ["2", "refused", "refused", "refused", "refused", "refused", "0", "filled"]


def test_torch_plugin_refuses_a_source_whose_allocations_call_python(stand_in_libcuda):
    # PyTorch calls the plug-in holding its allocator mutex: a Python callback there would wait
    # for the GIL against a thread holding it that waits for the mutex (memory_stats()).
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import cumempool._native as native
        import cumempool.torch as cmt
        pool = cm.MemPool(cm.Route.device(0))
        source = cm.CachingResource(cm.OnOutOfMemory(cm.PoolResource(pool), lambda size, attempt: False))
        for call in (lambda: native.torch_bind(source, source), lambda: cmt.serve(source)):
            try:
                call()
                print("served")
            except ValueError as error:
                print("refused", "GIL" in str(error))
        cmt.serve(cm.PoolResource(pool))  # without a callback
        print("served")
        cmt.stop()
        """,
    )
    assert words == ["refused", "True", "refused", "True", "served"]


# On the GPU: the capturing libraries. Each makes its stream (cumempool borrows it and allocates
# on it before the capture), then captures it in its own way, and checks that the capture gave a
# graph that runs.


class TorchCapture:
    def __init__(self):
        self.torch = library("torch")
        self.stream = self.torch.cuda.Stream()

    @contextlib.contextmanager
    def capturing(self):
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        static = torch.zeros(16, device="cuda")
        with torch.cuda.graph(graph, stream=self.stream):
            static += 1
            yield
        graph.replay()
        torch.cuda.synchronize()
        assert static[0].item() == 1.0, "the capture's own work, recorded (not run) and replayed once"


class CupyCapture:
    def __init__(self):
        self.cupy = library("cupy")
        self.stream = self.cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def capturing(self):
        with self.stream:
            self.stream.begin_capture()
            try:
                yield
            finally:
                graph = self.stream.end_capture()
        graph.launch(self.stream)
        self.stream.synchronize()


class CudaCoreCapture:
    def __init__(self):
        core = library("cuda.core")
        device = core.Device(0)
        device.set_current()
        self.builder = device.create_stream().create_graph_builder()
        self.stream = self.builder if hasattr(self.builder, "__cuda_stream__") else self.builder.stream

    @contextlib.contextmanager
    def capturing(self):
        self.builder.begin_building()
        try:
            yield
        finally:
            self.builder.end_building()
        self.builder.complete()


class RawCapture:
    """The driver through ctypes, capturing a stream cumempool made and lent by its handle."""

    def __init__(self):
        self.lib = libcuda()
        self.own = cm.Stream(0)
        self.stream = self.own.handle

    @contextlib.contextmanager
    def capturing(self):
        handle = ctypes.c_void_p(self.stream)
        assert self.lib.cuStreamBeginCapture_v2(handle, 2) == 0
        graph = ctypes.c_void_p()
        try:
            yield
        finally:
            ended = self.lib.cuStreamEndCapture(handle, ctypes.byref(graph))
        assert ended == 0, f"the capture was invalidated ({ended})"
        assert graph.value, "the capture gave a graph"
        self.lib.cuGraphDestroy(graph)


CAPTURES = {"torch": TorchCapture, "cupy": CupyCapture, "cuda.core": CudaCoreCapture, "raw": RawCapture}


@pytest.mark.parametrize("capture", list(CAPTURES))
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_on_the_gpu_an_operation_is_refused_and_the_capture_intact(gpu, capture, operation):
    library_capture = CAPTURES[capture]()
    captured = cm.Stream.borrow(library_capture.stream)
    pool = cm.MemPool(cm.Route.device(0))
    buffer = pool.alloc(1 << 16, captured)
    other = pool.alloc(1 << 16, cm.Stream(0))
    consumer = other.stream.handle
    namespace = {"buffer": buffer, "other": other, "captured": captured, "consumer": consumer}
    with library_capture.capturing():
        with pytest.raises(cm.StreamCapturingError):
            exec(OPERATIONS[operation], namespace)
    assert not buffer.closed
    buffer.fill(3)  # after the capture, each works again
    exec(OPERATIONS[operation], namespace)
    captured.synchronize()
    other.close()
    buffer.close()


def test_on_the_gpu_the_per_thread_stream_object_is_checked_at_each_use(gpu):
    cupy = library("cupy")
    pool = cm.MemPool(cm.Route.device(0))
    per_thread = cm.Stream.borrow(2, 0)
    buffer = pool.alloc(4096, per_thread)
    ptds = cupy.cuda.Stream.ptds
    with ptds:
        ptds.begin_capture()
        try:
            for use in (lambda: pool.alloc(4096, per_thread), lambda: buffer.fill(0)):
                with pytest.raises(cm.StreamCapturingError):
                    use()
        finally:
            graph = ptds.end_capture()  # raises if the capture was invalidated
    graph.launch(ptds)
    ptds.synchronize()
    buffer.fill(1)
    assert buffer.to_bytes()[:4] == b"\x01" * 4


def test_on_the_gpu_an_out_of_memory_names_the_entry_point(gpu):
    pool = cm.MemPool(cm.Route.device(0), max_size=32 << 20)
    for source in (pool, cm.PoolResource(pool)):
        with pytest.raises(cm.OutOfMemoryError) as refused:
            source.alloc(64 << 20, cm.Stream(0))
        error = refused.value
        assert (error.code, error.name, error.function) == (2, "CUDA_ERROR_OUT_OF_MEMORY", "cuMemAllocFromPoolAsync")


def test_on_the_gpu_the_cupy_out_of_memory_pickles_with_its_fields(gpu):
    library("cupy")
    import pickle

    import cumempool.cupy as cmc

    allocator = cmc.Allocator(cm.MemPool(cm.Route.device(0), max_size=32 << 20))
    with pytest.raises(cm.OutOfMemoryError) as refused:
        allocator(64 << 20)
    again = pickle.loads(pickle.dumps(refused.value))
    assert isinstance(again, cm.OutOfMemoryError)
    assert (again.code, again.name, again.function) == (2, "CUDA_ERROR_OUT_OF_MEMORY", "cuMemAllocFromPoolAsync")


def test_on_the_gpu_routing_never_changes_a_pool_it_does_not_own(routing):
    route = cm.Route.device(0)
    default = cm.default_pool(route)
    before = default.release_threshold
    default.release_threshold = 0  # the driver's own default, whatever ran in this process before
    try:
        guard = cm.set_current_pool(route, default)
        assert default.release_threshold == 0, "the driver's default pool serves every cudaMallocAsync user"
        guard.restore()
    finally:
        default.release_threshold = before
    own = cm.MemPool(route)
    own.release_threshold = 0
    with cm.set_current_pool(route, own):
        assert own.release_threshold == 2**64 - 1, "a pool cumempool made is raised, as before"


def test_on_the_gpu_torch_plugin_with_a_memory_stats_thread_does_not_hang(gpu):
    # The combination that hung: a thread allocating through the plug-in at the source's limit
    # while another, holding the GIL, reads PyTorch's allocator statistics. With the callback
    # refused, the plug-in never waits for the GIL; a watchdog turns a hang into a failure.
    if os.environ.get("CUMEMPOOL_UNDER_SANITIZER") == "1":
        pytest.skip("the watchdog's 120 s are too short for a child under compute-sanitizer")
    library("torch")
    code = textwrap.dedent(
        """
        import threading, torch
        import cumempool as cm, cumempool.torch as cmt
        pool = cm.MemPool(cm.Route.device(0), max_size=64 << 20)
        torch_pool = cmt.mem_pool(cm.PoolResource(pool))
        stop = threading.Event()
        def stats():
            while not stop.is_set():
                torch.cuda.memory_stats()
        reader = threading.Thread(target=stats)
        reader.start()
        ooms = 0
        with torch.cuda.use_mem_pool(torch_pool):
            for _ in range(200):
                try:
                    x = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
                    y = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")
                except torch.OutOfMemoryError:
                    ooms += 1
                x = y = None
        stop.set()
        reader.join()
        print("done", ooms > 0)
        """
    )
    assert run_in_new_process(code).split() == ["done", "True"]


def test_on_the_gpu_the_cuda_core_plugin_refuses_a_deallocate_on_a_capturing_stream(gpu):
    # cuda.core's Buffer.close(stream) calls the resource's deallocate with that stream: while
    # another library captures it, the free cannot follow "the work queued so far".
    core = library("cuda.core")
    import cumempool.cuda_core as cmcc

    device = core.Device(0)
    device.set_current()
    stream = device.create_stream()
    mr = cmcc.MemoryResource(cm.MemPool(cm.Route.device(0)))
    buffer = mr.allocate(1 << 20, stream=stream)
    ptr, size = int(buffer.handle), buffer.size
    capture = RawCapture()
    capture.stream = int(stream.handle)
    with capture.capturing():
        with pytest.raises(cm.StreamCapturingError):
            mr.deallocate(ptr, size, stream)
    mr.deallocate(ptr, size, stream)  # after the capture: freed after the stream's work
    stream.sync()
