//! The `cumempool` command: what every CUDA pool route holds, what this driver supports, and
//! what allocations cost.

mod bench;
mod counting_allocator;
mod doctor;
mod routes;
mod table;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[global_allocator]
static HEAP: counting_allocator::Counting = counting_allocator::Counting;

#[derive(Parser)]
#[command(name = "cumempool", version, about = "CUDA stream-ordered memory pools: routes, driver support, benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Every route's default and current pool, with attributes (the default command).
    Routes {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Crate, driver and device support, and which features work here and why not.
    Doctor {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Allocation+free cost per route and size (raw sys, safe layer, cache), and thread scaling.
    Bench {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Pairs per measurement.
        #[arg(long, default_value_t = 2_000)]
        pairs: usize,
        /// Interleaved rounds per measurement (the median and the minimum are reported).
        #[arg(long, default_value_t = 61)]
        rounds: usize,
        /// Thread counts to scale through.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
        threads: Vec<usize>,
        /// A short run (a tenth of the pairs, three rounds).
        #[arg(long)]
        quick: bool,
        /// Also write the JSON report to this file (the table still goes to stdout).
        #[arg(long, value_name = "FILE")]
        json_out: Option<std::path::PathBuf>,
    },
}

fn print_json(value: &impl serde::Serialize) -> ExitCode {
    match serde_json::to_string_pretty(value) {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: writing JSON: {error}");
            ExitCode::FAILURE
        }
    }
}

fn fail(error: &cumempool::Error) -> ExitCode {
    eprintln!("error: {error}");
    if matches!(error, cumempool::Error::Load(_)) {
        eprintln!("(cumempool needs the NVIDIA driver; `cumempool doctor` says what was tried)");
    }
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Routes { json: false }) {
        Command::Routes { json } => match routes::collect() {
            Ok(report) if json => print_json(&report),
            Ok(report) => {
                print!("{}", routes::render(&report));
                ExitCode::SUCCESS
            }
            Err(error) => fail(&error),
        },
        Command::Doctor { json } => {
            let report = doctor::collect();
            let code = if report.error.is_some() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
            if json {
                print_json(&report);
            } else {
                print!("{}", doctor::render(&report));
            }
            code
        }
        Command::Bench { json, pairs, rounds, threads, quick, json_out } => {
            let (pairs, rounds) = if quick { (pairs / 10, 3) } else { (pairs, rounds) };
            let options = bench::Options { pairs: pairs.max(100), rounds: rounds.max(1), threads, progress: !json };
            match bench::run(&options) {
                Ok(report) => {
                    if let Some(path) = json_out {
                        let written = serde_json::to_string_pretty(&report)
                            .map_err(std::io::Error::other)
                            .and_then(|text| std::fs::write(&path, text));
                        if let Err(error) = written {
                            eprintln!("error: writing {}: {error}", path.display());
                            return ExitCode::FAILURE;
                        }
                    }
                    if json {
                        return print_json(&report);
                    }
                    print!("{}", bench::render(&report));
                    ExitCode::SUCCESS
                }
                Err(error) => fail(&error),
            }
        }
    }
}
