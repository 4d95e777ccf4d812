//! `/metrics` exposition: renders a snapshot of the replica in Prometheus
//! text format 0.0.4 with vLLM's or SGLang's metric names, and produces the
//! deliberately unparseable body used to test the router's scrape hardening.

use std::fmt::Write as _;

use crate::config::Mode;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

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
    /// The prefix cache's capacity, in tokens (whole blocks).
    pub capacity_tokens: usize,
    /// Tokens per cache block (vLLM's `block_size`).
    pub block_tokens: usize,
    /// Requests received per path.
    pub requests: Vec<(String, u64)>,
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
    labels: String,
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
    /// vLLM 0.10 prints them, sorted), the value 1. The capacity is
    /// `num_gpu_blocks` blocks of `block_size` tokens.
    fn vllm_cache_config_info(&mut self, blocks: usize, block_size: usize) {
        let name = "vllm:cache_config_info";
        self.family(name, "gauge", "Information of the LLMEngine CacheConfig");
        let _ = writeln!(
            self.text,
            "{name}{{block_size=\"{block_size}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",\
             cpu_kvcache_space_bytes=\"4294967296\",cpu_offload_gb=\"0.0\",enable_prefix_caching=\"True\",\
             gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"0\",\
             num_gpu_blocks=\"{blocks}\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",\
             sliding_window=\"None\",swap_space=\"4.0\",swap_space_bytes=\"4294967296.0\"}} 1.0"
        );
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
            self.labels,
            escape(digest)
        );
    }
}

pub fn render(mode: Mode, model: &str, release: &str, s: &Snapshot) -> String {
    let mut o = Out {
        text: String::new(),
        labels: format!("model_name=\"{}\"", escape(model)),
    };
    match mode {
        Mode::Vllm => {
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
            o.counter(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
                s.completed,
            );
            let block = s.block_tokens.max(1);
            o.vllm_cache_config_info(s.capacity_tokens / block, block);
            o.release_info("vllm:release_info", release);
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
            o.release_info("sglang:release_info", release);
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
            capacity_tokens: 200_000,
            block_tokens: 16,
            requests: vec![("/health".into(), 3), ("/metrics".into(), 1)],
        }
    }

    #[test]
    fn vllm_names_and_values() {
        let t = render(Mode::Vllm, "m\"x", "sha256:a", &snap());
        for line in [
            "# TYPE vllm:num_requests_running gauge",
            "vllm:num_requests_running{model_name=\"m\\\"x\"} 2.0",
            "vllm:num_requests_waiting{model_name=\"m\\\"x\"} 1.0",
            "vllm:kv_cache_usage_perc{model_name=\"m\\\"x\"} 0.25",
            "# TYPE vllm:prefix_cache_queries_total counter",
            "vllm:prefix_cache_queries_total{model_name=\"m\\\"x\"} 400.0",
            "vllm:prefix_cache_hits_total{model_name=\"m\\\"x\"} 100.0",
            "vllm:request_success_total{model_name=\"m\\\"x\"} 7.0",
            "vllm:release_info{model_name=\"m\\\"x\",digest=\"sha256:a\"} 1",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_kvcache_space_bytes=\"4294967296\",cpu_offload_gb=\"0.0\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"0\",num_gpu_blocks=\"12500\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",sliding_window=\"None\",swap_space=\"4.0\",swap_space_bytes=\"4294967296.0\"} 1.0",
            "emulator_http_requests_total{path=\"/health\"} 3.0",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line}\n{t}");
        }
        assert!(!t.contains("sglang:"));
    }

    #[test]
    fn sglang_names_and_values() {
        let t = render(Mode::Sglang, "m", "d", &snap());
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
    }

    #[test]
    fn garbage_is_not_prometheus() {
        let g = garbage(1);
        assert_ne!(g, garbage(2));
        assert!(g.lines().all(|l| l.starts_with('%') || l.starts_with('<')));
        assert!(!g.contains("vllm:"));
    }
}
