//! The per-request routing decision, parsing included: `Router::route` on
//! OpenAI chat bodies of 2 KB, 32 KB and 256 KB with 3 and 16 regions, next
//! to the naive filter (a `serde_json::Value` of the whole body, every
//! message's text concatenated, one xxh3) timed the same way on the same
//! bodies, and the shared-data calls each decision makes against the issue's
//! bound `2·log2(blocks) + 4`.
//!
//! No criterion: a warm-up, then repetitions of a calibrated number of
//! batches, each batch one pass over a pool of distinct bodies; the figure
//! per repetition is its timed nanoseconds over its requests, reported as the
//! median and the minimum over repetitions. Ours and naive run interleaved,
//! one repetition of each in turn, and their ratio is taken per repetition,
//! so that a busy machine slows both alike.
//!
//! Two states of the prefix directory, rebuilt (untimed) before every batch:
//! * steady: earlier turns of the same conversation were routed, so the
//!   request finds its history cached and only its new tail (the last
//!   assistant reply and the new user turn) is written;
//! * cold: nothing is known, so every checkpoint of the prompt is written.
//!
//! `cargo bench --bench decision` prints a table; `-- --json` one JSON object.

use std::hint::black_box;
use std::time::{Duration, Instant};

use llm_geo_router::config::Config;
use llm_geo_router::decision::cost::Reason;
use llm_geo_router::decision::pipeline::{RouteInputs, Routed, Router};
use llm_geo_router::fleet::snapshot::{RegionState, Snapshot};
use llm_geo_router::request::openai::{self, Endpoint};
use llm_geo_router::request::prefix::PromptHasher;
use llm_geo_router::shared::store::MemoryStore;
use serde_json::{json, Value};

/// Target body sizes.
const SIZES: [usize; 3] = [2 * 1024, 32 * 1024, 256 * 1024];
const REGION_COUNTS: [usize; 2] = [3, 16];
/// Distinct bodies per batch: each one is a request the directory has not
/// seen, so repeating a batch never turns a steady request into a fully
/// cached one.
const POOL: usize = 16;
const WARMUP: Duration = Duration::from_millis(150);
/// Timed time aimed at per repetition.
const REP_TARGET: Duration = Duration::from_millis(20);
const REPS: usize = 15;
/// Issue target for a 32 KB prompt, natively, parsing included.
const TARGET_32K_NS: f64 = 15_000.0;

fn main() -> Result<(), String> {
    let json_out = std::env::args().skip(1).any(|a| a == "--json");
    let mut results = Vec::new();
    for &regions in &REGION_COUNTS {
        let cfg = config(regions)?;
        for &size in &SIZES {
            results.push(run_case(&cfg, size)?);
        }
    }
    if json_out {
        println!("{}", to_json(&results));
    } else {
        print_table(&results);
    }
    Ok(())
}

// ---------------------------------------------------------------- inputs

fn config(regions: usize) -> Result<Config, String> {
    let list: Vec<Value> = (0..regions)
        .map(|i| {
            json!({
                "name": format!("r{i}"),
                "cluster": format!("cluster_r{i}"),
                "capacity_rps": 20,
                // 5 ms for the nearest, then 13 ms further per region.
                "rtt_ms": 5 + 13 * i,
            })
        })
        .collect();
    let doc = json!({ "regions": list });
    let bytes = serde_json::to_vec(&doc).map_err(|e| e.to_string())?;
    Config::parse(&bytes).map_err(|e| e.to_string())
}

/// Every region healthy, some engine load, probe RTTs at their configured
/// values.
fn snapshot(cfg: &Config) -> Snapshot {
    Snapshot {
        version: 1,
        generated_ms: 1,
        regions: cfg
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| RegionState {
                name: r.name.clone(),
                healthy: true,
                rtt_ms: Some(r.rtt_ms),
                running: (4 + i % 5) as f64,
                waiting: 0.0,
                metrics_ok: true,
                ..RegionState::default()
            })
            .collect(),
        ..Snapshot::default()
    }
}

