//! Moving a pool's file descriptor to another process over a Unix-domain socket (SCM_RIGHTS),
//! so sharing a pool needs no other code.
//!
//! ```no_run
//! # use cumempool::{descriptor_passing as dp, HandleTypes, MemPool, Route, Stream, Device};
//! # fn main() -> cumempool::Result<()> {
//! # let context = Device::get(0)?.primary_context()?; let stream = Stream::new(&context)?;
//! // exporter
//! let pool = MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build()?;
//! let buffer = pool.alloc(1 << 20, &stream)?;
//! let (mut exporter, mut importer) = std::os::unix::net::UnixStream::pair().map_err(|e| dp::io_error("socketpair", e))?;
//! dp::send_pool(&exporter, &pool)?;
//! dp::send_allocation(&mut exporter, &buffer.export()?)?;
//! // importer (normally another process)
//! let received = dp::receive_pool(&importer)?;
//! let shared = dp::receive_allocation(&mut importer)?;
//! let mapping = received.pool.import_pointer(&shared, &stream)?;
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::location::{raw_id, raw_location, AllocationType, Location, Route};
use crate::pool::{MemPool, Pool};
use crate::sharing::SharedAllocation;
use cumempool_sys as sys;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

const POOL_MAGIC: &[u8; 8] = b"CMPOOL01";
const POOL_MESSAGE_LEN: usize = 20;

/// An I/O failure while sharing, as this crate's error.
pub fn io_error(what: &'static str, error: std::io::Error) -> Error {
    Error::Sharing { what, reason: error.to_string() }
}

/// Sends `fd` with `payload` (at least one byte) as one message.
pub fn send_fd(socket: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> Result<()> {
    if payload.is_empty() {
        return Err(Error::InvalidArgument {
            what: "sending a descriptor",
            reason: "the payload must hold at least one byte".into(),
        });
    }
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut c_void, iov_len: payload.len() };
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: plain arithmetic on a constant.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<c_int>() as u32) } as usize;
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = space as _;
    // SAFETY: the control buffer is large and aligned enough for one descriptor.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&message);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<c_int>(), fd.as_raw_fd());
    }
    // SAFETY: a connected socket and a well-formed message.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &message, 0) };
    if sent < 0 {
        return Err(io_error("sending a descriptor", std::io::Error::last_os_error()));
    }
    if (sent as usize) < payload.len() {
        return Err(Error::Sharing {
            what: "sending a descriptor",
            reason: format!("only {sent} of {} bytes were sent", payload.len()),
        });
    }
    Ok(())
}

/// Receives one descriptor and up to `payload.len()` bytes sent with [`send_fd`].
pub fn receive_fd(socket: &UnixStream, payload: &mut [u8]) -> Result<(OwnedFd, usize)> {
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() };
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: buffers sized as declared.
    let received = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
    if received < 0 {
        return Err(io_error("receiving a descriptor", std::io::Error::last_os_error()));
    }
    if message.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::Sharing {
            what: "receiving a descriptor",
            reason: "the descriptor did not fit the message (truncated)".into(),
        });
    }
    // SAFETY: the kernel filled the control buffer; CMSG_* walk it within its length.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<c_int>());
                return Ok((OwnedFd::from_raw_fd(fd), received as usize));
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    let reason = if received == 0 {
        "the peer closed the socket".to_owned()
    } else {
        "a message arrived without a descriptor".to_owned()
    };
    Err(Error::Sharing { what: "receiving a descriptor", reason })
}

fn encode_route(route: Option<Route>) -> [u8; 12] {
    let mut bytes = [0u8; 12];
    if let Some(route) = route {
        if let Ok(raw) = route.location.to_raw() {
            bytes[0] = 1;
            bytes[1] = route.allocation_type.to_raw().0 as u8;
            bytes[4..8].copy_from_slice(&raw.type_.0.to_le_bytes());
            bytes[8..12].copy_from_slice(&raw_id(&raw).to_le_bytes());
        }
    }
    bytes
}

