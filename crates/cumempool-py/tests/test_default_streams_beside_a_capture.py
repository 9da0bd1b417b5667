"""Work on the legacy stream (`stream=None`, the default) while a blocking stream captures, on
the stand-in driver: the driver refuses such work and invalidates that capture, so every
operation of the core on the legacy stream asks first. A free waits for the capture's end (and
runs at the next use of the legacy stream); other work is refused with `StreamCapturingError`.
The capture here is CuPy's `Stream.ptds.begin_capture()`: the calling thread's per-thread stream,
a blocking stream, in thread-local mode."""

import pytest

from test_resource_alloc_under_capture import run_on_stand_in

BEGIN = "assert begin(2, 1) == 0  # the per-thread stream, blocking, captures"
CASES = {
    "a pool buffer closed": "b = pool.alloc(4096)\nBEGIN\nb.close()",
    "a pool buffer collected": "b = pool.alloc(4096)\nBEGIN\ndel b",
    "a resource's buffer collected": "r = cm.PoolResource(pool)\nb = r.alloc(4096)\nBEGIN\ndel b",
    "a block the cache cannot keep": (
        "r = cm.CachingResource(cm.PoolResource(pool), max_cached=1024)\nb = r.alloc(1 << 16)\nBEGIN\ndel b"
    ),
    "a pool allocation": "BEGIN\ntry:\n    pool.alloc(4096)\nexcept cm.StreamCapturingError:\n    print('refused')",
    "a resource allocation": (
        "r = cm.PoolResource(pool)\nBEGIN\ntry:\n    r.alloc(4096)\nexcept cm.StreamCapturingError:\n    print('refused')"
    ),
    "a fill": "b = pool.alloc(4096)\nBEGIN\ntry:\n    b.fill(1)\nexcept cm.StreamCapturingError:\n    print('refused')",
}


@pytest.mark.parametrize("case", list(CASES))
def test_legacy_stream_work_beside_a_blocking_capture_leaves_it_intact(stand_in_libcuda, case):
    code = (
        "import ctypes\npool = cm.MemPool(cm.Route.device(0))\n"
        + CASES[case].replace("BEGIN", BEGIN)
        + "\ngraph = ctypes.c_void_p()\nprint('end', end(2, ctypes.byref(graph)))\n"
        # After the capture (a buffer still held let go of): the next use of the legacy stream
        # runs the frees it deferred.
        + "globals().pop('b', None)\npool.alloc(16).close()\nprint('used', pool.used_mem_current)\n"
    )
    words = run_on_stand_in(stand_in_libcuda, code)
    assert words[-4:] == ["end", "0", "used", "0"], f"{case}: {words}"
    if "allocation" in case or "fill" in case:
        assert words[0] == "refused", words


def test_a_buffer_closed_on_another_thread_during_a_per_thread_capture_leaves_it_intact(stand_in_libcuda):
    # Allocated on one thread's per-thread stream, which then captures; another thread closes
    # it: the free goes to the legacy stream, which that capture blocks.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import threading
        pool = cm.MemPool(cm.Route.device(0))
        per_thread = cm.Stream.borrow(2, 0)
        started, done, ended, box = threading.Event(), threading.Event(), [], []
        def capturing_thread():
            box.append(pool.alloc(4096, per_thread))
            assert begin(2, 1) == 0
            started.set()
            done.wait()
            graph = ctypes.c_void_p()
            ended.append(end(2, ctypes.byref(graph)))
            pool.alloc(16, per_thread).close()  # this thread's next use runs what waited
        t = threading.Thread(target=capturing_thread)
        t.start()
        started.wait()
        box.pop().close()
        done.set()
        t.join()
        print(ended[0], pool.used_mem_current)
        """,
    )
    assert words == ["0", "0"], words


def test_a_resource_allocation_refused_by_the_core_beside_a_blocking_capture_names_the_python_call(
    stand_in_libcuda,
):
    # A blocking capture begun between the binding's question and the core's (the stand-in
    # begins it right after the first question): the core refuses, in words that name
    # `Pool::alloc_raw`, which the resource calls; the message names the resource's alloc()
    # instead, with no Rust left in it.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        pool = cm.MemPool(cm.Route.device(0))
        r = cm.PoolResource(pool)
        ctypes.c_int.in_dll(lib, "capture_after_capture_queries").value = 1
        try:
            r.alloc(4096)
        except cm.StreamCapturingError as e:
            print(str(e).replace(" ", "_"))
        graph = ctypes.c_void_p()
        print("end", end(2, ctypes.byref(graph)), pool.used_mem_current)
        """,
    )
    message = words[0].replace("_", " ")
    assert "on the legacy stream with a resource's alloc() (use a non-blocking stream" in message, message
    assert "alloc() raw" not in message and "alloc raw" not in message, message
    assert words[-3:] == ["end", "0", "0"], words
