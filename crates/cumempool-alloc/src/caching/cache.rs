//! The cache itself: the resource trait's hot paths, and the slow paths that tie slots,
//! lanes, the bound and the resource below together.

use super::bound::Bound;
use super::captured::CapturedBlocks;
use super::eviction;
use super::lanes::{give_lists_if_missing, own_lane, Lane};
use super::lock::lock;
use super::padded::Padded;
use super::size_class::{class_bytes, size_class, CLASSES};
use super::slot::{gather_from_lanes, lanes_of, pop_shared, SlotState, Taken, SLOTS};
use super::stats::CacheStats;
use super::table::SlotTable;
use super::timers::{nanos_of, Timers, LANE_SWEEP_INTERVAL};
use crate::error::Result;
use crate::resource::{check_alignment, CaptureMark, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Relaxed, Release},
};
use std::sync::PoisonError;

/// Keeps freed blocks per stream and size class, bounded in bytes.
///
/// - A block freed on stream `s` is reused only by allocations on `s`, or freed to the
///   resource below on `s` when it does not fit, is evicted or released. Streams are told apart
///   by [`Stream::id`], never by their raw handle.
/// - Requests are rounded up to a size class (at most 25% above 256 B) and allocated below with
///   [`POOL_ALIGNMENT`], so a cached block satisfies any alignment; requests over 1 TiB bypass
///   the cache, and so do streams beyond the first 256 with blocks cached at once.
/// - Each stream has its own slot, and each slot a lane per thread (the first 64 threads alive
///   at once; later ones use the slot's shared lists); the bound counts cached bytes exactly and
///   is claimed in chunks, so the hot path (a hit, or a free with room and budget in the thread's
///   lane) enters only the thread's own lane, with no read-modify-write, and writes no shared
///   counter. Once warm, a cached pair allocates no heap memory. A thread that exits leaves its
///   lanes to the next thread that starts; release, eviction, the no-memory retry and drop take
///   every lane's blocks, from any thread.
/// - When the bound is reached or the slots run out, the blocks of streams nobody else holds any
///   more are given back, then those of the least recently used streams.
/// - If the resource below answers with a no-memory error, the cache gives back what it holds
///   and retries once, unless the error shows that cannot help (a request over a
///   [`Limit`](crate::Limit) or a pool's maximum size, or short of a limit by more than the
///   cache holds).
/// - While a stream is capturing, its allocations and frees go straight to the resource below,
///   and blocks allocated during a capture are never cached, whenever they are freed.
/// - The resource below, and a global allocator, must not call back into the same cache: a
///   slow path holds a stream's lock while it allocates host memory.
pub struct CachingResource<R: StreamOrderedResource> {
    inner: R,
    /// What the hot path reads, beside `inner`; what slow paths write (below) sits on cache
    /// lines of its own.
    pub(super) table: SlotTable,
    pub(super) bound: Padded<Bound>,
    /// Misses of streams that found no slot.
    overflow_misses: Padded<AtomicU64>,
    timers: Padded<Timers>,
    captured: Padded<CapturedBlocks>,
}

impl<R: StreamOrderedResource> std::fmt::Debug for CachingResource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not `stats()`: that claims every lane, which costs every running thread an interrupt.
        f.debug_struct("CachingResource")
            .field("max_cached", &self.bound.max())
            .field("unclaimed", &self.bound.unclaimed())
            .field("fences", &self.table.fences)
            .finish_non_exhaustive()
    }
}

impl<R: StreamOrderedResource> CachingResource<R> {
    /// The default bound: 1 GiB of cached blocks.
    pub const DEFAULT_MAX_CACHED: usize = 1 << 30;

    /// A cache over `inner` holding at most [`Self::DEFAULT_MAX_CACHED`] bytes.
    pub fn new(inner: R) -> Self {
        Self::with_max_cached(inner, Self::DEFAULT_MAX_CACHED)
    }

    /// A cache over `inner` holding at most `max_cached` bytes of free blocks.
    pub fn with_max_cached(inner: R, max_cached: usize) -> Self {
        let table = SlotTable::new();
        let captured = Padded(CapturedBlocks::new(&table.id));
        Self {
            inner,
            table,
            bound: Padded(Bound::new(max_cached, SLOTS)),
            overflow_misses: Padded(AtomicU64::new(0)),
            timers: Padded(Timers::new()),
            captured,
        }
    }

    /// The resource below.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// The bound on cached bytes.
    pub fn max_cached(&self) -> usize {
        self.bound.max()
    }

