//! The router filter on one request: wait for an inference request's body,
//! route it (`decision::pipeline`), set the cluster header and clear the route cache;
//! send everything else to the default region untouched; remove any
//! client-sent cluster header. The same stream on the answer is in
//! `roots::router_answer`: when a successful answer's first bytes arrive,
//! it reads from Envoy which region's host served the last try and charges
//! to that region, and to no other, what the answer teaches: the prompt's
//! prefix and the session (the directory), the stored response's id and the
//! engine's `usage`. A refused, failed or unattributable answer teaches
//! nothing. For a stream answered on the first try by the region routed to,
//! it reports the observed TTFT with the predicted cost terms to the probe,
//! which tunes the cost. When the request ends it reads from Envoy how, and
//! charges the outcome to the region whose engine had it (`outcome`).

use std::rc::Rc;

use crate::cache::stored_responses::{self, Head};
use crate::config::{Config, InvalidRequests, StreamUsage};
use crate::decision::cost::Reason;
use crate::decision::pipeline::{Refusal, RouteInputs, Routed, Router};
use crate::decision::placement::UnreadInputs;
use crate::fleet::view::View;
use crate::learning::tuning::Observation;
use crate::learning::usage::UsageScan;
use crate::request::limits::EngineRefusal;
use crate::request::openai::{self, BodyKind, Endpoint, RequestError};
use crate::shared::flow::{Flow, Reply};
use crate::shared::host_api::StreamHost;
use crate::shared::names::{Global, RegionStat, Stat, DECISION_FILTER_STATE, POOL_FALLBACK};

/// The router filter's per-configuration state (one per root context).
#[derive(Debug)]
pub struct RouterShared {
    pub cfg: Rc<Config>,
    pub router: Router,
    /// Per region: its in-flight count, reused per request (no allocation).
    inflight: std::cell::RefCell<Vec<f64>>,
}

impl RouterShared {
    /// What this Envoy knows about a request besides the snapshot: its
    /// in-flight requests per region (read into the reused buffer) and the
    /// residency header's value, if configured and sent.
    fn local_inputs(
        &self,
        host: &mut dyn StreamHost,
    ) -> (std::cell::RefMut<'_, Vec<f64>>, Option<String>) {
        let mut inflight = self.inflight.borrow_mut();
        for (i, v) in inflight.iter_mut().enumerate() {
            *v = host.stat(Stat::Region(i, RegionStat::RqActive)) as f64;
        }
        let residency = self
            .cfg
            .residency
            .header
            .as_deref()
            .and_then(|h| host.request_header(h));
        (inflight, residency)
    }

    pub fn new(cfg: Rc<Config>) -> RouterShared {
        RouterShared {
            router: Router::new(&cfg),
            inflight: std::cell::RefCell::new(vec![0.0; cfg.regions.len()]),
            cfg,
        }
    }
}

/// A streamed request's predicted terms, until its first byte arrives.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) routed_ms: u64,
    pub(super) observation: Observation,
}

/// The router on one request.
#[derive(Debug, Default)]
pub struct RouterStream {
    /// An inference request waiting for its body.
    pub(super) endpoint: Option<Endpoint>,
    /// The region routed to (counted in flight there until the end).
    pub(super) routed: Option<usize>,
    /// The region the request was sent to, read or not (its outcome is
    /// the region's, unless Envoy or a filter answered in its place).
    pub(super) sent: Option<usize>,
    /// `rq_total` was counted for `sent`: at the response headers when an
    /// upstream answered or failed, at the end otherwise.
    pub(super) counted: bool,
    /// The response is a local reply that never concerned the region (no
    /// route, a direct response, another filter's refusal): neither
    /// counted nor labelled as the region's.
    pub(super) local: bool,
    /// The region whose engine answered (its host served the last try),
    /// once a successful answer has started; `None` before, or when a
    /// retry went to a host of no configured region.
    pub(super) served: Option<usize>,
    /// The answer's first bytes have been seen (what they teach is learnt).
    pub(super) started: bool,
    /// The guard sent this request to the fallback pool.
    pub(super) fallback: bool,
    /// The status of the response headers the client got, if any.
    pub(super) status: Option<u32>,
    pub(super) decision_header: Option<String>,
    pub(super) pending: Option<Pending>,
    /// The decision made for this request, with every cost term.
    pub(super) decided: Option<Routed>,
    /// The scan of the answer for the engine's `usage`.
    pub(super) usage: Option<UsageScan>,
    /// The start of a stored Responses API answer, until its `id` is read.
    pub(super) head: Option<Head>,
    /// Per region (bit i), as the snapshot said when the request was
    /// routed: its engine keeps no Responses (`keeps_none`), or whether it
    /// does is not known yet (`keeping_unknown`; the probe checks).
    pub(super) keeps_none: u64,
    pub(super) keeping_unknown: u64,
    /// When the request headers arrived (ms): where the client's TTFT and
    /// the request's duration start.
    pub(super) arrived_ms: u64,
    /// A successful answer's first byte is a time to first token: a
    /// routed stream of the main pool, not a Responses one.
    pub(super) ttft: bool,
    /// When the answer's first body byte arrived (ms).
    pub(super) first_byte_ms: Option<u64>,
    /// The output tokens of the answer's usage, once read.
    pub(super) output_tokens: Option<u64>,
}

impl RouterStream {
    pub fn new() -> RouterStream {
        RouterStream::default()
    }

    /// The request headers arrived.
    pub fn on_request_headers(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        end_of_stream: bool,
    ) -> Flow {
        let cfg = &*shared.cfg;
        self.arrived_ms = host.now_ms();
        // Never let a client pick the cluster or speak for the router (Envoy
        // removes them earlier too; this holds without that).
        for name in [&cfg.headers.cluster, &cfg.migration.header] {
            if host.request_header(name).is_some() {
                write_header(host, name, None);
            }
        }
        // Only the guard sets the pool (it removes any client value first).
        self.fallback = host.request_header(&cfg.headers.pool).as_deref() == Some(POOL_FALLBACK);
        let method = host.request_header(":method").unwrap_or_default();
        let path = host.request_header(":path").unwrap_or_default();
        self.endpoint = openai::endpoint(&method, &path)
            .filter(|_| !openai::is_encoded(host.request_header("content-encoding").as_deref()));
        if self.endpoint.is_none() {
            return self.route_unread(shared, host, view, stored_responses::path_id(&path));
        }
        if end_of_stream {
            return self.on_request_body(shared, host, view, &[]);
        }
        Flow::Pause
    }

    /// Whether the router waits for the complete body.
    pub fn wants_body(&self) -> bool {
        self.endpoint.is_some()
    }

    /// A request whose body is already whole (the simulator, the CLI, the
    /// tests): its headers, then its body if the router waits for it.
    pub fn on_whole_request(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        body: &[u8],
    ) -> Flow {
        let flow = self.on_request_headers(shared, host, view, false);
        if flow == Flow::Pause && self.wants_body() {
            return self.on_request_body(shared, host, view, body);
        }
        flow
    }

    /// The decision the router made for this request, once it has (none
    /// for a request sent to the default region uninterpreted).
    pub fn decision(&self) -> Option<&Routed> {
        self.decided.as_ref()
    }

    /// The host could not read the complete body the router waited for:
    /// the request is routed as one the router does not read, and counted
    /// in `router.body_unreadable` (not refused as an empty request: the
    /// client sent one).
    pub fn on_body_unreadable(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
    ) -> Flow {
        if self.endpoint.take().is_none() {
            return Flow::Continue;
        }
        host.count(Stat::Global(Global::RouterBodyUnreadable), 1);
        self.route_unread(shared, host, view, None)
    }

    /// The complete request body.
    pub fn on_request_body(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        body: &[u8],
    ) -> Flow {
        let Some(endpoint) = self.endpoint.take() else {
            return Flow::Continue;
        };
        // A blank body is an empty request (refused below), not a non-JSON one.
        if openai::body_kind(body) == BodyKind::Other {
            return self.route_unread(shared, host, view, None);
        }
        self.route(shared, host, view, endpoint, body)
    }

