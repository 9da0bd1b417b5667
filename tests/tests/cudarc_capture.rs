//! A capture cudarc begins from safe code on a stream cumempool borrowed (feature `cudarc`).
#![cfg(feature = "cudarc")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaContext;
use cumempool::{Error, MemPool, Route, Stream};
use cumempool_tests::gpu;

const MIB: usize = 1 << 20;

/// Safe code only. A buffer dropped while cudarc captures its stream has its free deferred to
/// the `Stream` value's list, which runs once a capture-aware operation finds the capture over.
/// The last clone of that `Stream` (from `Stream::from_cudarc`) may drop before cudarc ends the
/// capture: nothing about this order is unusual, as the cumempool handle is a temporary of the
/// code that allocated, while cudarc's stream lives on. Its deferred frees must not be forgotten
/// then (the memory would never be freed, and each forgotten free holds an `Arc` of the pool's
/// owner, so `MemPool::destroy` would answer `PoolInUse` for good): they run at the next
/// capture-aware operation on any `Stream` of that handle once it no longer captures.
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