    /// Gives taken blocks back below, each on the stream it was freed on, then lets go of the
    /// streams. Called without any lock held.
    fn give_back(&self, taken: Vec<Taken>) -> Result<()> {
        let mut first_error = None;
        for Taken { stream, blocks } in taken {
            for (index, list) in blocks.iter().enumerate() {
                let bytes = class_bytes(index);
                for &ptr in list {
                    // SAFETY: each block came from `inner` with the class size and
                    // `POOL_ALIGNMENT`, and was freed by its user on `stream`; it is given back
                    // once, on that stream.
                    if let Err(error) = unsafe { self.inner.deallocate(ptr, bytes, POOL_ALIGNMENT, &stream) } {
                        first_error.get_or_insert(error);
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Counters, summed over all streams.
    ///
    /// Every slot and lane is held at once while the sum is taken, so it is one moment's:
    /// `cached_bytes` is at most the bound. That moment costs every thread working in the cache
    /// a short wait, and on Linux a `membarrier` system call (tens of microseconds with many
    /// threads busy): read it to report, not on a hot path. Where lanes cannot be claimed (see
    /// [`Error::LanesUnreachable`](crate::Error::LanesUnreachable)), what they hold is not
    /// counted.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats { misses: self.overflow_misses.load(Relaxed), ..CacheStats::default() };
        let indices: Vec<usize> = (0..SLOTS).collect();
        let (states, mut lanes) = self.table.lock_with_lanes(&indices, true);
        for (group, state) in states.iter().enumerate() {
            stats.hits += state.hits;
            stats.misses += state.misses;
            stats.cached_bytes += state.cached_bytes;
            stats.cached_blocks += state.blocks.iter().map(Vec::len).sum::<usize>();
            stats.streams += usize::from(state.stream.is_some());
            for lane in lanes.iter_mut().flat_map(|lanes| lanes.group(group)) {
                stats.hits += lane.hits;
                stats.cached_bytes += lane.cached_bytes();
                stats.cached_blocks += lane.blocks();
            }
        }
        stats
    }

    /// Frees every cached block to the resource below (each on the stream it was freed on) and
    /// lets go of every stream; blocks of the legacy stream stay cached while a blocking stream
    /// captures ([`Stream::is_blocked_by_a_capture`]: freed there, they would invalidate that
    /// capture).
    ///
    /// # Errors
    /// The first error of the resource below;
    /// [`Error::LanesUnreachable`](crate::Error::LanesUnreachable) if threads' lanes could not be
    /// claimed (then the streams that have lanes keep their blocks, which `Drop` gives back).
    pub fn release(&self) -> Result<()> {
        let (taken, unreachable) = {
            let _registry = self.table.registry();
            self.table.take_slots(0..SLOTS, SlotState::may_give_back, &self.bound)
        };
        self.give_back(taken)?;
        unreachable.map_or(Ok(()), |why| Err(crate::Error::LanesUnreachable { reason: why.reason() }))
    }

    /// Frees the blocks cached for `stream` (this very stream: its clones, not other streams
    /// with the same handle value) to the resource below, and lets go of the stream.
    ///
    /// # Errors
    /// As [`release`](Self::release).
    pub fn release_stream(&self, stream: &Stream) -> Result<()> {
        let (taken, unreachable) = {
            let _registry = self.table.registry();
            self.table.find(stream.id().get()).map_or_else(
                || (Vec::new(), None),
                |index| self.table.take_slots(std::iter::once(index), SlotState::may_give_back, &self.bound),
            )
        };
        self.give_back(taken)?;
        unreachable.map_or(Ok(()), |why| Err(crate::Error::LanesUnreachable { reason: why.reason() }))
    }

    /// Allocates below; on a no-memory answer that giving back cached blocks could turn (see
    /// [`release_could_serve`](Self::release_could_serve)), gives back every cached block and retries once.
    fn allocate_below(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        match self.inner.allocate(bytes, align, stream) {
            Err(error) if error.is_out_of_memory() && self.release_could_serve(&error) => {
                if let Err(error) = self.release() {
                    tracing::warn!(%error, "giving cached blocks back failed");
                }
                self.inner.allocate(bytes, align, stream)
            }
            other => other,
        }
    }

    /// Caches a block whose stream has no slot or whose slot has no budget left, making room
    /// if it can; otherwise gives it back below.
    ///
    /// # Safety
    /// As [`StreamOrderedResource::deallocate`], for a block of size class `index`.
    #[cold]
    unsafe fn deallocate_slow(&self, ptr: CUdeviceptr, index: usize, stream: &Stream) -> Result<()> {
        let mut taken = Vec::new();
        let cached = !self.no_slot_for_now(stream) && self.cache_making_room(ptr, index, stream, &mut taken);
        if let Err(error) = self.give_back(taken) {
            tracing::warn!(%error, "giving evicted blocks back failed");
        }
        if cached {
            return Ok(());
        }
        // SAFETY: the block came from `inner` with the class size and `POOL_ALIGNMENT`; it
        // cannot be cached, so it goes back below, on the stream its user freed it on.
        unsafe { self.inner.deallocate(ptr, class_bytes(index), POOL_ALIGNMENT, stream) }
    }

    /// Whether `stream` has no slot, none is free, and a scan for unused streams found nothing
    /// less than [`SLOT_SCAN_INTERVAL`](super::timers::SLOT_SCAN_INTERVAL) ago: then its free goes straight below without the
    /// registry lock, so that streams beyond the slots (all live) are not serialised on it.
    fn no_slot_for_now(&self, stream: &Stream) -> bool {
        let key = stream.id().get();
        if self.table.find(key).is_some() || self.table.free_slot(key).is_some() {
            return false;
        }
        self.timers.slot_scan_resting()
    }

    /// Whether giving back the cached blocks could let a request that the resource below
    /// refused with the no-memory `error` succeed. Not when the cache holds nothing, nor when
    /// the error shows the request cannot fit: above a [`Limit`](crate::Limit), or short of it
    /// by more than the cache holds (giving the blocks back lowers its use by at most that), or
    /// above a pool's maximum size. Anything else (a device or heap out of memory, which says
    /// neither what is free nor what could be) may be served, so it is tried.
    fn release_could_serve(&self, error: &crate::Error) -> bool {
        use crate::Error;
        match *error {
            Error::LimitExceeded { requested, limit, in_use } if requested <= limit => {
                // What the cache holds, with every unfilled budget taken back first (that gives
                // up no block, and budget is no memory below): a claim of every lane, on a path
                // that would otherwise have released them all.
                self.return_unfilled_budgets_now();
                let held = self.bound.held_at_most();
                let needed = in_use.saturating_sub(held).checked_add(requested);
                held > 0 && needed.is_some_and(|needed| needed <= limit)
            }
            Error::LimitExceeded { .. } => false,
            Error::Pool(cumempool::Error::OutOfMemory { requested, limit: Some(max_size), .. }) => {
                self.bound.held_at_most() > 0 && u64::try_from(requested).is_ok_and(|requested| requested <= max_size)
            }
            _ => self.bound.held_at_most() > 0,
        }
    }

    /// Takes back every slot's and lane's unfilled budget, whatever the sweep limit.
    pub(super) fn return_unfilled_budgets_now(&self) {
        let _registry = self.table.registry();
        eviction::return_unfilled_budgets(&self.table, &self.bound, &self.timers, true);
    }

    /// Caches the block under the registry lock, reclaiming and evicting what it must; false
    /// when it cannot be cached. What was taken from other slots lands in `taken`.
    fn cache_making_room(&self, ptr: CUdeviceptr, index: usize, stream: &Stream, taken: &mut Vec<Taken>) -> bool {
        let class = class_bytes(index);
        let key = stream.id().get();
        let _registry = self.table.registry();
        let now = self.table.tick();
        let own = self.table.find(key);
        if let Some(own) = own {
            // Its unfilled budget counts towards the block, before others give anything up.
            let mut state = lock(&self.table.slots[own].state);
            self.bound.give(std::mem::take(&mut state.budget));
        }
        let mut slot = own.or_else(|| self.table.free_slot(key));
        if slot.is_none() {
            eviction::reclaim_unused(&self.table, &self.bound, None, taken);
            slot = self.table.free_slot(key);
            if slot.is_none() {
                self.timers.rest_slot_scans();
            }
        }
        let Some(slot) = slot else { return false };
        if !eviction::make_room(&self.table, &self.bound, &self.timers, class, Some(slot), taken) {
            return false;
        }
        let slot = &self.table.slots[slot];
        let mut state = lock(&slot.state);
        if state.stream.is_none() {
            state.stream = Some(stream.clone());
            slot.key.store(key, Release);
        }
        if state.blocks.is_empty() {
            state.blocks = vec![Vec::new(); CLASSES];
        }
        slot.last_used.store(now, Relaxed);
        match state.blocks.get_mut(index) {
            Some(list) => {
                list.push(ptr);
                state.cached_bytes += class;
                true
            }
            None => {
                self.bound.give(class);
                false
            }
        }
    }
}

// SAFETY: hands out blocks of the resource below, each to one user at a time: a cached block
// is in no user's hands, and every class block has the class size and the pools' alignment,
// which is at least what any request rounded into that class asked.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for CachingResource<R> {
    type Kind = R::Kind;

    // Always inlined, like the hot paths below: a call per allocation and free, and the
    // out-of-memory-sized `Result` returned through memory, cost as much as the hit itself
    // (measured: 13.9 ns against 9.2 ns per pair where the compiler chose not to inline).
    #[inline(always)]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        check_alignment(align)?;
        match self.pop_from_lane(bytes, stream) {
            Some(ptr) => Ok(ptr),
            None => self.allocate_beyond_lane(bytes, align, stream),
        }
    }

    /// One question at most: a block of the calling thread's lane is served without one (only
    /// a stream on which no capture can be underway has a lane), and any other allocation
    /// after it.
    #[inline]
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        check_alignment(align)?;
        if let Some(ptr) = self.pop_from_lane(bytes, stream) {
            return Ok(Some(ptr));
        }
        if self.inner.may_be_capturing(stream) && !matches!(self.inner.is_capturing(stream), Ok(false)) {
            return Ok(None);
        }
        let ptr = self.allocate_outside_a_capture(bytes, align, stream)?;
        // Given back through the cache's own free, which sends graph memory below.
        Ok(crate::resource::unless_graph_memory(self, ptr, bytes, align, stream))
    }

    #[inline(always)]
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        if self.push_to_lane(ptr, bytes, stream) {
            return Ok(());
        }
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.deallocate_beyond_lane(ptr, bytes, align, stream) }
    }

    // An adaptor: a capture is what the resource below says it is, so layers above the cache
    // apply the same capture rules as the cache itself.
    crate::resource::forward_capture_checks!(|this| this.inner);
}

