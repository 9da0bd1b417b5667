//! Graph launches on a stream that other code may begin capturing at any moment (a stream it
//! lent, as `Stream::from_cudarc` lends cudarc's), on a host without a GPU, through the stand-in
//! libcuda of `cumempool_tests::stand_in_driver`, whose call log shows what was launched and
//! waited for. Whatever that other code does, a launch must either not happen or be waited for
//! by the executable's drop, after which the memory it borrowed is released; and it must never be
//! recorded into the other code's graph, whose replays would outlive that memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{Error, Stream};
use cumempool_tests::end_foreign_capture;
use cumempool_tests::stand_in_driver::{call_log, capture_at_next_launch, set_switch, stand_in};
use std::sync::MutexGuard;

/// Whether the log shows a launch that ran (was not recorded into a capture) and that no
/// successful host wait followed, or a launch recorded into a capture. Each test's calls are the
/// only ones in its stretch of the log.
fn launch_left_running_or_captured(log: &str) -> bool {
    let mut running = false;
    for call in log.lines() {
        let fields: Vec<&str> = call.split(' ').collect();
        match fields.as_slice() {
            ["launch", _, _, "1"] => return true,
            ["launch", ..] => running = true,
            ["sync" | "eventsync", _, _, "0"] => running = false,
            _ => {}
        }
    }
    running
}

struct LentLaunch {
    launched: cumempool::Result<()>,
    /// From just before the launch to just after the executable's drop.
    log: String,
    stream: Stream,
    _serial: MutexGuard<'static, ()>,
}

/// An executable launched on a stream lent by other code, with `cue` setting the stand-in's
/// switches for that code's capture first, then dropped (the point after which the memory it
/// borrowed may be released).
fn launch_on_a_lent_stream(cue: impl FnOnce(&Stream)) -> Option<LentLaunch> {
    let (serial, context) = stand_in()?;
    // Leaked, so that it outlives every clone of the stream lent from it.
    let lender = Box::leak(Box::new(Stream::new(&context).unwrap()));
    // SAFETY: `lender` is never dropped.
    let stream = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
    let graph = Stream::new(&context).unwrap().capture(|_| Ok(())).unwrap();
    let mut exec = graph.instantiate().unwrap();
    let start = call_log().len();
    cue(&stream);
    let launched = exec.launch(&stream);
    drop(exec);
    let log = call_log()[start..].to_owned();
    Some(LentLaunch { launched, log, stream, _serial: serial })
}

#[test]
fn a_launch_on_a_lent_stream_that_begins_capturing_before_the_launch_launches_nothing_and_leaves_that_capture_no_graph()
{
    // The other code's capture begins after the check, before the launch is queued.
    let Some(LentLaunch { launched, log, stream, _serial }) =
        launch_on_a_lent_stream(|_| set_switch("capture_on_next_record"))
    else {
        return;
    };
    let Err(Error::CaptureRefused { what, hint, .. }) = &launched else { panic!("{launched:?}\n{log}") };
    assert!(what.contains("GraphExec::launch") && hint.contains("nothing was launched"), "{launched:?}");
    assert!(!log.contains("launch "), "a launch was queued beside or unordered after the capture:\n{log}");
    assert_eq!(
        end_foreign_capture(&stream),
        CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "the capture that the launch's private stream joined gave a graph, which would wait for a launch that never comes"
    );
}

#[test]
fn a_launch_on_a_lent_stream_that_begins_capturing_while_the_launch_runs_is_waited_for_by_the_drop() {
    // The other code's capture begins once the launch is queued: the launch is real work, which
    // the executable's drop must wait for before the memory it borrowed can be released.
    let Some(LentLaunch { launched, log, stream, _serial }) = launch_on_a_lent_stream(capture_at_next_launch) else {
        return;
    };
    assert!(launched.is_ok(), "{launched:?}\n{log}");
    assert!(log.contains("launch "), "{log}");
    assert!(
        !launch_left_running_or_captured(&log),
        "the drop returned with the launch still running, or the launch was recorded into the capture:\n{log}"
    );
    assert_eq!(
        end_foreign_capture(&stream),
        CUresult::CUDA_SUCCESS,
        "the other code's capture, which the launch never touched, was broken"
    );
}

#[test]
fn a_launch_whose_marker_a_capture_took_and_ended_launches_nothing() {
    // The other code's capture takes the event that orders the launch after the stream, and ends
    // before the launch's stream waits for it: the wait then orders nothing.
    let Some(LentLaunch { launched, log, .. }) = launch_on_a_lent_stream(|_| {
        set_switch("capture_on_next_record");
        set_switch("end_capture_before_next_waitevent");
    }) else {
        return;
    };
    let Err(Error::CaptureRefused { hint, .. }) = &launched else { panic!("{launched:?}\n{log}") };
    assert!(hint.contains("nothing was launched"), "{launched:?}");
    assert!(!log.contains("launch "), "{log}");
}

#[test]
fn a_launch_on_a_stream_nobody_captures_is_waited_for_by_the_drop_and_orders_the_stream_after_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let graph = Stream::new(&context).unwrap().capture(|_| Ok(())).unwrap();
    let mut exec = graph.instantiate().unwrap();
    let start = call_log().len();
    exec.launch(&stream).unwrap();
    exec.launch(&stream).unwrap();
    let before_drop = call_log()[start..].to_owned();
    drop(exec);
    let log = call_log()[start..].to_owned();
    assert!(!launch_left_running_or_captured(&log), "{log}");
    let on = format!("{:p}", stream.as_raw());
    assert!(
        before_drop.lines().filter(|call| call.starts_with(&format!("waitevent {on} "))).count() >= 2,
        "the stream was not ordered after each launch:\n{before_drop}"
    );
}
