//! A stream's lanes: a few free blocks per size class for each thread using the stream, which
//! that thread enters without any read-modify-write instruction.
//!
//! Threads sharing one stream would otherwise serialise on the stream's one lock, and even a
//! lock nobody else takes costs a locked instruction to take (about 10 ns on the H200 node's
//! Xeon, twice per pair). So lane `n` of every stream belongs to the thread holding lane number
//! `n` (see [`lane_number`](super::lane_number)): its *owner*. Threads beyond the first
//! [`LANES`] have no lane and use the stream's shared lists.
//!
//! The owner enters its lane by storing `busy` and reading `claimed`; a slow path of any thread
//! (release, reclaim, eviction, the no-memory retry, stats, drop, a miss once the bound is
//! spent) claims a lane by storing `claimed` and reading `busy`, waiting for the owner to leave,
//! with the two halves of the fence of [`fence`] between. Where the slow path's
//! half cannot be had, claims are refused, never made without it: the owners' hot path goes
//! on, and what their lanes hold stays cached until a claim succeeds or the cache is dropped,
//! which needs no claim. In a child forked after the cache was made, claims are refused too (a
//! lane the parent's other threads were in stays busy there). A child forked while other
//! threads were inside the cache must not use it at all (as with any lock: a slot lock or lane
//! another thread held at the fork is held for ever there).

use super::bound::Bound;
use super::fence::{self, Fences};
use super::lane_number::LANES;
use super::lane_number::{allow_fast_lane, fast_lane_number, lane_number, remember_lane, remembered_lane, NO_CACHE};
use super::size_class::{class_bytes, CLASSES};
use cumempool::sys::CUdeviceptr;
use std::cell::UnsafeCell;
use std::sync::atomic::{
    compiler_fence, AtomicBool, AtomicPtr, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst},
};

/// Blocks a lane holds per size class; further frees go to the stream's shared lists.
const DEPTH: usize = 8;

/// A stream's lanes, one per lane number: made by the stream's second cached free and kept for
/// the slot's life. A plain pointer, null until then, so that the hot path reaches the lanes
/// with one load and one test.
pub(super) struct StreamLanes(AtomicPtr<[Lane; LANES]>);

impl StreamLanes {
    pub(super) const fn new() -> Self {
        Self(AtomicPtr::new(std::ptr::null_mut()))
    }

    /// The lanes, if they were made.
    #[inline(always)]
    pub(super) fn get(&self) -> Option<&[Lane; LANES]> {
        // SAFETY: non-null only once it points to lanes made by `get_or_make` (published by its
        // release, seen by this acquire), which live until `self` is dropped.
        unsafe { self.0.load(Acquire).as_ref() }
    }

    /// The lanes, made now if they were not.
    pub(super) fn get_or_make(&self) -> &[Lane; LANES] {
        if let Some(lanes) = self.get() {
            return lanes;
        }
        let made = Box::into_raw(Box::new(std::array::from_fn(|_| Lane::new())));
        let lanes = match self.0.compare_exchange(std::ptr::null_mut(), made, AcqRel, Acquire) {
            Ok(_) => made,
            Err(first) => {
                // SAFETY: `made` came from `Box::into_raw` above and was published nowhere.
                drop(unsafe { Box::from_raw(made) });
                first
            }
        };
        // SAFETY: non-null, made by this function, freed only when `self` is dropped.
        unsafe { &*lanes }
    }

    /// The lanes through exclusive access, if they were made.
    pub(super) fn get_mut(&mut self) -> Option<&mut [Lane; LANES]> {
        // SAFETY: as in `get`; `&mut self` makes this the only reference.
        unsafe { self.0.get_mut().as_mut() }
    }
}

impl Drop for StreamLanes {
    fn drop(&mut self) {
        let lanes = *self.0.get_mut();
        if !lanes.is_null() {
            // SAFETY: made by `Box::into_raw` in `get_or_make`; nothing refers to it any more.
            drop(unsafe { Box::from_raw(lanes) });
        }
    }
}

