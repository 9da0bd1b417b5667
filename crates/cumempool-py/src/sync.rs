//! Who may run: the GIL, released only around driver calls, and the crate's locks, which
//! outlive a panic. The bottom layer: it uses no other module of the crate.

pub(crate) mod gil;
pub(crate) mod locks;
