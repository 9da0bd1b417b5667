//! Fails when a header adds a member to an enum that grows (location types, allocation types,
//! pool attributes, handle types) that the safe layer neither maps nor lists as unmapped.

use crate::{AllocationType, HandleTypes, Location, PoolAttribute};
use cumempool_sys as sys;

// What the safe layer deliberately leaves unmapped, each with the reason: a header member in
// none of these lists and not mapped fails the tests below.

/// Raw `CUmemLocationType` values left without a [`Location`].
const UNMAPPED_LOCATION_TYPES: &[(u32, &str)] =
    &[(0x7FFF_FFFF, "CU_MEM_LOCATION_TYPE_MAX only forces the C enum to 32 bits; no location has it")];

/// Raw `CUmemAllocationType` values left without an [`AllocationType`].
const UNMAPPED_ALLOCATION_TYPES: &[(u32, &str)] = &[
    (0, "CU_MEM_ALLOCATION_TYPE_INVALID is the unset value; no pool has it"),
    (0x7FFF_FFFF, "CU_MEM_ALLOCATION_TYPE_MAX only forces the C enum to 32 bits"),
];

/// Raw `CUmemPool_attribute` values left unmapped.
const UNMAPPED_POOL_ATTRIBUTES: &[(u32, &str)] = &[];

/// Raw `CUmemAllocationHandleType` bits left unnamed by [`HandleTypes`].
const UNMAPPED_HANDLE_TYPES: &[(u32, &str)] =
    &[(0x7FFF_FFFF, "CU_MEM_HANDLE_TYPE_MAX only forces the C enum to 32 bits; it is no handle type")];

fn assert_covered(members: &[(&str, u32)], mapped: impl Fn(u32) -> bool, unmapped: &[(u32, &str)], list: &str) {
    for (name, value) in members {
        let listed = unmapped.iter().any(|(v, reason)| v == value && !reason.is_empty());
        assert!(
            mapped(*value) || listed,
            "cuda.h declares {name} = {value:#x}, which cumempool neither maps nor lists in {list} with a reason"
        );
    }
}

#[test]
fn every_location_type_is_mapped_or_listed() {
    let members: Vec<_> = sys::CUmemLocationType_MEMBERS.iter().map(|(n, v)| (*n, v.0)).collect();
    let mapped = |v| !matches!(Location::from_raw_parts(sys::CUmemLocationType(v), 0), Location::Unknown { .. });
    assert_covered(&members, mapped, UNMAPPED_LOCATION_TYPES, "UNMAPPED_LOCATION_TYPES");
}

#[test]
fn every_allocation_type_is_mapped_or_listed() {
    let members: Vec<_> = sys::CUmemAllocationType_MEMBERS.iter().map(|(n, v)| (*n, v.0)).collect();
    let mapped = |v| AllocationType::try_from(sys::CUmemAllocationType(v)).is_ok();
    assert_covered(&members, mapped, UNMAPPED_ALLOCATION_TYPES, "UNMAPPED_ALLOCATION_TYPES");
}

#[test]
fn every_pool_attribute_is_mapped_or_listed() {
    let members: Vec<_> = sys::CUmemPool_attribute_MEMBERS.iter().map(|(n, v)| (*n, v.0)).collect();
    let mapped = |v| PoolAttribute::from_raw(sys::CUmemPool_attribute(v)).is_some();
    assert_covered(&members, mapped, UNMAPPED_POOL_ATTRIBUTES, "UNMAPPED_POOL_ATTRIBUTES");
    let expected = if cfg!(feature = "cuda-13040") {
        15
    } else if cfg!(feature = "cuda-13020") {
        14
    } else {
        8
    };
    assert_eq!(PoolAttribute::ALL.len(), expected);
}

#[test]
fn every_handle_type_is_mapped_or_listed() {
    let members: Vec<_> = sys::CUmemAllocationHandleType_MEMBERS.iter().map(|(n, v)| (*n, v.0)).collect();
    let mapped = |v| HandleTypes::from_bits(v).is_known();
    assert_covered(&members, mapped, UNMAPPED_HANDLE_TYPES, "UNMAPPED_HANDLE_TYPES");
}

#[test]
fn the_check_itself_catches_a_new_member() {
    let result = std::panic::catch_unwind(|| {
        assert_covered(
            &[("CU_MEM_LOCATION_TYPE_FUTURE", 0x77)],
            |_| false,
            UNMAPPED_LOCATION_TYPES,
            "UNMAPPED_LOCATION_TYPES",
        )
    });
    assert!(result.is_err(), "an unmapped, unlisted member must fail the test");
}
