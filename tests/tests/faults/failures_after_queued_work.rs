//! Failures after work was queued, through the fault-injecting driver.
//!
//! `BufferOn::copy_from_async` and `GraphExec::launch` order the other buffer's stream after the
//! work they queued with an event wait *after* queuing it. When that wait fails, the other
//! stream must still end up ordered after the work: otherwise that stream's next free (the
//! buffer's drop, or the drop after `mem::forget` of the executable, which the graph's docs
//! promise is harmless) releases memory the device still reads or writes. A capture whose end
//! fails must not stay underway. On the fault suite's fixture (`crate::suite`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::{suite, UNKNOWN};
use cumempool::{Buffer, Context, Event, GraphExec, MemPool, Route, Stream};

const MIB: usize = 1 << 20;
/// Bytes per fill: 64 of them keep an H200 busy for milliseconds.
const BIG: usize = 512 * MIB;

/// Whether the work queued on `after` so far, which `waiter` must be ordered after, has
/// finished once `waiter`'s queued work has: records an event on `waiter`, waits for it on the
/// host, and asks whether `after` is idle.
fn ordered_after(waiter: &Stream, after: &Stream, context: &Context) -> bool {
    let mark = Event::new(context).unwrap();
    mark.record(waiter).unwrap();
    mark.synchronize().unwrap();
    after.is_idle().unwrap()
}

