//! Its own process: it loads the fault-injecting driver before the process's first driver call.
//!
//! The fault suite: every fallible driver call of the safe and alloc layers made to fail, through
//! the fault-injecting driver (`cumempool-fault`), which this process loads instead of libcuda.
//!
//! Each case fails exactly one driver call site and checks what a user would notice: the error
//! is typed and names the call, nothing panics, a Drop whose driver call fails says so once
//! (`tracing`), nothing is freed twice (the test frees what the library had to leave, and the
//! driver accepts it), nothing leaks (the pool's used memory is back to 0; compute-sanitizer's
//! leak check in the GPU pack), and the state is consistent and usable afterwards.
//! docs/reliability.md lists the sites and the case that covers each. Two modules use the same
//! fixture: `failures_after_queued_work` (failures after work was queued) and `route_checks` (the
//! driver calls of a routing call, counted).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod failures_after_queued_work;
mod route_checks;

use allocator_api2::vec::Vec as PoolVec;
use cumempool::{
    current_pool, default_pool, is_default, reset_current_pool, set_current_pool, Access, Context, Device, Error,
    Event, HandleTypes, Location, MemPool, Pool, PoolAttribute, Route, Stream,
};
use cumempool_alloc::{CachingResource, DeviceMemory, HostMemory, PoolAllocator, PoolResource, StreamOrderedResource};
use cumempool_tests::fault_library::FaultLibrary;
use cumempool_tests::{pattern, routing_lock};
use std::fmt::Debug;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

/// `CUDA_ERROR_UNKNOWN`: what the cases inject unless the code matters to the path.
const UNKNOWN: u32 = 999;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: u32 = 2;

/// The process-wide fixture: the fault library in place of libcuda, device 0's context, and
/// what happened to the one call that only the process's first use can reach.
struct Suite {
    faults: FaultLibrary,
    context: Context,
    /// `Device::count` with its first `cuDeviceGetCount` failed (the count is cached after).
    first_count: cumempool::Result<i32>,
}

static SUITE: OnceLock<Option<Suite>> = OnceLock::new();

/// Warnings and errors logged through `tracing`, for the cases whose Drop must say it failed.
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn logged() -> MutexGuard<'static, Vec<String>> {
    LOGGED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Collects warnings (and errors) with their fields, the way a subscriber would show them.
