//! DLPack capsules over a buffer's memory (the `dlpack.h` structures, ABI version 1.0 and the
//! unversioned form), whose deleters keep only Rust state alive and may run on any thread, after
//! the buffer object is gone or during interpreter shutdown.

use crate::memory::{Core, Kind, Slot};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;
use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

/// DLPack's CPU device type.
pub const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
const KDL_CUDA_MANAGED: i32 = 13;
const KDL_UINT: u8 = 1;

const UNVERSIONED: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a capsule's tensor points into, boxed once: the shape lives beside the tensor and the
/// buffer's core is held until the consumer's deleter runs.
struct Context {
    shape: [i64; 1],
    core: Arc<Core>,
}

impl Context {
    /// Lets go of the core: through [`Core::release`] where the caller holds the GIL (`py`), so
    /// the memo of lent streams forgets a stream nothing uses any more, else without touching
    /// Python.
    fn release(self, py: Option<Python<'_>>) {
        match py {
            Some(py) => Core::release(Slot::Shared(self.core), py),
            None => Core::release_unattached(self.core),
        }
    }
}

/// `(device type, device id)` of a buffer, as DLPack numbers them.
pub fn device_of(core: &Core) -> (i32, i32) {
    match core.kind {
        Kind::Device => (KDL_CUDA, core.device),
        Kind::Host => (KDL_CUDA_HOST, 0),
        Kind::Managed => (KDL_CUDA_MANAGED, 0),
    }
}

fn tensor(core: &Core, shape: *mut i64, (device_type, device_id): (i32, i32)) -> DLTensor {
    DLTensor {
        data: core.ptr() as usize as *mut c_void,
        device: DLDevice { device_type, device_id },
        ndim: 1,
        dtype: DLDataType { code: KDL_UINT, bits: 8, lanes: 1 },
        shape,
        strides: std::ptr::null_mut(), // C order
        byte_offset: 0,
    }
}

/// A capsule over `core`'s memory as DLPack device `device`: versioned
/// (`"dltensor_versioned"`) or not (`"dltensor"`).
pub fn capsule(py: Python<'_>, core: Arc<Core>, versioned: bool, device: (i32, i32)) -> PyResult<Bound<'_, PyCapsule>> {
    let context = Box::into_raw(Box::new(Context { shape: [core.len() as i64], core }));
    // SAFETY: `context` was just boxed; the shape stays put inside the box until it is freed.
    let shape = unsafe { (*context).shape.as_mut_ptr() };
    // SAFETY: as above; the tensor only reads the core.
    let dl_tensor = tensor(unsafe { &(*context).core }, shape, device);
    let (pointer, name, destructor): (*mut c_void, &'static CStr, ffi::PyCapsule_Destructor) = if versioned {
        let managed = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: context.cast(),
            deleter: Some(delete_versioned),
            flags: 0,
            dl_tensor,
        });
        (Box::into_raw(managed).cast(), VERSIONED, drop_versioned_capsule)
    } else {
        let managed =
            Box::new(DLManagedTensor { dl_tensor, manager_ctx: context.cast(), deleter: Some(delete_unversioned) });
        (Box::into_raw(managed).cast(), UNVERSIONED, drop_unversioned_capsule)
    };
    let Some(pointer) = NonNull::new(pointer) else {
        return Err(pyo3::exceptions::PyMemoryError::new_err("no memory for a DLPack tensor"));
    };
    // SAFETY: `pointer` is a boxed managed tensor that the destructor frees unless a consumer
    // renamed the capsule (taking ownership, and the duty to call the deleter).
    let made = unsafe { PyCapsule::new_with_pointer_and_destructor(py, pointer, name, Some(destructor)) };
    if made.is_err() {
        // SAFETY: the capsule was not made, so nothing else owns the tensor.
        unsafe {
            if versioned {
                delete_versioned(pointer.as_ptr().cast());
            } else {
                delete_unversioned(pointer.as_ptr().cast());
            }
        }
    }
    made
}

/// The deleter a consumer calls: frees the tensor and lets go of the buffer's core. Touches no
/// Python object (the core's stream reference is released lazily), so any thread may call it,
/// with or without the GIL, during shutdown too.
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: forwarded under DLPack's rule (made by `capsule`, deleted once).
    unsafe { free_versioned(managed, None) }
}

unsafe extern "C" fn delete_unversioned(managed: *mut DLManagedTensor) {
    // SAFETY: as in `delete_versioned`.
    unsafe { free_unversioned(managed, None) }
}

/// Frees a tensor `capsule` made, and lets go of its core (with the GIL when `py` is given).
///
/// # Safety
/// `managed` is null or a tensor of `capsule`, not freed before.
unsafe fn free_versioned(managed: *mut DLManagedTensorVersioned, py: Option<Python<'_>>) {
    if managed.is_null() {
        return;
    }
    // The caller may hold the GIL or not: the GIL is left as it is.
    let _unmarked = crate::sync::gil::Unmarked::new();
    // SAFETY: made by `capsule` with Box::into_raw, deleted once (DLPack's rule).
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: the context box belongs to this tensor.
    unsafe { Box::from_raw(managed.manager_ctx.cast::<Context>()) }.release(py);
}

/// As [`free_versioned`], for the unversioned tensor.
///
/// # Safety
/// As for [`free_versioned`].
unsafe fn free_unversioned(managed: *mut DLManagedTensor, py: Option<Python<'_>>) {
    if managed.is_null() {
        return;
    }
    let _unmarked = crate::sync::gil::Unmarked::new();
    // SAFETY: as in `free_versioned`.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as in `free_versioned`.
    unsafe { Box::from_raw(managed.manager_ctx.cast::<Context>()) }.release(py);
}

/// A capsule collected while still named as made: no consumer took the tensor, so it is freed,
/// with the GIL Python holds while it runs a capsule's destructor.
unsafe extern "C" fn drop_versioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with a live capsule, holding the GIL.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let py = Python::assume_attached();
            free_versioned(ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()).cast(), Some(py));
        }
    }
}

unsafe extern "C" fn drop_unversioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `drop_versioned_capsule`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, UNVERSIONED.as_ptr()) == 1 {
            let py = Python::assume_attached();
            free_unversioned(ffi::PyCapsule_GetPointer(capsule, UNVERSIONED.as_ptr()).cast(), Some(py));
        }
    }
}