/// The hot paths, small enough to be inlined wherever the cache is called, and the rest, kept
/// out of line so that they do not stop that.
impl<R: StreamOrderedResource> CachingResource<R> {
    /// An allocation on a capturing stream. No cached block may serve it (the graph would use
    /// the block at every replay while the cache hands it to others), so it goes straight
    /// below, and the block is remembered: it is graph memory, and its free must not cache it
    /// either.
    #[cold]
    #[inline(never)]
    fn allocate_during_capture(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        let ptr = self.inner.allocate(bytes, align, stream)?;
        self.captured.remember(ptr);
        Ok(ptr)
    }

    /// Frees below what the cache must not take: a block it handed out during a capture
    /// (remembered in `captured`; given back with the `bytes` and `align` it was asked for),
    /// any block freed on a capturing stream, or graph memory the pool allocated into a capture
    /// begun after this cache asked (a class block with its class's size and the pools'
    /// alignment, as it was allocated). `None` for a block the cache may take. When the
    /// capture status cannot be had, the block goes below: that is never wrong.
    ///
    /// # Safety
    /// As [`StreamOrderedResource::deallocate`].
    #[cold]
    #[inline(never)]
    unsafe fn deallocate_under_capture_rules(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        align: usize,
        stream: &Stream,
    ) -> Option<Result<()>> {
        if self.captured.any() && self.captured.forget(ptr) {
            // SAFETY: the block came from `inner` with these arguments during a capture.
            return Some(unsafe { self.inner.deallocate(ptr, bytes, align, stream) });
        }
        let outside_captures =
            !self.inner.may_be_capturing(stream) || self.inner.is_capturing(stream).is_ok_and(|capturing| !capturing);
        // Graph memory is never kept, however it came here: a capture begun on the stream after
        // this cache's question, and ended since, made the pool's block the graph's (the core
        // records it), and the graph uses it at every launch. One relaxed load while no graph
        // memory is outstanding.
        if outside_captures && !cumempool::is_captured_allocation(ptr) {
            return None;
        }
        let (bytes, align) = match size_class(bytes) {
            Some((_, class)) => (class, POOL_ALIGNMENT),
            None => (bytes, align),
        };
        // SAFETY: a class block came from `inner` with its class size and the pools'
        // alignment, a larger one with the caller's arguments; freed once, here.
        Some(unsafe { self.inner.deallocate(ptr, bytes, align, stream) })
    }

