//! How allocation+free pairs scale with threads, each thread on its own stream, all on one
//! device pool: raw driver calls, the safe layer and the caching resource.

use super::harness::{cached_pair, median, on_threads, raw_pool_pair, Options, Progress};
use crate::error::Result;
use crate::table::{bytes, Table};
use cumempool::{Context, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource};
use serde::Serialize;

/// The size of every pair.
pub const SIZE: usize = 1 << 20;

#[derive(Serialize)]
pub struct Row {
    pub threads: usize,
    pub raw_pairs_per_s: f64,
    pub safe_pairs_per_s: f64,
    pub cache_pairs_per_s: f64,
    pub cache_over_raw: f64,
}

/// Pairs per second, in total, of `threads` threads each on its own stream.
fn scale(threads: usize, pairs: usize, context: &Context, pair: &(dyn Fn(&Stream) -> bool + Sync)) -> Result<f64> {
    let streams: Vec<Stream> = (0..threads).map(|_| Stream::new(context)).collect::<cumempool::Result<_>>()?;
    // Warm: binds the context, fills a cache.
    on_threads(&streams.iter().collect::<Vec<_>>(), pairs / 20 + 1, pairs, &|stream, _, _| pair(stream))
}

/// One row per thread count of `options`.
pub fn measure(context: &Context, options: &Options, progress: &mut Progress) -> Result<Vec<Row>> {
    let pool = MemPool::new(Route::device(0))?;
    pool.set_release_threshold(u64::MAX)?;
    let raw_sized = raw_pool_pair(&pool)?;
    let raw = move |stream: &Stream| raw_sized(stream, SIZE);
    let safe = |stream: &Stream| pool.alloc(SIZE, stream).is_ok();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
    let cached = |stream: &Stream| cached_pair(&cache, stream, SIZE);
    let mut rows = Vec::new();
    for &n in &options.threads {
        progress.tick(&format!("{n} thread(s), one stream each, one device pool"));
        // Each timed window must dwarf the skew of waking n threads from a barrier.
        let driver_pairs = (options.pairs * 2 / n.max(1)).max(4000);
        let cache_pairs = options.pairs * 100;
        let (mut r, mut s, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..options.rounds.clamp(1, 3) {
            r.push(scale(n, driver_pairs, context, &raw)?);
            s.push(scale(n, driver_pairs, context, &safe)?);
            c.push(scale(n, cache_pairs, context, &cached)?);
            cache.release()?;
        }
        let (raw_rate, safe_rate, cache_rate) = (median(r), median(s), median(c));
        rows.push(Row {
            threads: n,
            raw_pairs_per_s: raw_rate,
            safe_pairs_per_s: safe_rate,
            cache_pairs_per_s: cache_rate,
            cache_over_raw: cache_rate / raw_rate,
        });
    }
    Ok(rows)
}

pub fn render(size: usize, rows: &[Row]) -> String {
    let mut out = format!(
        "thread scaling: {} per pair, one device pool, one stream per thread (pairs per second, in total)\n",
        bytes(size as u64)
    );
    let mut threads = Table::new(&["threads", "raw sys", "safe", "cache", "cache/raw"]);
    for t in rows {
        threads.row(vec![
            t.threads.to_string(),
            format!("{:.2} M/s", t.raw_pairs_per_s / 1e6),
            format!("{:.2} M/s", t.safe_pairs_per_s / 1e6),
            format!("{:.2} M/s", t.cache_pairs_per_s / 1e6),
            format!("{:.0}x", t.cache_over_raw),
        ]);
    }
    out.push_str(&threads.render());
    out
}
