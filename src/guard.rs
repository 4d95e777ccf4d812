//! The guard's policy: who the caller is (tier), and what the current ladder
//! level does to their request: serve it, shed it (429 with a jittered
//! `Retry-After`), refuse a prompt over the level's cap (413), or clamp
//! `max_tokens` / `max_completion_tokens` in the body.
//!
//! The tier never comes from the client: an API key's SHA-256 in the
//! configured map, else the tier header only when the operator declares it
//! trusted (a filter before the guard always overwrites it), else the
//! default tier.

use sha2::{Digest, Sha256};

use crate::config::{Config, TierPolicy};
use crate::prefix::PromptHasher;
use crate::request::{self, Endpoint, InferenceRequest, RequestError};

/// The caller's tier.
pub fn resolve_tier<'c>(
    cfg: &'c Config,
    authorization: Option<&str>,
    tier_header: Option<&str>,
) -> &'c str {
    let t = &cfg.tiers;
    if !t.api_keys.is_empty() {
        if let Some(key) = authorization.and_then(bearer_token) {
            let digest = Sha256::digest(key.as_bytes());
            let hex = hex(&digest);
            if let Some(tier) = t.api_keys.get(&hex) {
                return tier;
            }
        }
    }
    if t.trust_header {
        if let Some(v) = tier_header {
            if let Some(name) = t.names.iter().find(|n| n.as_str() == v.trim()) {
                return name;
            }
        }
    }
    &t.default
}

fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(
            DIGITS.get(usize::from(b >> 4)).copied().unwrap_or(b'0'),
        ));
        s.push(char::from(
            DIGITS.get(usize::from(b & 15)).copied().unwrap_or(b'0'),
        ));
    }
    s
}

/// The lowercase hex SHA-256 of an API key, as `tiers.api_keys` expects.
pub fn api_key_digest(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes()))
}

/// What the guard does with one request once it has seen the body.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Pass,
    PromptTooLong {
        tokens: u64,
        limit: u64,
    },
    /// Serve with this body instead: max tokens clamped (`clamped`) and/or
    /// the model rewritten for the fallback pool.
    Rewrite {
        body: Vec<u8>,
        clamped: bool,
    },
}

/// True when the policy needs the body to decide (a cap on length) or to
/// change it (a model rewrite).
pub fn needs_body(policy: &TierPolicy) -> bool {
    !policy.shed
        && (policy.max_prompt_tokens.is_some()
            || policy.max_tokens.is_some()
            || (policy.fallback && policy.fallback_model.is_some()))
}

/// A body whose top-level `model` is `model` (replaced, or added).
pub fn rewrite_model(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let value = serde_json::to_vec(model).ok()?;
    match request::top_level_value_span(body, "model") {
        Some(span) => {
            let mut out = Vec::with_capacity(body.len() + value.len());
            out.extend_from_slice(body.get(..span.start)?);
            out.extend_from_slice(&value);
            out.extend_from_slice(body.get(span.end..)?);
            Some(out)
        }
        None => {
            let open = body.iter().position(|&b| b == b'{')?;
            let rest = body.get(open + 1..)?;
            let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
            let mut out = Vec::with_capacity(body.len() + value.len() + 10);
            out.extend_from_slice(body.get(..=open)?);
            out.extend_from_slice(b"\"model\":");
            out.extend_from_slice(&value);
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(rest);
            Some(out)
        }
    }
}

/// Apply a level's caps to a body.
pub fn check_body(
    cfg: &Config,
    policy: &TierPolicy,
    endpoint: Endpoint,
    body: &[u8],
) -> Result<Verdict, RequestError> {
    let req = request::parse(endpoint, body, PromptHasher::counting_only())?;
    if let Some(limit) = policy.max_prompt_tokens {
        let tokens = req.prompt_tokens(cfg.prefix.bytes_per_token);
        if tokens > limit {
            return Ok(Verdict::PromptTooLong { tokens, limit });
        }
    }
    let clamped = policy
        .max_tokens
        .and_then(|limit| clamp_max_tokens(body, &req, limit));
    let was_clamped = clamped.is_some();
    let current = clamped.as_deref().unwrap_or(body);
    let rewritten = match (&policy.fallback_model, policy.fallback) {
        (Some(model), true) => rewrite_model(current, model),
        _ => None,
    };
    match rewritten.or(clamped) {
        Some(body) => Ok(Verdict::Rewrite {
            body,
            clamped: was_clamped,
        }),
        None => Ok(Verdict::Pass),
    }
}

