//! The `prometheus` load source: one instant query per probe round for
//! every region that uses it, and its answer read back into one
//! [`EngineSample`] per region, summed over the region's replicas, with
//! the region's replica count and when Prometheus scraped them.
//!
//! The query is one PromQL expression: per region and per signal, the
//! aggregate over the region's selector, labelled with the region
//! (`llm_geo_region`) and the signal (`llm_geo_signal`) by `label_replace`,
//! all joined with `or`. Signals: `waiting`, `running` (sums), `kv` (mean
//! KV-cache usage), `replicas` (series of the running gauge), `completed`
//! (the completions counters, summed), `prefix_queries`/`prefix_hits`
//! (vLLM's prefix-cache counters, summed; llama.cpp's queries are the sum
//! of its prefilled and its cached prompt tokens, each summed over the
//! selector, added), `hit_rate` (SGLang's, mean), `prompt_tokens`
//! (SGLang's prompt tokens counter, summed: its restarts are watched on it,
//! as it has no prefix counter), `block` (SGLang's `page_size`, the
//! largest; vLLM's block is a label of its capacity series),
//! `scraped` (the oldest scrape time of the running gauge's series) and
//! `cache` (the KV-cache capacity series, not aggregated).
//!
//! The capacity is summed here rather than in PromQL: vLLM prints it as
//! labels (`num_gpu_blocks` × `block_size` of `vllm:cache_config_info`),
//! which PromQL cannot add up, and each series must pass the same checks
//! as a scrape's (`metrics::CapacitySum`), so SGLang's series come raw too.

use std::collections::HashMap;

use serde::Deserialize;

use crate::config::{Config, LoadSource, Region};
use crate::engines::metrics::{CapacitySum, EngineKind, EngineSample};

/// Answers read at most.
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

const REGION_LABEL: &str = "llm_geo_region";
const SIGNAL_LABEL: &str = "llm_geo_signal";

/// One region's figures from a Prometheus answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RegionLoad {
    pub sample: EngineSample,
    /// Engine series behind the region's entry point (replicas).
    pub replicas: u32,
    /// When Prometheus scraped them (the oldest series; Unix ms).
    pub scraped_ms: Option<u64>,
}

/// The metric names of each signal, per engine: the terms of a sum (one
/// term for most), each a list of alternatives joined with `or` (vLLM
/// renamed some). A signal the engine does not export is `None`.
fn metric(engine: EngineKind, signal: &str) -> Option<&'static [&'static [&'static str]]> {
    Some(match (engine, signal) {
        (EngineKind::Vllm, "waiting") => &[&["vllm:num_requests_waiting"]],
        (EngineKind::Vllm, "running" | "replicas" | "scraped") => &[&["vllm:num_requests_running"]],
        (EngineKind::Vllm, "kv") => &[&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]],
        (EngineKind::Vllm, "completed") => &[&["vllm:request_success_total"]],
        (EngineKind::Vllm, "prefix_queries") => &[&[
            "vllm:prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_queries_total",
        ]],
        (EngineKind::Vllm, "prefix_hits") => &[&[
            "vllm:prefix_cache_hits_total",
            "vllm:gpu_prefix_cache_hits_total",
        ]],
        (EngineKind::Vllm, "cache") => &[&["vllm:cache_config_info"]],
        (EngineKind::Vllm, "generation") => &[&["vllm:generation_tokens_total"]],
        (EngineKind::Sglang, "generation") => &[&["sglang:generation_tokens_total"]],
        (EngineKind::Llamacpp, "generation") => &[&["llamacpp:tokens_predicted_total"]],
        (EngineKind::Sglang, "waiting") => &[&["sglang:num_queue_reqs"]],
        (EngineKind::Sglang, "running" | "replicas" | "scraped") => &[&["sglang:num_running_reqs"]],
        (EngineKind::Sglang, "kv") => &[&["sglang:token_usage"]],
        (EngineKind::Sglang, "completed") => &[&["sglang:num_requests_total"]],
        (EngineKind::Sglang, "hit_rate") => &[&["sglang:cache_hit_rate"]],
        (EngineKind::Sglang, "prompt_tokens") => &[&["sglang:prompt_tokens_total"]],
        (EngineKind::Sglang, "block") => &[&["sglang:page_size"]],
        (EngineKind::Sglang, "cache") => &[&["sglang:max_total_num_tokens"]],
        (EngineKind::Llamacpp, "waiting") => &[&["llamacpp:requests_deferred"]],
        (EngineKind::Llamacpp, "running" | "replicas" | "scraped") => {
            &[&["llamacpp:requests_processing"]]
        }
        // Its prompt counter leaves out the tokens reused from the cache:
        // a lookup is one or the other (as `metrics` reads a scrape).
        (EngineKind::Llamacpp, "prefix_queries") => &[
            &["llamacpp:prompt_tokens_total"],
            &["llamacpp:prompt_tokens_cached_total"],
        ],
        (EngineKind::Llamacpp, "prefix_hits") => &[&["llamacpp:prompt_tokens_cached_total"]],
        // llama.cpp exports no KV-cache usage, completions counter, hit
        // rate or capacity; SGLang no prefix counters, vLLM v1 no hit rate.
        _ => return None,
    })
}

