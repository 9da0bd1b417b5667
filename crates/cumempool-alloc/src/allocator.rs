//! `allocator_api2::alloc::Allocator` over any resource of host-accessible memory, so `Vec`,
//! `Box` and `hashbrown` containers can live in pinned host, host NUMA or managed memory, also
//! through a cache or a limit.

use crate::error::Result;
use crate::memory_kind::{HostAccessible, MemoryKind};
use crate::pool_resource::PoolResource;
use crate::resource::{StreamOrderedResource, POOL_ALIGNMENT};
use allocator_api2::alloc::{AllocError, Allocator};
use cumempool::{Context, Pool, Stream};
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

/// Allocates host-accessible memory for containers from any [`StreamOrderedResource`] whose
/// kind is [`HostAccessible`]: `Vec::new_in(allocator.clone())`.
///
/// The allocator owns a stream. Pool memory is stream-ordered and a pool may hand back memory
/// another stream freed moments ago, so each allocation waits for that stream
/// (`cuStreamSynchronize`, a few microseconds) before the host may touch the memory; each free
/// is queued on it without waiting. Clones share the stream and the resource.
///
/// Alignments above the pools' guaranteed 256 bytes are refused (`AllocError`), never ignored.
/// Device-only memory cannot be used: the kind must be [`HostAccessible`], checked at compile
/// time, and managed memory is refused where the host may not touch it while kernels run.
pub struct ResourceAllocator<R: StreamOrderedResource>
where
    R::Kind: HostAccessible,
{
    inner: Arc<AllocatorState<R>>,
}

/// A [`ResourceAllocator`] straight over one pool: `PoolAllocator::<HostMemory>::new(&pool, &context)`.
pub type PoolAllocator<K> = ResourceAllocator<PoolResource<K>>;

/// What the clones of one allocator share.
struct AllocatorState<R> {
    resource: R,
    stream: Stream,
}

impl<R: StreamOrderedResource> Clone for ResourceAllocator<R>
where
    R::Kind: HostAccessible,
{
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone() }
    }
}

impl<R: StreamOrderedResource> std::fmt::Debug for ResourceAllocator<R>
where
    R::Kind: HostAccessible,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResourceAllocator")
            .field("kind", &<R::Kind as MemoryKind>::NAME)
            .field("stream", &self.inner.stream.id())
            .finish()
    }
}

impl<R: StreamOrderedResource> ResourceAllocator<R>
where
    R::Kind: HostAccessible,
{
    /// An allocator over `resource` with a new stream in `context`.
    ///
    /// # Errors
    /// For managed memory, [`cumempool::Error::ManagedMemoryNotHostAccessible`] on machines
    /// whose devices lack concurrent managed access (the host may not touch managed memory
    /// there while kernels run); a stream the driver refuses.
    pub fn with_resource(resource: R, context: &Context) -> Result<Self> {
        if <R::Kind as MemoryKind>::MIGRATES {
            cumempool::require_concurrent_managed_access()?;
        }
        let stream = Stream::new(context)?;
        Ok(Self { inner: Arc::new(AllocatorState { resource, stream }) })
    }

    /// The allocator's stream.
    pub fn stream(&self) -> &Stream {
        &self.inner.stream
    }

    /// The resource below.
    pub fn resource(&self) -> &R {
        &self.inner.resource
    }
}

impl<K: HostAccessible> ResourceAllocator<PoolResource<K>> {
    /// An allocator straight over `pool`, with a new stream in `context`.
    ///
    /// # Errors
    /// [`Error::KindMismatch`](crate::Error::KindMismatch) for a pool of another memory kind,
    /// and the errors of [`ResourceAllocator::with_resource`].
    pub fn new(pool: &Pool, context: &Context) -> Result<Self> {
        Self::with_resource(PoolResource::new(pool)?, context)
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        self.inner.resource.pool()
    }
}

#[cfg(feature = "cuda-13040")]
impl<R: StreamOrderedResource<Kind = crate::memory_kind::ManagedMemory>> ResourceAllocator<R> {
    /// Where the pages of managed memory this allocator handed out reside (driver 13.4): one
    /// [`Location`](cumempool::Location) per region of `summary_granularity` bytes of `memory`
    /// (a container's slice, such as `vec.as_slice()`), each the location most samples (every
    /// `sampling_granularity` bytes; 0 lets the system choose) found. See
    /// [`cumempool::location_info`].
    ///
    /// # Errors
    /// [`cumempool::Error::InvalidGranularity`] before the driver when the summary granularity
    /// is 0 or larger than `memory`, or the sampling granularity is larger than the summary
    /// granularity; [`cumempool::Error::DriverTooOld`] on a driver older than 13.4.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn location_info<T>(
        &self,
        memory: &[T],
        summary_granularity: usize,
        sampling_granularity: usize,
    ) -> Result<Vec<cumempool::Location>> {
        let address = memory.as_ptr() as usize as cumempool::sys::CUdeviceptr;
        Ok(cumempool::location_info(address, std::mem::size_of_val(memory), summary_granularity, sampling_granularity)?)
    }
}

// SAFETY: memory handed out comes from a resource, whose (unsafe) trait promises memory of the
// asked size and alignment, of its kind, used by no one else until freed; the kind is
// host-accessible, managed memory only where the host may touch it while kernels run, and the
// allocator waits for its stream before handing memory to the host. The allocator (and its
// clones) keep the resource and the stream alive, so memory may be freed through any clone.
unsafe impl<R: StreamOrderedResource> Allocator for ResourceAllocator<R>
where
    R::Kind: HostAccessible,
{
    fn allocate(&self, layout: Layout) -> std::result::Result<NonNull<[u8]>, AllocError> {
        if layout.size() == 0 {
            let dangling = NonNull::new(layout.align() as *mut u8).ok_or(AllocError)?;
            return Ok(NonNull::slice_from_raw_parts(dangling, 0));
        }
        if layout.align() > POOL_ALIGNMENT {
            tracing::debug!(align = layout.align(), "refusing an alignment above the pool guarantee");
            return Err(AllocError);
        }
        let state = &self.inner;
        let ptr = state.resource.allocate(layout.size(), layout.align(), &state.stream).map_err(|_| AllocError)?;
        let Some(address) = NonNull::new(ptr as usize as *mut u8) else {
            // A resource that answers a non-empty request with 0 broke its promise; nothing to free.
            return Err(AllocError);
        };
        if let Err(error) = state.stream.synchronize() {
            tracing::debug!(%error, "waiting for new container memory failed; giving it back");
            // SAFETY: just allocated with this layout on this stream, never handed out.
            if let Err(error) = unsafe { state.resource.deallocate(ptr, layout.size(), layout.align(), &state.stream) }
            {
                // Said, not swallowed: the memory is lost to the pool until the process ends.
                tracing::warn!(%error, ptr, "giving back container memory the host never got failed");
            }
            return Err(AllocError);
        }
        Ok(NonNull::slice_from_raw_parts(address, layout.size()))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 {
            return;
        }
        let state = &self.inner;
        let address = ptr.as_ptr() as usize as cumempool::sys::CUdeviceptr;
        // SAFETY: the caller returns memory this allocator (or a clone) handed out with `layout`.
        if let Err(error) = unsafe { state.resource.deallocate(address, layout.size(), layout.align(), &state.stream) }
        {
            tracing::warn!(%error, "freeing container memory failed");
        }
    }
}
