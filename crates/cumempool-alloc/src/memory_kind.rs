//! What a resource's memory is accessible from, known from its type.

use cumempool::{AllocationType, Route};

mod sealed {
    pub trait Sealed {}
}

/// A kind of memory: which processors may touch it. Implemented by the three marker types
/// below and sealed: safe code relies on a kind's word (a host-accessible kind's memory is
/// given to containers as host memory), so no other type may claim one.
pub trait MemoryKind: sealed::Sealed + Send + Sync + 'static {
    /// A name for messages.
    const NAME: &'static str;
    /// Whether the memory migrates between host and devices (managed memory), which the host
    /// may touch only where devices support concurrent managed access.
    const MIGRATES: bool;
    /// Whether a pool of `route` holds this kind of memory.
    fn admits(route: Route) -> bool;
}

/// Memory the host may touch once its stream has finished: [`HostMemory`] and
/// [`ManagedMemory`].
pub trait HostAccessible: MemoryKind {}

/// Pinned device memory: devices only.
#[derive(Debug)]
pub enum DeviceMemory {}

/// Pinned host memory (host or host NUMA node): the host, and devices through the bus.
#[derive(Debug)]
pub enum HostMemory {}

/// Managed memory: migrates between host and devices.
#[derive(Debug)]
pub enum ManagedMemory {}

impl sealed::Sealed for DeviceMemory {}
impl sealed::Sealed for HostMemory {}
impl sealed::Sealed for ManagedMemory {}

impl MemoryKind for DeviceMemory {
    const NAME: &'static str = "device";
    const MIGRATES: bool = false;
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Pinned && route.location.device().is_some()
    }
}

impl MemoryKind for HostMemory {
    const NAME: &'static str = "pinned host";
    const MIGRATES: bool = false;
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Pinned && route.location.is_host()
    }
}

impl MemoryKind for ManagedMemory {
    const NAME: &'static str = "managed";
    const MIGRATES: bool = true;
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Managed
    }
}

impl HostAccessible for HostMemory {}
impl HostAccessible for ManagedMemory {}

#[cfg(test)]
mod tests {
    use super::*;
    use cumempool::Location;

    #[test]
    fn kinds_admit_exactly_their_routes() {
        assert!(DeviceMemory::admits(Route::device(0)) && !DeviceMemory::admits(Route::host()));
        assert!(HostMemory::admits(Route::host()) && HostMemory::admits(Route::host_numa(1)));
        assert!(!HostMemory::admits(Route::managed(Location::Host)));
        assert!(
            ManagedMemory::admits(Route::managed(Location::Unspecified)) && !ManagedMemory::admits(Route::device(0))
        );
        const { assert!(ManagedMemory::MIGRATES && !HostMemory::MIGRATES && !DeviceMemory::MIGRATES) };
    }
}