    /// A hit in the calling thread's lane of a stream with a slot; `None` for anything else
    /// (any other case is retried by `allocate_beyond_lane`).
    #[inline(always)]
    fn pop_from_lane(&self, bytes: usize, stream: &Stream) -> Option<CUdeviceptr> {
        let (index, _) = size_class(bytes)?;
        // The stream's key, marked if a capture may be underway: a marked key matches no lane
        // and no slot, so `allocate_beyond_lane` applies the capture rules.
        self.table.pop_from_own_lane(self.inner.marked_stream_id(stream).get(), index)
    }

    /// Caches a block in the calling thread's lane of a stream with a slot, if it has room
    /// and budget; false for anything else (`deallocate_beyond_lane` takes it then).
    #[inline(always)]
    fn push_to_lane(&self, ptr: CUdeviceptr, bytes: usize, stream: &Stream) -> bool {
        let Some((index, class)) = size_class(bytes) else { return false };
        // The capture rules (which `deallocate_beyond_lane` applies) ride on the comparisons
        // that find the lane: a stream that may be capturing has a marked key, which matches no
        // lane, and while blocks handed out during a capture are out, the gate matches no
        // remembered cache. Both loads relaxed: see `CapturedBlocks` and `Stream::marked_id`.
        let key = self.inner.marked_stream_id(stream).get();
        match self.table.push_to_remembered_lane(&self.captured.gate, key, ptr, index, class, &self.bound) {
            Some(pushed) => pushed,
            None => self.push_to_lane_looked_up(ptr, key, index, class),
        }
    }

