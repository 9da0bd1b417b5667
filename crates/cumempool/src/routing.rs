//! Location-keyed routing (CUDA 13.0): each route has a default pool, which the driver owns,
//! and a current pool, which `cuMemAllocAsync`-style allocations at that route use.
//!
//! Changing a route's current pool is **process-global**: every thread and every library in
//! the process that allocates through that route is affected. [`set_current_pool`] therefore
//! returns a guard that undoes the change, and a pool this crate routed is kept alive for as
//! long as it is current. The rules for several guards on one route are on [`set_current_pool`].
//!
//! A pool that was ever current is never destroyed when its last holder lets go: another
//! thread's allocation may still be reading it. It is retired until
//! [`destroy_retired_pools`](crate::destroy_retired_pools).

pub(crate) mod table;

use crate::devices::checked_route::CheckedRoute;
use crate::driver::handle::DriverHandle;
use crate::driver::{driver_answer, Answer};
use crate::error::{Error, Result};
use crate::pool::{Pool, PoolRef};
use crate::values::route::Route;
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
    /// Pools of changes forgotten after a change outside this crate: other code may have saved
    /// one to restore it later, so they stay alive until [`reset_current_pool`].
    forgotten: Vec<Pool>,
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
    fn new(base: Base) -> Self {
        Self { base, entries: Vec::new(), forgotten: Vec::new() }
    }

    /// After a change outside this crate: this crate's changes are forgotten (their guards do
    /// nothing any more), their pools kept alive, and `current` is the new base.
    fn detach(&mut self, current: Base) {
        let forgotten = std::mem::take(&mut self.entries).into_iter().map(|entry| entry.pool);
        self.forgotten.extend(forgotten);
        self.base = current;
    }

    /// A pool this crate holds for the route (current or forgotten) with this handle.
    fn holding(&self, raw: sys::CUmemoryPool) -> Option<&Pool> {
        let entries = self.entries.iter().rev().map(|entry| &entry.pool);
        entries.chain(self.forgotten.iter()).find(|pool| pool.as_raw() == raw)
    }

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
///
/// # Errors
/// [`Error::InvalidRoute`] or [`Error::InvalidDevice`] before the driver; the driver's refusal
/// (a route it has no pool for) as [`Error::RouteRefused`].
///
/// See [cuMemGetDefaultMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn default_pool(route: Route) -> Result<PoolRef> {
    let raw = default_raw(route.checked()?)?;
    Ok(PoolRef::new(Pool::default_of(raw, route)))
}

fn default_raw(route: CheckedRoute) -> Result<sys::CUmemoryPool> {
    let (mut location, allocation_type) = route.to_raw();
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    let answer = unsafe { driver_answer!(cuMemGetDefaultMemPool(&mut raw, &mut location, allocation_type)) }?;
    route_answer(route.route(), answer)?;
    Ok(raw)
}

fn current_raw(route: CheckedRoute) -> Result<sys::CUmemoryPool> {
    let (mut location, allocation_type) = route.to_raw();
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    let answer = unsafe { driver_answer!(cuMemGetMemPool(&mut raw, &mut location, allocation_type)) }?;
    route_answer(route.route(), answer)?;
    // Seen current: other threads may allocate from it, so it must never be destroyed by this crate.
    crate::bare_pools::retirement::note_current(raw);
    Ok(raw)
}

fn set_raw(route: CheckedRoute, pool: sys::CUmemoryPool) -> Result<()> {
    let (mut location, allocation_type) = route.to_raw();
    // SAFETY: valid location and a live pool.
    route_answer(route.route(), unsafe { driver_answer!(cuMemSetMemPool(&mut location, allocation_type, pool)) }?)
}

/// The current pool of `route`: the last one set for it, else its default pool.
///
/// A pool that this crate made current comes back owning, keeping it alive ([`Pool::is_owned`]);
/// the default pool comes back not owning (the driver never destroys it). A pool that other
/// code made current through the raw API is refused: this crate cannot keep it alive, and a
/// safe handle to it would outlive its destruction; [`current_pool_handle`] gives its raw
/// handle.
///
/// # Errors
/// [`Error::InvalidRoute`] / [`Error::InvalidDevice`] before the driver, the driver's refusal
/// as [`Error::RouteRefused`], and [`Error::ForeignCurrentPool`] for a pool routed by other code.
///
/// See [cuMemGetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn current_pool(route: Route) -> Result<Pool> {
    let valid = route.checked()?;
    let map = routed();
    let raw = current_raw(valid)?;
    if let Some(pool) = map.get(&route).and_then(|stack| stack.holding(raw)) {
        return Ok(pool.clone());
    }
    drop(map);
    if raw == default_raw(valid)? {
        return Ok(Pool::default_of(raw, route));
    }
    Err(Error::ForeignCurrentPool { route, handle: raw as usize as u64 })
}

