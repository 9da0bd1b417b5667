//! A block of stream-ordered memory, seen for the length of one operation: where it is, how
//! long, the stream it is ordered on and which processors may touch it.
//!
//! Every operation on such memory is written here once, with the checks that keep it out of
//! captures other code runs: a fill, copies each way, a copy between two blocks, and the
//! orderings between a block's stream and another stream. [`BufferOn`](crate::BufferOn) uses
//! them for pool memory, and the layers above (a resource's allocation, an import, the Python
//! package, the NCCL crate) use them for memory of their own, so no layer queues such work on a
//! stream without them.
//!
//! Invariant: nothing is queued on a stream that captures, and nothing orders two streams when
//! either captures; each is refused with [`Error::StreamCapturing`] before the driver sees it,
//! the capture left intact. A waited copy returns only once the copy has finished (or once the
//! memory it uses is otherwise safe to release: see [`Block::copy_from_host`]).

use crate::driver::driver_call;
use crate::error::{Error, Result};
use crate::streams::capture_mode;
use crate::streams::event::Event;
use crate::streams::ordering;
use crate::streams::stream::Stream;
use crate::values::location::AllocationType;
use crate::values::route::Route;
use cumempool_sys as sys;

/// Which processors may touch a block's memory, as the driver's operations need to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Pinned device memory (or memory of unknown kind: the narrowest claim).
    Device,
    /// Pinned host or host NUMA memory: the driver's memset refuses it.
    Host,
    /// Managed memory.
    Managed,
}

impl Placement {
    /// The placement of memory from a pool of `route` (device memory where unknown).
    pub fn of(route: Option<Route>) -> Self {
        match route {
            Some(r) if r.allocation_type == AllocationType::Managed => Self::Managed,
            Some(r) if r.location.is_host() => Self::Host,
            _ => Self::Device,
        }
    }

    /// Whether the host may read and write the memory directly.
    pub fn is_host_accessible(self) -> bool {
        self != Self::Device
    }

    /// `"device"`, `"host"` or `"managed"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
            Self::Managed => "managed",
        }
    }
}

/// A view of `len` bytes of stream-ordered memory at `ptr`, ordered on `stream`: what every
/// operation on such memory needs, whoever allocated it (a pool, a resource, an import).
///
/// ```no_run
/// use cumempool::{Block, Device, MemPool, Placement, Route, Stream};
/// # fn main() -> cumempool::Result<()> {
/// let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
/// let pool = MemPool::new(Route::device(0))?;
/// let buffer = pool.alloc(4096, &stream)?;
/// // SAFETY: a live allocation of 4096 bytes on `stream`, freed only after the view is gone.
/// let block = unsafe { Block::new(buffer.as_raw(), buffer.len(), &stream, Placement::Device) };
/// block.fill(0)?;                   // refused while `stream` captures
/// let mut bytes = [0u8; 16];
/// block.copy_to_host(&mut bytes)?;  // waited for
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Block<'a> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Stream,
    placement: Placement,
}

impl<'a> Block<'a> {
    /// A view of the memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be a live stream-ordered allocation of at least `len` bytes of `placement`,
    /// ordered on `stream`, whose free is queued only after this view and every copy of it are
    /// gone; and no Rust reference to its bytes may live meanwhile (the operations write them
    /// through the device, and a pinned host block through the host).
    pub unsafe fn new(ptr: sys::CUdeviceptr, len: usize, stream: &'a Stream, placement: Placement) -> Self {
        Self { ptr, len, stream, placement }
    }

