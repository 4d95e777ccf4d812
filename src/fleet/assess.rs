//! The declare-disaster rule (the seed's `assess()`), checked in this order:
//! a release mismatch → `rollback` (never fail over to a replica of a bad
//! release); a region judged down by at least two independent signals for
//! the configured time → `page_and_propose_failover` (a human confirms);
//! healthy capacity under the configured fraction →
//! `scale_dr_and_raise_ladder` (automatic); else `ok`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Assessment {
    #[default]
    Ok,
    ScaleDrAndRaiseLadder,
    PageAndProposeFailover,
    Rollback,
}

impl Assessment {
    pub fn as_str(self) -> &'static str {
        match self {
            Assessment::Ok => "ok",
            Assessment::ScaleDrAndRaiseLadder => "scale_dr_and_raise_ladder",
            Assessment::PageAndProposeFailover => "page_and_propose_failover",
            Assessment::Rollback => "rollback",
        }
    }

    /// The gauge value: 0 ok, 1 scale, 2 page, 3 rollback (worse is higher).
    pub fn gauge(self) -> u64 {
        match self {
            Assessment::Ok => 0,
            Assessment::ScaleDrAndRaiseLadder => 1,
            Assessment::PageAndProposeFailover => 2,
            Assessment::Rollback => 3,
        }
    }
}

/// The signals, already reduced per fleet.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Signals {
    /// Some region reports a release other than the expected one.
    pub release_mismatch: bool,
    /// Some region has had ≥ 2 independent down signals for at least the
    /// configured time.
    pub region_down: bool,
    /// Healthy (routable) capacity over configured capacity.
    pub healthy_capacity_fraction: f64,
}

pub fn assess(s: &Signals, capacity_fraction_min: f64) -> Assessment {
    if s.release_mismatch {
        Assessment::Rollback
    } else if s.region_down {
        Assessment::PageAndProposeFailover
    } else if s.healthy_capacity_fraction < capacity_fraction_min {
        Assessment::ScaleDrAndRaiseLadder
    } else {
        Assessment::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_of_the_rule() {
        let all = Signals {
            release_mismatch: true,
            region_down: true,
            healthy_capacity_fraction: 0.1,
        };
        assert_eq!(assess(&all, 0.7), Assessment::Rollback);
        let s = Signals {
            release_mismatch: false,
            ..all
        };
        assert_eq!(assess(&s, 0.7), Assessment::PageAndProposeFailover);
        let s = Signals {
            region_down: false,
            ..s
        };
        assert_eq!(assess(&s, 0.7), Assessment::ScaleDrAndRaiseLadder);
        let s = Signals {
            healthy_capacity_fraction: 0.7,
            ..s
        };
        assert_eq!(assess(&s, 0.7), Assessment::Ok);
        assert_eq!(Assessment::Rollback.as_str(), "rollback");
    }
}
