//! Adaptors: each wraps any resource and is one itself, so they compose
//! (`Traced::new(Limit::new(Statistics::new(pool), cap), "pool")`).

mod limit;
mod on_out_of_memory;
mod statistics;
mod traced;
mod tracking;

pub use limit::Limit;
pub use on_out_of_memory::OnOutOfMemory;
pub use statistics::{Statistics, Usage};
pub use traced::Traced;
pub use tracking::{Outstanding, Tracking};
