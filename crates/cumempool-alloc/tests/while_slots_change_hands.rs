//! Its own process: its 16 threads need lanes, which other tests' threads could all hold.
//!
//! Adversarial check of the cache's hot path, which finds a stream in any slot within eight
//! of its home (not only its home slot), against slots being evicted, reclaimed, released and
//! taken over by other streams from other threads at the same time.
//!
//! The resource below records, for every block, the stream its user last freed it on, and
//! which blocks are in a user's hands. The cache must never hand a block to two users at once,
//! never hand a block freed on stream A to an allocation on stream B (B's work is not ordered
//! after A's last use), and give every block back below on the stream its user freed it on.
#![cfg(feature = "testing")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, Result, StreamOrderedResource};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use support::fake_stream;

/// What the test knows about every block.
#[derive(Default)]
struct Ledger {
    /// Blocks the resource below handed out and nobody has freed yet (fresh from below).
    fresh: HashSet<CUdeviceptr>,
    /// Blocks in a user's hands.
    in_use: HashSet<CUdeviceptr>,
    /// The stream each block's user last freed it on (blocks the cache may hold).
    freed_on: HashMap<CUdeviceptr, u64>,
    /// What went wrong, in words.
    faults: Vec<String>,
}

/// The host heap, recording what the cache gives back below.
#[derive(Clone, Default)]
struct Recording {
    ledger: Arc<Mutex<Ledger>>,
}

// SAFETY: forwards to the host heap, which keeps the trait's promise.
unsafe impl StreamOrderedResource for Recording {
    type Kind = <HostHeap as StreamOrderedResource>::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        let ptr = HostHeap.allocate(bytes, align, stream)?;
        self.ledger.lock().unwrap().fresh.insert(ptr);
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        {
            let mut ledger = self.ledger.lock().unwrap();
            match ledger.freed_on.remove(&ptr) {
                Some(id) if id == stream.id().get() => {}
                Some(id) => {
                    let fault =
                        format!("{ptr:#x} freed by its user on stream {id} went below on {}", stream.id().get());
                    ledger.faults.push(fault);
                }
                None => {
                    let fault = format!("{ptr:#x} went below without a user's free");
                    ledger.faults.push(fault);
                }
            }
        }
        // SAFETY: forwarded under the caller's promise.
        unsafe { HostHeap.deallocate(ptr, bytes, align, stream) }
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        HostHeap.is_capturing(stream)
    }

    fn marked_stream_id(&self, stream: &Stream) -> std::num::NonZeroU64 {
        HostHeap.marked_stream_id(stream)
    }
}

impl Recording {
    fn handed_out(&self, ptr: CUdeviceptr, stream: &Stream) {
        let mut ledger = self.ledger.lock().unwrap();
        if !ledger.in_use.insert(ptr) {
            ledger.faults.push(format!("{ptr:#x} handed to two users at once"));
        }
        if ledger.fresh.remove(&ptr) {
            return;
        }
        match ledger.freed_on.remove(&ptr) {
            Some(id) if id == stream.id().get() => {}
            Some(id) => {
                let fault = format!("{ptr:#x} freed on stream {id} was handed to stream {}", stream.id().get());
                ledger.faults.push(fault);
            }
            None => ledger.faults.push(format!("{ptr:#x} handed out from nowhere")),
        }
    }

    fn freeing(&self, ptr: CUdeviceptr, stream: &Stream) {
        let mut ledger = self.ledger.lock().unwrap();
        ledger.in_use.remove(&ptr);
        ledger.freed_on.insert(ptr, stream.id().get());
    }
}

