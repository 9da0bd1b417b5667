//! How a pool was made: what a retired pool must match to serve a new pool (see `retirement`).
//! Its own module because the builder that writes it, the owner that keeps it and the retired
//! list that matches it sit on both sides of the pool handles.

use crate::values::export_handles::HandleTypes;
use crate::values::route::Route;

/// The properties a pool was created with. A retired pool (see `retirement`) made with the same
/// recipe, never exported and whose access was never changed, serves a new pool made the same
/// way: the driver holds a bounded number of pools, and a retired one is never destroyed by the
/// library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Recipe {
    pub(crate) route: Route,
    pub(crate) handle_types: HandleTypes,
    pub(crate) max_size: Option<u64>,
    pub(crate) hw_decompress: bool,
}

#[cfg(test)]
impl Recipe {
    /// A device-0 recipe that differs by its maximum size.
    pub(crate) fn for_tests(max_size: u64) -> Self {
        Self {
            route: Route::device(0),
            handle_types: HandleTypes::NONE,
            max_size: Some(max_size),
            hw_decompress: false,
        }
    }
}
