//! What a cache reports about itself.

/// Counters of a [`CachingResource`](crate::CachingResource).
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
