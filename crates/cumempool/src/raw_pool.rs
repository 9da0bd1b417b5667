//! The driver calls on a bare pool handle that the layers under [`Pool`](crate::Pool) need:
//! destroying and trimming. The owner and the retired list hold only the handle; `Pool`'s own
//! methods call the same functions, so each driver function has one call site.

use crate::driver::driver_call;
use crate::error::Result;
use cumempool_sys as sys;

/// Destroys a pool: the one `cuMemPoolDestroy` of the crate.
///
/// # Safety
/// `raw` is a live pool, destroyed once, that no thread allocates from or through a route now.
pub(crate) unsafe fn destroy(raw: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: as the caller promised.
    unsafe { driver_call!(cuMemPoolDestroy(raw)) }
}

/// Releases memory the pool `raw` holds beyond `keep_bytes` back to the system
/// (`cuMemPoolTrimTo`).
///
/// # Safety
/// `raw` is a live pool.
pub(crate) unsafe fn trim_to(raw: sys::CUmemoryPool, keep_bytes: usize) -> Result<()> {
    // SAFETY: as the caller promised.
    unsafe { driver_call!(cuMemPoolTrimTo(raw, keep_bytes)) }
}
