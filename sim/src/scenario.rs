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
//! `e`, `f` and `g` run on engine regions on three continents, iad / fra /
//! nrt (us-east, eu-central, ap-northeast), at measured inter-region round
//! trips (`CONTINENT_RTT_MS`), with client regions na / eu / ap:
//!
//! * `e` demand skewed 55 / 30 / 15 % across na / eu / ap, multi-turn chat
//!   behind a handful of system prompts shared by all three client regions
//!   (Zipf popularity), and from 150 s to 225 s a crowd of short
//!   conversations in ap that triples its request rate.
//! * `f` caches smaller than the working set: many distinct long documents
//!   revisited by multi-turn sessions, each region's cache about a tenth of
//!   the prefixes that are sent more than once, so evictions dominate.
//! * `g` heterogeneous regions: nrt has half the slots of the others, fra
//!   twice their prefill time per token; a mix of chat, long-document
//!   sessions and one-off long prompts at about 75 % of the fleet's slots.
//!
//! Requests are open-loop: a session's next turn is sent after the previous
//! one's expected duration plus a think time, whatever the policy does.

use crate::rng::Rng;
use crate::topology::{Outage, Region, Topology};
use crate::trace::{mix, TraceRequest};
use engine_emulator::model::DEFAULT_PREFILL_OVERHEAD_MS;
use std::collections::{BTreeMap, HashMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    A,
    B,
    C,
    D,
    E,
    F,
    G,
}

impl Kind {
    /// Every scenario, in the order of their names.
    pub const ALL: [Kind; 7] = [
        Kind::A,
        Kind::B,
        Kind::C,
        Kind::D,
        Kind::E,
        Kind::F,
        Kind::G,
    ];

    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "a" => Some(Kind::A),
            "b" => Some(Kind::B),
            "c" => Some(Kind::C),
            "d" => Some(Kind::D),
            "e" => Some(Kind::E),
            "f" => Some(Kind::F),
            "g" => Some(Kind::G),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Kind::A => "long-prefix agentic multi-turn (GORGO-like)",
            Kind::B => "short independent prompts",
            Kind::C => "flash crowd in eu with a hot system prompt",
            Kind::D => "loss of region iad mid-trace and its return",
            Kind::E => "three continents, skewed demand, shared system prompts, a burst in ap",
            Kind::F => "caches smaller than the working set: many long documents revisited",
            Kind::G => "heterogeneous regions: half the slots in nrt, double prefill in fra",
        }
    }
}

