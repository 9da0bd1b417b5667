//! A multi-threaded worker pool: each worker has its own stream and allocates through one
//! shared caching resource, so repeated sizes on a stream are answered without the driver.
//!
//! `cargo run --example worker_pool`

#[path = "exit_report.rs"]
mod exit_report;

use cumempool::{Device, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, Statistics, StreamOrderedResource};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

const WORKERS: usize = 8;
const JOBS: usize = 200_000;

fn main() -> std::process::ExitCode {
    exit_report::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let context = Device::get(0)?.primary_context()?;
    let pool = MemPool::new(Route::device(0))?;
    let cache = Arc::new(CachingResource::new(Statistics::new(PoolResource::<DeviceMemory>::new(&pool)?)));

    // Jobs are sizes of scratch memory; a worker takes the next one from the queue.
    let (queue, jobs) = mpsc::channel::<usize>();
    let jobs = Arc::new(Mutex::new(jobs));
    for job in 0..JOBS {
        queue.send([4 << 10, 64 << 10, 1 << 20, 8 << 20][job % 4])?;
    }
    drop(queue);

    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (cache, jobs, stream) = (cache.clone(), jobs.clone(), Stream::new(&context));
            std::thread::spawn(move || -> Result<usize, cumempool_alloc::Error> {
                let stream = stream?;
                let mut done = 0;
                // The lock is held only to take one job; an empty queue ends the worker.
                let next = || jobs.lock().ok()?.recv().ok();
                while let Some(bytes) = next() {
                    let scratch = cache.alloc(bytes, &stream)?;
                    // Real work would queue kernels on `stream` using `scratch.as_raw()` here.
                    drop(scratch);
                    done += 1;
                }
                stream.synchronize()?;
                Ok(done)
            })
        })
        .collect();
    let mut per_worker = Vec::new();
    for worker in workers {
        per_worker.push(worker.join().map_err(|_| "a worker panicked")??);
    }
    let elapsed = started.elapsed();

    let stats = cache.stats();
    let below = cache.inner().usage();
    println!("{WORKERS} workers, a stream each, did {per_worker:?} jobs in {:.1} ms", elapsed.as_secs_f64() * 1e3);
    println!(
        "cache: {} hits, {} misses (hit rate {:.4}), {} streams with cached blocks, {} MiB cached",
        stats.hits,
        stats.misses,
        stats.hit_rate(),
        stats.streams,
        stats.cached_bytes >> 20
    );
    println!("the pool was asked {} times, at most {} MiB at once", below.total_count, below.peak_bytes >> 20);
    cache.release()?;
    println!("after release: {} bytes still out of the pool", cache.inner().usage().current_bytes);
    Ok(())
}
