//! Stream capture into CUDA graphs, with the memory a graph uses kept alive by the borrow checker.

use crate::devices::context::Context;
use crate::driver::handle::DriverHandle;
use crate::driver::{driver_answer, driver_call, Answer};
use crate::error::{Error, InvalidArgumentReason, Result};
use crate::memory::buffer::BufferOn;
use crate::pool::Pool;
use crate::streams::capture_mode;
use crate::streams::capture_state::{CaptureStatus, ThreadCapture};
use crate::streams::event::Event;
use crate::streams::ordering;
use crate::streams::stream::Stream;
use crate::values::location::AllocationType;
use crate::values::route::Route;
use cumempool_sys as sys;
use std::borrow::Borrow;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

/// Makes a type invariant in `'env` (so a borrow for a shorter time cannot stand in for it) and
/// not `Sync` (graph objects are not synchronised by the driver).
type Invariant<'env> = PhantomData<Cell<&'env ()>>;

impl Stream {
    /// Captures the work `record` queues through its [`Capture`] into a [`Graph`].
    ///
    /// The capture runs on a private stream of this stream's context, made for it (or kept from
    /// an earlier capture of this stream that nobody else held a handle to), never on this
    /// stream: [`Stream`] is `Sync`, and work another thread queues on this stream could
    /// otherwise land in the graph between its "not capturing" check and its driver call.
    /// **Invariant:** only work queued on [`Capture::stream`] during `record` is recorded, and
    /// nothing else holds that stream when the capture begins. Work queued on this stream
    /// inside `record` is not captured: it runs in this stream's order, as outside a capture.
    /// Nothing recorded runs until a launch, which orders itself after the work queued on the
    /// streams of the buffers the graph uses ([`GraphExec::launch`]), so the private stream
    /// needs no ordering with this one.
    ///
    /// The capture is begun in `CU_STREAM_CAPTURE_MODE_RELAXED` mode: other threads' CUDA calls
    /// are not disturbed, and this thread's calls on other streams inside `record` (a buffer of
    /// this stream dropped there frees it at once) do not invalidate it, which the driver does
    /// in thread-local mode. Host waits inside `record` are refused by the library instead
    /// ([`Error::StreamCapturing`]). The capture is always ended: when `record` returns, fails or
    /// panics. Captured allocations that `record` left alive are freed in the graph before it
    /// ends. Frees deferred by the capture (memory from outside it freed on
    /// [`Capture::stream`] meanwhile) run on the private stream once it has ended.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] on a stream other code captures; [`Error::StreamNotBorrowable`]
    /// for a stream borrowed without its context (the private stream is made in it);
    /// [`Error::CaptureRefused`] for the driver's capture refusals (a capture invalidated by
    /// an operation it could not record fails when it ends); `record`'s own error (the graph is
    /// then destroyed); the driver's refusal to record the free of a captured allocation (the
    /// graph is destroyed too: launched, it would leave that memory allocated for good); the
    /// driver's answer.
    ///
    /// See [cuStreamBeginCapture](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html).
    pub fn capture<'env>(&self, record: impl for<'c> FnOnce(&'c Capture<'env>) -> Result<()>) -> Result<Graph<'env>> {
        let Some(context) = self.context() else {
            return Err(Error::StreamNotBorrowable {
                reason: "a capture runs on a private stream made in the stream's context, and this stream was borrowed without one; a stream of a device's primary context can be borrowed with it (Stream::borrow_raw(raw, Some(&context))), while a stream of any other context cannot be captured with Stream::capture (capture it through the driver, after Stream::note_capture_possible)",
            });
        };
        self.ensure_not_capturing(BEGIN)?;
        let private = self.take_capture_stream(context)?;
        // Unwinding out of `record` drops the private stream instead (its capture was ended).
        let graph = capture_on(&private, record);
        self.give_back_capture_stream(private);
        graph
    }
}

const BEGIN: &str = "beginning a capture (Stream::capture)";

