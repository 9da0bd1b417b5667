//! Its own process: it sets NCCL_NVLS_ENABLE before NCCL loads, and its bandwidth table times the GPUs.
//!
//! cumempool-nccl on the GPU: loading, one-rank collectives on pool buffers (each a copy),
//! registration of pool versus arena memory, windows, bad input, the bounded wait; and with two
//! GPUs exact all-reduce results in one process and in two, a peer that dies mid-collective, and
//! the bus-bandwidth table of docs/benchmarks.md.
//!
//! Without NCCL the tests skip with the reason (`CUMEMPOOL_REQUIRE_NCCL=1` fails them instead);
//! two-GPU tests skip on one GPU unless `CUMEMPOOL_REQUIRE_TWO_GPUS=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::{Device, MemPool, Route, Stream};
use cumempool_alloc::{Arena, StreamOrderedResource};
use cumempool_nccl::{
    group, Communicator, DeviceBuffer, DeviceSlice, Error, InvalidArgumentReason as Reason, NcclMemory, ReduceOp,
    UniqueId,
};
use cumempool_tests::gpu;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(60);

/// NVLink multicast must stay off on the GPU machine: set before NCCL first loads.
fn nccl_ready() -> bool {
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
    match cumempool_nccl::nccl() {
        Ok(nccl) => {
            eprintln!("NCCL {} from {}", nccl.version(), nccl.library_path());
            true
        }
        Err(error) if std::env::var("CUMEMPOOL_REQUIRE_NCCL").is_ok_and(|v| v == "1") => {
            panic!("CUMEMPOOL_REQUIRE_NCCL=1 but NCCL did not load: {error}")
        }
        Err(error) => {
            eprintln!("skipped: {error}");
            false
        }
    }
}

/// Device 0's context and a stream, with NCCL loaded; `None` (skipped) otherwise.
fn one_gpu() -> Option<Stream> {
    let context = gpu()?;
    nccl_ready().then(|| Stream::new(&context).unwrap())
}

fn two_gpus() -> Option<(Stream, Stream)> {
    gpu()?;
    if Device::count().unwrap() < 2 {
        assert!(std::env::var("CUMEMPOOL_REQUIRE_TWO_GPUS").map_or(true, |v| v != "1"), "one GPU");
        eprintln!("skipped: needs two GPUs");
        return None;
    }
    if !nccl_ready() {
        return None;
    }
    let stream = |d| Stream::new(&Device::get(d).unwrap().primary_context().unwrap()).unwrap();
    Some((stream(0), stream(1)))
}

