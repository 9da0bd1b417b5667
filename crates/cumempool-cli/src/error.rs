//! What can stop a command: the library's errors, kept whole, and the command's own failures.

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The safe layer refused or the driver failed.
    #[error(transparent)]
    Pool(#[from] cumempool::Error),
    /// The allocator layer (the cache or a pool resource) failed.
    #[error(transparent)]
    Alloc(#[from] cumempool_alloc::Error),
    /// An allocation or free inside a timed benchmark loop failed; the loop only counts failures,
    /// so the figure it was measuring is meaningless.
    #[error("{measurement}: an allocation or free failed during the run")]
    BenchRunFailed { measurement: &'static str },
    /// The report could not be written where it was asked to go.
    #[error("writing {path}: {source}")]
    Write { path: std::path::PathBuf, source: std::io::Error },
}

/// A missing driver or entry point, as the safe layer names it, so `?` works on raw `sys` calls.
impl From<cumempool::sys::LoadError> for Error {
    fn from(error: cumempool::sys::LoadError) -> Self {
        Self::Pool(error.into())
    }
}

impl Error {
    /// Whether the failure is the driver library itself missing, which `doctor` explains.
    pub fn is_missing_driver(&self) -> bool {
        matches!(
            self,
            Self::Pool(cumempool::Error::Load(_))
                | Self::Alloc(cumempool_alloc::Error::Pool(cumempool::Error::Load(_)))
        )
    }
}

/// The command's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
