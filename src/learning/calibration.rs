//! What the engines' own answers teach the probe about each region: how
//! many of the engine's tokens a byte of the router's canonical prompt
//! text makes, and how long the region's prefix cache really keeps what
//! the directory records there.
//!
//! The directory knows when a region last served a prefix, not whether the
//! engine still holds it: an engine whose cache is smaller than the working
//! set evicts long before the directory's TTL. Every answered request
//! reports (`usage::UsageReport`) what the directory believed the region
//! held, how old that belief was, and the engine's `cached_tokens`. From
//! them, per region:
//!
//! - **tokens per byte**: the median of the last 15 reports' engine
//!   `prompt_tokens` over the router's prompt bytes (prompts of at least
//!   [`CALIBRATE_MIN_BYTES`], so the chat template's own tokens do not
//!   dominate), overall and per model (at most [`MODELS_MAX`] models per
//!   region). A request that continued a stored response is not reported:
//!   its `prompt_tokens` count a history the router never saw;
//! - **cache capacity**: prefix caches evict the least recently used
//!   blocks, so what decides whether a prefix survives is how many tokens
//!   the engine took in since it was last used, not the wall time. The
//!   probe keeps a clock of the tokens the region's engine prefilled (the
//!   uncached part of each reported prompt, at its routing time) and learns
//!   the capacity `C` in those tokens: an engine that reports less than
//!   nine tenths of a belief made after `t` tokens evicted something that
//!   old, so `C` comes down to `t`; a belief confirmed near `C` raises it by
//!   a quarter, and an engine that reports more than was believed while an
//!   entry was set aside raises it past that entry's token age. The clock
//!   is the engine's own (prefix-cache lookups less hits in its `/metrics`,
//!   at each scrape, read between scrapes by interpolation), which counts
//!   every proxy's traffic; an engine that does not report them is timed by
//!   this Envoy's reported answers. Published
//!   as a horizon in milliseconds, recomputed at every snapshot: the age at
//!   which `C` tokens have gone in since; the router applies it only with
//!   `directory.cache_horizon` (off by default: docs/ROUTING.md);
//! - **reliability**: how much of what the directory (within the horizon)
//!   believes the engine confirms, a decayed mean of `min(1, reported /
//!   believed)`, published for operators. The cost does not discount by it:
//!   one region-wide factor discounts the beliefs that are right with the
//!   ones that are not, and in the simulator it cost cache hits
//!   (docs/ROUTING.md).
//!
//! A belief is checked as the cost made it: the directory's bytes in the
//! engine's tokens, then in its whole blocks and short of the prompt's last
//! token (`engines::capacity::servable_tokens`), which is all an engine can
//! report as `cached_tokens`; compared unrounded, every belief in a
//! 128-token block would read as part evicted.
//!
//! vLLM before 0.24 and SGLang before 0.5.23 omit `cached_tokens` when it
//! is 0; a region that has reported a count once is taken to report it, so
//! from then on an answer without one means 0. A region that never reported
//! one teaches tokens per byte only.

use crate::engines::capacity::servable_tokens;
use crate::learning::usage::UsageReport;

/// Prompts shorter than this do not calibrate tokens per byte.
pub const CALIBRATE_MIN_BYTES: u32 = 256;
const RELIABILITY_ALPHA: f64 = 0.25;
/// Models calibrated per region; others use the region's overall figure.
pub const MODELS_MAX: usize = 8;
/// A report below this share of the belief refutes it.
const REFUTED_BELOW: f64 = 0.9;
/// Tokens per byte accepted from one report (a byte of text is at most a
/// few tokens in any tokenizer; garbage is ignored).
const TPB_RANGE: (f64, f64) = (0.01, 4.0);

/// The median of the last [`RATIOS_KEPT`] reports' tokens per byte. A
/// median, not a byte-weighted mean: one long prompt of unusual text (a
/// table of digits, a code dump) must not set the figure every other
/// prompt is estimated with; with three reports or more, no single report
/// moves it past its neighbours.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Ratio {
    ring: [f64; RATIOS_KEPT],
    len: usize,
    next: usize,
}

/// Reports the tokens-per-byte median is taken over.
const RATIOS_KEPT: usize = 15;

