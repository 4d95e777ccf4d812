//! The prefix directory: which regions recently served which prompt
//! prefixes. It lives in Envoy's shared data (process-wide, one per
//! `vm_id`), so every worker's router reads and writes the same one.
//!
//! Layout: a fixed number of slots, keys `llm_geo_router.dir.<slot>`; a
//! checkpoint's chain hash picks its slot. An entry is
//! `layout (u32) ‖ hash (u64) ‖ last-served ms (u64) per region`, so one read
//! answers for every region. Memory is bounded by
//! `slots × (12 + 8·regions)` bytes of values plus Envoy's per-key overhead;
//! a colliding prefix replaces the older one (newest wins).
//!
//! Lookup: checkpoints are prefix-closed (a region that served checkpoint j
//! also served every checkpoint before it), so the longest prefix each region
//! holds is found by binary search over the prompt's checkpoints, all regions
//! at once: about log2(checkpoints) reads, not one per block.
//!
//! Writes: after routing to region r, the entries from r's known prefix up to
//! the prompt's end get r's timestamp; entries nobody holds are written
//! blind, shared ones with a CAS read-modify-write. When r's oldest probed
//! entry is past half the TTL, the whole chain is rewritten, so a prefix in
//! constant use never expires.

use crate::prefix::Checkpoint;

use crate::protocol::DIRECTORY_KEY_PREFIX as KEY_PREFIX;
use crate::store::{SetOutcome, SharedStore, SlotKey};

/// Checkpoints tried in a row when a lookup finds slots taken by other
/// prefixes (each try is one shared-data read).
const COLLISION_PROBES: usize = 2;

/// Directory parameters for one configuration.
#[derive(Debug, Clone, Copy)]
pub struct Directory {
    pub slots: u32,
    pub ttl_ms: u64,
    pub regions: usize,
    /// Identifies the region list; entries written under another layout are
    /// ignored, so reordering regions cannot misattribute a prefix.
    pub layout: u32,
}

/// What a lookup learnt, and what the write once the request is served needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lookup {
    /// Per region: blocks of the prompt it holds (a checkpoint's position).
    pub cached_blocks: Vec<u32>,
    /// Per region: the number of checkpoints it holds.
    held: Vec<usize>,
    /// Per region: oldest timestamp among its probed hits.
    oldest_hit_ms: Vec<Option<u64>>,
    /// Per region: the newest stamp of an entry set aside by its horizon.
    cut_ms: Vec<Option<u64>>,
    /// Entries read, by checkpoint index: (value, cas).
    read: Vec<Option<(Vec<u8>, u32)>>,
    /// Shared-data calls made (reads and writes).
    pub calls: u32,
}

impl Lookup {
    /// The oldest stamp among `region`'s entries read as held (about the
    /// stamp of the longest prefix it holds).
    pub fn oldest_hit_ms(&self, region: usize) -> Option<u64> {
        self.oldest_hit_ms.get(region).copied().flatten()
    }

    /// The newest stamp among `region`'s entries its horizon set aside.
    pub fn cut_ms(&self, region: usize) -> Option<u64> {
        self.cut_ms.get(region).copied().flatten()
    }
}

impl Directory {
    pub fn slot_key(&self, hash: u64) -> SlotKey {
        SlotKey::new(KEY_PREFIX, hash % u64::from(self.slots.max(1)))
    }

    /// `buf` := an entry for `hash` that no region holds.
    fn fresh_entry(&self, buf: &mut Vec<u8>, hash: u64) {
        buf.clear();
        buf.extend_from_slice(&self.layout.to_le_bytes());
        buf.extend_from_slice(&hash.to_le_bytes());
        buf.resize(12 + 8 * self.regions, 0);
    }

    fn set_stamp(buf: &mut [u8], region: usize, now_ms: u64) {
        let at = 12 + 8 * region;
        if let Some(dst) = buf.get_mut(at..at + 8) {
            dst.copy_from_slice(&now_ms.to_le_bytes());
        }
    }

