//! Scenario generators: a fleet and a trace per scenario, deterministic by
//! seed.
//!
//! * `a` long-prefix agentic multi-turn (GORGO-like): ≈ 18k input tokens,
//!   ≈ 90 % prefix reuse; three regions 37 / 279 / 456 ms from the main client
//!   population (na), minorities in eu and ap.
//! * `b` short independent prompts.
//! * `c` a flash crowd in eu with a hot system prompt, over steady traffic.
//! * `d` multi-turn chat while the region nearest the main population is
//!   lost and comes back (fleet `outages`).
//!
//! Requests are open-loop: a session's next turn is sent after the previous
//! one's expected duration plus a think time, whatever the policy does.

use crate::fleet::{Fleet, Outage, Region};
use crate::rng::Rng;
use crate::trace::{mix, TraceRequest};
use std::collections::{BTreeMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    A,
    B,
    C,
    D,
}

impl Kind {
    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "a" => Some(Kind::A),
            "b" => Some(Kind::B),
            "c" => Some(Kind::C),
            "d" => Some(Kind::D),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Kind::A => "long-prefix agentic multi-turn (GORGO-like)",
            Kind::B => "short independent prompts",
            Kind::C => "flash crowd in eu with a hot system prompt",
            Kind::D => "loss of region iad mid-trace and its return",
        }
    }
}

pub struct Scenario {
    pub fleet: Fleet,
    pub trace: Vec<TraceRequest>,
}

pub fn generate(kind: Kind, seed: u64) -> Scenario {
    // Each scenario draws from its own stream of the seed.
    let mut rng = Rng::new(mix(
        seed ^ (kind as u64 + 1).wrapping_mul(0x5851_F42D_4C95_7F2D)
    ));
    let mut s = match kind {
        Kind::A => agentic(&mut rng),
        Kind::B => short(&mut rng),
        Kind::C => flash_crowd(&mut rng),
        Kind::D => region_loss(&mut rng),
    };
    // Sorted by time; ties keep generation order.
    s.trace.sort_by(|a, b| a.t_ms.total_cmp(&b.t_ms));
    for r in &mut s.trace {
        r.t_ms = (r.t_ms * 10.0).round() / 10.0;
    }
    s
}

/// The three regions and the round trips of three client populations: na
/// sees iad / fra / icn at 37 / 279 / 456 ms (GORGO's measurements from
/// Ashburn).
fn regions(slots: [u32; 3], decode_ms: f64) -> Vec<Region> {
    let rtt = |na: f64, eu: f64, ap: f64| {
        BTreeMap::from([
            ("na".to_string(), na),
            ("eu".to_string(), eu),
            ("ap".to_string(), ap),
        ])
    };
    let region = |name: &str, rtt_ms, slots| Region {
        name: name.into(),
        rtt_ms,
        max_concurrency: slots,
        prefill_ms_per_token: 0.09,
        decode_ms_per_token: decode_ms,
        cache_tokens: 600_000,
    };
    let [a, b, c] = slots;
    vec![
        region("iad", rtt(37.0, 95.0, 210.0), a),
        region("fra", rtt(279.0, 24.0, 260.0), b),
        region("icn", rtt(456.0, 300.0, 41.0), c),
    ]
}

fn clients() -> Vec<String> {
    vec!["na".into(), "eu".into(), "ap".into()]
}

fn tier(rng: &mut Rng, free: f64, paid: f64, critical: f64) -> String {
    ["free", "paid", "critical"]
        .get(rng.pick(&[free, paid, critical]))
        .copied()
        .unwrap_or("paid")
        .to_string()
}

fn tokens(rng: &mut Rng, median: f64, sigma: f64, lo: f64, hi: f64) -> u32 {
    rng.lognormal(median, sigma).clamp(lo, hi).round() as u32
}

