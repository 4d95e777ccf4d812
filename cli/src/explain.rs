//! `explain`: the routing decision for one request, with every term. Drives
//! the router filter's own state machine (`router::RouterStream`, what the
//! .wasm runs) over files instead of Envoy: the plugin configuration, a
//! fleet snapshot, the request body, and optionally earlier requests
//! replayed into an in-memory prefix directory. No routing logic of its
//! own: it hands the stream what Envoy would and prints what comes back.

use crate::{read, CliError};
use llm_geo_router::config::Config;
use llm_geo_router::decision::cost::{Cost, Decision};
use llm_geo_router::decision::migration::{KvAction, MigrationAction};
use llm_geo_router::decision::pipeline::{Routed, Router};
use llm_geo_router::fleet::snapshot::Snapshot;
use llm_geo_router::fleet::view::View;
use llm_geo_router::request::openai::{self, Endpoint};
use llm_geo_router::request::prefix::PromptHasher;
use llm_geo_router::roots::router::{RouterShared, RouterStream};
use llm_geo_router::shared::flow::Flow;
use llm_geo_router::shared::host_api::{Effects, Recorder};
use llm_geo_router::shared::names::{Global, RegionStat, Stat, SNAPSHOT_KEY};
use llm_geo_router::shared::store::{MemoryStore, SharedStore};
use serde_json::{json, Value};
use std::path::Path;
use std::rc::Rc;

pub const SUMMARY: &str = "the routing decision for one request, with every cost term";

pub const ABOUT: &str = "\
The routing decision for one request, with every cost term.

Runs the router filter's own state machine on one request and prints the
decision: per region whether it is a candidate, healthy and over its
bounded-load share, the tokens it is believed to hold, and the rtt, prefill
and queue terms of its expected time to first token; then the chosen region,
the reason, the runner-up, the migration action and the shared-data calls
made. The prefix directory and the session records are in memory: empty,
unless --history replays earlier requests into them.";

pub const AFTER: &str = "\
Exit status: 0 routed (or sent to default_region uninterpreted); 1 the router
would answer 400 (invalid body, unknown residency), and the OpenAI error body
it would send is printed; 2 a wrong option, or a file that cannot be read or
is invalid (the message names it).";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The plugin's JSON configuration (the `configuration` string)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs"
    )]
    config: String,
    /// A fleet snapshot as the probe publishes it (shared-data key
    /// llm_geo_router.snapshot)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs",
        long_help = "A fleet snapshot as the probe publishes it (shared-data key\n\
                     llm_geo_router.snapshot). Its freshness is NOT checked: it is used\n\
                     whatever its generated_ms and probe.snapshot_max_age_ms say, where\n\
                     the filter would ignore a stale one and fall back to the nearest\n\
                     region."
    )]
    snapshot: String,
    /// The request body, bytes as sent
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Inputs"
    )]
    request: String,
    /// Request path, POST assumed; another path is not interpreted: it goes
    /// to default_region
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "P",
        default_value = "/v1/chat/completions",
        help_heading = "Request"
    )]
    path: String,
    /// Value of the session header (headers.session); else the body's `user`
    #[arg(verbatim_doc_comment, long, value_name = "S", help_heading = "Request")]
    session: Option<String>,
    /// Value of the residency header; refused unless the configuration sets
    /// residency.header
    #[arg(verbatim_doc_comment, long, value_name = "R", help_heading = "Request")]
    residency: Option<String>,
    /// This Envoy's in-flight requests per region, e.g. near=3,mid=1
    /// (default 0)
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "LIST",
        help_heading = "Request",
        long_help = "This Envoy's in-flight requests per region, e.g. near=3,mid=1\n\
                     (default 0); occupancy is the snapshot's waiting + running plus\n\
                     this minus the region's inflight_at_scrape"
    )]
    inflight: Option<String>,
    /// JSON array of earlier requests, replayed in order into the directory
    #[arg(
        verbatim_doc_comment,
        long,
        value_name = "FILE",
        help_heading = "Directory",
        long_help = "JSON array of earlier requests, replayed in order:\n  \
                     [{\"body\": {...} | \"file.json\", \"region\": \"mid\",\n    \
                     \"at_ms\": 1700000000000, \"session\": \"s1\"}]\n\
                     a body file is relative to the history file's directory;\n\
                     `session` is optional (else the body's `user`). Each entry is\n\
                     recorded for its region as the router records the region it\n\
                     chose. at_ms: > 0, not decreasing."
    )]
    history: Option<String>,
    /// The request's time, ms since the Unix epoch (default: the later of the
    /// snapshot's generated_ms and the last at_ms)
    #[arg(verbatim_doc_comment, long, value_name = "T", value_parser = crate::args::whole::<u64>,
          help_heading = "Directory")]
    now_ms: Option<u64>,
    /// One JSON object instead of a table
    #[arg(verbatim_doc_comment, long, help_heading = "Output")]
    json: bool,
}

