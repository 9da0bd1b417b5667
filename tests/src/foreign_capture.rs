//! Captures begun and ended by "other code" (cudarc's `begin_capture`, the raw driver), on a
//! cumempool stream: what the library must survive without owning the capture.
#![allow(clippy::unwrap_used)]

use cumempool::sys::{self, CUresult, CUstreamCaptureMode};
use cumempool::Stream;

/// Begins a thread-local capture on `stream` as other code would.
pub fn begin_foreign_capture(stream: &Stream) {
    begin_foreign_capture_in(stream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}

/// Begins a capture in `mode` on `stream` through the driver, after marking the stream as one
/// that may capture (as `Stream::note_capture_possible` asks of such code).
pub fn begin_foreign_capture_in(stream: &Stream, mode: CUstreamCaptureMode) {
    stream.note_capture_possible();
    // SAFETY: a live stream that does not capture.
    let begun = unsafe { sys::driver().unwrap().cuStreamBeginCapture().unwrap()(stream.as_raw(), mode) };
    assert_eq!(begun, CUresult::CUDA_SUCCESS);
}

/// Ends the capture begun by [`begin_foreign_capture`]: the driver's answer (not invalidated, if
/// nothing disturbed it); the graph is destroyed.
pub fn end_foreign_capture(stream: &Stream) -> CUresult {
    end_foreign_capture_counting(stream).0
}

/// As [`end_foreign_capture`], with the graph's node count.
pub fn end_foreign_capture_counting(stream: &Stream) -> (CUresult, usize) {
    let driver = sys::driver().unwrap();
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun on this thread; a valid out-pointer.
    let ended = unsafe { driver.cuStreamEndCapture().unwrap()(stream.as_raw(), &mut graph) };
    let mut nodes = 0;
    if !graph.is_null() {
        // SAFETY: the graph just handed back, destroyed once.
        unsafe {
            assert_eq!(
                driver.cuGraphGetNodes().unwrap()(graph, std::ptr::null_mut(), &mut nodes),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(driver.cuGraphDestroy().unwrap()(graph), CUresult::CUDA_SUCCESS);
        }
    }
    (ended, nodes)
}
