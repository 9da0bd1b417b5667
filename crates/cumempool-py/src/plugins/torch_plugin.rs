//! The C functions PyTorch's `CUDAPluggableAllocator` loads from this module's own shared
//! library, serving from the resource chosen in Python (`cumempool.torch`).
//!
//! They touch no Python object: PyTorch calls them from any thread, with or without the GIL.
//!
//! PyTorch gives an allocation function no pool id, so each `torch.cuda.MemPool` needs a
//! function of its own to keep the source it was made over: the module exports
//! [`TORCH_SLOTS`] allocation functions (`cumempool_torch_alloc_0`, ...), each serving the
//! source bound to its slot (`cumempool.torch.mem_pool` binds one), and one free function,
//! which finds the source by the pointer. `cumempool_torch_alloc` serves what `serve` chose,
//! for callers of the C functions themselves.

use crate::errors::{Failure, Outcome};
use crate::memory::dyn_resource::{Erased, Resource};
use crate::pools::resources::ResourceBase;
use crate::pools::MemPool;
use crate::streams::device_wait::wait_for_device;
use crate::streams::primary_contexts::PerDevice;
use cumempool::sys;
use cumempool_alloc::Statistics;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

/// What the exported functions serve: the resource and the device it allocates on.
#[derive(Clone)]
struct Served {
    resource: Arc<dyn Resource>,
    device: i32,
}

static SERVED: RwLock<Option<Served>> = RwLock::new(None);

/// One `Stream` per raw handle and device PyTorch passes, so a cache sees the same stream
/// every time (as PyTorch's own caching allocator, it keys by the handle's value). The device
/// is part of the key: the default stream is handle 0 on every device, and means each
/// device's own legacy stream.
static STREAMS: Mutex<Option<HashMap<(usize, i32), cumempool::Stream>>> = Mutex::new(None);

/// Memory PyTorch freed while a capture was underway (or while the device could not be waited
/// for): kept, with its slot, until `torch_release_captured` gives it back.
static PARKED: Mutex<Vec<Parked>> = Mutex::new(Vec::new());

/// A free kept for later.
struct Parked {
    ptr: usize,
    resource: Arc<dyn Resource>,
    size: usize,
    device: i32,
    slot: Option<SlotId>,
}

/// The resource each live allocation came from, its size and its slot, so a free goes back to
/// it even after Python switched or stopped what is served (or unbound the slot), with the size
/// it was allocated with (a cache files a block under its size: a wrong size PyTorch passes is
/// never trusted).
static LIVE: Mutex<Option<HashMap<usize, Live>>> = Mutex::new(None);

/// A live allocation.
struct Live {
    /// The resource it came from.
    resource: Arc<dyn Resource>,
    /// Its size, as allocated.
    size: usize,
    /// The slot whose function allocated it, while that binding lasts.
    slot: Option<SlotId>,
}

/// How many `torch.cuda.MemPool`s over distinct sources may live at once: one exported
/// allocation function each.
pub(crate) const TORCH_SLOTS: usize = 64;

/// One binding of a slot: its index and the binding's generation (a slot unbound and bound
/// again has a new one, so a late free or unbind of the old binding changes nothing).
#[derive(Clone, Copy, PartialEq, Eq)]
struct SlotId {
    index: usize,
    generation: u64,
}

/// A slot: the source its allocation function serves, if bound.
struct Slot {
    generation: u64,
    binding: Option<Binding>,
}

/// What a bound slot serves, and what keeps it bound.
struct Binding {
    /// What its function serves, counted (the served resource is the statistics, over the
    /// source); `None` once `stop()` ran: the slot's pools get PyTorch's out-of-memory.
    serving: Option<(Served, Arc<Statistics<Erased>>)>,
    /// The source it was bound for: `mem_pool` of the same source shares the slot while it
    /// serves. A sound key only then (the key's comment).
    source: SourceKey,
    /// The `torch.cuda.MemPool`s over the slot still alive.
    holders: usize,
    /// Allocations it made that are not freed yet: PyTorch's pool (and its allocation
    /// function) lives while its blocks do, even after the Python `MemPool` is gone.
    live: usize,
}

