//! The routing decision: one expected time-to-first-token per region, in
//! milliseconds, and the region that minimises it.
//!
//! `ttft(r) = w_rtt·rtt(r) + prefill_ms_per_token(r)·uncached_tokens(r) + w_queue·queue_ms(r)`
//!
//! * `rtt(r)`: the probe's EWMA of the health round trip, else the
//!   configured `rtt_ms`.
//! * `uncached_tokens(r)`: prompt tokens beyond the prefix the directory
//!   believes `r` holds.
//! * `queue_ms(r)`: requests ahead of this one beyond the engine's
//!   concurrency, times the mean slot time per slot. Occupancy is the
//!   engine's waiting + running at the last scrape plus what this Envoy has
//!   sent (or finished) since: the in-flight gauge now minus its value at the
//!   scrape. A burst between two probe ticks therefore sees its own load.
//!
//! Unhealthy regions are not candidates. Regions within `tie_ms` of the best
//! are a tie, broken by rendezvous hashing of the prompt's first block so
//! that independent proxies agree on where a new conversation goes.

use crate::config::Config;
use crate::snapshot::Snapshot;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Why a region was chosen, for counters and the decision header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds the longest cached prefix among the candidates.
    Cache,
    /// A region holding more of the prompt was passed over for its queue.
    Load,
    /// Nothing cached decided it: the lowest network + queue cost won.
    Rtt,
    /// No usable snapshot, or no healthy region: nearest configured region.
    Fallback,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Load => "load",
            Reason::Rtt => "rtt",
            Reason::Fallback => "fallback",
        }
    }
    pub const ALL: [Reason; 4] = [Reason::Cache, Reason::Load, Reason::Rtt, Reason::Fallback];
}

/// The terms of one region's expected TTFT, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Cost {
    pub rtt_ms: f64,
    pub prefill_ms: f64,
    pub queue_ms: f64,
    pub total_ms: f64,
    pub cached_tokens: u64,
    pub candidate: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub region: usize,
    pub runner_up: Option<usize>,
    pub reason: Reason,
    /// Per configured region (same order as `Config::regions`).
    pub costs: Vec<Cost>,
}

/// Everything the decision reads, gathered by the caller.
pub struct Inputs<'a> {
    pub config: &'a Config,
    /// A fresh snapshot, or `None` when there is none or it is stale.
    pub snapshot: Option<&'a Snapshot>,
    /// Per configured region: the index of its entry in the snapshot.
    pub snapshot_index: &'a [Option<usize>],
    /// Per configured region: blocks of the prompt it holds.
    pub cached_blocks: &'a [u32],
    /// Per configured region: this Envoy's in-flight requests now.
    pub inflight: &'a [f64],
    pub prompt_tokens: u64,
    pub first_block: Option<u64>,
}

/// Expected queueing wait for one more request at `occupancy` requests.
pub fn queue_ms(occupancy: f64, max_concurrency: u32, service_ms: f64) -> f64 {
    let slots = f64::from(max_concurrency.max(1));
    let ahead = (occupancy + 1.0 - slots).max(0.0);
    ahead / slots * service_ms
}

