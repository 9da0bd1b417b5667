"""The CuPy plug-in's CUDA graph support on a host without a GPU: a stand-in ``cupy`` module over
the stand-in libcuda, whose current stream says it captures when told to."""

import pytest

from test_resource_alloc_under_capture import run_on_stand_in

# A stand-in ``cupy``: its current stream is `current[0]` (a handle of the stand-in driver, 0
# the legacy stream), which `capture()` begins capturing (in `mode`) and `end_capture()` ends, as
# CuPy's `begin_capture` and `end_capture` do; `synced` notes the devices synchronised
# (`cupy.cuda.Device(n).synchronize()`); `asked` lists the attributes the stream had not
# (what a conversion looked for), and `protocol` counts calls of `__cuda_stream__`. The current
# stream is a new object per call unless `same[0]` holds one (CuPy keeps its current stream's).
FAKE_CUPY = """
import sys, types
current, synced, asked, protocol, same = [0], [], [], [0], [None]
class FakeStream:
    device_id = -1  # CuPy's default-stream objects answer -1: "the current device"
    def __cuda_stream__(self):
        protocol[0] += 1
        return (0, self.ptr)
    def __getattr__(self, name):
        asked.append(name)
        raise AttributeError(name)
    @property
    def ptr(self):
        return current[0]
    def is_capturing(self):
        status = ctypes.c_int()
        assert capture_info(ctypes.c_void_p(current[0]), ctypes.byref(status), *[None] * 5) == 0
        return status.value != 0
capture_info = entry("cuStreamGetCaptureInfo", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), *[ctypes.c_void_p] * 5)
def capture(mode=0):
    stream = cm.Stream(0)
    assert begin(stream.handle, mode) == 0
    current[0] = stream.handle
    return stream
def end_capture(stream):
    graph = ctypes.c_void_p()
    current[0] = 0
    return end(stream.handle, ctypes.byref(graph))
class FakeDevice:
    def __init__(self, n):
        self.n = n
    def synchronize(self):
        synced.append(self.n)
cupy = types.ModuleType("cupy")
cupy.cuda = types.SimpleNamespace(
    memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
    runtime=types.SimpleNamespace(getDevice=lambda: 0),
    get_current_stream=lambda: same[0] or FakeStream(),
    Device=FakeDevice,
    UnownedMemory=lambda ptr, size, owner, device: (ptr, size, owner, device),
    MemoryPointer=lambda memory, offset: memory,
)
sys.modules["cupy"] = cupy
import cumempool.cupy as cmc
"""


# Another thread begins capturing its per-thread stream (a blocking stream, global mode) and
# waits for `done`; `ended` gets its capture's end.
ANOTHER_THREAD_CAPTURES = """
import threading
started, done, ended = threading.Event(), threading.Event(), []
def capturing_thread():
    assert begin(2, 0) == 0
    started.set()
    done.wait()
    graph = ctypes.c_void_p()
    ended.append(end(2, ctypes.byref(graph)))
thread = threading.Thread(target=capturing_thread)
thread.start()
started.wait()
"""


def _with_fake_cupy(stand_in_libcuda, code):
    """Runs `code` on the stand-in driver after FAKE_CUPY; its stdout words."""
    return run_on_stand_in(stand_in_libcuda, FAKE_CUPY + code)


