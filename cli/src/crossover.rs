//! `crossover`: when does fetching a session's cached KV prefix from another
//! region beat recomputing it locally, by prefix length and, given the queue
//! options, by fetch-path utilisation. Prints what `migration.rs` computes;
//! no arithmetic of its own beyond unit conversion.

use crate::args::{self, Domain, Kind, Opt, Parsed};
use crate::CliError;
use llm_geo_router::migration::{
    crossover_tokens, crossover_utilization, fetch_s, recompute_s, transfer_s_per_token, KvModel,
};
use serde_json::{json, Map, Value};

pub const SUMMARY: &str = "fetch a migrated session's KV prefix over the WAN, or recompute it?";

pub const USAGE: &str = "\
usage: llm-geo-router crossover --layers L --kv-heads H --head-dim D [--kv-bytes B]
                                --params P --tflops T --mfu M
                                --bandwidth-gbps G --rtt-ms R
                                [--prefix-tokens N --compute-util U --service-rate S]
                                [--json]

When a region takes over a session, is fetching its cached KV prefix from the
region that holds it faster than recomputing the prefix locally?

model:
  --layers L            transformer layers
  --kv-heads H          KV heads per layer
  --head-dim D          dimension of one head
  --kv-bytes B          bytes per cached element (default 2; 1 for FP8, 0.5 for 4-bit)
  --params P            parameters, e.g. 70e9
  --tflops T            dense accelerator throughput in TFLOP/s, e.g. 989
  --mfu M               prefill model FLOPs utilisation, in (0, 1]
link:
  --bandwidth-gbps G    WAN goodput between the two regions, Gbit/s
  --rtt-ms R            round trip between the two regions, ms
queues (all three or none):
  --prefix-tokens N     cached prefix length to price
  --compute-util U      destination compute queue utilisation, in [0, 1)
  --service-rate S      requests/s each queue (fetch path, compute) drains
output:
  --json                one JSON object instead of a table
";

const fn value(name: &'static str) -> Opt {
    Opt {
        name,
        kind: Kind::Value,
    }
}

const OPTIONS: &[Opt] = &[
    value("layers"),
    value("kv-heads"),
    value("head-dim"),
    value("kv-bytes"),
    value("params"),
    value("tflops"),
    value("mfu"),
    value("bandwidth-gbps"),
    value("rtt-ms"),
    value("prefix-tokens"),
    value("compute-util"),
    value("service-rate"),
    Opt {
        name: "json",
        kind: Kind::Flag,
    },
];

const REQUIRED: &[&str] = &[
    "layers",
    "kv-heads",
    "head-dim",
    "params",
    "tflops",
    "mfu",
    "bandwidth-gbps",
    "rtt-ms",
];

const QUEUE_OPTIONS: &[&str] = &["prefix-tokens", "compute-util", "service-rate"];

/// The optional queue scenario: price one prefix on both queues.
struct Queues {
    prefix_tokens: u64,
    compute_util: f64,
    service_rate: f64,
}

struct Inputs {
    model: KvModel,
    bandwidth_gbps: f64,
    rtt_ms: f64,
    queues: Option<Queues>,
}

pub fn run(argv: &[String]) -> Result<String, CliError> {
    let parsed = args::parse(argv, OPTIONS)?;
    let inputs = inputs(&parsed)?;
    let report = Report::compute(&inputs);
    Ok(if parsed.flag("json") {
        report.json()
    } else {
        report.table(&inputs)
    })
}

fn inputs(p: &Parsed) -> Result<Inputs, CliError> {
    p.require_all(REQUIRED)?;
    let missing: Vec<String> = QUEUE_OPTIONS
        .iter()
        .filter(|name| !p.has(name))
        .map(|name| format!("--{name}"))
        .collect();
    if !missing.is_empty() && missing.len() != QUEUE_OPTIONS.len() {
        return Err(CliError::Usage(format!(
            "--prefix-tokens, --compute-util and --service-rate go together; missing {}",
            missing.join(", ")
        )));
    }
    let model = KvModel {
        layers: required(p.whole("layers", true)?, "layers")?,
        kv_heads: required(p.whole("kv-heads", true)?, "kv-heads")?,
        head_dim: required(p.whole("head-dim", true)?, "head-dim")?,
        kv_bytes: p.number("kv-bytes", Domain::Positive)?.unwrap_or(2.0),
        params: required(p.number("params", Domain::Positive)?, "params")?,
        tflops: required(p.number("tflops", Domain::Positive)?, "tflops")?,
        mfu: required(p.number("mfu", Domain::Fraction)?, "mfu")?,
    };
    // The options above already hold every field to its domain; this keeps
    // the CLI from ever accepting a model the plugin's config would refuse.
    model
        .validate()
        .map_err(|e| CliError::Usage(format!("invalid model: {e}")))?;
    let bandwidth_gbps = required(
        p.number("bandwidth-gbps", Domain::Positive)?,
        "bandwidth-gbps",
    )?;
    let rtt_ms = required(p.number("rtt-ms", Domain::NonNegative)?, "rtt-ms")?;
    let queues = match (
        p.whole("prefix-tokens", false)?,
        p.number("compute-util", Domain::Utilization)?,
        p.number("service-rate", Domain::Positive)?,
    ) {
        (Some(prefix_tokens), Some(compute_util), Some(service_rate)) => Some(Queues {
            prefix_tokens,
            compute_util,
            service_rate,
        }),
        _ => None,
    };
    Ok(Inputs {
        model,
        bandwidth_gbps,
        rtt_ms,
        queues,
    })
}

