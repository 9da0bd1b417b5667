//! A capture cudarc begins from safe code on a stream cumempool borrowed (feature `cudarc`).
#![cfg(feature = "cudarc")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaContext;
use cumempool::{Error, MemPool, Route, Stream};
use cumempool_tests::{context_wait_lock, gpu};

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
    let _context_waits = context_wait_lock(); // its first stream waits for the primary context
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

/// Safe code only. A copy into a buffer on a stream of a non-primary cudarc context (no context
/// cumempool knows, so the source's stream is ordered after the copy with a host wait), asked
/// inside another stream's capture closure, where host waits are refused: refused before the copy
/// is queued, so the source may be freed at once.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_copy_into_a_non_primary_contexts_stream_inside_a_capture_closure_is_refused_before_it_is_queued() {
    let context = gpu().expect("a GPU");
    let _context_waits = context_wait_lock(); // it captures in the primary context
    let cudarc_context = CudaContext::new_non_primary(0, 0).unwrap();
    let cudarc_stream = cudarc_context.new_stream().unwrap();
    let target_stream = Stream::from_cudarc(&cudarc_stream).unwrap();
    assert!(target_stream.context().is_none());
    let (source_stream, check_stream) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut source = pool.alloc(4 * MIB, &source_stream).unwrap();
    source.fill(7).unwrap();
    let mut target = pool.alloc(4 * MIB, &target_stream).unwrap();
    target.fill(1).unwrap();
    let outer = Stream::new(&context).unwrap();
    let mut refused = None;
    let graph = outer.capture(|_| {
        refused = Some(target.copy_from_async(&source));
        drop(source); // freed on its own stream: no copy may read it
        Ok(())
    });
    graph.expect("the capture survives the refusal");
    let refused = refused.unwrap();
    assert!(matches!(refused, Err(Error::StreamCapturing { .. })), "{refused:?}");
    let mut check = pool.alloc(4 * MIB, &check_stream).unwrap();
    check.copy_from(&target).unwrap();
    let mut back = vec![0u8; 4 * MIB];
    check.copy_to_host(&mut back).unwrap();
    assert!(back.iter().all(|b| *b == 1), "refused, yet the copy was queued");
}
