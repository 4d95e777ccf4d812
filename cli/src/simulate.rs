//! `simulate`: run routing policies over a trace on simulated engines and
//! report TTFT, end-to-end latency, cache hits and load. The geo-router
//! policy is the plugin's own core (guard, router, probe, ladder) with one
//! Envoy per client region; each baseline runs once per `--deployment`
//! (`llm_geo_router_sim::deploy`); the engines are the emulator's own model.
//! All simulation logic is in `llm_geo_router_sim`; this module reads the
//! files, prints the results and writes the plots.

use crate::{read, CliError};
use llm_geo_router_sim::deploy::{self, Deployment};
use llm_geo_router_sim::geo::Source;
use llm_geo_router_sim::policy::PolicyName;
use llm_geo_router_sim::sim::Options;
use llm_geo_router_sim::topology::{Topology, MAX_REPLICAS};
use llm_geo_router_sim::workload::Workload;
use llm_geo_router_sim::{plot, report, simulate_all, trace};
use std::path::Path;

pub const SUMMARY: &str = "simulate routing policies over a trace (TTFT, e2e, cache hits)";

pub const ABOUT: &str = "\
Simulate routing policies over a trace (TTFT, e2e, cache hits).

Runs each policy over the trace on its own fresh simulated engines (the
engine emulator's model: FIFO slots, prefix cache, prefill and decode
timing) and prints, per run, TTFT and end-to-end percentiles, the cache
hit token ratio, the requests completed, shed and capped, and the requests
per region. Deterministic: the same files give the same numbers.

TTFT is measured at the client: half a round trip to the region, queueing,
prefill of the uncached tokens, half a round trip back. End to end adds the
decode of the remaining output tokens.

The geo-router runs as the plugin is deployed, one Envoy per client region
(--proxies N: N Envoys per client region, each with its own plugin state,
a request going to the next in turn, as behind an L7 load balancer).
Every other policy (a baseline) runs once per --deployment, labelled
<policy>@<deployment>:
  oracle             one instance that knows every engine's queue and every
                     routed prefix exactly and at once, at no network
                     position: the limit, not a peer
  global:<region>    one instance in that engine region: every request goes
                     client -> router -> engine, so TTFT adds the client's
                     round trip to the router's region and that region's
                     round trip to the engine's (the fleet's region_rtt_ms,
                     else an estimate: bench/README.md); it sees all traffic
  per-client-region  one instance per client region, each seeing only its
                     own traffic (its own prefix tree, in-flight counts and
                     round-robin counter)
Outside the oracle, gorgo reads the engines' queues by a scrape every
probe.tick_ms (the plugin's probe tick, 1000 ms unless --config sets it),
and llm-d their waiting queues and KV usage every 50 ms (its default
refresh interval).

A region may be several engine replicas behind one entry point (--replicas
N, or the fleet's regions[].replicas): the entry point sends each request,
and each probe callout, to one replica by Envoy's least-request rule (two
replicas drawn at random, the one with fewer requests taken). The
geo-router reads the regions' load as --load-source says:
  scrape             (default) its probe scrapes /metrics through the
                     region's cluster: one replica's figures, the one the
                     entry point picks; max_concurrency configured as the
                     region's total (replicas x slots)
  scrape-replica     the same scrape, max_concurrency configured as one
                     replica's slots
  prometheus         one query per probe round to a Prometheus that scrapes
                     every replica every --prometheus-interval-ms and
                     answers with the sums over each region's replicas, the
                     replica count and when it scraped them
                     (load_source: prometheus, max_concurrency per replica);
                     it runs in the engine region nearest each client region
With one replica per region, scrape and scrape-replica are the same.";

pub const AFTER: &str = "\
JSON (--json): {\"policies\": {\"<label>\": {\"policy\", \"deployment\",
\"ttft_ms\": {mean, p50, p95, p99}, \"e2e_ms\": {...}, \"cache_hit_token_ratio\",
\"requests\", \"completed\", \"shed\", \"capped\", \"per_region_requests\": {...},
\"proxies\", \"utilisation\": {<region>: x}, \"queued_share\",
\"occupancy\": {<region>: {p50, p95, max}}, \"queue_time_share\": {<region>: x},
\"reasons\": {<reason>: n}, \"probe_scrapes_per_min\",
\"probe_busy_share\", \"probe_queries_per_min\", \"load_source\"}}}
with <label> geo-router or <policy>@<deployment>. shed: refused by the ladder
(429); capped: a ladder cap applied (max_tokens clamped, or the prompt
refused with 413); requests - completed - shed - 413s failed in an outage.
Only geo-router has a guard and a ladder (and reasons: its decisions per
reason; proxies: its Envoys per client region, 1 for a baseline).
utilisation: slot time used / (slots x time) in the middle half of the
trace's span. queued_share: of the requests an engine gave a slot, the
fraction that waited for it (more than 0.5 ms). occupancy: requests at the
region's engine (running + waiting) / its slots, sampled every 1000 ms of
simulated time in the middle half (nearest-rank percentiles; above 1 means
requests waiting); queue_time_share: the fraction of those samples with a
request waiting. null where there is no sample.
probe_scrapes_per_min (geo-router, else null): /metrics scrapes each Envoy's
probe sent each region's engine per minute of the run (60 at a probe.tick_ms
of 1000 while idle, 240 at a probe.busy_tick_ms of 250); probe_busy_share:
the share of the run its probes ticked at probe.busy_tick_ms;
probe_queries_per_min: the queries each Envoy's probe sent Prometheus per
minute (0 unless --load-source prometheus); load_source: scrape,
scrape-replica or prometheus@<interval>ms (geo-router, else null).