fn floats(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

#[test]
fn nccl_loads_where_installed_and_names_its_version() {
    if !nccl_ready() {
        return;
    }
    let version = cumempool_nccl::version().unwrap();
    assert!(version.0 >= 21903, "NCCL {version}: registration needs 2.19");
    let window = cumempool_nccl::nccl().unwrap().ncclCommWindowRegister();
    match window {
        Ok(_) => assert!(version.0 >= 22700),
        Err(error) => assert!(error.to_string().contains("needs NCCL 2.27.0"), "{error}"),
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_one_rank_communicator_copies_on_every_collective() {
    let Some(stream) = one_gpu() else { return };
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    assert_eq!((comm.rank(), comm.size(), comm.device()), (0, 1, 0));
    let pool = MemPool::new(Route::device(0)).unwrap();
    let n = 1 << 16;
    let input = floats((0..n).map(|i| i as f32 * 0.5));
    let mut send = pool.alloc(input.len(), &stream).unwrap();
    send.copy_from_host(&input).unwrap();
    let recv = pool.alloc(input.len(), &stream).unwrap();
    let check = |what: &str, recv: &cumempool::Buffer<'_>| {
        comm.wait(&stream, TIMEOUT).unwrap();
        let mut out = vec![0u8; input.len()];
        recv.copy_to_host(&mut out).unwrap();
        assert!(out == input, "{what} on one rank is a copy");
    };
    comm.all_reduce::<f32>(&send, &recv, n, ReduceOp::Sum, &stream).unwrap();
    check("all-reduce", &recv);
    for (name, run) in [("all-gather", 0), ("reduce-scatter", 1), ("broadcast", 2), ("send/recv", 3)] {
        // A fresh, zeroed buffer for each collective, so a copy cannot pass by leftover bytes.
        let mut fresh = pool.alloc(input.len(), &stream).unwrap();
        fresh.fill(0).unwrap();
        match run {
            0 => comm.all_gather::<f32>(&send, &fresh, n, &stream).unwrap(),
            1 => comm.reduce_scatter::<f32>(&send, &fresh, n, ReduceOp::Max, &stream).unwrap(),
            2 => comm.broadcast::<f32>(&send, &fresh, n, 0, &stream).unwrap(),
            _ => group(|g| {
                g.send::<f32>(&comm, &send, n, 0, &stream)?;
                g.recv::<f32>(&comm, &fresh, n, 0, &stream)
            })
            .unwrap(),
        }
        check(name, &fresh);
    }
    // In place: the sum over one rank leaves the bytes.
    comm.all_reduce::<f32>(&send, &send, n, ReduceOp::Sum, &stream).unwrap();
    check("in-place all-reduce", &send);
    comm.destroy().unwrap();
}

/// Keeps `stream` busy for a while (copies of 1 GiB), so that work queued on another stream
/// without waiting for it runs first.
fn delay(pool: &MemPool, stream: &Stream) {
    let big = pool.alloc(1 << 30, stream).unwrap();
    let mut other = pool.alloc(1 << 30, stream).unwrap();
    for _ in 0..40 {
        other.copy_from_async(&big).unwrap();
    }
}

/// A collective on another stream than its buffers' waits for the work their stream queued
/// before it (the fill that produced the data), and their stream waits for it before their
/// frees: the memory is not handed out again while NCCL still writes it. Before the ordering,
/// the collective read the source before its fill, and its write landed in the next owner's
/// bytes (0x33 over 0x44) on the H200.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_collective_on_another_stream_is_ordered_with_its_buffers_streams_both_ways() {
    let Some(a) = one_gpu() else { return };
    let b = Stream::new(&Device::get(0).unwrap().primary_context().unwrap()).unwrap();
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    let n = 4 << 20;
    // The data is written on A after a delay; the collective on B must read it.
    let mut src = pool.alloc(n, &a).unwrap();
    let mut dst = pool.alloc(n, &b).unwrap();
    dst.fill(0).unwrap();
    delay(&pool, &a);
    src.fill(0x33).unwrap();
    comm.all_reduce::<u8>(&src, &dst, n, ReduceOp::Sum, &b).unwrap();
    comm.wait(&b, TIMEOUT).unwrap();
    let mut out = vec![0u8; n];
    dst.copy_to_host(&mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0x33), "the collective read the source before its stream wrote it");

    // The destination is freed on A while the collective on B is still behind a delay; A's
    // next allocation must not receive bytes the collective writes after it.
    let target = pool.alloc(n, &a).unwrap();
    delay(&pool, &b);
    comm.all_reduce::<u8>(&src, &target, n, ReduceOp::Sum, &b).unwrap();
    let freed = target.as_raw();
    drop(target);
    let mut next = pool.alloc(n, &a).unwrap();
    eprintln!("the next allocation on A reused the freed address: {}", next.as_raw() == freed);
    next.fill(0x44).unwrap();
    b.synchronize().unwrap();
    a.synchronize().unwrap();
    next.copy_to_host(&mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0x44), "the collective wrote into memory freed and handed out again");
    drop((src, dst, next));
}

