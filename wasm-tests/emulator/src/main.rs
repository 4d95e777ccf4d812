//! `engine-emulator` binary: parses flags, binds, announces the bound
//! address on stdout (harnesses wait for that line) and serves forever.

use std::io::Write;
use std::process::ExitCode;

use engine_emulator::config::{parse_args, CliError, USAGE};
use engine_emulator::server::Server;

fn main() -> ExitCode {
    // Console writes ignore errors: a closed stdout must not panic the replica.
    let config = match parse_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(CliError::Help) => {
            let _ = std::io::stdout().write_all(USAGE.as_bytes());
            return ExitCode::SUCCESS;
        }
        Err(CliError::Bad(msg)) => {
            let _ = writeln!(std::io::stderr(), "engine-emulator: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
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
    server.run();
    ExitCode::SUCCESS
}
