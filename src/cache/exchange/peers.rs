//! One Envoy's side of the exchange (`Exchange`): the peers it heard of and
//! their loads, each peer's news merged once, and the outbox that relays it.

use std::collections::{BTreeMap, HashMap};

use crate::cache::exchange::message::{layout, load_len, Body, Group, Item, Load, Message, HEAD};
use crate::config::Config;

/// Origins one Envoy keeps state for; past it the least recently heard
/// from is forgotten (and counted).
pub const MAX_PEERS: usize = 4096;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::exchange::message::tests::{cfg, load, placement};

    #[derive(Default)]
    struct Log(Vec<(u64, Body)>);
    impl Apply for Log {
        fn apply(&mut self, origin: u64, body: &Body) {
            self.0.push((origin, body.clone()));
        }
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
}
