//! Stream-ordered allocations: freed on their stream when dropped.
//!
//! One buffer type, generic over how it holds its stream: [`Buffer`] borrows it (the compiler
//! keeps the stream alive, at no run-time cost), [`OwnedBuffer`] holds a clone of it (storable
//! in a struct beside its stream, returnable from the function that made the stream). Both
//! share every method below.

use crate::driver::driver_call;
use crate::error::{Error, Result};
use crate::location::{AllocationType, Location, Route};
use crate::owner::Owner;
use crate::stream::{Event, Stream};
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
        Self { ptr: 0, len: 0, stream, route, pool: None }
    }

    /// # Safety
    /// `ptr` must be a live allocation of `len` bytes from the pool `pool` keeps alive (or a
    /// driver-owned pool), ordered on `stream`, that nothing else frees.
    pub(crate) unsafe fn from_pool(
        ptr: sys::CUdeviceptr,
        len: usize,
        stream: S,
        route: Option<Route>,
        pool: Option<Arc<Owner>>,
    ) -> Self {
        Self { ptr, len, stream, route, pool }
    }

    /// The stream the buffer is ordered on and freed on.
    #[inline]
    fn on(&self) -> &Stream {
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

    /// Copies `src` into the start of the buffer and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than the buffer; the driver's answer.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<()> {
        self.check_len("copying from the host", src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` is valid for its length, the buffer holds at least that many bytes, and
        // the copy is waited for before `src` can be released.
        unsafe { self.copy_unified(self.ptr, src.as_ptr() as usize as sys::CUdeviceptr, src.len()) }
    }

    /// Copies the start of the buffer into `dst` and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `dst` is longer than the buffer; the driver's answer.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.check_len("copying to the host", dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `copy_from_host`, the other way round.
        unsafe { self.copy_unified(dst.as_mut_ptr() as usize as sys::CUdeviceptr, self.ptr, dst.len()) }
    }

    /// Copies the start of `src` into the start of this buffer, ordered after the work queued
    /// on both streams, and waits for the copy.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than this buffer; the driver's answer.
    pub fn copy_from<T: Borrow<Stream>>(&mut self, src: &BufferOn<T>) -> Result<()> {
        self.check_len("copying between buffers", src.len)?;
        if src.is_empty() {
            return Ok(());
        }
        self.on().bind()?;
        if !self.on().same_as(src.on()) {
            match src.on().context() {
                Some(context) => {
                    let ready = Event::new(context)?;
                    ready.record(src.on())?;
                    self.on().wait(&ready)?;
                }
                None => src.on().synchronize()?,
            }
        }
        // SAFETY: both allocations are live for at least `src.len` bytes, and the copy is waited
        // for before either can be freed.
        unsafe { self.copy_unified(self.ptr, src.ptr, src.len) }
    }

    /// A copy on this buffer's stream between any two addresses, waited for before returning.
    /// Unified addressing lets the driver infer the direction; the typed `HtoD`/`DtoH` copies
    /// refuse host pool memory (CUDA_ERROR_INVALID_VALUE on driver 580).
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes until the copy has finished.
    unsafe fn copy_unified(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, len: usize) -> Result<()> {
        // Unlike allocation and free, a copy that involves host memory needs the stream's
        // context current (driver 580 crashes without one), whatever the stream's handle.
        self.on().bind_context()?;
        // SAFETY: the caller vouches for both ranges.
        unsafe { driver_call!(cuMemcpyAsync(dst, src, len, self.on().as_raw())) }?;
        self.on().synchronize()
    }

    /// Sets every byte to `value`, ordered on the buffer's stream.
    ///
    /// Device and managed memory are set by the device without waiting. Pinned host memory,
    /// which the driver's memset refuses, is set by the host after the stream has finished.
    ///
    /// # Errors
    /// Host access refusals for pinned host memory (see [`Buffer::host_slice_mut`]); the
    /// driver's answer.
    pub fn fill(&mut self, value: u8) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        if self.route.is_some_and(|r| r.location.is_host() && r.allocation_type == AllocationType::Pinned) {
            self.host_slice_mut()?.fill(value);
            return Ok(());
        }
        self.on().bind()?;
        // SAFETY: a live allocation of `len` bytes.
        unsafe { driver_call!(cuMemsetD8Async(self.ptr, value, self.len, self.on().as_raw())) }
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
            return Err(crate::location::InvalidLocation {
                location,
                reason: "cuda.h does not support prefetching to a locality domain; prefetch to its device",
            }
            .into());
        }
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
        crate::device::domain_from_driver(NAME, ordinal)
    }

    /// Where the pages of this managed buffer reside (driver 13.4): one [`Location`] per region
    /// of `summary_granularity` bytes, each the location most samples (every
    /// `sampling_granularity` bytes; 0 lets the system choose) found; see
    /// [`location_info`](crate::location_info). Waits for the buffer's stream first, so queued
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
                reason: format!("the buffer is pinned memory of {route}, which never migrates; only managed memory has a residency to report"),
            });
        }
        crate::location_info::region_count(self.len, summary_granularity, sampling_granularity)?;
        if !self.is_empty() {
            self.on().synchronize()?;
        }
        crate::location_info(self.ptr, self.len, summary_granularity, sampling_granularity)
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
        if self.route.is_some_and(|r| r.allocation_type == AllocationType::Managed) {
            crate::device::require_concurrent_managed_access()?;
        }
        self.on().synchronize()?;
        Ok(self.ptr as usize as *mut u8)
    }

    /// The bytes, for the host to read, after waiting for the buffer's stream.
    ///
    /// Only for host-accessible memory (host, host NUMA, managed); device memory is
    /// [`Error::NotHostAccessible`], and managed memory on a machine whose devices lack
    /// concurrent managed access is [`Error::ManagedMemoryNotHostAccessible`].
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
        if let Err(error) = unsafe { free_async(self.ptr, self.on()) } {
            tracing::warn!(%error, ptr = self.ptr, "freeing a pool allocation failed");
            return; // an import whose unmapping failed stays marked as mapped, never mapped again
        }
        if self.pool.as_ref().is_some_and(|owner| owner.imported) {
            // The unmapping is stream-ordered: only once it has run may the same allocation be
            // imported again (the driver would hand back the same address).
            match self.on().synchronize() {
                Ok(()) => crate::owner::forget_mapping(self.ptr),
                Err(error) => {
                    tracing::warn!(%error, ptr = self.ptr, "waiting for an unmapping failed; the allocation stays unimportable")
                }
            }
        }
    }
}

/// Frees pool memory in stream order: `cuMemFreeAsync` of `ptr` on `stream`.
///
/// For memory from [`Pool::alloc_raw`](crate::Pool::alloc_raw); [`Buffer`]s free themselves.
///
/// # Safety
/// `ptr` must come from a stream-ordered allocation, be freed once, and no work may use it
/// after the free in stream order.
#[inline]
pub unsafe fn free_async(ptr: sys::CUdeviceptr, stream: &Stream) -> Result<()> {
    stream.bind()?;
    // SAFETY: a live allocation, freed once, ordered on its stream.
    unsafe { driver_call!(cuMemFreeAsync(ptr, stream.as_raw())) }
}