/// Which source a slot serves: a pool by its handle, or a resource by its address. Sound as a
/// key while the slot is bound: the binding holds the pool (or the resource) alive, so no other
/// source can have the same handle (or address) meanwhile.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SourceKey {
    Pool(usize),
    Resource(usize),
}

static SLOTS: [Mutex<Slot>; TORCH_SLOTS] = [const { Mutex::new(Slot { generation: 0, binding: None }) }; TORCH_SLOTS];

/// The last generation given to a binding.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Where the search for a free slot begins: the slot after the last one bound, so a slot just
/// freed is taken again last (PyTorch can in principle still reach a pool by its id).
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

fn slot(index: usize) -> MutexGuard<'static, Slot> {
    crate::sync::locks::lock(&SLOTS[index])
}

impl Slot {
    /// The binding of `id`, if the slot is still bound to it.
    fn binding_of(&mut self, id: SlotId) -> Option<&mut Binding> {
        if self.generation != id.generation {
            return None;
        }
        self.binding.as_mut()
    }

    /// Unbinds the slot when nothing keeps it bound any more; what it served, to be dropped
    /// outside the lock (dropping a cache gives its blocks back to the driver).
    fn take_if_unused(&mut self) -> Option<Binding> {
        match &self.binding {
            Some(binding) if binding.holders == 0 && binding.live == 0 => self.binding.take(),
            _ => None,
        }
    }
}

fn stream_for(raw: usize, device: i32) -> cumempool::Result<cumempool::Stream> {
    let mut streams = crate::sync::locks::lock(&STREAMS);
    let streams = streams.get_or_insert_with(HashMap::new);
    if let Some(stream) = streams.get(&(raw, device)) {
        return Ok(stream.clone());
    }
    let context = crate::streams::primary_contexts::primary_context(device)?;
    let stream = match raw {
        raw if crate::streams::default_streams::names_legacy(raw) => cumempool::Stream::legacy(&context),
        // Another stream on each thread: the legacy stream, asking the calling thread's at each use.
        crate::streams::default_streams::PER_THREAD_HANDLE => cumempool::Stream::legacy_for_per_thread(&context),
        // SAFETY: PyTorch never destroys its own streams (the default stream, its stream pools).
        // A stream lent to it through `torch.cuda.ExternalStream` is the lender's to keep alive,
        // as PyTorch requires; here, until the served resource gave back what was freed on it
        // (the plug-in's documented contract: docs/python.md, Plug-ins).
        _ => unsafe { cumempool::Stream::borrow_raw(raw as sys::CUstream, Some(&context)) }?,
    };
    streams.insert((raw, device), stream.clone());
    Ok(stream)
}

/// Serves the exported C functions from `resource` (or stops serving, with `None`).
#[pyfunction]
#[pyo3(signature = (resource))]
pub fn torch_serve(py: Python<'_>, resource: Option<&Bound<'_, ResourceBase>>) -> Outcome<()> {
    if let Some(resource) = resource {
        refuse_python_callbacks("cumempool.torch.serve", resource.get())?;
    }
    let served = resource.map(|r| Served { resource: r.get().inner.clone(), device: r.get().device });
    // The lock is held only to swap (no allocation runs under it), and the resource served
    // until now is let go of after, without the GIL: a cache dropped there frees on the driver.
    let previous = std::mem::replace(&mut *crate::sync::locks::write(&SERVED), served);
    crate::sync::gil::detach(py, || drop(previous));
    Ok(())
}

/// Refuses a source whose allocations may call Python: PyTorch calls the plug-in's allocation
/// function holding its per-device allocator mutex, so a callback there would wait for the GIL
/// while holding it, and any thread holding the GIL that asks PyTorch's allocator for something
/// (`torch.cuda.memory_stats()`, an allocation) waits for that mutex: a deadlock. The plug-in
/// never waits for the GIL.
fn refuse_python_callbacks(what: &str, resource: &ResourceBase) -> Outcome<()> {
    if !resource.calls_python {
        return Ok(());
    }
    Err(Failure::Python(PyValueError::new_err(format!(
        "{what} cannot serve a source with an OnOutOfMemory callback: PyTorch calls the plug-in \
         holding its allocator lock, where the callback would wait for the GIL while another \
         thread holding the GIL waits for that lock (torch.cuda.memory_stats(), say), and both \
         would hang. Serve the source below the OnOutOfMemory (PyTorch frees its cached blocks \
         and retries before it raises torch.OutOfMemoryError, which your code can catch)"
    ))))
}

