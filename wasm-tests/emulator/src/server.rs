//! The live replica: accepts connections (one thread each, keep-alive),
//! routes requests, and drives the pure engine model with the real clock:
//! network delay, FIFO admission, prefill and decode become actual waits, so
//! a client (or Envoy) observes the latencies a real engine would produce.

use std::collections::BTreeMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use serde_json::json;

use crate::config::{Config, MAX_MS};
use crate::http::{self, BodyKind, Framing, Head, ReadError, MAX_BODY_BYTES};
use crate::metrics;
use crate::model::{Engine, Prompt};
use crate::openai::{self, Kind, ResponseMeta, Usage};

/// An idle keep-alive connection is dropped after this; long enough that
/// Envoy's pooled upstream connections are normally closed by Envoy first.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// A client that stops reading our response is abandoned after this.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often waits check whether the client is still there.
const WATCH_SLICE: Duration = Duration::from_millis(20);
/// After an error response on a connection we are closing, unread request
/// bytes are drained briefly so the close does not turn into a RST that
/// destroys the response before the client reads it.
const LINGER: Duration = Duration::from_millis(200);
const LINGER_MAX_BYTES: usize = 1 << 20;

const JSON: &str = "application/json";
const INVALID: &str = "invalid_request_error";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Completions,
    Health,
    Models,
    Metrics,
    AdminStats,
    AdminState,
    AdminReset,
    NotFound,
}

impl Route {
    const ALL: [Route; 9] = [
        Route::Health,
        Route::Metrics,
        Route::Chat,
        Route::Completions,
        Route::Models,
        Route::AdminStats,
        Route::AdminState,
        Route::AdminReset,
        Route::NotFound,
    ];

    fn of(path: &str) -> Route {
        Route::ALL
            .into_iter()
            .find(|r| r.path() == path)
            .unwrap_or(Route::NotFound)
    }

    /// Also the key under which requests are counted; unknown paths share
    /// one key so arbitrary URLs cannot grow the counter map.
    fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Health => "/health",
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
            Route::Chat | Route::Completions | Route::AdminReset => &["POST"],
            Route::AdminState => &["GET", "POST"],
            _ => &["GET"],
        }
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
}

struct Shared {
    config: Config,
    clock: Instant,
    started_unix: u64,
    next_id: AtomicU64,
    state: Mutex<State>,
    /// Signalled whenever a slot frees or the scheduler is unpaused.
    wake: Condvar,
}

impl Shared {
    /// A panic cannot leave `State` half-updated in a way that matters more
    /// than stopping the replica would, so a poisoned lock is just used.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>, timeout: Duration) -> MutexGuard<'a, State> {
        match self.wake.wait_timeout(guard, timeout) {
            Ok((g, _)) => g,
            Err(poisoned) => poisoned.into_inner().0,
        }
    }

    fn now_ms(&self) -> f64 {
        self.clock.elapsed().as_secs_f64() * 1000.0
    }
}

/// Holds a request's place in the scheduler (slot or queue position) and
/// gives it back however the handler exits: done, error, or client gone.
struct Slot<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.shared.lock().engine.scheduler.finish(self.id);
        self.shared.wake.notify_all();
    }
}

pub struct Server {
    listener: TcpListener,
    shared: Arc<Shared>,
}

