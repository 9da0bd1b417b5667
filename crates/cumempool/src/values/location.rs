//! Where pool memory lives and what kind it is: the two halves of a [`Route`](crate::Route).

use crate::values::unknown_value::UnknownValue;
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

/// Where a pool's memory resides: the safe form of `CUmemLocation`.
///
/// `Unspecified` is the driver's `CU_MEM_LOCATION_TYPE_NONE`: no preferred location, which only
/// managed pools accept. `Invisible` (CUDA 13.2) describes an imported pool whose device this
/// process cannot see, and `Unknown` a location type this crate does not know (a newer
/// driver's); the driver only ever reports them, so they are refused as inputs.
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
    /// One locality domain of a device (CUDA 13.4): the part of the device's memory nearest one
    /// group of its multiprocessors. Pinned pools only. On a device with one domain, domain 0 is
    /// the whole device, and the driver reports such a pool as [`Location::Device`].
    /// [`Device::locality_domain`](crate::Device::locality_domain) checks both numbers.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    DeviceLocalityDomain {
        /// The device ordinal (cuda.h keeps it in an `unsigned char`: 0 to 255).
        device: i32,
        /// The domain, from 0 to the device's
        /// [`locality_domain_count`](crate::Device::locality_domain_count) minus one.
        domain: u8,
    },
    /// A location type this version of the crate does not know, read back from a newer driver,
    /// with the raw type and id. Never an input.
    Unknown {
        /// The raw `CUmemLocationType`.
        type_: u32,
        /// The raw id (the whole `id` union, read as an `int`).
        id: i32,
    },
}

impl Location {
    /// The driver's form, for a location that may be passed to the driver.
    ///
    /// Refuses `Invisible`, `Unknown`, and negative device ordinals or NUMA ids, before the
    /// driver sees them.
    ///
    /// # Errors
    /// [`InvalidLocation`] for the refusals above.
    pub fn to_raw(self) -> Result<sys::CUmemLocation, InvalidLocation> {
        let (type_, id) = self.to_raw_parts()?;
        Ok(raw_location(type_, id))
    }

