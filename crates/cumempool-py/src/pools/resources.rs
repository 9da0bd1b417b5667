//! Stream-ordered resources from Python: a pool as a resource, the adaptors (statistics, limit,
//! tracking, an out-of-memory callback) and the cache, composable in any order like the Rust
//! types. Each Python object holds the Rust resource behind one object-safe trait
//! (`dyn_resource`).

use crate::errors::{Failure, Outcome};
use crate::memory::buffers::Buffer;
use crate::memory::dyn_resource::{Erased, Resource};
use crate::memory::{Core, Kind, Memory};
use crate::pools::driver_link::DriverLink;
use crate::pools::MemPool;
use crate::streams::stream::Stream;
use crate::sync::gil::Held;
use cumempool::sys::CUdeviceptr;
use cumempool_alloc::{
    CachingResource as Cache, DeviceMemory, HostMemory, Limit as LimitAdaptor, ManagedMemory,
    OnOutOfMemory as OomAdaptor, PoolResource, Statistics as StatisticsAdaptor, Tracking as TrackingAdaptor,
};
use pyo3::exceptions::PyException;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::{PyClassInitializer, PyTraverseError};
use std::cell::RefCell;
use std::sync::{Arc, Mutex, TryLockError};

/// Base of every resource: `alloc(size, stream)` returns a Buffer given back to the resource
/// when closed or collected.
#[pyclass(subclass, frozen, module = "cumempool", name = "Resource")]
pub struct ResourceBase {
    pub(crate) inner: Arc<dyn Resource>,
    pub(crate) kind: Kind,
    pub(crate) device: i32,
    /// The Python object below (pool or inner resource), kept for as long as this one and
    /// shown to the garbage collector (`__traverse__`). It is never cleared: a cycle through it
    /// also runs through an object the collector can clear (a callback, an instance's dict).
    /// A stream another library lent needs nothing here: every clone of its Rust stream (a
    /// buffer's, one a cache keeps with its blocks) holds the library's object.
    below: Py<PyAny>,
    /// Whether an allocation through this stack may call Python (an `OnOutOfMemory` callback
    /// in it), and so wait for the GIL.
    pub(crate) calls_python: bool,
}

impl ResourceBase {
    /// `size` bytes on `stream` as a Buffer, on a stream the caller found not capturing (the
    /// plug-ins check it their own way): `alloc` without its capture check.
    pub(crate) fn alloc_outside_captures(&self, py: Python<'_>, size: usize, stream: Py<Stream>) -> Outcome<Buffer> {
        // The plug-in's check came first: a capture begun after it is caught after the allocation.
        let allocate = |inner: &dyn Resource, stream: &cumempool::Stream| {
            crate::memory::dyn_resource::allocate_unless_a_capture_took_it(inner, size, stream)
        };
        match self.alloc_with(py, size, stream, allocate)? {
            Ok(buffer) => Ok(buffer),
            // The stream comes back where the pool allocated into a capture begun meanwhile.
            Err(_) => Err(refused_during_capture()),
        }
    }

    /// `size` bytes on `stream` as a Buffer where no capture is underway on it, asking the
    /// driver once at most ([`Resource::allocate_unless_capturing`]); the stream back, with
    /// nothing allocated, where one is or the driver cannot say (ask again for which).
    pub(crate) fn alloc_unless_capturing(
        &self,
        py: Python<'_>,
        size: usize,
        stream: Py<Stream>,
    ) -> Outcome<Result<Buffer, Py<Stream>>> {
        self.alloc_with(py, size, stream, |inner, stream| inner.allocate_unless_capturing(size, stream))
    }