impl Server {
    pub fn bind(config: Config) -> io::Result<Server> {
        let listener = TcpListener::bind(config.listen.as_str())?;
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
        };
        let shared = Shared {
            config,
            clock: Instant::now(),
            started_unix: unix_secs(),
            next_id: AtomicU64::new(1),
            state: Mutex::new(state),
            wake: Condvar::new(),
        };
        Ok(Server {
            listener,
            shared: Arc::new(shared),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves forever.
    pub fn run(self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let shared = Arc::clone(&self.shared);
                    // If no thread can be spawned the connection is dropped:
                    // the client sees a reset and can retry elsewhere.
                    let _ = thread::Builder::new()
                        .name("emulator-conn".to_string())
                        .spawn(move || serve_connection(&shared, stream));
                }
                // Typically EMFILE: back off instead of spinning.
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

fn serve_connection(shared: &Shared, stream: TcpStream) {
    // SSE events must leave as soon as they are written.
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    while serve_one(shared, &mut reader, &stream) {}
}

/// Serves one request; returns whether the connection stays open.
fn serve_one(shared: &Shared, reader: &mut BufReader<TcpStream>, stream: &TcpStream) -> bool {
    let head = match http::read_head(reader) {
        Ok(h) => h,
        Err(e) => {
            reject(stream, &e, Vec::new());
            return false;
        }
    };
    let route = Route::of(head.path());
    {
        let mut st = shared.lock();
        let n = st.requests.entry(route.path()).or_insert(0);
        *n = n.saturating_add(1);
    }
    let echo = echo_headers(&shared.config, &head);

    // Refuse an oversized upload before inviting the client to send it.
    if let BodyKind::Length(n) = head.body {
        if n > MAX_BODY_BYTES {
            reject(stream, &ReadError::BodyTooLarge, echo);
            return false;
        }
    }
    if head.expects_continue() {
        let mut w = stream;
        if w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err() {
            return false;
        }
    }
    let body = match http::read_body(reader, head.body, MAX_BODY_BYTES) {
        Ok(b) => b,
        Err(e) => {
            reject(stream, &e, echo);
            return false;
        }
    };

    let mut reply = Reply {
        stream,
        keep_alive: head.keep_alive(),
        http10: head.minor_version == 0,
        framing: Framing::Length(0),
        echo,
    };
    if !route.is_admin() {
        let delay = shared.lock().network_delay_ms;
        thread::sleep(ms_duration(delay));
    }
    let ok = dispatch(shared, route, &head, &body, &mut reply).is_ok();
    ok && reply.keep_alive
}

/// Answers a request that could not be read, then closes gracefully.
fn reject(stream: &TcpStream, e: &ReadError, echo: Vec<(String, String)>) {
    let Some(status) = e.status() else {
        return;
    };
    let mut reply = Reply {
        stream,
        keep_alive: false,
        http10: false,
        framing: Framing::Length(0),
        echo,
    };
    if reply.error(status, &e.message(), INVALID).is_err() {
        return;
    }
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(LINGER));
    let deadline = Instant::now() + LINGER;
    let mut drained = 0usize;
    let mut buf = [0u8; 8192];
    let mut r = stream;
    while drained < LINGER_MAX_BYTES && Instant::now() < deadline {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained = drained.saturating_add(n),
        }
    }
}

/// `x-echo-NAME` response headers for the configured names: lets tests see
/// what Envoy actually forwarded.
fn echo_headers(config: &Config, head: &Head) -> Vec<(String, String)> {
    config
        .echo_headers
        .iter()
        .map(|name| {
            let values: Vec<&str> = head.header_values(name).collect();
            let value = if values.is_empty() {
                "-".to_string()
            } else {
                values.join(", ")
            };
            (format!("x-echo-{name}"), value)
        })
        .collect()
}

/// Response writer for one exchange; remembers the framing it announced.
struct Reply<'a> {
    stream: &'a TcpStream,
    keep_alive: bool,
    http10: bool,
    framing: Framing,
    echo: Vec<(String, String)>,
}

impl Reply<'_> {
    fn headers(&self, content_type: &str, extra: Vec<(String, String)>) -> Vec<(String, String)> {
        let mut h = vec![("content-type".to_string(), content_type.to_string())];
        h.extend(extra);
        h.extend(self.echo.iter().cloned());
        h
    }

    fn send(
        &mut self,
        status: u16,
        content_type: &str,
        extra: Vec<(String, String)>,
        body: &[u8],
    ) -> io::Result<()> {
        let headers = self.headers(content_type, extra);
        let mut w = self.stream;
        http::write_response(&mut w, status, &headers, body, self.keep_alive)
    }

    fn json(&mut self, status: u16, body: &[u8]) -> io::Result<()> {
        self.send(status, JSON, Vec::new(), body)
    }

    fn error(&mut self, status: u16, message: &str, kind: &str) -> io::Result<()> {
        self.json(status, &openai::error_body(message, kind))
    }

    /// Writes only the head; the body follows via `body_part`.
    fn head(
        &mut self,
        status: u16,
        content_type: &str,
        extra: Vec<(String, String)>,
        framing: Framing,
    ) -> io::Result<()> {
        if framing == Framing::UntilClose {
            self.keep_alive = false;
        }
        self.framing = framing;
        let bytes = http::head_bytes(
            status,
            &self.headers(content_type, extra),
            framing,
            self.keep_alive,
        );
        let mut w = self.stream;
        w.write_all(&bytes)?;
        w.flush()
    }

    fn body_part(&mut self, data: &[u8]) -> io::Result<()> {
        let mut w = self.stream;
        match self.framing {
            Framing::Chunked => http::write_chunk(&mut w, data),
            _ => {
                w.write_all(data)?;
                w.flush()
            }
        }
    }

    fn end_body(&mut self) -> io::Result<()> {
        match self.framing {
            Framing::Chunked => {
                let mut w = self.stream;
                http::write_last_chunk(&mut w)
            }
            _ => Ok(()),
        }
    }
}

