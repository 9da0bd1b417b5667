//! A small stand-in for libcuda (`stand_in_driver.c`), compiled here with the system C compiler
//! and loaded through `CUMEMPOOL_LIBCUDA`, that models what a capture forbids, so that the
//! capture rules can be tested on a host without a GPU. It logs the calls that order work
//! ([`call_log`]) and can fail or capture on cue ([`set_switch`], [`capture_at_next_copy`]).
//!
//! A host wait or status query (`cuStreamSynchronize`, `cuStreamQuery`, `cuEventSynchronize`,
//! `cuEventQuery`) is refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture that
//! forbade it invalidated, when the calling thread's mode is not relaxed and the thread has a
//! capture underway, or (in global mode) any thread has a global capture underway; a wait on a
//! capturing stream is refused whatever the mode. An event last recorded on a capturing stream
//! answers CUDA_ERROR_CAPTURED_EVENT to a query or wait. Each thread has its own current context
//! (`cuCtxCreate_v2` makes one of the caller's own): without one, a new stream or event, or pool
//! memory ordered on the legacy stream, is refused with CUDA_ERROR_INVALID_CONTEXT. Pool
//! allocations are heap blocks, counted; so are the streams alive ([`live_streams`]), and the
//! last destroyed stream's handle goes to the next new stream, as the driver's often does.
//! Virtual memory has 2 MiB granules and one range of addresses, never dereferenced; exporting
//! physical memory as a file descriptor hands out a new descriptor of `/dev/null`. A pool made
//! with the file-descriptor handle type exports as such a descriptor, and any open descriptor
//! imports as a new pool; an allocation exports as its address and size, and imports as a fresh
//! block of that size (the driver would map the exporter's memory), whose range
//! `cuPointerGetAttribute` answers. A wait on the legacy stream while a blocking stream captures
//! is refused with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates that capture. Every function
//! the stand-in does not model answers success. The Python tests run on the same stand-in
//! (the `stand_in_libcuda` fixture of crates/cumempool-py/tests/conftest.py).
//!
//! The same library is also a stand-in for libnccl (`stand_in_nccl.c`, loaded through
//! `CUMEMPOOL_LIBNCCL`): collectives are logged in the same call log, as `nccl <stream>`, when
//! NCCL would launch them (at the outermost group's end inside a group), and registrations as
//! `register <address> <bytes>`; the switch `fail_next_init` fails the next `ncclCommInitRank`.
//!
//! The stand-in is a driver of CUDA 13.0 unless built for another version ([`compiled`], which
//! passes it as `-DSTAND_IN_DRIVER_VERSION=<version>`, `11080` for 11.8): `cuDriverGetVersion`
//! answers it, and below 12.0 the library lacks `cuGetProcAddress_v2`, as those drivers do. The
//! switch is the build's, not the environment's: a loader tells an old driver by a missing symbol.
//!
//! The stand-in replaces the driver (and NCCL) for the whole process: a test binary that uses it
//! uses nothing else.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Context, Device};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

const SOURCE: &str = include_str!("stand_in_driver.c");
const NCCL_SOURCE: &str = include_str!("stand_in_nccl.c");

/// Where the stand-in was compiled to.
static LIBRARY: OnceLock<PathBuf> = OnceLock::new();

/// The stand-in compiled and loaded, and its device's context; `None` (skipped, said why)
/// without a C compiler. The guard serialises the tests of the binary: the stand-in's state
/// (captures, counters) is process-wide.
pub fn stand_in() -> Option<(MutexGuard<'static, ()>, Context)> {
    static SERIAL: Mutex<()> = Mutex::new(());
    static CONTEXT: OnceLock<Option<Context>> = OnceLock::new();
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let context = CONTEXT.get_or_init(|| {
        let library = compiled(13000)?;
        LIBRARY.set(library.clone()).unwrap();
        // SAFETY: set before any thread of this binary reads the environment through the loader
        // (every test takes `SERIAL` and reaches the driver only after this).
        unsafe {
            std::env::set_var("CUMEMPOOL_LIBCUDA", &library);
            std::env::set_var("CUMEMPOOL_LIBNCCL", &library);
        }
        Some(Device::get(0).unwrap().primary_context().unwrap())
    });
    context.clone().map(|context| (serial, context))
}

/// The stand-in compiled as a driver of CUDA `version` (`13000` for 13.0, the one [`stand_in`]
/// loads), once per process and version; `None` (skipped, said why) without a C compiler.
pub fn compiled(version: i32) -> Option<PathBuf> {
    static BUILT: Mutex<BTreeMap<i32, Option<PathBuf>>> = Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    built.entry(version).or_insert_with(|| compile(version)).clone()
}