/// A small xorshift generator: the test needs no crate for it.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Many threads on more streams than the cache has slots, with a small bound, while one thread
/// releases streams and the whole cache and replaces streams with new ones (their old values
/// dropped, so the cache holds the only handle and reclaims their slot): slots change hands all
/// the time under the hot path's feet.
#[test]
fn under_eviction_release_and_reclaim_every_block_stays_on_its_stream() {
    let recording = Recording::default();
    let cache = CachingResource::with_max_cached(recording.clone(), 4 << 20);
    let streams: Vec<Mutex<Stream>> = (0..320).map(|i| Mutex::new(fake_stream(i))).collect();
    let made = AtomicU64::new(320);
    let stop = AtomicBool::new(false);
    let sizes = [256, 4096, 64 << 10];
    std::thread::scope(|scope| {
        for thread in 0..16u64 {
            let (cache, recording, streams, stop) = (&cache, &recording, &streams, &stop);
            scope.spawn(move || {
                let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (thread + 1);
                while !stop.load(Relaxed) {
                    // Mostly a few streams near each other, so that hot-path hits happen.
                    let pick =
                        if next(&mut seed).is_multiple_of(4) { next(&mut seed) % 320 } else { next(&mut seed) % 24 };
                    let stream = streams[pick as usize].lock().unwrap().clone();
                    let bytes = sizes[(next(&mut seed) % 3) as usize];
                    let mut held = Vec::new();
                    for _ in 0..(1 + next(&mut seed) % 4) {
                        let ptr = cache.allocate(bytes, 256, &stream).unwrap();
                        recording.handed_out(ptr, &stream);
                        held.push(ptr);
                    }
                    for ptr in held {
                        recording.freeing(ptr, &stream);
                        // SAFETY: allocated above with these arguments, freed once.
                        unsafe { cache.deallocate(ptr, bytes, 256, &stream) }.unwrap();
                    }
                }
            });
        }
        let (cache, streams, stop, made) = (&cache, &streams, &stop, &made);
        scope.spawn(move || {
            let mut seed = 0x1234_5678;
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_secs(3) {
                let pick = (next(&mut seed) % 24) as usize;
                match next(&mut seed) % 8 {
                    0 => {
                        let stream = streams[pick].lock().unwrap().clone();
                        // Lanes may be unreachable for a moment; what matters is what comes back.
                        let _ = cache.release_stream(&stream);
                    }
                    1 => {
                        let _ = cache.release();
                    }
                    _ => {
                        // A new stream in the place of an old one: the cache may hold the old
                        // one's only handle, and reclaim its slot for a new stream.
                        let id = made.fetch_add(1, Relaxed) as usize;
                        *streams[pick].lock().unwrap() = fake_stream(id % 4000);
                    }
                }
                std::thread::yield_now();
            }
            stop.store(true, Relaxed);
        });
    });
    drop(cache);
    let ledger = recording.ledger.lock().unwrap();
    let shown: Vec<&String> = ledger.faults.iter().take(10).collect();
    assert!(ledger.faults.is_empty(), "{} faults, first: {shown:#?}", ledger.faults.len());
    assert!(ledger.freed_on.is_empty(), "blocks the cache never gave back: {}", ledger.freed_on.len());
}

/// The cache's home slot of a stream (the same hash as the cache's `home_of`).
fn home(stream: &Stream) -> u64 {
    (stream.id().get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) % 256
}

/// Small enough for Miri (`cargo +nightly miri test`, whose data-race detector and weak-memory
/// emulation check the key-in-lane protocol): two threads hit and free on two streams with the
/// same home slot (the second found by the hot path off its home), while a third releases
/// their slots and a new stream of that home takes one, so a slot's key changes under a
/// thread that found it.
#[test]
fn a_slot_found_off_home_and_taken_over_meanwhile_serves_only_its_own_stream() {
    let recording = Recording::default();
    let cache = CachingResource::with_max_cached(recording.clone(), 1 << 20);
    let first = fake_stream(0);
    let same_home =
        |from: usize| (from..).map(fake_stream).find(|s| home(s) == home(&first)).expect("a stream with the same home");
    let second = same_home(1);
    let rounds = if cfg!(miri) { 12 } else { 2000 };
    std::thread::scope(|scope| {
        for stream in [&first, &second] {
            let (cache, recording) = (&cache, &recording);
            scope.spawn(move || {
                for _ in 0..rounds {
                    let ptrs = [(); 3].map(|()| cache.allocate(4096, 256, stream).unwrap());
                    for ptr in ptrs {
                        recording.handed_out(ptr, stream);
                    }
                    for ptr in ptrs {
                        recording.freeing(ptr, stream);
                        // SAFETY: allocated above with these arguments, freed once.
                        unsafe { cache.deallocate(ptr, 4096, 256, stream) }.unwrap();
                    }
                }
            });
        }
        let (cache, recording, first) = (&cache, &recording, &first);
        scope.spawn(move || {
            for round in 0..rounds {
                let _ = cache.release_stream(first);
                // A newcomer of the same home takes the slot just released, then goes.
                let newcomer = same_home(1000 + round);
                let ptr = cache.allocate(4096, 256, &newcomer).unwrap();
                recording.handed_out(ptr, &newcomer);
                recording.freeing(ptr, &newcomer);
                // SAFETY: allocated just above with these arguments, freed once.
                unsafe { cache.deallocate(ptr, 4096, 256, &newcomer) }.unwrap();
                let _ = cache.release_stream(&newcomer);
            }
        });
    });
    drop(cache);
    let ledger = recording.ledger.lock().unwrap();
    assert!(ledger.faults.is_empty(), "{:#?}", &ledger.faults[..ledger.faults.len().min(10)]);
    assert!(ledger.freed_on.is_empty(), "blocks the cache never gave back: {}", ledger.freed_on.len());
}
