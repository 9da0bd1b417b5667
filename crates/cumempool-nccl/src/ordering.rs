//! How a collective is ordered with the streams its buffers are released on, and whether this
//! thread is inside [`group`](crate::group())'s closure.
//!
//! A buffer's free is queued on its own stream. A collective queued on another stream is made to
//! wait for the work queued on each buffer's stream (the work that produced its data), and each
//! buffer's stream is then made to wait for the collective, so the free, and every later use in
//! that stream's order, comes after NCCL is done with the memory: an event each way, as
//! `BufferOn::copy_from_async` orders a copy.
//!
//! Inside a group both halves wait for the group's end ([`crate::group()`] runs them around
//! the launch): the first, so that the work queued on a buffer's stream inside the closure comes
//! before the collective, and a capture a stream joined inside it is seen; the second, since
//! NCCL launches only at `ncclGroupEnd`.

use crate::error::{Error, Result};
use cumempool::Stream;
use std::cell::Cell;

thread_local! {
    /// How many [`crate::group()`] closures run on this thread (0 or 1: groups do not nest).
    static GROUP_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Whether this thread runs inside [`crate::group()`]'s closure.
pub(crate) fn inside_group() -> bool {
    GROUP_DEPTH.with(Cell::get) > 0
}

/// Refuses `what` inside [`crate::group()`]'s closure, saying what to do `instead`.
pub(crate) fn refuse_inside_group(what: &'static str, instead: &'static str) -> Result<()> {
    if inside_group() {
        return Err(Error::InsideGroup { what, instead });
    }
    Ok(())
}

/// Marks this thread as inside a group's closure while it lives (also while it unwinds).
pub(crate) struct InsideGroup(());

impl InsideGroup {
    pub(crate) fn enter() -> Self {
        GROUP_DEPTH.with(|depth| depth.set(depth.get() + 1));
        Self(())
    }
}

impl Drop for InsideGroup {
    fn drop(&mut self) {
        GROUP_DEPTH.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

/// A collective queued (or about to be launched) on `collective`, and the buffers' streams that
/// must wait for it.
#[derive(Debug)]
pub(crate) struct Ordered {
    collective: Stream,
    buffers: Vec<Stream>,
}

/// Before a collective is queued on `stream`: refuses a capture underway on `stream` or on a
/// buffer's stream (NCCL's kernels would be recorded into a graph that outlives the buffers), then
/// makes `stream` wait for each buffer's stream that is not `stream`.
///
/// # Errors
/// [`cumempool::Error::StreamCapturing`]; the ordering's failure (nothing is queued then).
pub(crate) fn before(what: &'static str, stream: &Stream, buffers: [Option<&Stream>; 2]) -> Result<Ordered> {
    stream.ensure_not_capturing(what)?;
    let mut others: Vec<Stream> = Vec::with_capacity(2);
    for buffer in buffers.into_iter().flatten() {
        buffer.ensure_not_capturing(what)?;
        if !buffer.same_as(stream) && !others.iter().any(|other| other.same_as(buffer)) {
            others.push(buffer.clone());
        }
    }
    for other in &others {
        stream.order_after(other)?;
    }
    Ok(Ordered { collective: stream.clone(), buffers: others })
}

impl Ordered {
    /// After the collective was launched: each buffer's stream waits for the collective's
    /// stream. Where that cannot be set up, the host waits for the collective's stream (with a
    /// wait nothing the library refuses), so no buffer is released under NCCL.
    ///
    /// # Errors
    /// The first ordering that failed (the wait took its place).
    pub(crate) fn after(self) -> Result<()> {
        let mut first_error = None;
        for buffer in &self.buffers {
            if let Err(error) = buffer.order_after(&self.collective) {
                first_error.get_or_insert(Error::from(error));
            }
        }
        let Some(error) = first_error else { return Ok(()) };
        if let Err(wait) = self.collective.wait_before_release() {
            tracing::error!(%wait, %error, "a collective whose buffers' streams could not be ordered after it could not be waited for either; their frees may not wait for it");
        }
        Err(error)
    }
}
