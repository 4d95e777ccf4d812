//! Session migration: when a region takes over a session whose KV prefix is
//! cached elsewhere, whether to fetch that prefix over the WAN or recompute it
//! locally. Owns the seed's fetch-versus-recompute model
//! (`wan_kv_crossover.py`), its M/M/1 queueing extension
//! (`wan_routing_score.py`), the two crossovers they define, and `decide`.
//!
//! This is a once-per-session migration choice, not per-request routing:
//! redirecting a request to the region that holds the cache moves no KV bytes
//! and stays the default (`cost.rs`).
//!
//! Units: seconds in the `_s` functions, milliseconds in `MigrationPlan`,
//! `tflops` in TFLOP/s (989 means 989e12 FLOP/s), bandwidth in Gbit/s.
//! Nothing here panics or asserts: an undefined quantity is `None`.

use serde::Deserialize;

/// Bisection steps for `crossover_utilization`; the seed's count, so the
/// result matches it bit for bit.
const BISECTION_STEPS: usize = 80;
/// Upper end of the utilisation bisection; the seed's, just below saturation
/// where the M/M/1 wait is still finite.
const BISECTION_HI: f64 = 0.999_999;

/// Bytes of KV cache one token occupies: K and V, for every layer, KV head
/// and head dimension. `kv_bytes` is fractional for sub-byte caches (0.5 for
/// a 4-bit cache).
pub fn bytes_per_kv_token(layers: u32, kv_heads: u32, head_dim: u32, kv_bytes: f64) -> f64 {
    2.0 * f64::from(layers) * f64::from(kv_heads) * f64::from(head_dim) * kv_bytes
}

/// Seconds of prefill compute per token: a forward pass costs about
/// 2·params FLOPs per token (Kaplan et al. 2020) and prefill is compute-bound.
pub fn recompute_s_per_token(params: f64, tflops_tera: f64, mfu: f64) -> f64 {
    2.0 * params / (tflops_tera * 1e12 * mfu)
}

/// Seconds to move one token's KV over a link of `bandwidth_gbps`.
pub fn transfer_s_per_token(bytes_per_token: f64, bandwidth_gbps: f64) -> f64 {
    bytes_per_token * 8.0 / (bandwidth_gbps * 1e9)
}

/// Seconds to fetch a cached prefix: one round trip plus the payload.
pub fn fetch_s(prefix_tokens: u64, bytes_per_token: f64, bandwidth_gbps: f64, rtt_ms: f64) -> f64 {
    rtt_ms / 1000.0 + prefix_tokens as f64 * transfer_s_per_token(bytes_per_token, bandwidth_gbps)
}

/// Seconds to recompute a prefix locally.
pub fn recompute_s(prefix_tokens: u64, params: f64, tflops_tera: f64, mfu: f64) -> f64 {
    prefix_tokens as f64 * recompute_s_per_token(params, tflops_tera, mfu)
}

/// Prefix length, in tokens, above which fetching beats recomputing: the
/// fetch's round trip amortised over the per-token saving. `None` when
/// recomputing a token costs no more than transferring it (fetch never wins)
/// or the inputs leave the crossover undefined.
pub fn crossover_tokens(
    bytes_per_token: f64,
    bandwidth_gbps: f64,
    rtt_ms: f64,
    params: f64,
    tflops_tera: f64,
    mfu: f64,
) -> Option<f64> {
    let saving_per_token = recompute_s_per_token(params, tflops_tera, mfu)
        - transfer_s_per_token(bytes_per_token, bandwidth_gbps);
    if saving_per_token.is_nan() || saving_per_token <= 0.0 {
        return None;
    }
    let tokens = (rtt_ms / 1000.0) / saving_per_token;
    tokens.is_finite().then_some(tokens)
}

/// Expected time in queue (excluding own service) of an M/M/1 queue:
/// `ρ / (μ·(1 − ρ))`. `None` when the queue has no steady state
/// (`ρ ∉ [0, 1)`) or the inputs are not finite or `μ ≤ 0`.
pub fn mm1_wait_s(utilization: f64, service_rate_per_s: f64) -> Option<f64> {
    if !(0.0..1.0).contains(&utilization)
        || !service_rate_per_s.is_finite()
        || service_rate_per_s <= 0.0
    {
        return None;
    }
    if utilization == 0.0 {
        return Some(0.0);
    }
    Some(utilization / (service_rate_per_s * (1.0 - utilization)))
}

