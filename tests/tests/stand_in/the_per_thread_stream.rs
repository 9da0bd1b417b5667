//! The per-thread default stream served as `Stream::legacy_for_per_thread`, on the stand-in
//! libcuda (which models per-thread streams as blocking streams: legacy-stream work while any
//! thread's per-thread stream captures is refused and invalidates that capture).
//!
//! The per-thread stream is another stream on each thread, so a value serving it is never "the
//! same stream" as another, a cache never hands a block freed on it to another thread, and a
//! free one thread's capture deferred waits for that thread.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUresult, CUstreamCaptureMode};
use cumempool::{Block, Error, MemPool, Placement, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, Limit, PoolResource, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool_tests::stand_in_driver::stand_in;

/// `CU_STREAM_PER_THREAD`.
const PER_THREAD: usize = 2;

/// Begins a thread-local capture of the calling thread's per-thread stream, as CuPy's
/// `Stream.ptds.begin_capture()` does.
pub(crate) fn begin_per_thread_capture() {
    let begin = sys::driver().unwrap().cuStreamBeginCapture().unwrap();
    // SAFETY: the calling thread's per-thread stream, which always exists; not capturing.
    let begun = unsafe { begin(PER_THREAD as sys::CUstream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) };
    assert_eq!(begun, CUresult::CUDA_SUCCESS);
}

/// Ends that capture: the driver's answer (CUDA_SUCCESS unless something invalidated it).
pub(crate) fn end_per_thread_capture() -> CUresult {
    let driver = sys::driver().unwrap();
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun on this thread; a valid out-pointer.
    let ended = unsafe { driver.cuStreamEndCapture().unwrap()(PER_THREAD as sys::CUstream, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph just handed back, destroyed once.
        assert_eq!(unsafe { driver.cuGraphDestroy().unwrap()(graph) }, CUresult::CUDA_SUCCESS);
    }
    ended
}

#[test]
fn the_per_thread_stream_is_never_the_same_stream_as_another() {
    let Some((_serial, context)) = stand_in() else { return };
    let per_thread = Stream::legacy_for_per_thread(&context);
    let legacy = Stream::legacy(&context);
    assert!(!per_thread.same_as(&legacy) && !legacy.same_as(&per_thread));
    assert!(!per_thread.same_as(&per_thread.clone()), "another stream on each thread");
    assert!(per_thread.may_be_capturing(), "every use asks the driver");
}

#[test]
fn a_cache_never_serves_a_block_freed_on_the_per_thread_stream() {
    // Thread A's kernels on its per-thread stream, then a free; thread B's allocation from the
    // cache would be ordered with none of A's work.
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    let per_thread = Stream::legacy_for_per_thread(&context);
    for _ in 0..3 {
        let ptr = cache.allocate(4096, POOL_ALIGNMENT, &per_thread).unwrap();
        // SAFETY: just allocated with these arguments, freed once.
        unsafe { cache.deallocate(ptr, 4096, POOL_ALIGNMENT, &per_thread) }.unwrap();
    }
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.cached_blocks), (0, 0), "nothing cached for the per-thread stream");
    assert_eq!(pool.used_mem_current().unwrap(), 0, "every block went back to the pool");
}

#[test]
fn an_ordering_with_the_per_thread_stream_is_refused_while_it_captures() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let legacy = Stream::legacy(&context);
    let buffer = pool.alloc(4096, &legacy).unwrap();
    let per_thread = Stream::legacy_for_per_thread(&context);
    // SAFETY: `buffer`'s live allocation on `legacy`, freed after the view is gone.
    let block = unsafe { Block::new(buffer.as_raw(), buffer.len(), &legacy, Placement::Device) };
    begin_per_thread_capture();
    let export = block.order_before(&per_thread, "exporting to the per-thread stream");
    let release = block.order_release_after(&per_thread, "closing after the per-thread stream");
    // SAFETY: `buffer`'s live allocation, freed after the view is gone; only refused work is queued through it.
    let fill = unsafe { Block::new(buffer.as_raw(), buffer.len(), &per_thread, Placement::Device) }.fill(0);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    for refused in [export, release, fill] {
        assert!(matches!(refused, Err(Error::StreamCapturing { .. })), "{refused:?}");
    }
    block.order_before(&per_thread, "exporting to the per-thread stream").unwrap();
}

