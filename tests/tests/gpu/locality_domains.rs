//! CUDA 13.4 on the real driver: locality domains (counts, routes, pools, the pool's and the
//! buffer's domain) and `cuMemGetLocationInfo`. On a driver older than 13.4 each must be the
//! typed `Error::DriverTooOld` naming what it needs; on 13.4 or newer, the driver's answers.
#![cfg(feature = "cuda-13040")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{default_pool, Device, DriverVersion, Error, InvalidArgumentReason, Location, MemPool, Route};
use cumempool_alloc::{ManagedMemory, PoolAllocator};
use cumempool_tests::{gpu, gpu_stream};

/// Whether the driver has 13.4; when not, `result` must be the typed error naming `needs`.
fn too_old_or<T: std::fmt::Debug>(what: &str, result: &cumempool::Result<T>) -> bool {
    let version = cumempool::driver_version().unwrap();
    if version >= DriverVersion::CUDA_13_4 {
        return true;
    }
    match result {
        Err(e @ Error::DriverTooOld { needs, found, .. }) => {
            assert_eq!((*needs, *found), (DriverVersion::CUDA_13_4, version), "{what}");
            assert!(e.to_string().contains("needs a CUDA 13.4 driver"), "{e}");
            eprintln!("{what}: {e}");
        }
        other => panic!("{what} on driver {version}: expected DriverTooOld (needs 13.4), got {other:?}"),
    }
    false
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn device_domain_counts_need_13_4() {
    let _gpu = gpu().expect("a GPU");
    let device = Device::get(0).unwrap();
    let count = device.locality_domain_count();
    if too_old_or("LOCALITY_DOMAIN_COUNT", &count) {
        let count = count.unwrap();
        assert!(count >= 1, "a device has at least one domain");
        assert!(device.locality_domain_multiprocessor_count().unwrap() >= 1);
        let beyond = u8::try_from(count).unwrap();
        match device.locality_domain(beyond) {
            Err(Error::InvalidLocalityDomain { domain, count: c, .. }) => assert_eq!((domain, c), (beyond, count)),
            other => panic!("domain {beyond} of {count}: expected InvalidLocalityDomain, got {other:?}"),
        }
        assert_eq!(device.locality_domain(0).unwrap(), Location::DeviceLocalityDomain { device: 0, domain: 0 });
    } else {
        too_old_or("LOCALITY_DOMAIN_MULTIPROCESSOR_COUNT", &device.locality_domain_multiprocessor_count());
        too_old_or("Device::locality_domain", &device.locality_domain(0));
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn domain_routes_and_pools_need_13_4() {
    let stream = gpu_stream().expect("a GPU");
    let route = Route::locality_domain(0, 0);
    too_old_or("default_pool(domain 0 of device 0)", &default_pool(route).map(|p| p.as_raw()));
    let created = MemPool::new(route);
    if too_old_or("MemPool::new(domain 0 of device 0)", &created) {
        let pool = created.unwrap();
        let buffer = pool.alloc(1 << 20, &stream).unwrap();
        let domains = Device::get(0).unwrap().locality_domain_count().unwrap();
        if domains == 1 {
            // cuda.h: domain 0 of a one-domain device is the whole device.
            assert_eq!(pool.location_attribute().unwrap(), Location::Device(0));
            assert_eq!(pool.locality_domain_id().unwrap(), None);
        } else {
            assert_eq!(pool.location_attribute().unwrap(), Location::DeviceLocalityDomain { device: 0, domain: 0 });
            assert_eq!(pool.locality_domain_id().unwrap(), Some(0));
            assert_eq!(buffer.locality_domain().unwrap(), Some(0));
        }
    }
    // The device's own pool is in no domain; on an older driver both reads are the typed error.
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(1 << 20, &stream).unwrap();
    let id = pool.locality_domain_id();
    if too_old_or("CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID", &id) {
        assert_eq!(id.unwrap(), None);
    }
    let ordinal = buffer.locality_domain();
    if too_old_or("CU_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL", &ordinal) {
        assert_eq!(ordinal.unwrap(), None);
    }
    // Managed memory cannot use a domain, on any driver: refused before the driver.
    let managed = MemPool::new(Route::managed(Location::DeviceLocalityDomain { device: 0, domain: 0 }));
    assert!(matches!(managed, Err(Error::InvalidRoute(_))), "{managed:?}");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn location_info_checks_granularities_first_and_needs_13_4() {
    let stream = gpu_stream().expect("a GPU");
    let pool = MemPool::new(Route::managed(Location::Device(0))).unwrap();
    let mut buffer = pool.alloc(4 << 20, &stream).unwrap();
    buffer.fill(1).unwrap();
    // cuda.h's rules, on any driver, before the driver is asked.
    for (summary, sampling) in [(0, 0), (8 << 20, 0), (1 << 20, 2 << 20)] {
        let refused = buffer.location_info(summary, sampling);
        assert!(matches!(refused, Err(Error::InvalidGranularity { .. })), "({summary}, {sampling}): {refused:?}");
    }
    let regions = buffer.location_info(1 << 20, 0);
    if too_old_or("cuMemGetLocationInfo", &regions) {
        let regions = regions.unwrap();
        assert_eq!(regions.len(), 4);
        assert!(regions.iter().all(|l| *l == Location::Device(0)), "filled on device 0: {regions:?}");
    } else {
        let text = regions.unwrap_err().to_string();
        assert!(text.starts_with("cuMemGetLocationInfo needs a CUDA 13.4 driver"), "{text}");
    }
    // Pinned memory has no residency to report.
    let device_pool = MemPool::new(Route::device(0)).unwrap();
    let pinned = device_pool.alloc(4096, &stream).unwrap();
    let refused = pinned.location_info(4096, 0);
    assert!(
        matches!(refused, Err(Error::InvalidArgument { reason: InvalidArgumentReason::NotManagedMemory { .. }, .. })),
        "{refused:?}"
    );
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn managed_container_memory_reports_its_location_or_needs_13_4() {
    let context = gpu().expect("a GPU");
    let pool = MemPool::new(Route::managed(Location::Host)).unwrap();
    let allocator = PoolAllocator::<ManagedMemory>::new(&pool, &context).unwrap();
    let mut v = allocator_api2::vec::Vec::with_capacity_in(1 << 20, allocator.clone());
    v.resize(1 << 20, 7u8);
    let regions = allocator.location_info(&v, 1 << 20, 0).map_err(|e| match e {
        cumempool_alloc::Error::Pool(e) => e,
        other => panic!("{other}"),
    });
    if too_old_or("PoolAllocator::location_info", &regions) {
        assert_eq!(regions.unwrap().len(), 1);
    }
    assert!(allocator.location_info(&v, 0, 0).is_err(), "a zero summary granularity is refused");
}
