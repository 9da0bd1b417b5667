//! This process's route table: every route of its devices with its default pool, its current
//! pool and the current pool's attributes, in the shape of `cumempool routes --json`'s `routes`,
//! so a program can log what it routed. (The command, a process of its own, only ever sees
//! routes on their defaults: routing is per process.)

use crate::bare_pools::attributes::PoolAttribute;
use crate::devices::device::Device;
use crate::error::Result;
use crate::pool::Pool;
use crate::routing::{current_pool, default_pool};
use crate::values::location::{AllocationType, Location};
use crate::values::route::Route;
use std::collections::BTreeMap;
use std::fmt;

/// Every route of this process, as [`route_table`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RouteTable {
    /// One entry per route, in the order of [`all_routes`].
    pub routes: Vec<RouteEntry>,
}

/// One route: its pools as handles (or the refusal), and the current pool's attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RouteEntry {
    /// The route, as `Route`'s `Display` writes it.
    pub route: String,
    /// The location, as `Location`'s `Display` writes it.
    pub location: String,
    /// The allocation type, as `AllocationType`'s `Display` writes it.
    pub allocation_type: String,
    /// The default pool's handle, or `None` when the route was refused.
    pub default_pool: Option<String>,
    /// Why the default pool could not be read.
    pub default_pool_error: Option<String>,
    /// The current pool's handle, or `None` when it could not be read.
    pub current_pool: Option<String>,
    /// Why the current pool could not be read.
    pub current_pool_error: Option<String>,
    /// Whether the current pool differs from the default.
    pub changed: bool,
    /// The current pool's attributes by name (without `CU_MEMPOOL_ATTR_`), `None` where unreadable.
    pub attributes: BTreeMap<String, Option<u64>>,
    /// Why each unreadable attribute could not be read.
    pub attribute_errors: BTreeMap<String, String>,
}

/// Every route kind of this machine: per device (pinned, each locality domain where it has
/// several, managed), the host, each host NUMA node, the calling thread's NUMA node, and managed
/// memory at the host and at no location.
///
/// # Errors
/// The driver's refusal to count the devices, or a driver that cannot be loaded.
pub fn all_routes() -> Result<Vec<Route>> {
    let devices = Device::all()?;
    let mut routes = Vec::new();
    for device in &devices {
        routes.push(Route::device(device.ordinal()));
        routes.extend(locality_domain_routes(*device));
        routes.push(Route::managed(Location::Device(device.ordinal())));
    }
    routes.push(Route::host());
    routes.extend(numa_nodes(&devices).into_iter().map(Route::host_numa));
    routes.push(Route::new(Location::HostNumaCurrent, AllocationType::Pinned));
    routes.push(Route::managed(Location::Host));
    routes.push(Route::managed(Location::Unspecified));
    Ok(routes)
}

/// This process's route table: [`all_routes`], each with its default and current pool. A
/// refused route is an entry with its refusal, not an error.
///
/// # Errors
/// As [`all_routes`].
pub fn route_table() -> Result<RouteTable> {
    Ok(RouteTable { routes: all_routes()?.into_iter().map(RouteEntry::read).collect() })
}

impl RouteEntry {
    /// Reads `route`'s pools and the current pool's attributes now.
    pub fn read(route: Route) -> Self {
        let default = default_pool(route);
        let current = current_pool(route);
        let changed = matches!((&default, &current), (Ok(d), Ok(c)) if !d.same_as(c));
        let (attributes, attribute_errors) = current.as_ref().map(attributes_of).unwrap_or_default();
        let (default_pool, default_pool_error) = handle_or_error(default.as_ref().map(|p| p.as_raw()));
        let (current_pool, current_pool_error) = handle_or_error(current.as_ref().map(Pool::as_raw));
        Self {
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
}

/// One line per route: `route: current HANDLE (changed), used N B, reserved N B`, or the refusal.
impl fmt::Display for RouteTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for entry in &self.routes {
            let attribute = |name: &str| entry.attributes.get(name).copied().flatten();
            match (&entry.current_pool, &entry.default_pool_error) {
                (Some(handle), _) => {
                    let changed = if entry.changed { " (changed)" } else { "" };
                    write!(f, "{}: current {handle}{changed}", entry.route)?;
                    if let (Some(used), Some(reserved)) =
                        (attribute("USED_MEM_CURRENT"), attribute("RESERVED_MEM_CURRENT"))
                    {
                        write!(f, ", used {used} B, reserved {reserved} B")?;
                    }
                    writeln!(f)?;
                }
                (None, refusal) => {
                    let why = refusal.as_deref().or(entry.current_pool_error.as_deref()).unwrap_or("unreadable");
                    writeln!(f, "{}: {why}", entry.route)?;
                }
            }
        }
        Ok(())
    }
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
    pool: std::result::Result<cumempool_sys::CUmemoryPool, &crate::Error>,
) -> (Option<String>, Option<String>) {
    match pool {
        Ok(raw) => (Some(format!("{raw:?}")), None),
        Err(error) => (None, Some(error.to_string())),
    }
}
