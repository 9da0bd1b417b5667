//! Where the GIL is released for a stack of resources: at the bottom only, around the driver.
//!
//! A binding that calls a resource with the GIL held marks the call ([`Held`]); the pool at the
//! bottom of every stack (`DriverLink`, through [`released`]) releases the GIL around its
//! driver call when it finds the mark. So a cache hit, a limit check or a count runs without the cost of a release and a
//! reacquire, and every driver call (a miss, a free that may wait) runs with the GIL released.
//!
//! This is sound because no resource of `cumempool-alloc` calls the resource below it while it
//! holds a lock of its own (the cache gives blocks back "without any lock held"): otherwise a
//! thread could take the GIL back while holding that lock, as another thread holding the GIL
//! waits for it.

use pyo3::prelude::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Whether this thread is inside a binding's call of a resource, holding the GIL.
    static HELD: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread, which holds the GIL (`_py`), as calling a resource; unmarked on drop.
pub struct Held {
    before: bool,
}

impl Held {
    /// Marks the calling thread until the guard is dropped.
    #[inline]
    pub fn new(_py: Python<'_>) -> Self {
        Self { before: HELD.with(|held| held.replace(true)) }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        HELD.with(|held| held.set(self.before));
    }
}

/// Clears the mark for its life: for code that may run without the GIL on a thread a binding
/// marked (a release of the GIL, a C function another library calls, a DLPack deleter).
pub struct Unmarked {
    before: bool,
}

impl Unmarked {
    /// Clears the calling thread's mark until the guard is dropped.
    #[inline]
    pub fn new() -> Self {
        Self { before: HELD.with(|held| held.replace(false)) }
    }
}

impl Drop for Unmarked {
    #[inline]
    fn drop(&mut self) {
        HELD.with(|held| held.set(self.before));
    }
}

/// `py.detach(call)` with the mark cleared meanwhile. Every release of the GIL in the bindings
/// goes through here, so a mark is never seen by a thread that does not hold the GIL (a Python
/// callback of a resource, such as an out-of-memory callback calling
/// `CachingResource.release()`, may release it inside a marked call).
#[inline]
pub fn detach<T: Send>(py: Python<'_>, call: impl FnOnce() -> T + Send) -> T {
    let _unmarked = Unmarked::new();
    py.detach(call)
}

/// Set by the `atexit` handler the module registers: the interpreter is shutting down.
static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);

/// Marks the interpreter as shutting down; registered with `atexit` when the module loads.
#[pyfunction]
pub fn note_shutdown() {
    SHUTTING_DOWN.store(true, Ordering::Release);
}

/// Runs `call` attached to Python, or answers `None` where attaching is not safe: Python not
/// initialised or finalizing (`Python::try_attach`), or shutting down. `try_attach` cannot see
/// finalizing under the abi3 build before CPython 3.13 (no `Py_IsFinalizing` in the stable
/// ABI), and a thread attaching to a finalizing interpreter is ended inside the call (CPython
/// exits it with `pthread_exit`): so a thread that would have to take the GIL (a thread
/// PyTorch calls the plug-in on) does not attach once the module's `atexit` handler ran, which
/// is before finalizing begins. A thread a binding marked holds the GIL and always may.
pub fn try_attach<T>(call: impl for<'py> FnOnce(Python<'py>) -> T) -> Option<T> {
    if !HELD.with(Cell::get) && SHUTTING_DOWN.load(Ordering::Acquire) {
        return None;
    }
    Python::try_attach(call)
}

/// Runs `call` with the GIL released when a binding marked this thread, else as it is (a
/// thread PyTorch calls the plug-in on, or one that released the GIL already).
#[inline]
pub(crate) fn released<T: Send>(call: impl FnOnce() -> T + Send) -> T {
    if !HELD.with(Cell::get) {
        return call();
    }
    // SAFETY: `Held` marks only threads that hold the GIL (it takes the `Python` token), and
    // every release of the GIL in the bindings (`detach`, this one) or by C code calling in
    // (`Unmarked`) clears the mark meanwhile.
    let py = unsafe { Python::assume_attached() };
    detach(py, call)
}
