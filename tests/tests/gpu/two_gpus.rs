//! Pools across two devices: peer access to a pool, and routing per device.
//! Skipped on one GPU unless `CUMEMPOOL_REQUIRE_TWO_GPUS=1`, which makes them fail instead.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{current_pool, default_pool, set_current_pool, Access, Device, Error, MemPool, PoolRef, Route, Stream};
use cumempool_tests::{gpu, pattern, routing_lock};

fn two_devices() -> Option<(Device, Device)> {
    gpu()?;
    if Device::count().unwrap() < 2 {
        assert!(
            std::env::var("CUMEMPOOL_REQUIRE_TWO_GPUS").map_or(true, |v| v != "1"),
            "CUMEMPOOL_REQUIRE_TWO_GPUS=1 but one GPU"
        );
        eprintln!("skipped: needs two GPUs");
        return None;
    }
    Some((Device::get(0).unwrap(), Device::get(1).unwrap()))
}

#[test]
#[ignore = "requires two CUDA GPUs"]
fn peer_access_to_a_pool_is_refused_until_granted() {
    let Some((zero, one)) = two_devices() else { return };
    assert!(one.can_access_peer(zero).unwrap());
    let stream0 = Stream::new(&zero.primary_context().unwrap()).unwrap();
    let stream1 = Stream::new(&one.primary_context().unwrap()).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut source = pool.alloc(1 << 20, &stream0).unwrap();
    source.copy_from_host(&pattern(1 << 20, 3)).unwrap();
    let mut target = default_pool(Route::device(1)).unwrap().alloc(1 << 20, &stream1).unwrap();

    assert_eq!(pool.access(one).unwrap(), Access::None);
    match target.copy_from(&source) {
        Err(e) => eprintln!("before access: {e}"),
        Ok(()) => panic!("device 1 copied from a device-0 pool it had no access to"),
    }
    // Read-only: granted where the driver supports it, else a clear refusal (driver 580 refuses).
    match pool.set_access(one, Access::Read) {
        Ok(()) => assert_eq!(pool.access(one).unwrap(), Access::Read),
        Err(e @ Error::AccessNotGrantable { .. }) => {
            assert!(e.to_string().contains("read-only"), "{e}");
            assert_eq!(pool.access(one).unwrap(), Access::None, "a refused grant changes nothing");
            eprintln!("{e}");
        }
        Err(other) => panic!("read-only access: {other:?}"),
    }
    pool.set_access_many(&[(one, Access::ReadWrite), (zero, Access::ReadWrite)]).unwrap();
    assert_eq!(pool.access(one).unwrap(), Access::ReadWrite);
    let mut fresh = pool.alloc(1 << 20, &stream0).unwrap();
    fresh.copy_from_host(&pattern(1 << 20, 4)).unwrap();
    target.copy_from(&fresh).unwrap();
    let mut back = vec![0u8; 1 << 20];
    target.copy_to_host(&mut back).unwrap();
    assert_eq!(back, pattern(1 << 20, 4), "device 1 read the device-0 pool's bytes");
    pool.set_access(one, Access::None).unwrap();
    assert_eq!(pool.access(one).unwrap(), Access::None);
}

#[test]
#[ignore = "requires two CUDA GPUs"]
fn routing_on_each_device_is_independent() {
    let Some((_zero, _one)) = two_devices() else { return };
    let _lock = routing_lock();
    let (route0, route1) = (Route::device(0), Route::device(1));
    let default0 = default_pool(route0).unwrap();
    assert!(!default0.same_as(&default_pool(route1).unwrap()), "each device has its own default pool");
    let pool1 = MemPool::new(route1).unwrap();
    let guard = set_current_pool(route1, &pool1).unwrap();
    assert!(current_pool(route1).unwrap().same_as(&pool1));
    assert!(current_pool(route0).unwrap().same_as(&default0), "device 0 is untouched");
    drop(guard);
    let pool0 = MemPool::new(route0).unwrap();
    assert!(matches!(set_current_pool(route1, &pool0), Err(Error::PoolRouteMismatch { .. })));
    // A pool of unknown route goes to the driver, which refuses it too.
    // SAFETY: `pool0` is live and outlives `unknown`, and nothing is allocated from it.
    let unknown = unsafe { PoolRef::from_raw(pool0.as_raw(), None) };
    match set_current_pool(route1, &unknown) {
        Err(e @ Error::RouteRefused { .. }) => eprintln!("{e}"),
        other => panic!("expected RouteRefused, got {other:?}"),
    }
    assert!(current_pool(route1).unwrap().same_as(&default_pool(route1).unwrap()));
}

#[test]
#[ignore = "requires two CUDA GPUs"]
fn the_legacy_streams_of_two_contexts_never_share_cached_blocks() {
    use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, StreamOrderedResource};
    let Some((zero, one)) = two_devices() else { return };
    let (context0, context1) = (zero.primary_context().unwrap(), one.primary_context().unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    pool.set_access(one, Access::ReadWrite).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    let (legacy0, legacy1) = (Stream::legacy(&context0), Stream::legacy(&context1));
    let block = cache.allocate(1 << 20, 256, &legacy0).unwrap();
    // SAFETY: allocated above with these arguments, freed once.
    unsafe { cache.deallocate(block, 1 << 20, 256, &legacy0) }.unwrap();
    // Both handles are 0; keyed by the handle (before the fix) this was a hit: device 1's legacy
    // stream got a block whose free on device 0's legacy stream nothing ordered it after.
    let other = cache.allocate(1 << 20, 256, &legacy1).unwrap();
    assert_ne!(other, block, "a block crossed from one context's legacy stream to another's");
    // SAFETY: `other` was allocated above with these arguments, freed once.
    unsafe { cache.deallocate(other, 1 << 20, 256, &legacy1) }.unwrap();
    cache.release().unwrap();
    legacy0.synchronize().unwrap();
    legacy1.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}
