//! Buffer and window registrations: zero-copy for VMM memory (arenas, `ncclMemAlloc`), each
//! deregistered when dropped.
//!
//! A registration borrows its communicator and its memory, so neither can go while NCCL may use
//! it, and it is deregistered exactly once: [`Registration::deregister`] consumes it, and a
//! second call does not compile.
//!
//! Deregistering first waits on the host for the collectives queued over the memory
//! ([`QueuedOver`]): `ncclCommDeregister` tears down the mappings NCCL made for the memory at
//! once, and `ncclCommWindowDeregister` works on a private stream that no user stream is ordered
//! with, so a collective still running would touch unmapped memory. Where that wait is refused,
//! the registration is kept, not deregistered: NCCL releases it with the communicator.
//!
//! ```no_run
//! # fn f(comm: &cumempool_nccl::Communicator, memory: &cumempool_nccl::NcclMemory) -> cumempool_nccl::Result<()> {
//! let registration = comm.register(memory)?;
//! registration.deregister()?; // or drop it
//! # Ok(()) }
//! ```
//!
//! ```compile_fail,E0382
//! # fn f(comm: &cumempool_nccl::Communicator, memory: &cumempool_nccl::NcclMemory) -> cumempool_nccl::Result<()> {
//! let registration = comm.register(memory)?;
//! registration.deregister()?;
//! registration.deregister()?; // use of a moved value: deregistering twice cannot be written
//! # Ok(()) }
//! ```

use crate::bindings::{ncclWindow_t, NCCL_WIN_COLL_SYMMETRIC, NCCL_WIN_REQUIRED_ALIGNMENT};
use crate::buffers::DeviceBuffer;
use crate::comm::Communicator;
use crate::error::{check, Error, InvalidArgumentReason, Result};
use crate::loader::nccl;
use crate::ordering::refuse_inside_group;
use cumempool::sys::CUdeviceptr;
use cumempool_alloc::{Arena, MappingHold};
use std::ffi::c_void;
use std::marker::PhantomData;

/// What a deregistration waits for on the host first, so that no collective queued over the
/// memory still runs when NCCL tears its mappings down: every collective the communicator has
/// launched (a registration is the communicator's, and only its collectives use it), through the
/// communicator's launch fence ([`Communicator::wait_for_launches`]), a private stream ordered
/// after each launch. Its wait is one no capture on the user's streams refuses or invalidates
/// (the fence never captures, and is not the legacy stream), and it keeps no stream of the
/// user's alive. A collective queued inside a group whose closure drops the registration is
/// launched only at the group's end, after the deregistration: NCCL then finds the memory
/// unregistered, as if it never was.
#[derive(Clone, Copy, Debug)]
enum QueuedOver {
    /// A registration of its own: waits for the communicator's launches.
    Launches,
    /// A span of an [`ArenaRegistration`], which waits for the communicator's launches once for
    /// all its spans.
    ArenaSpan,
}

impl QueuedOver {
    /// Waits on the host until every collective launched on `comm` so far has finished.
    ///
    /// # Errors
    /// [`Error::NotDeregistered`] where the driver refuses the wait: the caller must then keep
    /// the registration, not deregister it.
    fn wait(self, comm: &Communicator, what: &'static str) -> Result<()> {
        let waited = match self {
            Self::Launches => comm.wait_for_launches(),
            Self::ArenaSpan => Ok(()),
        };
        waited.map_err(|cause| Error::NotDeregistered { what, cause: Box::new(cause) })
    }
}

/// A buffer registered with a communicator (`ncclCommRegister`), deregistered when dropped,
/// after a host wait for the collectives the communicator launched (its launch fence).
#[derive(Debug)]
#[must_use = "dropping a registration deregisters it, after waiting for the collectives queued over it"]
pub struct Registration<'a> {
    comm: &'a Communicator,
    handle: *mut c_void,
    ptr: CUdeviceptr,
    len: usize,
    queued_over: QueuedOver,
    memory: PhantomData<&'a ()>,
}

