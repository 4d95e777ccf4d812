//! The probe singleton: every tick, one health and one `/metrics` callout
//! per region through its Envoy cluster, and now and then one for its model
//! list (the engine's context limit: at start, every
//! `context.refresh_ticks`, when the region becomes healthy again and when
//! its release digest changes); their answers, the routers'
//! per-region outcome counters, their TTFT observations (shared queue) and
//! the operator's override feed the pure [`Fleet`], which decides health,
//! ejection, the ladder and the assessment; the probe publishes the
//! snapshot to shared data and the gauges.
//!
//! Exactly one probe loop per Envoy process: Envoy may run `on_configure`
//! for more than one root context of the singleton, so a lease in shared
//! data (owner id + heartbeat) decides which of them acts; the others stay
//! idle unless the owner stops renewing it for three ticks.

use std::collections::HashMap;
use std::rc::Rc;

use crate::cache::exchange::{self, Apply, Body, Exchange, Load, Message};
use crate::config::{Config, LoadSource, ProbeConfig, ReleaseSource};
use crate::engines::metrics::{parse_engine_metrics, CacheCapacity, EngineKind};
use crate::fleet::assess::Assessment;
use crate::fleet::snapshot::Snapshot;
use crate::fleet::state::{Fleet, HealthChange};
use crate::learning::calibration::Verdict;
use crate::learning::tuning::Observation;
use crate::learning::usage::UsageReport;
use crate::request::limits::{limit_field, parse_model_ids, parse_model_limit, MAX_LISTED_MODELS};
use crate::shared::host_api::{CalloutResponse, Level, ProbeHost};
use crate::shared::names::{
    Global, RegionStat, Stat, LADDER_OVERRIDE_KEY, LEASE_KEY, OBSERVATIONS_QUEUE, SNAPSHOT_KEY,
};
use crate::shared::store::SetOutcome;

/// What of a peer's news the probe applies itself: the usage reports, to
/// its calibration (the exchange filter wrote the placements and stored
/// responses to shared data as the message arrived).
#[derive(Default)]
struct Usage(Vec<UsageReport>);

impl Apply for Usage {
    fn apply(&mut self, _origin: u64, body: &Body) {
        if let Body::Usage(b) = body {
            if let Some(r) = UsageReport::decode(b) {
                self.0.push(r);
            }
        }
    }
}

/// `ladder.capacity_ratio_pct` is capped at 100x (10000 %).
const RATIO_PCT_CAP: u64 = 10_000;

/// Observations drained per tick at most: a bound on the work one tick does.
const MAX_OBSERVATIONS_PER_TICK: usize = 10_000;

/// The first round runs this soon after start rather than a whole
/// `probe.tick_ms` later, so that a new Envoy routes on measured figures
/// within a round trip (and a long tick cannot leave it without a snapshot).
pub const FIRST_TICK_MS: u64 = 50;

/// Health bodies read at most (a release digest in JSON).
const HEALTH_BODY_MAX: usize = 64 * 1024;

/// Model-list bodies read at most: a card is a few hundred bytes, so this
/// holds a model with hundreds of LoRA adapters; a longer list is refused.
const MODELS_BODY_MAX: usize = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Health,
    Metrics,
    Models,
    /// The `prometheus` load source's query, for every region using it.
    Prometheus,
    /// A message to a peer Envoy.
    Exchange,
}

/// Token-less region index of the Prometheus query in `pending`.
const ALL_REGIONS: usize = usize::MAX;

/// Samples of this Envoy's in-flight requests kept per region, one per
/// tick: enough to find the count when Prometheus scraped the engines.
const INFLIGHT_HISTORY: usize = 128;

/// What the last warning about a region's KV-cache capacity said, so that
/// a figure missing or refused scrape after scrape is warned about once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CapacityWarned {
    Nothing,
    Missing,
    Refused,
}

#[derive(Debug)]
pub struct Probe {
    cfg: Rc<Config>,
    fleet: Fleet,
    owner: String,
    /// Callouts in flight: token → (region, kind, sent at).
    pending: HashMap<u32, (usize, Kind, u64)>,
    /// Per region: the outcome counters (answered, failures) at the last tick.
    last_upstream: Vec<Option<(u64, u64)>>,
    metrics_warned: Vec<bool>,
    models_warned: Vec<bool>,
    /// Per region: warned that it reports no release digest while parity
    /// is configured (again after it reports one and then stops).
    digest_warned: Vec<bool>,
    dispatch_warned: Vec<bool>,
    capacity_warned: Vec<CapacityWarned>,
    last_assessment: Assessment,
    /// Rounds this root context has run (holding the lease).
    rounds: u64,
    /// Per region: the round from which its model list is to be read.
    models_due: Vec<u64>,
    /// The tick period last set on the host (ms).
    period_ms: u64,
    /// When the last full round ran.
    last_full_ms: Option<u64>,
    /// Busy-period rounds in a row with the fleet not busy.
    calm_rounds: u32,
    /// The `prometheus` source's request path (query included), if any
    /// region uses it.
    prom_path: Option<String>,
    prom_warned: bool,
    /// Per region using the `prometheus` source: (time, this Envoy's
    /// in-flight requests) at each tick, oldest first.
    inflight_history: Vec<std::collections::VecDeque<(u64, f64)>>,
    /// The exchange with the deployment's other Envoys, when configured.
    exchange: Option<Exchange>,
    /// When the last exchange message went out.
    exchange_sent_ms: Option<u64>,
    exchange_warned: bool,
}

/// The next tick period and count of calm rounds: `probe.busy_tick_ms` as
/// soon as the fleet is busy, back to `probe.tick_ms` only after
/// `probe.idle_rounds` busy-period rounds in a row without it being busy
/// (so a queue that comes and goes does not make the period flap).
pub fn next_period(cfg: &ProbeConfig, current_ms: u64, busy: bool, calm_rounds: u32) -> (u64, u32) {
    let idle = u64::from(cfg.tick_ms);
    let fast = u64::from(cfg.busy_tick_ms());
    if fast >= idle {
        return (idle, 0);
    }
    if busy {
        return (fast, 0);
    }
    if current_ms != fast {
        return (idle, 0);
    }
    let calm = calm_rounds.saturating_add(1);
    if calm >= cfg.idle_rounds {
        (idle, 0)
    } else {
        (fast, calm)
    }
}

impl Probe {
    /// `owner` names this root context in the lease (unique per process).
    pub fn new(cfg: Rc<Config>, owner: String, now_ms: u64) -> Probe {
        let n = cfg.regions.len();
        let owner_bytes = owner.clone();
        Probe {
            fleet: Fleet::new(&cfg, now_ms),
            owner,
            pending: HashMap::new(),
            last_upstream: vec![None; n],
            metrics_warned: vec![false; n],
            models_warned: vec![false; n],
            digest_warned: vec![false; n],
            dispatch_warned: vec![false; n],
            capacity_warned: vec![CapacityWarned::Nothing; n],
            last_assessment: Assessment::Ok,
            rounds: 0,
            models_due: vec![0; n],
            period_ms: 0,
            last_full_ms: None,
            calm_rounds: 0,
            prom_path: crate::engines::promql::fleet_query(&cfg)
                .map(|q| crate::engines::promql::query_path(&cfg, &q)),
            prom_warned: false,
            inflight_history: vec![std::collections::VecDeque::new(); n],
            exchange: cfg.exchange.enabled().then(|| {
                let origin = xxhash_rust::xxh3::xxh3_64(owner_bytes.as_bytes());
                Exchange::new(&cfg, origin)
            }),
            exchange_sent_ms: None,
            exchange_warned: false,
            cfg,
        }
    }

    /// This Envoy's id in the exchange (0 without one).
    pub fn origin(&self) -> u64 {
        self.exchange.as_ref().map_or(0, |x| x.origin)
    }

    /// Arm the first tick; false (configuration refused) when the host
    /// refuses a tick period.
    pub fn start(&mut self, host: &mut dyn ProbeHost) -> bool {
        let first = FIRST_TICK_MS.min(u64::from(self.cfg.probe.tick_ms));
        self.period_ms = first;
        if !host.set_tick_ms(first) {
            host.log(
                Level::Error,
                "llm-geo-router probe: the host refused a tick period; configuration refused",
            );
            return false;
        }
        true
    }

    pub fn fleet(&self) -> &Fleet {
        &self.fleet
    }

    /// Take or renew the lease; true when this root context runs the loop.
    fn hold_lease(&self, host: &mut dyn ProbeHost, now: u64) -> bool {
        let stale_after = 3 * u64::from(self.cfg.probe.tick_ms);
        let (current, cas) = match host.get(LEASE_KEY) {
            Ok(Some((v, cas))) => (Some(v), cas),
            Ok(None) => (None, 0),
            Err(_) => return false,
        };
        if let Some(v) = current {
            let text = String::from_utf8_lossy(&v);
            let (owner, beat) = text.rsplit_once(':').unwrap_or(("", "0"));
            let beat: u64 = beat.parse().unwrap_or(0);
            if owner != self.owner && now.saturating_sub(beat) <= stale_after {
                return false;
            }
        }
        let value = format!("{}:{now}", self.owner);
        matches!(
            host.set(LEASE_KEY, value.as_bytes(), (cas != 0).then_some(cas)),
            Ok(SetOutcome::Stored)
        )
    }

