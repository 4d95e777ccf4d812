//! The sections of how the router handles one request: the headers it reads
//! and sets, placement of prompts no region holds (`cost`), the body-wait
//! guard, and session migration (fetch or recompute a prefix's KV).

use serde::Deserialize;

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
