//! A stream's lanes: a few free blocks per size class for each thread using the stream, which
//! that thread enters without any read-modify-write instruction.
//!
//! Threads sharing one stream would otherwise serialise on the stream's one lock, and even a
//! lock nobody else takes costs a locked instruction to take (about 10 ns on the H200 node's
//! Xeon, twice per pair). So each thread gets a lane number for its life, and lane `n` of every
//! stream belongs to the thread holding number `n`: its *owner*. A number is given back when its
//! thread exits, and the next thread to start takes it, with the blocks the lane holds. Threads
//! beyond the first [`LANES`] have no lane and use the stream's shared lists.
//!
//! The owner enters its lane by storing `busy` and reading `claimed`; a slow path of any thread
//! (release, reclaim, eviction, the no-memory retry, stats, drop, a miss once the bound is
//! spent) claims a lane by storing `claimed` and reading `busy`, waiting for the owner to leave.
//! That is Dekker's mutual exclusion, which needs a full fence between each side's store and
//! load. The owner's side runs on every hot path, so it gets the free half of an asymmetric
//! fence (a compiler fence), and the slow path the expensive half: a `membarrier` system call
//! that makes every running thread of the process execute a full fence (Linux 4.14 and later).
//! Where that call cannot be registered (other systems, a kernel or sandbox without it, Miri),
//! both sides use an ordinary sequentially consistent fence, which costs the owner about what a
//! lock would. Should the call fail later, claims are refused, never made without the fence:
//! for good when the failure is permanent (a seccomp filter installed after the first cache:
//! EPERM; ENOSYS; a command the kernel no longer accepts), or in a child forked after the cache
//! was made (a lane the parent's other threads were in stays busy there); for that claim only
//! when it passes (ENOMEM, EINTR, EAGAIN: retried a few times first). The owners' hot path goes
//! on, and what their lanes hold stays cached until a claim succeeds or the cache is dropped,
//! which needs no claim. A child forked while other threads were inside the cache must not use it at all (as
//! with any lock: a slot lock or lane another thread held at the fork is held for ever there).

use super::{class_bytes, CLASSES};
use cumempool::sys::CUdeviceptr;
use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{
    compiler_fence, fence, AtomicBool, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release, SeqCst},
};
use std::sync::{Mutex, OnceLock};

/// Lanes per stream: up to this many threads share a stream without sharing a lock.
pub(super) const LANES: usize = 64;
/// Blocks a lane holds per size class; further frees go to the stream's shared lists.
const DEPTH: usize = 8;

