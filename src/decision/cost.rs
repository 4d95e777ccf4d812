//! The routing decision: one expected time-to-first-token per region, in
//! milliseconds, and the region that minimises it.
//!
//! `ttft(r) = rtt(r) + prefill_ms_per_token(r)·uncached_tokens(r) + w_queue·queue_ms(r) + x(r)`
//!
//! * `rtt(r)`: the least of the probe's recent health round trips, else the
//!   configured `rtt_ms`.
//! * `uncached_tokens(r)`: prompt tokens beyond the prefix the directory
//!   believes `r` holds.
//! * `queue_ms(r)`: requests ahead of this one beyond the engine's
//!   concurrency, times the mean slot time per slot. Occupancy is the
//!   engine's waiting + running at the last scrape plus what this Envoy has
//!   sent (or finished) since: the in-flight gauge now minus its value at the
//!   scrape. A burst between two probe ticks therefore sees its own load.
//! * `x(r)`: the externality, the delay this request adds to the requests
//!   that arrive at `r` while it is there ([`externality_ms`]); left out
//!   where a region holds the prompt.
//!
//! Unhealthy regions are not candidates, nor are regions whose context
//! limit the request exceeds (`request::limits`). Regions of exactly the least cost
//! are a tie, broken by rendezvous hashing of the prompt's first block so
//! that independent proxies agree on where a new conversation goes.

use crate::config::Config;
use crate::fleet::snapshot::{RegionState, Snapshot};
use xxhash_rust::xxh3::xxh3_64_with_seed;

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
    /// The queue term: the request's own expected wait for a slot, weighted
    /// (`w_queue × wait_ms`), plus `load_ms`.
    pub queue_ms: f64,
    /// Of `queue_ms`, the externality: the delay this request adds to the
    /// requests that arrive at the region while it is there
    /// ([`externality_ms`]); 0 where a region holds the prompt.
    pub load_ms: f64,
    /// The expected wait itself (unweighted, without the externality):
    /// what the tuner compares with observed TTFT.
    pub wait_ms: f64,
    pub total_ms: f64,
    /// The prompt's tokens as this region's engine counts them (estimated
    /// with its measured tokens per byte).
    pub prompt_tokens: u64,
    /// Of them, believed cached there (the directory's belief within the
    /// region's cache horizon).
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
    /// The prompt's tokens, estimated fleet-wide (see [`tokens_per_byte`]).
    pub prompt_tokens: u64,
    /// Bytes of canonical prompt text (each region's estimate is made
    /// from them with its own tokens per byte).
    pub prompt_bytes: u64,
    /// Fleet-wide tokens per byte (`prompt_tokens` was made with it): for
    /// the regions not yet measured.
    pub tokens_per_byte: f64,
    /// The request's `model`, for per-model tokens per byte.
    pub model: Option<&'a str>,
    /// Rendezvous key for ties (the first block's hash, else the session's).
    pub first_block: Option<u64>,
    /// Residency pin: per configured region, whether it is allowed.
    pub allowed: Option<&'a [bool]>,
    /// Per configured region (bit i): whether the request fits its context
    /// limit (`limits::check`); `u64::MAX` when none is known.
    pub fits: u64,
    /// Cost weights in force (configured, or tuned by the probe).
    pub weights: Weights,
    /// Now (ms since the Unix epoch): how long the engines have drained
    /// since their scrape.
    pub now_ms: u64,
}

/// The tunable weights of the cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    pub w_queue: f64,
}

impl Weights {
    /// Before the probe has fitted anything: the queue weight's start.
    pub fn configured(cfg: &Config) -> Self {
        Weights {
            w_queue: cfg.tuning.w_queue_start(),
        }
    }

