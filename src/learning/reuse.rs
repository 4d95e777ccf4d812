//! How long the deployment's prompts wait before they are used again: the
//! reuse gaps the usage reports show, as a decayed histogram weighted by the
//! tokens reused (`ReuseGaps`). A prefix cache keeps an entry while less
//! than its capacity went in after it: for an engine taking in `λ` tokens a
//! second into `C`, about `T = C / λ` seconds (Che's approximation). Which
//! share of the reuse falls beyond `T`, and how densely it falls at `T`,
//! is what a new prompt's footprint costs there (`decision::footprint`).
//!
//! A sample is a report's reuse: the prompt's prefix the directory read as
//! held (the oldest stamp read, about when it was last served there; the
//! engine's `cached_tokens`), and the prefix it set aside as evicted (the
//! newest stamp set aside; the tokens the engine then prefilled). Gaps
//! longer than any region keeps are seen only as the second kind.

use serde::{Deserialize, Serialize};

use crate::learning::usage::UsageReport;

/// Bucket `k` holds gaps in `[FIRST_MS · 2^(k/2), FIRST_MS · 2^((k+1)/2))`;
/// the first also everything shorter, the last everything longer.
pub const BUCKETS: usize = 32;
const FIRST_MS: f64 = 250.0;
/// A sample's weight halves every this many ms.
const HALF_LIFE_MS: f64 = 600_000.0;

/// The reuse gaps: per bucket, the tokens reused with a gap in it,
/// decayed, normalised to sum to 1 when published.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReuseGaps {
    /// Decayed token weights per bucket (empty: nothing seen).
    pub weights: Vec<f64>,
    /// When the weights were last decayed (ms since the Unix epoch).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub at_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The bucket of a gap, and the bounds of bucket `k` in ms.
fn bucket(gap_ms: f64) -> usize {
    if gap_ms.is_nan() || gap_ms <= FIRST_MS {
        return 0;
    }
    let k = (2.0 * (gap_ms / FIRST_MS).log2()).floor();
    (k.max(0.0) as usize).min(BUCKETS - 1)
}

fn bounds(k: usize) -> (f64, f64) {
    let at = |j: usize| FIRST_MS * 2f64.powf(j as f64 / 2.0);
    (if k == 0 { 0.0 } else { at(k) }, at(k + 1))
}

impl ReuseGaps {
    /// A router's report of one answered request: its reuse, if any.
    pub fn on_report(&mut self, r: &UsageReport) {
        let cached = f64::from(r.cached_tokens.unwrap_or(0));
        if r.held_ms > 0 && r.routed_ms > r.held_ms {
            self.add(r.routed_ms - r.held_ms, cached, r.routed_ms);
        }
        if r.cut_ms > 0 && r.routed_ms > r.cut_ms {
            let prefilled = f64::from(r.prompt_tokens) - cached;
            self.add(r.routed_ms - r.cut_ms, prefilled, r.routed_ms);
        }
    }

    /// Adds `tokens` reused after `gap_ms`, at `now_ms`.
    pub fn add(&mut self, gap_ms: u64, tokens: f64, now_ms: u64) {
        if !tokens.is_finite() || tokens <= 0.0 {
            return;
        }
        self.decay(now_ms);
        if self.weights.len() != BUCKETS {
            self.weights = vec![0.0; BUCKETS];
        }
        if let Some(w) = self.weights.get_mut(bucket(gap_ms as f64)) {
            *w += tokens;
        }
    }

    fn decay(&mut self, now_ms: u64) {
        if now_ms > self.at_ms && self.at_ms > 0 {
            let f = 0.5f64.powf((now_ms - self.at_ms) as f64 / HALF_LIFE_MS);
            self.weights.iter_mut().for_each(|w| *w *= f);
        }
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// As published: the weights summing to 1; empty while nothing is seen.
    pub fn normalised(&self) -> Vec<f64> {
        let total: f64 = self.weights.iter().sum();
        if !(total.is_finite() && total > 0.0) || self.weights.len() != BUCKETS {
            return Vec::new();
        }
        self.weights.iter().map(|w| w / total).collect()
    }
}

/// The share of reuse (by tokens) whose gap exceeds `t_ms`, from published
/// weights (uniform within a bucket); 0 with none.
pub fn beyond(weights: &[f64], t_ms: f64) -> f64 {
    if weights.len() != BUCKETS || t_ms.is_nan() {
        return 0.0;
    }
    let k = bucket(t_ms);
    let (lo, hi) = bounds(k);
    let inside = if k == BUCKETS - 1 {
        1.0
    } else {
        ((hi - t_ms) / (hi - lo)).clamp(0.0, 1.0)
    };
    let above: f64 = weights.iter().skip(k + 1).sum();
    (above + weights.get(k).copied().unwrap_or(0.0) * inside).clamp(0.0, 1.0)
}

/// The density of reuse at a gap of `t_ms`, per ms, from published weights
/// (the share in its bucket over the bucket's width); 0 in the open last
/// bucket and with none.
pub fn density(weights: &[f64], t_ms: f64) -> f64 {
    if weights.len() != BUCKETS || t_ms.is_nan() {
        return 0.0;
    }
    let k = bucket(t_ms);
    if k == BUCKETS - 1 {
        return 0.0;
    }
    let (lo, hi) = bounds(k);
    weights.get(k).copied().unwrap_or(0.0) / (hi - lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_fall_in_half_octaves_and_decay() {
        let mut g = ReuseGaps::default();
        // 3000 tokens reused after 10 s, 1000 after 60 s.
        g.add(10_000, 3000.0, 1_000);
        g.add(60_000, 1000.0, 1_000);
        let w = g.normalised();
        assert_eq!(w.len(), BUCKETS);
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // Nothing is reused after more than 60 s or so; all after 0.
        assert!(beyond(&w, 130_000.0) < 1e-12);
        assert!((beyond(&w, 0.0) - 1.0).abs() < 1e-12);
        // Between the two gaps: the later quarter.
        assert!((beyond(&w, 20_000.0) - 0.25).abs() < 1e-12);
        // The density at 10 s is the 10 s bucket's share over its width.
        let (lo, hi) = bounds(bucket(10_000.0));
        assert!(lo <= 10_000.0 && 10_000.0 < hi);
        assert!((density(&w, 10_000.0) - 0.75 / (hi - lo)).abs() < 1e-15);
        // Ten minutes later the old samples weigh half a new one's.
        g.add(60_000, 2000.0, 601_000);
        let w = g.normalised();
        assert!((beyond(&w, 20_000.0) - 2500.0 / 4000.0).abs() < 1e-9);
        // Nothing, garbage: no share, no density, no panic.
        assert_eq!(beyond(&[], 5.0), 0.0);
        assert_eq!(density(&[0.5; 3], 5.0), 0.0);
        g.add(5, f64::NAN, 601_000);
        g.add(5, -1.0, 601_000);
        assert_eq!(g.normalised().len(), BUCKETS);
        assert_eq!(beyond(&w, f64::NAN), 0.0);
    }
}
