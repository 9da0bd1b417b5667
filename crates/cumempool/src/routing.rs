//! Location-keyed routing (CUDA 13.0): each route has a default pool, which the driver owns,
//! and a current pool, which `cuMemAllocAsync`-style allocations at that route use.
//!
//! Changing a route's current pool is **process-global**: every thread and every library in
//! the process that allocates through that route is affected. [`set_current_pool`] therefore
//! returns a guard that undoes the change, and a pool this crate routed is kept alive for as
//! long as it is current. The rules for several guards on one route are on [`set_current_pool`].

use crate::driver::{driver_answer, Answer};
use crate::driver_handle::DriverHandle;
use crate::error::{Error, Result};
use crate::location::Route;
use crate::pool::{Pool, PoolRef};
use cumempool_sys as sys;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// `Ok` for `CUDA_SUCCESS`, else [`Error::RouteRefused`] with the driver's answer.
fn route_answer(route: Route, answer: Answer) -> Result<()> {
    if answer.code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::RouteRefused { route, cause: answer.cause() })
    }
}

/// What this crate knows of each route it changed. See [`set_current_pool`] for the rules.
static ROUTED: Mutex<BTreeMap<Route, RouteStack>> = Mutex::new(BTreeMap::new());

fn routed() -> MutexGuard<'static, BTreeMap<Route, RouteStack>> {
    // Every update below leaves the map consistent before anything that can panic runs.
    ROUTED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One route's changes made through this crate, newest last.
#[derive(Debug)]
struct RouteStack {
    /// The pool that was current before the first entry: the driver's default, or a pool another
    /// library routed (which this crate cannot keep alive, so it is never restored blindly).
    base: Base,
    /// Pools made current through this crate; the route shows the last. Held here, so a pool is
    /// alive for as long as it is current.
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Base {
    Default(DriverHandle<sys::CUmemoryPool>),
    Foreign(DriverHandle<sys::CUmemoryPool>),
}

#[derive(Debug)]
struct Entry {
    /// The guard that removes it; [`KEPT`] once kept (or its guard forgotten: the same).
    guard: u64,
    pool: Pool,
}

/// The guard id of an entry that stays until the route is reset.
const KEPT: u64 = 0;

impl RouteStack {
    /// What the driver should show for this route if nothing outside this crate changed it.
    fn expected(&self) -> sys::CUmemoryPool {
        match (self.entries.last(), self.base) {
            (Some(entry), _) => entry.pool.as_raw(),
            (None, Base::Default(raw) | Base::Foreign(raw)) => raw.0,
        }
    }
}

/// The driver-owned default pool of `route`. Never changes and is never destroyed.
///
/// Looking it up changes nothing: unlike some other libraries, no attribute (such as the
/// release threshold) is raised behind the caller's back.
/// See [cuMemGetDefaultMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn default_pool(route: Route) -> Result<PoolRef> {
    let (mut location, allocation_type) = route.to_raw()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    route_answer(route, unsafe { driver_answer!(cuMemGetDefaultMemPool(&mut raw, &mut location, allocation_type)) }?)?;
    Ok(PoolRef::new(Pool::borrowed(raw, Some(route))))
}

fn current_raw(route: Route) -> Result<sys::CUmemoryPool> {
    let (mut location, allocation_type) = route.to_raw()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    route_answer(route, unsafe { driver_answer!(cuMemGetMemPool(&mut raw, &mut location, allocation_type)) }?)?;
    Ok(raw)
}

fn set_raw(route: Route, pool: sys::CUmemoryPool) -> Result<()> {
    let (mut location, allocation_type) = route.to_raw()?;
    // SAFETY: valid location and a live pool.
    route_answer(route, unsafe { driver_answer!(cuMemSetMemPool(&mut location, allocation_type, pool)) }?)
}

