//! Its own process: it counts the retired pools, which any pool built in the process may take back.
//!
//! Teardown other threads survive: pools that were ever a route's current pool are
//! retired, not destroyed, so threads of other libraries allocating through the route at that
//! moment never find their pool gone; `destroy_retired_pools` destroys them when the program says.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{CUdeviceptr, CUresult};
use cumempool::{destroy_retired_pools, retired_pools, set_current_pool, Location, MemPool, PoolRef, Route, Stream};
use cumempool_tests::{gpu, routing_lock};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Set in the child processes of the stress test.
const CHILD_ENV: &str = "CUMEMPOOL_TEARDOWN_CHILD";
/// The routes the teardown threads change: device pinned, host pinned, device managed.
const ROUTES: [Route; 3] = [Route::device(0), Route::host(), Route::managed(Location::Device(0))];
/// How long the routing threads of one run change routes, at most.
const ROUTING_FOR: Duration = Duration::from_millis(800);

/// A raw `cuMemAllocAsync` of `bytes` on `stream`: what PyTorch, CuPy and cudarc call, drawing
/// from the current pool of the stream's device.
fn raw_alloc(bytes: usize, stream: &Stream) -> Result<CUdeviceptr, CUresult> {
    let alloc = cumempool::sys::driver().unwrap().cuMemAllocAsync().unwrap();
    let mut ptr: CUdeviceptr = 0;
    // SAFETY: a valid out-pointer and a live stream.
    let code = unsafe { alloc(&mut ptr, bytes, stream.as_raw()) };
    if code == CUresult::CUDA_SUCCESS {
        Ok(ptr)
    } else {
        Err(code)
    }
}

fn raw_free(ptr: CUdeviceptr, stream: &Stream) {
    let free = cumempool::sys::driver().unwrap().cuMemFreeAsync().unwrap();
    // SAFETY: an allocation of `raw_alloc` on this stream, freed once.
    assert_eq!(unsafe { free(ptr, stream.as_raw()) }, CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_retired_pool_is_not_destroyed_by_drop_and_is_by_destroy_retired_pools() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let stream = Stream::new(&context).unwrap();
    // SAFETY: this test holds the routing lock and no other thread allocates through a route.
    unsafe { destroy_retired_pools() }.unwrap();
    let route = Route::device(0);

    let pool = MemPool::new(route).unwrap();
    let raw = pool.as_raw();
    let guard = set_current_pool(route, &pool).unwrap();
    // Another library's allocation through the route, made while the pool was current.
    let foreign = raw_alloc(1 << 20, &stream).unwrap();
    drop(guard);
    pool.destroy().unwrap();
    let retired = retired_pools().unwrap();
    assert_eq!(retired.count, 1, "retired, not destroyed");
    assert!(retired.used_bytes >= 1 << 20, "the other library's allocation is still there: {retired:?}");
    // SAFETY: the retired pool is alive until destroy_retired_pools below.
    let still = unsafe { PoolRef::from_raw(raw, Some(route)) };
    assert!(still.used_mem_current().unwrap() >= 1 << 20, "the pool is alive and keeps the allocation");
    raw_free(foreign, &stream);
    stream.synchronize().unwrap();
    assert_eq!(retired_pools().unwrap().used_bytes, 0);

    // A pool never routed is destroyed as before.
    drop(MemPool::new(route).unwrap());
    assert_eq!(retired_pools().unwrap().count, 1, "only the routed pool is retired");

    // SAFETY: no thread allocates through a route, and the retired pool's allocation was freed.
    assert_eq!(unsafe { destroy_retired_pools() }.unwrap(), 1);
    assert_eq!(retired_pools().unwrap().count, 0);
    assert!(cumempool::is_default(route).unwrap());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_retired_pool_serves_the_next_pool_made_the_same_way_with_fresh_state() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let stream = Stream::new(&context).unwrap();
    let route = Route::device(0);
    let pool = MemPool::builder(route).max_size(64 << 20).build().unwrap();
    let raw = pool.as_raw();
    pool.set_release_threshold(u64::MAX).unwrap();
    drop(pool.alloc(1 << 20, &stream).unwrap());
    stream.synchronize().unwrap();
    drop(set_current_pool(route, &pool).unwrap());
    drop(pool);
    assert_eq!(retired_pools().unwrap().count, 1);

    let other = MemPool::builder(route).max_size(128 << 20).build().unwrap();
    assert_ne!(other.as_raw(), raw, "another recipe never takes it");
    let again = MemPool::builder(route).max_size(64 << 20).build().unwrap();
    assert_eq!(again.as_raw(), raw, "the retired pool is made anew");
    assert_eq!(retired_pools().unwrap().count, 0);
    assert_eq!(again.release_threshold().unwrap(), 0, "the driver's default threshold again");
    assert_eq!(again.used_mem_high().unwrap(), 0, "fresh high-water marks");
    assert!(again.reuse_allow_opportunistic().unwrap());
    drop(again.alloc(1 << 20, &stream).unwrap());
    stream.synchronize().unwrap();
    drop(again);
    assert_eq!(retired_pools().unwrap().count, 1, "still ever current: retired again, not destroyed");
    drop(other);
    // SAFETY: no thread allocates through a route; nothing from the retired pool is in use.
    assert_eq!(unsafe { destroy_retired_pools() }.unwrap(), 1);
}

/// One run of the shape, in this process: 8 threads set and drop guards on three
/// routes and drop their pools after their own guards, beside 4 threads making raw
/// `cuMemAllocAsync`/`cuMemFreeAsync` pairs on device 0. Returns (pools made, raw pairs made).
fn teardown_shape() -> (u64, u64) {
    let context = gpu().expect("a GPU");
    let stop = Arc::new(AtomicBool::new(false));
    let pairs = Arc::new(AtomicU64::new(0));
    let allocators: Vec<_> = (0..4)
        .map(|_| {
            let stream = Stream::new(&context).unwrap();
            let (stop, pairs) = (stop.clone(), pairs.clone());
            // No context is made current on these threads: the stream names its own.
            std::thread::spawn(move || {
                let mut made = 0u64;
                while !stop.load(Relaxed) {
                    match raw_alloc(4096, &stream) {
                        Ok(ptr) => raw_free(ptr, &stream),
                        Err(CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {}
                        Err(code) => panic!("cuMemAllocAsync answered {code:?}"),
                    }
                    made += 1;
                    if made.is_multiple_of(1024) {
                        stream.synchronize().unwrap();
                    }
                }
                stream.synchronize().unwrap();
                pairs.fetch_add(made, Relaxed);
            })
        })
        .collect();
    let deadline = Instant::now() + ROUTING_FOR;
    let routers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut pools = 0u64;
                for _ in 0..200 {
                    if Instant::now() > deadline {
                        break;
                    }
                    for route in ROUTES {
                        let pool = MemPool::new(route).unwrap();
                        let guard = set_current_pool(route, &pool).unwrap();
                        drop(guard);
                        drop(pool); // after its own guard: the last holder lets go here
                        pools += 1;
                    }
                }
                pools
            })
        })
        .collect();
    let pools: u64 = routers.into_iter().map(|t| t.join().unwrap()).sum();
    stop.store(true, Relaxed);
    for allocator in allocators {
        allocator.join().unwrap();
    }
    (pools, pairs.load(Relaxed))
}

