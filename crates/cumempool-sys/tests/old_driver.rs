//! A driver library older than CUDA 12.0 is named as such, with its version, not as "not a
//! driver". A stand-in library is compiled from C where a C compiler is present (CI has one).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool_sys::{Driver, DriverVersion, LoadError};

const CUDA_11_8_DRIVER: &str = r#"
int cuDriverGetVersion(int *version) { *version = 11080; return 0; }
int cuInit(unsigned int flags) { (void)flags; return 0; }
"#;

#[cfg(target_os = "linux")]
#[test]
fn a_cuda_11_driver_is_too_old_not_a_stranger() {
    let dir = std::env::temp_dir().join(format!("cumempool-old-driver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (source, library) = (dir.join("libcuda.c"), dir.join("libcuda.so.1"));
    std::fs::write(&source, CUDA_11_8_DRIVER).unwrap();
    let compiled =
        std::process::Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&library).arg(&source).status();
    match compiled {
        Ok(status) if status.success() => {}
        Ok(status) => panic!("cc failed: {status}"),
        Err(error) => {
            eprintln!("skipped: no C compiler here ({error})");
            return;
        }
    }
    // SAFETY: the stand-in implements the two functions the loader calls before it refuses.
    let result = unsafe { Driver::open(library.to_str().unwrap()) };
    let _ = std::fs::remove_dir_all(&dir);
    match result {
        Err(error @ LoadError::DriverTooOld { needs: DriverVersion(12000), found: DriverVersion(11080), .. }) => {
            let text = error.to_string();
            assert!(text.contains("12.0") && text.contains("11.8"), "{text}");
        }
        other => panic!("expected DriverTooOld for an 11.8 driver, got {other:?}"),
    }
}
