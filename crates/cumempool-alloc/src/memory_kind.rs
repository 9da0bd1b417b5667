//! What a resource's memory is accessible from, known from its type.

use cumempool::{AllocationType, Route};

/// A kind of memory: which processors may touch it. Implemented by the marker types below.
pub trait MemoryKind: Send + Sync + 'static {
    /// Whether devices may read and write it.
    const DEVICE_ACCESSIBLE: bool;
    /// Whether the host may read and write it (after its stream has synchronised).
    const HOST_ACCESSIBLE: bool;
    /// A name for messages.
    const NAME: &'static str;
    /// Whether a pool of `route` holds this kind of memory.
    fn admits(route: Route) -> bool;
}

/// Memory the host may touch: [`HostMemory`] and [`ManagedMemory`].
pub trait HostAccessible: MemoryKind {}

/// Memory devices may touch: all three kinds.
pub trait DeviceAccessible: MemoryKind {}

/// Pinned device memory: devices only.
#[derive(Debug)]
pub enum DeviceMemory {}

/// Pinned host memory (host or host NUMA node): the host, and devices through the bus.
#[derive(Debug)]
pub enum HostMemory {}

/// Managed memory: migrates between host and devices.
#[derive(Debug)]
pub enum ManagedMemory {}

impl MemoryKind for DeviceMemory {
    const DEVICE_ACCESSIBLE: bool = true;
    const HOST_ACCESSIBLE: bool = false;
    const NAME: &'static str = "device";
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Pinned && route.location.device().is_some()
    }
}

impl MemoryKind for HostMemory {
    const DEVICE_ACCESSIBLE: bool = true;
    const HOST_ACCESSIBLE: bool = true;
    const NAME: &'static str = "pinned host";
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Pinned && route.location.is_host()
    }
}

impl MemoryKind for ManagedMemory {
    const DEVICE_ACCESSIBLE: bool = true;
    const HOST_ACCESSIBLE: bool = true;
    const NAME: &'static str = "managed";
    fn admits(route: Route) -> bool {
        route.allocation_type == AllocationType::Managed
    }
}

impl DeviceAccessible for DeviceMemory {}
impl DeviceAccessible for HostMemory {}
impl DeviceAccessible for ManagedMemory {}
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
        const { assert!(!DeviceMemory::HOST_ACCESSIBLE && HostMemory::HOST_ACCESSIBLE && ManagedMemory::HOST_ACCESSIBLE) };
    }
}
