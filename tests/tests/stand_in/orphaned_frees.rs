//! Frees deferred by other code's capture and left behind by a dropped `Stream` (orphans), on a
//! host without a GPU, through the stand-in libcuda of `cumempool_tests::stand_in_driver`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{MemPool, Route, Stream};
use cumempool_tests::stand_in_driver::{live_streams, stand_in};
use cumempool_tests::{begin_foreign_capture, end_foreign_capture};
use std::sync::{Arc, Weak};

/// A `Stream` dropped during other code's capture takes the orphans earlier values of the same
/// handle left (their deferred frees) and, the stream still capturing, adopts them again with
/// its own: it must keep the earlier values' keep-alives (the lender's handle: a cudarc
/// `Arc<CudaStream>`, a Python stream object) too, while their frees still wait to run on that
/// stream. Were they dropped, the lender could let go of its stream, which would be destroyed,
/// its handle value could come back for a new stream, and the frees would run there, unordered
/// with the old stream's work (or `cuStreamGetCaptureInfo` would be asked about a destroyed
/// handle by `run_orphaned_frees`). In Python the case needs no unsafe code: a buffer dropped on a
/// `Stream.borrow(obj)` mid-capture, then any short-lived borrow of the same handle without an
/// owner (a DLPack consumer's stream in `order_before_consumer`, `Stream.borrow(int)`) dropped
/// before the capture ends.
#[test]
fn a_second_value_dropped_mid_capture_keeps_the_first_values_lender_alive() {
    let Some((_serial, context)) = stand_in() else { return };
    let lender = Stream::new(&context).unwrap(); // stands for cudarc's stream
    let pool = MemPool::new(Route::device(0)).unwrap();
    let keep_alive: Arc<dyn std::any::Any + Send + Sync> = Arc::new(lender.clone());
    let watch: Weak<dyn std::any::Any + Send + Sync> = Arc::downgrade(&keep_alive);
    // SAFETY: the keep-alive holds a clone of `lender`, which is live until it is dropped.
    let first = unsafe { Stream::borrow_raw_keeping(lender.as_raw(), Some(&context), keep_alive) }.unwrap();
    let buffer = pool.alloc(4096, &first).unwrap();
    begin_foreign_capture(&first);
    drop(buffer); // deferred: its stream captures
    drop(first); // an orphan, holding the lender's handle
    assert!(watch.upgrade().is_some(), "control: the orphan keeps the lender");
    {
        // A borrow that lives only for this block, during which the stream is valid (as for a
        // DLPack consumer's stream in one call); it defers no free of its own.
        // SAFETY: `lender` is alive for the whole block.
        let second = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
        drop(second);
    }
    let kept = watch.upgrade().is_some();
    // Put things right before asserting, so that a failure leaves nothing dangling.
    assert_eq!(end_foreign_capture(&lender), CUresult::CUDA_SUCCESS);
    assert_eq!(Stream::run_orphaned_frees(), 0, "nothing left waiting");
    assert_eq!(pool.used_mem_current().unwrap(), 0);
    assert!(
        kept,
        "the first value's free still waits on the stream, but the lender's handle that keeps the stream valid was dropped"
    );
}

/// An owned stream (`Stream::new`) that other code captures (after `note_capture_possible`),
/// dropped during that capture with a free deferred to it, is kept alive so that the free can
/// run on it later; once the capture is over and the free has run (`run_orphaned_frees`, or a
/// later use of its handle), it is destroyed, or every such drop would leak a driver stream for
/// the process's life.
#[test]
fn an_owned_stream_leaked_for_a_capture_is_destroyed_once_its_frees_have_run() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    // Streams that earlier tests of this binary left for their frees (a capture their private
    // stream joined is over): destroyed now, so that the count is this test's own.
    Stream::run_orphaned_frees();
    let before = live_streams();
    let owned = Stream::new(&context).unwrap();
    let raw = owned.as_raw();
    let buffer = pool.alloc(4096, &owned).unwrap();
    begin_foreign_capture(&owned);
    drop(buffer); // deferred: its stream captures
    drop(owned); // leaked for the free, rightly: it still captures
    assert_eq!(live_streams(), before + 1, "control: not destroyed mid-capture");
    // SAFETY: the leaked stream is valid; this value is forgotten, never destroyed here.
    let ender = unsafe { Stream::borrow_raw(raw, Some(&context)) }.unwrap();
    assert_eq!(end_foreign_capture(&ender), CUresult::CUDA_SUCCESS);
    drop(ender);
    assert_eq!(Stream::run_orphaned_frees(), 0, "nothing left waiting");
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the deferred free ran");
    assert_eq!(live_streams(), before, "the owned stream is destroyed once its capture and frees are over");
}
