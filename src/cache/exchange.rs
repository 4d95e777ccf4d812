//! Many Envoys, one view: what each Envoy of a deployment learns reaches
//! the others through the probe's callouts, within about a tick.
//!
//! Each Envoy's probe keeps an outbox of news: this Envoy's placements (a
//! region served a prompt: the checkpoints it wrote, their stamp and the
//! prompt's end), stored-response ids, the engines' usage reports, and its
//! own load (in-flight requests per region, and its demand). Every
//! `exchange.interval_ms` it sends the outbox as one message to
//! `exchange.fanout` peers through the peers' Envoy cluster, and empties it.
//! A peer's `exchange` filter checks the message whole, merges its
//! placements and stored responses into shared data at once, and queues it
//! for its probe, which takes the loads and usage reports and puts in its
//! own outbox what was news to it: each Envoy forwards each item once (relay, not all-to-all), so the
//! bytes an Envoy sends and receives per routed request of the deployment
//! are about `fanout` items, at any number of Envoys.
//!
//! Merging is idempotent and order-free. Directory entries and response
//! records are last-writer-wins registers (a stamp per prefix and region;
//! newest wins); loads are per origin, newest wins; usage reports are
//! events, taken once per (origin, sequence number). A lost, repeated or
//! reordered message changes only how fresh a view is.
//!
//! Message layout (little endian):
//! `magic "LGRX" ‖ version u8 ‖ 0 u8 ‖ layout u32 ‖ sender u64 ‖ sent ms u64
//! ‖ groups u16`, then per group (one origin Envoy)
//! `origin u64 ‖ has load u8 [‖ taken ms u64 ‖ demand f32 ‖ in-flight u32 ×
//! regions] ‖ items u16`, then per item `seq u32 ‖ kind u8 ‖ len u16 ‖ body`:
//! - kind 1, placement: `region u16 ‖ stamp u64 ‖ blocks u32 ‖ end tag u32 ‖
//!   n u8 ‖ checkpoint hash u64 × n` (1 ≤ n ≤ 64);
//! - kind 2, stored response: `region u16 ‖ recorded ms u64 ‖ id hash u64`;
//! - kind 3, usage report: the router's report as the probe's queue carries it;
//! - kind 4, session record: `region u16 ‖ recorded ms u64 ‖ session hash u64
//!   ‖ prompt blocks u32 ‖ last block hash u64`.
//!
//! A message is refused whole, never merged in part, when any of it is
//! malformed, beyond the size limit, or of another layout (region list,
//! hash seed, block size or protocol version differ: its hashes and region
//! numbers would mean other things here).

use std::collections::{BTreeMap, HashMap};

use crate::cache::directory::Directory;
use crate::cache::sessions::Sessions;
use crate::cache::stored_responses::ResponseMap;
use crate::config::Config;
use crate::learning::usage::UsageReport;
use crate::shared::flow::{Flow, Reply};

/// First bytes of every exchange message.
pub const MAGIC: &[u8; 4] = b"LGRX";
/// Protocol version, mixed into the layout id.
pub const VERSION: u8 = 1;
/// Tag of a router's note to its probe on the observations queue.
pub const NOTE_TAG: u8 = b'N';
/// Tag of a peer's message the exchange filter queued for the probe.
pub const PEER_TAG: u8 = b'X';
/// Checkpoint hashes one placement carries at most.
pub const MAX_HASHES: usize = 64;
/// Origins one Envoy keeps state for; past it the least recently heard
/// from is forgotten (and counted).
pub const MAX_PEERS: usize = 4096;

const HEAD: usize = 4 + 1 + 1 + 4 + 8 + 8 + 2;
const KIND_PLACEMENT: u8 = 1;
const KIND_RESPONSE: u8 = 2;
const KIND_USAGE: u8 = 3;
const KIND_SESSION: u8 = 4;

/// Layout id of a configuration: what must agree for two Envoys' hashes
/// and region numbers to mean the same.
pub fn layout(cfg: &Config) -> u32 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&[VERSION]);
    for r in &cfg.regions {
        h.update(r.name.as_bytes());
        h.update(&[0]);
    }
    h.update(&cfg.prefix.hash_seed.to_le_bytes());
    h.update(&cfg.prefix.block_bytes.to_le_bytes());
    h.digest() as u32
}

/// One Envoy's load as it measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub taken_ms: u64,
    /// Its arrivals counter (inference requests it has seen since start):
    /// counters, not rates, so that when a peer stops and its traffic moves
    /// to the others the deployment's sum goes on at the same rate.
    pub arrivals: u64,
    /// Its requests in flight per region.
    pub inflight: Vec<u32>,
}

/// What one item says.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// `region` served a prompt: it holds these checkpoints as of `stamp`;
    /// the prompt ended at `blocks` with a last block tagged `tag`.
    Placement {
        region: u16,
        stamp: u64,
        blocks: u32,
        tag: u32,
        hashes: Vec<u64>,
    },
    /// `region` stored the response whose id hashes to `hash`.
    Response { region: u16, at_ms: u64, hash: u64 },
    /// An engine's answer's usage, as the router reported it.
    Usage(Vec<u8>),
    /// `region` served the session whose key hashes to `hash` at `at_ms`,
    /// its prompt ending at `blocks` with a last block hashing to `last`.
    Session {
        region: u16,
        at_ms: u64,
        hash: u64,
        blocks: u32,
        last: u64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub seq: u32,
    pub body: Body,
}

