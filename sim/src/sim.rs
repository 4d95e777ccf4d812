//! The discrete-event simulation of one policy over one trace: client
//! regions send the trace's requests, the policy routes them, they cross
//! half a round trip to the region's engine (the emulator's model: FIFO
//! scheduler, prefix cache, prefill/decode timing), and the first token and
//! the end of the stream cross half a round trip back.
//!
//! TTFT = arrival at the client of the first token − the trace's `t_ms`:
//! `rtt/2 + queueing + prefill of uncached tokens + rtt/2`. The end of the
//! stream comes `(output_tokens − 1) × decode_ms_per_token` after the first
//! token, as the emulator streams it. An engine in an outage refuses new
//! requests (the client learns it half a round trip later), drops the ones
//! it holds, fails its health checks, and comes back with an empty cache.
//!
//! A baseline runs as its `Deployment` says (`deploy`). A router in another
//! region than its client (`global:<region>`) puts itself on the path both
//! ways: `rtt` above is then the client's round trip to the router's region
//! plus that region's round trip to the engine's (`Topology::region_rtt`), the
//! router decides when the request reaches it, and it counts a request out
//! when the end of the answer passes it.

use crate::deploy::{self, Deployment};
use crate::events::EventQueue;
use crate::geo::{self, Callout, Envoy, Handled, Source, To};
use crate::llmd;
use crate::policy::{Ask, Baseline, PolicyName, View};
use crate::rng::Rng;
use crate::topology::Topology;
use crate::trace::{self, mix};
use crate::workload::Workload;
use engine_emulator::config::Mode as EngineMode;
use engine_emulator::metrics as exposition;
use engine_emulator::model::{Admission, Engine, EngineConfig, Timing, DEFAULT_BLOCK_TOKENS};
use engine_emulator::openai::{self, Kind};
use llm_geo_router::shared::host_api::Answer;
use serde_json::{json, Value};
use std::collections::BTreeSet;

/// The plugin's clock is Unix milliseconds; the trace's 0 is this instant.
pub const EPOCH_MS: u64 = 1_700_000_000_000;

/// Consecutive health check results before the baselines' view of a region
/// changes (Envoy's `unhealthy_threshold` / `healthy_threshold`, set like the
/// plugin's probe defaults).
const HC_UNHEALTHY_AFTER: i64 = 2;
const HC_HEALTHY_AFTER: i64 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Completed,
    /// Shed by the guard (429).
    Shed,
    /// Refused by the guard for its prompt length (413).
    TooLong,
    /// Refused or dropped by an engine in an outage, or refused by the router.
    Failed,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub status: Status,
    pub region: Option<usize>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Prompt tokens and cached tokens at admission (zero if never admitted).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The guard clamped `max_tokens`.
    pub clamped: bool,
    /// Geo-router: the decision's reason (`cost::Reason::as_str`).
    pub reason: Option<&'static str>,
    /// Time from reaching the engine to getting a slot.
    pub queued_ms: Option<f64>,
    /// Geo-router: the queue wait it predicted (unweighted), ms.
    pub predicted_queue_ms: Option<f64>,
    /// Geo-router: which of its client region's Envoys handled it (0 with
    /// one Envoy per client region).
    pub proxy: Option<usize>,
}

/// One policy's run.
#[derive(Debug, Clone)]
pub struct Run {
    pub policy: PolicyName,
    /// How the policy was deployed (the geo-router: always per client region).
    pub deployment: Deployment,
    pub records: Vec<Record>,
    /// (time, region) of every prefill start.
    pub starts: Vec<(f64, usize)>,
    /// Per client region: (time, ladder level) at each probe tick
    /// (geo-router; with several Envoys per client region, its first one's).
    pub levels: Vec<Vec<(f64, u8)>>,
    /// Geo-router: Envoys per client region (`run_with`); 1 for a baseline.
    pub proxies: usize,
    /// Geo-router: where it read the regions' load from.
    pub source: Option<Source>,
    /// Geo-router: its Envoys shared what they learnt (`Options::exchange`).
    pub exchange: bool,
    /// Per region: slot time used (ms) within `window_ms`.
    pub busy_ms: Vec<f64>,
    /// The middle half of the trace's span, where utilisation is measured
    /// (away from the ramp-up and the drain).
    pub window_ms: (f64, f64),
    /// Per region: (requests at the engine, running and waiting; of them
    /// waiting) every `SAMPLE_MS` within `window_ms`.
    pub occupancy: Vec<Vec<(u32, u32)>>,
    /// When the last request resolved.
    pub end_ms: f64,
    /// Geo-router: decisions per reason (`cost::Reason::as_str`).
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Geo-router: what its probes sent.
    pub probe: Option<ProbeLoad>,
}

/// The geo-router's probe load over a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeLoad {
    /// Envoys simulated (all client regions).
    pub envoys: usize,
    /// Metrics callouts their probes sent (every region's engine).
    pub scrapes: u64,
    /// Queries their probes sent Prometheus.
    pub queries: u64,
    /// Time their probes ticked at the busy period, summed over Envoys (ms).
    pub fast_ms: f64,
}

impl Run {
    /// `geo-router`, or `<policy>@<deployment>` (`deploy::label`).
    pub fn label(&self) -> String {
        let l = deploy::label(self.policy, &self.deployment);
        if self.exchange {
            format!("{l}+exchange")
        } else {
            l
        }
    }
}

#[derive(Debug, Clone)]
enum Ev {
    /// A baseline's health checks.
    Tick,
    /// Envoy `proxy` of client region `client` (geo-router): its probe's
    /// tick, each Envoy on the period its probe set.
    ProbeTick {
        client: usize,
        proxy: usize,
    },
    /// A baseline scrapes the engines' queues (outside the oracle).
    Scrape,
    Arrive(usize),
    /// The request reaches a router away from its client (`global`).
    RouterArrive(usize),
    /// The end of the answer (or the refusal) passes the router.
    RouterHears {
        i: usize,
        ok: bool,
    },
    EngineArrive(usize),
    FirstToken(usize),
    EngineDone(usize),
    ClientFirstToken(usize),
    ClientDone(usize),
    ClientFail(usize),
    ProbeSample {
        client: usize,
        proxy: usize,
        callout: Callout,
    },
    ProbeDeliver {
        client: usize,
        proxy: usize,
        token: u32,
        answer: Box<Answer>,
    },
    /// An exchange message reaches Envoy `to` (client region, proxy) from
    /// `from`, which waits for its answer under `token`.
    PeerArrive {
        from: (usize, usize),
        to: (usize, usize),
        token: u32,
        body: Vec<u8>,
    },
    OutageStart(usize),
    OutageEnd(usize),
    /// Read every engine's occupancy (`Run::occupancy`).
    Sample,
    /// Prometheus scrapes replica `replica` of region `region`.
    PromScrape {
        region: usize,
        replica: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Pending,
    InTransit,
    Waiting,
    Running,
    /// The engine is done with it (finished, refused or dropped); the
    /// client has not heard yet.
    Leaving,
    Resolved,
}

#[derive(Debug, Clone)]
struct Live {
    stage: Stage,
    region: usize,
    /// The replica of the region its entry point sent it to.
    replica: usize,
    /// Round trip between the client and its router: 0 unless the router
    /// is in another region (`global`).
    to_router: f64,
    /// Round trip between the router and the engine (the client's own round
    /// trip to the engine when the router is at the client).
    to_engine: f64,
    /// The baseline instance that routed it; the geo-router: which of its
    /// client region's Envoys.
    router: usize,
    output_tokens: u32,
    started_at: f64,
    reached_at: f64,
}

/// One engine replica.
struct Station {
    engine: Engine,
    config: EngineConfig,
    /// Requests the engine holds (waiting or running): what its entry
    /// point counts as its active requests.
    held: BTreeSet<usize>,
    /// Prompt tokens (as the segments count them) of the requests in its
    /// waiting queue: what a scrape reads.
    waiting_tokens: u64,
    /// When its serving process started (sim ms; before the trace for
    /// the engines running when it starts), as its `/metrics` says.
    started_ms: f64,
}

/// The engines a trace starts with have served for an hour.
const STARTED_BEFORE_MS: f64 = -3_600_000.0;

#[derive(Debug, Clone, Copy)]
struct HealthCheck {
    healthy: bool,
    streak: i64,
}

impl HealthCheck {
    fn observe(&mut self, ok: bool) {
        if ok {
            self.streak = self.streak.max(0) + 1;
            if self.streak >= HC_HEALTHY_AFTER {
                self.healthy = true;
            }
        } else {
            self.streak = self.streak.min(0) - 1;
            if -self.streak >= HC_UNHEALTHY_AFTER {
                self.healthy = false;
            }
        }
    }
}

enum Mode {
    /// Per client region, its Envoys (`Sim::proxies` of them).
    Geo(Vec<Vec<Envoy>>),
    Base(Peers),
}

/// A baseline as deployed: one instance (oracle, global) or one per client
/// region.
struct Peers {
    deployment: Deployment,
    /// `global`: the router's region.
    router_region: Option<usize>,
    instances: Vec<Peer>,
    /// Outside the oracle, what the baseline reads from the engines is a
    /// scrape every this many ms: GORGO's queued tokens at the plugin's
    /// `probe.tick_ms`, llm-d's waiting queues and KV usage at its own
    /// refresh interval (`llmd::REFRESH_MS`).
    scrape_ms: Option<f64>,
}

/// One baseline router: its state (counter, prefix tree) and its own count
/// of the requests it routed and has not seen end, per region.
struct Peer {
    baseline: Baseline,
    outstanding: Vec<u64>,
}

impl Peers {
    /// The instance that routes a request from client region `client`.
    fn instance(&self, client: usize) -> usize {
        match self.deployment {
            Deployment::PerClientRegion => client,
            Deployment::Oracle | Deployment::Global(_) => 0,
        }
    }
}

/// What one replica's `/metrics` showed when Prometheus scraped it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Figures {
    at_ms: f64,
    running: usize,
    waiting: usize,
    kv: f64,
    query_tokens: u64,
    hit_tokens: u64,
    completed: u64,
    generated: u64,
}

impl Figures {
    fn of(s: &Station, at_ms: f64) -> Figures {
        Figures {
            at_ms,
            running: s.engine.scheduler.running(),
            waiting: s.engine.scheduler.waiting(),
            kv: s.engine.cache.usage(),
            query_tokens: s.engine.cache.query_tokens(),
            hit_tokens: s.engine.cache.hit_tokens(),
            completed: s.engine.completed(),
            generated: s.engine.generated(),
        }
    }
}

