//! What collectives read and write: device memory of one device, typed by element.

use crate::bindings::ncclDataType_t;
use crate::error::{check, Error, InvalidArgumentReason, Result};
use crate::loader::nccl;
use cumempool::sys::CUdeviceptr;
use cumempool::{AllocationType, Buffer, Context, Device, Location, OwnedBuffer, Route, Stream};
use cumempool_alloc::{Allocation, Arena, StreamOrderedResource};
use std::ffi::c_void;

/// Device memory a collective may read or write: its address, size, device, and the stream its
/// release is ordered on.
///
/// Only memory of one device that the host never borrows qualifies (a pinned device pool's
/// buffers, arena memory, [`NcclMemory`]); NCCL writes it the way a kernel does, so a shared
/// reference is enough, as for a kernel argument. Memory the host can reach (host, managed) is
/// refused by [`DeviceBuffer::device`] before NCCL sees it.
///
/// A collective queued on a stream other than the buffer's is ordered after the work queued on
/// the buffer's stream, and the buffer's stream after the collective (an event each way), so the
/// buffer's free, queued on its own stream, never releases memory NCCL still uses.
///
/// The trait is unsafe to implement because NCCL trusts what it says: a buffer that claimed more
/// bytes than it has would have NCCL write past its allocation.
///
/// ```compile_fail,E0200
/// #![forbid(unsafe_code)]
/// use cumempool::{sys::CUdeviceptr, Stream};
/// struct Lying;
/// impl cumempool_nccl::DeviceBuffer for Lying { // an unsafe trait: a safe impl does not compile
///     fn device_ptr(&self) -> CUdeviceptr { 0 }
///     fn byte_len(&self) -> usize { usize::MAX }
///     fn device(&self) -> Result<i32, String> { Ok(0) }
///     fn stream(&self) -> Option<&Stream> { None }
/// }
/// ```
///
/// # Safety
/// An implementation promises, for as long as the value lives, with the same answers at every
/// call:
/// - when [`device`](DeviceBuffer::device) answers `Ok(d)`, the [`byte_len`](DeviceBuffer::byte_len)
///   bytes at [`device_ptr`](DeviceBuffer::device_ptr) are allocated device memory of device `d`,
///   which nothing on the host reads or writes through a Rust reference;
/// - the memory stays allocated until the work queued with it has finished: when
///   [`stream`](DeviceBuffer::stream) answers a stream, its release is queued on that stream (as a
///   pool buffer's `cuMemFreeAsync` is), so that work the stream was made to wait for finishes
///   first; when it answers `None`, whoever releases the memory first waits for every stream
///   that used it.
pub unsafe trait DeviceBuffer {
    /// The first address.
    fn device_ptr(&self) -> CUdeviceptr;
    /// The size in bytes.
    fn byte_len(&self) -> usize;
    /// The device the memory lives on, or what it is instead, in words.
    fn device(&self) -> std::result::Result<i32, String>;
    /// The stream the memory is ordered on and released on, if any (see the trait's safety
    /// contract).
    fn stream(&self) -> Option<&Stream>;
}

/// Where a pool buffer lives, for [`DeviceBuffer::device`].
fn pool_buffer_device(route: Option<Route>) -> std::result::Result<i32, String> {
    match route {
        Some(route) => match (route.location, route.allocation_type) {
            (Location::Device(ordinal), AllocationType::Pinned) => Ok(ordinal),
            _ => Err(format!("memory of {route}, which the host can reach; use a device pool's buffer")),
        },
        None => Err("memory of an imported pool of unknown location".to_owned()),
    }
}

/// Pool buffers, borrowing or holding their stream.
macro_rules! pool_buffer {
    ($($buffer:ty),*) => {$(
        // SAFETY: a pool allocation of `len()` bytes at `as_raw()`, alive while the buffer lives
        // and freed with `cuMemFreeAsync` on the buffer's stream; only device pools' buffers
        // answer a device. Safe methods that give the host a slice of its bytes refuse device
        // memory.
        unsafe impl DeviceBuffer for $buffer {
            fn device_ptr(&self) -> CUdeviceptr {
                self.as_raw()
            }
            fn byte_len(&self) -> usize {
                self.len()
            }
            fn device(&self) -> std::result::Result<i32, String> {
                pool_buffer_device(self.route())
            }
            fn stream(&self) -> Option<&Stream> {
                Some(<$buffer>::stream(self))
            }
        }
    )*};
}

