//! Rust errors as Python exceptions: one class per variant (defined in `cumempool/errors.py`,
//! where multiple inheritance from `MemoryError`, `ValueError` and `OSError` is plain Python),
//! the message from the Rust `Display` with its causes, and the driver's code and name.
//!
//! The classes are bound as a Rust enum ([`Class`]), so the mapping from variants names only
//! classes that exist: each is looked up once, when the native module loads, and a class
//! `errors.py` lacks fails that import. Unlike `pyo3::import_exception!`, whose types panic on a
//! failed lookup, a failed lookup never replaces the error: raising takes the class the module
//! names now (a reload of `errors.py` makes new classes, which `except` and pickle then expect),
//! else the one bound at import.

use cumempool::DriverError;
use pyo3::exceptions::{PyBaseException, PyImportError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyModule, PyType};

/// What a binding can fail with: a Rust error, a use after `close()`, or a Python error
/// (argument conversion, a callback's exception).
#[derive(Debug)]
pub enum Failure {
    /// An error of `cumempool`.
    Core(cumempool::Error),
    /// An error of `cumempool-alloc`.
    Alloc(cumempool_alloc::Error),
    /// An object used after `close()`: what it was.
    Closed(&'static str),
    /// An error raised by Python code or a conversion.
    Python(PyErr),
}

/// `Result` of the bindings.
pub type Outcome<T> = Result<T, Failure>;

/// The too-old error for something this build was compiled without.
#[cfg_attr(feature = "cuda-13040", allow(dead_code))]
pub(crate) fn too_old(feature: &'static str, needs: cumempool::DriverVersion) -> Failure {
    Failure::Core(cumempool::Error::DriverTooOld { feature, needs, found: cumempool::sys::BINDINGS_VERSION })
}

impl From<cumempool::Error> for Failure {
    fn from(error: cumempool::Error) -> Self {
        Self::Core(error)
    }
}

impl From<cumempool_alloc::Error> for Failure {
    fn from(error: cumempool_alloc::Error) -> Self {
        match error {
            // One class per cause, whichever crate passed it on.
            cumempool_alloc::Error::Pool(inner) => Self::Core(inner),
            other => Self::Alloc(other),
        }
    }
}

impl From<PyErr> for Failure {
    fn from(error: PyErr) -> Self {
        Self::Python(error)
    }
}

impl From<Failure> for PyErr {
    fn from(failure: Failure) -> Self {
        Python::attach(|py| failure.into_pyerr(py))
    }
}

impl Failure {
    fn into_pyerr(self, py: Python<'_>) -> PyErr {
        let (class, message, driver, reason) = match &self {
            Self::Python(_) => return self.into_python(),
            Self::Core(error) => (core_class(error), message_of(error), driver_cause(error), reason_of(error)),
            Self::Alloc(cumempool_alloc::Error::Pool(error)) => {
                (core_class(error), message_of(error), driver_cause(error), reason_of(error))
            }
            Self::Alloc(error) => (alloc_class(error), message_of(error), None, None),
            Self::Closed(what) => (
                Class::ClosedError,
                format!("{what} is closed; make a new one (close() gave its memory or handle back)"),
                None,
                None,
            ),
        };
        let core = match &self {
            Self::Core(error) | Self::Alloc(cumempool_alloc::Error::Pool(error)) => Some(error),
            _ => None,
        };
        let code = core.and_then(cumempool::Error::cuda_code);
        // The entry point that failed: the driver's answer's, or the one that ran out of memory.
        let function = match core {
            Some(cumempool::Error::OutOfMemory { function, .. }) => Some(*function),
            _ => driver.map(|d| d.function),
        };
        let message = pythonic(&message);
        raise(py, class, &message, code, driver, function, reason).unwrap_or_else(|lookup| {
            // Only a package whose `errors.py` was changed under it gets here (the classes were
            // all found when the module loaded): the error still reads as itself.
            PyRuntimeError::new_err(format!("{message} (and cumempool.errors.{} failed: {lookup})", class.name()))
        })
    }

    fn into_python(self) -> PyErr {
        match self {
            Self::Python(error) => error,
            other => PyRuntimeError::new_err(format!("{other:?}")),
        }
    }
}

/// Declares [`Class`], one variant per exception class of `cumempool/errors.py`, named as the
/// class is: a variant the mapping below names is checked by the compiler, and a class
/// `errors.py` lacks fails the import of the native module ([`bind_classes`]).
macro_rules! exception_classes {
    ($($class:ident),* $(,)?) => {
        /// An exception class of `cumempool.errors`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[allow(clippy::enum_variant_names, reason = "each variant is named as its Python class is")]
        pub(crate) enum Class {
            $(
                #[doc = concat!("`cumempool.errors.", stringify!($class), "`.")]
                $class,
            )*
        }

        impl Class {
            /// Every class, in declaration order (the order of [`CLASSES`]).
            const ALL: &'static [Class] = &[$(Class::$class),*];

            /// The class's name in `cumempool.errors`.
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $(Class::$class => stringify!($class),)*
                }
            }
        }
    };
}