/// Deterministic pseudo-random numbers (PCG-style LCG, high bits).
#[derive(Clone)]
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const WORDS: &[&str] = &[
    "the",
    "request",
    "model",
    "region",
    "latency",
    "cache",
    "prefix",
    "token",
    "user",
    "answer",
    "question",
    "system",
    "assistant",
    "should",
    "would",
    "could",
    "because",
    "however",
    "therefore",
    "first",
    "second",
    "then",
    "after",
    "before",
    "when",
    "where",
    "which",
    "this",
    "that",
    "these",
    "those",
    "with",
    "without",
    "from",
    "into",
    "over",
    "under",
    "between",
    "data",
    "service",
    "server",
    "client",
    "error",
    "value",
    "function",
    "result",
    "example",
    "document",
    "policy",
    "customer",
    "account",
    "invoice",
    "order",
    "shipping",
    "return",
    "refund",
    "product",
    "price",
    "discount",
    "week",
    "month",
    "year",
    "today",
    "please",
    "explain",
    "describe",
    "summarise",
    "compare",
    "list",
    "steps",
    "reason",
    "carefully",
    "important",
    "always",
    "never",
    "only",
    "also",
    "each",
    "every",
    "some",
    "many",
    "few",
    "more",
    "less",
    "most",
    "least",
    "good",
    "better",
    "best",
    "simple",
    "complex",
    "clear",
    "short",
    "long",
    "fast",
    "slow",
    "new",
    "old",
    "large",
    "small",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "has",
    "have",
    "had",
    "do",
    "does",
    "did",
    "can",
    "will",
    "may",
    "must",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "and",
    "or",
    "not",
    "it",
    "its",
    "we",
    "you",
    "they",
    "our",
    "your",
    "their",
    "query",
    "table",
    "column",
    "index",
    "memory",
    "network",
    "queue",
    "engine",
    "prompt",
    "context",
    "window",
    "format",
    "output",
    "input",
    "review",
    "update",
];

fn word(rng: &mut Lcg) -> &'static str {
    WORDS.get(rng.below(WORDS.len())).copied().unwrap_or("the")
}

/// About `bytes` bytes of prose: sentences, paragraphs, the odd quotation,
/// list item and inline code (so the body has escapes like real ones).
fn prose(rng: &mut Lcg, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 64);
    while s.len() < bytes {
        match rng.below(12) {
            0 => s.push_str("\n\n"),
            1 => s.push_str("\n- "),
            _ => {}
        }
        let n = 6 + rng.below(15);
        for i in 0..n {
            let w = word(rng);
            if i == 0 {
                let mut c = w.chars();
                if let Some(f) = c.next() {
                    s.extend(f.to_uppercase());
                    s.push_str(c.as_str());
                }
            } else {
                s.push(' ');
                match rng.below(40) {
                    0 => {
                        s.push('"');
                        s.push_str(w);
                        s.push('"');
                    }
                    1 => {
                        s.push('`');
                        s.push_str(w);
                        s.push_str("()`");
                    }
                    2 => {
                        s.push_str(w);
                        s.push(',');
                    }
                    _ => s.push_str(w),
                }
            }
        }
        s.push_str(if rng.below(8) == 0 { "? " } else { ". " });
    }
    s.truncate(bytes);
    s
}

/// One conversation: system prompt and history (the earlier turns), plus
/// `POOL` different continuations (last assistant reply + new user turn).
struct Conversation {
    system: String,
    history: Vec<String>,
}

/// Share of the body per message: system 35 %, u1 5, a1 15, u2 5, a2 15,
/// u3 5 (history, known in steady state), then a3 15, u4 5 (new).
const HISTORY_SHARE: [f64; 5] = [0.05, 0.15, 0.05, 0.15, 0.05];
const SYSTEM_SHARE: f64 = 0.35;
const REPLY_SHARE: f64 = 0.15;
const TURN_SHARE: f64 = 0.05;

/// `text` is the bytes of message text to generate, chosen so that the JSON
/// body comes out at the target size.
fn conversation(rng: &mut Lcg, text: f64) -> Conversation {
    let part = |share: f64| (text * share) as usize;
    Conversation {
        system: format!(
            "You are a support assistant for an online shop. {}",
            prose(rng, part(SYSTEM_SHARE))
        ),
        history: HISTORY_SHARE.iter().map(|&s| prose(rng, part(s))).collect(),
    }
}

