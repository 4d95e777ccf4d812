//! The engine families (vLLM, SGLang, llama.cpp): which series each one's
//! figures come from, and how a scrape's series add up into an
//! [`EngineSample`] (counts summed, usage and ratios averaged).

use crate::engines::capacity::{CacheCapacity, CapacitySum};

/// Which inference server exposes the endpoint; it decides the metric names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Vllm,
    Sglang,
    /// llama.cpp's `llama-server` (started with `--metrics`).
    Llamacpp,
}

impl EngineKind {
    /// The name in the configuration (`regions[].engine`) and in messages.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Llamacpp => "llamacpp",
        }
    }

    /// Every metric this module reads for the kind starts with this, so most
    /// lines of a scrape are rejected by one prefix comparison.
    pub(crate) fn metric_prefix(self) -> &'static [u8] {
        match self {
            EngineKind::Vllm => b"vllm:",
            EngineKind::Sglang => b"sglang:",
            EngineKind::Llamacpp => b"llamacpp:",
        }
    }

    pub(crate) fn wanted_series(self) -> &'static [(&'static str, Series)] {
        match self {
            EngineKind::Vllm => VLLM_SERIES,
            EngineKind::Sglang => SGLANG_SERIES,
            EngineKind::Llamacpp => LLAMACPP_SERIES,
        }
    }

    /// The block of the kind's cache when its engine does not say: SGLang's
    /// default page of one token; unknown otherwise.
    pub fn default_block_tokens(self) -> Option<u32> {
        match self {
            EngineKind::Sglang => Some(1),
            EngineKind::Vllm | EngineKind::Llamacpp => None,
        }
    }

    /// The names of the kind's waiting and running series, as a
    /// failed scrape names them.
    pub(crate) fn load_series(self) -> impl Iterator<Item = &'static str> {
        self.wanted_series()
            .iter()
            .filter(|(_, s)| matches!(s, Series::Waiting | Series::Running))
            .map(|(name, _)| *name)
    }
}

/// One scrape's worth of load numbers. `None` means the engine did not report
/// the number (or reported it as NaN, infinite or, for counts, negative).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineSample {
    /// Requests queued and not yet scheduled, summed over all series.
    pub waiting: Option<f64>,
    /// Requests in the running batch, summed over all series.
    pub running: Option<f64>,
    /// KV-cache usage as a fraction in 0..=1, the mean over all series.
    pub kv_usage: Option<f64>,
    /// Cumulative prefix-cache lookups, in tokens, summed over all series
    /// (llama.cpp: the prompt tokens it prefilled plus those it reused).
    pub prefix_queries: Option<f64>,
    /// Cumulative prefix-cache hits, in tokens, summed over all series
    /// (llama.cpp: the prompt tokens it reused from its cache).
    pub prefix_hits: Option<f64>,
    /// Prefix-cache hit rate in 0..=1, when the engine reports a rate itself.
    pub hit_rate: Option<f64>,
    /// Value of the configured release label, from the first series of its
    /// metric that carries that label.
    pub release: Option<String>,
    /// Cumulative requests the engine finished, summed over all series
    /// (vLLM `request_success_total`, SGLang `num_requests_total`; llama.cpp
    /// has none): the probe measures the engine's drain rate from it.
    pub completed: Option<f64>,
    /// KV-cache capacity in tokens, summed over the endpoint's engines;
    /// `None` when the engine exports no capacity metric.
    pub cache_capacity: Option<CacheCapacity>,
    /// Tokens per block of the engine's prefix cache, which serves whole
    /// blocks only: vLLM's `block_size` label of `cache_config_info`,
    /// SGLang's `page_size` (1 when it does not say: its default); `None`
    /// for llama.cpp, or when not said (no rounding then). The largest
    /// over the endpoint's engines.
    pub block_tokens: Option<u32>,
    /// Cumulative prompt tokens the engine took, summed over all series
    /// (vLLM and SGLang `prompt_tokens_total`; llama.cpp's, which leaves
    /// out the tokens it reused from its cache): a counter that only a
    /// restart sends back, watched where there is no prefix-cache counter
    /// (`EngineSample::restart_counter`).
    pub prompt_tokens: Option<f64>,
    /// Cumulative output tokens the engine generated, summed over all
    /// series (vLLM and SGLang `generation_tokens_total`, llama.cpp
    /// `tokens_predicted_total`): its cache keeps an answer's blocks as it
    /// keeps a prompt's, so they age the cache too (`Fleet::on_engine_clock`).
    pub generation_tokens: Option<f64>,
    /// When the engine's serving process started (Unix seconds), from the
    /// `process_start_time_seconds` Python's Prometheus client exports
    /// from its default registry (vLLM's server; not SGLang's multiprocess
    /// one); the largest over its series. Another value at the next scrape
    /// is a restart, whatever the counters read; nothing served before it
    /// is in the cache, restart seen or not (`Fleet::on_metrics`).
    pub process_start_s: Option<f64>,
}

