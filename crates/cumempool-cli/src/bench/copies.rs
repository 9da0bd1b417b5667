//! Device-to-device copies that do not wait: `BufferOn::copy_from_async` against a raw
//! `cuMemcpyAsync` between the same two buffers on the same stream, in interleaved rounds.

use super::harness::{median, time, Options};
use crate::error::Result;
use crate::table::{bytes, Table};
use cumempool::sys::CUresult;
use cumempool::{Context, MemPool, Route, Stream};
use serde::Serialize;

/// The sizes copied: one where the call's own cost shows, one where the copy's bandwidth does.
const SIZES: [usize; 2] = [4 << 10, 1 << 20];

#[derive(Serialize)]
pub struct Row {
    pub size: usize,
    /// Medians over the rounds.
    pub raw_copies_per_s: f64,
    pub safe_copies_per_s: f64,
    /// `copy_from_async`'s rate over the raw call's: the median of per-round ratios (target >= 0.95).
    pub safe_over_raw: f64,
}

#[derive(Serialize)]
pub struct Report {
    pub copies_per_measurement: usize,
    pub rows: Vec<Row>,
}

pub fn measure(context: &Context, options: &Options) -> Result<Report> {
    let stream = Stream::new(context)?;
    let pool = MemPool::new(Route::device(context.device().ordinal()))?;
    let copy = cumempool::sys::driver()?.cuMemcpyAsync()?;
    let mut rows = Vec::new();
    for size in SIZES {
        let mut source = pool.alloc(size, &stream)?;
        source.fill(7)?;
        let mut target = pool.alloc(size, &stream)?;
        let (to, from, raw_stream) = (target.as_raw(), source.as_raw(), stream.as_raw());
        // SAFETY: two live allocations of `size` bytes, freed after the stream's last copy.
        let mut raw = || unsafe { copy(to, from, size, raw_stream) } == CUresult::CUDA_SUCCESS;
        let mut safe = || target.copy_from_async(&source).is_ok();
        time(options.pairs / 10 + 1, &stream, &mut raw)?;
        time(options.pairs / 10 + 1, &stream, &mut safe)?;
        let (mut r, mut s) = (Vec::new(), Vec::new());
        for _ in 0..options.rounds {
            r.push(1e9 / time(options.pairs, &stream, &mut raw)?.0);
            s.push(1e9 / time(options.pairs, &stream, &mut safe)?.0);
        }
        let safe_over_raw = median(r.iter().zip(&s).map(|(raw, safe)| safe / raw).collect());
        rows.push(Row { size, raw_copies_per_s: median(r), safe_copies_per_s: median(s), safe_over_raw });
    }
    Ok(Report { copies_per_measurement: options.pairs, rows })
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "device-to-device copies on one stream, no host wait ({} copies per round; copies per second)\n",
        report.copies_per_measurement
    );
    let mut table = Table::new(&["size", "raw cuMemcpyAsync", "copy_from_async", "copy_from_async/raw"]);
    for r in &report.rows {
        table.row(vec![
            bytes(r.size as u64),
            format!("{:.2} M/s", r.raw_copies_per_s / 1e6),
            format!("{:.2} M/s", r.safe_copies_per_s / 1e6),
            format!("{:.3}", r.safe_over_raw),
        ]);
    }
    out.push_str(&table.render());
    out
}
