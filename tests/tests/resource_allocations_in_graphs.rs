//! Allocating through a resource on a stream that captures into a graph, on the GPU: nothing a
//! capture allocates is left holding graph memory after the graph is gone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, StreamOrderedResource};
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
