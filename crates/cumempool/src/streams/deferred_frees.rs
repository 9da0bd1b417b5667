//! Frees of memory allocated outside a capture, asked for while the stream was capturing:
//! kept with the pool they keep alive, and run on the stream once its capture is over.

use crate::bare_pools::pool_owner::Owner;
use crate::driver::driver_call;
use crate::error::Result;
use crate::streams::capture_mode;
use crate::streams::capture_state::{capture_info, refuse_host_wait_on_capturing_thread, CaptureStatus};
use cumempool_sys as sys;
use std::sync::Arc;

/// A free waiting for its stream's capture to end, with the pool it keeps alive until then.
#[derive(Debug)]
pub(crate) struct DeferredFree {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) pool: Option<Arc<Owner>>,
}

/// `cuMemFreeAsync` of each deferred free on `stream`; imported allocations are forgotten as
/// mapped once their unmapping has run, and stay marked as mapped (never imported again) where
/// a capture beside `stream` forbids waiting for it. Answers the frees the legacy stream refused
/// for a capture a blocking stream began since it was asked (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`):
/// still live, for the caller to keep waiting.
#[must_use = "the frees a capture refused are still live: keep them"]
pub(crate) fn run_frees(stream: sys::CUstream, frees: Vec<DeferredFree>) -> Vec<DeferredFree> {
    let mut refused = Vec::new();
    if frees.is_empty() {
        return refused;
    }
    let mut imported = Vec::new();
    for free in frees {
        // SAFETY: a live stream-ordered allocation its buffer gave up when dropped, freed once.
        match unsafe { driver_call!(cuMemFreeAsync(free.ptr, stream)) } {
            Ok(()) if free.pool.as_ref().is_some_and(|pool| pool.imported) => imported.push(free.ptr),
            Ok(()) => {}
            Err(error) if error.is_refused_for_a_blocking_capture() => refused.push(free),
            Err(error) => tracing::warn!(%error, ptr = free.ptr, "a free deferred by a capture failed"),
        }
    }
    if imported.is_empty() {
        return refused;
    }
    // Invariant: a mapping is forgotten only once a wait saw its unmapping run, and the wait is
    // made only while nothing captures on or beside `stream`: the driver refuses a wait on the
    // legacy stream while a blocking stream captures, and invalidates that capture. One may have
    // begun during the batch (a refused free says so) or after its last free (the question says
    // so). Unwaited, the mappings stay marked as mapped: never imported again.
    let beside = if refused.is_empty() { captured_beside(stream) } else { Ok(true) };
    let waited = match beside {
        Ok(true) => {
            tracing::warn!(
                count = imported.len(),
                "a capture began beside the stream of deferred unmappings, which a wait would invalidate; they are not waited for and stay unimportable"
            );
            return refused;
        }
        Ok(false) => refuse_host_wait_on_capturing_thread("waiting for deferred unmappings")
            // SAFETY: a live stream, with no capture on it or beside it.
            .and_then(|()| capture_mode::relaxed(|| unsafe { driver_call!(cuStreamSynchronize(stream)) })),
        Err(error) => Err(error),
    };
    match waited {
        Ok(()) => imported.into_iter().for_each(crate::bare_pools::pool_owner::forget_mapping),
        Err(error) => tracing::warn!(%error, "waiting for deferred unmappings failed; they stay unimportable"),
    }
    refused
}

/// Whether a capture is underway on `stream` or, for the legacy stream, on a blocking stream of
/// its context (the driver's question then answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`).
fn captured_beside(stream: sys::CUstream) -> Result<bool> {
    match capture_info(stream) {
        Ok(status) => Ok(status != CaptureStatus::None),
        Err(error) if error.is_refused_for_a_blocking_capture() => Ok(true),
        Err(error) => Err(error),
    }
}
