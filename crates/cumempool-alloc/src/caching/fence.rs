//! The fence between a lane's owner entering it and a slow path claiming it.
//!
//! The owner stores `busy` and reads `claimed`; a slow path stores `claimed` and reads `busy`.
//! That is Dekker's mutual exclusion, which needs a full fence between each side's store and
//! load. The owner's side runs on every hot path, so it gets the free half of an asymmetric
//! fence (a compiler fence), and the slow path the expensive half: a `membarrier` system call
//! that makes every running thread of the process execute a full fence (Linux 4.14 and later).
//! Where that call cannot be registered (other systems, a kernel or sandbox without it, Miri),
//! both sides use an ordinary sequentially consistent fence, which costs the owner about what a
//! lock would. Should the call fail later, the slow path's half is refused, never skipped: for
//! good when the failure is permanent (a seccomp filter installed after the first cache: EPERM;
//! ENOSYS; a command the kernel no longer accepts), for that claim only when it passes (ENOMEM,
//! EINTR, EAGAIN: retried a few times first).

use std::sync::atomic::{
    compiler_fence, fence, AtomicBool,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::OnceLock;

/// Why the slow path's half of the fence cannot be had. Only `membarrier` fails: without it
/// (other systems, Miri) this is never made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(all(target_os = "linux", not(miri))), allow(dead_code))]
pub(super) enum Unavailable {
    /// `membarrier` failed for good after the process had chosen it.
    ForGood,
    /// `membarrier` failed with an error that passes (ENOMEM, EINTR, EAGAIN) on every try.
    ForNow,
}

/// Whether `membarrier` has failed for good: every later claim is refused at once.
pub(super) fn failed_for_good() -> bool {
    MEMBARRIER_FAILED.load(Relaxed)
}

/// Set when `membarrier` failed for good after it had been chosen (nothing lifts a seccomp
/// filter).
static MEMBARRIER_FAILED: AtomicBool = AtomicBool::new(false);

/// Set once a claim was refused for a `membarrier` failure that passes, so that only the first
/// is logged as a warning.
#[cfg(all(target_os = "linux", not(miri)))]
static MEMBARRIER_BUSY_LOGGED: AtomicBool = AtomicBool::new(false);

/// Which fences pair up: decided once, before any cache exists, and never changed after.
static FENCES: OnceLock<Fences> = OnceLock::new();

/// How lanes fence, as decided for the process. The hot path never reads it: a thread's lane
/// number allows the hot path's entry, with the light half, only in the asymmetric mode (see
/// [`own_lane_quickly`](super::lanes::own_lane_quickly)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fences {
    /// The owner uses a compiler fence; slow paths `membarrier`.
    Asymmetric,
    /// Both sides use a full fence.
    Symmetric,
}

/// Decides how lanes fence, registering this process for `membarrier` if it can. Called by
/// every cache's constructor: owners use the decision only through a cache, made after it.
pub(super) fn prepare_fences() -> Fences {
    *FENCES.get_or_init(|| if register_membarrier() { Fences::Asymmetric } else { Fences::Symmetric })
}

impl Fences {
    /// The owner's half of the fence between storing `busy` and reading `claimed`.
    #[inline]
    pub(super) fn light(self) {
        match self {
            Fences::Asymmetric => compiler_fence(SeqCst),
            Fences::Symmetric => fence(SeqCst),
        }
    }
}

/// A slow path's half of the fence between storing `claimed` and reading `busy`; why not when
/// it cannot be had.
pub(super) fn heavy_fence() -> Result<(), Unavailable> {
    if FENCES.get() == Some(&Fences::Asymmetric) {
        expedited_membarrier()
    } else {
        fence(SeqCst);
        Ok(())
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
fn register_membarrier() -> bool {
    use rustix::thread::{membarrier, MembarrierCommand};
    membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
        && membarrier(MembarrierCommand::PrivateExpedited).is_ok()
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn register_membarrier() -> bool {
    false
}

/// Tries of one `membarrier` that fails with an error that passes, before the claim gives up.
#[cfg(all(target_os = "linux", not(miri)))]
const MEMBARRIER_TRIES: u32 = 4;

/// Makes every running thread of the process execute a full memory barrier. Owners already
/// chose the compiler fence, so nothing else will do: a call that fails with an error that
/// passes (ENOMEM, EINTR, EAGAIN) is tried again a few times, one that says the process is not
/// registered (EINVAL: not expected once registered, but cheap to answer) registers again, and
/// if none of that helps the claim is refused rather than made without the fence; for every
/// later claim too when the error is permanent.
#[cfg(all(target_os = "linux", not(miri)))]
fn expedited_membarrier() -> Result<(), Unavailable> {
    use rustix::io::Errno;
    use rustix::thread::{membarrier, MembarrierCommand};
    let mut last = Errno::AGAIN;
    for _ in 0..MEMBARRIER_TRIES {
        let error = match membarrier(MembarrierCommand::PrivateExpedited) {
            Ok(()) => return Ok(()),
            Err(Errno::INVAL) => match membarrier(MembarrierCommand::RegisterPrivateExpedited) {
                Ok(()) => continue,
                Err(error) => error,
            },
            Err(error) => error,
        };
        last = error;
        if membarrier_failure_is_permanent(error) {
            if !MEMBARRIER_FAILED.swap(true, Relaxed) {
                tracing::error!(%error, "membarrier(PRIVATE_EXPEDITED) fails: cached blocks in threads' lanes are out of reach");
            }
            return Err(Unavailable::ForGood);
        }
        std::thread::yield_now();
    }
    // Once at warning level: sweeps may run every millisecond while the failures last.
    if MEMBARRIER_BUSY_LOGGED.swap(true, Relaxed) {
        tracing::debug!(error = %last, tries = MEMBARRIER_TRIES, "membarrier(PRIVATE_EXPEDITED) failed: this claim of lanes is refused");
    } else {
        tracing::warn!(error = %last, tries = MEMBARRIER_TRIES, "membarrier(PRIVATE_EXPEDITED) failed: this claim of lanes is refused (logged once)");
    }
    Err(Unavailable::ForNow)
}

/// Whether a `membarrier` failure will not pass: forbidden (EPERM: a seccomp filter), missing
/// (ENOSYS), or a command the kernel refuses even after registering again (EINVAL).
#[cfg(all(target_os = "linux", not(miri)))]
fn membarrier_failure_is_permanent(error: rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    matches!(error, Errno::PERM | Errno::NOSYS | Errno::INVAL)
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn expedited_membarrier() -> Result<(), Unavailable> {
    // Never chosen here: `register_membarrier` answers false.
    fence(SeqCst);
    Ok(())
}
