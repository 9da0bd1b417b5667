//! Raw pool allocations made during a stream capture, and what a raw free of one must do.
//!
//! [`Pool::alloc_raw`](crate::Pool::alloc_raw) on a capturing stream records an allocation node:
//! the address belongs to the graph's memory (driver 580: not the pool's, whatever its cap), and
//! is live only while the graph runs. Allocator layers that keep their own books (such as
//! `cumempool-alloc`'s pool resource) free such addresses through [`free_async`](crate::free_async),
//! which looks them up here to decide between a free node, a deferred free and a free outside
//! the graph.

use crate::streams::capture_state::CaptureStatus;
use cumempool_sys as sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

/// Address -> id of the capture that allocated it, for raw allocations made during captures and
/// not freed yet.
static CAPTURED: Mutex<Option<HashMap<sys::CUdeviceptr, u64>>> = Mutex::new(None);

/// How many entries [`CAPTURED`] holds: the free path reads this (one relaxed load) and takes
/// the lock only when some captured allocation is outstanding.
static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);

fn with_map<R>(f: impl FnOnce(&mut HashMap<sys::CUdeviceptr, u64>) -> R) -> R {
    let mut guard = CAPTURED.lock().unwrap_or_else(PoisonError::into_inner);
    let map = guard.get_or_insert_with(HashMap::new);
    let result = f(map);
    OUTSTANDING.store(map.len(), Relaxed);
    result
}

/// Records `ptr` as allocated during the capture `capture`.
pub(crate) fn record(ptr: sys::CUdeviceptr, capture: u64) {
    with_map(|map| map.insert(ptr, capture));
}

/// The capture that allocated `ptr`, if it is an outstanding captured allocation.
fn lookup(ptr: sys::CUdeviceptr) -> Option<u64> {
    if OUTSTANDING.load(Relaxed) == 0 {
        return None;
    }
    with_map(|map| map.get(&ptr).copied())
}

/// Removes `ptr` and answers the capture that allocated it: its free is now decided.
fn take(ptr: sys::CUdeviceptr) -> Option<u64> {
    if OUTSTANDING.load(Relaxed) == 0 {
        return None;
    }
    with_map(|map| map.remove(&ptr))
}

/// Whether `ptr` was allocated through [`Pool::alloc_raw`](crate::Pool::alloc_raw) during a
/// stream capture and not freed since: graph memory, not the pool's. Caches ask this on slow
/// paths and never keep such an address for reuse outside its graph.
pub fn is_captured_allocation(ptr: sys::CUdeviceptr) -> bool {
    lookup(ptr).is_some()
}

/// What a stream-ordered free of one address must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreeAction {
    /// `cuMemFreeAsync` on the stream: it runs (no capture), or it is recorded as a free node
    /// of the capture that allocated the address.
    Free,
    /// Keep it until the stream's capture ends, then free it: a free node cannot free memory
    /// the graph did not allocate, and the free must run after the stream's pre-capture work.
    Defer,
}

/// The decision for freeing `ptr` on a stream in `status`, given the capture that allocated it
/// (if any); pure, so the rules are tested without a driver.
///
/// Graph memory of a capture that ended (the graph has an allocation node and no free node for
/// it) is freed as asked, outside the graph: `free_async`'s caller promises the free is ordered
/// after the graph's launch that uses it; before any launch the driver refuses it
/// (CUDA_ERROR_INVALID_VALUE), and a later launch of an executable instantiated without
/// auto-free-on-launch needs it freed.
pub(crate) fn free_action(status: CaptureStatus, allocated_under: Option<u64>) -> FreeAction {
    match (status.id(), allocated_under) {
        (Some(capture), Some(allocated)) if capture == allocated => FreeAction::Free,
        (Some(_), _) => FreeAction::Defer,
        (None, _) => FreeAction::Free,
    }
}

/// Decides for `ptr` on a stream in `status`, and forgets the address once its free is decided.
pub(crate) fn decide(ptr: sys::CUdeviceptr, status: CaptureStatus) -> FreeAction {
    free_action(status, take(ptr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_is_recorded_in_its_own_capture_deferred_in_another_and_freed_as_asked_after() {
        let active = |id| CaptureStatus::Active { id };
        assert_eq!(free_action(CaptureStatus::None, None), FreeAction::Free, "no capture: an ordinary free");
        assert_eq!(free_action(active(7), Some(7)), FreeAction::Free, "a free node of its own capture");
        assert_eq!(free_action(active(7), None), FreeAction::Defer, "memory from outside the capture");
        assert_eq!(free_action(CaptureStatus::Invalidated { id: 7 }, None), FreeAction::Defer);
        assert_eq!(free_action(CaptureStatus::None, Some(7)), FreeAction::Free, "its capture ended: freed as asked");
        assert_eq!(
            free_action(active(8), Some(7)),
            FreeAction::Defer,
            "another capture's graph memory: after this one"
        );
    }

    #[test]
    fn captured_addresses_are_known_until_their_free_is_decided() {
        let ptr = 0xdead_0000;
        assert!(!is_captured_allocation(ptr));
        record(ptr, 42);
        assert!(is_captured_allocation(ptr));
        assert_eq!(decide(ptr, CaptureStatus::Active { id: 42 }), FreeAction::Free);
        assert!(!is_captured_allocation(ptr), "a recorded free forgets the address");
        record(ptr, 43);
        assert_eq!(decide(ptr, CaptureStatus::None), FreeAction::Free, "after its capture: freed as asked");
        assert!(!is_captured_allocation(ptr), "forgotten once its free is decided");
        assert_eq!(decide(ptr, CaptureStatus::Active { id: 44 }), FreeAction::Defer, "unknown now: outside memory");
    }
}
