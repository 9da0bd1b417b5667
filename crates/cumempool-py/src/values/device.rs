//! CUDA devices as Python sees them, and the calling thread's current device, which every
//! binding that takes an optional device defaults to (as PyTorch, CuPy and cuda.core do).

use crate::errors::Outcome;
use pyo3::prelude::*;

/// A CUDA device.
#[pyclass(frozen, eq, hash, module = "cumempool", from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device(pub cumempool::Device);

#[pymethods]
impl Device {
    /// Device `ordinal` (default: the current device, as PyTorch, CuPy and cuda.core take it);
    /// raises InvalidDeviceError for one this machine lacks.
    #[new]
    #[pyo3(signature = (ordinal = None))]
    fn new(py: Python<'_>, ordinal: Option<i32>) -> Outcome<Self> {
        let ordinal = given_or_current(ordinal, py)?;
        Ok(Self(crate::sync::gil::detach(py, || cumempool::Device::get(ordinal))?))
    }

    /// How many devices the driver sees.
    #[staticmethod]
    fn count(py: Python<'_>) -> Outcome<i32> {
        Ok(crate::sync::gil::detach(py, cumempool::Device::count)?)
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

    /// `(free, total)`: the bytes of device memory free now, and all of it (what
    /// `cudaMemGetInfo` reports, and what Numba's memory managers answer).
    fn memory_info(&self, py: Python<'_>) -> Outcome<(usize, usize)> {
        let device = self.0;
        Ok(crate::sync::gil::detach(py, || {
            let context = device.primary_context()?;
            context.while_current(|| context.memory_info())
        })?)
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

    /// The export handle types its pools support, a `HandleTypes`.
    #[getter]
    fn supported_handle_types(&self, py: Python<'_>) -> Outcome<Py<PyAny>> {
        Ok(crate::values::enums::handle_types(py, self.0.supported_handle_types()?.bits())?)
    }

    /// Whether this device can access `peer`'s memory.
    fn can_access_peer(&self, peer: Device) -> Outcome<bool> {
        Ok(self.0.can_access_peer(peer.0)?)
    }

    /// Pickles as `Device(ordinal)`: the receiving process checks the ordinal against its own
    /// devices.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, pyo3::types::PyType>, (i32,)) {
        (slf.get_type(), (slf.get().0.ordinal(),))
    }

    fn __repr__(&self) -> String {
        format!("Device({})", self.0.ordinal())
    }
}

/// `device` where the caller gave one, else the current device: the default of every binding
/// that takes a device.
pub(crate) fn given_or_current(device: Option<i32>, py: pyo3::Python<'_>) -> Outcome<i32> {
    match device {
        Some(device) => Ok(device),
        None => current_device(py),
    }
}

/// The calling thread's current device, as PyTorch, CuPy and cuda.core take it: the device of the
/// current context, else device 0 (no context current yet).
pub(crate) fn current_device(py: pyo3::Python<'_>) -> Outcome<i32> {
    let device = crate::sync::gil::detach(py, cumempool::current_device)?;
    Ok(device.map_or(0, cumempool::Device::ordinal))
}
