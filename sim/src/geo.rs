//! The geo-router as deployed: one Envoy per client region, each with its
//! own plugin state, running the plugin's own code. Per request: the guard's
//! policy (`guard::resolve_tier`, `Config::tier_policy`, `guard::check_body`)
//! then `route::Router::route` over this Envoy's prefix directory (a
//! `MemoryStore`) and its latest fresh snapshot. Per probe tick: arrivals,
//! TTFT observations and upstream results into `fleet::Fleet`, health and
//! metrics callout results as they come back, `Fleet::tick` and a snapshot,
//! exactly in the order the host layer (`host/probe.rs`) feeds them.

use crate::fleet::Fleet;
use llm_geo_router::config::Config;
use llm_geo_router::cost::Reason;
use llm_geo_router::directory::MemoryStore;
use llm_geo_router::fleet::Fleet as Probe;
use llm_geo_router::guard::{self, Verdict};
use llm_geo_router::metrics::EngineSample;
use llm_geo_router::request::Endpoint;
use llm_geo_router::route::{RouteInputs, Router};
use llm_geo_router::snapshot::Snapshot;
use llm_geo_router::tuning::Observation;
use serde_json::{json, Map, Value};

/// The plugin configuration one client region's Envoy gets: the fleet's
/// regions with their figures and this client region's round trips, the
/// tier taken from the trace as a trusted header, and `overrides` (a partial
/// plugin configuration, everything but `regions`) merged on top.
pub fn plugin_config(
    fleet: &Fleet,
    client: usize,
    mean_output_tokens: f64,
    overrides: Option<&Value>,
) -> Result<Config, String> {
    let regions: Vec<Value> = fleet
        .regions
        .iter()
        .enumerate()
        .map(|(r, region)| {
            // The mean time a request holds a slot is dominated by decode.
            let service_ms = (region.decode_ms_per_token * mean_output_tokens).max(1.0);
            json!({
                "name": region.name,
                "cluster": region.name,
                "capacity_rps": f64::from(region.max_concurrency) * 1000.0 / service_ms,
                "max_concurrency": region.max_concurrency,
                "prefill_ms_per_token": region.prefill_ms_per_token,
                "service_ms": service_ms,
                "rtt_ms": fleet.rtt(client, r),
            })
        })
        .collect();
    let mut doc = json!({
        "regions": regions,
        "tiers": {"trust_header": true},
    });
    if let Some(o) = overrides {
        let Value::Object(o) = o else {
            return Err("must be a JSON object (a plugin configuration without regions)".into());
        };
        if o.contains_key("regions") {
            return Err(
                "regions: come from the fleet file; give only the other plugin settings".into(),
            );
        }
        if let Value::Object(d) = &mut doc {
            merge(d, o);
        }
    }
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::parse(&bytes).map_err(|e| e.to_string())
}

/// Deep merge: objects merge key by key, anything else replaces.
fn merge(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(Value::Object(a)), Value::Object(b)) => merge(a, b),
            _ => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

/// What the guard and the router did with one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Handled {
    /// The level sheds the tier (429).
    Shed,
    /// The level caps the tier's prompt length (413).
    TooLong,
    Routed(Routing),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub region: usize,
    pub reason: Reason,
    /// `max_tokens` after the guard's clamp, when it rewrote the body.
    pub clamped_body: Option<Vec<u8>>,
    /// The predicted terms, sent to the probe with the observed TTFT.
    pub observation: Option<Observation>,
}

pub struct Envoy {
    pub cfg: Config,
    router: Router,
    store: MemoryStore,
    probe: Probe,
    snapshot: Option<Snapshot>,
    index: Vec<Option<usize>>,
    /// Per region: this Envoy's requests in flight (`rq_active`).
    pub inflight: Vec<f64>,
    arrivals: u64,
    observations: Vec<Observation>,
    /// Per region: requests its engines answered, and tries they failed
    /// (the routers' `upstream_rq_answered` and `upstream_failure`).
    answered: Vec<u64>,
    failures: Vec<u64>,
    last_upstream: Vec<(u64, u64)>,
}

