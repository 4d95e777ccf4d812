//! The probe's view of the fleet: per-region health with consecutive
//! failure/success thresholds, the windowed minimum of the health RTT, the engines' queue counts,
//! release parity and the failback ramp, the down signals and the
//! assessment, the measured demand, and the ladder. The host feeds it probe
//! results and counter readings with explicit times; it produces the
//! [`Snapshot`].

use std::collections::VecDeque;

use crate::config::Config;
use crate::engines::metrics::{CacheCapacity, EngineSample};
use crate::fleet::assess::{assess, Assessment, Signals};
use crate::fleet::cache_clock::{cache_model, engine_intake};
use crate::fleet::drain::CounterRate;
use crate::fleet::ladder::Ladder;
use crate::fleet::restart::{Restart, RestartWatch};
use crate::fleet::snapshot::{RegionState, Snapshot};
use crate::learning::calibration::{RegionCalibration, Verdict};
use crate::learning::reuse::ReuseGaps;
use crate::learning::tuning::{Fit, Observation, Tuner};
use crate::learning::usage::UsageReport;

#[derive(Debug, Clone)]
struct Region {
    healthy: bool,
    /// Consecutive failed (negative) or good (positive) health probes.
    streak: i64,
    /// The last failed health probe got no answer at all (timed out, or
    /// Envoy's 504): a busy engine's sign as much as a dead one's. False
    /// after an answer that it is down, and once healthy again; a good
    /// answer while still unhealthy (recovering) leaves it as it is.
    silent: bool,
    /// The last `probe.rtt_window` health round trips, oldest first.
    rtt_samples: VecDeque<f64>,
    sample: EngineSample,
    inflight_at_scrape: f64,
    /// How many more requests the deployment's other Envoys have in flight
    /// to the region than at the last good scrape (exchange; 0 without).
    peer_inflight_delta: f64,
    /// When the last good scrape was answered (Unix ms).
    scraped_ms: Option<u64>,
    /// Requests the engine finishes per second (EWMA over time), from its
    /// completions counter; and the tokens its prefix cache serves a
    /// second, from its hits counter.
    drain: CounterRate,
    hits: CounterRate,
    metrics_ok: bool,
    /// Consecutive failed scrapes.
    scrape_failures: u32,
    /// The release digest last read from the health response (or metrics).
    release: Option<String>,
    /// Whether the region was routable (healthy, right release) at the last
    /// tick, and since when.
    routable: bool,
    routable_since_ms: Option<u64>,
    /// Most of the tries the region's engines ended during the last tick
    /// failed.
    upstream_failing: bool,
    /// Tries the region's engines ended (failed or answered) during the
    /// last tick.
    upstream_seen: u64,
    /// Consecutive ticks with most of the region's tries failing.
    upstream_streak: u32,
    /// Passive ejection: out of routing until then (Unix ms).
    ejected_until_ms: Option<u64>,
    /// Ejections in a row (reset by a tick with traffic and no majority
    /// of failures).
    ejections: u32,
    /// Since when at least two independent signals say the region is down.
    down_since_ms: Option<u64>,
    /// What the engine's answers taught (tokens per byte, cache horizon).
    calibration: RegionCalibration,
    /// The engine's context limit, from its model list.
    max_model_len: Option<u32>,
    /// Whether the engine keeps the Responses it produces (vLLM 0.32 only
    /// with `VLLM_ENABLE_RESPONSES_API_STORE=1`): `None` until checked.
    stores_responses: Option<bool>,
    /// The models and adapters its model list names (empty: not read).
    models: Vec<String>,
    /// Replicas behind the entry point (`prometheus` load source).
    replicas: Option<u32>,
    /// The engines' last valid KV-cache capacity (tokens); a later
    /// scrape without one leaves it standing.
    cache_tokens: Option<u64>,
    /// Tokens per block of the engines' prefix cache, as last said.
    block_tokens: Option<u32>,
    /// The counter that tells the engine's restarts, as last read.
    restarts: RestartWatch,
    /// Since when the engine's cache can hold what the region served
    /// (Unix ms): the last restart the probe saw, or its serving process's
    /// start (`process_start_time_seconds`), whichever is later.
    cache_reset_ms: Option<u64>,
}

impl Region {
    /// Its engine's cache held nothing the region served before `ms`.
    fn cache_empty_since(&mut self, ms: u64) {
        self.cache_reset_ms = Some(self.cache_reset_ms.map_or(ms, |t| t.max(ms)));
    }

    /// Healthy by its probe and not ejected for live failures.
    fn in_service(&self) -> bool {
        self.healthy && self.ejected_until_ms.is_none()
    }

    /// The network round trip: the least of the recent health round trips.
    /// A sample is the path's delay plus whatever held the answer up (the
    /// engine's HTTP server busy, this Envoy's dispatcher late to read it);
    /// only the first is the region's, and the least sample is the closest
    /// to it (the same filter as TCP's and BBR's min RTT). A load that
    /// slows the engine is what the queue term measures, not this one; a
    /// path that really got longer shows after a window of samples.
    fn rtt(&self) -> Option<f64> {
        self.rtt_samples.iter().copied().reduce(f64::min)
    }
}

#[derive(Debug, Clone)]
pub struct Fleet {
    regions: Vec<Region>,
    ladder: Ladder,
    demand_rps: Option<f64>,
    last_arrivals: Option<(u64, u64)>,
    version: u64,
    tuner: Tuner,
    fit: Option<Fit>,
    observations: u64,
    /// Growth of the engines' waiting queues (requests/s, EWMA, ≥ 0).
    queue_growth_rps: f64,
    last_waiting: Option<(f64, u64)>,
    assessment: Assessment,
    /// A level set at runtime by an operator; wins over the controller and
    /// over `ladder.forced_level`.
    override_level: Option<u8>,
    /// How long the deployment's prompts wait to be used again.
    reuse: ReuseGaps,
}

/// What changed in a health transition, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    None,
    BecameHealthy,
    BecameUnhealthy,
}

/// How long (probe ticks) a good scrape that showed requests running or
/// waiting keeps a region's unanswered health probes from counting against
/// it: an engine that stays silent longer is taken for hung.
pub const BUSY_CREDIT_TICKS: u64 = 10;

