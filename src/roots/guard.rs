//! The guard: who the caller is (tier), and what the current ladder level
//! does to their request: serve it, shed it (429 with a jittered
//! `Retry-After`), refuse a prompt over the level's cap (413), clamp
//! `max_tokens` / `max_completion_tokens` in the body, or send it to the
//! fallback pool. The policy functions, then the filter itself
//! ([`GuardStream`]), which also answers the operator's ladder override.
//! At a level with no caps for the tier the body is not read.
//!
//! The tier never comes from the client: an API key's SHA-256 in the
//! configured map, else the tier header only when the operator declares it
//! trusted (a filter before the guard always overwrites it), else the
//! default tier.

use std::cell::Cell;
use std::rc::Rc;

use sha2::{Digest, Sha256};

use crate::config::{Config, InvalidRequests, TierPolicy};
use crate::fleet::snapshot::Snapshot;
use crate::fleet::view::View;
use crate::request::openai::{self, BodyKind, Endpoint, InferenceRequest, RequestError};
use crate::request::prefix::PromptHasher;
use crate::shared::flow::{Flow, Reply};
use crate::shared::host_api::{Level, StreamHost};
use crate::shared::names::{Global, Stat, TierStat, LADDER_OVERRIDE_KEY, POOL_FALLBACK};

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
    match openai::top_level_value_span(body, "model") {
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

/// Apply a level's caps to a body. Prompt tokens are counted at the
/// tokens per byte the engines' usage taught (the fleet's mean, for the
/// request's model where measured; 4 bytes per token before any).
pub fn check_body(
    policy: &TierPolicy,
    endpoint: Endpoint,
    body: &[u8],
    snapshot: Option<&Snapshot>,
) -> Result<Verdict, RequestError> {
    let req = openai::parse(endpoint, body, PromptHasher::counting_only())?;
    if let Some(limit) = policy.max_prompt_tokens {
        let tpb = crate::fleet::tokens::fleet_tokens_per_byte(snapshot, req.model.as_deref());
        let tokens = crate::fleet::tokens::tokens_of(req.prompt.bytes, tpb);
        if tokens > limit {
            return Ok(Verdict::PromptTooLong { tokens, limit });
        }
    }
    let clamped = policy
        .max_tokens
        .and_then(|limit| clamp_max_tokens(endpoint, body, &req, limit));
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

/// A body whose output-token limits are at most `limit`: `max_tokens` and
/// `max_completion_tokens` (the Responses API: `max_output_tokens`). Values
/// above it (or null) are replaced in place, and when none is present the
/// first is added. `None` when nothing changes.
pub fn clamp_max_tokens(
    endpoint: Endpoint,
    body: &[u8],
    req: &InferenceRequest,
    limit: u64,
) -> Option<Vec<u8>> {
    let over = |v: Option<u64>| v.is_none_or(|v| v > limit);
    let fields: &[(&str, Option<u64>)] = match endpoint {
        Endpoint::Responses => &[("max_output_tokens", req.max_tokens)],
        _ => &[
            ("max_tokens", req.max_tokens),
            ("max_completion_tokens", req.max_completion_tokens),
        ],
    };
    let mut spans = Vec::new();
    let mut present = false;
    for (key, value) in fields {
        if let Some(span) = openai::top_level_value_span(body, key) {
            present = true;
            if over(*value) {
                spans.push(span);
            }
        }
    }
    let added = fields.first().map_or("max_tokens", |(k, _)| *k);
    let number = limit.to_string();
    if !present {
        let open = body.iter().position(|&b| b == b'{')?;
        let rest = body.get(open + 1..)?;
        let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(body.get(..=open)?);
        out.push(b'"');
        out.extend_from_slice(added.as_bytes());
        out.extend_from_slice(b"\":");
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
        Some(l) if l > crate::fleet::ladder::MAX_LEVEL => {
            Err(format!("level {l} is out of range 0..=5"))
        }
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

// ---------------------------------------------------------------- the filter

/// The guard filter's per-configuration state (one per root context).
#[derive(Debug)]
pub struct Guard {
    pub cfg: Rc<Config>,
    /// Mixed into each `Retry-After` so that shed clients spread out.
    entropy: Cell<u64>,
    /// The level this worker last wrote to `guard.level` (written on change).
    level_written: Cell<Option<u8>>,
}

impl Guard {
    pub fn new(cfg: Rc<Config>, seed: u64) -> Guard {
        Guard {
            cfg,
            entropy: Cell::new(seed),
            level_written: Cell::new(None),
        }
    }
}

/// What the guard waits for the body to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    Nothing,
    /// The operator's override request.
    Operator,
    /// A capped request: its endpoint, the level and the tier (index).
    Caps(Endpoint, u8, usize),
}

/// The guard on one request. Events in, flow out; what it does to the
/// request goes through the host.
#[derive(Debug)]
pub struct GuardStream {
    waiting: Waiting,
    /// The snapshot the level came from: its measured tokens per byte
    /// count a capped prompt as the engines do.
    snapshot: Option<Rc<Snapshot>>,
}

impl Default for GuardStream {
    fn default() -> Self {
        GuardStream {
            waiting: Waiting::Nothing,
            snapshot: None,
        }
    }
}

impl GuardStream {
    pub fn new() -> GuardStream {
        GuardStream::default()
    }

    /// The request headers arrived.
    pub fn on_request_headers(
        &mut self,
        guard: &Guard,
        host: &mut dyn StreamHost,
        view: &mut View,
        end_of_stream: bool,
    ) -> Flow {
        let cfg = &*guard.cfg;
        let authorization = host.request_header("authorization");
        let claimed = host.request_header(&cfg.headers.tier);
        let tier = resolve_tier(cfg, authorization.as_deref(), claimed.as_deref());
        // Downstream filters and the engine see the resolved tier, never the
        // client's claim; only the guard chooses the pool.
        if claimed.as_deref() != Some(tier) {
            write_header(host, &cfg.headers.tier, Some(tier));
        }
        if host.request_header(&cfg.headers.pool).is_some() {
            write_header(host, &cfg.headers.pool, None);
        }
        let path = host.request_header(":path").unwrap_or_default();
        let method = host.request_header(":method").unwrap_or_default();
        if !cfg.ladder.operator_keys.is_empty() && path.split('?').next() == Some(OPERATOR_PATH) {
            if !is_operator(cfg, authorization.as_deref()) {
                return Flow::Reply(Reply::error(
                    403,
                    "permission_error",
                    "forbidden",
                    "operator token required",
                    None,
                    &[],
                ));
            }
            if method != "POST" {
                return Flow::Reply(Reply::error(
                    405,
                    "invalid_request_error",
                    "method_not_allowed",
                    "use POST with {\"level\": 0..=5 or null}",
                    None,
                    &[("allow", "POST".to_string())],
                ));
            }
            self.waiting = Waiting::Operator;
            return self.body_or_pause(guard, host, end_of_stream);
        }
        let Some(endpoint) = openai::endpoint(&method, &path) else {
            return Flow::Continue;
        };
        host.count(Stat::Global(Global::Arrivals), 1);
        // The level of the fresh snapshot; 0 without one: the guard never
        // refuses on stale data.
        let now_ms = host.now_ms();
        let fresh = view.current(cfg, host, now_ms);
        let level = fresh.as_ref().map_or(0, |f| f.level());
        if guard.level_written.get() != Some(level) {
            guard.level_written.set(Some(level));
            host.set_gauge(Stat::Global(Global::GuardLevel), u64::from(level));
        }
        let Some(policy) = cfg.tier_policy(level, tier) else {
            return Flow::Continue;
        };
        let tier_index = cfg.tiers.names.iter().position(|t| t == tier).unwrap_or(0);
        if policy.shed {
            host.count(Stat::Tier(tier_index, TierStat::Shed), 1);
            let seed = guard
                .entropy
                .get()
                .wrapping_mul(6364136223846793005)
                .wrapping_add(now_ms | 1);
            guard.entropy.set(seed);
            let retry = retry_after_s(cfg, seed).to_string();
            let msg = format!(
                "the service is in degraded mode (level {level}) and is not serving tier {tier:?} now; retry after {retry} s"
            );
            return Flow::Reply(Reply::error(
                u32::from(cfg.ladder.shed_status),
                "rate_limit_error",
                "degraded_mode_shed",
                &msg,
                None,
                &[("retry-after", retry)],
            ));
        }
        if policy.fallback {
            write_header(host, &cfg.headers.pool, Some(POOL_FALLBACK));
            host.count(Stat::Tier(tier_index, TierStat::Fallback), 1);
        }
        if !needs_body(policy)
            || openai::is_encoded(host.request_header("content-encoding").as_deref())
        {
            // A compressed body is not one the guard can read: the router
            // sends it to the default region untouched.
            return Flow::Continue;
        }
        self.waiting = Waiting::Caps(endpoint, level, tier_index);
        self.snapshot = fresh.map(|f| f.snapshot);
        self.body_or_pause(guard, host, end_of_stream)
    }

    fn body_or_pause(&mut self, guard: &Guard, host: &mut dyn StreamHost, end: bool) -> Flow {
        if end {
            self.on_request_body(guard, host, &[])
        } else {
            Flow::Pause
        }
    }

    /// Whether the guard waits for the complete body.
    pub fn wants_body(&self) -> bool {
        self.waiting != Waiting::Nothing
    }

    /// A request whose body is already whole (the simulator, the CLI): its
    /// headers, then its body if the guard waits for it.
    pub fn on_whole_request(
        &mut self,
        guard: &Guard,
        host: &mut dyn StreamHost,
        view: &mut View,
        body: &[u8],
    ) -> Flow {
        let flow = self.on_request_headers(guard, host, view, false);
        if flow == Flow::Pause && self.wants_body() {
            return self.on_request_body(guard, host, body);
        }
        flow
    }

    /// The host could not read the complete body the guard waited for: a
    /// cap or an override it cannot check is refused (500
    /// `body_unreadable`), never let through unchecked; counted in
    /// `guard.body_unreadable`.
    pub fn on_body_unreadable(&mut self, host: &mut dyn StreamHost) -> Flow {
        if matches!(
            std::mem::replace(&mut self.waiting, Waiting::Nothing),
            Waiting::Nothing
        ) {
            return Flow::Continue;
        }
        host.count(Stat::Global(Global::GuardBodyUnreadable), 1);
        Flow::Reply(Reply::error(
            500,
            "server_error",
            "body_unreadable",
            "the guard could not read the request body from the proxy",
            None,
            &[],
        ))
    }

    /// The complete request body.
    pub fn on_request_body(
        &mut self,
        guard: &Guard,
        host: &mut dyn StreamHost,
        body: &[u8],
    ) -> Flow {
        let cfg = &*guard.cfg;
        match std::mem::replace(&mut self.waiting, Waiting::Nothing) {
            Waiting::Nothing => Flow::Continue,
            Waiting::Operator => operator_override(host, body),
            Waiting::Caps(endpoint, level, tier_index) => {
                let tier = cfg.tiers.names.get(tier_index).map_or("", String::as_str);
                let Some(policy) = cfg.tier_policy(level, tier) else {
                    return Flow::Continue;
                };
                if openai::body_kind(body) == BodyKind::Other {
                    return Flow::Continue;
                }
                match check_body(policy, endpoint, body, self.snapshot.as_deref()) {
                    Ok(Verdict::Pass) => Flow::Continue,
                    Ok(Verdict::PromptTooLong { tokens, limit }) => {
                        host.count(Stat::Tier(tier_index, TierStat::PromptTooLong), 1);
                        let msg = format!(
                            "the prompt is about {tokens} tokens; in degraded mode tier {tier:?} is limited to {limit} prompt tokens"
                        );
                        Flow::Reply(Reply::error(
                            413,
                            "invalid_request_error",
                            "context_length_exceeded",
                            &msg,
                            Some("messages"),
                            &[],
                        ))
                    }
                    Ok(Verdict::Rewrite { body, clamped }) => {
                        if host.replace_request_body(&body) {
                            write_header(host, "content-length", Some(&body.len().to_string()));
                            if clamped {
                                host.count(Stat::Tier(tier_index, TierStat::MaxTokensClamped), 1);
                            }
                        }
                        Flow::Continue
                    }
                    Err(e) => {
                        host.count(Stat::Global(Global::GuardInvalidRequest), 1);
                        if cfg.invalid_requests == InvalidRequests::PassThrough {
                            return Flow::Continue;
                        }
                        Flow::Reply(Reply::error(
                            400,
                            "invalid_request_error",
                            "invalid_request",
                            &e.message,
                            e.param,
                            &[],
                        ))
                    }
                }
            }
        }
    }
}

/// `POST /llm-geo-router/ladder` from an operator: store the override
/// where the probe reads it.
fn operator_override(host: &mut dyn StreamHost, body: &[u8]) -> Flow {
    match parse_override(body) {
        Ok(level) => {
            let value = level.map(|l| l.to_string()).unwrap_or_default();
            if host
                .set(LADDER_OVERRIDE_KEY, value.as_bytes(), None)
                .is_err()
            {
                return Flow::Reply(Reply::error(
                    500,
                    "server_error",
                    "shared_data",
                    "could not store the override",
                    None,
                    &[],
                ));
            }
            host.log(
                Level::Warn,
                &format!("llm-geo-router guard: operator set the ladder override to {level:?}"),
            );
            Flow::Reply(Reply::json(format!(
                r#"{{"override":{}}}"#,
                level.map_or("null".to_string(), |l| l.to_string())
            )))
        }
        Err(e) => Flow::Reply(Reply::error(
            400,
            "invalid_request_error",
            "invalid_override",
            &e,
            Some("level"),
            &[],
        )),
    }
}

/// Write (or remove) a request header; a write the host refused is
/// counted (`guard.header_write_failed`).
fn write_header(host: &mut dyn StreamHost, name: &str, value: Option<&str>) {
    if !host.set_request_header(name, value) {
        host.count(Stat::Global(Global::GuardHeaderWriteFailed), 1);
    }
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
        let req = openai::parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            PromptHasher::counting_only(),
        )
        .unwrap();
        clamp_max_tokens(Endpoint::ChatCompletions, body.as_bytes(), &req, limit)
            .map(|b| String::from_utf8(b).unwrap())
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
    fn responses_bodies_clamp_max_output_tokens() {
        let clamp_r = |body: &str, limit: u64| {
            let req = openai::parse(
                Endpoint::Responses,
                body.as_bytes(),
                PromptHasher::counting_only(),
            )
            .unwrap();
            clamp_max_tokens(Endpoint::Responses, body.as_bytes(), &req, limit)
                .map(|b| String::from_utf8(b).unwrap())
        };
        assert_eq!(
            clamp_r(r#"{"input":"x","max_output_tokens":5000}"#, 100).unwrap(),
            r#"{"input":"x","max_output_tokens":100}"#
        );
        assert_eq!(
            clamp_r(r#"{"input":"x","max_output_tokens":50}"#, 100),
            None
        );
        // `max_tokens` is not a Responses field: the limit is added.
        assert_eq!(
            clamp_r(r#"{"input":"x","max_tokens":5000}"#, 100).unwrap(),
            r#"{"max_output_tokens":100,"input":"x","max_tokens":5000}"#
        );
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
        let chat = Endpoint::ChatCompletions;
        // 106 bytes of canonical text: 27 tokens at 4 bytes per token
        // before any engine has reported a usage.
        assert_eq!(
            check_body(&policy, chat, long.as_bytes(), None).unwrap(),
            Verdict::PromptTooLong {
                tokens: 27,
                limit: 10
            }
        );
        // Once an engine's usage taught 2 bytes per token (and, for one
        // model, 1), the cap counts as the engines do.
        let mut snap = Snapshot::all_healthy(&c);
        let r0 = snap.regions.get_mut(0).unwrap();
        r0.tokens_per_byte = Some(0.5);
        r0.model_tokens_per_byte = vec![("m1".into(), 1.0)];
        assert_eq!(
            check_body(&policy, chat, long.as_bytes(), Some(&snap)).unwrap(),
            Verdict::PromptTooLong {
                tokens: 53,
                limit: 10
            }
        );
        let m1 = long.replacen('{', r#"{"model":"m1","#, 1);
        assert_eq!(
            check_body(&policy, chat, m1.as_bytes(), Some(&snap)).unwrap(),
            Verdict::PromptTooLong {
                tokens: 106,
                limit: 10
            }
        );
        let short = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;
        assert_eq!(
            check_body(&policy, chat, short.as_bytes(), None).unwrap(),
            Verdict::Pass
        );
        assert!(check_body(&policy, chat, b"{oops", None).is_err());
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
            check_body(&policy, Endpoint::ChatCompletions, body.as_bytes(), None).unwrap()
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

    // ------------------------------------------------------- the filter

    mod stream {
        use super::super::*;
        use crate::fleet::snapshot::Snapshot;
        use crate::shared::host_api::Recorder;
        use crate::shared::names::{Global, Stat, TierStat};

        const NOW: u64 = 1_700_000_000_000;

        fn guard(extra: &str) -> Guard {
            let c = Config::parse(
                format!(
                    r#"{{"regions":[{{"name":"a","cluster":"ca","capacity_rps":1}}],
                        "tiers":{{"api_keys":{{"{}":"paid"}}}},
                        "ladder":{{"operator_keys":["{}"]}}{extra}}}"#,
                    api_key_digest("sk-paid"),
                    api_key_digest("op-token")
                )
                .as_bytes(),
            )
            .unwrap();
            Guard::new(Rc::new(c), 7)
        }

        fn host_at_level(g: &Guard, level: u8) -> Recorder {
            let mut host = Recorder {
                now_ms: NOW,
                ..Recorder::default()
            };
            host.publish(&Snapshot {
                version: 1,
                generated_ms: NOW,
                level,
                ..Snapshot::all_healthy(&g.cfg)
            });
            host
        }

        type Headers = Vec<(&'static str, &'static str)>;

        fn headers(path: &'static str, extra: &[(&'static str, &'static str)]) -> Headers {
            let mut h = vec![(":method", "POST"), (":path", path)];
            h.extend_from_slice(extra);
            h
        }

        /// Headers, then the body if the guard asks for it.
        fn run(g: &Guard, host: &mut Recorder, h: &Headers, body: &str) -> (Flow, bool) {
            let mut s = GuardStream::new();
            let mut view = View::new();
            host.request(h);
            let flow = s.on_request_headers(g, host, &mut view, false);
            if flow == Flow::Pause && s.wants_body() {
                return (s.on_request_body(g, host, body.as_bytes()), true);
            }
            (flow, false)
        }

        fn code(flow: &Flow) -> (u32, String) {
            let Flow::Reply(r) = flow else {
                panic!("not a reply: {flow:?}")
            };
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            (
                r.status,
                v["error"]["code"].as_str().unwrap_or("").to_string(),
            )
        }

        const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1000}"#;

        #[test]
        fn level_zero_resolves_the_tier_and_never_reads_the_body() {
            let g = guard("");
            let mut host = host_at_level(&g, 0);
            let h = headers(
                "/v1/chat/completions",
                &[
                    ("authorization", "Bearer sk-paid"),
                    ("x-llm-tier", "critical"),
                    ("x-llm-pool", "fallback"),
                ],
            );
            let (flow, read_body) = run(&g, &mut host, &h, CHAT);
            assert_eq!((flow, read_body), (Flow::Continue, false));
            assert_eq!(host.request_header("x-llm-tier"), Some(Some("paid")));
            assert_eq!(host.request_header("x-llm-pool"), Some(None));
            assert_eq!(host.value(Stat::Global(Global::Arrivals)), 1);
            assert_eq!(host.value(Stat::Global(Global::GuardLevel)), 0);
            // Not an inference path: no arrival, nothing read.
            let (flow, _) = run(&g, &mut host, &headers("/v1/models", &[]), "");
            assert_eq!(flow, Flow::Continue);
            assert_eq!(host.value(Stat::Global(Global::Arrivals)), 1);
        }

        #[test]
        fn a_body_the_host_cannot_read_is_refused_never_let_through_unchecked() {
            let g = guard("");
            // Level 3 caps free's max_tokens: the guard waits for the body.
            let mut host = host_at_level(&g, 3);
            let mut s = GuardStream::new();
            host.request(&headers("/v1/chat/completions", &[]));
            let flow = s.on_request_headers(&g, &mut host, &mut View::new(), false);
            assert_eq!(flow, Flow::Pause);
            assert_eq!(
                code(&s.on_body_unreadable(&mut host)),
                (500, "body_unreadable".into())
            );
            assert_eq!(host.value(Stat::Global(Global::GuardBodyUnreadable)), 1);
            assert!(host.replaced_body.is_none());
            // Level 0 reads no body: nothing to refuse, nothing counted.
            let mut host = host_at_level(&g, 0);
            let mut s = GuardStream::new();
            host.request(&headers("/v1/chat/completions", &[]));
            let flow = s.on_request_headers(&g, &mut host, &mut View::new(), false);
            assert_eq!(flow, Flow::Continue);
            assert_eq!(s.on_body_unreadable(&mut host), Flow::Continue);
            assert_eq!(host.value(Stat::Global(Global::GuardBodyUnreadable)), 0);
        }

        #[test]
        fn a_header_write_the_host_refuses_is_counted() {
            let g = guard("");
            let mut host = host_at_level(&g, 4);
            host.refuse_header_writes = true;
            let h = headers("/v1/chat/completions", &[("x-llm-tier", "paid")]);
            let (flow, _) = run(&g, &mut host, &h, CHAT);
            assert_eq!(flow, Flow::Continue);
            // The tier (the client's claim replaced), the fallback pool and
            // the clamped body's content-length.
            assert_eq!(host.value(Stat::Global(Global::GuardHeaderWriteFailed)), 3);
            host.refuse_header_writes = false;
            run(&g, &mut host, &h, CHAT);
            assert_eq!(host.value(Stat::Global(Global::GuardHeaderWriteFailed)), 3);
        }

        #[test]
        fn shed_clamp_cap_and_fallback_per_level() {
            let g = guard("");
            // Level 5: free is shed with a Retry-After in range.
            let mut host = host_at_level(&g, 5);
            let (flow, _) = run(&g, &mut host, &headers("/v1/chat/completions", &[]), CHAT);
            assert_eq!(code(&flow), (429, "degraded_mode_shed".into()));
            let Flow::Reply(r) = flow else { unreachable!() };
            let retry: u32 = r
                .headers
                .iter()
                .find(|(n, _)| *n == "retry-after")
                .unwrap()
                .1
                .parse()
                .unwrap();
            let [lo, hi] = g.cfg.ladder.retry_after_s;
            assert!((lo..=hi).contains(&retry));
            assert_eq!(host.value(Stat::Tier(0, TierStat::Shed)), 1);
            // Level 3: free's max_tokens is clamped to 256 in the body.
            let mut host = host_at_level(&g, 3);
            let (flow, read) = run(&g, &mut host, &headers("/v1/chat/completions", &[]), CHAT);
            assert_eq!((flow, read), (Flow::Continue, true));
            let body = host.replaced_body.clone().unwrap();
            assert!(String::from_utf8_lossy(&body).contains(r#""max_tokens":256"#));
            assert_eq!(
                host.request_header("content-length"),
                Some(Some(&*body.len().to_string()))
            );
            assert_eq!(host.value(Stat::Tier(0, TierStat::MaxTokensClamped)), 1);
            // Level 4: free goes to the fallback pool.
            let mut host = host_at_level(&g, 4);
            run(&g, &mut host, &headers("/v1/chat/completions", &[]), CHAT);
            assert_eq!(host.request_header("x-llm-pool"), Some(Some(POOL_FALLBACK)));
            assert_eq!(host.value(Stat::Tier(0, TierStat::Fallback)), 1);
            // A prompt over the level's cap: 413.
            let long = format!(
                r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
                "x".repeat(40_000)
            );
            let mut host = host_at_level(&g, 3);
            let (flow, _) = run(&g, &mut host, &headers("/v1/chat/completions", &[]), &long);
            assert_eq!(code(&flow), (413, "context_length_exceeded".into()));
        }

        #[test]
        fn the_body_rule_is_the_routers() {
            let g = guard("");
            let mut host = host_at_level(&g, 3);
            let path = headers("/v1/chat/completions", &[]);
            // Blank: an empty request, 400.
            let (flow, _) = run(&g, &mut host, &path, " \n ");
            assert_eq!(code(&flow), (400, "invalid_request".into()));
            // Not meant as JSON: left to the router (default region).
            assert_eq!(run(&g, &mut host, &path, "a=1").0, Flow::Continue);
            // Malformed JSON: 400, or passed through as configured.
            assert_eq!(code(&run(&g, &mut host, &path, "{\"messages\":").0).0, 400);
            let pass = guard(r#","invalid_requests":"pass_through""#);
            let mut host = host_at_level(&pass, 3);
            assert_eq!(
                run(&pass, &mut host, &path, "{\"messages\":").0,
                Flow::Continue
            );
            assert_eq!(host.value(Stat::Global(Global::GuardInvalidRequest)), 1);
        }

        #[test]
        fn the_operator_sets_and_clears_the_override() {
            let g = guard("");
            let mut host = host_at_level(&g, 0);
            let op = |extra: &[(&'static str, &'static str)]| headers(OPERATOR_PATH, extra);
            let auth = ("authorization", "Bearer op-token");
            assert_eq!(code(&run(&g, &mut host, &op(&[]), "").0).0, 403);
            let get: Headers = vec![
                (":method", "GET"),
                (":path", OPERATOR_PATH),
                ("authorization", "Bearer op-token"),
            ];
            assert_eq!(code(&run(&g, &mut host, &get, "").0).0, 405);
            let (flow, _) = run(&g, &mut host, &op(&[auth]), r#"{"level": 9}"#);
            assert_eq!(code(&flow), (400, "invalid_override".into()));
            let (flow, _) = run(&g, &mut host, &op(&[auth]), r#"{"level": 3}"#);
            assert_eq!(flow, Flow::Reply(Reply::json(r#"{"override":3}"#.into())));
            assert_eq!(host.store.map.get(LADDER_OVERRIDE_KEY).unwrap().0, b"3");
            run(&g, &mut host, &op(&[auth]), r#"{"level": null}"#);
            assert_eq!(host.store.map.get(LADDER_OVERRIDE_KEY).unwrap().0, b"");
            assert_eq!(host.logs.len(), 2);
        }

        #[test]
        fn the_level_gauge_is_written_on_change_only() {
            let g = guard("");
            let mut host = host_at_level(&g, 2);
            for _ in 0..3 {
                run(
                    &g,
                    &mut host,
                    &headers("/v1/completions", &[("authorization", "Bearer sk-paid")]),
                    "",
                );
            }
            assert_eq!(host.value(Stat::Global(Global::GuardLevel)), 2);
            host.stats.remove(&Stat::Global(Global::GuardLevel));
            run(
                &g,
                &mut host,
                &headers("/v1/completions", &[("authorization", "Bearer sk-paid")]),
                "",
            );
            assert_eq!(
                host.value(Stat::Global(Global::GuardLevel)),
                0,
                "unchanged level, no write"
            );
        }
    }
}
