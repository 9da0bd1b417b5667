//! The cache under CUDA graph capture on the real driver: a capturing stream
//! is never served a cached block, a free during the capture never enters the cache, and a block
//! handed out during a capture stays out of the cache when it is freed after the capture, on
//! another stream. The capture is begun with the raw driver, as code outside the library would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUdeviceptr};
use cumempool::{Event, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, Statistics, StreamOrderedResource};
use cumempool_tests::{gpu, graph_memory_lock};

const BLOCK: usize = 1 << 20;

fn check(result: sys::CUresult, what: &str) {
    assert_eq!(result, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// Begins a relaxed capture on `stream`, marking it first as code that captures must.
fn begin_capture(stream: &Stream) {
    stream.note_capture_possible();
    let begin = sys::driver().unwrap().cuStreamBeginCapture().unwrap();
    check(
        // SAFETY: a live stream that does not capture.
        unsafe { begin(stream.as_raw(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) },
        "cuStreamBeginCapture",
    );
}

/// Ends the capture on `stream` and instantiates its graph: (graph, executable).
fn end_capture(stream: &Stream) -> (sys::CUgraph, sys::CUgraphExec) {
    let driver = sys::driver().unwrap();
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun on this thread; a valid out-pointer.
    check(unsafe { driver.cuStreamEndCapture().unwrap()(stream.as_raw(), &mut graph) }, "cuStreamEndCapture");
    let mut exec = std::ptr::null_mut();
    // SAFETY: the graph just captured; a valid out-pointer.
    check(unsafe { driver.cuGraphInstantiateWithFlags().unwrap()(&mut exec, graph, 0) }, "cuGraphInstantiate");
    (graph, exec)
}

fn launch(exec: sys::CUgraphExec, stream: &Stream) {
    // SAFETY: an executable from `end_capture`, not yet destroyed, and a live stream.
    check(unsafe { sys::driver().unwrap().cuGraphLaunch().unwrap()(exec, stream.as_raw()) }, "cuGraphLaunch");
}

fn destroy(graph: sys::CUgraph, exec: sys::CUgraphExec) {
    let driver = sys::driver().unwrap();
    // SAFETY: the executable from `end_capture`, destroyed once.
    check(unsafe { driver.cuGraphExecDestroy().unwrap()(exec) }, "cuGraphExecDestroy");
    // SAFETY: the graph from `end_capture`, destroyed once.
    check(unsafe { driver.cuGraphDestroy().unwrap()(graph) }, "cuGraphDestroy");
}

fn fill(dst: CUdeviceptr, value: u8, bytes: usize, stream: &Stream) {
    let f = sys::driver().unwrap().cuMemsetD8Async().unwrap();
    // SAFETY: callers pass a live allocation of at least `bytes` bytes, and a live stream.
    check(unsafe { f(dst, value, bytes, stream.as_raw()) }, "cuMemsetD8Async");
}

fn copy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: &Stream) {
    let f = sys::driver().unwrap().cuMemcpyAsync().unwrap();
    // SAFETY: callers pass live device memory of at least `bytes` bytes at both ends, and a live stream.
    check(unsafe { f(dst, src, bytes, stream.as_raw()) }, "cuMemcpyAsync");
}

/// Three blocks cached on `stream` (the shared lists, then this thread's lane): their addresses.
fn cache_three<R: StreamOrderedResource>(cache: &CachingResource<R>, stream: &Stream) -> [CUdeviceptr; 3] {
    let blocks = [(); 3].map(|()| cache.allocate(BLOCK, 256, stream).unwrap());
    for ptr in blocks {
        // SAFETY: each block was allocated above with these arguments and is freed once.
        unsafe { cache.deallocate(ptr, BLOCK, 256, stream) }.unwrap();
    }
    blocks
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_captured_allocation_fill_copy_and_free_never_touch_the_cached_blocks() {
    let context = gpu().expect("a GPU");
    let _graph_memory = graph_memory_lock(); // its launches allocate graph memory
    let stream = Stream::new(&context).unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(Statistics::new(PoolResource::<DeviceMemory>::new(&pool).unwrap()));
    let cached = cache_three(&cache, &stream);
    let out = pool.alloc_raw(BLOCK, &stream).unwrap();
    fill(out, 0, BLOCK, &stream);
    stream.synchronize().unwrap();

    begin_capture(&stream);
    let during = cache.allocate(BLOCK, 256, &stream).unwrap();
    assert!(!cached.contains(&during), "a cached block was handed to the capture");
    fill(during, 0x5a, BLOCK, &stream);
    copy(out, during, BLOCK, &stream);
    // SAFETY: allocated above in this capture with these arguments, freed once (a free node).
    unsafe { cache.deallocate(during, BLOCK, 256, &stream) }.unwrap();
    let (graph, exec) = end_capture(&stream);
    assert_eq!(cache.stats().cached_blocks, 3, "the free during the capture was cached");

    for _ in 0..2 {
        launch(exec, &stream);
    }
    stream.synchronize().unwrap();
    let mut host = vec![0u8; BLOCK];
    let to_host = sys::driver().unwrap().cuMemcpyDtoHAsync().unwrap();
    // SAFETY: `host` and `out` hold `BLOCK` bytes each; `host` is read after the stream synchronises.
    check(unsafe { to_host(host.as_mut_ptr().cast(), out, BLOCK, stream.as_raw()) }, "cuMemcpyDtoHAsync");
    stream.synchronize().unwrap();
    assert!(host.iter().all(|&b| b == 0x5a), "the replays wrote the captured block and copied it out");
    // After the capture the cache serves its own blocks again, untouched by the replays.
    let again = cache.allocate(BLOCK, 256, &stream).unwrap();
    assert!(cached.contains(&again));
    // SAFETY: `again` was allocated above with these arguments, freed once.
    unsafe { cache.deallocate(again, BLOCK, 256, &stream) }.unwrap();
    destroy(graph, exec);
    // SAFETY: `out` came from `alloc_raw` on this stream and is freed once.
    unsafe { cumempool::free_async(out, &stream) }.unwrap();
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_block_allocated_during_a_capture_and_freed_after_it_elsewhere_goes_below() {
    let context = gpu().expect("a GPU");
    let _graph_memory = graph_memory_lock(); // its launches allocate graph memory
    let (stream, other) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(Statistics::new(PoolResource::<DeviceMemory>::new(&pool).unwrap()));
    cache_three(&cache, &stream);
    cache_three(&cache, &other);

    begin_capture(&stream);
    // Not a class size: a free counted as a class block would show in the statistics below.
    let bytes = BLOCK - 1000;
    let during = cache.allocate(bytes, 256, &stream).unwrap();
    fill(during, 0x17, bytes, &stream);
    let (graph, exec) = end_capture(&stream);
    launch(exec, &stream);
    let in_use = cache.inner().usage().current_bytes;
    // Freed outside the graph, on another stream ordered after the launch.
    let launched = Event::new(&context).unwrap();
    launched.record(&stream).unwrap();
    other.wait(&launched).unwrap();
    // SAFETY: allocated above with these arguments, freed once; `other` is ordered after the launch.
    unsafe { cache.deallocate(during, bytes, 256, &other) }.unwrap();
    assert_eq!(cache.inner().usage().current_bytes, in_use - bytes, "the free went below as it was asked for");
    assert_eq!(cache.stats().cached_blocks, 6, "graph memory entered the cache");
    other.synchronize().unwrap();
    // Freed, so the graph may be launched again; this launch's block is freed below directly.
    launch(exec, &stream);
    // SAFETY: the second launch's allocation, which no free node frees; freed once, after the launch.
    unsafe { cumempool::free_async(during, &stream) }.unwrap();
    stream.synchronize().unwrap();
    destroy(graph, exec);
}
