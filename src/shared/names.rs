//! The protocol between the plugin's three roots (`probe`, `guard`,
//! `router`) and with Envoy: the shared-data keys, the shared queue, the
//! names of every stat (with the parts Envoy's tag extraction turns into
//! labels), the filter-state key and the properties the router reads. One
//! module owns them so that no root imports another's names, and so that
//! the host layer, the simulator and the tests agree by construction.

use crate::config::Config;
use crate::decision::cost::Reason;

/// Shared data: the fleet snapshot the probe publishes.
pub const SNAPSHOT_KEY: &str = "llm_geo_router.snapshot";
/// Shared data: which probe root context runs the loop (owner id + beat).
pub const LEASE_KEY: &str = "llm_geo_router.probe.lease";
/// Set once the running Envoy's version has been said (once per Envoy).
pub const ENVOY_VERSION_SAID_KEY: &str = "llm_geo_router.envoy_version_said";
/// Shared data: the operator's runtime ladder override (written by the
/// guard's operator endpoint): a level 0..=5, or empty for none.
pub const LADDER_OVERRIDE_KEY: &str = "llm_geo_router.ladder.override";
/// Shared data: prefix-directory slots (`<prefix><slot>`).
pub const DIRECTORY_KEY_PREFIX: &str = "llm_geo_router.dir.";
/// Shared data: this Envoy's latest prefills per region, not yet in the
/// snapshot's intake clock (`directory::RecentIntake`).
pub const INTAKE_KEY: &str = "llm_geo_router.intake";
/// Shared data: session slots (`<prefix><slot>`).
pub const SESSION_KEY_PREFIX: &str = "llm_geo_router.session.";
/// Shared data: stored responses' regions (`<prefix><slot>`).
pub const RESPONSES_KEY_PREFIX: &str = "llm_geo_router.responses.";

/// Shared queue that carries TTFT observations from the routers to the probe.
pub const OBSERVATIONS_QUEUE: &str = "llm_geo_router.observations";

/// Filter state key holding the decision text (Envoy prefixes `wasm.`, so
/// access logs read `%FILTER_STATE(wasm.llm_geo_router.decision:PLAIN)%`).
pub const DECISION_FILTER_STATE: &str = "llm_geo_router.decision";

/// Value of the pool header for the fallback pool.
pub const POOL_FALLBACK: &str = "fallback";

/// Endpoint metadata naming an upstream host's region.
pub const HOST_REGION_PROPERTY: [&str; 5] = [
    "xds",
    "upstream_host_metadata",
    "filter_metadata",
    "llm_geo_router",
    "region",
];
/// Envoy's response flags of the request (8 bytes, little endian).
pub const RESPONSE_FLAGS_PROPERTY: [&str; 2] = ["response", "flags"];
/// Envoy's response code details (text).
pub const CODE_DETAILS_PROPERTY: [&str; 2] = ["response", "code_details"];
/// Tries made upstream (8 bytes, little endian).
pub const ATTEMPTS_PROPERTY: [&str; 2] = ["upstream", "request_attempt_count"];

/// Prefix of every stat the plugin defines (Envoy shows them under
/// `wasmcustom.`).
pub const STAT_PREFIX: &str = "llm_geo_router";

/// Counter, gauge or histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatKind {
    Counter,
    Gauge,
    /// Envoy records whole numbers; the name says the unit.
    Histogram,
}

/// Stats of the whole plugin (no entity in the name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Global {
    Arrivals,
    GuardLevel,
    GuardInvalidRequest,
    GuardBodyWaitTimeout,
    RouterInvalidRequest,
    RouterPassthrough,
    RouterResidencyRejected,
    RouterContextRejected,
    RouterOutcomeUnattributed,
    RouterBodyWaitTimeout,
    RouterBodyUnreadable,
    GuardBodyUnreadable,
    RouterHeaderWriteFailed,
    GuardHeaderWriteFailed,
    QueueDropped,
    LadderLevel,
    LadderLevelChangedUnixS,
    LadderCapacityRatioPct,
    LadderDemandRps,
    LadderCapacityRps,
    LadderOverrideActive,
    AssessmentState,
    ProbeCallouts,
    ProbeTicks,
    ProbeSnapshotVersion,
    ProbeTickMs,
    TuningObservations,
    UsageReports,
    RouterUsageMissing,
    RouterResponsesRecorded,
    RouterResponseUnknown,
    RouterResponseHolderUnavailable,
    ExchangeSent,
    ExchangeSendFailed,
    ExchangeBytesSent,
    ExchangeReceived,
    ExchangeRefused,
    ExchangeMerged,
    ExchangeDuplicate,
    ExchangeDropped,
    ExchangePeers,
    ExchangeLagMs,
}

