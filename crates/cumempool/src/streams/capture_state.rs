//! Whether a stream captures (`CaptureStatus`, asked of the driver), and the captures
//! [`Stream::capture`](crate::Stream::capture) has underway on the calling thread, on which host
//! waits are refused.

use crate::driver::driver_call;
use crate::error::{Error, Result};
use cumempool_sys as sys;

thread_local! {
    /// The innermost [`Stream::capture`](crate::Stream::capture) underway on this thread, if any (its id).
    static THREAD_CAPTURE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
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

/// `CU_STREAM_LEGACY`: the legacy default stream of the current context, like `0`.
pub(crate) const LEGACY_HANDLE: usize = 0x1;

/// Whether `raw` names the legacy stream of the current context (`0` or `CU_STREAM_LEGACY`):
/// the stream the driver refuses work on while a blocking stream of the context captures.
pub(crate) fn is_legacy_handle(raw: sys::CUstream) -> bool {
    matches!(raw as usize, 0 | LEGACY_HANDLE)
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

/// What captures on or beside a stream.
pub(crate) enum Beside {
    Nothing,
    /// The stream itself captures.
    OwnCapture,
    /// For the legacy stream: a blocking stream of its context captures (the driver's question
    /// answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`).
    BlockingCapture,
}

/// What captures on or beside `stream`, asked of the driver (in the current context, which a
/// legacy handle names).
pub(crate) fn capture_beside(stream: sys::CUstream) -> Result<Beside> {
    match capture_info(stream) {
        Ok(CaptureStatus::None) => Ok(Beside::Nothing),
        Ok(_) => Ok(Beside::OwnCapture),
        Err(error) if error.is_refused_for_a_blocking_capture() => Ok(Beside::BlockingCapture),
        Err(error) => Err(error),
    }
}
