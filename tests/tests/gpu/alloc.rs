//! The allocator crate on the real driver: containers in every host-accessible pool kind,
//! resources that follow routing, and the caching layer under a 16-thread stress.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use allocator_api2::alloc::Allocator;
use allocator_api2::vec::Vec as PoolVec;
use cumempool::sys::{self, CUdeviceptr};
use cumempool::{default_pool, set_current_pool, Event, Location, MemPool, Route, Stream};
use cumempool_alloc::{
    CachingResource, CurrentPoolResource, DeviceMemory, Error, HostMemory, ManagedMemory, PoolAllocator, PoolResource,
    Statistics, StreamOrderedResource,
};
use cumempool_tests::{gpu, pattern, routing_lock};
use std::alloc::Layout;

fn copy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: &Stream) {
    let f = sys::driver().unwrap().cuMemcpyAsync().unwrap();
    stream.bind().unwrap();
    // SAFETY: callers pass live memory of at least `bytes` bytes at both ends, and a live stream.
    assert_eq!(unsafe { f(dst, src, bytes, stream.as_raw()) }, sys::CUresult::CUDA_SUCCESS);
    stream.synchronize().unwrap();
}

fn fill(dst: CUdeviceptr, value: u8, bytes: usize, stream: &Stream) {
    let f = sys::driver().unwrap().cuMemsetD8Async().unwrap();
    // SAFETY: callers pass a live allocation of at least `bytes` bytes, and a live stream.
    assert_eq!(unsafe { f(dst, value, bytes, stream.as_raw()) }, sys::CUresult::CUDA_SUCCESS);
}

