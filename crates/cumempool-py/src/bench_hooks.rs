//! Hooks for `bench/alloc_pair.py --breakdown` and `bench/workloads.py`: the pieces of a
//! Python alloc+free pair, each callable alone, so one run shows where the time goes. Built
//! only with the cargo feature `bench-hooks` (the GPU pack's wheel has it, the user's wheel
//! does not): they are no part of the public API and have no type stubs.

use crate::errors::Outcome;
use crate::pools::resources::ResourceBase;
use crate::pools::MemPool;
use crate::streams::stream::Stream;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use std::time::Instant;

/// Adds the hooks to the native module, as attributes only: kept out of its `__all__`, so the
/// type stubs, which leave the hooks out, match this wheel as they match the user's.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    for hook in [
        wrap_pyfunction!(_bench_noop, module)?,
        wrap_pyfunction!(_bench_args, module)?,
        wrap_pyfunction!(_bench_stream, module)?,
        wrap_pyfunction!(_bench_detach, module)?,
        wrap_pyfunction!(_bench_rust_pairs, module)?,
    ] {
        module.setattr(
            hook.getattr(pyo3::intern!(module.py(), "__name__"))?.cast_into::<pyo3::types::PyString>()?,
            &hook,
        )?;
    }
    Ok(())
}

/// An empty native call: the floor under every method call.
#[pyfunction]
pub fn _bench_noop() {}

/// A native call with `alloc`'s signature that converts nothing: the cost of its arguments.
#[pyfunction]
#[pyo3(signature = (size, stream = None))]
pub fn _bench_args(size: usize, stream: Option<&Bound<'_, PyAny>>) -> usize {
    size + usize::from(stream.is_some())
}

/// What `alloc` does to its stream argument (`None`: the legacy stream of `device`).
#[pyfunction]
#[pyo3(signature = (stream, device = 0))]
pub fn _bench_stream(py: Python<'_>, stream: Option<&Bound<'_, PyAny>>, device: i32) -> Outcome<Py<Stream>> {
    Stream::from_object(py, stream, device)
}

/// Releases the GIL and takes it back, with nothing in between.
#[pyfunction]
pub fn _bench_detach(py: Python<'_>) {
    crate::sync::gil::detach(py, || ());
}

/// Nanoseconds per alloc+free pair of `size` bytes on `stream`, `pairs` times in Rust with the
/// GIL released: the floor a Python pair through `target` (a MemPool or a resource) stands on.
#[pyfunction]
pub fn _bench_rust_pairs(
    py: Python<'_>,
    target: &Bound<'_, PyAny>,
    size: usize,
    stream: &Bound<'_, PyAny>,
    pairs: u32,
) -> Outcome<f64> {
    let stream = Stream::from_object(py, Some(stream), 0)?;
    let s = &stream.get().stream;
    if let Ok(pool) = target.cast::<MemPool>() {
        let pool = pool.borrow();
        let pool = pool.pool()?;
        return crate::sync::gil::detach(py, || {
            let start = Instant::now();
            for _ in 0..pairs {
                let ptr = pool.alloc_raw(size, s)?;
                // SAFETY: just allocated on `s`, freed once, never used.
                unsafe { cumempool::free_async(ptr, s) }?;
            }
            Ok(per_pair(start, pairs))
        });
    }
    if let Ok(resource) = target.cast::<ResourceBase>() {
        let inner = resource.get().inner.clone();
        return crate::sync::gil::detach(py, || {
            let start = Instant::now();
            for _ in 0..pairs {
                let ptr = inner.allocate(size, s)?;
                // SAFETY: just allocated by `inner` with `size` bytes on `s`, freed once, unused.
                unsafe { inner.deallocate(ptr, size, s) }?;
            }
            Ok(per_pair(start, pairs))
        });
    }
    Err(PyTypeError::new_err("the target is a MemPool or a resource (PoolResource, CachingResource, ...)").into())
}

fn per_pair(start: Instant, pairs: u32) -> f64 {
    start.elapsed().as_nanos() as f64 / f64::from(pairs.max(1))
}