/// The monotonic counter of a scrape that only an engine's restart sends
/// back ([`EngineSample::restart_counter`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartCounter {
    /// The prefix-cache lookups (llama.cpp: its prefilled plus its reused
    /// prompt tokens).
    PrefixQueries,
    /// The prompt tokens taken (SGLang, which has no prefix counter).
    PromptTokens,
    /// The serving process's start time (`process_start_time_seconds`).
    ProcessStart,
}

impl RestartCounter {
    /// As a log line names it.
    pub fn describe(self) -> &'static str {
        match self {
            RestartCounter::PrefixQueries => "prefix-cache queries counter",
            RestartCounter::PromptTokens => "prompt tokens counter",
            RestartCounter::ProcessStart => "process start time (process_start_time_seconds)",
        }
    }
}

impl EngineSample {
    /// The counter that tells an engine's restart, and its value: the
    /// prefix-cache queries where the engine exports them, else its prompt
    /// tokens; `None` when the scrape has neither (it then says nothing
    /// about a restart, and is never read as a counter gone to 0).
    pub fn restart_counter(&self) -> Option<(RestartCounter, f64)> {
        self.prefix_queries
            .map(|v| (RestartCounter::PrefixQueries, v))
            .or_else(|| {
                self.prompt_tokens
                    .map(|v| (RestartCounter::PromptTokens, v))
            })
    }
}

/// Where a number lands. Counts and counters are summed over series; usage
/// and ratio gauges are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Series {
    Waiting,
    Running,
    KvUsage,
    /// vLLM's pre-0.9 name, read only when the current one is absent.
    KvUsageLegacy,
    PrefixQueries(PrefixFamily),
    PrefixHits(PrefixFamily),
    /// Prompt tokens prefilled, not found in the cache (llama.cpp's
    /// `prompt_tokens_total`, which leaves the cached ones out).
    PrefixMisses,
    /// Prompt tokens reused from the cache (llama.cpp's
    /// `prompt_tokens_cached_total`): the hits; a lookup is a miss or one
    /// of these.
    PrefixReused,
    HitRate,
    Completed,
    /// Prompt tokens taken, cached or not (vLLM's and SGLang's
    /// `prompt_tokens_total`).
    PromptTokens,
    /// Output tokens generated (vLLM's and SGLang's
    /// `generation_tokens_total`, llama.cpp's `tokens_predicted_total`).
    GenerationTokens,
    /// SGLang's `page_size`: the tokens per block of its cache.
    PageSize,
    /// `process_start_time_seconds`: when the serving process started.
    ProcessStart,
    /// vLLM's `cache_config_info`: the capacity is in its labels.
    CacheConfigInfo,
    /// SGLang's `max_total_num_tokens`: the capacity is the value.
    MaxTotalTokens,
}

/// The spellings vLLM has used for its prefix-cache counters, most preferred
/// first. Queries and hits are always taken from the same spelling so their
/// ratio compares like with like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefixFamily {
    /// `vllm:prefix_cache_*_total`, what prometheus_client prints.
    Total = 0,
    /// `vllm:prefix_cache_*`, from exporters that omit the suffix.
    Bare = 1,
    /// `vllm:gpu_prefix_cache_*_total`, deprecated in 0.9.
    GpuTotal = 2,
    /// `vllm:gpu_prefix_cache_*`.
    GpuBare = 3,
}

impl PrefixFamily {
    const BY_PREFERENCE: [PrefixFamily; 4] = [
        PrefixFamily::Total,
        PrefixFamily::Bare,
        PrefixFamily::GpuTotal,
        PrefixFamily::GpuBare,
    ];
}

/// When the serving process started (Unix s), as Python's Prometheus
/// client prints it from its default registry: vLLM's server has it (read
/// from vLLM 0.32's /metrics). SGLang's multiprocess registry leaves it
/// out; read where an exporter adds it.
pub(crate) const PROCESS_START: &str = "process_start_time_seconds";

