//! An imported allocation's buffer on the legacy stream, dropped while a blocking stream
//! captures: its free (the unmapping) waits for the capture's end. The mapping may be forgotten,
//! and the allocation imported again, only once a host wait saw the unmapping run (the driver
//! maps a re-import at the same address); that wait, on the legacy stream, must never be made
//! while a blocking stream captures, which it would invalidate.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::the_per_thread_stream::{begin_per_thread_capture, end_per_thread_capture};
use cumempool::sys::CUresult;
use cumempool::{Buffer, Context, Error, HandleTypes, MemPool, Route, SharedAllocation, Stream};
use cumempool_tests::stand_in_driver::{set_switch, stand_in};

const LEN: usize = 4096;

/// A pool of this process shared with itself: the exporter's allocation on `stream`, its export
/// data, and the pool imported from the exporter's descriptor.
fn shared_with_itself(stream: &Stream) -> (Buffer<'_>, SharedAllocation, MemPool) {
    let exporter =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let allocation = exporter.alloc(LEN, stream).unwrap();
    let imported = MemPool::import_fd(exporter.export_fd().unwrap()).unwrap();
    let shared = allocation.export().unwrap();
    (allocation, shared, imported)
}

/// Makes the wait for `mapping`'s unmapping owed: dropped during a blocking capture, its
/// deferred free runs while another blocking capture begins, which then ends; neither capture
/// is invalidated.
fn owe_the_wait_for(mapping: Buffer<'_>) {
    begin_per_thread_capture();
    drop(mapping); // deferred: a blocking stream captures
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the first capture was left intact");
    set_switch("capture_per_thread_after_next_legacy_free");
    assert_eq!(Stream::run_orphaned_frees(), 1, "the deferred free ran, its wait is owed");
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the wait for the unmapping invalidated the capture");
}

/// Runs `work` inside the capture of a new stream of `context`, so that the calling thread
/// captures; the capture must succeed.
fn inside_another_streams_capture(context: &Context, work: impl FnOnce()) {
    let graph = Stream::new(context).unwrap().capture(|_| {
        work();
        Ok(())
    });
    assert!(graph.is_ok(), "{:?}", graph.err());
}

/// The unmapping's free goes through, then a blocking stream begins capturing before the wait
/// for it: the wait is not made, the capture is left intact, and the allocation is not mapped
/// again under a pending unmapping. The wait is owed: the legacy stream's next use, once
/// nothing blocks it, makes it, and the allocation can be imported again (a mapping left marked
/// for good would also refuse another allocation the driver maps at that address).
#[test]
fn a_deferred_unmapping_is_waited_for_at_the_legacy_streams_next_use_after_a_blocking_capture_begun_after_its_free() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (_allocation, shared, imported) = shared_with_itself(&legacy);
    let mapping = imported.import_pointer(&shared, &legacy).unwrap();
    let mapped = imported.used_mem_current().unwrap();
    owe_the_wait_for(mapping);
    assert_eq!(imported.used_mem_current().unwrap(), mapped - LEN as u64, "unmapped");
    let again = imported.import_pointer(&shared, &legacy);
    assert!(matches!(again, Err(Error::AlreadyImported { .. })), "not waited for, yet importable again: {again:?}");
    legacy.synchronize().unwrap();
    let again = imported.import_pointer(&shared, &legacy).unwrap();
    assert_eq!(again.len(), LEN, "importable again once the owed wait was made");
}

/// With nothing capturing once the free went through, the unmapping is waited for and the
/// allocation can be imported again.
#[test]
fn a_deferred_unmapping_is_waited_for_and_forgotten_once_the_capture_is_over() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (_allocation, shared, imported) = shared_with_itself(&legacy);
    let mapping = imported.import_pointer(&shared, &legacy).unwrap();
    begin_per_thread_capture();
    drop(mapping); // deferred: a blocking stream captures
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    assert_eq!(Stream::run_orphaned_frees(), 0, "the deferred free ran");
    let again = imported.import_pointer(&shared, &legacy).unwrap();
    assert_eq!(again.len(), LEN, "importable again once its unmapping was waited for");
}