    /// The stamp of `region` in an entry (0: never served).
    fn stamp(value: &[u8], region: usize) -> u64 {
        let at = 12 + 8 * region;
        value
            .get(at..at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    }

    /// The entry's prefix hash, if it is one of this layout.
    fn entry_hash(&self, value: &[u8]) -> Option<u64> {
        let layout = u32::from_le_bytes(value.get(0..4)?.try_into().ok()?);
        if layout != self.layout || value.len() != 12 + 8 * self.regions {
            return None;
        }
        Some(u64::from_le_bytes(value.get(4..12)?.try_into().ok()?))
    }

    /// Regions holding checkpoint `cp` per `value`, as a bit set: stamped
    /// within the TTL and within the region's horizon (`horizons[r]`, when
    /// given). An entry within the TTL but past the horizon is set aside:
    /// its stamp is noted in `cut` (the newest per region).
    fn holders(
        &self,
        value: Option<&(Vec<u8>, u32)>,
        cp: &Checkpoint,
        now_ms: u64,
        horizons: &[u64],
        cut: &mut [Option<u64>],
    ) -> u64 {
        let Some((v, _)) = value else {
            return 0;
        };
        if self.entry_hash(v) != Some(cp.hash) {
            return 0;
        }
        let mut mask = 0u64;
        for r in 0..self.regions.min(64) {
            let ts = Self::stamp(v, r);
            let age = now_ms.saturating_sub(ts);
            if ts == 0 || age >= self.ttl_ms {
                continue;
            }
            if horizons.get(r).is_some_and(|h| age >= *h) {
                if let Some(c) = cut.get_mut(r) {
                    *c = Some(c.map_or(ts, |old: u64| old.max(ts)));
                }
                continue;
            }
            mask |= 1 << r;
        }
        mask
    }

    /// Note each holder's stamp as its oldest hit.
    fn note_hits(oldest: &mut [Option<u64>], value: Option<&(Vec<u8>, u32)>, mask: u64) {
        let Some((v, _)) = value else {
            return;
        };
        for (r, o) in oldest.iter_mut().enumerate().take(64) {
            if mask & (1 << r) != 0 {
                let ts = Self::stamp(v, r);
                *o = Some(o.map_or(ts, |old: u64| old.min(ts)));
            }
        }
    }

    /// Longest held prefix of `checkpoints` per region.
    pub fn lookup(
        &self,
        store: &mut dyn SharedStore,
        checkpoints: &[Checkpoint],
        now_ms: u64,
    ) -> Lookup {
        self.lookup_within(store, checkpoints, now_ms, &[])
    }

    /// The same, believing a region's entries only within its cache
    /// horizon (`horizons[r]` ms; a region without one: the TTL). Entries
    /// are prefix-closed in age too (a prefix's stamp is at least as recent
    /// as any longer prefix's), so the search is unchanged.
    pub fn lookup_within(
        &self,
        store: &mut dyn SharedStore,
        checkpoints: &[Checkpoint],
        now_ms: u64,
        horizons: &[u64],
    ) -> Lookup {
        let mut out = Lookup {
            cached_blocks: vec![0; self.regions],
            held: vec![0; self.regions],
            oldest_hit_ms: vec![None; self.regions],
            cut_ms: vec![None; self.regions],
            read: vec![None; checkpoints.len()],
            calls: 0,
        };
        // First probe the first checkpoint: a region that does not hold it
        // holds nothing, so a cold prompt costs one read, and only the
        // regions that hold it take part in the binary search. Region sets
        // are bit sets (at most 64 regions).
        let mut first_holders = 0u64;
        if let Some(cp) = checkpoints.first() {
            out.calls += 1;
            let value = store.get(self.slot_key(cp.hash).as_str()).ok().flatten();
            first_holders = self.holders(value.as_ref(), cp, now_ms, horizons, &mut out.cut_ms);
            Self::note_hits(&mut out.oldest_hit_ms, value.as_ref(), first_holders);
            if let Some(slot) = out.read.get_mut(0) {
                *slot = value;
            }
        }
        // Invariant of each task: every region in it holds between lo and hi
        // checkpoints (inclusive).
        let mut tasks = vec![(
            1usize.min(checkpoints.len()),
            checkpoints.len(),
            first_holders,
        )];
        while let Some((lo, hi, regions)) = tasks.pop() {
            if regions == 0 {
                continue;
            }
            if lo == hi {
                for (r, h) in out.held.iter_mut().enumerate().take(64) {
                    if regions & (1 << r) != 0 {
                        *h = lo;
                    }
                }
                continue;
            }
            let mid = (lo + hi).div_ceil(2); // does the region hold `mid` checkpoints?
                                             // A slot taken by another prefix (newest wins) is no evidence
                                             // either way: ask the next checkpoint instead (a region holding
                                             // it holds `mid` too); after `COLLISION_PROBES` taken slots the
                                             // regions are taken not to hold `mid`, an under-estimate (the
                                             // safe side: the request is routed by distance and load).
            let mut probe = mid;
            let mut holders = 0u64;
            while probe <= hi && probe < mid + COLLISION_PROBES {
                let idx = probe - 1;
                let Some(cp) = checkpoints.get(idx) else {
                    break;
                };
                if out.read.get(idx).is_some_and(|r| r.is_none()) {
                    out.calls += 1;
                    let value = store.get(self.slot_key(cp.hash).as_str()).ok().flatten();
                    if let Some(slot) = out.read.get_mut(idx) {
                        *slot = value;
                    }
                }
                let entry = out.read.get(idx).and_then(|r| r.as_ref());
                match entry.and_then(|(v, _)| self.entry_hash(v)) {
                    Some(h) if h != cp.hash => probe += 1,
                    _ => {
                        holders = self.holders(entry, cp, now_ms, horizons, &mut out.cut_ms);
                        Self::note_hits(&mut out.oldest_hit_ms, entry, holders & regions);
                        break;
                    }
                }
            }
            let yes = regions & holders;
            let no = regions & !holders;
            tasks.push((probe.min(hi), hi, yes));
            tasks.push((lo, mid - 1, no));
        }
        for r in 0..self.regions {
            let held = out.held.get(r).copied().unwrap_or(0);
            let blocks = held
                .checked_sub(1)
                .and_then(|i| checkpoints.get(i))
                .map_or(0, |c| c.blocks);
            if let Some(b) = out.cached_blocks.get_mut(r) {
                *b = blocks;
            }
        }
        out
    }

    /// Record that `region` now holds every checkpoint of the prompt.
    /// Returns the number of shared-data calls made.
    pub fn record(
        &self,
        store: &mut dyn SharedStore,
        lookup: &mut Lookup,
        checkpoints: &[Checkpoint],
        region: usize,
        now_ms: u64,
    ) -> u32 {
        if region >= self.regions || now_ms == 0 {
            return 0;
        }
        let mut calls = 0;
        let held = lookup.held.get(region).copied().unwrap_or(0);
        let stale = lookup
            .oldest_hit_ms
            .get(region)
            .copied()
            .flatten()
            .is_some_and(|ts| now_ms.saturating_sub(ts) > self.ttl_ms / 2);
        let start = if stale { 0 } else { held };
        let held_by_anyone = lookup.held.iter().copied().max().unwrap_or(0);
        // One buffer for every entry written: the layout, the hash, and each
        // region's stamp, edited in place.
        let mut buf: Vec<u8> = Vec::with_capacity(12 + 8 * self.regions);
        for (idx, cp) in checkpoints.iter().enumerate().skip(start) {
            let key = self.slot_key(cp.hash);
            let key = key.as_str();
            if idx >= held_by_anyone && lookup.read.get(idx).is_none_or(|r| r.is_none()) {
                // Nobody holds it: write blind; a colliding older prefix is replaced.
                self.fresh_entry(&mut buf, cp.hash);
                Self::set_stamp(&mut buf, region, now_ms);
                calls += 1;
                let _ = store.set(key, &buf, None);
                continue;
            }
            // Shared entry: read-modify-write under CAS, one retry.
            let mut current = lookup.read.get_mut(idx).and_then(|r| r.take());
            for _ in 0..2 {
                let (value, cas) = match current.take() {
                    Some(v) => v,
                    None => {
                        calls += 1;
                        match store.get(key) {
                            Ok(Some(v)) => v,
                            Ok(None) => (Vec::new(), 0),
                            Err(_) => break,
                        }
                    }
                };
                if self.entry_hash(&value) == Some(cp.hash) {
                    buf.clear();
                    buf.extend_from_slice(&value);
                } else {
                    self.fresh_entry(&mut buf, cp.hash);
                }
                Self::set_stamp(&mut buf, region, now_ms);
                calls += 1;
                let cas = (cas != 0).then_some(cas);
                match store.set(key, &buf, cas) {
                    Ok(SetOutcome::CasMismatch) => continue,
                    _ => break,
                }
            }
        }
        lookup.calls += calls;
        calls
    }
}

/// Layout id of a region list.
pub fn layout_of<'a>(names: impl Iterator<Item = &'a str>) -> u32 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for n in names {
        h.update(n.as_bytes());
        h.update(&[0]);
    }
    h.digest() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::PromptHasher;
    use crate::store::MemoryStore;

    fn dir(regions: usize) -> Directory {
        Directory {
            slots: 1 << 16,
            ttl_ms: 60_000,
            regions,
            layout: 7,
        }
    }

    fn cps(text: &[u8]) -> Vec<Checkpoint> {
        let mut h = PromptHasher::new(64, 9);
        h.feed(text);
        h.finish().checkpoints
    }

    fn text(n: usize, salt: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
            .collect()
    }

    #[test]
    fn empty_directory_knows_nothing() {
        let d = dir(3);
        let mut s = MemoryStore::default();
        let c = cps(&text(64 * 100, 1));
        let l = d.lookup(&mut s, &c, 1000);
        assert_eq!(l.cached_blocks, vec![0, 0, 0]);
        // One read: the first probe at the middle misses for every region, then
        // the search narrows without new regions to place... bounded by log2.
        assert!(l.calls <= 5, "{}", l.calls);
    }

    #[test]
    fn finds_each_regions_longest_prefix() {
        let d = dir(3);
        let mut s = MemoryStore::default();
        let long = text(64 * 600, 1);
        let c_long = cps(&long);
        // Region 1 served the first 100 blocks, region 2 the first 600.
        let c100 = cps(&long[..64 * 100]);
        let mut l = d.lookup(&mut s, &c100, 1000);
        d.record(&mut s, &mut l, &c100, 1, 1000);
        let mut l = d.lookup(&mut s, &c_long, 1000);
        d.record(&mut s, &mut l, &c_long, 2, 1000);
        let l = d.lookup(&mut s, &c_long, 2000);
        // 100 blocks → the largest checkpoint ≤ 100 is 96.
        assert_eq!(l.cached_blocks, vec![0, 96, 512]);
        assert!(l.calls <= 2 * 5 + 2, "calls {}", l.calls);
        // Another prompt sharing only the first 10 blocks.
        let mut other = long[..640].to_vec();
        other.extend(text(64 * 50, 2));
        let l = d.lookup(&mut s, &cps(&other), 2000);
        assert_eq!(l.cached_blocks, vec![0, 8, 8]);
    }

    #[test]
    fn a_slot_taken_by_another_prefix_is_no_evidence() {
        let d = dir(3);
        let mut s = MemoryStore::default();
        let long = text(64 * 600, 1);
        let c = cps(&long);
        let mut l = d.lookup(&mut s, &c, 1000);
        d.record(&mut s, &mut l, &c, 2, 1000);
        assert_eq!(d.lookup(&mut s, &c, 2000).cached_blocks, vec![0, 0, 512]);
        // Another prefix takes each checkpoint's slot in turn (newest wins):
        // the search asks the next checkpoint instead, so the region keeps
        // its whole prefix; only the last checkpoint, with none after it,
        // is lost (credited the one before, never more than it holds).
        for (i, cp) in c.iter().enumerate().skip(1) {
            let mut s = s.clone();
            let mut other = Vec::new();
            d.fresh_entry(&mut other, cp.hash ^ 1);
            Directory::set_stamp(&mut other, 1, 1500);
            s.set(d.slot_key(cp.hash).as_str(), &other, None).unwrap();
            let l = d.lookup(&mut s, &c, 2000);
            let got = l.cached_blocks[2];
            let want = if i + 1 < c.len() {
                512
            } else {
                c[i - 1].blocks
            };
            assert_eq!(got, want, "slot {i} of {} taken", c.len());
            assert_eq!(l.cached_blocks[1], 0);
        }
    }

    #[test]
    fn entries_expire_after_ttl_and_refresh_keeps_them() {
        let d = dir(2);
        let mut s = MemoryStore::default();
        let c = cps(&text(64 * 40, 3));
        let mut l = d.lookup(&mut s, &c, 1000);
        d.record(&mut s, &mut l, &c, 0, 1000);
        assert_eq!(d.lookup(&mut s, &c, 60_999).cached_blocks, vec![32, 0]);
        assert_eq!(d.lookup(&mut s, &c, 61_000).cached_blocks, vec![0, 0]);
        // Used past half the TTL: the whole chain is refreshed.
        let mut l = d.lookup(&mut s, &c, 40_000);
        d.record(&mut s, &mut l, &c, 0, 40_000);
        assert_eq!(d.lookup(&mut s, &c, 95_000).cached_blocks, vec![32, 0]);
    }

    #[test]
    fn steady_conversation_writes_little() {
        let d = dir(3);
        let mut s = MemoryStore::default();
        let mut convo = text(64 * 300, 4);
        let mut t = 1000;
        let mut writes = vec![];
        for _ in 0..6 {
            let c = cps(&convo);
            let mut l = d.lookup(&mut s, &c, t);
            let before = s.sets;
            d.record(&mut s, &mut l, &c, 0, t);
            writes.push(s.sets - before);
            convo.extend(text(64 * 5, 5));
            t += 1000;
        }
        // The first turn writes all 16 checkpoints up to 300 blocks; later
        // turns add at most one new checkpoint each.
        assert_eq!(writes[0], 16);
        assert!(writes[1..].iter().all(|&w| w <= 1), "{writes:?}");
    }

    #[test]
    fn other_layout_and_garbage_are_ignored() {
        let d = dir(2);
        let mut s = MemoryStore::default();
        let c = cps(&text(64 * 8, 6));
        for cp in &c {
            s.set(d.slot_key(cp.hash).as_str(), b"garbage", None)
                .unwrap();
        }
        assert_eq!(d.lookup(&mut s, &c, 5).cached_blocks, vec![0, 0]);
        let mut l = d.lookup(&mut s, &c, 5);
        d.record(&mut s, &mut l, &c, 1, 5);
        assert_eq!(d.lookup(&mut s, &c, 6).cached_blocks, vec![0, 8]);
        let other = Directory { layout: 8, ..d };
        assert_eq!(other.lookup(&mut s, &c, 6).cached_blocks, vec![0, 0]);
    }

    #[test]
    fn cas_conflict_is_retried() {
        struct Racy(MemoryStore, bool);
        impl SharedStore for Racy {
            fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
                self.0.get(key)
            }
            fn set(
                &mut self,
                key: &str,
                value: &[u8],
                cas: Option<u32>,
            ) -> Result<SetOutcome, String> {
                if cas.is_some() && std::mem::take(&mut self.1) {
                    return Ok(SetOutcome::CasMismatch);
                }
                self.0.set(key, value, cas)
            }
        }
        let d = dir(2);
        let mut s = Racy(MemoryStore::default(), false);
        let c = cps(&text(64 * 4, 7));
        let mut l = d.lookup(&mut s, &c, 10);
        d.record(&mut s, &mut l, &c, 0, 10);
        s.1 = true;
        let mut l = d.lookup(&mut s, &c, 20);
        d.record(&mut s, &mut l, &c, 1, 20);
        // Both regions end up holding the prompt despite the conflict.
        assert_eq!(d.lookup(&mut s, &c, 30).cached_blocks, vec![4, 4]);
    }
}
