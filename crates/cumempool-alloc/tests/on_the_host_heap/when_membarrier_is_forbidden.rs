//! Found by review of the lanes: once the first cache chose the asymmetric fences, a
//! `membarrier` that starts failing (a seccomp filter installed after start-up, as sandboxes
//! and some service managers do) made every claim of a lane spin for ever: `release`,
//! `release_stream`, `stats`, eviction and `Drop` hung. Now claims give up with a typed error,
//! and `Drop` needs none. The probe runs in a child process (this binary, re-run) so that a
//! hang fails the test instead of hanging it.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use crate::support::{
    fake_stream, fill_this_threads_lane, filter_membarrier, is_child, run_in_child, MEMBARRIER_EPERM,
};
use cumempool_alloc::{CachingResource, Error, HostHeap, Statistics, StreamOrderedResource};
use std::time::Duration;

const CHILD: &str = "CUMEMPOOL_REVIEW_MEMBARRIER_CHILD";

#[test]
fn release_returns_when_membarrier_is_forbidden_after_the_first_cache() {
    if is_child(CHILD) {
        let below = Statistics::new(HostHeap);
        let cache = CachingResource::new(&below);
        let stream = fake_stream(0);
        fill_this_threads_lane(&cache, &stream, 4096);
        // As a sandbox would, after the first cache chose `membarrier`.
        filter_membarrier(MEMBARRIER_EPERM);
        eprintln!("child: releasing");
        let error = cache.release().unwrap_err();
        assert!(matches!(error, Error::LanesUnreachable { .. }), "{error}");
        eprintln!("child: {error}");
        assert_eq!(cache.stats().streams, 1, "stats still answers");
        // The hot path goes on: the lane's block is still there for this thread.
        let ptr = cache.allocate(4096, 256, &stream).unwrap();
        // SAFETY: allocated just above with these arguments, freed once.
        unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
        drop(cache);
        assert_eq!(below.usage().current_bytes, 0, "drop gave every block back, the lane's too");
        eprintln!("child: dropped");
        return;
    }
    // A release still spinning after 10 s fails the test.
    run_in_child(
        concat!(module_path!(), "::release_returns_when_membarrier_is_forbidden_after_the_first_cache"),
        CHILD,
        Duration::from_secs(10),
    );
}