/// A body whose `max_tokens` and `max_completion_tokens` are at most
/// `limit`: values above it (or null) are replaced in place, and when
/// neither is present `max_tokens` is added. `None` when nothing changes.
pub fn clamp_max_tokens(body: &[u8], req: &InferenceRequest, limit: u64) -> Option<Vec<u8>> {
    let over = |v: Option<u64>| v.is_none_or(|v| v > limit);
    let mut spans = Vec::new();
    for (key, value) in [
        ("max_tokens", req.max_tokens),
        ("max_completion_tokens", req.max_completion_tokens),
    ] {
        if let Some(span) = request::top_level_value_span(body, key) {
            if over(value) {
                spans.push(span);
            }
        }
    }
    let present = request::top_level_value_span(body, "max_tokens").is_some()
        || request::top_level_value_span(body, "max_completion_tokens").is_some();
    let number = limit.to_string();
    if !present {
        let open = body.iter().position(|&b| b == b'{')?;
        let rest = body.get(open + 1..)?;
        let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(body.get(..=open)?);
        out.extend_from_slice(b"\"max_tokens\":");
        out.extend_from_slice(number.as_bytes());
        if !empty {
            out.push(b',');
        }
        out.extend_from_slice(rest);
        return Some(out);
    }
    if spans.is_empty() {
        return None;
    }
    spans.sort_by_key(|s| s.start);
    let mut out = Vec::with_capacity(body.len());
    let mut at = 0;
    for s in spans {
        out.extend_from_slice(body.get(at..s.start)?);
        out.extend_from_slice(number.as_bytes());
        at = s.end;
    }
    out.extend_from_slice(body.get(at..)?);
    Some(out)
}

/// Path of the operator's runtime ladder override.
pub const OPERATOR_PATH: &str = "/llm-geo-router/ladder";

/// True when `authorization` carries an operator token of `cfg`.
pub fn is_operator(cfg: &Config, authorization: Option<&str>) -> bool {
    let Some(token) = authorization.and_then(bearer_token) else {
        return false;
    };
    let digest = api_key_digest(token);
    cfg.ladder.operator_keys.contains(&digest)
}

/// The override an operator asked for: `{"level": 0..=5}` sets it,
/// `{"level": null}` clears it.
pub fn parse_override(body: &[u8]) -> Result<Option<u8>, String> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        level: Option<u8>,
    }
    let r: Req = serde_json::from_slice(body)
        .map_err(|e| format!("expected {{\"level\": 0..=5 or null}}: {e}"))?;
    match r.level {
        Some(l) if l > crate::ladder::MAX_LEVEL => Err(format!("level {l} is out of range 0..=5")),
        other => Ok(other),
    }
}