Exit status: 0 on success; 2 on a wrong option or a file that cannot be read
or is invalid (the message names it); 1 when the plots cannot be written.";

/// The policies of one `--policy` value.
#[derive(Debug, Clone)]
pub struct Policies(Vec<PolicyName>);

fn policies(raw: &str) -> Result<Policies, String> {
    let mut out = Vec::new();
    for name in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "all" {
            out.extend(PolicyName::ALL);
        } else {
            out.push(PolicyName::parse(name).ok_or_else(|| {
                format!(
                    "unknown policy '{name}'; known: {}, all",
                    PolicyName::ALL.map(PolicyName::as_str).join(", ")
                )
            })?);
        }
    }
    if out.is_empty() {
        return Err("names no policy".into());
    }
    Ok(Policies(out))
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The fleet (JSON): client_regions, regions with rtt_ms per client
    /// region, max_concurrency, prefill_ms_per_token, decode_ms_per_token,
    /// cache_tokens; optional region_rtt_ms and outages
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs"
    )]
    fleet: String,
    /// The trace (JSONL, one request a line, sorted by t_ms)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs"
    )]
    trace: String,
    /// geo-router, round-robin, least-request, session-affinity, nearest,
    /// cache-aware, gorgo, llm-d, mesh-default, or all; repeat or separate
    /// with commas for several
    #[arg(verbatim_doc_comment, long = "policy", value_name = "NAME", value_parser = policies, required = true,
          action = clap::ArgAction::Append, help_heading = "Inputs")]
    policy: Vec<Policies>,
    /// How the baselines are deployed: oracle, per-client-region or
    /// global:<region> (one of the fleet's regions); repeat for several.
    /// Default: all three, global in the region with the lowest round trip
    /// summed over the trace's requests
    #[arg(verbatim_doc_comment, long = "deployment", value_name = "D", value_parser = Deployment::parse,
          action = clap::ArgAction::Append, help_heading = "Inputs")]
    deployment: Vec<Deployment>,
    /// Plugin settings for geo-router (a plugin configuration without
    /// `regions`, merged over the one built from the fleet), e.g.
    /// {"cost": {"placement_floor": 0.5}}; its probe.tick_ms is also gorgo's scrape
    /// period outside the oracle
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs"
    )]
    config: Option<String>,
    /// The geo-router as N Envoys per client region (gateway replicas behind
    /// an L7 load balancer), each with its own plugin state (directory,
    /// probe, in-flight counts) from the same configuration, all probing at
    /// the same ticks; a client region's n-th request goes to its Envoy
    /// n mod N. The baselines ignore it
    #[arg(verbatim_doc_comment, long, value_name = "N", default_value = "1",
          value_parser = crate::args::positive_whole::<usize>, allow_negative_numbers = true, help_heading = "Inputs")]
    proxies: usize,
    /// The geo-router's Envoys (every client region's, all --proxies of
    /// them) sharing what they learn through the plugin's exchange
    /// (`exchange.cluster`), each message delayed by the network: off, on,
    /// or both (a run without and a run with, labelled geo-router and
    /// geo-router+exchange). Default: both with --proxies above 1, else off
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "off|on|both",
        help_heading = "Inputs"
    )]
    exchange: Option<String>,
    /// Split every region's engine into N replicas behind its one entry
    /// point, each with 1/N of its slots (rounded, replicas alike) and of its
    /// prefix cache; requests and probe callouts to the region go to one
    /// replica by least request. Default: as the fleet file says (one)
    #[arg(verbatim_doc_comment, long, value_name = "N",
          value_parser = crate::args::positive_whole::<u32>, allow_negative_numbers = true, help_heading = "Inputs")]
    replicas: Option<u32>,
    /// Where the geo-router reads the regions' load: scrape (its probe's
    /// /metrics callout through the region's cluster, max_concurrency the
    /// region's total), scrape-replica (the same, max_concurrency one
    /// replica's) or prometheus (one query per probe round, sums over the
    /// replicas as of Prometheus' last scrape, max_concurrency per replica)
    #[arg(verbatim_doc_comment, long, value_name = "SOURCE", default_value = "scrape",
          value_parser = Source::parse, help_heading = "Inputs")]
    load_source: Source,
    /// With --load-source prometheus: Prometheus' scrape_interval, ms
    /// (default 15000, Prometheus' own default)
    #[arg(verbatim_doc_comment, long, value_name = "MS",
          value_parser = crate::args::positive, allow_negative_numbers = true, help_heading = "Inputs")]
    prometheus_interval_ms: Option<f64>,
    /// Multiply the trace's request rate by F: every request's t_ms is
    /// divided by F before simulating, so think times between a session's
    /// turns shrink too (F > 1) and the span is 1/F as long; the fleet's
    /// outages keep their times
    #[arg(verbatim_doc_comment, long, value_name = "F", default_value = "1",
          value_parser = crate::args::positive, allow_negative_numbers = true, help_heading = "Inputs")]
    rate_scale: f64,
    /// One JSON object (shape below)
    #[arg(verbatim_doc_comment, long, help_heading = "Output")]
    json: bool,
    /// Write ttft_cdf.svg, region_load.svg and (with geo-router) ladder.svg
    /// into DIR (created if missing)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "DIR",
        help_heading = "Output"
    )]
    plots: Option<String>,
    /// Also write every request's outcome, one JSON object a line: policy
    /// (the run's label), deployment, index, t_ms, session, client_region,
    /// region, status, ttft_ms, e2e_ms, prompt_tokens, cached_tokens,
    /// queued_ms, reason (geo-router)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Output"
    )]
    requests: Option<String>,
    /// Label in the plots' titles (default: the trace's directory name for
    /// trace.jsonl, else its file name)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "TEXT",
        help_heading = "Output"
    )]
    title: Option<String>,
}

