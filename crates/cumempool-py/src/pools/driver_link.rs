//! The adaptor at the bottom of every resource stack the bindings build, right above the pool:
//! the only place a stack reaches the driver, so the only place that needs to release the GIL
//! and to put the caller's context back. Each role is its own module's ([`crate::sync::gil`],
//! [`crate::streams::current_context`]); this one composes them.

use cumempool::sys::CUdeviceptr;
use cumempool_alloc::StreamOrderedResource;

/// A pool's resource whose driver calls release the GIL when a binding marked the thread
/// ([`crate::sync::gil::released`], outermost: the context is restored before the GIL is taken back)
/// and put back the caller's context after a call on a legacy stream
/// ([`crate::streams::current_context::restored_after`], inside).
/// Both are needed at the bottom of every stack because only there does a call reach the
/// driver: a cache hit, a limit check or a count above it runs with the GIL held and touches no
/// context, while every path that reaches the driver through a resource (an allocation, a cache
/// giving blocks back on release, collection or to make room for another stream's allocation,
/// the PyTorch plug-in's C functions) must neither hold the GIL across a driver call that may
/// wait nor leave another device's context current for the Python code around it.
pub struct DriverLink<R>(pub R);

// SAFETY: forwards every call to `R`, which keeps the promise.
unsafe impl<R: StreamOrderedResource + Sync> StreamOrderedResource for DriverLink<R> {
    type Kind = R::Kind;

    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &cumempool::Stream) -> cumempool_alloc::Result<CUdeviceptr> {
        crate::sync::gil::released(|| {
            crate::streams::current_context::restored_after(stream.as_raw() as usize, || {
                self.0.allocate(bytes, align, stream)
            })
        })
    }

    #[inline]
    unsafe fn deallocate(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        align: usize,
        stream: &cumempool::Stream,
    ) -> cumempool_alloc::Result<()> {
        crate::sync::gil::released(|| {
            crate::streams::current_context::restored_after(stream.as_raw() as usize, || {
                // SAFETY: forwarded under the caller's promise.
                unsafe { self.0.deallocate(ptr, bytes, align, stream) }
            })
        })
    }

    fn frees_legacy_after_blocking_captures(&self) -> bool {
        self.0.frees_legacy_after_blocking_captures()
    }

    // The capture question of `allocate_unless_capturing` and of anything below asking, with the
    // caller's context current afterwards (the legacy stream's question makes its own current).
    fn is_capturing(&self, stream: &cumempool::Stream) -> cumempool_alloc::Result<bool> {
        Ok(stream.is_capturing_keeping_context()?)
    }
}
