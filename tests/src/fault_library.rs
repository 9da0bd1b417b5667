//! The fault-injecting driver (`cumempool-fault`) from a test's side: finding it, making this
//! process load it instead of libcuda, and steering its plan.

use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;

/// The library's file name.
pub const FILE_NAME: &str = "libcumempool_fault.so";

/// Where the library is: beside the test binary in a GPU pack (`.gpu/bin/`), else in cargo's
/// target directory (`target/<profile>/`, the parent of the test binary's `deps/`).
pub fn path() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let beside = exe.with_file_name(FILE_NAME);
    let above = exe.parent()?.parent()?.join(FILE_NAME);
    [beside, above].into_iter().find(|p| p.is_file())
}

type SetPlan = unsafe extern "C" fn(*const c_char, *mut c_char, usize) -> c_int;
type Count = unsafe extern "C" fn(*const c_char, c_int) -> i64;
type ResetCounts = extern "C" fn();

/// The loaded fault library's control functions.
pub struct FaultLibrary {
    set_plan: SetPlan,
    count: Count,
    reset_counts: ResetCounts,
    _library: libloading::Library,
}

impl FaultLibrary {
    /// Makes this process's driver the fault library: sets `CUMEMPOOL_LIBCUDA` and opens the
    /// library for its control functions. Must run before the process's first driver use.
    pub fn install() -> Result<Self, String> {
        let path = path().ok_or_else(|| {
            format!("{FILE_NAME} is neither beside the test binary nor in target/<profile>/: build it with `cargo build -p cumempool-fault` (the GPU pack carries it)")
        })?;
        std::env::set_var(cumempool::sys::LIBCUDA_ENV, &path);
        Self::open(&path)
    }

    /// Opens the library at `path` for its control functions (a child process whose parent
    /// already set `CUMEMPOOL_LIBCUDA` to it).
    pub fn open(path: &std::path::Path) -> Result<Self, String> {
        // SAFETY: the fault library's initialisers only set up statics; the real driver is
        // opened on first use. The same path gives the same handle the driver loader gets.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: the control functions have these signatures (cumempool-fault's control.rs).
        unsafe {
            Ok(Self {
                set_plan: *library.get::<SetPlan>(b"cumempool_fault_set_plan").map_err(|e| e.to_string())?,
                count: *library.get::<Count>(b"cumempool_fault_count").map_err(|e| e.to_string())?,
                reset_counts: *library
                    .get::<ResetCounts>(b"cumempool_fault_reset_counts")
                    .map_err(|e| e.to_string())?,
                _library: library,
            })
        }
    }

    /// Replaces the plan (text form of `CUMEMPOOL_FAULT_PLAN`), or says why it does not parse.
    pub fn set_plan(&self, plan: &str) -> Result<(), String> {
        let text = CString::new(plan).map_err(|e| e.to_string())?;
        let mut error = [0 as c_char; 512];
        // SAFETY: a NUL-terminated plan and an error buffer of its stated length.
        let code = unsafe { (self.set_plan)(text.as_ptr(), error.as_mut_ptr(), error.len()) };
        if code == 0 {
            return Ok(());
        }
        let bytes: Vec<u8> = error.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
        Err(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Clears the plan: every call reaches the driver.
    pub fn clear(&self) {
        let _ = self.set_plan("");
    }

    fn count(&self, function: &str, injected: bool) -> u64 {
        let Ok(name) = CString::new(function) else { return 0 };
        // SAFETY: a NUL-terminated name.
        let count = unsafe { (self.count)(name.as_ptr(), c_int::from(injected)) };
        u64::try_from(count).unwrap_or_else(|_| panic!("{function} is not an entry point of the bindings"))
    }

    /// Calls of `function` that reached the library since the counts were reset.
    pub fn calls(&self, function: &str) -> u64 {
        self.count(function, false)
    }

    /// Failures injected into `function` since the counts were reset.
    pub fn injected(&self, function: &str) -> u64 {
        self.count(function, true)
    }

    /// Sets every count back to 0.
    pub fn reset_counts(&self) {
        (self.reset_counts)();
    }
}
