//! What a finished request says about the regions that handled it. Envoy
//! tells, in the stream info a filter reads at `on_log`, how the request
//! ended (its response flags, status and code details), how many tries it
//! took and which upstream host served the last one. From that this module
//! decides, for each region involved, whether its engines failed, answered,
//! or had the request taken away by the client.
//!
//! A client that gives up is never evidence against a region: the busiest
//! region is the one whose users press "stop" first, and ejecting it for
//! that would push its load onto the next region (the seed's thundering
//! herd). Only what the upstream side did counts as a failure.

/// Envoy's response flags as the `response.flags` property gives them: the
/// bit of each `StreamInfo::CoreResponseFlag`, by its position in that enum
/// (stable since Envoy 1.8; verified on 1.40: `UT` = 0x4, `DC` = 0x4000).
pub mod flags {
    /// `UH`: no healthy upstream host in the cluster.
    pub const NO_HEALTHY_UPSTREAM: u64 = 1 << 1;
    /// `UT`: upstream request timeout, including `per_try_idle_timeout`.
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 1 << 2;
    /// `UR`: upstream remote reset.
    pub const UPSTREAM_REMOTE_RESET: u64 = 1 << 4;
    /// `UF`: upstream connection failure.
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 1 << 5;
    /// `UC`: upstream connection termination.
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 1 << 6;
    /// `UO`: upstream overflow (circuit breaker).
    pub const UPSTREAM_OVERFLOW: u64 = 1 << 7;
    /// `DC`: downstream connection termination (the client went away).
    pub const DOWNSTREAM_CONNECTION_TERMINATION: u64 = 1 << 14;
    /// `URX`: the upstream retry limit was exceeded.
    pub const UPSTREAM_RETRY_LIMIT_EXCEEDED: u64 = 1 << 15;
    /// `UPE`: the upstream answered something that is not HTTP.
    pub const UPSTREAM_PROTOCOL_ERROR: u64 = 1 << 23;
    /// `DR`: downstream remote reset (an HTTP/2 or HTTP/3 client cancelled
    /// its stream).
    pub const DOWNSTREAM_REMOTE_RESET: u64 = 1 << 28;

    /// Flags that mean the upstream side failed.
    pub const UPSTREAM_FAILURE: u64 = NO_HEALTHY_UPSTREAM
        | UPSTREAM_REQUEST_TIMEOUT
        | UPSTREAM_REMOTE_RESET
        | UPSTREAM_CONNECTION_FAILURE
        | UPSTREAM_CONNECTION_TERMINATION
        | UPSTREAM_OVERFLOW
        | UPSTREAM_RETRY_LIMIT_EXCEEDED
        | UPSTREAM_PROTOCOL_ERROR;

    /// Flags that mean the client went away.
    pub const CLIENT_GONE: u64 = DOWNSTREAM_CONNECTION_TERMINATION | DOWNSTREAM_REMOTE_RESET;
}

/// `response.code_details` of a response an upstream sent.
pub const VIA_UPSTREAM: &str = "via_upstream";

/// How one routed request ended, as read from Envoy at `on_log`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ending {
    /// `response.flags` (0 when Envoy gave none).
    pub flags: u64,
    /// `response.code`: the status sent to the client, if any was.
    pub status: Option<u32>,
    /// `response.code_details` was `via_upstream`: the status came from an
    /// engine, not from Envoy or a filter. Only read for a 5xx without an
    /// upstream flag; `None` when not read.
    pub via_upstream: Option<bool>,
    /// `upstream.request_attempt_count`: tries made (0 or 1: no retry).
    pub attempts: u32,
    /// The region the last try's host belongs to, from its endpoint
    /// metadata (`llm_geo_router.region`), when it names a configured one.
    pub host_region: Option<usize>,
}

/// What one finished request charges to which region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// The first try failed in this region and was retried (a failure of
    /// the region first chosen, whatever happened next).
    pub retried_from: Option<usize>,
    /// The region the last try went to; `None` when a retry went to a host
    /// whose region is unknown (no endpoint metadata).
    pub served: Option<usize>,
    /// The last try failed on the upstream side.
    pub failed: bool,
    /// The last try's engine answered (a status below 500 reached it, or the
    /// client left after its answer had started).
    pub answered: bool,
    /// The client went away before the response was complete.
    pub cancelled: bool,
}

