//! The importing side of the two-process sharing test (tests/gpu/ipc.rs starts it).
//!
//! Usage: `ipc_child SOCKET_PATH`. Connects, imports the pool and the allocation, checks the
//! exporter's pattern, writes its own, tries the bad inputs, and reports one line per check.

use cumempool::descriptor_passing::{receive_allocation, receive_pool};
use cumempool::{default_pool, Device, Error, MemPool, Route, SharedAllocation, Stream};
use cumempool_tests::pattern;
use std::io::Write;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;

fn run(socket: &mut UnixStream) -> Result<Vec<String>, Error> {
    let context = Device::get(0)?.primary_context()?;
    let stream = Stream::new(&context)?;
    let received = receive_pool(socket)?;
    let shared = receive_allocation(socket)?;
    let mut report = vec![format!("exporter route: {:?}", received.exporter_route)];
    let pool = received.pool;
    report.push(format!(
        "imported location: {}",
        pool.location().map_or_else(|e| format!("unknown ({e})"), |l| l.to_string())
    ));

    let mut mapping = pool.import_pointer(&shared, &stream)?;
    // A second import of the same allocation would get the same mapping, which the first
    // buffer's drop would then unmap under the second: one buffer per mapping.
    report.push(match pool.import_pointer(&shared, &stream) {
        Err(Error::AlreadyImported { .. }) => "importing the same allocation twice: refused (already imported)".into(),
        Err(other) => format!("importing the same allocation twice: WRONG error ({other})"),
        Ok(_) => "importing the same allocation twice: WRONGLY ACCEPTED".into(),
    });
    // Another process may write it at any time: no slice over it.
    report.push(match mapping.host_slice() {
        Err(Error::ImportedMemoryNotSliceable) => "a slice over imported memory: refused (copy only)".into(),
        other => format!("a slice over imported memory: WRONG ({:?})", other.map(<[u8]>::len)),
    });
    let mut bytes = vec![0u8; mapping.len()];
    mapping.copy_to_host(&mut bytes)?;
    report
        .push(format!("pattern from the exporter: {}", if bytes == pattern(bytes.len(), 1) { "ok" } else { "WRONG" }));
    mapping.copy_from_host(&pattern(bytes.len(), 2))?;
    drop(mapping);
    stream.synchronize()?;
    report.push("wrote own pattern: ok".into());

    // Bad input: each must be a clear error, never a crash.
    let check = |name: &str, result: Result<(), Error>| match result {
        Err(error) => format!("{name}: refused ({error})"),
        Ok(()) => format!("{name}: WRONGLY ACCEPTED"),
    };
    report.push(check("allocating from the imported pool", pool.alloc(4096, &stream).map(drop)));
    let mut garbage = [0x5au8; SharedAllocation::ENCODED_LEN];
    garbage[64..].copy_from_slice(&4096u64.to_le_bytes());
    let garbage = SharedAllocation::from_bytes(&garbage)?;
    // A peer that claims more bytes than it shared: the driver's mapping decides, not the wire.
    let mut inflated = shared.to_bytes();
    inflated[64..].copy_from_slice(&(1u64 << 30).to_le_bytes());
    let inflated = SharedAllocation::from_bytes(&inflated)?;
    report.push(check(
        "importing with a length beyond the allocation",
        pool.import_pointer(&inflated, &stream).map(drop),
    ));
    report.push(check("importing garbage export data", pool.import_pointer(&garbage, &stream).map(drop)));
    report
        .push(check("reading truncated export data", SharedAllocation::from_bytes(&shared.to_bytes()[..40]).map(drop)));
    let own = default_pool(Route::device(0))?;
    report.push(check("importing into a pool of this process", own.import_pointer(&shared, &stream).map(drop)));
    // SAFETY: descriptor 987 is not open in this process; the import must say so, not crash.
    let closed = unsafe { BorrowedFd::borrow_raw(987) };
    report.push(check("importing from a closed descriptor", MemPool::import_fd(closed).map(drop)));
    let wrong = std::fs::File::open("/dev/null").map_err(|e| cumempool::descriptor_passing::io_error("open", e))?;
    report.push(check("importing from a descriptor that is no pool", MemPool::import_fd(&wrong).map(drop)));
    drop(pool);
    Ok(report)
}

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: ipc_child SOCKET_PATH");
        return ExitCode::from(2);
    };
    let mut socket = match UnixStream::connect(&path) {
        Ok(socket) => socket,
        Err(error) => {
            eprintln!("connecting to {path}: {error}");
            return ExitCode::from(2);
        }
    };
    let (lines, code) = match run(&mut socket) {
        Ok(lines) => (lines, ExitCode::SUCCESS),
        Err(error) => (vec![format!("FAILED: {error}")], ExitCode::FAILURE),
    };
    for line in &lines {
        let _ = writeln!(socket, "{line}");
    }
    code
}
