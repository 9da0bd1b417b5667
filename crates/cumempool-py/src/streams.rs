//! Devices and streams: cumempool's own, and those of PyTorch, CuPy, cuda.core or any object
//! with `__cuda_stream__`, borrowed while a reference to their Python object is held.

use crate::errors::{Failure, Outcome};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::{Mutex, PoisonError};

/// A CUDA device.
#[pyclass(frozen, eq, hash, module = "cumempool", from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device(pub cumempool::Device);

#[pymethods]
impl Device {
    /// Device `ordinal` (raises InvalidDeviceError for one this machine lacks).
    #[new]
    #[pyo3(signature = (ordinal = 0))]
    fn new(py: Python<'_>, ordinal: i32) -> Outcome<Self> {
        Ok(Self(py.detach(|| cumempool::Device::get(ordinal))?))
    }

    /// How many devices the driver sees.
    #[staticmethod]
    fn count(py: Python<'_>) -> Outcome<i32> {
        Ok(py.detach(cumempool::Device::count)?)
    }

    /// The ordinal.
    #[getter]
    fn ordinal(&self) -> i32 {
        self.0.ordinal()
    }

    /// The device's name.
    #[getter]
    fn name(&self) -> Outcome<String> {
        Ok(self.0.name()?)
    }

    /// Bytes of memory on the device.
    #[getter]
    fn total_memory(&self) -> Outcome<usize> {
        Ok(self.0.total_memory()?)
    }

    /// Whether the device supports stream-ordered pools.
    #[getter]
    fn supports_memory_pools(&self) -> Outcome<bool> {
        Ok(self.0.supports_memory_pools()?)
    }

    /// Whether the device can use pools of pinned host memory.
    #[getter]
    fn supports_host_memory_pools(&self) -> Outcome<bool> {
        Ok(self.0.supports_host_memory_pools()?)
    }

    /// The export handle types its pools support, as a bit set (`HandleTypes`).
    #[getter]
    fn supported_handle_types(&self) -> Outcome<u32> {
        Ok(self.0.supported_handle_types()?.bits())
    }

    /// Whether this device can access `peer`'s memory.
    fn can_access_peer(&self, peer: Device) -> Outcome<bool> {
        Ok(self.0.can_access_peer(peer.0)?)
    }

    fn __repr__(&self) -> String {
        format!("Device({})", self.0.ordinal())
    }
}

/// A CUDA stream: one cumempool created (`Stream(device)`), the legacy default stream of a
/// device (`Stream.legacy(device)`), or another library's stream (`Stream.borrow(obj)`), kept
/// alive by holding its Python object.
#[pyclass(frozen, module = "cumempool")]
pub struct Stream {
    pub(crate) stream: cumempool::Stream,
    /// The lending library's stream object, held so its stream outlives every use here.
    owner: Option<Py<PyAny>>,
    pub(crate) device: i32,
}

impl Stream {
    fn context(py: Python<'_>, device: i32) -> Outcome<cumempool::Context> {
        Ok(py.detach(|| cumempool::Device::get(device)?.primary_context())?)
    }

    /// Whether another library lent the stream (its object is held).
    pub(crate) fn is_lent(&self) -> bool {
        self.owner.is_some()
    }

    /// The legacy default stream of `device`.
    pub(crate) fn legacy_of(py: Python<'_>, device: i32) -> Outcome<Self> {
        let context = Self::context(py, device)?;
        Ok(Self { stream: cumempool::Stream::legacy(&context), owner: None, device })
    }

    /// The legacy default stream of `device`, one object per device for the process, so a
    /// cache sees one stream and no context is retained per call.
    fn shared_legacy(py: Python<'_>, device: i32) -> Outcome<Py<Self>> {
        static LEGACY: Mutex<Vec<(i32, Py<Stream>)>> = Mutex::new(Vec::new());
        if let Some((_, stream)) =
            LEGACY.lock().unwrap_or_else(PoisonError::into_inner).iter().find(|(d, _)| *d == device)
        {
            return Ok(stream.clone_ref(py));
        }
        let stream = Py::new(py, Self::legacy_of(py, device)?)?;
        LEGACY.lock().unwrap_or_else(PoisonError::into_inner).push((device, stream.clone_ref(py)));
        Ok(stream)
    }

    /// Borrows `raw`, a stream of `device`, keeping `owner` alive as long as this stream.
    pub(crate) fn borrow_handle(py: Python<'_>, raw: usize, device: i32, owner: Option<Py<PyAny>>) -> Outcome<Self> {
        let context = Self::context(py, device)?;
        // SAFETY: `raw` is the lending library's stream of `device` and `owner` (its Python
        // object, or the caller's promise for a bare int) keeps it alive while this Stream and
        // every buffer holding it live; buffers hold this object.
        let stream = unsafe { cumempool::Stream::borrow_raw(raw as cumempool::sys::CUstream, Some(&context)) }?;
        Ok(Self { stream, owner, device })
    }

