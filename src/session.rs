//! Session affinity records: which region served a session's previous
//! request, the prompt it sent and the length of the answer it got. The
//! engine that generated that answer holds prompt and answer in its cache
//! (vLLM caches generated blocks as they fill; SGLang inserts the output
//! into its radix tree when a request ends), which the prefix directory
//! cannot know: the next turn, whose prompt repeats both, is credited with
//! them there. Stored in shared data like the directory: fixed slots
//! (`llm_geo_router.session.<slot>`, the directory's slot count), a TTL, the
//! newest session winning a slot; the key is a seeded hash, never the
//! session id itself.

use crate::store::{SharedStore, SlotKey};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::protocol::SESSION_KEY_PREFIX as KEY_PREFIX;

#[derive(Debug, Clone, Copy)]
pub struct Sessions {
    pub slots: u32,
    pub ttl_ms: u64,
    pub layout: u32,
    pub seed: u64,
}

/// What a session's last request left in its region's cache: its prompt
/// (`blocks` full blocks, the last one's chain hash `last`) and the answer
/// generated after it (`answer_tokens`, the engine's `completion_tokens`;
/// 0 when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Turn {
    pub blocks: u32,
    pub last: u64,
    pub answer_tokens: u32,
}

/// A looked-up session: its hash, and the region and time of its last
/// request if known and fresh, with what that request left there (so the
/// region's cache of it can be credited exactly, not just to the last
/// checkpoint, and its answer too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionEntry {
    pub hash: u64,
    pub last: Option<(usize, u64)>,
    pub turn: Option<Turn>,
}

const RECORD_BYTES: usize = 40;

impl Sessions {
    fn key(&self, hash: u64) -> SlotKey {
        SlotKey::new(KEY_PREFIX, hash % u64::from(self.slots.max(1)))
    }

