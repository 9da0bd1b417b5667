//! The C functions PyTorch's `CUDAPluggableAllocator` loads from this module's own shared
//! library, serving from the resource chosen in Python (`cumempool.torch`).
//!
//! They touch no Python object: PyTorch calls them from any thread, with or without the GIL.

use crate::dyn_resource::Resource;
use crate::resources::ResourceBase;
use cumempool::sys;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// What the exported functions serve: the resource and the device it allocates on.
#[derive(Clone)]
struct Served {
    resource: Arc<dyn Resource>,
    device: i32,
}

static SERVED: RwLock<Option<Served>> = RwLock::new(None);

/// One `Stream` per raw handle and device PyTorch passes, so a cache sees the same stream
/// every time (as PyTorch's own caching allocator, it keys by the handle's value). The device
/// is part of the key: the default stream is handle 0 on every device, and means each
/// device's own legacy stream.
static STREAMS: Mutex<Option<HashMap<(usize, i32), cumempool::Stream>>> = Mutex::new(None);

/// The resource each live allocation came from and its size, so a free goes back to it even
/// after Python switched or stopped what is served, with the size it was allocated with (a
/// cache files a block under its size: a wrong size PyTorch passes is never trusted).
static LIVE: Mutex<Option<HashMap<usize, Live>>> = Mutex::new(None);

/// A live allocation: the resource it came from and its size.
type Live = (Arc<dyn Resource>, usize);

fn stream_for(raw: usize, device: i32) -> cumempool::Result<cumempool::Stream> {
    let mut streams = STREAMS.lock().unwrap_or_else(PoisonError::into_inner);
    let streams = streams.get_or_insert_with(HashMap::new);
    if let Some(stream) = streams.get(&(raw, device)) {
        return Ok(stream.clone());
    }
    let context = cumempool::Device::get(device)?.primary_context()?;
    let stream = match raw {
        0 | 1 => cumempool::Stream::legacy(&context),
        // SAFETY: PyTorch never destroys its own streams (the default stream, its stream pools).
        // A stream lent to it through `torch.cuda.ExternalStream` is the lender's to keep alive,
        // as PyTorch requires; here, until the served resource gave back what was freed on it
        // (the plug-in's documented contract: docs/python.md, Plug-ins).
        _ => unsafe { cumempool::Stream::borrow_raw(raw as sys::CUstream, Some(&context)) }?,
    };
    streams.insert((raw, device), stream.clone());
    Ok(stream)
}

/// Serves the exported C functions from `resource` (or stops serving, with `None`).
#[pyfunction]
#[pyo3(signature = (resource))]
pub fn torch_serve(py: Python<'_>, resource: Option<&Bound<'_, ResourceBase>>) {
    let served = resource.map(|r| Served { resource: r.get().inner.clone(), device: r.get().device });
    // The lock is held only to swap (no allocation runs under it), and the resource served
    // until now is let go of after, without the GIL: a cache dropped there frees on the driver.
    let previous = std::mem::replace(&mut *SERVED.write().unwrap_or_else(PoisonError::into_inner), served);
    crate::gil::detach(py, || drop(previous));
}

/// PyTorch's pluggable allocation function: `size` bytes on `device`, ordered on `stream`;
/// null for zero bytes, and (PyTorch's out-of-memory) on any failure or for a device the resource
/// does not serve.
///
/// # Safety
/// Called by PyTorch with a valid stream of `device`.
#[no_mangle]
pub unsafe extern "C" fn cumempool_torch_alloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    // PyTorch may call in holding the GIL or not: the GIL is left as it is.
    let _unmarked = crate::gil::Unmarked::new();
    // Zero bytes (an empty tensor) is the null pointer, which PyTorch never frees: nothing is
    // allocated or kept for it, or it would stay live for ever and keep its resource alive.
    let Ok(size @ 1..) = usize::try_from(size) else {
        return std::ptr::null_mut();
    };
    // A clone, so no lock is held while the resource runs: its out-of-memory callback may
    // serve another resource or stop (`torch_serve` takes the write lock).
    let served = SERVED.read().unwrap_or_else(PoisonError::into_inner).clone();
    let Some(served) = served.filter(|s| s.device == device) else {
        return std::ptr::null_mut();
    };
    let answer = stream_for(stream as usize, device)
        .map_err(cumempool_alloc::Error::from)
        .and_then(|s| served.resource.allocate(size, &s));
    match answer {
        Ok(ptr) => {
            let mut live = LIVE.lock().unwrap_or_else(PoisonError::into_inner);
            live.get_or_insert_with(HashMap::new).insert(ptr as usize, (served.resource.clone(), size));
            ptr as usize as *mut c_void
        }
        Err(error) => {
            tracing::debug!(%error, size, device, "cumempool_torch_alloc failed");
            std::ptr::null_mut()
        }
    }
}

/// PyTorch's pluggable free function: gives `ptr` back on `stream`.
///
/// # Safety
/// `ptr` must come from `cumempool_torch_alloc` with the same device and stream, freed once. The
/// size is the one recorded at allocation, whatever `size` says.
#[no_mangle]
pub unsafe extern "C" fn cumempool_torch_free(ptr: *mut c_void, size: isize, device: i32, stream: *mut c_void) {
    // The null pointer is what an empty allocation got: nothing to give back.
    if ptr.is_null() {
        return;
    }
    // As in `cumempool_torch_alloc`.
    let _unmarked = crate::gil::Unmarked::new();
    let live = LIVE.lock().unwrap_or_else(PoisonError::into_inner).as_mut().and_then(|l| l.remove(&(ptr as usize)));
    let Some((resource, allocated)) = live else {
        tracing::warn!(?ptr, "cumempool_torch_free of memory cumempool_torch_alloc did not give: ignored");
        return;
    };
    if usize::try_from(size) != Ok(allocated) {
        tracing::warn!(
            ?ptr,
            size,
            allocated,
            "cumempool_torch_free given another size than allocated: freed with the allocated size"
        );
    }
    let size = allocated;
    let answer = stream_for(stream as usize, device).map_err(cumempool_alloc::Error::from).and_then(|s| {
        // SAFETY: PyTorch frees what cumempool_torch_alloc gave (it was live), with the size
        // recorded then, on its stream, to the resource it came from.
        unsafe { resource.deallocate(ptr as usize as sys::CUdeviceptr, size, &s) }
    });
    if let Err(error) = answer {
        tracing::warn!(%error, ?ptr, "cumempool_torch_free failed");
    }
}
