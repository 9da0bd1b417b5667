//! Recognising another library's stream object: which handle and device a PyTorch, CuPy or
//! cuda.core stream (or any object with `__cuda_stream__`, or an int) names, and the memo that
//! finds the same `Stream` again for the same object, another object of the same stream, or
//! the same handle.
//!
//! The memo is keyed by the handle's value, as PyTorch's caching allocator keys streams, so a
//! cache (which keys blocks by the `Stream`) sees one stream however it is passed. Invariants:
//! a hit is confirmed with the entry's own object where that object may have closed its stream
//! (the driver gives a destroyed stream's handle to the next new one); an entry is let go of
//! once nothing but the memo uses its stream (no other Python reference, no clone of the Rust
//! stream); and whatever is let go of is dropped outside the memo's lock, since dropping a
//! library's object may run its code, which may lend a stream again.
//!
//! The memo holds the bindings' `Stream` objects through [`LentStream`], so that this module
//! sits below the `Stream` class that uses it.

use crate::errors::{Failure, Outcome};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::pyclass::boolean_struct::True;
use pyo3::types::{PyBool, PyInt, PyString, PyTuple};
use pyo3::PyClass;
use std::collections::VecDeque;

/// How many other libraries' streams are kept (with their objects) for reuse.
const LENT_KEPT: usize = 64;

/// How many recently passed stream objects are remembered by identity.
const RECENT_KEPT: usize = 8;

/// How a lender names its stream, which says whether the name can change while it lives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Naming {
    /// An int handle: the caller promised it stays valid; there is nothing to ask again.
    Int,
    /// A PyTorch (`cuda_stream`) or CuPy (`ptr`) stream: the handle is fixed for the object's
    /// life, and the object keeps its stream alive.
    Attribute,
    /// `__cuda_stream__()` (cuda.core and others): an object may close its stream while it
    /// lives (cuda.core's `Stream.close()`), so a remembered answer is confirmed by asking again.
    Protocol,
}

/// What the memo needs of the stream objects it keeps.
pub(crate) trait LentStream: PyClass<Frozen = True> + Sync {
    /// The lending library's object and how it names the stream; `None` for a stream the
    /// bindings made or an int handle.
    fn lender(&self) -> Option<&(Py<PyAny>, Naming)>;

    /// The other objects the stream was found for and holds, with how each names it.
    fn held_also(&self, py: Python<'_>) -> Vec<(Py<PyAny>, Naming)>;

    /// Whether a clone of the Rust stream is held beside this object's (a buffer's, a block a
    /// cache keeps).
    fn shared_elsewhere(&self) -> bool;
}

/// Refuses a `bool` where a stream is expected: `True` and `False` are ints to Python, and
/// would name the legacy stream.
pub(crate) fn refuse_bool(obj: &Bound<'_, PyAny>) -> Outcome<()> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(
            "a bool is not a stream: pass a Stream, an object with __cuda_stream__, a torch or CuPy stream, or an int handle",
        )
        .into());
    }
    Ok(())
}

/// The raw handle and device of another library's stream object, and how it names the stream.
pub(crate) fn foreign_handle(obj: &Bound<'_, PyAny>, default_device: i32) -> Outcome<(usize, i32, Naming)> {
    refuse_bool(obj)?;
    if obj.is_instance_of::<PyInt>() {
        return Ok((obj.extract::<usize>()?, default_device, Naming::Int));
    }
    let (handle, naming) = handle_of(obj)?;
    Ok((handle, device_of(obj).unwrap_or(default_device), naming))
}

/// The raw handle a library's stream object (not an int) names now: `__cuda_stream__()`, a
/// PyTorch stream's `cuda_stream` or a CuPy stream's `ptr`.
fn handle_of(obj: &Bound<'_, PyAny>) -> Outcome<(usize, Naming)> {
    let py = obj.py();
    if optional_attr(obj, intern!(py, "__cuda_stream__")).is_some() {
        return Ok((protocol_handle(obj)?, Naming::Protocol));
    }
    for attribute in [intern!(py, "cuda_stream"), intern!(py, "ptr")] {
        if let Some(value) = optional_attr(obj, attribute) {
            if let Ok(raw) = value.extract::<usize>() {
                return Ok((raw, Naming::Attribute));
            }
        }
    }
    Err(Failure::Python(PyTypeError::new_err(format!(
        "cannot use a {} as a stream: pass a cumempool.Stream, an object with __cuda_stream__ (cuda.core), a torch.cuda.Stream, a cupy.cuda.Stream, or an int handle",
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
    ))))
}