    /// `push_to_lane` for a thread that must look its lane up: false while a capture may be
    /// underway on the stream (`key` is marked) or blocks handed out during a capture are out,
    /// which `deallocate_beyond_lane` looks at.
    #[inline(never)]
    fn push_to_lane_looked_up(&self, ptr: CUdeviceptr, key: u64, index: usize, class: usize) -> bool {
        if key & Stream::CAPTURE_MARK != 0 || self.captured.any() {
            return false;
        }
        self.table.push_out_of_line(key, ptr, index, class, &self.bound)
    }

    #[inline(never)]
    fn allocate_beyond_lane(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        if bytes == 0 {
            return Ok(0);
        }
        if self.inner.may_be_capturing(stream) && self.inner.is_capturing(stream)? {
            return self.allocate_during_capture(bytes, align, stream);
        }
        self.allocate_outside_a_capture(bytes, align, stream)
    }

    /// `allocate_beyond_lane` on a stream found not capturing (or on which none can be): the
    /// stream's shared blocks, then below.
    #[inline(never)]
    fn allocate_outside_a_capture(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        if bytes == 0 {
            return Ok(0);
        }
        let Some((index, class)) = size_class(bytes) else {
            return self.allocate_below(bytes, align, stream);
        };
        if stream.is_for_per_thread() {
            // Never cached (see `deallocate_beyond_lane`). Always marked, so never in a lane.
            return self.allocate_below(class, POOL_ALIGNMENT, stream);
        }
        let key = stream.id().get();
        let found = self.table.find(key).map(|index| &self.table.slots[index]);
        match found {
            Some(slot) => {
                if let Some(ptr) = self.table.pop_from_lane(slot, key, index) {
                    return Ok(ptr);
                }
                let mut state = lock(&slot.state);
                if slot.key.load(Relaxed) == key {
                    self.table.touch(slot);
                    if let Some(ptr) = pop_shared(lanes_of(slot), &mut state, index, class) {
                        return Ok(ptr);
                    }
                    // The bound is spent: blocks other threads left in their lanes of this stream
                    // (threads that exited, or work that moved) serve this thread before the
                    // driver is asked. Same stream, so their reuse is ordered; under the slot's
                    // lock its lanes cannot be drained for another stream meanwhile.
                    let now = self.timers.nanos();
                    if self.bound.unclaimed() < class && now >= state.next_gather {
                        // Each stream on its own timer: on the timer shared with the budget sweeps,
                        // a thread that arrived just after one went to the driver (46 of 1,600
                        // allocations on the 32-core H200 node) while every block it needed sat
                        // in other lanes. The budget sweeps wait for it too.
                        gather_from_lanes(lanes_of(slot), self.table.made_in, &mut state);
                        state.next_gather = now.saturating_add(nanos_of(LANE_SWEEP_INTERVAL));
                        self.timers.hold_lane_sweeps_until(state.next_gather);
                        if let Some(ptr) = pop_shared(lanes_of(slot), &mut state, index, class) {
                            return Ok(ptr);
                        }
                    }
                    state.misses += 1;
                } else {
                    self.overflow_misses.fetch_add(1, Relaxed);
                }
            }
            None => {
                self.overflow_misses.fetch_add(1, Relaxed);
            }
        }
        // Every class block is allocated with the pools' alignment, which satisfies any request.
        self.allocate_below(class, POOL_ALIGNMENT, stream)
    }

