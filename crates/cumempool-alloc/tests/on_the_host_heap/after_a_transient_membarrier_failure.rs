//! Issue 19, item 6: one `membarrier` that failed for a passing reason (ENOMEM, EINTR, EAGAIN)
//! set a flag that was never cleared, so every later claim of a lane in the whole process was
//! refused: `release` answered `LanesUnreachable` and lane blocks stayed cached until each
//! cache was dropped. Only permanent failures (EPERM, ENOSYS, an unsupported command) may stick.
//! `membarrier` is trapped by a seccomp filter (SIGSYS) whose handler fails the first calls with
//! ENOMEM and then answers success, in a child process (this binary, re-run), since the filter
//! cannot be removed. One thread only: the success it answers is a real barrier's equal there.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use crate::support::{fake_stream, fill_this_threads_lane, is_child, run_in_child, trap_membarrier};
use cumempool_alloc::{CachingResource, Error, HostHeap, Statistics};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

const CHILD: &str = "CUMEMPOOL_TRANSIENT_MEMBARRIER_CHILD";
/// How many more trapped `membarrier` calls fail with ENOMEM.
static FAILURES_LEFT: AtomicUsize = AtomicUsize::new(0);

/// A trapped `membarrier`'s answer: ENOMEM while failures are left, then success.
fn fail_while_failures_left() -> i64 {
    let fail = FAILURES_LEFT.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(1)).is_ok();
    if fail {
        -i64::from(libc::ENOMEM)
    } else {
        0
    }
}

#[test]
fn a_transient_membarrier_failure_fails_at_most_that_claim() {
    if is_child(CHILD) {
        let below = Statistics::new(HostHeap);
        let cache = CachingResource::new(&below);
        let stream = fake_stream(0);
        trap_membarrier(fail_while_failures_left);
        // Enough failures in a row that the first claim gives up, whatever its retries.
        FAILURES_LEFT.store(64, Relaxed);
        fill_this_threads_lane(&cache, &stream, 4096);
        match cache.release() {
            Err(Error::LanesUnreachable { reason }) => eprintln!("child: the first release: {reason}"),
            other => panic!("the first release should have been refused: {other:?}"),
        }
        assert_eq!(below.usage().current_bytes, 4096, "only the lane's block stayed");
        FAILURES_LEFT.store(0, Relaxed);
        cache.release().expect("once membarrier works again, so do claims");
        assert_eq!(below.usage().current_bytes, 0, "the lane's block was given back");
        // A few failures in a row are retried within one claim.
        fill_this_threads_lane(&cache, &stream, 4096);
        FAILURES_LEFT.store(1, Relaxed);
        cache.release().expect("a claim retries a passing failure");
        assert_eq!(below.usage().current_bytes, 0);
        return;
    }
    run_in_child(
        concat!(module_path!(), "::a_transient_membarrier_failure_fails_at_most_that_claim"),
        CHILD,
        Duration::from_secs(30),
    );
}
