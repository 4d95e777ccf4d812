//! `generate`: write a scenario's fleet and trace (deterministic by seed)
//! for `simulate` and the live replayer. The generators are
//! `llm_geo_router_sim::scenario`; this module only writes the files and
//! prints the scenario's figures.

use crate::CliError;
use llm_geo_router_sim::scenario::{self, figures};
use llm_geo_router_sim::trace;
use std::path::Path;

pub const SUMMARY: &str = "write a benchmark scenario's fleet.json and trace.jsonl";

pub const ABOUT: &str = "\
Write a benchmark scenario's fleet.json and trace.jsonl.

Writes DIR/fleet.json and DIR/trace.jsonl (DIR is created if missing) and
prints the scenario's figures: requests, sessions, span, mean prompt tokens,
prefix reuse (prompt tokens that are a prefix an earlier request already
sent), offered decode load (decode work over all regions' slots for the
trace's span), the prefill load on top of it (between every reused prefix
cached and none), and the working set (prompt prefixes sent more than once)
against the largest region cache. The same scenario and seed always give
the same files.

scenarios (regions iad, fra, icn; client regions na, eu, ap; na sees the
regions at 37 / 279 / 456 ms):
  a   long-prefix agentic multi-turn, GORGO-like: about 18k prompt tokens,
      about 90 % prefix reuse, 80 % of sessions from na
  b   short independent prompts
  c   steady short traffic and, from 60 s to 120 s, a flash crowd in eu
      behind one hot 3000-token system prompt
  d   multi-turn chat; iad is lost from 80 s to 170 s (fleet `outages`)

scenarios on three continents (regions iad, fra, nrt: us-east, eu-central,
ap-northeast; clients in na, eu, ap 15-25 ms from their own continent's
region, 104-262 ms from the others, after measured inter-region round trips):
  e   multi-turn chat, demand 55 / 30 / 15 % from na / eu / ap, six system
      prompts shared by all client regions, and from 150 s to 225 s a crowd
      of short conversations in ap tripling its request rate
  f   caches smaller than the working set: 240 long documents revisited by
      multi-turn sessions, each region's cache about a tenth of the prefixes
      sent more than once
  g   heterogeneous regions: nrt has half the slots of the others, fra twice
      their prefill time per token; chat, long-document sessions and long
      one-off prompts at about 75 % of the fleet's slots";

pub const AFTER: &str = "\
Exit status: 0 on success; 2 on a wrong option or a file that cannot be
written.";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The scenario: a, b, c, d, e, f or g
    #[arg(verbatim_doc_comment, long, value_name = "a|b|c|d|e|f|g", value_parser = scenario_kind)]
    scenario: scenario::Kind,
    /// The seed (a whole number >= 0)
    #[arg(verbatim_doc_comment, long, value_name = "N", value_parser = crate::args::whole::<u64>)]
    seed: u64,
    /// Where to write the files
    #[arg(verbatim_doc_comment, long, value_name = "DIR", default_value = ".")]
    out: String,
}

fn scenario_kind(raw: &str) -> Result<scenario::Kind, String> {
    scenario::Kind::parse(raw).ok_or_else(|| "must be one of a, b, c, d, e, f, g".to_string())
}

pub fn run(a: Args) -> Result<String, CliError> {
    let (kind, seed) = (a.scenario, a.seed);
    let name = match kind {
        scenario::Kind::A => "a",
        scenario::Kind::B => "b",
        scenario::Kind::C => "c",
        scenario::Kind::D => "d",
        scenario::Kind::E => "e",
        scenario::Kind::F => "f",
        scenario::Kind::G => "g",
    };
    let dir = Path::new(&a.out);
    let s = scenario::generate(kind, seed);
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::Input(format!("--out {}: cannot create: {e}", dir.display())))?;
    let fleet_path = dir.join("fleet.json");
    let trace_path = dir.join("trace.jsonl");
    let fleet_json = serde_json::to_string_pretty(&s.fleet)
        .map_err(|e| CliError::Input(format!("fleet: {e}")))?;
    for (path, text) in [
        (&fleet_path, format!("{fleet_json}\n")),
        (&trace_path, trace::to_jsonl(&s.trace)),
    ] {
        std::fs::write(path, text)
            .map_err(|e| CliError::Input(format!("{}: cannot write: {e}", path.display())))?;
    }
    let f = figures(&s.fleet, &s.trace);
    let cache = s
        .fleet
        .regions
        .iter()
        .map(|r| r.cache_tokens)
        .max()
        .unwrap_or(0);
    let clients: Vec<String> = f
        .per_client
        .iter()
        .map(|(c, n)| format!("{c} {n}"))
        .collect();
    Ok(format!(
        "scenario {name} ({}), seed {seed}\nwrote {} and {}\n\
         {} requests in {} sessions over {:.1} s; by client region: {}\n\
         mean prompt {:.0} tokens; prefix reuse {:.1} %; \
         working set {:.0}k tokens, {:.1}x the largest region cache\n\
         offered decode load {:.0} % of the fleet's slots; \
         prefill {:.0}-{:.0} % more (reused prefixes all cached - none)\n",
        kind.describe(),
        fleet_path.display(),
        trace_path.display(),
        f.requests,
        f.sessions,
        f.span_s,
        clients.join(", "),
        f.mean_prompt_tokens,
        100.0 * f.prefix_reuse,
        f.working_set_tokens as f64 / 1000.0,
        f.working_set_tokens as f64 / cache.max(1) as f64,
        100.0 * f.offered_load,
        100.0 * f.prefill_load.0,
        100.0 * f.prefill_load.1,
    ))
}
