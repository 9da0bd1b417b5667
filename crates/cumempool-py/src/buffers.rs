//! Buffers handed to Python: stream-ordered memory with `__cuda_array_interface__`, DLPack,
//! NumPy's `__array_interface__` (host-accessible memory) and copies to and from bytes.

use crate::contexts::check;
use crate::dlpack;
use crate::errors::{Failure, Outcome};
use crate::gil::Held;
use crate::resources::Resource;
use crate::streams::Stream;
use cumempool::sys;
use pyo3::exceptions::{PyAttributeError, PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Which processors may touch a buffer's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Pinned device memory.
    Device,
    /// Pinned host memory.
    Host,
    /// Managed memory.
    Managed,
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
            // (`gil::DriverLink`).
            Self::Resource { .. } => {
                let _held = Held::new(py);
                drop(self);
            }
            _ => crate::gil::detach(py, || self.free()),
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
        let freed = crate::contexts::restored_after(handle, || {
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
            Slot::Shared(shared) => match Arc::try_unwrap(shared) {
                Ok(core) => core,
                Err(_) => return,
            },
        };
        let Self { memory, stream, .. } = core;
        // The memory first: it is freed on the stream the Python object keeps alive.
        memory.give_back(py);
        crate::streams::let_go(py, stream);
    }

    /// Lets go of `core` where the GIL may not be held (a DLPack consumer's deleter, on any
    /// thread): the last holder gives the memory back here, as [`Memory::free`] says. The
    /// stream's Python object is let go of when Python next runs bindings (PyO3's deferred
    /// references), and the memo forgets an unused lent stream at its next miss
    /// (`streams::prune_unused`).
    pub(crate) fn release_unattached(core: Arc<Core>) {
        if let Ok(Self { memory, stream, .. }) = Arc::try_unwrap(core) {
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

    pub(crate) fn stream(&self) -> &cumempool::Stream {
        match &self.memory {
            Memory::Pool(buffer) => buffer.stream(),
            Memory::Imported { mapping, .. } => mapping.stream(),
            Memory::Resource { stream, .. } => stream,
        }
    }

    /// The context of the buffer's stream (copies, events and the legacy stream need it
    /// current). Streams made by the bindings always know theirs.
    fn context(&self) -> Outcome<cumempool::Context> {
        match self.stream().context() {
            Some(context) => Ok(context.clone()),
            None => Ok(cumempool::Device::get(self.stream.get().device)?.primary_context()?),
        }
    }

    /// Runs `call` with the stream's context current, then puts back the caller's.
    fn in_context<R>(&self, call: impl FnOnce() -> Outcome<R>) -> Outcome<R> {
        crate::contexts::while_current(&self.context()?, call)
    }

    /// A copy of `len` bytes on this buffer's stream between two addresses, waited for.
    /// Unified addressing lets the driver infer the direction.
    ///
    /// # Safety
    /// Both ranges must be valid for `len` bytes until the copy has finished.
    unsafe fn copy(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, len: usize) -> Outcome<()> {
        if len == 0 {
            return Ok(());
        }
        let stream = self.stream();
        let copy = sys::driver().and_then(|d| d.cuMemcpyAsync()).map_err(cumempool::Error::from)?;
        // Copies that touch host memory need the stream's context current.
        self.in_context(|| {
            // SAFETY: the caller vouches for both ranges; the stream is live (held by this core).
            check("cuMemcpyAsync", unsafe { copy(dst, src, len, stream.as_raw()) })?;
            Ok(stream.synchronize()?)
        })
    }

    fn fill(&self, value: u8) -> Outcome<()> {
        let len = self.len();
        if len == 0 {
            return Ok(());
        }
        let stream = self.stream();
        if self.kind == Kind::Host {
            // The driver's memset refuses pinned host memory: the host sets it once the
            // stream's earlier work is done.
            self.in_context(|| Ok(stream.synchronize()?))?;
            // SAFETY: a live host-accessible allocation of `len` bytes, not used by queued work.
            unsafe { std::ptr::write_bytes(self.ptr() as usize as *mut u8, value, len) };
            return Ok(());
        }
        let memset = sys::driver().and_then(|d| d.cuMemsetD8Async()).map_err(cumempool::Error::from)?;
        // SAFETY: a live allocation of `len` bytes, ordered on its own stream.
        self.in_context(|| check("cuMemsetD8Async", unsafe { memset(self.ptr(), value, len, stream.as_raw()) }))
    }

    /// Makes `waiter` wait for the work queued on this buffer's stream so far. Streams are
    /// compared as the driver sees them (handle and context): the legacy streams of two
    /// devices are two streams.
    pub(crate) fn order_before(&self, waiter: &cumempool::Stream) -> Outcome<()> {
        let stream = self.stream();
        if waiter.same_as(stream) {
            return Ok(());
        }
        let context = self.context()?;
        self.in_context(|| {
            let ready = cumempool::Event::new(&context)?;
            ready.record(stream)?;
            Ok(waiter.wait(&ready)?)
        })
    }

    /// Makes this buffer's stream wait for the work queued on `producer` so far (a free on
    /// this stream then follows that work too).
    pub(crate) fn order_after(&self, producer: &Stream) -> Outcome<()> {
        let stream = self.stream();
        if producer.stream.same_as(stream) {
            return Ok(());
        }
        let context = match producer.stream.context() {
            Some(context) => context.clone(),
            None => cumempool::Device::get(producer.device)?.primary_context()?,
        };
        crate::contexts::while_current(&context, || {
            let ready = cumempool::Event::new(&context)?;
            ready.record(&producer.stream)?;
            Ok(stream.wait(&ready)?)
        })
    }

    /// Makes a DLPack consumer's stream (`consumer`, a raw handle of the memory's device;
    /// 1 and 2 for the legacy and per-thread default streams) wait for this buffer's work.
    fn order_before_consumer(&self, consumer: usize, context: &cumempool::Context) -> Outcome<()> {
        let waiter = match consumer {
            1 => cumempool::Stream::legacy(context),
            // The per-thread stream cannot be borrowed: wait for the work here instead.
            2 => return self.in_context(|| Ok(self.stream().synchronize()?)),
            // SAFETY: the consumer's stream, live for the duration of this call (DLPack).
            raw => unsafe { cumempool::Stream::borrow_raw(raw as sys::CUstream, Some(context)) }?,
        };
        self.order_before(&waiter)
    }
}

/// Stream-ordered memory from a pool or a resource. Freed on its stream by `close()`, by
/// leaving its `with` block, or when collected, unless a DLPack consumer still holds it, or an
/// array interface was read (then the memory goes when this object does: the consumers of
/// `__cuda_array_interface__` and `__array_interface__` hold the exporting object, not the
/// memory).
#[pyclass(module = "cumempool")]
pub struct Buffer {
    core: Option<Slot>,
    /// Whether an array interface handed the address out: `close()` then keeps the memory in
    /// `kept` until this object goes.
    viewed: bool,
    /// The memory of a closed buffer that array views may still use (behind an `Arc`, so the
    /// object stays small).
    kept: Option<Arc<Core>>,
}

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

impl Drop for Buffer {
    /// A buffer collected without `close()` gives its memory back as `close()` does (Python
    /// deallocates objects with the GIL held).
    fn drop(&mut self) {
        let (core, kept) = (self.core.take(), self.kept.take());
        if core.is_some() || kept.is_some() {
            Python::attach(|py| {
                for slot in [core, kept.map(Slot::Shared)].into_iter().flatten() {
                    Core::release(slot, py);
                }
            });
        }
    }
}

/// The core of a buffer for a call that releases the GIL: shared, so that a `close()` on
/// another thread meanwhile leaves the memory to the call, which gives it back when done.
pub(crate) struct InUse(ManuallyDrop<Arc<Core>>);

impl std::ops::Deref for InUse {
    type Target = Core;

    fn deref(&self) -> &Core {
        &self.0
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used after.
        let core = unsafe { ManuallyDrop::take(&mut self.0) };
        // Made and dropped by bindings, which hold the GIL: this only counts it again.
        Python::attach(|py| Core::release(Slot::Shared(core), py));
    }
}

impl Buffer {
    pub(crate) fn new(core: Core) -> Self {
        Self { core: Some(Slot::Own(core)), viewed: false, kept: None }
    }

    pub(crate) fn core(&self) -> Outcome<&Core> {
        self.core.as_deref().ok_or(Failure::Closed("this Buffer"))
    }

    /// The core, shared from now on (so a DLPack capsule or a call without the GIL can hold
    /// it beyond this buffer's `close()`).
    fn shared_core(buffer: &Bound<'_, Self>) -> Outcome<Arc<Core>> {
        if let Some(Slot::Shared(core)) = buffer.try_borrow().map_err(PyErr::from)?.core.as_ref() {
            return Ok(core.clone());
        }
        let mut this = buffer.try_borrow_mut().map_err(PyErr::from)?;
        let slot = this.core.take().ok_or(Failure::Closed("this Buffer"))?;
        let core = match slot {
            Slot::Own(core) => Arc::new(core),
            Slot::Shared(core) => core,
        };
        this.core = Some(Slot::Shared(core.clone()));
        Ok(core)
    }

    /// The core held for a call that releases the GIL (see [`InUse`]).
    pub(crate) fn in_use(buffer: &Bound<'_, Self>) -> Outcome<InUse> {
        Ok(InUse(ManuallyDrop::new(Self::shared_core(buffer)?)))
    }

    /// An array interface dict (version `version`) for the whole buffer as bytes; with a
    /// stream for the CUDA array interface (whose 0 is not allowed: the legacy stream is 1).
    /// From now on `close()` leaves the memory to this object's end (see [`Buffer`]).
    fn interface(buffer: &Bound<'_, Self>, version: u32, with_stream: bool) -> Outcome<Py<PyDict>> {
        let py = buffer.py();
        let mut this = buffer.try_borrow_mut().map_err(PyErr::from)?;
        let core = this.core()?;
        if !with_stream && core.kind == Kind::Device {
            return Err(PyAttributeError::new_err(
                "device memory has no __array_interface__: the host cannot read it; use __cuda_array_interface__, DLPack or to_bytes()",
            )
            .into());
        }
        let dict = PyDict::new(py);
        dict.set_item("shape", (core.len(),))?;
        dict.set_item("typestr", "|u1")?;
        dict.set_item("data", (core.ptr() as usize, false))?;
        dict.set_item("version", version)?;
        dict.set_item("strides", py.None())?;
        if with_stream {
            dict.set_item("stream", (core.stream().as_raw() as usize).max(1))?;
        }
        this.viewed = true;
        Ok(dict.unbind())
    }
}

#[pymethods]
impl Buffer {
    /// The address, as an int.
    #[getter]
    fn ptr(&self) -> Outcome<usize> {
        Ok(self.core()?.ptr() as usize)
    }

    /// The size in bytes.
    #[getter]
    fn size(&self) -> Outcome<usize> {
        Ok(self.core()?.len())
    }

    /// The size in bytes.
    #[getter]
    fn nbytes(&self) -> Outcome<usize> {
        self.size()
    }

    fn __len__(&self) -> Outcome<usize> {
        self.size()
    }

    /// The device the memory is on (for host and managed memory: the device of its stream).
    #[getter]
    fn device(&self) -> Outcome<i32> {
        Ok(self.core()?.device)
    }

    /// `"device"`, `"host"` or `"managed"`.
    #[getter]
    fn memory_kind(&self) -> Outcome<&'static str> {
        Ok(match self.core()?.kind {
            Kind::Device => "device",
            Kind::Host => "host",
            Kind::Managed => "managed",
        })
    }

    /// The stream the buffer is ordered on.
    #[getter]
    fn stream(&self, py: Python<'_>) -> Outcome<Py<Stream>> {
        Ok(self.core()?.stream.clone_ref(py))
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.core.is_none()
    }

    /// CUDA Array Interface version 3: a 1-D array of bytes, with the buffer's stream for the
    /// consumer to synchronise on. The consumer holds this Buffer, not the memory: once this
    /// was read, `close()` leaves the memory to the Buffer's end (when the last array over it
    /// lets go of it).
    #[getter]
    fn __cuda_array_interface__(slf: &Bound<'_, Self>) -> Outcome<Py<PyDict>> {
        Self::interface(slf, 3, true)
    }

    /// NumPy's array interface, for host-accessible memory only (no copy). Wait for the
    /// buffer's stream (`buffer.stream.synchronize()`) before the host reads what it wrote.
    /// As with `__cuda_array_interface__`, `close()` then leaves the memory to the Buffer's end.
    #[getter]
    fn __array_interface__(slf: &Bound<'_, Self>) -> Outcome<Py<PyDict>> {
        Self::interface(slf, 3, false)
    }

    /// DLPack export: a capsule `"dltensor_versioned"` for `max_version >= (1, 0)`, else
    /// `"dltensor"`; `stream` is the consumer's stream on the memory's device, made to wait for
    /// this buffer's work (`None` or 1: the legacy default stream; 2: the per-thread default
    /// stream; -1: no ordering; 0 is refused, as DLPack says for CUDA).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> Outcome<Py<PyAny>> {
        let py = slf.py();
        let core = Self::shared_core(slf)?;
        let mut device = dlpack::device_of(&core);
        // Host-accessible memory may be handed to a CPU consumer as CPU memory.
        if dl_device == Some((dlpack::KDL_CPU, 0)) && core.kind != Kind::Device {
            device = (dlpack::KDL_CPU, 0);
        }
        if dl_device.is_some_and(|d| d != device) {
            return Err(PyBufferError::new_err(format!(
                "this buffer is on DLPack device {device:?} and cannot be exported to {dl_device:?} without a copy"
            ))
            .into());
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "cumempool buffers export without a copy only; copy into a new buffer with copy_from_buffer",
            )
            .into());
        }
        let consumer = match stream {
            Some(-1) => None,
            // A host consumer has no stream to order: the buffer's work is waited for.
            None if core.kind != Kind::Device => Some(2),
            None => Some(1),
            Some(raw) if raw > 0 => Some(raw as usize),
            Some(raw) => {
                return Err(PyValueError::new_err(format!(
                    "stream={raw} is not a DLPack stream for CUDA memory: pass -1 (no ordering), None or 1 (the legacy default stream), 2 (the per-thread default stream) or a stream handle"
                ))
                .into())
            }
        };
        if let Some(consumer) = consumer {
            // The consumer's stream is on the memory's device (DLPack).
            let context = Stream::context(py, core.device)?;
            crate::gil::detach(py, || core.order_before_consumer(consumer, &context))?;
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        Ok(dlpack::capsule(py, core, versioned, device)?.into_any().unbind())
    }

    /// The data another process needs to map this allocation from the pool it imported
    /// (`MemPool.import_buffer`): a picklable `SharedAllocation`. The pool must be created with
    /// `handle_types=HandleTypes.POSIX_FILE_DESCRIPTOR` and exported first (`export_fd` or
    /// `send`). Keep this buffer until the importer has closed its mapping.
    fn export(slf: &Bound<'_, Self>) -> Outcome<crate::sharing::SharedAllocation> {
        let core = Self::in_use(slf)?;
        crate::sharing::export_allocation(slf.py(), &core)
    }

    /// `(device type, device id)`: CUDA 2, CUDA host 3, CUDA managed 13.
    fn __dlpack_device__(&self) -> Outcome<(i32, i32)> {
        Ok(dlpack::device_of(self.core()?))
    }

    /// Copies a bytes-like object (anything with the buffer protocol: bytes, bytearray,
    /// memoryview, a NumPy array) into the start of the buffer and waits for the copy.
    fn copy_from(slf: &Bound<'_, Self>, data: &Bound<'_, PyAny>) -> Outcome<()> {
        let py = slf.py();
        // A private bytes object: nothing can resize it while the copy runs without the GIL.
        // `memoryview` refuses what is not bytes-like (an int, which `bytes()` would turn into
        // that many zero bytes).
        let bytes = match data.cast::<PyBytes>() {
            Ok(bytes) => bytes.clone(),
            Err(_) => {
                let view = py.import("builtins")?.getattr("memoryview")?.call1((data,))?;
                view.call_method0("tobytes")?.cast_into::<PyBytes>().map_err(PyErr::from)?
            }
        };
        let core = Self::in_use(slf)?;
        let src = bytes.as_bytes();
        if src.len() > core.len() {
            return Err(cumempool::Error::DoesNotFit {
                what: "copying from the host",
                requested: src.len(),
                capacity: core.len(),
            }
            .into());
        }
        let (src_ptr, len) = (src.as_ptr() as usize, src.len());
        // SAFETY: `bytes` is immutable and held until the copy has finished; the memory is
        // held (`core`) and holds at least `len` bytes.
        crate::gil::detach(py, || unsafe { core.copy(core.ptr(), src_ptr as sys::CUdeviceptr, len) })
    }

    /// The buffer's bytes (its first `size` bytes, all by default), after its stream's work.
    #[pyo3(signature = (size = None))]
    fn to_bytes(slf: &Bound<'_, Self>, size: Option<usize>) -> Outcome<Py<PyBytes>> {
        let py = slf.py();
        let core = Self::in_use(slf)?;
        let len = size.unwrap_or(core.len());
        if len > core.len() {
            return Err(cumempool::Error::DoesNotFit {
                what: "copying to the host",
                requested: len,
                capacity: core.len(),
            }
            .into());
        }
        let mut failure = None;
        let bytes = PyBytes::new_with(py, len, |dst| {
            let dst_ptr = dst.as_mut_ptr() as usize;
            // SAFETY: `dst` is `len` writable bytes, alive until the copy has finished; the
            // memory is held (`core`).
            if let Err(error) =
                crate::gil::detach(py, || unsafe { core.copy(dst_ptr as sys::CUdeviceptr, core.ptr(), len) })
            {
                failure = Some(error);
            }
            Ok(())
        })?;
        match failure {
            Some(error) => Err(error),
            None => Ok(bytes.unbind()),
        }
    }

    /// Copies all of `other` (a Buffer) into the start of this one, ordered after the work on
    /// both streams, and waits for the copy. Overlapping ranges (a buffer into itself) raise
    /// OverlappingCopyError.
    fn copy_from_buffer(slf: &Bound<'_, Self>, other: &Bound<'_, Buffer>) -> Outcome<()> {
        let py = slf.py();
        // Both memories are held until the copy has finished, whatever closes meanwhile.
        let (dst, src) = (Self::in_use(slf)?, Self::in_use(other)?);
        if src.len() > dst.len() {
            return Err(cumempool::Error::DoesNotFit {
                what: "copying between buffers",
                requested: src.len(),
                capacity: dst.len(),
            }
            .into());
        }
        // A buffer copied into itself, say: the driver's copies are undefined there.
        let (to, from, len) = (dst.ptr(), src.ptr(), src.len());
        if len > 0 && to < from.saturating_add(len as u64) && from < to.saturating_add(len as u64) {
            return Err(
                cumempool::Error::OverlappingCopy { what: "copying between buffers", dst: to, src: from, len }.into()
            );
        }
        crate::gil::detach(py, || {
            src.order_before(dst.stream())?;
            // SAFETY: both allocations are held until the copy has finished.
            unsafe { dst.copy(dst.ptr(), src.ptr(), src.len()) }
        })
    }

    /// Sets every byte to `value`, ordered on the buffer's stream (pinned host memory: by the
    /// host, after the stream's earlier work).
    fn fill(slf: &Bound<'_, Self>, value: u8) -> Outcome<()> {
        let core = Self::in_use(slf)?;
        crate::gil::detach(slf.py(), || core.fill(value))
    }

    /// Gives the memory back, freed on its stream, after the work queued on `stream` so far
    /// when one is given (a Stream or another library's stream: the memory is then free only
    /// once that work is done too). A DLPack consumer still holding the memory keeps it until
    /// it lets go; after an array interface was read, the memory stays until this Buffer is
    /// collected (the arrays over it hold it). Using the buffer afterwards raises ClosedError;
    /// closing twice does nothing.
    #[pyo3(signature = (stream = None))]
    fn close(slf: &Bound<'_, Self>, stream: Option<&Bound<'_, PyAny>>) -> Outcome<()> {
        let py = slf.py();
        if let Some(stream) = stream.filter(|s| !s.is_none()) {
            let core = match Self::in_use(slf) {
                Ok(core) => core,
                Err(Failure::Closed(_)) => return Ok(()),
                Err(other) => return Err(other),
            };
            let producer = Stream::from_object(py, Some(stream), core.device)?;
            let ordered = crate::gil::detach(py, || core.order_after(producer.get()));
            crate::streams::let_go(py, producer);
            ordered?;
        }
        let slot = {
            let mut this = slf.try_borrow_mut().map_err(PyErr::from)?;
            let slot = this.core.take();
            if this.viewed {
                // Array views hold this object: the memory goes with it.
                match slot {
                    Some(Slot::Own(core)) => this.kept = Some(Arc::new(core)),
                    Some(Slot::Shared(core)) => this.kept = Some(core),
                    // Closed before: what is kept stays kept.
                    None => {}
                }
                return Ok(());
            }
            slot
        };
        if let Some(slot) = slot {
            Core::release(slot, py);
        }
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(slf: &Bound<'_, Self>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> Outcome<bool> {
        Self::close(slf, None)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match &self.core {
            Some(core) => format!(
                "Buffer(ptr={:#x}, size={}, kind={:?}, device={})",
                core.ptr(),
                core.len(),
                core.kind,
                core.device
            ),
            None => "Buffer(closed)".to_owned(),
        }
    }
}
