//! The entry points of the bindings, numbered in the bindings' order: the index every table of
//! this crate (wrappers, real pointers, counters) is kept by.

macro_rules! entry_names {
    ($($name:ident: $pfn:ty = $since:literal,)*) => {
        /// The entry points' names; an entry's index is its position here.
        pub(crate) const NAMES: &[&str] = &[$(stringify!($name),)*];
    };
}
cumempool_sys::for_each_entry_point!(entry_names);

/// How many entry points the bindings declare.
pub(crate) const COUNT: usize = NAMES.len();

/// The index of the entry point `name`.
pub(crate) fn index_of(name: &str) -> Option<usize> {
    NAMES.iter().position(|n| *n == name)
}
