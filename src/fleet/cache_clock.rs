//! What ages a region's modelled prefix cache: the tokens its engine's
//! cache took in, read from its counters at each scrape (`engine_intake`),
//! and the capacity and intake clock a snapshot carries for it
//! (`cache_model`).

use crate::engines::metrics::EngineSample;
use crate::learning::calibration::RegionCalibration;

/// Points of the intake clock a snapshot carries per region.
const CACHE_CLOCK_POINTS: usize = 48;

/// The tokens the engine's cache has taken in so far, from one scrape's
/// counters; `None` without its prefix-cache counters. Each request's new
/// blocks push out the least recently used: those of its prompt that
/// missed (prefix-cache queries less hits), of its answer (the generation
/// counter: vLLM caches a block as it fills, output included, and SGLang's
/// radix tree inserts the output when a request ends), and the block its
/// last tokens only partly fill, which evicts a whole one and is freed
/// holding nothing reusable: half a block per finished request on average
/// (vLLM 0.32's `KVCacheManager.allocate_slots` and `BlockPool`).
pub(crate) fn engine_intake(sample: &EngineSample, block_tokens: Option<u32>) -> Option<f64> {
    let (q, h) = (sample.prefix_queries?, sample.prefix_hits?);
    let partial = f64::from(block_tokens.unwrap_or(1).saturating_sub(1)) / 2.0;
    Some(
        (q - h).max(0.0)
            + sample.generation_tokens.unwrap_or(0.0)
            + sample.completed.unwrap_or(0.0) * partial,
    )
}

/// What the region's prefix cache holds, and the intake clock that ages
/// its entries, both per engine replica (a replica caches only what it
/// served itself); none while the capacity is unknown. The clock is the
/// engine's own where it exports its prefix-cache counters (all proxies'
/// traffic), else this Envoy's reported answers.
pub(crate) fn cache_model(
    capacity: Option<u64>,
    replicas: Option<u32>,
    calibration: &RegionCalibration,
) -> (Option<f64>, Vec<(u64, f64)>) {
    let Some(capacity) = capacity.filter(|c| *c > 0) else {
        return (None, Vec::new());
    };
    let replicas = f64::from(replicas.unwrap_or(1).max(1));
    // The whole capacity, not less what running requests pin
    // (`kv_cache_usage`): a running request's blocks are either new
    // intake, which the clock already charges, or reused prefixes, which
    // leave the free queue without pushing anything out. Less the pinned
    // share, scenario a's believed caches halved (cache hits 0.76 -> 0.64,
    // docs/ROUTING.md).
    let free = capacity as f64 / replicas;
    let clock = calibration
        .clock_for(free * replicas, CACHE_CLOCK_POINTS)
        .into_iter()
        .map(|(t, tokens)| (t, tokens / replicas))
        .collect();
    (Some(free), clock)
}
