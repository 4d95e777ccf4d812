//! The engine model: tokenization, prefix cache, timing and scheduler of one
//! replica. Pure on purpose: no I/O, no threads, no clocks. Time comes in as
//! explicit f64 milliseconds so the live server (real clock) and a
//! discrete-event simulator (virtual clock) drive the very same model.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The emulator has no tokenizer; 4 bytes of canonical prompt text is the
/// usual rule of thumb for English BPE vocabularies.
pub const BYTES_PER_TOKEN: usize = 4;

/// vLLM's default KV block size; only full blocks are shareable.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;

/// Prompt length in tokens: ceil(bytes / 4), and at least 1 because an engine
/// always runs at least one token through the model.
pub fn prompt_tokens(len_bytes: usize) -> usize {
    len_bytes.div_ceil(BYTES_PER_TOKEN).max(1)
}

/// Chain hashes of the full blocks of `text`. h_i = xxh3(h_{i-1} LE ++ block),
/// h_{-1} = 0, so a block hash identifies the whole prefix up to it: two
/// prompts share h_i exactly when they share their first i+1 blocks. The
/// trailing partial block is not hashed (vLLM caches full blocks only).
pub fn block_hashes(text: &[u8], block_tokens: usize) -> Vec<u64> {
    let block_bytes = block_tokens.max(1).saturating_mul(BYTES_PER_TOKEN);
    let mut out = Vec::with_capacity(text.len() / block_bytes);
    let mut buf = Vec::with_capacity(8 + block_bytes);
    let mut prev = 0u64;
    for block in text.chunks_exact(block_bytes) {
        buf.clear();
        buf.extend_from_slice(&prev.to_le_bytes());
        buf.extend_from_slice(block);
        prev = xxh3_64_with_seed(&buf, 0);
        out.push(prev);
    }
    out
}

/// A tokenized prompt as the engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: usize,
    pub blocks: Vec<u64>,
}

impl Prompt {
    pub fn from_text(text: &[u8], block_tokens: usize) -> Self {
        Prompt {
            tokens: prompt_tokens(text.len()),
            blocks: block_hashes(text, block_tokens),
        }
    }
}

/// Recency key of a cached block: time first, then a sequence number so that
/// blocks touched at the same instant still have a strict order.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    ms: f64,
    seq: u64,
}

impl PartialEq for Stamp {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Stamp {}
impl PartialOrd for Stamp {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Stamp {
    fn cmp(&self, other: &Self) -> Ordering {
        self.ms.total_cmp(&other.ms).then(self.seq.cmp(&other.seq))
    }
}

/// Block-level LRU prefix cache with a capacity in tokens, plus the
/// query/hit token counters vLLM v1 exports.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_tokens: usize,
    capacity_blocks: usize,
    blocks: HashMap<u64, Stamp>,
    lru: BTreeMap<Stamp, u64>,
    next_seq: u64,
    query_tokens: u64,
    hit_tokens: u64,
}

impl PrefixCache {
    /// `capacity_tokens` is rounded down to whole blocks; 0 disables caching.
    pub fn new(capacity_tokens: usize, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        PrefixCache {
            block_tokens,
            capacity_blocks: capacity_tokens / block_tokens,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            next_seq: 0,
            query_tokens: 0,
            hit_tokens: 0,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn capacity_tokens(&self) -> usize {
        self.capacity_blocks.saturating_mul(self.block_tokens)
    }

    pub fn used_tokens(&self) -> usize {
        self.blocks.len().saturating_mul(self.block_tokens)
    }

    /// Fraction of capacity holding cached blocks, 0..1.
    pub fn usage(&self) -> f64 {
        if self.capacity_blocks == 0 {
            0.0
        } else {
            self.blocks.len() as f64 / self.capacity_blocks as f64
        }
    }

    pub fn contains(&self, block: u64) -> bool {
        self.blocks.contains_key(&block)
    }

    /// Number of leading blocks present. Stops at the first miss: a block is
    /// only usable if its whole prefix is usable.
    pub fn lookup(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Refreshes the recency of the blocks already present; inserts nothing.
    pub fn touch(&mut self, blocks: &[u64], now_ms: f64) {
        self.stamp_all(blocks, now_ms, false);
    }

    /// Inserts (or refreshes) all blocks, then evicts least-recently-used
    /// blocks beyond capacity.
    pub fn insert(&mut self, blocks: &[u64], now_ms: f64) {
        self.stamp_all(blocks, now_ms, true);
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&victim);
        }
    }

    /// Walks the chain tail-first so the deepest block gets the oldest stamp:
    /// like vLLM's free queue, a request's tail is evicted before its head,
    /// which keeps what remains a usable prefix.
    fn stamp_all(&mut self, blocks: &[u64], now_ms: f64, insert: bool) {
        for &h in blocks.iter().rev() {
            let stamp = Stamp {
                ms: now_ms,
                seq: self.next_seq,
            };
            match self.blocks.get_mut(&h) {
                Some(old) => {
                    self.lru.remove(old);
                    *old = stamp;
                }
                None if insert => {
                    self.blocks.insert(h, stamp);
                }
                None => continue,
            }
            self.lru.insert(stamp, h);
            self.next_seq = self.next_seq.wrapping_add(1);
        }
    }

    /// Accounts one lookup the way vLLM v1 does: queries count every prompt
    /// token, hits count the tokens served from cache.
    pub fn record_query(&mut self, query_tokens: usize, hit_tokens: usize) {
        self.query_tokens = self.query_tokens.saturating_add(query_tokens as u64);
        self.hit_tokens = self.hit_tokens.saturating_add(hit_tokens as u64);
    }

    pub fn query_tokens(&self) -> u64 {
        self.query_tokens
    }

    pub fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// Cumulative hit tokens / query tokens, 0..1 (SGLang's cache_hit_rate).
    pub fn hit_rate(&self) -> f64 {
        if self.query_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.query_tokens as f64
        }
    }

