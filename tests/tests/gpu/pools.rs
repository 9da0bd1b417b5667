//! Pools on the real driver: creation and refusals, maximum size, attributes, destruction,
//! access, and many threads on one pool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{
    default_pool, Access, Device, Error, HandleTypes, Location, MemPool, Pool, PoolAttribute, Route, Stream,
};
use cumempool_tests::{gpu, gpu_stream, reservations_lock, routing_lock};

#[test]
#[ignore = "requires a CUDA GPU"]
fn pools_are_created_for_every_creatable_route() {
    let _gpu = gpu().expect("a GPU");
    let creatable = [
        MemPool::builder(Route::device(0)),
        MemPool::builder(Route::host()),
        MemPool::builder(Route::host_numa(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR),
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR),
        MemPool::builder(Route::device(0)).max_size(1 << 30),
        MemPool::builder(Route::device(0)).hw_decompress(true),
        MemPool::builder(Route::managed(Location::Unspecified)),
        MemPool::builder(Route::managed(Location::Device(0))),
    ];
    for builder in creatable {
        let description = format!("{builder:?}");
        let pool = builder.build().unwrap_or_else(|e| panic!("{description}: {e}"));
        assert!(pool.route().is_some());
        pool.destroy().unwrap();
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_builder_sets_threshold_reuse_and_reserves_the_initial_size() {
    let _gpu = gpu().expect("a GPU");
    let _reservations = reservations_lock();
    const MIB: u64 = 1 << 20;
    for route in [Route::device(0), Route::host()] {
        let pool = MemPool::builder(route)
            .initial_size(64 * MIB)
            .reuse_allow_opportunistic(false)
            .reuse_allow_internal_dependencies(false)
            .build()
            .unwrap();
        let reserved = pool.reserved_mem_current().unwrap();
        assert!(reserved >= 64 * MIB, "{route}: reserved at build ({reserved} B)");
        assert_eq!(pool.release_threshold().unwrap(), reserved, "{route}: the threshold keeps the reservation");
        assert_eq!(pool.used_mem_current().unwrap(), 0, "{route}: nothing left allocated");
        assert!(!pool.reuse_allow_opportunistic().unwrap());
        assert!(!pool.reuse_allow_internal_dependencies().unwrap());
        assert!(pool.reuse_follow_event_dependencies().unwrap(), "untouched policies keep the driver's default");
        pool.destroy().unwrap();
    }
    let pool = MemPool::builder(Route::device(0)).release_threshold(u64::MAX).initial_size(32 * MIB).build().unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX, "an explicit threshold wins");
    pool.destroy().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn refused_pool_creations_say_why() {
    let _gpu = gpu().expect("a GPU");
    let refused = [
        (MemPool::builder(Route::managed(Location::Unspecified)).max_size(1 << 30), "maximum size"),
        (
            MemPool::builder(Route::managed(Location::Device(0)))
                .export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR),
            "export",
        ),
        (MemPool::builder(Route::host()).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR), "host NUMA node"),
        (MemPool::builder(Route::new(Location::HostNumaCurrent, cumempool::AllocationType::Pinned)), "calling thread"),
        (MemPool::builder(Route::host_numa(7)), "node 7"),
    ];
    for (builder, reason) in refused {
        match builder.build() {
            Err(e @ Error::PoolCreation { .. }) => {
                let text = e.to_string();
                assert!(text.contains(reason), "{text} should mention {reason}");
                eprintln!("{text}");
            }
            other => panic!("expected PoolCreation mentioning {reason}, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_maximum_size_turns_into_a_typed_out_of_memory() {
    let stream = gpu_stream().expect("a GPU");
    let _reservations = reservations_lock();
    let pool = MemPool::builder(Route::device(0)).max_size(1 << 30).build().unwrap();
    let first = pool.alloc(512 << 20, &stream).unwrap();
    match pool.alloc(1 << 30, &stream) {
        Err(e @ Error::OutOfMemory { requested, limit, .. }) => {
            assert_eq!((requested, limit), (1 << 30, Some(1 << 30)));
            assert!(e.to_string().contains("maximum size"), "{e}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    drop(first);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn every_attribute_reads_and_the_newer_ones_fail_cleanly_on_older_drivers() {
    let stream = gpu_stream().expect("a GPU");
    let version = cumempool::driver_version().unwrap();
    let pool = MemPool::builder(Route::device(0)).max_size(1 << 30).build().unwrap();
    let buffer = pool.alloc(64 << 20, &stream).unwrap();
    stream.synchronize().unwrap();
    for (attribute, value) in pool.attributes() {
        if attribute.since() <= version {
            let value = value.unwrap_or_else(|e| panic!("{}: {e}", attribute.name()));
            eprintln!("{} = {value}", attribute.name());
        } else {
            match value {
                Err(e @ Error::DriverTooOld { needs, found, .. }) => {
                    assert_eq!((needs, found), (attribute.since(), version));
                    let text = e.to_string();
                    assert!(text.contains(attribute.name()) && text.contains(&needs.to_string()), "{text}");
                    eprintln!("{text}");
                }
                other => panic!("{} on driver {version}: expected DriverTooOld, got {other:?}", attribute.name()),
            }
        }
    }
    assert!(pool.used_mem_current().unwrap() >= 64 << 20);
    assert!(pool.reserved_mem_current().unwrap() >= pool.used_mem_current().unwrap());
    assert!(pool.used_mem_high().unwrap() >= 64 << 20);
    drop(buffer);
    stream.synchronize().unwrap();
    pool.reset_used_mem_high().unwrap();
    assert_eq!(pool.used_mem_high().unwrap(), 0);
    pool.trim_to(0).unwrap();
    pool.reset_reserved_mem_high().unwrap();
    assert_eq!(pool.reserved_mem_current().unwrap(), 0, "trimmed to nothing");
    for (get, set) in [
        (
            Pool::reuse_follow_event_dependencies as fn(&Pool) -> _,
            Pool::set_reuse_follow_event_dependencies as fn(&Pool, bool) -> _,
        ),
        (Pool::reuse_allow_opportunistic, Pool::set_reuse_allow_opportunistic),
        (Pool::reuse_allow_internal_dependencies, Pool::set_reuse_allow_internal_dependencies),
    ] {
        let before = get(&pool).unwrap();
        set(&pool, !before).unwrap();
        assert_eq!(get(&pool).unwrap(), !before);
    }
    pool.set_release_threshold(u64::MAX).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    #[cfg(feature = "cuda-13020")]
    if version >= cumempool::DriverVersion::CUDA_13_2 {
        assert_eq!(pool.max_pool_size().unwrap(), 1 << 30);
        assert_eq!(pool.location_attribute().unwrap(), Location::Device(0));
        assert_eq!(pool.allocation_type_attribute().unwrap(), cumempool::AllocationType::Pinned);
    } else {
        assert!(matches!(pool.max_pool_size(), Err(Error::DriverTooOld { .. })));
        assert!(matches!(pool.hw_decompress_enabled(), Err(Error::DriverTooOld { .. })));
        assert!(matches!(pool.export_handle_types(), Err(Error::DriverTooOld { .. })));
    }
    // location() and allocation_type() work on any driver for pools this process created.
    assert_eq!(pool.location().unwrap(), Location::Device(0));
    assert_eq!(pool.allocation_type().unwrap(), cumempool::AllocationType::Pinned);
    let expected = match () {
        () if cfg!(feature = "cuda-13040") => 15,
        () if cfg!(feature = "cuda-13020") => 14,
        () => 8,
    };
    assert_eq!(PoolAttribute::ALL.len(), expected);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn looking_up_a_default_pool_changes_none_of_its_attributes() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock(); // it reads the route's current pool
    let before: Vec<_> =
        default_pool(Route::device(0)).unwrap().attributes().into_iter().map(|(a, v)| (a, v.ok())).collect();
    let again = default_pool(Route::device(0)).unwrap();
    let _ = cumempool::current_pool(Route::device(0)).unwrap();
    for (attribute, value) in before {
        if matches!(attribute, PoolAttribute::ReleaseThreshold | PoolAttribute::ReuseAllowOpportunistic) {
            assert_eq!(again.attribute(attribute).ok(), value, "{} changed on lookup", attribute.name());
        }
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_pool_with_live_buffers_is_not_destroyed_early() {
    let stream = gpu_stream().expect("a GPU");
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(1 << 20, &stream).unwrap();
    let clone = pool.clone();
    match pool.destroy() {
        Err(Error::PoolInUse { holders }) => assert_eq!(holders, 2, "the clone and the buffer"),
        other => panic!("expected PoolInUse, got {other:?}"),
    }
    // The buffer still works; dropping the last handle leaves the buffer holding the pool.
    drop(clone);
    drop(buffer);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn access_of_the_owning_device_is_read_write_and_cannot_be_lowered() {
    let _gpu = gpu().expect("a GPU");
    let device = Device::get(0).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    assert_eq!(pool.access(device).unwrap(), Access::ReadWrite);
    assert_eq!(pool.access_from(Location::Host).unwrap(), Access::None);
    assert!(matches!(pool.set_access(device, Access::Read), Err(Error::AccessNotGrantable { .. })));
    pool.set_access(device, Access::ReadWrite).unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn sixteen_threads_allocate_and_free_on_one_pool() {
    let context = gpu().expect("a GPU");
    let pool = MemPool::new(Route::device(0)).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..16 {
            let (pool, context) = (&pool, &context);
            scope.spawn(move || {
                let stream = Stream::new(context).unwrap();
                for i in 0..2000usize {
                    let bytes = 256 << ((i + thread) % 13);
                    let mut buffer = pool.alloc(bytes, &stream).unwrap();
                    buffer.fill(thread as u8).unwrap();
                }
                stream.synchronize().unwrap();
            });
        }
    });
    assert_eq!(pool.used_mem_current().unwrap(), 0, "every allocation was freed");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn device_facts_are_readable() {
    let _gpu = gpu().expect("a GPU");
    let device = Device::get(0).unwrap();
    assert!(!device.name().unwrap().is_empty());
    assert!(device.supports_memory_pools().unwrap());
    assert!(device.supported_handle_types().unwrap().contains(HandleTypes::POSIX_FILE_DESCRIPTOR));
    eprintln!(
        "{}: host pools {}, host NUMA pools {}, NUMA id {:?}, handle types {}",
        device.name().unwrap(),
        device.supports_host_memory_pools().unwrap(),
        device.supports_host_numa_memory_pools().unwrap(),
        device.host_numa_id().unwrap(),
        device.supported_handle_types().unwrap()
    );
}

/// When the driver refuses an allocation, for a pool's maximum size or for the device's memory,
/// it gives back the unused reserved memory of every pool of the device, whatever their release
/// thresholds: a reservation made with `PoolBuilder::initial_size` is a head start, not a
/// guarantee (driver 580; docs/driver-behaviour.md).
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_refused_allocation_gives_back_every_pools_unused_reservation() {
    let stream = gpu_stream().expect("a GPU");
    let _reservations = reservations_lock();
    let kept = MemPool::builder(Route::device(0)).initial_size(64 << 20).build().unwrap();
    let before = kept.reserved_mem_current().unwrap();
    let capped = MemPool::builder(Route::device(0)).max_size(1 << 30).build().unwrap();
    let first = capped.alloc(512 << 20, &stream).unwrap();
    assert!(capped.alloc(1 << 30, &stream).is_err(), "over the maximum size");
    let after_cap = kept.reserved_mem_current().unwrap();
    drop(first);
    stream.synchronize().unwrap();
    // Reserve again, then have the device's memory refuse an allocation.
    let again = kept.alloc(64 << 20, &stream).unwrap();
    drop(again);
    stream.synchronize().unwrap();
    let reserved_again = kept.reserved_mem_current().unwrap();
    let total = Device::get(0).unwrap().total_memory().unwrap();
    let unbounded = MemPool::new(Route::device(0)).unwrap();
    assert!(unbounded.alloc(total + (1 << 30), &stream).is_err(), "more than the device has");
    let after_device = kept.reserved_mem_current().unwrap();
    eprintln!(
        "reserved by a pool with a 64 MiB initial size: {before} B at build, {after_cap} B after another pool's \
         maximum size refused an allocation; {reserved_again} B reserved again, {after_device} B after the \
         device's memory refused one"
    );
    assert!(before >= 64 << 20 && reserved_again >= 64 << 20);
    assert_eq!((after_cap, after_device), (0, 0), "the driver gave the unused reservation back");
    for pool in [kept, capped, unbounded] {
        pool.destroy().unwrap();
    }
}
