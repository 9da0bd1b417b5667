//! Pools: owned ones (`MemPool(route, ...)`) and handles to the driver's default and current
//! pools, with every attribute as a property.
//!
//! Above the class: the default and current pools (`current_pools`), the resources built on
//! pools (`resources`) and the link at the bottom of every resource stack (`driver_link`).

pub(crate) mod current_pools;
pub(crate) mod driver_link;
pub(crate) mod resources;

use crate::errors::{Failure, Outcome};
use crate::memory::buffers::Buffer;
use crate::memory::sharing::SharedAllocation;
use crate::memory::{memory_device, Core, Kind, Memory};
use crate::streams::stream::Stream;
use crate::values::build_features::gated;
use crate::values::device::Device;
use crate::values::route_values::{AllocationType, Location, Route};
use pyo3::prelude::*;
use std::sync::Mutex;

/// The Rust access for a member of `cumempool.Access`.
fn access_from_python(access: &Bound<'_, PyAny>) -> PyResult<cumempool::Access> {
    Ok(match crate::values::enums::ACCESS.name_of(access)? {
        "READ" => cumempool::Access::Read,
        "READ_WRITE" => cumempool::Access::ReadWrite,
        _ => cumempool::Access::None,
    })
}

/// The member of `cumempool.Access` for a Rust access (one the crate does not know reads NONE).
fn access_to_python(py: Python<'_>, access: cumempool::Access) -> PyResult<Py<PyAny>> {
    let name = match access {
        cumempool::Access::Read => "READ",
        cumempool::Access::ReadWrite => "READ_WRITE",
        _ => "NONE",
    };
    Ok(crate::values::enums::ACCESS.member(py, name)?.unbind())
}

/// A memory pool. `MemPool(route, max_size=..., handle_types=..., hw_decompress=...)` creates
/// one that is destroyed when it, every buffer from it and every route it was made current for
/// are gone; `default_pool` and `current_pool` return handles to pools the driver or other
/// holders keep alive. `close()` lets go of this handle.
#[pyclass(frozen, module = "cumempool")]
pub struct MemPool {
    /// The handle; `None` once closed. Calls take a clone (the lock is held for that only, never
    /// across a driver call or Python code), so `close()` on one thread while another allocates
    /// without the GIL closes, and the call in flight finishes on its clone.
    pool: Mutex<Option<cumempool::Pool>>,
}

impl MemPool {
    pub(crate) fn wrap(pool: cumempool::Pool) -> Self {
        Self { pool: Mutex::new(Some(pool)) }
    }

    pub(crate) fn pool(&self) -> Outcome<cumempool::Pool> {
        crate::sync::locks::lock(&self.pool).clone().ok_or(Failure::Closed("this MemPool"))
    }

    /// The device whose context and legacy stream serve this pool by default.
    pub(crate) fn home_device(route: Option<cumempool::Route>) -> i32 {
        route.and_then(|r| r.location.device()).unwrap_or(0)
    }
}

#[pymethods]
impl MemPool {
    #[new]
    #[pyo3(signature = (route, *, max_size = None, handle_types = 0, hw_decompress = false))]
    fn new(
        py: Python<'_>,
        route: Route,
        max_size: Option<u64>,
        handle_types: u32,
        hw_decompress: bool,
    ) -> Outcome<Self> {
        let mut builder = cumempool::MemPool::builder(route.0)
            .export_handle_types(cumempool::HandleTypes::from_bits(handle_types))
            .hw_decompress(hw_decompress);
        if let Some(bytes) = max_size {
            builder = builder.max_size(bytes);
        }
        let pool = crate::sync::gil::detach(py, || builder.build())?;
        Ok(Self::wrap(cumempool::Pool::clone(&pool)))
    }

