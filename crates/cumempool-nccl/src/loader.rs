//! Opening libnccl at run time and resolving its functions by name.
//!
//! Nothing is linked at build time. The library is searched for on first use: the path in
//! [`LIBNCCL_ENV`], then `libnccl.so.2` through the system loader, then the `nvidia-nccl-cu13`
//! (or `-cu12`) wheel's `nvidia/nccl/lib/libnccl.so.2` in python3's site-packages. Its version
//! comes from `ncclGetVersion`; a function newer than it fails only the call that needs it.

use crate::bindings::{ncclResult_t, PFN_ncclGetVersion};
use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::OnceLock;

/// The environment variable that names the NCCL library to open instead of searching.
pub const LIBNCCL_ENV: &str = "CUMEMPOOL_LIBNCCL";

/// The library name the system loader is asked for.
pub const DEFAULT_LIBRARY: &str = "libnccl.so.2";

/// An NCCL version as `NCCL_VERSION_CODE` writes it: `2.28.9` is 22809 (2.8 and older:
/// `X*1000 + Y*100 + Z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion(pub i32);

impl NcclVersion {
    /// The version of the headers these bindings were generated from.
    pub const BINDINGS: Self = Self(crate::bindings::NCCL_VERSION_CODE as i32);

    /// (major, minor, patch).
    pub fn parts(self) -> (i32, i32, i32) {
        let code = self.0;
        if code < 10000 {
            (code / 1000, (code % 1000) / 100, code % 100)
        } else {
            (code / 10000, (code % 10000) / 100, code % 100)
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor, patch) = self.parts();
        write!(f, "{major}.{minor}.{patch}")
    }
}

/// Why NCCL, or one of its functions, is not available.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No NCCL library was found; each place tried, with what went wrong there.
    #[error("NCCL was not found; tried {}. Install it (`pip install nvidia-nccl-cu13`, or the system's libnccl2) or set {LIBNCCL_ENV} to the path of libnccl.so.2", .tried.join("; "))]
    LibraryNotFound {
        /// `place: reason` for each attempt, in order.
        tried: Vec<String>,
    },
    /// The library opened but lacks `ncclGetVersion`: it is not NCCL.
    #[error("{path} is not NCCL: it has no ncclGetVersion")]
    NotNccl {
        /// The file opened.
        path: String,
    },
    /// `ncclGetVersion` failed.
    #[error("ncclGetVersion failed with code {code}")]
    VersionQueryFailed {
        /// The `ncclResult_t`.
        code: u32,
    },
    /// A function newer than the loaded NCCL.
    #[error("{function} needs NCCL {needs} or newer; the loaded NCCL is {found}")]
    NcclTooOld {
        /// The function.
        function: &'static str,
        /// The release that added it.
        needs: NcclVersion,
        /// The loaded release.
        found: NcclVersion,
    },
    /// The loaded NCCL is new enough but does not export the function.
    #[error("the loaded NCCL {version} does not export {function}")]
    SymbolMissing {
        /// The function.
        function: &'static str,
        /// The loaded release.
        version: NcclVersion,
    },
}

/// The loaded NCCL: its library, path, version and functions.
pub struct Nccl {
    // Kept open for the process: the function pointers point into it.
    _library: libloading::Library,
    path: String,
    version: NcclVersion,
    entry_points: EntryPoints,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

impl std::ops::Deref for Nccl {
    type Target = EntryPoints;
    fn deref(&self) -> &EntryPoints {
        &self.entry_points
    }
}

impl Nccl {
    /// The file that was opened (or the name the system loader resolved).
    pub fn library_path(&self) -> &str {
        &self.path
    }

