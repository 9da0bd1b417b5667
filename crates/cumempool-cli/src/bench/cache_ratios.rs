//! The cache's speed as ratios to the plain thread-local free list, in one run: on one thread
//! (time per pair) and on 16 threads each on its own stream (pairs per second), with 1 MiB and
//! with mixed sizes; and beside them the cache without its check of the stream's capture mark
//! (on the allocation and on the free), which is what that check costs. The mark rides in the
//! stream's key, which the hot path compares anyway, so the two caches run the same instructions
//! and that column shows how far two caches' timings differ, about zero. The free's check of
//! blocks handed out during captures stays in both, so it is not counted.
//!
//! The three loops run on the same threads, round after round, in an order that turns with
//! each round, and every ratio is the median of the per-round ratios: a thread's placement on
//! the machine and the clock's drift then weigh on both sides of a ratio alike, where timing
//! the cache and the free list on different threads or at different moments measured the
//! machine as much as the code.

use super::free_list::free_list_pair;
use super::harness::{cached_pair, median, Options};
use super::stream_handover;
use crate::error::{Error, Result};
use crate::table::Table;
use cumempool::sys::CUdeviceptr;
use cumempool::{Context, MemPool, Route, Stream};
use cumempool_alloc::{CachingResource, DeviceMemory, PoolResource, StreamOrderedResource};
use serde::Serialize;
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Threads of the many-thread rows, each on its own stream.
const THREADS: usize = 16;
/// Sizes each thread cycles through, drawn before timing so that drawing them costs nothing; a
/// power of two, so the loop picks the next one with a mask, not a division.
const SEQUENCE: usize = 4096;
const _: () = assert!(SEQUENCE.is_power_of_two());

#[derive(Serialize)]
pub struct Report {
    pub rounds: usize,
    pub pairs_per_thread_per_round: usize,
    pub rows: Vec<Row>,
}

#[derive(Serialize)]
pub struct Row {
    /// "1 MiB" or "256 B..4 MiB".
    pub sizes: &'static str,
    pub threads: usize,
    /// Medians over the rounds, nanoseconds per pair of one thread.
    pub free_list_ns_per_pair: f64,
    pub cache_ns_per_pair: f64,
    pub cache_without_checks_ns_per_pair: f64,
    /// Median of the per-round ratios of the cache's time per pair to the free list's (the
    /// one-thread target: at most 1.25).
    pub cache_time_over_free_list: f64,
    /// Its inverse, as rates: the cache's pairs per second over the free list's (the 16-thread
    /// target: at least 0.75).
    pub cache_rate_over_free_list: f64,
    /// Median of the per-round differences, nanoseconds per pair of one thread: what the checks
    /// of the stream's capture mark on the allocation and the free cost together (the free's
    /// check of blocks handed out during captures is in both loops, so not in this).
    pub capture_checks_ns_per_pair: f64,
}

/// A resource for a measurement only: the one below, on streams this bench made and never
/// captures, saying so: it answers the stream's id unmarked, so a cache over it shows the cost
/// of the check of the stream's capture mark. Not for any other use: on a
/// stream that could be captured it would let the cache break the capture's rules.
struct NeverCaptured<R>(R);

// SAFETY: every allocation and free is the resource below's, with the same arguments.
unsafe impl<R: StreamOrderedResource> StreamOrderedResource for NeverCaptured<R> {
    type Kind = R::Kind;

    #[inline(always)]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> cumempool_alloc::Result<CUdeviceptr> {
        self.0.allocate(bytes, align, stream)
    }

    #[inline(always)]
    unsafe fn deallocate(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        align: usize,
        stream: &Stream,
    ) -> cumempool_alloc::Result<()> {
        // SAFETY: forwarded under the caller's promise.
        unsafe { self.0.deallocate(ptr, bytes, align, stream) }
    }

    fn is_capturing(&self, _stream: &Stream) -> cumempool_alloc::Result<bool> {
        Ok(false)
    }

    #[inline(always)]
    fn marked_stream_id(&self, stream: &Stream) -> std::num::NonZeroU64 {
        stream.id().get_nonzero()
    }
}

/// The sizes thread `thread` cycles through: all 1 MiB, or the stream handover's even spread.
fn sequence(thread: usize, mixed: bool) -> Vec<usize> {
    (0..SEQUENCE).map(|step| if mixed { stream_handover::size(thread, step) } else { 1 << 20 }).collect()
}

/// The three loops a round times.
#[derive(Clone, Copy)]
enum Loop {
    FreeList,
    Cache,
    CacheWithoutChecks,
}

const LOOPS: [Loop; 3] = [Loop::FreeList, Loop::Cache, Loop::CacheWithoutChecks];

