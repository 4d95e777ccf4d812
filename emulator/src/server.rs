//! The live replica: an HTTP/1.1 server (hyper on a small tokio runtime)
//! that routes requests and drives the pure engine model with the real
//! clock. Network delay, FIFO admission, prefill and decode become actual
//! waits, so a client (or Envoy) observes the latencies a real engine would
//! produce.
//!
//! Cancellation: each request is one future (then, for an answer, one paced
//! body). When the client goes away hyper notices the connection's end
//! (it keeps reading while it answers: EOF or a reset fails the connection)
//! or fails to write, and drops the future or the body. The request's `Slot`
//! is dropped with it, which takes it out of the scheduler, whether it was
//! still waiting or already running, and wakes the waiters.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Incoming};
use hyper::header::{HeaderName, HeaderValue, ALLOW, CACHE_CONTROL, CONNECTION, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Sleep;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::body::{ms_duration, ReplyBody};
use crate::config::{Config, Mode, MAX_MS};
use crate::embeddings;
use crate::metrics;
use crate::model::{Engine, PrefillPlan, Prompt, RequestId};
use crate::openai::{self, Kind, ResponseMeta, Usage};
use crate::refusal::Refusal;
use crate::responses::{self, Answer, Stored};
use crate::tokenizer;

/// Runtime worker threads: the work is waiting, not computing.
const WORKER_THREADS: usize = 2;
/// A connection waiting for a request head longer than this (idle
/// keep-alive included) is dropped; long enough that Envoy's pooled
/// upstream connections are normally closed by Envoy first. Also bounds the
/// wait for a request body.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// A client that stops reading our response is abandoned after this.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Request line plus headers; larger heads get 431 (from hyper).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// Request bodies beyond this get 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// When a connection ends, unread request bytes are drained briefly so the
/// close does not turn into a RST that destroys the last response (say a
/// 413) before the client reads it.
const LINGER: Duration = Duration::from_millis(200);
const LINGER_MAX_BYTES: usize = 1 << 20;

const JSON: &str = "application/json";
/// What Starlette sends with a `text/event-stream` media type (the
/// Responses API stream; the chat streams keep the emulator's plain type).
const EVENT_STREAM_UTF8: &str = "text/event-stream; charset=utf-8";
const INVALID: &str = "invalid_request_error";

const X_ENGINE_REPLICA: HeaderName = HeaderName::from_static("x-engine-replica");
const X_ENGINE_CACHED: HeaderName = HeaderName::from_static("x-engine-cached-tokens");
const X_ENGINE_PROMPT: HeaderName = HeaderName::from_static("x-engine-prompt-tokens");
const X_ENGINE_QUEUE_MS: HeaderName = HeaderName::from_static("x-engine-queue-ms");
const X_RELEASE_DIGEST: HeaderName = HeaderName::from_static("x-release-digest");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    /// `/v1/chat/completions/render`: the prompt's token ids, no inference.
    ChatRender,
    Completions,
    Responses,
    /// `/v1/responses/{response_id}`.
    ResponseItem,
    /// `/v1/responses/{response_id}/cancel`.
    ResponseCancel,
    Embeddings,
    Health,
    /// `GET /version` (vLLM).
    Version,
    Models,
    Metrics,
    AdminStats,
    AdminState,
    AdminReset,
    NotFound,
}

impl Route {
    const ALL: [Route; 15] = [
        Route::Health,
        Route::Version,
        Route::Metrics,
        Route::Chat,
        Route::ChatRender,
        Route::Completions,
        Route::Responses,
        Route::ResponseItem,
        Route::ResponseCancel,
        Route::Embeddings,
        Route::Models,
        Route::AdminStats,
        Route::AdminState,
        Route::AdminReset,
        Route::NotFound,
    ];

    fn of(path: &str) -> Route {
        if let Some(rest) = path.strip_prefix("/v1/responses/") {
            // Starlette's `{response_id}` matches one non-empty segment.
            let segment = |id: &str| !id.is_empty() && !id.contains('/');
            return match rest.strip_suffix("/cancel") {
                Some(id) if segment(id) => Route::ResponseCancel,
                _ if segment(rest) => Route::ResponseItem,
                _ => Route::NotFound,
            };
        }
        Route::ALL
            .into_iter()
            .find(|r| r.path() == path)
            .unwrap_or(Route::NotFound)
    }

    /// The id in a `/v1/responses/{response_id}[/cancel]` path.
    fn response_id(path: &str) -> &str {
        let rest = path.strip_prefix("/v1/responses/").unwrap_or_default();
        rest.strip_suffix("/cancel").unwrap_or(rest)
    }

    /// Also the key under which requests are counted; unknown paths share
    /// one key so arbitrary URLs cannot grow the counter map.
    fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::ChatRender => "/v1/chat/completions/render",
            Route::Completions => "/v1/completions",
            Route::Responses => "/v1/responses",
            Route::ResponseItem => "/v1/responses/{response_id}",
            Route::ResponseCancel => "/v1/responses/{response_id}/cancel",
            Route::Embeddings => "/v1/embeddings",
            Route::Health => "/health",
            Route::Version => "/version",
            Route::Models => "/v1/models",
            Route::Metrics => "/metrics",
            Route::AdminStats => "/admin/stats",
            Route::AdminState => "/admin/state",
            Route::AdminReset => "/admin/reset",
            Route::NotFound => "other",
        }
    }

    fn methods(self) -> &'static [&'static str] {
        match self {
            Route::Chat
            | Route::ChatRender
            | Route::Completions
            | Route::Responses
            | Route::ResponseCancel
            | Route::Embeddings
            | Route::AdminReset => &["POST"],
            Route::AdminState => &["GET", "POST"],
            _ => &["GET"],
        }
    }

    /// Routes answered in the engines' own words down to Starlette's 404
    /// and 405 (the routes older than them keep the emulator's wording).
    fn starlette_errors(self) -> bool {
        matches!(
            self,
            Route::Responses | Route::ResponseItem | Route::ResponseCancel | Route::Embeddings
        )
    }

    /// Test controls are not part of the emulated engine, so the emulated
    /// network distance does not apply to them.
    fn is_admin(self) -> bool {
        matches!(
            self,
            Route::AdminStats | Route::AdminState | Route::AdminReset
        )
    }
}

