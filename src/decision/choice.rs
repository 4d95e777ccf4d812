//! The choice: the region that minimises the expected time to first token
//! (`cost`) among the candidates, and why (`decide`).
//!
//! Unhealthy regions are not candidates, nor are regions whose context
//! limit the request exceeds (`request::limits`). Regions of exactly the least cost
//! are a tie, broken by rendezvous hashing of the prompt's first block so
//! that independent proxies agree on where a new conversation goes.

use crate::decision::cost::{
    move_ms, price_externality, region_costs, Cost, Decision, PassedOver, Reason,
};
use crate::decision::inputs::{allowed, region_slots, Inputs};
use crate::decision::load_guard::{apply_load_guard, holds_prompt};
use crate::fleet::snapshot::Snapshot;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The region for a request: the cheapest candidate the load guard leaves,
/// its reason, the runner-up and every region's cost.
pub fn decide(inp: &Inputs) -> Decision {
    let Some(snap) = inp.snapshot else {
        return fallback(inp, Vec::new());
    };
    let mut costs = region_costs(inp, snap);
    let allowed = |i: usize| allowed(inp, i);
    // Release parity: a region on another release gets no new traffic,
    // unless no healthy region is on the expected one (a fleet-wide
    // mismatch is for rollback, not a reason to route nowhere).
    let state = |i: usize| snap.region_at(inp.snapshot_index, i);
    let any_release_ok = costs
        .iter()
        .enumerate()
        .any(|(i, c)| c.healthy && state(i).is_none_or(|s| s.release_ok));
    let ramp_key = inp.first_block.unwrap_or(0);
    let slots = |i: usize| f64::from(region_slots(inp, i));
    // The ramp protects a returning region's cold caches from a stampede; it
    // must not hold it back while every fully ramped region is full.
    let others_full = costs.iter().enumerate().all(|(i, c)| {
        let ramping = state(i).is_some_and(|s| s.ramp < 1.0);
        ramping || !c.healthy || !allowed(i) || c.over_context || c.occupancy + 1.0 > slots(i)
    });
    for (i, c) in costs.iter_mut().enumerate() {
        let st = state(i);
        let release_ok = !any_release_ok || st.is_none_or(|s| s.release_ok);
        // Failback ramp: a region coming back takes only its ramp's share of
        // new prompts, the same share for every proxy (by rendezvous).
        let ramp_ok = st.is_none_or(|s| {
            s.ramp >= 1.0 || (rendezvous(ramp_key, &s.name) as f64 / u64::MAX as f64) < s.ramp
        }) || others_full;
        c.healthy = c.healthy && release_ok;
        c.candidate = c.healthy && allowed(i) && ramp_ok && !c.over_context;
    }
    if !costs.iter().any(|c| c.candidate) {
        price_externality(inp, &mut costs);
        return fallback(inp, costs);
    }
    // Where a region holds the prompt, the choice is between waiting there
    // and a full prefill elsewhere; the externality term, which would move
    // a kept conversation off a busy holder into a cache miss that the term
    // does not price (the holder's copy wasted, a second copy evicting
    // others' prefixes), is left out: the prompt's own expected wait
    // decides (A/B in docs/ROUTING.md).
    let held = holds_prompt(&costs, inp.prompt_tokens);
    if !held {
        price_externality(inp, &mut costs);
    }
    apply_load_guard(inp, &mut costs, held);
    let eligible = |c: &Cost| c.candidate && !c.over_bound;
    let Some(region) = pick(inp, &costs, eligible) else {
        return fallback(inp, costs);
    };
    let runner_up = costs
        .iter()
        .enumerate()
        .filter(|(i, c)| *i != region && eligible(c))
        .min_by(|a, b| a.1.total_ms.total_cmp(&b.1.total_ms))
        .map(|(i, _)| i);
    // What would have won without the pin and without the load bound.
    let unpinned = costs
        .iter()
        .enumerate()
        .filter(|(_, c)| c.healthy && c.total_ms.is_finite())
        .min_by(|a, b| a.1.total_ms.total_cmp(&b.1.total_ms))
        .map(|(i, _)| i);
    // ... and what would have won among the allowed without the context
    // limits.
    let unlimited = costs
        .iter()
        .enumerate()
        .filter(|(i, c)| c.healthy && allowed(*i) && c.total_ms.is_finite())
        .min_by(|a, b| a.1.total_ms.total_cmp(&b.1.total_ms))
        .map(|(i, _)| i);
    let cheaper = |other: Option<usize>| {
        costs
            .get(region)
            .zip(other.and_then(|u| costs.get(u)))
            .is_some_and(|(c, u)| u.total_ms < c.total_ms)
    };
    let unbounded = pick(inp, &costs, |c| c.candidate);
    let reason = if unpinned.is_some_and(|u| !allowed(u) && u != region) && cheaper(unpinned) {
        Reason::Pin
    } else if unlimited.is_some_and(|u| u != region && costs.get(u).is_some_and(|c| c.over_context))
        && cheaper(unlimited)
    {
        Reason::Context
    } else if let Some(u) = unbounded.filter(|&u| u != region) {
        if costs.get(u).is_some_and(|c| c.over_wait) {
            Reason::LoadOverride
        } else {
            Reason::Spread
        }
    } else {
        cost_reason(&costs, region, |c| c.candidate)
    };
    let passed_over = match reason {
        Reason::LoadOverride | Reason::Spread => unbounded,
        Reason::Load => holder(&costs, |c| c.candidate),
        _ => None,
    }
    .and_then(|p| passed_over(&costs, p, region));
    Decision {
        region,
        runner_up,
        reason,
        costs,
        passed_over,
    }
}