struct WarningLog;

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl tracing::Subscriber for WarningLog {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        logged().push(fields.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn setup() -> Option<Suite> {
    let faults = FaultLibrary::install().unwrap_or_else(|e| panic!("the fault library: {e}"));
    // Fails only when an earlier setup panicked (no GPU under CUMEMPOOL_REQUIRE_GPU=1) after setting it.
    let _ = tracing::subscriber::set_global_default(WarningLog);
    if cumempool::init().is_err() {
        cumempool_tests::gpu()?; // says why, or fails under CUMEMPOOL_REQUIRE_GPU=1
    }
    let library = cumempool::library_path().unwrap();
    assert!(library.ends_with(cumempool_tests::fault_library::FILE_NAME), "the driver is {library}");
    faults.set_plan("cuDeviceGetCount:nth=1").unwrap();
    let first_count = Device::count();
    faults.clear();
    let context = cumempool_tests::gpu()?;
    Some(Suite { faults, context, first_count })
}

/// The suite, with the lock every case holds (they share the process's driver and plan), the
/// plan cleared and the log emptied; `None` without a GPU.
fn suite() -> Option<(MutexGuard<'static, ()>, &'static Suite)> {
    let lock = routing_lock();
    let suite = SUITE.get_or_init(setup).as_ref()?;
    suite.faults.clear();
    logged().clear();
    Some((lock, suite))
}

impl Suite {
    /// Runs `call` with the `nth` call of `function` (counted from here) answering `code`, and
    /// checks the fault was injected exactly once: the call site was reached.
    #[track_caller]
    fn failing<T>(&self, function: &str, nth: u64, code: u32, call: impl FnOnce() -> T) -> T {
        self.faults.reset_counts();
        self.faults.set_plan(&format!("{function}:nth={nth}:code={code}")).unwrap();
        let outcome = call();
        self.faults.clear();
        assert_eq!(self.faults.injected(function), 1, "the case never reached the {nth}th call of {function}");
        outcome
    }

    /// As [`Suite::failing`], with the first call of each of `functions` failing, each once.
    #[track_caller]
    fn failing_first_of_each<T>(&self, functions: [&str; 2], call: impl FnOnce() -> T) -> T {
        self.faults.reset_counts();
        let plan = functions.map(|function| format!("{function}:nth=1:code={UNKNOWN}")).join(";");
        self.faults.set_plan(&plan).unwrap();
        let outcome = call();
        self.faults.clear();
        for function in functions {
            assert_eq!(self.faults.injected(function), 1, "the case never reached the first call of {function}");
        }
        outcome
    }

    fn stream(&self) -> Stream {
        Stream::new(&self.context).unwrap()
    }
}

/// The driver call an error names, with its code.
fn failed_call(error: &Error) -> Option<(&'static str, u32)> {
    match error {
        Error::Driver(cause)
        | Error::RouteRefused { cause, .. }
        | Error::PoolCreation { cause, .. }
        | Error::SharingRefused { cause, .. }
        | Error::CaptureRefused { cause, .. } => Some((cause.function, cause.code)),
        Error::OutOfMemory { function, .. } => Some((function, OUT_OF_MEMORY)),
        _ => None,
    }
}

/// The call failed with a typed error naming `function` and `code`; returns the error.
#[track_caller]
fn refused_by<T: Debug>(result: cumempool::Result<T>, function: &str, code: u32) -> Error {
    let error = match result {
        Err(error) => error,
        Ok(value) => panic!("{function} failed, but the call answered {value:?}"),
    };
    names_the_call(&error, function, code);
    error
}

#[track_caller]
fn names_the_call(error: &Error, function: &str, code: u32) {
    assert_eq!(failed_call(error), Some((function, code)), "{error}");
    assert!(error_chain(error).contains(function), "{error}");
    if code == UNKNOWN {
        assert!(error_chain(error).contains("CUDA_ERROR_UNKNOWN"), "the driver named the code: {error}");
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// Exactly one warning was logged, and it names `function`.
#[track_caller]
fn warned_once(function: &str) {
    let log = logged();
    assert_eq!(log.len(), 1, "expected one warning naming {function}, got {log:?}");
    assert!(log[0].contains(function), "{log:?}");
}

/// The `ptr` field of the one warning logged.
#[track_caller]
fn logged_address() -> cumempool::sys::CUdeviceptr {
    let log = logged();
    let field = log.first().and_then(|line| line.split("ptr=").nth(1)).unwrap_or_else(|| panic!("no ptr in {log:?}"));
    field.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no address in {log:?}"))
}

/// The pool holds no allocation once `stream` is idle.
#[track_caller]
fn nothing_used(pool: &Pool, stream: &Stream) {
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the pool still holds memory");
}

// ---- device.rs -----------------------------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_first_device_count_fails_cleanly_and_is_asked_again() {
    let Some((_lock, suite)) = suite() else { return };
    names_the_call(suite.first_count.as_ref().expect_err("the count was failed"), "cuDeviceGetCount", UNKNOWN);
    assert!(Device::count().unwrap() >= 1, "a failed count is not kept");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn device_queries_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    refused_by(suite.failing("cuDeviceGet", 1, UNKNOWN, || Device::get(0)), "cuDeviceGet", UNKNOWN);
    let device = Device::get(0).unwrap();
    refused_by(suite.failing("cuDeviceGetName", 1, UNKNOWN, || device.name()), "cuDeviceGetName", UNKNOWN);
    refused_by(suite.failing("cuDeviceGetUuid", 1, UNKNOWN, || device.uuid()), "cuDeviceGetUuid", UNKNOWN);
    refused_by(suite.failing("cuDeviceTotalMem", 1, UNKNOWN, || device.total_memory()), "cuDeviceTotalMem", UNKNOWN);
    let supports = suite.failing("cuDeviceGetAttribute", 1, UNKNOWN, || device.supports_memory_pools());
    refused_by(supports, "cuDeviceGetAttribute", UNKNOWN);
    let peer = suite.failing("cuDeviceCanAccessPeer", 1, UNKNOWN, || device.can_access_peer(device));
    refused_by(peer, "cuDeviceCanAccessPeer", UNKNOWN);
    assert!(!device.name().unwrap().is_empty() && device.supports_memory_pools().unwrap(), "usable afterwards");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn graph_memory_calls_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let device = Device::get(0).unwrap();
    let read = suite.failing("cuDeviceGetGraphMemAttribute", 1, UNKNOWN, || device.graph_memory());
    refused_by(read, "cuDeviceGetGraphMemAttribute", UNKNOWN);
    let reset = suite.failing("cuDeviceSetGraphMemAttribute", 1, UNKNOWN, || device.reset_graph_memory_high());
    refused_by(reset, "cuDeviceSetGraphMemAttribute", UNKNOWN);
    let trim = suite.failing("cuDeviceGraphMemTrim", 1, UNKNOWN, || device.trim_graph_memory());
    refused_by(trim, "cuDeviceGraphMemTrim", UNKNOWN);
    device.reset_graph_memory_high().unwrap();
    device.trim_graph_memory().unwrap();
    device.graph_memory().unwrap();
}

// ---- context.rs ----------------------------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn context_calls_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let device = Device::get(0).unwrap();
    let retain = suite.failing("cuDevicePrimaryCtxRetain", 1, UNKNOWN, || device.primary_context());
    refused_by(retain, "cuDevicePrimaryCtxRetain", UNKNOWN);
    let context = &suite.context;
    refused_by(suite.failing("cuCtxSetCurrent", 1, UNKNOWN, || context.make_current()), "cuCtxSetCurrent", UNKNOWN);
    // Every operation that needs its context current asks first; a stream is one.
    refused_by(suite.failing("cuCtxGetCurrent", 1, UNKNOWN, || Stream::new(context)), "cuCtxGetCurrent", UNKNOWN);
    let synchronize = suite.failing("cuCtxSynchronize", 1, UNKNOWN, || context.synchronize());
    refused_by(synchronize, "cuCtxSynchronize", UNKNOWN);
    refused_by(suite.failing("cuMemGetInfo", 1, UNKNOWN, || context.memory_info()), "cuMemGetInfo", UNKNOWN);
    context.make_current().unwrap();
    refused_by(suite.failing("cuCtxGetDevice", 1, UNKNOWN, cumempool::current_device), "cuCtxGetDevice", UNKNOWN);
    assert_eq!(cumempool::current_device().unwrap().map(Device::ordinal), Some(0));
    context.synchronize().unwrap();
    assert!(context.memory_info().unwrap().1 > 0, "usable afterwards");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_context_whose_release_fails_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let device = Device::get(0).unwrap();
    let extra = device.primary_context().unwrap(); // a second retain, released on drop
    suite.failing("cuDevicePrimaryCtxRelease", 1, UNKNOWN, || drop(extra));
    warned_once("cuDevicePrimaryCtxRelease");
    // The retain the failed release left: given back here, which the driver accepts once.
    let release = cumempool::sys::driver().unwrap().cuDevicePrimaryCtxRelease().unwrap();
    // SAFETY: balances the retain whose release was failed above.
    assert_eq!(unsafe { release(device.as_raw()) }, cumempool::sys::CUresult::CUDA_SUCCESS);
    suite.stream().synchronize().unwrap();
}

// ---- stream.rs -----------------------------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn stream_and_event_calls_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let context = &suite.context;
    refused_by(suite.failing("cuStreamCreate", 1, UNKNOWN, || Stream::new(context)), "cuStreamCreate", UNKNOWN);
    let stream = suite.stream();
    refused_by(
        suite.failing("cuStreamSynchronize", 1, UNKNOWN, || stream.synchronize()),
        "cuStreamSynchronize",
        UNKNOWN,
    );
    refused_by(suite.failing("cuStreamQuery", 1, UNKNOWN, || stream.is_idle()), "cuStreamQuery", UNKNOWN);
    let status = suite.failing("cuStreamGetCaptureInfo", 1, UNKNOWN, || stream.capture_status());
    refused_by(status, "cuStreamGetCaptureInfo", UNKNOWN);
    refused_by(suite.failing("cuEventCreate", 1, UNKNOWN, || Event::new(context)), "cuEventCreate", UNKNOWN);
    let event = Event::new(context).unwrap();
    refused_by(suite.failing("cuEventRecord", 1, UNKNOWN, || event.record(&stream)), "cuEventRecord", UNKNOWN);
    event.record(&stream).unwrap();
    refused_by(suite.failing("cuStreamWaitEvent", 1, UNKNOWN, || stream.wait(&event)), "cuStreamWaitEvent", UNKNOWN);
    refused_by(suite.failing("cuEventQuery", 1, UNKNOWN, || event.is_complete()), "cuEventQuery", UNKNOWN);
    let synchronize = suite.failing("cuEventSynchronize", 1, UNKNOWN, || event.synchronize());
    refused_by(synchronize, "cuEventSynchronize", UNKNOWN);
    stream.wait(&event).unwrap();
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap() && stream.is_idle().unwrap(), "usable afterwards");
}

