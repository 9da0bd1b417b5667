//! The crate's one error type, and the driver's answer it carries when the driver refused.

use crate::values::access::Access;
use crate::values::export_handles::HandleTypes;
use crate::values::location::InvalidLocation;
use crate::values::route::{InvalidRoute, Route};
use crate::values::unknown_value::UnknownValue;
use cumempool_sys as sys;
use cumempool_sys::DriverVersion;
use std::ffi::CStr;

/// `Result` with this crate's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A driver call that did not return `CUDA_SUCCESS`: which call, and what it answered.
///
/// Every error of this crate that comes from the driver carries one (as its
/// [`source`](std::error::Error::source) or as [`Error::Driver`]), so
/// [`Error::cuda_code`] always has the `CUresult`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{function} failed with {name} ({code}): {description}")]
pub struct DriverError {
    /// The entry point, such as `cuMemPoolCreate`.
    pub function: &'static str,
    /// The raw `CUresult`.
    pub code: u32,
    /// Its name, such as `CUDA_ERROR_INVALID_VALUE`.
    pub name: String,
    /// The driver's description of it.
    pub description: String,
}

impl DriverError {
    /// The driver's answer `code` from `function`, named by the driver where it can.
    #[cold]
    pub fn new(function: &'static str, code: sys::CUresult) -> Self {
        let (name, description) = describe(code);
        Self { function, code: code.0, name, description }
    }
}

