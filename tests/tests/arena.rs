//! The VMM arena on the GPU: growth without moving, stream-ordered reuse, trim, the cache on
//! top, holds, and sharing an allocation's chunks through descriptors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Access, HandleTypes, Stream};
use cumempool_alloc::{Arena, ArenaImport, CachingResource, Error, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool_tests::device_bytes::{read, write};
use cumempool_tests::{gpu, pattern};

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_arena_grows_without_moving_and_keeps_every_byte() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 1 << 30).build().unwrap();
    let chunk = arena.chunk_size();
    assert_eq!(arena.stats().mapped, 0, "nothing is mapped before the first allocation");
    let first = arena.alloc(4096, &stream).unwrap();
    assert_eq!(first.as_raw(), arena.base(), "first fit starts at the base");
    assert_eq!(arena.stats().mapped, chunk, "one chunk mapped");
    write(first.as_raw(), &pattern(4096, 1), &stream);
    // A block spanning several chunks maps them all, after the first, at higher addresses.
    let large = arena.alloc(3 * chunk, &stream).unwrap();
    assert!(large.as_raw() > first.as_raw() && arena.contains(large.as_raw(), 3 * chunk));
    assert_eq!(arena.stats().mapped, 4 * chunk, "{:?}", arena.stats());
    write(large.as_raw(), &pattern(3 * chunk, 2), &stream);
    assert_eq!(read(first.as_raw(), 4096, &stream), pattern(4096, 1), "growth moved nothing");
    assert_eq!(read(large.as_raw(), 3 * chunk, &stream), pattern(3 * chunk, 2));
    assert_eq!(arena.mapped_spans(), vec![(arena.base(), 4 * chunk)], "adjacent chunks merge");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn freed_spans_are_reused_after_their_stream_and_trim_unmaps_idle_chunks() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 1 << 30).build().unwrap();
    let chunk = arena.chunk_size();
    let a = arena.allocate(chunk, POOL_ALIGNMENT, &stream).unwrap();
    let b = arena.allocate(chunk, POOL_ALIGNMENT, &stream).unwrap();
    // SAFETY: allocated above with these arguments, freed once, unused after.
    unsafe { arena.deallocate(a, chunk, POOL_ALIGNMENT, &stream) }.unwrap();
    stream.synchronize().unwrap();
    let again = arena.allocate(chunk, POOL_ALIGNMENT, &stream).unwrap();
    assert_eq!(again, a, "a span whose free has passed is reused");
    // SAFETY: as above.
    unsafe { arena.deallocate(again, chunk, POOL_ALIGNMENT, &stream) }.unwrap();
    assert_eq!(arena.trim().unwrap(), chunk, "the idle chunk is released, the used one stays");
    assert_eq!(arena.stats().mapped, chunk);
    let hold = arena.hold_mappings();
    assert!(matches!(arena.trim(), Err(Error::MappingsHeld { holders: 1 })));
    drop(hold);
    // SAFETY: as above.
    unsafe { arena.deallocate(b, chunk, POOL_ALIGNMENT, &stream) }.unwrap();
    // SAFETY: freed already: refused, not freed twice.
    let twice = unsafe { arena.deallocate(b, chunk, POOL_ALIGNMENT, &stream) }.unwrap_err();
    assert!(matches!(twice, Error::NotFromArena { .. }), "{twice}");
    assert_eq!(arena.trim().unwrap(), chunk);
    assert_eq!(arena.stats(), cumempool_alloc::ArenaStats { reserved: arena.stats().reserved, ..Default::default() });
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn an_exhausted_arena_says_so_as_out_of_memory_and_alignment_is_bounded() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 1).build().unwrap(); // rounded up to one chunk
    let chunk = arena.chunk_size();
    assert_eq!(arena.stats().reserved, chunk);
    let full = arena.allocate(chunk + 1, POOL_ALIGNMENT, &stream).unwrap_err();
    assert!(full.is_out_of_memory() && matches!(full, Error::ArenaExhausted { .. }), "{full}");
    let align = arena.allocate(256, 2 * chunk, &stream).unwrap_err();
    assert!(matches!(align, Error::Alignment { .. }), "{align}");
    let odd = Arena::builder(0, 1 << 30).chunk_size(chunk + 1).build().unwrap_err();
    assert!(odd.to_string().contains("granularity"), "{odd}");
    let own = Arena::builder(0, 1 << 30).peer_access(0, Access::Read).build().unwrap_err();
    assert!(own.to_string().contains("owns the arena"), "{own}");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_cache_sits_on_the_arena() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 4 << 30).build().unwrap();
    let cache = CachingResource::new(&arena);
    for round in 0..100u8 {
        let block = cache.alloc(1 << 20, &stream).unwrap();
        assert!(arena.contains(block.as_raw(), 1 << 20));
        if round == 0 {
            write(block.as_raw(), &pattern(1 << 20, 4), &stream);
            assert_eq!(read(block.as_raw(), 1 << 20, &stream), pattern(1 << 20, 4));
        }
    }
    assert!(arena.stats().in_use <= 2 << 20, "the cache reuses its block: {:?}", arena.stats());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn an_allocation_shared_through_descriptors_shows_the_same_bytes() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 1 << 30).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let chunk = arena.chunk_size();
    let _pad = arena.alloc(4096, &stream).unwrap();
    let block = arena.alloc(chunk, &stream).unwrap(); // starts inside the first chunk, spans two
    write(block.as_raw(), &pattern(chunk, 6), &stream);
    let export = arena.export_fd(block.as_raw()).unwrap();
    assert_eq!((export.descriptors.len(), export.offset, export.len), (2, 4096, chunk));
    let mapped = ArenaImport::map(&export.descriptors, export.chunk_size, export.offset, export.len, 0).unwrap();
    assert_ne!(mapped.as_raw(), block.as_raw());
    assert_eq!(read(mapped.as_raw(), chunk, &stream), pattern(chunk, 6));
    assert!(matches!(arena.export_fd(block.as_raw() + 256), Err(Error::NotFromArena { .. })));
    let plain = Arena::builder(0, 1 << 30).build().unwrap();
    let unshareable = plain.alloc(256, &stream).unwrap();
    assert!(plain.export_fd(unshareable.as_raw()).unwrap_err().to_string().contains("POSIX_FILE_DESCRIPTOR"));
}
