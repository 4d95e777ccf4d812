//! The `guard` HTTP filter: resolves the caller's tier (and rewrites the
//! tier header to it), counts arrivals for the ladder's demand, and applies
//! the current level's policy for that tier: shed (429 + `Retry-After`),
//! prompt cap (413), `max_tokens` clamp (body rewritten, `Content-Length`
//! kept right). At a level with no caps for the tier the body is not read.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::calls::{self, HostStore, Metric};
use super::probe::LADDER_OVERRIDE_KEY;
use super::router::POOL_FALLBACK;
use super::view::View;
use crate::config::{Config, InvalidRequests, TierPolicy};
use crate::directory::SharedStore;
use crate::guard::{self, Verdict};
use crate::openai;
use crate::request::{self, Endpoint};

/// Shared with the probe, which turns it into the demand rate.
pub const ARRIVALS: &str = "llm_geo_router.arrivals";

struct TierStats {
    shed: Metric,
    prompt_too_long: Metric,
    clamped: Metric,
    fallback: Metric,
}

pub struct GuardShared {
    cfg: Rc<Config>,
    view: RefCell<View>,
    arrivals: Metric,
    level: Metric,
    invalid: Metric,
    tiers: BTreeMap<String, TierStats>,
    entropy: std::cell::Cell<u64>,
}

impl GuardShared {
    pub fn new(cfg: Rc<Config>) -> Self {
        let tiers = cfg
            .tiers
            .names
            .iter()
            .map(|t| {
                let m =
                    |what: &str| Metric::counter(&format!("llm_geo_router.guard.tier.{t}.{what}"));
                (
                    t.clone(),
                    TierStats {
                        shed: m("shed"),
                        prompt_too_long: m("prompt_too_long"),
                        clamped: m("max_tokens_clamped"),
                        fallback: m("fallback"),
                    },
                )
            })
            .collect();
        GuardShared {
            view: View::new(),
            arrivals: Metric::counter(ARRIVALS),
            level: Metric::gauge("llm_geo_router.guard.level"),
            invalid: Metric::counter("llm_geo_router.guard.invalid_request"),
            tiers,
            entropy: std::cell::Cell::new(calls::now_ms()),
            cfg,
        }
    }
}

pub struct GuardFilter {
    shared: Rc<GuardShared>,
    pending: Option<(Endpoint, TierPolicy, String)>,
    /// An operator's override request, waiting for its body.
    operator: bool,
}

impl GuardFilter {
    pub fn new(shared: Rc<GuardShared>) -> Self {
        GuardFilter {
            shared,
            pending: None,
            operator: false,
        }
    }

    fn tier_stats(&self, tier: &str) -> Option<&TierStats> {
        self.shared.tiers.get(tier)
    }

