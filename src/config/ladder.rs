//! The guard's sections: the degraded-mode ladder (its thresholds and the
//! caps each level applies to each tier, with the seed's defaults) and the
//! tiers callers are sorted into.

use serde::Deserialize;
use std::collections::BTreeMap;

/// Number of rungs above level 0 on the degraded-mode ladder.
pub const LADDER_RUNGS: usize = 5;

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