#[test]
fn a_free_one_threads_capture_deferred_waits_for_that_capture() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let per_thread = Stream::legacy_for_per_thread(&context);
    let buffer = pool.alloc_owned(4096, &per_thread).unwrap();
    let used = pool.used_mem_current().unwrap();
    begin_per_thread_capture();
    drop(buffer); // deferred: this thread's per-thread stream captures
                  // Another thread, whose own per-thread stream does not capture, uses the stream: its work
                  // goes to the legacy stream, which this thread's capture (a blocking stream) blocks. It is
                  // refused, and does not run the free there, which would invalidate the capture.
    let other = per_thread.clone();
    let refused =
        std::thread::spawn(move || other.ensure_not_capturing("using the stream on another thread")).join().unwrap();
    assert!(matches!(refused, Err(Error::StreamCapturing { .. })), "{refused:?}");
    assert_eq!(pool.used_mem_current().unwrap(), used, "still deferred");
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    per_thread.ensure_not_capturing("using the stream after the capture").unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), used - 4096, "freed once the capture ended");
}

#[test]
fn the_questions_keeping_the_context_see_a_per_thread_capture_and_leave_it_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let per_thread = Stream::legacy_for_per_thread(&context);
    begin_per_thread_capture();
    assert!(legacy.capture_status_keeping_context().is_err(), "a blocking stream captures");
    assert!(matches!(per_thread.capture_status_keeping_context(), Ok(cumempool::CaptureStatus::Active { .. })));
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "a question invalidated the capture");
}

/// A cache gives blocks back of its own accord: on `release`, and to make room when the layer
/// below refuses an allocation for lack of memory. A block freed on the legacy stream would be
/// freed there, which the driver refuses while a blocking stream captures, invalidating that
/// capture (and the refused block would be lost). So it stays cached until the capture is over.
#[test]
fn a_cache_keeps_its_legacy_stream_blocks_while_a_blocking_stream_captures() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(Limit::new(PoolResource::<DeviceMemory>::new(&pool).unwrap(), 1 << 20));
    let legacy = Stream::legacy(&context);
    let side = Stream::new(&context).unwrap();
    let ptr = cache.allocate(512 << 10, POOL_ALIGNMENT, &legacy).unwrap();
    // SAFETY: just allocated with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 512 << 10, POOL_ALIGNMENT, &legacy) }.unwrap();
    let cached = pool.used_mem_current().unwrap();
    assert!(cached >= 512 << 10, "the block is cached, still the pool's");
    begin_per_thread_capture();
    cache.release().unwrap();
    let refused = cache.allocate(768 << 10, POOL_ALIGNMENT, &side);
    assert!(refused.is_err_and(|error| error.is_out_of_memory()), "no room made from the legacy stream's block");
    assert_eq!(pool.used_mem_current().unwrap(), cached, "the block stayed cached");
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    let ptr = cache.allocate(768 << 10, POOL_ALIGNMENT, &side).unwrap();
    // SAFETY: just allocated with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 768 << 10, POOL_ALIGNMENT, &side) }.unwrap();
    cache.release().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "every block went back once the capture was over");
}

/// A cache dropped while a blocking stream captures has no later moment to give its
/// legacy-stream blocks back: it hands them below all the same, where the pool's free waits for
/// the capture's end (freed on the legacy stream now, the driver would refuse them and
/// invalidate the capture), and the legacy stream's next use frees them: none leaks.
#[test]
fn a_cache_dropped_while_a_blocking_stream_captures_leaves_the_capture_intact_and_leaks_nothing() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool).unwrap());
    let legacy = Stream::legacy(&context);
    let ptr = cache.allocate(512 << 10, POOL_ALIGNMENT, &legacy).unwrap();
    // SAFETY: just allocated with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 512 << 10, POOL_ALIGNMENT, &legacy) }.unwrap();
    begin_per_thread_capture();
    drop(cache);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    legacy.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the block was freed once the capture was over");
}

/// A cache that owns an arena, dropped while a blocking stream captures: the arena's free would
/// wait for the capture's end, and the arena, dropped right after, would then keep its whole
/// range mapped for that pending free. The cache keeps such blocks instead, and the arena
/// releases everything.
#[test]
fn a_cache_owning_an_arena_dropped_beside_a_blocking_capture_leaves_the_arena_free_to_release_its_range() {
    use cumempool_alloc::Arena;
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let arena = Arena::builder(0, 8 << 20).chunk_size(2 << 20).build().unwrap();
    let cache = CachingResource::new(arena);
    let ptr = cache.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap();
    // SAFETY: just allocated with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 4096, POOL_ALIGNMENT, &legacy) }.unwrap();
    let start = cumempool_tests::stand_in_driver::call_log().len();
    begin_per_thread_capture();
    drop(cache);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    let log = cumempool_tests::stand_in_driver::call_log()[start..].to_owned();
    assert!(log.lines().any(|call| call.starts_with("addressfree ")), "the arena's range was never released:\n{log}");
}