/// Each signal and its aggregation (empty: the series themselves).
const SIGNALS: [(&str, &str); 13] = [
    ("waiting", "sum"),
    ("running", "sum"),
    ("kv", "avg"),
    ("replicas", "count"),
    ("completed", "sum"),
    ("prefix_queries", "sum"),
    ("prefix_hits", "sum"),
    ("hit_rate", "avg"),
    ("prompt_tokens", "sum"),
    ("generation", "sum"),
    ("block", "max"),
    ("scraped", "min"),
    ("cache", ""),
];

/// The PromQL expression for one region.
pub fn region_query(region: &Region) -> String {
    let sel = region.selector();
    let mut parts = Vec::new();
    for (signal, agg) in SIGNALS {
        let Some(terms) = metric(region.engine, signal) else {
            continue;
        };
        // Each term aggregated on its own, then added: `sum(a) + sum(b)`,
        // whose two sides have no labels left and so match one to one.
        let inner: Vec<String> = terms
            .iter()
            .map(|names| {
                let series: Vec<String> = names.iter().map(|m| format!("{m}{{{sel}}}")).collect();
                let mut term = series.join(" or ");
                if signal == "scraped" {
                    term = format!("timestamp({term})");
                }
                if !agg.is_empty() {
                    term = format!("{agg}({term})");
                }
                term
            })
            .collect();
        let inner = inner.join(" + ");
        parts.push(format!(
            "label_replace(label_replace({inner},\"{REGION_LABEL}\",\"{}\",\"\",\"\"),\"{SIGNAL_LABEL}\",\"{signal}\",\"\",\"\")",
            region.name
        ));
    }
    parts.join(" or ")
}

/// The one query for every region whose `load_source` is `prometheus`;
/// `None` when none is.
pub fn fleet_query(cfg: &Config) -> Option<String> {
    let parts: Vec<String> = cfg
        .regions
        .iter()
        .filter(|r| r.load_source == LoadSource::Prometheus)
        .map(region_query)
        .collect();
    (!parts.is_empty()).then(|| parts.join(" or "))
}

/// The request path: the configured endpoint with `query` form-encoded.
pub fn query_path(cfg: &Config, query: &str) -> String {
    let mut p = String::with_capacity(cfg.prometheus.path.len() + 7 + query.len() * 2);
    p.push_str(&cfg.prometheus.path);
    p.push_str("?query=");
    for b in query.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            p.push(char::from(b));
        } else {
            let hex = |n: u8| char::from(if n < 10 { b'0' + n } else { b'A' + n - 10 });
            p.push('%');
            p.push(hex(b >> 4));
            p.push(hex(b & 15));
        }
    }
    p
}

#[derive(Deserialize)]
struct Answer {
    status: String,
    #[serde(default)]
    data: Option<Data>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "resultType")]
    result_type: String,
    result: Vec<Series>,
}

#[derive(Deserialize)]
struct Series {
    metric: HashMap<String, String>,
    value: (f64, String),
}