    /// The driver's type and id: the id is the whole `id` union of `CUmemLocation` read as an
    /// `int` (for a locality domain, the bytes of `localized { deviceId, localityDomainId }`).
    ///
    /// # Errors
    /// [`InvalidLocation`], as [`Location::to_raw`].
    pub fn to_raw_parts(self) -> Result<(sys::CUmemLocationType, i32), InvalidLocation> {
        use sys::CUmemLocationType as T;
        let refuse = |reason| Err(InvalidLocation { location: self, reason });
        Ok(match self {
            Self::Device(ordinal) if ordinal < 0 => return refuse("device ordinals start at 0"),
            Self::HostNuma(node) if node < 0 => return refuse("NUMA nodes are numbered from 0"),
            Self::Device(ordinal) => (T::CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
            Self::Host => (T::CU_MEM_LOCATION_TYPE_HOST, 0),
            Self::HostNuma(node) => (T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
            Self::HostNumaCurrent => (T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, 0),
            Self::Unspecified => (T::CU_MEM_LOCATION_TYPE_NONE, 0),
            #[cfg(feature = "cuda-13020")]
            Self::Invisible => {
                return refuse("the driver only reports Invisible for imported pools; it is never an input")
            }
            #[cfg(feature = "cuda-13040")]
            Self::DeviceLocalityDomain { device, domain } => match u8::try_from(device) {
                Ok(device) => {
                    (T::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, i32::from_ne_bytes([device, domain, 0, 0]))
                }
                Err(_) if device < 0 => return refuse("device ordinals start at 0"),
                Err(_) => {
                    return refuse("cuda.h keeps a locality domain's device in an unsigned char: ordinals 0 to 255")
                }
            },
            Self::Unknown { .. } => {
                return refuse(
                    "an unknown location type is only ever read back from a newer driver; it is never an input",
                )
            }
        })
    }

    /// The location the driver means by a type and an id (the whole `id` union read as an
    /// `int`). Total: a type this crate does not know is [`Location::Unknown`], never undefined
    /// behaviour.
    pub fn from_raw_parts(type_: sys::CUmemLocationType, id: i32) -> Self {
        use sys::CUmemLocationType as T;
        match type_ {
            T::CU_MEM_LOCATION_TYPE_DEVICE => Self::Device(id),
            T::CU_MEM_LOCATION_TYPE_HOST => Self::Host,
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA => Self::HostNuma(id),
            T::CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Self::HostNumaCurrent,
            // Also CU_MEM_LOCATION_TYPE_INVALID, which shares the value 0.
            T::CU_MEM_LOCATION_TYPE_NONE => Self::Unspecified,
            #[cfg(feature = "cuda-13020")]
            T::CU_MEM_LOCATION_TYPE_INVISIBLE => Self::Invisible,
            #[cfg(feature = "cuda-13040")]
            T::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN => {
                let [device, domain, ..] = id.to_ne_bytes();
                Self::DeviceLocalityDomain { device: device.into(), domain }
            }
            other => Self::Unknown { type_: other.0, id },
        }
    }

    /// The location a driver `CUmemLocation` describes (see [`Location::from_raw_parts`]).
    ///
    /// # Safety
    /// All four bytes of `raw`'s `id` union must be initialised, as they are in what the driver
    /// writes and in [`raw_location`]'s result. With CUDA 13.4's headers a union built from
    /// `localized` alone (two bytes) does not qualify, because its `id` cannot be read.
    pub unsafe fn from_raw(raw: &sys::CUmemLocation) -> Self {
        // SAFETY: the caller vouches that the whole union is initialised.
        Self::from_raw_parts(raw.type_, unsafe { raw_location_id(raw) })
    }

    /// Whether the host can read and write memory at this location.
    pub fn is_host(self) -> bool {
        matches!(self, Self::Host | Self::HostNuma(_) | Self::HostNumaCurrent)
    }

    /// The device ordinal, for a device location or one of its locality domains.
    pub fn device(self) -> Option<i32> {
        match self {
            Self::Device(ordinal) => Some(ordinal),
            #[cfg(feature = "cuda-13040")]
            Self::DeviceLocalityDomain { device, .. } => Some(device),
            _ => None,
        }
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
            #[cfg(feature = "cuda-13040")]
            Self::DeviceLocalityDomain { device, domain } => write!(f, "locality domain {domain} of device {device}"),
            Self::Unknown { type_, id } => write!(f, "unknown location type {type_:#x} (id {id})"),
        }
    }
}

/// The driver's `CUmemLocation` from its parts, whatever they are: for handing the driver inputs
/// [`Location`] refuses (probes of what the driver itself answers). CUDA 13.2's header moved
/// `id` into a one-member anonymous union (same layout); 13.0's has it as a plain field.
#[cfg(feature = "cuda-13020")]
pub fn raw_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_, __bindgen_anon_1: sys::CUmemLocation_st__bindgen_ty_1 { id } }
}

/// The id of a driver `CUmemLocation` (13.2's one-member union, or 13.4's `id`/`localized`).
///
/// # Safety
/// As [`Location::from_raw`]: the whole union must be initialised.
#[cfg(feature = "cuda-13020")]
unsafe fn raw_location_id(raw: &sys::CUmemLocation) -> i32 {
    // SAFETY: the caller vouches for all four bytes, so `id` is an initialised `int`.
    unsafe { raw.__bindgen_anon_1.id }
}

/// The driver's `CUmemLocation` from its parts, whatever they are: for handing the driver inputs
/// [`Location`] refuses (probes of what the driver itself answers).
#[cfg(not(feature = "cuda-13020"))]
pub fn raw_location(type_: sys::CUmemLocationType, id: i32) -> sys::CUmemLocation {
    sys::CUmemLocation { type_, id }
}

