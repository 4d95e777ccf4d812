//! Command-line configuration of one emulated replica: the flag set (clap,
//! derive), its defaults and validation, and the plain `Config` the server
//! runs on. Parsing is separate from `main` so it is testable, and `Config`
//! is a plain value so other harnesses can build one directly
//! (`Config::new`).
//!
//! Every flag but the repeatable ones (`--echo-header`, `--client-delay-ms`)
//! may be given once: a repeated or unknown flag is an error (exit code 2).

use std::collections::BTreeMap;
use std::ffi::OsString;

use clap::error::ErrorKind;
use clap::{ArgAction, CommandFactory, Parser, ValueEnum};

use crate::model::{
    EngineConfig, Timing, DEFAULT_BLOCK_TOKENS, DEFAULT_PREFILL_OVERHEAD_MS, RADIX_BLOCK_TOKENS,
};
use crate::openai::CacheReport;

/// Upper bound on any configured duration (one day), far from `Duration`
/// overflow.
pub const MAX_MS: f64 = 86_400_000.0;

const DEFAULT_NAME: &str = "engine";
const DEFAULT_MODEL: &str = "emulated-model";
const DEFAULT_MAX_CONCURRENCY: usize = 8;
const DEFAULT_CACHE_TOKENS: usize = 200_000;
const DEFAULT_PREFILL_MS_PER_TOKEN: f64 = 0.05;
const DEFAULT_DECODE_MS_PER_TOKEN: f64 = 2.0;
const DEFAULT_NETWORK_DELAY_MS: f64 = 0.0;
/// Largest `--block-size`: vLLM's own bound on a KV block.
pub const MAX_BLOCK_SIZE: usize = 1024;
/// The environment variable that turns vLLM's Responses store on; the
/// emulator reads it too (`--responses-store` is the same).
pub const RESPONSES_STORE_ENV: &str = "VLLM_ENABLE_RESPONSES_API_STORE";
/// vLLM's `--max-model-len` when the emulator is not told.
pub const DEFAULT_MAX_MODEL_LEN: usize = 32_768;
pub const DEFAULT_CLIENT_REGION_HEADER: &str = "x-client-region";
/// Length of the emulated model's embeddings (its "hidden size").
pub const DEFAULT_EMBEDDING_DIM: usize = 32;
/// Largest `--embedding-dim`: bounds the work of one embedding.
pub const MAX_EMBEDDING_DIM: usize = 8192;

/// Which engine's Prometheus names `/metrics` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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
    /// Per-request overhead added to every prefill, ms.
    pub prefill_overhead_ms: f64,
    /// The release digest `/health` (header `x-release-digest`) and
    /// `*:release_info` report, for release-parity tests. Neither engine
    /// reports one: `None` (the default) reports nothing, as they do.
    pub release: Option<String>,
    /// vLLM `--block-size`: tokens per KV block, the prefix cache's unit.
    /// SGLang mode ignores it (token granularity).
    pub block_size: usize,
    /// vLLM `VLLM_ENABLE_RESPONSES_API_STORE=1`: `/v1/responses` keeps its
    /// answers for `GET` and `previous_response_id`. SGLang always does.
    pub responses_store: bool,
    /// vLLM serves `/v1/embeddings` only for a pooling model: without this
    /// the route is Starlette's 404, as on a generative model. SGLang mode
    /// always serves it.
    pub embedding_model: bool,
    /// Lowercased header names.
    pub echo_headers: Vec<String>,
    /// Lowercased name of the header that names the client's region.
    pub client_region_header: String,
    /// Delay before the first byte per client region, used instead of
    /// `network_delay_ms` for requests from that region.
    pub client_delays_ms: BTreeMap<String, f64>,
    /// Context limit in tokens (prompt + output), refused like the engine.
    pub max_model_len: usize,
    /// vLLM `--enable-prompt-tokens-details`.
    pub prompt_tokens_details: bool,
    /// vLLM `--enable-force-include-usage`: the final usage chunk in every
    /// stream, asked for or not.
    pub force_include_usage: bool,
    /// SGLang `--enable-cache-report`.
    pub cache_report: bool,
    /// Length of `/v1/embeddings` vectors (before `dimensions` shortens them).
    pub embedding_dim: usize,
    /// vLLM `--lora-modules`: adapter names listed in `/v1/models` beside
    /// the served model.
    pub lora_modules: Vec<String>,
    /// Refuse a request naming a model that is neither the served one nor
    /// an adapter, with vLLM's 404.
    pub check_model: bool,
}

