//! Command-line configuration of one emulated replica: the flag set, its
//! defaults and validation. Parsing is separate from `main` so it is testable
//! and so other harnesses can build a `Config` directly.

use crate::model::{EngineConfig, Timing, DEFAULT_BLOCK_TOKENS};

pub const USAGE: &str = "\
usage: engine-emulator --listen HOST:PORT [options]
  --listen HOST:PORT          address to bind (port 0: pick one, printed at startup)
  --name NAME                 replica name (default engine)
  --mode vllm|sglang          metrics dialect (default vllm)
  --model NAME                served model name (default emulated-model)
  --max-concurrency N         requests running at once (default 8)
  --cache-tokens N            prefix cache capacity in tokens (default 200000)
  --prefill-ms-per-token F    prefill cost per uncached prompt token (default 0.05)
  --decode-ms-per-token F     decode cost per output token (default 2.0)
  --network-delay-ms F        delay before every response's first byte (default 0)
  --release DIGEST            release digest reported by /health and metrics (default sha256:release-a)
  --echo-header NAME          echo request header NAME as x-echo-NAME (repeatable)
";

/// Which engine's Prometheus names `/metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Vllm,
    Sglang,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Vllm => "vllm",
            Mode::Sglang => "sglang",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub listen: String,
    pub name: String,
    pub mode: Mode,
    pub model: String,
    pub max_concurrency: usize,
    pub cache_tokens: usize,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    pub network_delay_ms: f64,
    pub release: String,
    /// Lowercased header names.
    pub echo_headers: Vec<String>,
}

