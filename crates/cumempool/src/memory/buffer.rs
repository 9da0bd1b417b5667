//! Stream-ordered allocations: freed on their stream when dropped.
//!
//! One buffer type, generic over how it holds its stream: [`Buffer`] borrows it (the compiler
//! keeps the stream alive, at no run-time cost), [`OwnedBuffer`] holds a clone of it (storable
//! in a struct beside its stream, returnable from the function that made the stream). Both
//! share every method below.

use crate::bare_pools::pool_owner::Owner;
use crate::driver::driver_call;
use crate::error::{Error, Result};
use crate::memory::block::{Block, Placement};
use crate::memory::capture_registry::{self, FreeAction};
use crate::streams::capture_state::CaptureStatus;
use crate::streams::deferred_frees::{refused_for_now, DeferredFree};
use crate::streams::event::Event;
use crate::streams::stream::Stream;
use crate::values::export_handles::HandleTypes;
use crate::values::location::{AllocationType, Location};
use crate::values::route::Route;
use cumempool_sys as sys;
use std::borrow::Borrow;
use std::sync::Arc;

/// Memory from a pool, freed with `cuMemFreeAsync` on its stream when dropped; `S` is how the
/// buffer holds that stream: `&Stream` ([`Buffer`]) or `Stream` ([`OwnedBuffer`]).
///
/// Holds its pool (for owned pools), so the pool's handle is never used after it is destroyed.
/// Only this crate makes buffers, so the stream a buffer frees on is always the one it was
/// allocated on.
#[derive(Debug)]
#[must_use = "a buffer that is not kept is freed at once"]
pub struct BufferOn<S: Borrow<Stream>> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: S,
    /// `None` for memory imported from a pool whose route this process does not know.
    route: Option<Route>,
    pool: Option<Arc<Owner>>,
    /// The pool's export handle types, where known ([`Pool::created_handle_types`](crate::Pool::created_handle_types)):
    /// host memory another process may map is never borrowed as a slice.
    handle_types: Option<HandleTypes>,
}

/// A buffer that borrows its stream, so the compiler keeps the stream alive for it.
///
/// A buffer that is not kept is freed at once, so the compiler warns about it:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// fn allocate(pool: &cumempool::Pool, stream: &cumempool::Stream) -> cumempool::Result<()> {
///     pool.alloc(4096, stream)?; // the buffer would be freed right here
///     Ok(())
/// }
/// ```
pub type Buffer<'s> = BufferOn<&'s Stream>;

/// A buffer that holds a clone of its stream: `'static`, `Send`, storable beside its stream
/// and returnable from the function that made the stream
/// ([`Pool::alloc_owned`](crate::Pool::alloc_owned)).
///
/// ```no_run
/// use cumempool::{Device, MemPool, OwnedBuffer, Route, Stream};
/// struct Staging {
///     stream: Stream,
///     buffer: OwnedBuffer, // a `Buffer<'_>` could not sit beside the stream it borrows
/// }
/// fn staging(pool: &MemPool) -> cumempool::Result<Staging> {
///     let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
///     let buffer = pool.alloc_owned(1 << 20, &stream)?;
///     Ok(Staging { stream, buffer })
/// }
/// ```
pub type OwnedBuffer = BufferOn<Stream>;

impl<S: Borrow<Stream>> BufferOn<S> {
    pub(crate) fn empty(stream: S, route: Option<Route>) -> Self {
        Self { ptr: 0, len: 0, stream, route, pool: None, handle_types: None }
    }

    /// # Safety
    /// `ptr` must be a live allocation of `len` bytes from the pool `pool` keeps alive (or a
    /// driver-owned pool), ordered on `stream`, that nothing else frees; `handle_types` the
    /// pool's export handle types where known, else `None`.
    pub(crate) unsafe fn from_pool(
        ptr: sys::CUdeviceptr,
        len: usize,
        stream: S,
        route: Option<Route>,
        pool: Option<Arc<Owner>>,
        handle_types: Option<HandleTypes>,
    ) -> Self {
        Self { ptr, len, stream, route, pool, handle_types }
    }

    /// The stream the buffer is ordered on and freed on.
    #[inline]
    pub(crate) fn on(&self) -> &Stream {
        self.stream.borrow()
    }

