//! The checks behind each fuzz target. Every function takes the raw input,
//! runs one parser of `llm_geo_router` on it and asserts what must hold for
//! any input: no panic (the library denies unwrap, expect, panic and
//! indexing, so any panic is a finding), results within their documented
//! bounds, and round trips where the format has an encoder.
//!
//! The libFuzzer binaries in `fuzz_targets/` call these functions; so does
//! `cargo test --no-default-features` (tests/corpus.rs), the stable fallback
//! that runs them over the committed corpus and deterministic mutations.

use llm_geo_router::config::Config;
use llm_geo_router::cache::directory::{layout_of, Directory};
use llm_geo_router::engines::metrics::{self, EngineKind, EngineSample, MetricsError, Sample};
use llm_geo_router::request::prefix::PromptHasher;
use llm_geo_router::request::openai::{self, Endpoint, InferenceRequest};
use llm_geo_router::decision::pipeline::{RouteInputs, Router};
use llm_geo_router::cache::sessions::Sessions;
use llm_geo_router::fleet::snapshot::Snapshot;
use llm_geo_router::shared::store::{SetOutcome, SharedStore};
use llm_geo_router::cache::exchange;
use llm_geo_router::fleet::ladder;
use llm_geo_router::roots::guard;
use llm_geo_router::learning::usage::UsageScan;

/// The plugin configuration of `envoy/envoy.yaml` (the demo).
pub const DEMO_CONFIG: &str = include_str!("../corpus/config/envoy-demo.json");

/// The request keys the router and the guard read, and one nobody sends.
const KEYS: [&str; 11] = [
    "model",
    "messages",
    "prompt",
    "input",
    "instructions",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "stream",
    "user",
    "absent_key",
];

// ---------------------------------------------------------------- request

/// `openai::parse` for both endpoints, `body_kind`,
/// `top_level_value_span`, and the guard's body rewrites that build on them;
/// the same bytes read as an answer: its stored response id and its usage.
pub fn request(data: &[u8]) {
    let first = data.iter().find(|b| !b.is_ascii_whitespace());
    let kind = openai::body_kind(data);
    assert_eq!(kind == openai::BodyKind::Json, first == Some(&b'{'));
    assert_eq!(kind == openai::BodyKind::Blank, first.is_none());

    // An answer's first bytes, whole or in any split: the response id the
    // router would record is a usable id, and found the same either way.
    let whole = llm_geo_router::cache::stored_responses::find_id(data);
    assert!(whole.is_none_or(llm_geo_router::cache::stored_responses::valid_id));
    let mut head = llm_geo_router::cache::stored_responses::Head::default();
    let mut found = None;
    for chunk in data.chunks(7) {
        let n = head.wanted(chunk.len());
        if n == 0 {
            break;
        }
        if let Some(id) = head.push(chunk.get(..n).unwrap_or_default()) {
            found = Some(id);
            break;
        }
    }
    if data.len() <= llm_geo_router::cache::stored_responses::HEAD_BYTES {
        assert_eq!(found.as_deref(), whole);
    }
    // An answer's bytes, whole or in any split: the usage the router would
    // report is found the same either way (the key and the object may be
    // cut anywhere), and within the answer's own figures.
    let mut whole = UsageScan::default();
    whole.push(data);
    let usage = whole.usage();
    for step in [1, 7, 64] {
        let mut scan = UsageScan::default();
        for chunk in data.chunks(step) {
            scan.push(chunk);
        }
        assert_eq!(scan.usage(), usage, "chunks of {step}");
    }
    if let Some(u) = usage {
        assert!(u.cached_tokens.is_none_or(|c| c <= u.prompt_tokens));
    }
    let path = String::from_utf8_lossy(data);
    assert!(
        llm_geo_router::cache::stored_responses::path_id(&path).is_none_or(llm_geo_router::cache::stored_responses::valid_id)
    );

    for endpoint in [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Responses,
    ] {
        let counted = openai::parse(endpoint, data, PromptHasher::counting_only());
        let hashed = openai::parse(endpoint, data, PromptHasher::new(16, 7));
        match (&counted, &hashed) {
            (Ok(c), Ok(h)) => {
                // Hashing changes what is recorded, never what is accepted.
                assert_eq!(c.prompt.bytes, h.prompt.bytes);
                assert_eq!((&c.model, c.stream, &c.user), (&h.model, h.stream, &h.user));
                check_accepted(endpoint, data, h);
            }
            (Err(c), Err(h)) => {
                assert_eq!(c, h);
                assert!(!c.message.is_empty());
            }
            _ => panic!("the hasher changed whether the body parses: {counted:?} / {hashed:?}"),
        }
    }

    // The span scanner runs only on bodies `parse` accepted, but it must
    // not panic on anything, and whatever it returns must be in bounds.
    for key in KEYS {
        if let Some(span) = openai::top_level_value_span(data, key) {
            assert!(span.start <= span.end && span.end <= data.len());
        }
    }
}

