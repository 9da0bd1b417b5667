//! A VMM arena: one reserved range of addresses that grows by mapping physical chunks on
//! demand and shrinks by unmapping them, so it grows without moving (like PyTorch's expandable
//! segments) and its memory is what NCCL can register for zero-copy transfers.
//!
//! ```no_run
//! use cumempool::{Device, Stream};
//! use cumempool_alloc::{Arena, CachingResource, StreamOrderedResource};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let context = Device::get(0)?.primary_context()?;
//! let stream = Stream::new(&context)?;
//! let arena = Arena::builder(0, 64 << 30).build()?; // 64 GiB of addresses, no memory yet
//! let cache = CachingResource::new(&arena);
//! let block = cache.alloc(1 << 20, &stream)?; // maps one chunk
//! # drop(block);
//! # Ok(()) }
//! ```
//!
//! An allocation that owns its chunks (a multiple of the chunk size, aligned to it:
//! `arena.allocate(k * chunk, chunk, &stream)`) can be shared with another process through
//! [`Arena::export_fd`]; one that shares a chunk with others cannot, since a peer maps whole
//! chunks and would reach the neighbours.
//!
//! Frees are stream-ordered: a freed span is reused once an event recorded on the freeing
//! stream has completed (checked without waiting at each allocation; waited for only when
//! nothing else fits, and by [`Arena::trim`]).
//!
//! Spans are not graph memory, so an arena serves no capture: allocating on a stream that
//! captures into a graph is refused (the captured work would run again at each launch, after
//! the span may have been freed and handed out again). A span freed on a capturing stream is
//! kept until the capture has ended, then until the stream's work has passed the free: an
//! event recorded into the capture could never be asked about (`cuEventQuery` answers
//! CUDA_ERROR_CAPTURED_EVENT for it).

use crate::error::{Error, Result};
use crate::memory_kind::DeviceMemory;
use crate::resource::{CaptureMark, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool::sys::{CUdeviceptr, CUresult};
use cumempool::vmm::{AddressRange, AllocationProperties, PhysicalAllocation};
use cumempool::{Access, Context, Device, Event, HandleTypes, InvalidArgumentReason, Stream};
use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
#[cfg(unix)]
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// What [`Arena::builder`] needs beyond the device and the range: chunk size, export handle
/// types, GPUDirect RDMA and peers.
#[derive(Clone, Debug)]
pub struct ArenaBuilder {
    device: i32,
    reserve: usize,
    chunk: Option<usize>,
    props: AllocationProperties,
    peers: Vec<(i32, Access)>,
}

impl ArenaBuilder {
    /// The size of each physical chunk: a multiple of the minimum granularity (default: the
    /// device's recommended granularity, 2 MiB on current GPUs). Larger chunks mean fewer
    /// mappings (and fewer NCCL registrations), smaller ones a tighter fit.
    #[must_use]
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk = Some(bytes);
        self
    }

    /// The handle types chunks may be exported as ([`Arena::export_fd`] needs
    /// `POSIX_FILE_DESCRIPTOR`).
    #[must_use]
    pub fn export_handle_types(mut self, types: HandleTypes) -> Self {
        self.props = self.props.handle_types(types);
        self
    }

    /// Whether network adapters may access the memory directly (`gpuDirectRDMACapable`).
    #[must_use]
    pub fn gpu_direct_rdma(mut self, capable: bool) -> Self {
        self.props = self.props.gpu_direct_rdma(capable);
        self
    }

    /// Grants a peer device access to every chunk, mapped now or later. Without it only the
    /// owning device has access; see also [`Arena::grant_access`].
    #[must_use]
    pub fn peer_access(mut self, device: i32, access: Access) -> Self {
        self.peers.push((device, access));
        self
    }

    /// Reserves the range (rounded up to whole chunks). No memory is created yet.
    ///
    /// # Errors
    /// [`Error::Pool`] with [`cumempool::Error::InvalidArgument`] for a chunk size that is not a
    /// multiple of the granularity or a peer that is the owning device; the driver's answers.
    pub fn build(self) -> Result<Arena> {
        let context = Device::get(self.device)?.primary_context()?;
        context.make_current()?;
        let granularity = self.props.granularity()?;
        let chunk = self.chunk.unwrap_or(granularity.recommended);
        if chunk == 0 || !chunk.is_multiple_of(granularity.minimum) {
            return Err(invalid(InvalidArgumentReason::NotGranularityMultiple {
                quantity: "the chunk size",
                value: chunk,
                granularity: granularity.minimum,
            }));
        }
        check_peers(self.device, &self.peers)?;
        let reserve =
            self.reserve.max(1).div_ceil(chunk).checked_mul(chunk).ok_or_else(|| {
                invalid(InvalidArgumentReason::RoundingOverflows { bytes: self.reserve, unit: chunk })
            })?;
        let range = AddressRange::reserve(reserve, chunk)?;
        check_range_end(&range, "building a VMM arena")?;
        let mut free = BTreeMap::new();
        free.insert(0, reserve);
        let state = State {
            chunks: BTreeMap::new(),
            free,
            live: BTreeMap::new(),
            pending: Vec::new(),
            peers: self.peers,
            holds: 0,
        };
        Ok(Arena { range: ManuallyDrop::new(range), props: self.props, chunk, context, state: Mutex::new(state) })
    }
}