    /// What `allocate` answers from `self.inner` on `stream`, as a Buffer; the stream back where
    /// it answers None (nothing allocated).
    fn alloc_with(
        &self,
        py: Python<'_>,
        size: usize,
        stream: Py<Stream>,
        allocate: impl FnOnce(&dyn Resource, &cumempool::Stream) -> cumempool_alloc::Result<Option<CUdeviceptr>>,
    ) -> Outcome<Result<Buffer, Py<Stream>>> {
        // Only an out-of-memory callback can raise an interruption: a stack without one has
        // nothing to collect.
        let interruptions = self.calls_python.then(Interruptions::collect);
        // The GIL is released, and the caller's context put back, only around driver calls, at
        // the bottom of the stack (a cache hit makes none).
        let allocated = {
            let _held = Held::new(py);
            allocate(&*self.inner, &stream.get().stream)
        };
        if let Some(interruption) = interruptions.and_then(Interruptions::take) {
            // A resource above the callback (a cache) may have found memory after its refusal.
            if let Ok(Some(ptr)) = allocated {
                let _held = Held::new(py);
                // SAFETY: just allocated by `inner` with `size` bytes on this stream, freed
                // once, never used.
                if let Err(error) = unsafe { self.inner.deallocate(ptr, size, &stream.get().stream) } {
                    tracing::warn!(%error, size, "giving back an allocation an interruption stopped failed");
                }
            }
            return Err(interruption.into());
        }
        let Some(ptr) = allocated? else { return Ok(Err(stream)) };
        let memory =
            Memory::Resource { ptr, len: size, resource: self.inner.clone(), stream: stream.get().stream.clone() };
        // The memory's device is the pool's, whichever device's stream it is ordered on.
        let device = if self.kind == Kind::Device { self.device } else { stream.get().device };
        Ok(Ok(Buffer::new(Core::new(memory, stream, self.kind, device))))
    }

    fn over(inner: Arc<dyn Resource>, below: &ResourceBase, below_object: Py<PyAny>) -> Self {
        Self { inner, kind: below.kind, device: below.device, below: below_object, calls_python: below.calls_python }
    }
}

#[pymethods]
impl ResourceBase {
    /// Allocates `size` bytes ordered on `stream` (as `MemPool.alloc`). On a stream capturing
    /// into a CUDA graph it raises StreamCapturingError: allocate before the capture, or through
    /// the capturing library's allocator plug-in.
    ///
    /// Example: `buf = CachingResource(PoolResource(pool)).alloc(1 << 20, stream)`.
    #[pyo3(signature = (size, stream = None))]
    fn alloc(&self, py: Python<'_>, size: usize, stream: Option<&Bound<'_, PyAny>>) -> Outcome<Buffer> {
        let mut stream = Stream::from_object(py, stream, self.device)?;
        // What it allocates on a capturing stream is graph memory (an allocation node), and the
        // Buffer, freed outside the graph, would either have its free refused before a launch
        // (each launch then allocates memory nothing frees) or run unordered after one. The
        // legacy stream's question, of the blocking streams beside it, is asked apart.
        if stream.get().stream.is_legacy() {
            stream.get().stream.ensure_not_capturing(ALLOC_DURING_CAPTURE)?;
            return self.alloc_outside_captures(py, size, stream);
        }
        // First, the frees an earlier capture deferred on the stream, which the question asked
        // apart (`ensure_not_capturing`) ran: a cache hit reaches no pool that would run them,
        // and a stream served from the cache would hold them.
        if stream.get().stream.may_be_capturing() {
            stream.get().stream.run_frees_deferred_by_a_capture();
        }
        // One question where the stack can answer it with the allocation. Where it answers no
        // allocation, the question is asked again for the reason (the capture's refusal, or the
        // driver's error); a capture that has ended since is allocated for once more, through
        // the same call, so that one begun meanwhile is refused, not served graph memory.
        for _ in 0..2 {
            match self.alloc_unless_capturing(py, size, stream)? {
                Ok(buffer) => return Ok(buffer),
                Err(back) => stream = back,
            }
            stream.get().stream.ensure_not_capturing(ALLOC_DURING_CAPTURE)?;
        }
        Err(refused_during_capture())
    }

    /// `"device"`, `"host"` or `"managed"`.
    #[getter]
    fn memory_kind(&self) -> &'static str {
        self.kind.name()
    }

    /// The device whose legacy stream serves `alloc(size)` without a stream.
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// `CachingResource(PoolResource(MemPool(...)), max_cached=...)`: the stack from the top,
    /// each layer with the arguments it was made with.
    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let name = slf.get_type().qualname()?;
        let below = slf.get().below.bind(slf.py()).repr()?;
        let arguments = if let Ok(limit) = slf.cast::<Limit>() {
            format!(", {}", limit.get().0.limit())
        } else if let Ok(cache) = slf.cast::<Caching>() {
            format!(", max_cached={}", cache.get().0.max_cached())
        } else if let Ok(on_oom) = slf.cast::<OnOutOfMemory>() {
            let slot = crate::sync::locks::lock(&on_oom.get().callback);
            let callback = slot.as_ref().map(|c| c.clone_ref(slf.py()));
            // Released before the repr runs Python code.
            drop(slot);
            match callback {
                Some(callback) => format!(", {}", callback.bind(slf.py()).repr()?),
                None => ", None".to_owned(),
            }
        } else {
            String::new()
        };
        Ok(format!("{name}({below}{arguments})"))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.below)
    }
}