/// A collective on a capturing stream, over a buffer from outside the capture, would be
/// recorded into a graph that outlives the buffer: refused, with nothing queued.
#[test]
#[ignore = "requires a CUDA GPU"]
fn a_collective_inside_a_capture_is_refused() {
    let Some(stream) = one_gpu() else { return };
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let outside = pool.alloc(1 << 20, &stream).unwrap();
    let mut refused = None;
    let graph = stream
        .capture(|capture| {
            refused = Some(comm.all_reduce::<u8>(&outside, &outside, 1 << 20, ReduceOp::Sum, capture.stream()));
            Ok(())
        })
        .unwrap();
    let refused = refused.unwrap();
    assert!(matches!(refused, Err(Error::Cuda(cumempool::Error::StreamCapturing { .. }))), "{refused:?}");
    assert_eq!(graph.node_count().unwrap(), 0, "nothing of NCCL's was recorded");
    drop(graph);
    comm.all_reduce::<u8>(&outside, &outside, 1 << 20, ReduceOp::Sum, &stream).unwrap();
    comm.wait(&stream, TIMEOUT).unwrap();
}

/// What NCCL answers when pool memory and arena memory are registered. Pool memory has no VMM
/// allocation handle: NCCL may accept the call (and use copies) or refuse it; either way the
/// answer is typed. Arena memory must register, once for the whole arena, and as a window.
#[test]
#[ignore = "requires a CUDA GPU"]
fn registration_of_pool_memory_versus_arena_memory() {
    let Some(stream) = one_gpu() else { return };
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(4 << 20, &stream).unwrap();
    match comm.register(&buffer) {
        Ok(registration) => {
            eprintln!("NCCL registered pool memory ({} bytes)", registration.len());
            registration.deregister().unwrap();
        }
        Err(error @ Error::Nccl { .. }) => eprintln!("NCCL refused pool memory: {error}"),
        Err(other) => panic!("registering pool memory: untyped answer {other:?}"),
    }

    let arena = Arena::builder(0, 1 << 30).build().unwrap();
    let first = arena.alloc(4 << 20, &stream).unwrap();
    let second = arena.alloc(8 << 20, &stream).unwrap();
    let mut registration = comm.register_arena(&arena).unwrap();
    eprintln!("arena registered as {:?}", registration.spans());
    assert_eq!(registration.spans().len(), 1, "one registration covers the arena's mapped chunks");
    assert!(matches!(arena.trim(), Err(cumempool_alloc::Error::MappingsHeld { .. })), "registered chunks stay");
    let (a, b) = (DeviceSlice::of_arena(&arena, &first).unwrap(), DeviceSlice::of_arena(&arena, &second).unwrap());
    comm.all_reduce::<f32>(&a, &b, (4 << 20) / 4, ReduceOp::Sum, &stream).unwrap();
    comm.wait(&stream, TIMEOUT).unwrap();
    let grown = arena.alloc(64 << 20, &stream).unwrap();
    assert!(registration.refresh().unwrap() >= 1, "the chunks mapped since are registered");
    drop((registration, grown));

    let window_memory = arena.alloc(16 << 20, &stream).unwrap();
    let slice = DeviceSlice::of_arena(&arena, &window_memory).unwrap();
    match comm.register_window(&slice, true) {
        Ok(window) => {
            // NCCL answers success without a window where the communicator has no symmetric
            // memory support: printed, for docs/distributed.md.
            eprintln!("window on arena memory: registered by NCCL: {}", window.is_registered());
            window.deregister().unwrap();
        }
        Err(Error::Load(error)) => assert!(error.to_string().contains("2.27"), "{error}"),
        Err(error) => panic!("a window on arena memory: {error}"),
    }
    // SAFETY: 4096 bytes inside the arena allocation above, on device 0, alive until the end.
    let unaligned = unsafe { DeviceSlice::from_raw(slice.device_ptr() + 256, 4096, 0, Some(&stream)) };
    let refused = comm.register_window(&unaligned, true).map(|_| ());
    assert!(
        matches!(refused, Err(Error::InvalidArgument { reason: Reason::Misaligned { alignment: 4096, .. }, .. })),
        "{refused:?}"
    );
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn bad_input_gets_a_typed_error_before_nccl() {
    let Some(stream) = one_gpu() else { return };
    let comm = Communicator::init_all(&[0]).unwrap().pop().unwrap();
    let pool = MemPool::new(Route::device(0)).unwrap();
    let small = pool.alloc(1024, &stream).unwrap();
    let too_many = comm.all_reduce::<f32>(&small, &small, 257, ReduceOp::Sum, &stream).unwrap_err();
    assert!(matches!(too_many, Error::DoesNotFit { count: 257, .. }), "{too_many}");
    let overflow = comm.all_reduce::<f64>(&small, &small, usize::MAX / 2, ReduceOp::Sum, &stream).unwrap_err();
    assert!(matches!(overflow, Error::DoesNotFit { .. }), "{overflow}");
    let host = MemPool::new(Route::host()).unwrap().alloc(1024, &stream).unwrap();
    let on_host = comm.all_reduce::<u8>(&host, &small, 16, ReduceOp::Sum, &stream).unwrap_err();
    assert!(matches!(on_host, Error::WrongDevice { .. }) && on_host.to_string().contains("host"), "{on_host}");
    let root = comm.broadcast::<u8>(&small, &small, 16, 3, &stream).unwrap_err();
    assert!(matches!(root, Error::NoSuchRank { rank: 3, size: 1, .. }), "{root}");
    assert!(matches!(Communicator::init_rank(&UniqueId::new().unwrap(), 2, 2, 0), Err(Error::NoSuchRank { .. })));
    let repeated = Communicator::init_all(&[0, 0]).map(|_| ());
    assert!(
        matches!(repeated, Err(Error::InvalidArgument { reason: Reason::RepeatedDevice { device: 0 }, .. })),
        "{repeated:?}"
    );
    // A unique id from another communicator: this process already made rank 0 from it.
    let id = UniqueId::new().unwrap();
    let first = Communicator::init_rank(&id, 1, 0, 0).unwrap();
    assert!(matches!(Communicator::init_rank(&id, 1, 0, 0), Err(Error::UniqueIdReused { rank: 0 })));
    drop(first);
    // A bounded wait on an idle stream answers at once; after an abort every call says so.
    let start = Instant::now();
    comm.wait(&stream, TIMEOUT).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    comm.abort().unwrap();
    assert!(matches!(comm.all_reduce::<u8>(&small, &small, 16, ReduceOp::Sum, &stream), Err(Error::Aborted)));
}

// ---- two GPUs ----------------------------------------------------------------------------------

#[test]
#[ignore = "requires two CUDA GPUs"]
fn all_reduce_on_pool_buffers_is_exact_across_two_gpus_in_one_process() {
    let Some((s0, s1)) = two_gpus() else { return };
    let comms = Communicator::init_all(&[0, 1]).unwrap();
    let (p0, p1) = (MemPool::new(Route::device(0)).unwrap(), MemPool::new(Route::device(1)).unwrap());
    let n = 1 << 20;
    let (mut b0, mut b1) = (p0.alloc(4 * n, &s0).unwrap(), p1.alloc(4 * n, &s1).unwrap());
    b0.copy_from_host(&floats((0..n).map(|i| i as f32))).unwrap();
    b1.copy_from_host(&floats((0..n).map(|i| 2.0 * i as f32))).unwrap();
    let wrong = comms[0].all_reduce::<f32>(&b1, &b1, n, ReduceOp::Sum, &s0).unwrap_err();
    assert!(matches!(wrong, Error::WrongDevice { device: 0, .. }), "a buffer of another device: {wrong}");
    group(|g| {
        g.all_reduce::<f32>(&comms[0], &b0, &b0, n, ReduceOp::Sum, &s0)?;
        g.all_reduce::<f32>(&comms[1], &b1, &b1, n, ReduceOp::Sum, &s1)
    })
    .unwrap();
    comms[0].wait(&s0, TIMEOUT).unwrap();
    comms[1].wait(&s1, TIMEOUT).unwrap();
    let expected = floats((0..n).map(|i| 3.0 * i as f32));
    for buffer in [&b0, &b1] {
        let mut out = vec![0u8; 4 * n];
        buffer.copy_to_host(&mut out).unwrap();
        assert!(out == expected, "every rank holds the exact sum");
    }
}

#[test]
#[ignore = "requires two CUDA GPUs"]
fn registration_on_two_gpus_pool_arena_and_nccl_memory() {
    let Some((s0, s1)) = two_gpus() else { return };
    let comms = Communicator::init_all(&[0, 1]).unwrap();
    let streams = [&s0, &s1];
    let pools = [MemPool::new(Route::device(0)).unwrap(), MemPool::new(Route::device(1)).unwrap()];
    let buffers: Vec<_> = (0..2).map(|r| pools[r].alloc(8 << 20, streams[r]).unwrap()).collect();
    for (comm, buffer) in comms.iter().zip(&buffers) {
        match comm.register(buffer) {
            Ok(r) => eprintln!("rank {}: pool memory registered ({} bytes)", comm.rank(), r.len()),
            Err(error) => eprintln!("rank {}: pool memory refused: {error}", comm.rank()),
        }
    }
    let arenas: Vec<Arena> = (0..2).map(|d| Arena::builder(d, 1 << 30).chunk_size(64 << 20).build().unwrap()).collect();
    let blocks: Vec<_> = (0..2).map(|r| arenas[r].alloc(8 << 20, streams[r]).unwrap()).collect();
    let registrations: Vec<_> = comms.iter().zip(&arenas).map(|(c, a)| c.register_arena(a).unwrap()).collect();
    let slices: Vec<_> = (0..2).map(|r| DeviceSlice::of_arena(&arenas[r], &blocks[r]).unwrap()).collect();
    let windows = cumempool_nccl::register_windows(&[(&comms[0], &slices[0]), (&comms[1], &slices[1])], true);
    eprintln!("windows on arena memory: {:?}", windows.as_ref().err());
    assert!(windows.is_ok(), "windows on arena memory");
    let nccl_memory: Vec<_> = (0..2).map(|d| NcclMemory::new(d as i32, 8 << 20, streams[d]).unwrap()).collect();
    for (comm, memory) in comms.iter().zip(&nccl_memory) {
        let registered = comm.register(memory).map(|r| r.len());
        eprintln!("rank {}: ncclMemAlloc memory: {registered:?}", comm.rank());
        assert!(registered.is_ok());
    }
    drop((windows, registrations));
}

/// The child side of the two-process tests: rank 1 on device 1, the id on stdin.
fn child_rank(role: &str) {
    let Some((_, s1)) = two_gpus() else { return };
    let id = UniqueId::receive(2, std::io::stdin()).unwrap();
    let comm = Communicator::init_rank(&id, 2, 1, 1).unwrap();
    if role == "die" {
        // Dies with its rank joined, before the collective its peer waits in.
        std::process::exit(3);
    }
    let pool = MemPool::new(Route::device(1)).unwrap();
    let mut buffer = pool.alloc(4 << 20, &s1).unwrap();
    buffer.copy_from_host(&floats((0..1 << 20).map(|i| 2.0 * i as f32))).unwrap();
    comm.all_reduce::<f32>(&buffer, &buffer, 1 << 20, ReduceOp::Sum, &s1).unwrap();
    comm.wait(&s1, TIMEOUT).unwrap();
}

/// Rank 0 here, rank 1 in a child process started with `role`; the id goes over a socket.
fn parent_rank(test: &str, role: &str) -> Option<(Communicator, std::process::Child, Stream)> {
    let (s0, _) = two_gpus()?;
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--include-ignored", "--nocapture"])
        .env("CUMEMPOOL_NCCL_CHILD", role)
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(theirs)))
        .spawn()
        .unwrap();
    let id = UniqueId::new().unwrap();
    id.send(2, &mut ours).unwrap();
    Some((Communicator::init_rank(&id, 2, 0, 0).unwrap(), child, s0))
}

