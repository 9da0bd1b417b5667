//! Its own process: its threads need lanes, which other tests' threads could all hold.
//!
//! Found by the second review of the lanes: since lane lists are made only by
//! `deallocate_beyond_lane` for a stream in its *home* slot (`home_slot`, 30b8185), a stream
//! whose home slot another stream holds (it sits further along the probe path) never gets lane
//! lists: every free of it, from every thread, goes to the slot's shared lists under the slot's
//! lock. Before 30b8185, `push` made the lists inside the lane, for any slot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, StreamOrderedResource};
use support::fake_stream;

/// The cache's home slot of a stream (the same hash as `caching::home_of`).
fn home(stream: &Stream) -> u64 {
    (stream.id().get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) % 256
}

/// Whether a block this thread frees on `stream` lands in this thread's lane: another living
/// thread asking for the same size then misses (a block in the shared lists would be its hit).
fn freed_block_lands_in_my_lane(cache: &CachingResource<HostHeap>, stream: &Stream) -> bool {
    let (small, probe) = (4096, 1 << 20);
    // Slot, then lanes: both frees go to the shared lists.
    let warm = [(); 2].map(|()| cache.allocate(small, 256, stream).unwrap());
    for ptr in warm {
        // SAFETY: each block was allocated above with these arguments and is freed once.
        unsafe { cache.deallocate(ptr, small, 256, stream) }.unwrap();
    }
    let mine = cache.allocate(probe, 256, stream).unwrap();
    // SAFETY: allocated just above with these arguments, freed once.
    unsafe { cache.deallocate(mine, probe, 256, stream) }.unwrap();
    let theirs = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let ptr = cache.allocate(probe, 256, stream).unwrap();
                // SAFETY: allocated just above with these arguments, freed once.
                unsafe { cache.deallocate(ptr, probe, 256, stream) }.unwrap();
                ptr
            })
            .join()
            .unwrap()
    });
    mine != theirs
}

#[test]
fn a_stream_whose_home_slot_is_taken_still_caches_in_lanes() {
    let cache = CachingResource::new(HostHeap);
    let first = fake_stream(0);
    // A second stream with the same home slot: it takes the next slot on the probe path.
    let mut streams = Vec::new();
    let second = loop {
        let s = fake_stream(streams.len() + 1);
        if home(&s) == home(&first) {
            break s;
        }
        streams.push(s);
    };
    assert!(freed_block_lands_in_my_lane(&cache, &first), "control: the home stream's free lands in the lane");
    assert!(
        freed_block_lands_in_my_lane(&cache, &second),
        "a stream off its home slot never gets lane lists: every free goes under the slot's lock"
    );
}