/// A Prometheus server scraping every replica of every region each
/// `interval_ms` (each at its own offset in the interval, as Prometheus
/// spreads its targets), answering the plugin's instant query from the
/// last scrape of each.
struct Prometheus {
    interval_ms: f64,
    /// Per region, per replica: its last scrape; `None` after a failed one
    /// (Prometheus marks the series stale: the query no longer sees them).
    last: Vec<Vec<Option<Figures>>>,
}

impl Prometheus {
    /// The instant query's answer at `now_ms`, as Prometheus evaluates the
    /// plugin's query (`llm_geo_router::engines::promql::fleet_query`): per region
    /// with at least one live series, each signal's aggregate over its
    /// replicas, labelled `llm_geo_region` and `llm_geo_signal`.
    fn answer(&self, names: &[String], now_ms: f64) -> Vec<u8> {
        let secs = |ms: f64| format!("{:.3}", core_ms(ms) as f64 / 1000.0);
        let eval = core_ms(now_ms) as f64 / 1000.0;
        let mut result = Vec::new();
        for (name, replicas) in names.iter().zip(&self.last) {
            let seen: Vec<&Figures> = replicas.iter().flatten().collect();
            if seen.is_empty() {
                continue;
            }
            let n = seen.len() as f64;
            let sum = |f: fn(&Figures) -> f64| seen.iter().map(|x| f(x)).sum::<f64>();
            let oldest = seen.iter().map(|x| x.at_ms).fold(f64::INFINITY, f64::min);
            for (signal, value) in [
                ("waiting", sum(|x| x.waiting as f64).to_string()),
                ("running", sum(|x| x.running as f64).to_string()),
                ("kv", (sum(|x| x.kv) / n).to_string()),
                ("replicas", n.to_string()),
                ("completed", sum(|x| x.completed as f64).to_string()),
                ("prefix_queries", sum(|x| x.query_tokens as f64).to_string()),
                ("prefix_hits", sum(|x| x.hit_tokens as f64).to_string()),
                ("generation", sum(|x| x.generated as f64).to_string()),
                ("scraped", secs(oldest)),
            ] {
                result.push(json!({
                    "metric": {"llm_geo_region": name, "llm_geo_signal": signal},
                    "value": [eval, value],
                }));
            }
        }
        json!({"status": "success", "data": {"resultType": "vector", "result": result}})
            .to_string()
            .into_bytes()
    }
}

/// How a run is set up beyond its policy and deployment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Geo-router: Envoys per client region (`run_with`).
    pub proxies: usize,
    /// Geo-router: where it reads the regions' load from.
    pub source: Source,
    /// Geo-router: every Envoy of the deployment (all client regions) in
    /// one exchange (`exchange.cluster`), messages delayed by the network.
    pub exchange: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            proxies: 1,
            source: Source::default(),
            exchange: false,
        }
    }
}

/// Envoy's `LEAST_REQUEST` load balancer with its defaults (equal weights,
/// `choice_count` 2): two hosts drawn at random, with replacement, and the
/// one with fewer active requests taken (the first drawn on a tie). One
/// replica: no draw.
pub(crate) fn least_request(rng: &mut Rng, active: &[usize]) -> usize {
    if active.len() <= 1 {
        return 0;
    }
    let n = active.len() as u64;
    let mut pick = (rng.next_u64() % n) as usize;
    let other = (rng.next_u64() % n) as usize;
    if active.get(other) < active.get(pick) {
        pick = other;
    }
    pick
}

struct Sim<'a> {
    fleet: &'a Topology,
    work: &'a Workload,
    policy: PolicyName,
    /// As run (the geo-router: always per client region, or the oracle).
    deployment: Deployment,
    proxies: usize,
    exchange: bool,
    source: Source,
    q: EventQueue<Ev>,
    /// Per region, its engine replicas (one unless the fleet says more).
    stations: Vec<Vec<Station>>,
    /// Per region: not in an outage (all its replicas alike).
    up: Vec<bool>,
    /// Per region: its entry point's random draws (least request).
    balancer: Vec<Rng>,
    /// Geo-router with the `prometheus` source: what Prometheus holds.
    prometheus: Option<Prometheus>,
    live: Vec<Live>,
    records: Vec<Record>,
    mode: Mode,
    /// Prompt tokens routed to each region that have not started prefill
    /// (in transit or waiting): the oracle's exact view of the queues.
    queued_tokens: Vec<u64>,
    /// The requests those tokens are.
    queued_requests: Vec<u64>,
    /// The last scrape of each region's waiting requests and KV usage.
    scraped_waiting: Vec<u64>,
    scraped_kv: Vec<f64>,
    /// Per region: KV-cache blocks over its replicas.
    kv_blocks: Vec<u64>,
    /// The last scrape of each engine's `waiting_tokens`.
    scraped: Vec<u64>,
    health: Vec<HealthCheck>,
    names: Vec<String>,
    tick_ms: f64,
    unresolved: usize,
    starts: Vec<(f64, usize)>,
    levels: Vec<Vec<(f64, u8)>>,
    /// Geo-router: requests seen per client region, for the round robin
    /// over its Envoys.
    sent: Vec<u64>,
    busy_ms: Vec<f64>,
    window_ms: (f64, f64),
    occupancy: Vec<Vec<(u32, u32)>>,
    end_ms: f64,
    reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Geo-router: probe time spent at the busy period, summed over Envoys.
    probe_fast_ms: f64,
}

/// The period of `Run::occupancy`'s samples, ms of simulated time.
pub const SAMPLE_MS: f64 = 1000.0;

/// A region's KV-cache usage: the mean over its replicas, as a region-wide
/// figure is read (Prometheus' `kv`).
fn kv_usage(replicas: &[Station]) -> f64 {
    if replicas.is_empty() {
        return 0.0;
    }
    replicas.iter().map(|s| s.engine.cache.usage()).sum::<f64>() / replicas.len() as f64
}

fn core_ms(t: f64) -> u64 {
    EPOCH_MS + t.max(0.0).floor() as u64
}

/// Mean `output_tokens` of the trace: the plugin's `service_ms` is built from it.
pub fn mean_output_tokens(work: &Workload) -> f64 {
    let n = work.prepared.len().max(1) as f64;
    work.prepared
        .iter()
        .map(|p| f64::from(p.output_tokens))
        .sum::<f64>()
        / n
}

/// Runs `policy` over the workload on fresh engines, a baseline deployed as
/// `deployment` (the geo-router is always one Envoy per client region, and
/// ignores it). `overrides`: a partial plugin configuration for the
/// geo-router; its `probe.tick_ms` is also the scrape period of a deployed
/// (not oracle) GORGO.
pub fn run(
    fleet: &Topology,
    work: &Workload,
    policy: PolicyName,
    deployment: &Deployment,
    overrides: Option<&Value>,
) -> Result<Run, String> {
    run_with(fleet, work, policy, deployment, overrides, 1)
}

/// `run` with the geo-router deployed as `proxies` Envoys per client region
/// (gateway replicas behind an L7 load balancer): each its own plugin state
/// (directory, probe, in-flight counts) from the same configuration, all
/// created at 0 and ticking together. Request `n` of a client region
/// (counting from 0) goes to its Envoy `n mod proxies`. Baselines ignore
/// `proxies`.
pub fn run_with(
    fleet: &Topology,
    work: &Workload,
    policy: PolicyName,
    deployment: &Deployment,
    overrides: Option<&Value>,
    proxies: usize,
) -> Result<Run, String> {
    let options = Options {
        proxies,
        ..Options::default()
    };
    run_options(fleet, work, policy, deployment, overrides, options)
}

/// `run_with`, the geo-router reading the regions' load as
/// `options.source` says. A region of several replicas (the fleet's
/// `replicas`) is reached through one entry point that sends each request,
/// and each probe callout, to one of them by Envoy's least-request rule
/// (`least_request`); with the `prometheus` source a Prometheus server
/// scrapes every replica every `interval_ms` and answers the probe's query
/// from what it last scraped, one round trip from the client region's
/// nearest engine region away (where it, or the query front end, runs).
pub fn run_options(
    fleet: &Topology,
    work: &Workload,
    policy: PolicyName,
    deployment: &Deployment,
    overrides: Option<&Value>,
    options: Options,
) -> Result<Run, String> {
    let mut sim = Sim::new(fleet, work, policy, deployment, overrides, options)?;
    while let Some((now, ev)) = sim.q.pop() {
        sim.handle(now, ev)?;
    }
    Ok(sim.finish())
}

