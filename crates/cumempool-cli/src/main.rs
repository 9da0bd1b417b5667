//! The `cumempool` command: what every CUDA pool route holds, what this driver supports, and
//! what allocations cost.

mod bench;
mod counting_allocator;
mod doctor;
mod error;
mod routes;
mod schema;
mod table;

use clap::{Parser, Subcommand};
use serde::Serialize;
use std::process::ExitCode;

#[global_allocator]
static HEAP: counting_allocator::Counting = counting_allocator::Counting;

/// Fewer pairs per measurement than this time the clock more than the allocator.
const MIN_PAIRS: u64 = 100;

#[derive(Parser)]
#[command(name = "cumempool", version, about = "CUDA stream-ordered memory pools: routes, driver support, benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Every route's default and current pool, with attributes (the default command).
    ///
    /// Routing is per process: this command sees its own routes, every one on its default
    /// pool. A program that routes pools reads its own table with `cumempool::route_table()`
    /// (the same shape as this command's JSON `routes`).
    Routes {
        /// Machine-readable output (docs/cli.md), also when there is no driver.
        #[arg(long)]
        json: bool,
    },
    /// Crate, driver and device support, and which features work here and why not.
    Doctor {
        /// Machine-readable output (docs/cli.md).
        #[arg(long)]
        json: bool,
    },
    /// Allocation+free cost per route and size (raw sys, safe layer, cache), and thread scaling.
    Bench {
        /// Machine-readable output (docs/cli.md) instead of the tables.
        #[arg(long)]
        json: bool,
        /// Pairs per measurement (at least 100).
        #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(MIN_PAIRS..))]
        pairs: u64,
        /// Interleaved rounds per measurement (the median and the minimum are reported).
        #[arg(long, default_value_t = 61, value_parser = clap::value_parser!(u64).range(1..))]
        rounds: u64,
        /// Thread counts to scale through.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16", value_parser = clap::value_parser!(u64).range(1..))]
        threads: Vec<u64>,
        /// A short run: 200 pairs, 3 rounds (so it cannot be combined with --pairs or --rounds).
        #[arg(long, conflicts_with_all = ["pairs", "rounds"])]
        quick: bool,
        /// Also write the JSON document to this file (the tables still go to stdout).
        #[arg(long, value_name = "FILE")]
        json_out: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Routes { json: false }) {
        Command::Routes { json } => finish("routes", json, None, routes::collect(), routes::render),
        Command::Doctor { json } => {
            let report = doctor::collect();
            let code = if report.error.is_some() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
            if json {
                let written = schema::document("doctor", report.error.as_deref(), &report);
                return print_document(written).and(Some(code)).unwrap_or(ExitCode::FAILURE);
            }
            print!("{}", doctor::render(&report));
            code
        }
        Command::Bench { json, pairs, rounds, threads, quick, json_out } => {
            let (pairs, rounds) = if quick { (200, 3) } else { (pairs, rounds) };
            let options = bench::Options {
                pairs: usize::try_from(pairs).unwrap_or(usize::MAX),
                rounds: usize::try_from(rounds).unwrap_or(usize::MAX),
                threads: threads.into_iter().map(|n| usize::try_from(n).unwrap_or(usize::MAX)).collect(),
            };
            finish("bench", json, json_out.as_deref(), bench::run(&options), bench::render)
        }
    }
}

/// Prints a command's outcome: its tables, or its JSON document (also written to `json_out`),
/// which on failure carries the error, so a script reading stdout always gets a document.
fn finish<T: Serialize>(
    command: &'static str,
    json: bool,
    json_out: Option<&std::path::Path>,
    outcome: error::Result<T>,
    render: fn(&T) -> String,
) -> ExitCode {
    let code = if outcome.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    if json || json_out.is_some() {
        let document = match &outcome {
            Ok(report) => schema::document(command, None, report),
            Err(error) => schema::document(command, Some(&error.to_string()), &schema::Failure::new()),
        };
        if let Some(path) = json_out {
            let written = document
                .as_ref()
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|text| std::fs::write(path, text))
                .map_err(|source| error::Error::Write { path: path.to_owned(), source });
            if let Err(error) = written {
                eprintln!("error: {error}");
                return ExitCode::FAILURE;
            }
        }
        if json {
            return print_document(document).and(Some(code)).unwrap_or(ExitCode::FAILURE);
        }
    }
    match outcome {
        Ok(report) => print!("{}", render(&report)),
        Err(error) => explain(&error),
    }
    code
}

/// Prints a JSON document; `None` if it could not be made.
fn print_document(document: serde_json::Result<String>) -> Option<()> {
    match document {
        Ok(text) => {
            println!("{text}");
            Some(())
        }
        Err(error) => {
            eprintln!("error: writing JSON: {error}");
            None
        }
    }
}

fn explain(error: &error::Error) {
    eprintln!("error: {error}");
    if error.is_missing_driver() {
        eprintln!("(cumempool needs the NVIDIA driver; `cumempool doctor` says what was tried)");
    }
}
