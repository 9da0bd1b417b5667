//! The stream-ordered resource trait, in the spirit of CCCL's `cuda::mr::resource` and RMM's
//! device memory resources.

use crate::error::Result;
use crate::memory_kind::MemoryKind;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;

/// The alignment every CUDA pool allocation has at least.
pub const POOL_ALIGNMENT: usize = 256;

/// Allocates and frees memory in stream order.
///
/// Memory from `allocate(bytes, align, s)` may be used by work queued on `s` after the call
/// (and by the host once `s` has synchronised, for host-accessible kinds). `deallocate` queues
/// the free on its stream: work queued earlier on that stream may still use the memory.
///
/// # Safety
/// Safe code trusts what a resource hands out (the container allocator gives it to `Vec` and
/// `Box` as host memory), so implementing this trait is a promise, like `GlobalAlloc`: a
/// successful `allocate(bytes, align, s)` returns memory of at least `bytes` bytes, aligned to
/// `align`, of kind [`Self::Kind`], that nothing else uses until it is given to `deallocate`
/// (0 only for `bytes == 0`). And [`marked_stream_id`](Self::marked_stream_id) marks a stream
/// whenever a capture may be underway on it as far as this resource can tell: a cache above
/// trusts it to keep blocks out of captures.
pub unsafe trait StreamOrderedResource: Send + Sync {
    /// Which processors may touch the memory.
    type Kind: MemoryKind;

    /// Allocates `bytes` aligned to `align` (a power of two), ordered on `stream`.
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr>;

    /// Frees memory in stream order on `stream`.
    ///
    /// # Safety
    /// `ptr` must come from `allocate` on this resource with the same `bytes` and `align`, be
    /// freed once, and no work may use it after the free in the order of `stream`.
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()>;

    /// Whether [`deallocate`](Self::deallocate) on the legacy stream, while a blocking stream of
    /// its context captures, leaves the free waiting for that capture's end and owes nothing to
    /// the resource's own drop: then a [`CachingResource`](crate::CachingResource) dropped
    /// during such a capture gives its legacy-stream blocks to this resource; otherwise it keeps
    /// them allocated, with a warning. The driver itself would refuse such a free and invalidate
    /// the capture.
    ///
    /// The default answers false. [`PoolResource`](crate::PoolResource) and
    /// [`CurrentPoolResource`](crate::CurrentPoolResource) answer true (their free is
    /// [`cumempool::free_async`], which waits, keeping nothing of theirs); adaptors forward.
    /// An [`Arena`](crate::Arena) answers false: its free waits too, but a pending free keeps
    /// its whole range mapped when it is dropped right after a cache that owns it.
    fn frees_legacy_after_blocking_captures(&self) -> bool {
        false
    }

