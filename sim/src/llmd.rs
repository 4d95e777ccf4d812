//! The llm-d router as it ships: the endpoint picker (EPP) of the llm-d
//! inference scheduler (the Gateway API Inference Extension's scheduler,
//! moved there) with its default configuration, the regions as its
//! endpoints. Matched against llm-d/llm-d-inference-scheduler at 520af47
//! (2026-05-17): `pkg/epp/config/loader/defaults.go` and the plugins it
//! names.
//!
//! The default profile scores every candidate endpoint with three scorers,
//! each in [0, 1], sums them by weight and takes the highest (max-score
//! picker; ties broken at random, it shuffles before a stable sort):
//!
//! - `queue-scorer`, weight 2: `(max − waiting) / (max − min)` over the
//!   candidates' waiting queues (`vllm:num_requests_waiting`), 1 for every
//!   candidate when all queues are equal.
//! - `kv-cache-utilization-scorer`, weight 2: `1 − KV-cache usage`.
//! - `prefix-cache-scorer`, weight 3: the prompt's blocks found for the
//!   endpoint in the approximate prefix index ÷ the prompt's blocks (0 for a
//!   prompt with no block).
//!
//! The approximate index (`approx-prefix-cache-producer`, its defaults with
//! `autoTune`) is the router's own record of where it sent what, never the
//! engines' caches:
//!
//! - A prompt is the JSON of its chat messages (`[{"role":"user",
//!   "content":"…"}]`, Go's `json.Marshal` of them) cut into blocks of
//!   `block_size` × 4 characters (4 characters standing for a token; the
//!   engines' `block_size`, 16 for vLLM, read from `cache_config_info`):
//!   64 characters. Each block's hash chains its predecessor's, so equal
//!   hashes mean equal text up to the block's end. A trailing partial block
//!   counts as a block; a prompt shorter than one block has none; only the
//!   first 256 blocks (16384 characters) are hashed, so prompts sharing
//!   those are alike to it however they go on.
//! - Per endpoint, an LRU of block hashes holding as many entries as the
//!   engine has KV blocks (`num_gpu_blocks` from `cache_config_info`):
//!   after each pick, the prompt's hashes are added for the chosen endpoint
//!   (an entry already there becomes the newest). Lookups do not refresh
//!   entries.
//! - A prompt's match for an endpoint: walking its blocks in order until
//!   one no endpoint holds, the blocks that endpoint holds.
//! - Every 2 minutes (from its start) the index forgets the endpoints that
//!   have left the pool (not ready: here, failing health checks).
//!
//! What the simulation adds: an endpoint is a region (its replicas' waiting
//! queues summed, their KV usage averaged, their KV blocks summed). The
//! segment text is 4 bytes a token (`trace`), so the index's 4 characters
//! a token are exactly the trace's tokens; blocks are hashed from the
//! segments and character ranges they cover (what fixes their text), not
//! from the text itself. Deployed, it reads the engines' metrics every
//! 50 ms (`--refresh-metrics-interval`'s default), as of the scrape (the
//! scrape's own network delay is not modelled); as the oracle, exactly and
//! at once. Not modelled: flow control and the saturation detector (off by
//! default: the `flowControl` feature gate; without it only requests of
//! negative priority are shed).

use crate::policy::{Ask, View};
use crate::rng::Rng;
use crate::trace::{mix, BYTES_PER_TOKEN};
use engine_emulator::model::DEFAULT_BLOCK_TOKENS;
use std::collections::{BTreeMap, HashMap};

pub const W_QUEUE: f64 = 2.0;
pub const W_KV: f64 = 2.0;
pub const W_PREFIX: f64 = 3.0;
/// The index's characters per token (`averageCharactersPerToken`).
pub const CHARS_PER_TOKEN: u64 = 4;
/// Blocks hashed at most (`defaultMaxPrefixBlocks`).
pub const MAX_BLOCKS: u64 = 256;
/// How often the index forgets endpoints gone from the pool
/// (`podActiveCheckInterval`).
pub const CLEANUP_MS: f64 = 120_000.0;
/// How often a deployed EPP reads the engines' metrics.
pub const REFRESH_MS: f64 = 50.0;

/// The JSON around the one user message's text.
const HEADER: &str = r#"[{"role":"user","content":""#;
const TRAILER: &str = r#""}]"#;
/// Tags of the two fixed runs; segments are tagged by their interned id
/// (a `u32`), so these cannot collide with one.
const HEADER_TAG: u64 = u64::MAX;
const TRAILER_TAG: u64 = u64::MAX - 1;
/// The chain's start: the real one hashes the model's name first, alike
/// for every request of a trace ("llm-d" stands in for it).
const CHAIN_SEED: u64 = 0x006c_6c6d_2d64;