    /// Allocates `size` bytes ordered on `stream` (a Stream, a torch/CuPy/cuda.core stream, an
    /// int handle; `None`: the legacy default stream of the pool's device). The buffer is freed
    /// on that stream when closed or collected.
    ///
    /// Example: `buf = pool.alloc(1 << 20, Stream(0))`.
    #[pyo3(signature = (size, stream = None))]
    fn alloc(&self, py: Python<'_>, size: usize, stream: Option<&Bound<'_, PyAny>>) -> Outcome<Buffer> {
        let pool = self.pool()?;
        let route = pool.route();
        let stream = Stream::from_object(py, stream, Self::home_device(route))?;
        let buffer = {
            let s = &stream.get().stream;
            // An empty buffer makes no driver call; any other may wait on the driver.
            let alloc =
                || crate::streams::current_context::restored_after(s.as_raw() as usize, || pool.alloc_owned(size, s));
            match size {
                0 => alloc()?,
                _ => crate::sync::gil::detach(py, alloc)?,
            }
        };
        let device = memory_device(route, stream.get().device);
        Ok(Buffer::new(Core::new(Memory::Pool(buffer), stream, Kind::of(route), device)))
    }

    /// Exports the pool as a new POSIX file descriptor, yours to send (for instance with
    /// `multiprocessing.reduction.send_handle`) and to close (`os.close`). The pool must be
    /// created with `handle_types=HandleTypes.POSIX_FILE_DESCRIPTOR` (NotShareableError).
    fn export_fd(&self, py: Python<'_>) -> Outcome<i32> {
        crate::memory::sharing::export_descriptor(py, &self.pool()?)
    }

    /// Imports a pool another process exported with `export_fd`; `fd` stays yours to close.
    /// A descriptor that is not open raises NotShareableError, one that is not a pool's
    /// SharingRefusedError. Allocating from an imported pool is refused: map the exporter's
    /// buffers with `import_buffer`.
    #[staticmethod]
    fn import_fd(py: Python<'_>, fd: i32) -> Outcome<Self> {
        Ok(Self::wrap(crate::memory::sharing::import_descriptor(py, fd)?))
    }

    /// Sends the pool's descriptor (SCM_RIGHTS) and route over a connected Unix-domain socket:
    /// a `socket.socket`, a `multiprocessing` connection, or a descriptor.
    fn send(&self, py: Python<'_>, socket: &Bound<'_, PyAny>) -> Outcome<()> {
        crate::memory::sharing::send_pool(py, &self.pool()?, socket)
    }

    /// Receives a pool sent with `send` over a Unix-domain socket and imports it
    /// (MalformedMessageError for a message `send` did not write, or a closed peer).
    #[staticmethod]
    fn receive(py: Python<'_>, socket: &Bound<'_, PyAny>) -> Outcome<Self> {
        Ok(Self::wrap(crate::memory::sharing::receive_pool(py, socket)?))
    }

    /// Maps an allocation of the exporting process (`shared`, from its `Buffer.export()`) from
    /// this imported pool, ordered on `stream`. Close the mapping (and let its stream's work
    /// finish) before the exporter frees the allocation; wait for the exporter's writes before
    /// reading.
    #[pyo3(signature = (shared, stream = None))]
    fn import_buffer(
        &self,
        py: Python<'_>,
        shared: PyRef<'_, SharedAllocation>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> Outcome<Buffer> {
        let pool = self.pool()?;
        let stream = Stream::from_object(py, stream, Self::home_device(pool.route()))?;
        Ok(Buffer::new(crate::memory::sharing::import_allocation(py, &pool, &shared, stream)?))
    }

    /// The raw `CUmemoryPool` as an int (for `cupy.cuda.MemoryAsyncPool(pool_handles=...)` or
    /// RMM's `CudaAsyncViewMemoryResource`); valid while this handle is open.
    #[getter]
    fn handle(&self) -> Outcome<usize> {
        Ok(self.pool()?.as_raw() as usize)
    }

    /// The route the pool serves (`None` for an imported pool).
    #[getter]
    fn route(&self) -> Outcome<Option<Route>> {
        Ok(self.pool()?.route().map(Route))
    }