impl Fleet {
    /// Regions start healthy: a fresh Envoy routes at once, and the first
    /// failed probes take a region out within `unhealthy_after` ticks.
    pub fn new(cfg: &Config, now_ms: u64) -> Self {
        Fleet {
            regions: cfg
                .regions
                .iter()
                .map(|_| Region {
                    healthy: true,
                    streak: 0,
                    silent: false,
                    rtt_samples: VecDeque::new(),
                    sample: EngineSample::default(),
                    inflight_at_scrape: 0.0,
                    peer_inflight_delta: 0.0,
                    scraped_ms: None,
                    drain: CounterRate::default(),
                    hits: CounterRate::default(),
                    metrics_ok: false,
                    scrape_failures: 0,
                    release: None,
                    routable: true,
                    routable_since_ms: None,
                    upstream_failing: false,
                    upstream_seen: 0,
                    upstream_streak: 0,
                    ejected_until_ms: None,
                    ejections: 0,
                    down_since_ms: None,
                    calibration: RegionCalibration::default(),
                    max_model_len: None,
                    stores_responses: None,
                    models: Vec::new(),
                    replicas: None,
                    cache_tokens: None,
                    block_tokens: None,
                    restarts: RestartWatch::default(),
                    cache_reset_ms: None,
                })
                .collect(),
            ladder: Ladder::new(now_ms),
            demand_rps: None,
            last_arrivals: None,
            version: 0,
            tuner: Tuner::new(&cfg.tuning),
            fit: None,
            observations: 0,
            queue_growth_rps: 0.0,
            last_waiting: None,
            assessment: Assessment::Ok,
            override_level: None,
            reuse: ReuseGaps::default(),
        }
    }

    /// Set or clear the runtime override of the ladder level.
    pub fn set_override(&mut self, level: Option<u8>) {
        self.override_level = level;
    }

    /// The release digest a region reported (from its health response or
    /// its metrics, per `release.source`).
    /// `None` means the answer carried no digest: the release is unknown
    /// again (a redeployed engine that stopped reporting one is not assumed
    /// to still serve the old release).
    pub fn on_release(&mut self, region: usize, digest: Option<String>) {
        if let Some(r) = self.regions.get_mut(region) {
            r.release = digest;
        }
    }

    /// The release digest the region last reported, if any.
    pub fn release(&self, region: usize) -> Option<&str> {
        self.regions.get(region)?.release.as_deref()
    }

    /// The context limit the region's model list states; true when it
    /// changed. A failed read does not come here: the last limit read
    /// stands (unknown until one is read).
    pub fn on_model_limit(&mut self, region: usize, limit: u32) -> bool {
        self.regions
            .get_mut(region)
            .is_some_and(|r| r.max_model_len.replace(limit) != Some(limit))
    }

    /// The models (and adapters) the region's model list names; true when
    /// they changed. As for the limit, a failed read leaves them standing.
    pub fn on_models(&mut self, region: usize, models: Vec<String>) -> bool {
        self.regions.get_mut(region).is_some_and(|r| {
            let changed = r.models != models;
            r.models = models;
            changed
        })
    }

    /// What a check of a response the region's engine produced found:
    /// `Some(true)` it kept it, `Some(false)` it did not. True when it changed.
    pub fn on_stores_responses(&mut self, region: usize, stores: bool) -> bool {
        self.regions
            .get_mut(region)
            .is_some_and(|r| r.stores_responses.replace(stores) != Some(stores))
    }

    /// Whether the region's engine keeps its Responses, once checked.
    pub fn stores_responses(&self, region: usize) -> Option<bool> {
        self.regions.get(region)?.stores_responses
    }

    /// The engines' last valid KV-cache capacity for the region (tokens).
    pub fn engine_cache_tokens(&self, region: usize) -> Option<u64> {
        self.regions.get(region)?.cache_tokens
    }

    /// The context limit last read for the region.
    pub fn model_limit(&self, region: usize) -> Option<u32> {
        self.regions.get(region)?.max_model_len
    }

    /// Live results of the region's engines since the last tick (from the
    /// routers' counters): `failures` tries they failed, out of `outcomes`
    /// (failures plus requests they answered); failing when most failed.
    /// A request the client cancelled is in neither: it says nothing about
    /// the region.
    pub fn on_upstream(&mut self, region: usize, failures: u64, outcomes: u64) {
        if let Some(r) = self.regions.get_mut(region) {
            r.upstream_failing = failures > 0 && failures * 2 >= outcomes.max(failures);
            r.upstream_seen = outcomes.max(failures);
        }
    }

    /// Passive ejection (`probe.eject_s`): a region whose engines failed
    /// most tries they ended for `unhealthy_after` ticks in a row leaves routing
    /// for `eject_s × 2^(ejections in a row)` (at most 32×), whatever its
    /// health endpoint says; when the time is up it takes traffic again,
    /// and is ejected again, for longer, if it still fails.
    fn update_ejection(&mut self, cfg: &Config, now_ms: u64) {
        let base_ms = u64::from(cfg.probe.eject_s) * 1000;
        for r in &mut self.regions {
            // Ejection is for a region whose health endpoint passes while
            // its requests fail; once the health probe has taken it out,
            // health alone brings it back.
            if base_ms == 0 || !r.healthy {
                r.ejected_until_ms = None;
                r.upstream_streak = 0;
                r.ejections = 0;
                continue;
            }
            if r.ejected_until_ms.is_some_and(|t| now_ms < t) {
                continue;
            }
            r.ejected_until_ms = None;
            if r.upstream_failing {
                r.upstream_streak += 1;
                if r.upstream_streak >= cfg.probe.unhealthy_after {
                    let factor = 1u64 << r.ejections.min(5);
                    r.ejected_until_ms = Some(now_ms.saturating_add(base_ms * factor));
                    r.ejections = r.ejections.saturating_add(1);
                    r.upstream_streak = 0;
                }
            } else if r.upstream_seen > 0 {
                r.upstream_streak = 0;
                r.ejections = 0;
            }
        }
    }

    /// Taken out of routing by passive ejection.
    pub fn is_ejected(&self, region: usize) -> bool {
        self.regions
            .get(region)
            .is_some_and(|r| r.ejected_until_ms.is_some())
    }

    /// Parity holds unless the region reported a digest other than the
    /// expected one. A region that has not reported one (yet) is not a
    /// mismatch: at start every region is unknown, and an unknown digest is
    /// no evidence of a bad release.
    fn release_ok(cfg: &Config, r: &Region) -> bool {
        match (&cfg.release.expected, &r.release) {
            (Some(want), Some(have)) => want == have,
            _ => true,
        }
    }

    pub fn assessment(&self) -> Assessment {
        self.assessment
    }

