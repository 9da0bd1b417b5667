//! Opening libcuda at run time and resolving its entry points.
//!
//! Nothing is linked at build time. The library is opened on first use, `cuDriverGetVersion`
//! and `cuGetProcAddress` are taken from it by symbol name, and every other entry point is asked
//! of `cuGetProcAddress` once, with a CUDA version no higher than the running driver's: a 13.0
//! driver refuses requests made for 13.2, even for old functions.

use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use crate::version::DriverVersion;

use crate::bindings::{
    CUdriverProcAddressQueryResult, CUresult, PFN_cuDriverGetVersion, PFN_cuGetProcAddress, PFN_cuInit, CUDA_VERSION,
};

/// The environment variable that names the driver library to open instead of the default.
pub const LIBCUDA_ENV: &str = "CUMEMPOOL_LIBCUDA";

/// The driver library opened when [`LIBCUDA_ENV`] is not set.
#[cfg(windows)]
pub const DEFAULT_LIBRARY: &str = "nvcuda.dll";
/// The driver library opened when [`LIBCUDA_ENV`] is not set.
#[cfg(not(windows))]
pub const DEFAULT_LIBRARY: &str = "libcuda.so.1";

/// The CUDA version the compiled-in declarations come from (13.0, 13.2, 13.4 or 13.5: the
/// newest `cuda-130x0` feature enabled).
pub const BINDINGS_VERSION: DriverVersion = DriverVersion(CUDA_VERSION as i32);

/// Why the driver, or one of its entry points, is not available.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum LoadError {
    /// The driver library could not be opened.
    LibraryNotFound {
        /// The file that was tried.
        path: String,
        /// What the system loader said (the error's [`source`](std::error::Error::source)).
        source: Arc<libloading::Error>,
        /// What is wrong with the file at `path` when it exists but is no loadable library (a
        /// directory, a device such as `/dev/null`, a text file); `None` when there is no such
        /// file or the path is a bare library name for the system loader to search.
        problem: Option<String>,
    },
    /// The library opened but lacks a symbol every CUDA driver exports: it is not libcuda.
    NotADriver {
        /// The file that was opened.
        path: String,
        /// The symbol it lacks.
        symbol: &'static str,
    },
    /// `cuDriverGetVersion` failed.
    VersionQueryFailed {
        /// The `CUresult` it returned.
        code: u32,
    },
    /// The running driver is older than the ABI these bindings declare for a function.
    DriverTooOld {
        /// The function's base name.
        function: &'static str,
        /// The CUDA version whose ABI the bindings declare.
        needs: DriverVersion,
        /// The running driver's version.
        found: DriverVersion,
    },
    /// The driver is new enough but did not hand out the function.
    EntryPointNotFound {
        /// The function's base name.
        function: String,
        /// The running driver's version.
        driver: DriverVersion,
    },
    /// The driver has `function`, but not at the version asked for
    /// (`CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`).
    VersionNotSufficient {
        /// The function's base name.
        function: String,
        /// The CUDA version asked for.
        requested: DriverVersion,
        /// The running driver's version.
        driver: DriverVersion,
    },
    /// `cuGetProcAddress` itself failed for `function` at `requested`.
    ResolveFailed {
        /// The function's base name.
        function: String,
        /// The CUDA version asked for.
        requested: DriverVersion,
        /// The running driver's version.
        driver: DriverVersion,
        /// The `CUresult`.
        code: u32,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LibraryNotFound { path, source, problem } => {
                // libloading 0.9 says only "dlopen failed" and keeps dlerror's text as its source.
                let reason = std::error::Error::source(&**source).map_or_else(|| source.to_string(), ToString::to_string);
                let named_by_env = std::env::var(LIBCUDA_ENV).is_ok_and(|p| p == *path);
                match (problem, named_by_env) {
                    (Some(problem), true) => write!(
                        f,
                        "{LIBCUDA_ENV} names {path}, which {problem}; set it to the path of the driver library (libcuda.so.1), or unset it to use the system's"
                    ),
                    (Some(problem), false) => {
                        write!(f, "could not open {path} as the CUDA driver: it {problem} ({reason})")
                    }
                    (None, true) => write!(
                        f,
                        "{LIBCUDA_ENV} names {path}, which could not be opened ({reason}); set it to the path of the driver library (libcuda.so.1), or unset it to use the system's"
                    ),
                    (None, false) => write!(
                        f,
                        "no CUDA driver: could not open {path} ({reason}); install the NVIDIA driver, or set {LIBCUDA_ENV} to the path of libcuda"
                    ),
                }
            }
            Self::NotADriver { path, symbol } => {
                write!(f, "{path} is not a CUDA driver library: it does not export {symbol}")
            }
            Self::VersionQueryFailed { code } => write!(f, "cuDriverGetVersion failed with CUresult {code}"),
            Self::DriverTooOld { function, needs, found } => {
                write!(f, "{function} needs a CUDA {needs} driver or newer; the running driver is CUDA {found}")
            }
            Self::EntryPointNotFound { function, driver } => {
                write!(f, "the CUDA {driver} driver does not provide {function}")
            }
            Self::VersionNotSufficient { function, requested, driver } => write!(
                f,
                "the CUDA {driver} driver does not offer {function} at CUDA {requested}: the function is newer than that version"
            ),
            Self::ResolveFailed { function, requested, driver, code } => write!(
                f,
                "cuGetProcAddress refused {function} at CUDA {requested} (code {code}); the running driver is CUDA {driver}, ask for a version no higher than that"
            ),
        }
    }
}

