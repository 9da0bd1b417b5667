"""What test_contexts.py and test_stream_memo.py check, and more, shown on a host without a
GPU: each scenario runs in a process whose driver is the stand-in libcuda of the Rust tests
(tests/src/stand_in_driver.c, the `stand_in_libcuda` fixture). It keeps a current context per
thread, hands a destroyed stream's handle to the next new stream (as the driver often does) and
answers every function it does not model with success. Each scenario checks first that the path
the bindings already guard behaves, so a failure is the bindings', not the stand-in's."""

import textwrap

from conftest import run_on_driver

# What every scenario starts with: the stand-in's own context functions, and a context of the
# caller's own made current (what CuPy or a runtime user on another device looks like).
PRELUDE = """
import ctypes, gc, os, weakref
import cumempool as cm
cuda = ctypes.CDLL(os.environ["CUMEMPOOL_LIBCUDA"])
def current():
    c = ctypes.c_void_p(); assert cuda.cuCtxGetCurrent(ctypes.byref(c)) == 0; return c.value
device, mine = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(mine), 0, device) == 0
def mine_current():
    return current() == mine.value
class Lender:
    def __init__(self, stream): self.stream = stream
    def close(self): self.stream = None
    def __cuda_stream__(self):
        if self.stream is None: raise RuntimeError("this stream is closed")
        return (0, self.stream.handle)
pool = cm.MemPool(cm.Route.device(0))
"""


def _run(stand_in_libcuda, scenario):
    """Runs `scenario` after PRELUDE on the stand-in driver; its stdout lines."""
    return run_on_driver(stand_in_libcuda, PRELUDE + textwrap.dedent(scenario))


def _run_after(stand_in_libcuda, setup, scenario):
    """Runs `scenario` after PRELUDE and `setup` (both unindented) on the stand-in driver."""
    return _run(stand_in_libcuda, setup + textwrap.dedent(scenario))


# The plug-in's exported C functions as PyTorch calls them (`lib`), and the plug-in (`cmt`).
TORCH_FUNCTIONS = """
import cumempool.torch as cmt
lib = ctypes.CDLL(cm.native_library_path())
lib.cumempool_torch_alloc.restype = ctypes.c_void_p
lib.cumempool_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.cumempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
"""


