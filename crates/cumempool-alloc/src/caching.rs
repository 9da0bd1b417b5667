//! A cache of freed blocks per stream and size class on top of any resource.
//!
//! CUDA's pools serialise inside the driver: one pool gives about 1.5 M allocation+free pairs
//! per second on one thread and less in total on many. This cache answers repeated pairs on a
//! stream without the driver, and threads on different streams rarely meet on a lock.
//!
//! Stream order stays correct because a cached block is only ever handed out again on the
//! stream it was freed on (work on one stream runs in order), or given back to the resource
//! below with a free on that same stream. It never moves to another stream by itself.

use crate::error::Result;
use crate::resource::{check_alignment, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool::sys::CUdeviceptr;
use cumempool::Stream;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};

const SHARDS: usize = 64;
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
struct Padded<T>(T);

#[derive(Default)]
struct Shard {
    streams: Vec<StreamCache>,
    /// Budget this shard has claimed from the global bound and not yet filled with blocks.
    budget: usize,
    hits: u64,
    misses: u64,
}

struct StreamCache {
    stream: Stream,
    /// Free blocks by size class, all freed on `stream`.
    blocks: Vec<Vec<CUdeviceptr>>,
    cached_bytes: usize,
}

impl StreamCache {
    fn new(stream: &Stream) -> Self {
        Self { stream: stream.clone(), blocks: vec![Vec::new(); CLASSES], cached_bytes: 0 }
    }
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
///   bypass the cache.
/// - The bound counts cached bytes; budget is claimed from it in chunks, so the hot path
///   touches only one shard's lock. Once warm, a cached pair allocates no heap memory.
/// - If the resource below runs out of memory, the cache gives back what it holds and retries
///   once.
pub struct CachingResource<R: StreamOrderedResource> {
    inner: R,
    shards: Box<[Padded<Mutex<Shard>>]>,
    /// Bytes of the bound no shard has claimed.
    unclaimed: AtomicUsize,
    max_cached: usize,
    chunk: usize,
}

impl<R: StreamOrderedResource> std::fmt::Debug for CachingResource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingResource").field("max_cached", &self.max_cached).field("stats", &self.stats()).finish()
    }
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
        let shards = (0..SHARDS).map(|_| Padded(Mutex::new(Shard::default()))).collect();
        let chunk = (max_cached / SHARDS).max(1 << 20).min(max_cached);
        Self { inner, shards, unclaimed: AtomicUsize::new(max_cached), max_cached, chunk }
    }

    /// The resource below.
    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// The bound on cached bytes.
    pub fn max_cached(&self) -> usize {
        self.max_cached
    }

    #[inline]
    fn shard(&self, stream: &Stream) -> MutexGuard<'_, Shard> {
        let key = (stream.as_raw() as usize as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let index = (key >> 58) as usize % SHARDS;
        // A panic while holding a shard cannot leave it inconsistent: every update is local.
        self.shards[index].0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `bytes` of budget for a shard; false when the bound is reached.
    fn claim(&self, shard: &mut Shard, bytes: usize) -> bool {
        if shard.budget < bytes {
            let need = bytes - shard.budget;
            let take =
                |amount: usize| self.unclaimed.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(amount)).is_ok();
            let chunk = need.max(self.chunk);
            if take(chunk) {
                shard.budget += chunk;
            } else if take(need) {
                shard.budget += need;
            } else {
                return false;
            }
        }
        shard.budget -= bytes;
        true
    }

    /// Counters, summed over all shards.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats::default();
        for shard in self.shards.iter() {
            let shard = shard.0.lock().unwrap_or_else(PoisonError::into_inner);
            stats.hits += shard.hits;
            stats.misses += shard.misses;
            for cache in &shard.streams {
                stats.cached_bytes += cache.cached_bytes;
                stats.cached_blocks += cache.blocks.iter().map(Vec::len).sum::<usize>();
                stats.streams += 1;
            }
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
        for shard in self.shards.iter() {
            let mut shard = shard.0.lock().unwrap_or_else(PoisonError::into_inner);
            let mut i = 0;
            while i < shard.streams.len() {
                if which(&shard.streams[i].stream) {
                    taken.push(shard.streams.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            let budget = std::mem::take(&mut shard.budget);
            self.unclaimed.fetch_add(budget, Relaxed);
        }
        let mut first_error = None;
        for cache in taken {
            for (index, blocks) in cache.blocks.iter().enumerate() {
                let bytes = class_bytes(index);
                for ptr in blocks {
                    // SAFETY: each block came from `inner` with the class size and was freed by
                    // its user on `cache.stream`; it is given back once, on that stream.
                    if let Err(error) = unsafe { self.inner.deallocate(*ptr, bytes, POOL_ALIGNMENT, &cache.stream) } {
                        first_error.get_or_insert(error);
                    }
                }
            }
            self.unclaimed.fetch_add(cache.cached_bytes, Relaxed);
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
        {
            let mut guard = self.shard(stream);
            let shard = &mut *guard;
            let raw = stream.as_raw();
            if let Some(cache) = shard.streams.iter_mut().find(|c| c.stream.as_raw() == raw) {
                if let Some(ptr) = cache.blocks[index].pop() {
                    cache.cached_bytes -= class;
                    shard.budget += class;
                    shard.hits += 1;
                    return Ok(ptr);
                }
            }
            shard.misses += 1;
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
        {
            let mut guard = self.shard(stream);
            let shard = &mut *guard;
            if self.claim(shard, class) {
                let raw = stream.as_raw();
                let position = shard.streams.iter().position(|c| c.stream.as_raw() == raw);
                let cache = match position {
                    Some(i) => &mut shard.streams[i],
                    None => {
                        shard.streams.push(StreamCache::new(stream));
                        let last = shard.streams.len() - 1;
                        &mut shard.streams[last]
                    }
                };
                cache.blocks[index].push(ptr);
                cache.cached_bytes += class;
                return Ok(());
            }
        }
        // SAFETY: the block came from `inner` with the class size; the cache is full, so it
        // goes back below, on the stream its user freed it on.
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
