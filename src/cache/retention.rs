//! What a region's engine is believed to keep of what it served: the rules
//! (`Keep`: TTL, horizon, or a modelled LRU cache, `Lru`), since its last
//! restart (`Retention`), and the intake clock an LRU ages by, with this
//! Envoy's recent prefills placed in it (`RecentIntake`).

use crate::shared::names::INTAKE_KEY;
use crate::shared::store::{SetOutcome, SharedStore};

/// A region whose engine's cache is modelled restamps every checkpoint of a
/// prompt it serves once what went in since the prompt's oldest held stamp
/// passes this share of its free capacity: an engine's hit refreshes every
/// block it reuses. Until then the stamps are at most that much older than
/// the truth (an under-estimate, the safe side), and a burst of hits on one
/// prefix writes only what is new.
const REFRESH_SHARE: f64 = 1.0 / 32.0;

/// What a region's engine is believed to keep of what it served.
#[derive(Debug, Clone, Copy, Default)]
pub enum Keep<'a> {
    /// Everything, for the directory's TTL (nothing known of its cache).
    #[default]
    Ttl,
    /// Entries younger than this many ms (the learnt horizon,
    /// `directory.cache_horizon`).
    Horizon(u64),
    /// An LRU prefix cache of known capacity (`Lru::holds`).
    Lru(Lru<'a>),
}

/// What a region's engine is believed to keep: its rule, and nothing
/// stamped before `since_ms`, when the probe last saw it restart (its cache
/// was empty then: `fleet::restart`). Whoever wrote an entry, this Envoy or
/// a peer through the exchange, its stamp is when the region served it, so
/// one check at the read covers both.
#[derive(Debug, Clone, Copy, Default)]
pub struct Retention<'a> {
    pub keep: Keep<'a>,
    /// Unix ms; 0: no restart seen.
    pub since_ms: u64,
}

impl<'a> From<Keep<'a>> for Retention<'a> {
    fn from(keep: Keep<'a>) -> Self {
        Retention { keep, since_ms: 0 }
    }
}

impl Retention<'_> {
    /// Served at `ts`, after the engine's last restart.
    pub fn after_restart(&self, ts: u64) -> bool {
        ts >= self.since_ms
    }

    /// Whether an entry of `blocks` blocks stamped `ts` is believed held
    /// at `now_ms` (the TTL aside).
    pub fn holds(&self, ts: u64, blocks: u32, now_ms: u64) -> bool {
        self.after_restart(ts) && self.keep.holds(ts, blocks, now_ms)
    }

    /// Of a prompt of `blocks` blocks served at `ts`, the blocks believed
    /// held at `now_ms`: all or none, except in an LRU cache, which frees
    /// a prompt tail first and so keeps the head of it that fits.
    pub fn blocks_held(&self, ts: u64, blocks: u32, now_ms: u64) -> u32 {
        match self.keep {
            _ if !self.after_restart(ts) => 0,
            Keep::Lru(lru) => blocks.min(lru.blocks_fitting(ts)),
            k if k.holds(ts, blocks, now_ms) => blocks,
            _ => 0,
        }
    }
}

/// A least-recently-used prefix cache in the engine's tokens, as vLLM's
/// block pool and SGLang's radix tree keep one: what a request used is
/// freed when it ends, deepest block first, and new blocks take the least
/// recently freed ones. A prefix of `t` tokens last used when the engine's
/// intake clock read `k` is therefore still whole while
/// `(clock − k) + t <= free`: everything freed before it goes first, then
/// its own blocks from the tail. It is prefix-closed (a shorter prefix is
/// at least as recent and ends earlier), so the lookup's search holds.
#[derive(Debug, Clone, Copy)]
pub struct Lru<'a> {
    /// Tokens the cache holds (its capacity, per engine replica).
    pub free_tokens: f64,
    /// Engine tokens per directory block (tokens per byte × block bytes).
    pub tokens_per_block: f64,
    /// The engine's intake: (ms, tokens taken in so far), ascending
    /// (`RecentIntake::merged`).
    pub clock: &'a [(u64, f64)],
}

impl Lru<'_> {
    /// Tokens the engine took in after `ms` (between two clock points by
    /// interpolation; before the first point, at least all since it).
    pub fn intake_since(&self, ms: u64) -> f64 {
        let Some(&(_, total)) = self.clock.last() else {
            return 0.0;
        };
        let i = self.clock.partition_point(|(t, _)| *t <= ms);
        let at = match (
            i.checked_sub(1).and_then(|j| self.clock.get(j)),
            self.clock.get(i),
        ) {
            (None, Some(&(_, first))) => first,
            (Some(&(t0, c0)), Some(&(t1, c1))) if t1 > t0 => {
                c0 + (c1 - c0) * (ms - t0) as f64 / (t1 - t0) as f64
            }
            (Some(&(_, c0)), _) => c0,
            (None, None) => total,
        };
        (total - at).max(0.0)
    }

    /// The longest prefix, in blocks, of one last used at `ms` that is
    /// still whole.
    pub fn blocks_fitting(&self, ms: u64) -> u32 {
        let room = self.free_tokens - self.intake_since(ms);
        if room <= 0.0 || self.tokens_per_block <= 0.0 {
            return 0;
        }
        (room / self.tokens_per_block)
            .floor()
            .min(f64::from(u32::MAX)) as u32
    }

    /// Whether a prefix of `blocks` blocks, last used at `ms`, is whole.
    pub fn holds(&self, ms: u64, blocks: u32) -> bool {
        self.intake_since(ms) + f64::from(blocks) * self.tokens_per_block <= self.free_tokens
    }
}