/// The raw handle of `route`'s current pool, whoever made it current: for inspection, or for
/// `unsafe` [`PoolRef::from_raw`](crate::PoolRef::from_raw) by code that knows the pool's owner
/// keeps it alive.
///
/// # Errors
/// As [`current_pool`], except that a foreign pool is answered.
pub fn current_pool_handle(route: Route) -> Result<sys::CUmemoryPool> {
    current_raw(route.checked()?)
}

/// Whether `route`'s current pool is its default pool.
///
/// # Errors
/// As [`current_pool`].
pub fn is_default(route: Route) -> Result<bool> {
    let valid = route.checked()?;
    Ok(current_raw(valid)? == default_raw(valid)?)
}

static NEXT_GUARD: AtomicU64 = AtomicU64::new(KEPT + 1);

/// Makes `pool` the current pool of `route`, **for the whole process**.
///
/// Every thread and library that allocates through this route from now on gets memory from
/// `pool`. While `pool` is current it is kept alive, even if every other handle to it is dropped;
/// afterwards, when its last holder lets go, it is retired rather than destroyed (another
/// thread's `cuMemAllocAsync` may still be reading it), until
/// [`destroy_retired_pools`](crate::destroy_retired_pools).
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
///   is and forgets this crate's changes to it (with a `tracing` warning), keeping their pools
///   alive until [`reset_current_pool`] (other code may have saved one to restore later);
/// - a pool that another library had made current before the first change is restored only
///   if it is the route's default pool; otherwise the default pool is restored (with a
///   warning), because this crate cannot know whether that library has destroyed it since.
///
/// A pool created for another route is refused with [`Error::PoolRouteMismatch`] before the
/// driver is called.
///
/// A pool this crate made ([`MemPool`](crate::MemPool)) whose release threshold is 0 (the
/// driver's default) has it raised to `u64::MAX` first, as CuPy's `MemoryAsyncPool` and
/// cuda.core do for the pool they serve from; a pool it does not own (the driver's default pool,
/// one from [`PoolRef::from_raw`](crate::PoolRef::from_raw)) is never changed. With 0 the driver
/// gives the pool's memory back at every synchronisation and maps it again on the next
/// allocation, and the libraries the route serves (PyTorch's `cudaMallocAsync` backend among them)
/// only raise the threshold of pools they configure themselves. The pool's `max_size` still caps
/// it, and [`Pool::trim_to`](crate::Pool::trim_to) still gives memory back. A threshold set to
/// anything else is left as it is; to route a pool that gives memory back at every
/// synchronisation, set its threshold to 0 after routing it.
///
/// # Errors
/// [`Error::PoolRouteMismatch`], an invalid route, or the driver's refusal as
/// [`Error::RouteRefused`] (or of the threshold's read or write); the route is unchanged then.
///
/// See [cuMemSetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub fn set_current_pool(route: Route, pool: &Pool) -> Result<RouteGuard> {
    if let Some(served) = pool.route() {
        if served != route {
            return Err(Error::PoolRouteMismatch { pool: served, route });
        }
    }
    let valid = route.checked()?;
    let mut map = routed();
    let current = current_raw(valid)?;
    // Everything that can fail is asked before the route changes, so a refusal changes nothing.
    let base = base_of(valid, current)?;
    // Only a pool this crate made: the driver's default pool, and a pool another library made,
    // are theirs to configure (the default pool serves every `cudaMallocAsync` in the process).
    let raised = pool.is_owned() && !pool.is_imported() && pool.release_threshold()? == 0;
    if raised {
        pool.set_release_threshold(u64::MAX)?;
    }
    // Before the route shows it: from then on a thread may read it, so it is never destroyed.
    crate::bare_pools::retirement::note_current(pool.as_raw());
    if let Err(error) = set_raw(valid, pool.as_raw()) {
        // A refused change leaves the pool as it found it too.
        if raised {
            if let Err(reset) = pool.set_release_threshold(0) {
                tracing::warn!(%reset, "putting back the release threshold of a pool whose routing was refused failed");
            }
        }
        return Err(error);
    }
    let stack = map.entry(route).or_insert_with(|| RouteStack::new(base));
    if stack.expected() != current {
        // Changes made outside this crate since it last looked end this crate's changes.
        tracing::warn!(%route, expected = ?stack.expected(), found = ?current, "the current pool was changed outside cumempool; its earlier changes to this route are forgotten");
        stack.detach(base);
    }
    let guard = NEXT_GUARD.fetch_add(1, Relaxed);
    stack.entries.push(Entry { guard, pool: pool.clone().with_route(Some(route)) });
    drop(map);
    tracing::info!(%route, pool = ?pool.as_raw(), previous = ?current, "current pool changed (process-wide)");
    Ok(RouteGuard { route: valid, id: guard })
}