impl Config {
    /// Defaults for everything but the listen address.
    pub fn new(listen: impl Into<String>) -> Self {
        Config {
            listen: listen.into(),
            name: DEFAULT_NAME.to_string(),
            mode: Mode::Vllm,
            model: DEFAULT_MODEL.to_string(),
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            cache_tokens: DEFAULT_CACHE_TOKENS,
            prefill_ms_per_token: DEFAULT_PREFILL_MS_PER_TOKEN,
            decode_ms_per_token: DEFAULT_DECODE_MS_PER_TOKEN,
            network_delay_ms: DEFAULT_NETWORK_DELAY_MS,
            prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
            release: None,
            block_size: DEFAULT_BLOCK_TOKENS,
            responses_store: false,
            embedding_model: false,
            echo_headers: Vec::new(),
            client_region_header: DEFAULT_CLIENT_REGION_HEADER.to_string(),
            client_delays_ms: BTreeMap::new(),
            max_model_len: DEFAULT_MAX_MODEL_LEN,
            prompt_tokens_details: false,
            force_include_usage: false,
            cache_report: false,
            embedding_dim: DEFAULT_EMBEDDING_DIM,
            lora_modules: Vec::new(),
            check_model: false,
        }
    }

    /// Parses a command line, program name first (as `std::env::args_os`
    /// gives it). The error is clap's: `print` it and exit with
    /// `exit_code` (0 for `--help`, 2 for a bad command line).
    pub fn try_parse_from<I, T>(args: I) -> Result<Config, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let cli = Cli::try_parse_from(args)?;
        let mut client_delays_ms = BTreeMap::new();
        for (region, ms) in cli.client_delay_ms {
            if client_delays_ms.insert(region.clone(), ms).is_some() {
                return Err(Cli::command().error(
                    ErrorKind::ArgumentConflict,
                    format!("--client-delay-ms: region {region:?} is given more than once"),
                ));
            }
        }
        Ok(Config {
            listen: cli.listen,
            name: cli.name,
            mode: cli.mode,
            model: cli.model,
            max_concurrency: cli.max_concurrency,
            cache_tokens: cli.cache_tokens,
            prefill_ms_per_token: cli.prefill_ms_per_token,
            decode_ms_per_token: cli.decode_ms_per_token,
            network_delay_ms: cli.network_delay_ms,
            prefill_overhead_ms: cli.prefill_overhead_ms,
            release: cli.release,
            block_size: cli.block_size,
            responses_store: cli.responses_store,
            embedding_model: cli.embedding_model,
            echo_headers: cli.echo_header,
            client_region_header: cli.client_region_header,
            client_delays_ms,
            max_model_len: cli.max_model_len,
            prompt_tokens_details: cli.enable_prompt_tokens_details,
            force_include_usage: cli.force_include_usage,
            cache_report: cli.enable_cache_report,
            embedding_dim: cli.embedding_dim,
            lora_modules: cli.lora_modules,
            check_model: cli.check_model,
        })
    }

    /// Whether `/v1/responses` answers are kept: vLLM only with its store
    /// on (`--responses-store`, or `VLLM_ENABLE_RESPONSES_API_STORE=1` in
    /// the environment, read by `main`); SGLang always.
    pub fn stores_responses(&self) -> bool {
        match self.mode {
            Mode::Vllm => self.responses_store,
            Mode::Sglang => true,
        }
    }

    /// Whether `/v1/embeddings` is served (see `embedding_model`).
    pub fn serves_embeddings(&self) -> bool {
        match self.mode {
            Mode::Vllm => self.embedding_model,
            Mode::Sglang => true,
        }
    }

    /// How `usage` reports cached prompt tokens: the flag of this engine's
    /// own dialect (vLLM's flag does nothing to SGLang and vice versa).
    pub fn cache_report(&self) -> CacheReport {
        match self.mode {
            Mode::Vllm if self.prompt_tokens_details => CacheReport::VllmPromptTokensDetails,
            Mode::Vllm => CacheReport::VllmOff,
            Mode::Sglang if self.cache_report => CacheReport::SglangCacheReport,
            Mode::Sglang => CacheReport::Off,
        }
    }

    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            max_concurrency: self.max_concurrency,
            cache_tokens: self.cache_tokens,
            // vLLM: blocks of --block-size tokens (16 on GPUs, 128 on
            // CPU); SGLang: a radix tree at token granularity.
            block_tokens: match self.mode {
                Mode::Vllm => self.block_size,
                Mode::Sglang => RADIX_BLOCK_TOKENS,
            },
            timing: Timing {
                prefill_ms_per_token: self.prefill_ms_per_token,
                decode_ms_per_token: self.decode_ms_per_token,
                prefill_overhead_ms: self.prefill_overhead_ms,
            },
        }
    }

    /// Delay before a response's first byte: the client region's delay when
    /// `client_region` (the value of the client-region header, if the
    /// request has one) names a configured region, else `network_delay_ms`
    /// (the current one, which `/admin/state` can change).
    pub fn first_byte_delay_ms(&self, client_region: Option<&str>, network_delay_ms: f64) -> f64 {
        client_region
            .and_then(|r| self.client_delays_ms.get(r.trim_matches([' ', '\t'])))
            .copied()
            .unwrap_or(network_delay_ms)
    }
}