    /// The loaded NCCL's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }
}

static NCCL: OnceLock<Result<Nccl, LoadError>> = OnceLock::new();

/// The process's NCCL, loaded on first use.
pub fn nccl() -> Result<&'static Nccl, LoadError> {
    NCCL.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Where NCCL is looked for, in order.
pub fn candidates() -> Vec<String> {
    if let Ok(path) = std::env::var(LIBNCCL_ENV) {
        return vec![path];
    }
    let mut places = vec![DEFAULT_LIBRARY.to_owned()];
    places.extend(wheel_libraries().into_iter().map(|p| p.to_string_lossy().into_owned()));
    places
}

/// `nvidia/nccl/lib/libnccl.so.2` under each of python3's site-packages folders that has it.
fn wheel_libraries() -> Vec<PathBuf> {
    let script =
        "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))";
    let Ok(output) = std::process::Command::new("python3").args(["-c", script]).output() else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = Vec::new();
    for folder in String::from_utf8_lossy(&output.stdout).lines() {
        let library = PathBuf::from(folder).join("nvidia/nccl/lib").join(DEFAULT_LIBRARY);
        if library.is_file() && !found.contains(&library) {
            found.push(library);
        }
    }
    found
}

fn load() -> Result<Nccl, LoadError> {
    load_from(&candidates(), std::env::var(LIBNCCL_ENV).is_ok())
}

/// Opens the first of `places` that opens; `from_env` when they came from [`LIBNCCL_ENV`].
fn load_from(places: &[String], from_env: bool) -> Result<Nccl, LoadError> {
    let mut tried = Vec::new();
    for place in places {
        // SAFETY: opening NCCL runs its initialisers, which only set up its own state.
        match unsafe { libloading::Library::new(place) } {
            Ok(library) => return open(library, place.clone()),
            Err(error) => {
                let reason = std::error::Error::source(&error).map_or_else(|| error.to_string(), ToString::to_string);
                let label = if from_env { format!("{place} (from {LIBNCCL_ENV})") } else { place.clone() };
                tried.push(format!("{label}: {reason}"));
            }
        }
    }
    if !from_env && places.len() <= 1 {
        tried.push("python3's site-packages: no nvidia/nccl/lib/libnccl.so.2 (or no python3)".to_owned());
    }
    Err(LoadError::LibraryNotFound { tried })
}

fn open(library: libloading::Library, path: String) -> Result<Nccl, LoadError> {
    let lookup = |name: &CStr| -> Option<NonNull<c_void>> {
        // SAFETY: only the address is taken; it is typed by the generated declarations.
        let symbol = unsafe { library.get::<*mut c_void>(name.to_bytes_with_nul()) }.ok()?;
        NonNull::new(*symbol)
    };
    let get_version = lookup(c"ncclGetVersion").ok_or_else(|| LoadError::NotNccl { path: path.clone() })?;
    // SAFETY: ncclGetVersion has this signature in every NCCL 2.
    let get_version = unsafe { std::mem::transmute::<*mut c_void, PFN_ncclGetVersion>(get_version.as_ptr()) };
    let mut code: c_int = 0;
    // SAFETY: a valid out-pointer.
    let result = unsafe { get_version(&mut code) };
    if result != ncclResult_t::ncclSuccess {
        return Err(LoadError::VersionQueryFailed { code: result.0 });
    }
    let version = NcclVersion(code);
    let entry_points = EntryPoints::resolve(version.0, lookup);
    tracing::debug!(library = path, %version, "NCCL loaded");
    Ok(Nccl { _library: library, path, version, entry_points })
}

/// The error for a function that did not resolve; `found` is the loaded NCCL's version.
#[cold]
pub(crate) fn missing(function: &'static str, since: i32, found: i32) -> LoadError {
    let (needs, found) = (NcclVersion(since), NcclVersion(found));
    if found < needs {
        LoadError::NcclTooOld { function, needs, found }
    } else {
        LoadError::SymbolMissing { function, version: found }
    }
}

/// Puts the bindings' list of functions (`for_each_entry_point!`) into libnccl's table,
/// [`EntryPoints`] and [`ENTRY_POINTS`]: each function resolved once by name, when the loaded
/// NCCL is at least the release that added it.
macro_rules! entry_points {
    ($($rows:tt)*) => {
        cumempool::sys::entry_point_table! {
            /// Every NCCL function the bindings declare, each resolved once by symbol name.
            pub struct EntryPoints {
                missing: missing,
                error: LoadError,
                provider: "the loaded NCCL",
            }
            /// Every function of the bindings with the NCCL release that added it.
            pub const ENTRY_POINTS: &[(&str, i32)] = |name, since| (name, since);
            $($rows)*
        }
    };
}
crate::bindings::for_each_entry_point!(entry_points);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_releases() {
        assert_eq!(NcclVersion(22809).to_string(), "2.28.9");
        assert_eq!(NcclVersion(2406).to_string(), "2.4.6");
        assert_eq!(NcclVersion::BINDINGS.to_string(), "2.30.7");
        assert!(NcclVersion(22809) < NcclVersion(23007));
    }

    #[test]
    fn a_missing_library_names_every_place_tried_and_a_foreign_one_is_not_nccl() {
        let missing = load_from(&["/nonexistent/libnccl.so.2".to_owned()], true).unwrap_err().to_string();
        assert!(missing.contains("/nonexistent/libnccl.so.2 (from CUMEMPOOL_LIBNCCL)"), "{missing}");
        assert!(missing.contains("pip install nvidia-nccl-cu13"), "says how to get it: {missing}");
        let searched = load_from(&[DEFAULT_LIBRARY.to_owned()], false);
        if let Err(LoadError::LibraryNotFound { tried }) = searched {
            assert!(tried.iter().any(|t| t.contains("site-packages")), "{tried:?}");
        }
        let libc = load_from(&["libc.so.6".to_owned()], true).unwrap_err();
        assert_eq!(libc, LoadError::NotNccl { path: "libc.so.6".into() });
    }

    #[test]
    fn a_function_newer_than_the_library_names_both_versions() {
        let error = missing("ncclCommWindowRegister", 22700, 22605);
        assert_eq!(error.to_string(), "ncclCommWindowRegister needs NCCL 2.27.0 or newer; the loaded NCCL is 2.26.5");
        assert!(matches!(missing("ncclSend", 2700, 22809), LoadError::SymbolMissing { .. }));
    }
}