/// One thread's free blocks on one stream.
#[repr(align(128))]
pub(super) struct Lane {
    /// Set by the owner while it works in the lane; written by no other thread.
    busy: AtomicBool,
    /// Set by a slow path that has taken the lane from its owner, or is waiting to.
    claimed: AtomicBool,
    /// The LRU clock when the owner last took a block from the lane: a hit marks its lane,
    /// not the slot, so that it writes no line other threads share. Read without a claim by
    /// eviction (see [`SlotTable::last_used`](super::table::SlotTable::last_used)). Never reset:
    /// a slot's next stream registers at a later time than any mark its lanes hold.
    used: AtomicU64,
    state: UnsafeCell<LaneState>,
}

// SAFETY: `state` is only reached through an `OwnedLane` or `ClaimedLanes`, which exclude each
// other through `busy` and `claimed` (see the module's documentation), with acquire/release
// ordering from one holder to the next. `LaneState` itself is `Send`. In the asymmetric mode
// the exclusion rests on the kernel's guarantee for `membarrier(PRIVATE_EXPEDITED)` (every
// running thread of the process executes a full barrier before it returns) paired with the
// owner's compiler fence, a pairing the Rust memory model does not describe; it is the
// technique of Linux's userspace RCU and folly's asymmetric barriers. Miri checks the same
// protocol with ordinary fences on both sides, and native stress tests run the asymmetric one.
unsafe impl Sync for Lane {}

/// The bytes of the bound a lane has claimed are its `budget`, and for each size class, its
/// `Lists::reserved` blocks' bytes: the blocks it holds fill the reserved ones, and the hot path
/// moves blocks between held and reserved-but-empty without touching a byte count. A
/// reservation left empty (the thread's sizes moved on) is budget like any other to the slow
/// paths: [`take_unfilled`](Self::take_unfilled) takes both back.
#[derive(Default)]
pub(super) struct LaneState {
    /// Budget this lane has claimed from the bound and not yet reserved for a size class.
    pub budget: usize,
    /// Made when the lane first caches a block.
    lists: Option<Box<Lists>>,
    pub hits: u64,
    /// [`NO_STREAM`] or the key of the lane's slot, and then `lists` are made: what the hot path
    /// checks inside the lane (see [`enter_remembered`]). Set by the owner inside the lane once
    /// it has seen that key in the slot there ([`OwnedLane::ready_for`]); a slot's key changes
    /// from a stream's only while a slow path holds all its lanes' claims, and that path resets
    /// this ([`drain_into`](Self::drain_into)) before it gives them back, or when the cache is
    /// dropped (`&mut`, no lane entered again). So whenever no slow path holds the lane, a key
    /// here is the slot's.
    key: u64,
}

/// `LaneState::key` of a lane ready for no stream: stream keys start at 1.
const NO_STREAM: u64 = 0;

/// A cache's identity for the lanes its threads remember: unique in the process, never reused
/// (a cache dropped and another made at the same address have different ids).
pub(super) struct CacheId(u64);

impl CacheId {
    pub(super) fn new() -> Self {
        // Neither `NO_CACHE` nor `CLOSED` until 2^64 caches have been made.
        static NEXT: AtomicU64 = AtomicU64::new(NO_CACHE + 1);
        Self(NEXT.fetch_add(1, Relaxed))
    }

    /// Whether the calling thread remembers a lane of this cache ready for the stream with
    /// `key`.
    #[cfg(test)]
    pub(super) fn remembered_by_this_thread(&self, key: u64) -> bool {
        enter_remembered(self, key).is_ok()
    }
}

/// What a closed [`FreeGate`] holds: no cache's id, and not `NO_CACHE`, so no thread's
/// remembered cache matches it.
const CLOSED: u64 = u64::MAX;

/// Whether frees may enter the lanes threads remember in one cache without a look at the block:
/// the cache's id while they may, [`CLOSED`] while they may not. The free's hot path compares
/// it with the cache the thread remembers, in place of the cache's id, so that the one
/// comparison finds the lane and keeps out frees that must be looked at first.
pub(super) struct FreeGate {
    open: u64,
    value: AtomicU64,
}

impl FreeGate {
    /// An open gate of the cache with id `cache`.
    pub(super) fn new(cache: &CacheId) -> Self {
        Self { open: cache.0, value: AtomicU64::new(cache.0) }
    }

