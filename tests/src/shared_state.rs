//! What the tests of one binary share besides their own values, and the lock that guards each.
//!
//! A test binary runs its tests on parallel threads of one process, all on device 0's primary
//! context: a test that changes one of these, or asserts on it, holds its lock for as long as it
//! does. A test that needs several takes them in the order of this file (routing, graph memory,
//! reservations, context waits), so that no two tests wait for each other.
//!
//! What a lock cannot share (a fault-injecting or stand-in driver in place of libcuda, a capture
//! in global mode, a fork, a lane number) needs a process of its own: those tests are binaries
//! of their own, each saying why at its top.

use std::sync::{Mutex, MutexGuard, PoisonError};

static ROUTING: Mutex<()> = Mutex::new(());
static GRAPH_MEMORY: Mutex<()> = Mutex::new(());
static RESERVATIONS: Mutex<()> = Mutex::new(());
static CONTEXT_WAITS: Mutex<()> = Mutex::new(());

fn hold(lock: &'static Mutex<()>) -> MutexGuard<'static, ()> {
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Held by every test that changes or depends on process-global routing: a route's current pool
/// (`set_current_pool`, the raw `cuMemSetMemPool`), what allocates through it (`cuMemAllocAsync`,
/// cudarc, `CurrentPoolResource`), what reads it (`current_pool`, `is_default`, `route_table`),
/// and the retired pools that route changes leave (`retired_pools`, `destroy_retired_pools`).
pub fn routing_lock() -> MutexGuard<'static, ()> {
    hold(&ROUTING)
}

/// Held by every test that launches a graph with allocation nodes, or that reads or trims the
/// device's graph memory (`Device::graph_memory`, `trim_graph_memory`, `reset_graph_memory_high`):
/// graph memory is per device. [`GraphMemoryBaseline`](crate::graph_memory::GraphMemoryBaseline)
/// holds it.
pub fn graph_memory_lock() -> MutexGuard<'static, ()> {
    hold(&GRAPH_MEMORY)
}

/// Held by every test that reads a pool's reserved memory and by every one that has an
/// allocation refused: when the driver refuses one (for a pool's maximum size or for the
/// device's memory) it gives back the unused reservation of every pool of the device
/// (docs/driver-behaviour.md).
pub fn reservations_lock() -> MutexGuard<'static, ()> {
    hold(&RESERVATIONS)
}

/// Held by every test that waits for a whole context (`cuCtxSynchronize`: `Context::synchronize`,
/// and cudarc's first stream on a context) and by every test that captures in that context beside
/// them: such a wait fails and invalidates every capture in the context, whichever thread began
/// it (docs/driver-behaviour.md).
pub fn context_wait_lock() -> MutexGuard<'static, ()> {
    hold(&CONTEXT_WAITS)
}
