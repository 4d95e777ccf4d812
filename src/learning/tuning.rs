//! Online tuning of the cost model from observed time-to-first-token.
//!
//! The router reports, for each streamed request, the cost terms it
//! predicted and the TTFT it then observed (request sent → first response
//! body byte). The probe keeps a rolling window of these and fits:
//!
//! * per region, the prefill time as a per-request part and a rate (ms per
//!   uncached token), by least squares on `observed − rtt − queue ≈
//!   per_request + rate · uncached_tokens` over every observation (the
//!   short turns included: the fit covers what it is applied to), the rate
//!   shrunk towards the configured one and kept within [¼×, 4×] of it, the
//!   per-request part towards 0 and at least 0. A real engine costs a fixed
//!   part per request (vLLM 0.32 on a small model: about 14 ms, then about
//!   17 µs a token); fitted through the origin, that part is charged per
//!   token, and a region whose observations were short turns looks several
//!   times slower than its twin (issue 45, item 3).
//!
//! Neither the round trip nor the queue is weighted: each is predicted in
//! the unit the TTFT is observed in (a round trip is one round trip, a
//! predicted ms of wait one ms). Fitted weights on either, by ridge
//! regression within bounds, paid nothing as shipped and were removed
//! (docs/ROUTING.md, "What each rule is worth").
//!
//! Why a calibration rather than GORGO's (1+1)-ES on p95: the terms are
//! physical, so a model that predicts TTFT correctly also ranks regions
//! correctly; a regression uses every observation instead of judging one
//! noisy candidate per window, and it cannot drift without evidence.

use serde::Deserialize;

/// One observation, as the router sends it over the shared queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    pub region: u16,
    /// Unweighted terms as predicted at routing time.
    pub rtt_ms: f32,
    pub queue_ms: f32,
    pub uncached_tokens: u32,
    pub prefill_ms: f32,
    pub observed_ms: f32,
}

impl Observation {
    pub const BYTES: usize = 22;

    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        let parts: [&[u8]; 6] = [
            &self.region.to_le_bytes(),
            &self.rtt_ms.to_le_bytes(),
            &self.queue_ms.to_le_bytes(),
            &self.uncached_tokens.to_le_bytes(),
            &self.prefill_ms.to_le_bytes(),
            &self.observed_ms.to_le_bytes(),
        ];
        let mut at = 0;
        for p in parts {
            if let Some(dst) = b.get_mut(at..at + p.len()) {
                dst.copy_from_slice(p);
            }
            at += p.len();
        }
        b
    }

    pub fn decode(b: &[u8]) -> Option<Observation> {
        if b.len() != Self::BYTES {
            return None;
        }
        let f = |at: usize| -> Option<f32> {
            Some(f32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
        };
        let o = Observation {
            region: u16::from_le_bytes(b.get(0..2)?.try_into().ok()?),
            rtt_ms: f(2)?,
            queue_ms: f(6)?,
            uncached_tokens: u32::from_le_bytes(b.get(10..14)?.try_into().ok()?),
            prefill_ms: f(14)?,
            observed_ms: f(18)?,
        };
        let sane = |v: f32| v.is_finite() && (0.0..1.0e7).contains(&v);
        (sane(o.rtt_ms) && sane(o.queue_ms) && sane(o.prefill_ms) && sane(o.observed_ms))
            .then_some(o)
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TuningConfig {
    /// Observations kept (the rolling window).
    pub window: u32,
    /// Observations needed before anything is fitted.
    pub min_samples: u32,
}

impl Default for TuningConfig {
    fn default() -> Self {
        TuningConfig {
            window: 512,
            min_samples: 32,
        }
    }
}

impl TuningConfig {
    pub fn validate(&self) -> Result<(), (String, String)> {
        let e = |f: &str, r: String| Err((format!("tuning.{f}"), r));
        if !(16..=65536).contains(&self.window) {
            return e(
                "window",
                format!("{} must be within 16..=65536", self.window),
            );
        }
        if self.min_samples == 0 || self.min_samples > self.window {
            return e(
                "min_samples",
                format!("{} must be within 1..=tuning.window", self.min_samples),
            );
        }
        Ok(())
    }
}

/// The rolling window and the fitted values.
#[derive(Debug, Clone)]
pub struct Tuner {
    window: Vec<Observation>,
    next: usize,
    cap: usize,
}

/// What a fit produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Per region; `None` where there was too little evidence.
    pub prefill: Vec<Option<Prefill>>,
    pub samples: usize,
}

/// A region's fitted prefill time: `per_request_ms + ms_per_token ·
/// uncached tokens`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prefill {
    pub per_request_ms: f64,
    pub ms_per_token: f64,
}

impl Prefill {
    pub fn ms(&self, uncached_tokens: f64) -> f64 {
        self.per_request_ms + self.ms_per_token * uncached_tokens
    }
}