    /// Keeps frees out of remembered lanes until [`open`](Self::open). A free that
    /// happens after this (through whatever ordered it after) sees it, or a later change.
    pub(super) fn close(&self) {
        self.value.store(CLOSED, Relaxed);
    }

    /// Lets frees into remembered lanes again.
    pub(super) fn open(&self) {
        self.value.store(self.open, Relaxed);
    }
}

/// A lane's blocks: fixed-size arrays, so that the hot path checks one index.
struct Lists {
    /// Blocks held per size class: at most `reserved` each, which `pop` and `push` rely on (a
    /// count grows only in `push` and `push_reserving`, below `reserved`).
    counts: [u8; CLASSES],
    /// Blocks per size class whose bytes the lane has claimed (see [`LaneState`]): at least
    /// `counts`, at most `DEPTH`.
    reserved: [u8; CLASSES],
    /// `DEPTH` entries per size class, the first `counts[class]` of them held.
    blocks: [[CUdeviceptr; DEPTH]; CLASSES],
}

/// Gives the calling thread's lane among `lanes` its lists if it has none. They are made
/// before the thread enters the lane: an allocation inside a lane could reach a global
/// allocator that calls back into the cache, and a slow path there could wait for this very
/// lane.
pub(super) fn give_lists_if_missing(lanes: &[Lane]) {
    if own_lane(lanes).is_none_or(|lane| lane.lists.is_some()) {
        return;
    }
    let lists = Box::new(Lists { counts: [0; CLASSES], reserved: [0; CLASSES], blocks: [[0; DEPTH]; CLASSES] });
    let spare = match own_lane(lanes) {
        Some(mut lane) if lane.lists.is_none() => {
            lane.lists = Some(lists);
            None
        }
        _ => Some(lists),
    };
    // Freed, if unused, outside the lane for the same reason.
    drop(spare);
}

impl Lane {
    /// The lane's state through exclusive access (the cache is being dropped, so no thread is
    /// in any of its lanes); `None` for a lane left busy, which only a fork can do (a thread of
    /// the parent was inside it): its state may be half updated, so it is left alone.
    pub(super) fn state_if_idle(&mut self) -> Option<&mut LaneState> {
        (!*self.busy.get_mut()).then(|| self.state.get_mut())
    }

    /// When the owner last took a block from the lane (see `used`).
    pub(super) fn last_used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    pub(super) fn new() -> Self {
        Self {
            busy: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
            used: AtomicU64::new(0),
            state: UnsafeCell::new(LaneState::default()),
        }
    }
}

/// The calling thread in its own lane of one stream.
pub(super) struct OwnedLane<'a> {
    lane: &'a Lane,
}

/// The calling thread's own lane among a stream's `lanes`, unless it has none (a thread beyond
/// the first [`LANES`], or one whose thread-locals are being destroyed), a slow path holds it,
/// or the thread is in it already (a re-entrant call from inside the cache).
#[inline(always)]
pub(super) fn own_lane(lanes: &[Lane]) -> Option<OwnedLane<'_>> {
    own_lane_quickly(lanes).unwrap_or_else(|SlowEntry| own_lane_slowly(lanes))
}

/// The calling thread must enter its lanes with [`own_lane`], out of line.
pub(super) struct SlowEntry;

/// [`own_lane`] for the hot path: the entry with the owner's light fence, for a thread whose
/// number allows it; [`SlowEntry`] for anything else (a thread's first entry, a thread without
/// a lane, a process that fences symmetrically), so that the hot path keeps nothing live
/// across the call that [`own_lane_slowly`] is.
#[inline(always)]
pub(super) fn own_lane_quickly(lanes: &[Lane]) -> Result<Option<OwnedLane<'_>>, SlowEntry> {
    let number = fast_lane_number();
    if number >= LANES {
        return Err(SlowEntry);
    }
    Ok(lanes.get(number).and_then(|lane| enter(lane, fast_lane_fence)))
}

/// The owner's half of the fence for a thread with a fast lane: the process fences
/// asymmetrically (see `allow_fast_lane`), so a compiler fence, which the slow path's
/// `membarrier` completes. Under Miri, which has no `membarrier` and so fences symmetrically,
/// threads take the fast entry all the same with a full fence, which the slow path's full fence
/// pairs with: Miri then checks the hot path's own code (the remembered lane, the lane's key).
#[inline(always)]
fn fast_lane_fence() {
    #[cfg(not(miri))]
    compiler_fence(SeqCst);
    #[cfg(miri)]
    std::sync::atomic::fence(SeqCst);
}

