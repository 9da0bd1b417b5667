//! Containers in pinned host memory: a `hashbrown::HashMap` and an `allocator_api2` `Vec`
//! allocate from a cumempool host pool through `PoolAllocator`, and the Vec's bytes go to the
//! device and back.
//!
//! `cargo run --example pinned_containers`

#[path = "exit_report.rs"]
mod exit_report;

use allocator_api2::vec::Vec;
use cumempool::{Device, MemPool, Route, Stream};
use cumempool_alloc::{HostMemory, PoolAllocator};
use hashbrown::HashMap;

fn main() -> std::process::ExitCode {
    exit_report::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let context = Device::get(0)?.primary_context()?;
    let pool = MemPool::new(Route::host())?;
    let allocator = PoolAllocator::<HostMemory>::new(&pool, &context)?;

    let mut squares = HashMap::new_in(allocator.clone());
    for n in 0..100_000u64 {
        squares.insert(n, n * n);
    }
    println!("HashMap: {} entries, squares[12345] = {}", squares.len(), squares[&12345]);

    let mut bytes = Vec::new_in(allocator.clone());
    bytes.extend((0..8 << 20).map(|i: u32| (i % 251) as u8));
    println!(
        "Vec: {} MiB in pinned host memory; the host pool holds {} MiB",
        bytes.len() >> 20,
        pool.used_mem_current()? >> 20
    );

    // Pinned memory is what the copy engines read directly.
    let stream = Stream::new(&context)?;
    let device = MemPool::new(Route::device(0))?;
    let mut on_device = device.alloc(bytes.len(), &stream)?;
    on_device.copy_from_host(&bytes)?;
    let mut back = Vec::new_in(allocator.clone());
    back.resize(bytes.len(), 0u8);
    on_device.copy_to_host(&mut back)?;
    println!("round trip through the device: {}", if back == bytes { "same bytes" } else { "DIFFERENT" });
    if back != bytes {
        return Err("the bytes changed on the way".into());
    }

    drop((squares, bytes, back));
    println!("containers dropped: the host pool holds {} bytes", pool.used_mem_current()?);
    Ok(())
}