/// The handle `obj.__cuda_stream__()` answers now.
pub(crate) fn protocol_handle(obj: &Bound<'_, PyAny>) -> Outcome<usize> {
    let answer = obj.call_method0(intern!(obj.py(), "__cuda_stream__"))?;
    let pair = answer
        .cast::<PyTuple>()
        .map_err(|_| PyValueError::new_err("__cuda_stream__() must return a (version, handle) tuple"))?;
    if pair.len() != 2 {
        return Err(PyValueError::new_err("__cuda_stream__() must return a (version, handle) tuple").into());
    }
    Ok(pair.get_item(1)?.extract::<usize>()?)
}

/// `obj.name`, or `None` where it has no such attribute or reading it fails. Asked with
/// `PyObject_HasAttr` first, which finds most missing attributes without building an exception.
fn optional_attr<'py>(obj: &Bound<'py, PyAny>, name: &Bound<'py, PyString>) -> Option<Bound<'py, PyAny>> {
    // SAFETY: both are live objects, held by the caller; `PyObject_HasAttr` never raises.
    if unsafe { ffi::PyObject_HasAttr(obj.as_ptr(), name.as_ptr()) } == 0 {
        return None;
    }
    obj.getattr(name).ok()
}

/// The device of a torch (`device.index`), CuPy (`device_id`) or cuda.core (`device.device_id`)
/// stream. A negative id names no device (CuPy's null stream answers -1, "the current device"):
/// the caller's default applies.
fn device_of(obj: &Bound<'_, PyAny>) -> Option<i32> {
    let py = obj.py();
    let named = |value: Bound<'_, PyAny>| value.extract::<i32>().ok().filter(|id| *id >= 0);
    if let Some(id) = optional_attr(obj, intern!(py, "device_id")).and_then(named) {
        return Some(id);
    }
    let device = optional_attr(obj, intern!(py, "device"))?;
    for attribute in [intern!(py, "index"), intern!(py, "device_id")] {
        if let Some(id) = optional_attr(&device, attribute).and_then(named) {
            return Some(id);
        }
    }
    None
}

/// Whether `stream`'s memo entry still stands for the stream `obj` names as `raw` (on the same
/// device). A held object does not keep its stream alive (cuda.core's `Stream.close()`
/// destroys it), and the driver gives a destroyed stream's handle to the next new stream:
/// the entry's own object is asked again which handle it names. An entry an int made
/// answers for ints (which promise validity themselves), and gives way to a library
/// object, which is then held.
pub(crate) fn still_lent_as<S: LentStream>(stream: &S, obj: &Bound<'_, PyAny>, raw: usize, naming: Naming) -> bool {
    let Some((lender, lender_naming)) = stream.lender() else {
        return false;
    };
    let py = obj.py();
    // The lender first; then the objects the stream holds besides (one may own the stream
    // while the lender, a wrapper, was closed), only asked for where the lender fails.
    names_it_still(lender.bind(py), *lender_naming, obj, raw, naming)
        || stream
            .held_also(py)
            .iter()
            .any(|(held, held_naming)| names_it_still(held.bind(py), *held_naming, obj, raw, naming))
}

/// Whether `held`, an object the entry holds, still stands for the stream `obj` names as `raw`.
fn names_it_still(
    held: &Bound<'_, PyAny>,
    held_naming: Naming,
    obj: &Bound<'_, PyAny>,
    raw: usize,
    naming: Naming,
) -> bool {
    if held.is(obj) {
        return true;
    }
    match held_naming {
        Naming::Int => naming == Naming::Int,
        // An object named by an attribute owns its stream (CuPy, PyTorch): held, it stays.
        Naming::Attribute => true,
        // The object raising (closed) or naming another handle: it stands for nothing now.
        Naming::Protocol => protocol_handle(held).is_ok_and(|handle| handle == raw),
    }
}

/// Streams other libraries lent (or int handles), kept so that passing the same object,
/// another object of the same stream (each `torch.cuda.current_stream()` is a new one) or the
/// same handle again finds the same `S`. Entries nothing uses any more are let go of when a
/// buffer lets go of its stream, on a miss, and when a cache is released. Every method that
/// takes entries out answers what it took, for the caller to drop outside the lock.
pub(crate) struct Lent<S> {
    /// `(handle, device, stream)`, the oldest first.
    streams: VecDeque<(usize, i32, Py<S>)>,
    /// The objects passed last, held (so their identity stays theirs) with their stream and
    /// how they name it: the same object again needs no lookup, but for `__cuda_stream__`,
    /// which is asked again (the object may have closed its stream since).
    objects: VecDeque<(Py<PyAny>, Py<S>, Naming)>,
}