    /// Whether this handle keeps the pool alive (false for the driver's default pools).
    #[getter]
    fn is_owned(&self) -> Outcome<bool> {
        Ok(self.pool()?.is_owned())
    }

    /// Whether the host may touch the pool's memory.
    #[getter]
    fn is_host_accessible(&self) -> Outcome<bool> {
        Ok(self.pool()?.is_host_accessible())
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        crate::sync::locks::lock(&self.pool).is_none()
    }

    /// Gives memory held beyond `keep_bytes` back to the system.
    fn trim_to(&self, py: Python<'_>, keep_bytes: usize) -> Outcome<()> {
        let pool = self.pool()?;
        Ok(crate::sync::gil::detach(py, || pool.trim_to(keep_bytes))?)
    }

    /// Grants `device` an access (a member of `cumempool.Access`) to the pool's memory.
    fn set_access(&self, py: Python<'_>, device: Device, access: &Bound<'_, PyAny>) -> Outcome<()> {
        let access = access_from_python(access)?;
        let pool = self.pool()?;
        Ok(crate::sync::gil::detach(py, || pool.set_access(device.0, access))?)
    }

    /// The access `device` has to the pool's memory, a member of `cumempool.Access`.
    fn access(&self, py: Python<'_>, device: Device) -> Outcome<Py<PyAny>> {
        let pool = self.pool()?;
        let access = crate::sync::gil::detach(py, || pool.access(device.0))?;
        Ok(access_to_python(py, access)?)
    }

