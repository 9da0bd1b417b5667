//! Location-keyed routing on the real driver: every route kind, the refusals of
//! docs/driver-behaviour.md's table as typed errors, override and restore.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{current_pool, default_pool, is_default, set_current_pool, Error, Location, MemPool, Route};
use cumempool_tests::{gpu, reservations_lock, routing_lock, ROUTE_KINDS};

#[test]
#[ignore = "requires a CUDA GPU"]
fn every_route_kind_has_a_distinct_default_pool() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let pools: Vec<_> = ROUTE_KINDS.iter().map(|r| default_pool(*r).unwrap_or_else(|e| panic!("{r}: {e}"))).collect();
    for (i, a) in pools.iter().enumerate() {
        assert_eq!(a.route(), Some(ROUTE_KINDS[i]));
        for b in &pools[i + 1..] {
            assert!(!a.same_as(b), "{:?} and {:?} share a pool", a.route(), b.route());
        }
        assert!(is_default(ROUTE_KINDS[i]).unwrap(), "{} starts on its default pool", ROUTE_KINDS[i]);
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_device_route_default_is_the_device_default_pool() {
    let _gpu = gpu().expect("a GPU");
    let driver = cumempool::sys::driver().unwrap();
    let mut raw = std::ptr::null_mut();
    let f = driver.cuDeviceGetDefaultMemPool().unwrap();
    // SAFETY: a valid out-pointer; device 0 exists (a GPU was found).
    assert_eq!(unsafe { f(&mut raw, 0) }, cumempool::sys::CUresult::CUDA_SUCCESS);
    assert_eq!(default_pool(Route::device(0)).unwrap().as_raw(), raw);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn refused_routes_are_typed_errors() {
    let _gpu = gpu().expect("a GPU");
    // Refused before the driver is called.
    let unspecified_pinned = Route::new(Location::Unspecified, cumempool::AllocationType::Pinned);
    assert!(matches!(default_pool(unspecified_pinned), Err(Error::InvalidRoute { .. })));
    let count = cumempool::Device::count().unwrap();
    match default_pool(Route::device(count)) {
        Err(Error::InvalidDevice { ordinal, count: c }) => assert_eq!((ordinal, c), (count, count)),
        other => panic!("expected InvalidDevice, got {other:?}"),
    }
    assert!(matches!(default_pool(Route::host_numa(-1)), Err(Error::InvalidRoute { .. })));
    #[cfg(feature = "cuda-13020")]
    assert!(matches!(default_pool(Route::managed(Location::Invisible)), Err(Error::InvalidRoute { .. })));
    // Refused by the driver: (HOST_NUMA_CURRENT, PINNED) is CUDA_ERROR_NOT_SUPPORTED.
    match default_pool(Route::new(Location::HostNumaCurrent, cumempool::AllocationType::Pinned)) {
        Err(e @ Error::RouteRefused { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("CUDA_ERROR_NOT_SUPPORTED") && text.contains("host NUMA node of the calling thread"),
                "{text}"
            );
            eprintln!("{text}");
        }
        other => panic!("expected RouteRefused, got {other:?}"),
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_route_override_is_seen_and_restored_when_the_guard_drops() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    for route in [Route::device(0), Route::host(), Route::managed(Location::Unspecified)] {
        let default = default_pool(route).unwrap();
        let pool = MemPool::new(route).unwrap();
        {
            let guard = set_current_pool(route, &pool).unwrap();
            assert!(current_pool(route).unwrap().same_as(&pool), "{route}: the override is current");
            assert!(!is_default(route).unwrap());
            assert_eq!(guard.route(), route);
        }
        assert!(current_pool(route).unwrap().same_as(&default), "{route}: the default is back");
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn cu_mem_alloc_async_follows_the_current_pool_of_the_device_route() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let stream = cumempool::Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let _guard = set_current_pool(Route::device(0), &pool).unwrap();
    let driver = cumempool::sys::driver().unwrap();
    let (alloc, free) = (driver.cuMemAllocAsync().unwrap(), driver.cuMemFreeAsync().unwrap());
    let mut ptr = 0;
    // SAFETY: a valid out-pointer and a live stream.
    assert_eq!(unsafe { alloc(&mut ptr, 1 << 20, stream.as_raw()) }, cumempool::sys::CUresult::CUDA_SUCCESS);
    assert!(pool.used_mem_current().unwrap() >= 1 << 20, "the allocation came from the routed pool");
    // SAFETY: the allocation just made on this stream, freed once.
    assert_eq!(unsafe { free(ptr, stream.as_raw()) }, cumempool::sys::CUresult::CUDA_SUCCESS);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn keep_makes_the_change_last_and_keeps_the_pool_alive() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::host();
    let pool = MemPool::new(route).unwrap();
    let raw = pool.as_raw();
    set_current_pool(route, &pool).unwrap().keep();
    drop(pool); // the route still holds it: the driver must not fall back to the default
    let current = current_pool(route).unwrap();
    assert_eq!(current.as_raw(), raw);
    let stream = cumempool::Stream::new(&context).unwrap();
    let mut buffer = current.alloc(4096, &stream).unwrap();
    buffer.host_slice_mut().unwrap().fill(0x5a);
    drop(buffer);
    drop(current);
    cumempool::reset_current_pool(route).unwrap();
    assert!(is_default(route).unwrap());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_pool_of_another_route_is_refused_before_the_driver() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let host_pool = MemPool::new(Route::host()).unwrap();
    match set_current_pool(Route::device(0), &host_pool) {
        Err(e @ Error::PoolRouteMismatch { .. }) => eprintln!("{e}"),
        other => panic!("expected PoolRouteMismatch, got {other:?}"),
    }
    assert!(is_default(Route::device(0)).unwrap());
}

/// The driver's current pool of `route`, read without this crate's bookkeeping.
fn raw_current(route: Route) -> cumempool::sys::CUmemoryPool {
    cumempool::current_pool_handle(route).unwrap()
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn guards_dropped_out_of_order_leave_the_route_on_what_was_current_before() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::host();
    let default = default_pool(route).unwrap();
    let (a, b) = (MemPool::new(route).unwrap(), MemPool::new(route).unwrap());
    let guard_a = set_current_pool(route, &a).unwrap();
    let guard_b = set_current_pool(route, &b).unwrap();
    drop(guard_a);
    assert_eq!(raw_current(route), b.as_raw(), "the newest live change still shows");
    drop(guard_b);
    assert_eq!(raw_current(route), default.as_raw(), "measured before the fix: the route ended on A");
    // Nothing holds A or B any more: both are released now (retired, as they were current).
    a.destroy().unwrap();
    b.destroy().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_forgotten_guard_keeps_its_pool_until_the_route_is_reset() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::host();
    let pool = MemPool::new(route).unwrap();
    let raw = pool.as_raw();
    std::mem::forget(set_current_pool(route, &pool).unwrap());
    drop(pool);
    assert_eq!(raw_current(route), raw);
    let stream = cumempool::Stream::new(&context).unwrap();
    let mut buffer = current_pool(route).unwrap().alloc(4096, &stream).unwrap();
    buffer.host_slice_mut().unwrap().fill(1);
    drop(buffer);
    stream.synchronize().unwrap();
    cumempool::reset_current_pool(route).unwrap();
    assert!(is_default(route).unwrap());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn guards_of_one_route_on_several_threads_end_on_the_default() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::device(0);
    let pools: Vec<MemPool> = (0..4).map(|_| MemPool::new(route).unwrap()).collect();
    for round in 0..20 {
        let barrier = std::sync::Barrier::new(pools.len());
        std::thread::scope(|scope| {
            for (i, pool) in pools.iter().enumerate() {
                let (barrier, context) = (&barrier, &context);
                scope.spawn(move || {
                    context.make_current().unwrap();
                    let guard = set_current_pool(route, pool).unwrap();
                    barrier.wait();
                    if (i + round) % 2 == 0 {
                        guard.restore().unwrap();
                    } else {
                        drop(guard);
                    }
                });
            }
        });
        assert!(is_default(route).unwrap(), "round {round}");
    }
    for pool in pools {
        pool.destroy().unwrap();
    }
}

/// A pool made by "another library" through the raw API.
fn foreign_pool(route: Route) -> cumempool::sys::CUmemoryPool {
    let driver = cumempool::sys::driver().unwrap();
    let props = MemPool::builder(route).to_props().unwrap();
    let mut raw = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and the builder's properties for `route`.
    assert_eq!(unsafe { driver.cuMemPoolCreate().unwrap()(&mut raw, &props) }, cumempool::sys::CUresult::CUDA_SUCCESS);
    raw
}

fn raw_set(route: Route, pool: cumempool::sys::CUmemoryPool) {
    let driver = cumempool::sys::driver().unwrap();
    let (mut location, kind) = (route.location.to_raw().unwrap(), route.allocation_type.to_raw());
    assert_eq!(
        // SAFETY: a valid location and type of `route`; callers pass a live pool.
        unsafe { driver.cuMemSetMemPool().unwrap()(&mut location, kind, pool) },
        cumempool::sys::CUresult::CUDA_SUCCESS
    );
}

fn raw_destroy(pool: cumempool::sys::CUmemoryPool) {
    let driver = cumempool::sys::driver().unwrap();
    // SAFETY: a pool made by `foreign_pool`, destroyed once; nothing was allocated from it.
    assert_eq!(unsafe { driver.cuMemPoolDestroy().unwrap()(pool) }, cumempool::sys::CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_foreign_pool_destroyed_meanwhile_is_never_restored() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::host();
    let foreign = foreign_pool(route);
    raw_set(route, foreign);
    let ours = MemPool::new(route).unwrap();
    let guard = set_current_pool(route, &ours).unwrap();
    raw_destroy(foreign); // the other library lets its pool go while ours is current
    drop(guard);
    assert!(is_default(route).unwrap(), "the default, never the destroyed pool's handle");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_change_made_outside_the_library_is_not_overwritten() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let route = Route::host();
    let ours = MemPool::new(route).unwrap();
    let guard = set_current_pool(route, &ours).unwrap();
    let foreign = foreign_pool(route);
    raw_set(route, foreign);
    // Dropping the guard must not drop our pool here: code that had saved it to restore later
    // would restore a destroyed pool.
    drop(guard);
    assert_eq!(raw_current(route), foreign, "the outside change stays");
    match current_pool(route) {
        Err(Error::ForeignCurrentPool { handle, .. }) => assert_eq!(handle, foreign as usize as u64),
        other => panic!("a pool routed by other code gets no safe handle, got {other:?}"),
    }
    let destroyed = ours.destroy();
    assert!(matches!(destroyed, Err(Error::PoolInUse { .. })), "kept alive until reset_current_pool: {destroyed:?}");
    raw_set(route, default_pool(route).unwrap().as_raw()); // the other code restores the default
    cumempool::reset_current_pool(route).unwrap();
    raw_destroy(foreign);
}

/// A routed pool keeps its memory between synchronisations (threshold raised from the driver's
/// 0, as CuPy and cuda.core do), so the libraries the route serves do not map memory afresh at
/// every step; a threshold set by the program is left alone, and trimming still gives memory back.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_routed_pool_keeps_its_memory_unless_its_threshold_was_set() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let _reservations = reservations_lock(); // it reads what the pool keeps reserved
    let stream = cumempool::Stream::new(&context).unwrap();
    let route = Route::device(0);
    let pool = MemPool::builder(route).max_size(256 << 20).build().unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 0, "the driver's default");
    let guard = set_current_pool(route, &pool).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX, "raised when routed");
    drop(pool.alloc(64 << 20, &stream).unwrap());
    stream.synchronize().unwrap();
    assert!(pool.reserved_mem_current().unwrap() >= 64 << 20, "kept across a synchronisation");
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_mem_current().unwrap(), 0, "trim_to still gives it back");
    drop(guard);
    let chosen = MemPool::builder(route).release_threshold(1 << 20).build().unwrap();
    let guard = set_current_pool(route, &chosen).unwrap();
    assert_eq!(chosen.release_threshold().unwrap(), 1 << 20, "a threshold the program set is kept");
    drop(guard);
}
