//! A `tracing` event for every allocation and free.

use crate::error::Result;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;

/// Emits a `debug` event (target `cumempool_alloc::traced`) for every allocation and free,
/// failures included, with size, alignment, address and stream.
#[derive(Debug)]
pub struct Traced<R> {
    inner: R,
    name: &'static str,
}

impl<R> Traced<R> {
    /// Traces `inner`, naming it `name` in the events.
    pub fn new(inner: R, name: &'static str) -> Self {
        Self { inner, name }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }
}

// SAFETY: forwards the resource below's memory unchanged.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for Traced<R> {
    type Kind = R::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        let result = self.inner.allocate(bytes, align, stream);
        match &result {
            Ok(ptr) => tracing::debug!(resource = self.name, bytes, align, ptr, stream = ?stream.as_raw(), "allocate"),
            Err(error) => {
                tracing::debug!(resource = self.name, bytes, align, %error, stream = ?stream.as_raw(), "allocate failed")
            }
        }
        result
    }

    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        let result = self.inner.allocate_unless_capturing(bytes, align, stream);
        match &result {
            Ok(Some(ptr)) => {
                tracing::debug!(resource = self.name, bytes, align, ptr, stream = ?stream.as_raw(), "allocate");
            }
            Ok(None) => tracing::debug!(
                resource = self.name,
                bytes,
                align,
                stream = ?stream.as_raw(),
                "allocate declined: a capture may be underway"
            ),
            Err(error) => {
                tracing::debug!(resource = self.name, bytes, align, %error, stream = ?stream.as_raw(), "allocate failed")
            }
        }
        result
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        let result = unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        match &result {
            Ok(()) => tracing::debug!(resource = self.name, bytes, align, ptr, stream = ?stream.as_raw(), "deallocate"),
            Err(error) => tracing::debug!(resource = self.name, bytes, ptr, %error, "deallocate failed"),
        }
        result
    }

    crate::resource::forward_capture_checks!(|this| this.inner);
}