/// The child side of the stress test; does nothing unless started by it.
#[test]
#[ignore = "requires a CUDA GPU"]
fn teardown_shape_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let (pools, pairs) = teardown_shape();
    assert!(pairs > 0, "the raw allocating threads ran");
    for route in ROUTES {
        assert!(cumempool::is_default(route).unwrap(), "{route} is back on its default pool");
    }
    let retired = retired_pools().unwrap();
    assert!(retired.count >= 1 && retired.count as u64 <= pools, "{} retired of {pools}", retired.count);
    assert!(
        pools < 100 || (retired.count as u64) < pools / 2,
        "retired pools serve new ones: {} retired for {pools} pools made",
        retired.count
    );
    // SAFETY: every thread of the run has stopped; their raw allocations were freed.
    assert_eq!(unsafe { destroy_retired_pools() }.unwrap(), retired.count);
    eprintln!("teardown shape: {pools} pools made from {} driver pools, retired and destroyed after the run, {pairs} raw pairs", retired.count);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn foreign_threads_allocating_through_a_route_survive_pool_teardown_in_20_fresh_processes() {
    let _gpu = gpu().expect("a GPU");
    let exe = std::env::current_exe().unwrap();
    let mut crashes = 0;
    for run in 1..=20 {
        let started = Instant::now();
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "teardown_shape_child", "--include-ignored", "--nocapture"])
            .env(CHILD_ENV, "1")
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if started.elapsed() > Duration::from_secs(60) {
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let took = started.elapsed();
        let verdict = match status {
            Some(status) if status.success() => "ok".to_owned(),
            Some(status) => {
                use std::os::unix::process::ExitStatusExt;
                crashes += 1;
                match status.signal() {
                    Some(signal) => format!("CRASHED (signal {signal})"),
                    None => format!("FAILED ({status})"),
                }
            }
            None => {
                crashes += 1;
                "HUNG (killed after 60 s)".to_owned()
            }
        };
        eprintln!("run {run:2}/20: {verdict} in {took:.2?}");
    }
    assert_eq!(crashes, 0, "{crashes} of 20 runs crashed, failed or hung");
}