/// One thread's free blocks on one stream.
#[repr(align(128))]
pub(super) struct Lane {
    /// Set by the owner while it works in the lane; written by no other thread.
    busy: AtomicBool,
    /// Set by a slow path that has taken the lane from its owner, or is waiting to.
    claimed: AtomicBool,
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

/// In this order (`repr(C)`): with `budget` and `hits` side by side, the compiler updates both
/// with one 16-byte load and store on a hit, and the next hit's 16-byte load then spans the
/// free's 8-byte store of `budget` alone, which the processor cannot forward from its store
/// buffer: a stall of a dozen cycles on every pair.
#[derive(Default)]
#[repr(C)]
pub(super) struct LaneState {
    /// Budget this lane has claimed from the bound and not yet filled with blocks.
    pub budget: usize,
    /// Made when the lane first caches a block.
    lists: Option<Box<Lists>>,
    pub hits: u64,
}

/// A lane's blocks: fixed-size arrays, so that the hot path checks one index.
struct Lists {
    /// Blocks held per size class.
    counts: [u8; CLASSES],
    /// `DEPTH` entries per size class, the first `counts[class]` of them held.
    blocks: [[CUdeviceptr; DEPTH]; CLASSES],
}

/// Gives the calling thread's lane among `lanes` its lists if it has none. They are made
/// before the thread enters the lane: an allocation inside a lane could reach a global
/// allocator that calls back into the cache, and a slow path there could wait for this very
/// lane.
pub(super) fn give_lists_if_missing(lanes: &[Lane], fences: Fences) {
    if own_lane(lanes, fences).is_none_or(|lane| lane.lists.is_some()) {
        return;
    }
    let lists = Box::new(Lists { counts: [0; CLASSES], blocks: [[0; DEPTH]; CLASSES] });
    let spare = match own_lane(lanes, fences) {
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

    pub(super) fn new() -> Self {
        Self {
            busy: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
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
pub(super) fn own_lane(lanes: &[Lane], fences: Fences) -> Option<OwnedLane<'_>> {
    let lane = lanes.get(lane_number())?;
    // Only the owner stores `true` here, so reading it set means this thread is inside.
    if lane.busy.load(Relaxed) {
        return None;
    }
    lane.busy.store(true, Relaxed);
    fences.light();
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
    if MEMBARRIER_FAILED.load(Relaxed) {
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
    heavy_fence()?;
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
    /// A block of size class `index`, if the lane holds one.
    #[inline(always)]
    pub(super) fn pop(&mut self, index: usize) -> Option<CUdeviceptr> {
        let lists = self.lists.as_deref_mut()?;
        let (count, blocks) = (lists.counts.get_mut(index)?, lists.blocks.get(index)?);
        *count = count.checked_sub(1)?;
        // `count` never exceeds `DEPTH`, so the remainder is the count itself; it spares the
        // hot path a bounds check.
        Some(blocks[usize::from(*count) % DEPTH])
    }

    /// Keeps a block of size class `index` if the lane has its lists (see
    /// [`give_lists_if_missing`]) and room in that class, and `claim` takes its bytes from the
    /// lane's budget; false, with nothing changed but what `claim` did, otherwise.
    #[inline(always)]
    pub(super) fn push_claiming(
        &mut self,
        index: usize,
        ptr: CUdeviceptr,
        claim: impl FnOnce(&mut usize) -> bool,
    ) -> bool {
        let Some(lists) = self.lists.as_deref_mut() else { return false };
        let (Some(count), Some(blocks)) = (lists.counts.get_mut(index), lists.blocks.get_mut(index)) else {
            return false;
        };
        // No entry at `count` means the class is full (`count == DEPTH`).
        let Some(entry) = blocks.get_mut(usize::from(*count)) else { return false };
        if !claim(&mut self.budget) {
            return false;
        }
        *entry = ptr;
        *count += 1;
        true
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
        let (Some(count), Some(blocks)) = (lists.counts.get_mut(index), lists.blocks.get(index)) else { return 0 };
        let n = usize::from(std::mem::take(count));
        list.extend_from_slice(blocks.get(..n).unwrap_or_default());
        n
    }

    /// Moves every block into `lists` (by size class) and empties the lane; answers the bytes
    /// it held, blocks and budget, for the bound.
    pub(super) fn drain_into(&mut self, lists: &mut [Vec<CUdeviceptr>]) -> usize {
        let bytes = self.cached_bytes();
        for (index, held) in self.held() {
            if let Some(list) = lists.get_mut(index) {
                list.extend_from_slice(held);
            }
        }
        // A slow path: give the lists' host memory back too (64 lanes of 256 streams would
        // otherwise keep about 140 MiB); the lane's next free makes them again.
        self.lists = None;
        bytes + std::mem::take(&mut self.budget)
    }

    /// Bytes held: counted on slow paths, so that the hot path updates only the budget.
    pub(super) fn cached_bytes(&self) -> usize {
        self.held().map(|(index, held)| held.len() * class_bytes(index)).sum()
    }

    /// Blocks held.
    pub(super) fn blocks(&self) -> usize {
        self.held().map(|(_, held)| held.len()).sum()
    }
}

/// Set when `membarrier` failed for good after it had been chosen (nothing lifts a seccomp
/// filter).
static MEMBARRIER_FAILED: AtomicBool = AtomicBool::new(false);

/// Set once a claim was refused for a `membarrier` failure that passes, so that only the first
/// is logged as a warning.
#[cfg(all(target_os = "linux", not(miri)))]
static MEMBARRIER_BUSY_LOGGED: AtomicBool = AtomicBool::new(false);

/// Which fences pair up: decided once, before any cache exists, and never changed after.
static FENCES: OnceLock<Fences> = OnceLock::new();

/// How lanes fence, as decided for the process; each cache keeps a copy, so that the hot path
/// reads it next to the cache's other fields rather than from a static.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fences {
    /// The owner uses a compiler fence; slow paths `membarrier`.
    Asymmetric,
    /// Both sides use a full fence.
    Symmetric,
}

/// Decides how lanes fence, registering this process for `membarrier` if it can. Called by
/// every cache's constructor: owners use the decision only through a cache, made after it.
pub(super) fn prepare_fences() -> Fences {
    *FENCES.get_or_init(|| if register_membarrier() { Fences::Asymmetric } else { Fences::Symmetric })
}

impl Fences {
    /// The owner's half of the fence between storing `busy` and reading `claimed`.
    #[inline]
    fn light(self) {
        match self {
            Fences::Asymmetric => compiler_fence(SeqCst),
            Fences::Symmetric => fence(SeqCst),
        }
    }
}

/// A slow path's half of the fence between storing `claimed` and reading `busy`; why not when
/// it cannot be had.
fn heavy_fence() -> Result<(), Unreachable> {
    if FENCES.get() == Some(&Fences::Asymmetric) {
        expedited_membarrier()
    } else {
        fence(SeqCst);
        Ok(())
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
fn register_membarrier() -> bool {
    use rustix::thread::{membarrier, MembarrierCommand};
    membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn register_membarrier() -> bool {
    false
}

/// Tries of one `membarrier` that fails with an error that passes, before the claim gives up.
const MEMBARRIER_TRIES: u32 = 4;

/// Makes every running thread of the process execute a full memory barrier. Owners already
/// chose the compiler fence, so nothing else will do: a call that fails with an error that
/// passes (ENOMEM, EINTR, EAGAIN) is tried again a few times, one that says the process is not
/// registered (EINVAL: not expected once registered, but cheap to answer) registers again, and
/// if none of that helps the claim is refused rather than made without the fence; for every
/// later claim too when the error is permanent.
#[cfg(all(target_os = "linux", not(miri)))]
fn expedited_membarrier() -> Result<(), Unreachable> {
    use rustix::io::Errno;
    use rustix::thread::{membarrier, MembarrierCommand};
    let mut last = Errno::AGAIN;
    for _ in 0..MEMBARRIER_TRIES {
        let error = match membarrier(MembarrierCommand::PrivateExpedited) {
            Ok(()) => return Ok(()),
            Err(Errno::INVAL) => match membarrier(MembarrierCommand::RegisterPrivateExpedited) {
                Ok(()) => continue,
                Err(error) => error,
            },
            Err(error) => error,
        };
        last = error;
        if membarrier_failure_is_permanent(error) {
            if !MEMBARRIER_FAILED.swap(true, Relaxed) {
                tracing::error!(%error, "membarrier(PRIVATE_EXPEDITED) fails: cached blocks in threads' lanes are out of reach");
            }
            return Err(Unreachable::Membarrier);
        }
        std::thread::yield_now();
    }
    // Once at warning level: sweeps may run every millisecond while the failures last.
    if MEMBARRIER_BUSY_LOGGED.swap(true, Relaxed) {
        tracing::debug!(error = %last, tries = MEMBARRIER_TRIES, "membarrier(PRIVATE_EXPEDITED) failed: this claim of lanes is refused");
    } else {
        tracing::warn!(error = %last, tries = MEMBARRIER_TRIES, "membarrier(PRIVATE_EXPEDITED) failed: this claim of lanes is refused (logged once)");
    }
    Err(Unreachable::MembarrierBusy)
}

/// Whether a `membarrier` failure will not pass: forbidden (EPERM: a seccomp filter), missing
/// (ENOSYS), or a command the kernel refuses even after registering again (EINVAL).
#[cfg(all(target_os = "linux", not(miri)))]
fn membarrier_failure_is_permanent(error: rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    matches!(error, Errno::PERM | Errno::NOSYS | Errno::INVAL)
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn expedited_membarrier() -> Result<(), Unreachable> {
    // Never chosen here: `register_membarrier` answers false.
    fence(SeqCst);
    Ok(())
}

/// Lane numbers of exited threads, for the next threads to take (with what they left).
static FREE_LANES: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static NEXT_LANE: AtomicUsize = AtomicUsize::new(0);
/// How many numbers below [`LANES`] `FREE_LANES` holds: a thread with a higher number trades it
/// for one of them (read without the lock on such a thread's every call).
static LOW_FREE: AtomicUsize = AtomicUsize::new(0);

/// Gives a number back to `FREE_LANES`.
fn give_back_number(free: &mut Vec<usize>, number: usize) {
    free.push(number);
    if number < LANES {
        LOW_FREE.fetch_add(1, Relaxed);
    }
}

/// Takes the lowest free number, if any.
fn take_lowest(free: &mut Vec<usize>) -> Option<usize> {
    let (at, _) = free.iter().enumerate().min_by_key(|&(_, &number)| number)?;
    let number = free.swap_remove(at);
    if number < LANES {
        LOW_FREE.fetch_sub(1, Relaxed);
    }
    Some(number)
}

/// `LANE_NUMBER` before the thread's first use of a cache.
const UNASSIGNED: usize = usize::MAX;
/// `LANE_NUMBER` once the thread has given its number back (its thread-locals are being
/// destroyed): no lane any more, the shared lists serve it.
const GIVEN_BACK: usize = usize::MAX - 1;

thread_local! {
    /// The thread's lane number: read on every hot path, so a plain `Cell` with a constant
    /// initial value (no lazy state, nothing to destroy), readable even while the thread's
    /// other locals are destroyed. Unique among live threads: lane `n` of every stream has one
    /// owner at a time.
    static LANE_NUMBER: Cell<usize> = const { Cell::new(UNASSIGNED) };
    /// Gives the number back when the thread exits; made with the number.
    static LANE_RETURN: LaneReturn = const { LaneReturn };
}

struct LaneReturn;

impl Drop for LaneReturn {
    fn drop(&mut self) {
        let number = LANE_NUMBER.with(|cell| cell.replace(GIVEN_BACK));
        if number < GIVEN_BACK {
            give_back_number(&mut super::lock(&FREE_LANES), number);
        }
    }
}

/// The calling thread's lane number, taking one on first use.
#[inline(always)]
fn lane_number() -> usize {
    let number = LANE_NUMBER.with(Cell::get);
    if number >= LANES {
        return lane_number_beyond(number);
    }
    number
}

/// A thread without a lane: takes its first number, or trades a number beyond [`LANES`] for a
/// lower one that an exited thread gave back (found by review: a thread that started while 64
/// others held numbers kept number 64, and no lane, for life). The thread is in no lane here.
#[cold]
fn lane_number_beyond(number: usize) -> usize {
    match number {
        UNASSIGNED => take_lane_number(),
        GIVEN_BACK => GIVEN_BACK,
        _ if LOW_FREE.load(Relaxed) == 0 => number,
        _ => {
            let mut free = super::lock(&FREE_LANES);
            match take_lowest(&mut free) {
                Some(low) if low < number => {
                    give_back_number(&mut free, number);
                    LANE_NUMBER.with(|cell| cell.set(low));
                    low
                }
                Some(other) => {
                    give_back_number(&mut free, other);
                    number
                }
                None => number,
            }
        }
    }
}

/// Takes the lowest free number, so that numbers stay below [`LANES`] while few threads live,
/// and arranges for it to be given back. A thread whose locals are being destroyed gets none.
#[cold]
fn take_lane_number() -> usize {
    // Registering the destructor first: if that is refused (the thread is exiting), no number
    // is taken, so none can leak.
    if LANE_RETURN.try_with(|_| ()).is_err() {
        LANE_NUMBER.with(|cell| cell.set(GIVEN_BACK));
        return GIVEN_BACK;
    }
    let number = take_lowest(&mut super::lock(&FREE_LANES))
        .unwrap_or_else(|| NEXT_LANE.fetch_add(1, Relaxed).min(GIVEN_BACK - 1));
    LANE_NUMBER.with(|cell| cell.set(number));
    number
}

/// Held by unit tests that need a lane number below [`LANES`] or that take more than [`LANES`]
/// numbers at once: lane numbers are process-wide, shared by the test threads.
#[cfg(test)]
pub(super) static TEST_LANE_NUMBERS: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes() -> Vec<Lane> {
        (0..LANES).map(|_| Lane::new()).collect()
    }

    #[test]
    fn a_thread_inside_its_lane_cannot_enter_it_again() {
        let _numbers = super::super::lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let inside = own_lane(&lanes, prepare_fences());
        assert!(inside.is_some());
        assert!(own_lane(&lanes, prepare_fences()).is_none(), "a re-entrant call would alias the lane's state");
        drop(inside);
        assert!(own_lane(&lanes, prepare_fences()).is_some());
    }

    #[test]
    fn a_claimed_lane_turns_its_owner_away_until_given_back() {
        let _numbers = super::super::lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let mut claimed = claim(vec![&lanes[..]], std::process::id()).expect("claimed");
        assert!(own_lane(&lanes, prepare_fences()).is_none());
        claimed.group(0).for_each(|lane| lane.budget += 1);
        drop(claimed);
        let lane = own_lane(&lanes, prepare_fences()).expect("given back");
        assert_eq!(lane.budget, 1, "the owner sees what the claim wrote");
    }

    #[test]
    fn no_two_living_threads_own_one_lane_and_threads_beyond_the_lanes_own_none() {
        let _numbers = super::super::lock(&TEST_LANE_NUMBERS);
        let lanes = lanes();
        let threads = LANES + 6;
        let barrier = std::sync::Barrier::new(threads);
        let owned: Vec<Option<usize>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (lanes, barrier) = (&lanes, &barrier);
                    scope.spawn(move || {
                        let lane = own_lane(lanes, prepare_fences());
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
