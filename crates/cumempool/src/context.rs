//! The primary context of a device: retained, made current, released.

use crate::device::Device;
use crate::driver::api;
use crate::error::{check, Result};
use crate::handle::Shared;
use cumempool_sys as sys;
use std::sync::Arc;

/// A retained primary context. Clones share one retain; the last drop releases it.
///
/// Operations that need a current context make this one current on the calling thread first,
/// so programs need not manage the context stack themselves.
#[derive(Clone, Debug)]
pub struct Context(Arc<Retained>);

#[derive(Debug)]
struct Retained {
    raw: Shared<sys::CUcontext>,
    device: Device,
}

impl Context {
    pub(crate) fn retain_primary(device: Device) -> Result<Self> {
        let f = api()?.cuDevicePrimaryCtxRetain()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        check(unsafe { f(&mut raw, device.as_raw()) }, "cuDevicePrimaryCtxRetain")?;
        Ok(Self(Arc::new(Retained { raw: Shared(raw), device })))
    }

    /// The device whose primary context this is.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// The driver's handle.
    pub fn as_raw(&self) -> sys::CUcontext {
        self.0.raw.0
    }

    /// Makes this context current on the calling thread.
    ///
    /// See [cuCtxSetCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    pub fn make_current(&self) -> Result<()> {
        let f = api()?.cuCtxSetCurrent()?;
        // SAFETY: a retained context.
        check(unsafe { f(self.0.raw.0) }, "cuCtxSetCurrent")
    }

    /// Makes this context current unless it already is.
    ///
    /// Asks the driver every time (`cuCtxGetCurrent` is a thread-local read inside libcuda, a few
    /// nanoseconds): other code in the process (the runtime's `cudaSetDevice`, a push or a pop)
    /// may have changed the current context since this crate last set it.
    #[inline]
    pub(crate) fn ensure_current(&self) -> Result<()> {
        let get = api()?.cuCtxGetCurrent()?;
        let mut current = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        check(unsafe { get(&mut current) }, "cuCtxGetCurrent")?;
        if current == self.0.raw.0 {
            return Ok(());
        }
        self.make_current()
    }

    /// Waits for all work in this context.
    pub fn synchronize(&self) -> Result<()> {
        self.ensure_current()?;
        let f = api()?.cuCtxSynchronize()?;
        // SAFETY: a retained context (cuCtxSynchronize_v2 takes it explicitly).
        check(unsafe { f(self.0.raw.0) }, "cuCtxSynchronize")
    }

    /// Free and total memory of this context's device, in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ensure_current()?;
        let f = api()?.cuMemGetInfo()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers; the context is current.
        check(unsafe { f(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok((free, total))
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        let result = api().and_then(|d| {
            let f = d.cuDevicePrimaryCtxRelease()?;
            // SAFETY: balances the retain in `retain_primary`.
            check(unsafe { f(self.device.as_raw()) }, "cuDevicePrimaryCtxRelease")
        });
        if let Err(error) = result {
            tracing::warn!(%error, device = self.device.ordinal(), "releasing a primary context failed");
        }
    }
}