    /// The device address.
    #[inline]
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block has no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the memory is ordered on.
    #[inline]
    pub fn stream(&self) -> &'a Stream {
        self.stream
    }

    /// Which processors may touch the memory.
    #[inline]
    pub fn placement(&self) -> Placement {
        self.placement
    }

    fn check_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::DoesNotFit { what, requested: len, capacity: self.len });
        }
        Ok(())
    }

    /// Sets every byte to `value`, ordered on the block's stream.
    ///
    /// Device and managed memory are set by the device without waiting. Pinned host memory,
    /// which the driver's memset refuses, is set by copies from a host pattern, waited for, so
    /// that no host write races with work queued on the stream.
    ///
    /// The capture check and the memset are two driver calls: a capture that another thread
    /// begins on a lent stream between them would record the memset. [`Stream::borrow_raw`]'s
    /// lender keeps that window closed by not sharing a stream with another thread while it
    /// captures (copies, which wait, close it themselves with a private stream).
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] while the stream captures (before the driver, the capture
    /// intact); for pinned host memory, as [`Block::copy_from_host`]; the driver's answer.
    ///
    /// See [cuMemsetD8Async](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    pub fn fill(&self, value: u8) -> Result<()> {
        const WHAT: &str = "filling a buffer (Buffer::fill)";
        self.stream.ensure_not_capturing(WHAT)?;
        if self.is_empty() {
            return Ok(());
        }
        if self.placement == Placement::Host {
            return self.fill_from_host(WHAT, value);
        }
        self.stream.bind()?;
        // SAFETY: a live allocation of `len` bytes (the constructor's promise).
        unsafe { driver_call!(cuMemsetD8Async(self.ptr, value, self.len, self.stream.as_raw())) }
    }

    /// [`Block::fill`] for pinned host memory: waited copies of a host pattern of at most 1 MiB.
    fn fill_from_host(&self, what: &'static str, value: u8) -> Result<()> {
        const PATTERN: usize = 1 << 20;
        let pattern = vec![value; self.len.min(PATTERN)];
        let mut done = 0;
        while done < self.len {
            let len = (self.len - done).min(PATTERN);
            let dst = self.ptr + done as u64;
            // SAFETY: `pattern` lives past the waited copy; the block holds `done + len` bytes.
            unsafe { self.copy_unified(what, dst, pattern.as_ptr() as usize as sys::CUdeviceptr, len, None) }?;
            done += len;
        }
        Ok(())
    }

    /// Copies `src` into the start of the block and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than the block; [`Error::StreamCapturing`]
    /// while the block's stream captures, and inside [`Stream::capture`]'s closure;
    /// [`Error::CaptureRefused`] when other code began capturing the stream while the copy was
    /// queued (that capture is invalidated, so its graph never runs the copy); the driver's
    /// answer. Nothing is released while the copy may still run: a failure before the copy is
    /// queued queues nothing, and after it, the copy is waited for first.
    ///
    /// See [cuMemcpyAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    pub fn copy_from_host(&self, src: &[u8]) -> Result<()> {
        const WHAT: &str = "copying from the host (Buffer::copy_from_host, which waits)";
        self.check_len(WHAT, src.len())?;
        self.stream.ensure_not_capturing(WHAT)?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is valid for its length, the block holds at least that many bytes, and
        // the copy is waited for before `src` can be released.
        unsafe { self.copy_unified(WHAT, self.ptr, src.as_ptr() as usize as sys::CUdeviceptr, src.len(), None) }
    }

    /// Copies the start of the block into `dst` and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `dst` is longer than the block; otherwise as
    /// [`Block::copy_from_host`].
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        const WHAT: &str = "copying to the host (Buffer::copy_to_host, which waits)";
        self.check_len(WHAT, dst.len())?;
        self.stream.ensure_not_capturing(WHAT)?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `copy_from_host`, the other way round.
        unsafe { self.copy_unified(WHAT, dst.as_mut_ptr() as usize as sys::CUdeviceptr, self.ptr, dst.len(), None) }
    }

    /// Copies all of `src` into the start of this block, ordered after the work queued on both
    /// streams, and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than this block; [`Error::OverlappingCopy`]
    /// when the two ranges overlap (a block copied into itself); otherwise as
    /// [`Block::copy_from_host`] (either stream capturing is refused). When the wait fails,
    /// `src`'s stream is ordered after the copy before this returns.
    pub fn copy_from(&self, src: &Block<'_>) -> Result<()> {
        const WHAT: &str = "copying between buffers (Buffer::copy_from, which waits)";
        self.check_len(WHAT, src.len)?;
        let (to, from, len) = (self.ptr, src.ptr, src.len);
        if len > 0 && to < from.saturating_add(len as u64) && from < to.saturating_add(len as u64) {
            return Err(Error::OverlappingCopy { what: WHAT, dst: to, src: from, len });
        }
        self.stream.ensure_not_capturing(WHAT)?;
        src.stream.ensure_not_capturing(WHAT)?;
        if src.is_empty() {
            return Ok(());
        }
        // Before the ordering below, which may itself wait on the host (a source stream
        // borrowed without its context).
        crate::streams::capture_state::refuse_host_wait_on_capturing_thread(WHAT)?;
        self.stream.bind()?;
        if !self.stream.same_as(src.stream) {
            self.stream.order_after(src.stream)?;
        }
        // SAFETY: both allocations are live for at least `src.len` bytes, and the copy is waited
        // for (or `src`'s stream ordered after it) before either can be freed.
        unsafe { self.copy_unified(WHAT, self.ptr, src.ptr, src.len, Some(src.stream)) }
    }

    /// Makes `waiter` wait for the work queued on the block's stream so far: `waiter`'s later
    /// work may then use the memory (a consumer of a DLPack export, say). Nothing to do when
    /// `waiter` is the block's stream.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] for `operation` while either stream captures, before the driver
    /// (an event recorded into a capture would join `waiter` to it; one recorded outside it,
    /// waited for by a capturing `waiter`, invalidates that capture); the driver's answer.
    pub fn order_before(&self, waiter: &Stream, operation: &'static str) -> Result<()> {
        if waiter.same_as(self.stream) {
            return Ok(());
        }
        self.stream.ensure_not_capturing(operation)?;
        waiter.ensure_not_capturing(operation)?;
        waiter.order_after(self.stream)
    }

    /// Makes the block's stream wait for the work queued on `producer` so far: a free queued on
    /// the block's stream afterwards then follows that work too (the release of a block used on
    /// another stream). Nothing to do when `producer` is the block's stream.
    ///
    /// # Errors
    /// As [`Block::order_before`].
    pub fn order_after(&self, producer: &Stream, operation: &'static str) -> Result<()> {
        if producer.same_as(self.stream) {
            return Ok(());
        }
        self.stream.ensure_not_capturing(operation)?;
        producer.ensure_not_capturing(operation)?;
        self.stream.order_after(producer)
    }

    /// Makes the block's release, queued on its own stream next, follow the work queued on
    /// `producer` so far: memory used on another stream is free only once that work is done.
    ///
    /// Unlike [`Block::order_after`], the block's own stream capturing is refused even when it
    /// is `producer`: inside a capture the work queued "so far" is the graph's, which runs at
    /// every launch, so no release can follow it.
    ///
    /// # Errors
    /// As [`Block::order_before`].
    pub fn order_release_after(&self, producer: &Stream, operation: &'static str) -> Result<()> {
        self.stream.ensure_not_capturing(operation)?;
        self.order_after(producer, operation)
    }

    /// A copy between any two addresses, ordered after the work queued on this block's stream
    /// and waited for before returning. Unified addressing lets the driver infer the direction;
    /// the typed `HtoD`/`DtoH` copies refuse host pool memory (CUDA_ERROR_INVALID_VALUE on
    /// driver 580). `source`: another stream whose later work (a free) must come after the copy.
    ///
    /// The copy runs on a private stream of the library's, ordered after the block's stream with
    /// an event. Other code may begin capturing the block's stream at any moment (another
    /// thread, with a stream it lent), and a copy queued there just before such a capture could
    /// then be waited for by no legal call. The private stream is held by this call alone, so
    /// nothing else can capture it: it captures only by joining a capture through the event,
    /// which happens only if the event was recorded into a capture, that is before anything of
    /// the copy was queued. That is checked before the copy is queued, and refused with the
    /// capture invalidated.
    ///
    /// Everything that can be refused (a capture underway on the thread or the stream, the
    /// context, the events, the change of capture mode) is settled before the copy is queued;
    /// after that, the function does not return before the copy has finished.
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes until the copy has finished.
    unsafe fn copy_unified(
        &self,
        what: &'static str,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        len: usize,
        source: Option<&Stream>,
    ) -> Result<()> {
        let stream = self.stream;
        crate::streams::capture_state::refuse_host_wait_on_capturing_thread(what)?;
        stream.ensure_not_capturing(what)?;
        // Unlike allocation and free, a copy that involves host memory needs the stream's
        // context current (driver 580 crashes without one), whatever the stream's handle; a
        // stream borrowed without its context is refused here.
        let context = stream.bind_context()?;
        let (queued, done) = (Event::new(context)?, Event::new(context)?);
        let private = stream.take_capture_stream(context)?;
        let copied = capture_mode::relaxed(|| {
            ordering::order_after(&private, stream, &queued, what, &MARKER_HINTS)?;
            ordering::refuse_if_captured(&queued, what, &MARKER_HINTS)?;
            // SAFETY: the caller vouches for both ranges.
            unsafe { driver_call!(cuMemcpyAsync(dst, src, len, private.as_raw())) }?;
            // From here the copy may be running: no return before it has finished.
            let waited = done.record(&private).and_then(|()| {
                // SAFETY: a live event, recorded on a stream that does not capture.
                unsafe { driver_call!(cuEventSynchronize(done.as_raw())) }
            });
            waited.inspect_err(|error| {
                if let Err(wait) = private.wait_before_release() {
                    tracing::error!(%wait, %error, "a copy could not be waited for; the memory it uses may be released under it");
                    // At least the blocks' frees, on their streams, come after it.
                    for after in std::iter::once(stream).chain(source.filter(|source| !source.same_as(stream))) {
                        if let Err(ordering) = after.order_after(&private) {
                            tracing::error!(%ordering, "ordering a stream after a copy that could not be waited for failed");
                        }
                    }
                }
            })
        });
        // Kept for the next copy or capture only if it does not capture (else leaked, not
        // destroyed mid-capture).
        stream.give_back_capture_stream(private);
        copied
    }
}

/// Why a copy whose private stream other code's capture reached through its marker is refused
/// (nothing of the copy is queued then).
const MARKER_HINTS: ordering::Hints = ordering::Hints {
    joined: "other code began capturing the buffer's stream while the copy was being set up; nothing was copied, and that capture was invalidated (its end gives no graph). Copy before another library's capture of the stream begins or after it ends",
    captured: "other code captured the buffer's stream while the copy was being set up; nothing was copied. Copy before another library's capture of the stream begins or after it ends",
};
