//! Reading and resetting the statistics: the pool's own counters (used and reserved memory,
//! and their high-water marks), the `Statistics` adaptor's, the cache's, and a leak report.
//!
//! `cargo run --example statistics`

#[path = "exit_report.rs"]
mod exit_report;

use cumempool::{Device, MemPool, Pool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, Statistics, StreamOrderedResource, Tracking};

const MIB: u64 = 1 << 20;

fn print_pool(when: &str, pool: &Pool) -> cumempool::Result<()> {
    println!(
        "{when:<28} pool: used {:>3} MiB (high {:>3} MiB), reserved {:>3} MiB (high {:>3} MiB)",
        pool.used_mem_current()? / MIB,
        pool.used_mem_high()? / MIB,
        pool.reserved_mem_current()? / MIB,
        pool.reserved_mem_high()? / MIB
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit_report::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let context = Device::get(0)?.primary_context()?;
    let stream = Stream::new(&context)?;
    let pool = MemPool::new(Route::device(0))?;
    let stack = Tracking::new(Statistics::new(CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?)));
    let counted = stack.inner();

    // Phase 1: a burst of 64 MiB, then most of it freed.
    let burst: Vec<_> = (0..8).map(|_| stack.alloc(8 << 20, &stream)).collect::<Result<_, _>>()?;
    let kept = stack.alloc(4 << 20, &stream)?;
    drop(burst);
    stream.synchronize()?;
    print_pool("after the burst", &pool)?;
    println!("{:<28} adaptor: {:?}", "", counted.usage());
    println!("{:<28} cache: {:?}", "", counted.inner().stats());

    // Reset: the cache gives its blocks back (the pool counts them as used until then), the pool
    // returns what it reserved beyond its use, and the peaks start again from what is in use now.
    counted.inner().release()?;
    stream.synchronize()?;
    pool.trim_to(0)?;
    pool.reset_used_mem_high()?;
    pool.reset_reserved_mem_high()?;
    counted.reset_peaks();
    print_pool("after the resets", &pool)?;
    println!("{:<28} adaptor: {:?}", "", counted.usage());

    // Phase 2: small steady work; its peak is its own.
    for _ in 0..100 {
        drop(stack.alloc(1 << 20, &stream)?);
    }
    stream.synchronize()?;
    print_pool("after phase 2", &pool)?;
    let usage = counted.usage();
    println!("{:<28} adaptor: peak {} MiB, total {} allocations", "", usage.peak_bytes >> 20, usage.total_count);
    print!("still outstanding (the leak report):\n{}", stack.report());
    drop(kept);
    println!("after the last free, outstanding: {:?}", stack.outstanding_bytes());
    Ok(())
}
