//! The context work on a stream runs in: the stream's own, else its device's primary context,
//! retained once per device for the process. Invariant: one retained primary context per
//! device, never released (the process keeps it, as the runtime does), so after the first use
//! of a device no lookup here makes a driver call.

use crate::sync::locks::lock;
use std::sync::Mutex;

/// The retained primary contexts, one per device, in the order first asked for.
static PRIMARY: Mutex<Vec<(i32, cumempool::Context)>> = Mutex::new(Vec::new());

/// The primary context of `device`, retained on the first call for the device. That call
/// retains it with the driver (which may create it: a long call), so callers holding the GIL
/// make it with the GIL released.
pub(crate) fn primary_context(device: i32) -> cumempool::Result<cumempool::Context> {
    // Retained without the lock (another thread's lookup of a known device need not wait); an
    // extra retain, where another thread retained it meanwhile, is released after the lock
    // (releasing is a driver call).
    once_per_device(&PRIMARY, device, || cumempool::Device::get(device)?.primary_context())
}

/// The entry of `device` in `entries`, made by `make` on the first call for the device. `make`
/// runs without the lock, so a lookup of a known device never waits for it; where another
/// thread made an entry meanwhile, that first one stays the device's and the one made here is
/// dropped after the lock.
pub(crate) fn once_per_device<T: Clone>(
    entries: &Mutex<Vec<(i32, T)>>,
    device: i32,
    make: impl FnOnce() -> cumempool::Result<T>,
) -> cumempool::Result<T> {
    let known = |entries: &[(i32, T)]| entries.iter().find(|(d, _)| *d == device).map(|(_, entry)| entry.clone());
    if let Some(entry) = known(&lock(entries)) {
        return Ok(entry);
    }
    let made = make()?;
    let mut entries = lock(entries);
    if let Some(first) = known(&entries) {
        drop(entries);
        return Ok(first);
    }
    entries.push((device, made.clone()));
    Ok(made)
}

/// The context of `stream`, a stream of `device`: its own where it knows it (every stream the
/// bindings make or borrow does), else the device's primary context.
pub(crate) fn context_of(stream: &cumempool::Stream, device: i32) -> cumempool::Result<cumempool::Context> {
    match stream.context() {
        Some(context) => Ok(context.clone()),
        None => primary_context(device),
    }
}