fn invalid(reason: InvalidArgumentReason) -> Error {
    Error::Pool(cumempool::Error::InvalidArgument { what: "building a VMM arena", reason })
}

/// Refuses a range whose end would pass the end of the address space, so that every offset
/// into it (at most its length) names an address without wrapping.
fn check_range_end(range: &AddressRange, what: &'static str) -> Result<()> {
    if range.base().checked_add(range.len() as u64).is_none() {
        return Err(Error::Pool(cumempool::Error::InvalidArgument {
            what,
            reason: InvalidArgumentReason::RangePastAddressSpace { start: range.base(), size: range.len() },
        }));
    }
    Ok(())
}

/// The address `offset` bytes into `range`: exact for offsets up to its length, which
/// [`check_range_end`] let through; never wraps.
fn address_in(range: &AddressRange, offset: usize) -> CUdeviceptr {
    range.base().saturating_add(offset as u64)
}

fn check_peers(owner: i32, peers: &[(i32, Access)]) -> Result<()> {
    if let Some((device, _)) = peers.iter().find(|(device, _)| *device == owner) {
        return Err(invalid(InvalidArgumentReason::OwnerNamedAsPeer { device: *device }));
    }
    Ok(())
}

/// What says that the stream of a pending free has passed it.
#[derive(Debug)]
enum FreedAfter {
    /// An event recorded on the freeing stream after the free, and that stream.
    Event(Event, Stream),
    /// The free was on a stream capturing into a graph, where an event would be recorded into
    /// the capture and never answer a query. Once the capture has ended, an event recorded on
    /// the stream follows the work queued before the capture.
    CaptureEnd(Stream),
}

/// The arena's bookkeeping, under one lock.
///
/// Every span it records lies inside the range: `offset + len` is at most the reserved length
/// ([`State::take`] checks that with checked arithmetic), so sums of recorded offsets and
/// lengths cannot overflow; they saturate all the same, so a broken invariant never wraps.
#[derive(Debug)]
struct State {
    /// Mapped chunks by index (offset / chunk size).
    chunks: BTreeMap<usize, PhysicalAllocation>,
    /// Free spans of the whole range (mapped or not), by offset, coalesced.
    free: BTreeMap<usize, usize>,
    /// Live allocations by offset.
    live: BTreeMap<usize, usize>,
    /// Freed spans `(offset, len)` whose stream had not reached the free yet.
    pending: Vec<(FreedAfter, usize, usize)>,
    peers: Vec<(i32, Access)>,
    /// Registrations (NCCL's) that need every chunk to stay mapped.
    holds: usize,
}

impl State {
    fn give_back(&mut self, offset: usize, len: usize) {
        let (mut start, mut end) = (offset, offset.saturating_add(len));
        if let Some((&before, &size)) = self.free.range(..start).next_back() {
            if before.saturating_add(size) == start {
                self.free.remove(&before);
                start = before;
            }
        }
        if let Some(size) = self.free.remove(&end) {
            end = end.saturating_add(size);
        }
        self.free.insert(start, end - start);
    }