fn is_undecodable_but_valid(e: &serde_json::Error) -> bool {
    let m = e.to_string();
    m.contains("surrogate")
        || m.contains("hex escape")
        || m.contains("unicode code point")
        || m.contains("number out of range")
}

fn check_accepted(endpoint: Endpoint, data: &[u8], req: &InferenceRequest) {
    // Whatever `parse` accepts is one JSON object and nothing else.
    assert_eq!(openai::body_kind(data), openai::BodyKind::Json);
    // Two things are valid JSON grammar that serde_json's `Value` refuses
    // to decode: a `\uXXXX` escape of a lone surrogate (RFC 8259 section
    // 8.2) and a number beyond f64 (section 6). `parse` skips the members it
    // does not read without decoding them, so those are the allowed
    // mismatches; everything else `Value` refuses, `parse` must refuse too.
    let value: serde_json::Value = match serde_json::from_slice(data) {
        Ok(v) => v,
        Err(e) if is_undecodable_but_valid(&e) => return,
        Err(e) => panic!("parse accepted a body serde_json rejects: {e}"),
    };
    assert!(value.is_object());

    let p = &req.prompt;
    assert_eq!(p.blocks as usize, p.hashes.len());
    assert_eq!(u64::from(p.blocks), p.bytes / 16);
    // The first and last blocks and the checkpoints are in the request's
    // cache namespace, as `block_hash` gives every block.
    assert_eq!(p.first_block, p.block_hash(0));
    assert_eq!(
        p.last_block,
        p.hashes.len().checked_sub(1).and_then(|i| p.block_hash(i))
    );
    assert!(p.checkpoints.iter().all(|c| c.blocks >= 1
        && c.blocks <= p.blocks
        && p.block_hash(c.blocks as usize - 1) == Some(c.hash)));
    for tpb in [0.0, 2.0, 0.25, 1e300, -1.0, f64::NAN] {
        let _ = llm_geo_router::fleet::tokens::tokens_of(req.prompt.bytes, tpb);
    }

    // On an accepted body every member's span is exactly its JSON value,
    // and the scalars `parse` returned are the ones in those spans.
    for key in KEYS {
        let Some(span) = openai::top_level_value_span(data, key) else {
            continue;
        };
        let Some(raw) = data.get(span) else {
            panic!("span of {key:?} out of bounds");
        };
        let member: serde_json::Value = match serde_json::from_slice(raw) {
            Ok(v) => v,
            Err(e) => panic!("span of {key:?} is not one JSON value: {e}"),
        };
        match (key, &member) {
            ("model", serde_json::Value::String(s)) => assert_eq!(req.model.as_ref(), Some(s)),
            ("user", serde_json::Value::String(s)) => assert_eq!(req.user.as_ref(), Some(s)),
            ("stream", serde_json::Value::Bool(b)) => assert_eq!(req.stream, *b),
            ("max_tokens", serde_json::Value::Number(n))
                if n.is_u64() && endpoint != Endpoint::Responses =>
            {
                assert_eq!(req.max_tokens, n.as_u64())
            }
            ("max_output_tokens", serde_json::Value::Number(n))
                if n.is_u64() && endpoint == Endpoint::Responses =>
            {
                assert_eq!(req.max_tokens, n.as_u64())
            }
            ("max_completion_tokens", serde_json::Value::Number(n))
                if n.is_u64() && endpoint != Endpoint::Responses =>
            {
                assert_eq!(req.max_completion_tokens, n.as_u64())
            }
            ("absent_key", _) => assert!(value.get("absent_key").is_some()),
            _ => {}
        }
    }

    // The guard's rewrites must leave a body that still parses, with the
    // change they promise.
    if let Some(out) = guard::rewrite_model(data, "fuzz/model") {
        match openai::parse(endpoint, &out, PromptHasher::counting_only()) {
            Ok(r) => {
                assert_eq!(r.model.as_deref(), Some("fuzz/model"));
                assert_eq!(r.prompt.bytes, req.prompt.bytes);
            }
            Err(e) => panic!("rewrite_model made an invalid body: {}", e.message),
        }
    }
    let limit = 100;
    let clamped = guard::clamp_max_tokens(endpoint, data, req, limit);
    if let Some(out) = &clamped {
        match openai::parse(endpoint, out, PromptHasher::counting_only()) {
            Ok(r) => {
                assert!(r.max_tokens.is_none_or(|v| v <= limit));
                assert!(r.max_completion_tokens.is_none_or(|v| v <= limit));
                assert!(r.max_tokens.is_some() || r.max_completion_tokens.is_some());
                assert_eq!(r.prompt.bytes, req.prompt.bytes);
            }
            Err(e) => panic!("clamp_max_tokens made an invalid body: {}", e.message),
        }
    } else {
        assert!(req.max_tokens.is_none_or(|v| v <= limit));
        assert!(req.max_completion_tokens.is_none_or(|v| v <= limit));
    }
}

