//! The built `llm-geo-router ladder`: the probe's controller step over a
//! ratio series on stdin, with the seed's thresholds (llm-serving-dr.md:
//! UP_AT, DOWN_AT, a 300 s dwell) unless told otherwise.

// clippy.toml exempts `#[test]` functions only; the helpers here are test code too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use llm_geo_router::config::Config;
use std::io::Write;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_llm-geo-router");
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn run(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(BIN)
        .arg("ladder")
        .args(args.iter().map(|a| a.replace("{fixtures}", FIXTURES)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // The binary may refuse its options and exit before reading stdin: a
    // broken pipe here is not the test's failure.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    child.wait_with_output().unwrap()
}

/// The output lines `t level`, as (t text, level).
fn levels(args: &[&str], stdin: &str) -> Vec<(String, u8)> {
    let out = run(args, stdin);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (t, level) = l.split_once(' ').unwrap();
            (t.to_string(), level.parse().unwrap())
        })
        .collect()
}

/// The times at which the level changed, and to what.
fn changes(args: &[&str], stdin: &str) -> Vec<(String, u8)> {
    let mut prev = 0;
    levels(args, stdin)
        .into_iter()
        .filter(|(_, l)| std::mem::replace(&mut prev, *l) != *l)
        .collect()
}

/// `t ratio` for t in `from..=to` (whole seconds).
fn series(from: u32, to: u32, ratio: f64) -> String {
    (from..=to).map(|t| format!("{t} {ratio}\n")).collect()
}

fn failure(args: &[&str], stdin: &str) -> String {
    let out = run(args, stdin);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(out.stdout.is_empty(), "nothing printed on an error");
    String::from_utf8(out.stderr).unwrap()
}

fn owned(pairs: &[(&str, u8)]) -> Vec<(String, u8)> {
    pairs.iter().map(|(t, l)| (t.to_string(), *l)).collect()
}

#[test]
fn a_drop_to_a_fifth_of_demand_climbs_one_rung_per_line_to_five() {
    let input = format!("0 2.0\n{}", series(1, 7, 0.2));
    let got: Vec<u8> = levels(&[], &input).into_iter().map(|(_, l)| l).collect();
    assert_eq!(got, vec![0, 1, 2, 3, 4, 5, 5, 5]);
}

#[test]
fn recovery_is_one_rung_per_dwell() {
    // Level 5 at t=4; then plenty of capacity every second. The dwell must be
    // exceeded (> 10 s), so each rung falls 11 s after the previous change.
    let input = format!("{}{}", series(0, 4, 0.2), series(5, 80, 2.0));
    assert_eq!(
        changes(&["--dwell-s", "10"], &input),
        owned(&[
            ("0", 1),
            ("1", 2),
            ("2", 3),
            ("3", 4),
            ("4", 5),
            ("15", 4),
            ("26", 3),
            ("37", 2),
            ("48", 1),
            ("59", 0),
        ])
    );
}

#[test]
fn a_ratio_oscillating_around_one_does_not_flap() {
    // 0.95 < up_at[0] raises level 1 once; 1.05 never passes down_at[0]
    // (1.10), however long the level has held.
    let input: String = (0..600)
        .map(|t| format!("{t} {}\n", if t % 2 == 0 { 0.95 } else { 1.05 }))
        .collect();
    assert_eq!(changes(&[], &input), owned(&[("0", 1)]));
    assert_eq!(
        changes(&["--dwell-s", "5"], &input),
        owned(&[("0", 1)]),
        "not even with a short dwell"
    );
}

#[test]
fn the_seeds_defaults() {
    // UP_AT = [1.00, 0.90, 0.75, 0.60, 0.45]: a ratio equal to the threshold
    // does not raise the level, one just below it does.
    let input = "0 1.0\n1 0.99\n2 0.9\n3 0.89\n4 0.75\n5 0.74\n6 0.6\n7 0.59\n8 0.45\n9 0.44\n";
    let got: Vec<u8> = levels(&[], input).into_iter().map(|(_, l)| l).collect();
    assert_eq!(got, vec![0, 1, 1, 2, 2, 3, 3, 4, 4, 5]);
    // DOWN_AT[4] = 0.55 and a 300 s dwell (dwell_s > 300): the last change
    // was at t=9, so 309 holds and 309.5 steps down; 0.55 itself is not enough.
    let recover = format!("{input}100 0.56\n309 0.56\n309.5 0.55\n309.500 0.56\n");
    let tail: Vec<(String, u8)> = levels(&[], &recover).into_iter().skip(10).collect();
    assert_eq!(
        tail,
        owned(&[("100", 5), ("309", 5), ("309.5", 5), ("309.500", 4)])
    );
}

#[test]
fn the_seeds_worked_example_recovers_one_rung_per_dwell() {
    // A 70B service loses its 32-GPU region and keeps an 8-GPU floor: ratio
    // 0.25 for 11 minutes, then the 24 reserved GPUs are up (ratio 1.25).
    // One probe sample a minute. The ladder climbs a rung a minute to 5; once
    // capacity is back, each rung falls after more than 5 minutes (300 s) at
    // its level: the first at minute 11 (7 minutes after reaching 5), then
    // one every 6 minutes (samples a minute apart: 360 s is the first > 300).
    let mut input = String::new();
    for minute in 0..=40 {
        let ratio = if minute < 11 { 0.25 } else { 1.25 };
        input.push_str(&format!("{} {ratio}\n", minute * 60));
    }
    let got = changes(&[], &input);
    assert_eq!(
        got,
        owned(&[
            ("0", 1),
            ("60", 2),
            ("120", 3),
            ("180", 4),
            ("240", 5),
            ("660", 4),
            ("1020", 3),
            ("1380", 2),
            ("1740", 1),
            ("2100", 0),
        ])
    );
}

