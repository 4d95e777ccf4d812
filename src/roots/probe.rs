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
//!
//! This file holds the loop (lease, period, callouts, the queue and
//! counters read each round, health); the engines' answers, the
//! `prometheus` source, the exchange and the publication are in the
//! `probe_*` files beside it.

use std::collections::HashMap;
use std::rc::Rc;

use crate::cache::exchange::{self, Body, Exchange};
use crate::cache::stored_responses;
use crate::config::{Config, LoadSource, ProbeConfig, ReleaseSource};
use crate::fleet::assess::Assessment;
use crate::fleet::state::{Fleet, HealthChange};
use crate::learning::calibration::Verdict;
use crate::learning::tuning::Observation;
use crate::learning::usage::UsageReport;
use crate::shared::host_api::{CalloutResponse, Level, ProbeHost};
use crate::shared::names::{
    Global, RegionStat, Stat, LADDER_OVERRIDE_KEY, LEASE_KEY, OBSERVATIONS_QUEUE,
};
use crate::shared::store::SetOutcome;

/// Observations drained per tick at most: a bound on the work one tick does.
const MAX_OBSERVATIONS_PER_TICK: usize = 10_000;

/// The first round runs this soon after start rather than a whole
/// `probe.tick_ms` later, so that a new Envoy routes on measured figures
/// within a round trip (and a long tick cannot leave it without a snapshot).
pub const FIRST_TICK_MS: u64 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Health,
    Metrics,
    Models,
    /// The `prometheus` load source's query, for every region using it.
    Prometheus,
    /// A message to a peer Envoy.
    Exchange,
    /// Whether the engine kept a response (`probe_store`).
    StoreCheck,
}

/// Token-less region index of the Prometheus query in `pending`.
pub(super) const ALL_REGIONS: usize = usize::MAX;

/// What the last warning about a region's KV-cache capacity said, so that
/// a figure missing or refused scrape after scrape is warned about once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CapacityWarned {
    Nothing,
    Missing,
    Refused,
}

