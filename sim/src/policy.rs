//! The policies a simulation can run, and the baselines' decisions. Each
//! baseline is one type with its thresholds as named constants, deciding on
//! a `View`: what the router instance that runs it knows. How much that is
//! (everything at once for the oracle, its own traffic and a periodic
//! scrape for a deployed instance) is the simulation's business
//! (`deploy`, `sim`); the decisions are the same code in every deployment.
//! The geo-router is in `geo.rs`: it runs the plugin's own code.

use crate::llmd::LlmD;
use crate::mesh::MeshDefault;
use crate::trace::fnv1a64;
use crate::trie::Trie;
use llm_geo_router::decision::choice::rendezvous;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    GeoRouter,
    RoundRobin,
    LeastRequest,
    SessionAffinity,
    Nearest,
    CacheAware,
    Gorgo,
    LlmD,
    MeshDefault,
}

impl PolicyName {
    pub const ALL: [PolicyName; 9] = [
        PolicyName::GeoRouter,
        PolicyName::RoundRobin,
        PolicyName::LeastRequest,
        PolicyName::SessionAffinity,
        PolicyName::Nearest,
        PolicyName::CacheAware,
        PolicyName::Gorgo,
        PolicyName::LlmD,
        PolicyName::MeshDefault,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::GeoRouter => "geo-router",
            PolicyName::RoundRobin => "round-robin",
            PolicyName::LeastRequest => "least-request",
            PolicyName::SessionAffinity => "session-affinity",
            PolicyName::Nearest => "nearest",
            PolicyName::CacheAware => "cache-aware",
            PolicyName::Gorgo => "gorgo",
            PolicyName::LlmD => "llm-d",
            PolicyName::MeshDefault => "mesh-default",
        }
    }

    pub fn parse(name: &str) -> Option<PolicyName> {
        PolicyName::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// SGLang's `cache_aware` defaults as its gateway's command line sets them
/// (smg 1.9.0, `model_gateway/src/main.rs`; the Python `RouterArgs` agree).
/// The KV-usage imbalance triggers are off at their default (1.0).
pub const CACHE_THRESHOLD: f64 = 0.3;
pub const BALANCE_ABS_THRESHOLD: u64 = 64;
pub const BALANCE_REL_THRESHOLD: f64 = 1.5;

/// GORGO's published learned weights.
pub const GORGO_W_RTT: f64 = 0.276;
pub const GORGO_W_QUEUE: f64 = 0.5;

/// What a baseline sees when it decides, all per region.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// Simulated time, ms.
    pub now_ms: f64,
    /// Passing active health checks.
    pub healthy: &'a [bool],
    /// Requests this router instance routed there and has not seen finish
    /// (the router's active count).
    pub outstanding: &'a [u64],
    /// Prompt tokens waiting there: for the oracle, every prompt routed
    /// there that has not started prefill yet (in transit or in the
    /// engine's waiting queue), at once; for a deployed router, the engine's
    /// waiting queue at the last scrape.
    pub queued_tokens: &'a [u64],
    /// Requests waiting there, counted as `queued_tokens` is (the engines'
    /// `num_requests_waiting` at the last scrape, for a deployed router).
    pub waiting: &'a [u64],
    /// KV-cache usage in [0, 1] (the mean over the region's replicas):
    /// exact for the oracle, else as of the last scrape.
    pub kv_usage: &'a [f64],
    /// KV-cache blocks (all the region's replicas), as the engines state
    /// them (vLLM's `cache_config_info`).
    pub kv_blocks: &'a [u64],
    /// Round trip from where the router is: the request's client region,
    /// or the router's own region for a global one.
    pub rtt_ms: &'a [f64],
    pub names: &'a [String],
}

