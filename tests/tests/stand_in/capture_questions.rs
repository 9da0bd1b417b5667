//! Asking a default stream whether it captures, with the caller's current context kept
//! (`Stream::capture_status_keeping_context`, which the Python plug-ins ask at every allocation
//! on a default stream), on the stand-in libcuda of `cumempool_tests::stand_in_driver`. What
//! the questions answer while a blocking stream captures is in `the_per_thread_stream`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{CaptureStatus, Error, Stream};
use cumempool_tests::stand_in_driver::{queries, stand_in};

#[test]
fn the_legacy_streams_question_reads_the_current_context_once_where_its_context_is_current() {
    let Some((_serial, context)) = stand_in() else { return };
    let legacy = Stream::legacy(&context);
    let (contexts, captures) = context
        .while_current(|| {
            let before = (queries("context_queries"), queries("capture_queries"));
            assert_eq!(legacy.capture_status_keeping_context()?, CaptureStatus::None);
            Ok::<_, Error>((queries("context_queries") - before.0, queries("capture_queries") - before.1))
        })
        .unwrap();
    assert_eq!((contexts, captures), (1, 1), "context reads, capture questions");
}

#[test]
fn the_question_puts_back_no_context_on_a_thread_that_had_none() {
    let Some((_serial, context)) = stand_in() else { return };
    let per_thread = Stream::legacy_for_per_thread(&context);
    let legacy = Stream::legacy(&context);
    std::thread::spawn(move || {
        assert_eq!(cumempool::current_device().unwrap(), None);
        assert_eq!(legacy.capture_status_keeping_context().unwrap(), CaptureStatus::None);
        assert_eq!(per_thread.capture_status_keeping_context().unwrap(), CaptureStatus::None);
        assert_eq!(cumempool::current_device().unwrap(), None, "the thread was left on a context");
    })
    .join()
    .unwrap();
}
