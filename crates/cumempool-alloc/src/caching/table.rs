//! A cache's table of slots: where each stream's slot is found, and how slots are taken away
//! with their lanes.

use super::bound::Bound;
use super::fence::{prepare_fences, Fences};
use super::lanes::{
    claim, enter_remembered, enter_remembered_to_free, own_lane, CacheId, ClaimedLanes, Entry, FreeGate, Lane,
    ReadyLane, StreamLanes, Unreachable,
};
use super::lock::lock;
use super::padded::Padded;
use super::size_class::CLASSES;
use super::slot::{home_of, lanes_of, Slot, SlotState, Taken, EMPTY, RELEASED, SLOTS};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Mutex, MutexGuard};

/// How far along its probe path the hot path looks for a stream's slot.
const NEAR: usize = 8;

/// The slots of a cache, with what finds and changes them.
pub(super) struct SlotTable {
    /// A fixed-size array, so that indexing it with a probe index needs no bounds check.
    pub(super) slots: Box<[Slot; SLOTS]>,
    /// Held to change slot keys (register, reclaim, evict, release); never on the hot path.
    registry: Padded<Mutex<()>>,
    /// A coarse clock for least-recently-used eviction: advanced on slow paths only, read by
    /// the hot path.
    clock: Padded<AtomicU64>,
    /// How lanes fence (the process's decision, made by the constructor before any thread can
    /// enter a lane of this cache); for `Debug`.
    pub(super) fences: Fences,
    /// The process that made the cache: a forked child cannot claim lanes.
    pub(super) made_in: u32,
    /// Which cache a thread's remembered lane belongs to.
    pub(super) id: CacheId,
}

impl SlotTable {
    pub(super) fn new() -> Self {
        let fences = prepare_fences();
        let slots = Box::new(std::array::from_fn(|_| Slot {
            key: AtomicU64::new(EMPTY),
            last_used: AtomicU64::new(0),
            lanes: StreamLanes::new(),
            state: Mutex::new(SlotState::default()),
        }));
        Self {
            slots,
            registry: Padded(Mutex::new(())),
            clock: Padded(AtomicU64::new(0)),
            fences,
            made_in: std::process::id(),
            id: CacheId::new(),
        }
    }

