//! The C functions a test resolves (with `dlsym`) to steer the library at run time.

use crate::injection;
use std::ffi::{c_char, c_int, CStr};

/// Replaces the fault plan with `plan` (the text form of `CUMEMPOOL_FAULT_PLAN`; empty clears it).
///
/// Returns 0, or -1 with the reason written NUL-terminated (and truncated) into
/// `error[..error_len]`; the plan in force is unchanged then.
///
/// # Safety
/// `plan` must be a NUL-terminated string; `error` must be valid for `error_len` bytes, or null.
#[no_mangle]
pub unsafe extern "C" fn cumempool_fault_set_plan(plan: *const c_char, error: *mut c_char, error_len: usize) -> c_int {
    let outcome = if plan.is_null() {
        Err("the plan is a null pointer".to_owned())
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(plan) }.to_string_lossy();
        injection::set_plan(&text).map_err(|e| e.to_string())
    };
    match outcome {
        Ok(()) => 0,
        Err(reason) => {
            if !error.is_null() && error_len > 0 {
                let bytes = &reason.as_bytes()[..reason.len().min(error_len - 1)];
                // SAFETY: `error` is valid for `error_len` bytes and `bytes` leaves room for the NUL.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), error, bytes.len());
                    *error.add(bytes.len()) = 0;
                }
            }
            -1
        }
    }
}

/// Calls of entry point `name` seen (`injected == 0`) or failed (`injected != 0`) since the
/// process started or [`cumempool_fault_reset_counts`]; -1 for a name the bindings lack.
///
/// # Safety
/// `name` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cumempool_fault_count(name: *const c_char, injected: c_int) -> i64 {
    if name.is_null() {
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
    match injection::counts(&name) {
        Some((calls, failed)) => i64::try_from(if injected != 0 { failed } else { calls }).unwrap_or(i64::MAX),
        None => -1,
    }
}

/// Sets every count back to 0.
#[no_mangle]
pub extern "C" fn cumempool_fault_reset_counts() {
    injection::reset_counts();
}
