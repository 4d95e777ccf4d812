//! End-to-end tests of the `engine-emulator` binary over real sockets, with
//! a std-only HTTP/1.1 client: prefix-cache hits, metrics, SSE, admin
//! controls, error handling, cancellation by disconnect, per-client-region
//! delays and CLI behaviour.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_engine-emulator");

/// A running emulator process, killed on drop.
struct Emulator {
    child: Child,
    addr: String,
}

impl Emulator {
    fn start(args: &[&str]) -> Emulator {
        let mut child = Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().rsplit(' ').next().unwrap().to_string();
        assert!(
            line.starts_with("engine-emulator ") && line.contains(" listening on 127.0.0.1:"),
            "{line}"
        );
        Emulator { child, addr }
    }

    fn connect(&self) -> Client {
        let stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Minimal keep-alive HTTP/1.1 client.
struct Client {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Client {
    fn send_raw(&mut self, raw: &[u8]) {
        self.stream.write_all(raw).unwrap();
    }

    fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Response {
        let mut raw = format!(
            "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-length: {}\r\n",
            body.len()
        );
        for (n, v) in headers {
            raw.push_str(&format!("{n}: {v}\r\n"));
        }
        raw.push_str("\r\n");
        let mut raw = raw.into_bytes();
        raw.extend_from_slice(body);
        self.send_raw(&raw);
        self.read_response()
    }

    fn post_json(&mut self, path: &str, body: &Value) -> Response {
        self.request(
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line.trim_end_matches(['\r', '\n']).to_string()
    }

    fn read_response(&mut self) -> Response {
        let status_line = self.line();
        let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let line = self.line();
            if line.is_empty() {
                break;
            }
            let (n, v) = line.split_once(':').unwrap();
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let mut body = Vec::new();
        if get("transfer-encoding").as_deref() == Some("chunked") {
            loop {
                let size = usize::from_str_radix(&self.line(), 16).unwrap();
                if size == 0 {
                    assert_eq!(self.line(), "");
                    break;
                }
                let mut chunk = vec![0; size];
                self.reader.read_exact(&mut chunk).unwrap();
                body.extend(chunk);
                assert_eq!(self.line(), "");
            }
        } else if let Some(len) = get("content-length") {
            body.resize(len.parse().unwrap(), 0);
            self.reader.read_exact(&mut body).unwrap();
        } else {
            self.reader.read_to_end(&mut body).unwrap();
        }
        Response {
            status,
            headers,
            body,
        }
    }

    /// True when the server closed the connection.
    fn is_closed(&mut self) -> bool {
        let mut buf = [0u8; 1];
        matches!(self.reader.read(&mut buf), Ok(0) | Err(_))
    }

    /// No byte of an answer has arrived within `wait`, and the connection
    /// is still open: the request is pending.
    fn is_pending(&mut self, wait: Duration) -> bool {
        self.stream.set_read_timeout(Some(wait)).unwrap();
        let pending = match self.reader.fill_buf() {
            Ok(_) => false,
            Err(e) => matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        };
        self.stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        pending
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "m1", "messages": [{"role": "user", "content": content}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A long prompt whose canonical text is not a whole number of blocks.
fn long_prompt() -> String {
    (0..120).map(|i| format!("w{i:03} ")).collect::<String>() + "end?"
}

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[test]
fn prefix_cache_metrics_and_streaming() {
    let emu = Emulator::start(&[
        "--name",
        "r1",
        "--model",
        "m1",
        "--cache-tokens",
        "100000",
        "--prefill-ms-per-token",
        "0.5",
        "--decode-ms-per-token",
        "0.2",
        "--echo-header",
        "x-request-id",
        "--echo-header",
        "x-missing",
        "--enable-prompt-tokens-details",
    ]);
    let content = long_prompt();
    // The engine's own tokens: o200k_base over the Llama-3-style template.
    let prompt_tokens =
        engine_emulator::tokenizer::chat(&json!([{"role": "user", "content": content}]))
            .unwrap()
            .len();
    assert_ne!(prompt_tokens % 16, 0);
    let full_blocks = prompt_tokens / 16;

    // Both requests on one keep-alive connection.
    let mut c = emu.connect();
    let body = chat(&content, json!({"max_tokens": 3}));
    let t0 = Instant::now();
    let first = c.request(
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "abc")],
        body.to_string().as_bytes(),
    );
    let first_ms = t0.elapsed().as_millis();
    let t1 = Instant::now();
    let second = c.request(
        "POST",
        "/v1/chat/completions",
        &[("x-request-id", "def")],
        body.to_string().as_bytes(),
    );
    let second_ms = t1.elapsed().as_millis();

    assert_eq!((first.status, second.status), (200, 200));
    assert_eq!(first.header("x-engine-replica"), Some("r1"));
    assert_eq!(first.header("x-engine-cached-tokens"), Some("0"));
    assert_eq!(
        first.header("x-engine-prompt-tokens"),
        Some(prompt_tokens.to_string().as_str())
    );
    assert_eq!(first.header("x-echo-x-request-id"), Some("abc"));
    assert_eq!(first.header("x-echo-x-missing"), Some("-"));
    assert_eq!(second.header("x-echo-x-request-id"), Some("def"));
    let cached: usize = second
        .header("x-engine-cached-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!(cached > 0);
    assert_eq!(cached, full_blocks * 16);
    assert!(second
        .header("x-engine-queue-ms")
        .unwrap()
        .parse::<u64>()
        .is_ok());
    // Prefill of ~prompt_tokens × 0.5 ms vs. only the uncached tail.
    assert!(
        first_ms as f64 >= prompt_tokens as f64 * 0.5 * 0.9,
        "{first_ms} ms"
    );
    assert!(second_ms < first_ms, "{second_ms} >= {first_ms}");

    let v = second.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m1");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 3);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], cached);

    let m = c.request("GET", "/metrics", &[], b"");
    assert_eq!(m.status, 200);
    assert!(m
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = m.text();
    // Nothing is running: cached blocks nobody holds count as free, as in
    // vLLM's kv_cache_usage_perc.
    let usage = "0.0";
    for line in [
        "# TYPE vllm:num_requests_running gauge".to_string(),
        "vllm:num_requests_running{model_name=\"m1\"} 0.0".to_string(),
        "vllm:num_requests_waiting{model_name=\"m1\"} 0.0".to_string(),
        format!("vllm:kv_cache_usage_perc{{model_name=\"m1\"}} {usage}"),
        "# TYPE vllm:prefix_cache_queries_total counter".to_string(),
        format!(
            "vllm:prefix_cache_queries_total{{model_name=\"m1\"}} {}.0",
            2 * prompt_tokens
        ),
        format!("vllm:prefix_cache_hits_total{{model_name=\"m1\"}} {cached}.0"),
        "vllm:request_success_total{model_name=\"m1\"} 2.0".to_string(),
        "vllm:release_info{model_name=\"m1\",digest=\"sha256:release-a\"} 1".to_string(),
        "emulator_http_requests_total{path=\"/v1/chat/completions\"} 2.0".to_string(),
        "emulator_http_requests_total{path=\"/metrics\"} 1.0".to_string(),
        "emulator_http_requests_total{path=\"/health\"} 0.0".to_string(),
        "emulator_http_requests_total{path=\"/v1/completions\"} 0.0".to_string(),
    ] {
        assert!(has_line(&text, &line), "missing {line:?} in\n{text}");
    }

    // Streaming: one event per token, usage chunk, then [DONE].
    let s = c.post_json(
        "/v1/chat/completions",
        &chat(
            &content,
            json!({"stream": true, "max_tokens": 5, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(s.status, 200);
    assert_eq!(s.header("content-type"), Some("text/event-stream"));
    assert_eq!(
        s.header("x-engine-cached-tokens"),
        Some(cached.to_string().as_str())
    );
    let text = s.text();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 5 + 1 + 1);
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
    assert_eq!(
        chunks[5]["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached
    );

    // Completions endpoint on the same connection, non-streaming and streaming.
    let r = c.post_json(
        "/v1/completions",
        &json!({"model": "m1", "prompt": content, "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["object"], "text_completion");
    let r = c.post_json("/v1/completions", &json!({"prompt": "hi", "stream": true}));
    assert!(r.text().ends_with("data: [DONE]\n\n"));
    assert_eq!(
        r.text().matches("\"object\":\"text_completion\"").count(),
        16
    );

    let stats = c.request("GET", "/admin/stats", &[], b"").json();
    assert_eq!(stats["name"], "r1");
    assert_eq!(stats["requests"]["/v1/chat/completions"], 3);
    assert_eq!(stats["requests"]["/v1/completions"], 2);
    assert_eq!(stats["completed"], 5);
    assert_eq!(
        (stats["running"].as_u64(), stats["waiting"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(stats["cache_hit_tokens"].as_u64().unwrap() >= 2 * cached as u64);

    let models = c.request("GET", "/v1/models", &[], b"").json();
    assert_eq!(models["data"][0]["id"], "m1");
    let health = c.request("GET", "/health", &[], b"");
    assert_eq!(
        (health.status, health.header("x-release-digest")),
        (200, Some("sha256:release-a"))
    );
    assert_eq!(health.json()["status"], "ok");
}

#[test]
fn errors_and_admin_controls() {
    let emu = Emulator::start(&["--prefill-ms-per-token", "0", "--decode-ms-per-token", "0"]);
    let mut c = emu.connect();

    let r = c.request("GET", "/nope", &[], b"");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = c.request("GET", "/v1/chat/completions", &[], b"");
    assert_eq!((r.status, r.header("allow")), (405, Some("POST")));
    let r = c.request("POST", "/v1/chat/completions", &[], b"{oops");
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON"));
    assert!(r.json()["error"]["param"].is_null());

    // Chunked request body, still on the same connection.
    let body = chat("chunked hello", json!({})).to_string();
    let (a, b) = body.split_at(10);
    let raw = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    c.send_raw(raw.as_bytes());
    let r = c.read_response();
    assert_eq!(r.status, 200);
    let expect =
        engine_emulator::tokenizer::chat(&json!([{"role": "user", "content": "chunked hello"}]))
            .unwrap()
            .len()
            .to_string();
    assert_eq!(r.header("x-engine-prompt-tokens"), Some(expect.as_str()));

    // Health toggles, inference follows; garbage metrics; reset.
    let s = c.post_json(
        "/admin/state",
        &json!({"healthy": false, "garbage_metrics": true}),
    );
    assert_eq!(
        s.json(),
        json!({"healthy": false, "network_delay_ms": 0.0, "garbage_metrics": true, "paused": false,
               "fail_status": 0, "hang_probes": false, "hang_inference": false})
    );
    assert_eq!(c.request("GET", "/health", &[], b"").status, 503);
    let r = c.post_json("/v1/chat/completions", &chat("x", json!({})));
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"].is_string());
    let m = c.request("GET", "/metrics", &[], b"").text();
    assert!(!m.contains("vllm:") && !m.contains("# TYPE"));
    assert_eq!(
        c.post_json("/admin/state", &json!({"bogus": 1})).status,
        400
    );
    assert_eq!(
        c.post_json("/admin/state", &json!({"network_delay_ms": -1}))
            .status,
        400
    );
    c.post_json(
        "/admin/state",
        &json!({"healthy": true, "garbage_metrics": false}),
    );
    assert_eq!(c.request("GET", "/health", &[], b"").status, 200);

    // Injected failures: inference answers the status at once, named by
    // the replica; probes are untouched; out-of-range statuses refused.
    c.post_json("/admin/state", &json!({"fail_status": 500}));
    let r = c.post_json("/v1/chat/completions", &chat("x", json!({})));
    assert_eq!(r.status, 500);
    assert!(r.header("x-engine-replica").is_some());
    assert_eq!(c.request("GET", "/health", &[], b"").status, 200);
    assert_eq!(
        c.post_json("/admin/state", &json!({"fail_status": 200}))
            .status,
        400
    );
    c.post_json("/admin/state", &json!({"fail_status": 0}));
    // Hung probes: no answer until the hang is lifted from another connection.
    c.post_json("/admin/state", &json!({"hang_probes": true}));
    let mut hung = emu.connect();
    hung.send_raw(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n");
    // Still unanswered after 300 ms, while inference is served.
    assert!(hung.is_pending(Duration::from_millis(300)));
    assert_eq!(
        c.post_json("/v1/chat/completions", &chat("y", json!({})))
            .status,
        200
    );
    assert!(hung.is_pending(Duration::from_millis(50)));
    c.post_json("/admin/state", &json!({"hang_probes": false}));
    assert_eq!(hung.read_response().status, 200);

    assert_eq!(c.request("POST", "/admin/reset", &[], b"").status, 200);
    let stats = c.request("GET", "/admin/stats", &[], b"").json();
    assert_eq!(
        (
            stats["completed"].as_u64(),
            stats["cache_query_tokens"].as_u64()
        ),
        (Some(0), Some(0))
    );
    assert_eq!(stats["requests"]["/admin/stats"], 1);

    // Oversized body: 413 before the body is sent, then close.
    let mut c2 = emu.connect();
    c2.send_raw(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 67108865\r\n\r\n");
    assert_eq!(c2.read_response().status, 413);
    assert!(c2.is_closed());

    // Malformed request line: 400 and close.
    let mut c3 = emu.connect();
    c3.send_raw(b"THIS IS NOT HTTP\r\n\r\n");
    let r = c3.read_response();
    assert_eq!(r.status, 400);
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c3.is_closed());

    // The server survived all of that.
    assert_eq!(
        emu.connect().request("GET", "/health", &[], b"").status,
        200
    );
}

#[test]
fn paused_engine_queues_requests_fifo() {
    let emu = Emulator::start(&[
        "--max-concurrency",
        "1",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-token",
        "1",
    ]);
    let mut admin = emu.connect();
    admin.post_json("/admin/state", &json!({"paused": true}));
    let addr = emu.addr.clone();
    let waiter = thread::spawn(move || {
        let stream = TcpStream::connect(addr).unwrap();
        let mut c = Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        };
        c.post_json(
            "/v1/chat/completions",
            &chat("queued", json!({"max_tokens": 1})),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = admin.request("GET", "/metrics", &[], b"").text();
        if has_line(
            &m,
            "vllm:num_requests_waiting{model_name=\"emulated-model\"} 1.0",
        ) {
            break;
        }
        assert!(Instant::now() < deadline, "request never queued:\n{m}");
        thread::sleep(Duration::from_millis(20));
    }
    thread::sleep(Duration::from_millis(100));
    admin.post_json("/admin/state", &json!({"paused": false}));
    let r = waiter.join().unwrap();
    assert_eq!(r.status, 200);
    let queued: u64 = r.header("x-engine-queue-ms").unwrap().parse().unwrap();
    assert!(queued >= 100, "queue-ms {queued}");
    // The slot is released once the response is written: poll briefly.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let stats = admin.request("GET", "/admin/stats", &[], b"").json();
        let counts = (stats["running"].as_u64(), stats["waiting"].as_u64());
        if counts == (Some(0), Some(0)) {
            break;
        }
        assert!(Instant::now() < deadline, "slots not released: {counts:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sglang_mode_and_network_delay() {
    let emu = Emulator::start(&[
        "--mode",
        "sglang",
        "--model",
        "sg",
        "--network-delay-ms",
        "150",
        "--release",
        "sha256:b",
    ]);
    let mut c = emu.connect();
    let t = Instant::now();
    let h = c.request("GET", "/health", &[], b"");
    assert!(t.elapsed() >= Duration::from_millis(150));
    assert_eq!(h.header("x-release-digest"), Some("sha256:b"));
    let text = c.request("GET", "/metrics", &[], b"").text();
    for line in [
        "sglang:num_queue_reqs{model_name=\"sg\"} 0.0",
        "sglang:num_running_reqs{model_name=\"sg\"} 0.0",
        "sglang:token_usage{model_name=\"sg\"} 0.0",
        "sglang:cache_hit_rate{model_name=\"sg\"} 0.0",
        "sglang:release_info{model_name=\"sg\",digest=\"sha256:b\"} 1",
        "emulator_http_requests_total{path=\"/health\"} 1.0",
    ] {
        assert!(has_line(&text, line), "missing {line:?} in\n{text}");
    }
    assert!(!text.contains("vllm:"));
    // Admin endpoints are not delayed; the delay is adjustable at runtime.
    let t = Instant::now();
    c.post_json("/admin/state", &json!({"network_delay_ms": 0}));
    assert!(t.elapsed() < Duration::from_millis(150));
    let t = Instant::now();
    c.request("GET", "/health", &[], b"");
    assert!(t.elapsed() < Duration::from_millis(150));
}

/// Reads an SSE body's `data:` events (JSON ones only).
fn sse_events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

#[test]
fn context_limit_usage_reports_and_radix_matching() {
    // vLLM dialect: 400 in vLLM's words past --max-model-len, the limit in
    // /v1/models, cached_tokens omitted when nothing hit, the usage chunk
    // forced into every stream.
    let emu = Emulator::start(&[
        "--max-model-len",
        "64",
        "--enable-prompt-tokens-details",
        "--force-include-usage",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-token",
        "0",
    ]);
    let mut c = emu.connect();
    let m = c.request("GET", "/v1/models", &[], b"").json();
    assert_eq!(m["data"][0]["max_model_len"], 64);
    let long = "many different words here ".repeat(20);
    let r = c.post_json("/v1/chat/completions", &chat(&long, json!({})));
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["type"], "BadRequestError");
    assert_eq!(e["error"]["code"], 400);
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "This model's maximum context length is 64 tokens. However, your request has "
        ),
        "{msg}"
    );
    let r = c.post_json(
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 60})),
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("'max_tokens' or 'max_completion_tokens' is too large: 60."));
    let r = c.post_json(
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 2})),
    );
    assert_eq!(r.status, 200);
    let u = &r.json()["usage"];
    assert!(
        u.get("prompt_tokens_details").is_none(),
        "omitted when 0: {u}"
    );
    // Streamed without asking for usage: forced, in the last event only.
    let r = c.post_json(
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 3, "stream": true})),
    );
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 4);
    assert!(events[..3].iter().all(|e| e.get("usage").is_none()));
    assert_eq!(events[3]["choices"], json!([]));
    assert!(events[3]["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    drop(c);

    // SGLang dialect: its own words, cached_tokens always reported, and
    // matching at token granularity (a radix tree), not 16-token blocks.
    let emu = Emulator::start(&[
        "--mode",
        "sglang",
        "--max-model-len",
        "4096",
        "--enable-cache-report",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-token",
        "0",
    ]);
    let mut c = emu.connect();
    let base = long_prompt();
    let first = c.post_json("/v1/completions", &json!({"prompt": base, "max_tokens": 1}));
    assert_eq!(
        first.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let n = first.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let more = format!("{base} and then some more");
    let second = c.post_json("/v1/completions", &json!({"prompt": more, "max_tokens": 1}));
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Everything the two prompts share, to the token (the last token of the
    // first prompt may tokenize differently once text follows it).
    assert!(cached >= n - 2 && cached <= n, "{cached} of {n}");
    assert_ne!(cached % 16, 0, "token granularity, not blocks: {cached}");
    let r = c.post_json(
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 5000}),
    );
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["object"], "error");
    assert!(e["message"].as_str().unwrap().starts_with(
        "Requested token count exceeds the model's maximum context length of 4096 tokens."
    ));
}

#[test]
fn bad_flags_exit_2_with_clap_message() {
    for args in [
        &["--listen", "127.0.0.1:0", "--bogus"][..],
        &["--name", "x"],
        &["--listen", "127.0.0.1:0", "--mode", "tgi"],
        // Repeated flags are refused, not "last one wins".
        &["--listen", "127.0.0.1:0", "--listen", "127.0.0.1:0"],
        &[
            "--listen",
            "127.0.0.1:0",
            "--max-concurrency",
            "1",
            "--max-concurrency",
            "2",
        ],
        &[
            "--listen",
            "127.0.0.1:0",
            "--client-delay-ms",
            "eu=1",
            "--client-delay-ms",
            "eu=2",
        ],
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        // clap's message: what is wrong, and where help is.
        assert!(
            err.starts_with("error: ") && err.contains("'--help'"),
            "{err}"
        );
        assert!(out.stdout.is_empty());
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--client-delay-ms <REGION=MS>"), "{help}");
}

#[test]
fn client_region_delay_replaces_network_delay() {
    let emu = Emulator::start(&[
        "--network-delay-ms",
        "1500",
        "--client-region-header",
        "X-Region",
        "--client-delay-ms",
        "eu=0",
        "--client-delay-ms",
        "ap=150",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-token",
        "0",
    ]);
    let mut c = emu.connect();
    let timed = |c: &mut Client, method: &str, path: &str, region: Option<(&str, &str)>| {
        let headers: Vec<(&str, &str)> = region.into_iter().collect();
        let body = if method == "POST" {
            chat("region", json!({"max_tokens": 1})).to_string()
        } else {
            String::new()
        };
        let t = Instant::now();
        let r = c.request(method, path, &headers, body.as_bytes());
        assert_eq!(r.status, 200);
        t.elapsed()
    };
    let ms = Duration::from_millis;
    // Bounds far apart (a region's 150 ms against the 1500 ms network
    // delay): a busy machine adds latency, never removes it.
    // A configured region: its own delay, shorter or longer.
    assert!(timed(&mut c, "GET", "/health", Some(("x-region", "eu"))) < ms(1200));
    let ap = timed(&mut c, "GET", "/health", Some(("x-region", "ap")));
    assert!(ap >= ms(150) && ap < ms(1200), "{ap:?}");
    let ap = timed(
        &mut c,
        "POST",
        "/v1/chat/completions",
        Some(("x-region", "ap")),
    );
    assert!(ap >= ms(150) && ap < ms(1200), "{ap:?}");
    // No header, an unknown region, or the region under another header
    // name: --network-delay-ms.
    assert!(timed(&mut c, "GET", "/health", None) >= ms(1500));
    assert!(timed(&mut c, "GET", "/health", Some(("x-region", "us"))) >= ms(1500));
    assert!(timed(&mut c, "GET", "/health", Some(("x-client-region", "eu"))) >= ms(1500));
    // Admin endpoints are not delayed; changing the network delay at run
    // time leaves the regions' delays alone.
    c.post_json("/admin/state", &json!({"network_delay_ms": 0}));
    assert!(timed(&mut c, "GET", "/health", None) < ms(1200));
    let ap = timed(&mut c, "GET", "/health", Some(("x-region", "ap")));
    assert!(ap >= ms(150), "{ap:?}");
}

fn running_waiting(admin: &mut Client) -> (u64, u64) {
    let stats = admin.request("GET", "/admin/stats", &[], b"").json();
    (
        stats["running"].as_u64().unwrap(),
        stats["waiting"].as_u64().unwrap(),
    )
}

fn wait_for_counts(admin: &mut Client, want: (u64, u64)) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = running_waiting(admin);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "running/waiting {got:?}, want {want:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_client_that_goes_away_frees_its_slot_or_queue_place() {
    let emu = Emulator::start(&[
        "--max-concurrency",
        "1",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-token",
        "500",
    ]);
    let mut admin = emu.connect();
    let send = |body: Value| {
        let mut c = emu.connect();
        let raw = body.to_string();
        c.send_raw(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: {}\r\n\r\n{raw}",
                raw.len()
            )
            .as_bytes(),
        );
        c
    };
    // A slow stream takes the only slot; a second request waits behind it.
    let mut streaming = send(chat("long", json!({"stream": true, "max_tokens": 100})));
    assert!(streaming.line().starts_with("HTTP/1.1 200"));
    let queued = send(chat("queued", json!({"max_tokens": 1})));
    wait_for_counts(&mut admin, (1, 1));
    // The waiting client leaves: its queue place goes, the stream runs on.
    drop(queued);
    wait_for_counts(&mut admin, (1, 0));
    // The streaming client leaves mid-stream (between two tokens): the
    // slot is free again long before the 50 s of decode would be over.
    drop(streaming);
    wait_for_counts(&mut admin, (0, 0));
    // Same while the non-streaming answer's head is out and its body due.
    let mut whole = send(chat("whole", json!({"max_tokens": 100})));
    assert!(whole.line().starts_with("HTTP/1.1 200"));
    wait_for_counts(&mut admin, (1, 0));
    drop(whole);
    wait_for_counts(&mut admin, (0, 0));
    // And while hung before any answer.
    admin.post_json("/admin/state", &json!({"hang_inference": true}));
    let hung = send(chat("hung", json!({"max_tokens": 1})));
    thread::sleep(Duration::from_millis(100));
    drop(hung);
    admin.post_json("/admin/state", &json!({"hang_inference": false}));
    // Had it stayed, it would now run (one 500 ms token) and complete.
    thread::sleep(Duration::from_millis(800));
    wait_for_counts(&mut admin, (0, 0));
    let stats = admin.request("GET", "/admin/stats", &[], b"").json();
    assert_eq!(stats["completed"], 0);
    // The replica still serves.
    let r = admin.post_json(
        "/v1/chat/completions",
        &chat("after", json!({"max_tokens": 1})),
    );
    assert_eq!(r.status, 200);
}
