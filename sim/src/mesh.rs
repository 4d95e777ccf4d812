//! The mesh default: what a client region's Envoy (an Istio sidecar or
//! gateway with locality load balancing, which Istio only turns on with
//! outlier detection) does with the regions as its hosts, at Envoy's and
//! Istio's defaults.
//!
//! - Priorities by locality: the client region's own region (here the
//!   nearest, the first on ties) at priority 0; every other region at one
//!   failover priority (Istio gives all other regions the same priority
//!   unless `failover` or `failoverPriority` lists are configured).
//! - A host counts as healthy while it passes its active health checks
//!   (the simulation's, as for every baseline) and is not ejected by
//!   outlier detection.
//! - Priority load (Envoy's priority levels): a level's health is its
//!   healthy share × the overprovisioning factor 1.4, capped at 100 %;
//!   priority 0 takes its health's share of the traffic, the next level the
//!   rest, normalised when the levels' health adds up to less than 100 %.
//!   Traffic therefore leaves priority 0 only when its hosts are unhealthy
//!   or ejected, never because they are loaded. With one region at
//!   priority 0 its health is 0 or 100 %: all or nothing.
//! - Within a level, `LEAST_REQUEST` at its defaults: two hosts drawn at
//!   random with replacement among the level's healthy ones, the one with
//!   fewer active requests from this Envoy taken (`sim::least_request`).
//! - Outlier detection at Envoy's defaults (what Istio passes on for every
//!   field its `outlierDetection` leaves unset): 5 consecutive 5xx (a refused or dropped request
//!   counts) eject a host, if the ejected hosts, it included, are at most
//!   10 % of all hosts (`max_ejection_percent`; `always_eject_one_host`
//!   off), for 30 s × its ejection count (capped at 300 s), checked every
//!   10 s; a passing active health check un-ejects it at once
//!   (`successful_active_health_check_uneject_host`); each 10 s sweep
//!   after a host has been back a whole interval lowers its count by one.
//!   With fewer than 10 regions no region can be ejected: failover rests
//!   on the health checks alone.
//! - No panic routing: Istio sets `healthy_panic_threshold` to 0. Where no
//!   host is healthy at all Envoy puts the load on priority 0 and answers
//!   503 for want of a healthy host; here the request goes to priority 0's
//!   region, which fails it the same way when it is down.
//!
//! Sources: Envoy's priority levels and overprovisioning
//! (`intro/arch_overview/upstream/load_balancing/priority`), its outlier
//! detection (`source/common/upstream/outlier_detection_impl.cc`,
//! `ejectHost`, `checkHostForUneject`, `onIntervalTimer`), Istio's
//! `applyOutlierDetection` (panic threshold 0).

use crate::policy::View;
use crate::rng::Rng;

/// Envoy's `overprovisioning_factor`, in percent.
pub const OVERPROVISIONING_PERCENT: u64 = 140;
pub const CONSECUTIVE_5XX: u32 = 5;
pub const INTERVAL_MS: f64 = 10_000.0;
pub const BASE_EJECTION_MS: f64 = 30_000.0;
pub const MAX_EJECTION_MS: f64 = 300_000.0;
pub const MAX_EJECTION_PERCENT: f64 = 10.0;

/// One host's outlier state, as one Envoy sees it.
#[derive(Debug, Clone, Default)]
struct Host {
    consecutive_5xx: u32,
    ejected_at: Option<f64>,
    /// Envoy's `ejectTimeBackoff`: the ejection time's multiplier.
    backoff: u32,
    unejected_at: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct MeshDefault {
    hosts: Vec<Host>,
    rng: Rng,
    next_sweep_ms: f64,
}

/// A level's health: its healthy share × the overprovisioning factor,
/// whole percent, capped at 100.
fn health(healthy: usize, hosts: usize) -> u64 {
    if hosts == 0 {
        return 0;
    }
    (OVERPROVISIONING_PERCENT * healthy as u64 / hosts as u64).min(100)
}

impl MeshDefault {
    pub fn new(regions: usize, seed: u64) -> Self {
        MeshDefault {
            hosts: vec![Host::default(); regions],
            rng: Rng::new(seed),
            next_sweep_ms: INTERVAL_MS,
        }
    }

