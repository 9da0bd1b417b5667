//! Routing a foreign library's allocations into a capped pool: a cudarc program allocates as
//! usual, a cumempool pool with a maximum size is made current for its device, and the
//! program's memory comes from that pool and stops at its cap with a clean out-of-memory error.
//! The cudarc code does not change.
//!
//! `cargo run --example cudarc_capped_pool`

#[path = "exit_report.rs"]
mod exit_report;

use cumempool::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use cumempool::{set_current_pool, MemPool, Route};
use std::sync::Arc;

const MIB: usize = 1 << 20;

/// The cudarc program: allocates 16 MiB slices until it has `count` or the driver says no.
fn cudarc_program(stream: &Arc<CudaStream>, count: usize) -> (Vec<CudaSlice<f32>>, Option<DriverError>) {
    let mut slices = Vec::new();
    for _ in 0..count {
        match stream.alloc_zeros::<f32>(16 * MIB / 4) {
            Ok(slice) => slices.push(slice),
            Err(error) => return (slices, Some(error)),
        }
    }
    (slices, None)
}

fn main() -> std::process::ExitCode {
    exit_report::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // A clean error where there is no driver: cudarc's own loader panics instead.
    cumempool::init()?;
    let context = CudaContext::new(0)?;
    let stream = context.new_stream()?;

    // A device pool of at most 128 MiB, made current for device 0: process-global, restored
    // when the guard drops.
    let pool = MemPool::builder(Route::device(0)).max_size(128 << 20).build()?;
    match pool.max_pool_size() {
        Ok(bytes) => println!("capped pool: max {} MiB (as the driver rounded it)", bytes / MIB as u64),
        Err(error) => println!("capped pool: asked for 128 MiB ({error})"),
    }
    let guard = set_current_pool(Route::device(0), &pool)?;

    let (slices, refused) = cudarc_program(&stream, 100);
    stream.synchronize()?;
    println!(
        "cudarc allocated {} slices of 16 MiB; the pool's used memory is {} MiB",
        slices.len(),
        pool.used_mem_current()? / MIB as u64
    );
    match refused {
        Some(error) => println!("cudarc's next allocation: {error} ({:?})", error.0),
        None => return Err("the cap did not stop cudarc".into()),
    }

    drop(slices);
    stream.synchronize()?;
    println!("after cudarc freed its slices: {} MiB used", pool.used_mem_current()?);

    guard.restore()?;
    let (slices, refused) = cudarc_program(&stream, 10);
    stream.synchronize()?;
    println!(
        "route restored: cudarc allocated {} slices elsewhere (refused: {}); the capped pool holds {} MiB",
        slices.len(),
        refused.is_some(),
        pool.used_mem_current()? / MIB as u64
    );
    Ok(())
}
