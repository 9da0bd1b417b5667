//! `cumempool doctor`: what this build, this driver and these devices support, and why not.

use crate::table::Table;
use cumempool::sys;
use cumempool::{Device, DriverVersion, HandleTypes};
use serde::Serialize;

#[derive(Serialize)]
pub struct DeviceReport {
    pub ordinal: i32,
    pub name: String,
    pub memory_pools: bool,
    pub host_memory_pools: bool,
    pub host_numa_memory_pools: bool,
    pub concurrent_managed_access: bool,
    pub host_numa_id: Option<i32>,
    pub supported_handle_types: String,
    /// `LOCALITY_DOMAIN_COUNT` (driver 13.4, `cuda-13040` builds); null where unknown.
    pub locality_domains: Option<u32>,
    /// `LOCALITY_DOMAIN_MULTIPROCESSOR_COUNT`: multiprocessors per domain; null where unknown.
    pub multiprocessors_per_locality_domain: Option<u32>,
    /// The device's graph memory (what captured allocations use; no pool caps or counts it);
    /// null where the driver did not answer.
    pub graph_memory: Option<GraphMemoryReport>,
}

/// `Device::graph_memory`, in bytes.
#[derive(Serialize)]
pub struct GraphMemoryReport {
    pub used_current: u64,
    pub used_high: u64,
    pub reserved_current: u64,
    pub reserved_high: u64,
}

fn graph_memory(device: Device) -> Option<GraphMemoryReport> {
    let memory = device.graph_memory().ok()?;
    Some(GraphMemoryReport {
        used_current: memory.used_current,
        used_high: memory.used_high,
        reserved_current: memory.reserved_current,
        reserved_high: memory.reserved_high,
    })
}

#[derive(Serialize)]
pub struct Feature {
    pub feature: String,
    pub works: bool,
    pub why: String,
}

#[derive(Serialize)]
pub struct Report {
    pub crate_version: String,
    pub compiled_features: Vec<String>,
    pub bindings_cuda: String,
    pub library_tried: String,
    pub library_loaded: Option<String>,
    pub driver: Option<String>,
    /// In the document's shared `error` key (src/schema.rs), not twice.
    #[serde(skip)]
    pub error: Option<String>,
    pub devices: Vec<DeviceReport>,
    pub features: Vec<Feature>,
}

fn compiled_features() -> Vec<String> {
    let compiled = [
        ("cuda-13020", cfg!(feature = "cuda-13020")),
        ("cuda-13040", cfg!(feature = "cuda-13040")),
        ("cuda-13050", cfg!(feature = "cuda-13050")),
    ];
    let newer = compiled.iter().filter(|(_, on)| *on).map(|(name, _)| (*name).to_owned());
    std::iter::once("cuda-13000".to_owned()).chain(newer).collect()
}

/// Whether a feature of a newer CUDA works here, and why (not): compiled in, and the driver.
fn newer_feature(
    compiled: bool,
    cargo_feature: &str,
    needs: DriverVersion,
    found: DriverVersion,
    absent: &str,
) -> (bool, String) {
    if !compiled {
        (false, format!("not compiled: build with the {cargo_feature} feature"))
    } else if found < needs {
        (false, format!("needs driver {needs}, found {found}: {absent}"))
    } else {
        (true, format!("driver {found}"))
    }
}

/// The device's locality domains and multiprocessors per domain (driver 13.4), where known.
#[cfg(feature = "cuda-13040")]
fn locality_domains(device: Device) -> (Option<u32>, Option<u32>) {
    (device.locality_domain_count().ok(), device.locality_domain_multiprocessor_count().ok())
}

#[cfg(not(feature = "cuda-13040"))]
fn locality_domains(_: Device) -> (Option<u32>, Option<u32>) {
    (None, None)
}