/// `Retry-After` seconds for a shed response, uniform over the configured
/// range by `entropy` (anything that differs per request).
pub fn retry_after_s(cfg: &Config, entropy: u64) -> u32 {
    let [lo, hi] = cfg.ladder.retry_after_s;
    let span = u64::from(hi.saturating_sub(lo)) + 1;
    let mixed = xxhash_rust::xxh3::xxh3_64(&entropy.to_le_bytes());
    lo + (mixed % span) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        Config::parse(
            format!(r#"{{"regions":[{{"name":"a","cluster":"a","capacity_rps":1}}]{extra}}}"#)
                .as_bytes(),
        )
        .unwrap()
    }

    #[test]
    fn tier_comes_from_keys_or_trusted_header_only() {
        let key_hash = api_key_digest("sk-paid-1");
        assert_eq!(key_hash.len(), 64);
        let c = cfg(&format!(
            r#","tiers":{{"api_keys":{{"{key_hash}":"paid"}}}}"#
        ));
        assert_eq!(resolve_tier(&c, Some("Bearer sk-paid-1"), None), "paid");
        assert_eq!(resolve_tier(&c, Some("bearer  sk-paid-1 "), None), "paid");
        assert_eq!(
            resolve_tier(&c, Some("Bearer sk-other"), Some("critical")),
            "free"
        );
        assert_eq!(resolve_tier(&c, None, Some("critical")), "free");
        let trusted = cfg(r#","tiers":{"trust_header":true}"#);
        assert_eq!(resolve_tier(&trusted, None, Some("critical")), "critical");
        assert_eq!(resolve_tier(&trusted, None, Some("gold")), "free");
    }

    fn clamp(body: &str, limit: u64) -> Option<String> {
        let req = request::parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            PromptHasher::counting_only(),
        )
        .unwrap();
        clamp_max_tokens(body.as_bytes(), &req, limit).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn clamping_rewrites_only_what_is_over() {
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(
            clamp(&format!(r#"{{{m},"max_tokens":5000}}"#), 100).unwrap(),
            format!(r#"{{{m},"max_tokens":100}}"#)
        );
        assert_eq!(clamp(&format!(r#"{{{m},"max_tokens":50}}"#), 100), None);
        assert_eq!(
            clamp(
                &format!(r#"{{"max_completion_tokens":null,{m},"max_tokens":9000}}"#),
                64
            )
            .unwrap(),
            format!(r#"{{"max_completion_tokens":64,{m},"max_tokens":64}}"#)
        );
        assert_eq!(
            clamp(&format!(r#" {{ {m} }}"#), 7).unwrap(),
            format!(r#" {{"max_tokens":7, {m} }}"#)
        );
        let out = clamp(&format!(r#"{{{m},"max\u005ftokens":900}}"#), 10).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["max_tokens"], 10);
    }

    #[test]
    fn prompt_cap_and_verdicts() {
        let c = cfg("");
        let policy = TierPolicy {
            max_prompt_tokens: Some(10),
            max_tokens: Some(20),
            ..TierPolicy::default()
        };
        let long = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(100)
        );
        assert_eq!(
            check_body(&c, &policy, Endpoint::ChatCompletions, long.as_bytes()).unwrap(),
            Verdict::PromptTooLong {
                tokens: 27,
                limit: 10
            }
        );
        let short = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;
        assert_eq!(
            check_body(&c, &policy, Endpoint::ChatCompletions, short.as_bytes()).unwrap(),
            Verdict::Pass
        );
        assert!(check_body(&c, &policy, Endpoint::ChatCompletions, b"{oops").is_err());
    }

    #[test]
    fn operator_override_requests() {
        let key = api_key_digest("op-secret");
        let c = cfg(&format!(r#","ladder":{{"operator_keys":["{key}"]}}"#));
        assert!(is_operator(&c, Some("Bearer op-secret")));
        assert!(!is_operator(&c, Some("Bearer nope")));
        assert!(!is_operator(&cfg(""), Some("Bearer op-secret")));
        assert_eq!(parse_override(br#"{"level":3}"#), Ok(Some(3)));
        assert_eq!(parse_override(br#"{"level":null}"#), Ok(None));
        assert!(parse_override(br#"{"level":9}"#).is_err());
        assert!(parse_override(br#"{"lvl":1}"#).is_err());
        assert!(parse_override(b"garbage").is_err());
    }

    #[test]
    fn fallback_model_is_rewritten_with_the_clamp() {
        let c = cfg("");
        let policy = TierPolicy {
            max_tokens: Some(20),
            fallback: true,
            fallback_model: Some("chat-70b-int4".into()),
            ..TierPolicy::default()
        };
        assert!(needs_body(&policy));
        let body =
            r#"{"model":"chat-70b","messages":[{"role":"user","content":"hi"}],"max_tokens":500}"#;
        let Verdict::Rewrite { body, clamped } =
            check_body(&c, &policy, Endpoint::ChatCompletions, body.as_bytes()).unwrap()
        else {
            panic!("expected a rewrite")
        };
        assert!(clamped);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (v["model"].as_str(), v["max_tokens"].as_u64()),
            (Some("chat-70b-int4"), Some(20))
        );
        let added = rewrite_model(br#"{"prompt":"x"}"#, "m\"q").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&added).unwrap();
        assert_eq!(v["model"], "m\"q");
    }

    #[test]
    fn retry_after_is_spread_over_the_range() {
        let c = cfg(r#","ladder":{"retry_after_s":[5,14]}"#);
        let values: Vec<u32> = (0..2000).map(|i| retry_after_s(&c, i)).collect();
        assert!(values.iter().all(|v| (5..=14).contains(v)));
        for v in 5..=14 {
            let n = values.iter().filter(|&&x| x == v).count();
            assert!((120..=280).contains(&n), "{v}: {n}");
        }
    }
}
