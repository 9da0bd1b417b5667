//! `cumempool routes`: every route's default and current pool, with attributes, and the
//! driver's answer for routes that cannot exist.

use crate::table::{bytes, Table};
use cumempool::sys;
use cumempool::{current_pool, default_pool, AllocationType, Device, Location, Pool, PoolAttribute, Route};
use serde::Serialize;
use std::collections::BTreeMap;

/// One route, as docs/cli.md describes it: each pool is a handle or null with its error beside.
#[derive(Serialize)]
pub struct RouteReport {
    pub route: String,
    pub location: String,
    pub allocation_type: String,
    /// The default pool's handle, or null when the driver refused the route.
    pub default_pool: Option<String>,
    pub default_pool_error: Option<String>,
    pub current_pool: Option<String>,
    pub current_pool_error: Option<String>,
    /// Whether the current pool differs from the default.
    pub changed: bool,
    /// Attributes of the current pool by name, null where it cannot be read.
    pub attributes: BTreeMap<String, Option<u64>>,
    /// Why each null attribute could not be read.
    pub attribute_errors: BTreeMap<String, String>,
}

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

/// Host NUMA nodes: the kernel's list where readable, else the nodes devices report.
fn numa_nodes(devices: &[Device]) -> Vec<i32> {
    let mut nodes: Vec<i32> = std::fs::read_dir("/sys/devices/system/node")
        .map(|entries| {
            entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("node")?.parse().ok()).collect()
        })
        .unwrap_or_default();
    if nodes.is_empty() {
        nodes = devices.iter().filter_map(|d| d.host_numa_id().ok().flatten()).collect();
    }
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The pinned route of each locality domain, on a device with more than one (driver 13.4); on
/// a device with one, domain 0 is the device's own route.
#[cfg(feature = "cuda-13040")]
fn locality_domain_routes(device: Device) -> Vec<Route> {
    match device.locality_domain_count() {
        Ok(count) if count > 1 => (0..count)
            .filter_map(|domain| u8::try_from(domain).ok())
            .map(|domain| Route::locality_domain(device.ordinal(), domain))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(not(feature = "cuda-13040"))]
fn locality_domain_routes(_: Device) -> Vec<Route> {
    Vec::new()
}

/// Every route kind: per device (pinned, each locality domain where it has several, managed),
/// the host, each host NUMA node, the calling thread's NUMA node, and managed memory at the
/// host and at no location.
pub fn all_routes(devices: &[Device]) -> Vec<Route> {
    let mut routes = Vec::new();
    for device in devices {
        routes.push(Route::device(device.ordinal()));
        routes.extend(locality_domain_routes(*device));
        routes.push(Route::managed(Location::Device(device.ordinal())));
    }
    routes.push(Route::host());
    routes.extend(numa_nodes(devices).into_iter().map(Route::host_numa));
    routes.push(Route::new(Location::HostNumaCurrent, AllocationType::Pinned));
    routes.push(Route::managed(Location::Host));
    routes.push(Route::managed(Location::Unspecified));
    routes
}

/// The current pool's attributes, and why each unreadable one could not be read.
fn attributes_of(pool: &Pool) -> (BTreeMap<String, Option<u64>>, BTreeMap<String, String>) {
    let (mut values, mut errors) = (BTreeMap::new(), BTreeMap::new());
    for attribute in PoolAttribute::ALL {
        let name = attribute.name().trim_start_matches("CU_MEMPOOL_ATTR_").to_owned();
        match pool.attribute(*attribute) {
            Ok(value) => values.insert(name, Some(value)),
            Err(error) => {
                errors.insert(name.clone(), error.to_string());
                values.insert(name, None)
            }
        };
    }
    (values, errors)
}

/// A pool's handle, or null and the refusal.
fn handle_or_error(
    pool: std::result::Result<cumempool::sys::CUmemoryPool, &cumempool::Error>,
) -> (Option<String>, Option<String>) {
    match pool {
        Ok(raw) => (Some(format!("{raw:?}")), None),
        Err(error) => (None, Some(error.to_string())),
    }
}

fn report_route(route: Route) -> RouteReport {
    let default = default_pool(route);
    let current = current_pool(route);
    let changed = matches!((&default, &current), (Ok(d), Ok(c)) if !d.same_as(c));
    let (attributes, attribute_errors) = current.as_ref().map(attributes_of).unwrap_or_default();
    let (default_pool, default_pool_error) = handle_or_error(default.as_ref().map(|p| p.as_raw()));
    let (current_pool, current_pool_error) = handle_or_error(current.as_ref().map(Pool::as_raw));
    RouteReport {
        route: route.to_string(),
        location: route.location.to_string(),
        allocation_type: route.allocation_type.to_string(),
        default_pool,
        default_pool_error,
        current_pool,
        current_pool_error,
        changed,
        attributes,
        attribute_errors,
    }
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
    let devices = Device::all()?;
    let routes = all_routes(&devices).into_iter().map(report_route).collect();
    Ok(Report { routes, invalid_inputs: raw_probes(devices.len() as i32) })
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
