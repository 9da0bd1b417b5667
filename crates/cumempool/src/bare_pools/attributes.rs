//! Every pool attribute, typed: the eight of CUDA 11.2, with `cuda-13020` the six of 13.2, and
//! with `cuda-13040` the locality domain of 13.4; and reading or setting one on a pool handle.
//! [`Pool`](crate::Pool)'s typed accessors go through these, and so do the layers under it,
//! which hold only the handle.

use crate::driver::driver_call;
use crate::driver::require;
use crate::error::Result;
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

/// Reads `attribute` of the pool `pool` as a 64-bit value (`int` attributes are widened):
/// the one `cuMemPoolGetAttribute` of the crate, for [`Pool::attribute`](crate::Pool::attribute)
/// and for layers that hold only the handle.
///
/// # Safety
/// `pool` is a live pool.
pub(crate) unsafe fn get(pool: sys::CUmemoryPool, attribute: PoolAttribute) -> Result<u64> {
    require(attribute.name(), attribute.since())?;
    if attribute.value() == AttributeValue::Bytes {
        let mut value: u64 = 0;
        // SAFETY: the attribute's value type is cuuint64_t; a live pool, as the caller promised.
        unsafe {
            driver_call!(cuMemPoolGetAttribute(pool, attribute.to_raw(), (&mut value as *mut u64).cast::<c_void>()))
        }?;
        Ok(value)
    } else {
        let mut value: i32 = 0;
        // SAFETY: the attribute's value type is int (or a C enum, which is int-sized); a live pool.
        unsafe {
            driver_call!(cuMemPoolGetAttribute(pool, attribute.to_raw(), (&mut value as *mut i32).cast::<c_void>()))
        }?;
        Ok(value as u32 as u64)
    }
}

/// Sets `attribute` of the pool `pool` (`int` attributes take 0 or 1): the one
/// `cuMemPoolSetAttribute` of the crate.
///
/// # Safety
/// `pool` is a live pool.
pub(crate) unsafe fn set(pool: sys::CUmemoryPool, attribute: PoolAttribute, value: u64) -> Result<()> {
    if attribute.value() == AttributeValue::Bytes {
        let mut value = value;
        // SAFETY: the attribute's value type is cuuint64_t; a live pool, as the caller promised.
        unsafe {
            driver_call!(cuMemPoolSetAttribute(pool, attribute.to_raw(), (&mut value as *mut u64).cast::<c_void>()))
        }
    } else {
        let mut value = i32::from(value != 0);
        // SAFETY: the attribute's value type is int; a live pool.
        unsafe {
            driver_call!(cuMemPoolSetAttribute(pool, attribute.to_raw(), (&mut value as *mut i32).cast::<c_void>()))
        }
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
