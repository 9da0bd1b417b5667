//! Allocating through a resource on a stream that captures into a graph, on a host without a
//! GPU, through the stand-in libcuda of `cumempool_tests::stand_in_driver`: the safe
//! `StreamOrderedResource::alloc` is refused there (its `Allocation` could leave the capture
//! holding graph memory; the raw `allocate`/`deallocate` keep serving captures, which the
//! stand-in does not model), and a VMM arena neither hands a capture its spans nor lets a free
//! during a capture stop its later allocations.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{Error as PoolError, MemPool, Route, Stream};
use cumempool_alloc::{
    Arena, CachingResource, DeviceMemory, Error, Limit, PoolResource, Statistics, StreamOrderedResource,
};
use cumempool_tests::stand_in_driver::{call_log, stand_in};
use cumempool_tests::{begin_foreign_capture, end_foreign_capture};

const CHUNK: usize = 2 << 20;

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

/// An arena's span is not graph memory: allocated on a capturing stream, the captured work that
/// uses it would run again at each launch, after the span may have been freed and handed out
/// again. The arena refuses (through `alloc` and `allocate`, and so through a cache above it),
/// and a refused allocation inside `Stream::capture` leaves later allocations working.
#[test]
fn an_arena_refuses_to_allocate_on_a_capturing_stream() {
    let Some((_serial, context)) = stand_in() else { return };
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let cache = CachingResource::new(&arena);
    let stream = Stream::new(&context).unwrap();
    let mut answers = Vec::new();
    let graph = stream.capture(|capture| {
        answers.push(arena.alloc(4096, capture.stream()).map(drop));
        answers.push(arena.allocate(4096, 256, capture.stream()).map(|_| ()));
        answers.push(cache.allocate(4096, 256, capture.stream()).map(|_| ()));
        Ok(())
    });
    assert!(graph.is_ok(), "the refusals left the capture intact: {:?}", graph.err());
    for (layer, answer) in ["Arena::alloc", "Arena::allocate", "a cache over the arena"].iter().zip(&answers) {
        assert!(answer.as_ref().is_err_and(is_capturing_refusal), "{layer}: {answer:?}");
    }
    assert_eq!(arena.stats().in_use, 0);
    drop(arena.alloc(4096, &stream).unwrap());
    drop(arena.alloc(4096, &stream).unwrap());
}

/// A span freed on a stream other code captures (a cache over the arena under PyTorch's graph
/// capture, say): an event recorded there would be recorded into the capture, and every later
/// query of it answers CUDA_ERROR_CAPTURED_EVENT, which stopped every later allocation of the
/// arena. The free waits for the capture to end instead, then for the stream's work.
#[test]
fn a_free_on_a_capturing_stream_never_stops_the_arenas_later_allocations() {
    let Some((_serial, context)) = stand_in() else { return };
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let stream = Stream::new(&context).unwrap();
    let other = Stream::new(&context).unwrap();
    let ptr = arena.allocate(4096, 256, &stream).unwrap();
    begin_foreign_capture(&stream);
    // SAFETY: allocated above with these arguments, unused, freed once.
    let freed = unsafe { arena.deallocate(ptr, 4096, 256, &stream) };
    let during = arena.allocate(4096, 256, &other);
    let stats_during = arena.stats();
    let ended = end_foreign_capture(&stream);
    freed.unwrap();
    assert_eq!(ended, CUresult::CUDA_SUCCESS, "nothing disturbed the capture");
    let during = during.expect("another stream's allocation during the capture");
    assert_ne!(during, ptr, "the span freed into the capture is not free while the capture lasts");
    assert_eq!(stats_during.pending_frees, 1);
    for _ in 0..3 {
        let after = arena.allocate(4096, 256, &stream).expect("allocations after the capture");
        // SAFETY: allocated just above with these arguments, unused, freed once.
        unsafe { arena.deallocate(after, 4096, 256, &stream) }.unwrap();
    }
    // SAFETY: allocated above with these arguments, unused, freed once.
    unsafe { arena.deallocate(during, 4096, 256, &other) }.unwrap();
    assert_eq!(arena.trim().unwrap(), CHUNK, "every free came back, and the chunk with them");
    assert_eq!(arena.stats().pending_frees, 0);
}

