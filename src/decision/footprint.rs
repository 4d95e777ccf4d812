//! The cache a request's prefill takes at a region, priced
//! (`footprint_ms`): the re-prefill it causes later to the prefixes the
//! region then evicts sooner.
//!
//! A region's engine keeps an LRU prefix cache of `C` tokens (per replica).
//! By its intake clock (the engine's counters, this Envoy's own prefills
//! placed in it) an entry survives `T` ms unused: the time the last `C`
//! tokens took to go in (Che's characteristic time). The deployment's
//! reuse gaps (`learning::reuse`) say how densely reused tokens come back
//! after a gap `g` (`f(g)`, a share per ms).
//!
//! Taking in `u` new tokens brings every resident entry's eviction forward
//! by `u / λ` ms (`λ = C / T`, the intake rate). The reuses lost are those
//! whose gap falls in that last stretch of `T`: of the `h · T` tokens the
//! region will serve from entries resident now (`h`: its hit tokens a ms,
//! from its prefix-cache counters), the share `f(T) · u / λ`. So
//! `u · h · f(T) · T² / C` tokens to prefill again, priced at the region's
//! prefill rate: the cache's counterpart of the queue's externality `x`.
//!
//! Nothing here is a share of in-flight requests: a region whose cache is
//! large against its intake keeps what it takes and costs nothing; one
//! whose cache turns over within the gaps the deployment's prompts leave
//! prices every new prefix. What the prompt's own next use loses where it
//! is evicted before it comes back is not priced: a first version that
//! priced it (the share of reuse beyond what the region keeps, times the
//! engines' hit ratio) lost on scenario f and gained nothing elsewhere
//! (docs/ROUTING.md, "The cache a prefill takes").

use crate::fleet::snapshot::RegionState;
use crate::learning::reuse::density;

/// How long ago, by `clock` ((ms, tokens taken in so far), ascending),
/// the last `room` tokens started going in, at `now_ms`: what an entry
/// last used then has left of a cache of `room` free tokens. `None`: less
/// than `room` went in over the whole clock (nothing is evicted yet).
pub fn survival_ms(clock: &[(u64, f64)], room: f64, now_ms: u64) -> Option<f64> {
    if room <= 0.0 {
        return Some(0.0);
    }
    let &(_, total) = clock.last()?;
    let target = total - room;
    let &(t0, first) = clock.first()?;
    if target < first {
        return None;
    }
    // The last point at or below the target, and the next one.
    let i = clock.partition_point(|(_, c)| *c <= target);
    let (ta, ca) = *clock.get(i.checked_sub(1)?)?;
    let at = match clock.get(i) {
        Some(&(tb, cb)) if cb > ca && tb > ta => {
            ta as f64 + (target - ca) / (cb - ca) * (tb - ta) as f64
        }
        _ => ta.max(t0) as f64,
    };
    Some((now_ms as f64 - at).max(0.0))
}

