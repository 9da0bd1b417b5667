//! The repository README's Rust examples, compiled by `cargo test` as doctests (they are
//! `no_run`: they need a GPU), so an API change that breaks them fails the tests.

#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeExamples;
