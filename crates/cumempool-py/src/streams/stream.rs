//! CUDA streams as Python sees them: one cumempool created (`Stream(device)`), the legacy
//! default stream of a device, the calling thread's per-thread default stream (served as the
//! legacy one, refused at each use while the calling thread's per-thread stream captures), or
//! another library's stream, borrowed while its Python object is held.
//!
//! Invariants: one `Stream` object per device for the legacy stream, one for the per-thread
//! stream, and one per lent stream
//! while the memo (`lent_streams`) keeps it, so a cache, which keys blocks by the `Stream`,
//! sees one stream however it is passed; every raw handle handed out goes through
//! `Stream::lent_raw`, which marks the stream as one that may capture.

use crate::errors::{Failure, Outcome};
use crate::streams::default_streams::{names_legacy, PER_THREAD_HANDLE};
use crate::streams::lent_streams::{
    foreign_handle, protocol_handle, refuse_bool, still_lent_as, Lent, LentStream, Naming,
};
use crate::streams::primary_contexts::{primary_context, PerDevice};
use crate::sync::locks::lock;
use crate::values::device::given_or_current;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::{Arc, Mutex};

/// A CUDA stream of one device: a new one (`Stream(device)`), a device's legacy default
/// stream (`Stream.legacy(device)`), or another library's stream (`Stream.borrow(obj)`), which
/// stays alive as long as cumempool uses it. Wherever cumempool takes a stream, it takes
/// another library's stream object as it is, too.
///
/// Example: `buf = pool.alloc(1 << 20, Stream.borrow(torch.cuda.current_stream()))`.
#[pyclass(frozen, module = "cumempool")]
pub struct Stream {
    pub(crate) stream: cumempool::Stream,
    /// For another library's stream: its object (the lender, and how it names the stream) and
    /// the other objects this stream was found for since (`hold_also`), held by every clone of
    /// the Rust stream (its keep-alive) so the stream outlives every use here.
    lenders: Option<Arc<Lenders>>,
    pub(crate) device: i32,
    /// Set by `close()` on a stream cumempool created: later uses through this object raise
    /// `ClosedError`; the driver stream goes with its last holder (buffers, caches).
    closed: std::sync::atomic::AtomicBool,
}

impl Stream {
    /// The raw handle, for code outside this package: the stream is marked as one that may
    /// capture first (`cumempool::Stream::note_capture_possible`, the lender's duty the core
    /// crate's `Stream::may_be_capturing` states), since the code it goes to may begin a
    /// capture on it that nothing here would see. Every path that hands a handle out goes
    /// through here. The legacy stream cannot be captured and is not marked (which would make
    /// each use of it ask the driver).
    pub(crate) fn lent_raw(&self) -> usize {
        let raw = self.handle_value();
        if !names_legacy(raw) {
            self.stream.note_capture_possible();
        }
        raw
    }

    /// The handle another library would use for this stream (2 for the per-thread stream
    /// served as `legacy_for_per_thread`), without marking it: for comparisons.
    fn handle_value(&self) -> usize {
        if self.stream.is_for_per_thread() {
            return PER_THREAD_HANDLE;
        }
        self.stream.as_raw() as usize
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
        self.lenders.is_some()
    }

    /// The legacy default stream of `device`, one object per device for the process, so a
    /// cache sees one stream and no context is retained per call.
    fn shared_legacy(py: Python<'_>, device: i32) -> Outcome<Py<Self>> {
        static LEGACY: PerDevice<Py<Stream>> = PerDevice::new();
        Self::shared(py, &LEGACY, device, cumempool::Stream::legacy)
    }

    /// What the calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`, handle 2)
    /// of `device` is served as: the core's `Stream::legacy_for_per_thread`, one object per
    /// device. Handle 2 names another stream on each thread, and memory allocated on one
    /// thread's may be freed from another thread, where 2 names that thread's; the legacy
    /// stream is ordered with every thread's per-thread stream both ways (both are blocking
    /// streams), and every use asks whether the calling thread's per-thread stream captures, so
    /// an object kept and used later is refused while it does (`StreamCapturingError`, the
    /// capture left intact).
    fn per_thread(py: Python<'_>, device: i32) -> Outcome<Py<Self>> {
        static PER_THREAD: PerDevice<Py<Stream>> = PerDevice::new();
        Self::shared(py, &PER_THREAD, device, cumempool::Stream::legacy_for_per_thread)
    }