impl Registration<'_> {
    /// The registered address.
    pub fn as_raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The registered bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: empty buffers are not registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Deregisters now, after a host wait for the collectives queued over the buffer, reporting
    /// NCCL's answer (dropping only logs a failure).
    ///
    /// # Errors
    /// [`Error::NotDeregistered`] where the driver refused the wait for the launch fence: the
    /// buffer stays registered until the communicator is destroyed or aborted; NCCL's refusal.
    pub fn deregister(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.deregister_raw()
    }

    fn deregister_raw(&self) -> Result<()> {
        const WHAT: &str = "deregistering a buffer";
        // Also after an abort that failed: NCCL still holds the registration.
        let raw = self.comm.held()?;
        let deregister = nccl()?.ncclCommDeregister()?;
        self.queued_over.wait(self.comm, WHAT)?;
        // SAFETY: a handle ncclCommRegister gave for this communicator, deregistered once, after
        // every collective queued over its memory has finished (the wait above).
        self.comm.check("ncclCommDeregister", unsafe { deregister(raw, self.handle) })
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        match self.deregister_raw() {
            // An aborted communicator took its registrations with it.
            Ok(()) | Err(Error::Aborted) => {}
            Err(error) => tracing::warn!(%error, ptr = self.ptr, "deregistering a buffer failed"),
        }
    }
}

/// A symmetric window (`ncclCommWindowRegister`, NCCL 2.27+), deregistered when dropped, after a
/// host wait for the collectives queued over its memory (as for [`Registration`]).
///
/// NCCL answers a registration on a communicator without symmetric-memory support with success
/// and no window: collectives over the memory then run as over memory never registered.
/// [`Window::is_registered`] tells the two apart; such a window goes without a wait or a call.
#[derive(Debug)]
#[must_use = "dropping a window deregisters it, after waiting for the collectives queued over it"]
pub struct Window<'a> {
    comm: &'a Communicator,
    window: ncclWindow_t,
    queued_over: QueuedOver,
    memory: PhantomData<&'a ()>,
}

impl Window<'_> {
    /// The raw window, still owned by `self`; null where NCCL registered none.
    pub fn as_raw(&self) -> ncclWindow_t {
        self.window
    }

    /// Whether NCCL registered a window: false where the communicator has no symmetric-memory
    /// support, for which NCCL answers success and writes no window.
    pub fn is_registered(&self) -> bool {
        !self.window.is_null()
    }

    /// Deregisters now, after a host wait for the collectives queued over the window's memory,
    /// reporting NCCL's answer.
    ///
    /// # Errors
    /// As [`Registration::deregister`].
    pub fn deregister(self) -> Result<()> {
        let this = std::mem::ManuallyDrop::new(self);
        this.deregister_raw()
    }

    fn deregister_raw(&self) -> Result<()> {
        const WHAT: &str = "deregistering a window";
        if !self.is_registered() {
            // Nothing of NCCL's to release, and so no collective to wait for.
            return Ok(());
        }
        let raw = self.comm.held()?;
        let deregister = nccl()?.ncclCommWindowDeregister()?;
        // NCCL deregisters on a private stream that no user stream is ordered with: the host waits.
        self.queued_over.wait(self.comm, WHAT)?;
        // SAFETY: a window of this communicator, deregistered once, after every collective queued
        // over its memory has finished (the wait above).
        self.comm.check("ncclCommWindowDeregister", unsafe { deregister(raw, self.window) })
    }
}

impl Drop for Window<'_> {
    fn drop(&mut self) {
        match self.deregister_raw() {
            Ok(()) | Err(Error::Aborted) => {}
            Err(error) => tracing::warn!(%error, "deregistering a window failed"),
        }
    }
}

/// Every span an arena had mapped when registered, each registered once, and a hold that keeps
/// the arena from unmapping them (NCCL caches the mappings). Allocations inside those spans are
/// covered without registering each; chunks the arena maps later are covered after
/// [`ArenaRegistration::refresh`].
///
/// Dropping it waits on the host for the collectives the communicator launched (its launch fence)
/// before deregistering the spans. Where the driver refuses that wait, the spans stay registered
/// (NCCL releases them with the communicator) and mapped (the hold is kept, so the arena never
/// unmaps them).
#[derive(Debug)]
#[must_use = "dropping a registration deregisters it, after waiting for the communicator's collectives"]
pub struct ArenaRegistration<'a> {
    comm: &'a Communicator,
    arena: &'a Arena,
    spans: Vec<Registration<'a>>,
    /// `None` only once `Drop` has kept it for good.
    hold: Option<MappingHold<'a>>,
}

impl ArenaRegistration<'_> {
    /// The registered spans `(address, bytes)`.
    pub fn spans(&self) -> Vec<(CUdeviceptr, usize)> {
        self.spans.iter().map(|r| (r.ptr, r.len)).collect()
    }

    /// Registers the chunks the arena mapped since; returns how many spans were added.
    ///
    /// Every part of a mapped span that no registration covers is registered, wherever it lies:
    /// past the registered part, before it, or between two registrations (a chunk unmapped by a
    /// trim before registering and mapped again since).
    ///
    /// # Errors
    /// NCCL's refusal; the spans registered before it stay registered.
    pub fn refresh(&mut self) -> Result<usize> {
        let before = self.spans.len();
        for (ptr, len) in self.arena.mapped_spans() {
            let registered: Vec<(CUdeviceptr, usize)> = self.spans.iter().map(|r| (r.ptr, r.len)).collect();
            for (start, len) in uncovered((ptr, len), &registered) {
                self.spans.push(self.comm.register_raw(start, len, QueuedOver::ArenaSpan)?);
            }
        }
        Ok(self.spans.len() - before)
    }
}

