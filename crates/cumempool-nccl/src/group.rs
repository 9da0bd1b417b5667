//! Groups: collectives queued together between `ncclGroupStart` and `ncclGroupEnd`, which NCCL
//! launches at the end: send/recv pairs, and several communicators driven from one thread.
//!
//! NCCL launches a grouped collective only at the group's end, so its buffers must outlive the
//! group, not only the call that queued it: a buffer dropped inside the closure would be freed
//! on its stream before NCCL's kernels were launched there. [`Group`]'s methods therefore borrow
//! communicators and buffers for `'env`, a lifetime that outlasts the whole [`group`] call (as
//! `std::thread::scope` borrows for its threads), and the buffers' streams are ordered after the
//! collectives once the group has ended.
//!
//! ```compile_fail,E0597
//! # fn f(comm: &cumempool_nccl::Communicator, pool: &cumempool::Pool, stream: &cumempool::Stream) -> cumempool_nccl::Result<()> {
//! cumempool_nccl::group(|g| {
//!     let buffer = pool.alloc(4096, stream)?; // dropped at the end of the closure: before the launch
//!     g.all_reduce::<f32>(comm, &buffer, &buffer, 1024, cumempool_nccl::ReduceOp::Sum, stream)
//! })
//! # }
//! ```

use crate::buffers::{DeviceBuffer, Element, ReduceOp};
use crate::comm::{collectives, After, Collective, Communicator};
use crate::error::{check, Result};
use crate::loader::nccl;
use crate::ordering::{refuse_inside_group, InsideGroup, Ordered};
use cumempool::Stream;
use std::cell::RefCell;
use std::marker::PhantomData;

/// The collectives queued in one [`group`], launched together at its end.
///
/// Invariant in `'env`, so a borrow shorter than the group cannot be passed for it.
#[derive(Debug)]
pub struct Group<'env> {
    /// Every collective queued, with the streams to order after it once NCCL has launched it.
    pending: RefCell<Vec<Ordered>>,
    env: PhantomData<&'env mut &'env ()>,
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`, so NCCL launches the collectives it
/// queues (through the [`Group`] it is given) together at the end: needed for send/recv pairs
/// and for driving several communicators from one thread. The group is ended even when `calls`
/// fails or panics, and each buffer's stream is then ordered after its collective.
///
/// ```no_run
/// # fn f(comms: &[cumempool_nccl::Communicator], buffers: &[cumempool::Buffer<'_>], streams: &[cumempool::Stream]) -> cumempool_nccl::Result<()> {
/// use cumempool_nccl::{group, ReduceOp};
/// group(|g| {
///     for ((comm, buffer), stream) in comms.iter().zip(buffers).zip(streams) {
///         g.all_reduce::<f32>(comm, buffer, buffer, buffer.len() / 4, ReduceOp::Sum, stream)?;
///     }
///     Ok(())
/// })
/// # }
/// ```
///
/// # Errors
/// [`Error::InsideGroup`](crate::Error::InsideGroup) inside another group's closure; the first
/// failure of `calls`, else `ncclGroupEnd`'s, else the ordering's.
pub fn group<'env, T>(calls: impl for<'g> FnOnce(&'g Group<'env>) -> Result<T>) -> Result<T> {
    refuse_inside_group("a group", "queue every collective in the outer group")?;
    let nccl = nccl()?;
    let (start, end) = (nccl.ncclGroupStart()?, nccl.ncclGroupEnd()?);
    // SAFETY: no arguments; ended by `Ending` below.
    check("ncclGroupStart", unsafe { start() }, None)?;
    let mut ending = Ending { group: Group { pending: RefCell::new(Vec::new()), env: PhantomData }, end, ended: false };
    let outcome = {
        let _inside = InsideGroup::enter();
        calls(&ending.group)
    };
    let (ended, ordered) = ending.finish();
    let value = outcome?;
    ended?;
    ordered.map(|()| value)
}

/// Ends the group once, whether its closure returned or panicked (a group left open would
/// launch its collectives at some later group's end, after their buffers were freed).
struct Ending<'env> {
    group: Group<'env>,
    end: crate::bindings::PFN_ncclGroupEnd,
    ended: bool,
}

impl Ending<'_> {
    /// Ends the group and orders each buffer's stream after its collective: `ncclGroupEnd`'s
    /// answer, and the first ordering's failure. Ordered even when the end failed, so whatever
    /// NCCL launched is covered.
    fn finish(&mut self) -> (Result<()>, Result<()>) {
        self.ended = true;
        let pending = std::mem::take(&mut *self.group.pending.borrow_mut());
        // SAFETY: ends the group `group` started, once (the flag above).
        let ended = check("ncclGroupEnd", unsafe { (self.end)() }, None);
        let mut ordered = Ok(());
        for collective in pending {
            if let Err(error) = collective.after() {
                if ordered.is_ok() {
                    ordered = Err(error);
                }
            }
        }
        (ended, ordered)
    }
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let (ended, ordered) = self.finish();
        if let Err(error) = ended.and(ordered) {
            tracing::warn!(%error, "ending a group whose closure panicked failed");
        }
    }
}

impl<'env> Group<'env> {
    fn queue<T: Element>(
        &self,
        comm: &'env Communicator,
        collective: Collective,
        (send, recv): (&'env dyn DeviceBuffer, &'env dyn DeviceBuffer),
        count: usize,
        stream: &Stream,
    ) -> Result<()> {
        comm.queue::<T>(collective, send, recv, count, stream, After::GroupEnd(&self.pending))
    }
}

/// [`Group`]'s collectives, from [`collectives!`]'s rows: launched at the group's end, with the
/// communicator and buffers borrowed for `'env`.
macro_rules! group_methods {
    ($($(#[$doc:meta])* fn $name:ident($($buffer:ident),+; $($arg:ident: $ty:ty),*) => $collective:expr, ($send:ident, $recv:ident);)*) => {
        impl<'env> Group<'env> {
            $(
                #[doc = concat!("[`Communicator::", stringify!($name), "`], launched at the group's end.")]
                ///
                /// # Errors
                #[doc = concat!("As [`Communicator::", stringify!($name), "`].")]
                pub fn $name<T: Element>(
                    &self,
                    comm: &'env Communicator,
                    $($buffer: &'env impl DeviceBuffer,)+
                    count: usize,
                    $($arg: $ty,)*
                    stream: &Stream,
                ) -> Result<()> {
                    self.queue::<T>(comm, $collective, ($send, $recv), count, stream)
                }
            )*
        }
    };
}

collectives!(group_methods);