/// Long agentic sessions: a shared system prompt, a shared document, then
/// turns of tool output and the model's previous answer.
/// One multi-turn conversation's shape: token distributions as
/// (median, sigma, min, max) for the answers and the user's (or tool's) next
/// turns, and the gap between turns as fixed ms + an exponential mean.
struct Conversation<'a> {
    name: &'a str,
    client: &'a str,
    tier: &'a str,
    output: (f64, f64, f64, f64),
    user: (f64, f64, f64, f64),
    gap_ms: (f64, f64),
    decode_ms: f64,
}

impl Conversation<'_> {
    /// `turns` requests from `start_ms`, each answer and the next user turn
    /// joining the context.
    fn push_turns(
        &self,
        rng: &mut Rng,
        trace: &mut Vec<TraceRequest>,
        mut segments: Vec<(String, u32)>,
        turns: u64,
        start_ms: f64,
    ) {
        let name = self.name;
        let (om, os, olo, ohi) = self.output;
        let (um, us, ulo, uhi) = self.user;
        let mut at = start_ms;
        for k in 0..turns {
            let out = tokens(rng, om, os, olo, ohi);
            trace.push(TraceRequest {
                t_ms: at,
                session: name.to_string(),
                client_region: self.client.into(),
                tier: self.tier.to_string(),
                segments: segments.clone(),
                output_tokens: out,
            });
            segments.push((format!("{name}-a{k}"), out));
            segments.push((format!("{name}-u{}", k + 1), tokens(rng, um, us, ulo, uhi)));
            at += self.gap_ms.0 + f64::from(out) * self.decode_ms + rng.exp(self.gap_ms.1);
        }
    }
}

fn agentic(rng: &mut Rng) -> Scenario {
    let decode = 22.0;
    let fleet = Fleet {
        client_regions: clients(),
        regions: regions([24, 24, 24], decode),
        outages: Vec::new(),
    };
    let systems: Vec<u32> = (0..4)
        .map(|_| tokens(rng, 1300.0, 0.2, 800.0, 2000.0))
        .collect();
    let docs: Vec<u32> = (0..40)
        .map(|_| tokens(rng, 8500.0, 0.35, 3000.0, 16000.0))
        .collect();
    let sessions = 150;
    let rate_per_s = 0.9;
    let mut trace = Vec::new();
    let mut t = 0.0;
    for s in 0..sessions {
        t += rng.exp(1000.0 / rate_per_s);
        let client = ["na", "eu", "ap"]
            .get(rng.pick(&[0.80, 0.12, 0.08]))
            .copied()
            .unwrap_or("na");
        let tier = tier(rng, 0.3, 0.6, 0.1);
        let sys = rng.zipf(systems.len(), 1.0);
        let doc = rng.zipf(docs.len(), 0.8);
        let name = format!("a{s}");
        let segments = vec![
            (
                format!("sys-{sys}"),
                systems.get(sys).copied().unwrap_or(1000),
            ),
            (format!("doc-{doc}"), docs.get(doc).copied().unwrap_or(8000)),
            (format!("{name}-u0"), tokens(rng, 400.0, 0.5, 50.0, 2000.0)),
        ];
        let turns = rng.int(8, 16);
        let convo = Conversation {
            name: &name,
            client,
            tier: &tier,
            output: (180.0, 0.5, 20.0, 800.0),
            user: (1000.0, 0.6, 100.0, 4000.0),
            gap_ms: (600.0, 2000.0),
            decode_ms: decode,
        };
        convo.push_turns(rng, &mut trace, segments, turns, t);
    }
    Scenario { fleet, trace }
}

/// Independent short prompts: a small shared system prompt and a unique
/// user message each.
fn short(rng: &mut Rng) -> Scenario {
    let decode = 18.0;
    let fleet = Fleet {
        client_regions: clients(),
        regions: regions([32, 16, 16], decode),
        outages: Vec::new(),
    };
    let systems: Vec<u32> = (0..8)
        .map(|_| tokens(rng, 250.0, 0.3, 100.0, 500.0))
        .collect();
    let mut trace = Vec::new();
    let mut t = 0.0;
    for i in 0..4000 {
        t += rng.exp(1000.0 / 20.0);
        trace.push(short_request(
            rng,
            t,
            &format!("b{i}"),
            &systems,
            [0.65, 0.22, 0.13],
        ));
    }
    Scenario { fleet, trace }
}

