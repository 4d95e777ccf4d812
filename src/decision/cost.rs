//! One expected time to first token per region, in milliseconds: the cost
//! the decision minimises (`choice`), term by term.
//!
//! `ttft(r) = rtt(r) + prefill_ms_per_token(r)·uncached_tokens(r) + queue_ms(r) + x(r) + e(r)`
//!
//! * `rtt(r)`: the least of the probe's recent health round trips, else the
//!   configured `rtt_ms`.
//! * `uncached_tokens(r)`: prompt tokens beyond the prefix the directory
//!   believes `r` holds, in the engine's whole blocks and short of the
//!   prompt's last token (`engines::capacity::servable_tokens`).
//! * `queue_ms(r)`: requests ahead of this one beyond the engine's
//!   concurrency, times the mean slot time per slot. Occupancy is the
//!   engine's waiting + running at the last scrape plus what this Envoy has
//!   sent (or finished) since: the in-flight gauge now minus its value at the
//!   scrape. A burst between two probe ticks therefore sees its own load.
//! * `x(r)`: the externality, the delay this request adds to the requests
//!   that arrive at `r` while it is there ([`externality_ms`]); left out
//!   where a region holds the prompt.
//! * `e(r)`: the cache's externality, the re-prefill the uncached tokens'
//!   footprint in `r`'s cache causes to the prefixes it then evicts sooner
//!   (`footprint`).

use crate::decision::footprint::footprint_tokens;
use crate::decision::inputs::{region_slots, Inputs};
use crate::engines::capacity::servable_tokens;
use crate::fleet::snapshot::{RegionState, Snapshot};
use crate::fleet::tokens::{tokens_of, tokens_per_byte};

/// Why a region was chosen, for counters and the decision header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// It holds the longest cached prefix among the candidates.
    Cache,
    /// A region holding more of the prompt was passed over for its queue.
    Load,
    /// Nothing cached decided it: the lowest network + queue cost won.
    Rtt,
    /// The load guard passed over the region holding the prompt: it had no
    /// free slot, and its expected wait exceeded what the move costs (the
    /// prefill of the tokens not held elsewhere plus the round-trip
    /// difference), though the weighted cost alone would have stayed.
    LoadOverride,
    /// The load guard's placement bound passed over the cheapest region for
    /// a prompt no region holds (a new conversation, or one held everywhere
    /// alike).
    Spread,
    /// Where the request may go excluded the cheapest region: the
    /// residency pin, or the model (a region whose engine does not list it
    /// while another does).
    Pin,
    /// The cheapest allowed region's context limit is below the request's
    /// estimated length (`context`).
    Context,
    /// No usable snapshot, or no healthy candidate: nearest region.
    Fallback,
    /// The stored response the request continues lives there (Responses
    /// API `previous_response_id`).
    Response,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Load => "load",
            Reason::Rtt => "rtt",
            Reason::LoadOverride => "load-override",
            Reason::Spread => "spread",
            Reason::Pin => "pin",
            Reason::Context => "context",
            Reason::Fallback => "fallback",
            Reason::Response => "response",
        }
    }
    /// The name in stats (`llm_geo_router.router.decision.<stat_name>`).
    pub fn stat_name(self) -> &'static str {
        match self {
            Reason::LoadOverride => "load_override",
            other => other.as_str(),
        }
    }
    pub const ALL: [Reason; 9] = [
        Reason::Cache,
        Reason::Load,
        Reason::Rtt,
        Reason::LoadOverride,
        Reason::Spread,
        Reason::Pin,
        Reason::Context,
        Reason::Fallback,
        Reason::Response,
    ];
}