    /// The one object of `device` in `objects`, made with `make` from the device's primary
    /// context the first time.
    fn shared(
        py: Python<'_>,
        objects: &'static PerDevice<Py<Stream>>,
        device: i32,
        make: fn(&cumempool::Context) -> cumempool::Stream,
    ) -> Outcome<Py<Self>> {
        let object = objects.get_or_make(device, || {
            // Retaining the context may be a long driver call: made with the GIL released.
            let context = crate::sync::gil::detach(py, || primary_context(device))?;
            Py::new(py, Self { stream: make(&context), lenders: None, device, closed: Default::default() })
                .map_err(Failure::from)
        })?;
        Ok(object.clone_ref(py))
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
        let context = crate::sync::gil::detach(py, || primary_context(device))?;
        let raw_stream = raw as cumempool::sys::CUstream;
        let lenders = owner.map(|first| Arc::new(Lenders::new(first)));
        let stream = match &lenders {
            // SAFETY: `raw` is the lending library's stream of `device`, and its Python object
            // (held by every clone of the result) keeps it alive.
            Some(lenders) => unsafe {
                cumempool::Stream::borrow_raw_keeping(raw_stream, Some(&context), lenders.clone())
            },
            // SAFETY: a bare int: the caller promised (`Stream.borrow`) that it stays valid while
            // this Stream and its buffers live.
            None => unsafe { cumempool::Stream::borrow_raw(raw_stream, Some(&context)) },
        }?;
        Ok(Self { stream, lenders, device, closed: Default::default() })
    }

    /// Holds `obj` too, for as long as any clone of the Rust stream lives: this remembered
    /// stream was found for it by its handle, and `obj` may be the object that owns the stream
    /// (a CuPy stream beside a `torch.cuda.ExternalStream` or cuda.core `Stream.from_handle` of
    /// its handle, met first). At most `ALSO_HELD` objects besides the lender, so objects made
    /// per call do not pile up.
    fn hold_also(&self, obj: &Bound<'_, PyAny>, naming: Naming) {
        let Some(lenders) = &self.lenders else { return };
        if naming == Naming::Int || lenders.first.0.is(obj) {
            return;
        }
        let mut others = lock(&lenders.others);
        if others.len() < ALSO_HELD && !others.iter().any(|(other, _)| other.is(obj)) {
            others.push((obj.clone().unbind(), naming));
        }
    }

    /// The object `raw` stands for where it names one of `device`'s default streams, which no
    /// library destroys: `0` and `CU_STREAM_LEGACY` name the legacy stream of whichever context
    /// is current (the device's own object, so two devices' legacy streams are never one
    /// stream); `CU_STREAM_PER_THREAD` the calling thread's per-thread stream (never
    /// remembered: each use is checked on its own thread, `per_thread`). `None` for any other
    /// handle.
    pub(crate) fn for_default_handle(py: Python<'_>, raw: usize, device: i32) -> Outcome<Option<Py<Self>>> {
        if names_legacy(raw) {
            return Self::shared_legacy(py, device).map(Some);
        }
        if raw == PER_THREAD_HANDLE {
            return Self::per_thread(py, device).map(Some);
        }
        Ok(None)
    }

    /// What `obj`, whose handle was just read as `raw` (CuPy's `ptr`), names as a stream: the
    /// memo's stream for `obj` where it still has that handle, so the object is not asked
    /// again; else looked up anew (whatever the memo kept for `obj`, which names another
    /// stream now).
    pub(crate) fn from_object_with_handle(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        raw: usize,
        default_device: i32,
    ) -> Outcome<Py<Self>> {
        let recent = lock(&LENT).recent(py, obj);
        if let Some((known, _)) = recent {
            if known.get().stream.as_raw() as usize == raw {
                return Ok(known);
            }
        }
        Self::looked_up_anew(py, obj, default_device)
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
        let recent = lock(&LENT).recent(py, obj);
        if let Some((known, naming)) = recent {
            // `__cuda_stream__` is asked again: the object may have closed its stream since
            // (cuda.core's `Stream.close()`), and the handle may name another stream by now. A
            // closed object's own error surfaces; one that names another stream is looked up
            // anew.
            if naming != Naming::Protocol || protocol_handle(obj)? == known.get().stream.as_raw() as usize {
                return Ok(known);
            }
        }
        Self::looked_up_anew(py, obj, default_device)
    }

