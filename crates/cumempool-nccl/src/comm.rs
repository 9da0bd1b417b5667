//! Communicators: creation (all ranks in one process, or one rank per process from a unique
//! id), stream-ordered collectives, a bounded wait, abort, and destruction on drop.

use crate::bindings::{self, ncclComm_t, ncclResult_t, ncclUniqueId};
use crate::buffers::{DeviceBuffer, Element, ReduceOp};
use crate::error::{check, nccl_error, Error, InvalidArgumentReason, Result};
use crate::loader::nccl;
use cumempool::{Context, Device, Stream};
use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The 128-byte unique id that names a communicator before it exists: made once (by rank 0,
/// usually) and given to every rank.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId(ncclUniqueId);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

const ID_MAGIC: &[u8; 8] = b"CMNCCL01";
/// The size of [`UniqueId::send`]'s message: magic, rank count, id.
pub const ID_MESSAGE_LEN: usize = 8 + 4 + UniqueId::LEN;

impl UniqueId {
    /// The size of [`UniqueId::to_bytes`].
    pub const LEN: usize = bindings::NCCL_UNIQUE_ID_BYTES as usize;

    /// A fresh id (`ncclGetUniqueId`), which also starts the bootstrap root this process serves.
    pub fn new() -> Result<Self> {
        let mut id = ncclUniqueId::default();
        let get = nccl()?.ncclGetUniqueId()?;
        // SAFETY: a valid out-pointer.
        check("ncclGetUniqueId", unsafe { get(&mut id) }, None)?;
        Ok(Self(id))
    }

    /// The 128 bytes, for any transport between ranks.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        self.0.internal.map(|c| c as u8)
    }

    /// From [`UniqueId::to_bytes`]'s bytes.
    ///
    /// # Errors
    /// [`Error::MalformedId`] for a length other than 128.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: &[u8; Self::LEN] = bytes.try_into().map_err(|_| Error::MalformedId {
            reason: format!("got {} bytes, a unique id has {}", bytes.len(), Self::LEN),
        })?;
        Ok(Self(ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) }))
    }

    /// Sends the id with the communicator's size over any byte stream (a Unix or TCP socket):
    /// [`UniqueId::receive`] refuses a size that differs from its own.
    pub fn send(&self, ranks: i32, mut to: impl Write) -> Result<()> {
        let mut message = [0u8; ID_MESSAGE_LEN];
        message[..8].copy_from_slice(ID_MAGIC);
        message[8..12].copy_from_slice(&ranks.to_le_bytes());
        message[12..].copy_from_slice(&self.to_bytes());
        to.write_all(&message)
            .and_then(|()| to.flush())
            .map_err(|source| Error::Io { what: "sending a unique id", source })
    }

    /// Receives an id sent with [`UniqueId::send`] for a communicator of `ranks` ranks.
    ///
    /// # Errors
    /// [`Error::RankCountMismatch`] when the sender announced another size;
    /// [`Error::MalformedId`] for bytes that are no such message; [`Error::Io`].
    pub fn receive(ranks: i32, mut from: impl Read) -> Result<Self> {
        let mut message = [0u8; ID_MESSAGE_LEN];
        from.read_exact(&mut message).map_err(|source| Error::Io { what: "receiving a unique id", source })?;
        if &message[..8] != ID_MAGIC {
            return Err(Error::MalformedId { reason: "the message does not start with UniqueId::send's magic".into() });
        }
        let mut sent = [0u8; 4];
        sent.copy_from_slice(&message[8..12]);
        let sent = i32::from_le_bytes(sent);
        if sent != ranks {
            return Err(Error::RankCountMismatch { sent, expected: ranks });
        }
        Self::from_bytes(&message[12..])
    }
}

/// Ids and ranks this process created communicators from: NCCL would wait for a root that is
/// gone, so a reuse is refused instead.
static USED_IDS: Mutex<Option<HashSet<UsedId>>> = Mutex::new(None);

/// An id's bytes with the rank made from it.
type UsedId = ([u8; UniqueId::LEN], i32);