impl Global {
    pub const ALL: [Global; 42] = [
        Global::Arrivals,
        Global::GuardLevel,
        Global::GuardInvalidRequest,
        Global::GuardBodyWaitTimeout,
        Global::RouterInvalidRequest,
        Global::RouterPassthrough,
        Global::RouterResidencyRejected,
        Global::RouterContextRejected,
        Global::RouterOutcomeUnattributed,
        Global::RouterBodyWaitTimeout,
        Global::RouterBodyUnreadable,
        Global::GuardBodyUnreadable,
        Global::RouterHeaderWriteFailed,
        Global::GuardHeaderWriteFailed,
        Global::QueueDropped,
        Global::LadderLevel,
        Global::LadderLevelChangedUnixS,
        Global::LadderCapacityRatioPct,
        Global::LadderDemandRps,
        Global::LadderCapacityRps,
        Global::LadderOverrideActive,
        Global::AssessmentState,
        Global::ProbeCallouts,
        Global::ProbeTicks,
        Global::ProbeSnapshotVersion,
        Global::ProbeTickMs,
        Global::TuningObservations,
        Global::UsageReports,
        Global::RouterUsageMissing,
        Global::RouterResponsesRecorded,
        Global::RouterResponseUnknown,
        Global::RouterResponseHolderUnavailable,
        Global::ExchangeSent,
        Global::ExchangeSendFailed,
        Global::ExchangeBytesSent,
        Global::ExchangeReceived,
        Global::ExchangeRefused,
        Global::ExchangeMerged,
        Global::ExchangeDuplicate,
        Global::ExchangeDropped,
        Global::ExchangePeers,
        Global::ExchangeLagMs,
    ];

    fn spec(self) -> (&'static str, StatKind) {
        use StatKind::{Counter, Gauge};
        match self {
            Global::Arrivals => ("arrivals", Counter),
            Global::GuardLevel => ("guard.level", Gauge),
            Global::GuardInvalidRequest => ("guard.invalid_request", Counter),
            Global::GuardBodyWaitTimeout => ("guard.body_wait_timeout", Counter),
            Global::RouterInvalidRequest => ("router.invalid_request", Counter),
            Global::RouterPassthrough => ("router.passthrough", Counter),
            Global::RouterResidencyRejected => ("router.residency_rejected", Counter),
            Global::RouterContextRejected => ("router.context_rejected", Counter),
            Global::RouterOutcomeUnattributed => ("router.outcome_unattributed", Counter),
            Global::RouterBodyWaitTimeout => ("router.body_wait_timeout", Counter),
            Global::RouterBodyUnreadable => ("router.body_unreadable", Counter),
            Global::GuardBodyUnreadable => ("guard.body_unreadable", Counter),
            Global::RouterHeaderWriteFailed => ("router.header_write_failed", Counter),
            Global::GuardHeaderWriteFailed => ("guard.header_write_failed", Counter),
            Global::QueueDropped => ("queue.dropped", Counter),
            Global::LadderLevel => ("ladder.level", Gauge),
            Global::LadderLevelChangedUnixS => ("ladder.level_changed_unix_s", Gauge),
            Global::LadderCapacityRatioPct => ("ladder.capacity_ratio_pct", Gauge),
            Global::LadderDemandRps => ("ladder.demand_rps", Gauge),
            Global::LadderCapacityRps => ("ladder.capacity_rps", Gauge),
            Global::LadderOverrideActive => ("ladder.override_active", Gauge),
            Global::AssessmentState => ("assessment.state", Gauge),
            Global::ProbeCallouts => ("probe.callouts", Counter),
            Global::ProbeTicks => ("probe.ticks", Counter),
            Global::ProbeSnapshotVersion => ("probe.snapshot_version", Gauge),
            Global::ProbeTickMs => ("probe.tick_ms", Gauge),
            Global::TuningObservations => ("tuning.observations", Counter),
            Global::UsageReports => ("usage.reports", Counter),
            Global::RouterUsageMissing => ("router.usage_missing", Counter),
            Global::RouterResponsesRecorded => ("router.responses_recorded", Counter),
            Global::RouterResponseUnknown => ("router.response_unknown", Counter),
            Global::RouterResponseHolderUnavailable => {
                ("router.response_holder_unavailable", Counter)
            }
            Global::ExchangeSent => ("exchange.sent", Counter),
            Global::ExchangeSendFailed => ("exchange.send_failed", Counter),
            Global::ExchangeBytesSent => ("exchange.bytes_sent", Counter),
            Global::ExchangeReceived => ("exchange.received", Counter),
            Global::ExchangeRefused => ("exchange.refused", Counter),
            Global::ExchangeMerged => ("exchange.merged", Counter),
            Global::ExchangeDuplicate => ("exchange.duplicate", Counter),
            Global::ExchangeDropped => ("exchange.dropped", Counter),
            Global::ExchangePeers => ("exchange.peers", Gauge),
            Global::ExchangeLagMs => ("exchange.lag_ms", Gauge),
        }
    }
}