    /// A health probe finished: `rtt_ms` is `Some` on success.
    pub fn on_health(&mut self, cfg: &Config, region: usize, rtt_ms: Option<f64>) -> HealthChange {
        let p = &cfg.probe;
        let Some(r) = self.regions.get_mut(region) else {
            return HealthChange::None;
        };
        match rtt_ms {
            Some(rtt) if rtt.is_finite() && rtt >= 0.0 => {
                r.streak = r.streak.max(0) + 1;
                if r.rtt_samples.len() >= p.rtt_window as usize {
                    r.rtt_samples.pop_front();
                }
                r.rtt_samples.push_back(rtt);
                if !r.healthy && r.streak >= i64::from(p.healthy_after) {
                    r.healthy = true;
                    r.silent = false;
                    // Back from an outage, perhaps redeployed with another
                    // setting: check again.
                    r.stores_responses = None;
                    return HealthChange::BecameHealthy;
                }
            }
            _ => {
                r.silent = false;
                r.streak = r.streak.min(0) - 1;
                if r.healthy && -r.streak >= i64::from(p.unhealthy_after) {
                    r.healthy = false;
                    return HealthChange::BecameUnhealthy;
                }
            }
        }
        HealthChange::None
    }

    /// A health probe that got no answer (timed out, Envoy's 504, or reset):
    /// a dead engine's sign or a busy one's (vLLM 0.32 decoding on two cores
    /// answers `/health` after over a second). Not held against a region
    /// that shows work: its engines answered this Envoy's requests since the
    /// last tick, mostly successfully, or its last good scrape, under
    /// [`BUSY_CREDIT_TICKS`] ticks old, showed requests running or waiting.
    /// `None`: nothing changes; else a failed probe ([`Fleet::on_health`]).
    pub fn on_health_unanswered(
        &mut self,
        cfg: &Config,
        region: usize,
        now_ms: u64,
    ) -> Option<HealthChange> {
        let credit_ms = u64::from(cfg.probe.tick_ms) * BUSY_CREDIT_TICKS;
        let busy = self.regions.get(region).is_some_and(|r| {
            let serving = r.upstream_seen > 0 && !r.upstream_failing;
            let working = r
                .scraped_ms
                .is_some_and(|t| now_ms.saturating_sub(t) < credit_ms)
                && r.sample.running.unwrap_or(0.0) + r.sample.waiting.unwrap_or(0.0) > 0.0;
            serving || working
        });
        (!busy).then(|| {
            let change = self.on_health(cfg, region, None);
            if let Some(r) = self.regions.get_mut(region) {
                r.silent = true;
            }
            change
        })
    }

    /// A metrics scrape finished at `now_ms`; `inflight` is this Envoy's
    /// in-flight count to the region at the time the scrape was answered.
    /// Returns the engine's restart it shows, if any (`restart`; with the
    /// `prometheus` source, `on_replicas` first): the caller says when with
    /// `on_cache_reset`.
    pub fn on_metrics(
        &mut self,
        cfg: &Config,
        region: usize,
        sample: Option<EngineSample>,
        inflight: f64,
        now_ms: u64,
    ) -> Option<Restart> {
        let r = self.regions.get_mut(region)?;
        let mut restart = None;
        match sample {
            Some(s) => {
                restart = r.restarts.observe(&s, r.replicas.unwrap_or(1));
                // Nothing the region served before its serving process
                // started can be in that process's cache, whether or not
                // the probe saw the restart (an engine that died and came
                // back before this probe's first good scrape of it). A
                // start after now is the engine's clock ahead of ours:
                // no bound.
                if let Some(start_ms) = s
                    .process_start_s
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .map(|v| (v * 1000.0) as u64)
                    .filter(|ms| *ms <= now_ms)
                {
                    r.cache_empty_since(start_ms);
                }
                r.drain.observe(cfg, s.completed, now_ms);
                r.hits.observe(cfg, s.prefix_hits, now_ms);
                if let Some(CacheCapacity::Tokens(t)) = s.cache_capacity {
                    r.cache_tokens = Some(t);
                }
                if s.block_tokens.is_some() {
                    r.block_tokens = s.block_tokens;
                    r.calibration.block_tokens = s.block_tokens;
                }
                r.sample = s;
                r.scraped_ms = Some(now_ms);
                r.inflight_at_scrape = inflight.max(0.0);
                // Nothing the peers told since this scrape yet.
                r.peer_inflight_delta = 0.0;
                r.metrics_ok = true;
                r.scrape_failures = 0;
            }
            None => {
                r.metrics_ok = false;
                r.scrape_failures = r.scrape_failures.saturating_add(1);
            }
        }
        restart
    }

    /// The region's engine restarted, as known at `ms`: its prefix cache
    /// held nothing the region served before then.
    pub fn on_cache_reset(&mut self, region: usize, ms: u64) {
        if let Some(r) = self.regions.get_mut(region) {
            r.cache_empty_since(ms);
        }
    }

    /// The replicas behind the region's entry point, read with its load
    /// (`prometheus` source).
    pub fn on_replicas(&mut self, region: usize, replicas: u32) {
        if let Some(r) = self.regions.get_mut(region) {
            r.replicas = Some(replicas.max(1));
        }
    }

    /// After a good scrape: what the engine's cache took in so far
    /// (`cache_clock::engine_intake`) times the region's cache.
    pub fn on_engine_clock(&mut self, region: usize, now_ms: u64) {
        let Some(r) = self.regions.get_mut(region) else {
            return;
        };
        if let Some(intake) = engine_intake(&r.sample, r.block_tokens) {
            r.calibration.on_engine_tokens(now_ms, intake);
        }
    }

    /// Whether the fleet is busy enough for the probe's fast period: a
    /// routable region whose engine reported a request waiting or
    /// (waiting + running) / `max_concurrency` at `probe.busy_utilization`
    /// or above, or the ladder above 0.
    pub fn busy(&self, cfg: &Config) -> bool {
        self.ladder.level > 0
            || cfg.regions.iter().zip(&self.regions).any(|(c, r)| {
                let waiting = r.sample.waiting.unwrap_or(0.0);
                let load = waiting + r.sample.running.unwrap_or(0.0);
                r.routable
                    && r.metrics_ok
                    && (waiting > 0.0
                        || load
                            / f64::from(c.max_concurrency.max(1))
                            / f64::from(r.replicas.unwrap_or(1).max(1))
                            >= cfg.probe.busy_utilization)
            })
    }

    /// Feed the process-wide arrivals counter; updates the demand EWMA.
    pub fn on_arrivals(&mut self, cfg: &Config, arrivals_total: u64, now_ms: u64) {
        if let Some((prev_total, prev_ms)) = self.last_arrivals {
            let dt_s = now_ms.saturating_sub(prev_ms) as f64 / 1000.0;
            if dt_s > 0.0 {
                let rate = arrivals_total.saturating_sub(prev_total) as f64 / dt_s;
                let a = cfg.probe.demand_alpha;
                self.demand_rps = Some(match self.demand_rps {
                    Some(old) => old + a * (rate - old),
                    None => rate,
                });
            }
        }
        self.last_arrivals = Some((arrivals_total, now_ms));
    }

