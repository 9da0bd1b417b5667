//! A cache of freed blocks per stream and size class on top of any resource.
//!
//! CUDA's pools serialise inside the driver: one pool gives about 1.5 M allocation+free pairs
//! per second on one thread and less in total on many. This cache answers repeated pairs on a
//! stream without the driver. Each stream has its own slot, found without taking any shared
//! lock, and each slot a lane per thread: a few blocks per size class that only that thread
//! enters on the hot path, with plain loads and stores and no read-modify-write (see
//! [`lanes`]), so threads never wait for each other, whether they use streams of their own or
//! share one. A lane's overflow and misses go to the slot's shared lists, under the slot's
//! lock; slow paths take lanes from their owners with one `membarrier` for all they need.
//!
//! The rules that keep it sound and its budget useful:
//!
//! - **Streams by identity.** Slots are keyed by [`Stream::id`], never by the raw handle: handle
//!   values can name different streams (the legacy stream of another context, a destroyed
//!   borrowed stream's successor). A cached block is only handed out again on the stream it was
//!   freed on (work on one stream runs in order), or given back below with a free on that same
//!   stream, whose clone the slot keeps alive while it holds blocks. A lane belongs to its
//!   slot: its blocks were freed on the slot's stream, and a thread checks the slot's key inside
//!   the lane, which a slot given up changes before it claims its lanes to empty them.
//! - **One alignment below.** Size-class blocks are always allocated from the resource below
//!   with [`POOL_ALIGNMENT`] and always given back with exactly (class bytes, `POOL_ALIGNMENT`),
//!   on every path: a hit, a free that does not fit, eviction, release. Every alignment a request
//!   may ask for is at most `POOL_ALIGNMENT`, so any cached block serves any request. Requests too
//!   large for a class bypass the cache with their own (bytes, align) both ways.
//! - **Slots only for cached blocks.** A stream takes a slot when a block is cached for it, not
//!   for a free that goes straight below.
//! - **Reclaim, then evict.** When the bound is reached or no slot is free, slots whose stream
//!   only the cache still holds ([`Stream::handle_count`] is 1) give their blocks back below on
//!   that stream and drop it; if that is not enough, the least recently used other streams'
//!   slots are evicted the same way before a block is refused. This happens on slow paths only,
//!   under a lock the hot path never takes; before any of it, every slot's unfilled budget, and
//!   at most once a millisecond every lane's, is taken back (that gives up no block). After a scan found no slot to free (more than 256
//!   live streams), streams without a slot free straight below for a while without scanning.
//! - **Every no-memory answer that a release could turn retries.** When the resource below
//!   answers with any error for which [`Error::is_out_of_memory`](crate::Error::is_out_of_memory)
//!   holds (the pool's, a [`Limit`](crate::Limit)'s, the host heap's), the cache gives back what
//!   it holds and retries once, unless it holds nothing or the error shows that no release can
//!   serve the request: larger than a limit or a pool's maximum size, or short of a limit by
//!   more than the cache holds. Then it fails at once, and other streams keep their blocks.
//! - **Nothing crosses a capture boundary.** While a stream is capturing into a CUDA graph, an
//!   allocation on it is never served from the cache (the graph would use the block at every
//!   replay while the cache hands it to others) and a free on it is never cached: both go
//!   straight below, which records them in the capture. A block handed out during a capture is
//!   graph memory: the cache remembers its address until it is freed, and that free, whenever
//!   and on whatever stream, goes below with the size and alignment it was asked with. The
//!   hot path pays for this with two relaxed loads: the stream's mark that no capture is
//!   possible ([`StreamOrderedResource::may_be_capturing`]) and a count of such blocks; the
//!   driver is asked, and the blocks' set locked, only when those say so.

mod lanes;