pub fn run(a: Args) -> Result<String, CliError> {
    let config_path = a.config.as_str();
    let cfg = Config::parse(&read("config", config_path)?)
        .map_err(|e| CliError::Input(format!("--config {config_path}: {e}")))?;
    let snapshot_path = a.snapshot.as_str();
    let snapshot = Snapshot::decode(&read("snapshot", snapshot_path)?)
        .map_err(|e| CliError::Input(format!("--snapshot {snapshot_path}: {e}")))?;
    let body = read("request", &a.request)?;
    let inflight = inflight(&cfg, a.inflight.as_deref())?;
    let residency = match a.residency.as_deref() {
        Some(_) if cfg.residency.header.is_none() => {
            return Err(CliError::Usage(
                "--residency: the configuration sets no residency.header, so the \
                 router never reads a residency"
                    .into(),
            ))
        }
        other => other,
    };
    let history = match a.history.as_deref() {
        Some(file) => History::load(&cfg, Path::new(file))?,
        None => History::default(),
    };
    let last_at = history.entries.last().map_or(0, |e| e.at_ms);
    let now_ms = match a.now_ms {
        Some(t) if t < last_at => {
            return Err(CliError::Usage(format!(
                "--now-ms {t} is before the history's last at_ms ({last_at})"
            )))
        }
        Some(t) => t,
        None => snapshot.generated_ms.max(last_at),
    };
    let json_out = a.json;

    let req_path = a.path.as_str();
    // The filter's own state machine, with the snapshot used whatever its
    // age (the --snapshot file is the state to explain, not a live one).
    let mut cfg = cfg;
    cfg.probe.snapshot_max_age_ms = u32::MAX;
    let shared = RouterShared::new(Rc::new(cfg));
    let cfg = &*shared.cfg;
    let mut host = Recorder {
        now_ms,
        ..Recorder::default()
    };
    let endpoint = openai::endpoint("POST", req_path);
    if let Some(endpoint) = endpoint {
        history.replay(cfg, &shared.router, endpoint, &mut host.store)?;
    }
    let snapshot_index: Vec<Option<usize>> = cfg
        .regions
        .iter()
        .map(|r| snapshot.regions.iter().position(|s| s.name == r.name))
        .collect();
    let session = endpoint.and_then(|endpoint| {
        session_record(
            cfg,
            &shared.router,
            &mut host.store,
            a.session.as_deref(),
            endpoint,
            &body,
            now_ms,
        )
    });
    // What the probe would have published, and this Envoy's in-flight counts.
    let _ = host.store.set(SNAPSHOT_KEY, &snapshot.encode(), None);
    host.set_gauge(
        Stat::Global(Global::ProbeSnapshotVersion),
        snapshot.version.max(1),
    );
    for (i, n) in inflight.iter().enumerate() {
        host.set_gauge(Stat::Region(i, RegionStat::RqActive), n.round() as u64);
    }
    let mut headers = vec![(":method", "POST"), (":path", req_path)];
    if let Some(s) = a.session.as_deref() {
        headers.push((cfg.headers.session.as_str(), s));
    }
    if let (Some(name), Some(value)) = (&cfg.residency.header, residency) {
        headers.push((name.as_str(), value));
    }
    host.request(&headers);
    let mut stream = RouterStream::new();
    if let Flow::Reply(r) = stream.on_whole_request(&shared, &mut host, &mut View::new(), &body) {
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        let what = match v.pointer("/error/code").and_then(Value::as_str) {
            Some("invalid_residency") => "residency value not in residency.allowed",
            _ => "invalid request body",
        };
        return Err(CliError::Refused {
            output: format!("{}\n", String::from_utf8_lossy(&r.body)),
            message: format!("the router would answer {} ({what})", r.status),
        });
    }
    let Some(routed) = stream.decision() else {
        let why = match endpoint {
            None => format!("POST {req_path} is not an inference path"),
            Some(_) if host.value(Stat::Global(Global::RouterInvalidRequest)) > 0 => {
                let hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed);
                let message = endpoint
                    .and_then(|e| openai::parse(e, &body, hasher).err())
                    .map_or_else(String::new, |e| e.message);
                format!(
                    "invalid request passed through (invalid_requests = pass_through): {message}"
                )
            }
            Some(_) => "the body's first non-blank byte is not `{`".to_string(),
        };
        return Ok(Uninterpreted { why }.render(cfg, json_out));
    };
    let report = Report {
        cfg,
        snapshot: &snapshot,
        snapshot_index: &snapshot_index,
        routed,
        session,
        req_path,
        now_ms,
        replayed: history.entries.len(),
    };
    Ok(if json_out {
        report.json()
    } else {
        report.table()
    })
}

