//! The router's guard against a pause that never ends.
//!
//! The router pauses every inference request in `on_request_headers` until
//! the body has arrived. Envoy honours that pause as a plain StopIteration
//! (body chunks keep reaching the filter) only when the filter's Wasm config
//! sets `allow_on_headers_stop_iteration: true`; without it (the field was
//! dropped, e.g. by an istiod older than 1.28, whose go-control-plane does
//! not know it) Envoy stops the whole stream, buffers the body and never
//! hands it to the filter: the request would hang until a stream timeout.
//!
//! HTTP contexts have no timers, so the router's root context keeps this
//! registry (per worker, like the contexts) and checks it on its tick: a
//! request paused longer than `body_wait.timeout_ms` with no body callback is
//! expired, and the host then resumes it unrouted or answers it with an
//! error, as `body_wait.on_timeout` says. The first expiry is logged loudly,
//! naming the missing field.
//!
//! Resumed, the request cannot be routed: Envoy then hands the filter the
//! buffered body, but a stream resumed by `proxy_continue_stream` no longer
//! exposes its request headers to the filter (reading them fails), so the
//! router cannot set the cluster header; Envoy's router has picked the route
//! without it (the fallback to the nearest region). The filter lets such a
//! request through untouched ([`BodyWait::arrived`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{BodyWaitAction, BodyWaitConfig};
use crate::shared::flow::{Flow, Reply};
use crate::shared::host_api::{Effects, Level};
use crate::shared::names::{Global, Stat};

/// Requests paused on their headers, by HTTP context id, with the time
/// (ms) they paused.
#[derive(Debug, Default)]
pub struct BodyWait {
    paused: BTreeMap<u32, u64>,
    /// Expired and resumed: their filter must not touch the request again.
    resumed: BTreeSet<u32>,
    warned: bool,
}

impl BodyWait {
    pub fn new() -> BodyWait {
        BodyWait::default()
    }

    /// The request of context `id` paused on its headers for the body.
    pub fn paused(&mut self, id: u32, now_ms: u64) {
        self.paused.insert(id, now_ms);
    }

    /// The request of context `id` got a body callback: whether its filter
    /// handles it. Not one the tick resumed: its headers can no longer be
    /// read or set, so it goes on untouched.
    pub fn arrived(&mut self, id: u32) -> bool {
        self.paused.remove(&id);
        !self.resumed.contains(&id)
    }

    /// The request of context `id` ended.
    pub fn done(&mut self, id: u32) {
        self.paused.remove(&id);
        self.resumed.remove(&id);
    }

    /// The host resumed the expired request of context `id`.
    pub fn resumed(&mut self, id: u32) {
        self.resumed.insert(id);
    }

    /// How many requests are paused now.
    pub fn len(&self) -> usize {
        self.paused.len()
    }

    pub fn is_empty(&self) -> bool {
        self.paused.is_empty()
    }

    /// The requests paused for `timeout_ms` or longer, removed from the
    /// registry (each expires once). A timeout of 0 expires none.
    fn expire(&mut self, now_ms: u64, timeout_ms: u64) -> Vec<u32> {
        if timeout_ms == 0 {
            return Vec::new();
        }
        let expired: Vec<u32> = self
            .paused
            .iter()
            .filter(|(_, &since)| now_ms.saturating_sub(since) >= timeout_ms)
            .map(|(&id, _)| id)
            .collect();
        for id in &expired {
            self.paused.remove(id);
        }
        expired
    }

    /// The root's tick: each request paused for `cfg.timeout_ms` or longer
    /// with what its filter does now, in its own context: `Continue` (the
    /// host resumes it, unrouted, and reports [`BodyWait::resumed`]) or a
    /// reply, as `cfg.on_timeout` says. Each is counted in `stat`; the
    /// first expiry is logged, naming the missing Wasm config field.
    pub fn on_tick(
        &mut self,
        host: &mut dyn Effects,
        role: &str,
        stat: Global,
        cfg: &BodyWaitConfig,
    ) -> Vec<(u32, Flow)> {
        if self.paused.is_empty() {
            return Vec::new();
        }
        let expired = self.expire(host.now_ms(), cfg.timeout_ms);
        if expired.is_empty() {
            return Vec::new();
        }
        if let Some(msg) = self.warning(role, cfg.timeout_ms, cfg.on_timeout) {
            host.log(Level::Critical, &msg);
        }
        host.count(
            Stat::Global(stat),
            i64::try_from(expired.len()).unwrap_or(i64::MAX),
        );
        let flow = || match cfg.on_timeout {
            BodyWaitAction::PassThrough => Flow::Continue,
            BodyWaitAction::Reject => Flow::Reply(reply()),
        };
        expired.into_iter().map(|id| (id, flow())).collect()
    }

    /// The log line for the first expiry (then `None`: logged once).
    fn warning(&mut self, role: &str, timeout_ms: u64, action: BodyWaitAction) -> Option<String> {
        if self.warned {
            return None;
        }
        self.warned = true;
        Some(warning(role, timeout_ms, action))
    }
}

