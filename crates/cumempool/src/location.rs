//! Where pool memory lives, what kind it is, and the routes they form together.

use crate::unknown_value::UnknownValue;
use cumempool_sys as sys;
use std::fmt;

/// A location that cannot be given to the driver, with the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{location} cannot be given to the driver: {reason}")]
pub struct InvalidLocation {
    /// The location.
    pub location: Location,
    /// Why, and what would be right.
    pub reason: &'static str,
}

/// A (location, allocation type) pair that cannot name a pool, with the reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{route} is not a valid route: {reason}")]
pub struct InvalidRoute {
    /// The route asked for.
    pub route: Route,
    /// Why it cannot exist, and what would.
    pub reason: &'static str,
}

/// Where a pool's memory resides: the safe form of `CUmemLocation`.
///
/// `Unspecified` is the driver's `CU_MEM_LOCATION_TYPE_NONE`: no preferred location, which only
/// managed pools accept. `Invisible` (CUDA 13.2) describes an imported pool whose device this
/// process cannot see; the driver only ever reports it, so it is refused as an input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Location {
    /// A device, by ordinal.
    Device(i32),
    /// Host memory, on no particular NUMA node.
    Host,
    /// Host memory on one NUMA node, by id.
    HostNuma(i32),
    /// Host memory on the NUMA node of the calling thread.
    HostNumaCurrent,
    /// No preferred location (`CU_MEM_LOCATION_TYPE_NONE`): managed pools only.
    Unspecified,
    /// A location this process cannot see, reported for some imported pools (CUDA 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    Invisible,
}

impl Location {
    /// The driver's form, for a location that may be passed to the driver.
    ///
    /// Refuses `Invisible`, and negative device ordinals or NUMA ids, before the driver sees them.
    ///
    /// # Errors
    /// [`InvalidLocation`] for the refusals above.
    pub fn to_raw(self) -> Result<sys::CUmemLocation, InvalidLocation> {
        use sys::CUmemLocationType as T;
        let (type_, id) = match self {
            Self::Device(ordinal) if ordinal < 0 => {
                return Err(InvalidLocation { location: self, reason: "device ordinals start at 0" })
            }
            Self::HostNuma(node) if node < 0 => {
                return Err(InvalidLocation { location: self, reason: "NUMA nodes are numbered from 0" })
            }
            Self::Device(ordinal) => (T::CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
            Self::Host => (T::CU_MEM_LOCATION_TYPE_HOST, 0),
            Self::HostNuma(node) => (T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
            Self::HostNumaCurrent => (T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, 0),
            Self::Unspecified => (T::CU_MEM_LOCATION_TYPE_NONE, 0),
            #[cfg(feature = "cuda-13020")]
            Self::Invisible => {
                return Err(InvalidLocation {
                    location: self,
                    reason: "the driver only reports Invisible for imported pools; it is never an input",
                })
            }
        };
        Ok(raw_location(type_, id))
    }

    /// Whether the host can read and write memory at this location.
    pub fn is_host(self) -> bool {
        matches!(self, Self::Host | Self::HostNuma(_) | Self::HostNumaCurrent)
    }

    /// The device ordinal, for a device location.
    pub fn device(self) -> Option<i32> {
        match self {
            Self::Device(ordinal) => Some(ordinal),
            _ => None,
        }
    }
}

impl TryFrom<sys::CUmemLocation> for Location {
    type Error = UnknownValue;

    /// Reads a location the driver wrote; values this crate does not know are an error, never UB.
    fn try_from(raw: sys::CUmemLocation) -> Result<Self, UnknownValue> {
        use sys::CUmemLocationType as T;
        Ok(match raw.type_ {
            T::CU_MEM_LOCATION_TYPE_DEVICE => Self::Device(raw_location_id(&raw)),
            T::CU_MEM_LOCATION_TYPE_HOST => Self::Host,
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA => Self::HostNuma(raw_location_id(&raw)),
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Self::HostNumaCurrent,
            T::CU_MEM_LOCATION_TYPE_NONE => Self::Unspecified,
            #[cfg(feature = "cuda-13020")]
            T::CU_MEM_LOCATION_TYPE_INVISIBLE => Self::Invisible,
            other => return Err(UnknownValue { type_name: "CUmemLocationType", value: other.0.into() }),
        })
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Device(ordinal) => write!(f, "device {ordinal}"),
            Self::Host => f.write_str("host"),
            Self::HostNuma(node) => write!(f, "host NUMA node {node}"),
            Self::HostNumaCurrent => f.write_str("host NUMA node of the calling thread"),
            Self::Unspecified => f.write_str("unspecified location"),
            #[cfg(feature = "cuda-13020")]
            Self::Invisible => f.write_str("invisible location"),
        }
    }
}

/// Raw `CUmemLocationType` values deliberately left without a [`Location`], with the reason.
pub const UNMAPPED_LOCATION_TYPES: &[(u32, &str)] =
    &[(0x7FFF_FFFF, "CU_MEM_LOCATION_TYPE_MAX only forces the C enum to 32 bits; no location has it")];

/// Raw `CUmemAllocationType` values deliberately left without an [`AllocationType`], with the reason.
pub const UNMAPPED_ALLOCATION_TYPES: &[(u32, &str)] = &[
    (0, "CU_MEM_ALLOCATION_TYPE_INVALID is the unset value; no pool has it"),
    (0x7FFF_FFFF, "CU_MEM_ALLOCATION_TYPE_MAX only forces the C enum to 32 bits"),
];

/// The driver's `CUmemLocation` from its parts, whatever they are: for handing the driver inputs
/// [`Location`] refuses (probes of what the driver itself answers). CUDA 13.2's header moved
/// `id` into a one-member anonymous union (same layout); 13.0's has it as a plain field.
#[cfg(feature = "cuda-13020")]
pub fn raw_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_, __bindgen_anon_1: sys::CUmemLocation_st__bindgen_ty_1 { id } }
}

