/* A stand-in for libcuda, loaded through CUMEMPOOL_LIBCUDA by tests/src/stand_in_driver.rs: what a
   capture forbids, modelled on a host without a GPU (that module's documentation says what). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <fcntl.h>
typedef int CUresult;
/* Streams made and not destroyed, read by the tests through the symbol. */
int live_streams;
typedef void *CUcontext;
enum { GLOBAL = 0, THREAD_LOCAL = 1, RELAXED = 2 };
enum { INVALID_CONTEXT = 201, UNSUPPORTED = 900, INVALIDATED = 901, ISOLATION = 905 };
/* `joined`: the stream whose capture this one joined by waiting for an event recorded in it. */
typedef struct Stream { int capturing, invalidated, mode, blocking, destroyed; pthread_t thread; uint64_t id; struct Stream *joined; } Stream;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static Stream *capturing[64];
static uint64_t next_id = 1;
static __thread int thread_mode = GLOBAL;
static int primary_storage;
static CUcontext primary = &primary_storage;
/* The calling thread's current context: work that needs one (a new stream or event, or pool
   memory ordered on the legacy stream) is refused with CUDA_ERROR_INVALID_CONTEXT without it. */
static __thread CUcontext current;
/* The calling thread's per-thread default stream (handle 2), a blocking stream: while any
   thread's captures, legacy-stream work (handles 0 and 1) from any thread is an implicit
   dependency the driver refuses with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, invalidating that
   capture (driver 580, measured). */
static __thread Stream per_thread_stream = { .blocking = 1 };
enum { IMPLICIT = 906 };
static Stream *resolve(Stream *s) { return (uintptr_t)s == 2 ? &per_thread_stream : s; }
static int legacy_refused(Stream *s) {
    if ((uintptr_t)s > 1) return 0;
    int refused = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 64; i++)
        if (capturing[i] && capturing[i]->blocking) { capturing[i]->invalidated = 1; refused = 1; }
    pthread_mutex_unlock(&lock);
    return refused;
}
static size_t live_bytes;
/* Set in the size header of an imported mapping's block (see `pointer_import`). */
#define MAPPING ((size_t)1 << 63)
static CUresult generic(void) { return 0; }
/* A log of the calls that order work, and one-shot switches (see stand_in_driver.rs). */
char call_log[1 << 16];
int call_log_len;
int fail_next_exchange;
int capture_on_next_record;
int end_capture_before_next_waitevent;
int fail_next_waits;
int null_next_alloc;
/* The next free on the legacy stream is refused as if a blocking stream began capturing just
   before it (after the library asked): CUDA_ERROR_STREAM_CAPTURE_IMPLICIT. */
int refuse_next_legacy_free;
/* The next cuEventCreate begins a relaxed capture of the calling thread's per-thread stream, as
   a blocking stream's capture begun right after the library asked the legacy stream. */
int capture_per_thread_at_next_event_create;
/* The next free on the legacy stream that goes through begins a relaxed capture of the calling
   thread's per-thread stream right after it, as a blocking stream's capture begun between the
   library's last free of a batch and what it does next. */
int capture_per_thread_after_next_legacy_free;
/* Counts capture questions down: the one that brings it to 0 is answered, then a relaxed capture
   begins of `capture_after_queries_of`, or where that is null of the calling thread's per-thread
   stream (a blocking stream), as a capture begun between one check of the library's and the
   next. */
int capture_after_capture_queries;
void *capture_after_queries_of;
/* The next this many capture questions fail (an error other than a capture's), as a driver that
   cannot answer. */