impl std::error::Error for LoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::LibraryNotFound { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

/// What is wrong with an existing file that the system loader refused, in words that complete
/// "the file ...". `None` for a path that does not exist (or a bare name the loader searches).
fn file_problem(path: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let metadata = std::fs::metadata(path).ok()?;
    if metadata.is_dir() {
        return Some("is a directory".to_owned());
    }
    if !metadata.is_file() {
        return Some("is not a regular file (a device, socket or pipe, such as /dev/null)".to_owned());
    }
    if metadata.len() == 0 {
        return Some("is empty".to_owned());
    }
    let mut magic = [0u8; 4];
    let read = std::fs::File::open(path).and_then(|mut file| file.read_exact(&mut magic));
    match read {
        Err(error) => Some(format!("cannot be read ({error})")),
        Ok(()) if magic != *b"\x7fELF" && cfg!(unix) => {
            Some("is not a shared library (it does not start with the ELF header; a text file or a script?)".to_owned())
        }
        Ok(()) => {
            Some("is a file the system loader refused (another architecture, or a missing dependency)".to_owned())
        }
    }
}

/// One entry point of the bindings: its base name and the driver version its ABI needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The base name, as `cuGetProcAddress` takes it (`cuMemcpyHtoDAsync`, not `_v2`).
    pub name: &'static str,
    /// The CUDA version that introduced the declared ABI (`11020` for 11.2).
    pub since: i32,
}

/// The opened driver library and its resolved entry points.
///
/// The function pointers it hands out point into the library, which stays open for as long as
/// the `Driver` lives: a pointer copied out must not be called after its `Driver` is dropped.
/// The process-wide [`driver`] is never dropped.
///
/// Dereferences to [`EntryPoints`], whose methods hand out each function pointer or the reason
/// it is missing: `driver()?.cuMemAllocAsync()?`.
pub struct Driver {
    path: String,
    version: DriverVersion,
    get_proc_address: PFN_cuGetProcAddress,
    entry_points: EntryPoints,
    // Last: the function pointers above point into it, so it must outlive them.
    _library: libloading::Library,
}

impl fmt::Debug for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

static DRIVER: OnceLock<Result<Driver, LoadError>> = OnceLock::new();

/// The process's driver, opened and resolved on first use.
///
/// Opens [`library_to_open`]: [`LIBCUDA_ENV`] if set, else [`DEFAULT_LIBRARY`]. The outcome,
/// success or failure, is kept for the life of the process. Does not call `cuInit`.
///
/// Naming a library through [`LIBCUDA_ENV`] is the same promise as [`Driver::open`]'s: the
/// environment of the process is trusted to name a CUDA driver (or a library of its ABI).
pub fn driver() -> Result<&'static Driver, LoadError> {
    DRIVER.get_or_init(Driver::load).as_ref().map_err(Clone::clone)
}

/// The running driver's CUDA version: a cheap probe for whether a driver is there.
pub fn driver_version() -> Result<DriverVersion, LoadError> {
    driver().map(Driver::version)
}

/// The path [`driver`] opens (or opened): [`LIBCUDA_ENV`] if set, else [`DEFAULT_LIBRARY`].
/// [`Driver::library_path`] is the one that was opened.
pub fn library_to_open() -> String {
    std::env::var(LIBCUDA_ENV).ok().filter(|p| !p.is_empty()).unwrap_or_else(|| DEFAULT_LIBRARY.to_owned())
}