/// Everything a message says about one origin Envoy.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Group {
    pub origin: u64,
    pub load: Option<Load>,
    pub items: Vec<Item>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub sender: u64,
    pub sent_ms: u64,
    pub groups: Vec<Group>,
}

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    TooLarge,
    Malformed(&'static str),
    ForeignLayout,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::TooLarge => write!(f, "larger than exchange.max_message_bytes"),
            Refusal::Malformed(why) => write!(f, "malformed: {why}"),
            Refusal::ForeignLayout => write!(
                f,
                "another layout (region list, prefix.hash_seed, prefix.block_bytes or protocol version differ)"
            ),
        }
    }
}

impl Body {
    fn kind(&self) -> u8 {
        match self {
            Body::Placement { .. } => KIND_PLACEMENT,
            Body::Response { .. } => KIND_RESPONSE,
            Body::Usage(_) => KIND_USAGE,
            Body::Session { .. } => KIND_SESSION,
        }
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Body::Placement {
                region,
                stamp,
                blocks,
                tag,
                hashes,
            } => {
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&stamp.to_le_bytes());
                out.extend_from_slice(&blocks.to_le_bytes());
                out.extend_from_slice(&tag.to_le_bytes());
                let n = hashes.len().min(MAX_HASHES);
                out.push(n as u8);
                for h in hashes.iter().take(n) {
                    out.extend_from_slice(&h.to_le_bytes());
                }
            }
            Body::Response {
                region,
                at_ms,
                hash,
            } => {
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&at_ms.to_le_bytes());
                out.extend_from_slice(&hash.to_le_bytes());
            }
            Body::Usage(b) => out.extend_from_slice(b),
            Body::Session {
                region,
                at_ms,
                hash,
                blocks,
                last,
            } => {
                out.extend_from_slice(&region.to_le_bytes());
                out.extend_from_slice(&at_ms.to_le_bytes());
                out.extend_from_slice(&hash.to_le_bytes());
                out.extend_from_slice(&blocks.to_le_bytes());
                out.extend_from_slice(&last.to_le_bytes());
            }
        }
    }

    fn encoded_len(&self) -> usize {
        match self {
            Body::Placement { hashes, .. } => 2 + 8 + 4 + 4 + 1 + 8 * hashes.len().min(MAX_HASHES),
            Body::Response { .. } => 2 + 8 + 8,
            Body::Usage(b) => b.len(),
            Body::Session { .. } => 2 + 8 + 8 + 4 + 8,
        }
    }

    fn decode(kind: u8, b: &[u8], regions: usize) -> Result<Body, Refusal> {
        let mut r = Reader { b, at: 0 };
        let region_ok = |x: u16| usize::from(x) < regions;
        let body = match kind {
            KIND_PLACEMENT => {
                let region = r.u16()?;
                let stamp = r.u64()?;
                let blocks = r.u32()?;
                let tag = r.u32()?;
                let n = usize::from(r.u8()?);
                if n == 0 || n > MAX_HASHES {
                    return Err(Refusal::Malformed(
                        "placement with 0 or over 64 checkpoints",
                    ));
                }
                let mut hashes = Vec::with_capacity(n);
                for _ in 0..n {
                    hashes.push(r.u64()?);
                }
                if !region_ok(region) {
                    return Err(Refusal::Malformed("region out of range"));
                }
                if stamp == 0 {
                    return Err(Refusal::Malformed("placement without a stamp"));
                }
                Body::Placement {
                    region,
                    stamp,
                    blocks,
                    tag,
                    hashes,
                }
            }
            KIND_RESPONSE => {
                let region = r.u16()?;
                let at_ms = r.u64()?;
                let hash = r.u64()?;
                if !region_ok(region) {
                    return Err(Refusal::Malformed("region out of range"));
                }
                Body::Response {
                    region,
                    at_ms,
                    hash,
                }
            }
            KIND_USAGE => {
                let rep = UsageReport::decode(b)
                    .ok_or(Refusal::Malformed("usage report of another layout"))?;
                if !region_ok(rep.region) {
                    return Err(Refusal::Malformed("region out of range"));
                }
                r.at = b.len();
                Body::Usage(b.to_vec())
            }
            KIND_SESSION => {
                let region = r.u16()?;
                let at_ms = r.u64()?;
                let hash = r.u64()?;
                let blocks = r.u32()?;
                let last = r.u64()?;
                if !region_ok(region) {
                    return Err(Refusal::Malformed("region out of range"));
                }
                Body::Session {
                    region,
                    at_ms,
                    hash,
                    blocks,
                    last,
                }
            }
            _ => return Err(Refusal::Malformed("unknown item kind")),
        };
        if r.at != b.len() {
            return Err(Refusal::Malformed("item longer than its fields"));
        }
        Ok(body)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Refusal> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or(Refusal::Malformed("truncated"))?;
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Refusal> {
        Ok(self.take(1)?.first().copied().unwrap_or(0))
    }
    fn u16(&mut self) -> Result<u16, Refusal> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    fn u32(&mut self) -> Result<u32, Refusal> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, Refusal> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

fn load_len(regions: usize) -> usize {
    8 + 8 + 4 * regions
}

impl Group {
    fn encoded_len(&self, regions: usize) -> usize {
        8 + 1
            + self.load.as_ref().map_or(0, |_| load_len(regions))
            + 2
            + self
                .items
                .iter()
                .map(|i| 7 + i.body.encoded_len())
                .sum::<usize>()
    }
}

impl Message {
    pub fn encode(&self, layout: u32, regions: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEAD + self
                .groups
                .iter()
                .map(|g| g.encoded_len(regions))
                .sum::<usize>(),
        );
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(0);
        out.extend_from_slice(&layout.to_le_bytes());
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&self.sent_ms.to_le_bytes());
        let groups = self.groups.len().min(usize::from(u16::MAX));
        out.extend_from_slice(&(groups as u16).to_le_bytes());
        for g in self.groups.iter().take(groups) {
            out.extend_from_slice(&g.origin.to_le_bytes());
            match &g.load {
                Some(l) => {
                    out.push(1);
                    out.extend_from_slice(&l.taken_ms.to_le_bytes());
                    out.extend_from_slice(&l.arrivals.to_le_bytes());
                    for i in 0..regions {
                        let v = l.inflight.get(i).copied().unwrap_or(0);
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
                None => out.push(0),
            }
            let items = g.items.len().min(usize::from(u16::MAX));
            out.extend_from_slice(&(items as u16).to_le_bytes());
            for it in g.items.iter().take(items) {
                out.extend_from_slice(&it.seq.to_le_bytes());
                out.push(it.body.kind());
                out.extend_from_slice(&(it.body.encoded_len() as u16).to_le_bytes());
                it.body.encode_into(&mut out);
            }
        }
        out
    }

    /// The whole message, checked: a message is taken whole or not at all.
    pub fn decode(b: &[u8], layout: u32, regions: usize, max: usize) -> Result<Message, Refusal> {
        if b.len() > max {
            return Err(Refusal::TooLarge);
        }
        let mut r = Reader { b, at: 0 };
        if r.take(4)? != MAGIC {
            return Err(Refusal::Malformed("not an exchange message"));
        }
        if r.u8()? != VERSION {
            return Err(Refusal::ForeignLayout);
        }
        if r.u8()? != 0 {
            return Err(Refusal::Malformed("reserved byte set"));
        }
        if r.u32()? != layout {
            return Err(Refusal::ForeignLayout);
        }
        let sender = r.u64()?;
        let sent_ms = r.u64()?;
        let ngroups = usize::from(r.u16()?);
        let mut groups = Vec::with_capacity(ngroups.min(b.len() / 11 + 1));
        for _ in 0..ngroups {
            let origin = r.u64()?;
            let load = match r.u8()? {
                0 => None,
                1 => {
                    let taken_ms = r.u64()?;
                    let arrivals = r.u64()?;
                    let mut inflight = Vec::with_capacity(regions);
                    for _ in 0..regions {
                        inflight.push(r.u32()?);
                    }
                    Some(Load {
                        taken_ms,
                        arrivals,
                        inflight,
                    })
                }
                _ => return Err(Refusal::Malformed("load flag not 0 or 1")),
            };
            let nitems = usize::from(r.u16()?);
            let mut items = Vec::with_capacity(nitems.min(b.len() / 7 + 1));
            for _ in 0..nitems {
                let seq = r.u32()?;
                let kind = r.u8()?;
                let len = usize::from(r.u16()?);
                let body = Body::decode(kind, r.take(len)?, regions)?;
                items.push(Item { seq, body });
            }
            groups.push(Group {
                origin,
                load,
                items,
            });
        }
        if r.at != b.len() {
            return Err(Refusal::Malformed("bytes after the last group"));
        }
        Ok(Message {
            sender,
            sent_ms,
            groups,
        })
    }
}

/// A router's note to its probe: the body of an item of its own.
pub fn encode_note(body: &Body) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + body.encoded_len());
    out.push(NOTE_TAG);
    out.push(body.kind());
    body.encode_into(&mut out);
    out
}

