//! Memory pools: their three handles, creation, trimming, access from devices, typed
//! attributes, and stream-ordered allocation.
//!
//! Ownership shows in the type:
//! - [`MemPool`]: a pool this process created or imported; it (with its clones, buffers and
//!   routes) keeps the pool alive, and the last holder destroys it.
//! - [`PoolRef`]: a pool this handle never keeps alive: a route's default pool (owned by the
//!   driver, never destroyed) or one borrowed from elsewhere with `unsafe` [`PoolRef::from_raw`].
//! - [`Pool`]: what both dereference to, the operations every pool has. A `Pool` value (from
//!   [`current_pool`](crate::current_pool), or a clone) owns when it came from a `MemPool`.

use crate::bare_pools;
use crate::bare_pools::attributes::{self, PoolAttribute};
use crate::bare_pools::pool_owner::Owner;
use crate::bare_pools::pool_recipe::Recipe;
use crate::devices::device::Device;
use crate::driver::handle::DriverHandle;
use crate::driver::{driver_answer, driver_call};
use crate::error::{DriverError, Error, InvalidArgumentReason, Result};
use crate::memory::buffer::{Buffer, OwnedBuffer};
use crate::streams::stream::Stream;
use crate::values::access::Access;
use crate::values::export_handles::HandleTypes;
use crate::values::location::{AllocationType, Location};
use crate::values::route::Route;
use cumempool_sys as sys;
#[cfg(not(feature = "cuda-13020"))]
use cumempool_sys::DriverVersion;
use std::ops::Deref;
use std::sync::Arc;

/// A pool's handle with what this crate knows of it: the operations every pool has.
///
/// [`MemPool`] and [`PoolRef`] dereference to it. A `Pool` cloned from a [`MemPool`], or
/// returned by [`current_pool`](crate::current_pool) for a pool this crate routed, keeps the
/// pool alive like the `MemPool` does ([`Pool::is_owned`]); one from a [`PoolRef`] does not.
#[derive(Clone, Debug)]
pub struct Pool {
    raw: DriverHandle<sys::CUmemoryPool>,
    /// Known for pools this process created or looked up by route; `None` for imported pools.
    route: Option<Route>,
    /// The maximum size asked at creation, for error messages.
    max_size: Option<u64>,
    /// The export handle types asked at creation; `None` where unknown (borrowed or imported).
    handle_types: Option<HandleTypes>,
    /// Present when this crate must destroy the pool; clones keep it alive.
    owner: Option<Arc<Owner>>,
}

impl Pool {
    pub(crate) fn borrowed(raw: sys::CUmemoryPool, route: Option<Route>) -> Self {
        Self { raw: DriverHandle(raw), route, max_size: None, handle_types: None, owner: None }
    }

    /// A route's default pool, which the driver made without export handle types.
    pub(crate) fn default_of(raw: sys::CUmemoryPool, route: Route) -> Self {
        Self::borrowed(raw, Some(route)).with_handle_types(HandleTypes::NONE)
    }

    pub(crate) fn owned(raw: sys::CUmemoryPool, route: Option<Route>, max_size: Option<u64>, imported: bool) -> Self {
        let owner = Arc::new(Owner::new(raw, imported));
        Self { raw: DriverHandle(raw), route, max_size, handle_types: None, owner: Some(owner) }
    }

    /// The driver's handle. Valid while this handle (or a buffer from it) lives.
    #[inline]
    pub fn as_raw(&self) -> sys::CUmemoryPool {
        self.raw.0
    }

    /// The route this pool serves, where known without asking the driver: for pools this process
    /// created or looked up by route. Imported pools answer through [`Pool::location`].
    pub fn route(&self) -> Option<Route> {
        self.route
    }

    /// Where the pool's memory lives. Known on any driver for pools this process created or
    /// looked up; for imported pools it needs driver 13.2 (the `LOCATION_TYPE` attribute).
    pub fn location(&self) -> Result<Location> {
        match self.route {
            Some(route) => Ok(route.location),
            None => self.location_attribute(),
        }
    }

    /// The kind of memory the pool hands out; see [`Pool::location`] for when it is known.
    pub fn allocation_type(&self) -> Result<AllocationType> {
        match self.route {
            Some(route) => Ok(route.allocation_type),
            None => self.allocation_type_attribute(),
        }
    }

    /// Whether the host may touch this pool's memory (after the stream has synchronised).
    pub fn is_host_accessible(&self) -> bool {
        self.route.is_some_and(|r| r.is_host_accessible())
    }

    /// Whether this process imported the pool from another.
    pub fn is_imported(&self) -> bool {
        self.owner.as_ref().is_some_and(|o| o.imported)
    }

    /// Whether this handle keeps the pool alive (owned and imported pools).
    pub fn is_owned(&self) -> bool {
        self.owner.is_some()
    }

    /// Whether two handles name the same driver pool.
    pub fn same_as(&self, other: &Pool) -> bool {
        self.raw == other.raw
    }

