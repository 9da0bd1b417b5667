//! Locations, allocation types and routes as Python values: the keys the driver keeps pools
//! under. Immutable and hashable; a route that cannot exist on any machine is refused when
//! made; pickling and reprs use the constructor that makes a value again (a location only the
//! driver reports has none).

use crate::errors::{Failure, Outcome};
use crate::values::build_features::gated;
use crate::values::enums::PyEnum;
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
        let location = slf.get().0;
        let Some((name, args)) = constructor(location) else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "the location {location} is one only the driver reports, and cannot be pickled"
            )));
        };
        Ok((slf.get_type().getattr(name)?, PyTuple::new(slf.py(), args)?))
    }

    /// The constructor call that makes it again (`Location.device(0)`), or the driver's words
    /// in angle brackets for a location only the driver reports.
    fn __repr__(&self) -> String {
        location_repr(self.0)
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }
}

/// The static method of `Location` that makes `location` again and its arguments; `None` for a
/// location only the driver reports (invisible, unknown).
fn constructor(location: cumempool::Location) -> Option<(&'static str, Vec<i64>)> {
    use cumempool::Location as L;
    Some(match location {
        L::Device(ordinal) => ("device", vec![ordinal.into()]),
        L::Host => ("host", Vec::new()),
        L::HostNuma(node) => ("host_numa", vec![node.into()]),
        L::HostNumaCurrent => ("host_numa_current", Vec::new()),
        L::Unspecified => ("unspecified", Vec::new()),
        #[cfg(feature = "cuda-13040")]
        L::DeviceLocalityDomain { device, domain } => ("locality_domain", vec![device.into(), domain.into()]),
        _ => return None,
    })
}

/// `Location.device(0)`: Python that makes `location` again in the package's namespace.
fn location_repr(location: cumempool::Location) -> String {
    match constructor(location) {
        Some((name, args)) => {
            let args: Vec<String> = args.iter().map(i64::to_string).collect();
            format!("Location.{name}({})", args.join(", "))
        }
        None => format!("<Location {location}>"),
    }
}

/// Device `device`'s locality domain `domain`, where this build knows locality domains.
fn locality_domain_location(device: i32, domain: u8) -> Outcome<cumempool::Location> {
    gated!(
        "cuda-13040",
        CUDA_13_4,
        "locality domains",
        cumempool::Location::DeviceLocalityDomain { device, domain },
        inputs(device, domain)
    )
}

/// The kind of memory a pool hands out; Python sees `cumempool.AllocationType`, an `enum.Enum`
/// whose values are the driver's `CUmemAllocationType` constants.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocationType {
    /// Memory that stays where it was allocated.
    Pinned,
    /// Managed (unified) memory, which migrates between host and devices.
    Managed,
}

/// The Python class of [`AllocationType`].
pub(crate) static ALLOCATION_TYPE: PyEnum = PyEnum::new(
    "AllocationType",
    "Enum",
    "The kind of memory a pool hands out: PINNED stays where it was allocated, MANAGED \
     (unified memory) migrates between host and devices.",
    &[("PINNED", 1), ("MANAGED", 2)],
);

impl AllocationType {
    fn to_rust(self) -> cumempool::AllocationType {
        match self {
            Self::Pinned => cumempool::AllocationType::Pinned,
            Self::Managed => cumempool::AllocationType::Managed,
        }
    }

    pub(crate) fn from_rust(value: cumempool::AllocationType) -> Self {
        match value {
            cumempool::AllocationType::Managed => Self::Managed,
            _ => Self::Pinned,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Pinned => "PINNED",
            Self::Managed => "MANAGED",
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for AllocationType {
    type Error = PyErr;

    fn extract(object: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match ALLOCATION_TYPE.name_of(&object)? {
            "MANAGED" => Ok(Self::Managed),
            _ => Ok(Self::Pinned),
        }
    }
}

impl<'py> IntoPyObject<'py> for AllocationType {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        ALLOCATION_TYPE.member(py, self.name())
    }
}

/// A (location, allocation type) pair: the key under which CUDA keeps a default pool and a
/// current pool. Routes that cannot exist on any machine are refused when made.
/// `Route(location, allocation_type=None)`: `None` means `AllocationType.PINNED`.
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
    // The default is spelled `None` (meaning PINNED) because `inspect.signature`, and so
    // `help()`, reads only literals in a native signature.
    #[new]
    #[pyo3(signature = (location, allocation_type = None))]
    fn new(location: Location, allocation_type: Option<AllocationType>) -> Outcome<Self> {
        let allocation_type = allocation_type.unwrap_or(AllocationType::Pinned);
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
        Ok(crate::sync::gil::detach(py, || route.validate())?)
    }

    /// Pickles as `Route(location, allocation_type)`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, (Location, AllocationType)) {
        let route = slf.get().0;
        (slf.get_type(), (Location(route.location), AllocationType::from_rust(route.allocation_type)))
    }

    /// `Route(Location.device(0), AllocationType.PINNED)`: Python that makes it again.
    fn __repr__(&self) -> String {
        route_repr(self.0)
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }
}

/// `Route(Location.device(0), AllocationType.PINNED)`: Python that makes `route` again, for the
/// reprs of the objects that name a route.
pub(crate) fn route_repr(route: cumempool::Route) -> String {
    let allocation_type = AllocationType::from_rust(route.allocation_type).name();
    format!("Route({}, AllocationType.{allocation_type})", location_repr(route.location))
}