impl View<'_> {
    fn candidates(&self) -> Vec<usize> {
        let healthy: Vec<usize> = (0..self.rtt_ms.len())
            .filter(|&r| self.healthy.get(r).copied().unwrap_or(false))
            .collect();
        if healthy.is_empty() {
            (0..self.rtt_ms.len()).collect()
        } else {
            healthy
        }
    }

    fn rtt(&self, r: usize) -> f64 {
        self.rtt_ms.get(r).copied().unwrap_or(f64::INFINITY)
    }

    fn load(&self, r: usize) -> u64 {
        self.outstanding.get(r).copied().unwrap_or(0)
    }

    /// Nearest among `among` (the first on ties).
    pub(crate) fn nearest(&self, among: &[usize]) -> usize {
        let mut best = among.first().copied().unwrap_or(0);
        for &r in among {
            if self.rtt(r) < self.rtt(best) {
                best = r;
            }
        }
        best
    }
}

/// One request as a baseline sees it.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub session: &'a str,
    pub segments: &'a [(u32, u32)],
    pub prompt_tokens: u64,
}

#[derive(Debug, Clone)]
pub enum Baseline {
    /// Next healthy region in turn.
    RoundRobin {
        next: usize,
    },
    /// Fewest outstanding requests at the region (Envoy `least_request` with
    /// full knowledge rather than two random choices); ties: nearest.
    LeastRequest,
    /// Rendezvous (highest-random-weight) hash of the session over the
    /// healthy regions: consistent, and only a lost region's sessions move.
    SessionAffinity,
    /// Lowest round trip from the router among the healthy regions: on a
    /// loss, the next nearest healthy region takes all of it. Not what a
    /// mesh does by default (`MeshDefault`).
    Nearest,
    CacheAware(CacheAware),
    Gorgo(Trie),
    LlmD(LlmD),
    MeshDefault(MeshDefault),
}

/// SGLang's `cache_aware` state: its tree, and per worker the requests it
/// sent there (`processed`, its tie-break among the least loaded).
#[derive(Debug, Clone)]
pub struct CacheAware {
    tree: Trie,
    processed: Vec<u64>,
}

impl Baseline {
    /// `seed`: the instance's own random draws (llm-d's tie-break, the
    /// mesh's least request), so instances draw apart and runs repeat.
    pub fn new(name: PolicyName, regions: usize, seed: u64) -> Option<Baseline> {
        Some(match name {
            PolicyName::GeoRouter => return None,
            PolicyName::RoundRobin => Baseline::RoundRobin { next: 0 },
            PolicyName::LeastRequest => Baseline::LeastRequest,
            PolicyName::SessionAffinity => Baseline::SessionAffinity,
            PolicyName::Nearest => Baseline::Nearest,
            PolicyName::CacheAware => Baseline::CacheAware(CacheAware {
                tree: Trie::new(regions),
                processed: vec![0; regions],
            }),
            PolicyName::Gorgo => Baseline::Gorgo(Trie::new(regions)),
            PolicyName::LlmD => Baseline::LlmD(LlmD::new(regions, seed)),
            PolicyName::MeshDefault => Baseline::MeshDefault(MeshDefault::new(regions, seed)),
        })
    }

    /// A round of health checks at `now_ms`: `checks` what each region
    /// answered, `healthy` the health they now give it.
    pub fn tick(&mut self, now_ms: f64, checks: &[bool], healthy: &[bool]) {
        match self {
            Baseline::LlmD(p) => p.tick(now_ms, healthy),
            Baseline::MeshDefault(p) => p.tick(now_ms, checks, healthy),
            _ => {}
        }
    }

    /// The end of a request this instance sent to `region` passed it:
    /// answered (`ok`) or refused or dropped.
    pub fn observe(&mut self, region: usize, ok: bool, now_ms: f64) {
        if let Baseline::MeshDefault(p) = self {
            p.observe(region, ok, now_ms);
        }
    }