/// Utilisation of the fetch path above which recomputing on the destination's
/// own compute queue (at `compute_util`) wins despite fetching being cheaper
/// over an idle link. Both queues drain at `service_rate_per_s`, as in the
/// seed. `None` when recomputing wins even over an idle fetch path, or when
/// either wait is undefined (a saturated compute queue never beats a fetch).
///
/// Bisection over `[0, 0.999999]` exactly as the seed does it, so a target
/// beyond the wait at the upper end returns that upper end.
#[allow(clippy::too_many_arguments)] // The seed's signature, kept for line-by-line review.
pub fn crossover_utilization(
    bytes_per_token: f64,
    bandwidth_gbps: f64,
    rtt_ms: f64,
    params: f64,
    tflops_tera: f64,
    mfu: f64,
    prefix_tokens: u64,
    compute_util: f64,
    service_rate_per_s: f64,
) -> Option<f64> {
    let fetch = fetch_s(prefix_tokens, bytes_per_token, bandwidth_gbps, rtt_ms);
    let recompute = recompute_s(prefix_tokens, params, tflops_tera, mfu);
    let compute_wait = mm1_wait_s(compute_util, service_rate_per_s)?;
    // The fetch-path wait that makes both options cost the same.
    let target = recompute + compute_wait - fetch;
    if target.is_nan() || target <= 0.0 {
        return None;
    }
    let (mut lo, mut hi) = (0.0_f64, BISECTION_HI);
    for _ in 0..BISECTION_STEPS {
        let mid = 0.5 * (lo + hi);
        match mm1_wait_s(mid, service_rate_per_s) {
            Some(wait) if wait >= target => hi = mid,
            _ => lo = mid,
        }
    }
    Some(hi)
}

/// The served model's KV footprint and prefill cost.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvModel {
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer (fewer than attention heads under GQA).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per cached element: 2 for BF16/FP16, 1 for FP8, 0.5 for 4-bit.
    #[serde(default = "default_kv_bytes")]
    pub kv_bytes: f64,
    /// Parameters (active parameters for a mixture of experts).
    pub params: f64,
    /// Dense throughput of the destination's accelerators, in TFLOP/s.
    pub tflops: f64,
    /// Model FLOPs utilisation achieved in prefill, in (0, 1].
    pub mfu: f64,
}

fn default_kv_bytes() -> f64 {
    2.0
}

impl KvModel {
    pub fn bytes_per_token(&self) -> f64 {
        bytes_per_kv_token(self.layers, self.kv_heads, self.head_dim, self.kv_bytes)
    }

    pub fn recompute_s_per_token(&self) -> f64 {
        recompute_s_per_token(self.params, self.tflops, self.mfu)
    }

    /// Refuses a model the cost model cannot reason about, naming the field.
    pub fn validate(&self) -> Result<(), String> {
        match self.invalid_field() {
            None => Ok(()),
            Some(("mfu", value)) => Err(format!("mfu must be in (0, 1], got {value}")),
            Some((field, value)) => Err(format!(
                "{field} must be a positive finite number, got {value}"
            )),
        }
    }

    /// The first field outside its domain and its value; no allocation, so
    /// `decide` can check it on every call.
    fn invalid_field(&self) -> Option<(&'static str, f64)> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let fields = [
            ("layers", f64::from(self.layers)),
            ("kv_heads", f64::from(self.kv_heads)),
            ("head_dim", f64::from(self.head_dim)),
            ("kv_bytes", self.kv_bytes),
            ("params", self.params),
            ("tflops", self.tflops),
        ];
        if let Some(bad) = fields.into_iter().find(|(_, value)| !positive(*value)) {
            return Some(bad);
        }
        if !(positive(self.mfu) && self.mfu <= 1.0) {
            return Some(("mfu", self.mfu));
        }
        None
    }
}

/// What the destination region should do with a migrated session's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationAction {
    /// Pull the cached KV from the region that holds it.
    Fetch,
    /// Run prefill again locally.
    Recompute,
}

/// A migration decision and the expected costs it compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MigrationPlan {
    pub action: MigrationAction,
    /// Fetch time plus the M/M/1 wait on the fetch path, in ms; `None` when
    /// fetching is impossible or undefined (no bandwidth, a saturated path,
    /// unusable inputs).
    pub fetch_ms: Option<f64>,
    /// Recompute time plus the M/M/1 wait on the destination's compute queue,
    /// in ms; infinite when that queue is saturated or the inputs are unusable.
    pub recompute_ms: f64,
}

