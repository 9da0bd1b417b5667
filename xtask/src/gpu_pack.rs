//! `cargo xtask gpu-pack [DIR]`: the GPU suite, built here and laid out to run on a GPU host that
//! has the NVIDIA driver but no Rust: every release test binary, the executables (the `cumempool`
//! command, the IPC tests' children, the examples), the fault-injecting driver library the
//! fault suite loads, the Python wheel (built with maturin, with the benchmark hooks) with the
//! Python tests, and `run.sh`, which runs them all with the GPU tests included, then every
//! example, then the Python tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct Options {
    dir: Option<PathBuf>,
    cargo_args: Vec<String>,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let (ours, cargo_args) = match args.iter().position(|a| a == "--") {
            Some(split) => (&args[..split], args[split + 1..].to_vec()),
            None => (args, Vec::new()),
        };
        match ours {
            [] => Ok(Options { dir: None, cargo_args }),
            [dir] if !dir.starts_with('-') => Ok(Options { dir: Some(dir.into()), cargo_args }),
            _ => Err(format!("unexpected arguments {ours:?} (see `cargo xtask help`)")),
        }
    }
}

/// The runner, copied beside the binaries.
const RUNNER: &str = include_str!("gpu_pack/run.sh");

pub fn run(options: &Options) -> Result<(), String> {
    let root = crate::workspace::root();
    let dir = options.dir.clone().unwrap_or_else(|| root.join(".gpu"));
    clear(&dir)?;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| format!("creating {}: {e}", bin.display()))?;
    // First, so that a pack whose build failed is still recognised as one and can be replaced.
    let runner = dir.join("run.sh");
    std::fs::write(&runner, RUNNER).map_err(|e| format!("writing {}: {e}", runner.display()))?;
    make_executable(&runner)?;

    eprintln!("building the test binaries (release)...");
    let tests = artifacts(&root, &["test", "--no-run"], &options.cargo_args, true)?;
    eprintln!("building the executables (release)...");
    let executables = artifacts(&root, &["build", "--lib", "--bins", "--examples"], &options.cargo_args, false)?;
    let mut names = std::collections::BTreeSet::new();
    for artifact in tests.iter().chain(&executables) {
        if !names.insert(artifact.packed_name.clone()) {
            return Err(format!("two artifacts would both be packed as {}", artifact.packed_name));
        }
        let dest = bin.join(&artifact.packed_name);
        std::fs::copy(&artifact.path, &dest)
            .map_err(|e| format!("copying {} to {}: {e}", artifact.path.display(), dest.display()))?;
    }
    eprintln!("building the Python wheel (maturin)...");
    let python = crate::python::environment(&root)?;
    // With the benchmark hooks, which the pack's benches time (`bench/alloc_pair.py
    // --breakdown`, `bench/workloads.py`); the user's wheel has none.
    let wheel_args: Vec<String> =
        options.cargo_args.iter().cloned().chain(["--features".into(), "bench-hooks".into()]).collect();
    let wheel = crate::python::build_wheel(&root, &python, &dir.join("wheels"), &wheel_args)?;
    eprintln!("packed {}", wheel.display());
    let size: u64 = std::fs::read_dir(&bin)
        .map_err(|e| format!("reading {}: {e}", bin.display()))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "packed {} test binaries and {} executables, examples and libraries into {} ({:.1} MiB)",
        tests.len(),
        executables.len(),
        dir.display(),
        size as f64 / (1 << 20) as f64
    );
    // The GPU host's path is not this one: the pack goes into a checkout of the same commit
    // there, at its root (where its Python tests are found), and runs from there.
    let name = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    eprintln!(
        "next: copy {} into a checkout of this commit on the GPU host (at its root) and run \
         `bash {name}/run.sh` there (CONTRIBUTING.md, docs/gpu-suite.md)",
        dir.display()
    );
    Ok(())
}