    /// # Safety
    /// As [`StreamOrderedResource::deallocate`].
    #[inline(never)]
    unsafe fn deallocate_beyond_lane(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        align: usize,
        stream: &Stream,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if self.captured.any() || self.inner.may_be_capturing(stream) {
            // SAFETY: forwarded under the caller's promise.
            if let Some(freed) = unsafe { self.deallocate_under_capture_rules(ptr, bytes, align, stream) } {
                return freed;
            }
        }
        let Some((index, class)) = size_class(bytes) else {
            // SAFETY: a bypassing block came from `inner` with these arguments.
            return unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        };
        if stream.is_for_per_thread() {
            // The per-thread stream is another stream on each thread, ordered with the others
            // only through work on the legacy stream: a block freed after one thread's work and
            // handed to another thread from the cache would be ordered with nothing. Given back
            // below, where the free itself is legacy-stream work that waits for every thread's.
            // SAFETY: a class block came from `inner` with its class size and the pools'
            // alignment (`allocate_beyond_lane`), freed once, here.
            return unsafe { self.inner.deallocate(ptr, class, POOL_ALIGNMENT, stream) };
        }
        let key = stream.id().get();
        if let Some(slot) = self.table.find(key).map(|index| &self.table.slots[index]) {
            // A lane's first free (or first since it was emptied): its lists are made here,
            // outside the lane, for a stream in any slot.
            if let Some(lanes) = slot.lanes.get() {
                give_lists_if_missing(&lanes[..]);
            }
            if self.table.push_to_lane(slot, key, ptr, index, class, &self.bound) {
                return Ok(());
            }
            let mut guard = lock(&slot.state);
            let state = &mut *guard;
            if slot.key.load(Relaxed) == key {
                // A stream's second cached free makes its lanes (8 KiB, once per slot): a stream
                // used once never has any, so slow paths have none of its to claim.
                let lanes = slot.lanes.get_or_make();
                // Short of budget: this thread's own lane's unfilled budget first, which needs no
                // claim (entering one's own lane never waits), so that a thread whose lane is
                // full never goes below while budget sits in that lane.
                if state.budget < class {
                    if let Some(mut lane) = own_lane(&lanes[..]) {
                        state.budget += lane.take_unfilled();
                    }
                }
                if let Some(list) = state.blocks.get_mut(index) {
                    if self.bound.claim(&mut state.budget, class) {
                        list.push(ptr);
                        state.cached_bytes += class;
                        self.table.touch(slot);
                        return Ok(());
                    }
                }
            }
        }
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.deallocate_slow(ptr, index, stream) }
    }
}