    /// Marks the pool as one the driver cannot destroy safely: it will be leaked, not destroyed.
    pub(crate) fn mark_unsafe_to_destroy(&self) {
        if let Some(owner) = &self.owner {
            owner.mark_unsafe_to_destroy();
        }
    }

    /// Marks the pool as one a new owner must not inherit (access changed, exported): once
    /// retired, it is never made anew.
    pub(crate) fn mark_never_reuse(&self) {
        if let Some(owner) = &self.owner {
            owner.mark_never_reuse();
        }
    }

    pub(crate) fn owner_handle(&self) -> Option<Arc<Owner>> {
        self.owner.clone()
    }

    /// The export handle types the pool was created with, where known: a pool this process
    /// built, and a route's default pool (none). `None` for a pool borrowed or taken over with
    /// `from_raw`, and for an imported one.
    pub fn created_handle_types(&self) -> Option<HandleTypes> {
        self.handle_types
    }

    pub(crate) fn with_handle_types(mut self, handle_types: HandleTypes) -> Self {
        self.handle_types = Some(handle_types);
        self
    }

    /// Records how the pool was made, so that once retired it can serve a new pool made the same
    /// way (see [`PoolBuilder::build`]).
    pub(crate) fn with_recipe(self, recipe: Recipe) -> Self {
        if let Some(owner) = &self.owner {
            owner.set_recipe(recipe);
        }
        self
    }

    pub(crate) fn with_route(mut self, route: Option<Route>) -> Self {
        self.route = route;
        self
    }