const VLLM_SERIES: &[(&str, Series)] = &[
    ("vllm:num_requests_waiting", Series::Waiting),
    ("vllm:num_requests_running", Series::Running),
    ("vllm:kv_cache_usage_perc", Series::KvUsage),
    ("vllm:gpu_cache_usage_perc", Series::KvUsageLegacy),
    (
        "vllm:prefix_cache_queries_total",
        Series::PrefixQueries(PrefixFamily::Total),
    ),
    (
        "vllm:prefix_cache_queries",
        Series::PrefixQueries(PrefixFamily::Bare),
    ),
    (
        "vllm:gpu_prefix_cache_queries_total",
        Series::PrefixQueries(PrefixFamily::GpuTotal),
    ),
    (
        "vllm:gpu_prefix_cache_queries",
        Series::PrefixQueries(PrefixFamily::GpuBare),
    ),
    (
        "vllm:prefix_cache_hits_total",
        Series::PrefixHits(PrefixFamily::Total),
    ),
    (
        "vllm:prefix_cache_hits",
        Series::PrefixHits(PrefixFamily::Bare),
    ),
    (
        "vllm:gpu_prefix_cache_hits_total",
        Series::PrefixHits(PrefixFamily::GpuTotal),
    ),
    (
        "vllm:gpu_prefix_cache_hits",
        Series::PrefixHits(PrefixFamily::GpuBare),
    ),
    // The v0 engine (0.6 to 0.8) has no prefix counters, only this gauge.
    // With prefix caching off it prints -1, which clamps to a 0 hit rate.
    ("vllm:gpu_prefix_cache_hit_rate", Series::HitRate),
    ("vllm:request_success_total", Series::Completed),
    ("vllm:prompt_tokens_total", Series::PromptTokens),
    ("vllm:generation_tokens_total", Series::GenerationTokens),
    ("vllm:cache_config_info", Series::CacheConfigInfo),
    (PROCESS_START, Series::ProcessStart),
];

const SGLANG_SERIES: &[(&str, Series)] = &[
    ("sglang:num_queue_reqs", Series::Waiting),
    ("sglang:num_running_reqs", Series::Running),
    ("sglang:token_usage", Series::KvUsage),
    ("sglang:cache_hit_rate", Series::HitRate),
    ("sglang:num_requests_total", Series::Completed),
    ("sglang:prompt_tokens_total", Series::PromptTokens),
    ("sglang:generation_tokens_total", Series::GenerationTokens),
    ("sglang:page_size", Series::PageSize),
    ("sglang:max_total_num_tokens", Series::MaxTotalTokens),
    (PROCESS_START, Series::ProcessStart),
];

/// llama.cpp (`llama-server --metrics`) prints every series unlabelled and
/// has no KV-cache usage, no cache capacity and no completions counter:
/// those figures stay `None` (see docs/OPERATIONS.md for what the cost does
/// without them).
const LLAMACPP_SERIES: &[(&str, Series)] = &[
    ("llamacpp:requests_deferred", Series::Waiting),
    ("llamacpp:requests_processing", Series::Running),
    ("llamacpp:prompt_tokens_total", Series::PrefixMisses),
    ("llamacpp:prompt_tokens_cached_total", Series::PrefixReused),
    ("llamacpp:tokens_predicted_total", Series::GenerationTokens),
];

/// Running sum of the series of one name.
#[derive(Debug, Clone, Copy, Default)]
struct Accumulator {
    sum: f64,
    series: u32,
}

impl Accumulator {
    fn add(&mut self, value: f64) {
        self.sum += value;
        self.series = self.series.saturating_add(1);
    }

    /// Counts add up across data-parallel engines (`engine="0"`, `"1"`, or
    /// SGLang's `dp_rank`) and across models served by one endpoint: the
    /// router cares about all the work queued behind the address.
    fn total(self) -> Option<f64> {
        (self.series > 0 && self.sum.is_finite()).then_some(self.sum)
    }

    /// Usage and ratios are averaged instead: data-parallel engines have
    /// equal KV pools, so the mean is the endpoint's overall fill, while a
    /// sum would exceed 1 and mean nothing.
    fn mean(self) -> Option<f64> {
        (self.series > 0).then(|| (self.sum / f64::from(self.series)).clamp(0.0, 1.0))
    }
}

