//! The sections of what the router remembers of the engines' caches
//! (src/cache/): prefix hashing, the prefix directory, the exchange that
//! shares what each Envoy learns, and the stored responses' map.

use serde::Deserialize;

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

/// The exchange between the Envoys of one deployment (`src/cache/exchange/`).
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