pub fn measure(context: &Context, options: &Options) -> Result<Report> {
    let pool = MemPool::new(Route::device(0))?;
    pool.set_release_threshold(u64::MAX)?;
    let cache = CachingResource::new(PoolResource::<DeviceMemory>::new(&pool)?);
    let unchecked = CachingResource::new(NeverCaptured(PoolResource::<DeviceMemory>::new(&pool)?));
    let rounds = options.rounds.clamp(3, 15);
    // Rounds of a few milliseconds: short enough to interleave often, long beside the barrier.
    let pairs = (options.pairs * 50).max(SEQUENCE);
    let streams: Vec<Stream> = (0..THREADS).map(|_| Stream::new(context)).collect::<cumempool::Result<_>>()?;
    let mut rows = Vec::new();
    for (mixed, sizes) in [(false, "1 MiB"), (true, "256 B..4 MiB")] {
        for threads in [1, THREADS] {
            let sequences: Vec<Vec<usize>> = (0..threads).map(|t| sequence(t, mixed)).collect();
            let run = |which: Loop, thread: usize, stream: &Stream, count: usize| {
                let Ok(sizes) = <&[usize; SEQUENCE]>::try_from(&sequences[thread][..]) else { return false };
                match which {
                    Loop::FreeList => pairs_through(sizes, count, free_list_pair),
                    Loop::Cache => pairs_through(sizes, count, |bytes| cached_pair(&cache, stream, bytes)),
                    Loop::CacheWithoutChecks => {
                        pairs_through(sizes, count, |bytes| cached_pair(&unchecked, stream, bytes))
                    }
                }
            };
            let times = interleaved(&streams[..threads], rounds, pairs, &run)?;
            rows.push(row(sizes, threads, pairs, &times));
        }
    }
    cache.release()?;
    unchecked.release()?;
    Ok(Report { rounds, pairs_per_thread_per_round: pairs, rows })
}

/// `count` pairs, each of the next size of `sizes` (round and round) through `pair`; true if
/// every pair succeeded. A loop of its own for each kind of pair, with the pair inlined, as a
/// program compiles one: a loop that chose the kind of each pair inside held all three, and the
/// compiler inlined only some (the measured cache then paid a call and a `Result` through memory
/// per pair that a program does not).
#[inline(never)]
fn pairs_through(sizes: &[usize; SEQUENCE], count: usize, mut pair: impl FnMut(usize) -> bool) -> bool {
    let mut ok = true;
    for step in 0..count {
        ok &= pair(sizes[step & (SEQUENCE - 1)]);
    }
    ok
}

/// Per round, the wall time of each loop of [`LOOPS`] on a thread per stream (all threads run
/// the same loop at once, between two barriers), after one untimed round of each to warm the
/// caches and the free lists.
fn interleaved<F: Fn(Loop, usize, &Stream, usize) -> bool + Sync>(
    streams: &[Stream],
    rounds: usize,
    pairs: usize,
    run: &F,
) -> Result<Vec<[Duration; 3]>> {
    let barrier = Barrier::new(streams.len() + 1);
    let order = |round: usize, i: usize| LOOPS[(round + i) % LOOPS.len()];
    let (times, ok) = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(thread, stream)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let mut ok = LOOPS.iter().all(|&which| run(which, thread, stream, pairs / 4));
                    ok &= stream.synchronize().is_ok();
                    for round in 0..rounds {
                        for i in 0..LOOPS.len() {
                            barrier.wait();
                            ok &= run(order(round, i), thread, stream, pairs);
                            barrier.wait();
                        }
                    }
                    ok & stream.synchronize().is_ok()
                })
            })
            .collect();
        let mut times = Vec::with_capacity(rounds);
        for round in 0..rounds {
            let mut each = [Duration::ZERO; 3];
            for i in 0..LOOPS.len() {
                barrier.wait();
                let start = Instant::now();
                barrier.wait();
                each[order(round, i) as usize] = start.elapsed();
            }
            times.push(each);
        }
        let ok = handles.into_iter().all(|handle| handle.join().unwrap_or(false));
        (times, ok)
    });
    if !ok {
        return Err(Error::BenchRunFailed { measurement: "the cache against the free list" });
    }
    Ok(times)
}

fn row(sizes: &'static str, threads: usize, pairs: usize, times: &[[Duration; 3]]) -> Row {
    let ns = |t: Duration| t.as_nanos() as f64 / pairs as f64;
    let of = |which: Loop| median(times.iter().map(|round| ns(round[which as usize])).collect());
    let free = Loop::FreeList as usize;
    let (cache, unchecked) = (Loop::Cache as usize, Loop::CacheWithoutChecks as usize);
    let time_ratio = median(times.iter().map(|round| ns(round[cache]) / ns(round[free])).collect());
    Row {
        sizes,
        threads,
        free_list_ns_per_pair: of(Loop::FreeList),
        cache_ns_per_pair: of(Loop::Cache),
        cache_without_checks_ns_per_pair: of(Loop::CacheWithoutChecks),
        cache_time_over_free_list: time_ratio,
        cache_rate_over_free_list: 1.0 / time_ratio,
        capture_checks_ns_per_pair: median(times.iter().map(|round| ns(round[cache]) - ns(round[unchecked])).collect()),
    }
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "the cache against a plain thread-local free list, on the same threads in interleaved rounds: \
         {} rounds of {} pairs per thread; medians (ratios: of the per-round ratios); ns/pair is per thread\n",
        report.rounds, report.pairs_per_thread_per_round
    );
    let mut table = Table::new(&[
        "sizes",
        "threads",
        "free list ns/pair",
        "cache ns/pair",
        "cache/free list (time)",
        "cache/free list (rate)",
        "without capture checks",
        "capture checks",
    ]);
    for r in &report.rows {
        table.row(vec![
            r.sizes.to_owned(),
            r.threads.to_string(),
            format!("{:.1}", r.free_list_ns_per_pair),
            format!("{:.1}", r.cache_ns_per_pair),
            format!("{:.2}x", r.cache_time_over_free_list),
            format!("{:.2}x", r.cache_rate_over_free_list),
            format!("{:.1}", r.cache_without_checks_ns_per_pair),
            format!("{:+.1} ns", r.capture_checks_ns_per_pair),
        ]);
    }
    out.push_str(&table.render());
    out
}
