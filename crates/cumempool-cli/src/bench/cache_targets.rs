//! The cache's targets, measured in one run beside the raw driver: one thread's cost per pair,
//! 16 threads each on its own stream, and 16 threads sharing one stream, each with 1 MiB pairs
//! and with mixed sizes (256 B to 4 MiB). Beside them, a plain thread-local free list timed the
//! same way on one and on 16 threads: what the node itself allows, the reference the cache is
//! held to (a pair from a thread-local free list costs a few nanoseconds).

use super::free_list::free_list_pair;
use super::harness::{cached_pair, hit_rate, median, min, on_threads, raw_pool_pair, time, Options};
use super::stream_handover;
use crate::error::Result;
use crate::table::Table;
use cumempool::{Context, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource};
use serde::Serialize;

/// Threads of the multi-threaded rows, as in the stream handover.
const THREADS: usize = 16;
/// Sizes each thread cycles through, drawn before timing so that drawing them costs nothing.
pub(super) const SEQUENCE: usize = 4096;
const _: () = assert!(SEQUENCE.is_power_of_two());

#[derive(Serialize)]
pub struct Report {
    pub threads: usize,
    pub min_size: usize,
    pub max_size: usize,
    pub cache_pairs_per_thread: usize,
    pub raw_pairs_per_thread: usize,
    pub rows: Vec<Row>,
    /// The thread-local free list's rows.
    pub reference: Vec<ReferenceRow>,
}

#[derive(Serialize)]
pub struct ReferenceRow {
    pub sizes: &'static str,
    pub threads: usize,
    pub pairs_per_s: f64,
    pub ns_per_pair: f64,
    /// Rate over the one-thread rate of the same sizes.
    pub over_one_thread: f64,
}

#[derive(Serialize)]
pub struct Row {
    pub case: &'static str,
    /// "1 MiB" or "256 B..4 MiB".
    pub sizes: &'static str,
    pub threads: usize,
    pub raw_pairs_per_s: f64,
    pub cache_pairs_per_s: f64,
    /// Nanoseconds of one thread per pair (one-thread rows), or total time over pairs.
    pub cache_ns_per_pair: f64,
    /// One-thread rows: the fastest round's nanoseconds per pair (noise only ever adds time).
    pub cache_best_ns_per_pair: Option<f64>,
    /// Cache rate over the one-thread cache rate of the same sizes.
    pub cache_over_one_thread: f64,
    pub cache_over_raw: f64,
    /// Hits over allocations of the row, warm-up included.
    pub cache_hit_rate: f64,
    /// One-thread rows only (other rows spawn threads, which allocate).
    pub cache_heap_allocs_per_pair: Option<f64>,
}

/// The sizes thread `thread` cycles through: all 1 MiB, or the handover's even spread.
pub(super) fn sequence(thread: usize, mixed: bool) -> Vec<usize> {
    (0..SEQUENCE).map(|step| if mixed { stream_handover::size(thread, step) } else { 1 << 20 }).collect()
}