    /// Size in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes (and no driver allocation).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (0 for an empty buffer).
    #[inline]
    pub fn as_raw(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The route of the pool it came from (`None` for memory imported from a pool whose route
    /// this process does not know).
    pub fn route(&self) -> Option<Route> {
        self.route
    }

    /// Whether the host may read and write it directly (host, host NUMA and managed memory).
    pub fn is_host_accessible(&self) -> bool {
        self.route.is_some_and(|r| r.is_host_accessible())
    }

    fn check_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::DoesNotFit { what, requested: len, capacity: self.len });
        }
        Ok(())
    }

    /// This buffer as a [`Block`], for the operations written once there. Crate-private: a
    /// block writes the memory through `&self`, so only methods that hold the buffer
    /// exclusively (or only read it) may make one.
    #[inline]
    fn block(&self) -> Block<'_> {
        // SAFETY: the buffer's own live allocation, on its own stream, freed only when the
        // buffer drops (after the view); callers hold `&mut self` where the view writes.
        unsafe { Block::new(self.ptr, self.len, self.on(), Placement::of(self.route)) }
    }

    /// Copies `src` into the start of the buffer and waits for the copy.
    ///
    /// # Errors
    /// As [`Block::copy_from_host`].
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<()> {
        self.block().copy_from_host(src)
    }

    /// Copies the start of the buffer into `dst` and waits for the copy.
    ///
    /// # Errors
    /// As [`Block::copy_to_host`].
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.block().copy_to_host(dst)
    }

    /// Copies the start of `src` into the start of this buffer, ordered after the work queued
    /// on both streams, and waits for the copy ([`BufferOn::copy_from_async`] does not wait).
    ///
    /// # Errors
    /// As [`Block::copy_from`].
    pub fn copy_from<T: Borrow<Stream>>(&mut self, src: &BufferOn<T>) -> Result<()> {
        self.block().copy_from(&src.block())
    }

    /// Copies the start of `src` into the start of this buffer on this buffer's stream, without
    /// waiting on the host: device, managed and pinned host pool memory alike.
    ///
    /// The copy is ordered after the work queued on both streams, and when `src` is on another
    /// stream, that stream is then made to wait for the copy (an event each way): each buffer's
    /// free, on its own stream, and every later use of it in stream order, come after the copy.
    /// An event needs its stream's context: for a stream borrowed without one, the host waits
    /// for that stream instead, so such a copy between two streams is refused inside
    /// [`Stream::capture`]'s closure, where host waits are, before anything is queued.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than this buffer; [`Error::StreamCapturing`]
    /// while either stream captures (record captured copies with
    /// [`Capture::copy`](crate::Capture::copy)), and inside [`Stream::capture`]'s closure for
    /// streams ordered with a host wait (above); the driver's answer.
    ///
    /// See [cuMemcpyAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    #[inline]
    pub fn copy_from_async<T: Borrow<Stream>>(&mut self, src: &BufferOn<T>) -> Result<()> {
        const WHAT: &str = "copying between buffers (Buffer::copy_from_async)";
        self.check_len(WHAT, src.len)?;
        self.on().ensure_not_capturing(WHAT)?;
        src.on().ensure_not_capturing(WHAT)?;
        if src.is_empty() {
            return Ok(());
        }
        let same_stream = self.on().same_as(src.on());
        if !same_stream && (self.on().context().is_none() || src.on().context().is_none()) {
            // The two streams are ordered with a host wait (an event needs its stream's
            // context), before the copy and after it. Refused after the copy was queued, that
            // wait would leave the source's free unordered after the copy: decided now.
            crate::streams::capture_state::refuse_host_wait_on_capturing_thread(WITHOUT_CONTEXT_IN_CAPTURE)?;
        }
        // Copies involving host memory need the context current (see `copy_unified`): made so
        // whenever it is known (one `cuCtxGetCurrent` when it already is), and refused for host
        // memory on a stream borrowed without its context.
        if self.on().context().is_some() || self.is_host_accessible() || src.is_host_accessible() {
            self.on().bind_context()?;
        } else {
            self.on().bind()?;
        }
        if !same_stream {
            self.on().order_after(src.on())?;
        }
        // SAFETY: both allocations are live for at least `src.len` bytes until their frees,
        // which are ordered after the copy: this stream's by the queue, the other's by the event
        // below.
        unsafe { driver_call!(cuMemcpyAsync(self.ptr, src.ptr, src.len, self.on().as_raw())) }?;
        if !same_stream {
            if let Err(error) = src.on().order_after(self.on()) {
                // The copy is queued and `src`'s stream is not ordered after it: its free could
                // release memory the copy still reads. Wait for the copy on the host instead,
                // with a wait nothing refuses.
                if let Err(wait) = self.on().wait_before_release() {
                    tracing::error!(%wait, %error, "a copy whose source's stream could not be ordered after it could not be waited for either; the source's free may not wait for it");
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Copies the start of the buffer into `dst` (its whole length) without waiting: the
    /// returned [`PendingCopy`] owns `dst` until the copy has finished and hands it back from
    /// [`PendingCopy::wait`].
    ///
    /// The host memory is moved in, not borrowed: a pending copy that borrowed a slice could be
    /// leaked with `mem::forget`, ending the borrow while the device still writes the memory.
    /// Leaking a `PendingCopy` leaks its vector instead, which is sound. For a copy into
    /// pinned memory that stays usable as a buffer, copy buffer to buffer with
    /// [`BufferOn::copy_from_async`] into a host pool's buffer.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `dst` is longer than the buffer; [`Error::StreamCapturing`]
    /// while the stream captures; [`Error::StreamNotBorrowable`] for a stream borrowed without
    /// its context (host copies need it current); the driver's answer.
    pub fn copy_to_host_async(&self, mut dst: Vec<u8>) -> Result<PendingCopy> {
        const WHAT: &str = "copying to the host (Buffer::copy_to_host_async)";
        self.check_len(WHAT, dst.len())?;
        let (to, len) = (dst.as_mut_ptr() as usize as sys::CUdeviceptr, dst.len());
        // SAFETY: `dst` is valid for `len` bytes and the pending copy owns it until the copy has
        // finished; the buffer holds at least `len` bytes, and its free is ordered after the copy.
        unsafe { PendingCopy::start(self.on(), WHAT, dst, to, self.ptr, len) }
    }

    /// Copies `src` (its whole length) into the start of the buffer without waiting: the
    /// returned [`PendingCopy`] owns `src` until the copy has finished and hands it back from
    /// [`PendingCopy::wait`]. See [`BufferOn::copy_to_host_async`] for why the memory is moved in.
    ///
    /// # Errors
    /// As [`BufferOn::copy_to_host_async`].
    pub fn copy_from_host_async(&mut self, src: Vec<u8>) -> Result<PendingCopy> {
        const WHAT: &str = "copying from the host (Buffer::copy_from_host_async)";
        self.check_len(WHAT, src.len())?;
        let (from, len) = (src.as_ptr() as usize as sys::CUdeviceptr, src.len());
        // SAFETY: as in `copy_to_host_async`, the other way round; `&mut self` keeps host
        // slices of the buffer out until then, and `host_slice` waits for the stream.
        unsafe { PendingCopy::start(self.on(), WHAT, src, self.ptr, from, len) }
    }

    /// Sets every byte to `value`, ordered on the buffer's stream.
    ///
    /// Device and managed memory are set by the device without waiting. Pinned host memory,
    /// which the driver's memset refuses, is set by the host after the stream has finished when
    /// the buffer can be borrowed as a slice, and otherwise (imported or exportable memory) by
    /// waited copies from the host ([`Block::fill`]).
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] while the stream captures (record captured fills with
    /// [`Capture::fill`](crate::Capture::fill)); host access refusals; the driver's answer.
    pub fn fill(&mut self, value: u8) -> Result<()> {
        self.on().ensure_not_capturing("filling a buffer (Buffer::fill)")?;
        if self.is_empty() {
            return Ok(());
        }
        if Placement::of(self.route) == Placement::Host && self.is_sliceable() {
            self.host_slice_mut()?.fill(value);
            return Ok(());
        }
        self.block().fill(value)
    }

    /// Moves managed memory towards `location` ahead of use (ordered on the buffer's stream).
    ///
    /// A locality domain is refused before the driver: cuda.h does not support prefetching to one.
    ///
    /// # Errors
    /// An invalid location; the driver's answer (for memory that is not managed, say).
    pub fn prefetch_to(&self, location: Location) -> Result<()> {
        #[cfg(feature = "cuda-13040")]
        if let Location::DeviceLocalityDomain { .. } = location {
            return Err(crate::values::location::InvalidLocation {
                location,
                reason: "cuda.h does not support prefetching to a locality domain; prefetch to its device",
            }
            .into());
        }
        self.on().ensure_not_capturing("prefetching a buffer (Buffer::prefetch_to)")?;
        if self.is_empty() {
            return Ok(());
        }
        self.on().bind()?;
        // SAFETY: a live managed allocation of `len` bytes.
        unsafe { driver_call!(cuMemPrefetchAsync(self.ptr, self.len, location.to_raw()?, 0, self.on().as_raw())) }
    }

    /// The locality domain the buffer's memory is placed in (driver 13.4): the pointer attribute
    /// `CU_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL`. `None` for memory in no domain (and for
    /// an empty buffer, which has no memory).
    ///
    /// See [cuPointerGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html).
    ///
    /// # Errors
    /// `Error::DriverTooOld` on a driver older than 13.4; the driver's refusal.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain(&self) -> Result<Option<u8>> {
        const NAME: &str = "CU_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL";
        crate::driver::require(NAME, sys::DriverVersion::CUDA_13_4)?;
        if self.is_empty() {
            return Ok(None);
        }
        let mut ordinal: i32 = -1;
        // SAFETY: the attribute's value type is int; a live allocation.
        unsafe {
            driver_call!(cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast::<std::ffi::c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_LOCALITY_DOMAIN_ORDINAL,
                self.ptr
            ))
        }?;
        crate::devices::device::domain_from_driver(NAME, ordinal)
    }

    /// Where the pages of this managed buffer reside (driver 13.4): one [`Location`] per region
    /// of `summary_granularity` bytes, each the location most samples (every
    /// `sampling_granularity` bytes; 0 lets the system choose) found; see
    /// [`location_info`](crate::location_info()). Waits for the buffer's stream first, so queued
    /// work such as prefetches is reflected.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a buffer of pinned memory, which has no residency to
    /// report; [`Error::InvalidGranularity`] for granularities cuda.h refuses (the summary
    /// granularity must be more than 0 and at most the length, the sampling granularity at most
    /// the summary granularity), both before the driver; `Error::DriverTooOld` before 13.4.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn location_info(&self, summary_granularity: usize, sampling_granularity: usize) -> Result<Vec<Location>> {
        if let Some(route) = self.route.filter(|r| r.allocation_type != AllocationType::Managed) {
            return Err(Error::InvalidArgument {
                what: "asking where a buffer's pages reside (cuMemGetLocationInfo)",
                reason: crate::error::InvalidArgumentReason::NotManagedMemory { route },
            });
        }
        crate::memory::location_info::region_count(self.len, summary_granularity, sampling_granularity)?;
        self.on().ensure_not_capturing("asking where a buffer's pages reside (Buffer::location_info, which waits)")?;
        if !self.is_empty() {
            self.on().synchronize()?;
        }
        crate::location_info(self.ptr, self.len, summary_granularity, sampling_granularity)
    }

    /// Whether no other process may map this memory, so a Rust slice over it races with no one.
    fn is_sliceable(&self) -> bool {
        !self.pool.as_ref().is_some_and(|owner| owner.imported) && self.handle_types.is_some_and(|t| t.is_empty())
    }

    fn host_ptr(&self) -> Result<*mut u8> {
        if self.pool.as_ref().is_some_and(|owner| owner.imported) {
            // Another process maps the same memory and may write it at any time: a Rust slice
            // over it would be a data race. Copies are fine.
            return Err(Error::ImportedMemoryNotSliceable);
        }
        if !self.is_host_accessible() {
            return Err(Error::NotHostAccessible { route: self.route });
        }
        if self.handle_types.is_none_or(|types| !types.is_empty()) {
            // The pool may be exported at any moment, and an importer may then write this
            // memory while the slice lives: the same race as above, from the exporting side.
            return Err(Error::ExportableMemoryNotSliceable { handle_types: self.handle_types });
        }
        if self.route.is_some_and(|r| r.allocation_type == AllocationType::Managed) {
            crate::devices::device::require_concurrent_managed_access()?;
        }
        self.on().ensure_not_capturing("borrowing a buffer's bytes on the host (host_slice, which waits)")?;
        self.on().synchronize()?;
        Ok(self.ptr as usize as *mut u8)
    }

    /// The bytes, for the host to read, after waiting for the buffer's stream.
    ///
    /// Only for host-accessible memory (host, host NUMA, managed); device memory is
    /// [`Error::NotHostAccessible`], and managed memory on a machine whose devices lack
    /// concurrent managed access is [`Error::ManagedMemoryNotHostAccessible`]. Memory another
    /// process may map is copied, never borrowed: imported memory is
    /// [`Error::ImportedMemoryNotSliceable`], and memory of a pool with export handle types (a
    /// host NUMA pool with `POSIX_FILE_DESCRIPTOR`), or of a pool whose handle types this
    /// process does not know (`from_raw`), [`Error::ExportableMemoryNotSliceable`].
    ///
    /// # Errors
    /// The refusals above, or the stream's failure while waiting for it.
    pub fn host_slice(&self) -> Result<&[u8]> {
        if self.is_empty() {
            return Ok(&[]);
        }
        let ptr = self.host_ptr()?;
        // SAFETY: host-accessible memory of `len` bytes, with no device work pending on its
        // stream; safe methods that enqueue device writes need `&mut self`, so none can start
        // while this borrow lives.
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.len) })
    }

    /// The bytes, for the host to write, after waiting for the buffer's stream.
    pub fn host_slice_mut(&mut self) -> Result<&mut [u8]> {
        if self.is_empty() {
            return Ok(&mut []);
        }
        let ptr = self.host_ptr()?;
        // SAFETY: as in `host_slice`, and the borrow is exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.len) })
    }
}