fn decode_route(bytes: &[u8]) -> Option<Route> {
    if bytes.first() != Some(&1) || bytes.len() < 12 {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let location = Location::try_from(raw_location(sys::CUmemLocationType(word(4)), word(8) as i32)).ok()?;
    let allocation_type = AllocationType::try_from(sys::CUmemAllocationType(u32::from(bytes[1]))).ok()?;
    Some(Route::new(location, allocation_type))
}

/// Exports `pool` as a file descriptor and sends it, with the pool's route as the exporter sees
/// it, over `socket`.
pub fn send_pool(socket: &UnixStream, pool: &Pool) -> Result<()> {
    let fd = pool.export_fd()?;
    let mut message = [0u8; POOL_MESSAGE_LEN];
    message[..8].copy_from_slice(POOL_MAGIC);
    message[8..].copy_from_slice(&encode_route(pool.route()));
    send_fd(socket, std::os::fd::AsFd::as_fd(&fd), &message)
}

/// A pool received with [`receive_pool`].
#[derive(Debug)]
pub struct ReceivedPool {
    /// The imported pool.
    pub pool: MemPool,
    /// The route as the exporting process saw it; device ordinals are the exporter's, which
    /// may differ from this process's (a driver 13.2 reports `Location::Invisible` for devices
    /// this process cannot see).
    pub exporter_route: Option<Route>,
}

/// Receives a pool sent with [`send_pool`] and imports it.
pub fn receive_pool(socket: &UnixStream) -> Result<ReceivedPool> {
    let mut message = [0u8; POOL_MESSAGE_LEN];
    let (fd, len) = receive_fd(socket, &mut message)?;
    if len != POOL_MESSAGE_LEN || &message[..8] != POOL_MAGIC {
        return Err(Error::Sharing {
            what: "receiving a pool",
            reason: "the message is not a cumempool pool message (send it with send_pool)".into(),
        });
    }
    let pool = MemPool::import_fd(&fd)?;
    Ok(ReceivedPool { pool, exporter_route: decode_route(&message[8..]) })
}

/// Writes an allocation's export data to `socket`.
pub fn send_allocation(socket: &mut UnixStream, shared: &SharedAllocation) -> Result<()> {
    socket.write_all(&shared.to_bytes()).map_err(|e| io_error("sending an allocation", e))
}

/// Reads an allocation's export data written by [`send_allocation`].
pub fn receive_allocation(socket: &mut UnixStream) -> Result<SharedAllocation> {
    let mut bytes = [0u8; SharedAllocation::ENCODED_LEN];
    socket.read_exact(&mut bytes).map_err(|e| io_error("receiving an allocation", e))?;
    SharedAllocation::from_bytes(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_and_payloads_cross_a_socket() {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let file = std::fs::File::open("/dev/null").expect("/dev/null");
        send_fd(&a, std::os::fd::AsFd::as_fd(&file), b"hello").expect("send");
        let mut payload = [0u8; 16];
        let (fd, len) = receive_fd(&b, &mut payload).expect("receive");
        assert_eq!(&payload[..len], b"hello");
        assert!(fd.as_raw_fd() >= 0 && fd.as_raw_fd() != file.as_raw_fd());
    }

    #[test]
    fn a_message_without_a_descriptor_is_a_clear_error() {
        let (mut a, b) = UnixStream::pair().expect("socketpair");
        a.write_all(b"x").expect("write");
        let error = receive_fd(&b, &mut [0u8; 4]).expect_err("no descriptor");
        assert!(error.to_string().contains("without a descriptor"), "{error}");
        drop(a);
        let error = receive_fd(&b, &mut [0u8; 4]).expect_err("closed");
        assert!(error.to_string().contains("closed"), "{error}");
    }

    #[test]
    fn routes_survive_the_wire() {
        for route in [Route::device(1), Route::host(), Route::host_numa(3), Route::managed(Location::Unspecified)] {
            assert_eq!(decode_route(&encode_route(Some(route))), Some(route));
        }
        assert_eq!(decode_route(&encode_route(None)), None);
    }

    #[test]
    fn truncated_or_garbage_allocation_data_is_refused() {
        assert!(SharedAllocation::from_bytes(&[0u8; 10]).is_err());
        assert!(SharedAllocation::from_bytes(&[0u8; 72]).is_err(), "length 0");
        let mut bytes = [7u8; 72];
        bytes[64..].copy_from_slice(&4096u64.to_le_bytes());
        let shared = SharedAllocation::from_bytes(&bytes).expect("well-formed");
        assert_eq!((shared.len(), shared.to_bytes()), (4096, bytes));
    }
}
