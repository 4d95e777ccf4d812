//! The sections the probe works by: its rounds, health thresholds and
//! ejection (`probe`), release parity, the declare-disaster rule, and the
//! context limits it reads from each region.

use serde::Deserialize;

/// Where a region's release digest is read from.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseSource {
    /// A header of the health response (`name` is the header).
    #[default]
    HealthHeader,
    /// A field of the health response's JSON body (`name` is the field).
    HealthJson,
    /// A label of a `/metrics` series (`name` is `metric/label`).
    MetricsLabel,
}

impl ReleaseSource {
    /// As the configuration spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseSource::HealthHeader => "health_header",
            ReleaseSource::HealthJson => "health_json",
            ReleaseSource::MetricsLabel => "metrics_label",
        }
    }
}

/// Release parity: every region must serve the expected release (the digest
/// of its release manifest). A region that does not gets no new traffic;
/// a region that becomes routable again is ramped back in, not stampeded.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ReleaseConfig {
    /// The digest every region must report. Absent: parity is not checked.
    pub expected: Option<String>,
    pub source: ReleaseSource,
    /// Header name, JSON field, or `metric/label`, per `source`.
    pub name: String,
    /// Seconds over which a region that becomes routable again (healthy and
    /// on the expected release) ramps from 0 to its full share of new
    /// requests. 0: at once.
    pub ramp_s: f64,
}

impl Default for ReleaseConfig {
    fn default() -> Self {
        ReleaseConfig {
            expected: None,
            source: ReleaseSource::HealthHeader,
            name: "x-release-digest".into(),
            ramp_s: 60.0,
        }
    }
}

/// The declare-disaster rule (the seed's `assess()`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AssessmentConfig {
    /// A region judged down by at least two independent signals (health
    /// probe, metrics scrape, live upstream failures) for this long is a
    /// candidate for failover.
    pub region_down_minutes: f64,
    /// Healthy capacity below this fraction of the configured capacity is a
    /// capacity loss.
    pub capacity_fraction_min: f64,
}

impl Default for AssessmentConfig {
    fn default() -> Self {
        AssessmentConfig {
            region_down_minutes: 5.0,
            capacity_fraction_min: 0.7,
        }
    }
}

/// Context limits at the edge: the probe reads each region's
/// `max_model_len`, and the router sends no prompt to a region whose limit it
/// exceeds, answering 400 `context_length_exceeded` itself when no allowed
/// region can take it (docs/ROUTING.md, "Context limits").
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ContextConfig {
    /// How far the router's prompt-token estimate may be too high: a region
    /// is passed over only when the estimate lowered by this fraction, plus
    /// the requested output tokens, exceeds its limit. 0..1.
    pub margin: f64,
    /// Probe ticks between two reads of a region's model list (one callout
    /// per region); it is also read at start, when a region becomes healthy
    /// again and when its release digest changes.
    pub refresh_ticks: u32,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            margin: 0.1,
            refresh_ticks: 60,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ProbeConfig {
    /// The period of a full round (health, metrics, the controller step),
    /// and of the metrics scrape while the fleet is idle.
    pub tick_ms: u32,
    /// The metrics-scrape period while the fleet is busy (see
    /// [`ProbeConfig::busy_tick_ms`]); absent: [`DEFAULT_BUSY_TICK_MS`], or
    /// `tick_ms` if that is shorter. Equal to `tick_ms`: no adaptation.
    pub busy_tick_ms: Option<u32>,
    /// Busy when a routable region's (waiting + running) / max_concurrency
    /// reaches this, when any region has a request waiting, or when the
    /// ladder is above 0.
    pub busy_utilization: f64,
    /// Back to the idle period after this many busy-period rounds in a row
    /// without the fleet being busy.
    pub idle_rounds: u32,
    /// Callout timeout; at most `tick_ms`.
    pub timeout_ms: u32,
    /// A region's RTT is the least of its last this many health round
    /// trips.
    pub rtt_window: u32,
    /// EWMA weight of a new demand (arrival rate) sample.
    pub demand_alpha: f64,
    /// Consecutive failed health probes before a region is unhealthy.
    pub unhealthy_after: u32,
    /// Consecutive good health probes before it is healthy again.
    pub healthy_after: u32,
    /// A snapshot older than this is ignored by the filters, which then
    /// route as if there were none.
    pub snapshot_max_age_ms: u32,
    /// Passive ejection: a region whose engines failed most of the requests
    /// they ended (5xx, or a connection failure, reset or timeout upstream;
    /// never a client's cancellation) for `unhealthy_after` ticks in a row
    /// is taken out of
    /// routing for this many seconds, doubled at each ejection in a row (at
    /// most 32×), as Envoy's outlier detection does. 0 turns it off.
    pub eject_s: u32,
}

/// `probe.busy_tick_ms` when not configured (capped at `probe.tick_ms`).
pub const DEFAULT_BUSY_TICK_MS: u32 = 250;

impl ProbeConfig {
    /// The metrics-scrape period while the fleet is busy, in ms.
    pub fn busy_tick_ms(&self) -> u32 {
        self.busy_tick_ms
            .unwrap_or(DEFAULT_BUSY_TICK_MS)
            .min(self.tick_ms)
    }
}

impl Default for ProbeConfig {
    fn default() -> Self {
        ProbeConfig {
            tick_ms: 1000,
            busy_tick_ms: None,
            busy_utilization: 0.5,
            idle_rounds: 8,
            timeout_ms: 1000,
            rtt_window: 10,
            demand_alpha: 0.5,
            unhealthy_after: 2,
            healthy_after: 2,
            snapshot_max_age_ms: 10_000,
            eject_s: 10,
        }
    }
}
