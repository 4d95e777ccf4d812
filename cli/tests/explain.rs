//! The built `llm-geo-router explain` on the fixtures: three regions near
//! (5 ms), mid (40 ms) and far (120 ms), all idle and healthy; a 485-token
//! chat turn whose 1760-byte system prompt an earlier turn left in mid.

// clippy.toml exempts `#[test]` functions only; the helpers here are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_llm-geo-router");
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn run(request: &str, extra: &[&str]) -> Output {
    let f = |name: &str| format!("{FIXTURES}/{name}");
    Command::new(BIN)
        .arg("explain")
        .args(["--config", &f("config.json")])
        .args(["--snapshot", &f("snapshot.json")])
        .args(["--request", &f(request)])
        .args(extra.iter().map(|a| a.replace("{fixtures}", FIXTURES)))
        .output()
        .expect("the binary runs")
}

fn decision(extra: &[&str]) -> Value {
    let mut args = extra.to_vec();
    args.push("--json");
    let out = run("request.json", &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object: {text}");
    serde_json::from_str(&text).unwrap()
}

fn region<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["regions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no region {name} in {v}"))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

const HISTORY: &[&str] = &["--history", "{fixtures}/history.json"];

#[test]
fn a_cold_prompt_goes_to_the_nearest_region() {
    let v = decision(&[]);
    assert_eq!(v["region"], "near");
    assert_eq!(v["reason"], "rtt");
    assert_eq!(v["runner_up"], "mid");
    assert_eq!(v["prompt_tokens"], 485);
    // Nothing cached anywhere: 485 tokens at 0.2 ms each, plus the RTT,
    // plus the externality of running 1 of 8 slots (near nothing).
    let near = region(&v, "near");
    assert_eq!(near["cached_tokens"], 0);
    assert!((num(near, "prefill_ms") - 97.0).abs() < 1e-9);
    assert!(
        num(near, "load_ms") > 0.0 && num(near, "load_ms") < 0.01,
        "{near}"
    );
    assert!((num(near, "total_ms") - num(near, "load_ms") - 102.0).abs() < 1e-9);
    // Every region's terms add up to its total, the cache's footprint
    // among them (0 here: no region's cache has turned over).
    for r in v["regions"].as_array().unwrap() {
        let terms: f64 = ["rtt_ms", "prefill_ms", "wait_ms", "load_ms", "footprint_ms"]
            .iter()
            .map(|k| num(r, k))
            .sum();
        assert!((terms - num(r, "total_ms")).abs() < 1e-9, "{r}");
        assert_eq!(num(r, "footprint_ms"), 0.0, "{r}");
    }
    assert!((num(region(&v, "far"), "total_ms") - 217.0).abs() < 1e-9);
    assert!(v["migration"].is_null());
    let text = v["decision"].as_str().unwrap();
    assert!(
        text.starts_with("region=near; reason=rtt; ttft_ms=102.0;"),
        "{text}"
    );
}

#[test]
fn history_in_mid_makes_mid_win_on_its_cache() {
    let v = decision(HISTORY);
    assert_eq!(v["region"], "mid");
    assert_eq!(v["reason"], "cache");
    assert_eq!(v["runner_up"], "near");
    assert_eq!(v["history_replayed"], 2);
    let mid = region(&v, "mid");
    // The earlier turn shares 28 full 64-byte blocks with this one, and
    // this prompt continues it: the directory believes it to the earlier
    // turn's end less the block an engine may not have whole, 27 blocks of
    // 16 tokens (its checkpoints alone would say 24).
    assert_eq!(mid["cached_tokens"], 432);
    assert!((num(mid, "prefill_ms") - 10.6).abs() < 1e-9);
    assert!(num(mid, "total_ms") < num(region(&v, "near"), "total_ms"));
    // far served an unrelated prompt: nothing of this one.
    assert_eq!(region(&v, "far")["cached_tokens"], 0);
    assert!(v["shared_data_calls"].as_u64().unwrap() > 0);
}