pub fn decide(inp: &Inputs) -> Decision {
    let cfg = inp.config;
    let block_tokens = f64::from(cfg.prefix.block_bytes) / cfg.prefix.bytes_per_token;
    let Some(snap) = inp.snapshot else {
        return fallback(inp, None);
    };
    let mut costs = Vec::with_capacity(cfg.regions.len());
    for (i, region) in cfg.regions.iter().enumerate() {
        let state = inp
            .snapshot_index
            .get(i)
            .copied()
            .flatten()
            .and_then(|j| snap.regions.get(j));
        // A region the probe does not report on is assumed healthy with its
        // configured figures: the probe's configuration may lag the filters'.
        let healthy = state.is_none_or(|s| s.healthy);
        let rtt = state.and_then(|s| s.rtt_ms).unwrap_or(region.rtt_ms);
        let inflight_now = inp.inflight.get(i).copied().unwrap_or(0.0);
        let occupancy = state.map_or(inflight_now, |s| {
            (s.waiting + s.running + inflight_now - s.inflight_at_scrape).max(0.0)
        });
        let cached_blocks = inp.cached_blocks.get(i).copied().unwrap_or(0);
        let cached_tokens =
            ((f64::from(cached_blocks) * block_tokens).floor() as u64).min(inp.prompt_tokens);
        let uncached = inp.prompt_tokens - cached_tokens;
        let rtt_ms = cfg.cost.w_rtt * rtt;
        let prefill_ms = region.prefill_ms_per_token * uncached as f64;
        let queue =
            cfg.cost.w_queue * queue_ms(occupancy, region.max_concurrency, region.service_ms);
        costs.push(Cost {
            rtt_ms,
            prefill_ms,
            queue_ms: queue,
            total_ms: rtt_ms + prefill_ms + queue,
            cached_tokens,
            candidate: healthy,
        });
    }
    let best = costs
        .iter()
        .filter(|c| c.candidate)
        .map(|c| c.total_ms)
        .fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return fallback(inp, Some(costs));
    }
    let tied = |c: &Cost| c.candidate && c.total_ms <= best + cfg.cost.tie_ms;
    let key = inp.first_block.unwrap_or(0);
    let mut region = 0;
    let mut top = None;
    for (i, c) in costs.iter().enumerate() {
        if !tied(c) {
            continue;
        }
        let score = rendezvous(key, cfg.regions.get(i).map_or("", |r| r.name.as_str()));
        if top.is_none_or(|t| score > t) {
            top = Some(score);
            region = i;
        }
    }
    let runner_up = costs
        .iter()
        .enumerate()
        .filter(|(i, c)| *i != region && c.candidate)
        .min_by(|a, b| a.1.total_ms.total_cmp(&b.1.total_ms))
        .map(|(i, _)| i);
    let chosen_cached = costs.get(region).map_or(0, |c| c.cached_tokens);
    let most_cached = costs
        .iter()
        .filter(|c| c.candidate)
        .map(|c| c.cached_tokens)
        .max()
        .unwrap_or(0);
    let reason = if most_cached > chosen_cached {
        // A better-cached region lost: to its queue, or to its distance.
        let holder = costs
            .iter()
            .filter(|c| c.candidate && c.cached_tokens == most_cached)
            .min_by(|a, b| a.total_ms.total_cmp(&b.total_ms));
        let chosen = costs.get(region);
        match (holder, chosen) {
            (Some(h), Some(c)) if h.queue_ms - c.queue_ms > h.rtt_ms - c.rtt_ms => Reason::Load,
            _ => Reason::Rtt,
        }
    } else if chosen_cached > 0 {
        Reason::Cache
    } else {
        Reason::Rtt
    };
    Decision {
        region,
        runner_up,
        reason,
        costs,
    }
}

/// No usable snapshot, or no healthy region: nearest configured region
/// among those last known healthy, else nearest configured region.
fn fallback(inp: &Inputs, costs: Option<Vec<Cost>>) -> Decision {
    let cfg = inp.config;
    let known_healthy = |i: usize| {
        inp.snapshot
            .zip(inp.snapshot_index.get(i).copied().flatten())
            .and_then(|(s, j)| s.regions.get(j))
            .is_none_or(|r| r.healthy)
    };
    let mut best: Option<usize> = None;
    for (i, r) in cfg.regions.iter().enumerate() {
        if known_healthy(i)
            && best
                .and_then(|b| cfg.regions.get(b))
                .is_none_or(|b| r.rtt_ms < b.rtt_ms)
        {
            best = Some(i);
        }
    }
    Decision {
        region: best.unwrap_or_else(|| cfg.nearest_configured_region()),
        runner_up: None,
        reason: Reason::Fallback,
        costs: costs.unwrap_or_default(),
    }
}