/// The current pool of `route`: the last one set for it, else its default pool.
///
/// A pool that this crate made current comes back owning, keeping it alive ([`Pool::is_owned`]);
/// the default pool and a pool routed by other code through the raw API come back not owning
/// (the driver keeps a default pool alive; the other code must keep its own).
///
/// # Errors
/// [`Error::InvalidRoute`] / [`Error::InvalidDevice`] before the driver, or the driver's refusal
/// as [`Error::RouteRefused`].
///
/// See [cuMemGetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn current_pool(route: Route) -> Result<Pool> {
    let map = routed();
    let raw = current_raw(route)?;
    let ours = map.get(&route).and_then(|stack| stack.entries.iter().rev().find(|e| e.pool.as_raw() == raw));
    let pool = match ours {
        Some(entry) => entry.pool.clone(),
        None => Pool::borrowed(raw, Some(route)),
    };
    Ok(pool)
}

/// Whether `route`'s current pool is its default pool.
///
/// # Errors
/// As [`current_pool`].
pub fn is_default(route: Route) -> Result<bool> {
    Ok(current_raw(route)? == default_pool(route)?.as_raw())
}

static NEXT_GUARD: AtomicU64 = AtomicU64::new(KEPT + 1);

/// Makes `pool` the current pool of `route`, **for the whole process**.
///
/// Every thread and library that allocates through this route from now on gets memory from
/// `pool`. While `pool` is current it is kept alive, even if every other handle to it is dropped.
///
/// Each route keeps a stack of the changes made through this crate:
/// - the route shows the newest change whose guard is alive (or was kept), and when none is
///   left, the pool that was current before the first one;
/// - dropping a [`RouteGuard`] removes its own change, in any order and from any thread; the
///   driver is only called when the pool it shows has to change;
/// - [`RouteGuard::keep`] (or forgetting the guard) leaves the change in place until
///   [`reset_current_pool`];
/// - a change made outside this crate (through the raw API) is never silently overwritten:
///   when a guard finds the route showing a pool it did not expect, it leaves the route as it
///   is and forgets this crate's changes to it (with a `tracing` warning);
/// - a pool that another library had made current before the first change is restored only
///   if it is the route's default pool; otherwise the default pool is restored (with a
///   warning), because this crate cannot know whether that library has destroyed it since.
///
/// A pool created for another route is refused with [`Error::PoolRouteMismatch`] before the
/// driver is called.
///
/// # Errors
/// [`Error::PoolRouteMismatch`], an invalid route, or the driver's refusal as
/// [`Error::RouteRefused`]; the route is unchanged then.
///
/// See [cuMemSetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub fn set_current_pool(route: Route, pool: &Pool) -> Result<RouteGuard> {
    if let Some(served) = pool.route() {
        if served != route {
            return Err(Error::PoolRouteMismatch { pool: served, route });
        }
    }
    let mut map = routed();
    let current = current_raw(route)?;
    // Changes made outside this crate since it last looked end its stack for this route.
    let detached = match map.get(&route) {
        Some(stack) if stack.expected() != current => {
            tracing::warn!(%route, expected = ?stack.expected(), found = ?current, "the current pool was changed outside cumempool; its earlier changes to this route are forgotten");
            map.remove(&route)
        }
        _ => None,
    };
    // A new stack's base is learnt before the driver switches the route: a lookup failing after
    // the switch would leave the route showing a pool that nothing keeps alive.
    let base = match map.get(&route) {
        Some(_) => None,
        None if current == default_raw(route)? => Some(Base::Default(DriverHandle(current))),
        None => Some(Base::Foreign(DriverHandle(current))),
    };
    set_raw(route, pool.as_raw())?;
    // `base` is known whenever the route has no stack: the lock is held throughout.
    let base = base.unwrap_or(Base::Default(DriverHandle(current)));
    let stack = map.entry(route).or_insert_with(|| RouteStack { base, entries: Vec::new() });
    let guard = NEXT_GUARD.fetch_add(1, Relaxed);
    stack.entries.push(Entry { guard, pool: pool.clone().with_route(Some(route)) });
    drop(map);
    drop(detached);
    tracing::info!(%route, pool = ?pool.as_raw(), previous = ?current, "current pool changed (process-wide)");
    Ok(RouteGuard { route, id: guard })
}