/// Why `alloc` is refused on a stream capturing into a graph, and what to do instead (the
/// allocator plug-ins serve captures through the raw path, freed inside the capture).
const ALLOC_DURING_CAPTURE: &str = "allocating with Resource.alloc (a Buffer cannot hold a capture's graph memory: allocate before the capture, or through the capturing library's allocator plug-in)";

/// `Resource.alloc`'s refusal where a capture took the stream and the driver named no capture.
fn refused_during_capture() -> Failure {
    cumempool_alloc::Error::Pool(cumempool::Error::StreamCapturing { operation: ALLOC_DURING_CAPTURE, capture: None })
        .into()
}

/// A pool as a resource, the bottom of a stack of adaptors:
/// `Statistics(PoolResource(MemPool(Route.device(0))))`.
#[pyclass(extends = ResourceBase, frozen, module = "cumempool", name = "PoolResource")]
pub struct PoolResourceBinding;

#[pymethods]
impl PoolResourceBinding {
    #[new]
    fn new(pool: Bound<'_, MemPool>) -> Outcome<PyClassInitializer<Self>> {
        let (inner, route): (Arc<dyn Resource>, _) = {
            let borrowed = pool.borrow();
            let p = borrowed.pool()?;
            let route = p.route();
            let inner: Arc<dyn Resource> = match Kind::of(route) {
                Kind::Device => Arc::new(DriverLink(PoolResource::<DeviceMemory>::new(&p)?)),
                Kind::Host => Arc::new(DriverLink(PoolResource::<HostMemory>::new(&p)?)),
                Kind::Managed => Arc::new(DriverLink(PoolResource::<ManagedMemory>::new(&p)?)),
            };
            (inner, route)
        };
        let base = ResourceBase {
            inner,
            kind: Kind::of(route),
            device: MemPool::home_device(route),
            below: pool.into_any().unbind(),
            calls_python: false,
        };
        Ok(PyClassInitializer::from(base).add_subclass(Self))
    }
}

fn base_of<'py>(resource: &Bound<'py, ResourceBase>) -> (Arc<dyn Resource>, Py<PyAny>) {
    (resource.get().inner.clone(), resource.clone().into_any().unbind())
}

/// Counts bytes and allocations through the resource below (current, peak, total).
#[pyclass(extends = ResourceBase, frozen, module = "cumempool")]
pub struct Statistics(Arc<StatisticsAdaptor<Erased>>);

#[pymethods]
impl Statistics {
    #[new]
    fn new(resource: &Bound<'_, ResourceBase>) -> PyClassInitializer<Self> {
        let (inner, object) = base_of(resource);
        let adaptor = Arc::new(StatisticsAdaptor::new(Erased(inner)));
        let base = ResourceBase::over(adaptor.clone(), resource.get(), object);
        PyClassInitializer::from(base).add_subclass(Self(adaptor))
    }

    /// A snapshot, as a dict: `current_bytes`, `peak_bytes`, `total_bytes`, `current_count`,
    /// `peak_count` and `total_count`.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        usage_dict(py, self.0.usage())
    }

    /// Sets the peaks to the current values.
    fn reset_peaks(&self) {
        self.0.reset_peaks();
    }
}

/// `usage` as the dict `Statistics.usage()` answers.
pub(crate) fn usage_dict(py: Python<'_>, usage: cumempool_alloc::Usage) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("current_bytes", usage.current_bytes)?;
    dict.set_item("peak_bytes", usage.peak_bytes)?;
    dict.set_item("total_bytes", usage.total_bytes)?;
    dict.set_item("current_count", usage.current_count)?;
    dict.set_item("peak_count", usage.peak_count)?;
    dict.set_item("total_count", usage.total_count)?;
    Ok(dict)
}

/// Refuses allocations that would take the bytes in use past `limit` (LimitExceededError, an
/// OutOfMemoryError, so a cache above gives its blocks back and retries).
#[pyclass(extends = ResourceBase, frozen, module = "cumempool")]
pub struct Limit(Arc<LimitAdaptor<Erased>>);

#[pymethods]
impl Limit {
    #[new]
    fn new(resource: &Bound<'_, ResourceBase>, limit: usize) -> PyClassInitializer<Self> {
        let (inner, object) = base_of(resource);
        let adaptor = Arc::new(LimitAdaptor::new(Erased(inner), limit));
        let base = ResourceBase::over(adaptor.clone(), resource.get(), object);
        PyClassInitializer::from(base).add_subclass(Self(adaptor))
    }