impl Ratio {
    fn add(&mut self, tokens: f64, bytes: f64) {
        if let Some(slot) = self.ring.get_mut(self.next) {
            *slot = tokens / bytes;
        }
        self.next = (self.next + 1) % RATIOS_KEPT;
        self.len = (self.len + 1).min(RATIOS_KEPT);
    }

    fn value(&self) -> Option<f64> {
        let mut kept = self.ring;
        let kept = kept.get_mut(..self.len)?;
        kept.sort_by(f64::total_cmp);
        let mid = self.len / 2;
        match self.len {
            0 => None,
            n if n % 2 == 1 => kept.get(mid).copied(),
            _ => Some((kept.get(mid - 1)? + kept.get(mid)?) / 2.0),
        }
    }
}

/// Points of the token clock kept per region.
const CLOCK_POINTS: usize = 512;

/// One region's calibration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RegionCalibration {
    overall: Ratio,
    models: Vec<(String, Ratio)>,
    /// The region's engine has reported `cached_tokens` at least once.
    pub reports_cached: bool,
    /// (time, tokens prefilled there up to and including it), in time
    /// order: the engine's own counters at each scrape when it reports
    /// them, else this Envoy's reported answers at their routing times.
    clock: std::collections::VecDeque<(u64, f64)>,
    /// The clock reads the engine's counters (all proxies' traffic).
    engine_clock: bool,
    /// The engine's last raw counter reading.
    engine_raw: f64,
    /// Learnt cache capacity in clock tokens; `None`: not yet refuted.
    capacity: Option<f64>,
    reliability: Option<f64>,
    /// Tokens per block of the engine's cache, as its metrics last said.
    pub block_tokens: Option<u32>,
}

/// What one report changed (for logs and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No belief to check, or the engine does not report cached tokens.
    Unchecked,
    /// The engine held what was believed.
    Confirmed,
    /// The engine held less: the capacity came down.
    Refuted,
    /// The engine held more than the horizon let the router believe: the
    /// capacity went up.
    Underestimated,
}

impl RegionCalibration {
    /// Learn from one report.
    pub fn on_report(&mut self, r: &UsageReport) -> Verdict {
        let bytes = f64::from(r.prompt_bytes);
        let tokens = f64::from(r.prompt_tokens);
        if r.prompt_bytes >= CALIBRATE_MIN_BYTES {
            let tpb = tokens / bytes;
            if (TPB_RANGE.0..=TPB_RANGE.1).contains(&tpb) {
                self.overall.add(tokens, bytes);
                if let Some(m) = &r.model {
                    let full = self.models.len() >= MODELS_MAX;
                    match self.models.iter_mut().find(|(n, _)| n == m) {
                        Some((_, ratio)) => ratio.add(tokens, bytes),
                        None if !full => {
                            let mut ratio = Ratio::default();
                            ratio.add(tokens, bytes);
                            self.models.push((m.clone(), ratio));
                        }
                        None => {}
                    }
                }
            }
        }
        if r.cached_tokens.is_some() {
            self.reports_cached = true;
        }
        if !self.reports_cached {
            return Verdict::Unchecked;
        }
        let reported = f64::from(r.cached_tokens.unwrap_or(0));
        let tpb = self
            .overall
            .value()
            .unwrap_or(if bytes > 0.0 { tokens / bytes } else { 0.0 });
        // In the engine's whole blocks, as the cost believed it and as the
        // engine counts `cached_tokens`.
        let believed = f64::from(r.believed_bytes) * tpb;
        let believed = match self.block_tokens {
            Some(_) => servable_tokens(
                believed.floor() as u64,
                u64::from(r.prompt_tokens),
                self.block_tokens,
            ) as f64,
            None => believed,
        };
        let at = self.tokens_at(r.routed_ms);
        let mut verdict = Verdict::Unchecked;
        if believed >= 1.0 && r.held_ms > 0 {
            let share = reported / believed;
            let sample = share.min(1.0);
            self.reliability = Some(match self.reliability {
                None => sample,
                Some(old) => old * (1.0 - RELIABILITY_ALPHA) + RELIABILITY_ALPHA * sample,
            });
            let age = at - self.tokens_at(r.held_ms);
            if share < REFUTED_BELOW {
                self.capacity = Some(self.capacity.map_or(age, |c| c.min(age)).max(1.0));
                verdict = Verdict::Refuted;
            } else {
                if let Some(c) = self.capacity.filter(|c| age > 0.8 * c) {
                    self.capacity = Some(c.max(1.25 * age));
                }
                verdict = Verdict::Confirmed;
            }
        }
        // More than believed, and the horizon set an entry aside: it was
        // there after all.
        let margin = (0.1 * believed).max(16.0);
        if r.cut_ms > 0 && reported > believed + margin {
            let age = at - self.tokens_at(r.cut_ms);
            if let Some(c) = self.capacity {
                self.capacity = Some(c.max(1.25 * age));
                verdict = Verdict::Underestimated;
            }
        }
        // Without the engine's counters, the clock is this request's
        // prefill, at its routing time.
        if !self.engine_clock {
            let inserted = (tokens - reported).max(0.0);
            let at = if r.served_ms > 0 {
                r.served_ms
            } else {
                r.routed_ms
            };
            self.tick_clock(at, inserted);
        }
        verdict
    }