/// The capture of [`Stream::capture`] on `stream`, a private stream no other code holds.
fn capture_on<'env>(
    stream: &Stream,
    record: impl for<'c> FnOnce(&'c Capture<'env>) -> Result<()>,
) -> Result<Graph<'env>> {
    stream.note_capture_possible();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a live ordinary stream that does not capture (private to this capture).
    let begun = unsafe { driver_answer!(cuStreamBeginCapture(stream.as_raw(), mode)) }?;
    refused_capture(begun, BEGIN)?;
    let ending = Ending { stream, ended: false };
    let id = stream.capture_status()?.id().unwrap_or_default();
    // Host waits on this thread, on any stream, would invalidate the capture: refused until it ends.
    let on_this_thread = ThreadCapture::enter(id);
    let capture = Capture {
        stream: stream.clone(),
        id,
        live: RefCell::new(Live::default()),
        outside: RefCell::new(Vec::new()),
        _env: PhantomData,
    };
    let recorded = record(&capture);
    let (outside, failed_free) = capture.finish();
    // A graph whose allocation has no free node would leave that memory allocated after the
    // executable is gone (destroying it frees no graph memory): refused, the graph destroyed
    // unlaunched, so that nothing was ever allocated.
    let recorded = recorded.and(failed_free.map_or(Ok(()), Err));
    drop(capture); // its clone of the private stream, which is kept for reuse only if unshared
                   // Before the end, which runs deferred frees (an import's unmapping waits on the host).
    drop(on_this_thread);
    match (recorded, ending.end()) {
        (Ok(()), Ok(graph)) => {
            Ok(Graph { raw: DriverHandle(graph), context: stream.context().cloned(), outside, _env: PhantomData })
        }
        (Ok(()), Err(error)) => Err(error),
        (Err(error), graph) => {
            // The closure's error says more than the end's (which it may have caused).
            graph.map(destroy_graph).ok();
            Err(error)
        }
    }
}

/// Ends a capture that is still underway when dropped (`record` failed or panicked), and runs
/// the frees deferred during it.
struct Ending<'s> {
    stream: &'s Stream,
    ended: bool,
}

impl Ending<'_> {
    fn end(mut self) -> Result<sys::CUgraph> {
        self.ended = true;
        let graph = end_capture(self.stream);
        run_deferred_frees_once_ended(self.stream);
        graph
    }
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        match end_capture(self.stream) {
            Ok(graph) => destroy_graph(graph),
            Err(error) => tracing::warn!(%error, "ending an abandoned capture failed"),
        }
        run_deferred_frees_once_ended(self.stream);
    }
}

/// Runs the frees deferred during the capture, unless a failed end left it underway (then the
/// next capture-aware operation that finds it ended runs them).
fn run_deferred_frees_once_ended(stream: &Stream) {
    // Refused only while the capture is still underway; it runs the frees otherwise.
    let _still_capturing = stream.ensure_not_capturing("ending a capture");
}

/// Ends the capture on `stream`. A failed end that left the capture underway (the driver
/// normally ends it even when it refuses) is ended once more and its graph destroyed: a capture
/// left underway would refuse this thread's later CUDA calls.
fn end_capture(stream: &Stream) -> Result<sys::CUgraph> {
    let ended = end_capture_once(stream);
    if ended.is_err() && stream.capture_status().is_ok_and(|status| status != CaptureStatus::None) {
        match end_capture_once(stream) {
            Ok(graph) => destroy_graph(graph),
            Err(error) => tracing::warn!(%error, "ending a capture after a failed end failed too"),
        }
    }
    ended
}

fn end_capture_once(stream: &Stream) -> Result<sys::CUgraph> {
    let mut graph = std::ptr::null_mut();
    // SAFETY: a stream capturing on this thread (the capture began here); a valid out-pointer.
    let answer = unsafe { driver_answer!(cuStreamEndCapture(stream.as_raw(), &mut graph)) }?;
    refused_capture(answer, "ending a capture (Stream::capture)")?;
    Ok(graph)
}

fn destroy_graph(graph: sys::CUgraph) {
    if graph.is_null() {
        return;
    }
    // SAFETY: a graph this crate owns, destroyed once.
    if let Err(error) = unsafe { driver_call!(cuGraphDestroy(graph)) } {
        tracing::warn!(%error, "destroying a graph failed");
    }
}

