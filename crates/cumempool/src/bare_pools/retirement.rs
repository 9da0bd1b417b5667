//! Teardown other threads survive: pools that were ever a route's current pool are retired, not
//! destroyed, when their last holder lets go.
//!
//! `cuMemAllocAsync` reads a route's current pool without keeping it alive. A thread of any
//! library may have read it just before the route moved on, so destroying a pool that was ever
//! current can pull it from under that allocation (driver 580 crashes inside `cuMemAllocAsync`,
//! see docs/driver-behaviour.md). Such pools are trimmed and kept on a process-wide list until
//! the program names a point where no thread allocates through a route:
//! [`destroy_retired_pools`]. At process exit the driver reclaims them; nothing needs doing.

use crate::bare_pools;
use crate::bare_pools::attributes::{self, PoolAttribute};
use crate::bare_pools::pool_recipe::Recipe;
use crate::driver::handle::DriverHandle;
use crate::error::Result;
use cumempool_sys as sys;
use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Handles of every pool the routing module saw as (or made) a route's current pool, until a
/// retired pool with that handle is destroyed. A handle of a pool that other code destroyed may
/// stay: a later pool the driver gives the same handle is then retired instead of destroyed,
/// which costs only its (trimmed) bookkeeping.
static EVER_CURRENT: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// Pools retired and not destroyed yet. Held while they are destroyed or measured, so no one
/// measures a destroyed pool.
static RETIRED: Mutex<RetiredList> = Mutex::new(RetiredList(Vec::new()));

/// Lock order: [`RETIRED`] before [`EVER_CURRENT`]; neither is held while taking the other in
/// the opposite order.
fn ever_current() -> MutexGuard<'static, BTreeSet<usize>> {
    // Every update is one insert or remove: the set is consistent whenever a panic could strike.
    EVER_CURRENT.lock().unwrap_or_else(PoisonError::into_inner)
}

fn retired_list() -> MutexGuard<'static, RetiredList> {
    // As above: one push, or a swap of the whole list.
    RETIRED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records that `raw` is (or is about to be) a route's current pool. Called before the route
/// shows it, so its owner cannot destroy it after the route did.
pub(crate) fn note_current(raw: sys::CUmemoryPool) {
    ever_current().insert(raw as usize);
}

/// Whether `raw` was ever a route's current pool (and so must be retired, not destroyed).
pub(crate) fn was_ever_current(raw: sys::CUmemoryPool) -> bool {
    ever_current().contains(&(raw as usize))
}

/// Retires a pool its last owner let go: gives its unused memory back and keeps the handle until
/// [`destroy_retired_pools`], or until a new pool with the same `recipe` takes it ([`reuse`]).
pub(crate) fn retire(raw: sys::CUmemoryPool, recipe: Option<Recipe>) {
    // Trimming frees only memory no allocation holds: allocations another library made from it
    // (through the route) stay valid.
    // SAFETY: its last owner let go of a live pool; it stays live until destroy_retired_pools.
    if let Err(error) = unsafe { bare_pools::trim_to(raw, 0) } {
        tracing::warn!(%error, pool = ?raw, "trimming a retired pool failed; its memory stays reserved until destroy_retired_pools");
    }
    retired_list().0.push(RetiredPool { handle: DriverHandle(raw), recipe });
    tracing::debug!(pool = ?raw, "memory pool retired (it was a route's current pool)");
}

/// Takes a retired pool made with `recipe` and holding no allocation, for a new pool made the same
/// way: the driver holds a bounded number of pools (on the H200, creation failed with
/// CUDA_ERROR_OUT_OF_MEMORY after some hundreds were retired), so retired pools are reused rather
/// than piled up. The pool stays one that was ever current: released again, it is retired again.
pub(crate) fn reuse(recipe: &Recipe) -> Option<sys::CUmemoryPool> {
    // SAFETY: `take` asks only about pools it lists, which are live while listed (locked here).
    let is_empty = |raw| unsafe { attributes::get(raw, PoolAttribute::UsedMemCurrent) }.is_ok_and(|used| used == 0);
    retired_list().take(recipe, is_empty)
}

