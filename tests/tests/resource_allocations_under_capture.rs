//! Allocating through a resource on a stream that captures into a graph, on a host without a
//! GPU, through the stand-in libcuda of `cumempool_tests::stand_in_driver`: the safe
//! `StreamOrderedResource::alloc` is refused there (its `Allocation` could leave the capture
//! holding graph memory; the raw `allocate`/`deallocate` keep serving captures, which the
//! stand-in does not model).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Error as PoolError, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, Error, PoolResource, StreamOrderedResource};
use cumempool_tests::stand_in_driver::stand_in;

/// Whether `error` is the refusal of a capturing stream.
fn is_capturing_refusal(error: &Error) -> bool {
    matches!(error, Error::Pool(PoolError::StreamCapturing { .. }))
}

/// An `Allocation` made inside a capture closure and kept past it would hold an allocation
/// node's address with no free node: dropped before a launch its free is refused and each
/// launch allocates memory nothing frees; dropped after one it is freed unordered with the
/// launch. So `alloc` refuses a capturing stream, and nothing is left allocated or captured.
#[test]
fn a_resource_alloc_on_a_capturing_stream_is_refused_and_leaves_nothing_behind() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let cache = CachingResource::new(&resource);
    let stream = Stream::new(&context).unwrap();
    let (mut from_resource, mut from_cache) = (None, None);
    let graph = stream.capture(|capture| {
        from_resource = Some(resource.alloc(4096, capture.stream()));
        from_cache = Some(cache.alloc(4096, capture.stream()));
        Ok(())
    });
    assert!(graph.is_ok(), "the refusal left the capture intact: {:?}", graph.err());
    let refusals = [("the pool resource", from_resource.unwrap().err()), ("a cache", from_cache.unwrap().err())];
    for (layer, refusal) in refusals {
        let error = refusal.unwrap_or_else(|| panic!("{layer}: an allocation holding graph memory left its capture"));
        assert!(is_capturing_refusal(&error), "{layer}: {error:?}");
        assert!(error.to_string().contains("Capture::alloc"), "{layer}: says what to use instead: {error}");
    }
    assert_eq!(pool.used_mem_current().unwrap(), 0, "nothing was allocated for the refused calls");
    // Outside the capture the same call serves.
    let allocation = cache.alloc(4096, &stream).unwrap();
    assert!(!cumempool::is_captured_allocation(allocation.as_raw()));
}
