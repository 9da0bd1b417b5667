//! cudarc interop (feature `cudarc`): cudarc's streams and contexts used as cumempool's, and the
//! reverse where it is sound.
//!
//! Routing is process-global, so a pool made current for a device route also serves cudarc's
//! `CudaStream::alloc` (it calls `cuMemAllocAsync`, which draws from the device's current pool)
//! without any change to the cudarc code. These conversions let the two libraries share streams
//! and contexts on top of that.
//!
//! Which directions are sound:
//! - cudarc stream -> [`Stream`]: safe. The `Stream` holds cudarc's `Arc<CudaStream>` until its
//!   last clone drops, so the stream outlives every buffer and cache entry made here; the
//!   `Stream` still has an identity of its own ([`Stream::id`]).
//! - cudarc context <-> [`Context`]: safe for primary contexts, both ways. Each side retains the
//!   device's primary context itself (`cuDevicePrimaryCtxRetain`), so each keeps it alive for as
//!   long as it needs, whatever the other does. Non-primary cudarc contexts are refused: a
//!   [`Context`] is a retained primary context.
//! - [`Stream`] -> cudarc stream: `unsafe`. cudarc builds a `CudaStream` from a raw handle only
//!   with `CudaContext::wrap_borrowed_stream`, which holds nothing of ours, and its `Arc` may be
//!   kept anywhere (every `CudaSlice` holds one), so nothing can tie the `Stream`'s life to it.

use crate::devices::context::Context;
use crate::devices::device::Device;
use crate::error::{DriverError, Error, InvalidArgumentReason, Result};
use crate::streams::stream::Stream;
use cudarc::driver::{CudaContext, CudaStream};
use cumempool_sys as sys;
use std::sync::Arc;

#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
impl Stream {
    /// cudarc's stream as a cumempool stream: allocate on it, cache on it, free on it.
    ///
    /// The result holds a clone of `stream` (and so its context) until its last clone drops.
    /// cudarc's default stream gets its context (primary contexts only); the per-thread stream
    /// is refused, as by [`Stream::borrow_raw`].
    ///
    /// Captures: cudarc may begin a capture on this stream (`CudaStream::begin_capture`), and
    /// cumempool asks the driver whether one is underway before each operation that a capture
    /// changes. A capture begun between that answer and the operation (from another thread,
    /// while a cumempool call on this stream runs) is not seen: the allocation or copy may then
    /// be recorded into the graph. Begin a capture on a stream only while no other thread works
    /// on it: what such a thread queues meanwhile lands in the graph or outside it by chance.
    ///
    /// # Errors
    /// [`Error::StreamNotBorrowable`] for the per-thread stream, and for the default stream of a
    /// non-primary context; the driver's refusal to retain the primary context.
    pub fn from_cudarc(stream: &Arc<CudaStream>) -> Result<Self> {
        let cudarc_context = stream.context();
        // A primary context's handle, for the legacy stream and for events; an ordinary stream of
        // another context needs none (the driver finds it from the handle).
        let context = if cudarc_context.is_primary() { Some(Context::from_cudarc(cudarc_context)?) } else { None };
        let raw = stream.cu_stream() as sys::CUstream;
        let keep_alive: Arc<dyn std::any::Any + Send + Sync> = stream.clone();
        // SAFETY: `raw` is cudarc's live stream of that context, and the keep-alive holds cudarc's
        // `Arc<CudaStream>`, which does not destroy it before the result's last clone drops.
        unsafe { Stream::borrow_raw_keeping(raw, context.as_ref(), keep_alive) }
    }

