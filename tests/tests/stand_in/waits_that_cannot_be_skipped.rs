//! Copies whose ordering or wait could be refused after the copy was queued, on a host without a
//! GPU, through the stand-in libcuda of `cumempool_tests::stand_in_driver`, whose call log shows
//! what was queued and waited for. A copy must settle everything that can be refused before it
//! queues anything; once queued, it must not return while the copy may still use memory the
//! caller then releases.
//!
//! The same failures on the GPU, through the fault-injecting driver, are in
//! `tests/tests/faults/failures_after_queued_work.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{Error, MemPool, Route, Stream};
use cumempool_tests::end_foreign_capture;
use cumempool_tests::stand_in_driver::{call_log, capture_at_next_copy, set_switch, stand_in};

/// Whether the log shows a copy queued (on any stream: a waiting copy runs on a private one)
/// that no successful host wait followed. Each test's calls are the only ones in its stretch of
/// the log.
fn copy_left_running(log: &str) -> bool {
    let mut running = false;
    for call in log.lines() {
        let fields: Vec<&str> = call.split(' ').collect();
        match fields.as_slice() {
            ["memcpy", ..] => running = true,
            ["sync" | "eventsync", _, _, "0"] => running = false,
            _ => {}
        }
    }
    running
}

fn the_log_since(start: usize) -> String {
    call_log()[start..].to_owned()
}

/// A stream of the lender's (which outlives it) with no context known here, as
/// `Stream::from_cudarc` gives for a stream of a non-primary cudarc context.
fn without_context(lender: &Stream) -> Stream {
    // SAFETY: every caller keeps `lender` alive for longer than the result and its buffers.
    unsafe { Stream::borrow_raw(lender.as_raw(), None) }.unwrap()
}

#[test]
fn a_copy_between_streams_ordered_with_host_waits_is_refused_in_a_capture_closure_before_anything_is_queued() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let (lender, known) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let unknown = without_context(&lender);
    let outer = Stream::new(&context).unwrap();
    // The stream without a context on either end: after the copy, or before it.
    for (target_stream, source_stream) in [(&unknown, &known), (&known, &unknown)] {
        let source = pool.alloc(4096, source_stream).unwrap();
        let mut target = pool.alloc(4096, target_stream).unwrap();
        let start = call_log().len();
        let mut copied = None;
        outer
            .capture(|_| {
                copied = Some(target.copy_from_async(&source));
                Ok(())
            })
            .expect("the capture survives the refusal");
        let log = the_log_since(start);
        let Some(Err(Error::StreamCapturing { operation, .. })) = copied else { panic!("{copied:?}") };
        assert!(
            operation.contains("copy_from_async") && operation.contains("without its context"),
            "the refusal names the copy and why: {operation}"
        );
        assert!(operation.contains("Capture::copy"), "and what would work: {operation}");
        assert!(!log.contains("memcpy"), "a copy was queued, which the source's free would not wait for:\n{log}");
        // The source's free, on its own stream: nothing reads it.
        drop(source);
    }
}

