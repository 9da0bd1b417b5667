//! What a pool and its buffers refuse, on a host without a GPU, through the stand-in libcuda of
//! `cumempool_tests::stand_in_driver` (whose pool allocations are heap blocks the host can
//! touch): a driver's success that hands out no memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Error, MemPool, Route, Stream};
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
