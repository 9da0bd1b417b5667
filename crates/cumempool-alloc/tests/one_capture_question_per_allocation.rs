//! How many times a cache asks whether a stream captures, on a stream where one may be underway
//! (one lent to other code): an allocation that refuses captures asks once, not once for the
//! refusal and again inside the cache.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use cumempool_alloc::{
    CachingResource, HostHeap, HostMemory, Limit, OnOutOfMemory, Result, Statistics, StreamOrderedResource, Traced,
    Tracking,
};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use support::fake_stream;

/// The host heap, for which every stream may be capturing (marked), as a lent stream is: it
/// counts the questions, answers `capturing` (or the driver's error, with `unanswerable`), and
/// counts what it allocates.
#[derive(Default)]
struct LentStreams {
    questions: AtomicUsize,
    allocations: AtomicUsize,
    capturing: AtomicBool,
    unanswerable: AtomicBool,
    /// The next this many questions fail.
    failing: AtomicUsize,
    /// Counts answered questions down: the one that brings it to 0 is answered, then a capture
    /// begins.
    capture_after: AtomicUsize,
}

// SAFETY: the host heap's memory and promise; every stream marked, which is never wrong.
unsafe impl StreamOrderedResource for LentStreams {
    type Kind = HostMemory;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        self.allocations.fetch_add(1, Relaxed);
        HostHeap.allocate(bytes, align, stream)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // SAFETY: forwarded under the caller's promise (allocated by the heap above).
        unsafe { HostHeap.deallocate(ptr, bytes, align, stream) }
    }

    fn is_capturing(&self, _stream: &Stream) -> Result<bool> {
        self.questions.fetch_add(1, Relaxed);
        let failing = self.failing.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok();
        if failing || self.unanswerable.load(Relaxed) {
            return Err(cumempool_alloc::Error::Pool(cumempool::Error::StreamCapturing {
                operation: "asking the stand-in",
                capture: None,
            }));
        }
        let answer = self.capturing.load(Relaxed);
        if self.capture_after.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1) {
            self.capturing.store(true, Relaxed);
        }
        Ok(answer)
    }

    fn marked_stream_id(&self, stream: &Stream) -> NonZeroU64 {
        stream.id().get_nonzero() | Stream::CAPTURE_MARK
    }
}

#[test]
fn an_allocation_that_refuses_captures_asks_once_and_is_served_from_the_cache() {
    let cache = CachingResource::new(LentStreams::default());
    let below = cache.inner();
    let stream = fake_stream(0);
    let first = cache.allocate_unless_capturing(4096, 256, &stream).unwrap().expect("no capture");
    assert_eq!(below.questions.load(Relaxed), 1, "one question for the allocation");
    // SAFETY: allocated just above with these arguments.
    unsafe { cache.deallocate(first, 4096, 256, &stream) }.unwrap();
    assert_eq!(below.questions.load(Relaxed), 2, "one for the free, which the cache keeps");
    let again = cache.allocate_unless_capturing(4096, 256, &stream).unwrap().expect("no capture");
    assert_eq!((again, below.questions.load(Relaxed)), (first, 3), "the kept block, for one question");
    assert_eq!(below.allocations.load(Relaxed), 1, "one allocation below in all");
    // SAFETY: allocated just above with these arguments.
    unsafe { cache.deallocate(again, 4096, 256, &stream) }.unwrap();
}

#[test]
fn an_allocation_that_refuses_captures_allocates_nothing_during_one_or_without_an_answer() {
    let cache = CachingResource::new(LentStreams::default());
    let below = cache.inner();
    let stream = fake_stream(1);
    below.capturing.store(true, Relaxed);
    assert_eq!(cache.allocate_unless_capturing(4096, 256, &stream).unwrap(), None, "a capture underway");
    below.capturing.store(false, Relaxed);
    below.unanswerable.store(true, Relaxed);
    assert_eq!(cache.allocate_unless_capturing(4096, 256, &stream).unwrap(), None, "no answer");
    assert_eq!((below.questions.load(Relaxed), below.allocations.load(Relaxed)), (2, 0));
    assert!(cache.allocate_unless_capturing(4096, 512, &stream).is_err(), "an alignment no pool gives");
}

#[test]
fn the_convenient_alloc_asks_once_and_refuses_a_capture() {
    let cache = CachingResource::new(LentStreams::default());
    let below = cache.inner();
    let stream = fake_stream(2);
    let allocation = cache.alloc(4096, &stream).unwrap();
    assert_eq!(below.questions.load(Relaxed), 1, "asked once, not before the cache and again inside it");
    drop(allocation);
    below.capturing.store(true, Relaxed);
    let refused = cache.alloc(4096, &stream).unwrap_err();
    assert!(refused.to_string().contains("StreamOrderedResource::alloc"), "{refused}");
    below.capturing.store(false, Relaxed);
    below.unanswerable.store(true, Relaxed);
    let unanswered = cache.alloc(4096, &stream).unwrap_err();
    assert!(unanswered.to_string().contains("asking the stand-in"), "the question's own error: {unanswered}");
}