    /// What `obj` names as a stream: a `Stream`, an object with `__cuda_stream__`, a PyTorch
    /// stream (`cuda_stream`), a CuPy stream (`ptr`), or a raw int handle. `None` is the legacy
    /// default stream of `default_device`.
    pub(crate) fn from_object(
        py: Python<'_>,
        obj: Option<&Bound<'_, PyAny>>,
        default_device: i32,
    ) -> Outcome<Py<Self>> {
        let Some(obj) = obj.filter(|o| !o.is_none()) else {
            return Self::shared_legacy(py, default_device);
        };
        if let Ok(stream) = obj.cast::<Self>() {
            return Ok(stream.clone().unbind());
        }
        let (raw, device) = foreign_handle(obj, default_device)?;
        Ok(Py::new(py, Self::borrow_handle(py, raw, device, Some(obj.clone().unbind()))?)?)
    }
}

/// The raw handle and device of another library's stream object.
fn foreign_handle(obj: &Bound<'_, PyAny>, default_device: i32) -> Outcome<(usize, i32)> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err("a stream is a Stream, an object with __cuda_stream__, a torch or CuPy stream, or an int handle; got a bool").into());
    }
    if let Ok(raw) = obj.extract::<usize>() {
        return Ok((raw, default_device));
    }
    let device = device_of(obj).unwrap_or(default_device);
    if obj.hasattr("__cuda_stream__")? {
        let answer = obj.call_method0("__cuda_stream__")?;
        let pair = answer
            .cast::<PyTuple>()
            .map_err(|_| PyValueError::new_err("__cuda_stream__() must return a (version, handle) tuple"))?;
        if pair.len() != 2 {
            return Err(PyValueError::new_err("__cuda_stream__() must return a (version, handle) tuple").into());
        }
        return Ok((pair.get_item(1)?.extract::<usize>()?, device));
    }
    for attribute in ["cuda_stream", "ptr"] {
        if let Ok(value) = obj.getattr(attribute) {
            if let Ok(raw) = value.extract::<usize>() {
                return Ok((raw, device));
            }
        }
    }
    Err(Failure::Python(PyTypeError::new_err(format!(
        "cannot use a {} as a stream: pass a cumempool.Stream, an object with __cuda_stream__ (cuda.core), a torch.cuda.Stream, a cupy.cuda.Stream, or an int handle",
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
    ))))
}

/// The device of a torch (`device.index`), CuPy (`device_id`) or cuda.core (`device.device_id`)
/// stream.
fn device_of(obj: &Bound<'_, PyAny>) -> Option<i32> {
    if let Ok(id) = obj.getattr("device_id").and_then(|v| v.extract::<i32>()) {
        return Some(id);
    }
    let device = obj.getattr("device").ok()?;
    for attribute in ["index", "device_id"] {
        if let Ok(id) = device.getattr(attribute).and_then(|v| v.extract::<i32>()) {
            return Some(id);
        }
    }
    None
}

#[pymethods]
impl Stream {
    /// A new non-blocking stream on `device`, destroyed with its last holder.
    #[new]
    #[pyo3(signature = (device = 0))]
    fn new(py: Python<'_>, device: i32) -> Outcome<Self> {
        let context = Self::context(py, device)?;
        let stream = py.detach(|| cumempool::Stream::new(&context))?;
        Ok(Self { stream, owner: None, device })
    }

    /// The legacy default stream (`0`) of `device`.
    #[staticmethod]
    #[pyo3(signature = (device = 0))]
    fn legacy(py: Python<'_>, device: i32) -> Outcome<Self> {
        Self::legacy_of(py, device)
    }

    /// Borrows another library's stream: an object with `__cuda_stream__`, a torch or CuPy
    /// stream, or an int handle (of `device`, default: the object's device or 0). The object is
    /// held; a bare int must stay valid while this Stream and its buffers live.
    #[staticmethod]
    #[pyo3(signature = (obj, device = None))]
    fn borrow(py: Python<'_>, obj: &Bound<'_, PyAny>, device: Option<i32>) -> Outcome<Py<Self>> {
        if let (Some(device), Ok(raw)) = (device, obj.extract::<usize>()) {
            return Ok(Py::new(py, Self::borrow_handle(py, raw, device, None)?)?);
        }
        Self::from_object(py, Some(obj), device.unwrap_or(0))
    }

    /// The raw `CUstream` as an int.
    #[getter]
    fn handle(&self) -> usize {
        self.stream.as_raw() as usize
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// Whether cumempool created (and will destroy) the stream.
    #[getter]
    fn is_owned(&self) -> bool {
        self.stream.is_owned()
    }

    /// The borrowed library object, if any.
    #[getter]
    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.owner.as_ref().map(|o| o.clone_ref(py))
    }

    /// Waits for all work queued on the stream.
    fn synchronize(&self, py: Python<'_>) -> Outcome<()> {
        Ok(py.detach(|| self.stream.synchronize())?)
    }

    /// Whether all queued work has finished.
    fn is_idle(&self, py: Python<'_>) -> Outcome<bool> {
        Ok(py.detach(|| self.stream.is_idle())?)
    }

    /// cuda.core's stream protocol: `(0, handle)`.
    fn __cuda_stream__(&self) -> (u32, usize) {
        (0, self.handle())
    }

    fn __int__(&self) -> usize {
        self.handle()
    }

    fn __repr__(&self) -> String {
        format!("Stream(handle={:#x}, device={}, owned={})", self.handle(), self.device, self.stream.is_owned())
    }
}
