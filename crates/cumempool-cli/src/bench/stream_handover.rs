//! The stream handover: threads fill the cache on a stream each, drop those streams, then share
//! one new stream. A cache that strands its budget on the dropped streams misses in the second
//! phase and falls below the driver it is meant to beat.

use super::harness::{cached_pair, hit_rate, on_threads, raw_pool_pair};
use crate::error::Result;
use crate::table::Table;
use cumempool::{Context, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource};
use serde::Serialize;

/// Threads in both phases: more than most machines have cores, so streams are contended.
const THREADS: usize = 16;
pub(super) const MIN_SIZE: usize = 256;
pub(super) const MAX_SIZE: usize = 4 << 20;

#[derive(Serialize)]
pub struct Report {
    pub threads: usize,
    pub pairs_per_thread: usize,
    pub min_size: usize,
    pub max_size: usize,
    pub phases: Vec<Phase>,
}

#[derive(Serialize)]
pub struct Phase {
    pub phase: &'static str,
    pub raw_pairs_per_s: f64,
    pub cache_pairs_per_s: f64,
    /// Hits over allocations during this phase only.
    pub cache_hit_rate: f64,
    pub cache_over_raw: f64,
}

/// The size of pair `step` of `thread`: spread evenly over 256 B to 4 MiB, the same in every run.
pub(super) fn size(thread: usize, step: usize) -> usize {
    let x = (thread as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (step as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    MIN_SIZE + (x >> 11) as usize % (MAX_SIZE - MIN_SIZE + 1)
}

/// Pairs per second, in total, of `THREADS` threads spread over `streams`, each making its
/// own sequence of mixed sizes.
fn run_threads(streams: &[Stream], pairs: usize, pair: &(dyn Fn(&Stream, usize) -> bool + Sync)) -> Result<f64> {
    let spread: Vec<&Stream> = (0..THREADS).map(|thread| &streams[thread % streams.len()]).collect();
    on_threads(&spread, 0, pairs, &|stream, thread, step| pair(stream, size(thread, step)))
}

/// Runs both phases through the raw driver, then through a cache, on one device pool.
/// `pairs_per_thread` is 20,000 at the default `--pairs`.
pub fn measure(context: &Context, pairs_per_thread: usize) -> Result<Report> {
    let pool = MemPool::new(Route::device(0))?;
    pool.set_release_threshold(u64::MAX)?;
    let raw = raw_pool_pair(&pool)?;
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
    let cached = |stream: &Stream, bytes: usize| cached_pair(&cache, stream, bytes);
    let own_streams = || (0..THREADS).map(|_| Stream::new(context)).collect::<cumempool::Result<Vec<_>>>();

    let raw_own = run_threads(&own_streams()?, pairs_per_thread, &raw)?;
    let raw_shared = run_threads(&[Stream::new(context)?], pairs_per_thread, &raw)?;

    let start = cache.stats();
    let streams = own_streams()?;
    let cache_own = run_threads(&streams, pairs_per_thread, &cached)?;
    drop(streams); // only the cache still holds them
    let handed_over = cache.stats();
    let cache_shared = run_threads(&[Stream::new(context)?], pairs_per_thread, &cached)?;
    let end = cache.stats();
    cache.release()?;

    let phase = |phase, raw: f64, cache: f64, hit_rate| Phase {
        phase,
        raw_pairs_per_s: raw,
        cache_pairs_per_s: cache,
        cache_hit_rate: hit_rate,
        cache_over_raw: cache / raw,
    };
    Ok(Report {
        threads: THREADS,
        pairs_per_thread,
        min_size: MIN_SIZE,
        max_size: MAX_SIZE,
        phases: vec![
            phase("a stream per thread", raw_own, cache_own, hit_rate(start, handed_over)),
            phase("then one new shared stream", raw_shared, cache_shared, hit_rate(handed_over, end)),
        ],
    })
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "stream handover: {} threads x {} pairs of {} to {} (even spread), one device pool; \
         the first phase's streams are dropped before the second\n",
        report.threads,
        report.pairs_per_thread,
        crate::table::bytes(report.min_size as u64),
        crate::table::bytes(report.max_size as u64),
    );
    let mut table = Table::new(&["phase", "raw sys", "cache", "cache hit rate", "cache/raw"]);
    for p in &report.phases {
        table.row(vec![
            p.phase.to_owned(),
            format!("{:.2} M/s", p.raw_pairs_per_s / 1e6),
            format!("{:.2} M/s", p.cache_pairs_per_s / 1e6),
            format!("{:.1}%", p.cache_hit_rate * 100.0),
            format!("{:.1}x", p.cache_over_raw),
        ]);
    }
    out.push_str(&table.render());
    out
}
