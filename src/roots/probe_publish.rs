//! What the probe publishes: the once-per-tick step with its logs
//! (ejections, the assessment, the ladder level), the snapshot in shared
//! data and the gauges read from it.

use crate::fleet::snapshot::Snapshot;
use crate::roots::probe::Probe;
use crate::shared::host_api::{Level, ProbeHost};
use crate::shared::names::{Global, RegionStat, Stat, SNAPSHOT_KEY};

/// `ladder.capacity_ratio_pct` is capped at 100x (10000 %).
const RATIO_PCT_CAP: u64 = 10_000;

impl Probe {
    /// The once-per-tick step (ladder, tuning, assessment), then a publication.
    pub(super) fn tick_and_publish(&mut self, host: &mut dyn ProbeHost, now: u64) {
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
    pub(super) fn publish(&mut self, host: &mut dyn ProbeHost, now: u64) -> Snapshot {
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
            rg(
                host,
                RegionStat::PrefillMsPerRequest,
                r.prefill_ms_per_request.unwrap_or(0.0).round() as u64,
            );
            let tpb = r
                .tokens_per_byte
                .unwrap_or(crate::fleet::tokens::PRIOR_TOKENS_PER_BYTE);
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
            rg(
                host,
                RegionStat::CacheBlockTokens,
                r.block_tokens.map_or(0, u64::from),
            );
        }
        // Last: the filters copy the snapshot in when this changes.
        g(host, Global::ProbeSnapshotVersion, snap.version);
    }
}
