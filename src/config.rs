//! Plugin configuration: the JSON an operator writes into each plugin's
//! `configuration`, parsed once in `on_configure` into these types and
//! validated. One schema serves all three roots (`probe`, `guard`, `router`)
//! so that the same document can be given to each; every root validates the
//! whole of it, so a typo is refused wherever it is pasted.
//!
//! Unknown fields are refused (`deny_unknown_fields`): a misspelt option that
//! silently falls back to its default is worse than a refused config.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

use crate::engines::metrics::EngineKind;

/// Number of rungs above level 0 on the degraded-mode ladder.
pub const LADDER_RUNGS: usize = 5;
/// Largest number of regions one configuration may name: a directory entry
/// keeps one timestamp per region, and stats names carry the region.
pub const MAX_REGIONS: usize = 64;

/// A configuration that failed to parse or validate: `field` is the JSON path
/// of the offending value, `reason` says what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration: {}: {}", self.field, self.reason)
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The complete replicas this proxy routes to, in any order.
    pub regions: Vec<Region>,
    /// One line per removed field the configuration still sets (see
    /// [`REMOVED_FIELDS`]): accepted, ignored, and logged once per Envoy.
    #[serde(skip)]
    pub warnings: Vec<String>,
    /// Region for requests the router does not understand (other paths,
    /// methods, non-JSON bodies). Default: the region with the lowest
    /// configured `rtt_ms`.
    #[serde(default)]
    pub default_region: Option<String>,
    #[serde(default)]
    pub headers: Headers,
    #[serde(default)]
    pub prefix: PrefixConfig,
    #[serde(default)]
    pub directory: DirectoryConfig,
    #[serde(default)]
    pub cost: CostConfig,
    #[serde(default)]
    pub probe: ProbeConfig,
    #[serde(default)]
    pub ladder: LadderConfig,
    #[serde(default)]
    pub tiers: TierConfig,
    #[serde(default)]
    pub residency: ResidencyConfig,
    #[serde(default)]
    pub tuning: crate::learning::tuning::TuningConfig,
    #[serde(default)]
    pub migration: MigrationConfig,
    #[serde(default)]
    pub release: ReleaseConfig,
    #[serde(default)]
    pub assessment: AssessmentConfig,
    #[serde(default)]
    pub context: ContextConfig,
    #[serde(default)]
    pub responses: ResponsesConfig,
    #[serde(default)]
    pub prometheus: PrometheusConfig,
    #[serde(default)]
    pub body_wait: BodyWaitConfig,
    /// Sharing what this Envoy learns with the other Envoys of its
    /// deployment (docs/OPERATIONS.md, "Many Envoys"). Off without a
    /// `cluster`.
    #[serde(default)]
    pub exchange: ExchangeConfig,
    /// What to do with a request to an inference path whose body is not a
    /// valid request: `reject` (400, OpenAI error JSON) or `pass_through`
    /// (send it untouched to the default region and let the engine answer).
    #[serde(default)]
    pub invalid_requests: InvalidRequests,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum InvalidRequests {
    #[default]
    Reject,
    PassThrough,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Short name used in stats, headers and logs: `[a-z0-9_]`, 1..=32 chars.
    pub name: String,
    /// Envoy cluster that reaches this region's engine.
    pub cluster: String,
    /// `:authority` for probe callouts. Default: the cluster name.
    #[serde(default)]
    pub authority: Option<String>,
    #[serde(default = "default_health_path")]
    pub health_path: String,
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    /// The engine's model list, read for its context limit
    /// (`max_model_len`): `/v1/models` on vLLM and SGLang alike.
    #[serde(default = "default_models_path")]
    pub models_path: String,
    #[serde(default = "default_engine")]
    pub engine: EngineKind,
    /// Requests per second the region sustains; the ladder's capacity is the
    /// sum over healthy regions.
    pub capacity_rps: f64,
    /// Requests the engine runs at once (vLLM `max_num_seqs`); beyond this
    /// they queue.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
    /// Prefill time per uncached prompt token, in milliseconds.
    #[serde(default = "default_prefill_ms_per_token")]
    pub prefill_ms_per_token: f64,
    /// Mean time a request holds an engine slot, in milliseconds; turns a
    /// queue length into a wait.
    #[serde(default = "default_service_ms")]
    pub service_ms: f64,
    /// Expected network round trip to the region, used until the probe has
    /// measured one, and to choose the nearest region without a snapshot.
    #[serde(default)]
    pub rtt_ms: f64,
    /// Envoy cluster of this region's fallback pool (e.g. a quantized
    /// model), for tiers a ladder level sends there.
    #[serde(default)]
    pub fallback_cluster: Option<String>,
    /// Where the region's load figures come from: `scrape` (its
    /// `metrics_path` through its cluster: one engine, or an entry point
    /// that serves aggregated metrics) or `prometheus` (the `prometheus`
    /// query, summed over the region's replicas).
    #[serde(default)]
    pub load_source: LoadSource,
    /// PromQL label matchers that select the region's engine series in
    /// Prometheus (without braces); default `region="<name>"`.
    #[serde(default)]
    pub prometheus_selector: Option<String>,
    /// KV-cache capacity of the region in tokens (all its replicas), for
    /// engines that export none; wins over the engine's figure. Read as a
    /// JSON number so that a bad one is refused with its field's name.
    #[serde(default)]
    pub cache_tokens: Option<serde_json::Number>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum LoadSource {
    #[default]
    Scrape,
    Prometheus,
}

impl Region {
    /// The configured `cache_tokens`, once validated (a whole number in
    /// 1..=`metrics::MAX_CACHE_TOKENS`).
    pub fn cache_tokens(&self) -> Option<u64> {
        self.cache_tokens.as_ref().and_then(whole_tokens)
    }

    /// The region's PromQL label matchers.
    pub fn selector(&self) -> String {
        self.prometheus_selector
            .clone()
            .unwrap_or_else(|| format!("region=\"{}\"", self.name))
    }
}

/// The Prometheus-compatible HTTP API the `prometheus` load source queries
/// (docs/CONFIG.md, "Prometheus").
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrometheusConfig {
    /// Envoy cluster that reaches it.
    pub cluster: Option<String>,
    /// `:authority` of the query; default the cluster's name.
    pub authority: Option<String>,
    /// Path of the instant-query endpoint.
    pub path: String,
}

impl Default for PrometheusConfig {
    fn default() -> Self {
        PrometheusConfig {
            cluster: None,
            authority: None,
            path: "/api/v1/query".to_string(),
        }
    }
}

fn default_health_path() -> String {
    "/health".to_string()
}
fn default_metrics_path() -> String {
    "/metrics".to_string()
}
fn default_models_path() -> String {
    "/v1/models".to_string()
}
fn default_engine() -> EngineKind {
    EngineKind::Vllm
}
fn default_max_concurrency() -> u32 {
    64
}
fn default_prefill_ms_per_token() -> f64 {
    0.1
}
/// `regions[].service_ms` when the operator does not give one.
pub const DEFAULT_SERVICE_MS: f64 = 2000.0;

fn default_service_ms() -> f64 {
    DEFAULT_SERVICE_MS
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Headers {
    /// Request header the router sets to the chosen Envoy cluster; the route
    /// uses it as `cluster_header`. Any client-sent value is removed.
    pub cluster: String,
    /// Request header that carries a session key (else the body's `user`).
    pub session: String,
    /// Request header carrying the caller's tier. Trusted only when
    /// `tiers.trust_header` is true; the guard always rewrites it to the tier
    /// it resolved, so the router and the engine see that one.
    pub tier: String,
    /// Response header with the routing decision (region, reason, cost
    /// terms). Absent: not sent.
    pub decision: Option<String>,
    /// Internal request header by which the guard sends a request to the
    /// fallback pool (`fallback`); any client value is removed by the guard.
    pub pool: String,
    /// Request header the router sets to `true` on a streamed request it
    /// routes, and removes from every other request it routes, so that a
    /// route can give streams a first-byte deadline (`per_try_idle_timeout`)
    /// that a non-streamed answer, whose first byte is its last, must not
    /// get (docs/OPERATIONS.md, "Failures and cancellations").
    pub stream: String,
}

impl Default for Headers {
    fn default() -> Self {
        Headers {
            cluster: "x-llm-cluster".to_string(),
            session: "x-session-id".to_string(),
            tier: "x-llm-tier".to_string(),
            decision: None,
            pool: "x-llm-pool".to_string(),
            stream: "x-llm-stream".to_string(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixConfig {
    /// Bytes of canonical prompt text per hashed block (64 ≈ 16 tokens).
    pub block_bytes: u32,
    /// Seed of the xxh3 chain hash. Change it per deployment so that block
    /// hashes cannot be precomputed by a client.
    pub hash_seed: u64,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_bytes: 64,
            hash_seed: 0x6c6c_6d2d_6765_6f21,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DirectoryConfig {
    /// Fixed number of shared-data slots; the directory never holds more.
    pub slots: u32,
    /// How long a region is believed to hold a prefix after it last served
    /// it: an upper bound; each region's engine teaches (from the `usage`
    /// the router reads at the end of each answer) how long it really
    /// keeps prefixes.
    pub ttl_s: u32,
    /// Also believe a region's entries only within the cache horizon its
    /// engine's `cached_tokens` teach. Off by
    /// default: measured to help where engine caches are far smaller than
    /// the working set and to cost cache hits elsewhere (docs/ROUTING.md).
    pub cache_horizon: bool,
    /// Which streamed answers carry a `usage` to read: `requested` (only
    /// those whose request asked, `stream_options.include_usage`; the
    /// Responses API's always do) or `always` (the engines force it:
    /// vLLM `--enable-force-include-usage`, SGLang
    /// `--stream-response-default-include-usage`). A stream that carries
    /// none is not read at all: reading costs one host call per chunk.
    pub stream_usage: StreamUsage,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum StreamUsage {
    #[default]
    Requested,
    Always,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        DirectoryConfig {
            slots: 16384,
            ttl_s: 600,
            cache_horizon: false,
            stream_usage: StreamUsage::Requested,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CostConfig {
    /// Placement of prompts no region holds (new conversations): no region
    /// takes more than `(1 + placement_epsilon)` times its fair share (by
    /// `max_concurrency`) of the in-flight work while another candidate has
    /// room. A conversation stays where it starts, so its future load is
    /// placed with it.
    pub placement_epsilon: f64,
    /// Below this fraction of its `max_concurrency` a region is never over
    /// the placement bound: at low load, spreading would only add network
    /// distance.
    pub placement_floor: f64,
}

impl Default for CostConfig {
    fn default() -> Self {
        CostConfig {
            placement_epsilon: 0.1,
            placement_floor: 0.25,
        }
    }
}

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

/// The router's guard against a pause on the request headers that never
/// ends: Envoy without `allow_on_headers_stop_iteration` on the filter never
/// delivers the body (src/request/body_wait.rs).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BodyWaitConfig {
    /// How long (ms) a request may stay paused on its headers with no body
    /// callback before the router acts; 0 disables the guard.
    pub timeout_ms: u64,
    /// What the router then does: `pass_through` (resume the request
    /// unrouted: Envoy's route without the cluster header, the nearest
    /// region, as when the VM fails open) or `reject` it (503).
    pub on_timeout: BodyWaitAction,
}

impl Default for BodyWaitConfig {
    fn default() -> Self {
        BodyWaitConfig {
            timeout_ms: 1000,
            on_timeout: BodyWaitAction::PassThrough,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum BodyWaitAction {
    #[default]
    PassThrough,
    Reject,
}

/// The exchange between the Envoys of one deployment (`src/exchange.rs`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ExchangeConfig {
    /// The Envoy cluster whose hosts are the deployment's Envoys' exchange
    /// listeners (static, DNS or EDS; under Istio the headless Service).
    /// Absent: no exchange, each Envoy on its own.
    pub cluster: Option<String>,
    /// `:authority` of the exchange callouts (default: the cluster name).
    pub authority: Option<String>,
    /// The path the `exchange` filter answers on the peers' listener.
    pub path: String,
    /// How often this Envoy sends its news (ms); default `probe.tick_ms`.
    pub interval_ms: Option<u32>,
    /// The most callouts one send makes (the cluster's load balancer picks
    /// each host; round robin spreads them). A deployment whose Envoys all
    /// fit (each peer heard from, this Envoy and one spare) is all-to-all
    /// and relays nothing; a larger one sends `fanout` and relays each item
    /// once (`exchange::plan`).
    pub fanout: u32,
    /// The largest message sent or taken; the outbox drops (and counts)
    /// news beyond it.
    pub max_message_bytes: u32,
}

impl Default for ExchangeConfig {
    fn default() -> Self {
        ExchangeConfig {
            cluster: None,
            authority: None,
            path: "/llm-geo-router/exchange".into(),
            interval_ms: None,
            fanout: 8,
            max_message_bytes: 262_144,
        }
    }
}

impl ExchangeConfig {
    pub fn enabled(&self) -> bool {
        self.cluster.is_some()
    }
}

/// The Responses API's stored responses (docs/ROUTING.md, "Endpoints").
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// Shared-data slots of the `id → region` map: one record each (about
    /// 60 bytes), so at most this many stored responses are followed.
    pub slots: u32,
    /// How long a response's region is remembered (seconds); engines keep
    /// stored responses in memory until they restart.
    pub ttl_s: u32,
    /// A follow-up whose response is held by a region that is unavailable
    /// (unhealthy, ejected, on another release, or outside the request's
    /// residency): `reject` (503, OpenAI error JSON: a retry elsewhere
    /// cannot succeed) or `reroute` (route it as a new request; the engine
    /// there answers that it does not know the response).
    pub holder_unavailable: HolderUnavailable,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum HolderUnavailable {
    #[default]
    Reject,
    Reroute,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        ResponsesConfig {
            slots: 65_536,
            ttl_s: 86_400,
            holder_unavailable: HolderUnavailable::Reject,
        }
    }
}

/// Session migration: when a request goes to a region other than the one
/// holding its prefix, whether that region should fetch the cached KV from
/// the holder or recompute it, told to the engine in a request header.
/// Moving only the request (redirect) stays the default: without this
/// section nothing is added.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    pub enabled: bool,
    /// Request header the engine reads: `fetch; from=<region>; tokens=<n>`
    /// or `recompute; tokens=<n>`. A client-sent value is always removed.
    pub header: String,
    /// The served model's KV geometry and compute (required when enabled).
    pub model: Option<crate::decision::migration::KvModel>,
    /// Inter-region bandwidth for KV transfer, Gbit/s, unless a link says otherwise.
    pub bandwidth_gbps: f64,
    /// Per pair of regions: measured RTT and bandwidth between them.
    pub links: Vec<Link>,
    /// Utilisation of the fetch path (0..1), for its M/M/1 wait.
    pub fetch_path_utilization: f64,
    /// Requests per second either queue drains (the seed's service rate).
    pub service_rate_per_s: f64,
    /// Prefixes shorter than this many tokens are not worth a decision.
    pub min_prefix_tokens: u64,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            enabled: false,
            header: "x-llm-kv-action".into(),
            model: None,
            bandwidth_gbps: 10.0,
            links: Vec::new(),
            fetch_path_utilization: 0.0,
            service_rate_per_s: 20.0,
            min_prefix_tokens: 256,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub from: String,
    pub to: String,
    /// Round trip between the two regions, ms. Absent: the sum of their
    /// RTTs from this proxy (an upper bound).
    #[serde(default)]
    pub rtt_ms: Option<f64>,
    #[serde(default)]
    pub bandwidth_gbps: Option<f64>,
}

/// Data residency: a request header whose value names an allow-listed set of
/// regions; the request may only go to one of them (a hard constraint).
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ResidencyConfig {
    /// Request header carrying the residency (e.g. `x-llm-residency`).
    /// Absent: no residency constraints.
    pub header: Option<String>,
    /// Residency value → the names of the regions it allows.
    pub allowed: BTreeMap<String, Vec<String>>,
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

/// Caps that one ladder level applies to one tier.
#[derive(Debug, Clone, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TierPolicy {
    /// Prompts longer than this many tokens get 413.
    pub max_prompt_tokens: Option<u64>,
    /// `max_tokens` / `max_completion_tokens` are clamped to this.
    pub max_tokens: Option<u64>,
    /// Requests of this tier are refused (`ladder.shed_status`, with a
    /// jittered `Retry-After`).
    pub shed: bool,
    /// Requests of this tier go to the chosen region's `fallback_cluster`
    /// (e.g. a quantized model), where one is configured.
    pub fallback: bool,
    /// With `fallback`: the request body's `model` is rewritten to this.
    pub fallback_model: Option<String>,
}

impl TierPolicy {
    pub fn is_noop(&self) -> bool {
        self.max_prompt_tokens.is_none()
            && self.max_tokens.is_none()
            && !self.shed
            && !self.fallback
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LadderConfig {
    /// Capacity/demand ratio below which level i steps up to i+1.
    pub up_at: [f64; LADDER_RUNGS],
    /// Ratio above which level i+1 may step down to i (after the dwell).
    pub down_at: [f64; LADDER_RUNGS],
    /// Seconds a level must have held before stepping down one rung.
    pub dwell_s: f64,
    /// Operator override: this level regardless of the ratio.
    pub forced_level: Option<u8>,
    /// Per level 0..=5, per tier name: the caps. A tier absent from a level
    /// is served without caps at that level.
    pub levels: Vec<BTreeMap<String, TierPolicy>>,
    /// Shed responses carry `Retry-After` drawn uniformly from this range of
    /// seconds, so shed clients do not come back together.
    pub retry_after_s: [u32; 2],
    /// Status of a shed response: 429 (the client's rate) or 503 (the
    /// service's state).
    pub shed_status: u16,
    /// Scale each healthy region's capacity by its free KV cache
    /// (`1 − kv_usage`) as the engine reports it.
    pub scale_by_kv_headroom: bool,
    /// SHA-256 (lowercase hex) of operator bearer tokens allowed to set or
    /// clear a ladder override at runtime (`POST /llm-geo-router/ladder`).
    /// Empty: no runtime override endpoint.
    pub operator_keys: Vec<String>,
}

impl Default for LadderConfig {
    fn default() -> Self {
        LadderConfig {
            up_at: [1.00, 0.90, 0.75, 0.60, 0.45],
            down_at: [1.10, 1.00, 0.85, 0.70, 0.55],
            dwell_s: 300.0,
            forced_level: None,
            levels: default_levels(),
            retry_after_s: [5, 30],
            shed_status: 429,
            scale_by_kv_headroom: false,
            operator_keys: Vec::new(),
        }
    }
}

fn caps(max_prompt_tokens: Option<u64>, max_tokens: Option<u64>) -> TierPolicy {
    TierPolicy {
        max_prompt_tokens,
        max_tokens,
        ..TierPolicy::default()
    }
}

/// Defaults follow the seed: each rung gives up a little more, free traffic
/// first; by level 4 paid traffic is served at capped lengths and free
/// traffic goes to the fallback pool (the quantized model, where regions
/// configure one); level 5 sheds free traffic; paid is never shed;
/// `critical` is never touched.
fn default_levels() -> Vec<BTreeMap<String, TierPolicy>> {
    let level = |free: TierPolicy, paid: Option<TierPolicy>| {
        let mut m = BTreeMap::new();
        m.insert("free".to_string(), free);
        if let Some(p) = paid {
            m.insert("paid".to_string(), p);
        }
        m
    };
    vec![
        BTreeMap::new(),
        level(caps(None, Some(1024)), None),
        level(caps(Some(16384), Some(512)), Some(caps(None, Some(2048)))),
        level(
            caps(Some(8192), Some(256)),
            Some(caps(Some(32768), Some(1024))),
        ),
        level(
            TierPolicy {
                fallback: true,
                ..caps(Some(4096), Some(256))
            },
            Some(caps(Some(16384), Some(512))),
        ),
        level(
            TierPolicy {
                shed: true,
                ..TierPolicy::default()
            },
            Some(caps(Some(8192), Some(256))),
        ),
    ]
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// Known tiers; a header value outside this list is treated as absent.
    pub names: Vec<String>,
    /// Tier of a caller the guard cannot identify.
    pub default: String,
    /// Trust the tier header as sent. Only safe when a filter before the
    /// guard (e.g. `jwt_authn` with `claim_to_headers`) always overwrites it.
    pub trust_header: bool,
    /// Map of lowercase hex SHA-256 of an API key (the bearer token) to its
    /// tier; checked before the header.
    pub api_keys: BTreeMap<String, String>,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            names: vec!["free".into(), "paid".into(), "critical".into()],
            default: "free".into(),
            trust_header: false,
            api_keys: BTreeMap::new(),
        }
    }
}

/// What replaced the held prompts' share bound (two removed fields).
const HELD_SHARE_BOUND_GONE: &str =
    "nothing: a prompt some region holds is not spread by a share of \
     the in-flight work; it leaves the region holding it only when that region is full and its \
     wait exceeds what the move costs (docs/ROUTING.md, \"What each rule is worth\")";

/// Fields an earlier release took and this one does not: `(section, field,
/// what replaced it)`. A configuration that still sets one is accepted, the
/// field ignored, with one warning naming the replacement (for one release;
/// then they are unknown fields, refused).
pub const REMOVED_FIELDS: &[(&str, &str, &str)] = &[
    (
        "cost",
        "w_rtt",
        "nothing: the round trip enters the cost as the probe measures it, in ms \
         (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "tuning",
        "w_rtt_min",
        "nothing: the round trip is not weighted, so there is no weight to bound",
    ),
    (
        "tuning",
        "w_rtt_max",
        "nothing: the round trip is not weighted, so there is no weight to bound",
    ),
    (
        "cost",
        "spread_margin_ms",
        "nothing: the near-tie draw is gone, a prompt goes to the least expected \
         TTFT (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "spread_share",
        "nothing: the near-tie draw is gone, a prompt goes to the least expected \
         TTFT (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "tie_ms",
        "nothing: only regions of exactly the least expected TTFT tie (rendezvous \
         breaks them); a difference within a band is a difference (docs/ROUTING.md, \
         \"What each rule is worth\")",
    ),
    (
        "cost",
        "session_slack_ms",
        "nothing: a session's previous region is not kept by a margin; what it \
         holds of the session's prompt enters the expected TTFT as cached tokens, \
         from the session record (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "congestion_cap",
        "the externality term: the delay a request adds to the requests arriving \
         at a region while it is there, from the region's occupancy and slots, \
         with no cap to set (docs/ROUTING.md, \"What each rule is worth\")",
    ),
    (
        "cost",
        "w_queue",
        "the fitted queue weight: it starts at 1 (a predicted ms of wait is a ms, \
         like every other term) and is fitted on the observed TTFT within \
         tuning.w_queue_min and tuning.w_queue_max; set both to one value to pin it",
    ),
    ("cost", "bounded_load_epsilon", HELD_SHARE_BOUND_GONE),
    ("cost", "bounded_load_floor", HELD_SHARE_BOUND_GONE),
    (
        "prefix",
        "bytes_per_token",
        "the engines' own count: tokens per byte of prompt are measured from each \
         answer's usage.prompt_tokens, per region and model (4 bytes per token until \
         the first answer) (docs/ROUTING.md, \"What the engines report\")",
    ),
    (
        "directory",
        "learn_from_usage",
        "nothing: the usage ending each answer is always read and learnt from \
         (docs/ROUTING.md, \"What the engines report\")",
    ),
    (
        "tuning",
        "enabled",
        "nothing: the queue weight and prefill rates are always fitted on the \
         observed TTFT; to pin the queue weight set tuning.w_queue_min and \
         tuning.w_queue_max to it",
    ),
    (
        "probe",
        "rtt_alpha",
        "probe.rtt_window: a region's round trip is the least of its last rtt_window \
         health round trips, not an average",
    ),
];

/// The configuration without the removed fields it sets, and a warning for
/// each; `None` when it sets none (or is not a JSON object: the parse then
/// says what is wrong).
fn strip_removed(bytes: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
    // Cheap test first: most configurations name no removed field.
    let text = std::str::from_utf8(bytes).ok()?;
    if !REMOVED_FIELDS.iter().any(|(_, f, _)| text.contains(f)) {
        return None;
    }
    let mut value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let mut warnings = Vec::new();
    for (section, field, instead) in REMOVED_FIELDS {
        let removed = value
            .get_mut(*section)
            .and_then(serde_json::Value::as_object_mut)
            .and_then(|o| o.remove(*field));
        if removed.is_some() {
            warnings.push(format!(
                "{section}.{field} is no longer a setting and is ignored; replaced by {instead}. \
                 Remove it: the next release refuses it"
            ));
        }
    }
    // Written back as text and parsed as any configuration is: parsing a
    // `Value` into the types would build their deserializers a second time
    // (about 140 KB of module).
    let stripped = serde_json::to_vec(&value).ok()?;
    (!warnings.is_empty()).then_some((stripped, warnings))
}

/// The shared-data key that records `warning` as logged.
fn warned_key(warning: &str) -> String {
    format!(
        "llm_geo_router.config_warned.{:016x}",
        xxhash_rust::xxh3::xxh3_64(warning.as_bytes())
    )
}

impl Config {
    /// The warnings of [`Config::warnings`] not yet logged by this Envoy
    /// (any of its plugins and workers), marked logged in `store`.
    pub fn unlogged_warnings(
        &self,
        store: &mut dyn crate::shared::store::SharedStore,
    ) -> Vec<&str> {
        self.warnings
            .iter()
            .filter(|w| {
                let key = warned_key(w);
                match store.get(&key) {
                    Ok(Some(_)) => false,
                    _ => {
                        let _ = store.set(&key, b"1", None);
                        true
                    }
                }
            })
            .map(String::as_str)
            .collect()
    }

    /// Parse and validate; the error names the field and the reason.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Err(ConfigError::new(
                "configuration",
                "is empty; a JSON object with at least `regions` is required",
            ));
        }
        let invalid = |e: serde_json::Error| {
            ConfigError::new(
                "configuration",
                format!("is not valid for this plugin: {e}"),
            )
        };
        let (mut config, warnings): (Config, _) = match strip_removed(bytes) {
            Some((text, warnings)) => (serde_json::from_slice(&text).map_err(invalid)?, warnings),
            None => (serde_json::from_slice(bytes).map_err(invalid)?, Vec::new()),
        };
        config.warnings = warnings;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_exchange()?;
        if self.regions.is_empty() {
            return Err(ConfigError::new("regions", "must name at least one region"));
        }
        if self.regions.len() > MAX_REGIONS {
            return Err(ConfigError::new(
                "regions",
                format!(
                    "names {} regions; at most {MAX_REGIONS}",
                    self.regions.len()
                ),
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            let at = |f: &str| format!("regions[{i}].{f}");
            if !valid_name(&r.name) {
                return Err(ConfigError::new(
                    at("name"),
                    format!("{:?} must be 1..=32 chars of [a-z0-9_]", r.name),
                ));
            }
            if self.regions.iter().take(i).any(|o| o.name == r.name) {
                return Err(ConfigError::new(
                    at("name"),
                    format!("{:?} is used twice", r.name),
                ));
            }
            if r.cluster.trim().is_empty() {
                return Err(ConfigError::new(at("cluster"), "must not be empty"));
            }
            if let Some(a) = &r.authority {
                if a.trim().is_empty() {
                    return Err(ConfigError::new(at("authority"), "must not be empty"));
                }
            }
            for (f, p) in [
                ("health_path", &r.health_path),
                ("metrics_path", &r.metrics_path),
                ("models_path", &r.models_path),
            ] {
                if !p.starts_with('/') {
                    return Err(ConfigError::new(
                        at(f),
                        format!("{p:?} must start with '/'"),
                    ));
                }
            }
            positive(&at("capacity_rps"), r.capacity_rps)?;
            if r.max_concurrency == 0 {
                return Err(ConfigError::new(
                    at("max_concurrency"),
                    "must be at least 1",
                ));
            }
            non_negative(&at("prefill_ms_per_token"), r.prefill_ms_per_token)?;
            positive(&at("service_ms"), r.service_ms)?;
            non_negative(&at("rtt_ms"), r.rtt_ms)?;
            if let Some(n) = &r.cache_tokens {
                if whole_tokens(n).is_none() {
                    return Err(ConfigError::new(
                        at("cache_tokens"),
                        format!(
                            "{n} must be a whole number of tokens in 1..={}",
                            crate::engines::metrics::MAX_CACHE_TOKENS
                        ),
                    ));
                }
            }
            if let Some(sel) = &r.prometheus_selector {
                if sel.trim().is_empty()
                    || sel.len() > 1024
                    || sel
                        .chars()
                        .any(|c| matches!(c, '{' | '}') || c.is_control())
                {
                    return Err(ConfigError::new(
                        at("prometheus_selector"),
                        format!("{sel:?} must be PromQL label matchers without braces (e.g. region=\"eu\"), 1..=1024 characters, no control characters"),
                    ));
                }
            }
        }
        let prom = &self.prometheus;
        if self
            .regions
            .iter()
            .any(|r| r.load_source == LoadSource::Prometheus)
            && prom.cluster.as_deref().is_none_or(|c| c.trim().is_empty())
        {
            return Err(ConfigError::new(
                "prometheus.cluster",
                "must name the Envoy cluster of the Prometheus API: a region uses load_source \"prometheus\"",
            ));
        }
        if !prom.path.starts_with('/')
            || prom.path.contains(['?', '#'])
            || prom.path.chars().any(char::is_whitespace)
        {
            return Err(ConfigError::new(
                "prometheus.path",
                format!(
                    "{:?} must start with '/' and hold no query, fragment or whitespace",
                    prom.path
                ),
            ));
        }
        if let Some(d) = &self.default_region {
            if !self.regions.iter().any(|r| &r.name == d) {
                return Err(ConfigError::new(
                    "default_region",
                    format!("{d:?} is not the name of a configured region"),
                ));
            }
        }
        let h = &self.headers;
        for (f, v) in [
            ("headers.cluster", Some(&h.cluster)),
            ("headers.session", Some(&h.session)),
            ("headers.tier", Some(&h.tier)),
            ("headers.decision", h.decision.as_ref()),
            ("headers.pool", Some(&h.pool)),
            ("headers.stream", Some(&h.stream)),
        ] {
            if let Some(v) = v {
                if !valid_header_name(v) {
                    return Err(ConfigError::new(
                        f,
                        format!("{v:?} is not a lowercase HTTP header name"),
                    ));
                }
            }
        }
        if !(16..=4096).contains(&self.prefix.block_bytes) {
            return Err(ConfigError::new(
                "prefix.block_bytes",
                format!("{} must be within 16..=4096", self.prefix.block_bytes),
            ));
        }
        if !(64..=1 << 20).contains(&self.directory.slots) {
            return Err(ConfigError::new(
                "directory.slots",
                format!("{} must be within 64..=1048576", self.directory.slots),
            ));
        }
        if self.directory.ttl_s == 0 {
            return Err(ConfigError::new("directory.ttl_s", "must be at least 1"));
        }
        non_negative("cost.placement_epsilon", self.cost.placement_epsilon)?;
        let floor = self.cost.placement_floor;
        if !(floor.is_finite() && (0.0..=1.0).contains(&floor)) {
            return Err(ConfigError::new(
                "cost.placement_floor",
                format!("{floor} must be within 0..=1"),
            ));
        }
        if self.body_wait.timeout_ms > 60_000 {
            return Err(ConfigError::new(
                "body_wait.timeout_ms",
                format!("{} must be within 0..=60000", self.body_wait.timeout_ms),
            ));
        }
        let m = self.context.margin;
        if !(m.is_finite() && (0.0..1.0).contains(&m)) {
            return Err(ConfigError::new(
                "context.margin",
                format!("{m} must be within [0, 1)"),
            ));
        }
        if !(1..=86_400).contains(&self.context.refresh_ticks) {
            return Err(ConfigError::new(
                "context.refresh_ticks",
                format!("{} must be within 1..=86400", self.context.refresh_ticks),
            ));
        }
        if !(1..=4_194_304).contains(&self.responses.slots) {
            return Err(ConfigError::new(
                "responses.slots",
                format!("{} must be within 1..=4194304", self.responses.slots),
            ));
        }
        if !(1..=2_592_000).contains(&self.responses.ttl_s) {
            return Err(ConfigError::new(
                "responses.ttl_s",
                format!(
                    "{} must be within 1..=2592000 (30 days)",
                    self.responses.ttl_s
                ),
            ));
        }
        self.validate_residency()?;
        self.tuning
            .validate()
            .map_err(|(f, r)| ConfigError::new(f, r))?;
        self.validate_migration()?;
        self.validate_release()?;
        let p = &self.probe;
        if p.tick_ms < 50 {
            return Err(ConfigError::new("probe.tick_ms", "must be at least 50"));
        }
        if p.timeout_ms == 0 || p.timeout_ms > p.tick_ms {
            return Err(ConfigError::new(
                "probe.timeout_ms",
                format!(
                    "{} must be within 1..=probe.tick_ms ({})",
                    p.timeout_ms, p.tick_ms
                ),
            ));
        }
        if let Some(b) = p.busy_tick_ms {
            if b < 50 || b > p.tick_ms {
                return Err(ConfigError::new(
                    "probe.busy_tick_ms",
                    format!("{b} must be within 50..=probe.tick_ms ({})", p.tick_ms),
                ));
            }
        }
        if !(p.busy_utilization.is_finite() && p.busy_utilization > 0.0) {
            return Err(ConfigError::new(
                "probe.busy_utilization",
                format!("{} must be a number above 0", p.busy_utilization),
            ));
        }
        if p.idle_rounds == 0 || p.idle_rounds > 10_000 {
            return Err(ConfigError::new(
                "probe.idle_rounds",
                format!("{} must be within 1..=10000", p.idle_rounds),
            ));
        }
        if p.rtt_window == 0 || p.rtt_window > 64 {
            return Err(ConfigError::new(
                "probe.rtt_window",
                format!("{} must be within 1..=64", p.rtt_window),
            ));
        }
        fraction("probe.demand_alpha", p.demand_alpha)?;
        if p.unhealthy_after == 0 {
            return Err(ConfigError::new(
                "probe.unhealthy_after",
                "must be at least 1",
            ));
        }
        if p.healthy_after == 0 {
            return Err(ConfigError::new(
                "probe.healthy_after",
                "must be at least 1",
            ));
        }
        if p.eject_s > 3600 {
            return Err(ConfigError::new(
                "probe.eject_s",
                format!("{} must be within 0..=3600", p.eject_s),
            ));
        }
        if p.snapshot_max_age_ms < p.tick_ms.saturating_mul(2) {
            return Err(ConfigError::new(
                "probe.snapshot_max_age_ms",
                "must be at least twice probe.tick_ms",
            ));
        }
        self.validate_ladder()?;
        self.validate_tiers()
    }

    fn validate_ladder(&self) -> Result<(), ConfigError> {
        let l = &self.ladder;
        for i in 0..LADDER_RUNGS {
            let (up, down) = (l.up_at.get(i).copied(), l.down_at.get(i).copied());
            let (Some(up), Some(down)) = (up, down) else {
                continue;
            };
            positive(&format!("ladder.up_at[{i}]"), up)?;
            if !(down.is_finite() && down > up) {
                return Err(ConfigError::new(
                    format!("ladder.down_at[{i}]"),
                    format!("{down} must be greater than up_at[{i}] ({up}), or the level flaps"),
                ));
            }
            if i > 0 && l.up_at.get(i - 1).is_some_and(|prev| up > *prev) {
                return Err(ConfigError::new(
                    format!("ladder.up_at[{i}]"),
                    "thresholds must not increase from one rung to the next",
                ));
            }
        }
        non_negative("ladder.dwell_s", l.dwell_s)?;
        if let Some(f) = l.forced_level {
            if usize::from(f) > LADDER_RUNGS {
                return Err(ConfigError::new(
                    "ladder.forced_level",
                    format!("{f} must be within 0..={LADDER_RUNGS}"),
                ));
            }
        }
        if l.levels.len() != LADDER_RUNGS + 1 {
            return Err(ConfigError::new(
                "ladder.levels",
                format!(
                    "has {} entries; exactly {} (levels 0..=5) are required",
                    l.levels.len(),
                    LADDER_RUNGS + 1
                ),
            ));
        }
        for (i, level) in l.levels.iter().enumerate() {
            for (tier, policy) in level {
                if !self.tiers.names.contains(tier) {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}"),
                        "is not a tier named in tiers.names",
                    ));
                }
                for (f, v) in [
                    ("max_prompt_tokens", policy.max_prompt_tokens),
                    ("max_tokens", policy.max_tokens),
                ] {
                    if v == Some(0) {
                        return Err(ConfigError::new(
                            format!("ladder.levels[{i}].{tier}.{f}"),
                            "must be at least 1 (use shed to refuse a tier)",
                        ));
                    }
                }
            }
        }
        if !matches!(l.shed_status, 429 | 503) {
            return Err(ConfigError::new(
                "ladder.shed_status",
                format!("{} must be 429 or 503", l.shed_status),
            ));
        }
        for (i, k) in l.operator_keys.iter().enumerate() {
            if k.len() != 64 || !k.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(ConfigError::new(
                    format!("ladder.operator_keys[{i}]"),
                    "must be the lowercase hex SHA-256 (64 chars) of an operator token",
                ));
            }
        }
        for (i, level) in l.levels.iter().enumerate() {
            for (tier, policy) in level {
                if policy.fallback_model.is_some() && !policy.fallback {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}.fallback_model"),
                        "is only used with fallback: true",
                    ));
                }
                if policy.fallback_model.is_some() {
                    let missing = self
                        .regions
                        .iter()
                        .enumerate()
                        .find(|(_, r)| r.fallback_cluster.is_none());
                    if let Some((j, r)) = missing {
                        return Err(ConfigError::new(
                            format!("ladder.levels[{i}].{tier}.fallback_model"),
                            format!(
                                "needs a fallback_cluster in every region (regions[{j}] {:?} has none): the renamed model would reach the main pool",
                                r.name
                            ),
                        ));
                    }
                }
                if policy
                    .fallback_model
                    .as_deref()
                    .is_some_and(|m| m.trim().is_empty())
                {
                    return Err(ConfigError::new(
                        format!("ladder.levels[{i}].{tier}.fallback_model"),
                        "must not be empty",
                    ));
                }
            }
        }
        let [lo, hi] = l.retry_after_s;
        if lo == 0 || hi < lo {
            return Err(ConfigError::new(
                "ladder.retry_after_s",
                format!("[{lo}, {hi}] must be [min, max] with 1 <= min <= max"),
            ));
        }
        Ok(())
    }

    fn validate_release(&self) -> Result<(), ConfigError> {
        let r = &self.release;
        if let Some(d) = &r.expected {
            if d.trim().is_empty() {
                return Err(ConfigError::new("release.expected", "must not be empty"));
            }
        }
        let ok = match r.source {
            ReleaseSource::HealthHeader => valid_header_name(&r.name),
            ReleaseSource::HealthJson => !r.name.is_empty(),
            ReleaseSource::MetricsLabel => r
                .name
                .split_once('/')
                .is_some_and(|(m, l)| !m.is_empty() && !l.is_empty()),
        };
        if !ok {
            return Err(ConfigError::new(
                "release.name",
                format!("{:?} does not fit release.source (a header name, a JSON field, or metric/label)", r.name),
            ));
        }
        non_negative("release.ramp_s", r.ramp_s)?;
        let a = &self.assessment;
        non_negative("assessment.region_down_minutes", a.region_down_minutes)?;
        fraction("assessment.capacity_fraction_min", a.capacity_fraction_min)?;
        for (i, r) in self.regions.iter().enumerate() {
            if r.fallback_cluster
                .as_deref()
                .is_some_and(|c| c.trim().is_empty())
            {
                return Err(ConfigError::new(
                    format!("regions[{i}].fallback_cluster"),
                    "must not be empty",
                ));
            }
        }
        Ok(())
    }

    fn validate_migration(&self) -> Result<(), ConfigError> {
        let m = &self.migration;
        if !valid_header_name(&m.header) {
            return Err(ConfigError::new(
                "migration.header",
                format!("{:?} is not a lowercase HTTP header name", m.header),
            ));
        }
        match &m.model {
            Some(model) => model
                .validate()
                .map_err(|e| ConfigError::new("migration.model", e))?,
            None if m.enabled => {
                return Err(ConfigError::new(
                    "migration.model",
                    "is required when migration.enabled is true",
                ))
            }
            None => {}
        }
        positive("migration.bandwidth_gbps", m.bandwidth_gbps)?;
        let u = m.fetch_path_utilization;
        if !(u.is_finite() && (0.0..1.0).contains(&u)) {
            return Err(ConfigError::new(
                "migration.fetch_path_utilization",
                format!("{u} must be within [0, 1)"),
            ));
        }
        positive("migration.service_rate_per_s", m.service_rate_per_s)?;
        for (i, l) in m.links.iter().enumerate() {
            for (f, name) in [("from", &l.from), ("to", &l.to)] {
                if !self.regions.iter().any(|r| &r.name == name) {
                    return Err(ConfigError::new(
                        format!("migration.links[{i}].{f}"),
                        format!("{name:?} is not the name of a configured region"),
                    ));
                }
            }
            if let Some(v) = l.rtt_ms {
                non_negative(&format!("migration.links[{i}].rtt_ms"), v)?;
            }
            if let Some(v) = l.bandwidth_gbps {
                positive(&format!("migration.links[{i}].bandwidth_gbps"), v)?;
            }
        }
        Ok(())
    }

    fn validate_residency(&self) -> Result<(), ConfigError> {
        let r = &self.residency;
        if let Some(h) = &r.header {
            if !valid_header_name(h) {
                return Err(ConfigError::new(
                    "residency.header",
                    format!("{h:?} is not a lowercase HTTP header name"),
                ));
            }
            if r.allowed.is_empty() {
                return Err(ConfigError::new(
                    "residency.allowed",
                    "must list at least one residency when residency.header is set",
                ));
            }
        }
        for (value, regions) in &r.allowed {
            let at = format!("residency.allowed.{value}");
            // The header value is trimmed before lookup: a key that cannot
            // equal a trimmed header value could never be matched.
            if value.is_empty()
                || value.trim() != value
                || !value.chars().all(|c| (' '..='~').contains(&c))
            {
                return Err(ConfigError::new(
                    format!("residency.allowed.{value:?}"),
                    "a residency value must be non-empty printable ASCII without \
                     surrounding whitespace (header values are matched after trimming)",
                ));
            }
            if regions.is_empty() {
                return Err(ConfigError::new(at, "must name at least one region"));
            }
            for name in regions {
                if !self.regions.iter().any(|x| &x.name == name) {
                    return Err(ConfigError::new(
                        at,
                        format!("{name:?} is not the name of a configured region"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Per configured region, whether `residency` allows it; `None` when the
    /// value is not allow-listed.
    pub fn residency_mask(&self, residency: &str) -> Option<Vec<bool>> {
        let names = self.residency.allowed.get(residency.trim())?;
        Some(
            self.regions
                .iter()
                .map(|r| names.contains(&r.name))
                .collect(),
        )
    }

    fn validate_tiers(&self) -> Result<(), ConfigError> {
        let t = &self.tiers;
        if t.names.is_empty() {
            return Err(ConfigError::new(
                "tiers.names",
                "must name at least one tier",
            ));
        }
        for (i, n) in t.names.iter().enumerate() {
            if !valid_name(n) {
                return Err(ConfigError::new(
                    format!("tiers.names[{i}]"),
                    format!("{n:?} must be 1..=32 chars of [a-z0-9_]"),
                ));
            }
            if t.names.iter().take(i).any(|o| o == n) {
                return Err(ConfigError::new(
                    format!("tiers.names[{i}]"),
                    format!("{n:?} is used twice"),
                ));
            }
        }
        if !t.names.contains(&t.default) {
            return Err(ConfigError::new(
                "tiers.default",
                format!("{:?} is not in tiers.names", t.default),
            ));
        }
        for (hash, tier) in &t.api_keys {
            if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(ConfigError::new(
                    "tiers.api_keys",
                    format!(
                        "key {hash:?} must be the lowercase hex SHA-256 (64 chars) of an API key"
                    ),
                ));
            }
            if !t.names.contains(tier) {
                return Err(ConfigError::new(
                    format!("tiers.api_keys.{hash}"),
                    format!("{tier:?} is not in tiers.names"),
                ));
            }
        }
        Ok(())
    }

    /// Index of the region for requests the router does not understand.
    pub fn default_region_index(&self) -> usize {
        match &self.default_region {
            Some(name) => self
                .regions
                .iter()
                .position(|r| &r.name == name)
                .unwrap_or(0),
            None => self.nearest_configured_region(),
        }
    }

    /// The region with the lowest configured RTT (the first on ties).
    pub fn nearest_configured_region(&self) -> usize {
        let mut best = 0;
        for (i, r) in self.regions.iter().enumerate() {
            if self.regions.get(best).is_some_and(|b| r.rtt_ms < b.rtt_ms) {
                best = i;
            }
        }
        best
    }

    pub fn region_authority(&self, i: usize) -> Option<&str> {
        let r = self.regions.get(i)?;
        Some(r.authority.as_deref().unwrap_or(&r.cluster))
    }

    /// The policy for `tier` at `level`; no caps when the level or the tier
    /// is not listed.
    pub fn tier_policy(&self, level: u8, tier: &str) -> Option<&TierPolicy> {
        self.ladder.levels.get(usize::from(level))?.get(tier)
    }
}

fn valid_name(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(':')
        && s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'))
}

/// A token count in 1..=`metrics::MAX_CACHE_TOKENS`; `1e6` is as good as
/// `1000000`, `1.5` or `-1` is none.
fn whole_tokens(n: &serde_json::Number) -> Option<u64> {
    let t = n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| {
                f.fract() == 0.0
                    && *f >= 1.0
                    && *f <= crate::engines::metrics::MAX_CACHE_TOKENS as f64
            })
            .map(|f| f as u64)
    })?;
    (1..=crate::engines::metrics::MAX_CACHE_TOKENS)
        .contains(&t)
        .then_some(t)
}

fn positive(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be a finite number > 0"),
        ))
    }
}

