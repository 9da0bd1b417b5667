//! The native part of the `cumempool` Python package (`cumempool._native`): thin conversions
//! of the Rust crates' types and errors; every rule stays in `cumempool` and `cumempool-alloc`.
//!
//! Driver calls run with the GIL released. Objects Python holds own their Rust state (owned
//! buffers, clones of streams and pools), so nothing borrows across the GIL.

// Each folder is a layer that uses only those below it; `LAYERS` in xtask/src/module_cycles.rs
// lists them bottom up, and `cargo xtask module-cycles` holds them.
#[cfg(feature = "bench-hooks")]
mod bench_hooks;
mod errors;
mod memory;
mod plugins;
mod pools;
mod streams;
mod sync;
mod values;

use pyo3::prelude::*;

/// The running driver's version as `(major, minor)`.
#[pyfunction]
fn driver_version(py: Python<'_>) -> errors::Outcome<(i32, i32)> {
    let version = crate::sync::gil::detach(py, cumempool::driver_version)?;
    Ok((version.major(), version.minor()))
}

/// The CUDA version of the declarations this build was compiled with, as `(major, minor)`.
#[pyfunction]
fn bindings_version() -> (i32, i32) {
    let version = cumempool::bindings_version();
    (version.major(), version.minor())
}

/// Loads and initialises the driver; raises LoadError where there is none.
#[pyfunction]
fn init(py: Python<'_>) -> errors::Outcome<()> {
    Ok(crate::sync::gil::detach(py, cumempool::init)?)
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::bind_classes(module.py())?;
    module.add_class::<values::route_values::Location>()?;
    module.add("AllocationType", values::route_values::ALLOCATION_TYPE.class(module.py())?)?;
    module.add_class::<values::route_values::Route>()?;
    module.add_class::<pools::current_pools::RouteGuard>()?;
    module.add_class::<values::device::Device>()?;
    module.add_class::<streams::stream::Stream>()?;
    module.add("Access", values::enums::ACCESS.class(module.py())?)?;
    module.add("HandleTypes", values::enums::HANDLE_TYPES.class(module.py())?)?;
    module.add_class::<pools::MemPool>()?;
    module.add_class::<memory::buffers::Buffer>()?;
    module.add_class::<memory::sharing::SharedAllocation>()?;
    module.add_class::<pools::resources::ResourceBase>()?;
    module.add_class::<pools::resources::PoolResourceBinding>()?;
    module.add_class::<pools::resources::Statistics>()?;
    module.add_class::<pools::resources::Limit>()?;
    module.add_class::<pools::resources::Tracking>()?;
    module.add_class::<pools::resources::OnOutOfMemory>()?;
    module.add_class::<pools::resources::Caching>()?;
    // Named `Allocator` (what its argument errors say: the class users call is
    // `cumempool.cupy.Allocator`, its subclass), found in this module as `_CupyAllocatorBase`.
    module.add("_CupyAllocatorBase", module.py().get_type::<plugins::cupy_allocator::CupyAllocatorBase>())?;
    module.add_function(wrap_pyfunction!(streams::capture_mode::_in_relaxed_capture_mode, module)?)?;
    module.add_function(wrap_pyfunction!(streams::device_wait::_wait_for_device, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::default_pool, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::current_pool, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::current_pool_handle, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::is_default, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::reset_current_pool, module)?)?;
    module.add_function(wrap_pyfunction!(pools::current_pools::set_current_pool, module)?)?;
    // From interpreter shutdown on, threads that would have to attach to Python (the torch
    // plug-in's) leave out-of-memory callbacks uncalled.
    let note_shutdown = wrap_pyfunction!(sync::gil::note_shutdown, module)?;
    PyModule::import(module.py(), "atexit")?.call_method1("register", (note_shutdown,))?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add_function(wrap_pyfunction!(driver_version, module)?)?;
    module.add_function(wrap_pyfunction!(bindings_version, module)?)?;
    module.add_function(wrap_pyfunction!(init, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_serve, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_bind, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_unbind, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_stop_slots, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_usage, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_release_captured, module)?)?;
    module.add_function(wrap_pyfunction!(plugins::torch_plugin::torch_captured_bytes, module)?)?;
    module.add("TORCH_SLOTS", plugins::torch_plugin::TORCH_SLOTS)?;
    #[cfg(feature = "bench-hooks")]
    bench_hooks::register(module)?;
    Ok(())
}