    /// Drops every block and zeroes the counters.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        self.query_tokens = 0;
        self.hit_tokens = 0;
    }
}

/// Linear cost model: prefill is compute-bound per uncached prompt token,
/// decode is memory-bound per output token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
}

impl Timing {
    pub fn prefill_ms(&self, uncached_tokens: usize) -> f64 {
        uncached_tokens as f64 * self.prefill_ms_per_token
    }

    pub fn decode_ms(&self, output_tokens: usize) -> f64 {
        output_tokens as f64 * self.decode_ms_per_token
    }
}

pub type RequestId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Started,
    Queued,
}

/// `max_concurrency` slots and a FIFO waiting queue. Strict FIFO: a newcomer
/// never overtakes a waiting request, even when a slot is free.
#[derive(Debug, Clone)]
pub struct Scheduler {
    max_concurrency: usize,
    running: HashSet<RequestId>,
    waiting: VecDeque<RequestId>,
    paused: bool,
}

impl Scheduler {
    pub fn new(max_concurrency: usize) -> Self {
        Scheduler {
            max_concurrency: max_concurrency.max(1),
            running: HashSet::new(),
            waiting: VecDeque::new(),
            paused: false,
        }
    }

    pub fn arrive(&mut self, id: RequestId) -> Admission {
        if self.waiting.is_empty() && self.has_free_slot() {
            self.running.insert(id);
            Admission::Started
        } else {
            self.waiting.push_back(id);
            Admission::Queued
        }
    }

    /// Removes `id`, whether running (done, or client gone) or still waiting
    /// (client gave up). Returns the request that took the freed slot.
    pub fn finish(&mut self, id: RequestId) -> Option<RequestId> {
        if self.running.remove(&id) {
            self.start_next()
        } else {
            self.waiting.retain(|&w| w != id);
            None
        }
    }

    /// While paused nothing is admitted; unpausing fills the free slots and
    /// returns the requests started, in FIFO order.
    pub fn set_paused(&mut self, paused: bool) -> Vec<RequestId> {
        self.paused = paused;
        let mut started = Vec::new();
        while let Some(id) = self.start_next() {
            started.push(id);
        }
        started
    }

    fn has_free_slot(&self) -> bool {
        !self.paused && self.running.len() < self.max_concurrency
    }

    fn start_next(&mut self) -> Option<RequestId> {
        if !self.has_free_slot() {
            return None;
        }
        let id = self.waiting.pop_front()?;
        self.running.insert(id);
        Some(id)
    }

    pub fn is_running(&self, id: RequestId) -> bool {
        self.running.contains(&id)
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    pub fn max_concurrency(&self) -> usize {
        self.max_concurrency
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    pub max_concurrency: usize,
    pub cache_tokens: usize,
    pub block_tokens: usize,
    pub timing: Timing,
}

/// What admission decided for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillPlan {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub uncached_tokens: usize,
    pub prefill_ms: f64,
}

/// One replica: cache + scheduler + timing + the success counter.
#[derive(Debug, Clone)]
pub struct Engine {
    pub cache: PrefixCache,
    pub scheduler: Scheduler,
    pub timing: Timing,
    completed: u64,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        Engine {
            cache: PrefixCache::new(config.cache_tokens, config.block_tokens),
            scheduler: Scheduler::new(config.max_concurrency),
            timing: config.timing,
            completed: 0,
        }
    }

