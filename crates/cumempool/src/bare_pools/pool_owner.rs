//! The one owner of a pool's lifetime: whoever holds it (pool handles, buffers, routes) keeps
//! the pool alive, and the last to let go releases it, through one path: destroyed, or retired
//! if it was ever a route's current pool (the `retirement` module says why).

use crate::bare_pools;
use crate::bare_pools::pool_recipe::Recipe;
use crate::driver::handle::DriverHandle;
use crate::error::{Error, Result};
use cumempool_sys as sys;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// What names an imported allocation before the driver maps it: the imported pool's handle and
/// the allocation's export data.
pub(crate) type ImportKey = (usize, [u8; 64]);

/// Allocations imported from other processes and mapped now by one buffer each, in any imported
/// pool. The driver maps an allocation imported twice at the same address, and one unmapping
/// ends both: so each may be mapped by one buffer at a time.
#[derive(Debug)]
pub(crate) struct MappedImports {
    by_address: BTreeMap<sys::CUdeviceptr, ImportKey>,
    by_allocation: BTreeMap<ImportKey, sys::CUdeviceptr>,
}

impl MappedImports {
    const fn new() -> Self {
        Self { by_address: BTreeMap::new(), by_allocation: BTreeMap::new() }
    }

    /// Maps an allocation with `map` (the driver's import) and records it as the one buffer's
    /// mapping. An allocation a buffer maps is refused before `map` runs: a buffer being
    /// dropped forgets its mapping only after its unmapping has run, and a mapping the driver
    /// made in between (a fresh one, at the same address) would belong to no one.
    ///
    /// # Errors
    /// [`Error::AlreadyImported`] for an allocation a buffer maps; `map`'s error.
    pub(crate) fn import(
        &mut self,
        key: ImportKey,
        map: impl FnOnce() -> Result<sys::CUdeviceptr>,
    ) -> Result<sys::CUdeviceptr> {
        if let Some(address) = self.by_allocation.get(&key) {
            return Err(Error::AlreadyImported { address: *address });
        }
        let ptr = map()?;
        if self.by_address.contains_key(&ptr) {
            // The same allocation under other export data: the driver handed back the mapping a
            // live buffer holds (one mapping per allocation), not a new one.
            return Err(Error::AlreadyImported { address: ptr });
        }
        self.by_address.insert(ptr, key);
        self.by_allocation.insert(key, ptr);
        Ok(ptr)
    }

    /// Forgets the mapping at `ptr` once its unmapping has run.
    pub(crate) fn forget(&mut self, ptr: sys::CUdeviceptr) {
        if let Some(key) = self.by_address.remove(&ptr) {
            self.by_allocation.remove(&key);
        }
    }
}

static MAPPED_IMPORTS: Mutex<MappedImports> = Mutex::new(MappedImports::new());

/// The mapped imports, locked. Importing holds it from the check to the claim.
pub(crate) fn mapped_imports() -> MutexGuard<'static, MappedImports> {
    // Every update inserts or removes both entries before anything that can panic runs.
    MAPPED_IMPORTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Forgets `ptr` once its unmapping has run.
pub(crate) fn forget_mapping(ptr: sys::CUdeviceptr) {
    mapped_imports().forget(ptr);
}

/// Releases the pool (destroys or retires it) when the last holder (pool handle, buffer, route)
/// lets go.
#[derive(Debug)]
pub(crate) struct Owner {
    raw: DriverHandle<sys::CUmemoryPool>,
    pub(crate) imported: bool,
    /// Set when the driver left the pool in a state where destroying it crashes the process.
    unsafe_to_destroy: AtomicBool,
    /// How the pool was built, for pools `PoolBuilder` made: once retired, such a pool can serve
    /// a new pool with the same recipe.
    recipe: OnceLock<Recipe>,
    /// Set once the pool was given something a new owner must not inherit: access granted or
    /// changed for other devices, or an export to other processes (which hold its handle for
    /// good and can import allocations from it). Such a pool is never made anew.
    never_reuse: AtomicBool,
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
    /// Whether a pool with this fate may be handed to a caller who will destroy it.
    fn check_give_away(self) -> Result<()> {
        match self {
            Fate::Leak => Err(Error::UnsafeToDestroy),
            Fate::Retire => Err(Error::PoolWasCurrent),
            Fate::Destroy => Ok(()),
        }
    }

    fn of(unsafe_to_destroy: bool, ever_current: bool) -> Self {
        match (unsafe_to_destroy, ever_current) {
            (true, _) => Fate::Leak,
            (false, true) => Fate::Retire,
            (false, false) => Fate::Destroy,
        }
    }
}

