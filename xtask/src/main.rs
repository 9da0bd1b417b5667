//! Project automation, run as `cargo xtask <command>`.
//!
//! - `cargo xtask bindgen [--cuda 13.0|13.2|13.4|13.5] [--header PATH] [--check]`: regenerate the committed
//!   bindings of `cumempool-sys` from the pinned cuda.h headers, or prove they are fresh.
//! - `cargo xtask bindgen --nccl [--check]`: the same for `cumempool-nccl`, from the pinned nccl.h.
//! - `cargo xtask gpu-pack [DIR] [-- CARGO_ARGS]`: build the GPU suite to run on a GPU host
//!   without Rust, the Python wheel and its tests included.
//! - `cargo xtask module-cycles`: fails when modules of a crate depend on each other
//!   (docs/decisions.md promises none), or a folder uses a layer above it (`LAYERS`).
//! - `cargo xtask driver-boundary`: fails when the Python crate names a CUDA driver entry point
//!   (it reaches the driver only through the core crate's checked operations).
//! - `cargo xtask internals-check`: fails when a file or item `docs/internals.md` names is gone.
//! - `cargo xtask test [--python-only | rust [FILTER] | python [FILTER]]`: the README's test command: `cargo test --workspace`,
//!   then the Python wheel built with maturin and its pytest suite.

mod attribute_places;
mod bindgen;
mod driver_boundary;
mod gpu_pack;
mod headers;
mod internals_check;
mod libclang;
mod module_cycles;
mod nccl;
mod python;
mod workspace;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("bindgen") if args[1..].iter().any(|a| a == "--nccl") => nccl_options(&args[1..]).and_then(nccl::run),
        Some("bindgen") => bindgen::Options::parse(&args[1..]).and_then(|o| bindgen::run(&o)),
        Some("gpu-pack") => gpu_pack::Options::parse(&args[1..]).and_then(|o| gpu_pack::run(&o)),
        Some("test") => python::test(&args[1..]),
        Some("module-cycles") => module_cycles::run(&workspace::root()),
        Some("driver-boundary") => driver_boundary::run(&workspace::root()),
        Some("internals-check") => internals_check::run(&workspace::root()),
        Some("help" | "--help" | "-h") | None => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

const USAGE: &str = "usage: cargo xtask bindgen [--cuda 13.0|13.2|13.4|13.5] [--header PATH] [--check]
       cargo xtask bindgen --nccl [--check]
       cargo xtask gpu-pack [DIR] [-- CARGO_ARGS]
       cargo xtask test [--python-only | rust [FILTER] | python [FILTER]]
       cargo xtask module-cycles
       cargo xtask driver-boundary
       cargo xtask internals-check

bindgen: regenerate crates/cumempool-sys/src/generated/ from the pinned cuda.h (needs libclang)
  --cuda V      only this CUDA version (default: every pinned version)
  --header P    use this cuda.h (cudaTypedefs.h is read from beside it) instead of the pinned wheel
  --check       regenerate into memory and fail if the committed files differ
  --nccl        instead, crates/cumempool-nccl/src/generated/ from the pinned nccl.h (NCCL 2.30.7's
                wheel, 216 MB, fetched into target/nccl-headers once)

gpu-pack: build every test binary and executable in release mode into DIR (default .gpu) with
  run.sh, to copy to a GPU host without Rust and run there: `bash DIR/run.sh` (docs/gpu-suite.md).
  CARGO_ARGS go to cargo, e.g. `-- --no-default-features --features cuda-13000`. The Python
  wheel (maturin) goes into DIR/wheels and run.sh runs the Python GPU tests too.

module-cycles: list the modules of each crate that depend on each other (a parent and a child,
  siblings, or through others) and fail unless every one is listed as pending in
  xtask/src/module_cycles.rs; fail too on a use of a layer above, for the crates whose folders
  LAYERS in that file lists from the bottom up.

driver-boundary: fail when the Python crate's code (crates/cumempool-py/src and python/) calls a
  CUDA driver entry point or the loader: it reaches the driver only through the core crate.

internals-check: fail when a file or item docs/internals.md names does not exist.

test: `cargo test --workspace`, then the Python wheel built into target/wheels with maturin and
  installed into target/py-venv (created, with maturin, pytest and numpy, when missing), then
  pytest on crates/cumempool-py/tests (GPU tests skip without a GPU). --python-only skips cargo test.
  `test rust [FILTER]`: cargo test --workspace with a name filter. `test python [FILTER]`: the quick
  loop: the native module built in place (maturin develop --release), the .py files used from the
  tree, pytest -k FILTER.";

/// `--nccl` with at most `--check`: whether to check.
fn nccl_options(args: &[String]) -> Result<bool, String> {
    let mut check = false;
    for arg in args {
        match arg.as_str() {
            "--nccl" => {}
            "--check" => check = true,
            other => return Err(format!("`{other}` does not go with --nccl (only --check does)")),
        }
    }
    Ok(check)
}
