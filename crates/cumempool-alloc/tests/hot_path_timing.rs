//! Its own process: a timing, which other tests' threads running beside it would distort.
//!
//! The cache's hot path on the host heap, timed: `cargo test --release -p cumempool-alloc
//! --features testing --test hot_path_timing -- --ignored --nocapture`. No GPU is needed: a hit
//! never reaches the resource below, so these are the cache's own costs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, StreamOrderedResource};
use std::sync::Barrier;
use std::time::Instant;
use support::fake_stream;

/// 4096 sizes spread evenly over 256 B to 4 MiB, drawn once so that timing measures the cache.
fn mixed_sizes(seed: usize) -> Vec<usize> {
    (0..4096u64)
        .map(|step| {
            let x = (seed as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03);
            let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            256 + (x >> 11) as usize % ((4 << 20) - 255)
        })
        .collect()
}

/// Nanoseconds per pair and pairs per second in total, of `threads` threads each running
/// `pair(t, stream, step)` with `stream` = `streams[t % len]`, after a warm-up; the fastest of
/// `ROUNDS` rounds (noise only ever adds time).
fn pairs(
    streams: &[Stream],
    threads: usize,
    per_thread: usize,
    pair: &(dyn Fn(usize, &Stream, usize) + Sync),
) -> (f64, f64) {
    let best = (0..ROUNDS)
        .map(|_| {
            let barrier = Barrier::new(threads + 1);
            std::thread::scope(|scope| {
                for thread in 0..threads {
                    let (barrier, stream) = (&barrier, &streams[thread % streams.len()]);
                    scope.spawn(move || {
                        (0..8192).for_each(|step| pair(thread, stream, step));
                        barrier.wait();
                        (0..per_thread).for_each(|step| pair(thread, stream, step));
                        barrier.wait();
                    });
                }
                barrier.wait();
                let start = Instant::now();
                barrier.wait();
                start.elapsed()
            })
        })
        .min()
        .unwrap();
    let total = (threads * per_thread) as f64;
    (best.as_nanos() as f64 * threads as f64 / total, total / best.as_secs_f64())
}

/// Rounds per measurement; the fastest counts.
const ROUNDS: usize = 5;

/// The sizes of a thread's pairs: all 1 MiB, or [`mixed_sizes`].
fn sizes(mixed: bool) -> Vec<Vec<usize>> {
    (0..64).map(|thread| if mixed { mixed_sizes(thread) } else { vec![1 << 20; 4096] }).collect()
}

/// What the lanes no longer pay: the design before took its lane's flag lock twice per pair (a
/// compare-exchange and a release store), and the one before that a `Mutex` twice; a thread now
/// enters its lane with plain stores and loads.
fn time_the_locks(rounds: u32) {
    let flag = std::sync::atomic::AtomicBool::new(false);
    let start = Instant::now();
    for _ in 0..rounds {
        while flag
            .compare_exchange(false, true, std::sync::atomic::Ordering::Acquire, std::sync::atomic::Ordering::Relaxed)
            .is_err()
        {}
        flag.store(false, std::sync::atomic::Ordering::Release);
    }
    let flag_ns = start.elapsed().as_nanos() as f64 / f64::from(rounds);
    let mutex = std::sync::Mutex::new(0u64);
    let start = Instant::now();
    for _ in 0..rounds {
        *std::hint::black_box(&mutex).lock().unwrap() += 1;
    }
    let mutex_ns = start.elapsed().as_nanos() as f64 / f64::from(rounds);
    println!("uncontended lock+unlock: flag (compare-exchange, store) {flag_ns:.1} ns, std Mutex {mutex_ns:.1} ns");
}

thread_local! {
    /// The free list `cumempool bench` holds the cache to (its cache ratios): a plain free list per
    /// power of two, each thread its own.
    static FREE_LISTS: std::cell::RefCell<Vec<Vec<u64>>> =
        std::cell::RefCell::new((0..64).map(|_| Vec::with_capacity(64)).collect());
}

/// A pair from the calling thread's plain free lists, as `cumempool bench` times it.
fn free_list_pair(bytes: usize) {
    FREE_LISTS.with(|lists| {
        let mut lists = lists.borrow_mut();
        let Some(list) = lists.get_mut(bytes.next_power_of_two().trailing_zeros() as usize) else { return };
        let block = list.pop().unwrap_or(bytes as u64);
        list.push(std::hint::black_box(block));
    });
}

