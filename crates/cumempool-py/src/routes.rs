//! Locations, allocation types and routes: the keys the driver keeps pools under.

use crate::errors::{Failure, Outcome};
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyType};

/// What `__reduce__` answers for pickling: a callable and its arguments.
type Reduced<'py> = (Bound<'py, PyAny>, Bound<'py, PyTuple>);

/// Where memory lives: a device, the host, a host NUMA node, no preference (managed pools
/// only) or, with CUDA 13.4, one locality domain of a device.
#[pyclass(frozen, eq, hash, module = "cumempool", from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Location(pub cumempool::Location);

#[pymethods]
impl Location {
    /// A device, by ordinal.
    #[staticmethod]
    fn device(ordinal: i32) -> Self {
        Self(cumempool::Location::Device(ordinal))
    }

    /// Host memory on no particular NUMA node.
    #[staticmethod]
    fn host() -> Self {
        Self(cumempool::Location::Host)
    }

    /// Host memory on one NUMA node.
    #[staticmethod]
    fn host_numa(node: i32) -> Self {
        Self(cumempool::Location::HostNuma(node))
    }

    /// Host memory on the NUMA node of the calling thread.
    #[staticmethod]
    fn host_numa_current() -> Self {
        Self(cumempool::Location::HostNumaCurrent)
    }

    /// No preferred location: managed pools only.
    #[staticmethod]
    fn unspecified() -> Self {
        Self(cumempool::Location::Unspecified)
    }

    /// One locality domain of a device (CUDA 13.4).
    #[staticmethod]
    fn locality_domain(device: i32, domain: u8) -> Outcome<Self> {
        locality_domain_location(device, domain).map(Self)
    }

    /// The device ordinal for device locations, else `None`.
    #[getter]
    fn device_ordinal(&self) -> Option<i32> {
        self.0.device()
    }

    /// Whether this is host memory (any node).
    #[getter]
    fn is_host(&self) -> bool {
        self.0.is_host()
    }

    /// Pickles as the constructor that makes it again, so a location crosses to another
    /// process (`multiprocessing`). A location only the driver reports (invisible, unknown)
    /// has no constructor and is refused.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Reduced<'py>> {
        use cumempool::Location as L;
        let py = slf.py();
        let (name, args) = match slf.get().0 {
            L::Device(ordinal) => ("device", PyTuple::new(py, [ordinal])?),
            L::Host => ("host", PyTuple::empty(py)),
            L::HostNuma(node) => ("host_numa", PyTuple::new(py, [node])?),
            L::HostNumaCurrent => ("host_numa_current", PyTuple::empty(py)),
            L::Unspecified => ("unspecified", PyTuple::empty(py)),
            #[cfg(feature = "cuda-13040")]
            L::DeviceLocalityDomain { device, domain } => ("locality_domain", (device, domain).into_pyobject(py)?),
            other => {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "the location {other} is one only the driver reports, and cannot be pickled"
                )))
            }
        };
        Ok((slf.get_type().getattr(name)?, args))
    }

    fn __repr__(&self) -> String {
        format!("Location({})", self.0)
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }
}

#[cfg(feature = "cuda-13040")]
fn locality_domain_location(device: i32, domain: u8) -> Outcome<cumempool::Location> {
    Ok(cumempool::Location::DeviceLocalityDomain { device, domain })
}

#[cfg(not(feature = "cuda-13040"))]
fn locality_domain_location(_device: i32, _domain: u8) -> Outcome<cumempool::Location> {
    Err(crate::errors::too_old(
        "locality domains (this build lacks the cuda-13040 feature)",
        cumempool::DriverVersion::CUDA_13_4,
    ))
}

/// The kind of memory a pool hands out.
#[pyclass(frozen, eq, eq_int, hash, module = "cumempool", from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
pub enum AllocationType {
    /// Memory that stays where it was allocated.
    PINNED,
    /// Managed (unified) memory, which migrates between host and devices.
    MANAGED,
}