/// Host waits run in relaxed capture mode: a refused switch fails the wait before it begins, and
/// a refused restore is logged while the wait's own answer stands.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_host_wait_whose_capture_mode_change_fails_names_it_or_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let exchange = "cuThreadExchangeStreamCaptureMode";
    refused_by(suite.failing(exchange, 1, UNKNOWN, || stream.synchronize()), exchange, UNKNOWN);
    assert!(logged().is_empty(), "nothing to restore: {:?}", logged());
    suite.failing(exchange, 2, UNKNOWN, || stream.synchronize()).expect("the wait itself succeeded");
    warned_once(exchange);
    let driver = cumempool::sys::driver().unwrap();
    let mut mode = cumempool::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    assert_eq!(
        // SAFETY: a valid in/out pointer; puts back the default mode the failed restore left relaxed.
        unsafe { driver.cuThreadExchangeStreamCaptureMode().unwrap()(&mut mode) },
        cumempool::sys::CUresult::CUDA_SUCCESS
    );
    assert_eq!(mode, cumempool::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED, "left relaxed");
    stream.synchronize().unwrap();
    assert!(stream.is_idle().unwrap(), "usable afterwards");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_stream_whose_destroy_fails_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let raw = stream.as_raw();
    suite.failing("cuStreamDestroy", 1, UNKNOWN, || drop(stream));
    warned_once("cuStreamDestroy");
    let destroy = cumempool::sys::driver().unwrap().cuStreamDestroy().unwrap();
    // SAFETY: the stream whose destroy was failed above; destroyed once, here.
    assert_eq!(unsafe { destroy(raw) }, cumempool::sys::CUresult::CUDA_SUCCESS, "no destroy happened before");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn an_event_whose_destroy_fails_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let event = Event::new(&suite.context).unwrap();
    let raw = event.as_raw();
    suite.failing("cuEventDestroy", 1, UNKNOWN, || drop(event));
    warned_once("cuEventDestroy");
    let destroy = cumempool::sys::driver().unwrap().cuEventDestroy().unwrap();
    // SAFETY: the event whose destroy was failed above; destroyed once, here.
    assert_eq!(unsafe { destroy(raw) }, cumempool::sys::CUresult::CUDA_SUCCESS, "no destroy happened before");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_free_deferred_by_a_capture_that_fails_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(1 << 20, &stream).unwrap();
    let ptr = buffer.as_raw();
    // Other code (cudarc's begin_capture) captures the buffer's stream: the drop defers the free
    // until the stream no longer captures.
    stream.note_capture_possible();
    let driver = cumempool::sys::driver().unwrap();
    let mode = cumempool::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    assert_eq!(
        // SAFETY: a live stream that does not capture.
        unsafe { driver.cuStreamBeginCapture().unwrap()(stream.as_raw(), mode) },
        cumempool::sys::CUresult::CUDA_SUCCESS
    );
    drop(buffer);
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun on this thread above; the graph it hands back is destroyed once.
    unsafe {
        assert_eq!(
            driver.cuStreamEndCapture().unwrap()(stream.as_raw(), &mut graph),
            cumempool::sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(driver.cuGraphDestroy().unwrap()(graph), cumempool::sys::CUresult::CUDA_SUCCESS);
    }
    // The next allocation on the stream runs the deferred free, which fails.
    let next = suite.failing("cuMemFreeAsync", 1, UNKNOWN, || pool.alloc_raw(4096, &stream)).unwrap();
    let log = logged().clone();
    assert!(log.len() == 1 && log[0].contains("cuMemFreeAsync") && log[0].contains(&format!("ptr={ptr}")), "{log:?}");
    stream.synchronize().unwrap();
    assert!(pool.used_mem_current().unwrap() >= (1 << 20) + 4096, "the refused free left the memory allocated");
    // SAFETY: the allocation whose deferred free was failed above, and the one just made; each
    // freed once, here.
    unsafe {
        cumempool::free_async(ptr, &stream).expect("the driver accepts the only real free");
        cumempool::free_async(next, &stream).unwrap();
    }
    nothing_used(&pool, &stream);
}