#[test]
#[ignore = "requires two CUDA GPUs"]
fn all_reduce_is_exact_across_two_processes() {
    if let Ok(role) = std::env::var("CUMEMPOOL_NCCL_CHILD") {
        return child_rank(&role);
    }
    let Some((comm, mut child, s0)) = parent_rank("all_reduce_is_exact_across_two_processes", "work") else {
        return;
    };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let mut buffer = pool.alloc(4 << 20, &s0).unwrap();
    buffer.copy_from_host(&floats((0..1 << 20).map(|i| i as f32))).unwrap();
    comm.all_reduce::<f32>(&buffer, &buffer, 1 << 20, ReduceOp::Sum, &s0).unwrap();
    comm.wait(&s0, TIMEOUT).unwrap();
    let mut out = vec![0u8; 4 << 20];
    buffer.copy_to_host(&mut out).unwrap();
    assert!(out == floats((0..1 << 20).map(|i| 3.0 * i as f32)));
    assert!(child.wait().unwrap().success());
}

/// A peer that dies mid-collective: the survivor's bounded wait fails (NCCL's asynchronous
/// error or the timeout) and aborts, instead of hanging; how long it took is printed.
#[test]
#[ignore = "requires two CUDA GPUs"]
fn a_peer_that_dies_mid_collective_fails_the_wait_within_its_bound() {
    if let Ok(role) = std::env::var("CUMEMPOOL_NCCL_CHILD") {
        return child_rank(&role);
    }
    let test = "a_peer_that_dies_mid_collective_fails_the_wait_within_its_bound";
    let Some((comm, mut child, s0)) = parent_rank(test, "die") else { return };
    let pool = MemPool::new(Route::device(0)).unwrap();
    let buffer = pool.alloc(4 << 20, &s0).unwrap();
    comm.all_reduce::<f32>(&buffer, &buffer, 1 << 20, ReduceOp::Sum, &s0).unwrap();
    let bound = Duration::from_secs(20);
    let start = Instant::now();
    let outcome = comm.wait(&s0, bound);
    eprintln!("the survivor's wait answered after {:?}: {outcome:?}", start.elapsed());
    assert!(matches!(outcome, Err(Error::Timeout { .. } | Error::Nccl { .. })), "{outcome:?}");
    assert!(start.elapsed() < bound + Duration::from_secs(10), "bounded");
    assert_eq!(child.wait().unwrap().code(), Some(3));
    assert!(matches!(comm.async_error(), Err(Error::Aborted)));
}

