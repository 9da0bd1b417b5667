//! The plan in force and what it did: per entry point, the calls seen and the failures injected.

use crate::entry_points::{index_of, COUNT};
use crate::plan::{Plan, PlanError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, Once, OnceLock, PoisonError};

/// The environment variable holding the plan a process starts with.
pub(crate) const PLAN_ENV: &str = "CUMEMPOOL_FAULT_PLAN";

static PLAN: Mutex<Plan> = Mutex::new(Plan::EMPTY);
/// Whether any rule is in force: without one, a call costs two atomic operations, no lock.
static ACTIVE: AtomicBool = AtomicBool::new(false);
static CALLS: [AtomicU64; COUNT] = [const { AtomicU64::new(0) }; COUNT];
static INJECTED: [AtomicU64; COUNT] = [const { AtomicU64::new(0) }; COUNT];

fn plan() -> MutexGuard<'static, Plan> {
    // A plan is replaced whole, so a panic elsewhere cannot leave it half-changed.
    PLAN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts a call of entry `index` and answers the code to fail it with, if the plan says so.
#[inline]
pub(crate) fn decide(index: usize) -> Option<u32> {
    CALLS[index].fetch_add(1, Relaxed);
    if !ACTIVE.load(Relaxed) {
        return None;
    }
    let code = plan().decide(index)?;
    INJECTED[index].fetch_add(1, Relaxed);
    Some(code)
}

/// Replaces the plan with the one `text` describes; on error the plan in force stays.
pub(crate) fn set_plan(text: &str) -> Result<(), PlanError> {
    let parsed = Plan::parse(text, index_of)?;
    let mut plan = plan();
    ACTIVE.store(!parsed.is_empty(), Relaxed);
    *plan = parsed;
    Ok(())
}

/// Counts of entry `name`: (calls seen, failures injected), since the process started or the
/// counts were last reset.
pub(crate) fn counts(name: &str) -> Option<(u64, u64)> {
    let index = index_of(name)?;
    Some((CALLS[index].load(Relaxed), INJECTED[index].load(Relaxed)))
}

pub(crate) fn reset_counts() {
    for counter in CALLS.iter().chain(INJECTED.iter()) {
        counter.store(0, Relaxed);
    }
}

/// Installs the plan of [`PLAN_ENV`] once; the outcome is kept, so a plan the text does not
/// describe fails every process start the same way.
pub(crate) fn load_env_plan() -> Result<(), &'static str> {
    static ONCE: Once = Once::new();
    static ERROR: OnceLock<String> = OnceLock::new();
    ONCE.call_once(|| {
        let Ok(text) = std::env::var(PLAN_ENV) else { return };
        if let Err(error) = set_plan(&text) {
            let message = format!("cumempool-fault: {PLAN_ENV} is not a plan: {error}");
            eprintln!("{message}");
            let _ = ERROR.set(message);
        }
    });
    match ERROR.get() {
        Some(message) => Err(message),
        None => Ok(()),
    }
}
