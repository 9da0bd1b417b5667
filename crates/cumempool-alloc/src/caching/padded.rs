//! Values on cache lines of their own.

/// `T` on cache lines of its own: 128 bytes, the pair of 64-byte lines that Intel's spatial
/// prefetcher fetches together. For what slow paths write (locks, counters, timers): their
/// writes must not evict the line of the fields every hot path of every thread reads.
#[derive(Default)]
#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    #[inline(always)]
    fn deref(&self) -> &T {
        &self.0
    }
}
