//! Streams and events: the order in which pool memory is handed out and given back.

use crate::context::Context;
use crate::driver::api;
use crate::error::{check, Error, Result};
use crate::handle::Shared;
use cumempool_sys as sys;
use std::sync::Arc;

/// A CUDA stream. Clones share it; an owned stream is destroyed when the last clone drops.
///
/// Buffers keep a clone of the stream they are freed on, so a stream outlives its buffers.
#[derive(Clone, Debug)]
pub struct Stream(Arc<StreamInner>);

#[derive(Debug)]
struct StreamInner {
    raw: Shared<sys::CUstream>,
    /// `None` for the legacy default stream and borrowed streams given without a context: work
    /// on them runs in whatever context is current on the calling thread.
    context: Option<Context>,
    owned: bool,
}

impl Stream {
    /// A new non-blocking stream in `context` (it does not synchronise with the legacy stream).
    ///
    /// See [cuStreamCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn new(context: &Context) -> Result<Self> {
        context.ensure_current()?;
        let f = api()?.cuStreamCreate()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        // SAFETY: valid out-pointer; the context is current.
        check(unsafe { f(&mut raw, flags) }, "cuStreamCreate")?;
        Ok(Self(Arc::new(StreamInner { raw: Shared(raw), context: Some(context.clone()), owned: true })))
    }

    /// The legacy default stream (`0`), in whatever context is current on the calling thread.
    /// Creating it calls no driver function.
    pub fn legacy() -> Self {
        Self(Arc::new(StreamInner { raw: Shared(std::ptr::null_mut()), context: None, owned: false }))
    }

    /// Borrows a stream created elsewhere (by another library, say); it is never destroyed here.
    ///
    /// With a context, that context is made current before work is queued on the stream;
    /// without, work runs in whatever context is current on the calling thread.
    ///
    /// # Safety
    /// `raw` must be a valid stream (of `context`, if given) and must outlive every clone of the
    /// result and every buffer allocated on it.
    pub unsafe fn borrow_raw(raw: sys::CUstream, context: Option<&Context>) -> Self {
        Self(Arc::new(StreamInner { raw: Shared(raw), context: context.cloned(), owned: false }))
    }

    /// The driver's handle.
    #[inline]
    pub fn as_raw(&self) -> sys::CUstream {
        self.0.raw.0
    }

    /// The context the stream belongs to, where known.
    #[inline]
    pub fn context(&self) -> Option<&Context> {
        self.0.context.as_ref()
    }

    /// Makes the stream's context current on this thread (if it has one), ready to queue work.
    #[inline]
    pub fn bind(&self) -> Result<()> {
        match &self.0.context {
            Some(context) => context.ensure_current(),
            None => Ok(()),
        }
    }

    /// Whether this handle destroys the stream (false for [`Stream::borrow_raw`]).
    pub fn is_owned(&self) -> bool {
        self.0.owned
    }

    /// Waits until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        let f = api()?.cuStreamSynchronize()?;
        // SAFETY: a live stream.
        check(unsafe { f(self.as_raw()) }, "cuStreamSynchronize")
    }

    /// Whether all queued work has finished, without waiting.
    pub fn is_idle(&self) -> Result<bool> {
        let f = api()?.cuStreamQuery()?;
        // SAFETY: a live stream.
        match unsafe { f(self.as_raw()) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(Error::driver(code, "cuStreamQuery")),
        }
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        let f = api()?.cuStreamWaitEvent()?;
        // SAFETY: live stream and event.
        check(unsafe { f(self.as_raw(), event.as_raw(), 0) }, "cuStreamWaitEvent")
    }

    /// Whether two handles name the same driver stream.
    pub fn same_as(&self, other: &Stream) -> bool {
        self.as_raw() == other.as_raw()
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let bound = self.context.as_ref().map_or(Ok(()), Context::ensure_current);
        let result = bound.and_then(|()| {
            let f = api()?.cuStreamDestroy()?;
            // SAFETY: an owned stream, destroyed once.
            check(unsafe { f(self.raw.0) }, "cuStreamDestroy")
        });
        if let Err(error) = result {
            tracing::warn!(%error, "destroying a stream failed");
        }
    }
}

/// A CUDA event without timing: a point in a stream that other streams and the host can wait on.
#[derive(Debug)]
pub struct Event {
    raw: Shared<sys::CUevent>,
    context: Context,
}

impl Event {
    /// A new event in `context`.
    ///
    /// See [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    pub fn new(context: &Context) -> Result<Self> {
        context.ensure_current()?;
        let f = api()?.cuEventCreate()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        // SAFETY: valid out-pointer; the context is current.
        check(unsafe { f(&mut raw, flags) }, "cuEventCreate")?;
        Ok(Self { raw: Shared(raw), context: context.clone() })
    }

    /// The driver's handle.
    #[inline]
    pub fn as_raw(&self) -> sys::CUevent {
        self.raw.0
    }

    /// Records the event at the current end of `stream`.
    #[inline]
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let f = api()?.cuEventRecord()?;
        // SAFETY: live event and stream.
        check(unsafe { f(self.raw.0, stream.as_raw()) }, "cuEventRecord")
    }

    /// Whether the work before the last record has finished, without waiting.
    #[inline]
    pub fn is_complete(&self) -> Result<bool> {
        let f = api()?.cuEventQuery()?;
        // SAFETY: a live event.
        match unsafe { f(self.raw.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(Error::driver(code, "cuEventQuery")),
        }
    }

    /// Waits on the host until the work before the last record has finished.
    pub fn synchronize(&self) -> Result<()> {
        let f = api()?.cuEventSynchronize()?;
        // SAFETY: a live event.
        check(unsafe { f(self.raw.0) }, "cuEventSynchronize")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let result = self.context.ensure_current().and_then(|()| {
            let f = api()?.cuEventDestroy()?;
            // SAFETY: an owned event, destroyed once.
            check(unsafe { f(self.raw.0) }, "cuEventDestroy")
        });
        if let Err(error) = result {
            tracing::warn!(%error, "destroying an event failed");
        }
    }
}
