//! Online tuning of the cost model from observed time-to-first-token.
//!
//! The router reports, for each streamed request, the cost terms it
//! predicted and the TTFT it then observed (request sent → first response
//! body byte). The probe keeps a rolling window of these and fits:
//!
//! * per region, the prefill rate (ms per uncached token), by least squares
//!   on `observed − rtt − queue ≈ rate · uncached_tokens`, shrunk towards the
//!   configured rate and kept within [¼×, 4×] of it;
//! * the queue weight `w_queue`, by ridge regression of
//!   `observed − rtt − prefill ≈ w_queue · queue` towards 1 (a predicted
//!   ms of wait taken as one ms), within configured bounds. The round trip is not weighted: it is
//!   measured in the unit the TTFT is observed in (one round trip is one
//!   round trip), and A/B in the simulator showed the fitted weight gained
//!   nothing (docs/ROUTING.md, "What each rule is worth").
//!
//! Why a calibration rather than GORGO's (1+1)-ES on p95: the terms are
//! physical (a round trip is one round trip), so a model that predicts TTFT
//! correctly also ranks regions correctly; a regression uses every
//! observation instead of judging one noisy candidate per window, and it
//! cannot drift without evidence. The queue weight's lower bound is what
//! stops the known collapse: a window without queueing carries no evidence
//! about `w_queue` (its column is zero), so the ridge keeps it at its prior,
//! and no fit can take it below `w_queue_min`.

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
    /// Bounds on the tuned queue weight. `w_queue_min` > 0 is what prevents
    /// it from collapsing.
    pub w_queue_min: f64,
    pub w_queue_max: f64,
}

impl Default for TuningConfig {
    fn default() -> Self {
        TuningConfig {
            window: 512,
            min_samples: 32,
            w_queue_min: 0.5,
            w_queue_max: 4.0,
        }
    }
}