impl Envoy {
    pub fn new(cfg: Config, now_ms: u64) -> Envoy {
        let n = cfg.regions.len();
        Envoy {
            router: Router::new(&cfg),
            store: MemoryStore::default(),
            probe: Probe::new(&cfg, now_ms),
            snapshot: None,
            index: (0..n).map(Some).collect(),
            inflight: vec![0.0; n],
            arrivals: 0,
            observations: Vec::new(),
            answered: vec![0; n],
            failures: vec![0; n],
            last_upstream: vec![(0, 0); n],
            cfg,
        }
    }

    fn fresh(&self, now_ms: u64) -> Option<&Snapshot> {
        let max_age = u64::from(self.cfg.probe.snapshot_max_age_ms);
        self.snapshot
            .as_ref()
            .filter(|s| s.is_fresh(now_ms, max_age))
    }

    /// The ladder level the guard applies now (0 without a fresh snapshot).
    pub fn level(&self, now_ms: u64) -> u8 {
        self.fresh(now_ms).map_or(0, |s| s.level)
    }

    /// The guard, then the router, for one request body.
    pub fn handle(
        &mut self,
        body: &[u8],
        tier: &str,
        session: &str,
        now_ms: u64,
    ) -> Result<Handled, String> {
        let cfg = &self.cfg;
        let tier = guard::resolve_tier(cfg, None, Some(tier));
        self.arrivals += 1;
        let level = self.level(now_ms);
        let mut fallback = false;
        let mut clamped_body = None;
        if let Some(policy) = cfg.tier_policy(level, tier) {
            if policy.shed {
                return Ok(Handled::Shed);
            }
            fallback = policy.fallback;
            if guard::needs_body(policy) {
                match guard::check_body(cfg, policy, Endpoint::ChatCompletions, body) {
                    Ok(Verdict::Pass) => {}
                    Ok(Verdict::PromptTooLong { .. }) => return Ok(Handled::TooLong),
                    Ok(Verdict::Rewrite { body, clamped }) => {
                        if clamped {
                            clamped_body = Some(body);
                        }
                    }
                    Err(e) => return Err(format!("the guard refuses the body: {}", e.message)),
                }
            }
        }
        let body = clamped_body.as_deref().unwrap_or(body);
        let snapshot = self
            .snapshot
            .as_ref()
            .filter(|s| s.is_fresh(now_ms, u64::from(cfg.probe.snapshot_max_age_ms)));
        let inputs = RouteInputs {
            endpoint: Endpoint::ChatCompletions,
            body,
            session_header: Some(session),
            residency: None,
            snapshot,
            snapshot_index: if snapshot.is_some() { &self.index } else { &[] },
            inflight: &self.inflight,
            now_ms,
            fallback,
        };
        let routed = self
            .router
            .route(cfg, &mut self.store, &inputs)
            .map_err(|e| format!("the router refuses the request: {e:?}"))?;
        let d = &routed.decision;
        let region = d.region;
        // Only the main pool's streamed TTFT teaches the tuner (host/router.rs).
        let observation = (routed.stream && d.reason != Reason::Fallback && !fallback)
            .then(|| routed.observation())
            .flatten();
        if let Some(v) = self.inflight.get_mut(region) {
            *v += 1.0;
        }
        Ok(Handled::Routed(Routing {
            region,
            reason: d.reason,
            clamped_body,
            observation,
        }))
    }

    /// The first byte of a routed request arrived after `observed_ms`.
    pub fn first_byte(&mut self, observation: Option<Observation>, observed_ms: f64) {
        if let Some(mut o) = observation {
            o.observed_ms = observed_ms as f32;
            self.observations.push(o);
        }
    }

