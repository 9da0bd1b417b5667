//! The CuPy plug-in's call, native: `cumempool.cupy.Allocator` is a Python subclass of this
//! class, so CuPy's call to the allocator enters native code with no Python frame, and the
//! common case (the resource's device current, a stream that does not capture, no recording)
//! stays native to the return. Every other case goes to the Python class's
//! `_serve_in_python`, and every failure to its `_failed` (which turns an out-of-memory into
//! CuPy's class).

use crate::errors::{Failure, Outcome};
use crate::memory::buffers::Buffer;
use crate::pools::resources::ResourceBase;
use crate::streams::stream::Stream;
use pyo3::exceptions::{PyAttributeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::{PyTraverseError, PyVisit};

/// The native part of `cumempool.cupy.Allocator`: serves CuPy's allocations from a resource,
/// returning `cupy.cuda.MemoryPointer`s. Made with CuPy's own functions, so this crate imports
/// no CuPy.
#[pyclass(subclass, frozen, module = "cumempool._native", name = "Allocator")]
pub struct CupyAllocatorBase {
    resource: Py<ResourceBase>,
    /// `cupy.cuda.runtime.getDevice`: CuPy's current device.
    current_device: Py<PyAny>,
    /// `cupy.cuda.get_current_stream`.
    current_stream: Py<PyAny>,
    /// `cupy.cuda.UnownedMemory`.
    unowned_memory: Py<PyAny>,
    /// `cupy.cuda.MemoryPointer`.
    memory_pointer: Py<PyAny>,
    /// The globals of `cumempool._history`, whose `recording` is not None while recording.
    history: Py<PyDict>,
}

#[pymethods]
impl CupyAllocatorBase {
    #[new]
    fn new(
        resource: Py<ResourceBase>,
        current_device: Py<PyAny>,
        current_stream: Py<PyAny>,
        unowned_memory: Py<PyAny>,
        memory_pointer: Py<PyAny>,
        history: Py<PyDict>,
    ) -> Self {
        Self { resource, current_device, current_stream, unowned_memory, memory_pointer, history }
    }

    /// The resource the allocator draws from.
    #[getter]
    fn resource(&self, py: Python<'_>) -> Py<ResourceBase> {
        self.resource.clone_ref(py)
    }

    /// A `cupy.cuda.MemoryPointer` to `size` bytes on CuPy's current stream, owned by a
    /// `Buffer` that gives the memory back when CuPy lets go of it. Served natively where it
    /// can be, else by `self._serve_in_python(size)`; a failure of the native steps goes to
    /// `self._failed(size, error)`, which raises or returns a pointer served after all (the
    /// error itself is raised where it returns None or is missing).
    fn __call__(slf: &Bound<'_, Self>, size: usize) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let recording = this.history.bind(py).get_item(intern!(py, "recording"))?;
        if recording.is_none_or(|recorder| recorder.is_none()) {
            match this.serve(py, size) {
                Ok(Some(pointer)) => return Ok(pointer),
                Ok(None) => {}
                Err(failure) => {
                    let error = PyErr::from(failure);
                    let Ok(failed) = slf.getattr(intern!(py, "_failed")) else { return Err(error) };
                    return match failed.call1((size, error.value(py))) {
                        Ok(served) if !served.is_none() => Ok(served.unbind()),
                        Ok(_) => Err(error),
                        Err(raised) => Err(raised),
                    };
                }
            }
        }
        slf.call_method1(intern!(py, "_serve_in_python"), (size,)).map(Bound::unbind)
    }

    /// `self(size)` as a method, for `cupy.cuda.set_allocator(allocator.malloc)` as CuPy's own
    /// pools are installed (`MemoryPool().malloc`): CuPy then calls it without making an
    /// argument tuple, which the call of an object needs.
    fn malloc(slf: &Bound<'_, Self>, size: usize) -> PyResult<Py<PyAny>> {
        Self::__call__(slf, size)
    }

    /// For the Python steps (recording on): `size` bytes on CuPy's default stream `handle` (0,
    /// 1 or 2), which CuPy said does not capture, allocated as the native call allocates.
    fn _alloc_on_default_stream(&self, py: Python<'_>, size: usize, handle: usize) -> Outcome<Buffer> {
        let Some(stream) = Stream::for_default_handle(py, handle, self.resource.get().device)? else {
            return Err(PyValueError::new_err(format!(
                "handle {handle} is not a default stream's (0, 1 or 2): allocate on other streams with Resource.alloc"
            ))
            .into());
        };
        self.alloc_on(py, size, stream)
    }

    /// What the garbage collector follows: a cycle through the resource (an out-of-memory
    /// callback that holds the allocator) is found, and broken where it can be cleared.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.resource)?;
        visit.call(&self.current_device)?;
        visit.call(&self.current_stream)?;
        visit.call(&self.unowned_memory)?;
        visit.call(&self.memory_pointer)?;
        visit.call(&self.history)
    }
}