    fn reject(
        &self,
        status: u32,
        kind: &str,
        code: &str,
        message: &str,
        param: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Action {
        let body = openai::error_body(message, kind, param, Some(code));
        let mut headers = vec![("content-type", "application/json")];
        headers.extend_from_slice(extra);
        calls::send_response(status, &headers, &body);
        Action::Pause
    }
}

impl Context for GuardFilter {}

impl HttpContext for GuardFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let tier = guard::resolve_tier(
            cfg,
            calls::request_header("authorization").as_deref(),
            calls::request_header(&cfg.headers.tier).as_deref(),
        )
        .to_string();
        // Downstream filters and the engine see the resolved tier, never the
        // client's claim; only the guard chooses the pool.
        calls::set_request_header(&cfg.headers.tier, Some(&tier));
        calls::set_request_header(&cfg.headers.pool, None);
        let method = calls::request_header(":method").unwrap_or_default();
        let path = calls::request_header(":path").unwrap_or_default();
        if !cfg.ladder.operator_keys.is_empty()
            && path.split('?').next() == Some(guard::OPERATOR_PATH)
        {
            if !guard::is_operator(cfg, calls::request_header("authorization").as_deref()) {
                return self.reject(
                    403,
                    "permission_error",
                    "forbidden",
                    "operator token required",
                    None,
                    &[],
                );
            }
            if method != "POST" {
                return self.reject(
                    405,
                    "invalid_request_error",
                    "method_not_allowed",
                    "use POST with {\"level\": 0..=5 or null}",
                    None,
                    &[("allow", "POST")],
                );
            }
            self.operator = true;
            if end_of_stream {
                return self.on_http_request_body(0, true);
            }
            return Action::Pause;
        }
        let Some(endpoint) = request::endpoint(&method, &path) else {
            return Action::Continue;
        };
        shared.arrivals.add(1);
        // No fresh snapshot: level 0. The guard never refuses on stale data.
        let now = calls::now_ms();
        let level = shared
            .view
            .borrow_mut()
            .current(cfg, now)
            .map_or(0, |(s, _)| s.level);
        shared.level.set(u64::from(level));
        let Some(policy) = cfg.tier_policy(level, &tier) else {
            return Action::Continue;
        };
        if policy.shed {
            if let Some(s) = self.tier_stats(&tier) {
                s.shed.add(1);
            }
            let seed = shared
                .entropy
                .get()
                .wrapping_mul(6364136223846793005)
                .wrapping_add(now | 1);
            shared.entropy.set(seed);
            let retry = guard::retry_after_s(cfg, seed).to_string();
            let msg = format!(
                "the service is in degraded mode (level {level}) and is not serving tier {tier:?} now; retry after {retry} s"
            );
            return self.reject(
                u32::from(cfg.ladder.shed_status),
                "rate_limit_error",
                "degraded_mode_shed",
                &msg,
                None,
                &[("retry-after", &retry)],
            );
        }
        if policy.fallback {
            calls::set_request_header(&cfg.headers.pool, Some(POOL_FALLBACK));
            if let Some(s) = self.tier_stats(&tier) {
                s.fallback.add(1);
            }
        }
        if !guard::needs_body(policy) {
            return Action::Continue;
        }
        if request::is_encoded(calls::request_header("content-encoding").as_deref()) {
            // Not a body the guard can read: the router sends it to the default
            // region untouched, where the engine judges it.
            return Action::Continue;
        }
        self.pending = Some((endpoint, policy.clone(), tier));
        if end_of_stream {
            return self.on_http_request_body(0, true);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.operator {
            if !end_of_stream {
                return Action::Pause;
            }
            self.operator = false;
            let body = calls::request_body(body_size).unwrap_or_default();
            return match guard::parse_override(&body) {
                Ok(level) => {
                    let value = level.map(|l| l.to_string()).unwrap_or_default();
                    let stored = HostStore
                        .set(LADDER_OVERRIDE_KEY, value.as_bytes(), None)
                        .is_ok();
                    if !stored {
                        return self.reject(
                            500,
                            "server_error",
                            "shared_data",
                            "could not store the override",
                            None,
                            &[],
                        );
                    }
                    calls::log(
                        proxy_wasm::types::LogLevel::Warn,
                        &format!(
                            "llm-geo-router guard: operator set the ladder override to {level:?}"
                        ),
                    );
                    let body = format!(
                        r#"{{"override":{}}}"#,
                        level.map_or("null".to_string(), |l| l.to_string())
                    );
                    calls::send_response(
                        200,
                        &[("content-type", "application/json")],
                        body.as_bytes(),
                    );
                    Action::Pause
                }
                Err(e) => self.reject(
                    400,
                    "invalid_request_error",
                    "invalid_override",
                    &e,
                    Some("level"),
                    &[],
                ),
            };
        }
        if self.pending.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let Some((endpoint, policy, tier)) = self.pending.take() else {
            return Action::Continue;
        };
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let body = calls::request_body(body_size).unwrap_or_default();
        // A blank body is an empty request (refused below), not a non-JSON one.
        let blank = body.iter().all(u8::is_ascii_whitespace);
        if !blank && !request::looks_like_json(&body) {
            return Action::Continue;
        }
        match guard::check_body(cfg, &policy, endpoint, &body) {
            Ok(Verdict::Pass) => Action::Continue,
            Ok(Verdict::PromptTooLong { tokens, limit }) => {
                if let Some(s) = self.tier_stats(&tier) {
                    s.prompt_too_long.add(1);
                }
                let msg = format!(
                    "the prompt is about {tokens} tokens; in degraded mode tier {tier:?} is limited to {limit} prompt tokens"
                );
                self.reject(
                    413,
                    "invalid_request_error",
                    "context_length_exceeded",
                    &msg,
                    Some("messages"),
                    &[],
                )
            }
            Ok(Verdict::Rewrite {
                body: new_body,
                clamped,
            }) => {
                if calls::replace_request_body(body_size, &new_body) {
                    calls::set_request_header("content-length", Some(&new_body.len().to_string()));
                    if clamped {
                        if let Some(s) = self.tier_stats(&tier) {
                            s.clamped.add(1);
                        }
                    }
                }
                Action::Continue
            }
            Err(e) => {
                shared.invalid.add(1);
                if cfg.invalid_requests == InvalidRequests::PassThrough {
                    return Action::Continue;
                }
                self.reject(
                    400,
                    "invalid_request_error",
                    "invalid_request",
                    &e.message,
                    e.param,
                    &[],
                )
            }
        }
    }
}