    /// Whether a capture is underway on `stream` (active or invalidated): work queued on it now
    /// is recorded into a graph rather than run. Asked only where
    /// [`may_be_capturing`](CaptureMark::may_be_capturing) answers true. The default answers
    /// [`Stream::is_capturing`].
    ///
    /// # Errors
    /// The driver's, when it cannot say.
    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        Ok(stream.is_capturing()?)
    }

    /// The stream's id, with [`Stream::CAPTURE_MARK`] set if a capture may be underway on it,
    /// without asking the driver: unmarked means none can be, marked means ask
    /// [`is_capturing`](Self::is_capturing). The one cheap capture check of a resource (see
    /// [`CaptureMark`]): a cache compares it with the stream ids it keys its blocks by, so that
    /// one comparison both finds a stream's blocks and turns away a stream that may be
    /// capturing. It is asked on every allocation and free, so it must cost no more than a
    /// relaxed load.
    ///
    /// The default answers [`Stream::marked_id`]. Adaptors forward to the resource below; only a
    /// resource that stands in for the driver (the test heap) answers otherwise.
    #[inline(always)]
    fn marked_stream_id(&self, stream: &Stream) -> std::num::NonZeroU64 {
        stream.marked_id()
    }

    /// [`allocate`](Self::allocate) where no capture is underway on `stream`; `None`, with
    /// nothing allocated, where one is or the driver cannot say (ask
    /// [`is_capturing`](Self::is_capturing) which). For callers that refuse captures: a check
    /// before `allocate` asks the driver once, and a cache's `allocate` asks again, where this
    /// asks once in all.
    ///
    /// The default asks, then allocates. [`CachingResource`](crate::CachingResource) serves
    /// from its blocks after its one question, and adaptors hand the call down, so that a
    /// stack asks once. A capture begun after the question, inside the allocation, is seen
    /// where it made the memory graph memory (the core records that): given back, and `None`.
    ///
    /// # Errors
    /// What `allocate` answers.
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        if self.may_be_capturing(stream) && !matches!(self.is_capturing(stream), Ok(false)) {
            return Ok(None);
        }
        let ptr = self.allocate(bytes, align, stream)?;
        Ok(unless_graph_memory(self, ptr, bytes, align, stream))
    }

    /// Allocates with the pool alignment and frees on drop: the convenient form.
    ///
    /// Refused on a stream capturing into a graph: memory allocated there is the graph's (an
    /// allocation node), and an [`Allocation`] could leave the capture holding it with no free
    /// node, so that its free outside the graph is either refused before a launch (the memory
    /// each launch allocates is then never given back) or unordered after one. Allocate inside
    /// a capture with [`Capture::alloc`](cumempool::Capture::alloc); the raw
    /// [`allocate`](Self::allocate) and [`deallocate`](Self::deallocate) keep serving captures
    /// for layers that free inside the capture themselves.
    ///
    /// # Errors
    /// [`Error::Pool`](crate::Error::Pool) with [`cumempool::Error::StreamCapturing`] while
    /// [`is_capturing`](Self::is_capturing) says a capture is underway on `stream`; what
    /// `is_capturing` and `allocate` answer.
    fn alloc(&self, bytes: usize, stream: &Stream) -> Result<Allocation<'_, Self>>
    where
        Self: Sized,
    {
        let refused = || {
            refused_while_capturing(
                "allocating through StreamOrderedResource::alloc (allocate inside a capture with Capture::alloc)",
            )
        };
        let mut allocated = None;
        for _ in 0..2 {
            allocated = self.allocate_unless_capturing(bytes, POOL_ALIGNMENT, stream)?;
            if allocated.is_some() {
                break;
            }
            // Asked again for the reason: the driver's error, or the capture. One that has
            // ended since is allocated for once more through the same call, so that a capture
            // begun meanwhile is refused, not served graph memory.
            if self.is_capturing(stream)? {
                return Err(refused());
            }
        }
        let Some(ptr) = allocated else { return Err(refused()) };
        Ok(Allocation { resource: self, ptr, bytes, stream: stream.clone() })
    }
}

/// `ptr`, just allocated by `resource` with these arguments, unless it is graph memory: a capture
/// begun on `stream` after the caller's question, inside the allocation (another thread's, or
/// code an out-of-memory callback ran), made it the graph's, and it is given back (in that
/// capture or after it, as the core decides) and `None` answered. One relaxed load while no
/// graph memory is outstanding, and none on a stream that cannot capture.
pub(crate) fn unless_graph_memory<R: StreamOrderedResource + ?Sized>(
    resource: &R,
    ptr: CUdeviceptr,
    bytes: usize,
    align: usize,
    stream: &Stream,
) -> Option<CUdeviceptr> {
    if !(resource.may_be_capturing(stream) && cumempool::is_captured_allocation(ptr)) {
        return Some(ptr);
    }
    // SAFETY: just allocated by `resource` with these arguments, freed once, never used.
    if let Err(error) = unsafe { resource.deallocate(ptr, bytes, align, stream) } {
        tracing::warn!(%error, bytes, "giving back graph memory a capture took failed");
    }
    None
}

/// Whether a capture may be underway on a stream, as a resource sees it: read off
/// [`StreamOrderedResource::marked_stream_id`], so that the two can never disagree. Implemented
/// for every resource, and for no other type: a resource changes the answer through
/// `marked_stream_id`.
pub trait CaptureMark {
    /// Whether a capture may be underway on `stream`, without asking the driver: false means
    /// none can be, true means ask [`StreamOrderedResource::is_capturing`].
    fn may_be_capturing(&self, stream: &Stream) -> bool;
}

