//! Session affinity records: which region served a session's previous
//! request. A soft signal for the cost (the region that served the last turn
//! also caches that turn's output, which the prefix directory cannot know).
//! Stored in shared data like the directory: fixed slots
//! (`llm_geo_router.session.<slot>`, the directory's slot count), a TTL, the
//! newest session winning a slot; the key is a seeded hash, never the
//! session id itself.

use crate::shared::store::{SharedStore, SlotKey};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::shared::names::SESSION_KEY_PREFIX as KEY_PREFIX;

#[derive(Debug, Clone, Copy)]
pub struct Sessions {
    pub slots: u32,
    pub ttl_ms: u64,
    pub layout: u32,
    pub seed: u64,
}

/// A looked-up session: its hash, and the region and time of its last
/// request if known and fresh, with that request's prompt length in blocks
/// and the chain hash of its last block (so the region's cache of it can be
/// credited exactly, not just to the last checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionEntry {
    pub hash: u64,
    pub last: Option<(usize, u64)>,
    pub prefix: Option<(u32, u64)>,
}

const RECORD_BYTES: usize = 36;

impl Sessions {
    fn key(&self, hash: u64) -> SlotKey {
        SlotKey::new(KEY_PREFIX, hash % u64::from(self.slots.max(1)))
    }

    fn encode(&self, hash: u64, region: usize, now_ms: u64, prefix: (u32, u64)) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD_BYTES);
        v.extend_from_slice(&self.layout.to_le_bytes());
        v.extend_from_slice(&hash.to_le_bytes());
        v.extend_from_slice(&(region as u32).to_le_bytes());
        v.extend_from_slice(&now_ms.to_le_bytes());
        v.extend_from_slice(&prefix.0.to_le_bytes());
        v.extend_from_slice(&prefix.1.to_le_bytes());
        v
    }

    #[allow(clippy::type_complexity)]
    fn decode(&self, v: &[u8]) -> Option<(u64, usize, u64, (u32, u64))> {
        if v.len() != RECORD_BYTES
            || u32::from_le_bytes(v.get(0..4)?.try_into().ok()?) != self.layout
        {
            return None;
        }
        let hash = u64::from_le_bytes(v.get(4..12)?.try_into().ok()?);
        let region = u32::from_le_bytes(v.get(12..16)?.try_into().ok()?) as usize;
        let ts = u64::from_le_bytes(v.get(16..24)?.try_into().ok()?);
        let blocks = u32::from_le_bytes(v.get(24..28)?.try_into().ok()?);
        let last = u64::from_le_bytes(v.get(28..36)?.try_into().ok()?);
        Some((hash, region, ts, (blocks, last)))
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
            prefix: found
                .map(|(_, _, _, p)| p)
                .filter(|(blocks, _)| *blocks > 0),
        }
    }

    /// Record the region that now serves the session and the prompt it
    /// sent (`prefix`: blocks, last block's chain hash); skipped (no call)
    /// when the record already says exactly that and is younger than half
    /// the TTL.
    /// A peer Envoy's record: session `hash` served by `region` at
    /// `at_ms`, its prompt `prefix`; kept unless the slot holds a newer
    /// record. True when it changed the slot.
    pub fn merge(
        &self,
        store: &mut dyn SharedStore,
        hash: u64,
        region: usize,
        at_ms: u64,
        prefix: (u32, u64),
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
        let _ = store.set(
            key.as_str(),
            &self.encode(hash, region, at_ms, prefix),
            None,
        );
        true
    }

    /// The sessions of a configuration.
    pub fn new(cfg: &crate::config::Config) -> Sessions {
        Sessions {
            slots: cfg.directory.slots,
            ttl_ms: u64::from(cfg.directory.ttl_s) * 1000,
            layout: crate::cache::directory::layout_of(cfg.regions.iter().map(|r| r.name.as_str())),
            seed: cfg.prefix.hash_seed,
        }
    }

    pub fn record(
        &self,
        store: &mut dyn SharedStore,
        entry: SessionEntry,
        region: usize,
        now_ms: u64,
        prefix: (u32, u64),
    ) -> u32 {
        if let Some((r, ts)) = entry.last {
            let fresh = now_ms.saturating_sub(ts) < self.ttl_ms / 2;
            if r == region && entry.prefix == Some(prefix) && fresh {
                return 0;
            }
        }
        let value = self.encode(entry.hash, region, now_ms, prefix);
        let _ = store.set(self.key(entry.hash).as_str(), &value, None);
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared::store::MemoryStore;

    /// 128 slots, a 10 s TTL, and an empty store.
    fn sessions() -> (Sessions, MemoryStore) {
        let s = Sessions {
            slots: 128,
            ttl_ms: 10_000,
            layout: 1,
            seed: 3,
        };
        (s, MemoryStore::default())
    }

    #[test]
    fn remembers_the_last_region_within_the_ttl() {
        let (s, mut m) = sessions();
        let e = s.lookup(&mut m, "conv-1", 1000);
        assert_eq!(e.last, None);
        assert_eq!(s.record(&mut m, e, 2, 1000, (7, 99)), 1);
        let e = s.lookup(&mut m, "conv-1", 2000);
        assert_eq!(e.last, Some((2, 1000)));
        assert_eq!(e.prefix, Some((7, 99)));
        // Same region and prompt, fresh: no write; a longer prompt: written.
        assert_eq!(s.record(&mut m, e, 2, 2000, (7, 99)), 0);
        assert_eq!(s.record(&mut m, e, 2, 2000, (9, 5)), 1);
        assert_eq!(s.lookup(&mut m, "conv-1", 12_000).last, None);
        assert_eq!(s.lookup(&mut m, "conv-2", 2000).last, None);
        // The key is not the session id.
        assert!(m.map.keys().all(|k| !k.contains("conv")));
    }

    #[test]
    fn a_peers_record_is_kept_unless_the_slot_holds_a_newer_one() {
        let (s, mut m) = sessions();
        let hash = s.lookup(&mut m, "conv-1", 1000).hash;
        assert!(s.merge(&mut m, hash, 1, 1000, (7, 99)));
        let e = s.lookup(&mut m, "conv-1", 1500);
        assert_eq!((e.last, e.prefix), (Some((1, 1000)), Some((7, 99))));
        // An older record from another peer does not replace it; a newer one
        // does.
        assert!(!s.merge(&mut m, hash, 2, 900, (3, 5)));
        assert_eq!(s.lookup(&mut m, "conv-1", 1500).last, Some((1, 1000)));
        assert!(s.merge(&mut m, hash, 2, 1200, (9, 6)));
        assert_eq!(s.lookup(&mut m, "conv-1", 1500).last, Some((2, 1200)));
    }
}