/// The misconfiguration, named for the operator who reads Envoy's log.
pub fn warning(role: &str, timeout_ms: u64, action: BodyWaitAction) -> String {
    let then = match action {
        BodyWaitAction::PassThrough => {
            "passing such requests through unrouted after the wait (body_wait.on_timeout pass_through)"
        }
        BodyWaitAction::Reject => {
            "answering such requests 503 body_wait_timeout (body_wait.on_timeout reject)"
        }
    };
    format!(
        "llm-geo-router {role}: MISCONFIGURED: a request paused for its body got none within {timeout_ms} ms. \
         The {role}'s Wasm filter config most likely lacks allow_on_headers_stop_iteration: true, so Envoy stops \
         the whole stream and never delivers the body (Istio before 1.28 drops that field from EnvoyFilter \
         patches; check with istioctl proxy-config ecds <pod> -o json). {then}; counted in \
         llm_geo_router.{role}.body_wait_timeout. Logged once per worker."
    )
}

/// The answer to an expired request when `on_timeout` is `reject`.
pub fn reply() -> Reply {
    Reply::error(
        503,
        "server_error",
        "body_wait_timeout",
        "the router received no request body in time (proxy misconfiguration: \
         allow_on_headers_stop_iteration missing)",
        None,
        &[],
    )
}

/// How often the router's root checks the registry: a quarter of the
/// timeout, within 50 ms .. 1 s (0: never).
pub fn tick_ms(timeout_ms: u64) -> u64 {
    if timeout_ms == 0 {
        0
    } else {
        (timeout_ms / 4).clamp(50, 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expires_only_what_waited_long_enough_once() {
        let mut w = BodyWait::new();
        w.paused(1, 1000);
        w.paused(2, 1500);
        w.paused(3, 1000);
        w.done(3);
        assert_eq!(w.expire(1999, 1000), Vec::<u32>::new());
        assert_eq!(w.expire(2000, 1000), vec![1]);
        assert_eq!(w.expire(2600, 1000), vec![2]);
        assert!(w.is_empty());
        assert_eq!(w.expire(9000, 1000), Vec::<u32>::new());
        w.paused(4, 0);
        assert!(w.arrived(4));
        assert!(w.expire(9000, 1000).is_empty());
        w.resumed(5);
        assert!(
            !w.arrived(5),
            "a resumed request is not the filter's any more"
        );
        w.done(5);
        assert!(w.arrived(5));
    }

    #[test]
    fn the_tick_counts_logs_once_and_answers_as_configured() {
        use crate::shared::host_api::Recorder;
        let mut host = Recorder {
            now_ms: 5000,
            ..Recorder::default()
        };
        let mut cfg = BodyWaitConfig {
            timeout_ms: 1000,
            on_timeout: BodyWaitAction::PassThrough,
        };
        let mut w = BodyWait::new();
        w.paused(1, 3000);
        w.paused(2, 4500);
        let stat = Global::RouterBodyWaitTimeout;
        assert_eq!(
            w.on_tick(&mut host, "router", stat, &cfg),
            vec![(1, Flow::Continue)]
        );
        assert_eq!(host.value(Stat::Global(stat)), 1);
        assert_eq!(host.logs.len(), 1);
        assert_eq!(host.logs[0].0, Level::Critical);
        cfg.on_timeout = BodyWaitAction::Reject;
        host.now_ms = 6000;
        let expired = w.on_tick(&mut host, "router", stat, &cfg);
        assert_eq!(expired.len(), 1);
        let (2, Flow::Reply(r)) = &expired[0] else {
            panic!("{expired:?}")
        };
        assert_eq!(r.status, 503);
        assert_eq!(host.value(Stat::Global(stat)), 2);
        assert_eq!(host.logs.len(), 1, "logged once");
        assert!(w.on_tick(&mut host, "router", stat, &cfg).is_empty());
    }

    #[test]
    fn zero_timeout_disables() {
        let mut w = BodyWait::new();
        w.paused(1, 0);
        assert!(w.expire(u64::MAX, 0).is_empty());
        assert_eq!(w.len(), 1);
        assert_eq!(tick_ms(0), 0);
        assert_eq!(tick_ms(1000), 250);
        assert_eq!(tick_ms(100), 50);
        assert_eq!(tick_ms(60_000), 1000);
    }

    #[test]
    fn warns_once_naming_the_field() {
        let mut w = BodyWait::new();
        let first = w.warning("router", 1000, BodyWaitAction::PassThrough);
        assert!(first
            .as_deref()
            .is_some_and(|m| m.contains("allow_on_headers_stop_iteration")
                && m.contains("router.body_wait_timeout")));
        assert!(w.warning("router", 1000, BodyWaitAction::Reject).is_none());
        let r = reply();
        assert_eq!(r.status, 503);
        assert!(String::from_utf8_lossy(&r.body).contains("body_wait_timeout"));
    }
}
