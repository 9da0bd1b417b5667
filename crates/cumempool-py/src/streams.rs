//! Devices and streams: cumempool's own, and those of PyTorch, CuPy, cuda.core or any object
//! with `__cuda_stream__`, borrowed while a reference to their Python object is held.

use crate::errors::{Failure, Outcome};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyString, PyTuple};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

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
        let ordinal = match ordinal {
            Some(ordinal) => ordinal,
            None => current_device(py)?,
        };
        Ok(Self(crate::gil::detach(py, || cumempool::Device::get(ordinal))?))
    }

    /// How many devices the driver sees.
    #[staticmethod]
    fn count(py: Python<'_>) -> Outcome<i32> {
        Ok(crate::gil::detach(py, cumempool::Device::count)?)
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

    /// The export handle types its pools support, a `HandleTypes`.
    #[getter]
    fn supported_handle_types(&self, py: Python<'_>) -> Outcome<Py<PyAny>> {
        Ok(crate::enums::handle_types(py, self.0.supported_handle_types()?.bits())?)
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

/// A CUDA stream: one cumempool created (`Stream(device)`), the legacy default stream of a
/// device (`Stream.legacy(device)`), or another library's stream (`Stream.borrow(obj)`), kept
/// alive by holding its Python object.
#[pyclass(frozen, module = "cumempool")]
pub struct Stream {
    pub(crate) stream: cumempool::Stream,
    /// The lending library's stream object, held so its stream outlives every use here, and
    /// how it names the stream.
    owner: Option<(Py<PyAny>, Naming)>,
    pub(crate) device: i32,
    /// Set by `close()` on a stream cumempool created: later uses through this object raise
    /// `ClosedError`; the driver stream goes with its last holder (buffers, caches).
    closed: std::sync::atomic::AtomicBool,
}

impl Stream {
    /// The primary context of `device`, retained once per device for the process, so that
    /// borrowing a stream makes no driver call after the first.
    pub(crate) fn context(py: Python<'_>, device: i32) -> Outcome<cumempool::Context> {
        static CONTEXTS: Mutex<Vec<(i32, cumempool::Context)>> = Mutex::new(Vec::new());
        let known = |contexts: &[(i32, cumempool::Context)]| {
            contexts.iter().find(|(d, _)| *d == device).map(|(_, context)| context.clone())
        };
        if let Some(context) = known(&CONTEXTS.lock().unwrap_or_else(PoisonError::into_inner)) {
            return Ok(context);
        }
        let context = crate::gil::detach(py, || cumempool::Device::get(device)?.primary_context())?;
        let mut contexts = CONTEXTS.lock().unwrap_or_else(PoisonError::into_inner);
        // Another thread may have retained it meanwhile: one entry per device.
        Ok(known(&contexts).unwrap_or_else(|| {
            contexts.push((device, context.clone()));
            context
        }))
    }

    /// Whether this memo entry still stands for the stream `obj` names as `raw` (on the same
    /// device). A held object does not keep its stream alive (cuda.core's `Stream.close()`
    /// destroys it), and the driver gives a destroyed stream's handle to the next new stream:
    /// the entry's own object is asked again which handle it names. An entry an int made
    /// answers for ints (which promise validity themselves), and gives way to a library
    /// object, which is then held.
    fn still_lent_as(&self, obj: &Bound<'_, PyAny>, raw: usize, naming: Naming) -> bool {
        let Some((owner, owner_naming)) = &self.owner else {
            return false;
        };
        let owner = owner.bind(obj.py());
        if owner.is(obj) {
            return true;
        }
        match owner_naming {
            Naming::Int => naming == Naming::Int,
            Naming::Attribute => true,
            // The entry's object raising (closed) or naming another handle: a stale entry.
            Naming::Protocol => protocol_handle(owner).is_ok_and(|handle| handle == raw),
        }
    }

    /// The raw handle, for code outside this package: the stream is marked as one that may
    /// capture first (`cumempool::Stream::note_capture_possible`, the lender's duty the core
    /// crate's `Stream::may_be_capturing` states), since the code it goes to may begin a
    /// capture on it that nothing here would see. Every path that hands a handle out goes
    /// through here. The legacy stream cannot be captured and is not marked (which would make
    /// each use of it ask the driver).
    pub(crate) fn lent_raw(&self) -> usize {
        let raw = self.stream.as_raw() as usize;
        if raw != 0 && raw != LEGACY_HANDLE {
            self.stream.note_capture_possible();
        }
        raw
    }

    /// `ClosedError` once `close()` was called on this object.
    pub(crate) fn check_open(&self) -> Outcome<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::Closed("this Stream"));
        }
        Ok(())
    }

    /// Whether another library lent the stream (its object is held).
    pub(crate) fn is_lent(&self) -> bool {
        self.owner.is_some()
    }

    /// The legacy default stream of `device`.
    pub(crate) fn legacy_of(py: Python<'_>, device: i32) -> Outcome<Self> {
        let context = Self::context(py, device)?;
        Ok(Self { stream: cumempool::Stream::legacy(&context), owner: None, device, closed: Default::default() })
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
        // Made without the lock (retaining the context releases the GIL): another thread may
        // have made one meanwhile, and the first one stays the device's.
        let made = Py::new(py, Self::legacy_of(py, device)?)?;
        let mut legacy = LEGACY.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, stream)) = legacy.iter().find(|(d, _)| *d == device) {
            return Ok(stream.clone_ref(py));
        }
        legacy.push((device, made.clone_ref(py)));
        Ok(made)
    }

    /// What the calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`, handle 2)
    /// of `device` is served as: the device's legacy stream. Handle 2 names another stream on
    /// each thread, and memory allocated on one thread's may be freed from another thread,
    /// where 2 names that thread's. The per-thread stream is a blocking stream, which the
    /// legacy stream synchronises with both ways (CUDA's stream semantics): work queued on the
    /// legacy stream from any thread runs after the work queued before it on every thread's
    /// per-thread stream of the context, and before the work queued on them after it. So an
    /// allocation, a free, a cached block handed out, ordered on the legacy stream, is ordered
    /// with the calling thread's per-thread stream, from whichever thread the free comes (at
    /// the price of ordering with the context's other blocking streams too; non-blocking
    /// streams, such as every `Stream(device)`, are not affected).
    ///
    /// The per-thread stream can be captured, and the legacy stream must not be used while a
    /// blocking stream of its context captures (the driver would invalidate the capture): the
    /// calling thread's per-thread stream is asked first, and a capture on it raises
    /// `StreamCapturingError`, the capture left intact.
    fn per_thread(py: Python<'_>, device: i32) -> Outcome<Py<Self>> {
        let context = Self::context(py, device)?;
        let capture = crate::gil::detach(py, || crate::contexts::while_current(&context, per_thread_capture))?;
        if let Some(capture) = capture {
            return Err(cumempool::Error::StreamCapturing {
                operation: "using the per-thread default stream (handle 2), served as the device's legacy stream, which must not be used while it captures",
                capture,
            }
            .into());
        }
        Self::shared_legacy(py, device)
    }

    /// Borrows `raw`, a stream of `device`, keeping `owner` alive as long as any clone of the
    /// Rust stream: this object's, a buffer's, or one a cache keeps with its blocks (which may
    /// outlive every Python object here).
    pub(crate) fn borrow_handle(
        py: Python<'_>,
        raw: usize,
        device: i32,
        owner: Option<(Py<PyAny>, Naming)>,
    ) -> Outcome<Self> {
        let context = Self::context(py, device)?;
        let raw_stream = raw as cumempool::sys::CUstream;
        let stream = match &owner {
            // SAFETY: `raw` is the lending library's stream of `device`, and its Python object
            // (held by every clone of the result) keeps it alive.
            Some((object, _)) => unsafe {
                cumempool::Stream::borrow_raw_keeping(raw_stream, Some(&context), Arc::new(object.clone_ref(py)))
            },
            // SAFETY: a bare int: the caller promised (`Stream.borrow`) that it stays valid while
            // this Stream and its buffers live.
            None => unsafe { cumempool::Stream::borrow_raw(raw_stream, Some(&context)) },
        }?;
        Ok(Self { stream, owner, device, closed: Default::default() })
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
            stream.get().check_open()?;
            return Ok(stream.clone().unbind());
        }
        let recent =
            lock(&LENT).objects.iter().find(|(o, _, _)| o.is(obj)).map(|(_, s, naming)| (s.clone_ref(py), *naming));
        if let Some((known, naming)) = recent {
            // `__cuda_stream__` is asked again: the object may have closed its stream since
            // (cuda.core's `Stream.close()`), and the handle may name another stream by now. A
            // closed object's own error surfaces; one that names another stream is looked up
            // anew.
            if naming != Naming::Protocol || protocol_handle(obj)? == known.get().stream.as_raw() as usize {
                return Ok(known);
            }
        }
        let (raw, device, naming) = foreign_handle(obj, default_device)?;
        // `0` and `CU_STREAM_LEGACY` name the legacy stream of whichever context is current:
        // the device's own object, so two devices' legacy streams are never one stream.
        if raw == 0 || raw == LEGACY_HANDLE {
            return Self::shared_legacy(py, device);
        }
        // Never remembered: each use is checked on its own thread (`per_thread`).
        if raw == PER_THREAD_HANDLE {
            return Self::per_thread(py, device);
        }
        let known =
            lock(&LENT).streams.iter().find(|(r, d, _)| (*r, *d) == (raw, device)).map(|(_, _, s)| s.clone_ref(py));
        let stream = match known {
            Some(stream) if stream.get().still_lent_as(obj, raw, naming) => stream,
            _ => Py::new(py, Self::borrow_handle(py, raw, device, Some((obj.clone().unbind(), naming)))?)?,
        };
        // Let go of outside the lock: dropping a library's object may run its code, which may
        // lend a stream again.
        let mut evicted: Vec<Py<PyAny>> = Vec::new();
        let mut lent = lock(&LENT);
        if !lent.streams.iter().any(|(_, _, s)| s.is(&stream)) {
            // A miss: entries nothing uses any more (a `Stream.borrow` result dropped, memory
            // a DLPack consumer gave back without the GIL) go now, not when pushed out.
            evicted.extend(unused_entries(py, &mut lent));
            if let Some(at) = lent.streams.iter().position(|(r, d, _)| (*r, *d) == (raw, device)) {
                evicted.extend(lent.streams.remove(at).map(|(_, _, s)| s.into_any()));
            }
            if lent.streams.len() >= LENT_KEPT {
                evicted.extend(lent.streams.pop_front().map(|(_, _, s)| s.into_any()));
            }
            lent.streams.push_back((raw, device, stream.clone_ref(py)));
        }
        if naming != Naming::Int {
            // An object that names another stream now keeps one entry, for that stream.
            while let Some(at) = lent.objects.iter().position(|(o, _, _)| o.is(obj)) {
                if let Some((object, stream, _)) = lent.objects.remove(at) {
                    evicted.extend([object, stream.into_any()]);
                }
            }
            if lent.objects.len() >= RECENT_KEPT {
                if let Some((object, stream, _)) = lent.objects.pop_front() {
                    evicted.extend([object, stream.into_any()]);
                }
            }
            lent.objects.push_back((obj.clone().unbind(), stream.clone_ref(py), naming));
        }
        drop(lent);
        drop(evicted);
        Ok(stream)
    }
}

