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

/// Nanoseconds per pair and pairs per second in total, of `threads` threads on `streams`
/// (thread `t` on `streams[t % len]`), after a warm-up.
fn pairs(
    cache: &CachingResource<HostHeap>,
    streams: &[Stream],
    threads: usize,
    per_thread: usize,
    mixed: bool,
) -> (f64, f64) {
    let barrier = Barrier::new(threads + 1);
    let elapsed = std::thread::scope(|scope| {
        for thread in 0..threads {
            let (barrier, stream) = (&barrier, &streams[thread % streams.len()]);
            scope.spawn(move || {
                let sizes = if mixed { mixed_sizes(thread) } else { vec![1 << 20; 4096] };
                let pair = |step: usize| {
                    let bytes = sizes[step & 4095];
                    let ptr = cache.allocate(bytes, 256, stream).unwrap();
                    unsafe { cache.deallocate(ptr, bytes, 256, stream) }.unwrap();
                };
                (0..8192).for_each(pair);
                barrier.wait();
                (0..per_thread).for_each(pair);
                barrier.wait();
            });
        }
        barrier.wait();
        let start = Instant::now();
        barrier.wait();
        start.elapsed()
    });
    let total = (threads * per_thread) as f64;
    (elapsed.as_nanos() as f64 * threads as f64 / total, total / elapsed.as_secs_f64())
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

/// The reference of `cumempool bench`'s cache targets, in this process: a pair from a plain
/// thread-local free list (a `Vec` per power of two).
fn time_a_plain_free_list(pairs: usize) {
    thread_local! {
        static LISTS: std::cell::RefCell<Vec<Vec<u64>>> = std::cell::RefCell::new((0..64).map(|_| Vec::with_capacity(64)).collect());
    }
    let start = Instant::now();
    for step in 0..pairs {
        let bytes = std::hint::black_box(1usize << 20) + (step & 1);
        LISTS.with(|lists| {
            let mut lists = lists.borrow_mut();
            let list = &mut lists[bytes.next_power_of_two().trailing_zeros() as usize];
            let block = list.pop().unwrap_or(bytes as u64);
            list.push(std::hint::black_box(block));
        });
    }
    let ns = start.elapsed().as_nanos() as f64 / pairs as f64;
    println!("plain thread-local free list: {ns:.1} ns per pair");
}

#[test]
#[ignore = "a timing, not a check: run it with --release --ignored --nocapture"]
fn time_the_hot_path() {
    time_the_locks(10_000_000);
    time_a_plain_free_list(20_000_000);
    let per_thread = 2_000_000;
    for mixed in [false, true] {
        let sizes = if mixed { "256 B..4 MiB" } else { "1 MiB" };
        let cache = CachingResource::new(HostHeap);
        let (ns, rate1) = pairs(&cache, &[fake_stream(1)], 1, per_thread, mixed);
        println!("{sizes}: 1 thread: {ns:.1} ns per pair ({:.1} M/s)", rate1 / 1e6);
        // This host's cores, then the 16 threads (more than the cores here: the
        // threads take turns, so contention shows less than on a machine with 16 cores).
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let mut counts = vec![cores, 16];
        counts.dedup();
        for threads in counts {
            let own: Vec<Stream> = (0..threads).map(|i| fake_stream(10 + i)).collect();
            let (_, rate) = pairs(&cache, &own, threads, per_thread, mixed);
            println!(
                "{sizes}: {threads} threads, own streams: {:.1} M/s ({:.1}x one thread)",
                rate / 1e6,
                rate / rate1
            );
            let before = cache.stats();
            let (_, rate) = pairs(&cache, &[fake_stream(2)], threads, per_thread, mixed);
            let after = cache.stats();
            let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
            println!(
                "{sizes}: {threads} threads, one stream: {:.1} M/s ({:.1}x one thread), hit rate {:.2}%",
                rate / 1e6,
                rate / rate1,
                100.0 * hits as f64 / (hits + misses) as f64
            );
        }
    }
}

/// One thread's warm 1 MiB pairs, `CUMEMPOOL_PAIRS` of them (default 1,000,000), for counting
/// instructions per pair: run it under `valgrind --tool=callgrind` with two counts and divide
/// the difference in instructions by the difference in pairs.
#[test]
#[ignore = "an instruction count, not a check: run it under callgrind with --release --ignored"]
fn pairs_for_an_instruction_count() {
    let count = std::env::var("CUMEMPOOL_PAIRS").ok().and_then(|n| n.parse().ok()).unwrap_or(1_000_000);
    let cache = CachingResource::new(HostHeap);
    let stream = fake_stream(1);
    for _ in 0..count {
        let bytes = std::hint::black_box(1 << 20);
        let ptr = cache.allocate(bytes, 256, &stream).unwrap();
        unsafe { cache.deallocate(ptr, bytes, 256, &stream) }.unwrap();
    }
}