/// The two costs compared when `region` is chosen over `from`.
fn passed_over(costs: &[Cost], from: usize, region: usize) -> Option<PassedOver> {
    let f = costs.get(from)?;
    let c = costs.get(region)?;
    Some(PassedOver {
        region: from,
        wait_ms: f.wait_ms,
        move_ms: move_ms(f, c),
    })
}

fn state_healthy(inp: &Inputs, snap: &Snapshot, i: usize) -> bool {
    snap.region_at(inp.snapshot_index, i)
        .is_none_or(|s| s.healthy)
}

/// The cheapest region among those `eligible`; among regions of exactly the
/// least cost, the rendezvous winner.
fn pick(inp: &Inputs, costs: &[Cost], eligible: impl Fn(&Cost) -> bool) -> Option<usize> {
    let cfg = inp.config;
    let best = costs
        .iter()
        .filter(|c| eligible(c))
        .map(|c| c.total_ms)
        .fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return None;
    }
    let key = inp.first_block.unwrap_or(0);
    let mut chosen = None;
    let mut top = 0u64;
    for (i, c) in costs.iter().enumerate() {
        if !eligible(c) || c.total_ms > best {
            continue;
        }
        let score = rendezvous(key, cfg.regions.get(i).map_or("", |r| r.name.as_str()));
        if chosen.is_none() || score > top {
            top = score;
            chosen = Some(i);
        }
    }
    chosen
}

/// Among cost-driven choices: did the cache win, did a queue push the request
/// away from the region holding more of it, or did distance decide?
fn cost_reason(costs: &[Cost], region: usize, eligible: impl Fn(&Cost) -> bool) -> Reason {
    let chosen_cached = costs.get(region).map_or(0, |c| c.cached_tokens);
    let most_cached = costs
        .iter()
        .filter(|c| eligible(c))
        .map(|c| c.cached_tokens)
        .max()
        .unwrap_or(0);
    if most_cached > chosen_cached {
        let holder = holder(costs, eligible).and_then(|h| costs.get(h));
        match (holder, costs.get(region)) {
            (Some(h), Some(c)) if h.queue_ms - c.queue_ms > h.rtt_ms - c.rtt_ms => Reason::Load,
            _ => Reason::Rtt,
        }
    } else if chosen_cached > 0 {
        Reason::Cache
    } else {
        Reason::Rtt
    }
}

/// The cheapest of the regions holding the most of the prompt among those
/// `eligible`, if any holds some.
fn holder(costs: &[Cost], eligible: impl Fn(&Cost) -> bool) -> Option<usize> {
    let most = costs
        .iter()
        .filter(|c| eligible(c))
        .map(|c| c.cached_tokens)
        .max()
        .filter(|&m| m > 0)?;
    costs
        .iter()
        .enumerate()
        .filter(|(_, c)| eligible(c) && c.cached_tokens == most)
        .min_by(|a, b| a.1.total_ms.total_cmp(&b.1.total_ms))
        .map(|(i, _)| i)
}

