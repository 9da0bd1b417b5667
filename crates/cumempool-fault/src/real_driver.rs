//! The real libcuda behind the wrappers: opened once, from [`REAL_LIBCUDA_ENV`] or the default.

use cumempool_sys::{PFN_cuDriverGetVersion, PFN_cuGetProcAddress, PFN_cuInit};
use std::sync::OnceLock;

/// The environment variable naming the real driver library (default `libcuda.so.1`).
pub(crate) const REAL_LIBCUDA_ENV: &str = "CUMEMPOOL_FAULT_REAL_LIBCUDA";

/// The three functions the loader takes by symbol; everything else comes through
/// `get_proc_address`.
pub(crate) struct RealDriver {
    pub(crate) get_version: PFN_cuDriverGetVersion,
    pub(crate) init: PFN_cuInit,
    pub(crate) get_proc_address: PFN_cuGetProcAddress,
}

/// The real driver, or why it could not be opened (said once on stderr). `this_library` is this
/// library's own `cuGetProcAddress_v2`, refused as the real one; the crate root, which defines
/// it, passes it, so this module stays below the exports that call it.
pub(crate) fn real_driver(this_library: *const ()) -> Option<&'static RealDriver> {
    static REAL: OnceLock<Option<RealDriver>> = OnceLock::new();
    REAL.get_or_init(|| match open(this_library) {
        Ok(real) => Some(real),
        Err(reason) => {
            eprintln!("cumempool-fault: {reason}");
            None
        }
    })
    .as_ref()
}

fn open(this_library: *const ()) -> Result<RealDriver, String> {
    let path = std::env::var(REAL_LIBCUDA_ENV).ok().filter(|p| !p.is_empty());
    let path = path.as_deref().unwrap_or(cumempool_sys::DEFAULT_LIBRARY);
    // SAFETY: opening libcuda runs its initialisers, which is what loading a driver means. The
    // library is never closed: the wrappers call into it for the rest of the process.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
        // libloading says only "dlopen failed" and keeps dlerror's text as the source.
        let reason = std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
        format!("cannot open the real driver {path} (set {REAL_LIBCUDA_ENV}): {reason}")
    })?;
    let library: &'static libloading::Library = Box::leak(Box::new(library));
    // SAFETY: these symbols have had these signatures since CUDA 2.0 (cuGetProcAddress_v2: 12.0).
    let real = unsafe {
        RealDriver {
            get_version: symbol(library, path, b"cuDriverGetVersion")?,
            init: symbol(library, path, b"cuInit")?,
            get_proc_address: symbol(library, path, b"cuGetProcAddress_v2")?,
        }
    };
    if real.get_proc_address as *const () == this_library {
        return Err(format!("{REAL_LIBCUDA_ENV}={path} names this fault library, not the real driver"));
    }
    Ok(real)
}

/// # Safety
/// `T` must be the function-pointer type of `name`.
unsafe fn symbol<T: Copy>(library: &'static libloading::Library, path: &str, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller names the symbol's type.
    unsafe { library.get::<T>(name) }
        .map(|s| *s)
        .map_err(|_| format!("{path} does not export {}: not a CUDA driver", String::from_utf8_lossy(name)))
}