/// The terms of one region's expected TTFT, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Cost {
    pub rtt_ms: f64,
    pub prefill_ms: f64,
    /// The queue term: the request's own expected wait for a slot
    /// (`wait_ms`), plus `load_ms`.
    pub queue_ms: f64,
    /// Of `queue_ms`, the externality: the delay this request adds to the
    /// requests that arrive at the region while it is there
    /// ([`externality_ms`]); 0 where a region holds the prompt.
    pub load_ms: f64,
    /// The expected wait itself (without the externality): what the tuner
    /// takes from observed TTFT.
    pub wait_ms: f64,
    /// The cache the prefill takes there, priced: the re-prefill it causes
    /// later to the prefixes the region then evicts sooner (`footprint`).
    pub footprint_ms: f64,
    pub total_ms: f64,
    /// The prompt's tokens as this region's engine counts them (estimated
    /// with its measured tokens per byte).
    pub prompt_tokens: u64,
    /// Of them, believed cached there: the directory's belief within the
    /// region's cache horizon, in its engine's whole blocks and short of
    /// the prompt's last token, as the engine would serve it.
    pub cached_tokens: u64,
    /// Requests at the engine counting this Envoy's since the scrape.
    pub occupancy: f64,
    /// Judged healthy by the probe (or not reported on).
    pub healthy: bool,
    /// Healthy, allowed by the residency pin, if any, and able to take the
    /// request (its context limit).
    pub candidate: bool,
    /// The request exceeds the region's context limit (`limits::fits`).
    pub over_context: bool,
    /// A candidate left out by the load guard (see `apply_load_guard`).
    pub over_bound: bool,
    /// Left out as a full holder whose wait exceeded what the move costs
    /// (not for its share).
    pub over_wait: bool,
}

/// The region that would have been chosen on cache and cost but was passed
/// over for its load, and the two costs compared: its expected wait for a
/// slot against what moving the request costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassedOver {
    pub region: usize,
    /// Its expected wait for a slot as compared (ms): the larger of `wait_ms`
    /// and its weighted wait (the queue term without the externality); 0
    /// while it has a slot free.
    pub wait_ms: f64,
    /// What the move costs (ms): the chosen region's round trip, prefill and
    /// wait minus the passed-over region's round trip and prefill.
    pub move_ms: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub region: usize,
    pub runner_up: Option<usize>,
    pub reason: Reason,
    /// Per configured region (same order as `Config::regions`).
    pub costs: Vec<Cost>,
    /// With `Load`, `LoadOverride` and `Spread`: the region passed over.
    pub passed_over: Option<PassedOver>,
}

/// Requests at a region's engine now, as this Envoy can tell: the engine's
/// counts at the scrape plus what this Envoy sent (or saw finish) since,
/// less the queued requests the engine has drained into freed slots since
/// the scrape at its measured rate (only the queue drains: a running
/// request stays until it ends, and a request that ends frees the slot
/// for one that waits). Never less than this Envoy's own in-flight
/// requests, which are all somewhere between here and the engine (a
/// request in transit at the scrape is in neither count). Without a
/// measured drain rate, the queue as scraped.
pub fn occupancy(state: &RegionState, inflight_now: f64, now_ms: u64) -> f64 {
    let drained = match (state.drain_rps, state.scraped_ms) {
        (Some(rate), Some(at)) if rate.is_finite() && rate > 0.0 => {
            rate * now_ms.saturating_sub(at) as f64 / 1000.0
        }
        _ => 0.0,
    };
    let waiting = (state.waiting - drained).max(0.0);
    // The other Envoys' requests since the scrape (exchange): what they
    // sent less what ended, as of their last messages. Not in the floor:
    // their counts are up to a message old.
    let peers = state.peer_inflight_delta;
    (waiting + state.running + inflight_now - state.inflight_at_scrape + peers).max(inflight_now)
}

/// Expected queueing wait for one more request at `occupancy` requests.
pub fn queue_ms(occupancy: f64, max_concurrency: u32, service_ms: f64) -> f64 {
    let slots = f64::from(max_concurrency.max(1));
    let ahead = (occupancy + 1.0 - slots).max(0.0);
    ahead / slots * service_ms
}

/// The delay one more request of `service_ms` adds to the requests that
/// arrive at a region while it is there: of the about `occupancy` arrivals
/// in one residence time (Little), those that find every slot taken
/// (occupancy taken as Poisson about its measured value) wait
/// `service_ms / slots` longer each.
pub fn externality_ms(occupancy: f64, slots: u32, service_ms: f64) -> f64 {
    // An occupancy no engine can have (a corrupt figure) stays finite.
    let n = if occupancy.is_nan() {
        0.0
    } else {
        occupancy.clamp(0.0, 1e12)
    };
    let c = slots.max(1);
    n * poisson_at_least(n, c - 1) * service_ms.max(0.0) / f64::from(c)
}