impl CupyAllocatorBase {
    /// The common case: a pointer, or `None` where the Python steps must serve the call (the
    /// resource's device is not the current one, or the stream captures into a graph, whose
    /// memory needs their keeping). Fails as `Resource.alloc` does (`OutOfMemoryError` at the
    /// resource's limit).
    fn serve(&self, py: Python<'_>, size: usize) -> Outcome<Option<Py<PyAny>>> {
        let resource = self.resource.get();
        if !self.device_is_current(py, resource.device)? {
            return Ok(None);
        }
        let stream = self.current_stream(py, resource.device)?;
        let buffer = if stream.get().stream.is_legacy() {
            // CuPy's per-thread stream is served on the legacy stream, yet may capture itself
            // (`Stream.ptds.begin_capture()`): its own capture, or no answer, goes to the Python
            // steps too. The null stream never captures: nothing is asked there.
            if stream.get().stream.is_capturing_keeping_context().unwrap_or(true) {
                crate::streams::stream::let_go(py, stream);
                return Ok(None);
            }
            self.alloc_on(py, size, stream)?
        } else {
            // First, the frees an earlier capture deferred on the stream, as `Resource.alloc`
            // runs them: a cache hit reaches no pool that would, and a stream served from the
            // cache would hold that memory for as long as every call hits.
            if stream.get().stream.may_be_capturing() {
                stream.get().stream.run_frees_deferred_by_a_capture();
            }
            // A capture on CuPy's stream, or no answer: the Python steps keep a capture's
            // memory for the graph. Asked once, with the allocation.
            match resource.alloc_unless_capturing(py, size, stream)? {
                Ok(buffer) => buffer,
                Err(stream) => {
                    crate::streams::stream::let_go(py, stream);
                    return Ok(None);
                }
            }
        };
        let (ptr, device) = buffer.address_and_device()?;
        let owner = Bound::new(py, buffer)?;
        let memory = self.unowned_memory.call1(py, (ptr, size, owner, device))?;
        Ok(Some(self.memory_pointer.call1(py, (memory, 0))?))
    }

    /// `size` bytes on `stream`, which does not capture, as a Buffer. On the legacy stream
    /// (CuPy's null and per-thread streams) nothing of the blocking streams beside it is asked
    /// first (`serve` asks only whether the per-thread stream captures itself): a block a cache holds for
    /// it is served with no work queued there, and the core asks before any work it queues
    /// (`Stream::ensure_not_capturing`), whose refusal for a blocking stream's capture is
    /// reported in CuPy's words.
    fn alloc_on(&self, py: Python<'_>, size: usize, stream: Py<Stream>) -> Outcome<Buffer> {
        let on_legacy = stream.get().stream.is_legacy();
        match self.resource.get().alloc_outside_captures(py, size, stream) {
            Err(Failure::Core(cumempool::Error::StreamCapturing { capture: None, .. })) if on_legacy => {
                Err(Failure::Core(cumempool::Error::StreamCapturing { operation: BESIDE_A_CAPTURE, capture: None }))
            }
            allocated => allocated,
        }
    }

    /// Whether `device` is CuPy's current device. CuPy's is the runtime's (`cudaGetDevice`),
    /// which is the current context's device: where `device`'s primary context (retained by an
    /// earlier call) is current, that is the answer without a call into CuPy; otherwise CuPy
    /// is asked.
    fn device_is_current(&self, py: Python<'_>, device: i32) -> Outcome<bool> {
        if let Some(context) = crate::streams::primary_contexts::primary_context_if_retained(device) {
            if matches!(context.is_current(), Ok(true)) {
                return Ok(true);
            }
        }
        Ok(self.current_device.call0(py)?.extract::<i32>(py)? == device)
    }

    /// CuPy's current stream, as served on `device` (the current device). A default stream
    /// (CuPy's null stream, its per-thread stream) is served from its handle, `ptr`, alone:
    /// those streams outlive every object, and this skips the other libraries' attributes the
    /// general conversion looks for first. Any other stream goes through the lent-stream memo,
    /// which keeps CuPy's object (CuPy destroys the stream when its object goes); the handle
    /// just read stands for the memo's question of the object.
    fn current_stream(&self, py: Python<'_>, device: i32) -> Outcome<Py<Stream>> {
        let stream_object = self.current_stream.call0(py)?;
        let stream_object = stream_object.bind(py);
        match stream_object.getattr(intern!(py, "ptr")) {
            Ok(ptr) => {
                if let Ok(raw) = ptr.extract::<usize>() {
                    if let Some(stream) = Stream::for_default_handle(py, raw, device)? {
                        return Ok(stream);
                    }
                    return Stream::from_object_with_handle(py, stream_object, raw, device);
                }
            }
            // No `ptr`: not a CuPy stream; the general conversion says what it is.
            Err(error) if error.is_instance_of::<PyAttributeError>(py) => {}
            Err(error) => return Err(error.into()),
        }
        Stream::from_object(py, Some(stream_object), device)
    }
}

/// Why an allocation on CuPy's null or per-thread default stream (both queue on the legacy
/// stream) was refused: it needed work there (the cache had no block for it), which the driver
/// refuses while a blocking stream of the device captures, invalidating that capture. The core
/// asks before any such work; a block the cache serves queues none, so nothing is asked for it.
const BESIDE_A_CAPTURE: &str = "allocating for CuPy on its null or per-thread default stream (work there would invalidate a capture underway on a blocking stream of the device: allocate on another stream, or after the capture)";
