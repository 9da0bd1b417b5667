//! The calling thread's current context around a binding's driver calls: made what the calls
//! need, then put back. Python code around the bindings (CuPy, the runtime's `cudaSetDevice`
//! state, a context of the caller's own) reads the current context, so a binding must not leave
//! another device's there.

use crate::errors::Outcome;
use cumempool::sys;

/// Runs `call` with `context` current on the calling thread, then makes current again whatever
/// was before (no context included). `call`'s failure wins over a failure to restore.
pub fn while_current<R>(context: &cumempool::Context, call: impl FnOnce() -> Outcome<R>) -> Outcome<R> {
    let previous = current()?;
    if previous == context.as_raw() {
        return call();
    }
    context.make_current()?;
    let outcome = call();
    let restored = set_current(previous);
    let value = outcome?;
    restored?;
    Ok(value)
}

/// Runs `call` on the stream `handle` and puts back the caller's context if `call` changed
/// it: work queued on a legacy stream makes the stream's context current first. Ordinary
/// streams carry their context, so they cost nothing here. `call`'s failure wins over a
/// failure to restore.
pub fn restored_after<R, E: From<cumempool::Error>>(
    handle: usize,
    call: impl FnOnce() -> Result<R, E>,
) -> Result<R, E> {
    if !matches!(handle, 0 | LEGACY_HANDLE) {
        return call();
    }
    let previous = current()?;
    let outcome = call();
    let restored = match current() {
        Ok(now) if now == previous => Ok(()),
        Ok(_) => set_current(previous),
        Err(error) => Err(error),
    };
    let value = outcome?;
    restored?;
    Ok(value)
}

/// `CU_STREAM_LEGACY`, which names the legacy stream like `0`.
const LEGACY_HANDLE: usize = 1;

/// The calling thread's current context (null for none).
fn current() -> cumempool::Result<sys::CUcontext> {
    let get = sys::driver().and_then(|d| d.cuCtxGetCurrent())?;
    let mut context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    driver_answer("cuCtxGetCurrent", unsafe { get(&mut context) })?;
    Ok(context)
}

/// Makes `context` (a context that was current, so live, or null) current again.
fn set_current(context: sys::CUcontext) -> cumempool::Result<()> {
    let set = sys::driver().and_then(|d| d.cuCtxSetCurrent())?;
    // SAFETY: the context was current on this thread a moment ago (its holder keeps it), or null,
    // which unbinds the thread's context.
    driver_answer("cuCtxSetCurrent", unsafe { set(context) })
}

/// A driver answer as an outcome.
pub fn check(function: &'static str, code: sys::CUresult) -> Outcome<()> {
    Ok(driver_answer(function, code)?)
}

fn driver_answer(function: &'static str, code: sys::CUresult) -> cumempool::Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(cumempool::Error::Driver(cumempool::DriverError::new(function, code)))
}

/// Calls `call` with the calling thread's capture mode relaxed, and puts the thread's mode back
/// after: a capture other code runs in global or thread-local mode forbids this thread calls the
/// driver calls "potentially unsafe" (an allocation on another stream among them) and
/// invalidates itself on one; in relaxed mode they leave it intact. For the plug-ins, which
/// allocate beside another library's capture on a stream of their own.
#[pyo3::pyfunction]
pub fn _in_relaxed_capture_mode(
    py: pyo3::Python<'_>,
    call: pyo3::Bound<'_, pyo3::PyAny>,
) -> Outcome<pyo3::Py<pyo3::PyAny>> {
    use pyo3::prelude::*;
    let exchange = sys::driver().and_then(|d| d.cuThreadExchangeStreamCaptureMode()).map_err(cumempool::Error::from)?;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer; the previous mode comes back in it.
    check("cuThreadExchangeStreamCaptureMode", unsafe { exchange(&mut mode) })?;
    let called = call.call0().map(Bound::unbind);
    // SAFETY: as above; puts the caller's mode back.
    let restored = check("cuThreadExchangeStreamCaptureMode", unsafe { exchange(&mut mode) });
    let _ = py;
    let value = called?;
    restored?;
    Ok(value)
}
