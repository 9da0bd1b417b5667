//! Its own process: it forks, and the child must not inherit other tests' threads holding locks.
//!
//! A cache used in a child forked after it was made: lanes that the parent's other threads were
//! inside at the fork stay marked busy in the child for ever (found by review), so claims there
//! are refused with a typed error instead of waiting.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(target_os = "linux")]

mod support;

use cumempool_alloc::{CachingResource, Error, HostHeap};
use support::{exit_code_of_forked, fake_stream, fill_this_threads_lane};

#[test]
fn release_in_a_forked_child_answers_instead_of_waiting() {
    let cache = CachingResource::new(HostHeap);
    let stream = fake_stream(0);
    fill_this_threads_lane(&cache, &stream, 4096);
    let code = exit_code_of_forked(|| match cache.release() {
        Err(Error::LanesUnreachable { reason }) if reason.contains("forked") => 0,
        _ => 1,
    });
    assert_eq!(code, 0, "the child's release did not answer as expected");
    // The parent's cache is untouched by the child.
    assert_eq!(cache.stats().cached_blocks, 3);
    cache.release().unwrap();
}
