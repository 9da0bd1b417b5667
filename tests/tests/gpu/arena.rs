//! The VMM arena on the GPU: growth without moving, stream-ordered reuse, trim, the cache on
//! top, holds, and sharing an allocation's chunks through descriptors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Access, HandleTypes, Stream};
use cumempool_alloc::{Arena, ArenaImport, CachingResource, Error, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool_tests::device_bytes::{read, write};
use cumempool_tests::{gpu, harness_name, pattern};
use std::io::{Read, Write};
use std::os::fd::AsFd;

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
    let pad = arena.alloc(4096, &stream).unwrap();
    // Two whole chunks, aligned to one: it owns them, so the pad is not exported with it.
    let block = arena.allocate(2 * chunk, chunk, &stream).unwrap();
    write(block, &pattern(2 * chunk, 6), &stream);
    let export = arena.export_fd(block).unwrap();
    assert_eq!((export.descriptors.len(), export.offset, export.len), (2, 0, 2 * chunk));
    let mapped = ArenaImport::map(&export.descriptors, export.chunk_size, export.offset, export.len, 0).unwrap();
    assert_ne!(mapped.as_raw(), block);
    assert_eq!(read(mapped.as_raw(), 2 * chunk, &stream), pattern(2 * chunk, 6));
    assert!(matches!(arena.export_fd(block + 256), Err(Error::NotFromArena { .. })));
    assert!(matches!(arena.export_fd(pad.as_raw()), Err(Error::NotExportable { .. })));
    drop(mapped);
    // SAFETY: allocated above with these arguments, freed once, unused after (the import is gone).
    unsafe { arena.deallocate(block, 2 * chunk, chunk, &stream) }.unwrap();
    let plain = Arena::builder(0, 1 << 30).build().unwrap();
    let unshareable = plain.allocate(chunk, chunk, &stream).unwrap();
    assert!(plain.export_fd(unshareable).unwrap_err().to_string().contains("POSIX_FILE_DESCRIPTOR"));
    // SAFETY: as above.
    unsafe { plain.deallocate(unshareable, chunk, chunk, &stream) }.unwrap();
}

/// The child side of the two-process test: the chunks' descriptors arrive on stdin (a Unix
/// socket), each with the allocation's shape.
fn import_in_child() {
    use cumempool::descriptor_passing::receive_fd;
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let socket = std::os::unix::net::UnixStream::from(std::io::stdin().as_fd().try_clone_to_owned().unwrap());
    let mut descriptors = Vec::new();
    let mut shape = [0u64; 4];
    loop {
        let mut payload = [0u8; 32];
        let (fd, received) = receive_fd(&socket, &mut payload).unwrap();
        assert_eq!(received, 32);
        for (value, bytes) in shape.iter_mut().zip(payload.chunks(8)) {
            *value = u64::from_le_bytes(bytes.try_into().unwrap());
        }
        descriptors.push(fd);
        if descriptors.len() as u64 == shape[0] {
            break;
        }
    }
    let [_, chunk, offset, len] = shape.map(|v| v as usize);
    let mapped = ArenaImport::map(&descriptors, chunk, offset, len, 0).unwrap();
    assert_eq!(read(mapped.as_raw(), len, &stream), pattern(len, 7), "the exporter's bytes");
    write(mapped.as_raw(), &pattern(len, 8), &stream);
    drop(mapped);
    (&socket).write_all(b"ok").unwrap();
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn another_process_maps_an_arena_allocation_from_its_descriptors() {
    if std::env::var_os("CUMEMPOOL_ARENA_CHILD").is_some() {
        return import_in_child();
    }
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let arena = Arena::builder(0, 1 << 30).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let chunk = arena.chunk_size();
    let len = 2 * chunk;
    let _pad = arena.alloc(4096, &stream).unwrap();
    let block = arena.allocate(len, chunk, &stream).unwrap();
    write(block, &pattern(len, 7), &stream);
    let export = arena.export_fd(block).unwrap();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .arg(harness_name(concat!(module_path!(), "::another_process_maps_an_arena_allocation_from_its_descriptors")))
        .args(["--exact", "--include-ignored"])
        .env("CUMEMPOOL_ARENA_CHILD", "1")
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .spawn()
        .unwrap();
    let shape = [export.descriptors.len(), export.chunk_size, export.offset, export.len];
    let payload: Vec<u8> = shape.iter().flat_map(|v| (*v as u64).to_le_bytes()).collect();
    for fd in &export.descriptors {
        cumempool::descriptor_passing::send_fd(&ours, fd.as_fd(), &payload).unwrap();
    }
    let mut answer = Vec::new();
    (&ours).read_to_end(&mut answer).unwrap();
    assert!(child.wait().unwrap().success(), "the child failed");
    assert_eq!(answer, b"ok");
    assert_eq!(read(block, len, &stream), pattern(len, 8), "the child's bytes, seen by the exporter");
    // SAFETY: allocated above with these arguments, freed once; the child has unmapped it.
    unsafe { arena.deallocate(block, len, chunk, &stream) }.unwrap();
}