impl Ending {
    /// Classify the ending of a request the router sent to region `routed`.
    pub fn outcome(&self, routed: usize) -> Outcome {
        let retried = self.attempts > 1;
        // Without metadata the first try's host is the routed region's (the
        // region's own endpoints come first in its cluster); a retry's host
        // is unknown.
        let served = self.host_region.or((!retried).then_some(routed));
        let upstream_flag = self.flags & flags::UPSTREAM_FAILURE != 0;
        let client_gone = self.flags & flags::CLIENT_GONE != 0;
        let engine_5xx = !upstream_flag
            && self.status.is_some_and(|s| (500..600).contains(&s))
            && self.via_upstream == Some(true);
        let failed = upstream_flag || engine_5xx;
        // A status that came from the engine (not a local reply) while the
        // client was still there, or before it left.
        let engine_status = self
            .status
            .is_some_and(|s| s < 500 && (self.flags == 0 || client_gone));
        let answered = !failed && engine_status;
        Outcome {
            retried_from: retried.then_some(routed),
            served,
            failed,
            answered,
            cancelled: client_gone && !failed,
        }
    }

    /// The `response.code_details` read is needed to tell an engine's 5xx
    /// from one Envoy or a filter made: only for a 5xx without an upstream
    /// flag.
    pub fn needs_details(&self) -> bool {
        self.flags & flags::UPSTREAM_FAILURE == 0
            && self.status.is_some_and(|s| (500..600).contains(&s))
    }
}

/// Per-region tallies of outcomes, as the routers count them and the probe
/// reads them (one stat each per region in the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    /// Tries the region's engines failed.
    pub failures: u64,
    /// Requests the region's engines answered.
    pub answered: u64,
    /// Requests whose client went away while the region had them.
    pub cancelled: u64,
}

impl Outcome {
    /// What to add to which region's tallies: the first try's failure when
    /// it was retried, then the last try's outcome (at most two entries; the
    /// same region may appear twice).
    pub fn charges(&self) -> [Option<(usize, Tally)>; 2] {
        let first = self.retried_from.map(|r| {
            (
                r,
                Tally {
                    failures: 1,
                    ..Tally::default()
                },
            )
        });
        let last = self.served.map(|r| {
            (
                r,
                Tally {
                    failures: u64::from(self.failed),
                    answered: u64::from(self.answered),
                    cancelled: u64::from(self.cancelled),
                },
            )
        });
        [first, last]
    }

    /// The last try said something about a region that cannot be named (a
    /// retry to a host without region metadata).
    pub fn unattributed(&self) -> bool {
        self.served.is_none() && (self.failed || self.answered || self.cancelled)
    }