#[derive(Debug)]
struct RawComm(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one thread at a time; the
// communicator that owns this is Send but not Sync.
unsafe impl Send for RawComm {}

/// One rank of an NCCL communicator, destroyed when dropped (unless aborted).
///
/// Collectives are stream-ordered: they return once queued on the stream. NCCL allows one
/// thread at a time per communicator, so a communicator is `Send` but not `Sync`.
#[derive(Debug)]
pub struct Communicator {
    raw: RawComm,
    rank: i32,
    size: i32,
    device: i32,
    context: Context,
    /// Set once aborted or destroyed: no later call reaches NCCL with it.
    gone: AtomicBool,
    not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

impl Communicator {
    /// Owns `raw` (destroyed on drop from here on); rank, size and device are asked next.
    fn wrap(raw: ncclComm_t, context: Context) -> Self {
        Self {
            raw: RawComm(raw),
            rank: 0,
            size: 0,
            device: 0,
            context,
            gone: AtomicBool::new(false),
            not_sync: std::marker::PhantomData,
        }
    }

    fn query(&mut self) -> Result<()> {
        let nccl = nccl()?;
        let raw = self.raw.0;
        // SAFETY: a live communicator and valid out-pointers.
        unsafe {
            check("ncclCommUserRank", nccl.ncclCommUserRank()?(raw, &mut self.rank), Some(raw))?;
            check("ncclCommCount", nccl.ncclCommCount()?(raw, &mut self.size), Some(raw))?;
            check("ncclCommCuDevice", nccl.ncclCommCuDevice()?(raw, &mut self.device), Some(raw))
        }
    }

    /// One communicator per device, all in this process (`ncclCommInitAll`): rank `i` runs on
    /// `devices[i]`. With one device, a one-rank communicator whose collectives are copies.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty or repeated device list; the CUDA errors of a
    /// device that does not exist; NCCL's refusal.
    pub fn init_all(devices: &[i32]) -> Result<Vec<Self>> {
        const WHAT: &str = "creating communicators";
        if devices.is_empty() {
            return Err(Error::InvalidArgument { what: WHAT, reason: InvalidArgumentReason::NoDevices });
        }
        let mut seen = HashSet::new();
        if let Some(&device) = devices.iter().find(|&&d| !seen.insert(d)) {
            return Err(Error::InvalidArgument {
                what: WHAT,
                reason: InvalidArgumentReason::RepeatedDevice { device },
            });
        }
        let contexts = devices
            .iter()
            .map(|&d| Device::get(d).and_then(Device::primary_context))
            .collect::<cumempool::Result<Vec<_>>>()?;
        let count = c_int::try_from(devices.len()).map_err(|_| Error::InvalidArgument {
            what: WHAT,
            reason: InvalidArgumentReason::TooManyDevices { count: devices.len() },
        })?;
        let init = nccl()?.ncclCommInitAll()?;
        let mut raws: Vec<ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `raws` has room for `count` communicators; the device list lives for the call.
        check("ncclCommInitAll", unsafe { init(raws.as_mut_ptr(), count, devices.as_ptr()) }, None)?;
        // Every communicator is owned before any query can fail, so a failure destroys them all.
        let mut comms: Vec<Self> =
            raws.into_iter().zip(contexts).map(|(raw, context)| Self::wrap(raw, context)).collect();
        for comm in &mut comms {
            comm.query()?;
        }
        Ok(comms)
    }

    /// This process's rank `rank` of a communicator of `ranks` ranks named by `id`, on
    /// `device` (`ncclCommInitRank`). Blocks until every rank has joined.
    ///
    /// # Errors
    /// [`Error::NoSuchRank`] for a rank outside `0..ranks`; [`Error::UniqueIdReused`] for an
    /// id this process already created this rank from; NCCL's refusal.
    pub fn init_rank(id: &UniqueId, ranks: i32, rank: i32, device: i32) -> Result<Self> {
        if ranks < 1 || !(0..ranks).contains(&rank) {
            return Err(Error::NoSuchRank { what: "creating a communicator", rank, size: ranks });
        }
        let context = Device::get(device)?.primary_context()?;
        context.make_current()?;
        let key = (id.to_bytes(), rank);
        {
            let mut used = USED_IDS.lock().unwrap_or_else(PoisonError::into_inner);
            if !used.get_or_insert_with(HashSet::new).insert(key) {
                return Err(Error::UniqueIdReused { rank });
            }
        }
        let init = nccl()?.ncclCommInitRank()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the id is passed by value.
        check("ncclCommInitRank", unsafe { init(&mut raw, ranks, id.0, rank) }, None)?;
        let mut comm = Self::wrap(raw, context);
        comm.query()?;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> i32 {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> i32 {
        self.size
    }

    /// The device this rank runs on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The raw communicator, still owned by `self`.
    pub fn as_raw(&self) -> ncclComm_t {
        self.raw.0
    }

    pub(crate) fn usable(&self) -> Result<ncclComm_t> {
        if self.gone.load(Ordering::Acquire) {
            return Err(Error::Aborted);
        }
        Ok(self.raw.0)
    }

    pub(crate) fn check(&self, function: &'static str, result: ncclResult_t) -> Result<()> {
        check(function, result, Some(self.raw.0))
    }

    /// Refuses a buffer of another device, or not of a device at all.
    pub(crate) fn check_buffer(&self, what: &'static str, buffer: &impl DeviceBuffer) -> Result<*mut c_void> {
        match buffer.device() {
            Ok(device) if device == self.device => Ok(buffer.device_ptr() as *mut c_void),
            Ok(device) => Err(Error::WrongDevice { what, found: format!("on device {device}"), device: self.device }),
            Err(found) => Err(Error::WrongDevice { what, found, device: self.device }),
        }
    }

    /// NCCL's asynchronous error, if any (`ncclCommGetAsyncError`): a peer's failure shows here
    /// while the stream waits.
    pub fn async_error(&self) -> Result<()> {
        let raw = self.usable()?;
        let mut state = ncclResult_t::ncclSuccess;
        let get = nccl()?.ncclCommGetAsyncError()?;
        // SAFETY: a live communicator and a valid out-pointer.
        self.check("ncclCommGetAsyncError", unsafe { get(raw, &mut state) })?;
        if state == ncclResult_t::ncclSuccess || state == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        Err(self.error("ncclCommGetAsyncError", state))
    }

    #[cold]
    fn error(&self, function: &'static str, result: ncclResult_t) -> Error {
        nccl_error(function, result, Some(self.raw.0))
    }

    /// Waits for the work queued on `stream` (this rank's collectives among it), polling NCCL's
    /// asynchronous error, for at most `timeout`. On an error or at the timeout the communicator
    /// is aborted (its kernels stop), so a peer that died never leaves this rank hanging.
    ///
    /// # Errors
    /// [`Error::Timeout`] at the timeout; NCCL's asynchronous error; [`Error::Aborted`] for a
    /// communicator aborted before. Either way this communicator is unusable afterwards.
    pub fn wait(&self, stream: &Stream, timeout: Duration) -> Result<()> {
        self.usable()?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            if stream.is_idle()? {
                return self.async_error();
            }
            if let Err(error) = self.async_error() {
                self.abort_quietly();
                return Err(error);
            }
            if start.elapsed() >= timeout {
                self.abort_quietly();
                return Err(Error::Timeout { what: "waiting for the stream's collectives", waited: start.elapsed() });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    fn abort_quietly(&self) {
        if let Err(error) = self.abort() {
            tracing::warn!(%error, "aborting a communicator failed");
        }
    }

    /// Aborts the communicator (`ncclCommAbort`): its pending operations stop and it frees its
    /// resources; every later call answers [`Error::Aborted`].
    pub fn abort(&self) -> Result<()> {
        if self.gone.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let abort = nccl()?.ncclCommAbort()?;
        // SAFETY: a live communicator, aborted once (the flag above).
        check("ncclCommAbort", unsafe { abort(self.raw.0) }, None)
    }

    /// Destroys the communicator, reporting NCCL's answer (dropping it only logs a failure).
    pub fn destroy(self) -> Result<()> {
        self.destroy_raw()
    }

    /// Destroys the communicator once: marks it gone first, so `Drop` after `destroy` (or a
    /// failed destroy) does not call NCCL again.
    fn destroy_raw(&self) -> Result<()> {
        if self.gone.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.context.make_current()?;
        let destroy = nccl()?.ncclCommDestroy()?;
        // SAFETY: a live communicator, destroyed once (the flag above).
        check("ncclCommDestroy", unsafe { destroy(self.raw.0) }, None)
    }

    fn queue<R>(
        &self,
        what: &'static str,
        stream: &Stream,
        call: impl FnOnce(ncclComm_t, bindings::cudaStream_t) -> Result<R>,
    ) -> Result<R> {
        let raw = self.usable()?;
        if stream.context().is_some_and(|c| c.device().ordinal() != self.device) {
            return Err(Error::WrongDevice { what, found: "a stream of another device".into(), device: self.device });
        }
        stream.bind()?;
        call(raw, stream.as_raw().cast())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Err(error) = self.destroy_raw() {
            tracing::warn!(%error, rank = self.rank, "destroying a communicator failed");
        }
    }
}

/// `count` elements of `T`, times `ranks`, in bytes, checked against `capacity`.
fn bytes_of<T: Element>(what: &'static str, count: usize, ranks: usize, capacity: usize) -> Result<()> {
    let element_size = std::mem::size_of::<T>();
    let fits = count.checked_mul(element_size).and_then(|b| b.checked_mul(ranks)).is_some_and(|b| b <= capacity);
    if fits {
        Ok(())
    } else {
        Err(Error::DoesNotFit { what, count, element_size, ranks, capacity })
    }
}

impl Communicator {
    fn ranks(&self) -> usize {
        usize::try_from(self.size).unwrap_or(0)
    }

    fn peer(&self, what: &'static str, peer: i32) -> Result<()> {
        if (0..self.size).contains(&peer) {
            Ok(())
        } else {
            Err(Error::NoSuchRank { what, rank: peer, size: self.size })
        }
    }

    /// Reduces `count` elements of every rank's `send` into every rank's `recv` (they may be
    /// the same buffer), queued on `stream`.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`], [`Error::WrongDevice`], [`Error::Aborted`]; NCCL's refusal.
    pub fn all_reduce<T: Element>(
        &self,
        send: &impl DeviceBuffer,
        recv: &impl DeviceBuffer,
        count: usize,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let function = nccl()?.ncclAllReduce()?;
        self.collective::<T>(("all-reduce", "ncclAllReduce"), send, recv, (count, 1, 1), stream, |s, r, comm, st| {
            // SAFETY: `collective` checked both buffers for `count` elements of this device.
            unsafe { function(s, r, count, T::DATA_TYPE, op.to_raw(), comm, st) }
        })
    }

    /// Gathers `count` elements from every rank's `send` into every rank's `recv`, rank by rank
    /// (`recv` holds `count * size` elements).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn all_gather<T: Element>(
        &self,
        send: &impl DeviceBuffer,
        recv: &impl DeviceBuffer,
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        let function = nccl()?.ncclAllGather()?;
        self.collective::<T>(
            ("all-gather", "ncclAllGather"),
            send,
            recv,
            (count, 1, self.ranks()),
            stream,
            |s, r, comm, st| {
                // SAFETY: `collective` checked `count` elements in `send`, `count * size` in `recv`.
                unsafe { function(s, r, count, T::DATA_TYPE, comm, st) }
            },
        )
    }

    /// Reduces every rank's `send` (`count * size` elements) and leaves block `rank` of the
    /// result (`count` elements) in each rank's `recv`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &impl DeviceBuffer,
        recv: &impl DeviceBuffer,
        count: usize,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let function = nccl()?.ncclReduceScatter()?;
        self.collective::<T>(
            ("reduce-scatter", "ncclReduceScatter"),
            send,
            recv,
            (count, self.ranks(), 1),
            stream,
            |s, r, comm, st| {
                // SAFETY: `collective` checked `count * size` elements in `send`, `count` in `recv`.
                unsafe { function(s, r, count, T::DATA_TYPE, op.to_raw(), comm, st) }
            },
        )
    }

    /// Copies `count` elements of `root`'s `send` into every rank's `recv` (`send` is read on
    /// the root only; it may be `recv`).
    ///
    /// # Errors
    /// [`Error::NoSuchRank`] for a root outside the communicator; as [`Communicator::all_reduce`].
    pub fn broadcast<T: Element>(
        &self,
        send: &impl DeviceBuffer,
        recv: &impl DeviceBuffer,
        count: usize,
        root: i32,
        stream: &Stream,
    ) -> Result<()> {
        self.peer("broadcast", root)?;
        let function = nccl()?.ncclBroadcast()?;
        self.collective::<T>(("broadcast", "ncclBroadcast"), send, recv, (count, 1, 1), stream, |s, r, comm, st| {
            // SAFETY: `collective` checked both buffers; the root is a rank.
            unsafe { function(s, r, count, T::DATA_TYPE, root, comm, st) }
        })
    }

    /// Sends `count` elements of `buffer` to `peer`, which must post a matching
    /// [`Communicator::recv`]; pair them inside [`group`] when ranks both send and receive.
    ///
    /// # Errors
    /// [`Error::NoSuchRank`]; as [`Communicator::all_reduce`].
    pub fn send<T: Element>(&self, buffer: &impl DeviceBuffer, count: usize, peer: i32, stream: &Stream) -> Result<()> {
        self.peer("send", peer)?;
        let function = nccl()?.ncclSend()?;
        self.collective::<T>(("send", "ncclSend"), buffer, buffer, (count, 1, 1), stream, |s, _, comm, st| {
            // SAFETY: `collective` checked the buffer; the peer is a rank.
            unsafe { function(s, count, T::DATA_TYPE, peer, comm, st) }
        })
    }

    /// Receives `count` elements from `peer` into `buffer`.
    ///
    /// # Errors
    /// As [`Communicator::send`].
    pub fn recv<T: Element>(&self, buffer: &impl DeviceBuffer, count: usize, peer: i32, stream: &Stream) -> Result<()> {
        self.peer("receive", peer)?;
        let function = nccl()?.ncclRecv()?;
        self.collective::<T>(("receive", "ncclRecv"), buffer, buffer, (count, 1, 1), stream, |_, r, comm, st| {
            // SAFETY: `collective` checked the buffer; the peer is a rank.
            unsafe { function(r, count, T::DATA_TYPE, peer, comm, st) }
        })
    }

    /// `function` (the NCCL call, doing `what`) after checking that `send` holds `count * send_ranks` elements and `recv` `count * recv_ranks`,
    /// both of this rank's device, then queues `call` with their addresses on `stream`.
    fn collective<T: Element>(
        &self,
        (what, function): (&'static str, &'static str),
        send: &impl DeviceBuffer,
        recv: &impl DeviceBuffer,
        (count, send_ranks, recv_ranks): (usize, usize, usize),
        stream: &Stream,
        call: impl FnOnce(*const c_void, *mut c_void, ncclComm_t, bindings::cudaStream_t) -> ncclResult_t,
    ) -> Result<()> {
        bytes_of::<T>(what, count, send_ranks, send.byte_len())?;
        bytes_of::<T>(what, count, recv_ranks, recv.byte_len())?;
        let (s, r) = (self.check_buffer(what, send)?, self.check_buffer(what, recv)?);
        self.queue(what, stream, |comm, st| self.check(function, call(s, r, comm, st)))
    }
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`, so NCCL launches them together:
/// needed for send/recv pairs and for driving several communicators from one thread. The group
/// is ended even when `calls` fails.
///
/// # Errors
/// The first failure of `calls`, else `ncclGroupEnd`'s.
pub fn group<T>(calls: impl FnOnce() -> Result<T>) -> Result<T> {
    let nccl = nccl()?;
    let (start, end) = (nccl.ncclGroupStart()?, nccl.ncclGroupEnd()?);
    // SAFETY: no arguments; balanced by the end below.
    check("ncclGroupStart", unsafe { start() }, None)?;
    let outcome = calls();
    // SAFETY: ends the group started above.
    let ended = check("ncclGroupEnd", unsafe { end() }, None);
    let value = outcome?;
    ended.map(|()| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_or_repeated_device_list_is_refused_with_a_reason_to_match() {
        let empty = Communicator::init_all(&[]).map(|_| ());
        assert!(
            matches!(empty, Err(Error::InvalidArgument { reason: InvalidArgumentReason::NoDevices, .. })),
            "{empty:?}"
        );
        let repeated = Communicator::init_all(&[3, 1, 3]).map(|_| ());
        assert!(
            matches!(
                repeated,
                Err(Error::InvalidArgument { reason: InvalidArgumentReason::RepeatedDevice { device: 3 }, .. })
            ),
            "{repeated:?}"
        );
        let text = repeated.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(text, "creating communicators: device 3 is named more than once; name each device once");
    }

    #[test]
    fn ids_travel_with_the_rank_count_and_a_disagreeing_count_is_refused() {
        let id = UniqueId::from_bytes(&[7u8; UniqueId::LEN]).unwrap();
        let mut wire = Vec::new();
        id.send(4, &mut wire).unwrap();
        assert_eq!(wire.len(), ID_MESSAGE_LEN);
        assert_eq!(UniqueId::receive(4, wire.as_slice()).unwrap(), id);
        assert!(matches!(
            UniqueId::receive(2, wire.as_slice()),
            Err(Error::RankCountMismatch { sent: 4, expected: 2 })
        ));
        wire[0] = b'X';
        assert!(matches!(UniqueId::receive(4, wire.as_slice()), Err(Error::MalformedId { .. })));
        assert!(matches!(UniqueId::receive(4, &wire[..10]), Err(Error::Io { .. })));
        assert!(matches!(UniqueId::from_bytes(&[0; 127]), Err(Error::MalformedId { .. })));
    }

    #[test]
    fn counts_that_overflow_or_exceed_the_buffer_are_refused() {
        assert!(bytes_of::<f32>("t", 16, 1, 64).is_ok());
        assert!(matches!(bytes_of::<f32>("t", 17, 1, 64), Err(Error::DoesNotFit { count: 17, .. })));
        assert!(bytes_of::<f64>("t", usize::MAX / 4, 1, usize::MAX).is_err(), "the byte count overflows");
        assert!(bytes_of::<u8>("t", 32, 2, 64).is_ok() && bytes_of::<u8>("t", 33, 2, 64).is_err());
    }
}