/// PyTorch's pluggable allocation function for what `serve` chose: `size` bytes on `device`,
/// ordered on `stream`; null for zero bytes, and (PyTorch's out-of-memory) on any failure or
/// for a device the resource does not serve.
///
/// # Safety
/// Called by PyTorch with a valid stream of `device`.
#[no_mangle]
pub unsafe extern "C" fn cumempool_torch_alloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    // PyTorch may call in holding the GIL or not: the GIL is left as it is.
    let _unmarked = crate::sync::gil::Unmarked::new();
    // A clone, so no lock is held while the resource runs: its out-of-memory callback may
    // serve another resource or stop (`torch_serve` takes the write lock).
    let served = crate::sync::locks::read(&SERVED).clone();
    // SAFETY: under the caller's promise.
    unsafe { allocate(served, None, size, device, stream) }
}

/// The allocation function of slot `index` (exported as `cumempool_torch_alloc_<index>`): as
/// `cumempool_torch_alloc`, from the source bound to the slot.
///
/// # Safety
/// As `cumempool_torch_alloc`.
unsafe fn alloc_in_slot(index: usize, size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
    let _unmarked = crate::sync::gil::Unmarked::new();
    // A clone, as in `cumempool_torch_alloc`: the lock is not held while the resource runs.
    let bound = {
        let slot = slot(index);
        let served = slot.binding.as_ref().and_then(|b| b.serving.as_ref()).map(|(served, _)| served.clone());
        served.map(|served| (served, SlotId { index, generation: slot.generation }))
    };
    let (served, id) = bound.unzip();
    // SAFETY: under the caller's promise.
    unsafe { allocate(served, id, size, device, stream) }
}

/// Allocates from `served` (nothing served: PyTorch's out-of-memory) and records the
/// allocation for the free, with the slot whose function made it.
///
/// # Safety
/// As `cumempool_torch_alloc`.
unsafe fn allocate(
    served: Option<Served>,
    mut id: Option<SlotId>,
    size: isize,
    device: i32,
    stream: *mut c_void,
) -> *mut c_void {
    // Zero bytes (an empty tensor) is the null pointer, which PyTorch never frees: nothing is
    // allocated or kept for it, or it would stay live for ever and keep its resource alive.
    let Ok(size @ 1..) = usize::try_from(size) else {
        return std::ptr::null_mut();
    };
    let Some(served) = served.filter(|s| s.device == device) else {
        return std::ptr::null_mut();
    };
    let answer = stream_for(stream as usize, device)
        .map_err(cumempool_alloc::Error::from)
        .and_then(|s| allocate_outside_graphs(&served, size, &s));
    match answer {
        Ok(ptr) => {
            // The slot may have been unbound meanwhile (`stop()` from an out-of-memory
            // callback): the allocation then keeps no slot bound.
            if let Some(index) = id.map(|id| id.index) {
                let mut slot = slot(index);
                match id.and_then(|id| slot.binding_of(id)) {
                    Some(binding) => binding.live += 1,
                    None => id = None,
                }
            }
            let live = Live { resource: served.resource.clone(), size, slot: id };
            crate::sync::locks::lock(&LIVE).get_or_insert_with(HashMap::new).insert(ptr as usize, live);
            ptr as usize as *mut c_void
        }
        Err(error) => {
            tracing::debug!(%error, size, device, "cumempool_torch_alloc failed");
            std::ptr::null_mut()
        }
    }
}