/// The session key the router will use (the header, else the body's
/// `user`) and what its record says before this request; a read of the
/// in-memory store, so it is not among the decision's shared-data calls.
fn session_record(
    cfg: &Config,
    router: &Router,
    store: &mut MemoryStore,
    header: Option<&str>,
    endpoint: Endpoint,
    body: &[u8],
    now_ms: u64,
) -> Option<Session> {
    let key = match header {
        Some(h) => h.to_string(),
        None => {
            let hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed);
            openai::parse(endpoint, body, hasher).ok()?.user?
        }
    };
    let last = router.sessions.lookup(store, &key, now_ms).last;
    Some(Session { key, last })
}

struct Session {
    key: String,
    /// The region that served its previous request, and when.
    last: Option<(usize, u64)>,
}

/// `near=3,mid=1` → per configured region; unnamed regions are 0.
fn inflight(cfg: &Config, raw: Option<&str>) -> Result<Vec<f64>, CliError> {
    let mut out = vec![0.0; cfg.regions.len()];
    let mut given = vec![false; cfg.regions.len()];
    let Some(raw) = raw else {
        return Ok(out);
    };
    let bad = |what: String| CliError::Usage(format!("--inflight {raw:?}: {what}"));
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((name, count)) = item.split_once('=') else {
            return Err(bad(format!("{item:?} is not region=count")));
        };
        let name = name.trim();
        let Some(i) = cfg.regions.iter().position(|r| r.name == name) else {
            return Err(bad(format!("{name:?} is not a configured region")));
        };
        let n = count
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
            .ok_or_else(|| bad(format!("{count:?} for {name} is not a number >= 0")))?;
        if given.get(i).copied().unwrap_or(false) {
            return Err(bad(format!("{name} is given more than once")));
        }
        if let (Some(slot), Some(g)) = (out.get_mut(i), given.get_mut(i)) {
            *slot = n;
            *g = true;
        }
    }
    Ok(out)
}

/// Earlier requests to replay into the directory and the session records.
#[derive(Default)]
struct History {
    file: String,
    entries: Vec<Past>,
}

struct Past {
    body: Vec<u8>,
    region: usize,
    at_ms: u64,
    session: Option<String>,
}

