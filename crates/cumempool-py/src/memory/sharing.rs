//! Sharing a pool and its allocations with another process: the pool's POSIX file descriptor
//! (sent over a Unix socket, or with `multiprocessing.reduction.send_handle`) and each
//! allocation's export data (a picklable `SharedAllocation`).

use crate::errors::{Failure, Outcome};
use crate::memory::{Core, Kind, Memory};
use crate::streams::stream::Stream;
use cumempool::descriptor_passing as dp;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyTuple};
use std::mem::ManuallyDrop;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// What another process needs to map one allocation from its imported pool: the driver's 64
/// bytes of export data and the length. Picklable (`multiprocessing` sends it as is) and
/// convertible to and from 72 bytes (`to_bytes`, `from_bytes`).
#[pyclass(frozen, eq, module = "cumempool")]
#[derive(PartialEq)]
pub struct SharedAllocation(pub cumempool::SharedAllocation);

#[pymethods]
impl SharedAllocation {
    /// Reads the 72 bytes `to_bytes` wrote (MalformedMessageError for anything else).
    #[staticmethod]
    fn from_bytes(data: &[u8]) -> Outcome<Self> {
        Ok(Self(cumempool::SharedAllocation::from_bytes(data)?))
    }

    /// The 72-byte form: 64 bytes of export data, then the length (little-endian).
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.to_bytes())
    }

    /// The allocation's size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.0.len()
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let rebuild = slf.get_type().getattr("from_bytes")?;
        PyTuple::new(py, [rebuild.into_any(), PyTuple::new(py, [slf.get().to_bytes(py)])?.into_any()])
    }

    fn __repr__(&self) -> String {
        format!("SharedAllocation(size={})", self.0.len())
    }
}

/// The descriptor of `socket`: an int, or an object with `fileno()` (a `socket.socket`, a
/// `multiprocessing` connection).
fn descriptor_of(socket: &Bound<'_, PyAny>, what: &'static str) -> Outcome<RawFd> {
    let fd: RawFd = if socket.is_instance_of::<PyInt>() {
        socket.extract()?
    } else {
        socket.call_method0(pyo3::intern!(socket.py(), "fileno"))?.extract()?
    };
    if fd < 0 {
        return Err(cumempool::Error::Io {
            what,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("descriptor {fd} is not open: the socket is closed; pass an open Unix-domain socket"),
            ),
        }
        .into());
    }
    Ok(fd)
}

/// Runs `io` on `fd` as a Unix stream socket it does not own (the caller's object keeps it open).
fn on_socket<T>(fd: RawFd, io: impl FnOnce(&UnixStream) -> T) -> T {
    // SAFETY: `fd` is open (checked non-negative; a closed one fails the system call with
    // EBADF) and owned by the caller's Python object for the call; `ManuallyDrop` never closes it.
    let socket = ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(fd) });
    io(&socket)
}

/// Exports `pool` as a new descriptor (see `MemPool.export_fd`).
pub(crate) fn export_descriptor(py: Python<'_>, pool: &cumempool::Pool) -> Outcome<RawFd> {
    Ok(crate::sync::gil::detach(py, || pool.export_fd())?.into_raw_fd())
}

/// Imports a pool from descriptor `fd`, which stays the caller's.
pub(crate) fn import_descriptor(py: Python<'_>, fd: RawFd) -> Outcome<cumempool::Pool> {
    if fd < 0 {
        return Err(cumempool::Error::NotShareable {
            what: "importing a pool",
            reason: cumempool::NotShareableReason::DescriptorNotOpen { descriptor: fd },
        }
        .into());
    }
    // SAFETY: a non-negative descriptor the caller lends for the call; `import_fd` checks
    // that it is open before the driver sees it, and neither closes it.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let pool = crate::sync::gil::detach(py, || cumempool::MemPool::import_fd(fd))?;
    Ok(cumempool::Pool::clone(&pool))
}

/// Sends `pool`'s descriptor and route over a Unix socket.
pub(crate) fn send_pool(py: Python<'_>, pool: &cumempool::Pool, socket: &Bound<'_, PyAny>) -> Outcome<()> {
    let fd = descriptor_of(socket, "sending a pool")?;
    Ok(crate::sync::gil::detach(py, || on_socket(fd, |s| dp::send_pool(s, pool)))?)
}

/// Receives a pool sent with `send_pool` and imports it, waiting as `socket` says: up to its
/// timeout (`socket.gettimeout()`), for ever where it has none (a blocking `socket.socket`, a
/// `multiprocessing` connection, an int), whether or not its descriptor is non-blocking.
pub(crate) fn receive_pool(py: Python<'_>, socket: &Bound<'_, PyAny>) -> Outcome<cumempool::Pool> {
    let fd = descriptor_of(socket, "receiving a pool")?;
    let timeout = timeout_of(socket)?;
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        wait_readable(py, fd, deadline, timeout.is_some_and(|t| t.is_zero()))?;
        // One `recvmsg`: a message that is not there yet (another reader took it, or readiness
        // was spurious) fails with nothing consumed, and is waited for again.
        match crate::sync::gil::detach(py, || on_socket(fd, dp::receive_pool)) {
            Ok(received) => return Ok(cumempool::Pool::clone(&received.pool)),
            Err(cumempool::Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(error) => return Err(error.into()),
        }
    }
}

