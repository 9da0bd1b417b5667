//! Every Rust code block of the README, the crates' READMEs and docs/*.md, run on the GPU (see
//! build.rs). Each block runs in a process of its own: examples change process-global routes
//! and count retired pools, which other blocks running beside them would disturb.

// The pages show the API of the default features (the newest CUDA declarations).
#![cfg(feature = "cuda-13050")]
#![allow(clippy::expect_used, clippy::panic)]

use std::process::Command;

/// Set in the child process that runs one block.
const CHILD: &str = "CUMEMPOOL_DOC_BLOCK";

/// Runs `body` in a new process of this test binary (the test `name` alone), or, in that
/// process, runs it. A `two_gpus` block is skipped, with a note, on a machine with fewer.
fn run_in_own_process(name: &str, two_gpus: bool, body: fn() -> Result<(), String>) {
    if std::env::var_os(CHILD).is_some() {
        if two_gpus && cumempool::Device::count().unwrap_or(0) < 2 {
            assert!(std::env::var_os("CUMEMPOOL_REQUIRE_TWO_GPUS").is_none(), "{name}: two GPUs required");
            eprintln!("{name}: skipped, the example needs two GPUs");
            return;
        }
        if let Err(error) = body() {
            panic!("{name}: the example failed: {error}");
        }
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = Command::new(exe)
        .args([name, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .status()
        .expect("the test binary runs again");
    assert!(status.success(), "{name}: the example's process failed ({status})");
}

include!(concat!(env!("OUT_DIR"), "/doc_blocks.rs"));
