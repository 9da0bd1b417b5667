//! A thread that exits leaves its lane's blocks to the next thread. Alone in its test binary:
//! a thread's lane number is process-wide, so other tests' threads would take it first.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, Statistics, StreamOrderedResource};

#[test]
fn a_thread_that_exits_leaves_its_blocks_to_the_next_thread_and_to_release() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.unwrap();
    let pair_of_blocks = || {
        let (a, b) = (cache.allocate(4096, 256, &stream).unwrap(), cache.allocate(4096, 256, &stream).unwrap());
        unsafe { cache.deallocate(a, 4096, 256, &stream) }.unwrap();
        unsafe { cache.deallocate(b, 4096, 256, &stream) }.unwrap();
        (a, b)
    };
    // The first free takes the stream's slot (its shared lists), the second lands in the lane.
    let (a, b) = std::thread::scope(|scope| scope.spawn(pair_of_blocks).join().unwrap());
    let stats = cache.stats();
    assert_eq!((stats.cached_blocks, stats.hits, stats.misses), (2, 0, 2), "{stats:?}");
    // The next thread takes the exited thread's lane number, and with it the lane's block.
    let (c, d) = std::thread::scope(|scope| scope.spawn(pair_of_blocks).join().unwrap());
    assert_eq!(cache.stats().hits, 2, "both blocks were found: the lane's and the shared one");
    let (mut before, mut after) = ([a, b], [c, d]);
    before.sort_unstable();
    after.sort_unstable();
    assert_eq!(before, after);
    assert_eq!(below.usage().current_bytes, 8192);
    drop(cache);
    assert_eq!(below.usage().current_bytes, 0, "nothing leaks");
}
