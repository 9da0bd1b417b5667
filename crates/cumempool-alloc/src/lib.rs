//! Allocators on CUDA memory pools: a stream-ordered resource trait, resources over pools,
//! composable adaptors, a caching layer that scales with threads, and `allocator-api2`
//! containers in host-accessible pool memory.
//!
//! ```no_run
//! use cumempool::{Device, MemPool, Route, Stream};
//! use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, StreamOrderedResource};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let context = Device::get(0)?.primary_context()?;
//! let stream = Stream::new(&context)?;
//! let pool = MemPool::new(Route::device(0))?;
//! let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
//! for _ in 0..1000 {
//!     let block = cache.alloc(1 << 20, &stream)?; // after the first, answered without the driver
//!     # drop(block);
//! }
//! println!("{:?}", cache.stats());
//! # Ok(()) }
//! ```
//!
//! Containers in pinned host memory:
//!
//! ```no_run
//! use allocator_api2::vec::Vec;
//! use cumempool::{Device, MemPool, Route};
//! use cumempool_alloc::{HostMemory, PoolAllocator};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let context = Device::get(0)?.primary_context()?;
//! let pool = MemPool::new(Route::host())?;
//! let mut numbers = Vec::new_in(PoolAllocator::<HostMemory>::new(&pool, &context)?);
//! numbers.extend(0..1024u32);
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adaptors;
mod allocator;
mod arena;
mod caching;
mod error;
#[cfg(any(test, feature = "testing"))]
mod host_heap;
mod memory_kind;
mod pool_resource;
mod resource;

pub use adaptors::{Limit, OnOutOfMemory, Outstanding, Statistics, Traced, Tracking, Usage};
pub use allocator::{PoolAllocator, ResourceAllocator};
pub use arena::{Arena, ArenaBuilder, ArenaStats, MappingHold};
#[cfg(unix)]
pub use arena::{ArenaExport, ArenaImport};
pub use caching::{CacheStats, CachingResource};
pub use error::{Error, Result};
#[cfg(any(test, feature = "testing"))]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub use host_heap::{HostHeap, SimulatedCapture};
pub use memory_kind::{DeviceMemory, HostAccessible, HostMemory, ManagedMemory, MemoryKind};
pub use pool_resource::{CurrentPoolResource, PoolResource};
pub use resource::{Allocation, CaptureMark, StreamOrderedResource, POOL_ALIGNMENT};