/// Makes `route`'s default pool current again, for the whole process, and forgets every change
/// made through this crate to it (their guards do nothing any more), releasing the pools it held.
///
/// # Errors
/// An invalid route, or the driver's refusal; the route is unchanged then.
pub fn reset_current_pool(route: Route) -> Result<()> {
    let valid = route.checked()?;
    let default = default_raw(valid)?;
    let mut map = routed();
    set_raw(valid, default)?;
    let released = map.remove(&route);
    drop(map);
    // Pools kept alive only by the route are released (retired) here, after the route moved on.
    drop(released);
    tracing::info!(%route, "current pool reset to the default (process-wide)");
    Ok(())
}

/// What `current`, the pool a route shows, is as the base of this crate's changes.
fn base_of(route: CheckedRoute, current: sys::CUmemoryPool) -> Result<Base> {
    Ok(if current == default_raw(route)? {
        Base::Default(DriverHandle(current))
    } else {
        Base::Foreign(DriverHandle(current))
    })
}

/// Removes one change from its route's stack (see [`set_current_pool`]) when dropped.
#[derive(Debug)]
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub struct RouteGuard {
    /// Checked when the change was made: undoing it checks nothing again.
    route: CheckedRoute,
    /// Its entry's id; [`KEPT`] once it has let go.
    id: u64,
}

impl RouteGuard {
    /// The route whose current pool was changed.
    pub fn route(&self) -> Route {
        self.route.route()
    }

    /// Makes the change last: it stays on the route's stack (keeping its pool alive) until
    /// [`reset_current_pool`] or a change outside this crate.
    pub fn keep(mut self) {
        let mut map = routed();
        if let Some(entry) =
            map.get_mut(&self.route.route()).and_then(|s| s.entries.iter_mut().find(|e| e.guard == self.id))
        {
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
        let Some(stack) = map.get_mut(&self.route.route()) else {
            return Ok(()); // reset, or detached by a change outside this crate
        };
        let Some(index) = stack.entries.iter().position(|e| e.guard == id) else {
            return Ok(());
        };
        let current = current_raw(self.route)?;
        if current != stack.expected() {
            tracing::warn!(route = %self.route.route(), found = ?current, "the current pool was changed outside cumempool; leaving it as it is");
            let base = base_of(self.route, current)?;
            stack.detach(base);
            return Ok(());
        }
        // What the route shows once this change is gone: the newest other change, else the base.
        let newest_other = stack.entries.iter().enumerate().rev().find(|(i, _)| *i != index);
        let wanted = match (newest_other, stack.base) {
            (Some((_, entry)), _) => entry.pool.as_raw(),
            (None, Base::Default(raw)) => raw.0,
            (None, Base::Foreign(raw)) => {
                tracing::warn!(route = %self.route.route(), foreign = ?raw.0, "restoring the default pool, not the pool another library had made current: it may have been destroyed since");
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
        if stack.entries.is_empty() && stack.forgotten.is_empty() {
            map.remove(&self.route.route());
        }
        drop(map);
        // A pool that was only kept alive by its route is released (retired) here, after the route moved on.
        drop(removed);
        tracing::info!(route = %self.route.route(), "a route change was undone (process-wide)");
        Ok(())
    }
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        if let Err(error) = self.remove() {
            tracing::warn!(%error, route = %self.route.route(), "undoing a route change failed; the route keeps its pool");
        }
    }
}
