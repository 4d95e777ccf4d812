//! An engine's KV-cache capacity in tokens: vLLM's `cache_config_info`
//! labels or SGLang's `max_total_num_tokens`, summed over the engines
//! behind one endpoint, as the scrape and the `prometheus` source
//! (`promql`) both read it; and the block its cache is kept in (vLLM's
//! `block_size` label, SGLang's `page_size`), which decides how much of a
//! held prompt it can serve from its cache (`servable_tokens`).

/// Largest KV-cache capacity believed, in tokens, for one region: a
/// thousand times the largest pools deployed today (a few hundred GPUs of
/// a few million tokens each). A larger figure is a broken exporter.
pub const MAX_CACHE_TOKENS: u64 = 1_000_000_000_000;

/// Largest cache block believed, in tokens: vLLM's are 16 by default and
/// 128 on CPU; hybrid models' reach a few thousand. A larger figure is a
/// broken exporter.
pub const MAX_BLOCK_TOKENS: u64 = 1 << 16;

/// A block size as an engine prints it (a label's text or a gauge's value,
/// as `f64`), if it is one: a whole number in 1..=[`MAX_BLOCK_TOKENS`].
pub fn block_tokens_of(value: f64) -> Option<u32> {
    (value.is_finite() && value.fract() == 0.0 && (1.0..=MAX_BLOCK_TOKENS as f64).contains(&value))
        .then_some(value as u32)
}

/// Of a prompt of `prompt_tokens` tokens of which `held` are in the
/// engine's cache, the tokens the engine serves from it: whole blocks of
/// `block` tokens only, and never the prompt's last token (computed to give
/// the first output token), so at most `⌊(prompt_tokens − 1) / block⌋`
/// blocks. vLLM's `cached_tokens` is always such a multiple. `None` (the
/// block is not known: llama.cpp, or an engine that does not say): `held`
/// within the prompt, unrounded.
pub fn servable_tokens(held: u64, prompt_tokens: u64, block: Option<u32>) -> u64 {
    let held = held.min(prompt_tokens);
    match block.map(u64::from).filter(|b| *b > 0) {
        Some(b) => (held / b * b).min(prompt_tokens.saturating_sub(1) / b * b),
        None => held,
    }
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

/// The KV-cache capacity over the series of its metric, as the scrape
/// and the `prometheus` source (`promql`) both sum it.
#[derive(Debug, Default)]
pub struct CapacitySum {
    tokens: Option<u64>,
    /// The first refused figure; once set, the sum is refused.
    invalid: Option<String>,
    /// The largest valid `block_size` label of vLLM's series, whatever
    /// became of the sum (a pool not yet profiled still says its block).
    block_tokens: Option<u32>,
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
        if name == "vllm:cache_config_info" {
            let block = label("block_size")
                .and_then(|b| b.as_ref().trim().parse::<f64>().ok())
                .and_then(block_tokens_of);
            // Engines of one region with other blocks: the largest, as
            // blocks are powers of two, rounds down to every engine's.
            self.block_tokens = self.block_tokens.max(block);
        }
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

    /// The block the engines keep their cache in, from vLLM's
    /// `block_size` labels (the largest); `None`: no valid label.
    pub fn block_tokens(&self) -> Option<u32> {
        self.block_tokens
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::families::EngineKind;
    use crate::engines::metrics::parse_engine_metrics;

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
    fn the_engines_block_is_read_with_the_capacity_and_rounds_what_it_serves() {
        let block = |kind, text: &str| {
            parse_engine_metrics(kind, text.as_bytes(), None)
                .unwrap()
                .block_tokens
        };
        let vllm = |labels: &[&str]| {
            let mut t = String::from("vllm:num_requests_waiting 0\n");
            for (i, l) in labels.iter().enumerate() {
                t.push_str(&format!(
                    "vllm:cache_config_info{{{l},engine=\"{i}\",num_gpu_blocks=\"None\"}} 1.0\n"
                ));
            }
            block(EngineKind::Vllm, &t)
        };
        // The label, even before the pool is profiled; the largest over
        // engines; a garbled one is no block.
        assert_eq!(vllm(&["block_size=\"128\""]), Some(128));
        assert_eq!(vllm(&["block_size=\"16\"", "block_size=\"32\""]), Some(32));
        for bad in ["0", "-16", "1.5", "None", "99999999", ""] {
            assert_eq!(vllm(&[&format!("block_size=\"{bad}\"")]), None, "{bad}");
        }
        assert_eq!(vllm(&["cache_dtype=\"auto\""]), None);
        // SGLang: its page size, else its default page of one token.
        let sglang = "sglang:num_running_reqs 0\n";
        assert_eq!(block(EngineKind::Sglang, sglang), Some(1));
        assert_eq!(
            block(
                EngineKind::Sglang,
                &format!("{sglang}sglang:page_size{{tp_rank=\"0\"}} 16.0\n")
            ),
            Some(16)
        );
        assert_eq!(
            block(
                EngineKind::Sglang,
                &format!("{sglang}sglang:page_size NaN\n")
            ),
            Some(1)
        );
        // llama.cpp says none.
        assert_eq!(
            block(EngineKind::Llamacpp, "llamacpp:requests_processing 1\n"),
            None
        );
        // What is served: whole blocks, never the prompt's last token.
        assert_eq!(servable_tokens(300, 1000, Some(128)), 256);
        assert_eq!(servable_tokens(256, 256, Some(128)), 128);
        assert_eq!(servable_tokens(256, 257, Some(128)), 256);
        assert_eq!(servable_tokens(127, 1000, Some(128)), 0);
        assert_eq!(servable_tokens(256, 256, Some(1)), 255);
        assert_eq!(servable_tokens(900, 256, None), 256, "unknown: capped only");
        assert_eq!(servable_tokens(5, 0, Some(16)), 0);
        // No overflow at the ends: (2^64 − 1) is (2^32 + 1) blocks of
        // (2^32 − 1), the last of them not servable.
        let b = u64::from(u32::MAX);
        assert_eq!(
            servable_tokens(u64::MAX, u64::MAX, Some(u32::MAX)),
            u64::MAX - b
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
}
