//! Its own process: the lane numbers its threads hand on would go to other tests' threads.
//!
//! The hot path enters the lane of a stream's home slot before it checks the slot's key, and a
//! thread's lane number (with the blocks and budget its lanes hold) passes to the next thread
//! when it exits. Checked together here: short-lived threads on streams that share one home
//! slot, while slots are released and taken over by new streams of that home. No block may go
//! to two users at once or to a stream other than the one it was freed on, every block must go
//! back below on its stream, and once everything is released the whole bound must be free
//! again (no budget lost in a lane of an exited thread or a released slot).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use cumempool_alloc::{CachingResource, HostHeap, Result, StreamOrderedResource};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use support::fake_stream;

/// Each block's user state: `None` while a user holds it, `Some(stream id)` once its user
/// freed it on that stream; absent for a block below.
type Blocks = HashMap<CUdeviceptr, Option<u64>>;

/// The host heap, checking what the cache gives back below against the blocks' frees.
#[derive(Default)]
struct Checked {
    blocks: Mutex<Blocks>,
    faults: Mutex<Vec<String>>,
}

impl Checked {
    fn fault(&self, fault: String) {
        self.faults.lock().unwrap().push(fault);
    }

    /// `ptrs` handed to a user on `stream`, then freed there.
    fn used(&self, ptrs: &[CUdeviceptr], stream: &Stream) {
        let id = stream.id().get();
        let mut blocks = self.blocks.lock().unwrap();
        for &ptr in ptrs {
            match blocks.insert(ptr, None) {
                Some(None) => self.fault(format!("{ptr:#x} handed to two users at once")),
                Some(Some(on)) if on != id => self.fault(format!("{ptr:#x} freed on stream {on} served stream {id}")),
                _ => {}
            }
        }
        for &ptr in ptrs {
            blocks.insert(ptr, Some(id));
        }
    }
}

// SAFETY: forwards to the host heap, which keeps the trait's promise.
unsafe impl StreamOrderedResource for &Checked {
    type Kind = <HostHeap as StreamOrderedResource>::Kind;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        HostHeap.allocate(bytes, align, stream)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        // Forgotten before the heap may hand the address out again.
        match self.blocks.lock().unwrap().remove(&ptr) {
            Some(Some(on)) if on == stream.id().get() => {}
            other => self.fault(format!("{ptr:#x} went below on stream {} as {other:?}", stream.id().get())),
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

/// A small xorshift generator: the test needs no crate for it.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The cache's home slot of a stream (the same hash as the cache's `home_of`).
fn home(stream: &Stream) -> u64 {
    (stream.id().get().wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) % 256
}

#[test]
fn short_lived_threads_on_streams_of_one_home_keep_every_block_on_its_stream_and_the_bound_whole() {
    let checked = Checked::default();
    let block = 64 << 10;
    let max = 8 * block;
    let cache = CachingResource::with_max_cached(&checked, max);
    let first = fake_stream(0);
    // Every stream made has a new id, so one of the next few has the same home.
    let same_home = || (1..).map(fake_stream).find(|s| home(s) == home(&first)).expect("a stream");
    let streams = [Mutex::new(first.clone()), Mutex::new(same_home()), Mutex::new(same_home())];
    let stop = AtomicBool::new(false);
    let sizes = [256, 4096, 20 << 10, block];
    std::thread::scope(|scope| {
        for worker in 0..6u64 {
            let (cache, checked, streams, stop) = (&cache, &checked, &streams, &stop);
            scope.spawn(move || {
                let mut seed = 0x9E37_79B9_7F4A_7C15 ^ (worker + 1);
                while !stop.load(Relaxed) {
                    // A thread of its own for a few rounds: lane numbers change hands all the time.
                    let mut seed = next(&mut seed);
                    std::thread::scope(|inner| {
                        inner.spawn(move || {
                            for _ in 0..50 {
                                let stream = streams[(next(&mut seed) % 3) as usize].lock().unwrap().clone();
                                let bytes = sizes[(next(&mut seed) % 4) as usize];
                                let count = 1 + next(&mut seed) % 6;
                                let ptrs: Vec<CUdeviceptr> =
                                    (0..count).map(|_| cache.allocate(bytes, 256, &stream).unwrap()).collect();
                                checked.used(&ptrs, &stream);
                                for ptr in ptrs {
                                    // SAFETY: allocated above with these arguments, freed once.
                                    unsafe { cache.deallocate(ptr, bytes, 256, &stream) }.unwrap();
                                }
                            }
                        });
                    });
                }
            });
        }
        let (cache, streams, stop) = (&cache, &streams, &stop);
        scope.spawn(move || {
            let mut seed = 0x1234_5678;
            let start = std::time::Instant::now();
            while start.elapsed() < std::time::Duration::from_secs(3) {
                let pick = (next(&mut seed) % 3) as usize;
                let stream = streams[pick].lock().unwrap().clone();
                // Lanes may be unreachable for a moment; what matters is what comes back.
                let _ = cache.release_stream(&stream);
                if next(&mut seed).is_multiple_of(2) {
                    // A new stream of the same home, which may take the slot just released.
                    *streams[pick].lock().unwrap() = same_home();
                }
                if next(&mut seed).is_multiple_of(8) {
                    assert!(cache.stats().cached_bytes <= max);
                }
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            stop.store(true, Relaxed);
        });
    });
    cache.release().unwrap();
    // The whole bound is free again: a new stream caches `max` bytes, none of its frees going
    // below for want of budget.
    let fresh = same_home();
    let ptrs: Vec<CUdeviceptr> = (0..8).map(|_| cache.allocate(block, 256, &fresh).unwrap()).collect();
    checked.used(&ptrs, &fresh);
    for ptr in ptrs {
        // SAFETY: allocated just above with these arguments, freed once.
        unsafe { cache.deallocate(ptr, block, 256, &fresh) }.unwrap();
    }
    assert_eq!(cache.stats().cached_bytes, max, "budget was lost");
    drop(cache);
    let faults = checked.faults.lock().unwrap();
    assert!(faults.is_empty(), "{} faults, first: {:#?}", faults.len(), &faults[..faults.len().min(10)]);
    assert!(checked.blocks.lock().unwrap().is_empty(), "blocks the cache never gave back");
}
