//! Allocating through a resource on a stream that captures into a graph, on the GPU: nothing a
//! capture allocates is left holding graph memory after the graph is gone, and a VMM arena's
//! free during a capture never stops its later allocations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{MemPool, Route, Stream};
use cumempool_alloc::{Arena, CachingResource, DeviceMemory, PoolResource, StreamOrderedResource};
use cumempool_tests::gpu;
use cumempool_tests::graph_memory::GraphMemoryBaseline;

const MIB: usize = 1 << 20;

/// A safe `Allocation` made inside a capture closure and kept past it would hold graph memory
/// with no free node: dropped before the launch its free is refused, and the memory the launch
/// allocates is never given back. `alloc` refuses the capturing stream instead.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_resource_allocation_cannot_leave_its_capture_holding_graph_memory() {
    let context = gpu().expect("a GPU");
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    let stream = Stream::new(&context).unwrap();
    let baseline = GraphMemoryBaseline::take(&stream);
    let mut escaped = None;
    let graph = stream
        .capture(|capture| {
            escaped = Some(cache.alloc(MIB, capture.stream()));
            Ok(())
        })
        .unwrap();
    let escaped = escaped.unwrap();
    assert!(escaped.is_err(), "a safe allocation holding graph memory left its capture");
    drop(escaped);
    let mut exec = graph.instantiate().unwrap();
    exec.launch(&stream).unwrap();
    drop(exec);
    drop(graph);
    baseline.assert_given_back(&stream, "graph memory leaked");
}

/// A cache over an arena, its block freed on a stream while that stream is captured: the
/// arena's event for the free would be recorded into the capture, and querying it answers
/// CUDA_ERROR_CAPTURED_EVENT at every later allocation, for good. The free waits for the
/// capture's end instead, and allocating from the arena during the capture is refused.
#[test]
#[ignore = "requires a CUDA GPU"]
fn an_arena_free_during_a_capture_never_stops_its_later_allocations() {
    let context = gpu().expect("a GPU");
    let arena = Arena::builder(0, 64 * MIB).build().unwrap();
    let stream = Stream::new(&context).unwrap();
    let before = arena.allocate(MIB, 256, &stream).unwrap();
    let graph = stream
        .capture(|capture| {
            assert!(arena.allocate(MIB, 256, capture.stream()).is_err(), "a span is not graph memory");
            assert!(arena.alloc(MIB, capture.stream()).is_err(), "a span is not graph memory");
            // SAFETY: allocated above with these arguments, unused, freed once.
            unsafe { arena.deallocate(before, MIB, 256, capture.stream()) }.unwrap();
            Ok(())
        })
        .unwrap();
    drop(graph);
    for _ in 0..3 {
        let after = arena.allocate(MIB, 256, &stream).expect("allocations after the capture");
        // SAFETY: allocated just above with these arguments, unused, freed once.
        unsafe { arena.deallocate(after, MIB, 256, &stream) }.unwrap();
    }
    stream.synchronize().unwrap();
    arena.trim().unwrap();
    assert_eq!(arena.stats().pending_frees, 0, "every free came back");
}
