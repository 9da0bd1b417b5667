//! Blocks a cache handed out while their stream was capturing: graph memory, never cached,
//! given back below as they were asked for, whenever and on whatever stream they are freed.

use super::lock::lock;
use cumempool::sys::CUdeviceptr;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// The blocks handed out during captures, by address, each with how many such blocks live
/// there.
#[derive(Default)]
pub(super) struct CapturedBlocks {
    blocks: Mutex<HashMap<CUdeviceptr, usize>>,
    /// How many blocks `blocks` counts, changed under its lock: the free's hot path reads it
    /// (one relaxed load) and consults `blocks` only when it is not 0. A thread freeing such a
    /// block got it, through whatever handed it over, after its count was added, and only its
    /// own free takes that count away, so it cannot read 0 here.
    count: AtomicUsize,
}

impl CapturedBlocks {
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
    }

    /// Takes `ptr` out of the blocks handed out during a capture; false if it is not one.
    pub(super) fn forget(&self, ptr: CUdeviceptr) -> bool {
        let mut blocks = lock(&self.blocks);
        let Some(count) = blocks.get_mut(&ptr) else { return false };
        *count -= 1;
        if *count == 0 {
            blocks.remove(&ptr);
        }
        self.count.fetch_sub(1, Relaxed);
        true
    }
}
