//! Location-keyed routing (CUDA 13.0): each route has a default pool, which the driver owns,
//! and a current pool, which `cuMemAllocAsync`-style allocations at that route use.
//!
//! Changing a route's current pool is **process-global**: every thread and every library in
//! the process that allocates through that route is affected. [`set_current_pool`] therefore
//! returns a guard that puts the previous pool back, and a pool this crate routed is kept alive
//! for as long as it is current.

use crate::driver::api;
use crate::error::{Error, Result};
use crate::location::Route;
use crate::pool::{Pool, PoolRef};
use cumempool_sys as sys;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Pools this crate made current, by route: holding them keeps them alive while they are current.
static ROUTED: Mutex<BTreeMap<Route, Pool>> = Mutex::new(BTreeMap::new());

fn routed() -> MutexGuard<'static, BTreeMap<Route, Pool>> {
    // The map stays consistent even if a holder panicked: every update is a single insert/remove.
    ROUTED.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cold]
fn refused(route: Route, code: sys::CUresult, during: &'static str) -> Error {
    let (name, description) = crate::error::describe(code);
    Error::RouteRefused { route, code: code.0, name, description, during }
}

/// The driver-owned default pool of `route`. Never changes and is never destroyed.
///
/// Looking it up changes nothing: unlike some other libraries, no attribute (such as the
/// release threshold) is raised behind the caller's back.
/// See [cuMemGetDefaultMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn default_pool(route: Route) -> Result<PoolRef> {
    let (mut location, allocation_type) = route.to_raw()?;
    let f = api()?.cuMemGetDefaultMemPool()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    let code = unsafe { f(&mut raw, &mut location, allocation_type) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(refused(route, code, "cuMemGetDefaultMemPool"));
    }
    Ok(PoolRef::new(Pool::borrowed(raw, Some(route))))
}

fn current_raw(route: Route) -> Result<sys::CUmemoryPool> {
    let (mut location, allocation_type) = route.to_raw()?;
    let f = api()?.cuMemGetMemPool()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid out-pointer and location.
    let code = unsafe { f(&mut raw, &mut location, allocation_type) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(refused(route, code, "cuMemGetMemPool"));
    }
    Ok(raw)
}

fn set_raw(route: Route, pool: sys::CUmemoryPool) -> Result<()> {
    let (mut location, allocation_type) = route.to_raw()?;
    let f = api()?.cuMemSetMemPool()?;
    // SAFETY: valid location and a live pool.
    let code = unsafe { f(&mut location, allocation_type, pool) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(refused(route, code, "cuMemSetMemPool"));
    }
    Ok(())
}

/// The current pool of `route`: the last one set for it, else its default pool.
///
/// A pool that this crate made current comes back keeping it alive.
/// See [cuMemGetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
pub fn current_pool(route: Route) -> Result<PoolRef> {
    let map = routed();
    let raw = current_raw(route)?;
    let pool = match map.get(&route) {
        Some(pool) if pool.as_raw() == raw => pool.clone(),
        _ => Pool::borrowed(raw, Some(route)),
    };
    Ok(PoolRef::new(pool))
}

/// Whether `route`'s current pool is its default pool.
pub fn is_default(route: Route) -> Result<bool> {
    Ok(current_raw(route)? == default_pool(route)?.as_raw())
}

/// Makes `pool` the current pool of `route`, **for the whole process**.
///
/// Every thread and library that allocates through this route from now on gets memory from
/// `pool`. The returned guard puts the previous pool back when dropped; call
/// [`RouteGuard::keep`] to make the change last. While `pool` is current it is kept alive,
/// even if every other handle to it is dropped.
///
/// A pool created for another route is refused with [`Error::PoolRouteMismatch`] before the
/// driver is called.
/// See [cuMemSetMemPool](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub fn set_current_pool(route: Route, pool: &Pool) -> Result<RouteGuard> {
    if let Some(served) = pool.route() {
        if served != route {
            return Err(Error::PoolRouteMismatch { pool: served, route });
        }
    }
    let mut map = routed();
    let previous_raw = current_raw(route)?;
    set_raw(route, pool.as_raw())?;
    let previous = match map.insert(route, pool.clone().with_route(Some(route))) {
        Some(kept) if kept.as_raw() == previous_raw => kept,
        _ => Pool::borrowed(previous_raw, Some(route)),
    };
    drop(map);
    tracing::info!(%route, pool = ?pool.as_raw(), previous = ?previous_raw, "current pool changed (process-wide)");
    Ok(RouteGuard { route, previous: Some(previous) })
}

/// Makes `route`'s default pool current again, for the whole process.
pub fn reset_current_pool(route: Route) -> Result<()> {
    let default = default_pool(route)?;
    let mut map = routed();
    set_raw(route, default.as_raw())?;
    let released = map.remove(&route);
    drop(map);
    drop(released);
    tracing::info!(%route, "current pool reset to the default (process-wide)");
    Ok(())
}

/// Puts a route's previous current pool back when dropped (see [`set_current_pool`]).
#[derive(Debug)]
#[must_use = "dropping the guard at once puts the previous pool back; call .keep() to make the change last"]
pub struct RouteGuard {
    route: Route,
    previous: Option<Pool>,
}

impl RouteGuard {
    /// The route whose current pool was changed.
    pub fn route(&self) -> Route {
        self.route
    }

    /// Makes the change last: the route keeps the new pool (and keeps it alive) until changed again.
    pub fn keep(mut self) {
        self.previous = None;
    }

    /// Puts the previous pool back now and reports the driver's answer.
    pub fn restore(mut self) -> Result<()> {
        self.put_back()
    }

    fn put_back(&mut self) -> Result<()> {
        let Some(previous) = self.previous.take() else {
            return Ok(());
        };
        let mut map = routed();
        set_raw(self.route, previous.as_raw())?;
        let released = if previous.is_owned() { map.insert(self.route, previous) } else { map.remove(&self.route) };
        drop(map);
        // A pool that was only kept alive by its route may be destroyed here, after the route moved on.
        drop(released);
        tracing::info!(route = %self.route, "current pool restored (process-wide)");
        Ok(())
    }
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        if let Err(error) = self.put_back() {
            tracing::warn!(%error, route = %self.route, "restoring the previous current pool failed");
        }
    }
}
