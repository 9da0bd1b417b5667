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
    let known = |contexts: &[(i32, cumempool::Context)]| {
        contexts.iter().find(|(d, _)| *d == device).map(|(_, context)| context.clone())
    };
    if let Some(context) = known(&lock(&PRIMARY)) {
        return Ok(context);
    }
    // Retained without the lock: another thread's lookup of a known device need not wait.
    let context = cumempool::Device::get(device)?.primary_context()?;
    // Another thread may have retained it meanwhile: one entry per device, and the extra
    // retain is released after the lock (releasing is a driver call).
    let mut contexts = lock(&PRIMARY);
    if let Some(first) = known(&contexts) {
        drop(contexts);
        return Ok(first);
    }
    contexts.push((device, context.clone()));
    Ok(context)
}

/// The context of `stream`, a stream of `device`: its own where it knows it (every stream the
/// bindings make or borrow does), else the device's primary context.
pub(crate) fn context_of(stream: &cumempool::Stream, device: i32) -> cumempool::Result<cumempool::Context> {
    match stream.context() {
        Some(context) => Ok(context.clone()),
        None => primary_context(device),
    }
}
