//! Engine tokens per byte of canonical prompt text (a region's measured
//! figure, per model where measured; the fleet's mean; the prior before
//! any engine has answered), and a prompt's tokens from its bytes.

use crate::fleet::snapshot::{RegionState, Snapshot};

/// Engine tokens per byte of canonical prompt text for a region: measured
/// for `model`, else measured for the region, else the configured
/// [`PRIOR_TOKENS_PER_BYTE`]. Values outside any tokenizer's range are
/// not believed.
pub fn tokens_per_byte(state: Option<&RegionState>, model: Option<&str>) -> f64 {
    let sane = |v: &f64| v.is_finite() && (0.01..=4.0).contains(v);
    state
        .and_then(|s| {
            model
                .and_then(|m| {
                    s.model_tokens_per_byte
                        .iter()
                        .find(|(n, _)| n == m)
                        .map(|(_, v)| *v)
                        .filter(sane)
                })
                .or(s.tokens_per_byte.filter(sane))
        })
        .unwrap_or(PRIOR_TOKENS_PER_BYTE)
}

/// Engine tokens per byte of prompt text until an engine's `usage` says:
/// 4 bytes per token, about what the BPE tokenizers of today's models
/// give for English text. The first answer's `usage.prompt_tokens`
/// replaces it, per region and per model, so it is a starting point, not
/// a setting (docs/ROUTING.md, "What the engines report").
pub const PRIOR_TOKENS_PER_BYTE: f64 = 0.25;

/// Engine tokens per byte for the fleet-wide prompt estimate: the mean of
/// the regions' measured figures (for `model`, where measured), else
/// [`PRIOR_TOKENS_PER_BYTE`].
pub fn fleet_tokens_per_byte(snapshot: Option<&Snapshot>, model: Option<&str>) -> f64 {
    let (mut sum, mut n) = (0.0, 0u32);
    for r in snapshot
        .into_iter()
        .flat_map(|s| s.regions.iter())
        .filter(|r| r.tokens_per_byte.is_some())
    {
        sum += tokens_per_byte(Some(r), model);
        n += 1;
    }
    if n == 0 {
        PRIOR_TOKENS_PER_BYTE
    } else {
        sum / f64::from(n)
    }
}

/// Tokens in `bytes` at `tpb` tokens per byte.
pub fn tokens_of(bytes: u64, tpb: f64) -> u64 {
    (bytes as f64 * tpb).ceil() as u64
}
