//! `cumempool bench`: the cost of an allocation+free pair per route and size, through raw
//! `cumempool-sys` calls, the safe layer and the caching resource on the same pool in one run,
//! and how each scales with threads.

mod cache_targets;
mod copies;
#[cfg(feature = "cudarc")]
mod cudarc_pairs;
mod stream_handover;

use crate::counting_allocator;
use crate::error::{Error, Result};
use crate::table::{bytes, Table};
use cumempool::{Context, Device, Location, MemPool, Pool, Route, Stream};
use cumempool_alloc::{
    CachingResource, DeviceMemory, HostMemory, ManagedMemory, MemoryKind, PoolResource, StreamOrderedResource,
};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::sync::Barrier;
use std::time::{Duration, Instant};

pub struct Options {
    pub pairs: usize,
    pub rounds: usize,
    pub threads: Vec<usize>,
}

#[derive(Serialize)]
pub struct PairRow {
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

#[derive(Serialize)]
pub struct ThreadRow {
    pub threads: usize,
    pub raw_pairs_per_s: f64,
    pub safe_pairs_per_s: f64,
    pub cache_pairs_per_s: f64,
    pub cache_over_raw: f64,
}

#[derive(Serialize)]
pub struct Report {
    pub device: String,
    pub driver: String,
    pub pairs_per_measurement: usize,
    pub rounds: usize,
    pub statistic: &'static str,
    pub rows: Vec<PairRow>,
    pub sync_alloc_free_1mib_us: f64,
    pub thread_size: usize,
    pub threads: Vec<ThreadRow>,
    pub stream_handover: stream_handover::Report,
    pub cache_targets: cache_targets::Report,
    /// Device-to-device copies through `copy_from_async` against raw `cuMemcpyAsync`.
    pub copies: copies::Report,
    /// cudarc's alloc+free against the safe layer's; only in a command built with `cudarc`.
    #[cfg(feature = "cudarc")]
    pub cudarc: cudarc_pairs::Report,
}

/// Which measurement is running and about how long the rest will take, redrawn in place; only
/// on a terminal, so a log or a pipe gets no control codes.
struct Progress {
    enabled: bool,
    started: Instant,
    step: usize,
    total: usize,
}

impl Progress {
    fn new(total: usize) -> Self {
        Self { enabled: std::io::stderr().is_terminal(), started: Instant::now(), step: 0, total }
    }

    fn tick(&mut self, what: &str) {
        self.step += 1;
        if self.enabled {
            let left = match remaining(self.started.elapsed(), self.step - 1, self.total) {
                Some(left) => format!(", about {}s left", left.as_secs()),
                None => String::new(),
            };
            eprint!("\r\x1b[2K[{}/{}{left}] {what}", self.step, self.total);
            let _ = std::io::stderr().flush();
        }
    }

