"""A resource's alloc on a stream another library captures into a CUDA graph: on the GPU, and
on a host without one through the stand-in libcuda of the Rust tests
(tests/src/stand_in_driver.c), which models captures."""

import ctypes
import textwrap

import pytest

import cumempool as cm
from conftest import libcuda, run_on_driver


def capture_functions():
    """The driver, and its functions another library begins and ends a capture with."""
    cuda = libcuda()
    begin, end = cuda.cuStreamBeginCapture_v2, cuda.cuStreamEndCapture
    begin.argtypes = [ctypes.c_void_p, ctypes.c_int]
    end.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    cuda.cuGraphDestroy.argtypes = [ctypes.c_void_p]
    return cuda, begin, end


def test_a_resource_alloc_on_a_capturing_stream_is_refused(gpu, stream):
    # What alloc allocates on a capturing stream is the graph's memory (an allocation node): a
    # Buffer holding it would be freed outside the graph, refused before a launch (each launch
    # then allocating memory nothing frees) or unordered after one.
    cuda, begin, end = capture_functions()
    pool = cm.MemPool(cm.Route.device(0))
    cache = cm.CachingResource(cm.PoolResource(pool))
    handle = stream.handle
    assert begin(handle, 2) == 0  # relaxed, as another library's capture
    try:
        for resource in (cache, cm.PoolResource(pool)):
            with pytest.raises(cm.StreamCapturingError):
                resource.alloc(4096, handle)  # the lender's handle, as torch or CuPy pass it
    finally:
        graph = ctypes.c_void_p()
        ended = end(handle, ctypes.byref(graph))
        if graph.value:
            cuda.cuGraphDestroy(graph)
    assert ended == 0, "the refusal left the capture intact"
    assert pool.used_mem_current == 0
    cache.alloc(4096, stream).close()


# The stand-in's capture functions as another library calls them (`begin`, `end`): it hands its
# entry points out through cuGetProcAddress only.
STAND_IN_CAPTURE = """
import ctypes, os
import cumempool as cm
lib = ctypes.CDLL(os.environ["CUMEMPOOL_LIBCUDA"])
def entry(name, *argtypes):
    fn = ctypes.c_void_p()
    lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), 13000, ctypes.c_uint64(0), None)
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fn.value)
begin = entry("cuStreamBeginCapture", ctypes.c_void_p, ctypes.c_int)
end = entry("cuStreamEndCapture", ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
"""


# A cache over a pool, and a stream of cumempool's whose handle is lent (`handle`), as torch or
# CuPy pass theirs: a capture may begin on it at any time.
LENT_CACHE = """\
pool = cm.MemPool(cm.Route.device(0))
stream = cm.Stream(0)
handle = stream.handle
resource = cm.CachingResource(cm.PoolResource(pool))
"""


def run_on_stand_in(stand_in_libcuda, code):
    """Runs `code` (dedented, after STAND_IN_CAPTURE) on the stand-in driver; its stdout words."""
    return run_on_driver(stand_in_libcuda, STAND_IN_CAPTURE + textwrap.dedent(code))