#[derive(Debug)]
pub struct Probe {
    pub(super) cfg: Rc<Config>,
    pub(super) fleet: Fleet,
    owner: String,
    /// Callouts in flight: token → (region, kind, sent at).
    pub(super) pending: HashMap<u32, (usize, Kind, u64)>,
    /// Per region: the outcome counters (answered, failures) at the last tick.
    last_upstream: Vec<Option<(u64, u64)>>,
    pub(super) metrics_warned: Vec<bool>,
    pub(super) models_warned: Vec<bool>,
    /// Per region: warned that it reports no release digest while parity
    /// is configured (again after it reports one and then stops).
    pub(super) digest_warned: Vec<bool>,
    dispatch_warned: Vec<bool>,
    pub(super) capacity_warned: Vec<CapacityWarned>,
    /// Per region: when its engine's restart was last logged (0: never),
    /// and the restarts seen since that were not (`engine_restarted`).
    pub(super) restart_logged: Vec<(u64, u32)>,
    pub(super) last_assessment: Assessment,
    /// Rounds this root context has run (holding the lease).
    pub(super) rounds: u64,
    /// Per region: the round from which its model list is to be read.
    pub(super) models_due: Vec<u64>,
    /// The tick period last set on the host (ms).
    period_ms: u64,
    /// When the last full round ran.
    last_full_ms: Option<u64>,
    /// Busy-period rounds in a row with the fleet not busy.
    calm_rounds: u32,
    /// The `prometheus` source's request path (query included), if any
    /// region uses it.
    pub(super) prom_path: Option<String>,
    pub(super) prom_warned: bool,
    /// Per region using the `prometheus` source: (time, this Envoy's
    /// in-flight requests) at each tick, oldest first.
    pub(super) inflight_history: Vec<std::collections::VecDeque<(u64, f64)>>,
    /// The exchange with the deployment's other Envoys, when configured.
    pub(super) exchange: Option<Exchange>,
    /// When the last exchange message went out.
    pub(super) exchange_sent_ms: Option<u64>,
    pub(super) exchange_warned: bool,
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
            restart_logged: vec![(0, 0); n],
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
                            self.health(host, i, None, "the host refused its health callout");
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
        // An answer without headers is a failed callout (timeout, reset):
        // no status, whatever a stale `:status` read would give.
        let status = match response.header_count() {
            0 => None,
            _ => response.status(),
        };
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        match kind {
            Kind::Health => {
                let rtt = ok.then(|| now.saturating_sub(sent) as f64);
                if ok && self.cfg.release.source != ReleaseSource::MetricsLabel {
                    let digest = self.health_release(response);
                    self.release(host, region, digest);
                }
                // Envoy answers a callout that timed out with its own 504
                // ("upstream request timeout"): no answer from the engine.
                let changed = match status {
                    None | Some(504) => self.health_unanswered(host, region),
                    Some(_) if ok => self.health(host, region, rtt, ""),
                    Some(s) => self.health(
                        host,
                        region,
                        None,
                        &format!("its health probe answered {s}"),
                    ),
                };
                if changed {
                    self.publish(host, now);
                }
            }
            Kind::Metrics => self.metrics(host, region, status, response, now),
            Kind::Models => self.models(host, region, status, response, now),
            Kind::Prometheus => self.prometheus(host, status, response, now),
            Kind::StoreCheck => self.store_checked(host, region, status, response, now),
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
                Some(&stored_responses::STORE_CHECK_TAG) => {
                    if let Some((region, id)) = stored_responses::decode_store_check(&bytes) {
                        self.check_store(host, region, id);
                    }
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

    /// A health probe that got no answer: not held against a region whose
    /// engines are answering requests (`Fleet::on_health_unanswered`),
    /// counted in `health_probe_busy`; else a failed probe.
    fn health_unanswered(&mut self, host: &mut dyn ProbeHost, region: usize) -> bool {
        host.count(Stat::Region(region, RegionStat::HealthProbeFailure), 1);
        match self
            .fleet
            .on_health_unanswered(&self.cfg, region, host.now_ms())
        {
            None => {
                host.count(Stat::Region(region, RegionStat::HealthProbeBusy), 1);
                false
            }
            Some(change) => {
                self.health_changed(host, region, change, "its health probes went unanswered")
            }
        }
    }

    /// Feed one health result (`why` it failed, for the log); true when
    /// the region's health changed.
    fn health(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        rtt: Option<f64>,
        why: &str,
    ) -> bool {
        if rtt.is_none() {
            host.count(Stat::Region(region, RegionStat::HealthProbeFailure), 1);
        }
        let change = self.fleet.on_health(&self.cfg, region, rtt);
        self.health_changed(host, region, change, why)
    }

    /// Act on a change of a region's health; true when it changed.
    fn health_changed(
        &mut self,
        host: &mut dyn ProbeHost,
        region: usize,
        change: HealthChange,
        why: &str,
    ) -> bool {
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
                        "llm-geo-router probe: region {name} is unhealthy ({why}); no new requests go there"
                    ),
                );
                true
            }
        }
    }
}