pub fn collect() -> Report {
    let mut report = Report {
        crate_version: env!("CARGO_PKG_VERSION").into(),
        compiled_features: compiled_features(),
        bindings_cuda: cumempool::bindings_version().to_string(),
        library_tried: sys::library_to_open(),
        library_loaded: None,
        driver: None,
        error: None,
        devices: Vec::new(),
        features: Vec::new(),
    };
    // The library can open and still fail to initialise (no device, a broken install): it was
    // loaded all the same.
    report.library_loaded = sys::driver().ok().map(|driver| driver.library_path().to_owned());
    let version = match cumempool::init().and_then(|()| cumempool::driver_version()) {
        Ok(version) => version,
        Err(error) => {
            report.error = Some(error.to_string());
            return report;
        }
    };
    report.driver = Some(version.to_string());
    let devices = Device::all().unwrap_or_default();
    for device in &devices {
        let (locality_domains, multiprocessors_per_locality_domain) = locality_domains(*device);
        report.devices.push(DeviceReport {
            ordinal: device.ordinal(),
            name: device.name().unwrap_or_else(|e| format!("? ({e})")),
            memory_pools: device.supports_memory_pools().unwrap_or(false),
            host_memory_pools: device.supports_host_memory_pools().unwrap_or(false),
            host_numa_memory_pools: device.supports_host_numa_memory_pools().unwrap_or(false),
            concurrent_managed_access: device.concurrent_managed_access().unwrap_or(false),
            host_numa_id: device.host_numa_id().ok().flatten(),
            supported_handle_types: device.supported_handle_types().map_or_else(|e| e.to_string(), |t| t.to_string()),
            locality_domains,
            multiprocessors_per_locality_domain,
            graph_memory: graph_memory(*device),
        });
    }
    let any = |f: fn(&DeviceReport) -> bool| report.devices.iter().any(f);
    let mut feature =
        |name: &str, works: bool, why: String| report.features.push(Feature { feature: name.into(), works, why });
    let routing = version >= DriverVersion::CUDA_13_0;
    feature(
        "location-keyed routing (default/current pools per route)",
        routing,
        if routing {
            format!("driver {version} has cuMemGetMemPool/cuMemSetMemPool")
        } else {
            format!("needs driver 13.0, found {version}")
        },
    );
    feature("device pools", any(|d| d.memory_pools), "MEMORY_POOLS_SUPPORTED per device".into());
    feature("host pools", any(|d| d.host_memory_pools), "HOST_MEMORY_POOLS_SUPPORTED per device".into());
    feature("host NUMA pools", any(|d| d.host_numa_memory_pools), "HOST_NUMA_MEMORY_POOLS_SUPPORTED per device".into());
    feature(
        "managed pools",
        routing && any(|d| d.concurrent_managed_access),
        "managed routes need 13.0; host access while the device runs needs CONCURRENT_MANAGED_ACCESS".into(),
    );
    let handle = |t: HandleTypes| devices.iter().any(|d| d.supported_handle_types().is_ok_and(|s| s.contains(t)));
    feature(
        "sharing pools by file descriptor (IPC)",
        cfg!(unix) && handle(HandleTypes::POSIX_FILE_DESCRIPTOR),
        "MEMPOOL_SUPPORTED_HANDLE_TYPES has POSIX_FILE_DESCRIPTOR".into(),
    );
    feature(
        "sharing pools by fabric handle",
        handle(HandleTypes::FABRIC),
        "MEMPOOL_SUPPORTED_HANDLE_TYPES has FABRIC (also needs an IMEX channel)".into(),
    );
    let peers = devices.len() > 1 && devices[0].can_access_peer(devices[1]).unwrap_or(false);
    feature(
        "peer access to pools",
        peers,
        if devices.len() > 1 { "device 0 and 1 peer capability".into() } else { "one device only".into() },
    );
    let newer = [
        (
            "CUDA 13.2 pool attributes (ALLOCATION_TYPE, EXPORT_HANDLE_TYPES, LOCATION_ID/TYPE, MAX_POOL_SIZE, HW_DECOMPRESS_ENABLED)",
            cfg!(feature = "cuda-13020"),
            "cuda-13020",
            DriverVersion::CUDA_13_2,
            "the six attributes return a typed DriverTooOld error",
        ),
        (
            "CUDA 13.4 locality domains (DEVICE_LOCALITY_DOMAIN routes and pools, LOCALITY_DOMAIN_ID, domain counts, a buffer's domain)",
            cfg!(feature = "cuda-13040"),
            "cuda-13040",
            DriverVersion::CUDA_13_4,
            "domain routes, attributes and counts return a typed DriverTooOld error",
        ),
        (
            "CUDA 13.4 cuMemGetLocationInfo (where managed pages reside: Buffer::location_info)",
            cfg!(feature = "cuda-13040"),
            "cuda-13040",
            DriverVersion::CUDA_13_4,
            "the entry point is missing; the call returns a typed DriverTooOld error",
        ),
        (
            "CUDA 13.5 declarations (nothing new for pools: cuMemGetLocationInfo is 13.4's)",
            cfg!(feature = "cuda-13050"),
            "cuda-13050",
            DriverVersion::CUDA_13_5,
            "nothing a pool needs is missing",
        ),
    ];
    for (name, compiled, cargo_feature, needs, absent) in newer {
        let (works, why) = newer_feature(compiled, cargo_feature, needs, version, absent);
        feature(name, works, why);
    }
    report
}

/// Bytes in MiB, for the table.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
}

pub fn render(report: &Report) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "cumempool {} (features: {}; declarations of CUDA {})\n",
        report.crate_version,
        report.compiled_features.join(", "),
        report.bindings_cuda
    ));
    if let Some(error) = &report.error {
        out.push_str(&format!("{error}\n(library tried: {})\n", report.library_tried));
        return out;
    }
    out.push_str(&format!(
        "driver: CUDA {} from {}\n\n",
        report.driver.as_deref().unwrap_or("?"),
        report.library_loaded.as_deref().unwrap_or("?")
    ));
    let mut devices = Table::new(&[
        "device",
        "name",
        "pools",
        "host pools",
        "host NUMA pools",
        "managed concurrent",
        "NUMA id",
        "handle types",
        "locality domains",
        "graph memory used / reserved",
    ]);
    let yes = |b: bool| if b { "yes" } else { "no" }.to_owned();
    for d in &report.devices {
        devices.row(vec![
            d.ordinal.to_string(),
            d.name.clone(),
            yes(d.memory_pools),
            yes(d.host_memory_pools),
            yes(d.host_numa_memory_pools),
            yes(d.concurrent_managed_access),
            d.host_numa_id.map_or("-".into(), |n| n.to_string()),
            d.supported_handle_types.clone(),
            match (d.locality_domains, d.multiprocessors_per_locality_domain) {
                (Some(count), Some(sms)) => format!("{count} ({sms} SMs each)"),
                (Some(count), None) => count.to_string(),
                _ => "-".into(),
            },
            d.graph_memory.as_ref().map_or("-".into(), |g| {
                format!(
                    "{} / {} (high {} / {})",
                    mib(g.used_current),
                    mib(g.reserved_current),
                    mib(g.used_high),
                    mib(g.reserved_high)
                )
            }),
        ]);
    }
    out.push_str(&devices.render());
    out.push('\n');
    let mut features = Table::new(&["works", "feature", "why"]);
    for f in &report.features {
        features.row(vec![yes(f.works), f.feature.clone(), f.why.clone()]);
    }
    out.push_str(&features.render());
    out
}