/// `P[N ≥ k]` for `N` Poisson with `mean`.
fn poisson_at_least(mean: f64, k: u32) -> f64 {
    if k == 0 {
        return 1.0;
    }
    if mean.is_nan() || mean <= 0.0 {
        return 0.0;
    }
    let kf = f64::from(k);
    if kf > mean && kf * (1.0 + (mean / kf).ln()) - mean < -50.0 {
        // Chernoff: P[N ≥ k] ≤ e^(−mean)·(e·mean/k)^k < 2e-22, nothing
        // against a cost in ms; most regions below their slots end here.
        return 0.0;
    }
    if mean > 600.0 || k > 2048 {
        // Normal approximation with continuity correction.
        let z = (kf - 0.5 - mean) / mean.sqrt();
        return 0.5 * erfc(z / std::f64::consts::SQRT_2);
    }
    let mut p = (-mean).exp();
    let mut below = p;
    for j in 1..k {
        p *= mean / f64::from(j);
        below += p;
    }
    if kf <= mean {
        return (1.0 - below).clamp(0.0, 1.0);
    }
    // Beyond the mean the tail is summed upwards (its terms fall at least
    // geometrically), not left as a difference of nearly equal numbers.
    p *= mean / f64::from(k);
    let mut tail = 0.0;
    let mut j = k;
    while p > tail * 1e-17 && j < k.saturating_add(2048) {
        tail += p;
        j += 1;
        p *= mean / f64::from(j);
    }
    tail.clamp(0.0, 1.0)
}

/// Complementary error function (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7).
fn erfc(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let e = poly * (-x * x).exp();
    if x >= 0.0 {
        e
    } else {
        2.0 - e
    }
}

pub(super) fn region_costs(inp: &Inputs, snap: &Snapshot) -> Vec<Cost> {
    let cfg = inp.config;
    let block_bytes = f64::from(cfg.prefix.block_bytes);
    cfg.regions
        .iter()
        .enumerate()
        .map(|(i, region)| {
            let state = snap.region_at(inp.snapshot_index, i);
            // A region the probe does not report on is assumed healthy with its
            // configured figures: the probe's configuration may lag the filters'.
            let healthy = state.is_none_or(|s| s.healthy);
            let rtt = state.and_then(|s| s.rtt_ms).unwrap_or(region.rtt_ms);
            let prefill_rate = state
                .and_then(|s| s.prefill_ms_per_token)
                .unwrap_or(region.prefill_ms_per_token);
            let prefill_fixed = state.and_then(|s| s.prefill_ms_per_request).unwrap_or(0.0);
            let inflight_now = inp.inflight.get(i).copied().unwrap_or(0.0);
            let slots = region_slots(inp, i);
            let occupancy = state.map_or(inflight_now, |s| {
                let known = occupancy(s, inflight_now, inp.now_ms);
                // A load nobody can read is no free slot: priced full (its
                // last known queue standing), so that it takes what regions
                // with room cannot, and a saturated engine behind a broken
                // scrape is never the idle nearest region.
                if s.load_unknown {
                    known.max(f64::from(slots))
                } else {
                    known
                }
            });
            // A region not yet measured counts in the fleet's unit, for its
            // prompt and its cache alike.
            let (tpb, prompt_tokens) = if state.is_some_and(|s| s.tokens_per_byte.is_some()) {
                let tpb = tokens_per_byte(state, inp.model);
                (tpb, tokens_of(inp.prompt_bytes, tpb))
            } else {
                (inp.tokens_per_byte, inp.prompt_tokens)
            };
            let cached_blocks = inp.cached_blocks.get(i).copied().unwrap_or(0);
            // The engine serves whole blocks of its own, never the last
            // token: what it would report as `cached_tokens`.
            let held = (f64::from(cached_blocks) * block_bytes * tpb).floor() as u64;
            let cached_tokens =
                servable_tokens(held, prompt_tokens, state.and_then(|s| s.block_tokens));
            let uncached = prompt_tokens - cached_tokens;
            let rtt_ms = rtt;
            let prefill_ms = prefill_fixed + prefill_rate * uncached as f64;
            let footprint_ms = state.map_or(0.0, |s| {
                let clock = inp.clocks.get(i).map_or(&[][..], Vec::as_slice);
                prefill_rate
                    * footprint_tokens(s, clock, &snap.reuse_gaps, uncached as f64, inp.now_ms)
            });
            let wait = queue_ms(occupancy, slots, region.service_ms);
            // The externality (`load_ms`) is added by `price_externality`
            // where it applies: not for a prompt some region holds.
            let queue = wait;
            Cost {
                rtt_ms,
                prefill_ms,
                queue_ms: queue,
                load_ms: 0.0,
                wait_ms: wait,
                footprint_ms,
                total_ms: rtt_ms + prefill_ms + queue + footprint_ms,
                prompt_tokens,
                cached_tokens,
                occupancy,
                healthy,
                candidate: healthy,
                over_context: i < 64 && inp.fits & (1 << i) == 0,
                over_bound: false,
                over_wait: false,
            }
        })
        .collect()
}

