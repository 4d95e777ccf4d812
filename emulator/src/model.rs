//! The engine model: tokenization, prefix cache, timing and scheduler of one
//! replica. Pure on purpose: no I/O, no threads, no clocks. Time comes in as
//! explicit f64 milliseconds so the live server (real clock) and a
//! discrete-event simulator (virtual clock) drive the very same model.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// vLLM's default KV block size; only full blocks are shareable.
pub const DEFAULT_BLOCK_TOKENS: usize = 16;
/// SGLang's radix cache matches at token granularity (page size 1): a chain
/// of one-token blocks is exactly a radix tree's path.
pub const RADIX_BLOCK_TOKENS: usize = 1;

/// Chain hashes of the full blocks of `tokens`, as vLLM's prefix cache keys
/// them: h_i = xxh3(h_{i-1} LE ++ the block's token ids LE), h_{-1} = 0, so
/// a block hash identifies the whole prefix up to it: two prompts share h_i
/// exactly when they share their first i+1 blocks of token ids. The trailing
/// partial block is not hashed (vLLM caches full blocks only).
pub fn block_hashes(tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    chain_hashes(tokens, block_tokens, 0)
}

/// [`block_hashes`] with the chain started from `salt`'s hash instead of 0:
/// vLLM puts a request's `cache_salt` into its first block's key, so no
/// block of a salted prompt is shared with a prompt salted otherwise (or
/// not at all).
pub fn salted_block_hashes(tokens: &[u32], block_tokens: usize, salt: &str) -> Vec<u64> {
    chain_hashes(
        tokens,
        block_tokens,
        xxh3_64_with_seed(salt.as_bytes(), SALT_SEED),
    )
}

/// Seed of a salt's hash, so that no salt hashes to the unsalted chain's 0.
const SALT_SEED: u64 = 0x5a17_5a17;

