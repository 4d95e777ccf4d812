//! `/metrics` exposition: renders a snapshot of the replica in Prometheus
//! text format 0.0.4 with vLLM's or SGLang's metric names, and produces the
//! deliberately unparseable body used to test the router's scrape hardening.

use std::fmt::Write as _;

use crate::config::Mode;

/// What vLLM 0.32's prometheus_client sends (text format 1.0.0).
pub const CONTENT_TYPE: &str = "text/plain; version=1.0.0; charset=utf-8";
/// What SGLang's sends.
pub const CONTENT_TYPE_SGLANG: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The content type of `/metrics` in `mode`.
pub fn content_type(mode: Mode) -> &'static str {
    match mode {
        Mode::Vllm => CONTENT_TYPE,
        Mode::Sglang => CONTENT_TYPE_SGLANG,
    }
}

/// vLLM's finish reasons, one `request_success_total` series each.
const FINISHED_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];

/// Everything `/metrics` reports, captured under one lock so the numbers are
/// mutually consistent.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    /// Cached tokens / capacity, 0..1.
    pub cache_usage: f64,
    pub query_tokens: u64,
    pub hit_tokens: u64,
    pub completed: u64,
    /// Output tokens generated (`generation_tokens_total`).
    pub generated: u64,
    /// The prefix cache's capacity, in tokens (whole blocks).
    pub capacity_tokens: usize,
    /// Tokens per cache block (vLLM's `block_size`).
    pub block_tokens: usize,
    /// The context limit (vLLM's `kv_cache_max_concurrency` is the cache
    /// in contexts of this length).
    pub max_model_len: usize,
    /// Requests received per path.
    pub requests: Vec<(String, u64)>,
    /// When the serving process started (Unix s).
    pub process_start_s: f64,
}

/// Label value escaping per the text format: backslash, quote, newline.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Formats like Python's prometheus_client (which both engines use): floats
/// always carry a decimal point, so 3 is written "3.0".
fn value(v: f64) -> String {
    let s = format!("{v}");
    if s.contains(['.', 'e', 'E', 'N', 'n']) {
        s
    } else {
        format!("{s}.0")
    }
}

struct Out {
    text: String,
    /// Every series' labels (vLLM: `engine="0",model_name=...`).
    labels: String,
    /// `model_name="..."` alone.
    model_label: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, v: f64) {
        let _ = writeln!(self.text, "{name}{{{}}} {}", self.labels, value(v));
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.family(name, "gauge", help);
        self.sample(name, v);
    }

    fn counter(&mut self, name: &str, help: &str, v: u64) {
        self.family(name, "counter", help);
        self.sample(name, v as f64);
    }

    /// vLLM's info gauge of its CacheConfig: every field a label (as
    /// vLLM 0.32 prints them, sorted, `engine` among them and no
    /// `model_name`), the value 1. The capacity is `num_gpu_blocks` blocks
    /// of `block_size` tokens, `kv_cache_size_tokens` in all; the memory is
    /// what the tiny model's 512 bytes a token would take.
    fn vllm_cache_config_info(&mut self, blocks: usize, block_size: usize, max_model_len: usize) {
        let name = "vllm:cache_config_info";
        self.family(name, "gauge", "Information of the LLMEngine CacheConfig");
        let tokens = blocks.saturating_mul(block_size);
        let bytes = tokens.saturating_mul(512);
        let concurrency = value(tokens as f64 / max_model_len.max(1) as f64);
        let _ = writeln!(
            self.text,
            "{name}{{_block_size_resolved=\"True\",block_size=\"{block_size}\",cache_dtype=\"auto\",\
             cache_hit_alignment_tokens=\"None\",effective_attention_block_size=\"{block_size}\",\
             enable_mamba_shared_prefix_checkpoint=\"False\",enable_prefix_caching=\"True\",engine=\"0\",\
             gpu_memory_utilization=\"0.92\",hash_block_size=\"None\",is_attention_free=\"False\",\
             kv_cache_dtype_skip_layers=\"[]\",kv_cache_layout=\"None\",kv_cache_max_concurrency=\"{concurrency}\",\
             kv_cache_memory_bytes=\"{bytes}\",kv_cache_size_tokens=\"{tokens}\",kv_offloading_backend=\"native\",\
             kv_offloading_size=\"None\",kv_sharing_fast_prefill=\"False\",mamba_block_size=\"None\",\
             mamba_cache_dtype=\"auto\",mamba_cache_mode=\"none\",mamba_page_size_padded=\"None\",\
             mamba_ssm_cache_dtype=\"float32\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{blocks}\",\
             num_gpu_blocks_override=\"None\",prefix_cache_retention_interval=\"0\",\
             prefix_caching_hash_algo=\"sha256\",prefix_match_unit=\"None\",replayssm_buffer_len=\"16\",\
             skip_page_size_padded=\"None\",sliding_window=\"None\",swa_bounded_replay=\"True\",\
             use_kda_recoverssm=\"False\",use_replayssm=\"False\",user_specified_block_size=\"False\"}} 1.0"
        );
    }

    /// vLLM's `request_success_total`: one series per finish reason. Every
    /// emulated generation ends at its length limit.
    fn vllm_request_success(&mut self, completed: u64) {
        let name = "vllm:request_success_total";
        self.family(name, "counter", "Count of successfully processed requests.");
        for reason in FINISHED_REASONS {
            let n = if reason == "length" { completed } else { 0 };
            let _ = writeln!(
                self.text,
                "{name}{{engine=\"0\",finished_reason=\"{reason}\",{}}} {}",
                self.model_label,
                value(n as f64)
            );
        }
    }

    fn release_info(&mut self, name: &str, digest: &str) {
        self.family(
            name,
            "gauge",
            "Release of the engine build serving this replica.",
        );
        let _ = writeln!(
            self.text,
            "{name}{{{},digest=\"{}\"}} 1",
            self.model_label,
            escape(digest)
        );
    }
}

