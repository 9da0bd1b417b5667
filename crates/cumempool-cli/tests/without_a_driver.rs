//! The command on a machine without a driver: a clear message and a failing exit code, no panic.
#![allow(clippy::expect_used)]

use std::process::Command;

/// The binary: beside this test when packed for the GPU machine, else cargo's.
fn binary() -> std::path::PathBuf {
    let packed = std::env::current_exe().expect("own path").with_file_name("bin--cumempool");
    if packed.exists() {
        packed
    } else {
        env!("CARGO_BIN_EXE_cumempool").into()
    }
}

fn cumempool(args: &[&str]) -> (i32, String) {
    let output = Command::new(binary())
        .args(args)
        .env("CUMEMPOOL_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .expect("the binary runs");
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.code().unwrap_or(-1), text)
}

#[test]
fn every_command_says_which_library_it_tried() {
    for args in [&[][..], &["routes"], &["doctor"], &["bench", "--quick"], &["routes", "--json"]] {
        let (code, text) = cumempool(args);
        assert_eq!(code, 1, "{args:?}: {text}");
        assert!(text.contains("/nonexistent/libcuda.so.1"), "{args:?}: {text}");
        assert!(!text.contains("panicked"), "{args:?}: {text}");
    }
}

#[test]
fn doctor_json_reports_the_missing_driver() {
    let (code, text) = cumempool(&["doctor", "--json"]);
    assert_eq!(code, 1);
    assert!(text.contains("\"error\"") && text.contains("\"compiled_features\""), "{text}");
}