    /// Moves pending frees whose stream has passed them to the free list; as `settle` says,
    /// waits for each stream first, except one still capturing (a capture cannot be waited for).
    ///
    /// A free that cannot be checked stays pending (its span is not reused on a guess) and the
    /// others are settled all the same, so one failing check never stops the arena.
    ///
    /// # Errors
    /// The first check that failed.
    fn settle(&mut self, context: &Context, settle: Settle) -> Result<()> {
        let mut first_error = None;
        let mut index = 0;
        while index < self.pending.len() {
            match passed(&mut self.pending[index].0, context, settle) {
                Ok(true) => {
                    let (_, offset, len) = self.pending.swap_remove(index);
                    self.give_back(offset, len);
                    continue;
                }
                Ok(false) => {}
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
            index += 1;
        }
        first_error.map_or(Ok(()), Err)
    }

    /// First fit of `bytes` aligned to `align` (relative to the chunk-aligned base). A span
    /// whose aligned start or end cannot be computed without overflow does not fit: no request,
    /// however large, wraps around to an offset that is in use.
    fn take(&mut self, base: CUdeviceptr, bytes: usize, align: usize) -> Option<usize> {
        let found = self.free.iter().find_map(|(&offset, &len)| {
            let end = offset.checked_add(len)?;
            let address = base.checked_add(u64::try_from(offset).ok()?)?;
            let aligned = address.checked_next_multiple_of(u64::try_from(align).ok()?)?;
            let start = usize::try_from(aligned.checked_sub(base)?).ok()?;
            let stop = start.checked_add(bytes)?;
            (stop <= end).then_some((offset, start, stop, end))
        });
        let (offset, start, stop, end) = found?;
        self.free.remove(&offset);
        if start > offset {
            self.free.insert(offset, start - offset);
        }
        if end > stop {
            self.free.insert(stop, end - stop);
        }
        self.live.insert(start, bytes);
        Some(start)
    }

    /// Whether a live allocation, or a freed one whose stream may still use it, touches
    /// `[start, end)`.
    fn chunk_in_use(&self, start: usize, end: usize) -> bool {
        let last = self.live.range(..end).next_back();
        last.is_some_and(|(&offset, &len)| offset.saturating_add(len) > start)
            || self.pending.iter().any(|&(_, offset, len)| offset < end && offset.saturating_add(len) > start)
    }
}

/// How [`State::settle`] treats a pending free whose stream has not passed it yet.
#[derive(Clone, Copy, Debug)]
enum Settle {
    /// Leaves it pending.
    Check,
    /// Waits for it on the host, as [`Event::synchronize`] does (refused inside a capture
    /// closure on this thread: the caller then gets the refusal).
    Wait,
    /// Waits for it with [`Event::wait_before_release`], which nothing refuses: the range is
    /// about to be unmapped, and a refusal would leave it mapped for the process's life.
    WaitBeforeRelease,
}

/// Whether the stream of a pending free has passed it; with a wait (see [`Settle`]), waits for
/// that unless the stream still captures. A free on a capturing stream gets its event once the
/// capture is over.
///
/// So does a free whose event other code's capture took: a capture begun on a stream it lent
/// between the free's check of the stream and the record. Every query of such an event answers
/// CUDA_ERROR_CAPTURED_EVENT, and the work queued before the capture is followed by an event
/// recorded once it has ended. That is retried once here; a capture that takes the new event too
/// is found at the next call.
fn passed(after: &mut FreedAfter, context: &Context, settle: Settle) -> Result<bool> {
    for _ in 0..2 {
        match passed_once(after, context, settle) {
            Err(cumempool::Error::Driver(cause)) if cause.code == CUresult::CUDA_ERROR_CAPTURED_EVENT.0 => {
                if let FreedAfter::Event(_, stream) = after {
                    *after = FreedAfter::CaptureEnd(stream.clone());
                }
            }
            answer => return Ok(answer?),
        }
    }
    Ok(false)
}

/// [`passed`], without the retry of a captured event.
fn passed_once(after: &mut FreedAfter, context: &Context, settle: Settle) -> cumempool::Result<bool> {
    if let FreedAfter::CaptureEnd(stream) = after {
        if stream.is_capturing()? || stream.blocked_by_a_capture()? {
            return Ok(false);
        }
        match event_after(stream, context)? {
            Some(recorded) => *after = recorded,
            None => return Ok(true),
        }
    }
    match (after, settle) {
        (FreedAfter::Event(event, _), Settle::Check) => event.is_complete(),
        (FreedAfter::Event(event, _), Settle::Wait) => event.synchronize().map(|()| true),
        (FreedAfter::Event(event, _), Settle::WaitBeforeRelease) => event.wait_before_release().map(|()| true),
        (FreedAfter::CaptureEnd(_), _) => Ok(false),
    }
}

/// What tells when `stream` (not capturing) has passed a free queued on it now: an event
/// recorded on it, made in the stream's context (`context`, the arena's, for a stream that
/// knows none), since an event of another context cannot be recorded on it. Where no event can
/// be recorded (a stream of a context this crate does not know), a host wait for the stream:
/// `None`, the span is free at once.
///
/// # Errors
/// The event's, when neither the event nor the wait worked.
fn event_after(stream: &Stream, context: &Context) -> cumempool::Result<Option<FreedAfter>> {
    let recorded = Event::new(stream.context().unwrap_or(context)).and_then(|event| {
        event.record(stream)?;
        Ok(event)
    });
    match recorded {
        Ok(event) => Ok(Some(FreedAfter::Event(event, stream.clone()))),
        Err(record) => {
            stream.synchronize().map_err(|_| record)?;
            Ok(None)
        }
    }
}

/// A reserved range of one device's addresses with physical chunks mapped on demand: a
/// [`StreamOrderedResource`] of device memory that never moves.
#[derive(Debug)]
pub struct Arena {
    /// Dropped by `Drop` only once no stream may still use the memory; leaked otherwise.
    range: ManuallyDrop<AddressRange>,
    props: AllocationProperties,
    chunk: usize,
    context: Context,
    state: Mutex<State>,
}

/// What [`Arena::stats`] reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// The reserved addresses.
    pub reserved: usize,
    /// The bytes of physical memory mapped.
    pub mapped: usize,
    /// The bytes of live allocations.
    pub in_use: usize,
    /// Allocations freed whose stream had not yet passed the free when last checked.
    pub pending_frees: usize,
}

