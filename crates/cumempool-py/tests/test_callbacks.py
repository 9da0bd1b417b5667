"""An out-of-memory callback, shown on a host without a GPU through the stand-in driver of
the Rust tests: a cycle through it is collected (and with it the pool's memory a cache
kept), and an interruption raised in it (KeyboardInterrupt, SystemExit) reaches the caller of
`alloc` instead of being reported as unraisable."""

from test_fake_driver import _run_after

# A cycle whose only edge back runs through the callback: the holder keeps the resource, the
# resource keeps the holder's bound method.
HOLDER = """
import sys
class Holder:
    def __init__(self, wrap): self.res = wrap(self)
    def cb(self, requested, attempt): return False
def collected(wrap):
    h = Holder(wrap); r = weakref.ref(h); del h; gc.collect()
    return r() is None
"""


def test_a_cycle_through_an_out_of_memory_callback_is_collected(stand_in_libcuda):
    lines = _run_after(
        stand_in_libcuda,
        HOLDER,
        """
        base = sys.getrefcount(pool)
        print(collected(lambda h: [h, cm.Statistics(cm.PoolResource(pool))]))  # control
        print(collected(lambda h: cm.OnOutOfMemory(cm.PoolResource(pool), h.cb)))
        print(collected(lambda h: cm.CachingResource(cm.OnOutOfMemory(cm.PoolResource(pool), h.cb))))
        print(sys.getrefcount(pool) == base)
        """,
    )
    assert lines[0] == "True"
    assert lines[1] == "True", "a holder whose OnOutOfMemory calls its method was never collected"
    assert lines[2] == "True", "a holder whose cache is over an OnOutOfMemory calling its method was never collected"
    assert lines[3] == "True", "the collected resources still hold the pool"


def test_a_collected_cycle_gives_the_cached_memory_back(stand_in_libcuda):
    lines = _run_after(
        stand_in_libcuda,
        HOLDER,
        """
        stats = cm.Statistics(cm.PoolResource(pool))
        h = Holder(lambda h: cm.CachingResource(cm.OnOutOfMemory(stats, h.cb)))
        h.res.alloc(4096).close()
        print(stats.usage()["current_bytes"] > 0)  # control: the cache keeps the block
        r = weakref.ref(h); del h; gc.collect()
        print(r() is None, stats.usage()["current_bytes"])
        """,
    )
    assert lines[0] == "True"
    assert lines[1:] == ["True", "0"], "the cycle kept the cache, and the pool's memory it holds, alive"


INTERRUPTIONS = """
import sys
unraisable = []
sys.unraisablehook = lambda u: unraisable.append(type(u.exc_value).__name__)
calls = []
def raising(exception):
    def callback(requested, attempt):
        calls.append(attempt)
        raise exception
    return callback
def outcome(resource, size):
    try:
        resource.alloc(size)
        return "allocated"
    except BaseException as e:
        return type(e).__name__
"""


def test_keyboard_interrupt_in_an_out_of_memory_callback_reaches_alloc(stand_in_libcuda):
    lines = _run_after(
        stand_in_libcuda,
        INTERRUPTIONS,
        """
        limit = cm.Limit(cm.PoolResource(pool), 1024)
        print(outcome(cm.OnOutOfMemory(limit, raising(KeyboardInterrupt())), 4096), unraisable, calls)
        """,
    )
    assert lines == ["KeyboardInterrupt", "[]", "[1]"], "Ctrl-C in the callback was swallowed"


def test_system_exit_in_an_out_of_memory_callback_reaches_alloc(stand_in_libcuda):
    lines = _run_after(
        stand_in_libcuda,
        INTERRUPTIONS,
        """
        guarded = cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 1024), raising(SystemExit(3)))
        try:
            guarded.alloc(4096)
        except SystemExit as e:
            print("SystemExit", e.code, unraisable)
        """,
    )
    assert lines == ["SystemExit", "3", "[]"]


def test_an_ordinary_exception_in_an_out_of_memory_callback_is_unraisable(stand_in_libcuda):
    lines = _run_after(
        stand_in_libcuda,
        INTERRUPTIONS,
        """
        limit = cm.Limit(cm.PoolResource(pool), 1024)
        print(outcome(cm.OnOutOfMemory(limit, raising(ValueError("no"))), 4096), unraisable, calls)
        print(outcome(cm.OnOutOfMemory(limit, lambda requested, attempt: 1 / 0), 4096), unraisable)
        print(outcome(cm.OnOutOfMemory(limit, raising(ValueError("no"))), 512))  # no memory problem
        """,
    )
    assert lines == [
        "LimitExceededError",
        "['ValueError']",
        "[1]",
        "LimitExceededError",
        "['ValueError',",
        "'ZeroDivisionError']",
        "allocated",
    ]


def test_an_interruption_wins_over_an_allocation_a_cache_then_makes(stand_in_libcuda):
    # The cache above gives its block back after the callback's refusal and retries, which
    # succeeds: the memory goes back and the interruption is raised all the same.
    lines = _run_after(
        stand_in_libcuda,
        INTERRUPTIONS,
        """
        limit = cm.Limit(cm.PoolResource(pool), 4096)
        cache = cm.CachingResource(cm.OnOutOfMemory(limit, raising(KeyboardInterrupt())))
        cache.alloc(2048).close()
        print(limit.in_use)  # control: the cache keeps the block
        print(outcome(cache, 4096), calls, unraisable)
        cache.release()
        print(limit.in_use)
        print(outcome(cache, 4096))  # and the next allocation is not interrupted
        """,
    )
    assert lines == ["2048", "KeyboardInterrupt", "[1]", "[]", "0", "allocated"]


def test_an_interruption_is_raised_once_by_the_alloc_it_stopped(stand_in_libcuda):
    # A callback that allocates through another guarded resource: the inner interruption
    # reaches the outer callback, which lets it through; the next alloc raises nothing stale.
    lines = _run_after(
        stand_in_libcuda,
        INTERRUPTIONS,
        """
        inner = cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 1024), raising(KeyboardInterrupt()))
        outer = cm.OnOutOfMemory(cm.Limit(cm.PoolResource(pool), 1024), lambda n, a: inner.alloc(4096))
        print(outcome(outer, 4096), calls)
        print(outcome(outer, 512), outcome(inner, 512))
        """,
    )
    assert lines == ["KeyboardInterrupt", "[1]", "allocated", "allocated"]
