//! The whole configuration document: `Config`, one field per section, its
//! parse (removed fields stripped, unknown ones refused) and validation
//! entry, and the lookups the roots make on it.

use serde::Deserialize;

use crate::config::cache::{DirectoryConfig, ExchangeConfig, PrefixConfig, ResponsesConfig};
use crate::config::error::{
    fraction, non_negative, positive, valid_header_name, valid_name, ConfigError,
};
use crate::config::ladder::{LadderConfig, TierConfig, TierPolicy};
use crate::config::probe::{AssessmentConfig, ContextConfig, ProbeConfig, ReleaseConfig};
use crate::config::regions::{
    whole_tokens, LoadSource, PrometheusConfig, Region, ResidencyConfig, MAX_REGIONS,
};
use crate::config::removed::{strip_removed, warned_key};
use crate::config::routing::{BodyWaitConfig, CostConfig, Headers, MigrationConfig};

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The complete replicas this proxy routes to, in any order.
    pub regions: Vec<Region>,
    /// One line per removed field the configuration still sets (see
    /// [`REMOVED_FIELDS`](crate::config::removed::REMOVED_FIELDS)):
    /// accepted, ignored, and logged once per Envoy.
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

    /// The exchange's send period, ms.
    pub fn exchange_interval_ms(&self) -> u64 {
        u64::from(self.exchange.interval_ms.unwrap_or(self.probe.tick_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::metrics::EngineKind;

    const MINIMAL: &str = r#"{"regions":[{"name":"near","cluster":"c_near","capacity_rps":10,"rtt_ms":5},
        {"name":"far","cluster":"c_far","capacity_rps":10,"rtt_ms":120}]}"#;

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
        assert!(c.warnings[4].contains("the prefill times are always fitted"));
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