    /// Releases memory the pool holds beyond `keep_bytes` back to the system.
    ///
    /// # Errors
    /// The driver's answer.
    ///
    /// See [cuMemPoolTrimTo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        // SAFETY: a live pool.
        unsafe { bare_pools::trim_to(self.raw.0, keep_bytes) }
    }

    /// Sets the access of `device` to this pool's memory.
    ///
    /// The owning device always has read-write access; the driver refuses to lower it
    /// (`CUDA_ERROR_NOT_SUPPORTED`), and so does this method, with that reason. Driver 580
    /// (CUDA 13.0) also refuses read-only access for peers; that comes back as
    /// [`Error::AccessNotGrantable`] saying so.
    ///
    /// # Errors
    /// [`Error::AccessNotGrantable`] for the refusals above, else the driver's answer.
    ///
    /// See [cuMemPoolSetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn set_access(&self, device: Device, access: Access) -> Result<()> {
        self.set_access_many(&[(device, access)])
    }

    /// Sets the access of several devices at once.
    ///
    /// # Errors
    /// As [`Pool::set_access`].
    pub fn set_access_many(&self, grants: &[(Device, Access)]) -> Result<()> {
        let owner = self.route.and_then(|r| r.location.device());
        if let Some((device, access)) =
            grants.iter().find(|(d, a)| Some(d.ordinal()) == owner && *a != Access::ReadWrite)
        {
            return Err(Error::AccessNotGrantable {
                device: device.ordinal(),
                access: *access,
                reason: "the device owns the pool and always has read-write access",
                cause: None,
            });
        }
        let descriptors: Vec<sys::CUmemAccessDesc> = grants
            .iter()
            .map(|(device, access)| sys::CUmemAccessDesc {
                location: crate::values::location::raw_location(
                    sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    device.ordinal(),
                ),
                flags: access.to_raw(),
            })
            .collect();
        // Before the driver: a refused call may have applied some of the descriptors.
        self.mark_never_reuse();
        // SAFETY: a live pool and `len` valid descriptors.
        let answer =
            unsafe { driver_answer!(cuMemPoolSetAccess(self.raw.0, descriptors.as_ptr(), descriptors.len())) }?;
        if answer.code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
            // Seen on driver 580 (13.0): pools take read-write or no access for peers, not read-only.
            if let Some((device, access)) = grants.iter().find(|(_, a)| *a == Access::Read) {
                return Err(Error::AccessNotGrantable {
                    device: device.ordinal(),
                    access: *access,
                    reason: "the driver does not support read-only access to pool memory (CUDA_ERROR_NOT_SUPPORTED); grant Access::ReadWrite or Access::None",
                    cause: Some(answer.cause()),
                });
            }
        }
        answer.check()
    }

    /// The access `device` has to this pool's memory.
    pub fn access(&self, device: Device) -> Result<Access> {
        self.access_from(Location::Device(device.ordinal()))
    }

    /// The access a location (a device, or the host) has to this pool's memory.
    ///
    /// # Errors
    /// An invalid location, or the driver's answer.
    pub fn access_from(&self, location: Location) -> Result<Access> {
        let mut raw_location = location.to_raw()?;
        let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: valid pointers; a live pool.
        unsafe { driver_call!(cuMemPoolGetAccess(&mut flags, self.raw.0, &mut raw_location)) }?;
        Ok(Access::from_raw(flags)?)
    }

    /// Allocates `bytes` from this pool, ordered on `stream`; the buffer is freed on the same
    /// stream when dropped.
    ///
    /// A zero-byte request returns an empty buffer without calling the driver. Running out of
    /// the pool's maximum size, or of device memory, is [`Error::OutOfMemory`].
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the pool (or the device) cannot supply `bytes`;
    /// [`Error::ImportedPoolAllocation`] for a pool imported from another process;
    /// [`Error::StreamCapturing`] on a stream capturing into a graph (captured memory is the
    /// graph's, and a buffer could outlive it: use [`Capture::alloc`](crate::Capture::alloc));
    /// [`Error::DriverGaveNullPointer`] when the driver answers success with address 0; else
    /// the driver's answer.
    ///
    /// See [cuMemAllocFromPoolAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    #[inline]
    pub fn alloc<'s>(&self, bytes: usize, stream: &'s Stream) -> Result<Buffer<'s>> {
        stream.ensure_not_capturing(ALLOC_WHILE_CAPTURING)?;
        if bytes == 0 {
            return Ok(Buffer::empty(stream, self.route));
        }
        let ptr = self.alloc_on(bytes, stream)?;
        // SAFETY: `ptr` was just allocated from this pool on `stream` with `bytes` bytes.
        Ok(unsafe { Buffer::from_pool(ptr, bytes, stream, self.route, self.owner.clone(), self.handle_types) })
    }

    /// Like [`Pool::alloc`], but the buffer holds a clone of `stream` instead of borrowing it:
    /// an [`OwnedBuffer`] can be stored beside its stream or returned from the function that
    /// made the stream. It costs one reference-count increment and decrement more.
    #[inline]
    pub fn alloc_owned(&self, bytes: usize, stream: &Stream) -> Result<OwnedBuffer> {
        stream.ensure_not_capturing(ALLOC_WHILE_CAPTURING)?;
        if bytes == 0 {
            return Ok(OwnedBuffer::empty(stream.clone(), self.route));
        }
        let ptr = self.alloc_on(bytes, stream)?;
        // SAFETY: `ptr` was just allocated from this pool on `stream` with `bytes` bytes.
        Ok(unsafe {
            OwnedBuffer::from_pool(ptr, bytes, stream.clone(), self.route, self.owner.clone(), self.handle_types)
        })
    }

    /// The allocation behind [`Pool::alloc`], as a raw address the caller frees with
    /// [`free_async`](crate::free_async) (for allocator layers that keep their own books).
    ///
    /// Unlike [`Pool::alloc`] this does not keep the pool alive: the driver defers destroying a
    /// pool until its outstanding allocations are freed.
    ///
    /// On a capturing stream it is recorded as an allocation node: the address is graph memory
    /// (not the pool's: the pool's maximum size does not apply, driver 580), live while the
    /// graph runs. It is remembered ([`is_captured_allocation`](crate::is_captured_allocation)),
    /// and [`free_async`](crate::free_async) frees it inside its capture (a free node), or,
    /// once the capture has ended, outside the graph after the launch that used it (the only
    /// way that memory comes back: destroying the graph does not free it).
    ///
    /// # Errors
    /// As [`Pool::alloc`], without its refusal of a capturing stream.
    #[inline]
    pub fn alloc_raw(&self, bytes: usize, stream: &Stream) -> Result<sys::CUdeviceptr> {
        if stream.is_legacy() {
            // The driver refuses the legacy stream's work while a blocking stream of its context
            // captures, and invalidates that capture: refused here first (`ensure_not_capturing`
            // asks).
            stream.ensure_not_capturing(ALLOC_RAW_BESIDE_A_CAPTURE)?;
            return self.alloc_on(bytes, stream);
        }
        if !stream.may_be_capturing() {
            return self.alloc_on(bytes, stream);
        }
        let status = stream.capture_status()?;
        if status == crate::CaptureStatus::None {
            stream.run_deferred_frees();
        }
        let ptr = self.alloc_on(bytes, stream)?;
        if let Some(capture) = status.id() {
            crate::memory::capture_registry::record(ptr, capture);
        }
        Ok(ptr)
    }

    /// `cuMemAllocFromPoolAsync` on `stream`, whether or not it captures: the one allocation
    /// path of [`Pool::alloc`], [`Pool::alloc_raw`] and [`Capture::alloc`](crate::Capture::alloc).
    #[inline]
    pub(crate) fn alloc_on(&self, bytes: usize, stream: &Stream) -> Result<sys::CUdeviceptr> {
        if self.is_imported() {
            return Err(Error::ImportedPoolAllocation);
        }
        stream.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer, live pool and stream, context current.
        let answer = unsafe { driver_answer!(cuMemAllocFromPoolAsync(&mut ptr, bytes, self.raw.0, stream.as_raw())) }?;
        match answer.code {
            // A success with no memory would become a buffer at address 0 that copies, host
            // slices and the free on drop all take for memory.
            sys::CUresult::CUDA_SUCCESS if ptr == 0 && bytes > 0 => {
                Err(Error::DriverGaveNullPointer { function: answer.function, requested: bytes })
            }
            sys::CUresult::CUDA_SUCCESS => Ok(ptr),
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(Error::OutOfMemory { requested: bytes, limit: self.max_size, function: answer.function })
            }
            _ => Err(answer.error()),
        }
    }
}

