//! The sys layer against the real driver: loading, version, every entry point, and typed
//! refusals for versions the driver lacks.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool_sys as sys;

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_real_driver_loads_and_resolves_every_entry_point_it_is_new_enough_for() {
    cumempool_tests::gpu().expect("a GPU");
    let driver = sys::driver().expect("the driver loads");
    let version = driver.version();
    eprintln!("driver CUDA {version} from {}", driver.library_path());
    assert!(version >= sys::DriverVersion::CUDA_13_0, "the GPU machine runs CUDA 13.0 or newer, found {version}");
    let mut resolved = 0;
    for entry in sys::ENTRY_POINTS.iter().filter(|e| e.since <= version.0) {
        assert!(
            driver
                .resolve_raw(&std::ffi::CString::new(entry.name).unwrap(), sys::BINDINGS_VERSION.min(version))
                .is_ok(),
            "{} did not resolve",
            entry.name
        );
        resolved += 1;
    }
    // The table itself: every accessor hands out a pointer.
    assert!(
        driver.cuMemGetMemPool().is_ok() && driver.cuMemSetMemPool().is_ok() && driver.cuMemGetDefaultMemPool().is_ok()
    );
    assert!(driver.cuMemAllocFromPoolAsync().is_ok() && driver.cuCtxGetDevice().is_ok());
    eprintln!("resolved {resolved} of {} entry points", sys::ENTRY_POINTS.len());
    // Only 13.4's cuMemGetLocationInfo is newer than 13.0; on an older driver it is refused by name.
    let newer: Vec<_> = sys::ENTRY_POINTS.iter().filter(|e| e.since > version.0).map(|e| e.name).collect();
    assert!(newer.iter().all(|name| *name == "cuMemGetLocationInfo"), "newer than driver {version}: {newer:?}");
    assert_eq!(resolved + newer.len(), sys::ENTRY_POINTS.len());
    #[cfg(feature = "cuda-13040")]
    match driver.cuMemGetLocationInfo() {
        Ok(_) => assert!(version >= sys::DriverVersion::CUDA_13_4, "resolved on driver {version}"),
        Err(error @ sys::LoadError::DriverTooOld { function: "cuMemGetLocationInfo", needs, found }) => {
            assert_eq!((needs, found), (sys::DriverVersion::CUDA_13_4, version));
            eprintln!("{error}");
        }
        Err(other) => panic!("cuMemGetLocationInfo on driver {version}: {other:?}"),
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn asking_for_a_version_the_driver_lacks_is_a_typed_error() {
    cumempool_tests::gpu().expect("a GPU");
    let driver = sys::driver().expect("the driver loads");
    // cuMemGetMemPool is new in 13.0: asked at 12.0 the driver says VERSION_NOT_SUFFICIENT.
    let error = driver.resolve_raw(c"cuMemGetMemPool", sys::DriverVersion::CUDA_12_0).expect_err("not in 12.0");
    assert!(
        matches!(error, sys::LoadError::VersionNotSufficient { requested: sys::DriverVersion::CUDA_12_0, .. }),
        "{error:?}"
    );
    eprintln!("cuMemGetMemPool at 12.0: {error}");
    if driver.version() < sys::DriverVersion::CUDA_13_2 {
        // A 13.0 driver refuses every request made for 13.2, even for old functions.
        let error =
            driver.resolve_raw(c"cuMemAllocAsync", sys::DriverVersion::CUDA_13_2).expect_err("above the driver");
        assert!(
            matches!(error, sys::LoadError::ResolveFailed { requested: sys::DriverVersion::CUDA_13_2, code: 1, .. }),
            "{error:?}"
        );
        let text = error.to_string();
        assert!(text.contains("13.2") && text.contains("13.0"), "{text}");
        eprintln!("cuMemAllocAsync at 13.2: {text}");
    }
    let error = driver.resolve_raw(c"cuNoSuchFunction", sys::DriverVersion::CUDA_13_0).expect_err("no such function");
    assert!(matches!(error, sys::LoadError::EntryPointNotFound { .. }), "{error:?}");
}

#[test]
fn without_a_library_loading_fails_cleanly() {
    // SAFETY: nothing is opened: the file does not exist.
    let error = unsafe { sys::Driver::open("/no/such/libcuda.so.1") }.expect_err("no library there");
    assert!(std::error::Error::source(&error).is_some(), "the system loader's error is kept as the cause");
    let text = error.to_string();
    assert!(text.contains("/no/such/libcuda.so.1") && text.contains(sys::LIBCUDA_ENV), "{text}");
}