// ---- pool.rs, owner.rs, attributes.rs --------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn creating_a_pool_that_fails_leaves_nothing_half_made() {
    let Some((_lock, suite)) = suite() else { return };
    // A retired pool of the same properties would serve the builder without cuMemPoolCreate.
    // SAFETY: the suite lock serialises the cases; no thread allocates through a route now.
    unsafe { cumempool::destroy_retired_pools() }.unwrap();
    // Every property goes to the driver in the one cuMemPoolCreate call: no attribute is set
    // before or after it, so a refusal leaves no pool behind.
    let builder = || MemPool::builder(Route::host()).max_size(64 << 20);
    let create = suite.failing("cuMemPoolCreate", 1, UNKNOWN, || builder().build());
    refused_by(create, "cuMemPoolCreate", UNKNOWN);
    assert_eq!(suite.faults.calls("cuMemPoolDestroy"), 0, "nothing to undo");
    let invalid = suite.failing("cuMemPoolCreate", 1, 1, || builder().build());
    assert!(matches!(refused_by(invalid, "cuMemPoolCreate", 1), Error::PoolCreation { .. }));
    // CUDA_ERROR_OUT_OF_MEMORY: the driver holds no more pools; the reason says what to do.
    let full = refused_by(suite.failing("cuMemPoolCreate", 1, 2, || builder().build()), "cuMemPoolCreate", 2);
    assert!(
        matches!(&full, Error::PoolCreation { reason, .. } if reason.contains("no room for another pool")),
        "{full}"
    );
    let pool = builder().build().unwrap();
    let stream = suite.stream();
    drop(pool.alloc(1 << 20, &stream).unwrap());
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn pool_calls_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let device = Device::get(0).unwrap();
    let pool = MemPool::new(Route::host()).unwrap();
    refused_by(suite.failing("cuMemPoolTrimTo", 1, UNKNOWN, || pool.trim_to(0)), "cuMemPoolTrimTo", UNKNOWN);
    let grant = suite.failing("cuMemPoolSetAccess", 1, UNKNOWN, || pool.set_access(device, Access::ReadWrite));
    refused_by(grant, "cuMemPoolSetAccess", UNKNOWN);
    refused_by(suite.failing("cuMemPoolGetAccess", 1, UNKNOWN, || pool.access(device)), "cuMemPoolGetAccess", UNKNOWN);
    // Bytes and int attributes are read and written at two sites each.
    let threshold = suite.failing("cuMemPoolGetAttribute", 1, UNKNOWN, || pool.release_threshold());
    refused_by(threshold, "cuMemPoolGetAttribute", UNKNOWN);
    let reuse = suite.failing("cuMemPoolGetAttribute", 1, UNKNOWN, || pool.reuse_follow_event_dependencies());
    refused_by(reuse, "cuMemPoolGetAttribute", UNKNOWN);
    let set_threshold = suite.failing("cuMemPoolSetAttribute", 1, UNKNOWN, || pool.set_release_threshold(1 << 20));
    refused_by(set_threshold, "cuMemPoolSetAttribute", UNKNOWN);
    let set_reuse =
        suite.failing("cuMemPoolSetAttribute", 1, UNKNOWN, || pool.set_reuse_follow_event_dependencies(false));
    refused_by(set_reuse, "cuMemPoolSetAttribute", UNKNOWN);
    assert_eq!(pool.release_threshold().unwrap(), 0, "the failed write changed nothing");
    pool.set_access(device, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(device).unwrap(), Access::ReadWrite, "usable afterwards");
    pool.set_release_threshold(1 << 20).unwrap();
    assert_eq!(pool.attribute(PoolAttribute::ReleaseThreshold).unwrap(), 1 << 20);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn an_allocation_that_fails_is_typed_and_leaves_the_pool_usable() {
    let Some((_lock, suite)) = suite() else { return };
    let pool = MemPool::builder(Route::host()).max_size(64 << 20).build().unwrap();
    let stream = suite.stream();
    let oom = suite.failing("cuMemAllocFromPoolAsync", 1, OUT_OF_MEMORY, || pool.alloc(1 << 20, &stream));
    let error = refused_by(oom, "cuMemAllocFromPoolAsync", OUT_OF_MEMORY);
    assert!(
        matches!(error, Error::OutOfMemory { requested: 1_048_576, limit: Some(_), .. }) && error.is_out_of_memory()
    );
    let other = suite.failing("cuMemAllocFromPoolAsync", 1, UNKNOWN, || pool.alloc(1 << 20, &stream));
    assert!(!refused_by(other, "cuMemAllocFromPoolAsync", UNKNOWN).is_out_of_memory());
    let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
    buffer.copy_from_host(&pattern(1 << 20, 3)).unwrap();
    assert_eq!(buffer.host_slice().unwrap(), &pattern(1 << 20, 3)[..]);
    drop(buffer);
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_pool_whose_destroy_fails_is_reported_and_never_destroyed_twice() {
    let Some((_lock, suite)) = suite() else { return };
    // Earlier cases routed host pools; retired, one would serve `MemPool::new` below, and a pool
    // that was ever current is retired, never destroyed. Start from none.
    // SAFETY: the suite lock serialises the cases; no thread allocates through a route now.
    unsafe { cumempool::destroy_retired_pools() }.unwrap();
    let destroy = cumempool::sys::driver().unwrap().cuMemPoolDestroy().unwrap();
    let pool = MemPool::new(Route::host()).unwrap();
    let raw = pool.as_raw();
    refused_by(suite.failing("cuMemPoolDestroy", 1, UNKNOWN, || pool.destroy()), "cuMemPoolDestroy", UNKNOWN);
    assert!(logged().is_empty(), "destroy() answers the error; nothing else is logged");
    // SAFETY: the pool whose destroy was failed above and then given up; destroyed once, here.
    assert_eq!(unsafe { destroy(raw) }, cumempool::sys::CUresult::CUDA_SUCCESS, "no destroy happened before");

    let dropped = MemPool::new(Route::host()).unwrap();
    let raw = dropped.as_raw();
    suite.failing("cuMemPoolDestroy", 1, UNKNOWN, || drop(dropped));
    warned_once("cuMemPoolDestroy");
    // SAFETY: as above, for the pool whose Drop failed.
    assert_eq!(unsafe { destroy(raw) }, cumempool::sys::CUresult::CUDA_SUCCESS, "no destroy happened before");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_retired_pool_whose_destroy_fails_stays_retired() {
    let Some((_lock, suite)) = suite() else { return };
    // SAFETY: the suite's lock is held and no thread of this process allocates through a route,
    // nor uses an allocation of a retired pool.
    unsafe { cumempool::destroy_retired_pools() }.unwrap(); // what earlier cases retired
    let pool = MemPool::new(Route::host()).unwrap();
    drop(set_current_pool(Route::host(), &pool).unwrap());
    pool.destroy().unwrap();
    assert_eq!(cumempool::retired_pools().unwrap().count, 1, "retired, not destroyed");
    // SAFETY: as above.
    let failed = suite.failing("cuMemPoolDestroy", 1, UNKNOWN, || unsafe { cumempool::destroy_retired_pools() });
    refused_by(failed, "cuMemPoolDestroy", UNKNOWN);
    assert_eq!(cumempool::retired_pools().unwrap().count, 1, "still listed, for a later call");
    // SAFETY: as above.
    assert_eq!(unsafe { cumempool::destroy_retired_pools() }.unwrap(), 1, "destroyed once, by the later call");
    assert_eq!(cumempool::retired_pools().unwrap().count, 0);
}

// ---- buffer.rs -----------------------------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn buffer_operations_name_the_call_that_failed_and_keep_the_buffer() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
    let bytes = pattern(1 << 20, 9);
    refused_by(suite.failing("cuMemcpyAsync", 1, UNKNOWN, || buffer.copy_from_host(&bytes)), "cuMemcpyAsync", UNKNOWN);
    refused_by(suite.failing("cuMemsetD8Async", 1, UNKNOWN, || buffer.fill(1)), "cuMemsetD8Async", UNKNOWN);
    buffer.copy_from_host(&bytes).unwrap();
    let mut back = vec![0u8; 1 << 20];
    buffer.copy_to_host(&mut back).unwrap();
    assert_eq!(back, bytes, "usable afterwards");
    drop(buffer);
    nothing_used(&pool, &stream);

    let managed = MemPool::new(Route::managed(Location::Device(0))).unwrap();
    let buffer = managed.alloc(1 << 20, &stream).unwrap();
    let prefetch = suite.failing("cuMemPrefetchAsync", 1, UNKNOWN, || buffer.prefetch_to(Location::Device(0)));
    refused_by(prefetch, "cuMemPrefetchAsync", UNKNOWN);
    buffer.prefetch_to(Location::Device(0)).unwrap();
    drop(buffer);
    nothing_used(&managed, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn host_slice_reports_a_failed_stream_synchronise() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::host()).unwrap();
    let mut buffer = pool.alloc(4096, &stream).unwrap();
    buffer.copy_from_host(&pattern(4096, 4)).unwrap();
    let slice = suite.failing("cuStreamSynchronize", 1, UNKNOWN, || buffer.host_slice().map(<[u8]>::len));
    refused_by(slice, "cuStreamSynchronize", UNKNOWN);
    let slice_mut = suite.failing("cuStreamSynchronize", 1, UNKNOWN, || buffer.host_slice_mut().map(|s| s.len()));
    refused_by(slice_mut, "cuStreamSynchronize", UNKNOWN);
    assert_eq!(buffer.host_slice().unwrap(), &pattern(4096, 4)[..], "usable afterwards");
    drop(buffer);
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_buffer_whose_free_fails_says_so_once_and_is_not_freed_twice() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::host()).unwrap();
    let buffer = pool.alloc(1 << 20, &stream).unwrap();
    let ptr = buffer.as_raw();
    suite.failing("cuMemFreeAsync", 1, UNKNOWN, || drop(buffer));
    warned_once("cuMemFreeAsync");
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 1 << 20, "a refused free leaves the memory allocated");
    // SAFETY: the allocation whose free was failed above; freed once, here.
    unsafe { cumempool::free_async(ptr, &stream) }.expect("the driver accepts the only real free");
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn copies_that_do_not_wait_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut a = pool.alloc(4096, &stream).unwrap();
    let b = pool.alloc(4096, &stream).unwrap();
    refused_by(suite.failing("cuMemcpyAsync", 1, UNKNOWN, || a.copy_from_async(&b)), "cuMemcpyAsync", UNKNOWN);
    let pending = suite.failing("cuMemcpyAsync", 1, UNKNOWN, || a.copy_to_host_async(vec![0; 4096]).map(|_| ()));
    refused_by(pending, "cuMemcpyAsync", UNKNOWN);
    a.copy_from_host_async(pattern(4096, 3)).unwrap().wait().unwrap();
    let back = a.copy_to_host_async(vec![0; 4096]).unwrap().wait().unwrap();
    assert_eq!(back, pattern(4096, 3), "usable afterwards");
    drop((a, b));
    nothing_used(&pool, &stream);
}

/// A waiting copy whose wait fails after the copy was queued returns only once the copy has
/// finished: the caller's slice is released as it returns.
#[test]
#[ignore = "requires a CUDA GPU"]
fn waiting_copies_whose_wait_fails_return_only_once_the_copy_has_finished() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
    buffer.copy_from_host(&pattern(1 << 20, 5)).unwrap();
    let mut back = vec![0u8; 1 << 20];
    // The copy runs on a private stream after an event that marks the buffer's stream's work:
    // `is_idle` of the context, not of `stream`, tells whether it still runs.
    let idle = || suite.context.synchronize().is_ok() && stream.is_idle().unwrap();
    // The wait for the event recorded after the copy: the private stream is waited for instead.
    let waited = suite.failing("cuEventSynchronize", 1, UNKNOWN, || buffer.copy_to_host(&mut back));
    refused_by(waited, "cuEventSynchronize", UNKNOWN);
    assert_eq!(back, pattern(1 << 20, 5), "the fallback wait saw the copy through before the call returned");
    // The marker event of the buffer's stream not recorded: nothing is queued.
    back.fill(0);
    let unmarked = suite.failing("cuEventRecord", 1, UNKNOWN, || buffer.copy_to_host(&mut back));
    refused_by(unmarked, "cuEventRecord", UNKNOWN);
    assert!(idle());
    assert!(back.iter().all(|&byte| byte == 0), "a copy ran though its setup failed");
    // The event after the copy not recorded: the private stream is waited for.
    let unrecorded = suite.failing("cuEventRecord", 2, UNKNOWN, || buffer.copy_to_host(&mut back));
    refused_by(unrecorded, "cuEventRecord", UNKNOWN);
    assert_eq!(back, pattern(1 << 20, 5), "the fallback wait saw the copy through before the call returned");
    // Both waits fail: said so (the copy may still run), never silently.
    logged().clear();
    let neither =
        suite.failing_first_of_each(["cuEventSynchronize", "cuStreamSynchronize"], || buffer.copy_to_host(&mut back));
    refused_by(neither, "cuEventSynchronize", UNKNOWN);
    assert!(idle());
    warned_once("cuStreamSynchronize");
    drop(buffer);
    nothing_used(&pool, &stream);
}

