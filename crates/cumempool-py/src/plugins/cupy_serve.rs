//! The CuPy plug-in's allocation in one native call: what `cumempool.cupy.Allocator` does for
//! each of CuPy's allocations on a stream that does not capture, without a Python frame per
//! step. The Python class keeps every other case (another device current, a capture, recording)
//! and turns an out-of-memory into CuPy's class.

use crate::errors::{Failure, Outcome};
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
        // Held until the allocation is made: the layers below (a cache, the pool) take the
        // stream as checked, and ask the driver no more.
        let checked = match not_capturing(&stream.get().stream, resource.device) {
            Ok(Some(checked)) => checked,
            outcome => {
                crate::streams::stream::let_go(py, stream);
                return outcome.map(|_| None);
            }
        };
        let buffer = resource.alloc_outside_captures(py, size, stream);
        drop(checked);
        let buffer = buffer?;
        let (ptr, device) = buffer.address_and_device()?;
        let owner = Bound::new(py, buffer)?;
        let memory = self.unowned_memory.call1(py, (ptr, size, owner, device))?;
        Ok(Some(self.memory_pointer.call1(py, (memory, 0))?))
    }
}

/// `stream` checked not capturing, for the native steps; `None` where the Python steps must
/// serve the call: a capture on it (its memory is kept for the graph there), or an answer that
/// cannot be had. Work queued on the legacy stream (CuPy's null stream, or its per-thread
/// stream, served as the legacy one) while a blocking stream of the device captures would be
/// refused by the driver, which would invalidate that capture: refused here first, asked in a
/// way that leaves the capture intact.
fn not_capturing(stream: &cumempool::Stream, device: i32) -> Outcome<Option<cumempool::CaptureChecked>> {
    let Ok(checked) = stream.check_not_capturing("allocating for CuPy") else {
        return Ok(None);
    };
    if stream.as_raw().is_null() && crate::streams::default_streams::legacy_stream_blocked(device) {
        return Err(Failure::Core(cumempool::Error::StreamCapturing {
            operation: "allocating for CuPy on its null or per-thread default stream (work there would invalidate a capture underway on a blocking stream of the device: allocate on another stream, or after the capture)",
            capture: None,
        }));
    }
    Ok(Some(checked))
}
