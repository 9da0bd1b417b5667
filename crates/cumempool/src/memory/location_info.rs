//! Where the pages of managed memory reside, summarised per region: `cuMemGetLocationInfo`
//! (CUDA 13.4).

use crate::driver::driver_call;
use crate::error::{Error, Result};
use crate::values::location::{raw_location, Location};
use cumempool_sys as sys;

/// How many regions `cuMemGetLocationInfo` reports for `size` bytes, after cuda.h's rules:
/// the summary granularity is more than 0 and at most `size`; the sampling granularity is at
/// most the summary granularity (0: a system-dependent value). An empty range has no regions.
///
/// # Errors
/// [`Error::InvalidGranularity`] naming the rule that is broken.
pub(crate) fn region_count(size: usize, summary: usize, sampling: usize) -> Result<usize> {
    let refuse = |reason| Err(Error::InvalidGranularity { size, summary, sampling, reason });
    if summary == 0 {
        return refuse("the summary granularity must be more than 0");
    }
    if sampling > summary {
        return refuse("the sampling granularity must be at most the summary granularity (or 0 for the system's)");
    }
    if size == 0 {
        return Ok(0);
    }
    if summary > size {
        return refuse("the summary granularity must be at most the size; use the size for one region");
    }
    Ok(size.div_ceil(summary))
}

/// Where the pages of `size` bytes at `ptr` reside: one [`Location`] per region of
/// `summary_granularity` bytes (the last may be shorter), each the location most of the region's
/// samples, taken every `sampling_granularity` bytes (0: the system's choice), found it in.
/// A region resident nowhere is [`Location::Unspecified`].
///
/// The memory must be managed (from a managed pool or `cuMemAllocManaged`) or pageable system
/// memory; the driver answers anything else with `CUDA_ERROR_INVALID_VALUE`, and a machine
/// where a device lacks concurrent managed access with `CUDA_ERROR_NOT_SUPPORTED`. It only reads
/// page tables, so any address is safe to ask about; the answer is a snapshot.
///
/// See [cuMemGetLocationInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html).
///
/// # Errors
/// [`Error::InvalidGranularity`] before the driver; `Error::DriverTooOld` on a driver older
/// than 13.4; the driver's refusal.
pub fn location_info(
    ptr: sys::CUdeviceptr,
    size: usize,
    summary_granularity: usize,
    sampling_granularity: usize,
) -> Result<Vec<Location>> {
    let regions = region_count(size, summary_granularity, sampling_granularity)?;
    if regions == 0 {
        return Ok(Vec::new());
    }
    // Whole unions, so every entry can be read whatever the driver leaves in it.
    let mut raw = vec![raw_location(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_NONE, 0); regions];
    // SAFETY: `raw` holds the ceil(size / summary) entries the driver writes; the driver only
    // reads the page tables of the range.
    unsafe {
        driver_call!(cuMemGetLocationInfo(ptr, size, summary_granularity, sampling_granularity, raw.as_mut_ptr()))
    }?;
    // SAFETY: every entry was initialised whole above, and the driver writes whole entries.
    Ok(raw.iter().map(|entry| unsafe { Location::from_raw(entry) }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_follow_the_granularity_rules_of_cuda_h() {
        // cuda.h's example: 1 GiB in 128 MiB regions sampled every 2 MiB is 8 regions.
        assert_eq!(region_count(1 << 30, 128 << 20, 2 << 20).unwrap(), 8);
        assert_eq!(region_count(1000, 300, 0).unwrap(), 4, "ceil(size / summary), sampling 0 is the system's");
        assert_eq!(region_count(4096, 4096, 4096).unwrap(), 1);
        assert_eq!(region_count(0, 4096, 0).unwrap(), 0, "an empty range has no regions");
        let reason = |size, summary, sampling| match region_count(size, summary, sampling) {
            Err(Error::InvalidGranularity { reason, .. }) => reason,
            other => panic!("expected InvalidGranularity, got {other:?}"),
        };
        assert!(reason(4096, 0, 0).contains("more than 0"));
        assert!(reason(4096, 8192, 0).contains("at most the size"));
        assert!(reason(4096, 1024, 2048).contains("at most the summary"));
        let text = region_count(4096, 1024, 2048).unwrap_err().to_string();
        assert!(text.contains("4096 bytes") && text.contains("1024") && text.contains("2048"), "{text}");
    }
}