fn short_request(rng: &mut Rng, t: f64, id: &str, systems: &[u32], mix: [f64; 3]) -> TraceRequest {
    let client = ["na", "eu", "ap"]
        .get(rng.pick(&mix))
        .copied()
        .unwrap_or("na");
    let sys = rng.zipf(systems.len(), 1.0);
    TraceRequest {
        t_ms: t,
        session: id.into(),
        client_region: client.into(),
        tier: tier(rng, 0.4, 0.5, 0.1),
        segments: vec![
            (
                format!("sys-{sys}"),
                systems.get(sys).copied().unwrap_or(200),
            ),
            (format!("{id}-u0"), tokens(rng, 250.0, 0.8, 20.0, 2000.0)),
        ],
        output_tokens: tokens(rng, 120.0, 0.6, 10.0, 600.0),
    }
}

/// Steady short traffic, and for a minute a crowd in eu sending short
/// questions behind one hot 3000-token system prompt.
fn flash_crowd(rng: &mut Rng) -> Scenario {
    let decode = 18.0;
    let fleet = Fleet {
        client_regions: clients(),
        regions: regions([32, 16, 16], decode),
        outages: Vec::new(),
    };
    let systems: Vec<u32> = (0..8)
        .map(|_| tokens(rng, 250.0, 0.3, 100.0, 500.0))
        .collect();
    let mut trace = Vec::new();
    let mut t = 0.0;
    let mut i = 0;
    while t < 220_000.0 {
        t += rng.exp(1000.0 / 13.0);
        trace.push(short_request(
            rng,
            t,
            &format!("c{i}"),
            &systems,
            [0.55, 0.30, 0.15],
        ));
        i += 1;
    }
    let mut t = 60_000.0;
    let mut k = 0;
    while t < 120_000.0 {
        t += rng.exp(1000.0 / 14.0);
        let id = format!("crowd{k}");
        trace.push(TraceRequest {
            t_ms: t,
            session: id.clone(),
            client_region: "eu".into(),
            tier: tier(rng, 0.7, 0.3, 0.0),
            segments: vec![
                ("sys-hot".into(), 3000),
                (format!("{id}-u0"), tokens(rng, 120.0, 0.6, 10.0, 800.0)),
            ],
            output_tokens: tokens(rng, 100.0, 0.5, 10.0, 400.0),
        });
        k += 1;
    }
    Scenario { fleet, trace }
}

/// Multi-turn chat of moderate length; iad, nearest to the main
/// population, is lost from 80 s to 170 s.
fn region_loss(rng: &mut Rng) -> Scenario {
    let decode = 20.0;
    let fleet = Fleet {
        client_regions: clients(),
        regions: regions([24, 24, 16], decode),
        outages: vec![Outage {
            region: "iad".into(),
            from_ms: 80_000.0,
            to_ms: 170_000.0,
        }],
    };
    let systems: Vec<u32> = (0..6)
        .map(|_| tokens(rng, 800.0, 0.3, 300.0, 1500.0))
        .collect();
    let mut trace = Vec::new();
    let mut t = 0.0;
    let mut s = 0;
    while t < 240_000.0 {
        t += rng.exp(1000.0 / 1.9);
        let client = ["na", "eu", "ap"]
            .get(rng.pick(&[0.60, 0.25, 0.15]))
            .copied()
            .unwrap_or("na");
        let tier = tier(rng, 0.4, 0.5, 0.1);
        let sys = rng.zipf(systems.len(), 1.0);
        let name = format!("d{s}");
        let segments = vec![
            (
                format!("sys-{sys}"),
                systems.get(sys).copied().unwrap_or(800),
            ),
            (format!("{name}-u0"), tokens(rng, 300.0, 0.6, 20.0, 2000.0)),
        ];
        let turns = rng.int(4, 10);
        let convo = Conversation {
            name: &name,
            client,
            tier: &tier,
            output: (150.0, 0.5, 10.0, 600.0),
            user: (150.0, 0.7, 10.0, 1500.0),
            gap_ms: (400.0, 3000.0),
            decode_ms: decode,
        };
        convo.push_turns(rng, &mut trace, segments, turns, t);
        s += 1;
    }
    Scenario { fleet, trace }
}

