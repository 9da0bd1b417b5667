//! The driver's capture-mode rules, on a host without a GPU: this binary loads a small stand-in
//! for libcuda (`CUMEMPOOL_LIBCUDA`), compiled here from C, that models what a capture forbids.
//! A host wait or status query (`cuStreamSynchronize`, `cuStreamQuery`, `cuEventSynchronize`,
//! `cuEventQuery`) is refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture that
//! forbade it invalidated, when the calling thread's mode is not relaxed and the thread has a
//! capture underway, or (in global mode) any thread has a global capture underway; a wait on a
//! capturing stream is refused whatever the mode. Pool allocations are heap blocks, counted.
//! Every function the stand-in does not model answers success.
//!
//! The same scenarios run on the GPU in `review2_capture.rs` and `review2_cudarc.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUresult, CUstreamCaptureMode};
use cumempool::{Context, Device, Error, Event, MemPool, Route, Stream};
use cumempool_tests::{begin_foreign_capture_in, end_foreign_capture};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock, PoisonError};

const STAND_IN: &str = r#"
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
typedef void *CUcontext;
enum { GLOBAL = 0, THREAD_LOCAL = 1, RELAXED = 2 };
enum { UNSUPPORTED = 900, INVALIDATED = 901 };
typedef struct { int capturing, invalidated, mode; pthread_t thread; uint64_t id; } Stream;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static Stream *capturing[64];
static uint64_t next_id = 1;
static __thread int thread_mode = GLOBAL;
static int primary_storage;
static CUcontext primary = &primary_storage;
static __thread CUcontext current;
static size_t live_bytes;
static CUresult generic(void) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuInit(unsigned flags) { return 0; }
static CUresult error_name(CUresult e, const char **s) { *s = "CUDA_ERROR_FROM_THE_STAND_IN"; return 0; }
static CUresult device_count(int *n) { *n = 1; return 0; }
static CUresult device_get(int *d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
static CUresult device_attribute(int *v, int attribute, int d) { *v = 1; return 0; }
static CUresult primary_retain(CUcontext *c, int d) { *c = primary; return 0; }
static CUresult ctx_get(CUcontext *c) { *c = current; return 0; }
static CUresult ctx_set(CUcontext c) { current = c; return 0; }
static CUresult stream_create(Stream **s, unsigned flags) { *s = calloc(1, sizeof **s); return 0; }
static CUresult stream_destroy(Stream *s) { free(s); return 0; }
static CUresult pool_create(void **pool, const void *props) { *pool = malloc(8); return 0; }
static CUresult pool_attribute(void *pool, int attribute, void *value) {
    if (attribute >= 4) *(uint64_t *)value = live_bytes; else *(int *)value = 0;
    return 0;
}
static CUresult alloc_from_pool(uint64_t *p, size_t n, void *pool, Stream *s) {
    size_t *block = malloc(sizeof(size_t) + (n ? n : 1));
    *block = n; live_bytes += n; *p = (uint64_t)(uintptr_t)(block + 1); return 0;
}
static CUresult free_async(uint64_t p, Stream *s) {
    if (s && (uintptr_t)s > 2 && s->capturing) return 1; /* memory from before the capture */
    size_t *block = (size_t *)(uintptr_t)p - 1;
    live_bytes -= *block; free(block); return 0;
}
static CUresult event_create(void **e, unsigned flags) { *e = malloc(8); return 0; }
static CUresult event_destroy(void *e) { free(e); return 0; }
/* Whether the calling thread may make a potentially unsafe call now; invalidates what forbids it. */
static int forbidden(Stream *on) {
    int refused = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 64; i++) {
        Stream *c = capturing[i];
        if (!c) continue;
        int mine = pthread_equal(c->thread, pthread_self());
        int forbids = c == on
            || (thread_mode != RELAXED && c->mode != RELAXED && mine)
            || (thread_mode == GLOBAL && c->mode == GLOBAL);
        if (forbids) { c->invalidated = 1; refused = 1; }
    }
    pthread_mutex_unlock(&lock);
    return refused;
}
static CUresult stream_wait(Stream *s) { return forbidden((uintptr_t)s > 2 ? s : 0) ? UNSUPPORTED : 0; }
static CUresult event_wait(void *e) { return forbidden(0) ? UNSUPPORTED : 0; }
static CUresult begin_capture(Stream *s, int mode) {
    pthread_mutex_lock(&lock);
    s->capturing = 1; s->invalidated = 0; s->mode = mode; s->thread = pthread_self(); s->id = next_id++;
    for (int i = 0; i < 64; i++) if (!capturing[i]) { capturing[i] = s; break; }
    pthread_mutex_unlock(&lock);
    return 0;
}
static CUresult end_capture(Stream *s, void **graph) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 64; i++) if (capturing[i] == s) capturing[i] = 0;
    int invalidated = s->invalidated;
    s->capturing = 0; s->invalidated = 0;
    pthread_mutex_unlock(&lock);
    *graph = invalidated ? 0 : malloc(8);
    return invalidated ? INVALIDATED : 0;
}
static CUresult graph_destroy(void *graph) { free(graph); return 0; }
static CUresult capture_info(Stream *s, int *status, uint64_t *id, void *a, void *b, void *c, void *d) {
    int on = (uintptr_t)s > 2 && s->capturing;
    *status = on ? (s->invalidated ? 2 : 1) : 0;
    if (id) *id = on ? s->id : 0;
    return 0;
}
static CUresult exchange_mode(int *mode) { int old = thread_mode; thread_mode = *mode; *mode = old; return 0; }
static const struct { const char *name; void *fn; } table[] = {
    {"cuGetErrorName", error_name}, {"cuGetErrorString", error_name},
    {"cuDeviceGetCount", device_count}, {"cuDeviceGet", device_get},
    {"cuDeviceGetAttribute", device_attribute}, {"cuDevicePrimaryCtxRetain", primary_retain},
    {"cuCtxGetCurrent", ctx_get}, {"cuCtxSetCurrent", ctx_set},
    {"cuStreamCreate", stream_create}, {"cuStreamDestroy", stream_destroy},
    {"cuMemPoolCreate", pool_create}, {"cuMemPoolGetAttribute", pool_attribute},
    {"cuMemAllocFromPoolAsync", alloc_from_pool}, {"cuMemFreeAsync", free_async},
    {"cuEventCreate", event_create}, {"cuEventDestroy", event_destroy},
    {"cuStreamSynchronize", stream_wait}, {"cuStreamQuery", stream_wait},
    {"cuEventSynchronize", event_wait}, {"cuEventQuery", event_wait},
    {"cuStreamBeginCapture", begin_capture}, {"cuStreamEndCapture", end_capture},
    {"cuGraphDestroy", graph_destroy}, {"cuStreamGetCaptureInfo", capture_info},
    {"cuThreadExchangeStreamCaptureMode", exchange_mode},
};
CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, uint64_t flags, int *status) {
    *fn = (void *)generic;
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(symbol, table[i].name)) *fn = table[i].fn;
    if (status) *status = 0;
    return 0;
}
"#;

