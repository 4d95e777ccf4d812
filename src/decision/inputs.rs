//! What the decision reads: its `Inputs`, gathered by the caller, with the
//! cost `Weights` in force; and what they tell of one region (its slots,
//! whether the residency pin allows it).

use crate::config::Config;
use crate::fleet::snapshot::Snapshot;

/// Everything the decision reads, gathered by the caller.
pub struct Inputs<'a> {
    pub config: &'a Config,
    /// A fresh snapshot, or `None` when there is none or it is stale.
    pub snapshot: Option<&'a Snapshot>,
    /// Per configured region: the index of its entry in the snapshot.
    pub snapshot_index: &'a [Option<usize>],
    /// Per configured region: blocks of the prompt it holds.
    pub cached_blocks: &'a [u32],
    /// Per configured region: its engine's intake clock with this Envoy's
    /// prefills placed in it (empty: its cache is not modelled).
    pub clocks: &'a [Vec<(u64, f64)>],
    /// Per configured region: this Envoy's in-flight requests now.
    pub inflight: &'a [f64],
    /// The prompt's tokens, estimated fleet-wide (see
    /// [`tokens_per_byte`](crate::fleet::tokens::tokens_per_byte)).
    pub prompt_tokens: u64,
    /// Bytes of canonical prompt text (each region's estimate is made
    /// from them with its own tokens per byte).
    pub prompt_bytes: u64,
    /// Fleet-wide tokens per byte (`prompt_tokens` was made with it): for
    /// the regions not yet measured.
    pub tokens_per_byte: f64,
    /// The request's `model`, for per-model tokens per byte.
    pub model: Option<&'a str>,
    /// Rendezvous key for ties (the first block's hash, else the session's).
    pub first_block: Option<u64>,
    /// Residency pin: per configured region, whether it is allowed.
    pub allowed: Option<&'a [bool]>,
    /// Per configured region (bit i): whether the request fits its context
    /// limit (`limits::check`); `u64::MAX` when none is known.
    pub fits: u64,
    /// Now (ms since the Unix epoch): how long the engines have drained
    /// since their scrape.
    pub now_ms: u64,
}

/// Slots region `i` runs at once: its `max_concurrency` times the
/// replicas the snapshot reports behind its entry point (one if none).
pub fn region_slots(inp: &Inputs, i: usize) -> u32 {
    let per = inp.config.regions.get(i).map_or(1, |r| r.max_concurrency);
    match inp
        .snapshot
        .and_then(|s| s.region_at(inp.snapshot_index, i))
    {
        Some(state) => state.slots(per),
        None => per.max(1),
    }
}

/// Whether the residency pin allows region `i` (no pin: every region).
pub(super) fn allowed(inp: &Inputs, i: usize) -> bool {
    inp.allowed
        .is_none_or(|a| a.get(i).copied().unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use crate::decision::choice::decide;
    use crate::decision::choice::tests::{eight_slots, inputs, snap};
    use crate::decision::cost::Reason;

    #[test]
    fn replicas_behind_an_entry_point_multiply_its_slots() {
        let c = eight_slots();
        let mut s = snap(&c);
        // 20 requests at mid: with one engine of 8 slots, 12 wait; with the
        // 3 replicas the Prometheus source reports, none does.
        s.regions[1].running = 20.0;
        let one = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert!(one.costs[1].wait_ms > 0.0);
        s.regions[1].replicas = Some(3);
        let three = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert_eq!(three.costs[1].wait_ms, 0.0);
        assert_eq!((three.region, three.reason), (1, Reason::Cache));
    }
}
