//! How the cache takes its locks.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks ignoring poison: a panic while holding one of the cache's locks cannot leave what it
/// guards inconsistent, every update under them is local.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