/// Read an answer: per region (by index in `cfg.regions`) that has at least
/// its waiting and running sums and one replica, its load; a region the
/// answer has no complete figures for is absent (a failed probe for it).
/// An answer that is not a successful instant vector is an error.
pub fn parse_answer(cfg: &Config, body: &[u8]) -> Result<HashMap<usize, RegionLoad>, String> {
    if body.len() > MAX_ANSWER_BYTES {
        return Err(format!(
            "the answer is larger than {} KiB",
            MAX_ANSWER_BYTES / 1024
        ));
    }
    let a: Answer =
        serde_json::from_slice(body).map_err(|e| format!("not a Prometheus API answer: {e}"))?;
    if a.status != "success" {
        return Err(format!(
            "status {:?}: {}",
            a.status,
            a.error.as_deref().unwrap_or("no error given")
        ));
    }
    let data = a.data.ok_or("a successful answer without data")?;
    if data.result_type != "vector" {
        return Err(format!(
            "result type {:?}, expected \"vector\"",
            data.result_type
        ));
    }
    let mut seen: HashMap<usize, HashMap<&str, f64>> = HashMap::new();
    let mut capacity: HashMap<usize, CapacitySum> = HashMap::new();
    for s in &data.result {
        let (Some(region), Some(signal)) = (s.metric.get(REGION_LABEL), s.metric.get(SIGNAL_LABEL))
        else {
            continue;
        };
        let Some(i) = cfg.regions.iter().position(|r| &r.name == region) else {
            continue;
        };
        if signal == "cache" {
            let terms = cfg.regions.get(i).and_then(|r| metric(r.engine, "cache"));
            if let Some(name) = terms.and_then(|t| t.first()).and_then(|n| n.first()) {
                let v = parse_sample_value(&s.value.1);
                capacity
                    .entry(i)
                    .or_default()
                    .add(name, |l| s.metric.get(l), v);
            }
            continue;
        }
        let Ok(v) = s.value.1.parse::<f64>() else {
            continue;
        };
        if !v.is_finite() || v < 0.0 {
            continue;
        }
        let Some((name, _)) = SIGNALS.iter().find(|(n, _)| n == signal) else {
            continue;
        };
        seen.entry(i).or_default().insert(name, v);
    }
    let mut out = HashMap::new();
    for (i, sig) in seen {
        let engine = cfg.regions.get(i).map(|r| r.engine);
        let (Some(waiting), Some(running), Some(replicas)) = (
            sig.get("waiting"),
            sig.get("running"),
            sig.get("replicas").filter(|n| **n >= 1.0),
        ) else {
            continue;
        };
        let sample = EngineSample {
            waiting: Some(*waiting),
            running: Some(*running),
            kv_usage: sig.get("kv").map(|v| v.clamp(0.0, 1.0)),
            prefix_queries: sig.get("prefix_queries").copied(),
            prefix_hits: sig.get("prefix_hits").copied(),
            hit_rate: sig.get("hit_rate").map(|v| v.clamp(0.0, 1.0)),
            release: None,
            completed: sig.get("completed").copied(),
            block_tokens: sig
                .get("block")
                .copied()
                .and_then(crate::engines::capacity::block_tokens_of)
                .max(capacity.get(&i).and_then(CapacitySum::block_tokens))
                .or(engine.and_then(EngineKind::default_block_tokens)),
            cache_capacity: capacity.remove(&i).and_then(CapacitySum::into_capacity),
            prompt_tokens: sig.get("prompt_tokens").copied(),
            generation_tokens: sig.get("generation").copied(),
            // Several replicas' start times do not add up: the summed
            // counters tell their restarts.
            process_start_s: None,
        };
        out.insert(
            i,
            RegionLoad {
                sample,
                replicas: replicas.min(f64::from(u32::MAX)) as u32,
                scraped_ms: sig
                    .get("scraped")
                    .filter(|t| **t < 1e11)
                    .map(|t| (t * 1000.0) as u64),
            },
        );
    }
    Ok(out)
}