impl History {
    fn load(cfg: &Config, path: &Path) -> Result<History, CliError> {
        let file = path.display().to_string();
        let bytes = read("history", &file)?;
        let fail = |what: String| CliError::Input(format!("--history {file}: {what}"));
        let value: Value =
            serde_json::from_slice(&bytes).map_err(|e| fail(format!("is not valid JSON: {e}")))?;
        let Value::Array(items) = value else {
            return Err(fail(
                "must be a JSON array of {\"body\", \"region\", \"at_ms\"} objects".into(),
            ));
        };
        let base = path.parent().unwrap_or(Path::new("."));
        let mut entries: Vec<Past> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let at = |what: String| fail(format!("[{i}]: {what}"));
            let Value::Object(obj) = item else {
                return Err(at("must be an object with body, region and at_ms".into()));
            };
            if let Some(k) = obj
                .keys()
                .find(|k| !matches!(k.as_str(), "body" | "region" | "at_ms" | "session"))
            {
                return Err(at(format!(
                    "unknown field {k:?}; expected body, region, at_ms, session"
                )));
            }
            let body = match obj.get("body") {
                Some(Value::String(name)) => {
                    let body_path = base.join(name);
                    std::fs::read(&body_path).map_err(|e| {
                        at(format!("body {}: cannot read: {e}", body_path.display()))
                    })?
                }
                Some(b @ Value::Object(_)) => b.to_string().into_bytes(),
                _ => {
                    return Err(at(
                        "body must be a request object or the name of a file holding one".into(),
                    ))
                }
            };
            let region = match obj.get("region") {
                Some(Value::String(name)) => cfg
                    .regions
                    .iter()
                    .position(|r| &r.name == name)
                    .ok_or_else(|| at(format!("region {name:?} is not a configured region")))?,
                _ => return Err(at("region must be the name of a configured region".into())),
            };
            let at_ms = obj
                .get("at_ms")
                .and_then(Value::as_u64)
                .filter(|t| *t > 0)
                // The directory treats a zero stamp as "never served".
                .ok_or_else(|| at("at_ms must be a whole number of ms > 0".into()))?;
            if let Some(prev) = entries.last().filter(|p| p.at_ms > at_ms) {
                return Err(at(format!(
                    "at_ms {at_ms} is before the previous entry's ({})",
                    prev.at_ms
                )));
            }
            let session = match obj.get("session") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err(at("session must be a string".into())),
            };
            entries.push(Past {
                body,
                region,
                at_ms,
                session,
            });
        }
        Ok(History { file, entries })
    }

    /// Records each entry as the router records the region it chose: the
    /// directory lookup then record, and the session record.
    fn replay(
        &self,
        cfg: &Config,
        router: &Router,
        endpoint: Endpoint,
        store: &mut MemoryStore,
    ) -> Result<(), CliError> {
        for (i, past) in self.entries.iter().enumerate() {
            let hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed);
            let req = openai::parse(endpoint, &past.body, hasher).map_err(|e| {
                CliError::Input(format!(
                    "--history {}: [{i}]: body is not a valid request: {}",
                    self.file, e.message
                ))
            })?;
            let checkpoints = &req.prompt.checkpoints;
            let prefix = (req.prompt.blocks, req.prompt.last_block.unwrap_or(0));
            let mut lookup = router.dir.lookup(store, checkpoints, past.at_ms);
            router.dir.record(
                store,
                &mut lookup,
                checkpoints,
                past.region,
                past.at_ms,
                prefix,
            );
            if let Some(key) = past.session.as_deref().or(req.user.as_deref()) {
                let entry = router.sessions.lookup(store, key, past.at_ms);
                router
                    .sessions
                    .record(store, entry, past.region, past.at_ms, prefix);
            }
        }
        Ok(())
    }
}

/// A request the router does not route by cost: it goes to `default_region`.
struct Uninterpreted {
    why: String,
}

impl Uninterpreted {
    fn render(&self, cfg: &Config, json_out: bool) -> String {
        let name = cfg
            .regions
            .get(cfg.default_region_index())
            .map_or("?", |r| r.name.as_str());
        // The decision header the filter sends for these; it sets no filter state.
        let decision = format!("region={name}; reason=default");
        if json_out {
            let v = json!({
                "region": name,
                "reason": "default",
                "why": self.why,
                "decision": decision,
            });
            return format!("{v}\n");
        }
        format!(
            "chosen     {name} (default_region, untouched)\nreason     default: {}\ndecision   {decision}\n",
            self.why
        )
    }
}