pool_buffer!(Buffer<'_>, OwnedBuffer);

/// A span of an arena's memory (or other device memory whose device is known), borrowed for
/// collectives and registrations.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a> {
    ptr: CUdeviceptr,
    len: usize,
    device: i32,
    stream: Option<&'a Stream>,
}

impl<'a> DeviceSlice<'a> {
    /// An allocation of `arena` (directly or through a cache over it), ordered on the
    /// allocation's stream.
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
        Ok(Self {
            ptr: allocation.as_raw(),
            len: allocation.len(),
            device: arena.device(),
            stream: Some(allocation.stream()),
        })
    }

    /// Device memory given by address, ordered on `stream` if given.
    ///
    /// # Safety
    /// `len` bytes at `ptr` must be device memory of `device`, not reachable from the host, and
    /// stay allocated for `'a` and until the work queued with the slice has finished: released
    /// on `stream` (after the work it was made to wait for) when one is given, else only after a
    /// wait for every stream that used it.
    pub unsafe fn from_raw(ptr: CUdeviceptr, len: usize, device: i32, stream: Option<&'a Stream>) -> Self {
        Self { ptr, len, device, stream }
    }

    /// The first `len` bytes, or `None` when the slice is shorter.
    pub fn prefix(&self, len: usize) -> Option<Self> {
        (len <= self.len).then_some(Self { len, ..*self })
    }
}

// SAFETY: made only by `of_arena` (a live arena allocation the slice borrows, freed on its stream)
// or by `from_raw`, whose caller promises the same.
unsafe impl DeviceBuffer for DeviceSlice<'_> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn device(&self) -> std::result::Result<i32, String> {
        Ok(self.device)
    }
    fn stream(&self) -> Option<&Stream> {
        self.stream
    }
}

/// Memory from `ncclMemAlloc` (VMM memory NCCL maps on every peer that registers it), ordered on
/// a stream like a pool buffer: collectives on other streams are ordered with it, and dropping
/// it waits on the host for that stream before `ncclMemFree` (which does not wait for the GPU).
#[derive(Debug)]
pub struct NcclMemory {
    ptr: CUdeviceptr,
    len: usize,
    device: i32,
    context: Context,
    stream: Stream,
}

impl NcclMemory {
    /// `len` bytes on `device`, ordered on `stream` (a stream of that device).
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for a stream of another device; [`Error::Load`] before NCCL 2.19;
    /// NCCL's refusal.
    pub fn new(device: i32, len: usize, stream: &Stream) -> Result<Self> {
        if let Some(other) = stream.context().map(|c| c.device().ordinal()).filter(|&d| d != device) {
            return Err(Error::WrongDevice {
                what: "allocating NCCL memory",
                found: format!("a stream of device {other}"),
                device,
            });
        }
        let context = Device::get(device)?.primary_context()?;
        context.make_current()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let alloc = nccl()?.ncclMemAlloc()?;
        // SAFETY: a valid out-pointer.
        check("ncclMemAlloc", unsafe { alloc(&mut ptr, len) }, None)?;
        Ok(Self { ptr: ptr as CUdeviceptr, len, device, context, stream: stream.clone() })
    }
}

const _: () = {
    const fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<NcclMemory>();
    send_and_sync::<DeviceSlice<'static>>();
};

// SAFETY: `len` bytes of `device` from ncclMemAlloc, freed only by `Drop` after a host wait for
// `stream`, which every collective on another stream made wait for itself.
unsafe impl DeviceBuffer for NcclMemory {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn byte_len(&self) -> usize {
        self.len
    }
    fn device(&self) -> std::result::Result<i32, String> {
        Ok(self.device)
    }
    fn stream(&self) -> Option<&Stream> {
        Some(&self.stream)
    }
}

impl Drop for NcclMemory {
    fn drop(&mut self) {
        // Work queued with the memory finishes before it is freed; where that cannot be waited
        // for (the stream captures), the memory is leaked rather than freed under that work.
        if let Err(error) = self.stream.wait_before_release() {
            tracing::warn!(%error, ptr = self.ptr, "NCCL memory whose stream could not be waited for is leaked");
            return;
        }
        let freed = self.context.make_current().map_err(Error::from).and_then(|()| {
            let free = nccl()?.ncclMemFree()?;
            // SAFETY: memory ncclMemAlloc handed out, freed once, after its stream's work.
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