impl Driver {
    fn load() -> Result<Self, LoadError> {
        // SAFETY: the process's environment names the driver (see `driver`), or the system's
        // libcuda is opened.
        unsafe { Self::open(&library_to_open()) }
    }

    /// Opens the driver library at `path` and resolves every entry point of the bindings.
    ///
    /// Most programs use [`driver`], which does this once for the process.
    ///
    /// # Errors
    /// A [`LoadError`] naming what is missing: the library, a symbol every driver exports, or a
    /// driver new enough for the loader (CUDA 12.0).
    ///
    /// # Safety
    /// Opening a library runs its initialisers, and every later call goes into it with the
    /// signatures cuda.h declares: `path` must name a CUDA driver library, or a library that
    /// implements the same ABI (such as a fault-injecting stand-in).
    pub unsafe fn open(path: &str) -> Result<Self, LoadError> {
        // SAFETY: the caller vouches that `path` is a driver; the library is kept open for as long
        // as any pointer resolved from it is reachable.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| LoadError::LibraryNotFound {
            path: path.to_owned(),
            source: Arc::new(e),
            problem: file_problem(std::path::Path::new(path)),
        })?;
        // SAFETY: these symbols have had these signatures since CUDA 2.0.
        let (get_version, init) = unsafe {
            (
                bootstrap::<PFN_cuDriverGetVersion>(&library, path, "cuDriverGetVersion")?,
                bootstrap::<PFN_cuInit>(&library, path, "cuInit")?,
            )
        };
        let mut raw_version: c_int = 0;
        // SAFETY: a valid out-pointer.
        let code = unsafe { get_version(&mut raw_version) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(LoadError::VersionQueryFailed { code: code.0 });
        }
        let version = DriverVersion(raw_version);
        // SAFETY: `cuGetProcAddress_v2` has had this signature since CUDA 12.0.
        let get_proc_address = match unsafe { bootstrap::<PFN_cuGetProcAddress>(&library, path, "cuGetProcAddress_v2") }
        {
            Ok(function) => function,
            // A driver that knows its version is a driver, just an old one.
            Err(_) if version < DriverVersion::CUDA_12_0 => {
                return Err(LoadError::DriverTooOld {
                    function: "cuGetProcAddress_v2",
                    needs: DriverVersion::CUDA_12_0,
                    found: version,
                })
            }
            Err(error) => return Err(error),
        };
        let request = BINDINGS_VERSION.min(version).0;
        let lookup = |name: &CStr| -> Option<NonNull<c_void>> { resolve(get_proc_address, name, request).ok() };
        // Some drivers only hand out entry points after cuInit; initialising is harmless then.
        if lookup(c"cuDriverGetVersion").is_none() {
            // SAFETY: cuInit takes flags, which must be 0.
            let _ = unsafe { init(0) };
        }
        let entry_points = EntryPoints::resolve(version.0, lookup);
        Ok(Self { path: path.to_owned(), version, get_proc_address, entry_points, _library: library })
    }

    /// The library file this driver was opened from.
    pub fn library_path(&self) -> &str {
        &self.path
    }

    /// The running driver's CUDA version, from `cuDriverGetVersion`.
    pub fn version(&self) -> DriverVersion {
        self.version
    }

    /// The resolved entry points.
    pub fn entry_points(&self) -> &EntryPoints {
        &self.entry_points
    }

    /// Asks `cuGetProcAddress` for `name` at `cuda_version`, bypassing the resolved table.
    ///
    /// For probing what a driver offers; the result is a raw pointer whose signature is that of
    /// the function at the version asked, which may differ from the bindings' declaration.
    pub fn resolve_raw(&self, name: &CStr, cuda_version: DriverVersion) -> Result<NonNull<c_void>, LoadError> {
        resolve(self.get_proc_address, name, cuda_version.0).map_err(|failure| {
            let function = name.to_string_lossy().into_owned();
            let driver = self.version;
            match failure {
                Unresolved::Call(code) => {
                    LoadError::ResolveFailed { function, requested: cuda_version, driver, code: code.0 }
                }
                Unresolved::Query(q)
                    if q == CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT =>
                {
                    LoadError::VersionNotSufficient { function, requested: cuda_version, driver }
                }
                Unresolved::Query(_) => LoadError::EntryPointNotFound { function, driver },
            }
        })
    }
}

