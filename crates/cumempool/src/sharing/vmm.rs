//! The virtual memory management API: physical allocations, address reservations, mappings
//! and access, each an owned value that gives its resource back when dropped.
//!
//! Pools hand out memory the driver places; this API lets a program place it: reserve a range
//! of addresses once ([`AddressRange::reserve`]), create physical memory in multiples of the
//! device's granularity ([`PhysicalAllocation::create`]), map it anywhere in the range
//! ([`AddressRange::map`]) and grant devices access ([`AddressRange::set_access`]). A range that
//! grows this way never moves, and its memory is what NCCL can register for zero-copy transfers
//! (NCCL asks the driver for the allocation handle behind a pointer, which only this API's
//! memory has). Physical memory is shared with other processes as a POSIX file descriptor
//! ([`PhysicalAllocation::export_fd`]) or, across nodes of one NVLink domain, a fabric handle.
//!
//! ```no_run
//! use cumempool::vmm::{AddressRange, AllocationProperties, PhysicalAllocation};
//! use cumempool::Access;
//! # fn main() -> cumempool::Result<()> {
//! let props = AllocationProperties::device(0);
//! let chunk = props.granularity()?.recommended;
//! let range = AddressRange::reserve(64 * chunk, chunk)?;
//! let memory = PhysicalAllocation::create(&props, chunk)?;
//! range.map(0, &memory)?; // the mapping keeps the physical memory alive
//! range.set_access(0, chunk, &[(0, Access::ReadWrite)])?;
//! # Ok(()) }
//! ```

use crate::driver::driver_call;
use crate::error::{Error, InvalidArgumentReason, NotShareableReason, Result};
use crate::sharing::{refused_unless_success, require_imex_channel};
use crate::values::access::Access;
use crate::values::export_handles::HandleTypes;
use crate::values::location::Location;
use cumempool_sys as sys;
use std::collections::BTreeMap;
use std::ffi::c_void;
#[cfg(unix)]
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, PoisonError};

/// What physical memory to create: the device, the handle types it may be exported as, and
/// whether network adapters may access it directly (GPUDirect RDMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocationProperties {
    device: i32,
    handle_types: HandleTypes,
    gpu_direct_rdma: bool,
}

impl AllocationProperties {
    /// Pinned memory of device `ordinal`, not exportable, without GPUDirect RDMA.
    pub fn device(ordinal: i32) -> Self {
        Self { device: ordinal, handle_types: HandleTypes::NONE, gpu_direct_rdma: false }
    }

    /// The handle types the memory may be exported as (`POSIX_FILE_DESCRIPTOR`, `FABRIC`).
    #[must_use]
    pub fn handle_types(mut self, types: HandleTypes) -> Self {
        self.handle_types = types;
        self
    }

    /// Whether network adapters may read and write the memory directly (`gpuDirectRDMACapable`);
    /// the device must support it (`GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`).
    #[must_use]
    pub fn gpu_direct_rdma(mut self, capable: bool) -> Self {
        self.gpu_direct_rdma = capable;
        self
    }

    /// The device ordinal.
    pub fn device_ordinal(&self) -> i32 {
        self.device
    }

    /// The export handle types.
    pub fn export_handle_types(&self) -> HandleTypes {
        self.handle_types
    }

    /// Whether GPUDirect RDMA was asked for.
    pub fn is_gpu_direct_rdma(&self) -> bool {
        self.gpu_direct_rdma
    }

    fn to_raw(self) -> Result<sys::CUmemAllocationProp> {
        let location = Location::Device(self.device).to_raw()?;
        let mut raw = sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: self.handle_types.to_raw(),
            location,
            ..Default::default()
        };
        raw.allocFlags.gpuDirectRDMACapable = u8::from(self.gpu_direct_rdma);
        Ok(raw)
    }

    /// The sizes physical allocations of these properties come in.
    ///
    /// See [cuMemGetAllocationGranularity](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn granularity(&self) -> Result<Granularity> {
        let raw = self.to_raw()?;
        let query = |flag: sys::CUmemAllocationGranularity_flags| -> Result<usize> {
            let mut size = 0usize;
            // SAFETY: valid out-pointer and properties.
            unsafe { driver_call!(cuMemGetAllocationGranularity(&mut size, &raw, flag)) }?;
            Ok(size)
        };
        use sys::CUmemAllocationGranularity_flags as G;
        let minimum = query(G::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?;
        let recommended = query(G::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?;
        Ok(Granularity { minimum, recommended })
    }
}

