//! Buffers handed to Python: stream-ordered memory with `__cuda_array_interface__`, DLPack,
//! NumPy's `__array_interface__` (host-accessible memory) and copies to and from bytes.

use crate::errors::{Failure, Outcome};
use crate::memory::dlpack;
use crate::memory::{Core, Kind, Slot};
use crate::streams::default_streams::LEGACY_HANDLE;
use crate::streams::stream::Stream;
use pyo3::exceptions::{PyAttributeError, PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Stream-ordered memory from a pool or a resource. Freed on its stream by `close()`, by
/// leaving its `with` block, or when collected, unless a DLPack consumer still holds it, or an
/// array interface was read (then the memory goes when this Buffer does, which the arrays made
/// over it keep alive).
///
/// Example: `with pool.alloc(1 << 20, stream) as buf: buf.fill(0)`.
#[pyclass(module = "cumempool")]
pub struct Buffer {
    core: Option<Slot>,
    /// Whether an array interface handed the address out: `close()` then keeps the memory in
    /// `kept` until this object goes (the interfaces' consumers hold this object, not the
    /// memory).
    viewed: bool,
    /// The memory of a closed buffer that array views may still use (behind an `Arc`, so the
    /// object stays small).
    kept: Option<Arc<Core>>,
}

impl Drop for Buffer {
    /// A buffer collected without `close()` gives its memory back as `close()` does (Python
    /// deallocates objects with the GIL held).
    fn drop(&mut self) {
        if self.core.is_none() && self.kept.is_none() {
            return;
        }
        Python::attach(|py| {
            if let Some(core) = self.core.take() {
                Core::release(core, py);
            }
            if let Some(kept) = self.kept.take() {
                Core::release(Slot::Shared(kept), py);
            }
        });
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

impl InUse {
    /// The core, for a holder that lets go of it itself (a DLPack capsule's context).
    pub(crate) fn hand_on(self) -> Arc<Core> {
        let mut this = ManuallyDrop::new(self);
        // SAFETY: taken once; `this` is never dropped, so `Drop` does not take it again.
        unsafe { ManuallyDrop::take(&mut this.0) }
    }
}

impl Buffer {
    pub(crate) fn new(core: Core) -> Self {
        Self { core: Some(Slot::Own(core)), viewed: false, kept: None }
    }

    pub(crate) fn core(&self) -> Outcome<&Core> {
        self.core.as_deref().ok_or(Failure::Closed("this Buffer"))
    }

    /// The address, as an int, and the device the memory is on.
    pub(crate) fn address_and_device(&self) -> Outcome<(usize, i32)> {
        let core = self.core()?;
        Ok((core.ptr() as usize, core.device))
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
            // The consumer may capture the stream it reads here: marked as `Stream.handle` does.
            dict.set_item("stream", core.stream_object().get().lent_raw().max(1))?;
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
        Ok(self.core()?.kind.name())
    }

    /// The stream the buffer is ordered on.
    #[getter]
    fn stream(&self, py: Python<'_>) -> Outcome<Py<Stream>> {
        Ok(self.core()?.stream_object().clone_ref(py))
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.core.is_none()
    }

    /// CUDA Array Interface version 3: a 1-D array of bytes, with the buffer's stream for the
    /// consumer to synchronise on. Once this was read, `close()` leaves the memory to the
    /// Buffer's end (when the last array over it lets go of it).
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
    /// `"dltensor"`. `stream` is the consumer's stream on the memory's device, made to wait for
    /// this buffer's work: 1 the legacy default stream, 2 the per-thread default stream, a
    /// stream handle, -1 no ordering; 0 is refused, as DLPack says for CUDA. `None` is 1 for
    /// device memory; for host or managed memory it waits for the buffer's work before
    /// returning. A consumer stream capturing a CUDA graph raises StreamCapturingError.
    /// `dl_device` may name the memory's own device, or `(1, 0)` (the CPU) for host or managed
    /// memory; another device, or `copy=True`, raises BufferError.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> Outcome<Py<PyAny>> {
        let py = slf.py();
        // In use, not a bare share: an error below, after a `close()` on another thread while
        // the GIL was released, then lets go of it as the last holder must.
        let core = Self::in_use(slf)?;
        let mut device = dlpack::device_of(&core);
        // Host-accessible memory may be handed to a CPU consumer as CPU memory.
        if dl_device == Some((dlpack::KDL_CPU, 0)) && core.kind != Kind::Device {
            device = (dlpack::KDL_CPU, 0);
        }
        if let Some(wanted) = dl_device.filter(|&wanted| wanted != device) {
            return Err(PyBufferError::new_err(format!(
                "this buffer is on DLPack device {device:?} and cannot be exported to {wanted:?} without a copy"
            ))
            .into());
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "cumempool buffers export without a copy only; copy into a new buffer with copy_from_buffer",
            )
            .into());
        }
        // `None` inside: a host consumer, for whom the host waits for the buffer's work.
        let consumer = match stream {
            Some(-1) => None,
            None if core.kind != Kind::Device => Some(None),
            None => Some(Some(LEGACY_HANDLE)),
            Some(raw) if raw > 0 => Some(Some(raw as usize)),
            Some(raw) => {
                return Err(PyValueError::new_err(format!(
                    "stream={raw} is not a DLPack stream for CUDA memory: pass -1 (no ordering), None or 1 (the legacy default stream), 2 (the per-thread default stream) or a stream handle"
                ))
                .into())
            }
        };
        if let Some(consumer) = consumer {
            // The consumer's stream is on the memory's device (DLPack).
            crate::sync::gil::detach(py, || {
                let context = crate::streams::primary_contexts::primary_context(core.device)?;
                core.order_before_consumer(consumer, &context)
            })?;
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        Ok(dlpack::capsule(py, core.hand_on(), versioned, device)?.into_any().unbind())
    }

    /// The data another process needs to map this allocation from the pool it imported
    /// (`MemPool.import_buffer`): a picklable `SharedAllocation`. The pool must be created with
    /// `handle_types=HandleTypes.POSIX_FILE_DESCRIPTOR` and exported first (`export_fd` or
    /// `send`). Keep this buffer until the importer has closed its mapping.
    fn export(slf: &Bound<'_, Self>) -> Outcome<crate::memory::sharing::SharedAllocation> {
        let core = Self::in_use(slf)?;
        crate::memory::sharing::export_allocation(slf.py(), &core)
    }

    /// `(device type, device id)`: CUDA 2, CUDA host 3, CUDA managed 13.
    fn __dlpack_device__(&self) -> Outcome<(i32, i32)> {
        Ok(dlpack::device_of(self.core()?))
    }

    /// Copies a bytes-like object (anything with the buffer protocol: bytes, bytearray,
    /// memoryview, a NumPy array) into the start of the buffer and waits for the copy. Data
    /// longer than the buffer raises DoesNotFitError.
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
        // `bytes` is immutable and held until the copy, which waits, has finished.
        crate::sync::gil::detach(py, || core.with_block(|block| block.copy_from_host(src)))
    }

    /// The buffer's bytes (its first `size` bytes, all by default), after its stream's work.
    /// A `size` beyond the buffer raises DoesNotFitError.
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
            // `dst` is `len` writable bytes, alive until the copy, which waits, has finished.
            if let Err(error) = crate::sync::gil::detach(py, || core.with_block(|block| block.copy_to_host(dst))) {
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
    /// both streams, and waits for the copy. A larger `other` raises DoesNotFitError,
    /// overlapping ranges (a buffer into itself) OverlappingCopyError.
    fn copy_from_buffer(slf: &Bound<'_, Self>, other: &Bound<'_, Buffer>) -> Outcome<()> {
        let py = slf.py();
        // Both memories are held until the copy has finished, whatever closes meanwhile.
        let (dst, src) = (Self::in_use(slf)?, Self::in_use(other)?);
        crate::sync::gil::detach(py, || dst.with_block(|to| to.copy_from(&src.block())))
    }

    /// Sets every byte to `value`, ordered on the buffer's stream. For pinned host memory the
    /// call first waits for the stream's earlier work, and returns with the bytes set.
    fn fill(slf: &Bound<'_, Self>, value: u8) -> Outcome<()> {
        let core = Self::in_use(slf)?;
        crate::sync::gil::detach(slf.py(), || core.with_block(|block| block.fill(value)))
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
            let ordered = crate::sync::gil::detach(py, || core.order_release_after(producer.get()));
            crate::streams::stream::let_go(py, producer);
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
