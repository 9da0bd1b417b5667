//! The Rust examples of the repository's README and of each published crate's README (its
//! crates.io page), compiled by `cargo test` as doctests. They are `no_run` (they need a GPU), so
//! what this catches is an API change that leaves the front doors stale.

#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct Readme;

#[cfg(doctest)]
#[doc = include_str!("../../../crates/cumempool-sys/README.md")]
pub struct SysReadme;

#[cfg(doctest)]
#[doc = include_str!("../../../crates/cumempool/README.md")]
pub struct CumempoolReadme;

#[cfg(doctest)]
#[doc = include_str!("../../../crates/cumempool-alloc/README.md")]
pub struct AllocReadme;
