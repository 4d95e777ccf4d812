//! The policies a simulation can run, and the baselines' decisions. Each
//! baseline is one type with its thresholds as named constants, deciding on
//! a `View`: what the router instance that runs it knows. How much that is
//! (everything at once for the oracle, its own traffic and a periodic
//! scrape for a deployed instance) is the simulation's business
//! (`deploy`, `sim`); the decisions are the same code in every deployment.
//! The geo-router is in `geo.rs`: it runs the plugin's own code.

use crate::trace::fnv1a64;
use crate::trie::Trie;
use llm_geo_router::cost::rendezvous;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyName {
    GeoRouter,
    RoundRobin,
    LeastRequest,
    SessionAffinity,
    Nearest,
    CacheAware,
    Gorgo,
}

impl PolicyName {
    pub const ALL: [PolicyName; 7] = [
        PolicyName::GeoRouter,
        PolicyName::RoundRobin,
        PolicyName::LeastRequest,
        PolicyName::SessionAffinity,
        PolicyName::Nearest,
        PolicyName::CacheAware,
        PolicyName::Gorgo,
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
        }
    }

    pub fn parse(name: &str) -> Option<PolicyName> {
        PolicyName::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// SGLang router `cache_aware` defaults (sglang_router `RouterArgs`).
pub const CACHE_THRESHOLD: f64 = 0.3;
pub const BALANCE_ABS_THRESHOLD: u64 = 64;
pub const BALANCE_REL_THRESHOLD: f64 = 1.5;

/// GORGO's published learned weights.
pub const GORGO_W_RTT: f64 = 0.276;
pub const GORGO_W_QUEUE: f64 = 0.5;

/// What a baseline sees when it decides, all per region.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
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
    fn nearest(&self, among: &[usize]) -> usize {
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
    /// Lowest round trip from the client region.
    Nearest,
    CacheAware(Trie),
    Gorgo(Trie),
}

impl Baseline {
    pub fn new(name: PolicyName, regions: usize) -> Option<Baseline> {
        Some(match name {
            PolicyName::GeoRouter => return None,
            PolicyName::RoundRobin => Baseline::RoundRobin { next: 0 },
            PolicyName::LeastRequest => Baseline::LeastRequest,
            PolicyName::SessionAffinity => Baseline::SessionAffinity,
            PolicyName::Nearest => Baseline::Nearest,
            PolicyName::CacheAware => Baseline::CacheAware(Trie::new(regions)),
            PolicyName::Gorgo => Baseline::Gorgo(Trie::new(regions)),
        })
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
            Baseline::CacheAware(tree) => cache_aware(tree, v, ask, &cands),
            Baseline::Gorgo(tree) => gorgo(tree, v, ask, &cands),
        }
    }
}

/// SGLang router `cache_aware` (sgl-model-gateway `CacheAwarePolicy::select_worker`):
/// if the load is imbalanced (max − min > 64 and max > 1.5 × min, over all
/// workers, load = the router's outstanding requests) the least loaded
/// healthy worker; else if the prompt's match rate in the approximate tree
/// (matched / prompt, of the worker that last went through the deepest
/// matched node) exceeds 0.3 that worker; else the least loaded healthy
/// worker (the first on ties). The chosen worker's tree gets the prompt.
fn cache_aware(tree: &mut Trie, v: &View, ask: &Ask, cands: &[usize]) -> usize {
    let loads = (0..v.rtt_ms.len()).map(|r| v.load(r));
    let max = loads.clone().max().unwrap_or(0);
    let min = loads.min().unwrap_or(0);
    let imbalanced = max.saturating_sub(min) > BALANCE_ABS_THRESHOLD
        && max as f64 > min as f64 * BALANCE_REL_THRESHOLD;
    let least = || {
        let mut best = cands.first().copied().unwrap_or(0);
        for &r in cands {
            if v.load(r) < v.load(best) {
                best = r;
            }
        }
        best
    };
    let chosen = if imbalanced {
        least()
    } else {
        let m = tree.lookup(ask.segments);
        let rate = if ask.prompt_tokens == 0 {
            0.0
        } else {
            m.tokens as f64 / ask.prompt_tokens as f64
        };
        match m.region {
            Some(r) if rate > CACHE_THRESHOLD => {
                // An unhealthy best match: SGLang falls back to the first
                // healthy worker.
                if cands.contains(&r) {
                    r
                } else {
                    cands.first().copied().unwrap_or(r)
                }
            }
            _ => least(),
        }
    };
    tree.insert(ask.segments, chosen);
    chosen
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
            healthy,
            outstanding: out,
            queued_tokens: queued,
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
        let mut rr = Baseline::new(PolicyName::RoundRobin, 2).unwrap();
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
        let mut p = Baseline::new(PolicyName::CacheAware, 2).unwrap();
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
        // 205 vs 140: a gap over 64 but not 1.5×: balanced, the cache wins.
        let v = view(&n, &[true, true], &[140, 205], &[0, 0]);
        assert_eq!(
            p.choose(&v, &ask(&[(1, 1000), (5, 10)])),
            0,
            "the latest holder of the deepest node"
        );
        // A low match rate (1000 of 5000 tokens) goes to the least loaded.
        let v = view(&n, &[true, true], &[4, 3], &[0, 0]);
        assert_eq!(p.choose(&v, &ask(&[(1, 1000), (6, 4000)])), 1);
    }

    #[test]
    fn gorgo_weighs_rtt_uncached_and_queued_tokens() {
        let n = names();
        let mut p = Baseline::new(PolicyName::Gorgo, 2).unwrap();
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