pub struct Scenario {
    pub fleet: Topology,
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
        Kind::E => burst(&mut rng),
        Kind::F => evictions(&mut rng),
        Kind::G => heterogeneous(&mut rng),
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
        prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
        cache_tokens: 600_000,
        region_rtt_ms: BTreeMap::new(),
        replicas: 1,
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
    let fleet = Topology {
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
    let fleet = Topology {
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
    let fleet = Topology {
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
    let fleet = Topology {
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

/// A region's engines in [`continents`]: slots, prefill time per token and
/// prefix cache capacity.
#[derive(Debug, Clone, Copy)]
struct Engines {
    slots: u32,
    prefill_ms: f64,
    cache_tokens: u64,
}

/// Round trips (ms) of client regions na / eu / ap to iad / fra / nrt.
///
/// Between regions: the average ping round trips between AWS regions of
/// "Latency Between AWS Global Regions", as tabulated in
/// <https://acomputerscientistlearnsaws.blogspot.com/2017/04/aws-regions.html>:
/// us-east-1 ↔ eu-central-1 88.6 ms, us-east-1 ↔ ap-northeast-1 145.3 ms,
/// eu-central-1 ↔ ap-northeast-1 236.5 ms (the usual cloud figures: us-east
/// ↔ eu 75–90 ms, us-east ↔ ap-northeast 145–180 ms, eu ↔ ap 210–250 ms).
/// A client reaches the region on its own continent in 20 (na), 15 (eu) and
/// 25 (ap) ms (last mile and metro to a cloud region, typically 10–30 ms),
/// and a region on another continent in that plus the inter-region round
/// trip, rounded.
const CONTINENT_RTT_MS: [(&str, [f64; 3]); 3] = [
    // client: iad, fra, nrt
    ("na", [20.0, 109.0, 165.0]),
    ("eu", [104.0, 15.0, 252.0]),
    ("ap", [170.0, 262.0, 25.0]),
];

/// Round trips between the engine regions (the measured figures above),
/// each pair once: what a router deployed in one region pays to reach
/// another.
const INTER_REGION_RTT_MS: [(&str, &str, f64); 3] = [
    ("iad", "fra", 88.6),
    ("iad", "nrt", 145.3),
    ("fra", "nrt", 236.5),
];

/// The fleet of e, f and g: iad (us-east-1, N. Virginia), fra
/// (eu-central-1, Frankfurt), nrt (ap-northeast-1, Tokyo), with the round
/// trips of [`CONTINENT_RTT_MS`].
fn continents(engines: [Engines; 3], decode_ms: f64) -> Topology {
    let regions = ["iad", "fra", "nrt"]
        .into_iter()
        .zip(engines)
        .enumerate()
        .map(|(r, (name, e))| Region {
            name: name.into(),
            rtt_ms: CONTINENT_RTT_MS
                .iter()
                .map(|(c, rtt)| (c.to_string(), rtt.get(r).copied().unwrap_or(0.0)))
                .collect(),
            max_concurrency: e.slots,
            prefill_ms_per_token: e.prefill_ms,
            decode_ms_per_token: decode_ms,
            prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
            cache_tokens: e.cache_tokens,
            region_rtt_ms: INTER_REGION_RTT_MS
                .iter()
                .filter(|(a, _, _)| *a == name)
                .map(|(_, b, ms)| (b.to_string(), *ms))
                .collect(),
            replicas: 1,
        })
        .collect();
    Topology {
        client_regions: clients(),
        regions,
        outages: Vec::new(),
    }
}

fn client(rng: &mut Rng, shares: &[f64; 3]) -> &'static str {
    ["na", "eu", "ap"]
        .get(rng.pick(shares))
        .copied()
        .unwrap_or("na")
}

/// Scenario e: steady session demand by client region (na, eu, ap).
const E_SHARES: [f64; 3] = [0.55, 0.30, 0.15];
/// Scenario e: sessions start over this span (ms) at `E_RATE_PER_S`, each
/// of `E_TURNS` turns.
const E_SPAN_MS: f64 = 300_000.0;
const E_RATE_PER_S: f64 = 1.95;
const E_TURNS: (u64, u64) = (3, 10);
/// Scenario e: in this window (ms) ap's request rate is tripled by a crowd
/// of short conversations (`E_BURST_TURNS` turns each).
const E_BURST_MS: (f64, f64) = (150_000.0, 225_000.0);
const E_BURST_TURNS: (u64, u64) = (1, 3);

/// Multi-turn chat on three continents behind six system prompts shared by
/// every client region (Zipf popularity); demand 55 / 30 / 15 % from na /
/// eu / ap, slots 40 / 24 / 16 in iad / fra / nrt (50 / 30 / 20 %); and
/// from 150 s to 225 s a crowd in ap (a launch, the start of the working
/// day) sends short conversations behind the same system prompts, twice
/// ap's steady request rate on top of it: more than nrt alone can serve.
fn burst(rng: &mut Rng) -> Scenario {
    let decode = 20.0;
    let engines = |slots| Engines {
        slots,
        prefill_ms: 0.09,
        cache_tokens: 600_000,
    };
    let fleet = continents([engines(40), engines(24), engines(16)], decode);
    let systems: Vec<u32> = (0..6)
        .map(|_| tokens(rng, 2500.0, 0.4, 1000.0, 6000.0))
        .collect();
    let mut trace = Vec::new();
    let chat = |rng: &mut Rng, trace: &mut Vec<TraceRequest>, name: &str, client, t, turns| {
        let tier = tier(rng, 0.4, 0.5, 0.1);
        let sys = rng.zipf(systems.len(), 1.1);
        let segments = vec![
            (
                format!("sys-{sys}"),
                systems.get(sys).copied().unwrap_or(2500),
            ),
            (format!("{name}-u0"), tokens(rng, 300.0, 0.7, 20.0, 3000.0)),
        ];
        let (lo, hi) = turns;
        let turns = rng.int(lo, hi);
        let convo = Conversation {
            name,
            client,
            tier: &tier,
            output: (180.0, 0.5, 20.0, 800.0),
            user: (200.0, 0.7, 10.0, 2000.0),
            gap_ms: (500.0, 3000.0),
            decode_ms: decode,
        };
        convo.push_turns(rng, trace, segments, turns, t);
    };
    let mut t = 0.0;
    let mut s = 0;
    loop {
        t += rng.exp(1000.0 / E_RATE_PER_S);
        if t >= E_SPAN_MS {
            break;
        }
        let who = client(rng, &E_SHARES);
        chat(rng, &mut trace, &format!("e{s}"), who, t, E_TURNS);
        s += 1;
    }
    // ap's steady request rate, twice over, from shorter conversations.
    let mean_turns = |(lo, hi): (u64, u64)| (lo + hi) as f64 / 2.0;
    let ap_requests_per_s =
        E_SHARES.get(2).copied().unwrap_or(0.15) * E_RATE_PER_S * mean_turns(E_TURNS);
    let crowd_per_s = 2.0 * ap_requests_per_s / mean_turns(E_BURST_TURNS);
    let (from, to) = E_BURST_MS;
    let mut t = from;
    let mut k = 0;
    loop {
        t += rng.exp(1000.0 / crowd_per_s);
        if t >= to {
            break;
        }
        chat(rng, &mut trace, &format!("eb{k}"), "ap", t, E_BURST_TURNS);
        k += 1;
    }
    Scenario { fleet, trace }
}

/// Scenario f: each region's prefix cache, in tokens: about what its 24
/// slots' prompts take at once, a tenth of the trace's working set.
const F_CACHE_TOKENS: u64 = 320_000;

/// Document question answering on three continents: three applications
/// (system prompts, Zipf popularity), each with its own library of 80 long
/// documents (≈ 10k tokens, Zipf 0.6 popularity: most are read by several
/// sessions, minutes apart), read by multi-turn sessions with long think
/// times. Each region's cache holds about a tenth of the prefixes the trace
/// sends more than once, so what a region holds is decided by eviction.
fn evictions(rng: &mut Rng) -> Scenario {
    let decode = 20.0;
    let engines = |slots| Engines {
        slots,
        prefill_ms: 0.09,
        cache_tokens: F_CACHE_TOKENS,
    };
    let fleet = continents([engines(24), engines(24), engines(16)], decode);
    let systems: Vec<u32> = (0..3)
        .map(|_| tokens(rng, 1200.0, 0.2, 800.0, 2000.0))
        .collect();
    let docs: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            (0..80)
                .map(|_| tokens(rng, 10_000.0, 0.35, 3000.0, 20_000.0))
                .collect()
        })
        .collect();
    let rate_per_s = 3.0;
    let mut trace = Vec::new();
    let mut t = 0.0;
    let mut s = 0;
    loop {
        t += rng.exp(1000.0 / rate_per_s);
        if t >= 300_000.0 {
            break;
        }
        let who = client(rng, &[0.50, 0.30, 0.20]);
        let tier = tier(rng, 0.4, 0.5, 0.1);
        let app = rng.zipf(systems.len(), 1.0);
        let library = docs.get(app).map_or(&[][..], Vec::as_slice);
        let doc = rng.zipf(library.len(), 0.6);
        let name = format!("f{s}");
        let segments = vec![
            (
                format!("sys-{app}"),
                systems.get(app).copied().unwrap_or(1200),
            ),
            (
                format!("doc-{app}-{doc}"),
                library.get(doc).copied().unwrap_or(10_000),
            ),
            (format!("{name}-u0"), tokens(rng, 250.0, 0.6, 30.0, 1500.0)),
        ];
        let turns = rng.int(2, 6);
        let convo = Conversation {
            name: &name,
            client: who,
            tier: &tier,
            output: (150.0, 0.5, 20.0, 600.0),
            user: (150.0, 0.7, 10.0, 1500.0),
            gap_ms: (500.0, 8000.0),
            decode_ms: decode,
        };
        convo.push_turns(rng, &mut trace, segments, turns, t);
        s += 1;
    }
    Scenario { fleet, trace }
}

/// Regions that differ: iad and fra have 32 slots, nrt (the newest build-out)
/// 16; fra's older accelerators take twice as long per prefill token (0.18
/// ms against 0.09). Demand 45 / 30 / 25 % from na / eu / ap, so nrt alone
/// would run near its limit; sessions are chat (60 %), long-document
/// conversations (30 %) or one long prompt each (10 %), at about 75 % of
/// the fleet's slots.
fn heterogeneous(rng: &mut Rng) -> Scenario {
    let decode = 20.0;
    let fleet = continents(
        [
            Engines {
                slots: 32,
                prefill_ms: 0.09,
                cache_tokens: 600_000,
            },
            Engines {
                slots: 32,
                prefill_ms: 0.18,
                cache_tokens: 600_000,
            },
            Engines {
                slots: 16,
                prefill_ms: 0.09,
                cache_tokens: 600_000,
            },
        ],
        decode,
    );
    let chat_systems: Vec<u32> = (0..8)
        .map(|_| tokens(rng, 500.0, 0.4, 150.0, 1500.0))
        .collect();
    let doc_systems: Vec<u32> = (0..3)
        .map(|_| tokens(rng, 1500.0, 0.2, 800.0, 2500.0))
        .collect();
    let docs: Vec<u32> = (0..40)
        .map(|_| tokens(rng, 8000.0, 0.35, 3000.0, 16000.0))
        .collect();
    let rate_per_s = 3.5;
    let mut trace = Vec::new();
    let mut t = 0.0;
    let mut s = 0;
    loop {
        t += rng.exp(1000.0 / rate_per_s);
        if t >= 300_000.0 {
            break;
        }
        let who = client(rng, &[0.45, 0.30, 0.25]);
        let tier = tier(rng, 0.4, 0.5, 0.1);
        let name = format!("g{s}");
        s += 1;
        match rng.pick(&[0.6, 0.3, 0.1]) {
            0 => {
                let sys = rng.zipf(chat_systems.len(), 1.0);
                let segments = vec![
                    (
                        format!("chat-{sys}"),
                        chat_systems.get(sys).copied().unwrap_or(500),
                    ),
                    (format!("{name}-u0"), tokens(rng, 200.0, 0.7, 10.0, 2000.0)),
                ];
                let turns = rng.int(2, 6);
                let convo = Conversation {
                    name: &name,
                    client: who,
                    tier: &tier,
                    output: (150.0, 0.6, 10.0, 600.0),
                    user: (120.0, 0.7, 10.0, 1000.0),
                    gap_ms: (400.0, 3000.0),
                    decode_ms: decode,
                };
                convo.push_turns(rng, &mut trace, segments, turns, t);
            }
            1 => {
                let sys = rng.zipf(doc_systems.len(), 1.0);
                let doc = rng.zipf(docs.len(), 0.8);
                let segments = vec![
                    (
                        format!("sys-{sys}"),
                        doc_systems.get(sys).copied().unwrap_or(1500),
                    ),
                    (format!("doc-{doc}"), docs.get(doc).copied().unwrap_or(8000)),
                    (format!("{name}-u0"), tokens(rng, 300.0, 0.6, 30.0, 2000.0)),
                ];
                let turns = rng.int(3, 8);
                let convo = Conversation {
                    name: &name,
                    client: who,
                    tier: &tier,
                    output: (200.0, 0.5, 20.0, 800.0),
                    user: (400.0, 0.6, 50.0, 2000.0),
                    gap_ms: (600.0, 2500.0),
                    decode_ms: decode,
                };
                convo.push_turns(rng, &mut trace, segments, turns, t);
            }
            _ => trace.push(TraceRequest {
                t_ms: t,
                session: name.clone(),
                client_region: who.into(),
                tier,
                segments: vec![(
                    format!("{name}-u0"),
                    tokens(rng, 6000.0, 0.5, 2000.0, 16000.0),
                )],
                output_tokens: tokens(rng, 300.0, 0.4, 50.0, 800.0),
            }),
        }
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
    /// Prefill work offered / (all regions' slots × span), at the fleet's
    /// slot-weighted mean prefill time per token: `.0` if every prefix sent
    /// before were still cached where the request goes (only the tokens not
    /// in `prefix_reuse` prefilled), `.1` with no cache at all. Any policy's
    /// slot load lies between `offered_load` plus the one and plus the other.
    pub prefill_load: (f64, f64),
    /// Tokens of the distinct prompt prefixes sent by two requests or more:
    /// what a cache could ever hit on.
    pub working_set_tokens: u64,
    pub per_client: BTreeMap<String, usize>,
}

pub fn figures(fleet: &Topology, trace: &[TraceRequest]) -> Figures {
    // Prefix key → (its last segment's tokens, requests that sent it).
    let mut sent: HashMap<u64, (u64, u32)> = HashMap::new();
    let mut total = 0u64;
    let mut sessions: HashSet<&str> = HashSet::new();
    let mut per_client: BTreeMap<String, usize> = BTreeMap::new();
    for r in trace {
        sessions.insert(&r.session);
        *per_client.entry(r.client_region.clone()).or_insert(0) += 1;
        for (key, n) in prefixes(r) {
            total += u64::from(n);
            sent.entry(key).or_insert((u64::from(n), 0)).1 += 1;
        }
    }
    let span_ms = trace.last().map_or(0.0, |r| r.t_ms).max(1.0);
    let load = offered_load(fleet, trace, (0.0, span_ms));
    Figures {
        requests: trace.len(),
        sessions: sessions.len(),
        span_s: span_ms / 1000.0,
        mean_prompt_tokens: total as f64 / trace.len().max(1) as f64,
        prefix_reuse: if total == 0 {
            0.0
        } else {
            load.reused_tokens as f64 / total as f64
        },
        offered_load: load.decode,
        prefill_load: load.prefill,
        working_set_tokens: sent
            .values()
            .filter(|(_, requests)| *requests >= 2)
            .map(|(tokens, _)| tokens)
            .sum(),
        per_client,
    }
}

/// A request's prompt prefixes: after each segment, a key for the whole
/// prefix so far and that segment's tokens.
fn prefixes(r: &TraceRequest) -> impl Iterator<Item = (u64, u32)> + '_ {
    r.segments.iter().scan(0u64, |key, (id, n)| {
        *key = mix(*key ^ crate::trace::fnv1a64(id.as_bytes()));
        Some((*key, *n))
    })
}

/// Work offered by the requests sent within a window, over all regions'
/// slots for its length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    /// Decode of every output token but the first, at the regions' mean
    /// decode time per token.
    pub decode: f64,
    /// Prefill at the fleet's slot-weighted mean prefill time per token:
    /// `.0` of the tokens no earlier request sent as the same prefix (every
    /// prefix cached wherever the request goes), `.1` of every prompt token
    /// (nothing cached).
    pub prefill: (f64, f64),
    /// Prompt tokens of the window's requests that an earlier request sent
    /// as the same prefix.
    pub reused_tokens: u64,
}

/// The load offered by the requests with `window.0 <= t_ms <= window.1`
/// (earlier requests count only for what they leave reusable).
pub fn offered_load(fleet: &Topology, trace: &[TraceRequest], window: (f64, f64)) -> Load {
    let (from, to) = window;
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut decode_tokens, mut total, mut reused) = (0u64, 0u64, 0u64);
    for r in trace.iter().take_while(|r| r.t_ms <= to) {
        let counted = r.t_ms >= from;
        if counted {
            decode_tokens += u64::from(r.output_tokens.saturating_sub(1));
        }
        let mut shared = true;
        for (key, n) in prefixes(r) {
            let sent_before = !seen.insert(key);
            shared = shared && sent_before;
            if counted {
                total += u64::from(n);
                if shared {
                    reused += u64::from(n);
                }
            }
        }
    }
    let slots: f64 = fleet
        .regions
        .iter()
        .map(|r| f64::from(r.max_concurrency))
        .sum();
    let mean_decode = fleet
        .regions
        .iter()
        .map(|r| r.decode_ms_per_token)
        .sum::<f64>()
        / fleet.regions.len().max(1) as f64;
    let prefill_ms = fleet
        .regions
        .iter()
        .map(|r| f64::from(r.max_concurrency) * r.prefill_ms_per_token)
        .sum::<f64>()
        / slots.max(1.0);
    let capacity = slots * (to - from).max(1.0);
    let prefill = |tokens: u64| tokens as f64 * prefill_ms / capacity;
    Load {
        decode: decode_tokens as f64 * mean_decode / capacity,
        prefill: (prefill(total - reused), prefill(total)),
        reused_tokens: reused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_valid_and_sorted() {
        for kind in Kind::ALL {
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

    /// When each session sent its first request.
    fn session_starts(trace: &[TraceRequest]) -> HashMap<&str, f64> {
        let mut first: HashMap<&str, f64> = HashMap::new();
        for r in trace {
            first.entry(&r.session).or_insert(r.t_ms);
        }
        first
    }

    /// Requests per second from `client` with `from <= t_ms < to`.
    fn rate(trace: &[TraceRequest], client: &str, from: f64, to: f64) -> f64 {
        let n = trace
            .iter()
            .filter(|r| r.client_region == client && (from..to).contains(&r.t_ms))
            .count();
        n as f64 * 1000.0 / (to - from)
    }

    /// Decode plus prefill load (`.0` every reused prefix cached, `.1`
    /// nothing cached) of the requests sent from 60 s to 300 s, while
    /// sessions arrive at their steady rate.
    fn steady_load(s: &Scenario) -> (f64, f64) {
        let l = offered_load(&s.fleet, &s.trace, (60_000.0, 300_000.0));
        (l.decode + l.prefill.0, l.decode + l.prefill.1)
    }

    #[test]
    fn offered_load_counts_the_window_and_what_came_before() {
        let s = generate(Kind::D, 3);
        let span = s.trace.last().unwrap().t_ms;
        let f = figures(&s.fleet, &s.trace);
        let all = offered_load(&s.fleet, &s.trace, (0.0, span));
        assert_eq!(all.decode, f.offered_load);
        assert!(all.prefill.0 < all.prefill.1);
        // Halves: each counts its own requests, the second reuses the first's prefixes.
        let a = offered_load(&s.fleet, &s.trace, (0.0, span / 2.0));
        let b = offered_load(&s.fleet, &s.trace, (span / 2.0 + 0.05, span));
        assert!(((a.decode + b.decode) / 2.0 - all.decode).abs() < 1e-3 * all.decode);
        assert_eq!(a.reused_tokens + b.reused_tokens, all.reused_tokens);
    }

    #[test]
    fn scenario_e_is_skewed_shared_and_bursts_in_ap() {
        for seed in 1..=3 {
            let s = generate(Kind::E, seed);
            let fleet = &s.fleet;
            assert_eq!(fleet.client_regions, ["na", "eu", "ap"]);
            // Each client region has a region of its own 10–30 ms away and
            // the others at inter-continental distances.
            for c in 0..3 {
                assert!((10.0..=30.0).contains(&fleet.rtt(c, c)), "{c}");
                assert!((0..3).filter(|&r| r != c).all(|r| fleet.rtt(c, r) >= 80.0));
            }
            // Inter-region legs: us-east–eu, us-east–ap, eu–ap.
            let leg = |c, r| fleet.rtt(c, r) - fleet.rtt(c, c);
            assert!((75.0..=95.0).contains(&leg(0, 1)) && (75.0..=95.0).contains(&leg(1, 0)));
            assert!((140.0..=180.0).contains(&leg(0, 2)) && (140.0..=180.0).contains(&leg(2, 0)));
            assert!((210.0..=250.0).contains(&leg(1, 2)) && (210.0..=250.0).contains(&leg(2, 1)));

            // Demand shares of the steady traffic (sessions begun outside the burst).
            let (from, to) = E_BURST_MS;
            let starts = session_starts(&s.trace);
            let steady: Vec<&TraceRequest> = s
                .trace
                .iter()
                .filter(|r| !(from..to).contains(&starts[r.session.as_str()]))
                .collect();
            for (client, want) in [("na", 0.55), ("eu", 0.30), ("ap", 0.15)] {
                let n = steady.iter().filter(|r| r.client_region == client).count();
                let share = n as f64 / steady.len() as f64;
                assert!(
                    (share - want).abs() <= 0.05,
                    "seed {seed}: {client} {share}"
                );
            }

            // ap's request rate in the burst (its conversations take a few
            // seconds to reach their second turns) is at least twice its
            // rate in the 90 s before; the others' barely move.
            let during = |c| rate(&s.trace, c, from + 10_000.0, to + 10_000.0);
            let steady = |c| {
                let (a, b) = (from - 60_000.0, E_SPAN_MS - to - 30_000.0);
                (rate(&s.trace, c, 60_000.0, from) * a
                    + rate(&s.trace, c, to + 30_000.0, E_SPAN_MS) * b)
                    / (a + b)
            };
            assert!(during("ap") >= 2.0 * steady("ap"), "seed {seed}");
            for c in ["na", "eu"] {
                assert!(during(c) < 1.5 * steady(c), "seed {seed}: {c}");
            }

            // The most popular system prompts are sent from every client region.
            let mut users: BTreeMap<&str, HashSet<&str>> = BTreeMap::new();
            for r in &s.trace {
                users
                    .entry(&r.segments[0].0)
                    .or_default()
                    .insert(&r.client_region);
            }
            assert_eq!(users.len(), 6, "seed {seed}");
            assert!(users.values().filter(|c| c.len() == 3).count() >= 3);
            let f = figures(fleet, &s.trace);
            assert!(f.prefix_reuse > 0.8, "{f:?}");
            assert!(f.sessions * 3 < f.requests, "multi-turn: {f:?}");

            let (lo, hi) = steady_load(&s);
            assert!(lo >= 0.60 && hi <= 0.90, "seed {seed}: {lo} {hi}");
        }
    }

    #[test]
    fn scenario_f_caches_hold_a_tenth_of_the_working_set() {
        for seed in 1..=3 {
            let s = generate(Kind::F, seed);
            let f = figures(&s.fleet, &s.trace);
            for r in &s.fleet.regions {
                let ratio = f.working_set_tokens as f64 / r.cache_tokens as f64;
                assert!((8.0..=12.5).contains(&ratio), "seed {seed}: {ratio}");
                // Yet a region's cache holds what its slots prefill at once.
                let at_once = f64::from(r.max_concurrency) * f.mean_prompt_tokens;
                assert!(r.cache_tokens as f64 >= 0.75 * at_once, "{}", r.name);
            }
            // Many distinct long documents, most read by several sessions.
            let mut readers: HashMap<&str, HashSet<&str>> = HashMap::new();
            for r in &s.trace {
                let (doc, n) = &r.segments[1];
                assert!(*n >= 3000, "{doc}");
                readers.entry(doc).or_default().insert(&r.session);
            }
            assert!(readers.len() >= 200, "seed {seed}: {}", readers.len());
            let revisited = readers.values().filter(|s| s.len() >= 2).count();
            assert!(
                revisited * 10 >= readers.len() * 7,
                "seed {seed}: {revisited}"
            );
            assert!(f.mean_prompt_tokens > 8000.0, "{f:?}");

            // Between every reused prefix cached and none: half of them.
            let (lo, hi) = steady_load(&s);
            assert!(
                (0.60..=0.90).contains(&((lo + hi) / 2.0)),
                "seed {seed}: {lo} {hi}"
            );
            assert!(hi <= 1.0, "seed {seed}: {hi}");
        }
    }

    #[test]
    fn scenario_g_has_a_small_region_and_a_slow_one() {
        for seed in 1..=3 {
            let s = generate(Kind::G, seed);
            let regions = &s.fleet.regions;
            let most = regions.iter().map(|r| r.max_concurrency).max().unwrap();
            let fastest = regions
                .iter()
                .map(|r| r.prefill_ms_per_token)
                .fold(f64::INFINITY, f64::min);
            let small: Vec<usize> = (0..3)
                .filter(|&i| regions[i].max_concurrency * 2 == most)
                .collect();
            let slow: Vec<usize> = (0..3)
                .filter(|&i| regions[i].prefill_ms_per_token == 2.0 * fastest)
                .collect();
            assert_eq!(small.len(), 1);
            assert_eq!(slow.len(), 1);
            assert_ne!(small, slow);
            for (i, r) in regions.iter().enumerate() {
                assert!(small.contains(&i) || r.max_concurrency == most);
                assert!(slow.contains(&i) || r.prefill_ms_per_token == fastest);
                assert_eq!(r.decode_ms_per_token, regions[0].decode_ms_per_token);
            }
            // A mixed workload: short chat, long prompts, one-off requests.
            let n = s.trace.len() as f64;
            let short = s.trace.iter().filter(|r| r.segment_tokens() < 2000).count();
            let long = s
                .trace
                .iter()
                .filter(|r| r.segment_tokens() >= 6000)
                .count();
            assert!((0.25..=0.7).contains(&(short as f64 / n)), "{short}");
            assert!((0.2..=0.6).contains(&(long as f64 / n)), "{long}");
            let starts = session_starts(&s.trace);
            let mut turns: HashMap<&str, usize> = HashMap::new();
            for r in &s.trace {
                *turns.entry(&r.session).or_insert(0) += 1;
            }
            let one_off = turns.values().filter(|&&t| t == 1).count();
            assert!(one_off * 20 >= starts.len(), "{one_off}");

            let (lo, hi) = steady_load(&s);
            assert!(lo >= 0.70 && hi <= 0.90, "seed {seed}: {lo} {hi}");
        }
    }
}
