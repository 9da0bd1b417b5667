// Probe: does a pool keep memory reserved for an initial size (allocate, free, synchronise)
// under a release threshold? Prints the pool's reserved bytes after each step.
//   nvcc -O2 tests/probes/reserve.c -o /tmp/reserve -lcuda && /tmp/reserve
#include <cuda.h>
#include <stdio.h>
#include <string.h>
static CUmemoryPool pool;
static void show(const char* when) {
  cuuint64_t reserved = 0, threshold = 0;
  cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved);
  cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold);
  printf("  %-34s reserved %10llu  threshold %llu\n", when, (unsigned long long)reserved, (unsigned long long)threshold);
}
int main() {
  CUdevice dev; CUcontext ctx;
  cuInit(0); cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&ctx, dev); cuCtxSetCurrent(ctx);
  for (int variant = 0; variant < 6; variant++) {
    CUmemPoolProps p; memset(&p, 0, sizeof p);
    p.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = (variant < 2 || variant >= 4) ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST;
    p.location.id = 0;
    cuMemPoolCreate(&pool, &p);
    int early = variant % 2 == 0;  // threshold before the allocation, or while it is live
    if (variant >= 4) {            // the opportunistic and internal-dependency reuse policies off
      int off = 0;
      cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, &off);
      cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, &off);
    }
    printf("%s pool%s, threshold set %s:\n", (variant < 2 || variant >= 4) ? "device" : "host",
           variant >= 4 ? " (opportunistic and internal-dependency reuse off)" : "", early ? "before allocating" : "while allocated");
    cuuint64_t want = 64 << 20;
    if (early) cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &want);
    CUstream s; cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
    CUdeviceptr ptr; CUresult r = cuMemAllocFromPoolAsync(&ptr, 64 << 20, pool, s);
    printf("  alloc -> %d\n", r);
    show("allocated");
    if (!early) {
      cuuint64_t reserved = 0;
      cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved);
      cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &reserved);
    }
    cuMemFreeAsync(ptr, s); show("freed (async)");
    cuStreamSynchronize(s); show("stream synchronised");
    cuStreamDestroy(s); show("stream destroyed");
    cuCtxSynchronize(); show("context synchronised");
    cuMemPoolDestroy(pool);
  }
  return 0;
}
