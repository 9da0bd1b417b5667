//! Raw driver handles that may cross threads.

use cumempool_sys as sys;

/// The raw handle types the driver lets any thread use.
pub(crate) trait RawHandle: Copy + private::Sealed {}

mod private {
    pub trait Sealed {}
}

macro_rules! raw_handles {
    ($($handle:ty),*) => {$(
        impl private::Sealed for $handle {}
        impl RawHandle for $handle {}
    )*};
}

raw_handles!(sys::CUmemoryPool, sys::CUstream, sys::CUevent, sys::CUcontext, sys::CUgraph, sys::CUgraphExec);

/// A raw driver handle (a pointer the driver owns) that may be used from any thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub(crate) struct DriverHandle<T: RawHandle>(pub(crate) T);

// SAFETY: the CUDA driver API is thread-safe: its pool, stream, event, context and graph handles may
// be used from any thread, and this crate never dereferences them on the Rust side. Only those
// handle types implement the sealed `RawHandle`.
unsafe impl<T: RawHandle> Send for DriverHandle<T> {}
// SAFETY: as above; sharing a handle only shares the right to pass it to the driver.
unsafe impl<T: RawHandle> Sync for DriverHandle<T> {}
