//! Values this build has only with a CUDA feature (`cuda-13020`, `cuda-13040`, ...): each
//! gate is written once, with [`gated!`], which answers the value where the build has the
//! feature and the too-old error (naming what is missing, the feature and the driver version
//! that brings it) where it does not, so the bindings keep one signature for every build.

/// `Ok($value)` where this build has the cargo feature `$feature`, else the too-old error for
/// `$what`, which needs a driver of `DriverVersion::$needs`. `inputs(...)` names the arguments
/// only `$value` uses, so a build without the feature does not warn of them.
macro_rules! gated {
    ($feature:literal, $needs:ident, $what:literal, $value:expr $(, inputs($($input:ident),+))?) => {{
        #[cfg(feature = $feature)]
        let value: $crate::errors::Outcome<_> = Ok($value);
        #[cfg(not(feature = $feature))]
        let value: $crate::errors::Outcome<_> = {
            $(let _ = ($($input),+);)?
            Err($crate::errors::too_old(
                concat!($what, " (build without ", $feature, ")"),
                cumempool::DriverVersion::$needs,
            ))
        };
        value
    }};
}

pub(crate) use gated;