/// Mutable replica state, all behind one lock so snapshots are consistent.
struct State {
    engine: Engine,
    healthy: bool,
    network_delay_ms: f64,
    garbage_metrics: bool,
    requests: BTreeMap<&'static str, u64>,
    garbage_seq: u64,
    /// Fault injection: inference requests answered at once with this
    /// status (0: off).
    fail_status: u16,
    /// Fault injection: `/health` and `/metrics` never answer (until off).
    hang_probes: bool,
    /// Fault injection: inference requests never answer (until off).
    hang_inference: bool,
    /// Answers of `/v1/responses` kept for `previous_response_id` and GET.
    responses: responses::Store,
    /// When the serving process started (Unix s), as vLLM's
    /// `process_start_time_seconds` says: at launch, and again at
    /// `/admin/reset`, which stands for a restart.
    process_start_s: f64,
}

struct Shared {
    config: Config,
    /// (request header, `x-echo-` response header) per `--echo-header`.
    echo: Vec<(HeaderName, HeaderName)>,
    client_region_header: Option<HeaderName>,
    clock: Instant,
    started_unix: u64,
    next_id: AtomicU64,
    /// Seed of the ids this replica hands out (response, message and
    /// embedding ids), unique per replica and start.
    id_seed: u64,
    state: Mutex<State>,
    /// Signalled whenever a slot frees, the scheduler is unpaused or a
    /// fault is lifted.
    wake: Notify,
}

impl Shared {
    /// A panic cannot leave `State` half-updated in a way that matters more
    /// than stopping the replica would, so a poisoned lock is just used.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now_ms(&self) -> f64 {
        self.clock.elapsed().as_secs_f64() * 1000.0
    }

    /// 32 fresh hex digits, the shape of vLLM's `random_uuid()`.
    fn fresh_hex(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed).to_le_bytes();
        let a = xxh3_64_with_seed(&n, self.id_seed);
        let b = xxh3_64_with_seed(&n, self.id_seed ^ 0x9e37_79b9_7f4a_7c15);
        format!("{a:016x}{b:016x}")
    }

    /// Waits until `ready` returns a value. `ready` runs under the state
    /// lock, now and after every wake-up; being registered for the wake-up
    /// before looking means none is missed.
    async fn wait_for<T>(&self, mut ready: impl FnMut(&mut State) -> Option<T>) -> T {
        loop {
            let mut notified = pin!(self.wake.notified());
            notified.as_mut().enable();
            let got = ready(&mut self.lock());
            if let Some(v) = got {
                return v;
            }
            notified.await;
        }
    }
}

/// Holds a request's place in the scheduler (slot or queue position) and
/// gives it back however the request ends: done, error, or client gone
/// (the future or body holding it is dropped).
struct Slot {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let now = self.shared.now_ms();
        self.shared.lock().engine.finish(self.id, now);
        self.shared.wake.notify_waiters();
    }
}

pub struct Server {
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
}