impl Owner {
    /// The one place a pool is given back: Drop and [`MemPool::destroy`](crate::MemPool::destroy)
    /// both come here. A pool that was ever a route's current pool is retired (Ok), not destroyed.
    pub(crate) fn release(&self) -> Result<()> {
        let raw = self.raw.0;
        match Fate::of(self.unsafe_to_destroy.load(Relaxed), crate::bare_pools::retirement::was_ever_current(raw)) {
            // Driver 580: cuMemPoolDestroy crashes inside libcuda on a pool whose fabric export
            // was refused. Leaking the pool is the lesser harm.
            Fate::Leak => Err(Error::UnsafeToDestroy),
            Fate::Retire => {
                crate::bare_pools::retirement::retire(raw, self.reusable_recipe());
                Ok(())
            }
            Fate::Destroy => {
                // SAFETY: called once, by the pool's only owner (Drop, or `destroy` after taking
                // sole ownership and forgetting the owner); never a route's current pool.
                unsafe { bare_pools::destroy(raw) }?;
                tracing::debug!(pool = ?raw, imported = self.imported, "memory pool destroyed");
                Ok(())
            }
        }
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
        Self {
            raw: DriverHandle(raw),
            imported,
            unsafe_to_destroy: AtomicBool::new(false),
            recipe: OnceLock::new(),
            never_reuse: AtomicBool::new(false),
        }
    }

    pub(crate) fn set_recipe(&self, recipe: Recipe) {
        // Set once, right after the pool is made; a second recipe could only repeat the first.
        let _ = self.recipe.set(recipe);
    }

    /// Records that the pool's access was changed or that it was exported to other processes:
    /// once retired, it never serves a new owner.
    pub(crate) fn mark_never_reuse(&self) {
        self.never_reuse.store(true, Relaxed);
    }

    /// The recipe a retired pool may serve again: `None` for a pool that must never be made anew.
    fn reusable_recipe(&self) -> Option<Recipe> {
        if self.never_reuse.load(Relaxed) {
            return None;
        }
        self.recipe.get().copied()
    }

    /// Whether the caller may take the pool to destroy it itself (`MemPool::into_raw`): only a
    /// pool that would be destroyed here. A pool that was ever a route's current pool (a retired
    /// pool made anew included, whose handle stays marked) must be retired instead.
    pub(crate) fn check_give_away(&self) -> Result<()> {
        Fate::of(self.is_unsafe_to_destroy(), crate::bare_pools::retirement::was_ever_current(self.raw.0))
            .check_give_away()
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

    #[test]
    fn only_a_pool_that_would_be_destroyed_here_is_given_away() {
        assert!(Fate::of(false, false).check_give_away().is_ok());
        assert!(matches!(Fate::of(false, true).check_give_away(), Err(Error::PoolWasCurrent)));
        assert!(matches!(Fate::of(true, false).check_give_away(), Err(Error::UnsafeToDestroy)));
        // A pool made anew from a retired one keeps its handle's mark.
        let raw = 0xfeed_0000 as sys::CUmemoryPool;
        crate::bare_pools::retirement::note_current(raw);
        let owner = Owner::new(raw, false);
        assert!(matches!(owner.check_give_away(), Err(Error::PoolWasCurrent)));
        std::mem::forget(owner); // not a real pool: no release
    }

    #[test]
    fn a_pool_exported_or_given_access_never_serves_a_new_owner() {
        let owner = Owner::new(0xfeed_1000 as sys::CUmemoryPool, false);
        owner.set_recipe(Recipe::for_tests(1));
        assert!(owner.reusable_recipe().is_some(), "built by the builder: reusable");
        owner.mark_never_reuse();
        assert!(owner.reusable_recipe().is_none(), "exported or given access: never made anew");
        std::mem::forget(owner); // not a real pool: no release
    }

    #[test]
    fn an_allocation_whose_buffer_is_still_unmapping_is_refused_before_the_driver_maps_it_again() {
        let mut mapped = MappedImports::new();
        let key = (0x10, [7u8; 64]);
        assert_eq!(mapped.import(key, || Ok(0x1000)).ok(), Some(0x1000));
        // The buffer's drop has enqueued its unmapping and waits for it; it has not forgotten
        // the mapping yet. A concurrent import of the same allocation: the driver would map it
        // afresh at the same address once the unmapping ran, and that mapping was leaked.
        let mut driver_imports = 0;
        let racing = mapped.import(key, || {
            driver_imports += 1;
            Ok(0x1000)
        });
        assert!(matches!(racing, Err(Error::AlreadyImported { address: 0x1000 })), "{racing:?}");
        assert_eq!(driver_imports, 0, "refused before the driver made a mapping no buffer owns");
        mapped.forget(0x1000);
        assert_eq!(mapped.import(key, || Ok(0x1000)).ok(), Some(0x1000), "importable again once unmapped");
        // Another allocation, and the same export data in another imported pool, are their own.
        assert_eq!(mapped.import((0x10, [8u8; 64]), || Ok(0x2000)).ok(), Some(0x2000));
        assert_eq!(mapped.import((0x20, [7u8; 64]), || Ok(0x3000)).ok(), Some(0x3000));
        assert!(matches!(
            mapped.import((0x10, [9u8; 64]), || Ok(0x2000)),
            Err(Error::AlreadyImported { address: 0x2000 })
        ));
        mapped.forget(0x2000);
        assert!(mapped.import((0x10, [8u8; 64]), || Ok(0x2000)).is_ok(), "both names forgotten");
        let refused = mapped.import((0x10, [1u8; 64]), || Err(Error::UnsafeToDestroy));
        assert!(matches!(refused, Err(Error::UnsafeToDestroy)));
    }
}