#[derive(Debug, Default)]
pub(crate) struct Totals {
    waiting: Accumulator,
    running: Accumulator,
    kv_usage: Accumulator,
    kv_usage_legacy: Accumulator,
    prefix_queries: [Accumulator; 4],
    prefix_hits: [Accumulator; 4],
    prefix_misses: Accumulator,
    prefix_reused: Accumulator,
    hit_rate: Accumulator,
    completed: Accumulator,
    prompt_tokens: Accumulator,
    generation_tokens: Accumulator,
    page_size: Option<u32>,
    process_start: Option<f64>,
    pub(crate) capacity: CapacitySum,
}

impl Totals {
    pub(crate) fn add(&mut self, series: Series, value: f64) {
        // NaN or infinity is no measurement; a negative count is a broken
        // exporter. Either way that series is left out, not zeroed.
        if !value.is_finite() {
            return;
        }
        let count = (value >= 0.0).then_some(value);
        let ratio = value.clamp(0.0, 1.0);
        let (accumulator, value) = match series {
            Series::Waiting => (Some(&mut self.waiting), count),
            Series::Running => (Some(&mut self.running), count),
            Series::PrefixQueries(family) => (self.prefix_queries.get_mut(family as usize), count),
            Series::PrefixHits(family) => (self.prefix_hits.get_mut(family as usize), count),
            Series::PrefixMisses => (Some(&mut self.prefix_misses), count),
            Series::PrefixReused => (Some(&mut self.prefix_reused), count),
            Series::KvUsage => (Some(&mut self.kv_usage), Some(ratio)),
            Series::KvUsageLegacy => (Some(&mut self.kv_usage_legacy), Some(ratio)),
            Series::HitRate => (Some(&mut self.hit_rate), Some(ratio)),
            Series::Completed => (Some(&mut self.completed), count),
            Series::PromptTokens => (Some(&mut self.prompt_tokens), count),
            Series::GenerationTokens => (Some(&mut self.generation_tokens), count),
            Series::PageSize => {
                let page = crate::engines::capacity::block_tokens_of(value);
                self.page_size = self.page_size.max(page);
                (None, None)
            }
            Series::ProcessStart => {
                if value > 0.0 {
                    self.process_start = Some(self.process_start.map_or(value, |s| s.max(value)));
                }
                (None, None)
            }
            Series::CacheConfigInfo | Series::MaxTotalTokens => (None, None),
        };
        if let (Some(accumulator), Some(value)) = (accumulator, value) {
            accumulator.add(value);
        }
    }