/// Keeps every chunk of an arena mapped while it lives: [`Arena::trim`] refuses meanwhile.
/// Registrations that cache the arena's physical memory (NCCL's) hold one.
#[derive(Debug)]
#[must_use = "the hold ends when dropped"]
pub struct MappingHold<'a> {
    arena: &'a Arena,
}

impl Drop for MappingHold<'_> {
    fn drop(&mut self) {
        self.arena.lock().holds -= 1;
    }
}

/// The chunks of an exported allocation, which owns them whole, for another process to map with
/// [`ArenaImport`].
#[cfg(unix)]
#[derive(Debug)]
pub struct ArenaExport {
    /// One descriptor per chunk, in address order.
    pub descriptors: Vec<OwnedFd>,
    /// The size of each chunk.
    pub chunk_size: usize,
    /// The allocation's offset into the first chunk: 0, since an exported allocation starts on
    /// a chunk boundary (kept for [`ArenaImport::map`], which takes any offset).
    pub offset: usize,
    /// The allocation's length: a whole number of chunks.
    pub len: usize,
    /// The device the memory lives on.
    pub device: i32,
}

impl Arena {
    /// An arena of `reserve` bytes of addresses on device `device`; see [`ArenaBuilder`].
    pub fn builder(device: i32, reserve: usize) -> ArenaBuilder {
        ArenaBuilder { device, reserve, chunk: None, props: AllocationProperties::device(device), peers: Vec::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The device that owns the memory.
    pub fn device(&self) -> i32 {
        self.props.device_ordinal()
    }

    /// The first address of the range; it never changes.
    pub fn base(&self) -> CUdeviceptr {
        self.range.base()
    }

    /// The size of each physical chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// The properties chunks are created with.
    pub fn properties(&self) -> &AllocationProperties {
        &self.props
    }

    /// Whether `[ptr, ptr + len)` lies in the arena's range.
    pub fn contains(&self, ptr: CUdeviceptr, len: usize) -> bool {
        self.offset_of(ptr).and_then(|offset| offset.checked_add(len)).is_some_and(|end| end <= self.range.len())
    }

    /// `ptr`'s offset into the range, where it lies at or above the base.
    fn offset_of(&self, ptr: CUdeviceptr) -> Option<usize> {
        ptr.checked_sub(self.range.base()).and_then(|offset| usize::try_from(offset).ok())
    }

    /// The offset of chunk `index` (at most the range's length for the chunks of the range).
    fn chunk_offset(&self, index: usize) -> usize {
        index.saturating_mul(self.chunk)
    }

    /// Reserved, mapped and used bytes.
    pub fn stats(&self) -> ArenaStats {
        let state = self.lock();
        ArenaStats {
            reserved: self.range.len(),
            mapped: state.chunks.len().saturating_mul(self.chunk),
            in_use: state.live.values().sum(),
            pending_frees: state.pending.len(),
        }
    }

    /// The mapped spans `(address, bytes)`, adjacent chunks merged, in address order.
    pub fn mapped_spans(&self) -> Vec<(CUdeviceptr, usize)> {
        let state = self.lock();
        let mut spans: Vec<(CUdeviceptr, usize)> = Vec::new();
        for &index in state.chunks.keys() {
            let address = address_in(&self.range, self.chunk_offset(index));
            match spans.last_mut() {
                Some((start, len)) if start.saturating_add(*len as u64) == address => *len += self.chunk,
                _ => spans.push((address, self.chunk)),
            }
        }
        spans
    }

    /// Keeps every chunk mapped until the hold is dropped.
    pub fn hold_mappings(&self) -> MappingHold<'_> {
        self.lock().holds += 1;
        MappingHold { arena: self }
    }

    /// Grants `device` (a peer) access to every chunk mapped now and later.
    ///
    /// # Errors
    /// [`Error::Pool`] for the owning device (which always has read-write access) or the
    /// driver's refusal (a device that cannot reach this one); then no chunk changes.
    pub fn grant_access(&self, device: i32, access: Access) -> Result<()> {
        check_peers(self.device(), &[(device, access)])?;
        let mut state = self.lock();
        for &index in state.chunks.keys() {
            self.range.set_access(self.chunk_offset(index), self.chunk, &[(device, access)])?;
        }
        state.peers.retain(|(d, _)| *d != device);
        state.peers.push((device, access));
        Ok(())
    }

    /// Maps every chunk `[start, end)` touches that is not mapped yet.
    fn map_chunks(&self, state: &mut State, start: usize, end: usize) -> Result<()> {
        let mut access = vec![(self.device(), Access::ReadWrite)];
        access.extend(state.peers.iter().copied());
        for index in start / self.chunk..end.div_ceil(self.chunk) {
            if state.chunks.contains_key(&index) {
                continue;
            }
            let memory = PhysicalAllocation::create(&self.props, self.chunk)?;
            self.range.map(self.chunk_offset(index), &memory)?;
            if let Err(error) = self.range.set_access(self.chunk_offset(index), self.chunk, &access) {
                // SAFETY: mapped just now, never handed out.
                if let Err(unmap) = unsafe { self.range.unmap(self.chunk_offset(index)) } {
                    tracing::warn!(%unmap, "unmapping a chunk whose access was refused failed");
                }
                return Err(error.into());
            }
            state.chunks.insert(index, memory);
        }
        Ok(())
    }

    /// Unmaps and releases every chunk no live allocation touches, after waiting for pending
    /// frees. Returns the bytes released. A chunk under a span freed on a stream that still
    /// captures stays mapped: the capture cannot be waited for.
    ///
    /// # Errors
    /// [`Error::MappingsHeld`] while a [`MappingHold`] (an NCCL registration) lives; the
    /// driver's answers (then nothing is unmapped).
    pub fn trim(&self) -> Result<usize> {
        let mut state = self.lock();
        if state.holds > 0 {
            return Err(Error::MappingsHeld { holders: state.holds });
        }
        state.settle(&self.context, Settle::Wait)?;
        let idle: Vec<usize> = state
            .chunks
            .keys()
            .copied()
            .filter(|&index| {
                !state.chunk_in_use(self.chunk_offset(index), self.chunk_offset(index).saturating_add(self.chunk))
            })
            .collect();
        let mut released = 0;
        for index in idle {
            // SAFETY: no live or pending allocation lies in the chunk: every free in it was passed.
            unsafe { self.range.unmap(self.chunk_offset(index)) }?;
            state.chunks.remove(&index);
            released += self.chunk;
        }
        Ok(released)
    }

    /// Exports the chunks of the live allocation at `ptr` as file descriptors, for another
    /// process to map with [`ArenaImport::map`].
    ///
    /// A peer maps whole chunks, so only an allocation that owns its chunks is exported: one
    /// that starts on a chunk boundary and is a whole number of chunks long, which nothing else
    /// can share while it lives (`arena.allocate(k * chunk, chunk, &stream)`, with `chunk` from
    /// [`Arena::chunk_size`]). The peer must stop using the memory before the allocation is
    /// freed here: its chunks are then handed out again.
    ///
    /// # Errors
    /// [`Error::NotFromArena`] for a pointer that is no live allocation of this arena;
    /// [`Error::NotExportable`] for one that shares a chunk with other allocations; the
    /// export's refusals (an arena built without `POSIX_FILE_DESCRIPTOR`).
    #[cfg(unix)]
    pub fn export_fd(&self, ptr: CUdeviceptr) -> Result<ArenaExport> {
        let state = self.lock();
        let Some((offset, len)) = self.offset_of(ptr).and_then(|o| state.live.get(&o).map(|len| (o, *len))) else {
            return Err(Error::NotFromArena { ptr });
        };
        if !offset.is_multiple_of(self.chunk) || !len.is_multiple_of(self.chunk) {
            return Err(Error::NotExportable {
                ptr,
                len,
                offset_in_chunk: offset % self.chunk,
                chunk_size: self.chunk,
            });
        }
        // Whole chunks inside the range: `offset + len` is at most its length.
        let first = offset / self.chunk;
        let descriptors = (first..first.saturating_add(len / self.chunk))
            .map(|index| match state.chunks.get(&index) {
                Some(memory) => Ok(memory.export_fd()?),
                None => Err(Error::NotFromArena { ptr }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ArenaExport { descriptors, chunk_size: self.chunk, offset: 0, len, device: self.device() })
    }
}

// SAFETY: `allocate` hands out spans of mapped device memory of `props.device` (chunks are
// mapped before the span is returned), never two live spans overlapping (`take` removes them
// from the free list); a freed span is reused only after an event on its freeing stream has
// completed (recorded after the capture, for a free on a capturing stream), or after a host
// wait for that stream. Alignments above the chunk size are refused.
unsafe impl StreamOrderedResource for Arena {
    type Kind = DeviceMemory;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        if self.may_be_capturing(stream) && self.is_capturing(stream)? {
            return Err(crate::resource::refused_while_capturing(
                "allocating from a VMM arena, whose spans are not graph memory (allocate before the capture, or inside it from a pool with Capture::alloc)",
            ));
        }
        if !align.is_power_of_two() || align > self.chunk {
            return Err(Error::Alignment {
                requested: align,
                reason: format!("the arena aligns to powers of two up to its chunk size, {}", self.chunk),
            });
        }
        if bytes == 0 {
            return Ok(0);
        }
        let exhausted = || Error::ArenaExhausted { requested: bytes, reserved: self.range.len() };
        // Refused before any arithmetic on offsets: a span this large cannot fit.
        if bytes > self.range.len() {
            return Err(exhausted());
        }
        let rounded = bytes.checked_next_multiple_of(POOL_ALIGNMENT).ok_or_else(exhausted)?;
        let align = align.max(POOL_ALIGNMENT);
        let mut state = self.lock();
        // A free that cannot be checked now only keeps its span out of this allocation.
        if let Err(error) = state.settle(&self.context, Settle::Check) {
            tracing::debug!(%error, "checking an arena's pending frees failed; their spans stay pending");
        }
        let base = self.range.base();
        let mut offset = state.take(base, rounded, align);
        let mut unsettled = None;
        if offset.is_none() && !state.pending.is_empty() {
            unsettled = state.settle(&self.context, Settle::Wait).err();
            offset = state.take(base, rounded, align);
        }
        let Some(offset) = offset else {
            // Exhausted, unless frees that could not be waited for would have made room.
            return Err(unsettled.unwrap_or_else(exhausted));
        };
        // `take` found `offset + rounded` inside the range.
        if let Err(error) = self.map_chunks(&mut state, offset, offset.saturating_add(rounded)) {
            state.live.remove(&offset);
            state.give_back(offset, rounded);
            return Err(error);
        }
        Ok(address_in(&self.range, offset))
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, _align: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let offset = self.offset_of(ptr);
        let live = |state: &State| offset.filter(|offset| state.live.contains_key(offset));
        // Refused before anything reaches the stream. The caller's promise (a live allocation,
        // freed once) keeps it live until it is taken out below.
        if live(&self.lock()).is_none() {
            return Err(Error::NotFromArena { ptr });
        }
        // The legacy stream beside a blocking stream's capture takes no event now (the driver
        // would refuse it and invalidate that capture): the span waits for the capture's end.
        let after = if (self.may_be_capturing(stream) && self.is_capturing(stream)?) || stream.blocked_by_a_capture()? {
            Some(FreedAfter::CaptureEnd(stream.clone()))
        } else {
            match event_after(stream, &self.context) {
                // A blocking stream began capturing since the question: the legacy stream's
                // event waits for that capture's end.
                Err(cumempool::Error::StreamCapturing { .. }) if stream.is_blocked_by_a_capture() => {
                    Some(FreedAfter::CaptureEnd(stream.clone()))
                }
                // The span stays live if this fails: the caller's free failed, nothing is reused.
                recorded => recorded?,
            }
        };
        let mut state = self.lock();
        let Some((offset, len)) = live(&state).and_then(|o| state.live.remove(&o).map(|len| (o, len))) else {
            return Err(Error::NotFromArena { ptr });
        };
        match after {
            Some(after) => state.pending.push((after, offset, len)),
            None => state.give_back(offset, len),
        }
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Frees still in flight finish before the range unmaps the chunks. Where one cannot be
        // waited for (its stream still captures, or the wait failed), the range stays mapped
        // for the process's life rather than unmapped under work that may still use it.
        let mut state = self.lock();
        let settled = state.settle(&self.context, Settle::WaitBeforeRelease);
        let unsettled = state.pending.len();
        drop(state);
        match settled {
            Ok(()) if unsettled == 0 => {
                // SAFETY: dropped once, here; `self.range` is not used after.
                unsafe { ManuallyDrop::drop(&mut self.range) };
            }
            Ok(()) => tracing::warn!(
                unsettled,
                "an arena was dropped while streams that freed its spans still capture; its memory stays mapped"
            ),
            Err(error) => {
                tracing::warn!(%error, "waiting for an arena's pending frees failed; its memory stays mapped");
            }
        }
    }
}

/// Another process's arena allocation mapped here: a range of its own with the imported chunks,
/// unmapped and released when dropped.
#[cfg(unix)]
#[derive(Debug)]
pub struct ArenaImport {
    range: AddressRange,
    offset: usize,
    len: usize,
}

#[cfg(unix)]
impl ArenaImport {
    /// Maps the chunks `descriptors` (from [`Arena::export_fd`], in order, each `chunk_size`
    /// bytes) and grants `device` read-write access. The allocation starts `offset` bytes into
    /// the first chunk and is `len` bytes long.
    ///
    /// # Errors
    /// [`Error::Pool`] with the import's or the mapping's refusal, or an `offset + len` that
    /// does not fit the chunks.
    pub fn map(descriptors: &[impl AsFd], chunk_size: usize, offset: usize, len: usize, device: i32) -> Result<Self> {
        let total = descriptors.len().checked_mul(chunk_size).unwrap_or(0);
        if total == 0 || offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(Error::Pool(cumempool::Error::InvalidArgument {
                what: "mapping an imported arena allocation",
                reason: InvalidArgumentReason::OutsideChunks { offset, len, chunks: descriptors.len(), chunk_size },
            }));
        }
        let props = AllocationProperties::device(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
        let range = AddressRange::reserve(total, chunk_size)?;
        check_range_end(&range, "mapping an imported arena allocation")?;
        for (index, fd) in descriptors.iter().enumerate() {
            let memory = PhysicalAllocation::import_fd(fd, chunk_size, &props)?;
            range.map(index * chunk_size, &memory)?;
        }
        range.set_access(0, total, &[(device, Access::ReadWrite)])?;
        Ok(Self { range, offset, len })
    }

    /// The allocation's address in this process.
    pub fn as_raw(&self) -> CUdeviceptr {
        address_in(&self.range, self.offset)
    }

    /// The allocation's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: exported allocations are not empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(reserve: usize) -> State {
        let mut free = BTreeMap::new();
        free.insert(0, reserve);
        State { chunks: BTreeMap::new(), free, live: BTreeMap::new(), pending: Vec::new(), peers: Vec::new(), holds: 0 }
    }

    #[test]
    fn spans_are_taken_first_fit_aligned_and_coalesce_when_given_back() {
        let base = 1 << 21;
        let mut state = state(1 << 20);
        let a = state.take(base, 256, 256).unwrap();
        let b = state.take(base, 4096, 4096).unwrap();
        assert_eq!((a, b), (0, 4096), "b is aligned past the gap a leaves");
        assert_eq!(state.free.get(&256), Some(&(4096 - 256)), "the gap stays free");
        let c = state.take(base, 512, 256).unwrap();
        assert_eq!(c, 256, "the gap is reused first");
        for (offset, len) in [(a, 256), (c, 512), (b, 4096)] {
            state.live.remove(&offset);
            state.give_back(offset, len);
        }
        assert_eq!(state.free.len(), 1, "everything coalesced: {:?}", state.free);
        assert_eq!(state.free.get(&0), Some(&(1 << 20)));
        assert!(state.take(base, (1 << 20) + 256, 256).is_none(), "more than the range is refused");
    }

    #[test]
    fn a_span_that_cannot_be_computed_without_overflow_does_not_fit() {
        let chunk = 1 << 21;
        let mut state = state(16 * chunk);
        let first = state.take(chunk as u64, 256, 256).unwrap();
        for huge in [usize::MAX - 300, usize::MAX - 255, usize::MAX, 16 * chunk + 1] {
            assert_eq!(state.take(chunk as u64, huge, 256), None, "{huge} bytes");
        }
        // A base near the end of the address space: aligning the start would wrap.
        assert_eq!(state.take(u64::MAX - 4095, 256, 1 << 20), None);
        // An alignment of 0 (no multiple exists) and one past the address space.
        assert_eq!(state.take(chunk as u64, 256, 0), None);
        assert_eq!(state.take(chunk as u64, 256, usize::MAX), None);
        assert_eq!(state.live.len(), 1, "the refusals took nothing: {:?}", state.live);
        assert_eq!(state.free.get(&256), Some(&(16 * chunk - 256)), "and left the free list whole");
        let next = state.take(chunk as u64, 4096, 256).unwrap();
        assert!(next >= first + 256, "{next} overlaps the live span at {first}");
    }

    #[test]
    fn the_owner_named_as_a_peer_is_refused_with_a_reason_to_match() {
        assert!(check_peers(0, &[(1, Access::ReadWrite)]).is_ok());
        let refused = check_peers(2, &[(1, Access::ReadWrite), (2, Access::ReadWrite)]);
        assert!(
            matches!(
                refused,
                Err(Error::Pool(cumempool::Error::InvalidArgument {
                    reason: InvalidArgumentReason::OwnerNamedAsPeer { device: 2 },
                    ..
                }))
            ),
            "{refused:?}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn an_import_that_does_not_fit_its_chunks_is_refused_before_the_driver() {
        let none: [OwnedFd; 0] = [];
        let refused = ArenaImport::map(&none, 1 << 21, 0, 256, 0).map(|_| ());
        assert!(
            matches!(
                refused,
                Err(Error::Pool(cumempool::Error::InvalidArgument {
                    reason: InvalidArgumentReason::OutsideChunks { chunks: 0, len: 256, .. },
                    ..
                }))
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn a_chunk_is_in_use_while_any_allocation_touches_it() {
        let chunk = 1 << 21;
        let mut state = state(8 * chunk);
        let spanning = state.take(0, chunk + 256, 256).unwrap();
        assert!(state.chunk_in_use(0, chunk) && state.chunk_in_use(chunk, 2 * chunk));
        assert!(!state.chunk_in_use(2 * chunk, 3 * chunk));
        state.live.remove(&spanning);
        assert!(!state.chunk_in_use(0, chunk) && !state.chunk_in_use(chunk, 2 * chunk));
    }

    #[test]
    fn a_chunk_stays_in_use_while_a_free_in_it_waits_for_a_capture_to_end() {
        let chunk = 1 << 21;
        let mut state = state(8 * chunk);
        let span = state.take(0, 256, 256).unwrap();
        state.live.remove(&span);
        // SAFETY: a handle never given to a driver (no call here reaches one).
        let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.unwrap();
        state.pending.push((FreedAfter::CaptureEnd(stream), span, 256));
        assert!(state.chunk_in_use(0, chunk), "the capturing stream may still use the span");
        assert!(!state.chunk_in_use(chunk, 2 * chunk));
    }
}
