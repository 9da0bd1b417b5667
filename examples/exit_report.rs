//! How every example ends: a failure prints its `Display` text and the chain of causes, and the
//! process exits with status 1 (`fn main() -> Result` would print the `Debug` form instead).

use std::process::ExitCode;

/// Prints `error: ...` and each `caused by: ...` for an error; the exit status for the outcome.
pub fn exit_code(outcome: Result<(), Box<dyn std::error::Error>>) -> ExitCode {
    let Err(error) = outcome else { return ExitCode::SUCCESS };
    eprintln!("error: {error}");
    let mut cause = error.source();
    while let Some(source) = cause {
        eprintln!("  caused by: {source}");
        cause = source.source();
    }
    ExitCode::FAILURE
}