impl<R: StreamOrderedResource> Drop for CachingResource<R> {
    /// Takes every block straight from the slots and lanes: `&mut self` means no thread is in
    /// any lane (their last use happened before this), so no claim or fence is needed, and
    /// none can fail. Blocks of the legacy stream while a blocking stream captures go below only
    /// if the resource there lets such a free wait for the capture's end
    /// ([`StreamOrderedResource::frees_legacy_after_blocking_captures`]): nothing is left to
    /// give them back later. Otherwise they are kept allocated, with a warning: freed there,
    /// the driver would refuse them and invalidate the capture.
    fn drop(&mut self) {
        let mut taken = Vec::new();
        let below_waits = self.inner.frees_legacy_after_blocking_captures();
        for slot in self.table.slots.iter_mut() {
            let state = slot.state.get_mut().unwrap_or_else(PoisonError::into_inner);
            if !below_waits && !state.may_give_back() {
                tracing::warn!("a cache dropped while a blocking stream captures keeps its legacy-stream blocks allocated (freeing them would invalidate that capture)");
                continue;
            }
            let lanes = slot.lanes.get_mut().into_iter().flat_map(|lanes| lanes.iter_mut());
            taken.extend(state.take_all(lanes.filter_map(Lane::state_if_idle)).map(|(contents, _)| contents));
        }
        if let Err(error) = self.give_back(taken) {
            tracing::warn!(%error, "giving cached blocks back failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::lane_number::TEST_LANE_NUMBERS;
    use crate::caching::lanes::claim;
    use crate::caching::slot::gather_from_lanes;
    use crate::HostHeap;

    /// Bytes in the stream's shared lists and in its lanes.
    fn where_blocks_are(cache: &CachingResource<HostHeap>, stream: &Stream) -> (usize, usize) {
        let slot = &cache.table.slots[cache.table.find(stream.id().get()).expect("the stream has a slot")];
        let state = lock(&slot.state);
        let mut lanes = claim(vec![lanes_of(slot)], cache.table.made_in).expect("claimed");
        (state.cached_bytes, lanes.group(0).map(|lane| lane.cached_bytes()).sum())
    }

    /// Found on the 32-core H200 node (a regression test failed under compute-sanitizer there):
    /// a free that did not fit in the thread's full lane went below for want of budget while
    /// the lane itself held unfilled budget, and the budget sweep was not due.
    #[test]
    fn a_full_lane_lends_its_budget_to_a_free_into_the_shared_lists() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let (a, b) = (64 << 10, 80 << 10);
        let cache = CachingResource::with_max_cached(HostHeap, 10 * a + b);
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        let blocks: Vec<u64> = (0..11).map(|_| cache.allocate(a, 256, &stream).expect("host memory")).collect();
        let other = cache.allocate(b, 256, &stream).expect("host memory");
        // The first two frees go to the shared lists (slot, then lanes), the next eight fill
        // this thread's lane for that class; then `other` fills the bound.
        for &ptr in &blocks[..10] {
            // SAFETY: allocated above with these arguments.
            unsafe { cache.deallocate(ptr, a, 256, &stream) }.expect("cached");
        }
        // SAFETY: as above.
        unsafe { cache.deallocate(other, b, 256, &stream) }.expect("cached");
        assert_eq!(where_blocks_are(&cache, &stream), (2 * a, 8 * a + b));
        assert_eq!(cache.bound.unclaimed(), 0, "the bound is spent");
        // A hit leaves `b` of budget in the lane; no budget sweep is due for a long while.
        let other = cache.allocate(b, 256, &stream).expect("a hit");
        cache.timers.hold_lane_sweeps_until(u64::MAX);
        // SAFETY: as above.
        unsafe { cache.deallocate(blocks[10], a, 256, &stream) }.expect("cached");
        assert_eq!(where_blocks_are(&cache, &stream), (3 * a, 8 * a), "the free was cached with the lane's budget");
        // SAFETY: as above.
        unsafe { cache.deallocate(other, b, 256, &stream) }.expect("freed");
    }

    /// A hit in a lane marks the lane, not the slot (the hot path writes no shared line); the
    /// eviction must still see the stream as used then, or it would evict a stream busy in its
    /// lanes before one idle since it registered.
    #[test]
    fn a_stream_used_only_through_its_lane_is_not_the_least_recently_used() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let block = 64 << 10;
        let cache = CachingResource::with_max_cached(HostHeap, 6 * block);
        // SAFETY: HostHeap ignores streams, so the handles are never used.
        let [busy, idle, new] = [0x300, 0x301, 0x302]
            .map(|raw| unsafe { Stream::borrow_raw(raw as cumempool::sys::CUstream, None) }.expect("a fake stream"));
        // Three blocks each: the first two frees go to the shared lists, the third to this
        // thread's lane; the bound is then spent.
        for stream in [&busy, &idle] {
            allocate_then_free(&cache, stream, block, 3);
        }
        assert_eq!(cache.bound.unclaimed(), 0, "the bound is spent");
        // Later than `idle` registered, `busy` is used through its lane only.
        cache.table.tick();
        let (_, in_lane) = where_blocks_are(&cache, &busy);
        let ptr = cache.allocate(block, 256, &busy).expect("a hit");
        assert_eq!(where_blocks_are(&cache, &busy).1, in_lane - block, "the hit came from the lane");
        // SAFETY: allocated just above with these arguments.
        unsafe { cache.deallocate(ptr, block, 256, &busy) }.expect("cached");
        // A new stream's free needs room: the least recently used stream is evicted.
        let ptr = cache.allocate(block, 256, &new).expect("host memory");
        // SAFETY: as above.
        unsafe { cache.deallocate(ptr, block, 256, &new) }.expect("cached");
        assert!(cache.table.find(idle.id().get()).is_none(), "the idle stream was evicted");
        assert!(cache.table.find(busy.id().get()).is_some(), "the stream busy in its lane kept its slot");
    }

    /// `n` blocks of `bytes` allocated on `stream`, then all freed there (the first frees go to
    /// the stream's slot and make its lanes, the later ones to this thread's lane).
    fn allocate_then_free(cache: &CachingResource<HostHeap>, stream: &Stream, bytes: usize, n: usize) {
        let blocks: Vec<u64> = (0..n).map(|_| cache.allocate(bytes, 256, stream).expect("host memory")).collect();
        for ptr in blocks {
            // SAFETY: allocated just above with these arguments.
            unsafe { cache.deallocate(ptr, bytes, 256, stream) }.expect("cached");
        }
    }

    /// Warm pairs on `stream`, so that the calling thread remembers its lane of the stream in
    /// `cache`; answers the block the lane then holds.
    fn warm(cache: &CachingResource<HostHeap>, stream: &Stream) -> CUdeviceptr {
        let block = 64 << 10;
        allocate_then_free(cache, stream, block, 4);
        let hits = cache.stats().hits;
        let ptr = cache.allocate(block, 256, stream).expect("a hit");
        // SAFETY: as above.
        unsafe { cache.deallocate(ptr, block, 256, stream) }.expect("cached");
        assert_eq!(cache.stats().hits, hits + 1);
        // The hit came through the remembered lane wherever threads take the fast entry (always
        // under Miri): the tests that use this exercise that path, not the lookup beside it.
        if cache.table.fences == crate::caching::fence::Fences::Asymmetric || cfg!(miri) {
            assert!(cache.table.id.remembered_by_this_thread(stream.id().get()), "no lane remembered");
        }
        ptr
    }

    /// The lane a thread remembers is for one cache: another cache, or one made where a dropped
    /// one was (its lanes possibly at the same addresses), looks its slot up.
    #[test]
    fn a_remembered_lane_serves_only_its_own_cache() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let block = 64 << 10;
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x400 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        let cache = CachingResource::new(HostHeap);
        let other = CachingResource::new(HostHeap);
        let cached = warm(&cache, &stream);
        let ptr = other.allocate(block, 256, &stream).expect("host memory");
        assert_ne!(ptr, cached, "another cache's block");
        assert_eq!(other.stats().hits, 0);
        // SAFETY: allocated just above with these arguments.
        unsafe { other.deallocate(ptr, block, 256, &stream) }.expect("freed");
        warm(&cache, &stream);
        // Dropped before the next is made, which may then take its place in memory: the lane the
        // thread remembers is freed (Miri reports any use of it).
        drop(cache);
        let cache = CachingResource::new(HostHeap);
        let ptr = cache.allocate(block, 256, &stream).expect("host memory");
        assert_eq!(cache.stats().hits, 0, "the new cache holds nothing");
        // SAFETY: as above.
        unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("freed");
    }