/// Empties `dir` for a new pack, but only if it is one (it holds run.sh) or is empty, so a
/// mistyped directory is never wiped.
fn clear(dir: &Path) -> Result<(), String> {
    let Ok(mut entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    if entries.next().is_some() && !dir.join("run.sh").is_file() {
        return Err(format!(
            "{} is not empty and holds no run.sh: not a GPU pack, refusing to replace it",
            dir.display()
        ));
    }
    std::fs::remove_dir_all(dir).map_err(|e| format!("removing the old pack {}: {e}", dir.display()))
}

struct Artifact {
    path: PathBuf,
    /// `test--<package>--<target>` for a test binary, `example--<name>` for an example (run.sh
    /// runs each after the tests), `bin--<name>` for another executable: the tests find
    /// `bin--cumempool` and `bin--ipc_child` beside themselves by these names. A C library
    /// (`cdylib`, the fault suite's driver) keeps its file name, `libcumempool_fault.so`.
    packed_name: String,
}

/// Runs `cargo <command> --release` over the workspace (xtask aside) with the binaries stripped, and returns the executables cargo reports that are test harnesses (`tests`)
/// or that are not (`cargo test` builds the executables too, for the tests that run them), the
/// latter with the C libraries (`cdylib`) built.
fn artifacts(root: &Path, command: &[&str], extra: &[String], tests: bool) -> Result<Vec<Artifact>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args(command)
        .args(["--workspace", "--exclude", "xtask", "--release", "--message-format=json-render-diagnostics"])
        // The Python extension travels as a wheel (built by maturin), not as a bare library.
        .args(["--exclude", "cumempool-py"])
        .args(extra)
        // Small enough to carry (a third of the size with symbols); a panic still names its
        // file and line.
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols")
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("`cargo {}` failed ({})", command.join(" "), output.status));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        if !tests {
            found.extend(c_libraries(&message));
        }
        let Some(path) = message["executable"].as_str() else {
            continue;
        };
        let is_test = message["profile"]["test"] == true;
        if is_test != tests {
            continue;
        }
        let target = message["target"]["name"].as_str().unwrap_or("unknown").replace('-', "_");
        let is_example = message["target"]["kind"].as_array().is_some_and(|kinds| kinds.iter().any(|k| k == "example"));
        let packed_name = if is_test {
            let package = package_name(message["package_id"].as_str().unwrap_or("unknown"));
            format!("test--{}--{target}", package.replace('-', "_"))
        } else if is_example {
            format!("example--{target}")
        } else {
            format!("bin--{target}")
        };
        found.push(Artifact { path: path.into(), packed_name });
    }
    Ok(found)
}

/// The C libraries (`cdylib`) a compiler-artifact message reports, packed under their file names.
fn c_libraries(message: &serde_json::Value) -> Vec<Artifact> {
    let is_cdylib = message["target"]["crate_types"].as_array().is_some_and(|t| t.iter().any(|t| t == "cdylib"));
    if !is_cdylib {
        return Vec::new();
    }
    let files = message["filenames"].as_array().map(Vec::as_slice).unwrap_or_default();
    files
        .iter()
        .filter_map(|f| f.as_str())
        .filter(|f| f.ends_with(std::env::consts::DLL_SUFFIX))
        .filter_map(|f| {
            let path = PathBuf::from(f);
            let packed_name = path.file_name()?.to_str()?.to_owned();
            Some(Artifact { path, packed_name })
        })
        .collect()
}

/// The package's name out of cargo's package id: `path+file:///…/tests#cumempool-tests@0.1.0`,
/// or `path+file:///…/cumempool-cli#0.1.0` where the directory is named after the package, or the
/// older `cumempool-tests 0.1.0 (path+file:///…)`.
fn package_name(id: &str) -> &str {
    match id.rsplit_once('#') {
        Some((_, fragment)) if fragment.contains('@') => fragment.split('@').next().unwrap_or(fragment),
        Some((url, _)) => url.rsplit('/').next().unwrap_or(url),
        None => id.split(' ').next().unwrap_or(id),
    }
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("making {} executable: {e}", path.display()))
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<(), String> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_libraries_are_packed_under_their_file_names() {
        let message = serde_json::json!({
            "target": {"crate_types": ["cdylib", "rlib"]},
            "filenames": ["/t/release/deps/libcumempool_fault.so", "/t/release/deps/libcumempool_fault.rlib"],
        });
        let found = c_libraries(&message);
        assert_eq!(found.iter().map(|a| a.packed_name.as_str()).collect::<Vec<_>>(), ["libcumempool_fault.so"]);
        assert!(
            c_libraries(&serde_json::json!({"target": {"crate_types": ["lib"]}, "filenames": ["/t/x.so"]})).is_empty()
        );
    }

    #[test]
    fn package_names_come_out_of_both_id_forms() {
        assert_eq!(package_name("path+file:///src/cumempool/tests#cumempool-tests@0.1.0"), "cumempool-tests");
        assert_eq!(package_name("path+file:///src/cumempool/crates/cumempool-cli#0.1.0"), "cumempool-cli");
        assert_eq!(package_name("cumempool-tests 0.1.0 (path+file:///src/cumempool/tests)"), "cumempool-tests");
    }
}
