//! The fleet snapshot: what `probe` publishes to shared data
//! (`names::SNAPSHOT_KEY`) and the filters read. JSON, versioned; the
//! filters copy and decode it only when the probe's version gauge says it
//! changed (`view`).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Snapshot {
    /// Increases by one with every publication.
    pub version: u64,
    /// When the probe built it (ms since the Unix epoch).
    pub generated_ms: u64,
    /// Degraded-mode ladder level, 0..=5.
    pub level: u8,
    /// Healthy capacity over measured demand; absent while there is no demand.
    pub ratio: Option<f64>,
    /// Measured arrival rate of inference requests (EWMA, requests/s).
    pub demand_rps: f64,
    /// Sum of `capacity_rps` over routable regions (ramping ones in
    /// proportion, optionally scaled by KV headroom).
    pub capacity_rps: f64,
    /// When the level last changed.
    pub level_changed_ms: u64,
    /// The declare-disaster assessment.
    #[serde(default)]
    pub assessment: crate::fleet::assess::Assessment,
    /// How long the deployment's prompts wait to be used again: the share
    /// of reused tokens per gap bucket (`learning::reuse`); empty: none
    /// seen yet.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reuse_gaps: Vec<f64>,
    pub regions: Vec<RegionState>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionState {
    pub name: String,
    pub healthy: bool,
    /// Unhealthy only because its health probes went unanswered (timed
    /// out), perhaps answering well again since (recovering, short of
    /// `probe.healthy_after`): not ejected for failing requests, and no
    /// probe since answered that it is down. An engine busy decoding on few
    /// cores looks the same as a dead one here; a follow-up to a response
    /// stored only there is still sent (it is the one place that can answer
    /// it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub unanswered: bool,
    /// Measured round trip of the health probe (EWMA, ms); absent until the
    /// first success.
    pub rtt_ms: Option<f64>,
    /// Engine-reported requests waiting and running at the last good scrape.
    pub waiting: f64,
    pub running: f64,
    /// Engine KV-cache usage 0..1, when reported.
    pub kv_usage: Option<f64>,
    /// Engine prefix-cache hit ratio 0..1, when reported.
    pub prefix_hit_rate: Option<f64>,
    /// This Envoy's in-flight requests to the region when the engine counts
    /// were scraped: the router adds only what changed since then, so its own
    /// requests are not counted twice.
    pub inflight_at_scrape: f64,
    /// How many more requests the deployment's other Envoys have in flight
    /// to the region than at that scrape, as their exchange messages said
    /// (the probe's figure at publication; 0 without the exchange).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub peer_inflight_delta: f64,
    /// Requests the engine finishes per second, measured from its
    /// completions counter over the probe's scrapes; absent: not measured
    /// (the router then takes the queue as scraped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_rps: Option<f64>,
    /// Tokens the engine's prefix cache serves a second, measured from its
    /// hits counter like `drain_rps`; absent: not measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_tokens_per_s: Option<f64>,
    /// When the engine counts were scraped (the answer's arrival, ms since
    /// the Unix epoch); absent before the first good scrape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scraped_ms: Option<u64>,
    /// Whether the last `/metrics` scrape succeeded.
    pub metrics_ok: bool,
    /// The engine's load is not known: its last `probe.unhealthy_after`
    /// scrapes failed (no answer, an error status, garbage, or none of its
    /// family's load series). `waiting` and `running` are then the last
    /// good scrape's, if any, and the router prices the region as full,
    /// never as idle (`cost`, its occupancy).
    #[serde(default, skip_serializing_if = "is_false")]
    pub load_unknown: bool,
    /// Prefill rate refined from observed TTFT; absent: the configured one.
    #[serde(default)]
    pub prefill_ms_per_token: Option<f64>,
    /// The per-request part of the prefill time fitted with that rate (ms);
    /// absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_ms_per_request: Option<f64>,
    /// The release digest the region reports, if read.
    #[serde(default)]
    pub release: Option<String>,
    /// False when parity is checked and the region's release differs (or is
    /// unknown): it then gets no new traffic.
    #[serde(default = "yes")]
    pub release_ok: bool,
    /// Share (0..1) of new requests the region may take while it ramps back
    /// in after becoming routable again; 1 when not ramping.
    #[serde(default = "one")]
    pub ramp: f64,
    /// Engine tokens per byte of the router's canonical prompt text,
    /// measured from the engine's `usage.prompt_tokens`; absent: not yet
    /// measured (4 bytes per token, `tokens::PRIOR_TOKENS_PER_BYTE`, is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_byte: Option<f64>,
    /// The same per model the requests named (a few at most).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_tokens_per_byte: Vec<(String, f64)>,
    /// Age beyond which the region's engine is not believed to still hold
    /// a prefix (learnt from its `cached_tokens`); absent: the directory TTL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_horizon_ms: Option<u64>,
    /// Share 0..1 of the believed cached tokens the engine confirms lately;
    /// absent: not measured (taken as 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_reliability: Option<f64>,
    /// The engine's context limit in tokens (`max_model_len` in its model
    /// list); absent until read, or when it does not say.
    #[serde(default)]
    pub max_model_len: Option<u32>,
    /// Whether the region's engine keeps the Responses it produces, once
    /// the probe has checked one (`GET /v1/responses/{id}`); absent: not
    /// known, and a response is followed there as if kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stores_responses: Option<bool>,
    /// The models and LoRA adapters the engine's model list names (each
    /// card's `id`); empty: not read, or more than the router keeps
    /// (`limits::MAX_LISTED_MODELS`), and then it is taken to serve any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// Engine replicas behind the region's entry point, from the
    /// `prometheus` load source; absent: one (`max_concurrency` is then the
    /// region's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// KV-cache capacity of the region in tokens: the configured
    /// `cache_tokens`, else the engines' own figure (vLLM
    /// `cache_config_info`, SGLang `max_total_num_tokens`); absent when
    /// neither says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_tokens: Option<u64>,
    /// What the engine's prefix cache holds, per replica:
    /// `cache_tokens / replicas`;
    /// absent when the capacity is unknown (the directory then forgets by
    /// its TTL, or the learnt horizon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_free_tokens: Option<f64>,
    /// The engine's intake clock, per replica: (ms, tokens taken into its
    /// cache since the first point), back to where `cache_free_tokens` had
    /// gone in; the directory's entries are aged by it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache_clock: Vec<(u64, f64)>,
    /// When the probe last saw the region's engine restart (ms since the
    /// Unix epoch; `fleet::restart`): its prefix cache then held nothing,
    /// so no entry stamped before it is believed, whoever wrote it (this
    /// Envoy or a peer through the exchange). Absent: none seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_reset_ms: Option<u64>,
    /// Tokens per block of the region's engine cache, which serves whole
    /// blocks only (vLLM's `block_size`, SGLang's page size): the cost
    /// rounds the cached tokens it believes down to them. Absent: not
    /// known (llama.cpp), no rounding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_tokens: Option<u32>,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

fn is_false(v: &bool) -> bool {
    !*v
}

impl RegionState {
    /// Slots the region runs at once: `max_concurrency` per replica.
    pub fn slots(&self, max_concurrency: u32) -> u32 {
        max_concurrency
            .max(1)
            .saturating_mul(self.replicas.unwrap_or(1).max(1))
    }
}

impl Default for RegionState {
    fn default() -> Self {
        RegionState {
            name: String::new(),
            healthy: false,
            unanswered: false,
            rtt_ms: None,
            waiting: 0.0,
            running: 0.0,
            kv_usage: None,
            prefix_hit_rate: None,
            inflight_at_scrape: 0.0,
            peer_inflight_delta: 0.0,
            drain_rps: None,
            hit_tokens_per_s: None,
            scraped_ms: None,
            metrics_ok: false,
            load_unknown: false,
            prefill_ms_per_token: None,
            prefill_ms_per_request: None,
            stores_responses: None,
            release: None,
            release_ok: true,
            ramp: 1.0,
            tokens_per_byte: None,
            model_tokens_per_byte: Vec::new(),
            cache_horizon_ms: None,
            cache_reliability: None,
            max_model_len: None,
            models: Vec::new(),
            replicas: None,
            cache_tokens: None,
            cache_free_tokens: None,
            cache_clock: Vec::new(),
            cache_reset_ms: None,
            block_tokens: None,
        }
    }
}

fn yes() -> bool {
    true
}

fn one() -> f64 {
    1.0
}

impl Snapshot {
    /// The state of configured region `i`, where `index` maps configured
    /// regions to their entries in this snapshot (`View` builds it).
    pub fn region_at(&self, index: &[Option<usize>], i: usize) -> Option<&RegionState> {
        index
            .get(i)
            .copied()
            .flatten()
            .and_then(|j| self.regions.get(j))
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Snapshot, String> {
        let s: Snapshot = serde_json::from_slice(bytes)
            .map_err(|e| format!("fleet snapshot is not valid: {e}"))?;
        if s.level > crate::fleet::ladder::MAX_LEVEL {
            return Err(format!("fleet snapshot level {} is out of range", s.level));
        }
        Ok(s)
    }

    /// A snapshot in which every configured region is healthy at its
    /// configured RTT (for tests, tools and the first moments of a probe).
    pub fn all_healthy(cfg: &crate::config::Config) -> Snapshot {
        Snapshot {
            regions: cfg
                .regions
                .iter()
                .map(|r| RegionState {
                    name: r.name.clone(),
                    healthy: true,
                    rtt_ms: Some(r.rtt_ms),
                    ..RegionState::default()
                })
                .collect(),
            ..Snapshot::default()
        }
    }

    pub fn region(&self, name: &str) -> Option<&RegionState> {
        self.regions.iter().find(|r| r.name == name)
    }

    pub fn is_fresh(&self, now_ms: u64, max_age_ms: u64) -> bool {
        now_ms.saturating_sub(self.generated_ms) <= max_age_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let s = Snapshot {
            version: 3,
            generated_ms: 10,
            level: 2,
            ratio: Some(0.8),
            regions: vec![RegionState {
                name: "a".into(),
                healthy: true,
                rtt_ms: Some(4.5),
                ..RegionState::default()
            }],
            ..Snapshot::default()
        };
        assert_eq!(Snapshot::decode(&s.encode()).unwrap(), s);
        assert!(Snapshot::decode(b"\x00garbage").is_err());
        assert!(Snapshot::decode(br#"{"version":1}"#).is_err());
        let mut bad = s.clone();
        bad.level = 9;
        assert!(Snapshot::decode(&bad.encode()).is_err());
        assert!(s.is_fresh(1010, 1000) && !s.is_fresh(1011, 1000));
    }

    #[test]
    fn the_context_limit_round_trips_and_older_snapshots_still_decode() {
        let mut s = Snapshot::default();
        s.regions.push(RegionState {
            name: "a".into(),
            max_model_len: Some(32768),
            ..RegionState::default()
        });
        assert_eq!(Snapshot::decode(&s.encode()).unwrap(), s);
        // Published before the limit existed: no field, limit unknown.
        let old = br#"{"version":1,"generated_ms":1,"level":0,"ratio":null,"demand_rps":0,
            "capacity_rps":0,"level_changed_ms":0,"regions":[{"name":"a","healthy":true,
            "rtt_ms":null,"waiting":0,"running":0,"kv_usage":null,"prefix_hit_rate":null,
            "inflight_at_scrape":0,"metrics_ok":false}]}"#;
        assert_eq!(
            Snapshot::decode(old).unwrap().regions[0].max_model_len,
            None
        );
        assert_eq!(Snapshot::decode(old).unwrap().regions[0].cache_tokens, None);
        assert_eq!(
            Snapshot::decode(old).unwrap().regions[0].cache_reset_ms,
            None
        );
    }

    #[test]
    fn a_restart_round_trips_and_a_garbled_one_is_refused() {
        let mut s = Snapshot::default();
        s.regions.push(RegionState {
            name: "a".into(),
            cache_reset_ms: Some(1_700_000_000_123),
            ..RegionState::default()
        });
        s.regions.push(RegionState {
            name: "b".into(),
            ..RegionState::default()
        });
        let bytes = s.encode();
        assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text.matches("cache_reset_ms").count(), 1, "{text}");
        for bad in ["-1", "\"soon\"", "1.5", "1e30", "[1]"] {
            let garbled = text.replace("1700000000123", bad);
            assert!(Snapshot::decode(garbled.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_block_round_trips_and_a_garbled_one_is_refused() {
        let mut s = Snapshot::default();
        s.regions.push(RegionState {
            name: "a".into(),
            block_tokens: Some(128),
            ..RegionState::default()
        });
        s.regions.push(RegionState {
            name: "b".into(),
            ..RegionState::default()
        });
        let bytes = s.encode();
        assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(text.matches("\"block_tokens\":128").count(), 1, "{text}");
        for bad in ["-1", "\"16\"", "1.5", "4294967296", "[16]"] {
            let garbled = text.replace("\"block_tokens\":128", &format!("\"block_tokens\":{bad}"));
            assert!(Snapshot::decode(garbled.as_bytes()).is_err(), "{bad}");
        }
        // Published before it existed: no block, no rounding.
        let old = br#"{"version":1,"generated_ms":1,"level":0,"ratio":null,"demand_rps":0,
            "capacity_rps":0,"level_changed_ms":0,"regions":[{"name":"a","healthy":true,
            "rtt_ms":null,"waiting":0,"running":0,"kv_usage":null,"prefix_hit_rate":null,
            "inflight_at_scrape":0,"metrics_ok":false}]}"#;
        assert_eq!(Snapshot::decode(old).unwrap().regions[0].block_tokens, None);
    }

    #[test]
    fn the_cache_capacity_round_trips_and_is_left_out_when_unknown() {
        let mut s = Snapshot::default();
        s.regions.push(RegionState {
            name: "a".into(),
            cache_tokens: Some(1_000_000_000_000),
            ..RegionState::default()
        });
        s.regions.push(RegionState {
            name: "b".into(),
            ..RegionState::default()
        });
        let bytes = s.encode();
        assert_eq!(Snapshot::decode(&bytes).unwrap(), s);
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(
            text.matches("\"cache_tokens\":1000000000000").count(),
            1,
            "{text}"
        );
        assert_eq!(text.matches("cache_tokens").count(), 1, "{text}");
    }
}
