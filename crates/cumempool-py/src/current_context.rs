//! The calling thread's current context around a binding's driver calls: made what the calls
//! need, then put back. Python code around the bindings (CuPy, the runtime's `cudaSetDevice`
//! state, a context of the caller's own) reads the current context, so a binding must not leave
//! another device's there. Invariant: whatever runs inside these functions, the caller's
//! context (or none) is current again when they return, and a failure of the call wins over a
//! failure to restore.

use crate::default_streams::names_legacy;
use crate::driver_answers::driver_answer;
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
    if !names_legacy(handle) {
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

/// The calling thread's current context (null for none).
pub fn current() -> cumempool::Result<sys::CUcontext> {
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
