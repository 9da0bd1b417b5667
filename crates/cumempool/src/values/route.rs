//! What a route is: a (location, allocation type) pair, the key under which CUDA 13 keeps a
//! default pool and a current pool, and which pairs can exist on any machine. A value: nothing
//! here calls the driver, so the crate's error can name a route. The checks against this
//! machine are `devices::checked_route`'s.

use crate::values::location::{AllocationType, Location};
use std::fmt;

/// A (location, allocation type) pair that cannot name a pool, with the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{route} is not a valid route: {reason}")]
pub struct InvalidRoute {
    /// The route asked for.
    pub route: Route,
    /// Why it cannot exist, and what would.
    pub reason: &'static str,
}

/// A (location, allocation type) pair: the key under which CUDA 13 keeps a default pool and a
/// current pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Route {
    /// Where the memory lives.
    pub location: Location,
    /// What kind of memory it is.
    pub allocation_type: AllocationType,
}

impl Route {
    /// Any route; [`Route::validate`] says whether it can exist.
    pub const fn new(location: Location, allocation_type: AllocationType) -> Self {
        Self { location, allocation_type }
    }

    /// Pinned memory on a device: the classic device pool.
    pub const fn device(ordinal: i32) -> Self {
        Self::new(Location::Device(ordinal), AllocationType::Pinned)
    }

    /// Pinned host memory.
    pub const fn host() -> Self {
        Self::new(Location::Host, AllocationType::Pinned)
    }

    /// Pinned host memory on one NUMA node.
    pub const fn host_numa(node: i32) -> Self {
        Self::new(Location::HostNuma(node), AllocationType::Pinned)
    }

    /// Pinned memory in one locality domain of a device (CUDA 13.4). Any values; the device and
    /// the domain are checked against the machine by [`Route::validate`], or up front by
    /// [`Device::locality_domain`](crate::Device::locality_domain).
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub const fn locality_domain(device: i32, domain: u8) -> Self {
        Self::new(Location::DeviceLocalityDomain { device, domain }, AllocationType::Pinned)
    }

    /// Managed memory preferring `location` (a device, the host, or [`Location::Unspecified`]).
    pub const fn managed(location: Location) -> Self {
        Self::new(location, AllocationType::Managed)
    }

    /// Whether the host may touch this route's memory (after its stream is synchronised).
    pub fn is_host_accessible(&self) -> bool {
        self.allocation_type == AllocationType::Managed || self.location.is_host()
    }

    /// Refuses a route that cannot exist on any machine: `Unspecified` with pinned memory,
    /// `Invisible` or `Unknown` as an input, a locality domain with managed memory, and ids out
    /// of range. [`Route::validate`] adds the check against this machine's devices.
    ///
    /// # Errors
    /// [`InvalidRoute`] naming what is wrong and what would work.
    pub fn check_shape(&self) -> Result<(), InvalidRoute> {
        let invalid = |reason| Err(InvalidRoute { route: *self, reason });
        match (self.location, self.allocation_type) {
            (Location::Unspecified, AllocationType::Pinned) => {
                invalid("an unspecified location serves managed memory only; name a device, the host or a host NUMA node for pinned memory")
            }
            #[cfg(feature = "cuda-13020")]
            (Location::Invisible, _) => {
                invalid("Invisible is only ever reported by the driver, for imported pools; it cannot be asked for")
            }
            (Location::Unknown { .. }, _) => {
                invalid("an unknown location type is only ever read back from a newer driver; it cannot be asked for")
            }
            #[cfg(feature = "cuda-13040")]
            (Location::DeviceLocalityDomain { .. }, AllocationType::Managed) => {
                invalid("managed memory cannot be placed in a locality domain (cuda.h); use Route::managed(Location::Device(n))")
            }
            #[cfg(feature = "cuda-13040")]
            (location @ Location::DeviceLocalityDomain { .. }, _) => match location.to_raw_parts() {
                Ok(_) => Ok(()),
                Err(refusal) => invalid(refusal.reason),
            },
            (Location::Device(ordinal), _) if ordinal < 0 => invalid("device ordinals are 0 or more"),
            (Location::HostNuma(node), _) if node < 0 => invalid("host NUMA node ids are 0 or more"),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.location, self.allocation_type)
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_routes_are_refused_with_what_would_work() {
        let text = Route::new(Location::Unspecified, AllocationType::Pinned)
            .check_shape()
            .expect_err("NONE is managed-only")
            .to_string();
        assert!(text.contains("managed memory only"), "{text}");
        assert!(Route::host_numa(-1).check_shape().is_err());
        assert!(Route::managed(Location::Unspecified).check_shape().is_ok());
        assert!(Route::host().check_shape().is_ok());
    }

    #[cfg(feature = "cuda-13040")]
    #[test]
    fn locality_domains_are_pinned_only_and_their_device_fits_a_byte() {
        assert!(Route::locality_domain(0, 1).check_shape().is_ok());
        let managed = Route::managed(Location::DeviceLocalityDomain { device: 0, domain: 0 }).check_shape();
        assert!(managed.expect_err("managed pools cannot use domains").to_string().contains("managed memory cannot"));
        let too_big = Route::locality_domain(256, 0).check_shape().expect_err("deviceId is an unsigned char");
        assert!(too_big.to_string().contains("0 to 255"), "{too_big}");
        assert!(Location::DeviceLocalityDomain { device: -1, domain: 0 }.to_raw_parts().is_err());
    }

    #[test]
    fn host_access_follows_location_and_type() {
        assert!(!Route::device(0).is_host_accessible());
        assert!(Route::host().is_host_accessible());
        assert!(Route::host_numa(0).is_host_accessible());
        assert!(Route::managed(Location::Device(0)).is_host_accessible());
        assert_eq!(Route::managed(Location::Unspecified).to_string(), "(unspecified location, managed)");
    }

    #[test]
    fn what_the_driver_only_reports_is_no_route_to_ask_for() {
        let unknown = Location::Unknown { type_: 0x77, id: 0x0102 };
        assert!(Route::new(unknown, AllocationType::Pinned).check_shape().is_err());
        #[cfg(feature = "cuda-13020")]
        assert!(Route::managed(Location::Invisible).check_shape().is_err());
    }
}
