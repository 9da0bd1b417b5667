// Probe: destroying pools that were a route's current pool while other threads allocate through
// the route (driver API only). One run per process; run it several times:
//   nvcc -O2 tests/probes/teardown.c -o /tmp/teardown -lcuda -lpthread
//   for i in $(seq 10); do /tmp/teardown; echo "exit $?"; done
// Argument `late`: destroy the pools only after the allocating threads stopped.
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static CUcontext ctx;
static volatile int stop = 0;
static int late = 0;
static CUmemoryPool made[8][200];

static void* allocate(void* arg) {
  (void)arg;
  CUstream s;
  cuCtxSetCurrent(ctx);
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  cuCtxSetCurrent(NULL);  // the stream names its context; nothing current on this thread
  long pairs = 0;
  while (!stop) {
    CUdeviceptr p;
    if (cuMemAllocAsync(&p, 4096, s) == CUDA_SUCCESS) cuMemFreeAsync(p, s);
    if (++pairs % 1024 == 0) cuStreamSynchronize(s);
  }
  cuStreamSynchronize(s);
  return NULL;
}

static void* route(void* arg) {
  long me = (long)arg;
  CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location = loc;
  CUmemoryPool fallback;
  cuMemGetDefaultMemPool(&fallback, &loc, CU_MEM_ALLOCATION_TYPE_PINNED);
  for (int i = 0; i < 200; i++) {
    CUmemoryPool pool;
    if (cuMemPoolCreate(&pool, &props) != CUDA_SUCCESS) { made[me][i] = 0; continue; }
    cuMemSetMemPool(&loc, CU_MEM_ALLOCATION_TYPE_PINNED, pool);
    cuMemSetMemPool(&loc, CU_MEM_ALLOCATION_TYPE_PINNED, fallback);
    if (late) made[me][i] = pool; else cuMemPoolDestroy(pool);
  }
  return NULL;
}

int main(int argc, char** argv) {
  late = argc > 1 && strcmp(argv[1], "late") == 0;
  CUdevice dev;
  cuInit(0);
  cuDeviceGet(&dev, 0);
  cuDevicePrimaryCtxRetain(&ctx, dev);
  pthread_t a[4], r[8];
  for (long i = 0; i < 4; i++) pthread_create(&a[i], NULL, allocate, NULL);
  for (long i = 0; i < 8; i++) pthread_create(&r[i], NULL, route, (void*)i);
  for (int i = 0; i < 8; i++) pthread_join(r[i], NULL);
  stop = 1;
  for (int i = 0; i < 4; i++) pthread_join(a[i], NULL);
  if (late)
    for (int t = 0; t < 8; t++)
      for (int i = 0; i < 200; i++)
        if (made[t][i]) cuMemPoolDestroy(made[t][i]);
  printf("done (%s)\n", late ? "destroyed after the allocating threads stopped" : "destroyed at once");
  return 0;
}