    /// Call when the request gets its slot: matches the prefix cache, counts
    /// the query, inserts the prompt's blocks and prices the prefill.
    /// Like vLLM, at most `prompt_tokens - 1` tokens can hit, because the
    /// last prompt token must be computed to produce logits.
    pub fn admit(&mut self, prompt: &Prompt, now_ms: f64) -> PrefillPlan {
        let block_tokens = self.cache.block_tokens();
        let max_hit_blocks = prompt.tokens.saturating_sub(1) / block_tokens;
        let hit_blocks = self.cache.lookup(&prompt.blocks).min(max_hit_blocks);
        let cached_tokens = hit_blocks.saturating_mul(block_tokens);
        let uncached_tokens = prompt.tokens.saturating_sub(cached_tokens);
        self.cache.record_query(prompt.tokens, cached_tokens);
        self.cache.insert(&prompt.blocks, now_ms);
        PrefillPlan {
            prompt_tokens: prompt.tokens,
            cached_tokens,
            uncached_tokens,
            prefill_ms: self.timing.prefill_ms(uncached_tokens),
        }
    }

    /// Counts a request whose response was completely delivered.
    pub fn record_success(&mut self) {
        self.completed = self.completed.saturating_add(1);
    }

    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// Clears cache and counters; running/waiting requests are untouched.
    pub fn reset(&mut self) {
        self.cache.clear();
        self.completed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| b'a' + ((i as u8).wrapping_add(seed)) % 26)
            .collect()
    }

    #[test]
    fn tokens_round_up_and_never_zero() {
        assert_eq!(prompt_tokens(0), 1);
        assert_eq!(prompt_tokens(1), 1);
        assert_eq!(prompt_tokens(4), 1);
        assert_eq!(prompt_tokens(5), 2);
        assert_eq!(prompt_tokens(64), 16);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert!(block_hashes(&text(63, 0), 16).is_empty());
        assert_eq!(block_hashes(&text(64, 0), 16).len(), 1);
        assert_eq!(block_hashes(&text(200, 0), 16).len(), 3);
        assert_eq!(block_hashes(&text(200, 0), 8).len(), 6);
    }

    #[test]
    fn chain_hash_matches_definition() {
        let t = text(128, 3);
        let h = block_hashes(&t, 16);
        let mut first = 0u64.to_le_bytes().to_vec();
        first.extend_from_slice(&t[..64]);
        let h0 = xxh3_64_with_seed(&first, 0);
        let mut second = h0.to_le_bytes().to_vec();
        second.extend_from_slice(&t[64..]);
        assert_eq!(h, vec![h0, xxh3_64_with_seed(&second, 0)]);
    }

    #[test]
    fn chain_hash_has_prefix_property() {
        let a = text(64 * 4, 0);
        let mut b = a.clone();
        b[64 * 2 + 5] ^= 1; // differs inside block 2
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Block 3 has identical bytes but a different prefix.
        assert_ne!(ha[3], hb[3]);
        // Same block content at another position hashes differently.
        let rep = [b'x'; 128];
        let hr = block_hashes(&rep, 16);
        assert_ne!(hr[0], hr[1]);
    }

    #[test]
    fn lookup_counts_leading_blocks_only() {
        let mut c = PrefixCache::new(1000, 16);
        c.insert(&[1, 2, 3], 0.0);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), 3);
        assert_eq!(c.lookup(&[1, 9, 3]), 1);
        assert_eq!(c.lookup(&[9, 1, 2]), 0);
        assert_eq!(c.lookup(&[]), 0);
    }

    #[test]
    fn capacity_is_in_tokens_rounded_to_blocks() {
        let c = PrefixCache::new(100, 16);
        assert_eq!(c.capacity_tokens(), 96);
        let mut c = PrefixCache::new(48, 16);
        c.insert(&[1, 2, 3, 4, 5], 0.0);
        assert_eq!(c.used_tokens(), 48);
        assert!((c.usage() - 1.0).abs() < 1e-12);
        let mut off = PrefixCache::new(0, 16);
        off.insert(&[1], 0.0);
        assert_eq!(off.lookup(&[1]), 0);
        assert_eq!(off.usage(), 0.0);
    }

    #[test]
    fn lru_evicts_oldest_and_tail_first() {
        let mut c = PrefixCache::new(4 * 16, 16);
        c.insert(&[1, 2], 0.0);
        c.insert(&[10, 11], 1.0);
        // Touching the first chain makes the second one the LRU.
        c.touch(&[1, 2], 2.0);
        c.insert(&[20], 3.0);
        assert!(!c.contains(11), "tail of the LRU chain goes first");
        assert!(c.contains(10));
        c.insert(&[21], 4.0);
        assert!(!c.contains(10));
        assert_eq!(c.lookup(&[1, 2]), 2);
        // A chain longer than the cache keeps its head, not its tail.
        c.insert(&[30, 31, 32, 33, 34, 35], 5.0);
        assert_eq!(c.lookup(&[30, 31, 32, 33, 34, 35]), 4);
        assert!(!c.contains(1));
    }

    #[test]
    fn touch_does_not_insert() {
        let mut c = PrefixCache::new(160, 16);
        c.touch(&[1, 2], 0.0);
        assert_eq!(c.used_tokens(), 0);
    }

    #[test]
    fn counters_accumulate_and_clear() {
        let mut c = PrefixCache::new(160, 16);
        c.record_query(100, 0);
        c.record_query(100, 64);
        assert_eq!((c.query_tokens(), c.hit_tokens()), (200, 64));
        assert!((c.hit_rate() - 0.32).abs() < 1e-12);
        c.insert(&[1], 0.0);
        c.clear();
        assert_eq!(
            (c.query_tokens(), c.hit_tokens(), c.used_tokens()),
            (0, 0, 0)
        );
    }

    #[test]
    fn timing_is_linear() {
        let t = Timing {
            prefill_ms_per_token: 0.5,
            decode_ms_per_token: 2.0,
        };
        assert_eq!(t.prefill_ms(10), 5.0);
        assert_eq!(t.decode_ms(3), 6.0);
    }

    #[test]
    fn scheduler_is_fifo() {
        let mut s = Scheduler::new(2);
        assert_eq!(s.arrive(1), Admission::Started);
        assert_eq!(s.arrive(2), Admission::Started);
        assert_eq!(s.arrive(3), Admission::Queued);
        assert_eq!(s.arrive(4), Admission::Queued);
        assert_eq!((s.running(), s.waiting()), (2, 2));
        assert_eq!(s.finish(2), Some(3));
        assert!(s.is_running(3));
        // A waiting request that leaves frees no slot.
        assert_eq!(s.finish(4), None);
        assert_eq!(s.finish(1), None);
        assert_eq!((s.running(), s.waiting()), (1, 0));
        assert_eq!(s.finish(99), None);
    }

    #[test]
    fn newcomer_never_overtakes_waiter() {
        let mut s = Scheduler::new(1);
        s.set_paused(true);
        assert_eq!(s.arrive(1), Admission::Queued);
        assert_eq!(s.arrive(2), Admission::Queued);
        assert_eq!(s.set_paused(false), vec![1]);
        assert_eq!(s.arrive(3), Admission::Queued);
        assert_eq!(s.finish(1), Some(2));
        assert_eq!(s.finish(2), Some(3));
    }

    #[test]
    fn unpause_fills_all_free_slots() {
        let mut s = Scheduler::new(3);
        s.set_paused(true);
        for id in 1..=5 {
            assert_eq!(s.arrive(id), Admission::Queued);
        }
        assert!(s.is_paused());
        assert_eq!(s.finish(9), None);
        assert_eq!(s.set_paused(false), vec![1, 2, 3]);
        assert_eq!((s.running(), s.waiting()), (3, 2));
    }

    #[test]
    fn engine_admission_uses_and_fills_cache() {
        let mut e = Engine::new(EngineConfig {
            max_concurrency: 4,
            cache_tokens: 10_000,
            block_tokens: 16,
            timing: Timing {
                prefill_ms_per_token: 0.1,
                decode_ms_per_token: 1.0,
            },
        });
        let p = Prompt::from_text(&text(1000, 1), 16); // 250 tokens, 15 blocks
        assert_eq!((p.tokens, p.blocks.len()), (250, 15));
        let first = e.admit(&p, 0.0);
        assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 250));
        assert!((first.prefill_ms - 25.0).abs() < 1e-9);
        let second = e.admit(&p, 1.0);
        assert_eq!((second.cached_tokens, second.uncached_tokens), (240, 10));
        assert_eq!((e.cache.query_tokens(), e.cache.hit_tokens()), (500, 240));
        e.record_success();
        assert_eq!(e.completed(), 1);
        e.reset();
        assert_eq!((e.completed(), e.cache.query_tokens()), (0, 0));
    }

    #[test]
    fn block_aligned_prompt_recomputes_last_block() {
        let mut e = Engine::new(EngineConfig {
            max_concurrency: 1,
            cache_tokens: 10_000,
            block_tokens: 16,
            timing: Timing {
                prefill_ms_per_token: 0.0,
                decode_ms_per_token: 0.0,
            },
        });
        let p = Prompt::from_text(&text(128, 0), 16); // exactly 2 blocks
        e.admit(&p, 0.0);
        let again = e.admit(&p, 1.0);
        assert_eq!((again.cached_tokens, again.uncached_tokens), (16, 16));
    }
}