impl ArenaRegistration<'_> {
    /// Keeps the spans registered, and mapped for the arena's life: neither deregistered nor
    /// let go of.
    fn keep_mapped(&mut self) {
        std::mem::forget(std::mem::take(&mut self.spans));
        std::mem::forget(self.hold.take());
    }
}

impl Drop for ArenaRegistration<'_> {
    fn drop(&mut self) {
        // Nothing registered, or a released communicator (which took its registrations with it):
        // nothing to deregister, so nothing to wait for. Where NCCL refused to release it, it may
        // still hold the spans' mappings: they stay mapped for the arena's life.
        if self.spans.is_empty() || self.comm.held().is_err() {
            if self.comm.release_refused() {
                self.keep_mapped();
            }
            return;
        }
        if let Err(error) = QueuedOver::Launches.wait(self.comm, "deregistering an arena") {
            tracing::warn!(%error, spans = self.spans.len(), "an arena's spans stay registered and mapped");
            // A collective may still use them.
            self.keep_mapped();
        }
        // Otherwise the spans are deregistered as the fields drop (each without another wait),
        // then the hold ends.
    }
}

/// The parts of `span` that none of `covered` covers, in address order. Spans are `(address,
/// bytes)` of one address range, so no end overflows.
fn uncovered((start, len): (CUdeviceptr, usize), covered: &[(CUdeviceptr, usize)]) -> Vec<(CUdeviceptr, usize)> {
    let end = start.saturating_add(len as u64);
    let mut inside: Vec<(CUdeviceptr, CUdeviceptr)> = covered
        .iter()
        .map(|&(address, bytes)| (address.max(start), address.saturating_add(bytes as u64).min(end)))
        .filter(|(from, to)| from < to)
        .collect();
    inside.sort_unstable();
    let mut gaps = Vec::new();
    let mut at = start;
    for (from, to) in inside {
        if from > at {
            gaps.push((at, (from - at) as usize));
        }
        at = at.max(to);
    }
    if at < end {
        gaps.push((at, (end - at) as usize));
    }
    gaps
}

