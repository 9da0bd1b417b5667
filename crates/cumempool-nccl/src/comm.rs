//! Communicators: creation (all ranks in one process, or one rank per process from a unique
//! id), stream-ordered collectives, a bounded wait, abort, and destruction on drop.

use crate::bindings::{self, ncclComm_t, ncclResult_t, ncclUniqueId};
use crate::buffers::{DeviceBuffer, Element, ReduceOp};
use crate::error::{check, nccl_error, Error, InvalidArgumentReason, Result};
use crate::loader::nccl;
use crate::ordering::{self, refuse_inside_group, Ordered};
use cumempool::{Context, Device, Stream};
use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

/// What to do instead of creating a communicator inside a group: NCCL creates one only at the
/// group's end, so its rank, size and device, asked at once, are not known yet.
const CREATE_BEFORE_THE_GROUP: &str = "create communicators before the group";

/// What a deregistration answers where a launch could not be covered.
const UNCOVERED: &str = "waiting for a collective launched while a capture began beside it (its registrations stay registered until the communicator is released)";

/// What to do instead of waiting for or aborting a communicator inside a group, whose
/// collectives NCCL launches only at the group's end.
const AFTER_THE_GROUP: &str = "do it after group returns, once NCCL has launched the group's collectives";

/// Ids and ranks this process created communicators from: NCCL would wait for a root that is
/// gone, so a reuse is refused instead.
static USED_IDS: Mutex<Option<HashSet<UsedId>>> = Mutex::new(None);

/// An id's bytes with the rank made from it.
type UsedId = ([u8; UniqueId::LEN], i32);

#[derive(Debug)]
struct RawComm(ncclComm_t);

/// Which communicator a rank belongs to, as far as this process can tell: the ranks one
/// `init_all` call made, or those made here from one unique id, belong to one. Lets calls that
/// take the ranks of one process together (`register_windows`) compare what must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Membership {
    /// The n-th `init_all` call of this process.
    InitAll(u64),
    /// `init_rank` from this id.
    Id(UniqueId),
}

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
    membership: Membership,
    /// Set once the communicator has been handed back to NCCL (`ncclCommDestroy` or
    /// `ncclCommAbort` called, whatever it answered: a refusal may come after NCCL freed part of
    /// it): no call reaches NCCL with it after that. A release that failed before NCCL was
    /// called (the context could not be made current, the function not found) is tried again by
    /// the next `abort`, `destroy` or drop, and registrations are still deregistered meanwhile.
    released: AtomicBool,
    /// Set when `abort` is first called, whatever NCCL answers: no new work is queued from then
    /// on, and a drop that finds the communicator not released aborts it again rather than
    /// destroying it (a destroy would wait for the operations the abort was to stop).
    abort_asked: AtomicBool,
    /// The launch fence: a private stream of this rank's context, made at the first launch and
    /// ordered after every collective launched since (an event each), so that waiting for it
    /// waits for them all. What a deregistration waits for (registration.rs): no capture of the
    /// user's streams can refuse that wait, and it keeps none of their streams alive.
    fence: std::cell::RefCell<Option<Stream>>,
    /// Set where a launch could be covered neither by the fence nor by a host wait (a capture
    /// began beside it): from then on a deregistration cannot know that the collectives are
    /// done, and keeps its registration.
    uncovered: std::cell::Cell<bool>,
    /// Set where NCCL refused to release the communicator: NCCL may still hold its
    /// registrations' mappings, so an arena's spans stay mapped.
    release_refused: AtomicBool,
    not_sync: std::marker::PhantomData<std::cell::Cell<()>>,
}

