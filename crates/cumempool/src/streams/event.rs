//! Events: points in a stream that other streams and the host can wait on, and the orderings
//! between streams made with them ([`Stream::wait`](crate::Stream::wait),
//! [`Stream::order_after`](crate::Stream::order_after)).

use crate::devices::context::Context;
use crate::driver::handle::DriverHandle;
use crate::driver::{driver_answer, driver_call};
use crate::error::Result;
use crate::streams::capture_mode;
use crate::streams::capture_state::refuse_host_wait_on_capturing_thread;
use crate::streams::stream::Stream;
use cumempool_sys as sys;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// A CUDA event without timing: a point in a stream that other streams and the host can wait on.
#[derive(Debug)]
pub struct Event {
    raw: DriverHandle<sys::CUevent>,
    context: Context,
    /// Set once the event was recorded on a stream that may be capturing: a stream that waits
    /// on it may join that capture.
    may_be_captured: AtomicBool,
}

impl Event {
    /// A new event in `context`.
    ///
    /// See [cuEventCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    pub fn new(context: &Context) -> Result<Self> {
        context.ensure_current()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { driver_call!(cuEventCreate(&mut raw, flags)) }?;
        Ok(Self { raw: DriverHandle(raw), context: context.clone(), may_be_captured: AtomicBool::new(false) })
    }

    /// The driver's handle.
    #[inline]
    pub fn as_raw(&self) -> sys::CUevent {
        self.raw.0
    }

    /// The context the event belongs to.
    pub(crate) fn context(&self) -> &Context {
        &self.context
    }

    /// Records the event at the current end of `stream`.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`](crate::Error::StreamCapturing) on the legacy stream while a
    /// blocking stream of its context captures (the driver would invalidate that capture); the
    /// driver's answer.
    #[inline]
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.refuse_blocked_legacy("recording an event (Event::record)")?;
        stream.bind()?;
        if stream.may_be_capturing() {
            self.may_be_captured.store(true, Relaxed);
        }
        // SAFETY: live event and stream.
        unsafe { driver_call!(cuEventRecord(self.raw.0, stream.as_raw())) }
    }

    /// Whether the work before the last record has finished, without waiting.
    ///
    /// A status query, like a host wait, is refused inside [`Stream::capture`]'s closure (the
    /// driver would invalidate the capture), and runs in relaxed capture mode otherwise, so
    /// captures other code runs are left intact.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`](crate::Error::StreamCapturing) inside [`Stream::capture`]'s
    /// closure; the driver's answer (`cuEventQuery`).
    pub fn is_complete(&self) -> Result<bool> {
        refuse_host_wait_on_capturing_thread("asking whether an event is complete (Event::is_complete)")?;
        // SAFETY: a live event.
        let answer = capture_mode::relaxed(|| unsafe { driver_answer!(cuEventQuery(self.raw.0)) })?;
        match answer.code {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            _ => Err(answer.error()),
        }
    }

    /// Waits on the host until the work before the last record has finished.
    ///
    /// Runs in relaxed capture mode, so captures other code runs (on this thread, or in global
    /// mode on any thread) are left intact.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`](crate::Error::StreamCapturing) inside [`Stream::capture`]'s
    /// closure (the driver's wait would invalidate the capture); the driver's answer.
    ///
    /// See [cuEventSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html).
    pub fn synchronize(&self) -> Result<()> {
        refuse_host_wait_on_capturing_thread("waiting for an event (Event::synchronize)")?;
        // SAFETY: a live event.
        capture_mode::relaxed(|| unsafe { driver_call!(cuEventSynchronize(self.raw.0)) })
    }
}

impl Event {
    /// Waits on the host for the work before the last record, where memory that work may still
    /// use is about to be released (an allocator's teardown, say). Unlike
    /// [`Event::synchronize`], nothing the library controls refuses it: not a
    /// [`Stream::capture`] closure on this thread (invalidating that capture is better than a
    /// use-after-free), nor a failed change of the thread's capture mode. The event must have
    /// been recorded on a stream that did not capture (a captured record is not scheduled to
    /// run, and the driver refuses the wait).
    ///
    /// # Errors
    /// The driver's answer; the caller must then keep the memory rather than release it.
    pub fn wait_before_release(&self) -> Result<()> {
        // SAFETY: a live event.
        capture_mode::relaxed_if_possible(|| unsafe { driver_call!(cuEventSynchronize(self.raw.0)) })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let result = self.context.while_current(|| {
            // SAFETY: an owned event, destroyed once.
            unsafe { driver_call!(cuEventDestroy(self.raw.0)) }
        });
        if let Err(error) = result {
            tracing::warn!(%error, "destroying an event failed");
        }
    }
}

impl Stream {
    /// Makes later work on this stream wait for `event`.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`](crate::Error::StreamCapturing) for the legacy stream while a
    /// blocking stream of its context captures (the driver would invalidate that capture); the
    /// driver's answer.
    ///
    /// See [cuStreamWaitEvent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.refuse_blocked_legacy("making a stream wait for an event (Stream::wait)")?;
        self.bind()?;
        // Waiting on an event recorded during a capture joins that capture.
        if event.may_be_captured.load(Relaxed) {
            self.note_capture_possible();
        }
        // SAFETY: live stream and event.
        unsafe { driver_call!(cuStreamWaitEvent(self.as_raw(), event.as_raw(), 0)) }
    }

    /// Makes later work on this stream wait for the work queued on `other` so far: an event
    /// recorded on `other` (in its context), or, for a stream borrowed without its context, a
    /// host wait for `other`. Layers above use it to order work on one stream with memory whose
    /// free is queued on another (as [`BufferOn::copy_from_async`](crate::BufferOn::copy_from_async)
    /// does, an event each way).
    ///
    /// # Errors
    /// The driver's refusals; the host wait's (refused inside [`Stream::capture`]'s closure).
    pub fn order_after(&self, other: &Stream) -> Result<()> {
        match other.context() {
            Some(context) => {
                let ready = Event::new(context)?;
                ready.record(other)?;
                self.wait(&ready)
            }
            None => other.synchronize(),
        }
    }
}