impl<'a> Sim<'a> {
    /// A run set up, its first events queued.
    fn new(
        fleet: &'a Topology,
        work: &'a Workload,
        policy: PolicyName,
        deployment: &Deployment,
        overrides: Option<&Value>,
        options: Options,
    ) -> Result<Sim<'a>, String> {
        let Options {
            proxies,
            source,
            exchange,
        } = options;
        if let Source::Prometheus { interval_ms } = source {
            if !(interval_ms.is_finite() && interval_ms >= 1.0) {
                return Err(format!(
                    "prometheus interval: {interval_ms} ms must be at least 1 ms"
                ));
            }
        }
        if proxies == 0 {
            return Err("proxies: must be at least 1".into());
        }
        let regions = fleet.regions.len();
        // The geo-router is always one Envoy per client region; asked for as
        // the oracle, it is given the engines' exact figures (`Knowledge::Exact`).
        let deployment = match policy {
            PolicyName::GeoRouter if *deployment == Deployment::Oracle => Deployment::Oracle,
            PolicyName::GeoRouter => Deployment::PerClientRegion,
            _ => deployment.clone(),
        };
        let knowledge = if deployment == Deployment::Oracle {
            geo::Knowledge::Exact
        } else {
            geo::Knowledge::Operator
        };
        let mode = match Baseline::new(policy, regions, 0) {
            Some(_) => {
                let count = match deployment {
                    Deployment::PerClientRegion => fleet.client_regions.len(),
                    Deployment::Oracle | Deployment::Global(_) => 1,
                };
                let mut instances = Vec::with_capacity(count);
                for k in 0..count {
                    // Instance k's draws: its own SplitMix64 sequence.
                    let seed = mix(0x6261_7365 ^ k as u64);
                    if let Some(baseline) = Baseline::new(policy, regions, seed) {
                        instances.push(Peer {
                            baseline,
                            outstanding: vec![0; regions],
                        });
                    }
                }
                let scrape_ms = match policy {
                    _ if deployment == Deployment::Oracle => None,
                    PolicyName::Gorgo => {
                        let cfg = geo::plugin_config(
                            fleet,
                            0,
                            geo::Knowledge::Operator,
                            mean_output_tokens(work),
                            Source::default(),
                            overrides,
                        )
                        .map_err(|e| format!("--config: {e}"))?;
                        Some(f64::from(cfg.probe.tick_ms).max(1.0))
                    }
                    PolicyName::LlmD => Some(llmd::REFRESH_MS),
                    _ => None,
                };
                Mode::Base(Peers {
                    router_region: deployment.router_region(fleet)?,
                    deployment: deployment.clone(),
                    instances,
                    scrape_ms,
                })
            }
            None => {
                let mean_out = mean_output_tokens(work);
                let mut envoys = Vec::new();
                for c in 0..fleet.client_regions.len() {
                    let mut replicas = Vec::with_capacity(proxies);
                    for p in 0..proxies {
                        let mut cfg =
                            geo::plugin_config(fleet, c, knowledge, mean_out, source, overrides)
                                .map_err(|e| format!("--config: {e}"))?;
                        if exchange {
                            cfg.exchange.cluster = Some(geo::PEERS_CLUSTER.into());
                        }
                        // Envoy (c, p)'s name in the exchange.
                        let seed =
                            ((c * proxies + p + 1) as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
                        let mut envoy = Envoy::new(cfg, core_ms(0.0), seed);
                        // Round robins start apart (the next Envoy first).
                        envoy.next_peer = c * proxies + p + 1;
                        replicas.push(envoy);
                    }
                    envoys.push(replicas);
                }
                Mode::Geo(envoys)
            }
        };
        let tick_ms = match &mode {
            Mode::Geo(e) => e
                .iter()
                .flatten()
                .next()
                .map_or(1000.0, |e| f64::from(e.cfg.probe.tick_ms)),
            Mode::Base(_) => 1000.0,
        }
        .max(1.0);
        let stations: Vec<Vec<Station>> = fleet
            .regions
            .iter()
            .map(|r| {
                let config = EngineConfig {
                    max_concurrency: r.max_concurrency as usize,
                    cache_tokens: usize::try_from(r.cache_tokens).unwrap_or(usize::MAX),
                    block_tokens: DEFAULT_BLOCK_TOKENS,
                    timing: Timing {
                        prefill_ms_per_token: r.prefill_ms_per_token,
                        decode_ms_per_token: r.decode_ms_per_token,
                        prefill_overhead_ms: r.prefill_overhead_ms,
                    },
                };
                (0..r.replicas.max(1))
                    .map(|_| Station {
                        engine: Engine::new(config),
                        config,
                        held: BTreeSet::new(),
                        waiting_tokens: 0,
                        started_ms: STARTED_BEFORE_MS,
                    })
                    .collect()
            })
            .collect();
        // Prometheus only where the geo-router reads it.
        let prometheus = match (source, &mode) {
            (Source::Prometheus { interval_ms }, Mode::Geo(_)) => Some(Prometheus {
                interval_ms,
                // Running long before the trace: the idle engines as of 0.
                last: stations
                    .iter()
                    .map(|r| r.iter().map(|s| Some(Figures::of(s, 0.0))).collect())
                    .collect(),
            }),
            _ => None,
        };
        let kv_blocks = stations
            .iter()
            .map(|r| {
                r.iter()
                    .map(|s| {
                        (s.engine.cache.capacity_tokens() / s.engine.cache.block_tokens().max(1))
                            as u64
                    })
                    .sum()
            })
            .collect();
        let n = work.requests.len();
        let mut sim = Sim {
            fleet,
            work,
            policy,
            deployment: deployment.clone(),
            proxies,
            exchange,
            source,
            q: EventQueue::default(),
            stations,
            up: vec![true; regions],
            balancer: (0..regions)
                .map(|r| Rng::new(mix(0x6c62_272e_07bb_0142 ^ r as u64)))
                .collect(),
            prometheus,
            live: vec![
                Live {
                    stage: Stage::Pending,
                    region: 0,
                    replica: 0,
                    to_router: 0.0,
                    to_engine: 0.0,
                    router: 0,
                    output_tokens: 0,
                    started_at: 0.0,
                    reached_at: 0.0,
                };
                n
            ],
            records: vec![
                Record {
                    status: Status::Failed,
                    region: None,
                    ttft_ms: None,
                    e2e_ms: None,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    clamped: false,
                    reason: None,
                    queued_ms: None,
                    predicted_queue_ms: None,
                    proxy: None,
                };
                n
            ],
            mode,
            queued_tokens: vec![0; regions],
            queued_requests: vec![0; regions],
            scraped: vec![0; regions],
            scraped_waiting: vec![0; regions],
            scraped_kv: vec![0.0; regions],
            kv_blocks,
            health: vec![
                HealthCheck {
                    healthy: true,
                    streak: 0
                };
                regions
            ],
            names: fleet.regions.iter().map(|r| r.name.clone()).collect(),
            tick_ms,
            unresolved: n,
            starts: Vec::new(),
            levels: vec![Vec::new(); fleet.client_regions.len()],
            sent: vec![0; fleet.client_regions.len()],
            busy_ms: vec![0.0; regions],
            window_ms: {
                let span = work.requests.last().map_or(0.0, |r| r.t_ms);
                (0.25 * span, 0.75 * span)
            },
            occupancy: vec![Vec::new(); regions],
            end_ms: 0.0,
            reasons: std::collections::BTreeMap::new(),
            probe_fast_ms: 0.0,
        };
        match &sim.mode {
            Mode::Geo(envoys) => {
                for (client, replicas) in envoys.iter().enumerate() {
                    for proxy in 0..replicas.len() {
                        sim.q.push(0.0, Ev::ProbeTick { client, proxy });
                    }
                }
            }
            Mode::Base(_) => sim.q.push(0.0, Ev::Tick),
        }
        if matches!(&sim.mode, Mode::Base(p) if p.scrape_ms.is_some()) {
            sim.q.push(0.0, Ev::Scrape);
        }
        // Prometheus' scrapes: each replica at its own offset in the interval,
        // from a hash of the target as Prometheus spreads them.
        if let Some(p) = &sim.prometheus {
            let every = p.interval_ms;
            for (region, r) in sim.stations.iter().enumerate() {
                for replica in 0..r.len() {
                    let h = mix(0x7072_6f6d ^ ((region as u64) << 16) ^ replica as u64);
                    let offset = (h >> 11) as f64 / (1u64 << 53) as f64 * every;
                    sim.q.push(offset, Ev::PromScrape { region, replica });
                }
            }
        }
        for (i, r) in work.requests.iter().enumerate() {
            sim.q.push(r.t_ms, Ev::Arrive(i));
        }
        for o in &fleet.outages {
            if let Some(r) = fleet.regions.iter().position(|x| x.name == o.region) {
                sim.q.push(o.from_ms, Ev::OutageStart(r));
                sim.q.push(o.to_ms, Ev::OutageEnd(r));
            }
        }
        // Occupancy samples at lo, lo + SAMPLE_MS, ... before hi (only reads).
        let (lo, hi) = sim.window_ms;
        let mut k = 0u32;
        loop {
            let t = lo + f64::from(k) * SAMPLE_MS;
            if t >= hi {
                break;
            }
            sim.q.push(t, Ev::Sample);
            k += 1;
        }
        Ok(sim)
    }

    /// The run, once every event has been handled.
    fn finish(self) -> Run {
        let geo = matches!(self.policy, PolicyName::GeoRouter);
        Run {
            policy: self.policy,
            deployment: self.deployment,
            records: self.records,
            starts: self.starts,
            levels: self.levels,
            proxies: if geo { self.proxies } else { 1 },
            source: geo.then_some(self.source),
            exchange: geo && self.exchange,
            busy_ms: self.busy_ms,
            window_ms: self.window_ms,
            occupancy: self.occupancy,
            end_ms: self.end_ms,
            probe: match &self.mode {
                Mode::Geo(envoys) => Some(ProbeLoad {
                    envoys: envoys.iter().map(Vec::len).sum(),
                    scrapes: envoys.iter().flatten().map(|e| e.scrapes).sum(),
                    queries: envoys.iter().flatten().map(|e| e.queries).sum(),
                    fast_ms: self.probe_fast_ms,
                }),
                Mode::Base(_) => None,
            },
            reasons: self.reasons,
        }
    }
}

