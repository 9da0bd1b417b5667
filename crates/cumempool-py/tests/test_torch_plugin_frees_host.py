"""When the PyTorch plug-in gives memory back, on the stand-in libcuda (no GPU, no torch): its
exported functions called as PyTorch's caching allocator calls them, around captures the
stand-in models."""

from test_resource_alloc_under_capture import run_on_stand_in

# The plug-in's C functions (`lib`), serving a pool (`pool`, `cmt`), and the stand-in's log of
# the calls that order work (`logged()`: the first word of each line since `mark()`).
SETUP = """
import cumempool.torch as cmt
lib = ctypes.CDLL(cm.native_library_path())
lib.cumempool_torch_alloc.restype = ctypes.c_void_p
lib.cumempool_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.cumempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
pool = cm.MemPool(cm.Route.device(0))
cmt.serve(pool)
stream = cm.Stream(0)
h = stream.handle
MIB = 1 << 20
log = ctypes.c_char * (1 << 16)
def text():
    length = ctypes.c_int.in_dll(lib_cuda, "call_log_len").value
    return log.in_dll(lib_cuda, "call_log").raw[:length].decode()
lib_cuda = ctypes.CDLL(os.environ["CUMEMPOOL_LIBCUDA"])
start = [0]
def mark():
    start[0] = len(text())
def logged():
    return [line.split()[0] for line in text()[start[0]:].splitlines()]
def end_capture(handle):
    graph = ctypes.c_void_p()
    return end(handle, ctypes.byref(graph))
"""


def _run(stand_in_libcuda, code):
    """Runs `code` after SETUP on the stand-in driver; its stdout words."""
    return run_on_stand_in(stand_in_libcuda, SETUP + code)


def test_a_free_waits_for_the_device_first(stand_in_libcuda):
    # A graph replayed on another stream may still read a segment PyTorch frees: the plug-in
    # waits for the whole device before the memory goes back, as PyTorch's cudaFree does.
    words = _run(
        stand_in_libcuda,
        """
p = lib.cumempool_torch_alloc(MIB, 0, h)
mark()
lib.cumempool_torch_free(p, MIB, 0, h)
print(" ".join(word for word in logged() if word in ("ctxsync", "free")), pool.used_mem_current)
""",
    )
    assert words == ["ctxsync", "free", "0"], "the memory went back before the device was waited for"


def test_a_free_during_a_capture_is_kept_until_release_captured(stand_in_libcuda):
    # PyTorch's out-of-memory retry can free a segment while its stream captures; the graph may
    # use it at every launch, so it must not go back when the capture ends.
    words = _run(
        stand_in_libcuda,
        """
p = lib.cumempool_torch_alloc(MIB, 0, h)
assert begin(h, 2) == 0  # relaxed, as PyTorch's allocator runs inside its capture
lib.cumempool_torch_free(p, MIB, 0, h)
print(end_capture(h))
q = lib.cumempool_torch_alloc(64, 0, h)  # the stream is used again after the capture
lib.cumempool_torch_free(q, 64, 0, h)
print(pool.used_mem_current, cmt.captured_bytes())
print(cmt.release_captured(), pool.used_mem_current, cmt.captured_bytes())
""",
    )
    assert words[0] == "0", "the capture was invalidated"
    assert words[1:3] == [str(1 << 20), str(1 << 20)], "the memory a capture freed went back with the graph still to run"
    assert words[3:] == [str(1 << 20), "0", "0"], "release_captured did not give it back"


def test_a_free_while_another_stream_captures_is_kept_and_released_after(stand_in_libcuda):
    # Waiting for the device would invalidate a capture underway on it (the driver refuses the
    # wait and invalidates the capture, in every mode): while a stream the plug-in saw capturing
    # still captures, the free is kept, and release_captured refuses, leaving the capture intact.
    words = _run(
        stand_in_libcuda,
        """
other = cm.Stream(0)
p = lib.cumempool_torch_alloc(MIB, 0, h)
assert begin(other.handle, 2) == 0
q = lib.cumempool_torch_alloc(64, 0, other.handle)  # the capture asks the plug-in for memory
lib.cumempool_torch_free(p, MIB, 0, h)
print(pool.used_mem_current - 64)
try:
    cmt.release_captured()
except cm.StreamCapturingError:
    print("refused")
print(cmt.captured_bytes(), end_capture(other.handle))
print(cmt.release_captured(), pool.used_mem_current - 64)
""",
    )
    assert words[0] == str(1 << 20), "the memory went back without waiting for the device"
    assert words[1] == "refused", words
    assert words[2:] == [str(1 << 20), "0", str(1 << 20), "0"], "the capture was invalidated, or the memory not given back"


