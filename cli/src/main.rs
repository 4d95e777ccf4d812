//! `llm-geo-router`: the operator's command line. Each subcommand is one
//! module that runs the plugin's own pure core (the code the .wasm runs) on
//! numbers given on the command line; this file only dispatches.
//!
//! Exit status: 0 on success, 2 when the command line is wrong (the message
//! names the option and the usage follows) or an input file is unreadable or
//! invalid (the message names the file), 1 when the plugin would refuse the
//! input (`explain`: the 400 the router sends) or output cannot be written.
//!
//! To add a subcommand: a module with `SUMMARY`, `USAGE` and
//! `run(&[String]) -> Result<String, CliError>`, and one row in `COMMANDS`.

mod args;
mod crossover;
mod explain;
mod generate;
mod ladder;
mod simulate;

use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

const BIN: &str = "llm-geo-router";

/// Why a subcommand produced no output.
#[derive(Debug)]
pub enum CliError {
    /// The command line is wrong: what to fix, shown above the usage.
    Usage(String),
    /// An input file cannot be read or is invalid: the message names the
    /// file and the problem; no usage follows, the command line was right.
    Input(String),
    /// The plugin would refuse the input: `output` (what it would send) goes
    /// to stdout, `message` to stderr, exit status 1.
    Refused { output: String, message: String },
}

struct Command {
    name: &'static str,
    summary: &'static str,
    usage: &'static str,
    run: fn(&[String]) -> Result<String, CliError>,
}

const COMMANDS: &[Command] = &[
    Command {
        name: "crossover",
        summary: crossover::SUMMARY,
        usage: crossover::USAGE,
        run: crossover::run,
    },
    Command {
        name: "explain",
        summary: explain::SUMMARY,
        usage: explain::USAGE,
        run: explain::run,
    },
    Command {
        name: "generate",
        summary: generate::SUMMARY,
        usage: generate::USAGE,
        run: generate::run,
    },
    Command {
        name: "ladder",
        summary: ladder::SUMMARY,
        usage: ladder::USAGE,
        run: ladder::run,
    },
    Command {
        name: "simulate",
        summary: simulate::SUMMARY,
        usage: simulate::USAGE,
        run: simulate::run,
    },
];

fn top_usage() -> String {
    let mut text = format!("usage: {BIN} <command> [options]\n\ncommands:\n");
    for command in COMMANDS {
        text.push_str(&format!("  {:<12}{}\n", command.name, command.summary));
    }
    text.push_str(&format!(
        "\nRun '{BIN} <command> --help' for a command's options.\n"
    ));
    text
}

fn main() -> ExitCode {
    let argv: Result<Vec<String>, OsString> = std::env::args_os()
        .skip(1)
        .map(OsString::into_string)
        .collect();
    let argv = match argv {
        Ok(argv) => argv,
        Err(bad) => return refuse(&format!("argument {bad:?} is not UTF-8"), &top_usage()),
    };
    let Some((name, rest)) = argv.split_first() else {
        return refuse("missing command", &top_usage());
    };
    if matches!(name.as_str(), "help" | "--help" | "-h") {
        return emit(&top_usage());
    }
    let Some(command) = COMMANDS.iter().find(|c| c.name == name) else {
        return refuse(&format!("unknown command '{name}'"), &top_usage());
    };
    if rest.iter().any(|a| a == "--help" || a == "-h") {
        return emit(command.usage);
    }
    match (command.run)(rest) {
        Ok(output) => emit(&output),
        Err(CliError::Usage(message)) => {
            refuse(&format!("{}: {message}", command.name), command.usage)
        }
        Err(CliError::Input(message)) => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "error: {}: {message}",
                command.name
            );
            ExitCode::from(2)
        }
        Err(CliError::Refused { output, message }) => {
            let _ = writeln!(std::io::stderr().lock(), "{}: {message}", command.name);
            // Written or not, the status is 1.
            let _ = emit(&output);
            ExitCode::from(1)
        }
    }
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