fn non_negative(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be a finite number >= 0"),
        ))
    }
}

impl Config {
    fn validate_exchange(&self) -> Result<(), ConfigError> {
        let x = &self.exchange;
        if let Some(c) = &x.cluster {
            if c.is_empty() || c.len() > 256 || c.bytes().any(|b| b.is_ascii_control()) {
                return Err(ConfigError::new(
                    "exchange.cluster",
                    "must be a cluster name (1..=256 printable bytes)",
                ));
            }
        }
        if let Some(a) = &x.authority {
            if a.is_empty() || a.len() > 256 || a.bytes().any(|b| b.is_ascii_control() || b == b' ')
            {
                return Err(ConfigError::new(
                    "exchange.authority",
                    "must be a host name (1..=256 printable bytes, no spaces)",
                ));
            }
        }
        if !x.path.starts_with('/')
            || x.path.len() > 256
            || x.path
                .bytes()
                .any(|b| !b.is_ascii_graphic() || b == b'?' || b == b'#')
        {
            return Err(ConfigError::new(
                "exchange.path",
                format!(
                    "{:?} must be an absolute path without query (at most 256 bytes)",
                    x.path
                ),
            ));
        }
        if let Some(ms) = x.interval_ms {
            if !(50..=60_000).contains(&ms) {
                return Err(ConfigError::new(
                    "exchange.interval_ms",
                    format!("{ms} must be within 50..=60000"),
                ));
            }
        }
        if !(1..=16).contains(&x.fanout) {
            return Err(ConfigError::new(
                "exchange.fanout",
                format!("{} must be within 1..=16", x.fanout),
            ));
        }
        if !(1024..=4 << 20).contains(&x.max_message_bytes) {
            return Err(ConfigError::new(
                "exchange.max_message_bytes",
                format!("{} must be within 1024..=4194304", x.max_message_bytes),
            ));
        }
        Ok(())
    }

