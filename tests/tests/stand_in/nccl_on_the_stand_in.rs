//! cumempool-nccl on a host without a GPU, through the stand-in libcuda and libnccl of
//! `cumempool_tests::stand_in_driver` (one library, one call log): a collective is ordered with
//! its buffers' streams (an event each way), a collective that a capture would record is
//! refused, a failed `ncclCommInitRank` can be retried with the same id, an arena's
//! registration covers every mapped chunk after `refresh`, and a registration is deregistered
//! only after the collectives queued over its memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::sys::CUresult;
use cumempool::{Error as CudaError, MemPool, Route, Stream};
use cumempool_alloc::{Arena, StreamOrderedResource, POOL_ALIGNMENT};
use cumempool_nccl::{group, Communicator, DeviceBuffer, Error, InvalidArgumentReason, ReduceOp, UniqueId};
use cumempool_tests::stand_in_driver::{call_log, set_switch, stand_in};

/// The calls logged since `start`, each as its fields.
fn calls_since(start: usize) -> Vec<Vec<String>> {
    call_log()[start..].lines().map(|line| line.split(' ').map(str::to_owned).collect()).collect()
}

/// The stand-in's name for a stream in its log (`%p` of the handle).
fn name(stream: &Stream) -> String {
    format!("{:p}", stream.as_raw())
}

/// Whether `calls` make `waiter` wait, at or after `from`, for an event recorded on `recorded`
/// before that wait; and where the wait is.
fn wait_for(calls: &[Vec<String>], from: usize, waiter: &str, recorded: &str) -> Option<usize> {
    calls.iter().enumerate().skip(from).find_map(|(at, call)| {
        let [kind, stream, event, result] = &call[..] else { return None };
        let ordered = kind == "waitevent"
            && stream == waiter
            && result == "0"
            && calls[..at]
                .iter()
                .any(|c| matches!(&c[..], [r, e, s, _] if r == "record" && e == event && s == recorded));
        ordered.then_some(at)
    })
}

/// A one-rank communicator and a device pool, on the stand-in.
fn one_rank() -> (Communicator, MemPool) {
    (Communicator::init_all(&[0]).unwrap().pop().unwrap(), MemPool::new(Route::device(0)).unwrap())
}

#[test]
fn a_collective_on_another_stream_waits_for_its_buffers_streams_and_they_for_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, b, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let send = pool.alloc(4096, &a).unwrap();
    let recv = pool.alloc(4096, &b).unwrap();
    let start = call_log().len();
    comm.all_reduce::<f32>(&send, &recv, 1024, ReduceOp::Sum, &c).unwrap();
    let calls = calls_since(start);
    let launch = calls.iter().position(|call| call[0] == "nccl").expect("the collective was launched");
    assert_eq!(calls[launch][1], name(&c), "on the collective's stream");
    for buffer_stream in [&a, &b] {
        let before = wait_for(&calls, 0, &name(&c), &name(buffer_stream));
        assert!(before.is_some_and(|at| at < launch), "the collective waits for the buffer's stream: {calls:?}");
        let after = wait_for(&calls, launch, &name(buffer_stream), &name(&c));
        assert!(after.is_some(), "the buffer's stream (its free) waits for the collective: {calls:?}");
    }
    // On the buffers' own stream nothing needs ordering: the one wait is the launch fence's.
    let start = call_log().len();
    comm.all_reduce::<f32>(&send, &send, 1024, ReduceOp::Sum, &a).unwrap();
    let calls = calls_since(start);
    let waits: Vec<&Vec<String>> = calls.iter().filter(|call| call[0] == "waitevent").collect();
    assert!(waits.len() == 1 && waits[0][1] != name(&a), "{calls:?}");
}

#[test]
fn a_collective_that_a_capture_would_record_is_refused_before_nccl() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (outer, other) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let outside = pool.alloc(4096, &other).unwrap();
    let start = call_log().len();
    let mut on_the_capture = None;
    let graph = outer.capture(|capture| {
        on_the_capture = Some(comm.all_reduce::<u8>(&outside, &outside, 4096, ReduceOp::Sum, capture.stream()));
        Ok(())
    });
    let refused = on_the_capture.unwrap();
    assert!(matches!(refused, Err(Error::Cuda(CudaError::StreamCapturing { .. }))), "{refused:?}");
    assert!(calls_since(start).iter().all(|call| call[0] != "nccl"), "nothing reached NCCL");
    drop(graph);
}

#[test]
fn a_unique_id_whose_init_failed_can_be_used_again() {
    let Some((_serial, _context)) = stand_in() else { return };
    let id = UniqueId::new().unwrap();
    set_switch("fail_next_init");
    let failed = Communicator::init_rank(&id, 1, 0, 0).map(|_| ());
    assert!(matches!(failed, Err(Error::Nccl { function: "ncclCommInitRank", .. })), "{failed:?}");
    let retried = Communicator::init_rank(&id, 1, 0, 0);
    assert!(retried.is_ok(), "a retry after a failed init: {:?}", retried.err());
    let again = Communicator::init_rank(&id, 1, 0, 0).map(|_| ());
    assert!(matches!(again, Err(Error::UniqueIdReused { rank: 0 })), "a used id is still refused: {again:?}");
}

