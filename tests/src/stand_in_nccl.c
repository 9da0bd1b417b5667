/* A stand-in for libnccl, compiled into the same library as stand_in_driver.c and loaded through
   CUMEMPOOL_LIBNCCL, so that NCCL's calls land in the same call log as the driver's: what orders
   a collective with its buffers' streams can be checked on a host without a GPU.

   A collective is logged as `nccl <stream>` when NCCL would launch it: at once outside a group,
   at the outermost ncclGroupEnd inside one (as NCCL does). Registrations are logged as
   `register <address> <bytes>`, deregistrations as `deregister <handle>` and `windowderegister
   <window>`; a communicator's creation as `ncclinit`. Inside a group,
   ncclCommInitRank and ncclCommWindowRegister are deferred to the outermost ncclGroupEnd, as NCCL
   2.28 defers them: the window's handle would be written through the caller's out-pointer only
   then (logged as `windowdeferred <out-pointer>`, and `windowwritten <out-pointer>` when written). `fail_next_init` makes the next ncclCommInitRank fail with
   ncclSystemError, as a bootstrap that could not reach its root does; `fail_next_destroy` and
   `fail_next_abort` make the next ncclCommDestroy or ncclCommAbort fail so, keeping the
   communicator. `no_symmetric_next` makes the next ncclCommWindowRegister answer as NCCL 2.27+
   does for a communicator without symmetric-memory support: success, the window set to NULL at
   once (inside a group too), and nothing registered. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
void stand_in_log(const char *what, const void *a, const void *b, int r);
typedef int ncclResult_t;
typedef struct Comm { int rank, size, device; } Comm;
typedef struct { char internal[128]; } ncclUniqueId;
int fail_next_init;
static __thread int group_depth;
static __thread void *grouped[256];
static __thread int grouped_len;
static uint64_t next_unique_id = 1;

ncclResult_t ncclGetVersion(int *version) { *version = 22809; return 0; }
const char *ncclGetErrorString(ncclResult_t r) { return "an error of the stand-in NCCL"; }
const char *ncclGetLastError(void *comm) { return ""; }
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    memset(id, 0, sizeof *id);
    memcpy(id->internal, &next_unique_id, sizeof next_unique_id);
    next_unique_id++;
    return 0;
}
static Comm *new_comm(int rank, int size, int device) {
    Comm *c = calloc(1, sizeof *c);
    c->rank = rank; c->size = size; c->device = device;
    return c;
}
ncclResult_t ncclCommInitAll(Comm **comms, int n, const int *devices) {
    stand_in_log("ncclinit", 0, 0, n);
    for (int i = 0; i < n; i++) comms[i] = new_comm(i, n, devices ? devices[i] : i);
    return 0;
}
ncclResult_t ncclCommInitRank(Comm **comm, int n, ncclUniqueId id, int rank) {
    if (fail_next_init) { fail_next_init = 0; return 2; }
    stand_in_log("ncclinit", 0, 0, n);
    *comm = new_comm(rank, n, 0);
    return 0;
}
ncclResult_t ncclCommUserRank(const Comm *c, int *rank) { *rank = c->rank; return 0; }
ncclResult_t ncclCommCount(const Comm *c, int *count) { *count = c->size; return 0; }
ncclResult_t ncclCommCuDevice(const Comm *c, int *device) { *device = c->device; return 0; }
/* Logged as `nccldestroy <comm>` and `ncclabort <comm>` with the answer; `fail_next_destroy` and
   `fail_next_abort` make the next one fail with ncclSystemError, the communicator kept. */
int fail_next_destroy;
int fail_next_abort;
static ncclResult_t release(const char *what, int *fail_next, Comm *c) {
    int failed = *fail_next;
    *fail_next = 0;
    stand_in_log(what, c, 0, failed ? 2 : 0);
    if (failed) return 2;
    free(c);
    return 0;
}
ncclResult_t ncclCommDestroy(Comm *c) { return release("nccldestroy", &fail_next_destroy, c); }
ncclResult_t ncclCommAbort(Comm *c) { return release("ncclabort", &fail_next_abort, c); }
ncclResult_t ncclCommGetAsyncError(Comm *c, ncclResult_t *state) { *state = 0; return 0; }

/* A collective's launch on `stream`: now, or at the end of the group. */
static ncclResult_t launch(void *stream) {
    if (group_depth > 0) {
        if (grouped_len == 256) return 3;
        grouped[grouped_len++] = stream;
        return 0;
    }
    stand_in_log("nccl", stream, 0, 0);
    return 0;
}
ncclResult_t ncclGroupStart(void) { group_depth++; return 0; }
/* Out-pointers of windows registered inside the group, written at its end as NCCL does. */
static __thread void **deferred_windows[64];
static __thread int deferred_windows_len;
ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) return 4;
    if (--group_depth == 0) {
        for (int i = 0; i < grouped_len; i++) stand_in_log("nccl", grouped[i], 0, 0);
        grouped_len = 0;
        for (int i = 0; i < deferred_windows_len; i++) {
            *deferred_windows[i] = malloc(1);
            stand_in_log("windowwritten", deferred_windows[i], 0, 0);
        }
        deferred_windows_len = 0;
    }
    return 0;
}
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int t, int op, void *c, void *stream) { return launch(stream); }
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int t, void *c, void *stream) { return launch(stream); }
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, void *c, void *stream) { return launch(stream); }
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int t, int root, void *c, void *stream) { return launch(stream); }
ncclResult_t ncclSend(const void *s, size_t n, int t, int peer, void *c, void *stream) { return launch(stream); }
ncclResult_t ncclRecv(void *r, size_t n, int t, int peer, void *c, void *stream) { return launch(stream); }

ncclResult_t ncclCommRegister(void *c, void *buffer, size_t size, void **handle) {
    stand_in_log("register", buffer, (void *)(uintptr_t)size, 0);
    *handle = malloc(1);
    return 0;
}
ncclResult_t ncclCommDeregister(void *c, void *handle) {
    stand_in_log("deregister", handle, 0, 0);
    free(handle);
    return 0;
}
/* Aligned as NCCL's VMM memory is (to its granularity), so that windows may be registered. */
ncclResult_t ncclMemAlloc(void **ptr, size_t size) { return posix_memalign(ptr, 4096, size ? size : 1) ? 1 : 0; }
ncclResult_t ncclMemFree(void *ptr) { stand_in_log("ncclmemfree", ptr, 0, 0); free(ptr); return 0; }
int no_symmetric_next;
ncclResult_t ncclCommWindowRegister(void *c, void *buffer, size_t size, void **window, int flags) {
    if (no_symmetric_next) {
        no_symmetric_next = 0;
        *window = NULL;
        stand_in_log("windownone", buffer, (void *)(uintptr_t)size, flags);
        return 0;
    }
    if (group_depth > 0) {
        if (deferred_windows_len == 64) return 3;
        deferred_windows[deferred_windows_len++] = window;
        stand_in_log("windowdeferred", window, 0, 0);
        return 0;
    }
    stand_in_log("windowregister", buffer, (void *)(uintptr_t)size, flags);
    *window = malloc(1);
    return 0;
}
ncclResult_t ncclCommWindowDeregister(void *c, void *window) {
    stand_in_log("windowderegister", window, 0, 0);
    free(window);
    return 0;
}