#[test]
fn the_table_shows_every_region_and_the_decision() {
    let out = run("request.json", HISTORY);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let row = |name: &str| {
        text.lines()
            .find(|l| {
                l.trim_start_matches(['*', ' '])
                    .starts_with(&format!("{name} "))
            })
            .unwrap_or_else(|| panic!("no row for {name} in\n{text}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row("mid"),
        ["*mid", "yes", "yes", "no", "432", "1.0", "40.0", "10.6", "0.0", "0.0", "0.0", "50.6"]
    );
    assert_eq!(row("near")[4], "0");
    assert!(
        text.contains("\nchosen     mid (expected ttft 50.6 ms)\n"),
        "{text}"
    );
    assert!(text.contains("\nreason     cache\n"), "{text}");
    assert!(text.contains("\nrunner-up  near (expected ttft 102.0 ms, +51.4 ms)\n"));
    assert!(text.contains("\nshared-data calls  "), "{text}");
}

#[test]
fn a_pin_away_from_the_holder_fetches_its_prefix() {
    // apac allows near and far: mid, which holds the prefix, is excluded.
    let v = decision(&[
        "--history",
        "{fixtures}/history.json",
        "--residency",
        "apac",
    ]);
    assert_eq!(v["region"], "near");
    assert_eq!(v["reason"], "pin");
    assert_eq!(region(&v, "mid")["candidate"], false);
    let m = &v["migration"];
    assert_eq!(m["action"], "fetch");
    assert_eq!(m["from"], "mid");
    assert_eq!(m["tokens"], 432);
    assert!(num(m, "fetch_ms") < num(m, "recompute_ms"), "{m}");
    assert_eq!(m["header"], "fetch; from=mid; tokens=432");
}

#[test]
fn in_flight_requests_do_not_pass_over_a_holder_with_a_free_slot() {
    // mid's 7 requests are far over its share of 9 across 24 slots, but it
    // has a free slot: nothing waits there, and the prefix stays with it.
    let v = decision(&[
        "--history",
        "{fixtures}/history.json",
        "--inflight",
        "mid=6",
    ]);
    assert_eq!(v["region"], "mid");
    assert_eq!(v["reason"], "cache");
    let mid = region(&v, "mid");
    assert_eq!(mid["over_bound"], false);
    assert_eq!(num(mid, "occupancy"), 7.0);
    assert!(v["passed_over"].is_null(), "{v}");
}

#[test]
fn a_full_holder_is_passed_over_when_its_wait_exceeds_the_move() {
    // 20 requests at mid's 8 slots: 13 ahead, 13/8 x 400 ms = 650 ms of
    // wait, more than moving the prompt's held tokens' prefill to near.
    let v = decision(&[
        "--history",
        "{fixtures}/history.json",
        "--inflight",
        "mid=19",
    ]);
    assert_eq!(v["region"], "near");
    assert_eq!(v["reason"], "load");
    let p = &v["passed_over"];
    assert_eq!(p["region"], "mid");
    assert_eq!(num(p, "wait_ms"), 650.0);
    assert!(num(p, "move_ms") < 650.0, "{p}");
    assert!(
        v["decision"]
            .as_str()
            .unwrap()
            .contains("; passed_over=mid; passed_over_wait_ms=650.0; move_ms="),
        "{v}"
    );
}

#[test]
fn a_session_record_from_the_history_is_shown() {
    let v = decision(&[
        "--history",
        "{fixtures}/history.json",
        "--session",
        "conv-1",
    ]);
    assert_eq!(v["session"]["key"], "conv-1");
    assert_eq!(v["session"]["last_region"], "mid");
    assert_eq!(v["session"]["last_at_ms"], 1_700_000_050_000u64);
}

#[test]
fn a_residency_not_allow_listed_is_refused_with_400() {
    let out = run("request.json", &["--residency", "mars"]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_residency");
    assert_eq!(
        v["error"]["message"],
        "unknown data residency \"mars\"; known: any, apac, eu"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("would answer 400"), "{stderr}");
}

#[test]
fn an_invalid_body_prints_the_openai_error_the_router_sends() {
    let out = run("invalid.json", &[]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_request");
    assert_eq!(v["error"]["param"], "messages");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`messages` must contain at least one message"),
        "{message}"
    );
}

#[test]
fn other_paths_go_to_the_default_region_untouched() {
    let v = decision(&["--path", "/v1/models"]);
    assert_eq!(v["region"], "near");
    assert_eq!(v["reason"], "default");
    assert_eq!(v["decision"], "region=near; reason=default");
}

#[test]
fn bad_files_and_options_name_what_is_wrong() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["--history", "{fixtures}/config.json"],
            "config.json: must be a JSON array",
        ),
        (
            &["--inflight", "moon=3"],
            "\"moon\" is not a configured region",
        ),
        (
            &["--history", "{fixtures}/history.json", "--now-ms", "5"],
            "--now-ms 5 is before the history's last at_ms (1700000050000)",
        ),
    ];
    for (extra, expected) in cases {
        let out = run("request.json", extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
    // A snapshot given as the configuration: the ConfigError, naming the file.
    let out = Command::new(BIN)
        .arg("explain")
        .args(["--config", &format!("{FIXTURES}/snapshot.json")])
        .args(["--snapshot", &format!("{FIXTURES}/snapshot.json")])
        .args(["--request", &format!("{FIXTURES}/request.json")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("snapshot.json: invalid configuration: configuration: ")
            && stderr.contains("unknown field `version`"),
        "{stderr}"
    );
}

#[test]
fn blank_and_non_json_bodies_are_taken_as_the_router_takes_them() {
    // Only whitespace: an empty request, refused with 400 as the router
    // filter refuses it (not passed through as a non-JSON body).
    let out = run("blank.json", &[]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "invalid_request");
    assert!(v["error"]["message"].as_str().unwrap().contains("empty"));
    // Not meant as JSON: the default region, untouched.
    let out = run("form.txt", &["--json"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["reason"], "default");
}
