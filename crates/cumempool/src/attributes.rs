//! Every pool attribute, typed: the eight of CUDA 11.2 and, with `cuda-13020`, the six of 13.2.

use crate::driver::{api, require, DriverVersion};
#[cfg(not(feature = "cuda-13020"))]
use crate::error::Error;
use crate::error::{check, Result};
#[cfg(feature = "cuda-13020")]
use crate::handle_types::HandleTypes;
#[cfg(feature = "cuda-13020")]
use crate::location::{AllocationType, Location};
use crate::pool::Pool;
use cumempool_sys as sys;
use std::ffi::c_void;

/// A pool attribute, named as in `CUmemPool_attribute`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PoolAttribute {
    /// `REUSE_FOLLOW_EVENT_DEPENDENCIES` (bool).
    ReuseFollowEventDependencies,
    /// `REUSE_ALLOW_OPPORTUNISTIC` (bool).
    ReuseAllowOpportunistic,
    /// `REUSE_ALLOW_INTERNAL_DEPENDENCIES` (bool).
    ReuseAllowInternalDependencies,
    /// `RELEASE_THRESHOLD` (bytes).
    ReleaseThreshold,
    /// `RESERVED_MEM_CURRENT` (bytes).
    ReservedMemCurrent,
    /// `RESERVED_MEM_HIGH` (bytes; resettable to zero).
    ReservedMemHigh,
    /// `USED_MEM_CURRENT` (bytes).
    UsedMemCurrent,
    /// `USED_MEM_HIGH` (bytes; resettable to zero).
    UsedMemHigh,
    /// `ALLOCATION_TYPE` (13.2).
    #[cfg(feature = "cuda-13020")]
    AllocationType,
    /// `EXPORT_HANDLE_TYPES` (13.2).
    #[cfg(feature = "cuda-13020")]
    ExportHandleTypes,
    /// `LOCATION_ID` (13.2).
    #[cfg(feature = "cuda-13020")]
    LocationId,
    /// `LOCATION_TYPE` (13.2).
    #[cfg(feature = "cuda-13020")]
    LocationType,
    /// `MAX_POOL_SIZE` (13.2; bytes).
    #[cfg(feature = "cuda-13020")]
    MaxPoolSize,
    /// `HW_DECOMPRESS_ENABLED` (13.2; bool).
    #[cfg(feature = "cuda-13020")]
    HwDecompressEnabled,
}

