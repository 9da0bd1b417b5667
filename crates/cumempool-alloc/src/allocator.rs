//! `allocator_api2::alloc::Allocator` for host-accessible pools, so `Vec` and `Box` can live in
//! pinned host, host NUMA or managed pool memory.

use crate::error::Result;
use crate::memory_kind::HostAccessible;
use crate::pool_resource::PoolResource;
use crate::resource::{StreamOrderedResource, POOL_ALIGNMENT};
use allocator_api2::alloc::{AllocError, Allocator};
use cumempool::{Context, Pool, Stream};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Allocates host-accessible pool memory for containers: `Vec::new_in(allocator.clone())`.
///
/// The allocator owns a stream. Pool memory is stream-ordered and a pool may hand back memory
/// another stream freed moments ago, so each allocation waits for that stream
/// (`cuStreamSynchronize`, a few microseconds) before the host may touch the memory; each free
/// is queued on it without waiting. Clones share the stream and the pool.
///
/// Alignments above the pools' guaranteed 256 bytes are refused (`AllocError`), never ignored.
/// Device-only pools cannot be used: `K` must be [`HostAccessible`], checked at compile time,
/// and the pool's route is checked against `K` when the allocator is made.
pub struct PoolAllocator<K: HostAccessible> {
    inner: Arc<Shared<K>>,
}

struct Shared<K: HostAccessible> {
    resource: PoolResource<K>,
    stream: Stream,
}

impl<K: HostAccessible> Clone for PoolAllocator<K> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<K: HostAccessible> std::fmt::Debug for PoolAllocator<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolAllocator")
            .field("pool", &self.inner.resource.pool().as_raw())
            .field("kind", &K::NAME)
            .finish()
    }
}

impl<K: HostAccessible> PoolAllocator<K> {
    /// An allocator over `pool` with a new stream in `context`.
    ///
    /// # Errors
    /// [`Error::KindMismatch`](crate::Error::KindMismatch) for a pool of another memory kind;
    /// for managed memory, [`cumempool::Error::ManagedMemoryNotHostAccessible`] on machines
    /// whose devices lack concurrent managed access (the host may not touch managed memory
    /// there while kernels run); a stream the driver refuses.
    pub fn new(pool: &Pool, context: &Context) -> Result<Self> {
        let resource = PoolResource::new(pool)?;
        if pool.allocation_type()? == cumempool::AllocationType::Managed {
            cumempool::require_concurrent_managed_access()?;
        }
        let stream = Stream::new(context)?;
        Ok(Self { inner: Arc::new(Shared { resource, stream }) })
    }

    /// The allocator's stream.
    pub fn stream(&self) -> &Stream {
        &self.inner.stream
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        self.inner.resource.pool()
    }
}

// SAFETY: memory handed out stays valid until deallocated (the allocator keeps its pool and
// stream alive), is host-accessible by `K`, is aligned as asked or refused, and clones share
// one pool, so memory may be freed through any clone.
unsafe impl<K: HostAccessible> Allocator for PoolAllocator<K> {
    fn allocate(&self, layout: Layout) -> std::result::Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            let dangling = NonNull::new(layout.align() as *mut u8).ok_or(AllocError)?;
            return Ok(NonNull::slice_from_raw_parts(dangling, 0));
        }
        if layout.align() > POOL_ALIGNMENT {
            tracing::debug!(align = layout.align(), "refusing an alignment above the pool guarantee");
            return Err(AllocError);
        }
        let shared = &self.inner;
        let ptr = shared.resource.allocate(layout.size(), layout.align(), &shared.stream).map_err(|_| AllocError)?;
        if shared.stream.synchronize().is_err() {
            // SAFETY: just allocated with this size on this stream, never handed out.
            let _ = unsafe { shared.resource.deallocate(ptr, layout.size(), layout.align(), &shared.stream) };
            return Err(AllocError);
        }
        let ptr = NonNull::new(ptr as usize as *mut u8).ok_or(AllocError)?;
        Ok(NonNull::slice_from_raw_parts(ptr, layout.size()))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let shared = &self.inner;
        let address = ptr.as_ptr() as usize as cumempool::sys::CUdeviceptr;
        // SAFETY: the caller returns memory this allocator (or a clone) handed out with `layout`.
        if let Err(error) =
            unsafe { shared.resource.deallocate(address, layout.size(), layout.align(), &shared.stream) }
        {
            tracing::warn!(%error, "freeing container memory failed");
        }
    }
}