#[test]
fn refresh_registers_a_chunk_mapped_again_between_two_registered_spans() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    let arena = Arena::builder(0, 64 << 20).build().unwrap();
    let chunk = arena.chunk_size();
    let blocks: Vec<u64> = (0..3).map(|_| arena.allocate(chunk, POOL_ALIGNMENT, &stream).unwrap()).collect();
    // SAFETY: allocated above with these arguments, freed once, not used after.
    unsafe { arena.deallocate(blocks[1], chunk, POOL_ALIGNMENT, &stream) }.unwrap();
    assert_eq!(arena.trim().unwrap(), chunk, "the middle chunk is unmapped");
    let mut registration = comm.register_arena(&arena).unwrap();
    assert_eq!(registration.spans().len(), 2, "two spans around the gap");
    let middle = arena.allocate(chunk, POOL_ALIGNMENT, &stream).unwrap();
    assert_eq!(middle, blocks[1], "first fit maps the middle chunk again");
    let start = call_log().len();
    assert_eq!(registration.refresh().unwrap(), 1, "the gap is registered");
    let registered: Vec<_> = calls_since(start).into_iter().filter(|call| call[0] == "register").collect();
    assert_eq!(registered.len(), 1, "{registered:?}");
    assert_eq!(registered[0][1], format!("{:p}", middle as *const u8), "exactly the middle chunk");
    assert_eq!(registered[0][2], format!("{:p}", chunk as *const u8));
    let mut covered: Vec<(u64, usize)> = registration.spans();
    covered.sort_unstable();
    assert_eq!(covered, vec![(blocks[0], chunk), (blocks[1], chunk), (blocks[2], chunk)]);
    assert_eq!(registration.refresh().unwrap(), 0, "nothing new to register");
    drop(registration);
    for block in [blocks[0], middle, blocks[2]] {
        // SAFETY: as above.
        unsafe { arena.deallocate(block, chunk, POOL_ALIGNMENT, &stream) }.unwrap();
    }
}

#[test]
fn a_group_orders_its_buffers_streams_after_the_launch_at_its_end() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let buffer = pool.alloc(4096, &a).unwrap();
    let received = pool.alloc(4096, &a).unwrap();
    let start = call_log().len();
    let mut inside = None;
    group(|g| {
        g.send::<u8>(&comm, &buffer, 4096, 0, &c)?;
        g.recv::<u8>(&comm, &received, 4096, 0, &c)?;
        // The communicator's own methods launch at once, which a group does not: refused.
        inside = Some(comm.all_reduce::<u8>(&buffer, &buffer, 16, ReduceOp::Sum, &c));
        // A group inside a group would end before the outer one launches: refused.
        let nested = group(|_| Ok(()));
        assert!(matches!(nested, Err(Error::InsideGroup { what: "a group", .. })), "{nested:?}");
        Ok(())
    })
    .unwrap();
    let refused = inside.unwrap();
    assert!(matches!(refused, Err(Error::InsideGroup { what: "an all-reduce", .. })), "{refused:?}");
    let calls = calls_since(start);
    let launches: Vec<usize> = calls.iter().enumerate().filter(|(_, c)| c[0] == "nccl").map(|(at, _)| at).collect();
    assert_eq!(launches.len(), 2, "both launched, at the group's end: {calls:?}");
    let before = wait_for(&calls, 0, &name(&c), &name(&a));
    assert!(before.is_some_and(|at| at < launches[0]), "the collective's stream waits for the buffer's: {calls:?}");
    let after = wait_for(&calls, launches[1], &name(&a), &name(&c));
    assert!(after.is_some(), "the buffer's stream waits for the launch, after it: {calls:?}");
    assert!(
        wait_for(&calls, 0, &name(&a), &name(&c)).is_some_and(|at| at > launches[1]),
        "no wait of the buffer's stream before the launch, which would order nothing: {calls:?}"
    );
}

/// A group is all or nothing, as NCCL's are: a closure that panics or fails launches nothing it
/// queued (half of a send/recv pair would wait for its other half for ever), and leaves the
/// thread outside any group.
#[test]
fn a_group_whose_closure_panics_or_fails_launches_nothing() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let (buffer, small) = (pool.alloc(4096, &a).unwrap(), pool.alloc(1024, &a).unwrap());
    let start = call_log().len();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        group::<()>(|g| {
            g.all_reduce::<u8>(&comm, &buffer, &buffer, 4096, ReduceOp::Sum, &c)?;
            panic!("the closure fails");
        })
    }));
    assert!(panicked.is_err());
    let failed = group(|g| {
        g.send::<u8>(&comm, &buffer, 4096, 0, &c)?;
        g.recv::<u8>(&comm, &small, 4096, 0, &c) // does not fit
    });
    assert!(matches!(failed, Err(Error::DoesNotFit { .. })), "{failed:?}");
    let refused = group(|g| {
        g.send::<u8>(&comm, &buffer, 4096, 0, &c)?;
        g.recv::<u8>(&comm, &buffer, 4096, 0, &c) // the bytes the send reads
    });
    assert!(matches!(refused, Err(Error::ConflictInGroup { .. })), "{refused:?}");
    let calls = calls_since(start);
    assert!(calls.iter().all(|call| call[0] != "nccl"), "nothing reached NCCL: {calls:?}");
    // The thread is no longer inside a group: the communicator launches at once again.
    let start = call_log().len();
    comm.all_reduce::<u8>(&buffer, &buffer, 4096, ReduceOp::Sum, &a).unwrap();
    assert_eq!(calls_since(start).iter().filter(|call| call[0] == "nccl").count(), 1);
}

