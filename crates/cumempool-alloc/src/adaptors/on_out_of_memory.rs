//! A second chance on out-of-memory: call the program, which may free memory, then retry
//! (RMM's failure callback adaptor).

use crate::error::Result;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;

/// On every no-memory answer of the resource it wraps ([`Error::is_out_of_memory`]), calls
/// `on_out_of_memory(requested bytes, attempt)` with attempts counted from 1; `true` retries the
/// allocation, `false` returns the out-of-memory error. Other errors return at once.
///
/// The function may free memory (drop a cache, release buffers, wait for a stream) before
/// answering; it decides how many times to retry, so it must say `false` at some point.
///
/// [`Error::is_out_of_memory`]: crate::Error::is_out_of_memory
pub struct OnOutOfMemory<R, F> {
    inner: R,
    on_out_of_memory: F,
}

impl<R: std::fmt::Debug, F> std::fmt::Debug for OnOutOfMemory<R, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnOutOfMemory").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<R, F: Fn(usize, u32) -> bool> OnOutOfMemory<R, F> {
    /// Calls `on_out_of_memory(requested, attempt)` when `inner` has no memory; `true` retries.
    pub fn new(inner: R, on_out_of_memory: F) -> Self {
        Self { inner, on_out_of_memory }
    }

    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// `allocate()`'s answer, with the callback asked after each no-memory answer whether to
    /// call it again.
    fn retrying<T>(&self, bytes: usize, allocate: impl Fn() -> Result<T>) -> Result<T> {
        let mut attempt = 0u32;
        loop {
            match allocate() {
                Err(error) if error.is_out_of_memory() => {
                    attempt = attempt.saturating_add(1);
                    if !(self.on_out_of_memory)(bytes, attempt) {
                        return Err(error);
                    }
                }
                answer => return answer,
            }
        }
    }
}

// SAFETY: forwards the resource below's memory unchanged (a retry is another call below).
unsafe impl<R, F> StreamOrderedResource for OnOutOfMemory<R, F>
where
    R: StreamOrderedResource,
    F: Fn(usize, u32) -> bool + Send + Sync,
{
    type Kind = R::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        self.retrying(bytes, || self.inner.allocate(bytes, align, stream))
    }

    /// The callback may run code that begins a capture on `stream`: each retry asks again, in
    /// the call below.
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        self.retrying(bytes, || self.inner.allocate_unless_capturing(bytes, align, stream))
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.inner.deallocate(ptr, bytes, align, stream) }
    }

    crate::resource::forward_capture_checks!(|this| this.inner);
}
