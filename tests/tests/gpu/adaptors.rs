//! The leak-hunting and out-of-memory adaptors on the real driver, over a capped device pool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{MemPool, Route, Stream};
use cumempool_alloc::{DeviceMemory, OnOutOfMemory, PoolResource, StreamOrderedResource, Tracking};
use cumempool_tests::{gpu, reservations_lock};
use std::sync::Mutex;

const MIB: usize = 1 << 20;

#[test]
#[ignore = "requires a CUDA GPU"]
fn tracking_names_the_leaked_device_allocation_and_its_stream() {
    let context = gpu().expect("a GPU");
    let (a, b) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let tracker = Tracking::new(PoolResource::<DeviceMemory>::new(&pool).unwrap()).with_backtraces(true);
    let freed = tracker.alloc(MIB, &a).unwrap();
    let leaked = tracker.allocate(3 * MIB, 256, &b).unwrap();
    drop(freed);
    let out = tracker.outstanding();
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].ptr, out[0].bytes, out[0].stream), (leaked, 3 * MIB, b.id()));
    // Captured, whatever RUST_BACKTRACE says; its frames are named only where the binary has
    // symbols (the GPU pack's are stripped), so the name is not asserted here.
    let backtrace = out[0].backtrace.as_ref().expect("with_backtraces(true) captures one");
    assert_eq!(backtrace.status(), std::backtrace::BacktraceStatus::Captured);
    assert!(tracker.report().contains(&format!("{leaked:#x}: {} bytes on stream {}", 3 * MIB, b.id().get())));
    b.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 3 * MIB as u64, "the pool agrees on what is out");
    // SAFETY: `leaked` was allocated above with these arguments, freed once.
    unsafe { tracker.deallocate(leaked, 3 * MIB, 256, &b) }.unwrap();
    b.synchronize().unwrap();
    assert!(tracker.outstanding().is_empty());
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn on_out_of_memory_frees_held_device_memory_and_the_retry_succeeds() {
    let context = gpu().expect("a GPU");
    let _reservations = reservations_lock(); // its allocations are refused
    let stream = Stream::new(&context).unwrap();
    // The driver rounds the maximum up to 32 MiB steps on the H200; 64 MiB is one.
    let pool = MemPool::builder(Route::device(0)).max_size(64 << 20).build().unwrap();
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let held = Mutex::new(Some(resource.allocate(48 * MIB, 256, &stream).unwrap()));
    let attempts = Mutex::new(Vec::new());
    let retrying = OnOutOfMemory::new(&resource, |requested, attempt| {
        attempts.lock().unwrap().push((requested, attempt));
        let Some(ptr) = held.lock().unwrap().take() else { return false };
        // Freed in stream order, and waited for, so the pool has the room when retried.
        // SAFETY: the block taken out of `held`, allocated with these arguments; taken once, so freed once.
        unsafe { resource.deallocate(ptr, 48 * MIB, 256, &stream) }.unwrap();
        stream.synchronize().unwrap();
        true
    });
    let block = retrying.alloc(48 * MIB, &stream).expect("the callback freed room, and the retry fits");
    assert_eq!(*attempts.lock().unwrap(), [(48 * MIB, 1)]);
    let refused = retrying.allocate(48 * MIB, 256, &stream).unwrap_err();
    assert!(refused.is_out_of_memory(), "{refused}");
    assert_eq!(attempts.lock().unwrap().len(), 2, "asked again, and it said no");
    drop(block);
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}