int capture_queries_failing;
Stream *capture_at_next_memcpy;
Stream *capture_at_next_launch;
static void log_call(const char *what, const void *a, const void *b, int r) {
    pthread_mutex_lock(&lock);
    if (call_log_len < (int)sizeof call_log - 128)
        call_log_len += snprintf(call_log + call_log_len, sizeof call_log - call_log_len, "%s %p %p %d\n", what, a, b, r);
    pthread_mutex_unlock(&lock);
}
/* The same log for the stand-in NCCL (stand_in_nccl.c), built into this library. */
void stand_in_log(const char *what, const void *a, const void *b, int r) { log_call(what, a, b, r); }
/* The CUDA version this stand-in is a driver of: 13.0 unless built for another (stand_in_driver.rs). */
#ifndef STAND_IN_DRIVER_VERSION
#define STAND_IN_DRIVER_VERSION 13000
#endif
CUresult cuDriverGetVersion(int *v) { *v = STAND_IN_DRIVER_VERSION; return 0; }
CUresult cuInit(unsigned flags) { return 0; }
static CUresult error_name(CUresult e, const char **s) { *s = "CUDA_ERROR_FROM_THE_STAND_IN"; return 0; }
static CUresult device_count(int *n) { *n = 1; return 0; }
/* cuDeviceGet and the context functions are exported by name as well, as libcuda exports them,
   for tests that call them through ctypes. */
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
static CUresult device_attribute(int *v, int attribute, int d) { *v = 1; return 0; }
static CUresult primary_retain(CUcontext *c, int d) { *c = primary; return 0; }
/* How many times the current context was read: a count, as `capture_queries` below. */
unsigned long context_queries;
CUresult cuCtxGetCurrent(CUcontext *c) { __atomic_fetch_add(&context_queries, 1, __ATOMIC_RELAXED); *c = current; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return 0; }
/* A context of the caller's own (what CuPy or a runtime user on another device looks like),
   made through these symbols only: `cuGetProcAddress` would owe CUDA 13 callers the _v4 ABI. */
CUresult cuCtxCreate_v2(CUcontext *c, unsigned flags, int d) { *c = malloc(8); current = *c; return 0; }
CUresult cuCtxDestroy_v2(CUcontext c) { if (current == c) current = 0; free(c); return 0; }
/* As the driver does, the last destroyed stream's handle goes to the next new stream (kept here
   rather than left to malloc, whose reuse depends on what else the process allocates). Other
   destroyed streams are never freed: asked about, they answer CUDA_ERROR_INVALID_HANDLE, as the
   driver does for a handle it no longer knows. */
static Stream *last_destroyed;
static CUresult stream_create(Stream **s, unsigned flags) {
    if (!current) return INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    *s = last_destroyed ? last_destroyed : malloc(sizeof **s);
    last_destroyed = 0;
    memset(*s, 0, sizeof **s);
    live_streams++;
    pthread_mutex_unlock(&lock);
    return 0;
}
static CUresult stream_destroy(Stream *s) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 64; i++) if (capturing[i] == s) capturing[i] = 0;
    s->destroyed = 1;
    last_destroyed = s;
    live_streams--;
    pthread_mutex_unlock(&lock);
    return 0;
}
/* A pool made here remembers the export handle types it was created with (CUmemPoolProps'
   second field); one imported from a shareable handle has none, as it cannot be exported again. */
typedef struct Pool { uint32_t handle_types; } Pool;
enum { INVALID_VALUE = 1, POSIX_FILE_DESCRIPTOR = 1 };
static CUresult pool_create(Pool **pool, const uint32_t *props) {
    *pool = calloc(1, sizeof **pool);
    (*pool)->handle_types = props[1];
    return 0;
}
static CUresult pool_attribute(void *pool, int attribute, void *value) {
    if (attribute >= 4) *(uint64_t *)value = live_bytes; else *(int *)value = 0;
    return 0;
}
/* STAND_IN_POOL_LIMIT=N (read at each allocation; unset or 0: none): an allocation that would
   bring the bytes live, over all pools, past N is refused with CUDA_ERROR_OUT_OF_MEMORY, as a
   pool at its maximum size refuses it. */