// ---------------------------------------------------------------- metrics

const RELEASE_LABEL: &str = "vllm:cache_config_info/release";

/// `parse_engine_metrics` for every engine family, with and without a
/// release label, plus `lines` and `Sample::parse` on every line.
pub fn metrics(data: &[u8]) {
    for kind in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Llamacpp] {
        let plain = metrics::parse_engine_metrics(kind, data, None);
        let labelled = metrics::parse_engine_metrics(kind, data, Some(RELEASE_LABEL));
        if let Ok(s) = &plain {
            check_sample(s);
            assert_eq!(s.release, None);
        }
        if let Ok(s) = &labelled {
            check_sample(s);
        }
        // A failed load scrape names metrics, never more of the payload.
        if let Err(MetricsError::NoLoadSeries {
            first_metric,
            first_namespaced,
            ..
        }) = &plain
        {
            for name in std::iter::once(first_metric).chain(first_namespaced) {
                assert!(name.len() <= metrics::MAX_NAME_SHOWN, "{name}");
                assert!(name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'));
            }
        }
        // Asking for a release label may add a release and may find a line
        // of its metric that is not UTF-8; it changes nothing else.
        match (&plain, &labelled) {
            (Ok(p), Ok(l)) => assert_eq!(
                p,
                &EngineSample {
                    release: None,
                    ..l.clone()
                }
            ),
            (Err(_), Err(_)) | (Ok(_), Err(MetricsError::NotUtf8 { .. })) => {}
            // The release metric's line may be the only sample.
            (Err(MetricsError::NoSamples { .. }), Ok(_)) => {}
            other => panic!("release label changed the outcome: {other:?}"),
        }
        assert!(matches!(
            metrics::parse_engine_metrics(kind, data, Some("no slash")),
            Err(MetricsError::InvalidReleaseLabel { .. })
        ));
    }

    let mut count = 0;
    for line in metrics::lines(data) {
        count += 1;
        assert_eq!(line.number, count);
        assert!(!line.bytes.contains(&b'\n'));
        if let Ok(text) = std::str::from_utf8(line.bytes) {
            check_sample_line(text);
        }
    }
    let newlines = data.iter().filter(|&&b| b == b'\n').count();
    let unterminated = usize::from(!data.is_empty() && data.last() != Some(&b'\n'));
    assert_eq!(count, newlines + unterminated);

    // The line parser on the whole input as one line, too.
    if let Ok(text) = std::str::from_utf8(data) {
        check_sample_line(text);
    }
}