    /// The weights the snapshot carries (tuned by the probe), else the
    /// configured ones.
    pub fn in_force(cfg: &Config, snapshot: Option<&Snapshot>) -> Self {
        snapshot.and_then(|s| s.weights).map_or_else(
            || Weights::configured(cfg),
            |w| Weights { w_queue: w.w_queue },
        )
    }
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

/// Slots region `i` runs at once: its `max_concurrency` times the
/// replicas the snapshot reports behind its entry point (one if none).
pub fn region_slots(inp: &Inputs, i: usize) -> u32 {
    let per = inp.config.regions.get(i).map_or(1, |r| r.max_concurrency);
    match inp
        .snapshot
        .and_then(|s| s.region_at(inp.snapshot_index, i))
    {
        Some(state) => state.slots(per),
        None => per.max(1),
    }
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

/// Whether the residency pin allows region `i` (no pin: every region).
fn allowed(inp: &Inputs, i: usize) -> bool {
    inp.allowed
        .is_none_or(|a| a.get(i).copied().unwrap_or(false))
}

/// The two costs compared when `region` is chosen over `from`.
fn passed_over(costs: &[Cost], from: usize, region: usize) -> Option<PassedOver> {
    let f = costs.get(from)?;
    let c = costs.get(region)?;
    Some(PassedOver {
        region: from,
        wait_ms: f.wait_ms.max(f.queue_ms - f.load_ms),
        move_ms: move_ms(f, c),
    })
}

/// What moving a request from `from` to `to` costs, before `from`'s wait:
/// `to`'s round trip, prefill and wait minus `from`'s round trip and prefill.
fn move_ms(from: &Cost, to: &Cost) -> f64 {
    (to.rtt_ms + to.prefill_ms + to.wait_ms) - (from.rtt_ms + from.prefill_ms)
}

fn state_healthy(inp: &Inputs, snap: &Snapshot, i: usize) -> bool {
    snap.region_at(inp.snapshot_index, i)
        .is_none_or(|s| s.healthy)
}

/// Engine tokens per byte of canonical prompt text for a region: measured
/// for `model`, else measured for the region, else the configured
/// [`PRIOR_TOKENS_PER_BYTE`]. Values outside any tokenizer's range are
/// not believed.
pub fn tokens_per_byte(state: Option<&RegionState>, model: Option<&str>) -> f64 {
    let sane = |v: &f64| v.is_finite() && (0.01..=4.0).contains(v);
    state
        .and_then(|s| {
            model
                .and_then(|m| {
                    s.model_tokens_per_byte
                        .iter()
                        .find(|(n, _)| n == m)
                        .map(|(_, v)| *v)
                        .filter(sane)
                })
                .or(s.tokens_per_byte.filter(sane))
        })
        .unwrap_or(PRIOR_TOKENS_PER_BYTE)
}

/// Engine tokens per byte of prompt text until an engine's `usage` says:
/// 4 bytes per token, about what the BPE tokenizers of today's models
/// give for English text. The first answer's `usage.prompt_tokens`
/// replaces it, per region and per model, so it is a starting point, not
/// a setting (docs/ROUTING.md, "What the engines report").
pub const PRIOR_TOKENS_PER_BYTE: f64 = 0.25;

/// Engine tokens per byte for the fleet-wide prompt estimate: the mean of
/// the regions' measured figures (for `model`, where measured), else
/// [`PRIOR_TOKENS_PER_BYTE`].
pub fn fleet_tokens_per_byte(snapshot: Option<&Snapshot>, model: Option<&str>) -> f64 {
    let (mut sum, mut n) = (0.0, 0u32);
    for r in snapshot
        .into_iter()
        .flat_map(|s| s.regions.iter())
        .filter(|r| r.tokens_per_byte.is_some())
    {
        sum += tokens_per_byte(Some(r), model);
        n += 1;
    }
    if n == 0 {
        PRIOR_TOKENS_PER_BYTE
    } else {
        sum / f64::from(n)
    }
}

/// Tokens in `bytes` at `tpb` tokens per byte.
pub fn tokens_of(bytes: u64, tpb: f64) -> u64 {
    (bytes as f64 * tpb).ceil() as u64
}

fn region_costs(inp: &Inputs, snap: &Snapshot) -> Vec<Cost> {
    let cfg = inp.config;
    let block_bytes = f64::from(cfg.prefix.block_bytes);
    let w = inp.weights;
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
            let cached_tokens =
                ((f64::from(cached_blocks) * block_bytes * tpb).floor() as u64).min(prompt_tokens);
            let uncached = prompt_tokens - cached_tokens;
            let rtt_ms = rtt;
            let prefill_ms = prefill_rate * uncached as f64;
            let wait = queue_ms(occupancy, slots, region.service_ms);
            // The externality (`load_ms`) is added by `price_externality`
            // where it applies: not for a prompt some region holds.
            let queue = w.w_queue * wait;
            Cost {
                rtt_ms,
                prefill_ms,
                queue_ms: queue,
                load_ms: 0.0,
                wait_ms: wait,
                total_ms: rtt_ms + prefill_ms + queue,
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
fn price_externality(inp: &Inputs, costs: &mut [Cost]) {
    for (i, c) in costs.iter_mut().enumerate() {
        let service = inp.config.regions.get(i).map_or(0.0, |r| r.service_ms);
        let x = externality_ms(c.occupancy, region_slots(inp, i), service + c.prefill_ms);
        c.load_ms = x;
        c.queue_ms += x;
        c.total_ms = c.rtt_ms + c.prefill_ms + c.queue_ms;
    }
}

/// Whether some candidate holds the prompt: at least half of it beyond what
/// every other candidate holds (a system prompt held everywhere does not
/// make a holder).
fn holds_prompt(costs: &[Cost], prompt_tokens: u64) -> bool {
    let cached = || {
        costs
            .iter()
            .filter(|c| c.candidate)
            .map(|c| c.cached_tokens)
    };
    let most = cached().max().unwrap_or(0);
    let least = cached().min().unwrap_or(0);
    most > 0 && (most - least).saturating_mul(2) >= prompt_tokens
}

/// The load guard: marks the candidates the request must not go to although
/// they may be the cheapest. Nothing is marked unless some other candidate
/// has a free slot and is within its share bound (moving to a full region
/// would only move the queue); call those "room".
///
/// * A prompt some candidate holds (`held`: at least half of it beyond what
///   every other candidate holds), at a candidate holding more of it than
///   every room region (moving forces a cache miss): marked only when the
///   move pays. It has no free slot, and its expected wait for one (the
///   larger of `wait_ms` and the tuned queue term) exceeds what the move
///   costs (`move_ms`: the prefill of the tokens not held there, plus the
///   round trip and wait difference). While the holder has a free slot, its
///   wait is 0 and the prompt stays.
/// * A prompt no region holds (a new conversation, whose later turns will
///   follow it, or one held everywhere alike), the placement bound: marked
///   when, with this request, its occupancy would exceed `(1 + ε)` times
///   its fair share (by `max_concurrency`) of all candidates' occupancy and
///   `floor × max_concurrency` (`placement_epsilon` / `_floor`).
/// * A held prompt that a room region holds as much of is not marked: it
///   goes by its cost. A share bound for it paid nothing (A/B in
///   docs/ROUTING.md, "What each rule is worth").
fn apply_load_guard(inp: &Inputs, costs: &mut [Cost], held: bool) {
    let cfg = inp.config;
    let slots = |i: usize| f64::from(region_slots(inp, i));
    let total_slots: f64 = costs
        .iter()
        .enumerate()
        .filter(|(_, c)| c.candidate)
        .map(|(i, _)| slots(i))
        .sum();
    let total_load: f64 = costs
        .iter()
        .filter(|c| c.candidate)
        .map(|c| c.occupancy)
        .sum::<f64>()
        + 1.0;
    if total_slots <= 0.0 {
        return;
    }
    let (e, f) = (cfg.cost.placement_epsilon, cfg.cost.placement_floor);
    let over_share: Vec<bool> = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fair = total_load * slots(i) / total_slots;
            let bound = ((1.0 + e) * fair).max(f * slots(i));
            !held && c.candidate && c.occupancy + 1.0 > bound
        })
        .collect();
    let room: Vec<usize> = costs
        .iter()
        .enumerate()
        .filter(|&(i, c)| {
            c.candidate
                && !over_share.get(i).copied().unwrap_or(true)
                && c.occupancy + 1.0 <= slots(i)
        })
        .map(|(i, _)| i)
        .collect();
    if room.is_empty() {
        return;
    }
    let marks: Vec<(bool, bool)> = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let others = || {
                room.iter()
                    .filter(move |&&j| j != i)
                    .filter_map(|&j| costs.get(j))
            };
            if !c.candidate || others().next().is_none() {
                return (false, false);
            }
            if held && !others().any(|o| o.cached_tokens >= c.cached_tokens) {
                let cheapest_move = others()
                    .map(|o| move_ms(c, o))
                    .fold(f64::INFINITY, f64::min);
                let wait = c.wait_ms.max(c.queue_ms);
                (c.wait_ms > 0.0 && wait > cheapest_move, true)
            } else {
                (over_share.get(i).copied().unwrap_or(false), false)
            }
        })
        .collect();
    for (c, (over, by_wait)) in costs.iter_mut().zip(marks) {
        c.over_bound = over;
        c.over_wait = over && by_wait;
    }
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
mod tests {
    use super::*;

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
        Snapshot::all_healthy(c)
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
            prompt_bytes: tokens * 4,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(42),
            allowed: None,
            fits: u64::MAX,
            weights: Weights::configured(c),
            now_ms: 0,
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
            inflight: &[0.0; 3],
            prompt_tokens: 10,
            prompt_bytes: 40,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(key),
            allowed: None,
            fits: u64::MAX,
            weights: Weights::configured(c),
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