impl Communicator {
    fn register_raw<'a>(&'a self, ptr: CUdeviceptr, len: usize, queued_over: QueuedOver) -> Result<Registration<'a>> {
        let raw = self.usable()?;
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "registering a buffer",
                reason: InvalidArgumentReason::EmptyBuffer,
            });
        }
        let register = nccl()?.ncclCommRegister()?;
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `len` bytes of this rank's device memory at `ptr` (the callers check), kept
        // alive by the registration's borrow; a valid out-pointer.
        self.check("ncclCommRegister", unsafe { register(raw, ptr as *mut c_void, len, &mut handle) })?;
        Ok(Registration { comm: self, handle, ptr, len, queued_over, memory: PhantomData })
    }

    /// Registers `buffer` for zero-copy transfers (`ncclCommRegister`, NCCL 2.19+) until the
    /// registration is dropped.
    ///
    /// NCCL registers only VMM memory (an [`Arena`]'s, [`crate::NcclMemory`]) for zero-copy:
    /// it asks the driver for the allocation handle behind the pointer, which pool memory does
    /// not have. What it answers for pool memory is recorded in docs/distributed.md.
    ///
    /// # Errors
    /// [`Error::WrongDevice`]; [`Error::Load`] before NCCL 2.19; NCCL's refusal.
    pub fn register<'a>(&'a self, buffer: &'a impl DeviceBuffer) -> Result<Registration<'a>> {
        self.check_buffer("registering a buffer", buffer)?;
        self.register_raw(buffer.device_ptr(), buffer.byte_len(), QueuedOver::Launches)
    }

    /// Registers every span `arena` has mapped, once: every allocation inside them is covered.
    /// The arena keeps them mapped (its trim refuses) until the registration is dropped.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for an arena of another device; NCCL's refusal.
    pub fn register_arena<'a>(&'a self, arena: &'a Arena) -> Result<ArenaRegistration<'a>> {
        if arena.device() != self.device() {
            return Err(Error::WrongDevice {
                what: "registering an arena",
                found: format!("on device {}", arena.device()),
                device: self.device(),
            });
        }
        let hold = arena.hold_mappings();
        let mut registration = ArenaRegistration { comm: self, arena, spans: Vec::new(), hold: Some(hold) };
        registration.refresh()?;
        Ok(registration)
    }

    /// Registers `buffer` as a window on every rank (`ncclCommWindowRegister`, NCCL 2.27+): a
    /// collective call, with the same size on every rank. `symmetric` asks for
    /// `NCCL_WIN_COLL_SYMMETRIC`, which NCCL's symmetric kernels need.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an address not aligned to 4096 bytes;
    /// [`Error::WrongDevice`]; [`Error::Load`] naming NCCL 2.27 on older NCCL;
    /// [`Error::InsideGroup`] inside [`group`](crate::group())'s closure (NCCL would register the
    /// window only at the group's end, writing its handle through a pointer to this call's
    /// stack frame, long returned); NCCL's refusal (memory that is not VMM memory among them).
    pub fn register_window<'a>(&'a self, buffer: &'a impl DeviceBuffer, symmetric: bool) -> Result<Window<'a>> {
        const WHAT: &str = "registering a window";
        refuse_inside_group(WHAT, "register the windows of several ranks with register_windows, outside the group")?;
        let ptr = self.window_memory(WHAT, buffer)?;
        let raw = self.usable()?;
        let register = nccl()?.ncclCommWindowRegister()?;
        let mut window: ncclWindow_t = std::ptr::null_mut();
        // SAFETY: this rank's device memory (checked), kept alive by the window's borrow; outside a
        // group NCCL writes the handle before returning.
        self.check("ncclCommWindowRegister", unsafe {
            register(raw, ptr, buffer.byte_len(), &mut window, window_flags(symmetric))
        })?;
        Ok(Window { comm: self, window, queued_over: QueuedOver::Launches, memory: PhantomData })
    }

    /// The address of `buffer` for a window: this rank's device memory, aligned as NCCL
    /// requires, not empty.
    fn window_memory(&self, what: &'static str, buffer: &(impl DeviceBuffer + ?Sized)) -> Result<*mut c_void> {
        let ptr = self.check_buffer(what, buffer)?;
        let alignment = u64::from(NCCL_WIN_REQUIRED_ALIGNMENT);
        if !buffer.device_ptr().is_multiple_of(alignment) {
            return Err(Error::InvalidArgument {
                what,
                reason: InvalidArgumentReason::Misaligned { address: buffer.device_ptr(), alignment },
            });
        }
        if buffer.byte_len() == 0 {
            return Err(Error::InvalidArgument { what, reason: InvalidArgumentReason::EmptyBuffer });
        }
        Ok(ptr)
    }
}

fn window_flags(symmetric: bool) -> i32 {
    if symmetric {
        NCCL_WIN_COLL_SYMMETRIC as i32
    } else {
        0
    }
}

/// Registers one window per rank driven from this thread (`ncclCommWindowRegister` for each,
/// inside one NCCL group, as a collective over ranks of one process needs): `ranks[i]`'s buffer
/// on `ranks[i]`'s communicator. NCCL writes each window's handle only at the group's end, so the
/// handles live here until then, and the windows come back once NCCL has written them, in the
/// order of `ranks`; a rank whose communicator has no symmetric-memory support gets a window
/// that is not registered ([`Window::is_registered`]), as [`Communicator::register_window`] does.
///
/// # Errors
/// As [`Communicator::register_window`], checked for every rank before NCCL is called;
/// [`InvalidArgumentReason::UnequalWindowSizes`] for buffers of unequal sizes on ranks of one
/// communicator (NCCL requires one size and does not check); [`Error::InsideGroup`] inside
/// [`group`](crate::group())'s closure; the first of NCCL's refusals (the windows it did register
/// are deregistered).
pub fn register_windows<'a>(
    ranks: &[(&'a Communicator, &'a dyn DeviceBuffer)],
    symmetric: bool,
) -> Result<Vec<Window<'a>>> {
    const WHAT: &str = "registering windows";
    refuse_inside_group(WHAT, "register the windows before the group")?;
    let mut checked = Vec::with_capacity(ranks.len());
    for &(comm, buffer) in ranks {
        checked.push((
            comm,
            comm.usable()?,
            comm.window_memory(WHAT, buffer)?,
            buffer.byte_len(),
            QueuedOver::Launches,
        ));
    }
    let sizes: Vec<(&Communicator, usize)> = checked.iter().map(|&(comm, _, _, len, _)| (comm, len)).collect();
    refuse_unequal_sizes(WHAT, &sizes)?;
    let nccl = nccl()?;
    let (start, end, register) = (nccl.ncclGroupStart()?, nccl.ncclGroupEnd()?, nccl.ncclCommWindowRegister()?);
    // Written by NCCL at the group's end: sized before, never moved until then.
    let mut handles: Vec<ncclWindow_t> = vec![std::ptr::null_mut(); checked.len()];
    // SAFETY: no arguments; ended below on every path.
    check("ncclGroupStart", unsafe { start() }, None)?;
    let mut first_error = None;
    for ((comm, raw, ptr, len, _), handle) in checked.iter().zip(handles.iter_mut()) {
        // SAFETY: each rank's device memory (checked), alive for 'a; `handle` outlives the group's end.
        let answer = unsafe { register(*raw, *ptr, *len, handle, window_flags(symmetric)) };
        if let Err(error) = comm.check("ncclCommWindowRegister", answer) {
            first_error.get_or_insert(error);
        }
    }
    // SAFETY: ends the group started above.
    let ended = check("ncclGroupEnd", unsafe { end() }, None);
    // One per rank; a null one (no symmetric-memory support, or a registration NCCL refused)
    // is not registered and goes without a call.
    let windows: Vec<Window<'a>> = checked
        .iter()
        .zip(handles)
        .map(|(&(comm, .., queued_over), window)| Window { comm, window, queued_over, memory: PhantomData })
        .collect();
    // On a failure, dropping the registered ones deregisters them.
    first_error.map_or(ended, Err).map(|()| windows)
}

