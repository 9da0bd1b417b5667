//! The bound counts cached bytes exactly, whatever the cache is asked: random allocations and
//! frees of several size classes on several streams (some freed on another stream than they
//! were allocated on), releases, budget sweeps, gathers into the shared lists and stats, with a
//! bound small enough to force evictions, on one thread and on many (more than there are lanes,
//! and short-lived, so lanes pass to new threads with what they reserved). After each step on
//! one thread, and after each round on many, the bytes claimed from the bound are exactly what
//! the slots and lanes hold: budgets, shared blocks, and each lane's reserved blocks, with
//! `counts <= reserved <= DEPTH` in every lane.

use super::cache::CachingResource;
use super::lane_number::TEST_LANE_NUMBERS;
use super::lock::lock;
use super::size_class::class_bytes;
use super::slot::{gather_from_lanes, lanes_of, SLOTS};
use crate::{HostHeap, StreamOrderedResource};
use cumempool::Stream;

/// xorshift64: the same steps for the same seed.
struct Steps(u64);

impl Steps {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Asserts that the bytes claimed from the bound are what the slots and lanes account for.
fn assert_exact(cache: &CachingResource<HostHeap>) {
    let indices: Vec<usize> = (0..SLOTS).collect();
    let (states, lanes) = cache.table.lock_with_lanes(&indices, true);
    let mut lanes = lanes.expect("lanes claimed");
    let mut claimed = 0;
    for (group, state) in states.iter().enumerate() {
        let listed: usize = state.blocks.iter().enumerate().map(|(index, list)| list.len() * class_bytes(index)).sum();
        assert_eq!(listed, state.cached_bytes, "a slot's shared lists against its count");
        claimed += state.budget + state.cached_bytes;
        claimed += lanes.group(group).map(|lane| lane.claimed_bytes()).sum::<usize>();
    }
    assert_eq!(claimed, cache.bound.max() - cache.bound.unclaimed(), "the bound is not exact");
}

fn fake_stream(raw: usize) -> Stream {
    // SAFETY: HostHeap ignores streams, so the handle is never used.
    unsafe { Stream::borrow_raw(raw as cumempool::sys::CUstream, None) }.expect("a fake stream")
}

const SIZES: [usize; 6] = [256, 1000, 64 << 10, 100 << 10, 1 << 20, 3 << 20];

/// `steps` random steps on `cache`; checks the bound after each when `check_each`.
fn random_steps(cache: &CachingResource<HostHeap>, streams: &[Stream], seed: u64, steps: usize, check_each: bool) {
    let mut next = Steps(seed | 1);
    let mut out: Vec<(u64, usize, usize)> = Vec::new();
    for _ in 0..steps {
        match next.below(100) {
            0..=44 => {
                let (bytes, on) = (SIZES[next.below(SIZES.len())], next.below(streams.len()));
                out.push((cache.allocate(bytes, 256, &streams[on]).expect("host memory"), bytes, on));
            }
            45..=89 if !out.is_empty() => {
                let (ptr, bytes, on) = out.swap_remove(next.below(out.len()));
                // Now and then on another stream: ordered there by the caller, as the contract allows.
                let on = if next.below(10) == 0 { next.below(streams.len()) } else { on };
                // SAFETY: allocated above with these arguments, freed once.
                unsafe { cache.deallocate(ptr, bytes, 256, &streams[on]) }.expect("freed");
            }
            90..=92 => cache.release_stream(&streams[next.below(streams.len())]).expect("released"),
            93 => cache.release().expect("released"),
            94..=95 => cache.return_unfilled_budgets_now(),
            96..=97 => {
                if let Some(index) = cache.table.find(streams[next.below(streams.len())].id().get()) {
                    let slot = &cache.table.slots[index];
                    gather_from_lanes(lanes_of(slot), cache.table.made_in, &mut lock(&slot.state));
                }
            }
            _ => assert!(cache.stats().cached_bytes <= cache.bound.max()),
        }
        if check_each {
            assert_exact(cache);
        }
    }
    for (ptr, bytes, on) in out {
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { cache.deallocate(ptr, bytes, 256, &streams[on]) }.expect("freed");
    }
}

/// After `cache` was used: exact, and whole once released.
fn assert_whole_after_release(cache: &CachingResource<HostHeap>) {
    assert_exact(cache);
    cache.release().expect("released");
    assert_exact(cache);
    assert_eq!(cache.stats().cached_bytes, 0);
    assert_eq!(cache.bound.unclaimed(), cache.bound.max(), "bytes lost or counted twice");
}

/// Under Miri, a few steps: each check claims every lane of 256 slots.
const fn scaled(native: usize, miri: usize) -> usize {
    if cfg!(miri) {
        miri
    } else {
        native
    }
}

#[test]
fn on_one_thread_after_every_step() {
    let _numbers = lock(&TEST_LANE_NUMBERS);
    for seed in 1..=scaled(10, 1) as u64 {
        let cache = CachingResource::with_max_cached(HostHeap, 6 << 20);
        let streams: Vec<Stream> = (0..3).map(|i| fake_stream(0x7000 + i)).collect();
        random_steps(&cache, &streams, seed * 7919, scaled(1000, 15), true);
        assert_whole_after_release(&cache);
    }
}

#[test]
fn on_four_threads_sharing_streams() {
    let _numbers = lock(&TEST_LANE_NUMBERS);
    for seed in 1..=scaled(3, 1) as u64 {
        let cache = CachingResource::with_max_cached(HostHeap, 6 << 20);
        let streams: Vec<Stream> = (0..3).map(|i| fake_stream(0x7100 + i)).collect();
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let (cache, streams) = (&cache, &streams);
                scope.spawn(move || {
                    random_steps(cache, streams, seed * 1_000_003 + thread * 31, scaled(4000, 10), false)
                });
            }
        });
        assert_whole_after_release(&cache);
    }
}

/// Waves of short-lived threads: their lanes, with what they reserved, pass to the next wave's
/// threads; every other wave has more threads than there are lanes.
#[test]
fn over_waves_of_short_lived_threads() {
    let _numbers = lock(&TEST_LANE_NUMBERS);
    let cache = CachingResource::with_max_cached(HostHeap, 3 << 20);
    let streams: Vec<Stream> = (0..4).map(|i| fake_stream(0x7200 + i)).collect();
    for wave in 0..scaled(6, 1) as u64 {
        let threads = if wave % 2 == 0 { scaled(8, 2) } else { scaled(70, 3) } as u64;
        std::thread::scope(|scope| {
            for thread in 0..threads {
                let (cache, streams) = (&cache, &streams);
                scope.spawn(move || random_steps(cache, streams, wave * 7777 + thread * 13 + 5, scaled(300, 6), false));
            }
        });
        assert_exact(&cache);
    }
    assert_whole_after_release(&cache);
}