    /// One round. A full round (one per `probe.tick_ms`): inputs since the
    /// last one, a health and a metrics callout per region and a
    /// model-list callout where one is due, the controller step, a
    /// publication. While the fleet is busy the probe ticks every
    /// `probe.busy_tick_ms`, and the rounds between full ones send only
    /// the metrics callouts (each answer is published), so that everything
    /// counted in ticks (health and ejection streaks, the ladder's one rung
    /// per tick, the EWMAs, the model-list refresh) keeps its period. A
    /// callout whose last one of its kind is still out is not sent again.
    pub fn on_tick(&mut self, host: &mut dyn ProbeHost) {
        let idle = u64::from(self.cfg.probe.tick_ms);
        let now = host.now_ms();
        if !self.hold_lease(host, now) {
            // From the first tick on, the configured period (accepted at
            // start): only the lease is watched.
            self.set_period(host, idle);
            return;
        }
        host.count(Stat::Global(Global::ProbeTicks), 1);
        let fast = u64::from(self.cfg.probe.busy_tick_ms());
        // Half a fast period of slack: a timer a little early still makes
        // the round full.
        let full = self
            .last_full_ms
            .is_none_or(|t| now.saturating_sub(t) + fast / 2 >= idle);
        if full {
            self.last_full_ms = Some(now);
            self.rounds += 1;
        }
        let timeout_ms = u64::from(self.cfg.probe.timeout_ms);
        // A callout the host never answered is forgotten after two timeouts.
        self.pending
            .retain(|_, (_, _, sent)| now.saturating_sub(*sent) <= 2 * timeout_ms + 1000);
        if full {
            // With the exchange, the deployment's arrivals: this Envoy's
            // and what its peers' counters rose by since it heard of them.
            let peers = self.exchange.as_ref().map_or(0, |x| x.peer_arrivals);
            let arrivals = host.stat(Stat::Global(Global::Arrivals));
            self.fleet
                .on_arrivals(&self.cfg, arrivals.saturating_add(peers), now);
        }
        self.drain_observations(host);
        self.send_exchange(host, now);
        if full {
            self.read_upstream_results(host);
        }
        self.read_override(host);
        let cfg = self.cfg.clone();
        self.record_inflight(host, now);
        for (i, r) in cfg.regions.iter().enumerate() {
            let authority = cfg.region_authority(i).unwrap_or(&r.cluster);
            let models_due = self.models_due.get(i).is_some_and(|d| *d <= self.rounds);
            for (kind, path) in [
                (Kind::Health, &r.health_path),
                (Kind::Metrics, &r.metrics_path),
                (Kind::Models, &r.models_path),
            ] {
                if (!full && kind != Kind::Metrics)
                    || (kind == Kind::Models && !models_due)
                    || (kind == Kind::Metrics && r.load_source == LoadSource::Prometheus)
                    || self
                        .pending
                        .values()
                        .any(|(ri, k, _)| *ri == i && *k == kind)
                {
                    continue;
                }
                if kind == Kind::Models {
                    if let Some(d) = self.models_due.get_mut(i) {
                        *d = self.rounds + u64::from(cfg.context.refresh_ticks);
                    }
                }
                let headers = [
                    (":method", "GET"),
                    (":path", path.as_str()),
                    (":authority", authority),
                    ("user-agent", "llm-geo-router-probe"),
                ];
                host.count(Stat::Global(Global::ProbeCallouts), 1);
                match host.dispatch(&r.cluster, &headers, None, timeout_ms) {
                    Ok(token) => {
                        self.pending.insert(token, (i, kind, now));
                        if let Some(w) = self.dispatch_warned.get_mut(i) {
                            *w = false;
                        }
                    }
                    Err(status) => {
                        // Once per region until a callout is accepted again,
                        // not every tick.
                        if let Some(w) = self.dispatch_warned.get_mut(i).filter(|w| !**w) {
                            *w = true;
                            host.log(
                                Level::Warn,
                                &format!(
                                    "llm-geo-router probe: region {}: callout to cluster {:?} refused by the host ({status}); is the cluster defined?",
                                    r.name, r.cluster
                                ),
                            );
                        }
                        if kind == Kind::Health {
                            self.health(host, i, None);
                        }
                    }
                }
            }
        }
        // Prometheus has the engines' figures as of its last scrape (every
        // few seconds): one query per full round is enough.
        if full {
            self.query_prometheus(host, now);
        }
        if full {
            self.tick_and_publish(host, now);
        }
        let (period, calm) = next_period(
            &cfg.probe,
            self.period_ms,
            self.fleet.busy(&cfg),
            self.calm_rounds,
        );
        self.calm_rounds = calm;
        self.set_period(host, period);
        host.set_gauge(Stat::Global(Global::ProbeTickMs), period);
    }

    /// Set the tick period on the host when it changes.
    fn set_period(&mut self, host: &mut dyn ProbeHost, ms: u64) {
        if ms != self.period_ms && host.set_tick_ms(ms) {
            self.period_ms = ms;
        }
    }

    /// A callout came back (or failed: no status).
    pub fn on_callout_response(
        &mut self,
        host: &mut dyn ProbeHost,
        token: u32,
        response: &mut dyn CalloutResponse,
    ) {
        let Some((region, kind, sent)) = self.pending.remove(&token) else {
            return;
        };
        let now = host.now_ms();
        let status = response.status();
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        match kind {
            Kind::Health => {
                let rtt = ok.then(|| now.saturating_sub(sent) as f64);
                if ok && self.cfg.release.source != ReleaseSource::MetricsLabel {
                    let digest = self.health_release(response);
                    self.release(host, region, digest);
                }
                if self.health(host, region, rtt) {
                    self.publish(host, now);
                }
            }
            Kind::Metrics => self.metrics(host, region, status, response, now),
            Kind::Models => self.models(host, region, status, response, now),
            Kind::Prometheus => self.prometheus(host, status, response, now),
            Kind::Exchange => {
                if !ok {
                    host.count(Stat::Global(Global::ExchangeSendFailed), 1);
                    if !std::mem::replace(&mut self.exchange_warned, true) {
                        host.log(
                            Level::Warn,
                            &format!(
                                "llm-geo-router probe: exchange: a message to cluster {:?} failed (status {}); the peers it did not reach learn this Envoy's news from others, or later",
                                self.cfg.exchange.cluster.as_deref().unwrap_or(""),
                                status.map_or("none (no response)".to_string(), |s| s.to_string())
                            ),
                        );
                    }
                } else {
                    self.exchange_warned = false;
                }
            }
        }
    }

    /// This Envoy's in-flight requests to each region using the
    /// `prometheus` source, kept for when Prometheus scraped its engines.
    fn record_inflight(&mut self, host: &mut dyn ProbeHost, now: u64) {
        if self.prom_path.is_none() {
            return;
        }
        for (i, r) in self.cfg.regions.iter().enumerate() {
            if r.load_source != LoadSource::Prometheus {
                continue;
            }
            let inflight = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
            if let Some(h) = self.inflight_history.get_mut(i) {
                if h.len() >= INFLIGHT_HISTORY {
                    h.pop_front();
                }
                h.push_back((now, inflight));
            }
        }
    }

    /// This Envoy's in-flight requests to `region` at `at_ms`: the last
    /// tick's count at or before then (the oldest kept if none is).
    fn inflight_at(&self, region: usize, at_ms: u64, now_inflight: f64) -> f64 {
        let Some(h) = self.inflight_history.get(region) else {
            return now_inflight;
        };
        h.iter()
            .rev()
            .find(|(t, _)| *t <= at_ms)
            .or(h.front())
            .map_or(now_inflight, |(_, v)| *v)
    }