fn dispatch(
    shared: &Shared,
    route: Route,
    head: &Head,
    body: &[u8],
    reply: &mut Reply,
) -> io::Result<()> {
    if route == Route::NotFound {
        let msg = format!("no route for {} {}", head.method, head.path());
        return reply.error(404, &msg, INVALID);
    }
    if !route.methods().contains(&head.method.as_str()) {
        let allow = vec![("allow".to_string(), route.methods().join(", "))];
        let body = openai::error_body(
            &format!("method {} not allowed on {}", head.method, route.path()),
            INVALID,
        );
        return reply.send(405, JSON, allow, &body);
    }
    let inference_route = matches!(route, Route::Chat | Route::Completions);
    let probe_route = matches!(route, Route::Health | Route::Metrics);
    let hung =
        |st: &State| (inference_route && st.hang_inference) || (probe_route && st.hang_probes);
    let fail_status = {
        let mut st = shared.lock();
        while hung(&st) {
            st = shared.wait(st, WATCH_SLICE);
            if !peer_connected(reply.stream) {
                return Err(aborted());
            }
        }
        st.fail_status
    };
    if inference_route && fail_status != 0 {
        let name = vec![("x-engine-replica".to_string(), shared.config.name.clone())];
        let body = openai::error_body("injected failure (admin fail_status)", "server_error");
        return reply.send(fail_status, JSON, name, &body);
    }
    match route {
        Route::Chat => inference(shared, Kind::Chat, body, reply),
        Route::Completions => inference(shared, Kind::Completion, body, reply),
        Route::Health => health(shared, reply),
        Route::Models => {
            let owner = shared.config.mode.as_str();
            reply.json(
                200,
                &openai::model_list(&shared.config.model, owner, shared.started_unix),
            )
        }
        Route::Metrics => metrics_page(shared, reply),
        Route::AdminStats => admin_stats(shared, reply),
        Route::AdminState if head.method == "GET" => admin_state(shared, b"", reply),
        Route::AdminState => admin_state(shared, body, reply),
        Route::AdminReset => {
            {
                let mut st = shared.lock();
                st.engine.reset();
                st.requests.clear();
            }
            reply.json(200, br#"{"status":"reset"}"#)
        }
        Route::NotFound => reply.error(404, "not found", INVALID),
    }
}

fn health(shared: &Shared, reply: &mut Reply) -> io::Result<()> {
    let healthy = shared.lock().healthy;
    let digest = vec![(
        "x-release-digest".to_string(),
        shared.config.release.clone(),
    )];
    if healthy {
        reply.send(200, JSON, digest, br#"{"status":"ok"}"#)
    } else {
        reply.send(503, JSON, digest, br#"{"status":"unhealthy"}"#)
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

fn metrics_page(shared: &Shared, reply: &mut Reply) -> io::Result<()> {
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
                requests: request_counts(&st),
            };
            metrics::render(cfg.mode, &cfg.model, &cfg.release, &snapshot)
        }
    };
    reply.send(200, metrics::CONTENT_TYPE, Vec::new(), text.as_bytes())
}

fn admin_stats(shared: &Shared, reply: &mut Reply) -> io::Result<()> {
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
        })
    };
    reply.json(200, body.to_string().as_bytes())
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

fn admin_state(shared: &Shared, body: &[u8], reply: &mut Reply) -> io::Result<()> {
    let patch = if body.iter().all(u8::is_ascii_whitespace) {
        StatePatch::default()
    } else {
        match serde_json::from_slice::<StatePatch>(body) {
            Ok(p) => p,
            Err(e) => return reply.error(400, &format!("bad state: {e}"), INVALID),
        }
    };
    if let Some(d) = patch.network_delay_ms {
        if !(d.is_finite() && (0.0..=MAX_MS).contains(&d)) {
            return reply.error(
                400,
                "network_delay_ms must be a number of milliseconds >= 0",
                INVALID,
            );
        }
    }
    if let Some(f) = patch.fail_status {
        if f != 0 && !(400..=599).contains(&f) {
            return reply.error(400, "fail_status must be 0 (off) or 400..=599", INVALID);
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
        shared.wake.notify_all();
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
            shared.wake.notify_all();
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
    reply.json(200, body.to_string().as_bytes())
}

fn aborted() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "client went away")
}

