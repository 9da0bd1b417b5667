//! Found by the second review of the lanes: `make_room` now takes every lane's budget back
//! (`return_unfilled_budgets(true)`: a claim of every lane of every slot, one `membarrier`)
//! before it even looks for a victim, whatever `LANE_SWEEP_INTERVAL` says. A stream alone at
//! the bound has no victim, so each of its frees that does not fit costs a `membarrier`
//! (measured with strace: 8112 for 8000 such frees, against 63 before 30b8185), the very
//! cliff the 1 ms sweep limit was made against (15-50 us each with many threads running).
//! `membarrier` is counted through a seccomp filter that traps it (SIGSYS) and answers 0, in a
//! child process (this binary, re-run), since the filter cannot be removed.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

use crate::support::{fake_stream, is_child, run_in_child, trap_membarrier};
use cumempool_alloc::{CachingResource, HostHeap, StreamOrderedResource};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

const CHILD: &str = "CUMEMPOOL_REVIEW2_BEYOND_BOUND_CHILD";
static MEMBARRIERS: AtomicUsize = AtomicUsize::new(0);

/// A trapped `membarrier`'s answer: counted, then success.
fn count_membarrier() -> i64 {
    MEMBARRIERS.fetch_add(1, Relaxed);
    0
}

#[test]
fn frees_beyond_the_bound_with_nothing_to_evict_cost_no_membarrier_each() {
    if is_child(CHILD) {
        let block = 64 << 10;
        let cache = CachingResource::with_max_cached(HostHeap, 4 * block);
        let stream = fake_stream(0);
        let round = || {
            let blocks = [(); 8].map(|()| cache.allocate(block, 256, &stream).unwrap());
            for ptr in blocks {
                // SAFETY: each block was allocated above with these arguments and is freed once.
                unsafe { cache.deallocate(ptr, block, 256, &stream) }.unwrap();
            }
        };
        round(); // slot, lanes, this thread's lane; the bound is spent
        trap_membarrier(count_membarrier);
        let rounds = 500;
        let start = Instant::now();
        for _ in 0..rounds {
            round(); // 4 of its 8 frees do not fit; no other stream to evict
        }
        let (count, ms) = (MEMBARRIERS.load(Relaxed), start.elapsed().as_millis() as usize);
        eprintln!("child: {count} membarriers for {} frees beyond the bound in {ms} ms", 4 * rounds);
        // The documented limits: a budget sweep at most once a millisecond per cache, and a
        // gather of a stream's lanes at most once a millisecond per stream (one stream here).
        assert!(count <= 2 * ms + 10, "{count} membarriers for {} frees beyond the bound in {ms} ms", 4 * rounds);
        return;
    }
    run_in_child(
        concat!(module_path!(), "::frees_beyond_the_bound_with_nothing_to_evict_cost_no_membarrier_each"),
        CHILD,
        Duration::from_secs(30),
    );
}
