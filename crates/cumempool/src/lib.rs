//! Safe, location-keyed CUDA stream-ordered memory pools.
//!
//! CUDA 13.0 keys pools by *route*: a [`Location`] (a device, the host, a host NUMA node, or
//! no preference) with an [`AllocationType`] (pinned or managed). Every route has a
//! driver-owned [default pool](default_pool) and a [current pool](current_pool), which
//! [`set_current_pool`] changes for the whole process. This crate wraps all of it: RAII pools
//! ([`MemPool`]) and handles that never own ([`PoolRef`]), every pool attribute typed (CUDA 13.2's
//! six new ones with the `cuda-13020` feature, 13.4's locality domain with `cuda-13040`, failing
//! cleanly on older drivers), buffers freed in stream order, and errors that say what was wrong
//! and what would be right.
//!
//! ```no_run
//! use cumempool::{Device, MemPool, Route, Stream};
//! # fn main() -> cumempool::Result<()> {
//! let context = Device::get(0)?.primary_context()?;
//! let stream = Stream::new(&context)?;
//! let pool = MemPool::builder(Route::host()).max_size(1 << 30).build()?;
//! let mut buffer = pool.alloc(4096, &stream)?;
//! buffer.host_slice_mut()?.fill(7); // host memory: the CPU may write it once the stream is idle
//! # Ok(()) }
//! ```
//!
//! CUDA graphs: [`Stream::capture`] records work through a [`Capture`] into a [`Graph`] whose
//! borrows keep the memory it uses alive while it can run; a buffer's own methods refuse a
//! capturing stream ([`Error::StreamCapturing`]) instead of invalidating the capture.
//!
//! ## Crate features
//! - `cuda-13050` (default): CUDA 13.5's declarations; for pools, the same as `cuda-13040`.
//! - `cuda-13040`: CUDA 13.4's locality domains (`Location::DeviceLocalityDomain`,
//!   `Route::locality_domain`, `Device::locality_domain_count`, the pool's and the buffer's
//!   domain) and `Buffer::location_info` (`cuMemGetLocationInfo`).
//! - `cuda-13020`: CUDA 13.2's pool attributes and `Location::Invisible`.
//! - `cuda-13000`: CUDA 13.0 only.
//! - `cudarc`: interop with [cudarc](https://docs.rs/cudarc) 0.19: `Stream::from_cudarc`,
//!   `Context::from_cudarc`/`to_cudarc` and `unsafe Stream::to_cudarc` (which directions are
//!   sound, and why, is in docs/decisions.md). A pool made current for a device route already
//!   serves cudarc's `CudaStream::alloc`, which draws from the device's current pool.
//!
//! Each implies the older ones, and a build with a newer one runs on a 13.0 driver: the newer
//! items then answer [`Error::DriverTooOld`] naming what they need.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bare_pools;
#[cfg(feature = "cudarc")]
mod cudarc_interop;
mod devices;
mod driver;
mod error;
mod graph;
#[cfg(test)]
mod header_coverage;
mod memory;
mod pool;
mod routing;
mod sharing;
mod streams;
mod values;

pub use bare_pools::attributes::{AttributeAccess, AttributeValue, PoolAttribute};
pub use bare_pools::retirement::{destroy_retired_pools, retired_pools, RetiredPools};
pub use cumempool_sys::DriverVersion;
pub use devices::context::{current_device, keeping_current_context, Context};
pub use devices::device::{require_concurrent_managed_access, Device, GraphMemory};
pub use driver::{bindings_version, driver_version, init, library_path};
pub use error::{error_name, DriverError, Error, InvalidArgumentReason, NotShareableReason, Result};
pub use graph::{Capture, CapturedBuffer, Graph, GraphExec};
pub use memory::block::{Block, Placement};
pub use memory::buffer::{free_async, Buffer, BufferOn, OwnedBuffer, PendingCopy, PendingCopyError};
pub use memory::capture_registry::is_captured_allocation;
#[cfg(feature = "cuda-13040")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-13040")))]
pub use memory::location_info::location_info;
pub use pool::{MemPool, Pool, PoolBuilder, PoolRef};
pub use routing::table::{all_routes, route_table, RouteEntry, RouteTable};
pub use routing::{
    current_pool, current_pool_handle, default_pool, is_default, reset_current_pool, set_current_pool, RouteGuard,
};
#[cfg(unix)]
pub use sharing::descriptor_passing;
pub use sharing::vmm;
pub use sharing::SharedAllocation;
pub use streams::capture_mode::relaxed as in_relaxed_capture_mode;
pub use streams::capture_state::CaptureStatus;
pub use streams::event::Event;
pub use streams::stream::{Stream, StreamId};
pub use values::access::Access;
pub use values::export_handles::HandleTypes;
pub use values::location::{raw_location, AllocationType, InvalidLocation, Location};
pub use values::route::{InvalidRoute, Route};
pub use values::unknown_value::UnknownValue;

/// The cudarc this crate's interop is built against (feature `cudarc`).
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use cudarc;

/// The raw layer, for what this crate does not wrap.
pub use cumempool_sys as sys;