/// What the request's prefill of `uncached` tokens at region `state`
/// costs later, in tokens others then prefill again there; 0 where the
/// region's cache is not modelled, or has not turned over yet.
pub fn footprint_tokens(
    state: &RegionState,
    clock: &[(u64, f64)],
    gaps: &[f64],
    uncached: f64,
    now_ms: u64,
) -> f64 {
    let Some(free) = state.cache_free_tokens.filter(|f| *f > 0.0) else {
        return 0.0;
    };
    let Some(t) = survival_ms(clock, free, now_ms) else {
        return 0.0;
    };
    let replicas = f64::from(state.replicas.unwrap_or(1).max(1));
    let hits_per_ms = state.hit_tokens_per_s.unwrap_or(0.0).max(0.0) / 1000.0 / replicas;
    let lost = uncached * hits_per_ms * density(gaps, t) * t * t / free;
    if lost.is_finite() {
        lost.clamp(0.0, free)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learning::reuse::ReuseGaps;

    #[test]
    fn survival_is_how_long_the_last_room_tokens_took() {
        // 1000 tokens a second for 10 s.
        let clock: Vec<(u64, f64)> = (0..=10).map(|s| (s * 1000, s as f64 * 1000.0)).collect();
        assert_eq!(survival_ms(&clock, 4000.0, 10_000), Some(4000.0));
        assert_eq!(survival_ms(&clock, 2500.0, 10_000), Some(2500.0));
        // Nothing went in since the last point: older by as much.
        assert_eq!(survival_ms(&clock, 4000.0, 12_000), Some(6000.0));
        // More than ever went in: nothing evicted yet.
        assert_eq!(survival_ms(&clock, 20_000.0, 10_000), None);
        assert_eq!(survival_ms(&[], 1.0, 10_000), None);
        assert_eq!(survival_ms(&clock, 0.0, 10_000), Some(0.0));
    }

    #[test]
    fn a_cache_that_keeps_what_comes_back_charges_nothing_and_one_that_turns_over_does() {
        // Prompts come back after 20 s (all of the reuse).
        let mut g = ReuseGaps::default();
        g.add(20_000, 1000.0, 1);
        let gaps = g.normalised();
        let state = RegionState {
            cache_free_tokens: Some(100_000.0),
            hit_tokens_per_s: Some(2000.0),
            ..RegionState::default()
        };
        // 1000 tokens a second into 100k: T = 100 s, far beyond 20 s.
        let slow: Vec<(u64, f64)> = (0..=200).map(|s| (s * 1000, s as f64 * 1000.0)).collect();
        assert_eq!(footprint_tokens(&state, &slow, &gaps, 5000.0, 200_000), 0.0);
        // 5000 a second: T = 20 s, at the gaps: 5000 x 2 tokens/ms x f(20 s)
        // x (20 s)^2 / 100k.
        let fast: Vec<(u64, f64)> = (0..=200).map(|s| (s * 1000, s as f64 * 5000.0)).collect();
        let t = footprint_tokens(&state, &fast, &gaps, 5000.0, 200_000);
        let want = 5000.0 * 2.0 * density(&gaps, 20_000.0) * 20_000.0f64.powi(2) / 100_000.0;
        assert!(want > 100.0 && (t - want).abs() < 1e-6, "{t} {want}");
        // Twice the replicas share the hits: half as much each.
        let two = RegionState {
            replicas: Some(2),
            ..state.clone()
        };
        assert!((footprint_tokens(&two, &fast, &gaps, 5000.0, 200_000) - want / 2.0).abs() < 1e-6);
        // Not modelled, no gaps seen, garbage: nothing.
        let unknown = RegionState::default();
        assert_eq!(
            footprint_tokens(&unknown, &fast, &gaps, 5000.0, 200_000),
            0.0
        );
        assert_eq!(footprint_tokens(&state, &fast, &[], 5000.0, 200_000), 0.0);
        let nan = RegionState {
            hit_tokens_per_s: Some(f64::NAN),
            ..state.clone()
        };
        assert_eq!(footprint_tokens(&nan, &fast, &gaps, 5000.0, 200_000), 0.0);
    }

    #[test]
    fn a_new_prompt_leaves_the_near_region_whose_cache_turns_over_at_the_gaps() {
        use crate::decision::choice::decide;
        use crate::decision::choice::tests::{cfg, inputs, snap};
        use crate::decision::cost::Reason;
        // 1000 tokens: near (5 ms) would prefill them in 500 ms, mid (40
        // ms) too. Prompts come back after about 20 s.
        let c = cfg();
        let mut s = snap(&c);
        let mut g = ReuseGaps::default();
        g.add(20_000, 1000.0, 1);
        s.reuse_gaps = g.normalised();
        for r in &mut s.regions {
            r.cache_free_tokens = Some(100_000.0);
            r.hit_tokens_per_s = Some(2000.0);
        }
        // near takes in 5000 tokens a second (its cache turns over in 20
        // s, at the gaps), mid 500 (in 200 s).
        let fast: Vec<(u64, f64)> = (0..=200).map(|s| (s * 1000, s as f64 * 5000.0)).collect();
        let slow: Vec<(u64, f64)> = (0..=200).map(|s| (s * 1000, s as f64 * 500.0)).collect();
        let clocks = vec![fast.clone(), slow.clone(), slow];
        let mut inp = inputs(&c, &s, &[0, 0, 0], None);
        inp.now_ms = 200_000;
        inp.clocks = &clocks;
        let d = decide(&inp);
        let near = d.costs[0];
        let want = 0.5 * footprint_tokens(&s.regions[0], &fast, &s.reuse_gaps, 1000.0, 200_000);
        assert!(want > 35.0, "{want}");
        assert!((near.footprint_ms - want).abs() < 1e-9, "{near:?}");
        assert_eq!(d.costs[1].footprint_ms, 0.0);
        assert!(
            (near.total_ms - (near.rtt_ms + near.prefill_ms + near.queue_ms + want)).abs() < 1e-9
        );
        assert_eq!((d.region, d.reason), (1, Reason::Rtt), "{:?}", d.costs);
        // Without the clocks (nothing modelled), near as before.
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!(d.region, 0);
        assert_eq!(d.costs[0].footprint_ms, 0.0);
    }
}
