//! A route is checked once per public routing call, and the driver calls below it take the
//! checked form: counted through the fault-injecting driver (`cumempool-fault`), which this
//! process loads instead of libcuda and which counts every entry point's calls (the fault suite's
//! fixture, `crate::suite`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::suite;
use cumempool::{current_pool, is_default, reset_current_pool, set_current_pool, MemPool, Route};

#[test]
#[ignore = "requires a CUDA GPU"]
fn routing_calls_check_their_route_without_asking_the_driver_for_the_device_again() {
    let Some((_lock, suite)) = suite() else { return };
    let faults = &suite.faults;
    let route = Route::device(0);
    let pool = MemPool::new(route).unwrap();

    faults.reset_counts();
    let guard = set_current_pool(route, &pool).unwrap();
    assert_eq!(faults.calls("cuMemGetMemPool"), 1, "the route's current pool, asked once");
    assert_eq!(faults.calls("cuMemGetDefaultMemPool"), 1, "the route's default pool, asked once");
    assert_eq!(faults.calls("cuMemSetMemPool"), 1);
    assert!(!is_default(route).unwrap());
    assert_eq!(current_pool(route).unwrap().as_raw(), pool.as_raw());
    guard.restore().unwrap();
    reset_current_pool(route).unwrap();
    // The device count is known from init on; a valid ordinal needs no cuDeviceGet to check.
    assert_eq!(faults.calls("cuDeviceGet"), 0, "routes were checked through cuDeviceGet");
}
