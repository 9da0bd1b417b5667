//! Shared helpers of the integration tests: finding the GPU, the locks of what the tests of one
//! binary share (`shared_state`), captures begun by other code, graph memory, and a stand-in
//! driver for the capture rules on a host without a GPU.

pub mod device_bytes;
pub mod fault_library;
mod foreign_capture;
pub mod graph_memory;
pub mod shared_state;
pub mod stand_in_driver;

pub use foreign_capture::{
    begin_foreign_capture, begin_foreign_capture_in, end_foreign_capture, end_foreign_capture_counting,
};
pub use shared_state::{context_wait_lock, graph_memory_lock, reservations_lock, routing_lock};

/// The device-0 primary context, or `None` (with a note) where no driver is present.
///
/// With `CUMEMPOOL_REQUIRE_GPU=1` a missing driver fails the test instead: the GPU suite must
/// never pass by skipping.
pub fn gpu() -> Option<cumempool::Context> {
    let found = cumempool::init().and_then(|()| cumempool::Device::get(0)).and_then(|d| d.primary_context());
    match found {
        Ok(context) => Some(context),
        Err(error) if std::env::var("CUMEMPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("CUMEMPOOL_REQUIRE_GPU=1 but no GPU is usable: {error}")
        }
        Err(error) => {
            eprintln!("skipped: no CUDA GPU here ({error})");
            None
        }
    }
}

/// A stream on device 0, with its context; `None` without a GPU (see [`gpu`]).
pub fn gpu_stream() -> Option<cumempool::Stream> {
    let context = gpu()?;
    Some(cumempool::Stream::new(&context).unwrap_or_else(|e| panic!("creating a stream: {e}")))
}

/// One route of every kind that serves allocations on device 0's machine: device, host, host
/// NUMA node 0, and managed memory at the device, the host and no location.
pub const ROUTE_KINDS: [cumempool::Route; 6] = [
    cumempool::Route::device(0),
    cumempool::Route::host(),
    cumempool::Route::host_numa(0),
    cumempool::Route::managed(cumempool::Location::Device(0)),
    cumempool::Route::managed(cumempool::Location::Host),
    cumempool::Route::managed(cumempool::Location::Unspecified),
];

/// A deterministic byte pattern, different for each `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The name the test harness knows a test by, from `concat!(module_path!(), "::test_fn")`: its
/// path below the crate, as `--exact` takes it when a test runs its own binary again.
pub fn harness_name(path: &str) -> &str {
    path.split_once("::").map_or(path, |(_, below)| below)
}