    /// Apply to per-region tallies (index = region).
    pub fn apply(&self, tallies: &mut [Tally]) {
        for (region, add) in self.charges().into_iter().flatten() {
            if let Some(t) = tallies.get_mut(region) {
                t.failures += add.failures;
                t.answered += add.answered;
                t.cancelled += add.cancelled;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::flags::*;
    use super::*;

    const NEAR: usize = 0;
    const MID: usize = 1;

    fn ending(flags: u64, status: Option<u32>) -> Ending {
        Ending {
            flags,
            status,
            via_upstream: None,
            attempts: 1,
            host_region: Some(NEAR),
        }
    }

    #[test]
    fn a_client_cancellation_is_never_a_failure() {
        // Cancelled before the first byte: no status at all.
        let o = ending(DOWNSTREAM_CONNECTION_TERMINATION, None).outcome(NEAR);
        assert!(o.cancelled && !o.failed && !o.answered, "{o:?}");
        // An HTTP/2 client resetting its stream.
        let o = ending(DOWNSTREAM_REMOTE_RESET, None).outcome(NEAR);
        assert!(o.cancelled && !o.failed);
        // Cancelled mid-stream: the engine had answered.
        let o = ending(DOWNSTREAM_CONNECTION_TERMINATION, Some(200)).outcome(NEAR);
        assert!(o.cancelled && o.answered && !o.failed, "{o:?}");
        let mut t = [Tally::default(); 2];
        for _ in 0..20 {
            ending(DOWNSTREAM_CONNECTION_TERMINATION, None)
                .outcome(NEAR)
                .apply(&mut t);
        }
        assert_eq!(
            t[NEAR],
            Tally {
                failures: 0,
                answered: 0,
                cancelled: 20
            }
        );
    }

    #[test]
    fn upstream_flags_and_engine_5xx_are_failures() {
        for f in [
            NO_HEALTHY_UPSTREAM,
            UPSTREAM_REQUEST_TIMEOUT,
            UPSTREAM_REMOTE_RESET,
            UPSTREAM_CONNECTION_FAILURE,
            UPSTREAM_CONNECTION_TERMINATION,
            UPSTREAM_OVERFLOW,
            UPSTREAM_RETRY_LIMIT_EXCEEDED,
            UPSTREAM_PROTOCOL_ERROR,
        ] {
            let o = ending(f, Some(504)).outcome(NEAR);
            assert!(o.failed && !o.answered && !o.cancelled, "{f:#x}: {o:?}");
            // A reset after the stream started, then the client left too.
            let o = ending(f | DOWNSTREAM_CONNECTION_TERMINATION, Some(200)).outcome(NEAR);
            assert!(o.failed && !o.cancelled, "{f:#x}: {o:?}");
        }
        // An engine's own 500 (no flag; code details via_upstream).
        let mut e = ending(0, Some(500));
        assert!(e.needs_details());
        e.via_upstream = Some(true);
        let o = e.outcome(NEAR);
        assert!(o.failed && !o.answered);
        // A 503 Envoy or a filter made without touching the upstream (no
        // cluster, a local reply) says nothing about the region.
        e.via_upstream = Some(false);
        let o = e.outcome(NEAR);
        assert!(!o.failed && !o.answered && !o.cancelled);
        // Engine 4xx: answered, not failed (the request was wrong).
        let o = ending(0, Some(400)).outcome(NEAR);
        assert!(o.answered && !o.failed);
        assert!(!ending(0, Some(400)).needs_details());
        assert!(!ending(UPSTREAM_REQUEST_TIMEOUT, Some(504)).needs_details());
    }

    #[test]
    fn a_retry_charges_the_first_region_a_failure_and_the_second_the_outcome() {
        let e = Ending {
            flags: 0,
            status: Some(200),
            via_upstream: None,
            attempts: 2,
            host_region: Some(MID),
        };
        let o = e.outcome(NEAR);
        assert_eq!((o.retried_from, o.served), (Some(NEAR), Some(MID)));
        assert!(o.answered);
        let mut t = [Tally::default(); 2];
        o.apply(&mut t);
        assert!(!o.unattributed());
        assert_eq!((t[NEAR].failures, t[NEAR].answered), (1, 0));
        assert_eq!((t[MID].failures, t[MID].answered), (0, 1));
        // All tries failed: the first and the last region each get one.
        let mut t = [Tally::default(); 2];
        Ending {
            flags: UPSTREAM_CONNECTION_FAILURE | UPSTREAM_RETRY_LIMIT_EXCEEDED,
            status: Some(503),
            ..e
        }
        .outcome(NEAR)
        .apply(&mut t);
        assert_eq!((t[NEAR].failures, t[MID].failures), (1, 1));
        // A retry to a host without region metadata: the first try is
        // still charged; the rest cannot be.
        let mut t = [Tally::default(); 2];
        let o = Ending {
            host_region: None,
            ..e
        }
        .outcome(NEAR);
        assert_eq!(o.served, None);
        assert!(o.unattributed());
        o.apply(&mut t);
        assert_eq!(t[NEAR].failures, 1);
        assert_eq!(t[MID], Tally::default());
    }

    #[test]
    fn without_metadata_the_first_try_is_the_routed_regions() {
        let o = Ending {
            host_region: None,
            ..ending(0, Some(200))
        }
        .outcome(MID);
        assert_eq!(o.served, Some(MID));
        assert!(o.answered);
        // Metadata wins: a first try that landed on another region's host
        // (the operator's health checks moved it) is that region's.
        let o = Ending {
            host_region: Some(NEAR),
            ..ending(0, Some(200))
        }
        .outcome(MID);
        assert_eq!(o.served, Some(NEAR));
    }

    #[test]
    fn an_ending_without_evidence_charges_nothing() {
        // No status, no flags (e.g. a filter stopped the stream).
        let o = ending(0, None).outcome(NEAR);
        assert!(!o.failed && !o.answered && !o.cancelled);
        let mut t = [Tally::default(); 1];
        o.apply(&mut t);
        assert!(!o.unattributed());
        assert_eq!(t[0], Tally::default());
    }
}