impl std::ops::Deref for Driver {
    type Target = EntryPoints;
    fn deref(&self) -> &EntryPoints {
        &self.entry_points
    }
}

/// # Safety
/// `T` must be the function-pointer type of `symbol`.
unsafe fn bootstrap<T: Copy>(library: &libloading::Library, path: &str, symbol: &'static str) -> Result<T, LoadError> {
    // SAFETY: the caller names the symbol's type.
    unsafe { library.get::<T>(symbol.as_bytes()) }
        .map(|s| *s)
        .map_err(|_| LoadError::NotADriver { path: path.to_owned(), symbol })
}

/// Why `cuGetProcAddress` handed out no pointer. Its `CUresult` and its query result are both
/// small integers (1 is INVALID_VALUE and SYMBOL_NOT_FOUND), so they are kept apart by type.
enum Unresolved {
    /// The call failed with this `CUresult`.
    Call(CUresult),
    /// The call succeeded but the query result says why there is no pointer.
    Query(CUdriverProcAddressQueryResult),
}

/// One `cuGetProcAddress` call.
fn resolve(get_proc_address: PFN_cuGetProcAddress, name: &CStr, version: i32) -> Result<NonNull<c_void>, Unresolved> {
    let mut pointer: *mut c_void = ptr::null_mut();
    let mut found = CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: valid C string and out-pointers; flags 0 is CU_GET_PROC_ADDRESS_DEFAULT.
    let code = unsafe { get_proc_address(name.as_ptr(), &mut pointer, version, 0, &mut found) };
    if code != CUresult::CUDA_SUCCESS {
        return Err(Unresolved::Call(code));
    }
    if found != CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS {
        return Err(Unresolved::Query(found));
    }
    NonNull::new(pointer).ok_or(Unresolved::Query(CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND))
}

#[doc(hidden)]
pub fn missing(function: &'static str, needs: i32, driver: i32) -> LoadError {
    let (needs, driver) = (DriverVersion(needs), DriverVersion(driver));
    if driver < needs {
        LoadError::DriverTooOld { function, needs, found: driver }
    } else {
        LoadError::EntryPointNotFound { function: function.to_owned(), driver }
    }
}