pub fn decode_note(b: &[u8], regions: usize) -> Option<Body> {
    let (&tag, rest) = b.split_first()?;
    let (&kind, rest) = rest.split_first()?;
    (tag == NOTE_TAG)
        .then(|| Body::decode(kind, rest, regions).ok())
        .flatten()
}

/// Which sequence numbers of one origin were taken: the highest and a
/// window of 128 below it (older ones count as taken: their news is old).
#[derive(Debug, Clone, Default)]
struct Seen {
    top: Option<u32>,
    /// Bit i: `top - i` taken.
    bits: u128,
}

impl Seen {
    /// Marks `seq`; true when it was new.
    fn take(&mut self, seq: u32) -> bool {
        let Some(top) = self.top else {
            self.top = Some(seq);
            self.bits = 1;
            return true;
        };
        if seq > top {
            let shift = seq - top;
            self.bits = if shift >= 128 { 0 } else { self.bits << shift };
            self.bits |= 1;
            self.top = Some(seq);
            return true;
        }
        let back = top - seq;
        if back >= 128 {
            return false;
        }
        let bit = 1u128 << back;
        let new = self.bits & bit == 0;
        self.bits |= bit;
        new
    }
}

/// Loads kept per origin: enough to find the first one taken after this
/// Envoy's last scrape of a region (a scrape every tick or faster).
const LOADS_KEPT: usize = 8;