    /// The `prometheus` source's one query for every region using it,
    /// unless the last one is still out.
    fn query_prometheus(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let (Some(path), Some(cluster)) = (&self.prom_path, &self.cfg.prometheus.cluster) else {
            return;
        };
        if self
            .pending
            .values()
            .any(|(_, k, _)| *k == Kind::Prometheus)
        {
            return;
        }
        let authority = self.cfg.prometheus.authority.as_deref().unwrap_or(cluster);
        let headers = [
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority),
            ("accept", "application/json"),
            ("user-agent", "llm-geo-router-probe"),
        ];
        host.count(Stat::Global(Global::ProbeCallouts), 1);
        let timeout = u64::from(self.cfg.probe.timeout_ms);
        match host.dispatch(cluster, &headers, None, timeout) {
            Ok(token) => {
                self.pending
                    .insert(token, (ALL_REGIONS, Kind::Prometheus, now));
            }
            Err(status) => {
                let e = format!("callout to cluster {cluster:?} refused by the host ({status}); is the cluster defined?");
                self.prometheus_failed(host, &e, now);
            }
        }
    }

    /// The Prometheus answer: each region using it gets its load summed
    /// over its replicas, as of when Prometheus scraped them; a region the
    /// answer has no complete figures for (or any region, when the query
    /// failed) has a failed scrape.
    fn prometheus(
        &mut self,
        host: &mut dyn ProbeHost,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let read = match status {
            Some(s) if (200..300).contains(&s) => {
                match response.body(crate::engines::promql::MAX_ANSWER_BYTES + 1) {
                    Some(b) => crate::engines::promql::parse_answer(&self.cfg, &b),
                    None => Err("the answer has no body".to_string()),
                }
            }
            Some(s) => Err(format!("status {s}")),
            None => Err("no response (timeout or connection failure)".to_string()),
        };
        let loads = match read {
            Ok(l) => l,
            Err(e) => return self.prometheus_failed(host, &e, now),
        };
        self.prom_warned = false;
        let cfg = self.cfg.clone();
        let mut missing = Vec::new();
        for (i, r) in cfg.regions.iter().enumerate() {
            if r.load_source != LoadSource::Prometheus {
                continue;
            }
            let inflight_now = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
            match loads.get(&i) {
                Some(load) => {
                    // As of the scrape, never in the future of this answer.
                    let at = load.scraped_ms.map_or(now, |t| t.min(now));
                    let inflight = self.inflight_at(i, at, inflight_now);
                    self.check_capacity(host, i, load.sample.cache_capacity.as_ref());
                    self.fleet.on_replicas(i, load.replicas);
                    self.fleet
                        .on_metrics(&cfg, i, Some(load.sample.clone()), inflight, at);
                    self.fleet.on_engine_clock(i, at);
                    if let Some(w) = self.metrics_warned.get_mut(i) {
                        *w = false;
                    }
                }
                None => {
                    host.count(Stat::Region(i, RegionStat::MetricsScrapeFailure), 1);
                    self.fleet.on_metrics(&cfg, i, None, inflight_now, now);
                    if let Some(w) = self.metrics_warned.get_mut(i).filter(|w| !**w) {
                        *w = true;
                        missing.push(format!("{} ({{{}}})", r.name, r.selector()));
                    }
                }
            }
        }
        if !missing.is_empty() {
            host.log(
                Level::Warn,
                &format!("llm-geo-router probe: Prometheus has no complete load figures (waiting, running, one replica or more) for region(s) {}; check prometheus_selector and that Prometheus scrapes their engines", missing.join(", ")),
            );
        }
        self.publish(host, now);
    }

    /// The Prometheus query failed: a failed scrape for every region using
    /// it, one warning until a query succeeds again.
    fn prometheus_failed(&mut self, host: &mut dyn ProbeHost, e: &str, now: u64) {
        let cfg = self.cfg.clone();
        for (i, r) in cfg.regions.iter().enumerate() {
            if r.load_source == LoadSource::Prometheus {
                host.count(Stat::Region(i, RegionStat::MetricsScrapeFailure), 1);
                let inflight = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
                self.fleet.on_metrics(&cfg, i, None, inflight, now);
            }
        }
        if !std::mem::replace(&mut self.prom_warned, true) {
            host.log(
                Level::Warn,
                &format!("llm-geo-router probe: Prometheus query failed: {e}; a failed scrape for every region it serves"),
            );
        }
    }

    /// A release digest read; a region that changed release is redeployed,
    /// perhaps with another context limit: its model list is read again
    /// in the next round.
    fn release(&mut self, host: &mut dyn ProbeHost, region: usize, digest: Option<String>) {
        // With parity configured, a region that reports no digest is never
        // held back (docs/CONFIG.md, `release`): said once, not silently.
        if let (Some(expected), Some(warned)) = (
            self.cfg.release.expected.as_deref(),
            self.digest_warned.get_mut(region),
        ) {
            if digest.is_some() {
                *warned = false;
            } else if !std::mem::replace(warned, true) {
                let r = &self.cfg.release;
                let name = self
                    .cfg
                    .regions
                    .get(region)
                    .map_or("?", |r| r.name.as_str());
                host.log(
                    Level::Warn,
                    &format!(
                        "llm-geo-router probe: region {name}: no release digest ({} {:?}); release parity ({expected}) does not apply to it until it reports one",
                        r.source.as_str(),
                        r.name
                    ),
                );
            }
        }
        let old = self.fleet.release(region);
        if old.is_some() && old != digest.as_deref() {
            self.models_due_now(region);
        }
        self.fleet.on_release(region, digest);
    }

    fn models_due_now(&mut self, region: usize) {
        if let Some(d) = self.models_due.get_mut(region) {
            *d = self.rounds;
        }
    }

    /// A model list came back: the region's context limit, or, for anything
    /// else (an error status, no answer, a body too large or not a model
    /// list), one warning until a read succeeds again and a counter; the
    /// last limit read stands.
    fn models(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let Some(r) = self.cfg.regions.get(region) else {
            return;
        };
        let (name, path, engine) = (r.name.clone(), r.models_path.clone(), r.engine);
        let body = match status {
            Some(s) if (200..300).contains(&s) => match response.body(MODELS_BODY_MAX + 1) {
                Some(b) if b.len() > MODELS_BODY_MAX => Err(format!(
                    "the body is larger than {} KiB",
                    MODELS_BODY_MAX / 1024
                )),
                Some(b) => Ok(b),
                None => Err("the answer has no body".to_string()),
            },
            Some(s) => Err(format!("status {s}")),
            None => Err("no response".to_string()),
        };
        // The models it serves, whatever its limit says: a list without
        // limits still says which requests the region would refuse. One
        // publication for whatever the list changed.
        let mut changed = false;
        if let Ok(Ok(ids)) = body.as_deref().map(parse_model_ids) {
            let said = match ids.len() {
                0 => format!("more than {MAX_LISTED_MODELS} models (or an overlong id) in {path}: taken to serve any model"),
                n => format!("{n} model(s) listed in {path}"),
            };
            if self.fleet.on_models(region, ids) {
                host.log(
                    Level::Info,
                    &format!("llm-geo-router probe: region {name}: {said}"),
                );
                changed = true;
            }
        }
        let read = body.and_then(|b| parse_model_limit(engine, &b));
        match read {
            Ok(limit) => {
                if let Some(w) = self.models_warned.get_mut(region) {
                    *w = false;
                }
                if self.fleet.on_model_limit(region, limit) {
                    host.log(
                        Level::Info,
                        &format!(
                            "llm-geo-router probe: region {name}: context limit {limit} tokens ({} in {path})",
                            limit_field(engine)
                        ),
                    );
                    changed = true;
                }
            }
            Err(e) => {
                host.count(Stat::Region(region, RegionStat::ModelsReadFailure), 1);
                if let Some(w) = self.models_warned.get_mut(region).filter(|w| !**w) {
                    *w = true;
                    let stays = self
                        .fleet
                        .model_limit(region)
                        .map_or("unknown".to_string(), |l| format!("{l} tokens"));
                    host.log(
                        Level::Warn,
                        &format!("llm-geo-router probe: region {name}: model list {path} not read: {e}; its context limit stays {stays}"),
                    );
                }
            }
        }
        if changed {
            self.publish(host, now);
        }
    }

    fn metrics(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        status: Option<u32>,
        response: &mut dyn CalloutResponse,
        now: u64,
    ) {
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str())
            .to_string();
        let engine = self.cfg.regions.get(region).map(|r| r.engine);
        let parsed = match (ok, engine) {
            (true, Some(engine)) => {
                let body = response.body(usize::MAX).unwrap_or_default();
                let label = (self.cfg.release.source == ReleaseSource::MetricsLabel)
                    .then_some(self.cfg.release.name.as_str());
                parse_engine_metrics(engine, &body, label).map_err(|e| e.to_string())
            }
            _ => Err(format!(
                "status {}",
                status.map_or("none (no response)".to_string(), |s| s.to_string())
            )),
        };
        let inflight = host.stat(Stat::Region(region, RegionStat::RqActive)) as f64;
        match parsed {
            Ok(sample) => {
                if let Some(w) = self.metrics_warned.get_mut(region) {
                    *w = false;
                }
                if self.cfg.release.source == ReleaseSource::MetricsLabel {
                    self.release(host, region, sample.release.clone());
                }
                self.check_capacity(host, region, sample.cache_capacity.as_ref());
                self.fleet
                    .on_metrics(&self.cfg, region, Some(sample), inflight, now);
                self.fleet.on_engine_clock(region, now);
                self.publish(host, now);
            }
            Err(e) => {
                host.count(Stat::Region(region, RegionStat::MetricsScrapeFailure), 1);
                if let Some(w) = self.metrics_warned.get_mut(region).filter(|w| !**w) {
                    *w = true;
                    host.log(
                        Level::Warn,
                        &format!("llm-geo-router probe: region {name}: metrics scrape failed: {e}"),
                    );
                }
                self.fleet
                    .on_metrics(&self.cfg, region, None, inflight, now);
            }
        }
    }

    /// The engines' KV-cache capacity in a good scrape (or Prometheus
    /// answer): a refused figure is counted, and a refused or missing one
    /// is warned about once per region and kind until a valid one comes;
    /// the fleet keeps the last valid figure. A region whose capacity is
    /// configured (`cache_tokens`) is not warned about.
    fn check_capacity(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        capacity: Option<&CacheCapacity>,
    ) {
        let Some(r) = self.cfg.regions.get(region) else {
            return;
        };
        if let Some(CacheCapacity::Invalid(_)) = capacity {
            host.count(Stat::Region(region, RegionStat::CacheCapacityRejected), 1);
        }
        let kind = match capacity {
            Some(CacheCapacity::Tokens(_)) => CapacityWarned::Nothing,
            Some(CacheCapacity::Invalid(_)) => CapacityWarned::Refused,
            None => CapacityWarned::Missing,
        };
        let Some(warned) = self.capacity_warned.get_mut(region) else {
            return;
        };
        if kind == CapacityWarned::Nothing || r.cache_tokens().is_some() {
            *warned = CapacityWarned::Nothing;
            return;
        }
        if std::mem::replace(warned, kind) == kind {
            return;
        }
        let stays = self
            .fleet
            .engine_cache_tokens(region)
            .map_or("unknown".to_string(), |t| format!("{t} tokens"));
        let metric = match r.engine {
            EngineKind::Vllm => "vllm:cache_config_info (num_gpu_blocks x block_size)",
            EngineKind::Sglang => "sglang:max_total_num_tokens",
            EngineKind::Llamacpp => "llama.cpp has no such metric",
        };
        let what = match capacity {
            Some(CacheCapacity::Invalid(why)) => format!("KV-cache capacity ignored: {why}"),
            _ => format!("the engine exports no KV-cache capacity ({metric})"),
        };
        host.log(
            Level::Warn,
            &format!(
                "llm-geo-router probe: region {}: {what}; its capacity stays {stays} (set regions[].cache_tokens to give it)",
                r.name
            ),
        );
    }

    /// The release digest in a health response, per `release.source`.
    fn health_release(&self, response: &mut dyn CalloutResponse) -> Option<String> {
        let r = &self.cfg.release;
        match r.source {
            ReleaseSource::HealthHeader => response.header(&r.name),
            ReleaseSource::HealthJson => {
                let body = response.body(HEALTH_BODY_MAX)?;
                let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
                v.get(&r.name)?.as_str().map(str::to_string)
            }
            ReleaseSource::MetricsLabel => None,
        }
    }

    /// Live results since the last tick: the routers' per-region counters
    /// of requests the region's engines answered and of tries they failed
    /// (client cancellations are in neither).
    fn read_upstream_results(&mut self, host: &mut dyn ProbeHost) {
        for (i, last) in self.last_upstream.iter_mut().enumerate() {
            let answered = host.stat(Stat::Region(i, RegionStat::UpstreamRqAnswered));
            let failed = host.stat(Stat::Region(i, RegionStat::UpstreamFailure));
            let (a0, f0) = last
                .replace((answered, failed))
                .unwrap_or((answered, failed));
            let failed = failed.saturating_sub(f0);
            self.fleet
                .on_upstream(i, failed, failed + answered.saturating_sub(a0));
        }
    }

    /// The operator's runtime override of the ladder level, if any.
    fn read_override(&mut self, host: &mut dyn ProbeHost) {
        // Without operator keys there is no override (one left in shared data
        // from an earlier configuration does not count).
        let level = if self.cfg.ladder.operator_keys.is_empty() {
            None
        } else {
            host.get(LADDER_OVERRIDE_KEY)
                .ok()
                .flatten()
                .and_then(|(v, _)| parse_override_value(&v))
        };
        host.set_gauge(
            Stat::Global(Global::LadderOverrideActive),
            u64::from(level.is_some()),
        );
        self.fleet.set_override(level);
    }

    fn drain_observations(&mut self, host: &mut dyn ProbeHost) {
        for _ in 0..MAX_OBSERVATIONS_PER_TICK {
            let Some(bytes) = host.dequeue(OBSERVATIONS_QUEUE) else {
                break;
            };
            match bytes.first() {
                Some(&exchange::NOTE_TAG) => {
                    let regions = self.cfg.regions.len();
                    if let (Some(x), Some(body)) = (
                        self.exchange.as_mut(),
                        exchange::decode_note(&bytes, regions),
                    ) {
                        x.note(body);
                    }
                    continue;
                }
                Some(&exchange::PEER_TAG) => {
                    self.merge_peer(host, bytes.get(1..).unwrap_or_default());
                    continue;
                }
                _ => {}
            }
            if let Some(o) = Observation::decode(&bytes) {
                self.fleet.on_observation(&self.cfg, o);
                host.count(Stat::Global(Global::TuningObservations), 1);
            } else if let Some(r) = UsageReport::decode(&bytes) {
                host.count(Stat::Global(Global::UsageReports), 1);
                let region = usize::from(r.region);
                if let Some(Verdict::Refuted) = self.fleet.on_usage(&r) {
                    host.count(Stat::Region(region, RegionStat::CacheBeliefRefuted), 1);
                }
                if let Some(x) = self.exchange.as_mut() {
                    x.note(Body::Usage(bytes));
                }
            }
        }
    }

    /// How long a peer's load counts after its last message: three send
    /// periods and a callout timeout (a peer that stopped sending costs
    /// only its own contribution, and only until then).
    fn peer_fresh_ms(&self) -> u64 {
        3 * self.cfg.exchange_interval_ms() + u64::from(self.cfg.probe.timeout_ms)
    }

    /// A peer's message, as this Envoy's exchange filter queued it (it
    /// checked it whole; it is checked again here, as the queue is shared
    /// data any root could write).
    fn merge_peer(&mut self, host: &mut dyn ProbeHost, bytes: &[u8]) {
        let now = host.now_ms();
        let regions = self.cfg.regions.len();
        let max = self.cfg.exchange.max_message_bytes as usize;
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let msg = match Message::decode(bytes, x.layout(), regions, max) {
            Ok(m) => m,
            Err(e) => {
                host.count(Stat::Global(Global::ExchangeRefused), 1);
                host.log(
                    Level::Warn,
                    &format!("llm-geo-router probe: exchange: a queued message refused: {e}"),
                );
                return;
            }
        };
        let sent_ms = msg.sent_ms;
        let mut usage = Usage::default();
        let merged = x.merge(msg, now, &mut usage);
        let usage = usage.0;
        if merged.own {
            return;
        }
        host.count(Stat::Global(Global::ExchangeReceived), 1);
        host.count(Stat::Global(Global::ExchangeMerged), merged.fresh as i64);
        host.count(
            Stat::Global(Global::ExchangeDuplicate),
            merged.duplicate as i64,
        );
        host.set_gauge(
            Stat::Global(Global::ExchangeLagMs),
            now.saturating_sub(sent_ms),
        );
        for r in usage {
            let region = usize::from(r.region);
            if let Some(Verdict::Refuted) = self.fleet.on_usage(&r) {
                host.count(Stat::Region(region, RegionStat::CacheBeliefRefuted), 1);
            }
        }
        self.export_peers(host, now);
    }

    /// The live peers' in-flight requests (the routers read the gauges)
    /// and demand (the ladder's), as of `now`: after each merge, and at
    /// each send, so that a peer gone quiet stops counting at once.
    fn export_peers(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let fresh = self.peer_fresh_ms();
        let Some(x) = &self.exchange else {
            return;
        };
        let inflight = x.peer_inflight(now, fresh);
        for (i, v) in inflight.iter().enumerate() {
            host.set_gauge(Stat::Region(i, RegionStat::PeerRqActive), v.round() as u64);
        }
        let since = x.peer_inflight_since(&self.fleet.scraped_ms(), now, fresh);
        self.fleet.set_peer_inflight_delta(&since);
        host.set_gauge(
            Stat::Global(Global::ExchangePeers),
            x.live_peers(now, fresh) as u64,
        );
    }

    /// Every `exchange.interval_ms`: the outbox and this Envoy's load, to
    /// `exchange.fanout` peers.
    fn send_exchange(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let interval = self.cfg.exchange_interval_ms();
        let fast = u64::from(self.cfg.probe.busy_tick_ms());
        if self.exchange.is_none()
            || self
                .exchange_sent_ms
                .is_some_and(|t| now.saturating_sub(t) + fast / 2 < interval)
        {
            return;
        }
        let inflight = (0..self.cfg.regions.len())
            .map(|i| {
                let v = host.stat(Stat::Region(i, RegionStat::RqActive));
                u32::try_from(v).unwrap_or(u32::MAX)
            })
            .collect();
        let own = Load {
            taken_ms: now,
            arrivals: host.stat(Stat::Global(Global::Arrivals)),
            inflight,
        };
        self.export_peers(host, now);
        let fresh = self.peer_fresh_ms();
        let Some(x) = self.exchange.as_mut() else {
            return;
        };
        let (calls, direct) = crate::cache::exchange::plan(
            self.cfg.exchange.fanout as usize,
            x.live_peers(now, fresh),
        );
        x.direct = direct;
        let dropped = std::mem::take(&mut x.dropped);
        if dropped > 0 {
            host.count(Stat::Global(Global::ExchangeDropped), dropped as i64);
        }
        let body = x.take_message(own, now);
        self.exchange_sent_ms = Some(now);
        let Some(cluster) = self.cfg.exchange.cluster.clone() else {
            return;
        };
        let authority = self
            .cfg
            .exchange
            .authority
            .clone()
            .unwrap_or_else(|| cluster.clone());
        let length = body.len().to_string();
        let headers = [
            (":method", "POST"),
            (":path", self.cfg.exchange.path.as_str()),
            (":authority", authority.as_str()),
            ("content-type", "application/octet-stream"),
            ("content-length", length.as_str()),
            ("user-agent", "llm-geo-router-exchange"),
        ];
        let timeout = u64::from(self.cfg.probe.timeout_ms);
        // A callout answered after two timeouts is forgotten: at most
        // `fanout` of them per interval are out.
        let out = self
            .pending
            .values()
            .filter(|(_, k, _)| *k == Kind::Exchange)
            .count();
        for _ in out..calls {
            match host.dispatch(&cluster, &headers, Some(&body), timeout) {
                Ok(token) => {
                    self.pending
                        .insert(token, (ALL_REGIONS, Kind::Exchange, now));
                    host.count(Stat::Global(Global::ExchangeSent), 1);
                    host.count(Stat::Global(Global::ExchangeBytesSent), body.len() as i64);
                }
                Err(status) => {
                    host.count(Stat::Global(Global::ExchangeSendFailed), 1);
                    if !std::mem::replace(&mut self.exchange_warned, true) {
                        host.log(
                            Level::Warn,
                            &format!(
                                "llm-geo-router probe: exchange: callout to cluster {cluster:?} refused by the host ({status}); is the cluster defined?"
                            ),
                        );
                    }
                    break;
                }
            }
        }
    }

    /// Feed one health result; true when the region's health changed.
    fn health(&mut self, host: &mut dyn ProbeHost, region: usize, rtt: Option<f64>) -> bool {
        if rtt.is_none() {
            host.count(Stat::Region(region, RegionStat::HealthProbeFailure), 1);
        }
        let change = self.fleet.on_health(&self.cfg, region, rtt);
        if change == HealthChange::BecameHealthy {
            // Back from an outage, perhaps redeployed: read its limit again.
            self.models_due_now(region);
        }
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str());
        match change {
            HealthChange::None => false,
            HealthChange::BecameHealthy => {
                host.log(
                    Level::Info,
                    &format!("llm-geo-router probe: region {name} is healthy again"),
                );
                true
            }
            HealthChange::BecameUnhealthy => {
                host.log(
                    Level::Warn,
                    &format!(
                        "llm-geo-router probe: region {name} is unhealthy; no new requests go there"
                    ),
                );
                true
            }
        }
    }

    /// The once-per-tick step (ladder, tuning, assessment), then a publication.
    fn tick_and_publish(&mut self, host: &mut dyn ProbeHost, now: u64) {
        let cfg = self.cfg.clone();
        let ejected_before: Vec<bool> = (0..cfg.regions.len())
            .map(|i| self.fleet.is_ejected(i))
            .collect();
        let level_changed = self.fleet.tick(&cfg, now);
        let tick = host.stat(Stat::Global(Global::ProbeTicks));
        for (i, was) in ejected_before.into_iter().enumerate() {
            let name = cfg.regions.get(i).map_or("?", |r| r.name.as_str());
            match (was, self.fleet.is_ejected(i)) {
                (false, true) => host.log(
                    Level::Warn,
                    &format!(
                        "llm-geo-router probe: region {name} ejected: its engines failed most requests they ended (5xx, connection failure, reset or timeout upstream; client cancellations do not count) for {} ticks in a row; no new requests go there for now (probe.eject_s; probe tick {tick})",
                        cfg.probe.unhealthy_after
                    ),
                ),
                (true, false) => host.log(
                    Level::Info,
                    &format!("llm-geo-router probe: region {name} back in routing after its ejection"),
                ),
                _ => {}
            }
        }
        let snap = self.publish(host, now);
        if snap.assessment != self.last_assessment {
            self.last_assessment = snap.assessment;
            let healthy: Vec<&str> = snap
                .regions
                .iter()
                .filter(|r| r.healthy && r.release_ok)
                .map(|r| r.name.as_str())
                .collect();
            host.log(
                Level::Warn,
                &format!(
                    "llm-geo-router probe: assessment {} (routable regions {}/{}: [{}]; capacity {:.1} rps, demand {:.1} rps)",
                    snap.assessment.as_str(),
                    healthy.len(),
                    snap.regions.len(),
                    healthy.join(", "),
                    snap.capacity_rps,
                    snap.demand_rps
                ),
            );
        }
        if level_changed {
            host.log(
                Level::Warn,
                &format!(
                    "llm-geo-router probe: ladder level {} (capacity {:.1} rps, demand {:.1} rps; probe tick {tick})",
                    snap.level, snap.capacity_rps, snap.demand_rps
                ),
            );
        }
    }

    /// Publish the current state: on every tick, on a health change, and on
    /// each engine scrape, so queue depths reach the routers within one
    /// callout rather than a tick later. The snapshot first, then the
    /// version gauge the filters watch.
    fn publish(&mut self, host: &mut dyn ProbeHost, now: u64) -> Snapshot {
        let snap = self.fleet.snapshot(&self.cfg, now);
        let _ = host.set(SNAPSHOT_KEY, &snap.encode(), None);
        self.export(host, &snap);
        snap
    }

    fn export(&self, host: &mut dyn ProbeHost, snap: &Snapshot) {
        let g = |host: &mut dyn ProbeHost, s: Global, v: u64| host.set_gauge(Stat::Global(s), v);
        g(host, Global::LadderLevel, u64::from(snap.level));
        g(host, Global::AssessmentState, snap.assessment.gauge());
        g(
            host,
            Global::LadderLevelChangedUnixS,
            snap.level_changed_ms / 1000,
        );
        // No demand: "plenty", shown as the cap (100x) rather than 0, which
        // would read as no capacity.
        let cap = RATIO_PCT_CAP as f64;
        let ratio = snap.ratio.map_or(RATIO_PCT_CAP, |r| {
            (r * 100.0).round().clamp(0.0, cap) as u64
        });
        g(host, Global::LadderCapacityRatioPct, ratio);
        g(
            host,
            Global::LadderDemandRps,
            snap.demand_rps.round() as u64,
        );
        g(
            host,
            Global::LadderCapacityRps,
            snap.capacity_rps.round() as u64,
        );
        let w_queue = crate::decision::cost::Weights::in_force(&self.cfg, Some(snap)).w_queue;
        g(
            host,
            Global::TuningWQueueMilli,
            (w_queue * 1000.0).round() as u64,
        );
        // The snapshot lists the configured regions in order.
        for (ci, r) in snap.regions.iter().enumerate() {
            let rg = |host: &mut dyn ProbeHost, s: RegionStat, v: u64| {
                host.set_gauge(Stat::Region(ci, s), v)
            };
            rg(host, RegionStat::Healthy, u64::from(r.healthy));
            rg(
                host,
                RegionStat::RttMs,
                r.rtt_ms.map_or(0, |v| v.round() as u64),
            );
            rg(host, RegionStat::EngineWaiting, r.waiting.round() as u64);
            rg(host, RegionStat::EngineRunning, r.running.round() as u64);
            rg(
                host,
                RegionStat::EngineKvUsagePct,
                r.kv_usage.map_or(0, |v| (v * 100.0).round() as u64),
            );
            let rate = r
                .prefill_ms_per_token
                .or_else(|| self.cfg.regions.get(ci).map(|c| c.prefill_ms_per_token))
                .unwrap_or(0.0);
            rg(
                host,
                RegionStat::PrefillUsPerToken,
                (rate * 1000.0).round() as u64,
            );
            let tpb = r
                .tokens_per_byte
                .unwrap_or(crate::decision::cost::PRIOR_TOKENS_PER_BYTE);
            rg(
                host,
                RegionStat::TokensPerKib,
                (tpb * 1024.0).round() as u64,
            );
            rg(
                host,
                RegionStat::CacheHorizonMs,
                r.cache_horizon_ms
                    .unwrap_or(u64::from(self.cfg.directory.ttl_s) * 1000),
            );
            rg(
                host,
                RegionStat::CacheReliabilityPct,
                (r.cache_reliability.unwrap_or(1.0) * 100.0).round() as u64,
            );
            rg(
                host,
                RegionStat::MaxModelLen,
                r.max_model_len.map_or(0, u64::from),
            );
            rg(
                host,
                RegionStat::Replicas,
                u64::from(r.replicas.unwrap_or(1)),
            );
            rg(
                host,
                RegionStat::CacheCapacityTokens,
                r.cache_tokens.unwrap_or(0),
            );
        }
        // Last: the filters copy the snapshot in when this changes.
        g(host, Global::ProbeSnapshotVersion, snap.version);
    }
}