fn check_sample(s: &EngineSample) {
    // Without a load figure the scrape is refused, never an idle engine.
    assert!(s.waiting.is_some() || s.running.is_some());
    for count in [s.waiting, s.running, s.prefix_queries, s.prefix_hits]
        .into_iter()
        .flatten()
    {
        assert!(count.is_finite() && count >= 0.0, "count {count}");
    }
    for ratio in [s.kv_usage, s.hit_rate].into_iter().flatten() {
        assert!((0.0..=1.0).contains(&ratio), "ratio {ratio}");
    }
}

fn check_sample_line(text: &str) {
    let Some(sample) = Sample::parse(text) else {
        return;
    };
    assert!(!sample.name.is_empty());
    assert!(text.contains(sample.name));
    assert!(sample
        .name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'));
    for label in ["model_name", "engine", "le", "release", "x"] {
        if let Some(v) = sample.label(label) {
            assert!(v.len() <= text.len());
        }
    }
}

// ----------------------------------------------------------------- config

/// A fixed chat body whose prompt spans several prefix blocks.
fn chat_body() -> Vec<u8> {
    let turn = "Summarise the following paragraph about regional routing. ".repeat(12);
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"You are terse."}},{{"role":"user","content":"{turn}"}}],"user":"u-1"}}"#
    )
    .into_bytes()
}