// ---- graph.rs ------------------------------------------------------------------------------

/// A capture of two allocations, a fill of one and a copy into the other.
fn filling<'env>(
    pool: &'env Pool,
    value: u8,
) -> impl for<'c> FnOnce(&'c cumempool::Capture<'env>) -> cumempool::Result<()> + 'env {
    move |capture| {
        let scratch = capture.alloc(pool, 4096)?;
        let other = capture.alloc(pool, 4096)?;
        capture.fill(&scratch, value)?;
        capture.copy(&other, &scratch)
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn graph_calls_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let fill = |value| filling(&pool, value);
    let begin = suite.failing("cuStreamBeginCapture", 1, UNKNOWN, || stream.capture(fill(1)).map(|_| ()));
    refused_by(begin, "cuStreamBeginCapture", UNKNOWN);
    let end = suite.failing("cuStreamEndCapture", 1, UNKNOWN, || stream.capture(fill(1)).map(|_| ()));
    refused_by(end, "cuStreamEndCapture", UNKNOWN);
    assert!(!stream.is_capturing().unwrap(), "a failed end leaves no capture underway (the library ends it again)");
    let memset = suite.failing("cuMemsetD8Async", 1, UNKNOWN, || stream.capture(fill(1)).map(|_| ()));
    refused_by(memset, "cuMemsetD8Async", UNKNOWN);
    let copy = suite.failing("cuMemcpyAsync", 1, UNKNOWN, || stream.capture(fill(1)).map(|_| ()));
    refused_by(copy, "cuMemcpyAsync", UNKNOWN);
    assert!(!stream.is_capturing().unwrap(), "a failed closure ends its capture");
    let graph = stream.capture(fill(2)).unwrap();
    refused_by(suite.failing("cuGraphGetNodes", 1, UNKNOWN, || graph.node_count()), "cuGraphGetNodes", UNKNOWN);
    let instantiate = suite.failing("cuGraphInstantiateWithFlags", 1, UNKNOWN, || graph.instantiate().map(|_| ()));
    refused_by(instantiate, "cuGraphInstantiateWithFlags", UNKNOWN);
    let mut exec = graph.instantiate().unwrap();
    refused_by(suite.failing("cuGraphUpload", 1, UNKNOWN, || exec.upload(&stream)), "cuGraphUpload", UNKNOWN);
    refused_by(suite.failing("cuGraphLaunch", 1, UNKNOWN, || exec.launch(&stream)), "cuGraphLaunch", UNKNOWN);
    // The query of the event that orders the launch after the stream: unanswered, nothing runs.
    refused_by(suite.failing("cuEventQuery", 1, UNKNOWN, || exec.launch(&stream)), "cuEventQuery", UNKNOWN);
    exec.launch(&stream).unwrap();
    drop(exec);
    assert!(graph.node_count().unwrap() >= 4, "usable afterwards");
    drop(graph);
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn graph_drops_that_fail_say_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let graph_memory = Device::get(0).unwrap().graph_memory().unwrap();
    // A free node that cannot be recorded: the capture answers it and destroys the graph, which
    // launched would leave its allocation allocated after the executable is gone.
    let refused = suite.failing("cuMemFreeAsync", 1, UNKNOWN, || {
        stream.capture(|capture| {
            let scratch = capture.alloc(&pool, 4096)?;
            capture.fill(&scratch, 1)
        })
    });
    refused_by(refused.map(|_| ()), "cuMemFreeAsync", UNKNOWN);
    logged().clear();
    assert_eq!(
        Device::get(0).unwrap().graph_memory().unwrap().used_current,
        graph_memory.used_current,
        "the refused graph left graph memory allocated"
    );
    let graph = stream.capture(|capture| capture.fill(&capture.alloc(&pool, 4096)?, 1)).unwrap();
    let mut exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    exec.launch(&stream).unwrap();
    let raw_exec = exec.as_raw();
    suite.failing("cuGraphExecDestroy", 1, UNKNOWN, || drop(exec));
    warned_once("cuGraphExecDestroy");
    logged().clear();
    let raw_graph = graph.as_raw();
    suite.failing("cuGraphDestroy", 1, UNKNOWN, || drop(graph));
    warned_once("cuGraphDestroy");
    let driver = cumempool::sys::driver().unwrap();
    // SAFETY: the executable and graph whose destroys were failed above; destroyed once, here.
    unsafe {
        assert_eq!(driver.cuGraphExecDestroy().unwrap()(raw_exec), cumempool::sys::CUresult::CUDA_SUCCESS);
        assert_eq!(driver.cuGraphDestroy().unwrap()(raw_graph), cumempool::sys::CUresult::CUDA_SUCCESS);
    }
    nothing_used(&pool, &stream);
    Device::get(0).unwrap().trim_graph_memory().unwrap();
}

/// Dropping an executable waits for its last launch with a wait nothing in the library refuses
/// (inside another capture's closure too); the driver's failure of that wait is said, once.
#[test]
#[ignore = "requires a CUDA GPU"]
fn an_executable_whose_last_launch_cannot_be_waited_for_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let graph = stream.capture(filling(&pool, 1)).unwrap();
    let mut exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    logged().clear();
    suite.failing("cuEventSynchronize", 1, UNKNOWN, || drop(exec));
    warned_once("cuEventSynchronize");
    drop(graph);
    nothing_used(&pool, &stream);
}

// ---- routing.rs ----------------------------------------------------------------------------

