"""`cumempool.cuda_core.MemoryResource` on the stand-in libcuda, with a stand-in `cuda.core`
(its `MemoryResource` base and `Buffer.from_handle`): what the plug-in keeps of each allocation
between cuda.core's allocate and deallocate."""

from test_resource_alloc_under_capture import run_on_stand_in


FAKE_CUDA_CORE = """
import inspect, sys, types
cuda = types.ModuleType("cuda")
core = types.ModuleType("cuda.core")
class MemoryResource:
    pass
class CoreBuffer:  # cuda.core's Buffer: an address, a size, its resource
    def __init__(self, ptr, size, mr):
        self.ptr, self.size, self.mr = ptr, size, mr
    @classmethod
    def from_handle(cls, ptr, size, mr=None):
        return cls(ptr, size, mr)
core.MemoryResource, core.Buffer, cuda.core = MemoryResource, CoreBuffer, core
sys.modules["cuda"], sys.modules["cuda.core"] = cuda, core
import cumempool.cuda_core as cmcc
"""


def test_a_cuda_core_free_never_takes_another_threads_allocation_with_it(stand_in_libcuda):
    # Once thread A's `mr.deallocate(p)` has given `p` back, thread B can run (a thread switch at
    # any bytecode, or while A's close waits with the GIL released) and `mr.allocate` the same
    # memory, held in `_live[p]`: nothing A does after the free may drop B's entry, or B's
    # memory is freed while cuda.core's Buffer B still uses it (and the next allocation gets
    # the same address: two owners of one block). The switch is modelled by running B's
    # allocation at the first line A executes after the free.
    words = run_on_stand_in(
        stand_in_libcuda,
        FAKE_CUDA_CORE
        + """
cache = cm.CachingResource(cm.PoolResource(cm.MemPool(cm.Route.device(0))))
mr = cmcc.MemoryResource(cache)
stream = cm.Stream(0)
a = mr.allocate(4096, stream)
code = type(mr).deallocate.__code__
other_thread = []
def in_deallocate(frame, event, arg):
    # The first line (or the return) after the memory went back: thread B allocates now.
    if event in ("line", "return") and not other_thread and cache.stats()["cached_blocks"] == 1:
        other_thread.append(mr.allocate(4096, stream))
    return in_deallocate
sys.settrace(lambda frame, event, arg: in_deallocate if frame.f_code is code else None)
mr.deallocate(a.ptr, 4096, stream)
sys.settrace(None)
b = other_thread[0]
kept = b.ptr in mr._live
c = mr.allocate(4096, stream)  # a third allocation while b is alive
print(b.ptr == a.ptr, kept, c.ptr == b.ptr)
""",
    )
    assert words[0] == "True", "precondition: thread B got the block A freed"
    assert words[1:] == ["True", "False"], "A's free dropped B's buffer: B's memory was freed and handed out again"