#[test]
#[ignore = "a timing, not a check: run it with --release --ignored --nocapture"]
fn time_the_hot_path() {
    time_the_locks(10_000_000);
    let per_thread = 2_000_000;
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    println!("{cores} cores; each figure the fastest of {ROUNDS} rounds of {per_thread} pairs per thread");
    for mixed in [false, true] {
        let label = if mixed { "256 B..4 MiB" } else { "1 MiB" };
        let sizes = sizes(mixed);
        let cache = CachingResource::new(HostHeap);
        let own: Vec<Stream> = (0..16).map(|i| fake_stream(10 + i)).collect();
        let listed = |thread: usize, _: &Stream, step: usize| free_list_pair(sizes[thread][step & 4095]);
        let cached = |thread: usize, stream: &Stream, step: usize| {
            let bytes = sizes[thread][step & 4095];
            let ptr = cache.allocate(bytes, 256, stream).unwrap();
            // SAFETY: allocated just above with these arguments, freed once.
            unsafe { cache.deallocate(ptr, bytes, 256, stream) }.unwrap();
        };
        let (list_ns, list_one) = pairs(&own, 1, per_thread, &listed);
        let (cache_ns, cache_one) = pairs(&own, 1, per_thread, &cached);
        println!(
            "{label}: 1 thread: cache {cache_ns:.1} ns per pair, free list {list_ns:.1} ns: {:.2}x the free list's time",
            cache_ns / list_ns
        );
        // This host's cores, then the bench's 16 threads (more than the cores here: the
        // threads take turns, so contention shows less than on a machine with 16 cores).
        let mut counts = vec![cores, 16];
        counts.dedup();
        for threads in counts {
            let (_, list) = pairs(&own, threads, per_thread, &listed);
            let (_, rate) = pairs(&own, threads, per_thread, &cached);
            println!(
                "{label}: {threads} threads, own streams: cache {:.1} M/s ({:.1}x one thread), free list {:.1} M/s \
                 ({:.1}x one thread): {:.2}x the free list's rate",
                rate / 1e6,
                rate / cache_one,
                list / 1e6,
                list / list_one,
                rate / list
            );
            let before = cache.stats();
            let shared = [fake_stream(2)];
            let (_, rate) = pairs(&shared, threads, per_thread, &cached);
            let after = cache.stats();
            let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
            println!(
                "{label}: {threads} threads, one stream: cache {:.1} M/s ({:.1}x one thread), hit rate {:.2}%",
                rate / 1e6,
                rate / cache_one,
                100.0 * hits as f64 / (hits + misses) as f64
            );
        }
    }
}

/// A stream whose home slot in `cache` another stream holds (kept alive, with a cached block),
/// so that it sits further along the probe path.
fn off_home_stream(cache: &CachingResource<HostHeap>) -> Stream {
    let home = |stream: &Stream| (stream.id().get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) % 256;
    let first = fake_stream(1000);
    let ptr = cache.allocate(4096, 256, &first).unwrap();
    // SAFETY: allocated just above with these arguments, freed once.
    unsafe { cache.deallocate(ptr, 4096, 256, &first) }.unwrap();
    let stream = (1001..).map(fake_stream).find(|s| home(s) == home(&first)).unwrap();
    std::mem::forget(first);
    stream
}

/// One thread's warm 1 MiB pairs, `CUMEMPOOL_PAIRS` of them (default 1,000,000), for counting
/// instructions per pair: run it under `valgrind --tool=callgrind` with two counts and divide
/// the difference in instructions by the difference in pairs. With `CUMEMPOOL_OFF_HOME` set, on
/// a stream whose home slot another stream holds; with `CUMEMPOOL_FREE_LIST` set, the plain
/// free list's pairs instead (the reference).
#[test]
#[ignore = "an instruction count, not a check: run it under callgrind with --release --ignored"]
fn pairs_for_an_instruction_count() {
    let count = std::env::var("CUMEMPOOL_PAIRS").ok().and_then(|n| n.parse().ok()).unwrap_or(1_000_000);
    if std::env::var_os("CUMEMPOOL_FREE_LIST").is_some() {
        (0..count).for_each(|_| free_list_pair(std::hint::black_box(1 << 20)));
        return;
    }
    let cache = CachingResource::new(HostHeap);
    let stream =
        if std::env::var_os("CUMEMPOOL_OFF_HOME").is_some() { off_home_stream(&cache) } else { fake_stream(1) };
    for _ in 0..count {
        let bytes = std::hint::black_box(1 << 20);
        let ptr = cache.allocate(bytes, 256, &stream).unwrap();
        // SAFETY: allocated just above with these arguments, freed once.
        unsafe { cache.deallocate(ptr, bytes, 256, &stream) }.unwrap();
    }
}