/// Adds to each region's cost the delay its request adds to the others
/// there (`externality_ms` of its occupancy, slots, and slot time: the
/// service time plus its prefill), as `load_ms`, inside `queue_ms`.
pub(super) fn price_externality(inp: &Inputs, costs: &mut [Cost]) {
    for (i, c) in costs.iter_mut().enumerate() {
        let service = inp.config.regions.get(i).map_or(0.0, |r| r.service_ms);
        let x = externality_ms(c.occupancy, region_slots(inp, i), service + c.prefill_ms);
        c.load_ms = x;
        c.queue_ms += x;
        c.total_ms = c.rtt_ms + c.prefill_ms + c.queue_ms + c.footprint_ms;
    }
}

/// What moving a request from `from` to `to` costs, before `from`'s wait:
/// `to`'s round trip, prefill and wait minus `from`'s round trip and prefill.
pub(super) fn move_ms(from: &Cost, to: &Cost) -> f64 {
    (to.rtt_ms + to.prefill_ms + to.wait_ms) - (from.rtt_ms + from.prefill_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::decision::choice::decide;
    use crate::decision::choice::tests::{cfg, inputs, run, snap};

    #[test]
    fn believed_cached_tokens_are_whole_engine_blocks_short_of_the_last_token() {
        use crate::decision::choice::tests::inputs;
        let c = cfg();
        let mut s = snap(&c);
        // mid's engine keeps its cache in blocks of 128 tokens (vLLM on
        // CPU), far's in SGLang's pages of 1; near's does not say.
        s.regions[1].block_tokens = Some(128);
        s.regions[2].block_tokens = Some(1);
        // Each holds 15 of the router's 64-byte blocks: 960 bytes, 300
        // tokens at 0.3125 tokens a byte, of a 1000-token prompt.
        let mut inp = inputs(&c, &s, &[15, 15, 15], None);
        inp.tokens_per_byte = 0.3125;
        inp.prompt_tokens = 1000;
        inp.prompt_bytes = 3200;
        let d = decide(&inp);
        let held: Vec<u64> = d.costs.iter().map(|k| k.cached_tokens).collect();
        assert_eq!(held, [300, 256, 300]);
        // The prefill is priced on what the engine will compute.
        assert_eq!(d.costs[1].prefill_ms, 0.5 * 744.0);
        // A 256-token prompt held whole: its last token is computed, so
        // one block of 128 is served from the cache, and 255 tokens of
        // pages of 1.
        let mut inp = inputs(&c, &s, &[16, 16, 16], None);
        inp.prompt_tokens = 256;
        inp.prompt_bytes = 1024;
        let held: Vec<u64> = decide(&inp).costs.iter().map(|k| k.cached_tokens).collect();
        assert_eq!(held, [256, 128, 255]);
        // Less than one block held is nothing held.
        let inp = inputs(&c, &s, &[4, 4, 4], None);
        let held: Vec<u64> = decide(&inp).costs.iter().map(|k| k.cached_tokens).collect();
        assert_eq!(held, [64, 0, 64]);
    }

    #[test]
    fn a_region_whose_load_is_unknown_is_priced_full_never_idle() {
        let c = cfg();
        let mut s = snap(&c);
        // near's scrapes have failed (another family's payload, a 501): its
        // figures are the last good scrape's, here none.
        s.regions[0].load_unknown = true;
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 1000);
        assert_eq!(d.costs[0].occupancy, 4.0, "every slot taken");
        // One request beyond 4 slots: a quarter of service_ms, and the
        // externality of 4 requests' arrivals.
        let k = d.costs[0];
        assert!((k.wait_ms - 1000.0 / 4.0).abs() < 1e-9, "{k:?}");
        assert!(
            (k.queue_ms - k.wait_ms - externality_ms(4.0, 4, 1000.0 + k.prefill_ms)).abs() < 1e-9
        );
        assert_eq!((d.region, d.reason), (1, Reason::Rtt), "{:?}", d.costs);
        // A queue known from before the failures stands above that.
        s.regions[0].waiting = 6.0;
        s.regions[0].running = 4.0;
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 1000);
        assert_eq!(d.costs[0].occupancy, 10.0);
        // A conversation it holds stays while the wait for a slot there
        // (250 ms) is below a full prefill elsewhere (500 ms).
        s.regions[0].waiting = 0.0;
        s.regions[0].running = 0.0;
        let d = run(&c, Some(&s), [62, 0, 0], [0.0; 3], 1000);
        assert_eq!((d.region, d.reason), (0, Reason::Cache));
        // Known load, idle: the nearest again.
        s.regions[0].load_unknown = false;
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 1000);
        assert_eq!((d.region, d.costs[0].occupancy), (0, 0.0));
    }

    #[test]
    fn the_terms_add_up_and_the_externality_is_its_own() {
        let c = cfg();
        let mut s = snap(&c);
        s.regions[1].waiting = 10.0;
        s.regions[1].running = 4.0;
        let sum = |k: &Cost| k.rtt_ms + k.prefill_ms + (k.queue_ms - k.load_ms) + k.load_ms;
        // A prompt no region holds: the queued region's queue term is its
        // weighted wait plus the externality, which is load_ms: of the 14
        // arrivals in one residence time all but a Poisson tail of
        // 1.5e-4 find its 4 slots taken and wait service / 4 longer, the
        // service being its slot time and this request's prefill.
        let d = run(&c, Some(&s), [0, 0, 0], [0.0; 3], 1000);
        let k = d.costs[1];
        let expect = 14.0 * (1000.0 + k.prefill_ms) / 4.0;
        assert!(
            k.load_ms < expect && k.load_ms > expect * 0.999,
            "{k:?} against {expect}"
        );
        assert!((k.queue_ms - k.load_ms - k.wait_ms).abs() < 1e-9, "{k:?}");
        for k in &d.costs {
            assert!((sum(k) - k.total_ms).abs() < 1e-9, "{k:?}");
        }
        // A prompt a region holds: the own wait decides, no externality.
        let d = run(&c, Some(&s), [0, 62, 0], [0.0; 3], 1000);
        assert!(d.costs.iter().all(|k| k.load_ms == 0.0), "{:?}", d.costs);
        assert!(d.costs.iter().all(|k| (sum(k) - k.total_ms).abs() < 1e-9));
    }

    #[test]
    fn the_externality_is_zero_idle_grows_with_load_and_stays_finite() {
        assert_eq!(externality_ms(0.0, 8, 1000.0), 0.0);
        assert_eq!(externality_ms(-3.0, 8, 1000.0), 0.0);
        assert_eq!(externality_ms(5.0, 8, 0.0), 0.0);
        // One slot: every arrival while it is there waits its whole service.
        assert!((externality_ms(2.0, 1, 1000.0) - 2000.0).abs() < 1e-9);
        // Rises with the load, from almost nothing well below the slots to
        // about one slot time per slot per arrival well beyond them.
        let mut last = 0.0;
        for n in 1..400 {
            let x = externality_ms(f64::from(n) / 4.0, 32, 1000.0);
            assert!(x >= last, "{n}: {x} < {last}");
            last = x;
        }
        assert!(externality_ms(4.0, 32, 1000.0) < 1e-6);
        assert!((externality_ms(100.0, 32, 1000.0) - 100.0 * 1000.0 / 32.0).abs() < 1.0);
        // The approximation for large loads and slot counts joins on.
        let below = externality_ms(599.999, 600, 1000.0);
        let above = externality_ms(600.001, 600, 1000.0);
        assert!((below - above).abs() / below < 0.01, "{below} {above}");
        for (n, c) in [
            (1e9, 4096),
            (5000.0, 4096),
            (5000.0, 8),
            (f64::NAN, 8),
            (f64::INFINITY, 8),
        ] {
            let x = externality_ms(n, c, 1000.0);
            assert!(x.is_finite() && x >= 0.0, "{n} {c}: {x}");
        }
    }

    #[test]
    fn own_inflight_since_scrape_counts() {
        // The accounting, not the placement bound, is under test here.
        let mut c = cfg();
        c.cost.placement_floor = 0.5;
        let s = snap(&c);
        // 8 requests sent to `near` since the last scrape: it is full.
        let d = run(&c, Some(&s), [0, 0, 0], [8.0, 0.0, 0.0], 100);
        assert_eq!(d.region, 1);
        // Already counted by the engine at the scrape: not counted twice.
        let mut s2 = snap(&c);
        s2.regions[0].running = 1.0;
        s2.regions[0].inflight_at_scrape = 1.0;
        let d = run(&c, Some(&s2), [0, 0, 0], [1.0, 0.0, 0.0], 100);
        assert_eq!(d.region, 0);
        assert_eq!(d.costs[0].wait_ms, 0.0);
    }

    #[test]
    fn the_queue_drains_at_the_measured_rate_since_the_scrape() {
        let scraped = RegionState {
            waiting: 6.0,
            running: 8.0,
            inflight_at_scrape: 2.0,
            scraped_ms: Some(10_000),
            ..RegionState::default()
        };
        // No drain measured: the scrape as it was, plus what this Envoy
        // sent since (3 in flight now, 2 then), at any age.
        assert_eq!(occupancy(&scraped, 3.0, 10_000), 15.0);
        assert_eq!(occupancy(&scraped, 3.0, 12_000), 15.0);
        let draining = RegionState {
            drain_rps: Some(8.0),
            ..scraped.clone()
        };
        assert_eq!(occupancy(&draining, 3.0, 10_000), 15.0);
        // 250 ms at 8 rps: 2 of the 6 waiting are in slots; the running
        // ones stay.
        assert_eq!(occupancy(&draining, 3.0, 10_250), 13.0);
        // The queue empties, and no further: running 8 plus the one sent.
        assert_eq!(occupancy(&draining, 3.0, 11_000), 9.0);
        assert_eq!(occupancy(&draining, 3.0, 60_000), 9.0);
        // Never below this Envoy's own in flight.
        let idle = RegionState {
            waiting: 1.0,
            running: 0.0,
            inflight_at_scrape: 5.0,
            ..draining.clone()
        };
        assert_eq!(occupancy(&idle, 4.0, 20_000), 4.0);
        // A clock behind the scrape, no time of scrape, a broken rate:
        // nothing drained.
        assert_eq!(occupancy(&draining, 3.0, 9_000), 15.0);
        for r in [
            RegionState {
                scraped_ms: None,
                ..draining.clone()
            },
            RegionState {
                drain_rps: Some(f64::NAN),
                ..draining.clone()
            },
            RegionState {
                drain_rps: Some(-3.0),
                ..draining.clone()
            },
        ] {
            assert_eq!(occupancy(&r, 3.0, 11_000), 15.0);
        }
    }

    #[test]
    fn the_cost_prices_the_drained_queue() {
        // near's scrape showed it full (4 slots) with 4 waiting; it
        // drains 8 rps.
        let c = cfg();
        let mut s = snap(&c);
        s.regions[0].running = 3.0;
        s.regions[0].waiting = 4.0;
        s.regions[0].scraped_ms = Some(5_000);
        let near = |s: &Snapshot, now_ms: u64| {
            let d = decide(&Inputs {
                now_ms,
                ..inputs(&c, s, &[0, 0, 0], None)
            });
            let n = d.costs[0];
            (n.occupancy, n.wait_ms > 0.0)
        };
        assert_eq!(near(&s, 5_600), (7.0, true), "no drain measured");
        s.regions[0].drain_rps = Some(8.0);
        let (occupancy, waits) = near(&s, 5_100);
        assert!(
            (occupancy - 6.2).abs() < 1e-9 && waits,
            "100 ms: not yet drained"
        );
        assert_eq!(
            near(&s, 5_600),
            (3.0, false),
            "600 ms: queue gone, a slot free"
        );
    }

    /// Region 1's terms and the decision, with mid's terms the only thing
    /// that differs between `points`; asserts the other regions' costs do
    /// not move.
    fn sweep(c: &Config, points: &[(Snapshot, [u32; 3])]) -> Vec<(Cost, usize)> {
        let base = run(c, Some(&points[0].0), points[0].1, [0.0; 3], 1000);
        points
            .iter()
            .map(|(s, cached)| {
                let d = run(c, Some(s), *cached, [0.0; 3], 1000);
                assert_eq!(d.costs[0], base.costs[0]);
                assert_eq!(d.costs[2], base.costs[2]);
                (d.costs[1], d.region)
            })
            .collect()
    }

    /// Once the decision has left mid (1) for near (0) it does not come
    /// back; and it does leave, at the point the arithmetic says.
    fn leaves_mid_for_near_at(regions: &[usize], at: usize) {
        let want: Vec<usize> = (0..regions.len())
            .map(|i| if i < at { 1 } else { 0 })
            .collect();
        assert_eq!(regions, want);
    }

    #[test]
    fn monotone_in_rtt_queue_and_cache() {
        // mid holds 992 of the 1000 tokens: 40 + 4 ms against near's
        // 5 + 500 ms. Each sweep moves one of mid's terms, and only it.
        let c = cfg();
        let held = [0, 62, 0];

        // RTT: mid's round trip term is the measured RTT; it
        // loses its 461 ms lead between 400 and 470 ms more.
        let extras = [0.0, 10.0, 100.0, 400.0, 470.0, 1000.0];
        let points: Vec<_> = extras
            .iter()
            .map(|e| {
                let mut s = snap(&c);
                s.regions[1].rtt_ms = Some(40.0 + e);
                (s, held)
            })
            .collect();
        let got = sweep(&c, &points);
        for ((cost, _), e) in got.iter().zip(extras) {
            assert_eq!(cost.rtt_ms, 40.0 + e);
            assert_eq!((cost.prefill_ms, cost.queue_ms), (4.0, 0.0));
        }
        leaves_mid_for_near_at(&got.iter().map(|g| g.1).collect::<Vec<_>>(), 4);

        // Queue: running + waiting at mid's 4 slots. No term while a slot
        // is free; then a quarter of the 1000 ms slot time per request
        // ahead. Its 250 ms wait with one ahead is below the 461 ms lead,
        // 500 ms with two is above.
        let loads = [(0.0, 0.0), (3.0, 0.0), (4.0, 0.0), (4.0, 1.0), (4.0, 4.0)];
        let points: Vec<_> = loads
            .iter()
            .map(|&(running, waiting)| {
                let mut s = snap(&c);
                s.regions[1].running = running;
                s.regions[1].waiting = waiting;
                (s, held)
            })
            .collect();
        let got = sweep(&c, &points);
        let waits: Vec<f64> = got.iter().map(|g| g.0.wait_ms).collect();
        assert_eq!(waits, [0.0, 0.0, 250.0, 500.0, 1250.0]);
        for (cost, _) in &got {
            assert_eq!((cost.rtt_ms, cost.prefill_ms), (40.0, 4.0));
            assert!(cost.queue_ms >= cost.wait_ms, "{cost:?}");
        }
        assert!(got.windows(2).all(|w| w[1].0.queue_ms >= w[0].0.queue_ms));
        assert!(got
            .windows(2)
            .skip(1)
            .all(|w| w[1].0.queue_ms > w[0].0.queue_ms));
        leaves_mid_for_near_at(&got.iter().map(|g| g.1).collect::<Vec<_>>(), 3);

        // Cache: each cached block (16 tokens) takes 8 ms of prefill off
        // mid; from 8 blocks (476 ms) it beats near's 505.
        let blocks = [62, 31, 16, 8, 2, 0];
        let points: Vec<_> = blocks.iter().map(|&b| (snap(&c), [0, b, 0])).collect();
        let got = sweep(&c, &points);
        for ((cost, _), b) in got.iter().zip(blocks) {
            assert_eq!(cost.cached_tokens, 16 * u64::from(b));
            assert_eq!(cost.prefill_ms, 0.5 * (1000.0 - 16.0 * f64::from(b)));
            assert_eq!((cost.rtt_ms, cost.queue_ms), (40.0, 0.0));
        }
        leaves_mid_for_near_at(&got.iter().map(|g| g.1).collect::<Vec<_>>(), 4);

        assert!(queue_ms(10.0, 4, 100.0) > queue_ms(5.0, 4, 100.0));
        assert_eq!(queue_ms(2.0, 4, 100.0), 0.0);
    }
}
