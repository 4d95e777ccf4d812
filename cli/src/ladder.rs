//! `ladder`: replay a capacity/demand ratio series through the degraded-mode
//! ladder controller and print the level after each sample. Runs
//! `ladder::Ladder::step`, the step the probe takes once per tick, with a
//! `LadderConfig` validated by `Config::validate` as the plugin validates it;
//! no controller logic of its own.

use crate::CliError;
use llm_geo_router::config::{Config, LADDER_RUNGS};
use llm_geo_router::fleet::ladder::Ladder;
use std::io::Read;

pub const SUMMARY: &str = "replay a capacity/demand ratio series through the ladder controller";

pub const ABOUT: &str = "\
Replay a capacity/demand ratio series through the ladder controller.

Reads lines `t_seconds ratio` on stdin (ratio = capacity / demand, as the
probe computes it each tick) and prints `t_seconds level` for each, running
the probe's own controller step (ladder::Ladder::step): the level rises one
rung per line while the ratio is below up_at[level], and falls one rung when
the ratio is above down_at[level-1] and more than dwell_s seconds have passed
since the level last changed. The first line starts the controller at level 0
with its time as the last change, then is stepped like every other line.

Thresholds default to the plugin's defaults, or the --config file's ladder;
the options override them. The result is validated as the plugin validates it
(e.g. down_at[i] must be greater than up_at[i]), with the plugin's message.

input (stdin):
  t_seconds   time of the sample in seconds (fractions allowed, >= 0),
              not decreasing from one line to the next
  ratio       capacity/demand, a number >= 0; `inf` for no demand
Blank lines and text after `#` are ignored. The time is printed as read.";

pub const AFTER: &str = "\
Exit status: 0 on success; 2 on a wrong option, an invalid --config file, an
invalid threshold, or a malformed or out-of-order input line (the message
names the line; nothing is printed then).";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// 5 comma-separated ratios; up_at[i] raises level i to i+1 (default
    /// 1.00,0.90,0.75,0.60,0.45)
    #[arg(verbatim_doc_comment, long, value_name = "LIST", value_parser = rungs)]
    up_at: Option<[f64; LADDER_RUNGS]>,
    /// 5 comma-separated ratios; above down_at[i] level i+1 may fall to i
    /// (default 1.10,1.00,0.85,0.70,0.55)
    #[arg(verbatim_doc_comment, long, value_name = "LIST", value_parser = rungs)]
    down_at: Option<[f64; LADDER_RUNGS]>,
    /// Seconds a level holds before it may fall (default 300)
    #[arg(verbatim_doc_comment, long, value_name = "N", value_parser = crate::args::finite,
          allow_negative_numbers = true)]
    dwell_s: Option<f64>,
    /// The plugin's JSON configuration: its `ladder` section (including
    /// forced_level, which then holds the level) is used; the options above
    /// still override it
    #[arg(verbatim_doc_comment, long, value_name = "FILE")]
    config: Option<String>,
}

/// A configuration the plugin accepts, for when no --config is given: its
/// `ladder` section takes every default.
const BARE_CONFIG: &[u8] =
    br#"{"regions":[{"name":"ladder","cluster":"ladder","capacity_rps":1}]}"#;

/// Times past this many milliseconds lose precision as `f64`.
const MAX_T_MS: f64 = 9_007_199_254_740_992.0;

pub fn run(a: Args) -> Result<String, CliError> {
    let cfg = config(&a)?;
    let mut input = Vec::new();
    std::io::stdin()
        .lock()
        .read_to_end(&mut input)
        .map_err(|e| CliError::Input(format!("stdin: cannot read: {e}")))?;
    replay(&cfg, &input)
}

/// The plugin configuration whose `ladder` the replay uses: the file's or a
/// bare one, with the options applied, validated as a whole.
fn config(a: &Args) -> Result<Config, CliError> {
    let mut cfg = match a.config.as_deref() {
        Some(path) => {
            let bytes = std::fs::read(path)
                .map_err(|e| CliError::Input(format!("--config {path}: cannot read: {e}")))?;
            Config::parse(&bytes).map_err(|e| CliError::Input(format!("--config {path}: {e}")))?
        }
        None => Config::parse(BARE_CONFIG).map_err(|e| CliError::Input(e.to_string()))?,
    };
    if let Some(up) = a.up_at {
        cfg.ladder.up_at = up;
    }
    if let Some(down) = a.down_at {
        cfg.ladder.down_at = down;
    }
    if let Some(dwell) = a.dwell_s {
        cfg.ladder.dwell_s = dwell;
    }
    // Ranges and orderings are the plugin's to judge, in its own words.
    cfg.validate().map_err(|e| CliError::Usage(e.to_string()))?;
    Ok(cfg)
}

