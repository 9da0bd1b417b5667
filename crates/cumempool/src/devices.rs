//! Devices, their primary contexts, and a route's check against this machine's devices.

pub(crate) mod checked_route;
pub(crate) mod context;
pub(crate) mod device;
