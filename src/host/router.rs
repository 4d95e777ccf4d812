//! The `router` HTTP filter: waits for an inference request's body, asks the
//! core for the region with the lowest expected TTFT, sets the cluster
//! header and clears the route cache. Everything else goes to the default
//! region untouched. A client-sent cluster header is always removed.
//!
//! For streamed requests it measures the TTFT it can see (request routed →
//! first response body byte) and reports it with the predicted cost terms to
//! the probe over a shared queue, which tunes the cost model.
//!
//! When a request ends it reads from Envoy how (response flags, tries, the
//! host that served the last try) and charges the outcome to the region
//! whose engines had it (`outcome`): a failure only for what the upstream
//! side did, a client's cancellation counted apart.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::calls::{self, HostStore, Metric};
use super::view::View;
use crate::config::{Config, InvalidRequests};
use crate::cost::Reason;
use crate::openai;
use crate::outcome::{Ending, Outcome, VIA_UPSTREAM};
use crate::request::{self, Endpoint, RequestError};
use crate::route::{Refusal, RouteInputs, Router};
use crate::tuning::Observation;

/// Value of the pool header for the fallback pool.
pub const POOL_FALLBACK: &str = "fallback";

/// Filter state key holding the decision text (Envoy prefixes `wasm.`).
pub const DECISION_FILTER_STATE: &str = "llm_geo_router.decision";

/// Shared queue that carries TTFT observations to the probe.
pub const OBSERVATIONS_QUEUE: &str = "llm_geo_router.observations";

struct Stats {
    /// Per region: requests in flight from this Envoy (one stat shared by
    /// every worker and the probe).
    rq_active: Vec<Metric>,
    /// Per region: requests routed there.
    rq_total: Vec<Metric>,
    /// Per region: tries its engines failed (engine 5xx, connection
    /// failure, reset or timeout upstream), by the region whose host had the
    /// try; with the answered count, the probe's live down signal.
    upstream_failures: Vec<Metric>,
    /// Per region: requests its engines answered (status below 500).
    answered: Vec<Metric>,
    /// Per region: requests whose client went away while the region had them.
    client_cancelled: Vec<Metric>,
    /// Retried requests whose last host names no region (no endpoint
    /// metadata `llm_geo_router.region`): their outcome is charged nowhere.
    unattributed: Metric,
    /// Per region: requests sent to its fallback pool.
    fallback_routed: Vec<Metric>,
    /// Per reason, in `Reason::ALL` order.
    decisions: Vec<Metric>,
    /// Per region, per reason.
    region_decisions: Vec<Vec<Metric>>,
    invalid: Metric,
    passthrough: Metric,
    residency_rejected: Metric,
}

pub struct RouterShared {
    cfg: Rc<Config>,
    router: Router,
    view: RefCell<View>,
    stats: Stats,
    vm_id: String,
    queue: Cell<Option<u32>>,
}

/// Name of the per-region in-flight gauge; the probe reads the same stat.
pub fn rq_active_name(region: &str) -> String {
    format!("llm_geo_router.region.{region}.rq_active")
}

/// Names of the per-region outcome counters; the probe reads the same stats.
pub fn upstream_failure_name(region: &str) -> String {
    format!("llm_geo_router.region.{region}.upstream_failure")
}
pub fn answered_name(region: &str) -> String {
    format!("llm_geo_router.region.{region}.upstream_rq_answered")
}

/// Endpoint metadata that names an upstream host's region: a retry that
/// `retry_priority` moved to another region's engine is charged to it.
const HOST_REGION: [&str; 5] = [
    "xds",
    "upstream_host_metadata",
    "filter_metadata",
    "llm_geo_router",
    "region",
];