use crate::error::Result;
use crate::resource::{check_alignment, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use lanes::{
    claim, give_lists_if_missing, own_lane, prepare_fences, ClaimedLanes, Fences, Lane, LaneState, Unreachable, LANES,
};
use std::collections::HashMap;
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Streams a cache serves at once; allocations on further streams go straight to the resource below.
const SLOTS: usize = 256;
/// A slot never used: lookups stop here. Stream ids start at 1.
const EMPTY: u64 = 0;
/// A slot whose stream was released: lookups probe past it, registrations may take it.
const RELEASED: u64 = u64::MAX;
/// After a scan for unused streams found no slot to free, streams without a slot skip the scan
/// for this long: a scan locks every slot, and with more than `SLOTS` live streams it would run
/// on every free of the streams beyond them.
const SLOT_SCAN_INTERVAL: Duration = Duration::from_micros(100);
/// The least time between two sweeps of threads' lanes that only make the cache better use its
/// bound: taking back their unfilled budget (per cache), and gathering a stream's blocks for a
/// thread that misses once the bound is spent (per stream; a gather also holds the budget
/// sweeps back). A sweep claims lanes, and a claim costs a `membarrier` that interrupts every
/// running thread of the process (15-50 us with 16-32 threads busy on the H200 node): without
/// this limit, a bound spent by many threads on one stream made every miss a sweep (1.5 M
/// pairs/s for 32 threads, measured). Sweeps that correctness needs (a slot given up, release,
/// stats) and the budget sweep before an eviction are never skipped.
const LANE_SWEEP_INTERVAL: Duration = Duration::from_millis(1);

const MIN_SHIFT: u32 = 8;
const MAX_SHIFT: u32 = 40;
const STEPS: u32 = 4;
/// Size classes: 256 B, then four per power of two up to 1 TiB; larger requests bypass the cache.
const CLASSES: usize = 1 + ((MAX_SHIFT - MIN_SHIFT) * STEPS) as usize;

/// The size class of a request: (index, bytes), with at most 25% rounding above 256 B.
///
/// On every hot path, so without branches but one: requests up to 256 B are raised to 255 + 1,
/// which the same arithmetic as the rest puts in class 0.
#[inline(always)]
pub(crate) fn size_class(bytes: usize) -> Option<(usize, usize)> {
    let below = (bytes as u64).wrapping_sub(1).max((1 << MIN_SHIFT) - 1);
    let log = 63 - below.leading_zeros(); // at least MIN_SHIFT - 1
    if log >= MAX_SHIFT {
        return None;
    }
    let shift = log - 2;
    let step = (below >> shift) + 1; // 5..=8
                                     // 1 + (log - MIN_SHIFT) * STEPS + (step - 5), with log = MIN_SHIFT - 1, step = 8 giving 0.
    let index = (log * STEPS + step as u32) - (MIN_SHIFT * STEPS + 4);
    // At most `CLASSES - 1` already (log < MAX_SHIFT, step <= 8); the bound, stated where the
    // compiler can see it, spares every lookup by class a bounds check.
    Some(((index as usize).min(CLASSES - 1), (step << shift) as usize))
}

/// The bytes of size class `index`.
pub(crate) fn class_bytes(index: usize) -> usize {
    if index == 0 {
        return 1 << MIN_SHIFT;
    }
    let i = index as u32 - 1;
    let log = MIN_SHIFT + i / STEPS;
    (((5 + i % STEPS) as u64) << (log - 2)) as usize
}

#[repr(align(128))]
struct Slot {
    /// `EMPTY`, `RELEASED`, or the [`Stream::id`] of its stream. Written only under the
    /// registry lock and the slot's own lock; read without either on the hot path.
    key: AtomicU64,
    /// The LRU clock when the slot was last used; written only when the clock has moved.
    last_used: AtomicU64,
    /// A lane per thread, made by the stream's second cached free and kept for the cache's life;
    /// what they hold belongs to the slot's stream like `state`'s blocks.
    lanes: OnceLock<Box<[Lane; LANES]>>,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// The stream, kept alive while blocks are cached for it; `Some` exactly while the slot
    /// has a key.
    stream: Option<Stream>,
    /// Free blocks by size class, all freed on `stream`.
    blocks: Vec<Vec<CUdeviceptr>>,
    cached_bytes: usize,
    /// Budget this slot has claimed from the global bound and not yet filled with blocks.
    budget: usize,
    hits: u64,
    misses: u64,
    /// Nanoseconds after the cache was made before which a miss does not gather this stream's
    /// lanes again ([`LANE_SWEEP_INTERVAL`] after the last gather).
    next_gather: u64,
}

impl SlotState {
    /// Takes the stream and every block the slot and `lanes` (its lanes' states) hold, if it has
    /// a stream; answers them with the bytes they accounted for in the bound (blocks and budget).
    fn take_all<'a>(&mut self, lanes: impl Iterator<Item = &'a mut LaneState>) -> Option<(Taken, usize)> {
        let stream = self.stream.take()?;
        let mut blocks = std::mem::take(&mut self.blocks);
        blocks.resize_with(CLASSES, Vec::new);
        let mut bytes = std::mem::take(&mut self.budget) + std::mem::take(&mut self.cached_bytes);
        for lane in lanes {
            bytes += lane.drain_into(&mut blocks);
        }
        Some((Taken { stream, blocks }, bytes))
    }
}

/// What a slot held when it was taken away: to be given back below, then let go of.
struct Taken {
    stream: Stream,
    blocks: Vec<Vec<CUdeviceptr>>,
}

#[inline(always)]
fn home_of(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % SLOTS
}

/// Moves every block a stream's lanes hold into the slot's shared lists, with their bytes; the
/// lanes keep their budget. Nothing moves if the lanes cannot be claimed.
fn gather_from_lanes(lanes: &[Lane], made_in: u32, state: &mut SlotState) {
    if state.blocks.len() != CLASSES {
        return;
    }
    let Ok(mut claimed) = claim(vec![lanes], made_in) else { return };
    let mut moved = 0;
    for lane in claimed.group(0) {
        for (index, list) in state.blocks.iter_mut().enumerate() {
            moved += lane.take_class(index, list) * class_bytes(index);
        }
    }
    state.cached_bytes += moved;
}

/// Gives the budget a block from the shared lists leaves to the calling thread's lane, so that
/// the block's free lands there: with the bound spent, a lane could otherwise never take a block
/// over from the shared lists, and every thread on the stream would keep queueing on the slot's
/// lock (measured: 32 threads on one stream, 1.4 M pairs/s at 100% hits). To the shared budget
/// when the thread has no lane. Under the slot's lock: entering one's own lane never waits, so
/// this cannot deadlock with a slow path claiming lanes, which holds that lock.
fn credit_budget(lanes: &[Lane], fences: Fences, state: &mut SlotState, class: usize) {
    match own_lane(lanes, fences) {
        Some(mut lane) => lane.budget += class,
        None => state.budget += class,
    }
}

