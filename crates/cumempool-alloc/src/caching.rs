//! A cache of freed blocks per stream and size class on top of any resource.
//!
//! CUDA's pools serialise inside the driver: one pool gives about 1.5 M allocation+free pairs
//! per second on one thread and less in total on many. This cache answers repeated pairs on a
//! stream without the driver. Each stream has its own slot, found without taking any shared
//! lock, and each slot a lane per thread: a few blocks per size class that only that thread
//! enters on the hot path, with plain loads and stores and no read-modify-write (see
//! [`lanes`]), so threads never wait for each other, whether they use streams of their own or
//! share one. A lane's overflow and misses go to the slot's shared lists, under the slot's
//! lock; slow paths take lanes from their owners with one `membarrier` for all they need.
//!
//! The rules that keep it sound and its budget useful:
//!
//! - **Streams by identity.** Slots are keyed by [`Stream::id`](cumempool::Stream::id), never by the raw handle: handle
//!   values can name different streams (the legacy stream of another context, a destroyed
//!   borrowed stream's successor). A cached block is only handed out again on the stream it was
//!   freed on (work on one stream runs in order), or given back below with a free on that same
//!   stream, whose clone the slot keeps alive while it holds blocks. A lane belongs to its
//!   slot: its blocks were freed on the slot's stream, and a thread checks the slot's key inside
//!   the lane, which a slot given up changes before it claims its lanes to empty them.
//! - **One alignment below.** Size-class blocks are always allocated from the resource below
//!   with [`POOL_ALIGNMENT`](crate::POOL_ALIGNMENT) and always given back with exactly (class bytes, `POOL_ALIGNMENT`),
//!   on every path: a hit, a free that does not fit, eviction, release. Every alignment a request
//!   may ask for is at most `POOL_ALIGNMENT`, so any cached block serves any request. Requests too
//!   large for a class bypass the cache with their own (bytes, align) both ways.
//! - **Slots only for cached blocks.** A stream takes a slot when a block is cached for it, not
//!   for a free that goes straight below.
//! - **Reclaim, then evict.** When the bound is reached or no slot is free, slots whose stream
//!   only the cache still holds ([`Stream::handle_count`](cumempool::Stream::handle_count) is 1) give their blocks back below on
//!   that stream and drop it; if that is not enough, the least recently used other streams'
//!   slots are evicted the same way before a block is refused. This happens on slow paths only,
//!   under a lock the hot path never takes; before any of it, every slot's unfilled budget, and
//!   at most once a millisecond every lane's, is taken back (that gives up no block). After a scan found no slot to free (more than 256
//!   live streams), streams without a slot free straight below for a while without scanning.
//! - **Every no-memory answer that a release could turn retries.** When the resource below
//!   answers with any error for which [`Error::is_out_of_memory`](crate::Error::is_out_of_memory)
//!   holds (the pool's, a [`Limit`](crate::Limit)'s, the host heap's), the cache gives back what
//!   it holds and retries once, unless it holds nothing or the error shows that no release can
//!   serve the request: larger than a limit or a pool's maximum size, or short of a limit by
//!   more than the cache holds. Then it fails at once, and other streams keep their blocks.
//! - **Nothing crosses a capture boundary.** While a stream is capturing into a CUDA graph, an
//!   allocation on it is never served from the cache (the graph would use the block at every
//!   replay while the cache hands it to others) and a free on it is never cached: both go
//!   straight below, which records them in the capture. A block handed out during a capture is
//!   graph memory: the cache remembers its address until it is freed, and that free, whenever
//!   and on whatever stream, goes below with the size and alignment it was asked with. The
//!   hot path pays for this with no instruction of its own: the stream's key it compares with
//!   the lane's carries the mark that a capture may be underway
//!   ([`StreamOrderedResource::marked_stream_id`](crate::StreamOrderedResource::marked_stream_id)),
//!   and while such blocks are out, the free compares the thread's remembered cache with a gate
//!   that matches none. The driver is asked, and the blocks' set locked, only when those say so.

// Modules in the order they build on each other: each uses only modules listed above it. A
// blank line starts the next layer; rustfmt sorts the modules inside one.
mod bound;
mod fence;
mod lock;
mod padded;
mod size_class;
mod stats;
mod timers;

mod lane_number;

mod lanes;

mod captured;
mod slot;

mod table;

mod eviction;

mod cache;

#[cfg(test)]
mod bound_stays_exact;

pub use cache::CachingResource;
pub use stats::CacheStats;
