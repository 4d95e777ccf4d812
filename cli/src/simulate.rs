//! `simulate`: run routing policies over a trace on simulated engines and
//! report TTFT, end-to-end latency, cache hits and load. The geo-router
//! policy is the plugin's own core (guard, router, probe, ladder) with one
//! Envoy per client region; the engines are the emulator's own model. All
//! simulation logic is in `llm_geo_router_sim`; this module reads the files,
//! prints the results and writes the plots.

use crate::args::{self, Kind, Opt};
use crate::CliError;
use llm_geo_router_sim::fleet::Fleet;
use llm_geo_router_sim::policy::PolicyName;
use llm_geo_router_sim::workload::Workload;
use llm_geo_router_sim::{plot, report, simulate_all, trace};
use std::path::Path;

pub const SUMMARY: &str = "simulate routing policies over a trace (TTFT, e2e, cache hits)";

pub const USAGE: &str = "\
usage: llm-geo-router simulate --fleet FILE --trace FILE --policy NAME [--policy NAME ...]
                               [--config FILE] [--json] [--plots DIR] [--title TEXT]

Runs each policy over the trace on its own fresh simulated engines (the
engine emulator's model: FIFO slots, prefix cache, prefill and decode
timing) and prints, per policy, TTFT and end-to-end percentiles, the cache
hit token ratio, the requests completed, shed and capped, and the requests
per region. Deterministic: the same files give the same numbers.

TTFT is measured at the client: half a round trip to the region, queueing,
prefill of the uncached tokens, half a round trip back. End to end adds the
decode of the remaining output tokens.

inputs:
  --fleet FILE     the fleet (JSON): client_regions, regions with rtt_ms per
                   client region, max_concurrency, prefill_ms_per_token,
                   decode_ms_per_token, cache_tokens; optional outages
  --trace FILE     the trace (JSONL, one request a line, sorted by t_ms)
  --policy NAME    geo-router, round-robin, least-request, session-affinity,
                   nearest, cache-aware, gorgo, or all; repeat or separate
                   with commas for several
  --config FILE    plugin settings for geo-router (a plugin configuration
                   without `regions`, merged over the one built from the
                   fleet), e.g. {\"cost\": {\"w_queue\": 2}}
output:
  --json           one JSON object: {\"policies\": {\"<name>\": {\"ttft_ms\":
                   {mean, p50, p95, p99}, \"e2e_ms\": {...},
                   \"cache_hit_token_ratio\", \"requests\", \"completed\",
                   \"shed\", \"capped\", \"per_region_requests\": {...}}}}
                   shed: refused by the ladder (429); capped: a ladder cap
                   applied (max_tokens clamped, or the prompt refused with
                   413); requests − completed − shed − 413s failed in an
                   outage. Only geo-router has a guard and a ladder.
  --plots DIR      write ttft_cdf.svg, region_load.svg and (with geo-router)
                   ladder.svg into DIR (created if missing)
  --requests FILE  also write every request's outcome, one JSON object a
                   line: policy, index, t_ms, session, client_region,
                   region, status, ttft_ms, e2e_ms, prompt_tokens,
                   cached_tokens, queued_ms, reason (geo-router)
  --title TEXT     label in the plots' titles (default: the trace's
                   directory name for trace.jsonl, else its file name)

Exit status: 0 on success; 2 on a wrong option or a file that cannot be read
or is invalid (the message names it); 1 when the plots cannot be written.
";

const OPTIONS: &[Opt] = &[
    Opt {
        name: "fleet",
        kind: Kind::Value,
    },
    Opt {
        name: "trace",
        kind: Kind::Value,
    },
    Opt {
        name: "config",
        kind: Kind::Value,
    },
    Opt {
        name: "plots",
        kind: Kind::Value,
    },
    Opt {
        name: "title",
        kind: Kind::Value,
    },
    Opt {
        name: "requests",
        kind: Kind::Value,
    },
    Opt {
        name: "json",
        kind: Kind::Flag,
    },
];

/// `--policy` may repeat, which the shared parser refuses: take its values
/// out first.
fn split_policies(argv: &[String]) -> Result<(Vec<PolicyName>, Vec<String>), CliError> {
    let mut names = Vec::new();
    let mut rest = Vec::new();
    let mut words = argv.iter();
    while let Some(w) = words.next() {
        let value = if w == "--policy" {
            match words.next() {
                Some(v) if !v.starts_with("--") => v.clone(),
                _ => return Err(CliError::Usage("--policy needs a value".into())),
            }
        } else if let Some(v) = w.strip_prefix("--policy=") {
            v.to_string()
        } else {
            rest.push(w.clone());
            continue;
        };
        for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let add: Vec<PolicyName> = if name == "all" {
                PolicyName::ALL.to_vec()
            } else {
                vec![PolicyName::parse(name).ok_or_else(|| {
                    CliError::Usage(format!(
                        "--policy: unknown policy '{name}'; known: {}, all",
                        PolicyName::ALL.map(PolicyName::as_str).join(", ")
                    ))
                })?]
            };
            for p in add {
                if !names.contains(&p) {
                    names.push(p);
                }
            }
        }
    }
    if names.is_empty() {
        return Err(CliError::Usage(
            "missing required option --policy (a policy name, or all)".into(),
        ));
    }
    Ok((names, rest))
}