/// Stats per region (`llm_geo_router.region.<region>.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionStat {
    /// Requests the router sent to the region.
    RqTotal,
    /// Requests in flight to the region from this Envoy (all workers).
    RqActive,
    FallbackRqTotal,
    UpstreamFailure,
    UpstreamRqAnswered,
    ClientCancelled,
    Healthy,
    RttMs,
    EngineWaiting,
    EngineRunning,
    EngineKvUsagePct,
    HealthProbeFailure,
    MetricsScrapeFailure,
    PrefillUsPerToken,
    PrefillMsPerRequest,
    HealthProbeBusy,
    TokensPerKib,
    CacheHorizonMs,
    CacheReliabilityPct,
    CacheBeliefRefuted,
    MaxModelLen,
    ModelsReadFailure,
    Replicas,
    CacheCapacityTokens,
    CacheCapacityRejected,
    /// Restarts of the region's engine the probe saw (`fleet::restart`).
    EngineRestart,
    /// Tokens per block of the region's engine cache (0: not known).
    CacheBlockTokens,
    /// Requests in flight to the region from the other Envoys of the
    /// deployment, as their last exchange messages said.
    PeerRqActive,
}

impl RegionStat {
    pub const ALL: [RegionStat; 28] = [
        RegionStat::RqTotal,
        RegionStat::RqActive,
        RegionStat::FallbackRqTotal,
        RegionStat::UpstreamFailure,
        RegionStat::UpstreamRqAnswered,
        RegionStat::ClientCancelled,
        RegionStat::Healthy,
        RegionStat::RttMs,
        RegionStat::EngineWaiting,
        RegionStat::EngineRunning,
        RegionStat::EngineKvUsagePct,
        RegionStat::HealthProbeFailure,
        RegionStat::MetricsScrapeFailure,
        RegionStat::PrefillUsPerToken,
        RegionStat::PrefillMsPerRequest,
        RegionStat::HealthProbeBusy,
        RegionStat::TokensPerKib,
        RegionStat::CacheHorizonMs,
        RegionStat::CacheReliabilityPct,
        RegionStat::CacheBeliefRefuted,
        RegionStat::MaxModelLen,
        RegionStat::ModelsReadFailure,
        RegionStat::Replicas,
        RegionStat::CacheCapacityTokens,
        RegionStat::CacheCapacityRejected,
        RegionStat::EngineRestart,
        RegionStat::CacheBlockTokens,
        RegionStat::PeerRqActive,
    ];