    fn done(&self) {
        if self.enabled {
            eprint!("\r\x1b[2K");
        }
    }
}

/// The time the steps not yet done will take at the pace of the `done` ones; none before the first.
fn remaining(elapsed: Duration, done: usize, total: usize) -> Option<Duration> {
    let done = u32::try_from(done).ok().filter(|d| *d > 0)?;
    let left = u32::try_from(total).ok()?.checked_sub(done)?;
    Some(elapsed / done * left)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Nanoseconds per pair and heap allocations per pair over `pairs` calls of `pair`.
fn time(pairs: usize, stream: &Stream, mut pair: impl FnMut() -> bool) -> Result<(f64, f64)> {
    let heap_before = counting_allocator::allocations();
    let start = Instant::now();
    let mut ok = true;
    for _ in 0..pairs {
        ok &= pair();
    }
    stream.synchronize()?;
    let elapsed = start.elapsed().as_nanos() as f64;
    let heap = (counting_allocator::allocations() - heap_before) as f64;
    if !ok {
        return Err(Error::BenchRunFailed { measurement: "allocation+free pairs" });
    }
    Ok((elapsed / pairs as f64, heap / pairs as f64))
}

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

fn measure_route<K: MemoryKind>(
    route: Route,
    context: &Context,
    sizes: &[usize],
    options: &Options,
    progress: &mut Progress,
) -> Result<Vec<PairRow>> {
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
        let mut cached = || match cache.allocate(size, 256, &stream) {
            // SAFETY: just allocated with these arguments; nothing used it.
            Ok(ptr) => unsafe { cache.deallocate(ptr, size, 256, &stream) }.is_ok(),
            Err(_) => false,
        };
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
        rows.push(PairRow {
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

fn sync_alloc_free(context: &Context) -> Result<f64> {
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

/// An allocation+free pair of `bytes` from `pool` on any stream, through raw driver calls, for
/// any thread: it makes the stream's context current first.
fn raw_pool_pair(pool: &Pool) -> cumempool::Result<impl Fn(&Stream, usize) -> bool + Sync + Copy> {
    let driver = cumempool::sys::driver()?;
    let (alloc, free) = (driver.cuMemAllocFromPoolAsync()?, driver.cuMemFreeAsync()?);
    let raw_pool = pool.as_raw() as usize;
    Ok(move |stream: &Stream, bytes: usize| {
        let mut ptr = 0;
        // SAFETY: live pool and stream (the caller keeps the pool alive while it uses the pair);
        // freed at once in stream order.
        unsafe {
            stream.bind().is_ok()
                && alloc(&mut ptr, bytes, raw_pool as cumempool::sys::CUmemoryPool, stream.as_raw())
                    == cumempool::sys::CUresult::CUDA_SUCCESS
                && free(ptr, stream.as_raw()) == cumempool::sys::CUresult::CUDA_SUCCESS
        }
    })
}

/// Pairs per second, in total, of `threads` threads each on its own stream.
fn scale(threads: usize, pairs: usize, context: &Context, pair: &(dyn Fn(&Stream) -> bool + Sync)) -> Result<f64> {
    let streams: Vec<Stream> = (0..threads).map(|_| Stream::new(context)).collect::<cumempool::Result<_>>()?;
    // Warm: binds the context, fills a cache.
    on_threads(&streams.iter().collect::<Vec<_>>(), pairs / 20 + 1, pairs, &|stream, _, _| pair(stream))
}

/// Pairs per second, in total, of a thread per entry of `streams` (entries may repeat a stream),
/// each making `warm` untimed calls, then `pairs` timed calls of `pair(stream, thread, step)`.
/// Generic rather than `dyn`, so that the pair is inlined into each thread's loop as it would
/// be in a program: a dynamic call per pair would add its own cost to the cache's few
/// nanoseconds.
fn on_threads<F: Fn(&Stream, usize, usize) -> bool + Sync>(
    streams: &[&Stream],
    warm: usize,
    pairs: usize,
    pair: &F,
) -> Result<f64> {
    let barrier = Barrier::new(streams.len() + 1);
    let elapsed = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(thread, &stream)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    for step in 0..warm {
                        pair(stream, thread, step);
                    }
                    barrier.wait();
                    let mut ok = true;
                    for step in 0..pairs {
                        ok &= pair(stream, thread, step);
                    }
                    ok & stream.synchronize().is_ok()
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let ok = handles.into_iter().all(|h| h.join().unwrap_or(false));
        (start.elapsed(), ok)
    });
    if !elapsed.1 {
        return Err(Error::BenchRunFailed { measurement: "thread scaling" });
    }
    Ok((streams.len() * pairs) as f64 / elapsed.0.as_secs_f64())
}

pub fn run(options: &Options) -> Result<Report> {
    cumempool::init()?;
    let device = Device::get(0)?;
    let context = device.primary_context()?;
    let numa = device.host_numa_id()?.unwrap_or(0);
    let sizes = [256, 1 << 20, 64 << 20];
    let routes = [
        Route::device(0),
        Route::host(),
        Route::host_numa(numa),
        Route::managed(Location::Device(0)),
        Route::managed(Location::Unspecified),
    ];
    let mut progress =
        Progress::new(routes.len() * sizes.len() + options.threads.len() + 4 + usize::from(cfg!(feature = "cudarc")));
    let mut rows = Vec::new();
    for route in routes {
        rows.extend(match route {
            r if DeviceMemory::admits(r) => measure_route::<DeviceMemory>(r, &context, &sizes, options, &mut progress)?,
            r if HostMemory::admits(r) => measure_route::<HostMemory>(r, &context, &sizes, options, &mut progress)?,
            r => measure_route::<ManagedMemory>(r, &context, &sizes, options, &mut progress)?,
        });
    }
    progress.tick("synchronous cuMemAlloc + cuMemFree");
    let sync_alloc_free_1mib_us = sync_alloc_free(&context)?;

    let thread_size = 1 << 20;
    let pool = MemPool::new(Route::device(0))?;
    pool.set_release_threshold(u64::MAX)?;
    let raw_sized = raw_pool_pair(&pool)?;
    let raw = move |stream: &Stream| raw_sized(stream, thread_size);
    let safe = |stream: &Stream| pool.alloc(thread_size, stream).is_ok();
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
    let cached = |stream: &Stream| match cache.allocate(thread_size, 256, stream) {
        // SAFETY: just allocated with these arguments.
        Ok(ptr) => unsafe { cache.deallocate(ptr, thread_size, 256, stream) }.is_ok(),
        Err(_) => false,
    };
    let mut threads = Vec::new();
    for &n in &options.threads {
        progress.tick(&format!("{n} thread(s), one stream each, one device pool"));
        // Each timed window must dwarf the skew of waking n threads from a barrier.
        let driver_pairs = (options.pairs * 2 / n.max(1)).max(4000);
        let cache_pairs = options.pairs * 100;
        let (mut r, mut s, mut c) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..options.rounds.clamp(1, 3) {
            r.push(scale(n, driver_pairs, &context, &raw)?);
            s.push(scale(n, driver_pairs, &context, &safe)?);
            c.push(scale(n, cache_pairs, &context, &cached)?);
            cache.release()?;
        }
        let (raw_rate, safe_rate, cache_rate) = (median(r), median(s), median(c));
        threads.push(ThreadRow {
            threads: n,
            raw_pairs_per_s: raw_rate,
            safe_pairs_per_s: safe_rate,
            cache_pairs_per_s: cache_rate,
            cache_over_raw: cache_rate / raw_rate,
        });
    }
    progress.tick("stream handover: a stream per thread, then one shared stream");
    // 20,000 pairs per thread at the default --pairs 2000, as in issue 9; --quick shrinks it.
    let stream_handover = stream_handover::measure(&context, options.pairs * 10)?;
    progress.tick("cache targets: one thread, 16 threads on their own streams, then on one stream");
    let cache_targets = cache_targets::measure(&context, options)?;
    progress.tick("device-to-device copies: copy_from_async against raw cuMemcpyAsync");
    let copies = copies::measure(&context, options)?;
    #[cfg(feature = "cudarc")]
    let cudarc = {
        progress.tick("cudarc's alloc+free against Pool::alloc on its stream");
        cudarc_pairs::measure(&context, options.pairs, options.rounds)?
    };
    progress.done();
    Ok(Report {
        device: device.name()?,
        driver: cumempool::driver_version()?.to_string(),
        pairs_per_measurement: options.pairs,
        rounds: options.rounds,
        statistic:
            "medians of interleaved rounds on the same pool and stream; safe/raw is the median of per-round ratios",
        rows,
        sync_alloc_free_1mib_us,
        thread_size,
        threads,
        stream_handover,
        cache_targets,
        copies,
        #[cfg(feature = "cudarc")]
        cudarc,
    })
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "{} (driver {}): allocation+free pairs, {} pairs x {} rounds ({})\n\n",
        report.device, report.driver, report.pairs_per_measurement, report.rounds, report.statistic
    );
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
    for r in &report.rows {
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
    out.push_str(&table.render());
    out.push_str(&format!(
        "\nsynchronous cuMemAlloc + cuMemFree of 1 MiB: {:.1} us\n\n",
        report.sync_alloc_free_1mib_us
    ));
    out.push_str(&format!(
        "thread scaling: {} per pair, one device pool, one stream per thread (pairs per second, in total)\n",
        bytes(report.thread_size as u64)
    ));
    let mut threads = Table::new(&["threads", "raw sys", "safe", "cache", "cache/raw"]);
    for t in &report.threads {
        threads.row(vec![
            t.threads.to_string(),
            format!("{:.2} M/s", t.raw_pairs_per_s / 1e6),
            format!("{:.2} M/s", t.safe_pairs_per_s / 1e6),
            format!("{:.2} M/s", t.cache_pairs_per_s / 1e6),
            format!("{:.0}x", t.cache_over_raw),
        ]);
    }
    out.push_str(&threads.render());
    out.push('\n');
    out.push_str(&stream_handover::render(&report.stream_handover));
    out.push('\n');
    out.push_str(&cache_targets::render(&report.cache_targets));
    out.push('\n');
    out.push_str(&copies::render(&report.copies));
    #[cfg(feature = "cudarc")]
    {
        out.push('\n');
        out.push_str(&cudarc_pairs::render(&report.cudarc));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_follows_the_pace_so_far() {
        assert_eq!(remaining(Duration::from_secs(10), 0, 4), None);
        assert_eq!(remaining(Duration::from_secs(10), 2, 4), Some(Duration::from_secs(10)));
        assert_eq!(remaining(Duration::from_secs(9), 3, 3), Some(Duration::ZERO));
    }
}