    /// Bytes in use through this limit.
    #[getter]
    fn in_use(&self) -> usize {
        self.0.in_use()
    }

    /// The limit in bytes.
    #[getter]
    fn limit(&self) -> usize {
        self.0.limit()
    }
}

/// Records every allocation not yet freed (address, size, stream). With `backtraces=True`,
/// `report()` also shows where each was made (the native call stack, not Python's).
#[pyclass(extends = ResourceBase, frozen, module = "cumempool")]
pub struct Tracking(Arc<TrackingAdaptor<Erased>>);

#[pymethods]
impl Tracking {
    #[new]
    #[pyo3(signature = (resource, *, backtraces = false))]
    fn new(resource: &Bound<'_, ResourceBase>, backtraces: bool) -> PyClassInitializer<Self> {
        let (inner, object) = base_of(resource);
        let adaptor = Arc::new(TrackingAdaptor::new(Erased(inner)).with_backtraces(backtraces));
        let base = ResourceBase::over(adaptor.clone(), resource.get(), object);
        PyClassInitializer::from(base).add_subclass(Self(adaptor))
    }

    /// `(ptr, size, stream id)` of every allocation not yet freed.
    fn outstanding(&self) -> Vec<(u64, usize, u64)> {
        self.0.outstanding().into_iter().map(|o| (o.ptr, o.bytes, o.stream.get())).collect()
    }

    /// Bytes not yet freed.
    #[getter]
    fn outstanding_bytes(&self) -> usize {
        self.0.outstanding_bytes()
    }

    /// A readable report of what is outstanding.
    fn report(&self) -> String {
        self.0.report()
    }
}

thread_local! {
    /// `Some` while a `Resource.alloc` runs on this thread, holding the first interruption (an
    /// exception that is not an `Exception`: KeyboardInterrupt, SystemExit) an out-of-memory
    /// callback raised during it. Out-of-memory callbacks run on the allocating thread.
    static INTERRUPTION: RefCell<Option<Option<PyErr>>> = const { RefCell::new(None) };
}

/// Collects the interruptions of out-of-memory callbacks for the life of one `alloc`, so that
/// `alloc` raises them; nested `alloc`s (a callback allocating) each collect their own.
struct Interruptions {
    outer: Option<Option<PyErr>>,
}

impl Interruptions {
    fn collect() -> Self {
        Self { outer: INTERRUPTION.with(|slot| slot.replace(Some(None))) }
    }

    /// The interruption a callback raised since `collect`, if any.
    fn take(self) -> Option<PyErr> {
        INTERRUPTION.with(|slot| slot.borrow_mut().as_mut().and_then(Option::take))
    }

    /// Whether an interruption stops the `alloc` under way: no callback runs again in it.
    fn pending() -> bool {
        INTERRUPTION.with(|slot| matches!(*slot.borrow(), Some(Some(_))))
    }

    /// Keeps `interruption` for the `alloc` under way, or hands it back outside one (a plug-in
    /// allocating for another library) or when the `alloc` keeps one already.
    fn keep(interruption: PyErr) -> Result<(), PyErr> {
        INTERRUPTION.with(|slot| match &mut *slot.borrow_mut() {
            Some(kept @ None) => {
                *kept = Some(interruption);
                Ok(())
            }
            _ => Err(interruption),
        })
    }
}

impl Drop for Interruptions {
    fn drop(&mut self) {
        // Outside the borrow: dropping an interruption not taken (only on a panic) may run Python.
        drop(INTERRUPTION.with(|slot| slot.replace(self.outer.take())));
    }
}

/// Calls `callback(requested_bytes, attempt)` when the resource below is out of memory;
/// `True` retries, `False` raises. An exception in the callback counts as `False` and is
/// reported as unraisable; an interruption (KeyboardInterrupt, SystemExit: an exception that is
/// not an `Exception`) stops the allocation, and `alloc` raises it.
#[pyclass(extends = ResourceBase, frozen, module = "cumempool")]
pub struct OnOutOfMemory {
    callback: CallbackSlot,
}

/// The callback, shared with the Rust adaptor that calls it, where the garbage collector can
/// see it and take it out (a cycle through it, such as a bound method of the object holding
/// this resource, is collected). Locked only with the GIL held and never across a call.
type CallbackSlot = Arc<Mutex<Option<Py<PyAny>>>>;

type Callback = Box<dyn Fn(usize, u32) -> bool + Send + Sync>;