static size_t pool_limit(void) {
    const char *v = getenv("STAND_IN_POOL_LIMIT");
    return v ? (size_t)strtoull(v, 0, 10) : 0;
}
static CUresult alloc_from_pool(uint64_t *p, size_t n, void *pool, Stream *s) {
    if ((uintptr_t)s <= 1 && !current) return INVALID_CONTEXT;
    if (legacy_refused(s)) return IMPLICIT;
    size_t limit = pool_limit();
    if (limit && (n > limit || live_bytes > limit - n)) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    if (null_next_alloc) { null_next_alloc = 0; *p = 0; return 0; } /* success with no memory */
    size_t *block = malloc(sizeof(size_t) + (n ? n : 1));
    *block = n; live_bytes += n; *p = (uint64_t)(uintptr_t)(block + 1); return 0;
}
static CUresult begin_capture(Stream *s, int mode);
static CUresult free_async(uint64_t p, Stream *s) {
    if ((uintptr_t)s <= 1 && !current) return INVALID_CONTEXT;
    if (legacy_refused(s)) return IMPLICIT;
    if ((uintptr_t)s <= 1 && refuse_next_legacy_free) { refuse_next_legacy_free = 0; return IMPLICIT; }
    if (s && (uintptr_t)s > 2 && s->capturing) return 1; /* memory from before the capture */
    log_call("free", (void *)(uintptr_t)p, s, 0);
    size_t *block = (size_t *)(uintptr_t)p - 1;
    live_bytes -= *block & ~MAPPING;
    if (!(*block & MAPPING)) free(block);
    if ((uintptr_t)s <= 1 && capture_per_thread_after_next_legacy_free) {
        capture_per_thread_after_next_legacy_free = 0;
        begin_capture((Stream *)2, RELAXED);
    }
    return 0;
}
/* An event is the capturing stream its last record was on, or null. Querying or waiting for an
   event recorded in a capture answers CUDA_ERROR_CAPTURED_EVENT. */
enum { CAPTURED_EVENT = 907 };
static CUresult begin_capture(Stream *s, int mode);
static CUresult event_create(void **e, unsigned flags) {
    if (!current) return INVALID_CONTEXT;
    if (capture_per_thread_at_next_event_create) {
        capture_per_thread_at_next_event_create = 0;
        begin_capture((Stream *)2, RELAXED);
    }
    *e = calloc(1, sizeof(Stream *)); log_call("eventcreate", *e, 0, 0);
    return 0;
}
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
        if (forbids) { c->invalidated = 1; refused = 1; if (c->joined) c->joined->invalidated = 1; }
    }
    pthread_mutex_unlock(&lock);
    return refused;
}
static CUresult begin_capture(Stream *s, int mode);
/* A wait for every stream of the context: while any stream captures, in any mode and from any
   thread, relaxed or not, the driver refuses it and invalidates that capture (driver 580,
   measured on an H100: 900, then 901 at the capture's end). */
static CUresult ctx_synchronize(CUcontext c) {
    int refused = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < 64; i++) if (capturing[i]) { capturing[i]->invalidated = 1; refused = 1; }
    pthread_mutex_unlock(&lock);
    CUresult r = refused ? UNSUPPORTED : 0;
    log_call("ctxsync", c, 0, r);
    return r;
}
/* A sticky error (an earlier launch's fault, say): while set, every capture question and stream
   wait answers it, as the driver answers every call of a context that faulted. */
int sticky_error;
/* A wait on the legacy stream is legacy-stream work: refused while a blocking stream captures,
   and that capture invalidated (`legacy_refused`). */
