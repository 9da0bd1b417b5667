//! One allocation+free pair per route and size, timed through raw `cumempool-sys` calls, the
//! safe layer, an owned buffer and the caching resource on the same pool and stream, in
//! interleaved rounds; and the synchronous `cuMemAlloc` + `cuMemFree` beside them.

use super::harness::{cached_pair, median, min, time, Options, Progress};
use crate::error::Result;
use crate::table::{bytes, Table};
use cumempool::{Context, MemPool, Pool, Route, Stream};
use cumempool_alloc::{CachingResource, MemoryKind, PoolResource};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize)]
pub struct Row {
    pub route: String,
    pub size: usize,
    /// Medians over the rounds.
    pub raw_ns: f64,
    pub safe_ns: f64,
    /// The same through an `OwnedBuffer` (`Pool::alloc_owned`), which holds a stream clone.
    pub owned_ns: f64,
    pub cache_ns: f64,
    /// Minima over the rounds (the cost with the least interference).
    pub raw_min_ns: f64,
    pub safe_min_ns: f64,
    /// Safe-layer cost over raw cost: the median of the per-round ratios, each round timing raw
    /// and safe back to back, which cancels the driver's drift between rounds (target: <= 1.05).
    pub safe_over_raw: f64,
    /// The same, of the minima.
    pub safe_over_raw_min: f64,
    /// Owned-buffer cost over raw cost, per-round ratios like `safe_over_raw` (target: <= 1.05).
    pub owned_over_raw: f64,
    /// Raw cost over cache cost.
    pub cache_speedup: f64,
    pub safe_heap_allocs_per_pair: f64,
    pub cache_heap_allocs_per_pair: f64,
}

/// An allocation+free pair of `size` from `pool` on `stream` through raw driver calls, on the
/// calling thread (the stream's context is bound once, here).
fn raw_pair(pool: &Pool, stream: &Stream, size: usize) -> Result<impl FnMut() -> bool> {
    let driver = cumempool::sys::driver()?;
    let (alloc, free) = (driver.cuMemAllocFromPoolAsync()?, driver.cuMemFreeAsync()?);
    stream.bind()?;
    let (pool, stream) = (pool.as_raw(), stream.as_raw());
    Ok(move || {
        let mut ptr = 0;
        // SAFETY: a live pool and stream; the allocation is freed at once, in stream order.
        unsafe {
            let a = alloc(&mut ptr, size, pool, stream);
            let f = free(ptr, stream);
            a == cumempool::sys::CUresult::CUDA_SUCCESS && f == cumempool::sys::CUresult::CUDA_SUCCESS
        }
    })
}

/// One row per size of `route`, on a pool of its own that never releases memory.
pub fn measure<K: MemoryKind>(
    route: Route,
    context: &Context,
    sizes: &[usize],
    options: &Options,
    progress: &mut Progress,
) -> Result<Vec<Row>> {
    let pool = MemPool::new(route)?;
    pool.set_release_threshold(u64::MAX)?;
    let stream = Stream::new(context)?;
    let cache = CachingResource::new(PoolResource::<K>::new(&pool)?);
    let mut rows = Vec::new();
    for &size in sizes {
        progress.tick(&format!("{route} {}", bytes(size as u64)));
        let mut raw = raw_pair(&pool, &stream, size)?;
        let mut safe = || pool.alloc(size, &stream).is_ok();
        let mut owned = || pool.alloc_owned(size, &stream).is_ok();
        let mut cached = || cached_pair(&cache, &stream, size);
        // Warm up every path (the pool grows, the cache fills, the stream's context binds).
        time(options.pairs / 10 + 1, &stream, &mut raw)?;
        time(options.pairs / 10 + 1, &stream, &mut safe)?;
        time(options.pairs / 10 + 1, &stream, &mut owned)?;
        time(options.pairs / 10 + 1, &stream, &mut cached)?;
        let (mut r, mut s, mut o, mut c) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut s_heap, mut c_heap) = (0.0f64, 0.0f64);
        for _ in 0..options.rounds {
            r.push(time(options.pairs, &stream, &mut raw)?.0);
            let (ns, heap) = time(options.pairs, &stream, &mut safe)?;
            s.push(ns);
            s_heap = s_heap.max(heap);
            o.push(time(options.pairs, &stream, &mut owned)?.0);
            let (ns, heap) = time(options.pairs, &stream, &mut cached)?;
            c.push(ns);
            c_heap = c_heap.max(heap);
        }
        let (raw_min_ns, safe_min_ns) = (min(&r), min(&s));
        let paired = median(r.iter().zip(&s).map(|(raw, safe)| safe / raw).collect());
        let owned_over_raw = median(r.iter().zip(&o).map(|(raw, owned)| owned / raw).collect());
        let (raw_ns, safe_ns, owned_ns, cache_ns) = (median(r), median(s), median(o), median(c));
        rows.push(Row {
            route: route.to_string(),
            size,
            raw_ns,
            safe_ns,
            owned_ns,
            cache_ns,
            raw_min_ns,
            safe_min_ns,
            safe_over_raw: paired,
            safe_over_raw_min: safe_min_ns / raw_min_ns,
            owned_over_raw,
            cache_speedup: raw_ns / cache_ns,
            safe_heap_allocs_per_pair: s_heap,
            cache_heap_allocs_per_pair: c_heap,
        });
    }
    Ok(rows)
}

/// Microseconds per synchronous `cuMemAlloc` + `cuMemFree` of 1 MiB.
pub fn sync_alloc_free(context: &Context) -> Result<f64> {
    context.make_current()?;
    let driver = cumempool::sys::driver()?;
    let (alloc, free) = (driver.cuMemAlloc()?, driver.cuMemFree()?);
    let rounds = 2000;
    let start = Instant::now();
    for _ in 0..rounds {
        let mut ptr = 0;
        // SAFETY: the context is current; the memory is freed at once.
        unsafe {
            alloc(&mut ptr, 1 << 20);
            free(ptr);
        }
    }
    Ok(start.elapsed().as_secs_f64() * 1e6 / rounds as f64)
}

pub fn render(rows: &[Row]) -> String {
    let mut table = Table::new(&[
        "route",
        "size",
        "raw sys ns",
        "safe ns",
        "safe/raw (median, min)",
        "owned ns",
        "owned/raw",
        "cache ns",
        "cache speedup",
        "heap allocs/pair (safe, cache)",
    ]);
    for r in rows {
        table.row(vec![
            r.route.clone(),
            bytes(r.size as u64),
            format!("{:.0}", r.raw_ns),
            format!("{:.0}", r.safe_ns),
            format!("{:.3}, {:.3}", r.safe_over_raw, r.safe_over_raw_min),
            format!("{:.0}", r.owned_ns),
            format!("{:.3}", r.owned_over_raw),
            format!("{:.1}", r.cache_ns),
            format!("{:.1}x", r.cache_speedup),
            format!("{:.2}, {:.2}", r.safe_heap_allocs_per_pair, r.cache_heap_allocs_per_pair),
        ]);
    }
    table.render()
}