def test_release_captured_keeps_memory_an_array_still_holds(stand_in_libcuda):
    # An array a capture made (the graph's output, `y = x * 2` inside the capture) lives on
    # after the graph: releasing the captured memory must not free it under the array, and the
    # device is waited for first (a launch queued before may still run on the memory).
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(pool)
captured = capture()
escaped = allocator(4096)  # the user keeps it
temporary = allocator(8192)
del temporary  # a temporary the capture let go of
assert end_capture(captured) == 0
allocator.release_captured()
log = (ctypes.c_char * 65536).in_dll(lib, "call_log").raw[: ctypes.c_int.in_dll(lib, "call_log_len").value]
waits = [line for line in log.decode().splitlines() if line.startswith("ctxsync")]
print(pool.used_mem_current, allocator.captured_bytes, len(waits), waits[-1].endswith(" 0"))
del escaped
allocator.release_captured()
print(pool.used_mem_current, allocator.captured_bytes)
""",
    )
    assert words == ["4096", "4096", "1", "True", "0", "0"], "an array's memory was freed under it, or unsynchronised"


def test_a_global_mode_capture_survives_the_plug_ins_side_stream(stand_in_libcuda):
    # A capture begun in global mode forbids this thread's host waits (the stand-in invalidates
    # it as the driver does): serving it, allocating on the side stream, a cache's bookkeeping
    # and the wait for the allocation must leave it intact.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
for source in (pool, cm.CachingResource(cm.PoolResource(pool))):
    allocator = cmc.Allocator(source)
    captured = capture(0)  # global
    pointers = [allocator(4096) for _ in range(3)]
    del pointers
    print(end_capture(captured), allocator.captured_bytes)
    allocator.release_captured()
""",
    )
    assert words == ["0", "12288", "0", "12288"], "the plug-in invalidated a global-mode capture"


@pytest.mark.parametrize("recording", [False, True], ids=["native call", "recording (Python steps)"])
@pytest.mark.parametrize("default_stream", [0, 2], ids=["null stream", "per-thread stream"])
def test_on_a_default_stream_a_blocking_capture_elsewhere_is_left_intact(stand_in_libcuda, default_stream, recording):
    # Another thread captures its per-thread stream (blocking, global mode) while CuPy
    # allocates on its null stream, or on its per-thread default stream (both queue on the
    # legacy stream): the driver would refuse that allocation and invalidate the capture. Both
    # paths of the call (the native one, and the Python steps recording takes) ask first,
    # harmlessly, and refuse with StreamCapturingError.
    words = _with_fake_cupy(
        stand_in_libcuda,
        f"current[0] = {default_stream}\nRECORDING = {recording}\n"
        + """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
if RECORDING:
    cm.record_history(True)
"""
        + ANOTHER_THREAD_CAPTURES
        + """
try:
    allocator(4096)
    print("allocated")
except cm.StreamCapturingError:
    print("refused")
finally:
    done.set()
    thread.join()
print(ended[0], pool.used_mem_current)
""",
    )
    assert words == ["refused", "0", "0"], "the allocation went to the driver and invalidated the other thread's capture"


def test_a_default_stream_is_served_from_its_handle_and_another_through_its_object(stand_in_libcuda):
    # CuPy's null and per-thread streams are served from `ptr` alone (they outlive every
    # object): no other library's attribute is looked for. Any other stream goes through the
    # general conversion, which keeps CuPy's object for the buffer.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
for handle in (0, 1, 2):
    current[0] = handle
    kept = allocator(4096)
    print(kept[2].stream.handle)
    del kept
print(len(asked))
stream = cm.Stream(0)
current[0] = stream.handle
kept = allocator(4096)
print(kept[2].stream.handle == stream.handle, len(asked) > 0)
""",
    )
    assert words == ["0", "0", "2", "0", "True", "True"], "a default stream was looked up by other attributes"


def test_a_default_stream_is_the_current_devices_in_the_python_steps_too(stand_in_libcuda):
    # Handles 0, 1 and 2 name the current context's default streams, whatever device the
    # stream object says: the Python steps (recording on) serve them as the native call does,
    # on the current device.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
FakeStream.device_id = 1
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
for recording in (False, True):
    cm.record_history(recording, stacks=None)
    kept = allocator(4096)
    buffer = getattr(kept[2], "buffer", kept[2])  # recording holds it in a record
    print(buffer.device, buffer.stream.handle)
    del buffer
    del kept
cm.record_history(False)
""",
    )
    assert words == ["0", "0", "0", "0"], "the Python steps took the stream object's device"


