//! Values read back from the driver that this crate does not know (a newer driver's).

/// A raw value of a C enum that this version of the crate has no name for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the driver returned {value} for {type_name}, which this version of cumempool does not know; a newer cumempool may"
)]
pub struct UnknownValue {
    /// The C type.
    pub type_name: &'static str,
    /// The raw value.
    pub value: i64,
}