/// `Ok` for success; a capture refusal as [`Error::CaptureRefused`] with what it means; any
/// other code as the driver's error.
fn refused_capture(answer: Answer, what: &'static str) -> Result<()> {
    use sys::CUresult as R;
    let hint = match answer.code {
        R::CUDA_SUCCESS => return Ok(()),
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => {
            "the operation cannot be captured (the legacy stream cannot capture; host waits cannot be recorded)"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {
            "an earlier operation invalidated the capture (a host wait on the capturing stream, say); nothing usable was recorded, capture again"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_MERGE | R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => {
            "another stream joined the capture and was not joined back; order every forked stream back into the capturing stream"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED | R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => {
            "the capture was not begun on this stream and thread; end a capture where it began"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION | R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => {
            "captured work depends on work outside the capture (the legacy stream, or an event from outside); keep captured work on the capturing stream"
        }
        _ => return Err(answer.error()),
    };
    Err(Error::CaptureRefused { what, hint, cause: answer.cause() })
}

/// A capture underway ([`Stream::capture`]): the only way to queue captured work.
///
/// `'env` is how long the graph may run: memory from outside the capture, and the pools
/// captured allocations come from, are borrowed for it.
///
/// A graph records addresses, and replaying it is sound only if every recorded address is live
/// memory whenever it runs. So captured work goes only through [`Capture`]'s methods:
/// - memory the capture allocates ([`Capture::alloc`]) is a [`CapturedBuffer`] that cannot
///   leave the closure; it is freed inside the graph (when dropped, or when the closure returns),
///   so every launch allocates and frees it again (graph memory: not the pool's, driver 580);
/// - memory from outside ([`Capture::buffer`]) is borrowed mutably for `'env`, and so are the
///   pools of captured allocations: [`Graph<'env>`] and [`GraphExec<'env>`] keep them borrowed,
///   so they can be neither dropped nor touched while the graph can run.
///
/// The capture runs on a private stream ([`Capture::stream`]) that no other code holds when it
/// begins, so another thread's work on the stream `capture` was called on never lands in the
/// graph, and that stream never captures: its buffers keep working (in stream order, not
/// recorded) inside the closure.
///
/// Work queued on the capturing stream through [`BufferOn`]'s own methods is refused with
/// [`Error::StreamCapturing`], before the driver, and so is every host wait on the capturing
/// thread ([`Stream::synchronize`] and [`Stream::is_idle`], the waiting copies, host slices,
/// [`Event::synchronize`]):
/// on driver 580 (CUDA 13.0) a host wait on the capturing thread, on any stream, answers
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture, whose end then answers
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`. Refused here, the capture stays intact.
///
/// ```no_run
/// use cumempool::{Device, MemPool, Route, Stream};
/// # fn main() -> cumempool::Result<()> {
/// let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
/// let device_pool = MemPool::new(Route::device(0))?;
/// let host_pool = MemPool::new(Route::host())?;
/// let mut result = host_pool.alloc(4096, &stream)?;
/// let graph = stream.capture(|capture| {
///     let scratch = capture.alloc(&device_pool, 4096)?; // graph memory, freed in the graph
///     capture.fill(&scratch, 7)?;
///     let result = capture.buffer(&mut result)?;
///     capture.copy(&result, &scratch)
/// })?;
/// let mut exec = graph.instantiate()?;
/// exec.launch(&stream)?;
/// exec.launch(&stream)?;
/// drop(exec); // waits for the last launch
/// drop(graph);
/// assert!(result.host_slice()?.iter().all(|b| *b == 7));
/// # Ok(()) }
/// ```
///
/// A graph cannot be replayed after a buffer it uses is gone:
///
/// ```compile_fail
/// # use cumempool::{MemPool, Stream};
/// # fn f(stream: &Stream, pool: &MemPool) -> cumempool::Result<()> {
/// let mut buffer = pool.alloc(4096, stream)?;
/// let graph = stream.capture(|capture| {
///     let target = capture.buffer(&mut buffer)?;
///     capture.fill(&target, 0)
/// })?;
/// drop(buffer); // error: `buffer` is borrowed by the graph
/// graph.instantiate()?.launch(stream)?;
/// # Ok(()) }
/// ```
///
/// nor after the pool it allocated from is gone:
///
/// ```compile_fail
/// # use cumempool::{MemPool, Route, Stream};
/// # fn f(stream: &Stream) -> cumempool::Result<()> {
/// let pool = MemPool::new(Route::device(0))?;
/// let graph = stream.capture(|capture| {
///     let scratch = capture.alloc(&pool, 4096)?;
///     capture.fill(&scratch, 0)
/// })?;
/// let mut exec = graph.instantiate()?;
/// drop(pool); // error: `pool` is borrowed by the graph
/// exec.launch(stream)?;
/// # Ok(()) }
/// ```
///
/// and memory the capture allocated cannot leave it:
///
/// ```compile_fail
/// # use cumempool::{MemPool, Stream};
/// # fn f(stream: &Stream, pool: &MemPool) -> cumempool::Result<()> {
/// let mut escaped = None;
/// stream.capture(|capture| {
///     escaped = Some(capture.alloc(pool, 4096)?); // error: borrowed data escapes the closure
///     Ok(())
/// })?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Capture<'env> {
    stream: Stream,
    id: u64,
    /// Captured allocations not freed yet (freed in the graph when the closure returns), and
    /// the first free node that could not be recorded.
    live: RefCell<Live>,
    /// The streams of the outside buffers the graph uses, which launches are ordered with.
    outside: RefCell<Vec<Stream>>,
    _env: Invariant<'env>,
}

impl<'env> Capture<'env> {
    /// The capture's id (unique in the process).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The capturing stream: a private stream of this capture (see [`Stream::capture`]), not the
    /// stream `capture` was called on. Work queued on it during the closure, through the raw
    /// driver or another library too, is recorded into the graph.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Records an allocation of `bytes` from `pool` (an allocation node): graph memory, live
    /// from here until the buffer is dropped or the closure returns, in every launch.
    ///
    /// The memory comes from the device's graph memory, not from the pool (driver 580): the
    /// pool's maximum size does not cap it and its statistics do not count it; see
    /// [`Device::graph_memory`](crate::Device::graph_memory).
    ///
    /// # Errors
    /// [`Error::ImportedPoolAllocation`] for an imported pool; [`Error::OutOfMemory`]; the
    /// driver's answer (`cuMemAllocFromPoolAsync`).
    pub fn alloc(&self, pool: &'env Pool, bytes: usize) -> Result<CapturedBuffer<'_>> {
        let route = pool.route();
        if bytes == 0 {
            return Ok(CapturedBuffer { ptr: 0, len: 0, route, capture: self.id, owner: None });
        }
        let ptr = pool.alloc_on(bytes, &self.stream)?;
        self.live.borrow_mut().allocations.push(ptr);
        Ok(CapturedBuffer { ptr, len: bytes, route, capture: self.id, owner: Some((&self.stream, &self.live)) })
    }

    /// Lets the graph use a buffer from outside the capture, borrowed mutably for as long as the
    /// graph may run (`'env`). Launches are ordered after the work queued on the buffer's
    /// stream, and the buffer's stream after each launch, so its free comes after every launch.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] for a buffer whose own stream (other than the capturing one)
    /// captures too; the driver's answer.
    pub fn buffer<S: Borrow<Stream>>(&self, buffer: &'env mut BufferOn<S>) -> Result<CapturedBuffer<'_>> {
        let stream = buffer.on();
        if !stream.same_as(&self.stream) {
            stream.ensure_not_capturing("using a buffer in a capture (Capture::buffer)")?;
        }
        let mut outside = self.outside.borrow_mut();
        if !outside.iter().any(|known| known.same_as(stream)) {
            outside.push(stream.clone());
        }
        Ok(CapturedBuffer {
            ptr: buffer.as_raw(),
            len: buffer.len(),
            route: buffer.route(),
            capture: self.id,
            owner: None,
        })
    }

    /// Records setting every byte of `dst` to `value` (a memset node). Device and managed
    /// memory only: the driver's memset refuses pinned host memory; copy into it instead.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for pinned host memory or a buffer of another capture; the
    /// driver's answer.
    ///
    /// See [cuMemsetD8Async](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    pub fn fill(&self, dst: &CapturedBuffer<'_>, value: u8) -> Result<()> {
        const WHAT: &str = "filling a buffer in a capture (Capture::fill)";
        self.check_own(WHAT, dst)?;
        if dst.route.is_some_and(|r| r.location.is_host() && r.allocation_type == AllocationType::Pinned) {
            return Err(Error::InvalidArgument { what: WHAT, reason: InvalidArgumentReason::PinnedHostFill });
        }
        if dst.len == 0 {
            return Ok(());
        }
        // SAFETY: a live allocation of `len` bytes whenever the graph runs (see `Capture`).
        let answer = unsafe { driver_answer!(cuMemsetD8Async(dst.ptr, value, dst.len, self.stream.as_raw())) }?;
        refused_capture(answer, WHAT)
    }

    /// Records copying the start of `src` into the start of `dst` (a copy node): device, managed
    /// and pinned host pool memory.
    ///
    /// # Errors
    /// [`Error::DoesNotFit`] when `src` is longer than `dst`; [`Error::OverlappingCopy`] when the
    /// ranges overlap (the same buffer as both, say), which the driver's copy leaves undefined;
    /// [`Error::InvalidArgument`] for a buffer of another capture; the driver's answer.
    ///
    /// See [cuMemcpyAsync](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html).
    pub fn copy(&self, dst: &CapturedBuffer<'_>, src: &CapturedBuffer<'_>) -> Result<()> {
        const WHAT: &str = "copying in a capture (Capture::copy)";
        self.check_own(WHAT, dst)?;
        self.check_own(WHAT, src)?;
        if src.len > dst.len {
            return Err(Error::DoesNotFit { what: WHAT, requested: src.len, capacity: dst.len });
        }
        if src.len == 0 {
            return Ok(());
        }
        // One buffer of `Capture::buffer` may be passed as both ends.
        if ranges_overlap(dst.ptr, src.ptr, src.len) {
            return Err(Error::OverlappingCopy { what: WHAT, dst: dst.ptr, src: src.ptr, len: src.len });
        }
        // Copies that involve host memory need the context current (see `Stream::bind_context`).
        self.stream.bind_context()?;
        // SAFETY: both live for at least `src.len` bytes whenever the graph runs.
        let answer = unsafe { driver_answer!(cuMemcpyAsync(dst.ptr, src.ptr, src.len, self.stream.as_raw())) }?;
        refused_capture(answer, WHAT)
    }

    fn check_own(&self, what: &'static str, buffer: &CapturedBuffer<'_>) -> Result<()> {
        if buffer.capture != self.id {
            return Err(Error::InvalidArgument {
                what,
                reason: InvalidArgumentReason::BufferOfAnotherCapture {
                    buffer_capture: buffer.capture,
                    capture: self.id,
                },
            });
        }
        Ok(())
    }

    /// Frees the captured allocations still alive (a `CapturedBuffer` forgotten with
    /// `mem::forget`) in the graph, and hands over the outside streams and the first free node
    /// that could not be recorded.
    fn finish(&self) -> (Vec<Stream>, Option<Error>) {
        let mut live = self.live.borrow_mut();
        for ptr in std::mem::take(&mut live.allocations) {
            live.free_node(ptr, &self.stream);
        }
        (std::mem::take(&mut *self.outside.borrow_mut()), live.failed_free.take())
    }
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        // Unwinding out of the closure: free nodes before the capture ends.
        self.finish();
    }
}

/// Whether `len` bytes at `a` and `len` bytes at `b` share a byte (`len` > 0).
fn ranges_overlap(a: sys::CUdeviceptr, b: sys::CUdeviceptr, len: usize) -> bool {
    let len = len as u64;
    a < b.saturating_add(len) && b < a.saturating_add(len)
}

/// A capture's allocations not freed yet, and the first free node that failed.
#[derive(Debug, Default)]
struct Live {
    allocations: Vec<sys::CUdeviceptr>,
    failed_free: Option<Error>,
}

impl Live {
    /// Records the free of a captured allocation (a free node); the first failure is kept for
    /// the capture to answer.
    fn free_node(&mut self, ptr: sys::CUdeviceptr, stream: &Stream) {
        // SAFETY: a live allocation of this capture, freed once (it left the live list).
        if let Err(error) = unsafe { driver_call!(cuMemFreeAsync(ptr, stream.as_raw())) } {
            self.failed_free.get_or_insert(error);
        }
    }
}

/// Memory a capture can use: allocated by it ([`Capture::alloc`], freed in the graph when this
/// is dropped) or from outside it ([`Capture::buffer`]). It cannot leave the capture's closure.
#[derive(Debug)]
pub struct CapturedBuffer<'c> {
    ptr: sys::CUdeviceptr,
    len: usize,
    route: Option<Route>,
    capture: u64,
    /// For memory the capture allocated: the capturing stream and the capture's live list.
    owner: Option<(&'c Stream, &'c RefCell<Live>)>,
}

impl CapturedBuffer<'_> {
    /// The device address (the same in every launch).
    pub fn as_raw(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the capture allocated it (and frees it in the graph).
    pub fn is_captured_allocation(&self) -> bool {
        self.owner.is_some()
    }
}

impl Drop for CapturedBuffer<'_> {
    fn drop(&mut self) {
        let Some((stream, live)) = self.owner else { return };
        let mut live = live.borrow_mut();
        if let Some(at) = live.allocations.iter().position(|p| *p == self.ptr) {
            live.allocations.swap_remove(at);
            live.free_node(self.ptr, stream);
        }
    }
}

/// A captured graph (`cuGraphDestroy` when dropped). It keeps borrowed, for `'env`, the memory
/// and pools its work uses.
#[derive(Debug)]
pub struct Graph<'env> {
    raw: DriverHandle<sys::CUgraph>,
    context: Option<Context>,
    outside: Vec<Stream>,
    _env: Invariant<'env>,
}