/// The sizes physical memory comes in: every size and mapping offset is a multiple of
/// `minimum`; `recommended` performs best.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granularity {
    /// The smallest unit (2 MiB on current GPUs).
    pub minimum: usize,
    /// The unit the driver recommends for performance.
    pub recommended: usize,
}

/// Refuses `value` unless it is a positive multiple of `unit`.
fn require_multiple(what: &'static str, quantity: &'static str, value: usize, unit: usize) -> Result<()> {
    if unit != 0 && value != 0 && value.is_multiple_of(unit) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what,
        reason: InvalidArgumentReason::NotGranularityMultiple { quantity, value, granularity: unit },
    })
}

/// Physical memory (`cuMemCreate`), released when dropped. Mappings of it keep it alive, so it
/// may be dropped while mapped.
#[derive(Debug)]
pub struct PhysicalAllocation {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    props: AllocationProperties,
}

impl PhysicalAllocation {
    /// Creates `size` bytes (a multiple of the granularity) of physical memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a size that is not a multiple of the minimum granularity;
    /// [`Error::OutOfMemory`] when the device has no room; the driver's other answers.
    ///
    /// See [cuMemCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn create(props: &AllocationProperties, size: usize) -> Result<Self> {
        let granularity = props.granularity()?;
        require_multiple("creating physical memory", "the size", size, granularity.minimum)?;
        let raw = props.to_raw()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and properties; flags must be 0.
        unsafe { driver_call!(cuMemCreate(&mut handle, size, &raw, 0)) }.map_err(|error| match error {
            error if error.is_out_of_memory() => {
                Error::OutOfMemory { requested: size, limit: None, function: "cuMemCreate" }
            }
            error => error,
        })?;
        Ok(Self { handle, size, props: *props })
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Never true: the driver creates no empty allocation.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The properties it was created (or imported) with.
    pub fn properties(&self) -> &AllocationProperties {
        &self.props
    }

    /// The raw handle, still owned by `self`.
    pub fn as_raw(&self) -> sys::CUmemGenericAllocationHandle {
        self.handle
    }

    fn require_export(&self, wanted: HandleTypes, what: &'static str) -> Result<()> {
        if self.props.handle_types.contains(wanted) {
            return Ok(());
        }
        Err(Error::NotShareable {
            what,
            reason: NotShareableReason::MemoryWithoutHandleType { created: self.props.handle_types, wanted },
        })
    }

