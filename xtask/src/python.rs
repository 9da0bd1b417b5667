//! The Python package's build and tests: a virtual environment under `target/py-venv` with
//! maturin, pytest, numpy and mypy (installed with pip when missing), the abi3 wheel built by
//! maturin, and `cargo xtask test`, the README's one test command (`cargo test --workspace`,
//! then the wheel, its type stubs checked against it, then pytest on
//! `crates/cumempool-py/tests`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The maturin the wheel is built with (pyproject.toml's build requirement).
const MATURIN: &str = "maturin>=1.16,<1.17";

/// The ruff the Python code is linted with (its rules change between minor releases).
const RUFF: &str = "ruff>=0.17,<0.18";

/// pytest's exit status when it collected no test: not a failure here.
const PYTEST_NO_TESTS: i32 = 5;

/// The Python of the build environment, created (with its tools) when missing.
pub fn environment(root: &Path) -> Result<PathBuf, String> {
    let venv = root.join("target").join("py-venv");
    let python = venv.join("bin").join("python");
    if !python.is_file() {
        let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(Command::new(&host).args(["-m", "venv"]).arg(&venv), "creating the Python environment")?;
    }
    let mut missing = Vec::new();
    let tools = [
        ("maturin", MATURIN),
        ("pytest", "pytest"),
        ("pytest_timeout", "pytest-timeout"),
        ("numpy", "numpy"),
        ("mypy", "mypy"),
        ("ruff", RUFF),
    ];
    for (module, requirement) in tools {
        let found = Command::new(&python).args(["-c", &format!("import {module}")]).output();
        if !found.is_ok_and(|o| o.status.success()) {
            missing.push(requirement);
        }
    }
    if !missing.is_empty() {
        eprintln!("installing {} into {}", missing.join(", "), venv.display());
        run(Command::new(&python).args(["-m", "pip", "install", "--quiet"]).args(&missing), "pip install")?;
    }
    Ok(python)
}

/// Builds the abi3 wheel into `out` with maturin (release; `cargo_args` such as features pass
/// through) and returns its path.
pub fn build_wheel(root: &Path, python: &Path, out: &Path, cargo_args: &[String]) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    let before = wheels_in(out);
    let manifest = root.join("crates").join("cumempool-py").join("Cargo.toml");
    run(
        Command::new(python)
            .args(["-m", "maturin", "build", "--release", "--manifest-path"])
            .arg(&manifest)
            .arg("--out")
            .arg(out)
            .args(cargo_args)
            .current_dir(root),
        "maturin build",
    )?;
    // The newest wheel in `out` that this build wrote or replaced.
    let mut wheels = wheels_in(out);
    wheels.sort_by_key(|(_, modified)| *modified);
    wheels
        .into_iter()
        .rev()
        .find(|w| !before.contains(w))
        .or_else(|| wheels_in(out).into_iter().max_by_key(|(_, m)| *m))
        .map(|(path, _)| path)
        .ok_or_else(|| format!("maturin wrote no wheel into {}", out.display()))
}

fn wheels_in(dir: &Path) -> Vec<(PathBuf, std::time::SystemTime)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            let path = e.path();
            let modified = e.metadata().ok()?.modified().ok()?;
            (path.extension()? == "whl" && path.file_name()?.to_str()?.starts_with("cumempool-"))
                .then_some((path, modified))
        })
        .collect()
}

/// Installs `wheel` into the environment and runs the Python tests with it.
pub fn test_wheel(root: &Path, python: &Path, wheel: &Path) -> Result<(), String> {
    run(
        Command::new(python).args(["-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall"]).arg(wheel),
        "installing the wheel",
    )?;
    check_types(root, python)?;
    lint(root, python)?;
    let tests = root.join("crates").join("cumempool-py").join("tests");
    let status = Command::new(python)
        .args(["-m", "pytest", "-q"])
        .arg(&tests)
        // The tests import the installed package, never the source folder.
        .current_dir(root.join("crates").join("cumempool-py"))
        .status()
        .map_err(|e| format!("running pytest: {e}"))?;
    match status.code() {
        Some(0 | PYTEST_NO_TESTS) => Ok(()),
        _ => Err(format!("the Python tests failed ({status})")),
    }
}