impl RouterShared {
    pub fn new(cfg: Rc<Config>) -> Self {
        let stats = Stats {
            rq_active: cfg
                .regions
                .iter()
                .map(|r| Metric::gauge(&rq_active_name(&r.name)))
                .collect(),
            rq_total: cfg
                .regions
                .iter()
                .map(|r| Metric::counter(&format!("llm_geo_router.region.{}.rq_total", r.name)))
                .collect(),
            upstream_failures: cfg
                .regions
                .iter()
                .map(|r| Metric::counter(&upstream_failure_name(&r.name)))
                .collect(),
            answered: cfg
                .regions
                .iter()
                .map(|r| Metric::counter(&answered_name(&r.name)))
                .collect(),
            client_cancelled: cfg
                .regions
                .iter()
                .map(|r| {
                    Metric::counter(&format!(
                        "llm_geo_router.region.{}.client_cancelled",
                        r.name
                    ))
                })
                .collect(),
            unattributed: Metric::counter("llm_geo_router.router.outcome_unattributed"),
            fallback_routed: cfg
                .regions
                .iter()
                .map(|r| {
                    Metric::counter(&format!(
                        "llm_geo_router.region.{}.fallback_rq_total",
                        r.name
                    ))
                })
                .collect(),
            decisions: Reason::ALL
                .iter()
                .map(|r| {
                    Metric::counter(&format!("llm_geo_router.router.decision.{}", r.stat_name()))
                })
                .collect(),
            region_decisions: cfg
                .regions
                .iter()
                .map(|r| {
                    Reason::ALL
                        .iter()
                        .map(|why| {
                            Metric::counter(&format!(
                                "llm_geo_router.region.{}.decision.{}",
                                r.name,
                                why.stat_name()
                            ))
                        })
                        .collect()
                })
                .collect(),
            invalid: Metric::counter("llm_geo_router.router.invalid_request"),
            passthrough: Metric::counter("llm_geo_router.router.passthrough"),
            residency_rejected: Metric::counter("llm_geo_router.router.residency_rejected"),
        };
        let router = Router::new(&cfg);
        let vm_id = calls::property(&["plugin_vm_id"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        RouterShared {
            cfg,
            router,
            view: View::new(),
            stats,
            vm_id,
            queue: Cell::new(None),
        }
    }

    /// The probe's observation queue, once the probe has registered it.
    fn queue(&self) -> Option<u32> {
        if self.queue.get().is_none() && self.cfg.tuning.enabled {
            self.queue
                .set(calls::resolve_queue(&self.vm_id, OBSERVATIONS_QUEUE));
        }
        self.queue.get()
    }
}

/// What to report about a streamed request: its predicted terms, and the
/// time to its first byte once that arrives. Sent when the request ends,
/// if it was answered on the first try by the region routed to.
struct Pending {
    routed_ms: u64,
    observation: Observation,
    first_byte: bool,
}

pub struct RouterFilter {
    shared: Rc<RouterShared>,
    endpoint: Option<Endpoint>,
    routed: Option<usize>,
    /// The guard sent this request to the fallback pool.
    fallback: bool,
    /// The status of the response headers the client got (an engine's, or
    /// a local reply's), if any.
    status: Option<u32>,
    decision_header: Option<String>,
    pending: Option<Pending>,
}

impl RouterFilter {
    pub fn new(shared: Rc<RouterShared>) -> Self {
        RouterFilter {
            shared,
            endpoint: None,
            routed: None,
            fallback: false,
            status: None,
            decision_header: None,
            pending: None,
        }
    }

    fn set_region(&mut self, region: usize, inflight: bool) {
        let cfg = &self.shared.cfg;
        let Some(r) = cfg.regions.get(region) else {
            return;
        };
        let cluster = match (&r.fallback_cluster, self.fallback) {
            (Some(fallback), true) => {
                if let Some(m) = self.shared.stats.fallback_routed.get(region) {
                    m.add(1);
                }
                fallback
            }
            _ => &r.cluster,
        };
        calls::set_request_header(&cfg.headers.cluster, Some(cluster));
        calls::clear_route_cache();
        if let Some(m) = self.shared.stats.rq_total.get(region) {
            m.add(1);
        }
        if inflight {
            if let Some(m) = self.shared.stats.rq_active.get(region) {
                m.add(1);
            }
            self.routed = Some(region);
        }
    }

    fn route_default(&mut self) {
        self.shared.stats.passthrough.add(1);
        let region = self.shared.cfg.default_region_index();
        self.set_region(region, false);
        if self.shared.cfg.headers.decision.is_some() {
            let name = self
                .shared
                .cfg
                .regions
                .get(region)
                .map_or("", |r| r.name.as_str());
            self.decision_header = Some(format!("region={name}; reason=default"));
        }
    }

    fn reject(&self, code: &str, message: &str, param: Option<&str>) -> Action {
        let body = openai::error_body(message, "invalid_request_error", param, Some(code));
        calls::send_response(400, &[("content-type", "application/json")], &body);
        Action::Pause
    }

    /// An invalid inference request: reject with 400, or pass it through to
    /// the default region, as configured.
    fn invalid(&mut self, e: &RequestError) -> Action {
        self.shared.stats.invalid.add(1);
        if self.shared.cfg.invalid_requests == InvalidRequests::PassThrough {
            self.route_default();
            return Action::Continue;
        }
        self.reject("invalid_request", &e.message, e.param)
    }

    fn route(&mut self, body: &[u8]) -> Action {
        let Some(endpoint) = self.endpoint else {
            self.route_default();
            return Action::Continue;
        };
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let now = calls::now_ms();
        let fresh = shared.view.borrow_mut().current(cfg, now);
        let snapshot = fresh.as_ref().map(|(s, _)| s.as_ref());
        let inflight: Vec<f64> = shared
            .stats
            .rq_active
            .iter()
            .map(|m| m.get() as f64)
            .collect();
        let session = calls::request_header(&cfg.headers.session);
        let residency = cfg
            .residency
            .header
            .as_deref()
            .and_then(calls::request_header);
        let inputs = RouteInputs {
            endpoint,
            body,
            session_header: session.as_deref(),
            residency: residency.as_deref(),
            snapshot,
            snapshot_index: fresh.as_ref().map_or(&[][..], |(_, i)| i.as_slice()),
            inflight: &inflight,
            now_ms: now,
            fallback: self.fallback,
        };
        let routed = match shared.router.route(cfg, &mut HostStore, &inputs) {
            Ok(r) => r,
            Err(Refusal::Invalid(e)) => return self.invalid(&e),
            Err(Refusal::UnknownResidency(msg)) => {
                // The residency pin is a hard constraint: an unknown value is
                // refused rather than routed somewhere it may not go.
                shared.stats.residency_rejected.add(1);
                return self.reject("invalid_residency", &msg, None);
            }
        };
        let d = &routed.decision;
        if let Some(i) = Reason::ALL.iter().position(|r| *r == d.reason) {
            if let Some(m) = shared.stats.decisions.get(i) {
                m.add(1);
            }
            if let Some(m) = shared
                .stats
                .region_decisions
                .get(d.region)
                .and_then(|v| v.get(i))
            {
                m.add(1);
            }
        }
        if let Some(kv) = &routed.kv {
            let from = cfg.regions.get(kv.from).map_or("", |r| r.name.as_str());
            calls::set_request_header(&cfg.migration.header, Some(&kv.header_value(from)));
        }
        let mut text = routed.describe(cfg, snapshot.map_or(0, |s| s.level));
        if self.fallback {
            text.push_str("; pool=fallback");
        }
        // For access logs: %FILTER_STATE(wasm.llm_geo_router.decision:PLAIN)%.
        calls::set_filter_state(DECISION_FILTER_STATE, text.as_bytes());
        if cfg.headers.decision.is_some() {
            self.decision_header = Some(text);
        }
        // The fallback pool's TTFT says nothing about the main pool's model.
        if routed.stream && d.reason != Reason::Fallback && !self.fallback {
            self.pending = routed.observation().map(|observation| Pending {
                routed_ms: now,
                observation,
                first_byte: false,
            });
        }
        // Streams get the route with a first-byte deadline; a non-streamed
        // answer's first byte is its last, so it must not.
        calls::set_request_header(&cfg.headers.stream, routed.stream.then_some("true"));
        self.set_region(d.region, true);
        Action::Continue
    }
}

impl Context for RouterFilter {}

impl HttpContext for RouterFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = self.shared.cfg.clone();
        // Never let a client pick the cluster or speak for the router.
        calls::set_request_header(&cfg.headers.cluster, None);
        calls::set_request_header(&cfg.migration.header, None);
        // Only the guard sets the pool (it removes any client value first).
        self.fallback = calls::request_header(&cfg.headers.pool).as_deref() == Some(POOL_FALLBACK);
        let method = calls::request_header(":method").unwrap_or_default();
        let path = calls::request_header(":path").unwrap_or_default();
        self.endpoint = request::endpoint(&method, &path);
        let encoded = request::is_encoded(calls::request_header("content-encoding").as_deref());
        if self.endpoint.is_none() || encoded {
            self.endpoint = None;
            self.route_default();
            return Action::Continue;
        }
        if end_of_stream {
            return self.route(&[]);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = calls::request_body(body_size).unwrap_or_default();
        // A blank body is an empty request (refused below), not a non-JSON one.
        let blank = body.iter().all(u8::is_ascii_whitespace);
        if !blank && !request::looks_like_json(&body) {
            self.endpoint = None;
            self.route_default();
            return Action::Continue;
        }
        let action = self.route(&body);
        self.endpoint = None;
        action
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if let (Some(name), Some(value)) =
            (&self.shared.cfg.headers.decision, &self.decision_header)
        {
            calls::add_response_header(name, value);
        }
        if self.routed.is_none() {
            return Action::Continue;
        }
        self.status = calls::response_header(":status").and_then(|s| s.parse().ok());
        // Only a successful stream's first byte is a time to first token.
        if !self.status.is_some_and(|s| (200..300).contains(&s)) {
            self.pending = None;
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if body_size > 0 {
            if let Some(p) = self.pending.as_mut().filter(|p| !p.first_byte) {
                p.first_byte = true;
                p.observation.observed_ms = calls::now_ms().saturating_sub(p.routed_ms) as f32;
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(region) = self.routed.take() else {
            return;
        };
        let stats = &self.shared.stats;
        if let Some(m) = stats.rq_active.get(region) {
            m.add(-1);
        }
        // The fallback pool is other engines: its outcomes say nothing about
        // the region's own (Envoy's cluster stats show them).
        if self.fallback {
            return;
        }
        let outcome = self.outcome(region);
        if outcome.unattributed() {
            stats.unattributed.add(1);
        }
        for (i, t) in outcome.charges().into_iter().flatten() {
            for (metric, n) in [
                (stats.upstream_failures.get(i), t.failures),
                (stats.answered.get(i), t.answered),
                (stats.client_cancelled.get(i), t.cancelled),
            ] {
                if let (Some(m), true) = (metric, n > 0) {
                    m.add(n as i64);
                }
            }
        }
        if let Some(p) = self
            .pending
            .take()
            .filter(|p| p.first_byte && outcome.teaches)
        {
            if let Some(q) = self.shared.queue() {
                calls::enqueue(q, &p.observation.encode());
            }
        }
    }
}

impl RouterFilter {
    /// How the request routed to `region` ended, from Envoy's stream info.
    fn outcome(&self, region: usize) -> Outcome {
        let cfg = &self.shared.cfg;
        let mut ending = Ending {
            flags: calls::property_u64(&["response", "flags"]).unwrap_or(0),
            status: self.status,
            via_upstream: None,
            attempts: calls::property_u64(&["upstream", "request_attempt_count"])
                .map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            host_region: calls::property(&HOST_REGION)
                .and_then(|name| cfg.regions.iter().position(|r| r.name.as_bytes() == name)),
        };
        if ending.needs_details() {
            ending.via_upstream = calls::property(&["response", "code_details"])
                .map(|d| d == VIA_UPSTREAM.as_bytes());
        }
        ending.outcome(region)
    }
}
