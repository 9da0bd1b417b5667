//! Adaptor and cache logic against the host heap: no GPU needed, runs in CI.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::Stream;
use cumempool_alloc::{
    CachingResource, Error, HostHeap, Limit, Statistics, StreamOrderedResource, Traced, POOL_ALIGNMENT,
};

/// A stream handle the host heap never hands to a driver. Offset past the handles that mean
/// "a stream of the current context" (0, 1, 2), which `borrow_raw` refuses without a context.
fn fake_stream(id: usize) -> Stream {
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    unsafe { Stream::borrow_raw((0x100 + id) as cumempool::sys::CUstream, None) }.unwrap()
}

fn write_and_check(ptr: u64, bytes: usize, value: u8) {
    // SAFETY: host heap memory of `bytes` bytes.
    let slice = unsafe { std::slice::from_raw_parts_mut(ptr as usize as *mut u8, bytes) };
    assert!(slice.iter().all(|_| true));
    slice.fill(value);
    assert!(slice.iter().all(|b| *b == value));
}

#[test]
fn statistics_count_current_peak_and_total() {
    let stats = Statistics::new(HostHeap);
    let stream = fake_stream(0);
    let a = stats.alloc(1000, &stream).unwrap();
    let b = stats.alloc(24, &stream).unwrap();
    assert_eq!(stats.usage().current_bytes, 1024);
    drop(a);
    let usage = stats.usage();
    assert_eq!((usage.current_bytes, usage.peak_bytes, usage.total_bytes), (24, 1024, 1024));
    assert_eq!((usage.current_count, usage.peak_count, usage.total_count), (1, 2, 2));
    drop(b);
    assert_eq!(stats.usage().current_count, 0);
}

#[test]
fn a_limit_is_a_typed_out_of_memory_and_frees_make_room() {
    let limited = Limit::new(HostHeap, 4096);
    let stream = fake_stream(0);
    let first = limited.alloc(3000, &stream).unwrap();
    match limited.alloc(2000, &stream) {
        Err(e @ Error::LimitExceeded { requested: 2000, limit: 4096, in_use: 3000 }) => {
            assert!(e.to_string().contains("limit of 4096"), "{e}")
        }
        other => panic!("expected LimitExceeded, got {other:?}"),
    }
    drop(first);
    let second = limited.alloc(4096, &stream).unwrap();
    assert_eq!(limited.in_use(), 4096);
    drop(second);
    assert_eq!(limited.in_use(), 0);
}

#[test]
fn adaptors_compose_in_any_order() {
    let stack = Traced::new(Limit::new(Statistics::new(HostHeap), 1 << 20), "test");
    let stream = fake_stream(0);
    {
        let block = stack.alloc(512, &stream).unwrap();
        write_and_check(block.as_raw(), 512, 7);
        assert_eq!(stack.inner().inner().usage().current_bytes, 512);
    }
    assert_eq!(stack.inner().in_use(), 0);
    assert!(matches!(stack.alloc(2 << 20, &stream), Err(Error::LimitExceeded { .. })));
    let cached = Statistics::new(CachingResource::new(Limit::new(HostHeap, 1 << 20)));
    drop(cached.alloc(100, &stream).unwrap());
    assert_eq!(cached.usage().total_count, 1);
}

#[test]
fn alignments_above_the_pool_guarantee_are_refused_not_ignored() {
    let stream = fake_stream(0);
    let cache = CachingResource::new(HostHeap);
    assert!(matches!(cache.allocate(64, POOL_ALIGNMENT * 2, &stream), Err(Error::Alignment { requested: 512, .. })));
    assert!(matches!(HostHeap.allocate(64, 3, &stream), Err(Error::Alignment { requested: 3, .. })));
    let ptr = cache.allocate(64, POOL_ALIGNMENT, &stream).unwrap();
    assert_eq!(ptr % POOL_ALIGNMENT as u64, 0);
    unsafe { cache.deallocate(ptr, 64, POOL_ALIGNMENT, &stream) }.unwrap();
}