/// The id of a driver `CUmemLocation` (13.0's plain field).
///
/// # Safety
/// None needed with 13.0's layout; `unsafe` for one signature under every feature.
#[cfg(not(feature = "cuda-13020"))]
unsafe fn raw_location_id(raw: &sys::CUmemLocation) -> i32 {
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
            // SAFETY: to_raw initialises the whole union.
            assert_eq!(unsafe { Location::from_raw(&raw) }, location);
            let (type_, id) = location.to_raw_parts().expect("valid location");
            assert_eq!(Location::from_raw_parts(type_, id), location);
        }
    }

    #[test]
    fn unknown_location_types_read_back_as_unknown_not_ub() {
        // 0x77 is no type of any header; 6 is 13.4's DEVICE_LOCALITY_DOMAIN, unknown before it.
        let mut raw_types = vec![0x77_u32, 0x7FFF_FFFE];
        if !cfg!(feature = "cuda-13040") {
            raw_types.push(6);
        }
        for type_ in raw_types {
            let raw = raw_location(sys::CUmemLocationType(type_), 0x0102);
            // SAFETY: raw_location initialises the whole union.
            let location = unsafe { Location::from_raw(&raw) };
            assert_eq!(location, Location::Unknown { type_, id: 0x0102 });
            assert_eq!(Location::from_raw_parts(sys::CUmemLocationType(type_), 0x0102), location);
            let refused = location.to_raw_parts().expect_err("Unknown is never an input").to_string();
            assert!(refused.contains("newer driver"), "{refused}");
        }
        assert!(AllocationType::try_from(sys::CUmemAllocationType(9)).is_err());
    }

    #[test]
    fn negative_ids_are_refused_before_the_driver() {
        assert!(Location::Device(-1).to_raw().is_err());
        let text = Location::HostNuma(-2).to_raw().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("-2") && text.contains("numbered from 0"), "{text}");
    }

    #[cfg(feature = "cuda-13020")]
    #[test]
    fn invisible_is_an_output_only() {
        assert!(Location::Invisible.to_raw().is_err());
        let raw = raw_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVISIBLE, -2);
        // SAFETY: raw_location initialises the whole union.
        assert_eq!(unsafe { Location::from_raw(&raw) }, Location::Invisible);
    }

    #[cfg(feature = "cuda-13040")]
    #[test]
    fn a_locality_domain_is_written_through_localized_and_read_back_from_either_member() {
        let location = Location::DeviceLocalityDomain { device: 3, domain: 2 };
        let raw = location.to_raw().expect("a valid domain location");
        assert_eq!(raw.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN);
        // SAFETY: to_raw initialises the whole union; `localized` is two of its bytes.
        let localized = unsafe { raw.__bindgen_anon_1.localized };
        assert_eq!((localized.deviceId, localized.localityDomainId), (3, 2));
        // SAFETY: as above; `id` is all four bytes, the upper two zero.
        assert_eq!(unsafe { raw.__bindgen_anon_1.id }, i32::from_ne_bytes([3, 2, 0, 0]));
        // SAFETY: raw_location initialises the whole union.
        assert_eq!(unsafe { Location::from_raw(&raw) }, location);

        // As a C program writes it: a zeroed struct whose `localized` member is then set.
        let mut written = raw_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, 0);
        written.__bindgen_anon_1.localized =
            sys::CUmemLocation_st__bindgen_ty_1__bindgen_ty_1 { deviceId: 255, localityDomainId: 7 };
        // SAFETY: the union was initialised whole before `localized` was written.
        assert_eq!(unsafe { Location::from_raw(&written) }, Location::DeviceLocalityDomain { device: 255, domain: 7 });

        // Device and HOST_NUMA locations still go through `id`, all four bytes.
        let device = Location::Device(300).to_raw().expect("valid");
        // SAFETY: to_raw initialises the whole union.
        assert_eq!(unsafe { device.__bindgen_anon_1.id }, 300);
        // SAFETY: as above.
        assert_eq!(unsafe { Location::from_raw(&device) }, Location::Device(300));
        assert_eq!(location.device(), Some(3));
        assert_eq!(location.to_string(), "locality domain 2 of device 3");
    }
}
