//! Engine load metrics: turns the Prometheus text exposition (format 0.0.4)
//! that vLLM, SGLang and llama.cpp's `llama-server` serve on `/metrics`
//! into the few numbers the router weighs (queue depth, running requests,
//! KV-cache usage, prefix-cache counters or hit rate, KV-cache capacity in
//! tokens) and an optional release digest read from a label.
//!
//! The text format is read by `exposition`, the per-engine metric names
//! are in `families` and the KV-cache capacity is summed by `capacity`;
//! this module reads one scrape with them. It does no I/O and keeps no
//! state between scrapes; the probe fetches the payload and decides what a
//! missing number means for routing. A payload with neither of the
//! family's load figures (waiting, running) is an error, not an idle
//! engine: read with the wrong family's names, every engine would look
//! idle.

use std::borrow::Cow;
use std::fmt;

use crate::engines::exposition::{
    classify, is_label_name, is_metric_name, leading_metric_name, LineClass,
};
use crate::engines::families::{Series, Totals, PROCESS_START};

pub use crate::engines::capacity::{
    servable_tokens, CacheCapacity, CapacitySum, MAX_BLOCK_TOKENS, MAX_CACHE_TOKENS,
};
pub use crate::engines::exposition::{lines, Line, Lines, Sample};
pub use crate::engines::families::{EngineKind, EngineSample, RestartCounter};

/// Largest payload parsed. A healthy engine prints tens of kilobytes; anything
/// this big is a misconfigured endpoint, and parsing it would stall the
/// proxy's worker thread.
pub const MAX_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;

/// Why a scrape gave no sample. Messages name the line so an operator can
/// find it in the engine's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsError {
    /// The payload is over [`MAX_PAYLOAD_BYTES`]; nothing was parsed.
    TooLarge { bytes: usize, limit: usize },
    /// Not one line parsed as a sample: not a Prometheus endpoint, or empty.
    NoSamples {
        lines: usize,
        first_malformed_line: Option<usize>,
    },
    /// Samples parsed, but no usable value of the kind's waiting or
    /// running series: another engine family (`regions[].engine` wrong),
    /// or not an engine's endpoint. Taken as an idle engine, it would
    /// draw every cold prompt.
    NoLoadSeries {
        engine: EngineKind,
        /// The first sample line's metric name (names are `[a-zA-Z0-9_:]`
        /// only, cut to [`MAX_NAME_SHOWN`] bytes): no label value, no
        /// payload.
        first_metric: String,
        /// The first metric name with a `namespace:` (which engine it is),
        /// when the first sample has none.
        first_namespaced: Option<String>,
    },
    /// A line of a metric this module reads is not UTF-8.
    NotUtf8 { line: usize, metric: String },
    /// The configured release label is not `metric_name/label_name`.
    InvalidReleaseLabel { spec: String },
}

impl fmt::Display for MetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetricsError::TooLarge { bytes, limit } => write!(
                f,
                "metrics payload of {bytes} bytes is over the {limit}-byte limit; not parsed"
            ),
            MetricsError::NoSamples { lines: 0, .. } => f.write_str("metrics payload is empty"),
            MetricsError::NoSamples {
                lines,
                first_malformed_line: Some(line),
            } => write!(
                f,
                "metrics payload has no parseable sample line in {lines} lines \
                 (first malformed line: {line})"
            ),
            MetricsError::NoSamples {
                lines,
                first_malformed_line: None,
            } => write!(
                f,
                "metrics payload has no sample line in {lines} lines (only blanks and comments)"
            ),
            MetricsError::NoLoadSeries {
                engine,
                first_metric,
                first_namespaced,
            } => {
                let names: Vec<&str> = engine.load_series().collect();
                write!(
                    f,
                    "metrics payload has no {} load figure ({}); its first sample is {first_metric}",
                    engine.name(),
                    names.join(", ")
                )?;
                if let Some(other) = first_namespaced {
                    write!(f, ", its first namespaced metric {other}")?;
                }
                f.write_str(" (is regions[].engine right?)")
            }
            MetricsError::NotUtf8 { line, metric } => {
                write!(f, "metrics line {line} ({metric}) is not valid UTF-8")
            }
            MetricsError::InvalidReleaseLabel { spec } => write!(
                f,
                "release label {spec:?} is not of the form metric_name/label_name"
            ),
        }
    }
}