#[derive(Debug, Clone, Default)]
struct Peer {
    /// Its latest loads, oldest first (by the origin's `taken_ms`).
    loads: std::collections::VecDeque<Load>,
    /// When this Envoy last heard of the origin (its clock).
    heard_ms: u64,
    /// When this Envoy last received a newer load of it (its clock).
    load_heard_ms: u64,
    seen: Seen,
}

/// What merging one message did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Merged {
    /// Items that were news (applied and relayed).
    pub fresh: u64,
    /// Items already taken.
    pub duplicate: u64,
    /// Loads newer than known.
    pub loads: u64,
    /// The message was this Envoy's own (the peers' cluster includes it).
    pub own: bool,
}

/// What to do with the news items of a merge; the probe applies them to
/// the directory, the response map and its calibration.
pub trait Apply {
    fn apply(&mut self, origin: u64, body: &Body);
}

/// One Envoy's side of the exchange: its identity, the peers it heard of,
/// and its outbox.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub origin: u64,
    regions: usize,
    layout: u32,
    max_bytes: usize,
    next_seq: u32,
    peers: HashMap<u64, Peer>,
    outbox: BTreeMap<u64, Group>,
    /// Encoded size of the outbox's items.
    outbox_bytes: usize,
    /// Items dropped because the outbox was full.
    pub dropped: u64,
    /// Origins forgotten past `MAX_PEERS`.
    pub forgotten: u64,
    /// The peers' arrivals this Envoy has learnt of, summed over their
    /// loads (a counter: what a stopped peer saw stays in it).
    pub peer_arrivals: u64,
    /// Whether the deployment is all-to-all (see [`plan`]): then nothing
    /// is relayed, every peer had it from its origin.
    pub direct: bool,
}

/// How one send goes out, with `live` peers heard from: `live + 2`
/// callouts through the peers' cluster's round robin (this Envoy, each
/// peer, and one for a peer not heard from yet) reach every host, so when
/// that fits in `fanout` the deployment is all-to-all and relaying would
/// only send every item again (each Envoy would receive `fanout` copies
/// instead of one). Beyond it, `fanout` callouts and each item relayed
/// once. Returns the callouts and whether the send is direct.
pub fn plan(fanout: usize, live: usize) -> (usize, bool) {
    let all = live.saturating_add(2);
    if all <= fanout {
        (all, true)
    } else {
        (fanout, false)
    }
}

impl Exchange {
    pub fn new(cfg: &Config, origin: u64) -> Exchange {
        Exchange {
            origin,
            regions: cfg.regions.len(),
            layout: layout(cfg),
            max_bytes: cfg.exchange.max_message_bytes as usize,
            next_seq: 1,
            peers: HashMap::new(),
            outbox: BTreeMap::new(),
            outbox_bytes: 0,
            dropped: 0,
            forgotten: 0,
            peer_arrivals: 0,
            direct: false,
        }
    }

    pub fn layout(&self) -> u32 {
        self.layout
    }

    /// Bytes the outbox may hold: the limit less the message's head and
    /// room for this Envoy's own group and load.
    fn budget(&self) -> usize {
        self.max_bytes
            .saturating_sub(HEAD + 11 + load_len(self.regions))
    }

    fn relay_load(&mut self, origin: u64, l: Load) {
        let budget = self.budget();
        let extra = match self.outbox.get(&origin) {
            Some(g) if g.load.is_some() => 0,
            Some(_) => load_len(self.regions),
            None => load_len(self.regions) + 11,
        };
        if self.outbox_bytes + extra > budget {
            self.dropped += 1;
            return;
        }
        self.outbox_bytes += extra;
        self.outbox
            .entry(origin)
            .or_insert_with(|| Group {
                origin,
                ..Group::default()
            })
            .load = Some(l);
    }

    fn push(&mut self, origin: u64, item: Item) {
        let len = 7 + item.body.encoded_len();
        let budget = self.budget();
        let head = if self.outbox.contains_key(&origin) {
            0
        } else {
            11
        };
        if self.outbox_bytes + len + head > budget {
            self.dropped += 1;
            return;
        }
        self.outbox
            .entry(origin)
            .or_insert_with(|| Group {
                origin,
                ..Group::default()
            })
            .items
            .push(item);
        self.outbox_bytes += len + head;
    }