impl<'s> Buffer<'s> {
    /// The stream the buffer is ordered on and freed on.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }
}

impl OwnedBuffer {
    /// The stream the buffer is ordered on and freed on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

impl<S: Borrow<Stream>> Drop for BufferOn<S> {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the buffer owns the allocation and frees it once, on its own stream.
        match unsafe { free_ordered(self.ptr, self.on(), self.pool.as_ref()) } {
            Ok(FreeAction::Free) => {}
            // Deferred: the stream frees it (and forgets an import's mapping) once its capture ends.
            Ok(FreeAction::Defer) => return,
            Err(error) => {
                tracing::warn!(%error, ptr = self.ptr, "freeing a pool allocation failed");
                return; // an import whose unmapping failed stays marked as mapped, never mapped again
            }
        }
        if self.pool.as_ref().is_some_and(|owner| owner.imported) {
            // The unmapping is stream-ordered: only once it has run may the same allocation be
            // imported again (the driver would hand back the same address).
            match self.on().synchronize() {
                Ok(()) => crate::bare_pools::pool_owner::forget_mapping(self.ptr),
                // A capture refused the wait for now: owed, with the stream's deferred frees.
                Err(error) if refused_for_now(&error) => {
                    let owed = DeferredFree::new(self.ptr, self.pool.as_ref()).into_owed_wait();
                    if self.on().is_legacy() {
                        self.on().defer_legacy_free(owed);
                    } else {
                        // Marked, so that its next capture-aware use runs its deferred frees.
                        self.on().note_capture_possible();
                        self.on().defer_free(owed);
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, ptr = self.ptr, "waiting for an unmapping failed; the allocation stays unimportable")
                }
            }
        }
    }
}

