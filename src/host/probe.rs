//! The `probe` singleton service: every tick, one health and one `/metrics`
//! callout per region through its Envoy cluster; results feed the pure
//! [`Fleet`], which publishes the snapshot to shared data and Envoy gauges.
//!
//! Exactly one probe loop per Envoy process: Envoy may run `on_configure`
//! for more than one root context of the singleton, so a lease in shared
//! data (owner id + heartbeat) decides which of them acts; the others stay
//! idle unless the owner stops renewing it for three ticks.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::types::LogLevel;

use super::calls::{self, log, HostStore, Metric};
use super::guard::ARRIVALS;
use super::router::{answered_name, rq_active_name, upstream_failure_name, OBSERVATIONS_QUEUE};
use crate::config::{Config, ReleaseSource};
use crate::directory::SharedStore;
use crate::fleet::{Fleet, HealthChange};
use crate::metrics::parse_engine_metrics;
use crate::snapshot::{Snapshot, SNAPSHOT_KEY};
use crate::tuning::Observation;

/// `ladder.capacity_ratio_pct` is capped at 100x (10000 %).
const RATIO_PCT_CAP: u64 = 10_000;

/// Shared-data key of the operator's runtime ladder override (written by
/// the guard's operator endpoint): a level 0..=5, or absent/empty for none.
pub const LADDER_OVERRIDE_KEY: &str = "llm_geo_router.ladder.override";

const LEASE_KEY: &str = "llm_geo_router.probe.lease";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Health,
    Metrics,
}

struct RegionStats {
    healthy: Metric,
    rtt_ms: Metric,
    waiting: Metric,
    running: Metric,
    kv_usage_pct: Metric,
    probe_failures: Metric,
    scrape_failures: Metric,
    rq_active: Metric,
    prefill_us_per_token: Metric,
    answered: Metric,
    upstream_failures: Metric,
    last_upstream: Option<(u64, u64)>,
}

pub struct Probe {
    cfg: Rc<Config>,
    fleet: Fleet,
    owner: String,
    pending: HashMap<u32, (usize, Kind, u64)>,
    regions: Vec<RegionStats>,
    arrivals: Metric,
    level: Metric,
    level_changed_s: Metric,
    ratio_pct: Metric,
    demand_rps: Metric,
    capacity_rps: Metric,
    callouts: Metric,
    ticks: Metric,
    snapshot_version: Metric,
    observations: Metric,
    w_rtt_milli: Metric,
    w_queue_milli: Metric,
    metrics_warned: Vec<bool>,
    dispatch_warned: Vec<bool>,
    queue: Option<u32>,
    assessment: Metric,
    last_assessment: crate::assess::Assessment,
    override_active: Metric,
    /// The first tick comes `FIRST_TICK_MS` after start; then `tick_ms`.
    first_tick: bool,
}

/// Observations drained per tick at most: a bound on the work one tick does.
const MAX_OBSERVATIONS_PER_TICK: usize = 10_000;

/// The first round runs this soon after start rather than a whole
/// `probe.tick_ms` later, so that a new Envoy routes on measured figures
/// within a round trip (and a long tick cannot leave it without a snapshot).
const FIRST_TICK_MS: u64 = 50;

