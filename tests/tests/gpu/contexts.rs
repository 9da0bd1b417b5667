//! The current context is the driver's, not the library's guess: code outside the library (the
//! runtime's `cudaSetDevice`, a push or pop) may change it at any time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys;
use cumempool::{MemPool, Route, Stream};
use cumempool_tests::gpu;

fn raw_current() -> sys::CUcontext {
    let mut current = std::ptr::null_mut();
    let get = sys::driver().unwrap().cuCtxGetCurrent().unwrap();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { get(&mut current) }, sys::CUresult::CUDA_SUCCESS);
    current
}

fn raw_set_current(context: sys::CUcontext) {
    let set = sys::driver().unwrap().cuCtxSetCurrent().unwrap();
    // SAFETY: null (no context) or a live context.
    assert_eq!(unsafe { set(context) }, sys::CUresult::CUDA_SUCCESS);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_context_unset_behind_the_library_is_made_current_again() {
    let context = gpu().expect("a GPU");
    let first = Stream::new(&context).unwrap();
    assert_eq!(raw_current(), context.as_raw());
    raw_set_current(std::ptr::null_mut()); // other code pops the context
                                           // Before the fix the library believed its own thread-local, so cuStreamCreate ran with no
                                           // current context.
    let second = Stream::new(&context).unwrap();
    assert_eq!(raw_current(), context.as_raw());
    raw_set_current(std::ptr::null_mut());
    let (free, total) = context.memory_info().unwrap();
    assert!(free > 0 && free <= total);
    raw_set_current(std::ptr::null_mut());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(4096, &second).unwrap();
    drop(buffer);
    second.synchronize().unwrap();
    first.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_buffer_on_the_legacy_stream_is_freed_in_its_own_context_from_any_thread() {
    let context = gpu().expect("a GPU");
    let legacy = Stream::legacy(&context);
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(1 << 20, &legacy).unwrap();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert!(raw_current().is_null(), "a fresh thread has no current context");
            drop(buffer); // the free binds the allocation's context first
            assert_eq!(raw_current(), context.as_raw());
        });
    });
    legacy.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

/// What the driver does with stream-ordered calls when the stream's context is not current:
/// the reason ordinary streams need no context binding on the hot path (measured, not assumed).
#[test]
#[ignore = "requires a CUDA GPU"]
fn stream_ordered_calls_run_in_the_streams_own_context() {
    let context = gpu().expect("a GPU");
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let other = (cumempool::Device::count().unwrap() > 1)
        .then(|| cumempool::Device::get(1).unwrap().primary_context().unwrap());
    let driver = sys::driver().unwrap();
    let (alloc, free) = (driver.cuMemAllocFromPoolAsync().unwrap(), driver.cuMemFreeAsync().unwrap());
    let (sync, query) = (driver.cuStreamSynchronize().unwrap(), driver.cuStreamQuery().unwrap());
    let memset = driver.cuMemsetD8Async().unwrap();
    for (label, current) in [
        ("no context", std::ptr::null_mut()),
        ("another device's context", other.as_ref().map_or(std::ptr::null_mut(), |c| c.as_raw())),
    ] {
        raw_set_current(current);
        let mut ptr = 0;
        // SAFETY: a live pool and stream; `ptr` is the allocation made first, set then freed once in stream order.
        let codes = unsafe {
            [
                alloc(&mut ptr, 1 << 20, pool.as_raw(), stream.as_raw()),
                memset(ptr, 7, 1 << 20, stream.as_raw()),
                free(ptr, stream.as_raw()),
                query(stream.as_raw()),
                sync(stream.as_raw()),
            ]
        };
        eprintln!("with {label} current: alloc, memset, free, query, synchronize -> {codes:?}");
        let fine = |c: &sys::CUresult| *c == sys::CUresult::CUDA_SUCCESS || *c == sys::CUresult::CUDA_ERROR_NOT_READY;
        assert!(codes.iter().all(fine), "{label}: {codes:?}");
        assert_eq!(raw_current(), current, "the driver did not change the current context");
    }
    raw_set_current(context.as_raw());
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

/// `bind` does not set the context for ordinary streams, yet a host copy from a thread with no
/// current context would crash inside libcuda (driver 580), and one with another device's
/// context current would be refused: copies make the stream's context current.
#[test]
#[ignore = "requires a CUDA GPU"]
fn copies_work_from_a_thread_without_the_streams_context() {
    let context = gpu().expect("a GPU");
    let stream = Stream::new(&context).unwrap();
    for route in [Route::host(), Route::device(0)] {
        let pool = MemPool::new(route).unwrap();
        let mut buffer = pool.alloc(4096, &stream).unwrap();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                assert!(raw_current().is_null(), "a fresh thread has no current context");
                buffer.copy_from_host(&[7; 4096]).unwrap();
                let mut back = [0u8; 4096];
                buffer.copy_to_host(&mut back).unwrap();
                assert!(back.iter().all(|b| *b == 7), "{route}");
            });
        });
        let other = cumempool::Device::count().unwrap() > 1;
        if other {
            let context1 = cumempool::Device::get(1).unwrap().primary_context().unwrap();
            raw_set_current(context1.as_raw());
            buffer.copy_from_host(&[9; 4096]).unwrap();
            let mut back = [0u8; 4096];
            buffer.copy_to_host(&mut back).unwrap();
            assert!(back.iter().all(|b| *b == 9), "{route}, with device 1's context current");
        }
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn is_current_reads_the_drivers_current_context() {
    let context = gpu().expect("a GPU");
    context.make_current().unwrap();
    assert!(context.is_current().unwrap());
    raw_set_current(std::ptr::null_mut()); // other code pops the context
    assert!(!context.is_current().unwrap());
    context.make_current().unwrap();
    assert!(context.is_current().unwrap());
}