#[test]
fn a_group_launches_nothing_on_a_stream_that_joined_a_capture_inside_its_closure() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (origin, x, a) =
        (Stream::new(&context).unwrap(), Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let buffer = pool.alloc(4096, &a).unwrap();
    let start = call_log().len();
    let mut grouped = None;
    let _graph = origin.capture(|capture| {
        grouped = Some(group(|g| {
            g.all_reduce::<u8>(&comm, &buffer, &buffer, 4096, ReduceOp::Sum, &x)?; // x does not capture yet
            x.order_after(capture.stream())?; // now it does
            Ok(())
        }));
        Ok(())
    });
    let grouped = grouped.unwrap();
    assert!(matches!(grouped, Err(Error::Cuda(CudaError::StreamCapturing { .. }))), "{grouped:?}");
    assert!(calls_since(start).iter().all(|call| call[0] != "nccl"), "nothing reached NCCL");
}

/// Work queued inside the closure on a buffer the group's collective writes comes before the
/// collective: NCCL is called at the end, after its stream waited for the buffer's stream then.
#[test]
fn a_group_orders_its_collectives_after_the_work_its_closure_queued_on_their_buffers() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, b, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let buffer = pool.alloc(4096, &a).unwrap();
    let mut copy = pool.alloc(4096, &b).unwrap();
    let start = call_log().len();
    group(|g| {
        g.all_reduce::<u8>(&comm, &buffer, &buffer, 4096, ReduceOp::Sum, &c)?; // NCCL writes `buffer`
        copy.copy_from_async(&buffer)?; // reads `buffer` on b; `buffer`'s stream a waits for it
        Ok(())
    })
    .unwrap();
    let calls = calls_since(start);
    let launch = calls.iter().position(|call| call[0] == "nccl").expect("launched");
    let copied = calls.iter().position(|call| call[0] == "memcpy").expect("copied");
    let a_after_copy = wait_for(&calls, copied, &name(&a), &name(&b)).expect("the buffer's stream waits for the copy");
    let c_after_a = wait_for(&calls, a_after_copy, &name(&c), &name(&a));
    assert!(c_after_a.is_some_and(|at| at < launch), "the collective waits for the copy: {calls:?}");
}

/// NCCL runs a group's collectives at once: one reading what another of the group writes (on
/// another stream, or a send and a receive of one buffer) is refused when queued.
#[test]
fn a_group_refuses_a_collective_touching_bytes_another_of_it_writes() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, c1, c2) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let (x, y, z) = (pool.alloc(4096, &a).unwrap(), pool.alloc(4096, &a).unwrap(), pool.alloc(4096, &a).unwrap());
    let grouped = group(|g| {
        g.all_reduce::<u8>(&comm, &x, &y, 4096, ReduceOp::Sum, &c1)?; // writes y
        g.all_reduce::<u8>(&comm, &y, &z, 4096, ReduceOp::Sum, &c2) // reads y
    });
    assert!(
        matches!(
            grouped,
            Err(Error::ConflictInGroup { what: "an all-reduce", earlier: "an all-reduce", len: 4096, .. })
        ),
        "{grouped:?}"
    );
    let grouped = group(|g| {
        g.send::<u8>(&comm, &x, 4096, 0, &c1)?;
        g.recv::<u8>(&comm, &x, 4096, 0, &c1)
    });
    assert!(matches!(grouped, Err(Error::ConflictInGroup { what: "a receive", earlier: "a send", .. })), "{grouped:?}");
    // The error names the bytes both touch.
    let grouped = group(|g| {
        g.all_reduce::<u8>(&comm, &x, &y, 1024, ReduceOp::Sum, &c1)?; // writes y's first KiB
        g.all_reduce::<u8>(&comm, &y, &z, 4096, ReduceOp::Sum, &c2) // reads all of y
    });
    let Err(Error::ConflictInGroup { address, len, .. }) = grouped else { panic!("{grouped:?}") };
    assert_eq!((address, len), (y.as_raw(), 1024));
    // Reading one buffer twice, or writing disjoint ones, is fine; a broadcast's send is read on
    // the root only.
    group(|g| {
        g.all_reduce::<u8>(&comm, &x, &y, 4096, ReduceOp::Sum, &c1)?;
        g.all_reduce::<u8>(&comm, &x, &z, 4096, ReduceOp::Sum, &c2)
    })
    .unwrap();
    let rank_one = Communicator::init_rank(&UniqueId::new().unwrap(), 2, 1, 0).unwrap();
    group(|g| {
        g.broadcast::<u8>(&rank_one, &x, &y, 4096, 0, &c1)?; // x is not read on rank 1
        g.all_reduce::<u8>(&comm, &z, &x, 4096, ReduceOp::Sum, &c2)
    })
    .unwrap();
}