impl Sim<'_> {
    fn handle(&mut self, now: f64, ev: Ev) -> Result<(), String> {
        match ev {
            Ev::Tick => self.tick(now),
            Ev::ProbeTick { client, proxy } => self.probe_tick(client, proxy, now),
            Ev::Scrape => self.scrape(now),
            Ev::Arrive(i) => self.arrive(i, now)?,
            Ev::RouterArrive(i) => self.route(i, now)?,
            Ev::RouterHears { i, ok } => self.router_hears(i, now, ok),
            Ev::EngineArrive(i) => self.engine_arrive(i, now),
            Ev::FirstToken(i) => {
                if self.stage(i) == Stage::Running {
                    // Through the router (if it is away from the client).
                    let back = self
                        .live
                        .get(i)
                        .map_or(0.0, |l| l.to_engine / 2.0 + l.to_router / 2.0);
                    self.q.push(now + back, Ev::ClientFirstToken(i));
                }
            }
            Ev::ClientFirstToken(i) => self.client_first_token(i, now),
            Ev::EngineDone(i) => self.engine_done(i, now),
            Ev::ClientDone(i) => self.client_end(i, now, true),
            Ev::ClientFail(i) => self.client_end(i, now, false),
            Ev::ProbeSample {
                client,
                proxy,
                callout,
            } => {
                // The callout reaches its target: what it answers now.
                let answer = self.probe_answer(callout.to, now);
                let rtt = self.callout_rtt(client, callout.to);
                self.q.push(
                    now + rtt / 2.0,
                    Ev::ProbeDeliver {
                        client,
                        proxy,
                        token: callout.token,
                        // A lost region does not answer: the callout fails.
                        answer: Box::new(answer.unwrap_or_default()),
                    },
                );
            }
            Ev::ProbeDeliver {
                client,
                proxy,
                token,
                answer,
            } => {
                if let Some(e) = self.envoy(client, proxy) {
                    e.answer(token, *answer, core_ms(now));
                }
            }
            Ev::PeerArrive {
                from,
                to,
                token,
                body,
            } => {
                let status = match self.envoy(to.0, to.1) {
                    Some(e) => e.exchange_in(&body, core_ms(now)),
                    None => 503,
                };
                let back = self.peer_rtt(from.0, to.0) / 2.0;
                self.q.push(
                    now + back,
                    Ev::ProbeDeliver {
                        client: from.0,
                        proxy: from.1,
                        token,
                        answer: Box::new(Answer {
                            status: Some(status),
                            ..Answer::default()
                        }),
                    },
                );
            }
            Ev::OutageStart(r) => self.outage_start(r, now),
            Ev::OutageEnd(r) => {
                if let Some(up) = self.up.get_mut(r) {
                    *up = true;
                }
            }
            Ev::Sample => {
                for (series, r) in self.occupancy.iter_mut().zip(&self.stations) {
                    let running: usize = r.iter().map(|s| s.engine.scheduler.running()).sum();
                    let waiting: usize = r.iter().map(|s| s.engine.scheduler.waiting()).sum();
                    let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
                    series.push((n(running).saturating_add(n(waiting)), n(waiting)));
                }
            }
            Ev::PromScrape { region, replica } => self.prometheus_scrape(region, replica, now),
        }
        Ok(())
    }

    /// What a probe callout's target answers when it reaches it: a region's
    /// entry point passes it to one replica (the metrics of that replica
    /// alone); Prometheus answers its query. `None`: no answer (a lost
    /// region).
    fn probe_answer(&mut self, to: To, now: f64) -> Option<Answer> {
        let mut a = Answer {
            status: Some(200),
            ..Answer::default()
        };
        match to {
            To::Region { region, metrics } => {
                if !self.up.get(region).copied().unwrap_or(false) {
                    return None;
                }
                let replica = self.balance(region);
                let s = self.stations.get(region)?.get(replica)?;
                if metrics {
                    let c = &s.engine.cache;
                    let sample = exposition::Snapshot {
                        running: s.engine.scheduler.running(),
                        waiting: s.engine.scheduler.waiting(),
                        cache_usage: c.usage(),
                        query_tokens: c.query_tokens(),
                        hit_tokens: c.hit_tokens(),
                        completed: s.engine.completed(),
                        generated: s.engine.generated(),
                        capacity_tokens: c.capacity_tokens(),
                        block_tokens: c.block_tokens(),
                        max_model_len: openai::MAX_OUTPUT_TOKENS,
                        requests: Vec::new(),
                        process_start_s: (EPOCH_MS as f64 + s.started_ms) / 1000.0,
                    };
                    a.body = exposition::render(EngineMode::Vllm, trace::MODEL, None, &sample)
                        .into_bytes();
                }
            }
            To::Prometheus => {
                a.body = self.prometheus.as_ref()?.answer(&self.names, now);
            }
            // Delivered as `Ev::PeerArrive`, never sampled.
            To::Peers => return None,
        }
        Some(a)
    }

    /// One round trip between client region `client` and a callout's
    /// target. Prometheus (or the query front end the plugin reaches) runs
    /// in the engine region nearest the client region.
    fn callout_rtt(&self, client: usize, to: To) -> f64 {
        match to {
            To::Region { region, .. } => self.fleet.rtt(client, region),
            To::Prometheus | To::Peers => (0..self.fleet.regions.len())
                .map(|r| self.fleet.rtt(client, r))
                .fold(f64::INFINITY, f64::min),
        }
    }

    /// One round trip between the Envoys of client regions `a` and `b`:
    /// 1 ms within a client region; between two, through the engine region
    /// that makes it shortest (the fleet gives no client-to-client figure,
    /// so this bounds the direct path from above).
    fn peer_rtt(&self, a: usize, b: usize) -> f64 {
        if a == b {
            return 1.0;
        }
        (0..self.fleet.regions.len())
            .map(|r| self.fleet.rtt(a, r) + self.fleet.rtt(b, r))
            .fold(f64::INFINITY, f64::min)
    }

    /// The replica region `region`'s entry point sends the next request (or
    /// probe callout) to.
    fn balance(&mut self, region: usize) -> usize {
        let active: Vec<usize> = self
            .stations
            .get(region)
            .map(|r| r.iter().map(|s| s.held.len()).collect())
            .unwrap_or_default();
        match self.balancer.get_mut(region) {
            Some(rng) => least_request(rng, &active),
            None => 0,
        }
    }

    /// Prometheus scrapes one replica (a lost region's fail: its series go
    /// stale), and again an interval later.
    fn prometheus_scrape(&mut self, region: usize, replica: usize, now: f64) {
        let up = self.up.get(region).copied().unwrap_or(false);
        let figures = self
            .stations
            .get(region)
            .and_then(|r| r.get(replica))
            .filter(|_| up)
            .map(|s| Figures::of(s, now));
        let Some(p) = &mut self.prometheus else {
            return;
        };
        if let Some(slot) = p.last.get_mut(region).and_then(|r| r.get_mut(replica)) {
            *slot = figures;
        }
        let every = p.interval_ms;
        if self.unresolved > 0 {
            self.q.push(now + every, Ev::PromScrape { region, replica });
        }
    }

    /// Envoy `proxy` of client region `client` (geo-router).
    fn envoy(&mut self, client: usize, proxy: usize) -> Option<&mut Envoy> {
        match &mut self.mode {
            Mode::Geo(envoys) => envoys.get_mut(client)?.get_mut(proxy),
            Mode::Base(_) => None,
        }
    }

    fn stage(&self, i: usize) -> Stage {
        self.live.get(i).map_or(Stage::Resolved, |l| l.stage)
    }

    fn set_stage(&mut self, i: usize, stage: Stage) {
        if let Some(l) = self.live.get_mut(i) {
            l.stage = stage;
        }
    }

    /// A baseline's health checks, then what its instances do with them.
    fn tick(&mut self, now: f64) {
        for (h, up) in self.health.iter_mut().zip(&self.up) {
            h.observe(*up);
        }
        if let Mode::Base(peers) = &mut self.mode {
            let healthy: Vec<bool> = self.health.iter().map(|h| h.healthy).collect();
            for p in &mut peers.instances {
                p.baseline.tick(now, &self.up, &healthy);
            }
        }
        if self.unresolved > 0 {
            self.q.push(now + self.tick_ms, Ev::Tick);
        }
    }

    /// Envoy (c, proxy)'s exchange callouts: each to the next host of the
    /// peers' cluster in its round robin over every Envoy of the deployment
    /// (itself included, as a headless Service lists it), half a round
    /// trip away.
    fn send_to_peers(&mut self, c: usize, proxy: usize, tokens: Vec<u32>, now: f64) {
        let Mode::Geo(envoys) = &mut self.mode else {
            return;
        };
        let hosts: Vec<(usize, usize)> = envoys
            .iter()
            .enumerate()
            .flat_map(|(ci, r)| (0..r.len()).map(move |p| (ci, p)))
            .collect();
        let mut sends = Vec::new();
        if let Some(e) = envoys.get_mut(c).and_then(|r| r.get_mut(proxy)) {
            for token in tokens {
                let Some(body) = e.take_peer_body(token) else {
                    continue;
                };
                let Some(&to) = hosts.get(e.next_peer % hosts.len().max(1)) else {
                    continue;
                };
                e.next_peer = e.next_peer.wrapping_add(1);
                sends.push((to, token, body));
            }
        }
        for (to, token, body) in sends {
            let at = now + self.peer_rtt(c, to.0) / 2.0;
            self.q.push(
                at,
                Ev::PeerArrive {
                    from: (c, proxy),
                    to,
                    token,
                    body,
                },
            );
        }
    }

    /// One Envoy's probe tick; the next one after the period its probe set.
    fn probe_tick(&mut self, c: usize, proxy: usize, now: f64) {
        let Mode::Geo(envoys) = &mut self.mode else {
            return;
        };
        let Some(e) = envoys.get_mut(c).and_then(|r| r.get_mut(proxy)) else {
            return;
        };
        let (callouts, level) = e.tick(core_ms(now));
        let period = e.period_ms() as f64;
        if period < f64::from(e.cfg.probe.tick_ms) {
            self.probe_fast_ms += period;
        }
        let mut peers = Vec::new();
        for callout in callouts {
            if callout.to == To::Peers {
                peers.push(callout.token);
                continue;
            }
            let rtt = self.callout_rtt(c, callout.to);
            // The callout reads the engine half a round trip later.
            self.q.push(
                now + rtt / 2.0,
                Ev::ProbeSample {
                    client: c,
                    proxy,
                    callout,
                },
            );
        }
        self.send_to_peers(c, proxy, peers, now);
        // The ladder as the first Envoy of each client region publishes it.
        if proxy == 0 {
            if let Some(series) = self.levels.get_mut(c) {
                series.push((now, level));
            }
        }
        if self.unresolved > 0 {
            self.q
                .push(now + period, Ev::ProbeTick { client: c, proxy });
        }
    }

    /// Every engine's waiting queue (its prompt tokens and its requests)
    /// and KV usage as a scrape reads them; a lost region does not answer
    /// and keeps its last reading.
    fn scrape(&mut self, now: f64) {
        let Mode::Base(peers) = &self.mode else {
            return;
        };
        let Some(every) = peers.scrape_ms else {
            return;
        };
        for (k, (r, up)) in self.stations.iter().zip(&self.up).enumerate() {
            if !*up {
                continue;
            }
            if let Some(seen) = self.scraped.get_mut(k) {
                *seen = r.iter().map(|s| s.waiting_tokens).sum();
            }
            if let Some(seen) = self.scraped_waiting.get_mut(k) {
                *seen = r.iter().map(|s| s.engine.scheduler.waiting() as u64).sum();
            }
            if let Some(seen) = self.scraped_kv.get_mut(k) {
                *seen = kv_usage(r);
            }
        }
        if self.unresolved > 0 {
            self.q.push(now + every, Ev::Scrape);
        }
    }

    /// The client sends request `i`: to its router, which is here unless it
    /// is a global one in another region.
    fn arrive(&mut self, i: usize, now: f64) -> Result<(), String> {
        let to_router = self.to_router(i);
        if to_router > 0.0 {
            self.q.push(now + to_router / 2.0, Ev::RouterArrive(i));
            return Ok(());
        }
        self.route(i, now)
    }

    /// Round trip between request `i`'s client and its router.
    fn to_router(&self, i: usize) -> f64 {
        let client = self.work.prepared.get(i).map_or(0, |p| p.client);
        match &self.mode {
            Mode::Base(Peers {
                router_region: Some(g),
                ..
            }) => self.fleet.rtt(client, *g),
            _ => 0.0,
        }
    }

    /// The router has request `i`: it decides, and sends it on.
    fn route(&mut self, i: usize, now: f64) -> Result<(), String> {
        let (Some(req), Some(prep)) = (self.work.requests.get(i), self.work.prepared.get(i)) else {
            return Ok(());
        };
        let client = prep.client;
        let router: usize;
        let mut output_tokens = prep.output_tokens;
        let region = match &mut self.mode {
            Mode::Geo(envoys) => {
                // Round robin over the client region's Envoys, per request.
                let sent = self.sent.get_mut(client);
                let nth = sent.as_ref().map_or(0, |n| **n);
                if let Some(n) = sent {
                    *n += 1;
                }
                let Some(replicas) = envoys.get_mut(client) else {
                    return Ok(());
                };
                let count = replicas.len().max(1) as u64;
                router = usize::try_from(nth % count).unwrap_or(0);
                if let Some(rec) = self.records.get_mut(i) {
                    rec.proxy = Some(router);
                }
                let Some(e) = replicas.get_mut(router) else {
                    return Ok(());
                };
                let body = trace::request_body(req);
                match e.handle(i, &body, &req.tier, &req.session, core_ms(now)) {
                    Ok(Handled::Shed) => {
                        self.resolve_early(i, Status::Shed, now);
                        return Ok(());
                    }
                    Ok(Handled::TooLong) => {
                        self.resolve_early(i, Status::TooLong, now);
                        return Ok(());
                    }
                    Ok(Handled::Routed(routing)) => {
                        if let Some(b) = &routing.clamped_body {
                            // The engine reads max_tokens from the body it gets.
                            let parsed = openai::parse_request(Kind::Chat, b)
                                .map_err(|e| format!("request {i}: clamped body: {e}"))?;
                            output_tokens = u32::try_from(parsed.max_tokens).unwrap_or(u32::MAX);
                            if let Some(rec) = self.records.get_mut(i) {
                                rec.clamped = true;
                            }
                        }
                        *self.reasons.entry(routing.reason.as_str()).or_insert(0) += 1;
                        if let Some(rec) = self.records.get_mut(i) {
                            rec.reason = Some(routing.reason.as_str());
                            rec.predicted_queue_ms = routing.predicted_queue_ms.map(f64::from);
                        }
                        routing.region
                    }
                    Err(e) => return Err(format!("request {i}: {e}")),
                }
            }
            Mode::Base(peers) => {
                // Round trips as the router sees them: from where it is.
                let rtt: Vec<f64> = (0..self.stations.len())
                    .map(|r| match peers.router_region {
                        Some(g) => self.fleet.region_rtt(g, r),
                        None => self.fleet.rtt(client, r),
                    })
                    .collect();
                let healthy: Vec<bool> = self.health.iter().map(|h| h.healthy).collect();
                // Only the oracle knows the queues exactly and at once.
                let exact_kv: Vec<f64>;
                let (queued, waiting, kv) = match peers.deployment {
                    Deployment::Oracle => {
                        exact_kv = self.stations.iter().map(|r| kv_usage(r)).collect();
                        (&self.queued_tokens, &self.queued_requests, &exact_kv)
                    }
                    Deployment::Global(_) | Deployment::PerClientRegion => {
                        (&self.scraped, &self.scraped_waiting, &self.scraped_kv)
                    }
                };
                router = peers.instance(client);
                let Some(peer) = peers.instances.get_mut(router) else {
                    return Err(format!("request {i}: no router for its client region"));
                };
                let view = View {
                    now_ms: now,
                    healthy: &healthy,
                    outstanding: &peer.outstanding,
                    queued_tokens: queued,
                    waiting,
                    kv_usage: kv,
                    kv_blocks: &self.kv_blocks,
                    rtt_ms: &rtt,
                    names: &self.names,
                };
                let region = peer.baseline.choose(
                    &view,
                    &Ask {
                        session: &req.session,
                        segments: &prep.segments,
                        prompt_tokens: prep.segment_tokens,
                    },
                );
                if let Some(o) = peer.outstanding.get_mut(region) {
                    *o += 1;
                }
                region
            }
        };
        let to_router = self.to_router(i);
        let to_engine = match &self.mode {
            Mode::Base(Peers {
                router_region: Some(g),
                ..
            }) => self.fleet.region_rtt(*g, region),
            _ => self.fleet.rtt(client, region),
        };
        if let Some(l) = self.live.get_mut(i) {
            *l = Live {
                stage: Stage::InTransit,
                region,
                replica: 0,
                to_router,
                to_engine,
                router,
                output_tokens,
                started_at: 0.0,
                reached_at: 0.0,
            };
        }
        if let Some(rec) = self.records.get_mut(i) {
            rec.region = Some(region);
        }
        if let Some(q) = self.queued_tokens.get_mut(region) {
            *q += prep.segment_tokens;
        }
        if let Some(q) = self.queued_requests.get_mut(region) {
            *q += 1;
        }
        self.q.push(now + to_engine / 2.0, Ev::EngineArrive(i));
        Ok(())
    }

    fn resolve_early(&mut self, i: usize, status: Status, now: f64) {
        if let Some(rec) = self.records.get_mut(i) {
            rec.status = status;
        }
        self.set_stage(i, Stage::Resolved);
        self.unresolved = self.unresolved.saturating_sub(1);
        self.end_ms = self.end_ms.max(now);
    }

    fn region_of(&self, i: usize) -> usize {
        self.live.get(i).map_or(0, |l| l.region)
    }

    /// The replica request `i` is at.
    fn station_mut(&mut self, i: usize) -> Option<&mut Station> {
        let (region, replica) = self.live.get(i).map(|l| (l.region, l.replica))?;
        self.stations.get_mut(region)?.get_mut(replica)
    }

    fn unqueue(&mut self, i: usize) {
        let region = self.region_of(i);
        let tokens = self.work.prepared.get(i).map_or(0, |p| p.segment_tokens);
        if let Some(q) = self.queued_tokens.get_mut(region) {
            *q = q.saturating_sub(tokens);
        }
        if let Some(q) = self.queued_requests.get_mut(region) {
            *q = q.saturating_sub(1);
        }
    }

    fn engine_arrive(&mut self, i: usize, now: f64) {
        let region = self.region_of(i);
        let up = self.up.get(region).copied().unwrap_or(false);
        if !up {
            self.unqueue(i);
            self.leave(i, now, false);
            return;
        }
        // The region's entry point picks a replica.
        let replica = self.balance(region);
        if let Some(l) = self.live.get_mut(i) {
            l.reached_at = now;
            l.replica = replica;
        }
        let admission = match self.station_mut(i) {
            Some(s) => {
                s.held.insert(i);
                s.engine.scheduler.arrive(i as u64)
            }
            None => return,
        };
        match admission {
            Admission::Started => self.start(i, now),
            Admission::Queued => {
                self.set_stage(i, Stage::Waiting);
                let tokens = self.work.prepared.get(i).map_or(0, |p| p.segment_tokens);
                if let Some(s) = self.station_mut(i) {
                    s.waiting_tokens += tokens;
                }
            }
        }
    }

    fn start(&mut self, i: usize, now: f64) {
        let region = self.region_of(i);
        let replica = self.live.get(i).map_or(0, |l| l.replica);
        let Some(prep) = self.work.prepared.get(i) else {
            return;
        };
        let Some(s) = self
            .stations
            .get_mut(region)
            .and_then(|r| r.get_mut(replica))
        else {
            return;
        };
        let plan = s.engine.admit(i as u64, &prep.prompt);
        let decode = s.engine.timing.decode_ms_per_token;
        if self.live.get(i).is_some_and(|l| l.stage == Stage::Waiting) {
            s.waiting_tokens = s.waiting_tokens.saturating_sub(prep.segment_tokens);
        }
        self.unqueue(i);
        let out = self.live.get(i).map_or(1, |l| l.output_tokens).max(1);
        if let Some(l) = self.live.get_mut(i) {
            l.stage = Stage::Running;
            l.started_at = now;
        }
        let reached = self.live.get(i).map_or(now, |l| l.reached_at);
        if let Some(rec) = self.records.get_mut(i) {
            rec.queued_ms = Some(now - reached);
            rec.prompt_tokens = plan.prompt_tokens as u64;
            rec.cached_tokens = plan.cached_tokens as u64;
        }
        self.starts.push((now, region));
        let first = now + plan.prefill_ms;
        self.q.push(first, Ev::FirstToken(i));
        self.q
            .push(first + f64::from(out - 1) * decode, Ev::EngineDone(i));
    }

    fn engine_done(&mut self, i: usize, now: f64) {
        if self.stage(i) != Stage::Running {
            return;
        }
        let work = self.work;
        let out = self.live.get(i).map_or(1, |l| l.output_tokens).max(1);
        let next = match self.station_mut(i) {
            Some(s) => {
                s.held.remove(&i);
                s.engine.record_success(out as usize);
                match work.prepared.get(i).and_then(|p| p.sequence.as_ref()) {
                    Some(seq) => s.engine.finish_generated(i as u64, now, seq),
                    None => s.engine.finish(i as u64, now),
                }
            }
            None => None,
        };
        self.account_busy(i, now);
        self.leave(i, now, true);
        if let Some(next) = next.and_then(|n| usize::try_from(n).ok()) {
            self.start(next, now);
        }
    }

    fn account_busy(&mut self, i: usize, now: f64) {
        let (region, started) = self
            .live
            .get(i)
            .map_or((0, now), |l| (l.region, l.started_at));
        let (lo, hi) = self.window_ms;
        if let Some(b) = self.busy_ms.get_mut(region) {
            *b += (now.min(hi) - started.max(lo)).max(0.0);
        }
    }

    /// The engine is done with request `i`; the router hears half a round
    /// trip later, and the client when it passes the answer on.
    fn leave(&mut self, i: usize, now: f64, ok: bool) {
        let to_engine = self.live.get(i).map_or(0.0, |l| l.to_engine);
        self.set_stage(i, Stage::Leaving);
        self.q
            .push(now + to_engine / 2.0, Ev::RouterHears { i, ok });
    }

    /// The end of request `i` passes its router: a baseline counts it out.
    fn router_hears(&mut self, i: usize, now: f64, ok: bool) {
        if self.stage(i) != Stage::Leaving {
            return;
        }
        let (region, router, to_router) = self
            .live
            .get(i)
            .map_or((0, 0, 0.0), |l| (l.region, l.router, l.to_router));
        if let Mode::Base(peers) = &mut self.mode {
            if let Some(p) = peers.instances.get_mut(router) {
                if let Some(o) = p.outstanding.get_mut(region) {
                    *o = o.saturating_sub(1);
                }
                p.baseline.observe(region, ok, now);
            }
        }
        if to_router > 0.0 {
            let ev = if ok {
                Ev::ClientDone(i)
            } else {
                Ev::ClientFail(i)
            };
            self.q.push(now + to_router / 2.0, ev);
        } else {
            self.client_end(i, now, ok);
        }
    }

    fn client_first_token(&mut self, i: usize, now: f64) {
        let t0 = self.work.requests.get(i).map_or(now, |r| r.t_ms);
        let ttft = now - t0;
        if let Some(rec) = self.records.get_mut(i) {
            rec.ttft_ms = Some(ttft);
        }
        let client = self.work.prepared.get(i).map_or(0, |p| p.client);
        let proxy = self.live.get(i).map_or(0, |l| l.router);
        if let Some(e) = self.envoy(client, proxy) {
            e.first_byte(i, core_ms(now));
        }
    }

    fn client_end(&mut self, i: usize, now: f64, ok: bool) {
        if self.stage(i) != Stage::Leaving {
            return;
        }
        let t0 = self.work.requests.get(i).map_or(now, |r| r.t_ms);
        if let Some(rec) = self.records.get_mut(i) {
            if ok {
                rec.status = Status::Completed;
                rec.e2e_ms = Some(now - t0);
            } else {
                rec.status = Status::Failed;
            }
        }
        let client = self.work.prepared.get(i).map_or(0, |p| p.client);
        let proxy = self.live.get(i).map_or(0, |l| l.router);
        // The engine's usage, as vLLM with `--enable-prompt-tokens-details`
        // reports it at the end of the answer.
        let usage = self
            .records
            .get(i)
            .filter(|_| ok)
            .map(|r| (r.prompt_tokens, r.cached_tokens));
        if let Some(e) = self.envoy(client, proxy) {
            e.done(i, ok, usage, core_ms(now));
        }
        self.set_stage(i, Stage::Resolved);
        self.unresolved = self.unresolved.saturating_sub(1);
        self.end_ms = self.end_ms.max(now);
    }

    fn outage_start(&mut self, region: usize, now: f64) {
        let Some(replicas) = self.stations.get_mut(region) else {
            return;
        };
        if let Some(up) = self.up.get_mut(region) {
            *up = false;
        }
        // A lost region comes back as fresh engines: empty caches.
        let mut held = Vec::new();
        for s in replicas {
            s.engine = Engine::new(s.config);
            s.waiting_tokens = 0;
            s.started_ms = now;
            held.extend(std::mem::take(&mut s.held));
        }
        // In request order, whatever the replicas.
        held.sort_unstable();
        for i in held {
            match self.stage(i) {
                Stage::Waiting => self.unqueue(i),
                Stage::Running => self.account_busy(i, now),
                _ => {}
            }
            self.leave(i, now, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geo::Slots;
    use crate::trace::TraceRequest;
    use engine_emulator::model::DEFAULT_PREFILL_OVERHEAD_MS;

    fn fleet(extra: &str) -> Topology {
        fleet_with(2, extra)
    }

    fn fleet_with(slots: u32, extra: &str) -> Topology {
        Topology::parse(
            format!(
                r#"{{"client_regions": ["na", "eu"], "regions": [
              {{"name": "near", "rtt_ms": {{"na": 10, "eu": 120}}, "max_concurrency": {slots},
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000}},
              {{"name": "far", "rtt_ms": {{"na": 120, "eu": 10}}, "max_concurrency": {slots},
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000}}]{extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn req(
        t_ms: f64,
        session: &str,
        client: &str,
        segments: &[(&str, u32)],
        out: u32,
    ) -> TraceRequest {
        TraceRequest {
            t_ms,
            session: session.into(),
            client_region: client.into(),
            tier: "paid".into(),
            segments: segments.iter().map(|(s, n)| (s.to_string(), *n)).collect(),
            output_tokens: out,
        }
    }

    /// Prompt tokens as the engine counts them: its own tokenizer over its
    /// chat template, not the segments' nominal count.
    fn engine_tokens(segments: &[(&str, u32)]) -> usize {
        let segs: Vec<(String, u32)> = segments.iter().map(|(s, n)| (s.to_string(), *n)).collect();
        let text = crate::trace::prompt_text(&segs);
        engine_emulator::tokenizer::chat(&serde_json::json!([{"role": "user", "content": text}]))
            .unwrap()
            .len()
    }

    #[test]
    fn one_request_ttft_is_rtt_plus_prefill_exactly() {
        let f = fleet("");
        // 100 segment tokens of text; the engine counts its own tokens, none
        // cached: 0.5 ms of prefill each.
        let n = engine_tokens(&[("sys-1", 100)]);
        assert_ne!(n, 100, "the engine does not share the trace's token count");
        // The engine's per-request overhead (the fleet's default), then
        // 0.5 ms a token.
        let prefill = DEFAULT_PREFILL_OVERHEAD_MS + n as f64 * 0.5;
        let w = Workload::new(&f, vec![req(1000.0, "s1", "na", &[("sys-1", 100)], 5)]).unwrap();
        for p in PolicyName::ALL {
            let r = run(&f, &w, p, &Deployment::Oracle, None).unwrap();
            let rec = &r.records[0];
            assert_eq!(rec.status, Status::Completed, "{p:?}");
            assert_eq!(rec.prompt_tokens, n as u64);
            // Session affinity hashes the session, llm-d breaks its tie at
            // random (it knows no round trips); every other policy takes
            // the near region for a lone cold request.
            let rtt = match rec.region {
                Some(0) => 10.0,
                Some(1) if matches!(p, PolicyName::SessionAffinity | PolicyName::LlmD) => 120.0,
                other => panic!("{p:?} chose {other:?}"),
            };
            assert_eq!(rec.ttft_ms, Some(rtt + prefill), "{p:?}");
            // Four more tokens at 10 ms each.
            assert_eq!(rec.e2e_ms, Some(rtt + prefill + 40.0), "{p:?}");
        }
    }

    #[test]
    fn queueing_and_cache_hits_follow_the_engine_model() {
        let f = fleet("");
        let seg = [("doc", 400u32)];
        let n = engine_tokens(&seg);
        let hit = (n - 1) / 16 * 16;
        let o = DEFAULT_PREFILL_OVERHEAD_MS;
        let (cold, warm) = (o + n as f64 * 0.5, o + (n - hit) as f64 * 0.5);
        // Three at once on a 2-slot engine: the third waits for the first
        // to finish (cold prefill + 99 × 10 ms decode), then hits the cache.
        let trace = vec![
            req(0.0, "a", "na", &seg, 100),
            req(0.0, "b", "na", &seg, 100),
            req(0.0, "c", "na", &seg, 100),
        ];
        let w = Workload::new(&f, trace).unwrap();
        let r = run(&f, &w, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        let ttft: Vec<f64> = r.records.iter().map(|x| x.ttft_ms.unwrap()).collect();
        assert_eq!(ttft[0], 10.0 + cold);
        // The second is admitted at the same instant: the first one's blocks
        // are already in the cache (the emulator inserts at admission).
        assert_eq!(r.records[1].cached_tokens, hit as u64);
        assert_eq!(ttft[1], 10.0 + warm);
        // The second finishes first (5 + warm + 99 × 10 ms); the third takes
        // its slot and hits the cache too.
        let free_at = 5.0 + warm + 990.0;
        assert_eq!(ttft[2], free_at + warm + 5.0);
        assert_eq!(r.records[2].cached_tokens, hit as u64);
        assert_eq!(r.starts.len(), 3);
    }

    #[test]
    fn the_next_turn_finds_the_answer_where_it_was_generated() {
        let f = fleet("");
        let first = [("s-u0", 300u32)];
        let next = [("s-u0", 300u32), ("s-a0", 80), ("s-u1", 40)];
        // The second turn comes long after the first ended, to the same
        // (nearest) engine: prompt and answer are cached, all but the
        // trailing partial block of the answer's text.
        let held = engine_tokens(&[("s-u0", 300), ("s-a0", 80)]) - 5; // less the end of turn and generation prompt
        let trace = vec![
            req(0.0, "s", "na", &first, 80),
            req(60_000.0, "s", "na", &next, 10),
        ];
        let w = Workload::new(&f, trace.clone()).unwrap();
        assert!(w.prepared[0].sequence.is_some());
        assert!(
            w.prepared[1].sequence.is_none(),
            "no later turn shows its answer"
        );
        let r = run(&f, &w, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        assert_eq!(r.records[1].cached_tokens, (held / 16 * 16) as u64);
        // A next turn that does not repeat the answer as generated (another
        // length): only the prompt stays.
        let mut other = trace;
        other[1].segments[1].1 = 81;
        let w = Workload::new(&f, other).unwrap();
        assert!(w.prepared[0].sequence.is_none());
        let r = run(&f, &w, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        let prompt_only = engine_tokens(&first) - 5;
        assert_eq!(r.records[1].cached_tokens, (prompt_only / 16 * 16) as u64);
        assert!(prompt_only / 16 < held / 16);
    }

    #[test]
    fn runs_are_deterministic() {
        let f = fleet(r#", "outages": [{"region": "near", "from_ms": 3000, "to_ms": 9000}]"#);
        let mut trace = Vec::new();
        for k in 0..120u32 {
            let client = if k % 3 == 0 { "eu" } else { "na" };
            let session = format!("s{}", k % 7);
            let turn = format!("{session}-u{k}");
            trace.push(req(
                f64::from(k) * 97.0,
                &session,
                client,
                &[("sys", 300), (&session, 200), (&turn, 50)],
                20 + k % 30,
            ));
        }
        let w = Workload::new(&f, trace).unwrap();
        let deployments = [
            Deployment::Oracle,
            Deployment::PerClientRegion,
            Deployment::Global("near".into()),
            Deployment::Global("far".into()),
        ];
        for p in PolicyName::ALL {
            for d in &deployments {
                let a = run(&f, &w, p, d, None).unwrap();
                let b = run(&f, &w, p, d, None).unwrap();
                assert_eq!(a.records, b.records, "{p:?} {d}");
                assert_eq!(a.starts, b.starts, "{p:?} {d}");
                assert_eq!(a.levels, b.levels, "{p:?} {d}");
                // Every request resolved, some failed in the outage.
                assert!(a.records.iter().any(|r| r.status == Status::Completed));
            }
        }
    }

    fn regions(r: &Run) -> Vec<Option<usize>> {
        r.records.iter().map(|x| x.region).collect()
    }

    #[test]
    fn per_client_region_routers_keep_their_own_prefix_trees_and_counts() {
        let f = fleet("");
        // na sends X (to near: all idle) then A (to far: near has X in
        // flight); eu then sends B, which shares A's 1000-token prefix.
        let trace = vec![
            req(0.0, "x", "na", &[("q", 100)], 100),
            req(1.0, "a", "na", &[("doc", 1000), ("a", 10)], 100),
            req(2.0, "b", "eu", &[("doc", 1000), ("b", 10)], 5),
        ];
        let w = Workload::new(&f, trace).unwrap();
        let run_as = |d: Deployment| run(&f, &w, PolicyName::CacheAware, &d, None).unwrap();
        // One tree for all traffic: B follows the prefix to far.
        for d in [Deployment::Oracle, Deployment::Global("near".into())] {
            assert_eq!(
                regions(&run_as(d.clone())),
                [Some(0), Some(1), Some(1)],
                "{d}"
            );
        }
        // eu's router never saw A: its tree is empty and its own counts are
        // all zero, so B goes to the first least-loaded region, near, cold.
        let r = run_as(Deployment::PerClientRegion);
        assert_eq!(regions(&r), [Some(0), Some(1), Some(0)]);
        assert_eq!(r.records[2].cached_tokens, 0);
        // Least request: na's X (one output token, a short prompt: done well
        // before 100 ms) goes near, its Z (long) far, as near is busy at
        // 1 ms. At 100 ms a shared router counts far busy, near idle; eu's
        // own router counts nothing and takes its nearest, far.
        let trace = vec![
            req(0.0, "x", "na", &[("q", 10)], 1),
            req(1.0, "z", "na", &[("z", 100)], 100),
            req(100.0, "y", "eu", &[("y", 100)], 5),
        ];
        let w = Workload::new(&f, trace).unwrap();
        let lr = |d: Deployment| regions(&run(&f, &w, PolicyName::LeastRequest, &d, None).unwrap());
        assert_eq!(lr(Deployment::Oracle), [Some(0), Some(1), Some(0)]);
        assert_eq!(lr(Deployment::PerClientRegion), [Some(0), Some(1), Some(1)]);
    }

    #[test]
    fn a_global_router_adds_the_round_trip_to_its_region() {
        // near–far 100 ms; eu is 120 ms from near, 10 ms from far.
        let f = Topology::parse(
            br#"{"client_regions": ["na", "eu"], "regions": [
              {"name": "near", "rtt_ms": {"na": 10, "eu": 120}, "max_concurrency": 2,
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000,
               "region_rtt_ms": {"far": 100}},
              {"name": "far", "rtt_ms": {"na": 120, "eu": 10}, "max_concurrency": 2,
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000}]}"#,
        )
        .unwrap();
        let w = Workload::new(&f, vec![req(1000.0, "s1", "eu", &[("sys-1", 100)], 5)]).unwrap();
        let prefill = DEFAULT_PREFILL_OVERHEAD_MS + engine_tokens(&[("sys-1", 100)]) as f64 * 0.5;
        let near = Deployment::Global("near".into());
        for p in PolicyName::ALL.into_iter().skip(1) {
            let rec = &run(&f, &w, p, &near, None).unwrap().records[0];
            assert_eq!(rec.status, Status::Completed, "{p:?}");
            // eu → near 120 ms, near → engine 0 or 100 ms, then the prefill.
            let (region, via) = match rec.region {
                Some(0) => (0, 0.0),
                Some(1) => (1, 100.0),
                other => panic!("{p:?}: {other:?}"),
            };
            assert_eq!(f.region_rtt(0, region), via);
            assert_eq!(rec.ttft_ms, Some(120.0 + via + prefill), "{p:?}");
            assert_eq!(rec.e2e_ms, Some(120.0 + via + prefill + 40.0), "{p:?}");
            // Seen from near, near is nearest: all but the session hash stay.
            let expected = if p == PolicyName::SessionAffinity {
                1
            } else {
                0
            };
            assert_eq!(region, expected, "{p:?}");
        }
        // The same engine (the session's hash: far) straight from the client
        // (oracle) and through a router in near: 120 + 100 − 10 = 210 ms more.
        let sa = |d: &Deployment| {
            run(&f, &w, PolicyName::SessionAffinity, d, None)
                .unwrap()
                .records[0]
                .clone()
        };
        let (direct, routed) = (sa(&Deployment::Oracle), sa(&near));
        assert_eq!((direct.region, routed.region), (Some(1), Some(1)));
        assert_eq!(direct.ttft_ms, Some(10.0 + prefill));
        assert_eq!(routed.ttft_ms, Some(10.0 + prefill + 210.0));
        // A router in far, where the client is next to: nothing added.
        let far = sa(&Deployment::Global("far".into()));
        assert_eq!(far.ttft_ms, direct.ttft_ms);
        // An unknown region is refused, naming the fleet's.
        let e = run(
            &f,
            &w,
            PolicyName::Nearest,
            &Deployment::Global("mid".into()),
            None,
        )
        .unwrap_err();
        assert!(e.contains("its regions: near, far"), "{e}");
    }

    #[test]
    fn a_deployed_gorgo_sees_the_queues_only_at_each_scrape() {
        // One slot per region: r0 runs long at near, r1 waits behind it.
        let f = fleet_with(1, "");
        let trace = vec![
            req(100.0, "r0", "na", &[("a", 100)], 200),
            req(200.0, "r1", "na", &[("b", 100)], 5),
            req(300.0, "r2", "na", &[("c", 100)], 5),
            req(1100.0, "r3", "na", &[("d", 100)], 5),
        ];
        let w = Workload::new(&f, trace).unwrap();
        let gorgo = |d: Deployment, o: Option<&Value>| {
            regions(&run(&f, &w, PolicyName::Gorgo, &d, o).unwrap())
        };
        // The oracle sees r1's 100 queued tokens at once: 0.5 × 100 > 0.276
        // × 110 ms, so r2 goes to far, and so does r3 (r1 still waits).
        assert_eq!(
            gorgo(Deployment::Oracle, None),
            [Some(0), Some(0), Some(1), Some(1)]
        );
        // A deployed router still has the scrape at 0 (nothing queued) when
        // r2 comes: near again. The scrape at 1000 ms shows r1 and r2
        // waiting: r3 goes to far.
        for d in [
            Deployment::PerClientRegion,
            Deployment::Global("near".into()),
        ] {
            assert_eq!(
                gorgo(d.clone(), None),
                [Some(0), Some(0), Some(0), Some(1)],
                "{d}"
            );
        }
        // The scrape follows the plugin's probe.tick_ms: at 250 ms it
        // already shows r1 waiting.
        let fast = serde_json::json!({"probe": {"tick_ms": 250, "timeout_ms": 250}});
        assert_eq!(
            gorgo(Deployment::PerClientRegion, Some(&fast)),
            [Some(0), Some(0), Some(1), Some(1)]
        );
    }

    #[test]
    fn several_envoys_per_client_region_take_its_requests_in_turn() {
        let f = fleet("");
        let clients = ["na", "na", "eu", "na", "na", "eu", "na"];
        let trace: Vec<TraceRequest> = clients
            .iter()
            .enumerate()
            .map(|(k, c)| req(100.0 * k as f64, &format!("s{k}"), c, &[("q", 50)], 5))
            .collect();
        let w = Workload::new(&f, trace).unwrap();
        let geo = |n: usize| {
            run_with(
                &f,
                &w,
                PolicyName::GeoRouter,
                &Deployment::PerClientRegion,
                None,
                n,
            )
            .unwrap()
        };
        let proxies = |r: &Run| r.records.iter().map(|x| x.proxy).collect::<Vec<_>>();
        // A counter per client region: na's 0th, 1st, 2nd, ... and eu's.
        let r = geo(3);
        assert_eq!(r.proxies, 3);
        assert_eq!(
            proxies(&r),
            [0, 1, 0, 2, 0, 1, 1].map(Some),
            "{:?}",
            r.records
        );
        assert!(r.records.iter().all(|x| x.status == Status::Completed));
        // The ladder: one series per client region (its first Envoy's).
        assert_eq!(r.levels.len(), 2);
        assert_eq!(r.levels[0].len(), geo(1).levels[0].len());
        assert_eq!(proxies(&geo(1)), [Some(0); 7]);
        // Baselines ignore it.
        let b = run_with(
            &f,
            &w,
            PolicyName::LeastRequest,
            &Deployment::PerClientRegion,
            None,
            3,
        )
        .unwrap();
        assert_eq!((b.proxies, b.records[0].proxy), (1, None));
        let e = run_with(
            &f,
            &w,
            PolicyName::GeoRouter,
            &Deployment::PerClientRegion,
            None,
            0,
        )
        .unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn several_envoys_keep_their_own_in_flight_counts() {
        // Four slots a region. After the probes have read the idle engines,
        // na sends a burst of eight at once: one Envoy counts its own
        // in flight and spreads them (bounded load); eight Envoys each see
        // one (the last goes to the warm-up's Envoy, done by then), nothing
        // in flight, and all take the nearest region.
        let f = fleet_with(4, "");
        let mut trace = vec![req(0.0, "w", "na", &[("w", 10)], 2)];
        for k in 0..8 {
            trace.push(req(5000.0, &format!("b{k}"), "na", &[("q", 50)], 200));
        }
        let w = Workload::new(&f, trace).unwrap();
        let geo = |n: usize| {
            run_with(
                &f,
                &w,
                PolicyName::GeoRouter,
                &Deployment::PerClientRegion,
                None,
                n,
            )
            .unwrap()
        };
        let far = |r: &Run| r.records.iter().filter(|x| x.region == Some(1)).count();
        let one = geo(1);
        assert!(far(&one) > 0, "{:?}", one.records);
        let eight = geo(8);
        assert_eq!(far(&eight), 0, "{:?}", eight.records);
        assert_eq!(
            eight.records.iter().map(|x| x.proxy).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5, 6, 7, 0].map(Some)
        );
    }

    #[test]
    fn geo_router_keeps_a_conversation_where_its_prefix_is_and_avoids_a_lost_region() {
        // Eight slots: one request in flight is not over the bounded-load share.
        let f = fleet_with(
            8,
            r#", "outages": [{"region": "near", "from_ms": 20000, "to_ms": 40000}]"#,
        );
        let mut trace = Vec::new();
        // One na conversation with a long shared prefix: its first turn
        // once the probe has measured the regions, the next once that
        // first answer has started (what a region learns, it learns from
        // an answer), then a turn every second.
        for k in 0..56u32 {
            let turn = format!("u{k}");
            let t_ms = if k == 0 {
                1000.0
            } else {
                f64::from(k + 4) * 1000.0
            };
            trace.push(req(t_ms, "s1", "na", &[("doc", 4000), (&turn, 20)], 10));
        }
        let w = Workload::new(&f, trace).unwrap();
        let r = run(
            &f,
            &w,
            PolicyName::GeoRouter,
            &Deployment::PerClientRegion,
            None,
        )
        .unwrap();
        let region = |k: usize| r.records[k].region;
        // Before the outage (turns 0 to 15): near, from cache after the
        // first turn.
        assert!(
            (0..16).all(|k| region(k) == Some(0)),
            "{:?}",
            r.records
                .iter()
                .map(|x| (x.region, x.cached_tokens, x.ttft_ms))
                .collect::<Vec<_>>()
        );
        assert!(r.records[5].cached_tokens >= 4000);
        // Once the probe has seen the loss (two failed checks), far serves.
        // (turns 20 to 34: 24 s to 38 s).
        assert!(
            (20..35).all(|k| region(k) == Some(1)),
            "{:?}",
            (16..36).map(region).collect::<Vec<_>>()
        );
        let failed = r
            .records
            .iter()
            .filter(|x| x.status == Status::Failed)
            .count();
        assert!((1..=4).contains(&failed), "{failed}");
        // Nearest keeps sending to the lost region until its health check
        // fails, then far: the same loss window.
        let n = run(&f, &w, PolicyName::Nearest, &Deployment::Oracle, None).unwrap();
        let failed_n = n
            .records
            .iter()
            .filter(|x| x.status == Status::Failed)
            .count();
        assert!((1..=4).contains(&failed_n), "{failed_n}");
    }

    #[test]
    fn a_region_back_from_an_outage_is_seen_restarted_by_the_plugins_probe() {
        // A lost region comes back as fresh engines, counters at 0: the
        // plugin's own probe, answered with the emulator's /metrics, sees
        // the restart, and its router believes nothing from before it.
        let f = fleet_with(
            8,
            r#", "outages": [{"region": "near", "from_ms": 20000, "to_ms": 40000}]"#,
        );
        // A conversation's turn every second from 2 s to 49 s (the probe
        // runs while requests are out).
        let trace = (0..48u32)
            .map(|k| {
                let turn = format!("u{k}");
                req(
                    f64::from(k + 2) * 1000.0,
                    "s1",
                    "na",
                    &[("doc", 4000), (&turn, 20)],
                    10,
                )
            })
            .collect();
        let w = Workload::new(&f, trace).unwrap();
        let mut sim = geo_sim(&f, &w, Source::default());
        step_until(&mut sim, 19_000.0);
        let snap = the_envoy(&sim).snapshot().unwrap();
        // Bounded by its engine's start, an hour before the trace.
        let before = Some(EPOCH_MS - 3_600_000);
        assert_eq!(snap.regions[0].cache_reset_ms, before);
        // The vLLM emulator's block, read from its cache_config_info.
        assert_eq!(snap.regions[0].block_tokens, Some(16));
        step_until(&mut sim, 45_000.0);
        let snap = the_envoy(&sim).snapshot().unwrap();
        let reset = snap.regions[0].cache_reset_ms.unwrap();
        assert!(
            (core_ms(40_000.0)..=core_ms(45_000.0)).contains(&reset),
            "{reset}"
        );
        assert_eq!(snap.regions[1].cache_reset_ms, before);
        // So the conversation, which far served through the outage, stays
        // there from cache once near is back (from 42 s): near's fresh
        // engine holds nothing, though the directory's entries from before
        // the outage are within the TTL. Believed, they sent the turn at
        // 42 s back to near for a full prefill (3.6 s, not 0.14 s).
        let r = run(
            &f,
            &w,
            PolicyName::GeoRouter,
            &Deployment::PerClientRegion,
            None,
        )
        .unwrap();
        let after: Vec<(Option<usize>, u64)> = r.records[40..]
            .iter()
            .map(|x| (x.region, x.cached_tokens))
            .collect();
        assert!(
            after
                .iter()
                .all(|(region, cached)| *region == Some(1) && *cached >= 4000),
            "{after:?}"
        );
    }

    /// One region of `replicas` engines with 2 slots each, 20 ms from na.
    fn replicated(replicas: u32) -> Topology {
        Topology::parse(
            format!(
                r#"{{"client_regions": ["na"], "regions": [
              {{"name": "only", "rtt_ms": {{"na": 20}}, "max_concurrency": 2, "replicas": {replicas},
               "prefill_ms_per_token": 0.5, "decode_ms_per_token": 10, "cache_tokens": 100000}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// Five requests in the first 40 ms, 20 s of decode each: from about
    /// 1 s to 20 s the engines hold them, unchanged.
    fn five_long() -> Vec<TraceRequest> {
        (0..5)
            .map(|k| {
                let q = format!("q{k}");
                req(
                    10.0 * f64::from(k),
                    &format!("s{k}"),
                    "na",
                    &[(&q, 50)],
                    2000,
                )
            })
            .collect()
    }

    fn geo_sim<'a>(f: &'a Topology, w: &'a Workload, source: Source) -> Sim<'a> {
        let options = Options {
            proxies: 1,
            source,
            exchange: false,
        };
        Sim::new(
            f,
            w,
            PolicyName::GeoRouter,
            &Deployment::PerClientRegion,
            None,
            options,
        )
        .unwrap()
    }

    fn step_until(sim: &mut Sim, t_ms: f64) {
        while sim.q.next_at().is_some_and(|t| t <= t_ms) {
            let (now, ev) = sim.q.pop().unwrap();
            sim.handle(now, ev).unwrap();
        }
    }

    fn the_envoy<'s>(sim: &'s Sim) -> &'s Envoy {
        match &sim.mode {
            Mode::Geo(e) => &e[0][0],
            Mode::Base(_) => panic!("not the geo-router"),
        }
    }

    /// Per replica of region 0: (running, waiting).
    fn loads(sim: &Sim) -> Vec<(usize, usize)> {
        sim.stations[0]
            .iter()
            .map(|s| (s.engine.scheduler.running(), s.engine.scheduler.waiting()))
            .collect()
    }

    #[test]
    fn least_request_takes_the_less_loaded_of_two_draws() {
        let mut rng = Rng::new(7);
        let before = rng.clone().next_u64();
        assert_eq!(least_request(&mut rng, &[9]), 0);
        assert_eq!(rng.next_u64(), before, "one replica: no draw");
        let mut rng = Rng::new(7);
        let mut picks = [0u32; 3];
        for _ in 0..9000 {
            picks[least_request(&mut rng, &[3, 0, 3])] += 1;
        }
        // The idle one unless both draws miss it: 1 - (2/3)^2 = 5/9.
        assert!((4700..5300).contains(&picks[1]), "{picks:?}");
        let mut picks = [0u32; 3];
        for _ in 0..9000 {
            picks[least_request(&mut rng, &[1, 1, 1])] += 1;
        }
        assert!(picks.iter().all(|n| (2700..3300).contains(n)), "{picks:?}");
    }

    #[test]
    fn prometheus_answers_the_sums_over_a_regions_replicas() {
        let f = replicated(3);
        let w = Workload::new(&f, five_long()).unwrap();
        let interval_ms = 5000.0;
        let mut sim = geo_sim(&f, &w, Source::Prometheus { interval_ms });
        step_until(&mut sim, 12_000.0);
        let loads = loads(&sim);
        let (running, waiting) = loads.iter().fold((0, 0), |(r, w), (a, b)| (r + a, w + b));
        assert_eq!(running + waiting, 5, "{loads:?}");
        assert!(
            loads.iter().filter(|(r, _)| *r > 0).count() >= 2,
            "least request spreads them: {loads:?}"
        );
        let e = the_envoy(&sim);
        // The plugin is told one replica's slots and asks Prometheus.
        assert_eq!(e.cfg.regions[0].max_concurrency, 2);
        assert_eq!(
            e.cfg.regions[0].load_source,
            llm_geo_router::config::LoadSource::Prometheus
        );
        assert_eq!(e.scrapes, 0, "no engine is scraped by the probe");
        assert!((11..=13).contains(&e.queries), "{}", e.queries);
        // What the core read from the sim's answer: the region's sums, its
        // three replicas, as of Prometheus' oldest scrape of them (at most
        // an interval and a probe round before now).
        let snap = e.snapshot().unwrap();
        let only = &snap.regions[0];
        assert!(only.metrics_ok);
        assert_eq!(only.replicas, Some(3));
        assert_eq!(only.slots(2), 6);
        assert_eq!(
            (only.running, only.waiting),
            (running as f64, waiting as f64)
        );
        let scraped = only.scraped_ms.unwrap();
        assert!(
            (core_ms(12_000.0 - interval_ms - 1100.0)..=core_ms(12_000.0)).contains(&scraped),
            "{scraped}"
        );
        // This Envoy's in-flight requests then: all five.
        assert_eq!(only.inflight_at_scrape, 5.0);
        // A failed scrape marks the replica's series stale: two replicas
        // counted, their sums only.
        if let Some(p) = &mut sim.prometheus {
            p.last[0][1] = None;
        }
        let body = sim
            .prometheus
            .as_ref()
            .unwrap()
            .answer(&sim.names, 12_000.0);
        let cfg = the_envoy(&sim).cfg.clone();
        let read = llm_geo_router::engines::promql::parse_answer(&cfg, &body).unwrap();
        let (r1, w1) = loads[1];
        assert_eq!(read[&0].replicas, 2);
        assert_eq!(
            (read[&0].sample.running, read[&0].sample.waiting),
            (Some((running - r1) as f64), Some((waiting - w1) as f64))
        );
    }

    #[test]
    fn a_scrape_through_the_entry_point_reads_one_replica() {
        let f = replicated(3);
        let w = Workload::new(&f, five_long()).unwrap();
        for (slots, configured) in [(Slots::Region, 6), (Slots::Replica, 2)] {
            let mut sim = geo_sim(&f, &w, Source::Scrape(slots));
            step_until(&mut sim, 12_000.0);
            let loads = loads(&sim);
            let held: Vec<usize> = loads.iter().map(|(r, w)| r + w).collect();
            assert_eq!(held.iter().sum::<usize>(), 5);
            assert!(held.iter().all(|n| *n < 5), "{held:?}");
            let e = the_envoy(&sim);
            assert_eq!(e.cfg.regions[0].max_concurrency, configured);
            assert_eq!(e.queries, 0);
            assert!(e.scrapes >= 12, "{}", e.scrapes);
            let snap = e.snapshot().unwrap();
            let only = &snap.regions[0];
            assert_eq!(only.replicas, None, "a scrape does not count replicas");
            // One replica's figures: one of theirs, never the region's.
            let seen = (only.running as usize, only.waiting as usize);
            assert!(loads.contains(&seen), "{seen:?} not one of {loads:?}");
        }
        // With one engine, the scrape reads all of it.
        let f = replicated(1);
        let mut sim = geo_sim(&f, &w, Source::default());
        step_until(&mut sim, 12_000.0);
        let only = &the_envoy(&sim).snapshot().unwrap().regions[0];
        assert_eq!(only.running + only.waiting, 5.0);
    }
}