/// The flags, as clap sees them; converted into `Config` after the checks
/// that need more than one flag.
#[derive(Debug, Parser)]
#[command(
    name = "engine-emulator",
    about = "Emulates one vLLM/SGLang replica (queueing, prefix cache, prefill/decode timing, metrics) for testing llm-geo-router.",
    disable_version_flag = true
)]
struct Cli {
    /// Address to bind (port 0: pick one, printed at startup)
    #[arg(long, value_name = "HOST:PORT", value_parser = printable)]
    listen: String,
    /// Replica name
    #[arg(long, value_name = "NAME", default_value = DEFAULT_NAME, value_parser = printable)]
    name: String,
    /// Metrics dialect
    #[arg(long, value_enum, default_value_t = Mode::Vllm)]
    mode: Mode,
    /// Served model name
    #[arg(long, value_name = "NAME", default_value = DEFAULT_MODEL, value_parser = printable)]
    model: String,
    /// Requests running at once
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_CONCURRENCY, value_parser = at_least_one)]
    max_concurrency: usize,
    /// Prefix cache capacity in tokens
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CACHE_TOKENS)]
    cache_tokens: usize,
    /// Prefill cost per uncached prompt token, ms
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_PREFILL_MS_PER_TOKEN, value_parser = millis)]
    prefill_ms_per_token: f64,
    /// Decode cost per output token, ms
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_DECODE_MS_PER_TOKEN, value_parser = millis)]
    decode_ms_per_token: f64,
    /// Delay before every response's first byte, ms (admin endpoints excepted)
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_NETWORK_DELAY_MS, value_parser = millis)]
    network_delay_ms: f64,
    /// Per-request cost before the first token, whatever the prompt
    /// (scheduling, first forward pass, HTTP), ms
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_PREFILL_OVERHEAD_MS, value_parser = millis)]
    prefill_overhead_ms: f64,
    /// Release digest reported by /health (x-release-digest) and a
    /// *:release_info metric, for release-parity tests (no engine reports
    /// one: without this flag, neither does the emulator)
    #[arg(long, value_name = "DIGEST", value_parser = printable)]
    release: Option<String>,
    /// vLLM's --block-size: tokens per KV block, the prefix cache's unit
    /// (vLLM: 16 on GPUs, 128 on CPU); reported in vllm:cache_config_info
    #[arg(long, value_name = "N", default_value_t = DEFAULT_BLOCK_TOKENS, value_parser = block_size)]
    block_size: usize,
    /// vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1 (also read from the
    /// environment): /v1/responses keeps answers for GET and
    /// previous_response_id; off, as in vLLM, they are not found (404)
    #[arg(long)]
    responses_store: bool,
    /// vLLM: the model is a pooling (embedding) model, so /v1/embeddings is
    /// served; without it the route is 404, as for a generative model
    #[arg(long)]
    embedding_model: bool,
    /// Echo request header NAME as x-echo-NAME (repeatable)
    #[arg(long, value_name = "NAME", value_parser = header_name, action = ArgAction::Append)]
    echo_header: Vec<String>,
    /// Request header naming the client's region (see --client-delay-ms)
    #[arg(long, value_name = "NAME", default_value = DEFAULT_CLIENT_REGION_HEADER, value_parser = header_name)]
    client_region_header: String,
    /// Delay before the first byte for requests whose client-region header is
    /// REGION, instead of --network-delay-ms (repeatable, one per region)
    #[arg(long, value_name = "REGION=MS", value_parser = region_delay, action = ArgAction::Append)]
    client_delay_ms: Vec<(String, f64)>,
    /// Context limit in tokens (prompt + output); longer requests are
    /// refused with HTTP 400 in the engine's words; /v1/models reports it
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_MODEL_LEN, value_parser = at_least_one)]
    max_model_len: usize,
    /// vLLM: usage.prompt_tokens_details {cached_tokens,
    /// created_cache_tokens, multimodal_tokens} on every answer
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// vLLM's --enable-force-include-usage: the usage chunk ends every
    /// stream, whether stream_options.include_usage asked for it or not
    #[arg(long)]
    force_include_usage: bool,
    /// SGLang: report usage.prompt_tokens_details.cached_tokens (0 included)
    #[arg(long)]
    enable_cache_report: bool,
    /// Length of /v1/embeddings vectors (the model's hidden size; a request's
    /// `dimensions` can only shorten them)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_EMBEDDING_DIM, value_parser = embedding_dim)]
    embedding_dim: usize,
    /// A LoRA adapter served beside the model, as vLLM's --lora-modules
    /// NAME=PATH (the path is ignored); listed in /v1/models (repeatable)
    #[arg(long, value_name = "NAME[=PATH]", value_parser = lora_name, action = ArgAction::Append)]
    lora_modules: Vec<String>,
    /// Refuse a request whose `model` is neither --model nor a
    /// --lora-modules name with vLLM's 404 NotFoundError (real vLLM always
    /// does; off by default, since traces and tests name any model)
    #[arg(long)]
    check_model: bool,
}