/// A resource whose free reaches the driver at once, on the legacy stream while a blocking
/// stream captures, would have the free refused and the capture invalidated: a cache dropped
/// then never hands it such blocks.
#[test]
fn a_cache_dropped_beside_a_blocking_capture_hands_no_legacy_block_to_a_resource_that_frees_at_once() {
    /// Frees straight through the driver, as a user's resource may.
    struct FreesAtOnce(cumempool::Pool);
    // SAFETY: the pool's memory, freed by cuMemFreeAsync.
    unsafe impl StreamOrderedResource for FreesAtOnce {
        type Kind = DeviceMemory;
        fn allocate(&self, bytes: usize, _align: usize, stream: &Stream) -> cumempool_alloc::Result<sys::CUdeviceptr> {
            Ok(self.0.alloc_raw(bytes, stream)?)
        }
        unsafe fn deallocate(
            &self,
            ptr: sys::CUdeviceptr,
            _bytes: usize,
            _align: usize,
            stream: &Stream,
        ) -> cumempool_alloc::Result<()> {
            stream.bind()?;
            let free = sys::driver().unwrap().cuMemFreeAsync().unwrap();
            // SAFETY: the caller's promise.
            let _ = unsafe { free(ptr, stream.as_raw()) };
            Ok(())
        }
    }
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache = CachingResource::new(FreesAtOnce((*pool).clone()));
    let legacy = Stream::legacy(&context);
    let ptr = cache.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap();
    // SAFETY: just allocated with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 4096, POOL_ALIGNMENT, &legacy) }.unwrap();
    begin_per_thread_capture();
    drop(cache);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "dropping the cache invalidated the capture");
    // SAFETY: the block the dropped cache kept, allocated on the legacy stream, freed once (the
    // stand-in's counters are the process's: the other tests find them back at 0).
    unsafe { cumempool::free_async(ptr, &legacy) }.unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}

/// A free deferred on a `Stream` of the `CU_STREAM_LEGACY` handle waits with the context's legacy
/// stream, whatever handle names it: the next use of `Stream::legacy` (handle 0) runs it.
#[test]
fn a_free_deferred_on_the_cu_stream_legacy_handle_runs_at_the_next_use_of_the_legacy_stream() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    // SAFETY: CU_STREAM_LEGACY with its context, valid for the context's life.
    let named_legacy = unsafe { Stream::borrow_raw(1 as sys::CUstream, Some(&context)) }.unwrap();
    let buffer = pool.alloc(4096, &named_legacy).unwrap();
    begin_per_thread_capture();
    drop(buffer); // deferred: a blocking stream captures
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    Stream::legacy(&context).synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the legacy stream's next use left the free waiting");
}

/// A failure of the legacy stream's question other than a capture's (a sticky error of an
/// earlier launch) is the driver's error, not a capture: no capture is reported, and no free is
/// kept waiting for one.
#[test]
fn a_sticky_error_on_the_legacy_stream_is_the_drivers_not_a_capture() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let legacy = Stream::legacy(&context);
    let live_before = pool.used_mem_current().unwrap();
    let buffer = pool.alloc(4096, &legacy).unwrap();
    let ptr = buffer.as_raw();
    cumempool_tests::stand_in_driver::set_sticky_error(700);
    let waited = legacy.synchronize();
    drop(buffer); // its free fails with the error, and is not kept for a capture's end
    cumempool_tests::stand_in_driver::set_sticky_error(0);
    let waiting = Stream::run_orphaned_frees();
    assert!(matches!(&waited, Err(error) if error.cuda_code() == Some(700)), "{waited:?}");
    assert_eq!(waiting, 0, "a free was kept for a capture that is not underway");
    // The stand-in counts live bytes over all pools, so the allocation the failed free left
    // would show in the next test's pool: freed here, the error gone.
    // SAFETY: allocated above; its free failed, so it is freed once, here, and unused after.
    unsafe { cumempool::free_async(ptr, &legacy) }.unwrap();
    legacy.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), live_before, "the test leaves no allocation behind");
}

/// Graph memory (`alloc_raw` during a capture that has ended) freed on the legacy stream while a
/// blocking stream captures is forgotten as a captured allocation, as a free outside a capture
/// forgets it, when its free is deferred.
#[test]
fn a_deferred_legacy_free_of_graph_memory_forgets_its_address() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let side = Stream::new(&context).unwrap();
    cumempool_tests::begin_foreign_capture(&side);
    let ptr = pool.alloc_raw(4096, &side).unwrap();
    assert_eq!(cumempool_tests::end_foreign_capture(&side), CUresult::CUDA_SUCCESS);
    assert!(cumempool::is_captured_allocation(ptr));
    let legacy = Stream::legacy(&context);
    begin_per_thread_capture();
    // SAFETY: allocated above, freed once, unused after.
    unsafe { cumempool::free_async(ptr, &legacy) }.unwrap();
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    legacy.synchronize().unwrap(); // runs the deferred free
    assert_eq!(pool.used_mem_current().unwrap(), 0);
    assert!(!cumempool::is_captured_allocation(ptr), "freed, yet still remembered as captured");
}