/// The calling thread's own lane of the stream with `key` in the cache with id `cache`, entered,
/// if the thread remembers that lane (see [`OwnedLane::ready_for`]): the hot path's lookup.
/// [`Entry::Elsewhere`] when it remembers no lane of that cache, or its lane there is not ready
/// for that stream (it is another stream's, or its slot was given up); [`Entry::Refused`] when
/// a slow path holds it. A lane ready for the stream has its lists.
#[inline(always)]
pub(super) fn enter_remembered(cache: &CacheId, key: u64) -> Result<ReadyLane<'_>, Entry> {
    enter_remembered_past(cache, cache.0, key)
}

/// [`enter_remembered`] for a free: [`Entry::Elsewhere`] too while `gate`, the gate of the cache
/// with id `cache`, is closed.
#[inline(always)]
pub(super) fn enter_remembered_to_free<'a>(
    cache: &'a CacheId,
    gate: &FreeGate,
    key: u64,
) -> Result<ReadyLane<'a>, Entry> {
    debug_assert_eq!(gate.open, cache.0, "the gate of another cache");
    enter_remembered_past(cache, gate.value.load(Relaxed), key)
}

/// [`enter_remembered`] with `compare`, the id of `cache` or [`CLOSED`], in place of that id in
/// the comparison with the cache the thread remembers.
#[inline(always)]
fn enter_remembered_past(cache: &CacheId, compare: u64, key: u64) -> Result<ReadyLane<'_>, Entry> {
    debug_assert!(compare == cache.0 || compare == CLOSED);
    let lane = remembered_lane(compare).ok_or(Entry::Elsewhere)?;
    // SAFETY: remembered by `OwnedLane::ready_for` for the cache with id `compare`: no thread
    // remembers `CLOSED`, so `compare` is `cache`'s id, whose owner (ids are never reused) has
    // lanes that live as long as it does (that function's contract); `&cache` borrows that
    // owner.
    let lane = unsafe { &*lane.cast::<Lane>() };
    // A remembered lane is the thread's own lane, of number `FAST_LANE`, in one of the cache's
    // slots, whichever stream it is for: it enters with the light fence (see
    // `allow_fast_lane`), and owning it, may enter it whatever stream it serves. The thread is
    // not inside it now: see `enter_from_outside`.
    let lane = enter_from_outside(lane).ok_or(Entry::Refused)?;
    // Inside the lane: see `LaneState::key`. A lane whose key is `key` is the thread's own lane
    // of the slot of the stream with `key`, and ready (its lists made) as long as `key` is a
    // stream's, not `NO_STREAM`: a stream id is never 0, which the compiler knows of ids read
    // from a stream, so the first test costs nothing there. On a mismatch, dropping `lane`
    // leaves it.
    if key == NO_STREAM || lane.key != key {
        return Err(Entry::Elsewhere);
    }
    Ok(ReadyLane(lane))
}

/// Why [`enter_remembered`] did not enter a lane.
pub(super) enum Entry {
    /// The thread remembers no lane of this cache, or the lane it remembers is not ready for
    /// this stream (it is another stream's, or its slot was given up): the slot must be looked
    /// up.
    Elsewhere,
    /// A slow path holds the lane the thread remembers.
    Refused,
}

/// `own_lane` for a thread without the hot path's entry: takes or trades its lane number, and
/// fences as the process chose; allows the hot path's entry from then on where it can.
#[cold]
#[inline(never)]
fn own_lane_slowly(lanes: &[Lane]) -> Option<OwnedLane<'_>> {
    let fences = fence::prepare_fences();
    let number = lane_number();
    if fences == Fences::Asymmetric || cfg!(miri) {
        allow_fast_lane(number);
    }
    enter(lanes.get(number)?, || fences.light())
}