impl std::error::Error for MetricsError {}

/// Metric names shown in an error are cut to this many bytes.
pub const MAX_NAME_SHOWN: usize = 120;

/// Reads the load numbers of one engine from its `/metrics` payload.
///
/// Malformed lines are skipped, so one bad series never hides the rest; the
/// scrape fails only when nothing in it parses as a sample, when a line of a
/// metric we read is not UTF-8, when it is over [`MAX_PAYLOAD_BYTES`], when
/// `release_label` is not `metric_name/label_name`, or when neither `kind`'s
/// waiting nor its running series has a usable value ([`MetricsError::NoLoadSeries`]).
/// Every other figure may be missing (`None`).
pub fn parse_engine_metrics(
    kind: EngineKind,
    text: &[u8],
    release_label: Option<&str>,
) -> Result<EngineSample, MetricsError> {
    // A bad spec is a configuration error: report it whatever the payload.
    let release_spec = release_label.map(ReleaseLabel::parse).transpose()?;
    if text.len() > MAX_PAYLOAD_BYTES {
        return Err(MetricsError::TooLarge {
            bytes: text.len(),
            limit: MAX_PAYLOAD_BYTES,
        });
    }

    let prefix = kind.metric_prefix();
    let wanted = kind.wanted_series();
    let mut totals = Totals::default();
    let mut release: Option<String> = None;
    let mut saw_sample = false;
    let mut first_malformed_line = None;
    let mut line_count = 0;
    // For the error that names what came back when the load series are
    // missing: one name scan per line until both are found.
    let mut first_metric: Option<&[u8]> = None;
    let mut first_namespaced: Option<&[u8]> = None;

    for line in lines(text) {
        line_count = line.number;
        let name = leading_metric_name(line.bytes);
        if first_namespaced.is_none() && name.contains(&b':') {
            first_namespaced = Some(name);
        }
        // The engine's own series carry its prefix; the one process series
        // read (`process_start_time_seconds`) has none.
        let series = if name.starts_with(prefix) || name == PROCESS_START.as_bytes() {
            wanted
                .iter()
                .find(|(wanted_name, _)| wanted_name.as_bytes() == name)
                .map(|&(_, series)| series)
        } else {
            None
        };
        let wants_release =
            release.is_none() && release_spec.is_some_and(|spec| spec.metric.as_bytes() == name);

        if series.is_none() && !wants_release {
            // Lines we do not read are only looked at until one of them proves
            // the payload is an exposition at all; after that they cost one
            // name scan each.
            if !saw_sample {
                match classify(line.bytes) {
                    LineClass::Comment => {}
                    LineClass::Sample => {
                        saw_sample = true;
                        first_metric = Some(name);
                    }
                    LineClass::Malformed => {
                        first_malformed_line.get_or_insert(line.number);
                    }
                }
            }
            continue;
        }

        let Ok(line_text) = std::str::from_utf8(line.bytes) else {
            return Err(MetricsError::NotUtf8 {
                line: line.number,
                metric: String::from_utf8_lossy(name).into_owned(),
            });
        };
        let Some(sample) = Sample::parse(line_text) else {
            first_malformed_line.get_or_insert(line.number);
            continue;
        };
        if !saw_sample {
            first_metric = Some(name);
        }
        saw_sample = true;
        match series {
            Some(Series::CacheConfigInfo | Series::MaxTotalTokens) => {
                totals
                    .capacity
                    .add(sample.name, |l| sample.label(l), sample.value);
            }
            Some(series) => totals.add(series, sample.value),
            None => {}
        }
        if wants_release {
            if let Some(spec) = release_spec {
                release = sample.label(spec.label).map(Cow::into_owned);
            }
        }
    }

    if !saw_sample {
        return Err(MetricsError::NoSamples {
            lines: line_count,
            first_malformed_line,
        });
    }
    let mut sample = totals.into_sample(release);
    sample.block_tokens = sample.block_tokens.or(kind.default_block_tokens());
    if sample.waiting.is_none() && sample.running.is_none() {
        let shown =
            |n: &[u8]| String::from_utf8_lossy(n.get(..MAX_NAME_SHOWN).unwrap_or(n)).into_owned();
        let first_metric = first_metric.map(shown).unwrap_or_default();
        let first_namespaced = first_namespaced
            .map(shown)
            .filter(|n| !first_metric.contains(':') && *n != first_metric);
        return Err(MetricsError::NoLoadSeries {
            engine: kind,
            first_metric,
            first_namespaced,
        });
    }
    Ok(sample)
}