/// NCCL's in-place all-gather sends from `recv + rank * count`, its in-place reduce-scatter
/// receives into `send + rank * count`: the same buffer for both is in place on rank 0 only.
#[test]
fn send_and_receive_buffers_overlapping_other_than_in_place_are_refused() {
    let Some((_serial, context)) = stand_in() else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let stream = Stream::new(&context).unwrap();
    let rank_one = Communicator::init_rank(&UniqueId::new().unwrap(), 2, 1, 0).unwrap();
    let buffer = pool.alloc(2048, &stream).unwrap();
    let gathered = rank_one.all_gather::<u8>(&buffer, &buffer, 1024, &stream);
    let scattered = rank_one.reduce_scatter::<u8>(&buffer, &buffer, 1024, ReduceOp::Sum, &stream);
    for refused in [gathered, scattered] {
        let Err(Error::InvalidArgument { reason: InvalidArgumentReason::OverlapNotInPlace { layout, .. }, .. }) =
            &refused
        else {
            panic!("{refused:?}")
        };
        assert!(layout.contains("rank * count"), "{layout}");
    }
    let rank_zero = Communicator::init_rank(&UniqueId::new().unwrap(), 2, 0, 0).unwrap();
    rank_zero.all_gather::<u8>(&buffer, &buffer, 1024, &stream).unwrap();
    rank_zero.reduce_scatter::<u8>(&buffer, &buffer, 1024, ReduceOp::Sum, &stream).unwrap();
}

#[test]
fn a_window_registered_inside_a_group_is_refused_before_nccl_defers_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let stream = Stream::new(&context).unwrap();
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &stream).unwrap();
    let start = call_log().len();
    let mut inside = None;
    group(|_| {
        // NCCL 2.28 would write the window's handle through `register_window`'s out-pointer only
        // at the group's end, into a stack frame that has returned by then.
        inside = Some(comm.register_window(&memory, false).map(|window| window.as_raw()));
        Ok(())
    })
    .unwrap();
    let refused = inside.unwrap();
    assert!(matches!(refused, Err(Error::InsideGroup { what: "registering a window", .. })), "{refused:?}");
    let calls = calls_since(start);
    assert!(calls.iter().all(|call| !call[0].starts_with("window")), "nothing reached NCCL: {calls:?}");
    // Outside a group it is registered at once.
    let window = comm.register_window(&memory, false).unwrap();
    assert!(!window.as_raw().is_null());
}

/// NCCL 2.27+ answers a window's registration with success and no window where the communicator
/// has no symmetric-memory support (its source sets the handle to NULL and returns): the window
/// says it is not registered, and letting go of it neither waits for the communicator's
/// collectives nor calls NCCL.
#[test]
fn a_window_nccl_did_not_register_says_so_and_goes_without_a_wait() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let stream = Stream::new(&context).unwrap();
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &stream).unwrap();
    let registered = comm.register_window(&memory, true).unwrap();
    assert!(registered.is_registered());
    for together in [false, true] {
        set_switch("no_symmetric_next");
        let window = if together {
            cumempool_nccl::register_windows(&[(&comm, &memory)], true).unwrap().pop().unwrap()
        } else {
            comm.register_window(&memory, true).unwrap()
        };
        assert!(!window.is_registered(), "NCCL registered no window");
        comm.all_reduce::<u8>(&memory, &memory, 1 << 16, ReduceOp::Sum, &stream).unwrap();
        let start = call_log().len();
        window.deregister().unwrap();
        let calls = calls_since(start);
        assert!(calls.is_empty(), "no wait and no NCCL call for a window NCCL did not register: {calls:?}");
    }
    drop(registered);
}

/// The windows of several ranks of one process are registered in one NCCL group, whose handles
/// NCCL writes at the group's end: `register_windows` keeps them until then.
#[test]
fn windows_of_the_ranks_of_one_process_are_registered_together_and_come_back_written() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let stream = Stream::new(&context).unwrap();
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &stream).unwrap();
    let start = call_log().len();
    let windows = cumempool_nccl::register_windows(&[(&comm, &memory)], true).unwrap();
    assert_eq!(windows.len(), 1);
    assert!(!windows[0].as_raw().is_null(), "the handle NCCL wrote at the group's end");
    let calls = calls_since(start);
    let deferred = calls.iter().position(|call| call[0] == "windowdeferred").expect("registered inside a group");
    let written = calls.iter().position(|call| call[0] == "windowwritten").expect("written at its end");
    assert!(deferred < written && calls[deferred][1] == calls[written][1], "{calls:?}");
    // Inside a group it is refused, as the single registration is.
    let mut inside = None;
    group(|_| {
        inside = Some(cumempool_nccl::register_windows(&[(&comm, &memory)], true).map(|w| w.len()));
        Ok(())
    })
    .unwrap();
    assert!(matches!(inside.unwrap(), Err(Error::InsideGroup { .. })));
}

