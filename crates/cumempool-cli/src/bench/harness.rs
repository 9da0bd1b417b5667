//! What every measurement of `cumempool bench` is made of: the options, the timing of a pair
//! loop, the statistics over rounds, the allocation+free pairs themselves (raw driver calls or
//! through a cache), the thread runner, and the progress line.

use crate::counting_allocator;
use crate::error::{Error, Result};
use cumempool::{Pool, Stream};
use cumempool_alloc::{CacheStats, StreamOrderedResource};
use std::io::{IsTerminal, Write};
use std::sync::Barrier;
use std::time::{Duration, Instant};

pub struct Options {
    pub pairs: usize,
    pub rounds: usize,
    pub threads: Vec<usize>,
}

/// The middle value (the upper one of an even count); `values` is never empty.
pub(super) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub(super) fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}

/// Nanoseconds per pair and heap allocations per pair over `pairs` calls of `pair`.
pub(super) fn time(pairs: usize, stream: &Stream, mut pair: impl FnMut() -> bool) -> Result<(f64, f64)> {
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

/// An allocation+free pair of `bytes` through `cache` on `stream`; inlined into the timed loop
/// as it would be in a program (left to the compiler, one loop that held several kinds of pair
/// called it for one of them, with its `Result` passed through memory).
#[inline(always)]
pub(super) fn cached_pair(cache: &impl StreamOrderedResource, stream: &Stream, bytes: usize) -> bool {
    let ptr = match cache.allocate(bytes, 256, stream) {
        Ok(ptr) => ptr,
        Err(error) => return failed(error),
    };
    // SAFETY: just allocated with these arguments; nothing used it.
    match unsafe { cache.deallocate(ptr, bytes, 256, stream) } {
        Ok(()) => true,
        Err(error) => failed(error),
    }
}

/// A pair that failed, out of line: dropping the error where it arises made the compiler keep
/// every allocation's `Result` in memory, a store and a load per pair that a program which
/// passes errors up does not pay.
#[cold]
#[inline(never)]
fn failed(error: cumempool_alloc::Error) -> bool {
    drop(error);
    false
}

/// An allocation+free pair of `bytes` from `pool` on any stream, through raw driver calls, for
/// any thread: it makes the stream's context current first.
pub(super) fn raw_pool_pair(pool: &Pool) -> cumempool::Result<impl Fn(&Stream, usize) -> bool + Sync + Copy> {
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

/// Pairs per second, in total, of a thread per entry of `streams` (entries may repeat a stream),
/// each making `warm` untimed calls, then `pairs` timed calls of `pair(stream, thread, step)`.
/// Generic rather than `dyn`, so that the pair is inlined into each thread's loop as it would
/// be in a program: a dynamic call per pair would add its own cost to the cache's few
/// nanoseconds.
pub(super) fn on_threads<F: Fn(&Stream, usize, usize) -> bool + Sync>(
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

/// Hits over allocations between two snapshots of a cache's counters.
pub(super) fn hit_rate(before: CacheStats, after: CacheStats) -> f64 {
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    hits as f64 / (hits + misses).max(1) as f64
}

/// Which measurement is running and about how long the rest will take, redrawn in place; only
/// on a terminal, so a log or a pipe gets no control codes.
pub(super) struct Progress {
    enabled: bool,
    started: Instant,
    step: usize,
    total: usize,
}

impl Progress {
    pub(super) fn new(total: usize) -> Self {
        Self { enabled: std::io::stderr().is_terminal(), started: Instant::now(), step: 0, total }
    }

    pub(super) fn tick(&mut self, what: &str) {
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

    pub(super) fn done(&self) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_follows_the_pace_so_far() {
        assert_eq!(remaining(Duration::from_secs(10), 0, 4), None);
        assert_eq!(remaining(Duration::from_secs(10), 2, 4), Some(Duration::from_secs(10)));
        assert_eq!(remaining(Duration::from_secs(9), 3, 3), Some(Duration::ZERO));
    }

    #[test]
    fn the_median_is_the_middle_value_and_the_minimum_the_least() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(min(&[3.0, 1.5, 2.0]), 1.5);
    }

    #[test]
    fn the_hit_rate_counts_only_what_happened_between_the_snapshots() {
        let (mut before, mut after) = (CacheStats::default(), CacheStats::default());
        (before.hits, before.misses, after.hits, after.misses) = (10, 10, 13, 11);
        assert_eq!(hit_rate(before, after), 0.75);
        assert_eq!(hit_rate(after, after), 0.0);
    }
}
