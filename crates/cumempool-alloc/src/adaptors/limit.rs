//! A cap on the bytes in use, turned into a typed out-of-memory error
//! ([`Error::is_out_of_memory`] is true for it, as for the pool's own).

use crate::error::{Error, Result};
use crate::resource::{CaptureMark, StreamOrderedResource};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Refuses allocations that would take the bytes in use past a limit.
#[derive(Debug)]
pub struct Limit<R> {
    inner: R,
    limit: usize,
    in_use: AtomicUsize,
}

impl<R> Limit<R> {
    /// At most `limit` bytes in use through `inner` at once.
    pub fn new(inner: R, limit: usize) -> Self {
        Self { inner, limit, in_use: AtomicUsize::new(0) }
    }

    /// Bytes in use now.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Relaxed)
    }

    /// The limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// Counts `bytes` as in use before they are allocated, so that two threads can never both
    /// pass the limit; given back by the caller where nothing is allocated.
    fn claim(&self, bytes: usize) -> Result<()> {
        let claimed =
            self.in_use.fetch_update(Relaxed, Relaxed, |used| used.checked_add(bytes).filter(|n| *n <= self.limit));
        match claimed {
            Ok(_) => Ok(()),
            Err(in_use) => Err(Error::LimitExceeded { requested: bytes, limit: self.limit, in_use }),
        }
    }
}

// SAFETY: forwards the resource below's memory unchanged.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for Limit<R> {
    type Kind = R::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        self.claim(bytes)?;
        self.inner.allocate(bytes, align, stream).inspect_err(|_| {
            self.in_use.fetch_sub(bytes, Relaxed);
        })
    }

    /// The limit is applied first, so that the one capture question is the resource below's;
    /// where it refuses, the question is asked here instead: a capture underway (or no answer)
    /// is answered `None`, as below, not as an out-of-memory, which would have an
    /// [`OnOutOfMemory`](crate::OnOutOfMemory) above run its callback inside the capture for
    /// an allocation refused anyway.
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        if let Err(exceeded) = self.claim(bytes) {
            if self.may_be_capturing(stream) && !matches!(self.is_capturing(stream), Ok(false)) {
                return Ok(None);
            }
            return Err(exceeded);
        }
        let allocated = self.inner.allocate_unless_capturing(bytes, align, stream);
        if !matches!(allocated, Ok(Some(_))) {
            self.in_use.fetch_sub(bytes, Relaxed);
        }
        allocated
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        let freed = unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        // After the free, so the limit is never exceeded while it runs; and even if it failed,
        // since the caller may not free the bytes again.
        self.in_use.fetch_sub(bytes, Relaxed);
        freed
    }

    crate::resource::forward_capture_checks!(|this| this.inner);
}