    /// What `obj` (another library's stream object) names now, asked of the object itself and
    /// remembered: the stream kept for its handle where `obj` may stand for it, else a new one.
    fn looked_up_anew(py: Python<'_>, obj: &Bound<'_, PyAny>, default_device: i32) -> Outcome<Py<Self>> {
        let (raw, device, naming) = foreign_handle(obj, default_device)?;
        if let Some(stream) = Self::for_default_handle(py, raw, device)? {
            return Ok(stream);
        }
        let known = lock(&LENT).by_handle(py, raw, device);
        let stream = match known {
            Some(stream) if still_lent_as(stream.get(), obj, raw, naming) => {
                stream.get().hold_also(obj, naming);
                stream
            }
            _ => Py::new(py, Self::borrow_handle(py, raw, device, Some((obj.clone().unbind(), naming)))?)?,
        };
        let mut lent = lock(&LENT);
        let evicted = lent.remember(py, obj, (raw, device, naming), &stream);
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
pub(crate) fn let_go(py: Python<'_>, stream: Py<Stream>) {
    if !stream.get().is_lent() {
        // With the GIL held: let go of at once, without asking whether it is.
        return stream.drop_ref(py);
    }
    // Held here too: one more reference than the memo's.
    let evicted = lock(&LENT).let_go_of(&stream);
    // Outside the lock: the library's object may run code when let go of. With the GIL held, let
    // go of at once, also where no binding is on the stack (a DLPack consumer's deleter run from
    // Python code), where PyO3 would defer it to its next call.
    for object in evicted {
        object.drop_ref(py);
    }
    stream.drop_ref(py);
}

/// Lets go of every memo entry whose stream nothing else uses (after a cache gave its blocks
/// back, say).
pub(crate) fn prune_unused(py: Python<'_>) {
    let evicted = lock(&LENT).unused_entries(py);
    drop(evicted);
}

/// The streams other libraries lent, found again by object and by handle (`lent_streams`).
static LENT: Mutex<Lent<Stream>> = Mutex::new(Lent::new());

/// How many objects a lent stream holds besides its lender (`Stream::hold_also`).
const ALSO_HELD: usize = 8;

/// The objects a lent stream keeps alive: the lender (with how it names the stream), and others
/// it was found for since. Every clone of the Rust stream holds it, so a buffer or a cached
/// block keeps them all.
struct Lenders {
    first: (Py<PyAny>, Naming),
    others: Mutex<Vec<(Py<PyAny>, Naming)>>,
}

impl Lenders {
    fn new(first: (Py<PyAny>, Naming)) -> Self {
        Self { first, others: Mutex::new(Vec::new()) }
    }
}

impl LentStream for Stream {
    fn lender(&self) -> Option<&(Py<PyAny>, Naming)> {
        self.lenders.as_deref().map(|lenders| &lenders.first)
    }

    fn held_also(&self, py: Python<'_>) -> Vec<(Py<PyAny>, Naming)> {
        self.lenders.as_deref().map_or_else(Vec::new, |lenders| {
            lock(&lenders.others).iter().map(|(object, naming)| (object.clone_ref(py), *naming)).collect()
        })
    }

    fn shared_elsewhere(&self) -> bool {
        self.stream.handle_count() != 1
    }
}

#[pymethods]
impl Stream {
    /// A new non-blocking stream on `device` (default: the current device, as PyTorch, CuPy and
    /// cuda.core take it), destroyed with its last holder.
    #[new]
    #[pyo3(signature = (device = None))]
    fn new(py: Python<'_>, device: Option<i32>) -> Outcome<Self> {
        let device = given_or_current(device, py)?;
        // `cuStreamCreate` needs the context current: the caller's is put back after.
        let stream = crate::sync::gil::detach(py, || {
            let context = primary_context(device)?;
            context.while_current(|| cumempool::Stream::new(&context))
        })?;
        Ok(Self { stream, lenders: None, device, closed: Default::default() })
    }

    /// The legacy default stream (`0`) of `device` (default: the current device): one object
    /// per device.
    #[staticmethod]
    #[pyo3(signature = (device = None))]
    fn legacy(py: Python<'_>, device: Option<i32>) -> Outcome<Py<Self>> {
        let device = given_or_current(device, py)?;
        Self::shared_legacy(py, device)
    }

    /// Another library's stream as a `Stream`: an object with `__cuda_stream__` (cuda.core), a
    /// torch or CuPy stream, or an int handle, on `device` (default: the object's device, else
    /// the current device). A library's object is kept alive while cumempool uses its stream;
    /// a bare int must stay valid while this Stream and its buffers live, and while a cache
    /// keeps blocks freed on it (until its `release()`). `0` and `1` name the device's legacy
    /// stream, `2` the calling thread's per-thread stream (served as the legacy stream, and
    /// refused while it captures); a bool is refused.
    ///
    /// Example: `s = Stream.borrow(torch.cuda.current_stream())`.
    #[staticmethod]
    #[pyo3(signature = (obj, device = None))]
    fn borrow(py: Python<'_>, obj: &Bound<'_, PyAny>, device: Option<i32>) -> Outcome<Py<Self>> {
        // An object or handle seen before is found in the memo (`lent_streams`), so the same
        // stream passed again is usually the same `Stream` (one stream to a cache).
        refuse_bool(obj)?;
        if let (Some(device), Ok(raw)) = (device, obj.extract::<usize>()) {
            if names_legacy(raw) {
                return Self::shared_legacy(py, device);
            }
            if raw == PER_THREAD_HANDLE {
                return Self::per_thread(py, device);
            }
            return Ok(Py::new(py, Self::borrow_handle(py, raw, device, None)?)?);
        }
        let device = given_or_current(device, py)?;
        Self::from_object(py, Some(obj), device)
    }

    /// The raw `CUstream` as an int, for another library
    /// (`torch.cuda.ExternalStream(s.handle)`). That library may capture the stream into a CUDA
    /// graph: cumempool's allocations and frees on it notice the capture from then on.
    #[getter]
    fn handle(&self) -> usize {
        // Marked as one that may capture (`lent_raw`): every capture-aware use here (a cache's
        // alloc, a free) asks the driver from now on.
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
        self.lenders.as_ref().map(|lenders| lenders.first.0.clone_ref(py))
    }

    /// Waits for all work queued on the stream.
    fn synchronize(&self, py: Python<'_>) -> Outcome<()> {
        self.check_open()?;
        let s = &self.stream;
        Ok(crate::sync::gil::detach(py, || {
            crate::streams::current_context::restored_after(s.as_raw() as usize, || s.synchronize())
        })?)
    }

    /// Whether all queued work has finished.
    fn is_idle(&self, py: Python<'_>) -> Outcome<bool> {
        self.check_open()?;
        let s = &self.stream;
        Ok(crate::sync::gil::detach(py, || {
            crate::streams::current_context::restored_after(s.as_raw() as usize, || s.is_idle())
        })?)
    }

    /// cuda.core's stream protocol: `(0, handle)`, with `handle`'s rule.
    fn __cuda_stream__(&self) -> (u32, usize) {
        (0, self.lent_raw())
    }

    /// The raw handle, with `handle`'s rule.
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
            .is_ok_and(|o| o.get().handle_value() == self.handle_value() && o.get().device == self.device)
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (self.handle_value(), self.device).hash(&mut hasher);
        hasher.finish()
    }

    fn __repr__(&self) -> String {
        // The handle shown can be copied into another library as well.
        let owned = if self.stream.is_owned() { "True" } else { "False" };
        format!("<cumempool.Stream handle={:#x} device={} owned={owned}>", self.lent_raw(), self.device)
    }
}