impl<'env> Graph<'env> {
    /// The driver's handle.
    pub fn as_raw(&self) -> sys::CUgraph {
        self.raw.0
    }

    /// How many nodes the graph has.
    ///
    /// See [cuGraphGetNodes](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    ///
    /// # Errors
    /// The driver's answer.
    pub fn node_count(&self) -> Result<usize> {
        let mut count = 0;
        // SAFETY: a live graph; a null node array asks only for the count.
        unsafe { driver_call!(cuGraphGetNodes(self.raw.0, std::ptr::null_mut(), &mut count)) }?;
        Ok(count)
    }

    /// An executable graph, instantiated with `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`
    /// (graph memory a launch left allocated is freed by the next launch), in the capturing
    /// stream's context. The graph may be dropped afterwards; the executable keeps `'env`.
    ///
    /// # Errors
    /// [`Error::StreamNotBorrowable`] when the capturing stream was borrowed without its
    /// context; the driver's answer.
    ///
    /// See [cuGraphInstantiateWithFlags](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    pub fn instantiate(&self) -> Result<GraphExec<'env>> {
        let Some(context) = &self.context else {
            return Err(Error::StreamNotBorrowable {
                reason: "instantiating a graph needs the capturing stream's context; borrow the stream with it (Stream::borrow_raw(raw, Some(&context)))",
            });
        };
        let done = Event::new(context)?;
        context.ensure_current()?;
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0;
        let mut raw = std::ptr::null_mut();
        // SAFETY: a live graph; a valid out-pointer; the context is current.
        unsafe { driver_call!(cuGraphInstantiateWithFlags(&mut raw, self.raw.0, u64::from(flags))) }?;
        Ok(GraphExec {
            raw: DriverHandle(raw),
            context: context.clone(),
            done,
            launched: false,
            outside: self.outside.clone(),
            private: None,
            markers: Vec::new(),
            _env: PhantomData,
        })
    }
}

