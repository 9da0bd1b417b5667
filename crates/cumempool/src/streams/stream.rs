//! Streams: the order in which pool memory is handed out and given back, each `Stream` value's
//! identity, and the frees a capture defers on it. Waits on events and orderings between
//! streams are in `event`; whether a stream captures, in `capture_state`.

use crate::devices::context::Context;
use crate::driver::handle::DriverHandle;
use crate::driver::{driver_answer, driver_call};
use crate::error::{Error, Result};
use crate::streams::capture_mode;
use crate::streams::capture_state::{
    capture_beside, capture_info, is_legacy_handle, refuse_host_wait_on_capturing_thread, Beside, CaptureStatus,
    LEGACY_HANDLE,
};
use crate::streams::deferred_frees::{run_frees, DeferredFree};
use crate::streams::orphans::{
    adopt, any_orphans, any_orphans_of, destroy_leaked, take_orphans, take_orphans_where, KeepAlive, Orphan,
};
use cumempool_sys as sys;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

/// A CUDA stream. Clones share it; an owned stream is destroyed when the last clone drops.
///
/// [`Buffer`](crate::Buffer)s borrow the stream they are freed on, so the compiler keeps the
/// stream alive for them.
///
/// Every `Stream` value made by [`Stream::new`], [`Stream::legacy`] or [`Stream::borrow_raw`]
/// has its own [`StreamId`], shared by its clones and never reused in the process. Caches key
/// freed memory by it, not by the raw handle: raw handle values can name different streams (the
/// legacy stream `0` is a different stream in each context, and a destroyed stream's handle
/// value can come back for a new stream).
#[derive(Clone, Debug)]
pub struct Stream(Arc<StreamInner>);

#[derive(Debug)]
struct StreamInner {
    raw: DriverHandle<sys::CUstream>,
    /// `None` only for borrowed ordinary streams given without a context: the driver finds
    /// their context from the handle. Streams whose handle means "the stream of the current
    /// context" always have one.
    context: Option<Context>,
    owned: bool,
    /// A legacy stream serving for the calling thread's per-thread default stream
    /// ([`Stream::legacy_for_per_thread`]): its capture status is that stream's.
    for_per_thread: bool,
    id: StreamId,
    /// The id, with [`Stream::CAPTURE_MARK`] set once a capture may be underway on the stream
    /// (unset only while the library created it and nothing that begins or joins a capture has
    /// reached it); once set it stays set. One word for both, so that a cache reads both with
    /// one load (see [`Stream::marked_id`]).
    marked_id: AtomicU64,
    /// Frees of memory allocated outside a capture, asked for while the stream was capturing:
    /// run on the stream once it no longer captures (see [`Stream::defer_free`]).
    deferred_frees: Mutex<Vec<DeferredFree>>,
    /// A private stream a finished [`Stream::capture`] left that nobody else holds, kept for
    /// the next capture of this stream (see [`Stream::take_capture_stream`]).
    spare_capture_stream: Mutex<Option<Stream>>,
    /// What keeps a borrowed stream alive: the other library's own handle (a cudarc
    /// `Arc<CudaStream>`), dropped after the last clone of this `Stream`.
    _keep_alive: KeepAlive,
}

/// A stream's identity in this process: unique per [`Stream`] (shared by its clones), never
/// reused, unlike raw handle values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(NonZeroU64);

impl StreamId {
    fn next() -> Self {
        // Never 0, so that caches can keep 0 for "no stream" and the compiler knows an id is
        // not it, and below 2^63, so that `Stream::CAPTURE_MARK` is free. Unique until the
        // counter reaches 2^63 streams (one a nanosecond for 292 years).
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let next = NEXT.fetch_add(1, Relaxed).min(Stream::CAPTURE_MARK - 2);
        Self(NonZeroU64::MIN.saturating_add(next))
    }

    /// The number, for logs; never 0, and below 2^63.
    #[inline]
    pub fn get(self) -> u64 {
        self.0.get()
    }

    /// The number as a [`NonZeroU64`].
    #[inline]
    pub fn get_nonzero(self) -> NonZeroU64 {
        self.0
    }
}

/// `CU_STREAM_PER_THREAD`: a different stream on each thread.
const PER_THREAD_HANDLE: usize = 0x2;

impl Stream {
    fn from_parts(raw: sys::CUstream, context: Option<Context>, owned: bool) -> Self {
        Self::with_keep_alive(raw, context, owned, KeepAlive(None))
    }

    fn with_keep_alive(raw: sys::CUstream, context: Option<Context>, owned: bool, keep_alive: KeepAlive) -> Self {
        // A borrowed ordinary stream is reachable by the code that lent it, which may capture
        // it; a stream created here, or the legacy stream (which cannot be captured), is not.
        let capture_possible = !owned && !is_legacy_handle(raw);
        let id = StreamId::next();
        let marked_id = id.get() | if capture_possible { Self::CAPTURE_MARK } else { 0 };
        Self(Arc::new(StreamInner {
            raw: DriverHandle(raw),
            context,
            owned,
            for_per_thread: false,
            id,
            marked_id: AtomicU64::new(marked_id),
            deferred_frees: Mutex::new(Vec::new()),
            spare_capture_stream: Mutex::new(None),
            _keep_alive: keep_alive,
        }))
    }

