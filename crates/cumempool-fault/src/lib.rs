//! A fault-injecting stand-in for libcuda, for testing the paths cumempool takes when the driver
//! fails in the middle of work. Not published.
//!
//! A process opens it instead of libcuda (`CUMEMPOOL_LIBCUDA=/path/libcumempool_fault.so`). It
//! opens the real driver (`CUMEMPOOL_FAULT_REAL_LIBCUDA`, default `libcuda.so.1`) and exports
//! the three symbols cumempool's loader takes by name. Every other entry point reaches the
//! program through `cuGetProcAddress_v2`, which hands out, for each function the bindings
//! declare, a wrapper that fails the calls the plan names and passes the others through.
//!
//! The plan comes from `CUMEMPOOL_FAULT_PLAN` at start (a plan that does not parse fails
//! `cuDriverGetVersion`, after saying why on stderr) and from the C functions of `control.rs` at run
//! time. `cuGetErrorName`, `cuGetErrorString` and `cuGetProcAddress` are never failed: the
//! error path and the resolution of every other function go through them.

mod control;
mod entry_points;
mod entry_table;
mod injection;
mod plan;
mod real_driver;

use cumempool_sys::{cuuint64_t, CUdriverProcAddressQueryResult, CUresult};
use real_driver::RealDriver;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// The real driver, never this library itself.
fn real_driver() -> Option<&'static RealDriver> {
    real_driver::real_driver(cuGetProcAddress_v2 as *const ())
}

/// The real driver's version. Fails with `CUDA_ERROR_INVALID_VALUE` when the startup plan does
/// not parse (the reason is on stderr), so no process runs with a plan other than the one asked.
///
/// # Safety
/// As the driver's `cuDriverGetVersion`.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    if injection::load_env_plan().is_err() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    match real_driver() {
        // SAFETY: forwarded with the caller's pointer.
        Some(real) => unsafe { (real.get_version)(version) },
        None => CUresult::CUDA_ERROR_NO_DEVICE,
    }
}

/// The real driver's `cuInit` (programs that want it failable use the entry point handed out by
/// `cuGetProcAddress_v2`, which cumempool does).
///
/// # Safety
/// As the driver's `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    match real_driver() {
        // SAFETY: forwarded.
        Some(real) => unsafe { (real.init)(flags) },
        None => CUresult::CUDA_ERROR_NO_DEVICE,
    }
}

/// The real driver's answer, with each function of the bindings replaced by its wrapper (and
/// `cuGetProcAddress` by this function, so later lookups are wrapped too).
///
/// # Safety
/// As the driver's `cuGetProcAddress_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    if injection::load_env_plan().is_err() {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    }
    let Some(real) = real_driver() else {
        return CUresult::CUDA_ERROR_NO_DEVICE;
    };
    // SAFETY: forwarded with the caller's pointers.
    let code = unsafe { (real.get_proc_address)(symbol, pfn, cuda_version, flags, status) };
    if code != CUresult::CUDA_SUCCESS || symbol.is_null() || pfn.is_null() {
        return code;
    }
    // SAFETY: the driver accepted `symbol` as a NUL-terminated name and wrote `*pfn`.
    let (name, found) = unsafe { (CStr::from_ptr(symbol).to_bytes(), *pfn) };
    if found.is_null() {
        return code;
    }
    let replacement =
        if name == b"cuGetProcAddress" { cuGetProcAddress_v2 as *mut c_void } else { entry_table::wrap(name, found) };
    // SAFETY: `pfn` is the caller's valid out-pointer.
    unsafe { *pfn = replacement };
    code
}
