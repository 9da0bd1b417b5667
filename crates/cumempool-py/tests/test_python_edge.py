"""What a Python user meets at the package's edge, on a host without a GPU: documented return
types, each library's own exception class, Python's socket timeouts, and messages that name the
Python API rather than the Rust one."""

import re
import socket
import threading

import pytest

import cumempool as cm
from test_resource_alloc_under_capture import run_on_stand_in

# What a Rust path or reference looks like in a message.
RUST_ISMS = re.compile(r"::|&[A-Za-z]|\bbuilder\(|\bStream::|Some\(")


def test_pool_attributes_are_a_dict(stand_in_libcuda):
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        attributes = cm.MemPool(cm.Route.device(0)).attributes()
        print(type(attributes).__name__, "CU_MEMPOOL_ATTR_USED_MEM_CURRENT" in attributes)
        """,
    )
    assert words == ["dict", "True"]


def test_the_cupy_allocator_raises_cupys_out_of_memory_error(stand_in_libcuda):
    # CuPy code catches cupy.cuda.memory.OutOfMemoryError (its own pool retries after freeing
    # cached blocks for that class only); a stand-in cupy module carries CuPy's class as CuPy
    # defines it.
    words = run_on_stand_in(
        stand_in_libcuda,
        """
        import sys, types
        class CupyOutOfMemoryError(MemoryError):
            def __init__(self, size, total, limit=0):
                super().__init__(f"Out of memory allocating {size:,} bytes")
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(
            memory=types.SimpleNamespace(OutOfMemoryError=CupyOutOfMemoryError),
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=lambda: None,
            UnownedMemory=lambda ptr, size, owner, device: (ptr, size, owner, device),
            MemoryPointer=lambda memory, offset: memory,
        )
        sys.modules["cupy"] = cupy
        import cumempool.cupy as cmc
        allocator = cmc.Allocator(cm.Limit(cm.PoolResource(cm.MemPool(cm.Route.device(0))), 1024))
        try:
            allocator(4096)
            print("served")
        except CupyOutOfMemoryError as error:
            print(isinstance(error, cm.OutOfMemoryError), isinstance(error.__cause__, cm.LimitExceededError))
            print("1024" in str(error))
        """,
    )
    assert words == ["True", "True", "True"], "CuPy code could not catch the limit as its out-of-memory error"


def _socketpair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a, b


def test_receive_honours_the_sockets_timeout():
    a, b = _socketpair()
    with a, b:
        a.settimeout(0.2)
        with pytest.raises(TimeoutError):
            cm.MemPool.receive(a)
        # Within the timeout: the message is read (bytes without a descriptor: refused as such).
        threading.Timer(0.05, b.send, (b"xxxx",)).start()
        a.settimeout(5)
        with pytest.raises(cm.MalformedMessageError, match="without a descriptor"):
            cm.MemPool.receive(a)


def test_receive_waits_under_a_timeout_longer_than_poll_takes():
    # 30 days is past the 2**31 - 1 milliseconds select.poll takes at once.
    a, b = _socketpair()
    with a, b:
        a.settimeout(30 * 24 * 3600)
        threading.Timer(0.05, b.send, (b"xxxx",)).start()
        with pytest.raises(cm.MalformedMessageError, match="without a descriptor"):
            cm.MemPool.receive(a)


def test_receive_on_a_non_blocking_socket():
    a, b = _socketpair()
    with a, b:
        a.setblocking(False)
        with pytest.raises(BlockingIOError):
            cm.MemPool.receive(a)
        b.send(b"xxxx")
        with pytest.raises(cm.MalformedMessageError, match="without a descriptor"):
            cm.MemPool.receive(a)


def test_receive_on_a_blocking_socket_and_its_descriptor_waits():
    a, b = _socketpair()
    with a, b:
        a.setblocking(False)  # the descriptor is non-blocking; an int has no timeout: it waits
        threading.Timer(0.05, b.send, (b"xxxx",)).start()
        with pytest.raises(cm.MalformedMessageError, match="without a descriptor"):
            cm.MemPool.receive(a.fileno())
        a.setblocking(True)
        threading.Timer(0.05, b.close).start()
        with pytest.raises(cm.MalformedMessageError, match="closed"):
            cm.MemPool.receive(a)


def test_messages_name_the_python_api(stand_in_libcuda):
    # Every refusal this host can provoke, printed one per line.
    out = run_on_stand_in(
        stand_in_libcuda,
        """
        def show(call):
            try:
                call()
                print("NO-ERROR")
            except Exception as error:
                print(type(error).__name__ + ":", str(error).replace(" ", "_"))
        pool = cm.MemPool(cm.Route.device(0))
        s = cm.Stream(0)
        show(pool.export_fd)
        show(lambda: pool.alloc(64, s).export())
        show(lambda: cm.Stream.borrow(1))
        show(lambda: cm.Stream.borrow(1 << 70))
        show(lambda: cm.MemPool.import_fd(-1))
        show(lambda: cm.Device(5))
        show(lambda: pool.alloc(0, s))
        show(lambda: cm.Route.host_numa(-7))
        handle = s.handle
        begin(handle, 2)
        show(lambda: cm.CachingResource(cm.PoolResource(pool)).alloc(64, s))
        show(lambda: cm.PoolResource(pool).alloc(64, s))
        show(s.synchronize)
        show(lambda: pool.alloc(64, s))
        graph = ctypes.c_void_p()
        end(handle, ctypes.byref(graph))
        """,
    )
    messages = [line.replace("_", " ") for line in out if ":" in line]
    assert len(messages) >= 8, out
    rusty = [m for m in messages if RUST_ISMS.search(m.split(":", 1)[1])]
    assert not rusty, "messages give Rust advice:\n" + "\n".join(rusty)