impl Drop for Graph<'_> {
    fn drop(&mut self) {
        destroy_graph(self.raw.0);
    }
}

/// An executable graph (`cuGraphExecDestroy` when dropped).
///
/// It may move to another thread but not be shared between threads: the driver does not
/// synchronise graph objects, and the event that tracks the last launch is re-recorded by each.
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<cumempool::GraphExec<'static>>();
/// ```
///
/// Dropping it waits on the host for its last launch, so the memory it borrowed for `'env` is
/// released only after every launch has finished. Each launch is also ordered after the work
/// queued on the streams of the outside buffers it uses, and those streams after the launch, so
/// even a leaked executable cannot let a buffer be freed under a running launch.
#[derive(Debug)]
pub struct GraphExec<'env> {
    raw: DriverHandle<sys::CUgraphExec>,
    context: Context,
    /// Recorded after each launch; launches of one executable run one after another.
    done: Event,
    launched: bool,
    outside: Vec<Stream>,
    /// Where launches run (see [`GraphExec::launch`]): made by the first, held by nothing else.
    private: Option<Stream>,
    /// The marker events of the last launch that succeeded, for the next to record again (an
    /// event per launch and stream would cost a create and a destroy each time).
    markers: Vec<Event>,
    _env: Invariant<'env>,
}