/// An executable of 64 fills of `target` (milliseconds of work per launch), captured on `capturing`.
fn sixty_four_fills<'env>(capturing: &Stream, target: &'env mut Buffer<'_>) -> GraphExec<'env> {
    let graph = capturing
        .capture(|capture| {
            let target = capture.buffer(target)?;
            (0..64u8).try_for_each(|value| capture.fill(&target, value))
        })
        .unwrap();
    graph.instantiate().unwrap()
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_failed_copy_from_async_still_orders_the_sources_stream_after_the_copy() {
    let Some((_lock, suite)) = suite() else { return };
    let (target_stream, source_stream) = (Stream::new(&suite.context).unwrap(), Stream::new(&suite.context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let source = pool.alloc(BIG, &source_stream).unwrap();
    let mut target = pool.alloc(BIG, &target_stream).unwrap();
    source_stream.synchronize().unwrap();
    for _ in 0..64 {
        target.fill(1).unwrap(); // milliseconds of work ahead of the copy
    }
    // The first wait orders the copy after the source's stream; the second, which fails, would
    // order the source's stream after the copy.
    suite.faults.set_plan(&format!("cuStreamWaitEvent:nth=2:code={UNKNOWN}")).unwrap();
    let copied = target.copy_from_async(&source);
    suite.faults.clear();
    assert!(copied.is_err(), "the injected failure was not reached");
    let ordered = ordered_after(&source_stream, &target_stream, &suite.context);
    target_stream.synchronize().unwrap();
    drop(source);
    assert!(ordered, "the source's free (on its stream) could run while the copy still reads it");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_failed_launch_still_orders_its_outside_buffers_stream_after_the_launch() {
    a_failed_launch_orders_its_outside_buffers_stream_after_the_launch(false);
}

/// As above, inside another stream's capture closure, where the library refuses ordinary host
/// waits: the wait that stands in for the failed ordering must not be one of them.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_failed_launch_inside_another_capture_still_orders_its_outside_buffers_stream_after_the_launch() {
    a_failed_launch_orders_its_outside_buffers_stream_after_the_launch(true);
}

fn a_failed_launch_orders_its_outside_buffers_stream_after_the_launch(inside_another_capture: bool) {
    let Some((_lock, suite)) = suite() else { return };
    let context = &suite.context;
    let (capturing, buffer_stream, launch_stream) =
        (Stream::new(context).unwrap(), Stream::new(context).unwrap(), Stream::new(context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut target = pool.alloc(BIG, &buffer_stream).unwrap();
    let mut exec = sixty_four_fills(&capturing, &mut target);
    // The first wait orders the launch after the buffer's stream; the second, which fails, would
    // order the buffer's stream after the launch.
    let mut launch = || {
        suite.faults.set_plan(&format!("cuStreamWaitEvent:nth=2:code={UNKNOWN}")).unwrap();
        let launched = exec.launch(&launch_stream);
        suite.faults.clear();
        launched
    };
    let launched = if inside_another_capture {
        let mut launched = None;
        let outer = Stream::new(context).unwrap();
        // The outer capture may be invalidated by the wait: better than a use-after-free.
        let _ = outer.capture(|_| {
            launched = Some(launch());
            Ok(())
        });
        launched.unwrap()
    } else {
        launch()
    };
    assert!(launched.is_err(), "the injected failure was not reached");
    // The graph's docs: "even a leaked executable cannot let a buffer be freed under a running
    // launch". Leaked, the executable no longer borrows `target`, whose free is on its stream.
    std::mem::forget(exec);
    let ordered = ordered_after(&buffer_stream, &launch_stream, context);
    launch_stream.synchronize().unwrap();
    drop(target);
    assert!(ordered, "the buffer's free (on its stream) could run while the launch still writes it");
}

/// A waiting copy whose way to its wait fails must not return while the copy still writes the
/// caller's (pinned) slice: it fails before queuing, or waits.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_copy_to_host_whose_wait_fails_leaves_no_copy_running_into_the_slice() {
    let Some((_lock, suite)) = suite() else { return };
    let context = &suite.context;
    let (stream, host_stream) = (Stream::new(context).unwrap(), Stream::new(context).unwrap());
    let device_pool = MemPool::new(Route::device(0)).unwrap();
    let host_pool = MemPool::new(Route::host()).unwrap();
    let mut device = device_pool.alloc(BIG, &stream).unwrap();
    let mut pinned = host_pool.alloc(BIG, &host_stream).unwrap();
    pinned.fill(0).unwrap();
    // The capture-mode change around the wait, then the wait itself.
    for plan in ["cuThreadExchangeStreamCaptureMode:nth=1", "cuEventSynchronize:nth=1"] {
        for _ in 0..64 {
            device.fill(3).unwrap(); // milliseconds of work ahead of the copy
        }
        let slice = pinned.host_slice_mut().unwrap();
        suite.faults.set_plan(&format!("{plan}:code={UNKNOWN}")).unwrap();
        let copied = device.copy_to_host(slice);
        suite.faults.clear();
        assert!(copied.is_err(), "{plan}: the injected failure was not reached");
        let at_return = pinned.host_slice().unwrap()[BIG - 4096..].to_vec();
        // The whole context: a waiting copy runs on a private stream of the library's.
        context.synchronize().unwrap();
        let later = pinned.host_slice().unwrap()[BIG - 4096..].to_vec();
        assert_eq!(at_return, later, "{plan}: the copy wrote the slice after copy_to_host returned {copied:?}");
        pinned.fill(0).unwrap();
    }
}

/// A capture whose end fails without ending it (an injected failure never reaches the driver)
/// must not leave the capture underway: in thread-local mode it would refuse this thread's later
/// host waits on any stream (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) for good.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_capture_whose_end_fails_leaves_no_capture_underway_on_the_thread() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = Stream::new(&suite.context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    suite.faults.set_plan(&format!("cuStreamEndCapture:nth=1:code={UNKNOWN}")).unwrap();
    let captured = stream.capture(|capture| {
        let scratch = capture.alloc(&pool, MIB)?;
        capture.fill(&scratch, 1)
    });
    suite.faults.clear();
    assert!(captured.is_err(), "the injected failure was not reached");
    let other = Stream::new(&suite.context).unwrap();
    other.synchronize().expect("a host wait on this thread after the failed end");
    assert!(!stream.is_capturing().unwrap());
    stream.capture(|_| Ok(())).expect("a later capture on the same stream");
}