    fn spec(self) -> (&'static str, StatKind) {
        use StatKind::{Counter, Gauge};
        match self {
            RegionStat::RqTotal => ("rq_total", Counter),
            RegionStat::RqActive => ("rq_active", Gauge),
            RegionStat::FallbackRqTotal => ("fallback_rq_total", Counter),
            RegionStat::UpstreamFailure => ("upstream_failure", Counter),
            RegionStat::UpstreamRqAnswered => ("upstream_rq_answered", Counter),
            RegionStat::ClientCancelled => ("client_cancelled", Counter),
            RegionStat::Healthy => ("healthy", Gauge),
            RegionStat::RttMs => ("rtt_ms", Gauge),
            RegionStat::EngineWaiting => ("engine_waiting", Gauge),
            RegionStat::EngineRunning => ("engine_running", Gauge),
            RegionStat::EngineKvUsagePct => ("engine_kv_usage_pct", Gauge),
            RegionStat::HealthProbeFailure => ("health_probe_failure", Counter),
            RegionStat::MetricsScrapeFailure => ("metrics_scrape_failure", Counter),
            RegionStat::PrefillUsPerToken => ("prefill_us_per_token", Gauge),
            RegionStat::PrefillMsPerRequest => ("prefill_ms_per_request", Gauge),
            RegionStat::HealthProbeBusy => ("health_probe_busy", Counter),
            RegionStat::TokensPerKib => ("tokens_per_kib", Gauge),
            RegionStat::CacheHorizonMs => ("prefix_horizon_ms", Gauge),
            RegionStat::CacheReliabilityPct => ("prefix_reliability_pct", Gauge),
            RegionStat::CacheBeliefRefuted => ("prefix_belief_refuted", Counter),
            RegionStat::MaxModelLen => ("max_model_len", Gauge),
            RegionStat::Replicas => ("replicas", Gauge),
            RegionStat::ModelsReadFailure => ("models_read_failure", Counter),
            RegionStat::CacheCapacityTokens => ("kv_capacity_tokens", Gauge),
            RegionStat::CacheCapacityRejected => ("kv_capacity_rejected", Counter),
            RegionStat::EngineRestart => ("engine_restart", Counter),
            RegionStat::CacheBlockTokens => ("kv_block_tokens", Gauge),
            RegionStat::PeerRqActive => ("peer_rq_active", Gauge),
        }
    }
}

/// Why a request the router sent to a region failed (OpenTelemetry's
/// `error.type` on `gen_ai.server.request.duration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorType {
    /// The engine answered 4xx.
    Upstream4xx,
    /// The engine (or a proxy in front of it) answered 5xx.
    Upstream5xx,
    /// No answer: reset, refused connection, timeout.
    UpstreamFailure,
    /// The client left before the answer ended.
    Cancelled,
}

impl ErrorType {
    pub const ALL: [ErrorType; 4] = [
        ErrorType::Upstream4xx,
        ErrorType::Upstream5xx,
        ErrorType::UpstreamFailure,
        ErrorType::Cancelled,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ErrorType::Upstream4xx => "upstream_4xx",
            ErrorType::Upstream5xx => "upstream_5xx",
            ErrorType::UpstreamFailure => "upstream_failure",
            ErrorType::Cancelled => "cancelled",
        }
    }
}

/// `gen_ai.token.type`: the conventions' `input` and `output`, and
/// `cached_input` (the part of the input the engine's cache served, as
/// Envoy AI Gateway names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Input,
    Output,
    CachedInput,
}

impl TokenType {
    pub const ALL: [TokenType; 3] = [TokenType::Input, TokenType::Output, TokenType::CachedInput];

    pub fn name(self) -> &'static str {
        match self {
            TokenType::Input => "input",
            TokenType::Output => "output",
            TokenType::CachedInput => "cached_input",
        }
    }
}

/// Distributions per region, recorded by the router. The OpenTelemetry
/// GenAI ones are named as Prometheus maps those conventions (dots to
/// underscores, the unit as a suffix), with the region as `cloud.region`
/// (an OpenTelemetry resource attribute) through Envoy's tag extraction;
/// the router's own error is the plugin's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionHistogram {
    /// Request headers to the answer's first body byte, for a successful
    /// stream (`gen_ai.server.time_to_first_token`), in ms.
    TimeToFirstToken,
    /// First byte to the last, per output token after the first, for a
    /// successful stream whose usage was read
    /// (`gen_ai.server.time_per_output_token`), in µs.
    TimePerOutputToken,
    /// Request headers to the end of the answer, for a successful request
    /// (`gen_ai.server.request.duration`), in ms.
    RequestDuration,
    /// The same for a failed one, by `error.type`.
    RequestDurationFailed(ErrorType),
    /// Tokens of a successful answer's usage (`gen_ai.client.token.usage`).
    TokenUsage(TokenType),
    /// Observed TTFT minus the TTFT the router expected of the region it
    /// chose, when observed is the larger (the router was optimistic), ms.
    TtftErrorLate,
    /// Expected minus observed, when the router was pessimistic, ms.
    TtftErrorEarly,
}