    pub fn choose(&mut self, v: &View, ask: &Ask) -> usize {
        let cands = v.candidates();
        match self {
            Baseline::RoundRobin { next } => {
                let n = v.rtt_ms.len().max(1);
                for k in 0..n {
                    let r = (*next + k) % n;
                    if cands.contains(&r) {
                        *next = r + 1;
                        return r;
                    }
                }
                v.nearest(&cands)
            }
            Baseline::LeastRequest => {
                let min = cands.iter().map(|&r| v.load(r)).min().unwrap_or(0);
                let tied: Vec<usize> = cands
                    .iter()
                    .copied()
                    .filter(|&r| v.load(r) == min)
                    .collect();
                v.nearest(&tied)
            }
            Baseline::SessionAffinity => {
                let key = fnv1a64(ask.session.as_bytes());
                let mut best = cands.first().copied().unwrap_or(0);
                let mut top = 0u64;
                for (k, &r) in cands.iter().enumerate() {
                    let name = v.names.get(r).map_or("", String::as_str);
                    let score = rendezvous(key, name);
                    if k == 0 || score > top {
                        top = score;
                        best = r;
                    }
                }
                best
            }
            Baseline::Nearest => v.nearest(&cands),
            Baseline::CacheAware(state) => cache_aware(state, v, ask, &cands),
            Baseline::Gorgo(tree) => gorgo(tree, v, ask, &cands),
            Baseline::LlmD(p) => p.choose(v, ask, &cands),
            Baseline::MeshDefault(p) => p.choose(v),
        }
    }
}

/// SGLang's `cache_aware` over HTTP (its approximate string tree), as smg
/// 1.9.0 has it (lightseekorg/smg at 73da68c, 2026-08-07:
/// `CacheAwarePolicy::select_worker`, `select_worker_with_text`). Load is
/// the router's own count of its requests in flight to the worker.
///
/// - Over the healthy workers: when max − min load > 64 and max > 1.5 ×
///   min, the least loaded one (imbalanced: cache affinity abandoned).
/// - Else the prompt's match rate (matched / prompt characters; 4 a token,
///   so tokens here) against the tree. Above 0.3: the worker that created
///   the deepest matched node (`Trie::lookup`'s owner); if it is not
///   healthy, the first healthy worker, and the tree is left alone.
/// - At or below 0.3: the least loaded healthy worker, ties to the one it
///   sent fewer requests, then the first (`(load, processed, index)`). Not
///   the worker with the smallest tree, as the policy's header comment
///   still says.
/// - The chosen worker's tree gets the prompt, its count one more.
///
/// Its tree eviction (by size, `max_tree_size` 2^26 characters a worker)
/// never bites at these traces' sizes and is not modelled.
fn cache_aware(state: &mut CacheAware, v: &View, ask: &Ask, cands: &[usize]) -> usize {
    let CacheAware { tree, processed } = state;
    // `cands` are the healthy workers. With none healthy SGLang has no
    // worker to give and fails the request; `candidates` then gives every
    // region, and it decides over those.
    let pool = cands;
    let max = pool.iter().map(|&r| v.load(r)).max().unwrap_or(0);
    let min = pool.iter().map(|&r| v.load(r)).min().unwrap_or(0);
    let imbalanced = max.saturating_sub(min) > BALANCE_ABS_THRESHOLD
        && max as f64 > min as f64 * BALANCE_REL_THRESHOLD;
    let sent = |r: usize| processed.get(r).copied().unwrap_or(0);
    let least = pool
        .iter()
        .copied()
        .min_by_key(|&r| (v.load(r), sent(r), r))
        .unwrap_or(0);
    let chosen = if imbalanced {
        Some(least)
    } else {
        let m = tree.lookup(ask.segments);
        let rate = if ask.prompt_tokens == 0 {
            0.0
        } else {
            m.tokens as f64 / ask.prompt_tokens as f64
        };
        if rate > CACHE_THRESHOLD {
            m.owner.filter(|r| pool.contains(r))
        } else {
            Some(least)
        }
    };
    match chosen {
        Some(r) => {
            tree.insert(ask.segments, r);
            if let Some(n) = processed.get_mut(r) {
                *n += 1;
            }
            r
        }
        None => pool.first().copied().unwrap_or(0),
    }
}

