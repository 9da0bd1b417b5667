//! CuPy's own memory object for memory the CuPy plug-in serves natively: CuPy's
//! `CFunctionAllocatorMemory`, made with a lease of the allocation as its `param` and this
//! module's two C functions as its `malloc` and `free`. No Python object of cumempool's stands
//! between CuPy and the memory, so an allocation costs no `Buffer` made and collected.
//!
//! The protocol, as CuPy's `memory.pyx` runs it (with the GIL held): the object's `__init__`
//! calls `malloc(param, size, device)` once when `size > 0` and keeps the address it returns;
//! its `__dealloc__` calls `free(param, address, device)` once when that address is not null.
//! The lease is an `Arc`: the object owns one count from the moment `lend` gives it the
//! address, and `give_back` drops that count. Whether `lend` ran is read from the count the
//! caller keeps, so no outcome of CuPy's constructor (raised before `malloc`, after it, or not
//! calling it) leaks the memory or frees it twice.

use crate::memory::{Core, Slot};
use pyo3::prelude::*;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// An allocation lent to one CuPy memory object.
struct Lease {
    /// Given back (on its stream, as a `Buffer`'s close does) when the last count goes.
    core: Option<Core>,
    /// Set by `lend`: CuPy's object holds the address, and one count of the lease with it.
    taken: AtomicBool,
}

impl Lease {
    /// Lets go of one count inside a binding; the last gives the core back there.
    fn let_go(lease: Arc<Self>, py: Python<'_>) {
        let Some(mut lease) = Arc::into_inner(lease) else { return };
        if let Some(core) = lease.core.take() {
            Core::release(Slot::Own(core), py);
        }
    }
}

impl Drop for Lease {
    /// The last count let go of outside a binding (`give_back`, from CuPy's `__dealloc__`):
    /// attached if it may be, else (at exit, once the module's `atexit` handler ran or Python
    /// is finalizing, where attaching would end the thread or panic) the memory is left to the
    /// driver with the process.
    fn drop(&mut self) {
        let Some(core) = self.core.take() else { return };
        let mut core = Some(core);
        let released = crate::sync::gil::try_attach(|py| {
            if let Some(core) = core.take() {
                Core::release(Slot::Own(core), py);
            }
        });
        if released.is_none() {
            std::mem::forget(core);
        }
    }
}

/// CuPy's `malloc` for a lease: the lease's address; from here on the object owns the count of
/// the lease that `param` stands for.
///
/// # Safety
/// `param` is a count of an `Arc<Lease>` from `LentMemory::make`, which still holds another.
unsafe extern "C" fn lend(param: *mut c_void, _size: usize, _device: c_int) -> *mut c_void {
    // SAFETY: live while `make`'s own count is held, which outlasts this call.
    let lease = unsafe { &*param.cast::<Lease>() };
    lease.taken.store(true, Ordering::Release);
    lease.core.as_ref().map_or(std::ptr::null_mut(), |core| core.ptr() as usize as *mut c_void)
}

/// CuPy's `free` for a lease: the object's count goes, and with the last count the memory.
///
/// # Safety
/// `param` is the count `lend` handed to CuPy's object, given back once.
unsafe extern "C" fn give_back(param: *mut c_void, _ptr: *mut c_void, _device: c_int) {
    // SAFETY: under the caller's promise.
    let lease = unsafe { Arc::from_raw(param.cast::<Lease>().cast_const()) };
    // CuPy calls this from the memory object's `__dealloc__`, holding the GIL but outside any
    // binding: the last count attaches in `Drop` (so that the stream's Python object is let go
    // of at once, not through PyO3's deferred references, as a token assumed here would).
    // No unwinding into CuPy's C: a panic leaves the memory to the driver.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(lease))).is_err() {
        tracing::error!("giving back memory CuPy let go of panicked: the memory is not given back");
    }
}

/// CuPy's `CFunctionAllocatorMemory`, with this module's two functions as the Python ints its
/// constructor takes (made once, not per allocation).
pub(crate) struct LentMemory {
    memory_type: Py<PyAny>,
    lend: Py<PyAny>,
    give_back: Py<PyAny>,
}

impl LentMemory {
    pub(crate) fn new(py: Python<'_>, memory_type: Py<PyAny>) -> PyResult<Self> {
        let lend: unsafe extern "C" fn(*mut c_void, usize, c_int) -> *mut c_void = lend;
        let give_back: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int) = give_back;
        let address = |function: usize| function.into_pyobject(py).map(|int| int.into_any().unbind());
        Ok(Self { memory_type, lend: address(lend as usize)?, give_back: address(give_back as usize)? })
    }

    /// The type, for the garbage collector.
    pub(crate) fn memory_type(&self) -> &Py<PyAny> {
        &self.memory_type
    }

    /// CuPy's memory object for `core`, of `size` bytes on the core's device. The core is given
    /// back when CuPy lets go of the object, or here where the object did not take it.
    pub(crate) fn make(&self, py: Python<'_>, core: Core, size: usize) -> PyResult<Py<PyAny>> {
        let device = core.device;
        let lease = Arc::new(Lease { core: Some(core), taken: AtomicBool::new(false) });
        let param = Arc::into_raw(lease.clone());
        let arguments = (size, param as usize, self.lend.clone_ref(py), self.give_back.clone_ref(py), device);
        let made = self.memory_type.call1(py, arguments);
        if !lease.taken.load(Ordering::Acquire) {
            // The object never took the address, nor the count `param` stands for: it is this
            // function's to drop.
            // SAFETY: the count made above, given to no one.
            unsafe { Arc::decrement_strong_count(param) };
        }
        Lease::let_go(lease, py);
        made
    }
}