fn lora_name(v: &str) -> Result<String, String> {
    let name = v.split_once('=').map_or(v, |(n, _)| n);
    if name.is_empty() {
        return Err("an adapter needs a name".to_string());
    }
    printable(name)
}

/// Names end up in header values and label values: no control characters.
fn printable(v: &str) -> Result<String, String> {
    if v.is_empty() || v.chars().any(char::is_control) {
        Err("expected a non-empty printable value".to_string())
    } else {
        Ok(v.to_string())
    }
}

fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected an integer >= 1".to_string()),
    }
}

fn block_size(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_BLOCK_SIZE).contains(&n) => Ok(n),
        _ => Err(format!("expected an integer from 1 to {MAX_BLOCK_SIZE}")),
    }
}

fn embedding_dim(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if (1..=MAX_EMBEDDING_DIM).contains(&n) => Ok(n),
        _ => Err(format!("expected an integer from 1 to {MAX_EMBEDDING_DIM}")),
    }
}

/// Durations: finite, non-negative, at most `MAX_MS`.
pub fn millis(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(f) if f.is_finite() && (0.0..=MAX_MS).contains(&f) => Ok(f),
        _ => Err(format!(
            "expected a number of milliseconds >= 0 and <= {MAX_MS}"
        )),
    }
}

/// A header name (RFC 9110 token), lowercased.
fn header_name(v: &str) -> Result<String, String> {
    if is_token(v) {
        Ok(v.to_ascii_lowercase())
    } else {
        Err("expected a header name".to_string())
    }
}