#[test]
fn a_waiting_copy_whose_capture_mode_cannot_be_relaxed_queues_nothing() {
    let Some((_serial, context)) = stand_in() else { return };
    let device_pool = MemPool::new(Route::device(0)).unwrap();
    let host_pool = MemPool::new(Route::host()).unwrap();
    let (stream, host_stream) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let device = device_pool.alloc(4096, &stream).unwrap();
    let mut pinned = host_pool.alloc(4096, &host_stream).unwrap();
    let mut source = device_pool.alloc(4096, &host_stream).unwrap();
    type Copy<'a> = Box<dyn FnMut() -> cumempool::Result<()> + 'a>;
    let copies: [(&str, &Stream, Copy<'_>); 3] = [
        ("copy_to_host", &stream, Box::new(|| device.copy_to_host(pinned.host_slice_mut()?))),
        ("copy_from_host", &host_stream, Box::new(|| source.copy_from_host(&[5; 4096]))),
        (
            "copy_from",
            &stream,
            Box::new(|| {
                let mut target = device_pool.alloc(4096, &stream)?;
                let from = device_pool.alloc(4096, &host_stream)?;
                target.copy_from(&from)
            }),
        ),
    ];
    for (name, _on, mut copy) in copies {
        let start = call_log().len();
        set_switch("fail_next_exchange"); // any failure on the way to the wait
        let copied = copy();
        let log = the_log_since(start);
        assert!(copied.is_err(), "{name}: the failed mode change was not reached");
        assert!(
            !copy_left_running(&log),
            "{name} answered {copied:?} with its copy queued and never waited for; the caller may release its memory:\n{log}"
        );
    }
}

/// What [`copy_on_a_lent_stream`] leaves: the copy's answer, the log of its calls, the lent
/// stream, and the buffer (on it) to drop once the other code's capture is over.
struct LentCopy {
    copied: cumempool::Result<()>,
    log: String,
    stream: Stream,
    _device: cumempool::OwnedBuffer,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// A `copy_to_host` from a buffer on a stream lent as `Stream::from_cudarc` lends it (cudarc's
/// safe `begin_capture` may run on it at any time, from another thread), with `cue` setting the
/// stand-in's switches for the other code's capture first.
fn copy_on_a_lent_stream(cue: impl FnOnce(&Stream)) -> Option<LentCopy> {
    let (serial, context) = stand_in()?;
    let pool = MemPool::new(Route::device(0)).unwrap();
    // Leaked, so that it outlives every clone of the stream lent from it.
    let lender = Box::leak(Box::new(Stream::new(&context).unwrap()));
    // SAFETY: `lender` is never dropped.
    let stream = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
    let device = pool.alloc_owned(4096, &stream).unwrap();
    let mut host = vec![0u8; 4096];
    let start = call_log().len();
    cue(&stream);
    let copied = device.copy_to_host(&mut host);
    let log = the_log_since(start);
    // Released as the caller of a waiting copy may: the copy must never run into it after this.
    drop(host);
    Some(LentCopy { copied, log, stream, _device: device, _serial: serial })
}

/// `copied` is the refusal that says nothing was copied, and the log shows no copy.
fn refused_with_nothing_copied(copied: &cumempool::Result<()>, log: &str) {
    let Err(Error::CaptureRefused { what, hint, .. }) = copied else { panic!("{copied:?}\n{log}") };
    assert!(what.contains("copy_to_host") && hint.contains("nothing was copied"), "{copied:?}");
    assert!(!log.contains("memcpy"), "a copy was queued beside or unordered after the capture:\n{log}");
}

#[test]
fn a_waiting_copy_on_a_lent_stream_that_begins_capturing_before_the_copy_copies_nothing_and_leaves_that_capture_no_graph(
) {
    // The other code's capture begins after the check, before the copy is set up.
    let Some(LentCopy { _serial, copied, log, stream, _device }) =
        copy_on_a_lent_stream(|_| set_switch("capture_on_next_record"))
    else {
        return;
    };
    refused_with_nothing_copied(&copied, &log);
    assert_eq!(
        end_foreign_capture(&stream),
        CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "the capture that the copy's private stream joined gave a graph, which would wait for a copy that never comes"
    );
}

#[test]
fn a_waiting_copy_on_a_lent_stream_that_begins_capturing_while_the_copy_runs_waits_for_it() {
    // The other code's capture begins once the copy is queued: the copy is real work, and must
    // be waited for before the vector can be released.
    let Some(LentCopy { _serial, copied, log, stream, _device }) = copy_on_a_lent_stream(capture_at_next_copy) else {
        return;
    };
    assert!(copied.is_ok(), "{copied:?}\n{log}");
    assert!(log.contains("memcpy"), "{log}");
    assert!(!copy_left_running(&log), "it returned with the copy into the vector still running:\n{log}");
    assert_eq!(
        end_foreign_capture(&stream),
        CUresult::CUDA_SUCCESS,
        "the other code's capture, which the copy never touched, was broken"
    );
}

#[test]
fn a_waiting_copy_whose_marker_a_capture_took_and_ended_copies_nothing() {
    // The other code's capture takes the event that orders the copy after the stream, and ends
    // before the copy's stream waits for it: the wait then orders nothing.
    let Some(LentCopy { _serial, copied, log, _device, .. }) = copy_on_a_lent_stream(|_| {
        set_switch("capture_on_next_record");
        set_switch("end_capture_before_next_waitevent");
    }) else {
        return;
    };
    refused_with_nothing_copied(&copied, &log);
}

#[test]
fn a_waiting_copy_that_cannot_be_waited_for_orders_the_buffers_streams_after_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let (stream, other) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let mut target = pool.alloc(4096, &stream).unwrap();
    let source = pool.alloc(4096, &other).unwrap();
    let start = call_log().len();
    set_switch("fail_next_waits"); // the wait for the copy, and the fallback wait, both fail
    let copied = target.copy_from(&source);
    let log = the_log_since(start);
    assert!(copied.is_err(), "{log}");
    // Each buffer's stream waits for an event recorded after the copy, where the copy ran.
    let calls: Vec<Vec<&str>> = log.lines().map(|line| line.split(' ').collect()).collect();
    let copied_on = calls.iter().rev().find(|call| call[0] == "memcpy").map(|call| call[1]).expect("a copy");
    let after_copy: Vec<&str> = calls
        .iter()
        .skip_while(|call| call[0] != "memcpy")
        .filter(|call| call[0] == "record" && call[2] == copied_on)
        .map(|call| call[1])
        .collect();
    for (name, on) in [("the target's", &stream), ("the source's", &other)] {
        let on = format!("{:p}", on.as_raw());
        assert!(
            calls.iter().any(|call| call[0] == "waitevent" && call[1] == on && after_copy.contains(&call[2])),
            "{name} stream was not ordered after the copy that could not be waited for:\n{log}"
        );
    }
    drop((target, source));
}
