//! The adaptor at the bottom of every resource stack the bindings build, right above the pool:
//! the only place a stack reaches the driver, so the only place that needs to release the GIL
//! and to put the caller's context back.

use crate::current_context::ContextRestored;
use crate::gil::GilReleased;

/// A pool's resource whose driver calls release the GIL when a binding marked the thread
/// ([`GilReleased`], outermost: the context is restored before the GIL is taken back) and put
/// back the caller's context after a call on a legacy stream ([`ContextRestored`], inside).
/// Both are needed at the bottom of every stack because only there does a call reach the
/// driver: a cache hit, a limit check or a count above it runs with the GIL held and touches no
/// context, while every path that reaches the driver through a resource (an allocation, a cache
/// giving blocks back on release, collection or to make room for another stream's allocation,
/// the PyTorch plug-in's C functions) must neither hold the GIL across a driver call that may
/// wait nor leave another device's context current for the Python code around it.
pub type DriverLink<R> = GilReleased<ContextRestored<R>>;

/// `resource` (a pool's) at the bottom of a stack: see [`DriverLink`].
#[inline]
pub fn driver_link<R>(resource: R) -> DriverLink<R> {
    GilReleased(ContextRestored(resource))
}
