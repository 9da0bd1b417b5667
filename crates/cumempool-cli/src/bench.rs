//! `cumempool bench`: the cost of an allocation+free pair per route and size, through raw
//! `cumempool-sys` calls, the safe layer and the caching resource on the same pool in one run,
//! and how each scales with threads.
//!
//! This module runs the measurements in order and renders their report; each measurement is a
//! child module built from [`harness`], and none of them uses this one.

mod cache_ratios;
mod copies;
#[cfg(feature = "cudarc")]
mod cudarc_pairs;
mod free_list;
mod harness;
mod route_pairs;
mod stream_handover;
mod thread_scaling;

pub use harness::Options;

use crate::error::Result;
use cumempool::{Device, Location, Route};
use cumempool_alloc::{DeviceMemory, HostMemory, ManagedMemory, MemoryKind};
use harness::Progress;
use serde::Serialize;

#[derive(Serialize)]
pub struct Report {
    pub device: String,
    pub driver: String,
    pub pairs_per_measurement: usize,
    pub rounds: usize,
    pub statistic: &'static str,
    pub rows: Vec<route_pairs::Row>,
    pub sync_alloc_free_1mib_us: f64,
    pub thread_size: usize,
    pub threads: Vec<thread_scaling::Row>,
    pub stream_handover: stream_handover::Report,
    /// The cache against the thread-local free list, as ratios from interleaved rounds, and what
    /// its capture checks cost.
    pub cache_ratios: cache_ratios::Report,
    /// Device-to-device copies through `copy_from_async` against raw `cuMemcpyAsync`.
    pub copies: copies::Report,
    /// cudarc's alloc+free against the safe layer's; only in a command built with `cudarc`.
    #[cfg(feature = "cudarc")]
    pub cudarc: cudarc_pairs::Report,
}

pub fn run(options: &Options) -> Result<Report> {
    cumempool::init()?;
    let device = Device::get(0)?;
    let context = device.primary_context()?;
    let numa = device.host_numa_id()?.unwrap_or(0);
    let sizes = [256, 1 << 20, 64 << 20];
    let routes = [
        Route::device(0),
        Route::host(),
        Route::host_numa(numa),
        Route::managed(Location::Device(0)),
        Route::managed(Location::Unspecified),
    ];
    let mut progress =
        Progress::new(routes.len() * sizes.len() + options.threads.len() + 4 + usize::from(cfg!(feature = "cudarc")));
    let mut rows = Vec::new();
    for route in routes {
        rows.extend(match route {
            r if DeviceMemory::admits(r) => {
                route_pairs::measure::<DeviceMemory>(r, &context, &sizes, options, &mut progress)?
            }
            r if HostMemory::admits(r) => {
                route_pairs::measure::<HostMemory>(r, &context, &sizes, options, &mut progress)?
            }
            r => route_pairs::measure::<ManagedMemory>(r, &context, &sizes, options, &mut progress)?,
        });
    }
    progress.tick("synchronous cuMemAlloc + cuMemFree");
    let sync_alloc_free_1mib_us = route_pairs::sync_alloc_free(&context)?;
    let threads = thread_scaling::measure(&context, options, &mut progress)?;
    progress.tick("stream handover: a stream per thread, then one shared stream");
    // 20,000 pairs per thread at the default --pairs 2000; --quick shrinks it.
    let stream_handover = stream_handover::measure(&context, options.pairs * 10)?;
    progress.tick("the cache against the free list, with and without capture checks, interleaved");
    let cache_ratios = cache_ratios::measure(&context, options)?;
    progress.tick("device-to-device copies: copy_from_async against raw cuMemcpyAsync");
    let copies = copies::measure(&context, options)?;
    #[cfg(feature = "cudarc")]
    let cudarc = {
        progress.tick("cudarc's alloc+free against Pool::alloc on its stream");
        cudarc_pairs::measure(&context, options.pairs, options.rounds)?
    };
    progress.done();
    Ok(Report {
        device: device.name()?,
        driver: cumempool::driver_version()?.to_string(),
        pairs_per_measurement: options.pairs,
        rounds: options.rounds,
        statistic:
            "medians of interleaved rounds on the same pool and stream; safe/raw is the median of per-round ratios",
        rows,
        sync_alloc_free_1mib_us,
        thread_size: thread_scaling::SIZE,
        threads,
        stream_handover,
        cache_ratios,
        copies,
        #[cfg(feature = "cudarc")]
        cudarc,
    })
}

pub fn render(report: &Report) -> String {
    let mut out = format!(
        "{} (driver {}): allocation+free pairs, {} pairs x {} rounds ({})\n\n",
        report.device, report.driver, report.pairs_per_measurement, report.rounds, report.statistic
    );
    out.push_str(&route_pairs::render(&report.rows));
    out.push_str(&format!(
        "\nsynchronous cuMemAlloc + cuMemFree of 1 MiB: {:.1} us\n\n",
        report.sync_alloc_free_1mib_us
    ));
    out.push_str(&thread_scaling::render(report.thread_size, &report.threads));
    out.push('\n');
    out.push_str(&stream_handover::render(&report.stream_handover));
    out.push('\n');
    out.push_str(&cache_ratios::render(&report.cache_ratios));
    out.push('\n');
    out.push_str(&copies::render(&report.copies));
    #[cfg(feature = "cudarc")]
    {
        out.push('\n');
        out.push_str(&cudarc_pairs::render(&report.cudarc));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of no rows: every table's header and every JSON key, without a GPU.
    fn empty_report() -> Report {
        Report {
            device: "a device".to_owned(),
            driver: "13.0".to_owned(),
            pairs_per_measurement: 200,
            rounds: 3,
            statistic: "medians",
            rows: Vec::new(),
            sync_alloc_free_1mib_us: 1.0,
            thread_size: thread_scaling::SIZE,
            threads: Vec::new(),
            stream_handover: stream_handover::Report {
                threads: 16,
                pairs_per_thread: 2000,
                min_size: 256,
                max_size: 4 << 20,
                phases: Vec::new(),
            },
            cache_ratios: cache_ratios::Report { rounds: 7, pairs_per_thread_per_round: 100_000, rows: Vec::new() },
            copies: copies::Report { copies_per_measurement: 200, rows: Vec::new() },
            #[cfg(feature = "cudarc")]
            cudarc: cudarc_pairs::Report { size: 1 << 20, cudarc_ns: 1.0, cudarc_untracked_ns: 1.0, safe_ns: 1.0 },
        }
    }

    #[test]
    fn the_tables_and_the_json_speak_of_measurements_not_of_the_project_history() {
        let report = empty_report();
        let text = render(&report);
        let json = serde_json::to_string(&report).unwrap();
        for output in [&text, &json] {
            assert!(!output.to_lowercase().contains("issue"), "{output}");
        }
        assert!(text.contains("stream handover: 16 threads x 2000 pairs"), "{text}");
        assert!(text.contains("free list, on the same threads in interleaved rounds: 7 rounds"), "{text}");
    }
}