    /// A routed request ended (`ok`: answered completely).
    pub fn done(&mut self, region: usize, ok: bool) {
        if let Some(v) = self.inflight.get_mut(region) {
            *v = (*v - 1.0).max(0.0);
        }
        let counter = if ok {
            &mut self.answered
        } else {
            &mut self.failures
        };
        if let Some(v) = counter.get_mut(region) {
            *v += 1;
        }
    }

    /// The start of a probe tick: what the host reads before dispatching
    /// its callouts.
    pub fn tick_begin(&mut self, now_ms: u64) {
        self.probe.on_arrivals(&self.cfg, self.arrivals, now_ms);
        for o in self.observations.drain(..) {
            self.probe.on_observation(&self.cfg, o);
        }
        for (i, last) in self.last_upstream.iter_mut().enumerate() {
            let answered = self.answered.get(i).copied().unwrap_or(0);
            let failed = self.failures.get(i).copied().unwrap_or(0);
            let (a0, f0) = std::mem::replace(last, (answered, failed));
            let failed = failed.saturating_sub(f0);
            self.probe
                .on_upstream(i, failed, failed + answered.saturating_sub(a0));
        }
    }

    /// The end of a probe tick: the controller step and a publication.
    /// Returns the level published.
    pub fn tick_end(&mut self, now_ms: u64) -> u8 {
        self.probe.tick(&self.cfg, now_ms);
        self.publish(now_ms)
    }

    fn publish(&mut self, now_ms: u64) -> u8 {
        let snap = self.probe.snapshot(&self.cfg, now_ms);
        let level = snap.level;
        self.snapshot = Some(snap);
        level
    }

    /// A health callout (`rtt_ms`: `Some` on success) and a metrics callout
    /// (`sample`: `None` on failure) came back from `region`.
    pub fn probed(
        &mut self,
        region: usize,
        rtt_ms: Option<f64>,
        sample: Option<EngineSample>,
        now_ms: u64,
    ) {
        let changed = self.probe.on_health(&self.cfg, region, rtt_ms);
        if changed != llm_geo_router::fleet::HealthChange::None {
            self.publish(now_ms);
        }
        let inflight = self.inflight.get(region).copied().unwrap_or(0.0);
        let ok = sample.is_some();
        self.probe.on_metrics(region, sample, inflight);
        if ok {
            self.publish(now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Fleet {
        Fleet::parse(
            br#"{"client_regions": ["na", "eu"], "regions": [
              {"name": "iad", "rtt_ms": {"na": 10, "eu": 80}, "max_concurrency": 20,
               "prefill_ms_per_token": 0.1, "decode_ms_per_token": 20, "cache_tokens": 100000},
              {"name": "fra", "rtt_ms": {"na": 80, "eu": 10}, "max_concurrency": 10,
               "prefill_ms_per_token": 0.2, "decode_ms_per_token": 25, "cache_tokens": 100000}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn config_comes_from_the_fleet_with_overrides() {
        let f = fleet();
        let c = plugin_config(&f, 1, 100.0, None).unwrap();
        assert_eq!(c.regions[0].rtt_ms, 80.0);
        assert_eq!(c.regions[1].service_ms, 2500.0);
        assert_eq!(c.regions[1].capacity_rps, 4.0);
        assert_eq!(c.regions[0].capacity_rps, 10.0);
        assert!(c.tiers.trust_header);
        let o = json!({"cost": {"w_queue": 2.0}, "probe": {"tick_ms": 500, "timeout_ms": 500}});
        let c = plugin_config(&f, 0, 100.0, Some(&o)).unwrap();
        assert_eq!(
            (c.cost.w_queue, c.cost.w_rtt, c.probe.tick_ms),
            (2.0, 1.0, 500)
        );
        let e = plugin_config(&f, 0, 100.0, Some(&json!({"regions": []}))).unwrap_err();
        assert!(e.starts_with("regions:"), "{e}");
        let e = plugin_config(&f, 0, 100.0, Some(&json!({"cost": {"w_rt": 1}}))).unwrap_err();
        assert!(e.contains("w_rt"), "{e}");
    }
}
