//! A route's check against this machine (the devices and locality domains it has), and the
//! driver's form of a checked route. The route itself is a value of `route`, below the error
//! type; the check asks the driver, so it lives above both.
//!
//! A route is checked once per public call ([`Route::checked`]); what is passed down from
//! there is the [`CheckedRoute`], so no driver call below re-checks it.

use crate::devices::device::Device;
use crate::error::Result;
use crate::values::location::Location;
use crate::values::route::Route;
use cumempool_sys as sys;
use std::fmt;

impl Route {
    /// Refuses, before any driver call, a route that cannot exist: `Unspecified` with pinned
    /// memory, `Invisible` or `Unknown` as an input, negative ids ([`Route::check_shape`]),
    /// device ordinals this machine lacks, and locality domains the device lacks.
    ///
    /// # Errors
    /// [`Error::InvalidRoute`](crate::Error::InvalidRoute),
    /// [`Error::InvalidDevice`](crate::Error::InvalidDevice) or `Error::InvalidLocalityDomain`,
    /// saying what would work; `Error::DriverTooOld` for a locality domain on a driver older
    /// than 13.4.
    pub fn validate(&self) -> Result<()> {
        self.checked().map(drop)
    }

    /// [`Route::validate`], keeping the driver's form of the route for the calls that follow.
    pub(crate) fn checked(self) -> Result<CheckedRoute> {
        self.check_shape()?;
        match self.location {
            Location::Device(ordinal) => Device::check_ordinal(ordinal)?,
            #[cfg(feature = "cuda-13040")]
            Location::DeviceLocalityDomain { device, domain } => {
                Device::get(device)?.locality_domain(domain)?;
            }
            _ => {}
        }
        Ok(CheckedRoute {
            route: self,
            location: self.location.to_raw()?,
            allocation_type: self.allocation_type.to_raw(),
        })
    }

    /// The driver's form of the location and the allocation type, after [`Route::validate`].
    pub(crate) fn to_raw(self) -> Result<(sys::CUmemLocation, sys::CUmemAllocationType)> {
        Ok(self.checked()?.to_raw())
    }
}

/// A route [`Route::checked`] accepted, with its driver form: what the driver calls of one
/// public call take, so the route is checked once, not once per call.
#[derive(Clone, Copy)]
pub(crate) struct CheckedRoute {
    route: Route,
    location: sys::CUmemLocation,
    allocation_type: sys::CUmemAllocationType,
}

impl CheckedRoute {
    /// The route as asked for.
    pub(crate) fn route(&self) -> Route {
        self.route
    }

    /// The driver's form, by value: the driver's routing calls take a mutable location.
    pub(crate) fn to_raw(self) -> (sys::CUmemLocation, sys::CUmemAllocationType) {
        (self.location, self.allocation_type)
    }
}

impl fmt::Debug for CheckedRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CheckedRoute").field(&self.route).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_route_carries_the_driver_form_of_its_route() {
        let valid = Route::managed(Location::Unspecified).checked().expect("no device to check");
        assert_eq!(valid.route(), Route::managed(Location::Unspecified));
        let (location, allocation_type) = valid.to_raw();
        assert_eq!(location.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_NONE);
        assert_eq!(allocation_type, sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED);
    }

    #[test]
    fn what_the_driver_only_reports_is_no_route_to_ask_for() {
        let unknown = Location::Unknown { type_: 0x77, id: 0x0102 };
        assert!(Route::new(unknown, crate::AllocationType::Pinned).validate().is_err());
    }
}
