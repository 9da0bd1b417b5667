//! A live allocation behind a Python buffer: where its memory came from (a pool, a resource, an
//! import), how it goes back, what keeps it valid, and which processors may touch it.
//!
//! Below it, the resource it goes back to (`dyn_resource`); above it, what Python sees of it:
//! DLPack capsules, sharing with another process, and the `Buffer` class.

pub(crate) mod buffers;
pub(crate) mod dlpack;
pub(crate) mod dyn_resource;
pub(crate) mod sharing;

use crate::errors::Outcome;
use crate::memory::dyn_resource::Resource;
use crate::streams::default_streams::{LEGACY_HANDLE, PER_THREAD_HANDLE};
use crate::streams::stream::Stream;
use crate::sync::gil::Held;
use cumempool::sys;
use pyo3::prelude::*;
use std::sync::Arc;

/// Which processors may touch a buffer's memory: the core's placement, which its operations
/// need.
pub use cumempool::Placement as Kind;

/// The device a pool of `route` places its memory on; for host, managed or imported memory,
/// `stream_device` (the device of the stream it is ordered on). A pool's memory may be
/// allocated on another device's stream: the memory's device is the pool's, not the stream's.
pub(crate) fn memory_device(route: Option<cumempool::Route>, stream_device: i32) -> i32 {
    match route {
        Some(r) if Kind::of(route) == Kind::Device => r.location.device().unwrap_or(stream_device),
        _ => stream_device,
    }
}

/// Where the memory came from, and how it goes back.
pub enum Memory {
    /// A pool allocation, freed on its stream when dropped.
    Pool(cumempool::OwnedBuffer),
    /// An allocation of a resource (a cache, an adaptor), given back to it when dropped.
    Resource {
        /// The address.
        ptr: sys::CUdeviceptr,
        /// The size in bytes.
        len: usize,
        /// The resource it goes back to.
        resource: Arc<dyn Resource>,
        /// The stream it is ordered on.
        stream: cumempool::Stream,
    },
    /// A mapping of another process's allocation (`MemPool.import_buffer`), unmapped on its
    /// stream when dropped.
    Imported {
        /// The mapping. Declared first, so dropped first: it borrows `*_stream`.
        mapping: cumempool::Buffer<'static>,
        /// The stream the mapping borrows, at an address that does not move.
        _stream: Arc<cumempool::Stream>,
    },
}

impl Memory {
    /// Gives the memory back from a binding, with the GIL released for driver calls only: none
    /// for an empty buffer, around the pool's free, or where a resource stack reaches the
    /// driver.
    fn give_back(self, py: Python<'_>) {
        match &self {
            // No driver call.
            Self::Pool(buffer) if buffer.is_empty() => drop(self),
            // The bottom of the stack releases the GIL and puts the caller's context back
            // (`driver_link::DriverLink`).
            Self::Resource { .. } => {
                let _held = Held::new(py);
                drop(self);
            }
            _ => crate::sync::gil::detach(py, || self.free()),
        }
    }

    /// Gives the memory back on the calling thread as it is (with the GIL or without it). A
    /// free on a legacy stream makes its context current: the caller's is put back after.
    fn free(self) {
        let handle = match &self {
            // Through the resource stack, whose bottom puts the caller's context back.
            Self::Resource { .. } => return drop(self),
            Self::Pool(buffer) => buffer.stream().as_raw() as usize,
            Self::Imported { mapping, .. } => mapping.stream().as_raw() as usize,
        };
        let freed = crate::streams::current_context::restored_after(handle, || {
            drop(self);
            Ok::<(), cumempool::Error>(())
        });
        if let Err(error) = freed {
            tracing::warn!(%error, "putting the caller's context back after a free failed");
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Self::Resource { ptr, len, resource, stream } = self {
            // SAFETY: allocated by `resource` with this size on `stream`, given back once (here).
            if let Err(error) = unsafe { resource.deallocate(*ptr, *len, stream) } {
                tracing::warn!(%error, ptr = *ptr, "giving a buffer back to its resource failed");
            }
        }
    }
}

/// A live allocation and what keeps it valid: shared by the Python buffer and every DLPack
/// capsule made from it, so memory outlives the buffer object while a consumer holds it.
pub struct Core {
    // Fields drop in order: the memory is freed on its stream before the stream (and the
    // library object that lent it) may go.
    memory: Memory,
    stream: Py<Stream>,
    pub(crate) kind: Kind,
    /// The device the memory is on (for host and managed memory: the stream's device).
    pub(crate) device: i32,
}

impl Core {
    /// Memory on `stream` (whose Python object is held), of `kind`, on `device`.
    pub fn new(memory: Memory, stream: Py<Stream>, kind: Kind, device: i32) -> Self {
        Self { memory, stream, kind, device }
    }

    /// Lets go of `core` from Python (a close, the buffer collected, the end of a call that
    /// held it): the memory goes back as [`Memory::give_back`] says, and the stream's Python
    /// object is let go of with the GIL held, so no reference waits for PyO3's deferred pool.
    /// A core something else still holds (a DLPack capsule, a call on another thread) is only
    /// let go of; the last holder gives the memory back.
    pub(crate) fn release(core: Slot, py: Python<'_>) {
        let core = match core {
            Slot::Own(core) => core,
            // `into_inner`, not `try_unwrap`: two holders letting go at once on two threads
            // (a close and a consumer's deleter) could both see the other and both fail, and
            // the core would then be dropped plainly, without what this function does.
            Slot::Shared(shared) => match Arc::into_inner(shared) {
                Some(core) => core,
                None => return,
            },
        };
        let Self { memory, stream, .. } = core;
        // The memory first: it is freed on the stream the Python object keeps alive.
        memory.give_back(py);
        crate::streams::stream::let_go(py, stream);
    }

