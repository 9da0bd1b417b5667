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
use crate::comm::{collectives, Collective, Communicator, Prepared};
use crate::error::{check, Error, Result};
use crate::loader::nccl;
use crate::ordering::{refuse_inside_group, InsideGroup};
use cumempool::Stream;
use std::cell::RefCell;
use std::marker::PhantomData;

/// The collectives queued in one [`group`], launched together at its end.
///
/// Invariant in `'env`, so a borrow shorter than the group cannot be passed for it.
#[derive(Debug)]
pub struct Group<'env> {
    /// Every collective queued, checked, in the order queued: NCCL is called for them only at
    /// the group's end.
    pending: RefCell<Vec<Prepared<'env>>>,
    env: PhantomData<&'env mut &'env ()>,
}

/// Runs `calls`, then launches the collectives it queued (through the [`Group`] it is given)
/// together, between `ncclGroupStart` and `ncclGroupEnd`: needed for send/recv pairs and for
/// driving several communicators from one thread.
///
/// NCCL is called only once `calls` has returned, so each collective is ordered after all the
/// work queued on its buffers' streams until then, and a stream that joined a capture inside
/// `calls` is seen: then nothing is launched. Two collectives of one group run at once, so one
/// that touches bytes an earlier one of the group touches, where either writes them, is
/// refused when queued. A group is all or nothing, as NCCL makes its own groups: when `calls`
/// fails or panics, nothing it queued is launched (half of a send/recv pair would wait for its
/// other half for ever).
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
/// [`Error::InsideGroup`] inside another group's closure; the failure of `calls` (nothing is
/// launched); [`cumempool::Error::StreamCapturing`] where a collective's stream or a buffer's
/// stream captures at the end, or the first ordering's failure (nothing is launched then
/// either); NCCL's refusal, or the ordering's after the launch.
pub fn group<'env, T>(calls: impl for<'g> FnOnce(&'g Group<'env>) -> Result<T>) -> Result<T> {
    refuse_inside_group("a group", "queue every collective in the outer group")?;
    let group = Group { pending: RefCell::new(Vec::new()), env: PhantomData };
    let value = {
        let _inside = InsideGroup::enter();
        calls(&group)?
    };
    group.launch()?;
    Ok(value)
}

impl Group<'_> {
    /// Orders each collective after its buffers' streams, launches them all between
    /// `ncclGroupStart` and `ncclGroupEnd`, and orders the buffers' streams after them. Nothing
    /// reaches NCCL where a collective's ordering is refused (a capture underway) or fails.
    fn launch(self) -> Result<()> {
        let pending = self.pending.into_inner();
        if pending.is_empty() {
            return Ok(());
        }
        let nccl = nccl()?;
        let (start, end) = (nccl.ncclGroupStart()?, nccl.ncclGroupEnd()?);
        for collective in &pending {
            collective.usable()?;
        }
        // The first half of every ordering before any launch: a refusal leaves NCCL untouched
        // (waits already set up on streams that do not capture only order more than needed).
        let ordered = pending.iter().map(Prepared::order_before).collect::<Result<Vec<_>>>()?;
        // SAFETY: no arguments; ended right below, whatever the launches answer.
        check("ncclGroupStart", unsafe { start() }, None)?;
        let mut launched = Ok(());
        for collective in &pending {
            if let Err(error) = collective.launch() {
                launched = launched.and(Err(error));
            }
        }
        // SAFETY: ends the group started above, once. NCCL launches nothing of a group in which
        // one of its calls failed.
        let ended = check("ncclGroupEnd", unsafe { end() }, None);
        // Ordered even where NCCL refused: what it may have launched is covered too.
        let mut after = Ok(());
        for (order, collective) in ordered.into_iter().zip(&pending) {
            if let Err(error) = order.after().and(collective.fence()) {
                after = after.and(Err(error));
            }
        }
        launched.and(ended).and(after)
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
        let prepared = comm.prepare::<T>(collective, send, recv, count, stream)?;
        let mut pending = self.pending.borrow_mut();
        for earlier in pending.iter() {
            if let Some(span) = prepared.accesses.conflict(&earlier.accesses) {
                return Err(Error::ConflictInGroup {
                    what: prepared.what(),
                    earlier: earlier.what(),
                    address: span.start,
                    len: span.len,
                });
            }
        }
        pending.push(prepared);
        Ok(())
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