    /// A slot given up leaves its lanes ready for no stream: a thread that remembers its lane
    /// for the stream finds the lane's key reset, and looks the stream up again.
    #[test]
    fn a_stream_released_is_not_served_from_the_lane_it_had() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let block = 64 << 10;
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x401 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        let cache = CachingResource::new(HostHeap);
        warm(&cache, &stream);
        cache.release_stream(&stream).expect("released");
        let hits = cache.stats().hits;
        let ptr = cache.allocate(block, 256, &stream).expect("host memory");
        assert_eq!(cache.stats().hits, hits, "a miss: the released blocks went below");
        // SAFETY: allocated just above with these arguments.
        unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("freed");
        warm(&cache, &stream);
    }

    /// A hit leaves its block's bytes reserved for the size class in the lane (the hot path
    /// moves no byte count). Whatever path the blocks take next (hits, a gather into the shared
    /// lists, a release), the bound is whole again once nothing is cached: no reservation is
    /// counted twice or lost.
    #[test]
    fn reserved_blocks_are_counted_once_on_every_path_back_to_the_bound() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let block = 64 << 10;
        let cache = CachingResource::with_max_cached(HostHeap, 64 * block);
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x500 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        allocate_then_free(&cache, &stream, block, 6);
        // Hits empty the lane's reserved blocks; the sweep takes them back with the budget.
        let out: Vec<u64> = (0..6).map(|_| cache.allocate(block, 256, &stream).expect("a hit")).collect();
        assert_eq!(cache.stats().cached_bytes, 0);
        cache.return_unfilled_budgets_now();
        assert_eq!(cache.bound.unclaimed(), cache.bound.max(), "reservations left empty went back");
        for ptr in out {
            // SAFETY: allocated above with these arguments.
            unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("cached");
        }
        // Blocks gathered from the lane into the shared lists take their reservation along.
        allocate_then_free(&cache, &stream, block, 6);
        {
            let slot = &cache.table.slots[cache.table.find(stream.id().get()).expect("a slot")];
            let mut state = lock(&slot.state);
            gather_from_lanes(lanes_of(slot), cache.table.made_in, &mut state);
        }
        assert_eq!(where_blocks_are(&cache, &stream).1, 0, "the lane was emptied");
        cache.release().expect("released");
        assert_eq!(cache.stats().cached_bytes, 0);
        assert_eq!(cache.bound.unclaimed(), cache.bound.max(), "each block's bytes went back once");
    }

    /// Found measuring 32 threads on one stream with the bound spent (1.4 M pairs/s at 100%
    /// hits): a block taken from the shared lists went back to them at its free, since the lane
    /// had no budget and the bound none to claim, so the threads kept queueing on the slot's
    /// lock. Now the block's budget follows it into the lane.
    #[test]
    fn with_the_bound_spent_a_block_from_the_shared_lists_moves_into_the_lane() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let block = 64 << 10;
        let cache = CachingResource::with_max_cached(HostHeap, 4 * block);
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        allocate_then_free(&cache, &stream, block, 4);
        // Everything into the shared lists, every lane's budget to the slot: the bound is spent
        // and the lanes hold nothing.
        {
            let slot = &cache.table.slots[cache.table.find(stream.id().get()).expect("a slot")];
            let mut state = lock(&slot.state);
            gather_from_lanes(lanes_of(slot), cache.table.made_in, &mut state);
            let mut lanes = claim(vec![lanes_of(slot)], cache.table.made_in).expect("claimed");
            let budgets: usize = lanes.group(0).map(crate::caching::lanes::LaneState::take_unfilled).sum();
            cache.bound.give(budgets + std::mem::take(&mut state.budget));
            assert_eq!(state.cached_bytes, 4 * block);
            assert_eq!(cache.bound.unclaimed(), 0, "the bound is spent");
        }
        assert_eq!(where_blocks_are(&cache, &stream), (4 * block, 0));
        let ptr = cache.allocate(block, 256, &stream).expect("a hit");
        // SAFETY: allocated just above with these arguments.
        unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("cached");
        assert_eq!(where_blocks_are(&cache, &stream), (3 * block, block), "the block went to the lane");
    }
}
