//! The regions a configuration names (each one's cluster, engine, capacity
//! and where its load figures come from), the Prometheus API that source
//! queries, and the residency sets that confine a request to some of them.

use serde::Deserialize;
use std::collections::BTreeMap;

use crate::engines::metrics::EngineKind;

/// Largest number of regions one configuration may name: a directory entry
/// keeps one timestamp per region, and stats names carry the region.
pub const MAX_REGIONS: usize = 64;

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

/// A token count in 1..=`metrics::MAX_CACHE_TOKENS`; `1e6` is as good as
/// `1000000`, `1.5` or `-1` is none.
pub(super) fn whole_tokens(n: &serde_json::Number) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::document::Config;

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
}