/// The page; `release` adds a `*:release_info` gauge carrying it (the
/// emulator's own, for release-parity tests: no engine has one).
pub fn render(mode: Mode, model: &str, release: Option<&str>, s: &Snapshot) -> String {
    let model_label = format!("model_name=\"{}\"", escape(model));
    let mut o = Out {
        text: String::new(),
        // vLLM 0.32 labels every series with its engine core's index.
        labels: match mode {
            Mode::Vllm => format!("engine=\"0\",{model_label}"),
            Mode::Sglang => model_label.clone(),
        },
        model_label,
    };
    match mode {
        Mode::Vllm => {
            // From Python's Prometheus client's default registry, which
            // vLLM serves (SGLang's multiprocess registry has none).
            o.family(
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
            );
            let _ = writeln!(
                o.text,
                "process_start_time_seconds {}",
                value(s.process_start_s)
            );
            o.gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                s.running as f64,
            );
            o.gauge(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                s.waiting as f64,
            );
            o.gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.cache_usage,
            );
            o.counter(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.query_tokens,
            );
            o.counter(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.hit_tokens,
            );
            // Every prompt token, cached or not (vLLM 0.32's
            // `prompt_tokens_total`; back to 0 at `/admin/reset`).
            o.counter(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                s.query_tokens,
            );
            o.counter(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                s.generated,
            );
            o.vllm_request_success(s.completed);
            let block = s.block_tokens.max(1);
            o.vllm_cache_config_info(s.capacity_tokens / block, block, s.max_model_len);
            if let Some(r) = release {
                o.release_info("vllm:release_info", r);
            }
        }
        Mode::Sglang => {
            o.gauge(
                "sglang:num_running_reqs",
                "The number of running requests.",
                s.running as f64,
            );
            o.gauge(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                s.waiting as f64,
            );
            o.gauge("sglang:token_usage", "The token usage.", s.cache_usage);
            let hit_rate = if s.query_tokens == 0 {
                0.0
            } else {
                s.hit_tokens as f64 / s.query_tokens as f64
            };
            o.gauge(
                "sglang:cache_hit_rate",
                "The prefix cache hit rate.",
                hit_rate,
            );
            // Every prompt token, cached or not: a counter only a restart
            // (`/admin/reset`) sends back, as the router watches it.
            o.counter(
                "sglang:prompt_tokens_total",
                "Number of prefill tokens processed.",
                s.query_tokens,
            );
            o.counter(
                "sglang:generation_tokens_total",
                "Number of generation tokens processed.",
                s.generated,
            );
            o.gauge(
                "sglang:page_size",
                "The page size of the KV cache.",
                s.block_tokens as f64,
            );
            // One series per tensor-parallel rank in SGLang; this replica
            // has one rank.
            let name = "sglang:max_total_num_tokens";
            o.family(
                name,
                "gauge",
                "Maximum total number of tokens in the KV cache pool.",
            );
            let _ = writeln!(
                o.text,
                "{name}{{engine_type=\"unified\",{},pp_rank=\"0\",tp_rank=\"0\"}} {}",
                o.labels,
                value(s.capacity_tokens as f64)
            );
            if let Some(r) = release {
                o.release_info("sglang:release_info", r);
            }
        }
    }
    o.family(
        "emulator_http_requests_total",
        "counter",
        "HTTP requests received by the emulator, per path.",
    );
    for (path, n) in &s.requests {
        let _ = writeln!(
            o.text,
            "emulator_http_requests_total{{path=\"{}\"}} {}",
            escape(path),
            value(*n as f64)
        );
    }
    o.text
}

