//! The process's driver: loaded and initialised once, and its version.

pub(crate) mod handle;

use crate::error::{DriverError, Error, Result};
use cumempool_sys as sys;
use cumempool_sys::DriverVersion;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Once, OnceLock};

#[derive(Clone, Debug)]
enum InitFailure {
    Load(sys::LoadError),
    Init(sys::CUresult),
}

static API: OnceLock<Result<&'static sys::Driver, InitFailure>> = OnceLock::new();

/// Set in a child process forked after this crate started using the driver: CUDA does not
/// survive fork, so every later call answers [`Error::ForkedChild`] instead of reaching libcuda.
static FORKED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn mark_forked_child() {
    FORKED.store(true, Relaxed);
}

fn watch_for_fork() {
    #[cfg(unix)]
    {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
            let code = unsafe { libc::pthread_atfork(None, None, Some(mark_forked_child)) };
            if code != 0 {
                tracing::warn!(code, "pthread_atfork failed: CUDA use in forked children will not be detected");
            }
        });
    }
}

/// The loaded and initialised driver: two atomic loads once warm.
#[inline]
pub(crate) fn api() -> Result<&'static sys::Driver> {
    if FORKED.load(Relaxed) {
        return Err(Error::ForkedChild);
    }
    match API.get_or_init(load_and_init) {
        Ok(driver) => Ok(driver),
        Err(failure) => Err(failure_error(failure)),
    }
}

#[cold]
fn failure_error(failure: &InitFailure) -> Error {
    match failure {
        InitFailure::Load(e) => Error::Load(e.clone()),
        InitFailure::Init(code) => Error::driver(*code, "cuInit"),
    }
}

fn load_and_init() -> Result<&'static sys::Driver, InitFailure> {
    watch_for_fork();
    let driver = sys::driver().map_err(InitFailure::Load)?;
    let init = driver.cuInit().map_err(InitFailure::Load)?;
    // SAFETY: flags must be 0.
    let code = unsafe { init(0) };
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(InitFailure::Init(code));
    }
    tracing::debug!(library = driver.library_path(), version = %driver.version(), "CUDA driver initialised");
    Ok(driver)
}

/// Why an entry point is missing, as this crate's error: one newer than the running driver is
/// [`Error::DriverTooOld`] naming the function and both versions, like a newer attribute.
#[cold]
pub(crate) fn entry_point_error(error: sys::LoadError) -> Error {
    match error {
        sys::LoadError::DriverTooOld { function, needs, found } => {
            Error::DriverTooOld { feature: function, needs, found }
        }
        other => Error::Load(other),
    }
}

/// What a driver entry point answered, with the function's name, so an error names the call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Answer {
    pub(crate) code: sys::CUresult,
    pub(crate) function: &'static str,
}

impl Answer {
    /// `Ok` for `CUDA_SUCCESS`, else [`Error::Driver`] naming the function.
    #[inline]
    pub(crate) fn check(self) -> Result<()> {
        if self.code == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error())
        }
    }

    /// The driver's answer as an error's cause.
    #[cold]
    pub(crate) fn cause(self) -> DriverError {
        DriverError::new(self.function, self.code)
    }

    /// The error for this answer (whatever it is).
    #[cold]
    pub(crate) fn error(self) -> Error {
        Error::Driver(self.cause())
    }
}

/// The one path to the driver: resolves `cuX`, calls it with the arguments, and answers an
/// [`Answer`] naming the function, without judging the code. Use inside `unsafe`, with the
/// call's `// SAFETY:` reasoning.
macro_rules! driver_answer {
    ($name:ident($($arg:expr),* $(,)?)) => {
        match $crate::driver::api().and_then(|driver| driver.$name().map_err($crate::driver::entry_point_error)) {
            Ok(function) => Ok($crate::driver::Answer { code: function($($arg),*), function: stringify!($name) }),
            Err(error) => Err(error),
        }
    };
}

/// [`driver_answer!`], with any code but `CUDA_SUCCESS` turned into [`Error::Driver`].
macro_rules! driver_call {
    ($name:ident($($arg:expr),* $(,)?)) => {
        $crate::driver::driver_answer!($name($($arg),*)).and_then($crate::driver::Answer::check)
    };
}

pub(crate) use {driver_answer, driver_call};

/// Loads and initialises the driver (`cuInit`), once per process.
///
/// Every other call does this on first use; call it to learn early whether a driver is there.
///
/// # Errors
/// [`Error::Load`] naming the library tried and what is missing; the driver's refusal of
/// `cuInit`; [`Error::ForkedChild`] in a child forked after the parent used CUDA.
///
/// See [cuInit](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__INITIALIZE.html).
pub fn init() -> Result<()> {
    api().map(|_| ())
}

/// The running driver's version.
///
/// See [cuDriverGetVersion](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VERSION.html).
pub fn driver_version() -> Result<DriverVersion> {
    Ok(api()?.version())
}

/// The driver library that was opened (`cumempool_sys::library_to_open` is the one that will be).
pub fn library_path() -> Result<&'static str> {
    Ok(api()?.library_path())
}

/// The CUDA version the crate's declarations were built for (the newest `cuda-130x0` feature:
/// `cuda-13050` is 13.5).
pub fn bindings_version() -> DriverVersion {
    sys::BINDINGS_VERSION
}

/// Fails with [`Error::DriverTooOld`] unless the driver is at least `needs`.
pub(crate) fn require(feature: &'static str, needs: DriverVersion) -> Result<()> {
    let found = api()?.version();
    if found < needs {
        return Err(Error::DriverTooOld { feature, needs, found });
    }
    Ok(())
}