fn chain_hashes(tokens: &[u32], block_tokens: usize, start: u64) -> Vec<u64> {
    let block_tokens = block_tokens.max(1);
    let mut out = Vec::with_capacity(tokens.len() / block_tokens);
    let mut buf = Vec::with_capacity(8 + 4 * block_tokens);
    let mut prev = start;
    for block in tokens.chunks_exact(block_tokens) {
        buf.clear();
        buf.extend_from_slice(&prev.to_le_bytes());
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
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
    /// At least 1 token: an engine always runs one token through the model.
    pub fn from_tokens(ids: &[u32], block_tokens: usize) -> Self {
        Prompt {
            tokens: ids.len().max(1),
            blocks: block_hashes(ids, block_tokens),
        }
    }

    /// A prompt whose request names a `cache_salt` (see
    /// [`salted_block_hashes`]); `None` is [`Prompt::from_tokens`].
    pub fn salted(ids: &[u32], block_tokens: usize, salt: Option<&str>) -> Self {
        match salt {
            Some(salt) => Prompt {
                tokens: ids.len().max(1),
                blocks: salted_block_hashes(ids, block_tokens, salt),
            },
            None => Prompt::from_tokens(ids, block_tokens),
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

/// A cached block: how many running requests hold it, and while nobody
/// does, its place in the eviction order.
#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    free_since: Option<Stamp>,
}

/// Block-level prefix cache as vLLM v1 keeps it (and, with one-token blocks,
/// SGLang's radix cache): a block held by a running request is referenced
/// and never evicted; when the last holder finishes it joins the free queue,
/// tail first, and stays reusable until the capacity is needed, least
/// recently freed first. Capacity is in tokens; blocks that running requests
/// hold may exceed it for a while (vLLM would preempt; the emulator's slot
/// limit stands in for that). Also keeps the query/hit token counters vLLM
/// v1 exports.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block_tokens: usize,
    capacity_blocks: usize,
    blocks: HashMap<u64, Entry>,
    /// Unreferenced blocks in eviction order.
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

    /// Tokens in cached blocks, referenced or not.
    pub fn used_tokens(&self) -> usize {
        self.blocks.len().saturating_mul(self.block_tokens)
    }

    /// Fraction of capacity held by running requests, 0..1: what vLLM
    /// exports as `kv_cache_usage_perc` and SGLang as `token_usage` (cached
    /// blocks nobody holds count as free, because they can be reclaimed).
    pub fn usage(&self) -> f64 {
        if self.capacity_blocks == 0 {
            0.0
        } else {
            let held = self.blocks.len().saturating_sub(self.lru.len());
            (held as f64 / self.capacity_blocks as f64).min(1.0)
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

    /// A request starts: takes a reference on each of its blocks (inserting
    /// the missing ones), then evicts free blocks beyond capacity.
    pub fn acquire(&mut self, blocks: &[u64]) {
        if self.capacity_blocks == 0 {
            return;
        }
        for &h in blocks {
            let entry = self.blocks.entry(h).or_insert(Entry {
                refs: 0,
                free_since: None,
            });
            if let Some(stamp) = entry.free_since.take() {
                self.lru.remove(&stamp);
            }
            entry.refs = entry.refs.saturating_add(1);
        }
        self.evict();
    }

    /// A request ends: drops its references. Walks the chain tail first so
    /// the deepest block is freed first and evicted first, like vLLM's free
    /// queue, which keeps what remains a usable prefix.
    pub fn release(&mut self, blocks: &[u64], now_ms: f64) {
        for &h in blocks.iter().rev() {
            let Some(entry) = self.blocks.get_mut(&h) else {
                continue;
            };
            entry.refs = entry.refs.saturating_sub(1);
            if entry.refs == 0 && entry.free_since.is_none() {
                let stamp = Stamp {
                    ms: now_ms,
                    seq: self.next_seq,
                };
                self.next_seq = self.next_seq.wrapping_add(1);
                entry.free_since = Some(stamp);
                self.lru.insert(stamp, h);
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.blocks.len() > self.capacity_blocks {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&victim);
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

/// Per-request cost a real engine pays before the first token whatever the
/// prompt (scheduling, the first forward pass, detokenizing, HTTP): vLLM
/// 0.32 on CPU measured 9-14 ms for a 10-token prompt, then about 17 us a
/// token (docs/ARCHITECTURE.md, the emulator's row).
pub const DEFAULT_PREFILL_OVERHEAD_MS: f64 = 10.0;

/// Linear cost model: a fixed overhead per request, then prefill is
/// compute-bound per uncached prompt token, decode is memory-bound per
/// output token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    /// Added once to every request's prefill, cached or not.
    pub prefill_overhead_ms: f64,
}

impl Timing {
    pub fn prefill_ms(&self, uncached_tokens: usize) -> f64 {
        self.prefill_overhead_ms + uncached_tokens as f64 * self.prefill_ms_per_token
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
    /// Tokens of the prompt's full blocks the cache holds once the prompt
    /// is prefilled, less the hit (vLLM 0.32's `created_cache_tokens`: a
    /// block-aligned prompt's last block is recomputed, and counted).
    pub created_tokens: usize,
    pub prefill_ms: f64,
}

/// One replica: cache + scheduler + timing + the success counter.
#[derive(Debug, Clone)]
pub struct Engine {
    pub cache: PrefixCache,
    pub scheduler: Scheduler,
    pub timing: Timing,
    /// Blocks each running request holds, released when it ends.
    held: HashMap<RequestId, Vec<u64>>,
    completed: u64,
    /// Output tokens of the completed requests (`generation_tokens_total`).
    generated: u64,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        Engine {
            cache: PrefixCache::new(config.cache_tokens, config.block_tokens),
            scheduler: Scheduler::new(config.max_concurrency),
            timing: config.timing,
            held: HashMap::new(),
            completed: 0,
            generated: 0,
        }
    }

    /// Call when request `id` gets its slot: matches the prefix cache,
    /// counts the query, takes the prompt's blocks and prices the prefill.
    /// Like vLLM (and SGLang), at most `prompt_tokens - 1` tokens can hit,
    /// because the last prompt token must be computed to produce logits.
    pub fn admit(&mut self, id: RequestId, prompt: &Prompt) -> PrefillPlan {
        let block_tokens = self.cache.block_tokens();
        let max_hit_blocks = prompt.tokens.saturating_sub(1) / block_tokens;
        let hit_blocks = self.cache.lookup(&prompt.blocks).min(max_hit_blocks);
        let cached_tokens = hit_blocks.saturating_mul(block_tokens);
        let uncached_tokens = prompt.tokens.saturating_sub(cached_tokens);
        // vLLM's `finalize`: what the cache holds of the prompt once it is
        // prefilled (its full blocks) less what it held before (the hit).
        let created_tokens = if self.cache.capacity_tokens() == 0 {
            0
        } else {
            prompt
                .blocks
                .len()
                .saturating_mul(block_tokens)
                .min(prompt.tokens)
                .saturating_sub(cached_tokens)
        };
        self.cache.record_query(prompt.tokens, cached_tokens);
        self.cache.acquire(&prompt.blocks);
        if let Some(old) = self.held.insert(id, prompt.blocks.clone()) {
            // An id admitted twice: the first admission's hold ends here.
            self.cache.release(&old, 0.0);
        }
        PrefillPlan {
            prompt_tokens: prompt.tokens,
            cached_tokens,
            uncached_tokens,
            created_tokens,
            prefill_ms: self.timing.prefill_ms(uncached_tokens),
        }
    }

    /// Call when a request that bypasses the prefix cache gets its slot (a
    /// pooling request such as an embedding: the emulator keeps its cache
    /// for generation, as vLLM does not cache pooling prompts by default):
    /// nothing is looked up, counted or held; the whole prompt is prefilled.
    pub fn admit_uncached(&mut self, prompt_tokens: usize) -> PrefillPlan {
        let tokens = prompt_tokens.max(1);
        PrefillPlan {
            prompt_tokens: tokens,
            cached_tokens: 0,
            uncached_tokens: tokens,
            created_tokens: 0,
            prefill_ms: self.timing.prefill_ms(tokens),
        }
    }

    /// Request `id` ends (done, failed, or its client left), running or
    /// still waiting: its blocks become evictable and its slot is freed.
    /// Returns the request that took the slot.
    pub fn finish(&mut self, id: RequestId, now_ms: f64) -> Option<RequestId> {
        if let Some(blocks) = self.held.remove(&id) {
            self.cache.release(&blocks, now_ms);
        }
        self.scheduler.finish(id)
    }

    /// Request `id` ends having generated its answer; `sequence` is its
    /// prompt and answer as one token sequence. The sequence's full blocks
    /// stay cached, as real engines keep them: vLLM v1 caches a request's
    /// blocks as they fill, generated tokens included, and SGLang's radix
    /// cache inserts prompt and output when a request finishes. So a
    /// conversation's next turn, whose prompt repeats the answer, finds it
    /// where it was generated. Returns the request that took the slot.
    pub fn finish_generated(
        &mut self,
        id: RequestId,
        now_ms: f64,
        sequence: &Prompt,
    ) -> Option<RequestId> {
        self.cache.acquire(&sequence.blocks);
        let next = self.finish(id, now_ms);
        self.cache.release(&sequence.blocks, now_ms);
        next
    }

    /// Counts a request whose response was completely delivered, with the
    /// output tokens it generated.
    pub fn record_success(&mut self, generated_tokens: usize) {
        self.completed = self.completed.saturating_add(1);
        self.generated = self.generated.saturating_add(generated_tokens as u64);
    }

    pub fn completed(&self) -> u64 {
        self.completed
    }

    pub fn generated(&self) -> u64 {
        self.generated
    }

    /// Clears cache and counters; running/waiting requests are untouched
    /// (their blocks are simply no longer cached).
    pub fn reset(&mut self) {
        self.cache.clear();
        self.completed = 0;
        self.generated = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32)
            .map(|i| i.wrapping_mul(7).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert!(block_hashes(&ids(15, 0), 16).is_empty());
        assert_eq!(block_hashes(&ids(16, 0), 16).len(), 1);
        assert_eq!(block_hashes(&ids(50, 0), 16).len(), 3);
        assert_eq!(block_hashes(&ids(50, 0), 1).len(), 50);
        assert_eq!(Prompt::from_tokens(&[], 16).tokens, 1);
    }

    #[test]
    fn chain_hash_matches_definition() {
        let t = ids(32, 3);
        let h = block_hashes(&t, 16);
        let bytes = |prev: u64, block: &[u32]| {
            let mut b = prev.to_le_bytes().to_vec();
            for x in block {
                b.extend_from_slice(&x.to_le_bytes());
            }
            b
        };
        let h0 = xxh3_64_with_seed(&bytes(0, &t[..16]), 0);
        let h1 = xxh3_64_with_seed(&bytes(h0, &t[16..]), 0);
        assert_eq!(h, vec![h0, h1]);
    }

    #[test]
    fn chain_hash_has_prefix_property() {
        let a = ids(64, 0);
        let mut b = a.clone();
        b[16 * 2 + 5] ^= 1; // differs inside block 2
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Block 3 has identical ids but a different prefix.
        assert_ne!(ha[3], hb[3]);
        // Same block content at another position hashes differently.
        let hr = block_hashes(&[9; 32], 16);
        assert_ne!(hr[0], hr[1]);
    }

    #[test]
    fn an_answer_stays_cached_after_its_request() {
        let config = EngineConfig {
            cache_tokens: 4096,
            block_tokens: 16,
            max_concurrency: 2,
            timing: Timing {
                prefill_ms_per_token: 1.0,
                decode_ms_per_token: 1.0,
                prefill_overhead_ms: 0.0,
            },
        };
        let mut e = Engine::new(config);
        let prompt = ids(100, 1);
        let mut sequence = prompt.clone();
        sequence.extend(ids(60, 9)); // the answer
        let mut next_turn = sequence.clone();
        next_turn.extend(ids(40, 5));
        e.scheduler.arrive(1);
        e.admit(1, &Prompt::from_tokens(&prompt, 16));
        e.finish_generated(1, 10.0, &Prompt::from_tokens(&sequence, 16));
        // The next turn hits prompt and answer: 160 tokens, 10 full blocks.
        e.scheduler.arrive(2);
        let plan = e.admit(2, &Prompt::from_tokens(&next_turn, 16));
        assert_eq!(plan.cached_tokens, 160);
        // Finished without its answer, only the prompt's blocks stay.
        let mut e = Engine::new(config);
        e.scheduler.arrive(1);
        e.admit(1, &Prompt::from_tokens(&prompt, 16));
        e.finish(1, 10.0);
        e.scheduler.arrive(2);
        assert_eq!(
            e.admit(2, &Prompt::from_tokens(&next_turn, 16))
                .cached_tokens,
            96
        );
    }

    #[test]
    fn lookup_counts_leading_blocks_only() {
        let mut c = PrefixCache::new(1000, 16);
        c.acquire(&[1, 2, 3]);
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
        c.acquire(&[1, 2, 3, 4, 5]);
        // Held blocks are never evicted, even beyond capacity ...
        assert_eq!(c.used_tokens(), 80);
        assert!((c.usage() - 1.0).abs() < 1e-12);
        // ... and once released, the cache shrinks back, tail first.
        c.release(&[1, 2, 3, 4, 5], 1.0);
        assert_eq!(c.used_tokens(), 48);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), 3);
        assert_eq!(c.usage(), 0.0, "free cached blocks are reclaimable");
        let mut off = PrefixCache::new(0, 16);
        off.acquire(&[1]);
        assert_eq!(off.lookup(&[1]), 0);
        assert_eq!(off.usage(), 0.0);
    }

    #[test]
    fn referenced_blocks_are_never_evicted() {
        let mut c = PrefixCache::new(3 * 16, 16);
        c.acquire(&[1, 2]); // running
        c.acquire(&[10, 11]);
        c.release(&[10, 11], 1.0); // done: free, evictable
        c.acquire(&[20, 21]); // needs room: evicts 11 then 10, never 1 or 2
        assert_eq!(c.lookup(&[1, 2]), 2);
        assert!(!c.contains(10) && !c.contains(11));
        assert!(c.contains(20) && c.contains(21));
        // A block shared by two holders stays held until both end.
        c.acquire(&[1]);
        c.release(&[1, 2], 2.0);
        c.release(&[20, 21], 3.0);
        c.acquire(&[30, 31]);
        assert!(c.contains(1), "still held by the second request");
    }

    #[test]
    fn lru_frees_oldest_and_tail_first() {
        let mut c = PrefixCache::new(4 * 16, 16);
        c.acquire(&[1, 2]);
        c.release(&[1, 2], 0.0);
        c.acquire(&[10, 11]);
        c.release(&[10, 11], 1.0);
        // Reusing the first chain makes the second one the least recent.
        c.acquire(&[1, 2]);
        c.release(&[1, 2], 2.0);
        c.acquire(&[20]);
        assert!(!c.contains(11), "tail of the LRU chain goes first");
        assert!(c.contains(10));
        c.release(&[20], 3.0);
        c.acquire(&[21]);
        assert!(!c.contains(10));
        assert_eq!(c.lookup(&[1, 2]), 2);
        c.release(&[21], 4.0);
        // A chain longer than the cache keeps its head, not its tail.
        let long = [30, 31, 32, 33, 34, 35];
        c.acquire(&long);
        c.release(&long, 5.0);
        assert_eq!(c.lookup(&long), 4);
        assert!(!c.contains(1));
    }

    #[test]
    fn counters_accumulate_and_clear() {
        let mut c = PrefixCache::new(160, 16);
        c.record_query(100, 0);
        c.record_query(100, 64);
        assert_eq!((c.query_tokens(), c.hit_tokens()), (200, 64));
        assert!((c.hit_rate() - 0.32).abs() < 1e-12);
        c.acquire(&[1]);
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
            prefill_overhead_ms: 0.0,
        };
        assert_eq!(t.prefill_ms(10), 5.0);
        assert_eq!(t.decode_ms(3), 6.0);
        // The overhead is paid once a request, even fully cached.
        let o = Timing {
            prefill_overhead_ms: 10.0,
            ..t
        };
        assert_eq!((o.prefill_ms(10), o.prefill_ms(0)), (15.0, 10.0));
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
                prefill_overhead_ms: 0.0,
            },
        });
        let p = Prompt::from_tokens(&ids(250, 1), 16); // 15 full blocks
        assert_eq!((p.tokens, p.blocks.len()), (250, 15));
        let first = e.admit(1, &p);
        assert_eq!((first.cached_tokens, first.uncached_tokens), (0, 250));
        assert_eq!(first.created_tokens, 240, "15 new full blocks");
        assert!((first.prefill_ms - 25.0).abs() < 1e-9);
        assert!(e.cache.usage() > 0.0);
        e.finish(1, 1.0);
        assert_eq!(e.cache.usage(), 0.0);
        let second = e.admit(2, &p);
        assert_eq!((second.cached_tokens, second.uncached_tokens), (240, 10));
        assert_eq!(second.created_tokens, 0, "every full block was cached");
        assert_eq!((e.cache.query_tokens(), e.cache.hit_tokens()), (500, 240));
        e.record_success(3);
        assert_eq!(e.completed(), 1);
        e.reset();
        assert_eq!((e.completed(), e.cache.query_tokens()), (0, 0));
    }

    #[test]
    fn salt_separates_prompts_and_uncached_admission_leaves_cache_alone() {
        let t = ids(64, 2);
        let plain = Prompt::salted(&t, 16, None);
        assert_eq!(plain, Prompt::from_tokens(&t, 16));
        let a = Prompt::salted(&t, 16, Some("a"));
        let b = Prompt::salted(&t, 16, Some("b"));
        assert_eq!(a.blocks.len(), 4);
        // No block in common: the salt changes the whole chain.
        for h in &a.blocks {
            assert!(!plain.blocks.contains(h) && !b.blocks.contains(h));
        }
        assert_eq!(a, Prompt::salted(&t, 16, Some("a")));

        let mut e = Engine::new(EngineConfig {
            max_concurrency: 2,
            cache_tokens: 10_000,
            block_tokens: 16,
            timing: Timing {
                prefill_ms_per_token: 0.5,
                decode_ms_per_token: 1.0,
                prefill_overhead_ms: 0.0,
            },
        });
        e.admit(1, &a);
        assert_eq!(e.admit(2, &b).cached_tokens, 0);
        let plan = e.admit_uncached(40);
        assert_eq!(
            (plan.prompt_tokens, plan.cached_tokens, plan.uncached_tokens),
            (40, 0, 40)
        );
        assert!((plan.prefill_ms - 20.0).abs() < 1e-9);
        assert_eq!(e.admit_uncached(0).prompt_tokens, 1);
        // Only the two generation prompts were counted.
        assert_eq!(e.cache.query_tokens(), 128);
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
                prefill_overhead_ms: 0.0,
            },
        });
        let p = Prompt::from_tokens(&ids(32, 0), 16); // exactly 2 blocks
        e.admit(1, &p);
        let again = e.admit(2, &p);
        assert_eq!((again.cached_tokens, again.uncached_tokens), (16, 16));
        assert_eq!(again.created_tokens, 16, "as vLLM counts it");
        // Token granularity (SGLang's radix cache): all but the last token.
        let mut r = Engine::new(EngineConfig {
            max_concurrency: 1,
            cache_tokens: 10_000,
            block_tokens: RADIX_BLOCK_TOKENS,
            timing: Timing {
                prefill_ms_per_token: 0.0,
                decode_ms_per_token: 0.0,
                prefill_overhead_ms: 0.0,
            },
        });
        let p = Prompt::from_tokens(&ids(37, 0), RADIX_BLOCK_TOKENS);
        r.admit(1, &p);
        let mut longer = ids(37, 0);
        longer.extend([5, 6, 7]);
        let q = Prompt::from_tokens(&longer, RADIX_BLOCK_TOKENS);
        assert_eq!(r.admit(2, &q).cached_tokens, 37);
    }
}