/// `REGION=MS`: REGION is compared with a header value, so it is printable
/// and has no surrounding blanks (header values never do).
fn region_delay(v: &str) -> Result<(String, f64), String> {
    let (region, ms) = v
        .split_once('=')
        .ok_or_else(|| "expected REGION=MS".to_string())?;
    let region = printable(region).map_err(|e| format!("REGION: {e}"))?;
    if region.trim_matches([' ', '\t']) != region {
        return Err("REGION: expected no leading or trailing blanks".to_string());
    }
    Ok((region, millis(ms)?))
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// RFC 9110 token (method, header name).
pub fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from(std::iter::once("engine-emulator").chain(args.iter().copied()))
    }

    #[test]
    fn defaults() {
        let c = parse(&["--listen", "127.0.0.1:0"]).unwrap();
        assert_eq!(c, Config::new("127.0.0.1:0"));
        assert_eq!(c.engine().block_tokens, 16);
        assert_eq!(c.engine().timing.prefill_overhead_ms, 10.0);
        assert_eq!(c.release, None);
        assert!(!c.stores_responses() && !c.serves_embeddings());
        assert_eq!(c.client_region_header, "x-client-region");
        assert!(c.client_delays_ms.is_empty());
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
            "--client-region-header",
            "X-Region",
            "--client-delay-ms",
            "eu=5",
            "--client-delay-ms=us-east=80.5",
            "--embedding-dim",
            "64",
            "--prefill-overhead-ms",
            "3.5",
            "--block-size",
            "128",
            "--responses-store",
            "--embedding-model",
        ])
        .unwrap();
        assert_eq!(c.prefill_overhead_ms, 3.5);
        assert_eq!(c.block_size, 128);
        assert!(c.responses_store && c.embedding_model);
        // SGLang: token granularity whatever --block-size says.
        assert_eq!(c.engine().block_tokens, 1);
        let v = parse(&["--listen", "a:1", "--block-size", "128"]).unwrap();
        assert_eq!(v.engine().block_tokens, 128);
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
        assert_eq!(c.release.as_deref(), Some("sha256:b"));
        assert_eq!(c.embedding_dim, 64);
        assert_eq!(c.echo_headers, vec!["x-request-id", "x-b"]);
        assert_eq!(c.client_region_header, "x-region");
        assert_eq!(
            c.client_delays_ms,
            BTreeMap::from([("eu".to_string(), 5.0), ("us-east".to_string(), 80.5)])
        );
    }

    #[test]
    fn bad_flags() {
        for args in [
            &[][..],
            &["--name", "x"],
            &["--listen"],
            &["--listen", "a:1", "--bogus"],
            &["--listen", "a:1", "stray"],
            &["--listen", "a:1", "--mode", "tgi"],
            &["--listen", "a:1", "--max-concurrency", "0"],
            &["--listen", "a:1", "--cache-tokens", "-1"],
            &["--listen", "a:1", "--decode-ms-per-token", "NaN"],
            &["--listen", "a:1", "--decode-ms-per-token", "inf"],
            &["--listen", "a:1", "--network-delay-ms", "-5"],
            &["--listen", "a:1", "--network-delay-ms", "86400001"],
            &["--listen", "a:1", "--echo-header", "bad header"],
            &["--listen", "a:1", "--name", ""],
            &["--listen", "a:1", "--client-region-header", "x:y"],
            &["--listen", "a:1", "--client-delay-ms", "eu"],
            &["--listen", "a:1", "--client-delay-ms", "=5"],
            &["--listen", "a:1", "--client-delay-ms", " eu=5"],
            &["--listen", "a:1", "--client-delay-ms", "eu=-1"],
            &["--listen", "a:1", "--client-delay-ms", "eu=NaN"],
            &["--listen", "a:1", "--client-delay-ms", "eu=86400001"],
            &["--listen", "a:1", "--embedding-dim", "0"],
            &["--listen", "a:1", "--embedding-dim", "8193"],
            &["--listen", "a:1", "--block-size", "0"],
            &["--listen", "a:1", "--block-size", "1025"],
            &["--listen", "a:1", "--prefill-overhead-ms", "-1"],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn unknown_flag_is_an_error() {
        let e = parse(&["--listen", "a:1", "--network-delay", "5"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownArgument);
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn repeated_flag_is_an_error() {
        for flag in [
            "--listen",
            "--name",
            "--mode",
            "--model",
            "--max-concurrency",
            "--cache-tokens",
            "--prefill-ms-per-token",
            "--decode-ms-per-token",
            "--network-delay-ms",
            "--release",
            "--client-region-header",
            "--embedding-dim",
            "--block-size",
            "--prefill-overhead-ms",
        ] {
            let value = if flag == "--mode" { "vllm" } else { "1" };
            let e = parse(&["--listen", "a:1", flag, value, flag, value]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{flag}");
            assert_eq!(e.exit_code(), 2, "{flag}");
        }
        // The repeatable ones: per header, and per region.
        assert!(parse(&[
            "--listen",
            "a:1",
            "--echo-header",
            "a",
            "--echo-header",
            "b"
        ])
        .is_ok());
        let e = parse(&[
            "--listen",
            "a:1",
            "--client-delay-ms",
            "eu=5",
            "--client-delay-ms",
            "eu=6",
        ])
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict);
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn help_exits_zero_and_names_every_flag() {
        let e = parse(&["--help"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        assert_eq!(e.exit_code(), 0);
        let text = e.to_string();
        for flag in [
            "--listen",
            "--mode",
            "--echo-header",
            "--client-region-header",
            "--client-delay-ms",
        ] {
            assert!(text.contains(flag), "{flag} missing from\n{text}");
        }
    }

    #[test]
    fn client_delay_replaces_network_delay_for_its_region() {
        let c = parse(&[
            "--listen",
            "a:1",
            "--client-delay-ms",
            "eu=5",
            "--client-delay-ms",
            "ap=0",
        ])
        .unwrap();
        assert_eq!(c.first_byte_delay_ms(Some("eu"), 40.0), 5.0);
        assert_eq!(c.first_byte_delay_ms(Some(" eu "), 40.0), 5.0);
        assert_eq!(c.first_byte_delay_ms(Some("ap"), 40.0), 0.0);
        // Unknown region, no header, and case matters (region names are
        // compared exactly).
        assert_eq!(c.first_byte_delay_ms(Some("us"), 40.0), 40.0);
        assert_eq!(c.first_byte_delay_ms(Some("EU"), 40.0), 40.0);
        assert_eq!(c.first_byte_delay_ms(None, 40.0), 40.0);
        assert_eq!(Config::new("a:1").first_byte_delay_ms(Some("eu"), 7.0), 7.0);
    }
}
