//! Engine load metrics: turns the Prometheus text exposition (format 0.0.4)
//! that vLLM, SGLang and llama.cpp's `llama-server` serve on `/metrics`
//! into the few numbers the router weighs (queue depth, running requests,
//! KV-cache usage, prefix-cache counters or hit rate, KV-cache capacity in
//! tokens) and an optional release digest read from a label.
//!
//! This module owns the text-format parsing and the per-engine metric names.
//! It does no I/O and keeps no state between scrapes; the probe fetches the
//! payload and decides what a missing number means for routing. A payload
//! with neither of the family's load figures (waiting, running) is an
//! error, not an idle engine: read with the wrong family's names, every
//! engine would look idle.

use std::borrow::Cow;
use std::fmt;

/// Largest payload parsed. A healthy engine prints tens of kilobytes; anything
/// this big is a misconfigured endpoint, and parsing it would stall the
/// proxy's worker thread.
pub const MAX_PAYLOAD_BYTES: usize = 4 * 1024 * 1024;

/// Largest KV-cache capacity believed, in tokens, for one region: a
/// thousand times the largest pools deployed today (a few hundred GPUs of
/// a few million tokens each). A larger figure is a broken exporter.
pub const MAX_CACHE_TOKENS: u64 = 1_000_000_000_000;

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
    fn metric_prefix(self) -> &'static [u8] {
        match self {
            EngineKind::Vllm => b"vllm:",
            EngineKind::Sglang => b"sglang:",
            EngineKind::Llamacpp => b"llamacpp:",
        }
    }

    fn wanted_series(self) -> &'static [(&'static str, Series)] {
        match self {
            EngineKind::Vllm => VLLM_SERIES,
            EngineKind::Sglang => SGLANG_SERIES,
            EngineKind::Llamacpp => LLAMACPP_SERIES,
        }
    }

    /// The names of the kind's waiting and running series, as a
    /// failed scrape names them.
    fn load_series(self) -> impl Iterator<Item = &'static str> {
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
}

/// What the engine says its KV cache holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheCapacity {
    /// Tokens, summed over data-parallel engines; always in
    /// 1..=[`MAX_CACHE_TOKENS`].
    Tokens(u64),
    /// The metric is there but a figure in it is no usable capacity (zero,
    /// negative, not a number, `None`, over [`MAX_CACHE_TOKENS`]): the
    /// whole figure is refused, since a sum without one engine would
    /// understate it. The text says which figure, as the engine wrote it.
    Invalid(String),
}

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
        let series = if name.starts_with(prefix) {
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
    let sample = totals.into_sample(release);
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

/// One physical line of a payload, without its `\n` or `\r\n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line<'a> {
    /// 1-based, as an editor or `sed -n` counts.
    pub number: usize,
    pub bytes: &'a [u8],
}

/// Iterator over the lines of a payload; borrows, never allocates.
#[derive(Debug, Clone)]
pub struct Lines<'a> {
    rest: Option<&'a [u8]>,
    number: usize,
}

/// Splits a payload into numbered lines, accepting `\n` and `\r\n` endings.
pub fn lines(text: &[u8]) -> Lines<'_> {
    Lines {
        rest: (!text.is_empty()).then_some(text),
        number: 0,
    }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Line<'a>;

    fn next(&mut self) -> Option<Line<'a>> {
        let rest = self.rest?;
        let (line, tail) = match rest.iter().position(|&b| b == b'\n') {
            Some(end) => (rest.get(..end).unwrap_or_default(), rest.get(end + 1..)),
            None => (rest, None),
        };
        // A final newline ends the last line; it does not start an empty one.
        self.rest = tail.filter(|tail| !tail.is_empty());
        self.number += 1;
        Some(Line {
            number: self.number,
            bytes: line.strip_suffix(b"\r").unwrap_or(line),
        })
    }
}

