//! Counting bytes and allocations: current, peak and total.

use crate::error::Result;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts what passes through the resource it wraps.
#[derive(Debug, Default)]
pub struct Statistics<R> {
    inner: R,
    bytes: Counter,
    count: Counter,
}

#[derive(Debug, Default)]
struct Counter {
    current: AtomicUsize,
    peak: AtomicUsize,
    total: AtomicUsize,
}

impl Counter {
    fn add(&self, n: usize) {
        let now = self.current.fetch_add(n, Relaxed) + n;
        self.peak.fetch_max(now, Relaxed);
        self.total.fetch_add(n, Relaxed);
    }

    fn sub(&self, n: usize) {
        self.current.fetch_sub(n, Relaxed);
    }

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
    }
}

/// A snapshot of [`Statistics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes allocated and not yet freed.
    pub current_bytes: usize,
    /// The most `current_bytes` has been.
    pub peak_bytes: usize,
    /// Bytes ever allocated.
    pub total_bytes: usize,
    /// Allocations not yet freed.
    pub current_count: usize,
    /// The most `current_count` has been.
    pub peak_count: usize,
    /// Allocations ever made.
    pub total_count: usize,
}

impl<R> Statistics<R> {
    /// Counts for `inner`.
    pub fn new(inner: R) -> Self {
        Self { inner, bytes: Counter::default(), count: Counter::default() }
    }

    /// The counts now.
    pub fn usage(&self) -> Usage {
        Usage {
            current_bytes: self.bytes.current.load(Relaxed),
            peak_bytes: self.bytes.peak.load(Relaxed),
            total_bytes: self.bytes.total.load(Relaxed),
            current_count: self.count.current.load(Relaxed),
            peak_count: self.count.peak.load(Relaxed),
            total_count: self.count.total.load(Relaxed),
        }
    }

    /// Starts the peaks again from what is in use now (as `Pool::reset_used_mem_high` does for
    /// a pool), to measure the peak of one phase of a program. Totals keep counting.
    pub fn reset_peaks(&self) {
        self.bytes.reset_peak();
        self.count.reset_peak();
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    fn count_allocation(&self, bytes: usize) {
        self.bytes.add(bytes);
        self.count.add(1);
    }
}

// SAFETY: forwards the resource below's memory unchanged.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for Statistics<R> {
    type Kind = R::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        let ptr = self.inner.allocate(bytes, align, stream)?;
        self.count_allocation(bytes);
        Ok(ptr)
    }

    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        let ptr = self.inner.allocate_unless_capturing(bytes, align, stream)?;
        if ptr.is_some() {
            self.count_allocation(bytes);
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        let freed = unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        // Counted as freed even if the free below failed: the caller may not free it again.
        self.bytes.sub(bytes);
        self.count.sub(1);
        freed
    }

    crate::resource::forward_capture_checks!(|this| this.inner);
}
