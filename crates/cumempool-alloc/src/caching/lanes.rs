//! A stream's lanes: a few free blocks per size class for each thread using the stream, behind
//! a lock that only that thread takes on the hot path.
//!
//! Threads sharing one stream would otherwise serialise on the stream's one lock. Each thread
//! gets a lane number for its life (reused by a later thread once it exits, so that thread takes
//! over the blocks it left); thread `t` uses lane `t % LANES` of every stream. The cache's slow
//! paths (release, reclaim, eviction, the no-memory retry, drop) lock every lane and take what
//! it holds, so no block is out of their reach.

use cumempool::sys::CUdeviceptr;
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{
    AtomicBool, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::Mutex;

/// Lanes per stream: up to this many threads share a stream without sharing a lock.
pub(super) const LANES: usize = 64;
/// Blocks a lane holds per size class; further frees go to the stream's shared lists.
const DEPTH: usize = 8;

/// One thread's free blocks on one stream. The lock is a flag rather than a `Mutex`: its
/// unlock is a plain release store, where a `Mutex` unlock is a read-modify-write, and the hot
/// path takes it twice per pair.
#[repr(align(128))]
pub(super) struct Lane {
    locked: AtomicBool,
    state: UnsafeCell<LaneState>,
}

// SAFETY: `state` is only reached through a `LaneGuard`, which holds `locked`: one thread at a
// time, with acquire/release ordering between holders. `LaneState` itself is `Send`.
unsafe impl Sync for Lane {}

#[derive(Default)]
pub(super) struct LaneState {
    /// `DEPTH` entries per size class; empty until the lane first caches a block.
    blocks: Vec<CUdeviceptr>,
    /// Blocks held per size class; empty with `blocks`.
    counts: Vec<u8>,
    /// Bytes in `blocks`.
    pub cached_bytes: usize,
    /// Budget this lane has claimed from the bound and not yet filled with blocks.
    pub budget: usize,
    pub hits: u64,
}

impl Lane {
    pub(super) fn new() -> Self {
        Self { locked: AtomicBool::new(false), state: UnsafeCell::new(LaneState::default()) }
    }

    /// Locks the lane: at once on the hot path (only its thread takes it there); a slow path
    /// holding it keeps it for a few instructions, so waiting spins, then yields.
    #[inline]
    pub(super) fn lock(&self) -> LaneGuard<'_> {
        if self.locked.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            self.lock_contended();
        }
        LaneGuard { lane: self }
    }

    #[cold]
    /// Locks the lane if no one holds it: for slow paths that may pass a busy lane by.
    #[inline]
    pub(super) fn try_lock(&self) -> Option<LaneGuard<'_>> {
        self.locked.compare_exchange(false, true, Acquire, Relaxed).is_ok().then_some(LaneGuard { lane: self })
    }

    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            if !self.locked.load(Relaxed) && self.locked.compare_exchange(false, true, Acquire, Relaxed).is_ok() {
                return;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

pub(super) struct LaneGuard<'a> {
    lane: &'a Lane,
}

impl Deref for LaneGuard<'_> {
    type Target = LaneState;
    fn deref(&self) -> &LaneState {
        // SAFETY: the guard holds the lane's lock.
        unsafe { &*self.lane.state.get() }
    }
}

impl DerefMut for LaneGuard<'_> {
    fn deref_mut(&mut self) -> &mut LaneState {
        // SAFETY: the guard holds the lane's lock.
        unsafe { &mut *self.lane.state.get() }
    }
}

impl Drop for LaneGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.lane.locked.store(false, Release);
    }
}

impl LaneState {
    /// A block of size class `index`, if the lane holds one.
    #[inline]
    pub(super) fn pop(&mut self, index: usize) -> Option<CUdeviceptr> {
        let count = self.counts.get_mut(index)?;
        *count = count.checked_sub(1)?;
        self.blocks.get(index * DEPTH + usize::from(*count)).copied()
    }

    /// Whether a block of size class `index` fits.
    #[inline]
    pub(super) fn has_room(&self, index: usize) -> bool {
        self.counts.get(index).is_none_or(|&count| usize::from(count) < DEPTH)
    }

    /// Keeps a block of size class `index` (`classes` in all); the first one allocates the
    /// lane's lists, once. The caller checked `has_room`.
    #[inline]
    pub(super) fn push(&mut self, index: usize, ptr: CUdeviceptr, classes: usize) {
        if self.counts.is_empty() {
            self.counts = vec![0; classes];
            self.blocks = vec![0; classes * DEPTH];
        }
        if let Some(count) = self.counts.get_mut(index) {
            if let Some(entry) = self.blocks.get_mut(index * DEPTH + usize::from(*count)) {
                *entry = ptr;
                *count += 1;
            }
        }
    }

    /// Moves every block into `lists` (by size class) and empties the lane; answers the bytes
    /// it held, blocks and budget, for the bound.
    pub(super) fn drain_into(&mut self, lists: &mut [Vec<CUdeviceptr>]) -> usize {
        for (index, count) in self.counts.iter_mut().enumerate() {
            let held = self.blocks.get(index * DEPTH..index * DEPTH + usize::from(*count)).unwrap_or_default();
            if let Some(list) = lists.get_mut(index) {
                list.extend_from_slice(held);
            }
            *count = 0;
        }
        // A slow path: give the lists' host memory back too (64 lanes of 256 streams would
        // otherwise keep about 140 MiB); the lane's next free makes them again.
        self.blocks = Vec::new();
        self.counts = Vec::new();
        std::mem::take(&mut self.cached_bytes) + std::mem::take(&mut self.budget)
    }

    /// Blocks held.
    pub(super) fn blocks(&self) -> usize {
        self.counts.iter().map(|&count| usize::from(count)).sum()
    }
}

/// Lane numbers of exited threads, for the next threads to take (with what they left).
static FREE_LANES: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static NEXT_LANE: AtomicUsize = AtomicUsize::new(0);

/// A thread's lane number, given back when the thread exits.
struct LaneNumber(usize);

impl Drop for LaneNumber {
    fn drop(&mut self) {
        super::lock(&FREE_LANES).push(self.0);
    }
}

thread_local! {
    static LANE: LaneNumber = LaneNumber(super::lock(&FREE_LANES).pop().unwrap_or_else(|| NEXT_LANE.fetch_add(1, Relaxed)));
}

/// The calling thread's lane (lane 0 while the thread's locals are being destroyed).
#[inline]
pub(super) fn this_threads_lane() -> usize {
    LANE.try_with(|lane| lane.0 % LANES).unwrap_or(0)
}
