//! The context work on a stream runs in: the stream's own, else its device's primary context,
//! retained once per device for the process. Invariant: one retained primary context per
//! device, never released (the process keeps it, as the runtime does), so after the first use
//! of a device no lookup here makes a driver call.

use crate::sync::locks::lock;
use std::sync::{Mutex, OnceLock};

/// The retained primary contexts, one per device.
static PRIMARY: PerDevice<cumempool::Context> = PerDevice::new();

/// The primary context of `device`, retained on the first call for the device. That call
/// retains it with the driver (which may create it: a long call), so callers holding the GIL
/// make it with the GIL released.
pub(crate) fn primary_context(device: i32) -> cumempool::Result<cumempool::Context> {
    PRIMARY.get_or_make(device, || cumempool::Device::get(device)?.primary_context()).cloned()
}

/// The primary context of `device` where an earlier call retained it, without a driver call or
/// a lock (for ordinals below [`UNLOCKED_DEVICES`]); `None` otherwise.
pub(crate) fn primary_context_if_retained(device: i32) -> Option<&'static cumempool::Context> {
    PRIMARY.get_unlocked(device)
}

/// How many device ordinals, from 0, [`PerDevice`] finds without a lock.
const UNLOCKED_DEVICES: usize = 64;

/// One entry per device, made on the first call for the device and kept for the process (never
/// dropped). Hot paths (a plug-in's allocation on a default stream) look entries up: for device
/// ordinals below [`UNLOCKED_DEVICES`] that is one acquire load, without a lock or an atomic
/// read-modify-write; other ordinals go through a lock.
pub(crate) struct PerDevice<T: 'static> {
    unlocked: [OnceLock<T>; UNLOCKED_DEVICES],
    /// Entries of other ordinals, leaked once made (they live for the process either way).
    locked: Mutex<Vec<(i32, &'static T)>>,
}

impl<T: Send + Sync> PerDevice<T> {
    pub(crate) const fn new() -> Self {
        Self { unlocked: [const { OnceLock::new() }; UNLOCKED_DEVICES], locked: Mutex::new(Vec::new()) }
    }

    /// The entry of `device` where it was made and the ordinal is below [`UNLOCKED_DEVICES`]:
    /// one acquire load, never a lock.
    pub(crate) fn get_unlocked(&'static self, device: i32) -> Option<&'static T> {
        usize::try_from(device).ok().and_then(|d| self.unlocked.get(d)).and_then(OnceLock::get)
    }

    /// The entry of `device`, made by `make` on the first call for the device. `make` runs
    /// without a lock, so a lookup of a known device never waits for it; where another thread
    /// made an entry meanwhile, that first one stays the device's and the one made here is
    /// dropped (on the calling thread, outside any lock).
    pub(crate) fn get_or_make<E>(
        &'static self,
        device: i32,
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<&'static T, E> {
        if let Some(slot) = usize::try_from(device).ok().and_then(|d| self.unlocked.get(d)) {
            if let Some(entry) = slot.get() {
                return Ok(entry);
            }
            let made = make()?;
            // The closure only moves `made` in, so another thread waits for it at most that
            // long; where the slot was set meanwhile it is not called, and drops `made`.
            return Ok(slot.get_or_init(move || made));
        }
        let known = |entries: &[(i32, &'static T)]| entries.iter().find(|(d, _)| *d == device).map(|&(_, e)| e);
        if let Some(entry) = known(&lock(&self.locked)) {
            return Ok(entry);
        }
        let made = make()?;
        let mut entries = lock(&self.locked);
        if let Some(first) = known(&entries) {
            drop(entries);
            drop(made);
            return Ok(first);
        }
        let entry: &'static T = Box::leak(Box::new(made));
        entries.push((device, entry));
        Ok(entry)
    }
}

/// The context of `stream`, a stream of `device`: its own where it knows it (every stream the
/// bindings make or borrow does), else the device's primary context.
pub(crate) fn context_of(stream: &cumempool::Stream, device: i32) -> cumempool::Result<cumempool::Context> {
    match stream.context() {
        Some(context) => Ok(context.clone()),
        None => primary_context(device),
    }
}