/// `Config::parse`, then `validate` again and every helper that runs on a
/// valid configuration, including one routing decision over it.
pub fn config(data: &[u8]) {
    let cfg = match Config::parse(data) {
        Ok(cfg) => cfg,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    if let Err(e) = cfg.validate() {
        panic!("parse accepted a configuration validate refuses: {e}");
    }
    let n = cfg.regions.len();
    assert!(n >= 1);
    assert!(cfg.default_region_index() < n);
    assert!(cfg.nearest_configured_region() < n);
    for i in 0..n {
        assert!(cfg.region_authority(i).is_some());
    }
    assert!(cfg.region_authority(n).is_none());
    for residency in cfg.residency.allowed.keys() {
        match cfg.residency_mask(residency) {
            Some(mask) => assert_eq!(mask.len(), n),
            None => panic!("allow-listed residency {residency:?} has no mask"),
        }
    }
    assert!(cfg.residency_mask("\u{0}not-a-residency\u{0}").is_none());
    for level in 0..=ladder::MAX_LEVEL.saturating_add(1) {
        for tier in cfg.tiers.names.iter().map(String::as_str).chain(["?"]) {
            if let Some(policy) = cfg.tier_policy(level, tier) {
                let _ = guard::needs_body(policy);
                let _ = policy.is_noop();
            }
        }
    }
    let _ = guard::is_operator(&cfg, Some("Bearer fuzz"));

    let snapshot = Snapshot::all_healthy(&cfg);
    assert_eq!(snapshot.regions.len(), n);
    // Exact but for the float rounding the snapshot target documents
    // (`rtt_ms` has no upper bound).
    match Snapshot::decode(&snapshot.encode()) {
        Ok(again) => assert!(
            again == snapshot
                || same_up_to_ulps(&json_of(&again.encode()), &json_of(&snapshot.encode()), 4)
        ),
        Err(e) => panic!("the all-healthy snapshot does not decode: {e}"),
    }

    // One decision over the configuration, as the router filter makes it.
    let router = Router::new(&cfg);
    let mut store = llm_geo_router::shared::store::MemoryStore::default();
    let index: Vec<Option<usize>> = (0..n).map(Some).collect();
    let inflight = vec![0.0; n];
    let body = chat_body();
    let inputs = RouteInputs {
        endpoint: Endpoint::ChatCompletions,
        body: &body,
        session_header: Some("session-1"),
        residency: cfg.residency.allowed.keys().next().map(String::as_str),
        snapshot: Some(&snapshot),
        snapshot_index: &index,
        inflight: &inflight,
        now_ms: 1_000_000,
        fallback: false,
    };
    if let Ok(routed) = router.route(&cfg, &mut store, &inputs) {
        assert!(routed.decision.region < n);
        assert_eq!(routed.decision.costs.len(), n);
    }
}

// --------------------------------------------------------------- snapshot

/// `Snapshot::decode`; for anything it accepts, the level is in range and
/// encoding then decoding gives the same snapshot, except that an `f64` may
/// come back a few units in the last place off: serde_json without its
/// `float_roundtrip` feature parses some 17-digit decimals inexactly (found
/// by this target; fuzz/corpus/snapshot/float-off-by-one-ulp). Every other
/// field must be identical.
pub fn snapshot(data: &[u8]) {
    let Ok(s) = Snapshot::decode(data) else {
        return;
    };
    assert!(s.level <= ladder::MAX_LEVEL);
    let bytes = s.encode();
    assert!(!bytes.is_empty());
    let again = match Snapshot::decode(&bytes) {
        Ok(again) => again,
        Err(e) => panic!("decode(encode(x)) failed: {e} on {}", show(&bytes)),
    };
    if again != s {
        let (a, b) = (json_of(&s.encode()), json_of(&again.encode()));
        assert!(
            same_up_to_ulps(&a, &b, 4),
            "decode(encode(x)) != x beyond float rounding for {}",
            show(&bytes)
        );
    }
    for r in &s.regions {
        assert!(s.region(&r.name).is_some());
    }
    let _ = s.is_fresh(u64::MAX, 0);
    let _ = s.is_fresh(0, u64::MAX);
}

fn json_of(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap_or(serde_json::Value::Null)
}

/// Equal JSON trees, numbers compared as f64 within `ulps` units in the
/// last place (integers exactly).
fn same_up_to_ulps(a: &serde_json::Value, b: &serde_json::Value, ulps: u64) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(x), Some(y)) => x == y,
            _ => match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => {
                    x == y
                        || (x.signum() == y.signum() && x.to_bits().abs_diff(y.to_bits()) <= ulps)
                }
                _ => false,
            },
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_up_to_ulps(x, y, ulps))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_up_to_ulps(v, w, ulps)))
        }
        _ => a == b,
    }
}

fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// --------------------------------------------------------- shared records

/// A shared-data store whose reads return values taken from the fuzz
/// input, in order: each read consumes one chunk `len ‖ bytes`, where a
/// length of 0xff reads "absent" and 0xfe a host error. Writes succeed.
pub struct ScriptedStore<'a> {
    rest: &'a [u8],
    cas: u32,
    pub gets: u32,
}

impl<'a> ScriptedStore<'a> {
    pub fn new(rest: &'a [u8]) -> Self {
        ScriptedStore {
            rest,
            cas: 0,
            gets: 0,
        }
    }
}

