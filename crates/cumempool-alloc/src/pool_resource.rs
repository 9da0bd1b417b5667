//! Resources over CUDA pools: one pool, or whichever pool is current for a route.

use crate::error::{Error, Result};
use crate::memory_kind::MemoryKind;
use crate::resource::{check_alignment, StreamOrderedResource};
use cumempool::sys::CUdeviceptr;
use cumempool::{Pool, Route, Stream};
use std::marker::PhantomData;

/// A resource over one pool (owned or borrowed), whose memory kind is checked once, here.
#[derive(Debug)]
pub struct PoolResource<K: MemoryKind> {
    pool: Pool,
    kind: PhantomData<fn() -> K>,
}

impl<K: MemoryKind> Clone for PoolResource<K> {
    fn clone(&self) -> Self {
        Self { pool: self.pool.clone(), kind: PhantomData }
    }
}

impl<K: MemoryKind> PoolResource<K> {
    /// A resource over `pool`, refused with [`Error::KindMismatch`] unless the pool's route
    /// holds memory of kind `K`. Keeps an owned pool alive.
    pub fn new(pool: &Pool) -> Result<Self> {
        let route = Route::new(pool.location()?, pool.allocation_type()?);
        if !K::admits(route) {
            return Err(Error::KindMismatch { route, kind: K::NAME });
        }
        Ok(Self { pool: pool.clone(), kind: PhantomData })
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
}

// SAFETY: memory from cuMemAllocFromPoolAsync of a pool whose route `new` checked against `K`;
// pool allocations are 256-byte aligned and `check_alignment` refuses more.
unsafe impl<K: MemoryKind> StreamOrderedResource for PoolResource<K> {
    type Kind = K;

    #[inline]
    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        check_alignment(align)?;
        if bytes == 0 {
            return Ok(0);
        }
        Ok(self.pool.alloc_raw(bytes, stream)?)
    }

    #[inline]
    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, _align: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's promise covers cuMemFreeAsync's.
        Ok(unsafe { cumempool::free_async(ptr, stream) }?)
    }

    fn frees_legacy_after_blocking_captures(&self) -> bool {
        true
    }
}

/// A resource that allocates from the *current* pool of a route, looked up at each allocation,
/// so a program that reroutes with [`cumempool::set_current_pool`] is followed.
///
/// Each allocation costs one more driver call (`cuMemGetMemPool`) than a [`PoolResource`].
#[derive(Debug)]
pub struct CurrentPoolResource<K: MemoryKind> {
    route: Route,
    kind: PhantomData<fn() -> K>,
}

impl<K: MemoryKind> Clone for CurrentPoolResource<K> {
    fn clone(&self) -> Self {
        Self { route: self.route, kind: PhantomData }
    }
}

impl<K: MemoryKind> CurrentPoolResource<K> {
    /// Follows `route`, which must hold memory of kind `K`.
    pub fn new(route: Route) -> Result<Self> {
        if !K::admits(route) {
            return Err(Error::KindMismatch { route, kind: K::NAME });
        }
        route.validate()?;
        Ok(Self { route, kind: PhantomData })
    }

    /// The route followed.
    pub fn route(&self) -> Route {
        self.route
    }
}

// SAFETY: memory from cuMemAllocFromPoolAsync of the route's current pool; the route was
// checked against `K` and a route only takes pools of its own kind.
unsafe impl<K: MemoryKind> StreamOrderedResource for CurrentPoolResource<K> {
    type Kind = K;

    fn allocate(&self, bytes: usize, align: usize, stream: &Stream) -> Result<CUdeviceptr> {
        check_alignment(align)?;
        if bytes == 0 {
            return Ok(0);
        }
        Ok(cumempool::current_pool(self.route)?.alloc_raw(bytes, stream)?)
    }

    unsafe fn deallocate(&self, ptr: CUdeviceptr, bytes: usize, _align: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: cuMemFreeAsync frees into whichever pool the memory came from.
        Ok(unsafe { cumempool::free_async(ptr, stream) }?)
    }

    fn frees_legacy_after_blocking_captures(&self) -> bool {
        true
    }
}