    /// The registry lock, under which slot keys change.
    pub(super) fn registry(&self) -> MutexGuard<'_, ()> {
        lock(&self.registry)
    }

    /// Advances the LRU clock; answers the new time.
    pub(super) fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Relaxed) + 1
    }

    /// The index of the slot of the stream with `key`, if it has one.
    #[inline]
    pub(super) fn find(&self, key: u64) -> Option<usize> {
        let home = home_of(key);
        // Most streams sit in their home slot: that case first, without the loop.
        if self.slots[home].key.load(Acquire) == key {
            return Some(home);
        }
        self.probe(home, key, SLOTS)
    }

    /// `find` past the home slot, over at most `length` slots of the probe path. Out of line for
    /// `find`, whose callers inline it; in line in the out-of-line paths of the hot path.
    #[inline(never)]
    fn probe(&self, home: usize, key: u64, length: usize) -> Option<usize> {
        self.probe_in_line(home, key, length)
    }

    /// [`probe`](Self::probe), in line.
    #[inline(always)]
    fn probe_in_line(&self, home: usize, key: u64, length: usize) -> Option<usize> {
        for i in 0..length {
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
    pub(super) fn free_slot(&self, key: u64) -> Option<usize> {
        let home = home_of(key);
        (0..SLOTS)
            .map(|i| (home + i) % SLOTS)
            .find(|&index| matches!(self.slots[index].key.load(Acquire), EMPTY | RELEASED))
    }

    /// When the slot's stream was last used, on the LRU clock: the latest of the slot's mark
    /// and its lanes' (a hit in a lane marks only the lane).
    pub(super) fn last_used(&self, slot: &Slot) -> u64 {
        lanes_of(slot).iter().map(Lane::last_used).fold(slot.last_used.load(Relaxed), u64::max)
    }

    /// Marks the slot used now for LRU eviction; writes only when the clock has moved, so
    /// threads sharing a stream do not bounce its cache line.
    #[inline(always)]
    pub(super) fn touch(&self, slot: &Slot) {
        let now = self.clock.load(Relaxed);
        if slot.last_used.load(Relaxed) != now {
            slot.last_used.store(now, Relaxed);
        }
    }

    /// Empties the slots of `indices` (ascending) that have a stream and `which` picks: their
    /// bytes return to the bound, their keys are released. One fence claims all their lanes; if
    /// the lanes cannot be claimed, only picked slots without lanes are emptied, and the reason
    /// comes back beside what was taken. Only under the registry lock.
    pub(super) fn take_slots(
        &self,
        indices: impl Iterator<Item = usize>,
        which: impl Fn(&SlotState) -> bool,
        bound: &Bound,
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
                    // lock (shared lists, budget) goes all the same.
                    for (_, state) in picked.iter_mut().filter(|(slot, _)| !lanes_of(slot).is_empty()) {
                        let Some(stream) = state.stream.clone() else { continue };
                        let blocks = std::mem::replace(&mut state.blocks, vec![Vec::new(); CLASSES]);
                        let bytes = std::mem::take(&mut state.budget) + std::mem::take(&mut state.cached_bytes);
                        bound.give(bytes);
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
                bound.give(bytes);
                taken.push(contents);
            }
        }
        (taken, unreachable)
    }

    /// The slots that have a stream. Keys change only under the registry lock, so under it this
    /// is exact: a slot without a stream holds no block and no budget.
    pub(super) fn slots_with_streams(&self) -> impl Iterator<Item = usize> + '_ {
        (0..SLOTS).filter(|&index| !matches!(self.slots[index].key.load(Acquire), EMPTY | RELEASED))
    }

    /// Locks the slots of `indices` (ascending: the one order any path takes several in) and,
    /// if `with_lanes`, claims all their lanes with one fence (`None` when that was not asked
    /// for or cannot be had).
    pub(super) fn lock_with_lanes(
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

    /// A hit in the calling thread's lane of the stream with `key`: the hot path's lookup, the
    /// lane the thread remembers (see [`enter_remembered`]); any other lane of the stream pays
    /// one call more, not the slow paths.
    #[inline(always)]
    pub(super) fn pop_from_own_lane(&self, key: u64, index: usize) -> Option<CUdeviceptr> {
        match enter_remembered(&self.id, key) {
            Ok(lane) => self.pop_inside(lane, index),
            Err(Entry::Elsewhere) => self.pop_out_of_line(key, index),
            Err(Entry::Refused) => None,
        }
    }

    /// Caches a block in the calling thread's remembered lane, if that is the lane of the stream
    /// with `key`, `gate` (this table's cache's) is open, and the lane has room and budget: the
    /// hot path's lookup, as in [`pop_from_own_lane`](Self::pop_from_own_lane). `None` when the
    /// lane must be looked up (see [`push_out_of_line`](Self::push_out_of_line)): the thread
    /// remembers another lane, or the gate is closed.
    #[inline(always)]
    pub(super) fn push_to_remembered_lane(
        &self,
        gate: &FreeGate,
        key: u64,
        ptr: CUdeviceptr,
        index: usize,
        class: usize,
        bound: &Bound,
    ) -> Option<bool> {
        match enter_remembered_to_free(&self.id, gate, key) {
            Ok(lane) => Some(push_inside(lane, ptr, index, class, bound)),
            Err(Entry::Elsewhere) => None,
            Err(Entry::Refused) => Some(false),
        }
    }

    /// `pop_from_own_lane` for a lane the thread does not remember: along the stream's probe
    /// path, within [`NEAR`] slots of its home only, so that a stream without a slot, which the
    /// slow paths look up again, does not scan the whole table twice per call once released
    /// slots have filled it.
    #[inline(never)]
    fn pop_out_of_line(&self, key: u64, index: usize) -> Option<CUdeviceptr> {
        // A key marked for a possible capture matches no slot: no need to probe.
        if key & Stream::CAPTURE_MARK != 0 {
            return None;
        }
        let slot = &self.slots[self.probe_in_line(home_of(key), key, NEAR)?];
        self.pop_from_lane(slot, key, index)
    }

    /// `push_to_remembered_lane` after a lookup, as [`pop_out_of_line`](Self::pop_out_of_line).
    /// In line: its caller is out of line.
    #[inline(always)]
    pub(super) fn push_out_of_line(
        &self,
        key: u64,
        ptr: CUdeviceptr,
        index: usize,
        class: usize,
        bound: &Bound,
    ) -> bool {
        self.probe_in_line(home_of(key), key, NEAR)
            .is_some_and(|at| self.push_to_lane(&self.slots[at], key, ptr, index, class, bound))
    }

    /// A hit in the calling thread's lane of `slot`, the slot of the stream with `key`.
    #[inline(always)]
    pub(super) fn pop_from_lane(&self, slot: &Slot, key: u64, index: usize) -> Option<CUdeviceptr> {
        self.pop_inside(self.enter_lane(slot, key)?, index)
    }

    /// Caches a block in the calling thread's lane of `slot`, the slot of the stream with `key`,
    /// if it has room and budget.
    #[inline(always)]
    pub(super) fn push_to_lane(
        &self,
        slot: &Slot,
        key: u64,
        ptr: CUdeviceptr,
        index: usize,
        class: usize,
        bound: &Bound,
    ) -> bool {
        self.enter_lane(slot, key).is_some_and(|lane| push_inside(lane, ptr, index, class, bound))
    }

    /// The calling thread in its own lane of `slot`, if that is the slot of the stream with
    /// `key` and the lane has its lists; the thread remembers the lane, ready for that stream,
    /// from then on.
    #[inline(always)]
    fn enter_lane<'a>(&'a self, slot: &'a Slot, key: u64) -> Option<ReadyLane<'a>> {
        let lanes = &slot.lanes.get()?[..];
        let lane = own_lane(lanes)?;
        // Inside the lane: a slot given up changes its key while it holds the lanes' claims,
        // before it empties them, so a thread that sees its stream's key here entered before the
        // claim (and the lane still holds only that stream's blocks) or after a claim of the
        // same stream: a block found here was freed on this stream, and one cached here is kept
        // for it.
        if slot.key.load(Relaxed) != key {
            return None;
        }
        // SAFETY: `lanes` are this table's slot's, whose key was read inside the lane as `key`,
        // and live as long as the table, which owns `self.id`.
        unsafe { lane.ready_for(&self.id, key, lanes) }
    }

    /// A block of size class `index` from `lane`, the calling thread's lane of a stream.
    #[inline(always)]
    fn pop_inside(&self, mut lane: ReadyLane<'_>, index: usize) -> Option<CUdeviceptr> {
        let ptr = lane.pop(index)?;
        lane.hits += 1;
        lane.mark_used(self.clock.load(Relaxed));
        Some(ptr)
    }
}

/// Caches a block of size class `index` in `lane` if it has room, and budget (claimed from
/// `bound` when short). Not touched: the allocation this block served was.
#[inline(always)]
fn push_inside(mut lane: ReadyLane<'_>, ptr: CUdeviceptr, index: usize, class: usize, bound: &Bound) -> bool {
    lane.push(index, ptr, class, bound)
}
