//! Its own process: a capture in global mode forbids the driver calls of every other thread.
//!
//! Host waits and queries that reach the driver while a capture is underway on the calling
//! thread (or, in global mode, on any thread), on the real driver: each is refused before the
//! driver or runs without invalidating the capture.
//!
//! Every test holds [`serial`]: a global-mode capture restricts every thread of the process, so
//! no other test of this binary may run beside one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUresult, CUstreamCaptureMode};
use cumempool::{Error, Event, MemPool, Route, Stream};
use cumempool_tests::gpu;
use std::sync::{mpsc, Mutex, MutexGuard, PoisonError};

const MIB: usize = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `during` while a capture in `mode`, begun on `stream` as other code would (cudarc's safe
/// `begin_capture`), is underway on this thread; then ends it and answers the driver's answer to
/// the end (CUDA_SUCCESS unless something invalidated the capture).
fn while_other_code_captures(stream: &Stream, mode: CUstreamCaptureMode, during: impl FnOnce()) -> CUresult {
    let driver = sys::driver().unwrap();
    stream.note_capture_possible();
    // SAFETY: a live stream that does not capture.
    assert_eq!(unsafe { driver.cuStreamBeginCapture().unwrap()(stream.as_raw(), mode) }, CUresult::CUDA_SUCCESS);
    during();
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun above on this thread; a valid out-pointer.
    let ended = unsafe { driver.cuStreamEndCapture().unwrap()(stream.as_raw(), &mut graph) };
    let destroyed = if graph.is_null() {
        CUresult::CUDA_SUCCESS
    } else {
        // SAFETY: the graph just handed back, destroyed once.
        unsafe { driver.cuGraphDestroy().unwrap()(graph) }
    };
    assert_eq!(destroyed, CUresult::CUDA_SUCCESS);
    ended
}

/// `Event::is_complete` and `PendingCopy::is_complete` (both `cuEventQuery`) inside
/// `Stream::capture`'s closure are refused like the other host waits and queries. In
/// thread-local mode the driver refuses a status query on the capturing thread with
/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture (measured for
/// `cuStreamQuery`; `cuEventQuery` is the same kind of call, and PyTorch's caching allocator
/// defers its event queries during captures for this reason): a closure that polls a copy's
/// progress would lose its whole graph to a `CaptureRefused` at the end instead of getting
/// `StreamCapturing` here.
#[test]
#[ignore = "requires a CUDA GPU"]
fn an_event_query_inside_a_capture_is_refused_and_leaves_the_capture_intact() {
    let _serial = serial();
    let context = gpu().expect("a GPU");
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(MIB, &stream).unwrap();
    buffer.fill(3).unwrap();
    let pending = buffer.copy_to_host_async(vec![0; MIB]).unwrap();
    let event = Event::new(&context).unwrap();
    event.record(&stream).unwrap();
    let mut asked = Vec::new();
    let graph = stream.capture(|capture| {
        let scratch = capture.alloc(&pool, MIB)?;
        capture.fill(&scratch, 1)?;
        asked.push(event.is_complete());
        asked.push(pending.is_complete());
        capture.fill(&scratch, 2)
    });
    for answer in &asked {
        assert!(
            matches!(answer, Ok(_) | Err(Error::StreamCapturing { .. })),
            "a query on the capturing thread reached the driver: {answer:?}"
        );
    }
    let graph = graph.expect("the capture was invalidated by a query the library let through");
    assert_eq!(graph.node_count().unwrap(), 4, "alloc, two fills, free");
    assert!(pending.wait().unwrap().iter().all(|b| *b == 3));
}

/// Dropping a launched `GraphExec` waits for its last launch (`cuEventSynchronize`). On a thread
/// where other code captures in thread-local mode (cudarc's `begin_capture`, a framework's graph
/// capture), that wait is refused by the driver (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
/// docs/driver-behaviour.md) and invalidates the other code's capture: its end answers
/// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. A drop cannot refuse, so every hidden host wait in
/// one (`GraphExec`, `PendingCopy`, an imported buffer's unmapping) would destroy a capture the
/// caller never touched.
///
/// So the library's host waits on streams and events that do not capture run in relaxed
/// capture mode (`cuThreadExchangeStreamCaptureMode(RELAXED)` before, the previous mode restored
/// after, as PyTorch's `CUDAStreamCaptureModeGuard` does): the wait is harmless to a capture on
/// another stream, and the driver then neither refuses it nor invalidates the capture.
#[test]
#[ignore = "requires a CUDA GPU"]
fn dropping_a_launched_executable_leaves_a_capture_other_code_runs_on_the_thread_intact() {
    let _serial = serial();
    let context = gpu().expect("a GPU");
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut target = pool.alloc(MIB, &stream).unwrap();
    let graph = stream
        .capture(|capture| {
            let target = capture.buffer(&mut target)?;
            capture.fill(&target, 9)
        })
        .unwrap();
    let mut exec = graph.instantiate().unwrap();
    drop(graph);
    exec.launch(&stream).unwrap();
    let foreign = Stream::new(&context).unwrap();
    let thread_local = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // The drop waits for the launch: a host wait on this (capturing) thread.
    let ended = while_other_code_captures(&foreign, thread_local, || drop(exec));
    assert_eq!(ended, CUresult::CUDA_SUCCESS, "dropping a GraphExec invalidated another library's capture");
    let mut back = vec![0; 16];
    target.copy_to_host(&mut back).unwrap();
    assert_eq!(back, vec![9; 16]);
}

/// A capture other code begins in global mode (the driver's default mode, and PyTorch's
/// `torch.cuda.graph` default) forbids "potentially unsafe" calls on every other thread of the
/// process whose capture mode is global (the default): `cuStreamSynchronize`, `cuStreamQuery`,
/// `cuEventSynchronize` are refused there with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the
/// global capture is invalidated. So any cumempool host wait on an unrelated stream, on any
/// thread, would destroy that capture: `Stream::synchronize`, the waiting copies, host slices, a
/// `GraphExec`'s or `PendingCopy`'s drop, and cumempool-alloc's `ResourceAllocator::allocate`
/// (every container growth waits on the allocator's private stream); the waiting thread would
/// get a plain driver error and the capturing thread's end would fail. The relaxed mode above
/// keeps such a wait from touching the capture.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_host_wait_on_another_thread_leaves_a_global_capture_of_other_code_intact() {
    let _serial = serial();
    let context = gpu().expect("a GPU");
    let capturing = Stream::new(&context).unwrap();
    let waiting = Stream::new(&context).unwrap();
    let (begun, on_begun) = mpsc::channel();
    let (waited, on_waited) = mpsc::channel::<()>();
    let (wait, ended) = std::thread::scope(|scope| {
        // The channels move into each side, so a panic on either side cannot leave the other
        // waiting for good.
        let other_code = scope.spawn(move || {
            while_other_code_captures(&capturing, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL, || {
                begun.send(()).unwrap();
                let _ = on_waited.recv();
            })
        });
        let waited = waited;
        on_begun.recv().expect("the other thread began its capture");
        let wait = waiting.synchronize();
        drop(waited);
        (wait, other_code.join().unwrap())
    });
    assert!(
        matches!(wait, Ok(()) | Err(Error::StreamCapturing { .. })),
        "a wait on a stream that does not capture reached the driver as a capture violation: {wait:?}"
    );
    assert_eq!(ended, CUresult::CUDA_SUCCESS, "a host wait on another thread invalidated the global capture");
}
