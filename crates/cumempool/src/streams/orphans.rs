//! The orphan registry: frees that `Stream` values dropped during a capture left behind, with
//! what keeps their stream valid until they run, and owned streams leaked for such a capture.

use crate::devices::context::Context;
use crate::driver::driver_call;
use crate::driver::handle::DriverHandle;
use crate::streams::deferred_frees::DeferredFree;
use cumempool_sys as sys;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};

/// Another library's handle, held only so that its stream outlives this one.
pub(crate) struct KeepAlive(pub(crate) Option<Arc<dyn std::any::Any + Send + Sync>>);

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Some(..)" } else { "None" })
    }
}

/// Frees deferred by a capture whose `Stream` values all dropped before it ended, with what
/// keeps their stream valid until they run (the lender's handle; an owned stream is leaked).
///
/// Invariant: every entry's stream is valid (by [`Stream::borrow_raw`](crate::Stream::borrow_raw)'s contract, the keep-alive,
/// or the leak) and names the same driver stream until its frees have run, so they run on it, in
/// its order after the capture, by the first capture-aware operation on a `Stream` with the same
/// handle that finds it not capturing, by that `Stream`'s drop, or by [`Stream::run_orphaned_frees`](crate::Stream::run_orphaned_frees).
/// Every keep-alive of the values that left frees for the stream stays with them (any one of
/// them may be what keeps the stream valid), and an owned stream leaked for a capture is
/// destroyed once the capture is over and its frees have run.
#[derive(Debug)]
pub(crate) struct Orphan {
    pub(crate) raw: DriverHandle<sys::CUstream>,
    pub(crate) context: Option<Context>,
    pub(crate) frees: Vec<DeferredFree>,
    /// The stream was the library's own (made by `Stream::new`): destroy it after the frees.
    pub(crate) owned: bool,
    pub(crate) _keep_alive: Vec<KeepAlive>,
}

static ORPHANS: Mutex<Vec<Orphan>> = Mutex::new(Vec::new());

/// How many entries [`ORPHANS`] holds: read (one relaxed load) before taking the lock.
static ORPHAN_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

pub(crate) fn adopt(orphan: Orphan) {
    let mut orphans = ORPHANS.lock().unwrap_or_else(PoisonError::into_inner);
    orphans.push(orphan);
    ORPHAN_COUNT.store(orphans.len(), Relaxed);
}

pub(crate) fn take_orphans_where(mut matches: impl FnMut(&Orphan) -> bool) -> Vec<Orphan> {
    if ORPHAN_COUNT.load(Relaxed) == 0 {
        return Vec::new();
    }
    let mut orphans = ORPHANS.lock().unwrap_or_else(PoisonError::into_inner);
    let (taken, kept) = std::mem::take(&mut *orphans).into_iter().partition(|o| matches(o));
    *orphans = kept;
    ORPHAN_COUNT.store(orphans.len(), Relaxed);
    taken
}

/// Whether any orphan waits (one relaxed load): a hot path's check before it takes any.
pub(crate) fn any_orphans() -> bool {
    ORPHAN_COUNT.load(Relaxed) != 0
}

/// The orphans of the driver stream `raw` (in `context`, where both sides know it: an ordinary
/// stream's handle names one stream whatever the context, and the legacy handles never capture).
pub(crate) fn take_orphans(raw: sys::CUstream, context: Option<sys::CUcontext>) -> Vec<Orphan> {
    take_orphans_where(|o| is_of(o, raw, context))
}

/// Whether an orphan of the driver stream `raw` waits (as [`take_orphans`] would take it),
/// taking none: one relaxed load where none waits at all, the lock only where some do, so
/// that the frees of other streams cost a stream's hot path no driver call.
pub(crate) fn any_orphans_of(raw: sys::CUstream, context: Option<sys::CUcontext>) -> bool {
    if !any_orphans() {
        return false;
    }
    ORPHANS.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|o| is_of(o, raw, context))
}

/// Whether `orphan` is of the driver stream `raw` in `context` (see [`take_orphans`]).
fn is_of(orphan: &Orphan, raw: sys::CUstream, context: Option<sys::CUcontext>) -> bool {
    orphan.raw.0 == raw && (context.is_none() || orphan.context.as_ref().is_none_or(|c| Some(c.as_raw()) == context))
}

/// Destroys an owned stream that was leaked because other code captured it when its last value
/// dropped, now that the capture is over and its frees have run.
pub(crate) fn destroy_leaked(raw: sys::CUstream, context: Option<&Context>) {
    // SAFETY: an owned stream, leaked (never destroyed) for its capture; its orphan is gone,
    // so this is its one destroy.
    let destroy = || unsafe { driver_call!(cuStreamDestroy(raw)) };
    let destroyed = match context {
        Some(context) => context.while_current(destroy),
        None => destroy(),
    };
    if let Err(error) = destroyed {
        tracing::warn!(%error, "destroying a stream leaked for a capture failed");
    }
}
