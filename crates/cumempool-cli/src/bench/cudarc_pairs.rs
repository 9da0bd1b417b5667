//! cudarc's own allocation+free pair against the safe layer's, on the same stream and the same
//! pool (feature `cudarc`): cudarc's `CudaStream::alloc` calls `cuMemAllocAsync`, which draws
//! from the device's current pool, so routing a pool there makes both draw from it.

use super::harness::{median, time};
use crate::error::{Error, Result};
use cumempool::cudarc::driver::{CudaContext, CudaStream};
use cumempool::{set_current_pool, Context, MemPool, Route, Stream};
use serde::Serialize;
use std::sync::Arc;

/// The size of the pairs: 1 MiB, as in the thread-scaling rows.
const SIZE: usize = 1 << 20;

#[derive(Serialize)]
pub struct Report {
    pub size: usize,
    /// cudarc's `alloc` + drop, with its event tracking on (its default): medians, nanoseconds.
    pub cudarc_ns: f64,
    /// The same with event tracking off.
    pub cudarc_untracked_ns: f64,
    /// `Pool::alloc` + drop on cudarc's stream (`Stream::from_cudarc`), from the same pool.
    pub safe_ns: f64,
}

fn cudarc_pair(stream: &Arc<CudaStream>) -> impl FnMut() -> bool + '_ {
    // SAFETY: the memory is never read; it is freed at once, in stream order.
    move || unsafe { stream.alloc::<u8>(SIZE) }.is_ok()
}

pub fn measure(context: &Context, pairs: usize, rounds: usize) -> Result<Report> {
    let failed = |_| Error::BenchRunFailed { measurement: "cudarc allocation+free pairs" };
    let cudarc_context: Arc<CudaContext> = context.to_cudarc()?;
    let cudarc_stream = cudarc_context.new_stream().map_err(failed)?;
    let stream = Stream::from_cudarc(&cudarc_stream)?;
    let pool = MemPool::new(Route::device(context.device().ordinal()))?;
    pool.set_release_threshold(u64::MAX)?;
    // Process-global for this measurement only: the guard restores the previous pool.
    let _routed = set_current_pool(Route::device(context.device().ordinal()), &pool)?;
    let mut safe = || pool.alloc(SIZE, &stream).is_ok();
    let (mut tracked, mut untracked, mut s) = (Vec::new(), Vec::new(), Vec::new());
    time(pairs / 10 + 1, &stream, cudarc_pair(&cudarc_stream))?;
    time(pairs / 10 + 1, &stream, &mut safe)?;
    for _ in 0..rounds {
        tracked.push(time(pairs, &stream, cudarc_pair(&cudarc_stream))?.0);
        // SAFETY: the slices made while tracking is off live on one stream and are dropped at
        // once, unused, so nothing needs the events cudarc would have recorded.
        unsafe { cudarc_context.disable_event_tracking() };
        let off = time(pairs, &stream, cudarc_pair(&cudarc_stream));
        // SAFETY: no slice made while tracking was off is still alive.
        unsafe { cudarc_context.enable_event_tracking() };
        untracked.push(off?.0);
        s.push(time(pairs, &stream, &mut safe)?.0);
    }
    Ok(Report { size: SIZE, cudarc_ns: median(tracked), cudarc_untracked_ns: median(untracked), safe_ns: median(s) })
}

pub fn render(report: &Report) -> String {
    format!(
        "cudarc {} alloc+free on one stream, same pool: cudarc {:.2} us, cudarc without event tracking {:.2} us, Pool::alloc {:.2} us\n",
        crate::table::bytes(report.size as u64),
        report.cudarc_ns / 1e3,
        report.cudarc_untracked_ns / 1e3,
        report.safe_ns / 1e3
    )
}