impl<S: LentStream> Lent<S> {
    /// An empty memo.
    pub(crate) const fn new() -> Self {
        Self { streams: VecDeque::new(), objects: VecDeque::new() }
    }

    /// The stream `obj` (this very object) was last found to name, and how it names it.
    pub(crate) fn recent(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> Option<(Py<S>, Naming)> {
        self.objects.iter().find(|(o, _, _)| o.is(obj)).map(|(_, s, naming)| (s.clone_ref(py), *naming))
    }

    /// The stream kept for handle `raw` of `device`, if any.
    pub(crate) fn by_handle(&self, py: Python<'_>, raw: usize, device: i32) -> Option<Py<S>> {
        self.streams.iter().find(|(r, d, _)| (*r, *d) == (raw, device)).map(|(_, _, s)| s.clone_ref(py))
    }

    /// Remembers `stream` as what `obj` names (`raw` of `device`, named as `naming`); what was
    /// let go of, to be dropped outside the lock.
    pub(crate) fn remember(
        &mut self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        (raw, device, naming): (usize, i32, Naming),
        stream: &Py<S>,
    ) -> Vec<Py<PyAny>> {
        let mut evicted: Vec<Py<PyAny>> = Vec::new();
        if !self.streams.iter().any(|(_, _, s)| s.is(stream)) {
            // A miss: entries nothing uses any more (a `Stream.borrow` result dropped, memory
            // a DLPack consumer gave back without the GIL) go now, not when pushed out.
            evicted.extend(self.unused_entries(py));
            if let Some(at) = self.streams.iter().position(|(r, d, _)| (*r, *d) == (raw, device)) {
                evicted.extend(self.streams.remove(at).map(|(_, _, s)| s.into_any()));
            }
            if self.streams.len() >= LENT_KEPT {
                evicted.extend(self.streams.pop_front().map(|(_, _, s)| s.into_any()));
            }
            self.streams.push_back((raw, device, stream.clone_ref(py)));
        }
        if naming != Naming::Int {
            // An object that names another stream now keeps one entry, for that stream.
            while let Some(at) = self.objects.iter().position(|(o, _, _)| o.is(obj)) {
                if let Some((object, stream, _)) = self.objects.remove(at) {
                    evicted.extend([object, stream.into_any()]);
                }
            }
            if self.objects.len() >= RECENT_KEPT {
                if let Some((object, stream, _)) = self.objects.pop_front() {
                    evicted.extend([object, stream.into_any()]);
                }
            }
            self.objects.push_back((obj.clone().unbind(), stream.clone_ref(py), naming));
        }
        evicted
    }

    /// Takes `stream`'s entries out when nothing but the memo and the caller (one reference)
    /// uses it; what was taken, to be dropped outside the lock.
    pub(crate) fn let_go_of(&mut self, stream: &Py<S>) -> Vec<Py<PyAny>> {
        self.evict(stream, 1)
    }

    /// Takes out every entry whose stream nothing else uses; what was taken, to be dropped
    /// outside the lock.
    pub(crate) fn unused_entries(&mut self, py: Python<'_>) -> Vec<Py<PyAny>> {
        let streams: Vec<Py<S>> = self.streams.iter().map(|(_, _, s)| s.clone_ref(py)).collect();
        let mut evicted = Vec::new();
        for stream in &streams {
            // `streams` holds one more reference.
            evicted.extend(self.evict(stream, 1));
        }
        evicted.extend(streams.into_iter().map(Py::into_any));
        evicted
    }

    /// Takes `stream`'s entries out when its references are the memo's and `others` more, and
    /// no clone of its Rust stream is held elsewhere; what was taken, to be dropped outside the
    /// lock.
    fn evict(&mut self, stream: &Py<S>, others: usize) -> Vec<Py<PyAny>> {
        let in_memo = self.streams.iter().filter(|(_, _, s)| s.is(stream)).count()
            + self.objects.iter().filter(|(_, s, _)| s.is(stream)).count();
        // SAFETY: a live object, held by the caller, who holds the GIL.
        let references = unsafe { ffi::Py_REFCNT(stream.as_ptr()) };
        let unused = references == (in_memo + others) as isize && !stream.get().shared_elsewhere();
        let mut evicted = Vec::new();
        if in_memo == 0 || !unused {
            return evicted;
        }
        while let Some(at) = self.streams.iter().position(|(_, _, s)| s.is(stream)) {
            evicted.extend(self.streams.remove(at).map(|(_, _, s)| s.into_any()));
        }
        while let Some(at) = self.objects.iter().position(|(_, s, _)| s.is(stream)) {
            if let Some((object, s, _)) = self.objects.remove(at) {
                evicted.extend([object, s.into_any()]);
            }
        }
        evicted
    }
}
