//! Its own process: it counts the retired pools, which a pool any other test drops (one that was
//! ever current) adds to, and any pool built in the process may take back.
//!
//! Retired pools made anew by the builder: never given away by `MemPool::into_raw`, and never
//! made anew at all once exported to other processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{destroy_retired_pools, retired_pools, set_current_pool, HandleTypes, MemPool, PoolBuilder, Route};
use cumempool_tests::{gpu, routing_lock};

/// Builds a pool with `builder`, makes it current for its route and back, and drops it: the
/// pool is retired. Answers its handle.
fn retire_one(builder: &PoolBuilder, before_drop: impl FnOnce(&MemPool)) -> cumempool::sys::CUmemoryPool {
    let pool = builder.clone().build().unwrap();
    let raw = pool.as_raw();
    before_drop(&pool);
    drop(set_current_pool(Route::device(0), &pool).unwrap());
    drop(pool);
    raw
}

/// The routing lock, with no pool retired: a retired pool of another test would serve the
/// builders here.
fn no_retired_pools() -> std::sync::MutexGuard<'static, ()> {
    gpu().expect("a GPU");
    let lock = routing_lock();
    // SAFETY: the caller holds the routing lock and no thread allocates through a route.
    unsafe { destroy_retired_pools() }.unwrap();
    lock
}

/// `MemPool::into_raw` tells its caller to destroy the pool with `cuMemPoolDestroy`, unless the
/// caller made it current somewhere. A pool fresh from the builder may be a retired pool made
/// anew, which *was* current (another thread may still be reading it through the route): the
/// caller, who never routed it, cannot know, and destroying it is the crash retirement exists
/// to prevent. `into_raw` refuses such a pool (or the builder never hands one out where
/// `into_raw` would give it away).
#[test]
#[ignore = "requires a CUDA GPU"]
fn into_raw_never_gives_away_a_pool_made_anew_from_a_retired_one() {
    let _lock = no_retired_pools();
    let builder = MemPool::builder(Route::device(0)).max_size(96 << 20);
    let retired = retire_one(&builder, |_| {});
    let fresh = builder.build().unwrap();
    assert_eq!(fresh.as_raw(), retired, "the retired pool was made anew (the case under test)");
    match fresh.into_raw() {
        Err(_) => {}
        Ok(raw) => {
            // Owned again, so that it is retired (not destroyed) when dropped.
            // SAFETY: the live pool just given away, serving this route; nothing else destroys it.
            drop(unsafe { MemPool::from_raw(raw, Route::device(0)) });
            // SAFETY: as above.
            unsafe { destroy_retired_pools() }.unwrap();
            panic!("into_raw handed a pool that was a route's current pool to a caller told to cuMemPoolDestroy it");
        }
    }
    // SAFETY: as above.
    unsafe { destroy_retired_pools() }.unwrap();
}

/// A pool exported to other processes (`Pool::export_fd`) is shared with them for good: they
/// hold its handle and can import allocations from it. Retired and made anew for a new owner,
/// it hands that owner's allocations out of a pool other processes have imported, without the
/// new owner asking for any sharing. Like a pool whose access was changed, an exported pool
/// must never be made anew.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_pool_exported_to_other_processes_is_never_made_anew_for_a_new_owner() {
    let _lock = no_retired_pools();
    let builder =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).max_size(64 << 20);
    let mut exported = None;
    let retired = retire_one(&builder, |pool| exported = Some(pool.export_fd().unwrap()));
    assert_eq!(retired_pools().unwrap().count, 1);
    let fresh = builder.build().unwrap();
    let reused = fresh.as_raw() == retired;
    drop(fresh);
    drop(exported);
    // SAFETY: as above.
    unsafe { destroy_retired_pools() }.unwrap();
    assert!(!reused, "a pool another process could import was handed to a new owner as a fresh pool");
}