    /// News of this Envoy's own.
    pub fn note(&mut self, body: Body) {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1).max(1);
        self.push(self.origin, Item { seq, body });
    }

    /// Merges a peer's message at `now_ms` (this Envoy's clock); news goes
    /// to `apply` and, unless the deployment is all-to-all, into the
    /// outbox, to be relayed once.
    pub fn merge(&mut self, msg: Message, now_ms: u64, apply: &mut dyn Apply) -> Merged {
        let mut out = Merged::default();
        if msg.sender == self.origin {
            out.own = true;
            return out;
        }
        for g in msg.groups {
            if g.origin == self.origin {
                continue;
            }
            if !self.peers.contains_key(&g.origin) && self.peers.len() >= MAX_PEERS {
                self.forget_one();
            }
            let peer = self.peers.entry(g.origin).or_default();
            peer.heard_ms = now_ms;
            let mut relay_load = None;
            if let Some(l) = g.load {
                if peer.loads.back().is_none_or(|k| l.taken_ms > k.taken_ms) {
                    // What it saw since its last load we had (none from
                    // its first: that is its past, not new demand).
                    if let Some(k) = peer.loads.back() {
                        self.peer_arrivals += l.arrivals.saturating_sub(k.arrivals);
                    }
                    if peer.loads.len() >= LOADS_KEPT {
                        peer.loads.pop_front();
                    }
                    peer.loads.push_back(l.clone());
                    peer.load_heard_ms = now_ms;
                    relay_load = Some(l);
                    out.loads += 1;
                }
            }
            let mut fresh = Vec::new();
            for it in g.items {
                if peer.seen.take(it.seq) {
                    fresh.push(it);
                } else {
                    out.duplicate += 1;
                }
            }
            for it in fresh {
                apply.apply(g.origin, &it.body);
                out.fresh += 1;
                if !self.direct {
                    self.push(g.origin, it);
                }
            }
            if let Some(l) = relay_load.filter(|_| !self.direct) {
                self.relay_load(g.origin, l);
            }
        }
        out
    }

    fn forget_one(&mut self) {
        if let Some(oldest) = self
            .peers
            .iter()
            .min_by_key(|(_, p)| p.heard_ms)
            .map(|(o, _)| *o)
        {
            self.peers.remove(&oldest);
            self.forgotten += 1;
        }
    }

    /// The outbox as one message carrying `own` (this Envoy's load now),
    /// and the outbox emptied.
    pub fn take_message(&mut self, own: Load, now_ms: u64) -> Vec<u8> {
        let mut groups: Vec<Group> = std::mem::take(&mut self.outbox).into_values().collect();
        self.outbox_bytes = 0;
        match groups.iter_mut().find(|g| g.origin == self.origin) {
            Some(g) => g.load = Some(own),
            None => groups.push(Group {
                origin: self.origin,
                load: Some(own),
                items: Vec::new(),
            }),
        }
        Message {
            sender: self.origin,
            sent_ms: now_ms,
            groups,
        }
        .encode(self.layout, self.regions)
    }

    /// Peers whose load was renewed within `fresh_ms`: their loads.
    fn live(
        &self,
        now_ms: u64,
        fresh_ms: u64,
    ) -> impl Iterator<Item = &std::collections::VecDeque<Load>> {
        self.peers
            .values()
            .filter(move |p| {
                !p.loads.is_empty() && now_ms.saturating_sub(p.load_heard_ms) <= fresh_ms
            })
            .map(|p| &p.loads)
    }

    /// Peers with a live load.
    pub fn live_peers(&self, now_ms: u64, fresh_ms: u64) -> usize {
        self.live(now_ms, fresh_ms).count()
    }

    /// The live peers' requests in flight per region.
    pub fn peer_inflight(&self, now_ms: u64, fresh_ms: u64) -> Vec<f64> {
        let mut out = vec![0.0; self.regions];
        for l in self.live(now_ms, fresh_ms).filter_map(|l| l.back()) {
            for (o, v) in out.iter_mut().zip(&l.inflight) {
                *o += f64::from(*v);
            }
        }
        out
    }

    /// Per region: how many more requests the live peers have in flight
    /// now than when this Envoy's scrape of it was answered
    /// (`scraped_ms[r]`), which counted theirs that had reached the engine.
    /// A peer's count then is its first load taken at or after the scrape:
    /// an older one would count twice what it sent between that load and
    /// the scrape. A peer with no load since the scrape adds nothing yet
    /// (an under-count, at most one message interval of its requests).
    pub fn peer_inflight_since(
        &self,
        scraped_ms: &[Option<u64>],
        now_ms: u64,
        fresh_ms: u64,
    ) -> Vec<f64> {
        let mut out = vec![0.0; self.regions];
        for loads in self.live(now_ms, fresh_ms) {
            let Some(latest) = loads.back() else {
                continue;
            };
            for (r, o) in out.iter_mut().enumerate() {
                let Some(at) = scraped_ms.get(r).copied().flatten() else {
                    continue;
                };
                if let Some(base) = loads.iter().find(|l| l.taken_ms >= at) {
                    let v = |l: &Load| f64::from(l.inflight.get(r).copied().unwrap_or(0));
                    *o += v(latest) - v(base);
                }
            }
        }
        out
    }
}

