//! A cache of freed blocks per stream and size class on top of any resource.
//!
//! CUDA's pools serialise inside the driver: one pool gives about 1.5 M allocation+free pairs
//! per second on one thread and less in total on many. This cache answers repeated pairs on a
//! stream without the driver. Each stream has its own slot and lock, found without taking any
//! shared lock, so threads on different streams never wait for each other.
//!
//! Stream order stays correct because a cached block is only ever handed out again on the
//! stream it was freed on (work on one stream runs in order), or given back to the resource
//! below with a free on that same stream. It never moves to another stream by itself.

use crate::error::Result;
use crate::resource::{check_alignment, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{
    AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Streams a cache serves at once; allocations on further streams go straight to the resource below.
const SLOTS: usize = 256;
const EMPTY: usize = 0;
/// A slot whose stream was released: lookups probe past it, registrations may take it.
const RELEASED: usize = usize::MAX;

const MIN_SHIFT: u32 = 8;
const MAX_SHIFT: u32 = 40;
const STEPS: u32 = 4;
/// Size classes: 256 B, then four per power of two up to 1 TiB; larger requests bypass the cache.
const CLASSES: usize = 1 + ((MAX_SHIFT - MIN_SHIFT) * STEPS) as usize;

/// The size class of a request: (index, bytes), with at most 25% rounding above 256 B.
pub(crate) fn size_class(bytes: usize) -> Option<(usize, usize)> {
    if bytes <= 1 << MIN_SHIFT {
        return Some((0, 1 << MIN_SHIFT));
    }
    let below = bytes as u64 - 1;
    let log = 63 - below.leading_zeros();
    if log >= MAX_SHIFT {
        return None;
    }
    let shift = log - 2;
    let step = (below >> shift) + 1; // 5..=8
    let index = 1 + (log - MIN_SHIFT) * STEPS + (step as u32 - 5);
    Some((index as usize, (step << shift) as usize))
}

/// The bytes of size class `index`.
pub(crate) fn class_bytes(index: usize) -> usize {
    if index == 0 {
        return 1 << MIN_SHIFT;
    }
    let i = index as u32 - 1;
    let log = MIN_SHIFT + i / STEPS;
    (((5 + i % STEPS) as u64) << (log - 2)) as usize
}

#[repr(align(128))]
struct Slot {
    /// `EMPTY`, `RELEASED`, or the stream's key (its handle plus one, so the null stream fits).
    key: AtomicUsize,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// The stream (kept alive while blocks are cached for it).
    stream: Option<Stream>,
    /// Free blocks by size class, all freed on `stream`.
    blocks: Vec<Vec<CUdeviceptr>>,
    cached_bytes: usize,
    /// Budget this slot has claimed from the global bound and not yet filled with blocks.
    budget: usize,
    hits: u64,
    misses: u64,
}

fn key_of(stream: &Stream) -> usize {
    (stream.as_raw() as usize).wrapping_add(1)
}

fn home_of(key: usize) -> usize {
    ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % SLOTS
}

/// Counters of a [`CachingResource`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Allocations answered from the cache.
    pub hits: u64,
    /// Allocations that went to the resource below.
    pub misses: u64,
    /// Bytes held in cached blocks.
    pub cached_bytes: usize,
    /// Cached blocks.
    pub cached_blocks: usize,
    /// Streams with a cache.
    pub streams: usize,
}

impl CacheStats {
    /// Hits over all allocations (0 before any).
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// Keeps freed blocks per stream and size class, bounded in bytes.
///
/// - A block freed on stream `s` is reused only by allocations on `s`, or freed to the
///   resource below on `s` when the cache is full or released.
/// - Requests are rounded up to a size class (at most 25% above 256 B); requests over 1 TiB
///   bypass the cache, and so do streams beyond the first 256 that free blocks into it.
/// - Each stream has its own slot and lock; the bound counts cached bytes and is claimed in
///   chunks, so the hot path touches no shared lock or counter. Once warm, a cached pair
///   allocates no heap memory.
/// - If the resource below runs out of memory, the cache gives back what it holds and retries
///   once.
pub struct CachingResource<R: StreamOrderedResource> {
    inner: R,
    slots: Box<[Slot]>,
    /// Bytes of the bound no slot has claimed.
    unclaimed: AtomicUsize,
    /// Misses of streams that found no free slot.
    overflow_misses: AtomicU64,
    max_cached: usize,
    chunk: usize,
}

impl<R: StreamOrderedResource> std::fmt::Debug for CachingResource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingResource").field("max_cached", &self.max_cached).field("stats", &self.stats()).finish()
    }
}

