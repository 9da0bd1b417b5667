//! A VMM arena's span freed on a stream of a context other than the arena's (feature `cudarc`,
//! for a non-primary context from safe code).
#![cfg(feature = "cudarc")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudarc::driver::CudaContext;
use cumempool::Stream;
use cumempool_alloc::{Arena, StreamOrderedResource};
use cumempool_tests::gpu;

/// An event of the arena's (primary) context cannot be recorded on a stream of another context
/// (CUDA_ERROR_INVALID_HANDLE): the free failed and the span stayed live for the arena's life.
/// The free succeeds, and the span comes back, once that stream has passed it.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_span_freed_on_a_stream_of_another_context_comes_back() {
    let context = gpu().expect("a GPU");
    let arena = Arena::builder(0, 64 << 20).build().unwrap();
    let home = Stream::new(&context).unwrap();
    let other_context = CudaContext::new_non_primary(0, 0).unwrap();
    let other_stream = other_context.new_stream().unwrap();
    let foreign = Stream::from_cudarc(&other_stream).unwrap();
    assert!(foreign.context().is_none(), "a context cumempool does not know");
    context.make_current().unwrap();
    let ptr = arena.allocate(4096, 256, &home).unwrap();
    home.synchronize().unwrap();
    // SAFETY: allocated above with these arguments, unused, freed once.
    let freed = unsafe { arena.deallocate(ptr, 4096, 256, &foreign) };
    assert!(freed.is_ok(), "{freed:?}");
    context.make_current().unwrap();
    assert_eq!(arena.stats().in_use, 0, "the span is no longer live");
    let again = arena.allocate(4096, 256, &home).unwrap();
    assert_eq!(again, ptr, "the span came back to the free list");
    // SAFETY: allocated just above with these arguments, unused, freed once.
    unsafe { arena.deallocate(again, 4096, 256, &home) }.unwrap();
}
