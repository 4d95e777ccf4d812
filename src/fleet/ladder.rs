//! The degraded-mode ladder controller (the seed's `next_level`): the level
//! rises one rung at once when the capacity/demand ratio falls below the
//! current rung's `up_at`, and falls one rung only after the level has held
//! for `dwell` and the ratio has recovered past `down_at`. The hysteresis
//! between the two thresholds and the dwell keep it from flapping.

use crate::config::{LadderConfig, LADDER_RUNGS};

pub const MAX_LEVEL: u8 = LADDER_RUNGS as u8;

/// The seed's `next_level`, with its thresholds from configuration.
pub fn next_level(cfg: &LadderConfig, level: u8, ratio: f64, dwell_s: f64) -> u8 {
    let i = usize::from(level);
    if level < MAX_LEVEL && cfg.up_at.get(i).is_some_and(|up| ratio < *up) {
        return level + 1;
    }
    if level > 0
        && cfg.down_at.get(i - 1).is_some_and(|down| ratio > *down)
        && dwell_s > cfg.dwell_s
    {
        return level - 1;
    }
    level
}

/// Controller state: the level and when it last changed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ladder {
    pub level: u8,
    pub changed_ms: u64,
}

impl Ladder {
    pub fn new(now_ms: u64) -> Self {
        Ladder {
            level: 0,
            changed_ms: now_ms,
        }
    }

    /// Hold `level` (an operator's override); true when the level changed.
    pub fn force(&mut self, level: u8, now_ms: u64) -> bool {
        let level = level.min(MAX_LEVEL);
        if level == self.level {
            return false;
        }
        self.level = level;
        self.changed_ms = now_ms;
        true
    }

    /// One controller step at `now_ms`; a forced level in configuration wins.
    /// Returns true when the level changed.
    pub fn step(&mut self, cfg: &LadderConfig, ratio: f64, now_ms: u64) -> bool {
        let next = match cfg.forced_level {
            Some(forced) => forced.min(MAX_LEVEL),
            None => {
                let dwell_s = now_ms.saturating_sub(self.changed_ms) as f64 / 1000.0;
                next_level(cfg, self.level, ratio, dwell_s)
            }
        };
        if next == self.level {
            return false;
        }
        self.level = next;
        self.changed_ms = now_ms;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_semantics() {
        let c = LadderConfig::default();
        assert_eq!(next_level(&c, 0, 0.99, 0.0), 1);
        assert_eq!(next_level(&c, 0, 1.0, 0.0), 0);
        assert_eq!(next_level(&c, 4, 0.44, 0.0), 5);
        assert_eq!(next_level(&c, 5, 0.01, 0.0), 5);
        // Recovery needs both the ratio past down_at and the dwell.
        assert_eq!(next_level(&c, 1, 1.2, 300.0), 1);
        assert_eq!(next_level(&c, 1, 1.2, 300.1), 0);
        assert_eq!(next_level(&c, 1, 1.05, 1000.0), 1);
        assert_eq!(next_level(&c, 3, 0.86, 301.0), 2);
    }

    #[test]
    fn climbs_one_rung_per_step_and_recovers_one_per_dwell() {
        let c = LadderConfig {
            dwell_s: 10.0,
            ..LadderConfig::default()
        };
        let mut l = Ladder::new(0);
        let mut levels = vec![];
        for t in 1..=6 {
            l.step(&c, 0.2, t * 1000);
            levels.push(l.level);
        }
        assert_eq!(levels, vec![1, 2, 3, 4, 5, 5]);
        let mut t = 6000;
        let mut downs = vec![];
        while l.level > 0 && t < 200_000 {
            t += 1000;
            if l.step(&c, 2.0, t) {
                downs.push(t);
            }
        }
        // 5 → 0, one rung each time the 10 s dwell has passed.
        assert_eq!(downs, vec![16_000, 27_000, 38_000, 49_000, 60_000]);
    }

    #[test]
    fn oscillating_ratio_does_not_flap() {
        let c = LadderConfig {
            dwell_s: 30.0,
            ..LadderConfig::default()
        };
        let mut l = Ladder::new(0);
        let mut changes = 0;
        for t in 1..=300u64 {
            let ratio = if t % 2 == 0 { 0.95 } else { 1.05 };
            changes += usize::from(l.step(&c, ratio, t * 1000));
        }
        // Up once to level 1 (0.95 < 1.0); 1.05 never passes down_at[0] = 1.10.
        assert_eq!((l.level, changes), (1, 1));
    }

    #[test]
    fn forced_level_wins() {
        let c = LadderConfig {
            forced_level: Some(3),
            ..LadderConfig::default()
        };
        let mut l = Ladder::new(0);
        assert!(l.step(&c, 10.0, 1));
        assert_eq!(l.level, 3);
        assert!(!l.step(&c, 0.0, 2));
    }
}