fn lock(slot: &Slot) -> MutexGuard<'_, SlotState> {
    // A panic while holding a slot cannot leave it inconsistent: every update is local.
    slot.state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<R: StreamOrderedResource> CachingResource<R> {
    /// The default bound: 1 GiB of cached blocks.
    pub const DEFAULT_MAX_CACHED: usize = 1 << 30;

    /// A cache over `inner` holding at most [`Self::DEFAULT_MAX_CACHED`] bytes.
    pub fn new(inner: R) -> Self {
        Self::with_max_cached(inner, Self::DEFAULT_MAX_CACHED)
    }

    /// A cache over `inner` holding at most `max_cached` bytes of free blocks.
    pub fn with_max_cached(inner: R, max_cached: usize) -> Self {
        let slots = (0..SLOTS)
            .map(|_| Slot { key: AtomicUsize::new(EMPTY), state: Mutex::new(SlotState::default()) })
            .collect();
        // Small enough that every slot can hold some budget at once; large enough that a
        // stream's steady allocate/free pairs never touch the shared counter.
        let chunk = (max_cached / (4 * SLOTS)).max(64 << 10).min(max_cached);
        Self {
            inner,
            slots,
            unclaimed: AtomicUsize::new(max_cached),
            overflow_misses: AtomicU64::new(0),
            max_cached,
            chunk,
        }
    }

    /// The resource below.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// The bound on cached bytes.
    pub fn max_cached(&self) -> usize {
        self.max_cached
    }

    /// The slot of the stream with `key`, if it has one.
    #[inline]
    fn find(&self, key: usize) -> Option<&Slot> {
        let home = home_of(key);
        for i in 0..SLOTS {
            let slot = &self.slots[(home + i) % SLOTS];
            match slot.key.load(Acquire) {
                k if k == key => return Some(slot),
                EMPTY => return None,
                _ => {}
            }
        }
        None
    }

    /// The stream's slot, taking a free one if it has none; `None` when all are taken.
    fn find_or_register(&self, key: usize) -> Option<&Slot> {
        if let Some(slot) = self.find(key) {
            return Some(slot);
        }
        let home = home_of(key);
        for i in 0..SLOTS {
            let slot = &self.slots[(home + i) % SLOTS];
            let current = slot.key.load(Acquire);
            if (current == EMPTY || current == RELEASED)
                && slot.key.compare_exchange(current, key, AcqRel, Acquire).is_ok()
            {
                return Some(slot);
            }
            if slot.key.load(Acquire) == key {
                return Some(slot);
            }
        }
        None
    }

    /// Takes `bytes` of budget for a slot; false when the bound is reached.
    fn claim(&self, state: &mut SlotState, bytes: usize) -> bool {
        if state.budget < bytes {
            let need = bytes - state.budget;
            let take =
                |amount: usize| self.unclaimed.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(amount)).is_ok();
            let chunk = need.max(self.chunk);
            if take(chunk) {
                state.budget += chunk;
            } else if take(need) {
                state.budget += need;
            } else {
                return false;
            }
        }
        state.budget -= bytes;
        true
    }

    /// Counters, summed over all streams.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats { misses: self.overflow_misses.load(Relaxed), ..CacheStats::default() };
        for slot in self.slots.iter() {
            let state = lock(slot);
            stats.hits += state.hits;
            stats.misses += state.misses;
            stats.cached_bytes += state.cached_bytes;
            stats.cached_blocks += state.blocks.iter().map(Vec::len).sum::<usize>();
            stats.streams += usize::from(state.stream.is_some());
        }
        stats
    }

    /// Frees every cached block to the resource below (each on the stream it was freed on).
    pub fn release(&self) -> Result<()> {
        self.release_where(|_| true)
    }

    /// Frees the blocks cached for `stream` to the resource below, and lets go of the stream.
    pub fn release_stream(&self, stream: &Stream) -> Result<()> {
        self.release_where(|s| s.same_as(stream))
    }

    fn release_where(&self, mut which: impl FnMut(&Stream) -> bool) -> Result<()> {
        let mut taken = Vec::new();
        for slot in self.slots.iter() {
            let mut state = lock(slot);
            let Some(stream) = state.stream.as_ref() else { continue };
            if !which(stream) {
                continue;
            }
            let blocks = std::mem::take(&mut state.blocks);
            let stream = state.stream.take();
            self.unclaimed
                .fetch_add(std::mem::take(&mut state.budget) + std::mem::take(&mut state.cached_bytes), Relaxed);
            // Under the slot's lock, so a thread that found the old key sees the change.
            slot.key.store(RELEASED, Release);
            drop(state);
            if let Some(stream) = stream {
                taken.push((stream, blocks));
            }
        }
        let mut first_error = None;
        for (stream, blocks) in taken {
            for (index, list) in blocks.iter().enumerate() {
                let bytes = class_bytes(index);
                for ptr in list {
                    // SAFETY: each block came from `inner` with the class size and was freed by
                    // its user on `stream`; it is given back once, on that stream.
                    if let Err(error) = unsafe { self.inner.deallocate(*ptr, bytes, POOL_ALIGNMENT, &stream) } {
                        first_error.get_or_insert(error);
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl<R: StreamOrderedResource> StreamOrderedResource for CachingResource<R> {
    type Kind = R::Kind;

    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        check_alignment(align)?;
        if bytes == 0 {
            return Ok(0);
        }
        let Some((index, class)) = size_class(bytes) else {
            return self.inner.allocate(bytes, align, stream);
        };
        let key = key_of(stream);
        match self.find(key) {
            Some(slot) => {
                let mut state = lock(slot);
                if slot.key.load(Acquire) == key {
                    if let Some(ptr) = state.blocks.get_mut(index).and_then(Vec::pop) {
                        state.cached_bytes -= class;
                        state.budget += class;
                        state.hits += 1;
                        return Ok(ptr);
                    }
                    state.misses += 1;
                } else {
                    self.overflow_misses.fetch_add(1, Relaxed);
                }
            }
            None => {
                self.overflow_misses.fetch_add(1, Relaxed);
            }
        }
        match self.inner.allocate(class, align, stream) {
            Err(crate::Error::Pool(cumempool::Error::OutOfMemory { .. })) if self.stats().cached_blocks > 0 => {
                self.release()?;
                self.inner.allocate(class, align, stream)
            }
            other => other,
        }
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, align: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let Some((index, class)) = size_class(bytes) else {
            // SAFETY: a bypassing block came from `inner` with these arguments.
            return unsafe { self.inner.deallocate(ptr, bytes, align, stream) };
        };
        let key = key_of(stream);
        if let Some(slot) = self.find_or_register(key) {
            let mut state = lock(slot);
            if slot.key.load(Acquire) == key && self.claim(&mut state, class) {
                if state.stream.is_none() {
                    state.stream = Some(stream.clone());
                }
                if state.blocks.is_empty() {
                    state.blocks = vec![Vec::new(); CLASSES];
                }
                state.blocks[index].push(ptr);
                state.cached_bytes += class;
                return Ok(());
            }
        }
        // SAFETY: the block came from `inner` with the class size; the cache is full (or has no
        // slot for this stream), so it goes back below, on the stream its user freed it on.
        unsafe { self.inner.deallocate(ptr, class, align, stream) }
    }
}

impl<R: StreamOrderedResource> Drop for CachingResource<R> {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::warn!(%error, "giving cached blocks back failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_cover_every_size_with_little_rounding() {
        let mut last = 0;
        for bytes in (1..70_000).chain([1 << 20, (1 << 20) + 1, 3 << 30, (1 << 40) - 1]) {
            let (index, class) = size_class(bytes).expect("in range");
            assert!(class >= bytes, "{bytes} -> {class}");
            assert!(bytes <= 256 || class as f64 <= bytes as f64 * 1.25 + 1.0, "{bytes} -> {class}");
            assert_eq!(class_bytes(index), class, "index {index}");
            assert!(index < CLASSES && index >= last.min(index));
            last = index;
        }
        assert_eq!(size_class(1 << 40), Some((CLASSES - 1, 1 << 40)));
        assert_eq!(size_class((1 << 40) + 1), None);
        assert_eq!(size_class(257), Some((1, 320)));
        assert_eq!(size_class(512), Some((4, 512)));
        assert_eq!(size_class(513), Some((5, 640)));
    }
}