/// Lets go of a buffer's `stream`, and of the memo's entries for it when nothing else uses it
/// any more (no other Python reference, no clone of the Rust stream: no buffer, no block a
/// cache keeps): so the lending library's object lives as long as its stream is used here,
/// and no longer. A stream still used stays in the memo, so it is found again (one stream to a
/// cache).
pub(crate) fn let_go(_py: Python<'_>, stream: Py<Stream>) {
    if !stream.get().is_lent() {
        return;
    }
    // Held here too: one more reference than the memo's.
    let evicted = evict(&mut lock(&LENT), &stream, 1);
    // Outside the lock: the library's object may run code when let go of.
    drop(evicted);
    drop(stream);
}

/// Lets go of every memo entry whose stream nothing else uses (after a cache gave its blocks
/// back, say).
pub(crate) fn prune_unused(py: Python<'_>) {
    let mut lent = lock(&LENT);
    let evicted = unused_entries(py, &mut lent);
    drop(lent);
    drop(evicted);
}

/// Takes out of the memo every entry whose stream nothing else uses; what was taken, to be
/// dropped outside the lock.
fn unused_entries(py: Python<'_>, lent: &mut Lent) -> Vec<Py<PyAny>> {
    let streams: Vec<Py<Stream>> = lent.streams.iter().map(|(_, _, s)| s.clone_ref(py)).collect();
    let mut evicted = Vec::new();
    for stream in &streams {
        // `streams` holds one more reference.
        evicted.extend(evict(lent, stream, 1));
    }
    evicted.extend(streams.into_iter().map(Py::into_any));
    evicted
}