/// Deterministic but random-looking junk that no Prometheus parser accepts:
/// every line starts with a character that cannot begin a metric name.
pub fn garbage(seed: u64) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789{}=\"#@%&*<>!~^";
    let mut out = String::new();
    let mut x = seed ^ 0x9e37_79b9_7f4a_7c15;
    for line in 0..24u64 {
        out.push(if line % 2 == 0 { '%' } else { '<' });
        for _ in 0..48 {
            // xorshift64*: cheap deterministic noise.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
            let i = usize::try_from(r >> 58).unwrap_or(0) % ALPHABET.len();
            out.push(ALPHABET.get(i).map(|&b| b as char).unwrap_or('?'));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Snapshot {
        Snapshot {
            running: 2,
            waiting: 1,
            cache_usage: 0.25,
            query_tokens: 400,
            hit_tokens: 100,
            completed: 7,
            generated: 90,
            capacity_tokens: 200_000,
            block_tokens: 16,
            max_model_len: 4096,
            requests: vec![("/health".into(), 3), ("/metrics".into(), 1)],
            process_start_s: 1796468503.92,
        }
    }

    #[test]
    fn vllm_names_and_values() {
        let t = render(Mode::Vllm, "m\"x", Some("sha256:a"), &snap());
        let m = "engine=\"0\",model_name=\"m\\\"x\"";
        for line in [
            "# TYPE vllm:num_requests_running gauge".to_string(),
            format!("vllm:num_requests_running{{{m}}} 2.0"),
            format!("vllm:num_requests_waiting{{{m}}} 1.0"),
            format!("vllm:kv_cache_usage_perc{{{m}}} 0.25"),
            "# TYPE vllm:prefix_cache_queries_total counter".to_string(),
            format!("vllm:prefix_cache_queries_total{{{m}}} 400.0"),
            format!("vllm:prefix_cache_hits_total{{{m}}} 100.0"),
            "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m\\\"x\"} 7.0".to_string(),
            "vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\\\"x\"} 0.0".to_string(),
            "vllm:release_info{model_name=\"m\\\"x\",digest=\"sha256:a\"} 1".to_string(),
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig".to_string(),
            "# TYPE vllm:cache_config_info gauge".to_string(),
            "emulator_http_requests_total{path=\"/health\"} 3.0".to_string(),
            "# TYPE process_start_time_seconds gauge".to_string(),
            "process_start_time_seconds 1796468503.92".to_string(),
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line}\n{t}");
        }
        let info = t
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .unwrap();
        for label in [
            "block_size=\"16\"",
            "num_gpu_blocks=\"12500\"",
            "kv_cache_size_tokens=\"200000\"",
            "kv_cache_max_concurrency=\"48.828125\"",
            "enable_prefix_caching=\"True\"",
            ",engine=\"0\",",
        ] {
            assert!(info.contains(label), "{label} missing from {info}");
        }
        assert!(!info.contains("model_name"));
        assert!(!t.contains("sglang:"));
        // No digest asked for: no release gauge (vLLM has none).
        let plain = render(Mode::Vllm, "m", None, &snap());
        assert!(!plain.contains("release_info"));
    }

    #[test]
    fn sglang_names_and_values() {
        let t = render(Mode::Sglang, "m", Some("d"), &snap());
        for line in [
            "sglang:num_running_reqs{model_name=\"m\"} 2.0",
            "sglang:num_queue_reqs{model_name=\"m\"} 1.0",
            "sglang:token_usage{model_name=\"m\"} 0.25",
            "sglang:cache_hit_rate{model_name=\"m\"} 0.25",
            "# TYPE sglang:prompt_tokens_total counter",
            "sglang:prompt_tokens_total{model_name=\"m\"} 400.0",
            "sglang:page_size{model_name=\"m\"} 16.0",
            "sglang:release_info{model_name=\"m\",digest=\"d\"} 1",
            "# TYPE sglang:max_total_num_tokens gauge",
            "sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"} 200000.0",
            "emulator_http_requests_total{path=\"/metrics\"} 1.0",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line}\n{t}");
        }
        assert!(!t.contains("vllm:"));
        assert!(!t.contains("process_start_time_seconds"));
    }

    #[test]
    fn garbage_is_not_prometheus() {
        let g = garbage(1);
        assert_ne!(g, garbage(2));
        assert!(g.lines().all(|l| l.starts_with('%') || l.starts_with('<')));
        assert!(!g.contains("vllm:"));
    }
}
