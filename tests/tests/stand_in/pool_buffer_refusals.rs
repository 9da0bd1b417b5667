//! What a pool and its buffers refuse, on a host without a GPU, through the stand-in libcuda of
//! `cumempool_tests::stand_in_driver` (whose pool allocations are heap blocks the host can
//! touch): a driver's success that hands out no memory, and host slices of memory another
//! process may map.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{default_pool, Error, HandleTypes, MemPool, PoolRef, Route, Stream};
use cumempool_tests::stand_in_driver::{set_switch, stand_in};

/// `cuMemAllocFromPoolAsync` answering success with address 0 for a non-zero size broke its
/// contract: a buffer at address 0 would be handed to copies and host slices as memory. Every
/// allocation path of a pool refuses it, typed, and the next allocation is served.
#[test]
fn a_successful_allocation_at_address_zero_is_refused() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::host()).unwrap();
    let stream = Stream::new(&context).unwrap();
    let paths: [(&str, &dyn Fn() -> cumempool::Result<u64>); 3] = [
        ("Pool::alloc", &|| pool.alloc(4096, &stream).map(|buffer| buffer.as_raw())),
        ("Pool::alloc_owned", &|| pool.alloc_owned(4096, &stream).map(|buffer| buffer.as_raw())),
        ("Pool::alloc_raw", &|| pool.alloc_raw(4096, &stream)),
    ];
    for (path, allocate) in paths {
        set_switch("null_next_alloc");
        match allocate() {
            Err(error @ Error::DriverGaveNullPointer { requested: 4096, .. }) => {
                let message = error.to_string();
                assert!(message.contains("cuMemAllocFromPoolAsync") && message.contains("4096"), "{path}: {message}");
            }
            other => panic!("{path}: a null allocation was answered {other:?}"),
        }
    }
    let served = pool.alloc(4096, &stream).unwrap();
    assert_ne!(served.as_raw(), 0);
}

/// A host NUMA pool built with `POSIX_FILE_DESCRIPTOR` can be exported at any moment, and an
/// importing process may then write its memory while the exporter holds a slice over it: a data
/// race, which the importing side already refuses. So the exporting side refuses host slices of
/// such a pool's buffers too (whether or not it was exported yet), and of a pool whose handle
/// types this process does not know; copies still work, and a pool without handle types (the
/// default pool included) still lends slices.
#[test]
fn host_memory_another_process_may_map_is_copied_not_sliced() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let route = Route::host_numa(0);
    let exportable = MemPool::builder(route).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    // SAFETY: the exportable pool outlives this handle and every buffer from it.
    let unknown = unsafe { PoolRef::from_raw(exportable.as_raw(), Some(route)) };
    for (what, pool, types) in [
        ("an exportable pool", &*exportable, Some(HandleTypes::POSIX_FILE_DESCRIPTOR)),
        ("a pool of unknown handle types", &*unknown, None),
    ] {
        let mut buffer = pool.alloc(4096, &stream).unwrap();
        match buffer.host_slice() {
            Err(error @ Error::ExportableMemoryNotSliceable { handle_types }) => {
                assert_eq!(handle_types, types, "{what}");
                let message = error.to_string();
                assert!(
                    message.contains("copy_to_host") && message.contains("without export handle types"),
                    "{what}: {message}"
                );
            }
            other => panic!("{what}: a slice over memory another process may write: {:?}", other.map(<[u8]>::len)),
        }
        assert!(matches!(buffer.host_slice_mut(), Err(Error::ExportableMemoryNotSliceable { .. })), "{what}");
        buffer.copy_from_host(&[7; 4096]).unwrap();
        buffer.copy_to_host(&mut [0; 4096]).unwrap();
    }
    for (what, pool) in [
        ("a pool without handle types", &*MemPool::new(route).unwrap()),
        ("the default pool", &*default_pool(route).unwrap()),
    ] {
        let mut buffer = pool.alloc(4096, &stream).unwrap();
        buffer.host_slice_mut().unwrap().fill(9);
        assert_eq!(buffer.host_slice().unwrap(), &[9; 4096][..], "{what}");
    }
}
