//! CUDA versions, in the driver's numbering (`13020` is 13.2).

use std::fmt;

/// A CUDA driver version, as `cuDriverGetVersion` reports it (`13000` for 13.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// CUDA 12.0: `cuGetProcAddress_v2`, which the loader needs.
    pub const CUDA_12_0: Self = Self(12000);
    /// CUDA 11.2: stream-ordered allocation and memory pools.
    pub const CUDA_11_2: Self = Self(11020);
    /// CUDA 13.0: location-keyed routing.
    pub const CUDA_13_0: Self = Self(13000);
    /// CUDA 13.2: the six new pool attributes.
    pub const CUDA_13_2: Self = Self(13020);
    /// CUDA 13.4: locality domains and `cuMemGetLocationInfo`.
    pub const CUDA_13_4: Self = Self(13040);
    /// CUDA 13.5.
    pub const CUDA_13_5: Self = Self(13050);

    /// The major version (13 for 13.2).
    pub fn major(self) -> i32 {
        self.0 / 1000
    }

    /// The minor version (2 for 13.2).
    pub fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}
