//! The one owner of a pool's lifetime: whoever holds it (pool handles, buffers, routes) keeps
//! the pool alive, and the last to let go releases it, through one path: destroyed, or retired
//! if it was ever a route's current pool (the `retirement` module says why).

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

/// Releases the pool (destroys or retires it) when the last holder (pool handle, buffer, route)
/// lets go.
#[derive(Debug)]
pub(crate) struct Owner {
    raw: DriverHandle<sys::CUmemoryPool>,
    pub(crate) imported: bool,
    /// Set when the driver left the pool in a state where destroying it crashes the process.
    unsafe_to_destroy: AtomicBool,
}

/// What happens to a pool when its last holder lets go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Never destroyed: the driver would crash (see [`Owner::mark_unsafe_to_destroy`]).
    Leak,
    /// Kept until `destroy_retired_pools`: it was a route's current pool, and another thread's
    /// `cuMemAllocAsync` may still read it.
    Retire,
    /// Destroyed now.
    Destroy,
}

impl Fate {
    fn of(unsafe_to_destroy: bool, ever_current: bool) -> Self {
        match (unsafe_to_destroy, ever_current) {
            (true, _) => Fate::Leak,
            (false, true) => Fate::Retire,
            (false, false) => Fate::Destroy,
        }
    }
}

impl Owner {
    /// The one place a pool is given back: Drop and [`MemPool::destroy`] both come here. A pool
    /// that was ever a route's current pool is retired (Ok), not destroyed.
    pub(crate) fn release(&self) -> Result<()> {
        let raw = self.raw.0;
        match Fate::of(self.unsafe_to_destroy.load(Relaxed), crate::retirement::was_ever_current(raw)) {
            // Driver 580: cuMemPoolDestroy crashes inside libcuda on a pool whose fabric export
            // was refused. Leaking the pool is the lesser harm.
            Fate::Leak => Err(Error::UnsafeToDestroy),
            Fate::Retire => {
                crate::retirement::retire(raw);
                Ok(())
            }
            Fate::Destroy => {
                // SAFETY: called once, by the pool's only owner (Drop, or `destroy` after taking
                // sole ownership and forgetting the owner); never a route's current pool.
                unsafe { destroy_pool(raw) }?;
                tracing::debug!(pool = ?raw, imported = self.imported, "memory pool destroyed");
                Ok(())
            }
        }
    }
}

/// Destroys a pool: the one `cuMemPoolDestroy` of the crate.
///
/// # Safety
/// `raw` is a live pool, destroyed once, that no thread allocates from or through a route now.
pub(crate) unsafe fn destroy_pool(raw: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: as the caller promised.
    unsafe { driver_call!(cuMemPoolDestroy(raw)) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_that_was_ever_current_is_retired_and_one_the_driver_would_crash_on_is_left() {
        assert_eq!(Fate::of(false, false), Fate::Destroy);
        assert_eq!(Fate::of(false, true), Fate::Retire);
        assert_eq!(Fate::of(true, true), Fate::Leak, "never destroyed, not even by destroy_retired_pools");
        assert_eq!(Fate::of(true, false), Fate::Leak);
    }
}