#[test]
fn communicators_are_not_created_inside_a_group() {
    let Some((_serial, _context)) = stand_in() else { return };
    let id = UniqueId::new().unwrap();
    let start = call_log().len();
    let mut inside = None;
    group(|_| {
        // Inside a group NCCL creates a communicator only at the group's end: the rank, size and
        // device asked at once would not be known, and a failure would destroy it before NCCL
        // had made it.
        inside = Some((Communicator::init_all(&[0]).map(|_| ()), Communicator::init_rank(&id, 1, 0, 0).map(|_| ())));
        Ok(())
    })
    .unwrap();
    let (all, rank) = inside.unwrap();
    assert!(matches!(all, Err(Error::InsideGroup { what: "creating communicators", .. })), "{all:?}");
    assert!(matches!(rank, Err(Error::InsideGroup { what: "creating a communicator", .. })), "{rank:?}");
    assert!(calls_since(start).iter().all(|call| call[0] != "ncclinit"), "nothing reached NCCL");
    assert!(Communicator::init_rank(&id, 1, 0, 0).is_ok(), "the id was not used up by the refusal");
}

#[test]
fn a_communicator_with_collectives_queued_in_a_group_is_not_aborted_inside_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let (a, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let buffer = pool.alloc(4096, &a).unwrap();
    let mut inside = None;
    group(|g| {
        g.all_reduce::<u8>(&comm, &buffer, &buffer, 4096, ReduceOp::Sum, &c)?;
        // NCCL would reclaim the communicator at the group's end, beside the launch it still owes.
        inside = Some((comm.abort(), comm.wait(&c, std::time::Duration::ZERO)));
        Ok(())
    })
    .unwrap();
    let (aborted, waited) = inside.unwrap();
    assert!(matches!(aborted, Err(Error::InsideGroup { what: "aborting a communicator", .. })), "{aborted:?}");
    assert!(matches!(waited, Err(Error::InsideGroup { .. })), "{waited:?}");
    comm.all_reduce::<u8>(&buffer, &buffer, 4096, ReduceOp::Sum, &a).unwrap();
}

/// The communicator's launch fence, as the stand-in names it: the stream, neither the
/// collective's (`on`) nor one of `others`, made to wait after the launch for an event recorded on
/// `on` after it.
fn launch_fence(calls: &[Vec<String>], on: &Stream, others: &[&Stream]) -> Option<String> {
    let launch = first(calls, "nccl")?;
    let (on, others): (String, Vec<String>) = (name(on), others.iter().map(|s| name(s)).collect());
    calls[launch..].iter().find_map(|call| {
        let waiter = &call[1];
        let candidate = call[0] == "waitevent" && *waiter != on && !others.contains(waiter);
        (candidate && wait_for(calls, launch, waiter, &on).is_some()).then(|| waiter.clone())
    })
}

/// Whether `calls` wait on the host for `stream` (by its stand-in name) before `before`.
fn synced_before(calls: &[Vec<String>], stream: &str, before: usize) -> bool {
    calls[..before].iter().any(|call| call[0] == "sync" && call[1] == stream && call[3] == "0")
}

/// Where the first call of `kind` is, if any.
fn first(calls: &[Vec<String>], kind: &str) -> Option<usize> {
    calls.iter().position(|call| call[0] == kind)
}

/// `ncclCommDeregister` (and a window's deregistration) tears down peers' mappings at once: a
/// collective still running over the memory would touch unmapped memory. The communicator's
/// launch fence, ordered after every collective it launched, is waited for first.
#[test]
fn dropping_a_registration_or_a_window_waits_for_the_collectives_queued_over_it() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let (s, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &s).unwrap();
    for deregistering in ["deregister", "windowderegister"] {
        let registered: Box<dyn std::fmt::Debug + '_> = match deregistering {
            "deregister" => Box::new(comm.register(&memory).unwrap()),
            _ => Box::new(comm.register_window(&memory, true).unwrap()),
        };
        let start = call_log().len();
        comm.all_reduce::<u8>(&memory, &memory, 1 << 16, ReduceOp::Sum, &c).unwrap();
        drop(registered);
        let calls = calls_since(start);
        let fence = launch_fence(&calls, &c, &[&s]).expect("the launch fence waits for the collective");
        let deregistered = first(&calls, deregistering).expect("deregistered");
        assert!(
            synced_before(&calls, &fence, deregistered),
            "deregistered with the collective still queued: {calls:?}"
        );
    }
}

/// An arena's registration covers allocations whose streams it does not know, and memory given
/// without a stream names none: the communicator's launch fence is waited for, never the whole
/// device (whose wait would invalidate any capture underway on it).
#[test]
fn dropping_an_arena_registration_waits_for_the_collectives_queued_over_its_spans() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let (a, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let arena = Arena::builder(0, 64 << 20).build().unwrap();
    let block = arena.alloc(4096, &a).unwrap();
    let registration = comm.register_arena(&arena).unwrap();
    let slice = cumempool_nccl::DeviceSlice::of_arena(&arena, &block).unwrap();
    let start = call_log().len();
    comm.all_reduce::<u8>(&slice, &slice, 4096, ReduceOp::Sum, &c).unwrap();
    drop(registration);
    let calls = calls_since(start);
    let fence = launch_fence(&calls, &c, &[&a]).expect("the launch fence waits for the collective");
    let deregistered = first(&calls, "deregister").expect("deregistered");
    assert!(synced_before(&calls, &fence, deregistered), "deregistered with the collective still queued: {calls:?}");
    assert_eq!(calls.iter().filter(|call| call[0] == "sync").count(), 1, "one wait for every span: {calls:?}");
    assert!(first(&calls, "ctxsync").is_none(), "never the whole device: {calls:?}");

    // SAFETY: the arena allocation's memory, alive (borrowed by `block`) past the registration.
    let streamless = unsafe { cumempool_nccl::DeviceSlice::from_raw(block.as_raw(), 4096, 0, None) };
    let registration = comm.register(&streamless).unwrap();
    let start = call_log().len();
    comm.all_reduce::<u8>(&streamless, &streamless, 4096, ReduceOp::Sum, &c).unwrap();
    drop(registration);
    let calls = calls_since(start);
    let deregistered = first(&calls, "deregister").expect("deregistered");
    assert!(synced_before(&calls, &fence, deregistered) && first(&calls, "ctxsync").is_none(), "{calls:?}");
}