/// A copy between a buffer and host memory that the host has not waited for yet: it owns the
/// host vector until the copy has finished, waits for it in [`PendingCopy::wait`] (which hands
/// the vector back) or when dropped.
#[derive(Debug)]
#[must_use = "dropping a pending copy waits for it at once"]
pub struct PendingCopy {
    /// `None` once handed back.
    host: Option<Vec<u8>>,
    done: Event,
    stream: Stream,
}

impl PendingCopy {
    /// Queues `len` bytes from `src` to `dst` on `stream` and records the point to wait for.
    ///
    /// # Safety
    /// `dst` and `src` must be valid for `len` bytes until the copy has finished; `host` is the
    /// host side, owned by the result until then.
    unsafe fn start(
        stream: &Stream,
        what: &'static str,
        host: Vec<u8>,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        len: usize,
    ) -> Result<Self> {
        stream.ensure_not_capturing(what)?;
        stream.bind_context()?;
        let Some(context) = stream.context() else {
            return Err(Error::StreamNotBorrowable {
                reason: "a pending copy needs the stream's context for its event",
            });
        };
        let done = Event::new(context)?;
        if len != 0 {
            // SAFETY: the caller vouches for both ranges; the host side is owned by the result.
            unsafe { driver_call!(cuMemcpyAsync(dst, src, len, stream.as_raw())) }?;
        }
        if let Err(error) = done.record(stream) {
            // The copy may be running: wait for the whole stream before `host` is released (a
            // wait nothing refuses), or keep it if even that fails.
            if stream.wait_before_release().is_err() {
                std::mem::forget(host);
            }
            return Err(error);
        }
        Ok(Self { host: Some(host), done, stream: stream.clone() })
    }