def test_a_free_while_a_blocking_stream_captures_is_kept(stand_in_libcuda):
    # A capture on a blocking stream (CuPy's streams, the per-thread stream) that never asked
    # the plug-in for memory is seen through the legacy stream, which answers without harm.
    words = _run(
        stand_in_libcuda,
        """
p = lib.cumempool_torch_alloc(MIB, 0, h)
assert begin(2, 0) == 0  # this thread's per-thread stream, global mode
lib.cumempool_torch_free(p, MIB, 0, h)
print(pool.used_mem_current, end_capture(2))
print(cmt.release_captured(), pool.used_mem_current)
""",
    )
    assert words == [str(1 << 20), "0", str(1 << 20), "0"], "the wait invalidated a blocking stream's capture"


def test_a_stream_that_captured_and_was_destroyed_does_not_keep_later_frees(stand_in_libcuda):
    # The plug-in asks again, before each free, every stream it saw capturing. A stream its
    # lender destroyed since cannot be asked: it is forgotten, not taken for a capture that
    # would keep every later free of the device.
    words = _run(
        stand_in_libcuda,
        """
lent = cm.Stream(0)
assert begin(lent.handle, 2) == 0
q = lib.cumempool_torch_alloc(64, 0, lent.handle)  # seen capturing
assert end_capture(lent.handle) == 0
lib.cumempool_torch_free(q, 64, 0, lent.handle)
import gc
lent.close()
del lent  # the lender destroys it
gc.collect()
p = lib.cumempool_torch_alloc(MIB, 0, h)
lib.cumempool_torch_free(p, MIB, 0, h)
print(pool.used_mem_current, cmt.captured_bytes(), cmt.release_captured())
""",
    )
    assert words == ["0", "0", "0"], "a destroyed stream kept the device's frees"


def test_an_allocation_beside_a_blocking_streams_capture_keeps_it_intact(stand_in_libcuda):
    # While a blocking stream captures (CuPy's streams, a per-thread stream), PyTorch's allocation
    # on its default stream is made beside the capture, on the plug-in's side stream, so that the
    # capture is left intact. A cache over a Limit that refuses it would give its cached blocks
    # back to make room, each on the stream it was freed on: a block PyTorch freed on its default
    # stream would go back on the legacy stream, which the driver refuses while a blocking stream
    # captures, invalidating that capture (driver 580; the stand-in models it), and the refused
    # block would be lost. The cache keeps that block instead, and the allocation that needed the
    # room is refused for lack of memory.
    words = _run(
        stand_in_libcuda,
        """
cache = cm.CachingResource(cm.Limit(cm.PoolResource(pool), 2 * MIB))
cmt.serve(cache)
p = lib.cumempool_torch_alloc(MIB, 0, None)  # PyTorch's default stream
lib.cumempool_torch_free(p, MIB, 0, None)    # a segment given back: cached, on the legacy stream
print(cache.stats()["cached_blocks"])
assert begin(2, 2) == 0  # this thread's per-thread stream (a blocking stream), relaxed mode
small = lib.cumempool_torch_alloc(MIB // 2, 0, None)  # control: fits under the limit
big = lib.cumempool_torch_alloc(MIB + MIB // 2, 0, None)  # needs the cached block's room
print(bool(small), bool(big), end_capture(2))
lib.cumempool_torch_free(small, MIB // 2, 0, None)
if big:
    lib.cumempool_torch_free(big, MIB + MIB // 2, 0, None)
cache.release()
print(cmt.captured_bytes(), pool.used_mem_current)
cmt.stop()
""",
    )
    assert words[:3] == ["1", "True", "False"], "the control served, the one needing room refused"
    assert words[3] == "0", "the plug-in's allocation beside the capture invalidated it (901)"
    assert words[4:] == ["0", "0"], "memory is left in the pool after every block was freed and released"


def test_a_capture_begun_after_the_plug_ins_question_gets_memory_beside_it_not_graph_memory(stand_in_libcuda):
    # Right after the plug-in asks whether PyTorch's stream captures (no), a capture begins on
    # it (another thread's, or Python code a finalizer or an out-of-memory callback ran). The
    # pool's allocation is then the graph's (an allocation node), which PyTorch's caching
    # allocator would hand to tensors outside the graph: it is given back inside the capture,
    # and the memory allocated beside the capture instead (on the side stream, waited for), as
    # for a capture seen at the question.
    words = _run(
        stand_in_libcuda,
        """
ctypes.c_void_p.in_dll(lib_cuda, "capture_after_queries_of").value = h
ctypes.c_int.in_dll(lib_cuda, "capture_after_capture_queries").value = 1
mark()
p = lib.cumempool_torch_alloc(MIB, 0, h)
print("sync" in logged())
print(end_capture(h))
before = pool.used_mem_current
lib.cumempool_torch_free(p, MIB, 0, h)
print(before - pool.used_mem_current)
""",
    )
    # The graph's own allocation, given back by a free node of its capture, is the graph's to
    # free at its launch: only the memory PyTorch got is counted here.
    assert words == ["True", "0", str(1 << 20)], words