// Typed access to the attributes of `attributes`' table.
impl Pool {
    /// Reads any attribute as a 64-bit value (`int` attributes are widened).
    ///
    /// A 13.2 attribute on an older driver is [`Error::DriverTooOld`], not the driver's bare
    /// `CUDA_ERROR_INVALID_VALUE`.
    ///
    /// # Errors
    /// [`Error::DriverTooOld`] for an attribute newer than the driver; the driver's answer.
    ///
    /// See [cuMemPoolGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn attribute(&self, attribute: PoolAttribute) -> Result<u64> {
        // SAFETY: a live pool.
        unsafe { attributes::get(self.raw.0, attribute) }
    }

    pub(crate) fn set_attribute(&self, attribute: PoolAttribute, value: u64) -> Result<()> {
        // SAFETY: a live pool.
        unsafe { attributes::set(self.raw.0, attribute, value) }
    }

    /// Whether the pool reuses memory freed on another stream once an event dependency orders it.
    pub fn reuse_follow_event_dependencies(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseFollowEventDependencies)? != 0)
    }

    /// Sets [`Pool::reuse_follow_event_dependencies`].
    pub fn set_reuse_follow_event_dependencies(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseFollowEventDependencies, enabled.into())
    }

    /// Whether the pool reuses memory whose free is already known complete.
    pub fn reuse_allow_opportunistic(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseAllowOpportunistic)? != 0)
    }

    /// Sets [`Pool::reuse_allow_opportunistic`].
    pub fn set_reuse_allow_opportunistic(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseAllowOpportunistic, enabled.into())
    }

    /// Whether the pool may insert its own dependencies to reuse memory.
    pub fn reuse_allow_internal_dependencies(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseAllowInternalDependencies)? != 0)
    }

    /// Sets [`Pool::reuse_allow_internal_dependencies`].
    pub fn set_reuse_allow_internal_dependencies(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseAllowInternalDependencies, enabled.into())
    }

    /// Bytes the pool keeps reserved at a synchronisation before releasing memory to the system.
    pub fn release_threshold(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReleaseThreshold)
    }

    /// Sets [`Pool::release_threshold`] (`u64::MAX`: never release).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_attribute(PoolAttribute::ReleaseThreshold, bytes)
    }

    /// Bytes the pool currently holds from the system.
    pub fn reserved_mem_current(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReservedMemCurrent)
    }

    /// The high-water mark of [`Pool::reserved_mem_current`].
    pub fn reserved_mem_high(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReservedMemHigh)
    }

    /// Resets [`Pool::reserved_mem_high`] to zero (the only value the driver accepts).
    pub fn reset_reserved_mem_high(&self) -> Result<()> {
        self.set_attribute(PoolAttribute::ReservedMemHigh, 0)
    }

    /// Bytes currently allocated from the pool.
    pub fn used_mem_current(&self) -> Result<u64> {
        self.attribute(PoolAttribute::UsedMemCurrent)
    }

    /// The high-water mark of [`Pool::used_mem_current`].
    pub fn used_mem_high(&self) -> Result<u64> {
        self.attribute(PoolAttribute::UsedMemHigh)
    }

    /// Resets [`Pool::used_mem_high`] to zero.
    pub fn reset_used_mem_high(&self) -> Result<()> {
        self.set_attribute(PoolAttribute::UsedMemHigh, 0)
    }

    /// The pool's allocation type, as the driver reports it (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn allocation_type_attribute(&self) -> Result<AllocationType> {
        let raw = self.attribute(PoolAttribute::AllocationType)?;
        Ok(AllocationType::try_from(sys::CUmemAllocationType(raw as u32))?)
    }

    /// The handle types the pool exports, as the driver reports them (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn export_handle_types(&self) -> Result<HandleTypes> {
        Ok(HandleTypes::from_bits(self.attribute(PoolAttribute::ExportHandleTypes)? as u32))
    }

    /// The pool's location, as the driver reports it: `LOCATION_TYPE` with `LOCATION_ID` (driver
    /// 13.2), and for a pool in a locality domain `LOCALITY_DOMAIN_ID` (driver 13.4). A type this
    /// crate does not know is [`Location::Unknown`].
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn location_attribute(&self) -> Result<Location> {
        let type_ = sys::CUmemLocationType(self.attribute(PoolAttribute::LocationType)? as u32);
        let id = self.attribute(PoolAttribute::LocationId)? as u32 as i32;
        #[cfg(feature = "cuda-13040")]
        if type_ == sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN {
            // cuda.h does not say whether LOCATION_ID of a localized pool is the device ordinal or
            // the packed `localized` pair; its low byte is the device either way (CUDA hosts are
            // little-endian), and the domain has its own attribute.
            if let Some(domain) = self.locality_domain_id()? {
                return Ok(Location::DeviceLocalityDomain { device: id & 0xFF, domain });
            }
        }
        Ok(Location::from_raw_parts(type_, id))
    }

    /// The locality domain the pool is placed in, as the driver reports it (driver 13.4).
    ///
    /// `None` for a pool in no domain, and also for one created in domain 0 of a device with a
    /// single domain: the driver treats that as the whole device.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain_id(&self) -> Result<Option<u8>> {
        let raw = self.attribute(PoolAttribute::LocalityDomainId)? as u32 as i32;
        crate::devices::device::domain_from_driver("CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID", raw)
    }

    /// The pool's maximum size in bytes, as the driver reports it (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn max_pool_size(&self) -> Result<u64> {
        self.attribute(PoolAttribute::MaxPoolSize)
    }

    /// Whether the pool's memory is usable by the hardware decompression engine (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn hw_decompress_enabled(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::HwDecompressEnabled)? != 0)
    }

    #[cfg(not(feature = "cuda-13020"))]
    pub(crate) fn location_attribute(&self) -> Result<crate::values::location::Location> {
        Err(Error::DriverTooOld {
            feature: "reading an imported pool's location (needs the cuda-13020 feature)",
            needs: DriverVersion::CUDA_13_2,
            found: sys::BINDINGS_VERSION,
        })
    }

    #[cfg(not(feature = "cuda-13020"))]
    pub(crate) fn allocation_type_attribute(&self) -> Result<crate::values::location::AllocationType> {
        Err(Error::DriverTooOld {
            feature: "reading an imported pool's allocation type (needs the cuda-13020 feature)",
            needs: DriverVersion::CUDA_13_2,
            found: sys::BINDINGS_VERSION,
        })
    }

    /// Every attribute, read once: a value or the reason it cannot be read.
    pub fn attributes(&self) -> Vec<(PoolAttribute, Result<u64>)> {
        PoolAttribute::ALL.iter().map(|a| (*a, self.attribute(*a))).collect()
    }
}

