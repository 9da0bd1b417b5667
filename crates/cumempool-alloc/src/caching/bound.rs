//! The bound on cached bytes. It counts cached bytes exactly and is handed out in chunks: a slot
//! or lane claims budget from it, and a block it caches fills that budget, so the hot path never
//! writes the shared counter.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Bytes a cache may hold, less what slots and lanes have claimed.
pub(super) struct Bound {
    /// Bytes of the bound no slot or lane has claimed.
    unclaimed: AtomicUsize,
    max: usize,
    chunk: usize,
}

impl Bound {
    /// A bound of `max` bytes, none claimed.
    pub(super) fn new(max: usize, slots: usize) -> Self {
        // Small enough that every slot can hold some budget at once; large enough that a
        // stream's steady allocate/free pairs never touch the shared counter.
        let chunk = (max / (4 * slots)).max(64 << 10).min(max);
        Self { unclaimed: AtomicUsize::new(max), max, chunk }
    }

    /// The bound.
    pub(super) fn max(&self) -> usize {
        self.max
    }

    /// Bytes no slot or lane has claimed.
    pub(super) fn unclaimed(&self) -> usize {
        self.unclaimed.load(Relaxed)
    }

    /// Takes `bytes` no slot has claimed; false when there are not that many.
    pub(super) fn take(&self, bytes: usize) -> bool {
        self.unclaimed.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(bytes)).is_ok()
    }

    /// Gives back `bytes` of budget or of blocks given up.
    pub(super) fn give(&self, bytes: usize) {
        self.unclaimed.fetch_add(bytes, Relaxed);
    }

    /// Takes `bytes` of `budget` (a slot's or lane's), claiming a chunk of the bound when it is
    /// short; false when the bound is reached.
    #[inline(always)]
    pub(super) fn claim(&self, budget: &mut usize, bytes: usize) -> bool {
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
        if self.take(chunk) {
            *budget += chunk;
        } else if self.take(need) {
            *budget += need;
        } else {
            return false;
        }
        true
    }

    /// At least the bytes of every block the cache holds: the bound less what no slot or lane
    /// has claimed (claimed budget counts too, so this may be more).
    pub(super) fn held_at_most(&self) -> usize {
        self.max.saturating_sub(self.unclaimed())
    }
}