/// Characters per block: the engines' block size (what `autoTune` reads)
/// at 4 characters a token.
pub fn block_chars() -> u64 {
    DEFAULT_BLOCK_TOKENS as u64 * CHARS_PER_TOKEN
}

fn feed(h: u64, x: u64) -> u64 {
    mix(h ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The chained block hashes of a prompt of `segments` (interned id,
/// tokens), as the index cuts it. Two prompts get the same hash for block
/// i exactly when their JSON agrees up to that block's end.
pub fn block_hashes(segments: &[(u32, u32)]) -> Vec<u64> {
    let per_token = BYTES_PER_TOKEN as u64;
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(segments.len() + 2);
    runs.push((HEADER_TAG, HEADER.len() as u64));
    runs.extend(
        segments
            .iter()
            .map(|&(id, n)| (u64::from(id), u64::from(n) * per_token)),
    );
    runs.push((TRAILER_TAG, TRAILER.len() as u64));
    let total: u64 = runs.iter().map(|r| r.1).sum();
    let block = block_chars();
    if total < block {
        return Vec::new();
    }
    let len = total.min(block * MAX_BLOCKS);
    let mut out = Vec::with_capacity(len.div_ceil(block) as usize);
    // Which run the walk is in, and where that run starts in the text.
    let (mut run, mut run_start) = (0usize, 0u64);
    let mut prev = feed(0, CHAIN_SEED);
    let mut start = 0u64;
    while start < len {
        let end = (start + block).min(len);
        let mut h = prev;
        let mut at = start;
        while at < end {
            let Some(&(tag, run_len)) = runs.get(run) else {
                break;
            };
            let run_end = run_start + run_len;
            if run_end <= at {
                run += 1;
                run_start = run_end;
                continue;
            }
            let upto = run_end.min(end);
            h = feed(feed(feed(h, tag), at - run_start), upto - run_start);
            at = upto;
        }
        out.push(h);
        prev = h;
        start = end;
    }
    out
}

/// One endpoint's entries: most recent last.
#[derive(Debug, Clone)]
struct Lru {
    capacity: usize,
    clock: u64,
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Lru {
            capacity: capacity.max(1),
            clock: 0,
            at: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    fn add(&mut self, hash: u64) {
        self.clock += 1;
        if let Some(old) = self.at.insert(hash, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, hash);
        while self.at.len() > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.at.remove(&oldest);
        }
    }

    fn contains(&self, hash: u64) -> bool {
        self.at.contains_key(&hash)
    }
}

/// One EPP: its index and its tie-breaking draws.
#[derive(Debug, Clone)]
pub struct LlmD {
    /// Per region: its LRU, made at the first add (sized then), dropped
    /// when the region leaves the pool.
    index: Vec<Option<Lru>>,
    rng: Rng,
    next_cleanup_ms: f64,
}

impl LlmD {
    pub fn new(regions: usize, seed: u64) -> Self {
        LlmD {
            index: vec![None; regions],
            rng: Rng::new(seed),
            next_cleanup_ms: CLEANUP_MS,
        }
    }

    /// Per region: the blocks of `hashes` it holds, over the leading blocks
    /// some region holds.
    fn matched(&self, hashes: &[u64]) -> Vec<u64> {
        let mut per_region = vec![0u64; self.index.len()];
        for &h in hashes {
            let mut any = false;
            for (r, lru) in self.index.iter().enumerate() {
                if lru.as_ref().is_some_and(|l| l.contains(h)) {
                    any = true;
                    if let Some(n) = per_region.get_mut(r) {
                        *n += 1;
                    }
                }
            }
            if !any {
                break;
            }
        }
        per_region
    }

    /// The three scores of candidate `r` (queue, KV, prefix), each in [0, 1].
    fn scores(
        v: &View,
        cands: &[usize],
        matched: &[u64],
        total: usize,
        r: usize,
    ) -> (f64, f64, f64) {
        let waiting = |r: usize| v.waiting.get(r).copied().unwrap_or(0);
        let min = cands.iter().map(|&c| waiting(c)).min().unwrap_or(0);
        let max = cands.iter().map(|&c| waiting(c)).max().unwrap_or(0);
        let queue = if max == min {
            1.0
        } else {
            (max - waiting(r)) as f64 / (max - min) as f64
        };
        let kv = 1.0 - v.kv_usage.get(r).copied().unwrap_or(0.0);
        let prefix = if total == 0 {
            0.0
        } else {
            matched.get(r).copied().unwrap_or(0) as f64 / total as f64
        };
        let clamp = |x: f64| x.clamp(0.0, 1.0);
        (clamp(queue), clamp(kv), clamp(prefix))
    }

    pub fn choose(&mut self, v: &View, ask: &Ask, cands: &[usize]) -> usize {
        let hashes = block_hashes(ask.segments);
        let matched = self.matched(&hashes);
        let weighted: Vec<(usize, f64)> = cands
            .iter()
            .map(|&r| {
                let (q, kv, p) = Self::scores(v, cands, &matched, hashes.len(), r);
                (r, W_QUEUE * q + W_KV * kv + W_PREFIX * p)
            })
            .collect();
        let top = weighted
            .iter()
            .map(|w| w.1)
            .fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = weighted
            .iter()
            .filter(|w| w.1 == top)
            .map(|w| w.0)
            .collect();
        let pick = match tied.len() {
            0 => cands.first().copied().unwrap_or(0),
            1 => tied.first().copied().unwrap_or(0),
            n => tied
                .get((self.rng.next_u64() % n as u64) as usize)
                .copied()
                .unwrap_or(0),
        };
        let blocks = v.kv_blocks.get(pick).copied().unwrap_or(0);
        if let Some(slot) = self.index.get_mut(pick) {
            let lru =
                slot.get_or_insert_with(|| Lru::new(usize::try_from(blocks).unwrap_or(usize::MAX)));
            for &h in &hashes {
                lru.add(h);
            }
        }
        pick
    }

    /// The index's cleanup, at each 2-minute mark passed by `now_ms`: the
    /// regions then out of the pool (`healthy` false) are forgotten.
    pub fn tick(&mut self, now_ms: f64, healthy: &[bool]) {
        while self.next_cleanup_ms <= now_ms {
            for (r, slot) in self.index.iter_mut().enumerate() {
                if !healthy.get(r).copied().unwrap_or(false) {
                    *slot = None;
                }
            }
            self.next_cleanup_ms += CLEANUP_MS;
        }
    }

    /// Region `r`'s entries in the index (none when it has no LRU).
    #[cfg(test)]
    fn entries(&self, r: usize) -> usize {
        self.index
            .get(r)
            .and_then(Option::as_ref)
            .map_or(0, |l| l.at.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["near".into(), "far".into()]
    }

    struct State {
        names: Vec<String>,
        healthy: Vec<bool>,
        waiting: Vec<u64>,
        kv: Vec<f64>,
        blocks: Vec<u64>,
    }

    impl State {
        fn new(waiting: [u64; 2], kv: [f64; 2]) -> Self {
            State {
                names: names(),
                healthy: vec![true, true],
                waiting: waiting.to_vec(),
                kv: kv.to_vec(),
                blocks: vec![100_000, 100_000],
            }
        }

        fn view(&self) -> View<'_> {
            View {
                now_ms: 0.0,
                healthy: &self.healthy,
                outstanding: &[0, 0],
                queued_tokens: &[0, 0],
                waiting: &self.waiting,
                kv_usage: &self.kv,
                kv_blocks: &self.blocks,
                rtt_ms: &[10.0, 200.0],
                names: &self.names,
            }
        }
    }

    fn ask(segments: &[(u32, u32)]) -> Ask<'_> {
        Ask {
            session: "s",
            segments,
            prompt_tokens: segments.iter().map(|s| u64::from(s.1)).sum(),
        }
    }

    #[test]
    fn blocks_are_64_characters_of_the_messages_json_at_most_256() {
        // 27 characters of JSON, 4 a token, 3 of trailer.
        assert_eq!(block_chars(), 64);
        // 8 tokens: 27 + 32 + 3 = 62 characters, short of one block.
        assert!(block_hashes(&[(1, 8)]).is_empty());
        // 9 tokens: 66 characters, one whole block and a partial one.
        assert_eq!(block_hashes(&[(1, 9)]).len(), 2);
        // A shared leading segment gives the same leading hashes; the block
        // where they part, and every later one, differ.
        let a = block_hashes(&[(1, 100), (2, 50)]);
        let b = block_hashes(&[(1, 100), (3, 50)]);
        // Text 0..400 shared: blocks ending by 27 + 400 = 427, i.e. 0..=5.
        assert_eq!(a[..6], b[..6]);
        assert!(a[6..].iter().zip(&b[6..]).all(|(x, y)| x != y));
        // The same text cut into other segments is other text (another
        // segment's tokens), so the hashes differ from where it is cut.
        let c = block_hashes(&[(1, 50), (1, 50), (2, 50)]);
        assert_eq!(a[..3], c[..3]);
        assert_ne!(a[3], c[3]);
        // A prompt that ends where another goes on: its last block holds
        // the JSON's end, the other's holds more text.
        let short = block_hashes(&[(1, 100)]);
        assert_eq!(short[..6], a[..6]);
        assert_ne!(short[6], a[6]);
        // Only 256 blocks (16384 characters, about 4090 tokens) are read:
        // two long prompts that part later are the same prompt to it.
        let long_a = block_hashes(&[(1, 5000), (2, 10)]);
        let long_b = block_hashes(&[(1, 5000), (3, 10)]);
        assert_eq!(long_a.len(), 256);
        assert_eq!(long_a, long_b);
    }

    #[test]
    fn the_higher_prefix_hit_wins_unless_queue_and_kv_outweigh_it() {
        let mut p = LlmD::new(2, 7);
        let doc = [(1, 2000), (2, 20)];
        // Seed the index: far is idle, near busy and full: far.
        let s = State::new([5, 0], [0.9, 0.0]);
        assert_eq!(p.choose(&s.view(), &ask(&doc), &[0, 1]), 1);
        // The same document, a new turn: far holds 125 of its 127 blocks.
        // Far's queue is the longest and near's empty (queue 0 against 1:
        // 2 points), KV alike: the prefix (3 × 125/127 = 2.95) wins.
        let s = State::new([0, 40], [0.5, 0.5]);
        let turn = [(1, 2000), (3, 20)];
        assert_eq!(p.choose(&s.view(), &ask(&turn), &[0, 1]), 1);
        // Far's cache also full (KV 0.95 against 0.05): near's queue and
        // KV (2 + 1.9) outweigh far's KV and hit (0.1 + 2.95).
        let s = State::new([0, 40], [0.05, 0.95]);
        let turn = [(1, 2000), (4, 20)];
        assert_eq!(p.choose(&s.view(), &ask(&turn), &[0, 1]), 0);
        // Queues within the min-max range count in proportion: far 10,
        // near 0 and another at 5 give 0 / 1 / 0.5.
        let v = State::new([0, 10], [0.0, 0.0]);
        let view = View {
            waiting: &[0, 10, 5],
            ..v.view()
        };
        let q = |r| LlmD::scores(&view, &[0, 1, 2], &[0, 0, 0], 0, r).0;
        assert_eq!((q(0), q(1), q(2)), (1.0, 0.0, 0.5));
        // Equal queues: 1 for all, not 0.
        let s = State::new([3, 3], [0.0, 0.0]);
        assert_eq!(LlmD::scores(&s.view(), &[0, 1], &[0, 0], 0, 1).0, 1.0);
    }

    #[test]
    fn ties_are_broken_at_random_whatever_the_distance() {
        // A cold prompt on idle regions: every score equal. llm-d knows no
        // round trips: far is picked as often as near.
        let s = State::new([0, 0], [0.0, 0.0]);
        let mut picks = [0u32; 2];
        for k in 0..400u32 {
            let mut p = LlmD::new(2, u64::from(k));
            picks[p.choose(&s.view(), &ask(&[(k, 100)]), &[0, 1])] += 1;
        }
        assert!(picks.iter().all(|&n| (150..250).contains(&n)), "{picks:?}");
    }

    #[test]
    fn the_index_holds_as_many_blocks_as_the_engine_and_forgets_lost_regions() {
        let mut p = LlmD::new(2, 1);
        let mut s = State::new([0, 5], [0.0, 0.0]);
        s.blocks = vec![10, 10];
        // 20 blocks into a 10-entry LRU: the first 10 are gone, so the
        // prompt no longer matches (its first block is missing).
        let doc = [(1, 300)];
        assert_eq!(block_hashes(&doc).len(), 20);
        assert_eq!(p.choose(&s.view(), &ask(&doc), &[0, 1]), 0);
        assert_eq!(p.entries(0), 10);
        assert_eq!(p.matched(&block_hashes(&doc)), [0, 0]);
        // A short prompt is held whole.
        let short = [(2, 100)];
        p.choose(&s.view(), &ask(&short), &[0, 1]);
        assert_eq!(p.matched(&block_hashes(&short)), [7, 0]);
        // Near out of the pool at the 2-minute mark: forgotten; not before.
        p.tick(119_000.0, &[false, true]);
        assert_eq!(p.entries(0), 10);
        p.tick(120_000.0, &[false, true]);
        assert_eq!(p.entries(0), 0);
        assert_eq!(p.matched(&block_hashes(&short)), [0, 0]);
    }
}