impl Keep<'_> {
    /// Whether an entry of `blocks` blocks stamped `ts` is believed held
    /// at `now_ms` (the TTL aside).
    pub fn holds(&self, ts: u64, blocks: u32, now_ms: u64) -> bool {
        match self {
            Keep::Ttl => true,
            Keep::Horizon(h) => now_ms.saturating_sub(ts) < *h,
            Keep::Lru(lru) => lru.holds(ts, blocks),
        }
    }

    /// Whether a prefix last stamped `ts` is old enough to restamp whole.
    pub(crate) fn stale(&self, ts: u64, now_ms: u64, ttl_ms: u64) -> bool {
        let age = now_ms.saturating_sub(ts);
        match self {
            Keep::Lru(lru) => {
                age > ttl_ms / 2 || lru.intake_since(ts) > REFRESH_SHARE * lru.free_tokens
            }
            _ => age > ttl_ms / 2,
        }
    }
}

/// This Envoy's latest prefills, one shared-data value for all workers:
/// per answer started, the region, when it was routed (the engine counts
/// its intake from then) and when its answer started (its directory
/// stamp), and the prompt tokens its engine had to take in. The snapshot's
/// intake clock learns them only at the next scrape and usage report, up to
/// a probe tick later; a client that sends its next request at once would
/// otherwise be told the cache still holds what that prefill evicted.
/// Records are `region u16 ‖ routed ms u64 ‖ started ms u64 ‖ tokens u32`,
/// the newest [`RecentIntake::CAP`] by routing time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecentIntake {
    /// (region, routed ms, started ms, tokens), oldest routed first.
    pub records: Vec<(u16, u64, u64, u32)>,
}

impl RecentIntake {
    pub const CAP: usize = 64;
    const REC: usize = 22;

    /// Reads the ring; a value of another layout reads as empty.
    pub fn read(store: &mut dyn SharedStore) -> (RecentIntake, Option<u32>) {
        match store.get(INTAKE_KEY) {
            Ok(Some((v, cas))) => (Self::decode(&v), Some(cas)),
            _ => (RecentIntake::default(), None),
        }
    }

