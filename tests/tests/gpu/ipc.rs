//! Two processes share a pool: the parent exports a pool and an allocation with a pattern, a
//! fresh child process imports both, checks the pattern and writes its own, which the parent
//! reads back; the child also tries every bad input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cumempool::descriptor_passing::{send_allocation, send_pool};
use cumempool::{Error, HandleTypes, MemPool, Route};
use cumempool_tests::{gpu_stream, pattern};
use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The child binary: beside this test binary when packed for the GPU machine, else cargo's.
fn child_binary() -> PathBuf {
    let packed = std::env::current_exe().unwrap().with_file_name("bin--ipc_child");
    if packed.exists() {
        packed
    } else {
        PathBuf::from(env!("CARGO_BIN_EXE_ipc_child"))
    }
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn a_child_process_imports_the_pool_reads_the_pattern_and_writes_back() {
    let stream = gpu_stream().expect("a GPU");
    let pool =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    let mut buffer = pool.alloc(1 << 20, &stream).unwrap();
    buffer.copy_from_host(&pattern(1 << 20, 1)).unwrap();

    let path = std::env::temp_dir().join(format!("cumempool-ipc-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut child = std::process::Command::new(child_binary()).arg(&path).spawn().unwrap();
    let started = Instant::now();
    let mut socket = loop {
        match listener.accept() {
            Ok((socket, _)) => break socket,
            Err(_) if started.elapsed() < Duration::from_secs(60) => {
                assert!(child.try_wait().unwrap().is_none(), "the child exited before connecting");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(error) => panic!("no child connected: {error}"),
        }
    };
    socket.set_nonblocking(false).unwrap();
    // The pool is shared first: the driver exports allocations of an already shared pool.
    send_pool(&socket, &pool).unwrap();
    let shared = buffer.export().unwrap();
    send_allocation(&mut socket, &shared).unwrap();
    let mut report = String::new();
    socket.read_to_string(&mut report).unwrap();
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(&path);
    eprintln!("child report:\n{report}");
    assert!(status.success(), "child failed: {report}");
    assert!(report.contains("pattern from the exporter: ok"), "{report}");
    assert!(!report.contains("WRONG"), "{report}");
    assert_eq!(report.matches(": refused (").count(), 9, "{report}");
    assert!(
        report.contains("length beyond the allocation: refused (the shared allocation claims 1073741824 bytes"),
        "{report}"
    );

    let mut back = vec![0u8; 1 << 20];
    buffer.copy_to_host(&mut back).unwrap();
    assert_eq!(back, pattern(1 << 20, 2), "the child's bytes arrived");
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn exporting_without_an_export_handle_type_is_a_clear_error() {
    let stream = gpu_stream().expect("a GPU");
    let private = MemPool::new(Route::device(0)).unwrap();
    match private.export_fd() {
        Err(e @ Error::NotShareable { .. }) => assert!(e.to_string().contains("POSIX_FILE_DESCRIPTOR"), "{e}"),
        other => panic!("expected Sharing, got {other:?}"),
    }
    assert!(matches!(private.export_fabric(), Err(Error::NotShareable { .. })));
    let buffer = private.alloc(4096, &stream).unwrap();
    match buffer.export() {
        Err(e @ Error::SharingRefused { .. }) => {
            assert!(e.cuda_code().is_some(), "the driver's answer is kept: {e:?}");
            eprintln!("{e}");
        }
        other => panic!("expected Sharing, got {other:?}"),
    }
    let empty = private.alloc(0, &stream).unwrap();
    assert!(matches!(empty.export(), Err(Error::NotShareable { .. })));
    let exportable =
        MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build().unwrap();
    #[cfg(feature = "cuda-13020")]
    match exportable.export_handle_types() {
        Ok(types) => assert_eq!(types, HandleTypes::POSIX_FILE_DESCRIPTOR),
        Err(Error::DriverTooOld { needs: cumempool::DriverVersion::CUDA_13_2, .. }) => {}
        other => panic!("EXPORT_HANDLE_TYPES: {other:?}"),
    }
    drop(exportable.export_fd().unwrap());
}

#[test]
#[ignore = "requires a CUDA GPU"]
fn fabric_export_works_or_says_why() {
    let _stream = gpu_stream().expect("a GPU");
    let device = cumempool::Device::get(0).unwrap();
    let supported = device.supported_handle_types().unwrap();
    let built = MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::FABRIC).build();
    match (supported.contains(HandleTypes::FABRIC), built) {
        (true, Ok(pool)) => match pool.export_fabric() {
            Ok(handle) => assert!(handle.iter().any(|b| *b != 0), "a fabric handle has content"),
            Err(e @ (Error::NotShareable { .. } | Error::SharingRefused { .. })) => {
                let text = e.to_string();
                assert!(text.contains("IMEX"), "{text}");
                eprintln!("fabric export refused: {text}");
                drop(pool); // must not crash (driver 580 does in cuMemPoolDestroy after a refused export)
            }
            Err(other) => panic!("fabric export: {other:?}"),
        },
        (true, Err(e)) => panic!("the device supports fabric handles but the pool was refused: {e}"),
        (false, Ok(pool)) => assert!(matches!(pool.export_fabric(), Err(Error::NotShareable { .. }))),
        (false, Err(e)) => eprintln!("no fabric support here: {e}"),
    }
}