/// The `exchange` filter, on the peers' listener: a `POST` to
/// `exchange.path` is a peer's message. It is checked whole, then queued
/// for this Envoy's probe (which merges it); the peer is answered 204, or
/// 400 / 413 with the reason and the refusal counted. Any other request
/// goes on to the listener's routes (which should answer 404).
#[derive(Debug, Default)]
pub struct ExchangeStream {
    mine: bool,
}

impl ExchangeStream {
    pub fn new() -> ExchangeStream {
        ExchangeStream::default()
    }

    pub fn wants_body(&self) -> bool {
        self.mine
    }

    pub fn on_request_headers(
        &mut self,
        cfg: &Config,
        host: &mut dyn crate::shared::host_api::StreamHost,
        end_of_stream: bool,
    ) -> Flow {
        let method = host.request_header(":method");
        let path = host.request_header(":path");
        let path = path.as_deref().map(crate::request::openai::strip_path);
        if method.as_deref() != Some("POST") || path != Some(cfg.exchange.path.as_str()) {
            return Flow::Continue;
        }
        self.mine = true;
        let declared = host
            .request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > u64::from(cfg.exchange.max_message_bytes)) {
            return refuse(host, 413, Refusal::TooLarge);
        }
        if end_of_stream {
            return refuse(host, 400, Refusal::Malformed("no body"));
        }
        Flow::Pause
    }

    /// The body so far (`size` bytes), complete when `end_of_stream`.
    pub fn on_request_body(
        &mut self,
        cfg: &Config,
        host: &mut dyn crate::shared::host_api::StreamHost,
        size: usize,
        body: Option<&[u8]>,
    ) -> Flow {
        if !self.mine {
            return Flow::Continue;
        }
        if size > cfg.exchange.max_message_bytes as usize {
            self.mine = false;
            return refuse(host, 413, Refusal::TooLarge);
        }
        let Some(body) = body else {
            return Flow::Pause;
        };
        self.mine = false;
        let max = cfg.exchange.max_message_bytes as usize;
        match Message::decode(body, layout(cfg), cfg.regions.len(), max) {
            Ok(msg) => {
                // Placements and stored responses go to shared data now,
                // not at the probe's next tick: a peer's news is routable
                // within its transit. Merging is newest-wins per entry, so
                // the repeats a relay brings change nothing.
                let maps = SharedMaps::new(cfg);
                for item in msg.groups.iter().flat_map(|g| &g.items) {
                    maps.apply(&mut *host, cfg, &item.body);
                }
                let mut queued = Vec::with_capacity(body.len() + 1);
                queued.push(PEER_TAG);
                queued.extend_from_slice(body);
                host.enqueue(crate::shared::names::OBSERVATIONS_QUEUE, &queued);
                Flow::Reply(Reply {
                    status: 204,
                    headers: Vec::new(),
                    body: Vec::new(),
                })
            }
            Err(e) => refuse(host, if e == Refusal::TooLarge { 413 } else { 400 }, e),
        }
    }
}

/// This Envoy's shared-data maps a peer's news goes to.
pub struct SharedMaps {
    pub dir: Directory,
    pub responses: ResponseMap,
    pub sessions: Sessions,
}

impl SharedMaps {
    pub fn new(cfg: &Config) -> SharedMaps {
        SharedMaps {
            dir: Directory::new(cfg),
            responses: ResponseMap::new(cfg),
            sessions: Sessions::new(cfg),
        }
    }

    /// A placement, stored response or session record, merged newest-wins
    /// (a usage report is the probe's).
    pub fn apply(
        &self,
        store: &mut dyn crate::shared::store::SharedStore,
        cfg: &Config,
        body: &Body,
    ) {
        match body {
            Body::Placement {
                region,
                stamp,
                blocks,
                tag,
                hashes,
            } => {
                self.dir.merge(
                    store,
                    hashes,
                    usize::from(*region),
                    *stamp,
                    (*blocks, u64::from(*tag)),
                );
            }
            Body::Response {
                region,
                at_ms,
                hash,
            } => {
                if let Some(r) = cfg.regions.get(usize::from(*region)) {
                    self.responses.merge(store, *hash, &r.name, *at_ms);
                }
            }
            Body::Session {
                region,
                at_ms,
                hash,
                blocks,
                last,
            } => {
                self.sessions
                    .merge(store, *hash, usize::from(*region), *at_ms, (*blocks, *last));
            }
            Body::Usage(_) => {}
        }
    }
}