#[test]
fn repeated_pairs_on_a_stream_are_cache_hits_on_the_same_block() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let stream = fake_stream(1);
    let first = cache.alloc(1000, &stream).unwrap().as_raw();
    for round in 0..100u8 {
        let block = cache.alloc(1000 + usize::from(round % 10), &stream).unwrap();
        assert_eq!(block.as_raw(), first, "the same size class reuses the block");
        write_and_check(block.as_raw(), 1000, round);
    }
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (100, 1));
    assert_eq!(below.usage().total_count, 1, "the resource below was asked once");
    assert_eq!((stats.cached_blocks, stats.streams), (1, 1));
    assert!(stats.hit_rate() > 0.99);
}

#[test]
fn a_block_freed_on_one_stream_is_never_handed_to_another() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let (a, b) = (fake_stream(1), fake_stream(2));
    let on_a = cache.allocate(4096, 256, &a).unwrap();
    unsafe { cache.deallocate(on_a, 4096, 256, &a) }.unwrap();
    let on_b = cache.allocate(4096, 256, &b).unwrap();
    assert_ne!(on_a, on_b, "b must not get a's block before a's free has completed");
    // Freed on b (a cross-stream free), the block now belongs to b's cache.
    unsafe { cache.deallocate(on_b, 4096, 256, &b) }.unwrap();
    assert_eq!(cache.allocate(4096, 256, &b).unwrap(), on_b);
    assert_eq!(cache.allocate(4096, 256, &a).unwrap(), on_a);
    unsafe { cache.deallocate(on_a, 4096, 256, &a) }.unwrap();
    unsafe { cache.deallocate(on_b, 4096, 256, &b) }.unwrap();
    drop(cache);
    assert_eq!(below.usage().current_bytes, 0, "nothing leaks");
}

#[test]
fn every_no_memory_answer_says_so() {
    let stream = fake_stream(0);
    let limited = Limit::new(HostHeap, 100);
    let refused = limited.allocate(200, 256, &stream).unwrap_err();
    assert!(refused.is_out_of_memory(), "{refused}");
    assert!(Error::HostOutOfMemory { requested: 1 }.is_out_of_memory());
    let alignment = HostHeap.allocate(64, 3, &stream).unwrap_err();
    assert!(!alignment.is_out_of_memory(), "{alignment}");
}

/// Allocates nothing (fake addresses) and refuses every free, as a failing driver would.
struct FailingFrees;

impl StreamOrderedResource for FailingFrees {
    type Kind = cumempool_alloc::HostMemory;

    fn allocate(&self, _bytes: usize, _align: usize, _stream: &Stream) -> cumempool_alloc::Result<u64> {
        Ok(0x10_000)
    }

    unsafe fn deallocate(
        &self,
        _ptr: u64,
        _bytes: usize,
        _align: usize,
        _stream: &Stream,
    ) -> cumempool_alloc::Result<()> {
        Err(Error::Pool(cumempool::Error::InvalidArgument { what: "freeing", reason: "the test refuses".into() }))
    }
}

#[test]
fn a_failed_free_below_still_gives_the_bytes_back_to_limit_and_statistics() {
    let stream = fake_stream(0);
    let stack = Limit::new(Statistics::new(FailingFrees), 4096);
    let ptr = stack.allocate(4096, 256, &stream).unwrap();
    assert!(unsafe { stack.deallocate(ptr, 4096, 256, &stream) }.is_err(), "the error is still reported");
    assert_eq!(stack.in_use(), 0, "the caller cannot free it again, so the limit must not keep it");
    assert_eq!(stack.inner().usage().current_bytes, 0);
    assert_eq!(stack.inner().usage().current_count, 0);
    let again = stack.allocate(4096, 256, &stream).expect("the limit has room again");
    let _ = unsafe { stack.deallocate(again, 4096, 256, &stream) };
}

