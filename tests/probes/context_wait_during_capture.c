/* What a wait for the whole context (cuCtxSynchronize) does to a capture underway, and whether
   an allocation on another stream, waited for, leaves one intact: the two things the PyTorch
   plug-in's frees and capture-time allocations rely on (docs/driver-behaviour.md).

   cc -O1 tests/probes/context_wait_during_capture.c -o /tmp/context_wait -ldl -lpthread && /tmp/context_wait

   Each line names the capture mode of the capture, which thread waits (and in which mode), the
   driver's answer to the wait and to cuStreamEndCapture (0 success, 900 unsupported during
   capture, 901 capture invalidated). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

typedef int CUresult;
typedef CUresult (*call)();
static call init, device_get, primary_retain, set_current, stream_create, begin_capture,
    end_capture, exchange_mode, context_wait, default_pool, alloc_from_pool, free_async,
    stream_wait, capture_info;
static void *context;
static const int RELAXED = 2;
static const char *MODES[] = {"global", "thread-local", "relaxed"};

static call entry(void *library, const char *name) {
    call found = (call)dlsym(library, name);
    if (!found) fprintf(stderr, "missing %s\n", name);
    return found;
}

/* Another thread asks the legacy stream (handle 0, then 1) whether it captures. */
struct asker { CUresult answers[2]; };
static void *ask_the_legacy_stream(void *argument) {
    struct asker *a = argument;
    set_current(context);
    for (int handle = 0; handle < 2; handle++) {
        int status = -1;
        unsigned long long id = 0;
        a->answers[handle] = capture_info((void *)(unsigned long)handle, &status, &id, 0, 0, 0, 0);
    }
    return 0;
}

/* Another thread waits for the context, in relaxed mode when asked to. */
struct waiter { int relaxed; CUresult answer; };
static void *wait_from_another_thread(void *argument) {
    struct waiter *w = argument;
    set_current(context);
    if (w->relaxed) { int mode = RELAXED; exchange_mode(&mode); }
    w->answer = context_wait(context);
    return 0;
}

int main(void) {
    void *library = dlopen("libcuda.so.1", RTLD_NOW);
    if (!library) { fprintf(stderr, "no libcuda.so.1\n"); return 1; }
    init = entry(library, "cuInit");
    device_get = entry(library, "cuDeviceGet");
    primary_retain = entry(library, "cuDevicePrimaryCtxRetain");
    set_current = entry(library, "cuCtxSetCurrent");
    stream_create = entry(library, "cuStreamCreate");
    begin_capture = entry(library, "cuStreamBeginCapture_v2");
    end_capture = entry(library, "cuStreamEndCapture");
    exchange_mode = entry(library, "cuThreadExchangeStreamCaptureMode");
    context_wait = (call)dlsym(library, "cuCtxSynchronize_v2");
    if (!context_wait) context_wait = entry(library, "cuCtxSynchronize");
    default_pool = entry(library, "cuDeviceGetDefaultMemPool");
    alloc_from_pool = entry(library, "cuMemAllocFromPoolAsync");
    free_async = entry(library, "cuMemFreeAsync");
    stream_wait = entry(library, "cuStreamSynchronize");
    capture_info = (call)dlsym(library, "cuStreamGetCaptureInfo_v3");
    if (!capture_info) capture_info = entry(library, "cuStreamGetCaptureInfo");

    int device;
    void *captured, *side, *pool;
    init(0);
    device_get(&device, 0);
    primary_retain(&context, device);
    set_current(context);
    void *blocking;
    stream_create(&captured, 1); /* non-blocking */
    stream_create(&blocking, 0);
    stream_create(&side, 1);
    default_pool(&pool, device);

    for (int mode = 0; mode < 3; mode++) {
        for (int relaxed = 0; relaxed < 2; relaxed++) {
            struct waiter w = {relaxed, -1};
            pthread_t thread;
            begin_capture(captured, mode);
            pthread_create(&thread, 0, wait_from_another_thread, &w);
            pthread_join(thread, 0);
            void *graph = 0;
            CUresult ended = end_capture(captured, &graph);
            printf("capture %-12s wait from another thread (%s): wait %d, end %d\n", MODES[mode],
                   relaxed ? "relaxed" : "its default mode", w.answer, ended);
        }
        begin_capture(captured, mode);
        int saved = RELAXED;
        exchange_mode(&saved);
        CUresult waited = context_wait(context);
        exchange_mode(&saved);
        void *graph = 0;
        CUresult ended = end_capture(captured, &graph);
        printf("capture %-12s wait from the capturing thread (relaxed): wait %d, end %d\n",
               MODES[mode], waited, ended);
    }
    for (int mode = 0; mode < 3; mode++) {
        unsigned long long address = 0;
        begin_capture(captured, mode);
        int saved = RELAXED;
        exchange_mode(&saved);
        CUresult allocated = alloc_from_pool(&address, 1 << 20, pool, side);
        CUresult waited = stream_wait(side);
        CUresult freed = free_async(address, side);
        CUresult waited_again = stream_wait(side);
        exchange_mode(&saved);
        void *graph = 0;
        CUresult ended = end_capture(captured, &graph);
        printf("capture %-12s allocate, wait, free, wait on another stream (relaxed): %d %d %d %d, end %d\n",
               MODES[mode], allocated, waited, freed, waited_again, ended);
    }
    for (int mode = 0; mode < 3; mode++) {
        struct asker a = {{-1, -1}};
        pthread_t thread;
        begin_capture(blocking, mode);
        pthread_create(&thread, 0, ask_the_legacy_stream, &a);
        pthread_join(thread, 0);
        void *graph = 0;
        CUresult ended = end_capture(blocking, &graph);
        printf("capture %-12s on a blocking stream, the legacy stream asked from another thread: 0 -> %d, 1 -> %d, end %d\n",
               MODES[mode], a.answers[0], a.answers[1], ended);
    }
    return 0;
}
