//! Where the workspace is: below every command, which all work from its root.

use std::path::PathBuf;

/// The workspace root: xtask lives one level below it.
pub(crate) fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}
