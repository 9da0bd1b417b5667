//! Sharing pools and their allocations with other processes: export a pool as a shareable
//! handle, import it elsewhere, and map allocations across through their export data.
//!
//! The flow (the `descriptor_passing` module moves the handle over a socket):
//! 1. The exporter creates a pool with an export handle type
//!    (`MemPool::builder(route).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)`),
//!    allocates, and calls [`Pool::export_fd`] and [`Buffer::export`].
//! 2. The importer calls [`MemPool::import_fd`] and [`Pool::import_pointer`], which returns a
//!    [`Buffer`] that unmaps the memory when dropped.
//! 3. The importer must drop its mapping before the exporter frees the allocation.
//!
//! The driver forbids allocating from an imported pool; this crate refuses it with that reason.

#[cfg(unix)]
pub mod descriptor_passing;
pub mod vmm;

use crate::driver::{driver_answer, driver_call, Answer};
use crate::error::{Error, InvalidArgumentReason, NotShareableReason, Result};
use crate::memory::buffer::{Buffer, BufferOn};
use crate::pool::{MemPool, Pool};
use crate::streams::stream::Stream;
use crate::values::export_handles::HandleTypes;
use cumempool_sys as sys;
use std::borrow::Borrow;
use std::ffi::c_void;
#[cfg(unix)]
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// An allocation's export data with its length: what another process needs to map it.
///
/// The driver's `CUmemPoolPtrExportData` is 64 opaque bytes; the length travels alongside
/// because the importer cannot ask the driver for it. [`SharedAllocation::to_bytes`] gives a
/// fixed 72-byte form for sockets and files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedAllocation {
    data: sys::CUmemPoolPtrExportData,
    len: u64,
}

impl SharedAllocation {
    /// The size of [`SharedAllocation::to_bytes`].
    pub const ENCODED_LEN: usize = 72;

    /// The allocation's length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the allocation is empty (never true for exported memory).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// 64 bytes of driver export data, then the length as little-endian u64.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut bytes = [0u8; Self::ENCODED_LEN];
        for (dst, src) in bytes.iter_mut().zip(self.data.reserved.iter()) {
            *dst = *src;
        }
        bytes[64..].copy_from_slice(&self.len.to_le_bytes());
        bytes
    }

    /// Reads [`SharedAllocation::to_bytes`]'s form; a wrong length is refused here, and data
    /// the driver does not recognise is refused at import.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != Self::ENCODED_LEN {
            return Err(Error::MalformedMessage {
                what: "reading shared allocation data",
                reason: format!(
                    "got {} bytes, expected {} (64 of export data and an 8-byte length): truncated or not export data",
                    bytes.len(),
                    Self::ENCODED_LEN
                ),
            });
        }
        let mut data = sys::CUmemPoolPtrExportData::default();
        for (dst, src) in data.reserved.iter_mut().zip(bytes.iter()) {
            *dst = *src;
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[64..]);
        let len = u64::from_le_bytes(len);
        if len == 0 {
            return Err(Error::MalformedMessage {
                what: "reading shared allocation data",
                reason: "the length is 0; exported allocations are never empty".into(),
            });
        }
        Ok(Self { data, len })
    }
}

impl<S: Borrow<Stream>> BufferOn<S> {
    /// The data another process needs to map this allocation from its imported pool.
    ///
    /// The pool must have been created with an export handle type and already shared
    /// ([`Pool::export_fd`]): the driver exports allocations of shared pools only.
    ///
    /// # Errors
    /// [`Error::NotShareable`] for an empty buffer; [`Error::SharingRefused`] when the driver
    /// refuses (a pool without an export handle type, or not shared yet).
    ///
    /// See [cuMemPoolExportPointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn export(&self) -> Result<SharedAllocation> {
        if self.is_empty() {
            return Err(Error::NotShareable {
                what: "exporting an allocation",
                reason: NotShareableReason::EmptyBuffer,
            });
        }
        let mut data = sys::CUmemPoolPtrExportData::default();
        // SAFETY: a live pool allocation and a valid out-pointer.
        let answer = unsafe { driver_answer!(cuMemPoolExportPointer(&mut data, self.as_raw())) }?;
        refused_unless_success(answer, "exporting an allocation", "the buffer's pool must be created with an export handle type (MemPool::builder(..).export_handle_types(..)) and shared (Pool::export_fd or descriptor_passing::send_pool) before its allocations are exported")?;
        Ok(SharedAllocation { data, len: self.len() as u64 })
    }
}

