//! A resource over the host heap, for testing adaptors and caches without a GPU.

use crate::error::{Error, Result};
use crate::memory_kind::HostMemory;
use crate::resource::StreamOrderedResource;
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::alloc::Layout;

/// Host memory from the global allocator; streams are ignored (every call is already complete).
///
/// For tests of code generic over [`StreamOrderedResource`]: no driver is needed.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostHeap;

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
}