    fn inputs<'a>(
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
            inflight: &[0.0; 3],
            prompt_tokens: 1000,
            prompt_bytes: 4000,
            tokens_per_byte: 0.25,
            model: None,
            first_block: Some(7),
            allowed,
            fits: u64::MAX,
            weights: Weights::configured(c),
            now_ms: 0,
        }
    }

    fn eight_slots() -> Config {
        let mut c = cfg();
        for r in &mut c.regions {
            r.max_concurrency = 8;
        }
        c
    }

    #[test]
    fn replicas_behind_an_entry_point_multiply_its_slots() {
        let c = eight_slots();
        let mut s = snap(&c);
        // 20 requests at mid: with one engine of 8 slots, 12 wait; with the
        // 3 replicas the Prometheus source reports, none does.
        s.regions[1].running = 20.0;
        let one = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert!(one.costs[1].wait_ms > 0.0);
        s.regions[1].replicas = Some(3);
        let three = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert_eq!(three.costs[1].wait_ms, 0.0);
        assert_eq!((three.region, three.reason), (1, Reason::Cache));
    }

    #[test]
    fn a_holder_with_a_free_slot_keeps_its_prompt_whatever_its_share() {
        let c = eight_slots();
        let mut s = snap(&c);
        // mid holds the prompt and runs 7 of 10 in-flight requests: far over
        // any share, but it has a free slot, so nothing is waiting there and
        // moving would only add a 1000-token prefill.
        s.regions[0].running = 2.0;
        s.regions[1].running = 7.0;
        s.regions[2].running = 1.0;
        let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        assert_eq!(d.passed_over, None);
        // Whatever the others' load and the weights, while the holder has a
        // free slot the guard never passes it over.
        for w_queue in [0.0, 0.2, 1.0, 3.0] {
            for holder in 0..8 {
                for other in 0..12 {
                    let mut s = snap(&c);
                    s.regions[1].running = f64::from(holder);
                    s.regions[0].running = f64::from(other);
                    s.regions[2].running = f64::from(other / 2);
                    let mut inp = inputs(&c, &s, &[0, 62, 0], None);
                    inp.weights.w_queue = w_queue;
                    let d = decide(&inp);
                    assert!(!d.costs[1].over_bound, "{holder} {other} {w_queue}");
                    assert_ne!(d.reason, Reason::LoadOverride, "{holder} {other} {w_queue}");
                }
            }
        }
    }

    #[test]
    fn a_full_holder_is_passed_over_only_when_its_wait_exceeds_the_move() {
        let c = eight_slots();
        // Moving the 1000-token prompt from mid (holds 992 tokens) to near
        // costs 0.5 ms x 992 tokens of prefill minus 35 ms of round trip:
        // 461 ms. mid's wait at occupancy n is (n + 1 - 8) / 8 x 1000 ms.
        let at = |n: f64, w_queue: f64| {
            let mut s = snap(&c);
            s.regions[1].running = 8.0;
            s.regions[1].waiting = n - 8.0;
            let mut inp = inputs(&c, &s, &[0, 62, 0], None);
            inp.weights.w_queue = w_queue;
            decide(&inp)
        };
        // Full, 125 ms of wait: cheaper than the move; it stays.
        let d = at(8.0, 1.0);
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        assert_eq!(d.costs[1].wait_ms, 125.0);
        // 625 ms of wait: the cost itself moves it (w_queue 1).
        let d = at(12.0, 1.0);
        assert_eq!((d.region, d.reason), (0, Reason::Load));
        let p = d.passed_over.unwrap();
        assert_eq!((p.region, p.wait_ms, p.move_ms), (1, 625.0, 461.0));
        // With the queue's weight tuned down to 0.2 the cost would stay (125
        // weighted ms); the guard compares the wait itself and moves it.
        let d = at(12.0, 0.2);
        assert_eq!((d.region, d.reason), (0, Reason::LoadOverride));
        assert!(d.costs[1].over_bound);
        let p = d.passed_over.unwrap();
        assert_eq!((p.region, p.wait_ms, p.move_ms), (1, 625.0, 461.0));
        // ... but not while the wait is below the move's cost.
        let d = at(10.0, 0.2);
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        // Nowhere with a free slot: staying in the queue beats moving it.
        let mut s = snap(&c);
        for r in &mut s.regions {
            r.running = 8.0;
            r.waiting = 8.0;
        }
        let mut inp = inputs(&c, &s, &[0, 62, 0], None);
        inp.weights.w_queue = 0.2;
        assert_eq!(decide(&inp).reason, Reason::Cache);
    }

    #[test]
    fn new_prompts_are_placed_within_the_tighter_placement_bound() {
        let c = eight_slots();
        let mut s = snap(&c);
        // near runs 2 of 2 in-flight requests: fair share (2+1)/3 = 1; the
        // placement bound 1.1 x 1 < 3: a prompt no region holds goes
        // elsewhere (no cache miss is forced: a spread).
        s.regions[0].running = 2.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!(d.reason, Reason::Spread);
        assert_ne!(d.region, 0);
        assert!(d.costs[0].over_bound);
        assert_eq!(d.passed_over.map(|p| (p.region, p.wait_ms)), Some((0, 0.0)));
        // near holds a shared prefix of it, less than half (320 of 1000
        // tokens): it does not hold the prompt, which is placed as new.
        let d = decide(&inputs(&c, &s, &[20, 0, 0], None));
        assert_eq!(d.reason, Reason::Spread);
        // A prompt near holds stays: it has free slots.
        let d = decide(&inputs(&c, &s, &[62, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Cache));
        // A prompt held everywhere alike is placed like a new one: moving it
        // forces no miss either.
        let d = decide(&inputs(&c, &s, &[62, 62, 62], None));
        assert_eq!(d.reason, Reason::Spread);
        // Held by near and mid, not far: no share bound, whatever near's
        // share; near (5 of 8 slots, a free one) is the cheaper holder.
        s.regions[0].running = 5.0;
        let d = decide(&inputs(&c, &s, &[62, 62, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Cache));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        // With a looser placement bound (1.5 x the share, floor a half),
        // near keeps the new prompt at 2.
        let mut c = eight_slots();
        c.cost.placement_epsilon = 0.5;
        c.cost.placement_floor = 0.5;
        s.regions[0].running = 2.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
    }

    #[test]
    fn the_load_guard_never_leaves_no_candidate_and_respects_the_floor() {
        let c = cfg();
        let mut s = snap(&c);
        for r in &mut s.regions {
            r.running = 4.0;
            r.waiting = 20.0;
        }
        let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        // Low load: a new prompt with one request in flight at near is below
        // the placement floor when it is as high as the general one (2 of 4
        // slots); at the default (a quarter: 1 of these 4 slots) it is not.
        let mut s = snap(&c);
        s.regions[0].running = 1.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (1, Reason::Spread));
        let mut c2 = cfg();
        c2.cost.placement_floor = 0.5;
        let d = decide(&inputs(&c2, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
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