exception_classes!(
    CumempoolError,
    LoadError,
    ForkedChildError,
    DriverError,
    OutOfMemoryError,
    LimitExceededError,
    DriverTooOldError,
    InvalidDeviceError,
    InvalidRouteError,
    RouteRefusedError,
    ForeignCurrentPoolError,
    PoolRouteMismatchError,
    PoolInUseError,
    UnsafeToDestroyError,
    PoolWasCurrentError,
    PoolCreationError,
    NotHostAccessibleError,
    DoesNotFitError,
    OverlappingCopyError,
    AccessNotGrantableError,
    StreamNotBorrowableError,
    ImportedPoolAllocationError,
    NotShareableError,
    SharingRefusedError,
    MalformedMessageError,
    AlreadyImportedError,
    SharedLengthMismatchError,
    CumempoolOSError,
    UnknownValueError,
    InvalidArgumentError,
    AlignmentError,
    KindMismatchError,
    LanesUnreachableError,
    StreamCapturingError,
    CaptureRefusedError,
    MappingsHeldError,
    ClosedError,
);

/// `cumempool.errors` and the classes of [`Class::ALL`] in it, in that order, as
/// [`bind_classes`] found them.
struct BoundClasses {
    module: Py<PyModule>,
    classes: Vec<Py<PyType>>,
}

static CLASSES: PyOnceLock<BoundClasses> = PyOnceLock::new();

/// Finds every class of [`Class`] in `cumempool.errors`, each a subclass of `CumempoolError`;
/// called when the native module loads, so a class the Python side lacks fails the import (with
/// its name) instead of the first error that would have raised it.
pub(crate) fn bind_classes(py: Python<'_>) -> PyResult<()> {
    classes(py).map(|_| ())
}

fn classes(py: Python<'_>) -> PyResult<&BoundClasses> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("cumempool.errors")?;
        let base = module.getattr("CumempoolError")?.cast_into::<PyType>()?;
        let classes = Class::ALL
            .iter()
            .map(|class| {
                let found = module.getattr(class.name()).and_then(|c| Ok(c.cast_into::<PyType>()?));
                match found {
                    Ok(found) if found.is_subclass(&base)? => Ok(found.unbind()),
                    Ok(_) => Err(PyImportError::new_err(format!(
                        "cumempool.errors.{} is not a subclass of CumempoolError; reinstall cumempool",
                        class.name()
                    ))),
                    Err(error) => Err(PyImportError::new_err(format!(
                        "cumempool.errors lacks the exception class {} ({error}); reinstall cumempool",
                        class.name()
                    ))),
                }
            })
            .collect::<PyResult<_>>()?;
        Ok(BoundClasses { module: module.unbind(), classes })
    })
}

/// The exception class `cumempool.errors` names `class` now, where that is one: after
/// `importlib.reload(cumempool.errors)` a new class, which `except cumempool.errors.X` and
/// pickle (which checks that a class is the one its module names) expect of a raised error.
fn named_now<'py>(module: &Bound<'py, PyModule>, class: Class) -> Option<Bound<'py, PyType>> {
    let found = module.getattr(class.name()).ok()?.cast_into::<PyType>().ok()?;
    found.is_subclass_of::<PyBaseException>().ok()?.then_some(found)
}

/// The exception `class` with `message`, `code`, `name`, `function` and `reason` set; `Err`
/// holds the error met while building it.
fn raise(
    py: Python<'_>,
    class: Class,
    message: &str,
    code: Option<u32>,
    driver: Option<&DriverError>,
    function: Option<&str>,
    reason: Option<String>,
) -> PyResult<PyErr> {
    let bound = classes(py)?;
    let module = bound.module.bind(py);
    let class = match named_now(module, class) {
        Some(now) => now,
        // The name no longer names an exception class: the class found when the module loaded.
        None => match bound.classes.get(class as usize) {
            Some(at_import) => at_import.bind(py).clone(),
            None => return Err(PyRuntimeError::new_err(format!("no class bound for {}", class.name()))),
        },
    };
    let instance = class.call1((message,))?;
    if let Some(reason) = reason {
        instance.setattr("reason", reason)?;
    }
    if let Some(code) = code {
        instance.setattr("code", code)?;
        let name = driver.map_or_else(|| cumempool::error_name(cumempool::sys::CUresult(code)), |d| d.name.clone());
        instance.setattr("name", name)?;
    }
    if let Some(function) = function {
        instance.setattr("function", function)?;
    }
    Ok(PyErr::from_value(instance))
}