impl Probe {
    pub fn new(cfg: Rc<Config>, context_id: u32) -> Option<Probe> {
        let now = calls::now_ms();
        let first = FIRST_TICK_MS.min(u64::from(cfg.probe.tick_ms));
        if calls::set_tick(Duration::from_millis(first)).is_err() {
            log(
                LogLevel::Error,
                "llm-geo-router probe: the host refused a tick period; configuration refused",
            );
            return None;
        }
        let regions = cfg
            .regions
            .iter()
            .map(|r| {
                let m = |what: &str| format!("llm_geo_router.region.{}.{what}", r.name);
                RegionStats {
                    healthy: Metric::gauge(&m("healthy")),
                    rtt_ms: Metric::gauge(&m("rtt_ms")),
                    waiting: Metric::gauge(&m("engine_waiting")),
                    running: Metric::gauge(&m("engine_running")),
                    kv_usage_pct: Metric::gauge(&m("engine_kv_usage_pct")),
                    probe_failures: Metric::counter(&m("health_probe_failure")),
                    scrape_failures: Metric::counter(&m("metrics_scrape_failure")),
                    rq_active: Metric::gauge(&rq_active_name(&r.name)),
                    prefill_us_per_token: Metric::gauge(&m("prefill_us_per_token")),
                    answered: Metric::counter(&answered_name(&r.name)),
                    upstream_failures: Metric::counter(&upstream_failure_name(&r.name)),
                    last_upstream: None,
                }
            })
            .collect();
        Some(Probe {
            fleet: Fleet::new(&cfg, now),
            owner: format!("{context_id}-{now}"),
            pending: HashMap::new(),
            regions,
            arrivals: Metric::counter(ARRIVALS),
            level: Metric::gauge("llm_geo_router.ladder.level"),
            level_changed_s: Metric::gauge("llm_geo_router.ladder.level_changed_unix_s"),
            ratio_pct: Metric::gauge("llm_geo_router.ladder.capacity_ratio_pct"),
            demand_rps: Metric::gauge("llm_geo_router.ladder.demand_rps"),
            capacity_rps: Metric::gauge("llm_geo_router.ladder.capacity_rps"),
            callouts: Metric::counter("llm_geo_router.probe.callouts"),
            ticks: Metric::counter("llm_geo_router.probe.ticks"),
            snapshot_version: Metric::gauge("llm_geo_router.probe.snapshot_version"),
            observations: Metric::counter("llm_geo_router.tuning.observations"),
            w_rtt_milli: Metric::gauge("llm_geo_router.tuning.w_rtt_milli"),
            w_queue_milli: Metric::gauge("llm_geo_router.tuning.w_queue_milli"),
            metrics_warned: vec![false; cfg.regions.len()],
            dispatch_warned: vec![false; cfg.regions.len()],
            assessment: Metric::gauge("llm_geo_router.assessment.state"),
            last_assessment: crate::assess::Assessment::Ok,
            override_active: Metric::gauge("llm_geo_router.ladder.override_active"),
            first_tick: true,
            queue: if cfg.tuning.enabled {
                calls::register_queue(OBSERVATIONS_QUEUE)
            } else {
                None
            },
            cfg,
        })
    }

    /// Take or renew the lease; true when this root context runs the loop.
    fn hold_lease(&self, now: u64) -> bool {
        let stale_after = 3 * u64::from(self.cfg.probe.tick_ms);
        let mut store = HostStore;
        let (current, cas) = match store.get(LEASE_KEY) {
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
            store.set(LEASE_KEY, value.as_bytes(), (cas != 0).then_some(cas)),
            Ok(crate::directory::SetOutcome::Stored)
        )
    }