fn round_trip_vec<K: cumempool_alloc::HostAccessible>(route: Route, context: &cumempool::Context, stream: &Stream) {
    let pool = MemPool::new(route).unwrap();
    let allocator = PoolAllocator::<K>::new(&pool, context).unwrap();
    let mut bytes = PoolVec::new_in(allocator.clone());
    for chunk in 0..64u8 {
        bytes.extend_from_slice(&pattern(16 << 10, chunk)); // grows through many reallocations
    }
    let expected: std::vec::Vec<u8> = (0..64u8).flat_map(|c| pattern(16 << 10, c)).collect();
    assert_eq!(&bytes[..], &expected[..], "{route}: growth kept the bytes");
    // Round trip through device memory.
    let device = default_pool(Route::device(0)).unwrap().alloc(bytes.len(), stream).unwrap();
    copy(device.as_raw(), bytes.as_ptr() as usize as u64, bytes.len(), stream);
    bytes.iter_mut().for_each(|b| *b = 0);
    copy(bytes.as_mut_ptr() as usize as u64, device.as_raw(), bytes.len(), stream);
    assert_eq!(&bytes[..], &expected[..], "{route}: bytes came back from the device");
    bytes.truncate(1000);
    bytes.shrink_to_fit();
    assert_eq!(&bytes[..], &expected[..1000], "{route}: shrinking kept the bytes");
    assert!(pool.used_mem_current().unwrap() >= 1000);
    let boxed = allocator_api2::boxed::Box::new_in([7u64; 32], allocator.clone());
    assert_eq!(boxed.iter().sum::<u64>(), 224);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn vecs_live_in_every_host_accessible_pool_kind() {
    let context = gpu().expect("a GPU");
    let stream = Stream::new(&context).unwrap();
    round_trip_vec::<HostMemory>(Route::host(), &context, &stream);
    round_trip_vec::<HostMemory>(Route::host_numa(0), &context, &stream);
    round_trip_vec::<ManagedMemory>(Route::managed(Location::Device(0)), &context, &stream);
    round_trip_vec::<ManagedMemory>(Route::managed(Location::Host), &context, &stream);
    round_trip_vec::<ManagedMemory>(Route::managed(Location::Unspecified), &context, &stream);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn allocators_refuse_wrong_pools_and_oversized_alignments() {
    let context = gpu().expect("a GPU");
    let device_pool = MemPool::new(Route::device(0)).unwrap();
    assert!(matches!(PoolAllocator::<HostMemory>::new(&device_pool, &context), Err(Error::KindMismatch { .. })));
    assert!(matches!(PoolResource::<ManagedMemory>::new(&device_pool), Err(Error::KindMismatch { .. })));
    let host_pool = MemPool::new(Route::host()).unwrap();
    let allocator = PoolAllocator::<HostMemory>::new(&host_pool, &context).unwrap();
    assert!(allocator.allocate(Layout::from_size_align(64, 512).unwrap()).is_err(), "512-byte alignment is refused");
    let ok = allocator.allocate(Layout::from_size_align(64, 256).unwrap()).unwrap();
    assert_eq!(ok.cast::<u8>().as_ptr() as usize % 256, 0);
    // SAFETY: `ok` came from this allocator with this layout, deallocated once.
    unsafe { allocator.deallocate(ok.cast(), Layout::from_size_align(64, 256).unwrap()) };
    let empty = allocator.allocate(Layout::from_size_align(0, 8).unwrap()).unwrap();
    assert_eq!(empty.len(), 0);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_current_pool_resource_follows_rerouting() {
    let context = gpu().expect("a GPU");
    let _lock = routing_lock();
    let stream = Stream::new(&context).unwrap();
    let follower = CurrentPoolResource::<HostMemory>::new(Route::host()).unwrap();
    let pool = MemPool::new(Route::host()).unwrap();
    {
        let _guard = set_current_pool(Route::host(), &pool).unwrap();
        let block = follower.alloc(1 << 20, &stream).unwrap();
        assert!(pool.used_mem_current().unwrap() >= 1 << 20, "allocated from the routed pool");
        drop(block);
    }
    let block = follower.alloc(1 << 20, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "after the guard, the default pool serves again");
    drop(block);
    assert!(matches!(CurrentPoolResource::<DeviceMemory>::new(Route::host()), Err(Error::KindMismatch { .. })));
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_cache_survives_sixteen_threads_of_mixed_sizes_and_cross_stream_frees() {
    let context = gpu().expect("a GPU");
    let pool = MemPool::new(Route::device(0)).unwrap();
    let cache =
        CachingResource::with_max_cached(Statistics::new(PoolResource::<DeviceMemory>::new(&pool).unwrap()), 256 << 20);
    let streams: std::vec::Vec<Stream> = (0..16).map(|_| Stream::new(&context).unwrap()).collect();
    std::thread::scope(|scope| {
        for thread in 0..16usize {
            let (cache, streams, context) = (&cache, &streams, &context);
            scope.spawn(move || {
                let mine = &streams[thread];
                let other = &streams[(thread + 1) % 16];
                let mut host = vec![0u8; 1 << 20];
                for i in 0..300usize {
                    let bytes = [256, 1000, 4096, 70_000, 1 << 20][(i + thread) % 5];
                    let value = (thread * 16 + i % 16) as u8;
                    let ptr = cache.allocate(bytes, 256, mine).unwrap();
                    fill(ptr, value, bytes, mine);
                    copy(host.as_mut_ptr() as usize as u64, ptr, bytes, mine);
                    assert!(
                        host[..bytes].iter().all(|b| *b == value),
                        "thread {thread} round {i}: another stream touched the block"
                    );
                    if i % 3 == 0 {
                        // A cross-stream free: `other` waits for our work, then frees.
                        let done = Event::new(context).unwrap();
                        done.record(mine).unwrap();
                        other.wait(&done).unwrap();
                        // SAFETY: allocated above with these arguments, freed once; `other` waits for this work.
                        unsafe { cache.deallocate(ptr, bytes, 256, other) }.unwrap();
                    } else {
                        // SAFETY: allocated above with these arguments, freed once, on the stream that used it.
                        unsafe { cache.deallocate(ptr, bytes, 256, mine) }.unwrap();
                    }
                }
                mine.synchronize().unwrap();
            });
        }
    });
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    let stats = cache.stats();
    eprintln!("cache after the stress: {stats:?}");
    assert!(stats.hits > stats.misses, "{stats:?}");
    assert!(stats.cached_bytes <= 256 << 20);
    cache.release().unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(cache.inner().usage().current_bytes, 0, "everything went back to the pool");
    assert_eq!(pool.used_mem_current().unwrap(), 0);
}