impl SharedStore for ScriptedStore<'_> {
    fn get(&mut self, _key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        self.gets += 1;
        let Some((&len, tail)) = self.rest.split_first() else {
            return Ok(None);
        };
        self.rest = tail;
        match len {
            0xff => Ok(None),
            0xfe => Err("scripted host error".into()),
            _ => {
                let len = usize::from(len).min(tail.len());
                let (value, tail) = tail.split_at(len);
                self.rest = tail;
                self.cas = self.cas.wrapping_add(1);
                Ok(Some((value.to_vec(), self.cas)))
            }
        }
    }

    fn set(&mut self, _key: &str, _value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
        // Alternate outcomes so the directory's CAS-retry path runs too.
        Ok(if cas.is_some() && self.cas % 2 == 1 {
            SetOutcome::CasMismatch
        } else {
            SetOutcome::Stored
        })
    }
}

/// The prefix directory's and the session records' decoding of shared-data
/// values (private in `directory.rs` / `session.rs`), reached through their
/// public `lookup`/`record` and through one full routing decision.
/// Input: `now_ms (u64 LE) ‖ chunks` (see [`ScriptedStore`]).
pub fn shared_records(data: &[u8]) {
    let Ok(cfg) = Config::parse(DEMO_CONFIG.as_bytes()) else {
        panic!("the demo configuration does not parse");
    };
    let (now, rest) = match data.split_first_chunk::<8>() {
        Some((now, rest)) => (u64::from_le_bytes(*now), rest),
        None => (0, data),
    };
    let n = cfg.regions.len();
    let body = chat_body();
    let mut hasher = PromptHasher::new(cfg.prefix.block_bytes, cfg.prefix.hash_seed);
    hasher.feed(&body);
    let prompt = hasher.finish();

    let router = Router::new(&cfg);
    let layout = layout_of(cfg.regions.iter().map(|r| r.name.as_str()));
    assert_eq!(router.dir.layout, layout);

    let dir: Directory = router.dir;
    let mut store = ScriptedStore::new(rest);
    let mut lookup = dir.lookup(&mut store, &prompt.checkpoints, now);
    assert_eq!(lookup.cached_blocks.len(), n);
    let held_max = prompt.checkpoints.last().map_or(0, |c| c.blocks);
    assert!(lookup.cached_blocks.iter().all(|&b| b <= held_max));
    let region = usize::try_from(now % 4).unwrap_or(0);
    let end = (prompt.blocks, prompt.last_block.unwrap_or(0));
    dir.extend(
        &mut lookup,
        &prompt.checkpoints,
        |i| prompt.block_hash(i),
        now,
        &[],
    );
    assert!(lookup.cached_blocks.iter().all(|&b| b <= prompt.blocks));
    let _ = dir.record(
        &mut store,
        &mut lookup,
        &prompt.checkpoints,
        region,
        now,
        end,
    );

    let sessions: Sessions = router.sessions;
    let entry = sessions.lookup(&mut store, "session-1", now);
    if let Some((_, ts)) = entry.last {
        assert!(now.saturating_sub(ts) < sessions.ttl_ms);
    }
    assert!(entry.prefix.is_none_or(|(blocks, _)| blocks > 0));
    let _ = sessions.record(&mut store, entry, 0, now, (prompt.blocks, 0));

    // The same lookup within per-region horizons, or an LRU cache over a
    // clock read from the input (garbage included), each since a restart
    // time read from it too, never believes more;
    // the ring of recent prefills decodes from anything without a trap.
    let horizons: Vec<u64> = (0..n)
        .map(|i| now.rotate_left(i as u32 * 7) % 100_000)
        .collect();
    let mut ring_store = ScriptedStore::new(rest);
    let (ring, _) = llm_geo_router::cache::directory::RecentIntake::read(&mut ring_store);
    let clock: Vec<(u64, f64)> = rest
        .chunks_exact(4)
        .scan(0u64, |t, c| {
            *t += u64::from(c[0]) * 10;
            Some((*t, f64::from(u32::from(c[1]) * 100 + u32::from(c[2]))))
        })
        .collect();
    let merged = ring.merged(0, &clock);
    assert!(merged.windows(2).all(|w| w[0].0 <= w[1].0), "{merged:?}");
    let keep: Vec<llm_geo_router::cache::directory::Retention> = horizons
        .iter()
        .enumerate()
        .map(|(i, h)| llm_geo_router::cache::directory::Retention {
            keep: if i % 2 == 0 {
                llm_geo_router::cache::directory::Keep::Horizon(*h)
            } else {
                llm_geo_router::cache::directory::Keep::Lru(llm_geo_router::cache::directory::Lru {
                    free_tokens: (*h % 5000) as f64,
                    tokens_per_block: 16.0,
                    clock: &merged,
                })
            },
            since_ms: if i % 3 == 0 {
                0
            } else {
                now.saturating_sub(*h)
            },
        })
        .collect();
    let within = dir.lookup_within(
        &mut ScriptedStore::new(rest),
        &prompt.checkpoints,
        now,
        &keep,
    );
    let plain = dir.lookup(&mut ScriptedStore::new(rest), &prompt.checkpoints, now);
    assert!(within
        .cached_blocks
        .iter()
        .zip(&plain.cached_blocks)
        .all(|(w, p)| w <= p));

    // The same bytes as a queue message: a usage report, if one, round
    // trips, and whatever it says the calibration stays in its ranges.
    if let Some(r) = llm_geo_router::learning::usage::UsageReport::decode(rest) {
        assert_eq!(
            llm_geo_router::learning::usage::UsageReport::decode(&r.encode()),
            Some(r.clone())
        );
        let mut c = llm_geo_router::learning::calibration::RegionCalibration::default();
        // In blocks of the engine's or not, the ranges hold.
        c.block_tokens = [None, Some(1), Some(16), Some(128)]
            .get((now % 4) as usize)
            .copied()
            .flatten();
        for _ in 0..3 {
            let _ = c.on_report(&r);
        }
        assert!(c
            .tokens_per_byte()
            .is_none_or(|t| t.is_finite() && (0.01..=4.0).contains(&t)));
        assert!(c.reliability().is_none_or(|v| (0.0..=1.0).contains(&v)));
        assert!(c
            .capacity_tokens()
            .is_none_or(|v| v.is_finite() && v >= 1.0));
        let _ = c.horizon_ms(now);
    }

    // The whole decision over the same kind of values.
    let snapshot = Snapshot::all_healthy(&cfg);
    let index: Vec<Option<usize>> = (0..n).map(Some).collect();
    let inflight = vec![0.0; n];
    let mut store = ScriptedStore::new(rest);
    let inputs = chat_inputs(&body, &snapshot, &index, &inflight, now);
    match router.route(&cfg, &mut store, &inputs) {
        Ok(routed) => {
            assert!(routed.decision.region < n);
            assert_eq!(routed.decision.costs.len(), n);
        }
        Err(e) => panic!("a valid body was refused: {e:?}"),
    }

    // A peer's exchange message from the same bytes (garbage, mostly): a
    // refusal or a message that re-encodes to the very bytes, then merged
    // into the directory over shared data read from the input. Framed (a
    // head of this layout and a checksum made for the bytes, so that the
    // decoder past the checksum is reached), and its every single-bit
    // change refused.
    let layout = exchange::layout(&cfg);
    let max = cfg.exchange.max_message_bytes as usize;
    let mut framed = b"LGRX".to_vec();
    framed.push(exchange::VERSION);
    framed.push(0);
    framed.extend_from_slice(&layout.to_le_bytes());
    framed.extend_from_slice(rest);
    let framed = exchange::seal(framed);
    if framed.len() > 10 {
        let at = 10 + usize::try_from(now).unwrap_or(0) % (framed.len() - 10);
        let mut damaged = framed.clone();
        if let Some(b) = damaged.get_mut(at) {
            *b ^= 1 << (now % 8);
        }
        assert!(exchange::Message::decode(&damaged, layout, n, max).is_err());
    }
    for bytes in [rest, &framed[..]] {
        if let Ok(m) = exchange::Message::decode(bytes, layout, n, max) {
            assert_eq!(m.encode(layout, n), bytes);
            struct Into<'a> {
                dir: Directory,
                store: ScriptedStore<'a>,
            }
            impl exchange::Apply for Into<'_> {
                fn apply(&mut self, _origin: u64, body: &exchange::Body) {
                    if let exchange::Body::Placement {
                        region,
                        stamp,
                        blocks,
                        tag,
                        hashes,
                    } = body
                    {
                        let changed = self.dir.merge(
                            &mut self.store,
                            hashes,
                            usize::from(*region),
                            *stamp,
                            (*blocks, u64::from(*tag)),
                        );
                        assert!(changed as usize <= hashes.len());
                    }
                }
            }
            let mut x = exchange::Exchange::new(&cfg, 1);
            let mut into = Into {
                dir,
                store: ScriptedStore::new(rest),
            };
            let _ = x.merge(m, now, &mut into);
            let out = x.take_message(
                exchange::Load {
                    taken_ms: now,
                    arrivals: 0,
                    inflight: vec![0; n],
                },
                now,
            );
            assert!(out.len() <= max);
            assert!(exchange::Message::decode(&out, layout, n, max).is_ok());
        }
    }
}