/// An import refused for a length the driver did not map gives its fresh mapping back on the
/// legacy stream, whose use runs the owed waits, which forget mappings: the list of mapped
/// imports must not be held then (the thread would wait for itself for ever).
#[test]
fn a_refused_import_that_runs_an_owed_wait_does_not_wait_for_itself() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let exporter =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let (first, second) = (exporter.alloc(LEN, &legacy).unwrap(), exporter.alloc(LEN, &legacy).unwrap());
    let imported = MemPool::import_fd(exporter.export_fd().unwrap()).unwrap();
    owe_the_wait_for(imported.import_pointer(&first.export().unwrap(), &legacy).unwrap());
    let mut forged = second.export().unwrap().to_bytes();
    forged[64..].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let forged = SharedAllocation::from_bytes(&forged).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let (imported, legacy) = (&imported, &legacy);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let refused = imported.import_pointer(&forged, legacy).map(|buffer| buffer.len());
            done.send(()).unwrap();
            assert!(matches!(refused, Err(Error::SharedLengthMismatch { .. })), "{refused:?}");
        });
        let answered = finished.recv_timeout(std::time::Duration::from_secs(10));
        // A hung import cannot be stopped: end the process rather than the scope's join.
        if answered.is_err() {
            eprintln!("the refused import waited for itself");
            std::process::abort();
        }
    });
}

/// An owed wait that a capture on the calling thread refuses for now (the legacy stream used
/// inside another stream's capture closure) stays owed, and is made later.
#[test]
fn an_owed_wait_refused_for_now_stays_owed() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (_allocation, shared, imported) = shared_with_itself(&legacy);
    owe_the_wait_for(imported.import_pointer(&shared, &legacy).unwrap());
    let mut inside = None;
    inside_another_streams_capture(&context, || {
        inside = Some(legacy.ensure_not_capturing("using the legacy stream inside a capture closure"));
    });
    assert!(matches!(inside, Some(Ok(()))), "{inside:?}");
    legacy.synchronize().unwrap();
    let again = imported.import_pointer(&shared, &legacy);
    assert!(again.is_ok(), "the owed wait was lost: {again:?}");
}

/// `run_orphaned_frees` counts the owed waits it keeps, as it counts the frees.
#[test]
fn owed_waits_are_counted_as_waiting() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (_allocation, shared, imported) = shared_with_itself(&legacy);
    let mapping = imported.import_pointer(&shared, &legacy).unwrap();
    begin_per_thread_capture();
    drop(mapping);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS);
    set_switch("capture_per_thread_after_next_legacy_free");
    let first = Stream::run_orphaned_frees();
    let second = Stream::run_orphaned_frees();
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS);
    assert_eq!((first, second), (1, 1), "the same owed wait, counted each time");
    legacy.synchronize().unwrap();
    assert_eq!(Stream::run_orphaned_frees(), 0);
}

/// An imported buffer dropped inside another stream's capture closure: its free runs (nothing
/// blocks the legacy stream), but the capture on the calling thread refuses the wait for the
/// unmapping. The wait is owed, and the legacy stream's next use makes it.
#[test]
fn an_unmapping_whose_wait_the_calling_threads_capture_refuses_is_owed() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (_allocation, shared, imported) = shared_with_itself(&legacy);
    let mapped = imported.used_mem_current().unwrap();
    let mapping = imported.import_pointer(&shared, &legacy).unwrap();
    inside_another_streams_capture(&context, || drop(mapping));
    assert_eq!(imported.used_mem_current().unwrap(), mapped, "unmapped");
    legacy.synchronize().unwrap();
    let again = imported.import_pointer(&shared, &legacy);
    assert!(again.is_ok(), "the wait for the unmapping was lost: {again:?}");
}

/// The same on a stream of its own: the wait is owed with that stream's deferred frees, and its
/// next use makes it.
#[test]
fn an_unmapping_on_its_own_stream_whose_wait_the_calling_threads_capture_refuses_is_owed() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let (_allocation, shared, imported) = shared_with_itself(&stream);
    let mapping = imported.import_pointer(&shared, &stream).unwrap();
    inside_another_streams_capture(&context, || drop(mapping));
    stream.synchronize().unwrap();
    let again = imported.import_pointer(&shared, &stream);
    assert!(again.is_ok(), "the wait for the unmapping was lost: {again:?}");
}
