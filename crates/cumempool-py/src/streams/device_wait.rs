//! Waiting for every launch queued on a device, which a capture underway on it does not
//! survive: `cuCtxSynchronize` invalidates any capture of the context, in every capture mode,
//! relaxed included (driver 580, measured). So the waits here are refused while a capture is
//! known, and each caller asks first about the captures it alone can see.

use crate::errors::Outcome;
use crate::streams::primary_contexts::primary_context;
use pyo3::prelude::*;

/// Waits for every launch queued on `device` (its primary context), in relaxed capture mode,
/// the caller's context kept. A capture underway on the device would be invalidated: callers
/// ask first.
pub(crate) fn wait_for_device(device: i32) -> cumempool::Result<()> {
    let context = primary_context(device)?;
    cumempool::in_relaxed_capture_mode(|| cumempool::keeping_current_context(|| context.synchronize()))
}

/// `_wait_for_device(device)`: waits for `device`, for a plug-in that gives back memory a graph
/// may have used (the CuPy plug-in's `release_captured`, after it asked its own capturing
/// streams). Refused with `StreamCapturingError`, the capture left intact, while a blocking
/// stream of the device captures (the legacy stream's answer: CuPy's streams are blocking by
/// default, and so is every thread's per-thread stream).
#[pyfunction]
pub fn _wait_for_device(py: Python<'_>, device: i32) -> Outcome<()> {
    let legacy = crate::streams::default_streams::legacy_stream(device)?;
    if legacy.blocked_by_a_capture()? {
        return Err(cumempool::Error::StreamCapturing { operation: RELEASE_CAPTURED, capture: None }.into());
    }
    crate::sync::gil::detach(py, || wait_for_device(device))?;
    Ok(())
}

const RELEASE_CAPTURED: &str =
    "giving back memory kept for graphs (release_captured waits for the device, which a capture on it does not survive)";