impl<R: StreamOrderedResource + ?Sized> CaptureMark for R {
    #[inline(always)]
    fn may_be_capturing(&self, stream: &Stream) -> bool {
        self.marked_stream_id(stream).get() & Stream::CAPTURE_MARK != 0
    }
}

/// The capture checks (and the legacy frees' promise) of a resource that wraps another, forwarded to it: `|this| expr` names the
/// resource below, given the wrapper as `this`.
macro_rules! forward_capture_checks {
    (|$this:ident| $below:expr) => {
        fn is_capturing(&self, stream: &cumempool::Stream) -> crate::Result<bool> {
            let $this = self;
            $below.is_capturing(stream)
        }

        #[inline(always)]
        fn marked_stream_id(&self, stream: &cumempool::Stream) -> std::num::NonZeroU64 {
            let $this = self;
            $below.marked_stream_id(stream)
        }

        fn frees_legacy_after_blocking_captures(&self) -> bool {
            let $this = self;
            $below.frees_legacy_after_blocking_captures()
        }
    };
}
pub(crate) use forward_capture_checks;

// SAFETY: forwards to a resource that keeps the promise.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for &R {
    type Kind = R::Kind;
    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        (**self).allocate(bytes, align, stream)
    }
    #[inline]
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        (**self).allocate_unless_capturing(bytes, align, stream)
    }
    #[inline]
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { (**self).deallocate(ptr, bytes, align, stream) }
    }
    forward_capture_checks!(|this| &**this);
}

// SAFETY: forwards to a resource that keeps the promise.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for std::sync::Arc<R> {
    type Kind = R::Kind;
    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        (**self).allocate(bytes, align, stream)
    }
    #[inline]
    fn allocate_unless_capturing(&self, bytes: usize, align: usize, stream: &Stream) -> Result<Option<CUdeviceptr>> {
        (**self).allocate_unless_capturing(bytes, align, stream)
    }
    #[inline]
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { (**self).deallocate(ptr, bytes, align, stream) }
    }
    forward_capture_checks!(|this| &**this);
}

/// Memory from a resource, freed on its stream when dropped.
#[derive(Debug)]
#[must_use = "dropping an allocation frees it at once"]
pub struct Allocation<'r, R: StreamOrderedResource> {
    resource: &'r R,
    ptr: CUdeviceptr,
    bytes: usize,
    stream: Stream,
}

impl<R: StreamOrderedResource> Allocation<'_, R> {
    /// The address.
    #[inline]
    pub fn as_raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The size in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the size is zero.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The stream it is ordered on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

impl<R: StreamOrderedResource> Drop for Allocation<'_, R> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: allocated by this resource with these arguments, freed once.
        if let Err(error) = unsafe { self.resource.deallocate(self.ptr, self.bytes, POOL_ALIGNMENT, &self.stream) } {
            tracing::warn!(%error, ptr = self.ptr, "freeing an allocation failed");
        }
    }
}

/// What an allocation that serves no capture answers on a capturing stream: `operation` says
/// which and what to do instead. A resource's capture checks say only whether a capture is
/// underway, not which.
#[cold]
pub(crate) fn refused_while_capturing(operation: &'static str) -> crate::Error {
    crate::Error::Pool(cumempool::Error::StreamCapturing { operation, capture: None })
}

/// Refuses alignments a pool does not guarantee (never silently ignored).
#[inline(always)]
pub(crate) fn check_alignment(align: usize) -> Result<()> {
    if align.is_power_of_two() && align <= POOL_ALIGNMENT {
        return Ok(());
    }
    Err(alignment_error(align))
}

#[cold]
fn alignment_error(align: usize) -> crate::Error {
    let reason = if align.is_power_of_two() {
        format!("pools guarantee {POOL_ALIGNMENT}-byte alignment; ask for {POOL_ALIGNMENT} or less")
    } else {
        "alignments are powers of two".to_owned()
    };
    crate::Error::Alignment { requested: align, reason }
}
