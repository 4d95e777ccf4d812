//! `crossover`: when does fetching a session's cached KV prefix from another
//! region beat recomputing it locally, by prefix length and, given the queue
//! options, by fetch-path utilisation. Prints what `migration.rs` computes;
//! no arithmetic of its own beyond unit conversion.

use crate::args;
use crate::CliError;
use llm_geo_router::decision::migration::{
    crossover_tokens, crossover_utilization, fetch_s, recompute_s, transfer_s_per_token, KvModel,
};
use serde_json::{json, Map, Value};

pub const SUMMARY: &str = "fetch a migrated session's KV prefix over the WAN, or recompute it?";

pub const ABOUT: &str = "\
Fetch a migrated session's KV prefix over the WAN, or recompute it?

When a region takes over a session, is fetching its cached KV prefix from the
region that holds it faster than recomputing the prefix locally? Prints the
bytes per token, both costs per token and the prefix length where they cross
(what migration.rs computes); given the three queue options, also prices one
prefix on both queues and the fetch-path utilisation where recompute wins.";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Transformer layers
    #[arg(verbatim_doc_comment, long, value_name = "L", value_parser = args::positive_whole::<u32>,
          help_heading = "Model")]
    layers: u32,
    /// KV heads per layer
    #[arg(verbatim_doc_comment, long, value_name = "H", value_parser = args::positive_whole::<u32>,
          help_heading = "Model")]
    kv_heads: u32,
    /// Dimension of one head
    #[arg(verbatim_doc_comment, long, value_name = "D", value_parser = args::positive_whole::<u32>,
          help_heading = "Model")]
    head_dim: u32,
    /// Bytes per cached element (1 for FP8, 0.5 for 4-bit)
    #[arg(verbatim_doc_comment, long, value_name = "B", value_parser = args::positive, default_value = "2",
          allow_negative_numbers = true, help_heading = "Model")]
    kv_bytes: f64,
    /// Parameters, e.g. 70e9
    #[arg(verbatim_doc_comment, long, value_name = "P", value_parser = args::positive,
          allow_negative_numbers = true, help_heading = "Model")]
    params: f64,
    /// Dense accelerator throughput in TFLOP/s, e.g. 989
    #[arg(verbatim_doc_comment, long, value_name = "T", value_parser = args::positive,
          allow_negative_numbers = true, help_heading = "Model")]
    tflops: f64,
    /// Prefill model FLOPs utilisation, in (0, 1]
    #[arg(verbatim_doc_comment, long, value_name = "M", value_parser = args::fraction,
          allow_negative_numbers = true, help_heading = "Model")]
    mfu: f64,
    /// WAN goodput between the two regions, Gbit/s
    #[arg(verbatim_doc_comment, long, value_name = "G", value_parser = args::positive,
          allow_negative_numbers = true, help_heading = "Link")]
    bandwidth_gbps: f64,
    /// Round trip between the two regions, ms
    #[arg(verbatim_doc_comment, long, value_name = "R", value_parser = args::non_negative,
          allow_negative_numbers = true, help_heading = "Link")]
    rtt_ms: f64,
    /// Cached prefix length to price
    #[arg(verbatim_doc_comment, long, value_name = "N", value_parser = args::whole::<u64>,
          help_heading = "Queues (all three or none)")]
    prefix_tokens: Option<u64>,
    /// Destination compute queue utilisation, in [0, 1)
    #[arg(verbatim_doc_comment, long, value_name = "U", value_parser = args::utilization,
          allow_negative_numbers = true, help_heading = "Queues (all three or none)")]
    compute_util: Option<f64>,
    /// Requests/s each queue (fetch path, compute) drains
    #[arg(verbatim_doc_comment, long, value_name = "S", value_parser = args::positive,
          allow_negative_numbers = true, help_heading = "Queues (all three or none)")]
    service_rate: Option<f64>,
    /// One JSON object instead of a table
    #[arg(verbatim_doc_comment, long, help_heading = "Output")]
    json: bool,
}

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

pub fn run(a: Args) -> Result<String, CliError> {
    let json = a.json;
    let inputs = inputs(a)?;
    let report = Report::compute(&inputs);
    Ok(if json {
        report.json()
    } else {
        report.table(&inputs)
    })
}

fn inputs(a: Args) -> Result<Inputs, CliError> {
    let queues = match (a.prefix_tokens, a.compute_util, a.service_rate) {
        (Some(prefix_tokens), Some(compute_util), Some(service_rate)) => Some(Queues {
            prefix_tokens,
            compute_util,
            service_rate,
        }),
        (None, None, None) => None,
        (p, c, r) => {
            let missing: Vec<&str> = [
                (p.is_none(), "--prefix-tokens"),
                (c.is_none(), "--compute-util"),
                (r.is_none(), "--service-rate"),
            ]
            .iter()
            .filter(|(absent, _)| *absent)
            .map(|(_, name)| *name)
            .collect();
            return Err(CliError::Usage(format!(
                "--prefix-tokens, --compute-util and --service-rate go together; missing {}",
                missing.join(", ")
            )));
        }
    };
    let model = KvModel {
        layers: a.layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        kv_bytes: a.kv_bytes,
        params: a.params,
        tflops: a.tflops,
        mfu: a.mfu,
    };
    // The options already hold every field to its domain; this keeps the
    // CLI from ever accepting a model the plugin's config would refuse.
    model
        .validate()
        .map_err(|e| CliError::Usage(format!("invalid model: {e}")))?;
    Ok(Inputs {
        model,
        bandwidth_gbps: a.bandwidth_gbps,
        rtt_ms: a.rtt_ms,
        queues,
    })
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
