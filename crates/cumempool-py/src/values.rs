//! Values at the edge: the enums, locations and routes, devices, and what this build's CUDA
//! features offer.

pub(crate) mod build_features;
pub(crate) mod device;
pub(crate) mod enums;
pub(crate) mod route_values;