/// A deregistration waits for the launch fence, a private stream no capture of the user's
/// streams involves: a capture underway on another stream, on the memory's stream, on the
/// collective's stream, or of the per-thread stream beside a collective on the legacy stream,
/// neither stops it nor is harmed by it (a wait for those streams themselves, or for the whole
/// device, was refused or invalidated the capture, and the memory was then freed while NCCL still
/// had it registered).
#[test]
fn a_deregistration_during_a_capture_waits_for_the_launch_fence_and_leaves_the_capture_intact() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let (s, c, origin) =
        (Stream::new(&context).unwrap(), Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &s).unwrap();
    let address = format!("{:p}", memory.device_ptr() as *const u8);

    let registration = comm.register(&memory).unwrap();
    comm.all_reduce::<u8>(&memory, &memory, 1 << 16, ReduceOp::Sum, &c).unwrap();
    let graph = origin.capture(|_| {
        drop(registration);
        Ok(())
    });
    assert!(graph.is_ok(), "a capture on another stream is left intact: {:?}", graph.err());

    let start = call_log().len();
    let registration = comm.register(&memory).unwrap();
    comm.all_reduce::<u8>(&memory, &memory, 1 << 16, ReduceOp::Sum, &c).unwrap();
    let mut answer = None;
    let _graph = origin.capture(|capture| {
        s.order_after(capture.stream())?; // the memory's stream joins the capture
        c.order_after(capture.stream())?; // and so does the collective's
        answer = Some(registration.deregister());
        Ok(())
    });
    assert!(answer.unwrap().is_ok(), "deregistered after the fence's wait");
    drop(memory);
    let calls = calls_since(start);
    let fence = launch_fence(&calls, &c, &[&s]).expect("the launch fence waits for the collective");
    let deregistered = first(&calls, "deregister").expect("deregistered");
    let freed = calls.iter().position(|call| call[0] == "ncclmemfree" && call[1] == address).expect("freed");
    assert!(synced_before(&calls, &fence, deregistered) && deregistered < freed, "{calls:?}");

    // A collective on the legacy stream, then another library captures the per-thread stream
    // (which blocks the legacy stream): the deregistration's wait leaves that capture intact.
    let legacy = Stream::legacy(&context);
    let arena = Arena::builder(0, 64 << 20).build().unwrap();
    let a = Stream::new(&context).unwrap();
    let block = arena.alloc(4096, &a).unwrap();
    let slice = cumempool_nccl::DeviceSlice::of_arena(&arena, &block).unwrap();
    let registration = comm.register_arena(&arena).unwrap();
    comm.all_reduce::<u8>(&slice, &slice, 4096, ReduceOp::Sum, &legacy).unwrap();
    crate::the_per_thread_stream::begin_per_thread_capture();
    drop(registration);
    assert_eq!(
        crate::the_per_thread_stream::end_per_thread_capture(),
        CUresult::CUDA_SUCCESS,
        "the capture was left intact"
    );
    drop(block);
    assert!(arena.trim().is_ok(), "the spans were deregistered and their hold let go");
}

/// The launch fence keeps no stream of the caller's alive: a lent stream whose lender destroyed
/// it after the collective is never used again.
#[test]
fn the_launch_fence_keeps_no_stream_of_the_callers() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let owner = Stream::new(&context).unwrap(); // the lender's stream
    let dead = name(&owner);
    let a = Stream::new(&context).unwrap();
    let block = pool.alloc(4096, &a).unwrap();
    // SAFETY: `owner` outlives `lent` and every clone made of it here.
    let lent = unsafe { Stream::borrow_raw(owner.as_raw(), Some(&context)) }.unwrap();
    // SAFETY: pool memory of device 0, alive until after every use here.
    let streamless = unsafe { cumempool_nccl::DeviceSlice::from_raw(block.as_raw(), 4096, 0, None) };
    let registration = comm.register(&streamless).unwrap();
    comm.all_reduce::<u8>(&streamless, &streamless, 4096, ReduceOp::Sum, &lent).unwrap();
    assert_eq!(lent.handle_count(), 1, "no clone of the lent stream is kept");
    drop(lent);
    drop(owner); // the lender destroys its stream
    let start = call_log().len();
    drop(registration);
    let calls = calls_since(start);
    assert!(calls.iter().all(|call| call.get(1) != Some(&dead)), "a destroyed stream handle was used: {calls:?}");
}

