//! Every pool attribute, typed: the eight of CUDA 11.2, with `cuda-13020` the six of 13.2, and
//! with `cuda-13040` the locality domain of 13.4.

use crate::driver::driver_call;
use crate::driver::require;
#[cfg(not(feature = "cuda-13020"))]
use crate::error::Error;
use crate::error::Result;
#[cfg(feature = "cuda-13020")]
use crate::export_handles::HandleTypes;
#[cfg(feature = "cuda-13020")]
use crate::location::{AllocationType, Location};
use crate::pool::Pool;
use cumempool_sys as sys;
use cumempool_sys::DriverVersion;
use std::ffi::c_void;

/// How an attribute's value is passed to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttributeValue {
    /// A C `int` read as true or false.
    Bool,
    /// A C `int` (or an int-sized C enum or bit set).
    Int,
    /// A `cuuint64_t` count of bytes.
    Bytes,
}

/// What the driver lets a program do with an attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttributeAccess {
    /// Read and set.
    ReadWrite,
    /// Read only.
    ReadOnly,
    /// Read, and reset to zero (high-water marks).
    ReadReset,
}

/// The table of pool attributes: one row each, read by the library, the command and the tests.
/// A new CUDA version's attribute is one row here.
macro_rules! pool_attributes {
    ($($(#[cfg($gate:meta)])* $variant:ident = $constant:ident, since $since:ident, $value:ident, $access:ident, $doc:literal;)*) => {
        /// A pool attribute, named as in `CUmemPool_attribute`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum PoolAttribute {
            $(
                #[doc = $doc]
                $(#[cfg($gate)] #[cfg_attr(docsrs, doc(cfg($gate)))])*
                $variant,
            )*
        }

        impl PoolAttribute {
            /// Every attribute the crate was built with, in driver order.
            pub const ALL: &'static [Self] = &[$($(#[cfg($gate)])* Self::$variant,)*];

            /// The driver's form.
            pub fn to_raw(self) -> sys::CUmemPool_attribute {
                match self {
                    $($(#[cfg($gate)])* Self::$variant => sys::CUmemPool_attribute::$constant,)*
                }
            }

            /// The C name, such as `CU_MEMPOOL_ATTR_MAX_POOL_SIZE`.
            pub fn name(self) -> &'static str {
                match self {
                    $($(#[cfg($gate)])* Self::$variant => stringify!($constant),)*
                }
            }

            /// The oldest driver that knows the attribute.
            pub fn since(self) -> DriverVersion {
                match self {
                    $($(#[cfg($gate)])* Self::$variant => DriverVersion::$since,)*
                }
            }

            /// How the value is passed to the driver.
            pub fn value(self) -> AttributeValue {
                match self {
                    $($(#[cfg($gate)])* Self::$variant => AttributeValue::$value,)*
                }
            }

            /// What the driver lets a program do with it.
            pub fn access(self) -> AttributeAccess {
                match self {
                    $($(#[cfg($gate)])* Self::$variant => AttributeAccess::$access,)*
                }
            }
        }
    };
}

pool_attributes! {
    ReuseFollowEventDependencies = CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, since CUDA_11_2, Bool, ReadWrite,
        "Whether memory freed on one stream is reused on another once an event dependency orders them.";
    ReuseAllowOpportunistic = CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, since CUDA_11_2, Bool, ReadWrite,
        "Whether memory whose free is already known complete is reused on any stream.";
    ReuseAllowInternalDependencies = CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, since CUDA_11_2, Bool, ReadWrite,
        "Whether the pool may insert its own dependencies to reuse memory.";
    ReleaseThreshold = CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, since CUDA_11_2, Bytes, ReadWrite,
        "Bytes the pool keeps reserved at a synchronisation before releasing memory to the system.";
    ReservedMemCurrent = CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, since CUDA_11_2, Bytes, ReadOnly,
        "Bytes the pool holds from the system now.";
    ReservedMemHigh = CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, since CUDA_11_2, Bytes, ReadReset,
        "The high-water mark of the reserved bytes.";
    UsedMemCurrent = CU_MEMPOOL_ATTR_USED_MEM_CURRENT, since CUDA_11_2, Bytes, ReadOnly,
        "Bytes allocated from the pool now.";
    UsedMemHigh = CU_MEMPOOL_ATTR_USED_MEM_HIGH, since CUDA_11_2, Bytes, ReadReset,
        "The high-water mark of the used bytes.";
    #[cfg(feature = "cuda-13020")]
    AllocationType = CU_MEMPOOL_ATTR_ALLOCATION_TYPE, since CUDA_13_2, Int, ReadOnly,
        "The kind of memory the pool hands out (a `CUmemAllocationType`).";
    #[cfg(feature = "cuda-13020")]
    ExportHandleTypes = CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES, since CUDA_13_2, Int, ReadOnly,
        "The handle types the pool can export (a `CUmemAllocationHandleType` bit set).";
    #[cfg(feature = "cuda-13020")]
    LocationId = CU_MEMPOOL_ATTR_LOCATION_ID, since CUDA_13_2, Int, ReadOnly,
        "The id of the pool's location (device ordinal or NUMA node).";
    #[cfg(feature = "cuda-13020")]
    LocationType = CU_MEMPOOL_ATTR_LOCATION_TYPE, since CUDA_13_2, Int, ReadOnly,
        "The type of the pool's location (a `CUmemLocationType`).";
    #[cfg(feature = "cuda-13020")]
    MaxPoolSize = CU_MEMPOOL_ATTR_MAX_POOL_SIZE, since CUDA_13_2, Bytes, ReadOnly,
        "The most bytes the pool may hold (0: no limit).";
    #[cfg(feature = "cuda-13020")]
    HwDecompressEnabled = CU_MEMPOOL_ATTR_HW_DECOMPRESS_ENABLED, since CUDA_13_2, Bool, ReadOnly,
        "Whether the pool's memory is usable by the hardware decompression engine.";
    #[cfg(feature = "cuda-13040")]
    LocalityDomainId = CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID, since CUDA_13_4, Int, ReadOnly,
        "The locality domain the pool is placed in (-1: none, also for domain 0 of a device with one domain).";
}

impl PoolAttribute {
    /// The attribute for a raw value, if the crate knows it.
    pub fn from_raw(raw: sys::CUmemPool_attribute) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.to_raw() == raw)
    }
}

/// Raw `CUmemPool_attribute` values the safe layer deliberately leaves unmapped, with the reason.
/// A test fails when a header adds one that is neither mapped nor listed here.
pub const UNMAPPED_POOL_ATTRIBUTES: &[(u32, &str)] = &[];

impl Pool {
    /// Reads any attribute as a 64-bit value (`int` attributes are widened).
    ///
    /// A 13.2 attribute on an older driver is [`Error::DriverTooOld`](crate::Error::DriverTooOld), not the driver's bare
    /// `CUDA_ERROR_INVALID_VALUE`.
    ///
    /// # Errors
    /// [`Error::DriverTooOld`](crate::Error::DriverTooOld) for an attribute newer than the
    /// driver; the driver's answer.
    ///
    /// See [cuMemPoolGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn attribute(&self, attribute: PoolAttribute) -> Result<u64> {
        require(attribute.name(), attribute.since())?;
        if attribute.value() == AttributeValue::Bytes {
            let mut value: u64 = 0;
            // SAFETY: the attribute's value type is cuuint64_t.
            unsafe {
                driver_call!(cuMemPoolGetAttribute(
                    self.as_raw(),
                    attribute.to_raw(),
                    (&mut value as *mut u64).cast::<c_void>()
                ))
            }?;
            Ok(value)
        } else {
            let mut value: i32 = 0;
            // SAFETY: the attribute's value type is int (or a C enum, which is int-sized).
            unsafe {
                driver_call!(cuMemPoolGetAttribute(
                    self.as_raw(),
                    attribute.to_raw(),
                    (&mut value as *mut i32).cast::<c_void>()
                ))
            }?;
            Ok(value as u32 as u64)
        }
    }

    pub(crate) fn set_attribute(&self, attribute: PoolAttribute, value: u64) -> Result<()> {
        if attribute.value() == AttributeValue::Bytes {
            let mut value = value;
            // SAFETY: the attribute's value type is cuuint64_t.
            unsafe {
                driver_call!(cuMemPoolSetAttribute(
                    self.as_raw(),
                    attribute.to_raw(),
                    (&mut value as *mut u64).cast::<c_void>()
                ))
            }
        } else {
            let mut value = i32::from(value != 0);
            // SAFETY: the attribute's value type is int.
            unsafe {
                driver_call!(cuMemPoolSetAttribute(
                    self.as_raw(),
                    attribute.to_raw(),
                    (&mut value as *mut i32).cast::<c_void>()
                ))
            }
        }
    }

    /// Whether the pool reuses memory freed on another stream once an event dependency orders it.
    pub fn reuse_follow_event_dependencies(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseFollowEventDependencies)? != 0)
    }

    /// Sets [`Pool::reuse_follow_event_dependencies`].
    pub fn set_reuse_follow_event_dependencies(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseFollowEventDependencies, enabled.into())
    }

    /// Whether the pool reuses memory whose free is already known complete.
    pub fn reuse_allow_opportunistic(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseAllowOpportunistic)? != 0)
    }

    /// Sets [`Pool::reuse_allow_opportunistic`].
    pub fn set_reuse_allow_opportunistic(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseAllowOpportunistic, enabled.into())
    }

    /// Whether the pool may insert its own dependencies to reuse memory.
    pub fn reuse_allow_internal_dependencies(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::ReuseAllowInternalDependencies)? != 0)
    }

    /// Sets [`Pool::reuse_allow_internal_dependencies`].
    pub fn set_reuse_allow_internal_dependencies(&self, enabled: bool) -> Result<()> {
        self.set_attribute(PoolAttribute::ReuseAllowInternalDependencies, enabled.into())
    }

    /// Bytes the pool keeps reserved at a synchronisation before releasing memory to the system.
    pub fn release_threshold(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReleaseThreshold)
    }

    /// Sets [`Pool::release_threshold`] (`u64::MAX`: never release).
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_attribute(PoolAttribute::ReleaseThreshold, bytes)
    }

    /// Bytes the pool currently holds from the system.
    pub fn reserved_mem_current(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReservedMemCurrent)
    }

    /// The high-water mark of [`Pool::reserved_mem_current`].
    pub fn reserved_mem_high(&self) -> Result<u64> {
        self.attribute(PoolAttribute::ReservedMemHigh)
    }

    /// Resets [`Pool::reserved_mem_high`] to zero (the only value the driver accepts).
    pub fn reset_reserved_mem_high(&self) -> Result<()> {
        self.set_attribute(PoolAttribute::ReservedMemHigh, 0)
    }

    /// Bytes currently allocated from the pool.
    pub fn used_mem_current(&self) -> Result<u64> {
        self.attribute(PoolAttribute::UsedMemCurrent)
    }

    /// The high-water mark of [`Pool::used_mem_current`].
    pub fn used_mem_high(&self) -> Result<u64> {
        self.attribute(PoolAttribute::UsedMemHigh)
    }

    /// Resets [`Pool::used_mem_high`] to zero.
    pub fn reset_used_mem_high(&self) -> Result<()> {
        self.set_attribute(PoolAttribute::UsedMemHigh, 0)
    }

    /// The pool's allocation type, as the driver reports it (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn allocation_type_attribute(&self) -> Result<AllocationType> {
        let raw = self.attribute(PoolAttribute::AllocationType)?;
        Ok(AllocationType::try_from(sys::CUmemAllocationType(raw as u32))?)
    }

    /// The handle types the pool exports, as the driver reports them (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn export_handle_types(&self) -> Result<HandleTypes> {
        Ok(HandleTypes::from_bits(self.attribute(PoolAttribute::ExportHandleTypes)? as u32))
    }

    /// The pool's location, as the driver reports it: `LOCATION_TYPE` with `LOCATION_ID` (driver
    /// 13.2), and for a pool in a locality domain `LOCALITY_DOMAIN_ID` (driver 13.4). A type this
    /// crate does not know is [`Location::Unknown`].
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn location_attribute(&self) -> Result<Location> {
        let type_ = sys::CUmemLocationType(self.attribute(PoolAttribute::LocationType)? as u32);
        let id = self.attribute(PoolAttribute::LocationId)? as u32 as i32;
        #[cfg(feature = "cuda-13040")]
        if type_ == sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN {
            // cuda.h does not say whether LOCATION_ID of a localized pool is the device ordinal or
            // the packed `localized` pair; its low byte is the device either way (CUDA hosts are
            // little-endian), and the domain has its own attribute.
            if let Some(domain) = self.locality_domain_id()? {
                return Ok(Location::DeviceLocalityDomain { device: id & 0xFF, domain });
            }
        }
        Ok(Location::from_raw_parts(type_, id))
    }

    /// The locality domain the pool is placed in, as the driver reports it (driver 13.4).
    ///
    /// `None` for a pool in no domain, and also for one created in domain 0 of a device with a
    /// single domain: the driver treats that as the whole device.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain_id(&self) -> Result<Option<u8>> {
        let raw = self.attribute(PoolAttribute::LocalityDomainId)? as u32 as i32;
        crate::device::domain_from_driver("CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID", raw)
    }

    /// The pool's maximum size in bytes, as the driver reports it (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn max_pool_size(&self) -> Result<u64> {
        self.attribute(PoolAttribute::MaxPoolSize)
    }

    /// Whether the pool's memory is usable by the hardware decompression engine (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn hw_decompress_enabled(&self) -> Result<bool> {
        Ok(self.attribute(PoolAttribute::HwDecompressEnabled)? != 0)
    }

    #[cfg(not(feature = "cuda-13020"))]
    pub(crate) fn location_attribute(&self) -> Result<crate::location::Location> {
        Err(Error::DriverTooOld {
            feature: "reading an imported pool's location (needs the cuda-13020 feature)",
            needs: DriverVersion::CUDA_13_2,
            found: sys::BINDINGS_VERSION,
        })
    }

    #[cfg(not(feature = "cuda-13020"))]
    pub(crate) fn allocation_type_attribute(&self) -> Result<crate::location::AllocationType> {
        Err(Error::DriverTooOld {
            feature: "reading an imported pool's allocation type (needs the cuda-13020 feature)",
            needs: DriverVersion::CUDA_13_2,
            found: sys::BINDINGS_VERSION,
        })
    }

    /// Every attribute, read once: a value or the reason it cannot be read.
    pub fn attributes(&self) -> Vec<(PoolAttribute, Result<u64>)> {
        PoolAttribute::ALL.iter().map(|a| (*a, self.attribute(*a))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_map_both_ways_and_name_the_c_constant() {
        for attribute in PoolAttribute::ALL {
            assert_eq!(PoolAttribute::from_raw(attribute.to_raw()), Some(*attribute));
            assert!(attribute.name().starts_with("CU_MEMPOOL_ATTR_"));
        }
        assert_eq!(PoolAttribute::ReleaseThreshold.since(), DriverVersion::CUDA_11_2);
        assert_eq!(PoolAttribute::ReleaseThreshold.value(), AttributeValue::Bytes);
        assert_eq!(PoolAttribute::ReuseAllowOpportunistic.value(), AttributeValue::Bool);
        assert_eq!(PoolAttribute::UsedMemHigh.access(), AttributeAccess::ReadReset);
    }

    #[cfg(feature = "cuda-13020")]
    #[test]
    fn the_six_new_attributes_need_13_2() {
        let new: Vec<_> = PoolAttribute::ALL.iter().filter(|a| a.since() == DriverVersion::CUDA_13_2).collect();
        assert_eq!(new.len(), 6);
        assert_eq!(PoolAttribute::MaxPoolSize.value(), AttributeValue::Bytes);
        assert_eq!(PoolAttribute::LocationId.value(), AttributeValue::Int);
        assert!(new.iter().all(|a| a.access() == AttributeAccess::ReadOnly));
    }

    #[cfg(not(feature = "cuda-13020"))]
    #[test]
    fn cuda_13_0_builds_have_only_the_eight() {
        assert_eq!(PoolAttribute::ALL.len(), 8);
    }
}