    fn route(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Flow {
        let cfg = &*shared.cfg;
        let now = host.now_ms();
        let fresh = view.current(cfg, host, now);
        let (inflight, residency) = shared.local_inputs(host);
        let session = host.request_header(&cfg.headers.session);
        let inputs = RouteInputs {
            endpoint,
            body,
            session_header: session.as_deref(),
            residency: residency.as_deref(),
            snapshot: fresh.as_ref().map(|f| &*f.snapshot),
            snapshot_index: fresh.as_ref().map_or(&[][..], |f| f.index.as_slice()),
            inflight: &inflight,
            now_ms: now,
            fallback: self.fallback,
        };
        let result = shared.router.route(cfg, host, &inputs);
        // Released before anything below may place the request again.
        drop(inflight);
        let routed = match result {
            Ok(r) => r,
            Err(Refusal::Invalid(e)) => return self.invalid(shared, host, view, &e),
            Err(Refusal::UnknownResidency(msg)) => {
                // The residency pin is a hard constraint: an unknown value is
                // refused rather than routed somewhere it may not go.
                host.count(Stat::Global(Global::RouterResidencyRejected), 1);
                return reject("invalid_residency", &msg, None);
            }
            Err(Refusal::ContextLength { refusal, .. }) => {
                // Refused here rather than shipped across the WAN to be
                // refused by the engine, as the engine answers it.
                host.count(Stat::Global(Global::RouterContextRejected), 1);
                return reject_context(&refusal);
            }
            Err(Refusal::HolderUnavailable(message)) => {
                return holder_unavailable(host, &message, Some("previous_response_id"));
            }
        };
        if routed.unknown_response {
            host.count(Stat::Global(Global::RouterResponseUnknown), 1);
        }
        let d = &routed.decision;
        host.count(Stat::Decision(d.reason), 1);
        host.count(Stat::RegionDecision(d.region, d.reason), 1);
        if let Some(kv) = &routed.kv {
            let from = cfg.regions.get(kv.from).map_or("", |r| r.name.as_str());
            write_header(host, &cfg.migration.header, Some(&kv.header_value(from)));
        }
        let mut text = routed.describe(cfg, fresh.as_ref().map_or(0, |f| f.level()));
        if self.fallback {
            text.push_str("; pool=fallback");
        }
        host.set_filter_state(DECISION_FILTER_STATE, text.as_bytes());
        if cfg.headers.decision.is_some() {
            self.decision_header = Some(text);
        }
        // The fallback pool's TTFT says nothing about the main pool's model.
        // Nor does a Responses stream's first byte: vLLM sends its
        // `response.created` event before the request is scheduled.
        if routed.stream
            && d.reason != Reason::Fallback
            && !self.fallback
            && endpoint != Endpoint::Responses
        {
            self.pending = routed.observation().map(|observation| Pending {
                routed_ms: now,
                observation,
            });
        }
        self.ttft = routed.stream && !self.fallback && endpoint != Endpoint::Responses;
        // Streams get the route with a first-byte deadline; a non-streamed
        // answer's first byte is its last, so it must not.
        if routed.stream {
            write_header(host, &cfg.headers.stream, Some("true"));
        } else if host.request_header(&cfg.headers.stream).is_some() {
            write_header(host, &cfg.headers.stream, None);
        }
        self.set_region(shared, host, d.region, true);
        // The fallback pool is other engines: their caches say nothing
        // about the region's.
        // A stream is read only when it carries a usage: every chunk read
        // is a host call and a pass over its bytes.
        let usage_comes = !routed.stream
            || routed.stream_usage
            || cfg.directory.stream_usage == StreamUsage::Always;
        if !self.fallback && usage_comes {
            self.usage = Some(UsageScan::default());
        }
        // A response produced by the fallback pool is in its engines: not
        // followed.
        if routed.store_response && !self.fallback {
            self.head = Some(Head::default());
            for i in 0..cfg.regions.len().min(64) {
                let keeps = fresh.as_ref().map(|f| {
                    f.snapshot
                        .region_at(&f.index, i)
                        .and_then(|r| r.stores_responses)
                });
                match keeps {
                    Some(Some(false)) => self.keeps_none |= 1 << i,
                    Some(None) => self.keeping_unknown |= 1 << i,
                    _ => {}
                }
            }
        }
        self.decided = Some(routed);
        Flow::Continue
    }

    /// Send the request to `region`'s cluster (its fallback pool's, when the
    /// guard chose that pool); `inflight`: count it in flight there.
    fn set_region(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        region: usize,
        inflight: bool,
    ) {
        let cfg = &*shared.cfg;
        let Some(r) = cfg.regions.get(region) else {
            return;
        };
        let cluster = match (&r.fallback_cluster, self.fallback) {
            (Some(fallback), true) => {
                host.count(Stat::Region(region, RegionStat::FallbackRqTotal), 1);
                fallback
            }
            _ => &r.cluster,
        };
        // Both or the route does not change: counted once.
        if !(host.set_request_header(&cfg.headers.cluster, Some(cluster))
            && host.clear_route_cache())
        {
            host.count(Stat::Global(Global::RouterHeaderWriteFailed), 1);
        }
        self.sent = Some(region);
        if inflight {
            host.count(Stat::Region(region, RegionStat::RqActive), 1);
            self.routed = Some(region);
        }
    }

    /// A request the router does not read (another endpoint, a body it
    /// will not interpret): the stored response's region for
    /// `/v1/responses/{id}` paths, else the best routable region by round
    /// trip and load, `default_region` preferred (`Router::place`).
    fn route_unread(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        response_id: Option<&str>,
    ) -> Flow {
        let cfg = &*shared.cfg;
        host.count(Stat::Global(Global::RouterPassthrough), 1);
        let now = host.now_ms();
        let fresh = view.current(cfg, host, now);
        let (inflight, residency) = shared.local_inputs(host);
        let inputs = UnreadInputs {
            residency: residency.as_deref(),
            snapshot: fresh.as_ref().map(|f| &*f.snapshot),
            snapshot_index: fresh.as_ref().map_or(&[][..], |f| f.index.as_slice()),
            inflight: &inflight,
            now_ms: now,
            response_id,
        };
        let placed = match shared.router.place(cfg, host, &inputs) {
            Ok(p) => p,
            Err(Refusal::UnknownResidency(msg)) => {
                host.count(Stat::Global(Global::RouterResidencyRejected), 1);
                return reject("invalid_residency", &msg, None);
            }
            Err(Refusal::HolderUnavailable(msg)) => return holder_unavailable(host, &msg, None),
            Err(Refusal::Invalid(e)) => return reject("invalid_request", &e.message, e.param),
            Err(Refusal::ContextLength { refusal, .. }) => return reject_context(&refusal),
        };
        drop(inflight);
        if placed.unknown_response {
            host.count(Stat::Global(Global::RouterResponseUnknown), 1);
        }
        self.set_region(shared, host, placed.region, false);
        if cfg.headers.decision.is_some() {
            let name = cfg
                .regions
                .get(placed.region)
                .map_or("", |r| r.name.as_str());
            self.decision_header = Some(format!("region={name}; reason={}", placed.reason));
        }
        Flow::Continue
    }

    /// An invalid inference request: 400, or the default region untouched,
    /// as configured.
    fn invalid(
        &mut self,
        shared: &RouterShared,
        host: &mut dyn StreamHost,
        view: &mut View,
        e: &RequestError,
    ) -> Flow {
        host.count(Stat::Global(Global::RouterInvalidRequest), 1);
        if shared.cfg.invalid_requests == InvalidRequests::PassThrough {
            return self.route_unread(shared, host, view, None);
        }
        reject("invalid_request", &e.message, e.param)
    }
}

/// Write (or remove) a request header the route depends on; a write the
/// host refused is counted (`router.header_write_failed`): the request
/// then goes where Envoy's route sends it without the write.
fn write_header(host: &mut dyn StreamHost, name: &str, value: Option<&str>) {
    if !host.set_request_header(name, value) {
        host.count(Stat::Global(Global::RouterHeaderWriteFailed), 1);
    }
}

/// The region holding a stored response cannot take its follow-up: 503,
/// saying a retry elsewhere cannot succeed.
fn holder_unavailable(host: &mut dyn StreamHost, message: &str, param: Option<&str>) -> Flow {
    host.count(Stat::Global(Global::RouterResponseHolderUnavailable), 1);
    Flow::Reply(Reply::error(
        503,
        "server_error",
        "response_region_unavailable",
        message,
        param,
        &[],
    ))
}

/// An output every allowed region's engine is sure to refuse: 400 as that
/// engine answers it (`limits::refusal`).
fn reject_context(r: &EngineRefusal) -> Flow {
    Flow::Reply(Reply::json_status(400, r.body()))
}

fn reject(code: &str, message: &str, param: Option<&str>) -> Flow {
    Flow::Reply(Reply::error(
        400,
        "invalid_request_error",
        code,
        message,
        param,
        &[],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learning::outcome::{flags, VIA_UPSTREAM};
    use crate::shared::host_api::Recorder;
    use crate::shared::names::{
        ErrorType, RegionHistogram, TokenType, ATTEMPTS_PROPERTY, CODE_DETAILS_PROPERTY,
        HOST_REGION_PROPERTY, OBSERVATIONS_QUEUE, RESPONSE_FLAGS_PROPERTY,
    };

    use crate::fleet::snapshot::Snapshot;

    const NOW: u64 = 1_700_000_000_000;

    fn shared(extra: &str) -> RouterShared {
        let c = Config::parse(
            format!(
                r#"{{"regions":[
                  {{"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5,"max_concurrency":8,"fallback_cluster":"cn_fb"}},
                  {{"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40,"max_concurrency":8}}],
                  "headers":{{"decision":"x-llm-route"}},
                  "residency":{{"header":"x-res","allowed":{{"eu":["mid"]}}}}{extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        RouterShared::new(Rc::new(c))
    }

    fn new_host(sh: &RouterShared) -> Recorder {
        let mut host = Recorder {
            now_ms: NOW,
            ..Recorder::default()
        };
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        snap.version = 1;
        snap.generated_ms = NOW;
        host.publish(&snap);
        // Answers come from the region's engine unless a test says not.
        host.properties.insert(
            CODE_DETAILS_PROPERTY.join("."),
            VIA_UPSTREAM.as_bytes().to_vec(),
        );
        host
    }

    /// The engine answered with `status` (a response from upstream).
    fn engine_status(host: &mut Recorder, status: Option<u32>) {
        host.status = status;
        host.properties.insert(
            CODE_DETAILS_PROPERTY.join("."),
            VIA_UPSTREAM.as_bytes().to_vec(),
        );
    }

    type Headers = Vec<(&'static str, &'static str)>;

    fn headers(path: &'static str, extra: &[(&'static str, &'static str)]) -> Headers {
        let mut h = vec![(":method", "POST"), (":path", path)];
        h.extend_from_slice(extra);
        h
    }

    fn request(
        sh: &RouterShared,
        host: &mut Recorder,
        h: Headers,
        body: &str,
    ) -> (RouterStream, Flow) {
        let mut s = RouterStream::new();
        host.request(&h);
        let flow = s.on_whole_request(sh, host, &mut View::new(), body.as_bytes());
        (s, flow)
    }

    const CHAT: &str = r#"{"messages":[{"role":"user","content":"hello there"}]}"#;
    const STREAM: &str = r#"{"messages":[{"role":"user","content":"hello there"}],"stream":true}"#;

    #[test]
    fn an_inference_request_is_routed_and_counted_in_flight() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let h = headers(
            "/v1/chat/completions",
            &[("x-llm-cluster", "cm"), ("x-llm-stream", "true")],
        );
        let (mut s, flow) = request(&sh, &mut host, h, CHAT);
        assert_eq!(flow, Flow::Continue);
        // The client's cluster and stream headers are gone; the router's is set.
        assert_eq!(host.request_headers[0], ("x-llm-cluster".into(), None));
        assert_eq!(host.request_header("x-llm-cluster"), Some(Some("cn")));
        assert_eq!(host.request_header("x-llm-stream"), Some(None));
        assert_eq!(host.route_cache_cleared, 1);
        // In flight now; a request to the region once an answer comes.
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqTotal)), 0);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqActive)), 1);
        assert_eq!(host.value(Stat::Decision(Reason::Rtt)), 1);
        assert_eq!(host.value(Stat::RegionDecision(0, Reason::Rtt)), 1);
        let (key, text) = &host.filter_state[0];
        assert_eq!(key, DECISION_FILTER_STATE);
        assert!(text.starts_with(b"region=near; reason=rtt; ttft_ms="));
        engine_status(&mut host, Some(200));
        s.on_response_headers(&sh, &mut host);
        assert!(host.response_headers[0]
            .1
            .starts_with("region=near; reason=rtt"));
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqTotal)), 1);
        s.on_log(&sh, &mut host);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqTotal)), 1);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqActive)), 0);
        assert_eq!(
            host.value(Stat::Region(0, RegionStat::UpstreamRqAnswered)),
            1
        );
    }

    #[test]
    fn what_the_host_refuses_is_counted_and_an_unreadable_body_is_routed_unread() {
        let sh = shared("");
        let mut host = new_host(&sh);
        // The cluster header and the route cache refused: counted once; the
        // stream header's removal too.
        host.refuse_header_writes = true;
        let h = headers("/v1/chat/completions", &[("x-llm-stream", "true")]);
        let (_, flow) = request(&sh, &mut host, h, STREAM);
        assert_eq!(flow, Flow::Continue);
        assert_eq!(host.value(Stat::Global(Global::RouterHeaderWriteFailed)), 2);
        host.refuse_header_writes = false;
        let (_, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), CHAT);
        assert_eq!(host.value(Stat::Global(Global::RouterHeaderWriteFailed)), 2);
        // A TTFT observation the host drops: counted.
        host.refuse_enqueue = true;
        let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), STREAM);
        engine_status(&mut host, Some(200));
        s.on_response_headers(&sh, &mut host);
        s.on_first_byte(&sh, &mut host);
        assert_eq!(host.value(Stat::Global(Global::QueueDropped)), 1);
        // A body the host cannot read: routed as a request the router does
        // not read, not refused as an empty one.
        let mut s = RouterStream::new();
        let mut view = View::new();
        host.request(&headers("/v1/chat/completions", &[]));
        assert_eq!(
            s.on_request_headers(&sh, &mut host, &mut view, false),
            Flow::Pause
        );
        let passthrough = host.value(Stat::Global(Global::RouterPassthrough));
        assert_eq!(
            s.on_body_unreadable(&sh, &mut host, &mut view),
            Flow::Continue
        );
        assert_eq!(host.value(Stat::Global(Global::RouterBodyUnreadable)), 1);
        assert_eq!(
            host.value(Stat::Global(Global::RouterPassthrough)),
            passthrough + 1
        );
        assert!(matches!(
            host.request_header("x-llm-cluster"),
            Some(Some("cn" | "cm"))
        ));
        assert_eq!(host.value(Stat::Global(Global::RouterInvalidRequest)), 0);
    }

    #[test]
    fn a_local_reply_is_neither_counted_nor_labelled_as_the_regions() {
        let sh = shared("");
        // Envoy's 404 for a path no route matches (flag NR, details
        // route_not_found), and a direct response's 200 (no flag).
        for (status, details, flag) in [
            (404, "route_not_found", 1u64 << 8),
            (200, "direct_response", 0),
        ] {
            for path in ["/unknown", "/v1/chat/completions"] {
                let mut host = new_host(&sh);
                let (mut s, _) = request(&sh, &mut host, headers(path, &[]), CHAT);
                host.status = Some(status);
                host.properties
                    .insert(CODE_DETAILS_PROPERTY.join("."), details.as_bytes().to_vec());
                host.properties.insert(
                    RESPONSE_FLAGS_PROPERTY.join("."),
                    flag.to_le_bytes().to_vec(),
                );
                s.on_response_headers(&sh, &mut host);
                assert!(
                    host.response_headers.is_empty(),
                    "{path}: {:?}",
                    host.response_headers
                );
                s.on_log(&sh, &mut host);
                for st in [
                    RegionStat::RqTotal,
                    RegionStat::RqActive,
                    RegionStat::UpstreamFailure,
                    RegionStat::UpstreamRqAnswered,
                ] {
                    assert_eq!(host.value(Stat::Region(0, st)), 0, "{path} {status} {st:?}");
                }
            }
        }
        // Envoy's 503 when the region's engines cannot be reached is the
        // region's: labelled and counted, a failure.
        let mut host = new_host(&sh);
        let (mut s, _) = request(&sh, &mut host, headers("/v1/models", &[]), "");
        host.status = Some(503);
        host.properties.insert(
            CODE_DETAILS_PROPERTY.join("."),
            b"upstream_reset_before_response_started{connection_failure}".to_vec(),
        );
        host.properties.insert(
            RESPONSE_FLAGS_PROPERTY.join("."),
            flags::UPSTREAM_CONNECTION_FAILURE.to_le_bytes().to_vec(),
        );
        s.on_response_headers(&sh, &mut host);
        assert_eq!(host.response_headers.len(), 1);
        s.on_log(&sh, &mut host);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqTotal)), 1);
        assert_eq!(host.value(Stat::Region(0, RegionStat::UpstreamFailure)), 1);
    }

    #[test]
    fn an_engine_5xx_on_an_unread_path_counts_against_the_region() {
        let sh = shared("");
        for (status, failed, answered) in [(501, 1, 0), (500, 1, 0), (200, 0, 1), (404, 0, 1)] {
            let mut host = new_host(&sh);
            let (mut s, _) = request(&sh, &mut host, headers("/v1/embeddings", &[]), CHAT);
            engine_status(&mut host, Some(status));
            s.on_response_headers(&sh, &mut host);
            s.on_log(&sh, &mut host);
            let v = |st| host.value(Stat::Region(0, st));
            assert_eq!(
                (
                    v(RegionStat::RqTotal),
                    v(RegionStat::UpstreamFailure),
                    v(RegionStat::UpstreamRqAnswered)
                ),
                (1, failed, answered),
                "{status}"
            );
            // Never counted in flight: it is not inference load.
            assert_eq!(v(RegionStat::RqActive), 0);
        }
    }

    #[test]
    fn a_stream_is_marked_and_its_first_byte_teaches_unless_retried() {
        let sh = shared("");
        for (attempts, taught) in [(1u64, 1usize), (2, 0)] {
            let mut host = new_host(&sh);
            let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), STREAM);
            assert_eq!(host.request_header("x-llm-stream"), Some(Some("true")));
            engine_status(&mut host, Some(200));
            s.on_response_headers(&sh, &mut host);
            assert!(s.awaiting_first_byte());
            host.now_ms = NOW + 42;
            host.properties
                .insert(ATTEMPTS_PROPERTY.join("."), attempts.to_le_bytes().to_vec());
            s.on_first_byte(&sh, &mut host);
            assert!(!s.awaiting_first_byte(), "later chunks are no news");
            let q = host.queues.get(OBSERVATIONS_QUEUE).map_or(0, |q| q.len());
            assert_eq!(q, taught, "attempts {attempts}");
            if taught == 1 {
                let o = Observation::decode(&host.queues[OBSERVATIONS_QUEUE][0]).unwrap();
                assert_eq!((o.region, o.observed_ms), (0, 42.0));
            }
        }
        // An error status: no TTFT to report.
        let mut host = new_host(&sh);
        let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), STREAM);
        engine_status(&mut host, Some(503));
        s.on_response_headers(&sh, &mut host);
        assert!(!s.awaiting_first_byte());
    }

    /// A stream's answer in chunks: `(ms after the request, bytes)`; the
    /// last ends the stream.
    fn stream_answer(
        s: &mut RouterStream,
        sh: &RouterShared,
        host: &mut Recorder,
        status: u32,
        chunks: &[(u64, &str)],
        end_ms: u64,
    ) {
        engine_status(host, Some(status));
        s.on_response_headers(sh, host);
        for (i, (at, chunk)) in chunks.iter().enumerate() {
            host.now_ms = NOW + at;
            host.response_chunk = chunk.as_bytes().to_vec();
            if s.wants_response_body() {
                s.on_response_body(sh, host, chunk.len(), i + 1 == chunks.len());
            }
        }
        host.now_ms = NOW + end_ms;
        s.on_log(sh, host);
    }

    const USAGE_STREAM: &str = r#"{"messages":[{"role":"user","content":"hello there"}],"stream":true,"stream_options":{"include_usage":true}}"#;

    #[test]
    fn a_requests_distributions_go_to_the_region_that_served_it() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/chat/completions", &[]),
            USAGE_STREAM,
        );
        let route = String::from_utf8(host.filter_state[0].1.clone()).unwrap();
        let term = |name: &str| -> f64 {
            route
                .split("; ")
                .find_map(|p| p.strip_prefix(name)?.strip_prefix('='))
                .unwrap()
                .parse()
                .unwrap()
        };
        let expected = term("rtt_ms") + term("prefill_ms") + term("wait_ms");
        stream_answer(
            &mut s,
            &sh,
            &mut host,
            200,
            &[
                (40, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n"),
                (90, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":11,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\ndata: [DONE]\n\n"),
            ],
            140,
        );
        let h = |x| {
            host.samples
                .get(&Stat::RegionHistogram(0, x))
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(h(RegionHistogram::TimeToFirstToken), [40]);
        assert_eq!(h(RegionHistogram::RequestDuration), [140]);
        // (140 - 40) ms over the 10 tokens after the first, in µs.
        assert_eq!(h(RegionHistogram::TimePerOutputToken), [10_000]);
        assert_eq!(h(RegionHistogram::TokenUsage(TokenType::Input)), [12]);
        assert_eq!(h(RegionHistogram::TokenUsage(TokenType::Output)), [11]);
        assert_eq!(h(RegionHistogram::TokenUsage(TokenType::CachedInput)), [8]);
        // Observed (from routing, at NOW) 40 ms against what it expected.
        let error = 40.0 - expected;
        let (late, early) = (
            h(RegionHistogram::TtftErrorLate),
            h(RegionHistogram::TtftErrorEarly),
        );
        if error >= 0.0 {
            assert_eq!((late, early), (vec![error.round() as u64], vec![]));
        } else {
            assert_eq!((late, early), (vec![], vec![(-error).round() as u64]));
        }
        assert!(host
            .samples
            .keys()
            .all(|k| matches!(k, Stat::RegionHistogram(0, _))));

        // A non-streamed answer: a duration and tokens, no TTFT or TPOT.
        host.next_stream();
        host.now_ms = NOW;
        host.samples.clear();
        let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), CHAT);
        stream_answer(
            &mut s,
            &sh,
            &mut host,
            200,
            &[(
                70,
                r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}"#,
            )],
            75,
        );
        let h = |x| {
            host.samples
                .get(&Stat::RegionHistogram(0, x))
                .cloned()
                .unwrap_or_default()
        };
        assert_eq!(h(RegionHistogram::RequestDuration), [75]);
        assert_eq!(h(RegionHistogram::TokenUsage(TokenType::Input)), [5]);
        assert_eq!(
            h(RegionHistogram::TokenUsage(TokenType::CachedInput)),
            Vec::<u64>::new()
        );
        assert!(h(RegionHistogram::TimeToFirstToken).is_empty());
        assert!(h(RegionHistogram::TimePerOutputToken).is_empty());

        // Failures by their error type, and no success or TTFT for them.
        for (status, flag, error) in [
            (500, 0, ErrorType::Upstream5xx),
            (400, 0, ErrorType::Upstream4xx),
            (
                503,
                flags::UPSTREAM_CONNECTION_FAILURE,
                ErrorType::UpstreamFailure,
            ),
            (200, flags::DOWNSTREAM_REMOTE_RESET, ErrorType::Cancelled),
        ] {
            host.next_stream();
            host.now_ms = NOW;
            host.samples.clear();
            host.properties.remove(&RESPONSE_FLAGS_PROPERTY.join("."));
            let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), STREAM);
            if flag != 0 {
                host.properties.insert(
                    RESPONSE_FLAGS_PROPERTY.join("."),
                    flag.to_le_bytes().to_vec(),
                );
            }
            stream_answer(&mut s, &sh, &mut host, status, &[(30, "data: x\n\n")], 50);
            let h = |x| {
                host.samples
                    .get(&Stat::RegionHistogram(0, x))
                    .cloned()
                    .unwrap_or_default()
            };
            assert_eq!(
                h(RegionHistogram::RequestDurationFailed(error)),
                [50],
                "{error:?}"
            );
            assert!(h(RegionHistogram::RequestDuration).is_empty(), "{error:?}");
            if status != 200 {
                assert!(h(RegionHistogram::TimeToFirstToken).is_empty(), "{error:?}");
            }
        }
        host.properties.remove(&RESPONSE_FLAGS_PROPERTY.join("."));

        // The fallback pool's answers are other engines': nothing recorded.
        host.next_stream();
        host.now_ms = NOW;
        host.samples.clear();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/chat/completions", &[("x-llm-pool", "fallback")]),
            USAGE_STREAM,
        );
        stream_answer(&mut s, &sh, &mut host, 200, &[(30, "data: x\n\n")], 50);
        assert!(host.samples.is_empty(), "{:?}", host.samples);
    }

    #[test]
    fn bodies_paths_and_residency_the_router_does_not_route() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let reply = |f: Flow| match f {
            Flow::Reply(r) => (
                r.status,
                serde_json::from_slice::<serde_json::Value>(&r.body).unwrap(),
            ),
            other => panic!("{other:?}"),
        };
        // Blank: an empty request.
        let (_, f) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), "  \n");
        let (status, v) = reply(f);
        assert_eq!(status, 400);
        assert!(v["error"]["message"].as_str().unwrap().contains("empty"));
        // Not JSON, another path, a compressed body: the default region.
        for (h, body) in [
            (headers("/v1/chat/completions", &[]), "a=1"),
            (headers("/v1/embeddings", &[]), CHAT),
            (
                headers("/v1/chat/completions", &[("content-encoding", "gzip")]),
                CHAT,
            ),
        ] {
            host.next_stream();
            let (s, f) = request(&sh, &mut host, h, body);
            assert_eq!(f, Flow::Continue);
            assert_eq!(host.request_header("x-llm-cluster"), Some(Some("cn")));
            assert!(s.decision().is_none());
        }
        assert_eq!(host.value(Stat::Global(Global::RouterPassthrough)), 3);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqActive)), 0);
        // Unknown residency: 400, whatever the body.
        let (_, f) = request(
            &sh,
            &mut host,
            headers("/v1/chat/completions", &[("x-res", "mars")]),
            CHAT,
        );
        let (status, v) = reply(f);
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (400, Some("invalid_residency"))
        );
        // Malformed, passed through when configured so.
        let pass = shared(r#","invalid_requests":"pass_through""#);
        let mut host = new_host(&pass);
        let (_, f) = request(
            &pass,
            &mut host,
            headers("/v1/completions", &[]),
            "{\"prompt\":",
        );
        assert_eq!(f, Flow::Continue);
        assert_eq!(host.value(Stat::Global(Global::RouterInvalidRequest)), 1);
    }

    /// Publish a snapshot (version `v`) with these regions unhealthy.
    fn health(sh: &RouterShared, host: &mut Recorder, v: u64, down: &[usize]) {
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        snap.version = v;
        snap.generated_ms = host.now_ms;
        for &i in down {
            snap.regions[i].healthy = false;
        }
        host.publish(&snap);
    }

    fn cluster(host: &mut Recorder) -> Option<String> {
        host.request_header("x-llm-cluster")
    }

    fn reason(s: &mut RouterStream, sh: &RouterShared, host: &mut Recorder) -> String {
        engine_status(host, Some(200));
        s.on_response_headers(sh, host);
        let v = host
            .response_headers
            .iter()
            .rev()
            .find(|(n, _)| n == "x-llm-route")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        v.split("; ")
            .find_map(|kv| kv.strip_prefix("reason="))
            .unwrap_or_default()
            .to_string()
    }

    fn get(path: &'static str) -> Headers {
        vec![(":method", "GET"), (":path", path)]
    }

    #[test]
    fn what_the_router_does_not_read_goes_to_a_routable_region() {
        let sh = shared("");
        let mut host = new_host(&sh);
        health(&sh, &mut host, 2, &[0]);
        for h in [
            headers("/v1/embeddings", &[]),
            get("/v1/models"),
            headers("/v1/audio/transcriptions", &[]),
            headers("/v1/chat/completions", &[("content-encoding", "gzip")]),
        ] {
            host.next_stream();
            let (mut s, f) = request(&sh, &mut host, h, CHAT);
            assert_eq!(f, Flow::Continue);
            assert_eq!(
                cluster(&mut host).as_deref(),
                Some("cm"),
                "never the unhealthy near"
            );
            assert_eq!(reason(&mut s, &sh, &mut host), "rtt");
        }
        // Not JSON: the same.
        host.next_stream();
        request(&sh, &mut host, headers("/v1/chat/completions", &[]), "a=1");
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        // The residency pin holds for what is not read too.
        health(&sh, &mut host, 3, &[]);
        host.next_stream();
        request(
            &sh,
            &mut host,
            headers("/v1/embeddings", &[("x-res", "eu")]),
            CHAT,
        );
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        host.next_stream();
        let (_, f) = request(
            &sh,
            &mut host,
            headers("/v1/embeddings", &[("x-res", "mars")]),
            CHAT,
        );
        assert!(matches!(f, Flow::Reply(r) if r.status == 400));
        // `default_region` is preferred while it can take the request.
        let pref = shared(r#","default_region":"mid""#);
        let mut host = new_host(&pref);
        let (mut s, _) = request(&pref, &mut host, headers("/v1/embeddings", &[]), CHAT);
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        assert_eq!(reason(&mut s, &pref, &mut host), "default");
        health(&pref, &mut host, 2, &[1]);
        host.next_stream();
        let (mut s, _) = request(&pref, &mut host, headers("/v1/embeddings", &[]), CHAT);
        assert_eq!(cluster(&mut host).as_deref(), Some("cn"));
        assert_eq!(reason(&mut s, &pref, &mut host), "rtt");
    }

    /// Answer the current stream with `body` (200) in one chunk.
    fn answer(s: &mut RouterStream, sh: &RouterShared, host: &mut Recorder, body: &str) {
        engine_status(host, Some(200));
        s.on_response_headers(sh, host);
        host.response_chunk = body.as_bytes().to_vec();
        if s.wants_response_body() {
            s.on_response_body(sh, host, body.len(), true);
        }
        s.on_log(sh, host);
    }

    const FOLLOW: &str = r#"{"model":"m","input":"and then?","previous_response_id":"resp_7"}"#;

    #[test]
    fn stored_responses_are_followed_to_the_region_that_holds_them() {
        let sh = shared("");
        let mut host = new_host(&sh);
        // Produced in mid while near was down.
        health(&sh, &mut host, 2, &[0]);
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"model":"m","input":"hello"}"#,
        );
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        answer(
            &mut s,
            &sh,
            &mut host,
            r#"{"id":"resp_7","object":"response","output":[]}"#,
        );
        assert_eq!(host.value(Stat::Global(Global::RouterResponsesRecorded)), 1);
        // near is back and cheaper; the follow-ups still go to mid.
        health(&sh, &mut host, 3, &[]);
        host.next_stream();
        let (mut s, _) = request(&sh, &mut host, headers("/v1/responses", &[]), FOLLOW);
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        assert_eq!(s.decision().unwrap().decision.reason, Reason::Response);
        assert_eq!(reason(&mut s, &sh, &mut host), "response");
        for h in [
            get("/v1/responses/resp_7"),
            get("/v1/responses/resp_7/input_items?limit=5"),
            headers("/v1/responses/resp_7/cancel", &[]),
            vec![(":method", "DELETE"), (":path", "/v1/responses/resp_7")],
        ] {
            host.next_stream();
            let (mut s, f) = request(&sh, &mut host, h, "");
            assert_eq!(f, Flow::Continue);
            assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
            assert_eq!(reason(&mut s, &sh, &mut host), "response");
        }
        // An id this Envoy never saw: routed as new, and counted.
        host.next_stream();
        request(&sh, &mut host, get("/v1/responses/resp_other"), "");
        assert_eq!(cluster(&mut host).as_deref(), Some("cn"));
        assert_eq!(host.value(Stat::Global(Global::RouterResponseUnknown)), 1);
        // mid is down: a clear 503, never a silent reroute.
        health(&sh, &mut host, 4, &[1]);
        for h in [headers("/v1/responses", &[]), get("/v1/responses/resp_7")] {
            host.next_stream();
            let (_, f) = request(&sh, &mut host, h, FOLLOW);
            let Flow::Reply(r) = f else { panic!("{f:?}") };
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(r.status, 503);
            assert_eq!(v["error"]["code"], "response_region_unavailable");
            assert!(v["error"]["message"].as_str().unwrap().contains("'mid'"));
            assert_eq!(cluster(&mut host), None, "sent nowhere");
        }
        assert_eq!(
            host.value(Stat::Global(Global::RouterResponseHolderUnavailable)),
            2
        );
        // mid's health probes only went unanswered (a busy engine's sign):
        // the follow-up still goes there, the one place that can answer it;
        // not when mid is also on another release (its responses are gone).
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        (snap.version, snap.generated_ms) = (5, host.now_ms);
        (snap.regions[1].healthy, snap.regions[1].unanswered) = (false, true);
        host.publish(&snap);
        for h in [headers("/v1/responses", &[]), get("/v1/responses/resp_7")] {
            host.next_stream();
            let (mut s, f) = request(&sh, &mut host, h, FOLLOW);
            assert_eq!(f, Flow::Continue);
            assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
            assert_eq!(reason(&mut s, &sh, &mut host), "response");
        }
        (snap.version, snap.regions[1].release_ok) = (6, false);
        host.publish(&snap);
        host.next_stream();
        let (_, f) = request(&sh, &mut host, headers("/v1/responses", &[]), FOLLOW);
        assert!(matches!(f, Flow::Reply(ref r) if r.status == 503), "{f:?}");
        assert_eq!(
            host.value(Stat::Global(Global::RouterResponseHolderUnavailable)),
            3
        );
        // ... unless the operator chose to reroute.
        let re = shared(r#","responses":{"holder_unavailable":"reroute"}"#);
        let mut host2 = new_host(&re);
        host2.store = host.store.clone();
        health(&re, &mut host2, 7, &[1]);
        let (_, f) = request(&re, &mut host2, headers("/v1/responses", &[]), FOLLOW);
        assert_eq!(f, Flow::Continue);
        assert_eq!(cluster(&mut host2).as_deref(), Some("cn"));
    }

    #[test]
    fn stored_responses_are_followed_only_where_the_engine_keeps_them() {
        // vLLM 0.32 keeps Responses only with its store on (issue 45, item
        // 8). Not known yet: the response is followed, and the probe is
        // asked to check it there.
        let sh = shared("");
        let mut host = new_host(&sh);
        health(&sh, &mut host, 2, &[0]);
        let first = r#"{"model":"m","input":"hello"}"#;
        let (mut s, _) = request(&sh, &mut host, headers("/v1/responses", &[]), first);
        answer(
            &mut s,
            &sh,
            &mut host,
            r#"{"id":"resp_7","object":"response","output":[]}"#,
        );
        assert_eq!(host.value(Stat::Global(Global::RouterResponsesRecorded)), 1);
        let sent: Vec<Vec<u8>> = host
            .queues
            .remove(OBSERVATIONS_QUEUE)
            .unwrap_or_default()
            .into();
        let checks: Vec<_> = sent
            .iter()
            .filter_map(|m| stored_responses::decode_store_check(m))
            .collect();
        assert_eq!(checks, [(1, "resp_7")]);
        // The probe found mid keeps none: its record is no holder. The
        // follow-up goes by its cost, and with mid down it is no 503: an
        // engine answers that it does not know the response.
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        (snap.version, snap.generated_ms) = (3, host.now_ms);
        snap.regions[1].stores_responses = Some(false);
        snap.regions[1].healthy = false;
        host.publish(&snap);
        for h in [headers("/v1/responses", &[]), get("/v1/responses/resp_7")] {
            host.next_stream();
            let (mut s, f) = request(&sh, &mut host, h, FOLLOW);
            assert_eq!(f, Flow::Continue);
            assert_eq!(cluster(&mut host).as_deref(), Some("cn"));
            assert_ne!(reason(&mut s, &sh, &mut host), "response");
        }
        assert_eq!(
            host.value(Stat::Global(Global::RouterResponseHolderUnavailable)),
            0
        );
        // A new response there is not recorded, and no check is asked for.
        snap.regions[1].healthy = true;
        snap.regions[0].healthy = false;
        snap.version = 4;
        host.publish(&snap);
        host.next_stream();
        host.queues.remove(OBSERVATIONS_QUEUE);
        let (mut s, _) = request(&sh, &mut host, headers("/v1/responses", &[]), first);
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        answer(
            &mut s,
            &sh,
            &mut host,
            r#"{"id":"resp_8","object":"response","output":[]}"#,
        );
        assert_eq!(host.value(Stat::Global(Global::RouterResponsesRecorded)), 1);
        let sent: Vec<Vec<u8>> = host
            .queues
            .remove(OBSERVATIONS_QUEUE)
            .unwrap_or_default()
            .into();
        assert!(!sent
            .iter()
            .any(|m| stored_responses::decode_store_check(m).is_some()));
    }

    /// Envoy retried the request to a host of region `served` (`None`: no
    /// retry), as its stream info tells at the answer.
    fn retried_to(host: &mut Recorder, served: Option<&str>) {
        if let Some(region) = served {
            host.properties
                .insert(ATTEMPTS_PROPERTY.join("."), 2u64.to_le_bytes().to_vec());
            host.properties
                .insert(HOST_REGION_PROPERTY.join("."), region.as_bytes().to_vec());
        }
    }

    #[test]
    fn a_continued_responses_usage_teaches_nothing() {
        // The engine counts the stored history in `input_tokens`; the
        // router saw only the new input: no usage report, no TTFT
        // observation (issue 45, item 2). A new Responses request reports.
        let sh = shared("");
        let mut host = new_host(&sh);
        let completed = |id: &str| {
            format!(
                r#"{{"id":"{id}","object":"response","output":[],"usage":{{"input_tokens":1547,"input_tokens_details":{{"cached_tokens":1408}},"output_tokens":4,"total_tokens":1551}}}}"#
            )
        };
        let sent = |host: &mut Recorder| -> Vec<Vec<u8>> {
            host.queues
                .remove(OBSERVATIONS_QUEUE)
                .unwrap_or_default()
                .into()
        };
        let first = format!(
            r#"{{"model":"m","input":"{}"}}"#,
            "a question about the harbour ledger. ".repeat(20)
        );
        let (mut s, _) = request(&sh, &mut host, headers("/v1/responses", &[]), &first);
        answer(&mut s, &sh, &mut host, &completed("resp_7"));
        let reports = sent(&mut host);
        assert!(
            reports
                .iter()
                .any(|m| m.first() == Some(&crate::learning::usage::REPORT_TAG)),
            "{reports:?}"
        );
        host.next_stream();
        let (mut s, _) = request(&sh, &mut host, headers("/v1/responses", &[]), FOLLOW);
        answer(&mut s, &sh, &mut host, &completed("resp_8"));
        let learnt: Vec<Vec<u8>> = sent(&mut host)
            .into_iter()
            .filter(|m| stored_responses::decode_store_check(m).is_none())
            .collect();
        assert_eq!(learnt, Vec::<Vec<u8>>::new());
    }

    #[test]
    fn what_an_answer_teaches_is_charged_to_the_region_that_served_it() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let doc = "a long document the conversation is about. ".repeat(100);
        let chat = |turn: &str| {
            format!(
                r#"{{"messages":[{{"role":"user","content":"{doc}"}},{{"role":"user","content":"{turn}"}}],"stream":true,"stream_options":{{"include_usage":true}}}}"#
            )
        };
        let held = |s: &RouterStream| {
            let costs = &s.decision().unwrap().decision.costs;
            (costs[0].cached_tokens, costs[1].cached_tokens)
        };
        let usage = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1200,\"completion_tokens\":1,\"total_tokens\":1201,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n";
        // Routed to near; Envoy retried it to mid, which answered.
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/chat/completions", &[]),
            &chat("a"),
        );
        assert_eq!(cluster(&mut host).as_deref(), Some("cn"));
        retried_to(&mut host, Some("mid"));
        host.queues.remove(OBSERVATIONS_QUEUE);
        answer(&mut s, &sh, &mut host, usage);
        // The usage report is mid's; no TTFT is reported (a retry's first
        // byte follows a failed try).
        let sent: Vec<Vec<u8>> = host
            .queues
            .remove(OBSERVATIONS_QUEUE)
            .unwrap_or_default()
            .into();
        assert_eq!(sent.len(), 1, "{sent:?}");
        let report = crate::learning::usage::UsageReport::decode(&sent[0]).unwrap();
        assert_eq!(report.region, 1);
        // The next turn: believed held by mid, not by near.
        host.next_stream();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/chat/completions", &[]),
            &chat("b"),
        );
        let (near, mid) = held(&s);
        assert_eq!(near, 0);
        assert!(mid > 500, "{mid}");
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        // mid refuses it (a 400, as for a context limit): nothing learnt.
        engine_status(&mut host, Some(400));
        s.on_response_headers(&sh, &mut host);
        host.response_chunk = br#"{"error":{"code":400}}"#.to_vec();
        assert!(!s.wants_response_body());
        s.on_log(&sh, &mut host);
        host.next_stream();
        let long = format!(r#"{{"messages":[{{"role":"user","content":"{doc} {doc} {doc}"}}]}}"#);
        let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), &long);
        let before = held(&s);
        engine_status(&mut host, Some(400));
        s.on_response_headers(&sh, &mut host);
        s.on_log(&sh, &mut host);
        host.next_stream();
        let (s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), &long);
        assert_eq!(held(&s), before, "a refused prompt is believed nowhere");
        // A stored response retried to mid is followed to mid.
        host.next_stream();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"model":"m","input":"hello"}"#,
        );
        assert_eq!(cluster(&mut host).as_deref(), Some("cn"));
        retried_to(&mut host, Some("mid"));
        answer(
            &mut s,
            &sh,
            &mut host,
            r#"{"id":"resp_7","object":"response","output":[]}"#,
        );
        host.next_stream();
        request(&sh, &mut host, headers("/v1/responses", &[]), FOLLOW);
        assert_eq!(cluster(&mut host).as_deref(), Some("cm"));
        // Retried to a host of no configured region: recorded nowhere.
        host.next_stream();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"model":"m","input":"hello again"}"#,
        );
        host.properties
            .insert(ATTEMPTS_PROPERTY.join("."), 2u64.to_le_bytes().to_vec());
        let recorded = host.value(Stat::Global(Global::RouterResponsesRecorded));
        answer(
            &mut s,
            &sh,
            &mut host,
            r#"{"id":"resp_8","object":"response","output":[]}"#,
        );
        assert_eq!(
            host.value(Stat::Global(Global::RouterResponsesRecorded)),
            recorded
        );
    }

    #[test]
    fn only_stored_successful_responses_are_recorded() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let body = r#"{"id":"resp_9","object":"response"}"#;
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"input":"x","store":false}"#,
        );
        answer(&mut s, &sh, &mut host, body);
        host.next_stream();
        let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), CHAT);
        answer(&mut s, &sh, &mut host, r#"{"id":"chatcmpl-1"}"#);
        host.next_stream();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"input":"x"}"#,
        );
        engine_status(&mut host, Some(500));
        s.on_response_headers(&sh, &mut host);
        assert!(!s.wants_response_body());
        assert_eq!(host.value(Stat::Global(Global::RouterResponsesRecorded)), 0);
        // Streamed: the id arrives split across chunks.
        host.next_stream();
        let (mut s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"input":"x","stream":true}"#,
        );
        engine_status(&mut host, Some(200));
        s.on_response_headers(&sh, &mut host);
        for chunk in [
            "event: response.created\ndata: {\"response\":{\"i",
            "d\":\"resp_s\",\"x\":1}}\n\n",
        ] {
            host.response_chunk = chunk.as_bytes().to_vec();
            s.on_response_body(&sh, &mut host, chunk.len(), false);
        }
        assert_eq!(host.value(Stat::Global(Global::RouterResponsesRecorded)), 1);
        // Its first byte is no TTFT (vLLM sends `response.created` before
        // scheduling): nothing for the tuner, only the usage at the end.
        assert!(!s.awaiting_first_byte());
        let tuning = host.queues.get(OBSERVATIONS_QUEUE).map_or(0, |q| {
            q.iter()
                .filter(|m| m.first() != Some(&crate::learning::usage::REPORT_TAG))
                .filter(|m| stored_responses::decode_store_check(m).is_none())
                .count()
        });
        assert_eq!(tuning, 0);
        let map = sh.router.responses;
        assert_eq!(
            map.lookup(&mut host.store, "resp_s", NOW).as_deref(),
            Some("near")
        );
        assert_eq!(map.lookup(&mut host.store, "resp_9", NOW), None);
    }

    #[test]
    fn only_streams_that_carry_a_usage_are_read() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let chat = |extra: &str| {
            format!(r#"{{"messages":[{{"role":"user","content":"hi"}}],"stream":true{extra}}}"#)
        };
        let p = "/v1/chat/completions";
        let (s, _) = request(&sh, &mut host, headers(p, &[]), &chat(""));
        assert!(s.usage.is_none(), "no usage asked: not read");
        host.next_stream();
        let (s, _) = request(
            &sh,
            &mut host,
            headers(p, &[]),
            &chat(r#","stream_options":{"include_usage":true}"#),
        );
        assert!(s.usage.is_some());
        host.next_stream();
        let (s, _) = request(
            &sh,
            &mut host,
            headers("/v1/responses", &[]),
            r#"{"input":"x","stream":true}"#,
        );
        assert!(
            s.usage.is_some(),
            "a Responses stream always ends with its usage"
        );
        host.next_stream();
        let (s, _) = request(&sh, &mut host, headers(p, &[]), CHAT);
        assert!(s.usage.is_some(), "a JSON answer carries its usage");
        // Engines that force usage into every stream: read them all.
        let always = shared(r#","directory":{"stream_usage":"always"}"#);
        let mut host = new_host(&always);
        let (s, _) = request(&always, &mut host, headers(p, &[]), &chat(""));
        assert!(s.usage.is_some());
    }

    #[test]
    fn a_usage_before_the_prompts_logprobs_is_read_whatever_follows() {
        // vLLM's answer to `"prompt_logprobs": 5`: a long text, the usage,
        // then 300 KiB of the prompt's logprobs.
        let sh = shared("");
        let text = "word ".repeat(15_000);
        let mut body = format!(r#"{{"id":"chatcmpl-1","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}}}}],"usage":{{"prompt_tokens":1200,"total_tokens":1201,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":0}}}},"prompt_logprobs":[null"#).into_bytes();
        while body.len() < 300 * 1024 {
            body.extend_from_slice(
                br#",{"1000":{"logprob":-1.5,"rank":1,"decoded_token":" the"}}"#,
            );
        }
        body.extend_from_slice(b"]}");
        let key = body.windows(8).position(|w| w == b"\"usage\":").unwrap();
        // `(bytes the host hands over, size Envoy says)`: a chunk over the
        // read limit (two reads, the second with the key's start), the rest
        // of the key and the logprobs; and again with a chunk the host did
        // not hand over between the key's halves, which must not be joined.
        let cut = key + 3;
        assert!(cut > super::super::router_answer::READ_MAX);
        let whole: Vec<(&[u8], usize)> = vec![
            (&body[..cut], cut),
            (&body[cut..cut + 1000], 1000),
            (&body[cut + 1000..], body.len() - cut - 1000),
        ];
        let holed: Vec<(&[u8], usize)> = vec![
            (&body[..cut], cut),
            (&[], 5),
            (&body[cut..], body.len() - cut),
        ];
        for (chunks, read) in [(whole, true), (holed, false)] {
            let mut host = new_host(&sh);
            let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), CHAT);
            engine_status(&mut host, Some(200));
            s.on_response_headers(&sh, &mut host);
            host.queues.remove(OBSERVATIONS_QUEUE);
            let last = chunks.len() - 1;
            for (i, (bytes, size)) in chunks.into_iter().enumerate() {
                host.response_chunk = bytes.to_vec();
                s.on_response_body(&sh, &mut host, size, i == last);
            }
            s.on_log(&sh, &mut host);
            let reports: Vec<_> = host
                .queues
                .remove(OBSERVATIONS_QUEUE)
                .unwrap_or_default()
                .iter()
                .filter_map(|m| crate::learning::usage::UsageReport::decode(m))
                .collect();
            let missing = host.value(Stat::Global(Global::RouterUsageMissing));
            if read {
                assert_eq!(reports.len(), 1);
                assert_eq!(reports[0].prompt_tokens, 1200);
                assert_eq!(reports[0].cached_tokens, Some(0));
                assert_eq!(missing, 0);
            } else {
                assert!(reports.is_empty(), "{reports:?}");
                assert_eq!(missing, 1);
            }
        }
    }

    #[test]
    fn only_an_output_beyond_every_regions_context_gets_the_engines_400_at_the_edge() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        snap.version = 2;
        snap.generated_ms = NOW;
        snap.regions[0].max_model_len = Some(4096);
        snap.regions[1].max_model_len = Some(4096);
        host.publish(&snap);
        // About 10,000 tokens by the estimate: only the engine counts
        // them, so the request goes to an engine, which judges (issue 45,
        // item 2).
        let long = format!(r#"{{"prompt":"{}","max_tokens":16}}"#, "word ".repeat(8000));
        let (_, f) = request(&sh, &mut host, headers("/v1/completions", &[]), &long);
        assert_eq!(f, Flow::Continue);
        assert!(host.request_header("x-llm-cluster").is_some());
        assert_eq!(host.value(Stat::Global(Global::RouterContextRejected)), 0);
        // An output above every region's limit: vLLM refuses it whatever
        // the prompt; the edge answers as vLLM 0.32 does (issue 45, item 7).
        host.next_stream();
        let (s, f) = request(
            &sh,
            &mut host,
            headers("/v1/completions", &[]),
            r#"{"prompt":"hi","max_tokens":5000}"#,
        );
        let Flow::Reply(r) = f else { panic!("{f:?}") };
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(r.status, 400);
        assert_eq!(
            v,
            serde_json::json!({"error": {
                "message": "max_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_tokens, value=5000)",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}})
        );
        assert_eq!(host.value(Stat::Global(Global::RouterContextRejected)), 1);
        assert!(s.decision().is_none());
        assert_eq!(host.request_header("x-llm-cluster"), None, "sent nowhere");
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqTotal)), 0);
        // As many as the context: vLLM 0.32 serves it, cut at the context.
        host.next_stream();
        let (_, f) = request(
            &sh,
            &mut host,
            headers("/v1/completions", &[]),
            r#"{"prompt":"hi","max_tokens":4096}"#,
        );
        assert_eq!(f, Flow::Continue);
        assert_eq!(host.request_header("x-llm-cluster"), Some(Some("cn")));
    }

    #[test]
    fn llamacpp_regions_are_never_refused_at_the_edge() {
        let mut c = (*shared("").cfg).clone();
        for r in &mut c.regions {
            r.engine = crate::engines::metrics::EngineKind::Llamacpp;
        }
        let sh = RouterShared::new(Rc::new(c));
        let mut host = new_host(&sh);
        let mut snap = Snapshot::all_healthy(&sh.cfg);
        snap.version = 2;
        snap.generated_ms = NOW;
        // meta.n_ctx: the context of one slot.
        snap.regions[0].max_model_len = Some(4096);
        snap.regions[1].max_model_len = Some(4096);
        host.publish(&snap);
        // llama-server refuses only a prompt that fills the slot, which
        // only it counts; it takes any max_tokens and stops when the slot
        // is full.
        for body in [
            format!(r#"{{"prompt":"{}"}}"#, "word ".repeat(8000)),
            r#"{"prompt":"hi","max_tokens":100000}"#.to_string(),
        ] {
            host.next_stream();
            let (_, f) = request(&sh, &mut host, headers("/v1/completions", &[]), &body);
            assert_eq!(f, Flow::Continue);
        }
        assert_eq!(host.value(Stat::Global(Global::RouterContextRejected)), 0);
    }

    #[test]
    fn outcomes_are_charged_where_the_engine_had_the_request() {
        let sh = shared("");
        let end = |flags: u64, status: Option<u32>, attempts: u64, host_region: &str| {
            let mut host = new_host(&sh);
            let (mut s, _) = request(&sh, &mut host, headers("/v1/chat/completions", &[]), CHAT);
            host.next_stream();
            engine_status(&mut host, status);
            if status.is_some() {
                s.on_response_headers(&sh, &mut host);
            }
            host.properties.insert(
                RESPONSE_FLAGS_PROPERTY.join("."),
                flags.to_le_bytes().to_vec(),
            );
            host.properties
                .insert(ATTEMPTS_PROPERTY.join("."), attempts.to_le_bytes().to_vec());
            host.properties.insert(
                HOST_REGION_PROPERTY.join("."),
                host_region.as_bytes().to_vec(),
            );
            host.properties
                .insert(CODE_DETAILS_PROPERTY.join("."), b"via_upstream".to_vec());
            s.on_log(&sh, &mut host);
            let r = |i, st| host.value(Stat::Region(i, st));
            (
                [
                    r(0, RegionStat::UpstreamFailure),
                    r(0, RegionStat::UpstreamRqAnswered),
                    r(0, RegionStat::ClientCancelled),
                ],
                [
                    r(1, RegionStat::UpstreamFailure),
                    r(1, RegionStat::UpstreamRqAnswered),
                    r(1, RegionStat::ClientCancelled),
                ],
                r(0, RegionStat::RqActive),
            )
        };
        // Cancelled before the first byte: counted apart, never a failure.
        assert_eq!(
            end(flags::DOWNSTREAM_CONNECTION_TERMINATION, None, 1, "near"),
            ([0, 0, 1], [0, 0, 0], 0)
        );
        // The engine's 500 and an upstream timeout: near's failures.
        assert_eq!(end(0, Some(500), 1, "near").0, [1, 0, 0]);
        assert_eq!(
            end(flags::UPSTREAM_REQUEST_TIMEOUT, Some(504), 1, "near").0,
            [1, 0, 0]
        );
        // Retried on mid's engine: one failure for near, the answer for mid.
        assert_eq!(end(0, Some(200), 2, "mid"), ([1, 0, 0], [0, 1, 0], 0));
        // ... and on a host without metadata: only the first try is charged.
        assert_eq!(end(0, Some(200), 2, "elsewhere"), ([1, 0, 0], [0, 0, 0], 0));
    }

    #[test]
    fn the_fallback_pool_is_routed_but_its_outcomes_are_not_the_regions() {
        let sh = shared("");
        let mut host = new_host(&sh);
        let h = headers("/v1/chat/completions", &[("x-llm-pool", POOL_FALLBACK)]);
        let (mut s, _) = request(&sh, &mut host, h, CHAT);
        assert_eq!(host.request_header("x-llm-cluster"), Some(Some("cn_fb")));
        assert_eq!(host.value(Stat::Region(0, RegionStat::FallbackRqTotal)), 1);
        host.properties.insert(
            RESPONSE_FLAGS_PROPERTY.join("."),
            flags::UPSTREAM_CONNECTION_FAILURE.to_le_bytes().to_vec(),
        );
        s.on_log(&sh, &mut host);
        assert_eq!(host.value(Stat::Region(0, RegionStat::UpstreamFailure)), 0);
        assert_eq!(host.value(Stat::Region(0, RegionStat::RqActive)), 0);
    }
}