/// Everything that can go wrong, each variant saying what was wrong and what would be right.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver library, or one of its entry points, is not available.
    #[error(transparent)]
    Load(#[from] sys::LoadError),

    /// A CUDA call in a child process created by `fork()` after the parent used CUDA.
    #[error("CUDA cannot be used in a process forked after its parent initialised CUDA; start the child with exec (std::process::Command) and share pools with descriptor_passing")]
    ForkedChild,

    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),

    /// The pool, or the device behind it, could not supply the memory.
    #[error("out of memory: {function} could not allocate {requested} bytes{}", limit_hint(*.limit))]
    OutOfMemory {
        /// The bytes asked for.
        requested: usize,
        /// The pool's maximum size, where one was set.
        limit: Option<u64>,
        /// The driver call that ran out.
        function: &'static str,
    },

    /// The driver answered an allocation of a non-zero size with success and address 0: a broken
    /// answer, refused rather than handed out as memory (nothing was allocated that could be
    /// freed).
    #[error("{function} reported success but handed out address 0 for {requested} bytes, which is no allocation; the allocation was refused. The driver broke its contract: update it, or report it with the driver version")]
    DriverGaveNullPointer {
        /// The driver call that answered.
        function: &'static str,
        /// The bytes asked for.
        requested: usize,
    },

    /// A device ordinal that does not exist on this machine.
    #[error("there is no CUDA device {ordinal}: {}", devices_present(*.count))]
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices the driver sees.
        count: i32,
    },

    /// A locality domain the device does not have (checked before the driver).
    #[error("device {device} has {count} locality domain(s), numbered 0..{count}: there is no domain {domain}")]
    InvalidLocalityDomain {
        /// The device ordinal.
        device: i32,
        /// The domain asked for.
        domain: u8,
        /// How many domains the device has (`CU_DEVICE_ATTRIBUTE_LOCALITY_DOMAIN_COUNT`).
        count: u32,
    },

    /// Granularities `cuMemGetLocationInfo` refuses, by cuda.h's rules (checked before the driver).
    #[error("location info of {size} bytes with summary granularity {summary} and sampling granularity {sampling}: {reason}")]
    InvalidGranularity {
        /// The bytes asked about.
        size: usize,
        /// The summary granularity asked for.
        summary: usize,
        /// The sampling granularity asked for (0: the system's).
        sampling: usize,
        /// The rule it breaks, and what would be right.
        reason: &'static str,
    },

    /// A (location, allocation type) pair that cannot name a pool.
    #[error(transparent)]
    InvalidRoute(#[from] InvalidRoute),

    /// A location that cannot be given to the driver.
    #[error(transparent)]
    InvalidLocation(#[from] InvalidLocation),

    /// The driver refused a route (it has no pool there, or not on this machine).
    #[error("the driver refused {route}: {cause}")]
    RouteRefused {
        /// The route asked for.
        route: Route,
        /// The driver's answer.
        #[source]
        cause: DriverError,
    },

    /// The running driver is too old for a feature.
    #[error("{feature} needs a CUDA {needs} driver or newer; the running driver is CUDA {found}")]
    DriverTooOld {
        /// What was asked for.
        feature: &'static str,
        /// The driver version it needs.
        needs: DriverVersion,
        /// The running driver's version.
        found: DriverVersion,
    },

    /// A route whose current pool was made current by other code, which this crate cannot keep
    /// alive.
    #[error("the current pool of {route} ({handle:#x}) was made current by other code, which keeps it alive (or not); cumempool hands out no safe handle to it: use current_pool_handle, or reset_current_pool")]
    ForeignCurrentPool {
        /// The route.
        route: Route,
        /// The pool's raw handle, as a number.
        handle: u64,
    },

    /// A pool given for a route it cannot serve.
    #[error("a pool of {pool} cannot be the current pool of {route}: a route takes only pools of its own location and allocation type")]
    PoolRouteMismatch {
        /// The route the pool serves.
        pool: Route,
        /// The route it was given for.
        route: Route,
    },

    /// A pool that cannot be destroyed yet.
    #[error("the pool is still in use by {holders} buffer(s), route(s) or handle(s); drop them first, or let the last one destroy it")]
    PoolInUse {
        /// How many other holders keep it alive.
        holders: usize,
    },

    /// A pool the driver cannot destroy safely, left alive for the rest of the process.
    #[error("the pool was not destroyed: driver 580 crashes in cuMemPoolDestroy on a pool whose fabric export it refused, so it is left alive (leaked) for the rest of the process")]
    UnsafeToDestroy,

    /// `MemPool::into_raw` refused for a pool that was a route's current pool (a retired pool
    /// made anew by the builder included): another thread may still allocate from it through
    /// the route, so the caller must not destroy it. The pool is retired, as a drop would.
    #[error("MemPool::into_raw refused: the pool was a route's current pool (or is a retired pool made anew for this owner), so another thread may still allocate from it through the route, and destroying it with cuMemPoolDestroy could crash the process; it was retired instead (as dropping it does). Keep the MemPool, or build one that is never made current, and call destroy_retired_pools where no thread allocates through a route")]
    PoolWasCurrent,

    /// A copy whose source and destination overlap: undefined for the driver's copies.
    #[error("{what}: the source (address {src:#x}) and the destination (address {dst:#x}) overlap over the {len} bytes copied, and the driver's copies are undefined for overlapping ranges; copy through a separate buffer")]
    OverlappingCopy {
        /// What was being done.
        what: &'static str,
        /// The destination's address.
        dst: u64,
        /// The source's address.
        src: u64,
        /// How many bytes were to be copied.
        len: usize,
    },

    /// A pool creation the driver refused, with the likeliest reason.
    #[error("cannot create a pool for {route}: {reason}")]
    PoolCreation {
        /// The route asked for.
        route: Route,
        /// Why the driver refuses it, and what would work.
        reason: String,
        /// The driver's answer.
        #[source]
        cause: DriverError,
    },

    /// Host code asked for memory the host cannot touch.
    #[error("memory of {} is not accessible from the host; use a host, host NUMA or managed pool, or copy to the host", route_text(.route))]
    NotHostAccessible {
        /// The route the memory came from, where known.
        route: Option<Route>,
    },

    /// Managed memory the host may not touch on this machine.
    #[error("device {device} has no concurrent managed access (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 0): the host must not touch managed memory while any kernel may run; copy it to the host with Buffer::copy_to_host instead")]
    ManagedMemoryNotHostAccessible {
        /// The first device without concurrent managed access.
        device: i32,
    },

    /// More bytes than a buffer holds.
    #[error("{what}: {requested} bytes do not fit the buffer's {capacity} bytes")]
    DoesNotFit {
        /// What was being done.
        what: &'static str,
        /// The bytes asked for.
        requested: usize,
        /// The buffer's size.
        capacity: usize,
    },

    /// An access a device cannot be given to a pool.
    #[error("device {device} cannot be given {access:?} access to this pool: {reason}")]
    AccessNotGrantable {
        /// The device.
        device: i32,
        /// The access asked for.
        access: Access,
        /// Why, and what would work.
        reason: &'static str,
        /// The driver's answer, when it was the driver that refused.
        #[source]
        cause: Option<DriverError>,
    },

    /// A raw stream handle that cannot be borrowed safely.
    #[error("this stream handle cannot be borrowed: {reason}")]
    StreamNotBorrowable {
        /// Why, and what would work.
        reason: &'static str,
    },

    /// An allocation from a pool imported from another process.
    #[error("allocating from an imported pool: the driver only lets the exporting process allocate; allocate there and share the pointer with Buffer::export")]
    ImportedPoolAllocation,

    /// A pool or allocation that cannot be shared as asked (checked before the driver).
    #[error("{what}: {reason}")]
    NotShareable {
        /// What was being done.
        what: &'static str,
        /// Why, and what would work: a program can `match` it; its text is the message's.
        reason: NotShareableReason,
    },

    /// The driver refused to export or import a pool or an allocation.
    #[error("{what}: {cause}; {hint}")]
    SharingRefused {
        /// What was being done.
        what: &'static str,
        /// What the call needs, in the library's words.
        hint: &'static str,
        /// The driver's answer.
        #[source]
        cause: DriverError,
    },

    /// Bytes from a peer that are not what the sharing protocol sends.
    #[error("{what}: {reason}")]
    MalformedMessage {
        /// What was being received.
        what: &'static str,
        /// What was wrong with it.
        reason: String,
    },

    /// An allocation this process has already mapped from its exporter, and not unmapped yet.
    #[error("the allocation at {address:#x} is already imported by a live buffer; the driver maps it once, so use that buffer (or drop it first)")]
    AlreadyImported {
        /// The mapped address.
        address: u64,
    },

    /// Memory mapped from another process, which may write it at any time: it is copied, never
    /// borrowed as a slice.
    #[error("memory imported from another process cannot be borrowed as a slice (the other process may write it at any time); copy it with Buffer::copy_to_host / copy_from_host")]
    ImportedMemoryNotSliceable,

    /// Host memory of a pool that other processes may map (created with export handle types, or
    /// of unknown handle types): it is copied, never borrowed as a slice. The pool may be
    /// exported at any moment, so the pool's handle types decide, not whether it was exported.
    #[error("the buffer's pool {}, so another process may map this memory and write it at any time, and a slice over it would be a data race; copy it with Buffer::copy_to_host / copy_from_host, or allocate from a pool built without export handle types", exportable_text(*.handle_types))]
    ExportableMemoryNotSliceable {
        /// The pool's export handle types; `None` where this process does not know them (a pool
        /// borrowed or taken over with `from_raw`).
        handle_types: Option<HandleTypes>,
    },

    /// Export data whose length (sent by the peer) is more than the driver mapped.
    #[error("the shared allocation claims {claimed} bytes but the driver mapped {mapped}: the export data's length is wrong (or not from Buffer::export); the mapping was undone")]
    SharedLengthMismatch {
        /// The length in the export data.
        claimed: u64,
        /// What the driver mapped from the imported address.
        mapped: u64,
    },

    /// An operating-system call failed (sockets, descriptors), with its cause.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// The driver returned a value this crate does not know (a newer driver).
    #[error(transparent)]
    UnknownValue(#[from] UnknownValue),

    /// A request that cannot be served as asked, for a reason no other variant names (checked
    /// before the driver).
    #[error("{what}: {reason}")]
    InvalidArgument {
        /// What was being done.
        what: &'static str,
        /// What was wrong, and what would be right: a program can `match` it; its text is the
        /// message's.
        reason: InvalidArgumentReason,
    },

    /// An operation refused, before the driver, because its stream is capturing into a graph:
    /// the operation would wait on the host or record an address the graph could outlive. The
    /// capture is left intact.
    #[error("{operation}: {}, and this operation cannot be recorded into a graph soundly; the capture was left intact. Record captured work through Capture (Stream::capture: Capture::alloc, fill, copy), or do this before the capture begins or after it ends", capture_text(*.capture))]
    StreamCapturing {
        /// What was being done.
        operation: &'static str,
        /// The capture's id, where the driver gave one.
        capture: Option<u64>,
    },

    /// The driver refused a capture or graph operation (a `CUDA_ERROR_STREAM_CAPTURE_*` answer).
    #[error("{what}: {cause}; {hint}")]
    CaptureRefused {
        /// What was being done.
        what: &'static str,
        /// What the driver's answer means here, and what would work.
        hint: &'static str,
        /// The driver's answer.
        #[source]
        cause: DriverError,
    },
}

fn capture_text(capture: Option<u64>) -> String {
    // The id is unknown where the legacy stream was refused for another stream's capture: the
    // driver names neither.
    capture.map_or_else(
        || "a stream capture is underway on a blocking stream of the legacy stream's context (the driver names neither that stream nor its capture)".to_owned(),
        |id| format!("stream capture {id} is underway on the stream"),
    )
}

fn exportable_text(handle_types: Option<HandleTypes>) -> String {
    match handle_types {
        Some(types) => format!("was created with export handle types {types}"),
        None => "was not built by this process (from_raw), so its export handle types are unknown".to_owned(),
    }
}

fn route_text(route: &Option<Route>) -> String {
    route.map_or_else(|| "an imported pool of unknown location".to_owned(), |r| r.to_string())
}

fn limit_hint(limit: Option<u64>) -> String {
    match limit {
        Some(limit) => format!(" (the pool's maximum size is {limit} bytes)"),
        None => String::new(),
    }
}

/// The devices this machine has and their ordinals, in words, for [`Error::InvalidDevice`].
fn devices_present(count: i32) -> String {
    match count {
        ..=0 => "this machine has none".to_owned(),
        1 => "this machine has one (the only ordinal is 0)".to_owned(),
        n => format!("this machine has {n} (ordinals 0 to {})", n - 1),
    }
}

impl Error {
    /// The raw `CUresult` when the driver reported the failure.
    pub fn cuda_code(&self) -> Option<u32> {
        match self {
            Self::Driver(cause)
            | Self::RouteRefused { cause, .. }
            | Self::PoolCreation { cause, .. }
            | Self::SharingRefused { cause, .. }
            | Self::CaptureRefused { cause, .. }
            | Self::AccessNotGrantable { cause: Some(cause), .. } => Some(cause.code),
            Self::OutOfMemory { .. } => Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY.0),
            _ => None,
        }
    }

    /// Whether the failure means "no memory": the pool's or the device's out-of-memory, however
    /// it was reported. Caches and adaptors above a pool answer this by giving memory back and
    /// retrying.
    pub fn is_out_of_memory(&self) -> bool {
        self.cuda_code() == Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY.0)
    }

    /// Whether the driver refused legacy-stream work (or answered the legacy stream's capture
    /// question) because a blocking stream of its context captures:
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`. That capture was left intact by a question, and
    /// invalidated by refused work.
    pub(crate) fn is_refused_for_a_blocking_capture(&self) -> bool {
        self.cuda_code() == Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT.0)
    }

    /// Builds the error for a failed driver call, with the driver's name for the code.
    #[cold]
    pub(crate) fn driver(code: sys::CUresult, function: &'static str) -> Self {
        Self::Driver(DriverError::new(function, code))
    }
}

/// The driver's name and description of `code`, or a stand-in when the driver cannot say.
fn describe(code: sys::CUresult) -> (String, String) {
    let text = |f: Option<sys::PFN_cuGetErrorName>| -> Option<String> {
        let f = f?;
        let mut ptr: *const std::ffi::c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string, or fails.
        let ok = unsafe { f(code, &mut ptr) } == sys::CUresult::CUDA_SUCCESS && !ptr.is_null();
        // SAFETY: on success the pointer is a NUL-terminated string owned by the driver.
        ok.then(|| unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
    };
    let driver = sys::driver().ok();
    let name = text(driver.and_then(|d| d.cuGetErrorName().ok()));
    let description = text(driver.and_then(|d| d.cuGetErrorString().ok()));
    (
        name.unwrap_or_else(|| format!("CUresult {}", code.0)),
        description.unwrap_or_else(|| "the driver gave no description".to_owned()),
    )
}

/// The driver's name for a `CUresult`, such as `CUDA_ERROR_INVALID_VALUE` (`CUresult N` where
/// no driver is loaded or it does not know the code).
pub fn error_name(code: sys::CUresult) -> String {
    describe(code).0
}

/// Why a pool, an allocation or a descriptor cannot be shared as asked
/// ([`Error::NotShareable`]). Its `Display` is the reason's part of the error's message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotShareableReason {
    /// An empty buffer (address 0) has no memory to export.
    #[error("an empty buffer has no memory to share")]
    EmptyBuffer,
    /// A pool imported from another process cannot be exported again.
    #[error("this pool was imported; only the process that created it can export it")]
    ImportedPool,
    /// A pool created without the handle type the export needs.
    #[error("the pool was created with export handle types {created}; create it with MemPool::builder(..).export_handle_types(HandleTypes::{wanted}) to share it")]
    PoolWithoutHandleType {
        /// The handle types the pool was created with.
        created: HandleTypes,
        /// The one the export needs.
        wanted: HandleTypes,
    },
    /// Physical memory (`vmm`) created without the handle type the export needs.
    #[error("the memory was created with export handle types {created}; create it with AllocationProperties::handle_types(HandleTypes::{wanted})")]
    MemoryWithoutHandleType {
        /// The handle types the memory was created with.
        created: HandleTypes,
        /// The one the export needs.
        wanted: HandleTypes,
    },
    /// The driver reported success but handed out no valid descriptor.
    #[error("the driver reported success but handed out descriptor {descriptor}")]
    DriverGaveInvalidDescriptor {
        /// What the driver handed out.
        descriptor: i32,
    },
    /// A device without fabric-handle support.
    #[error("device {device} does not support fabric handles (it supports {supported})")]
    NoFabricSupport {
        /// The pool's device.
        device: i32,
        /// The handle types it supports.
        supported: HandleTypes,
    },
    /// Allocations are imported into a pool imported from their exporter, not into a pool of
    /// this process.
    #[error("allocations are imported into a pool imported from the exporting process (MemPool::import_fd), not into one of this process's own")]
    NotAnImportedPool,
    /// A descriptor that is not open in this process.
    #[error("descriptor {descriptor} is not open")]
    DescriptorNotOpen {
        /// The descriptor given.
        descriptor: i32,
    },
    /// No IMEX channel, which fabric handles need.
    #[error("no IMEX channel on this system ({channels} is missing or empty): fabric handles need the IMEX service; within one node share with HandleTypes::POSIX_FILE_DESCRIPTOR")]
    NoImexChannel {
        /// The device directory the channels are looked for in.
        channels: &'static str,
    },
    /// A buffer that was not allocated from a pool this process can export from (a resource's,
    /// or an imported one).
    #[error("only buffers allocated from a pool can be exported (a resource's or an imported buffer cannot); allocate it from a pool created with the POSIX_FILE_DESCRIPTOR handle type")]
    NotPoolMemory,
}

/// Why a request was refused as an invalid argument ([`Error::InvalidArgument`]), with the
/// values a program needs to correct it. Its `Display` is the reason's part of the error's
/// message: what was wrong, and what would be right.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgumentReason {
    /// A size of 0 where only a positive size can be served.
    #[error("the size is 0; give a positive size")]
    ZeroSize,
    /// An alignment that is neither 0 (the driver's default) nor a power of two.
    #[error("alignment {alignment} is not a power of two; give 0 (the driver's default) or a power of two")]
    AlignmentNotPowerOfTwo {
        /// The alignment given.
        alignment: usize,
    },
    /// A size that is not a positive multiple of the allocation granularity.
    #[error("{quantity} {value} is not a positive multiple of {granularity} bytes (the allocation granularity); round it up")]
    NotGranularityMultiple {
        /// Which size it is, such as "the size" or "the chunk size".
        quantity: &'static str,
        /// The size given.
        value: usize,
        /// The granularity it must be a multiple of.
        granularity: usize,
    },
    /// A span of a reserved address range that does not lie inside it (or is empty).
    #[error("{size} bytes at offset {offset} do not lie inside the reserved {reserved} bytes; give a non-empty span inside the range")]
    OutsideReservedRange {
        /// The span's offset into the range.
        offset: usize,
        /// The span's size.
        size: usize,
        /// The range's size.
        reserved: usize,
    },
    /// A span to map that overlaps a mapping already made in the range.
    #[error("{size} bytes at offset {offset} overlap the mapping of {mapped_size} bytes at offset {mapped_offset}; unmap it first")]
    OverlapsMapping {
        /// The new mapping's offset.
        offset: usize,
        /// The new mapping's size.
        size: usize,
        /// The existing mapping's offset.
        mapped_offset: usize,
        /// The existing mapping's size.
        mapped_size: usize,
    },
    /// An offset at which no mapping was made.
    #[error("nothing is mapped at offset {offset}; give the offset a mapping was made at")]
    NothingMapped {
        /// The offset given.
        offset: usize,
    },
    /// An empty list of devices where at least one must be named.
    #[error("no device was named; name at least one")]
    NoDevices,
    /// The device that owns an arena named among its peers.
    #[error("device {device} owns the arena and always has read-write access; name only peer devices")]
    OwnerNamedAsPeer {
        /// The owning device.
        device: i32,
    },
    /// A size that overflows the address space when rounded up to whole units.
    #[error("{bytes} bytes rounded up to {unit}-byte chunks overflow the address space; ask for less")]
    RoundingOverflows {
        /// The size asked for.
        bytes: usize,
        /// The unit it is rounded up to.
        unit: usize,
    },
    /// An allocation that does not fit the chunks it is said to lie in.
    #[error("{len} bytes at offset {offset} do not fit {chunks} chunks of {chunk_size} bytes; give the chunks, chunk size, offset and length the exporter sent")]
    OutsideChunks {
        /// The allocation's offset into the first chunk.
        offset: usize,
        /// The allocation's length.
        len: usize,
        /// How many chunks were given.
        chunks: usize,
        /// Each chunk's size.
        chunk_size: usize,
    },
    /// A byte count larger than this platform's `size_t`.
    #[error("{bytes} bytes does not fit this platform's size_t; ask for at most usize::MAX bytes")]
    ExceedsSizeT {
        /// The bytes asked for.
        bytes: u64,
    },
    /// An allocation range the driver reported running past the end of the address space.
    #[error("the driver reported {size} bytes from {start:#x}, past the end of the address space")]
    RangePastAddressSpace {
        /// The range's first address.
        start: u64,
        /// Its size.
        size: usize,
    },
    /// Memory that is not managed, which never migrates and so has no residency to report.
    #[error(
        "the buffer is pinned memory of {route}, which never migrates; only managed memory has a residency to report"
    )]
    NotManagedMemory {
        /// The buffer's route.
        route: Route,
    },
    /// A fill of pinned host memory, which the driver's memset refuses.
    #[error("the driver's memset refuses pinned host memory; fill a device buffer and copy it in with Capture::copy")]
    PinnedHostFill,
    /// A buffer allocated in one capture used in another.
    #[error("the buffer belongs to capture {buffer_capture}, not to this capture ({capture}); each capture uses its own buffers")]
    BufferOfAnotherCapture {
        /// The capture the buffer was allocated in.
        buffer_capture: u64,
        /// The capture it was given to.
        capture: u64,
    },
    /// An empty payload where at least one byte must go with a descriptor.
    #[error("the payload must hold at least one byte")]
    EmptyPayload,
    /// A stream borrowed without its context, where the context is needed.
    #[error("cudarc needs the stream's context, and this stream was borrowed without one; a stream of a device's primary context can be borrowed with it (Stream::borrow_raw(raw, Some(&context))), while a stream of any other context cannot be handed to cudarc here")]
    StreamWithoutContext,
    /// A context that is not a device's primary context.
    #[error(
        "only primary contexts (CudaContext::new) are supported: a cumempool Context is a retained primary context"
    )]
    NotPrimaryContext,
    /// A device ordinal too large for a `CUdevice` (a C `int`).
    #[error("device ordinal {ordinal} does not fit a CUdevice (at most i32::MAX)")]
    OrdinalTooLarge {
        /// The ordinal given.
        ordinal: usize,
    },
    /// A negative device ordinal.
    #[error("device ordinal {ordinal} is negative; device ordinals count from 0")]
    NegativeOrdinal {
        /// The ordinal given.
        ordinal: i32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_missing_device_names_the_ordinals_there_are() {
        let text = |ordinal, count| Error::InvalidDevice { ordinal, count }.to_string();
        assert_eq!(text(0, 0), "there is no CUDA device 0: this machine has none");
        assert_eq!(text(1, 1), "there is no CUDA device 1: this machine has one (the only ordinal is 0)");
        assert_eq!(text(7, 4), "there is no CUDA device 7: this machine has 4 (ordinals 0 to 3)");
        assert_eq!(text(-1, 2), "there is no CUDA device -1: this machine has 2 (ordinals 0 to 1)");
    }

    #[test]
    fn why_a_share_is_refused_can_be_matched_and_reads_as_before() {
        let error = Error::NotShareable {
            what: "exporting a pool as a fabric handle",
            reason: NotShareableReason::PoolWithoutHandleType {
                created: HandleTypes::POSIX_FILE_DESCRIPTOR,
                wanted: HandleTypes::FABRIC,
            },
        };
        assert!(matches!(error, Error::NotShareable { reason: NotShareableReason::PoolWithoutHandleType { .. }, .. }));
        assert_eq!(
            error.to_string(),
            "exporting a pool as a fabric handle: the pool was created with export handle types POSIX_FILE_DESCRIPTOR; \
             create it with MemPool::builder(..).export_handle_types(HandleTypes::FABRIC) to share it"
        );
        let closed = Error::NotShareable {
            what: "importing a pool",
            reason: NotShareableReason::DescriptorNotOpen { descriptor: 987 },
        };
        assert_eq!(closed.to_string(), "importing a pool: descriptor 987 is not open");
        let imex = NotShareableReason::NoImexChannel { channels: "/dev/nvidia-caps-imex-channels" }.to_string();
        assert!(
            imex.starts_with("no IMEX channel on this system (/dev/nvidia-caps-imex-channels is missing"),
            "{imex}"
        );
    }

    #[test]
    fn why_an_argument_is_refused_can_be_matched_and_says_what_would_be_right() {
        let error = Error::InvalidArgument {
            what: "reserving addresses",
            reason: InvalidArgumentReason::AlignmentNotPowerOfTwo { alignment: 3 },
        };
        assert!(matches!(
            error,
            Error::InvalidArgument { reason: InvalidArgumentReason::AlignmentNotPowerOfTwo { alignment: 3 }, .. }
        ));
        assert_eq!(
            error.to_string(),
            "reserving addresses: alignment 3 is not a power of two; give 0 (the driver's default) or a power of two"
        );
        let odd = InvalidArgumentReason::NotGranularityMultiple { quantity: "the size", value: 3, granularity: 2 };
        assert_eq!(
            odd.to_string(),
            "the size 3 is not a positive multiple of 2 bytes (the allocation granularity); round it up"
        );
        let pinned = InvalidArgumentReason::NotManagedMemory { route: Route::device(1) }.to_string();
        assert!(pinned.contains(&Route::device(1).to_string()) && pinned.contains("only managed memory"), "{pinned}");
        let other = InvalidArgumentReason::BufferOfAnotherCapture { buffer_capture: 4, capture: 9 }.to_string();
        assert!(other.contains("capture 4, not to this capture (9)"), "{other}");
    }

    #[test]
    fn driver_refusals_keep_their_code_and_chain_their_cause() {
        let cause = DriverError {
            function: "cuMemPoolCreate",
            code: 1,
            name: "CUDA_ERROR_INVALID_VALUE".into(),
            description: "invalid argument".into(),
        };
        let error = Error::PoolCreation { route: Route::host(), reason: "because".into(), cause: cause.clone() };
        assert_eq!(error.cuda_code(), Some(1));
        let source = error.source().map(ToString::to_string).unwrap_or_default();
        assert!(source.contains("cuMemPoolCreate") && source.contains("CUDA_ERROR_INVALID_VALUE"), "{source}");
        let io = Error::Io { what: "receiving", source: std::io::Error::from(std::io::ErrorKind::BrokenPipe) };
        let kind = io.source().and_then(|s| s.downcast_ref::<std::io::Error>()).map(std::io::Error::kind);
        assert_eq!(kind, Some(std::io::ErrorKind::BrokenPipe), "the io::Error's kind survives");
        assert!(Error::Driver(DriverError { code: 2, ..cause.clone() }).is_out_of_memory());
        let refused = Error::CaptureRefused { what: "ending a capture", hint: "capture again", cause };
        assert_eq!(refused.cuda_code(), Some(1), "a capture refusal keeps the driver's code");
    }

    #[test]
    fn a_refusal_during_a_capture_names_the_capture_and_the_way_to_record_it() {
        let text = Error::StreamCapturing { operation: "copying to the host", capture: Some(12) }.to_string();
        assert!(text.starts_with("copying to the host: stream capture 12 is underway"), "{text}");
        assert!(text.contains("left intact") && text.contains("Stream::capture"), "{text}");
        let unknown = Error::StreamCapturing { operation: "filling", capture: None }.to_string();
        // The legacy stream's refusal is for another stream's capture: it does not say "on the
        // stream".
        assert!(
            unknown.starts_with(
                "filling: a stream capture is underway on a blocking stream of the legacy stream's context"
            ),
            "{unknown}"
        );
        assert!(!unknown.contains("on the stream"), "{unknown}");
    }
}
