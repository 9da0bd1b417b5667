//! The kinds of shareable handle a pool can export: a bit set over `CUmemAllocationHandleType`.

use cumempool_sys as sys;
use std::fmt;
use std::ops::{BitOr, BitOrAssign};

/// A set of export handle types. Bits this crate does not name are kept, not dropped.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HandleTypes(u32);

impl HandleTypes {
    /// No export: the pool stays private to this process.
    pub const NONE: Self = Self(0);
    /// A POSIX file descriptor (Linux).
    pub const POSIX_FILE_DESCRIPTOR: Self =
        Self(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);
    /// A Win32 NT handle.
    pub const WIN32: Self = Self(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32.0);
    /// A Win32 KMT handle.
    pub const WIN32_KMT: Self = Self(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_WIN32_KMT.0);
    /// A fabric handle (multi-node NVLink).
    pub const FABRIC: Self = Self(sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0);

    const NAMED: [(Self, &'static str); 4] = [
        (Self::POSIX_FILE_DESCRIPTOR, "POSIX_FILE_DESCRIPTOR"),
        (Self::WIN32, "WIN32"),
        (Self::WIN32_KMT, "WIN32_KMT"),
        (Self::FABRIC, "FABRIC"),
    ];

    /// From raw bits, unknown ones included.
    pub const fn from_bits(bits: u32) -> Self {
        Self(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// The driver's form.
    pub const fn to_raw(self) -> sys::CUmemAllocationHandleType {
        sys::CUmemAllocationHandleType(self.0)
    }

    /// Whether every type in `other` is in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether every bit of the set has a name here (the empty set included).
    pub fn is_known(self) -> bool {
        let known = Self::NAMED.iter().fold(0, |acc, (t, _)| acc | t.0);
        self.0 & !known == 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The names of the types in the set; unknown bits as hex.
    pub fn names(self) -> Vec<String> {
        let mut names: Vec<String> =
            Self::NAMED.iter().filter(|(t, _)| self.contains(*t)).map(|(_, n)| (*n).to_owned()).collect();
        let known = Self::NAMED.iter().fold(0, |acc, (t, _)| acc | t.0);
        if self.0 & !known != 0 {
            names.push(format!("{:#x}", self.0 & !known));
        }
        names
    }
}

impl BitOr for HandleTypes {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for HandleTypes {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for HandleTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandleTypes({self})")
    }
}

impl fmt::Display for HandleTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("NONE");
        }
        f.write_str(&self.names().join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_print_names_and_keep_unknown_bits() {
        let set = HandleTypes::POSIX_FILE_DESCRIPTOR | HandleTypes::FABRIC;
        assert_eq!(set.to_string(), "POSIX_FILE_DESCRIPTOR | FABRIC");
        assert_eq!(set.bits(), 0x9);
        assert!(set.contains(HandleTypes::FABRIC) && !set.contains(HandleTypes::WIN32));
        assert_eq!(HandleTypes::from_bits(0x30).to_string(), "0x30");
        assert_eq!(HandleTypes::NONE.to_string(), "NONE");
    }
}
