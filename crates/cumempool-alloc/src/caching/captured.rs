//! Blocks a cache handed out while their stream was capturing: graph memory, never cached,
//! given back below as they were asked for, whenever and on whatever stream they are freed.

use super::lanes::{CacheId, FreeGate};
use super::lock::lock;
use cumempool::sys::CUdeviceptr;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// The blocks handed out during captures, by address, each with how many such blocks live
/// there.
pub(super) struct CapturedBlocks {
    blocks: Mutex<HashMap<CUdeviceptr, usize>>,
    /// How many blocks `blocks` counts, changed under its lock: the free's paths beyond the lane
    /// read it (one relaxed load) and consult `blocks` only when it is not 0. A thread freeing
    /// such a block got it, through whatever handed it over, after its count was added, and only
    /// its own free takes that count away, so it cannot read 0 here.
    count: AtomicUsize,
    /// Closed while `count` is not 0, changed under `blocks`' lock with it, so that a free
    /// of such a block, which reads it after the block's count was added (as it reads `count`),
    /// never enters a lane without looking at the block.
    pub(super) gate: FreeGate,
}

impl CapturedBlocks {
    /// None, for the cache with id `cache`.
    pub(super) fn new(cache: &CacheId) -> Self {
        Self { blocks: Mutex::default(), count: AtomicUsize::new(0), gate: FreeGate::new(cache) }
    }

    /// Whether any such block is out: false means the block being freed is none of them.
    #[inline(always)]
    pub(super) fn any(&self) -> bool {
        self.count.load(Relaxed) != 0
    }

    /// Remembers a block handed out during a capture.
    pub(super) fn remember(&self, ptr: CUdeviceptr) {
        let mut blocks = lock(&self.blocks);
        *blocks.entry(ptr).or_default() += 1;
        self.count.fetch_add(1, Relaxed);
        self.gate.close();
    }

    /// Takes `ptr` out of the blocks handed out during a capture; false if it is not one.
    pub(super) fn forget(&self, ptr: CUdeviceptr) -> bool {
        let mut blocks = lock(&self.blocks);
        let Some(count) = blocks.get_mut(&ptr) else { return false };
        *count -= 1;
        if *count == 0 {
            blocks.remove(&ptr);
        }
        if self.count.fetch_sub(1, Relaxed) == 1 {
            self.gate.open();
        }
        true
    }
}
