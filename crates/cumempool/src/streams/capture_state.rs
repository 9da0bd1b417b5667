//! Whether a stream captures (`CaptureStatus`, asked of the driver), and the captures
//! [`Stream::capture`](crate::Stream::capture) has underway on the calling thread, on which host
//! waits are refused.

use crate::driver::driver_call;
use crate::error::{Error, Result};
use cumempool_sys as sys;

thread_local! {
    /// The innermost [`Stream::capture`](crate::Stream::capture) underway on this thread, if any (its id).
    static THREAD_CAPTURE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    /// The check a [`CaptureChecked`] holds on this thread: the stream's id, and the guard's
    /// token; `(0, 0)` for none.
    static CHECKED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    /// The last token handed to a [`CaptureChecked`] on this thread.
    static TOKENS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A stream found not capturing by [`Stream::with_capture_checked`](crate::Stream::with_capture_checked),
/// and so taken as not capturing on the calling thread while the call it runs lasts. Made and
/// dropped there only, so no safe code can keep it (a guard forgotten with `mem::forget` would
/// answer "not capturing" for the stream on this thread for good).
///
/// One check holds per thread: a guard made while another holds makes none of its own (the
/// later calls ask the driver as before), so guards dropped in any order never leave a check
/// behind. Code that runs what the call does not control (a callback, a finalizer) calls
/// [`forget_capture_checks`] first.
#[derive(Debug)]
pub(crate) struct CaptureChecked {
    /// The token this guard set, or 0 where it set none.
    token: u64,
    /// Dropped on the thread whose check it holds.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CaptureChecked {
    /// Holds the check for stream `id` on this thread, unless another holds.
    pub(crate) fn hold(id: u64) -> Self {
        if CHECKED.with(std::cell::Cell::get).1 != 0 {
            return Self { token: 0, _not_send: std::marker::PhantomData };
        }
        let token = TOKENS.with(|t| {
            let next = t.get().wrapping_add(1).max(1);
            t.set(next);
            next
        });
        CHECKED.with(|c| c.set((id, token)));
        Self { token, _not_send: std::marker::PhantomData }
    }
}

impl Drop for CaptureChecked {
    fn drop(&mut self) {
        // Only its own check: one forgotten or held by no guard of this one stays as it is.
        if self.token != 0 {
            CHECKED.with(|c| {
                if c.get().1 == self.token {
                    c.set((0, 0));
                }
            });
        }
    }
}

/// Whether a [`CaptureChecked`] holds for stream `id` on this thread.
#[inline]
pub(crate) fn checked_not_capturing(id: u64) -> bool {
    CHECKED.with(std::cell::Cell::get).0 == id
}

/// Ends the capture check [`Stream::with_capture_checked`](crate::Stream::with_capture_checked)
/// holds on the calling thread, so that what follows asks the driver again: for code about to
/// run what the call does not control, such as an out-of-memory callback or a finalizer that
/// could begin a capture on the stream.
pub fn forget_capture_checks() {
    CHECKED.with(|c| c.set((0, 0)));
}

/// Marks a [`Stream::capture`](crate::Stream::capture) as underway on this thread until dropped (the previous mark is
/// restored, for captures begun inside another's closure).
#[derive(Debug)]
pub(crate) struct ThreadCapture {
    previous: Option<u64>,
}

impl ThreadCapture {
    pub(crate) fn enter(id: u64) -> Self {
        Self { previous: THREAD_CAPTURE.with(|c| c.replace(Some(id))) }
    }
}

impl Drop for ThreadCapture {
    fn drop(&mut self) {
        THREAD_CAPTURE.with(|c| c.set(self.previous));
    }
}

/// Refuses a host wait or query on a thread where a [`Stream::capture`](crate::Stream::capture) is underway, whatever
/// the stream: in thread-local mode the driver answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED for
/// `cuStreamSynchronize`, `cuStreamQuery` and `cuEventSynchronize` even on a stream that does
/// not capture, and invalidates the capture (docs/driver-behaviour.md). Host waits are not hot
/// paths: one thread-local read.
pub(crate) fn refuse_host_wait_on_capturing_thread(operation: &'static str) -> Result<()> {
    match THREAD_CAPTURE.with(std::cell::Cell::get) {
        Some(id) => Err(Error::StreamCapturing { operation, capture: Some(id) }),
        None => Ok(()),
    }
}

/// Whether work queued on a stream runs, or is recorded into a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CaptureStatus {
    /// No capture: queued work runs.
    None,
    /// Queued work is recorded into the capture with this id (unique in the process).
    Active {
        /// The capture's id (`cuStreamGetCaptureInfo`).
        id: u64,
    },
    /// A capture is underway but was invalidated by an operation it could not record; it only
    /// waits to be ended.
    Invalidated {
        /// The capture's id.
        id: u64,
    },
}

impl CaptureStatus {
    pub(crate) fn from_raw(status: sys::CUstreamCaptureStatus, id: u64) -> Result<Self> {
        use sys::CUstreamCaptureStatus as S;
        match status {
            S::CU_STREAM_CAPTURE_STATUS_NONE => Ok(Self::None),
            S::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Self::Active { id }),
            S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => Ok(Self::Invalidated { id }),
            other => Err(crate::UnknownValue { type_name: "CUstreamCaptureStatus", value: i64::from(other.0) }.into()),
        }
    }

    /// The id of the capture underway, if any.
    pub fn id(self) -> Option<u64> {
        match self {
            Self::None => None,
            Self::Active { id } | Self::Invalidated { id } => Some(id),
        }
    }
}

/// Whether `stream` (a live stream, bound) captures: `cuStreamGetCaptureInfo`.
pub(crate) fn capture_info(stream: sys::CUstream) -> Result<CaptureStatus> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: a live stream; valid out-pointers, the optional ones null.
    unsafe {
        driver_call!(cuStreamGetCaptureInfo(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut()
        ))
    }?;
    CaptureStatus::from_raw(status, id)
}

#[cfg(test)]
mod tests {
    use super::{checked_not_capturing, forget_capture_checks, CaptureChecked};

    #[test]
    fn a_check_holds_while_its_guard_lives() {
        let held = CaptureChecked::hold(5);
        assert!(checked_not_capturing(5) && !checked_not_capturing(6));
        drop(held);
        assert!(!checked_not_capturing(5));
    }

    #[test]
    fn guards_dropped_in_any_order_leave_no_check_behind() {
        let outer = CaptureChecked::hold(5);
        let inner = CaptureChecked::hold(6);
        assert!(!checked_not_capturing(6), "a second check while one holds makes none");
        drop(outer);
        assert!(!checked_not_capturing(5));
        drop(inner);
        assert!(!checked_not_capturing(5) && !checked_not_capturing(6));
    }

    #[test]
    fn a_forgotten_check_stays_forgotten() {
        let first = CaptureChecked::hold(5);
        forget_capture_checks();
        assert!(!checked_not_capturing(5));
        let second = CaptureChecked::hold(7);
        drop(first);
        assert!(checked_not_capturing(7), "the forgotten guard's drop cleared another's check");
        drop(second);
        assert!(!checked_not_capturing(7));
    }
}
