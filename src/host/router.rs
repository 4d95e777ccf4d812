//! The `router` HTTP filter: waits for an inference request's body, asks the
//! core for the region with the lowest expected TTFT, sets the cluster
//! header and clears the route cache. Everything else goes to the default
//! region untouched. A client-sent cluster header is always removed.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::calls::{self, HostStore, Metric};
use super::view::View;
use crate::config::{Config, InvalidRequests};
use crate::cost::{self, Decision, Reason};
use crate::directory::{layout_of, Directory};
use crate::openai;
use crate::prefix::PromptHasher;
use crate::request::{self, Endpoint, RequestError};

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
}

pub struct RouterShared {
    cfg: Rc<Config>,
    dir: Directory,
    view: RefCell<View>,
    stats: Stats,
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
                .map(|r| Metric::counter(&format!("llm_geo_router.router.decision.{}", r.as_str())))
                .collect(),
            invalid: Metric::counter("llm_geo_router.router.invalid_request"),
            passthrough: Metric::counter("llm_geo_router.router.passthrough"),
        };
        let dir = Directory {
            slots: cfg.directory.slots,
            ttl_ms: u64::from(cfg.directory.ttl_s) * 1000,
            regions: cfg.regions.len(),
            layout: layout_of(cfg.regions.iter().map(|r| r.name.as_str())),
        };
        RouterShared {
            cfg,
            dir,
            view: View::new(),
            stats,
        }
    }
}

pub struct RouterFilter {
    shared: Rc<RouterShared>,
    endpoint: Option<Endpoint>,
    routed: Option<usize>,
    decision_header: Option<String>,
}

impl RouterFilter {
    pub fn new(shared: Rc<RouterShared>) -> Self {
        RouterFilter {
            shared,
            endpoint: None,
            routed: None,
            decision_header: None,
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

    /// An invalid inference request: reject with 400, or pass it through to
    /// the default region, as configured.
    fn invalid(&mut self, e: &RequestError) -> Action {
        self.shared.stats.invalid.add(1);
        if self.shared.cfg.invalid_requests == InvalidRequests::PassThrough {
            self.route_default();
            return Action::Continue;
        }
        let body = openai::error_body(
            &e.message,
            "invalid_request_error",
            e.param,
            Some("invalid_request"),
        );
        calls::send_response(400, &[("content-type", "application/json")], &body);
        Action::Pause
    }

    fn route(&mut self, body: &[u8]) -> Action {
        let Some(endpoint) = self.endpoint else {
            self.route_default();
            return Action::Continue;
        };
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
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
        // Short prompts have no full block: the session key (header, else
        // `user`) keeps a conversation's first turns together.
        let first_block = req.prompt.first_block.or_else(|| {
            calls::request_header(&cfg.headers.session)
                .or_else(|| req.user.clone())
                .map(|s| xxhash_rust::xxh3::xxh3_64_with_seed(s.as_bytes(), cfg.prefix.hash_seed))
        });
        let decision = cost::decide(&cost::Inputs {
            config: cfg,
            snapshot: fresh.as_ref().map(|(s, _)| s.as_ref()),
            snapshot_index: fresh.as_ref().map_or(&[][..], |(_, i)| i.as_slice()),
            cached_blocks: &lookup.cached_blocks,
            inflight: &inflight,
            prompt_tokens: req.prompt_tokens(cfg.prefix.bytes_per_token),
            first_block,
        });
        shared.dir.record(
            &mut store,
            &mut lookup,
            &req.prompt.checkpoints,
            decision.region,
            now,
        );
        if let Some(m) = Reason::ALL
            .iter()
            .position(|r| *r == decision.reason)
            .and_then(|i| shared.stats.decisions.get(i))
        {
            m.add(1);
        }
        if cfg.headers.decision.is_some() {
            self.decision_header = Some(describe(
                cfg,
                &decision,
                fresh.as_ref().map_or(0, |(s, _)| s.level),
            ));
        }
        self.set_region(decision.region, true);
        Action::Continue
    }
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
        // Never let a client pick the cluster.
        calls::set_request_header(&cfg.headers.cluster, None);
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
