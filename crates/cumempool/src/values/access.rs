//! The access a device has to a pool's memory.

use crate::values::unknown_value::UnknownValue;
use cumempool_sys as sys;

/// Access a device has to a pool's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// No access.
    None,
    /// Read-only access.
    Read,
    /// Read-write access.
    ReadWrite,
}

impl Access {
    pub(crate) fn to_raw(self) -> sys::CUmemAccess_flags {
        match self {
            Self::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
            Self::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Self::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    pub(crate) fn from_raw(raw: sys::CUmemAccess_flags) -> Result<Self, UnknownValue> {
        match raw {
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE => Ok(Self::None),
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ => Ok(Self::Read),
            sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => Ok(Self::ReadWrite),
            other => Err(UnknownValue { type_name: "CUmemAccess_flags", value: other.0.into() }),
        }
    }
}
