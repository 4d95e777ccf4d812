//! The `router` HTTP filter: waits for an inference request's body, asks the
//! core for the region with the lowest expected TTFT, sets the cluster
//! header and clears the route cache. Everything else goes to the default
//! region untouched. A client-sent cluster header is always removed.
//!
//! For streamed requests it measures the TTFT it can see (request routed →
//! first response body byte) and reports it with the predicted cost terms to
//! the probe over a shared queue, which tunes the cost model.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::calls::{self, HostStore, Metric};
use super::view::View;
use crate::config::{Config, InvalidRequests};
use crate::cost::{self, Decision, Reason, Weights};
use crate::directory::{layout_of, Directory};
use crate::openai;
use crate::prefix::PromptHasher;
use crate::request::{self, Endpoint, RequestError};
use crate::session::Sessions;
use crate::tuning::Observation;

/// Shared queue that carries TTFT observations to the probe.
pub const OBSERVATIONS_QUEUE: &str = "llm_geo_router.observations";

struct Stats {
    /// Per region: requests in flight from this Envoy (one stat shared by
    /// every worker and the probe).
    rq_active: Vec<Metric>,
    /// Per region: requests routed there.
    rq_total: Vec<Metric>,
    /// Per reason, in `Reason::ALL` order.
    decisions: Vec<Metric>,
    invalid: Metric,
    passthrough: Metric,
    residency_rejected: Metric,
}

pub struct RouterShared {
    cfg: Rc<Config>,
    dir: Directory,
    sessions: Sessions,
    view: RefCell<View>,
    stats: Stats,
    vm_id: String,
    queue: Cell<Option<u32>>,
}

