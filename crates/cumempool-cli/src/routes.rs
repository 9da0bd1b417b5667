//! `cumempool routes`: every route's default and current pool, with attributes, and the
//! driver's answer for routes that cannot exist.

use crate::table::{bytes, Table};
use cumempool::sys;
use cumempool::{default_pool, AllocationType, Device, Location, PoolAttribute, Route};
use serde::Serialize;

/// One route, as docs/cli.md describes it (the library's own route table entry): each pool is a
/// handle or null with its error beside.
pub use cumempool::RouteEntry as RouteReport;

#[derive(Serialize)]
pub struct RawProbe {
    pub input: String,
    /// What the library says before calling the driver (if it refuses).
    pub library: Option<String>,
    /// What `cuMemGetDefaultMemPool` itself answers.
    pub driver: String,
}

#[derive(Serialize)]
pub struct Report {
    pub routes: Vec<RouteReport>,
    pub invalid_inputs: Vec<RawProbe>,
}

/// Asks the driver directly about inputs the library refuses, so both answers are on record.
fn raw_probes(device_count: i32) -> Vec<RawProbe> {
    use sys::CUmemAllocationType as A;
    let probe = |type_: u32, id: i32, alloc: A| -> String {
        let Ok(driver) = sys::driver() else { return "no driver".into() };
        let Ok(f) = driver.cuMemGetDefaultMemPool() else { return "entry point missing".into() };
        let mut location = cumempool::raw_location(sys::CUmemLocationType(type_), id);
        let mut pool = std::ptr::null_mut();
        // SAFETY: valid pointers; the driver validates the rest.
        let code = unsafe { f(&mut pool, &mut location, alloc) };
        cumempool_error_name(code)
    };
    let library = |route: Route| default_pool(route).err().map(|e| e.to_string());
    let mut probes = vec![
        RawProbe {
            input: "(NONE, PINNED)".into(),
            library: library(Route::new(Location::Unspecified, AllocationType::Pinned)),
            driver: probe(0, 0, A::CU_MEM_ALLOCATION_TYPE_PINNED),
        },
        RawProbe {
            input: "(INVISIBLE, PINNED)".into(),
            library: Some("Location::Invisible is only ever an output (refused as an input)".into()),
            driver: probe(5, 0, A::CU_MEM_ALLOCATION_TYPE_PINNED),
        },
        RawProbe {
            input: format!("(DEVICE {device_count}, PINNED)"),
            library: library(Route::device(device_count)),
            driver: probe(1, device_count, A::CU_MEM_ALLOCATION_TYPE_PINNED),
        },
        RawProbe {
            input: "(DEVICE 0, INVALID type 0)".into(),
            library: Some("AllocationType has no invalid variant (unrepresentable)".into()),
            driver: probe(1, 0, A(0)),
        },
    ];
    if let Ok(driver) = sys::driver() {
        if let Ok(f) = driver.cuMemGetDefaultMemPool() {
            let mut pool = std::ptr::null_mut();
            // SAFETY: a NULL location is what is being probed; the driver checks it.
            let code = unsafe { f(&mut pool, std::ptr::null_mut(), A::CU_MEM_ALLOCATION_TYPE_PINNED) };
            probes.push(RawProbe {
                input: "location pointer NULL".into(),
                library: Some("references cannot be null (unrepresentable)".into()),
                driver: cumempool_error_name(code),
            });
        }
    }
    probes
}

fn cumempool_error_name(code: sys::CUresult) -> String {
    if code == sys::CUresult::CUDA_SUCCESS {
        return "CUDA_SUCCESS (a pool exists)".into();
    }
    cumempool::error_name(code)
}

pub fn collect() -> crate::error::Result<Report> {
    cumempool::init()?;
    let device_count = Device::count()?;
    Ok(Report { routes: cumempool::route_table()?.routes, invalid_inputs: raw_probes(device_count) })
}

pub fn render(report: &Report) -> String {
    let mut table = Table::new(&[
        "route",
        "default pool",
        "current pool",
        "release threshold",
        "reserved",
        "used",
        "13.2 attributes",
    ]);
    let attribute = |r: &RouteReport, name: &str| -> String {
        match r.attributes.get(name) {
            Some(Some(v)) => bytes(*v),
            Some(None) => "n/a".into(),
            None => String::new(),
        }
    };
    for r in &report.routes {
        let current = match &r.current_pool {
            Some(handle) if r.changed => format!("{handle} (changed)"),
            Some(handle) => handle.clone(),
            None => "-".into(),
        };
        let newer = r.attributes.iter().filter(|(n, _)| is_newer_than_13_0(n)).collect::<Vec<_>>();
        let newer = if newer.is_empty() {
            "not compiled (cuda-13000 build)".to_owned()
        } else if newer.iter().all(|(_, v)| v.is_none()) {
            "need driver 13.2".to_owned()
        } else {
            newer
                .iter()
                .map(|(n, v)| format!("{}={}", n.to_lowercase(), v.map_or("?".into(), |v| v.to_string())))
                .collect::<Vec<_>>()
                .join(" ")
        };
        match (&r.default_pool, &r.default_pool_error) {
            (Some(handle), _) => table.row(vec![
                r.route.clone(),
                handle.clone(),
                current,
                attribute(r, "RELEASE_THRESHOLD"),
                attribute(r, "RESERVED_MEM_CURRENT"),
                attribute(r, "USED_MEM_CURRENT"),
                if r.attributes.is_empty() { String::new() } else { newer },
            ]),
            (None, refusal) => {
                let dash = || "-".to_owned();
                table.row(vec![
                    r.route.clone(),
                    dash(),
                    dash(),
                    dash(),
                    dash(),
                    dash(),
                    format!("refused: {}", short_refusal(refusal.as_deref().unwrap_or("?"))),
                ])
            }
        }
    }
    let mut out = table.render();
    out.push_str("\nInputs that name no route (the library's refusal, and what the driver itself answers):\n");
    let mut probes = Table::new(&["input", "cumempool", "driver"]);
    for p in &report.invalid_inputs {
        probes.row(vec![p.input.clone(), p.library.clone().unwrap_or_else(|| "-".into()), p.driver.clone()]);
    }
    out.push_str(&probes.render());
    out
}

/// Whether the attribute named `name` (without `CU_MEMPOOL_ATTR_`) came after CUDA 13.0.
fn is_newer_than_13_0(name: &str) -> bool {
    PoolAttribute::ALL.iter().any(|a| {
        a.name().trim_start_matches("CU_MEMPOOL_ATTR_") == name && a.since() > cumempool::DriverVersion::CUDA_13_0
    })
}

/// The driver's error name out of a refusal message, where it has one.
fn short_refusal(text: &str) -> String {
    text.split_whitespace()
        .find(|w| w.starts_with("CUDA_ERROR_"))
        .map_or_else(|| text.to_owned(), |w| w.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '_').to_owned())
}