impl GraphExec<'_> {
    /// The driver's handle.
    pub fn as_raw(&self) -> sys::CUgraphExec {
        self.raw.0
    }

    /// Launches the graph, ordered after the work queued on `stream` and on the streams of the
    /// outside buffers it uses, and orders those streams after the launch.
    ///
    /// The launch itself runs on a private stream of the executable's, ordered after those
    /// streams with events, never on `stream`: other code may begin capturing a stream it lent
    /// (one from `Stream::from_cudarc`, say) at any moment, and a launch queued there could be
    /// recorded into that capture, whose graph would replay it after this executable and the
    /// memory it borrowed are gone, while the event that `Drop` waits for would be recorded into
    /// the capture too and could not be waited for. Nothing else holds the private stream, so it
    /// captures only by joining a capture through one of those events, which happens only if the
    /// event was recorded into a capture, before anything was launched: that is checked, and
    /// refused with the joined capture invalidated (its end gives no graph).
    ///
    /// A stream that other code begins capturing once the launch is queued cannot be ordered
    /// after it on the device (the driver refuses that wait and would invalidate the capture):
    /// the call then waits for the launch on the host before it returns, and leaves that
    /// capture alone.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] when `stream` (or an outside buffer's stream) captures, and
    /// inside a [`Stream::capture`] closure on this thread;
    /// [`Error::CaptureRefused`] when other code began capturing one of them while the launch
    /// was being set up (nothing was launched); the driver's answer (a failure after the launch
    /// was queued comes only after the launch has finished, where it could be waited for).
    ///
    /// See [cuGraphLaunch](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    pub fn launch(&mut self, stream: &Stream) -> Result<()> {
        // Setting up the order queries events, and may wait on the host (a stream borrowed
        // without its context, a stream that begins capturing meanwhile): refused inside a
        // capture closure on this thread, as every such query and wait is.
        crate::streams::capture_state::refuse_host_wait_on_capturing_thread(LAUNCH)?;
        stream.ensure_not_capturing(LAUNCH)?;
        let outside = std::mem::take(&mut self.outside);
        let others: Vec<&Stream> = outside.iter().filter(|other| !other.same_as(stream)).collect();
        let launched = others
            .iter()
            .try_for_each(|other| other.ensure_not_capturing(LAUNCH))
            .and_then(|()| self.launch_after(stream, &others));
        self.outside = outside;
        launched
    }

    /// [`launch`](Self::launch) once `stream` and `others` were found not capturing.
    fn launch_after(&mut self, stream: &Stream, others: &[&Stream]) -> Result<()> {
        let private = match self.private.take() {
            Some(private) => private,
            None => {
                let private = Stream::new(&self.context)?;
                // So that its drop asks whether it still captures (it may have joined a capture
                // it could not leave), and leaks it rather than destroy it mid-capture.
                private.note_capture_possible();
                private
            }
        };
        let mut spare = std::mem::take(&mut self.markers);
        let mut markers = Vec::with_capacity(1 + others.len());
        let launched = capture_mode::relaxed(|| {
            for before in std::iter::once(stream).chain(others.iter().copied()) {
                match before.context() {
                    Some(context) => {
                        let marker = spare_marker(&mut spare, context).map_or_else(|| Event::new(context), Ok)?;
                        ordering::order_after(&private, before, &marker, LAUNCH, &MARKER_HINTS)?;
                        markers.push(marker);
                    }
                    // No event can be made for a stream borrowed without its context: its queued
                    // work is waited for on the host instead (no marker, so nothing to join).
                    None => before.synchronize()?,
                }
            }
            for marker in &markers {
                ordering::refuse_if_captured(marker, LAUNCH, &MARKER_HINTS)?;
            }
            private.bind()?;
            // SAFETY: a live executable, on a live stream that does not capture; the memory the
            // graph uses is borrowed for `'env`, and `Drop` waits for `done` before that ends.
            unsafe { driver_call!(cuGraphLaunch(self.raw.0, private.as_raw())) }?;
            self.launched = true;
            if let Err(error) = self.done.record(&private) {
                // Without the event, neither Drop nor the streams could wait for this launch:
                // wait on the host now, with a wait nothing refuses (not even another capture's
                // closure on this thread: invalidating that capture is better than letting a
                // buffer be freed under the launch).
                if let Err(wait) = private.wait_before_release() {
                    tracing::error!(%wait, %error, "a graph launch whose completion event could not be recorded could not be waited for either; its buffers may be freed under it");
                }
                return Err(error);
            }
            for after in std::iter::once(stream).chain(others.iter().copied()) {
                // A stream that other code began capturing since the check cannot wait for the
                // launch's event: the driver refuses a capturing stream's wait for an event
                // recorded outside its capture, and invalidates that capture. The launch is
                // waited for on the host instead, which orders every later use of the streams'
                // memory after it; the launch ran, so that is no error.
                // The legacy stream is never captured, but a blocking stream's capture begun since
                // refuses its wait just the same.
                let began_capturing = (after.may_be_capturing()
                    && !matches!(after.capture_status(), Ok(CaptureStatus::None)))
                    || after.is_blocked_by_a_capture();
                let refused = if began_capturing { None } else { after.wait(&self.done).err() };
                if began_capturing || refused.is_some() {
                    // `after` is not ordered after the launch, and its next free (even of a
                    // leaked executable's buffer) could release memory the launch still uses:
                    // wait for the launch on the host, with a wait nothing refuses.
                    let waited = self.done.wait_before_release();
                    return match (refused, waited) {
                        (None, Ok(())) => Ok(()),
                        (Some(error), Ok(())) => Err(error),
                        (refused, Err(wait)) => {
                            tracing::error!(%wait, ?refused, "a graph launch whose buffers' streams could not be ordered after it could not be waited for either; its buffers may be freed under it");
                            Err(refused.unwrap_or(wait))
                        }
                    };
                }
            }
            Ok(())
        });
        // Kept for the next launch only if it does not capture; else its drop leaks it.
        if matches!(private.capture_status(), Ok(CaptureStatus::None)) {
            self.private = Some(private);
        }
        // Only a launch's own markers, and only after it succeeded: one a refused launch recorded
        // may sit in other code's capture.
        if launched.is_ok() {
            self.markers = markers;
        }
        launched
    }

    /// Uploads the graph to the device ahead of its first launch, ordered on `stream`.
    ///
    /// # Errors
    /// [`Error::StreamCapturing`] when `stream` captures; the driver's answer.
    ///
    /// See [cuGraphUpload](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html).
    pub fn upload(&mut self, stream: &Stream) -> Result<()> {
        stream.ensure_not_capturing("uploading a graph (GraphExec::upload)")?;
        stream.bind()?;
        // SAFETY: a live executable and stream.
        unsafe { driver_call!(cuGraphUpload(self.raw.0, stream.as_raw())) }
    }

    /// Waits on the host until the last launch has finished.
    ///
    /// # Errors
    /// The driver's answer, which includes errors of the launch.
    pub fn synchronize(&self) -> Result<()> {
        self.done.synchronize()
    }
}

