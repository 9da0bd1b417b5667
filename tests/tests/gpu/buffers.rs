//! Buffers on the real driver: bytes through every pool kind, host access, zero size.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{default_pool, Error, HandleTypes, Location, MemPool, Route};
use cumempool_tests::{gpu_stream, pattern, ROUTE_KINDS};

#[test]
#[ignore = "requires a CUDA GPU"]
fn bytes_round_trip_through_every_route_kind() {
    let stream = gpu_stream().expect("a GPU");
    for (seed, route) in ROUTE_KINDS.into_iter().enumerate() {
        let pool = default_pool(route).unwrap();
        let data = pattern(3 << 20, seed as u8);
        let mut buffer = pool.alloc(data.len(), &stream).unwrap();
        buffer.copy_from_host(&data).unwrap();
        let mut device = default_pool(Route::device(0)).unwrap().alloc(data.len(), &stream).unwrap();
        device.copy_from(&buffer).unwrap();
        let mut back = vec![0; data.len()];
        device.copy_to_host(&mut back).unwrap();
        assert_eq!(back, data, "{route}");
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn the_host_writes_host_and_managed_buffers_and_the_device_sees_it() {
    let stream = gpu_stream().expect("a GPU");
    for route in
        [Route::host(), Route::host_numa(0), Route::managed(Location::Device(0)), Route::managed(Location::Unspecified)]
    {
        let pool = MemPool::new(route).unwrap();
        let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
        buffer.fill(0xee).unwrap();
        assert!(buffer.host_slice().unwrap().iter().all(|b| *b == 0xee), "{route}: the device's fill is visible");
        let data = pattern(1 << 20, 9);
        buffer.host_slice_mut().unwrap().copy_from_slice(&data);
        let mut back = vec![0; data.len()];
        buffer.copy_to_host(&mut back).unwrap();
        assert_eq!(back, data, "{route}: the host's writes are visible to copies");
    }
}

/// A host NUMA pool built with `POSIX_FILE_DESCRIPTOR` may be exported at any moment, and an
/// importer may then write its memory: its buffers are copied, never lent as slices. The
/// default host NUMA pool has no export handle types, so its buffers still are, and exporting
/// it is refused.
#[test]
#[ignore = "requires a CUDA GPU"]
fn exportable_host_memory_is_copied_not_sliced() {
    let stream = gpu_stream().expect("a GPU");
    let route = Route::host_numa(0);
    let exportable = MemPool::builder(route).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let mut buffer = exportable.alloc(1 << 20, &stream).unwrap();
    let refused = buffer.host_slice().unwrap_err();
    assert!(matches!(refused, Error::ExportableMemoryNotSliceable { .. }), "{refused}");
    assert!(matches!(buffer.host_slice_mut(), Err(Error::ExportableMemoryNotSliceable { .. })));
    let data = pattern(1 << 20, 3);
    buffer.copy_from_host(&data).unwrap();
    let mut back = vec![0; data.len()];
    buffer.copy_to_host(&mut back).unwrap();
    assert_eq!(back, data, "copies still work");
    let default = default_pool(route).unwrap();
    assert_eq!(default.created_handle_types(), Some(HandleTypes::NONE));
    // What the library assumes of default pools, asked of the driver where it can say (13.2).
    #[cfg(feature = "cuda-13020")]
    match default.export_handle_types() {
        Ok(types) => assert_eq!(types, HandleTypes::NONE, "the driver's default pool has export handle types"),
        Err(error) => assert!(matches!(error, Error::DriverTooOld { .. }), "{error}"),
    }
    let mut plain = default.alloc(4096, &stream).unwrap();
    plain.host_slice_mut().unwrap().fill(5);
    assert!(plain.host_slice().unwrap().iter().all(|b| *b == 5));
    let export = default.export_fd().unwrap_err();
    assert!(matches!(export, Error::NotShareable { .. }), "{export}");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn device_memory_is_not_handed_to_the_host() {
    let stream = gpu_stream().expect("a GPU");
    let buffer = default_pool(Route::device(0)).unwrap().alloc(4096, &stream).unwrap();
    assert!(matches!(buffer.host_slice(), Err(Error::NotHostAccessible { .. })));
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn zero_bytes_is_an_empty_buffer_without_a_driver_call() {
    let stream = gpu_stream().expect("a GPU");
    let pool = MemPool::new(Route::host()).unwrap();
    let mut buffer = pool.alloc(0, &stream).unwrap();
    assert!(buffer.is_empty() && buffer.as_raw() == 0);
    assert!(buffer.host_slice_mut().unwrap().is_empty());
    assert_eq!(pool.used_mem_current().unwrap(), 0);
    assert!(matches!(buffer.copy_from_host(&[1]), Err(Error::DoesNotFit { requested: 1, capacity: 0, .. })));
}

/// What a `Buffer<'_>` cannot be: a struct holding a stream and memory ordered on it.
struct Staging {
    stream: cumempool::Stream,
    buffer: cumempool::OwnedBuffer,
}

/// Makes the stream and the buffer here and returns both: a borrowed buffer could not leave.
fn staging(pool: &MemPool, data: &[u8]) -> Staging {
    let stream = cumempool::Stream::new(&cumempool_tests::gpu().unwrap()).unwrap();
    let mut buffer = pool.alloc_owned(data.len(), &stream).unwrap();
    buffer.copy_from_host(data).unwrap();
    Staging { stream, buffer }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn an_owned_buffer_is_stored_beside_its_stream_returned_and_sent_to_another_thread() {
    let stream = gpu_stream().expect("a GPU");
    let pool = MemPool::new(Route::device(0)).unwrap();
    let data = pattern(1 << 20, 5);
    let Staging { stream: own_stream, buffer } = staging(&pool, &data);
    assert!(buffer.stream().same_as(&own_stream));
    assert_eq!(own_stream.handle_count(), 2, "the buffer holds a clone of its stream");
    drop(own_stream);
    // Its stream now lives only in the buffer, and the buffer crosses a thread.
    let buffer = std::thread::spawn(move || {
        let mut back = vec![0; 1 << 20];
        buffer.copy_to_host(&mut back).unwrap();
        assert_eq!(back, pattern(1 << 20, 5));
        buffer
    })
    .join()
    .unwrap();
    // Borrowed and owned buffers copy into each other.
    let mut borrowed = pool.alloc(data.len(), &stream).unwrap();
    borrowed.copy_from(&buffer).unwrap();
    let mut owned = pool.alloc_owned(data.len(), &stream).unwrap();
    owned.fill(0).unwrap();
    owned.copy_from(&borrowed).unwrap();
    let mut back = vec![0; data.len()];
    owned.copy_to_host(&mut back).unwrap();
    assert_eq!(back, data);
    drop((buffer, borrowed, owned));
    stream.synchronize().unwrap();
    assert_eq!(pool.used_mem_current().unwrap(), 0, "every owned buffer was freed on its stream");
    assert!(pool.alloc_owned(0, &stream).unwrap().is_empty());
}