/// Enters `lane`, the calling thread's own lane, with the light fence, for a thread known not
/// to be inside it: [`enter`] without the test for that.
///
/// A thread is inside a lane only while the cache's own code runs between [`enter`] (or this)
/// and the `OwnedLane`'s drop, and that code calls out to nothing that could reach the cache
/// again: no heap allocation (a global allocator could call the cache; `give_lists_if_missing`
/// allocates before it enters), no lock, no callback, no logging. So no call of the hot path can
/// begin while its thread is inside its remembered lane, and the test `enter` makes for such a
/// call cannot fail. (A signal handler that allocates from the cache could interrupt a thread
/// inside a lane: the cache, which takes locks on its slow paths, is not async-signal-safe, as
/// no allocator is.) Debug builds keep the test.
#[inline(always)]
fn enter_from_outside(lane: &Lane) -> Option<OwnedLane<'_>> {
    debug_assert!(!lane.busy.load(Relaxed), "a thread entered its lane from inside it");
    enter_unless_claimed(lane, fast_lane_fence)
}

/// Enters `lane` as its owner, with `light` the owner's half of the fence.
#[inline(always)]
fn enter(lane: &Lane, light: impl FnOnce()) -> Option<OwnedLane<'_>> {
    // Only the owner stores `true` here, so reading it set means this thread is inside.
    if lane.busy.load(Relaxed) {
        return None;
    }
    enter_unless_claimed(lane, light)
}

/// [`enter`] for its owner, known to be outside it: enters unless a slow path claimed it.
#[inline(always)]
fn enter_unless_claimed(lane: &Lane, light: impl FnOnce()) -> Option<OwnedLane<'_>> {
    lane.busy.store(true, Relaxed);
    light();
    if lane.claimed.load(Acquire) {
        lane.busy.store(false, Release);
        return None;
    }
    Some(OwnedLane { lane })
}

impl std::ops::Deref for OwnedLane<'_> {
    type Target = LaneState;
    #[inline]
    fn deref(&self) -> &LaneState {
        // SAFETY: the owner is in the lane and no slow path has claimed it.
        unsafe { &*self.lane.state.get() }
    }
}

impl std::ops::DerefMut for OwnedLane<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut LaneState {
        // SAFETY: as in `deref`; `&mut self` keeps this the only reference.
        unsafe { &mut *self.lane.state.get() }
    }
}

impl<'a> OwnedLane<'a> {
    /// The lane ready for the stream with `key` if it has its lists (see `LaneState::key`),
    /// remembered by the calling thread as its lane in the cache `cache` (see
    /// [`enter_remembered`]); `None` for a lane without lists, which holds no block and takes
    /// none.
    ///
    /// # Safety
    /// `lanes` is the whole lane array of a slot of that cache, indexed by lane number (the
    /// thread's own lane is `lanes[FAST_LANE]`, which is remembered: a part of the array would
    /// remember another thread's lane), this lane is the thread's own among them, and the
    /// caller read that slot's key inside this lane as `key`; those lanes live as long as
    /// `cache` does.
    pub(super) unsafe fn ready_for(mut self, cache: &'a CacheId, key: u64, lanes: &'a [Lane]) -> Option<ReadyLane<'a>> {
        if self.lists.is_none() || key == NO_STREAM {
            return None;
        }
        self.key = key;
        // SAFETY: `lanes` are the cache's and live as long as `cache` (this function's contract).
        unsafe { remember_lane(cache.0, lanes) };
        Some(ReadyLane(self))
    }
}

/// The calling thread in its own lane, which is ready for a stream (`LaneState::key` is that
/// stream's key, not [`NO_STREAM`]): its lists are made.
pub(super) struct ReadyLane<'a>(OwnedLane<'a>);

impl std::ops::Deref for ReadyLane<'_> {
    type Target = LaneState;
    #[inline]
    fn deref(&self) -> &LaneState {
        &self.0
    }
}

impl std::ops::DerefMut for ReadyLane<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut LaneState {
        &mut self.0
    }
}

