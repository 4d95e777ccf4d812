//! `llm-geo-router`: the operator's command line. Each subcommand is one
//! module that runs the plugin's own pure core (the code the .wasm runs) on
//! numbers given on the command line; this file only parses (clap, derive)
//! and dispatches.
//!
//! Exit status: 0 on success (and for `--help`), 2 when the command line is
//! wrong (the message names the option and the usage follows) or an input
//! file is unreadable or invalid (the message names the file), 1 when the
//! plugin would refuse the input (`explain`: the 400 the router sends) or
//! output cannot be written.
//!
//! To add a subcommand: a module with `SUMMARY`, `ABOUT`, an `Args` struct
//! (`clap::Args`) and `run(Args) -> Result<String, CliError>`, and one
//! variant in `Command`.

mod args;
mod crossover;
mod explain;
mod generate;
mod ladder;
mod simulate;

use clap::{CommandFactory, Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

const BIN: &str = "llm-geo-router";

/// Why a subcommand produced no output.
#[derive(Debug)]
pub enum CliError {
    /// The command line is wrong in a way only the subcommand can see (a
    /// combination of options, a value checked against an input file):
    /// what to fix, shown above the usage.
    Usage(String),
    /// An input file cannot be read or is invalid: the message names the
    /// file and the problem; no usage follows, the command line was right.
    Input(String),
    /// The plugin would refuse the input: `output` (what it would send) goes
    /// to stdout, `message` to stderr, exit status 1.
    Refused { output: String, message: String },
}

/// The file an option names, or why it cannot be read.
pub fn read(option: &str, path: &str) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|e| CliError::Input(format!("--{option} {path}: cannot read: {e}")))
}

#[derive(Parser, Debug)]
#[command(
    name = BIN,
    bin_name = BIN,
    about = "Runs llm-geo-router's own core outside Envoy: routing decisions, the\n\
             degraded-mode ladder, KV migration arithmetic, and a simulator of the\n\
             router against baseline routers.",
    subcommand_required = true,
    arg_required_else_help = true,
    after_help = "Run 'llm-geo-router <command> --help' for a command's options."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    #[command(about = crossover::SUMMARY, long_about = crossover::ABOUT)]
    Crossover(crossover::Args),
    #[command(
        about = explain::SUMMARY,
        long_about = explain::ABOUT,
        after_help = explain::AFTER
    )]
    Explain(explain::Args),
    #[command(
        about = generate::SUMMARY,
        long_about = generate::ABOUT,
        after_help = generate::AFTER
    )]
    Generate(generate::Args),
    #[command(
        about = ladder::SUMMARY,
        long_about = ladder::ABOUT,
        after_help = ladder::AFTER
    )]
    Ladder(ladder::Args),
    #[command(
        about = simulate::SUMMARY,
        long_about = simulate::ABOUT,
        after_help = simulate::AFTER
    )]
    Simulate(simulate::Args),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with status 0; errors to
            // stderr with status 2.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let (name, result) = match cli.command {
        Command::Crossover(a) => ("crossover", crossover::run(a)),
        Command::Explain(a) => ("explain", explain::run(a)),
        Command::Generate(a) => ("generate", generate::run(a)),
        Command::Ladder(a) => ("ladder", ladder::run(a)),
        Command::Simulate(a) => ("simulate", simulate::run(a)),
    };
    match result {
        Ok(output) => emit(&output),
        Err(CliError::Usage(message)) => refuse(&format!("{name}: {message}"), &usage(name)),
        Err(CliError::Input(message)) => {
            let _ = writeln!(std::io::stderr().lock(), "error: {name}: {message}");
            ExitCode::from(2)
        }
        Err(CliError::Refused { output, message }) => {
            let _ = writeln!(std::io::stderr().lock(), "{name}: {message}");
            // Written or not, the status is 1.
            let _ = emit(&output);
            ExitCode::from(1)
        }
    }
}

/// A subcommand's usage line, as clap prints it under its own errors.
fn usage(name: &str) -> String {
    let mut cli = Cli::command();
    cli.build();
    let usage = cli
        .find_subcommand_mut(name)
        .map(|c| c.render_usage().to_string())
        .unwrap_or_default();
    format!("{usage}\n\nFor more information, try '{BIN} {name} --help'.")
}

fn emit(text: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) is not worth a panic, but it is a failure.
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(1),
    }
}

fn refuse(message: &str, usage: &str) -> ExitCode {
    // Nothing more useful to do if stderr is gone too.
    let _ = writeln!(std::io::stderr().lock(), "error: {message}\n\n{usage}");
    ExitCode::from(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn usage_names_the_binary_and_the_command() {
        let u = usage("simulate");
        assert!(u.starts_with("Usage: llm-geo-router simulate "), "{u}");
        assert!(u.contains("--policy <NAME>"), "{u}");
    }
}
