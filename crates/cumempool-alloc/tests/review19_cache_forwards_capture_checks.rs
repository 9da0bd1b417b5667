//! Adversarial review of issue 19: `CachingResource` is an adaptor, and the trait says adaptors
//! forward the capture checks to the resource below (`StreamOrderedResource::may_be_capturing`
//! and `is_capturing`). The cache does not: it answers the defaults (the stream's own mark, then
//! the driver), so a layer above it (another cache, an adaptor of the caller's) asks the driver
//! where the resource below answers otherwise, and misses a capture that resource reports. This
//! test failed when it was written. Alone in its binary: simulated captures are process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool_alloc::{CachingResource, HostHeap, Limit, StreamOrderedResource};
use support::fake_stream;

#[test]
fn a_cache_answers_the_capture_checks_of_the_resource_below() {
    let stream = fake_stream(0);
    let cache = CachingResource::new(HostHeap);
    let limited = Limit::new(CachingResource::new(HostHeap), 1 << 20);
    assert!(!HostHeap.may_be_capturing(&stream), "no simulated capture: the heap says none is possible");
    // Checked before any `is_capturing`: the defaults would hand this fake handle to a driver.
    assert!(!cache.may_be_capturing(&stream), "the cache answered its own default, not the heap's");
    assert!(!limited.may_be_capturing(&stream), "an adaptor above the cache got the cache's default");
    let capture = HostHeap::simulate_capture(&stream);
    assert!(cache.may_be_capturing(&stream));
    assert!(cache.is_capturing(&stream).unwrap(), "the capture the heap reports");
    assert!(limited.is_capturing(&stream).unwrap());
    drop(capture);
    assert!(!cache.is_capturing(&stream).unwrap());
}
