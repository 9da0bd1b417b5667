"""What a child process started with multiprocessing's "spawn" runs in test_sharing.py (a module
of its own so the child can import it; not collected by pytest)."""

import os
from multiprocessing import reduction


def map_and_read(conn):
    """Receives a pool as a descriptor (send_handle) and an allocation (pickled), reads the
    bytes the parent wrote, closes the mapping, then sends the bytes back with the names of
    the errors an allocation from the imported pool and its export raised."""
    import cumempool as cm

    fd = reduction.recv_handle(conn)
    try:
        pool = cm.MemPool.import_fd(fd)
    finally:
        os.close(fd)
    shared = conn.recv()
    stream = cm.Stream(0)
    with pool.import_buffer(shared, stream) as mapped:
        data = mapped.to_bytes()
    stream.synchronize()
    refusals = []
    for attempt in (lambda: pool.alloc(4096, stream), pool.export_fd):
        try:
            attempt()
        except cm.CumempoolError as error:
            refusals.append(type(error).__name__)
    conn.send((data, refusals))


def receive_over_socket(conn):
    """Receives a pool with MemPool.receive and an allocation's 72 bytes over the connection's
    socket, reads the bytes, and sends them back."""
    import cumempool as cm

    pool = cm.MemPool.receive(conn)
    shared = cm.SharedAllocation.from_bytes(conn.recv_bytes())
    stream = cm.Stream(0)
    mapped = pool.import_buffer(shared, stream)
    data = mapped.to_bytes()
    mapped.close()
    stream.synchronize()
    conn.send(data)