/// `require_all` has run, so this only turns "absent" into the same message.
fn required<T>(value: Option<T>, name: &str) -> Result<T, CliError> {
    value.ok_or_else(|| CliError::Usage(format!("missing required option --{name}")))
}

struct QueueReport {
    fetch_ms: f64,
    recompute_ms: f64,
    crossover_utilization: Option<f64>,
}

struct Report {
    bytes_per_token: f64,
    recompute_us_per_token: f64,
    transfer_us_per_token: f64,
    crossover_tokens: Option<f64>,
    queues: Option<QueueReport>,
}

impl Report {
    fn compute(i: &Inputs) -> Report {
        let m = &i.model;
        let bpt = m.bytes_per_token();
        let queues = i.queues.as_ref().map(|q| QueueReport {
            fetch_ms: fetch_s(q.prefix_tokens, bpt, i.bandwidth_gbps, i.rtt_ms) * 1e3,
            recompute_ms: recompute_s(q.prefix_tokens, m.params, m.tflops, m.mfu) * 1e3,
            crossover_utilization: crossover_utilization(
                bpt,
                i.bandwidth_gbps,
                i.rtt_ms,
                m.params,
                m.tflops,
                m.mfu,
                q.prefix_tokens,
                q.compute_util,
                q.service_rate,
            ),
        });
        Report {
            bytes_per_token: bpt,
            recompute_us_per_token: m.recompute_s_per_token() * 1e6,
            transfer_us_per_token: transfer_s_per_token(bpt, i.bandwidth_gbps) * 1e6,
            crossover_tokens: crossover_tokens(
                bpt,
                i.bandwidth_gbps,
                i.rtt_ms,
                m.params,
                m.tflops,
                m.mfu,
            ),
            queues,
        }
    }

    fn json(&self) -> String {
        let mut object = Map::new();
        // Whole bytes print as an integer; a sub-byte cache may not be whole.
        let bytes = if self.bytes_per_token.fract() == 0.0 && self.bytes_per_token < 9.0e15 {
            json!(self.bytes_per_token as u64)
        } else {
            json!(self.bytes_per_token)
        };
        object.insert("bytes_per_token".into(), bytes);
        object.insert(
            "recompute_us_per_token".into(),
            json!(self.recompute_us_per_token),
        );
        object.insert(
            "transfer_us_per_token".into(),
            json!(self.transfer_us_per_token),
        );
        object.insert("crossover_tokens".into(), json!(self.crossover_tokens));
        if let Some(q) = &self.queues {
            object.insert("fetch_ms".into(), json!(q.fetch_ms));
            object.insert("recompute_ms".into(), json!(q.recompute_ms));
            object.insert(
                "crossover_utilization".into(),
                json!(q.crossover_utilization),
            );
        }
        format!("{}\n", Value::Object(object))
    }

    fn table(&self, i: &Inputs) -> String {
        let mut rows: Vec<(String, String)> = vec![
            (
                "bytes per token".into(),
                format!(
                    "{} B ({:.1} KiB)",
                    self.bytes_per_token,
                    self.bytes_per_token / 1024.0
                ),
            ),
            (
                "recompute per token".into(),
                format!("{:.2} us", self.recompute_us_per_token),
            ),
            (
                "transfer per token".into(),
                format!(
                    "{:.2} us at {} Gbps",
                    self.transfer_us_per_token, i.bandwidth_gbps
                ),
            ),
            (
                "crossover".into(),
                match self.crossover_tokens {
                    Some(tokens) => format!(
                        "{tokens:.0} tokens at {} ms RTT (fetch wins for longer prefixes)",
                        i.rtt_ms
                    ),
                    None => "none: a token costs more to transfer than to recompute, \
                             fetch never wins"
                        .into(),
                },
            ),
        ];
        if let (Some(q), Some(inq)) = (&self.queues, &i.queues) {
            let n = inq.prefix_tokens;
            rows.push((
                format!("fetch, {n} tokens"),
                format!("{:.2} ms", q.fetch_ms),
            ));
            rows.push((
                format!("recompute, {n} tokens"),
                format!("{:.2} ms", q.recompute_ms),
            ));
            rows.push((
                "crossover utilisation".into(),
                match q.crossover_utilization {
                    Some(u) => format!(
                        "{u:.4} (fetch-path load above which recompute wins; \
                         compute at {}, {} req/s)",
                        inq.compute_util, inq.service_rate
                    ),
                    None => "none: recompute wins even over an idle fetch path".into(),
                },
            ));
        }
        let width = rows.iter().map(|(label, _)| label.len()).max().unwrap_or(0) + 2;
        rows.iter()
            .map(|(label, value)| format!("{label:<width$}{value}\n"))
            .collect()
    }
}