impl Server {
    pub fn bind(config: Config) -> io::Result<Server> {
        let listener = std::net::TcpListener::bind(config.listen.as_str())?;
        listener.set_nonblocking(true)?;
        let state = State {
            engine: Engine::new(config.engine()),
            healthy: true,
            network_delay_ms: config.network_delay_ms,
            garbage_metrics: false,
            fail_status: 0,
            hang_probes: false,
            hang_inference: false,
            requests: BTreeMap::new(),
            garbage_seq: 0,
            responses: responses::Store::default(),
            process_start_s: unix_secs_f64(),
        };
        // Names were validated as tokens; one that still did not convert
        // would simply not be echoed.
        let echo = config
            .echo_headers
            .iter()
            .filter_map(|name| {
                let from = HeaderName::from_bytes(name.as_bytes()).ok()?;
                let to = HeaderName::from_bytes(format!("x-echo-{name}").as_bytes()).ok()?;
                Some((from, to))
            })
            .collect();
        let client_region_header =
            HeaderName::from_bytes(config.client_region_header.as_bytes()).ok();
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut seed_key = config.name.as_bytes().to_vec();
        seed_key.extend_from_slice(&started.to_le_bytes());
        seed_key.extend_from_slice(&std::process::id().to_le_bytes());
        let shared = Shared {
            id_seed: xxh3_64_with_seed(&seed_key, 0),
            config,
            echo,
            client_region_header,
            clock: Instant::now(),
            started_unix: unix_secs(),
            next_id: AtomicU64::new(1),
            state: Mutex::new(state),
            wake: Notify::new(),
        };
        Ok(Server {
            listener,
            shared: Arc::new(shared),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves forever on a runtime of its own; returns only if that runtime
    /// cannot be built.
    pub fn run(self) -> io::Result<()> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("emulator")
            .enable_all()
            .build()?
            .block_on(self.serve())
    }

    /// Serves forever on the current tokio runtime.
    pub async fn serve(self) -> io::Result<()> {
        let listener = TcpListener::from_std(self.listener)?;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    tokio::spawn(serve_connection(Arc::clone(&self.shared), stream));
                }
                // Typically EMFILE: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    // SSE events must leave as soon as they are written.
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WriteStallTimeout::new(stream, WRITE_TIMEOUT));
    let service = service_fn(move |req| handle(Arc::clone(&shared), req));
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(IDLE_TIMEOUT)
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        .auto_date_header(false)
        .serve_connection(io, service)
        .without_shutdown();
    // An error (client gone, malformed request answered by hyper, timeout)
    // has already ended the exchange and dropped the socket; after a clean
    // end (either side asked to close) it is closed here, gently.
    if let Ok(parts) = conn.await {
        linger_close(parts.io.into_inner().into_inner()).await;
    }
}

/// Closes our side, then reads (and discards) for a moment what the client
/// may still be sending, so the kernel does not answer it with a RST that
/// would destroy our last response before the client reads it.
async fn linger_close(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let drain = async {
        let mut buf = [0u8; 8192];
        let mut drained = 0usize;
        while drained < LINGER_MAX_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained = drained.saturating_add(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

type Reply = Response<ReplyBody>;

/// Headers every response of one exchange carries: `x-echo-NAME` for the
/// configured names, which lets tests see what Envoy actually forwarded.
struct Echo(Vec<(HeaderName, HeaderValue)>);

fn echo_headers(shared: &Shared, headers: &HeaderMap) -> Echo {
    let pairs = shared
        .echo
        .iter()
        .filter_map(|(from, to)| {
            let values: Vec<String> = headers
                .get_all(from)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect();
            let value = if values.is_empty() {
                "-".to_string()
            } else {
                values.join(", ")
            };
            Some((to.clone(), HeaderValue::try_from(value).ok()?))
        })
        .collect();
    Echo(pairs)
}

/// A response: content type, then `extra`, then the echo headers. A header
/// value that cannot be sent (none of ours, all validated) is left out.
fn respond(
    status: u16,
    content_type: &'static str,
    extra: Vec<(HeaderName, String)>,
    echo: &Echo,
    body: ReplyBody,
) -> Reply {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    for (name, value) in extra {
        if let Ok(v) = HeaderValue::try_from(value) {
            h.append(name, v);
        }
    }
    for (name, value) in &echo.0 {
        h.append(name.clone(), value.clone());
    }
    r
}

fn json_reply(status: u16, body: impl Into<Bytes>, echo: &Echo) -> Reply {
    respond(status, JSON, Vec::new(), echo, ReplyBody::full(body))
}

fn error_reply(status: u16, message: &str, kind: &str, echo: &Echo) -> Reply {
    json_reply(status, openai::error_body(status, message, kind), echo)
}

fn refusal_reply(r: Refusal, extra: Vec<(HeaderName, String)>, echo: &Echo) -> Reply {
    respond(r.status, JSON, extra, echo, ReplyBody::full(r.body))
}

/// An error answer to a request that could not be read; the connection is
/// closed after it.
fn reject(status: u16, message: &str, echo: &Echo) -> Reply {
    let mut r = error_reply(status, message, INVALID, echo);
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// One exchange. The error (the body did not arrive in time) makes hyper
/// close the connection without an answer.
async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Reply, io::Error> {
    let (head, body) = req.into_parts();
    // hyper decodes chunked framing and refuses a coding list that does not
    // end with it; any other coding before it is not implemented here.
    if let Some(codings) = unsupported_codings(&head.headers) {
        let msg = format!("not implemented: transfer coding {codings}");
        return Ok(reject(501, &msg, &Echo(Vec::new())));
    }
    let route = Route::of(head.uri.path());
    {
        let mut st = shared.lock();
        let n = st.requests.entry(route.path()).or_insert(0);
        *n = n.saturating_add(1);
    }
    let echo = echo_headers(&shared, &head.headers);

    // Refuse an oversized upload before inviting the client to send it
    // (hyper sends `100 Continue` only once the body is read).
    let too_large = format!("request body larger than {MAX_BODY_BYTES} bytes");
    if body.size_hint().lower() > u64::try_from(MAX_BODY_BYTES).unwrap_or(u64::MAX) {
        return Ok(reject(413, &too_large, &echo));
    }
    let read = Limited::new(body, MAX_BODY_BYTES).collect();
    let body = match tokio::time::timeout(IDLE_TIMEOUT, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => return Ok(reject(413, &too_large, &echo)),
        Ok(Err(e)) => return Ok(reject(400, &format!("malformed request: {e}"), &echo)),
        Err(_) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "request body timed out",
            ))
        }
    };

    if !route.is_admin() {
        // The client-region header (its last value, if repeated: the one
        // the nearest proxy added) picks a region's own delay.
        let region = shared
            .client_region_header
            .as_ref()
            .and_then(|name| head.headers.get_all(name).iter().next_back())
            .and_then(|v| v.to_str().ok());
        let network_delay_ms = shared.lock().network_delay_ms;
        let delay = shared.config.first_byte_delay_ms(region, network_delay_ms);
        tokio::time::sleep(ms_duration(delay)).await;
    }
    let path = head.uri.path();
    Ok(dispatch(&shared, route, &head.method, path, &body, &echo).await)
}

/// The transfer codings of a request that are not just `chunked`, if any.
fn unsupported_codings(headers: &HeaderMap) -> Option<String> {
    let mut codings = Vec::new();
    for value in headers.get_all(hyper::header::TRANSFER_ENCODING) {
        let value = String::from_utf8_lossy(value.as_bytes());
        codings.extend(
            value
                .split(',')
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty()),
        );
    }
    match codings.as_slice() {
        [] => None,
        [only] if only == "chunked" => None,
        _ => Some(codings.join(", ")),
    }
}

async fn dispatch(
    shared: &Arc<Shared>,
    route: Route,
    method: &Method,
    path: &str,
    body: &[u8],
    echo: &Echo,
) -> Reply {
    // Routes the emulated engine does not have: vLLM serves embeddings only
    // for a pooling model, SGLang has no /version.
    let absent = match route {
        Route::Embeddings => !shared.config.serves_embeddings(),
        Route::Version => shared.config.mode == Mode::Sglang,
        _ => false,
    };
    if absent {
        return refusal_reply(Refusal::route_not_found(), Vec::new(), echo);
    }
    if route == Route::NotFound {
        if path.starts_with("/v1/responses/") {
            // Say `GET /v1/responses/{id}/input_items`: no route in vLLM.
            return refusal_reply(Refusal::route_not_found(), Vec::new(), echo);
        }
        let msg = format!("no route for {method} {path}");
        return error_reply(404, &msg, INVALID, echo);
    }
    if !route.methods().contains(&method.as_str()) {
        let allow = vec![(ALLOW, route.methods().join(", "))];
        if route.starlette_errors() {
            // Say `DELETE /v1/responses/{id}`: vLLM has only a GET there.
            return refusal_reply(Refusal::method_not_allowed(), allow, echo);
        }
        let body = openai::error_body(
            405,
            &format!("method {} not allowed on {}", method, route.path()),
            INVALID,
        );
        return respond(405, JSON, allow, echo, ReplyBody::full(body));
    }
    let inference_route = matches!(
        route,
        Route::Chat | Route::Completions | Route::Responses | Route::Embeddings
    );
    let probe_route = matches!(route, Route::Health | Route::Metrics);
    let fail_status = shared
        .wait_for(|st| {
            let hung = (inference_route && st.hang_inference) || (probe_route && st.hang_probes);
            (!hung).then_some(st.fail_status)
        })
        .await;
    if inference_route && fail_status != 0 {
        let name = vec![(X_ENGINE_REPLICA, shared.config.name.clone())];
        let msg = "injected failure (admin fail_status)";
        let body = openai::error_body(fail_status, msg, "server_error");
        return respond(fail_status, JSON, name, echo, ReplyBody::full(body));
    }
    match route {
        Route::Chat => inference(shared, Kind::Chat, body, echo).await,
        Route::ChatRender => render_chat(shared, method, path, body, echo),
        Route::Completions => inference(shared, Kind::Completion, body, echo).await,
        Route::Responses => create_response(shared, body, echo).await,
        Route::ResponseItem => retrieve_response(shared, Route::response_id(path), echo),
        Route::ResponseCancel => cancel_response(shared, Route::response_id(path), echo),
        Route::Embeddings => embed(shared, body, echo).await,
        Route::Health => health(shared, echo),
        Route::Version => json_reply(200, Bytes::from_static(br#"{"version":"0.32.0"}"#), echo),
        Route::Models => {
            let owner = shared.config.mode.as_str();
            let list = openai::model_list(
                &shared.config.model,
                &shared.config.lora_modules,
                owner,
                shared.started_unix,
                shared.config.max_model_len,
            );
            json_reply(200, list, echo)
        }
        Route::Metrics => metrics_page(shared, echo),
        Route::AdminStats => admin_stats(shared, echo),
        Route::AdminState if method == Method::GET => admin_state(shared, b"", echo),
        Route::AdminState => admin_state(shared, body, echo),
        Route::AdminReset => {
            {
                let mut st = shared.lock();
                st.engine.reset();
                st.requests.clear();
                st.responses.clear();
                st.process_start_s = unix_secs_f64();
            }
            json_reply(200, Bytes::from_static(br#"{"status":"reset"}"#), echo)
        }
        Route::NotFound => error_reply(404, "not found", INVALID, echo),
    }
}

/// vLLM's `POST /v1/chat/completions/render` (its token-in/token-out
/// API): the chat template applied and tokenized, answered as the
/// `GenerateRequest` that `/inference/v1/generate` would take, with the
/// same ids the engine would prefill for that body. Routers that match
/// prefixes on token ids call it on every worker before they choose one
/// (vllm-router's `cache_aware`). SGLang has no such route.
fn render_chat(shared: &Shared, method: &Method, path: &str, body: &[u8], echo: &Echo) -> Reply {
    let cfg = &shared.config;
    if cfg.mode == Mode::Sglang {
        return error_reply(404, &format!("no route for {method} {path}"), INVALID, echo);
    }
    let req = match openai::parse_request(Kind::Chat, body) {
        Ok(r) => r,
        Err(msg) => return error_reply(400, &msg, INVALID, echo),
    };
    if let Some(r) = openai::context_refusal(&req, cfg.max_model_len, cfg.mode) {
        return refusal_reply(r, Vec::new(), echo);
    }
    let rendered = json!({
        "request_id": shared.fresh_hex(),
        "token_ids": req.prompt,
        "features": null,
        "sampling_params": {"max_tokens": req.max_tokens},
        "model": cfg.model,
        "stream": req.stream,
    });
    json_reply(200, rendered.to_string(), echo)
}

/// `GET /health`: vLLM answers an empty 200 (503 once its engine is
/// dead), SGLang a small JSON body; the release digest only when
/// `--release` gives one.
fn health(shared: &Shared, echo: &Echo) -> Reply {
    let healthy = shared.lock().healthy;
    let digest: Vec<_> = shared
        .config
        .release
        .iter()
        .map(|r| (X_RELEASE_DIGEST, r.clone()))
        .collect();
    let status = if healthy { 200 } else { 503 };
    match shared.config.mode {
        Mode::Vllm => {
            let mut r = respond(status, JSON, digest, echo, ReplyBody::full(Bytes::new()));
            r.headers_mut().remove(CONTENT_TYPE);
            r
        }
        Mode::Sglang => {
            let body: &'static [u8] = if healthy {
                br#"{"status":"ok"}"#
            } else {
                br#"{"status":"unhealthy"}"#
            };
            respond(status, JSON, digest, echo, ReplyBody::full(body))
        }
    }
}

fn request_counts(st: &State) -> Vec<(String, u64)> {
    Route::ALL
        .iter()
        .map(|r| {
            let path = r.path();
            (
                path.to_string(),
                st.requests.get(path).copied().unwrap_or(0),
            )
        })
        .collect()
}

fn metrics_page(shared: &Shared, echo: &Echo) -> Reply {
    let cfg = &shared.config;
    let text = {
        let mut st = shared.lock();
        if st.garbage_metrics {
            st.garbage_seq = st.garbage_seq.wrapping_add(1);
            metrics::garbage(st.garbage_seq)
        } else {
            let snapshot = metrics::Snapshot {
                running: st.engine.scheduler.running(),
                waiting: st.engine.scheduler.waiting(),
                cache_usage: st.engine.cache.usage(),
                query_tokens: st.engine.cache.query_tokens(),
                hit_tokens: st.engine.cache.hit_tokens(),
                completed: st.engine.completed(),
                generated: st.engine.generated(),
                capacity_tokens: st.engine.cache.capacity_tokens(),
                block_tokens: st.engine.cache.block_tokens(),
                max_model_len: cfg.max_model_len,
                requests: request_counts(&st),
                process_start_s: st.process_start_s,
            };
            metrics::render(cfg.mode, &cfg.model, cfg.release.as_deref(), &snapshot)
        }
    };
    respond(
        200,
        metrics::content_type(cfg.mode),
        Vec::new(),
        echo,
        ReplyBody::full(text),
    )
}

fn admin_stats(shared: &Shared, echo: &Echo) -> Reply {
    let body = {
        let st = shared.lock();
        let requests: serde_json::Map<String, serde_json::Value> = request_counts(&st)
            .into_iter()
            .map(|(p, n)| (p, json!(n)))
            .collect();
        json!({
            "name": shared.config.name,
            "mode": shared.config.mode.as_str(),
            "requests": requests,
            "running": st.engine.scheduler.running(),
            "waiting": st.engine.scheduler.waiting(),
            "cache_hit_tokens": st.engine.cache.hit_tokens(),
            "cache_query_tokens": st.engine.cache.query_tokens(),
            "cache_used_tokens": st.engine.cache.used_tokens(),
            "completed": st.engine.completed(),
            "stored_responses": st.responses.len(),
        })
    };
    json_reply(200, body.to_string(), echo)
}

/// Body of `POST /admin/state`; unknown fields are rejected so a typo in a
/// test fails loudly instead of silently changing nothing.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatePatch {
    healthy: Option<bool>,
    network_delay_ms: Option<f64>,
    garbage_metrics: Option<bool>,
    paused: Option<bool>,
    fail_status: Option<u16>,
    hang_probes: Option<bool>,
    hang_inference: Option<bool>,
}

fn admin_state(shared: &Shared, body: &[u8], echo: &Echo) -> Reply {
    let patch = if body.iter().all(u8::is_ascii_whitespace) {
        StatePatch::default()
    } else {
        match serde_json::from_slice::<StatePatch>(body) {
            Ok(p) => p,
            Err(e) => return error_reply(400, &format!("bad state: {e}"), INVALID, echo),
        }
    };
    if let Some(d) = patch.network_delay_ms {
        if !(d.is_finite() && (0.0..=MAX_MS).contains(&d)) {
            let msg = "network_delay_ms must be a number of milliseconds >= 0";
            return error_reply(400, msg, INVALID, echo);
        }
    }
    if let Some(f) = patch.fail_status {
        if f != 0 && !(400..=599).contains(&f) {
            let msg = "fail_status must be 0 (off) or 400..=599";
            return error_reply(400, msg, INVALID, echo);
        }
    }
    let body = {
        let mut st = shared.lock();
        if let Some(f) = patch.fail_status {
            st.fail_status = f;
        }
        if let Some(h) = patch.hang_probes {
            st.hang_probes = h;
        }
        if let Some(h) = patch.hang_inference {
            st.hang_inference = h;
        }
        if let Some(h) = patch.healthy {
            st.healthy = h;
        }
        if let Some(d) = patch.network_delay_ms {
            st.network_delay_ms = d;
        }
        if let Some(g) = patch.garbage_metrics {
            st.garbage_metrics = g;
        }
        if let Some(p) = patch.paused {
            st.engine.scheduler.set_paused(p);
        }
        json!({
            "healthy": st.healthy,
            "network_delay_ms": st.network_delay_ms,
            "garbage_metrics": st.garbage_metrics,
            "paused": st.engine.scheduler.is_paused(),
            "fail_status": st.fail_status,
            "hang_probes": st.hang_probes,
            "hang_inference": st.hang_inference,
        })
    };
    // Lifted hangs and an unpaused scheduler let waiters go on.
    shared.wake.notify_waiters();
    json_reply(200, body.to_string(), echo)
}

/// One inference request: admission (FIFO), prefill, then the response,
/// timed so the client sees queue + prefill before the first byte and
/// decode pacing after it.
/// `f` (a request's parse and tokenization) on the runtime's blocking
/// pool, as vLLM tokenizes in a thread pool beside its event loop: a prompt
/// of megabytes takes a second or more to tokenize, and on the two runtime
/// threads two of them would stall every other request, `/health` and
/// `/metrics` included, for as long. `None` if it panicked there.
async fn off_the_runtime<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    tokio::task::spawn_blocking(f).await.ok()
}

/// The engine's own failure, for a request whose parse failed off the
/// runtime.
fn parse_failed(echo: &Echo) -> Reply {
    error_reply(
        500,
        "the request could not be tokenized",
        "internal_server_error",
        echo,
    )
}

async fn inference(shared: &Arc<Shared>, kind: Kind, body: &[u8], echo: &Echo) -> Reply {
    if !shared.lock().healthy {
        return error_reply(503, "replica is unhealthy", "service_unavailable", echo);
    }
    let owned = body.to_vec();
    let req = match off_the_runtime(move || openai::parse_request(kind, &owned)).await {
        Some(Ok(r)) => r,
        Some(Err(msg)) => return error_reply(400, &msg, INVALID, echo),
        None => return parse_failed(echo),
    };
    let cfg = &shared.config;
    if let Some(r) = unknown_model(cfg, req.model.as_deref()) {
        return refusal_reply(r, Vec::new(), echo);
    }
    if let Some(r) = openai::context_refusal(&req, cfg.max_model_len, cfg.mode) {
        return refusal_reply(r, Vec::new(), echo);
    }
    let tokens = openai::output_tokens(&req, cfg.max_model_len);
    let block_tokens = cfg.engine().block_tokens;
    // vLLM keys a salted prompt's blocks apart; SGLang has no salt.
    let salt = match cfg.mode {
        Mode::Vllm => req.cache_salt.as_deref(),
        Mode::Sglang => None,
    };
    let prompt = Prompt::salted(&req.prompt, block_tokens, salt);

    let (slot, plan, queue_ms) = prefill(shared, |e, id| e.admit(id, &prompt)).await;
    let id = slot.id;

    let cfg = &shared.config;
    let mut headers = engine_headers(cfg, &plan, queue_ms);
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let meta = ResponseMeta {
        id: format!("{prefix}-{}-{id}", cfg.name),
        created: unix_secs(),
        model: cfg.model.clone(),
    };
    let usage = Usage {
        prompt_tokens: plan.prompt_tokens,
        completion_tokens: tokens,
        cached_tokens: plan.cached_tokens,
        // vLLM 0.32's chat endpoint reports it, its completions endpoint
        // leaves it null.
        created_tokens: match kind {
            Kind::Chat => Some(plan.created_tokens),
            Kind::Completion => None,
        },
        report: shared.config.cache_report(),
    };
    let decode_ms_per_token = shared.lock().engine.timing.decode_ms_per_token;
    // With the last bytes: count the success, then give the slot back.
    let on_done = Box::new(move || {
        slot.shared.lock().engine.record_success(tokens);
        drop(slot);
    });

    if req.stream {
        let mut tail = Vec::new();
        let with_usage = req.include_usage || shared.config.force_include_usage;
        if with_usage {
            tail.extend(openai::usage_chunk(kind, &meta, usage));
        }
        tail.extend_from_slice(openai::SSE_DONE);
        let mode = cfg.mode;
        let render = Box::new(move |range: std::ops::Range<usize>| {
            let mut events = Vec::new();
            for i in range {
                let text = openai::token_text(i);
                let (first, last) = (i == 0, i.saturating_add(1) == tokens);
                events.extend(match mode {
                    Mode::Vllm => {
                        openai::vllm_stream_chunks(kind, &meta, &text, first, last, !with_usage)
                    }
                    Mode::Sglang => openai::stream_chunk(kind, &meta, &text, first, last),
                });
            }
            events
        });
        headers.push((CACHE_CONTROL, "no-cache".to_string()));
        let content_type = match mode {
            Mode::Vllm => EVENT_STREAM_UTF8,
            Mode::Sglang => "text/event-stream",
        };
        let body = ReplyBody::events(tokens, decode_ms_per_token, render, tail, on_done);
        respond(200, content_type, headers, echo, body)
    } else {
        let text = openai::output_text(tokens);
        let full = openai::full_response(kind, &meta, &text, usage);
        let decode_ms = decode_ms_per_token * tokens as f64;
        let body = ReplyBody::after(decode_ms, full, on_done);
        respond(200, JSON, headers, echo, body)
    }
}

/// vLLM's 404 for a request naming a model that is neither the served one
/// nor an adapter, when `--check-model` asks for the check.
fn unknown_model(cfg: &Config, model: Option<&str>) -> Option<Refusal> {
    let m = model.filter(|m| {
        cfg.check_model && *m != cfg.model && !cfg.lora_modules.iter().any(|l| l == m)
    })?;
    let mut aliases = vec![cfg.model.as_str()];
    aliases.extend(cfg.lora_modules.iter().map(String::as_str));
    Some(openai::unknown_model(m, &aliases))
}

/// Admission (FIFO, through the scheduler) and prefill of one engine
/// request: waits for a slot, lets `admit` price the prefill when it gets
/// one, then waits the prefill out. Returns the slot (freed when dropped),
/// the plan and the time spent queued, in ms.
async fn prefill(
    shared: &Arc<Shared>,
    mut admit: impl FnMut(&mut Engine, RequestId) -> PrefillPlan,
) -> (Slot, PrefillPlan, f64) {
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let arrived = Instant::now();
    let slot = Slot {
        shared: Arc::clone(shared),
        id,
    };
    shared.lock().engine.scheduler.arrive(id);
    let plan = shared
        .wait_for(|st| {
            st.engine
                .scheduler
                .is_running(id)
                .then(|| admit(&mut st.engine, id))
        })
        .await;
    let queue_ms = arrived.elapsed().as_secs_f64() * 1000.0;
    tokio::time::sleep(ms_duration(plan.prefill_ms)).await;
    (slot, plan, queue_ms)
}

/// The `x-engine-*` headers of an answer the engine prefilled.
fn engine_headers(cfg: &Config, plan: &PrefillPlan, queue_ms: f64) -> Vec<(HeaderName, String)> {
    vec![
        (X_ENGINE_REPLICA, cfg.name.clone()),
        (X_ENGINE_CACHED, plan.cached_tokens.to_string()),
        (X_ENGINE_PROMPT, plan.prompt_tokens.to_string()),
        (X_ENGINE_QUEUE_MS, format!("{}", queue_ms.round() as u64)),
    ]
}

/// `POST /v1/responses` (see `responses` for what vLLM does and what is
/// not emulated): the conversation (a stored previous answer continued,
/// then the new input) goes through the chat template, the queue and the
/// prefix cache exactly as a chat request does, with the same `x-engine-*`
/// headers and counters; the answer is stored when its last byte is
/// handed over (vLLM stores it when generation ends), if `store`.
///
/// Streaming deviates in one way: vLLM sends `response.created` and
/// `response.in_progress` before the request is even scheduled; here the
/// head and those events leave after the prefill, like a chat stream, so
/// the headers can carry the admission's numbers.
async fn create_response(shared: &Arc<Shared>, body: &[u8], echo: &Echo) -> Reply {
    if !shared.lock().healthy {
        return error_reply(503, "replica is unhealthy", "service_unavailable", echo);
    }
    let cfg = &shared.config;
    let mode = cfg.mode;
    let req = match responses::parse_request(mode, body) {
        Ok(r) => r,
        Err(r) => return refusal_reply(r, Vec::new(), echo),
    };
    if let Some(r) = unknown_model(cfg, req.model.as_deref()) {
        return refusal_reply(r, Vec::new(), echo);
    }
    let prev = match req.previous_response_id.as_deref() {
        None => None,
        Some(pid) => {
            if let Err(r) = responses::check_id(mode, pid) {
                return refusal_reply(r, Vec::new(), echo);
            }
            match shared.lock().responses.get(pid).cloned() {
                Some(stored) => Some(stored),
                None => return refusal_reply(responses::not_found(pid), Vec::new(), echo),
            }
        }
    };
    let messages = responses::conversation(mode, &req, prev.as_ref());
    let rendered = Value::Array(messages.clone());
    let ids = match off_the_runtime(move || tokenizer::chat(&rendered)).await {
        Some(Ok(ids)) => ids,
        Some(Err(msg)) => {
            return refusal_reply(Refusal::bad_request(mode, &msg, None), Vec::new(), echo)
        }
        None => return parse_failed(echo),
    };
    if let Some(r) =
        responses::context_refusal(mode, ids.len(), req.max_output_tokens, cfg.max_model_len)
    {
        return refusal_reply(r, Vec::new(), echo);
    }
    let (tokens, limit) =
        responses::output_budget(req.max_output_tokens, ids.len(), cfg.max_model_len);
    let prompt = Prompt::salted(&ids, cfg.engine().block_tokens, req.cache_salt.as_deref());

    let (slot, plan, queue_ms) = prefill(shared, |e, id| e.admit(id, &prompt)).await;

    let mut headers = engine_headers(cfg, &plan, queue_ms);
    let answer = Answer {
        mode,
        id: format!("{}{}", responses::ID_PREFIX, shared.fresh_hex()),
        msg_id: format!("msg_{}", shared.fresh_hex()),
        created_at: unix_secs(),
        // vLLM names the served model; SGLang repeats the request's.
        model: match (mode, &req.model) {
            (Mode::Sglang, Some(m)) => m.clone(),
            _ => cfg.model.clone(),
        },
        text: openai::output_text(tokens),
        prompt_tokens: plan.prompt_tokens,
        cached_tokens: plan.cached_tokens,
        created_tokens: plan.created_tokens,
        output_tokens: tokens,
        limit,
        cache_report: cfg.cache_report,
    };
    let full = responses::response_json(&req.echo, &answer, true);
    // vLLM keeps nothing unless its store is on (`store` is then ignored).
    let stored = (req.store && cfg.stores_responses()).then(|| {
        let s = Stored {
            response: full.clone(),
            messages,
            output_text: answer.text.clone(),
        };
        (answer.id.clone(), s)
    });
    let decode_ms_per_token = shared.lock().engine.timing.decode_ms_per_token;
    // With the last bytes: count the success, keep the answer, then give
    // the slot back.
    let on_done = Box::new(move || {
        {
            let mut st = slot.shared.lock();
            st.engine.record_success(tokens);
            if let Some((id, s)) = stored {
                st.responses.insert(id, s);
            }
        }
        drop(slot);
    });

    if req.stream {
        let head = responses::stream_head(&req.echo, &answer);
        let tail = responses::stream_tail(&req.echo, &answer);
        let render = Box::new(move |range: std::ops::Range<usize>| {
            let mut events = Vec::new();
            for i in range {
                if i == 0 {
                    events.extend_from_slice(&head);
                }
                events.extend(responses::stream_delta(&answer, i, &openai::token_text(i)));
            }
            events
        });
        headers.push((CACHE_CONTROL, "no-cache".to_string()));
        let body = ReplyBody::events(tokens, decode_ms_per_token, render, tail, on_done);
        respond(200, EVENT_STREAM_UTF8, headers, echo, body)
    } else {
        let bytes = responses::response_bytes(mode, &full);
        let decode_ms = decode_ms_per_token * tokens as f64;
        respond(
            200,
            JSON,
            headers,
            echo,
            ReplyBody::after(decode_ms, bytes, on_done),
        )
    }
}

/// `GET /v1/responses/{response_id}`: the stored answer, or 404 (also
/// while it is still being generated: vLLM stores it at the end).
fn retrieve_response(shared: &Shared, id: &str, echo: &Echo) -> Reply {
    let name = vec![(X_ENGINE_REPLICA, shared.config.name.clone())];
    if let Err(r) = responses::check_id(shared.config.mode, id) {
        return refusal_reply(r, name, echo);
    }
    let found = shared.lock().responses.get(id).map(|s| s.response.clone());
    match found {
        Some(response) => {
            let bytes = responses::response_bytes(shared.config.mode, &response);
            respond(200, JSON, name, echo, ReplyBody::full(bytes))
        }
        None => refusal_reply(responses::not_found(id), name, echo),
    }
}

/// `POST /v1/responses/{response_id}/cancel`: 404 for an unknown id; a
/// stored answer is finished, which vLLM refuses to cancel (400).
fn cancel_response(shared: &Shared, id: &str, echo: &Echo) -> Reply {
    let name = vec![(X_ENGINE_REPLICA, shared.config.name.clone())];
    let mode = shared.config.mode;
    if let Err(r) = responses::check_id(mode, id) {
        return refusal_reply(r, name, echo);
    }
    let known = shared.lock().responses.get(id).is_some();
    let r = if known {
        responses::cannot_cancel(mode)
    } else {
        responses::not_found(id)
    };
    refusal_reply(r, name, echo)
}

/// `POST /v1/embeddings`: one pass through the queue for all the request's
/// prompts, prefilled in full (pooling prompts bypass the prefix cache
/// and its counters), answered when the prefill ends; counted as a
/// success like any finished request.
async fn embed(shared: &Arc<Shared>, body: &[u8], echo: &Echo) -> Reply {
    if !shared.lock().healthy {
        return error_reply(503, "replica is unhealthy", "service_unavailable", echo);
    }
    let cfg = &shared.config;
    let mode = cfg.mode;
    let owned = body.to_vec();
    let req = match off_the_runtime(move || embeddings::parse_request(mode, &owned)).await {
        Some(Ok(r)) => r,
        Some(Err(r)) => return refusal_reply(r, Vec::new(), echo),
        None => return parse_failed(echo),
    };
    if let Some(r) = embeddings::context_refusal(mode, &req, cfg.max_model_len) {
        return refusal_reply(r, Vec::new(), echo);
    }
    let prompt_tokens = req.prompt_tokens();
    let vectors: Vec<Vec<f32>> = req
        .prompts
        .iter()
        .map(|p| embeddings::vector(p, cfg.embedding_dim, req.dimensions, req.normalize))
        .collect();

    let (slot, plan, queue_ms) = prefill(shared, |e, _| e.admit_uncached(prompt_tokens)).await;

    let headers = engine_headers(cfg, &plan, queue_ms);
    let meta = embeddings::Meta {
        id: format!("embd-{}", shared.fresh_hex()),
        created: unix_secs(),
        model: cfg.model.clone(),
    };
    let bytes = embeddings::response_body(mode, &meta, &vectors, req.base64, prompt_tokens);
    let on_done = Box::new(move || {
        slot.shared.lock().engine.record_success(0);
        drop(slot);
    });
    respond(
        200,
        JSON,
        headers,
        echo,
        ReplyBody::after(0.0, bytes, on_done),
    )
}

/// The socket under hyper, failing a write that has made no progress for
/// `limit`: a client that stops reading is abandoned (hyper then drops the
/// connection, and with it the request and its slot) instead of pinning a
/// slot forever. Reads pass through.
struct WriteStallTimeout {
    stream: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteStallTimeout {
    fn new(stream: TcpStream, limit: Duration) -> Self {
        WriteStallTimeout {
            stream,
            limit,
            stalled: None,
        }
    }

    fn into_inner(self) -> TcpStream {
        self.stream
    }

    /// Passes a ready result through (progress: the stall clock stops);
    /// on pending, runs the stall clock and fails when it expires.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if result.is_ready() {
            self.stalled = None;
            return result;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "client stopped reading",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteStallTimeout {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteStallTimeout {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.watch(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.watch(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.stream).poll_flush(cx);
        this.watch(cx, result)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

fn unix_secs_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn unix_secs() -> u64 {
    unix_secs_f64() as u64
}
