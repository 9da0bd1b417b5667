//! Work the library queues on a private stream of its own, ordered after a stream other code
//! may capture at any moment (a graph launch, a copy): the marker event that orders it, and the
//! refusals when that other code's capture took the marker.
//!
//! The private stream is held by its caller alone, so nothing else can begin a capture on it:
//! it captures only by joining a capture through a marker that was recorded into one, and then
//! nothing may be queued on it (the capture's graph would run that work at every launch, after
//! the memory it uses is gone).

use crate::driver::{driver_answer, driver_call};
use crate::error::{Error, Result};
use crate::streams::capture_state::CaptureStatus;
use crate::streams::event::Event;
use crate::streams::stream::Stream;
use cumempool_sys as sys;

/// What a refusal says, for each way other code's capture can take a marker.
pub(crate) struct Hints {
    /// The private stream joined a capture through the marker (that capture is invalidated).
    pub(crate) joined: &'static str,
    /// A capture took the marker and ended before the private stream waited for it.
    pub(crate) captured: &'static str,
}

/// Orders `private` after the work queued on `before`: records `marker` there and makes
/// `private` wait for it. If `private` joined a capture through the marker, answers
/// [`Error::CaptureRefused`] for `what` with `hints.joined` (or [`Error::StreamCapturing`]), with
/// that capture invalidated so that its end gives no graph. The join is checked whether or not
/// the record and the wait succeeded, so that a joined stream waits for no further marker: the
/// driver refuses a capturing stream's wait for an event recorded outside its capture, and
/// invalidates that capture.
pub(crate) fn order_after(
    private: &Stream,
    before: &Stream,
    marker: &Event,
    what: &'static str,
    hints: &Hints,
) -> Result<()> {
    let ordered = marker.record(before).and_then(|()| private.wait(marker));
    if let status @ (CaptureStatus::Active { .. } | CaptureStatus::Invalidated { .. }) = private.capture_status()? {
        return Err(invalidate_capture(private, what, hints.joined, status.id()));
    }
    ordered
}

/// Refuses `what` if a capture took `marker` (recorded and waited for by [`order_after`]) and
/// ended before the wait: the wait then ordered nothing. Only "done" and "not yet" let the work
/// go on; any other answer leaves the order unknown, and is the error. Call in relaxed capture
/// mode, where the query disturbs no capture.
pub(crate) fn refuse_if_captured(marker: &Event, what: &'static str, hints: &Hints) -> Result<()> {
    // SAFETY: a live event; a query waits for nothing.
    let answer = unsafe { driver_answer!(cuEventQuery(marker.as_raw())) }?;
    match answer.code {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
        sys::CUresult::CUDA_ERROR_CAPTURED_EVENT => {
            Err(Error::CaptureRefused { what, hint: hints.captured, cause: answer.cause() })
        }
        _ => Err(answer.error()),
    }
}

/// Invalidates the capture `stream` takes part in, with a host wait on it (always refused there,
/// and the refusal invalidates the capture), and answers why `what` was refused: with `hint`
/// and the refused wait as its cause, or, if the wait was not refused (the capture had ended),
/// [`Error::StreamCapturing`] for `capture`.
pub(crate) fn invalidate_capture(
    stream: &Stream,
    what: &'static str,
    hint: &'static str,
    capture: Option<u64>,
) -> Error {
    // SAFETY: a live stream.
    match unsafe { driver_call!(cuStreamSynchronize(stream.as_raw())) } {
        Err(Error::Driver(cause)) => Error::CaptureRefused { what, hint, cause },
        _ => Error::StreamCapturing { operation: what, capture },
    }
}