/// A sample value as the API writes it (Go's formatting: `NaN`, `+Inf`);
/// anything else that is no number reads as NaN, which the capacity
/// checks refuse.
fn parse_sample_value(v: &str) -> f64 {
    match v {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        _ => v.parse::<f64>().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[
              {"name":"eu","cluster":"ce","capacity_rps":5,"load_source":"prometheus"},
              {"name":"us","cluster":"cu","capacity_rps":5,"engine":"sglang","load_source":"prometheus","prometheus_selector":"namespace=\"llm\",site=~\"us-.*\""},
              {"name":"ap","cluster":"ca","capacity_rps":5}],
              "prometheus":{"cluster":"prom"}}"#,
        )
        .unwrap()
    }

    #[test]
    fn one_query_for_every_prometheus_region() {
        let c = cfg();
        let q = fleet_query(&c).unwrap();
        assert!(
            q.contains(r#"sum(vllm:num_requests_waiting{region="eu"})"#),
            "{q}"
        );
        assert!(q.contains(r#"count(vllm:num_requests_running{region="eu"})"#));
        assert!(q.contains(r#"avg(vllm:kv_cache_usage_perc{region="eu"} or vllm:gpu_cache_usage_perc{region="eu"})"#));
        assert!(q.contains(r#"min(timestamp(vllm:num_requests_running{region="eu"}))"#));
        assert!(q.contains(r#"sum(sglang:num_queue_reqs{namespace="llm",site=~"us-.*"})"#));
        // The capacity series come raw, labels and all, to be summed here.
        assert!(
            q.contains(r#"label_replace(label_replace(vllm:cache_config_info{region="eu"},"llm_geo_region","eu","",""),"llm_geo_signal","cache","","")"#),
            "{q}"
        );
        assert!(q.contains(
            r#"label_replace(sglang:max_total_num_tokens{namespace="llm",site=~"us-.*"},"#
        ));
        assert!(!q.contains("\"ap\""), "a scraped region is not queried");
        let path = query_path(&c, "sum(x{a=\"b c\"})");
        assert_eq!(path, "/api/v1/query?query=sum%28x%7Ba%3D%22b%20c%22%7D%29");
        let only_scrape =
            Config::parse(br#"{"regions":[{"name":"a","cluster":"c","capacity_rps":1}]}"#).unwrap();
        assert_eq!(fleet_query(&only_scrape), None);
    }

    #[test]
    fn llamacpp_regions_are_queried_by_their_names() {
        let c = Config::parse(
            br#"{"regions":[
              {"name":"edge","cluster":"ce","capacity_rps":5,"engine":"llamacpp","load_source":"prometheus"}],
              "prometheus":{"cluster":"prom"}}"#,
        )
        .unwrap();
        let q = fleet_query(&c).unwrap();
        let part = |inner: &str, signal: &str| {
            format!(
                r#"label_replace(label_replace({inner},"llm_geo_region","edge","",""),"llm_geo_signal","{signal}","","")"#
            )
        };
        let sel = r#"{region="edge"}"#;
        for (inner, signal) in [
            (format!("sum(llamacpp:requests_deferred{sel})"), "waiting"),
            (format!("sum(llamacpp:requests_processing{sel})"), "running"),
            (format!("count(llamacpp:requests_processing{sel})"), "replicas"),
            // Prefilled and reused prompt tokens are the lookups: each
            // summed over the replicas, then added.
            (
                format!("sum(llamacpp:prompt_tokens_total{sel}) + sum(llamacpp:prompt_tokens_cached_total{sel})"),
                "prefix_queries",
            ),
            (format!("sum(llamacpp:prompt_tokens_cached_total{sel})"), "prefix_hits"),
            (format!("sum(llamacpp:tokens_predicted_total{sel})"), "generation"),
            (format!("min(timestamp(llamacpp:requests_processing{sel}))"), "scraped"),
        ] {
            assert!(q.contains(&part(&inner, signal)), "{signal}: {q}");
        }
        // Nothing it does not export: no KV usage, completions, hit rate
        // or capacity, and no other family's names.
        for signal in ["kv", "completed", "hit_rate", "cache"] {
            assert!(
                !q.contains(&format!(r#""llm_geo_signal","{signal}""#)),
                "{q}"
            );
        }
        assert!(!q.contains("vllm:") && !q.contains("sglang:"), "{q}");
        assert_eq!(q.matches(" or ").count(), 6, "seven signals: {q}");
        let body = answer(&[
            series("edge", "waiting", "3"),
            series("edge", "running", "8"),
            series("edge", "replicas", "2"),
            series("edge", "prefix_queries", "1239780"),
            series("edge", "prefix_hits", "1234570"),
        ]);
        let out = parse_answer(&c, body.as_bytes()).unwrap();
        let s = &out[&0].sample;
        assert_eq!(
            (s.waiting, s.running, out[&0].replicas),
            (Some(3.0), Some(8.0), 2)
        );
        assert_eq!(
            (s.prefix_queries, s.prefix_hits),
            (Some(1_239_780.0), Some(1_234_570.0))
        );
        assert_eq!(
            (s.kv_usage, s.completed, s.cache_capacity.clone()),
            (None, None, None)
        );
    }

    fn series(region: &str, signal: &str, v: &str) -> String {
        format!(
            r#"{{"metric":{{"llm_geo_region":"{region}","llm_geo_signal":"{signal}"}},"value":[1764540000.5,"{v}"]}}"#
        )
    }

    #[test]
    fn answers_are_read_per_region() {
        let c = cfg();
        let body = format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{}]}}}}"#,
            [
                series("eu", "waiting", "7"),
                series("eu", "running", "24"),
                series("eu", "replicas", "3"),
                series("eu", "kv", "0.5"),
                series("eu", "completed", "1200"),
                series("eu", "scraped", "1764539998.25"),
                series("us", "waiting", "1"),
                series("us", "running", "NaN"),
                series("us", "replicas", "2"),
                series("mars", "waiting", "1"),
            ]
            .join(",")
        );
        let out = parse_answer(&c, body.as_bytes()).unwrap();
        let eu = &out[&0];
        assert_eq!(
            (eu.sample.waiting, eu.sample.running),
            (Some(7.0), Some(24.0))
        );
        assert_eq!(eu.replicas, 3);
        assert_eq!(eu.sample.kv_usage, Some(0.5));
        assert_eq!(eu.sample.completed, Some(1200.0));
        assert_eq!(eu.scraped_ms, Some(1_764_539_998_250));
        assert!(!out.contains_key(&1), "a NaN running sum is no figure");
        assert_eq!(out.len(), 1);
    }

    fn cache_series(region: &str, labels: &str, v: &str) -> String {
        format!(
            r#"{{"metric":{{"__name__":"x","llm_geo_region":"{region}","llm_geo_signal":"cache",{labels}}},"value":[1764540000.5,"{v}"]}}"#
        )
    }

    fn answer(series: &[String]) -> String {
        format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{}]}}}}"#,
            series.join(",")
        )
    }

    #[test]
    fn cache_capacity_is_summed_over_replicas_from_the_series() {
        use crate::engines::metrics::CacheCapacity;
        let c = cfg();
        let load = |r: &str| {
            vec![
                series(r, "waiting", "0"),
                series(r, "running", "0"),
                series(r, "replicas", "2"),
            ]
        };
        let mut body = load("eu");
        body.push(cache_series(
            "eu",
            r#""instance":"a","block_size":"16","num_gpu_blocks":"1000""#,
            "1",
        ));
        body.push(cache_series(
            "eu",
            r#""instance":"b","block_size":"16","num_gpu_blocks":"3000""#,
            "1",
        ));
        body.extend(load("us"));
        body.push(cache_series(
            "us",
            r#""instance":"a","tp_rank":"0""#,
            "144870",
        ));
        body.push(cache_series(
            "us",
            r#""instance":"a","tp_rank":"1""#,
            "144870",
        ));
        body.push(cache_series(
            "us",
            r#""instance":"b","tp_rank":"0""#,
            "100000",
        ));
        let out = parse_answer(&c, answer(&body).as_bytes()).unwrap();
        assert_eq!(
            out[&0].sample.cache_capacity,
            Some(CacheCapacity::Tokens(64_000))
        );
        assert_eq!(
            out[&1].sample.cache_capacity,
            Some(CacheCapacity::Tokens(244_870))
        );

        // One replica that has not profiled its memory spoils the sum;
        // none at all is no figure.
        let mut body = load("eu");
        body.push(cache_series(
            "eu",
            r#""instance":"a","block_size":"16","num_gpu_blocks":"1000""#,
            "1",
        ));
        body.push(cache_series(
            "eu",
            r#""instance":"b","block_size":"16","num_gpu_blocks":"None""#,
            "1",
        ));
        body.extend(load("us"));
        body.push(cache_series("us", r#""instance":"a""#, "NaN"));
        let out = parse_answer(&c, answer(&body).as_bytes()).unwrap();
        assert!(
            matches!(&out[&0].sample.cache_capacity, Some(CacheCapacity::Invalid(w)) if w.contains("\"None\""))
        );
        assert!(
            matches!(&out[&1].sample.cache_capacity, Some(CacheCapacity::Invalid(w)) if w.contains("is NaN"))
        );
        let out = parse_answer(&c, answer(&load("eu")).as_bytes()).unwrap();
        assert_eq!(out[&0].sample.cache_capacity, None);
    }

    #[test]
    fn the_block_is_a_label_of_vllms_capacity_series_and_sglangs_page_size() {
        let c = cfg();
        let load = |r: &str| {
            vec![
                series(r, "waiting", "0"),
                series(r, "running", "0"),
                series(r, "replicas", "2"),
            ]
        };
        // vLLM: the largest block over the replicas, even from a series
        // whose pool is not profiled yet; SGLang: its page size.
        let mut body = load("eu");
        body.push(cache_series(
            "eu",
            r#""instance":"a","block_size":"16","num_gpu_blocks":"1000""#,
            "1",
        ));
        body.push(cache_series(
            "eu",
            r#""instance":"b","block_size":"128","num_gpu_blocks":"None""#,
            "1",
        ));
        body.extend(load("us"));
        body.push(series("us", "block", "64"));
        let out = parse_answer(&c, answer(&body).as_bytes()).unwrap();
        assert_eq!(out[&0].sample.block_tokens, Some(128));
        assert_eq!(out[&1].sample.block_tokens, Some(64));
        // None said: vLLM's is unknown, SGLang's its default page of 1; a
        // garbled figure is none.
        let mut body = load("eu");
        body.push(cache_series(
            "eu",
            r#""instance":"a","block_size":"sixteen","num_gpu_blocks":"1000""#,
            "1",
        ));
        body.extend(load("us"));
        body.push(series("us", "block", "0.5"));
        let out = parse_answer(&c, answer(&body).as_bytes()).unwrap();
        assert_eq!(out[&0].sample.block_tokens, None);
        assert_eq!(out[&1].sample.block_tokens, Some(1));
        // The query asks SGLang for it (and its prompt tokens, on which
        // its restarts are seen).
        let q = fleet_query(&c).unwrap();
        assert!(q.contains(r#"max(sglang:page_size{namespace="llm",site=~"us-.*"})"#));
        assert!(q.contains(r#"sum(sglang:prompt_tokens_total{namespace="llm",site=~"us-.*"})"#));
    }

    #[test]
    fn bad_answers_are_errors_never_panics() {
        let c = cfg();
        for (body, want) in [
            (&b"<html>"[..], "not a Prometheus API answer"),
            (br#"{"status":"error","errorType":"bad_data","error":"parse error at char 3"}"#, "parse error at char 3"),
            (br#"{"status":"success"}"#, "without data"),
            (br#"{"status":"success","data":{"resultType":"matrix","result":[]}}"#, "matrix"),
            (br#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":["x","1"]}]}}"#, "not a Prometheus API answer"),
        ] {
            let e = parse_answer(&c, body).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let empty = br#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert!(parse_answer(&c, empty).unwrap().is_empty());
        let huge = vec![b' '; MAX_ANSWER_BYTES + 1];
        assert!(parse_answer(&c, &huge).unwrap_err().contains("larger"));
        // No replica: no figures.
        let zero = format!(
            r#"{{"status":"success","data":{{"resultType":"vector","result":[{},{},{}]}}}}"#,
            series("eu", "waiting", "0"),
            series("eu", "running", "0"),
            series("eu", "replicas", "0")
        );
        assert!(parse_answer(&c, zero.as_bytes()).unwrap().is_empty());
    }
}