/// The stand-in compiled and loaded, and its device's context; `None` (skipped, said why)
/// without a C compiler.
fn stand_in() -> Option<(MutexGuard<'static, ()>, Context)> {
    static SERIAL: Mutex<()> = Mutex::new(());
    static CONTEXT: OnceLock<Option<Context>> = OnceLock::new();
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let context = CONTEXT.get_or_init(|| {
        let directory = std::env::temp_dir().join(format!("cumempool-capture-modes-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let (source, library) = (directory.join("stand_in.c"), directory.join("libstandin.so"));
        std::fs::write(&source, STAND_IN).unwrap();
        let compiled = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-pthread", "-o"])
            .arg(&library)
            .arg(&source)
            .status();
        if !compiled.is_ok_and(|status| status.success()) {
            eprintln!("skipped: no C compiler for the stand-in driver");
            return None;
        }
        // SAFETY: set before any thread of this binary reads the environment through the loader
        // (every test takes `SERIAL` and reaches the driver only after this).
        unsafe { std::env::set_var("CUMEMPOOL_LIBCUDA", &library) };
        Some(Device::get(0).unwrap().primary_context().unwrap())
    });
    context.clone().map(|context| (serial, context))
}

#[test]
fn host_waits_leave_a_capture_other_code_runs_on_the_thread_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let foreign = Stream::new(&context).unwrap();
    let stream = Stream::new(&context).unwrap();
    let event = Event::new(&context).unwrap();
    event.record(&stream).unwrap();
    begin_foreign_capture_in(&foreign, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    stream.synchronize().unwrap();
    assert!(stream.is_idle().unwrap());
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    assert!(
        matches!(foreign.synchronize(), Err(Error::StreamCapturing { .. })),
        "a wait on the capturing stream itself is still refused"
    );
    assert_eq!(end_foreign_capture(&foreign), CUresult::CUDA_SUCCESS, "a host wait invalidated the capture");
    // The thread's own mode is back: a wait the library does not make is still refused.
    begin_foreign_capture_in(&foreign, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
    // SAFETY: a live stream.
    let raw_wait = unsafe { sys::driver().unwrap().cuStreamSynchronize().unwrap()(stream.as_raw()) };
    assert_eq!(
        raw_wait,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "the thread is back in its own (global) mode"
    );
    assert_eq!(end_foreign_capture(&foreign), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn a_host_wait_on_another_thread_leaves_a_global_capture_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let capturing = Stream::new(&context).unwrap();
    let waiting = Stream::new(&context).unwrap();
    let (begun, on_begun) = mpsc::channel();
    let (waited, on_waited) = mpsc::channel::<()>();
    let (wait, ended) = std::thread::scope(|scope| {
        let other_code = scope.spawn(move || {
            begin_foreign_capture_in(&capturing, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
            begun.send(()).unwrap();
            let _ = on_waited.recv();
            end_foreign_capture(&capturing)
        });
        on_begun.recv().unwrap();
        let wait = waiting.synchronize();
        drop(waited);
        (wait, other_code.join().unwrap())
    });
    wait.unwrap();
    assert_eq!(ended, CUresult::CUDA_SUCCESS, "a host wait on another thread invalidated the global capture");
}

#[test]
fn status_queries_inside_a_capture_are_refused_and_leave_it_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let event = Event::new(&context).unwrap();
    event.record(&stream).unwrap();
    let mut asked = None;
    let graph = stream.capture(|_| {
        asked = Some(event.is_complete());
        Ok(())
    });
    assert!(matches!(asked, Some(Err(Error::StreamCapturing { .. }))), "{asked:?}");
    graph.expect("the capture survives the refused query");
}

#[test]
fn a_stream_dropped_during_other_codes_capture_still_frees_what_was_deferred_to_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let lender = Stream::new(&context).unwrap(); // stands for cudarc's stream, which lives on
    let pool = MemPool::new(Route::device(0)).unwrap();
    for sweep in [false, true] {
        let keep_alive: Arc<dyn std::any::Any + Send + Sync> = Arc::new(lender.clone());
        // SAFETY: `lender` outlives the result (the keep-alive holds a clone).
        let stream = unsafe { Stream::borrow_raw_keeping(lender.as_raw(), Some(&context), keep_alive) }.unwrap();
        let buffer = pool.alloc(4096, &stream).unwrap();
        begin_foreign_capture_in(&stream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
        drop(buffer); // deferred: its stream captures
        drop(stream); // the last handle of it here
        assert_eq!(end_foreign_capture(&lender), CUresult::CUDA_SUCCESS);
        assert_eq!(pool.used_mem_current().unwrap(), 4096, "not freed during the capture");
        if sweep {
            assert_eq!(Stream::run_orphaned_frees(), 0, "nothing left waiting");
        } else {
            // SAFETY: as above.
            let again = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
            again.synchronize().unwrap();
        }
        assert_eq!(pool.used_mem_current().unwrap(), 0, "the free deferred to the dropped stream never ran");
    }
    assert!(!matches!(pool.destroy(), Err(Error::PoolInUse { .. })), "a lost deferred free keeps the pool in use");
}

#[test]
fn a_pending_copy_waited_for_inside_a_capture_is_handed_back_with_its_vector() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(4096, &stream).unwrap();
    let pending = buffer.copy_to_host_async(vec![7; 4096]).unwrap();
    let mut handed_back = None;
    stream
        .capture(|_| {
            let refused = pending.wait().unwrap_err();
            assert!(matches!(refused.error(), Error::StreamCapturing { .. }), "{refused}");
            handed_back = refused.into_pending();
            Ok(())
        })
        .expect("the capture survives the refused wait");
    let pending = handed_back.expect("the refused wait handed the copy back");
    assert_eq!(pending.wait().unwrap(), vec![7; 4096], "the vector itself, not a leaked one");
}
