//! The built `llm-geo-router crossover` against the seed's executed outputs
//! (region-replica-routing.md: wan_kv_crossover.py, wan_routing_score.py).

// clippy.toml exempts `#[test]` functions only; the helpers here are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_llm-geo-router");

/// The seed's Llama-3.1-70B-class model on H100s, 70 ms apart.
const SEED: &[&str] = &[
    "crossover",
    "--layers",
    "80",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--params",
    "70e9",
    "--tflops",
    "989",
    "--mfu",
    "0.4",
    "--rtt-ms",
    "70",
];

fn run(extra: &[&str]) -> Output {
    Command::new(BIN)
        .args(SEED)
        .args(extra)
        .output()
        .expect("the binary runs")
}

fn json(extra: &[&str]) -> Value {
    let out = run(extra);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object: {text}");
    serde_json::from_str(&text).unwrap()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

fn close(actual: f64, expected: f64, tolerance: f64) {
    assert!(
        (actual - expected).abs() <= tolerance,
        "{actual} is not within {tolerance} of {expected}"
    );
}

#[test]
fn backbone_link_matches_the_seed() {
    let v = json(&[
        "--bandwidth-gbps",
        "100",
        "--prefix-tokens",
        "600",
        "--compute-util",
        "0.1",
        "--service-rate",
        "20",
        "--json",
    ]);
    assert_eq!(v["bytes_per_token"].as_u64(), Some(327_680));
    close(num(&v, "recompute_us_per_token"), 353.89, 0.005);
    close(num(&v, "transfer_us_per_token"), 26.21, 0.005);
    // Unrounded in the JSON; the seed prints 214.
    let crossover = num(&v, "crossover_tokens");
    assert_eq!(crossover.round(), 214.0);
    assert_ne!(crossover, 214.0);
    close(num(&v, "fetch_ms"), 85.73, 0.005);
    close(num(&v, "recompute_ms"), 212.34, 0.005);
    close(num(&v, "crossover_utilization"), 0.7255, 0.00005);
}

#[test]
fn public_wan_link_never_favours_fetch() {
    let v = json(&["--bandwidth-gbps", "5", "--json"]);
    assert!(v["crossover_tokens"].is_null(), "{v}");
    close(num(&v, "transfer_us_per_token"), 524.29, 0.005);
    // No queue options, no queue fields.
    assert!(v.get("fetch_ms").is_none() && v.get("crossover_utilization").is_none());
}

#[test]
fn short_prefix_has_no_crossover_utilisation() {
    // At 100 tokens recompute (35 ms) beats even an idle fetch (73 ms).
    let v = json(&[
        "--bandwidth-gbps",
        "100",
        "--prefix-tokens",
        "100",
        "--compute-util",
        "0.1",
        "--service-rate",
        "20",
        "--json",
    ]);
    assert!(v["crossover_utilization"].is_null(), "{v}");
}

#[test]
fn table_is_the_default_output() {
    let out = run(&["--bandwidth-gbps", "100"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("353.89 us"), "{text}");
    assert!(text.contains("214 tokens"), "{text}");
}

fn refused(extra: &[&str]) -> String {
    let out = run(extra);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn bad_command_lines_exit_2_naming_the_option() {
    let missing = refused(&["--json"]);
    assert!(
        missing.contains("required arguments were not provided")
            && missing.contains("--bandwidth-gbps"),
        "{missing}"
    );
    assert!(
        missing.contains("Usage: llm-geo-router crossover"),
        "{missing}"
    );

    let invalid = refused(&["--bandwidth-gbps", "fast"]);
    assert!(
        invalid
            .contains("invalid value 'fast' for '--bandwidth-gbps <G>': must be a positive number"),
        "{invalid}"
    );

    let partial = refused(&["--bandwidth-gbps", "100", "--prefix-tokens", "600"]);
    assert!(
        partial.contains("missing --compute-util, --service-rate"),
        "{partial}"
    );
    assert!(
        partial.contains("Usage: llm-geo-router crossover"),
        "{partial}"
    );

    let saturated = refused(&[
        "--bandwidth-gbps",
        "100",
        "--prefix-tokens",
        "600",
        "--compute-util",
        "1",
        "--service-rate",
        "20",
    ]);
    assert!(
        saturated.contains(
            "invalid value '1' for '--compute-util <U>': must be a utilisation in [0, 1)"
        ),
        "{saturated}"
    );

    let unknown = refused(&["--bandwidth-gbps", "100", "--rtt", "70"]);
    assert!(unknown.contains("unexpected argument '--rtt'"), "{unknown}");

    let repeated = refused(&["--bandwidth-gbps", "100", "--rtt-ms", "70"]);
    assert!(
        repeated.contains("'--rtt-ms <R>' cannot be used multiple times"),
        "{repeated}"
    );
    let repeated = refused(&["--bandwidth-gbps", "100", "--json", "--json"]);
    assert!(
        repeated.contains("'--json' cannot be used multiple times"),
        "{repeated}"
    );
}

#[test]
fn help_is_printed_with_status_0() {
    for flag in ["--help", "-h"] {
        let out = Command::new(BIN)
            .args(["crossover", flag])
            .output()
            .unwrap();
        assert!(out.status.success(), "{flag}");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("Usage: llm-geo-router crossover")
                && text.contains("--bandwidth-gbps <G>"),
            "{text}"
        );
    }
}