def test_cupys_stream_object_is_found_again_by_its_handle_and_not_asked_again(stand_in_libcuda):
    # A CuPy stream that stays current is found in the memo by its object and the handle just
    # read (`ptr`): the stream protocol is not asked again. An object that names another
    # handle by now is looked up anew.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
first, second = cm.Stream(0), cm.Stream(0)
same[0] = FakeStream()
current[0] = first.handle
kept = [allocator(4096)]
asked_first = protocol[0]
kept += [allocator(4096) for _ in range(3)]
print(asked_first > 0, protocol[0] == asked_first, {k[2].stream.handle == first.handle for k in kept})
current[0] = second.handle
kept.append(allocator(4096))
print(kept[-1][2].stream.handle == second.handle)
""",
    )
    assert words == ["True", "True", "{True}", "True"], "the memo asked the protocol again, or kept a stale stream"


def test_a_cupy_stream_without_the_protocol_that_names_another_handle_is_looked_up_anew(stand_in_libcuda):
    # CuPy before 14 has no `__cuda_stream__`: its stream is named by `ptr`. Where the object
    # reports another handle than the memo kept for it, the allocation goes to that stream.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
class OlderCupyStream:
    device_id = -1
    ptr = 0
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
first, second = cm.Stream(0), cm.Stream(0)
same[0] = OlderCupyStream()
same[0].ptr = first.handle
kept = [allocator(4096)]
same[0].ptr = second.handle
kept.append(allocator(4096))
print([k[2].stream.handle for k in kept] == [first.handle, second.handle])
""",
    )
    assert words == ["True"], "the allocation went to the stream the memo kept, not the one the object names"


def test_the_native_call_raises_cupys_out_of_memory_and_records_when_asked(stand_in_libcuda):
    # The allocator's call is native: at the resource's limit it still raises CuPy's class
    # (cumempool's too, with the driver's fields), other failures raise as they are, and with
    # recording on the call goes through the Python steps, which record it.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
class CupyOutOfMemory(Exception):
    pass
cupy.cuda.memory.OutOfMemoryError = CupyOutOfMemory
stream = cm.Stream(0)
current[0] = stream.handle
allocator = cmc.Allocator(cm.Limit(cm.PoolResource(cm.MemPool(cm.Route.device(0))), 4096))
try:
    allocator(8192)
except CupyOutOfMemory as error:
    print(type(error).__qualname__, isinstance(error, cm.OutOfMemoryError), error.__cause__ is not None)
try:
    allocator(-1)
except OverflowError:
    print("overflow")
print(type(allocator(1024)[2]).__name__)
cm.record_history(stacks=None)
print(type(allocator(1024)[2]).__name__)
cm.record_history(False)
""",
    )
    assert words[:3] == ["OutOfMemoryError", "True", "True"], words
    assert words[3:5] == ["overflow", "Buffer"], words
    assert words[5] != "Buffer", "recording on, the native steps served the call"


def test_a_finalizer_that_begins_a_capture_inside_an_allocation_is_asked_about(stand_in_libcuda):
    # The cache, at the pool's limit, gives its blocks back, and so lets go of another library's
    # stream object, whose finalizer runs there and begins a capture on the stream being
    # allocated on. The call's check is stale from then on: the allocation the cache retries
    # must ask the driver again (and so find the capture), not take the check.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
import gc, os
os.environ["STAND_IN_POOL_LIMIT"] = "8192"
queries = ctypes.c_ulong.in_dll(lib, "capture_queries")
cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
target, lent = cm.Stream(0), cm.Stream(0)
fired = []
class Lender:
    def __cuda_stream__(self):
        return (0, lent.handle)
    def __del__(self):
        fired.append((begin(target.handle, 2), queries.value))
lender = Lender()
cache.alloc(4096, lender).close()  # a block cached on the lent stream: the cache holds `lender`
del lender
class Other:
    def __init__(self, handle):
        self.handle = handle
    def __cuda_stream__(self):
        return (0, self.handle)
others = [cm.Stream(0) for _ in range(80)]
kept = [cm.Stream.borrow(Other(s.handle)) for s in others]  # the lent stream leaves the memo
gc.collect()
assert not fired
try:
    buffer = cache.alloc(8192, target.handle)  # full: the cache gives its block back, then retries
    print("allocated")
except cm.StreamCapturingError:
    print("refused")
assert fired and fired[0][0] == 0, fired
print(queries.value - fired[0][1])
""",
    )
    assert int(words[1]) >= 1, "the retry after a finalizer took the call's stale check"
    # The retry found the capture and allocated for it: graph memory, which no Buffer may hold.
    assert words[0] == "refused", words