    /// Exports the memory as a POSIX file descriptor, for another process to import with
    /// [`PhysicalAllocation::import_fd`].
    ///
    /// # Errors
    /// [`Error::NotShareable`] for memory created without `POSIX_FILE_DESCRIPTOR`;
    /// [`Error::SharingRefused`] with the driver's answer.
    ///
    /// See [cuMemExportToShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    #[cfg(unix)]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        const WHAT: &str = "exporting physical memory as a file descriptor";
        self.require_export(HandleTypes::POSIX_FILE_DESCRIPTOR, WHAT)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the handle is an int.
        let answer = unsafe {
            crate::driver::driver_answer!(cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                self.handle,
                HandleTypes::POSIX_FILE_DESCRIPTOR.to_raw(),
                0
            ))
        }?;
        refused_unless_success(answer, WHAT, "create the memory with HandleTypes::POSIX_FILE_DESCRIPTOR")?;
        if fd < 0 {
            return Err(Error::NotShareable {
                what: WHAT,
                reason: NotShareableReason::DriverGaveInvalidDescriptor { descriptor: fd },
            });
        }
        // SAFETY: the driver hands over a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the memory as a 64-byte fabric handle, importable on any node of the same NVLink
    /// domain ([`PhysicalAllocation::import_fabric`]).
    ///
    /// Refused before the driver without an IMEX channel (`/dev/nvidia-caps-imex-channels/*`).
    ///
    /// # Errors
    /// [`Error::NotShareable`] for memory created without `FABRIC` or without an IMEX channel;
    /// [`Error::SharingRefused`] with the driver's answer.
    ///
    /// See [cuMemExportToShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn export_fabric(&self) -> Result<[u8; 64]> {
        const WHAT: &str = "exporting physical memory as a fabric handle";
        self.require_export(HandleTypes::FABRIC, WHAT)?;
        require_imex_channel(WHAT)?;
        let mut handle = sys::CUmemFabricHandle::default();
        // SAFETY: for FABRIC the handle is a CUmemFabricHandle.
        let answer = unsafe {
            crate::driver::driver_answer!(cuMemExportToShareableHandle(
                (&mut handle as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.handle,
                HandleTypes::FABRIC.to_raw(),
                0
            ))
        }?;
        refused_unless_success(
            answer,
            WHAT,
            "fabric export needs memory created with HandleTypes::FABRIC and an IMEX channel",
        )?;
        Ok(handle.data)
    }

    /// Imports `size` bytes of physical memory another process exported with
    /// [`PhysicalAllocation::export_fd`]; `props` describes the exporter's memory (the importer
    /// cannot ask the driver for the size). The descriptor is checked before the driver sees it.
    ///
    /// # Errors
    /// [`Error::NotShareable`] for a descriptor that is not open; [`Error::SharingRefused`] when
    /// the driver refuses it.
    ///
    /// See [cuMemImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    #[cfg(unix)]
    pub fn import_fd(fd: impl AsFd, size: usize, props: &AllocationProperties) -> Result<Self> {
        const WHAT: &str = "importing physical memory from a file descriptor";
        let raw = fd.as_fd().as_raw_fd();
        // SAFETY: F_GETFD only reads the descriptor's flags.
        if unsafe { libc::fcntl(raw, libc::F_GETFD) } == -1 {
            return Err(Error::NotShareable {
                what: WHAT,
                reason: NotShareableReason::DescriptorNotOpen { descriptor: raw },
            });
        }
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // The driver takes the descriptor's value smuggled in the pointer argument.
        let os_handle = raw as isize as *mut c_void;
        // SAFETY: a valid out-pointer and an open descriptor.
        let answer = unsafe {
            crate::driver::driver_answer!(cuMemImportFromShareableHandle(
                &mut handle,
                os_handle,
                HandleTypes::POSIX_FILE_DESCRIPTOR.to_raw()
            ))
        }?;
        refused_unless_success(
            answer,
            WHAT,
            "the descriptor must come from PhysicalAllocation::export_fd in another process",
        )?;
        Ok(Self { handle, size, props: *props })
    }

    /// Imports `size` bytes of physical memory exported with
    /// [`PhysicalAllocation::export_fabric`], on this or another node of the NVLink domain.
    ///
    /// Refused before the driver without an IMEX channel.
    ///
    /// # Errors
    /// [`Error::NotShareable`] without an IMEX channel; [`Error::SharingRefused`] when the
    /// driver refuses the handle.
    ///
    /// See [cuMemImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn import_fabric(handle: &[u8; 64], size: usize, props: &AllocationProperties) -> Result<Self> {
        const WHAT: &str = "importing physical memory from a fabric handle";
        require_imex_channel(WHAT)?;
        let mut fabric = sys::CUmemFabricHandle { data: *handle };
        let mut imported: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for FABRIC the OS handle points at a CUmemFabricHandle, alive for the call.
        let answer = unsafe {
            crate::driver::driver_answer!(cuMemImportFromShareableHandle(
                &mut imported,
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                HandleTypes::FABRIC.to_raw()
            ))
        }?;
        refused_unless_success(answer, WHAT, "the handle must come from PhysicalAllocation::export_fabric in the same NVLink domain, with an IMEX channel on both nodes")?;
        Ok(Self { handle: imported, size, props: *props })
    }
}

impl Drop for PhysicalAllocation {
    fn drop(&mut self) {
        // SAFETY: a handle this value owns, released once; mappings hold their own reference.
        if let Err(error) = unsafe { driver_call!(cuMemRelease(self.handle)) } {
            tracing::warn!(%error, handle = self.handle, "releasing physical memory failed");
        }
    }
}