/// No usable snapshot, or no healthy candidate: the nearest configured
/// region among those allowed, able to take the request (context limit)
/// and last known healthy; else the nearest allowed that can take it;
/// else the nearest allowed; else the nearest.
fn fallback(inp: &Inputs, costs: Vec<Cost>) -> Decision {
    let cfg = inp.config;
    let allowed = |i: usize| allowed(inp, i);
    let known_healthy = |i: usize| inp.snapshot.is_none_or(|s| state_healthy(inp, s, i));
    let nearest = |ok: &dyn Fn(usize) -> bool| {
        let mut best: Option<usize> = None;
        for (i, r) in cfg.regions.iter().enumerate() {
            if ok(i)
                && best
                    .and_then(|b| cfg.regions.get(b))
                    .is_none_or(|b| r.rtt_ms < b.rtt_ms)
            {
                best = Some(i);
            }
        }
        best
    };
    let fits = |i: usize| i < 64 && inp.fits & (1 << i) != 0;
    let region = nearest(&|i| allowed(i) && fits(i) && known_healthy(i))
        .or_else(|| nearest(&|i| allowed(i) && fits(i)))
        .or_else(|| nearest(&allowed))
        .unwrap_or_else(|| cfg.nearest_configured_region());
    Decision {
        region,
        runner_up: None,
        reason: Reason::Fallback,
        costs,
        passed_over: None,
    }
}

