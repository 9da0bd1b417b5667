//! CUDA devices: enumeration and the attributes that matter to pools.

use crate::driver::driver_call;
#[cfg(feature = "cuda-13040")]
use crate::driver::require;
use crate::error::{Error, Result};
use crate::values::export_handles::HandleTypes;
#[cfg(feature = "cuda-13040")]
use crate::values::location::Location;
use cumempool_sys as sys;
#[cfg(feature = "cuda-13040")]
use cumempool_sys::DriverVersion;
use std::ffi::c_char;
use std::sync::OnceLock;

/// A CUDA device, by ordinal. Cheap to copy; says nothing about contexts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    ordinal: i32,
    raw: sys::CUdevice,
}

/// A device's graph memory, in bytes ([`Device::graph_memory`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphMemory {
    /// Used by graph allocations now (`CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT`).
    pub used_current: u64,
    /// The most used since the mark was last reset (`CU_GRAPH_MEM_ATTR_USED_MEM_HIGH`).
    pub used_high: u64,
    /// Reserved for graph allocations now, used or not (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).
    pub reserved_current: u64,
    /// The most reserved since the mark was last reset (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH`).
    pub reserved_high: u64,
}

static COUNT: OnceLock<i32> = OnceLock::new();

/// Fails unless the host may touch managed memory while devices run work.
///
/// Without `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS` on every device, the host must not
/// touch any managed memory while any kernel runs (the access faults), and other threads may
/// start kernels at any time, so no wait on one stream makes it safe. Host access is refused
/// there instead. Asked of the driver once per process.
///
/// # Errors
/// [`Error::ManagedMemoryNotHostAccessible`] naming the first device without concurrent access.
pub fn require_concurrent_managed_access() -> Result<()> {
    static FIRST_WITHOUT: OnceLock<Option<i32>> = OnceLock::new();
    let first_without = match FIRST_WITHOUT.get() {
        Some(found) => *found,
        None => {
            let devices = Device::all()?;
            let found = first_without_concurrent_access(
                devices.iter().map(|d| d.concurrent_managed_access().map(|access| (d.ordinal(), access))),
            )?;
            *FIRST_WITHOUT.get_or_init(|| found)
        }
    };
    match first_without {
        None => Ok(()),
        Some(device) => Err(Error::ManagedMemoryNotHostAccessible { device }),
    }
}