def test_a_new_stream_puts_back_the_callers_context(stand_in_libcuda):
    # test_contexts.py::test_creating_a_stream_puts_back_the_callers_context
    lines = _run(
        stand_in_libcuda,
        """
        pool.alloc(64).close()
        print(mine_current())  # control: a legacy-stream alloc and free put it back
        cm.Stream(0)
        print(mine_current())
        """,
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "Stream(0) left the primary context current"


def test_a_capsules_last_free_puts_back_the_callers_context(stand_in_libcuda):
    # test_contexts.py::test_a_capsule_freeing_the_last_of_a_legacy_buffer_puts_back_...
    lines = _run(
        stand_in_libcuda,
        """
        buffer = pool.alloc(4096)
        capsule = buffer.__dlpack__(stream=-1)
        buffer.close()
        print(mine_current())  # control
        del capsule
        print(mine_current())
        """,
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "the capsule's free left the primary context current"


def test_a_caches_release_puts_back_the_callers_context(stand_in_libcuda):
    # test_contexts.py::test_a_cache_giving_legacy_blocks_back_puts_back_the_callers_context
    lines = _run(
        stand_in_libcuda,
        """
        cache = cm.CachingResource(cm.PoolResource(pool))
        cache.alloc(4096).close()
        print(cache.stats()["cached_blocks"], mine_current())  # control
        cache.release()
        print(mine_current())
        """,
    )
    assert lines[:2] == ["1", "True"]
    assert lines[2] == "True", "release() left the primary context current"


def test_a_cache_giving_legacy_blocks_back_for_another_stream_puts_back_the_callers_context(stand_in_libcuda):
    # The blocks go back inside an allocation on another (ordinary) stream: the limit below
    # refuses it, and the cache gives its legacy-stream block back to make room; later the
    # cache is collected with a block kept.
    lines = _run(
        stand_in_libcuda,
        """
        cache = cm.CachingResource(cm.Limit(cm.PoolResource(pool), 4096))
        stream = cm.Stream(0)
        cuda.cuCtxSetCurrent(mine)
        cache.alloc(4096).close()
        print(cache.stats()["cached_blocks"], mine_current())  # control
        buffer = cache.alloc(4096, stream)
        print(cache.stats()["cached_blocks"], mine_current())
        buffer.close()
        cache.alloc(4096).close()
        del cache, buffer
        gc.collect()
        print(mine_current())
        """,
    )
    assert lines[:2] == ["1", "True"]
    assert lines[2:4] == ["0", "True"], "making room for another stream left the primary context current"
    assert lines[4] == "True", "collecting the cache left the primary context current"


def test_the_torch_functions_put_back_the_callers_context_on_any_host(stand_in_libcuda):
    # test_contexts.py::test_the_torch_functions_put_back_the_callers_context
    lines = _run_after(
        stand_in_libcuda,
        TORCH_FUNCTIONS,
        """
        cmt.serve(pool)
        p = lib.cumempool_torch_alloc(1 << 20, 0, None)
        print(bool(p), mine_current())
        cuda.cuCtxSetCurrent(mine)
        lib.cumempool_torch_free(p, 1 << 20, 0, None)
        print(cmt.statistics()["current_count"], mine_current())
        """,
    )
    assert lines[0] == "True" and lines[2] == "0"  # control: served and given back
    assert (lines[1], lines[3]) == ("True", "True"), "(after alloc, after free) the caller's context was current"


def test_a_torch_allocation_of_zero_bytes_is_not_kept(stand_in_libcuda):
    # PyTorch passes size 0 for an empty tensor and never frees the null it gets back: an entry
    # kept for it would count for ever and keep the served resource alive after stop().
    lines = _run_after(
        stand_in_libcuda,
        TORCH_FUNCTIONS,
        """
        # The served cache keeps a block for the lender's stream, so holds the lender: the
        # lender lives exactly as long as the cache.
        lender = Lender(cm.Stream(0))
        kept = weakref.ref(lender)
        cache = cm.CachingResource(cm.PoolResource(pool))
        cache.alloc(64, lender).close()
        stats = cmt.serve(cache)
        p = lib.cumempool_torch_alloc(64, 0, None)
        lib.cumempool_torch_free(p, 64, 0, None)
        print(stats.usage()["current_count"])  # control: a pair leaves nothing counted
        print(lib.cumempool_torch_alloc(0, 0, None))
        print(stats.usage()["current_count"])
        cmt.stop()
        del cache, stats, lender
        cm.Stream.borrow(Lender(cm.Stream(0)))  # the bindings' memo of recent lenders moves on
        gc.collect()
        print(kept() is None)
        """,
    )
    assert lines[0] == "0"
    assert lines[1] == "None", "an empty allocation is the null pointer"
    assert lines[2] == "0", "the empty allocation is counted as live"
    assert lines[3] == "True", "the served resource outlived stop() through the empty allocation"


def test_the_cupy_allocator_refuses_a_device_it_does_not_serve(stand_in_libcuda):
    # Under `with cupy.cuda.Device(1)`, CuPy's null stream names no device, and the memory would
    # be the resource's device's, ordered on that device's legacy stream, while CuPy runs on 1.
    lines = _run(
        stand_in_libcuda,
        """
        import sys, types
        import cumempool.cupy as cmc
        current = [0]
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: current[0]),
            get_current_stream=lambda: None,
            UnownedMemory=lambda ptr, size, owner, device: (ptr, size, owner, device),
            MemoryPointer=lambda memory, offset: memory,
        )
        sys.modules["cupy"] = cupy
        allocator = cmc.Allocator(pool)
        print(allocator(64)[3])  # control: device 0 is served
        current[0] = 1
        try:
            allocator(64)
            print("served")
        except cm.InvalidDeviceError as error:
            print("refused", "device 1" in str(error) and "device 0" in str(error))
        """,
    )
    assert lines[0] == "0"
    assert lines[1:] == ["refused", "True"], "memory of device 0 was handed to CuPy running on device 1"


def test_the_cupy_allocator_asks_cupy_its_device_only_where_another_context_is_current(stand_in_libcuda):
    # CuPy's current device is the runtime's, which is the current context's device: where the
    # resource's device's primary context is current (as CuPy leaves it), the plug-in knows the
    # device without calling CuPy; with a context of another device current, CuPy is asked, and
    # a device the resource does not serve is refused.
    lines = _run(
        stand_in_libcuda,
        """
        import sys, types
        import cumempool.cupy as cmc
        cupys_device, asked = [0], []
        def get_device():
            asked.append(cupys_device[0])
            return cupys_device[0]
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=get_device),
            get_current_stream=lambda: None,
            UnownedMemory=lambda ptr, size, owner, device: (ptr, size, owner, device),
            MemoryPointer=lambda memory, offset: memory,
        )
        sys.modules["cupy"] = cupy
        allocator = cmc.Allocator(pool)
        print(allocator(64)[3], len(asked), mine_current())  # `mine` current: CuPy is asked
        retain = ctypes.c_void_p()  # handed out through cuGetProcAddress only
        cuda.cuGetProcAddress_v2(b"cuDevicePrimaryCtxRetain", ctypes.byref(retain), 13000, ctypes.c_uint64(0), None)
        primary = ctypes.c_void_p()
        retain = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)(retain.value)
        assert retain(ctypes.byref(primary), device) == 0
        assert cuda.cuCtxSetCurrent(primary) == 0
        kept = [allocator(64) for _ in range(3)]
        print(kept[-1][3], len(asked), current() == primary.value)
        assert cuda.cuCtxSetCurrent(mine) == 0
        cupys_device[0] = 1  # CuPy on another device, whose context `mine` stands for
        try:
            allocator(64)
            print("served")
        except cm.InvalidDeviceError:
            print("refused", len(asked))
        """,
    )
    assert lines[:3] == ["0", "1", "True"], lines
    assert lines[3:6] == ["0", "1", "True"], "CuPy was asked its device while the device's primary context was current"
    assert lines[6] == "refused" and int(lines[7]) > 1, "a context of another device current, CuPy was not asked"


def test_the_cupy_allocators_argument_errors_name_the_class_users_call(stand_in_libcuda):
    # Its call and `malloc` are its native base's: their argument errors name `Allocator`, the
    # class users make, not the base's name in the native module.
    lines = _run(
        stand_in_libcuda,
        """
        import sys, types
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: 0), get_current_stream=lambda: None,
            UnownedMemory=lambda *fields: fields, MemoryPointer=lambda memory, offset: memory,
        )
        sys.modules["cupy"] = cupy
        import cumempool.cupy as cmc
        allocator = cmc.Allocator(pool)
        for call in (allocator.malloc, allocator):
            try:
                call()
            except TypeError as error:
                print(str(error).split("(")[0])
        """,
    )
    assert lines == ["Allocator.malloc", "Allocator.__call__"], lines


def test_the_cupy_allocators_common_case_is_served_natively_and_freed_with_cupys_object(stand_in_libcuda):
    # CuPy's device current, a stream that does not capture, no recording: one native call
    # serves it (the Python steps, which would ask CuPy's stream, are not taken), and the
    # memory goes back when CuPy's memory object does.
    lines = _run(
        stand_in_libcuda,
        """
        import sys, types
        import cumempool.cupy as cmc
        class Stream:
            ptr = 2  # the per-thread stream: the Python steps would ask it whether it captures
            def is_capturing(self):
                raise AssertionError("the Python steps ran")
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=Stream,
            UnownedMemory=lambda ptr, size, owner, device: [ptr, size, owner, device],
            MemoryPointer=lambda memory, offset: memory,
        )
        sys.modules["cupy"] = cupy
        stats = cm.Statistics(cm.PoolResource(pool))
        allocator = cmc.Allocator(stats)
        memory = allocator(256)
        print(memory[1], memory[3], memory[0] == memory[2].ptr, stats.usage()["current_bytes"])
        del memory
        gc.collect()
        print(stats.usage()["current_bytes"])
        cm.record_history(stacks=None)
        try:
            allocator(256)
        except AssertionError as error:
            print("recording takes the Python steps:", error)
        """,
    )
    assert lines[:4] == ["256", "0", "True", "256"]
    assert lines[4] == "0", "the memory outlived CuPy's object"
    assert " ".join(lines[5:]) == "recording takes the Python steps: the Python steps ran"


def test_wrong_exports_and_streams_are_refused_in_plain_words(stand_in_libcuda):
    lines = _run(
        stand_in_libcuda,
        """
        buffer = pool.alloc(64)
        try:
            buffer.__dlpack__(dl_device=(1, 0))
        except BufferError as error:
            print("Some(" not in str(error), "(1, 0)" in str(error))
        for device in (None, 0):
            try:
                cm.Stream.borrow(True, device=device)
                print("borrowed")
            except TypeError:
                print("refused")
        buffer.close()
        """,
    )
    assert lines[:2] == ["True", "True"], "the refused DLPack device is shown as Rust's Option"
    assert lines[2:] == ["refused", "refused"], "Stream.borrow(True, device=0) took True for the legacy stream"


def test_a_device_pickles_as_its_ordinal(stand_in_libcuda):
    lines = _run(
        stand_in_libcuda,
        """
        import pickle
        again = pickle.loads(pickle.dumps(cm.Device(0)))
        print(type(again).__name__, again.ordinal, again == cm.Device(0))
        """,
    )
    assert lines == ["Device", "0", "True"]


def test_a_new_stream_with_a_reused_handle_is_held_by_its_buffers(stand_in_libcuda):
    # test_stream_memo.py::test_a_new_stream_with_a_closed_streams_handle_is_held_by_its_buffers
    lines = _run(
        stand_in_libcuda,
        """
        first = Lender(cm.Stream(0))
        handle = first.stream.handle
        kept = cm.Stream.borrow(first)
        first.close()
        fresh = cm.Stream(0)
        print(fresh.handle == handle)  # control: the stand-in gave the handle out again
        second = Lender(fresh)
        buffer = pool.alloc(4096, second)
        print(buffer.stream.owner is second)
        buffer.close()
        """,
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "the buffer holds the closed stream's object, not its own stream's"


def test_a_closed_stream_object_is_asked_for_its_handle(stand_in_libcuda):
    # test_stream_memo.py::test_a_closed_stream_object_passed_again_is_asked_for_its_handle
    lines = _run(
        stand_in_libcuda,
        """
        first = Lender(cm.Stream(0))
        kept = cm.Stream.borrow(first)
        first.close()
        fresh = cm.Stream(0)  # takes the closed stream's handle
        try:
            pool.alloc(4096, Lender(None))
        except RuntimeError:
            print("raised")  # control: a closed object the memo does not know raises
        try:
            pool.alloc(4096, first).close()
            print("allocated")
        except RuntimeError:
            print("raised")
        """,
    )
    assert lines[0] == "raised"
    assert lines[1] == "raised", "a closed stream object was answered with its old Stream"


def test_a_borrowed_and_dropped_stream_lets_go_of_its_lender(stand_in_libcuda):
    # test_stream_memo.py::test_a_stream_borrowed_and_dropped_lets_go_of_its_lender
    lines = _run(
        stand_in_libcuda,
        """
        stats = cm.Statistics(cm.PoolResource(pool))
        lender = Lender(cm.Stream(0)); lent = weakref.ref(lender)
        stats.alloc(256, lender).close(); del lender; gc.collect()
        print(lent() is None)  # control: a buffer's close lets go of it
        lender = Lender(cm.Stream(0)); lent = weakref.ref(lender)
        cm.Stream.borrow(lender); del lender
        cm.Stream.borrow(Lender(cm.Stream(0)))  # another lend (a miss)
        gc.collect()
        print(lent() is None)
        """,
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "the memo still holds a lender whose Stream was dropped"


def test_a_capsules_last_free_lets_go_of_the_lender(stand_in_libcuda):
    # test_stream_memo.py::test_a_lent_stream_is_let_go_of_when_a_capsule_frees_the_last_buffer
    lines = _run(
        stand_in_libcuda,
        """
        stats = cm.Statistics(cm.PoolResource(pool))
        lender = Lender(cm.Stream(0)); lent = weakref.ref(lender)
        buffer = stats.alloc(256, lender)
        capsule = buffer.__dlpack__(stream=-1)
        buffer.close(); del buffer, lender, capsule
        print(stats.usage()["current_count"])  # control: the capsule gave the memory back
        cm.Stream.borrow(Lender(cm.Stream(0)))  # another lend (a miss)
        gc.collect()
        print(lent() is None)
        """,
    )
    assert lines[0] == "0"
    assert lines[1] == "True", "the memo still holds the lender after the capsule gave the memory back"


def test_a_buffer_copied_into_itself_is_refused_on_any_host(stand_in_libcuda):
    # test_buffers.py::test_a_buffer_copied_into_itself_is_refused_before_the_driver
    lines = _run(
        stand_in_libcuda,
        """
        buffer, other = pool.alloc(64), pool.alloc(64)
        other.copy_from_buffer(buffer)
        print("copied")  # control: separate buffers copy
        try:
            buffer.copy_from_buffer(buffer)
            print("copied")
        except cm.OverlappingCopyError as error:
            print("refused", isinstance(error, ValueError))
        """,
    )
    assert lines[0] == "copied"
    assert lines[1:] == ["refused", "True"], "an overlapping copy reached the driver"


# A DLPack consumer that took the tensor (renamed the capsule) and calls its deleter without
# the GIL (a ctypes CFUNCTYPE call releases it), as PyTorch may from any thread.
CONSUMER = """
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
USED = b"used_dltensor"
def consume(capsule):
    managed = api.PyCapsule_GetPointer(capsule, b"dltensor")
    assert api.PyCapsule_SetName(capsule, USED) == 0
    # DLManagedTensor: a 48-byte DLTensor, manager_ctx, then the deleter.
    address = ctypes.c_void_p.from_address(managed + 56).value
    return lambda: ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)(managed)
"""


def test_a_consumers_deleter_without_the_gil_puts_back_the_callers_context(stand_in_libcuda):
    lines = _run(
        stand_in_libcuda,
        CONSUMER
        + """
buffer = pool.alloc(4096)
delete = consume(buffer.__dlpack__(stream=-1))
buffer.close()
print(mine_current())  # control
delete()
print(mine_current())
""",
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "the consumer's deleter left the primary context current"


def test_a_consumers_deleter_without_the_gil_lets_go_of_the_lender(stand_in_libcuda):
    lines = _run(
        stand_in_libcuda,
        CONSUMER
        + """
stats = cm.Statistics(cm.PoolResource(pool))
lender = Lender(cm.Stream(0)); lent = weakref.ref(lender)
buffer = stats.alloc(256, lender)
delete = consume(buffer.__dlpack__(stream=-1))
buffer.close(); del buffer, lender
delete()
print(stats.usage()["current_count"])  # control: the deleter gave the memory back
cm.Stream.borrow(Lender(cm.Stream(0)))  # another lend (a miss)
gc.collect()
print(lent() is None)
""",
    )
    assert lines[0] == "0"
    assert lines[1] == "True", "the memo still holds the lender after a consumer gave the memory back"


def test_a_buffers_memory_goes_back_once_when_its_last_holder_lets_go(stand_in_libcuda):
    # The GPU tests of test_lifetimes.py, on any host: whichever of the pool, the resource,
    # the Buffer, an array view and a DLPack consumer lets go first, the memory goes back to
    # the resource it came from exactly once, and only when the last of them lets go.
    lines = _run(
        stand_in_libcuda,
        CONSUMER
        + """
stats = cm.Statistics(cm.PoolResource(pool))
count = lambda: stats.usage()["current_count"]
buffer = stats.alloc(64); buffer.close()
print(count())  # control: a plain close gives it back
buffer = stats.alloc(64)
pool.close(); gc.collect()
buffer.close()
print(count())  # the pool's object closed first
limit = cm.Limit(stats, 1 << 20)
buffer = limit.alloc(64)
del limit; gc.collect()
buffer.close()
print(count())  # the object of the resource it came from collected first
buffer = stats.alloc(64)
buffer.__cuda_array_interface__
capsule = buffer.__dlpack__(stream=-1)
buffer.close()
print(count())  # an array view and a capsule hold it
del capsule; gc.collect()
print(count())  # the view still holds it
del buffer; gc.collect()
print(count())
buffer = stats.alloc(64)
delete = consume(buffer.__dlpack__(stream=-1))
buffer.close(stream=cm.Stream(0))
print(count())  # a consumer holds it past a close ordered after another stream
delete()
print(count())
""",
    )
    assert lines[0] == "0"
    assert lines[1:3] == ["0", "0"], "memory was not given back after its pool or resource object went first"
    assert lines[3:6] == ["1", "1", "0"], "(after close, capsule, buffer) memory went back too early or not at all"
    assert lines[6:8] == ["1", "0"], "a close with a stream did not leave the memory to the consumer"


def test_errors_carry_the_rust_reason_or_none_on_any_host(stand_in_libcuda):
    # The reason's name is the Rust enum variant's (`NotShareableReason::NotPoolMemory`);
    # errors without one, such as ClosedError, carry None.
    lines = _run(
        stand_in_libcuda,
        """
stats = cm.Statistics(cm.PoolResource(pool))
buffer = stats.alloc(64)
try:
    buffer.export()
except cm.NotShareableError as error:
    print(error.reason)
buffer.close()
try:
    buffer.to_bytes()
except cm.ClosedError as error:
    print(error.reason)
""",
    )
    assert lines == ["NotPoolMemory", "None"], lines


def test_the_torch_functions_put_back_the_callers_context_on_the_per_thread_stream(stand_in_libcuda):
    # As test_the_torch_functions_put_back_the_callers_context_on_any_host, on
    # CU_STREAM_PER_THREAD (2) too, a handle the plug-in serves: the question whether the calling
    # thread's per-thread stream captures makes the primary context current, and the caller's is
    # put back after it.
    lines = _run_after(
        stand_in_libcuda,
        TORCH_FUNCTIONS,
        """
        cmt.serve(pool)
        for handle in (None, 2):
            cuda.cuCtxSetCurrent(mine)
            p = lib.cumempool_torch_alloc(1 << 20, 0, handle)
            print(bool(p), mine_current())
            cuda.cuCtxSetCurrent(mine)
            lib.cumempool_torch_free(p, 1 << 20, 0, handle)
            print(cmt.statistics()["current_count"], mine_current())
        cmt.stop()
        """,
    )
    assert lines[:4] == ["True", "True", "0", "True"], "control: the legacy stream puts it back"
    assert (lines[4], lines[6]) == ("True", "0"), "served and given back on the per-thread stream"
    assert (lines[5], lines[7]) == ("True", "True"), "(after alloc, after free) on handle 2: the caller's context was not current"


def test_a_dlpack_consumers_last_free_lets_go_of_a_lent_stream_at_once(stand_in_libcuda):
    # The capsule's deleter runs from plain Python code (`del cap`, no binding on the stack) with
    # the GIL held: the lending library's object goes then, as after a close, not at the next
    # call into cumempool.
    lines = _run(
        stand_in_libcuda,
        """
        l = Lender(cm.Stream(0)); r = weakref.ref(l)
        b = pool.alloc(64, l); del l; b.close(); print(r() is None)  # control: a close
        l = Lender(cm.Stream(0)); r = weakref.ref(l)
        b = pool.alloc(64, l)
        cap = b.__dlpack__(stream=-1)
        b.close(); del b, l
        print(r() is None)
        del cap
        print(r() is None)
        """,
    )
    assert lines == ["True", "False", "True"], "the lender outlived the last use of its stream"
