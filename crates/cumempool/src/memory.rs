//! Stream-ordered memory: buffers, the operations on any block of it, raw allocations made
//! during a capture, and where managed pages reside.

pub(crate) mod block;
pub(crate) mod buffer;
pub(crate) mod capture_registry;
#[cfg(feature = "cuda-13040")]
pub(crate) mod location_info;
