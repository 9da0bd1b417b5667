//! A program's own route table (`cumempool::route_table`): what it routed, in the shape of
//! `cumempool routes --json`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{route_table, set_current_pool, MemPool, Route};
use cumempool_tests::{gpu, routing_lock};

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_route_table_shows_what_this_process_routed() {
    let _gpu = gpu().expect("a GPU");
    let _lock = routing_lock();
    let before = route_table().unwrap();
    let device = Route::device(0).to_string();
    let entry = |table: &cumempool::RouteTable| table.routes.iter().find(|e| e.route == device).cloned().unwrap();
    assert!(!entry(&before).changed, "device 0 starts on its default pool");
    assert!(before.routes.iter().any(|e| e.route == Route::host().to_string()));

    let pool = MemPool::builder(Route::device(0)).max_size(64 << 20).build().unwrap();
    let guard = set_current_pool(Route::device(0), &pool).unwrap();
    let during = route_table().unwrap();
    let routed = entry(&during);
    assert!(routed.changed, "{routed:?}");
    assert_eq!(routed.current_pool, Some(format!("{:?}", pool.as_raw())));
    assert!(routed.attributes.contains_key("USED_MEM_CURRENT"), "{routed:?}");
    let shown = during.to_string();
    assert!(shown.lines().any(|l| l.starts_with(&device) && l.contains("(changed)")), "{shown}");
    drop(guard);
    assert!(!entry(&route_table().unwrap()).changed, "restored");
}