/// A duration in nanoseconds, saturating (the cache's clocks count nanoseconds in a `u64`).
fn nanos_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// A block of size class `index` from a slot's shared lists, its budget given to the calling
/// thread's lane (see [`credit_budget`]).
fn pop_shared(
    lanes: &[Lane],
    fences: Fences,
    state: &mut SlotState,
    index: usize,
    class: usize,
) -> Option<CUdeviceptr> {
    let ptr = state.blocks.get_mut(index).and_then(Vec::pop)?;
    state.cached_bytes -= class;
    state.hits += 1;
    credit_budget(lanes, fences, state, class);
    Some(ptr)
}

/// The lanes of a slot, or none if it never had any.
fn lanes_of(slot: &Slot) -> &[Lane] {
    slot.lanes.get().map_or(&[], |lanes| &lanes[..])
}

/// Counters of a [`CachingResource`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Allocations answered from the cache.
    pub hits: u64,
    /// Allocations that went to the resource below.
    pub misses: u64,
    /// Bytes held in cached blocks.
    pub cached_bytes: usize,
    /// Cached blocks.
    pub cached_blocks: usize,
    /// Streams with a cache.
    pub streams: usize,
}

impl CacheStats {
    /// Hits over all allocations (0 before any).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

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
///   counter. Once warm, a cached pair allocates no
///   heap memory. A thread that exits leaves its lanes to the next thread that starts; release,
///   eviction, the no-memory retry and drop take every lane's blocks, from any thread.
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
    /// A fixed-size array, so that indexing it with a probe index needs no bounds check.
    slots: Box<[Slot; SLOTS]>,
    /// Bytes of the bound no slot has claimed.
    unclaimed: AtomicUsize,
    /// Misses of streams that found no slot.
    overflow_misses: AtomicU64,
    /// A coarse clock for least-recently-used eviction: advanced on slow paths only, read by
    /// the hot path.
    clock: AtomicU64,
    /// Held to change slot keys (register, reclaim, evict, release); never on the hot path.
    registry: Mutex<()>,
    /// When the cache was made: the origin of `next_slot_scan`.
    made: Instant,
    /// Nanoseconds after `made` before which streams that find no slot skip the scan for
    /// unused streams.
    next_slot_scan: AtomicU64,
    /// Nanoseconds after `made` before which no lane sweep for the bound's sake runs.
    next_lane_sweep: AtomicU64,
    max_cached: usize,
    chunk: usize,
    /// How lanes fence (the process's decision).
    fences: Fences,
    /// The process that made the cache: a forked child cannot claim lanes.
    made_in: u32,
    /// Blocks handed out while their stream was capturing (graph memory), by address, each
    /// with how many such blocks live there: never cached, given back below as they were asked
    /// for (see [`CachingResource::deallocate_under_capture_rules`]).
    captured: Mutex<HashMap<CUdeviceptr, usize>>,
    /// How many blocks `captured` counts, changed under its lock: the free's hot path reads it
    /// (one relaxed load) and consults `captured` only when it is not 0. A thread freeing such
    /// a block got it, through whatever handed it over, after its count was added, and only
    /// its own free takes that count away, so it cannot read 0 here.
    captured_count: AtomicUsize,
}

impl<R: StreamOrderedResource> std::fmt::Debug for CachingResource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not `stats()`: that claims every lane, which costs every running thread an interrupt.
        f.debug_struct("CachingResource")
            .field("max_cached", &self.max_cached)
            .field("unclaimed", &self.unclaimed.load(Relaxed))
            .field("fences", &self.fences)
            .finish_non_exhaustive()
    }
}