    /// The engine's cumulative prefilled tokens (prefix-cache lookups less
    /// hits, from its `/metrics`) at a scrape: from then on the clock is
    /// the engine's, which counts every proxy's traffic. A counter that
    /// went back (a restarted engine) counts from zero again.
    /// Returns the tokens taken in since the scrape before (0 at the first).
    pub fn on_engine_tokens(&mut self, ms: u64, raw: f64) -> f64 {
        if !raw.is_finite() || raw < 0.0 {
            return 0.0;
        }
        if !self.engine_clock {
            self.engine_clock = true;
            self.clock.clear();
            self.engine_raw = raw;
            self.tick_clock(ms, 0.0);
            return 0.0;
        }
        let delta = if raw >= self.engine_raw {
            raw - self.engine_raw
        } else {
            raw
        };
        self.engine_raw = raw;
        self.tick_clock(ms, delta);
        delta
    }

    fn tick_clock(&mut self, ms: u64, tokens: f64) {
        let last = self.clock.back().copied().unwrap_or((0, 0.0));
        self.clock.push_back((ms.max(last.0), last.1 + tokens));
        if self.clock.len() > CLOCK_POINTS {
            self.clock.pop_front();
        }
    }

    /// Tokens on the clock at `ms`: those prefilled at or before it (the
    /// engine's clock is read between scrapes by interpolation).
    fn tokens_at(&self, ms: u64) -> f64 {
        let i = self.clock.partition_point(|(t, _)| *t <= ms);
        let Some(before) = i.checked_sub(1).and_then(|i| self.clock.get(i)) else {
            return 0.0;
        };
        match self.clock.get(i).filter(|_| self.engine_clock) {
            Some(after) if after.0 > before.0 => {
                let f = (ms - before.0) as f64 / (after.0 - before.0) as f64;
                before.1 + f * (after.1 - before.1)
            }
            _ => before.1,
        }
    }

    /// Engine tokens per byte of canonical prompt text, once measured.
    pub fn tokens_per_byte(&self) -> Option<f64> {
        self.overall.value()
    }

    /// Per model, once measured.
    pub fn model_tokens_per_byte(&self) -> impl Iterator<Item = (&str, f64)> {
        self.models
            .iter()
            .filter_map(|(m, r)| Some((m.as_str(), r.value()?)))
    }

    /// Learnt capacity, in clock tokens.
    pub fn capacity_tokens(&self) -> Option<f64> {
        self.capacity
    }

    /// The age at `now_ms` beyond which an entry is not believed: entries
    /// last served before the capacity's worth of tokens went in. `None`:
    /// no capacity learnt, or not that many tokens on the clock.
    pub fn horizon_ms(&self, now_ms: u64) -> Option<u64> {
        let c = self.capacity?;
        let total = self.clock.back()?.1;
        // The first point whose later intake is within the capacity: an
        // entry stamped before it has had more than `c` tokens go in since.
        let i = self.clock.partition_point(|(_, cum)| total - *cum > c);
        if i == 0 {
            return None;
        }
        let (t, cum) = *self.clock.get(i)?;
        let (t0, cum0) = *self.clock.get(i - 1)?;
        if self.engine_clock && cum > cum0 && t > t0 {
            // Between the two scrapes, where `c` tokens before the last.
            let f = ((total - c) - cum0) / (cum - cum0);
            let cut = t0 as f64 + f.clamp(0.0, 1.0) * (t - t0) as f64;
            return Some((now_ms as f64 - cut).max(1.0).round() as u64);
        }
        Some(now_ms.saturating_sub(t).saturating_add(1).max(1))
    }