/// One sample line, parsed: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub value: f64,
    /// Milliseconds since the epoch, when the exporter printed one.
    pub timestamp_ms: Option<i64>,
    /// The text between the braces, already checked; label values stay
    /// escaped until [`Sample::label`] asks for one.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// Parses one line of the text format; `None` for comments, blank lines
    /// and anything malformed. Blanks may surround every token.
    pub fn parse(line: &'a str) -> Option<Self> {
        let mut cursor = Cursor { rest: line };
        cursor.skip_blanks();
        let name = cursor.take_while(is_metric_name_byte);
        if !is_metric_name(name) {
            return None;
        }
        // The name must be followed by labels or a separator, not glued to
        // another token.
        if !matches!(cursor.peek(), Some(b'{' | b' ' | b'\t')) {
            return None;
        }
        cursor.skip_blanks();

        let mut labels = "";
        if cursor.eat(b'{') {
            let inside = cursor.rest;
            loop {
                cursor.skip_blanks();
                if cursor.peek() == Some(b'}') {
                    break;
                }
                cursor.label_pair()?;
                // A trailing comma before `}` is allowed by the format.
                if !cursor.eat(b',') && cursor.peek() != Some(b'}') {
                    return None;
                }
            }
            let inside_len = inside.len().checked_sub(cursor.rest.len())?;
            labels = inside.get(..inside_len)?;
            cursor.eat(b'}');
            cursor.skip_blanks();
        }

        let value = parse_value(cursor.take_token())?;
        cursor.skip_blanks();
        let timestamp_ms = match cursor.take_token() {
            "" => None,
            token => Some(token.parse::<i64>().ok()?),
        };
        cursor.skip_blanks();
        if !cursor.rest.is_empty() {
            return None;
        }
        Some(Sample {
            name,
            value,
            timestamp_ms,
            labels,
        })
    }

    /// The unescaped value of label `name`, if the series carries it.
    /// Borrows unless the value holds an escape sequence.
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        let mut cursor = Cursor { rest: self.labels };
        loop {
            let (label, raw_value) = cursor.label_pair()?;
            if label == name {
                return Some(unescape_label_value(raw_value));
            }
            cursor.eat(b',');
        }
    }
}

/// Where a number lands. Counts and counters are summed over series; usage
/// and ratio gauges are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Series {
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
    /// vLLM's `cache_config_info`: the capacity is in its labels.
    CacheConfigInfo,
    /// SGLang's `max_total_num_tokens`: the capacity is the value.
    MaxTotalTokens,
}

/// The spellings vLLM has used for its prefix-cache counters, most preferred
/// first. Queries and hits are always taken from the same spelling so their
/// ratio compares like with like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefixFamily {
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
    ("vllm:cache_config_info", Series::CacheConfigInfo),
];