#[pymethods]
impl AllocationType {
    /// Pickles as `getattr(AllocationType, name)`: the one member of that name.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Reduced<'py>> {
        let name = match *slf.get() {
            Self::PINNED => "PINNED",
            Self::MANAGED => "MANAGED",
        };
        let getattr = PyModule::import(slf.py(), "builtins")?.getattr("getattr")?;
        Ok((getattr, (slf.as_any().get_type(), name).into_pyobject(slf.py())?))
    }
}

impl AllocationType {
    fn to_rust(self) -> cumempool::AllocationType {
        match self {
            Self::PINNED => cumempool::AllocationType::Pinned,
            Self::MANAGED => cumempool::AllocationType::Managed,
        }
    }

    pub(crate) fn from_rust(value: cumempool::AllocationType) -> Self {
        match value {
            cumempool::AllocationType::Managed => Self::MANAGED,
            _ => Self::PINNED,
        }
    }
}

/// A (location, allocation type) pair: the key under which CUDA keeps a default pool and a
/// current pool. Routes that cannot exist on any machine are refused when made.
#[pyclass(frozen, eq, hash, module = "cumempool", from_py_object)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route(pub cumempool::Route);

impl Route {
    fn checked(route: cumempool::Route) -> Outcome<Self> {
        route.check_shape().map_err(|e| Failure::Core(e.into()))?;
        Ok(Self(route))
    }
}

#[pymethods]
impl Route {
    #[new]
    #[pyo3(signature = (location, allocation_type = AllocationType::PINNED))]
    fn new(location: Location, allocation_type: AllocationType) -> Outcome<Self> {
        Self::checked(cumempool::Route::new(location.0, allocation_type.to_rust()))
    }

    /// Pinned memory on a device: the classic device pool.
    #[staticmethod]
    fn device(ordinal: i32) -> Outcome<Self> {
        Self::checked(cumempool::Route::device(ordinal))
    }

    /// Pinned host memory.
    #[staticmethod]
    fn host() -> Self {
        Self(cumempool::Route::host())
    }

    /// Pinned host memory on one NUMA node.
    #[staticmethod]
    fn host_numa(node: i32) -> Outcome<Self> {
        Self::checked(cumempool::Route::host_numa(node))
    }

    /// Managed memory preferring `location` (a device, the host, or none).
    #[staticmethod]
    #[pyo3(signature = (location = None))]
    fn managed(location: Option<Location>) -> Outcome<Self> {
        let location = location.map_or(cumempool::Location::Unspecified, |l| l.0);
        Self::checked(cumempool::Route::managed(location))
    }

    /// Pinned memory in one locality domain of a device (CUDA 13.4).
    #[staticmethod]
    fn locality_domain(device: i32, domain: u8) -> Outcome<Self> {
        let location = locality_domain_location(device, domain)?;
        Self::checked(cumempool::Route::new(location, cumempool::AllocationType::Pinned))
    }

    /// Where the memory lives.
    #[getter]
    fn location(&self) -> Location {
        Location(self.0.location)
    }

    /// What kind of memory it is.
    #[getter]
    fn allocation_type(&self) -> AllocationType {
        AllocationType::from_rust(self.0.allocation_type)
    }

    /// Whether the host may touch this route's memory (once its stream is idle).
    #[getter]
    fn is_host_accessible(&self) -> bool {
        self.0.is_host_accessible()
    }

    /// Checks the route against this machine's devices (raises if it cannot exist here).
    fn validate(&self, py: Python<'_>) -> Outcome<()> {
        let route = self.0;
        Ok(crate::gil::detach(py, || route.validate())?)
    }

    /// Pickles as `Route(location, allocation_type)`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, (Location, AllocationType)) {
        let route = slf.get().0;
        (slf.get_type(), (Location(route.location), AllocationType::from_rust(route.allocation_type)))
    }

    fn __repr__(&self) -> String {
        format!("Route({})", self.0)
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }
}