/// A reserved range of virtual addresses (`cuMemAddressReserve`). Unmaps whatever is still
/// mapped, then frees the range, when dropped.
#[derive(Debug)]
pub struct AddressRange {
    base: sys::CUdeviceptr,
    size: usize,
    /// Mapped pieces by offset, with their sizes: what `Drop` must unmap.
    mapped: Mutex<BTreeMap<usize, usize>>,
}

impl AddressRange {
    /// Reserves `size` bytes of addresses aligned to `alignment` (0: the driver's default);
    /// `size` must be a multiple of the granularity of the memory that will be mapped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero size or an alignment that is not a power of two;
    /// the driver's answer (`CUDA_ERROR_OUT_OF_MEMORY` when the address space is exhausted).
    ///
    /// See [cuMemAddressReserve](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn reserve(size: usize, alignment: usize) -> Result<Self> {
        const WHAT: &str = "reserving addresses";
        if size == 0 {
            return Err(Error::InvalidArgument { what: WHAT, reason: InvalidArgumentReason::ZeroSize });
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(Error::InvalidArgument {
                what: WHAT,
                reason: InvalidArgumentReason::AlignmentNotPowerOfTwo { alignment },
            });
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: a valid out-pointer; no fixed address is asked for; flags must be 0.
        unsafe { driver_call!(cuMemAddressReserve(&mut base, size, alignment, 0, 0)) }?;
        Ok(Self { base, size, mapped: Mutex::new(BTreeMap::new()) })
    }

    /// The first address.
    pub fn base(&self) -> sys::CUdeviceptr {
        self.base
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Never true: no empty range is reserved.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The bytes mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.pieces().values().sum()
    }

    fn pieces(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        self.mapped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_span(&self, what: &'static str, offset: usize, size: usize) -> Result<()> {
        if size > 0 && offset.checked_add(size).is_some_and(|end| end <= self.size) {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            what,
            reason: InvalidArgumentReason::OutsideReservedRange { offset, size, reserved: self.size },
        })
    }

