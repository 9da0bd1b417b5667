//! NCCL's raw declarations, generated from the pinned nccl.h by `cargo xtask bindgen --nccl`,
//! and the loader's table of its functions. The generated file depends on nothing hand-written
//! and the loader reads its list of functions, so the two meet here, above both.

pub use crate::generated::*;
/// The functions of the declarations, resolved by the loader.
pub use crate::loader::{EntryPoints, ENTRY_POINTS};