struct Report<'a> {
    cfg: &'a Config,
    snapshot: &'a Snapshot,
    snapshot_index: &'a [Option<usize>],
    routed: &'a Routed,
    session: Option<Session>,
    req_path: &'a str,
    now_ms: u64,
    replayed: usize,
}

impl Report<'_> {
    fn name(&self, i: usize) -> &str {
        self.cfg.regions.get(i).map_or("?", |r| r.name.as_str())
    }

    fn decision(&self) -> &Decision {
        &self.routed.decision
    }

    fn cost(&self, i: usize) -> Option<&Cost> {
        self.decision().costs.get(i)
    }

    /// Configured regions the snapshot does not report on: the core assumes
    /// them healthy with their configured figures.
    fn unreported(&self) -> Vec<&str> {
        self.snapshot_index
            .iter()
            .enumerate()
            .filter(|(_, j)| j.is_none())
            .map(|(i, _)| self.name(i))
            .collect()
    }

    fn describe(&self) -> String {
        self.routed.describe(self.cfg, self.snapshot.level)
    }

    fn json(&self) -> String {
        let d = self.decision();
        let regions: Vec<Value> = self
            .cfg
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let c = self.cost(i).copied().unwrap_or_default();
                json!({
                    "name": r.name,
                    "in_snapshot": self.snapshot_index.get(i).copied().flatten().is_some(),
                    "candidate": c.candidate,
                    "healthy": c.healthy,
                    "over_bound": c.over_bound,
                    "cached_tokens": c.cached_tokens,
                    "occupancy": c.occupancy,
                    "rtt_ms": c.rtt_ms,
                    "prefill_ms": c.prefill_ms,
                    "wait_ms": c.queue_ms - c.load_ms,
                    "load_ms": c.load_ms,
                    "footprint_ms": c.footprint_ms,
                    "total_ms": c.total_ms,
                })
            })
            .collect();
        let migration = self.routed.kv.as_ref().map(|kv| {
            json!({
                "action": action_name(kv),
                "from": self.name(kv.from),
                "tokens": kv.tokens,
                // Non-finite (saturated queue) becomes null.
                "fetch_ms": kv.plan.fetch_ms,
                "recompute_ms": kv.plan.recompute_ms,
                "header": kv.header_value(self.name(kv.from)),
            })
        });
        let v = json!({
            "path": self.req_path,
            "now_ms": self.now_ms,
            "snapshot_version": self.snapshot.version,
            "level": self.snapshot.level,
            "history_replayed": self.replayed,
            "prompt_tokens": self.routed.prompt_tokens,
            "stream": self.routed.stream,
            "regions": regions,
            "region": self.name(d.region),
            "reason": d.reason.as_str(),
            "runner_up": d.runner_up.map(|i| self.name(i)),
            "passed_over": d.passed_over.map(|p| json!({
                "region": self.name(p.region),
                "wait_ms": p.wait_ms,
                "move_ms": p.move_ms,
            })),
            "session": self.session.as_ref().map(|s| json!({
                "key": s.key,
                "last_region": s.last.map(|(r, _)| self.name(r)),
                "last_at_ms": s.last.map(|(_, t)| t),
            })),
            "migration": migration,
            "shared_data_calls": self.routed.shared_data_calls,
            "decision": self.describe(),
        });
        format!("{v}\n")
    }

    fn table(&self) -> String {
        let d = self.decision();
        let mut out = format!(
            "request    POST {}: {} prompt tokens (estimated), stream={}\n\
             snapshot   version {}, level {}\n\
             directory  {} earlier request(s) replayed; now_ms={}\n",
            self.req_path,
            self.routed.prompt_tokens,
            self.routed.stream,
            self.snapshot.version,
            self.snapshot.level,
            self.replayed,
            self.now_ms,
        );
        if let Some(s) = &self.session {
            let last = match s.last {
                Some((r, t)) => format!(
                    "last served by {} at {t} ms; credited there with the previous prompt when this one extends it",
                    self.name(r)
                ),
                None => "no record".into(),
            };
            out.push_str(&format!("session    {:?}: {last}\n", s.key));
        }
        let unreported = self.unreported();
        if !unreported.is_empty() {
            out.push_str(&format!(
                "note       not in the snapshot, assumed healthy with configured figures: {}\n",
                unreported.join(", ")
            ));
        }
        out.push('\n');
        let header = [
            "region",
            "candidate",
            "healthy",
            "over_bound",
            "cached_tokens",
            "occupancy",
            "rtt_ms",
            "prefill_ms",
            "wait_ms",
            "load_ms",
            "footprint_ms",
            "total_ms",
        ];
        let yes = |b: bool| if b { "yes" } else { "no" }.to_string();
        let mut rows: Vec<[String; 12]> = vec![header.map(str::to_string)];
        for (i, r) in self.cfg.regions.iter().enumerate() {
            let marker = if i == d.region { "*" } else { " " };
            let name = format!("{marker}{}", r.name);
            rows.push(match self.cost(i) {
                Some(c) => [
                    name,
                    yes(c.candidate),
                    yes(c.healthy),
                    yes(c.over_bound),
                    c.cached_tokens.to_string(),
                    format!("{:.1}", c.occupancy),
                    format!("{:.1}", c.rtt_ms),
                    format!("{:.1}", c.prefill_ms),
                    format!("{:.1}", c.queue_ms - c.load_ms),
                    format!("{:.1}", c.load_ms),
                    format!("{:.1}", c.footprint_ms),
                    format!("{:.1}", c.total_ms),
                ],
                None => std::array::from_fn(|k| if k == 0 { name.clone() } else { "-".into() }),
            });
        }
        let mut widths = [0usize; 12];
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.len());
            }
        }
        for row in &rows {
            let mut line = String::new();
            for (k, (cell, w)) in row.iter().zip(widths).enumerate() {
                if k == 0 {
                    line.push_str(&format!("{cell:<w$}"));
                } else {
                    line.push_str(&format!("  {cell:>w$}"));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.push('\n');
        let chosen_total = self.cost(d.region).map(|c| c.total_ms);
        out.push_str(&format!("chosen     {}", self.name(d.region)));
        if let Some(t) = chosen_total {
            out.push_str(&format!(" (expected ttft {t:.1} ms)"));
        }
        out.push('\n');
        out.push_str(&format!("reason     {}\n", d.reason.as_str()));
        let runner_up = match d.runner_up.and_then(|i| self.cost(i).map(|c| (i, c))) {
            Some((i, c)) => {
                let behind =
                    chosen_total.map_or(String::new(), |t| format!(", {:+.1} ms", c.total_ms - t));
                format!(
                    "{} (expected ttft {:.1} ms{behind})",
                    self.name(i),
                    c.total_ms
                )
            }
            None => "none".to_string(),
        };
        out.push_str(&format!("runner-up  {runner_up}\n"));
        if let Some(p) = d.passed_over {
            out.push_str(&format!(
                "passed     {} (its wait for a slot {:.1} ms against {:.1} ms to move)\n",
                self.name(p.region),
                p.wait_ms,
                p.move_ms
            ));
        }
        let migration = match &self.routed.kv {
            Some(kv) => {
                let fetch = kv
                    .plan
                    .fetch_ms
                    .map_or("impossible".to_string(), |f| format!("{f:.1} ms"));
                format!(
                    "{} {} tokens held by {} (fetch {fetch}, recompute {:.1} ms); {}: {}",
                    action_name(kv),
                    kv.tokens,
                    self.name(kv.from),
                    kv.plan.recompute_ms,
                    self.cfg.migration.header,
                    kv.header_value(self.name(kv.from))
                )
            }
            None if !self.cfg.migration.enabled => "none (migration.enabled is false)".into(),
            None => "none".into(),
        };
        out.push_str(&format!("migration  {migration}\n"));
        out.push_str(&format!(
            "shared-data calls  {}\n",
            self.routed.shared_data_calls
        ));
        out.push_str(&format!("decision   {}\n", self.describe()));
        out
    }
}

fn action_name(kv: &KvAction) -> &'static str {
    match kv.plan.action {
        MigrationAction::Fetch => "fetch",
        MigrationAction::Recompute => "recompute",
    }
}