impl RegionHistogram {
    pub const ALL: [RegionHistogram; 12] = [
        RegionHistogram::TimeToFirstToken,
        RegionHistogram::TimePerOutputToken,
        RegionHistogram::RequestDuration,
        RegionHistogram::RequestDurationFailed(ErrorType::Upstream4xx),
        RegionHistogram::RequestDurationFailed(ErrorType::Upstream5xx),
        RegionHistogram::RequestDurationFailed(ErrorType::UpstreamFailure),
        RegionHistogram::RequestDurationFailed(ErrorType::Cancelled),
        RegionHistogram::TokenUsage(TokenType::Input),
        RegionHistogram::TokenUsage(TokenType::Output),
        RegionHistogram::TokenUsage(TokenType::CachedInput),
        RegionHistogram::TtftErrorLate,
        RegionHistogram::TtftErrorEarly,
    ];

    /// The name the plugin defines for `region`.
    fn name(self, region: &str) -> String {
        match self {
            RegionHistogram::TimeToFirstToken => {
                format!("gen_ai.server.time_to_first_token_milliseconds.region.{region}")
            }
            RegionHistogram::TimePerOutputToken => {
                format!("gen_ai.server.time_per_output_token_microseconds.region.{region}")
            }
            RegionHistogram::RequestDuration => {
                format!("gen_ai.server.request.duration_milliseconds.region.{region}")
            }
            RegionHistogram::RequestDurationFailed(e) => format!(
                "gen_ai.server.request.duration_milliseconds.region.{region}.error_type.{}",
                e.name()
            ),
            RegionHistogram::TokenUsage(t) => format!(
                "gen_ai.client.token.usage.region.{region}.token_type.{}",
                t.name()
            ),
            RegionHistogram::TtftErrorLate => {
                format!("{STAT_PREFIX}.region.{region}.ttft_error_milliseconds.late")
            }
            RegionHistogram::TtftErrorEarly => {
                format!("{STAT_PREFIX}.region.{region}.ttft_error_milliseconds.early")
            }
        }
    }
}

/// Stats per tier (`llm_geo_router.guard.tier.<tier>.<name>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierStat {
    Shed,
    PromptTooLong,
    MaxTokensClamped,
    Fallback,
}

impl TierStat {
    pub const ALL: [TierStat; 4] = [
        TierStat::Shed,
        TierStat::PromptTooLong,
        TierStat::MaxTokensClamped,
        TierStat::Fallback,
    ];

    fn name(self) -> &'static str {
        match self {
            TierStat::Shed => "shed",
            TierStat::PromptTooLong => "prompt_too_long",
            TierStat::MaxTokensClamped => "max_tokens_clamped",
            TierStat::Fallback => "fallback",
        }
    }
}

/// One stat of the plugin. Regions and tiers are indices into the
/// configuration's `regions` and `tiers.names`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stat {
    Global(Global),
    Region(usize, RegionStat),
    Tier(usize, TierStat),
    /// Routing decisions by reason (`router.decision.<reason>`).
    Decision(Reason),
    /// The same by chosen region (`region.<region>.decision.<reason>`).
    RegionDecision(usize, Reason),
    /// A distribution of the region's requests.
    RegionHistogram(usize, RegionHistogram),
}

impl Stat {
    pub fn kind(self) -> StatKind {
        match self {
            Stat::Global(g) => g.spec().1,
            Stat::Region(_, r) => r.spec().1,
            Stat::Tier(..) | Stat::Decision(_) | Stat::RegionDecision(..) => StatKind::Counter,
            Stat::RegionHistogram(..) => StatKind::Histogram,
        }
    }