#[test]
fn the_config_files_ladder_with_options_on_top() {
    let cfg = ["--config", "{fixtures}/ladder.json"];
    // The file's up_at[0] is 0.95: a ratio of 0.96 stays at level 0, 0.94
    // raises it; its 60 s dwell brings it back after 61 s above 1.05.
    let input = "0 0.96\n10 0.94\n70 1.06\n71 1.06\n";
    assert_eq!(
        levels(&cfg, input),
        owned(&[("0", 0), ("10", 1), ("70", 1), ("71", 0)])
    );
    // --dwell-s overrides the file's 60 s; its thresholds stay.
    assert_eq!(
        changes(&[cfg[0], cfg[1], "--dwell-s", "5"], input),
        owned(&[("10", 1), ("70", 0)])
    );
    // --up-at overrides the file's up_at (0.97: level 1 from t=0), and its
    // 60 s dwell from that change has passed at t=70.
    assert_eq!(
        changes(
            &[cfg[0], cfg[1], "--up-at", "0.97,0.8,0.65,0.5,0.35"],
            input
        ),
        owned(&[("0", 1), ("70", 0)])
    );
}

#[test]
fn thresholds_are_refused_with_the_plugins_message() {
    let plugin = Config::parse(
        br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1}],
             "ladder":{"down_at":[1.1,0.8,0.85,0.7,0.55]}}"#,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        plugin,
        "invalid configuration: ladder.down_at[1]: 0.8 must be greater than up_at[1] (0.9), or the level flaps"
    );
    let err = failure(&["--down-at", "1.1,0.8,0.85,0.7,0.55"], "0 1\n");
    assert!(
        err.starts_with(&format!("error: ladder: {plugin}\n")),
        "{err}"
    );
    // Against the file's thresholds too: its down_at[0] is 1.05.
    let err = failure(
        &[
            "--config",
            "{fixtures}/ladder.json",
            "--up-at",
            "1.05,0.8,0.65,0.5,0.35",
        ],
        "",
    );
    assert!(
        err.contains("ladder.down_at[0]: 1.05 must be greater than up_at[0] (1.05)"),
        "{err}"
    );
    let err = failure(&["--up-at", "0.9,0.95,0.75,0.6,0.45"], "");
    assert!(
        err.contains("ladder.up_at[1]: thresholds must not increase"),
        "{err}"
    );
    let err = failure(&["--dwell-s", "-1"], "");
    assert!(
        err.contains("ladder.dwell_s: -1 must be a finite number >= 0"),
        "{err}"
    );
}

#[test]
fn wrong_options_and_files_are_named() {
    let err = failure(&["--up-at", "1,0.9,0.75,0.6"], "");
    assert!(
        err.contains(
            "invalid value '1,0.9,0.75,0.6' for '--up-at <LIST>': \
             needs 5 comma-separated numbers (one per rung), got 4"
        ),
        "{err}"
    );
    let err = failure(&["--down-at", "1.1,1,x,0.7,0.55"], "");
    assert!(
        err.contains(
            "invalid value '1.1,1,x,0.7,0.55' for '--down-at <LIST>': 'x' is not a number"
        ),
        "{err}"
    );
    let err = failure(&["--dwell-s", "inf"], "");
    assert!(
        err.contains("invalid value 'inf' for '--dwell-s <N>': must be a number"),
        "{err}"
    );
    let err = failure(&["--dwell"], "");
    assert!(err.contains("unexpected argument '--dwell'"), "{err}");
    let err = failure(&["--dwell-s", "10", "--dwell-s=20"], "");
    assert!(
        err.contains("'--dwell-s <N>' cannot be used multiple times"),
        "{err}"
    );
    let err = failure(&["--config", "{fixtures}/nope.json"], "");
    assert!(
        err.contains("--config") && err.contains("nope.json: cannot read"),
        "{err}"
    );
    // A request body is not a configuration: the plugin's own refusal.
    let err = failure(&["--config", "{fixtures}/invalid.json"], "");
    assert!(
        err.contains(
            "invalid.json: invalid configuration: configuration: is not valid for this plugin"
        ),
        "{err}"
    );
}

#[test]
fn bad_input_lines_are_named_and_nothing_is_printed() {
    let err = failure(&[], "# t ratio\n0 1.0\n\n1 0.5 0.2\n");
    assert_eq!(
        err,
        "error: ladder: stdin line 4: expected `t_seconds ratio`, got '1 0.5 0.2'\n"
    );
    let err = failure(&[], "0 1.0\n1 lots\n");
    assert!(
        err.contains("stdin line 2: ratio 'lots' is not a number >= 0"),
        "{err}"
    );
    let err = failure(&[], "10 1.0\n20 1.0\n19.5 1.0\n");
    assert!(
        err.contains("stdin line 3: time 19.5 is before the previous line's (20)"),
        "{err}"
    );
}

#[test]
fn equal_times_blank_lines_comments_and_no_demand() {
    // Equal times are allowed (dwell 0 between them); `inf` is no demand,
    // which lets the ladder recover like any ratio above down_at.
    let input = "# outage\n0 0.5\n0 0.5\n\n   # recovery\n0.25 inf # plenty\n400 inf\n";
    assert_eq!(
        levels(&[], input),
        owned(&[("0", 1), ("0", 2), ("0.25", 2), ("400", 1)])
    );
    assert!(levels(&[], "").is_empty());
    assert!(levels(&[], "# nothing\n\n").is_empty());
}
