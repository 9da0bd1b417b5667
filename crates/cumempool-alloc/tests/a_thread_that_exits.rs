//! Its own process: the next thread must take the lane number the exited one gave back.
//!
//! A thread that exits leaves its lane's blocks to the next thread.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool_alloc::{CachingResource, HostHeap, Statistics};
use support::{fake_stream, fill_this_threads_lane};

#[test]
fn a_thread_that_exits_leaves_its_blocks_to_the_next_thread_and_to_release() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let stream = fake_stream(0);
    let three_blocks = || fill_this_threads_lane(&cache, &stream, 4096);
    // The first free takes the stream's slot, the second makes its lanes (both land in the
    // shared lists), the third lands in this thread's lane.
    let mut before = std::thread::scope(|scope| scope.spawn(three_blocks).join().unwrap());
    let stats = cache.stats();
    assert_eq!((stats.cached_blocks, stats.hits, stats.misses), (3, 0, 3), "{stats:?}");
    // The next thread takes the exited thread's lane number, and with it the lane's block: the
    // bound is far from spent, so nothing else would hand it that block.
    let mut after = std::thread::scope(|scope| scope.spawn(three_blocks).join().unwrap());
    assert_eq!(cache.stats().hits, 3, "all three were found: the lane's and the shared ones");
    before.sort_unstable();
    after.sort_unstable();
    assert_eq!(before, after);
    assert_eq!(below.usage().current_bytes, 3 * 4096);
    drop(cache);
    assert_eq!(below.usage().current_bytes, 0, "nothing leaks");
}
