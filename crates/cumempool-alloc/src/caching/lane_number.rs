//! Lane numbers: each thread gets one for its life, and lane `n` of every stream belongs to the
//! thread holding number `n`. A number is given back when its thread exits, and the next thread
//! to start takes it, with the blocks the lanes of that number hold. Numbers stay as low as the
//! threads alive at once allow, so that the first [`LANES`] threads have lanes.

use super::lock::lock;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Lanes per stream: up to this many threads share a stream without sharing a lock.
pub(super) const LANES: usize = 64;

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
    /// The thread's lane number where it enters its lanes on the hot path, [`NO_FAST_LANE`]
    /// otherwise (no number yet, none below [`LANES`], or the process fences symmetrically):
    /// one load and one comparison decide both whether the thread has a lane and how it
    /// fences. Set only to the thread's own `LANE_NUMBER`, cleared before that number is given
    /// back.
    static FAST_LANE: Cell<usize> = const { Cell::new(NO_FAST_LANE) };
    /// Gives the number back when the thread exits; made with the number.
    static LANE_RETURN: LaneReturn = const { LaneReturn };
    /// The thread's own lane of the stream it last entered a lane of, and which cache that lane
    /// belongs to: what the hot path looks up instead of hashing the stream's key, finding its
    /// slot, and reading `FAST_LANE`. Which stream the lane is for is not kept here: the lane's
    /// own key says that, and the hot path checks it inside the lane. Set only to the lane of number `FAST_LANE`
    /// (see [`remember_lane`]), and cleared before `FAST_LANE` changes, so a lane found here is
    /// the thread's own, entered with the light fence.
    static REMEMBERED: Remembered = const {
        Remembered { cache: Cell::new(NO_CACHE), lane: Cell::new(std::ptr::null()) }
    };
}

/// See `REMEMBERED`. The lane's type is not known here (lanes build on lane numbers), so its
/// address is kept untyped.
struct Remembered {
    /// The unique id of the cache the lane belongs to, or [`NO_CACHE`].
    cache: Cell<u64>,
    lane: Cell<*const ()>,
}

/// No cache has this id: `REMEMBERED` holds no lane.
pub(super) const NO_CACHE: u64 = 0;

/// The lane the calling thread remembers in the cache with id `cache` (see `REMEMBERED`), if
/// it remembers one there.
#[inline(always)]
pub(super) fn remembered_lane(cache: u64) -> Option<*const ()> {
    REMEMBERED.with(|remembered| (remembered.cache.get() == cache).then(|| remembered.lane.get()))
}

/// Remembers `lanes[FAST_LANE]`, the calling thread's own lane among `lanes`, in the cache with
/// id `cache`, if the thread enters its lanes on the hot path. Nothing is
/// remembered otherwise.
///
/// # Safety
/// `lanes` is the whole array of [`Lane`](super::lanes::Lane)s of a slot of the cache with id
/// `cache`, indexed by lane number (a part of it would remember another thread's lane, and two
/// threads would own it), and lives as long as that cache: whoever finds the lane here with
/// that cache's id dereferences it as a `Lane`.
pub(super) unsafe fn remember_lane<T>(cache: u64, lanes: &[T]) {
    let Some(lane) = lanes.get(fast_lane_number()) else { return };
    REMEMBERED.with(|remembered| {
        // The id last: were this interrupted (a signal handler that allocates), the entry in
        // between matches no cache.
        remembered.cache.set(NO_CACHE);
        remembered.lane.set(std::ptr::from_ref(lane).cast());
        remembered.cache.set(cache);
    });
}

/// Forgets the remembered lane: before `FAST_LANE` changes.
fn forget_lane() {
    REMEMBERED.with(|remembered| {
        remembered.cache.set(NO_CACHE);
        remembered.lane.set(std::ptr::null());
    });
}

struct LaneReturn;

/// `FAST_LANE` of a thread that takes the slow entry to its lanes.
const NO_FAST_LANE: usize = usize::MAX;

/// The calling thread's lane number if it enters its lanes with the owner's light fence (see
/// [`allow_fast_lane`]); [`LANES`] or more when it must take the slow entry.
#[inline(always)]
pub(super) fn fast_lane_number() -> usize {
    FAST_LANE.with(Cell::get)
}

/// Lets the calling thread enter its lanes on the hot path from now on, with `number` (its
/// current [`lane_number`], below [`LANES`]). Only once the process has chosen the asymmetric
/// fences, which it never changes: the hot path's entry uses the light half (under Miri, a full
/// fence: see `fast_lane_fence`).
pub(super) fn allow_fast_lane(number: usize) {
    if number < LANES && LANE_NUMBER.with(Cell::get) == number {
        if fast_lane_number() != number {
            forget_lane();
        }
        FAST_LANE.with(|cell| cell.set(number));
    }
}

impl Drop for LaneReturn {
    fn drop(&mut self) {
        // First: the number may go to another thread below, and this thread's destructors may
        // still use a cache; the remembered lane is that number's.
        forget_lane();
        FAST_LANE.with(|cell| cell.set(NO_FAST_LANE));
        let number = LANE_NUMBER.with(|cell| cell.replace(GIVEN_BACK));
        if number < GIVEN_BACK {
            give_back_number(&mut lock(&FREE_LANES), number);
        }
    }
}

/// The calling thread's lane number, taking one on first use; [`LANES`] or more for a thread
/// without a lane.
#[inline(always)]
pub(super) fn lane_number() -> usize {
    let number = LANE_NUMBER.with(Cell::get);
    if number >= LANES {
        return lane_number_beyond(number);
    }
    number
}

/// A thread without a lane: takes its first number, or trades a number beyond [`LANES`] for a
/// lower one that an exited thread gave back, so that a thread that started while 64 others
/// held numbers does not stay without a lane for life. The thread is in no lane here.
#[cold]
fn lane_number_beyond(number: usize) -> usize {
    match number {
        UNASSIGNED => take_lane_number(),
        GIVEN_BACK => GIVEN_BACK,
        _ if LOW_FREE.load(Relaxed) == 0 => number,
        _ => {
            let mut free = lock(&FREE_LANES);
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
    let number =
        take_lowest(&mut lock(&FREE_LANES)).unwrap_or_else(|| NEXT_LANE.fetch_add(1, Relaxed).min(GIVEN_BACK - 1));
    LANE_NUMBER.with(|cell| cell.set(number));
    number
}

/// Held by unit tests that need a lane number below [`LANES`] or that take more than [`LANES`]
/// numbers at once: lane numbers are process-wide, shared by the test threads.
#[cfg(test)]
pub(super) static TEST_LANE_NUMBERS: Mutex<()> = Mutex::new(());