    /// This stream as cudarc's, in cudarc's handle of the stream's (primary) context.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream whose context is unknown; cudarc's refusal to
    /// retain the primary context.
    ///
    /// The stream is marked as one that may capture ([`Stream::may_be_capturing`]): cudarc can
    /// begin a capture on it from safe code (`CudaStream::begin_capture`), and cumempool's
    /// capture-aware operations then ask the driver before they touch it.
    ///
    /// # Safety
    /// The result holds no clone of this stream: a clone of this `Stream` must outlive the
    /// result and every clone of it, including those cudarc keeps (every `CudaSlice` allocated
    /// on it holds one).
    ///
    /// The caller also orders work between this stream and cudarc's other streams. cudarc's
    /// `wrap_borrowed_stream` leaves cudarc believing the wrapped stream is its context's only
    /// stream, so it inserts no event waits between it and its own streams (as it does between
    /// streams it created, while it tracks more than one); and cumempool's streams are
    /// non-blocking (`CU_STREAM_NON_BLOCKING`), so they do not synchronise with the legacy
    /// stream either. A `CudaSlice` written on one of cudarc's streams and read on this one (or
    /// the other way round) needs an explicit event, such as [`Event::record`](crate::Event::record)
    /// on one stream and [`Stream::wait`] on the other.
    pub unsafe fn to_cudarc(&self) -> Result<Arc<CudaStream>> {
        let Some(context) = self.context() else {
            return Err(Error::InvalidArgument {
                what: "handing a stream to cudarc",
                reason: InvalidArgumentReason::StreamWithoutContext,
            });
        };
        let cudarc_context = context.to_cudarc()?;
        // cudarc can begin a capture on it from safe code.
        self.note_capture_possible();
        if self.as_raw().is_null() {
            return Ok(cudarc_context.default_stream());
        }
        // SAFETY: a live stream of this context; the caller keeps it alive for the result.
        Ok(unsafe { cudarc_context.wrap_borrowed_stream(self.as_raw() as _) })
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
impl Context {
    /// cudarc's context as a cumempool context: the same primary context, retained once more,
    /// so either may be dropped first.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-primary context; the driver's refusal to retain the
    /// primary context.
    pub fn from_cudarc(context: &CudaContext) -> Result<Self> {
        if !context.is_primary() {
            return Err(Error::InvalidArgument {
                what: "using a cudarc context",
                reason: InvalidArgumentReason::NotPrimaryContext,
            });
        }
        let ordinal = i32::try_from(context.ordinal()).map_err(|_| Error::InvalidArgument {
            what: "using a cudarc context",
            reason: InvalidArgumentReason::OrdinalTooLarge { ordinal: context.ordinal() },
        })?;
        Device::get(ordinal)?.primary_context()
    }

    /// This primary context as cudarc's: cudarc retains it itself (`CudaContext::new`), so
    /// either may be dropped first.
    ///
    /// # Errors
    /// cudarc's answer, as [`Error::Driver`].
    pub fn to_cudarc(&self) -> Result<Arc<CudaContext>> {
        let ordinal = usize::try_from(self.device().ordinal()).map_err(|_| Error::InvalidArgument {
            what: "handing a context to cudarc",
            reason: InvalidArgumentReason::NegativeOrdinal { ordinal: self.device().ordinal() },
        })?;
        CudaContext::new(ordinal).map_err(|e| from_cudarc_error("cuDevicePrimaryCtxRetain", e))
    }
}

/// cudarc's driver error as this crate's, keeping its `CUresult`.
fn from_cudarc_error(function: &'static str, error: cudarc::driver::DriverError) -> Error {
    Error::Driver(DriverError::new(function, sys::CUresult(error.0 as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_borrowed_without_its_context_is_refused_with_a_reason_to_match() {
        // SAFETY: refused before any driver call.
        let stream = unsafe { Stream::borrow_raw(0x5000 as sys::CUstream, None) }.unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: refused before cudarc sees the stream.
        let refused = unsafe { stream.to_cudarc() }.map(|_| ());
        assert!(
            matches!(refused, Err(Error::InvalidArgument { reason: InvalidArgumentReason::StreamWithoutContext, .. })),
            "{refused:?}"
        );
    }
}