    /// Borrows `raw` like [`Stream::borrow_raw`] and holds `keep_alive` (the other library's
    /// own handle to the stream: a cudarc `Arc<CudaStream>`, a Python stream object) until the
    /// last clone of the result drops, so the stream outlives every use made here, caches and
    /// deferred frees included.
    ///
    /// # Errors
    /// As [`Stream::borrow_raw`].
    ///
    /// # Safety
    /// `raw` must be a valid stream (of `context`, if given) for as long as `keep_alive` lives.
    pub unsafe fn borrow_raw_keeping(
        raw: sys::CUstream,
        context: Option<&Context>,
        keep_alive: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<Self> {
        check_borrowable(raw, context)?;
        Ok(Self::with_keep_alive(raw, context.cloned(), false, KeepAlive(Some(keep_alive))))
    }

    /// A new non-blocking stream in `context` (it does not synchronise with the legacy stream).
    ///
    /// # Errors
    /// The driver's refusal (`cuStreamCreate`), or a driver that cannot be loaded.
    ///
    /// See [cuStreamCreate](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn new(context: &Context) -> Result<Self> {
        context.ensure_current()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        // SAFETY: valid out-pointer; the context is current.
        unsafe { driver_call!(cuStreamCreate(&mut raw, flags)) }?;
        Ok(Self::from_parts(raw, Some(context.clone()), true))
    }

    /// The legacy default stream (`0`) of `context`. Creating it calls no driver function;
    /// work queued on it makes `context` current first, so it is always that context's legacy
    /// stream, whichever thread uses it.
    ///
    /// The driver refuses legacy-stream work while any blocking stream of the context captures
    /// (a capture other code began, on any thread), and invalidates that capture. So every
    /// capture-aware operation on this stream asks first (one driver question, about 0.1 us): an
    /// allocation, a fill, a copy or an ordering is refused with [`Error::StreamCapturing`], and
    /// a free waits, kept with the context's legacy stream, until the next use of that stream
    /// finds nothing blocking it (or [`Stream::run_orphaned_frees`]).
    pub fn legacy(context: &Context) -> Self {
        Self::from_parts(std::ptr::null_mut(), Some(context.clone()), false)
    }

    /// The legacy default stream of `context`, serving for the calling thread's per-thread
    /// default stream (`CU_STREAM_PER_THREAD`), which names another stream on each thread and
    /// so cannot be a `Stream` itself. The per-thread stream is a blocking stream, so work on
    /// the legacy stream is ordered with it both ways, from any thread.
    ///
    /// A per-thread stream can be captured (CuPy's `Stream.ptds.begin_capture()`), and the
    /// driver refuses legacy-stream work while a blocking stream of its context captures,
    /// invalidating that capture. So, as for [`Stream::legacy`], every capture-aware use asks the
    /// legacy stream itself, whose answer covers every blocking stream of the context, each
    /// thread's per-thread stream included ([`Stream::is_blocked_by_a_capture`]): an operation is
    /// refused while one captures, and a free waits for the capture's end, the capture left
    /// intact. Its capture status ([`Stream::capture_status`]) is the calling thread's per-thread
    /// stream's.
    pub fn legacy_for_per_thread(context: &Context) -> Self {
        let id = StreamId::next();
        Self(Arc::new(StreamInner {
            raw: DriverHandle(std::ptr::null_mut()),
            context: Some(context.clone()),
            owned: false,
            for_per_thread: true,
            id,
            marked_id: AtomicU64::new(id.get() | Self::CAPTURE_MARK),
            deferred_frees: Mutex::new(Vec::new()),
            spare_capture_stream: Mutex::new(None),
            _keep_alive: KeepAlive(None),
        }))
    }

    /// Whether this is [`Stream::legacy_for_per_thread`]'s stream.
    pub fn is_for_per_thread(&self) -> bool {
        self.0.for_per_thread
    }

    /// Borrows a stream created elsewhere (by another library, say); it is never destroyed here.
    ///
    /// With a context, that context is made current before work is queued on the stream.
    /// The handles that mean "a stream of the current context" are refused where they would be
    /// ambiguous: `0` and `CU_STREAM_LEGACY` need the context they belong to, and
    /// `CU_STREAM_PER_THREAD` is refused always (it names another stream on every thread, and a
    /// `Stream` may move between threads): use [`Stream::legacy`] or a stream of your own.
    ///
    /// # Errors
    /// [`Error::StreamNotBorrowable`] for the refused handles above.
    ///
    /// # Safety
    /// `raw` must be a valid stream (of `context`, if given) and must outlive every clone of the
    /// result and every buffer allocated on it. Caches (such as `cumempool-alloc`'s) may hold a
    /// clone until they are released. Buffers dropped while other code captures the stream are
    /// freed on it once the capture is over; if the last clone drops before that, the stream
    /// must stay valid until those frees have run (on the next capture-aware use of a `Stream`
    /// of the same handle, or [`Stream::run_orphaned_frees`]): end the capture and use the
    /// stream once more here before destroying it. [`Stream::borrow_raw_keeping`] (and
    /// `Stream::from_cudarc`) keep the lender's handle until then.
    pub unsafe fn borrow_raw(raw: sys::CUstream, context: Option<&Context>) -> Result<Self> {
        check_borrowable(raw, context)?;
        Ok(Self::from_parts(raw, context.cloned(), false))
    }

    /// The driver's handle.
    #[inline]
    pub fn as_raw(&self) -> sys::CUstream {
        self.0.raw.0
    }

    /// This stream's identity: shared by its clones, never reused.
    #[inline]
    pub fn id(&self) -> StreamId {
        self.0.id
    }