/// What [`Pool::alloc`] and [`Pool::alloc_owned`] say on a capturing stream.
const ALLOC_WHILE_CAPTURING: &str =
    "allocating a buffer with Pool::alloc (allocate inside a capture with Capture::alloc)";
const ALLOC_RAW_BESIDE_A_CAPTURE: &str =
    "allocating on the legacy stream with Pool::alloc_raw (use a non-blocking stream beside a capture)";

/// An owned pool, destroyed when it and every buffer and route holding it are gone.
///
/// Buffers keep their pool alive, and so does a route the pool was made current for
/// ([`crate::set_current_pool`]): the driver would otherwise fall back to the default pool
/// behind the program's back. [`MemPool::destroy`] reports the driver's answer.
///
/// A pool that was ever a route's current pool is **retired**, not destroyed, when the last
/// holder lets go: trimmed, never handed out again, and destroyed only by `unsafe`
/// [`destroy_retired_pools`](crate::destroy_retired_pools) at a point the program names (or
/// reclaimed by the driver at exit). Another thread's `cuMemAllocAsync` may read a route's
/// current pool without keeping it alive, and destroying it then crashes the process.
#[derive(Clone, Debug)]
pub struct MemPool(Pool);

impl MemPool {
    /// A builder for a pool serving `route`.
    pub fn builder(route: Route) -> PoolBuilder {
        PoolBuilder::new(route)
    }

    /// A pool with default properties serving `route`.
    ///
    /// # Errors
    /// As [`PoolBuilder::build`].
    pub fn new(route: Route) -> Result<Self> {
        Self::builder(route).build()
    }

    /// Destroys the pool now and returns the driver's answer, if this is the last holder.
    ///
    /// A pool that was ever a route's current pool is retired instead (see [`MemPool`]) and
    /// this answers `Ok`; [`retired_pools`](crate::retired_pools) counts it until
    /// [`destroy_retired_pools`](crate::destroy_retired_pools).
    ///
    /// # Errors
    /// [`Error::PoolInUse`] (leaving the pool alive) while buffers, clones or routes still hold
    /// it; [`Error::UnsafeToDestroy`] for a pool the driver cannot destroy safely (it is left
    /// alive for good, as dropping it would); else the driver's answer.
    ///
    /// See [cuMemPoolDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn destroy(self) -> Result<()> {
        match self.into_sole_owner()? {
            Ok(owner) => {
                let result = owner.release();
                // Released (or deliberately left alive) above: Drop must not try again.
                std::mem::forget(owner);
                result
            }
            Err(_borrowed) => Ok(()),
        }
    }

    /// The owner, if this handle holds the only reference to it (`Err(raw)` for a pool this
    /// handle never owned).
    fn into_sole_owner(self) -> Result<std::result::Result<Owner, sys::CUmemoryPool>> {
        let Some(owner) = self.0.owner else {
            return Ok(Err(self.0.raw.0));
        };
        Arc::try_unwrap(owner).map(Ok).map_err(|shared| Error::PoolInUse { holders: Arc::strong_count(&shared) - 1 })
    }

    /// Gives up ownership: the caller must destroy the pool with `cuMemPoolDestroy`.
    ///
    /// Only a pool this handle would destroy itself is given away. A pool that was ever a
    /// route's current pool (including a retired pool that [`PoolBuilder::build`] made anew for
    /// this owner, which the caller cannot tell apart) may still be read by another thread's
    /// allocation through the route, so no caller may destroy it: it is refused, and retired.
    ///
    /// # Errors
    /// [`Error::PoolInUse`] while other holders remain; [`Error::PoolWasCurrent`] for a pool
    /// that was a route's current pool (retired here, as a drop would); and
    /// [`Error::UnsafeToDestroy`] for a pool no one can destroy safely (it stays owned here, and
    /// is never destroyed).
    pub fn into_raw(self) -> Result<sys::CUmemoryPool> {
        match self.into_sole_owner()? {
            Ok(owner) => match owner.check_give_away() {
                Ok(()) => {
                    let raw = owner.raw();
                    std::mem::forget(owner);
                    Ok(raw)
                }
                Err(refused @ Error::UnsafeToDestroy) => {
                    std::mem::forget(owner);
                    Err(refused)
                }
                // The owner drops here: the pool is retired.
                Err(refused) => Err(refused),
            },
            Err(raw) => Ok(raw),
        }
    }

    pub(crate) fn from_pool(pool: Pool) -> Self {
        Self(pool)
    }

    /// Takes ownership of a pool created elsewhere; it is destroyed when dropped.
    ///
    /// # Safety
    /// `raw` must be a live pool serving `route` that nothing else destroys.
    pub unsafe fn from_raw(raw: sys::CUmemoryPool, route: Route) -> Self {
        Self(Pool::owned(raw, Some(route), None, false))
    }
}