/// Where the NVIDIA driver exposes IMEX channels, which fabric handles need.
const IMEX_CHANNELS: &str = "/dev/nvidia-caps-imex-channels";

/// Whether an IMEX channel exists. Checked before a fabric export because driver 580 refuses the
/// export without one and then crashes when the pool is destroyed.
fn imex_channel_present() -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    std::fs::read_dir(IMEX_CHANNELS).is_ok_and(|mut entries| entries.next().is_some())
}

/// Refuses a fabric export or import where no IMEX channel exists (driver 580 refuses the call
/// then; the check names the missing service instead).
pub(crate) fn require_imex_channel(what: &'static str) -> Result<()> {
    if imex_channel_present() {
        return Ok(());
    }
    Err(Error::NotShareable { what, reason: NotShareableReason::NoImexChannel { channels: IMEX_CHANNELS } })
}

/// `Ok` for `CUDA_SUCCESS`, else [`Error::SharingRefused`] with the driver's answer and `hint`.
pub(crate) fn refused_unless_success(answer: Answer, what: &'static str, hint: &'static str) -> Result<()> {
    if answer.code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::SharingRefused { what, hint, cause: answer.cause() })
    }
}

impl Pool {
    fn require_export(&self, wanted: HandleTypes, what: &'static str) -> Result<()> {
        if self.is_imported() {
            return Err(Error::NotShareable { what, reason: NotShareableReason::ImportedPool });
        }
        if let Some(created) = self.created_handle_types() {
            if !created.contains(wanted) {
                return Err(Error::NotShareable {
                    what,
                    reason: NotShareableReason::PoolWithoutHandleType { created, wanted },
                });
            }
        }
        Ok(())
    }