def test_an_allocator_in_a_cycle_is_collected_copied_and_keeps_its_errors(stand_in_libcuda):
    # An out-of-memory callback that holds the allocator makes a cycle through the allocator's
    # native part; the collector must find it. A copy draws from the same resource. A failure
    # while CuPy's error is built keeps the out-of-memory as its context.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import copy, gc, weakref
pool = cm.MemPool(cm.Route.device(0))
def make():
    holder = []
    def on_oom(requested, attempt):
        holder[0].release_captured()
        return False
    allocator = cmc.Allocator(cm.OnOutOfMemory(cm.PoolResource(pool), on_oom))
    holder.append(allocator)
    return weakref.ref(allocator)
ref = make()
gc.collect()
print(ref() is None)
allocator = cmc.Allocator(cm.Limit(cm.PoolResource(pool), 4096))
allocator._elsewhere = print
copied = copy.copy(allocator)
print(copied.resource is allocator.resource and copied._elsewhere is print and copied._captured == [])
stream = cm.Stream(0)
current[0] = stream.handle
cupy.cuda.memory.OutOfMemoryError = None  # building CuPy's class fails
cmc._out_of_memory_class = None
try:
    allocator(8192)
except TypeError as error:
    print(type(error.__context__).__name__)
""",
    )
    assert words[0] == "True", "an allocator in a cycle was never collected"
    assert words[1] == "True", "a copy draws from another resource"
    assert words[2] == "LimitExceededError", "the out-of-memory was lost when CuPy's class could not be built"


def test_memory_held_when_the_allocator_ran_out_goes_back_without_the_collector(stand_in_libcuda):
    # A program fills the resource until CuPy's out-of-memory, then drops what it holds: the
    # memory goes back at once. The error must not keep the frames of the failed call alive
    # (a cycle through them waits for the garbage collector, and holds the program's arrays).
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import gc
gc.disable()
class CupyOutOfMemory(Exception):
    pass
cupy.cuda.memory.OutOfMemoryError = CupyOutOfMemory
stream = cm.Stream(0)
current[0] = stream.handle
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.Limit(cm.PoolResource(pool), 4 * 4096))
def fill():
    held = []
    try:
        while True:
            held.append(allocator(4096))
    except CupyOutOfMemory as error:
        return len(held), type(error).__name__
print(*fill())
print(pool.used_mem_current)
""",
    )
    assert words == ["4", "OutOfMemoryError", "0"], "the arrays held when the allocator ran out stayed alive"


def test_on_the_null_stream_a_block_the_cache_holds_is_served_beside_a_blocking_capture(stand_in_libcuda):
    # A block the cache keeps for the legacy stream is served with no work queued there, so a
    # blocking capture on another thread is no reason to refuse it (CuPy's own pool serves it
    # too): the capture stays intact, and no capture question is asked. A size the cache has
    # no block for needs the pool's work on the legacy stream, and is refused as before. (On
    # CuPy's per-thread stream the cache asks at every allocation, since that stream may
    # capture itself, and the question that covers it is the legacy stream's: refused.)
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
captures = ctypes.c_ulong.in_dll(lib, "capture_queries")
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
del_me = allocator(4096)
del del_me  # the cache keeps the block for the legacy stream
"""
        + ANOTHER_THREAD_CAPTURES
        + """
before = captures.value
try:
    served = allocator(4096)
    print("served", captures.value - before)
    del served
    allocator(1 << 20)
    print("allocated")