impl Deref for MemPool {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        &self.0
    }
}

/// A pool this handle never keeps alive: a route's default pool, which the driver owns and never
/// destroys, or a pool borrowed from elsewhere with [`PoolRef::from_raw`].
#[derive(Clone, Debug)]
pub struct PoolRef(Pool);

impl PoolRef {
    pub(crate) fn new(pool: Pool) -> Self {
        Self(pool)
    }

    /// Borrows a pool handle created elsewhere.
    ///
    /// # Safety
    /// `raw` must be a live pool serving `route` (if given), and outlive every use of the result
    /// and every buffer allocated from it.
    pub unsafe fn from_raw(raw: sys::CUmemoryPool, route: Option<Route>) -> Self {
        Self(Pool::borrowed(raw, route))
    }
}

impl Deref for PoolRef {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        &self.0
    }
}

/// Optional properties of a new pool; the route is required.
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct PoolBuilder {
    route: Route,
    handle_types: HandleTypes,
    max_size: Option<u64>,
    hw_decompress: bool,
    release_threshold: Option<u64>,
    initial_size: u64,
    reuse: Reuse,
}

/// The reuse policies of a new pool; `None` keeps the driver's default (all three on).
#[derive(Clone, Copy, Debug, Default)]
struct Reuse {
    follow_event_dependencies: Option<bool>,
    allow_opportunistic: Option<bool>,
    allow_internal_dependencies: Option<bool>,
}

impl PoolBuilder {
    fn new(route: Route) -> Self {
        Self {
            route,
            handle_types: HandleTypes::NONE,
            max_size: None,
            hw_decompress: false,
            release_threshold: None,
            initial_size: 0,
            reuse: Reuse::default(),
        }
    }