/// The timeout `socket.gettimeout()` gives (`None`: wait for ever; objects without it, such as
/// an int or a `multiprocessing` connection, have none).
fn timeout_of(socket: &Bound<'_, PyAny>) -> Outcome<Option<std::time::Duration>> {
    let py = socket.py();
    if socket.is_instance_of::<PyInt>() || !socket.hasattr(pyo3::intern!(py, "gettimeout"))? {
        return Ok(None);
    }
    let seconds: Option<f64> = socket.call_method0(pyo3::intern!(py, "gettimeout"))?.extract()?;
    Ok(seconds.map(|s| std::time::Duration::from_secs_f64(s.max(0.0))))
}

/// Waits with `select.poll` (which releases the GIL, and retries on a signal as PEP 475 says)
/// until `fd` is readable or `deadline` passes: `TimeoutError` then (`socket.timeout`), or
/// `BlockingIOError` for a socket whose timeout is 0 (non-blocking mode), as Python's own
/// `recv` raises.
fn wait_readable(py: Python<'_>, fd: RawFd, deadline: Option<std::time::Instant>, non_blocking: bool) -> Outcome<()> {
    let select = py.import(pyo3::intern!(py, "select"))?;
    let poll = select.call_method0(pyo3::intern!(py, "poll"))?;
    let readable = select.getattr(pyo3::intern!(py, "POLLIN"))?;
    poll.call_method1(pyo3::intern!(py, "register"), (fd, readable))?;
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        // `poll` takes at most `i32::MAX` milliseconds at once (about 24 days): a longer timeout
        // is waited for in turns.
        let milliseconds = left.map(|left| left.as_millis().min(POLL_LONGEST_MS) as u64);
        let events = poll.call_method1(pyo3::intern!(py, "poll"), (milliseconds,))?;
        if events.len()? > 0 {
            return Ok(());
        }
        if left.is_none_or(|left| left.as_millis() <= POLL_LONGEST_MS) {
            break;
        }
    }
    Err(if non_blocking {
        pyo3::exceptions::PyBlockingIOError::new_err(
            "receiving a pool: no message is waiting on this non-blocking socket (timeout 0); wait for one, or set a timeout",
        )
    } else {
        pyo3::exceptions::PyTimeoutError::new_err(
            "receiving a pool: no message came within the socket's timeout (socket.settimeout); the peer has not sent one yet",
        )
    }
    .into())
}

/// The longest wait `select.poll` takes, in milliseconds (a C `int`).
const POLL_LONGEST_MS: u128 = i32::MAX as u128;

/// Maps `shared` from `pool` (an imported pool), ordered on `stream`.
pub(crate) fn import_allocation(
    py: Python<'_>,
    pool: &cumempool::Pool,
    shared: &SharedAllocation,
    stream: Py<Stream>,
) -> Outcome<Core> {
    // The mapping borrows its stream: an `Arc` keeps that stream at one address for as long
    // as the mapping lives (it is dropped after the mapping, see `Memory::Imported`).
    let borrowed = Arc::new(stream.get().stream.clone());
    // The import makes the stream's context current: the caller's is put back after.
    let mapping = {
        let (s, device): (&cumempool::Stream, i32) = (&borrowed, stream.get().device);
        crate::sync::gil::detach(py, || {
            let context = crate::streams::primary_contexts::context_of(s, device)?;
            context.while_current(|| Ok::<_, Failure>(pool.import_pointer(&shared.0, s)?))
        })?
    };
    // SAFETY: the mapping borrows `*borrowed`, which the same `Memory::Imported` holds and
    // drops after it; the `Arc`'s heap value does not move when the `Arc` does.
    let mapping: cumempool::Buffer<'static> = unsafe { std::mem::transmute(mapping) };
    let device = stream.get().device;
    let memory = Memory::Imported { mapping, _stream: borrowed };
    Ok(Core::new(memory, stream, Kind::of(pool.route()), device))
}

/// A buffer's export data (see `Buffer.export`).
pub(crate) fn export_allocation(py: Python<'_>, core: &Core) -> Outcome<SharedAllocation> {
    match core.pool_buffer() {
        Some(buffer) => Ok(SharedAllocation(crate::sync::gil::detach(py, || buffer.export())?)),
        None => Err(Failure::Core(cumempool::Error::NotShareable {
            what: "exporting an allocation",
            reason: cumempool::NotShareableReason::NotPoolMemory,
        })),
    }
}