/// Locks ignoring poison: a panic while holding a slot cannot leave it inconsistent, every
/// update is local.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
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
        let fences = prepare_fences();
        let slots = Box::new(std::array::from_fn(|_| Slot {
            key: AtomicU64::new(EMPTY),
            last_used: AtomicU64::new(0),
            lanes: OnceLock::new(),
            state: Mutex::new(SlotState::default()),
        }));
        // Small enough that every slot can hold some budget at once; large enough that a
        // stream's steady allocate/free pairs never touch the shared counter.
        let chunk = (max_cached / (4 * SLOTS)).max(64 << 10).min(max_cached);
        Self {
            inner,
            slots,
            unclaimed: AtomicUsize::new(max_cached),
            overflow_misses: AtomicU64::new(0),
            clock: AtomicU64::new(0),
            registry: Mutex::new(()),
            made: Instant::now(),
            next_slot_scan: AtomicU64::new(0),
            next_lane_sweep: AtomicU64::new(0),
            max_cached,
            chunk,
            fences,
            made_in: std::process::id(),
            captured: Mutex::new(HashMap::new()),
            captured_count: AtomicUsize::new(0),
        }
    }

    /// The resource below.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// The bound on cached bytes.
    pub fn max_cached(&self) -> usize {
        self.max_cached
    }

    /// The index of the slot of the stream with `key`, if it has one.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let home = home_of(key);
        // Most streams sit in their home slot: that case first, without the loop.
        if self.slots[home].key.load(Acquire) == key {
            return Some(home);
        }
        self.probe(home, key)
    }

    /// The slot of the stream with `key`, if it has one: the hot path's lookup. Its home slot
    /// first, in line; a stream further along the probe path (its home slot was taken when it
    /// registered) pays one call more, not the slow paths (2.3 times the instructions of a
    /// pair at home, measured).
    #[inline(always)]
    fn slot_of(&self, key: u64) -> Option<&Slot> {
        let home = home_of(key);
        let slot = &self.slots[home];
        if slot.key.load(Acquire) == key {
            return Some(slot);
        }
        self.probe(home, key).map(|index| &self.slots[index])
    }

    /// `find` past the home slot.
    #[inline(never)]
    fn probe(&self, home: usize, key: u64) -> Option<usize> {
        for i in 0..SLOTS {
            let index = (home + i) % SLOTS;
            match self.slots[index].key.load(Acquire) {
                k if k == key => return Some(index),
                EMPTY => return None,
                _ => {}
            }
        }
        None
    }

    /// A slot a stream with `key` may take: the first one free on its probe path, so `find`
    /// reaches it. Only under the registry lock.
    fn free_slot(&self, key: u64) -> Option<usize> {
        let home = home_of(key);
        (0..SLOTS)
            .map(|i| (home + i) % SLOTS)
            .find(|&index| matches!(self.slots[index].key.load(Acquire), EMPTY | RELEASED))
    }

    /// Marks the slot used now for LRU eviction; writes only when the clock has moved, so
    /// threads sharing a stream do not bounce its cache line.
    #[inline(always)]
    fn touch(&self, slot: &Slot) {
        let now = self.clock.load(Relaxed);
        if slot.last_used.load(Relaxed) != now {
            slot.last_used.store(now, Relaxed);
        }
    }

    /// Takes `bytes` of the bound no slot has claimed; false when there are not that many.
    fn take_unclaimed(&self, bytes: usize) -> bool {
        self.unclaimed.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(bytes)).is_ok()
    }

    /// Takes `bytes` of budget for a slot, claiming a chunk of the bound when its own is short;
    /// false when the bound is reached.
    #[inline(always)]
    fn claim(&self, budget: &mut usize, bytes: usize) -> bool {
        if *budget < bytes && !self.claim_chunk(budget, bytes) {
            return false;
        }
        *budget -= bytes;
        true
    }

    /// Adds a chunk of the bound (or what is short, if no chunk is left) to `budget`.
    #[cold]
    fn claim_chunk(&self, budget: &mut usize, bytes: usize) -> bool {
        let need = bytes - *budget;
        let chunk = need.max(self.chunk);
        if self.take_unclaimed(chunk) {
            *budget += chunk;
        } else if self.take_unclaimed(need) {
            *budget += need;
        } else {
            return false;
        }
        true
    }

    /// Empties the slots of `indices` (ascending) that have a stream and `which` picks: their
    /// bytes return to the bound, their keys are released. One fence claims all their lanes; if
    /// the lanes cannot be claimed, only picked slots without lanes are emptied, and the reason
    /// comes back beside what was taken. Only under the registry lock.
    fn take_slots(
        &self,
        indices: impl Iterator<Item = usize>,
        which: impl Fn(&SlotState) -> bool,
    ) -> (Vec<Taken>, Option<Unreachable>) {
        let mut picked: Vec<(&Slot, MutexGuard<'_, SlotState>)> = indices
            .map(|index| &self.slots[index])
            .filter_map(|slot| {
                let state = lock(&slot.state);
                (state.stream.is_some() && which(&state)).then_some((slot, state))
            })
            .collect();
        let mut taken = Vec::with_capacity(picked.len());
        let (mut lanes, unreachable) =
            match claim(picked.iter().map(|(slot, _)| lanes_of(slot)).collect(), self.made_in) {
                Ok(lanes) => (Some(lanes), None),
                Err(why) => {
                    // The slots with lanes keep their stream, key and lanes; what is under their
                    // lock (shared lists, budget) goes (found by the second review: they kept it all).
                    for (_, state) in picked.iter_mut().filter(|(slot, _)| !lanes_of(slot).is_empty()) {
                        let Some(stream) = state.stream.clone() else { continue };
                        let blocks = std::mem::replace(&mut state.blocks, vec![Vec::new(); CLASSES]);
                        let bytes = std::mem::take(&mut state.budget) + std::mem::take(&mut state.cached_bytes);
                        self.unclaimed.fetch_add(bytes, Relaxed);
                        taken.push(Taken { stream, blocks });
                    }
                    picked.retain(|(slot, _)| lanes_of(slot).is_empty());
                    (None, Some(why))
                }
            };
        for (group, (slot, state)) in picked.iter_mut().enumerate() {
            // Under the slot's lock and its lanes' claims, before the lanes are emptied: a thread
            // inside a lane now was there before the claim and is done; one that enters a lane
            // or locks the slot after sees the change.
            slot.key.store(RELEASED, Release);
            if let Some((contents, bytes)) = state.take_all(lanes.iter_mut().flat_map(|lanes| lanes.group(group))) {
                self.unclaimed.fetch_add(bytes, Relaxed);
                taken.push(contents);
            }
        }
        (taken, unreachable)
    }

    /// The slots that have a stream. Keys change only under the registry lock, so under it this
    /// is exact: a slot without a stream holds no block and no budget.
    fn slots_with_streams(&self) -> impl Iterator<Item = usize> + '_ {
        (0..SLOTS).filter(|&index| !matches!(self.slots[index].key.load(Acquire), EMPTY | RELEASED))
    }

    /// Takes the slots whose stream only the cache still holds (nobody can queue work on it
    /// any more), except the slot `keep`. Only under the registry lock.
    fn reclaim_unused(&self, keep: Option<usize>, taken: &mut Vec<Taken>) {
        let unused = |state: &SlotState| state.stream.as_ref().is_some_and(|s| s.handle_count() == 1);
        let candidates: Vec<usize> = self.slots_with_streams().filter(|&index| Some(index) != keep).collect();
        taken.extend(self.take_slots(candidates.into_iter(), unused).0);
    }

    /// Makes `bytes` of the bound unclaimed and takes them: reclaims unused streams' slots,
    /// then evicts the least recently used other streams' slots. Only under the registry lock.
    fn make_room(&self, bytes: usize, keep: Option<usize>, taken: &mut Vec<Taken>) -> bool {
        if bytes > self.max_cached {
            return false;
        }
        if self.take_unclaimed(bytes) {
            return true;
        }
        // Unfilled budget first: taking it back gives up no block. The lanes' only when a sweep
        // is due, at first.
        let swept = self.return_unfilled_budgets(false);
        if self.take_unclaimed(bytes) {
            return true;
        }
        self.reclaim_unused(keep, taken);
        if self.take_unclaimed(bytes) {
            return true;
        }
        let mut swept = swept;
        while !self.take_unclaimed(bytes) {
            let oldest = self
                .slots_with_streams()
                .filter(|&index| Some(index) != keep)
                .filter_map(|index| {
                    let state = lock(&self.slots[index].state);
                    state.stream.is_some().then(|| (self.slots[index].last_used.load(Relaxed), index))
                })
                .min();
            // No victim, no sweep: a stream alone at the bound would otherwise pay a
            // `membarrier` on every free that does not fit (found by the second review).
            let Some((_, victim)) = oldest else { return false };
            // Before a block is given up, every lane's budget, whatever the sweep limit (found by
            // review: a stream's block was evicted while a lane held budget for it).
            if !swept {
                swept = true;
                self.return_unfilled_budgets(true);
                if self.take_unclaimed(bytes) {
                    return true;
                }
            }
            let (victims, unreachable) = self.take_slots(std::iter::once(victim), |_| true);
            taken.extend(victims);
            if unreachable.is_some() {
                return false;
            }
        }
        true
    }

    /// Returns the budget every slot and lane has claimed and not filled to the bound, so
    /// that a thread short of budget need not evict blocks while others hold unused budget.
    /// The lanes' budget when `force`d or a lane sweep is due ([`LANE_SWEEP_INTERVAL`]), and
    /// their lanes can be claimed; answers whether the lanes' budget was taken.
    fn return_unfilled_budgets(&self, force: bool) -> bool {
        let indices: Vec<usize> = self.slots_with_streams().collect();
        let (mut states, lanes) = self.lock_with_lanes(&indices, force || self.lane_sweep_due());
        let Some(mut lanes) = lanes else {
            for state in &mut states {
                self.unclaimed.fetch_add(std::mem::take(&mut state.budget), Relaxed);
            }
            return false;
        };
        for (group, state) in states.iter_mut().enumerate() {
            let mut bytes = std::mem::take(&mut state.budget);
            for lane in lanes.group(group) {
                bytes += std::mem::take(&mut lane.budget);
            }
            self.unclaimed.fetch_add(bytes, Relaxed);
        }
        true
    }

    /// Locks the slots of `indices` (ascending: the one order any path takes several in) and,
    /// if `with_lanes`, claims all their lanes with one fence (`None` when that was not asked
    /// for or cannot be had).
    fn lock_with_lanes(
        &self,
        indices: &[usize],
        with_lanes: bool,
    ) -> (Vec<MutexGuard<'_, SlotState>>, Option<ClaimedLanes<'_>>) {
        let states = indices.iter().map(|&index| lock(&self.slots[index].state)).collect();
        // A refusal is not logged here: it would be on every sweep; `membarrier`'s failure is
        // logged once where it happens, and a forked child's is documented.
        let lanes = with_lanes
            .then(|| claim(indices.iter().map(|&index| lanes_of(&self.slots[index])).collect(), self.made_in))
            .and_then(Result::ok);
        (states, lanes)
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
        let (states, mut lanes) = self.lock_with_lanes(&indices, true);
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
    /// lets go of every stream.
    ///
    /// # Errors
    /// The first error of the resource below;
    /// [`Error::LanesUnreachable`](crate::Error::LanesUnreachable) if threads' lanes could not be
    /// claimed (then the streams that have lanes keep their blocks, which `Drop` gives back).
    pub fn release(&self) -> Result<()> {
        let (taken, unreachable) = {
            let _registry = lock(&self.registry);
            self.take_slots(0..SLOTS, |_| true)
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
            let _registry = lock(&self.registry);
            self.find(stream.id().get())
                .map_or_else(|| (Vec::new(), None), |index| self.take_slots(std::iter::once(index), |_| true))
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
    /// less than [`SLOT_SCAN_INTERVAL`] ago: then its free goes straight below without the
    /// registry lock, so that streams beyond the slots (all live) are not serialised on it.
    fn no_slot_for_now(&self, stream: &Stream) -> bool {
        let key = stream.id().get();
        if self.find(key).is_some() || self.free_slot(key).is_some() {
            return false;
        }
        self.nanos() < self.next_slot_scan.load(Relaxed)
    }

    /// Whether a lane sweep for the bound's sake may run now; if so, the next one waits
    /// [`LANE_SWEEP_INTERVAL`].
    fn lane_sweep_due(&self) -> bool {
        let now = self.nanos();
        let next = self.next_lane_sweep.load(Relaxed);
        let interval = nanos_of(LANE_SWEEP_INTERVAL);
        now >= next
            && self.next_lane_sweep.compare_exchange(next, now.saturating_add(interval), Relaxed, Relaxed).is_ok()
    }

    /// At least the bytes of every block the cache holds: the bound less what no slot or lane
    /// has claimed (claimed budget counts too, so this may be more).
    fn held_at_most(&self) -> usize {
        self.max_cached.saturating_sub(self.unclaimed.load(Relaxed))
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
                let needed = in_use.saturating_sub(self.held_at_most()).checked_add(requested);
                self.held_at_most() > 0 && needed.is_some_and(|needed| needed <= limit)
            }
            Error::LimitExceeded { .. } => false,
            Error::Pool(cumempool::Error::OutOfMemory { requested, limit: Some(max_size), .. }) => {
                self.held_at_most() > 0 && u64::try_from(requested).is_ok_and(|requested| requested <= max_size)
            }
            _ => self.held_at_most() > 0,
        }
    }

    /// Takes back every slot's and lane's unfilled budget, whatever the sweep limit.
    fn return_unfilled_budgets_now(&self) {
        let _registry = lock(&self.registry);
        self.return_unfilled_budgets(true);
    }

    /// Nanoseconds since the cache was made.
    fn nanos(&self) -> u64 {
        nanos_of(self.made.elapsed())
    }

    /// Caches the block under the registry lock, reclaiming and evicting what it must; false
    /// when it cannot be cached. What was taken from other slots lands in `taken`.
    fn cache_making_room(&self, ptr: CUdeviceptr, index: usize, stream: &Stream, taken: &mut Vec<Taken>) -> bool {
        let class = class_bytes(index);
        let key = stream.id().get();
        let _registry = lock(&self.registry);
        let now = self.clock.fetch_add(1, Relaxed) + 1;
        let own = self.find(key);
        if let Some(own) = own {
            // Its unfilled budget counts towards the block, before others give anything up.
            let mut state = lock(&self.slots[own].state);
            self.unclaimed.fetch_add(std::mem::take(&mut state.budget), Relaxed);
        }
        let mut slot = own.or_else(|| self.free_slot(key));
        if slot.is_none() {
            self.reclaim_unused(None, taken);
            slot = self.free_slot(key);
            if slot.is_none() {
                let interval = nanos_of(SLOT_SCAN_INTERVAL);
                self.next_slot_scan.store(self.nanos().saturating_add(interval), Relaxed);
            }
        }
        let Some(slot) = slot else { return false };
        if !self.make_room(class, Some(slot), taken) {
            return false;
        }
        let slot = &self.slots[slot];
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
                self.unclaimed.fetch_add(class, Relaxed);
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
        let mut captured = lock(&self.captured);
        *captured.entry(ptr).or_default() += 1;
        self.captured_count.fetch_add(1, Relaxed);
        Ok(ptr)
    }

    /// Frees below what the cache must not take: a block it handed out during a capture
    /// (remembered in `captured`; given back with the `bytes` and `align` it was asked for),
    /// or any block freed on a capturing stream (a class block with its class's size and the
    /// pools' alignment, as it was allocated). `None` for a block the cache may take. When the
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
        if self.captured_count.load(Relaxed) != 0 && self.forget_captured(ptr) {
            // SAFETY: the block came from `inner` with these arguments during a capture.
            return Some(unsafe { self.inner.deallocate(ptr, bytes, align, stream) });
        }
        if !self.inner.may_be_capturing(stream) || self.inner.is_capturing(stream).is_ok_and(|capturing| !capturing) {
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

    /// Takes `ptr` out of the blocks handed out during a capture; false if it is not one.
    fn forget_captured(&self, ptr: CUdeviceptr) -> bool {
        let mut captured = lock(&self.captured);
        let Some(count) = captured.get_mut(&ptr) else { return false };
        *count -= 1;
        if *count == 0 {
            captured.remove(&ptr);
        }
        self.captured_count.fetch_sub(1, Relaxed);
        true
    }

    /// A hit in the calling thread's lane of a stream with a slot; `None` for anything else
    /// (any other case is retried by `allocate_beyond_lane`).
    #[inline(always)]
    fn pop_from_lane(&self, bytes: usize, stream: &Stream) -> Option<CUdeviceptr> {
        let (index, class) = size_class(bytes)?;
        // After the size class, so that a free inlined next to this allocation can reuse it
        // (measured: 14 instructions per pair otherwise); `allocate_beyond_lane` applies the
        // capture rules.
        if self.inner.may_be_capturing(stream) {
            return None;
        }
        let key = stream.id().get();
        self.pop_from_lane_of(self.slot_of(key)?, key, index, class)
    }

    /// A hit in the calling thread's lane of `slot`, the slot of the stream with `key`.
    #[inline(always)]
    fn pop_from_lane_of(&self, slot: &Slot, key: u64, index: usize, class: usize) -> Option<CUdeviceptr> {
        let mut lane = own_lane(&slot.lanes.get()?[..], self.fences)?;
        // Inside the lane: a slot given up changes its key while it holds the lanes' claims,
        // before it empties them, so a thread that sees its stream's key here entered before the
        // claim (and the lane still holds only that stream's blocks) or after a claim of the same
        // stream: a block found here was freed on this stream.
        if slot.key.load(Relaxed) != key {
            return None;
        }
        let ptr = lane.pop(index)?;
        lane.budget += class;
        lane.hits += 1;
        drop(lane);
        self.touch(slot);
        Some(ptr)
    }

    /// Caches a block in the calling thread's lane of a stream with a slot, if it has room
    /// and budget; false for anything else (`deallocate_beyond_lane` takes it then).
    #[inline(always)]
    fn push_to_lane(&self, ptr: CUdeviceptr, bytes: usize, stream: &Stream) -> bool {
        let Some((index, class)) = size_class(bytes) else { return false };
        // Both loads relaxed: see `captured_count`, and `Stream::may_be_capturing` for the mark.
        // `deallocate_beyond_lane` applies the capture rules.
        if self.captured_count.load(Relaxed) != 0 || self.inner.may_be_capturing(stream) {
            return false;
        }
        let key = stream.id().get();
        self.slot_of(key).is_some_and(|slot| self.push_to_lane_of(slot, key, ptr, index, class))
    }

    /// Caches a block in the calling thread's lane of `slot`, the slot of the stream with `key`,
    /// if it has room and budget.
    #[inline(always)]
    fn push_to_lane_of(&self, slot: &Slot, key: u64, ptr: CUdeviceptr, index: usize, class: usize) -> bool {
        let Some(mut lane) = slot.lanes.get().and_then(|lanes| own_lane(&lanes[..], self.fences)) else {
            return false;
        };
        // As in `pop_from_lane`: the key, checked inside the lane, says whose blocks it holds.
        // Not touched: the allocation this block served was.
        slot.key.load(Relaxed) == key && lane.push_claiming(index, ptr, |budget| self.claim(budget, class))
    }

    #[inline(never)]
    fn allocate_beyond_lane(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        if bytes == 0 {
            return Ok(0);
        }
        if self.inner.may_be_capturing(stream) && self.inner.is_capturing(stream)? {
            return self.allocate_during_capture(bytes, align, stream);
        }
        let Some((index, class)) = size_class(bytes) else {
            return self.allocate_below(bytes, align, stream);
        };
        let key = stream.id().get();
        let found = self.find(key).map(|index| &self.slots[index]);
        match found {
            Some(slot) => {
                if let Some(ptr) = self.pop_from_lane_of(slot, key, index, class) {
                    return Ok(ptr);
                }
                let mut state = lock(&slot.state);
                if slot.key.load(Relaxed) == key {
                    self.touch(slot);
                    if let Some(ptr) = pop_shared(lanes_of(slot), self.fences, &mut state, index, class) {
                        return Ok(ptr);
                    }
                    // The bound is spent: blocks other threads left in their lanes of this stream
                    // (threads that exited, or work that moved) serve this thread before the
                    // driver is asked. Same stream, so their reuse is ordered; under the slot's
                    // lock its lanes cannot be drained for another stream meanwhile.
                    let now = self.nanos();
                    if self.unclaimed.load(Relaxed) < class && now >= state.next_gather {
                        // Each stream on its own timer: on the timer shared with the budget sweeps,
                        // a thread that arrived just after one went to the driver for 46 of 1,600
                        // allocations while every block it needed sat in other lanes (found on
                        // the 32-core H200 node, not on a 2-core VM).
                        // The budget sweeps wait for it too.
                        gather_from_lanes(lanes_of(slot), self.made_in, &mut state);
                        state.next_gather = now.saturating_add(nanos_of(LANE_SWEEP_INTERVAL));
                        self.next_lane_sweep.fetch_max(state.next_gather, Relaxed);
                        if let Some(ptr) = pop_shared(lanes_of(slot), self.fences, &mut state, index, class) {
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
        if self.captured_count.load(Relaxed) != 0 || self.inner.may_be_capturing(stream) {
            // SAFETY: forwarded under the caller's promise.
            if let Some(freed) = unsafe { self.deallocate_under_capture_rules(ptr, bytes, align, stream) } {
                return freed;
            }
        }
        let Some((index, class)) = size_class(bytes) else {
            // SAFETY: a bypassing block came from `inner` with these arguments.
            return unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        };
        let key = stream.id().get();
        if let Some(slot) = self.find(key).map(|index| &self.slots[index]) {
            // A lane's first free (or first since it was emptied): its lists are made here,
            // outside the lane, for a stream in any slot (found by the second review: only home
            // slots got them).
            if let Some(lanes) = slot.lanes.get() {
                give_lists_if_missing(&lanes[..], self.fences);
            }
            if self.push_to_lane_of(slot, key, ptr, index, class) {
                return Ok(());
            }
            let mut guard = lock(&slot.state);
            let state = &mut *guard;
            if slot.key.load(Relaxed) == key {
                // A stream's second cached free makes its lanes (8 KiB, once per slot): a stream
                // used once never has any, so slow paths have none of its to claim.
                let lanes = slot.lanes.get_or_init(|| Box::new(std::array::from_fn(|_| Lane::new())));
                // Short of budget: this thread's own lane's unfilled budget first, which needs no
                // claim (entering one's own lane never waits). Found on the 32-core node: a
                // thread whose lane was full went below with budget sitting in that lane.
                if state.budget < class {
                    if let Some(mut lane) = own_lane(&lanes[..], self.fences) {
                        state.budget += std::mem::take(&mut lane.budget);
                    }
                }
                if let Some(list) = state.blocks.get_mut(index) {
                    if self.claim(&mut state.budget, class) {
                        list.push(ptr);
                        state.cached_bytes += class;
                        self.touch(slot);
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
    /// none can fail.
    fn drop(&mut self) {
        let mut taken = Vec::new();
        for slot in self.slots.iter_mut() {
            let state = slot.state.get_mut().unwrap_or_else(PoisonError::into_inner);
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
    use crate::HostHeap;

    /// Bytes in the stream's shared lists and in its lanes.
    fn where_blocks_are(cache: &CachingResource<HostHeap>, stream: &Stream) -> (usize, usize) {
        let slot = &cache.slots[cache.find(stream.id().get()).expect("the stream has a slot")];
        let state = lock(&slot.state);
        let mut lanes = claim(vec![lanes_of(slot)], cache.made_in).expect("claimed");
        (state.cached_bytes, lanes.group(0).map(|lane| lane.cached_bytes()).sum())
    }

    /// Found on the 32-core H200 node (a regression test failed under compute-sanitizer there):
    /// a free that did not fit in the thread's full lane went below for want of budget while
    /// the lane itself held unfilled budget, and the budget sweep was not due.
    #[test]
    fn a_full_lane_lends_its_budget_to_a_free_into_the_shared_lists() {
        let _numbers = lock(&lanes::TEST_LANE_NUMBERS);
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
        assert_eq!(cache.unclaimed.load(Relaxed), 0, "the bound is spent");
        // A hit leaves `b` of budget in the lane; no budget sweep is due for a long while.
        let other = cache.allocate(b, 256, &stream).expect("a hit");
        cache.next_lane_sweep.store(u64::MAX, Relaxed);
        // SAFETY: as above.
        unsafe { cache.deallocate(blocks[10], a, 256, &stream) }.expect("cached");
        assert_eq!(where_blocks_are(&cache, &stream), (3 * a, 8 * a), "the free was cached with the lane's budget");
        // SAFETY: as above.
        unsafe { cache.deallocate(other, b, 256, &stream) }.expect("freed");
    }

    /// Found measuring 32 threads on one stream with the bound spent (1.4 M pairs/s at 100%
    /// hits): a block taken from the shared lists went back to them at its free, since the lane
    /// had no budget and the bound none to claim, so the threads kept queueing on the slot's
    /// lock. Now the block's budget follows it into the lane.
    #[test]
    fn with_the_bound_spent_a_block_from_the_shared_lists_moves_into_the_lane() {
        let _numbers = lock(&lanes::TEST_LANE_NUMBERS);
        let block = 64 << 10;
        let cache = CachingResource::with_max_cached(HostHeap, 4 * block);
        // SAFETY: HostHeap ignores streams, so the handle is never used.
        let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.expect("a fake stream");
        let pair = || {
            let blocks = [(); 4].map(|()| cache.allocate(block, 256, &stream).expect("host memory"));
            for ptr in blocks {
                // SAFETY: allocated just above with these arguments.
                unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("cached");
            }
        };
        pair();
        // Everything into the shared lists, every lane's budget to the slot: the bound is spent
        // and the lanes hold nothing.
        {
            let slot = &cache.slots[cache.find(stream.id().get()).expect("a slot")];
            let mut state = lock(&slot.state);
            gather_from_lanes(lanes_of(slot), cache.made_in, &mut state);
            let mut lanes = claim(vec![lanes_of(slot)], cache.made_in).expect("claimed");
            let budgets: usize = lanes.group(0).map(|lane| std::mem::take(&mut lane.budget)).sum();
            cache.unclaimed.fetch_add(budgets + std::mem::take(&mut state.budget), Relaxed);
            assert_eq!(state.cached_bytes, 4 * block);
            assert_eq!(cache.unclaimed.load(Relaxed), 0, "the bound is spent");
        }
        assert_eq!(where_blocks_are(&cache, &stream), (4 * block, 0));
        let ptr = cache.allocate(block, 256, &stream).expect("a hit");
        // SAFETY: allocated just above with these arguments.
        unsafe { cache.deallocate(ptr, block, 256, &stream) }.expect("cached");
        assert_eq!(where_blocks_are(&cache, &stream), (3 * block, block), "the block went to the lane");
    }

    #[test]
    fn size_classes_cover_every_size_with_little_rounding() {
        let mut last = 0;
        for bytes in (1..70_000).chain([1 << 20, (1 << 20) + 1, 3 << 30, (1 << 40) - 1]) {
            let (index, class) = size_class(bytes).expect("in range");
            assert!(class >= bytes, "{bytes} -> {class}");
            assert!(bytes <= 256 || class as f64 <= bytes as f64 * 1.25 + 1.0, "{bytes} -> {class}");
            assert_eq!(class_bytes(index), class, "index {index}");
            assert!(index < CLASSES && index >= last.min(index));
            last = index;
        }
        assert_eq!(size_class(1 << 40), Some((CLASSES - 1, 1 << 40)));
        assert_eq!(size_class((1 << 40) + 1), None);
        assert_eq!(size_class(257), Some((1, 320)));
        assert_eq!(size_class(512), Some((4, 512)));
        assert_eq!(size_class(513), Some((5, 640)));
    }
}