def test_a_resource_alloc_on_a_capturing_stream_is_refused_on_the_stand_in(stand_in_libcuda):
    # As above, without a GPU. A Rust-side allocation would succeed on the stand-in, so only
    # the refusal shows.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        stream = cm.Stream(0)
        handle = stream.handle
        assert begin(handle, 2) == 0  # relaxed, as another library's capture
        for resource in (cm.CachingResource(cm.PoolResource(pool)), cm.PoolResource(pool)):
            try:
                resource.alloc(4096, handle)  # the lender's handle, as torch or CuPy pass it
                print("allocated")
            except cm.StreamCapturingError:
                print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), pool.used_mem_current)
        """,
    )
    assert words == ["refused", "refused", "0", "0"], "refused, the capture intact, nothing allocated"


def test_a_resource_pair_on_a_lent_stream_asks_two_capture_questions_on_the_stand_in(stand_in_libcuda):
    # A lent stream may capture at any time: an allocation through a cache asks once (the
    # refusal's question and the cache's are one), its free once; a capture is still refused,
    # and a pair after it is served again.
    words = run_on_stand_in(
        stand_in_libcuda,
        LENT_CACHE
        + textwrap.dedent(
            """
        captures = ctypes.c_ulong.in_dll(lib, "capture_queries")
        resource.alloc(4096, handle).close()
        before = captures.value
        for _ in range(10):
            resource.alloc(4096, handle).close()
        print((captures.value - before) / 10)
        assert begin(handle, 2) == 0
        try:
            resource.alloc(4096, handle)
            print("allocated")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)))
        resource.alloc(4096, handle).close()
        print(resource.release(), pool.used_mem_current)
        """
        ),
    )
    assert words[:3] == ["2.0", "refused", "0"], words
    assert words[-1] == "0", words


def test_adaptors_above_a_cache_ask_no_more_capture_questions_than_the_cache_on_the_stand_in(
    stand_in_libcuda,
):
    # Statistics, a limit and an out-of-memory callback above the cache hand the allocation's
    # one question down to it, instead of asking their own before the cache asks again.
    words = run_on_stand_in(
        stand_in_libcuda,
        LENT_CACHE
        + textwrap.dedent(
            """
        captures = ctypes.c_ulong.in_dll(lib, "capture_queries")
        stacks = {
            "Statistics": cm.Statistics(resource),
            "Limit": cm.Limit(resource, 1 << 30),
            "OnOutOfMemory": cm.OnOutOfMemory(resource, lambda size, attempt: False),
        }
        for name, stack in stacks.items():
            stack.alloc(4096, handle).close()
            before = captures.value
            for _ in range(10):
                stack.alloc(4096, handle).close()
            print(name, (captures.value - before) / 10)
        """
        ),
    )
    assert words == ["Statistics", "2.0", "Limit", "2.0", "OnOutOfMemory", "2.0"], words


def test_a_free_a_capture_deferred_runs_at_the_next_resource_alloc_on_the_stand_in(stand_in_libcuda):
    # A Buffer closed while another library captures its stream waits, in the pool, for the
    # capture's end. The next Resource.alloc on the stream, a cache hit included, runs it: a
    # stream served from the cache from then on would otherwise hold that memory (of a pool
    # other libraries may share under a budget) for as long as no call reaches the pool.
    words = run_on_stand_in(
        stand_in_libcuda,
        LENT_CACHE
        + textwrap.dedent(
            """
        kept, cached = resource.alloc(4096, handle), resource.alloc(4096, handle)
        cached.close()
        assert begin(handle, 2) == 0
        kept.close()  # during the capture: the pool's free waits for its end
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), pool.used_mem_current)
        for _ in range(3):
            resource.alloc(4096, handle).close()  # served from the cache
        print(pool.used_mem_current, resource.stats()["misses"])
        resource.release()
        print(pool.used_mem_current)
        """
        ),
    )
    assert words == ["0", "8192", "4096", "2", "0"], words


def test_a_capture_begun_after_the_second_question_is_refused_not_served_graph_memory(stand_in_libcuda):
    # The driver cannot answer the first question (the allocation's, inside the cache), so
    # Resource.alloc asks again for the reason: no capture. Right after that answer, a capture
    # begins on the stream. What is allocated next must not be graph memory in a Buffer: the
    # allocation asks once more and refuses.
    words = run_on_stand_in(
        stand_in_libcuda,
        LENT_CACHE
        + textwrap.dedent(
            """
        ctypes.c_int.in_dll(lib, "capture_queries_failing").value = 1
        ctypes.c_void_p.in_dll(lib, "capture_after_queries_of").value = handle
        ctypes.c_int.in_dll(lib, "capture_after_capture_queries").value = 1
        try:
            kept = resource.alloc(4096, handle)
            print("allocated")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), pool.used_mem_current)
        """
        ),
    )
    assert words == ["refused", "0", "0"], words


def test_frees_waiting_with_another_stream_cost_no_question_per_resource_alloc_on_the_stand_in(stand_in_libcuda):
    # A legacy-stream free that a blocking capture deferred waits with the legacy stream until
    # its next use. Meanwhile an allocation on a lent stream, which runs only its own stream's
    # waiting frees, must not pay a second capture question for them: still one question per
    # allocation (two per pair), however long the other stream's frees wait.
    words = run_on_stand_in(
        stand_in_libcuda,
        LENT_CACHE
        + textwrap.dedent(
            """
        captures = ctypes.c_ulong.in_dll(lib, "capture_queries")
        waiting = pool.alloc(4096)  # on the legacy stream
        assert begin(2, 1) == 0  # the per-thread stream, blocking, captures
        waiting.close()  # waits with the legacy stream
        graph = ctypes.c_void_p()
        assert end(2, ctypes.byref(graph)) == 0
        resource.alloc(4096, handle).close()
        before = captures.value
        for _ in range(10):
            resource.alloc(4096, handle).close()
        print((captures.value - before) / 10)
        resource.release()
        pool.alloc(16).close()  # the legacy stream's next use runs what waited there
        print(pool.used_mem_current)
        """
        ),
    )
    assert words == ["2.0", "0"], words


def test_a_capture_begun_by_an_out_of_memory_callback_is_refused_not_served_graph_memory(stand_in_libcuda):
    # The callback runs Python code between the allocation's capture question and the retry
    # below it: here it begins a capture on the stream and makes room. The retry's memory is
    # the graph's (an allocation node); a Buffer must not hold it: refused, and given back
    # inside the capture (a free node of its own graph), which stays intact.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        stream = cm.Stream(0)
        handle = stream.handle
        kept = []
        def on_oom(requested, attempt):
            if attempt > 1 or not kept:
                return False
            assert begin(handle, 2) == 0
            kept.pop().close()
            return True
        for resource in (
            cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 4096), on_oom),
            cm.CachingResource(cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 4096), on_oom)),
        ):
            kept.append(resource.alloc(4096, handle))
            try:
                b = resource.alloc(4096, handle)
                print("allocated")
                b.close()
            except cm.StreamCapturingError as e:
                print("refused", "::" not in str(e))
            graph = ctypes.c_void_p()
            print(end(handle, ctypes.byref(graph)))
        """,
    )
    assert words == ["refused", "True", "0", "refused", "True", "0"], "refused, in Python's words, the capture intact"