/// The override value in shared data: a level, or empty for none.
fn parse_override_value(v: &[u8]) -> Option<u8> {
    std::str::from_utf8(v).ok()?.trim().parse::<u8>().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::roots::guard::api_key_digest;
    use crate::shared::host_api::{Answer, Effects, Recorder, StreamHost};
    use crate::shared::store::SharedStore;

    const T0: u64 = 1_700_000_000_000;
    const VLLM: &str = "vllm:num_requests_waiting{model_name=\"m\"} 3.0\nvllm:num_requests_running{model_name=\"m\"} 5.0\n";
    const MODELS: &str = r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768},{"id":"lora","object":"model","max_model_len":null}]}"#;

    fn cfg(extra: &str) -> Rc<Config> {
        Rc::new(
            Config::parse(
                format!(
                    r#"{{"regions":[
                      {{"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5}},
                      {{"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40}}],
                      "probe":{{"tick_ms":1000,"timeout_ms":500}}{extra}}}"#
                )
                .as_bytes(),
            )
            .unwrap(),
        )
    }

    fn started(c: &Rc<Config>, owner: &str, host: &mut Recorder) -> Probe {
        host.now_ms = T0;
        let mut p = Probe::new(c.clone(), owner.into(), T0);
        assert!(p.start(host));
        p
    }

    /// Answer every callout of the last tick `ms` later: health 200, metrics
    /// with `metrics` as the body (or `status` for both).
    fn answer_all(p: &mut Probe, host: &mut Recorder, ms: u64, status: Option<u32>, metrics: &str) {
        let sent = host.now_ms;
        host.now_ms = sent + ms;
        for (token, _, path) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status,
                ..Answer::default()
            };
            if path == "/metrics" {
                a.body = metrics.as_bytes().to_vec();
            } else if path == "/v1/models" {
                a.body = MODELS.as_bytes().to_vec();
            }
            p.on_callout_response(host, token, &mut a);
        }
        host.now_ms = sent;
    }

    fn tick(p: &mut Probe, host: &mut Recorder, at: u64) {
        host.now_ms = at;
        p.on_tick(host);
    }

    fn published(host: &Recorder) -> Snapshot {
        let (bytes, _) = host.store.map.get(SNAPSHOT_KEY).unwrap().clone();
        Snapshot::decode(&bytes).unwrap()
    }

    fn prom_series(region: &str, signal: &str, v: &str, at_s: f64) -> String {
        format!(
            r#"{{"metric":{{"llm_geo_region":"{region}","llm_geo_signal":"{signal}"}},"value":[{at_s},"{v}"]}}"#
        )
    }

    #[test]
    fn prometheus_regions_are_read_in_one_query_summed_over_replicas() {
        let c = cfg(r#","prometheus":{"cluster":"prom"}"#);
        let c = Rc::new({
            let mut c = (*c).clone();
            c.regions[1].load_source = LoadSource::Prometheus;
            c
        });
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // This Envoy has 2 requests in flight to mid now, 1 a tick earlier.
        host.stats.insert(Stat::Region(1, RegionStat::RqActive), 1);
        tick(&mut p, &mut host, T0 + 50);
        answer_all(&mut p, &mut host, 5, Some(200), VLLM);
        host.stats.insert(Stat::Region(1, RegionStat::RqActive), 2);
        tick(&mut p, &mut host, T0 + 1050);
        let calls: Vec<(String, String)> = host
            .callouts
            .iter()
            .map(|(_, c, p)| (c.clone(), p.clone()))
            .collect();
        assert!(calls.contains(&("cn".into(), "/metrics".into())));
        assert!(
            !calls.contains(&("cm".into(), "/metrics".into())),
            "mid is not scraped"
        );
        let queries: Vec<&(String, String)> = calls.iter().filter(|(c, _)| c == "prom").collect();
        assert_eq!(queries.len(), 1, "one query per round: {calls:?}");
        assert!(queries[0]
            .1
            .starts_with("/api/v1/query?query=label_replace"));
        // Prometheus scraped mid's 3 replicas at T0 + 500 (between the ticks).
        let at = (T0 + 500) as f64 / 1000.0;
        let body = format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{}]}}}}"#,
            [
                prom_series("mid", "waiting", "6", at),
                prom_series("mid", "running", "24", at),
                prom_series("mid", "replicas", "3", at),
                prom_series("mid", "scraped", &format!("{at}"), at),
            ]
            .join(",")
        );
        let sent = host.now_ms;
        for (token, cluster, _) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status: Some(200),
                ..Answer::default()
            };
            if cluster == "prom" {
                a.body = body.as_bytes().to_vec();
            }
            host.now_ms = sent + 5;
            p.on_callout_response(&mut host, token, &mut a);
        }
        let mid = published(&host).regions[1].clone();
        assert_eq!(
            (mid.waiting, mid.running, mid.replicas),
            (6.0, 24.0, Some(3))
        );
        assert!(mid.metrics_ok);
        assert_eq!(mid.scraped_ms, Some(T0 + 500), "as of Prometheus' scrape");
        assert_eq!(mid.inflight_at_scrape, 1.0, "this Envoy's in-flight then");
        assert_eq!(mid.slots(8), 24);
        assert_eq!(host.value(Stat::Region(1, RegionStat::Replicas)), 3);
        // A failed query: a failed scrape for mid, one warning. (The first
        // round's query was answered with the metrics text: one already.)
        let before = host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure));
        assert_eq!(before, 1);
        assert!(host
            .logs
            .iter()
            .any(|(_, m)| m.contains("not a Prometheus API answer")));
        for _ in 0..2 {
            let next = host.now_ms + 1000;
            tick(&mut p, &mut host, next);
            let sent = host.now_ms;
            for (token, cluster, _) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                if cluster == "prom" {
                    a.status = Some(503);
                }
                host.now_ms = sent + 5;
                p.on_callout_response(&mut host, token, &mut a);
            }
        }
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure)),
            3
        );
        let warns = host
            .logs
            .iter()
            .filter(|(_, m)| m.contains("Prometheus query failed: status 503"))
            .count();
        assert_eq!(warns, 1);
        assert!(!published(&host).regions[1].metrics_ok);
    }

    #[test]
    fn the_first_round_comes_at_once_then_every_tick_and_publishes() {
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        assert_eq!(host.tick_ms, Some(FIRST_TICK_MS));
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(host.tick_ms, Some(1000));
        assert_eq!(host.value(Stat::Global(Global::ProbeTicks)), 1);
        // One health and one metrics callout per region, with its authority,
        // and at first its model list.
        let paths: Vec<_> = host
            .callouts
            .iter()
            .map(|(_, c, p)| (c.clone(), p.clone()))
            .collect();
        assert_eq!(
            paths,
            [
                ("cn", "/health"),
                ("cn", "/metrics"),
                ("cn", "/v1/models"),
                ("cm", "/health"),
                ("cm", "/metrics"),
                ("cm", "/v1/models")
            ]
            .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        answer_all(&mut p, &mut host, 12, Some(200), VLLM);
        // The snapshot is in shared data, its version gauge written after it.
        let (bytes, _) = host.store.map.get(SNAPSHOT_KEY).unwrap().clone();
        let snap = Snapshot::decode(&bytes).unwrap();
        assert_eq!(
            host.value(Stat::Global(Global::ProbeSnapshotVersion)) as u64,
            snap.version
        );
        assert_eq!(snap.regions[0].waiting, 3.0);
        assert_eq!(snap.regions[1].running, 5.0);
        assert_eq!(snap.regions[0].rtt_ms, Some(12.0));
        assert_eq!(snap.regions[1].max_model_len, Some(32768));
        assert_eq!(host.value(Stat::Region(1, RegionStat::EngineWaiting)), 3);
        assert_eq!(host.value(Stat::Region(0, RegionStat::MaxModelLen)), 32768);
        // A callout still out is not sent again.
        tick(&mut p, &mut host, T0 + 1050);
        tick(&mut p, &mut host, T0 + 1100);
        assert_eq!(
            host.callouts.len(),
            4,
            "the second round's callouts are still out"
        );
    }

    #[test]
    fn the_period_goes_fast_at_once_and_slow_after_calm_rounds() {
        let mut c = (*cfg("")).clone();
        c.probe.idle_rounds = 3;
        let p = &c.probe;
        assert_eq!(next_period(p, 1000, false, 0), (1000, 0));
        assert_eq!(next_period(p, 1000, true, 0), (250, 0));
        // Calm rounds count only at the fast period; a busy one resets them.
        assert_eq!(next_period(p, 250, false, 0), (250, 1));
        assert_eq!(next_period(p, 250, false, 1), (250, 2));
        assert_eq!(next_period(p, 250, true, 2), (250, 0));
        assert_eq!(next_period(p, 250, false, 2), (1000, 0));
        // Busy period equal to the idle one: no adaptation.
        c.probe.busy_tick_ms = Some(1000);
        assert_eq!(next_period(&c.probe, 1000, true, 0), (1000, 0));
    }

    #[test]
    fn a_busy_fleet_is_scraped_every_busy_tick_and_health_keeps_its_period() {
        const QUEUED: &str = "vllm:num_requests_waiting 2\nvllm:num_requests_running 4\n";
        const HALF: &str = "vllm:num_requests_waiting 0\nvllm:num_requests_running 2\n";
        const QUIET: &str = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n";
        // max_concurrency 4 (busy at 2 running and none waiting), idle
        // after 4 calm rounds.
        let c = Rc::new(
            Config::parse(
                br#"{"regions":[
                  {"name":"near","cluster":"cn","capacity_rps":5,"max_concurrency":4},
                  {"name":"mid","cluster":"cm","capacity_rps":5,"max_concurrency":4}],
                  "probe":{"tick_ms":1000,"timeout_ms":500,"idle_rounds":4}}"#,
            )
            .unwrap(),
        );
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0;
        // One round at `at` + `step`, answered with `body`: the paths sent
        // and the period set after it.
        let mut round = |p: &mut Probe, host: &mut Recorder, step: u64, body: &str| {
            at += step;
            tick(p, host, at);
            let mut paths: Vec<String> = host.callouts.iter().map(|(_, _, p)| p.clone()).collect();
            paths.sort();
            paths.dedup();
            answer_all(p, host, 5, Some(200), body);
            (paths, host.tick_ms.unwrap_or(0))
        };
        let gauge = |host: &Recorder| host.value(Stat::Global(Global::ProbeTickMs));
        let (_, period) = round(&mut p, &mut host, 50, QUIET);
        assert_eq!((period, gauge(&host)), (1000, 1000));
        // Idle: the slow period, round after round.
        let (_, period) = round(&mut p, &mut host, 1000, QUIET);
        assert_eq!(period, 1000);
        // A region with a queue: fast from the next round on.
        let (paths, _) = round(&mut p, &mut host, 1000, QUEUED);
        assert_eq!(paths, ["/health", "/metrics"]);
        let (paths, period) = round(&mut p, &mut host, 1000, QUEUED);
        assert_eq!(paths, ["/health", "/metrics"]);
        assert_eq!((period, gauge(&host)), (250, 250));
        // Between full rounds, only the metrics scrape; health every 1000 ms.
        let mut sent = Vec::new();
        for _ in 0..8 {
            sent.push(round(&mut p, &mut host, 250, QUEUED).0.join(","));
        }
        assert_eq!(
            sent,
            [
                "/metrics",
                "/metrics",
                "/metrics",
                "/health,/metrics",
                "/metrics",
                "/metrics",
                "/metrics",
                "/health,/metrics"
            ]
        );
        // Utilization at the threshold (2 of 4 slots) is still busy.
        for _ in 0..6 {
            assert_eq!(round(&mut p, &mut host, 250, HALF).1, 250);
        }
        // Quiet (seen from the first quiet scrape's answer on): three calm
        // rounds stay fast, the fourth goes slow.
        let periods: Vec<u64> = (0..6)
            .map(|_| round(&mut p, &mut host, 250, QUIET).1)
            .collect();
        assert_eq!(periods, [250, 250, 250, 250, 1000, 1000]);
        assert_eq!(gauge(&host), 1000);
        assert_eq!(host.value(Stat::Global(Global::ProbeTicks)), 24);
    }

    #[test]
    fn the_ladder_above_0_keeps_the_period_fast() {
        let key = api_key_digest("op");
        let c = cfg(&format!(r#","ladder":{{"operator_keys":["{key}"]}}"#));
        let mut host = Recorder::default();
        host.store.set(LADDER_OVERRIDE_KEY, b"2", None).unwrap();
        let mut p = started(&c, "a", &mut host);
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(host.tick_ms, Some(250));
        // Released to 0 by the operator: at the next full round (1050),
        // then 8 calm rounds (the default).
        host.store.set(LADDER_OVERRIDE_KEY, b"0", None).unwrap();
        let periods: Vec<u64> = (1..=11)
            .map(|i| {
                tick(&mut p, &mut host, T0 + 50 + 250 * i);
                host.tick_ms.unwrap_or(0)
            })
            .collect();
        assert_eq!(periods[..10], [250; 10]);
        assert_eq!(periods[10], 1000);
    }

    #[test]
    fn one_loop_per_process_by_the_lease() {
        let c = cfg("");
        let mut host = Recorder::default();
        let mut a = started(&c, "a", &mut host);
        let mut b = started(&c, "b", &mut host);
        tick(&mut a, &mut host, T0 + 50);
        tick(&mut b, &mut host, T0 + 60);
        assert_eq!(
            host.value(Stat::Global(Global::ProbeTicks)),
            1,
            "b stays idle"
        );
        assert_eq!(host.callouts.len(), 6);
        // a stops renewing: after three ticks' time b takes over.
        tick(&mut b, &mut host, T0 + 50 + 3000);
        assert_eq!(host.value(Stat::Global(Global::ProbeTicks)), 1);
        tick(&mut b, &mut host, T0 + 50 + 3001);
        assert_eq!(host.value(Stat::Global(Global::ProbeTicks)), 2);
        tick(&mut a, &mut host, T0 + 50 + 3002);
        assert_eq!(
            host.value(Stat::Global(Global::ProbeTicks)),
            2,
            "a lost the lease"
        );
    }

    #[test]
    fn engines_that_fail_most_requests_are_ejected_and_cancellations_do_not_count() {
        let c = cfg(r#","release":{"ramp_s":0}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0;
        let mut round = |p: &mut Probe, host: &mut Recorder, near: [i64; 3]| {
            for (st, n) in [
                (RegionStat::UpstreamFailure, near[0]),
                (RegionStat::UpstreamRqAnswered, near[1]),
                (RegionStat::ClientCancelled, near[2]),
            ] {
                host.count(Stat::Region(0, st), n);
            }
            at += 1000;
            tick(p, host, at);
            answer_all(p, host, 5, Some(200), VLLM);
        };
        round(&mut p, &mut host, [0, 0, 0]);
        // A storm of cancellations: no evidence against near.
        for _ in 0..4 {
            round(&mut p, &mut host, [0, 0, 30]);
        }
        assert!(!p.fleet().is_ejected(0));
        assert!(!host.logs.iter().any(|(_, m)| m.contains("ejected")));
        // Most tries failing for unhealthy_after (2) ticks: ejected, logged
        // with the tick.
        round(&mut p, &mut host, [6, 2, 0]);
        assert!(!p.fleet().is_ejected(0));
        round(&mut p, &mut host, [5, 5, 0]);
        assert!(p.fleet().is_ejected(0));
        let line = host
            .logs
            .iter()
            .find(|(_, m)| m.contains("region near ejected"))
            .unwrap();
        assert!(line.1.ends_with("probe tick 7)"), "{}", line.1);
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 0);
    }

    #[test]
    fn a_region_reporting_no_digest_under_parity_is_said_once() {
        let c = cfg(r#","release":{"expected":"sha256:a","source":"health_json","name":"digest"}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // near: no digest, then one, then none again; the others report it.
        for (i, near) in ["{}", "{}", r#"{"digest":"sha256:a"}"#, "{}", "{}"]
            .iter()
            .enumerate()
        {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            host.now_ms += 5;
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let body = match (cluster.as_str(), path.as_str()) {
                    (_, "/metrics") => VLLM.as_bytes().to_vec(),
                    ("cn", _) => near.as_bytes().to_vec(),
                    _ => br#"{"digest":"sha256:a"}"#.to_vec(),
                };
                let mut a = Answer {
                    status: Some(200),
                    body,
                    ..Answer::default()
                };
                p.on_callout_response(&mut host, token, &mut a);
            }
        }
        let said: Vec<&str> = host
            .logs
            .iter()
            .filter(|(_, m)| m.contains("no release digest"))
            .map(|(_, m)| m.as_str())
            .collect();
        assert_eq!(said.len(), 2, "{said:?}");
        assert_eq!(said[0], "llm-geo-router probe: region near: no release digest (health_json \"digest\"); release parity (sha256:a) does not apply to it until it reports one");
        // Routed as docs/CONFIG.md says: no digest is no mismatch.
        assert!(p.fleet.snapshot(&c, T0 + 6000).regions[0].release_ok);
    }

    #[test]
    fn garbage_metrics_refused_callouts_and_releases() {
        let c = cfg(r#","release":{"expected":"sha256:a","source":"health_json","name":"digest"}"#);
        let mut host = Recorder {
            refuse_clusters: vec!["cm".into()],
            ..Recorder::default()
        };
        let mut p = started(&c, "a", &mut host);
        for i in 0..3 {
            tick(&mut p, &mut host, T0 + 1000 * (i + 1));
            let sent = host.now_ms;
            host.now_ms += 5;
            for (token, _, path) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    body: if path == "/metrics" {
                        b"\x00garbage{".to_vec()
                    } else {
                        br#"{"digest":"sha256:a"}"#.to_vec()
                    },
                    ..Answer::default()
                };
                p.on_callout_response(&mut host, token, &mut a);
            }
            host.now_ms = sent;
        }
        let warned = |what: &str| host.logs.iter().filter(|(_, m)| m.contains(what)).count();
        // Once per region, not per tick.
        assert_eq!(warned("region near: metrics scrape failed"), 1);
        assert_eq!(warned("region mid: callout to cluster \"cm\" refused"), 1);
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::MetricsScrapeFailure)),
            3
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::HealthProbeFailure)),
            3
        );
        // Health by the health probe: near up, on the expected release; mid
        // (no callout possible) down.
        let snap = p.fleet.snapshot(&c, T0 + 4000);
        assert!(snap.regions[0].healthy && snap.regions[0].release_ok);
        assert!(!snap.regions[1].healthy);
    }

    #[test]
    fn another_familys_metrics_are_a_failed_scrape_and_never_an_idle_engine() {
        // near is configured as SGLang but runs vLLM, saturated: 8 running
        // on its 8 slots, 8 waiting. mid is vLLM, idle.
        let c = Rc::new(
            Config::parse(
                br#"{"regions":[
                  {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":8,"engine":"sglang"},
                  {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":8}],
                  "probe":{"tick_ms":1000,"timeout_ms":500}}"#,
            )
            .unwrap(),
        );
        const SATURATED: &str =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
vllm:num_requests_running{model_name=\"m\"} 8.0\nvllm:num_requests_waiting{model_name=\"m\"} 8.0\n";
        const IDLE: &str = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n";
        const SGLANG: &str = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n";
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let round = |p: &mut Probe, host: &mut Recorder, at: u64, near: &str| {
            tick(p, host, at);
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                if path == "/metrics" {
                    a.body = if cluster == "cn" { near } else { IDLE }.into();
                }
                // near 5 ms away, mid 40.
                host.now_ms = at + if cluster == "cn" { 5 } else { 40 };
                p.on_callout_response(host, token, &mut a);
            }
            host.now_ms = at;
        };
        for i in 1..=3 {
            round(&mut p, &mut host, T0 + 1000 * i, SATURATED);
        }
        // Counted at every scrape, warned once, naming the region, the
        // family expected and what came back.
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::MetricsScrapeFailure)),
            3
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::MetricsScrapeFailure)),
            0
        );
        let warnings = |host: &Recorder| -> Vec<String> {
            host.logs
                .iter()
                .map(|(_, m)| m.clone())
                .filter(|m| m.contains("region near: metrics scrape failed"))
                .collect()
        };
        assert_eq!(
            warnings(&host),
            ["llm-geo-router probe: region near: metrics scrape failed: metrics payload has no sglang load figure (sglang:num_queue_reqs, sglang:num_running_reqs); its first sample is vllm:num_requests_running (is regions[].engine right?)"]
        );
        // Priced as unknown load: a cold prompt goes to mid, not to the
        // nearest region taken for idle.
        let snap = published(&host);
        assert!(!snap.regions[0].metrics_ok && snap.regions[0].load_unknown);
        let decide = |snap: &Snapshot| {
            crate::decision::cost::decide(&crate::decision::cost::Inputs {
                config: &c,
                snapshot: Some(snap),
                snapshot_index: &[Some(0), Some(1)],
                cached_blocks: &[0, 0],
                inflight: &[0.0, 0.0],
                prompt_tokens: 100,
                prompt_bytes: 400,
                tokens_per_byte: 0.25,
                model: None,
                first_block: Some(7),
                allowed: None,
                fits: u64::MAX,
                weights: crate::decision::cost::Weights::configured(&c),
                now_ms: T0 + 3000,
            })
        };
        assert_eq!(decide(&snap).region, 1, "{:?}", decide(&snap).costs);
        // The right family's figures: known again, and the warning re-armed.
        round(&mut p, &mut host, T0 + 4000, SGLANG);
        let snap = published(&host);
        assert!(snap.regions[0].metrics_ok && !snap.regions[0].load_unknown);
        assert_eq!(decide(&snap).region, 0);
        round(&mut p, &mut host, T0 + 5000, SATURATED);
        assert_eq!(warnings(&host).len(), 2);
    }

    /// The model-list callouts of the last round, answered `ms` later with
    /// `status` and `body` (the other callouts are answered 200, empty).
    fn answer_models(
        p: &mut Probe,
        host: &mut Recorder,
        status: Option<u32>,
        body: &[u8],
    ) -> usize {
        let mut n = 0;
        for (token, _, path) in std::mem::take(&mut host.callouts) {
            let mut a = Answer {
                status: Some(200),
                ..Answer::default()
            };
            if path == "/v1/models" {
                n += 1;
                a.status = status;
                a.body = body.to_vec();
            }
            p.on_callout_response(host, token, &mut a);
        }
        n
    }

    #[test]
    fn the_context_limit_is_read_at_start_then_every_refresh_and_on_recovery() {
        let c =
            cfg(r#","context":{"refresh_ticks":3},"release":{"source":"health_json","name":"d"}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let limit = |p: &mut Probe| {
            p.fleet
                .snapshot(&c, T0)
                .regions
                .iter()
                .map(|r| r.max_model_len)
                .collect::<Vec<_>>()
        };
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(
            answer_models(&mut p, &mut host, Some(200), MODELS.as_bytes()),
            2
        );
        assert_eq!(limit(&mut p), [Some(32768), Some(32768)]);
        assert!(host.logs.iter().any(|(_, m)| m == "llm-geo-router probe: region near: context limit 32768 tokens (max_model_len in /v1/models)"));
        // Not again in rounds 2 and 3; again in round 4.
        let mut reads = Vec::new();
        for round in 2..=7u64 {
            tick(&mut p, &mut host, T0 + 1000 * round);
            reads.push(answer_models(
                &mut p,
                &mut host,
                Some(200),
                br#"{"data":[{"max_model_len":8192}]}"#,
            ));
        }
        assert_eq!(reads, [0, 0, 2, 0, 0, 2]);
        assert_eq!(limit(&mut p), [Some(8192), Some(8192)]);
    }

    #[test]
    fn a_region_back_from_an_outage_or_on_another_release_is_read_again() {
        let c = cfg(
            r#","context":{"refresh_ticks":1000},"release":{"source":"health_json","name":"d"}"#,
        );
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // Each round: health as `health(cluster)` says, with that release;
        // the model lists read (by cluster).
        let round = |p: &mut Probe,
                     host: &mut Recorder,
                     at: u64,
                     health: &dyn Fn(&str) -> (u32, &'static str)| {
            tick(p, host, T0 + 1000 * at);
            let mut read = Vec::new();
            for (token, cluster, path) in std::mem::take(&mut host.callouts) {
                let (status, release) = health(&cluster);
                let mut a = Answer {
                    status: Some(200),
                    ..Answer::default()
                };
                match path.as_str() {
                    "/health" => {
                        a.status = Some(status);
                        a.body = format!(r#"{{"d":"{release}"}}"#).into_bytes();
                    }
                    "/v1/models" => {
                        a.body = MODELS.as_bytes().to_vec();
                        read.push(cluster);
                    }
                    _ => {}
                }
                p.on_callout_response(host, token, &mut a);
            }
            read
        };
        let up = |_: &str| (200, "one");
        assert_eq!(round(&mut p, &mut host, 1, &up), ["cn", "cm"]);
        assert!(round(&mut p, &mut host, 2, &up).is_empty());
        // near down for two rounds (unhealthy), up for two (healthy again):
        // read in the round after.
        let near_down = |c: &str| {
            if c == "cn" {
                (503, "one")
            } else {
                (200, "one")
            }
        };
        for at in 3..=4 {
            assert!(round(&mut p, &mut host, at, &near_down).is_empty());
        }
        for at in 5..=6 {
            assert!(round(&mut p, &mut host, at, &up).is_empty());
        }
        assert_eq!(round(&mut p, &mut host, 7, &up), ["cn"]);
        // mid redeployed on another release: read in the round after.
        let mid_two = |c: &str| {
            if c == "cm" {
                (200, "two")
            } else {
                (200, "one")
            }
        };
        assert!(round(&mut p, &mut host, 8, &mid_two).is_empty());
        assert_eq!(round(&mut p, &mut host, 9, &mid_two), ["cm"]);
        assert!(round(&mut p, &mut host, 10, &mid_two).is_empty());
    }

    #[test]
    fn a_model_list_that_cannot_be_read_leaves_the_limit_and_warns_once() {
        let c = cfg(r#","context":{"refresh_ticks":1}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let huge = format!(
            r#"{{"data":[{{"max_model_len":4096,"pad":"{}"}}]}}"#,
            "x".repeat(MODELS_BODY_MAX)
        );
        let bad: [(Option<u32>, &[u8]); 7] = [
            (Some(200), b"\x00garbage{"),
            (Some(200), br#"{"data":[{"max_model_len":"4096"}]}"#),
            (
                Some(200),
                br#"{"data":[{"id":"lora","max_model_len":null}]}"#,
            ),
            (Some(200), huge.as_bytes()),
            (Some(404), MODELS.as_bytes()),
            (None, b""),
            (Some(200), b""),
        ];
        for (i, (status, body)) in bad.iter().enumerate() {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            answer_models(&mut p, &mut host, *status, body);
        }
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::ModelsReadFailure)),
            7
        );
        let warnings: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("region near: model list"))
            .collect();
        assert_eq!(
            warnings,
            ["llm-geo-router probe: region near: model list /v1/models not read: model list is not JSON: expected value at line 1 column 1; its context limit stays unknown"]
        );
        assert_eq!(p.fleet.model_limit(0), None);
        // Read once, the limit stands through failures; a success re-arms
        // the warning.
        tick(&mut p, &mut host, T0 + 10_000);
        answer_models(
            &mut p,
            &mut host,
            Some(200),
            br#"{"data":[{"max_model_len":4096}]}"#,
        );
        tick(&mut p, &mut host, T0 + 11_000);
        answer_models(&mut p, &mut host, Some(200), huge.as_bytes());
        assert_eq!(p.fleet.model_limit(0), Some(4096));
        assert!(host.logs.iter().any(|(_, m)| m == "llm-geo-router probe: region near: model list /v1/models not read: the body is larger than 256 KiB; its context limit stays 4096 tokens"));
        assert_eq!(host.value(Stat::Region(0, RegionStat::MaxModelLen)), 4096);
    }

    #[test]
    fn cache_capacity_gauge_follows_the_engine_unless_configured_and_warns_once_per_kind() {
        let c = Rc::new(
            Config::parse(
                br#"{"regions":[
                  {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5},
                  {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"cache_tokens":5000}],
                  "probe":{"tick_ms":1000,"timeout_ms":500}}"#,
            )
            .unwrap(),
        );
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let info = |blocks: &str| {
            format!("{VLLM}vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"{blocks}\",num_gpu_blocks_override=\"None\"}} 1.0\n")
        };
        let bodies = [
            VLLM.to_string(),
            VLLM.to_string(),
            info("None"),
            info("-3"),
            info("1024"),
            info("0"),
            info("0"),
        ];
        let mut gauges = Vec::new();
        for (i, body) in bodies.iter().enumerate() {
            tick(&mut p, &mut host, T0 + 1000 * (i as u64 + 1));
            answer_all(&mut p, &mut host, 5, Some(200), body);
            gauges.push((
                host.value(Stat::Region(0, RegionStat::CacheCapacityTokens)),
                host.value(Stat::Region(1, RegionStat::CacheCapacityTokens)),
            ));
        }
        // Unknown is 0 on the gauge; the override wins from the start; a
        // refused figure leaves the last valid one.
        assert_eq!(
            gauges,
            [
                (0, 5000),
                (0, 5000),
                (0, 5000),
                (0, 5000),
                (16_384, 5000),
                (16_384, 5000),
                (16_384, 5000)
            ]
        );
        assert_eq!(published(&host).regions[0].cache_tokens, Some(16_384));
        assert_eq!(published(&host).regions[1].cache_tokens, Some(5000));
        // Four refused figures at near, four at mid (counted, not warned).
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::CacheCapacityRejected)),
            4
        );
        assert_eq!(
            host.value(Stat::Region(1, RegionStat::CacheCapacityRejected)),
            4
        );
        let warnings: Vec<&str> = host
            .logs
            .iter()
            .map(|(_, m)| m.as_str())
            .filter(|m| m.contains("capacity"))
            .collect();
        assert_eq!(
            warnings,
            [
                "llm-geo-router probe: region near: the engine exports no KV-cache capacity (vllm:cache_config_info (num_gpu_blocks x block_size)); its capacity stays unknown (set regions[].cache_tokens to give it)",
                "llm-geo-router probe: region near: KV-cache capacity ignored: vllm:cache_config_info num_gpu_blocks=\"None\" is not a whole number in 1..=1000000000000; its capacity stays unknown (set regions[].cache_tokens to give it)",
                "llm-geo-router probe: region near: KV-cache capacity ignored: vllm:cache_config_info num_gpu_blocks=\"0\" is not a whole number in 1..=1000000000000; its capacity stays 16384 tokens (set regions[].cache_tokens to give it)",
            ]
        );
    }

    #[test]
    fn the_operators_override_counts_only_with_operator_keys() {
        let key = api_key_digest("op");
        for (extra, value, expect) in [
            (
                format!(r#","ladder":{{"operator_keys":["{key}"]}}"#),
                "3",
                Some(3),
            ),
            (
                format!(r#","ladder":{{"operator_keys":["{key}"]}}"#),
                " 4\n",
                Some(4),
            ),
            (
                format!(r#","ladder":{{"operator_keys":["{key}"]}}"#),
                "",
                None,
            ),
            (
                format!(r#","ladder":{{"operator_keys":["{key}"]}}"#),
                "x",
                None,
            ),
            (String::new(), "3", None),
        ] {
            let c = cfg(&extra);
            let mut host = Recorder::default();
            host.store
                .set(LADDER_OVERRIDE_KEY, value.as_bytes(), None)
                .unwrap();
            let mut p = started(&c, "a", &mut host);
            tick(&mut p, &mut host, T0 + 50);
            assert_eq!(p.fleet.level(), expect.unwrap_or(0), "{extra} {value:?}");
            assert_eq!(
                host.value(Stat::Global(Global::LadderOverrideActive)),
                i64::from(expect.is_some())
            );
        }
    }

    #[test]
    fn observations_from_the_queue_tune_the_cost() {
        let c = cfg(r#","tuning":{"min_samples":4}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        for i in 0..6 {
            let o = Observation {
                region: 0,
                rtt_ms: 5.0,
                queue_ms: 0.0,
                uncached_tokens: 1000 + 100 * i,
                prefill_ms: 100.0,
                observed_ms: 5.0 + 0.4 * (1000.0 + 100.0 * i as f32),
            };
            host.enqueue(OBSERVATIONS_QUEUE, &o.encode());
        }
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(host.value(Stat::Global(Global::TuningObservations)), 6);
        assert!(host.queues[OBSERVATIONS_QUEUE].is_empty());
    }
}
