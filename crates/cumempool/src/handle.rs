//! Raw driver handles that may cross threads.

/// A raw driver handle (a pointer the driver owns) that may be used from any thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub(crate) struct Shared<T>(pub(crate) T);

// SAFETY: the CUDA driver API is thread-safe: its handles (pools, streams, events, contexts) may
// be used from any thread, and this crate never dereferences them on the Rust side.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above; sharing a handle only shares the right to pass it to the driver.
unsafe impl<T> Sync for Shared<T> {}