/// GORGO: `score = w_rtt·rtt + uncached tokens + w_queue·queued tokens`,
/// lowest wins (the first on ties); uncached tokens from the prefixes it
/// routed to each region, queued tokens from the prompts waiting there.
fn gorgo(tree: &mut Trie, v: &View, ask: &Ask, cands: &[usize]) -> usize {
    let m = tree.lookup(ask.segments);
    let score = |r: usize| {
        let cached = m.per_region.get(r).copied().unwrap_or(0);
        let queued = v.queued_tokens.get(r).copied().unwrap_or(0);
        GORGO_W_RTT * v.rtt(r)
            + ask.prompt_tokens.saturating_sub(cached) as f64
            + GORGO_W_QUEUE * queued as f64
    };
    let mut best = cands.first().copied().unwrap_or(0);
    for &r in cands {
        if score(r) < score(best) {
            best = r;
        }
    }
    tree.insert(ask.segments, best);
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["near".into(), "far".into()]
    }

    fn view<'a>(
        names: &'a [String],
        healthy: &'a [bool],
        out: &'a [u64],
        queued: &'a [u64],
    ) -> View<'a> {
        View {
            now_ms: 0.0,
            healthy,
            outstanding: out,
            queued_tokens: queued,
            waiting: &[0, 0],
            kv_usage: &[0.0, 0.0],
            kv_blocks: &[1000, 1000],
            rtt_ms: &[10.0, 200.0],
            names,
        }
    }

    fn ask(segments: &[(u32, u32)]) -> Ask<'_> {
        Ask {
            session: "s1",
            segments,
            prompt_tokens: segments.iter().map(|s| u64::from(s.1)).sum(),
        }
    }

    #[test]
    fn simple_baselines_on_two_regions() {
        let n = names();
        let v = view(&n, &[true, true], &[3, 1], &[0, 0]);
        let a = ask(&[(1, 10)]);
        let mut rr = Baseline::new(PolicyName::RoundRobin, 2, 0).unwrap();
        let picks: Vec<usize> = (0..4).map(|_| rr.choose(&v, &a)).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
        assert_eq!(Baseline::LeastRequest.choose(&v, &a), 1);
        assert_eq!(Baseline::Nearest.choose(&v, &a), 0);
        // Only healthy regions: the far one is all that is left.
        let down = view(&n, &[false, true], &[0, 9], &[0, 0]);
        assert_eq!(Baseline::Nearest.choose(&down, &a), 1);
        assert_eq!(rr.choose(&down, &a), 1);
        // Session affinity is stable per session and spreads sessions.
        let mut spread = [0; 2];
        for s in 0..200 {
            let session = format!("s{s}");
            let a = Ask {
                session: &session,
                ..a
            };
            let r = Baseline::SessionAffinity.choose(&v, &a);
            assert_eq!(Baseline::SessionAffinity.choose(&v, &a), r);
            spread[r] += 1;
        }
        assert!(spread[0] > 60 && spread[1] > 60, "{spread:?}");
    }

    #[test]
    fn cache_aware_follows_the_tree_until_the_load_is_imbalanced() {
        let n = names();
        let mut p = Baseline::new(PolicyName::CacheAware, 2, 0).unwrap();
        let long = [(1, 1000), (2, 10)];
        // Cold: least loaded (far has fewer outstanding).
        let v = view(&n, &[true, true], &[5, 2], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&long)), 1);
        // Matched 1000/1010 > 0.3 on far: stays there though near is idle.
        let v = view(&n, &[true, true], &[0, 60], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 1000), (3, 10)])), 1);
        // max − min = 65 > 64 and 65 > 1.5 × 0: imbalanced, least loaded wins.
        let v = view(&n, &[true, true], &[0, 65], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 1000), (4, 10)])), 0);
        // 205 vs 140: a gap over 64 but not 1.5×: balanced, the cache wins:
        // far's insert created the deepest node (segment 1), though near
        // went through it last.
        let v = view(&n, &[true, true], &[140, 205], &[0, 0]);
        assert_eq!(
            p.choose(&v, &ask(&[(1, 1000), (5, 10)])),
            1,
            "the creator of the deepest node"
        );
        // A low match rate (1000 of 5000 tokens) goes to the least loaded.
        let v = view(&n, &[true, true], &[4, 3], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 1000), (6, 4000)])), 1);
    }

    #[test]
    fn cache_aware_sends_a_low_match_to_the_least_loaded_then_the_least_sent() {
        let n = names();
        let mut p = Baseline::new(PolicyName::CacheAware, 2, 0).unwrap();
        let idle = view(&n, &[true, true], &[0, 0], &[0, 0]);
        // Cold, loads equal, nothing sent yet: the first.
        assert_eq!(p.choose(&idle, &ask(&[(1, 100)])), 0);
        // Cold again, loads still equal: the one it has sent fewer.
        assert_eq!(p.choose(&idle, &ask(&[(2, 100)])), 1);
        assert_eq!(p.choose(&idle, &ask(&[(3, 100)])), 0);
        // Load first: near busier, though it has been sent no more.
        let v = view(&n, &[true, true], &[1, 0], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(4, 100)])), 1);
        // A match at or below 0.3 of the prompt counts as none: 100 of 400.
        let v = view(&n, &[true, true], &[0, 3], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(4, 100), (5, 300)])), 0);
    }

    #[test]
    fn cache_aware_weighs_the_balance_over_healthy_workers_only() {
        let names: Vec<String> = vec!["a".into(), "b".into(), "c".into()];
        let mut p = Baseline::new(PolicyName::CacheAware, 3, 0).unwrap();
        let v = |healthy: &'static [bool], out: &'static [u64]| View {
            now_ms: 0.0,
            healthy,
            outstanding: out,
            queued_tokens: &[0, 0, 0],
            waiting: &[0, 0, 0],
            kv_usage: &[0.0, 0.0, 0.0],
            kv_blocks: &[1000, 1000, 1000],
            rtt_ms: &[10.0, 50.0, 200.0],
            names: &names,
        };
        // a gets the document.
        assert_eq!(
            p.choose(&v(&[true, true, true], &[0, 1, 1]), &ask(&[(1, 1000)])),
            0
        );
        // 100 and 60 in flight at the healthy ones, c down and idle: 40
        // apart, balanced, so the match keeps the turn on a. Counted with
        // c's 0 it would look imbalanced and go to b.
        let down = v(&[true, true, false], &[100, 60, 0]);
        assert_eq!(p.choose(&down, &ask(&[(1, 1000), (2, 10)])), 0);
        // 130 and 60: imbalanced among the healthy: b.
        let down = v(&[true, true, false], &[130, 60, 0]);
        assert_eq!(p.choose(&down, &ask(&[(1, 1000), (3, 10)])), 1);
    }

    #[test]
    fn cache_aware_falls_back_to_the_first_healthy_when_the_match_is_down() {
        let n = names();
        let mut p = Baseline::new(PolicyName::CacheAware, 2, 0).unwrap();
        let v = view(&n, &[true, true], &[1, 0], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 1000)])), 1);
        // Far, which holds it, fails its checks: near, and the tree is left
        // as it was (near does not get the prompt, nor a request counted).
        let down = view(&n, &[true, false], &[5, 0], &[0, 0]);
        let turn = [(1, 1000), (2, 10)];
        assert_eq!(p.choose(&down, &ask(&turn)), 0);
        let Baseline::CacheAware(state) = &p else {
            panic!("cache-aware")
        };
        assert_eq!(state.tree.lookup(&turn).per_region, [0, 1000]);
        assert_eq!(state.processed, [0, 1]);
    }

    #[test]
    fn gorgo_weighs_rtt_uncached_and_queued_tokens() {
        let n = names();
        let mut p = Baseline::new(PolicyName::Gorgo, 2, 0).unwrap();
        let v = view(&n, &[true, true], &[0, 0], &[0, 0]);
        // Cold: only RTT differs.
        assert_eq!(p.choose(&v, &ask(&[(1, 2000)])), 0);
        // near holds 2000 tokens; 1000 queued tokens there cost 500 < 2000.
        let v = view(&n, &[true, true], &[0, 0], &[1000, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 2000), (2, 10)])), 0);
        // 5000 queued tokens cost 2500 > 2000 uncached + 0.276 × 190 ms.
        let v = view(&n, &[true, true], &[0, 0], &[5000, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 2000), (3, 10)])), 1);
    }
}