/// A window has the same size on every rank of its communicator, which NCCL requires and does not
/// check; for ranks of one process the sizes are all here, and compared before NCCL.
#[test]
fn windows_of_unequal_sizes_on_ranks_of_one_process_are_refused() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let id = UniqueId::new().unwrap();
    let (rank0, rank1) =
        (Communicator::init_rank(&id, 2, 0, 0).unwrap(), Communicator::init_rank(&id, 2, 1, 0).unwrap());
    let (small, big) = (
        cumempool_nccl::NcclMemory::new(0, 1 << 12, &stream).unwrap(),
        cumempool_nccl::NcclMemory::new(0, 1 << 20, &stream).unwrap(),
    );
    let start = call_log().len();
    let windows = cumempool_nccl::register_windows(&[(&rank0, &small), (&rank1, &big)], true).map(|w| w.len());
    let expected = cumempool_nccl::InvalidArgumentReason::UnequalWindowSizes {
        rank: 0,
        bytes: 1 << 12,
        other_rank: 1,
        other_bytes: 1 << 20,
        smallest: 1 << 12,
    };
    assert!(
        matches!(&windows, Err(Error::InvalidArgument { what: "registering windows", reason }) if *reason == expected),
        "4 KiB on rank 0, 1 MiB on rank 1: {windows:?}"
    );
    assert_eq!(
        windows.unwrap_err().to_string(),
        "registering windows: rank 0's buffer has 4096 bytes but rank 1's has 1048576; a window has the same size on \
         every rank of its communicator, which NCCL does not check: register the same number of bytes on every rank \
         (at most 4096, the smallest here)"
    );
    assert!(calls_since(start).iter().all(|call| !call[0].starts_with("window")), "nothing reached NCCL");

    // Equal sizes are registered; so are ranks of two communicators, each with its own size.
    let other = cumempool_nccl::NcclMemory::new(0, 1 << 12, &stream).unwrap();
    let equal = cumempool_nccl::register_windows(&[(&rank0, &small), (&rank1, &other)], true).map(|w| w.len());
    assert_eq!(equal.unwrap(), 2);
    let (lone, _pool) = one_rank();
    let mixed = cumempool_nccl::register_windows(&[(&rank0, &small), (&rank1, &other), (&lone, &big)], true);
    assert_eq!(mixed.map(|w| w.len()).unwrap(), 3, "the one-rank communicator's window is its own size");

    // Each rank's k-th window pairs with the others' k-th: two windows a rank, sizes matching
    // pairwise, are registered; a rank with fewer windows than another is refused.
    let (big0, big1) = (
        cumempool_nccl::NcclMemory::new(0, 1 << 20, &stream).unwrap(),
        cumempool_nccl::NcclMemory::new(0, 1 << 20, &stream).unwrap(),
    );
    let two_each =
        cumempool_nccl::register_windows(&[(&rank0, &small), (&rank1, &other), (&rank0, &big0), (&rank1, &big1)], true);
    assert_eq!(two_each.map(|w| w.len()).unwrap(), 4, "4 KiB on both ranks, then 1 MiB on both");
    let uneven =
        cumempool_nccl::register_windows(&[(&rank0, &small), (&rank1, &other), (&rank0, &big0)], true).map(|w| w.len());
    assert!(
        matches!(
            uneven,
            Err(Error::InvalidArgument {
                reason: InvalidArgumentReason::UnequalWindowCounts {
                    rank: 0,
                    windows: 2,
                    other_rank: 1,
                    other_windows: 1
                },
                ..
            })
        ),
        "{uneven:?}"
    );
}

/// The answers NCCL gave to the calls of `kind` in `calls`.
fn answers(calls: &[Vec<String>], kind: &str) -> Vec<String> {
    calls.iter().filter(|call| call[0] == kind).map(|call| call[3].clone()).collect()
}

/// A destroy or abort NCCL refused may have freed part of the communicator: it is never handed
/// to NCCL again (a leak at worst, not a second free), and its registrations are NCCL's.
#[test]
fn a_destroy_or_abort_nccl_refused_is_not_tried_again() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let start = call_log().len();
    set_switch("fail_next_destroy");
    let failed = comm.destroy();
    assert!(matches!(failed, Err(Error::Nccl { function: "ncclCommDestroy", .. })), "{failed:?}");
    assert_eq!(answers(&calls_since(start), "nccldestroy"), ["2"], "not destroyed twice");

    let (comm, _pool) = one_rank();
    let stream = Stream::new(&context).unwrap();
    let memory = cumempool_nccl::NcclMemory::new(0, 1 << 16, &stream).unwrap();
    let registration = comm.register(&memory).unwrap();
    let start = call_log().len();
    set_switch("fail_next_abort");
    let failed = comm.abort();
    assert!(matches!(failed, Err(Error::Nccl { function: "ncclCommAbort", .. })), "{failed:?}");
    let refused = comm.all_reduce::<u8>(&memory, &memory, 16, ReduceOp::Sum, &stream);
    assert!(matches!(refused, Err(Error::Aborted)), "no new work once an abort was asked: {refused:?}");
    drop(registration);
    comm.abort().unwrap();
    drop(comm);
    let calls = calls_since(start);
    assert_eq!(answers(&calls, "ncclabort"), ["2"], "aborted once: {calls:?}");
    assert!(answers(&calls, "nccldestroy").is_empty() && first(&calls, "deregister").is_none(), "{calls:?}");
}