/// The policies asked for, each once, in the order first asked.
fn policy_list(given: &[Policies]) -> Vec<PolicyName> {
    let mut names = Vec::new();
    for p in given.iter().flat_map(|p| p.0.iter()) {
        if !names.contains(p) {
            names.push(*p);
        }
    }
    names
}

/// The deployments asked for, checked against the fleet (each once, a
/// global router in one of its regions), or the default three.
fn deployments(
    given: &[Deployment],
    fleet: &Topology,
    work: &Workload,
) -> Result<Vec<Deployment>, CliError> {
    if given.is_empty() {
        return Ok(Deployment::defaults(fleet, work));
    }
    deploy::check(given, fleet).map_err(|e| CliError::Usage(format!("--deployment {e}")))?;
    Ok(given.to_vec())
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

pub fn run(a: Args) -> Result<String, CliError> {
    let policies = policy_list(&a.policy);
    let fleet_path = a.fleet.as_str();
    let trace_path = a.trace.as_str();
    let fleet = Topology::parse(&read("fleet", fleet_path)?)
        .map_err(|e| CliError::Input(format!("--fleet {fleet_path}: {e}")))?;
    let fleet = match a.replicas {
        Some(n) if n > MAX_REPLICAS => {
            return Err(CliError::Usage(format!(
                "--replicas {n}: at most {MAX_REPLICAS}"
            )))
        }
        Some(n) => fleet
            .split_replicas(n)
            .map_err(|e| CliError::Input(format!("--fleet {fleet_path}: --replicas {n}: {e}")))?,
        None => fleet,
    };
    let source = match (a.load_source, a.prometheus_interval_ms) {
        (Source::Prometheus { interval_ms }, given) => Source::Prometheus {
            interval_ms: given.unwrap_or(interval_ms),
        },
        (s, None) => s,
        (_, Some(_)) => {
            return Err(CliError::Usage(
                "--prometheus-interval-ms is for --load-source prometheus".into(),
            ))
        }
    };
    let text = String::from_utf8(read("trace", trace_path)?)
        .map_err(|_| CliError::Input(format!("--trace {trace_path}: not UTF-8")))?;
    let mut requests =
        trace::parse(&text).map_err(|e| CliError::Input(format!("--trace {trace_path}: {e}")))?;
    scale_rate(&mut requests, a.rate_scale);
    let overrides = match a.config.as_deref() {
        Some(path) => Some(
            serde_json::from_slice::<serde_json::Value>(&read("config", path)?)
                .map_err(|e| CliError::Input(format!("--config {path}: not JSON: {e}")))?,
        ),
        None => None,
    };
    let work = Workload::new(&fleet, requests)
        .map_err(|e| CliError::Input(format!("--trace {trace_path}: {e}")))?;
    let deployments = deployments(&a.deployment, &fleet, &work)?;
    let jobs = deploy::jobs(&policies, &deployments);
    let (jobs, exchange) = match a.exchange.as_deref() {
        None if a.proxies > 1 => (deploy::with_exchange(jobs), false),
        None | Some("off") => (jobs, false),
        Some("on") => (jobs, true),
        Some("both") => (deploy::with_exchange(jobs), false),
        Some(other) => {
            return Err(CliError::Usage(format!(
                "--exchange {other:?}: one of off, on, both"
            )))
        }
    };
    let jobs: Vec<deploy::Job> = jobs
        .into_iter()
        .map(|j| deploy::Job {
            exchange: j.exchange || (exchange && j.policy == PolicyName::GeoRouter),
            ..j
        })
        .collect();
    let options = Options {
        proxies: a.proxies,
        source,
        exchange: false,
    };
    let runs =
        simulate_all(&fleet, &work, &jobs, overrides.as_ref(), options).map_err(CliError::Input)?;
    let summaries: Vec<report::Summary> = runs
        .iter()
        .map(|r| report::summarize(&fleet, &work, r))
        .collect();
    if let Some(dir) = a.plots.as_deref() {
        let title = a.title.clone().unwrap_or_else(|| label(trace_path));
        write_plots(Path::new(dir), &plot::all(&title, &fleet, &runs))?;
    }
    if let Some(path) = a.requests.as_deref() {
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
    if a.json {
        let v = report::to_json(&summaries);
        return Ok(format!("{v}\n"));
    }
    Ok(report::to_text(&summaries))
}

/// `--rate-scale`: the same requests `factor` times as fast.
fn scale_rate(requests: &mut [trace::TraceRequest], factor: f64) {
    if factor != 1.0 {
        for r in requests {
            r.t_ms /= factor;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use llm_geo_router_sim::scenario;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        a: Args,
    }

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let base = ["t", "--fleet", "f.json", "--trace", "t.jsonl"];
        T::try_parse_from(base.iter().chain(extra)).map(|t| t.a)
    }

    fn message(r: Result<Vec<Deployment>, CliError>) -> String {
        match r {
            Err(CliError::Usage(m)) => m,
            other => format!("unexpected {other:?}"),
        }
    }

    #[test]
    fn policies_repeat_with_commas_and_all() {
        let a = parse(&[
            "--policy",
            "gorgo",
            "--policy=nearest, gorgo",
            "--policy",
            "all",
        ])
        .unwrap();
        let p = policy_list(&a.policy);
        assert_eq!(p.len(), 9);
        assert_eq!(&p[..2], [PolicyName::Gorgo, PolicyName::Nearest]);
        let e = parse(&["--policy", "fastest"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("unknown policy 'fastest'"), "{e}");
        let e = parse(&[]).unwrap_err();
        assert!(e.to_string().contains("--policy <NAME>"), "{e}");
    }

    #[test]
    fn deployments_parse_check_and_default() {
        // Unknown kind: refused by the parser (exit 2, naming the option).
        let e = parse(&["--policy", "all", "--deployment", "everywhere"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let e = e.to_string();
        assert!(
            e.contains("invalid value 'everywhere' for '--deployment <D>'")
                && e.contains("oracle, per-client-region, global:<region>"),
            "{e}"
        );
        let s = scenario::generate(scenario::Kind::A, 1);
        let trace: Vec<_> = s.trace.into_iter().take(50).collect();
        let work = Workload::new(&s.fleet, trace).unwrap();
        let given = |extra: &[&str]| {
            let mut words = vec!["--policy", "all"];
            for d in extra {
                words.extend(["--deployment", d]);
            }
            let a = parse(&words).unwrap();
            deployments(&a.deployment, &s.fleet, &work)
        };
        // Unknown region: refused against the fleet, listing its regions.
        assert_eq!(
            message(given(&["global:sfo"])),
            "--deployment global:sfo: 'sfo' is not a region of the fleet; its regions: iad, fra, icn"
        );
        // The same deployment twice.
        assert_eq!(
            message(given(&["oracle", "global:fra", "oracle"])),
            "--deployment 'oracle' is given more than once"
        );
        assert_eq!(
            given(&["global:fra", "per-client-region"]).unwrap(),
            [
                Deployment::Global("fra".into()),
                Deployment::PerClientRegion
            ]
        );
        // None given: all three, the global router in iad (na's traffic).
        assert_eq!(
            given(&[]).unwrap(),
            [
                Deployment::Oracle,
                Deployment::PerClientRegion,
                Deployment::Global("iad".into())
            ]
        );
    }
}
