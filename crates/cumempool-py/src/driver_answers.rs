//! A driver call's `CUresult` as an error of the bindings, for the few calls made on the
//! driver's table directly (those `cumempool` has no safe wrapper for): success is
//! `CUDA_SUCCESS` only, and every error keeps the function's name and its code.

use crate::errors::Outcome;
use cumempool::sys;

/// A driver answer as an outcome.
pub fn check(function: &'static str, code: sys::CUresult) -> Outcome<()> {
    Ok(driver_answer(function, code)?)
}

/// A driver answer as a `cumempool` result.
pub fn driver_answer(function: &'static str, code: sys::CUresult) -> cumempool::Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(cumempool::Error::Driver(cumempool::DriverError::new(function, code)))
}