/// The override value in shared data: a level, or empty for none.
fn parse_override_value(v: &[u8]) -> Option<u8> {
    std::str::from_utf8(v).ok()?.trim().parse::<u8>().ok()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fleet::snapshot::Snapshot;
    use crate::roots::guard::api_key_digest;
    use crate::shared::host_api::{Answer, Effects, Recorder, StreamHost};
    use crate::shared::names::SNAPSHOT_KEY;
    use crate::shared::store::SharedStore;

    pub(crate) const T0: u64 = 1_700_000_000_000;
    pub(crate) const VLLM: &str = "vllm:num_requests_waiting{model_name=\"m\"} 3.0\nvllm:num_requests_running{model_name=\"m\"} 5.0\n";
    pub(crate) const MODELS: &str = r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768},{"id":"lora","object":"model","max_model_len":null}]}"#;

    pub(crate) fn cfg(extra: &str) -> Rc<Config> {
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

    pub(crate) fn started(c: &Rc<Config>, owner: &str, host: &mut Recorder) -> Probe {
        host.now_ms = T0;
        let mut p = Probe::new(c.clone(), owner.into(), T0);
        assert!(p.start(host));
        p
    }

    /// Answer every callout of the last tick `ms` later: health 200, metrics
    /// with `metrics` as the body (or `status` for both).
    pub(crate) fn answer_all(
        p: &mut Probe,
        host: &mut Recorder,
        ms: u64,
        status: Option<u32>,
        metrics: &str,
    ) {
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

    pub(crate) fn tick(p: &mut Probe, host: &mut Recorder, at: u64) {
        host.now_ms = at;
        p.on_tick(host);
    }

    pub(crate) fn published(host: &Recorder) -> Snapshot {
        let (bytes, _) = host.store.map.get(SNAPSHOT_KEY).unwrap().clone();
        Snapshot::decode(&bytes).unwrap()
    }

    /// An answer with a `:status` to read but no headers, as Envoy hands a
    /// root a reset or timed-out callout.
    struct Headerless;
    impl CalloutResponse for Headerless {
        fn header_count(&mut self) -> usize {
            0
        }
        fn status(&mut self) -> Option<u32> {
            Some(200)
        }
        fn header(&mut self, _: &str) -> Option<String> {
            None
        }
        fn body(&mut self, _: usize) -> Option<Vec<u8>> {
            None
        }
    }

    #[test]
    fn a_callout_answered_without_headers_failed() {
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        tick(&mut p, &mut host, T0 + 50);
        let health = host
            .callouts
            .iter()
            .find(|(_, c, path)| c == "cn" && path == "/health")
            .map(|(t, _, _)| *t)
            .unwrap();
        p.on_callout_response(&mut host, health, &mut Headerless);
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::HealthProbeFailure)),
            1
        );
    }

    #[test]
    fn an_engine_that_answers_it_is_down_is_logged_with_its_status() {
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0;
        for _ in 0..3 {
            at += 1000;
            tick(&mut p, &mut host, at);
            answer_all(&mut p, &mut host, 5, Some(503), "");
        }
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 0);
        assert!(host.logs.iter().any(|(_, m)| m
            == "llm-geo-router probe: region near is unhealthy (its health probe answered \
                503); no new requests go there"));
        // Unhealthy by an answer: no follow-up is sent there.
        let snap = p.fleet.snapshot(&c, at);
        assert!(!snap.regions[0].healthy && !snap.regions[0].unanswered);
    }

    #[test]
    fn a_busy_engine_whose_probes_time_out_stays_healthy_a_silent_one_does_not() {
        // Both regions' /health and /metrics go unanswered (timed out) for
        // five ticks (unhealthy_after is 2). near's engines answer this
        // Envoy's requests all along: busy, not dead (vLLM decoding on two
        // cores answered its probes after more than a second). mid
        // answers nothing: it goes (issue 45, item 10).
        let c = cfg(r#","release":{"ramp_s":0}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0;
        at += 1000;
        tick(&mut p, &mut host, at);
        let idle = "vllm:num_requests_waiting{model_name=\"m\"} 0.0\nvllm:num_requests_running{model_name=\"m\"} 0.0\n";
        answer_all(&mut p, &mut host, 5, Some(200), idle);
        for round in 0..5 {
            host.count(Stat::Region(0, RegionStat::UpstreamRqAnswered), 20);
            at += 1000;
            tick(&mut p, &mut host, at);
            for (token, _, _) in std::mem::take(&mut host.callouts) {
                // A timed-out callout: no headers, or Envoy's own 504.
                if round % 2 == 0 {
                    p.on_callout_response(&mut host, token, &mut Headerless);
                } else {
                    let mut timed_out = Answer {
                        status: Some(504),
                        ..Answer::default()
                    };
                    p.on_callout_response(&mut host, token, &mut timed_out);
                }
            }
        }
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 1);
        assert!(host.value(Stat::Region(0, RegionStat::HealthProbeBusy)) >= 4);
        assert_eq!(host.value(Stat::Region(1, RegionStat::Healthy)), 0);
        assert_eq!(host.value(Stat::Region(1, RegionStat::HealthProbeBusy)), 0);
        // The log says why: its probes got no answer; its own follow-ups
        // are still sent there.
        assert!(p.fleet.snapshot(&c, at).regions[1].unanswered);
        assert!(host.logs.iter().any(|(_, m)| m
            == "llm-geo-router probe: region mid is unhealthy (its health probes went \
                unanswered); no new requests go there"));
        // Serving but failing most requests: the timeouts count again.
        for _ in 0..3 {
            host.count(Stat::Region(0, RegionStat::UpstreamFailure), 20);
            at += 1000;
            tick(&mut p, &mut host, at);
            for (token, _, _) in std::mem::take(&mut host.callouts) {
                p.on_callout_response(&mut host, token, &mut Headerless);
            }
        }
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 0);
    }

    #[test]
    fn an_engine_whose_last_scrape_showed_work_has_ten_ticks_of_credit() {
        // Busy with another Envoy's requests (this one sends none): its
        // last good scrape showed 5 running and 3 waiting, then every probe
        // times out. Busy, not dead, for ten ticks; silent longer, hung.
        let c = cfg(r#","release":{"ramp_s":0}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0 + 1000;
        tick(&mut p, &mut host, at);
        answer_all(&mut p, &mut host, 5, Some(200), VLLM);
        let mut silent = |p: &mut Probe, host: &mut Recorder, ticks: u64| {
            for _ in 0..ticks {
                at += 1000;
                tick(p, host, at);
                for (token, _, _) in std::mem::take(&mut host.callouts) {
                    p.on_callout_response(host, token, &mut Headerless);
                }
            }
        };
        silent(&mut p, &mut host, 8);
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 1);
        assert_eq!(host.value(Stat::Region(1, RegionStat::Healthy)), 1);
        silent(&mut p, &mut host, 4);
        assert_eq!(host.value(Stat::Region(0, RegionStat::Healthy)), 0);
        assert_eq!(host.value(Stat::Region(1, RegionStat::Healthy)), 0);
    }

    #[test]
    fn the_probe_checks_whether_an_engine_keeps_its_responses() {
        let c = cfg("");
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        let mut at = T0 + 50;
        tick(&mut p, &mut host, at);
        answer_all(&mut p, &mut host, 5, Some(200), VLLM);
        // A router recorded resp_1 at mid and resp_2 at near: each region
        // is asked once, for the response recorded there.
        for (region, id) in [(1u16, "resp_1"), (0, "resp_2"), (1, "resp_3")] {
            host.enqueue(
                OBSERVATIONS_QUEUE,
                &stored_responses::encode_store_check(region, id),
            );
        }
        at += 1000;
        tick(&mut p, &mut host, at);
        let checks: Vec<(u32, String, String)> = host
            .callouts
            .iter()
            .filter(|(_, _, path)| path.starts_with("/v1/responses/"))
            .cloned()
            .collect();
        let asked: Vec<_> = checks
            .iter()
            .map(|(_, c, p)| (c.as_str(), p.as_str()))
            .collect();
        assert_eq!(
            asked,
            [
                ("cm", "/v1/responses/resp_1"),
                ("cn", "/v1/responses/resp_2")
            ]
        );
        // mid's engine does not know it (vLLM without its store), near's does.
        for (token, cluster, _) in checks {
            let mut a = Answer {
                status: Some(if cluster == "cm" { 404 } else { 200 }),
                ..Answer::default()
            };
            p.on_callout_response(&mut host, token, &mut a);
        }
        let snap = published(&host);
        assert_eq!(snap.regions[1].stores_responses, Some(false));
        assert_eq!(snap.regions[0].stores_responses, Some(true));
        assert!(host
            .logs
            .iter()
            .any(|(_, m)| m.contains("region mid: its engine does not keep the Responses")));
        // Known: no more checks.
        host.callouts.clear();
        host.enqueue(
            OBSERVATIONS_QUEUE,
            &stored_responses::encode_store_check(1, "resp_4"),
        );
        at += 1000;
        tick(&mut p, &mut host, at);
        assert!(!host
            .callouts
            .iter()
            .any(|(_, _, p)| p.starts_with("/v1/responses/")));
        // Garbage on the queue is ignored.
        host.enqueue(OBSERVATIONS_QUEUE, b"R\x01");
        host.enqueue(OBSERVATIONS_QUEUE, b"R\x00\x00bad id");
        tick(&mut p, &mut host, at + 1000);
        assert!(!host
            .callouts
            .iter()
            .any(|(_, _, p)| p.starts_with("/v1/responses/")));
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
        use crate::learning::tuning::Tuner;
        let c = cfg(r#","tuning":{"min_samples":4}"#);
        let mut host = Recorder::default();
        let mut p = started(&c, "a", &mut host);
        // Region 0 ("near", configured at 0.1 ms a token and nothing per
        // request) observed at 30 ms per request and 0.3 ms a token, over
        // 40 prompts of 500..4400 uncached tokens; region 1 not at all.
        let observations: Vec<Observation> = (0..40u32)
            .map(|i| {
                let u = 500 + 100 * i;
                Observation {
                    region: 0,
                    rtt_ms: 5.0,
                    queue_ms: 2.0,
                    uncached_tokens: u,
                    prefill_ms: 0.1 * u as f32,
                    observed_ms: 5.0 + 2.0 + 30.0 + 0.3 * u as f32,
                }
            })
            .collect();
        for o in &observations {
            host.enqueue(OBSERVATIONS_QUEUE, &o.encode());
        }
        tick(&mut p, &mut host, T0 + 50);
        assert_eq!(host.value(Stat::Global(Global::TuningObservations)), 40);
        assert!(host.queues[OBSERVATIONS_QUEUE].is_empty());
        // The fit those observations make is what the published snapshot
        // carries, for the cost to use.
        let mut tuner = Tuner::new(&c.tuning);
        for o in &observations {
            tuner.push(*o);
        }
        let fit = tuner.fit(&c.tuning, &[0.1, 0.1]).unwrap();
        let want = fit.prefill[0].unwrap();
        let snap = published(&host);
        let near = &snap.regions[0];
        let (Some(rate), Some(per_request)) =
            (near.prefill_ms_per_token, near.prefill_ms_per_request)
        else {
            panic!("no fitted prefill in the snapshot: {near:?}");
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
        assert!(
            close(rate, want.ms_per_token) && close(per_request, want.per_request_ms),
            "snapshot prefill {per_request} ms + {rate} ms/token, the observations' fit {want:?}"
        );
        // And that fit moved from the configured 0 ms + 0.1 ms/token to near
        // what the observations show (30 ms + 0.3 ms/token; the rate, shrunk
        // towards 0.1, a little under it, the per-request part taking up the
        // difference over these prompts: about 50 ms).
        assert!(
            (0.27..=0.33).contains(&rate) && (20.0..=60.0).contains(&per_request),
            "fitted {per_request} ms + {rate} ms/token, observed 30 ms + 0.3 ms/token"
        );
        // Region 1, without observations of its own, takes the window's fit.
        let mid = &snap.regions[1];
        let fleet = fit.prefill[1].unwrap();
        assert!(
            mid.prefill_ms_per_token
                .is_some_and(|r| close(r, fleet.ms_per_token)),
            "{mid:?} against {fleet:?}"
        );
    }
}