fn compile(version: i32) -> Option<PathBuf> {
    let directory = std::env::temp_dir().join(format!("cumempool-stand-in-driver-{}-{version}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let (source, library) = (directory.join("stand_in_driver.c"), directory.join("libstandin.so"));
    let nccl_source = directory.join("stand_in_nccl.c");
    std::fs::write(&source, SOURCE).unwrap();
    std::fs::write(&nccl_source, NCCL_SOURCE).unwrap();
    let compiled = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-pthread"])
        .arg(format!("-DSTAND_IN_DRIVER_VERSION={version}"))
        .arg("-o")
        .arg(&library)
        .arg(&source)
        .arg(&nccl_source)
        .status();
    if !compiled.is_ok_and(|status| status.success()) {
        eprintln!("skipped: no C compiler for the stand-in driver");
        return None;
    }
    Some(library)
}

/// How many streams the stand-in has made and not destroyed. Only after [`stand_in`] answered
/// a context.
pub fn live_streams() -> i32 {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: the stand-in, already loaded (opening it again only counts a reference); its
    // `live_streams` is an `int`, written only by the calls of the test that holds the guard.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let count = library.get::<*const i32>(b"live_streams\0").unwrap();
        **count
    }
}

/// How many times the stand-in was asked `name`, one of its counts: `context_queries`
/// (`cuCtxGetCurrent`) or `capture_queries` (`cuStreamGetCaptureInfo`), on every thread. Only
/// after [`stand_in`] answered a context.
pub fn queries(name: &str) -> u64 {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: as in `live_streams`; each count is an `unsigned long` the stand-in only adds to,
    // atomically.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let count = library.get::<*const std::sync::atomic::AtomicU64>(format!("{name}\0").as_bytes()).unwrap();
        (**count).load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The calls that order work, as the stand-in logged them, one per line: `memcpy <stream>`,
/// `sync <stream> <result>`, `record <event> <stream>`, `waitevent <stream> <event>`,
/// `eventsync <event> <result>`, `launch <stream> <1 if it captures, else 0>`,
/// `addressfree <base>`, `eventcreate <event>` (pointers
/// as `{:p}` prints them). Only after [`stand_in`] answered a context.
pub fn call_log() -> String {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: the stand-in, already loaded; `call_log` is a `char` array of 64 KiB of which the
    // first `call_log_len` bytes are written, under its lock, by the calls of the test that
    // holds the guard.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let log = library.get::<*const [u8; 1 << 16]>(b"call_log\0").unwrap();
        let len = library.get::<*const i32>(b"call_log_len\0").unwrap();
        String::from_utf8_lossy(&(&**log)[..**len as usize]).into_owned()
    }
}

/// Turns on one of the stand-in's one-shot switches: `fail_next_exchange` (the next
/// `cuThreadExchangeStreamCaptureMode` fails) or `capture_on_next_record` (the next
/// `cuEventRecord` on a stream begins a relaxed capture there first, as another thread's capture
/// would: the record lands in it), `end_capture_before_next_waitevent` (the next
/// `cuStreamWaitEvent` on an event recorded in a capture ends that capture first, so the wait
/// joins nothing and orders nothing) or `fail_next_waits` (the next `cuEventSynchronize`, and
/// the next `cuStreamSynchronize` or `cuStreamQuery`, that would succeed fail instead) or
/// `null_next_alloc` (the next `cuMemAllocFromPoolAsync` answers success with address 0, as a
/// misbehaving driver would) or `refuse_next_legacy_free` (the next `cuMemFreeAsync` on the
/// legacy stream answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, as when a blocking stream began
/// capturing after the library asked) or `capture_per_thread_at_next_event_create` (the next
/// `cuEventCreate` begins a relaxed capture of the calling thread's per-thread stream first) or
/// `capture_per_thread_after_next_legacy_free` (right after the next `cuMemFreeAsync` on the
/// legacy stream that succeeds, a relaxed capture of the calling thread's per-thread stream
/// begins, as another library's capture beginning mid-batch would). A stream that waits for an
/// event recorded in a capture joins that capture; the capture's end then ends it too, and
/// reports the capture invalidated (unjoined). A capturing stream that waits for an event
/// recorded outside any capture is refused with CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and its
/// capture invalidated, as driver 580 does. Only after [`stand_in`] answered a context.
pub fn set_switch(name: &str) {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: as in `call_log`; each switch is an `int` the stand-in reads and clears.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let symbol = library.get::<*mut i32>(format!("{name}\0").as_bytes()).unwrap();
        **symbol = if name == "fail_next_waits" { 3 } else { 1 };
    }
}

/// Makes every capture question and stream wait answer `code` until it is set back to 0, as the
/// driver answers every call of a context an earlier launch faulted (a sticky error). Only after
/// [`stand_in`] answered a context.
pub fn set_sticky_error(code: i32) {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: as in `call_log`; `sticky_error` is an `int` the stand-in reads.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let symbol = library.get::<*mut i32>(b"sticky_error\0").unwrap();
        **symbol = code;
    }
}

/// Makes the next `cuMemcpyAsync`, on whatever stream, begin a relaxed capture on `stream` right
/// after it is queued, as another thread's capture of a stream it lent would. Only after
/// [`stand_in`] answered a context.
pub fn capture_at_next_copy(stream: &cumempool::Stream) {
    capture_after(b"capture_at_next_memcpy\0", stream);
}

/// As [`capture_at_next_launch`], of the calling thread's per-thread stream (a blocking stream,
/// whose capture blocks the legacy stream).
pub fn capture_per_thread_at_next_launch() {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: as in `call_log`; `capture_at_next_launch` is a stream pointer the stand-in reads
    // and clears, here the per-thread handle.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let symbol = library.get::<*mut *mut std::ffi::c_void>(b"capture_at_next_launch\0").unwrap();
        **symbol = 2 as *mut std::ffi::c_void;
    }
}

/// As [`capture_at_next_copy`], after the next `cuGraphLaunch`.
pub fn capture_at_next_launch(stream: &cumempool::Stream) {
    capture_after(b"capture_at_next_launch\0", stream);
}

fn capture_after(symbol: &[u8], stream: &cumempool::Stream) {
    let path = LIBRARY.get().expect("the stand-in driver is loaded: call stand_in() first");
    // SAFETY: as in `call_log`; the symbol is a stream pointer the stand-in reads and clears,
    // and `stream`'s handle is one of the stand-in's streams.
    unsafe {
        let library = libloading::Library::new(path).unwrap();
        let symbol = library.get::<*mut *mut std::ffi::c_void>(symbol).unwrap();
        **symbol = stream.as_raw().cast();
    }
}
