//! The built `llm-geo-router generate` and `simulate`: a scenario written
//! twice is the same bytes; a short generated trace simulated under every
//! policy and deployment gives exactly one JSON object of the documented
//! shape; plots are SVG; bad inputs are refused with the option or the line
//! named.

// clippy.toml exempts `#[test]` functions only; the helpers here are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_llm-geo-router");

const BASELINES: [&str; 8] = [
    "round-robin",
    "least-request",
    "session-affinity",
    "nearest",
    "cache-aware",
    "gorgo",
    "llm-d",
    "mesh-default",
];

/// The default deployments for scenario d (most traffic from na: iad).
const DEPLOYMENTS: [&str; 3] = ["oracle", "per-client-region", "global:iad"];

fn cli(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("the binary runs")
}

fn ok(args: &[&str]) -> String {
    let out = cli(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A fresh directory for one test, removed when the test ends (passed
/// or failed: the guard drops while a panic unwinds).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!(
        "llm-geo-router-sim-test-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Scenario d (an outage, sessions, tiers) cut to its first `n` requests.
/// `simulate --json` of the geo-router and least-request per client
/// region on `fleet` and `trace`, with `extra` arguments.
fn geo_and_least_request(fleet: &Path, trace: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "simulate",
        "--fleet",
        s(fleet),
        "--trace",
        s(trace),
        "--policy",
        "geo-router,least-request",
        "--deployment",
        "per-client-region",
        "--json",
    ];
    args.extend(extra);
    serde_json::from_str(&ok(&args)).unwrap()
}

fn tiny(dir: &Path, n: usize) -> (PathBuf, PathBuf) {
    ok(&[
        "generate",
        "--scenario",
        "d",
        "--seed",
        "7",
        "--out",
        s(dir),
    ]);
    let trace = dir.join("trace.jsonl");
    let text = std::fs::read_to_string(&trace).unwrap();
    let head: Vec<&str> = text.lines().take(n).collect();
    let short = dir.join("short.jsonl");
    std::fs::write(&short, head.join("\n") + "\n").unwrap();
    (dir.join("fleet.json"), short)
}

fn is_number(v: &Value) -> bool {
    v.as_f64().is_some_and(f64::is_finite)
}

#[test]
fn generate_is_deterministic_by_seed() {
    let a = scratch("gen-a");
    let b = scratch("gen-b");
    let text = ok(&["generate", "--scenario", "b", "--seed", "3", "--out", s(&a)]);
    assert!(text.contains("4000 requests"), "{text}");
    ok(&["generate", "--scenario", "b", "--seed", "3", "--out", s(&b)]);
    for f in ["fleet.json", "trace.jsonl"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    ok(&["generate", "--scenario", "b", "--seed", "4", "--out", s(&b)]);
    assert_ne!(
        std::fs::read(a.join("trace.jsonl")).unwrap(),
        std::fs::read(b.join("trace.jsonl")).unwrap()
    );
    let fleet: Value =
        serde_json::from_slice(&std::fs::read(a.join("fleet.json")).unwrap()).unwrap();
    assert_eq!(fleet["client_regions"][0], "na");
    assert_eq!(fleet["regions"][0]["rtt_ms"]["na"], 37.0);
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(a.join("trace.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    for key in [
        "t_ms",
        "session",
        "client_region",
        "tier",
        "segments",
        "output_tokens",
    ] {
        assert!(first.get(key).is_some(), "{key} in {first}");
    }
}

#[test]
fn simulate_json_has_the_documented_shape_for_every_policy_and_deployment() {
    let dir = scratch("json");
    let (fleet, trace) = tiny(&dir, 60);
    let text = ok(&[
        "simulate",
        "--fleet",
        s(&fleet),
        "--trace",
        s(&trace),
        "--policy",
        "all",
        "--json",
    ]);
    assert_eq!(text.lines().count(), 1, "exactly one JSON object: {text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let top = v.as_object().unwrap();
    assert_eq!(top.keys().collect::<Vec<_>>(), ["policies"]);
    let policies = v["policies"].as_object().unwrap();
    // The geo-router once, every baseline once per default deployment.
    // With the oracle among them, the geo-router given exact figures too.
    let mut labels = vec![
        ("geo-router".to_string(), "geo-router", "per-client-region"),
        ("geo-router(exact)".to_string(), "geo-router", "oracle"),
    ];
    for b in BASELINES {
        for d in DEPLOYMENTS {
            labels.push((format!("{b}@{d}"), b, d));
        }
    }
    assert_eq!(policies.len(), labels.len());
    for (name, policy, deployment) in &labels {
        let p = &policies[name.as_str()];
        let keys: Vec<&String> = p.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "cache_hit_token_ratio",
                "capped",
                "completed",
                "deployment",
                "e2e_ms",
                "load_source",
                "occupancy",
                "per_region_requests",
                "policy",
                "probe_busy_share",
                "probe_queries_per_min",
                "probe_scrapes_per_min",
                "proxies",
                "queue_time_share",
                "queued_share",
                "reasons",
                "requests",
                "shed",
                "ttft_ms",
                "utilisation"
            ],
            "{name}"
        );
        assert_eq!(p["policy"], *policy);
        assert_eq!(p["deployment"], *deployment);
        // The probe's scrapes: at least one a second per engine and Envoy.
        if *policy == "geo-router" {
            let per_min = p["probe_scrapes_per_min"].as_f64().unwrap();
            assert!(per_min >= 55.0, "{name}: {per_min}");
            assert!(is_number(&p["probe_busy_share"]), "{name}");
            assert_eq!(p["probe_queries_per_min"], 0.0, "{name}");
            assert_eq!(p["load_source"], "scrape", "{name}");
        } else {
            assert!(p["probe_scrapes_per_min"].is_null(), "{name}");
            assert!(p["probe_queries_per_min"].is_null(), "{name}");
            assert!(p["load_source"].is_null(), "{name}");
        }
        for dist in ["ttft_ms", "e2e_ms"] {
            let d = &p[dist];
            assert_eq!(d.as_object().unwrap().len(), 4, "{name} {dist}");
            for q in ["mean", "p50", "p95", "p99"] {
                assert!(is_number(&d[q]), "{name} {dist} {q}: {d}");
            }
            assert!(d["p50"].as_f64() <= d["p95"].as_f64());
            assert!(d["p95"].as_f64() <= d["p99"].as_f64());
        }
        assert_eq!(p["requests"], 60, "{name}");
        let completed = p["completed"].as_u64().unwrap();
        assert!(completed > 0 && completed <= 60, "{name}");
        assert!(p["shed"].as_u64().unwrap() + completed <= 60);
        assert!(p["capped"].is_u64());
        let hit = p["cache_hit_token_ratio"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "{name}: {hit}");
        let per_region = p["per_region_requests"].as_object().unwrap();
        assert_eq!(per_region.keys().collect::<Vec<_>>(), ["fra", "iad", "icn"]);
        let routed: u64 = per_region.values().map(|n| n.as_u64().unwrap()).sum();
        assert!(routed >= completed && routed <= 60, "{name}");
        assert_eq!(p["proxies"], 1, "{name}");
        let q = p["queued_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&q), "{name}: {q}");
        for figure in ["utilisation", "occupancy", "queue_time_share"] {
            let by_region = p[figure].as_object().unwrap();
            assert_eq!(by_region.keys().collect::<Vec<_>>(), ["fra", "iad", "icn"]);
        }
        for o in p["occupancy"].as_object().unwrap().values() {
            let o = o.as_object().unwrap();
            assert_eq!(
                o.keys().collect::<Vec<_>>(),
                ["max", "p50", "p95"],
                "{name}"
            );
            assert!(
                o["p50"].as_f64() <= o["p95"].as_f64() && o["p95"].as_f64() <= o["max"].as_f64()
            );
        }
        for share in p["queue_time_share"].as_object().unwrap().values() {
            assert!((0.0..=1.0).contains(&share.as_f64().unwrap()), "{name}");
        }
        let decisions: u64 = p["reasons"]
            .as_object()
            .unwrap()
            .values()
            .map(|n| n.as_u64().unwrap())
            .sum();
        if *policy == "geo-router" {
            assert_eq!(decisions, routed, "{name}");
        } else {
            assert_eq!(decisions, 0, "{name}");
        }
    }
    // The same inputs give the same bytes.
    let again = ok(&[
        "simulate",
        "--fleet",
        s(&fleet),
        "--trace",
        s(&trace),
        "--policy",
        "all",
        "--json",
    ]);
    assert_eq!(text, again);
}

#[test]
fn policies_repeat_and_plots_are_svg() {
    let dir = scratch("plots");
    let (fleet, trace) = tiny(&dir, 40);
    let plots = dir.join("plots");
    let text = ok(&[
        "simulate",
        "--fleet",
        s(&fleet),
        "--trace",
        s(&trace),
        "--policy",
        "geo-router",
        "--policy=nearest,gorgo",
        "--plots",
        s(&plots),
    ]);
    assert!(text.starts_with("policy "), "{text}");
    for name in ["geo-router", "nearest", "gorgo"] {
        assert!(text.contains(name), "{name} in {text}");
    }
    assert!(!text.contains("cache-aware"));
    for d in DEPLOYMENTS {
        assert!(text.contains(&format!("gorgo@{d} ")), "gorgo@{d} in {text}");
    }
    assert!(!text.contains("geo-router@"), "{text}");
    for f in ["ttft_cdf.svg", "region_load.svg", "ladder.svg"] {
        let svg = std::fs::read_to_string(plots.join(f)).unwrap();
        assert!(
            svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
        assert!(svg.contains("<text"), "{f} has labels");
    }
    let cdf = std::fs::read_to_string(plots.join("ttft_cdf.svg")).unwrap();
    assert!(cdf.contains(">geo-router<") && cdf.contains(">gorgo<"));
    // A line per run, and a line style per deployment in the legend.
    // (The geo-router twice: as deployed, and given exact figures.)
    assert_eq!(cdf.matches("<path ").count(), 2 + 2 * 3, "{cdf}");
    for d in [
        ">oracle (the limit)<",
        ">per-client-region<",
        ">global:iad<",
    ] {
        assert!(cdf.contains(d), "{d}");
    }
    // Region load: the geo-router, then the best baseline of each deployment.
    let load = std::fs::read_to_string(plots.join("region_load.svg")).unwrap();
    assert_eq!(load.matches("Requests started per region: ").count(), 4);
    for d in DEPLOYMENTS {
        assert!(load.contains(&format!("@{d}</text>")), "{d}");
    }
}

#[test]
fn deployments_are_chosen_and_shown() {
    let dir = scratch("deploy");
    let (fleet, trace) = tiny(&dir, 40);
    let text = ok(&[
        "simulate",
        "--fleet",
        s(&fleet),
        "--trace",
        s(&trace),
        "--policy",
        "cache-aware,geo-router",
        "--deployment",
        "global:fra",
        "--deployment=oracle",
    ]);
    let rows: Vec<&str> = text
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(
        rows,
        [
            "cache-aware@global:fra",
            "cache-aware@oracle",
            "geo-router",
            "geo-router(exact)"
        ],
        "{text}"
    );
    assert!(text.contains("@oracle: "), "the oracle is labelled: {text}");
    // The help names the option and the three kinds.
    let help = ok(&["simulate", "--help"]);
    assert!(
        help.contains("--deployment <D>")
            && help.contains("per-client-region")
            && help.contains("global:<region>")
            && help.contains("oracle"),
        "{help}"
    );
}

#[test]
fn bad_inputs_are_refused_with_what_to_fix() {
    let dir = scratch("bad");
    let (fleet, trace) = tiny(&dir, 5);
    let refused = |args: &[&str], expected: &str| {
        let out = cli(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{expected:?} in {err}");
    };
    refused(
        &["simulate", "--fleet", s(&fleet), "--trace", s(&trace)],
        "the following required arguments were not provided:\n  --policy <NAME>",
    );
    refused(
        &[
            "simulate",
            "--fleet",
            s(&fleet),
            "--trace",
            s(&trace),
            "--policy",
            "fastest",
        ],
        "invalid value 'fastest' for '--policy <NAME>': unknown policy 'fastest'",
    );
    let with = |extra: &[&'static str]| {
        let mut args = vec![
            "simulate".to_string(),
            "--fleet".into(),
            s(&fleet).into(),
            "--trace".into(),
            s(&trace).into(),
            "--policy".into(),
            "nearest".into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };
    let refused_with = |extra: &[&'static str], expected: &str| {
        let args = with(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, expected);
    };
    refused_with(
        &["--deployment", "regional"],
        "invalid value 'regional' for '--deployment <D>': unknown deployment 'regional'; \
         known: oracle, per-client-region, global:<region>",
    );
    refused_with(
        &["--deployment", "global:sfo"],
        "error: simulate: --deployment global:sfo: 'sfo' is not a region of the fleet; \
         its regions: iad, fra, icn",
    );
    refused_with(
        &["--deployment", "oracle", "--deployment", "oracle"],
        "--deployment 'oracle' is given more than once",
    );
    refused_with(
        &["--fleet", "other.json"],
        "the argument '--fleet <FILE>' cannot be used multiple times",
    );
    refused_with(&["--speed", "2"], "unexpected argument '--speed'");
    for bad in ["0", "-1", "1.5", "two"] {
        refused_with(
            &["--proxies", bad],
            &format!("invalid value '{bad}' for '--proxies <N>': must be a whole number > 0"),
        );
    }
    for bad in ["0", "65", "1.5"] {
        let out = cli(&with(&["--replicas", bad])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>());
        assert_eq!(out.status.code(), Some(2), "--replicas {bad}");
    }
    refused_with(
        &["--load-source", "pull"],
        "invalid value 'pull' for '--load-source <SOURCE>': unknown load source 'pull'; \
         known: scrape, scrape-replica, prometheus",
    );
    refused_with(
        &["--prometheus-interval-ms", "5000"],
        "--prometheus-interval-ms is for --load-source prometheus",
    );
    for bad in ["0", "-2", "inf", "NaN", "fast"] {
        refused_with(
            &["--rate-scale", bad],
            &format!("invalid value '{bad}' for '--rate-scale <F>': must be a positive number"),
        );
    }
    let unsorted = dir.join("unsorted.jsonl");
    let text = std::fs::read_to_string(&trace).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.swap(0, 3);
    std::fs::write(&unsorted, lines.join("\n")).unwrap();
    refused(
        &[
            "simulate",
            "--fleet",
            s(&fleet),
            "--trace",
            s(&unsorted),
            "--policy",
            "nearest",
        ],
        "line 2: t_ms",
    );
    let config = dir.join("config.json");
    std::fs::write(&config, r#"{"cost": {"w_quue": 2}}"#).unwrap();
    refused(
        &[
            "simulate",
            "--fleet",
            s(&fleet),
            "--trace",
            s(&trace),
            "--policy",
            "geo-router",
            "--config",
            s(&config),
        ],
        "w_quue",
    );
    refused(
        &["generate", "--scenario", "h", "--seed", "1"],
        "invalid value 'h' for '--scenario <a|b|c|d|e|f|g>': must be one of a, b, c, d, e, f, g",
    );
}

#[test]
fn proxies_and_rate_scale() {
    let dir = scratch("proxies");
    let (fleet, trace) = tiny(&dir, 80);
    let json = |extra: &[&str]| geo_and_least_request(&fleet, &trace, extra);
    let one = json(&[]);
    let four = json(&["--proxies", "4"]);
    let geo = |v: &Value| v["policies"]["geo-router"].clone();
    let base = |v: &Value| v["policies"]["least-request@per-client-region"].clone();
    assert_eq!(
        (geo(&one)["proxies"].clone(), geo(&four)["proxies"].clone()),
        (1.into(), 4.into())
    );
    // The baselines are deployed as they were.
    assert_eq!(base(&one), base(&four));
    assert_eq!(json(&["--proxies", "1"]), one);
    // Several Envoys: with and without the exchange, side by side; one
    // Envoy per client region: without, unless asked.
    let shared = |v: &Value| v["policies"]["geo-router+exchange"].clone();
    assert_eq!(shared(&four)["proxies"], 4);
    assert!(shared(&one).is_null());
    let on = json(&["--exchange", "on"]);
    assert!(geo(&on).is_null() && shared(&on)["proxies"] == 1);
    assert_eq!(
        json(&["--proxies", "4", "--exchange", "off"])["policies"]["geo-router"],
        geo(&four)
    );
    // Twice the rate: the same requests, the span halved.
    let requests = dir.join("requests.jsonl");
    ok(&[
        "simulate",
        "--fleet",
        s(&fleet),
        "--trace",
        s(&trace),
        "--policy",
        "nearest",
        "--deployment",
        "oracle",
        "--rate-scale",
        "2",
        "--requests",
        s(&requests),
    ]);
    let t_ms = |path: &std::path::Path| -> Vec<f64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["t_ms"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let (original, scaled) = (t_ms(&trace), t_ms(&requests));
    assert_eq!(scaled, original.iter().map(|t| t / 2.0).collect::<Vec<_>>());
    let help = ok(&["simulate", "--help"]);
    assert!(
        help.contains("--proxies <N>") && help.contains("think times"),
        "{help}"
    );
}

#[test]
fn replicas_and_load_sources() {
    let dir = scratch("replicas");
    let (fleet, trace) = tiny(&dir, 80);
    let json = |extra: &[&str]| geo_and_least_request(&fleet, &trace, extra);
    let geo = |v: &Value| v["policies"]["geo-router"].clone();
    let one = json(&[]);
    // One replica per region: as before, whatever the scrape's slots.
    assert_eq!(json(&["--replicas", "1"]), one);
    assert_eq!(
        geo(&json(&["--load-source", "scrape-replica"]))["ttft_ms"],
        geo(&one)["ttft_ms"]
    );
    // Three: the baselines see the same regions, split behind entry points.
    let three = json(&["--replicas", "3"]);
    assert_ne!(three, one);
    let prom = json(&["--replicas", "3", "--load-source", "prometheus"]);
    let p = geo(&prom);
    assert_eq!(p["load_source"], "prometheus@15000ms");
    assert_eq!(p["probe_scrapes_per_min"], 0.0);
    let q = p["probe_queries_per_min"].as_f64().unwrap();
    assert!((55.0..=70.0).contains(&q), "one query a probe round: {q}");
    assert_eq!(
        prom["policies"]["least-request@per-client-region"],
        three["policies"]["least-request@per-client-region"]
    );
    let fast = json(&[
        "--replicas",
        "3",
        "--load-source",
        "prometheus",
        "--prometheus-interval-ms",
        "5000",
    ]);
    assert_eq!(geo(&fast)["load_source"], "prometheus@5000ms");
    let help = ok(&["simulate", "--help"]);
    assert!(
        help.contains("--replicas <N>") && help.contains("least-request"),
        "{help}"
    );
}

/// The simulator's geo-router learns from the answers as the plugin in
/// Envoy does: on long multi-turn conversations (scenario a), later turns
/// go where their prefix is (`cache`) and most prompt tokens are cached.
/// A host that stops telling the router the answer came from an engine
/// (Envoy's `response.code_details`) leaves the directory empty: seen
/// failing then (no `cache` decision in 400 requests).
#[test]
fn the_geo_router_learns_where_conversations_are() {
    let dir = scratch("learns");
    ok(&[
        "generate",
        "--scenario",
        "a",
        "--seed",
        "1",
        "--out",
        s(&dir),
    ]);
    let trace = dir.join("trace.jsonl");
    let text = std::fs::read_to_string(&trace).unwrap();
    let head: Vec<&str> = text.lines().take(400).collect();
    let short = dir.join("short.jsonl");
    std::fs::write(&short, head.join("\n") + "\n").unwrap();
    let out: Value = serde_json::from_str(&ok(&[
        "simulate",
        "--fleet",
        s(&dir.join("fleet.json")),
        "--trace",
        s(&short),
        "--policy",
        "geo-router",
        "--deployment",
        "per-client-region",
        "--json",
    ]))
    .unwrap();
    let geo = &out["policies"]["geo-router"];
    let cache = geo["reasons"]["cache"].as_u64().unwrap_or(0);
    let requests = geo["requests"].as_u64().unwrap();
    assert!(
        cache * 2 > requests,
        "{cache} of {requests}: {}",
        geo["reasons"]
    );
    assert!(
        geo["cache_hit_token_ratio"].as_f64().unwrap() > 0.5,
        "{}",
        geo["cache_hit_token_ratio"]
    );
}