/// How many pools are retired now.
pub(crate) fn retired_count() -> usize {
    retired_list().0.len()
}

/// A retired pool, and the recipe it can serve again (`None`: never reused).
#[derive(Debug)]
struct RetiredPool {
    handle: DriverHandle<sys::CUmemoryPool>,
    recipe: Option<Recipe>,
}

/// The pools retired and not destroyed yet, oldest first.
#[derive(Debug)]
struct RetiredList(Vec<RetiredPool>);

impl RetiredList {
    /// Removes the oldest pool made with `recipe` that `is_empty` says holds no allocation.
    fn take(
        &mut self,
        recipe: &Recipe,
        mut is_empty: impl FnMut(sys::CUmemoryPool) -> bool,
    ) -> Option<sys::CUmemoryPool> {
        let index = self.0.iter().position(|p| p.recipe.as_ref() == Some(recipe) && is_empty(p.handle.0))?;
        Some(self.0.remove(index).handle.0)
    }

    /// Destroys every pool with `destroy`, oldest first. On the first failure, that pool and the
    /// ones after it stay listed (never lost, never destroyed twice) and the error is returned.
    fn destroy_all(
        &mut self,
        mut destroy: impl FnMut(sys::CUmemoryPool) -> Result<()>,
    ) -> Result<Vec<sys::CUmemoryPool>> {
        let mut destroyed = Vec::new();
        let pools = std::mem::take(&mut self.0);
        let mut pools = pools.into_iter();
        while let Some(pool) = pools.next() {
            if let Err(error) = destroy(pool.handle.0) {
                self.0.push(pool);
                self.0.extend(pools);
                return Err(error);
            }
            destroyed.push(pool.handle.0);
        }
        Ok(destroyed)
    }
}

/// Destroys every retired pool (see [`retired_pools`]) and returns how many.
///
/// A pool that was ever a route's current pool ([`set_current_pool`](crate::set_current_pool),
/// or seen current by [`current_pool`](crate::current_pool) and its kin) is not destroyed when
/// its owner drops it or calls [`MemPool::destroy`](crate::MemPool::destroy): driver 580's
/// `cuMemAllocAsync` reads a route's current pool without keeping it alive, so a thread of any
/// library allocating through the route at that moment could crash the process. Such pools are
/// retired instead (trimmed, and never handed out again) until this call. At process exit
/// nothing needs doing: the driver reclaims them.
///
/// # Errors
/// The first refusal of `cuMemPoolDestroy`; that pool and the ones retired after it stay
/// listed for a later call.
///
/// # Safety
/// While this runs, no thread of the process (of any library) may allocate through a route
/// (`cuMemAllocAsync`, `cudaMallocAsync`, cudarc's or a framework's stream allocations) whose
/// current pool was ever a pool this crate retired, and no allocation from a retired pool may be
/// in use or used afterwards.
///
/// See [cuMemPoolDestroy](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub unsafe fn destroy_retired_pools() -> Result<usize> {
    let mut list = retired_list();
    // SAFETY: each retired pool is destroyed once (it leaves the list), and the caller promised
    // that no thread allocates through a route that showed it, nor uses its allocations.
    let destroyed = list.destroy_all(|raw| unsafe { bare_pools::destroy(raw) })?;
    // The driver may hand these handles to new pools: those start never current.
    let mut seen = ever_current();
    for raw in &destroyed {
        seen.remove(&(*raw as usize));
    }
    drop(seen);
    drop(list);
    tracing::info!(count = destroyed.len(), "retired memory pools destroyed");
    Ok(destroyed.len())
}