    pub fn reliability(&self) -> Option<f64> {
        self.reliability
    }

    /// The clock as the router reads it for a cache of `free` tokens: from
    /// the last point with at least `free` tokens taken in after it (older
    /// stamps are evicted whatever they hold) to the newest, at most `max`
    /// points (evenly thinned, both ends kept), counted from the first.
    pub fn clock_for(&self, free: f64, max: usize) -> Vec<(u64, f64)> {
        let clock = &self.clock;
        let Some(&(_, total)) = clock.back() else {
            return Vec::new();
        };
        let start = clock
            .partition_point(|(_, cum)| total - *cum >= free)
            .saturating_sub(1);
        let n = clock.len() - start;
        let Some(&(_, base)) = clock.get(start) else {
            return Vec::new();
        };
        let max = max.max(2);
        let pick = |k: usize| if n <= max { k } else { k * (n - 1) / (max - 1) };
        (0..n.min(max))
            .filter_map(|k| clock.get(start + pick(k)))
            .map(|&(t, cum)| (t, cum - base))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_700_000_000_000;

    /// A request routed at `T0 + at` of 8000 bytes / 4000 engine tokens.
    fn report(at: u64, believed_bytes: u32, held: u64, cached: Option<u32>) -> UsageReport {
        UsageReport {
            region: 0,
            routed_ms: T0 + at,
            prompt_bytes: 8000,
            believed_bytes,
            held_ms: if held > 0 { T0 + held } else { 0 },
            cut_ms: 0,
            served_ms: 0,
            prompt_tokens: 4000,
            cached_tokens: cached,
            model: None,
        }
    }

    #[test]
    fn no_single_report_sets_tokens_per_byte() {
        // Prose at 0.2 tokens a byte, then one 200 KB table of digits at
        // 0.5 (issue 45, item 2): under a byte-weighted mean the table
        // set the figure every later prose prompt was estimated with.
        let mut c = RegionCalibration::default();
        for i in 0..5 {
            let mut r = report(1 + i, 0, 0, None);
            (r.prompt_bytes, r.prompt_tokens) = (5_000, 1_000);
            c.on_report(&r);
        }
        let mut digits = report(10, 0, 0, None);
        (digits.prompt_bytes, digits.prompt_tokens) = (200_000, 100_000);
        c.on_report(&digits);
        assert_eq!(c.tokens_per_byte(), Some(0.2));
        // A change of traffic that lasts moves it: a majority of the last
        // 15 reports.
        for i in 0..8 {
            let mut r = report(20 + i, 0, 0, None);
            (r.prompt_bytes, r.prompt_tokens) = (4_000, 2_000);
            c.on_report(&r);
        }
        assert_eq!(c.tokens_per_byte(), Some(0.5));
    }

    #[test]
    fn tokens_per_byte_come_from_the_engines_counts() {
        let mut c = RegionCalibration::default();
        assert_eq!(c.tokens_per_byte(), None);
        c.on_report(&report(1, 0, 0, None));
        assert_eq!(c.tokens_per_byte(), Some(0.5));
        // Short prompts (template-dominated) and garbage do not count.
        let mut short = report(2, 0, 0, None);
        short.prompt_bytes = 100;
        short.prompt_tokens = 90;
        c.on_report(&short);
        let mut garbage = report(3, 0, 0, None);
        garbage.prompt_tokens = u32::MAX;
        c.on_report(&garbage);
        assert_eq!(c.tokens_per_byte(), Some(0.5));
        // Per model, bounded.
        for i in 0..20 {
            let mut r = report(4 + u64::from(i), 0, 0, None);
            r.model = Some(format!("m{i}"));
            r.prompt_tokens = 2000 + i;
            c.on_report(&r);
        }
        let models: Vec<_> = c.model_tokens_per_byte().collect();
        assert_eq!(models.len(), MODELS_MAX);
        assert_eq!(models[0], ("m0", 0.25));
        // No cached count ever reported: nothing about the cache is learnt.
        assert_eq!(c.capacity_tokens(), None);
        assert_eq!(c.reliability(), None);
        assert!(!c.reports_cached);
    }

    #[test]
    fn an_eviction_sets_the_capacity_in_tokens_taken_in_since() {
        let mut c = RegionCalibration::default();
        // Requests at 1..=5 s, each prefilling 4000 tokens (nothing cached):
        // the clock reads 4000, 8000, ... 20000.
        for s in 1..=5 {
            assert_eq!(
                c.on_report(&report(s * 1000, 0, 0, Some(0))),
                Verdict::Unchecked
            );
        }
        assert_eq!(c.horizon_ms(T0 + 6000), None);
        // At 6 s, a belief last served at 2 s (12000 tokens ago) is refuted:
        // the capacity is 12000 tokens.
        let r = report(6000, 4000, 2000, None);
        assert_eq!(c.on_report(&r), Verdict::Refuted);
        assert_eq!(c.capacity_tokens(), Some(12_000.0));
        assert_eq!(c.reliability(), Some(0.0));
        // The clock now reads 24000 (the 6 s request prefilled all of its
        // 4000): entries served before 3 s (more than 12000 tokens ago) are
        // past the horizon.
        assert_eq!(c.horizon_ms(T0 + 6500), Some(3501));
        // A belief confirmed near the capacity raises it by a quarter.
        let r = report(7000, 4000, 3000, Some(2000));
        assert_eq!(c.on_report(&r), Verdict::Confirmed);
        assert_eq!(c.capacity_tokens(), Some(15_000.0));
        // Far inside: no change.
        let r = report(8000, 4000, 7000, Some(2000));
        assert_eq!(c.on_report(&r), Verdict::Confirmed);
        assert_eq!(c.capacity_tokens(), Some(15_000.0));
        // More than believed while the horizon set aside an entry served
        // at 1 s: the capacity goes past its token age.
        let mut r = report(9000, 0, 0, Some(3000));
        r.cut_ms = T0 + 1000;
        assert_eq!(c.on_report(&r), Verdict::Underestimated);
        // clock at 9 s: 4000 x 5 + 4000 + 2000 + 2000 = 28000; at 1 s: 4000.
        assert_eq!(c.capacity_tokens(), Some(1.25 * 24_000.0));
        // A later refutation brings it down to its token age: the 9 s
        // answer prefilled 1000, so a belief from 8 s is 1000 old at 10 s.
        let r = report(10_000, 4000, 8000, Some(0));
        assert_eq!(c.on_report(&r), Verdict::Refuted);
        assert_eq!(c.capacity_tokens(), Some(1000.0));
    }

    #[test]
    fn the_engines_own_counters_time_the_cache_when_it_reports_them() {
        let mut c = RegionCalibration::default();
        // Scrapes every second: the engine (all proxies' traffic) prefills
        // 10000 tokens a second; the counter starts at 50000.
        for s in 0..=10u64 {
            c.on_engine_tokens(T0 + s * 1000, 50_000.0 + 10_000.0 * s as f64);
        }
        // This Envoy's own answers no longer move the clock.
        c.on_report(&report(10_100, 0, 0, Some(0)));
        // A belief from 4.5 s refuted at 10 s: 55000 tokens went in since
        // (interpolated between scrapes).
        assert_eq!(
            c.on_report(&report(10_000, 4000, 4500, None)),
            Verdict::Refuted
        );
        assert_eq!(c.capacity_tokens(), Some(55_000.0));
        // Entries older than 5.5 s at the last scrape are past it.
        assert_eq!(c.horizon_ms(T0 + 10_000), Some(5500));
        // A restarted engine (counter back to 0) keeps the clock going.
        c.on_engine_tokens(T0 + 11_000, 5_000.0);
        assert_eq!(c.horizon_ms(T0 + 11_000), Some(6000));
    }

    #[test]
    fn reliability_recovers_when_beliefs_agree_again() {
        let mut c = RegionCalibration::default();
        for i in 1..=4 {
            c.on_report(&report(i * 10, 4000, i * 10 - 5, Some(500)));
        }
        let low = c.reliability().unwrap();
        assert!(low < 0.4, "{low}");
        for i in 5..=25 {
            c.on_report(&report(i * 10, 4000, i * 10 - 5, Some(2000)));
        }
        assert!(c.reliability().unwrap() > 0.99);
    }
}