/// Figures of a generated scenario, for people.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    pub requests: usize,
    pub sessions: usize,
    pub span_s: f64,
    pub mean_prompt_tokens: f64,
    /// Prompt tokens that are a prefix some earlier request already sent.
    pub prefix_reuse: f64,
    /// Decode work offered / (all regions' slots × span).
    pub offered_load: f64,
    pub per_client: BTreeMap<String, usize>,
}

pub fn figures(fleet: &Fleet, trace: &[TraceRequest]) -> Figures {
    let mut seen: HashSet<u64> = HashSet::new();
    let mut total = 0u64;
    let mut reused = 0u64;
    let mut sessions: HashSet<&str> = HashSet::new();
    let mut per_client: BTreeMap<String, usize> = BTreeMap::new();
    let mut decode_work = 0.0;
    let mean_decode = fleet
        .regions
        .iter()
        .map(|r| r.decode_ms_per_token)
        .sum::<f64>()
        / fleet.regions.len().max(1) as f64;
    for r in trace {
        sessions.insert(&r.session);
        *per_client.entry(r.client_region.clone()).or_insert(0) += 1;
        decode_work += f64::from(r.output_tokens.saturating_sub(1)) * mean_decode;
        let mut key = 0u64;
        let mut shared = true;
        for (id, n) in &r.segments {
            key = mix(key ^ crate::trace::fnv1a64(id.as_bytes()));
            total += u64::from(*n);
            if shared && seen.contains(&key) {
                reused += u64::from(*n);
            } else {
                shared = false;
            }
            seen.insert(key);
        }
    }
    let span_ms = trace.last().map_or(0.0, |r| r.t_ms).max(1.0);
    let slots: f64 = fleet
        .regions
        .iter()
        .map(|r| f64::from(r.max_concurrency))
        .sum();
    Figures {
        requests: trace.len(),
        sessions: sessions.len(),
        span_s: span_ms / 1000.0,
        mean_prompt_tokens: total as f64 / trace.len().max(1) as f64,
        prefix_reuse: if total == 0 {
            0.0
        } else {
            reused as f64 / total as f64
        },
        offered_load: decode_work / (slots * span_ms),
        per_client,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_valid_and_sorted() {
        for kind in [Kind::A, Kind::B, Kind::C, Kind::D] {
            let a = generate(kind, 42);
            let b = generate(kind, 42);
            assert_eq!(a.trace, b.trace);
            assert_eq!(a.fleet, b.fleet);
            assert_ne!(generate(kind, 43).trace, a.trace);
            a.fleet.validate().unwrap();
            assert!(a.trace.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
            let text = crate::trace::to_jsonl(&a.trace);
            assert_eq!(crate::trace::parse(&text).unwrap(), a.trace);
        }
    }

    #[test]
    fn scenario_a_is_long_and_reused() {
        let s = generate(Kind::A, 1);
        let f = figures(&s.fleet, &s.trace);
        assert!(
            (15_000.0..21_000.0).contains(&f.mean_prompt_tokens),
            "{f:?}"
        );
        assert!(f.prefix_reuse > 0.85, "{f:?}");
        assert!(f.per_client["na"] > f.requests * 7 / 10, "{f:?}");
        assert_eq!(s.fleet.rtt(0, 0), 37.0);
        assert_eq!(s.fleet.rtt(0, 1), 279.0);
        assert_eq!(s.fleet.rtt(0, 2), 456.0);
    }
}
