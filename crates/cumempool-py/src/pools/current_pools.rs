//! The process-wide routing of pools as Python sees it: each route's default and current pool,
//! and the guards that change the current one. Every rule (the per-route stack of changes,
//! guards ending in any order) is `cumempool`'s; invariant here: a `RouteGuard` undoes its
//! change at most once, by `restore()`, its `with` block's end or its collection, and not at
//! all after `keep()`.

use crate::errors::Outcome;
use crate::pools::MemPool;
use crate::values::route_values::Route;
use pyo3::prelude::*;
use std::sync::Mutex;

/// The driver-owned default pool of `route` (never destroyed).
#[pyfunction]
pub fn default_pool(py: Python<'_>, route: Route) -> Outcome<MemPool> {
    let pool = crate::sync::gil::detach(py, || cumempool::default_pool(route.0))?;
    Ok(MemPool::wrap(cumempool::Pool::clone(&pool)))
}

/// The pool `route` draws from now, kept alive by the returned object where cumempool routed
/// it. A pool made current by other code raises ForeignCurrentPoolError: use
/// `current_pool_handle`.
#[pyfunction]
pub fn current_pool(py: Python<'_>, route: Route) -> Outcome<MemPool> {
    Ok(MemPool::wrap(crate::sync::gil::detach(py, || cumempool::current_pool(route.0))?))
}

/// The raw handle (`CUmemoryPool` as an int) of the pool `route` draws from now.
#[pyfunction]
pub fn current_pool_handle(py: Python<'_>, route: Route) -> Outcome<usize> {
    Ok(crate::sync::gil::detach(py, || cumempool::current_pool_handle(route.0).map(|h| h as usize))?)
}

/// Whether `route` draws from its default pool now.
#[pyfunction]
pub fn is_default(py: Python<'_>, route: Route) -> Outcome<bool> {
    Ok(crate::sync::gil::detach(py, || cumempool::is_default(route.0))?)
}

/// Makes the default pool current again and forgets every change made through cumempool.
#[pyfunction]
pub fn reset_current_pool(py: Python<'_>, route: Route) -> Outcome<()> {
    Ok(crate::sync::gil::detach(py, || cumempool::reset_current_pool(route.0))?)
}

/// Makes `pool` the current pool of `route` for the whole process until the returned guard
/// is restored: by leaving its `with` block, by `.restore()`, or when it is collected. `.keep()`
/// makes the change last until `reset_current_pool`. Guards may end in any order, on any
/// thread; a change made by other code in between is respected.
///
/// Example: `with set_current_pool(Route.device(0), pool): ...`.
#[pyfunction]
pub fn set_current_pool(py: Python<'_>, route: Route, pool: PyRef<'_, MemPool>) -> Outcome<RouteGuard> {
    let pool = pool.pool()?;
    let guard = crate::sync::gil::detach(py, || cumempool::set_current_pool(route.0, &pool))?;
    Ok(RouteGuard { route: route.0, guard: Mutex::new(Some(guard)) })
}

/// One change of a route's current pool (see `set_current_pool`).
#[pyclass(frozen, module = "cumempool")]
pub struct RouteGuard {
    route: cumempool::Route,
    guard: Mutex<Option<cumempool::RouteGuard>>,
}

impl RouteGuard {
    fn take(&self) -> Option<cumempool::RouteGuard> {
        crate::sync::locks::lock(&self.guard).take()
    }
}

#[pymethods]
impl RouteGuard {
    /// The route whose current pool was changed.
    #[getter]
    fn route(&self) -> Route {
        Route(self.route)
    }

    /// Whether the change is still this guard's to undo.
    #[getter]
    fn active(&self) -> bool {
        crate::sync::locks::lock(&self.guard).is_some()
    }

    /// Undoes this change now; a second call does nothing. Where the driver refuses, raises,
    /// and the change stays as if kept.
    fn restore(&self, py: Python<'_>) -> Outcome<()> {
        match self.take() {
            Some(guard) => Ok(crate::sync::gil::detach(py, || guard.restore())?),
            None => Ok(()),
        }
    }

    /// Makes the change last until `reset_current_pool` (the guard lets go of it).
    fn keep(&self) {
        if let Some(guard) = self.take() {
            guard.keep();
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> Outcome<bool> {
        self.restore(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let active = if self.active() { "True" } else { "False" };
        format!("<cumempool.RouteGuard route={} active={active}>", crate::values::route_values::route_repr(self.route))
    }
}