fn role(i: usize) -> &'static str {
    if i % 2 == 0 {
        "user"
    } else {
        "assistant"
    }
}

/// A chat body with the system prompt, the first `turns` history messages
/// and then `tail` (already alternating after them).
fn chat_body(c: &Conversation, turns: usize, tail: &[String]) -> Result<Vec<u8>, String> {
    let mut messages = vec![json!({"role": "system", "content": c.system})];
    for (i, text) in c.history.iter().take(turns).chain(tail).enumerate() {
        messages.push(json!({"role": role(i), "content": text}));
    }
    let body = json!({
        "model": "llama-3.1-70b-instruct",
        "messages": messages,
        "stream": true,
        "max_tokens": 512,
        "temperature": 0.7,
    });
    serde_json::to_vec(&body).map_err(|e| e.to_string())
}

fn continuation(rng: &mut Lcg, text: f64) -> Vec<String> {
    let part = |share: f64| (text * share) as usize;
    vec![prose(rng, part(REPLY_SHARE)), prose(rng, part(TURN_SHARE))]
}

// ---------------------------------------------------------------- routing

struct Env<'a> {
    cfg: &'a Config,
    router: Router,
    snapshot: Snapshot,
    index: Vec<Option<usize>>,
    inflight: Vec<f64>,
}

impl Env<'_> {
    fn route(
        &self,
        store: &mut MemoryStore,
        body: &[u8],
        session: &str,
        now_ms: u64,
    ) -> Result<Routed, String> {
        let inp = RouteInputs {
            endpoint: Endpoint::ChatCompletions,
            body,
            session_header: Some(session),
            residency: None,
            snapshot: Some(&self.snapshot),
            snapshot_index: &self.index,
            inflight: &self.inflight,
            now_ms,
            fallback: false,
        };
        let mut routed = self
            .router
            .route(self.cfg, store, &inp)
            .map_err(|e| format!("{e:?}"))?;
        // The answer starts where it was routed: the prefix and the
        // session are recorded there, as the filter does then.
        let region = routed.decision.region;
        if let Some(l) = routed.learning.as_mut() {
            routed.shared_data_calls += self.router.learn(store, l, region, now_ms);
        }
        Ok(routed)
    }
}

/// A copy of `store` with its contents and fresh counters.
fn copy_store(store: &MemoryStore) -> MemoryStore {
    MemoryStore {
        map: store.map.clone(),
        gets: 0,
        sets: 0,
    }
}

/// Shared-data calls of one request, as the router counts them and as the
/// store saw them.
#[derive(Debug, Clone, Copy)]
struct Calls {
    routed: u32,
    gets: u64,
    sets: u64,
}

impl Calls {
    fn store(&self) -> u64 {
        self.gets + self.sets
    }
}

// ---------------------------------------------------------------- naive

/// What a first filter would do: the whole body as a `Value`, every
/// message's text concatenated, one hash.
fn naive(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let mut text = String::new();
    for m in v.get("messages")?.as_array()? {
        if let Some(r) = m.get("role").and_then(Value::as_str) {
            text.push_str(r);
            text.push('\n');
        }
        match m.get("content") {
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                }
            }
            _ => {}
        }
        text.push('\n');
    }
    Some(xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
}

// ---------------------------------------------------------------- timing