/// An arena dropped inside a capture closure (of a stream it has nothing to do with) while a
/// free is still pending: its drop must wait for that free's stream before it unmaps the range,
/// with a wait that the closure cannot refuse; a refused wait left the range mapped for the
/// process's life.
#[test]
fn an_arena_dropped_inside_a_capture_closure_waits_for_its_pending_frees_and_unmaps() {
    let Some((_serial, context)) = stand_in() else { return };
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let (stream, other) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let ptr = arena.allocate(4096, 256, &stream).unwrap();
    // SAFETY: allocated above with these arguments, unused, freed once.
    unsafe { arena.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    assert_eq!(arena.stats().pending_frees, 1);
    let start = call_log().len();
    let graph = other.capture(|_| {
        drop(arena);
        Ok(())
    });
    let log = call_log()[start..].to_owned();
    assert!(graph.is_ok(), "{:?}", graph.err());
    let waited = log.lines().position(|call| call.starts_with("eventsync ") && call.ends_with(" 0"));
    let freed = log.lines().position(|call| call.starts_with("addressfree "));
    assert!(
        waited.is_some() && freed.is_some() && waited < freed,
        "the range was not unmapped after a wait for the pending free:\n{log}"
    );
}

/// A free of an address the arena never handed out is refused before anything reaches the
/// stream: no event is recorded there for it.
#[test]
fn a_free_of_an_address_not_from_the_arena_queues_nothing() {
    let Some((_serial, context)) = stand_in() else { return };
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let stream = Stream::new(&context).unwrap();
    let start = call_log().len();
    // SAFETY: refused; the arena touches nothing at that address.
    let freed = unsafe { arena.deallocate(0x1234_5000, 4096, 256, &stream) };
    let log = call_log()[start..].to_owned();
    assert!(matches!(freed, Err(Error::NotFromArena { ptr: 0x1234_5000 })), "{freed:?}");
    assert!(log.is_empty(), "the refused free reached the driver:\n{log}");
}

/// A captured allocation whose free node the driver refuses (the stand-in refuses every free on
/// a capturing stream): launched, the graph would leave that allocation allocated after the
/// executable is gone, so the capture answers the refusal and gives no graph.
#[test]
fn a_capture_whose_free_node_is_refused_gives_no_graph() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let stream = Stream::new(&context).unwrap();
    let address = std::cell::Cell::new(0);
    let graph = stream.capture(|capture| {
        let scratch = capture.alloc(&pool, 4096)?;
        address.set(scratch.as_raw());
        capture.fill(&scratch, 1)
    });
    let Err(PoolError::Driver(cause)) = &graph else { panic!("{graph:?}") };
    assert!(cause.to_string().contains("cuMemFreeAsync"), "{cause}");
    // The stand-in's allocation node is a heap block it counts, which no graph destroy frees
    // (a driver's would never have been allocated): freed here for the other tests' counts.
    // SAFETY: the stand-in's block, freed once, on a stream that no longer captures.
    unsafe { cumempool::free_async(address.get(), &stream) }.unwrap();
}

/// A capture other code begins on a stream it lent between an arena free's check of that
/// stream and the event the free records: the event lands in the capture, and every query of
/// it answers CUDA_ERROR_CAPTURED_EVENT, which kept the span pending for good (and the range
/// mapped at the arena's drop). Such a free waits for the capture's end instead, as one made
/// during the capture does.
#[test]
fn a_free_whose_event_a_capture_took_comes_back_once_the_capture_ends() {
    let Some((_serial, context)) = stand_in() else { return };
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let lender = Box::leak(Box::new(Stream::new(&context).unwrap()));
    // SAFETY: `lender` is never dropped.
    let stream = unsafe { Stream::borrow_raw(lender.as_raw(), Some(&context)) }.unwrap();
    let ptr = arena.allocate(4096, 256, &stream).unwrap();
    cumempool_tests::stand_in_driver::set_switch("capture_on_next_record");
    // SAFETY: allocated above with these arguments, unused, freed once.
    unsafe { arena.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    assert_eq!(arena.stats().pending_frees, 1);
    assert_eq!(end_foreign_capture(&stream), CUresult::CUDA_SUCCESS, "the free disturbed the capture");
    assert_eq!(arena.trim().unwrap(), CHUNK, "the span came back once the capture ended, and its chunk with it");
    assert_eq!(arena.stats().pending_frees, 0);
}

/// Below a cache, a capture begun on the stream after the cache asked whether it captures and
/// ended before the block reaches the cache (another thread's, or an out-of-memory callback's
/// code, can do that): the pool's block is graph memory the cache never saw allocated during a
/// capture.
struct CaptureAroundTheAllocation<'r>(&'r PoolResource<DeviceMemory>);