impl ReadyLane<'_> {
    /// The lane's lists, without a test.
    #[inline(always)]
    fn lists(&mut self) -> &mut Lists {
        // SAFETY: a ready lane's key is a stream's, and a lane whose key is a stream's has its
        // lists (see `LaneState::key`): `ready_for` sets the key only with the lists made, and
        // only `drain_into`, which resets the key, takes them away.
        unsafe { self.0.lists.as_deref_mut().unwrap_unchecked() }
    }

    /// Marks the lane used at `now` on the LRU clock.
    #[inline(always)]
    pub(super) fn mark_used(&self, now: u64) {
        self.0.lane.used.store(now, Relaxed);
    }

    /// A block of size class `index`, if the lane holds one. Its bytes stay reserved for the
    /// class in this lane.
    #[inline(always)]
    pub(super) fn pop(&mut self, index: usize) -> Option<CUdeviceptr> {
        let lists = self.lists();
        let (count, blocks) = (lists.counts.get_mut(index)?, lists.blocks.get(index)?);
        let left = usize::from(*count).checked_sub(1)?;
        // Below `DEPTH`, so it fits.
        *count = left as u8;
        // SAFETY: a count is at most `DEPTH` (see `Lists::counts`), so `left` is below it.
        Some(unsafe { *blocks.get_unchecked(left) })
    }

    /// Keeps a block of size class `index` (of `class` bytes) if the lane has room in that
    /// class: in a block reserved and empty, or else one reserved now from the lane's budget,
    /// claimed from `bound` when short; false, with at most a chunk of budget claimed, otherwise.
    #[inline(always)]
    pub(super) fn push(&mut self, index: usize, ptr: CUdeviceptr, class: usize, bound: &Bound) -> bool {
        let lists = self.lists();
        let (Some(count), Some(&reserved), Some(blocks)) =
            (lists.counts.get_mut(index), lists.reserved.get(index), lists.blocks.get_mut(index))
        else {
            return false;
        };
        if *count >= reserved {
            // Out of line, with the state (not this lane handle, which would then live in
            // memory), so that nothing here lives across the call.
            return self.0.push_reserving(index, ptr, class, bound);
        }
        // SAFETY: `count` is below `reserved`, which is at most `DEPTH` (see `Lists::reserved`).
        unsafe { *blocks.get_unchecked_mut(usize::from(*count)) = ptr };
        *count += 1;
        true
    }
}

impl Drop for OwnedLane<'_> {
    #[inline]
    fn drop(&mut self) {
        self.lane.busy.store(false, Release);
    }
}

/// Lanes a slow path has taken from their owners, in groups (a stream's lanes each); they go
/// back when this is dropped.
pub(super) struct ClaimedLanes<'a> {
    groups: Vec<&'a [Lane]>,
}

/// Why a slow path could not take lanes from their owners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unreachable {
    /// `membarrier` failed for good after the process had chosen it (a seccomp filter installed
    /// after the first cache was made, say): without it an owner's entry cannot be excluded.
    Membarrier,
    /// `membarrier` failed with an error that passes (ENOMEM, EINTR, EAGAIN) on every try of
    /// this claim; later claims try again.
    MembarrierBusy,
    /// This process is a child forked after the cache was made: lanes the parent's other
    /// threads were inside at the fork stay marked busy for ever.
    ForkedChild,
}

impl Unreachable {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Unreachable::Membarrier => {
                "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed after it was registered (a seccomp filter \
                 installed after the first cache was made?); allow it, or make caches only after the filter"
            }
            Unreachable::MembarrierBusy => {
                "membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed with a passing error (ENOMEM, EINTR, EAGAIN) on \
                 every try; try again later"
            }
            Unreachable::ForkedChild => {
                "this process is a child forked after the cache was made; make a new cache in the child"
            }
        }
    }
}