/// Median and minimum ns/request over repetitions.
#[derive(Debug, Clone, Copy)]
struct Timing {
    median_ns: f64,
    min_ns: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn timing(v: &[f64]) -> Timing {
    Timing {
        median_ns: median(v.to_vec()),
        min_ns: v.iter().copied().fold(f64::INFINITY, f64::min),
    }
}

/// One timed variant: runs one batch (`POOL` requests, its untimed
/// preparation included in the call) and returns the batch's timed part.
type Variant<'a> = Box<dyn FnMut() -> Duration + 'a>;

/// Per variant, ns/request of each repetition. Every variant is warmed up
/// and calibrated to about `REP_TARGET` per repetition; then the
/// repetitions run interleaved (one of each variant in turn), so that the
/// variants of one repetition see the same machine and their ratio is
/// meaningful even on a busy host.
fn measure(variants: &mut [Variant]) -> Vec<Vec<f64>> {
    let batches: Vec<u32> = variants
        .iter_mut()
        .map(|run| {
            let (mut timed, mut n) = (Duration::ZERO, 0u32);
            let start = Instant::now();
            while start.elapsed() < WARMUP || n < 3 {
                timed += run();
                n += 1;
            }
            let per_batch = timed.as_secs_f64() / f64::from(n);
            ((REP_TARGET.as_secs_f64() / per_batch.max(1e-9)) as u32).clamp(3, 100_000)
        })
        .collect();
    let mut samples = vec![Vec::with_capacity(REPS); variants.len()];
    for _ in 0..REPS {
        for ((run, &n), out) in variants.iter_mut().zip(&batches).zip(&mut samples) {
            let timed: Duration = (0..n).map(|_| run()).sum();
            out.push(timed.as_nanos() as f64 / (f64::from(n) * POOL as f64));
        }
    }
    samples
}

// ---------------------------------------------------------------- one case

struct CaseResult {
    size: usize,
    regions: usize,
    body_bytes: usize,
    prompt_bytes: u64,
    blocks: u32,
    bound: f64,
    steady: Timing,
    cold: Timing,
    naive: Timing,
    /// Median over repetitions of ours / naive in the same repetition.
    steady_over_naive: f64,
    cold_over_naive: f64,
    steady_calls: Calls,
    cold_calls: Calls,
    steady_reason: Reason,
    steady_cached_tokens: u64,
    prompt_tokens: u64,
}

const NOW_MS: u64 = 1_000_000;

fn run_case(cfg: &Config, size: usize) -> Result<CaseResult, String> {
    let regions = cfg.regions.len();
    let env = Env {
        cfg,
        router: Router::new(cfg),
        snapshot: snapshot(cfg),
        index: (0..regions).map(Some).collect(),
        inflight: vec![0.0; regions],
    };
    let mut rng = Lcg(0x5eed_0000 + size as u64);
    // JSON adds keys, quotes and escapes: size the text so the body hits `size`.
    let text = {
        let mut trial = rng.clone();
        let c = conversation(&mut trial, size as f64);
        let len = chat_body(&c, 5, &continuation(&mut trial, size as f64))?.len();
        size as f64 * size as f64 / len.max(1) as f64
    };

    // Steady: one conversation whose history was routed turn by turn.
    let convo = conversation(&mut rng, text);
    let mut warm = MemoryStore::default();
    for (t, turns) in [1, 3, 5].into_iter().enumerate() {
        let body = chat_body(&convo, turns, &[])?;
        env.route(
            &mut warm,
            &body,
            "conv-steady",
            NOW_MS - 3000 + 1000 * t as u64,
        )?;
    }
    let steady_bodies: Vec<Vec<u8>> = (0..POOL)
        .map(|_| chat_body(&convo, 5, &continuation(&mut rng, text)))
        .collect::<Result<_, _>>()?;

    // Cold: distinct conversations from their first byte, nothing known.
    let cold_bodies: Vec<Vec<u8>> = (0..POOL)
        .map(|_| {
            let c = conversation(&mut rng, text);
            chat_body(&c, 5, &continuation(&mut rng, text))
        })
        .collect::<Result<_, _>>()?;
    let cold_sessions: Vec<String> = (0..POOL).map(|i| format!("conv-cold-{i}")).collect();

    // Calls of one request in each state, counted by the router and by the store.
    let first = |bodies: &[Vec<u8>]| bodies.first().cloned().ok_or("empty pool".to_string());
    let probe_body = first(&steady_bodies)?;
    let mut s = copy_store(&warm);
    let steady_routed = env.route(&mut s, &probe_body, "conv-steady", NOW_MS)?;
    let steady_calls = Calls {
        routed: steady_routed.shared_data_calls,
        gets: s.gets,
        sets: s.sets,
    };
    let mut s = MemoryStore::default();
    let cold_routed = env.route(&mut s, &first(&cold_bodies)?, "conv-cold-0", NOW_MS)?;
    let cold_calls = Calls {
        routed: cold_routed.shared_data_calls,
        gets: s.gets,
        sets: s.sets,
    };
    let seed = cfg.prefix.hash_seed;
    let parsed = openai::parse(
        Endpoint::ChatCompletions,
        &probe_body,
        PromptHasher::new(cfg.prefix.block_bytes, seed),
    )
    .map_err(|e| e.message)?;
    let blocks = parsed.prompt.blocks;
    let bound = 2.0 * f64::from(blocks.max(1)).log2() + 4.0;

    let mut variants: Vec<Variant> = vec![
        Box::new(|| {
            let mut store = copy_store(&warm);
            let t = Instant::now();
            for body in &steady_bodies {
                let r = env.route(&mut store, black_box(body), "conv-steady", NOW_MS);
                black_box(&r);
            }
            t.elapsed()
        }),
        Box::new(|| {
            let mut store = MemoryStore {
                map: std::collections::HashMap::with_capacity_and_hasher(
                    64 * POOL,
                    Default::default(),
                ),
                ..MemoryStore::default()
            };
            let t = Instant::now();
            for (body, session) in cold_bodies.iter().zip(&cold_sessions) {
                let r = env.route(&mut store, black_box(body), session, NOW_MS);
                black_box(&r);
            }
            t.elapsed()
        }),
        Box::new(|| {
            let t = Instant::now();
            for body in &steady_bodies {
                black_box(naive(black_box(body)));
            }
            t.elapsed()
        }),
    ];
    let samples = measure(&mut variants);
    drop(variants);
    let [steady, cold, naive] = [0, 1, 2].map(|i| samples.get(i).cloned().unwrap_or_default());
    // Per repetition, ours over naive of the same repetition.
    let ratio = |ours: &[f64]| median(ours.iter().zip(&naive).map(|(o, n)| o / n).collect());

    Ok(CaseResult {
        size,
        regions,
        body_bytes: probe_body.len(),
        prompt_bytes: parsed.prompt.bytes,
        blocks,
        bound,
        steady: timing(&steady),
        cold: timing(&cold),
        naive: timing(&naive),
        steady_over_naive: ratio(&steady),
        cold_over_naive: ratio(&cold),
        steady_calls,
        cold_calls,
        steady_reason: steady_routed.decision.reason,
        steady_cached_tokens: steady_routed
            .decision
            .costs
            .get(steady_routed.decision.region)
            .map_or(0, |c| c.cached_tokens),
        prompt_tokens: steady_routed.prompt_tokens,
    })
}

// ---------------------------------------------------------------- output

fn size_label(size: usize) -> String {
    format!("{} KB", size / 1024)
}

fn calls_cell(c: &Calls) -> String {
    let mark = if u64::from(c.routed) == c.store() {
        ""
    } else {
        " MISMATCH"
    };
    format!("{} ({}g+{}s){mark}", c.routed, c.gets, c.sets)
}

fn print_table(results: &[CaseResult]) {
    println!(
        "Routing decision per request, parsing included (Router::route over MemoryStore)\n\
         on {} ({} CPUs).",
        cpu_model(),
        cpus()
    );
    println!(
        "ns/request: median (min) of {REPS} interleaved repetitions; req/s from the median;\n\
         naive = serde_json::Value of the body + every message's text concatenated + one xxh3;\n\
         ours/nv = median over repetitions of steady / naive in the same repetition."
    );
    println!(
        "calls: shared-data calls per request, Routed.shared_data_calls (store gets+sets);\n\
         bound = 2*log2(blocks)+4, blocks = prompt bytes / 64.\n"
    );
    println!(
        "{:<6} {:>3} {:>8} {:>6} | {:>17} {:>9} | {:>17} | {:>17} {:>7} | {:>14} {:>14} {:>6}",
        "body",
        "reg",
        "bytes",
        "blocks",
        "steady ns/req",
        "req/s",
        "cold ns/req",
        "naive ns/req",
        "ours/nv",
        "calls steady",
        "calls cold",
        "bound"
    );
    for r in results {
        println!(
            "{:<6} {:>3} {:>8} {:>6} | {:>17} {:>9.0} | {:>17} | {:>17} {:>7.2} | {:>14} {:>14} {:>6.1}",
            size_label(r.size),
            r.regions,
            r.body_bytes,
            r.blocks,
            format!("{:.0} ({:.0})", r.steady.median_ns, r.steady.min_ns),
            1e9 / r.steady.median_ns,
            format!("{:.0} ({:.0})", r.cold.median_ns, r.cold.min_ns),
            format!("{:.0} ({:.0})", r.naive.median_ns, r.naive.min_ns),
            r.steady_over_naive,
            calls_cell(&r.steady_calls),
            calls_cell(&r.cold_calls),
            r.bound,
        );
    }
    println!();
    for r in results {
        println!(
            "{} / {} regions: steady turn routed with reason={}, {} of {} prompt tokens \
             cached; prompt {} B",
            size_label(r.size),
            r.regions,
            r.steady_reason.as_str(),
            r.steady_cached_tokens,
            r.prompt_tokens,
            r.prompt_bytes,
        );
    }
    println!();
    for r in results.iter().filter(|r| r.size == 32 * 1024) {
        let verdict = if r.steady.median_ns <= TARGET_32K_NS && r.cold.median_ns <= TARGET_32K_NS {
            "met"
        } else {
            "MISSED"
        };
        println!(
            "target <= {:.0} us for 32 KB, {} regions: {verdict} (steady {:.1} us, cold {:.1} us)",
            TARGET_32K_NS / 1000.0,
            r.regions,
            r.steady.median_ns / 1000.0,
            r.cold.median_ns / 1000.0
        );
    }
    for r in results {
        let ok = |c: &Calls| {
            if f64::from(c.routed) <= r.bound {
                "within"
            } else {
                "OVER"
            }
        };
        println!(
            "calls bound {:.1} for {} / {} regions: steady {} {}, cold {} {}",
            r.bound,
            size_label(r.size),
            r.regions,
            r.steady_calls.routed,
            ok(&r.steady_calls),
            r.cold_calls.routed,
            ok(&r.cold_calls),
        );
    }
}

fn timing_json(t: &Timing) -> Value {
    json!({
        "median_ns": t.median_ns,
        "min_ns": t.min_ns,
        "requests_per_s": 1e9 / t.median_ns,
    })
}

fn calls_json(c: &Calls, bound: f64) -> Value {
    json!({
        "routed": c.routed,
        "store_gets": c.gets,
        "store_sets": c.sets,
        "consistent": u64::from(c.routed) == c.store(),
        "within_bound": f64::from(c.routed) <= bound,
    })
}

fn to_json(results: &[CaseResult]) -> Value {
    let cases: Vec<Value> = results
        .iter()
        .map(|r| {
            json!({
                "body_target_bytes": r.size,
                "regions": r.regions,
                "body_bytes": r.body_bytes,
                "prompt_bytes": r.prompt_bytes,
                "blocks": r.blocks,
                "calls_bound": r.bound,
                "steady": timing_json(&r.steady),
                "cold": timing_json(&r.cold),
                "naive": timing_json(&r.naive),
                "ratio_steady_over_naive": r.steady_over_naive,
                "ratio_cold_over_naive": r.cold_over_naive,
                "steady_calls": calls_json(&r.steady_calls, r.bound),
                "cold_calls": calls_json(&r.cold_calls, r.bound),
                "steady_reason": r.steady_reason.as_str(),
                "steady_cached_tokens": r.steady_cached_tokens,
                "prompt_tokens": r.prompt_tokens,
            })
        })
        .collect();
    json!({
        "bench": "decision",
        "repetitions": REPS,
        "pool": POOL,
        "target_32k_ns": TARGET_32K_NS,
        "cpus": cpus(),
        "cpu_model": cpu_model(),
        "cases": cases,
    })
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}