/// `size` bytes from `served`, ordered on `stream`, and never graph memory: PyTorch's caching
/// allocator keeps the segment the plug-in gives and may hand any part of it to a later
/// allocation of the same pool outside the capture, but graph memory (an allocation node)
/// belongs to the graph's launches, and no pool caps or counts it. So while `stream`
/// captures into a graph, the memory is allocated on the device's side stream and waited for
/// (in relaxed capture mode, as PyTorch's own `cudaMalloc` there): ordinary memory, idle and
/// usable from any stream, counted by the pool's cap like any other. PyTorch's free later comes
/// on `stream`; a free while `stream` still captures is deferred by the core until it ends.
fn allocate_outside_graphs(
    served: &Served,
    size: usize,
    stream: &cumempool::Stream,
) -> cumempool_alloc::Result<sys::CUdeviceptr> {
    let mut capturing = stream.is_capturing_keeping_context()?;
    let beside_a_capture = capturing
        || (stream.as_raw().is_null() && crate::streams::default_streams::legacy_stream_blocked(served.device));
    if !beside_a_capture {
        // Graph memory of a capture begun after the question is given back, and allocated
        // beside that capture.
        match crate::memory::dyn_resource::allocate_unless_a_capture_took_it(&*served.resource, size, stream)? {
            Some(ptr) => return Ok(ptr),
            None => capturing = true,
        }
    }
    // A capture on the stream, or (for work queued on the legacy stream, PyTorch's default
    // stream and the per-thread one included) on a blocking stream of the device, which the
    // allocation would invalidate: allocated beside it.
    if capturing {
        note_capturing(served.device, stream);
    }
    cumempool::in_relaxed_capture_mode(|| {
        // Made on first use, in relaxed mode too: a capture in global mode refuses this thread
        // calls that are unsafe while it runs.
        let side = side_stream(served.device)?;
        let ptr = served.resource.allocate(size, &side)?;
        if let Err(error) = side.synchronize() {
            // SAFETY: just allocated on `side` and given to no one; freed once, on `side`.
            if let Err(free_error) = unsafe { served.resource.deallocate(ptr, size, &side) } {
                tracing::warn!(%free_error, "freeing a side-stream allocation that could not be waited for");
            }
            return Err(error.into());
        }
        Ok(ptr)
    })
}

/// One non-blocking stream per device for allocations made while PyTorch's stream captures
/// (`allocate_outside_graphs`), made on first use and kept for the process.
static SIDE_STREAMS: PerDevice<cumempool::Stream> = PerDevice::new();

fn side_stream(device: i32) -> cumempool::Result<cumempool::Stream> {
    SIDE_STREAMS
        .get_or_make(device, || {
            let context = crate::streams::primary_contexts::primary_context(device)?;
            context.while_current(|| cumempool::Stream::new(&context))
        })
        .cloned()
}

/// Exports the allocation function of each slot, `cumempool_torch_alloc_<index>`.
macro_rules! slot_functions {
    ($($index:literal)*) => {
        $(
            const _: () = {
                /// The allocation function of one slot.
                ///
                /// # Safety
                /// As `cumempool_torch_alloc`.
                #[export_name = concat!("cumempool_torch_alloc_", $index)]
                unsafe extern "C" fn alloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void {
                    // SAFETY: under the caller's promise.
                    unsafe { alloc_in_slot($index, size, device, stream) }
                }
            };
        )*
        // One function per slot, no more, no less.
        const _: () = assert!([$($index),*].len() == TORCH_SLOTS);
    };
}

slot_functions!(
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
    32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
);

