//! Found by the second review of the lanes: `Error::LanesUnreachable` says "What else it held
//! was given back; the lanes' blocks stay cached", but `take_slots` drops every picked slot that
//! has lanes (any stream with a second cached free) from the release altogether, so its shared
//! lists and its budget stay too. The no-memory retry (`allocate_below` -> `release`) then frees
//! nothing, and dropped streams with lanes are never reclaimed (the cache keeps them alive).
//! Alone in its binary: the forked child must not inherit other tests' threads holding locks.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(target_os = "linux")]

use cumempool::Stream;
use cumempool_alloc::{CachingResource, Error, HostHeap, Statistics, StreamOrderedResource};

#[test]
fn when_lanes_are_unreachable_release_still_gives_back_the_shared_lists() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.unwrap();
    // Slot, lanes (both in the shared lists), then this thread's lane.
    let blocks = [(); 3].map(|()| cache.allocate(4096, 256, &stream).unwrap());
    for ptr in blocks {
        unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    }
    assert_eq!(below.usage().current_bytes, 3 * 4096);
    // SAFETY: the child only calls the cache and exits with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = match cache.release() {
            // Only the lane's block may stay.
            Err(Error::LanesUnreachable { .. }) if below.usage().current_bytes == 4096 => 0,
            Err(Error::LanesUnreachable { .. }) => 2,
            _ => 1,
        };
        // SAFETY: ends the child without running the parent's destructors twice.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "{status}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "2: release in the child kept the shared lists' blocks too, not only the lane's"
    );
}
