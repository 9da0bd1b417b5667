"""The CuPy plug-in's common case hands its memory to CuPy's own memory object,
``CFunctionAllocatorMemory``, on a host without a GPU: a stand-in ``cupy`` whose memory object
runs CuPy's protocol (``malloc(param, size, device)`` in ``__init__`` when ``size > 0``,
``free(param, ptr, device)`` when it goes and its address is not null, both with the GIL held)
over the stand-in libcuda."""

import textwrap

import pytest
from test_fake_driver import _run

# `raise_at[0]` makes the memory object's constructor raise before or after it calls `malloc`
# (CuPy's does neither; a failure of either kind must neither leak the memory nor free it twice).
FAKE_CUPY = """
import sys, types
import cumempool.cupy as cmc
MALLOC = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
raise_at, freed = [None], []
class CFunctionAllocatorMemory:
    def __init__(self, size, param, malloc, free, device_id):
        self._param, self._free, self.device_id, self.size, self.ptr = param, free, device_id, size, 0
        if raise_at[0] == "before":
            raise RuntimeError("before malloc")
        if size > 0:
            self.ptr = MALLOC(malloc)(param, size, device_id) or 0
        if raise_at[0] == "after":
            raise RuntimeError("after malloc")
    def __del__(self):
        if self.ptr:
            freed.append(self.ptr)
            FREE(self._free)(self._param, self.ptr, self.device_id)
    def __reduce__(self):
        # As Cython pickles CuPy's class: by its fields, with no malloc when made again.
        return (_by_fields, (type(self), (self._param, self._free, self.device_id, self.size, self.ptr)))
def _by_fields(cls, fields):
    made = cls.__new__(cls)
    made._param, made._free, made.device_id, made.size, made.ptr = fields
    return made
class CupyStream:
    def __init__(self, stream):
        self.stream = stream
    @property
    def ptr(self):
        return self.stream.handle
current = [None]
cupy = types.ModuleType("cupy")
cupy.cuda = types.SimpleNamespace(
    memory=types.SimpleNamespace(CFunctionAllocatorMemory=CFunctionAllocatorMemory, OutOfMemoryError=MemoryError),
    runtime=types.SimpleNamespace(getDevice=lambda: 0),
    get_current_stream=lambda: current[0],
    UnownedMemory=lambda *args: (_ for _ in ()).throw(AssertionError("a Buffer in an UnownedMemory was made")),
    MemoryPointer=lambda memory, offset: memory,
)
sys.modules["cupy"] = cupy
stats = cm.Statistics(cm.PoolResource(pool))
allocator = cmc.Allocator(stats)
def in_use():
    return stats.usage()["current_bytes"]
"""


def _with_fake_cupy(stand_in_libcuda, scenario):
    """Runs `scenario` (indented or not) after FAKE_CUPY on the stand-in driver."""
    return _run(stand_in_libcuda, FAKE_CUPY + textwrap.dedent(scenario))


def test_cupys_memory_object_holds_the_memory_until_it_goes(stand_in_libcuda):
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
        current[0] = CupyStream(cm.Stream(0))
        memory = allocator(256)
        print(isinstance(memory, CFunctionAllocatorMemory), memory.size, memory.device_id, memory.ptr != 0, in_use())
        ptr = memory.ptr
        del memory
        print(freed == [ptr], in_use())
        """,
    )
    assert words[:5] == ["True", "256", "0", "True", "256"]
    assert words[5:] == ["True", "0"], "the memory outlived CuPy's object"


def test_the_memory_keeps_cupys_stream_object_until_it_goes(stand_in_libcuda):
    # CuPy destroys a stream when its object goes: memory ordered on it keeps the object.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
        lender = CupyStream(cm.Stream(0)); kept = weakref.ref(lender)
        current[0] = lender
        memory = allocator(256)
        current[0] = lender = None
        gc.collect()
        print(kept() is not None)
        del memory
        gc.collect()
        print(kept() is None, in_use())
        """,
    )
    assert words == ["True", "True", "0"], "CuPy's stream went before the memory ordered on it, or stayed after"


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_memory_object_that_fails_gives_the_memory_back_once(stand_in_libcuda, when):
    # Before `malloc`, the object never took the memory; after it, the object took it and
    # gave it back as it went (`freed`). Either way the memory is back, once.
    words = _with_fake_cupy(
        stand_in_libcuda,
        f"""
        current[0] = CupyStream(cm.Stream(0))
        raise_at[0] = "{when}"
        try:
            allocator(256)
        except RuntimeError as error:
            print(error)
        gc.collect()
        print(in_use(), len(freed))
        raise_at[0] = None
        first, second = allocator(256), allocator(256)
        print(in_use(), first.ptr != second.ptr)
        """,
    )
    assert words[:2] == [when, "malloc"]
    assert words[2:4] == ["0", "1" if when == "after" else "0"], "memory CuPy's object did not hold was kept"
    assert words[4:] == ["512", "True"], "the memory was given back twice"


def test_an_empty_allocation_makes_a_memory_object_without_an_address(stand_in_libcuda):
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
        current[0] = CupyStream(cm.Stream(0))
        memory = allocator(0)
        print(memory.ptr, in_use())
        del memory
        print(in_use(), len(freed))
        """,
    )
    assert words == ["0", "0", "0", "0"]


def test_a_copy_is_the_object_itself_and_pickling_is_refused(stand_in_libcuda):
    # CuPy's class copies and pickles by its fields: a second object with the same fields
    # would give the memory back a second time, under the first.
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
        import copy, pickle
        current[0] = CupyStream(cm.Stream(0))
        memory = allocator(256)
        print(copy.copy(memory) is memory, copy.deepcopy(memory) is memory)
        try:
            pickle.dumps(memory)
        except TypeError as error:
            print("refused", "cumempool.cupy.Allocator" in str(error))
        del memory
        gc.collect()
        print(in_use(), len(freed))
        """,
    )
    assert words == ["True", "True", "refused", "True", "0", "1"]


def test_memory_cupy_holds_at_exit_is_left_to_the_driver(stand_in_libcuda):
    # CuPy lets go of its memory objects as the interpreter tears its modules down, from
    # outside any binding: no attaching to Python then (it would abort the process).
    words = _with_fake_cupy(
        stand_in_libcuda,
        """
        current[0] = types.SimpleNamespace(ptr=0)
        _kept = allocator(256)
        print(in_use())
        """,
    )
    assert words == ["256"]