    /// The name the plugin defines (Envoy adds `wasmcustom.`); `None` for a
    /// region or tier index the configuration does not have.
    pub fn name(self, cfg: &Config) -> Option<String> {
        let region = |i: usize| cfg.regions.get(i).map(|r| r.name.as_str());
        Some(match self {
            Stat::Global(g) => format!("{STAT_PREFIX}.{}", g.spec().0),
            Stat::Region(i, r) => format!("{STAT_PREFIX}.region.{}.{}", region(i)?, r.spec().0),
            Stat::Tier(i, t) => format!(
                "{STAT_PREFIX}.guard.tier.{}.{}",
                cfg.tiers.names.get(i)?,
                t.name()
            ),
            Stat::Decision(r) => format!("{STAT_PREFIX}.router.decision.{}", r.stat_name()),
            Stat::RegionDecision(i, r) => format!(
                "{STAT_PREFIX}.region.{}.decision.{}",
                region(i)?,
                r.stat_name()
            ),
            Stat::RegionHistogram(i, h) => h.name(region(i)?),
        })
    }

    /// Every stat of a configuration.
    pub fn all(cfg: &Config) -> Vec<Stat> {
        let regions = cfg.regions.len();
        let mut out: Vec<Stat> = Global::ALL.iter().map(|g| Stat::Global(*g)).collect();
        for i in 0..regions {
            out.extend(RegionStat::ALL.iter().map(|r| Stat::Region(i, *r)));
            out.extend(Reason::ALL.iter().map(|r| Stat::RegionDecision(i, *r)));
            out.extend(
                RegionHistogram::ALL
                    .iter()
                    .map(|h| Stat::RegionHistogram(i, *h)),
            );
        }
        for i in 0..cfg.tiers.names.len() {
            out.extend(TierStat::ALL.iter().map(|t| Stat::Tier(i, *t)));
        }
        out.extend(Reason::ALL.iter().map(|r| Stat::Decision(*r)));
        out
    }
}

/// A handle per stat of one configuration, found in O(1): what the host
/// layer keeps (Envoy metric ids) and what tests keep (values).
#[derive(Debug, Clone)]
pub struct StatTable<M> {
    regions: usize,
    tiers: usize,
    slots: Vec<M>,
}

const REGION_SLOTS: usize = RegionStat::ALL.len() + Reason::ALL.len() + RegionHistogram::ALL.len();

fn pos<T: PartialEq + Copy>(all: &[T], x: T) -> usize {
    all.iter().position(|y| *y == x).unwrap_or(0)
}

impl<M> StatTable<M> {
    /// One handle per stat, made by `define(stat, name, kind)`.
    pub fn new(cfg: &Config, mut define: impl FnMut(Stat, &str, StatKind) -> M) -> Self {
        let mut table = StatTable {
            regions: cfg.regions.len(),
            tiers: cfg.tiers.names.len(),
            slots: Vec::new(),
        };
        let mut stats = Stat::all(cfg);
        stats.sort_by_key(|s| table.index(*s));
        table.slots = stats
            .into_iter()
            .map(|s| define(s, &s.name(cfg).unwrap_or_default(), s.kind()))
            .collect();
        table
    }

    fn index(&self, stat: Stat) -> usize {
        let region_base = Global::ALL.len();
        let tier_base = region_base + self.regions * REGION_SLOTS;
        let decision_base = tier_base + self.tiers * TierStat::ALL.len();
        match stat {
            Stat::Global(g) => pos(&Global::ALL, g),
            Stat::Region(i, r) => region_base + i * REGION_SLOTS + pos(&RegionStat::ALL, r),
            Stat::RegionDecision(i, r) => {
                region_base + i * REGION_SLOTS + RegionStat::ALL.len() + pos(&Reason::ALL, r)
            }
            Stat::RegionHistogram(i, h) => {
                region_base
                    + i * REGION_SLOTS
                    + RegionStat::ALL.len()
                    + Reason::ALL.len()
                    + pos(&RegionHistogram::ALL, h)
            }
            Stat::Tier(i, t) => tier_base + i * TierStat::ALL.len() + pos(&TierStat::ALL, t),
            Stat::Decision(r) => decision_base + pos(&Reason::ALL, r),
        }
    }

