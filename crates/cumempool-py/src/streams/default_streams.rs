//! The handles CUDA reserves for default streams. They name no stream object of their own: the
//! legacy stream is the current context's, the per-thread stream the calling thread's, so every
//! module that meets a raw handle asks here before treating it as one stream.

use crate::streams::primary_contexts::{primary_context, PerDevice};

/// `CU_STREAM_LEGACY`: the legacy default stream of the current context, as `0` is.
pub(crate) const LEGACY_HANDLE: usize = 1;

/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
pub(crate) const PER_THREAD_HANDLE: usize = 2;

/// Whether `handle` names the legacy default stream (`0` or `CU_STREAM_LEGACY`).
#[inline]
pub(crate) fn names_legacy(handle: usize) -> bool {
    matches!(handle, 0 | LEGACY_HANDLE)
}

/// Whether work on `device`'s legacy stream would be refused for a capture underway: while a
/// blocking stream of the context captures, the driver refuses legacy-stream work and
/// invalidates that capture, and a question of the legacy stream answers with an error instead,
/// leaving it intact. An answer that cannot be had counts as blocked.
pub(crate) fn legacy_stream_blocked(device: i32) -> bool {
    legacy_stream(device).map_or(true, |legacy| legacy.is_blocked_by_a_capture())
}

/// The legacy stream of `device`'s primary context, made once per device: the plug-ins ask
/// it at every allocation on a default stream, so it is found without a lock.
pub(crate) fn legacy_stream(device: i32) -> cumempool::Result<&'static cumempool::Stream> {
    LEGACY_STREAMS.get_or_make(device, || Ok(cumempool::Stream::legacy(&primary_context(device)?)))
}

/// One legacy stream per device (`legacy_stream`); each holds its primary context, which the
/// bindings keep retained for the process anyway (`primary_contexts`). Apart from the Python
/// objects of `Stream::shared_legacy` (`stream.rs`): the torch plug-in asks without the GIL.
static LEGACY_STREAMS: PerDevice<cumempool::Stream> = PerDevice::new();
