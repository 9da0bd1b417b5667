//! Making room under the bound: unfilled budget back first (that gives up no block), then the
//! slots of streams only the cache still holds, then the least recently used other streams'
//! slots. On slow paths only, under the registry lock, which the hot path never takes.

use super::bound::Bound;
use super::lock::lock;
use super::slot::{SlotState, Taken};
use super::table::SlotTable;
use super::timers::Timers;

/// Takes the slots whose stream only the cache still holds (nobody can queue work on it
/// any more), except the slot `keep`. Only under the registry lock.
pub(super) fn reclaim_unused(table: &SlotTable, bound: &Bound, keep: Option<usize>, taken: &mut Vec<Taken>) {
    let unused =
        |state: &SlotState| state.stream.as_ref().is_some_and(|s| s.handle_count() == 1) && state.may_give_back();
    let candidates: Vec<usize> = table.slots_with_streams().filter(|&index| Some(index) != keep).collect();
    taken.extend(table.take_slots(candidates.into_iter(), unused, bound).0);
}

/// Makes `bytes` of the bound unclaimed and takes them: reclaims unused streams' slots,
/// then evicts the least recently used other streams' slots. Only under the registry lock.
pub(super) fn make_room(
    table: &SlotTable,
    bound: &Bound,
    timers: &Timers,
    bytes: usize,
    keep: Option<usize>,
    taken: &mut Vec<Taken>,
) -> bool {
    if bytes > bound.max() {
        return false;
    }
    if bound.take(bytes) {
        return true;
    }
    // Unfilled budget first: taking it back gives up no block. The lanes' only when a sweep
    // is due, at first.
    let swept = return_unfilled_budgets(table, bound, timers, false);
    if bound.take(bytes) {
        return true;
    }
    reclaim_unused(table, bound, keep, taken);
    if bound.take(bytes) {
        return true;
    }
    let mut swept = swept;
    while !bound.take(bytes) {
        let oldest = table
            .slots_with_streams()
            .filter(|&index| Some(index) != keep)
            .filter_map(|index| {
                let state = lock(&table.slots[index].state);
                (state.stream.is_some() && state.may_give_back()).then(|| (table.last_used(&table.slots[index]), index))
            })
            .min();
        // No victim, no sweep: a stream alone at the bound would otherwise pay a
        // `membarrier` on every free that does not fit.
        let Some((_, victim)) = oldest else { return false };
        // Before a block is given up, every lane's budget, whatever the sweep limit: no block
        // is evicted while a lane holds budget that could make room for it.
        if !swept {
            swept = true;
            return_unfilled_budgets(table, bound, timers, true);
            if bound.take(bytes) {
                return true;
            }
        }
        let (victims, unreachable) = table.take_slots(std::iter::once(victim), |_| true, bound);
        taken.extend(victims);
        if unreachable.is_some() {
            return false;
        }
    }
    true
}

/// Returns the budget every slot and lane has claimed and not filled to the bound, so
/// that a thread short of budget need not evict blocks while others hold unused budget.
/// The lanes' budget when `force`d or a lane sweep is due ([`LANE_SWEEP_INTERVAL`](super::timers::LANE_SWEEP_INTERVAL)), and
/// their lanes can be claimed; answers whether the lanes' budget was taken.
pub(super) fn return_unfilled_budgets(table: &SlotTable, bound: &Bound, timers: &Timers, force: bool) -> bool {
    let indices: Vec<usize> = table.slots_with_streams().collect();
    let (mut states, lanes) = table.lock_with_lanes(&indices, force || timers.lane_sweep_due());
    let Some(mut lanes) = lanes else {
        for state in &mut states {
            bound.give(std::mem::take(&mut state.budget));
        }
        return false;
    };
    for (group, state) in states.iter_mut().enumerate() {
        let mut bytes = std::mem::take(&mut state.budget);
        for lane in lanes.group(group) {
            bytes += lane.take_unfilled();
        }
        bound.give(bytes);
    }
    true
}