/// The first device whose answer is "no concurrent managed access".
fn first_without_concurrent_access(answers: impl Iterator<Item = Result<(i32, bool)>>) -> Result<Option<i32>> {
    for answer in answers {
        let (ordinal, concurrent) = answer?;
        if !concurrent {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

impl Device {
    /// How many devices the driver sees (asked once; it cannot change within a process).
    ///
    /// # Errors
    /// A driver that cannot be loaded or initialised.
    ///
    /// See [cuDeviceGetCount](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    pub fn count() -> Result<i32> {
        if let Some(count) = COUNT.get() {
            return Ok(*count);
        }
        let mut count = 0;
        // SAFETY: valid out-pointer.
        unsafe { driver_call!(cuDeviceGetCount(&mut count)) }?;
        Ok(*COUNT.get_or_init(|| count))
    }

    /// The device with this ordinal, or [`Error::InvalidDevice`] naming the valid range.
    ///
    /// # Errors
    /// [`Error::InvalidDevice`] naming the valid range; a driver that cannot be loaded.
    ///
    /// See [cuDeviceGet](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    pub fn get(ordinal: i32) -> Result<Self> {
        Self::check_ordinal(ordinal)?;
        let mut raw = 0;
        // SAFETY: valid out-pointer; the ordinal is in range.
        unsafe { driver_call!(cuDeviceGet(&mut raw, ordinal)) }?;
        Ok(Self { ordinal, raw })
    }

    /// Fails unless this machine has a device with this ordinal: the check of
    /// [`Device::get`] without its `cuDeviceGet` (the count is asked of the driver once).
    ///
    /// # Errors
    /// [`Error::InvalidDevice`] naming the valid range; a driver that cannot be loaded.
    pub(crate) fn check_ordinal(ordinal: i32) -> Result<()> {
        let count = Self::count()?;
        if !(0..count).contains(&ordinal) {
            return Err(Error::InvalidDevice { ordinal, count });
        }
        Ok(())
    }

    /// Every device, in ordinal order.
    pub fn all() -> Result<Vec<Self>> {
        (0..Self::count()?).map(Self::get).collect()
    }

    /// The ordinal.
    pub fn ordinal(self) -> i32 {
        self.ordinal
    }

    /// The driver's handle.
    pub fn as_raw(self) -> sys::CUdevice {
        self.raw
    }

    /// The marketing name, such as `NVIDIA H200`.
    pub fn name(self) -> Result<String> {
        let mut buffer = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        unsafe { driver_call!(cuDeviceGetName(buffer.as_mut_ptr(), buffer.len() as i32, self.raw)) }?;
        let bytes: Vec<u8> = buffer.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The device's UUID.
    pub fn uuid(self) -> Result<[u8; 16]> {
        let mut uuid = sys::CUuuid::default();
        // SAFETY: valid out-pointer.
        unsafe { driver_call!(cuDeviceGetUuid(&mut uuid, self.raw)) }?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Total memory of the device, in bytes.
    pub fn total_memory(self) -> Result<usize> {
        let mut bytes = 0;
        // SAFETY: valid out-pointer.
        unsafe { driver_call!(cuDeviceTotalMem(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }

    /// Any device attribute, raw.
    ///
    /// See [cuDeviceGetAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html).
    pub fn attribute(self, attribute: sys::CUdevice_attribute) -> Result<i32> {
        let mut value = 0;
        // SAFETY: valid out-pointer.
        unsafe { driver_call!(cuDeviceGetAttribute(&mut value, attribute, self.raw)) }?;
        Ok(value)
    }

    /// Whether the device supports stream-ordered memory pools.
    pub fn supports_memory_pools(self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// Whether pools of pinned host memory can be used with this device.
    pub fn supports_host_memory_pools(self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// Whether pools on host NUMA nodes can be used with this device.
    pub fn supports_host_numa_memory_pools(self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// Whether the host and the device may touch managed memory at the same time.
    pub fn concurrent_managed_access(self) -> Result<bool> {
        Ok(self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)? != 0)
    }

    /// The host NUMA node nearest the device, where the driver knows one.
    pub fn host_numa_id(self) -> Result<Option<i32>> {
        let id = self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?;
        Ok((id >= 0).then_some(id))
    }

    /// The handle types pools on this device can export.
    pub fn supported_handle_types(self) -> Result<HandleTypes> {
        let bits = self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
        Ok(HandleTypes::from_bits(bits as u32))
    }

    /// How many locality domains the device has (driver 13.4): 1 where its memory is one domain.
    ///
    /// On an older driver, [`Error::DriverTooOld`] naming the attribute.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain_count(self) -> Result<u32> {
        self.locality_domain_attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_COUNT,
            "CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_COUNT",
        )
    }

    /// How many multiprocessors each locality domain has (driver 13.4).
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain_multiprocessor_count(self) -> Result<u32> {
        self.locality_domain_attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_MULTIPROCESSOR_COUNT,
            "CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_MULTIPROCESSOR_COUNT",
        )
    }

    /// A 13.4 device attribute: refused by name on an older driver, whose bare answer would be
    /// `CUDA_ERROR_INVALID_VALUE`.
    #[cfg(feature = "cuda-13040")]
    fn locality_domain_attribute(self, attribute: sys::CUdevice_attribute, name: &'static str) -> Result<u32> {
        require(name, DriverVersion::CUDA_13_4)?;
        let value = self.attribute(attribute)?;
        u32::try_from(value).map_err(|_| crate::UnknownValue { type_name: name, value: value.into() }.into())
    }

    /// The location of one of the device's locality domains (driver 13.4), checked: a domain
    /// the device does not have is [`Error::InvalidLocalityDomain`] before any pool call.
    ///
    /// # Errors
    /// [`Error::InvalidLocalityDomain`]; [`Error::InvalidLocation`] for an ordinal above 255,
    /// which cuda.h's `localized.deviceId` cannot hold; [`Error::DriverTooOld`] before 13.4.
    #[cfg(feature = "cuda-13040")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
    pub fn locality_domain(self, domain: u8) -> Result<Location> {
        let location = Location::DeviceLocalityDomain { device: self.ordinal, domain };
        location.to_raw_parts()?;
        require("CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN", DriverVersion::CUDA_13_4)?;
        let count = self.locality_domain_count()?;
        if u32::from(domain) >= count {
            return Err(Error::InvalidLocalityDomain { device: self.ordinal, domain, count });
        }
        Ok(location)
    }

    /// The device's graph memory: what graphs' allocation nodes use and reserve, which pools
    /// neither cap nor count (driver 580: a captured allocation is served from here even above
    /// its pool's maximum size, and the pool's used memory stays 0).
    ///
    /// See [cuDeviceGetGraphMemAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// The driver's answer.
    pub fn graph_memory(self) -> Result<GraphMemory> {
        use sys::CUgraphMem_attribute as A;
        Ok(GraphMemory {
            used_current: self.graph_memory_attribute(A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            used_high: self.graph_memory_attribute(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
            reserved_current: self.graph_memory_attribute(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.graph_memory_attribute(A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    fn graph_memory_attribute(self, attribute: sys::CUgraphMem_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the graph memory attributes are 64-bit values; a valid out-pointer.
        unsafe {
            driver_call!(cuDeviceGetGraphMemAttribute(
                self.raw,
                attribute,
                (&mut value as *mut u64).cast::<std::ffi::c_void>()
            ))
        }?;
        Ok(value)
    }

    /// Resets the high-water marks of [`Device::graph_memory`] (used and reserved) to 0; the
    /// driver then tracks them from the current values.
    ///
    /// See [cuDeviceSetGraphMemAttribute](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// The driver's answer.
    pub fn reset_graph_memory_high(self) -> Result<()> {
        use sys::CUgraphMem_attribute as A;
        for attribute in [A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH] {
            let mut zero: u64 = 0;
            // SAFETY: the high-water marks take a 64-bit 0; a valid pointer.
            unsafe {
                driver_call!(cuDeviceSetGraphMemAttribute(
                    self.raw,
                    attribute,
                    (&mut zero as *mut u64).cast::<std::ffi::c_void>()
                ))
            }?;
        }
        Ok(())
    }

    /// Gives the device's unused graph memory back to the system. Graph memory stays reserved
    /// after the graphs that used it free it (driver 580), until this call.
    ///
    /// See [cuDeviceGraphMemTrim](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// The driver's answer.
    pub fn trim_graph_memory(self) -> Result<()> {
        // SAFETY: a valid device.
        unsafe { driver_call!(cuDeviceGraphMemTrim(self.raw)) }
    }

    /// Whether this device can access memory of `peer` directly.
    ///
    /// See [cuDeviceCanAccessPeer](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html).
    pub fn can_access_peer(self, peer: Device) -> Result<bool> {
        let mut can = 0;
        // SAFETY: valid out-pointer.
        unsafe { driver_call!(cuDeviceCanAccessPeer(&mut can, self.raw, peer.raw)) }?;
        Ok(can != 0)
    }
}

/// A locality domain as the driver reports it (an `int`, -1 for none) for `what`.
#[cfg(feature = "cuda-13040")]
pub(crate) fn domain_from_driver(what: &'static str, raw: i32) -> Result<Option<u8>> {
    match raw {
        -1 => Ok(None),
        _ => u8::try_from(raw).map(Some).map_err(|_| crate::UnknownValue { type_name: what, value: raw.into() }.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_device_without_concurrent_managed_access_makes_managed_memory_host_only_when_idle() {
        let answers = |list: &[(i32, bool)]| list.iter().map(|a| Ok(*a)).collect::<Vec<Result<(i32, bool)>>>();
        assert_eq!(first_without_concurrent_access(answers(&[(0, true), (1, true)]).into_iter()).unwrap(), None);
        assert_eq!(first_without_concurrent_access(answers(&[(0, true), (1, false)]).into_iter()).unwrap(), Some(1));
        let text = Error::ManagedMemoryNotHostAccessible { device: 1 }.to_string();
        assert!(text.contains("device 1") && text.contains("copy_to_host"), "{text}");
    }

    #[cfg(feature = "cuda-13040")]
    #[test]
    fn domains_read_back_as_none_a_domain_or_an_unknown_value() {
        assert_eq!(domain_from_driver("ordinal", -1).unwrap(), None);
        assert_eq!(domain_from_driver("ordinal", 3).unwrap(), Some(3));
        assert!(matches!(domain_from_driver("ordinal", 256), Err(Error::UnknownValue(_))));
        let text = Error::InvalidLocalityDomain { device: 0, domain: 2, count: 2 }.to_string();
        assert!(text.contains("2 locality domain(s)") && text.contains("no domain 2"), "{text}");
    }
}