/// `--up-at` / `--down-at`: exactly one finite number per rung.
fn rungs(raw: &str) -> Result<[f64; LADDER_RUNGS], String> {
    let values = raw
        .split(',')
        .map(|v| crate::args::finite(v).map_err(|_| format!("'{}' is not a number", v.trim())))
        .collect::<Result<Vec<f64>, String>>()?;
    <[f64; LADDER_RUNGS]>::try_from(values.as_slice()).map_err(|_| {
        format!(
            "needs {LADDER_RUNGS} comma-separated numbers (one per rung), got {}",
            values.len()
        )
    })
}

/// One controller step per sample line; the output has one line per sample.
fn replay(cfg: &Config, input: &[u8]) -> Result<String, CliError> {
    let mut out = String::new();
    let mut ladder: Option<Ladder> = None;
    let mut last: Option<(f64, String)> = None;
    for (i, raw) in input.split(|&b| b == b'\n').enumerate() {
        let n = i + 1;
        let bad = |what: String| CliError::Input(format!("stdin line {n}: {what}"));
        let line = std::str::from_utf8(raw).map_err(|_| bad("is not UTF-8".into()))?;
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(t_text), Some(ratio_text), None) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(bad(format!("expected `t_seconds ratio`, got '{line}'")));
        };
        let t = t_text
            .parse::<f64>()
            .ok()
            .filter(|t| t.is_finite() && *t >= 0.0 && *t * 1000.0 < MAX_T_MS)
            .ok_or_else(|| bad(format!("time '{t_text}' is not a number of seconds >= 0")))?;
        let ratio = ratio_text
            .parse::<f64>()
            .ok()
            .filter(|r| *r >= 0.0)
            .ok_or_else(|| bad(format!("ratio '{ratio_text}' is not a number >= 0")))?;
        if let Some((prev, prev_text)) = &last {
            if t < *prev {
                return Err(bad(format!(
                    "time {t_text} is before the previous line's ({prev_text}); times must not decrease"
                )));
            }
        }
        last = Some((t, t_text.to_owned()));
        let now_ms = (t * 1000.0).round() as u64;
        // No demand: the probe steps with f64::MAX (the ratio is "plenty").
        let ratio = if ratio.is_finite() { ratio } else { f64::MAX };
        let l = ladder.get_or_insert_with(|| Ladder::new(now_ms));
        l.step(&cfg.ladder, ratio, now_ms);
        out.push_str(&format!("{t_text} {}\n", l.level));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn levels(cfg: &Config, input: &str) -> Vec<String> {
        replay(cfg, input.as_bytes())
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn message(r: Result<String, CliError>) -> String {
        match r {
            Err(CliError::Input(m) | CliError::Usage(m)) => m,
            other => format!("unexpected {other:?}"),
        }
    }

    #[test]
    fn time_text_is_kept_and_comments_skipped() {
        let cfg = Config::parse(BARE_CONFIG).unwrap();
        let out = levels(
            &cfg,
            "# header\n\n0.50 1.2\r\n1.0e0 0.5 # drop\n  \n2 inf\n",
        );
        assert_eq!(out, vec!["0.50 0", "1.0e0 1", "2 1"]);
    }

    #[test]
    fn malformed_lines_name_their_number() {
        let cfg = Config::parse(BARE_CONFIG).unwrap();
        let cases = [
            (
                "0 1\n1\n",
                "stdin line 2: expected `t_seconds ratio`, got '1'",
            ),
            (
                "0 1 2\n",
                "stdin line 1: expected `t_seconds ratio`, got '0 1 2'",
            ),
            (
                "x 1\n",
                "stdin line 1: time 'x' is not a number of seconds >= 0",
            ),
            (
                "-1 1\n",
                "stdin line 1: time '-1' is not a number of seconds >= 0",
            ),
            ("0 NaN\n", "stdin line 1: ratio 'NaN' is not a number >= 0"),
            (
                "0 -0.5\n",
                "stdin line 1: ratio '-0.5' is not a number >= 0",
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(message(replay(&cfg, input.as_bytes())), expected);
        }
        assert_eq!(
            message(replay(&cfg, b"0 1\n\n5 1\n4.5 1\n")),
            "stdin line 4: time 4.5 is before the previous line's (5); times must not decrease"
        );
        assert_eq!(
            message(replay(&cfg, b"0 1\n\xff 1\n")),
            "stdin line 2: is not UTF-8"
        );
    }
}
