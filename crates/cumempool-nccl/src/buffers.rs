//! What collectives read and write: device memory of one device, typed by element.

use crate::bindings::ncclDataType_t;
use crate::error::{check, Error, InvalidArgumentReason, Result};
use crate::loader::nccl;
use cumempool::sys::CUdeviceptr;
use cumempool::{AllocationType, BufferOn, Context, Device, Location, Stream};
use cumempool_alloc::{Allocation, Arena, StreamOrderedResource};
use std::borrow::Borrow;
use std::ffi::c_void;
use std::marker::PhantomData;

/// Device memory a collective may read or write: its address, size and device.
///
/// Only memory of one device that the host never borrows qualifies (a pinned device pool's
/// buffers, arena memory, [`NcclMemory`]); NCCL writes it the way a kernel does, so a shared
/// reference is enough, as for a kernel argument. Memory the host can reach (host, managed) is
/// refused by [`DeviceBuffer::device`] before NCCL sees it.
pub trait DeviceBuffer {
    /// The first address.
    fn device_ptr(&self) -> CUdeviceptr;
    /// The size in bytes.
    fn byte_len(&self) -> usize;
    /// The device the memory lives on, or what it is instead, in words.
    fn device(&self) -> std::result::Result<i32, String>;
}

impl<S: Borrow<Stream>> DeviceBuffer for BufferOn<S> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.as_raw()
    }
    fn byte_len(&self) -> usize {
        self.len()
    }
    fn device(&self) -> std::result::Result<i32, String> {
        match self.route() {
            Some(route) => match (route.location, route.allocation_type) {
                (Location::Device(ordinal), AllocationType::Pinned) => Ok(ordinal),
                _ => Err(format!("memory of {route}, which the host can reach; use a device pool's buffer")),
            },
            None => Err("memory of an imported pool of unknown location".to_owned()),
        }
    }
}

/// A span of an arena's memory (or other device memory whose device is known), borrowed for
/// collectives and registrations.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a> {
    ptr: CUdeviceptr,
    len: usize,
    device: i32,
    memory: PhantomData<&'a ()>,
}

impl<'a> DeviceSlice<'a> {
    /// An allocation of `arena` (directly or through a cache over it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the allocation does not lie in the arena.
    pub fn of_arena<R: StreamOrderedResource>(arena: &'a Arena, allocation: &'a Allocation<'_, R>) -> Result<Self> {
        if !arena.contains(allocation.as_raw(), allocation.len()) {
            return Err(Error::InvalidArgument {
                what: "borrowing arena memory",
                reason: InvalidArgumentReason::OutsideArena {
                    address: allocation.as_raw(),
                    len: allocation.len(),
                    arena_base: arena.base(),
                },
            });
        }
        Ok(Self { ptr: allocation.as_raw(), len: allocation.len(), device: arena.device(), memory: PhantomData })
    }

    /// Device memory given by address.
    ///
    /// # Safety
    /// `len` bytes at `ptr` must be device memory of `device`, not reachable from the host, and
    /// stay allocated for `'a`.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize, device: i32) -> Self {
        Self { ptr, len, device, memory: PhantomData }
    }

    /// The first `len` bytes, or `None` when the slice is shorter.
    pub fn prefix(&self, len: usize) -> Option<Self> {
        (len <= self.len).then_some(Self { len, ..*self })
    }
}

impl DeviceBuffer for DeviceSlice<'_> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn device(&self) -> std::result::Result<i32, String> {
        Ok(self.device)
    }
}

/// Memory from `ncclMemAlloc` (VMM memory NCCL maps on every peer that registers it), freed
/// with `ncclMemFree` when dropped. Allocated on the device whose context is made current.
#[derive(Debug)]
pub struct NcclMemory {
    ptr: CUdeviceptr,
    len: usize,
    device: i32,
    context: Context,
}

impl NcclMemory {
    /// `len` bytes on `device`.
    ///
    /// # Errors
    /// [`Error::Load`] before NCCL 2.19; NCCL's refusal.
    pub fn new(device: i32, len: usize) -> Result<Self> {
        let context = Device::get(device)?.primary_context()?;
        context.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let alloc = nccl()?.ncclMemAlloc()?;
        // SAFETY: a valid out-pointer.
        check("ncclMemAlloc", unsafe { alloc(&mut ptr, len) }, None)?;
        Ok(Self { ptr: ptr as CUdeviceptr, len, device, context })
    }
}

const _: () = {
    const fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<NcclMemory>();
    send_and_sync::<DeviceSlice<'static>>();
};

impl DeviceBuffer for NcclMemory {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn device(&self) -> std::result::Result<i32, String> {
        Ok(self.device)
    }
}

impl Drop for NcclMemory {
    fn drop(&mut self) {
        let freed = self.context.make_current().map_err(Error::from).and_then(|()| {
            let free = nccl()?.ncclMemFree()?;
            // SAFETY: memory ncclMemAlloc handed out, freed once.
            check("ncclMemFree", unsafe { free(self.ptr as *mut c_void) }, None)
        });
        if let Err(error) = freed {
            tracing::warn!(%error, ptr = self.ptr, "freeing NCCL memory failed");
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL reduces: `i8`, `u8`, `i32`, `u32`, `i64`, `u64`, `f32`, `f64`.
pub trait Element: Copy + sealed::Sealed {
    /// NCCL's name for it.
    const DATA_TYPE: ncclDataType_t;
}

macro_rules! elements {
    ($($t:ty => $nccl:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DATA_TYPE: ncclDataType_t = ncclDataType_t::$nccl;
        }
    )*};
}

elements!(i8 => ncclInt8, u8 => ncclUint8, i32 => ncclInt32, u32 => ncclUint32, i64 => ncclInt64,
    u64 => ncclUint64, f32 => ncclFloat32, f64 => ncclFloat64);

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The maximum.
    Max,
    /// The minimum.
    Min,
    /// The mean (NCCL 2.10 and newer).
    Avg,
}

impl ReduceOp {
    pub(crate) fn to_raw(self) -> crate::bindings::ncclRedOp_t {
        use crate::bindings::ncclRedOp_t as Op;
        match self {
            Self::Sum => Op::ncclSum,
            Self::Prod => Op::ncclProd,
            Self::Max => Op::ncclMax,
            Self::Min => Op::ncclMin,
            Self::Avg => Op::ncclAvg,
        }
    }
}