/// The ordering primitives queue work on the legacy stream too: beside a blocking stream's
/// capture they are refused before the driver, which would invalidate that capture.
#[test]
fn an_ordering_of_the_legacy_stream_is_refused_beside_a_blocking_capture() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let side = Stream::new(&context).unwrap();
    begin_per_thread_capture();
    let waited = legacy.order_after(&side);
    let recorded = side.order_after(&legacy);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    for refused in [waited, recorded] {
        assert!(matches!(refused, Err(Error::StreamCapturing { .. })), "{refused:?}");
    }
    legacy.order_after(&side).unwrap();
}

/// A blocking stream that begins capturing between the legacy stream's question and the free
/// (the driver then refuses the free): the free is not lost, it waits for the next use of the
/// legacy stream.
#[test]
fn a_legacy_free_refused_for_a_capture_begun_after_the_question_waits() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let legacy = Stream::legacy(&context);
    let buffer = pool.alloc(4096, &legacy).unwrap();
    cumempool_tests::stand_in_driver::set_switch("refuse_next_legacy_free");
    drop(buffer);
    assert_eq!(pool.used_mem_current().unwrap(), 4096, "kept, not freed");
    legacy.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "the legacy stream's next use freed it");
}

/// An arena's span freed on the legacy stream while a blocking stream captures takes no event
/// there (the driver would refuse it and invalidate that capture): it waits for the capture's end,
/// then for the legacy stream, and is reused after.
#[test]
fn an_arena_free_on_the_legacy_stream_waits_for_a_blocking_capture() {
    use cumempool_alloc::Arena;
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let arena = Arena::builder(0, 8 << 20).chunk_size(2 << 20).build().unwrap();
    let ptr = arena.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap();
    begin_per_thread_capture();
    // SAFETY: allocated above with these arguments, freed once, unused after.
    let freed = unsafe { arena.deallocate(ptr, 4096, POOL_ALIGNMENT, &legacy) };
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    freed.unwrap();
    let stats = arena.stats();
    assert_eq!((stats.in_use, stats.pending_frees), (0, 1), "freed, waiting for the stream");
    let again = arena.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap();
    assert_eq!(again, ptr, "the span was reused once the capture ended");
}

/// A launch on the legacy stream that ran, where a blocking stream began capturing right after
/// it: as for an ordinary stream that begins capturing then, the launch is waited for on the host
/// and is no error (a caller retrying it would run the graph twice).
#[test]
fn a_launch_on_the_legacy_stream_that_ran_is_no_error_when_a_blocking_capture_begins() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let pool = MemPool::new(Route::device(0)).unwrap();
    let side = Stream::new(&context).unwrap();
    let mut buffer = pool.alloc(4096, &side).unwrap();
    let graph =
        Stream::new(&context).unwrap().capture(|capture| capture.fill(&capture.buffer(&mut buffer)?, 1)).unwrap();
    let mut exec = graph.instantiate().unwrap();
    cumempool_tests::stand_in_driver::capture_per_thread_at_next_launch();
    let launched = exec.launch(&legacy);
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    assert!(launched.is_ok(), "the launch ran and was waited for, yet: {launched:?}");
}

/// An arena span freed on the legacy stream when a blocking stream begins capturing between the
/// question and the event: the span waits for the capture's end, as a pool's free does, instead
/// of failing with the span live for ever.
#[test]
fn an_arena_free_racing_a_blocking_capture_waits_for_it() {
    use cumempool_alloc::Arena;
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let arena = Arena::builder(0, 8 << 20).chunk_size(2 << 20).build().unwrap();
    let ptr = arena.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap();
    cumempool_tests::stand_in_driver::set_switch("capture_per_thread_at_next_event_create");
    // SAFETY: allocated above with these arguments, freed once, unused after.
    let freed = unsafe { arena.deallocate(ptr, 4096, POOL_ALIGNMENT, &legacy) };
    assert_eq!(end_per_thread_capture(), CUresult::CUDA_SUCCESS, "the capture was left intact");
    freed.unwrap();
    assert_eq!(arena.allocate(4096, POOL_ALIGNMENT, &legacy).unwrap(), ptr, "reused after the capture");
}