pub fn measure(context: &Context, options: &Options) -> Result<Report> {
    let pool = MemPool::new(Route::device(0))?;
    pool.set_release_threshold(u64::MAX)?;
    let raw_sized = raw_pool_pair(&pool)?;
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
    let cache_pairs = options.pairs * 100;
    let raw_pairs = (options.pairs * 2 / THREADS).max(4000);
    let sequences: Vec<[Vec<usize>; 2]> = (0..THREADS).map(|t| [sequence(t, false), sequence(t, true)]).collect();
    // A mask, not a modulo, and one bounds check: the harness's own cost stays small beside a
    // cache hit (the reference rows show what is left of it).
    let size = |thread: usize, step: usize, mixed: bool| {
        sequences.get(thread).map_or(1 << 20, |both| both[usize::from(mixed)][step & (SEQUENCE - 1)])
    };
    let cached = |stream: &Stream, bytes: usize| cached_pair(&cache, stream, bytes);
    // Rounds of a few milliseconds each: enough of them that one slow round (a clock change, a
    // descheduled thread) does not move the median.
    let rounds = options.rounds.clamp(1, 7);
    let mut rows = Vec::new();
    let mut reference = Vec::new();
    for (mixed, sizes) in [(false, "1 MiB"), (true, "256 B..4 MiB")] {
        // The reference first, on the same threads' machinery as the cache's rows.
        let stream = Stream::new(context)?;
        let mut one_rate = 0.0;
        for threads in [1, THREADS] {
            let spread: Vec<&Stream> = vec![&stream; threads];
            let rate = median(
                (0..rounds)
                    // Four times the cache's pairs: a run this fast would otherwise be short
                    // next to starting and joining the threads.
                    .map(|_| {
                        on_threads(&spread, cache_pairs / 20, 4 * cache_pairs, &|_, t, step| {
                            free_list_pair(size(t, step, mixed))
                        })
                    })
                    .collect::<Result<_>>()?,
            );
            if threads == 1 {
                one_rate = rate;
            }
            reference.push(ReferenceRow {
                sizes,
                threads,
                pairs_per_s: rate,
                ns_per_pair: 1e9 / rate * threads as f64,
                over_one_thread: rate / one_rate,
            });
        }
        drop(stream);

        // One thread, on this thread, so heap allocations per pair can be counted.
        let stream = Stream::new(context)?;
        let mut step = 0;
        let mut one_cached = || {
            step += 1;
            cached(&stream, size(0, step, mixed))
        };
        time(cache_pairs / 10, &stream, &mut one_cached)?;
        let before = cache.stats();
        let (mut raw, mut ns, mut heap) = (Vec::new(), Vec::new(), 0.0f64);
        for _ in 0..rounds {
            let mut raw_step = 0;
            raw.push(
                time(raw_pairs, &stream, || {
                    raw_step += 1;
                    raw_sized(&stream, size(0, raw_step, mixed))
                })?
                .0,
            );
            let (n, h) = time(cache_pairs, &stream, &mut one_cached)?;
            ns.push(n);
            heap = heap.max(h);
        }
        let best = min(&ns);
        let one = 1e9 / median(ns);
        let raw_one = 1e9 / median(raw);
        rows.push(Row {
            case: "one thread",
            sizes,
            threads: 1,
            raw_pairs_per_s: raw_one,
            cache_pairs_per_s: one,
            cache_ns_per_pair: 1e9 / one,
            cache_best_ns_per_pair: Some(best),
            cache_over_one_thread: 1.0,
            cache_over_raw: one / raw_one,
            cache_hit_rate: hit_rate(before, cache.stats()),
            cache_heap_allocs_per_pair: Some(heap),
        });
        drop(stream);

        // Then THREADS threads on their own streams, then the same threads on one new stream
        // (the streams of the rows before are gone: only the cache still holds them).
        for (case, shared) in [("own streams", false), ("one shared stream", true)] {
            let streams: Vec<Stream> = (0..if shared { 1 } else { THREADS })
                .map(|_| Stream::new(context))
                .collect::<cumempool::Result<_>>()?;
            let spread: Vec<&Stream> = (0..THREADS).map(|t| &streams[t % streams.len()]).collect();
            let before = cache.stats();
            let (mut r, mut c) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                r.push(on_threads(&spread, 0, raw_pairs, &|s, t, step| raw_sized(s, size(t, step, mixed)))?);
                c.push(on_threads(&spread, cache_pairs / 20, cache_pairs, &|s, t, step| {
                    cached(s, size(t, step, mixed))
                })?);
            }
            let (raw_rate, cache_rate) = (median(r), median(c));
            rows.push(Row {
                case,
                sizes,
                threads: THREADS,
                raw_pairs_per_s: raw_rate,
                cache_pairs_per_s: cache_rate,
                cache_ns_per_pair: 1e9 / cache_rate,
                cache_best_ns_per_pair: None,
                cache_over_one_thread: cache_rate / one,
                cache_over_raw: cache_rate / raw_rate,
                cache_hit_rate: hit_rate(before, cache.stats()),
                cache_heap_allocs_per_pair: None,
            });
        }
    }
    cache.release()?;
    Ok(Report {
        threads: THREADS,
        min_size: stream_handover::MIN_SIZE,
        max_size: stream_handover::MAX_SIZE,
        cache_pairs_per_thread: cache_pairs,
        raw_pairs_per_thread: raw_pairs,
        rows,
        reference,
    })
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "cache targets: one device pool; {} cache pairs and {} raw pairs per thread; \
         each case follows the one above on the same cache\n",
        report.cache_pairs_per_thread, report.raw_pairs_per_thread
    );
    let mut table = Table::new(&[
        "case",
        "sizes",
        "threads",
        "raw sys",
        "cache",
        "cache ns/pair",
        "best round",
        "x one thread",
        "cache/raw",
        "hit rate",
        "heap allocs/pair",
    ]);
    for r in &report.rows {
        table.row(vec![
            r.case.to_owned(),
            r.sizes.to_owned(),
            r.threads.to_string(),
            format!("{:.2} M/s", r.raw_pairs_per_s / 1e6),
            format!("{:.2} M/s", r.cache_pairs_per_s / 1e6),
            format!("{:.1}", r.cache_ns_per_pair),
            r.cache_best_ns_per_pair.map_or_else(|| "-".to_owned(), |ns| format!("{ns:.1}")),
            format!("{:.1}x", r.cache_over_one_thread),
            format!("{:.0}x", r.cache_over_raw),
            format!("{:.1}%", r.cache_hit_rate * 100.0),
            r.cache_heap_allocs_per_pair.map_or_else(|| "-".to_owned(), |h| format!("{h:.2}")),
        ]);
    }
    out.push_str(&table.render());
    out.push_str(
        "reference: a plain thread-local free list (a Vec per power of two, no lock), same sizes and \
         threads; ns/pair is per thread\n",
    );
    let mut table = Table::new(&["sizes", "threads", "pairs", "ns/pair", "x one thread"]);
    for r in &report.reference {
        table.row(vec![
            r.sizes.to_owned(),
            r.threads.to_string(),
            format!("{:.2} M/s", r.pairs_per_s / 1e6),
            format!("{:.1}", r.ns_per_pair),
            format!("{:.1}x", r.over_one_thread),
        ]);
    }
    out.push_str(&table.render());
    out
}
