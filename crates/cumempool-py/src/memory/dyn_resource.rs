//! A stream-ordered resource behind one object-safe trait, its memory kind erased, so that
//! Python can stack adaptors freely and a buffer can give its memory back to whatever made it.

use cumempool::sys::CUdeviceptr;
use cumempool_alloc::{DeviceMemory, StreamOrderedResource, POOL_ALIGNMENT};
use std::sync::Arc;

/// A stream-ordered resource with its memory kind erased, so Python can stack adaptors freely.
pub trait Resource: Send + Sync {
    /// Allocates `bytes` (pool alignment) ordered on `stream`.
    fn allocate(&self, bytes: usize, stream: &cumempool::Stream) -> cumempool_alloc::Result<CUdeviceptr>;

    /// [`StreamOrderedResource::allocate_unless_capturing`]: `None`, with nothing allocated,
    /// where a capture is underway on `stream` or the driver cannot say.
    fn allocate_unless_capturing(
        &self,
        bytes: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<Option<CUdeviceptr>>;

    /// Frees in stream order.
    ///
    /// # Safety
    /// `ptr` must come from `allocate` on this resource with the same `bytes`, be freed once,
    /// and no work may use it after the free in the order of `stream`.
    unsafe fn deallocate(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<()>;

    /// [`StreamOrderedResource::frees_legacy_after_blocking_captures`].
    fn frees_legacy_after_blocking_captures(&self) -> bool;
}

impl<R: StreamOrderedResource> Resource for R {
    #[inline]
    fn allocate(&self, bytes: usize, stream: &cumempool::Stream) -> cumempool_alloc::Result<CUdeviceptr> {
        StreamOrderedResource::allocate(self, bytes, POOL_ALIGNMENT, stream)
    }

    #[inline]
    fn allocate_unless_capturing(
        &self,
        bytes: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<Option<CUdeviceptr>> {
        StreamOrderedResource::allocate_unless_capturing(self, bytes, POOL_ALIGNMENT, stream)
    }

    #[inline]
    unsafe fn deallocate(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { StreamOrderedResource::deallocate(self, ptr, bytes, POOL_ALIGNMENT, stream) }
    }

    fn frees_legacy_after_blocking_captures(&self) -> bool {
        StreamOrderedResource::frees_legacy_after_blocking_captures(self)
    }
}

/// `bytes` from `resource` on `stream` through the raw `allocate`, after the caller's own capture
/// check; `None` where a capture begun on `stream` after that check, inside the allocation
/// (another thread's, or Python code a finalizer or an out-of-memory callback ran), made the
/// memory the graph's (the pool records it): no Buffer and no other library may hold it. Given
/// back inside the capture or after it, as the core decides. One relaxed load while no graph
/// memory is outstanding, and only on a stream that may capture. `allocate_unless_capturing`
/// does the same below a refusing call.
pub(crate) fn allocate_unless_a_capture_took_it(
    resource: &dyn Resource,
    bytes: usize,
    stream: &cumempool::Stream,
) -> cumempool_alloc::Result<Option<CUdeviceptr>> {
    let ptr = resource.allocate(bytes, stream)?;
    if !(stream.may_be_capturing() && cumempool::is_captured_allocation(ptr)) {
        return Ok(Some(ptr));
    }
    // SAFETY: just allocated by `resource` with `bytes` bytes on `stream`, freed once, never
    // used.
    if let Err(error) = unsafe { resource.deallocate(ptr, bytes, stream) } {
        tracing::warn!(%error, bytes, "giving back memory a capture took failed");
    }
    Ok(None)
}

/// A resource chosen at run time, as a typed resource for the Rust adaptors. It claims device
/// memory, the narrowest kind (every kind is device-accessible); Python tracks the real kind.
#[derive(Clone)]
pub struct Erased(pub Arc<dyn Resource>);

// SAFETY: forwards to a resource that keeps the promise; device memory is the narrowest claim.
unsafe impl StreamOrderedResource for Erased {
    type Kind = DeviceMemory;

    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &cumempool::Stream) -> cumempool_alloc::Result<CUdeviceptr> {
        check_alignment(align)?;
        self.0.allocate(bytes, stream)
    }

    // Handed down, so that an adaptor over a Python stack with a cache in it asks once.
    #[inline]
    fn allocate_unless_capturing(
        &self,
        bytes: usize,
        align: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<Option<CUdeviceptr>> {
        check_alignment(align)?;
        self.0.allocate_unless_capturing(bytes, stream)
    }

    #[inline]
    unsafe fn deallocate(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        _align: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.0.deallocate(ptr, bytes, stream) }
    }

    fn frees_legacy_after_blocking_captures(&self) -> bool {
        self.0.frees_legacy_after_blocking_captures()
    }

    // The question of every adaptor over a Python stack (a cache's, a limit's), asked with the
    // GIL held above the bottom's `DriverLink`, which puts the caller's context back only around
    // its own calls: on the per-thread stream's legacy stand-in the default question would make
    // the stream's context current and leave it so (another device's, for the Python code).
    fn is_capturing(&self, stream: &cumempool::Stream) -> cumempool_alloc::Result<bool> {
        Ok(stream.is_capturing_keeping_context()?)
    }
}

/// Refuses an alignment the pools do not guarantee.
fn check_alignment(align: usize) -> cumempool_alloc::Result<()> {
    if align > POOL_ALIGNMENT || !align.is_power_of_two() {
        return Err(cumempool_alloc::Error::Alignment {
            requested: align,
            reason: format!("pools guarantee {POOL_ALIGNMENT}-byte alignment; ask for {POOL_ALIGNMENT} or less"),
        });
    }
    Ok(())
}
