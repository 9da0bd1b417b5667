//! Graph launches on a stream that other code may begin capturing at any moment (a stream it
//! lent, as `Stream::from_cudarc` lends cudarc's), on a host without a GPU, through the stand-in
//! libcuda of `cumempool_tests::stand_in_driver`, whose call log shows what was launched and
//! waited for. Whatever that other code does, a launch must either not happen or be waited for
//! by the executable's drop, after which the memory it borrowed is released; and it must never be
//! recorded into the other code's graph, whose replays would outlive that memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{Error, MemPool, Route, Stream};
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
    /// The launch stream, and the stream of an outside buffer the graph uses: both lent.
    stream: Stream,
    outside: Stream,
    _serial: MutexGuard<'static, ()>,
}

/// A stream lent by other code: borrowed from one that is leaked, so that it outlives every
/// clone of the stream lent from it.
fn lent(context: &cumempool::Context) -> Stream {
    let lender = Box::leak(Box::new(Stream::new(context).unwrap()));
    // SAFETY: `lender` is never dropped.
    unsafe { Stream::borrow_raw(lender.as_raw(), Some(context)) }.unwrap()
}

/// An executable that uses a buffer of a second lent stream, launched on a lent stream, with
/// `cue` setting the stand-in's switches for other code's capture first (given the launch
/// stream and the buffer's), then dropped: the point after which the memory it borrowed may be
/// released.
fn launch_on_a_lent_stream(cue: impl FnOnce(&Stream, &Stream)) -> Option<LentLaunch> {
    let (serial, context) = stand_in()?;
    let (stream, outside) = (lent(&context), lent(&context));
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(4096, &outside).unwrap();
    let graph =
        Stream::new(&context).unwrap().capture(|capture| capture.fill(&capture.buffer(&mut buffer)?, 1)).unwrap();
    let mut exec = graph.instantiate().unwrap();
    let start = call_log().len();
    cue(&stream, &outside);
    let launched = exec.launch(&stream);
    drop(exec);
    let log = call_log()[start..].to_owned();
    drop(graph);
    drop(buffer);
    Some(LentLaunch { launched, log, stream, outside, _serial: serial })
}

/// `launched` is the refusal that says nothing was launched, and the log shows no launch.
fn refused_with_nothing_launched(launched: &cumempool::Result<()>, log: &str) {
    let Err(Error::CaptureRefused { what, hint, .. }) = launched else { panic!("{launched:?}\n{log}") };
    assert!(what.contains("GraphExec::launch") && hint.contains("nothing was launched"), "{launched:?}");
    assert!(!log.contains("launch "), "a launch was queued beside or unordered after the capture:\n{log}");
}

#[test]
fn a_launch_on_a_lent_stream_that_begins_capturing_before_the_launch_launches_nothing_and_leaves_that_capture_no_graph()
{
    // The other code's capture begins after the check, before the launch is queued: the
    // launch stream's marker lands in it, and the private stream joins it by waiting for that
    // marker. The outside buffer's stream, ordered next, does not capture: the joined private
    // stream must not wait for its marker (the driver refuses that, breaking the capture with
    // an error of its own).
    let Some(LentLaunch { _serial, launched, log, stream, .. }) =
        launch_on_a_lent_stream(|_, _| set_switch("capture_on_next_record"))
    else {
        return;
    };
    refused_with_nothing_launched(&launched, &log);
    assert!(!log.contains(" 905"), "the joined private stream waited for an event from outside the capture:\n{log}");
    assert_eq!(
        end_foreign_capture(&stream),
        CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "the capture that the launch's private stream joined gave a graph, which would wait for a launch that never comes"
    );
}

/// Other code's capture begins on `which` (the launch stream, or the outside buffer's) once the
/// launch is queued: the launch is real work, which must be waited for before the memory it
/// borrowed is released; and a stream that now captures cannot wait for the launch's event
/// (the driver refuses the wait and invalidates the capture), so the launch waits on the host
/// instead, leaving that capture alone.
fn captured_while_the_launch_runs(which: for<'a> fn(&'a Stream, &'a Stream) -> &'a Stream) {
    let Some(LentLaunch { _serial, launched, log, stream, outside }) =
        launch_on_a_lent_stream(|stream, outside| capture_at_next_launch(which(stream, outside)))
    else {
        return;
    };
    assert!(launched.is_ok(), "{launched:?}\n{log}");
    assert!(log.contains("launch "), "{log}");
    assert!(
        !launch_left_running_or_captured(&log),
        "the drop returned with the launch still running, or the launch was recorded into the capture:\n{log}"
    );
    assert_eq!(
        end_foreign_capture(which(&stream, &outside)),
        CUresult::CUDA_SUCCESS,
        "the other code's capture, which the launch never touched, was broken:\n{log}"
    );
}

#[test]
fn a_launch_on_a_lent_stream_that_begins_capturing_while_the_launch_runs_is_waited_for_and_leaves_that_capture_alone() {
    captured_while_the_launch_runs(|stream, _| stream);
}

#[test]
fn a_launch_whose_outside_buffers_stream_begins_capturing_while_the_launch_runs_is_waited_for_and_leaves_that_capture_alone(
) {
    captured_while_the_launch_runs(|_, outside| outside);
}

#[test]
fn a_launch_whose_marker_a_capture_took_and_ended_launches_nothing() {
    // The other code's capture takes the event that orders the launch after the stream, and ends
    // before the launch's stream waits for it: the wait then orders nothing.
    let Some(LentLaunch { _serial, launched, log, .. }) = launch_on_a_lent_stream(|_, _| {
        set_switch("capture_on_next_record");
        set_switch("end_capture_before_next_waitevent");
    }) else {
        return;
    };
    refused_with_nothing_launched(&launched, &log);
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

#[test]
fn a_launch_inside_a_capture_closure_is_refused_before_anything_reaches_the_driver() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let graph = Stream::new(&context).unwrap().capture(|_| Ok(())).unwrap();
    let mut exec = graph.instantiate().unwrap();
    let start = call_log().len();
    let mut launched = None;
    let closure = Stream::new(&context).unwrap().capture(|_| {
        launched = Some(exec.launch(&stream));
        Ok(())
    });
    let log = call_log()[start..].to_owned();
    assert!(closure.is_ok(), "the refusal left the closure's capture intact: {:?}", closure.err());
    let Some(Err(Error::StreamCapturing { operation, .. })) = &launched else { panic!("{launched:?}") };
    assert!(operation.contains("GraphExec::launch"), "{operation}");
    assert!(!log.contains("launch ") && !log.contains("record "), "{log}");
}

#[test]
fn later_launches_record_the_markers_of_the_first_again_instead_of_making_events() {
    let Some((_serial, context)) = stand_in() else { return };
    let (stream, outside) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(4096, &outside).unwrap();
    let graph =
        Stream::new(&context).unwrap().capture(|capture| capture.fill(&capture.buffer(&mut buffer)?, 1)).unwrap();
    let mut exec = graph.instantiate().unwrap();
    let made = |log: &str| log.lines().filter(|call| call.starts_with("eventcreate ")).count();
    let start = call_log().len();
    exec.launch(&stream).unwrap();
    let first = call_log()[start..].to_owned();
    assert_eq!(made(&first), 2, "a marker per ordered stream:\n{first}");
    let start = call_log().len();
    exec.launch(&stream).unwrap();
    exec.launch(&outside).unwrap();
    let later = call_log()[start..].to_owned();
    assert_eq!(made(&later), 0, "{later}");
    assert_eq!(later.lines().filter(|call| call.starts_with("launch ")).count(), 2, "{later}");
}
