//! `engine-emulator` binary: parses flags, binds, announces the bound
//! address on stdout (harnesses wait for that line) and serves forever.

use std::io::Write;
use std::process::ExitCode;

use engine_emulator::config::{Config, RESPONSES_STORE_ENV};
use engine_emulator::server::Server;

fn main() -> ExitCode {
    // Console writes ignore errors: a closed stdout must not panic the replica.
    let mut config = match Config::try_parse_from(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => {
            // `--help` goes to stdout with 0; a bad command line to stderr
            // with clap's message, usage line and exit code 2.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    // vLLM's own switch for its Responses store (an integer, non-zero on).
    if std::env::var(RESPONSES_STORE_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .is_some_and(|n| n != 0)
    {
        config.responses_store = true;
    }
    let name = config.name.clone();
    let server = match Server::bind(config) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "engine-emulator: cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = match server.local_addr() {
        Ok(a) => a,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "engine-emulator: cannot read bound address: {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "engine-emulator {name} listening on {addr}");
        let _ = out.flush();
    }
    if let Err(e) = server.run() {
        let _ = writeln!(std::io::stderr(), "engine-emulator: cannot start: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