#[test]
fn the_cache_stays_within_its_bound_and_releases_on_demand() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::with_max_cached(&below, 1 << 20);
    let stream = fake_stream(3);
    let blocks: Vec<_> = (0..8).map(|_| cache.allocate(256 << 10, 256, &stream).unwrap()).collect();
    for ptr in blocks {
        unsafe { cache.deallocate(ptr, 256 << 10, 256, &stream) }.unwrap();
    }
    let stats = cache.stats();
    assert!(stats.cached_bytes <= 1 << 20, "{stats:?}");
    assert_eq!(stats.cached_bytes, 1 << 20, "it fills up to the bound");
    assert_eq!(below.usage().current_bytes, 1 << 20, "the rest went back below");
    cache.release().unwrap();
    assert_eq!(below.usage().current_bytes, 0);
    assert_eq!(cache.stats().cached_blocks, 0);
    // The budget came back: the cache can fill again.
    let again = cache.allocate(256 << 10, 256, &stream).unwrap();
    unsafe { cache.deallocate(again, 256 << 10, 256, &stream) }.unwrap();
    assert_eq!(cache.stats().cached_bytes, 256 << 10);
}

#[test]
fn release_stream_gives_back_only_that_streams_blocks() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let (a, b) = (fake_stream(10), fake_stream(11));
    for stream in [&a, &b] {
        let ptr = cache.allocate(1 << 16, 256, stream).unwrap();
        unsafe { cache.deallocate(ptr, 1 << 16, 256, stream) }.unwrap();
    }
    cache.release_stream(&a).unwrap();
    let stats = cache.stats();
    assert_eq!((stats.streams, stats.cached_bytes), (1, 1 << 16));
}

#[test]
fn threads_on_their_own_streams_keep_their_bytes() {
    let cache = CachingResource::new(Statistics::new(HostHeap));
    std::thread::scope(|scope| {
        for thread in 0..8usize {
            let cache = &cache;
            scope.spawn(move || {
                let stream = fake_stream(100 + thread);
                for i in 0..5000usize {
                    let bytes = 256 + (i * 37 + thread * 101) % 20_000;
                    let block = cache.alloc(bytes, &stream).unwrap();
                    write_and_check(block.as_raw(), bytes, (thread * 16 + i % 16) as u8);
                }
            });
        }
    });
    let stats = cache.stats();
    assert_eq!(stats.hits + stats.misses, 40_000);
    assert!(stats.hit_rate() > 0.9, "{stats:?}");
    cache.release().unwrap();
    assert_eq!(cache.inner().usage().current_bytes, 0, "nothing leaks");
}

#[test]
fn streams_beyond_the_slots_bypass_the_cache_and_released_slots_are_reused() {
    let below = Statistics::new(HostHeap);
    let cache = CachingResource::new(&below);
    let streams: Vec<Stream> = (1..=300).map(fake_stream).collect();
    for stream in &streams {
        let ptr = cache.allocate(1024, 256, stream).unwrap();
        unsafe { cache.deallocate(ptr, 1024, 256, stream) }.unwrap();
    }
    let stats = cache.stats();
    assert_eq!(stats.streams, 256, "{stats:?}");
    assert_eq!(below.usage().current_count, 256, "the other 44 blocks went straight back");
    for stream in &streams[..10] {
        cache.release_stream(stream).unwrap();
    }
    assert_eq!(cache.stats().streams, 246);
    let late = fake_stream(1000);
    let ptr = cache.allocate(1024, 256, &late).unwrap();
    unsafe { cache.deallocate(ptr, 1024, 256, &late) }.unwrap();
    assert_eq!(cache.allocate(1024, 256, &late).unwrap(), ptr, "a released slot serves a new stream");
    unsafe { cache.deallocate(ptr, 1024, 256, &late) }.unwrap();
    cache.release().unwrap();
    assert_eq!(below.usage().current_bytes, 0);
}

#[test]
fn resources_and_allocators_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CachingResource<HostHeap>>();
    send_sync::<Statistics<HostHeap>>();
    send_sync::<Limit<HostHeap>>();
    send_sync::<Traced<HostHeap>>();
    send_sync::<cumempool_alloc::PoolResource<cumempool_alloc::DeviceMemory>>();
    send_sync::<cumempool_alloc::CurrentPoolResource<cumempool_alloc::ManagedMemory>>();
    send_sync::<cumempool_alloc::PoolAllocator<cumempool_alloc::HostMemory>>();
    fn error<E: std::error::Error + Send + Sync + 'static>() {}
    error::<Error>();
}