    /// Per region: the other Envoys' requests in flight since the last
    /// good scrape (exchange, `Exchange::peer_inflight_since`).
    pub fn set_peer_inflight_delta(&mut self, delta: &[f64]) {
        for (r, v) in self.regions.iter_mut().zip(delta) {
            r.peer_inflight_delta = if v.is_finite() { *v } else { 0.0 };
        }
    }

    /// Per region: when its last good scrape was answered.
    pub fn scraped_ms(&self) -> Vec<Option<u64>> {
        self.regions.iter().map(|r| r.scraped_ms).collect()
    }

    /// A TTFT observation reported by a router.
    pub fn on_observation(&mut self, cfg: &Config, o: Observation) {
        if usize::from(o.region) < cfg.regions.len() {
            self.tuner.push(o);
            self.observations += 1;
        }
    }

    /// An engine's usage of one answered request, reported by a router.
    pub fn on_usage(&mut self, r: &UsageReport) -> Option<Verdict> {
        let region = self.regions.get_mut(usize::from(r.region))?;
        self.reuse.on_report(r);
        Some(region.calibration.on_report(r))
    }

    /// A region's calibration.
    pub fn calibration(&self, region: usize) -> Option<&RegionCalibration> {
        self.regions.get(region).map(|r| &r.calibration)
    }

    /// Observations received since start.
    pub fn observations(&self) -> u64 {
        self.observations
    }

    pub fn is_healthy(&self, region: usize) -> bool {
        self.regions.get(region).is_some_and(|r| r.healthy)
    }

    pub fn level(&self) -> u8 {
        self.ladder.level
    }

    /// One tick and a new snapshot (what the probe does once per tick).
    pub fn publish(&mut self, cfg: &Config, now_ms: u64) -> (Snapshot, bool) {
        let changed = self.tick(cfg, now_ms);
        (self.snapshot(cfg, now_ms), changed)
    }

    /// The share of new requests a routable region may take while ramping
    /// back in (1 when not ramping).
    fn ramp(cfg: &Config, r: &Region, now_ms: u64) -> f64 {
        if !r.routable {
            return 0.0;
        }
        match r.routable_since_ms {
            Some(since) if cfg.release.ramp_s > 0.0 => (now_ms.saturating_sub(since) as f64
                / (cfg.release.ramp_s * 1000.0))
                .clamp(0.0, 1.0),
            _ => 1.0,
        }
    }

    /// Capacity of routable regions (ramping ones in proportion, optionally
    /// scaled by KV headroom); demand = arrivals + queue growth; their ratio.
    fn capacity_and_ratio(&self, cfg: &Config, now_ms: u64) -> (f64, f64, Option<f64>) {
        let capacity: f64 = cfg
            .regions
            .iter()
            .zip(&self.regions)
            .filter(|(_, r)| r.routable)
            .map(|(c, r)| {
                let kv = if cfg.ladder.scale_by_kv_headroom {
                    r.sample.kv_usage.map_or(1.0, |u| (1.0 - u).clamp(0.0, 1.0))
                } else {
                    1.0
                };
                c.capacity_rps * Self::ramp(cfg, r, now_ms) * kv
            })
            .sum();
        let demand = self.demand_rps.unwrap_or(0.0) + self.queue_growth_rps;
        // Below a hundredth of a request per second there is no demand to
        // speak of; the ratio is then "plenty" and the ladder recovers.
        let ratio = (demand > 0.01).then(|| capacity / demand);
        (capacity, demand, ratio)
    }

    /// Once per tick: one ladder controller step (so the level moves at most
    /// one rung per tick however often snapshots are published) and a refit
    /// of the tuned cost model. Returns true when the level changed.
    pub fn tick(&mut self, cfg: &Config, now_ms: u64) -> bool {
        self.update_ejection(cfg, now_ms);
        self.update_routable(cfg, now_ms);
        self.update_queue_growth(cfg, now_ms);
        self.update_assessment(cfg, now_ms);
        let (_, _, ratio) = self.capacity_and_ratio(cfg, now_ms);
        let changed = match self.override_level {
            Some(level) => self.ladder.force(level, now_ms),
            None => self
                .ladder
                .step(&cfg.ladder, ratio.unwrap_or(f64::MAX), now_ms),
        };
        let configured: Vec<f64> = cfg.regions.iter().map(|r| r.prefill_ms_per_token).collect();
        if let Some(fit) = self.tuner.fit(&cfg.tuning, &configured) {
            self.fit = Some(fit);
        }
        changed
    }

    /// A new snapshot of the current state (after a tick, a health change or
    /// fresh engine metrics).
    fn update_routable(&mut self, cfg: &Config, now_ms: u64) {
        let any_matching = self
            .regions
            .iter()
            .any(|r| r.in_service() && Self::release_ok(cfg, r));
        for r in &mut self.regions {
            // A fleet-wide mismatch is a rollback, not a reason to route
            // nowhere: then health alone decides.
            let routable = r.in_service() && (Self::release_ok(cfg, r) || !any_matching);
            if routable && !r.routable {
                r.routable_since_ms = Some(now_ms);
            }
            r.routable = routable;
        }
    }

    fn update_queue_growth(&mut self, cfg: &Config, now_ms: u64) {
        let waiting: f64 = self
            .regions
            .iter()
            .filter(|r| r.metrics_ok)
            .map(|r| r.sample.waiting.unwrap_or(0.0))
            .sum();
        if let Some((prev, prev_ms)) = self.last_waiting {
            let dt = now_ms.saturating_sub(prev_ms) as f64 / 1000.0;
            if dt > 0.0 {
                let growth = ((waiting - prev) / dt).max(0.0);
                let a = cfg.probe.demand_alpha;
                self.queue_growth_rps += a * (growth - self.queue_growth_rps);
            }
        }
        self.last_waiting = Some((waiting, now_ms));
    }

    /// Down signals per region: the health probe, the metrics scrape, and
    /// live upstream failures; two or more held long enough is "down".
    fn update_assessment(&mut self, cfg: &Config, now_ms: u64) {
        let down_ms = (cfg.assessment.region_down_minutes * 60_000.0) as u64;
        let mut region_down = false;
        for r in &mut self.regions {
            let signals = u8::from(!r.healthy)
                + u8::from(r.scrape_failures >= cfg.probe.unhealthy_after)
                + u8::from(r.upstream_failing);
            if signals >= 2 {
                let since = *r.down_since_ms.get_or_insert(now_ms);
                region_down |= now_ms.saturating_sub(since) >= down_ms;
            } else {
                r.down_since_ms = None;
            }
        }
        let total: f64 = cfg.regions.iter().map(|c| c.capacity_rps).sum();
        let healthy: f64 = cfg
            .regions
            .iter()
            .zip(&self.regions)
            .filter(|(_, r)| r.healthy && Self::release_ok(cfg, r))
            .map(|(c, _)| c.capacity_rps)
            .sum();
        let signals = Signals {
            release_mismatch: cfg.release.expected.is_some()
                && self
                    .regions
                    .iter()
                    .any(|r| r.healthy && !Self::release_ok(cfg, r)),
            region_down,
            healthy_capacity_fraction: if total > 0.0 { healthy / total } else { 0.0 },
        };
        self.assessment = assess(&signals, cfg.assessment.capacity_fraction_min);
    }