const SGLANG_SERIES: &[(&str, Series)] = &[
    ("sglang:num_queue_reqs", Series::Waiting),
    ("sglang:num_running_reqs", Series::Running),
    ("sglang:token_usage", Series::KvUsage),
    ("sglang:cache_hit_rate", Series::HitRate),
    ("sglang:num_requests_total", Series::Completed),
    ("sglang:max_total_num_tokens", Series::MaxTotalTokens),
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
struct Totals {
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
    capacity: CapacitySum,
}

/// The KV-cache capacity over the series of its metric, as the scrape
/// and the `prometheus` source (`promql`) both sum it.
#[derive(Debug, Default)]
pub struct CapacitySum {
    tokens: Option<u64>,
    /// The first refused figure; once set, the sum is refused.
    invalid: Option<String>,
}

impl CapacitySum {
    /// Add one series of `name` (`vllm:cache_config_info` or
    /// `sglang:max_total_num_tokens`), given its labels and value.
    pub fn add<L: AsRef<str>>(
        &mut self,
        name: &str,
        label: impl Fn(&str) -> Option<L>,
        value: f64,
    ) {
        if self.invalid.is_some() {
            return;
        }
        match capacity_of(name, label, value) {
            Ok(None) => {}
            Ok(Some(tokens)) => {
                let sum = self.tokens.unwrap_or(0).checked_add(tokens);
                match sum.filter(|t| *t <= MAX_CACHE_TOKENS) {
                    Some(t) => self.tokens = Some(t),
                    None => {
                        self.invalid = Some(format!(
                            "{name}: the sum over engines is over {MAX_CACHE_TOKENS} tokens"
                        ));
                    }
                }
            }
            Err(why) => self.invalid = Some(why),
        }
    }

    /// `None` when no series was added (or each repeated another's pool).
    pub fn into_capacity(self) -> Option<CacheCapacity> {
        match (self.invalid, self.tokens) {
            (Some(why), _) => Some(CacheCapacity::Invalid(why)),
            (None, Some(t)) => Some(CacheCapacity::Tokens(t)),
            (None, None) => None,
        }
    }
}

/// One series' capacity in tokens: vLLM's `num_gpu_blocks` × `block_size`
/// labels (one series per data-parallel engine, `engine="N"`), SGLang's
/// value (one series per `dp_rank`). `Ok(None)`: a series that repeats
/// another's pool (SGLang prints one per tensor- and pipeline-parallel
/// rank; only rank 0's is counted).
fn capacity_of<L: AsRef<str>>(
    name: &str,
    label: impl Fn(&str) -> Option<L>,
    value: f64,
) -> Result<Option<u64>, String> {
    if name == "vllm:cache_config_info" {
        let figure = |l: &str| -> Result<u64, String> {
            let v = label(l).ok_or_else(|| format!("{name} has no {l} label"))?;
            let v = v.as_ref();
            match v.trim().parse::<u64>() {
                Ok(n) if n > 0 && n <= MAX_CACHE_TOKENS => Ok(n),
                _ => Err(format!(
                    "{name} {l}={v:?} is not a whole number in 1..={MAX_CACHE_TOKENS}"
                )),
            }
        };
        let blocks = figure("num_gpu_blocks")?;
        let size = figure("block_size")?;
        return blocks
            .checked_mul(size)
            .filter(|t| *t <= MAX_CACHE_TOKENS)
            .map(Some)
            .ok_or_else(|| {
                format!(
                    "{name} num_gpu_blocks={blocks} x block_size={size} is over {MAX_CACHE_TOKENS} tokens"
                )
            });
    }
    for rank in ["tp_rank", "pp_rank"] {
        if label(rank).is_some_and(|r| r.as_ref().trim() != "0") {
            return Ok(None);
        }
    }
    if value.is_finite() && value >= 1.0 && value <= MAX_CACHE_TOKENS as f64 {
        Ok(Some(value.round() as u64))
    } else {
        Err(format!(
            "{name} is {value}, not a number of tokens in 1..={MAX_CACHE_TOKENS}"
        ))
    }
}

impl Totals {
    fn add(&mut self, series: Series, value: f64) {
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
            Series::CacheConfigInfo | Series::MaxTotalTokens => (None, None),
        };
        if let (Some(accumulator), Some(value)) = (accumulator, value) {
            accumulator.add(value);
        }
    }

    fn into_sample(self, release: Option<String>) -> EngineSample {
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
        }
    }
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

enum LineClass {
    Comment,
    Sample,
    Malformed,
}

fn classify(line: &[u8]) -> LineClass {
    match line.iter().find(|&&b| !is_blank(b)) {
        None | Some(b'#') => LineClass::Comment,
        Some(_) => match std::str::from_utf8(line).ok().and_then(Sample::parse) {
            Some(_) => LineClass::Sample,
            None => LineClass::Malformed,
        },
    }
}

/// The metric name a line starts with, or empty for comments, blank lines
/// and lines that start with anything else. Names are ASCII, so this works
/// on bytes before the line is known to be UTF-8.
fn leading_metric_name(line: &[u8]) -> &[u8] {
    let start = line
        .iter()
        .position(|&b| !is_blank(b))
        .unwrap_or(line.len());
    let rest = line.get(start..).unwrap_or_default();
    let end = rest
        .iter()
        .position(|&b| !is_metric_name_byte(b))
        .unwrap_or(rest.len());
    rest.get(..end).unwrap_or_default()
}