    pub(crate) fn into_sample(self, release: Option<String>) -> EngineSample {
        let block_tokens = self.capacity.block_tokens().max(self.page_size);
        let (prefix_queries, prefix_hits) = PrefixFamily::BY_PREFERENCE
            .iter()
            .find_map(|&family| {
                let queries = self.prefix_queries.get(family as usize)?;
                let hits = self.prefix_hits.get(family as usize)?;
                (queries.series > 0 || hits.series > 0).then(|| (queries.total(), hits.total()))
            })
            .or_else(|| {
                // Counted as misses and hits (llama.cpp): the lookups are
                // both, so that queries − hits is the tokens prefilled, as
                // with vLLM's counters.
                let (misses, reused) = (self.prefix_misses, self.prefix_reused);
                (misses.series > 0 || reused.series > 0).then(|| {
                    let queries = misses
                        .total()
                        .zip(reused.total())
                        .map(|(m, r)| m + r)
                        .filter(|q| q.is_finite());
                    (queries, reused.total())
                })
            })
            .unwrap_or((None, None));
        EngineSample {
            waiting: self.waiting.total(),
            running: self.running.total(),
            kv_usage: self.kv_usage.mean().or_else(|| self.kv_usage_legacy.mean()),
            prefix_queries,
            prefix_hits,
            hit_rate: self.hit_rate.mean(),
            release,
            completed: self.completed.total(),
            cache_capacity: self.capacity.into_capacity(),
            block_tokens,
            // llama.cpp's prompt counter leaves the reused tokens out, but
            // only a restart sends it back.
            prompt_tokens: self
                .prompt_tokens
                .total()
                .or_else(|| self.prefix_misses.total()),
            generation_tokens: self.generation_tokens.total(),
            process_start_s: self.process_start,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engines::metrics::parse_engine_metrics;

    const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

    /// The labels of vLLM's `cache_config_info` before `engine`, as 0.10
    /// prints them (the fields of its CacheConfig, sorted).
    const VLLM_CACHE_LABELS: &str = "block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_kvcache_space_bytes=\"4294967296\",cpu_offload_gb=\"0.0\",enable_prefix_caching=\"None\"";

    /// Shaped like vLLM v1 (0.9+) with two data-parallel engines: labels in
    /// prometheus_client's sorted order, `_total` counters with their
    /// `_created` companions, deprecated names beside the current ones, and
    /// series this module ignores.
    pub(crate) fn vllm_v1_payload() -> String {
        let m = MODEL;
        let cache = VLLM_CACHE_LABELS;
        format!(
            "# HELP python_gc_objects_collected_total Objects collected during gc\n\
# TYPE python_gc_objects_collected_total counter\n\
python_gc_objects_collected_total{{generation=\"0\"}} 12345.0\n\
# HELP process_resident_memory_bytes Resident memory size in bytes.\n\
# TYPE process_resident_memory_bytes gauge\n\
process_resident_memory_bytes 1.23456789e+09\n\
# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{{engine=\"0\",model_name=\"{m}\"}} 3.0\n\
vllm:num_requests_running{{engine=\"1\",model_name=\"{m}\"}} 5.0\n\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{{engine=\"0\",model_name=\"{m}\"}} 0.0\n\
vllm:num_requests_waiting{{engine=\"1\",model_name=\"{m}\"}} 2.0\n\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.\n\
# TYPE vllm:gpu_cache_usage_perc gauge\n\
vllm:gpu_cache_usage_perc{{engine=\"0\",model_name=\"{m}\"}} 0.9\n\
vllm:gpu_cache_usage_perc{{engine=\"1\",model_name=\"{m}\"}} 0.9\n\
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queriedtokens. DEPRECATED: Use vllm:prefix_cache_queries instead.\n\
# TYPE vllm:gpu_prefix_cache_queries_total counter\n\
vllm:gpu_prefix_cache_queries_total{{engine=\"0\",model_name=\"{m}\"}} 99.0\n\
vllm:gpu_prefix_cache_queries_total{{engine=\"1\",model_name=\"{m}\"}} 99.0\n\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
# TYPE vllm:kv_cache_usage_perc gauge\n\
vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{m}\"}} 0.25\n\
vllm:kv_cache_usage_perc{{engine=\"1\",model_name=\"{m}\"}} 0.5\n\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n\
# TYPE vllm:prefix_cache_queries_total counter\n\
vllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"{m}\"}} 12800.0\n\
vllm:prefix_cache_queries_total{{engine=\"1\",model_name=\"{m}\"}} 3200.0\n\
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.\n\
# TYPE vllm:prefix_cache_queries_created gauge\n\
vllm:prefix_cache_queries_created{{engine=\"0\",model_name=\"{m}\"}} 1.7520632719876e+09\n\
vllm:prefix_cache_queries_created{{engine=\"1\",model_name=\"{m}\"}} 1.7520632719877e+09\n\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
# TYPE vllm:prefix_cache_hits_total counter\n\
vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{m}\"}} 6400.0\n\
vllm:prefix_cache_hits_total{{engine=\"1\",model_name=\"{m}\"}} 1.6e+03\n\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{{{cache},engine=\"0\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"0\",num_gpu_blocks=\"2340\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",sliding_window=\"None\",swap_space=\"4.0\",swap_space_bytes=\"4294967296.0\"}} 1.0\n\
vllm:cache_config_info{{{cache},engine=\"1\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"0\",num_gpu_blocks=\"2339\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"builtin\",sliding_window=\"None\",swap_space=\"4.0\",swap_space_bytes=\"4294967296.0\"}} 1.0\n\
# HELP vllm:request_success_total Count of successfully processed requests.\n\
# TYPE vllm:request_success_total counter\n\
vllm:request_success_total{{engine=\"0\",finished_reason=\"stop\",model_name=\"{m}\"}} 42.0\n\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n\
# TYPE vllm:time_to_first_token_seconds histogram\n\
vllm:time_to_first_token_seconds_sum{{engine=\"0\",model_name=\"{m}\"}} 3.14\n\
vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"0.001\",model_name=\"{m}\"}} 0.0\n\
vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{m}\"}} 42.0\n\
vllm:time_to_first_token_seconds_count{{engine=\"0\",model_name=\"{m}\"}} 42.0\n"
        )
    }

    #[test]
    fn vllm_v1_sums_counts_and_averages_usage_across_engines() {
        let sample =
            parse_engine_metrics(EngineKind::Vllm, vllm_v1_payload().as_bytes(), None).unwrap();
        assert_eq!(
            sample,
            EngineSample {
                waiting: Some(2.0),
                running: Some(8.0),
                kv_usage: Some(0.375),
                prefix_queries: Some(16000.0),
                prefix_hits: Some(8000.0),
                hit_rate: None,
                release: None,
                completed: Some(42.0),
                // (2340 + 2339) blocks of 16 tokens.
                cache_capacity: Some(CacheCapacity::Tokens(74_864)),
                block_tokens: Some(16),
                prompt_tokens: None,
                generation_tokens: None,
                process_start_s: None,
            }
        );
    }

    #[test]
    fn older_vllm_falls_back_to_gpu_names_and_unsuffixed_counters() {
        // Shaped like the v0 engine, labelled by model only, with
        // timestamps as some relabelling exporters add them.
        let text = "\
# HELP vllm:num_requests_running Number of requests currently running on GPU.\n\
# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{model_name=\"qwen\"} 5.0 1712345678901\n\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{model_name=\"qwen\"} 2.0 1712345678901\n\
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n\
# TYPE vllm:gpu_cache_usage_perc gauge\n\
vllm:gpu_cache_usage_perc{model_name=\"qwen\"} 0.734\n\
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.\n\
# TYPE vllm:gpu_prefix_cache_hit_rate gauge\n\
vllm:gpu_prefix_cache_hit_rate{model_name=\"qwen\"} 0.25\n\
# TYPE vllm:gpu_prefix_cache_queries counter\n\
vllm:gpu_prefix_cache_queries{model_name=\"qwen\"} 2048\n\
# TYPE vllm:gpu_prefix_cache_hits counter\n\
vllm:gpu_prefix_cache_hits{model_name=\"qwen\"} 512\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(
            sample,
            EngineSample {
                waiting: Some(2.0),
                running: Some(5.0),
                kv_usage: Some(0.734),
                prefix_queries: Some(2048.0),
                prefix_hits: Some(512.0),
                hit_rate: Some(0.25),
                release: None,
                completed: None,
                cache_capacity: None,
                block_tokens: None,
                prompt_tokens: None,
                generation_tokens: None,
                process_start_s: None,
            }
        );
    }

    #[test]
    fn prefix_counters_come_from_one_spelling_in_preference_order() {
        let text = "\
vllm:num_requests_running 0\n\
vllm:prefix_cache_queries{engine=\"0\"} 10\n\
vllm:prefix_cache_hits{engine=\"0\"} 4\n\
vllm:prefix_cache_queries_total{engine=\"0\"} 100\n\
vllm:gpu_prefix_cache_hits_total{engine=\"0\"} 77\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        // `_total` wins; its hits are absent rather than borrowed from
        // another spelling.
        assert_eq!(sample.prefix_queries, Some(100.0));
        assert_eq!(sample.prefix_hits, None);
    }

    #[test]
    fn sglang_with_data_parallel_ranks() {
        let labels0 =
            "dp_rank=\"0\",engine_type=\"unified\",model_name=\"Qwen/Qwen2.5-7B-Instruct\",pp_rank=\"0\",tp_rank=\"0\"";
        let labels1 =
            "dp_rank=\"1\",engine_type=\"unified\",model_name=\"Qwen/Qwen2.5-7B-Instruct\",pp_rank=\"0\",tp_rank=\"0\"";
        // Tensor-parallel rank 1 of dp_rank 0 repeats its pool.
        let tp1 =
            "dp_rank=\"0\",engine_type=\"unified\",model_name=\"Qwen/Qwen2.5-7B-Instruct\",pp_rank=\"0\",tp_rank=\"1\"";
        let text = format!(
            "# HELP sglang:num_running_reqs The number of running requests.\n\
# TYPE sglang:num_running_reqs gauge\n\
sglang:num_running_reqs{{{labels0}}} 30.0\n\
sglang:num_running_reqs{{{labels1}}} 28.0\n\
# HELP sglang:num_used_tokens The number of used tokens.\n\
# TYPE sglang:num_used_tokens gauge\n\
sglang:num_used_tokens{{{labels0}}} 81234.0\n\
# HELP sglang:token_usage The token usage.\n\
# TYPE sglang:token_usage gauge\n\
sglang:token_usage{{{labels0}}} 0.5\n\
sglang:token_usage{{{labels1}}} 0.75\n\
# HELP sglang:gen_throughput The generation throughput (token/s).\n\
# TYPE sglang:gen_throughput gauge\n\
sglang:gen_throughput{{{labels0}}} 86.50814177726902\n\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n\
# TYPE sglang:num_queue_reqs gauge\n\
sglang:num_queue_reqs{{{labels0}}} 12.0\n\
sglang:num_queue_reqs{{{labels1}}} 3.0\n\
# HELP sglang:cache_hit_rate The prefix cache hit rate.\n\
# TYPE sglang:cache_hit_rate gauge\n\
sglang:cache_hit_rate{{{labels0}}} 0.25\n\
sglang:cache_hit_rate{{{labels1}}} 0.5\n\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n\
# TYPE sglang:prompt_tokens_total counter\n\
sglang:prompt_tokens_total{{{labels0}}} 8.128902e+06\n\
# HELP sglang:num_requests_total Number of requests processed.\n\
# TYPE sglang:num_requests_total counter\n\
sglang:num_requests_total{{{labels0}}} 120.0\n\
sglang:num_requests_total{{{labels1}}} 80.0\n\
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n\
# TYPE sglang:max_total_num_tokens gauge\n\
sglang:max_total_num_tokens{{{labels0}}} 262144.0\n\
sglang:max_total_num_tokens{{{labels1}}} 262144.0\n\
sglang:max_total_num_tokens{{{tp1}}} 262144.0\n"
        );
        let sample = parse_engine_metrics(EngineKind::Sglang, text.as_bytes(), None).unwrap();
        assert_eq!(
            sample,
            EngineSample {
                waiting: Some(15.0),
                running: Some(58.0),
                kv_usage: Some(0.625),
                prefix_queries: None,
                prefix_hits: None,
                hit_rate: Some(0.375),
                release: None,
                completed: Some(200.0),
                // Two data-parallel pools; tp_rank 1 is not a third.
                cache_capacity: Some(CacheCapacity::Tokens(524_288)),
                // Its default page: it prints none here.
                block_tokens: Some(1),
                // No prefix counter: its restarts are watched on this.
                prompt_tokens: Some(8_128_902.0),
                generation_tokens: None,
                process_start_s: None,
            }
        );
    }

    /// What `llama-server --metrics` (b11434) prints: every series
    /// unlabelled, counters then gauges, each with its HELP and TYPE lines;
    /// no KV usage, no capacity, no completions counter. Values are C++
    /// stream output: six significant digits, past a million in exponent
    /// form.
    pub(crate) const LLAMACPP_PAYLOAD: &str = "\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens\n\
# TYPE llamacpp:prompt_tokens_total counter\n\
llamacpp:prompt_tokens_total 5210\n\
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache\n\
# TYPE llamacpp:prompt_tokens_cached_total counter\n\
llamacpp:prompt_tokens_cached_total 1.23457e+06\n\
# HELP llamacpp:prompt_seconds_total Total time spent processing prompts\n\
# TYPE llamacpp:prompt_seconds_total counter\n\
llamacpp:prompt_seconds_total 3.5\n\
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed\n\
# TYPE llamacpp:tokens_predicted_total counter\n\
llamacpp:tokens_predicted_total 912\n\
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens\n\
# TYPE llamacpp:tokens_predicted_seconds_total counter\n\
llamacpp:tokens_predicted_seconds_total 11.25\n\
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding\n\
# TYPE llamacpp:n_decode_total counter\n\
llamacpp:n_decode_total 640\n\
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)\n\
# TYPE llamacpp:n_tokens_max counter\n\
llamacpp:n_tokens_max 4096\n\
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated\n\
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\n\
llamacpp:spec_decode_num_draft_tokens_total 0\n\
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model\n\
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter\n\
llamacpp:spec_decode_num_accepted_tokens_total 0\n\
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps\n\
# TYPE llamacpp:spec_decode_num_drafts_total counter\n\
llamacpp:spec_decode_num_drafts_total 0\n\
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s\n\
# TYPE llamacpp:prompt_tokens_seconds gauge\n\
llamacpp:prompt_tokens_seconds 1488.57\n\
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s\n\
# TYPE llamacpp:predicted_tokens_seconds gauge\n\
llamacpp:predicted_tokens_seconds 81.07\n\
# HELP llamacpp:requests_processing Number of requests processing\n\
# TYPE llamacpp:requests_processing gauge\n\
llamacpp:requests_processing 4\n\
# HELP llamacpp:requests_deferred Number of requests deferred\n\
# TYPE llamacpp:requests_deferred gauge\n\
llamacpp:requests_deferred 3\n\
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call\n\
# TYPE llamacpp:n_busy_slots_per_decode gauge\n\
llamacpp:n_busy_slots_per_decode 3.6\n";

    #[test]
    fn llamacpp_queue_running_and_prompt_tokens_as_lookups_and_hits() {
        let sample =
            parse_engine_metrics(EngineKind::Llamacpp, LLAMACPP_PAYLOAD.as_bytes(), None).unwrap();
        assert_eq!(
            sample,
            EngineSample {
                waiting: Some(3.0),
                running: Some(4.0),
                kv_usage: None,
                // Its prompt counter leaves the cached tokens out: the
                // lookups are 5210 prefilled + 1234570 reused, so that
                // lookups − hits is the 5210 tokens that went in.
                prefix_queries: Some(1_239_780.0),
                prefix_hits: Some(1_234_570.0),
                hit_rate: None,
                release: None,
                completed: None,
                cache_capacity: None,
                block_tokens: None,
                prompt_tokens: Some(5210.0),
                generation_tokens: Some(912.0),
                process_start_s: None,
            }
        );
        // Without the cached counter (no hits), no lookups either: the
        // prompt counter alone is not what vLLM's queries mean.
        let text = "llamacpp:requests_processing 1\nllamacpp:prompt_tokens_total 10\n";
        let sample = parse_engine_metrics(EngineKind::Llamacpp, text.as_bytes(), None).unwrap();
        assert_eq!((sample.prefix_queries, sample.prefix_hits), (None, None));
    }

    #[test]
    fn nan_infinite_and_negative_series_are_left_out_and_ratios_clamped() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\"} NaN\n\
vllm:num_requests_waiting{engine=\"1\"} 4\n\
vllm:num_requests_running{engine=\"0\"} +Inf\n\
vllm:num_requests_running{engine=\"1\"} -1\n\
vllm:kv_cache_usage_perc{engine=\"0\"} 1.7\n\
vllm:kv_cache_usage_perc{engine=\"1\"} -0.2\n\
vllm:kv_cache_usage_perc{engine=\"2\"} -Inf\n\
vllm:prefix_cache_queries_total{engine=\"0\"} 1e308\n\
vllm:prefix_cache_queries_total{engine=\"1\"} 1e308\n\
vllm:gpu_prefix_cache_hit_rate{model_name=\"m\"} -1\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(sample.waiting, Some(4.0));
        assert_eq!(sample.running, None);
        assert_eq!(sample.kv_usage, Some(0.5));
        // Two finite counters whose sum overflows are no usable total.
        assert_eq!(sample.prefix_queries, None);
        assert_eq!(sample.hit_rate, Some(0.0));
    }

    #[test]
    fn only_nan_usage_falls_back_to_the_legacy_name() {
        let text = "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.5\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(sample.kv_usage, Some(0.5));
    }

    #[test]
    fn engine_kind_serde_names_are_lowercase() {
        // serde_json is a dependency of the crate but not of every scratch
        // build, so check the attribute through the derived Deserialize with
        // a minimal string deserializer.
        use serde::de::value::{Error, StrDeserializer};
        use serde::de::IntoDeserializer;
        use serde::Deserialize;
        let parse = |s: &'static str| {
            let de: StrDeserializer<'_, Error> = s.into_deserializer();
            EngineKind::deserialize(de)
        };
        assert_eq!(parse("vllm").unwrap(), EngineKind::Vllm);
        assert_eq!(parse("sglang").unwrap(), EngineKind::Sglang);
        assert_eq!(parse("llamacpp").unwrap(), EngineKind::Llamacpp);
        assert!(parse("Vllm").is_err());
        assert!(parse("llama.cpp").is_err());
        for kind in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Llamacpp] {
            assert_eq!(parse(kind.name()).unwrap(), kind);
        }
    }
}
