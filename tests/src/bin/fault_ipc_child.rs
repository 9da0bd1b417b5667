//! The importing side of the fault suite's IPC case, started by `tests/faults/main.rs` with the fault
//! library as its driver and `CUMEMPOOL_FAULT_PLAN` failing its first pool import. It receives
//! the pool twice (the first import fails after the descriptor arrived), then maps the
//! allocation with each of the import's driver calls failing in turn, and writes one line per
//! case (`ok` or `WRONG`) back over the socket.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::descriptor_passing::{receive_allocation, receive_pool};
use cumempool::{Device, Error, Stream};
use cumempool_tests::fault_library::FaultLibrary;
use cumempool_tests::pattern;
use std::io::Write;
use std::os::unix::net::UnixStream;

fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").map(Iterator::count).unwrap_or(0)
}

/// The driver call an error says failed.
fn failed_call(error: &Error) -> Option<&'static str> {
    match error {
        Error::Driver(cause) | Error::SharingRefused { cause, .. } => Some(cause.function),
        _ => None,
    }
}

fn main() {
    let path = std::env::args().nth(1).expect("the socket path");
    let mut socket = UnixStream::connect(&path).expect("connecting to the parent");
    let library = std::env::var(cumempool::sys::LIBCUDA_ENV).expect("the parent names the fault library");
    let faults = FaultLibrary::open(library.as_ref()).expect("opening the fault library");
    let mut report = String::new();
    let mut line = |case: &str, good: bool, detail: String| {
        report.push_str(&format!("{case}: {} ({detail})\n", if good { "ok" } else { "WRONG" }));
    };

    // The driver opens descriptors of its own as it starts: started first, so that the count
    // below sees only the pool's.
    let context = Device::get(0).and_then(Device::primary_context).expect("device 0");
    let stream = Stream::new(&context).expect("a stream");
    // CUMEMPOOL_FAULT_PLAN fails the first cuMemPoolImportFromShareableHandle.
    let before = open_descriptors();
    let refused = receive_pool(&socket);
    let after = open_descriptors();
    match &refused {
        Err(error) => line(
            "import failing after the descriptor arrived",
            failed_call(error) == Some("cuMemPoolImportFromShareableHandle")
                && matches!(error, Error::SharingRefused { .. }),
            error.to_string(),
        ),
        Ok(_) => line("import failing after the descriptor arrived", false, "the import succeeded".into()),
    }
    line("every descriptor closed", after == before, format!("{before} open before, {after} after"));
    drop(refused);

    let received = receive_pool(&socket).expect("the second pool message imports");
    let shared = receive_allocation(&mut socket).expect("the allocation's export data");
    for (plan, function) in [
        ("cuMemPoolImportPointer:nth=1", "cuMemPoolImportPointer"),
        ("cuPointerGetAttribute:nth=1", "cuPointerGetAttribute"),
        ("cuPointerGetAttribute:nth=2", "cuPointerGetAttribute"),
    ] {
        faults.reset_counts();
        faults.set_plan(plan).expect("a plan");
        let mapped = received.pool.import_pointer(&shared, &stream);
        faults.clear();
        let case = format!("mapping with {plan}");
        match mapped {
            Err(error) => {
                let named = failed_call(&error) == Some(function) && faults.injected(function) == 1;
                line(&case, named, error.to_string());
            }
            Ok(_) => line(&case, false, "the mapping succeeded".into()),
        }
        // A mapping made before the failure was undone: the stream's unmap completes cleanly.
        line(&format!("{case}, then the stream"), stream.synchronize().is_ok(), String::new());
    }
    let mapping = received.pool.import_pointer(&shared, &stream).expect("mapping with no fault");
    let mut bytes = vec![0u8; shared.len()];
    mapping.copy_to_host(&mut bytes).expect("reading the mapping");
    line("the pool is usable after the failures", bytes == pattern(shared.len(), 5), String::new());
    drop(mapping);
    stream.synchronize().expect("unmapping");
    drop(received);
    socket.write_all(report.as_bytes()).expect("reporting");
}
