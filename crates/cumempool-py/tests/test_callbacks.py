"""An out-of-memory callback, shown on a host without a GPU through the stand-in driver of
test_fake_driver.py: a cycle through it is collected (and with it the pool's memory a cache
kept)."""

import textwrap

from test_fake_driver import _run, fake_libcuda  # noqa: F401 (a fixture)


def _run_after(fake_libcuda, setup, scenario):
    """Runs `scenario` after PRELUDE and `setup` (both unindented) on the stand-in driver."""
    return _run(fake_libcuda, setup + textwrap.dedent(scenario))

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


def test_a_cycle_through_an_out_of_memory_callback_is_collected(fake_libcuda):
    lines = _run_after(
        fake_libcuda,
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


def test_a_collected_cycle_gives_the_cached_memory_back(fake_libcuda):
    lines = _run_after(
        fake_libcuda,
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