/// The name of the reason a program can match in Rust (`InvalidArgumentReason`,
/// `NotShareableReason`), such as `"ZeroSize"`: the variant's name, which its `Debug` begins with.
fn reason_of(error: &cumempool::Error) -> Option<String> {
    let debug = match error {
        cumempool::Error::InvalidArgument { reason, .. } => format!("{reason:?}"),
        cumempool::Error::NotShareable { reason, .. } => format!("{reason:?}"),
        _ => return None,
    };
    Some(debug.chars().take_while(char::is_ascii_alphanumeric).collect())
}

/// The Rust message with the causes it does not already quote.
fn message_of(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// The driver's answer behind an error, where the driver gave one.
fn driver_cause(error: &cumempool::Error) -> Option<&DriverError> {
    if let cumempool::Error::Driver(cause) = error {
        return Some(cause);
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(driver) = cause.downcast_ref::<DriverError>() {
            return Some(driver);
        }
        source = cause.source();
    }
    None
}

fn core_class(error: &cumempool::Error) -> Class {
    use cumempool::Error as E;
    match error {
        E::Load(_) => Class::LoadError,
        E::ForkedChild => Class::ForkedChildError,
        E::Driver(_) | E::DriverGaveNullPointer { .. } => Class::DriverError,
        E::OutOfMemory { .. } => Class::OutOfMemoryError,
        E::InvalidDevice { .. } | E::InvalidLocalityDomain { .. } => Class::InvalidDeviceError,
        E::InvalidGranularity { .. } | E::InvalidArgument { .. } => Class::InvalidArgumentError,
        E::InvalidRoute(_) | E::InvalidLocation(_) => Class::InvalidRouteError,
        E::RouteRefused { .. } => Class::RouteRefusedError,
        E::DriverTooOld { .. } => Class::DriverTooOldError,
        E::ForeignCurrentPool { .. } => Class::ForeignCurrentPoolError,
        E::PoolRouteMismatch { .. } => Class::PoolRouteMismatchError,
        E::PoolInUse { .. } => Class::PoolInUseError,
        E::UnsafeToDestroy => Class::UnsafeToDestroyError,
        E::PoolWasCurrent => Class::PoolWasCurrentError,
        E::OverlappingCopy { .. } => Class::OverlappingCopyError,
        E::PoolCreation { .. } => Class::PoolCreationError,
        E::NotHostAccessible { .. } | E::ManagedMemoryNotHostAccessible { .. } => Class::NotHostAccessibleError,
        E::DoesNotFit { .. } => Class::DoesNotFitError,
        E::AccessNotGrantable { .. } => Class::AccessNotGrantableError,
        E::StreamNotBorrowable { .. } => Class::StreamNotBorrowableError,
        E::ImportedPoolAllocation => Class::ImportedPoolAllocationError,
        E::NotShareable { .. } => Class::NotShareableError,
        E::SharingRefused { .. } => Class::SharingRefusedError,
        E::MalformedMessage { .. } => Class::MalformedMessageError,
        E::AlreadyImported { .. } => Class::AlreadyImportedError,
        E::ImportedMemoryNotSliceable | E::ExportableMemoryNotSliceable { .. } => Class::NotHostAccessibleError,
        E::SharedLengthMismatch { .. } => Class::SharedLengthMismatchError,
        E::Io { .. } => Class::CumempoolOSError,
        E::UnknownValue(_) => Class::UnknownValueError,
        E::StreamCapturing { .. } => Class::StreamCapturingError,
        E::CaptureRefused { .. } => Class::CaptureRefusedError,
        // A variant newer than these bindings: still a cumempool error, never a crash.
        _ => Class::CumempoolError,
    }
}

fn alloc_class(error: &cumempool_alloc::Error) -> Class {
    use cumempool_alloc::Error as E;
    match error {
        E::Pool(error) => core_class(error),
        E::LimitExceeded { .. } => Class::LimitExceededError,
        E::Alignment { .. } => Class::AlignmentError,
        E::KindMismatch { .. } => Class::KindMismatchError,
        E::LanesUnreachable { .. } => Class::LanesUnreachableError,
        E::HostOutOfMemory { .. } | E::ArenaExhausted { .. } => Class::OutOfMemoryError,
        E::NotFromArena { .. } | E::NotExportable { .. } => Class::InvalidArgumentError,
        E::MappingsHeld { .. } => Class::MappingsHeldError,
        _ => Class::CumempoolError,
    }
}

/// The Rust advice in a core crate's message, phrase by phrase, as the Python API says it: the
/// Rust crates' messages name Rust calls (`MemPool::builder(..)`, `Stream::legacy(&context)`),
/// which a Python user cannot make. The longest phrases come first (a shorter one is part of
/// some); what no phrase covers still loses its Rust syntax in `pythonic`.
const PYTHON_ADVICE: &[(&str, &str)] = &[
    (
        "Record captured work through Capture (Stream::capture: Capture::alloc, fill, copy), or do this before the capture begins or after it ends",
        "Allocate, copy and fill before the capture begins or after it ends (a graph's own memory comes from the capturing library's allocator, such as torch.cuda.graph's pool)",
    ),
    (" (allocate inside a capture with Capture::alloc)", ""),
    ("MemPool::builder(..).export_handle_types(..)", "cumempool.MemPool(route, handle_types=cumempool.HandleTypes.POSIX_FILE_DESCRIPTOR)"),
    ("Pool::export_fd or descriptor_passing::send_pool", "MemPool.export_fd() or MemPool.send()"),
    ("Stream::legacy(&context)", "cumempool.Stream.legacy(device)"),
    ("Stream::borrow_raw(raw, Some(&context))", "cumempool.Stream.borrow(handle, device)"),
    ("MemPool::builder(..).export_handle_types(HandleTypes::", "cumempool.MemPool(route, handle_types=cumempool.HandleTypes."),
    ("Buffer::copy_to_host / copy_from_host", "Buffer.to_bytes() / Buffer.copy_from()"),
    ("Buffer::copy_to_host_async", "Buffer.to_bytes()"),
    ("Buffer::copy_to_host", "Buffer.to_bytes()"),
    ("Buffer::copy_from_host_async", "Buffer.copy_from()"),
    ("Buffer::copy_from_host", "Buffer.copy_from()"),
    ("Buffer::copy_from_async", "Buffer.copy_from_buffer()"),
    ("Buffer::copy_from", "Buffer.copy_from_buffer()"),
    ("Buffer::fill", "Buffer.fill()"),
    ("Buffer::export", "Buffer.export()"),
    ("MemPool::import_fd", "cumempool.MemPool.import_fd()"),
    ("Pool::export_fd", "MemPool.export_fd()"),
    // Reached from Python through a resource (`PoolResource` calls it).
    ("Pool::alloc_raw", "a resource's alloc()"),
    ("Pool::alloc", "MemPool.alloc()"),
    ("StreamOrderedResource::alloc", "a resource's alloc()"),
    ("Stream::synchronize", "Stream.synchronize()"),
    ("Stream::is_idle", "Stream.is_idle()"),
    ("std::process::Command", "subprocess, or multiprocessing's spawn context"),
    ("descriptor_passing", "MemPool.send() and MemPool.receive()"),
    ("Route::managed(Location::Device(n))", "cumempool.Route.managed(cumempool.Location.device(n))"),
    ("Location::HostNuma", "cumempool.Route.host_numa(node)"),
    ("Access::ReadWrite or Access::None", "cumempool.Access.READ_WRITE or cumempool.Access.NONE"),
    ("i32::MAX", "2**31 - 1"),
    ("usize::MAX", "2**64 - 1"),
];

/// `text` with each `phrase` replaced by `with`, except where a phrase ending in a name is
/// followed by more of a name: `Pool::alloc` leaves `Pool::alloc_raw` to its own entry.
fn replace_whole(text: &str, phrase: &str, with: &str) -> String {
    let is_name = |c: char| c.is_alphanumeric() || c == '_';
    let ends_in_a_name = phrase.chars().next_back().is_some_and(is_name);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(phrase) {
        let after = &rest[at + phrase.len()..];
        let continues_a_name = ends_in_a_name && after.chars().next().is_some_and(is_name);
        out.push_str(&rest[..at]);
        out.push_str(if continues_a_name { phrase } else { with });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `message` with its Rust advice in Python terms (`PYTHON_ADVICE`), and any Rust path left
/// (`Type::item`, `&value`) written as Python would (`Type.item`, `value`).
pub(crate) fn pythonic(message: &str) -> String {
    let mut text = message.to_owned();
    for (rust, python) in PYTHON_ADVICE {
        if text.contains(rust) {
            text = replace_whole(&text, rust, python);
        }
    }
    text = text.replace("HandleTypes::", "cumempool.HandleTypes.").replace("::", ".");
    // `&` before a name is a Rust reference; `&&` and ` & ` are left (neither is in a message).
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '&' && chars.peek().is_some_and(|n| n.is_ascii_alphabetic()) {
            continue;
        }
        out.push(c);
    }
    out
}