#[test]
#[ignore = "requires a CUDA GPU"]
fn route_lookups_name_the_call_that_failed() {
    let Some((_lock, suite)) = suite() else { return };
    let route = Route::host();
    let default = suite.failing("cuMemGetDefaultMemPool", 1, UNKNOWN, || default_pool(route));
    assert!(matches!(refused_by(default, "cuMemGetDefaultMemPool", UNKNOWN), Error::RouteRefused { .. }));
    let current = suite.failing("cuMemGetMemPool", 1, UNKNOWN, || current_pool(route));
    assert!(matches!(refused_by(current, "cuMemGetMemPool", UNKNOWN), Error::RouteRefused { .. }));
    assert!(is_default(route).unwrap(), "usable afterwards");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_refused_route_change_leaves_the_route_unchanged() {
    let Some((_lock, suite)) = suite() else { return };
    let route = Route::host();
    let pool = MemPool::new(route).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 0, "the driver's default");
    let set = suite.failing("cuMemSetMemPool", 1, UNKNOWN, || set_current_pool(route, &pool));
    refused_by(set, "cuMemSetMemPool", UNKNOWN);
    assert!(is_default(route).unwrap(), "the route is unchanged");
    assert_eq!(pool.release_threshold().unwrap(), 0, "and so is the pool's release threshold");
    // The lookup of the default pool comes after the driver has switched the route: a failure
    // there must not leave the route showing a pool nothing keeps alive.
    let base = suite.failing("cuMemGetDefaultMemPool", 1, UNKNOWN, || set_current_pool(route, &pool));
    refused_by(base, "cuMemGetDefaultMemPool", UNKNOWN);
    assert!(is_default(route).unwrap(), "the route is unchanged");
    let guard = set_current_pool(route, &pool).unwrap();
    assert!(current_pool(route).unwrap().same_as(&pool), "usable afterwards");
    guard.restore().unwrap();
    assert!(is_default(route).unwrap());
    reset_current_pool(route).unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_route_guard_whose_restore_is_refused_keeps_the_pool_alive() {
    let Some((_lock, suite)) = suite() else { return };
    let route = Route::host();
    let stream = suite.stream();
    let pool = MemPool::new(route).unwrap();
    let guard = set_current_pool(route, &pool).unwrap();
    let restore = suite.failing("cuMemSetMemPool", 1, UNKNOWN, || guard.restore());
    assert!(matches!(refused_by(restore, "cuMemSetMemPool", UNKNOWN), Error::RouteRefused { .. }));
    drop(pool);
    let current = current_pool(route).unwrap();
    assert!(current.is_owned(), "the route still shows the pool, and keeps it alive");
    drop(current.alloc(4096, &stream).unwrap());
    nothing_used(&current, &stream);
    drop(current);
    reset_current_pool(route).unwrap();
    assert!(is_default(route).unwrap(), "a reset puts the default back");

    // The same through Drop: said once, with the route and the pool kept.
    let pool = MemPool::new(route).unwrap();
    let guard = set_current_pool(route, &pool).unwrap();
    suite.failing("cuMemSetMemPool", 1, UNKNOWN, || drop(guard));
    warned_once("cuMemSetMemPool");
    assert!(current_pool(route).unwrap().same_as(&pool));
    // A restore that cannot even read the route says so, and keeps the change too.
    let guard = set_current_pool(route, &pool).unwrap();
    let read = suite.failing("cuMemGetMemPool", 1, UNKNOWN, || guard.restore());
    refused_by(read, "cuMemGetMemPool", UNKNOWN);
    assert!(current_pool(route).unwrap().same_as(&pool));
    reset_current_pool(route).unwrap();
    assert!(is_default(route).unwrap());
}

// ---- sharing.rs (the importing side runs in a child process) ---------------------------------

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map(Iterator::count).unwrap_or(0)
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn exports_that_fail_name_the_call_and_leave_no_descriptor() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let buffer = pool.alloc(1 << 20, &stream).unwrap();
    let before = open_descriptors();
    let export = suite.failing("cuMemPoolExportToShareableHandle", 1, UNKNOWN, || pool.export_fd());
    assert!(matches!(refused_by(export, "cuMemPoolExportToShareableHandle", UNKNOWN), Error::SharingRefused { .. }));
    assert_eq!(open_descriptors(), before, "no descriptor left open");
    let fd = pool.export_fd().unwrap();
    let shared = suite.failing("cuMemPoolExportPointer", 1, UNKNOWN, || buffer.export());
    assert!(matches!(refused_by(shared, "cuMemPoolExportPointer", UNKNOWN), Error::SharingRefused { .. }));
    assert_eq!(buffer.export().unwrap().len(), 1 << 20, "usable afterwards");
    drop((fd, buffer));
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn imports_that_fail_after_the_descriptor_arrived_close_it_and_undo_the_mapping() {
    use cumempool::descriptor_passing::{send_allocation, send_pool};
    use std::io::Read;
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
    buffer.copy_from_host(&pattern(1 << 20, 5)).unwrap();
    let child = std::env::current_exe().unwrap().with_file_name("bin--fault_ipc_child");
    let child = if child.exists() { child } else { env!("CARGO_BIN_EXE_fault_ipc_child").into() };
    let path = std::env::temp_dir().join(format!("cumempool-fault-ipc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let mut process = std::process::Command::new(child)
        .arg(&path)
        .env("CUMEMPOOL_FAULT_PLAN", "cuMemPoolImportFromShareableHandle:nth=1")
        .spawn()
        .unwrap();
    let (mut socket, _) = listener.accept().unwrap();
    send_pool(&socket, &pool).unwrap(); // imported, then the import fails
    send_pool(&socket, &pool).unwrap();
    send_allocation(&mut socket, &buffer.export().unwrap()).unwrap();
    let mut report = String::new();
    socket.read_to_string(&mut report).unwrap();
    let status = process.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    eprintln!("child report:\n{report}");
    assert!(status.success(), "the child failed: {report}");
    assert!(!report.contains("WRONG"), "{report}");
    assert_eq!(report.matches(": ok").count(), 9, "{report}");
    drop(buffer);
    nothing_used(&pool, &stream);
}

// ---- cumempool-alloc -----------------------------------------------------------------------

/// A pinned host pool and a container allocator over it.
fn host_containers(suite: &Suite) -> (MemPool, PoolAllocator<HostMemory>) {
    let pool = MemPool::new(Route::host()).unwrap();
    let allocator = PoolAllocator::<HostMemory>::new(&pool, &suite.context).unwrap();
    (pool, allocator)
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_vec_whose_growth_runs_out_of_memory_keeps_its_elements() {
    let Some((_lock, suite)) = suite() else { return };
    let (pool, allocator) = host_containers(suite);
    let mut numbers = PoolVec::with_capacity_in(4, allocator.clone());
    numbers.extend(0..4u64);
    let grown = suite.failing("cuMemAllocFromPoolAsync", 1, OUT_OF_MEMORY, || numbers.try_reserve(1 << 16));
    assert!(grown.is_err(), "growth past the memory fails as a value");
    // The allocation succeeded but the wait before handing it to the host failed: given back.
    let waited = suite.failing("cuStreamSynchronize", 1, UNKNOWN, || numbers.try_reserve(1 << 16));
    assert!(waited.is_err());
    // And the free of that memory fails too: said once, with the address, so it is not lost silently.
    suite.faults.set_plan("cuStreamSynchronize:nth=1;cuMemFreeAsync:nth=1").unwrap();
    let lost = numbers.try_reserve(1 << 16);
    suite.faults.clear();
    assert!(lost.is_err());
    warned_once("cuMemFreeAsync");
    let ptr = logged_address();
    // SAFETY: the memory whose free was failed above, never handed out; freed once, here.
    unsafe { cumempool::free_async(ptr, allocator.stream()) }.expect("the driver accepts the only real free");
    assert_eq!(&numbers[..], &[0, 1, 2, 3], "the container still holds its elements");
    numbers.extend(4..1000u64);
    assert_eq!(numbers.iter().sum::<u64>(), 999 * 1000 / 2, "usable afterwards");
    drop(numbers);
    nothing_used(&pool, allocator.stream());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_hash_map_whose_growth_runs_out_of_memory_keeps_its_entries() {
    let Some((_lock, suite)) = suite() else { return };
    let (pool, allocator) = host_containers(suite);
    let mut map = hashbrown::HashMap::with_hasher_in(std::hash::RandomState::new(), allocator.clone());
    for key in 0..3u32 {
        map.insert(key, key * 10);
    }
    let grown = suite.failing("cuMemAllocFromPoolAsync", 1, OUT_OF_MEMORY, || map.try_reserve(1 << 16));
    assert!(grown.is_err());
    assert_eq!((map.len(), map.get(&2)), (3, Some(&20)), "the map still holds its entries");
    map.extend((3..500).map(|k| (k, k * 10)));
    assert_eq!(map.get(&499), Some(&4990), "usable afterwards");
    drop(map);
    nothing_used(&pool, allocator.stream());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_cache_gives_its_blocks_back_and_retries_when_memory_runs_out() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    drop(cache.alloc(1 << 20, &stream).unwrap());
    assert_eq!(cache.stats().cached_blocks, 1);
    let retried = suite.failing("cuMemAllocFromPoolAsync", 1, OUT_OF_MEMORY, || cache.alloc(4 << 20, &stream));
    let block = retried.expect("the retry after giving back succeeds");
    assert_eq!(suite.faults.calls("cuMemFreeAsync"), 1, "the cached block went back once");
    assert_eq!(cache.stats().cached_blocks, 0);
    drop(block); // cached

    // Both attempts out of memory (a size nothing cached fits): the error says so, typed.
    suite.faults.set_plan("cuMemAllocFromPoolAsync:every=1:code=2").unwrap();
    let refused = cache.alloc(16 << 20, &stream);
    suite.faults.clear();
    match refused {
        Err(cumempool_alloc::Error::Pool(error)) => {
            refused_by::<()>(Err(error), "cuMemAllocFromPoolAsync", OUT_OF_MEMORY);
        }
        other => panic!("expected the pool's out-of-memory, got {other:?}"),
    }
    cache.release().unwrap();
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_cache_whose_frees_fail_says_so_once_and_frees_nothing_twice() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    let block = cache.alloc(1 << 20, &stream).unwrap();
    let ptr = block.as_raw();
    drop(block);
    // Giving back during release-and-retry fails: said once, and the retry still runs.
    let plan = "cuMemAllocFromPoolAsync:nth=1:code=2;cuMemFreeAsync:nth=1";
    suite.faults.set_plan(plan).unwrap();
    let retried = cache.alloc(4 << 20, &stream);
    suite.faults.clear();
    let retried = retried.expect("the retry runs after a failed give-back");
    warned_once("cuMemFreeAsync");
    logged().clear();
    // SAFETY: the cached block whose free was failed above; freed once, here.
    unsafe { cumempool::free_async(ptr, &stream) }.expect("the driver accepts the only real free");

    // A cache whose release fails in Drop.
    let ptr = retried.as_raw();
    drop(retried); // cached
    suite.failing("cuMemFreeAsync", 1, UNKNOWN, || drop(cache));
    warned_once("cuMemFreeAsync");
    logged().clear();
    // SAFETY: as above, for the block the dropped cache held.
    unsafe { cumempool::free_async(ptr, &stream) }.expect("the driver accepts the only real free");
    nothing_used(&pool, &stream);

    // An allocation of a resource whose free fails in Drop.
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let allocation = resource.alloc(1 << 20, &stream).unwrap();
    let ptr = allocation.as_raw();
    suite.failing("cuMemFreeAsync", 1, UNKNOWN, || drop(allocation));
    warned_once("cuMemFreeAsync");
    // SAFETY: the allocation whose free was failed above; freed once, here.
    unsafe { cumempool::free_async(ptr, &stream) }.expect("the driver accepts the only real free");
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_limit_takes_back_its_claim_when_the_pool_refuses() {
    let Some((_lock, suite)) = suite() else { return };
    let stream = suite.stream();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let limited = cumempool_alloc::Limit::new(PoolResource::<DeviceMemory>::new(&pool).unwrap(), 8 << 20);
    let refused =
        suite.failing("cuMemAllocFromPoolAsync", 1, OUT_OF_MEMORY, || limited.alloc(4 << 20, &stream).map(|_| ()));
    assert!(refused.is_err_and(|e| e.is_out_of_memory()));
    assert_eq!(limited.in_use(), 0, "the refused bytes are not counted");
    let both = (limited.alloc(4 << 20, &stream).unwrap(), limited.alloc(4 << 20, &stream).unwrap());
    assert_eq!(limited.in_use(), 8 << 20, "the whole limit is usable afterwards");
    drop(both);
    nothing_used(&pool, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn container_memory_whose_free_fails_says_so_once() {
    let Some((_lock, suite)) = suite() else { return };
    let (pool, allocator) = host_containers(suite);
    let mut numbers = PoolVec::with_capacity_in(1024, allocator.clone());
    numbers.extend(0..1024u32);
    let ptr = numbers.as_ptr() as usize as cumempool::sys::CUdeviceptr;
    suite.failing("cuMemFreeAsync", 1, UNKNOWN, || drop(numbers));
    warned_once("cuMemFreeAsync");
    // SAFETY: the container memory whose free was failed above; freed once, here.
    unsafe { cumempool::free_async(ptr, allocator.stream()) }.expect("the driver accepts the only real free");
    nothing_used(&pool, allocator.stream());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn containers_survive_faults_drawn_at_random() {
    let Some((_lock, suite)) = suite() else { return };
    let (pool, allocator) = host_containers(suite);
    let mut numbers = PoolVec::new_in(allocator.clone());
    let mut map = hashbrown::HashMap::with_hasher_in(std::hash::RandomState::new(), allocator.clone());
    suite.faults.reset_counts();
    let plan = "cuMemAllocFromPoolAsync:p=0.3:seed=11:code=2;cuStreamSynchronize:p=0.2:seed=5";
    suite.faults.set_plan(plan).unwrap();
    let mut refused = 0;
    for i in 0..2000u64 {
        match numbers.try_reserve(1) {
            Ok(()) => numbers.push(i),
            Err(_) => refused += 1,
        }
        match map.try_reserve(1) {
            Ok(()) => drop(map.insert(i, i)),
            Err(_) => refused += 1,
        }
    }
    suite.faults.clear();
    let injected = suite.faults.injected("cuMemAllocFromPoolAsync") + suite.faults.injected("cuStreamSynchronize");
    assert!(refused > 0 && injected >= refused, "{refused} refusals, {injected} faults");
    assert_eq!(numbers.len() + map.len() + refused as usize, 4000, "every element kept or refused");
    assert!(numbers.windows(2).all(|w| w[0] < w[1]) && map.iter().all(|(k, v)| k == v), "nothing corrupted");
    assert!(logged().is_empty(), "only allocations failed: nothing to warn about");
    drop((numbers, map));
    nothing_used(&pool, allocator.stream());
}

// ---- vmm.rs --------------------------------------------------------------------------------

/// Device 0's exportable VMM properties and their minimum granularity.
fn vmm_props() -> (cumempool::vmm::AllocationProperties, usize) {
    let props = cumempool::vmm::AllocationProperties::device(0).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let chunk = props.granularity().unwrap().minimum;
    (props, chunk)
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn vmm_calls_name_the_call_that_failed_and_leave_nothing_half_made() {
    use cumempool::vmm::{AddressRange, PhysicalAllocation};
    let Some((_lock, suite)) = suite() else { return };
    let (props, chunk) = vmm_props();
    let granularity = suite.failing("cuMemGetAllocationGranularity", 1, UNKNOWN, || props.granularity());
    refused_by(granularity, "cuMemGetAllocationGranularity", UNKNOWN);
    let create = suite.failing("cuMemCreate", 1, UNKNOWN, || PhysicalAllocation::create(&props, chunk));
    refused_by(create, "cuMemCreate", UNKNOWN);
    let full = suite.failing("cuMemCreate", 1, OUT_OF_MEMORY, || PhysicalAllocation::create(&props, chunk));
    assert!(matches!(refused_by(full, "cuMemCreate", OUT_OF_MEMORY), Error::OutOfMemory { .. }));
    let reserve = suite.failing("cuMemAddressReserve", 1, UNKNOWN, || AddressRange::reserve(4 * chunk, chunk));
    refused_by(reserve, "cuMemAddressReserve", UNKNOWN);
    let range = AddressRange::reserve(4 * chunk, chunk).unwrap();
    let memory = PhysicalAllocation::create(&props, chunk).unwrap();
    refused_by(suite.failing("cuMemMap", 1, UNKNOWN, || range.map(0, &memory)), "cuMemMap", UNKNOWN);
    assert_eq!(range.mapped_bytes(), 0, "a refused mapping is not recorded");
    range.map(0, &memory).unwrap();
    let access = suite.failing("cuMemSetAccess", 1, UNKNOWN, || range.set_access(0, chunk, &[(0, Access::ReadWrite)]));
    refused_by(access, "cuMemSetAccess", UNKNOWN);
    range.set_access(0, chunk, &[(0, Access::ReadWrite)]).unwrap();
    let before = open_descriptors();
    let export = suite.failing("cuMemExportToShareableHandle", 1, UNKNOWN, || memory.export_fd());
    assert!(matches!(refused_by(export, "cuMemExportToShareableHandle", UNKNOWN), Error::SharingRefused { .. }));
    assert_eq!(open_descriptors(), before, "no descriptor left open");
    let fd = memory.export_fd().unwrap();
    let import = suite
        .failing("cuMemImportFromShareableHandle", 1, UNKNOWN, || PhysicalAllocation::import_fd(&fd, chunk, &props));
    assert!(matches!(refused_by(import, "cuMemImportFromShareableHandle", UNKNOWN), Error::SharingRefused { .. }));
    // SAFETY: nothing ran on the mapping.
    let unmap = suite.failing("cuMemUnmap", 1, UNKNOWN, || unsafe { range.unmap(0) });
    refused_by(unmap, "cuMemUnmap", UNKNOWN);
    assert_eq!(range.mapped_bytes(), chunk, "a refused unmapping keeps the mapping recorded");
    // SAFETY: as above.
    unsafe { range.unmap(0) }.unwrap();
    drop((fd, memory, range));
    assert!(logged().is_empty(), "the drops after the faults succeeded: {:?}", logged());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn vmm_drops_whose_driver_call_fails_say_so_once_and_free_nothing_twice() {
    use cumempool::vmm::{AddressRange, PhysicalAllocation};
    let Some((_lock, suite)) = suite() else { return };
    let (props, chunk) = vmm_props();
    let driver = cumempool::sys::driver().unwrap();
    let success = cumempool::sys::CUresult::CUDA_SUCCESS;

    let memory = PhysicalAllocation::create(&props, chunk).unwrap();
    let handle = memory.as_raw();
    suite.failing("cuMemRelease", 1, UNKNOWN, || drop(memory));
    warned_once("cuMemRelease");
    // SAFETY: the handle whose release was failed above, released once here.
    assert_eq!(unsafe { driver.cuMemRelease().unwrap()(handle) }, success, "it was not released");
    logged().clear();

    let range = AddressRange::reserve(2 * chunk, chunk).unwrap();
    range.map(0, &PhysicalAllocation::create(&props, chunk).unwrap()).unwrap();
    let base = range.base();
    suite.failing("cuMemUnmap", 1, UNKNOWN, || drop(range));
    warned_once("cuMemUnmap");
    // SAFETY: what the failed drop left: the mapping, then the reservation, each undone once.
    assert_eq!(unsafe { driver.cuMemUnmap().unwrap()(base, chunk) }, success, "the mapping was left");
    // SAFETY: the reservation the failed drop left, its mapping undone above; freed once.
    assert_eq!(unsafe { driver.cuMemAddressFree().unwrap()(base, 2 * chunk) }, success, "the range was left");
    logged().clear();

    let range = AddressRange::reserve(2 * chunk, chunk).unwrap();
    let base = range.base();
    suite.failing("cuMemAddressFree", 1, UNKNOWN, || drop(range));
    warned_once("cuMemAddressFree");
    // SAFETY: the reservation whose free was failed above, freed once here.
    assert_eq!(unsafe { driver.cuMemAddressFree().unwrap()(base, 2 * chunk) }, success, "it was not freed");
}

/// The figure in docs/reliability.md counts the driver-call sites from the one driver-call path;
/// this keeps its table in step with the source, so a new site cannot go unlisted. Runs from a
/// checkout (CI); a packed binary without one has nothing to compare.
#[test]
fn the_site_table_lists_every_driver_call_site() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let src = root.join("crates/cumempool/src");
    if !src.is_dir() {
        eprintln!("skipped: no checkout of the sources here");
        return;
    }
    // Every file below src, named by its path from there (`streams/event.rs`).
    let (mut files, mut folders) = (Vec::new(), vec![src.clone()]);
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else {
                files.push(path);
            }
        }
    }
    let mut in_source = Vec::new();
    for path in files {
        let file = path.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if file == "driver.rs" || !file.ends_with(".rs") {
            continue; // driver.rs defines the macros
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for macro_call in ["driver_call!(", "driver_answer!("] {
            for (at, _) in text.match_indices(macro_call) {
                let rest = &text[at + macro_call.len()..];
                let function: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                in_source.push((file.clone(), function));
            }
        }
    }
    let doc = std::fs::read_to_string(root.join("docs/reliability.md")).unwrap();
    // Every file of this binary: the cases live in its modules too.
    let mut suite = String::new();
    for entry in std::fs::read_dir(root.join("tests/tests/faults")).unwrap() {
        suite.push_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap());
    }
    let child = std::fs::read_to_string(root.join("tests/src/bin/fault_ipc_child.rs")).unwrap();
    let spans = |cell: &str| -> Vec<String> { cell.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
    let (mut in_table, mut covered) = (Vec::new(), 0);
    for row in doc.lines().filter(|l| l.starts_with("| `") && l.contains(".rs` ")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        assert_eq!(cells.len(), 3, "{row}");
        let (file, function) = (spans(cells[0])[0].clone(), spans(cells[1])[0].clone());
        in_table.push((file, function));
        if cells[2].starts_with("unreachable") {
            continue;
        }
        covered += 1;
        // The cases named outside parentheses (inside them: the methods and notes).
        let mut depth = 0;
        let outside: String = cells[2]
            .chars()
            .filter(|c| {
                depth += i32::from(*c == '(') - i32::from(*c == ')');
                depth == 0 && *c != ')'
            })
            .collect();
        for case in spans(&outside).iter().filter(|s| s.contains('_')) {
            assert!(suite.contains(&format!("fn {case}(")), "{row}: no case {case}");
        }
        assert!(suite.contains(&spans(cells[1])[0]) || child.contains(&spans(cells[1])[0]), "{row}: never failed");
    }
    in_source.sort();
    in_table.sort();
    assert_eq!(in_table, in_source, "docs/reliability.md lists the sites of crates/cumempool/src");
    let figure = format!("**The suite makes {covered} of {} sites fail.**", in_source.len());
    assert!(doc.contains(&figure), "the figure reads {figure}");
    assert!(doc.contains(&format!("**{}** in `crates/cumempool/src`", in_source.len())));
}