except cm.StreamCapturingError as error:
    print("refused", "null or per-thread default stream" in str(error))
finally:
    done.set()
    thread.join()
print(ended[0])
""",
    )
    assert words == ["served", "0", "refused", "True", "0"], words


def test_on_the_null_stream_a_miss_refused_beside_a_blocking_capture_is_reported_in_cupys_words_at_a_limit_too(
    stand_in_libcuda,
):
    # A limit below the cache: a miss within it reaches the pool, which refuses the legacy
    # stream's work for the blocking capture, and the plug-in says what was refused (an
    # allocation for CuPy on its null stream), not that a Buffer cannot hold a capture's memory
    # and the capturing library's plug-in should be used (this is that plug-in). A miss past
    # the limit is the limit's out-of-memory, as on any stream, also when the plug-in tries
    # again step by step after it.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
class CupysOutOfMemory(MemoryError):
    def __init__(self, size, total, limit=0):
        super().__init__(size)
cupy.cuda.memory.OutOfMemoryError = CupysOutOfMemory
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.Limit(cm.PoolResource(pool), 8192)))
"""
        + ANOTHER_THREAD_CAPTURES
        + """
try:
    for size in (4096, 1 << 20):
        try:
            allocator(size)
            print("allocated")
        except cm.StreamCapturingError as error:
            print("refused", "null or per-thread default stream" in str(error), "Resource.alloc" in str(error))
        except CupysOutOfMemory as error:
            print("out-of-memory", "limit of 8192 bytes" in str(error))
finally:
    done.set()
    thread.join()
print(ended[0])
""",
    )
    assert words == ["refused", "True", "False", "out-of-memory", "True", "0"], words


def test_with_recording_on_a_block_the_cache_holds_for_the_null_stream_is_served_beside_a_blocking_capture(
    stand_in_libcuda,
):
    # As the native call serves it (test above): recording must not change what is served.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(pool)))
del_me = allocator(4096)
del del_me  # the cache keeps the block for the legacy stream
cm.record_history(True)
"""
        + ANOTHER_THREAD_CAPTURES
        + """
try:
    served = allocator(4096)
    print("served")
    del served
except cm.StreamCapturingError:
    print("refused")
finally:
    done.set()
    thread.join()
print(ended[0])
""",
    )
    assert words == ["served", "0"], words


def test_a_cupy_pair_asks_two_capture_questions_on_its_own_stream_and_none_on_the_null_stream(stand_in_libcuda):
    # CuPy's stream is another library's, so whether it captures is asked at each step that
    # needs the answer: once at the allocation, which the cache answers with the block (a
    # capture goes to the Python steps), and once at the free. On CuPy's null stream a cache hit asks none (it queues no
    # work there, so a blocking capture elsewhere is no concern of it) and makes no other driver
    # call: one read of the current context says that CuPy's device is the resource's.
    # benchmarks.md states these counts.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
contexts = ctypes.c_ulong.in_dll(lib, "context_queries")
captures = ctypes.c_ulong.in_dll(lib, "capture_queries")
allocator = cmc.Allocator(cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0)))))
own = cm.Stream(0)
same[0] = FakeStream()
for handle in (own.handle, 0):
    current[0] = handle
    allocator(4096)  # the pool's block, then the cache's
    before = contexts.value, captures.value
    for _ in range(10):
        allocator(4096)
    print((contexts.value - before[0]) / 10, (captures.value - before[1]) / 10)
""",
    )
    own_stream, null_stream = words[:2], words[2:]
    assert own_stream[1] == "2.0", words
    assert null_stream == ["1.0", "0.0"], words


