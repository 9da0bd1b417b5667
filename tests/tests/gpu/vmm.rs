//! The VMM layer on the GPU: granularity, physical memory, reservations, mappings, access and
//! sharing a physical allocation through a file descriptor.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::vmm::{AddressRange, AllocationProperties, PhysicalAllocation};
use cumempool::{Access, Error, HandleTypes, InvalidArgumentReason as Reason, Stream};
use cumempool_tests::device_bytes::{read, write};
use cumempool_tests::{gpu, pattern};

#[test]
#[ignore = "requires a CUDA GPU"]
fn granularity_is_a_power_of_two_and_recommended_is_a_multiple_of_minimum() {
    let Some(_context) = gpu() else { return };
    let granularity = AllocationProperties::device(0).granularity().unwrap();
    eprintln!("device 0: {granularity:?}");
    assert!(granularity.minimum.is_power_of_two(), "{granularity:?}");
    assert_eq!(granularity.recommended % granularity.minimum, 0, "{granularity:?}");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn mapped_memory_holds_bytes_and_outlives_its_physical_handle() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let props = AllocationProperties::device(0);
    let chunk = props.granularity().unwrap().minimum;
    let range = AddressRange::reserve(4 * chunk, chunk).unwrap();
    assert_eq!(range.base() % chunk as u64, 0, "the range is aligned as asked");
    for index in [0, 2] {
        let memory = PhysicalAllocation::create(&props, chunk).unwrap();
        range.map(index * chunk, &memory).unwrap();
        // The handle is released here; the mapping keeps the memory.
    }
    assert_eq!(range.mapped_bytes(), 2 * chunk);
    range.set_access(0, chunk, &[(0, Access::ReadWrite)]).unwrap();
    range.set_access(2 * chunk, chunk, &[(0, Access::ReadWrite)]).unwrap();
    let bytes = pattern(chunk, 5);
    write(range.base() + 2 * chunk as u64, &bytes, &stream);
    assert_eq!(read(range.base() + 2 * chunk as u64, chunk, &stream), bytes);
    // SAFETY: the stream is idle (read synchronised it).
    unsafe { range.unmap(2 * chunk) }.unwrap();
    assert_eq!(range.mapped_bytes(), chunk);
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn bad_sizes_offsets_and_overlaps_are_refused_before_the_driver() {
    let Some(_context) = gpu() else { return };
    let props = AllocationProperties::device(0);
    let chunk = props.granularity().unwrap().minimum;
    let odd = PhysicalAllocation::create(&props, chunk + 1).unwrap_err();
    let Error::InvalidArgument { reason: Reason::NotGranularityMultiple { value, granularity, .. }, .. } = odd else {
        panic!("{odd}")
    };
    assert_eq!((value, granularity), (chunk + 1, chunk));
    assert!(odd.to_string().contains("multiple"), "{odd}");
    let range = AddressRange::reserve(2 * chunk, chunk).unwrap();
    let memory = PhysicalAllocation::create(&props, chunk).unwrap();
    let outside = range.map(2 * chunk, &memory).unwrap_err();
    assert!(
        matches!(outside, Error::InvalidArgument { reason: Reason::OutsideReservedRange { reserved, .. }, .. } if reserved == 2 * chunk),
        "{outside}"
    );
    assert!(outside.to_string().contains("inside the reserved"), "{outside}");
    range.map(0, &memory).unwrap();
    let overlap = range.map(0, &memory).unwrap_err();
    assert!(
        matches!(overlap, Error::InvalidArgument { reason: Reason::OverlapsMapping { mapped_offset: 0, .. }, .. }),
        "{overlap}"
    );
    assert!(overlap.to_string().contains("overlap"), "{overlap}");
    // SAFETY: nothing mapped at that offset; refused before the driver.
    let nothing = unsafe { range.unmap(chunk) }.unwrap_err();
    assert!(matches!(nothing, Error::InvalidArgument { reason: Reason::NothingMapped { .. }, .. }), "{nothing}");
    assert!(nothing.to_string().contains("nothing is mapped"), "{nothing}");
    let empty = range.set_access(0, chunk, &[]).unwrap_err();
    assert!(matches!(empty, Error::InvalidArgument { reason: Reason::NoDevices, .. }), "{empty}");
    let zero = AddressRange::reserve(0, 0).unwrap_err();
    assert!(matches!(zero, Error::InvalidArgument { reason: Reason::ZeroSize, .. }), "{zero}");
    let three = AddressRange::reserve(chunk, 3).unwrap_err();
    assert!(
        matches!(three, Error::InvalidArgument { reason: Reason::AlignmentNotPowerOfTwo { alignment: 3 }, .. }),
        "{three}"
    );
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn exports_need_the_handle_type_the_memory_was_created_with() {
    let Some(_context) = gpu() else { return };
    let plain = AllocationProperties::device(0);
    let chunk = plain.granularity().unwrap().minimum;
    let memory = PhysicalAllocation::create(&plain, chunk).unwrap();
    let refused = memory.export_fd().unwrap_err();
    assert!(matches!(refused, Error::NotShareable { .. }) && refused.to_string().contains("POSIX_FILE_DESCRIPTOR"));
    let fabric = memory.export_fabric().unwrap_err();
    assert!(fabric.to_string().contains("FABRIC"), "{fabric}");
}

/// Import of a descriptor in the exporting process itself: the same physical memory mapped at
/// a second address (the cross-process path is the same calls, with the descriptor sent over a
/// socket as `descriptor_passing::send_fd` does).
#[test]
#[ignore = "requires a CUDA GPU"]
fn an_exported_descriptor_maps_the_same_memory_at_another_address() {
    let Some(context) = gpu() else { return };
    let stream = Stream::new(&context).unwrap();
    let props = AllocationProperties::device(0).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let chunk = props.granularity().unwrap().minimum;
    let memory = PhysicalAllocation::create(&props, chunk).unwrap();
    let first = AddressRange::reserve(chunk, chunk).unwrap();
    first.map(0, &memory).unwrap();
    first.set_access(0, chunk, &[(0, Access::ReadWrite)]).unwrap();
    let fd = memory.export_fd().unwrap();
    let imported = PhysicalAllocation::import_fd(&fd, chunk, &props).unwrap();
    let second = AddressRange::reserve(chunk, chunk).unwrap();
    second.map(0, &imported).unwrap();
    second.set_access(0, chunk, &[(0, Access::ReadWrite)]).unwrap();
    let bytes = pattern(chunk, 9);
    write(first.base(), &bytes, &stream);
    assert_eq!(read(second.base(), chunk, &stream), bytes, "both addresses show the same memory");
    // SAFETY: a descriptor number above any open file limit, never open: it is refused before
    // the driver (which would answer CUDA_ERROR_UNKNOWN) and never used.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(1 << 24) };
    let refused = PhysicalAllocation::import_fd(borrowed, chunk, &props).unwrap_err();
    assert!(refused.to_string().contains("not open"), "{refused}");
}

/// Without an IMEX channel every fabric import is refused before the driver (which is never
/// loaded for it), naming the missing service: runs everywhere, CI included.
#[test]
fn fabric_imports_are_refused_without_an_imex_channel() {
    if std::path::Path::new("/dev/nvidia-caps-imex-channels").exists() {
        eprintln!("skipped: this machine has IMEX channels");
        return;
    }
    let pool = cumempool::MemPool::import_fabric(&[1; 64]).unwrap_err();
    assert!(matches!(pool, Error::NotShareable { .. }) && pool.to_string().contains("IMEX"), "{pool}");
    let props = AllocationProperties::device(0).handle_types(HandleTypes::FABRIC);
    let memory = PhysicalAllocation::import_fabric(&[1; 64], 2 << 20, &props).unwrap_err();
    assert!(memory.to_string().contains("/dev/nvidia-caps-imex-channels"), "{memory}");
}