impl Communicator {
    /// Owns `raw` (destroyed on drop from here on); rank, size and device are asked next.
    fn wrap(raw: ncclComm_t, context: Context, membership: Membership) -> Self {
        Self {
            raw: RawComm(raw),
            rank: 0,
            size: 0,
            device: 0,
            context,
            membership,
            released: AtomicBool::new(false),
            abort_asked: AtomicBool::new(false),
            fence: std::cell::RefCell::new(None),
            uncovered: std::cell::Cell::new(false),
            release_refused: AtomicBool::new(false),
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
    /// device that does not exist; [`Error::InsideGroup`]; NCCL's refusal.
    pub fn init_all(devices: &[i32]) -> Result<Vec<Self>> {
        const WHAT: &str = "creating communicators";
        refuse_inside_group(WHAT, CREATE_BEFORE_THE_GROUP)?;
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
        static CALLS: AtomicU64 = AtomicU64::new(0);
        let membership = Membership::InitAll(CALLS.fetch_add(1, Ordering::Relaxed));
        // Every communicator is owned before any query can fail, so a failure destroys them all.
        let mut comms: Vec<Self> =
            raws.into_iter().zip(contexts).map(|(raw, context)| Self::wrap(raw, context, membership)).collect();
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
    /// id this process already created this rank from (or is creating it from on another
    /// thread); [`Error::InsideGroup`]; NCCL's refusal, after which the same id may be tried
    /// again.
    pub fn init_rank(id: &UniqueId, ranks: i32, rank: i32, device: i32) -> Result<Self> {
        refuse_inside_group("creating a communicator", CREATE_BEFORE_THE_GROUP)?;
        if ranks < 1 || !(0..ranks).contains(&rank) {
            return Err(Error::NoSuchRank { what: "creating a communicator", rank, size: ranks });
        }
        let context = Device::get(device)?.primary_context()?;
        context.make_current()?;
        // Reserved while NCCL joins the ranks, so a second call with the same id and rank is
        // refused meanwhile; given back if the init fails, so the id can be tried again.
        let key = (id.to_bytes(), rank);
        {
            let mut used = USED_IDS.lock().unwrap_or_else(PoisonError::into_inner);
            if !used.get_or_insert_with(HashSet::new).insert(key) {
                return Err(Error::UniqueIdReused { rank });
            }
        }
        let made = Self::init_rank_raw(id, ranks, rank, context);
        if made.is_err() {
            let mut used = USED_IDS.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(used) = used.as_mut() {
                used.remove(&key);
            }
        }
        made
    }

    /// `ncclCommInitRank` and the queries after it.
    fn init_rank_raw(id: &UniqueId, ranks: i32, rank: i32, context: Context) -> Result<Self> {
        let init = nccl()?.ncclCommInitRank()?;
        let mut raw: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the id is passed by value.
        check("ncclCommInitRank", unsafe { init(&mut raw, ranks, id.0, rank) }, None)?;
        let mut comm = Self::wrap(raw, context, Membership::Id(*id));
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

    /// Which communicator this is a rank of.
    pub(crate) fn membership(&self) -> Membership {
        self.membership
    }

    /// The raw communicator, still owned by `self`.
    pub fn as_raw(&self) -> ncclComm_t {
        self.raw.0
    }

    /// The communicator, for new work: refused once aborted (or an abort was asked) or destroyed.
    pub(crate) fn usable(&self) -> Result<ncclComm_t> {
        if self.abort_asked.load(Ordering::Acquire) {
            return Err(Error::Aborted);
        }
        self.held()
    }

    /// The communicator while NCCL still holds it, also after an abort that failed before
    /// reaching NCCL: what deregistering needs (NCCL releases registrations only with the
    /// communicator).
    pub(crate) fn held(&self) -> Result<ncclComm_t> {
        if self.released.load(Ordering::Acquire) {
            return Err(Error::Aborted);
        }
        Ok(self.raw.0)
    }

    pub(crate) fn check(&self, function: &'static str, result: ncclResult_t) -> Result<()> {
        check(function, result, Some(self.raw.0))
    }

    /// Refuses a buffer of another device, or not of a device at all.
    pub(crate) fn check_buffer(
        &self,
        what: &'static str,
        buffer: &(impl DeviceBuffer + ?Sized),
    ) -> Result<*mut c_void> {
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
    /// communicator aborted before. Either way this communicator is unusable afterwards (where
    /// the abort failed before reaching NCCL, which is logged, dropping the communicator aborts
    /// it again).
    /// [`Error::InsideGroup`] inside [`group`](crate::group())'s closure, where nothing has been
    /// launched yet (and an abort could not stop it).
    pub fn wait(&self, stream: &Stream, timeout: Duration) -> Result<()> {
        refuse_inside_group("waiting for a communicator's collectives", AFTER_THE_GROUP)?;
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
    /// resources; every later call answers [`Error::Aborted`], also when the abort failed. An
    /// abort that failed before reaching NCCL leaves the communicator NCCL's: call `abort`
    /// again, or drop it, which aborts it again; its registrations are still deregistered when
    /// dropped. One NCCL refused is not tried again (NCCL may have freed part of it).
    ///
    /// # Errors
    /// [`Error::InsideGroup`] inside [`group`](crate::group())'s closure: NCCL would reclaim the
    /// communicator only at the group's end, beside the launch of the collectives queued for it
    /// there; NCCL's refusal.
    pub fn abort(&self) -> Result<()> {
        refuse_inside_group("aborting a communicator", AFTER_THE_GROUP)?;
        self.abort_asked.store(true, Ordering::Release);
        self.abort_raw()
    }

    /// `ncclCommAbort`, unless NCCL has released the communicator already.
    fn abort_raw(&self) -> Result<()> {
        if self.released.load(Ordering::Acquire) {
            return Ok(());
        }
        let abort = nccl()?.ncclCommAbort()?;
        // Released whatever NCCL answers: a refusal may come after NCCL freed part of it, so it is
        // never handed to NCCL again (a leak, at worst, rather than a second free).
        self.released.store(true, Ordering::Release);
        // SAFETY: a communicator NCCL still held until this call, handed back once (the flag
        // above); no other thread calls NCCL with it meanwhile (not `Sync`).
        let answer = check("ncclCommAbort", unsafe { abort(self.raw.0) }, None);
        self.release_refused.store(answer.is_err(), Ordering::Release);
        answer
    }

    /// Destroys the communicator, reporting NCCL's answer (dropping it only logs a failure).
    /// After an abort that failed, aborts it again instead.
    ///
    /// # Errors
    /// The context's or NCCL's refusal. Where the context refused, the communicator is still
    /// NCCL's, and dropping it, at the end of this call, tries once more (logging a second
    /// failure); one NCCL refused is not handed to NCCL again.
    pub fn destroy(self) -> Result<()> {
        self.release()
    }

    /// Hands the communicator back to NCCL: aborts it again after an abort that failed before
    /// reaching NCCL, destroys it otherwise; nothing once it was handed back.
    fn release(&self) -> Result<()> {
        if self.abort_asked.load(Ordering::Acquire) {
            return self.abort_raw();
        }
        self.destroy_raw()
    }

    /// `ncclCommDestroy` in the device's context, unless NCCL has released the communicator.
    fn destroy_raw(&self) -> Result<()> {
        if self.released.load(Ordering::Acquire) {
            return Ok(());
        }
        self.context.make_current()?;
        let destroy = nccl()?.ncclCommDestroy()?;
        // As in `abort_raw`: released once NCCL is called, whatever it answers.
        self.released.store(true, Ordering::Release);
        // SAFETY: a communicator NCCL still held until this call, handed back once (the flag
        // above); no other thread calls NCCL with it meanwhile (not `Sync`).
        let answer = check("ncclCommDestroy", unsafe { destroy(self.raw.0) }, None);
        self.release_refused.store(answer.is_err(), Ordering::Release);
        answer
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::warn!(%error, rank = self.rank, "releasing a communicator failed; it is leaked");
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

/// Which collective, with what it needs beyond buffers, count and stream.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Collective {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
    Broadcast { root: i32 },
    Send { peer: i32 },
    Recv { peer: i32 },
}

impl Collective {
    /// What it is called in messages, and NCCL's function.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::AllReduce(_) => ("an all-reduce", "ncclAllReduce"),
            Self::AllGather => ("an all-gather", "ncclAllGather"),
            Self::ReduceScatter(_) => ("a reduce-scatter", "ncclReduceScatter"),
            Self::Broadcast { .. } => ("a broadcast", "ncclBroadcast"),
            Self::Send { .. } => ("a send", "ncclSend"),
            Self::Recv { .. } => ("a receive", "ncclRecv"),
        }
    }
}

/// The collectives, one row each: the [`Communicator`] method's name and documentation, its
/// buffers, its arguments between `count` and `stream`, the [`Collective`] they make, and the
/// (send, receive) buffers it is queued with. Hands the rows to `$methods`, which writes one set
/// of methods: [`Communicator`]'s here, [`Group`](crate::Group)'s (launched at the group's end,
/// borrowing for `'env`) in group.rs.
macro_rules! collectives {
    ($methods:ident) => {
        $methods! {
            /// Reduces `count` elements of every rank's `send` into every rank's `recv` (they may be
            /// the same buffer), queued on `stream`, ordered with the buffers' streams (see
            /// [`DeviceBuffer`]). Inside [`group`](crate::group()) use [`Group::all_reduce`](crate::Group::all_reduce).
            ///
            /// # Errors
            /// [`Error::DoesNotFit`], [`Error::WrongDevice`], [`Error::Aborted`];
            /// [`Error::InvalidArgument`] with [`InvalidArgumentReason::OverlapNotInPlace`] where
            /// `send` and `recv` overlap other than in NCCL's in-place layout;
            /// [`cumempool::Error::StreamCapturing`] while `stream` or a buffer's stream captures
            /// (collectives are not recorded into graphs); [`Error::InsideGroup`]; NCCL's refusal.
            fn all_reduce(send, recv; op: ReduceOp) => Collective::AllReduce(op), (send, recv);

            /// Gathers `count` elements from every rank's `send` into every rank's `recv`, rank by rank
            /// (`recv` holds `count * size` elements). Inside [`group`](crate::group()) use [`Group::all_gather`](crate::Group::all_gather).
            ///
            /// # Errors
            /// As [`Communicator::all_reduce`].
            fn all_gather(send, recv;) => Collective::AllGather, (send, recv);

            /// Reduces every rank's `send` (`count * size` elements) and leaves block `rank` of the
            /// result (`count` elements) in each rank's `recv`. Inside [`group`](crate::group()) use
            /// [`Group::reduce_scatter`](crate::Group::reduce_scatter).
            ///
            /// # Errors
            /// As [`Communicator::all_reduce`].
            fn reduce_scatter(send, recv; op: ReduceOp) => Collective::ReduceScatter(op), (send, recv);

            /// Copies `count` elements of `root`'s `send` into every rank's `recv` (`send` is read on
            /// the root only; it may be `recv`). Inside [`group`](crate::group()) use [`Group::broadcast`](crate::Group::broadcast).
            ///
            /// # Errors
            /// [`Error::NoSuchRank`] for a root outside the communicator; as [`Communicator::all_reduce`].
            fn broadcast(send, recv; root: i32) => Collective::Broadcast { root }, (send, recv);

            /// Sends `count` elements of `buffer` to `peer`, which must post a matching receive. Ranks
            /// that both send and receive pair them inside [`group`](crate::group()), with [`Group::send`](crate::Group::send) and
            /// [`Group::recv`](crate::Group::recv).
            ///
            /// # Errors
            /// [`Error::NoSuchRank`]; as [`Communicator::all_reduce`].
            fn send(buffer; peer: i32) => Collective::Send { peer }, (buffer, buffer);

            /// Receives `count` elements from `peer` into `buffer`.
            ///
            /// # Errors
            /// As [`Communicator::send`].
            fn recv(buffer; peer: i32) => Collective::Recv { peer }, (buffer, buffer);
        }
    };
}
pub(crate) use collectives;

/// [`Communicator`]'s collectives, from [`collectives!`]'s rows: launched when called.
macro_rules! communicator_methods {
    ($($(#[$doc:meta])* fn $name:ident($($buffer:ident),+; $($arg:ident: $ty:ty),*) => $collective:expr, ($send:ident, $recv:ident);)*) => {
        impl Communicator {
            $(
                $(#[$doc])*
                pub fn $name<T: Element>(
                    &self,
                    $($buffer: &impl DeviceBuffer,)+
                    count: usize,
                    $($arg: $ty,)*
                    stream: &Stream,
                ) -> Result<()> {
                    self.queue_now::<T>($collective, $send, $recv, count, stream)
                }
            )*
        }
    };
}

collectives!(communicator_methods);

impl Communicator {
    /// Orders the launch fence after the collective just launched on `stream` (after NCCL's
    /// call outside a group, after `ncclGroupEnd` inside one). Where that ordering cannot be
    /// set up, the host waits for `stream` instead, so the fence still covers every launch.
    ///
    /// # Errors
    /// The ordering's failure (the host waited in its place).
    pub(crate) fn fence_after(&self, stream: &Stream) -> Result<()> {
        self.fence()
            .and_then(|fence| fence.order_after(stream))
            .map_err(|error| self.wait_in_place_of_the_fence(stream, error.into()))
    }

    /// The launch fence, made at the first call.
    fn fence(&self) -> cumempool::Result<Stream> {
        // Read into a local first: the borrow ends before the one that stores a new fence.
        let existing = self.fence.borrow().clone();
        if let Some(fence) = existing {
            return Ok(fence);
        }
        let fence = Stream::new(&self.context)?;
        *self.fence.borrow_mut() = Some(fence.clone());
        Ok(fence)
    }

    /// The host waits for `stream` where the fence could not be ordered after it; where that
    /// wait could harm a capture (the legacy stream beside a blocking stream's capture, which
    /// the wait would invalidate) or is refused, the launch stays uncovered instead.
    fn wait_in_place_of_the_fence(&self, stream: &Stream, error: Error) -> Error {
        let waited = match stream.blocked_by_a_capture() {
            Ok(false) => stream.wait_before_release(),
            Ok(true) => Err(cumempool::Error::StreamCapturing { operation: UNCOVERED, capture: None }),
            Err(error) => Err(error),
        };
        if let Err(wait) = waited {
            tracing::warn!(%wait, %error, "a collective the launch fence could not be ordered after could not be waited for either; the communicator's registrations stay registered until it is released");
            self.uncovered.set(true);
        }
        error
    }

    /// Waits on the host until every collective launched on this communicator so far has
    /// finished (the launch fence's work).
    ///
    /// # Errors
    /// [`cumempool::Error::StreamCapturing`] where a launch could not be covered (a capture
    /// began beside it); the fence's wait's refusal.
    pub(crate) fn wait_for_launches(&self) -> cumempool::Result<()> {
        if self.uncovered.get() {
            return Err(cumempool::Error::StreamCapturing { operation: UNCOVERED, capture: None });
        }
        let fence = self.fence.borrow().clone();
        fence.map_or(Ok(()), |fence| fence.wait_before_release())
    }

    /// Whether NCCL refused to release the communicator (its registrations may still be NCCL's).
    pub(crate) fn release_refused(&self) -> bool {
        self.release_refused.load(Ordering::Acquire)
    }

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

    /// A collective outside any group: NCCL launches it when called, so its buffers' streams
    /// are ordered after it at once.
    fn queue_now<T: Element>(
        &self,
        collective: Collective,
        send: &dyn DeviceBuffer,
        recv: &dyn DeviceBuffer,
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (what, _) = collective.names();
        refuse_inside_group(
            what,
            "queue it through the Group the closure was given (group.all_reduce(&comm, ...)), whose buffers outlive the group's launch",
        )?;
        let prepared = self.prepare::<T>(collective, send, recv, count, stream)?;
        let ordered = prepared.order_before()?;
        let launched = prepared.launch();
        // Ordered even when NCCL refused: what it may have queued is then covered too.
        let after = ordered.after();
        let fenced = prepared.fence();
        launched.and(after).and(fenced)
    }

    /// Checks `collective`'s buffers (`count` elements each, times the rank count where it
    /// gathers or scatters; this rank's device; overlapping only where NCCL runs it in place),
    /// its peer, the communicator and the stream's device, and resolves NCCL's function:
    /// everything but the ordering and the launch, so that a group can queue it for its end.
    pub(crate) fn prepare<T: Element>(
        &self,
        collective: Collective,
        send: &dyn DeviceBuffer,
        recv: &dyn DeviceBuffer,
        count: usize,
        stream: &Stream,
    ) -> Result<Prepared<'_>> {
        let (what, _) = collective.names();
        let (send_ranks, recv_ranks) = match collective {
            Collective::AllGather => (1, self.ranks()),
            Collective::ReduceScatter(_) => (self.ranks(), 1),
            _ => (1, 1),
        };
        match collective {
            Collective::Broadcast { root: peer } | Collective::Send { peer } | Collective::Recv { peer } => {
                self.peer(what, peer)?;
            }
            _ => {}
        }
        bytes_of::<T>(what, count, send_ranks, send.byte_len())?;
        bytes_of::<T>(what, count, recv_ranks, recv.byte_len())?;
        let (s, r) = (self.check_buffer(what, send)?, self.check_buffer(what, recv)?);
        self.usable()?;
        match stream.context() {
            // The orderings around the collective record events in the stream's context; without
            // it each would be a host wait.
            None => return Err(Error::InvalidArgument { what, reason: InvalidArgumentReason::StreamWithoutContext }),
            Some(c) if c.device().ordinal() != self.device => {
                return Err(Error::WrongDevice {
                    what,
                    found: "a stream of another device".into(),
                    device: self.device,
                });
            }
            Some(_) => {}
        }
        // `bytes_of` has checked that these products fit the buffers, so they do not overflow.
        let element = std::mem::size_of::<T>();
        let (read, written) = (
            Span { start: s as u64, len: count * element * send_ranks },
            Span { start: r as u64, len: count * element * recv_ranks },
        );
        let accesses = match collective {
            Collective::Send { .. } => Accesses { read: Some(read), written: None },
            Collective::Recv { .. } => Accesses { read: None, written: Some(written) },
            // NCCL reads `send` on the root only.
            Collective::Broadcast { root } if root != self.rank => Accesses { read: None, written: Some(written) },
            _ => {
                refuse_overlap_unless_in_place(what, collective, read, written, self.rank, count * element)?;
                Accesses { read: Some(read), written: Some(written) }
            }
        };
        let nccl = nccl()?;
        // Resolved before anything is queued, so a missing function orders nothing.
        let call = match collective {
            Collective::AllReduce(_) => Call::AllReduce(nccl.ncclAllReduce()?),
            Collective::AllGather => Call::AllGather(nccl.ncclAllGather()?),
            Collective::ReduceScatter(_) => Call::ReduceScatter(nccl.ncclReduceScatter()?),
            Collective::Broadcast { .. } => Call::Broadcast(nccl.ncclBroadcast()?),
            Collective::Send { .. } => Call::Send(nccl.ncclSend()?),
            Collective::Recv { .. } => Call::Recv(nccl.ncclRecv()?),
        };
        Ok(Prepared {
            comm: self,
            collective,
            call,
            send: s,
            recv: r,
            count,
            data_type: T::DATA_TYPE,
            stream: stream.clone(),
            buffer_streams: [send.stream().cloned(), recv.stream().cloned()],
            accesses,
        })
    }
}

/// Bytes a collective reads or writes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub(crate) start: u64,
    pub(crate) len: usize,
}

impl Span {
    fn end(self) -> u64 {
        self.start.saturating_add(self.len as u64)
    }

    fn overlaps(self, other: Span) -> bool {
        self.common(other).is_some()
    }

    /// The bytes both touch, where they overlap.
    fn common(self, other: Span) -> Option<Span> {
        let (start, end) = (self.start.max(other.start), self.end().min(other.end()));
        let len = usize::try_from(end.checked_sub(start)?).ok().filter(|&len| len > 0)?;
        Some(Span { start, len })
    }
}

/// What a collective reads and what it writes, for a group's check that no two of its
/// collectives touch the same bytes where either writes them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Accesses {
    read: Option<Span>,
    written: Option<Span>,
}

impl Accesses {
    /// The bytes that `self` and `other` both touch, where either of them writes: `None` where
    /// the two may run at once.
    pub(crate) fn conflict(&self, other: &Accesses) -> Option<Span> {
        let pairs = [(self.written, other.read), (self.written, other.written), (self.read, other.written)];
        pairs.into_iter().find_map(|(mine, theirs)| mine?.common(theirs?))
    }
}

/// Refuses send and receive buffers that overlap other than the way NCCL runs `collective` in
/// place: the same address for an all-reduce or a broadcast, `send == recv + rank * block` for an
/// all-gather, `recv == send + rank * block` for a reduce-scatter (`block`: one rank's bytes).
/// NCCL reads and writes any other overlap at once, in an order it does not define.
fn refuse_overlap_unless_in_place(
    what: &'static str,
    collective: Collective,
    read: Span,
    written: Span,
    rank: i32,
    block: usize,
) -> Result<()> {
    if !read.overlaps(written) {
        return Ok(());
    }
    let offset = u64::try_from(rank).unwrap_or(0).saturating_mul(block as u64);
    let (in_place, layout) = match collective {
        Collective::AllGather => {
            (read.start == written.start.saturating_add(offset), "send = recv + rank * count elements")
        }
        Collective::ReduceScatter(_) => {
            (written.start == read.start.saturating_add(offset), "recv = send + rank * count elements")
        }
        _ => (read.start == written.start, "the same buffer for send and recv"),
    };
    if in_place {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what,
        reason: InvalidArgumentReason::OverlapNotInPlace { send: read.start, recv: written.start, layout },
    })
}

/// A collective checked by [`Communicator::prepare`], ready to be ordered and launched: at once
/// outside a group, at its end inside one (a group borrows the buffers its pointers name for the
/// whole group).
#[derive(Debug)]
pub(crate) struct Prepared<'c> {
    comm: &'c Communicator,
    collective: Collective,
    call: Call,
    send: *mut c_void,
    recv: *mut c_void,
    count: usize,
    data_type: bindings::ncclDataType_t,
    stream: Stream,
    buffer_streams: [Option<Stream>; 2],
    pub(crate) accesses: Accesses,
}

impl Prepared<'_> {
    /// What it is called in messages.
    pub(crate) fn what(&self) -> &'static str {
        self.collective.names().0
    }

    /// Orders its communicator's launch fence after it, once launched.
    pub(crate) fn fence(&self) -> Result<()> {
        self.comm.fence_after(&self.stream)
    }

    /// Whether its communicator can still be used (not aborted or destroyed).
    pub(crate) fn usable(&self) -> Result<()> {
        self.comm.usable().map(|_| ())
    }

    /// The first half of its ordering: refuses a capture underway on its stream or a buffer's
    /// (NCCL's kernels would be recorded into a graph that outlives the buffers), then makes its
    /// stream wait for the buffers' streams. Asked right before the launch, so the work queued
    /// on the buffers until then comes first.
    pub(crate) fn order_before(&self) -> Result<Ordered> {
        let [send, recv] = &self.buffer_streams;
        ordering::before(self.what(), &self.stream, [send.as_ref(), recv.as_ref()])
    }

    /// Calls NCCL: launches it, or queues it for the group's end inside `ncclGroupStart`.
    pub(crate) fn launch(&self) -> Result<()> {
        let raw = self.comm.usable()?;
        self.stream.bind()?;
        let (s, r, count, dt) = (self.send, self.recv, self.count, self.data_type);
        let st: bindings::cudaStream_t = self.stream.as_raw().cast();
        // SAFETY: both buffers were checked by `prepare` for what the collective reads and
        // writes, on this rank's device, and are borrowed until it has finished (by the caller
        // outside a group, for `'env` inside one); their streams are ordered after it by the
        // caller; a live communicator; a stream of its device.
        let result = unsafe {
            match (self.call, self.collective) {
                (Call::AllReduce(f), Collective::AllReduce(op)) => f(s, r, count, dt, op.to_raw(), raw, st),
                (Call::AllGather(f), _) => f(s, r, count, dt, raw, st),
                (Call::ReduceScatter(f), Collective::ReduceScatter(op)) => f(s, r, count, dt, op.to_raw(), raw, st),
                (Call::Broadcast(f), Collective::Broadcast { root }) => f(s, r, count, dt, root, raw, st),
                (Call::Send(f), Collective::Send { peer }) => f(s, count, dt, peer, raw, st),
                (Call::Recv(f), Collective::Recv { peer }) => f(r, count, dt, peer, raw, st),
                _ => ncclResult_t::ncclInternalError,
            }
        };
        self.comm.check(self.collective.names().1, result)
    }
}

/// NCCL's function for a [`Collective`], resolved.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce(bindings::PFN_ncclAllReduce),
    AllGather(bindings::PFN_ncclAllGather),
    ReduceScatter(bindings::PFN_ncclReduceScatter),
    Broadcast(bindings::PFN_ncclBroadcast),
    Send(bindings::PFN_ncclSend),
    Recv(bindings::PFN_ncclRecv),
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
