//! Its own process: its 64 threads must take lane numbers 0..64, which are process-wide.
//!
//! Found by review of the lanes: a thread that took its lane number while 64 other
//! threads held theirs keeps a number >= LANES for its whole life, so it never gets a lane,
//! even after every other thread has exited.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool_alloc::{CachingResource, HostHeap, StreamOrderedResource};
use std::sync::Barrier;
use support::fake_stream;

#[test]
fn a_thread_that_started_among_64_others_gets_a_lane_once_they_exit() {
    let cache = CachingResource::new(HostHeap);
    let stream = fake_stream(1);
    let (small, large) = (4096, 1 << 20);
    // Two cached frees: the stream's slot, then its lanes (both into the shared lists). This
    // thread has not entered a lane yet, so it holds no lane number.
    let warm = [(); 2].map(|()| cache.allocate(small, 256, &stream).unwrap());
    for ptr in warm {
        // SAFETY: each block was allocated above with these arguments and is freed once.
        unsafe { cache.deallocate(ptr, small, 256, &stream) }.unwrap();
    }
    let (holding, late_has_number, pool_exited, late_freed, checked) =
        (Barrier::new(65), Barrier::new(65), Barrier::new(2), Barrier::new(2), Barrier::new(2));
    let (mut late_block, mut found) = (0, 0);
    std::thread::scope(|scope| {
        // A pool of 64 long-lived workers, each with a lane number (0..64).
        let pool: Vec<_> = (0..64)
            .map(|_| {
                let (cache, stream, holding, late_has_number) = (&cache, &stream, &holding, &late_has_number);
                scope.spawn(move || {
                    let ptr = cache.allocate(small, 256, stream).unwrap();
                    // SAFETY: allocated just above with these arguments, freed once.
                    unsafe { cache.deallocate(ptr, small, 256, stream) }.unwrap();
                    holding.wait();
                    late_has_number.wait();
                })
            })
            .collect();
        let late = {
            let (cache, stream, holding, late_has_number, pool_exited, late_freed, checked) =
                (&cache, &stream, &holding, &late_has_number, &pool_exited, &late_freed, &checked);
            scope.spawn(move || {
                holding.wait();
                // Takes number 64: no lane.
                let ptr = cache.allocate(small, 256, stream).unwrap();
                // SAFETY: allocated just above with these arguments, freed once.
                unsafe { cache.deallocate(ptr, small, 256, stream) }.unwrap();
                late_has_number.wait();
                pool_exited.wait();
                // Every other thread has exited and given its number back: 64 lanes are free,
                // and this is the only thread using the cache. Its free should land in a lane.
                let ptr = cache.allocate(large, 256, stream).unwrap();
                // SAFETY: allocated just above with these arguments, freed once.
                unsafe { cache.deallocate(ptr, large, 256, stream) }.unwrap();
                late_freed.wait();
                // Alive (holding its number) while the other thread looks: an exited thread's
                // lane goes to the next thread to take its number.
                checked.wait();
                ptr
            })
        };
        for worker in pool {
            worker.join().unwrap();
        }
        pool_exited.wait();
        late_freed.wait();
        // This thread takes a free number, with a lane, and asks for the same size: if the late
        // thread's block is in the late thread's own lane, this misses; if it went to the shared
        // lists (the late thread had no lane), this hits.
        found = cache.allocate(large, 256, &stream).unwrap();
        // SAFETY: allocated just above with these arguments, freed once.
        unsafe { cache.deallocate(found, large, 256, &stream) }.unwrap();
        checked.wait();
        late_block = late.join().unwrap();
    });
    let ptr = found;
    assert_ne!(
        ptr, late_block,
        "the late thread had no lane although 64 numbers were free: it keeps number 64 for life"
    );
}