    /// Maps all of `memory` at `offset` (a multiple of the granularity). The mapping holds its
    /// own reference to the physical memory, which stays until [`AddressRange::unmap`] or drop.
    /// Nothing may access the addresses before [`AddressRange::set_access`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a span outside the range or overlapping a mapping; the
    /// driver's answer (misaligned offsets among them).
    ///
    /// See [cuMemMap](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn map(&self, offset: usize, memory: &PhysicalAllocation) -> Result<()> {
        const WHAT: &str = "mapping physical memory";
        self.check_span(WHAT, offset, memory.size)?;
        let mut pieces = self.pieces();
        let end = offset + memory.size;
        let before = pieces.range(..end).next_back().map(|(o, s)| (*o, *s));
        if let Some((at, size)) = before.filter(|(at, size)| at + size > offset) {
            return Err(Error::InvalidArgument {
                what: WHAT,
                reason: InvalidArgumentReason::OverlapsMapping {
                    offset,
                    size: memory.size,
                    mapped_offset: at,
                    mapped_size: size,
                },
            });
        }
        // SAFETY: a reserved, unmapped span of this range and a live physical allocation; the
        // offset into the physical memory and the flags are 0.
        unsafe { driver_call!(cuMemMap(self.base + offset as u64, memory.size, 0, memory.handle, 0)) }?;
        pieces.insert(offset, memory.size);
        Ok(())
    }

    /// Unmaps the mapping at `offset`, dropping its reference to the physical memory.
    ///
    /// # Safety
    /// No work may still use the addresses (queued or running kernels and copies): the memory
    /// behind them goes away as with a free.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when nothing is mapped at `offset`; the driver's answer.
    ///
    /// See [cuMemUnmap](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub unsafe fn unmap(&self, offset: usize) -> Result<()> {
        let mut pieces = self.pieces();
        let Some(&size) = pieces.get(&offset) else {
            return Err(Error::InvalidArgument {
                what: "unmapping memory",
                reason: InvalidArgumentReason::NothingMapped { offset },
            });
        };
        // SAFETY: a mapping of this range; the caller vouches that no work uses it.
        unsafe { driver_call!(cuMemUnmap(self.base + offset as u64, size)) }?;
        pieces.remove(&offset);
        Ok(())
    }

    /// Grants each `(device, access)` access to the mapped span `[offset, offset + size)`.
    /// Devices not named keep what they had; a peer gets nothing unless named.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list or a span outside the range; the driver's
    /// answer (a span not wholly mapped, a device that cannot access it).
    ///
    /// See [cuMemSetAccess](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html).
    pub fn set_access(&self, offset: usize, size: usize, access: &[(i32, Access)]) -> Result<()> {
        const WHAT: &str = "setting access to mapped memory";
        self.check_span(WHAT, offset, size)?;
        if access.is_empty() {
            return Err(Error::InvalidArgument { what: WHAT, reason: InvalidArgumentReason::NoDevices });
        }
        let descriptors = access
            .iter()
            .map(|&(device, access)| {
                Ok(sys::CUmemAccessDesc { location: Location::Device(device).to_raw()?, flags: access.to_raw() })
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: the descriptors live for the call.
        unsafe {
            driver_call!(cuMemSetAccess(self.base + offset as u64, size, descriptors.as_ptr(), descriptors.len()))
        }
    }
}

impl Drop for AddressRange {
    fn drop(&mut self) {
        let pieces = std::mem::take(&mut *self.pieces());
        for (offset, size) in pieces {
            // SAFETY: a mapping of this range; dropping the range promises no work uses it, as
            // dropping a buffer does.
            if let Err(error) = unsafe { driver_call!(cuMemUnmap(self.base + offset as u64, size)) } {
                // The driver frees no range that still has mappings: leave the addresses reserved.
                tracing::warn!(%error, ptr = self.base + offset as u64, "unmapping memory failed; the range stays reserved");
                return;
            }
        }
        // SAFETY: a range this value reserved, freed once.
        if let Err(error) = unsafe { driver_call!(cuMemAddressFree(self.base, self.size)) } {
            tracing::warn!(%error, ptr = self.base, "freeing reserved addresses failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_positive_multiples_of_the_granularity() {
        assert!(require_multiple("t", "the size", 4 << 20, 2 << 20).is_ok());
        let error = require_multiple("t", "the size", 3 << 20, 2 << 20).unwrap_err();
        assert!(
            matches!(
                error,
                Error::InvalidArgument {
                    reason: InvalidArgumentReason::NotGranularityMultiple {
                        value: 0x30_0000,
                        granularity: 0x20_0000,
                        ..
                    },
                    ..
                }
            ),
            "{error}"
        );
        let text = error.to_string();
        assert!(text.contains("3145728") && text.contains("multiple of 2097152"), "{text}");
        let zero = require_multiple("t", "the size", 0, 2 << 20);
        assert!(
            matches!(
                zero,
                Err(Error::InvalidArgument {
                    reason: InvalidArgumentReason::NotGranularityMultiple { value: 0, .. },
                    ..
                })
            ),
            "{zero:?}"
        );
    }

    #[test]
    fn a_reservation_of_no_bytes_or_an_odd_alignment_is_refused_before_the_driver() {
        let zero = AddressRange::reserve(0, 0).map(|_| ());
        assert!(
            matches!(zero, Err(Error::InvalidArgument { reason: InvalidArgumentReason::ZeroSize, .. })),
            "{zero:?}"
        );
        let odd = AddressRange::reserve(2 << 20, 3).map(|_| ());
        assert!(
            matches!(
                odd,
                Err(Error::InvalidArgument {
                    reason: InvalidArgumentReason::AlignmentNotPowerOfTwo { alignment: 3 },
                    ..
                })
            ),
            "{odd:?}"
        );
    }

    #[test]
    fn properties_reach_the_driver_as_set() {
        let props =
            AllocationProperties::device(1).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).gpu_direct_rdma(true);
        let raw = props.to_raw().unwrap();
        assert_eq!(raw.requestedHandleTypes, HandleTypes::POSIX_FILE_DESCRIPTOR.to_raw());
        assert_eq!(raw.allocFlags.gpuDirectRDMACapable, 1);
        assert_eq!(raw.type_, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        assert!(AllocationProperties::device(-1).to_raw().is_err(), "a negative ordinal is refused");
    }
}