    pub fn snapshot(&mut self, cfg: &Config, now_ms: u64) -> Snapshot {
        let (capacity, demand, ratio) = self.capacity_and_ratio(cfg, now_ms);
        self.version += 1;
        let fit = self.fit.as_ref();
        let regions: Vec<RegionState> = cfg
            .regions
            .iter()
            .zip(&self.regions)
            .enumerate()
            .map(|(i, (c, r))| {
                (
                    i,
                    c,
                    r,
                    fit.and_then(|f| f.prefill.get(i).copied().flatten()),
                )
            })
            .map(|(_, c, r, prefill)| RegionState {
                name: c.name.clone(),
                healthy: r.in_service(),
                unanswered: !r.healthy && r.silent && r.ejected_until_ms.is_none(),
                rtt_ms: r.rtt(),
                waiting: r.sample.waiting.unwrap_or(0.0),
                running: r.sample.running.unwrap_or(0.0),
                kv_usage: r.sample.kv_usage,
                prefix_hit_rate: r.sample.hit_rate.or_else(|| {
                    match (r.sample.prefix_hits, r.sample.prefix_queries) {
                        (Some(h), Some(q)) if q > 0.0 => Some((h / q).clamp(0.0, 1.0)),
                        _ => None,
                    }
                }),
                inflight_at_scrape: r.inflight_at_scrape,
                peer_inflight_delta: r.peer_inflight_delta,
                drain_rps: r.drain.rate.filter(|_| r.metrics_ok),
                hit_tokens_per_s: r.hits.rate.filter(|_| r.metrics_ok),
                scraped_ms: r.scraped_ms,
                metrics_ok: r.metrics_ok,
                // The streak the assessment counts as the metrics signal
                // down: one failed scrape leaves the last figures standing,
                // a run of them leaves nothing known.
                load_unknown: r.scrape_failures >= cfg.probe.unhealthy_after,
                prefill_ms_per_token: prefill.map(|p| p.ms_per_token),
                prefill_ms_per_request: prefill.map(|p| p.per_request_ms),
                release: r.release.clone(),
                release_ok: Self::release_ok(cfg, r),
                ramp: if r.routable {
                    Self::ramp(cfg, r, now_ms)
                } else {
                    1.0
                },
                tokens_per_byte: r.calibration.tokens_per_byte(),
                model_tokens_per_byte: r
                    .calibration
                    .model_tokens_per_byte()
                    .map(|(m, v)| (m.to_owned(), v))
                    .collect(),
                cache_horizon_ms: r
                    .calibration
                    .horizon_ms(now_ms)
                    .filter(|_| cfg.directory.cache_horizon),
                cache_reliability: r.calibration.reliability(),
                max_model_len: r.max_model_len,
                stores_responses: r.stores_responses,
                models: r.models.clone(),
                replicas: r.replicas,
                cache_tokens: c.cache_tokens().or(r.cache_tokens),
                cache_free_tokens: None,
                cache_clock: Vec::new(),
                cache_reset_ms: r.cache_reset_ms,
                block_tokens: r.block_tokens,
            })
            .collect();
        let mut regions = regions;
        for (state, r) in regions.iter_mut().zip(&self.regions) {
            (state.cache_free_tokens, state.cache_clock) =
                cache_model(state.cache_tokens, state.replicas, &r.calibration);
        }
        Snapshot {
            version: self.version,
            generated_ms: now_ms,
            level: self.ladder.level,
            ratio,
            demand_rps: demand,
            capacity_rps: capacity,
            level_changed_ms: self.ladder.changed_ms,
            assessment: self.assessment,
            reuse_gaps: self.reuse.normalised(),
            regions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":2},{"name":"b","cluster":"b","capacity_rps":3}],
                "probe":{"unhealthy_after":2,"healthy_after":3,"rtt_window":4},"ladder":{"dwell_s":5}}"#,
        )
        .unwrap()
    }

    #[test]
    fn health_needs_consecutive_results() {
        let c = cfg();
        let mut f = Fleet::new(&c, 0);
        assert_eq!(f.on_health(&c, 0, None), HealthChange::None);
        assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::None);
        assert_eq!(f.on_health(&c, 0, None), HealthChange::None);
        assert_eq!(f.on_health(&c, 0, None), HealthChange::BecameUnhealthy);
        assert!(!f.is_healthy(0));
        assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::None);
        assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::None);
        assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::BecameHealthy);
        assert_eq!(f.on_health(&c, 7, None), HealthChange::None);
    }

    #[test]
    fn a_region_unhealthy_by_silence_is_told_apart_from_one_that_answers_it_is_down() {
        let c = cfg();
        let mut f = Fleet::new(&c, 0);
        let state = |f: &mut Fleet| {
            let r = &f.snapshot(&c, 0).regions[0];
            (r.healthy, r.unanswered)
        };
        assert_eq!(f.on_health_unanswered(&c, 0, 0), Some(HealthChange::None));
        assert_eq!(state(&mut f), (true, false), "healthy: nothing to tell");
        assert_eq!(
            f.on_health_unanswered(&c, 0, 0),
            Some(HealthChange::BecameUnhealthy)
        );
        assert_eq!(state(&mut f), (false, true));
        // An answer that it is down (a 503, a refused connection) wins.
        f.on_health(&c, 0, None);
        assert_eq!(state(&mut f), (false, false));
        f.on_health_unanswered(&c, 0, 0);
        assert_eq!(state(&mut f), (false, true));
        // Good answers while still unhealthy (short of healthy_after 3)
        // keep it: the engine is coming back, not down.
        for _ in 0..2 {
            assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::None);
            assert_eq!(state(&mut f), (false, true));
        }
        // Recovery clears it.
        assert_eq!(f.on_health(&c, 0, Some(5.0)), HealthChange::BecameHealthy);
        assert_eq!(state(&mut f), (true, false));
        // A later outage answered as down is not silent, even after a
        // good answer.
        f.on_health(&c, 0, None);
        assert_eq!(f.on_health(&c, 0, None), HealthChange::BecameUnhealthy);
        f.on_health(&c, 0, Some(5.0));
        assert_eq!(state(&mut f), (false, false));
    }

    #[test]
    fn live_failures_eject_a_region_for_a_doubling_time() {
        let c = cfg(); // unhealthy_after 2, eject_s 10
        let mut f = Fleet::new(&c, 0);
        let healthy = |f: &mut Fleet, now| f.snapshot(&c, now).regions[0].healthy;
        // One bad tick is not enough; a minority of failures never counts.
        f.on_upstream(0, 9, 10);
        f.tick(&c, 1_000);
        f.on_upstream(0, 4, 10);
        f.tick(&c, 2_000);
        f.on_upstream(0, 9, 10);
        f.tick(&c, 3_000);
        assert!(!f.is_ejected(0) && healthy(&mut f, 3_000));
        // Two in a row: out for 10 s, though its health probes pass.
        f.on_upstream(0, 5, 10);
        f.tick(&c, 4_000);
        assert!(f.is_ejected(0) && !healthy(&mut f, 4_000));
        assert!(f.is_healthy(0));
        f.on_upstream(0, 0, 0);
        f.tick(&c, 13_999);
        assert!(f.is_ejected(0));
        f.tick(&c, 14_000);
        assert!(!f.is_ejected(0) && healthy(&mut f, 14_000));
        // Still failing when back: out again, for twice as long.
        for t in [15_000, 16_000] {
            f.on_upstream(0, 3, 3);
            f.tick(&c, t);
        }
        assert!(f.is_ejected(0));
        f.tick(&c, 35_999);
        assert!(f.is_ejected(0));
        f.tick(&c, 36_000);
        assert!(!f.is_ejected(0));
        // A good tick with traffic resets the doubling.
        f.on_upstream(0, 0, 10);
        f.tick(&c, 37_000);
        for t in [38_000, 39_000] {
            f.on_upstream(0, 3, 3);
            f.tick(&c, t);
        }
        f.tick(&c, 48_999);
        assert!(f.is_ejected(0));
        f.tick(&c, 49_000);
        assert!(!f.is_ejected(0));
        // A region the health probe has taken out is not ejected as well:
        // when its probes pass again it is back at once.
        for t in [50_000, 51_000] {
            f.on_upstream(0, 3, 3);
            f.tick(&c, t);
        }
        assert!(f.is_ejected(0));
        f.on_health(&c, 0, None);
        f.on_health(&c, 0, None);
        f.tick(&c, 52_000);
        assert!(!f.is_ejected(0));
        // eject_s 0 turns it off.
        let mut off = cfg();
        off.probe.eject_s = 0;
        let mut f = Fleet::new(&off, 0);
        for t in [1_000, 2_000, 3_000] {
            f.on_upstream(0, 3, 3);
            f.tick(&off, t);
        }
        assert!(!f.is_ejected(0));
    }

    #[test]
    fn rtt_is_the_least_of_the_last_window_of_samples() {
        let mut c = cfg();
        c.probe.rtt_window = 3;
        let mut f = Fleet::new(&c, 0);
        let rtt = |f: &mut Fleet| f.publish(&c, 1).0.regions[1].rtt_ms;
        f.on_health(&c, 1, Some(10.0));
        assert_eq!(rtt(&mut f), Some(10.0));
        // A stalled answer does not move it.
        f.on_health(&c, 1, Some(200.0));
        assert_eq!(rtt(&mut f), Some(10.0));
        // A failed probe is no sample.
        f.on_health(&c, 1, None);
        f.on_health(&c, 1, Some(30.0));
        assert_eq!(rtt(&mut f), Some(10.0));
        // A longer path shows once the window no longer holds the short one.
        f.on_health(&c, 1, Some(40.0));
        assert_eq!(rtt(&mut f), Some(30.0));
        f.on_health(&c, 1, Some(35.0));
        f.on_health(&c, 1, Some(45.0));
        assert_eq!(rtt(&mut f), Some(35.0));
        // A shorter one at once.
        f.on_health(&c, 1, Some(6.0));
        assert_eq!(rtt(&mut f), Some(6.0));
        assert_eq!(f.publish(&c, 1).0.regions[0].rtt_ms, None);
    }

    #[test]
    fn demand_over_capacity_raises_the_ladder_one_rung_per_tick() {
        let c = cfg();
        let mut f = Fleet::new(&c, 0);
        let mut total = 0;
        let mut levels = vec![];
        for t in 0..8u64 {
            f.on_arrivals(&c, total, t * 1000);
            total += 25; // 25 rps against 5 rps of capacity: ratio 0.2
            levels.push(f.publish(&c, t * 1000).0.level);
        }
        assert_eq!(levels, vec![0, 1, 2, 3, 4, 5, 5, 5]);
        let (s, _) = f.publish(&c, 8000);
        assert_eq!(s.capacity_rps, 5.0);
        assert!((s.ratio.unwrap() - 0.2).abs() < 1e-9);
        // Losing region b halves nothing but capacity.
        f.on_health(&c, 1, None);
        f.on_health(&c, 1, None);
        assert_eq!(f.publish(&c, 9000).0.capacity_rps, 2.0);
    }

    #[test]
    fn metrics_fill_the_snapshot() {
        let c = cfg();
        let mut f = Fleet::new(&c, 0);
        f.on_metrics(
            &c,
            0,
            Some(EngineSample {
                waiting: Some(4.0),
                running: Some(2.0),
                prefix_queries: Some(100.0),
                prefix_hits: Some(25.0),
                ..EngineSample::default()
            }),
            3.0,
            0,
        );
        f.on_metrics(&c, 1, None, 0.0, 0);
        let (s, _) = f.publish(&c, 0);
        assert_eq!((s.regions[0].waiting, s.regions[0].running), (4.0, 2.0));
        assert_eq!(s.regions[0].prefix_hit_rate, Some(0.25));
        assert_eq!(s.regions[0].inflight_at_scrape, 3.0);
        assert!(s.regions[0].metrics_ok && !s.regions[1].metrics_ok);
        assert_eq!(s.ratio, None);
        assert_eq!(s.version, 1);
    }

    #[test]
    fn a_run_of_failed_scrapes_leaves_the_load_unknown_not_idle() {
        let c = cfg(); // unhealthy_after 2
        let mut f = Fleet::new(&c, 0);
        let load = |w: f64, r: f64| EngineSample {
            waiting: Some(w),
            running: Some(r),
            ..EngineSample::default()
        };
        let state = |f: &mut Fleet, now| {
            let r = f.snapshot(&c, now).regions[0].clone();
            (r.waiting, r.running, r.metrics_ok, r.load_unknown)
        };
        // Before any answer: nothing failed, nothing unknown.
        assert_eq!(state(&mut f, 0), (0.0, 0.0, false, false));
        f.on_metrics(&c, 0, Some(load(3.0, 8.0)), 0.0, 1000);
        assert_eq!(state(&mut f, 1000), (3.0, 8.0, true, false));
        // One failure: the last figures stand.
        f.on_metrics(&c, 0, None, 0.0, 2000);
        assert_eq!(state(&mut f, 2000), (3.0, 8.0, false, false));
        // The second in a row (the metrics signal of the assessment): the
        // load is unknown, the figures kept only as a floor.
        f.on_metrics(&c, 0, None, 0.0, 3000);
        assert_eq!(state(&mut f, 3000), (3.0, 8.0, false, true));
        // A good scrape brings it back.
        f.on_metrics(&c, 0, Some(load(0.0, 1.0)), 0.0, 4000);
        assert_eq!(state(&mut f, 4000), (0.0, 1.0, true, false));
        // A region never read: unknown after the same run.
        f.on_metrics(&c, 1, None, 0.0, 4000);
        f.on_metrics(&c, 1, None, 0.0, 5000);
        assert!(f.snapshot(&c, 5000).regions[1].load_unknown);
    }

    #[test]
    fn observations_tune_the_snapshot() {
        let c = cfg();
        // An engine of 20 ms per request and 0.3 ms a token (configured:
        // nothing per request and 0.1 ms a token, the fit bounded within
        // [0.025, 0.4]), over 256 prompts of 100..3160 uncached tokens.
        let o = |region: u16, uncached: u32| Observation {
            region,
            rtt_ms: 10.0,
            queue_ms: 0.0,
            uncached_tokens: uncached,
            prefill_ms: 0.0,
            observed_ms: 10.0 + 20.0 + 0.3 * uncached as f32,
        };
        let mut f = Fleet::new(&c, 0);
        for i in 0..256 {
            f.on_observation(&c, o(0, 100 + 12 * i));
        }
        f.on_observation(&c, o(9, 100)); // unknown region: ignored
        assert_eq!(f.observations(), 256);
        let (s, _) = f.publish(&c, 1);
        // Both parts near the engine's, each within a two-sided bound: the
        // rate, shrunk towards the configured 0.1, within 5 % of 0.3, the
        // per-request part within 15 ms of 20; and so the prefill of a short
        // prompt and of a long one within 5 % of what was observed.
        for (i, r) in s.regions.iter().enumerate() {
            // Region 1 has no observations of its own: the window's fit.
            let (rate, fixed) = (
                r.prefill_ms_per_token.unwrap(),
                r.prefill_ms_per_request.unwrap(),
            );
            assert!(
                (0.285..=0.315).contains(&rate) && (5.0..=35.0).contains(&fixed),
                "region {i}: fitted {fixed} ms + {rate} ms/token, observed 20 ms + 0.3 ms/token"
            );
            for u in [500.0, 3000.0] {
                let (predicted, observed) = (fixed + rate * u, 20.0 + 0.3 * u);
                assert!(
                    (predicted - observed).abs() <= 0.05 * observed,
                    "region {i}: {fixed} + {rate} x {u} = {predicted}, observed {observed}"
                );
            }
        }
    }

    fn parity_cfg() -> Config {
        Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":2},{"name":"b","cluster":"b","capacity_rps":2}],
                "release":{"expected":"sha256:good","ramp_s":10},
                "assessment":{"region_down_minutes":0.05},
                "probe":{"unhealthy_after":2,"healthy_after":1}}"#,
        )
        .unwrap()
    }

    #[test]
    fn release_mismatch_is_rollback_and_the_region_is_not_routable() {
        let c = parity_cfg();
        let mut f = Fleet::new(&c, 0);
        f.on_release(0, Some("sha256:good".into()));
        f.on_release(1, Some("sha256:bad".into()));
        let (s, _) = f.publish(&c, 1000);
        assert_eq!(s.assessment, Assessment::Rollback);
        assert!(s.regions[0].release_ok && !s.regions[1].release_ok);
        assert_eq!(s.capacity_rps, 2.0);
        f.on_release(1, Some("sha256:good".into()));
        let (s, _) = f.publish(&c, 2000);
        assert_eq!(s.assessment, Assessment::Ok);
        // Back on the right release: ramped in over 10 s.
        assert!((s.regions[1].ramp - 0.0).abs() < 1e-9);
        let (s, _) = f.publish(&c, 7000);
        assert!(
            (s.regions[1].ramp - 0.5).abs() < 1e-9,
            "{}",
            s.regions[1].ramp
        );
        assert!((s.capacity_rps - 3.0).abs() < 1e-9);
        let (s, _) = f.publish(&c, 20_000);
        assert_eq!(s.regions[1].ramp, 1.0);
    }

    #[test]
    fn region_down_needs_two_signals_for_the_configured_time() {
        let c = parity_cfg();
        let mut f = Fleet::new(&c, 0);
        for r in 0..2 {
            f.on_release(r, Some("sha256:good".into()));
        }
        // Health alone: capacity loss (50 % < 70 %), not a region down.
        f.on_health(&c, 1, None);
        f.on_health(&c, 1, None);
        let (s, _) = f.publish(&c, 1000);
        assert_eq!(s.assessment, Assessment::ScaleDrAndRaiseLadder);
        // Plus live upstream failures: two signals, but not yet for 3 s.
        f.on_upstream(1, 5, 5);
        let (s, _) = f.publish(&c, 2000);
        assert_eq!(s.assessment, Assessment::ScaleDrAndRaiseLadder);
        f.on_upstream(1, 5, 6);
        let (s, _) = f.publish(&c, 5000);
        assert_eq!(s.assessment, Assessment::PageAndProposeFailover);
        // Recovery clears it.
        f.on_health(&c, 1, Some(5.0));
        f.on_upstream(1, 0, 10);
        let (s, _) = f.publish(&c, 6000);
        assert_eq!(s.assessment, Assessment::Ok);
    }

    #[test]
    fn the_drain_rate_comes_from_the_completions_counter_over_time() {
        let c = cfg(); // tick_ms 1000, demand_alpha 0.5
        let mut f = Fleet::new(&c, 0);
        let done = |n: Option<f64>| EngineSample {
            waiting: Some(3.0),
            completed: n,
            ..EngineSample::default()
        };
        let drain = |f: &mut Fleet, now| {
            let s = f.snapshot(&c, now);
            (s.regions[0].drain_rps, s.regions[0].scraped_ms)
        };
        f.on_metrics(&c, 0, Some(done(Some(100.0))), 0.0, 1_000);
        assert_eq!(drain(&mut f, 1_000), (None, Some(1_000)), "one reading");
        // 10 done in 1 s: 10 rps.
        f.on_metrics(&c, 0, Some(done(Some(110.0))), 0.0, 2_000);
        assert_eq!(drain(&mut f, 2_000), (Some(10.0), Some(2_000)));
        // Then 0 rps for a tick's time, in four scrapes of 250 ms: the same
        // weight as one scrape of 1 s (alpha 0.5 per tick_ms).
        for t in [2_250, 2_500, 2_750, 3_000] {
            f.on_metrics(&c, 0, Some(done(Some(110.0))), 0.0, t);
        }
        let (rate, _) = drain(&mut f, 3_000);
        assert!((rate.unwrap() - 5.0).abs() < 1e-9, "{rate:?}");
        // A restarted engine (counter back) leaves the rate; a failed
        // scrape withholds it; a sample without the counter drops it.
        f.on_metrics(&c, 0, Some(done(Some(3.0))), 0.0, 4_000);
        assert!((drain(&mut f, 4_000).0.unwrap() - 5.0).abs() < 1e-9);
        f.on_metrics(&c, 0, None, 0.0, 5_000);
        assert_eq!(drain(&mut f, 5_000).0, None);
        f.on_metrics(&c, 0, Some(done(None)), 0.0, 6_000);
        assert_eq!(drain(&mut f, 6_000), (None, Some(6_000)));
    }

    #[test]
    fn busy_is_a_queue_a_high_utilization_or_the_ladder() {
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":2,"max_concurrency":10}],
                "probe":{"busy_utilization":0.5}}"#,
        )
        .unwrap();
        let mut f = Fleet::new(&c, 0);
        let load = |w: f64, r: f64| EngineSample {
            waiting: Some(w),
            running: Some(r),
            ..EngineSample::default()
        };
        assert!(!f.busy(&c), "nothing scraped");
        for ((w, r), busy) in [((0.0, 4.0), false), ((0.0, 5.0), true), ((1.0, 0.0), true)] {
            f.on_metrics(&c, 0, Some(load(w, r)), 0.0, 0);
            assert_eq!(f.busy(&c), busy, "waiting {w} running {r}");
        }
        // A failed scrape is no evidence of load.
        f.on_metrics(&c, 0, None, 0.0, 0);
        assert!(!f.busy(&c));
    }

    #[test]
    fn queue_growth_counts_as_demand() {
        let c = cfg();
        let mut f = Fleet::new(&c, 0);
        let sample = |w: f64| EngineSample {
            waiting: Some(w),
            ..EngineSample::default()
        };
        f.on_metrics(&c, 0, Some(sample(0.0)), 0.0, 0);
        f.publish(&c, 0);
        f.on_metrics(&c, 0, Some(sample(10.0)), 0.0, 1000);
        let (s, _) = f.publish(&c, 1000);
        // 10 more waiting in 1 s, EWMA alpha 0.5: 5 rps of unmet demand.
        assert!((s.demand_rps - 5.0).abs() < 1e-9, "{}", s.demand_rps);
    }

    #[test]
    fn cache_capacity_config_wins_then_last_valid_engine_figure() {
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1},
                {"name":"b","cluster":"b","capacity_rps":1,"cache_tokens":5000}]}"#,
        )
        .unwrap();
        let mut f = Fleet::new(&c, 0);
        let cap = |s: &Snapshot| -> Vec<Option<u64>> {
            s.regions.iter().map(|r| r.cache_tokens).collect()
        };
        assert_eq!(cap(&f.publish(&c, 0).0), vec![None, Some(5000)]);
        let with = |c: Option<CacheCapacity>| EngineSample {
            waiting: Some(0.0),
            cache_capacity: c,
            ..EngineSample::default()
        };
        for i in 0..2 {
            f.on_metrics(
                &c,
                i,
                Some(with(Some(CacheCapacity::Tokens(74_864)))),
                0.0,
                1,
            );
        }
        assert_eq!(cap(&f.publish(&c, 1).0), vec![Some(74_864), Some(5000)]);
        // A refused figure, a scrape without one, a failed scrape: the last
        // valid figure stands, never 0.
        f.on_metrics(
            &c,
            0,
            Some(with(Some(CacheCapacity::Invalid("x".into())))),
            0.0,
            2,
        );
        f.on_metrics(&c, 0, Some(with(None)), 0.0, 3);
        f.on_metrics(&c, 0, None, 0.0, 4);
        assert_eq!(cap(&f.publish(&c, 4).0), vec![Some(74_864), Some(5000)]);
    }

    #[test]
    fn a_belief_is_checked_in_the_engines_whole_blocks() {
        let c =
            Config::parse(br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}]}"#).unwrap();
        let mut f = Fleet::new(&c, 0);
        // The engine keeps its cache in blocks of 128 tokens.
        let sample = EngineSample {
            waiting: Some(0.0),
            block_tokens: Some(128),
            ..EngineSample::default()
        };
        f.on_metrics(&c, 0, Some(sample), 0.0, 1000);
        assert_eq!(f.snapshot(&c, 1000).regions[0].block_tokens, Some(128));
        // 1200 bytes believed held, 300 tokens at 0.25 a byte: the engine
        // serves 256 of them (two blocks), and says so. That is the belief
        // confirmed, not an eviction.
        let report = UsageReport {
            region: 0,
            routed_ms: 5000,
            prompt_bytes: 4000,
            believed_bytes: 1200,
            held_ms: 4000,
            cut_ms: 0,
            served_ms: 5100,
            prompt_tokens: 1000,
            cached_tokens: Some(256),
            model: None,
        };
        assert_eq!(f.on_usage(&report), Some(Verdict::Confirmed));
        let cal = f.calibration(0).unwrap();
        assert_eq!(cal.reliability(), Some(1.0));
        assert_eq!(cal.capacity_tokens(), None);
        // Less than what the blocks allow is still an eviction.
        let short = UsageReport {
            cached_tokens: Some(128),
            ..report
        };
        assert_eq!(f.on_usage(&short), Some(Verdict::Refuted));
    }
    #[test]
    fn the_cache_clock_counts_what_the_engine_allocates() {
        let c =
            Config::parse(br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}]}"#).unwrap();
        let mut f = Fleet::new(&c, 0);
        let scrape = |f: &mut Fleet, at: u64, missed: f64, generated: f64, done: f64| {
            let sample = EngineSample {
                waiting: Some(0.0),
                prefix_queries: Some(10_000.0 + missed),
                prefix_hits: Some(10_000.0),
                generation_tokens: Some(generated),
                completed: Some(done),
                block_tokens: Some(128),
                ..EngineSample::default()
            };
            f.on_metrics(&c, 0, Some(sample), 0.0, at);
            f.on_engine_clock(0, at);
        };
        scrape(&mut f, 1000, 0.0, 0.0, 0.0);
        // Two requests: 900 prompt tokens missed, 100 generated; each one's
        // last block is partly filled (63.5 tokens of 128 on average).
        scrape(&mut f, 2000, 900.0, 100.0, 2.0);
        let clock = f.calibration(0).unwrap().clock_for(1e9, 8);
        assert_eq!(clock.last(), Some(&(2000, 900.0 + 100.0 + 2.0 * 63.5)));
    }
}
