//! An engine's drain rate (requests it finishes a second), from the
//! completions counter each scrape reads: what the queue term divides the
//! waiting requests by; and the rate of any other counter read the same
//! way (`CounterRate`: the prefix-cache hits).

use crate::config::Config;

/// The engine's drain rate after a scrape that read `completed` at
/// `now_ms`, from the reading before (`last`): the rate over the interval,
/// folded into the EWMA with the weight `probe.demand_alpha` has per
/// `probe.tick_ms` (so the average spans the same time whatever the scrape
/// period). No counter: no rate; a counter that went back (the engine
/// restarted) or no time between the readings: the rate stands.
pub(crate) fn drain_rate(
    cfg: &Config,
    rate: Option<f64>,
    last: Option<(f64, u64)>,
    completed: Option<f64>,
    now_ms: u64,
) -> Option<f64> {
    let c = completed?;
    let Some((c0, t0)) = last else {
        return rate;
    };
    if c < c0 || now_ms <= t0 {
        return rate;
    }
    let dt_ms = (now_ms - t0) as f64;
    let sample = (c - c0) / (dt_ms / 1000.0);
    let per_tick = f64::from(cfg.probe.tick_ms.max(1));
    let a = 1.0 - (1.0 - cfg.probe.demand_alpha).powf(dt_ms / per_tick);
    Some(rate.map_or(sample, |old| old + a * (sample - old)))
}

/// A counter's rate over the probe's scrapes (`drain_rate`), with the
/// reading it is measured from.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CounterRate {
    last: Option<(f64, u64)>,
    /// Per second (EWMA over time); absent when the engine reports none.
    pub rate: Option<f64>,
}

impl CounterRate {
    /// A scrape read `value` at `now_ms`.
    pub fn observe(&mut self, cfg: &Config, value: Option<f64>, now_ms: u64) {
        self.rate = drain_rate(cfg, self.rate, self.last, value, now_ms);
        self.last = match (value, self.last) {
            // Two answers in the same millisecond: keep the older reading
            // as the base of the next rate.
            (Some(_), Some((_, t))) if t >= now_ms => self.last,
            (Some(c), _) => Some((c, now_ms)),
            (None, _) => None,
        };
    }
}