const LAUNCH: &str = "launching a graph (GraphExec::launch)";

/// A marker event of an earlier launch in `context`, taken from `spare`.
fn spare_marker(spare: &mut Vec<Event>, context: &Context) -> Option<Event> {
    let at = spare.iter().position(|marker| marker.context().as_raw() == context.as_raw())?;
    Some(spare.swap_remove(at))
}

/// Why a launch is refused whose private stream a capture of other code reached through a marker
/// (nothing was launched).
const MARKER_HINTS: ordering::Hints = ordering::Hints {
    joined: "other code began capturing the launch's stream (or an outside buffer's stream) while the launch was being set up; nothing was launched, and that capture was invalidated (its end gives no graph). Launch before another library's capture of the stream begins or after it ends",
    captured: "other code captured the launch's stream (or an outside buffer's stream) while the launch was being set up; nothing was launched. Launch before another library's capture of the stream begins or after it ends",
};

impl Drop for GraphExec<'_> {
    fn drop(&mut self) {
        // The memory borrowed for `'env` is released once this returns: the wait is one nothing
        // refuses, inside another capture's closure too.
        if self.launched {
            if let Err(error) = self.done.wait_before_release() {
                tracing::error!(%error, "waiting for a graph's last launch failed; the memory it borrowed may be released under it");
            }
        }
        let raw = self.raw.0;
        // In relaxed mode, as the wait above: other code's capture on this thread (or a global
        // one) must not be invalidated by the destroy.
        let result = self.context.while_current(|| {
            capture_mode::relaxed(|| {
                // SAFETY: an executable this crate owns, destroyed once, after its last launch.
                unsafe { driver_call!(cuGraphExecDestroy(raw)) }
            })
        });
        if let Err(error) = result {
            tracing::warn!(%error, "destroying an executable graph failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capture over a stream no driver sees: only what is refused before the driver is tested.
    fn capture_without_a_driver() -> Capture<'static> {
        // SAFETY: never given to a driver by the calls below, which refuse first.
        let stream = unsafe { Stream::borrow_raw(0x5000 as sys::CUstream, None) }.unwrap_or_else(|e| panic!("{e}"));
        Capture {
            stream,
            id: 9,
            live: RefCell::new(Live::default()),
            outside: RefCell::new(Vec::new()),
            _env: PhantomData,
        }
    }

    fn outside(ptr: sys::CUdeviceptr, len: usize) -> CapturedBuffer<'static> {
        CapturedBuffer { ptr, len, route: Some(Route::device(0)), capture: 9, owner: None }
    }

    #[test]
    fn a_captured_copy_between_overlapping_ranges_is_refused_before_the_driver() {
        let capture = capture_without_a_driver();
        let buffer = outside(0x10_0000, 4096);
        let same = capture.copy(&buffer, &buffer);
        assert!(matches!(same, Err(Error::OverlappingCopy { len: 4096, .. })), "{same:?}");
        let shifted = capture.copy(&outside(0x10_0800, 4096), &outside(0x10_0000, 4096));
        assert!(matches!(shifted, Err(Error::OverlappingCopy { .. })), "{shifted:?}");
        let backwards = capture.copy(&outside(0x10_0008, 4096), &outside(0x10_0000, 16));
        assert!(matches!(backwards, Err(Error::OverlappingCopy { .. })), "{backwards:?}");
    }

    #[test]
    fn a_stream_borrowed_without_a_context_cannot_be_captured_and_is_told_what_would_work() {
        // SAFETY: refused before any driver call.
        let stream = unsafe { Stream::borrow_raw(0x5000 as sys::CUstream, None) }.unwrap_or_else(|e| panic!("{e}"));
        let refused = stream.capture(|_| Ok(())).map(|_| ());
        let Err(Error::StreamNotBorrowable { reason }) = refused else { panic!("{refused:?}") };
        assert!(reason.contains("primary context") && reason.contains("any other context cannot"), "{reason}");
        assert!(!reason.contains("borrow it with"), "no advice that a non-primary context cannot follow");
    }

    #[test]
    fn a_buffer_of_another_capture_or_a_pinned_host_fill_is_refused_with_a_reason_to_match() {
        let capture = capture_without_a_driver();
        let foreign =
            CapturedBuffer { ptr: 0x10_0000, len: 64, route: Some(Route::device(0)), capture: 4, owner: None };
        let refused = capture.fill(&foreign, 0);
        assert!(
            matches!(
                refused,
                Err(Error::InvalidArgument {
                    reason: InvalidArgumentReason::BufferOfAnotherCapture { buffer_capture: 4, capture: 9 },
                    ..
                })
            ),
            "{refused:?}"
        );
        let copied = capture.copy(&outside(0x20_0000, 64), &foreign);
        assert!(
            matches!(
                copied,
                Err(Error::InvalidArgument { reason: InvalidArgumentReason::BufferOfAnotherCapture { .. }, .. })
            ),
            "{copied:?}"
        );
        let host = CapturedBuffer { ptr: 0x10_0000, len: 64, route: Some(Route::host()), capture: 9, owner: None };
        let filled = capture.fill(&host, 0);
        assert!(
            matches!(filled, Err(Error::InvalidArgument { reason: InvalidArgumentReason::PinnedHostFill, .. })),
            "{filled:?}"
        );
    }

    #[test]
    fn ranges_that_only_touch_do_not_overlap() {
        assert!(!ranges_overlap(0x1000, 0x2000, 0x1000));
        assert!(!ranges_overlap(0x2000, 0x1000, 0x1000));
        assert!(ranges_overlap(0x1000, 0x1fff, 0x1000));
        assert!(ranges_overlap(u64::MAX - 4, u64::MAX - 8, 8), "no overflow near the top");
    }
}
