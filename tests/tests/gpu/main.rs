//! The GPU suite on the real driver, one module per subject: pools, routes, buffers, streams and
//! contexts, graphs and captures, the allocator crate, the VMM layer and the arena, sharing with
//! another process, two GPUs.
//!
//! The tests run on parallel threads of this one process, on device 0's primary context: what
//! the process or the device shares (routing, graph memory, the reservations a refused allocation
//! gives back) is held under the locks of `cumempool_tests::shared_state`. The tests that need a
//! process of their own are the other targets of `tests/tests/`, each saying why at its top.

mod adaptors;
mod alloc;
mod arena;
mod arena_frees_on_streams_of_other_contexts;
mod buffers;
mod cache_under_capture;
mod capture_isolation_and_kept_allocations;
mod contexts;
mod driver_loading;
mod graphs;
mod ipc;
mod locality_domains;
mod pools;
mod resource_allocations_in_graphs;
mod route_table;
mod routes;
mod streams;
mod two_gpus;
mod vmm;
