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

/// stdout of `--json` is one document even without a driver, so a script can always parse it.
#[test]
fn json_without_a_driver_is_a_document_with_the_error_on_stdout() {
    for args in [&["routes", "--json"][..], &["doctor", "--json"], &["bench", "--quick", "--json"]] {
        let output = Command::new(binary())
            .args(args)
            .env("CUMEMPOOL_LIBCUDA", "/nonexistent/libcuda.so.1")
            .output()
            .expect("the binary runs");
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        let document: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
        assert_eq!(document["schema_version"], 1, "{args:?}");
        assert_eq!(document["command"], args[0], "{args:?}");
        assert!(document["error"].as_str().is_some_and(|e| e.contains("/nonexistent/libcuda.so.1")), "{document}");
        assert_eq!(document["library_tried"], "/nonexistent/libcuda.so.1", "{args:?}");
    }
}

#[test]
fn bench_refuses_what_it_would_change_silently() {
    for args in [
        &["bench", "--pairs", "10"][..],
        &["bench", "--quick", "--rounds", "9"],
        &["bench", "--quick", "--pairs", "500"],
    ] {
        let (code, text) = cumempool(args);
        assert_eq!(code, 2, "{args:?}: {text}");
        assert!(text.contains("--pairs") || text.contains("--rounds"), "{args:?}: {text}");
    }
}