/// Declares a table of entry points resolved at run time, for a loader of this workspace: each
/// row of a bindings list (`name: PFN_name = since,`, as `for_each_entry_point!` writes it) becomes
/// a field, a getter and a row of a `const` list. libcuda's table is below; libnccl's is in
/// cumempool-nccl. Not part of the public API.
///
/// The loading crate supplies what differs between libraries: how a name is looked up (the
/// `lookup` given to `resolve`), its error type, and `missing(name, since, version)`, which says
/// why a function did not resolve. A version is the library's own number (`13020` for CUDA 13.2,
/// `22809` for NCCL 2.28.9), in the same numbering as each row's `since`. A row newer than the
/// library is never looked up: the library may have the name with an older ABI than the row's
/// (`cuGetProcAddress` hands out the `_v1` of a `_v2` function to an older version).
#[doc(hidden)]
#[macro_export]
macro_rules! entry_point_table {
    (
        $(#[$table_attr:meta])*
        pub struct $Table:ident {
            missing: $missing:path,
            error: $Error:ty,
            provider: $provider:literal,
        }
        $(#[$list_attr:meta])*
        pub const $LIST:ident: $List:ty = |$row_name:ident, $row_since:ident| $row:expr;
        $($name:ident: $pfn:ty = $since:literal,)*
    ) => {
        $(#[$table_attr])*
        // The C names, as in the library's header.
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        pub struct $Table {
            version: i32,
            $($name: Option<$pfn>,)*
        }

        #[allow(non_snake_case)]
        impl $Table {
            /// Looks up every row no newer than `version` with `lookup`, which must hand back
            /// each name with the ABI the bindings declare for it.
            pub(crate) fn resolve(
                version: i32,
                lookup: impl Fn(&::core::ffi::CStr) -> Option<::core::ptr::NonNull<::core::ffi::c_void>>,
            ) -> Self {
                Self {
                    version,
                    $($name: if version < $since {
                        None
                    } else {
                        ::core::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                            .ok()
                            .and_then(&lookup)
                            // SAFETY: `resolve`'s caller passes a `lookup` that hands back `$name`
                            // with the ABI the bindings declare as `$pfn`.
                            .map(|p| unsafe { ::core::mem::transmute::<*mut ::core::ffi::c_void, $pfn>(p.as_ptr()) })
                    },)*
                }
            }

            $(
                #[doc = concat!("`", stringify!($name), "`, or why ", $provider, " cannot provide it.")]
                #[inline]
                pub fn $name(&self) -> Result<$pfn, $Error> {
                    self.$name.ok_or_else(|| $missing(stringify!($name), $since, self.version))
                }
            )*
        }

        $(#[$list_attr])*
        pub const $LIST: $List = &[$({
            let $row_name: &'static str = stringify!($name);
            let $row_since: i32 = $since;
            $row
        },)*];
    };
}

/// Puts the bindings' list of entry points (`for_each_entry_point!`) into libcuda's table,
/// [`EntryPoints`] and [`ENTRY_POINTS`].
macro_rules! entry_points {
    ($($rows:tt)*) => {
        $crate::entry_point_table! {
            /// Every entry point the bindings declare, each resolved once through `cuGetProcAddress`.
            ///
            /// Each method returns the function pointer, or why this driver cannot provide it.
            pub struct EntryPoints {
                missing: missing,
                error: LoadError,
                provider: "this driver",
            }
            /// Every entry point of the bindings with the driver version its declared ABI needs.
            pub const ENTRY_POINTS: &[EntryPoint] = |name, since| EntryPoint { name, since };
            $($rows)*
        }
    };
}
crate::for_each_entry_point!(entry_points);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_naming_the_path() {
        // SAFETY: nothing is opened: the file does not exist.
        let error = unsafe { Driver::open("/nonexistent/libcuda.so.1") }.err();
        match error {
            Some(LoadError::LibraryNotFound { path, .. }) => {
                assert_eq!(path, "/nonexistent/libcuda.so.1")
            }
            other => panic!("expected LibraryNotFound, got {other:?}"),
        }
    }

    #[test]
    fn a_file_that_is_no_library_says_what_is_wrong_with_it() {
        let dir = std::env::temp_dir().join(format!("cumempool-loader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = dir.join("libcuda.so.1");
        std::fs::write(&text, "not a library\n").unwrap();
        let cases = [
            (dir.to_str().unwrap().to_owned(), "is a directory"),
            ("/dev/null".to_owned(), "is not a regular file"),
            (text.to_str().unwrap().to_owned(), "is not a shared library"),
        ];
        for (path, expected) in cases {
            // SAFETY: none of these can be loaded, so nothing runs.
            match unsafe { Driver::open(&path) }.err() {
                Some(error @ LoadError::LibraryNotFound { .. }) => {
                    let shown = error.to_string();
                    assert!(shown.contains(expected) && shown.contains(&path), "{path}: {shown}");
                    assert!(!shown.contains("install the NVIDIA driver"), "{path}: {shown}");
                }
                other => panic!("{path}: expected LibraryNotFound, got {other:?}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_library_that_is_not_libcuda_is_refused_by_symbol() {
        // libc is present everywhere these tests run and exports no CUDA symbol.
        // SAFETY: libc's initialisers already ran in this process; no CUDA symbol is called.
        match unsafe { Driver::open("libc.so.6") }.err() {
            Some(LoadError::NotADriver { symbol, .. }) => assert_eq!(symbol, "cuDriverGetVersion"),
            other => panic!("expected NotADriver, got {other:?}"),
        }
    }

    #[test]
    fn too_old_names_function_and_both_versions() {
        let text = missing("cuMemGetMemPool", 13000, 12080).to_string();
        assert!(text.contains("cuMemGetMemPool") && text.contains("13.0") && text.contains("12.8"), "{text}");
        assert!(matches!(missing("cuMemGetMemPool", 13000, 13000), LoadError::EntryPointNotFound { .. }));
    }

    #[test]
    fn entry_points_are_listed_once_with_sane_versions() {
        let mut names: Vec<_> = crate::ENTRY_POINTS.iter().map(|e| e.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), crate::ENTRY_POINTS.len());
        assert!(crate::ENTRY_POINTS.iter().all(|e| (2000..=BINDINGS_VERSION.0).contains(&e.since)));
        let since = |n| crate::ENTRY_POINTS.iter().find(|e| e.name == n).map(|e| e.since);
        assert_eq!(since("cuMemGetMemPool"), Some(13000));
        assert_eq!(since("cuMemAllocAsync"), Some(11020));
    }
}
