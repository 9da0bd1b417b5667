//! Streams and events on the real driver: their drops leave the calling thread's current
//! context as it was.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::{self, CUresult};
use cumempool::{Event, Stream};
use cumempool_tests::gpu;

fn current() -> sys::CUcontext {
    let mut current = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { sys::driver().unwrap().cuCtxGetCurrent().unwrap()(&mut current) }, CUresult::CUDA_SUCCESS);
    current
}

fn set_current(context: sys::CUcontext) {
    // SAFETY: null (no context) or a live context.
    assert_eq!(unsafe { sys::driver().unwrap().cuCtxSetCurrent().unwrap()(context) }, CUresult::CUDA_SUCCESS);
}

/// Failed before the drops restored the context: they left the stream's context current.
#[test]
#[ignore = "requires a CUDA GPU"]
fn dropping_a_stream_or_an_event_leaves_no_context_current_where_there_was_none() {
    let context = gpu().expect("a GPU");
    // On a fresh thread, so no other test's current context is in the way.
    std::thread::spawn(move || {
        let stream = Stream::new(&context).unwrap();
        let event = Event::new(&context).unwrap();
        event.record(&stream).unwrap();
        set_current(std::ptr::null_mut());
        drop(event);
        assert!(current().is_null(), "dropping an event made a context current");
        drop(stream);
        assert!(current().is_null(), "dropping a stream made a context current");
        let stream = Stream::new(&context).unwrap();
        assert_eq!(current(), context.as_raw());
        drop(stream);
        assert_eq!(current(), context.as_raw(), "a context current before stays current");
    })
    .join()
    .unwrap();
}
