//! Graph memory in the GPU tests: a raw allocation a capture keeps past its end (what cudarc
//! kernels using a `CachingResource` or `PoolResource` under `begin_capture` leave), and the
//! device's graph memory in use before and after, to show that none of it leaked.
#![allow(clippy::unwrap_used)]

use crate::graph_memory_lock;
use cumempool::sys::CUdeviceptr;
use cumempool::{Capture, Device, Graph, MemPool, Stream};
use std::sync::MutexGuard;

/// Where a graph's kept allocation comes in the capture.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Before the closure's work: the kept allocation gets an address of its own.
    First,
    /// After it: where the closure allocated and freed, the driver (580) gives the kept
    /// allocation the address it freed.
    Last,
}

/// A graph captured on `stream` that allocates `bytes` from `pool` through the raw API and does
/// not free them, before or after running `work` ([`Kept`]); with that allocation's address.
/// Each launch allocates it again, and it must be freed outside the graph, once, after the
/// launch.
pub fn capture_a_kept_allocation<'p>(
    stream: &Stream,
    pool: &'p MemPool,
    bytes: usize,
    kept_at: Kept,
    work: impl FnOnce(&Capture<'p>) -> cumempool::Result<()>,
) -> (Graph<'p>, CUdeviceptr) {
    let kept = std::cell::Cell::new(0);
    let graph = stream
        .capture(|capture| {
            if kept_at == Kept::First {
                kept.set(pool.alloc_raw(bytes, capture.stream())?);
            }
            work(capture)?;
            if kept_at == Kept::Last {
                kept.set(pool.alloc_raw(bytes, capture.stream())?);
            }
            Ok(())
        })
        .unwrap();
    (graph, kept.get())
}

/// Device 0's graph memory in use when the test began, held with the graph-memory lock: graph
/// memory is per device, so no other test of the binary that launches graph allocations or
/// measures graph memory runs meanwhile.
pub struct GraphMemoryBaseline {
    _lock: MutexGuard<'static, ()>,
    device: Device,
    used_before: u64,
}

impl GraphMemoryBaseline {
    /// Takes the lock, waits for `stream`'s work, and reads device 0's graph memory in use.
    pub fn take(stream: &Stream) -> Self {
        let lock = graph_memory_lock();
        let device = Device::get(0).unwrap();
        stream.synchronize().unwrap();
        let used_before = device.graph_memory().unwrap().used_current;
        Self { _lock: lock, device, used_before }
    }

    /// Asserts that, once `stream`'s work is done and the device's unused graph memory trimmed,
    /// no more is in use than at [`take`](Self::take). Other tests of the binary may hold graph
    /// memory of their own (counted in whole chunks, 32 MiB on an H200): none of the caller's
    /// is left.
    pub fn assert_given_back(&self, stream: &Stream, what: &str) {
        stream.synchronize().unwrap();
        self.device.trim_graph_memory().unwrap();
        let after = self.device.graph_memory().unwrap();
        assert!(after.used_current <= self.used_before, "{what} ({after:?})");
    }
}