    pub fn on_tick(&mut self) {
        if std::mem::take(&mut self.first_tick) {
            // From now on, the configured period (accepted at start).
            let _ = calls::set_tick(Duration::from_millis(u64::from(self.cfg.probe.tick_ms)));
        }
        let now = calls::now_ms();
        if !self.hold_lease(now) {
            return;
        }
        self.ticks.add(1);
        let timeout_ms = u64::from(self.cfg.probe.timeout_ms);
        // A callout the host never answered is forgotten after two timeouts.
        self.pending
            .retain(|_, (_, _, sent)| now.saturating_sub(*sent) <= 2 * timeout_ms + 1000);
        self.fleet.on_arrivals(&self.cfg, self.arrivals.get(), now);
        self.drain_observations();
        self.read_upstream_results();
        self.read_override();
        let cfg = self.cfg.clone();
        for (i, r) in cfg.regions.iter().enumerate() {
            let authority = cfg.region_authority(i).unwrap_or(&r.cluster);
            for (kind, path) in [
                (Kind::Health, &r.health_path),
                (Kind::Metrics, &r.metrics_path),
            ] {
                if self
                    .pending
                    .values()
                    .any(|(ri, k, _)| *ri == i && *k == kind)
                {
                    continue;
                }
                let headers = [
                    (":method", "GET"),
                    (":path", path.as_str()),
                    (":authority", authority),
                    ("user-agent", "llm-geo-router-probe"),
                ];
                self.callouts.add(1);
                match calls::dispatch(&r.cluster, &headers, Duration::from_millis(timeout_ms)) {
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
                            log(
                                LogLevel::Warn,
                                &format!(
                                    "llm-geo-router probe: region {}: callout to cluster {:?} refused by the host ({status}); is the cluster defined?",
                                    r.name, r.cluster
                                ),
                            );
                        }
                        if kind == Kind::Health {
                            self.health(i, None);
                        }
                    }
                }
            }
        }
        self.tick_and_publish(now);
    }

    pub fn on_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Some((region, kind, sent)) = self.pending.remove(&token) else {
            return;
        };
        let now = calls::now_ms();
        let status: Option<u32> = if num_headers == 0 {
            None
        } else {
            calls::call_response_header(":status").and_then(|s| s.parse().ok())
        };
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        match kind {
            Kind::Health => {
                let rtt = ok.then(|| now.saturating_sub(sent) as f64);
                if ok && self.cfg.release.source != ReleaseSource::MetricsLabel {
                    let digest = self.health_release(body_size);
                    self.fleet.on_release(region, digest);
                }
                if self.health(region, rtt) {
                    self.publish(now);
                }
            }
            Kind::Metrics => {
                let name = self
                    .cfg
                    .regions
                    .get(region)
                    .map_or("?", |r| r.name.as_str())
                    .to_string();
                let engine = self.cfg.regions.get(region).map(|r| r.engine);
                let parsed = match (ok, engine) {
                    (true, Some(engine)) => {
                        let body = calls::call_response_body(body_size).unwrap_or_default();
                        let label = (self.cfg.release.source == ReleaseSource::MetricsLabel)
                            .then_some(self.cfg.release.name.as_str());
                        parse_engine_metrics(engine, &body, label).map_err(|e| e.to_string())
                    }
                    _ => Err(format!(
                        "status {}",
                        status.map_or("none (no response)".to_string(), |s| s.to_string())
                    )),
                };
                let stats = self.regions.get(region);
                let inflight = stats.map_or(0, |s| s.rq_active.get()) as f64;
                let warned = self.metrics_warned.get_mut(region);
                match parsed {
                    Ok(sample) => {
                        if let Some(w) = warned {
                            *w = false;
                        }
                        if self.cfg.release.source == ReleaseSource::MetricsLabel {
                            self.fleet.on_release(region, sample.release.clone());
                        }
                        self.fleet.on_metrics(region, Some(sample), inflight);
                        self.publish(now);
                    }
                    Err(e) => {
                        if let Some(s) = stats {
                            s.scrape_failures.add(1);
                        }
                        if let Some(w) = warned {
                            if !*w {
                                *w = true;
                                log(LogLevel::Warn, &format!("llm-geo-router probe: region {name}: metrics scrape failed: {e}"));
                            }
                        }
                        self.fleet.on_metrics(region, None, inflight);
                    }
                }
            }
        }
    }

    /// The release digest in a health response, per `release.source`.
    fn health_release(&self, body_size: usize) -> Option<String> {
        let r = &self.cfg.release;
        match r.source {
            ReleaseSource::HealthHeader => calls::call_response_header(&r.name),
            ReleaseSource::HealthJson => {
                let body = calls::call_response_body(body_size.min(64 * 1024))?;
                let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
                v.get(&r.name)?.as_str().map(str::to_string)
            }
            ReleaseSource::MetricsLabel => None,
        }
    }

    /// Live results since the last tick: the routers' per-region counters
    /// of requests the region's engines answered and of tries they failed
    /// (client cancellations are in neither).
    fn read_upstream_results(&mut self) {
        for (i, s) in self.regions.iter_mut().enumerate() {
            let (answered, failed) = (s.answered.get(), s.upstream_failures.get());
            let (a0, f0) = s
                .last_upstream
                .replace((answered, failed))
                .unwrap_or((answered, failed));
            let failed = failed.saturating_sub(f0);
            self.fleet
                .on_upstream(i, failed, failed + answered.saturating_sub(a0));
        }
    }

    /// The operator's runtime override of the ladder level, if any.
    fn read_override(&mut self) {
        // Without operator keys there is no override (one left in shared data
        // from an earlier configuration does not count).
        if self.cfg.ladder.operator_keys.is_empty() {
            self.override_active.set(0);
            self.fleet.set_override(None);
            return;
        }
        let value = HostStore
            .get(LADDER_OVERRIDE_KEY)
            .ok()
            .flatten()
            .map(|(v, _)| v);
        let level = value.and_then(|v| {
            std::str::from_utf8(&v)
                .ok()
                .and_then(|t| t.trim().parse::<u8>().ok())
        });
        self.override_active.set(u64::from(level.is_some()));
        self.fleet.set_override(level);
    }

    fn drain_observations(&mut self) {
        let Some(q) = self.queue else {
            return;
        };
        for _ in 0..MAX_OBSERVATIONS_PER_TICK {
            let Some(bytes) = calls::dequeue(q) else {
                break;
            };
            if let Some(o) = Observation::decode(&bytes) {
                self.fleet.on_observation(&self.cfg, o);
                self.observations.add(1);
            }
        }
    }

    /// Feed one health result; true when the region's health changed.
    fn health(&mut self, region: usize, rtt: Option<f64>) -> bool {
        if rtt.is_none() {
            if let Some(s) = self.regions.get(region) {
                s.probe_failures.add(1);
            }
        }
        let change = self.fleet.on_health(&self.cfg, region, rtt);
        let name = self
            .cfg
            .regions
            .get(region)
            .map_or("?", |r| r.name.as_str());
        match change {
            HealthChange::None => false,
            HealthChange::BecameHealthy => {
                log(
                    LogLevel::Info,
                    &format!("llm-geo-router probe: region {name} is healthy again"),
                );
                true
            }
            HealthChange::BecameUnhealthy => {
                log(LogLevel::Warn, &format!("llm-geo-router probe: region {name} is unhealthy; no new requests go there"));
                true
            }
        }
    }

    /// The once-per-tick step (ladder, tuning, assessment), then a publication.
    fn tick_and_publish(&mut self, now: u64) {
        let ejected_before: Vec<bool> = (0..self.cfg.regions.len())
            .map(|i| self.fleet.is_ejected(i))
            .collect();
        let level_changed = self.fleet.tick(&self.cfg, now);
        for (i, was) in ejected_before.into_iter().enumerate() {
            let name = self.cfg.regions.get(i).map_or("?", |r| r.name.as_str());
            match (was, self.fleet.is_ejected(i)) {
                (false, true) => log(
                    LogLevel::Warn,
                    &format!(
                        "llm-geo-router probe: region {name} ejected: its engines failed most requests they ended (5xx, connection failure, reset or timeout upstream; client cancellations do not count) for {} ticks in a row; no new requests go there for now (probe.eject_s; probe tick {})",
                        self.cfg.probe.unhealthy_after,
                        self.ticks.get()
                    ),
                ),
                (true, false) => log(
                    LogLevel::Info,
                    &format!("llm-geo-router probe: region {name} back in routing after its ejection"),
                ),
                _ => {}
            }
        }
        let snap = self.publish(now);
        if snap.assessment != self.last_assessment {
            self.last_assessment = snap.assessment;
            let (healthy, total): (Vec<&str>, usize) = (
                snap.regions
                    .iter()
                    .filter(|r| r.healthy && r.release_ok)
                    .map(|r| r.name.as_str())
                    .collect(),
                snap.regions.len(),
            );
            log(
                LogLevel::Warn,
                &format!(
                    "llm-geo-router probe: assessment {} (routable regions {}/{}: [{}]; capacity {:.1} rps, demand {:.1} rps)",
                    snap.assessment.as_str(),
                    healthy.len(),
                    total,
                    healthy.join(", "),
                    snap.capacity_rps,
                    snap.demand_rps
                ),
            );
        }
        if level_changed {
            log(
                LogLevel::Warn,
                &format!(
                    "llm-geo-router probe: ladder level {} (capacity {:.1} rps, demand {:.1} rps; probe tick {})",
                    snap.level,
                    snap.capacity_rps,
                    snap.demand_rps,
                    self.ticks.get()
                ),
            );
        }
    }

    /// Publish the current state: on every tick, on a health change, and on
    /// each engine scrape, so queue depths reach the routers within one
    /// callout rather than a tick later.
    fn publish(&mut self, now: u64) -> Snapshot {
        let snap = self.fleet.snapshot(&self.cfg, now);
        let _ = HostStore.set(SNAPSHOT_KEY, &snap.encode(), None);
        self.export(&snap);
        snap
    }

    fn export(&self, snap: &Snapshot) {
        self.level.set(u64::from(snap.level));
        self.assessment.set(snap.assessment.gauge());
        self.level_changed_s.set(snap.level_changed_ms / 1000);
        // No demand: "plenty", shown as the cap (100x) rather than 0, which
        // would read as no capacity.
        let cap = RATIO_PCT_CAP as f64;
        self.ratio_pct.set(snap.ratio.map_or(RATIO_PCT_CAP, |r| {
            (r * 100.0).round().clamp(0.0, cap) as u64
        }));
        self.demand_rps.set(snap.demand_rps.round() as u64);
        self.capacity_rps.set(snap.capacity_rps.round() as u64);
        self.snapshot_version.set(snap.version);
        let w = snap
            .weights
            .map_or((self.cfg.cost.w_rtt, self.cfg.cost.w_queue), |w| {
                (w.w_rtt, w.w_queue)
            });
        self.w_rtt_milli.set((w.0 * 1000.0).round() as u64);
        self.w_queue_milli.set((w.1 * 1000.0).round() as u64);
        for (stats, r) in self.regions.iter().zip(&snap.regions) {
            stats.healthy.set(u64::from(r.healthy));
            stats.rtt_ms.set(r.rtt_ms.map_or(0, |v| v.round() as u64));
            stats.waiting.set(r.waiting.round() as u64);
            stats.running.set(r.running.round() as u64);
            stats
                .kv_usage_pct
                .set(r.kv_usage.map_or(0, |v| (v * 100.0).round() as u64));
            let rate = r
                .prefill_ms_per_token
                .unwrap_or(cfg_rate(&self.cfg, &r.name));
            stats
                .prefill_us_per_token
                .set((rate * 1000.0).round() as u64);
        }
    }
}

fn cfg_rate(cfg: &Config, region: &str) -> f64 {
    cfg.regions
        .iter()
        .find(|r| r.name == region)
        .map_or(0.0, |r| r.prefill_ms_per_token)
}