/// Bus bandwidth (GB/s) of all-reduce, all-gather and reduce-scatter from 1 MiB to 4 GiB on two
/// GPUs, for pool buffers, registered arena buffers and `ncclMemAlloc` buffers: the table for
/// docs/benchmarks.md, printed as Markdown.
#[test]
#[ignore = "requires two CUDA GPUs"]
fn bus_bandwidth_table() {
    let Some((s0, s1)) = two_gpus() else { return };
    let comms = Communicator::init_all(&[0, 1]).unwrap();
    let streams = [&s0, &s1];
    let largest: usize = std::env::var("CUMEMPOOL_NCCL_BENCH_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(4 << 30);
    let pools = [MemPool::new(Route::device(0)).unwrap(), MemPool::new(Route::device(1)).unwrap()];
    let arenas: Vec<Arena> =
        (0..2).map(|d| Arena::builder(d, 5 * largest).chunk_size(1 << 30).build().unwrap()).collect();
    println!("| collective | bytes | pool GB/s | arena (registered) GB/s | ncclMemAlloc GB/s |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for collective in ["all-reduce", "all-gather", "reduce-scatter"] {
        let mut bytes = 1usize << 20;
        while bytes <= largest {
            let mut row = Vec::new();
            let gathered = if collective == "all-reduce" { bytes } else { bytes * 2 };
            // Pool buffers.
            let pool_bufs: Vec<_> = (0..2)
                .map(|r| (pools[r].alloc(gathered, streams[r]).unwrap(), pools[r].alloc(gathered, streams[r]).unwrap()))
                .collect();
            let pool_pairs = [(&pool_bufs[0].0, &pool_bufs[0].1), (&pool_bufs[1].0, &pool_bufs[1].1)];
            row.push(time_collective(&comms, streams, collective, bytes, pool_pairs));
            drop(pool_bufs);
            // Arena buffers, the arena registered once.
            let blocks: Vec<_> = (0..2)
                .map(|r| {
                    (arenas[r].alloc(gathered, streams[r]).unwrap(), arenas[r].alloc(gathered, streams[r]).unwrap())
                })
                .collect();
            let registrations: Vec<_> = comms.iter().zip(&arenas).map(|(c, a)| c.register_arena(a).unwrap()).collect();
            let slices: Vec<_> = (0..2)
                .map(|r| {
                    (
                        DeviceSlice::of_arena(&arenas[r], &blocks[r].0).unwrap(),
                        DeviceSlice::of_arena(&arenas[r], &blocks[r].1).unwrap(),
                    )
                })
                .collect();
            row.push(time_collective(
                &comms,
                streams,
                collective,
                bytes,
                [(&slices[0].0, &slices[0].1), (&slices[1].0, &slices[1].1)],
            ));
            drop(registrations);
            // ncclMemAlloc buffers, registered.
            let memory: Vec<_> = (0..2)
                .map(|d| {
                    (
                        NcclMemory::new(d as i32, gathered, streams[d]).unwrap(),
                        NcclMemory::new(d as i32, gathered, streams[d]).unwrap(),
                    )
                })
                .collect();
            let registered: Vec<_> = comms
                .iter()
                .zip(&memory)
                .flat_map(|(c, m)| [c.register(&m.0).unwrap(), c.register(&m.1).unwrap()])
                .collect();
            row.push(time_collective(
                &comms,
                streams,
                collective,
                bytes,
                [(&memory[0].0, &memory[0].1), (&memory[1].0, &memory[1].1)],
            ));
            drop(registered);
            println!("| {collective} | {bytes} | {:.1} | {:.1} | {:.1} |", row[0], row[1], row[2]);
            bytes *= 4;
        }
    }
}

/// Bus bandwidth in GB/s of `collective` over `bytes` per rank (nccl-tests' definition).
fn time_collective<B: cumempool_nccl::DeviceBuffer>(
    comms: &[Communicator],
    streams: [&Stream; 2],
    collective: &str,
    bytes: usize,
    buffers: [(&B, &B); 2],
) -> f64 {
    let run = || {
        group(|g| {
            for r in 0..2 {
                let (send, recv) = buffers[r];
                match collective {
                    "all-reduce" => g.all_reduce::<f32>(&comms[r], send, recv, bytes / 4, ReduceOp::Sum, streams[r])?,
                    "all-gather" => g.all_gather::<f32>(&comms[r], send, recv, bytes / 4, streams[r])?,
                    _ => g.reduce_scatter::<f32>(&comms[r], send, recv, bytes / 4, ReduceOp::Sum, streams[r])?,
                }
            }
            Ok(())
        })
        .unwrap();
    };
    let wait = || (0..2).for_each(|r| comms[r].wait(streams[r], TIMEOUT).unwrap());
    run();
    wait();
    let iterations = (1usize << 30).div_ceil(bytes).clamp(2, 50);
    let start = Instant::now();
    for _ in 0..iterations {
        run();
    }
    wait();
    let seconds = start.elapsed().as_secs_f64() / iterations as f64;
    // nccl-tests: all-reduce moves 2(n-1)/n of the data per rank, the others (n-1)/n of the
    // gathered size.
    let (factor, size) = if collective == "all-reduce" { (1.0, bytes) } else { (0.5, bytes * 2) };
    size as f64 / seconds / 1e9 * factor
}