impl TuningConfig {
    /// The queue weight before any fit, and the ridge's centre: 1 (a
    /// predicted ms of wait is one ms, as every other term is taken),
    /// within the bounds, so that equal bounds pin the weight throughout.
    pub fn w_queue_start(&self) -> f64 {
        1.0_f64.clamp(self.w_queue_min, self.w_queue_max)
    }

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
        let (lo, hi) = (self.w_queue_min, self.w_queue_max);
        if !(lo.is_finite() && hi.is_finite() && lo > 0.0 && hi >= lo) {
            return e(
                "w_queue_min",
                format!("[{lo}, {hi}] must be finite with 0 < min <= max"),
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
    pub w_queue: f64,
    /// Per region; `None` where there was too little evidence.
    pub prefill_ms_per_token: Vec<Option<f64>>,
    pub samples: usize,
}

/// Observations of a region needed before its prefill rate is refined.
const MIN_REGION_SAMPLES: usize = 8;
/// Prompts with fewer uncached tokens say little about the prefill rate.
const MIN_UNCACHED_TOKENS: u32 = 64;

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

    /// Fit the queue weight and per-region prefill rates. `configured`
    /// gives, per region, the configured prefill rate; `prior` the queue
    /// weight's start ([`TuningConfig::w_queue_start`]). The two fits depend on each other, so they
    /// alternate a few rounds (coordinate descent), starting from the prior.
    pub fn fit(&self, cfg: &TuningConfig, prior: f64, configured: &[f64]) -> Option<Fit> {
        if self.window.len() < cfg.min_samples as usize {
            return None;
        }
        let mut w_queue = prior;
        let mut prefill: Vec<Option<f64>> = vec![None; configured.len()];
        for _ in 0..4 {
            prefill = configured
                .iter()
                .enumerate()
                .map(|(r, &rate0)| {
                    // A region with too little evidence of its own takes the
                    // rate the whole window shows (the regions serve the same
                    // model), shrunk towards its configured rate: better
                    // than the configured guess alone, which a region seldom
                    // chosen would otherwise keep.
                    self.fit_prefill(Some(r), rate0, w_queue)
                        .or_else(|| self.fit_prefill(None, rate0, w_queue))
                })
                .collect();
            w_queue = self.fit_queue_weight(cfg, prior, configured, &prefill)?;
        }
        Some(Fit {
            w_queue,
            prefill_ms_per_token: prefill,
            samples: self.window.len(),
        })
    }

    /// Ridge regression of `observed − rtt − prefill` on the predicted
    /// wait, with the prior weight as the ridge centre; the ridge weighs
    /// as one virtual observation per 256 real ones (at least 1/16 of one)
    /// at the typical scale.
    fn fit_queue_weight(
        &self,
        cfg: &TuningConfig,
        prior: f64,
        configured: &[f64],
        prefill: &[Option<f64>],
    ) -> Option<f64> {
        let rate = |r: u16| {
            prefill
                .get(usize::from(r))
                .copied()
                .flatten()
                .or_else(|| configured.get(usize::from(r)).copied())
                .unwrap_or(0.0)
        };
        let (mut szz, mut szy) = (0.0, 0.0);
        for o in &self.window {
            let z = f64::from(o.queue_ms);
            let y = f64::from(o.observed_ms)
                - f64::from(o.rtt_ms)
                - rate(o.region) * f64::from(o.uncached_tokens);
            szz += z * z;
            szy += z * y;
        }
        let n = self.window.len() as f64;
        let scale = (szz / n).max(1.0);
        let lambda = scale * (n / 16.0).max(1.0) / 16.0;
        let b = (szy + lambda * prior) / (szz + lambda);
        b.is_finite()
            .then(|| b.clamp(cfg.w_queue_min, cfg.w_queue_max))
    }

    /// The prefill rate `region`'s observations show (every region's with
    /// `None`), shrunk towards `rate0`; `None` below `MIN_REGION_SAMPLES`.
    fn fit_prefill(&self, region: Option<usize>, rate0: f64, w_queue: f64) -> Option<f64> {
        let (mut suy, mut suu, mut n) = (0.0, 0.0, 0usize);
        for o in self
            .window
            .iter()
            .filter(|o| region.is_none_or(|r| usize::from(o.region) == r))
        {
            if o.uncached_tokens < MIN_UNCACHED_TOKENS {
                continue;
            }
            let u = f64::from(o.uncached_tokens);
            let y =
                (f64::from(o.observed_ms) - f64::from(o.rtt_ms) - w_queue * f64::from(o.queue_ms))
                    .max(0.0);
            suy += u * y;
            suu += u * u;
            n += 1;
        }
        if n < MIN_REGION_SAMPLES || suu <= 0.0 {
            return None;
        }
        // Shrink towards the configured rate as if it were 8 observations.
        let typical = suu / n as f64;
        let prior = 8.0 * typical;
        let rate = (suy + prior * rate0) / (suu + prior);
        let (lo, hi) = if rate0 > 0.0 {
            (rate0 / 4.0, rate0 * 4.0)
        } else {
            (0.0, 10.0)
        };
        rate.is_finite().then(|| rate.clamp(lo, hi))
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
    fn the_queue_weight_starts_at_one_within_its_bounds() {
        let mut cfg = TuningConfig::default();
        assert_eq!(cfg.w_queue_start(), 1.0);
        // Equal bounds pin it from the first request, before any fit.
        (cfg.w_queue_min, cfg.w_queue_max) = (2.0, 2.0);
        assert_eq!(cfg.w_queue_start(), 2.0);
        (cfg.w_queue_min, cfg.w_queue_max) = (0.1, 0.5);
        assert_eq!(cfg.w_queue_start(), 0.5);
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
    fn learns_the_true_prefill_rate_and_queue_weight() {
        let cfg = TuningConfig::default();
        let mut t = Tuner::new(&cfg);
        let mut x = 1u32;
        for i in 0..400u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let region = (i % 2) as u16;
            let uncached = 100 + (x >> 8) % 3000;
            let queue = ((x >> 4) % 400) as f32;
            let rtt = if region == 0 { 5.0 } else { 40.0 };
            // Real prefill 0.3 ms/token in region 0, 0.1 in region 1; queue weighs 2x.
            let rate = if region == 0 { 0.3 } else { 0.1 };
            t.push(obs(region, rtt, queue, uncached, rate, 2.0));
        }
        let fit = t.fit(&cfg, 1.0, &[0.1, 0.1]).unwrap();
        let r0 = fit.prefill_ms_per_token[0].unwrap();
        let r1 = fit.prefill_ms_per_token[1].unwrap();
        assert!((r0 - 0.3).abs() < 0.05, "{r0}");
        assert!((r1 - 0.1).abs() < 0.02, "{r1}");
        assert!(fit.w_queue > 1.5, "{}", fit.w_queue);
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
        let fit = t.fit(&cfg, 1.0, &[0.1, 0.1, 0.1]).unwrap();
        let rate = |r: usize| fit.prefill_ms_per_token[r].unwrap();
        for r in [0, 1, 2] {
            assert!((rate(r) - 0.05).abs() < 0.012, "region {r}: {}", rate(r));
        }
    }

    #[test]
    fn queue_weight_cannot_collapse() {
        let cfg = TuningConfig::default();
        let mut t = Tuner::new(&cfg);
        // A window with no queueing at all, and one where queueing never hurt.
        for i in 0..200u32 {
            t.push(obs(0, 5.0, 0.0, 500 + i, 0.1, 0.0));
        }
        let fit = t.fit(&cfg, 1.0, &[0.1]).unwrap();
        assert!(
            (fit.w_queue - 1.0).abs() < 1e-9,
            "no evidence: prior kept, got {}",
            fit.w_queue
        );
        let mut t = Tuner::new(&cfg);
        for i in 0..200u32 {
            t.push(obs(0, 5.0, 50.0 + i as f32, 500, 0.1, 0.0));
        }
        // There observed TTFT is 55 ms whatever the queue (50-250 ms): the
        // data says w_queue = 0. Unbounded, the ridge (centred on the prior,
        // 1) leaves it near that: measured 0.137. The floor holds it at
        // exactly w_queue_min, neither at the prior nor where the data is.
        let unbounded = TuningConfig {
            w_queue_min: 0.0,
            ..cfg.clone()
        };
        let free = t.fit(&unbounded, 1.0, &[0.1]).unwrap().w_queue;
        assert!(free < 0.25, "queueing never hurt: {free}");
        let fit = t.fit(&cfg, 1.0, &[0.1]).unwrap();
        assert_eq!(fit.w_queue, cfg.w_queue_min);
        // Queueing that costs 0.75 of its estimate, between floor and
        // prior: the fit finds it (measured 0.787), so the floor above is
        // the floor binding, not a fit stuck at a bound.
        let mut t = Tuner::new(&cfg);
        let mut x = 1u32;
        for _ in 0..200u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let queue = ((x >> 4) % 300) as f32;
            t.push(obs(0, 5.0, queue, 300 + (x >> 8) % 2000, 0.1, 0.75));
        }
        let fit = t.fit(&cfg, 1.0, &[0.1]).unwrap();
        assert!((fit.w_queue - 0.75).abs() < 0.1, "{}", fit.w_queue);
    }

    #[test]
    fn too_few_samples_fit_nothing_and_the_window_rolls() {
        let cfg = TuningConfig {
            window: 16,
            min_samples: 10,
            ..TuningConfig::default()
        };
        let mut t = Tuner::new(&cfg);
        for _ in 0..9 {
            t.push(obs(0, 5.0, 0.0, 500, 0.1, 1.0));
        }
        assert!(t.fit(&cfg, 1.0, &[0.1]).is_none());
        for _ in 0..100 {
            t.push(obs(0, 5.0, 0.0, 500, 0.1, 1.0));
        }
        assert_eq!(t.len(), 16);
        assert!(cfg.validate().is_ok());
        assert!(TuningConfig {
            w_queue_min: 0.0,
            ..cfg.clone()
        }
        .validate()
        .is_err());
    }
}
