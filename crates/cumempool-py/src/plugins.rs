//! The native sides of the plug-ins: PyTorch's pluggable allocator (its C entry points) and
//! CuPy's common case, served in one call.

pub(crate) mod cupy_allocator;
pub(crate) mod torch_plugin;