    fn ejected(&self, r: usize) -> bool {
        self.hosts.get(r).is_some_and(|h| h.ejected_at.is_some())
    }

    pub fn choose(&mut self, v: &View) -> usize {
        let all: Vec<usize> = (0..v.rtt_ms.len()).collect();
        let p0 = v.nearest(&all);
        let up = |r: usize| v.healthy.get(r).copied().unwrap_or(false) && !self.ejected(r);
        let p1: Vec<usize> = all.iter().copied().filter(|&r| r != p0).collect();
        let p1_up: Vec<usize> = p1.iter().copied().filter(|&r| up(r)).collect();
        let h0 = health(usize::from(up(p0)), 1);
        let h1 = health(p1_up.len(), p1.len());
        let total = (h0 + h1).min(100);
        if total == 0 {
            return p0;
        }
        let load0 = h0 * 100 / total;
        let to_p0 = match load0 {
            100.. => true,
            0 => false,
            share => self.rng.next_u64() % 100 < share,
        };
        if to_p0 {
            return p0;
        }
        let active: Vec<usize> = p1_up
            .iter()
            .map(|&r| usize::try_from(v.outstanding.get(r).copied().unwrap_or(0)).unwrap_or(0))
            .collect();
        let k = crate::sim::least_request(&mut self.rng, &active);
        p1_up.get(k).copied().unwrap_or(p0)
    }

    fn uneject(&mut self, r: usize, now_ms: f64) {
        if let Some(h) = self.hosts.get_mut(r) {
            h.ejected_at = None;
            h.consecutive_5xx = 0;
            h.unejected_at = Some(now_ms);
        }
    }

    /// The end of a request to region `r` reached this Envoy: a success
    /// resets the host's count of consecutive errors, an error adds one; the
    /// fifth in a row ejects it if the ejection cap allows (the count
    /// starts over either way). Errors of an ejected host count for nothing
    /// until it is back.
    pub fn observe(&mut self, r: usize, ok: bool, now_ms: f64) {
        let hosts = self.hosts.len();
        let ejected_now = self.hosts.iter().filter(|h| h.ejected_at.is_some()).count();
        let Some(h) = self.hosts.get_mut(r) else {
            return;
        };
        if h.ejected_at.is_some() {
            return;
        }
        if ok {
            h.consecutive_5xx = 0;
            return;
        }
        h.consecutive_5xx += 1;
        if h.consecutive_5xx < CONSECUTIVE_5XX {
            return;
        }
        h.consecutive_5xx = 0;
        let share = 100.0 * (ejected_now + 1) as f64 / hosts as f64;
        if share <= MAX_EJECTION_PERCENT {
            h.ejected_at = Some(now_ms);
            if f64::from(h.backoff) * BASE_EJECTION_MS < MAX_EJECTION_MS + BASE_EJECTION_MS {
                h.backoff += 1;
            }
        }
    }

