//! What a VMM arena refuses, on a host without a GPU, through the stand-in libcuda of
//! `cumempool_tests::stand_in_driver` (whose virtual-memory calls answer success): requests
//! larger than the reserved range, whose offsets would wrap, and exports of chunks that other
//! allocations share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::Stream;
use cumempool_alloc::{Arena, CachingResource, Error, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool_tests::stand_in_driver::stand_in;

const CHUNK: usize = 2 << 20;

/// A request near `usize::MAX` once wrapped `start + bytes` in the arena's first fit: it
/// "succeeded" (release builds) or panicked (debug builds), and the next allocation was handed
/// the start of the arena, over the first live block. It is refused, typed, saying how much was
/// asked and how much is reserved, and the arena goes on handing out disjoint spans.
#[test]
fn a_request_larger_than_the_range_is_refused_and_overlaps_nothing() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 16 * CHUNK).chunk_size(CHUNK).build().unwrap();
    let reserved = arena.stats().reserved;
    let first = arena.allocate(256, POOL_ALIGNMENT, &stream).unwrap();
    for huge in [usize::MAX - 300, usize::MAX - 255, usize::MAX, reserved + 1, (1 << 40) + 1] {
        let refused =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| arena.allocate(huge, POOL_ALIGNMENT, &stream)))
                .unwrap_or_else(|_| panic!("allocate({huge}) panicked"));
        match refused {
            Err(Error::ArenaExhausted { requested, reserved: said }) => {
                assert_eq!((requested, said), (huge, reserved));
            }
            other => panic!("allocate({huge}) answered {other:?}, not ArenaExhausted"),
        }
    }
    let message = arena.allocate(usize::MAX - 300, POOL_ALIGNMENT, &stream).unwrap_err().to_string();
    assert!(message.contains(&(usize::MAX - 300).to_string()) && message.contains(&reserved.to_string()), "{message}");
    let next = arena.allocate(4096, POOL_ALIGNMENT, &stream).unwrap();
    assert!(next >= first + 256 || next + 4096 <= first, "{next:#x} overlaps the live block at {first:#x}");
    assert_eq!(arena.stats().in_use, 256 + 4096, "the refused requests took nothing");
    // A cache passes requests over its largest class straight down: refused the same way.
    let cache = CachingResource::new(&arena);
    let through = cache.allocate(usize::MAX - 300, POOL_ALIGNMENT, &stream).unwrap_err();
    assert!(matches!(through, Error::ArenaExhausted { .. }), "{through:?}");
    // SAFETY: allocated above with these arguments, freed once, unused after.
    unsafe {
        arena.deallocate(first, 256, POOL_ALIGNMENT, &stream).unwrap();
        arena.deallocate(next, 4096, POOL_ALIGNMENT, &stream).unwrap();
    }
}

/// Chunks are the unit another process maps, so exporting an allocation that shares a chunk
/// with others would hand the peer those neighbours too. Only an allocation that owns its
/// chunks (it starts on a chunk boundary and is a whole number of chunks long, so nothing else
/// can be placed in them while it lives) is exported; any other is refused, saying how to
/// allocate one that can be.
#[test]
fn only_an_allocation_that_owns_its_chunks_is_exported() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 16 * CHUNK)
        .chunk_size(CHUNK)
        .export_handle_types(cumempool::HandleTypes::POSIX_FILE_DESCRIPTOR)
        .build()
        .unwrap();
    let pad = arena.allocate(4096, POOL_ALIGNMENT, &stream).unwrap();
    let straddling = arena.allocate(CHUNK, POOL_ALIGNMENT, &stream).unwrap();
    assert_eq!(straddling, pad + 4096, "it shares its first chunk with the pad");
    let filler = arena.allocate(CHUNK - 4096, POOL_ALIGNMENT, &stream).unwrap();
    let owning = arena.allocate(2 * CHUNK, CHUNK, &stream).unwrap();
    let small = arena.allocate(4096, CHUNK, &stream).unwrap();
    let neighbour = arena.allocate(4096, POOL_ALIGNMENT, &stream).unwrap();
    assert_eq!(neighbour, small + 4096, "a chunk-aligned small block still shares its chunk");
    for (what, ptr) in [("a block inside a shared chunk", straddling), ("a block smaller than a chunk", small)] {
        match arena.export_fd(ptr) {
            Err(error @ Error::NotExportable { .. }) => {
                let message = error.to_string();
                let advice = format!("arena.allocate(k * {CHUNK}, {CHUNK}, &stream)");
                assert!(message.contains(&advice), "{what}: says how to allocate one that can be: {message}");
            }
            other => panic!("{what} was exported with its neighbours: {other:?}"),
        }
    }
    let export = arena.export_fd(owning).unwrap();
    assert_eq!((export.descriptors.len(), export.offset, export.len), (2, 0, 2 * CHUNK));
    // SAFETY: allocated above with these arguments, freed once, unused after.
    unsafe {
        for (ptr, len) in [
            (pad, 4096),
            (straddling, CHUNK),
            (filler, CHUNK - 4096),
            (owning, 2 * CHUNK),
            (small, 4096),
            (neighbour, 4096),
        ] {
            arena.deallocate(ptr, len, POOL_ALIGNMENT, &stream).unwrap();
        }
    }
}