    /// Whether the copy has finished, without waiting.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] inside [`Stream::capture`]'s closure (as
    /// [`Event::is_complete`]); the driver's answer (`cuEventQuery`), which includes errors of
    /// the copy.
    pub fn is_complete(&self) -> Result<bool> {
        self.done.is_complete()
    }

    /// Waits for the copy and hands back the host vector (holding the copied bytes, for a copy
    /// to the host).
    ///
    /// # Errors
    /// A [`PendingCopyError`] with the cause. Inside [`Stream::capture`]'s closure the wait is
    /// refused before the driver ([`Error::StreamCapturing`]) and the error hands the copy back,
    /// still pending, to wait for once the capture is over. A copy that failed hands nothing
    /// back: its vector is released once the stream has been waited for, or kept (leaked) if
    /// even that fails, since the device may still use it.
    pub fn wait(mut self) -> std::result::Result<Vec<u8>, PendingCopyError> {
        if let Err(error) = crate::streams::capture_state::refuse_host_wait_on_capturing_thread(WAIT) {
            return Err(PendingCopyError { error, pending: Some(Box::new(self)) });
        }
        match self.finish() {
            Ok(()) => Ok(self.host.take().unwrap_or_default()),
            Err(error) => Err(PendingCopyError { error, pending: None }),
        }
    }

