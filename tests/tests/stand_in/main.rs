//! Its own process: the stand-in driver (`cumempool_tests::stand_in_driver`) is its libcuda.
//!
//! The library on a host without a GPU, through the stand-in libcuda (and libnccl), one module
//! per subject: the capture rules, what pools, buffers and arenas refuse, frees deferred and
//! orphaned, unmappings of imported memory deferred, the per-thread stream, NCCL's ordering, an
//! old driver. The stand-in's state (captures, switches, the call log, its counts of live streams
//! and bytes) is process-wide: every test that uses it holds the guard `stand_in()` answers.
//! `old_driver` opens a second stand-in of its own, built for CUDA 11.8, and touches no state of
//! the first.

mod arena_refusals;
mod capture_modes;
mod capture_questions;
mod deferred_unmappings;
mod graph_launches_beside_other_captures;
mod nccl_on_the_stand_in;
mod old_driver;
mod orphaned_frees;
mod pool_buffer_refusals;
mod resource_allocations_under_capture;
mod the_per_thread_stream;
mod waits_that_cannot_be_skipped;
