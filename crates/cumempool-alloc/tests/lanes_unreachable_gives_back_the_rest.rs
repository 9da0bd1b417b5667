//! Its own process: it forks, and the child must not inherit other tests' threads holding locks.
//!
//! Found by the second review of the lanes: `Error::LanesUnreachable` says "What else it held
//! was given back; the lanes' blocks stay cached", but `take_slots` drops every picked slot that
//! has lanes (any stream with a second cached free) from the release altogether, so its shared
//! lists and its budget stay too. The no-memory retry (`allocate_below` -> `release`) then frees
//! nothing, and dropped streams with lanes are never reclaimed (the cache keeps them alive).
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(target_os = "linux")]

mod support;

use cumempool_alloc::{CachingResource, Error, HostHeap, Statistics};
use support::{exit_code_of_forked, fake_stream, fill_this_threads_lane};

#[test]
fn when_lanes_are_unreachable_release_still_gives_back_the_shared_lists() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let stream = fake_stream(0);
    // Slot, lanes (both in the shared lists), then this thread's lane.
    fill_this_threads_lane(&cache, &stream, 4096);
    assert_eq!(below.usage().current_bytes, 3 * 4096);
    let code = exit_code_of_forked(|| match cache.release() {
        // Only the lane's block may stay.
        Err(Error::LanesUnreachable { .. }) if below.usage().current_bytes == 4096 => 0,
        Err(Error::LanesUnreachable { .. }) => 2,
        _ => 1,
    });
    assert_eq!(code, 0, "2: release in the child kept the shared lists' blocks too, not only the lane's");
}
