//! Bytes in and out of raw device memory (arena allocations, NCCL buffers), which no cumempool
//! `Buffer` wraps: the driver's copies, waited for before returning.

#![allow(clippy::unwrap_used)] // test support: a failing unwrap is a failing test
use cumempool::sys::{self, CUdeviceptr};
use cumempool::Stream;

fn check(code: sys::CUresult, what: &str) {
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "{what} failed with {}", cumempool::error_name(code));
}

/// Writes `bytes` at `ptr` (device memory of `stream`'s device) and waits.
pub fn write(ptr: CUdeviceptr, bytes: &[u8], stream: &Stream) {
    let copy = sys::driver().unwrap().cuMemcpyHtoDAsync().unwrap();
    // SAFETY: the caller gives `bytes.len()` bytes of device memory at `ptr`; the host bytes live
    // until the stream is synchronised below.
    check(unsafe { copy(ptr, bytes.as_ptr().cast(), bytes.len(), stream.as_raw()) }, "cuMemcpyHtoDAsync");
    stream.synchronize().unwrap();
}

/// Reads `len` bytes at `ptr` after the work queued on `stream`.
pub fn read(ptr: CUdeviceptr, len: usize, stream: &Stream) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    let copy = sys::driver().unwrap().cuMemcpyDtoHAsync().unwrap();
    // SAFETY: as `write`; the host buffer lives until the stream is synchronised below.
    check(unsafe { copy(bytes.as_mut_ptr().cast(), ptr, len, stream.as_raw()) }, "cuMemcpyDtoHAsync");
    stream.synchronize().unwrap();
    bytes
}