    /// Waits for the copy, with waits nothing refuses (the vector is released after them, inside
    /// a capture's closure too); on failure, releases the vector only once the stream is idle.
    /// Clears `host` either way, so a failed copy is waited for once.
    fn finish(&mut self) -> Result<()> {
        self.done.wait_before_release().inspect_err(|_| {
            let host = self.host.take();
            if self.stream.wait_before_release().is_err() {
                // Neither can be waited for: the device may still use the memory, so keep it.
                std::mem::forget(host);
            }
        })
    }
}

const WAIT: &str = "waiting for a pending copy (PendingCopy::wait)";

/// The refusal of a copy between streams ordered with host waits inside [`Stream::capture`]'s
/// closure (see [`BufferOn::copy_from_async`]).
const WITHOUT_CONTEXT_IN_CAPTURE: &str = "copying between buffers (Buffer::copy_from_async) where a stream borrowed without its context makes the ordering between the two streams a host wait, which Stream::capture's closure forbids; nothing was queued. Borrow the stream with its context (its buffers' streams are then ordered with events), record the copy with Capture::copy, or copy outside the closure";

/// Why [`PendingCopy::wait`] did not hand the vector back, with the copy itself where the wait
/// was refused before it began (as `BufWriter::into_inner` hands its writer back).
///
/// Converts into [`Error`] for `?`; the copy it holds is then dropped, which waits for it, inside
/// a capture's closure too (a wait that may invalidate that capture, since the vector is released
/// after it).
#[derive(Debug)]
pub struct PendingCopyError {
    error: Error,
    pending: Option<Box<PendingCopy>>,
}