#[pymethods]
impl OnOutOfMemory {
    #[new]
    fn new(resource: &Bound<'_, ResourceBase>, callback: Py<PyAny>) -> PyClassInitializer<Self> {
        let (inner, object) = base_of(resource);
        let slot: CallbackSlot = Arc::new(Mutex::new(Some(callback)));
        let shared = slot.clone();
        // Where Python cannot be attached to (shutting down), no retry: the out-of-memory stands.
        let call: Callback = Box::new(move |bytes, attempt| {
            crate::sync::gil::try_attach(|py| answer(py, &shared, bytes, attempt)).unwrap_or(false)
        });
        let adaptor = Arc::new(OomAdaptor::new(Erased(inner), call));
        let base = ResourceBase { calls_python: true, ..ResourceBase::over(adaptor, resource.get(), object) };
        PyClassInitializer::from(base).add_subclass(Self { callback: slot })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // The slot is locked only for a moment with the GIL held, so it is free here; were it
        // not, the callback stays unvisited, which only keeps it alive.
        match self.callback.try_lock() {
            Ok(callback) => visit.call(callback.as_ref()),
            Err(TryLockError::Poisoned(callback)) => visit.call(callback.into_inner().as_ref()),
            Err(TryLockError::WouldBlock) => Ok(()),
        }
    }

    fn __clear__(&self) {
        let callback = crate::sync::locks::lock(&self.callback).take();
        // Released after the lock: dropping it may run Python code.
        drop(callback);
    }
}

/// The callback's answer: whether to retry. Without a callback (the collector took it) or
/// after an interruption in the same `alloc`, no retry.
fn answer(py: Python<'_>, slot: &CallbackSlot, bytes: usize, attempt: u32) -> bool {
    if Interruptions::pending() {
        return false;
    }
    let callback = crate::sync::locks::lock(slot).as_ref().map(|c| c.clone_ref(py));
    let Some(callback) = callback else {
        return false;
    };
    match callback.call1(py, (bytes, attempt)).and_then(|answer| answer.is_truthy(py)) {
        Ok(retry) => retry,
        Err(error) if error.is_instance_of::<PyException>(py) => {
            error.write_unraisable(py, None);
            false
        }
        Err(interruption) => {
            if let Err(interruption) = Interruptions::keep(interruption) {
                interruption.write_unraisable(py, None);
            }
            false
        }
    }
}

/// A cache over the resource below: blocks freed through it are kept per stream and serve
/// later allocations on that stream. `max_cached` bounds the bytes of free blocks it keeps
/// (default: 1 GiB); `release()` gives the cached blocks back.
#[pyclass(extends = ResourceBase, frozen, module = "cumempool", name = "CachingResource")]
pub struct Caching(Arc<Cache<Erased>>);

#[pymethods]
impl Caching {
    #[new]
    #[pyo3(signature = (resource, *, max_cached = None))]
    fn new(resource: &Bound<'_, ResourceBase>, max_cached: Option<usize>) -> PyClassInitializer<Self> {
        let (inner, object) = base_of(resource);
        let cache = Arc::new(match max_cached {
            Some(bytes) => Cache::with_max_cached(Erased(inner), bytes),
            None => Cache::new(Erased(inner)),
        });
        let base = ResourceBase::over(cache.clone(), resource.get(), object);
        PyClassInitializer::from(base).add_subclass(Self(cache))
    }

    /// A snapshot, as a dict: `hits`, `misses`, `cached_bytes`, `cached_blocks`, `streams`
    /// and `hit_rate`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.0.stats();
        let dict = PyDict::new(py);
        dict.set_item("hits", stats.hits)?;
        dict.set_item("misses", stats.misses)?;
        dict.set_item("cached_bytes", stats.cached_bytes)?;
        dict.set_item("cached_blocks", stats.cached_blocks)?;
        dict.set_item("streams", stats.streams)?;
        dict.set_item("hit_rate", stats.hit_rate())?;
        Ok(dict)
    }

    /// The most bytes of free blocks the cache keeps.
    #[getter]
    fn max_cached(&self) -> usize {
        self.0.max_cached()
    }

    /// Gives every cached block back to the resource below (and with them the cache's hold on
    /// the streams other libraries lent), except blocks of the legacy stream while a blocking
    /// stream captures: freed there, they would invalidate that capture, so they stay cached
    /// until it is over.
    fn release(&self, py: Python<'_>) -> Outcome<()> {
        let cache = self.0.clone();
        crate::sync::gil::detach(py, || cache.release())?;
        crate::streams::stream::prune_unused(py);
        Ok(())
    }
}