    /// The exchange's send period, ms.
    pub fn exchange_interval_ms(&self) -> u64 {
        u64::from(self.exchange.interval_ms.unwrap_or(self.probe.tick_ms))
    }
}

fn fraction(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be within (0, 1]"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_field_is_ignored_with_one_warning_per_envoy() {
        let json = |cost: &str| {
            format!(
                r#"{{"regions":[{{"name":"a","cluster":"a","capacity_rps":1}}],"cost":{cost}}}"#
            )
        };
        let c = Config::parse(json(r#"{"w_rtt":1.5,"placement_floor":0.5}"#).as_bytes()).unwrap();
        assert_eq!(c.cost.placement_floor, 0.5);
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].starts_with("cost.w_rtt is no longer a setting"));
        let mut store = crate::shared::store::MemoryStore::default();
        assert_eq!(c.unlogged_warnings(&mut store).len(), 1);
        assert!(c.unlogged_warnings(&mut store).is_empty(), "logged once");
        // Each section's removed fields, each said.
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],
                "tuning":{"w_rtt_min":0.5,"w_rtt_max":2,"w_queue_max":3},"probe":{"rtt_alpha":0.3}}"#,
        )
        .unwrap();
        assert_eq!(c.tuning.w_queue_max, 3.0);
        assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
        assert!(
            c.warnings[2].contains("probe.rtt_window"),
            "{:?}",
            c.warnings
        );
        // None set: no warning; a wrong field next to a removed one is
        // still refused.
        assert!(Config::parse(json(r#"{"placement_floor":0.5}"#).as_bytes())
            .unwrap()
            .warnings
            .is_empty());
        let e =
            Config::parse(json(r#"{"w_rtt":0.5,"placement_floorx":3}"#).as_bytes()).unwrap_err();
        assert!(e.to_string().contains("placement_floorx"), "{e}");
        // The name in another section is not the removed field.
        let e = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],"probe":{"w_rtt":1}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("w_rtt"), "{e}");
    }

    const MINIMAL: &str = r#"{"regions":[{"name":"near","cluster":"c_near","capacity_rps":10,"rtt_ms":5},
        {"name":"far","cluster":"c_far","capacity_rps":10,"rtt_ms":120}]}"#;

    #[test]
    fn each_engine_family_is_accepted_by_its_name() {
        for (name, kind) in [
            ("vllm", EngineKind::Vllm),
            ("sglang", EngineKind::Sglang),
            ("llamacpp", EngineKind::Llamacpp),
        ] {
            let c = Config::parse(
                format!(
                    r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1,"engine":"{name}"}}]}}"#
                )
                .as_bytes(),
            )
            .unwrap();
            assert_eq!(c.regions[0].engine, kind, "{name}");
        }
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = Config::parse(MINIMAL.as_bytes()).unwrap();
        assert_eq!(c.headers.cluster, "x-llm-cluster");
        assert_eq!(c.prefix.block_bytes, 64);
        assert_eq!(c.probe.tick_ms, 1000);
        assert_eq!(c.ladder.up_at, [1.00, 0.90, 0.75, 0.60, 0.45]);
        assert_eq!(c.ladder.levels.len(), 6);
        assert_eq!(c.default_region_index(), 0);
        assert_eq!(c.regions[1].engine, EngineKind::Vllm);
        assert!(c.tier_policy(5, "free").unwrap().shed);
        assert!(c.tier_policy(5, "critical").is_none());
    }

    fn err(json: &str) -> ConfigError {
        Config::parse(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(err("").field, "configuration");
        assert_eq!(err(r#"{"regions":[]}"#).field, "regions");
        let e = err(r#"{"regions":[{"name":"Bad Name","cluster":"c","capacity_rps":1}]}"#);
        assert_eq!(e.field, "regions[0].name");
        let e = err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":0}]}"#);
        assert_eq!(e.field, "regions[0].capacity_rps");
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1},{"name":"a","cluster":"d","capacity_rps":1}]}"#,
        );
        assert_eq!(e.field, "regions[1].name");
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"default_region":"zz"}"#,
        );
        assert_eq!(e.field, "default_region");
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"ladder":{"up_at":[1,0.9,0.75,0.6,0.45],"down_at":[1.1,0.8,0.85,0.7,0.55]}}"#,
        );
        assert_eq!(e.field, "ladder.down_at[1]");
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"probe":{"tick_ms":100,"timeout_ms":500}}"#,
        );
        assert_eq!(e.field, "probe.timeout_ms");
        for (probe, field) in [
            (
                r#"{"tick_ms":1000,"busy_tick_ms":1001}"#,
                "probe.busy_tick_ms",
            ),
            (r#"{"busy_tick_ms":49}"#, "probe.busy_tick_ms"),
            (r#"{"busy_utilization":0}"#, "probe.busy_utilization"),
            (r#"{"busy_utilization":-1}"#, "probe.busy_utilization"),
            (r#"{"idle_rounds":0}"#, "probe.idle_rounds"),
        ] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],"probe":{probe}}}"#
            ));
            assert_eq!(e.field, field, "{probe}");
        }
        // The busy period defaults to 250 ms, capped at the idle period;
        // equal to it, the probe does not adapt.
        let busy = |probe: &str| {
            Config::parse(
                format!(r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],"probe":{probe}}}"#)
                    .as_bytes(),
            )
            .unwrap()
            .probe
            .busy_tick_ms()
        };
        assert_eq!(busy("{}"), 250);
        assert_eq!(busy(r#"{"tick_ms":100,"timeout_ms":100}"#), 100);
        assert_eq!(busy(r#"{"busy_tick_ms":1000}"#), 1000);
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"headers":{"cluster":"X-Bad Header"}}"#,
        );
        assert_eq!(e.field, "headers.cluster");
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"tiers":{"default":"gold"}}"#,
        );
        assert_eq!(e.field, "tiers.default");
        for (ctx, field) in [
            (r#"{"margin":1}"#, "context.margin"),
            (r#"{"margin":-0.1}"#, "context.margin"),
            (r#"{"refresh_ticks":0}"#, "context.refresh_ticks"),
        ] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],"context":{ctx}}}"#
            ));
            assert_eq!(e.field, field, "{ctx}");
        }
        for (extra, field) in [
            (r#","load_source":"prometheus"}]"#, "prometheus.cluster"),
            (
                r#","prometheus_selector":"a{b}"}]"#,
                "regions[0].prometheus_selector",
            ),
            (
                r#","prometheus_selector":" "}]"#,
                "regions[0].prometheus_selector",
            ),
            (r#"}],"prometheus":{"path":"api"}"#, "prometheus.path"),
            (r#"}],"prometheus":{"path":"/q?x=1"}"#, "prometheus.path"),
        ] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1{extra}}}"#
            ));
            assert_eq!(e.field, field, "{extra}");
        }
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1,"load_source":"prometheus"}],"prometheus":{"cluster":"prom"}}"#,
        )
        .unwrap();
        assert_eq!(c.regions[0].selector(), r#"region="a""#);
        assert_eq!(c.prometheus.path, "/api/v1/query");
        for (resp, field) in [
            (r#"{"slots":0}"#, "responses.slots"),
            (r#"{"slots":4194305}"#, "responses.slots"),
            (r#"{"ttl_s":0}"#, "responses.ttl_s"),
            (r#"{"ttl_s":2592001}"#, "responses.ttl_s"),
        ] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],"responses":{resp}}}"#
            ));
            assert_eq!(e.field, field, "{resp}");
        }
        assert!(Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"responses":{"holder_unavailable":"maybe"}}"#
        )
        .is_err());
        let e =
            err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1,"models_path":"v1"}]}"#);
        assert_eq!(e.field, "regions[0].models_path");
        let c = Config::parse(MINIMAL.as_bytes()).unwrap();
        assert_eq!((c.context.margin, c.context.refresh_ticks), (0.1, 60));
        assert_eq!(c.regions[0].models_path, "/v1/models");
        // The near-tie draw's settings, once refused out of range, are
        // removed fields now: accepted, ignored, each with its warning.
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"cost":{"spread_margin_ms":-1,"spread_share":1.0}}"#,
        )
        .unwrap();
        assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
        assert!(c
            .warnings
            .iter()
            .all(|w| w.contains("near-tie draw is gone")));
        // So is the tie band, once refused when negative.
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],"cost":{"tie_ms":-1}}"#,
        )
        .unwrap();
        assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
        assert!(c.warnings[0].starts_with("cost.tie_ms is no longer a setting"));
        assert!(c.warnings[0].contains("exactly the least expected TTFT"));
        // What the plugin now measures or always does, even set to values
        // once refused: the fields beside them still apply.
        let c = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],
                "prefix":{"bytes_per_token":0,"block_bytes":128},
                "directory":{"learn_from_usage":false,"ttl_s":60},
                "cost":{"bounded_load_epsilon":-1,"bounded_load_floor":2,"placement_floor":0.5},
                "tuning":{"enabled":false,"window":64},
                "migration":{"enabled":false}}"#,
        )
        .unwrap();
        assert_eq!(
            (c.prefix.block_bytes, c.directory.ttl_s, c.tuning.window),
            (128, 60, 64)
        );
        assert_eq!(c.cost.placement_floor, 0.5);
        assert_eq!(c.warnings.len(), 5, "{:?}", c.warnings);
        assert!(c.warnings[0].starts_with("cost.bounded_load_epsilon is no longer a setting"));
        assert!(c.warnings[1].starts_with("cost.bounded_load_floor is no longer a setting"));
        assert!(c.warnings[1].contains("its wait exceeds what the move costs"));
        assert!(c.warnings[2].starts_with("prefix.bytes_per_token is no longer a setting"));
        assert!(c.warnings[2].contains("usage.prompt_tokens"));
        assert!(c.warnings[3].starts_with("directory.learn_from_usage is no longer"));
        assert!(c.warnings[4].starts_with("tuning.enabled is no longer a setting"));
        assert!(c.warnings[4].contains("tuning.w_queue_min"));
    }

    #[test]
    fn cache_tokens_is_a_positive_whole_number_of_tokens() {
        let parse = |v: &str| {
            Config::parse(
                format!(
                    r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}},{{"name":"b","cluster":"d","capacity_rps":1,"cache_tokens":{v}}}]}}"#
                )
                .as_bytes(),
            )
        };
        for (v, want) in [
            ("1", 1),
            ("262144", 262_144),
            ("1e6", 1_000_000),
            ("1000000000000", 1_000_000_000_000),
        ] {
            let c = parse(v).unwrap();
            assert_eq!(c.regions[1].cache_tokens(), Some(want), "{v}");
            assert_eq!(c.regions[0].cache_tokens(), None);
        }
        for v in [
            "0",
            "-1",
            "-262144",
            "1.5",
            "0.0",
            "1000000000001",
            "1e13",
            "18446744073709551616",
        ] {
            let e = parse(v).unwrap_err();
            assert_eq!(e.field, "regions[1].cache_tokens", "{v}");
            assert!(
                e.reason
                    .ends_with("must be a whole number of tokens in 1..=1000000000000"),
                "{v}: {e}"
            );
        }
        let e = parse("\"262144\"").unwrap_err();
        assert!(e.reason.contains("invalid type: string"), "{e}");
        let e = parse("null").unwrap();
        assert_eq!(e.regions[1].cache_tokens(), None);
    }

    #[test]
    fn unknown_and_mistyped_fields_are_refused_with_their_name() {
        let e = err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1,"capacity":3}]}"#);
        assert!(e.reason.contains("unknown field `capacity`"), "{e}");
        let e = err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":"ten"}]}"#);
        assert!(e.reason.contains("invalid type"), "{e}");
        let e =
            err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1,"engine":"trtllm"}]}"#);
        assert!(e.reason.contains("unknown variant `trtllm`"), "{e}");
        // The three families, by their names.
        assert!(
            e.reason
                .contains("expected one of `vllm`, `sglang`, `llamacpp`"),
            "{e}"
        );
        let e = err(
            r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1,"engine":"llama.cpp"}]}"#,
        );
        assert!(e.reason.contains("unknown variant `llama.cpp`"), "{e}");
    }

    #[test]
    fn ladder_levels_must_name_known_tiers() {
        let e = err(r#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],
            "ladder":{"levels":[{},{},{},{},{},{"gold":{"shed":true}}]}}"#);
        assert_eq!(e.field, "ladder.levels[5].gold");
    }

    #[test]
    fn residency_values_that_no_header_can_match_are_refused() {
        // Found by the `config` fuzz target: a key with surrounding
        // whitespace was accepted, and then had no mask.
        for key in [" eu", "eu ", "", "e\\u0001u", "\\u00e9u"] {
            let e = err(&format!(
                r#"{{"regions":[{{"name":"a","cluster":"c","capacity_rps":1}}],
                "residency":{{"header":"x-r","allowed":{{"{key}":["a"]}}}}}}"#
            ));
            assert!(e.field.starts_with("residency.allowed."), "{key:?}: {e}");
        }
        let ok = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}],
            "residency":{"header":"x-r","allowed":{"eu west":["a"]}}}"#,
        )
        .unwrap();
        assert_eq!(ok.residency_mask(" eu west "), Some(vec![true]));
    }

    #[test]
    fn nearest_region_is_lowest_configured_rtt() {
        let c = Config::parse(
            br#"{"regions":[{"name":"far","cluster":"f","capacity_rps":1,"rtt_ms":90},
                {"name":"near","cluster":"n","capacity_rps":1,"rtt_ms":4}]}"#,
        )
        .unwrap();
        assert_eq!(c.nearest_configured_region(), 1);
        assert_eq!(c.default_region_index(), 1);
    }
}