/// What the retired pools (see [`destroy_retired_pools`]) hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetiredPools {
    /// How many pools are retired and not destroyed yet.
    pub count: usize,
    /// The memory they reserve from the system, in bytes (`RESERVED_MEM_CURRENT`, summed):
    /// after their trim, what their live allocations need.
    pub reserved_bytes: u64,
    /// The memory of their live allocations, in bytes (`USED_MEM_CURRENT`, summed): allocations
    /// other code made through a route while the pool was current.
    pub used_bytes: u64,
}

/// The retired pools: how many, and the memory they hold. Asks the driver nothing when none is
/// retired.
///
/// # Errors
/// The driver's answer to `cuMemPoolGetAttribute`.
///
/// See [cuMemPoolGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn retired_pools() -> Result<RetiredPools> {
    let list = retired_list();
    let mut total = RetiredPools { count: list.0.len(), ..RetiredPools::default() };
    for retired in &list.0 {
        let raw = retired.handle.0;
        // SAFETY: a retired pool is live while it is listed, and the list is locked.
        let reserved = unsafe { attributes::get(raw, PoolAttribute::ReservedMemCurrent) }?;
        // SAFETY: as above.
        let used = unsafe { attributes::get(raw, PoolAttribute::UsedMemCurrent) }?;
        total.reserved_bytes = total.reserved_bytes.saturating_add(reserved);
        total.used_bytes = total.used_bytes.saturating_add(used);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn handle(n: usize) -> sys::CUmemoryPool {
        n as sys::CUmemoryPool
    }

    #[test]
    fn destroying_the_retired_pools_stops_at_the_first_refusal_and_keeps_the_rest() {
        let mut list =
            RetiredList((1..=4).map(|n| RetiredPool { handle: DriverHandle(handle(n)), recipe: None }).collect());
        let mut asked = Vec::new();
        let outcome = list.destroy_all(|raw| {
            asked.push(raw as usize);
            if raw as usize == 3 {
                Err(Error::UnsafeToDestroy)
            } else {
                Ok(())
            }
        });
        assert!(matches!(outcome, Err(Error::UnsafeToDestroy)));
        assert_eq!(asked, [1, 2, 3], "nothing after the refusal is tried");
        let left: Vec<usize> = list.0.iter().map(|p| p.handle.0 as usize).collect();
        assert_eq!(left, [3, 4], "the refused pool and the ones after it stay listed, once each");
        let destroyed = list.destroy_all(|_| Ok(())).map_err(|e| e.to_string());
        let destroyed: Vec<usize> = destroyed.unwrap_or_default().into_iter().map(|raw| raw as usize).collect();
        assert_eq!(destroyed, [3, 4]);
        assert!(list.0.is_empty());
    }

    #[test]
    fn only_an_empty_pool_of_the_same_recipe_is_taken_oldest_first() {
        let recipe = Recipe::for_tests;
        let pool = |n, max: Option<u64>| RetiredPool { handle: DriverHandle(handle(n)), recipe: max.map(recipe) };
        let mut list =
            RetiredList(vec![pool(1, None), pool(2, Some(1)), pool(3, Some(2)), pool(4, Some(2)), pool(5, Some(2))]);
        assert_eq!(list.take(&recipe(7), |_| true), None, "no pool of that recipe");
        let taken = list.take(&recipe(2), |raw| raw as usize != 3);
        assert_eq!(taken.map(|raw| raw as usize), Some(4), "3 still holds an allocation; 4 is the oldest empty one");
        let left: Vec<usize> = list.0.iter().map(|p| p.handle.0 as usize).collect();
        assert_eq!(left, [1, 2, 3, 5]);
        assert_eq!(list.take(&recipe(1), |_| true).map(|raw| raw as usize), Some(2));
    }

    #[test]
    fn a_pool_is_retired_once_a_route_showed_it() {
        let raw = handle(0xbeef_0000);
        assert!(!was_ever_current(raw));
        note_current(raw);
        assert!(was_ever_current(raw));
    }
}