static CUresult stream_wait(Stream *s) {
    if (sticky_error) return sticky_error;
    CUresult r = legacy_refused(s) ? IMPLICIT : forbidden((uintptr_t)s > 2 ? s : 0) ? UNSUPPORTED : 0;
    if (!r && fail_next_waits & 2) { fail_next_waits &= ~2; r = 999; }
    log_call("sync", s, 0, r);
    return r;
}
static CUresult memcpy_async(uint64_t d, uint64_t src, size_t n, Stream *s) {
    if (legacy_refused(s)) return IMPLICIT;
    log_call("memcpy", s, 0, 0);
    if (capture_at_next_memcpy) { begin_capture(capture_at_next_memcpy, RELAXED); capture_at_next_memcpy = 0; }
    return 0;
}
/* A memset is logged with whether its stream captures (then it is recorded into the graph). */
static CUresult memset_async(uint64_t d, unsigned char v, size_t n, Stream *s) {
    if (legacy_refused(s)) return IMPLICIT;
    log_call("memset", s, 0, (uintptr_t)s > 2 && s->capturing);
    return 0;
}
/* A launch is logged with whether its stream captures (then it is recorded, not run). */
static CUresult graph_launch(void *exec, Stream *s) {
    log_call("launch", s, 0, (uintptr_t)s > 2 && s->capturing);
    if (capture_at_next_launch) { begin_capture(capture_at_next_launch, RELAXED); capture_at_next_launch = 0; }
    return 0;
}
static CUresult graph_instantiate(void **exec, void *graph, uint64_t flags) { *exec = malloc(8); return 0; }
static CUresult graph_exec_destroy(void *exec) { free(exec); return 0; }
static CUresult event_record(void *e, Stream *s) {
    if (capture_on_next_record && (uintptr_t)s > 2) { capture_on_next_record = 0; begin_capture(s, RELAXED); }
    Stream **recorded = e;
    *recorded = (uintptr_t)s > 2 && s->capturing ? s : 0;
    log_call("record", e, s, 0);
    return 0;
}
/* Waiting for an event recorded in a capture joins the waiting stream to that capture. */
static CUresult end_capture(Stream *s, void **graph);
static CUresult wait_event(Stream *s, void *e, unsigned f) {
    Stream *origin = *(Stream **)e;
    if (end_capture_before_next_waitevent && origin) {
        void *graph = 0;
        end_capture_before_next_waitevent = 0;
        end_capture(origin, &graph);
        free(graph);
    }
    /* A capturing stream waiting for an event recorded outside any capture: refused with
       CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and the capture invalidated (driver 580, measured). */
    if (!origin && (uintptr_t)s > 2 && s->capturing) {
        pthread_mutex_lock(&lock);
        s->invalidated = 1;
        if (s->joined) s->joined->invalidated = 1;
        pthread_mutex_unlock(&lock);
        log_call("waitevent", s, e, ISOLATION);
        return ISOLATION;
    }
    /* An event whose capture has ended has nothing to join: the wait orders nothing. */
    if (origin && origin->capturing && (uintptr_t)s > 2) {
        pthread_mutex_lock(&lock);
        s->capturing = 1; s->invalidated = 0; s->mode = origin->mode; s->thread = origin->thread;
        s->id = origin->id; s->joined = origin;
        for (int i = 0; i < 64; i++) if (!capturing[i]) { capturing[i] = s; break; }
        pthread_mutex_unlock(&lock);
    }
    log_call("waitevent", s, e, 0);
    return 0;
}
static CUresult event_query(void *e) { return forbidden(0) ? UNSUPPORTED : *(Stream **)e ? CAPTURED_EVENT : 0; }
static CUresult event_wait(void *e) {
    CUresult r = forbidden(0) ? UNSUPPORTED : *(Stream **)e ? CAPTURED_EVENT : 0;
    if (!r && fail_next_waits & 1) { fail_next_waits &= ~1; r = 999; }
    log_call("eventsync", e, 0, r);
    return r;
}
/* Virtual memory: 2 MiB granules, and one range of addresses (never dereferenced). */
static CUresult granularity(size_t *size, const void *props, int flag) { *size = 2 << 20; return 0; }
static CUresult address_reserve(uint64_t *base, size_t size, size_t align, uint64_t addr, uint64_t flags) {
    *base = (uint64_t)1 << 40;
    return 0;
}
static CUresult address_free(uint64_t base, size_t size) { log_call("addressfree", (void *)(uintptr_t)base, 0, 0); return 0; }
/* A chunk exported as a file descriptor: a new descriptor of /dev/null, which the caller owns. */
static CUresult export_shareable(void *handle, uint64_t memory, int type, uint64_t flags) {
    *(int *)handle = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return 0;
}
/* Sharing a pool within the process: a pool created with POSIX_FILE_DESCRIPTOR exports a new
   descriptor of /dev/null, and any open descriptor imports as a new pool. An allocation's export
   data is its address and size; importing it maps a fresh block of that size, laid out and
   counted as `alloc_from_pool`'s, which `free_async` unmaps. So a re-import is mapped at another
   address, where the driver maps the same one; and any allocation exports, shared pool or not.
   An unmapped block is never freed, so no later import is mapped at its address: a mapping the
   library could not wait for stays marked as mapped there, and must not reach into later tests. */