    /// Every attribute the driver answers, as a dict of the attribute's C name to its value;
    /// attributes the driver refuses (too old) are left out.
    fn attributes(&self, py: Python<'_>) -> Outcome<std::collections::BTreeMap<&'static str, u64>> {
        let pool = self.pool()?;
        let all = crate::sync::gil::detach(py, || pool.attributes());
        Ok(all.into_iter().filter_map(|(a, v)| v.ok().map(|v| (a.name(), v))).collect())
    }

    /// Whether the pool may reuse memory freed on another stream once an event orders that free
    /// before the allocation (the driver's default: `True`).
    #[getter]
    fn reuse_follow_event_dependencies(&self) -> Outcome<bool> {
        Ok(self.pool()?.reuse_follow_event_dependencies()?)
    }

    #[setter]
    fn set_reuse_follow_event_dependencies(&self, enabled: bool) -> Outcome<()> {
        Ok(self.pool()?.set_reuse_follow_event_dependencies(enabled)?)
    }

    /// Whether the pool may reuse memory whose free has already finished, whichever stream
    /// freed it (the driver's default: `True`).
    #[getter]
    fn reuse_allow_opportunistic(&self) -> Outcome<bool> {
        Ok(self.pool()?.reuse_allow_opportunistic()?)
    }

    #[setter]
    fn set_reuse_allow_opportunistic(&self, enabled: bool) -> Outcome<()> {
        Ok(self.pool()?.set_reuse_allow_opportunistic(enabled)?)
    }

    /// Whether the pool may make an allocation wait for another stream's pending free to reuse
    /// its memory (the driver's default: `True`).
    #[getter]
    fn reuse_allow_internal_dependencies(&self) -> Outcome<bool> {
        Ok(self.pool()?.reuse_allow_internal_dependencies()?)
    }

    #[setter]
    fn set_reuse_allow_internal_dependencies(&self, enabled: bool) -> Outcome<()> {
        Ok(self.pool()?.set_reuse_allow_internal_dependencies(enabled)?)
    }

    /// Bytes kept reserved at a synchronisation before memory goes back to the system.
    #[getter]
    fn release_threshold(&self) -> Outcome<u64> {
        Ok(self.pool()?.release_threshold()?)
    }

    #[setter]
    fn set_release_threshold(&self, bytes: u64) -> Outcome<()> {
        Ok(self.pool()?.set_release_threshold(bytes)?)
    }

    /// Bytes the pool holds from the system now.
    #[getter]
    fn reserved_mem_current(&self) -> Outcome<u64> {
        Ok(self.pool()?.reserved_mem_current()?)
    }

    /// The high-water mark of the reserved bytes.
    #[getter]
    fn reserved_mem_high(&self) -> Outcome<u64> {
        Ok(self.pool()?.reserved_mem_high()?)
    }

    /// Resets `reserved_mem_high` to the current value.
    fn reset_reserved_mem_high(&self) -> Outcome<()> {
        Ok(self.pool()?.reset_reserved_mem_high()?)
    }

    /// Bytes allocated from the pool now.
    #[getter]
    fn used_mem_current(&self) -> Outcome<u64> {
        Ok(self.pool()?.used_mem_current()?)
    }

    /// The high-water mark of the used bytes.
    #[getter]
    fn used_mem_high(&self) -> Outcome<u64> {
        Ok(self.pool()?.used_mem_high()?)
    }

    /// Resets `used_mem_high` to the current value.
    fn reset_used_mem_high(&self) -> Outcome<()> {
        Ok(self.pool()?.reset_used_mem_high()?)
    }

    /// The pool's allocation type, read from the driver (CUDA 13.2).
    #[getter]
    fn allocation_type(&self) -> Outcome<AllocationType> {
        gated!(
            "cuda-13020",
            CUDA_13_2,
            "CU_MEMPOOL_ATTR_ALLOCATION_TYPE",
            AllocationType::from_rust(self.pool()?.allocation_type_attribute()?)
        )
    }

    /// The handle types the pool can export, read from the driver (CUDA 13.2).
    #[getter]
    fn export_handle_types(&self, py: Python<'_>) -> Outcome<Py<PyAny>> {
        let bits = gated!(
            "cuda-13020",
            CUDA_13_2,
            "CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES",
            self.pool()?.export_handle_types()?.bits()
        )?;
        Ok(crate::values::enums::handle_types(py, bits)?)
    }

    /// The pool's location, read from the driver (CUDA 13.2).
    #[getter]
    fn location(&self) -> Outcome<Location> {
        gated!("cuda-13020", CUDA_13_2, "CU_MEMPOOL_ATTR_LOCATION_TYPE", Location(self.pool()?.location_attribute()?))
    }

    /// The most bytes the pool may hold, 0 for no limit (CUDA 13.2).
    #[getter]
    fn max_pool_size(&self) -> Outcome<u64> {
        gated!("cuda-13020", CUDA_13_2, "CU_MEMPOOL_ATTR_MAX_POOL_SIZE", self.pool()?.max_pool_size()?)
    }

    /// Whether the hardware decompression engine may use the memory (CUDA 13.2).
    #[getter]
    fn hw_decompress_enabled(&self) -> Outcome<bool> {
        gated!("cuda-13020", CUDA_13_2, "CU_MEMPOOL_ATTR_HW_DECOMPRESS_ENABLED", self.pool()?.hw_decompress_enabled()?)
    }

    /// The locality domain the pool is placed in, or `None` (CUDA 13.4).
    #[getter]
    fn locality_domain_id(&self) -> Outcome<Option<u8>> {
        gated!("cuda-13040", CUDA_13_4, "CU_MEMPOOL_ATTR_LOCALITY_DOMAIN_ID", self.pool()?.locality_domain_id()?)
    }

    /// Lets go of this handle. An owned pool is destroyed once its buffers and routes are gone
    /// too. Using the handle afterwards raises ClosedError; closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let pool = crate::sync::locks::lock(&self.pool).take();
        if let Some(pool) = pool {
            crate::sync::gil::detach(py, || drop(pool));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        match self.pool() {
            Ok(pool) => format!(
                "<cumempool.MemPool handle={:#x} route={} owned={}>",
                pool.as_raw() as usize,
                pool.route().map_or_else(|| "None".to_owned(), crate::values::route_values::route_repr),
                if pool.is_owned() { "True" } else { "False" }
            ),
            Err(_) => "<cumempool.MemPool closed>".to_owned(),
        }
    }
}
