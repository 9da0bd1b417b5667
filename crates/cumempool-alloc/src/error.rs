//! The crate's one error type.

use cumempool::Route;

/// `Result` with this crate's [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong allocating through a resource.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pool or driver failed (its own out-of-memory included).
    #[error(transparent)]
    Pool(#[from] cumempool::Error),

    /// A [`Limit`](crate::Limit) adaptor refused the allocation.
    #[error(
        "out of memory: {requested} bytes would take the resource past its limit of {limit} bytes ({in_use} in use)"
    )]
    LimitExceeded {
        /// Bytes asked for.
        requested: usize,
        /// The cap.
        limit: usize,
        /// Bytes in use when asked.
        in_use: usize,
    },

    /// An alignment the resource cannot give.
    #[error("alignment {requested} is not supported: {reason}")]
    Alignment {
        /// The alignment asked for.
        requested: usize,
        /// Why, and what would work.
        reason: String,
    },

    /// A pool whose route does not hold the memory kind the resource type promises.
    #[error("a pool of {route} does not hold {kind} memory; use a pool whose route does")]
    KindMismatch {
        /// The pool's route.
        route: Route,
        /// The kind the resource promises.
        kind: &'static str,
    },

    /// A cache could not take the blocks that threads keep in their lanes: the `membarrier`
    /// system call it needs started failing (for good, as under a seccomp filter, or on every
    /// try of this call, as with ENOMEM), or the process is a forked child of the one that made
    /// the cache. What else it held was given back; the lanes' blocks stay cached until a later
    /// call can take them (never, for the permanent causes) or the cache is dropped.
    #[error("cached blocks in threads' lanes are out of reach: {reason}")]
    LanesUnreachable {
        /// What failed, and what would work.
        reason: &'static str,
    },

    /// A host allocation failed (the test heap).
    #[error("the host heap could not allocate {requested} bytes")]
    HostOutOfMemory {
        /// Bytes asked for.
        requested: usize,
    },

    /// An [`Arena`](crate::Arena)'s reserved range has no free span that large.
    #[error("out of memory: the arena's {reserved} reserved bytes hold no free span of {requested} bytes; build it with a larger reservation")]
    ArenaExhausted {
        /// Bytes asked for.
        requested: usize,
        /// The arena's reserved bytes.
        reserved: usize,
    },

    /// A pointer an [`Arena`](crate::Arena) did not hand out (or that was freed already).
    #[error("{ptr:#x} is no live allocation of this arena: free and export only what its allocate returned, once")]
    NotFromArena {
        /// The pointer given.
        ptr: u64,
    },

    /// An arena allocation that shares a chunk with other allocations, which
    /// [`Arena::export_fd`](crate::Arena::export_fd) refuses: a peer maps whole chunks, so it
    /// would reach the neighbours too.
    #[error("the arena allocation at {ptr:#x} ({len} bytes, starting {offset_in_chunk} bytes into a chunk) does not own its chunks, and exporting it would let another process reach the allocations that share them; export only an allocation that is a multiple of the chunk size ({chunk_size} bytes) and aligned to it: arena.allocate(k * {chunk_size}, {chunk_size}, &stream)")]
    NotExportable {
        /// The allocation's address.
        ptr: u64,
        /// Its length as the arena keeps it (rounded up to 256 bytes).
        len: usize,
        /// How far into its first chunk it starts.
        offset_in_chunk: usize,
        /// The arena's chunk size.
        chunk_size: usize,
    },

    /// [`Arena::trim`](crate::Arena::trim) while registrations need every chunk mapped.
    #[error("the arena cannot unmap chunks while {holders} registration(s) hold its mappings (NCCL caches them); drop the registrations first")]
    MappingsHeld {
        /// How many holds are alive.
        holders: usize,
    },
}

impl Error {
    /// Whether the failure means "no memory": the pool's own out-of-memory, a [`Limit`](crate::Limit)
    /// refusal or the host heap's. Every layer answers it the same way (a cache gives its blocks
    /// back and retries), as RMM's limiting adaptor answers with the upstream's out-of-memory.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Self::Pool(error) => error.is_out_of_memory(),
            Self::LimitExceeded { .. } | Self::HostOutOfMemory { .. } | Self::ArenaExhausted { .. } => true,
            Self::Alignment { .. } | Self::KindMismatch { .. } | Self::LanesUnreachable { .. } => false,
            Self::NotFromArena { .. } | Self::NotExportable { .. } | Self::MappingsHeld { .. } => false,
        }
    }
}