/// PyTorch's pluggable free function: gives `ptr` back on `stream`.
///
/// # Safety
/// `ptr` must come from `cumempool_torch_alloc` with the same device and stream, freed once. The
/// size is the one recorded at allocation, whatever `size` says.
#[no_mangle]
pub unsafe extern "C" fn cumempool_torch_free(ptr: *mut c_void, size: isize, device: i32, stream: *mut c_void) {
    // The null pointer is what an empty allocation got: nothing to give back.
    if ptr.is_null() {
        return;
    }
    // As in `cumempool_torch_alloc`.
    let _unmarked = crate::sync::gil::Unmarked::new();
    let live = crate::sync::locks::lock(&LIVE).as_mut().and_then(|l| l.remove(&(ptr as usize)));
    let Some(Live { resource, size: allocated, slot: id }) = live else {
        tracing::warn!(?ptr, "cumempool_torch_free of memory cumempool_torch_alloc did not give: ignored");
        return;
    };
    if usize::try_from(size) != Ok(allocated) {
        tracing::warn!(
            ?ptr,
            size,
            allocated,
            "cumempool_torch_free given another size than allocated: freed with the allocated size"
        );
    }
    let size = allocated;
    let given_back = stream_for(stream as usize, device).map_err(cumempool_alloc::Error::from).and_then(|s| {
        if !device_is_idle_for_a_free(&s, device) {
            // A capture is underway: the graph may use this memory at every launch, so it is
            // kept (with its slot) until `release_captured()`, after the graphs are gone.
            crate::sync::locks::lock(&PARKED).push(Parked {
                ptr: ptr as usize,
                resource: resource.clone(),
                size,
                device,
                slot: id,
            });
            return Ok(false);
        }
        // SAFETY: PyTorch frees what cumempool_torch_alloc gave (it was live), with the size
        // recorded then, to the resource it came from; the device has finished every launch
        // queued before, so no replay of a graph still uses it, on whatever stream it ran.
        unsafe { resource.deallocate(ptr as usize as sys::CUdeviceptr, size, &s) }.map(|()| true)
    });
    match given_back {
        Ok(true) => release_slot_hold(id),
        Ok(false) => {}
        Err(error) => {
            tracing::warn!(%error, ?ptr, "cumempool_torch_free failed");
            release_slot_hold(id);
        }
    }
}

/// Whether a free may give memory back now, on `stream` of `device`: no capture underway on
/// it, and the device done with every launch queued before (as PyTorch's own release, whose
/// `cudaFree` synchronises the device, assumes). PyTorch frees a segment only once no tensor
/// uses it, but a CUDA graph replayed on another stream may still read it, unordered with
/// `stream`. The wait (`cuCtxSynchronize`) invalidates any capture underway on the device, in
/// every mode (driver 580, measured), so it is not made while one is known
/// (`capture_known_underway`), and the free is kept instead. Called holding PyTorch's allocator
/// mutex and perhaps the GIL, as `cudaFree` is: a host function that needs the GIL, queued
/// before, would wait for it.
fn device_is_idle_for_a_free(stream: &cumempool::Stream, device: i32) -> bool {
    if stream.is_capturing_keeping_context().unwrap_or(true) {
        note_capturing(device, stream);
        return false;
    }
    if capture_known_underway(device) {
        return false;
    }
    let waited = wait_for_device(device);
    if let Err(error) = &waited {
        tracing::debug!(%error, device, "the wait before a plug-in free was refused: the free is kept");
    }
    waited.is_ok()
}

/// Streams the plug-in saw capturing, with their device, kept for the process: a capture that
/// asked the plug-in for memory once may run again on the same stream (PyTorch captures on one
/// stream by default) without asking. A stream whose question fails (destroyed by its lender)
/// is dropped from it. The per-thread stream is never kept: it names another stream on each
/// thread, and a capturing thread's per-thread stream, which is blocking, is seen through the
/// legacy stream.
static SEEN_CAPTURING: Mutex<Vec<(i32, cumempool::Stream)>> = Mutex::new(Vec::new());

fn note_capturing(device: i32, stream: &cumempool::Stream) {
    if stream.is_for_per_thread() {
        return;
    }
    let mut seen = crate::sync::locks::lock(&SEEN_CAPTURING);
    if !seen.iter().any(|(d, s)| *d == device && s.same_as(stream)) {
        seen.push((device, stream.clone()));
    }
}

