//! Adversarial review of capture and teardown with cudarc (feature `cudarc`): a capture cudarc
//! begins from safe code on a stream cumempool borrowed. Each test here fails on the code it was
//! written against; its doc comment says what goes wrong and what a fix should do.
#![cfg(feature = "cudarc")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaContext;
use cumempool::{Error, MemPool, Route, Stream};
use cumempool_tests::gpu;

const MIB: usize = 1 << 20;

/// Safe code only. A buffer dropped while cudarc captures its stream has its free deferred to
/// the `Stream` value's list, which runs once a capture-aware operation finds the capture over.
/// If the last clone of that `Stream` (from `Stream::from_cudarc`) drops before cudarc ends the
/// capture, `StreamInner::drop` finds the stream still capturing and `mem::forget`s the deferred
/// frees: the memory is never freed, and each forgotten free holds an `Arc` of the pool's owner,
/// so the pool is never destroyed either (`MemPool::destroy` answers `PoolInUse` for good).
/// Nothing about this order is unusual: the cumempool handle is a temporary of the code that
/// allocated, while cudarc's stream lives on.
///
/// Fix: a borrowed stream dropped mid-capture hands its deferred frees (with its keep-alive and
/// context) to a process-wide list keyed by raw stream and context, run by the next
/// capture-aware operation on any `Stream` of that handle once it no longer captures (and by a
/// public sweep for programs that never touch the stream again), instead of forgetting them.
/// Sure to fail (read from `StreamInner::drop`).
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_cudarc_stream_dropped_during_cudarcs_capture_still_frees_the_buffers_dropped_in_it() {
    gpu().expect("a GPU");
    let cudarc_context = CudaContext::new(0).unwrap();
    let cudarc_stream = cudarc_context.new_stream().unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let stream = Stream::from_cudarc(&cudarc_stream).unwrap();
    let buffer = pool.alloc(MIB, &stream).unwrap();
    stream.synchronize().unwrap();
    cudarc_stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    drop(buffer); // deferred: its stream captures
    drop(stream); // cumempool's last handle; cudarc's stream lives on
    let graph = cudarc_stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    drop(graph.unwrap());
    // The capture is over: the next capture-aware operation on the stream may run the free.
    let again = Stream::from_cudarc(&cudarc_stream).unwrap();
    again.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the buffer dropped during cudarc's capture was never freed");
    let destroyed = pool.destroy();
    assert!(
        !matches!(destroyed, Err(Error::PoolInUse { .. })),
        "a forgotten deferred free keeps the pool alive for good: {destroyed:?}"
    );
}