/// Highest-random-weight score of `region` for `key`.
pub fn rendezvous(key: u64, region: &str) -> u64 {
    xxh3_64_with_seed(region.as_bytes(), key)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::Config;

    pub(crate) fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[
              {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000},
              {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000},
              {"name":"far","cluster":"cf","capacity_rps":5,"rtt_ms":120,"max_concurrency":4,"prefill_ms_per_token":0.5,"service_ms":1000}]}"#,
        )
        .unwrap()
    }

    pub(crate) fn snap(c: &Config) -> Snapshot {
        Snapshot::all_healthy(c)
    }

    pub(crate) fn run(
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
            clocks: &[],
            inflight: &inflight,
            prompt_tokens: tokens,
            prompt_bytes: tokens * 4,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(42),
            allowed: None,
            fits: u64::MAX,
            now_ms: 0,
        })
    }

    pub(crate) fn inputs<'a>(
        c: &'a Config,
        s: &'a Snapshot,
        cached: &'a [u32],
        allowed: Option<&'a [bool]>,
    ) -> Inputs<'a> {
        Inputs {
            config: c,
            snapshot: Some(s),
            snapshot_index: &[Some(0), Some(1), Some(2)],
            cached_blocks: cached,
            clocks: &[],
            inflight: &[0.0; 3],
            prompt_tokens: 1000,
            prompt_bytes: 4000,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(7),
            allowed,
            fits: u64::MAX,
            now_ms: 0,
        }
    }

    pub(crate) fn eight_slots() -> Config {
        let mut c = cfg();
        for r in &mut c.regions {
            r.max_concurrency = 8;
        }
        c
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

    /// A cold prompt of 10 tokens (nothing cached, nothing in flight)
    /// whose first block is `key`, decided with `c`'s configured weights.
    fn decide_cold(c: &Config, s: &Snapshot, index: &[Option<usize>], key: u64) -> Decision {
        decide(&Inputs {
            config: c,
            snapshot: Some(s),
            snapshot_index: index,
            cached_blocks: &[0, 0, 0],
            clocks: &[],
            inflight: &[0.0; 3],
            prompt_tokens: 10,
            prompt_bytes: 40,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(key),
            allowed: None,
            fits: u64::MAX,
            now_ms: 0,
        })
    }

    #[test]
    fn ties_are_broken_by_rendezvous_consistently() {
        // Two proxies with the same view: the second lists the regions in
        // the opposite order, and its probe's snapshot in the first's order.
        // A tie goes to the same region by name, whatever the indices.
        let mut c = cfg();
        for r in &mut c.regions {
            r.rtt_ms = 10.0;
        }
        let mut c2 = c.clone();
        c2.regions.reverse();
        let s = snap(&c);
        let mut seen = std::collections::HashSet::new();
        for key in 0..64u64 {
            let a = decide_cold(&c, &s, &[Some(0), Some(1), Some(2)], key);
            let b = decide_cold(&c2, &s, &[Some(2), Some(1), Some(0)], key);
            assert_eq!(a.reason, Reason::Rtt);
            let name = c.regions[a.region].name.as_str();
            assert_eq!(name, c2.regions[b.region].name, "key {key}");
            seen.insert(name);
        }
        assert_eq!(seen.len(), 3, "rendezvous spreads new conversations");
        // Only exact ties: a region a hundredth of a millisecond cheaper
        // takes every prompt, whatever its rendezvous score.
        c.regions[1].rtt_ms = 9.99;
        let s = snap(&c);
        for key in 0..64u64 {
            let d = decide_cold(&c, &s, &[Some(0), Some(1), Some(2)], key);
            assert_eq!((d.region, d.reason), (1, Reason::Rtt), "key {key}");
        }
    }

    #[test]
    fn residency_pin_is_a_hard_constraint() {
        let c = cfg();
        let mut s = snap(&c);
        let only_far = [false, false, true];
        let d = decide(&inputs(&c, &s, &[0, 62, 0], Some(&only_far)));
        assert_eq!((d.region, d.reason), (2, Reason::Pin));
        // Even when the pinned region is unhealthy, the request stays inside the pin.
        s.regions[2].healthy = false;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], Some(&only_far)));
        assert_eq!((d.region, d.reason), (2, Reason::Fallback));
        // A pin that allows the best region changes nothing.
        let s = snap(&c);
        let near_mid = [true, true, false];
        let d = decide(&inputs(&c, &s, &[0, 62, 0], Some(&near_mid)));
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
    }

    #[test]
    fn regions_that_cannot_take_the_request_are_not_candidates() {
        let c = cfg();
        let s = snap(&c);
        // near is cheapest but cannot take it: mid, for its context.
        let mut inp = inputs(&c, &s, &[0, 0, 0], None);
        inp.fits = !0b001;
        let d = decide(&inp);
        assert_eq!((d.region, d.reason), (1, Reason::Context));
        assert!(d.costs[0].over_context && !d.costs[0].candidate);
        assert_eq!(d.runner_up, Some(2));
        // Excluding a region that would not have won changes nothing.
        inp.fits = !0b100;
        assert_eq!(decide(&inp).reason, Reason::Rtt);
        // With a pin to near and far: far, for near's context.
        let near_far = [true, false, true];
        let mut inp = inputs(&c, &s, &[0, 0, 0], Some(&near_far));
        inp.fits = 0b110;
        let d = decide(&inp);
        assert_eq!((d.region, d.reason), (2, Reason::Context));
        // No healthy region that can take it: the nearest that can.
        let mut s2 = snap(&c);
        s2.regions[1].healthy = false;
        s2.regions[2].healthy = false;
        let mut inp = inputs(&c, &s2, &[0, 0, 0], None);
        inp.fits = 0b110;
        let d = decide(&inp);
        assert_eq!((d.region, d.reason), (1, Reason::Fallback));
    }

    #[test]
    fn release_mismatch_and_ramp_exclude_regions() {
        let c = cfg();
        let mut s = snap(&c);
        s.regions[0].release_ok = false;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!(d.region, 1, "the mismatched nearest region gets nothing");
        // Fleet-wide mismatch: routing goes on by health alone.
        for r in &mut s.regions {
            r.release_ok = false;
        }
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!(d.region, 0);
        // A region ramping back in at 30 % takes about 30 % of new prompts.
        let mut s = snap(&c);
        s.regions[0].ramp = 0.3;
        let mut near = 0;
        for key in 0..2000u64 {
            let mut inp = inputs(&c, &s, &[0, 0, 0], None);
            inp.first_block = Some(key);
            near += usize::from(decide(&inp).region == 0);
        }
        assert!((500..=700).contains(&near), "{near}");
    }
}
