//! A resource over the host heap, for testing adaptors and caches without a GPU.

use crate::error::{Error, Result};
use crate::memory_kind::HostMemory;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Host memory from the global allocator; streams are ignored (every call is already complete).
///
/// For tests of code generic over [`StreamOrderedResource`]: no driver is needed. It never asks
/// the driver whether a stream is capturing either: a stream is capturing for it while a
/// [`SimulatedCapture`] of that stream lives ([`HostHeap::simulate_capture`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct HostHeap;

/// The ids of the streams a [`SimulatedCapture`] marks, once per live capture.
static SIMULATED: Mutex<Vec<u64>> = Mutex::new(Vec::new());
/// [`Stream::CAPTURE_MARK`] while `SIMULATED` holds any entry, else 0: the cheap check, like
/// [`Stream::may_be_capturing`], and the mark [`HostHeap`] sets on every stream's id then.
static SIMULATED_MARK: AtomicU64 = AtomicU64::new(0);

/// What `SIMULATED_MARK` holds for `streams`.
fn mark_for(streams: &[u64]) -> u64 {
    if streams.is_empty() {
        0
    } else {
        Stream::CAPTURE_MARK
    }
}

fn simulated() -> std::sync::MutexGuard<'static, Vec<u64>> {
    // A push or a swap_remove: whole after any panic.
    SIMULATED.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HostHeap {
    /// Makes `stream` capturing, for every resource over the host heap, until the answer is
    /// dropped: what a capture begun by other code looks like to the layers above, without a
    /// driver.
    pub fn simulate_capture(stream: &Stream) -> SimulatedCapture {
        let id = stream.id().get();
        let mut streams = simulated();
        streams.push(id);
        SIMULATED_MARK.store(mark_for(&streams), Relaxed);
        SimulatedCapture { id }
    }
}

/// A capture on the host heap's terms; it ends when dropped. See [`HostHeap::simulate_capture`].
#[derive(Debug)]
#[must_use = "the capture ends when this is dropped"]
pub struct SimulatedCapture {
    id: u64,
}

impl Drop for SimulatedCapture {
    fn drop(&mut self) {
        let mut streams = simulated();
        if let Some(at) = streams.iter().position(|&id| id == self.id) {
            streams.swap_remove(at);
        }
        SIMULATED_MARK.store(mark_for(&streams), Relaxed);
    }
}

// SAFETY: memory from the global allocator with the asked layout, freed with the same.
unsafe impl StreamOrderedResource for HostHeap {
    type Kind = HostMemory;

    fn allocate(&self, bytes: usize, align: usize, _stream: &Stream) -> Result<CUdeviceptr> {
        crate::resource::check_alignment(align)?;
        if bytes == 0 {
            return Ok(0);
        }
        let layout = Layout::from_size_align(bytes, align).map_err(|_| Error::HostOutOfMemory { requested: bytes })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::HostOutOfMemory { requested: bytes });
        }
        Ok(ptr as usize as CUdeviceptr)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, _stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: allocated above with this layout, which was valid then.
        unsafe { std::alloc::dealloc(ptr as usize as *mut u8, Layout::from_size_align_unchecked(bytes, align)) };
        Ok(())
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        Ok(simulated().contains(&stream.id().get()))
    }

    #[inline(always)]
    fn marked_stream_id(&self, stream: &Stream) -> std::num::NonZeroU64 {
        stream.id().get_nonzero() | SIMULATED_MARK.load(Relaxed)
    }
}
