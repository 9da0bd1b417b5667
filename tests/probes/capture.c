// Probe: what the driver does around stream capture (driver API only).
#include <cuda.h>
#include <stdio.h>
#include <time.h>
#define R(x) do { CUresult r_ = (x); const char* n_ = 0; cuGetErrorName(r_, &n_); printf("%-70s -> %s\n", #x, n_ ? n_ : "?"); } while (0)
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main() {
  CUdevice dev; CUcontext ctx; CUstream s, s2; CUmemoryPool pool;
  cuInit(0); cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&ctx, dev); cuCtxSetCurrent(ctx);
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING); cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING);
  cuDeviceGetDefaultMemPool(&pool, dev);
  // 1. cost of capture queries
  CUstreamCaptureStatus st; cuuint64_t id; int N = 1000000;
  double t0 = now(); for (int i = 0; i < N; i++) cuStreamIsCapturing(s, &st); double t1 = now();
  for (int i = 0; i < N; i++) cuStreamGetCaptureInfo(s, &st, &id, 0, 0, 0, 0); double t2 = now();
  printf("cuStreamIsCapturing %.1f ns, cuStreamGetCaptureInfo %.1f ns per call\n", (t1-t0)/N*1e9, (t2-t1)/N*1e9);
  // 2. free of outside memory during capture
  CUdeviceptr outside; R(cuMemAllocFromPoolAsync(&outside, 1<<20, pool, s)); cuStreamSynchronize(s);
  R(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  R(cuMemFreeAsync(outside, s));
  cuStreamGetCaptureInfo(s, &st, &id, 0, 0, 0, 0); printf("status after outside free: %d\n", st);
  CUgraph g; R(cuStreamEndCapture(s, &g));
  cuStreamGetCaptureInfo(s, &st, &id, 0, 0, 0, 0); printf("status after end: %d\n", st);
  // 2b. sync calls during capture
  R(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  R(cuStreamQuery(s2));
  R(cuStreamSynchronize(s2));
  CUevent e; cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
  R(cuEventRecord(e, s2)); R(cuEventSynchronize(e));
  R(cuStreamQuery(s));
  cuStreamGetCaptureInfo(s, &st, &id, 0, 0, 0, 0); printf("status after sync calls on other streams + query on s: %d\n", st);
  R(cuStreamEndCapture(s, &g)); if (g) cuGraphDestroy(g);
  // 3. alloc without free in a graph
  CUdeviceptr inside = 0;
  R(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  R(cuMemAllocFromPoolAsync(&inside, 1<<20, pool, s));
  R(cuMemsetD8Async(inside, 7, 1<<20, s));
  R(cuStreamEndCapture(s, &g));
  printf("inside = %#llx\n", (unsigned long long)inside);
  R(cuMemFreeAsync(inside, s2)); R(cuStreamSynchronize(s2)); // free before any launch
  CUgraphExec x, xa;
  R(cuGraphInstantiateWithFlags(&x, g, 0));
  R(cuGraphLaunch(x, s)); R(cuStreamSynchronize(s));
  R(cuGraphLaunch(x, s)); R(cuStreamSynchronize(s));
  R(cuMemFreeAsync(inside, s)); R(cuStreamSynchronize(s));
  R(cuGraphLaunch(x, s)); R(cuStreamSynchronize(s));
  R(cuMemFreeAsync(inside, s)); R(cuStreamSynchronize(s));
  R(cuGraphExecDestroy(x));
  R(cuGraphInstantiateWithFlags(&xa, g, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH));
  R(cuGraphLaunch(xa, s)); R(cuStreamSynchronize(s));
  R(cuGraphLaunch(xa, s)); R(cuStreamSynchronize(s));
  cuuint64_t used = 0; cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used); printf("graph used %llu\n", (unsigned long long)used);
  R(cuGraphExecDestroy(xa)); R(cuStreamSynchronize(s));
  cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used); printf("graph used after exec destroy %llu\n", (unsigned long long)used);
  R(cuGraphDestroy(g));
  cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used); printf("graph used after graph destroy %llu\n", (unsigned long long)used);
  R(cuMemFreeAsync(inside, s)); R(cuStreamSynchronize(s));
  cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used); printf("graph used after free %llu\n", (unsigned long long)used);
  // 4. legacy stream capture
  R(cuStreamBeginCapture(0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  // 5. global-mode capture on another thread is not probed here.
  // 6. alloc+free inside, graph launched; pool destroy of created pool used in capture
  CUmemPoolProps p = {0}; p.allocType = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE; p.location.id = 0;
  CUmemoryPool mine; R(cuMemPoolCreate(&mine, &p));
  R(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  R(cuMemAllocFromPoolAsync(&inside, 1<<20, mine, s)); R(cuMemsetD8Async(inside, 7, 1<<20, s)); R(cuMemFreeAsync(inside, s));
  R(cuStreamEndCapture(s, &g)); R(cuGraphInstantiateWithFlags(&x, g, 0));
  R(cuMemPoolDestroy(mine));
  R(cuGraphLaunch(x, s)); R(cuStreamSynchronize(s));
  R(cuGraphLaunch(x, s)); R(cuStreamSynchronize(s));
  R(cuCtxSynchronize());
  return 0;
}
