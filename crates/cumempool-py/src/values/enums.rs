//! Python's own enum classes (`enum.Enum`, `enum.IntFlag`) for the Rust enums the API takes
//! and returns. Each class is made once from a table here, so the Rust side names the members;
//! the conversions at the edge check membership and map names to Rust values.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

/// One Python enum class: its name, its `enum` base, its doc and its members (name, value).
pub(crate) struct PyEnum {
    name: &'static str,
    base: &'static str,
    doc: &'static str,
    members: &'static [(&'static str, u32)],
    class: PyOnceLock<Py<PyType>>,
}

impl PyEnum {
    /// An `enum.Enum` (or `base`, another class of the `enum` module) named `name` in the
    /// `cumempool` package.
    pub(crate) const fn new(
        name: &'static str,
        base: &'static str,
        doc: &'static str,
        members: &'static [(&'static str, u32)],
    ) -> Self {
        Self { name, base, doc, members, class: PyOnceLock::new() }
    }

    /// The class, made on first use. Its module is `cumempool`, where the package exports it,
    /// so members pickle by reference.
    pub(crate) fn class<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyType>> {
        let class = self.class.get_or_try_init(py, || -> PyResult<Py<PyType>> {
            let base = PyModule::import(py, "enum")?.getattr(self.base)?;
            let options = PyDict::new(py);
            options.set_item("module", "cumempool")?;
            options.set_item("qualname", self.name)?;
            let class = base.call((self.name, self.members.to_vec()), Some(&options))?;
            class.setattr("__doc__", self.doc)?;
            Ok(class.cast_into::<PyType>()?.unbind())
        })?;
        Ok(class.bind(py))
    }

    /// The member called `name`.
    pub(crate) fn member<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        self.class(py)?.getattr(name)
    }

    /// The name of `object`, which must be a member of this class.
    pub(crate) fn name_of(&self, object: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        if object.is_instance(self.class(object.py())?)? {
            let name: String = object.getattr("name")?.extract()?;
            if let Some((member, _)) = self.members.iter().find(|(member, _)| *member == name) {
                return Ok(member);
            }
        }
        let names: Vec<String> = self.members.iter().map(|(member, _)| format!("{}.{member}", self.name)).collect();
        Err(PyTypeError::new_err(format!(
            "expected a member of cumempool.{} ({}), not {}",
            self.name,
            names.join(", "),
            object.repr().map_or_else(|_| "an object without a repr".to_owned(), |r| r.to_string())
        )))
    }
}

/// `cumempool.Access`: the access a device has to a pool's memory (the values are the
/// driver's `CUmemAccess_flags`).
pub(crate) static ACCESS: PyEnum = PyEnum::new(
    "Access",
    "Enum",
    "The access a device has to a pool's memory: NONE, READ or READ_WRITE.",
    &[("NONE", 0), ("READ", 1), ("READ_WRITE", 3)],
);

/// `cumempool.HandleTypes`: the export handle types a pool may be created with, bit flags
/// that combine with `|` and stay `HandleTypes`.
pub(crate) static HANDLE_TYPES: PyEnum = PyEnum::new(
    "HandleTypes",
    "IntFlag",
    "The export handle types a pool may be created with (bit flags, combined with `|`): \
     POSIX_FILE_DESCRIPTOR shares with another process of the node over a Unix socket, FABRIC \
     with another node of the same NVLink domain (needs IMEX).",
    &[
        ("NONE", cumempool::HandleTypes::NONE.bits()),
        ("POSIX_FILE_DESCRIPTOR", cumempool::HandleTypes::POSIX_FILE_DESCRIPTOR.bits()),
        ("FABRIC", cumempool::HandleTypes::FABRIC.bits()),
    ],
);

/// `bits` as a `cumempool.HandleTypes` (an `IntFlag`: bits it has no member for stay in the value).
pub(crate) fn handle_types(py: Python<'_>, bits: u32) -> PyResult<Py<PyAny>> {
    Ok(HANDLE_TYPES.class(py)?.call1((bits,))?.unbind())
}
