//! The crate's one error type, and how an NCCL result code becomes it.

use crate::bindings::{ncclComm_t, ncclResult_t};
use crate::loader::{nccl, LoadError};
use std::ffi::CStr;
use std::time::Duration;

/// `Result` with this crate's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, each variant saying what was wrong and what would be right.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// NCCL, or one of its functions, is not available.
    #[error(transparent)]
    Load(#[from] LoadError),

    /// An NCCL call failed.
    #[error("{function} failed with {name} ({code}): {description}{}", detail(.last_error))]
    Nccl {
        /// The function, such as `ncclAllReduce`.
        function: &'static str,
        /// The raw `ncclResult_t`.
        code: u32,
        /// Its name, such as `ncclInvalidArgument`.
        name: &'static str,
        /// NCCL's description of the code.
        description: String,
        /// NCCL's last error message (`ncclGetLastError`), where it had one.
        last_error: String,
    },

    /// A CUDA call (streams, contexts, arenas) failed.
    #[error(transparent)]
    Cuda(#[from] cumempool::Error),

    /// An arena refused (holding its mappings, for instance).
    #[error(transparent)]
    Arena(#[from] cumempool_alloc::Error),

    /// A buffer on a device other than the communicator's.
    #[error("{what}: the buffer is {found}, but the communicator's rank runs on device {device}; give each rank buffers of its own device")]
    WrongDevice {
        /// What was being done.
        what: &'static str,
        /// Where the buffer is, in words ("on device 1", "host memory").
        found: String,
        /// The communicator's device.
        device: i32,
    },

    /// More elements than a buffer holds, or a count whose bytes overflow.
    #[error("{what}: {count} elements of {element_size} bytes{} do not fit the buffer's {capacity} bytes", times(*.ranks))]
    DoesNotFit {
        /// What was being done.
        what: &'static str,
        /// The element count asked for.
        count: usize,
        /// The element size.
        element_size: usize,
        /// The factor the count is multiplied by (the rank count for gathers), 1 otherwise.
        ranks: usize,
        /// The buffer's size in bytes.
        capacity: usize,
    },

    /// A rank or peer outside the communicator.
    #[error("{what}: rank {rank} does not exist in a communicator of {size} ranks (0..{size})")]
    NoSuchRank {
        /// What was being done.
        what: &'static str,
        /// The rank given.
        rank: i32,
        /// The communicator's size.
        size: i32,
    },

    /// Ranks that disagree on the communicator's size, found in the unique-id exchange.
    #[error("the unique id was sent for a communicator of {sent} ranks, but this rank expects {expected}; every rank must pass the same size")]
    RankCountMismatch {
        /// The size the sender announced.
        sent: i32,
        /// The size this rank was given.
        expected: i32,
    },

    /// A unique id this process already used for the same rank: it belongs to another
    /// communicator, whose root no longer waits for ranks.
    #[error("this unique id already created rank {rank} of a communicator in this process; every communicator needs a fresh id from UniqueId::new")]
    UniqueIdReused {
        /// The rank it was used for.
        rank: i32,
    },

    /// Bytes that are not what the unique-id exchange sends.
    #[error("receiving a unique id: {reason}")]
    MalformedId {
        /// What was wrong.
        reason: String,
    },

    /// A stream-ordered collective did not finish in time (a peer died or hangs); the
    /// communicator was aborted.
    #[error("{what} did not finish within {waited:?} (a peer may have died); the communicator was aborted: create a new one")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },

    /// A call that cannot be made inside [`group`](crate::group())'s closure, where NCCL launches
    /// only at the group's end.
    #[error("{what} was called inside cumempool_nccl::group, where NCCL launches only at the group's end; {instead}")]
    InsideGroup {
        /// What was called.
        what: &'static str,
        /// What to do instead.
        instead: &'static str,
    },

    /// A collective queued in a [`group`](crate::group()) touching bytes that another collective
    /// of the group touches, where either writes them: NCCL runs a group's collectives at once,
    /// in no order.
    #[error("{what} touches {len} bytes at {address:#x} that {earlier}, queued earlier in the same group, also touches, and one of them writes them; NCCL runs a group's collectives at once: queue the second after the group, or use buffers that do not overlap")]
    ConflictInGroup {
        /// The collective refused.
        what: &'static str,
        /// The earlier collective of the group.
        earlier: &'static str,
        /// The first byte both touch.
        address: u64,
        /// How many bytes from there both touch.
        len: usize,
    },

    /// A registration (or window) not deregistered because the collectives queued over its
    /// memory could not be waited for first (the driver refused the wait for the communicator's
    /// launch fence): deregistering under them would unmap memory they use. It stays registered
    /// until NCCL releases the communicator.
    #[error("{what}: the collectives queued over the memory could not be waited for ({cause}), so it stays registered until the communicator is destroyed or aborted; keep the memory until then")]
    NotDeregistered {
        /// What was being done.
        what: &'static str,
        /// Why the wait failed (boxed: the error type stays small).
        #[source]
        cause: Box<cumempool::Error>,
    },

    /// A communicator that was aborted (after a timeout or an asynchronous error).
    #[error("the communicator was aborted (after a failure or timeout) and cannot be used; create a new one")]
    Aborted,

    /// A request that cannot be served as asked, for a reason no other variant names (checked
    /// before NCCL).
    #[error("{what}: {reason}")]
    InvalidArgument {
        /// What was being done.
        what: &'static str,
        /// What was wrong, and what would be right: a program can `match` it; its text is the
        /// message's.
        reason: InvalidArgumentReason,
    },

    /// An I/O failure while exchanging the unique id.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Why a request was refused as an invalid argument ([`Error::InvalidArgument`]), with the
/// values a program needs to correct it. Its `Display` is the reason's part of the error's
/// message: what was wrong, and what would be right.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgumentReason {
    /// An empty buffer, which NCCL cannot register.
    #[error("the buffer is empty; register a buffer of at least one byte")]
    EmptyBuffer,
    /// A window whose first address is not on the boundary NCCL requires.
    #[error("the buffer at {address:#x} does not start on a {alignment}-byte boundary, where windows start; allocate with that alignment")]
    Misaligned {
        /// The buffer's first address.
        address: u64,
        /// The alignment required (`NCCL_WIN_REQUIRED_ALIGNMENT`).
        alignment: u64,
    },
    /// An allocation that does not lie in the arena it was given with.
    #[error("{len} bytes at {address:#x} do not lie in the arena at {arena_base:#x}; pass the arena the allocation came from")]
    OutsideArena {
        /// The allocation's first address.
        address: u64,
        /// Its length.
        len: usize,
        /// The arena's first address.
        arena_base: u64,
    },
    /// Windows of one communicator's ranks driven from this process, of unequal sizes: NCCL
    /// requires the same size on every rank and does not check.
    #[error("rank {rank}'s buffer has {bytes} bytes but rank {other_rank}'s has {other_bytes}; a window has the same size on every rank of its communicator, which NCCL does not check: register the same number of bytes on every rank (at most {smallest}, the smallest here)")]
    UnequalWindowSizes {
        /// The first rank given for the communicator.
        rank: i32,
        /// The size of its buffer.
        bytes: usize,
        /// The first rank of the same communicator whose buffer has another size.
        other_rank: i32,
        /// The size of that buffer.
        other_bytes: usize,
        /// The smallest of the communicator's windows in that position.
        smallest: usize,
    },
    /// Ranks of one communicator registering different numbers of windows in one group: NCCL
    /// pairs each rank's `k`-th window with the others', and would wait for the missing ones.
    #[error("rank {rank} registers {windows} windows but rank {other_rank} of the same communicator registers {other_windows}; give every rank the same number of windows")]
    UnequalWindowCounts {
        /// A rank given.
        rank: i32,
        /// How many windows it registers.
        windows: usize,
        /// Another rank of the same communicator.
        other_rank: i32,
        /// How many windows that one registers.
        other_windows: usize,
    },
    /// A collective queued on a stream borrowed without its context: the events that order it
    /// with its buffers' streams are recorded in the stream's context.
    #[error("the stream was borrowed without its context; borrow it with its context (Stream::borrow_raw(handle, Some(&context)))")]
    StreamWithoutContext,
    /// An empty device list.
    #[error("no device was named; name each device once, at least one")]
    NoDevices,
    /// A device named more than once.
    #[error("device {device} is named more than once; name each device once")]
    RepeatedDevice {
        /// The first device named twice.
        device: i32,
    },
    /// More devices than NCCL's C `int` count can hold.
    #[error("{count} devices do not fit a C int; name fewer")]
    TooManyDevices {
        /// The number of devices given.
        count: usize,
    },
    /// Send and receive buffers that overlap other than in NCCL's in-place layout, where NCCL
    /// would read bytes it is writing.
    #[error("the send buffer at {send:#x} overlaps the receive buffer at {recv:#x} without being in place; NCCL runs it in place only with {layout}: pass that, or buffers that do not overlap")]
    OverlapNotInPlace {
        /// The send buffer's address.
        send: u64,
        /// The receive buffer's address.
        recv: u64,
        /// The in-place layout of this collective.
        layout: &'static str,
    },
}

fn detail(last_error: &str) -> String {
    if last_error.is_empty() {
        String::new()
    } else {
        format!(" ({last_error})")
    }
}

fn times(ranks: usize) -> String {
    if ranks > 1 {
        format!(" times {ranks} ranks")
    } else {
        String::new()
    }
}

/// `Ok` for `ncclSuccess`, else [`Error::Nccl`] naming `function`, with NCCL's description and
/// its last error message for `comm`.
pub(crate) fn check(function: &'static str, result: ncclResult_t, comm: Option<ncclComm_t>) -> Result<()> {
    if result == ncclResult_t::ncclSuccess {
        return Ok(());
    }
    Err(nccl_error(function, result, comm))
}

#[cold]
pub(crate) fn nccl_error(function: &'static str, result: ncclResult_t, comm: Option<ncclComm_t>) -> Error {
    let text = |pointer: *const std::ffi::c_char| {
        // SAFETY: NCCL returns a NUL-terminated string it owns, or null.
        (!pointer.is_null()).then(|| unsafe { CStr::from_ptr(pointer) }.to_string_lossy().into_owned())
    };
    let library = nccl().ok();
    // SAFETY: takes any code.
    let description = library.and_then(|l| l.ncclGetErrorString().ok()).and_then(|f| text(unsafe { f(result) }));
    let last_error = library
        .and_then(|l| l.ncclGetLastError().ok())
        // SAFETY: a live communicator or null (NCCL's last error of the process).
        .and_then(|f| text(unsafe { f(comm.unwrap_or(std::ptr::null_mut())) }));
    Error::Nccl {
        function,
        code: result.0,
        name: result_name(result.0),
        description: description.unwrap_or_else(|| "NCCL gave no description".to_owned()),
        last_error: last_error.unwrap_or_default(),
    }
}

/// The name of an `ncclResult_t`.
pub(crate) fn result_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an ncclResult_t this crate does not know",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_was_wrong_and_what_would_be_right() {
        let error = Error::Nccl {
            function: "ncclCommRegister",
            code: 5,
            name: result_name(5),
            description: "invalid usage".into(),
            last_error: "buffer is not VMM memory".into(),
        };
        assert_eq!(
            error.to_string(),
            "ncclCommRegister failed with ncclInvalidUsage (5): invalid usage (buffer is not VMM memory)"
        );
        let fit = Error::DoesNotFit { what: "all-gather", count: 10, element_size: 4, ranks: 2, capacity: 64 };
        assert_eq!(
            fit.to_string(),
            "all-gather: 10 elements of 4 bytes times 2 ranks do not fit the buffer's 64 bytes"
        );
        assert_eq!(result_name(42), "an ncclResult_t this crate does not know");
        let misaligned = Error::InvalidArgument {
            what: "registering a window",
            reason: InvalidArgumentReason::Misaligned { address: 0x1100, alignment: 4096 },
        };
        assert_eq!(
            misaligned.to_string(),
            "registering a window: the buffer at 0x1100 does not start on a 4096-byte boundary, where windows start; allocate with that alignment"
        );
    }
}