    /// The handle of `stat`; `None` for a region or tier out of range.
    fn in_range(&self, stat: Stat) -> bool {
        match stat {
            Stat::Region(i, _) | Stat::RegionDecision(i, _) | Stat::RegionHistogram(i, _) => {
                i < self.regions
            }
            Stat::Tier(i, _) => i < self.tiers,
            Stat::Global(_) | Stat::Decision(_) => true,
        }
    }

    pub fn get(&self, stat: Stat) -> Option<&M> {
        self.in_range(stat)
            .then(|| self.slots.get(self.index(stat)))?
    }

    pub fn get_mut(&mut self, stat: Stat) -> Option<&mut M> {
        let at = self.in_range(stat).then(|| self.index(stat))?;
        self.slots.get_mut(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[{"name":"near","cluster":"a","capacity_rps":1},
                            {"name":"far","cluster":"b","capacity_rps":1}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn names_are_the_documented_ones() {
        let c = cfg();
        let n = |s: Stat| s.name(&c).unwrap();
        assert_eq!(
            n(Stat::Region(1, RegionStat::RqActive)),
            "llm_geo_router.region.far.rq_active"
        );
        assert_eq!(
            n(Stat::Tier(2, TierStat::MaxTokensClamped)),
            "llm_geo_router.guard.tier.critical.max_tokens_clamped"
        );
        assert_eq!(
            n(Stat::RegionDecision(0, Reason::LoadOverride)),
            "llm_geo_router.region.near.decision.load_override"
        );
        assert_eq!(
            n(Stat::Decision(Reason::Cache)),
            "llm_geo_router.router.decision.cache"
        );
        assert_eq!(
            n(Stat::Global(Global::ProbeTicks)),
            "llm_geo_router.probe.ticks"
        );
        assert_eq!(
            n(Stat::RegionHistogram(1, RegionHistogram::TimeToFirstToken)),
            "gen_ai.server.time_to_first_token_milliseconds.region.far"
        );
        assert_eq!(
            n(Stat::RegionHistogram(
                0,
                RegionHistogram::TokenUsage(TokenType::CachedInput)
            )),
            "gen_ai.client.token.usage.region.near.token_type.cached_input"
        );
        assert_eq!(
            n(Stat::RegionHistogram(
                0,
                RegionHistogram::RequestDurationFailed(ErrorType::Upstream5xx)
            )),
            "gen_ai.server.request.duration_milliseconds.region.near.error_type.upstream_5xx"
        );
        assert_eq!(
            n(Stat::RegionHistogram(1, RegionHistogram::TtftErrorEarly)),
            "llm_geo_router.region.far.ttft_error_milliseconds.early"
        );
        assert_eq!(
            Stat::RegionHistogram(0, RegionHistogram::RequestDuration).kind(),
            StatKind::Histogram
        );
        assert_eq!(Stat::Region(2, RegionStat::RttMs).name(&c), None);
        assert_eq!(Stat::Global(Global::LadderLevel).kind(), StatKind::Gauge);
    }

    #[test]
    fn every_error_and_token_type_has_its_histogram() {
        for e in ErrorType::ALL {
            assert!(RegionHistogram::ALL.contains(&RegionHistogram::RequestDurationFailed(e)));
        }
        for t in TokenType::ALL {
            assert!(RegionHistogram::ALL.contains(&RegionHistogram::TokenUsage(t)));
        }
    }

    #[test]
    fn the_table_finds_every_stat_once() {
        let c = cfg();
        let table = StatTable::new(&c, |s, name, _| (s, name.to_string()));
        let all = Stat::all(&c);
        let mut names = std::collections::BTreeSet::new();
        for s in &all {
            let (stat, name) = table.get(*s).unwrap();
            assert_eq!(stat, s);
            assert_eq!(Some(name.clone()), s.name(&c));
            assert!(names.insert(name.clone()), "{name} twice");
        }
        assert_eq!(names.len(), all.len());
        assert!(table.get(Stat::Region(2, RegionStat::RqTotal)).is_none());
        assert!(table.get(Stat::Tier(3, TierStat::Shed)).is_none());
    }
}