/// Takes `stream`'s entries out of the memo when its references are the memo's and `others`
/// more, and no clone of its Rust stream is held elsewhere; what was taken, to be dropped
/// outside the lock.
fn evict(lent: &mut Lent, stream: &Py<Stream>, others: usize) -> Vec<Py<PyAny>> {
    let in_memo = lent.streams.iter().filter(|(_, _, s)| s.is(stream)).count()
        + lent.objects.iter().filter(|(_, s, _)| s.is(stream)).count();
    // SAFETY: a live object, held by the caller, who holds the GIL.
    let references = unsafe { ffi::Py_REFCNT(stream.as_ptr()) };
    let unused = references == (in_memo + others) as isize && stream.get().stream.handle_count() == 1;
    let mut evicted = Vec::new();
    if in_memo == 0 || !unused {
        return evicted;
    }
    while let Some(at) = lent.streams.iter().position(|(_, _, s)| s.is(stream)) {
        evicted.extend(lent.streams.remove(at).map(|(_, _, s)| s.into_any()));
    }
    while let Some(at) = lent.objects.iter().position(|(_, s, _)| s.is(stream)) {
        if let Some((object, s, _)) = lent.objects.remove(at) {
            evicted.extend([object, s.into_any()]);
        }
    }
    evicted
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `CU_STREAM_LEGACY`.
const LEGACY_HANDLE: usize = 1;

/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
const PER_THREAD_HANDLE: usize = 2;

/// Whether the calling thread's per-thread default stream (of the current context) captures:
/// `Some(id)` (the driver's capture id, where it gave one) while it does.
pub(crate) fn per_thread_capture() -> Outcome<Option<Option<u64>>> {
    let info = cumempool::sys::driver().and_then(|d| d.cuStreamGetCaptureInfo()).map_err(cumempool::Error::from)?;
    let mut status = cumempool::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: cumempool::sys::cuuint64_t = 0;
    // SAFETY: the per-thread stream of the current context (made current by the caller)
    // always exists; valid out-pointers, the optional ones null.
    let code = unsafe {
        info(
            PER_THREAD_HANDLE as cumempool::sys::CUstream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    crate::contexts::check("cuStreamGetCaptureInfo", code)?;
    Ok((status != cumempool::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        .then_some((id != 0).then_some(id)))
}

/// How many other libraries' streams are kept (with their objects) for reuse.
const LENT_KEPT: usize = 64;

/// How many recently passed stream objects are remembered by identity.
const RECENT_KEPT: usize = 8;

/// A stream another library lent (or an int handle), kept so that passing its object, another
/// object of the same stream (each `torch.cuda.current_stream()` is a new one) or its handle
/// again finds the same `Stream`: no conversion, and one stream to a cache, which keys blocks
/// by the `Stream`. The handle's value is the key, as PyTorch's caching allocator keys streams.
/// A held object does not always keep its stream alive (cuda.core's `Stream.close()` destroys
/// it), and the driver hands a destroyed stream's handle to the next new stream: so a hit is
/// confirmed by asking the entry's object which handle it names now
/// (`Stream::still_lent_as`), and a stale entry gives way to the new stream's object. Entries
/// nothing uses any more are let go of when a buffer lets go of its stream, on a miss, and
/// when a cache is released.
struct Lent {
    /// `(handle, device, stream)`, the oldest first.
    streams: VecDeque<(usize, i32, Py<Stream>)>,
    /// The objects passed last, held (so their identity stays theirs) with their stream and
    /// how they name it: the same object again needs no lookup, but for `__cuda_stream__`,
    /// which is asked again (the object may have closed its stream since).
    objects: VecDeque<(Py<PyAny>, Py<Stream>, Naming)>,
}

static LENT: Mutex<Lent> = Mutex::new(Lent { streams: VecDeque::new(), objects: VecDeque::new() });

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

/// The raw handle and device of another library's stream object, and how it names the stream.
fn foreign_handle(obj: &Bound<'_, PyAny>, default_device: i32) -> Outcome<(usize, i32, Naming)> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err("a stream is a Stream, an object with __cuda_stream__, a torch or CuPy stream, or an int handle; got a bool").into());
    }
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
fn protocol_handle(obj: &Bound<'_, PyAny>) -> Outcome<usize> {
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

#[pymethods]
impl Stream {
    /// A new non-blocking stream on `device` (default: the current device, as PyTorch, CuPy and
    /// cuda.core take it), destroyed with its last holder.
    #[new]
    #[pyo3(signature = (device = None))]
    fn new(py: Python<'_>, device: Option<i32>) -> Outcome<Self> {
        let device = match device {
            Some(device) => device,
            None => current_device(py)?,
        };
        let context = Self::context(py, device)?;
        // `cuStreamCreate` needs the context current: the caller's is put back after.
        let stream = crate::gil::detach(py, || {
            crate::contexts::while_current(&context, || Ok(cumempool::Stream::new(&context)?))
        })?;
        Ok(Self { stream, owner: None, device, closed: Default::default() })
    }

    /// The legacy default stream (`0`) of `device` (default: the current device): one object
    /// per device.
    #[staticmethod]
    #[pyo3(signature = (device = None))]
    fn legacy(py: Python<'_>, device: Option<i32>) -> Outcome<Py<Self>> {
        let device = match device {
            Some(device) => device,
            None => current_device(py)?,
        };
        Self::shared_legacy(py, device)
    }

    /// Borrows another library's stream: an object with `__cuda_stream__`, a torch or CuPy
    /// stream, or an int handle (of `device`, default: the object's device, else the current
    /// device). The object is
    /// held; a bare int must stay valid while this Stream and its buffers live, and while a
    /// cache keeps blocks freed on it (until its `release()`).
    #[staticmethod]
    #[pyo3(signature = (obj, device = None))]
    fn borrow(py: Python<'_>, obj: &Bound<'_, PyAny>, device: Option<i32>) -> Outcome<Py<Self>> {
        // `True` and `False` are ints to Python, and would name the legacy stream.
        if obj.is_instance_of::<pyo3::types::PyBool>() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "a bool is not a stream: pass a Stream, an object with __cuda_stream__, a torch or CuPy stream, or an int handle",
            )
            .into());
        }
        if let (Some(device), Ok(raw)) = (device, obj.extract::<usize>()) {
            if raw == 0 || raw == LEGACY_HANDLE {
                return Self::shared_legacy(py, device);
            }
            if raw == PER_THREAD_HANDLE {
                return Self::per_thread(py, device);
            }
            return Ok(Py::new(py, Self::borrow_handle(py, raw, device, None)?)?);
        }
        let device = match device {
            Some(device) => device,
            None => current_device(py)?,
        };
        Self::from_object(py, Some(obj), device)
    }

    /// The raw `CUstream` as an int. Whoever reads it may capture the stream into a CUDA graph
    /// (`torch.cuda.ExternalStream(s.handle)` under `torch.cuda.graph`), so the stream is marked
    /// as one that may capture: every capture-aware use here (a cache's alloc, a free) asks the
    /// driver from now on.
    #[getter]
    fn handle(&self) -> usize {
        self.lent_raw()
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
        self.owner.as_ref().map(|(o, _)| o.clone_ref(py))
    }

    /// Waits for all work queued on the stream.
    fn synchronize(&self, py: Python<'_>) -> Outcome<()> {
        self.check_open()?;
        let s = &self.stream;
        Ok(crate::gil::detach(py, || crate::contexts::restored_after(s.as_raw() as usize, || s.synchronize()))?)
    }

    /// Whether all queued work has finished.
    fn is_idle(&self, py: Python<'_>) -> Outcome<bool> {
        self.check_open()?;
        let s = &self.stream;
        Ok(crate::gil::detach(py, || crate::contexts::restored_after(s.as_raw() as usize, || s.is_idle()))?)
    }

    /// cuda.core's stream protocol: `(0, handle)`. Marks the stream as `handle` does.
    fn __cuda_stream__(&self) -> (u32, usize) {
        (0, self.lent_raw())
    }

    /// The raw handle, marking the stream as `handle` does.
    fn __int__(&self) -> usize {
        self.lent_raw()
    }

    /// Lets go of a stream cumempool created: later uses of this object raise `ClosedError`;
    /// the stream itself is destroyed once the buffers and cached blocks ordered on it are gone.
    /// A borrowed or legacy stream belongs to its library (and may be shared by other objects
    /// here): closing it does nothing.
    fn close(&self) {
        if self.stream.is_owned() {
            self.closed.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether `close()` was called on this (owned) stream.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) {
        self.close();
    }

    /// Streams are equal when they name the same driver stream of the same device.
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Self>()
            .is_ok_and(|o| o.get().stream.as_raw() == self.stream.as_raw() && o.get().device == self.device)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (self.stream.as_raw() as usize, self.device).hash(&mut hasher);
        hasher.finish()
    }

    fn __repr__(&self) -> String {
        // The handle shown can be copied into another library as well.
        let owned = if self.stream.is_owned() { "True" } else { "False" };
        format!("<cumempool.Stream handle={:#x} device={} owned={owned}>", self.lent_raw(), self.device)
    }
}

/// The calling thread's current device, as PyTorch, CuPy and cuda.core take it: the device of the
/// current context, else device 0 (no context current yet).
pub(crate) fn current_device(py: pyo3::Python<'_>) -> Outcome<i32> {
    crate::gil::detach(py, || -> Outcome<i32> {
        let driver = cumempool::sys::driver().map_err(cumempool::Error::from)?;
        let (get_current, get_device) = (
            driver.cuCtxGetCurrent().map_err(cumempool::Error::from)?,
            driver.cuCtxGetDevice().map_err(cumempool::Error::from)?,
        );
        let mut context: cumempool::sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        crate::contexts::check("cuCtxGetCurrent", unsafe { get_current(&mut context) })?;
        if context.is_null() {
            return Ok(0);
        }
        let mut device: cumempool::sys::CUdevice = 0;
        // SAFETY: a valid out-pointer; the current context.
        crate::contexts::check("cuCtxGetDevice", unsafe { get_device(&mut device, context) })?;
        // A device handle is its ordinal (cuDeviceGet(&d, i) gives d == i).
        Ok(device)
    })
}