/// Claims every lane of `groups` (one fence for all of them), waiting for owners inside to
/// leave. Callers claim a stream's lanes only while they hold its slot's lock, and take no slot
/// lock while they hold claims, so no two slow paths ever wait for the same lane. `made_in` is
/// the id of the process that made the cache.
///
/// # Errors
/// When the fence cannot be had, or in a forked child (see [`Unreachable`]): then no lane is
/// claimed, and their blocks stay where they are.
pub(super) fn claim(groups: Vec<&[Lane]>, made_in: u32) -> Result<ClaimedLanes<'_>, Unreachable> {
    let lanes = || groups.iter().flat_map(|group| group.iter());
    debug_assert!(
        {
            let mut at: Vec<*const Lane> = lanes().map(std::ptr::from_ref).collect();
            at.sort_unstable();
            at.windows(2).all(|pair| pair[0] != pair[1])
        },
        "a lane claimed twice would wait for itself"
    );
    if groups.iter().all(|group| group.is_empty()) {
        return Ok(ClaimedLanes { groups });
    }
    if std::process::id() != made_in {
        return Err(Unreachable::ForkedChild);
    }
    // Once `membarrier` has failed for good, without taking and giving back every claim first.
    if fence::failed_for_good() {
        return Err(Unreachable::Membarrier);
    }
    for lane in lanes() {
        let mut spins = 0u32;
        while lane.claimed.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            back_off(&mut spins);
        }
    }
    // Dropping the claims gives them back, whatever happens next.
    let claimed = ClaimedLanes { groups };
    fence::heavy_fence().map_err(|why| match why {
        fence::Unavailable::ForGood => Unreachable::Membarrier,
        fence::Unavailable::ForNow => Unreachable::MembarrierBusy,
    })?;
    for lane in claimed.groups.iter().flat_map(|group| group.iter()) {
        let mut spins = 0u32;
        while lane.busy.load(Acquire) {
            back_off(&mut spins);
        }
    }
    Ok(claimed)
}

impl ClaimedLanes<'_> {
    /// The states of the lanes of group `group`.
    pub(super) fn group(&mut self, group: usize) -> impl Iterator<Item = &mut LaneState> + '_ {
        let lanes = self.groups.get(group).copied().unwrap_or_default();
        // SAFETY: every lane here is claimed and its owner outside; `&mut self` keeps these the
        // only references while they live, and each lane appears once.
        lanes.iter().map(|lane| unsafe { &mut *lane.state.get() })
    }
}

impl Drop for ClaimedLanes<'_> {
    fn drop(&mut self) {
        for lane in self.groups.iter().flat_map(|group| group.iter()) {
            lane.claimed.store(false, Release);
        }
    }
}