/// Refuses windows NCCL would pair wrongly among the ranks of one communicator in `ranks`
/// (rank, bytes). A window is a collective over the ranks: the `k`-th window a rank registers in
/// the group pairs with every other rank's `k`-th, so each rank given must register as many
/// windows, and the `k`-th ones must have the same size, which NCCL requires and does not check.
/// Ranks of other communicators are compared only with their own.
fn refuse_unequal_sizes(what: &'static str, ranks: &[(&Communicator, usize)]) -> Result<()> {
    // Each entry's occurrence among its own rank's entries: its `k`.
    let occurrence = |at: usize| ranks[..at].iter().filter(|(comm, _)| std::ptr::eq(*comm, ranks[at].0)).count();
    let count = |comm: &Communicator| ranks.iter().filter(|(other, _)| std::ptr::eq(*other, comm)).count();
    for (at, &(comm, bytes)) in ranks.iter().enumerate() {
        let k = occurrence(at);
        for (other_at, &(other, other_bytes)) in ranks.iter().enumerate().skip(at + 1) {
            if other.membership() != comm.membership() || std::ptr::eq(other, comm) {
                continue;
            }
            let (windows, other_windows) = (count(comm), count(other));
            if windows != other_windows {
                return Err(Error::InvalidArgument {
                    what,
                    reason: InvalidArgumentReason::UnequalWindowCounts {
                        rank: comm.rank(),
                        windows,
                        other_rank: other.rank(),
                        other_windows,
                    },
                });
            }
            if occurrence(other_at) == k && other_bytes != bytes {
                // The smallest of the communicator's `k`-th windows: what every rank can register.
                let smallest = (0..ranks.len())
                    .filter(|&any| ranks[any].0.membership() == comm.membership() && occurrence(any) == k)
                    .map(|any| ranks[any].1)
                    .min()
                    .unwrap_or(bytes);
                return Err(Error::InvalidArgument {
                    what,
                    reason: InvalidArgumentReason::UnequalWindowSizes {
                        rank: comm.rank(),
                        bytes,
                        other_rank: other.rank(),
                        other_bytes,
                        smallest,
                    },
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::uncovered;

    #[test]
    fn every_uncovered_part_of_a_span_is_found_before_between_and_after_registrations() {
        let span = (1000, 600);
        assert_eq!(uncovered(span, &[]), vec![(1000, 600)]);
        assert_eq!(uncovered(span, &[(1000, 600)]), vec![]);
        assert_eq!(uncovered(span, &[(1000, 200), (1400, 200)]), vec![(1200, 200)], "the gap between two");
        assert_eq!(uncovered(span, &[(1200, 200)]), vec![(1000, 200), (1400, 200)], "before and after");
        assert_eq!(uncovered(span, &[(800, 300), (1500, 300)]), vec![(1100, 400)], "overlapping the ends");
        assert_eq!(
            uncovered(span, &[(1100, 100), (1150, 100)]),
            vec![(1000, 100), (1250, 350)],
            "overlapping each other"
        );
        assert_eq!(uncovered(span, &[(0, 100), (5000, 10)]), vec![(1000, 600)], "outside the span");
    }
}