    /// How many `Stream` values (this one and its clones) share this stream now. A cache that
    /// holds the only one knows nobody else can queue work on the stream any more.
    #[inline]
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// The context the stream belongs to, where known.
    #[inline]
    pub fn context(&self) -> Option<&Context> {
        self.0.context.as_ref()
    }

    /// Makes sure work queued on this stream from the calling thread lands in the stream's
    /// context.
    ///
    /// The legacy stream's handle means "the legacy stream of the current context", so its
    /// context is made current (when it is not already). An ordinary stream's handle carries its
    /// context: the driver queues allocations, frees, copies, sets, queries and waits on it in
    /// that context whatever is current on the thread (measured on driver 580 with no context
    /// and with another device's context current), so nothing is done and the hot path makes
    /// no context call.
    ///
    /// # Errors
    /// The driver's refusal to make the legacy stream's context current.
    #[inline]
    pub fn bind(&self) -> Result<()> {
        match &self.0.context {
            Some(context) if self.is_legacy() => context.ensure_current(),
            _ => Ok(()),
        }
    }

    /// Makes the stream's context current, whatever the handle, and answers it: for the calls that need a
    /// current context even on an ordinary stream. `cuMemcpyAsync` involving host memory is one
    /// (driver 580 crashes with no context current, and refuses with another device's context).
    ///
    /// # Errors
    /// [`Error::StreamNotBorrowable`] for a stream borrowed without its context; the driver's
    /// refusal to make the context current.
    pub(crate) fn bind_context(&self) -> Result<&Context> {
        match &self.0.context {
            Some(context) => context.ensure_current().map(|()| context),
            None => Err(Error::StreamNotBorrowable {
                reason: "copies need the stream's context current, and this stream was borrowed without one; a stream of a device's primary context can be borrowed with it (Stream::borrow_raw(raw, Some(&context))), while a stream of any other context cannot copy host memory here",
            }),
        }
    }

    /// Whether the handle means the legacy stream of the current context (`0` or
    /// `CU_STREAM_LEGACY`): the stream whose work the driver refuses while any blocking stream
    /// of its context captures, so that its capture question is of those streams.
    #[inline]
    pub fn is_legacy(&self) -> bool {
        is_legacy_handle(self.as_raw())
    }

    /// Whether this handle destroys the stream (false for [`Stream::legacy`] and
    /// [`Stream::borrow_raw`]).
    pub fn is_owned(&self) -> bool {
        self.0.owned
    }

