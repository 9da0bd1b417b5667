//! Its own process: a simulated capture marks every stream of the process as capturing.
//!
//! Every layer that wraps a resource answers the capture checks
//! (`StreamOrderedResource::marked_stream_id` and `is_capturing`) of the resource below, as the
//! trait asks: otherwise a layer above it (a cache over an adaptor, an adaptor over a cache)
//! asks the driver where the resource below answers otherwise, and misses a capture that
//! resource reports. The host heap's simulated captures stand in for a driver's; the tests of
//! this binary take turns on `CAPTURES`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::Stream;
use cumempool_alloc::{
    CachingResource, CaptureMark, HostHeap, Limit, OnOutOfMemory, Statistics, StreamOrderedResource, Traced, Tracking,
};
use std::sync::{Arc, Mutex};
use support::fake_stream;

static CAPTURES: Mutex<()> = Mutex::new(());

/// Whether `resource` reports no capture on `stream`, then the heap's simulated one, then none.
fn follows_the_heap(name: &str, resource: &impl StreamOrderedResource, stream: &Stream) {
    // Checked before any `is_capturing`: the defaults would hand this fake handle to a driver.
    assert!(!resource.may_be_capturing(stream), "{name}: answered its own default, not the heap's");
    assert!(!resource.is_capturing(stream).unwrap(), "{name}");
    // The id a cache above compares with its lanes' keys carries the same answer.
    let id = stream.id().get();
    assert_eq!(resource.marked_stream_id(stream).get(), id, "{name}: marked its own way, not the heap's");
    let capture = HostHeap::simulate_capture(stream);
    assert!(resource.may_be_capturing(stream), "{name}: missed the capture below");
    assert!(resource.is_capturing(stream).unwrap(), "{name}: missed the capture below");
    assert_eq!(resource.marked_stream_id(stream).get(), id | Stream::CAPTURE_MARK, "{name}: an unmarked id");
    drop(capture);
    assert!(!resource.is_capturing(stream).unwrap(), "{name}: a capture that ended");
    assert_eq!(resource.marked_stream_id(stream).get(), id, "{name}: still marked");
}

#[test]
fn a_cache_answers_the_capture_checks_of_the_resource_below() {
    let _captures = CAPTURES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let stream = fake_stream(0);
    assert!(!HostHeap.may_be_capturing(&stream), "no simulated capture: the heap says none is possible");
    follows_the_heap("a cache", &CachingResource::new(HostHeap), &stream);
    follows_the_heap("a limit over a cache", &Limit::new(CachingResource::new(HostHeap), 1 << 20), &stream);
    follows_the_heap("a cache over a cache", &CachingResource::new(CachingResource::new(HostHeap)), &stream);
}

#[test]
fn every_adaptor_answers_the_capture_checks_of_the_resource_below() {
    let _captures = CAPTURES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let stream = fake_stream(1);
    follows_the_heap("Limit", &Limit::new(HostHeap, 1 << 20), &stream);
    follows_the_heap("OnOutOfMemory", &OnOutOfMemory::new(HostHeap, |_, _| false), &stream);
    follows_the_heap("Statistics", &Statistics::new(HostHeap), &stream);
    follows_the_heap("Traced", &Traced::new(HostHeap, "test"), &stream);
    follows_the_heap("Tracking", &Tracking::new(HostHeap), &stream);
    follows_the_heap("a reference", &&HostHeap, &stream);
    follows_the_heap("an Arc", &Arc::new(HostHeap), &stream);
    let stack =
        Traced::new(Tracking::new(Statistics::new(CachingResource::new(Limit::new(HostHeap, 1 << 20)))), "stack");
    follows_the_heap("a stack of every layer", &stack, &stream);
}
