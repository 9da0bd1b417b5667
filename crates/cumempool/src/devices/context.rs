//! The primary context of a device: retained, made current, released.

use crate::devices::device::Device;
use crate::driver::driver_call;
use crate::driver::handle::DriverHandle;
use crate::error::{Error, Result};
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
    raw: DriverHandle<sys::CUcontext>,
    device: Device,
}

impl Context {
    pub(crate) fn retain_primary(device: Device) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        unsafe { driver_call!(cuDevicePrimaryCtxRetain(&mut raw, device.as_raw())) }?;
        Ok(Self(Arc::new(Retained { raw: DriverHandle(raw), device })))
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
    /// # Errors
    /// The driver's answer.
    ///
    /// See [cuCtxSetCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    pub fn make_current(&self) -> Result<()> {
        set_current(self.0.raw.0)
    }

    /// Whether this context is the calling thread's current one (`cuCtxGetCurrent`, a
    /// thread-local read inside libcuda). The runtime's current device (`cudaGetDevice`) is the
    /// current context's device, so this also says that the runtime's current device is this
    /// context's, without a call into the runtime.
    ///
    /// # Errors
    /// The driver's answer.
    ///
    /// See [cuCtxGetCurrent](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
    #[inline]
    pub fn is_current(&self) -> Result<bool> {
        Ok(current()? == self.0.raw.0)
    }

    /// Makes this context current unless it already is.
    ///
    /// Asks the driver every time (`cuCtxGetCurrent` is a thread-local read inside libcuda, a few
    /// nanoseconds): other code in the process (the runtime's `cudaSetDevice`, a push or a pop)
    /// may have changed the current context since this crate last set it.
    #[inline]
    pub(crate) fn ensure_current(&self) -> Result<()> {
        if self.is_current()? {
            return Ok(());
        }
        self.make_current()
    }

    /// Runs `f` with this context current, then makes current again whatever was current before
    /// (no context included): for destructors, which run wherever the value is dropped, and for
    /// layers above that must not leave the calling thread on another device (the runtime's
    /// `cudaSetDevice` state lives in the current context, and Python code reads it).
    ///
    /// # Errors
    /// The driver's refusal to read or set the current context; `f`'s failure wins over a failure
    /// to restore, and `f`'s value is returned only when the previous context was restored.
    pub fn while_current<R, E: From<Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        let previous = current()?;
        if previous == self.0.raw.0 {
            return f();
        }
        self.make_current()?;
        let result = f();
        let restored = set_current(previous);
        let value = result?;
        restored?;
        Ok(value)
    }

    /// Waits for all work in this context.
    ///
    /// # Errors
    /// The driver's answer, which includes errors of earlier asynchronous work.
    pub fn synchronize(&self) -> Result<()> {
        self.ensure_current()?;
        // SAFETY: a retained context (cuCtxSynchronize_v2 takes it explicitly).
        unsafe { driver_call!(cuCtxSynchronize(self.0.raw.0)) }
    }

    /// Free and total memory of this context's device, in bytes.
    ///
    /// # Errors
    /// The driver's answer.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ensure_current()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers; the context is current.
        unsafe { driver_call!(cuMemGetInfo(&mut free, &mut total)) }?;
        Ok((free, total))
    }
}

/// Runs `f`, then makes current again the context that was current before it (or none), if `f`
/// changed it: for work on a legacy stream, which makes its stream's context current. One
/// `cuCtxGetCurrent` before and one after when nothing changed.
///
/// # Errors
/// The driver's refusal to read or set the current context; `f`'s failure wins over a failure
/// to restore.
pub fn keeping_current_context<R, E: From<Error>>(
    f: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    let previous = current()?;
    let outcome = f();
    let restored = match current() {
        Ok(now) if now == previous => Ok(()),
        Ok(_) => set_current(previous),
        Err(error) => Err(error),
    };
    let value = outcome?;
    restored?;
    Ok(value)
}

/// The device of the calling thread's current context, or `None` when no context is current.
///
/// # Errors
/// The driver's answer.
///
/// See [cuCtxGetDevice](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html).
pub fn current_device() -> Result<Option<Device>> {
    let context = current()?;
    if context.is_null() {
        return Ok(None);
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: a valid out-pointer; the calling thread's current context.
    unsafe { driver_call!(cuCtxGetDevice(&mut device, context)) }?;
    // A device handle is its ordinal (cuDeviceGet(&d, i) gives d == i).
    Device::get(device).map(Some)
}

/// The calling thread's current context (null for none).
fn current() -> Result<sys::CUcontext> {
    let mut current = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    unsafe { driver_call!(cuCtxGetCurrent(&mut current)) }?;
    Ok(current)
}

/// Makes `raw` (a live context, or null for none) current on the calling thread.
fn set_current(raw: sys::CUcontext) -> Result<()> {
    // SAFETY: a retained context, or null, which unbinds the thread's context.
    unsafe { driver_call!(cuCtxSetCurrent(raw)) }
}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain_primary`.
        let result = unsafe { driver_call!(cuDevicePrimaryCtxRelease(self.device.as_raw())) };
        if let Err(error) = result {
            tracing::warn!(%error, device = self.device.ordinal(), "releasing a primary context failed");
        }
    }
}

impl Device {
    /// Retains the device's primary context (released when the last clone is dropped).
    ///
    /// # Errors
    /// The driver's refusal (`cuDevicePrimaryCtxRetain`).
    ///
    /// See [cuDevicePrimaryCtxRetain](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PRIMARY__CTX.html).
    pub fn primary_context(self) -> Result<Context> {
        Context::retain_primary(self)
    }
}
