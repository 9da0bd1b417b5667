//! The calling thread's stream capture mode, relaxed around the library's host waits.
//!
//! While a capture is underway, the driver refuses "potentially unsafe" calls (host waits and
//! status queries: `cuStreamSynchronize`, `cuStreamQuery`, `cuEventSynchronize`, `cuEventQuery`)
//! on the capturing thread for a thread-local capture, and on every thread whose mode is global
//! for a global one, and invalidates that capture, even when the call concerns a stream that
//! does not capture. Other code's captures are invisible to the library, so its host waits run
//! in relaxed mode, as PyTorch's `CUDAStreamCaptureModeGuard` does: a wait on work that is not
//! being captured is harmless to any capture. Relaxed mode does not make a wait on a capturing
//! stream legal; callers refuse that first ([`Error::StreamCapturing`](crate::Error)).
//!
//! Host waits are not hot paths: two driver calls that only swap a per-thread value.

use crate::driver::driver_call;
use crate::error::{Error, Result};
use cumempool_sys as sys;

/// Runs `wait` (a host wait or status query on work that does not capture) with the calling
/// thread's capture mode relaxed, and restores the thread's previous mode after. Public as
/// `in_relaxed_capture_mode` for layers above that work beside another library's capture on a
/// stream of their own (an allocator plug-in serving a capture), which a capture in global or
/// thread-local mode would forbid the thread and be invalidated by.
///
/// # Errors
/// The driver's refusal to change the mode (`cuThreadExchangeStreamCaptureMode`), before `wait`
/// runs; otherwise `wait`'s result. A failed restore leaves the thread relaxed, which refuses
/// nothing the thread's own captures need, and is logged.
pub fn relaxed<T, E: From<Error>>(wait: impl FnOnce() -> std::result::Result<T, E>) -> std::result::Result<T, E> {
    let previous = exchange(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let result = wait();
    if let Err(error) = exchange(previous) {
        tracing::warn!(%error, ?previous, "restoring the thread's capture mode after a host wait failed");
    }
    result
}

/// Runs `wait` (a host wait that memory about to be released depends on) in relaxed mode where
/// the mode can be changed, and as the thread is where it cannot: such a wait must not be skipped
/// for a failed mode change. The driver may then refuse it (and invalidate a capture on this
/// thread), which `wait`'s result says.
pub(crate) fn relaxed_if_possible<T>(wait: impl FnOnce() -> Result<T>) -> Result<T> {
    match exchange(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) {
        Ok(previous) => {
            let result = wait();
            if let Err(error) = exchange(previous) {
                tracing::warn!(%error, ?previous, "restoring the thread's capture mode after a host wait failed");
            }
            result
        }
        Err(error) => {
            tracing::warn!(%error, "relaxing the thread's capture mode before a host wait failed; waiting in its own mode");
            wait()
        }
    }
}

/// Sets the calling thread's capture mode to `mode` and answers the one it replaces.
///
/// See [cuThreadExchangeStreamCaptureMode](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
fn exchange(mode: sys::CUstreamCaptureMode) -> Result<sys::CUstreamCaptureMode> {
    let mut mode = mode;
    // SAFETY: a valid in/out pointer; the call only swaps the calling thread's mode.
    unsafe { driver_call!(cuThreadExchangeStreamCaptureMode(&mut mode)) }?;
    Ok(mode)
}