/// A parsed `metric_name/label_name` release spec.
#[derive(Debug, Clone, Copy)]
struct ReleaseLabel<'a> {
    metric: &'a str,
    label: &'a str,
}

impl<'a> ReleaseLabel<'a> {
    fn parse(spec: &'a str) -> Result<Self, MetricsError> {
        spec.split_once('/')
            .filter(|(metric, label)| is_metric_name(metric) && is_label_name(label))
            .map(|(metric, label)| ReleaseLabel { metric, label })
            .ok_or_else(|| MetricsError::InvalidReleaseLabel {
                spec: spec.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::families::tests::{vllm_v1_payload, LLAMACPP_PAYLOAD};

    #[test]
    fn the_process_start_is_read_though_it_has_no_engine_prefix() {
        // As vLLM 0.32 prints it, among other unprefixed process series.
        let page = b"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.79646850392e+09\nprocess_open_fds 32.0\nvllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n";
        let s = parse_engine_metrics(EngineKind::Vllm, page, None).unwrap();
        assert_eq!(s.process_start_s, Some(1.79646850392e9));
        let s = parse_engine_metrics(
            EngineKind::Llamacpp,
            b"llamacpp:requests_deferred 0\nprocess_start_time_seconds 5\n",
            None,
        )
        .unwrap();
        assert_eq!(
            s.process_start_s, None,
            "llama.cpp's table does not read it"
        );
    }

    #[test]
    fn another_familys_payload_is_a_failed_scrape_naming_what_came_back() {
        // Each family read with another's names: vLLM's and SGLang's
        // payloads start with Python's own series, llama.cpp's with its own.
        let sglang =
            "sglang:num_running_reqs{dp_rank=\"0\"} 8\nsglang:num_queue_reqs{dp_rank=\"0\"} 8\n";
        for (kind, text, first, namespaced) in [
            (
                EngineKind::Sglang,
                vllm_v1_payload(),
                "python_gc_objects_collected_total",
                Some("vllm:num_requests_running"),
            ),
            (
                EngineKind::Vllm,
                LLAMACPP_PAYLOAD.to_string(),
                "llamacpp:prompt_tokens_total",
                None,
            ),
            (
                EngineKind::Llamacpp,
                sglang.to_string(),
                "sglang:num_running_reqs",
                None,
            ),
        ] {
            let err = parse_engine_metrics(kind, text.as_bytes(), None).unwrap_err();
            assert_eq!(
                err,
                MetricsError::NoLoadSeries {
                    engine: kind,
                    first_metric: first.to_string(),
                    first_namespaced: namespaced.map(str::to_string),
                },
                "{kind:?}"
            );
        }
        let err = parse_engine_metrics(EngineKind::Sglang, vllm_v1_payload().as_bytes(), None)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "metrics payload has no sglang load figure (sglang:num_queue_reqs, sglang:num_running_reqs); \
             its first sample is python_gc_objects_collected_total, its first namespaced metric \
             vllm:num_requests_running (is regions[].engine right?)"
        );
        let err =
            parse_engine_metrics(EngineKind::Vllm, LLAMACPP_PAYLOAD.as_bytes(), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "metrics payload has no vllm load figure (vllm:num_requests_waiting, vllm:num_requests_running); \
             its first sample is llamacpp:prompt_tokens_total (is regions[].engine right?)"
        );
        // The load series there but with no usable value is no figure either.
        let err = parse_engine_metrics(EngineKind::Vllm, b"vllm:num_requests_waiting NaN\n", None)
            .unwrap_err();
        assert!(matches!(err, MetricsError::NoLoadSeries { .. }), "{err}");
        // One of the two is a load figure (the other is taken as 0).
        let one = parse_engine_metrics(
            EngineKind::Llamacpp,
            b"llamacpp:requests_deferred 2\n",
            None,
        )
        .unwrap();
        assert_eq!((one.waiting, one.running), (Some(2.0), None));
        // A name is shown cut, never the payload around it.
        let long = format!("{} 1\n", "x".repeat(10_000));
        match parse_engine_metrics(EngineKind::Vllm, long.as_bytes(), None) {
            Err(MetricsError::NoLoadSeries { first_metric, .. }) => {
                assert_eq!(first_metric.len(), MAX_NAME_SHOWN)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tolerates_blanks_crlf_timestamps_exponents_and_odd_label_values() {
        let text = "# a free comment\r\n\
\r\n\
   vllm:num_requests_running { engine = \"0\" , model_name = \"m\" , }   4   1712345678000  \r\n\
vllm:num_requests_running{engine=\"1\",model_name=\"a,b}{\\\"x\\\" = y\"}\t6\r\n\
vllm:num_requests_waiting{} 2.5E+1\r\n\
vllm:num_requests_waiting 1e0\r\n\
vllm:kv_cache_usage_perc{path=\"C:\\\\models\\\\llama\",note=\"line\\nbreak\"} 0.125\r\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(sample.running, Some(10.0));
        assert_eq!(sample.waiting, Some(26.0));
        assert_eq!(sample.kv_usage, Some(0.125));
    }

    #[test]
    fn malformed_lines_are_skipped_without_failing_the_scrape() {
        let text = "\
vllm:num_requests_waiting{engine=\"0\" 5\n\
vllm:num_requests_waiting{engine=\"0\"} 5 6 7\n\
vllm:num_requests_waiting{engine=\"0\"} 5 12.5\n\
vllm:num_requests_waiting{engine=0} 5\n\
vllm:num_requests_waiting{engine=\"0\"}\n\
vllm:num_requests_waiting{engine=\"unterminated\\\"} 5\n\
vllm:num_requests_waiting{,} 5\n\
vllm:num_requests_waiting{engine=\"0\"} five\n\
vllm:num_requests_waiting{engine=\"1\"} 3\n";
        let sample = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(sample.waiting, Some(3.0));
    }

    #[test]
    fn empty_payload_is_an_error() {
        let err = parse_engine_metrics(EngineKind::Vllm, b"", None).unwrap_err();
        assert_eq!(
            err,
            MetricsError::NoSamples {
                lines: 0,
                first_malformed_line: None
            }
        );
        assert_eq!(err.to_string(), "metrics payload is empty");
    }

    #[test]
    fn comments_only_is_an_error() {
        let text = b"# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n\n";
        let err = parse_engine_metrics(EngineKind::Vllm, text, None).unwrap_err();
        assert_eq!(
            err,
            MetricsError::NoSamples {
                lines: 3,
                first_malformed_line: None
            }
        );
        assert_eq!(
            err.to_string(),
            "metrics payload has no sample line in 3 lines (only blanks and comments)"
        );
    }

    #[test]
    fn garbage_bytes_are_an_error_naming_the_first_bad_line() {
        let text = b"# looks like a comment\n\xff\xfe\x00\x9f{{{ \"\n\x80\x81 1 2 3\n<html><body>502 Bad Gateway</body></html>\n";
        let err = parse_engine_metrics(EngineKind::Vllm, text, None).unwrap_err();
        assert_eq!(
            err,
            MetricsError::NoSamples {
                lines: 4,
                first_malformed_line: Some(2)
            }
        );
        assert_eq!(
            err.to_string(),
            "metrics payload has no parseable sample line in 4 lines (first malformed line: 2)"
        );
    }

    #[test]
    fn non_utf8_in_a_metric_we_read_is_an_error_elsewhere_skipped() {
        let text = b"other_metric{x=\"\xff\"} 1\nvllm:num_requests_running 1\nvllm:num_requests_waiting{model_name=\"\xc3\x28\"} 1\n";
        let err = parse_engine_metrics(EngineKind::Vllm, text, None).unwrap_err();
        assert_eq!(
            err,
            MetricsError::NotUtf8 {
                line: 3,
                metric: "vllm:num_requests_waiting".to_owned()
            }
        );
        assert_eq!(
            err.to_string(),
            "metrics line 3 (vllm:num_requests_waiting) is not valid UTF-8"
        );
        let before_bad_line =
            text.len() - b"vllm:num_requests_waiting{model_name=\"\xc3\x28\"} 1\n".len();
        let ok = parse_engine_metrics(EngineKind::Vllm, &text[..before_bad_line], None).unwrap();
        assert_eq!(ok.running, Some(1.0));
    }

    #[test]
    fn payload_over_the_cap_is_refused_unparsed() {
        let mut text = vec![b'#'; MAX_PAYLOAD_BYTES + 1];
        text.extend_from_slice(b"\nvllm:num_requests_waiting 1\n");
        let err = parse_engine_metrics(EngineKind::Vllm, &text, None).unwrap_err();
        assert_eq!(
            err,
            MetricsError::TooLarge {
                bytes: MAX_PAYLOAD_BYTES + 30,
                limit: MAX_PAYLOAD_BYTES
            }
        );
        assert_eq!(
            err.to_string(),
            "metrics payload of 4194334 bytes is over the 4194304-byte limit; not parsed"
        );

        // Exactly at the cap is still parsed.
        let line = b"vllm:num_requests_waiting 1\n";
        let mut at_cap = vec![b'#'; MAX_PAYLOAD_BYTES - line.len() - 1];
        at_cap.push(b'\n');
        at_cap.extend_from_slice(line);
        assert_eq!(at_cap.len(), MAX_PAYLOAD_BYTES);
        let sample = parse_engine_metrics(EngineKind::Vllm, &at_cap, None).unwrap();
        assert_eq!(sample.waiting, Some(1.0));
    }

    #[test]
    fn release_label_comes_unescaped_from_the_first_series() {
        let text = "\
# HELP vllm:release_info Build of the serving image.\n\
# TYPE vllm:release_info gauge\n\
vllm:release_info{note=\"a,b{c} d\",digest=\"sha256:ab\\\"c\\\\d\\ne\"} 1\n\
vllm:release_info{digest=\"sha256:second\"} 1\n\
vllm:num_requests_waiting 0\n";
        let sample = parse_engine_metrics(
            EngineKind::Vllm,
            text.as_bytes(),
            Some("vllm:release_info/digest"),
        )
        .unwrap();
        assert_eq!(sample.release.as_deref(), Some("sha256:ab\"c\\d\ne"));
        assert_eq!(sample.waiting, Some(0.0));
    }

    #[test]
    fn release_label_may_name_any_metric_and_may_be_missing() {
        let text =
            "build_info{revision=\"4f2a9c1\",version=\"0.10.2\"} 1\nvllm:num_requests_waiting 0\n";
        let found = parse_engine_metrics(
            EngineKind::Vllm,
            text.as_bytes(),
            Some("build_info/revision"),
        )
        .unwrap();
        assert_eq!(found.release.as_deref(), Some("4f2a9c1"));
        let other_label =
            parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), Some("build_info/digest"))
                .unwrap();
        assert_eq!(other_label.release, None);
        let no_metric = parse_engine_metrics(
            EngineKind::Vllm,
            text.as_bytes(),
            Some("vllm:release_info/digest"),
        )
        .unwrap();
        assert_eq!(no_metric.release, None);
        // A release without load figures is no load scrape (nor a release
        // read: the probe takes nothing from a failed scrape).
        let only_release = parse_engine_metrics(
            EngineKind::Sglang,
            b"build_info{revision=\"r1\"} 1\n",
            Some("build_info/revision"),
        )
        .unwrap_err();
        assert!(
            matches!(only_release, MetricsError::NoLoadSeries { .. }),
            "{only_release}"
        );
    }

    #[test]
    fn malformed_release_spec_is_an_error() {
        for spec in [
            "",
            "/",
            "vllm:release_info",
            "/digest",
            "vllm:release_info/",
            "vllm:release_info/dig-est",
            "vllm:release_info/a:b",
            "9metric/digest",
            "a/b/c",
            "vllm release/digest",
        ] {
            let err = parse_engine_metrics(EngineKind::Vllm, b"x 1\n", Some(spec)).unwrap_err();
            assert_eq!(
                err,
                MetricsError::InvalidReleaseLabel {
                    spec: spec.to_owned()
                },
                "{spec}"
            );
        }
        let err = parse_engine_metrics(EngineKind::Vllm, b"x 1\n", Some("release")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "release label \"release\" is not of the form metric_name/label_name"
        );
    }

    /// Tiny linear congruential generator (Knuth's MMIX constants); enough to
    /// spray bytes without another crate.
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 33
        }

        fn below(&mut self, n: u64) -> usize {
            (self.next() % n) as usize
        }
    }

    #[test]
    fn random_bytes_never_panic() {
        // Bytes drawn mostly from the format's own alphabet so the parser is
        // driven deep into labels and values, plus raw noise.
        const ALPHABET: &[u8] =
            b"vllm:sglang_num_requests_waiting{}=\",\\n# \t\r\n0123456789.eE+-InfNa\xff\xc3";
        let mut rng = Lcg(0x5eed);
        let base = vllm_v1_payload().into_bytes();
        for round in 0..4000 {
            let bytes: Vec<u8> = match round % 3 {
                0 => (0..rng.below(300))
                    .map(|_| ALPHABET[rng.below(ALPHABET.len() as u64)])
                    .collect(),
                1 => (0..rng.below(300)).map(|_| rng.next() as u8).collect(),
                _ => {
                    let mut mutated = base.clone();
                    for _ in 0..1 + rng.below(20) {
                        let at = rng.below(mutated.len() as u64);
                        mutated[at] = ALPHABET[rng.below(ALPHABET.len() as u64)];
                    }
                    mutated
                }
            };
            for kind in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::Llamacpp] {
                if let Ok(sample) =
                    parse_engine_metrics(kind, &bytes, Some("vllm:num_requests_waiting/engine"))
                {
                    for ratio in [sample.kv_usage, sample.hit_rate].into_iter().flatten() {
                        assert!((0.0..=1.0).contains(&ratio), "{ratio}");
                    }
                    for count in [sample.waiting, sample.running, sample.prefix_queries]
                        .into_iter()
                        .flatten()
                    {
                        assert!(count.is_finite() && count >= 0.0, "{count}");
                    }
                }
            }
            if let Ok(spec) = std::str::from_utf8(&bytes) {
                let _ = parse_engine_metrics(EngineKind::Vllm, b"x 1\n", Some(spec));
            }
        }
    }
}