impl Config {
    /// Defaults for everything but the listen address.
    pub fn new(listen: impl Into<String>) -> Self {
        Config {
            listen: listen.into(),
            name: "engine".to_string(),
            mode: Mode::Vllm,
            model: "emulated-model".to_string(),
            max_concurrency: 8,
            cache_tokens: 200_000,
            prefill_ms_per_token: 0.05,
            decode_ms_per_token: 2.0,
            network_delay_ms: 0.0,
            release: "sha256:release-a".to_string(),
            echo_headers: Vec::new(),
        }
    }

    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            max_concurrency: self.max_concurrency,
            cache_tokens: self.cache_tokens,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            timing: Timing {
                prefill_ms_per_token: self.prefill_ms_per_token,
                decode_ms_per_token: self.decode_ms_per_token,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    /// `--help`: print usage to stdout, exit 0.
    Help,
    /// Anything else: print the message and usage to stderr, exit 2.
    Bad(String),
}

/// Parses the arguments after the program name. Accepts `--flag value` and
/// `--flag=value`.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Config, CliError> {
    let mut args = args.into_iter();
    let mut listen = None;
    let mut cfg = Config::new("");
    while let Some(arg) = args.next() {
        if arg == "--help" || arg == "-h" {
            return Err(CliError::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| CliError::Bad(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--listen" => listen = Some(non_empty(&flag, value()?)?),
            "--name" => cfg.name = non_empty(&flag, value()?)?,
            "--mode" => {
                cfg.mode = match value()?.as_str() {
                    "vllm" => Mode::Vllm,
                    "sglang" => Mode::Sglang,
                    other => return Err(bad(&flag, other, "vllm or sglang")),
                }
            }
            "--model" => cfg.model = non_empty(&flag, value()?)?,
            "--max-concurrency" => {
                let v = value()?;
                cfg.max_concurrency = match v.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(bad(&flag, &v, "an integer >= 1")),
                }
            }
            "--cache-tokens" => {
                let v = value()?;
                cfg.cache_tokens = v
                    .parse::<usize>()
                    .map_err(|_| bad(&flag, &v, "a non-negative integer"))?;
            }
            "--prefill-ms-per-token" => cfg.prefill_ms_per_token = millis(&flag, value()?)?,
            "--decode-ms-per-token" => cfg.decode_ms_per_token = millis(&flag, value()?)?,
            "--network-delay-ms" => cfg.network_delay_ms = millis(&flag, value()?)?,
            "--release" => cfg.release = non_empty(&flag, value()?)?,
            "--echo-header" => {
                let v = value()?;
                if !crate::http::is_token(&v) {
                    return Err(bad(&flag, &v, "a header name"));
                }
                cfg.echo_headers.push(v.to_ascii_lowercase());
            }
            _ => return Err(CliError::Bad(format!("unknown argument {arg:?}"))),
        }
    }
    cfg.listen = listen.ok_or_else(|| CliError::Bad("--listen is required".to_string()))?;
    Ok(cfg)
}

fn bad(flag: &str, value: &str, expected: &str) -> CliError {
    CliError::Bad(format!("{flag}: expected {expected}, got {value:?}"))
}

fn non_empty(flag: &str, v: String) -> Result<String, CliError> {
    // Names end up in header values and label values: no control characters.
    if v.is_empty() || v.chars().any(char::is_control) {
        Err(bad(flag, &v, "a non-empty printable value"))
    } else {
        Ok(v)
    }
}

/// Durations: finite and non-negative, capped at a day to stay far from
/// `Duration` overflow.
pub fn millis(flag: &str, v: String) -> Result<f64, CliError> {
    match v.parse::<f64>() {
        Ok(f) if f.is_finite() && (0.0..=MAX_MS).contains(&f) => Ok(f),
        _ => Err(bad(flag, &v, "a number of milliseconds >= 0")),
    }
}

/// Upper bound on any configured duration (one day).
pub const MAX_MS: f64 = 86_400_000.0;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, CliError> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn defaults() {
        let c = parse(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(c, Config::new("127.0.0.1:0"));
        assert_eq!(c.engine().block_tokens, 16);
    }

    #[test]
    fn all_flags() {
        let c = parse(&[
            "--listen=0.0.0.0:9000",
            "--name",
            "eu-1",
            "--mode",
            "sglang",
            "--model",
            "m",
            "--max-concurrency",
            "3",
            "--cache-tokens",
            "1000",
            "--prefill-ms-per-token",
            "0.1",
            "--decode-ms-per-token",
            "1",
            "--network-delay-ms",
            "40",
            "--release",
            "sha256:b",
            "--echo-header",
            "X-Request-Id",
            "--echo-header",
            "x-b",
        ])
        .unwrap();
        assert_eq!(c.listen, "0.0.0.0:9000");
        assert_eq!(
            (c.name.as_str(), c.mode, c.model.as_str()),
            ("eu-1", Mode::Sglang, "m")
        );
        assert_eq!((c.max_concurrency, c.cache_tokens), (3, 1000));
        assert_eq!(
            (
                c.prefill_ms_per_token,
                c.decode_ms_per_token,
                c.network_delay_ms
            ),
            (0.1, 1.0, 40.0)
        );
        assert_eq!(c.release, "sha256:b");
        assert_eq!(c.echo_headers, vec!["x-request-id", "x-b"]);
    }

    #[test]
    fn bad_flags() {
        for args in [
            &[][..],
            &["--name", "x"],
            &["--listen"],
            &["--listen", "a:1", "--bogus"],
            &["--listen", "a:1", "--mode", "tgi"],
            &["--listen", "a:1", "--max-concurrency", "0"],
            &["--listen", "a:1", "--cache-tokens", "-1"],
            &["--listen", "a:1", "--decode-ms-per-token", "NaN"],
            &["--listen", "a:1", "--network-delay-ms", "-5"],
            &["--listen", "a:1", "--echo-header", "bad header"],
            &["--listen", "a:1", "--name", ""],
        ] {
            assert!(matches!(parse(args), Err(CliError::Bad(_))), "{args:?}");
        }
        assert_eq!(parse(&["--help"]), Err(CliError::Help));
    }
}
