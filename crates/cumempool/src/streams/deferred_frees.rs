//! Frees of memory allocated outside a capture, asked for while the stream was capturing:
//! kept with the pool they keep alive, and run on the stream once its capture is over.

use crate::bare_pools::pool_owner::Owner;
use crate::driver::driver_call;
use crate::error::Error;
use crate::streams::capture_mode;
use crate::streams::capture_state::{capture_beside, is_legacy_handle, refuse_host_wait_on_capturing_thread, Beside};
use cumempool_sys as sys;
use std::sync::Arc;

/// A free waiting for its stream's capture to end, with the pool it keeps alive until then.
#[derive(Debug)]
pub(crate) struct DeferredFree {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) pool: Option<Arc<Owner>>,
    /// Set once the free of an imported allocation has run on the legacy stream and only the
    /// host wait for its unmapping is owed: a blocking stream's capture forbade the wait then.
    pub(crate) unmapped: bool,
}

impl DeferredFree {
    /// The free of `ptr`, not run yet, keeping `pool` alive until it runs.
    pub(crate) fn new(ptr: sys::CUdeviceptr, pool: Option<&Arc<Owner>>) -> Self {
        Self { ptr, pool: pool.cloned(), unmapped: false }
    }

    /// This free of imported memory, run: only the wait for its unmapping is owed.
    pub(crate) fn into_owed_wait(self) -> Self {
        Self { unmapped: true, ..self }
    }
}

/// `cuMemFreeAsync` of each deferred free on `stream`; imported allocations are forgotten as
/// mapped once a host wait saw their unmapping run. Answers what must keep waiting with the
/// legacy stream: the frees it refused for a capture a blocking stream began since it was
/// asked (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), still live, and the unmappings whose wait
/// such a capture forbids, owed.
#[must_use = "the frees a capture refused are still live, and owed waits still owed: keep them"]
pub(crate) fn run_frees(stream: sys::CUstream, frees: Vec<DeferredFree>) -> Vec<DeferredFree> {
    let mut refused = Vec::new();
    if frees.is_empty() {
        return refused;
    }
    let mut imported = Vec::new();
    for free in frees {
        if free.unmapped {
            imported.push(free);
            continue;
        }
        // SAFETY: a live stream-ordered allocation its buffer gave up when dropped, freed once.
        match unsafe { driver_call!(cuMemFreeAsync(free.ptr, stream)) } {
            Ok(()) if free.pool.as_ref().is_some_and(|pool| pool.imported) => imported.push(free),
            Ok(()) => {}
            Err(error) if error.is_refused_for_a_blocking_capture() => refused.push(free),
            Err(error) => tracing::warn!(%error, ptr = free.ptr, "a free deferred by a capture failed"),
        }
    }
    if imported.is_empty() {
        return refused;
    }
    // Invariant: a mapping is forgotten only once a wait saw its unmapping run, and the wait is
    // made only when the question found nothing capturing on or beside `stream`: the driver
    // refuses a wait on the legacy stream while a blocking stream captures, and invalidates that
    // capture. One may have begun during the batch (a refused free says so, and only the legacy
    // stream refuses for it) or after its last free (the question says so). Then the wait is
    // owed, kept with the legacy stream's frees, as it is when a capture on the calling thread
    // refuses the wait for now; a capture on `stream` itself leaves the mappings marked as
    // mapped for good.
    let beside = if refused.is_empty() { capture_beside(stream) } else { Ok(Beside::BlockingCapture) };
    let waited = match beside {
        Ok(Beside::BlockingCapture) => {
            refused.extend(imported.into_iter().map(DeferredFree::into_owed_wait));
            return refused;
        }
        Ok(Beside::OwnCapture) => {
            tracing::warn!(
                count = imported.len(),
                "the stream of deferred unmappings captures again, which a wait would invalidate; they are not waited for and stay unimportable"
            );
            return refused;
        }
        Ok(Beside::Nothing) => refuse_host_wait_on_capturing_thread("waiting for deferred unmappings")
            // SAFETY: a live stream, with no capture on it or beside it.
            .and_then(|()| capture_mode::relaxed(|| unsafe { driver_call!(cuStreamSynchronize(stream)) })),
        Err(error) => Err(error),
    };
    match waited {
        Ok(()) => imported.into_iter().for_each(|free| crate::bare_pools::pool_owner::forget_mapping(free.ptr)),
        // Refused for now, on the legacy stream: owed, under the key its frees wait with.
        Err(error) if is_legacy_handle(stream) && refused_for_now(&error) => {
            refused.extend(imported.into_iter().map(DeferredFree::into_owed_wait));
        }
        Err(error) => tracing::warn!(%error, "waiting for deferred unmappings failed; they stay unimportable"),
    }
    refused
}

/// Whether a capture refused a host wait, which a later attempt may make: one on the calling
/// thread ([`Error::StreamCapturing`]) or, on the legacy stream, a blocking stream's begun since
/// the question.
pub(crate) fn refused_for_now(error: &Error) -> bool {
    matches!(error, Error::StreamCapturing { .. }) || error.is_refused_for_a_blocking_capture()
}
