//! The handles CUDA reserves for default streams. They name no stream object of their own: the
//! legacy stream is the current context's, the per-thread stream the calling thread's, so every
//! module that meets a raw handle asks here before treating it as one stream.

/// `CU_STREAM_LEGACY`: the legacy default stream of the current context, as `0` is.
pub(crate) const LEGACY_HANDLE: usize = 1;

/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
pub(crate) const PER_THREAD_HANDLE: usize = 2;

/// Whether `handle` names the legacy default stream (`0` or `CU_STREAM_LEGACY`).
#[inline]
pub(crate) fn names_legacy(handle: usize) -> bool {
    matches!(handle, 0 | LEGACY_HANDLE)
}
