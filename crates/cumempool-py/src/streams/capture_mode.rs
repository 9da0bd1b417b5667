//! The calling thread's stream capture mode, relaxed around a Python call: the plug-ins
//! allocate beside another library's capture on a stream of their own, which a capture in
//! global or thread-local mode would forbid. The thread's mode is always put back.

use crate::errors::Outcome;

/// Calls `call()` with the calling thread's stream capture mode relaxed, and puts the thread's
/// mode back after. For the plug-ins, which allocate beside another library's capture on a
/// stream of their own.
// A capture other code runs in global or thread-local mode forbids this thread the driver calls
// it deems "potentially unsafe" (an allocation on another stream among them) and invalidates
// itself on one; in relaxed mode they leave it intact.
#[pyo3::pyfunction]
pub fn _in_relaxed_capture_mode(call: pyo3::Bound<'_, pyo3::PyAny>) -> Outcome<pyo3::Py<pyo3::PyAny>> {
    use pyo3::prelude::*;
    cumempool::in_relaxed_capture_mode(|| Ok(call.call0().map(Bound::unbind)?))
}
