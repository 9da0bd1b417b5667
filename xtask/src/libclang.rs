//! libclang, which bindgen opens at run time. Loading it here first, through the same clang-sys
//! search bindgen uses, turns bindgen's "Unable to find libclang" panic into an error that says
//! what is missing and how to install it.

use std::path::PathBuf;

/// Loads libclang for this thread (bindgen then reuses it) and returns the file that was loaded.
pub fn load() -> Result<PathBuf, String> {
    if !clang_sys::is_loaded() {
        clang_sys::load().map_err(|reason| missing(&reason))?;
    }
    clang_sys::get_library()
        .map(|library| library.path().to_path_buf())
        .ok_or_else(|| missing("clang-sys reported success but holds no library"))
}

/// What to do about a missing libclang. Only `libclang.so*` and `libclang-N.so*` count: the
/// `libclang-cpp` many images ship is the C++ library, which bindgen cannot use.
fn missing(reason: &str) -> String {
    format!(
        "bindgen needs libclang (libclang.so or libclang-N.so; libclang-cpp is not it) and found none.\n\
         clang-sys said: {reason}\n\
         install it: `apt-get install libclang-dev` (Debian, Ubuntu; also brings clang's own headers),\n\
         `dnf install clang-devel` (Fedora), or set LIBCLANG_PATH to the directory that holds it"
    )
}