impl PendingCopyError {
    /// The cause.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The copy, still pending, when the wait was refused before it began.
    pub fn into_pending(self) -> Option<PendingCopy> {
        self.pending.map(|pending| *pending)
    }

    /// The cause and the copy, if it was handed back.
    pub fn into_parts(self) -> (Error, Option<PendingCopy>) {
        (self.error, self.pending.map(|pending| *pending))
    }
}

impl std::fmt::Display for PendingCopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for PendingCopyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl From<PendingCopyError> for Error {
    fn from(refused: PendingCopyError) -> Self {
        refused.error
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if self.host.is_none() {
            return;
        }
        if let Err(error) = self.finish() {
            tracing::warn!(%error, "a pending copy failed");
        }
    }
}

/// Frees pool memory in stream order: `cuMemFreeAsync` of `ptr` on `stream`, aware of captures.
///
/// For memory from [`Pool::alloc_raw`](crate::Pool::alloc_raw); [`Buffer`]s free themselves.
/// While `stream` captures into a graph:
/// - memory allocated by `alloc_raw` during that same capture is freed by a free node of the
///   graph;
/// - other memory (allocated before the capture) is not freed now, which would corrupt the
///   capture: the free is deferred and runs on `stream` once the capture has ended, after the
///   stream's pre-capture work.
///
/// Memory allocated by `alloc_raw` during a capture that has ended is graph memory (an
/// allocation node without a free node): it is freed as asked, outside the graph, which the
/// driver accepts once the graph has run and refuses before (CUDA_ERROR_INVALID_VALUE). The
/// free must be ordered after every launch that uses it, as for any memory.
/// [`is_captured_allocation`](crate::is_captured_allocation) tells such addresses apart; caches
/// never keep them.
///
/// # Errors
/// The driver's refusal to free, or to say whether `stream` captures.
///
/// # Safety
/// `ptr` must come from a stream-ordered allocation, be freed once, and no work may use it
/// after the free in stream order.
///
/// See [cuMemFreeAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
#[inline]
pub unsafe fn free_async(ptr: sys::CUdeviceptr, stream: &Stream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { free_ordered(ptr, stream, None) }.map(|_| ())
}

/// The free behind [`free_async`] and a buffer's drop: what was done with `ptr`. A deferred free
/// keeps `pool` alive until it runs.
///
/// # Safety
/// As [`free_async`].
#[inline]
unsafe fn free_ordered(ptr: sys::CUdeviceptr, stream: &Stream, pool: Option<&Arc<Owner>>) -> Result<FreeAction> {
    let legacy = stream.is_legacy();
    if legacy && stream.blocked_by_a_capture()? {
        // The driver would refuse the free and invalidate that capture; nothing of it can be in
        // the capture (the legacy stream is never captured), so it waits for the capture's end.
        // Graph memory of an ended capture is forgotten as such now, as a free outside does.
        capture_registry::decide(ptr, CaptureStatus::None);
        stream.defer_legacy_free(DeferredFree::new(ptr, pool));
        return Ok(FreeAction::Defer);
    }
    // Not blocked, the legacy stream's own work is not captured either (it never captures, and
    // no allocation is made on it during a capture).
    let status = if !legacy && stream.may_be_capturing() { stream.capture_status()? } else { CaptureStatus::None };
    let action = capture_registry::decide(ptr, status);
    match action {
        FreeAction::Free => {
            if status == CaptureStatus::None && (legacy || stream.may_be_capturing()) {
                stream.run_deferred_frees();
            }
            stream.bind()?;
            // SAFETY: a live allocation, freed once, ordered on its stream (or, during its own
            // capture, recorded as the graph's free node).
            match unsafe { driver_call!(cuMemFreeAsync(ptr, stream.as_raw())) } {
                // A blocking stream began capturing since the question: the free waits after all.
                Err(error) if legacy && error.is_refused_for_a_blocking_capture() => {
                    stream.defer_legacy_free(DeferredFree::new(ptr, pool));
                    return Ok(FreeAction::Defer);
                }
                answer => answer?,
            }
        }
        FreeAction::Defer => stream.defer_free(DeferredFree::new(ptr, pool)),
    }
    Ok(action)
}