@pytest.mark.parametrize("default_stream", [0, 2], ids=["null stream", "per-thread stream"])
@pytest.mark.parametrize("source", ["pool", "cm.CachingResource(cm.PoolResource(pool), max_cached=1024)"])
def test_an_array_freed_on_a_default_stream_leaves_another_threads_blocking_capture_intact(
    stand_in_libcuda, default_stream, source
):
    # An array made on CuPy's null (or per-thread) stream before another thread begins
    # capturing its per-thread stream (a blocking stream), let go of while that capture runs:
    # its free goes to the legacy stream, which the capture blocks. It waits for the capture's
    # end, and runs at the next use of the legacy stream.
    words = _with_fake_cupy(
        stand_in_libcuda,
        f"current[0] = {default_stream}\npool = cm.MemPool(cm.Route.device(0))\nallocator = cmc.Allocator({source})\n"
        + """
array = allocator(4096)
"""
        + ANOTHER_THREAD_CAPTURES
        + """
del array
done.set()
thread.join()
del allocator
pool.alloc(16, None).close()  # the next use of the legacy stream, whichever Stream names it
print(ended[0], pool.used_mem_current)
""",
    )
    assert words == ["0", "0"], f"the free invalidated the other thread's capture, or was lost: {words}"


def test_release_captured_refuses_while_a_capture_it_could_invalidate_runs(stand_in_libcuda):
    # The wait for the device (cuCtxSynchronize) invalidates any capture of the context: while a
    # stream this allocator served a capture on still captures, or a blocking stream of the
    # device does (the per-thread stream here), release_captured refuses and keeps the memory.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
class OwnStream(FakeStream):  # a CuPy stream object of its own: its handle stays its own
    def __init__(self, handle):
        object.__setattr__(self, "handle_", handle)
    @property
    def ptr(self):
        return self.handle_
    def is_capturing(self):
        status = ctypes.c_int()
        assert capture_info(ctypes.c_void_p(self.ptr), ctypes.byref(status), *[None] * 5) == 0
        return status.value != 0
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(pool)
captured = capture()
same[0] = OwnStream(captured.handle)
kept = allocator(4096)  # served to the capture, kept for its graph
same[0] = None
try:
    allocator.release_captured()
    print("released")
except cm.StreamCapturingError:
    print("refused")
print(end_capture(captured), allocator.captured_bytes)
assert begin(2, 2) == 0  # the per-thread stream, blocking, relaxed mode
try:
    allocator.release_captured()
    print("released")
except cm.StreamCapturingError:
    print("refused")
graph = ctypes.c_void_p()
print(end(2, ctypes.byref(graph)), allocator.captured_bytes)
del kept
allocator.release_captured()
print(allocator.captured_bytes)
""",
    )
    assert words == ["refused", "0", "4096", "refused", "0", "4096", "0"], words


def test_memory_kept_for_graphs_outlives_the_allocator_that_kept_it(stand_in_libcuda):
    # An array a capture made holds only the allocator's lease, and the graph holds nothing of
    # cumempool's: an allocator collected before `release_captured` (a temporary given to
    # `cupy.cuda.using_allocator`) must not free what the array and the graph's launches use.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import gc
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(pool)
captured = capture()
escaped = allocator(4096)  # the graph's output, kept by the user
graph_only = allocator(8192)
del graph_only  # a temporary only the graph uses now
assert end_capture(captured) == 0
print(pool.used_mem_current)
del allocator
gc.collect()
print(pool.used_mem_current)
del escaped
gc.collect()
print(pool.used_mem_current)
""",
    )
    assert words == ["12288", "12288", "12288"], "memory a graph or an array still uses was freed with its allocator"


def test_a_closed_budget_keeps_the_memory_cupys_graphs_use(stand_in_libcuda):
    # `Budget.close()` puts CuPy's previous allocator back, and the budget's allocator goes with
    # the budget: the memory it kept for CuPy's graphs stays.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import gc
