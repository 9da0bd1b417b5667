//! The driver's capture-mode rules, on a host without a GPU, through the stand-in libcuda of
//! `cumempool_tests::stand_in_driver`.
//!
//! The same scenarios run on the GPU in `tests/tests/host_waits_beside_other_captures.rs` and
//! `tests/tests/cudarc/cudarc_capture.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUresult, CUstreamCaptureMode};
use cumempool::{Error, Event, MemPool, Route, Stream};
use cumempool_tests::stand_in_driver::stand_in;
use cumempool_tests::{begin_foreign_capture_in, end_foreign_capture};
use std::sync::{mpsc, Arc};

#[test]
fn host_waits_leave_a_capture_other_code_runs_on_the_thread_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let foreign = Stream::new(&context).unwrap();
    let stream = Stream::new(&context).unwrap();
    let event = Event::new(&context).unwrap();
    event.record(&stream).unwrap();
    begin_foreign_capture_in(&foreign, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    stream.synchronize().unwrap();
    assert!(stream.is_idle().unwrap());
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    assert!(
        matches!(foreign.synchronize(), Err(Error::StreamCapturing { .. })),
        "a wait on the capturing stream itself is still refused"
    );
    assert_eq!(end_foreign_capture(&foreign), CUresult::CUDA_SUCCESS, "a host wait invalidated the capture");
    // The thread's own mode is back: a wait the library does not make is still refused.
    begin_foreign_capture_in(&foreign, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    // SAFETY: a live stream.
    let raw_wait = unsafe { sys::driver().unwrap().cuStreamSynchronize().unwrap()(stream.as_raw()) };
    assert_eq!(
        raw_wait,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "the thread is back in its own (global) mode"
    );
    assert_eq!(end_foreign_capture(&foreign), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn a_host_wait_on_another_thread_leaves_a_global_capture_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let capturing = Stream::new(&context).unwrap();
    let waiting = Stream::new(&context).unwrap();
    let (begun, on_begun) = mpsc::channel();
    let (waited, on_waited) = mpsc::channel::<()>();
    let (wait, ended) = std::thread::scope(|scope| {
        let other_code = scope.spawn(move || {
            begin_foreign_capture_in(&capturing, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
            begun.send(()).unwrap();
            let _ = on_waited.recv();
            end_foreign_capture(&capturing)
        });
        on_begun.recv().unwrap();
        let wait = waiting.synchronize();
        drop(waited);
        (wait, other_code.join().unwrap())
    });
    wait.unwrap();
    assert_eq!(ended, CUresult::CUDA_SUCCESS, "a host wait on another thread invalidated the global capture");
}

#[test]
fn status_queries_inside_a_capture_are_refused_and_leave_it_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let event = Event::new(&context).unwrap();
    event.record(&stream).unwrap();
    let mut asked = None;
    let graph = stream.capture(|_| {
        asked = Some(event.is_complete());
        Ok(())
    });
    assert!(matches!(asked, Some(Err(Error::StreamCapturing { .. }))), "{asked:?}");
    graph.expect("the capture survives the refused query");
}

#[test]
fn a_stream_dropped_during_other_codes_capture_still_frees_what_was_deferred_to_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let lender = Stream::new(&context).unwrap(); // stands for cudarc's stream, which lives on
    let pool = MemPool::new(Route::device(0)).unwrap();
    for sweep in [false, true] {
        let keep_alive: Arc<dyn std::any::Any + Send + Sync> = Arc::new(lender.clone());
        // SAFETY: `lender` outlives the result (the keep-alive holds a clone).
        let stream = unsafe { Stream::borrow_raw_keeping(lender.as_raw(), Some(&context), keep_alive) }.unwrap();
        let buffer = pool.alloc(4096, &stream).unwrap();
        begin_foreign_capture_in(&stream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        drop(buffer); // deferred: its stream captures
        drop(stream); // the last handle of it here
        assert_eq!(end_foreign_capture(&lender), CUresult::CUDA_SUCCESS);
        assert_eq!(pool.used_mem_current().unwrap(), 4096, "not freed during the capture");
        if sweep {
            assert_eq!(Stream::run_orphaned_frees(), 0, "nothing left waiting");
        } else {
            // SAFETY: as above.
            let again = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
            again.synchronize().unwrap();
        }
        assert_eq!(pool.used_mem_current().unwrap(), 0, "the free deferred to the dropped stream never ran");
    }
    assert!(!matches!(pool.destroy(), Err(Error::PoolInUse { .. })), "a lost deferred free keeps the pool in use");
}

#[test]
fn a_pending_copy_waited_for_inside_a_capture_is_handed_back_with_its_vector() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(4096, &stream).unwrap();
    let pending = buffer.copy_to_host_async(vec![7; 4096]).unwrap();
    let mut handed_back = None;
    stream
        .capture(|_| {
            let refused = pending.wait().unwrap_err();
            assert!(matches!(refused.error(), Error::StreamCapturing { .. }), "{refused}");
            handed_back = refused.into_pending();
            Ok(())
        })
        .expect("the capture survives the refused wait");
    let pending = handed_back.expect("the refused wait handed the copy back");
    assert_eq!(pending.wait().unwrap(), vec![7; 4096], "the vector itself, not a leaked one");
}