    /// A round of active health checks: `checks` what each region answered
    /// now, `healthy` the health it gave. A passing check of a host that is
    /// not failing its checks un-ejects it. Then the outlier sweeps due by
    /// `now_ms` (every 10 s from the start).
    pub fn tick(&mut self, now_ms: f64, checks: &[bool], healthy: &[bool]) {
        for r in 0..self.hosts.len() {
            let passed =
                checks.get(r).copied().unwrap_or(false) && healthy.get(r).copied().unwrap_or(false);
            if passed && self.ejected(r) {
                self.uneject(r, now_ms);
            }
        }
        while self.next_sweep_ms <= now_ms {
            let at = self.next_sweep_ms;
            for r in 0..self.hosts.len() {
                let due = self.hosts.get(r).and_then(|h| {
                    let t = h.ejected_at?;
                    let ban = (BASE_EJECTION_MS * f64::from(h.backoff)).min(MAX_EJECTION_MS);
                    Some(ban <= at - t)
                });
                if due == Some(true) {
                    self.uneject(r, at);
                }
            }
            for h in &mut self.hosts {
                let settled =
                    h.ejected_at.is_none() && h.unejected_at.is_some_and(|u| at - u >= INTERVAL_MS);
                if settled && h.backoff > 0 {
                    h.backoff -= 1;
                }
            }
            self.next_sweep_ms += INTERVAL_MS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct State {
        names: Vec<String>,
        healthy: Vec<bool>,
        outstanding: Vec<u64>,
        rtt: Vec<f64>,
    }

    impl State {
        /// Regions 10, 100, 200, ... ms away, all healthy and idle.
        fn new(regions: usize) -> Self {
            State {
                names: (0..regions).map(|r| format!("r{r}")).collect(),
                healthy: vec![true; regions],
                outstanding: vec![0; regions],
                rtt: (0..regions)
                    .map(|r| if r == 0 { 10.0 } else { 100.0 * r as f64 })
                    .collect(),
            }
        }

        fn view(&self) -> View<'_> {
            View {
                now_ms: 0.0,
                healthy: &self.healthy,
                outstanding: &self.outstanding,
                queued_tokens: &[],
                waiting: &[],
                kv_usage: &[],
                kv_blocks: &[],
                rtt_ms: &self.rtt,
                names: &self.names,
            }
        }
    }

    #[test]
    fn priority_zero_takes_everything_while_healthy_however_loaded() {
        let mut m = MeshDefault::new(3, 1);
        let mut s = State::new(3);
        s.outstanding = vec![500, 0, 0];
        for _ in 0..200 {
            assert_eq!(m.choose(&s.view()), 0);
        }
    }

    #[test]
    fn failover_spreads_by_least_request_over_all_other_regions() {
        let mut m = MeshDefault::new(3, 2);
        let mut s = State::new(3);
        s.healthy[0] = false;
        // Not the next nearest alone: both failover regions, the idle one
        // unless both draws hit the busy one (1/4).
        s.outstanding = vec![0, 9, 0];
        let mut picks = [0u32; 3];
        for _ in 0..4000 {
            picks[m.choose(&s.view())] += 1;
        }
        assert_eq!(picks[0], 0);
        assert!((2800..3200).contains(&picks[2]), "{picks:?}");
        // A failover region failing its checks too: the other one only.
        s.healthy[2] = false;
        assert!((0..100).all(|_| m.choose(&s.view()) == 1));
        // Nothing healthy: priority 0's region, where Envoy would answer 503.
        s.healthy = vec![false; 3];
        assert_eq!(m.choose(&s.view()), 0);
        // The level's health scales by 1.4: one healthy host of two is 70 %.
        assert_eq!((health(1, 2), health(3, 4), health(0, 1)), (70, 100, 0));
    }

    #[test]
    fn outlier_detection_ejects_only_within_ten_percent_of_the_hosts() {
        // Three regions: a fourth of them is over 10 %: never ejected, the
        // failing nearest region keeps its traffic until its checks fail.
        let mut m = MeshDefault::new(3, 3);
        let s = State::new(3);
        for k in 0..20 {
            m.observe(0, false, f64::from(k));
        }
        assert!(!m.ejected(0));
        assert_eq!(m.choose(&s.view()), 0);
        // Ten regions: one is 10 %: the fifth error in a row ejects it (a
        // success in between starts the count over), a second host not.
        let mut m = MeshDefault::new(10, 3);
        let s = State::new(10);
        for ok in [false, false, false, false, true, false, false, false, false] {
            m.observe(0, ok, 1000.0);
        }
        assert!(!m.ejected(0));
        m.observe(0, false, 1000.0);
        assert!(m.ejected(0));
        assert_ne!(m.choose(&s.view()), 0);
        for _ in 0..5 {
            m.observe(1, false, 1000.0);
        }
        assert!(!m.ejected(1));
        // Its checks still pass: the next round un-ejects it.
        let all = vec![true; 10];
        m.tick(2000.0, &all, &all);
        assert!(!m.ejected(0));
        assert_eq!(m.choose(&s.view()), 0);
        // Ejected again while its checks fail: 30 s × 2 (its second
        // ejection within an interval of the first), swept every 10 s.
        for _ in 0..5 {
            m.observe(0, false, 3000.0);
        }
        let mut checks = all.clone();
        checks[0] = false;
        let mut healthy = all.clone();
        healthy[0] = false;
        m.tick(60_000.0, &checks, &healthy);
        assert!(m.ejected(0), "3 s + 60 s is not over at the 60 s sweep");
        m.tick(70_000.0, &checks, &healthy);
        assert!(!m.ejected(0));
    }
}