/// Makes `route`'s default pool current again, for the whole process, and forgets every change
/// made through this crate to it (their guards do nothing any more).
///
/// # Errors
/// An invalid route, or the driver's refusal; the route is unchanged then.
pub fn reset_current_pool(route: Route) -> Result<()> {
    let default = default_raw(route)?;
    let mut map = routed();
    set_raw(route, default)?;
    let released = map.remove(&route);
    drop(map);
    // Pools kept alive only by the route may be destroyed here, after the route moved on.
    drop(released);
    tracing::info!(%route, "current pool reset to the default (process-wide)");
    Ok(())
}

fn default_raw(route: Route) -> Result<sys::CUmemoryPool> {
    Ok(default_pool(route)?.as_raw())
}

/// Removes one change from its route's stack (see [`set_current_pool`]) when dropped.
#[derive(Debug)]
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub struct RouteGuard {
    route: Route,
    /// Its entry's id; [`KEPT`] once it has let go.
    id: u64,
}

impl RouteGuard {
    /// The route whose current pool was changed.
    pub fn route(&self) -> Route {
        self.route
    }

    /// Makes the change last: it stays on the route's stack (keeping its pool alive) until
    /// [`reset_current_pool`] or a change outside this crate.
    pub fn keep(mut self) {
        let mut map = routed();
        if let Some(entry) = map.get_mut(&self.route).and_then(|s| s.entries.iter_mut().find(|e| e.guard == self.id)) {
            entry.guard = KEPT;
        }
        self.id = KEPT;
    }

    /// Removes this change now and reports the driver's answer.
    ///
    /// # Errors
    /// The driver's refusal to show the pool below this change; the change then stays on the
    /// stack as if kept, so the pool the route still shows stays alive.
    pub fn restore(mut self) -> Result<()> {
        self.remove()
    }

    fn remove(&mut self) -> Result<()> {
        let id = std::mem::replace(&mut self.id, KEPT);
        if id == KEPT {
            return Ok(());
        }
        let mut map = routed();
        let Some(stack) = map.get_mut(&self.route) else {
            return Ok(()); // reset, or detached by a change outside this crate
        };
        let Some(index) = stack.entries.iter().position(|e| e.guard == id) else {
            return Ok(());
        };
        let current = current_raw(self.route)?;
        if current != stack.expected() {
            tracing::warn!(route = %self.route, found = ?current, "the current pool was changed outside cumempool; leaving it as it is");
            let detached = map.remove(&self.route);
            drop(map);
            drop(detached);
            return Ok(());
        }
        // What the route shows once this change is gone: the newest other change, else the base.
        let newest_other = stack.entries.iter().enumerate().rev().find(|(i, _)| *i != index);
        let wanted = match (newest_other, stack.base) {
            (Some((_, entry)), _) => entry.pool.as_raw(),
            (None, Base::Default(raw)) => raw.0,
            (None, Base::Foreign(raw)) => {
                tracing::warn!(route = %self.route, foreign = ?raw.0, "restoring the default pool, not the pool another library had made current: it may have been destroyed since");
                default_raw(self.route)?
            }
        };
        let removed = stack.entries.remove(index);
        if wanted != current {
            if let Err(error) = set_raw(self.route, wanted) {
                // The route still shows the removed pool: keep it alive, as if kept.
                stack.entries.insert(index, Entry { guard: KEPT, pool: removed.pool });
                return Err(error);
            }
        }
        if stack.entries.is_empty() {
            map.remove(&self.route);
        }
        drop(map);
        // A pool that was only kept alive by its route may be destroyed here, after the route moved on.
        drop(removed);
        tracing::info!(route = %self.route, "a route change was undone (process-wide)");
        Ok(())
    }
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        if let Err(error) = self.remove() {
            tracing::warn!(%error, route = %self.route, "undoing a route change failed; the route keeps its pool");
        }
    }
}
