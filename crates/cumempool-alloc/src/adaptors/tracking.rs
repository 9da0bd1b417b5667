//! Every outstanding allocation with its size, stream and, on request, where it was made: for
//! hunting leaks (RMM's tracking adaptor).

use crate::error::Result;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::{Stream, StreamId};
use std::backtrace::Backtrace;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

/// Records every allocation the resource it wraps hands out until it is freed.
///
/// Each allocation and free takes one lock, and with backtraces on each allocation captures
/// one (microseconds): a tool for finding leaks, not for the hot path.
#[derive(Debug)]
pub struct Tracking<R> {
    inner: R,
    backtraces: bool,
    outstanding: Mutex<HashMap<CUdeviceptr, Outstanding>>,
}

/// An allocation not yet freed.
#[derive(Clone, Debug)]
pub struct Outstanding {
    /// Its address.
    pub ptr: CUdeviceptr,
    /// Its size in bytes.
    pub bytes: usize,
    /// The stream it was allocated on.
    pub stream: StreamId,
    /// Where it was allocated, when the tracker captures backtraces.
    pub backtrace: Option<Arc<Backtrace>>,
}

impl<R> Tracking<R> {
    /// Tracks `inner`'s allocations, without backtraces.
    pub fn new(inner: R) -> Self {
        Self { inner, backtraces: false, outstanding: Mutex::new(HashMap::new()) }
    }

    /// Also captures a backtrace for each allocation (forced, whatever `RUST_BACKTRACE` says).
    pub fn with_backtraces(mut self, enabled: bool) -> Self {
        self.backtraces = enabled;
        self
    }

    /// The allocations not yet freed, lowest address first.
    pub fn outstanding(&self) -> Vec<Outstanding> {
        let mut all: Vec<Outstanding> = self.lock().values().cloned().collect();
        all.sort_by_key(|o| o.ptr);
        all
    }

    /// Bytes allocated and not yet freed.
    pub fn outstanding_bytes(&self) -> usize {
        self.lock().values().map(|o| o.bytes).sum()
    }

    /// What is still out, for a log: one line per allocation, each followed by its backtrace
    /// where captured. Empty when nothing is outstanding.
    pub fn report(&self) -> String {
        let all = self.outstanding();
        if all.is_empty() {
            return String::new();
        }
        let total: usize = all.iter().map(|o| o.bytes).sum();
        let mut out = format!("{} allocation(s), {total} bytes, outstanding:\n", all.len());
        for o in &all {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "  {:#x}: {} bytes on stream {}", o.ptr, o.bytes, o.stream.get());
            if let Some(backtrace) = &o.backtrace {
                let _ = writeln!(out, "{backtrace}");
            }
        }
        out
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    fn record(&self, ptr: CUdeviceptr, bytes: usize, stream: &Stream) {
        // Empty allocations have no memory to leak, and all share address 0.
        if bytes > 0 {
            let backtrace = self.backtraces.then(|| Arc::new(Backtrace::force_capture()));
            self.lock().insert(ptr, Outstanding { ptr, bytes, stream: stream.id(), backtrace });
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CUdeviceptr, Outstanding>> {
        // The map is whole after any panic (each update is one insert or remove).
        self.outstanding.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// SAFETY: forwards the resource below's memory unchanged.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for Tracking<R> {
    type Kind = R::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        let ptr = self.inner.allocate(bytes, align, stream)?;
        self.record(ptr, bytes, stream);
        Ok(ptr)
    }

    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        let ptr = self.inner.allocate_unless_capturing(bytes, align, stream)?;
        if let Some(ptr) = ptr {
            self.record(ptr, bytes, stream);
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // Forgotten even if the free below fails: the caller may not free it again.
        if bytes > 0 && self.lock().remove(&ptr).is_none() {
            tracing::warn!(ptr, bytes, "freeing an allocation this tracker never handed out");
        }
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.inner.deallocate(ptr, bytes, align, stream) }
    }

    crate::resource::forward_capture_checks!(|this| this.inner);
}