/// Name of the per-region in-flight gauge; the probe reads the same stat.
pub fn rq_active_name(region: &str) -> String {
    format!("llm_geo_router.region.{region}.rq_active")
}

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
            decisions: Reason::ALL
                .iter()
                .map(|r| {
                    Metric::counter(&format!("llm_geo_router.router.decision.{}", r.stat_name()))
                })
                .collect(),
            invalid: Metric::counter("llm_geo_router.router.invalid_request"),
            passthrough: Metric::counter("llm_geo_router.router.passthrough"),
            residency_rejected: Metric::counter("llm_geo_router.router.residency_rejected"),
        };
        let layout = layout_of(cfg.regions.iter().map(|r| r.name.as_str()));
        let ttl_ms = u64::from(cfg.directory.ttl_s) * 1000;
        let dir = Directory {
            slots: cfg.directory.slots,
            ttl_ms,
            regions: cfg.regions.len(),
            layout,
        };
        let sessions = Sessions {
            slots: cfg.directory.slots,
            ttl_ms,
            layout,
            seed: cfg.prefix.hash_seed,
        };
        let vm_id = calls::property(&["plugin_vm_id"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        RouterShared {
            cfg,
            dir,
            sessions,
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

/// What to report about a streamed request once its first byte arrives.
struct Pending {
    routed_ms: u64,
    observation: Observation,
}

pub struct RouterFilter {
    shared: Rc<RouterShared>,
    endpoint: Option<Endpoint>,
    routed: Option<usize>,
    decision_header: Option<String>,
    pending: Option<Pending>,
}

impl RouterFilter {
    pub fn new(shared: Rc<RouterShared>) -> Self {
        RouterFilter {
            shared,
            endpoint: None,
            routed: None,
            decision_header: None,
            pending: None,
        }
    }

    fn set_region(&mut self, region: usize, inflight: bool) {
        let cfg = &self.shared.cfg;
        let Some(r) = cfg.regions.get(region) else {
            return;
        };
        calls::set_request_header(&cfg.headers.cluster, Some(&r.cluster));
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
        // The residency pin is a hard constraint: an unknown value is refused
        // rather than routed somewhere it may not go.
        let allowed = match cfg
            .residency
            .header
            .as_deref()
            .and_then(calls::request_header)
        {
            None => None,
            Some(value) => match cfg.residency_mask(&value) {
                Some(mask) => Some(mask),
                None => {
                    shared.stats.residency_rejected.add(1);
                    let known: Vec<&str> =
                        cfg.residency.allowed.keys().map(String::as_str).collect();
                    let msg = format!(
                        "unknown data residency {value:?}; known: {}",
                        known.join(", ")
                    );
                    return self.reject("invalid_residency", &msg, None);
                }
            },
        };
        let hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed);
        let req = match request::parse(endpoint, body, hasher) {
            Ok(r) => r,
            Err(e) => return self.invalid(&e),
        };
        let now = calls::now_ms();
        let fresh = shared.view.borrow_mut().current(cfg, now);
        let mut store = HostStore;
        let mut lookup = shared.dir.lookup(&mut store, &req.prompt.checkpoints, now);
        let inflight: Vec<f64> = shared
            .stats
            .rq_active
            .iter()
            .map(|m| m.get() as f64)
            .collect();
        let session_key = calls::request_header(&cfg.headers.session).or_else(|| req.user.clone());
        let session = session_key
            .as_deref()
            .map(|k| shared.sessions.lookup(&mut store, k, now));
        // Short prompts have no full block: the session key keeps a
        // conversation's first turns together.
        let first_block = req.prompt.first_block.or(session.map(|s| s.hash));
        let snapshot = fresh.as_ref().map(|(s, _)| s.as_ref());
        let weights = snapshot.and_then(|s| s.weights).map_or_else(
            || Weights::configured(cfg),
            |w| Weights {
                w_rtt: w.w_rtt,
                w_queue: w.w_queue,
            },
        );
        let prompt_tokens = req.prompt_tokens(cfg.prefix.bytes_per_token);
        let decision = cost::decide(&cost::Inputs {
            config: cfg,
            snapshot,
            snapshot_index: fresh.as_ref().map_or(&[][..], |(_, i)| i.as_slice()),
            cached_blocks: &lookup.cached_blocks,
            inflight: &inflight,
            prompt_tokens,
            first_block,
            allowed: allowed.as_deref(),
            session_region: session.and_then(|s| s.last).map(|(r, _)| r),
            weights,
        });
        shared.dir.record(
            &mut store,
            &mut lookup,
            &req.prompt.checkpoints,
            decision.region,
            now,
        );
        if let Some(s) = session {
            shared.sessions.record(&mut store, s, decision.region, now);
        }
        if let Some(m) = Reason::ALL
            .iter()
            .position(|r| *r == decision.reason)
            .and_then(|i| shared.stats.decisions.get(i))
        {
            m.add(1);
        }
        let kv = migration_for(
            cfg,
            &decision,
            snapshot,
            fresh.as_ref().map(|(_, i)| i.as_slice()),
        );
        if let Some(kv) = &kv {
            let from = cfg.regions.get(kv.from).map_or("", |r| r.name.as_str());
            calls::set_request_header(&cfg.migration.header, Some(&kv.header_value(from)));
        }
        if cfg.headers.decision.is_some() {
            let mut text = describe(cfg, &decision, snapshot.map_or(0, |s| s.level));
            if let Some(kv) = &kv {
                let from = cfg.regions.get(kv.from).map_or("", |r| r.name.as_str());
                text.push_str(&format!(
                    "; kv_action={}",
                    kv.header_value(from).replace("; ", ",")
                ));
            }
            self.decision_header = Some(text);
        }
        if req.stream && decision.reason != Reason::Fallback {
            self.pending =
                observation(&decision, weights, prompt_tokens).map(|observation| Pending {
                    routed_ms: now,
                    observation,
                });
        }
        self.set_region(decision.region, true);
        Action::Continue
    }
}

/// The fetch-or-recompute decision when the request leaves the region that
/// holds its prefix (a pin, the load bound or the queue moved it).
fn migration_for(
    cfg: &Config,
    d: &Decision,
    snapshot: Option<&crate::snapshot::Snapshot>,
    index: Option<&[Option<usize>]>,
) -> Option<crate::migration::KvAction> {
    if !cfg.migration.enabled {
        return None;
    }
    let state = |i: usize| {
        snapshot.and_then(|s| {
            index
                .and_then(|x| x.get(i).copied().flatten())
                .and_then(|j| s.regions.get(j))
        })
    };
    let rtt: Vec<f64> = cfg
        .regions
        .iter()
        .enumerate()
        .map(|(i, r)| state(i).and_then(|s| s.rtt_ms).unwrap_or(r.rtt_ms))
        .collect();
    let util: Vec<f64> = cfg
        .regions
        .iter()
        .zip(&d.costs)
        .map(|(r, c)| c.occupancy / f64::from(r.max_concurrency.max(1)))
        .collect();
    crate::migration::kv_action(cfg, d, &rtt, &util)
}

/// The unweighted terms the decision predicted for the chosen region.
fn observation(d: &Decision, w: Weights, prompt_tokens: u64) -> Option<Observation> {
    let c = d.costs.get(d.region)?;
    let unweight = |v: f64, weight: f64| if weight > 0.0 { v / weight } else { 0.0 };
    Some(Observation {
        region: u16::try_from(d.region).ok()?,
        rtt_ms: unweight(c.rtt_ms, w.w_rtt) as f32,
        queue_ms: unweight(c.queue_ms, w.w_queue) as f32,
        uncached_tokens: u32::try_from(prompt_tokens.saturating_sub(c.cached_tokens))
            .unwrap_or(u32::MAX),
        prefill_ms: c.prefill_ms as f32,
        observed_ms: 0.0,
    })
}

fn describe(cfg: &Config, d: &Decision, level: u8) -> String {
    let name = |i: usize| cfg.regions.get(i).map_or("?", |r| r.name.as_str());
    let mut s = format!("region={}; reason={}", name(d.region), d.reason.as_str());
    if let Some(c) = d.costs.get(d.region) {
        s.push_str(&format!(
            "; ttft_ms={:.1}; rtt_ms={:.1}; prefill_ms={:.1}; queue_ms={:.1}; cached_tokens={}",
            c.total_ms, c.rtt_ms, c.prefill_ms, c.queue_ms, c.cached_tokens
        ));
    }
    if let Some((i, c)) = d.runner_up.and_then(|i| d.costs.get(i).map(|c| (i, c))) {
        s.push_str(&format!(
            "; runner_up={}; runner_up_ttft_ms={:.1}",
            name(i),
            c.total_ms
        ));
    }
    s.push_str(&format!("; level={level}"));
    s
}

impl Context for RouterFilter {}

impl HttpContext for RouterFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = self.shared.cfg.clone();
        // Never let a client pick the cluster or speak for the router.
        calls::set_request_header(&cfg.headers.cluster, None);
        calls::set_request_header(&cfg.migration.header, None);
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
        if !body.is_empty() && !request::looks_like_json(&body) {
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
        // Only a successful stream's first byte is a time to first token.
        let ok = calls::response_header(":status").is_some_and(|s| s.starts_with('2'));
        if !ok {
            self.pending = None;
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        if body_size > 0 {
            if let Some(p) = self.pending.take() {
                let mut o = p.observation;
                o.observed_ms = calls::now_ms().saturating_sub(p.routed_ms) as f32;
                if let Some(q) = self.shared.queue() {
                    calls::enqueue(q, &o.encode());
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(region) = self.routed.take() {
            if let Some(m) = self.shared.stats.rq_active.get(region) {
                m.add(-1);
            }
        }
    }
}