/// One inference request: admission (FIFO), prefill, then the response,
/// timed so the client sees queue + prefill before the first byte and
/// decode pacing after it.
fn inference(shared: &Shared, kind: Kind, body: &[u8], reply: &mut Reply) -> io::Result<()> {
    if !shared.lock().healthy {
        return reply.error(503, "replica is unhealthy", "service_unavailable");
    }
    let req = match openai::parse_request(kind, body) {
        Ok(r) => r,
        Err(msg) => return reply.error(400, &msg, INVALID),
    };
    let block_tokens = shared.config.engine().block_tokens;
    let prompt = Prompt::from_text(&req.prompt_text, block_tokens);

    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let arrived = Instant::now();
    let _slot = Slot { shared, id };
    let plan = {
        let mut st = shared.lock();
        st.engine.scheduler.arrive(id);
        while !st.engine.scheduler.is_running(id) {
            st = shared.wait(st, WATCH_SLICE);
            if !peer_connected(reply.stream) {
                drop(st);
                return Err(aborted());
            }
        }
        let now = shared.now_ms();
        st.engine.admit(&prompt, now)
    };
    let queue_ms = arrived.elapsed().as_secs_f64() * 1000.0;

    if !sleep_watching(reply.stream, plan.prefill_ms) {
        return Err(aborted());
    }

    let cfg = &shared.config;
    let engine_headers = vec![
        ("x-engine-replica".to_string(), cfg.name.clone()),
        (
            "x-engine-cached-tokens".to_string(),
            plan.cached_tokens.to_string(),
        ),
        (
            "x-engine-prompt-tokens".to_string(),
            plan.prompt_tokens.to_string(),
        ),
        (
            "x-engine-queue-ms".to_string(),
            format!("{}", queue_ms.round() as u64),
        ),
    ];
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
        completion_tokens: req.max_tokens,
        cached_tokens: plan.cached_tokens,
    };
    let decode_ms_per_token = shared.lock().engine.timing.decode_ms_per_token;

    if req.stream {
        let framing = if reply.http10 {
            Framing::UntilClose
        } else {
            Framing::Chunked
        };
        let mut headers = engine_headers;
        headers.push(("cache-control".to_string(), "no-cache".to_string()));
        reply.head(200, "text/event-stream", headers, framing)?;
        stream_tokens(reply, kind, &meta, req.max_tokens, decode_ms_per_token)?;
        let mut tail = Vec::new();
        if req.include_usage {
            tail.extend(openai::usage_chunk(kind, &meta, usage));
        }
        tail.extend_from_slice(openai::SSE_DONE);
        reply.body_part(&tail)?;
        reply.end_body()?;
    } else {
        let text = openai::output_text(req.max_tokens);
        let body = openai::full_response(kind, &meta, &text, usage);
        reply.head(200, JSON, engine_headers, Framing::Length(body.len()))?;
        if !sleep_watching(reply.stream, decode_ms_per_token * req.max_tokens as f64) {
            return Err(aborted());
        }
        reply.body_part(&body)?;
    }
    shared.lock().engine.record_success();
    Ok(())
}

/// Emits one SSE event per output token: the first right away (prefill
/// produced it), token i at i × decode_ms_per_token after that. Events that
/// fall due together (sub-millisecond decode) share one write.
fn stream_tokens(
    reply: &mut Reply,
    kind: Kind,
    meta: &ResponseMeta,
    tokens: usize,
    per_token_ms: f64,
) -> io::Result<()> {
    let start = Instant::now();
    let mut sent = 0usize;
    while sent < tokens {
        let elapsed_ms = start.elapsed().as_secs_f64() * 1000.0;
        let due = if per_token_ms > 0.0 {
            ((elapsed_ms / per_token_ms).floor() as usize)
                .saturating_add(1)
                .min(tokens)
        } else {
            tokens
        };
        if due <= sent {
            let next_at_ms = sent as f64 * per_token_ms;
            // At least 1 ms so fast decode batches instead of busy-looping.
            let wait = (next_at_ms - elapsed_ms).max(1.0);
            if !sleep_watching(reply.stream, wait) {
                return Err(aborted());
            }
            continue;
        }
        let mut events = Vec::new();
        for i in sent..due {
            let text = openai::token_text(i);
            events.extend(openai::stream_chunk(
                kind,
                meta,
                &text,
                i == 0,
                i + 1 == tokens,
            ));
        }
        reply.body_part(&events)?;
        sent = due;
    }
    Ok(())
}

/// Whether the peer is still connected: a readable EOF means it closed.
/// Pipelined bytes waiting to be read count as connected.
fn peer_connected(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut probe = [0u8; 1];
    let result = stream.peek(&mut probe);
    let _ = stream.set_nonblocking(false);
    match result {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ),
    }
}

/// Sleeps `ms`, checking every few ms that the client is still there, so a
/// disconnect frees the slot promptly. Returns false if the client left.
fn sleep_watching(stream: &TcpStream, ms: f64) -> bool {
    let deadline = Instant::now() + ms_duration(ms);
    loop {
        if !peer_connected(stream) {
            return false;
        }
        let now = Instant::now();
        if now >= deadline {
            return true;
        }
        thread::sleep((deadline - now).min(WATCH_SLICE));
    }
}

/// Milliseconds to a `Duration`, treating NaN/negative as zero and capping
/// at a day so arithmetic on `Instant` cannot overflow.
fn ms_duration(ms: f64) -> Duration {
    if ms.is_finite() && ms > 0.0 {
        Duration::from_secs_f64(ms.min(MAX_MS) / 1000.0)
    } else {
        Duration::ZERO
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
