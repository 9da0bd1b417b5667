//! Two processes sharing a pool over a Unix socket: this program exports a device pool and an
//! allocation holding a pattern, starts itself again as the child, which imports both, checks
//! the pattern and writes its answer into the same memory, which the parent reads back.
//!
//! `cargo run --example shared_pool_two_processes`

#[path = "exit_report.rs"]
mod exit_report;

use cumempool::descriptor_passing::{receive_allocation, receive_pool, send_allocation, send_pool};
use cumempool::{Device, HandleTypes, MemPool, Route, Stream};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

const BYTES: usize = 4 << 20;

fn pattern(seed: u8) -> Vec<u8> {
    (0..BYTES).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The child: imports the pool and the allocation, checks the parent's pattern, writes its own.
fn child(socket_path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut socket = UnixStream::connect(socket_path)?;
    let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
    let pool = receive_pool(&socket)?.pool;
    let shared = receive_allocation(&mut socket)?;
    let mut memory = pool.import_pointer(&shared, &stream)?;
    let mut bytes = vec![0u8; memory.len()];
    memory.copy_to_host(&mut bytes)?;
    let seen = if bytes == pattern(1) { "the parent's pattern" } else { "WRONG bytes" };
    memory.copy_from_host(&pattern(2))?;
    drop(memory);
    stream.synchronize()?;
    writeln!(socket, "child {}: imported {} MiB, read {seen}, wrote its own", std::process::id(), BYTES >> 20)?;
    Ok(())
}

fn parent() -> Result<(), Box<dyn std::error::Error>> {
    let stream = Stream::new(&Device::get(0)?.primary_context()?)?;
    let pool = MemPool::builder(Route::device(0)).export_handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR).build()?;
    let mut buffer = pool.alloc(BYTES, &stream)?;
    buffer.copy_from_host(&pattern(1))?;

    let path = std::env::temp_dir().join(format!("cumempool-example-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    listener.set_nonblocking(true)?;
    let mut child = std::process::Command::new(std::env::current_exe()?).arg("child").arg(&path).spawn()?;
    println!("parent {}: pool exported for child {}", std::process::id(), child.id());
    let started = Instant::now();
    let mut socket = loop {
        match listener.accept() {
            Ok((socket, _)) => break socket,
            Err(_) if started.elapsed() < Duration::from_secs(30) && child.try_wait()?.is_none() => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(error) => return Err(format!("the child never connected: {error}").into()),
        }
    };
    socket.set_nonblocking(false)?;
    // The pool first: the driver exports allocations of an already shared pool only.
    send_pool(&socket, &pool)?;
    send_allocation(&mut socket, &buffer.export()?)?;
    let mut report = String::new();
    socket.read_to_string(&mut report)?;
    let status = child.wait()?;
    let _ = std::fs::remove_file(&path);
    print!("{report}");
    let mut bytes = vec![0u8; BYTES];
    buffer.copy_to_host(&mut bytes)?;
    let answer = if bytes == pattern(2) { "the child's pattern" } else { "WRONG bytes" };
    println!("parent: the shared memory now holds {answer}");
    if !status.success() || bytes != pattern(2) {
        return Err("sharing failed".into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    exit_report::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("child") => child(args.get(2).ok_or("usage: shared_pool_two_processes child SOCKET")?),
        _ => parent(),
    }
}