fn refuse(host: &mut dyn crate::shared::host_api::StreamHost, status: u32, why: Refusal) -> Flow {
    use crate::shared::names::{Global, Stat};
    host.count(Stat::Global(Global::ExchangeRefused), 1);
    host.log(
        crate::shared::host_api::Level::Warn,
        &format!("llm-geo-router exchange: a peer message refused ({status}): {why}"),
    );
    Flow::Reply(Reply {
        status,
        headers: vec![("content-type", "text/plain".to_string())],
        body: format!("llm-geo-router exchange: refused: {why}\n").into_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[{"name":"a","cluster":"ca","capacity_rps":5},
                           {"name":"b","cluster":"cb","capacity_rps":5}],
                 "exchange":{"cluster":"peers"}}"#,
        )
        .unwrap()
    }

    #[derive(Default)]
    struct Log(Vec<(u64, Body)>);
    impl Apply for Log {
        fn apply(&mut self, origin: u64, body: &Body) {
            self.0.push((origin, body.clone()));
        }
    }

    fn load(t: u64, a: u32, arrivals: u64) -> Load {
        Load {
            taken_ms: t,
            arrivals,
            inflight: vec![a, 0],
        }
    }

    fn placement(stamp: u64) -> Body {
        Body::Placement {
            region: 1,
            stamp,
            blocks: 9,
            tag: 7,
            hashes: vec![11, 22, 33],
        }
    }

    #[test]
    fn a_message_round_trips_and_any_damage_refuses_it_whole() {
        let c = cfg();
        let mut x = Exchange::new(&c, 1);
        x.note(placement(100));
        x.note(Body::Response {
            region: 0,
            at_ms: 5,
            hash: 99,
        });
        let bytes = x.take_message(load(50, 3, 25), 60);
        let max = c.exchange.max_message_bytes as usize;
        let m = Message::decode(&bytes, x.layout(), 2, max).unwrap();
        assert_eq!(m.sender, 1);
        assert_eq!(m.groups.len(), 1);
        assert_eq!(m.groups[0].items.len(), 2);
        assert_eq!(m.groups[0].items[0].body, placement(100));
        assert_eq!(m.groups[0].load, Some(load(50, 3, 25)));
        // Every truncation and every single-byte change is refused or
        // decodes to a message the same size (never a panic).
        for n in 0..bytes.len() {
            assert!(
                Message::decode(&bytes[..n], x.layout(), 2, max).is_err(),
                "{n}"
            );
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xff;
            let _ = Message::decode(&b, x.layout(), 2, max);
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Message::decode(&longer, x.layout(), 2, max).is_err());
        assert_eq!(
            Message::decode(&bytes, x.layout() ^ 1, 2, max),
            Err(Refusal::ForeignLayout)
        );
        assert_eq!(
            Message::decode(&bytes, x.layout(), 2, 10),
            Err(Refusal::TooLarge)
        );
        // Another region list: another layout.
        let mut other = c.clone();
        other.regions.swap(0, 1);
        assert_ne!(layout(&other), layout(&c));
    }

    #[test]
    fn news_is_taken_once_and_relayed_once_in_any_order() {
        let c = cfg();
        let mut a = Exchange::new(&c, 1);
        let mut b = Exchange::new(&c, 2);
        let mut relay = Exchange::new(&c, 3);
        a.note(placement(100));
        a.note(placement(200));
        let m1 = a.take_message(load(10, 1, 10), 10);
        a.note(placement(300));
        let m2 = a.take_message(load(20, 2, 25), 20);
        let dec = |b: &[u8]| Message::decode(b, layout(&c), 2, 1 << 20).unwrap();
        // b gets m2 before m1, and m1 twice.
        let mut log = Log::default();
        let r2 = b.merge(dec(&m2), 30, &mut log);
        let r1 = b.merge(dec(&m1), 31, &mut log);
        let again = b.merge(dec(&m1), 32, &mut log);
        assert_eq!(
            (r2.fresh, r1.fresh, again.fresh, again.duplicate),
            (1, 2, 0, 2)
        );
        assert_eq!(log.0.len(), 3);
        // The older load does not replace the newer.
        assert_eq!(b.peer_inflight(32, 1000), vec![2.0, 0.0]);
        assert_eq!(r1.loads, 0);
        // b relays what was news to it, once: a third Envoy learns all of
        // a's news from b, and a's own messages are ignored by a.
        let relayed = b.take_message(load(33, 0, 5), 33);
        let mut log3 = Log::default();
        let r = relay.merge(dec(&relayed), 40, &mut log3);
        assert_eq!(r.fresh, 3);
        assert_eq!(relay.live_peers(40, 1000), 2);
        // Arrivals count from each peer's second load on (its first is its
        // past): b took a's 25 first and the older 10 never, so none yet.
        assert_eq!(b.peer_arrivals, 0);
        let nothing_new = b.take_message(load(34, 0, 9), 34);
        assert_eq!(dec(&nothing_new).groups.len(), 1, "only b's own load");
        // b's counter went 5 -> 9: the relay learns 4 requests of demand,
        // and keeps them when b goes silent (a counter, not a rate).
        relay.merge(dec(&nothing_new), 41, &mut log3);
        assert_eq!(relay.peer_arrivals, 4);
        let m3 = a.take_message(load(60, 0, 40), 60);
        b.merge(dec(&m3), 61, &mut log);
        assert_eq!(b.peer_arrivals, 15);
        let mut log_a = Log::default();
        assert!(a.merge(dec(&m1), 50, &mut log_a).own);
        let back = relay.take_message(load(41, 0, 0), 41);
        let r = a.merge(dec(&back), 50, &mut log_a);
        assert_eq!(r.fresh, 0, "a's own items come back to it and are skipped");
        // A silent peer's load stops counting.
        assert_eq!(relay.peer_inflight(40 + 5000, 1000), vec![0.0, 0.0]);
    }

    #[test]
    fn a_deployment_that_fits_the_fanout_is_all_to_all_and_relays_nothing() {
        // Each peer known, itself, and one not heard from yet: while that
        // fits in the fan-out every host is reached directly.
        assert_eq!(plan(3, 0), (2, true));
        assert_eq!(plan(3, 1), (3, true));
        assert_eq!(plan(3, 2), (3, false));
        assert_eq!(plan(16, 11), (13, true));
        assert_eq!(plan(16, 14), (16, true));
        assert_eq!(plan(16, 47), (16, false));
        let c = cfg();
        let mut a = Exchange::new(&c, 1);
        let mut b = Exchange::new(&c, 2);
        a.note(placement(100));
        let m = a.take_message(load(10, 1, 10), 10);
        let dec = |b: &[u8]| Message::decode(b, layout(&c), 2, 1 << 20).unwrap();
        b.direct = true;
        let mut log = Log::default();
        assert_eq!(b.merge(dec(&m), 20, &mut log).fresh, 1);
        assert_eq!(log.0.len(), 1, "applied");
        let sent = dec(&b.take_message(load(21, 0, 0), 21));
        assert_eq!(sent.groups.len(), 1, "only b's own load: nothing relayed");
        assert_eq!(sent.groups[0].origin, 2);
        // The same message to an Envoy of a deployment too large for its
        // fan-out is relayed once, load and item.
        let mut c3 = Exchange::new(&c, 3);
        c3.merge(dec(&m), 20, &mut log);
        let relayed = dec(&c3.take_message(load(21, 0, 0), 21));
        let from_a = relayed.groups.iter().find(|g| g.origin == 1).unwrap();
        assert_eq!((from_a.items.len(), from_a.load.is_some()), (1, true));
    }

    #[test]
    fn a_peers_requests_since_a_scrape_count_from_its_first_load_after_it() {
        let c = cfg();
        let mut me = Exchange::new(&c, 1);
        let mut peer = Exchange::new(&c, 2);
        let dec = |b: &[u8]| Message::decode(b, layout(&c), 2, 1 << 20).unwrap();
        let mut log = Log::default();
        for (t, n) in [(1_000, 5), (2_000, 8), (3_000, 6)] {
            let m = peer.take_message(load(t, n, 10), t);
            me.merge(dec(&m), t + 10, &mut log);
        }
        // Scraped at 1500: the engine counted the peer's requests then;
        // its first load after is 8 (at 2000), the latest 6: 2 fewer.
        assert_eq!(
            me.peer_inflight_since(&[Some(1_500), None], 3_010, 5_000),
            vec![-2.0, 0.0]
        );
        // Scraped after its latest load: nothing known since.
        assert_eq!(
            me.peer_inflight_since(&[Some(3_001), None], 3_010, 5_000)[0],
            0.0
        );
        // A load older than the scrape is never the base: that would count
        // twice what the peer sent between it and the scrape.
        assert_eq!(
            me.peer_inflight_since(&[Some(999), None], 3_010, 5_000)[0],
            1.0
        );
        // A silent peer adds nothing.
        assert_eq!(
            me.peer_inflight_since(&[Some(1_500), None], 9_000, 5_000)[0],
            0.0
        );
    }

    #[test]
    fn the_outbox_is_bounded_and_says_what_it_dropped() {
        let mut c = cfg();
        c.exchange.max_message_bytes = 1024;
        let mut x = Exchange::new(&c, 1);
        for i in 0..100 {
            x.note(placement(100 + i));
        }
        assert!(x.dropped > 0);
        let m = x.take_message(load(1, 0, 0), 1);
        assert!(m.len() <= 1024, "{}", m.len());
        assert!(Message::decode(&m, x.layout(), 2, 1024).is_ok());
    }

    #[test]
    fn the_seen_window_takes_each_sequence_number_once() {
        let mut s = Seen::default();
        assert!(s.take(10));
        assert!(!s.take(10));
        assert!(s.take(8));
        assert!(s.take(200));
        assert!(!s.take(8), "far behind the window: old news");
        assert!(s.take(199));
        assert!(!s.take(199));
    }

    #[test]
    fn notes_round_trip() {
        let b = placement(5);
        assert_eq!(decode_note(&encode_note(&b), 2), Some(b));
        let s = Body::Session {
            region: 1,
            at_ms: 9,
            hash: 77,
            blocks: 12,
            last: 5,
        };
        assert_eq!(decode_note(&encode_note(&s), 2), Some(s.clone()));
        assert_eq!(decode_note(&encode_note(&s), 1), None, "region 1 of 1");
        assert_eq!(
            decode_note(&encode_note(&placement(5)), 1),
            None,
            "region 1 of 1"
        );
        assert_eq!(decode_note(b"V123", 2), None);
    }
}