/// Spins briefly, then yields: whoever holds a lane leaves it within a few instructions unless
/// it was descheduled.
fn back_off(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

impl LaneState {
    /// `ReadyLane::push` for a class whose reserved blocks are all held: reserves one more from
    /// the budget (claimed from `bound` when short), unless the class holds `DEPTH` already.
    #[cold]
    #[inline(never)]
    fn push_reserving(&mut self, index: usize, ptr: CUdeviceptr, class: usize, bound: &Bound) -> bool {
        let Some(lists) = self.lists.as_deref_mut() else { return false };
        let (Some(count), Some(reserved), Some(blocks)) =
            (lists.counts.get_mut(index), lists.reserved.get_mut(index), lists.blocks.get_mut(index))
        else {
            return false;
        };
        // No entry at `count` means the class is full (`count == DEPTH`).
        let Some(entry) = blocks.get_mut(usize::from(*count)) else { return false };
        if !bound.claim(&mut self.budget, class) {
            return false;
        }
        *entry = ptr;
        *count += 1;
        // Held blocks never outnumber reserved ones: `count` was at least `reserved`, and is at
        // most `DEPTH` now.
        *reserved = (*reserved).max(*count);
        true
    }

    /// Takes back what the lane claimed and holds no block in: its budget, and its reserved
    /// blocks left empty; answers those bytes.
    pub(super) fn take_unfilled(&mut self) -> usize {
        let mut bytes = std::mem::take(&mut self.budget);
        if let Some(lists) = self.lists.as_deref_mut() {
            for (index, (reserved, &count)) in lists.reserved.iter_mut().zip(&lists.counts).enumerate() {
                bytes += usize::from(*reserved - count) * class_bytes(index);
                *reserved = count;
            }
        }
        bytes
    }

    /// The blocks of each size class: (class, blocks).
    fn held(&self) -> impl Iterator<Item = (usize, &[CUdeviceptr])> {
        self.lists.iter().flat_map(|lists| {
            lists
                .counts
                .iter()
                .zip(&lists.blocks)
                .enumerate()
                .map(|(index, (&count, blocks))| (index, blocks.get(..usize::from(count)).unwrap_or_default()))
        })
    }

    /// Moves the blocks of size class `index` into `list`; answers how many.
    pub(super) fn take_class(&mut self, index: usize, list: &mut Vec<CUdeviceptr>) -> usize {
        let Some(lists) = self.lists.as_deref_mut() else { return 0 };
        let (Some(count), Some(reserved), Some(blocks)) =
            (lists.counts.get_mut(index), lists.reserved.get_mut(index), lists.blocks.get(index))
        else {
            return 0;
        };
        let n = usize::from(std::mem::take(count));
        // Their bytes go with them (the caller counts them where they land).
        *reserved -= n as u8;
        list.extend_from_slice(blocks.get(..n).unwrap_or_default());
        n
    }

    /// Moves every block into `lists` (by size class) and empties the lane; answers the bytes
    /// it claimed, blocks and budget, for the bound.
    pub(super) fn drain_into(&mut self, lists: &mut [Vec<CUdeviceptr>]) -> usize {
        let bytes = self.cached_bytes() + self.take_unfilled();
        for (index, held) in self.held() {
            if let Some(list) = lists.get_mut(index) {
                list.extend_from_slice(held);
            }
        }
        // A slow path: give the lists' host memory back too (64 lanes of 256 streams would
        // otherwise keep about 140 MiB); the lane's next free makes them again. Called for a
        // slot given up, under the lane's claim (or by the cache's drop, which no thread can be
        // inside): the lane is ready for no stream now.
        self.lists = None;
        self.key = NO_STREAM;
        bytes
    }

    /// Bytes held: counted on slow paths, so that the hot path updates only the budget.
    pub(super) fn cached_bytes(&self) -> usize {
        self.held().map(|(index, held)| held.len() * class_bytes(index)).sum()
    }

    /// The bytes of the bound the lane has claimed: its budget and its reserved blocks (see
    /// [`LaneState`]), after asserting `counts <= reserved <= DEPTH`.
    #[cfg(test)]
    pub(super) fn claimed_bytes(&self) -> usize {
        let lists = self.lists.iter().flat_map(|lists| lists.counts.iter().zip(&lists.reserved).enumerate());
        self.budget
            + lists
                .map(|(index, (&count, &reserved))| {
                    assert!(
                        count <= reserved && usize::from(reserved) <= DEPTH,
                        "class {index}: {count} of {reserved}"
                    );
                    usize::from(reserved) * class_bytes(index)
                })
                .sum::<usize>()
    }

    /// Blocks held.
    pub(super) fn blocks(&self) -> usize {
        self.held().map(|(_, held)| held.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caching::lane_number::{LANES, TEST_LANE_NUMBERS};
    use crate::caching::lock::lock;

    fn lanes() -> Vec<Lane> {
        (0..LANES).map(|_| Lane::new()).collect()
    }

    #[test]
    fn a_thread_inside_its_lane_cannot_enter_it_again() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let inside = own_lane(&lanes);
        assert!(inside.is_some());
        assert!(own_lane(&lanes).is_none(), "a re-entrant call would alias the lane's state");
        drop(inside);
        assert!(own_lane(&lanes).is_some());
    }

    #[test]
    fn a_claimed_lane_turns_its_owner_away_until_given_back() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let mut claimed = claim(vec![&lanes[..]], std::process::id()).expect("claimed");
        assert!(own_lane(&lanes).is_none());
        claimed.group(0).for_each(|lane| lane.budget += 1);
        drop(claimed);
        let lane = own_lane(&lanes).expect("given back");
        assert_eq!(lane.budget, 1, "the owner sees what the claim wrote");
    }

    #[test]
    fn no_two_living_threads_own_one_lane_and_threads_beyond_the_lanes_own_none() {
        let _numbers = lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let threads = LANES + 6;
        let barrier = std::sync::Barrier::new(threads);
        let owned: Vec<Option<usize>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (lanes, barrier) = (&lanes, &barrier);
                    scope.spawn(move || {
                        let lane = own_lane(lanes);
                        let at = lane.as_ref().map(|lane| std::ptr::from_ref(lane.lane) as usize);
                        barrier.wait(); // every thread holds its lane at once
                        at
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap_or(None)).collect()
        });
        let mut at: Vec<usize> = owned.iter().flatten().copied().collect();
        assert!(at.len() <= LANES);
        at.sort_unstable();
        at.dedup();
        assert_eq!(at.len(), owned.iter().flatten().count(), "two threads in one lane");
    }
}
