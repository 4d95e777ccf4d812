//! The exchange's message: its items, their encoding in the layout the
//! `exchange` module describes, and the whole-message check that refuses a
//! malformed, oversized or foreign message before any of it is merged.

use crate::config::Config;
use crate::learning::usage::UsageReport;

/// First bytes of every exchange message.
pub const MAGIC: &[u8; 4] = b"LGRX";
/// Protocol version, mixed into the layout id. 2: the trailing checksum.
pub const VERSION: u8 = 2;
/// Tag of a router's note to its probe on the observations queue.
pub const NOTE_TAG: u8 = b'N';
/// Tag of a peer's message the exchange filter queued for the probe.
pub const PEER_TAG: u8 = b'X';
/// Checkpoint hashes one placement carries at most.
pub const MAX_HASHES: usize = 64;

/// The fixed head and the trailing checksum: a message's size beyond its
/// groups.
pub(crate) const HEAD: usize = 4 + 1 + 1 + 4 + 8 + 8 + 2 + CHECKSUM;
/// The trailing checksum's bytes: XXH3-64 of every byte before it.
const CHECKSUM: usize = 8;
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
    /// Its checksum does not match its bytes: damaged on the way.
    Damaged,
    ForeignLayout,
    /// This Envoy could not read the body it buffered (not the peer's fault).
    Unreadable,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::TooLarge => write!(f, "larger than exchange.max_message_bytes"),
            Refusal::Malformed(why) => write!(f, "malformed: {why}"),
            Refusal::Damaged => write!(f, "damaged: its checksum does not match its bytes"),
            Refusal::ForeignLayout => write!(
                f,
                "another layout (region list, prefix.hash_seed, prefix.block_bytes or protocol version differ)"
            ),
            Refusal::Unreadable => write!(f, "this Envoy could not read the body"),
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

    pub(crate) fn encoded_len(&self) -> usize {
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

pub(crate) fn load_len(regions: usize) -> usize {
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
        seal(out)
    }

    /// The whole message, checked: a message is taken whole or not at all.
    pub fn decode(b: &[u8], layout: u32, regions: usize, max: usize) -> Result<Message, Refusal> {
        if b.len() > max {
            return Err(Refusal::TooLarge);
        }
        let mut r = Reader { b, at: 0 };
        // The head first: another protocol or layout is said as such, not
        // as damage.
        if b.len() < HEAD {
            return Err(Refusal::Malformed("shorter than a message's head"));
        }
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
        // Then every byte, before any of them is read as news: a flipped
        // bit anywhere refuses the message whole.
        let (b, sum) = b.split_at(b.len() - CHECKSUM);
        if xxhash_rust::xxh3::xxh3_64(b).to_le_bytes() != sum {
            return Err(Refusal::Damaged);
        }
        let mut r = Reader { b, at: r.at };
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

/// A message's bytes up to its groups' end, with the checksum appended:
/// what [`Message::decode`] checks first.
pub fn seal(mut bytes: Vec<u8>) -> Vec<u8> {
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
    bytes.extend_from_slice(&sum.to_le_bytes());
    bytes
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cache::exchange::peers::Exchange;

    pub(crate) fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[{"name":"a","cluster":"ca","capacity_rps":5},
                           {"name":"b","cluster":"cb","capacity_rps":5}],
                 "exchange":{"cluster":"peers"}}"#,
        )
        .unwrap()
    }

    pub(crate) fn load(t: u64, a: u32, arrivals: u64) -> Load {
        Load {
            taken_ms: t,
            arrivals,
            inflight: vec![a, 0],
        }
    }

    pub(crate) fn placement(stamp: u64) -> Body {
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
        // Every truncation is refused.
        for n in 0..bytes.len() {
            assert!(
                Message::decode(&bytes[..n], x.layout(), 2, max).is_err(),
                "{n}"
            );
        }
        // Every flipped bit is refused: in the head as what it breaks (the
        // magic, the version or the layout), anywhere else as damage, the
        // checksum's own bytes included.
        let head = 4 + 1 + 1 + 4;
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                let got = Message::decode(&b, x.layout(), 2, max);
                if i >= head {
                    assert_eq!(got, Err(Refusal::Damaged), "byte {i} bit {bit}");
                } else {
                    assert!(got.is_err(), "byte {i} bit {bit}");
                }
            }
        }
        // A payload byte changed and the checksum made again: what the
        // checksum alone stood between (the merge would take it).
        let mut forged = bytes[..bytes.len() - 8].to_vec();
        let at = forged.len() - 1;
        forged[at] ^= 1;
        let sum = xxhash_rust::xxh3::xxh3_64(&forged);
        forged.extend_from_slice(&sum.to_le_bytes());
        let m2 = Message::decode(&forged, x.layout(), 2, max).unwrap();
        assert_ne!(m2, m, "the flipped byte is news the merge would take");
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
