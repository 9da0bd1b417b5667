//! A cache used in a child forked after it was made: lanes that the parent's other threads were
//! inside at the fork stay marked busy in the child for ever (found by review), so claims there
//! are refused with a typed error instead of waiting. Alone in its binary: the child must not
//! inherit other tests' threads holding locks.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(target_os = "linux")]

use cumempool::Stream;
use cumempool_alloc::{CachingResource, Error, HostHeap, StreamOrderedResource};

#[test]
fn release_in_a_forked_child_answers_instead_of_waiting() {
    let cache = CachingResource::new(HostHeap);
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    let stream = unsafe { Stream::borrow_raw(0x100 as cumempool::sys::CUstream, None) }.unwrap();
    // Three cached frees: slot, lanes, this thread's lane.
    let blocks = [(); 3].map(|()| cache.allocate(4096, 256, &stream).unwrap());
    for ptr in blocks {
        unsafe { cache.deallocate(ptr, 4096, 256, &stream) }.unwrap();
    }
    // SAFETY: the child only calls the cache and exits with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = match cache.release() {
            Err(Error::LanesUnreachable { reason }) if reason.contains("forked") => 0,
            _ => 1,
        };
        // SAFETY: ends the child without running the parent's destructors twice.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's release did not answer as expected: {status}"
    );
    // The parent's cache is untouched by the child.
    assert_eq!(cache.stats().cached_blocks, 3);
    cache.release().unwrap();
}
