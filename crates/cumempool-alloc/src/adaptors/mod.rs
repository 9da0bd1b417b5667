//! Adaptors: each wraps any resource and is one itself, so they compose
//! (`Traced::new(Limit::new(Statistics::new(pool), cap), "pool")`).

mod limit;
mod statistics;
mod traced;

pub use limit::Limit;
pub use statistics::{Statistics, Usage};
pub use traced::Traced;