    fn decode(v: &[u8]) -> RecentIntake {
        if v.len() % Self::REC != 0 || v.len() > Self::CAP * Self::REC {
            return RecentIntake::default();
        }
        let u64_at = |c: &[u8], at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(c.get(at..at + 8)?.try_into().ok()?))
        };
        let records = v
            .chunks_exact(Self::REC)
            .filter_map(|c| {
                Some((
                    u16::from_le_bytes(c.get(0..2)?.try_into().ok()?),
                    u64_at(c, 2)?,
                    u64_at(c, 10)?,
                    u32::from_le_bytes(c.get(18..22)?.try_into().ok()?),
                ))
            })
            .collect();
        RecentIntake { records }
    }

    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.records.len() * Self::REC);
        for (r, routed, started, t) in &self.records {
            b.extend_from_slice(&r.to_le_bytes());
            b.extend_from_slice(&routed.to_le_bytes());
            b.extend_from_slice(&started.to_le_bytes());
            b.extend_from_slice(&t.to_le_bytes());
        }
        b
    }

    /// Adds one prefill (read-modify-write under CAS, one retry; a lost
    /// race loses only this record's freshness). Returns the calls made.
    pub fn note(
        store: &mut dyn SharedStore,
        region: u16,
        routed_ms: u64,
        started_ms: u64,
        tokens: u32,
    ) -> u32 {
        let mut calls = 0;
        for _ in 0..2 {
            calls += 2;
            let (mut ring, cas) = Self::read(store);
            let at = ring.records.partition_point(|(_, t, _, _)| *t <= routed_ms);
            ring.records
                .insert(at, (region, routed_ms, started_ms, tokens));
            if ring.records.len() > Self::CAP {
                ring.records.remove(0);
            }
            match store.set(INTAKE_KEY, &ring.encode(), cas) {
                Ok(SetOutcome::CasMismatch) => continue,
                _ => break,
            }
        }
        calls
    }

    /// `region`'s engine intake clock (`clock`: the snapshot's, one point
    /// per scrape, ascending) with this Envoy's prefills there placed in
    /// it, so that a prefix is aged by what went in after its stamp:
    /// - within a scrape interval, each prefill the engine admitted in it
    ///   (routed before the scrape) sits where its answer started, or at
    ///   the scrape if that came first (scaled down if they exceed what the
    ///   engine counted); the rest of the engine's count, other Envoys'
    ///   traffic and answers not yet noted, is spread evenly;
    /// - the last interval, when none of this Envoy's prefills in it are
    ///   noted yet (they are noted when their answers end), counts from
    ///   its start: spread, it would charge the prefill that set a stamp
    ///   in part after that stamp;
    /// - after the last scrape, this Envoy's prefills as steps.
    pub fn merged(&self, region: usize, clock: &[(u64, f64)]) -> Vec<(u64, f64)> {
        let mut mine: Vec<(u64, u64, f64)> = self
            .records
            .iter()
            .filter(|(r, _, _, _)| usize::from(*r) == region)
            .map(|&(_, routed, started, t)| (routed, started.max(routed), f64::from(t)))
            .collect();
        mine.sort_by_key(|(routed, _, _)| *routed);
        let mut own = mine.into_iter().peekable();
        let mut out = Vec::with_capacity(clock.len() + RecentIntake::CAP + 1);
        let mut prev: Option<(u64, f64)> = None;
        let last = clock.len().saturating_sub(1);
        for (i, &(t1, k1)) in clock.iter().enumerate() {
            let mut inside: Vec<(u64, f64)> = Vec::new();
            while let Some((_, started, n)) = own.next_if(|(routed, _, _)| *routed <= t1) {
                if prev.is_some() {
                    inside.push((started.min(t1), n));
                }
            }
            inside.sort_by_key(|(t, _)| *t);
            let Some((t0, k0)) = prev else {
                out.push((t1, k1));
                prev = Some((t1, k1));
                continue;
            };
            if i == last && inside.is_empty() {
                out.push((t0.saturating_add(1).min(t1), k1));
                out.push((t1, k1));
                prev = Some((t1, k1));
                continue;
            }
            let delta = (k1 - k0).max(0.0);
            let noted: f64 = inside.iter().map(|(_, n)| n).sum();
            let scale = if noted > delta { delta / noted } else { 1.0 };
            let rest = delta - noted * scale;
            let span = t1.saturating_sub(t0).max(1) as f64;
            let mut acc = 0.0;
            // A prefill is a step: the points before and after it share
            // its time (between the steps, the rest goes in evenly).
            for (t, n) in inside {
                let f = (t.saturating_sub(t0) as f64 / span).clamp(0.0, 1.0);
                out.push((t.max(t0), k0 + rest * f + acc));
                acc += n * scale;
                out.push((t.max(t0), k0 + rest * f + acc));
            }
            out.push((t1, k1));
            prev = Some((t1, k1));
        }
        let mut after: Vec<(u64, f64)> = own.map(|(_, started, n)| (started, n)).collect();
        after.sort_by_key(|(t, _)| *t);
        let (tl, mut cum) = prev.unwrap_or((0, 0.0));
        for (t, n) in after {
            out.push((t.max(tl), cum));
            cum += n;
            out.push((t.max(tl), cum));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::store::MemoryStore;

    #[test]
    fn this_envoys_prefills_are_steps_in_the_engines_clock() {
        // Scrapes at 1 s (0) and 2 s (1000 tokens taken in); this Envoy
        // routed a 600-token prefill at 1.2 s whose answer started at 1.5
        // s, and one of 50 at 2.1 s (after the scrape) started at 2.3 s.
        let mut ring = RecentIntake::default();
        let mut store = MemoryStore::default();
        RecentIntake::note(&mut store, 0, 1200, 1500, 600);
        RecentIntake::note(&mut store, 0, 2100, 2300, 50);
        RecentIntake::note(&mut store, 1, 1100, 1300, 999);
        ring.records = RecentIntake::read(&mut store).0.records;
        assert_eq!(ring.records.len(), 3);
        let clock = [(1000, 0.0), (2000, 1000.0)];
        let merged = ring.merged(0, &clock);
        let lru = Lru {
            free_tokens: 1e6,
            tokens_per_block: 1.0,
            clock: &merged,
        };
        // The rest (400, other Envoys) is spread over the interval; the
        // 600 sit at 1.5 s, so a stamp at 1.5 s (that answer's own) has
        // only the rest after it and the later prefill.
        assert!(
            (lru.intake_since(1500) - (200.0 + 50.0)).abs() < 1e-6,
            "{merged:?}"
        );
        assert!((lru.intake_since(1499) - (200.0 + 600.0 + 50.0)).abs() < 1.0);
        assert_eq!(lru.intake_since(2300), 0.0);
        assert_eq!(lru.intake_since(2200), 50.0);
        // The last interval with none of this Envoy's prefills noted
        // counts from its start (region 2: none at all).
        let merged = ring.merged(2, &[(1000, 0.0), (2000, 1000.0), (3000, 1500.0)]);
        let lru = Lru {
            free_tokens: 1e6,
            tokens_per_block: 1.0,
            clock: &merged,
        };
        assert_eq!(lru.intake_since(2500), 0.0);
        assert_eq!(lru.intake_since(1500), 1000.0);
        // Garbage in the shared value reads as an empty ring.
        store.set(INTAKE_KEY, &[1, 2, 3], None).unwrap();
        assert_eq!(RecentIntake::read(&mut store).0, RecentIntake::default());
    }
}