    /// How much freed memory the pool keeps reserved when a stream synchronises, in bytes
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; the driver's default is 0: everything unused is
    /// given back). Default here: the driver's, or, with [`PoolBuilder::initial_size`], what the
    /// pool reserved for the initial size.
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = Some(bytes);
        self
    }

    /// Memory the pool reserves at build, in bytes, so the first allocations up to that size do
    /// not go to the operating system (RMM's and CCCL's initial pool size). `build` allocates it
    /// on a stream of its own, frees it and waits; unless a release threshold is given, the
    /// threshold becomes what the pool reserved for it (at least this size), so it stays
    /// reserved. A smaller explicit threshold lets the driver give it back. Whatever the
    /// threshold, the driver gives the unused reservation of every pool of the device back when
    /// it refuses any allocation there (a pool's maximum size, or the device's memory; driver
    /// 580): the reservation is a head start, not a guarantee.
    pub fn initial_size(mut self, bytes: u64) -> Self {
        self.initial_size = bytes;
        self
    }

    /// Whether the pool may reuse memory freed on another stream once the free is known complete
    /// through event dependencies (`CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES`; default on).
    pub fn reuse_follow_event_dependencies(mut self, enabled: bool) -> Self {
        self.reuse.follow_event_dependencies = Some(enabled);
        self
    }

    /// Whether the pool may reuse memory whose free has completed, whatever the streams
    /// (`CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC`; default on).
    pub fn reuse_allow_opportunistic(mut self, enabled: bool) -> Self {
        self.reuse.allow_opportunistic = Some(enabled);
        self
    }

    /// Whether the pool may make an allocation wait on a pending free of another stream
    /// (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`; default on).
    pub fn reuse_allow_internal_dependencies(mut self, enabled: bool) -> Self {
        self.reuse.allow_internal_dependencies = Some(enabled);
        self
    }

    /// Handle types the pool can export to other processes (default: none).
    pub fn export_handle_types(mut self, types: HandleTypes) -> Self {
        self.handle_types = types;
        self
    }

    /// The most memory the pool may hold, in bytes; the driver rounds it up (to 32 MiB on the
    /// H200). Pinned pools only: managed pools refuse it.
    pub fn max_size(mut self, bytes: u64) -> Self {
        self.max_size = Some(bytes);
        self
    }

    /// Marks the pool's memory for the hardware decompression engine
    /// (`CU_MEM_POOL_CREATE_USAGE_HW_DECOMPRESS`).
    pub fn hw_decompress(mut self, enabled: bool) -> Self {
        self.hw_decompress = enabled;
        self
    }

    /// The driver's `CUmemPoolProps` for these settings.
    pub fn to_props(&self) -> Result<sys::CUmemPoolProps> {
        let (location, alloc_type) = self.route.to_raw()?;
        let max_size = match self.max_size {
            Some(bytes) => usize::try_from(bytes).map_err(|_| Error::InvalidArgument {
                what: "pool maximum size",
                reason: InvalidArgumentReason::ExceedsSizeT { bytes },
            })?,
            None => 0,
        };
        let usage = if self.hw_decompress { sys::CU_MEM_POOL_CREATE_USAGE_HW_DECOMPRESS as u16 } else { 0 };
        Ok(sys::CUmemPoolProps {
            allocType: alloc_type,
            handleTypes: self.handle_types.to_raw(),
            location,
            maxSize: max_size,
            usage,
            ..Default::default()
        })
    }

    /// Creates the pool.
    ///
    /// The driver's refusals come back as [`Error::PoolCreation`] with the reason where it is
    /// known (managed pools take no maximum size and no export handles; host pools cannot
    /// export file descriptors; host NUMA nodes must exist).
    ///
    /// # Errors
    /// An invalid route before the driver; [`Error::PoolCreation`] with the likeliest reason and
    /// the driver's answer when it refuses the properties.
    ///
    /// See [cuMemPoolCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn build(self) -> Result<MemPool> {
        let props = self.to_props()?;
        let recipe = self.recipe();
        if let Some(raw) = crate::bare_pools::retirement::reuse(&recipe) {
            tracing::info!(route = %self.route, pool = ?raw, "retired memory pool made anew");
            let pool = self.own(raw, recipe);
            // On an error the pool drops here and is retired again.
            reset_for_reuse(&pool)?;
            self.configure(&pool)?;
            return Ok(pool);
        }
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer and props.
        let answer = unsafe { driver_answer!(cuMemPoolCreate(&mut raw, &props)) }?;
        if answer.code == sys::CUresult::CUDA_ERROR_INVALID_VALUE
            || answer.code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
        {
            return Err(Error::PoolCreation {
                route: self.route,
                reason: self.refusal_reason(),
                cause: DriverError::new(answer.function, answer.code),
            });
        }
        if answer.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::PoolCreation { route: self.route, reason: out_of_pools(), cause: answer.cause() });
        }
        answer.check()?;
        tracing::info!(route = %self.route, pool = ?raw, max_size = ?self.max_size, handle_types = %self.handle_types, "memory pool created");
        let pool = self.own(raw, recipe);
        // On an error the half-configured pool drops here, destroyed: nothing routed it yet.
        self.configure(&pool)?;
        Ok(pool)
    }

    /// What a retired pool must have been made with to serve this builder.
    fn recipe(&self) -> Recipe {
        Recipe {
            route: self.route,
            handle_types: self.handle_types,
            max_size: self.max_size,
            hw_decompress: self.hw_decompress,
        }
    }

    /// The owned pool of a handle made (or made anew) for this builder.
    fn own(&self, raw: sys::CUmemoryPool, recipe: Recipe) -> MemPool {
        MemPool(
            Pool::owned(raw, Some(self.route), self.max_size, false)
                .with_handle_types(self.handle_types)
                .with_recipe(recipe),
        )
    }

    /// Applies the settings made after creation: the reuse policies, the release threshold and
    /// the initial reservation.
    fn configure(&self, pool: &Pool) -> Result<()> {
        let reuse = [
            (self.reuse.follow_event_dependencies, PoolAttribute::ReuseFollowEventDependencies),
            (self.reuse.allow_opportunistic, PoolAttribute::ReuseAllowOpportunistic),
            (self.reuse.allow_internal_dependencies, PoolAttribute::ReuseAllowInternalDependencies),
        ];
        for (setting, attribute) in reuse {
            if let Some(enabled) = setting {
                pool.set_attribute(attribute, enabled.into())?;
            }
        }
        if let Some(bytes) = self.release_threshold {
            pool.set_release_threshold(bytes)?;
        }
        if self.initial_size > 0 {
            reserve(pool, self.route, self.initial_size, self.release_threshold.is_none())?;
        }
        Ok(())
    }

    /// The likeliest reason the driver refused these properties (from what drivers were seen to do).
    fn refusal_reason(&self) -> String {
        let managed = self.route.allocation_type == AllocationType::Managed;
        if managed && self.max_size.is_some() {
            return "managed pools take no maximum size; leave max_size unset".into();
        }
        if managed && !self.handle_types.is_empty() {
            return "managed pools cannot export handles; create a pinned pool to share memory".into();
        }
        if self.route.location == Location::Host && self.handle_types.contains(HandleTypes::POSIX_FILE_DESCRIPTOR) {
            return "host pools cannot export file descriptors; use a host NUMA node (Location::HostNuma) for a shareable host pool".into();
        }
        match self.route.location {
            Location::HostNumaCurrent => "the driver does not create pools at the calling thread's NUMA node; name the node with Location::HostNuma".into(),
            Location::HostNuma(node) => format!("the driver refused host NUMA node {node}; check that the node exists (Device::host_numa_id gives a device's nearest)"),
            _ => format!("the driver refused these properties (handle types {}, max size {:?}, hw decompress {})", self.handle_types, self.max_size, self.hw_decompress),
        }
    }
}