/// The id of a driver `CUmemLocation`, under either header's layout.
#[cfg(feature = "cuda-13020")]
pub fn raw_location_id(raw: &sys::CUmemLocation) -> i32 {
    // SAFETY: the union's only member is `id`, so whatever initialised it initialised `id`.
    unsafe { raw.__bindgen_anon_1.id }
}

/// The driver's `CUmemLocation` from its parts, whatever they are: for handing the driver inputs
/// [`Location`] refuses (probes of what the driver itself answers).
#[cfg(not(feature = "cuda-13020"))]
pub fn raw_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_, id }
}

/// The id of a driver `CUmemLocation`, under either header's layout.
#[cfg(not(feature = "cuda-13020"))]
pub fn raw_location_id(raw: &sys::CUmemLocation) -> i32 {
    raw.id
}

/// The kind of memory a pool hands out: the safe form of `CUmemAllocationType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum AllocationType {
    /// Memory that stays where it was allocated.
    Pinned,
    /// Managed (unified) memory, which migrates between host and devices.
    Managed,
}

impl AllocationType {
    /// The driver's form.
    pub fn to_raw(self) -> sys::CUmemAllocationType {
        match self {
            Self::Pinned => sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            Self::Managed => sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED,
        }
    }
}

impl TryFrom<sys::CUmemAllocationType> for AllocationType {
    type Error = UnknownValue;

    fn try_from(raw: sys::CUmemAllocationType) -> Result<Self, UnknownValue> {
        match raw {
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED => Ok(Self::Pinned),
            sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_MANAGED => Ok(Self::Managed),
            other => Err(UnknownValue { type_name: "CUmemAllocationType", value: other.0.into() }),
        }
    }
}

impl fmt::Display for AllocationType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pinned => "pinned",
            Self::Managed => "managed",
        })
    }
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

    /// Managed memory preferring `location` (a device, the host, or [`Location::Unspecified`]).
    pub const fn managed(location: Location) -> Self {
        Self::new(location, AllocationType::Managed)
    }

    /// Whether the host may touch this route's memory (after its stream is synchronised).
    pub fn is_host_accessible(&self) -> bool {
        self.allocation_type == AllocationType::Managed || self.location.is_host()
    }

    /// Refuses a route that cannot exist on any machine: `Unspecified` with pinned memory,
    /// `Invisible` as an input, and negative ids. [`Route::validate`] adds the check against
    /// this machine's devices.
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
    fn locations_round_trip_through_the_driver_form() {
        let all = [
            Location::Device(3),
            Location::Host,
            Location::HostNuma(1),
            Location::HostNumaCurrent,
            Location::Unspecified,
        ];
        for location in all {
            let raw = location.to_raw().expect("valid location");
            assert_eq!(Location::try_from(raw).expect("known type"), location);
        }
    }

    #[test]
    fn unknown_location_types_are_an_error_not_ub() {
        let raw = raw_location(sys::CUmemLocationType(0x77), 0);
        let error = Location::try_from(raw).expect_err("0x77 is not a location type");
        assert_eq!(error.value, 0x77, "{error}");
        assert!(AllocationType::try_from(sys::CUmemAllocationType(9)).is_err());
    }

    #[test]
    fn negative_ids_are_refused_before_the_driver() {
        assert!(Location::Device(-1).to_raw().is_err());
        let text = Location::HostNuma(-2).to_raw().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("-2") && text.contains("numbered from 0"), "{text}");
    }

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

    #[cfg(feature = "cuda-13020")]
    #[test]
    fn invisible_is_an_output_only() {
        assert!(Location::Invisible.to_raw().is_err());
        assert!(Route::managed(Location::Invisible).check_shape().is_err());
        let raw = raw_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVISIBLE, -2);
        assert_eq!(Location::try_from(raw).expect("13.2 knows it"), Location::Invisible);
    }

    #[test]
    fn host_access_follows_location_and_type() {
        assert!(!Route::device(0).is_host_accessible());
        assert!(Route::host().is_host_accessible());
        assert!(Route::host_numa(0).is_host_accessible());
        assert!(Route::managed(Location::Device(0)).is_host_accessible());
        assert_eq!(Route::managed(Location::Unspecified).to_string(), "(unspecified location, managed)");
    }
}
