//! NCCL collectives on cumempool memory.
//!
//! NCCL is loaded at run time, like the CUDA driver: the library named by `CUMEMPOOL_LIBNCCL`,
//! else `libnccl.so.2` through the system loader, else the `nvidia-nccl-cu13` wheel's
//! `nvidia/nccl/lib/libnccl.so.2` in python3's site-packages. A missing library, or a function
//! newer than the loaded NCCL, is a typed error naming what is missing and which NCCL release
//! the call needs ([`LoadError`]).
//!
//! ```no_run
//! use cumempool::{Device, MemPool, Route, Stream};
//! use cumempool_nccl::{Communicator, ReduceOp};
//! use std::time::Duration;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let comms = Communicator::init_all(&[0])?; // one rank per device, in this process
//! let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
//! let pool = MemPool::new(Route::device(0))?;
//! let buffer = pool.alloc(1 << 20, &stream)?;
//! comms[0].all_reduce::<f32>(&buffer, &buffer, (1 << 20) / 4, ReduceOp::Sum, &stream)?;
//! comms[0].wait(&stream, Duration::from_secs(30))?; // bounded: aborts if a peer died
//! # Ok(()) }
//! ```
//!
//! One rank per process: rank 0 makes a [`UniqueId`] and sends it to the others over any byte
//! stream ([`UniqueId::send`] / [`UniqueId::receive`], which also check that the ranks agree on
//! the size); each calls [`Communicator::init_rank`]. docs/distributed.md shows it with
//! torchrun, Slurm and MPI launchers.
//!
//! Zero-copy registration ([`Communicator::register`], [`Communicator::register_window`])
//! works on VMM memory: an arena ([`cumempool_alloc::Arena`], registered once with
//! [`Communicator::register_arena`]) or [`NcclMemory`].
//!
//! ## Crate features
//! - `cuda-13050` (default), `cuda-13040`, `cuda-13020`, `cuda-13000`: passed to `cumempool`.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod bindings;
mod buffers;
mod comm;
mod error;
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    missing_docs,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]
#[path = "generated/nccl_23007.rs"]
mod generated;
mod group;
mod loader;
mod ordering;
mod registration;

pub use buffers::{DeviceBuffer, DeviceSlice, Element, NcclMemory, ReduceOp};
pub use comm::{Communicator, UniqueId, ID_MESSAGE_LEN};
pub use error::{Error, InvalidArgumentReason, Result};
pub use group::{group, Group};
pub use loader::{candidates, nccl, LoadError, Nccl, NcclVersion, DEFAULT_LIBRARY, LIBNCCL_ENV};
pub use registration::{register_windows, ArenaRegistration, Registration, Window};

/// The loaded NCCL's version (loading it on first use).
pub fn version() -> Result<NcclVersion> {
    Ok(nccl()?.version())
}