    /// Waits until all work queued on the stream has finished.
    ///
    /// A host wait cannot be recorded into a graph: on a stream that captures (a capture begun
    /// by any code) it is refused before the driver, which would invalidate the capture. On a
    /// stream that does not capture it runs in relaxed capture mode, so captures other code runs
    /// on other streams (on this thread, or in global mode on any thread) are left intact.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] while the stream captures (the capture is left intact); the
    /// driver's answer (`cuStreamSynchronize`), which includes errors of earlier asynchronous
    /// work on the stream.
    ///
    /// See [cuStreamSynchronize](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn synchronize(&self) -> Result<()> {
        const WHAT: &str = "waiting for a stream (Stream::synchronize)";
        refuse_host_wait_on_capturing_thread(WHAT)?;
        self.ensure_not_capturing(WHAT)?;
        self.bind()?;
        // SAFETY: a live stream, in its context.
        capture_mode::relaxed(|| unsafe { driver_call!(cuStreamSynchronize(self.as_raw())) })
    }

    /// Whether all queued work has finished, without waiting.
    ///
    /// Refused, like [`Stream::synchronize`], on a stream that captures: the driver's query
    /// would invalidate the capture.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] while the stream captures (the capture is left intact); the
    /// driver's answer (`cuStreamQuery`).
    ///
    /// See [cuStreamQuery](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn is_idle(&self) -> Result<bool> {
        const WHAT: &str = "asking whether a stream is idle (Stream::is_idle)";
        refuse_host_wait_on_capturing_thread(WHAT)?;
        self.ensure_not_capturing(WHAT)?;
        self.bind()?;
        // SAFETY: a live stream, in its context.
        let answer = capture_mode::relaxed(|| unsafe { driver_answer!(cuStreamQuery(self.as_raw())) })?;
        match answer.code {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            _ => Err(answer.error()),
        }
    }

    /// Whether a capture may be underway on this stream, without asking the driver: one relaxed
    /// load, for hot paths. `false` is definite: the library created the stream and nothing
    /// that begins or joins a capture has reached it through safe code (a capture begun here, a
    /// wait on an event recorded on a stream that may capture, handing the stream to another
    /// library). `true` means "ask the driver" ([`Stream::capture_status`]); it stays true.
    ///
    /// Code that captures the raw handle itself (through [`Stream::as_raw`] and the driver)
    /// must call [`Stream::note_capture_possible`] first.
    #[inline(always)]
    pub fn may_be_capturing(&self) -> bool {
        self.0.marked_id.load(Relaxed) & Self::CAPTURE_MARK != 0
    }

    /// The bit [`Stream::marked_id`] sets while a capture may be underway: the top one, which
    /// no [`StreamId`] has.
    pub const CAPTURE_MARK: u64 = 1 << 63;

    /// The stream's id ([`StreamId::get`]) with [`Stream::CAPTURE_MARK`] set while
    /// [`Stream::may_be_capturing`] answers true: both in one relaxed load. A cache that keys
    /// its blocks by stream id compares this with its keys, so that the one comparison that
    /// finds a stream's blocks also turns away a stream that may be capturing.
    #[inline(always)]
    pub fn marked_id(&self) -> NonZeroU64 {
        // SAFETY: every value stored is a stream id, which is not 0, with or without a bit set.
        unsafe { NonZeroU64::new_unchecked(self.0.marked_id.load(Relaxed)) }
    }

    /// Records that a capture may be underway on this stream from now on (see
    /// [`Stream::may_be_capturing`]): every capture-aware operation then asks the driver.
    #[inline]
    pub fn note_capture_possible(&self) {
        // The word holds the id or the marked id; either way it becomes the marked id.
        self.0.marked_id.store(self.0.id.get() | Self::CAPTURE_MARK, Relaxed);
    }

    /// The driver's answer: whether work queued on the stream now runs or is recorded into a
    /// graph. Always asks the driver (about 0.1 us); [`Stream::is_capturing`] asks only when a
    /// capture is possible.
    ///
    /// # Errors
    /// The driver's refusal (`cuStreamGetCaptureInfo`).
    ///
    /// See [cuStreamGetCaptureInfo](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        self.bind()?;
        capture_info(self.asked_handle())
    }

    /// The handle a capture question is asked of: for [`Stream::legacy_for_per_thread`], the
    /// calling thread's per-thread stream (of the context current when asked).
    fn asked_handle(&self) -> sys::CUstream {
        if self.0.for_per_thread {
            return PER_THREAD_HANDLE as sys::CUstream;
        }
        self.as_raw()
    }

    /// [`Stream::capture_status`], with the calling thread's current context (or none) current
    /// again afterwards: for layers above that must not move the thread to another device. Where
    /// the stream's context is already current (the common case) it reads the current context
    /// once and asks the question, no more.
    ///
    /// # Errors
    /// As [`Stream::capture_status`]; the driver's refusal to read or restore the current
    /// context.
    pub fn capture_status_keeping_context(&self) -> Result<CaptureStatus> {
        match &self.0.context {
            Some(context) if self.is_legacy() => context.while_current(|| capture_info(self.asked_handle())),
            // An ordinary stream names its context itself: the question needs none current.
            _ => capture_info(self.as_raw()),
        }
    }

    /// Whether the driver would refuse work queued on this stream now for a capture underway on
    /// another stream, and invalidate that capture: true for the legacy stream (and
    /// [`Stream::legacy_for_per_thread`]'s, whose work goes there) while any blocking stream of
    /// its context captures, or where the driver cannot say. Other streams are not refused for
    /// another stream's capture: false, without a driver call. The question leaves any capture
    /// intact and the caller's context current. For work a layer queues of its own accord (a
    /// cache giving blocks back to make room), not at its caller's word.
    pub fn is_blocked_by_a_capture(&self) -> bool {
        self.blocked_by_a_capture().unwrap_or(true)
    }

    /// The legacy stream's answer behind [`Stream::is_blocked_by_a_capture`], for work queued at
    /// its caller's word, which a failure should reach: `true` while a blocking stream of its
    /// context captures (the driver answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, the capture
    /// left intact), `false` when nothing blocks it or for any other stream (no driver call),
    /// and any other failure (a sticky error of an earlier launch, say) as itself, not as a
    /// capture.
    ///
    /// # Errors
    /// The driver's refusal to answer, other than for a capture.
    pub fn blocked_by_a_capture(&self) -> Result<bool> {
        let Some(context) = self.0.context.as_ref().filter(|_| self.is_legacy()) else {
            return Ok(false);
        };
        // The legacy stream itself, not the per-thread stream `asked_handle` names.
        let beside = context.while_current(|| capture_beside(self.as_raw()))?;
        Ok(!matches!(beside, Beside::Nothing))
    }

    /// Refuses `operation` on the legacy stream while a blocking stream of its context captures
    /// ([`Stream::blocked_by_a_capture`]); one comparison for any other stream. For the
    /// primitives that queue work without [`Stream::ensure_not_capturing`] (an event's record, a
    /// wait), which may join captures on ordinary streams by design.
    #[inline]
    pub(crate) fn refuse_blocked_legacy(&self, operation: &'static str) -> Result<()> {
        if self.is_legacy() && self.blocked_by_a_capture()? {
            return Err(Error::StreamCapturing { operation, capture: None });
        }
        Ok(())
    }

    /// [`Stream::is_capturing`], with the calling thread's current context (or none) current
    /// again afterwards, as [`Stream::capture_status_keeping_context`] asks. Asks the driver
    /// only when [`Stream::may_be_capturing`] is true.
    ///
    /// # Errors
    /// As [`Stream::capture_status_keeping_context`].
    #[inline]
    pub fn is_capturing_keeping_context(&self) -> Result<bool> {
        if !self.may_be_capturing() {
            return Ok(false);
        }
        Ok(self.capture_status_keeping_context()? != CaptureStatus::None)
    }

    /// Whether a capture is underway (active or invalidated) on this stream. Asks the driver
    /// only when [`Stream::may_be_capturing`] is true.
    ///
    /// # Errors
    /// As [`Stream::capture_status`].
    #[inline]
    pub fn is_capturing(&self) -> Result<bool> {
        if !self.may_be_capturing() {
            return Ok(false);
        }
        Ok(self.capture_status()? != CaptureStatus::None)
    }

    /// Refuses `operation` with [`Error::StreamCapturing`] while a capture is underway on the
    /// stream, before any driver call that could invalidate it; otherwise runs the frees
    /// deferred by an earlier capture. One relaxed load when no capture is possible. For layers
    /// above (the Python package's `Resource.alloc`) that refuse what a capture must not see as
    /// this crate does; `operation` names what was refused and what to do instead.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`]; the driver's refusal to say whether the stream captures.
    ///
    /// The legacy stream (and [`Stream::legacy_for_per_thread`]'s) is asked every time: the
    /// driver refuses its work while any blocking stream of its context captures, a capture begun
    /// by any code, and invalidates that capture ([`Stream::is_blocked_by_a_capture`]).
    #[inline]
    pub fn ensure_not_capturing(&self, operation: &'static str) -> Result<()> {
        if !self.may_be_capturing() && !self.is_legacy() {
            return Ok(());
        }
        self.ensure_not_capturing_slow(operation)
    }

    #[cold]
    fn ensure_not_capturing_slow(&self, operation: &'static str) -> Result<()> {
        if self.is_legacy() {
            // One question covers every blocking stream of the context, the calling thread's
            // per-thread stream (legacy_for_per_thread's) among them.
            self.refuse_blocked_legacy(operation)?;
            self.run_deferred_frees();
            return Ok(());
        }
        match self.capture_status()? {
            CaptureStatus::None => {
                self.run_deferred_frees();
                Ok(())
            }
            status => Err(Error::StreamCapturing { operation, capture: status.id() }),
        }
    }

    /// Runs the frees an earlier capture deferred on this stream (and those that earlier
    /// `Stream` values of the same driver stream left behind), as
    /// [`Stream::ensure_not_capturing`] does, where none captures now: for a layer above that
    /// asked the capture question its own way (an allocation that asked it once, inside a
    /// cache) and would otherwise leave them waiting while nothing of its reaches the pool. One
    /// lock and one load where none wait; the capture question is asked only where some wait
    /// for this stream: frees waiting with other streams (another stream's orphans, the legacy
    /// stream's) are theirs to run, and must not cost every allocation here a question.
    pub fn run_frees_deferred_by_a_capture(&self) {
        let none_kept = self.0.deferred_frees.lock().unwrap_or_else(PoisonError::into_inner).is_empty();
        if none_kept && !any_orphans_of(self.orphan_key(), self.context().map(Context::as_raw)) {
            return;
        }
        // A capture underway (or no answer): they wait on, for a later use of the stream.
        let _waiting = self.ensure_not_capturing("running frees a capture deferred");
    }

    /// Keeps a free for later: `ptr` (allocated outside the capture now underway) is freed on
    /// this stream once it no longer captures, ordered after the stream's pre-capture work. A
    /// free node recorded now could not free memory the graph did not allocate, and would
    /// corrupt the capture.
    pub(crate) fn defer_free(&self, free: DeferredFree) {
        self.0.deferred_frees.lock().unwrap_or_else(PoisonError::into_inner).push(free);
    }

    /// Keeps a free on the legacy stream that a blocking stream's capture refuses for now: run by
    /// the next use of any `Stream` of this context's legacy stream ([`Stream::legacy`]'s or
    /// [`Stream::legacy_for_per_thread`]'s, which share the driver stream) once nothing blocks
    /// it, or by [`Stream::run_orphaned_frees`].
    pub(crate) fn defer_legacy_free(&self, free: DeferredFree) {
        adopt(Orphan {
            raw: DriverHandle(self.orphan_key()),
            context: self.0.context.clone(),
            frees: vec![free],
            owned: false,
            _keep_alive: Vec::new(),
        });
    }

    /// The handle the frees this stream left behind are kept under: `0` for every handle of the
    /// legacy stream (`0`, `CU_STREAM_LEGACY`, the per-thread stream's), which all queue there.
    fn orphan_key(&self) -> sys::CUstream {
        if self.is_legacy() {
            return std::ptr::null_mut();
        }
        self.as_raw()
    }

    /// The frees waiting for the capture to end, taken from the list.
    fn take_deferred_frees(&self) -> Vec<DeferredFree> {
        std::mem::take(&mut *self.0.deferred_frees.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Runs the deferred frees, and those that earlier `Stream` values of the same driver stream
    /// left behind when they dropped during a capture. Call it only when the stream does not
    /// capture and, for the legacy stream (and [`Stream::legacy_for_per_thread`]'s), when
    /// [`Stream::is_blocked_by_a_capture`] answered false: then no blocking stream of the
    /// context captures, every thread's per-thread stream included, so every free kept for a
    /// capture may run. Failures are logged: like a buffer's drop, nobody is left to hand them
    /// to.
    pub(crate) fn run_deferred_frees(&self) {
        let none_kept = self.0.deferred_frees.lock().unwrap_or_else(PoisonError::into_inner).is_empty();
        if none_kept && !any_orphans() {
            return;
        }
        let raw = self.as_raw();
        // Taken once the context is current: where it cannot be made current, they stay kept.
        let run = || {
            let frees = self.take_deferred_frees();
            let orphans = take_orphans(self.orphan_key(), self.context().map(Context::as_raw));
            run_frees_keeping_refused(raw, self.context(), frees);
            for mut orphan in orphans {
                run_frees_keeping_refused(raw, self.context(), std::mem::take(&mut orphan.frees));
                if orphan.owned {
                    // This value borrows the leaked stream: its drop destroys it, not this call.
                    adopt(orphan);
                }
            }
            Ok::<(), Error>(())
        };
        // The legacy handle names the legacy stream of whichever context is current: its own,
        // for the frees, and the caller's again after.
        let ran = match &self.0.context {
            Some(context) if self.is_legacy() => context.while_current(run),
            _ => run(),
        };
        if let Err(error) = ran {
            tracing::warn!(%error, "making the legacy stream's context current for its deferred frees failed");
        }
    }

    /// Runs the frees that `Stream` values dropped during a capture left behind (see
    /// [`Stream::borrow_raw`]) on each of their streams that no longer captures, and answers how
    /// many frees still wait for a capture to end.
    ///
    /// Any capture-aware operation on a `Stream` of the same driver stream (a synchronize, a
    /// free, a capture) runs them too; this is for programs that never use that stream here again.
    /// Failures are logged, and the frees of a stream whose capture state cannot be read wait on.
    pub fn run_orphaned_frees() -> usize {
        let mut waiting = 0;
        for orphan in take_orphans_where(|_| true) {
            let raw = orphan.raw.0;
            // A legacy stream a blocking stream's capture blocks answers IMPLICIT: still waiting.
            let ended = || match capture_info(raw) {
                Err(error) if is_legacy_handle(raw) && error.is_refused_for_a_blocking_capture() => Ok(false),
                answer => answer.map(|status| status == CaptureStatus::None),
            };
            let ended = match &orphan.context {
                Some(context) => context.while_current(ended),
                None => ended(),
            };
            match ended {
                Ok(true) => {
                    // In the stream's context: a legacy handle names the current context's stream.
                    match &orphan.context {
                        Some(context) => {
                            let frees = orphan.frees;
                            match context
                                .while_current(|| Ok::<_, Error>(run_frees_keeping_refused(raw, Some(context), frees)))
                            {
                                Ok(kept) => waiting += kept,
                                Err(error) => {
                                    tracing::warn!(%error, "making a dropped stream's context current for its frees failed");
                                }
                            }
                        }
                        None => waiting += run_frees_keeping_refused(raw, None, orphan.frees),
                    }
                    if orphan.owned {
                        destroy_leaked(raw, orphan.context.as_ref());
                    }
                }
                Ok(false) => {
                    waiting += orphan.frees.len();
                    adopt(orphan);
                }
                Err(error) => {
                    tracing::warn!(%error, "asking whether a dropped stream still captures failed; its frees wait");
                    waiting += orphan.frees.len();
                    adopt(orphan);
                }
            }
        }
        waiting
    }

    /// Waits on the host for the work queued so far, where memory is about to be released (or
    /// left unordered) that the work may still use: the fallback when an ordering could not be
    /// set up after the work was queued.
    ///
    /// Unlike [`Stream::synchronize`], nothing the library controls refuses it: not a
    /// [`Stream::capture`] underway on this thread (a wait that invalidates the caller's capture
    /// is better than a use-after-free), nor a failed change of the thread's capture mode. Only a
    /// stream that captures cannot be waited for (its work is not scheduled to run): that, and
    /// the driver's refusal, is the error, and the caller must then keep the memory (leak it)
    /// rather than release it.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] for a stream that captures; the driver's refusal.
    pub fn wait_before_release(&self) -> Result<()> {
        const WHAT: &str = "waiting for queued work before releasing the memory it uses";
        if self.may_be_capturing() {
            if let Ok(status @ (CaptureStatus::Active { .. } | CaptureStatus::Invalidated { .. })) =
                self.capture_status()
            {
                return Err(Error::StreamCapturing { operation: WHAT, capture: status.id() });
            }
        }
        self.bind()?;
        // SAFETY: a live stream, in its context.
        capture_mode::relaxed_if_possible(|| unsafe { driver_call!(cuStreamSynchronize(self.as_raw())) })
    }

    /// The private stream for a capture of this stream ([`Stream::capture`]): the spare one an
    /// earlier capture left, or a new one in `context`. Only the caller holds it.
    pub(crate) fn take_capture_stream(&self, context: &Context) -> Result<Stream> {
        let spare = self.0.spare_capture_stream.lock().unwrap_or_else(PoisonError::into_inner).take();
        match spare {
            Some(stream) => Ok(stream),
            None => Stream::new(context),
        }
    }

    /// Gives back the private stream of a capture that is over. It is kept for the next capture
    /// only if nothing else holds it (a clone of `Capture::stream` kept by the closure could
    /// queue work that would land in that capture) and it no longer captures; a stream still
    /// capturing after every attempt to end it is leaked rather than destroyed mid-capture.
    pub(crate) fn give_back_capture_stream(&self, stream: Stream) {
        match stream.capture_status() {
            Ok(CaptureStatus::None) if stream.handle_count() == 1 => {
                let mut spare = self.0.spare_capture_stream.lock().unwrap_or_else(PoisonError::into_inner);
                if spare.is_none() {
                    *spare = Some(stream);
                }
            }
            Ok(CaptureStatus::None) => {}
            status => {
                tracing::warn!(
                    ?status,
                    "a capture's private stream may still capture after its end; it is leaked, not destroyed"
                );
                std::mem::forget(stream);
            }
        }
    }

    /// Whether two handles name the same driver stream: the same handle in the same context.
    /// Never for [`Stream::legacy_for_per_thread`]'s stream, which names another stream on each
    /// thread.
    pub fn same_as(&self, other: &Stream) -> bool {
        // The per-thread stream names another stream on each thread: never provably the same,
        // so work ordered with it always goes through the legacy stream (see
        // `legacy_for_per_thread`).
        if self.0.for_per_thread || other.0.for_per_thread {
            return false;
        }
        self.id() == other.id()
            || (self.as_raw() == other.as_raw()
                && self.context().map(Context::as_raw) == other.context().map(Context::as_raw))
    }
}

/// Refuses the handles that mean "a stream of the current context" where they would be
/// ambiguous (see [`Stream::borrow_raw`]).
fn check_borrowable(raw: sys::CUstream, context: Option<&Context>) -> Result<()> {
    match (raw as usize, context) {
        (PER_THREAD_HANDLE, _) => Err(Error::StreamNotBorrowable {
            reason: "CU_STREAM_PER_THREAD names a different stream on every thread, and a Stream may move between threads; borrow a stream you created, or use Stream::legacy(&context)",
        }),
        (0 | LEGACY_HANDLE, None) => Err(Error::StreamNotBorrowable {
            reason: "the legacy stream handle names the legacy stream of whichever context is current; give its context (or use Stream::legacy(&context))",
        }),
        _ => Ok(()),
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let raw = self.raw.0;
        let mut owned = self.owned;
        let may_capture = *self.marked_id.get_mut() & Stream::CAPTURE_MARK != 0;
        let mut frees = std::mem::take(self.deferred_frees.get_mut().unwrap_or_else(PoisonError::into_inner));
        if self.for_per_thread {
            // Like the legacy stream, it keeps no frees of its own: those its blocking captures
            // refuse wait with the context's legacy stream (`defer_legacy_free`).
            debug_assert!(frees.is_empty(), "a legacy stream's frees wait with its context's");
            return;
        }
        let mut keep_alive = vec![std::mem::replace(&mut self._keep_alive, KeepAlive(None))];
        if may_capture {
            // Earlier values of this driver stream left frees (and what keeps it valid, and
            // whether it is a leaked stream of the library's); they run (or wait) with these.
            for orphan in take_orphans(raw, self.context.as_ref().map(Context::as_raw)) {
                frees.extend(orphan.frees);
                keep_alive.extend(orphan._keep_alive);
                owned |= orphan.owned;
            }
        }
        if !owned && frees.is_empty() {
            return;
        }
        // Frees run before the stream is destroyed. A capture begun by `Stream::capture` is
        // over by now; one begun by other code is asked about below.
        let context = self.context.clone();
        let destroy = || -> Result<()> {
            let capturing = may_capture && capture_info(raw).map_or(true, |status| status != CaptureStatus::None);
            if capturing {
                // Code that lent the stream still captures on it (or a capture's private stream
                // could not be ended, or the driver cannot say): a free now would be recorded
                // into its graph, and a capture is not destroyed from under its owner. The frees
                // wait for the capture's end with what keeps the stream valid; an owned stream
                // is leaked (never destroyed) for them.
                if owned {
                    tracing::warn!("a stream dropped during a capture is leaked, not destroyed");
                }
                if !frees.is_empty() || owned {
                    adopt(Orphan { raw: DriverHandle(raw), context, frees, owned, _keep_alive: keep_alive });
                }
                return Ok(());
            }
            run_frees_keeping_refused(raw, context.as_ref(), frees);
            drop(keep_alive);
            if owned {
                // SAFETY: an owned stream, destroyed once.
                unsafe { driver_call!(cuStreamDestroy(raw)) }?;
            }
            Ok(())
        };
        let result = match &self.context {
            Some(context) => context.while_current(destroy),
            None => destroy(),
        };
        if let Err(error) = result {
            tracing::warn!(%error, "destroying a stream failed");
        }
    }
}

/// [`run_frees`] on `raw` in `context` (current), keeping the frees the legacy stream refused
/// for a capture begun since it was asked, and the waits for unmappings such a capture forbade:
/// they wait with the context's legacy stream again. Answers how many.
fn run_frees_keeping_refused(raw: sys::CUstream, context: Option<&Context>, frees: Vec<DeferredFree>) -> usize {
    let refused = run_frees(raw, frees);
    let kept = refused.len();
    if kept == 0 {
        return 0;
    }
    tracing::warn!(
        count = kept,
        "a capture began before deferred frees (or the wait for imported memory's unmappings) reached the legacy stream: they wait again"
    );
    adopt(Orphan {
        raw: DriverHandle(std::ptr::null_mut()),
        context: context.cloned(),
        frees: refused,
        owned: false,
        _keep_alive: Vec::new(),
    });
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bare_pools::pool_owner::Owner;
    use crate::streams::capture_state::ThreadCapture;

    #[test]
    fn handles_that_name_a_different_stream_per_thread_or_context_are_refused() {
        // SAFETY: refused before any use.
        let per_thread = unsafe { Stream::borrow_raw(PER_THREAD_HANDLE as sys::CUstream, None) };
        assert!(per_thread.is_err_and(|e| e.to_string().contains("CU_STREAM_PER_THREAD")));
        for legacy in [0, LEGACY_HANDLE] {
            // SAFETY: refused before any use.
            let borrowed = unsafe { Stream::borrow_raw(legacy as sys::CUstream, None) };
            assert!(borrowed.is_err_and(|e| e.to_string().contains("give its context")), "{legacy:#x}");
        }
    }

    #[test]
    fn a_borrowed_stream_may_be_capturing_from_the_start_and_the_mark_sticks() {
        // SAFETY: never given to a driver.
        let borrowed = unsafe { Stream::borrow_raw(0x1000 as sys::CUstream, None) }.unwrap();
        assert!(borrowed.may_be_capturing(), "the lender may capture it");
        let own = Stream::from_parts(0x2000 as sys::CUstream, None, true);
        assert!(!own.may_be_capturing());
        assert_eq!(own.marked_id(), own.id().get_nonzero(), "unmarked while no capture is possible");
        assert_eq!(borrowed.marked_id().get(), borrowed.id().get() | Stream::CAPTURE_MARK);
        let clone = own.clone();
        clone.note_capture_possible();
        assert!(own.may_be_capturing(), "clones share the mark");
        assert_eq!(own.marked_id().get(), own.id().get() | Stream::CAPTURE_MARK, "the id carries the mark");
        clone.note_capture_possible();
        assert_eq!(own.marked_id().get() & !Stream::CAPTURE_MARK, own.id().get(), "marked twice, still the id");
        std::mem::forget(own); // not a real stream: no destroy
        std::mem::forget(clone);
    }

    #[test]
    fn frees_deferred_by_a_capture_wait_in_their_stream_with_their_pool_until_taken_once() {
        let stream = Stream::from_parts(0x3000 as sys::CUstream, None, false);
        let pool = Arc::new(Owner::new(0x4000 as sys::CUmemoryPool, false));
        stream.defer_free(DeferredFree::new(0x10, Some(&pool)));
        stream.clone().defer_free(DeferredFree::new(0x20, None));
        assert_eq!(Arc::strong_count(&pool), 2, "the deferred free keeps its pool alive");
        let taken = stream.take_deferred_frees();
        assert_eq!(taken.iter().map(|f| f.ptr).collect::<Vec<_>>(), [0x10, 0x20], "clones share the list, in order");
        assert!(stream.take_deferred_frees().is_empty(), "taken once");
        drop(taken);
        assert_eq!(Arc::strong_count(&pool), 1);
        std::mem::forget(Arc::try_unwrap(pool).unwrap()); // not a real pool: no destroy
    }

    #[test]
    fn frees_left_by_a_stream_dropped_during_a_capture_wait_for_the_next_value_of_its_handle() {
        // No driver here: the drop cannot learn that the capture is over, which it must treat as
        // a capture still underway. With a driver, the drop would ask it about a made-up handle.
        if sys::driver().is_ok() {
            return;
        }
        let raw = 0x7000 as sys::CUstream;
        let pool = Arc::new(Owner::new(0x8000 as sys::CUmemoryPool, false));
        let lender: Arc<dyn std::any::Any + Send + Sync> = Arc::new(());
        // SAFETY: never given to a driver that exists.
        let stream = unsafe { Stream::borrow_raw_keeping(raw, None, lender.clone()) }.unwrap();
        stream.defer_free(DeferredFree::new(0x30, Some(&pool)));
        drop(stream);
        assert_eq!(Arc::strong_count(&pool), 2, "the free (and its pool) outlive the stream's last value");
        assert_eq!(Arc::strong_count(&lender), 2, "so does the lender's handle, which keeps the stream valid");
        assert!(take_orphans(0x7100 as sys::CUstream, None).is_empty(), "another stream's values do not run them");
        let orphans = take_orphans(raw, None);
        assert_eq!(orphans.iter().flat_map(|o| o.frees.iter().map(|f| f.ptr)).collect::<Vec<_>>(), [0x30]);
        assert!(take_orphans(raw, None).is_empty(), "taken once");
        drop(orphans);
        assert_eq!((Arc::strong_count(&pool), Arc::strong_count(&lender)), (1, 1));
        std::mem::forget(Arc::try_unwrap(pool).unwrap()); // not a real pool: no destroy
    }

    #[test]
    fn host_waits_are_refused_on_a_thread_while_its_capture_is_underway() {
        // SAFETY: never given to a driver: refused first.
        let stream = unsafe { Stream::borrow_raw(0x6000 as sys::CUstream, None) }.unwrap();
        let outer = ThreadCapture::enter(5);
        let inner = ThreadCapture::enter(6);
        assert!(matches!(stream.synchronize(), Err(Error::StreamCapturing { capture: Some(6), .. })));
        drop(inner);
        assert!(matches!(stream.is_idle(), Err(Error::StreamCapturing { capture: Some(5), .. })));
        let elsewhere = std::thread::spawn(|| refuse_host_wait_on_capturing_thread("testing").is_ok());
        assert!(elsewhere.join().unwrap(), "other threads are not capturing");
        drop(outer);
        assert!(refuse_host_wait_on_capturing_thread("testing").is_ok(), "over with the capture");
    }

    #[test]
    fn every_stream_value_has_its_own_identity_shared_by_its_clones() {
        // SAFETY: never given to a driver.
        let a = unsafe { Stream::borrow_raw(0x1000 as sys::CUstream, None) }.unwrap();
        // SAFETY: as above; the same raw handle borrowed again is a new identity.
        let b = unsafe { Stream::borrow_raw(0x1000 as sys::CUstream, None) }.unwrap();
        let a2 = a.clone();
        assert_eq!(a.id(), a2.id());
        assert_ne!(a.id(), b.id());
        assert_eq!((a.handle_count(), b.handle_count()), (2, 1));
        drop(a2);
        assert_eq!(a.handle_count(), 1);
        assert!(a.same_as(&b), "the same handle without a context is the same driver stream");
    }
}