#[test]
fn the_convenient_alloc_refuses_a_capture_begun_after_it_asked_for_the_reason() {
    // The first question has no answer; the second, asked for the reason, finds no capture,
    // and one begins right after it. What is allocated then would be graph memory in an
    // Allocation: refused instead, with nothing allocated.
    let cache = CachingResource::new(LentStreams::default());
    let below = cache.inner();
    let stream = fake_stream(3);
    below.failing.store(1, Relaxed);
    below.capture_after.store(1, Relaxed);
    let refused = cache.alloc(4096, &stream).unwrap_err();
    assert!(refused.to_string().contains("StreamOrderedResource::alloc"), "{refused}");
    assert_eq!(below.allocations.load(Relaxed), 0, "nothing allocated during the capture");
}

/// Whether `resource`'s allocation that refuses captures asks `below` one question, is served,
/// and allocates nothing during a capture.
fn asks_once_and_refuses_a_capture<R: StreamOrderedResource>(layer: &str, resource: &R, below: &LentStreams) {
    let stream = fake_stream(4);
    let asked = below.questions.load(Relaxed);
    let ptr = resource.allocate_unless_capturing(4096, 256, &stream).unwrap();
    let ptr = ptr.unwrap_or_else(|| panic!("{layer}: no capture, yet nothing allocated"));
    assert_eq!(
        below.questions.load(Relaxed) - asked,
        1,
        "{layer}: one question, not one above the cache and one in it"
    );
    // SAFETY: allocated just above with these arguments.
    unsafe { resource.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    below.capturing.store(true, Relaxed);
    let during = resource.allocate_unless_capturing(4096, 256, &stream).unwrap();
    below.capturing.store(false, Relaxed);
    assert_eq!(during, None, "{layer}: allocated during a capture");
}

#[test]
fn adaptors_above_the_cache_hand_the_one_question_down_and_count_only_what_they_allocate() {
    let cache = CachingResource::new(LentStreams::default());
    let below = cache.inner();
    let statistics = Statistics::new(&cache);
    asks_once_and_refuses_a_capture("Statistics", &statistics, below);
    assert_eq!((statistics.usage().current_count, statistics.usage().total_count), (0, 1), "the refusal uncounted");
    let limit = Limit::new(&cache, 1 << 20);
    asks_once_and_refuses_a_capture("Limit", &limit, below);
    assert_eq!(limit.in_use(), 0, "the refusal's claim given back");
    let tracking = Tracking::new(&cache);
    asks_once_and_refuses_a_capture("Tracking", &tracking, below);
    assert!(tracking.outstanding().is_empty(), "the refusal unrecorded");
    asks_once_and_refuses_a_capture("Traced", &Traced::new(&cache, "cache"), below);
    asks_once_and_refuses_a_capture("OnOutOfMemory", &OnOutOfMemory::new(&cache, |_, _| false), below);
    asks_once_and_refuses_a_capture("a stack of them", &Statistics::new(Limit::new(&cache, 1 << 20)), below);
}

#[test]
fn a_limit_gives_back_its_claim_where_the_allocation_below_refuses_a_capture() {
    let limit = Limit::new(CachingResource::new(LentStreams::default()), 8192);
    let stream = fake_stream(5);
    limit.inner().inner().capturing.store(true, Relaxed);
    for _ in 0..3 {
        assert_eq!(limit.allocate_unless_capturing(4096, 256, &stream).unwrap(), None);
    }
    assert_eq!(limit.in_use(), 0, "three refusals claimed nothing of the limit");
}

#[test]
fn a_limit_at_its_limit_answers_none_during_a_capture_and_no_out_of_memory_callback_runs() {
    // The limit is spent when a capture is underway: the answer is the capture's (`None`), as
    // the resource below would give it, not the limit's out-of-memory, which would run an
    // out-of-memory callback above (its code inside the capture) for an allocation refused
    // anyway.
    let limit = Limit::new(CachingResource::new(LentStreams::default()), 4096);
    let below = limit.inner().inner();
    let stream = fake_stream(6);
    let held = limit.allocate_unless_capturing(4096, 256, &stream).unwrap().expect("no capture");
    below.capturing.store(true, Relaxed);
    assert_eq!(limit.allocate_unless_capturing(4096, 256, &stream).unwrap(), None, "a capture underway");
    let callbacks = AtomicUsize::new(0);
    let on_oom = OnOutOfMemory::new(&limit, |_, _| {
        callbacks.fetch_add(1, Relaxed);
        false
    });
    assert_eq!(on_oom.allocate_unless_capturing(4096, 256, &stream).unwrap(), None, "a capture underway");
    assert_eq!(callbacks.load(Relaxed), 0, "no callback for an allocation a capture refuses");
    let refused = limit.alloc(4096, &stream).unwrap_err();
    assert!(refused.to_string().contains("StreamOrderedResource::alloc"), "the capture's refusal: {refused}");
    below.capturing.store(false, Relaxed);
    below.unanswerable.store(true, Relaxed);
    assert_eq!(limit.allocate_unless_capturing(4096, 256, &stream).unwrap(), None, "no answer");
    below.unanswerable.store(false, Relaxed);
    assert!(limit.allocate_unless_capturing(4096, 256, &stream).unwrap_err().is_out_of_memory(), "no capture");
    assert_eq!((limit.in_use(), below.allocations.load(Relaxed)), (4096, 1));
    // SAFETY: allocated above with these arguments.
    unsafe { limit.deallocate(held, 4096, 256, &stream) }.unwrap();
}