def test_a_spent_limit_refuses_a_capture_as_a_capture_and_runs_no_callback_on_the_stand_in(stand_in_libcuda):
    # A limit spent when a capture is underway answers as the capture does: StreamCapturingError,
    # not its out-of-memory, and an out-of-memory callback above runs no code inside the capture
    # for an allocation refused anyway.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        stream = cm.Stream(0)
        handle = stream.handle
        calls = []
        limit = cm.Limit(cm.PoolResource(pool), 4096)
        stack = cm.OnOutOfMemory(limit, lambda size, attempt: calls.append(size) or False)
        held = stack.alloc(4096, handle)
        assert begin(handle, 2) == 0  # relaxed, as another library's capture
        for resource in (limit, stack):
            try:
                resource.alloc(4096, handle)
                print("allocated")
            except cm.StreamCapturingError:
                print("refused")
            except MemoryError:
                print("out-of-memory")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), len(calls), limit.in_use)
        held.close()
        """,
    )
    assert words == ["refused", "refused", "0", "0", "4096"], words


@pytest.mark.xfail(
    strict=True,
    reason="known defect: Pool::alloc_raw asks the capture question before cuMemAllocFromPoolAsync; a "
    "capture begun between the two is not recorded (is_captured_allocation stays false), so no layer "
    "above can find the graph memory",
)
def test_a_capture_begun_right_after_the_pools_own_question_is_not_served_as_a_buffer(stand_in_libcuda):
    # The capture begins right after the second question (the pool's own, in Pool::alloc_raw),
    # before cuMemAllocFromPoolAsync: the memory is the graph's (an allocation node), yet the
    # core never recorded it, so Resource.alloc hands it out as a Buffer.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        stream = cm.Stream(0)
        handle = stream.handle
        resource = cm.PoolResource(pool)
        ctypes.c_void_p.in_dll(lib, "capture_after_queries_of").value = handle
        ctypes.c_int.in_dll(lib, "capture_after_capture_queries").value = 2
        try:
            kept = resource.alloc(4096, handle)
            print("allocated")
        except cm.StreamCapturingError:
            print("refused")
        graph = ctypes.c_void_p()
        print(end(handle, ctypes.byref(graph)), pool.used_mem_current)
        """,
    )
    assert words[0] == "refused", words


def test_an_allocation_on_the_per_thread_stream_through_a_cache_leaves_the_callers_context_current(
    stand_in_libcuda,
):
    # The per-thread stream is served on its device's legacy stream, and a cache (or a limit)
    # asks whether it captures: that question must leave the caller's context current (here
    # none), as the pool's own calls do, not the stream's.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        set_current = lib.cuCtxSetCurrent
        set_current.argtypes = [ctypes.c_void_p]
        get_current = lib.cuCtxGetCurrent
        get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        for resource in (
            cm.PoolResource(pool),
            cm.CachingResource(cm.PoolResource(pool)),
            cm.Limit(cm.CachingResource(cm.PoolResource(pool)), 1 << 20),
        ):
            for handle in (2, 0, 2):
                assert set_current(None) == 0
                b = resource.alloc(4096, handle)
                ctx = ctypes.c_void_p()
                assert get_current(ctypes.byref(ctx)) == 0
                print("none" if not ctx.value else "set")
                assert set_current(None) == 0
                b.close()
        """,
    )
    assert words == ["none"] * 9, words