/// Whether a capture is known to be underway on `device`, asked in ways that leave a capture
/// intact: each stream the plug-in saw capturing, and the legacy stream, which answers with an
/// error while a blocking stream of the context captures (CuPy's streams are blocking). A
/// capture on a non-blocking stream that never asked the plug-in for memory is not seen: the
/// docs tell users not to free through PyTorch then. A seen stream whose question fails is
/// forgotten (its lender destroyed it); a failed question of the legacy stream counts as a
/// capture.
fn capture_known_underway(device: i32) -> bool {
    let seen: Vec<cumempool::Stream> = crate::sync::locks::lock(&SEEN_CAPTURING)
        .iter()
        .filter(|(d, _)| *d == device)
        .map(|(_, s)| s.clone())
        .collect();
    for stream in &seen {
        match stream.capture_status_keeping_context() {
            Ok(cumempool::CaptureStatus::None) => {}
            Ok(_) => return true,
            Err(error) => {
                tracing::warn!(%error, "a stream the torch plug-in saw capturing cannot be asked any more: forgotten");
                crate::sync::locks::lock(&SEEN_CAPTURING).retain(|(d, s)| !(*d == device && s.same_as(stream)));
            }
        }
    }
    crate::streams::default_streams::legacy_stream_blocked(device)
}

/// Lets go of the hold an allocation of slot `id` kept on its slot (its free ran).
fn release_slot_hold(id: Option<SlotId>) {
    if let Some(id) = id {
        let mut slot = slot(id.index);
        let mut unused = None;
        if let Some(binding) = slot.binding_of(id) {
            binding.live -= 1;
            unused = slot.take_if_unused();
        }
        drop(slot);
        // Outside the lock: dropping what the slot served may give a cache's blocks back.
        drop(unused);
    }
}

/// Gives back the memory PyTorch freed during captures (`cumempool.torch.release_captured()`),
/// after waiting for each device it is on; returns the bytes given back. A device whose wait is
/// refused (a capture underway on it) keeps its memory, and the refusal is raised.
#[pyfunction]
pub fn torch_release_captured(py: Python<'_>) -> Outcome<usize> {
    let parked = std::mem::take(&mut *crate::sync::locks::lock(&PARKED));
    let (released, kept, refusal) = crate::sync::gil::detach(py, || {
        let mut devices: Vec<i32> = parked.iter().map(|p| p.device).collect();
        devices.sort_unstable();
        devices.dedup();
        let mut idle = Vec::new();
        let mut refusal = None;
        for device in devices {
            if capture_known_underway(device) {
                // The wait would invalidate it.
                let refused = cumempool::Error::StreamCapturing {
                    operation: "giving back memory kept for CUDA graphs (release_captured waits for the device)",
                    capture: None,
                };
                refusal = refusal.or(Some(refused));
                continue;
            }
            // Given back on the side stream: a cache files the blocks under a stream the
            // plug-in uses again.
            let waited = wait_for_device(device).and_then(|()| side_stream(device));
            match waited {
                Ok(stream) => idle.push((device, stream)),
                Err(error) => refusal = refusal.or(Some(error)),
            }
        }
        let (mut released, mut kept) = (0, Vec::new());
        for free in parked {
            let Some((_, stream)) = idle.iter().find(|(d, _)| *d == free.device) else {
                kept.push(free);
                continue;
            };
            // SAFETY: allocated by `resource` with `size` bytes, freed by PyTorch and kept since,
            // given back once; the device has finished every launch queued before.
            match unsafe { free.resource.deallocate(free.ptr as sys::CUdeviceptr, free.size, stream) } {
                Ok(()) => released += free.size,
                Err(error) => tracing::warn!(%error, ptr = free.ptr, "giving back memory a capture kept failed"),
            }
            release_slot_hold(free.slot);
        }
        (released, kept, refusal)
    });
    crate::sync::locks::lock(&PARKED).extend(kept);
    match refusal {
        Some(error) => Err(error.into()),
        None => Ok(released),
    }
}

/// The bytes PyTorch freed during captures that the plug-in keeps until `release_captured()`.
#[pyfunction]
pub fn torch_captured_bytes() -> usize {
    crate::sync::locks::lock(&PARKED).iter().map(|p| p.size).sum()
}