/// Gives a retired pool the state of a new one: the driver's default release threshold and reuse
/// policies, and fresh high-water marks. Its memory was trimmed when it was retired, and its
/// access was never changed and it was never exported (or it would not have been reused).
fn reset_for_reuse(pool: &Pool) -> Result<()> {
    pool.set_release_threshold(0)?;
    for policy in [
        PoolAttribute::ReuseFollowEventDependencies,
        PoolAttribute::ReuseAllowOpportunistic,
        PoolAttribute::ReuseAllowInternalDependencies,
    ] {
        pool.set_attribute(policy, 1)?;
    }
    pool.reset_used_mem_high()?;
    pool.reset_reserved_mem_high()
}

/// Why the driver may have no room for another pool.
fn out_of_pools() -> String {
    let retired = crate::bare_pools::retirement::retired_count();
    let mut reason = "the driver has no room for another pool (each pool reserves address space)".to_owned();
    if retired > 0 {
        reason.push_str(&format!(
            "; {retired} pools are retired (they were a route's current pool, so they are kept alive for other threads' allocations): call destroy_retired_pools at a point where no thread allocates through a route, or build pools with the same properties so retired ones serve them"
        ));
    }
    reason
}

/// Makes `pool` reserve `bytes`: one allocation of that size on a stream of its own, freed, and
/// waited for, under a release threshold of "never release". With `keep`, the threshold then
/// becomes what the pool holds reserved (the driver reserves in chunks that can exceed the
/// request, and at the next synchronisation gives back any whole chunk the threshold does not
/// cover); without it, the caller's threshold is set back and governs from then on. What the
/// pool reserves is read only once the free has completed: while the allocation is in flight,
/// the reservation is not yet reported. The stream is made in the primary context of the
/// route's device, or of device 0 for host and managed routes.
fn reserve(pool: &Pool, route: Route, bytes: u64, keep: bool) -> Result<()> {
    let size = usize::try_from(bytes).map_err(|_| Error::InvalidArgument {
        what: "pool initial size",
        reason: InvalidArgumentReason::ExceedsSizeT { bytes },
    })?;
    let device = match route.location {
        Location::Device(ordinal) => ordinal,
        _ => 0,
    };
    let stream = Stream::new(&Device::get(device)?.primary_context()?)?;
    let threshold = pool.release_threshold()?;
    pool.set_release_threshold(u64::MAX)?;
    let ptr = pool.alloc_raw(size, &stream)?;
    // SAFETY: allocated just above on this stream, freed once, never used.
    let freed = unsafe { crate::memory::buffer::free_async(ptr, &stream) };
    freed.and(stream.synchronize())?;
    let threshold = if keep { pool.reserved_mem_current()?.max(bytes) } else { threshold };
    pool.set_release_threshold(threshold)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool handle no driver ever sees: the code under test must not call the driver.
    fn unsafe_to_destroy_pool() -> MemPool {
        // SAFETY: the handle is only marked and released below, never passed to the driver.
        let pool = unsafe { MemPool::from_raw(0xdead_0000 as sys::CUmemoryPool, Route::host()) };
        pool.mark_unsafe_to_destroy();
        pool
    }

    #[test]
    fn destroy_never_calls_the_driver_on_a_pool_it_cannot_destroy_safely() {
        // Before one release path, destroy() called cuMemPoolDestroy here (driver 580 crashes).
        assert!(matches!(unsafe_to_destroy_pool().destroy(), Err(Error::UnsafeToDestroy)));
        assert!(matches!(unsafe_to_destroy_pool().into_raw(), Err(Error::UnsafeToDestroy)));
        drop(unsafe_to_destroy_pool());
    }

    #[test]
    fn a_pool_with_other_holders_is_not_destroyed() {
        let pool = unsafe_to_destroy_pool();
        let clone = pool.clone();
        assert!(matches!(pool.destroy(), Err(Error::PoolInUse { holders: 1 })));
        assert!(matches!(clone.destroy(), Err(Error::UnsafeToDestroy)));
    }
}