fn read(option: &str, path: &str) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|e| CliError::Input(format!("--{option} {path}: cannot read: {e}")))
}

fn label(trace_path: &str) -> String {
    let p = Path::new(trace_path);
    let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("trace");
    if p.file_name().and_then(|s| s.to_str()) == Some("trace.jsonl") {
        if let Some(dir) = p
            .parent()
            .and_then(|d| d.file_name())
            .and_then(|s| s.to_str())
        {
            return dir.to_string();
        }
    }
    stem.to_string()
}

pub fn run(argv: &[String]) -> Result<String, CliError> {
    let (policies, rest) = split_policies(argv)?;
    let p = args::parse(&rest, OPTIONS)?;
    p.require_all(&["fleet", "trace"])?;
    let fleet_path = p.text("fleet").unwrap_or_default();
    let trace_path = p.text("trace").unwrap_or_default();
    let fleet = Fleet::parse(&read("fleet", fleet_path)?)
        .map_err(|e| CliError::Input(format!("--fleet {fleet_path}: {e}")))?;
    let text = String::from_utf8(read("trace", trace_path)?)
        .map_err(|_| CliError::Input(format!("--trace {trace_path}: not UTF-8")))?;
    let requests =
        trace::parse(&text).map_err(|e| CliError::Input(format!("--trace {trace_path}: {e}")))?;
    let overrides = match p.text("config") {
        Some(path) => Some(
            serde_json::from_slice::<serde_json::Value>(&read("config", path)?)
                .map_err(|e| CliError::Input(format!("--config {path}: not JSON: {e}")))?,
        ),
        None => None,
    };
    let work = Workload::new(&fleet, requests)
        .map_err(|e| CliError::Input(format!("--trace {trace_path}: {e}")))?;
    let runs =
        simulate_all(&fleet, &work, &policies, overrides.as_ref()).map_err(CliError::Input)?;
    let summaries: Vec<report::Summary> = runs
        .iter()
        .map(|r| report::summarize(&fleet, &work, r))
        .collect();
    if let Some(dir) = p.text("plots") {
        let title = p
            .text("title")
            .map_or_else(|| label(trace_path), str::to_string);
        write_plots(Path::new(dir), &plot::all(&title, &fleet, &runs))?;
    }
    if let Some(path) = p.text("requests") {
        let mut out = String::new();
        for run in &runs {
            for line in report::request_lines(&fleet, &work, run) {
                out.push_str(&line.to_string());
                out.push('\n');
            }
        }
        std::fs::write(path, out).map_err(|e| CliError::Refused {
            output: String::new(),
            message: format!("--requests {path}: cannot write: {e}"),
        })?;
    }
    if p.flag("json") {
        let v = report::to_json(&summaries);
        return Ok(format!("{v}\n"));
    }
    Ok(report::to_text(&summaries))
}

fn write_plots(dir: &Path, plots: &[(&str, String)]) -> Result<(), CliError> {
    let fail = |e: std::io::Error| CliError::Refused {
        output: String::new(),
        message: format!("--plots {}: cannot write: {e}", dir.display()),
    };
    std::fs::create_dir_all(dir).map_err(fail)?;
    for (name, svg) in plots {
        std::fs::write(dir.join(name), svg).map_err(fail)?;
    }
    Ok(())
}
