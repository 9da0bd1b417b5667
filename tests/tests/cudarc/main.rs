//! Its own process: cudarc's first stream on a context waits for the whole context.
//!
//! cudarc interop on the real driver: cudarc's own allocations land in a cumempool pool routed
//! for the device, a max-size pool caps them with a clean out-of-memory error, and streams and
//! contexts convert between the two libraries; and captures cudarc begins (`cudarc_capture`).
//!
//! `CudaContext::new_stream` runs `cuCtxSynchronize` for the first stream of a `CudaContext`,
//! which fails and invalidates every capture in that context, on any thread
//! (docs/driver-behaviour.md): the tests that make one on device 0's primary context, and those
//! that capture there, hold `context_wait_lock`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cudarc_capture;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cumempool::{set_current_pool, Context, MemPool, Route, Stream};
use cumempool_tests::{context_wait_lock, gpu, routing_lock};
use std::sync::Arc;

const MIB: usize = 1 << 20;

/// An ordinary cudarc program's allocation: nothing in it knows about cumempool.
fn cudarc_program(stream: &Arc<CudaStream>, bytes: usize) -> Result<CudaSlice<u8>, DriverError> {
    stream.alloc_zeros::<u8>(bytes)
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn cudarc_allocations_land_in_the_routed_pool_and_its_maximum_caps_them() {
    gpu().expect("a GPU");
    let _lock = routing_lock();
    let _context_waits = context_wait_lock(); // its first stream waits for the primary context
    let context = CudaContext::new(0).unwrap();
    let stream = context.new_stream().unwrap();
    // The driver rounds the maximum up to 32 MiB steps on the H200; 64 MiB is two.
    let pool = MemPool::builder(Route::device(0)).max_size(64 << 20).build().unwrap();
    let guard = set_current_pool(Route::device(0), &pool).unwrap();

    let first = cudarc_program(&stream, 40 * MIB).unwrap();
    stream.synchronize().unwrap();
    let used = pool.used_mem_current().unwrap();
    eprintln!("after cudarc's 40 MiB: the pool's used memory is {used} bytes");
    assert!(used >= 40 * MIB as u64, "cudarc's allocation came from the routed pool ({used} bytes used)");

    let refused = cudarc_program(&stream, 40 * MIB).unwrap_err();
    eprintln!("cudarc's second 40 MiB: {refused:?}");
    assert_eq!(refused.0, cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "a clean out-of-memory");
    assert!(context.check_err().is_ok(), "the refusal left no error behind in cudarc's context");

    drop(first);
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "cudarc freed into the pool on its stream");
    let fits = cudarc_program(&stream, 40 * MIB).expect("after the free, the pool has room again");
    drop(fits);
    stream.synchronize().unwrap();

    guard.restore().unwrap();
    let elsewhere = cudarc_program(&stream, 40 * MIB).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "once the route is restored, cudarc allocates elsewhere");
    drop(elsewhere);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_cudarc_stream_serves_cumempool_and_stays_alive_as_long_as_needed() {
    gpu().expect("a GPU");
    let _context_waits = context_wait_lock(); // its first stream waits for the primary context
    let cudarc_context = CudaContext::new(0).unwrap();
    let cudarc_stream = cudarc_context.new_stream().unwrap();
    let raw = cudarc_stream.cu_stream() as usize;
    let stream = Stream::from_cudarc(&cudarc_stream).unwrap();
    let again = Stream::from_cudarc(&cudarc_stream).unwrap();
    assert_eq!(stream.as_raw() as usize, raw);
    assert_ne!(stream.id(), again.id(), "each Stream has its own identity");
    let context = stream.context().expect("a primary context comes along");
    assert_eq!(context.as_raw() as usize, cudarc_context.cu_ctx() as usize, "the same primary context");
    drop((again, cudarc_stream, cudarc_context));
    // cudarc's handles are gone here; the Stream keeps cudarc's stream (and context) alive.
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc_owned(MIB, &stream).unwrap();
    buffer.fill(7).unwrap();
    let mut back = vec![0u8; MIB];
    buffer.copy_to_host(&mut back).unwrap();
    assert!(back.iter().all(|b| *b == 7));
    drop(buffer);
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn contexts_convert_both_ways_and_streams_go_to_cudarc_unsafely() {
    let context: Context = gpu().expect("a GPU");
    // cudarc allocates through device 0's route, which another test of this file routes.
    let _lock = routing_lock();
    let cudarc_context = context.to_cudarc().unwrap();
    assert!(cudarc_context.is_primary());
    assert_eq!(cudarc_context.cu_ctx() as usize, context.as_raw() as usize);
    let back = Context::from_cudarc(&cudarc_context).unwrap();
    assert_eq!(back.as_raw(), context.as_raw());

    let stream = Stream::new(&context).unwrap();
    // SAFETY: `stream` outlives the cudarc stream and the slice allocated on it (dropped below).
    let as_cudarc = unsafe { stream.to_cudarc() }.unwrap();
    assert_eq!(as_cudarc.cu_stream() as usize, stream.as_raw() as usize);
    let slice = as_cudarc.clone_htod(&[1u32, 2, 3]).unwrap();
    assert_eq!(as_cudarc.clone_dtoh(&slice).unwrap(), [1, 2, 3]);
    drop((slice, as_cudarc));

    let legacy = Stream::from_cudarc(&cudarc_context.default_stream()).unwrap();
    assert!(legacy.as_raw().is_null() && legacy.context().is_some());
    legacy.synchronize().unwrap();
    let refused = Stream::from_cudarc(&cudarc_context.per_thread_stream()).unwrap_err();
    assert!(refused.to_string().contains("CU_STREAM_PER_THREAD"), "{refused}");
}