/// Binds a slot to `source` (a `MemPool` or a resource), serving `resource` (the source as a
/// resource) counted, and holds it for one more `torch.cuda.MemPool`; a slot bound to the same
/// source already is shared. Returns `(slot, generation)`. Raises `RuntimeError` when every
/// slot is bound.
#[pyfunction]
pub fn torch_bind(source: &Bound<'_, PyAny>, resource: &Bound<'_, ResourceBase>) -> Outcome<(usize, u64)> {
    refuse_python_callbacks("cumempool.torch.mem_pool", resource.get())?;
    let key = if let Ok(pool) = source.cast::<MemPool>() {
        SourceKey::Pool(pool.get().pool()?.as_raw() as usize)
    } else if let Ok(base) = source.cast::<ResourceBase>() {
        SourceKey::Resource(Arc::as_ptr(&base.get().inner).cast::<()>() as usize)
    } else {
        return Err(PyTypeError::new_err("cumempool.torch serves a cumempool.MemPool or a cumempool.Resource").into());
    };
    for index in 0..TORCH_SLOTS {
        let mut slot = slot(index);
        let generation = slot.generation;
        if let Some(binding) = slot.binding.as_mut().filter(|b| b.serving.is_some() && b.source == key) {
            binding.holders += 1;
            return Ok((index, generation));
        }
    }
    let start = NEXT_SLOT.load(Ordering::Relaxed);
    for index in (0..TORCH_SLOTS).map(|i| (start + i) % TORCH_SLOTS) {
        let mut slot = slot(index);
        if slot.binding.is_some() {
            continue;
        }
        let statistics = Arc::new(Statistics::new(Erased(resource.get().inner.clone())));
        let served = Served { resource: statistics.clone(), device: resource.get().device };
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
        slot.generation = generation;
        slot.binding = Some(Binding { serving: Some((served, statistics)), source: key, holders: 1, live: 0 });
        NEXT_SLOT.store((index + 1) % TORCH_SLOTS, Ordering::Relaxed);
        return Ok((index, generation));
    }
    Err(Failure::Python(PyRuntimeError::new_err(format!(
        "all {TORCH_SLOTS} cumempool.torch slots are bound: each torch.cuda.MemPool that \
         cumempool.torch.mem_pool made over a distinct source holds one until it and its blocks \
         are gone; delete unused MemPools (and torch.cuda.empty_cache()), share sources, or \
         call cumempool.torch.stop()"
    ))))
}

/// Lets go of one hold on the slot binding `(slot, generation)` (a `torch.cuda.MemPool` gone);
/// the slot is unbound once no hold and no allocation of it is left. A binding already gone
/// (`stop()`) is left alone.
#[pyfunction]
pub fn torch_unbind(py: Python<'_>, slot_index: usize, generation: u64) {
    if slot_index >= TORCH_SLOTS {
        return;
    }
    let mut slot = slot(slot_index);
    let mut unused = None;
    if let Some(binding) = slot.binding_of(SlotId { index: slot_index, generation }) {
        binding.holders = binding.holders.saturating_sub(1);
        unused = slot.take_if_unused();
    }
    drop(slot);
    // Without the GIL: a cache dropped here frees on the driver.
    crate::sync::gil::detach(py, || drop(unused));
}

/// Stops every slot: their functions serve nothing from now on (PyTorch's out-of-memory), and
/// what they allocated still goes back to its source when freed. A slot is free again once its
/// pools and blocks are gone, as before: a pool still alive must never reach a source bound to
/// its slot later.
#[pyfunction]
pub fn torch_stop_slots(py: Python<'_>) {
    let mut stopped = Vec::new();
    for index in 0..TORCH_SLOTS {
        let mut slot = slot(index);
        stopped.extend(slot.binding.as_mut().and_then(|b| b.serving.take()));
        drop(slot.take_if_unused());
    }
    // Without the GIL: a cache dropped here frees on the driver.
    crate::sync::gil::detach(py, || drop(stopped));
}

/// What the slot binding `(slot, generation)` served (`Statistics.usage()`), or `None` once
/// it is unbound.
#[pyfunction]
pub fn torch_usage(py: Python<'_>, slot_index: usize, generation: u64) -> PyResult<Option<Bound<'_, PyDict>>> {
    if slot_index >= TORCH_SLOTS {
        return Ok(None);
    }
    let usage = slot(slot_index)
        .binding_of(SlotId { index: slot_index, generation })
        .and_then(|b| b.serving.as_ref())
        .map(|(_, statistics)| statistics.usage());
    usage.map(|usage| crate::pools::resources::usage_dict(py, usage)).transpose()
}