/// Highest-random-weight score of `region` for `key`.
pub fn rendezvous(key: u64, region: &str) -> u64 {
    xxh3_64_with_seed(region.as_bytes(), key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::RegionState;

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[
              {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000},
              {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000},
              {"name":"far","cluster":"cf","capacity_rps":5,"rtt_ms":120,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000}]}"#,
        )
        .unwrap()
    }

    fn snap(c: &Config) -> Snapshot {
        Snapshot {
            regions: c
                .regions
                .iter()
                .map(|r| RegionState {
                    name: r.name.clone(),
                    healthy: true,
                    rtt_ms: Some(r.rtt_ms),
                    ..RegionState::default()
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    fn run(
        c: &Config,
        s: Option<&Snapshot>,
        cached: [u32; 3],
        inflight: [f64; 3],
        tokens: u64,
    ) -> Decision {
        decide(&Inputs {
            config: c,
            snapshot: s,
            snapshot_index: &[Some(0), Some(1), Some(2)],
            cached_blocks: &cached,
            inflight: &inflight,
            prompt_tokens: tokens,
            first_block: Some(42),
        })
    }

    #[test]
    fn cold_prompt_goes_to_nearest() {
        let c = cfg();
        let s = snap(&c);
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 1000);
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
        assert_eq!(d.runner_up, Some(1));
        assert_eq!(d.costs[0].total_ms, 5.0 + 500.0);
    }

    #[test]
    fn warm_region_wins_when_prefill_saving_beats_distance() {
        let c = cfg();
        let s = snap(&c);
        // 1000 tokens, mid holds 62 blocks (992 tokens): saves 496 ms for 35 ms more RTT.
        let d = run(&c, Some(&s), [0, 62, 0], [0.0; 3], 1000);
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        // A short prompt: the saving (8 blocks → 16 ms) does not pay for 35 ms.
        let d = run(&c, Some(&s), [0, 2, 0], [0.0; 3], 40);
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
    }

    #[test]
    fn queued_warm_region_is_avoided() {
        let c = cfg();
        let mut s = snap(&c);
        s.regions[1].waiting = 10.0;
        s.regions[1].running = 4.0;
        let d = run(&c, Some(&s), [0, 62, 0], [0.0; 3], 1000);
        assert_eq!((d.region, d.reason), (0, Reason::Load));
        assert!(d.costs[1].queue_ms > 2500.0);
    }

    #[test]
    fn own_inflight_since_scrape_counts() {
        let c = cfg();
        let s = snap(&c);
        // 8 requests sent to `near` since the last scrape: it is full.
        let d = run(&c, Some(&s), [0, 0, 0], [8.0, 0.0, 0.0], 100);
        assert_eq!(d.region, 1);
        // Already counted by the engine at the scrape: not counted twice.
        let mut s2 = snap(&c);
        s2.regions[0].running = 2.0;
        s2.regions[0].inflight_at_scrape = 2.0;
        let d = run(&c, Some(&s2), [0, 0, 0], [2.0, 0.0, 0.0], 100);
        assert_eq!(d.region, 0);
        assert_eq!(d.costs[0].queue_ms, 0.0);
    }

    #[test]
    fn unhealthy_regions_are_skipped_and_fallback_is_nearest_healthy() {
        let c = cfg();
        let mut s = snap(&c);
        s.regions[0].healthy = false;
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 100);
        assert_eq!(d.region, 1);
        for r in &mut s.regions {
            r.healthy = false;
        }
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 100);
        assert_eq!((d.region, d.reason), (0, Reason::Fallback));
        let d = run(&c, None, [0, 0, 0], [0.0; 3], 100);
        assert_eq!((d.region, d.reason), (0, Reason::Fallback));
    }

    #[test]
    fn ties_are_broken_by_rendezvous_consistently() {
        let mut c = cfg();
        for r in &mut c.regions {
            r.rtt_ms = 10.0;
        }
        let s = snap(&c);
        let mut seen = std::collections::HashSet::new();
        for key in 0..64u64 {
            let inp = Inputs {
                config: &c,
                snapshot: Some(&s),
                snapshot_index: &[Some(0), Some(1), Some(2)],
                cached_blocks: &[0, 0, 0],
                inflight: &[0.0; 3],
                prompt_tokens: 10,
                first_block: Some(key),
            };
            let a = decide(&inp).region;
            assert_eq!(a, decide(&inp).region);
            seen.insert(a);
        }
        assert_eq!(seen.len(), 3, "rendezvous spreads new conversations");
    }

    #[test]
    fn monotone_in_rtt_queue_and_cache() {
        let c = cfg();
        let base = snap(&c);
        for extra in [0.0, 10.0, 100.0, 1000.0] {
            let mut s = base.clone();
            s.regions[1].rtt_ms = Some(40.0 + extra);
            let d0 = run(&c, Some(&base), [0, 62, 0], [0.0; 3], 1000);
            let d1 = run(&c, Some(&s), [0, 62, 0], [0.0; 3], 1000);
            assert!(d1.costs[1].total_ms >= d0.costs[1].total_ms);
            let more_cache = run(&c, Some(&base), [0, 63, 0], [0.0; 3], 1000);
            assert!(more_cache.costs[1].total_ms <= d0.costs[1].total_ms);
        }
        assert!(queue_ms(10.0, 4, 100.0) > queue_ms(5.0, 4, 100.0));
        assert_eq!(queue_ms(2.0, 4, 100.0), 0.0);
    }
}
