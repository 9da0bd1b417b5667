//! Its own process: its thread needs a lane, which other tests' threads could all hold.
//!
//! Found by review of the lanes: the module documentation promises that "before any of
//! it [reclaim, eviction], every slot's and lane's unfilled budget is taken back (that gives up
//! no block)". With the 1 ms rate limit on lane sweeps, `make_room` evicts another stream's
//! cached blocks while a lane sits on enough unfilled budget for the block.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, Statistics, StreamOrderedResource};
use support::fake_stream;

#[test]
fn a_block_is_not_evicted_while_a_lane_holds_unfilled_budget_for_it() {
    let block = 64 << 10; // the budget chunk for this bound
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::with_max_cached(&below, 4 * block);
    let (a, b, c) = (fake_stream(1), fake_stream(2), fake_stream(3));
    let alloc = |s: &Stream| cache.allocate(block, 256, s).unwrap();
    // SAFETY: every caller passes a block `alloc` took from this cache with these arguments, freed once.
    let free = |p, s: &Stream| unsafe { cache.deallocate(p, block, 256, s) }.unwrap();
    // A: a1 takes the slot, a2 the shared lists (and makes the lanes), a3 this thread's lane.
    let (a1, a2, a3) = (alloc(&a), alloc(&a), alloc(&a));
    free(a1, &a);
    free(a2, &a);
    free(a3, &a);
    // B: one block; the bound is now spent (4 blocks).
    let b1 = alloc(&b);
    free(b1, &b);
    // A lane hit: a3 is out again, its 64 KiB of budget stays in this thread's lane.
    let a3 = alloc(&a);
    // C's first free needs room: the first sweep ever takes the lane's budget back. Fine.
    let (c1, c2) = (alloc(&c), alloc(&c));
    free(c1, &c);
    // A shared hit: its budget goes to this thread's lane (credit_budget).
    let a2 = alloc(&a);
    // Within 1 ms of the sweep above, C's second free needs room again. 64 KiB of unfilled
    // budget sits in this thread's lane of A, yet B's block is evicted.
    let before = below.usage().current_bytes;
    free(c2, &c);
    let stats = cache.stats();
    let evicted = before.saturating_sub(below.usage().current_bytes);
    free(a2, &a);
    free(a3, &a);
    assert_eq!(
        (evicted, stats.cached_blocks),
        (0, 4),
        "a cached block was evicted while a lane held unfilled budget: {stats:?}"
    );
}
