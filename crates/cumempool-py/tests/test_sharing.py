"""Sharing a pool and its allocations with another process: descriptors, export data, and the
typed errors for closed or foreign descriptors and malformed messages."""

import multiprocessing
import os
import pickle
import socket
from multiprocessing import reduction

import pytest

import cumempool as cm
from conftest import run_in_new_process

import sharing_child

PAYLOAD = bytes(range(256)) * 16


def test_shared_allocation_data_round_trips_and_pickles():
    data = bytes(range(64)) + (4096).to_bytes(8, "little")
    shared = cm.SharedAllocation.from_bytes(data)
    assert shared.size == 4096 and shared.to_bytes() == data
    assert pickle.loads(pickle.dumps(shared)) == shared


def test_malformed_export_data_is_refused():
    with pytest.raises(cm.MalformedMessageError, match="expected 72"):
        cm.SharedAllocation.from_bytes(b"short")
    with pytest.raises(cm.MalformedMessageError, match="length is 0"):
        cm.SharedAllocation.from_bytes(bytes(72))


def test_a_closed_descriptor_is_refused_before_the_driver_sees_it():
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(cm.NotShareableError, match="not open"):
        cm.MemPool.import_fd(fd)
    with pytest.raises(cm.NotShareableError, match="not open") as refused:
        cm.MemPool.import_fd(-1)
    assert refused.value.reason == "DescriptorNotOpen"


def test_a_message_without_a_pool_is_refused_and_a_closed_socket_is_an_os_error():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"not a pool")
        with pytest.raises(cm.MalformedMessageError, match="without a descriptor"):
            cm.MemPool.receive(b)
        a.close()
        with pytest.raises(cm.MalformedMessageError, match="closed"):
            cm.MemPool.receive(b)
    with pytest.raises(cm.CumempoolOSError, match="closed"):
        cm.MemPool.receive(b)  # fileno() is -1 once closed
    with pytest.raises(OSError):
        cm.MemPool.receive(a)


def test_a_foreign_descriptor_is_refused_by_the_driver(gpu):
    # In a process of its own: what the driver does with a descriptor that is no pool's is
    # its business; the bindings must turn its refusal into a typed error.
    code = (
        "import os, cumempool as cm\n"
        "fd = os.open(os.devnull, os.O_RDONLY)\n"
        "try:\n"
        "    cm.MemPool.import_fd(fd)\n"
        "    print('imported')\n"
        "except cm.SharingError as error:\n"
        "    print(type(error).__name__)\n"
    )
    assert run_in_new_process(code) == "SharingRefusedError"


def test_a_pool_without_an_export_handle_type_is_not_shareable(gpu, stream):
    pool = cm.MemPool(cm.Route.device(0))
    with pytest.raises(cm.NotShareableError) as refused:
        pool.export_fd()
    assert refused.value.reason == "PoolWithoutHandleType"
    cache = cm.CachingResource(cm.PoolResource(pool))
    with pytest.raises(cm.NotShareableError, match="allocated from a pool"):
        cache.alloc(4096, stream).export()


def _shareable(stream):
    pool = cm.MemPool(cm.Route.device(0), handle_types=cm.HandleTypes.POSIX_FILE_DESCRIPTOR)
    buffer = pool.alloc(len(PAYLOAD), stream)
    buffer.copy_from(PAYLOAD)
    return pool, buffer


def _finish(parent, process):
    """Closes the parent's end (a child still waiting for it exits on the EOF) and waits for
    the child, killing it after two minutes."""
    parent.close()
    process.join(120)
    if process.is_alive():
        process.kill()
        process.join()


def test_a_spawned_process_reads_what_the_parent_wrote_through_multiprocessing(gpu, stream):
    context = multiprocessing.get_context("spawn")  # a forked child cannot use CUDA
    parent, child = context.Pipe()
    pool, buffer = _shareable(stream)
    process = context.Process(target=sharing_child.map_and_read, args=(child,))
    process.start()
    child.close()  # the child's end lives in the child: closing ours lets it see an EOF
    try:
        fd = pool.export_fd()
        try:
            reduction.send_handle(parent, fd, process.pid)
        finally:
            os.close(fd)
        parent.send(buffer.export())
        assert parent.poll(120), "the child did not answer"
        data, refusals = parent.recv()
        assert data == PAYLOAD
        assert refusals == ["ImportedPoolAllocationError", "NotShareableError"]
    finally:
        _finish(parent, process)
    assert process.exitcode == 0
    buffer.close()  # after the child closed its mapping


def test_a_spawned_process_receives_the_pool_over_a_unix_socket(gpu, stream):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()  # a Unix-domain socket pair on Linux
    pool, buffer = _shareable(stream)
    process = context.Process(target=sharing_child.receive_over_socket, args=(child,))
    process.start()
    child.close()  # the child's end lives in the child: closing ours lets it see an EOF
    try:
        pool.send(parent)
        parent.send_bytes(buffer.export().to_bytes())
        assert parent.poll(120), "the child did not answer"
        assert parent.recv() == PAYLOAD
    finally:
        _finish(parent, process)
    assert process.exitcode == 0
    buffer.close()
