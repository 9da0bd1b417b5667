//! The one owner of a pool's lifetime: whoever holds it (pool handles, buffers, routes) keeps
//! the pool alive, and the last to let go destroys it, through one release path.

use crate::driver::driver_call;
use crate::driver_handle::DriverHandle;
use crate::error::{Error, Result};
use cumempool_sys as sys;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

/// Addresses of allocations imported from other processes and mapped now, in any imported pool.
/// The driver maps an allocation imported twice at the same address, and one unmapping ends
/// both: so each may be mapped by one buffer at a time.
static MAPPED_IMPORTS: Mutex<BTreeSet<sys::CUdeviceptr>> = Mutex::new(BTreeSet::new());

/// Records `ptr` as mapped by one buffer; false if a buffer already maps it.
pub(crate) fn claim_mapping(ptr: sys::CUdeviceptr) -> bool {
    MAPPED_IMPORTS.lock().unwrap_or_else(PoisonError::into_inner).insert(ptr)
}

/// Forgets `ptr` once its unmapping has run.
pub(crate) fn forget_mapping(ptr: sys::CUdeviceptr) {
    MAPPED_IMPORTS.lock().unwrap_or_else(PoisonError::into_inner).remove(&ptr);
}

/// Destroys the pool when the last holder (pool handle, buffer, route) lets go.
#[derive(Debug)]
pub(crate) struct Owner {
    raw: DriverHandle<sys::CUmemoryPool>,
    pub(crate) imported: bool,
    /// Set when the driver left the pool in a state where destroying it crashes the process.
    unsafe_to_destroy: AtomicBool,
}

impl Owner {
    /// The one place a pool is given back to the driver: Drop and [`MemPool::destroy`] both
    /// come here.
    pub(crate) fn release(&self) -> Result<()> {
        if self.unsafe_to_destroy.load(Relaxed) {
            // Driver 580: cuMemPoolDestroy crashes inside libcuda on a pool whose fabric export
            // was refused. Leaking the pool is the lesser harm.
            return Err(Error::UnsafeToDestroy);
        }
        // SAFETY: called once, by the pool's only owner (Drop, or `destroy` after taking sole
        // ownership and forgetting the owner).
        unsafe { driver_call!(cuMemPoolDestroy(self.raw.0)) }?;
        tracing::debug!(pool = ?self.raw.0, imported = self.imported, "memory pool destroyed");
        Ok(())
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::warn!(%error, pool = ?self.raw.0, "a memory pool was not destroyed");
        }
    }
}

impl Owner {
    pub(crate) fn new(raw: sys::CUmemoryPool, imported: bool) -> Self {
        Self { raw: DriverHandle(raw), imported, unsafe_to_destroy: AtomicBool::new(false) }
    }

    pub(crate) fn raw(&self) -> sys::CUmemoryPool {
        self.raw.0
    }

    /// Marks the pool as one the driver cannot destroy safely: it will be leaked, not destroyed.
    pub(crate) fn mark_unsafe_to_destroy(&self) {
        self.unsafe_to_destroy.store(true, Relaxed);
    }

    pub(crate) fn is_unsafe_to_destroy(&self) -> bool {
        self.unsafe_to_destroy.load(Relaxed)
    }
}
