//! Pure values, below the error type and the driver: locations and allocation types, routes,
//! access flags, export handle types, and values a newer driver reports that the crate does not
//! know. None of them calls the driver.

pub(crate) mod access;
pub(crate) mod export_handles;
pub(crate) mod location;
pub(crate) mod route;
pub(crate) mod unknown_value;
