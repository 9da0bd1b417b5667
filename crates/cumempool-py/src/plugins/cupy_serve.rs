//! The CuPy plug-in's allocation in one native call: what `cumempool.cupy.Allocator` does for
//! each of CuPy's allocations on a stream that does not capture, without a Python frame per
//! step. The Python class keeps every other case (another device current, a capture, recording)
//! and turns an out-of-memory into CuPy's class.

use crate::errors::Outcome;
use crate::pools::resources::ResourceBase;
use crate::streams::stream::Stream;
use pyo3::prelude::*;

/// Serves CuPy's allocations from a resource, returning `cupy.cuda.MemoryPointer`s; made by
/// `cumempool.cupy.Allocator` with CuPy's own functions, so this crate imports no CuPy.
#[pyclass(frozen, module = "cumempool._native", name = "_CupyServe")]
pub struct CupyServe {
    resource: Py<ResourceBase>,
    /// `cupy.cuda.runtime.getDevice`: CuPy's current device.
    current_device: Py<PyAny>,
    /// `cupy.cuda.get_current_stream`.
    current_stream: Py<PyAny>,
    /// `cupy.cuda.UnownedMemory`.
    unowned_memory: Py<PyAny>,
    /// `cupy.cuda.MemoryPointer`.
    memory_pointer: Py<PyAny>,
}

#[pymethods]
impl CupyServe {
    #[new]
    fn new(
        resource: Py<ResourceBase>,
        current_device: Py<PyAny>,
        current_stream: Py<PyAny>,
        unowned_memory: Py<PyAny>,
        memory_pointer: Py<PyAny>,
    ) -> Self {
        Self { resource, current_device, current_stream, unowned_memory, memory_pointer }
    }

    /// A `cupy.cuda.MemoryPointer` to `size` bytes on CuPy's current stream, owned by a
    /// `Buffer` that gives the memory back when CuPy lets go of it; `None` where the caller must
    /// serve the call itself: the resource's device is not the current one, or the stream
    /// captures into a graph (whose memory needs the caller's keeping). Raises what
    /// `Resource.alloc` raises (`OutOfMemoryError` at the resource's limit).
    fn __call__(&self, py: Python<'_>, size: usize) -> Outcome<Option<Py<PyAny>>> {
        let resource = self.resource.get();
        if self.current_device.call0(py)?.extract::<i32>(py)? != resource.device {
            return Ok(None);
        }
        let stream_object = self.current_stream.call0(py)?;
        let stream = Stream::from_object(py, Some(stream_object.bind(py)), resource.device)?;
        if capture_possible(&stream.get().stream) {
            crate::streams::stream::let_go(py, stream);
            return Ok(None);
        }
        let buffer = resource.alloc_outside_captures(py, size, stream)?;
        let (ptr, device) = buffer.address_and_device()?;
        let owner = Bound::new(py, buffer)?;
        let memory = self.unowned_memory.call1(py, (ptr, size, owner, device))?;
        Ok(Some(self.memory_pointer.call1(py, (memory, 0))?))
    }
}

/// Whether a capture may stand in the way of allocating on `stream`, asked without harm to one:
/// a stream that may capture is asked; the legacy stream (CuPy's null stream) cannot capture,
/// but the driver refuses work on it while a blocking stream of its context captures, and says
/// so when asked (CuPy's own query raises then, which the Python steps pass on). An answer that
/// cannot be had leaves the call to the Python steps.
fn capture_possible(stream: &cumempool::Stream) -> bool {
    if stream.may_be_capturing() {
        return stream.is_capturing().unwrap_or(true);
    }
    if !stream.as_raw().is_null() {
        return false;
    }
    cumempool::keeping_current_context(|| stream.capture_status())
        .map_or(true, |status| status != cumempool::CaptureStatus::None)
}