static CUresult pool_export(void *handle, Pool *pool, int type, uint64_t flags) {
    if (type != POSIX_FILE_DESCRIPTOR || !pool || !(pool->handle_types & POSIX_FILE_DESCRIPTOR)) return INVALID_VALUE;
    *(int *)handle = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return 0;
}
static CUresult pool_import(Pool **pool, void *handle, int type, uint64_t flags) {
    if (type != POSIX_FILE_DESCRIPTOR || fcntl((int)(intptr_t)handle, F_GETFD) == -1) return INVALID_VALUE;
    *pool = calloc(1, sizeof **pool);
    return 0;
}
static CUresult pointer_export(uint64_t data[8], uint64_t p) {
    memset(data, 0, 64);
    data[0] = p;
    data[1] = ((size_t *)(uintptr_t)p)[-1] & ~MAPPING;
    return 0;
}
static CUresult pointer_import(uint64_t *p, Pool *pool, const uint64_t data[8]) {
    size_t n = data[1];
    if (!data[0] || !n) return INVALID_VALUE;
    size_t *block = malloc(sizeof(size_t) + n);
    *block = n | MAPPING; live_bytes += n; *p = (uint64_t)(uintptr_t)(block + 1);
    return 0;
}
/* The mapped range of an allocation's start (CU_POINTER_ATTRIBUTE_RANGE_START_ADDR and
   RANGE_SIZE), read from its block; other attributes are left unwritten, as any unmodelled call. */