/// A value as Go's ParseFloat reads it, which is what the format specifies.
fn parse_value(token: &str) -> Option<f64> {
    match token {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => token.parse::<f64>().ok(),
    }
}

/// Undoes the three escapes the format defines (`\\`, `\"`, `\n`); any
/// other backslash is kept as written, as Prometheus itself does.
fn unescape_label_value(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut value = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            value.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => value.push('\n'),
            Some('\\') => value.push('\\'),
            Some('"') => value.push('"'),
            Some(other) => {
                value.push('\\');
                value.push(other);
            }
            None => value.push('\\'),
        }
    }
    Cow::Owned(value)
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn is_metric_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn is_metric_name(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && name.bytes().all(is_metric_name_byte)
}

fn is_label_name(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A read position in one line. Every split is at an ASCII delimiter, so it
/// is a char boundary; `get` still guards it rather than trusting that.
#[derive(Debug)]
struct Cursor<'a> {
    rest: &'a str,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.rest.as_bytes().first().copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() != Some(byte) {
            return false;
        }
        self.rest = self.rest.get(1..).unwrap_or_default();
        true
    }

    fn skip_blanks(&mut self) {
        self.rest = self.rest.trim_start_matches([' ', '\t']);
    }

    fn take_while(&mut self, keep: impl Fn(u8) -> bool) -> &'a str {
        let end = self
            .rest
            .bytes()
            .position(|b| !keep(b))
            .unwrap_or(self.rest.len());
        self.split_at(end)
    }

    fn take_token(&mut self) -> &'a str {
        self.take_while(|b| !is_blank(b))
    }

    fn split_at(&mut self, at: usize) -> &'a str {
        match (self.rest.get(..at), self.rest.get(at..)) {
            (Some(head), Some(tail)) => {
                self.rest = tail;
                head
            }
            _ => "",
        }
    }

    /// `name = "value"` with optional blanks around each token; returns the
    /// name and the still-escaped value, and leaves the cursor after any
    /// blanks that follow the closing quote.
    fn label_pair(&mut self) -> Option<(&'a str, &'a str)> {
        self.skip_blanks();
        let name = self.take_while(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !is_label_name(name) {
            return None;
        }
        self.skip_blanks();
        if !self.eat(b'=') {
            return None;
        }
        self.skip_blanks();
        if !self.eat(b'"') {
            return None;
        }
        let value = self.quoted_rest()?;
        self.skip_blanks();
        Some((name, value))
    }

    /// The text up to the next unescaped `"`, which is consumed.
    fn quoted_rest(&mut self) -> Option<&'a str> {
        let bytes = self.rest.as_bytes();
        let mut end = 0;
        loop {
            match bytes.get(end)? {
                b'\\' => end += 2,
                b'"' => break,
                _ => end += 1,
            }
        }
        let value = self.rest.get(..end)?;
        self.rest = self.rest.get(end + 1..)?;
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

    /// The labels of vLLM's `cache_config_info` before `engine`, as 0.10
    /// prints them (the fields of its CacheConfig, sorted).
    const VLLM_CACHE_LABELS: &str = "block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_kvcache_space_bytes=\"4294967296\",cpu_offload_gb=\"0.0\",enable_prefix_caching=\"None\"";

    /// Shaped like vLLM v1 (0.9+) with two data-parallel engines: labels in
    /// prometheus_client's sorted order, `_total` counters with their
    /// `_created` companions, deprecated names beside the current ones, and
    /// series this module ignores.
    fn vllm_v1_payload() -> String {
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
            }
        );
    }

    fn vllm_capacity(series: &[(&str, &str)]) -> Option<CacheCapacity> {
        let mut text = String::from("vllm:num_requests_waiting 0\n");
        for (i, (blocks, size)) in series.iter().enumerate() {
            text.push_str(&format!(
                "vllm:cache_config_info{{block_size=\"{size}\",cache_dtype=\"auto\",engine=\"{i}\",num_gpu_blocks=\"{blocks}\",num_gpu_blocks_override=\"None\"}} 1.0\n"
            ));
        }
        parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None)
            .unwrap()
            .cache_capacity
    }

    fn invalid(c: Option<CacheCapacity>) -> String {
        match c {
            Some(CacheCapacity::Invalid(why)) => why,
            other => panic!("expected an invalid capacity, got {other:?}"),
        }
    }

    #[test]
    fn vllm_capacity_is_blocks_times_block_size_summed_over_engines() {
        assert_eq!(
            vllm_capacity(&[("1024", "16")]),
            Some(CacheCapacity::Tokens(16_384))
        );
        assert_eq!(
            vllm_capacity(&[("1024", "16"), ("2048", "16"), ("10", "32")]),
            Some(CacheCapacity::Tokens(16_384 + 32_768 + 320))
        );
        // No cache_config_info at all: no figure, not an invalid one.
        assert_eq!(vllm_capacity(&[]), None);
    }

    #[test]
    fn vllm_capacity_refuses_none_zero_negative_garbage_and_absurd_labels() {
        // vLLM prints "None" before it has profiled its memory.
        let why = invalid(vllm_capacity(&[("1024", "16"), ("None", "16")]));
        assert_eq!(
            why,
            "vllm:cache_config_info num_gpu_blocks=\"None\" is not a whole number in 1..=1000000000000"
        );
        for (blocks, size, label) in [
            ("0", "16", "num_gpu_blocks"),
            ("-5", "16", "num_gpu_blocks"),
            ("12.5", "16", "num_gpu_blocks"),
            ("lots", "16", "num_gpu_blocks"),
            ("", "16", "num_gpu_blocks"),
            ("1024", "0", "block_size"),
            ("1024", "None", "block_size"),
            ("99999999999999999999999", "16", "num_gpu_blocks"),
        ] {
            let why = invalid(vllm_capacity(&[(blocks, size)]));
            assert!(why.contains(label), "{blocks} x {size}: {why}");
        }
        // Each figure sane, the product absurd; and a sum past the cap.
        let why = invalid(vllm_capacity(&[("100000000000", "16")]));
        assert!(why.contains("is over 1000000000000 tokens"), "{why}");
        let why = invalid(vllm_capacity(&[
            ("40000000000", "16"),
            ("40000000000", "16"),
        ]));
        assert!(why.contains("sum over engines"), "{why}");
        // A series without the label is refused, not read as 0.
        let text = "vllm:num_requests_running 0\nvllm:cache_config_info{block_size=\"16\"} 1.0\n";
        let c = parse_engine_metrics(EngineKind::Vllm, text.as_bytes(), None).unwrap();
        assert_eq!(
            invalid(c.cache_capacity),
            "vllm:cache_config_info has no num_gpu_blocks label"
        );
    }

    #[test]
    fn sglang_capacity_is_the_value_summed_over_dp_ranks() {
        let parse = |lines: &str| {
            let text = format!("sglang:num_running_reqs 0\n{lines}");
            parse_engine_metrics(EngineKind::Sglang, text.as_bytes(), None)
                .unwrap()
                .cache_capacity
        };
        assert_eq!(
            parse("sglang:max_total_num_tokens{model_name=\"m\"} 144870.0\n"),
            Some(CacheCapacity::Tokens(144_870))
        );
        assert_eq!(
            parse(
                "sglang:max_total_num_tokens{dp_rank=\"0\",tp_rank=\"0\"} 1000\n\
                 sglang:max_total_num_tokens{dp_rank=\"0\",tp_rank=\"1\"} 1000\n\
                 sglang:max_total_num_tokens{dp_rank=\"1\",tp_rank=\"0\",pp_rank=\"0\"} 3000\n\
                 sglang:max_total_num_tokens{dp_rank=\"1\",tp_rank=\"0\",pp_rank=\"1\"} 3000\n"
            ),
            Some(CacheCapacity::Tokens(4000))
        );
        assert_eq!(parse("sglang:num_running_reqs 1\n"), None);
        for bad in ["0", "-1", "NaN", "+Inf", "0.5", "2e12"] {
            let why = invalid(parse(&format!(
                "sglang:max_total_num_tokens{{dp_rank=\"0\"}} 5000\nsglang:max_total_num_tokens{{dp_rank=\"1\"}} {bad}\n"
            )));
            assert!(
                why.starts_with("sglang:max_total_num_tokens is "),
                "{bad}: {why}"
            );
        }
        // A value that is not a number is a malformed line, skipped: no figure.
        assert_eq!(
            parse("sglang:max_total_num_tokens lots\nsglang:num_running_reqs 1\n"),
            None
        );
        // vLLM's metric means nothing to an SGLang region, and vice versa.
        assert_eq!(
            parse("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"9\"} 1\n"),
            None
        );
    }

    /// What `llama-server --metrics` (b11434) prints: every series
    /// unlabelled, counters then gauges, each with its HELP and TYPE lines;
    /// no KV usage, no capacity, no completions counter. Values are C++
    /// stream output: six significant digits, past a million in exponent
    /// form.
    const LLAMACPP_PAYLOAD: &str = "\
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
            }
        );
        // Without the cached counter (no hits), no lookups either: the
        // prompt counter alone is not what vLLM's queries mean.
        let text = "llamacpp:requests_processing 1\nllamacpp:prompt_tokens_total 10\n";
        let sample = parse_engine_metrics(EngineKind::Llamacpp, text.as_bytes(), None).unwrap();
        assert_eq!((sample.prefix_queries, sample.prefix_hits), (None, None));
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

    #[test]
    fn sample_parse_reads_values_and_timestamps() {
        let cases: [(&str, f64, Option<i64>); 7] = [
            ("a 1", 1.0, None),
            ("a 1.5e-3 -12", 0.0015, Some(-12)),
            ("a{b=\"c\"} +Inf", f64::INFINITY, None),
            ("a -Inf", f64::NEG_INFINITY, None),
            ("a{} -0.5", -0.5, None),
            ("a\t7\t8", 7.0, Some(8)),
            ("a:b_c 1E3", 1000.0, None),
        ];
        for (line, value, timestamp) in cases {
            let sample = Sample::parse(line).unwrap();
            assert_eq!(sample.value, value, "{line}");
            assert_eq!(sample.timestamp_ms, timestamp, "{line}");
        }
        assert!(Sample::parse("a NaN").unwrap().value.is_nan());
        for bad in [
            "",
            "# HELP a b",
            "a",
            "a{",
            "a{b=\"c\"",
            "1a 1",
            "a=1",
            "a 1 2 3",
        ] {
            assert_eq!(Sample::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn sample_label_lookup_borrows_unless_escaped() {
        let sample = Sample::parse("m{a=\"plain\",b=\"q\\\"uote\"} 1").unwrap();
        assert!(matches!(sample.label("a"), Some(Cow::Borrowed("plain"))));
        assert_eq!(sample.label("b").as_deref(), Some("q\"uote"));
        assert_eq!(sample.label("c"), None);
        assert_eq!(unescape_label_value("x\\ty\\"), "x\\ty\\");
    }

    #[test]
    fn lines_are_numbered_and_stripped_of_line_ends() {
        let got: Vec<(usize, &[u8])> = lines(b"a\r\n\nb\rc\nd")
            .map(|line| (line.number, line.bytes))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, &b"a"[..]),
                (2, &b""[..]),
                (3, &b"b\rc"[..]),
                (4, &b"d"[..])
            ]
        );
        assert_eq!(lines(b"x\n").count(), 1);
        assert_eq!(lines(b"").count(), 0);
        assert_eq!(lines(b"\n").count(), 1);
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