    /// Lets go of `core` where the GIL may not be held (a DLPack consumer's deleter, on any
    /// thread): the last holder gives the memory back here, as [`Memory::free`] says. The
    /// stream's Python object is let go of when Python next runs bindings (PyO3's deferred
    /// references), and the memo forgets an unused lent stream at its next miss
    /// (`stream::prune_unused`).
    pub(crate) fn release_unattached(core: Arc<Core>) {
        // `into_inner`: see `release`.
        if let Some(Self { memory, stream, .. }) = Arc::into_inner(core) {
            // The memory first: it is freed on the stream the Python object keeps alive.
            memory.free();
            drop(stream);
        }
    }

    /// The pool allocation behind this core, where it is one (not a resource's, not imported).
    pub(crate) fn pool_buffer(&self) -> Option<&cumempool::OwnedBuffer> {
        match &self.memory {
            Memory::Pool(buffer) => Some(buffer),
            _ => None,
        }
    }

    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        match &self.memory {
            Memory::Pool(buffer) => buffer.as_raw(),
            Memory::Imported { mapping, .. } => mapping.as_raw(),
            Memory::Resource { ptr, .. } => *ptr,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.memory {
            Memory::Pool(buffer) => buffer.len(),
            Memory::Imported { mapping, .. } => mapping.len(),
            Memory::Resource { len, .. } => *len,
        }
    }

    /// The Python object of the stream the memory is ordered on.
    pub(crate) fn stream_object(&self) -> &Py<Stream> {
        &self.stream
    }

    pub(crate) fn stream(&self) -> &cumempool::Stream {
        match &self.memory {
            Memory::Pool(buffer) => buffer.stream(),
            Memory::Imported { mapping, .. } => mapping.stream(),
            Memory::Resource { stream, .. } => stream,
        }
    }

    /// The memory as the core crate's [`cumempool::Block`], for the operations written once
    /// there (fill, copies, orderings), each with its capture checks.
    pub(crate) fn block(&self) -> cumempool::Block<'_> {
        // SAFETY: the live allocation this core holds until it is let go of (after every view,
        // which borrows the core), ordered on its stream; the bindings hand out no Rust reference
        // to its bytes (only addresses, to other libraries).
        unsafe { cumempool::Block::new(self.ptr(), self.len(), self.stream(), self.kind) }
    }

    /// Runs one of the core's operations on this memory, then puts back the caller's context
    /// (copies, events and the legacy stream make the stream's context current).
    pub(crate) fn with_block<R>(&self, op: impl FnOnce(cumempool::Block<'_>) -> cumempool::Result<R>) -> Outcome<R> {
        Ok(cumempool::keeping_current_context(|| op(self.block()))?)
    }

    /// Makes a DLPack consumer wait for this buffer's work: `consumer` is a raw stream handle
    /// of the memory's device (1 and 2 for the legacy and per-thread default streams, the
    /// per-thread one served as `Stream::legacy_for_per_thread`), or `None` for a host consumer,
    /// for which the host waits. A capturing stream, the consumer's or the buffer's, is refused
    /// before the driver.
    pub(crate) fn order_before_consumer(&self, consumer: Option<usize>, context: &cumempool::Context) -> Outcome<()> {
        let waiter = match consumer {
            None => return self.with_block(|block| block.stream().synchronize()),
            Some(LEGACY_HANDLE) => cumempool::Stream::legacy(context),
            Some(PER_THREAD_HANDLE) => cumempool::Stream::legacy_for_per_thread(context),
            // SAFETY: the consumer's stream, live for the duration of this call (DLPack).
            Some(raw) => unsafe { cumempool::Stream::borrow_raw(raw as sys::CUstream, Some(context)) }?,
        };
        self.with_block(|block| block.order_before(&waiter, EXPORT_TO_CAPTURING))
    }

    /// Orders this memory's release after the work queued on `producer` so far
    /// (`Buffer.close(stream)`): refused while either stream captures, the buffer's own
    /// included.
    pub(crate) fn order_release_after(&self, producer: &Stream) -> Outcome<()> {
        self.with_block(|block| block.order_release_after(&producer.stream, CLOSE_AFTER_CAPTURING))
    }
}

/// Why `Buffer.close(stream)` is refused while `stream` captures, and what to do instead.
const CLOSE_AFTER_CAPTURING: &str =
    "closing a Buffer after the work of a stream while it or the buffer's own stream captures a CUDA graph (close it after the capture ends)";

/// Why a DLPack export to a capturing consumer stream is refused, and what to do instead.
const EXPORT_TO_CAPTURING: &str = "exporting a Buffer through DLPack to a stream that is capturing a CUDA graph (export it before the capture begins, or synchronise the buffer's stream and pass stream=-1)";

/// A buffer's core: the buffer's own (no allocation beyond the Python object), or shared
/// (with DLPack capsules, or with calls that release the GIL) from the first such use on.
pub(crate) enum Slot {
    Own(Core),
    Shared(Arc<Core>),
}

impl std::ops::Deref for Slot {
    type Target = Core;

    fn deref(&self) -> &Core {
        match self {
            Self::Own(core) => core,
            Self::Shared(core) => core,
        }
    }
}
