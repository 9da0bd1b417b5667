//! A driver library older than CUDA 12.0 is named as such, with its version, not as "not a
//! driver": the stand-in of `cumempool_tests::stand_in_driver`, built as a CUDA 11.8 driver.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool_sys::{Driver, DriverVersion, LoadError};

#[cfg(target_os = "linux")]
#[test]
fn a_cuda_11_driver_is_too_old_not_a_stranger() {
    let Some(library) = cumempool_tests::stand_in_driver::compiled(11080) else { return };
    // SAFETY: the stand-in implements the two functions the loader calls before it refuses.
    let result = unsafe { Driver::open(library.to_str().unwrap()) };
    match result {
        Err(error @ LoadError::DriverTooOld { needs: DriverVersion(12000), found: DriverVersion(11080), .. }) => {
            let text = error.to_string();
            assert!(text.contains("12.0") && text.contains("11.8"), "{text}");
        }
        other => panic!("expected DriverTooOld for an 11.8 driver, got {other:?}"),
    }
}