/// A collective on the legacy stream, and another library begins capturing the per-thread stream
/// (a blocking stream) right after NCCL launched it: the fence cannot be ordered after the legacy
/// stream then, and a host wait for it would invalidate that capture. The capture is left intact,
/// and the communicator's registrations stay registered (nothing is known to have waited for the
/// collective) rather than deregistered under it.
#[test]
fn a_launch_the_fence_cannot_cover_beside_a_capture_leaves_the_capture_intact_and_keeps_registrations() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let legacy = Stream::legacy(&context);
    let a = Stream::new(&context).unwrap();
    let block = pool.alloc(4096, &a).unwrap();
    // SAFETY: pool memory of device 0, alive past every use here.
    let slice = unsafe { cumempool_nccl::DeviceSlice::from_raw(block.as_raw(), 4096, 0, None) };
    let registration = comm.register(&slice).unwrap();
    comm.all_reduce::<u8>(&slice, &slice, 4096, ReduceOp::Sum, &legacy).unwrap(); // the fence exists now
    let start = call_log().len();
    set_switch("capture_per_thread_at_next_event_create"); // begins right after NCCL's launch
    let launched = comm.all_reduce::<u8>(&slice, &slice, 4096, ReduceOp::Sum, &legacy);
    assert_eq!(
        crate::the_per_thread_stream::end_per_thread_capture(),
        CUresult::CUDA_SUCCESS,
        "the capture was left intact"
    );
    let kept = registration.deregister();
    assert!(launched.is_err() && matches!(kept, Err(Error::NotDeregistered { .. })), "{launched:?} {kept:?}");
    let calls = calls_since(start);
    assert!(first(&calls, "deregister").is_none(), "deregistered with nothing having waited: {calls:?}");
}

/// A collective on a stream borrowed without its context is refused before NCCL: its orderings
/// record events in the stream's context, and without it each would be a host wait.
#[test]
fn a_collective_on_a_stream_borrowed_without_its_context_is_refused() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, pool) = one_rank();
    let owner = Stream::new(&context).unwrap();
    // SAFETY: `owner` outlives `lent`.
    let lent = unsafe { Stream::borrow_raw(owner.as_raw(), None) }.unwrap();
    let block = pool.alloc(4096, &owner).unwrap();
    let start = call_log().len();
    let refused = comm.all_reduce::<u8>(&block, &block, 4096, ReduceOp::Sum, &lent);
    assert!(
        matches!(refused, Err(Error::InvalidArgument { reason: InvalidArgumentReason::StreamWithoutContext, .. })),
        "{refused:?}"
    );
    assert!(calls_since(start).iter().all(|call| call[0] != "nccl" && call[0] != "sync"), "nothing reached NCCL");
}

/// An abort NCCL refused leaves NCCL's hold on the registrations unknown: an arena's spans stay
/// mapped (the arena's trim unmaps nothing of them) rather than unmapped under NCCL.
#[test]
fn an_arena_registration_of_a_communicator_nccl_refused_to_abort_keeps_its_spans_mapped() {
    let Some((_serial, context)) = stand_in() else { return };
    let (comm, _pool) = one_rank();
    let (a, c) = (Stream::new(&context).unwrap(), Stream::new(&context).unwrap());
    let arena = Arena::builder(0, 64 << 20).build().unwrap();
    let block = arena.alloc(4096, &a).unwrap();
    let registration = comm.register_arena(&arena).unwrap();
    let slice = cumempool_nccl::DeviceSlice::of_arena(&arena, &block).unwrap();
    comm.all_reduce::<u8>(&slice, &slice, 4096, ReduceOp::Sum, &c).unwrap();
    set_switch("fail_next_abort");
    assert!(comm.abort().is_err());
    drop(registration);
    drop(block);
    let trimmed = arena.trim();
    assert!(!trimmed.as_ref().is_ok_and(|&bytes| bytes > 0), "unmapped under NCCL: {trimmed:?}");
}

/// The size the unequal-windows error suggests is the smallest window given in that position.
#[test]
fn unequal_window_sizes_name_the_smallest_window_given() {
    let Some((_serial, context)) = stand_in() else { return };
    let stream = Stream::new(&context).unwrap();
    let id = UniqueId::new().unwrap();
    let ranks: Vec<Communicator> = (0..3).map(|r| Communicator::init_rank(&id, 3, r, 0).unwrap()).collect();
    let memory: Vec<_> =
        [8 << 10, 1 << 20, 4 << 10].iter().map(|&n| cumempool_nccl::NcclMemory::new(0, n, &stream).unwrap()).collect();
    let given: Vec<(&Communicator, &dyn DeviceBuffer)> =
        ranks.iter().zip(&memory).map(|(c, m)| (c, m as &dyn DeviceBuffer)).collect();
    let text = cumempool_nccl::register_windows(&given, true).map(|w| w.len()).unwrap_err().to_string();
    assert!(text.contains("at most 4096"), "{text}");
}