// SAFETY: forwards to the pool's resource, which keeps the promise.
unsafe impl StreamOrderedResource for CaptureAroundTheAllocation<'_> {
    type Kind = DeviceMemory;

    fn allocate(
        &self,
        bytes: usize,
        align: usize,
        stream: &Stream,
    ) -> cumempool_alloc::Result<cumempool::sys::CUdeviceptr> {
        begin_foreign_capture(stream);
        let allocated = self.0.allocate(bytes, align, stream);
        assert_eq!(end_foreign_capture(stream), CUresult::CUDA_SUCCESS);
        allocated
    }

    unsafe fn deallocate(
        &self,
        ptr: cumempool::sys::CUdeviceptr,
        bytes: usize,
        align: usize,
        stream: &Stream,
    ) -> cumempool_alloc::Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.0.deallocate(ptr, bytes, align, stream) }
    }
}

/// Graph memory is never kept by a cache, however it came to hold it: the graph uses the
/// address at every launch, while the cache would hand it to others.
#[test]
fn a_cache_never_keeps_graph_memory_a_capture_begun_after_its_question_made() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let cache = CachingResource::new(CaptureAroundTheAllocation(&resource));
    let stream = Stream::new(&context).unwrap();
    stream.note_capture_possible();
    let ptr = cache.allocate(4096, 256, &stream).unwrap();
    assert!(cumempool::is_captured_allocation(ptr), "the pool allocated it into the capture");
    // SAFETY: allocated just above with these arguments, freed once, never used.
    unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    assert_eq!(cache.stats().cached_blocks, 0, "graph memory went below, not into the cache");
}

/// The same capture, through the safe `alloc`: the `Allocation` would hold graph memory, so it
/// is refused, and the memory given back.
#[test]
fn alloc_refuses_graph_memory_a_capture_begun_after_its_question_made() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let below = CaptureAroundTheAllocation(&resource);
    let cache = CachingResource::new(&below);
    let stream = Stream::new(&context).unwrap();
    stream.note_capture_possible();
    for (layer, allocated) in
        [("the resource", below.alloc(4096, &stream).map(drop)), ("a cache", cache.alloc(4096, &stream).map(drop))]
    {
        let error = allocated.err().unwrap_or_else(|| panic!("{layer}: an Allocation held graph memory"));
        assert!(is_capturing_refusal(&error), "{layer}: {error:?}");
    }
    assert_eq!(cache.stats().cached_blocks, 0);
}

/// The same capture, through `allocate_unless_capturing` at every layer: a capture took the
/// memory, so the answer is `None`, as for a capture underway at the question, and the memory
/// is given back; the caller never holds graph memory it did not ask for.
#[test]
fn allocate_unless_capturing_answers_none_for_graph_memory_a_capture_begun_inside_it_made() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let resource = PoolResource::<DeviceMemory>::new(&pool).unwrap();
    let below = CaptureAroundTheAllocation(&resource);
    let cache = CachingResource::new(&below);
    let statistics = Statistics::new(&cache);
    let limit = Limit::new(&below, 1 << 20);
    let stream = Stream::new(&context).unwrap();
    stream.note_capture_possible();
    let answers = [
        ("the resource", below.allocate_unless_capturing(4096, 256, &stream)),
        ("a cache", cache.allocate_unless_capturing(4096, 256, &stream)),
        ("statistics above a cache", statistics.allocate_unless_capturing(4096, 256, &stream)),
        ("a limit", limit.allocate_unless_capturing(4096, 256, &stream)),
    ];
    for (layer, answer) in answers {
        assert_eq!(answer.unwrap(), None, "{layer}: served graph memory");
    }
    assert_eq!(pool.used_mem_current().unwrap(), 0, "every graph allocation was given back");
    assert_eq!((statistics.usage().current_count, limit.in_use(), cache.stats().cached_blocks), (0, 0, 0));
}
