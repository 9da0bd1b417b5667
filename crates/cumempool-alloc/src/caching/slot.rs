//! A stream's slot: its key, its lanes, and the shared lists under the slot's lock that hold
//! what the lanes do not (overflow, blocks of threads without a lane, and the budget a slot
//! claimed from the bound).

use super::lanes::{claim, own_lane, Lane, LaneState, StreamLanes};
use super::size_class::{class_bytes, CLASSES};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Streams a cache serves at once; allocations on further streams go straight to the resource below.
pub(super) const SLOTS: usize = 256;
/// A slot never used: lookups stop here. Stream ids start at 1.
pub(super) const EMPTY: u64 = 0;
/// A slot whose stream was released: lookups probe past it, registrations may take it.
pub(super) const RELEASED: u64 = u64::MAX;

/// One stream's place in a cache, on cache lines of its own.
#[repr(align(128))]
pub(super) struct Slot {
    /// `EMPTY`, `RELEASED`, or the [`Stream::id`] of its stream. Written only under the
    /// registry lock and the slot's own lock; read without either on the hot path.
    pub(super) key: AtomicU64,
    /// The LRU clock when the slot was last used on a slow path (a hit in a lane marks the
    /// lane: see [`SlotTable::last_used`](super::table::SlotTable::last_used)); written only
    /// when the clock has moved.
    pub(super) last_used: AtomicU64,
    /// A lane per thread, made by the stream's second cached free and kept for the cache's life;
    /// what they hold belongs to the slot's stream like `state`'s blocks.
    pub(super) lanes: StreamLanes,
    pub(super) state: Mutex<SlotState>,
}

/// What a slot's lock guards.
#[derive(Default)]
pub(super) struct SlotState {
    /// The stream, kept alive while blocks are cached for it; `Some` exactly while the slot
    /// has a key.
    pub(super) stream: Option<Stream>,
    /// Free blocks by size class, all freed on `stream`.
    pub(super) blocks: Vec<Vec<CUdeviceptr>>,
    pub(super) cached_bytes: usize,
    /// Budget this slot has claimed from the global bound and not yet filled with blocks.
    pub(super) budget: usize,
    pub(super) hits: u64,
    pub(super) misses: u64,
    /// Nanoseconds after the cache was made before which a miss does not gather this stream's
    /// lanes again ([`LANE_SWEEP_INTERVAL`](super::timers::LANE_SWEEP_INTERVAL) after the last gather).
    pub(super) next_gather: u64,
}

impl SlotState {
    /// Whether the blocks may go below now. Not while they would be freed on the legacy stream
    /// and the driver would refuse that for a blocking stream's capture, invalidating it
    /// ([`Stream::is_blocked_by_a_capture`]): the cache gives them back of its own accord
    /// (releasing, making room), at no time its user chose, so they stay cached until then.
    pub(super) fn may_give_back(&self) -> bool {
        self.stream.as_ref().is_none_or(|stream| !stream.is_blocked_by_a_capture())
    }

    /// Takes the stream and every block the slot and `lanes` (its lanes' states) hold, if it has
    /// a stream; answers them with the bytes they accounted for in the bound (blocks and budget).
    pub(super) fn take_all<'a>(&mut self, lanes: impl Iterator<Item = &'a mut LaneState>) -> Option<(Taken, usize)> {
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
pub(super) struct Taken {
    pub(super) stream: Stream,
    pub(super) blocks: Vec<Vec<CUdeviceptr>>,
}

#[inline(always)]
pub(super) fn home_of(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % SLOTS
}

/// Moves every block a stream's lanes hold into the slot's shared lists, with their bytes; the
/// lanes keep their budget. Nothing moves if the lanes cannot be claimed.
pub(super) fn gather_from_lanes(lanes: &[Lane], made_in: u32, state: &mut SlotState) {
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
pub(super) fn credit_budget(lanes: &[Lane], state: &mut SlotState, class: usize) {
    match own_lane(lanes) {
        Some(mut lane) => lane.budget += class,
        None => state.budget += class,
    }
}

/// A block of size class `index` from a slot's shared lists, its budget given to the calling
/// thread's lane (see [`credit_budget`]).
pub(super) fn pop_shared(lanes: &[Lane], state: &mut SlotState, index: usize, class: usize) -> Option<CUdeviceptr> {
    let ptr = state.blocks.get_mut(index).and_then(Vec::pop)?;
    state.cached_bytes -= class;
    state.hits += 1;
    credit_budget(lanes, state, class);
    Some(ptr)
}

/// The lanes of a slot, or none if it never had any.
pub(super) fn lanes_of(slot: &Slot) -> &[Lane] {
    slot.lanes.get().map_or(&[], |lanes| &lanes[..])
}