/// Observations of a region needed before its prefill is refined.
const MIN_REGION_SAMPLES: usize = 8;
/// The per-request part believed before any evidence (ms), and how many
/// observations a prior per-request part weighs.
const PER_REQUEST_PRIOR_MS: f64 = 0.0;
const PER_REQUEST_PRIOR_WEIGHT: f64 = 2.0;
/// The largest per-request part believed (ms): beyond it the observations
/// say something else than prefill (a queue the engine did not report).
const PER_REQUEST_MAX_MS: f64 = 1000.0;

impl Tuner {
    pub fn new(cfg: &TuningConfig) -> Self {
        let cap = cfg.window.max(1) as usize;
        Tuner {
            window: Vec::with_capacity(cap),
            next: 0,
            cap,
        }
    }

    pub fn push(&mut self, o: Observation) {
        if self.window.len() < self.cap {
            self.window.push(o);
        } else if let Some(slot) = self.window.get_mut(self.next) {
            *slot = o;
        }
        self.next = (self.next + 1) % self.cap;
    }

    pub fn len(&self) -> usize {
        self.window.len()
    }

    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }

    /// Fit the per-region prefill times. `configured` gives, per region,
    /// the configured prefill rate.
    pub fn fit(&self, cfg: &TuningConfig, configured: &[f64]) -> Option<Fit> {
        if self.window.len() < cfg.min_samples as usize {
            return None;
        }
        let prefill = configured
            .iter()
            .enumerate()
            .map(|(r, &rate0)| {
                // The regions serve the same model: what the whole window
                // shows (shrunk towards the configured rate) is the prior
                // of each region's own fit, and a region with too little
                // evidence of its own takes it. Better than the configured
                // guess, which a region seldom chosen, or seen only on
                // short turns, would otherwise keep.
                let configured = Prefill {
                    per_request_ms: PER_REQUEST_PRIOR_MS,
                    ms_per_token: rate0,
                };
                let fleet = self.fit_prefill(None, configured, rate0);
                self.fit_prefill(Some(r), fleet.unwrap_or(configured), rate0)
                    .or(fleet)
            })
            .collect();
        Some(Fit {
            prefill,
            samples: self.window.len(),
        })
    }

    /// The prefill time `region`'s observations show (every region's with
    /// `None`): least squares of `observed − rtt − queue` on a
    /// per-request part and a rate, shrunk towards `prior`, the rate as if
    /// it were 8 observations of the prompts' spread, the per-request part
    /// as 2; the rate kept within [¼×, 4×] of the configured `rate0`.
    /// `None` below `MIN_REGION_SAMPLES`.
    fn fit_prefill(&self, region: Option<usize>, prior: Prefill, rate0: f64) -> Option<Prefill> {
        let (mut n, mut su, mut sy, mut suu, mut suy) = (0.0f64, 0.0, 0.0, 0.0, 0.0);
        for o in self
            .window
            .iter()
            .filter(|o| region.is_none_or(|r| usize::from(o.region) == r))
        {
            let u = f64::from(o.uncached_tokens);
            let y =
                (f64::from(o.observed_ms) - f64::from(o.rtt_ms) - f64::from(o.queue_ms)).max(0.0);
            n += 1.0;
            su += u;
            sy += y;
            suu += u * u;
            suy += u * y;
        }
        if n < MIN_REGION_SAMPLES as f64 || suu <= 0.0 {
            return None;
        }
        // Ridge on both: minimise Σ(y − a − b·u)² + λa(a − a0)² + λb(b − b0)².
        let (la, a0) = (PER_REQUEST_PRIOR_WEIGHT, prior.per_request_ms);
        // The rate's prior weighs as 8 observations of the slope: with a
        // per-request part in the model, what tells the rate is the spread
        // of the prompts around their mean, not their size (a prior scaled
        // by the mean square would pin the rate and push the rest into the
        // per-request part).
        let spread = (suu / n - (su / n).powi(2)).max(0.0);
        let lb = 8.0 * spread + 1e-3 * suu / n;
        let (m11, m12, m22) = (n + la, su, suu + lb);
        let (r1, r2) = (sy + la * a0, suy + lb * prior.ms_per_token);
        let det = m11 * m22 - m12 * m12;
        if !(det.is_finite() && det > 0.0) {
            return None;
        }
        let (lo, hi) = if rate0 > 0.0 {
            (rate0 / 4.0, rate0 * 4.0)
        } else {
            (0.0, 10.0)
        };
        let mut b = ((m11 * r2 - m12 * r1) / det).clamp(lo, hi);
        // The per-request part for that rate, within its bounds; the rate
        // again for that part where the bound moved it.
        let a = ((r1 - m12 * b) / m11).clamp(0.0, PER_REQUEST_MAX_MS);
        b = ((r2 - m12 * a) / m22).clamp(lo, hi);
        (a.is_finite() && b.is_finite()).then_some(Prefill {
            per_request_ms: a,
            ms_per_token: b,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(
        region: u16,
        rtt: f32,
        queue: f32,
        uncached: u32,
        rate: f32,
        w_queue_true: f32,
    ) -> Observation {
        Observation {
            region,
            rtt_ms: rtt,
            queue_ms: queue,
            uncached_tokens: uncached,
            prefill_ms: 0.1 * uncached as f32,
            observed_ms: rtt + rate * uncached as f32 + w_queue_true * queue,
        }
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let o = obs(3, 40.0, 12.5, 900, 0.2, 1.0);
        assert_eq!(Observation::decode(&o.encode()), Some(o));
        assert_eq!(Observation::decode(&[0; 5]), None);
        let mut bad = o;
        bad.observed_ms = f32::NAN;
        assert_eq!(Observation::decode(&bad.encode()), None);
    }

    #[test]
    fn learns_the_true_prefill_rates_beside_a_queue() {
        let cfg = TuningConfig::default();
        let mut t = Tuner::new(&cfg);
        let mut x = 1u32;
        for i in 0..400u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let region = (i % 2) as u16;
            let uncached = 100 + (x >> 8) % 3000;
            let queue = ((x >> 4) % 400) as f32;
            let rtt = if region == 0 { 5.0 } else { 40.0 };
            // Real prefill 0.3 ms/token in region 0, 0.1 in region 1; the
            // queue costs what it predicts.
            let rate = if region == 0 { 0.3 } else { 0.1 };
            t.push(obs(region, rtt, queue, uncached, rate, 1.0));
        }
        let fit = t.fit(&cfg, &[0.1, 0.1]).unwrap();
        let r0 = fit.prefill[0].unwrap().ms_per_token;
        let r1 = fit.prefill[1].unwrap().ms_per_token;
        assert!((r0 - 0.3).abs() < 0.05, "{r0}");
        assert!((r1 - 0.1).abs() < 0.02, "{r1} {:?}", fit);
    }

    #[test]
    fn a_region_with_little_evidence_takes_the_fleets_rate() {
        // The configured rate (0.1) is a guess; every engine prefills at
        // 0.05 ms/token. Region 0 has plenty of observations, region 1 three,
        // region 2 none: both take what the window shows, not the guess.
        let cfg = TuningConfig::default();
        let mut t = Tuner::new(&cfg);
        for i in 0..40u32 {
            t.push(obs(0, 5.0, 0.0, 1000 + 97 * i, 0.05, 1.0));
        }
        for i in 0..3u32 {
            t.push(obs(1, 40.0, 0.0, 2000 + 300 * i, 0.05, 1.0));
        }
        let fit = t.fit(&cfg, &[0.1, 0.1, 0.1]).unwrap();
        let rate = |r: usize| fit.prefill[r].unwrap().ms_per_token;
        for r in [0, 1, 2] {
            assert!((rate(r) - 0.05).abs() < 0.012, "region {r}: {}", rate(r));
        }
    }

    #[test]
    fn a_per_request_part_is_not_charged_per_token() {
        // Three identical engines (vLLM 0.32 on the small model: 14 ms a
        // request plus 17 µs a token), configured at 0.05 ms/token (the
        // fit stays within 4x of it). near's
        // observations are short turns (100-300 uncached tokens), mid's
        // and far's long cold prompts (1,000-3,000). Through the origin
        // the fixed part was charged per token: near fitted 3x slower than
        // its twins, and cold prompts left it (issue 45, item 3).
        let cfg = TuningConfig::default();
        let mut t = Tuner::new(&cfg);
        let mut x = 7u32;
        for i in 0..300u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let region = (i % 3) as u16;
            let uncached = if region == 0 {
                100 + (x >> 8) % 200
            } else {
                1000 + (x >> 8) % 2000
            };
            let mut o = obs(region, 1.0, 0.0, uncached, 0.017, 1.0);
            o.observed_ms += 14.0;
            t.push(o);
        }
        let fit = t.fit(&cfg, &[0.05, 0.05, 0.05]).unwrap();
        for (r, p) in fit.prefill.iter().enumerate() {
            let p = p.unwrap();
            assert!(
                (0.012..=0.022).contains(&p.ms_per_token),
                "region {r}: {p:?}"
            );
            assert!(
                (10.0..=18.0).contains(&p.per_request_ms),
                "region {r}: {p:?}"
            );
            // The prediction for a 200-token and a 2,000-token prompt is
            // within 15 % of the truth in every region.
            for u in [200.0, 2000.0] {
                let truth = 14.0 + 0.017 * u;
                assert!(
                    (p.ms(u) - truth).abs() <= 0.15 * truth,
                    "region {r}, {u} tokens: {p:?}"
                );
            }
        }
    }

    #[test]
    fn too_few_samples_fit_nothing_and_the_window_rolls() {
        let cfg = TuningConfig {
            window: 16,
            min_samples: 10,
        };
        let mut t = Tuner::new(&cfg);
        for _ in 0..9 {
            t.push(obs(0, 5.0, 0.0, 500, 0.1, 1.0));
        }
        assert!(t.fit(&cfg, &[0.1]).is_none());
        for _ in 0..100 {
            t.push(obs(0, 5.0, 0.0, 500, 0.1, 1.0));
        }
        assert_eq!(t.len(), 16);
        assert!(cfg.validate().is_ok());
        assert!(TuningConfig {
            min_samples: 17,
            ..cfg.clone()
        }
        .validate()
        .is_err());
    }
}
