//! A pool as a bare driver handle: what the pool handles ([`Pool`](crate::Pool) and its kin) sit
//! on, naming no `Pool`. Here, the driver calls on a bare pool handle that the layers under
//! `Pool` need: destroying and trimming. The owner and the retired list hold only the handle;
//! `Pool`'s own methods call the same functions, so each driver function has one call site.
//! Below: the one owner of a pool's lifetime, how a pool was made, retired pools, and the
//! attribute table.

pub(crate) mod attributes;
pub(crate) mod pool_owner;
pub(crate) mod pool_recipe;
pub(crate) mod retirement;

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