/// The routing inputs of a chat request with session `session-1` and no
/// residency pin, as the router filter gathers them.
fn chat_inputs<'a>(
    body: &'a [u8],
    snapshot: &'a Snapshot,
    index: &'a [Option<usize>],
    inflight: &'a [f64],
    now_ms: u64,
) -> RouteInputs<'a> {
    RouteInputs {
        endpoint: Endpoint::ChatCompletions,
        body,
        session_header: Some("session-1"),
        residency: None,
        snapshot: Some(snapshot),
        snapshot_index: index,
        inflight,
        now_ms,
        fallback: false,
    }
}

/// A seed for [`shared_records`] made of real records: the values a second
/// routing decision reads after a first one wrote them, for 1..=`turns`
/// prior turns spread over the demo's regions.
pub fn shared_records_seed(now: u64, turns: u64) -> Vec<u8> {
    struct Recording<'a> {
        inner: &'a mut llm_geo_router::shared::store::MemoryStore,
        script: Vec<u8>,
    }
    impl SharedStore for Recording<'_> {
        fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
            let got = self.inner.get(key)?;
            match &got {
                Some((v, _)) if v.len() < 0xfe => {
                    self.script.push(v.len() as u8);
                    self.script.extend_from_slice(v);
                }
                _ => self.script.push(0xff),
            }
            Ok(got)
        }
        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
            self.inner.set(key, value, cas)
        }
    }
    let Ok(cfg) = Config::parse(DEMO_CONFIG.as_bytes()) else {
        return Vec::new();
    };
    let n = cfg.regions.len();
    let router = Router::new(&cfg);
    let snapshot = Snapshot::all_healthy(&cfg);
    let index: Vec<Option<usize>> = (0..n).map(Some).collect();
    let body = chat_body();
    let mut memory = llm_geo_router::shared::store::MemoryStore::default();
    for turn in 0..=turns {
        // Load the chosen region so that the turns spread over regions.
        let mut inflight = vec![0.0; n];
        if let Some(x) = inflight.get_mut(usize::try_from(turn).unwrap_or(0) % n) {
            *x = 50.0;
        }
        let mut store = Recording {
            inner: &mut memory,
            script: now.to_le_bytes().to_vec(),
        };
        let inputs = chat_inputs(
            &body,
            &snapshot,
            &index,
            &inflight,
            now - (turns - turn) * 1000,
        );
        let _ = router.route(&cfg, &mut store, &inputs);
        if turn == turns {
            return store.script;
        }
    }
    Vec::new()
}