    fn encode(&self, hash: u64, region: usize, now_ms: u64, turn: Turn) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD_BYTES);
        v.extend_from_slice(&self.layout.to_le_bytes());
        v.extend_from_slice(&hash.to_le_bytes());
        v.extend_from_slice(&(region as u32).to_le_bytes());
        v.extend_from_slice(&now_ms.to_le_bytes());
        v.extend_from_slice(&turn.blocks.to_le_bytes());
        v.extend_from_slice(&turn.last.to_le_bytes());
        v.extend_from_slice(&turn.answer_tokens.to_le_bytes());
        v
    }

    fn decode(&self, v: &[u8]) -> Option<(u64, usize, u64, Turn)> {
        if v.len() != RECORD_BYTES
            || u32::from_le_bytes(v.get(0..4)?.try_into().ok()?) != self.layout
        {
            return None;
        }
        let hash = u64::from_le_bytes(v.get(4..12)?.try_into().ok()?);
        let region = u32::from_le_bytes(v.get(12..16)?.try_into().ok()?) as usize;
        let ts = u64::from_le_bytes(v.get(16..24)?.try_into().ok()?);
        let turn = Turn {
            blocks: u32::from_le_bytes(v.get(24..28)?.try_into().ok()?),
            last: u64::from_le_bytes(v.get(28..36)?.try_into().ok()?),
            answer_tokens: u32::from_le_bytes(v.get(36..40)?.try_into().ok()?),
        };
        Some((hash, region, ts, turn))
    }

    /// One shared-data read.
    pub fn lookup(&self, store: &mut dyn SharedStore, session: &str, now_ms: u64) -> SessionEntry {
        let hash = xxh3_64_with_seed(session.as_bytes(), self.seed);
        let found = store
            .get(self.key(hash).as_str())
            .ok()
            .flatten()
            .and_then(|(v, _)| self.decode(&v))
            .filter(|(h, _, ts, _)| *h == hash && now_ms.saturating_sub(*ts) < self.ttl_ms);
        SessionEntry {
            hash,
            last: found.map(|(_, r, ts, _)| (r, ts)),
            turn: found
                .map(|(_, _, _, t)| t)
                .filter(|t| t.blocks > 0 || t.answer_tokens > 0),
        }
    }

    /// A peer Envoy's record: session `hash` served by `region` at
    /// `at_ms`, leaving `turn`; kept unless the slot holds a newer record.
    /// True when it changed the slot.
    pub fn merge(
        &self,
        store: &mut dyn SharedStore,
        hash: u64,
        region: usize,
        at_ms: u64,
        turn: Turn,
    ) -> bool {
        let key = self.key(hash);
        let newer = store
            .get(key.as_str())
            .ok()
            .flatten()
            .and_then(|(v, _)| self.decode(&v))
            .is_some_and(|(_, _, ts, _)| ts >= at_ms);
        if newer {
            return false;
        }
        let _ = store.set(key.as_str(), &self.encode(hash, region, at_ms, turn), None);
        true
    }

    /// The sessions of a configuration.
    pub fn new(cfg: &crate::config::Config) -> Sessions {
        Sessions {
            slots: cfg.directory.slots,
            ttl_ms: u64::from(cfg.directory.ttl_s) * 1000,
            layout: crate::directory::layout_of(cfg.regions.iter().map(|r| r.name.as_str())),
            seed: cfg.prefix.hash_seed,
        }
    }

    /// Record the region that served the session's request and what it
    /// left there (`turn`); skipped (no call) when the record already says
    /// exactly that and is younger than half the TTL.
    pub fn record(
        &self,
        store: &mut dyn SharedStore,
        entry: SessionEntry,
        region: usize,
        now_ms: u64,
        turn: Turn,
    ) -> u32 {
        if let Some((r, ts)) = entry.last {
            let fresh = now_ms.saturating_sub(ts) < self.ttl_ms / 2;
            if r == region && entry.turn == Some(turn) && fresh {
                return 0;
            }
        }
        let value = self.encode(entry.hash, region, now_ms, turn);
        let _ = store.set(self.key(entry.hash).as_str(), &value, None);
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn remembers_the_last_region_within_the_ttl() {
        let s = Sessions {
            slots: 128,
            ttl_ms: 10_000,
            layout: 1,
            seed: 3,
        };
        let mut m = MemoryStore::default();
        let turn = |blocks, last, answer_tokens| Turn {
            blocks,
            last,
            answer_tokens,
        };
        let e = s.lookup(&mut m, "conv-1", 1000);
        assert_eq!(e.last, None);
        assert_eq!(s.record(&mut m, e, 2, 1000, turn(7, 99, 40)), 1);
        let e = s.lookup(&mut m, "conv-1", 2000);
        assert_eq!(e.last, Some((2, 1000)));
        assert_eq!(e.turn, Some(turn(7, 99, 40)));
        // Same region, prompt and answer, fresh: no write; a longer prompt
        // or another answer: written.
        assert_eq!(s.record(&mut m, e, 2, 2000, turn(7, 99, 40)), 0);
        assert_eq!(s.record(&mut m, e, 2, 2000, turn(7, 99, 41)), 1);
        assert_eq!(s.record(&mut m, e, 2, 2000, turn(9, 5, 0)), 1);
        // A first turn shorter than a block still leaves its answer; one
        // that left nothing known is no turn.
        assert_eq!(s.record(&mut m, e, 2, 2000, turn(0, 0, 12)), 1);
        assert_eq!(s.lookup(&mut m, "conv-1", 2000).turn, Some(turn(0, 0, 12)));
        assert_eq!(s.record(&mut m, e, 2, 2000, turn(0, 0, 0)), 1);
        assert_eq!(s.lookup(&mut m, "conv-1", 2000).turn, None);
        assert_eq!(s.lookup(&mut m, "conv-1", 12_000).last, None);
        assert_eq!(s.lookup(&mut m, "conv-2", 2000).last, None);
        // The key is not the session id.
        assert!(m.map.keys().all(|k| !k.contains("conv")));
    }
}