/// Fetch or recompute a `prefix_tokens` prefix held in another region, given
/// the link (`rtt_ms`, `bandwidth_gbps`) and the utilisations of the two
/// queues the options consume: the fetch path and the destination's compute.
///
/// Fetch wins only when its expected time is strictly lower. Anything that
/// leaves the fetch undefined (an invalid model, a NaN, a negative RTT, zero
/// bandwidth, a saturated path) means recompute: it touches no WAN resource.
pub fn decide(
    model: &KvModel,
    prefix_tokens: u64,
    rtt_ms: f64,
    bandwidth_gbps: f64,
    fetch_path_utilization: f64,
    dest_compute_utilization: f64,
    service_rate_per_s: f64,
) -> MigrationPlan {
    let usable = |s: f64| (s.is_finite() && s >= 0.0).then_some(s * 1000.0);

    let recompute_ms = mm1_wait_s(dest_compute_utilization, service_rate_per_s)
        .map(|wait| recompute_s(prefix_tokens, model.params, model.tflops, model.mfu) + wait)
        .and_then(usable)
        .unwrap_or(f64::INFINITY);

    let link_usable = bandwidth_gbps.is_finite()
        && bandwidth_gbps > 0.0
        && rtt_ms.is_finite()
        && rtt_ms >= 0.0
        && model.invalid_field().is_none();
    let fetch_ms = if link_usable {
        mm1_wait_s(fetch_path_utilization, service_rate_per_s)
            .map(|wait| {
                fetch_s(
                    prefix_tokens,
                    model.bytes_per_token(),
                    bandwidth_gbps,
                    rtt_ms,
                ) + wait
            })
            .and_then(usable)
    } else {
        None
    };

    let action = match fetch_ms {
        Some(fetch) if fetch < recompute_ms => MigrationAction::Fetch,
        _ => MigrationAction::Recompute,
    };
    MigrationPlan {
        action,
        fetch_ms,
        recompute_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed's Llama-3.1-70B-class model on H100s at 40% MFU.
    const SEED: KvModel = KvModel {
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        kv_bytes: 2.0,
        params: 70e9,
        tflops: 989.0,
        mfu: 0.4,
    };
    const RTT_MS: f64 = 70.0;
    const FAST_GBPS: f64 = 100.0;
    const WEAK_GBPS: f64 = 5.0;
    const PREFIX: u64 = 600;
    const IDLE_UTIL: f64 = 0.1;
    const SERVICE_RATE: f64 = 20.0;

    /// The seed prints with `{:.2}` / `{:.4}`; compare at that precision.
    fn round_to(x: f64, places: i32) -> f64 {
        let scale = 10f64.powi(places);
        (x * scale).round() / scale
    }

    fn seed_crossover(gbps: f64, rtt_ms: f64) -> Option<f64> {
        crossover_tokens(
            SEED.bytes_per_token(),
            gbps,
            rtt_ms,
            SEED.params,
            SEED.tflops,
            SEED.mfu,
        )
    }

    fn seed_crossover_util(rtt_ms: f64) -> Option<f64> {
        crossover_utilization(
            SEED.bytes_per_token(),
            FAST_GBPS,
            rtt_ms,
            SEED.params,
            SEED.tflops,
            SEED.mfu,
            PREFIX,
            IDLE_UTIL,
            SERVICE_RATE,
        )
    }

    #[test]
    fn seed_kv_footprint_is_320_kib_per_token() {
        assert_eq!(bytes_per_kv_token(80, 8, 128, 2.0), 327_680.0);
        assert_eq!(SEED.bytes_per_token() / 1024.0, 320.0);
    }

    #[test]
    fn seed_per_token_rates() {
        let recompute_us = SEED.recompute_s_per_token() * 1e6;
        assert_eq!(round_to(recompute_us, 2), 353.89);
        let weak_us = transfer_s_per_token(SEED.bytes_per_token(), WEAK_GBPS) * 1e6;
        assert_eq!(round_to(weak_us, 2), 524.29);
        let fast_us = transfer_s_per_token(SEED.bytes_per_token(), FAST_GBPS) * 1e6;
        assert_eq!(round_to(fast_us, 2), 26.21);
    }

    #[test]
    fn public_wan_link_never_favours_fetch() {
        assert_eq!(seed_crossover(WEAK_GBPS, RTT_MS), None);
        assert_eq!(seed_crossover(WEAK_GBPS, 0.0), None);
    }

    #[test]
    fn backbone_crossover_is_214_tokens_and_427_at_twice_the_rtt() {
        let fast = seed_crossover(FAST_GBPS, RTT_MS).unwrap();
        assert_eq!(fast.round(), 214.0);
        let slow = seed_crossover(FAST_GBPS, 2.0 * RTT_MS).unwrap();
        assert_eq!(slow.round(), 427.0);

        // The seed's bracket: recompute wins at half the crossover, fetch at twice.
        let (p, t, m) = (SEED.params, SEED.tflops, SEED.mfu);
        let bpt = SEED.bytes_per_token();
        let short = (fast * 0.5) as u64;
        let long = (fast * 2.0) as u64;
        assert!(recompute_s(short, p, t, m) < fetch_s(short, bpt, FAST_GBPS, RTT_MS));
        assert!(fetch_s(long, bpt, FAST_GBPS, RTT_MS) < recompute_s(long, p, t, m));
    }

    #[test]
    fn seed_prefix_costs_at_1k_and_8k_tokens() {
        let (p, t, m) = (SEED.params, SEED.tflops, SEED.mfu);
        let bpt = SEED.bytes_per_token();
        let ms = |s: f64| round_to(s * 1000.0, 2);
        assert_eq!(ms(recompute_s(1000, p, t, m)), 353.89);
        assert_eq!(ms(fetch_s(1000, bpt, FAST_GBPS, RTT_MS)), 96.21);
        assert_eq!(ms(recompute_s(8000, p, t, m)), 2831.14);
        assert_eq!(ms(fetch_s(8000, bpt, FAST_GBPS, RTT_MS)), 279.72);
    }

    #[test]
    fn seed_600_token_costs() {
        let fetch = fetch_s(PREFIX, SEED.bytes_per_token(), FAST_GBPS, RTT_MS);
        let recompute = recompute_s(PREFIX, SEED.params, SEED.tflops, SEED.mfu);
        assert_eq!(round_to(fetch * 1000.0, 2), 85.73);
        assert_eq!(round_to(recompute * 1000.0, 2), 212.34);
    }

    #[test]
    fn seed_crossover_utilisation_is_0_7255_and_0_6602_at_1_5x_rtt() {
        let xu = seed_crossover_util(RTT_MS).unwrap();
        assert_eq!(round_to(xu, 4), 0.7255);
        let slower = seed_crossover_util(1.5 * RTT_MS).unwrap();
        assert_eq!(round_to(slower, 4), 0.6602);
        assert!(slower < xu);
    }

    #[test]
    fn decide_flips_to_recompute_across_the_crossover_utilisation() {
        let xu = seed_crossover_util(RTT_MS).unwrap();
        let at = |fetch_util: f64| {
            decide(
                &SEED,
                PREFIX,
                RTT_MS,
                FAST_GBPS,
                fetch_util,
                IDLE_UTIL,
                SERVICE_RATE,
            )
        };
        let below = at(xu * 0.95);
        assert_eq!(below.action, MigrationAction::Fetch);
        let above = at(xu + (1.0 - xu) * 0.5);
        assert_eq!(above.action, MigrationAction::Recompute);
        // The recompute side is the seed's idle_total: 212.34 ms + 1/180 s.
        assert_eq!(round_to(above.recompute_ms, 2), 217.89);
    }

    #[test]
    fn decide_at_equal_load_matches_the_plain_crossover() {
        let plan = decide(&SEED, PREFIX, RTT_MS, FAST_GBPS, 0.5, 0.5, SERVICE_RATE);
        assert_eq!(plan.action, MigrationAction::Fetch);
        // 85.73 ms + 50 ms wait against 212.34 ms + 50 ms wait.
        assert_eq!(plan.fetch_ms.map(|f| round_to(f, 2)), Some(135.73));
        assert_eq!(round_to(plan.recompute_ms, 2), 262.34);
        // A short prefix on the same link: below 214 tokens recompute wins.
        let short = decide(&SEED, 100, RTT_MS, FAST_GBPS, 0.0, 0.0, SERVICE_RATE);
        assert_eq!(short.action, MigrationAction::Recompute);
        // The public-WAN link: recompute at any length.
        let weak = decide(&SEED, 100_000, RTT_MS, WEAK_GBPS, 0.0, 0.0, SERVICE_RATE);
        assert_eq!(weak.action, MigrationAction::Recompute);
    }

    #[test]
    fn saturated_queues_and_dead_links() {
        let saturated_path = decide(&SEED, 8000, RTT_MS, FAST_GBPS, 1.0, 0.1, SERVICE_RATE);
        assert_eq!(saturated_path.action, MigrationAction::Recompute);
        assert_eq!(saturated_path.fetch_ms, None);

        let saturated_compute = decide(&SEED, 10, RTT_MS, FAST_GBPS, 0.1, 1.0, SERVICE_RATE);
        assert_eq!(saturated_compute.action, MigrationAction::Fetch);
        assert_eq!(saturated_compute.recompute_ms, f64::INFINITY);

        let no_bandwidth = decide(&SEED, 8000, RTT_MS, 0.0, 0.0, 0.0, SERVICE_RATE);
        assert_eq!(no_bandwidth.action, MigrationAction::Recompute);
        assert_eq!(no_bandwidth.fetch_ms, None);
        assert_eq!(round_to(no_bandwidth.recompute_ms, 2), 2831.14);
    }

    #[test]
    fn mm1_wait_domain() {
        assert_eq!(mm1_wait_s(0.0, 20.0), Some(0.0));
        assert_eq!(mm1_wait_s(0.5, 20.0), Some(0.05));
        for bad_util in [1.0, 1.5, -0.1, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(mm1_wait_s(bad_util, 20.0), None, "util {bad_util}");
        }
        for bad_rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(mm1_wait_s(0.5, bad_rate), None, "rate {bad_rate}");
        }
        // The seed's divergence check: 0.99 waits over 5x what 0.5 does.
        assert!(mm1_wait_s(0.99, 20.0).unwrap() > 5.0 * mm1_wait_s(0.5, 20.0).unwrap());
    }

    #[test]
    fn validate_names_the_bad_field() {
        assert_eq!(SEED.validate(), Ok(()));
        let cases: [(KvModel, &str); 8] = [
            (KvModel { layers: 0, ..SEED }, "layers"),
            (
                KvModel {
                    kv_heads: 0,
                    ..SEED
                },
                "kv_heads",
            ),
            (
                KvModel {
                    head_dim: 0,
                    ..SEED
                },
                "head_dim",
            ),
            (
                KvModel {
                    kv_bytes: -2.0,
                    ..SEED
                },
                "kv_bytes",
            ),
            (
                KvModel {
                    params: f64::NAN,
                    ..SEED
                },
                "params",
            ),
            (
                KvModel {
                    tflops: f64::INFINITY,
                    ..SEED
                },
                "tflops",
            ),
            (KvModel { mfu: 0.0, ..SEED }, "mfu"),
            (KvModel { mfu: 1.5, ..SEED }, "mfu"),
        ];
        for (model, field) in cases {
            let err = model.validate().unwrap_err();
            assert!(err.starts_with(field), "{err}");
        }
        assert_eq!(KvModel { mfu: 1.0, ..SEED }.validate(), Ok(()));
    }

    #[test]
    fn kv_model_deserializes_with_default_kv_bytes_and_refuses_unknown_fields() {
        let json =
            r#"{"layers":80,"kv_heads":8,"head_dim":128,"params":70e9,"tflops":989,"mfu":0.4}"#;
        let model: KvModel = serde_json::from_str(json).unwrap();
        assert_eq!(model, SEED);
        let typo = r#"{"layers":80,"kv_heads":8,"head_dim":128,"params":70e9,"tflops":989,"mfu":0.4,"kv_byte":1}"#;
        let err = serde_json::from_str::<KvModel>(typo).unwrap_err();
        assert!(err.to_string().contains("kv_byte"), "{err}");
    }

    // Properties over small deterministic grids.

    const RTTS: [f64; 6] = [0.0, 5.0, 35.0, 70.0, 140.0, 300.0];
    const GBPS: [f64; 7] = [1.0, 5.0, 10.0, 25.0, 100.0, 400.0, 1600.0];
    const MFUS: [f64; 3] = [0.2, 0.4, 0.6];

    #[test]
    fn more_rtt_never_lowers_the_crossover() {
        for gbps in GBPS {
            for mfu in MFUS {
                let model = KvModel { mfu, ..SEED };
                let crossovers: Vec<Option<f64>> = RTTS
                    .iter()
                    .map(|&rtt| {
                        crossover_tokens(
                            model.bytes_per_token(),
                            gbps,
                            rtt,
                            model.params,
                            model.tflops,
                            model.mfu,
                        )
                    })
                    .collect();
                // Whether fetch can ever win does not depend on the RTT.
                assert!(
                    crossovers.iter().all(Option::is_some)
                        || crossovers.iter().all(Option::is_none)
                );
                for pair in crossovers.windows(2) {
                    if let [Some(a), Some(b)] = pair {
                        assert!(b >= a, "gbps {gbps} mfu {mfu}: {a} then {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn more_bandwidth_never_raises_the_crossover() {
        for rtt in RTTS {
            for mfu in MFUS {
                let model = KvModel { mfu, ..SEED };
                let mut previous: Option<f64> = None;
                for gbps in GBPS {
                    let now = crossover_tokens(
                        model.bytes_per_token(),
                        gbps,
                        rtt,
                        model.params,
                        model.tflops,
                        model.mfu,
                    );
                    // Once fetch can win, more bandwidth keeps it that way.
                    if previous.is_some() {
                        assert!(now.is_some(), "rtt {rtt} mfu {mfu} gbps {gbps}");
                    }
                    if let (Some(before), Some(after)) = (previous, now) {
                        assert!(after <= before, "rtt {rtt} mfu {mfu} gbps {gbps}");
                    }
                    previous = now;
                }
            }
        }
    }

    #[test]
    fn mm1_wait_is_monotone_in_utilisation() {
        for rate in [0.5, 1.0, 20.0, 1000.0] {
            let mut previous = 0.0;
            for step in 0..1000 {
                let util = f64::from(step) / 1000.0;
                let wait = mm1_wait_s(util, rate).unwrap();
                assert!(wait >= previous, "rate {rate} util {util}");
                previous = wait;
            }
        }
    }

    #[test]
    fn decide_never_panics_and_never_fetches_on_garbage() {
        let odd = [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            0.0,
            f64::MIN_POSITIVE,
            0.5,
            1.0,
            1e300,
        ];
        let models = [
            SEED,
            KvModel {
                mfu: f64::NAN,
                ..SEED
            },
            KvModel {
                params: -1.0,
                ..SEED
            },
            KvModel {
                tflops: 0.0,
                ..SEED
            },
            KvModel {
                kv_bytes: f64::INFINITY,
                ..SEED
            },
            KvModel { layers: 0, ..SEED },
        ];
        for model in &models {
            for prefix in [0, 600, u64::MAX] {
                for &x in &odd {
                    let plans = [
                        decide(model, prefix, x, FAST_GBPS, 0.1, 0.1, SERVICE_RATE),
                        decide(model, prefix, RTT_MS, x, 0.1, 0.1, SERVICE_RATE),
                        decide(model, prefix, RTT_MS, FAST_GBPS, x, 0.1, SERVICE_RATE),
                        decide(model, prefix, RTT_MS, FAST_GBPS, 0.1, x, SERVICE_RATE),
                        decide(model, prefix, RTT_MS, FAST_GBPS, 0.1, 0.1, x),
                        decide(model, prefix, x, x, x, x, x),
                    ];
                    for plan in plans {
                        assert!(!plan.recompute_ms.is_nan());
                        if plan.action == MigrationAction::Fetch {
                            let fetch = plan.fetch_ms.unwrap();
                            assert!(fetch.is_finite() && fetch >= 0.0);
                            assert!(fetch < plan.recompute_ms);
                            assert!(model.validate().is_ok());
                        }
                    }
                }
            }
        }
    }
}

/// What the router tells the engine when a request goes to a region that
/// does not hold its prefix while another healthy region does.
#[derive(Debug, Clone, PartialEq)]
pub struct KvAction {
    pub plan: MigrationPlan,
    /// The region holding the prefix.
    pub from: usize,
    /// Tokens of prefix the destination would have to fetch or recompute.
    pub tokens: u64,
}

impl KvAction {
    /// The header value: `fetch; from=<region>; tokens=<n>` or
    /// `recompute; tokens=<n>`.
    pub fn header_value(&self, from_name: &str) -> String {
        match self.plan.action {
            MigrationAction::Fetch => format!("fetch; from={from_name}; tokens={}", self.tokens),
            MigrationAction::Recompute => format!("recompute; tokens={}", self.tokens),
        }
    }
}