impl PoolAttribute {
    /// Every attribute the crate was built with, in driver order.
    pub const ALL: &'static [Self] = &[
        Self::ReuseFollowEventDependencies,
        Self::ReuseAllowOpportunistic,
        Self::ReuseAllowInternalDependencies,
        Self::ReleaseThreshold,
        Self::ReservedMemCurrent,
        Self::ReservedMemHigh,
        Self::UsedMemCurrent,
        Self::UsedMemHigh,
        #[cfg(feature = "cuda-13020")]
        Self::AllocationType,
        #[cfg(feature = "cuda-13020")]
        Self::ExportHandleTypes,
        #[cfg(feature = "cuda-13020")]
        Self::LocationId,
        #[cfg(feature = "cuda-13020")]
        Self::LocationType,
        #[cfg(feature = "cuda-13020")]
        Self::MaxPoolSize,
        #[cfg(feature = "cuda-13020")]
        Self::HwDecompressEnabled,
    ];

    /// The driver's form.
    pub fn to_raw(self) -> sys::CUmemPool_attribute {
        use sys::CUmemPool_attribute as A;
        match self {
            Self::ReuseFollowEventDependencies => A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
            Self::ReuseAllowOpportunistic => A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
            Self::ReuseAllowInternalDependencies => A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            Self::ReleaseThreshold => A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            Self::ReservedMemCurrent => A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            Self::ReservedMemHigh => A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            Self::UsedMemCurrent => A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            Self::UsedMemHigh => A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            #[cfg(feature = "cuda-13020")]
            Self::AllocationType => A::CU_MEMPOOL_ATTR_ALLOCATION_TYPE,
            #[cfg(feature = "cuda-13020")]
            Self::ExportHandleTypes => A::CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES,
            #[cfg(feature = "cuda-13020")]
            Self::LocationId => A::CU_MEMPOOL_ATTR_LOCATION_ID,
            #[cfg(feature = "cuda-13020")]
            Self::LocationType => A::CU_MEMPOOL_ATTR_LOCATION_TYPE,
            #[cfg(feature = "cuda-13020")]
            Self::MaxPoolSize => A::CU_MEMPOOL_ATTR_MAX_POOL_SIZE,
            #[cfg(feature = "cuda-13020")]
            Self::HwDecompressEnabled => A::CU_MEMPOOL_ATTR_HW_DECOMPRESS_ENABLED,
        }
    }

    /// The attribute for a raw value, if the crate knows it.
    pub fn from_raw(raw: sys::CUmemPool_attribute) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.to_raw() == raw)
    }

    /// The C name, such as `CU_MEMPOOL_ATTR_MAX_POOL_SIZE`.
    pub fn name(self) -> &'static str {
        match self {
            Self::ReuseFollowEventDependencies => "CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES",
            Self::ReuseAllowOpportunistic => "CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC",
            Self::ReuseAllowInternalDependencies => "CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES",
            Self::ReleaseThreshold => "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD",
            Self::ReservedMemCurrent => "CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT",
            Self::ReservedMemHigh => "CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH",
            Self::UsedMemCurrent => "CU_MEMPOOL_ATTR_USED_MEM_CURRENT",
            Self::UsedMemHigh => "CU_MEMPOOL_ATTR_USED_MEM_HIGH",
            #[cfg(feature = "cuda-13020")]
            Self::AllocationType => "CU_MEMPOOL_ATTR_ALLOCATION_TYPE",
            #[cfg(feature = "cuda-13020")]
            Self::ExportHandleTypes => "CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES",
            #[cfg(feature = "cuda-13020")]
            Self::LocationId => "CU_MEMPOOL_ATTR_LOCATION_ID",
            #[cfg(feature = "cuda-13020")]
            Self::LocationType => "CU_MEMPOOL_ATTR_LOCATION_TYPE",
            #[cfg(feature = "cuda-13020")]
            Self::MaxPoolSize => "CU_MEMPOOL_ATTR_MAX_POOL_SIZE",
            #[cfg(feature = "cuda-13020")]
            Self::HwDecompressEnabled => "CU_MEMPOOL_ATTR_HW_DECOMPRESS_ENABLED",
        }
    }

    /// The oldest driver that knows the attribute.
    pub fn since(self) -> DriverVersion {
        if (self.to_raw().0) > sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH.0 {
            DriverVersion::CUDA_13_2
        } else {
            DriverVersion(11020)
        }
    }

    /// Whether the value is 64 bits wide (the byte counts); the others are C `int`s.
    fn is_wide(self) -> bool {
        use sys::CUmemPool_attribute as A;
        let raw = self.to_raw();
        let wide = [
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        ];
        #[cfg(feature = "cuda-13020")]
        if raw == A::CU_MEMPOOL_ATTR_MAX_POOL_SIZE {
            return true;
        }
        wide.contains(&raw)
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
    /// See [cuMemPoolGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MALLOC__ASYNC.html).
    pub fn attribute(&self, attribute: PoolAttribute) -> Result<u64> {
        require(attribute.name(), attribute.since())?;
        let f = api()?.cuMemPoolGetAttribute()?;
        if attribute.is_wide() {
            let mut value: u64 = 0;
            // SAFETY: the attribute's value type is cuuint64_t.
            check(
                unsafe { f(self.as_raw(), attribute.to_raw(), (&mut value as *mut u64).cast::<c_void>()) },
                "cuMemPoolGetAttribute",
            )?;
            Ok(value)
        } else {
            let mut value: i32 = 0;
            // SAFETY: the attribute's value type is int (or a C enum, which is int-sized).
            check(
                unsafe { f(self.as_raw(), attribute.to_raw(), (&mut value as *mut i32).cast::<c_void>()) },
                "cuMemPoolGetAttribute",
            )?;
            Ok(value as u32 as u64)
        }
    }

    fn set_attribute(&self, attribute: PoolAttribute, value: u64) -> Result<()> {
        let f = api()?.cuMemPoolSetAttribute()?;
        if attribute.is_wide() {
            let mut value = value;
            // SAFETY: the attribute's value type is cuuint64_t.
            check(
                unsafe { f(self.as_raw(), attribute.to_raw(), (&mut value as *mut u64).cast::<c_void>()) },
                "cuMemPoolSetAttribute",
            )
        } else {
            let mut value = i32::from(value != 0);
            // SAFETY: the attribute's value type is int.
            check(
                unsafe { f(self.as_raw(), attribute.to_raw(), (&mut value as *mut i32).cast::<c_void>()) },
                "cuMemPoolSetAttribute",
            )
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
        AllocationType::try_from(sys::CUmemAllocationType(raw as u32))
    }

    /// The handle types the pool exports, as the driver reports them (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn export_handle_types(&self) -> Result<HandleTypes> {
        Ok(HandleTypes::from_bits(self.attribute(PoolAttribute::ExportHandleTypes)? as u32))
    }

    /// The pool's location, as the driver reports it: `LOCATION_TYPE` with `LOCATION_ID` (driver 13.2).
    #[cfg(feature = "cuda-13020")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13020")))]
    pub fn location_attribute(&self) -> Result<Location> {
        let type_ = self.attribute(PoolAttribute::LocationType)? as u32;
        let id = self.attribute(PoolAttribute::LocationId)? as u32 as i32;
        Location::try_from(crate::location::raw_location(sys::CUmemLocationType(type_), id))
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
            needs: 13020,
            found: sys::BINDINGS_VERSION,
        })
    }

    #[cfg(not(feature = "cuda-13020"))]
    pub(crate) fn allocation_type_attribute(&self) -> Result<crate::location::AllocationType> {
        Err(Error::DriverTooOld {
            feature: "reading an imported pool's allocation type (needs the cuda-13020 feature)",
            needs: 13020,
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
        assert_eq!(PoolAttribute::ReleaseThreshold.since(), DriverVersion(11020));
        assert!(PoolAttribute::ReleaseThreshold.is_wide() && !PoolAttribute::ReuseAllowOpportunistic.is_wide());
    }

    #[cfg(feature = "cuda-13020")]
    #[test]
    fn the_six_new_attributes_need_13_2() {
        let new: Vec<_> = PoolAttribute::ALL.iter().filter(|a| a.since() == DriverVersion::CUDA_13_2).collect();
        assert_eq!(new.len(), 6);
        assert!(PoolAttribute::MaxPoolSize.is_wide() && !PoolAttribute::LocationId.is_wide());
    }

    #[cfg(not(feature = "cuda-13020"))]
    #[test]
    fn cuda_13_0_builds_have_only_the_eight() {
        assert_eq!(PoolAttribute::ALL.len(), 8);
    }
}