/// Lints the Python package, its tests, examples and benches with ruff (pyproject.toml's rules),
/// and checks they are laid out as `ruff format` lays them out.
fn lint(root: &Path, python: &Path) -> Result<(), String> {
    let package = root.join("crates").join("cumempool-py");
    run(
        Command::new(python).args(["-m", "ruff", "check", "--quiet", "."]).current_dir(&package),
        "ruff check (crates/cumempool-py/pyproject.toml's rules)",
    )?;
    run(
        Command::new(python).args(["-m", "ruff", "format", "--check", "--quiet", "."]).current_dir(&package),
        "ruff format --check (run `ruff format` in crates/cumempool-py)",
    )
}

/// Checks the installed package's stubs against the module (mypy's stubtest imports it only,
/// which needs no driver) and type-checks the quick start with them (mypy's settings, such as
/// which libraries may be missing, are in the package's pyproject.toml).
fn check_types(root: &Path, python: &Path) -> Result<(), String> {
    let package = root.join("crates").join("cumempool-py");
    run(
        Command::new(python)
            .args(["-m", "mypy.stubtest", "--mypy-config-file", "pyproject.toml"])
            .args(["--allowlist", "stubtest-allowlist.txt", "cumempool"])
            .current_dir(&package),
        "stubtest (the stubs differ from the module)",
    )?;
    run(
        Command::new(python)
            .args(["-m", "mypy", "--config-file", "pyproject.toml", "examples/quickstart.py"])
            .current_dir(&package),
        "mypy on examples/quickstart.py",
    )
}

/// `cargo xtask test [--python-only]`.
pub fn test(args: &[String]) -> Result<(), String> {
    let root = crate::workspace::root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    match args {
        [] | [_] if args.first().is_none_or(|flag| flag == "--python-only") => {
            if args.is_empty() {
                run(Command::new(&cargo).args(["test", "--workspace"]).current_dir(&root), "cargo test --workspace")?;
            }
            let python = environment(&root)?;
            let wheel = build_wheel(&root, &python, &root.join("target").join("wheels"), &[])?;
            eprintln!("built {}", wheel.display());
            test_wheel(&root, &python, &wheel)
        }
        [part, filter @ ..] if part == "rust" && filter.len() <= 1 => {
            let mut command = Command::new(&cargo);
            command.args(["test", "--workspace"]).args(filter).current_dir(&root);
            run(&mut command, "cargo test --workspace")
        }
        [part, filter @ ..] if part == "python" && filter.len() <= 1 => iterate_python(&root, filter.first()),
        _ => Err(format!(
            "unexpected arguments {args:?}: cargo xtask test [--python-only | rust [FILTER] | python [FILTER]]"
        )),
    }
}

/// `cargo xtask test python [FILTER]`: the quick loop on the Python package. The native module
/// is built into the source folder with `maturin develop --release` (cargo rebuilds only what
/// changed), so the package is imported from `crates/cumempool-py/python` and an edit of a
/// `.py` file needs no build at all; then pytest, with `-k FILTER`. The checks of the installed
/// wheel (stubtest, mypy, ruff) stay with `--python-only`.
fn iterate_python(root: &Path, filter: Option<&String>) -> Result<(), String> {
    let python = environment(root)?;
    let package = root.join("crates").join("cumempool-py");
    run(
        Command::new(&python)
            .args(["-m", "maturin", "develop", "--release", "--quiet", "--manifest-path"])
            .arg(package.join("Cargo.toml"))
            .env("VIRTUAL_ENV", python.parent().and_then(Path::parent).unwrap_or(root)),
        "maturin develop",
    )?;
    let mut pytest = Command::new(&python);
    pytest.args(["-m", "pytest", "-q"]).arg(package.join("tests")).current_dir(&package);
    if let Some(filter) = filter {
        pytest.args(["-k", filter]);
    }
    let status = pytest.status().map_err(|e| format!("running pytest: {e}"))?;
    match status.code() {
        Some(0 | PYTEST_NO_TESTS) => Ok(()),
        _ => Err(format!("the Python tests failed ({status})")),
    }
}

fn run(command: &mut Command, what: &str) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("{what}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}