enum { RANGE_START_ADDR = 11, RANGE_SIZE = 12 };
static CUresult pointer_attribute(void *value, int attribute, uint64_t p) {
    if (attribute == RANGE_START_ADDR) *(uint64_t *)value = p;
    if (attribute == RANGE_SIZE) *(size_t *)value = ((size_t *)(uintptr_t)p)[-1] & ~MAPPING;
    return 0;
}
static CUresult begin_capture(Stream *s, int mode) {
    s = resolve(s);
    pthread_mutex_lock(&lock);
    s->capturing = 1; s->invalidated = 0; s->mode = mode; s->thread = pthread_self(); s->id = next_id++;
    for (int i = 0; i < 64; i++) if (!capturing[i]) { capturing[i] = s; break; }
    pthread_mutex_unlock(&lock);
    return 0;
}
static CUresult end_capture(Stream *s, void **graph) {
    s = resolve(s);
    pthread_mutex_lock(&lock);
    int unjoined = 0;
    for (int i = 0; i < 64; i++) {
        Stream *c = capturing[i];
        if (c && c->joined == s) { c->capturing = 0; c->invalidated = 0; c->joined = 0; capturing[i] = 0; unjoined = 1; }
    }
    for (int i = 0; i < 64; i++) if (capturing[i] == s) capturing[i] = 0;
    int invalidated = s->invalidated || unjoined;
    s->capturing = 0; s->invalidated = 0;
    pthread_mutex_unlock(&lock);
    *graph = invalidated ? 0 : malloc(8);
    return invalidated ? INVALIDATED : 0;
}
static CUresult graph_destroy(void *graph) { free(graph); return 0; }
/* How many times cuStreamGetCaptureInfo was asked: a count, not a log entry, since hot paths ask. */
unsigned long capture_queries;
static CUresult capture_info(Stream *s, int *status, uint64_t *id, void *a, void *b, void *c, void *d) {
    __atomic_fetch_add(&capture_queries, 1, __ATOMIC_RELAXED);
    if (sticky_error) return sticky_error;
    if (capture_queries_failing > 0) { capture_queries_failing--; return 999; }
    /* Asked of the legacy stream while a blocking stream captures, the driver answers with the
       implicit-dependency error and leaves the capture intact. */
    if ((uintptr_t)s <= 1) {
        int blocked = 0;
        pthread_mutex_lock(&lock);
        for (int i = 0; i < 64; i++) if (capturing[i] && capturing[i]->blocking) blocked = 1;
        pthread_mutex_unlock(&lock);
        if (blocked) return IMPLICIT;
    }
    s = resolve(s);
    if ((uintptr_t)s > 2 && s->destroyed) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    int on = (uintptr_t)s > 2 && s->capturing;
    *status = on ? (s->invalidated ? 2 : 1) : 0;
    if (id) *id = on ? s->id : 0;
    if (capture_after_capture_queries > 0 && --capture_after_capture_queries == 0)
        begin_capture(capture_after_queries_of ? (Stream *)capture_after_queries_of : (Stream *)2, RELAXED);
    return 0;
}
static CUresult exchange_mode(int *mode) { if (fail_next_exchange) { fail_next_exchange = 0; return 999; } int old = thread_mode; thread_mode = *mode; *mode = old; return 0; }
static const struct { const char *name; void *fn; } table[] = {
    {"cuGetErrorName", error_name}, {"cuGetErrorString", error_name},
    {"cuDeviceGetCount", device_count}, {"cuDeviceGet", cuDeviceGet},
    {"cuDeviceGetAttribute", device_attribute}, {"cuDevicePrimaryCtxRetain", primary_retain},
    {"cuCtxGetCurrent", cuCtxGetCurrent}, {"cuCtxSetCurrent", cuCtxSetCurrent},
    {"cuStreamCreate", stream_create}, {"cuStreamDestroy", stream_destroy},
    {"cuMemPoolCreate", pool_create}, {"cuMemPoolGetAttribute", pool_attribute},
    {"cuMemAllocFromPoolAsync", alloc_from_pool}, {"cuMemFreeAsync", free_async},
    {"cuEventCreate", event_create}, {"cuEventDestroy", event_destroy},
    {"cuStreamSynchronize", stream_wait}, {"cuCtxSynchronize", ctx_synchronize}, {"cuStreamQuery", stream_wait},
    {"cuEventSynchronize", event_wait}, {"cuEventQuery", event_query},
    {"cuStreamBeginCapture", begin_capture}, {"cuStreamEndCapture", end_capture},
    {"cuGraphDestroy", graph_destroy}, {"cuStreamGetCaptureInfo", capture_info},
    {"cuThreadExchangeStreamCaptureMode", exchange_mode},
    {"cuMemGetAllocationGranularity", granularity}, {"cuMemAddressReserve", address_reserve},
    {"cuMemAddressFree", address_free}, {"cuMemExportToShareableHandle", export_shareable},
    {"cuGraphLaunch", graph_launch}, {"cuGraphInstantiateWithFlags", graph_instantiate},
    {"cuGraphExecDestroy", graph_exec_destroy},
    {"cuMemPoolExportToShareableHandle", pool_export}, {"cuMemPoolImportFromShareableHandle", pool_import},
    {"cuMemPoolExportPointer", pointer_export}, {"cuMemPoolImportPointer", pointer_import},
    {"cuPointerGetAttribute", pointer_attribute},
    {"cuMemcpyAsync", memcpy_async}, {"cuMemsetD8Async", memset_async}, {"cuEventRecord", event_record}, {"cuStreamWaitEvent", wait_event},
};
/* CUDA 12.0 added cuGetProcAddress_v2: an older driver lacks the symbol, which is how a loader
   tells it from a library that is no driver at all. */
#if STAND_IN_DRIVER_VERSION >= 12000
CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, uint64_t flags, int *status) {
    *fn = (void *)generic;
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(symbol, table[i].name)) *fn = table[i].fn;
    if (status) *status = 0;
    return 0;
}
#endif