    /// Exports the pool as a POSIX file descriptor, for another process to import.
    ///
    /// # Errors
    /// [`Error::NotShareable`] for a pool created without `POSIX_FILE_DESCRIPTOR` or imported;
    /// [`Error::SharingRefused`] with the driver's answer.
    ///
    /// See [cuMemPoolExportToShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    #[cfg(unix)]
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.require_export(HandleTypes::POSIX_FILE_DESCRIPTOR, "exporting a pool as a file descriptor")?;
        // Before the driver: once another process may hold the handle, no new owner inherits it.
        self.mark_never_reuse();
        let mut fd: std::ffi::c_int = -1;
        let kind = HandleTypes::POSIX_FILE_DESCRIPTOR.to_raw();
        // SAFETY: for POSIX_FILE_DESCRIPTOR the handle is an int.
        let answer = unsafe {
            driver_answer!(cuMemPoolExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                self.as_raw(),
                kind,
                0
            ))
        }?;
        const HINT: &str = "create the pool with HandleTypes::POSIX_FILE_DESCRIPTOR";
        refused_unless_success(answer, "exporting a pool as a file descriptor", HINT)?;
        if fd < 0 {
            return Err(Error::NotShareable {
                what: "exporting a pool as a file descriptor",
                reason: NotShareableReason::DriverGaveInvalidDescriptor { descriptor: fd },
            });
        }
        // SAFETY: the driver hands over a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the pool as a fabric handle (multi-node NVLink), where the device supports it.
    ///
    /// Needs an IMEX channel (`/dev/nvidia-caps-imex-channels/*` on Linux); without one this is
    /// refused before the driver is called, because driver 580 refuses the export and then
    /// crashes when the pool is destroyed. If the driver refuses anyway, the pool is never
    /// destroyed (it is leaked, with a warning) for the same reason.
    ///
    /// # Errors
    /// [`Error::NotShareable`] without fabric support or an IMEX channel;
    /// [`Error::SharingRefused`] when the driver refuses.
    pub fn export_fabric(&self) -> Result<[u8; 64]> {
        self.require_export(HandleTypes::FABRIC, "exporting a pool as a fabric handle")?;
        if let Some(ordinal) = self.route().and_then(|r| r.location.device()) {
            let supported = crate::Device::get(ordinal)?.supported_handle_types()?;
            if !supported.contains(HandleTypes::FABRIC) {
                return Err(Error::NotShareable {
                    what: "exporting a pool as a fabric handle",
                    reason: NotShareableReason::NoFabricSupport { device: ordinal, supported },
                });
            }
        }
        require_imex_channel("exporting a pool as a fabric handle")?;
        // As in `export_fd`.
        self.mark_never_reuse();
        let mut handle = sys::CUmemFabricHandle::default();
        // SAFETY: for FABRIC the handle is a CUmemFabricHandle.
        let answer = unsafe {
            driver_answer!(cuMemPoolExportToShareableHandle(
                (&mut handle as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.as_raw(),
                HandleTypes::FABRIC.to_raw(),
                0
            ))
        }?;
        if answer.code != sys::CUresult::CUDA_SUCCESS {
            // Driver 580 crashes in cuMemPoolDestroy after refusing a fabric export.
            self.mark_unsafe_to_destroy();
        }
        refused_unless_success(answer, "exporting a pool as a fabric handle", "fabric export needs a pool created with HandleTypes::FABRIC and an IMEX channel; this pool will not be destroyed (the driver crashes destroying it after this refusal)")?;
        Ok(handle.data)
    }

    /// Maps an allocation another process exported from this (imported) pool.
    ///
    /// The returned buffer unmaps the memory when dropped, in the order of `stream`; it must be
    /// dropped (and the stream synchronised) before the exporter frees the allocation. The
    /// memory must not be used before the exporter's allocation has completed.
    ///
    /// # Errors
    /// [`Error::NotShareable`] for a pool of this process; [`Error::SharingRefused`] for export
    /// data the driver does not accept; [`Error::SharedLengthMismatch`] when the peer claims more
    /// bytes than the driver mapped.
    ///
    /// See [cuMemPoolImportPointer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn import_pointer<'s>(&self, shared: &SharedAllocation, stream: &'s Stream) -> Result<Buffer<'s>> {
        if !self.is_imported() {
            return Err(Error::NotShareable {
                what: "importing an allocation",
                reason: NotShareableReason::NotAnImportedPool,
            });
        }
        // The mapping is made in the current context (no stream is involved).
        if let Some(context) = stream.context() {
            context.ensure_current()?;
        }
        let key = (self.as_raw() as usize, shared.data.reserved);
        // Held until the mapping is recorded (or undone): a buffer of this allocation being
        // dropped meanwhile forgets it only after its unmapping has run.
        let mut imports = crate::bare_pools::pool_owner::mapped_imports();
        // The driver maps an allocation imported twice at the same address, and the first
        // unmapping would pull the memory from under the second buffer: one buffer per mapping.
        let ptr = imports.import(key, || {
            let mut ptr: sys::CUdeviceptr = 0;
            let mut data = shared.data;
            // SAFETY: valid pointers; the driver validates the export data.
            let answer = unsafe { driver_answer!(cuMemPoolImportPointer(&mut ptr, self.as_raw(), &mut data)) }?;
            refused_unless_success(answer, "importing an allocation", "the export data must come from Buffer::export of an allocation of the pool this one was imported from, still alive in the exporter")?;
            Ok(ptr)
        })?;
        // The length came over the wire: a buffer must never reach past what the driver mapped.
        let checked = mapped_bytes_from(ptr).and_then(|mapped| {
            if shared.len <= mapped {
                Ok(())
            } else {
                Err(Error::SharedLengthMismatch { claimed: shared.len, mapped })
            }
        });
        if let Err(error) = checked {
            // Claimed, so no other import maps it meanwhile; released before the free, whose
            // use of the stream may run deferred frees that forget other mappings.
            drop(imports);
            // SAFETY: the fresh mapping is not handed out (it was claimed above, so no other
            // buffer maps it); freeing it unmaps it.
            let unmapped =
                unsafe { crate::memory::buffer::free_async(ptr, stream) }.and_then(|()| stream.synchronize());
            match unmapped {
                Ok(()) => crate::bare_pools::pool_owner::forget_mapping(ptr),
                Err(unmap) => tracing::warn!(%unmap, ptr, "unmapping a refused import failed"),
            }
            return Err(error);
        }
        // SAFETY: a fresh mapping of at least `len` bytes (checked above); freeing it
        // (cuMemFreeAsync) unmaps it, and the buffer keeps the imported pool alive until then.
        Ok(unsafe {
            Buffer::from_pool(ptr, shared.len(), stream, self.route(), self.owner_handle(), self.created_handle_types())
        })
    }
}

