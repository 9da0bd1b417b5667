//! The calling thread's current context around a binding's driver calls: made what the calls
//! need, then put back. Python code around the bindings (CuPy, the runtime's `cudaSetDevice`
//! state, a context of the caller's own) reads the current context, so a binding must not leave
//! another device's there. Invariant: whatever runs inside these functions, the caller's
//! context (or none) is current again when they return, and a failure of the call wins over a
//! failure to restore.

use crate::streams::default_streams::names_legacy;

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
    cumempool::keeping_current_context(call)
}