cupy.cuda.get_allocator = lambda: None
cupy.get_default_memory_pool = lambda: types.SimpleNamespace(malloc=None)
installed = []
cupy.cuda.set_allocator = installed.append
budget = cm.budget(1 << 30)
captured = capture()
escaped = installed[-1](4096)
assert end_capture(captured) == 0
pool = budget.pool(0)
print(pool.used_mem_current)
installed.clear()
budget.close()
del budget
gc.collect()
print(pool.used_mem_current)
""",
    )
    assert words == ["4096", "4096"], "the budget's teardown freed memory a captured CuPy array still uses"


def test_two_threads_releasing_captured_memory_at_once_do_not_fail(stand_in_libcuda):
    # release_captured removes what it gives back one entry at a time, from a copy of the list:
    # a call on another thread whose copy still holds an entry this one removed must neither
    # fail nor close the buffer again. `Gate` stands in for the weak reference only to order
    # the two threads (thread B stops right after taking its copy).
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
import threading
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(pool)
captured = capture()
leases = [allocator(256) for _ in range(4)]
assert end_capture(captured) == 0
del leases
b_in_loop, a_done, failures = threading.Event(), threading.Event(), []
class Gate:
    def __init__(self, ref):
        self.ref = ref
    def __call__(self):
        if threading.current_thread().name == "B" and not b_in_loop.is_set():
            b_in_loop.set()
            a_done.wait()
        return self.ref()
allocator._captured[:] = [(buffer, Gate(ref)) for buffer, ref in allocator._captured]
def release():
    try:
        allocator.release_captured()
    except Exception as error:
        failures.append(type(error).__name__)
b = threading.Thread(target=release, name="B")
b.start()
b_in_loop.wait()
release()  # thread A
a_done.set()
b.join()
print(failures or ["none"], pool.used_mem_current)
""",
    )
    assert words == ["['none']", "0"], words


@pytest.mark.parametrize("source", ["pool", "cache"])
def test_a_capture_of_the_calling_threads_per_thread_stream_goes_to_the_python_steps(stand_in_libcuda, source):
    # CuPy's current stream is its per-thread stream (handle 2), and this thread captures it
    # (`cupy.cuda.Stream.ptds.begin_capture()`): the native call cannot serve the capture (its
    # allocation would queue on the legacy stream, which the capture blocks), so it goes to the
    # Python steps, which keep memory of a side stream for the graph, as on any capturing
    # stream of CuPy's. Asked of the per-thread stream itself (it is a legacy stream's handle,
    # but one that may capture).
    words = _with_fake_cupy(
        stand_in_libcuda,
        f"SOURCE = {source!r}\n"
        + """
pool = cm.MemPool(cm.Route.device(0))
allocator = cmc.Allocator(pool if SOURCE == "pool" else cm.CachingResource(cm.PoolResource(pool)))
current[0] = 2
assert begin(2, 2) == 0  # the per-thread stream, blocking, relaxed mode
try:
    kept = allocator(4096)
    print("served", allocator.captured_bytes)
except cm.StreamCapturingError:
    print("refused")
graph = ctypes.c_void_p()
print(end(2, ctypes.byref(graph)))
kept = None
allocator.release_captured()
print(allocator.captured_bytes)
""",
    )
    assert words == ["served", "4096", "0", "0"], words


def test_a_free_a_capture_deferred_runs_at_the_next_native_call_on_cupys_stream(stand_in_libcuda):
    # An array freed while another library captures CuPy's stream waits, in the pool, for the
    # capture's end. The native call's next allocation on that stream, a cache hit included,
    # runs it, as Resource.alloc does: a stream the cache serves from then on reaches no pool
    # that would, and would hold that memory (of a pool other libraries may share under a
    # budget) for as long as every call hits.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
pool = cm.MemPool(cm.Route.device(0))
resource = cm.CachingResource(cm.PoolResource(pool))
allocator = cmc.Allocator(resource)
own = cm.Stream(0)
same[0] = FakeStream()
current[0] = own.handle
kept, cached = allocator(4096), allocator(4096)
del cached  # the cache keeps its block
assert begin(own.handle, 2) == 0
del kept  # during the capture: the pool's free waits for its end
graph = ctypes.c_void_p()
print(end(own.handle, ctypes.byref(graph)), pool.used_mem_current)
for _ in range(3):
    allocator(4096)  # served from the cache
print(pool.used_mem_current, resource.stats()["misses"])
""",
    )
    assert words == ["0", "8192", "4096", "2"], words