/// The bytes the driver has mapped from `ptr` to the end of its allocation.
fn mapped_bytes_from(ptr: sys::CUdeviceptr) -> Result<u64> {
    use sys::CUpointer_attribute as A;
    let mut start: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: RANGE_START_ADDR writes a CUdeviceptr.
    unsafe {
        driver_call!(cuPointerGetAttribute(
            (&mut start as *mut sys::CUdeviceptr).cast::<c_void>(),
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr
        ))
    }?;
    // SAFETY: RANGE_SIZE writes a size_t.
    unsafe {
        driver_call!(cuPointerGetAttribute(
            (&mut size as *mut usize).cast::<c_void>(),
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            ptr
        ))
    }?;
    let end = start.checked_add(size as u64).ok_or(Error::InvalidArgument {
        what: "reading an imported allocation's range",
        reason: InvalidArgumentReason::RangePastAddressSpace { start, size },
    })?;
    Ok(end.saturating_sub(ptr))
}

impl MemPool {
    /// Imports a pool another process exported with [`Pool::export_fd`].
    ///
    /// The descriptor is checked before the driver sees it (the driver answers a closed one with
    /// `CUDA_ERROR_UNKNOWN`). Its location is known on a 13.2 driver ([`Pool::location`]); on
    /// older drivers the importer learns it from the exporter. Allocating from it is refused:
    /// map the exporter's allocations with [`Pool::import_pointer`].
    ///
    /// # Errors
    /// [`Error::NotShareable`] for a descriptor that is not open; [`Error::SharingRefused`] when
    /// the driver refuses it.
    ///
    /// See [cuMemPoolImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    #[cfg(unix)]
    pub fn import_fd(fd: impl AsFd) -> Result<Self> {
        let raw = fd.as_fd().as_raw_fd();
        // SAFETY: F_GETFD only reads the descriptor's flags.
        if unsafe { libc::fcntl(raw, libc::F_GETFD) } == -1 {
            return Err(Error::NotShareable {
                what: "importing a pool",
                reason: NotShareableReason::DescriptorNotOpen { descriptor: raw },
            });
        }
        let mut pool = std::ptr::null_mut();
        // The driver takes the descriptor's value smuggled in the pointer argument.
        let handle = raw as isize as *mut c_void;
        let kind = HandleTypes::POSIX_FILE_DESCRIPTOR.to_raw();
        // SAFETY: a valid out-pointer and an open descriptor.
        let answer = unsafe { driver_answer!(cuMemPoolImportFromShareableHandle(&mut pool, handle, kind, 0)) }?;
        refused_unless_success(
            answer,
            "importing a pool",
            "the descriptor must come from Pool::export_fd in another process",
        )?;
        tracing::info!(pool = ?pool, "memory pool imported");
        Ok(Self::imported(pool))
    }

    /// Imports a pool another process exported with [`Pool::export_fabric`], on this node or
    /// another of the same NVLink domain (multi-node NVLink with IMEX). Map its allocations
    /// with [`Pool::import_pointer`], as for [`MemPool::import_fd`].
    ///
    /// Refused before the driver without an IMEX channel (`/dev/nvidia-caps-imex-channels/*`),
    /// as the export is.
    ///
    /// # Errors
    /// [`Error::NotShareable`] without an IMEX channel; [`Error::SharingRefused`] when the
    /// driver refuses the handle.
    ///
    /// See [cuMemPoolImportFromShareableHandle](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn import_fabric(handle: &[u8; 64]) -> Result<Self> {
        const WHAT: &str = "importing a pool from a fabric handle";
        require_imex_channel(WHAT)?;
        let mut fabric = sys::CUmemFabricHandle { data: *handle };
        let mut pool = std::ptr::null_mut();
        let kind = HandleTypes::FABRIC.to_raw();
        // SAFETY: for FABRIC the handle points at a CUmemFabricHandle, alive for the call.
        let answer = unsafe {
            driver_answer!(cuMemPoolImportFromShareableHandle(
                &mut pool,
                (&mut fabric as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                kind,
                0
            ))
        }?;
        refused_unless_success(answer, WHAT, "the handle must come from Pool::export_fabric in the same NVLink domain, with an IMEX channel on both nodes")?;
        tracing::info!(pool = ?pool, "memory pool imported from a fabric handle");
        Ok(Self::imported(pool))
    }

    /// An imported pool, with its route where the driver tells it (13.2 and newer).
    fn imported(pool: sys::CUmemoryPool) -> Self {
        let imported = Pool::owned(pool, None, None, true);
        let route = imported.location().ok().zip(imported.allocation_type().ok());
        MemPool::from_pool(imported.with_route(route.map(|(l, t)| crate::Route::new(l, t))))
    }
}
