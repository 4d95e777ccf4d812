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
//! Forgetting: an entry is believed for the directory's TTL at most, and
//! for a region whose engine's cache capacity is known (`Keep::Lru`), only
//! while that engine's LRU would still hold it: the tokens it took in since
//! the entry's stamp plus the prefix's own length within what running
//! requests leave free. Engines free a finished request's blocks tail
//! first, so a long prefix goes before its own shorter ones. Never an
//! entry stamped before the region's engine last restarted
//! (`Retention::since_ms`), whoever wrote it.
//!
//! Writes: once region r has served the prompt, the entries from r's known
//! prefix up to the prompt's end get r's timestamp; entries nobody holds
//! are written blind, shared ones with a CAS read-modify-write. Recency is
//! per prefix: when r's oldest held entry is past half the TTL, or (cache
//! modelled) an eighth of r's free capacity has gone in since it, the
//! whole chain is restamped, as an engine's hit refreshes every block it
//! reuses.

use crate::request::prefix::Checkpoint;

pub use crate::cache::retention::{Keep, Lru, RecentIntake, Retention};
use crate::shared::names::DIRECTORY_KEY_PREFIX as KEY_PREFIX;
use crate::shared::store::{SetOutcome, SharedStore, SlotKey};

/// Bytes of an entry before the regions' fields: layout, prefix hash.
const HEAD: usize = 12;
/// Bytes per region in an entry: stamp (u64), extent (u32), end tag (u32).
const PER_REGION: usize = 16;
/// Mixed into the layout id written in entries, so entries of the older
/// layout (8 bytes a region) read as another layout's.
const ENTRY_VERSION: u32 = 0x5eed_0002;

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
    /// Per region: its held stamps are old enough that serving the prompt
    /// there restamps every checkpoint, not only those beyond them.
    refresh: Vec<bool>,
    /// Entries read, by checkpoint index: (value, cas).
    read: Vec<Option<(Vec<u8>, u32)>>,
    /// Shared-data calls made (reads and writes).
    pub calls: u32,
    /// The first checkpoint the last `record` wrote (it wrote all from
    /// there on).
    pub written_from: usize,
}

impl Lookup {
    /// The oldest stamp among `region`'s entries read as held (about the
    /// stamp of the longest prefix it holds).
    pub fn oldest_hit_ms(&self, region: usize) -> Option<u64> {
        self.oldest_hit_ms.get(region).copied().flatten()
    }

    /// Serving the prompt at `region` restamps every checkpoint.
    pub fn refresh_all(&mut self, region: usize) {
        if let Some(f) = self.refresh.get_mut(region) {
            *f = true;
        }
    }

    /// The newest stamp among `region`'s entries its horizon set aside.
    pub fn cut_ms(&self, region: usize) -> Option<u64> {
        self.cut_ms.get(region).copied().flatten()
    }
}

impl Directory {
    /// The directory of a configuration (what every root reads and writes).
    pub fn new(cfg: &crate::config::Config) -> Directory {
        Directory {
            slots: cfg.directory.slots,
            ttl_ms: u64::from(cfg.directory.ttl_s) * 1000,
            regions: cfg.regions.len(),
            layout: layout_of(cfg.regions.iter().map(|r| r.name.as_str())),
        }
    }

    pub fn slot_key(&self, hash: u64) -> SlotKey {
        SlotKey::new(KEY_PREFIX, hash % u64::from(self.slots.max(1)))
    }

    fn entry_len(&self) -> usize {
        HEAD + PER_REGION * self.regions
    }

    /// `buf` := an entry for `hash` that no region holds.
    fn fresh_entry(&self, buf: &mut Vec<u8>, hash: u64) {
        buf.clear();
        buf.extend_from_slice(&(self.layout ^ ENTRY_VERSION).to_le_bytes());
        buf.extend_from_slice(&hash.to_le_bytes());
        buf.resize(self.entry_len(), 0);
    }

    /// `region` served the entry's prefix at `now_ms`, as part of a prompt
    /// of `end.0` blocks whose last block hashes to `end.1`.
    fn set_stamp(buf: &mut [u8], region: usize, now_ms: u64, end: (u32, u64)) {
        let at = HEAD + PER_REGION * region;
        let mut field = [0u8; PER_REGION];
        field[..8].copy_from_slice(&now_ms.to_le_bytes());
        field[8..12].copy_from_slice(&end.0.to_le_bytes());
        field[12..].copy_from_slice(&(end.1 as u32).to_le_bytes());
        if let Some(dst) = buf.get_mut(at..at + PER_REGION) {
            dst.copy_from_slice(&field);
        }
    }

    /// The stamp of `region` in an entry (0: never served).
    fn stamp(value: &[u8], region: usize) -> u64 {
        let at = HEAD + PER_REGION * region;
        value
            .get(at..at + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    }

    /// The prompt `region` last served through an entry: its blocks and
    /// its last block's hash, low 32 bits (0 blocks: none recorded).
    fn extent(value: &[u8], region: usize) -> (u32, u32) {
        let at = HEAD + PER_REGION * region + 8;
        let word = |i: usize| {
            value
                .get(i..i + 4)
                .and_then(|b| <[u8; 4]>::try_from(b).ok())
                .map_or(0, u32::from_le_bytes)
        };
        (word(at), word(at + 4))
    }

    /// The entry's prefix hash, if it is one of this layout.
    fn entry_hash(&self, value: &[u8]) -> Option<u64> {
        let layout = u32::from_le_bytes(value.get(0..4)?.try_into().ok()?);
        if layout != self.layout ^ ENTRY_VERSION || value.len() != self.entry_len() {
            return None;
        }
        Some(u64::from_le_bytes(value.get(4..12)?.try_into().ok()?))
    }

    /// Past each region's longest held checkpoint: the prompt it last
    /// served through that checkpoint, if this prompt continues it (its
    /// block at that length has the recorded hash, `block_hash(i)` being
    /// this prompt's block `i`) and the region's engine is believed to
    /// keep all of it. A conversation's next turn is then believed held to
    /// the previous turn's last block, not only to the checkpoint before
    /// it (checkpoints are up to a third short). No shared-data call: the
    /// entry was read by the lookup.
    pub fn extend(
        &self,
        lookup: &mut Lookup,
        checkpoints: &[Checkpoint],
        block_hash: impl Fn(usize) -> Option<u64>,
        now_ms: u64,
        keep: &[Retention],
    ) {
        for r in 0..self.regions.min(64) {
            let Some(idx) = lookup.held.get(r).and_then(|h| h.checked_sub(1)) else {
                continue;
            };
            let Some((v, _)) = lookup.read.get(idx).and_then(|e| e.as_ref()) else {
                continue;
            };
            let (Some(cp), Some(cached)) = (checkpoints.get(idx), lookup.cached_blocks.get(r))
            else {
                continue;
            };
            if self.entry_hash(v) != Some(cp.hash) {
                continue;
            }
            let (blocks, tag) = Self::extent(v, r);
            let ts = Self::stamp(v, r);
            let continues = blocks > *cached
                && block_hash(blocks as usize - 1).is_some_and(|h| h as u32 == tag);
            if !continues {
                continue;
            }
            // Engines cache whole blocks of their own tokens, so the
            // previous prompt's tail short of an engine block is not held:
            // the belief stops one of the router's blocks short (64 bytes
            // are more tokens than vLLM's 16-token block). An LRU cache
            // keeps the head of it that fits (it frees tail first).
            let held = keep
                .get(r)
                .copied()
                .unwrap_or_default()
                .blocks_held(ts, blocks, now_ms);
            if let Some(c) = lookup.cached_blocks.get_mut(r) {
                *c = (*c).max(held.saturating_sub(1));
            }
        }
    }

    /// Regions holding checkpoint `cp` per `value`, as a bit set: stamped
    /// within the TTL, after the region's engine last restarted, and
    /// believed kept by it (`keep[r]`, when given). An entry within the TTL
    /// that the engine is believed to have evicted is set aside: its stamp
    /// is noted in `cut` (the newest per region). One from before a restart
    /// is not: the restart, not the cache's size, emptied it.
    fn holders(
        &self,
        value: Option<&(Vec<u8>, u32)>,
        cp: &Checkpoint,
        now_ms: u64,
        keep: &[Retention],
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
            if keep.get(r).is_some_and(|k| !k.after_restart(ts)) {
                continue;
            }
            if keep
                .get(r)
                .is_some_and(|k| !k.keep.holds(ts, cp.blocks, now_ms))
            {
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

    /// The same, believing a region's entries only as far as its engine is
    /// believed to keep them (`keep[r]`; a region without one: the TTL).
    /// Every rule is prefix-closed (a prefix's stamp is at least as recent
    /// as any longer prefix's, and it ends earlier), so the search is
    /// unchanged.
    pub fn lookup_within(
        &self,
        store: &mut dyn SharedStore,
        checkpoints: &[Checkpoint],
        now_ms: u64,
        keep: &[Retention],
    ) -> Lookup {
        let mut out = Lookup {
            cached_blocks: vec![0; self.regions],
            held: vec![0; self.regions],
            oldest_hit_ms: vec![None; self.regions],
            cut_ms: vec![None; self.regions],
            refresh: vec![false; self.regions],
            read: vec![None; checkpoints.len()],
            calls: 0,
            written_from: 0,
        };
        // First probe the first checkpoint: a region that does not hold it
        // holds nothing, so a cold prompt costs one read, and only the
        // regions that hold it take part in the binary search. Region sets
        // are bit sets (at most 64 regions).
        let mut first_holders = 0u64;
        if let Some(cp) = checkpoints.first() {
            out.calls += 1;
            let value = store.get(self.slot_key(cp.hash).as_str()).ok().flatten();
            first_holders = self.holders(value.as_ref(), cp, now_ms, keep, &mut out.cut_ms);
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
                        holders = self.holders(entry, cp, now_ms, keep, &mut out.cut_ms);
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
            let k = keep.get(r).copied().unwrap_or_default().keep;
            if let (Some(ts), Some(f)) = (out.oldest_hit_ms(r), out.refresh.get_mut(r)) {
                *f = k.stale(ts, now_ms, self.ttl_ms);
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
        end: (u32, u64),
    ) -> u32 {
        if region >= self.regions || now_ms == 0 {
            return 0;
        }
        let mut calls = 0;
        let held = lookup.held.get(region).copied().unwrap_or(0);
        let stale = lookup.refresh.get(region).copied().unwrap_or(false);
        // The longest held checkpoint is rewritten too when it names
        // another prompt's end (`extend` reads it there).
        let deepest = held.checked_sub(1);
        let named = deepest
            .and_then(|i| lookup.read.get(i))
            .and_then(|e| e.as_ref())
            .is_some_and(|(v, _)| Self::extent(v, region) == (end.0, end.1 as u32));
        let start = match deepest {
            _ if stale => 0,
            Some(i) if !named => i,
            _ => held,
        };
        lookup.written_from = start;
        let held_by_anyone = lookup.held.iter().copied().max().unwrap_or(0);
        // One buffer for every entry written: the layout, the hash, and each
        // region's stamp, edited in place.
        let mut buf: Vec<u8> = Vec::with_capacity(self.entry_len());
        for (idx, cp) in checkpoints.iter().enumerate().skip(start) {
            let key = self.slot_key(cp.hash);
            let key = key.as_str();
            if idx >= held_by_anyone && lookup.read.get(idx).is_none_or(|r| r.is_none()) {
                // Nobody holds it: write blind; a colliding older prefix is replaced.
                self.fresh_entry(&mut buf, cp.hash);
                Self::set_stamp(&mut buf, region, now_ms, end);
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
                Self::set_stamp(&mut buf, region, now_ms, end);
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

impl Directory {
    /// A peer Envoy's placement: `region` held each checkpoint in
    /// `hashes` as of `stamp`, as part of a prompt ending at `end`. Per
    /// checkpoint and region the newest stamp wins (so merging is
    /// idempotent and order-free); a slot another prefix holds is taken
    /// only by a newer stamp than any of its own. Returns the entries
    /// changed.
    pub fn merge(
        &self,
        store: &mut dyn SharedStore,
        hashes: &[u64],
        region: usize,
        stamp: u64,
        end: (u32, u64),
    ) -> u32 {
        if region >= self.regions || stamp == 0 {
            return 0;
        }
        let mut changed = 0;
        let mut buf: Vec<u8> = Vec::with_capacity(self.entry_len());
        for &hash in hashes {
            let key = self.slot_key(hash);
            for _ in 0..2 {
                let (value, cas) = match store.get(key.as_str()) {
                    Ok(Some(v)) => v,
                    Ok(None) => (Vec::new(), 0),
                    Err(_) => break,
                };
                if self.entry_hash(&value) == Some(hash) {
                    if Self::stamp(&value, region) >= stamp {
                        break;
                    }
                    buf.clear();
                    buf.extend_from_slice(&value);
                } else {
                    let newest = match self.entry_hash(&value) {
                        Some(_) => (0..self.regions)
                            .map(|r| Self::stamp(&value, r))
                            .max()
                            .unwrap_or(0),
                        None => 0,
                    };
                    if newest >= stamp {
                        break;
                    }
                    self.fresh_entry(&mut buf, hash);
                }
                // Stamps are Unix ms: the low 32 bits of the end hash are
                // what an entry keeps.
                Self::set_stamp(&mut buf, region, stamp, end);
                let cas = (cas != 0).then_some(cas);
                match store.set(key.as_str(), &buf, cas) {
                    Ok(SetOutcome::CasMismatch) => continue,
                    Ok(SetOutcome::Stored) => {
                        changed += 1;
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        changed
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
    use crate::request::prefix::PromptHasher;
    use crate::shared::store::MemoryStore;

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
        d.record(&mut s, &mut l, &c100, 1, 1000, (0, 0));
        let mut l = d.lookup(&mut s, &c_long, 1000);
        d.record(&mut s, &mut l, &c_long, 2, 1000, (0, 0));
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
        d.record(&mut s, &mut l, &c, 2, 1000, (0, 0));
        assert_eq!(d.lookup(&mut s, &c, 2000).cached_blocks, vec![0, 0, 512]);
        // Another prefix takes each checkpoint's slot in turn (newest wins):
        // the search asks the next checkpoint instead, so the region keeps
        // its whole prefix; only the last checkpoint, with none after it,
        // is lost (credited the one before, never more than it holds).
        for (i, cp) in c.iter().enumerate().skip(1) {
            let mut s = s.clone();
            let mut other = Vec::new();
            d.fresh_entry(&mut other, cp.hash ^ 1);
            Directory::set_stamp(&mut other, 1, 1500, (0, 0));
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
        d.record(&mut s, &mut l, &c, 0, 1000, (0, 0));
        assert_eq!(d.lookup(&mut s, &c, 60_999).cached_blocks, vec![32, 0]);
        assert_eq!(d.lookup(&mut s, &c, 61_000).cached_blocks, vec![0, 0]);
        // Used past half the TTL: the whole chain is refreshed.
        let mut l = d.lookup(&mut s, &c, 40_000);
        d.record(&mut s, &mut l, &c, 0, 40_000, (0, 0));
        assert_eq!(d.lookup(&mut s, &c, 95_000).cached_blocks, vec![32, 0]);
    }

    #[test]
    fn steady_conversation_writes_little() {
        let d = dir(3);
        let mut s = MemoryStore::default();
        let mut convo = text(64 * 300, 4);
        let mut t = 1000;
        let mut writes = vec![];
        // Each checkpoint of the prompt with the time of the turn that first
        // wrote it: its stamp stays that turn's (nothing restamped within
        // half the TTL); 0: never written.
        let mut stamped: Vec<(u32, u64)> = vec![];
        for _ in 0..7 {
            let c = cps(&convo);
            let mut l = d.lookup(&mut s, &c, t);
            let before = s.sets;
            d.record(&mut s, &mut l, &c, 0, t, (0, 0));
            writes.push(s.sets - before);
            for cp in c.iter().skip(stamped.len()) {
                stamped.push((cp.blocks, t));
            }
            let now: Vec<(u32, u64)> = c
                .iter()
                .map(|cp| {
                    let entry = s.map.get(d.slot_key(cp.hash).as_str());
                    (cp.blocks, entry.map_or(0, |(v, _)| Directory::stamp(v, 0)))
                })
                .collect();
            assert_eq!(
                now, stamped,
                "(checkpoint blocks, region 0's stamp) at {t} ms"
            );
            assert_eq!(
                d.lookup(&mut s, &c, t).cached_blocks[0],
                c.last().unwrap().blocks
            );
            convo.extend(text(64 * 50, 5));
            t += 1000;
        }
        // The first turn writes all 16 checkpoints up to 300 blocks; a later
        // turn only the checkpoint it adds, if any: 384 blocks at the third
        // (400 blocks), 512 at the sixth (550).
        assert_eq!(writes, [16, 0, 1, 0, 0, 1, 0]);
    }

    fn prompt(text: &[u8]) -> crate::request::prefix::PromptPrefix {
        let mut h = PromptHasher::new(64, 9);
        h.feed(text);
        h.finish()
    }

    /// Records `p` as served by region 0 at `t`, as the router does.
    fn serve(
        d: &Directory,
        s: &mut MemoryStore,
        p: &crate::request::prefix::PromptPrefix,
        t: u64,
        keep: &[Retention],
    ) -> Lookup {
        let mut l = d.lookup_within(s, &p.checkpoints, t, keep);
        d.extend(&mut l, &p.checkpoints, |i| p.block_hash(i), t, keep);
        let seen = l.clone();
        d.record(
            s,
            &mut l,
            &p.checkpoints,
            0,
            t,
            (p.blocks, p.last_block.unwrap_or(0)),
        );
        seen
    }

    #[test]
    fn an_lru_cache_keeps_a_prefix_while_its_intake_since_and_length_fit() {
        // 10 tokens a block, 1000 tokens free; the engine took in 600
        // tokens between 2 s and 3 s (the clock), nothing since.
        let clock = [(1000, 0.0), (2000, 0.0), (3000, 600.0)];
        let lru = Lru {
            free_tokens: 1000.0,
            tokens_per_block: 10.0,
            clock: &clock,
        };
        assert_eq!(lru.intake_since(500), 600.0);
        assert_eq!(lru.intake_since(2500), 300.0);
        assert_eq!(lru.intake_since(3500), 0.0);
        // Stamped at 1.5 s: 600 in since, so 40 blocks (400 tokens) fit and
        // 41 do not; its tail went first.
        assert!(lru.holds(1500, 40));
        assert!(!lru.holds(1500, 41));
        assert_eq!(lru.blocks_fitting(1500), 40);
        assert_eq!(lru.blocks_fitting(3500), 100);
        // In the directory: a 60-block prompt served at 1.5 s is believed
        // held to its largest checkpoint within 40 blocks, and only by the
        // region whose cache is modelled so.
        let d = dir(2);
        let mut s = MemoryStore::default();
        let a = prompt(&text(64 * 60, 1));
        let mut l = d.lookup(&mut s, &a.checkpoints, 1500);
        d.record(&mut s, &mut l, &a.checkpoints, 0, 1500, (0, 0));
        let mut l = d.lookup(&mut s, &a.checkpoints, 1500);
        d.record(&mut s, &mut l, &a.checkpoints, 1, 1500, (0, 0));
        let keep = [Keep::Lru(lru).into(), Keep::Ttl.into()];
        let l = d.lookup_within(&mut s, &a.checkpoints, 3500, &keep);
        assert_eq!(l.cached_blocks, vec![32, 48]);
        // The entries past it were set aside: their stamp is the cut.
        assert_eq!(l.cut_ms(0), Some(1500));
    }

    #[test]
    fn a_conversation_is_believed_held_to_its_last_turn_and_refreshed_on_every_hit() {
        let d = dir(1);
        let mut s = MemoryStore::default();
        let mut convo = text(64 * 70, 2);
        let first = prompt(&convo);
        serve(&d, &mut s, &first, 1000, &[]);
        // The next turn extends it: held to the previous prompt's 70th
        // block less one (engines keep whole blocks of their own), not
        // only to its checkpoint (64).
        convo.extend(text(64 * 30, 3));
        let next = prompt(&convo);
        let l = serve(&d, &mut s, &next, 2000, &[]);
        assert_eq!(l.cached_blocks, vec![69]);
        // Another prompt through the same checkpoint but not this
        // conversation: the checkpoint only.
        let mut other = convo[..64 * 70].to_vec();
        other[64 * 69] ^= 1;
        other.extend(text(64 * 10, 4));
        let p = prompt(&other);
        let l = d.lookup(&mut s, &p.checkpoints, 3000);
        let mut l2 = l.clone();
        d.extend(&mut l2, &p.checkpoints, |i| p.block_hash(i), 3000, &[]);
        assert_eq!(l2.cached_blocks, vec![64]);
        // An LRU cache with 700 tokens taken in since the last turn and
        // 10 tokens a block keeps the head that fits (1000 − 700 = 300
        // tokens: 30 blocks, less the one short of an engine block; the
        // checkpoint alone would say 24).
        let clock = [(1000, 0.0), (2500, 0.0), (3000, 700.0)];
        let lru = Lru {
            free_tokens: 1000.0,
            tokens_per_block: 10.0,
            clock: &clock,
        };
        convo.extend(text(64 * 5, 5));
        let third = prompt(&convo);
        let l = serve(&d, &mut s, &third, 3000, &[Keep::Lru(lru).into()]);
        assert_eq!(l.cached_blocks, vec![29]);
        // That hit restamped every checkpoint (the engine's LRU refreshes
        // each block it reuses): at 3 s nothing went in since.
        let later = [(1000, 0.0), (2500, 0.0), (3000, 700.0), (3500, 700.0)];
        let lru = Lru {
            free_tokens: 1000.0,
            tokens_per_block: 10.0,
            clock: &later,
        };
        let l = d.lookup_within(&mut s, &third.checkpoints, 3500, &[Keep::Lru(lru).into()]);
        assert_eq!(l.oldest_hit_ms(0), Some(3000));
        assert_eq!(l.cached_blocks, vec![96]);
    }

    #[test]
    fn a_peers_placement_merges_newest_wins_in_any_order() {
        let d = dir(2);
        let p = prompt(&text(2000, 3));
        let hashes: Vec<u64> = p.checkpoints.iter().map(|c| c.hash).collect();
        let end = (p.blocks, p.last_block.unwrap_or(0));
        let held = |s: &mut MemoryStore, now| d.lookup(s, &p.checkpoints, now).cached_blocks;
        // In one order, repeated, and in the other: the same state.
        let mut a = MemoryStore::default();
        assert_eq!(d.merge(&mut a, &hashes, 1, 2_000, end), hashes.len() as u32);
        assert_eq!(d.merge(&mut a, &hashes, 1, 1_000, end), 0, "older: nothing");
        assert_eq!(
            d.merge(&mut a, &hashes, 1, 2_000, end),
            0,
            "repeated: nothing"
        );
        let mut b = MemoryStore::default();
        d.merge(&mut b, &hashes, 1, 1_000, end);
        d.merge(&mut b, &hashes, 1, 2_000, end);
        let mut va: Vec<_> = a.map.values().map(|(v, _)| v.clone()).collect();
        let mut vb: Vec<_> = b.map.values().map(|(v, _)| v.clone()).collect();
        va.sort();
        vb.sort();
        assert_eq!(va, vb);
        assert_eq!(
            held(&mut a, 3_000),
            vec![0, p.checkpoints.last().unwrap().blocks]
        );
        // Out of range or unstamped: nothing; another region keeps its own.
        assert_eq!(d.merge(&mut a, &hashes, 2, 5_000, end), 0);
        assert_eq!(d.merge(&mut a, &hashes, 0, 0, end), 0);
        d.merge(&mut a, &hashes, 0, 1_500, end);
        let last = p.checkpoints.last().unwrap().blocks;
        assert_eq!(held(&mut a, 3_000), vec![last, last]);
        // A slot another prefix holds goes only to a newer stamp.
        let one = Directory { slots: 1, ..d };
        let q = prompt(&text(200, 9));
        let mut c = MemoryStore::default();
        one.merge(&mut c, &[q.checkpoints[0].hash], 0, 5_000, end);
        assert_eq!(one.merge(&mut c, &[hashes[0]], 1, 4_000, end), 0);
        assert_eq!(one.merge(&mut c, &[hashes[0]], 1, 6_000, end), 1);
    }

    #[test]
    fn nothing_stamped_before_a_regions_restart_is_believed_whoever_wrote_it() {
        let d = dir(2);
        let mut s = MemoryStore::default();
        let mut convo = text(64 * 70, 6);
        let p = prompt(&convo);
        let hashes: Vec<u64> = p.checkpoints.iter().map(|c| c.hash).collect();
        let end = (p.blocks, p.last_block.unwrap_or(0));
        // Region 0 served it here at 1 s; a peer says region 1 did at 1.5 s.
        serve(&d, &mut s, &p, 1000, &[]);
        d.merge(&mut s, &hashes, 1, 1500, end);
        let all = p.checkpoints.last().unwrap().blocks;
        let ttl = Retention::default();
        let reset = |since_ms| Retention {
            keep: Keep::Ttl,
            since_ms,
        };
        let held = |s: &mut MemoryStore, keep: &[Retention]| {
            d.lookup_within(s, &p.checkpoints, 5000, keep).cached_blocks
        };
        assert_eq!(held(&mut s, &[ttl, ttl]), vec![all, all]);
        // Region 1's engine restarted at 2 s: the peer's entries are not
        // believed, region 0's are. Nor are they set aside as evictions.
        let l = d.lookup_within(&mut s, &p.checkpoints, 5000, &[ttl, reset(2000)]);
        assert_eq!(l.cached_blocks, vec![all, 0]);
        assert_eq!(l.cut_ms(1), None);
        // Region 0's at 1 s: its own entries go too, and the next turn's
        // extent past them.
        assert_eq!(held(&mut s, &[reset(1001), ttl]), vec![0, all]);
        convo.extend(text(64 * 5, 7));
        let next = prompt(&convo);
        let mut l = d.lookup_within(&mut s, &next.checkpoints, 5000, &[reset(1001), ttl]);
        d.extend(
            &mut l,
            &next.checkpoints,
            |i| next.block_hash(i),
            5000,
            &[reset(1001), ttl],
        );
        assert_eq!(l.cached_blocks[0], 0);
        assert!(l.cached_blocks[1] >= all, "{:?}", l.cached_blocks);
        // Served again after the restart: believed again (an entry stamped
        // at the restart's own millisecond is after it).
        d.merge(&mut s, &hashes, 1, 2000, end);
        assert_eq!(held(&mut s, &[ttl, reset(2000)]), vec![all, all]);
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
        d.record(&mut s, &mut l, &c, 1, 5, (0, 0));
        assert_eq!(d.lookup(&mut s, &c, 6).cached_blocks, vec![0, 8]);
        let other = Directory { layout: 8, ..d };
        assert_eq!(other.lookup(&mut s, &c, 6).cached_blocks, vec![0, 0]);
    }

    #[test]
    fn cas_conflict_is_retried() {
        /// A store where, once armed, another writer updates each existing
        /// entry once, between the directory's read of it and its write:
        /// region 2 stamped at 15 ms. The write then sees the version
        /// moved, as Envoy's CAS would.
        struct Racy {
            store: MemoryStore,
            dir: Directory,
            armed: bool,
            conflicted: std::collections::BTreeSet<String>,
        }
        impl SharedStore for Racy {
            fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
                self.store.get(key)
            }
            fn set(
                &mut self,
                key: &str,
                value: &[u8],
                cas: Option<u32>,
            ) -> Result<SetOutcome, String> {
                if self.armed && !self.conflicted.contains(key) {
                    if let Some((mut other, version)) = self.store.get(key)? {
                        self.conflicted.insert(key.to_string());
                        assert!(self.dir.entry_hash(&other).is_some(), "{key}");
                        Directory::set_stamp(&mut other, 2, 15, (0, 0));
                        assert_eq!(
                            self.store.set(key, &other, Some(version))?,
                            SetOutcome::Stored
                        );
                    }
                }
                self.store.set(key, value, cas)
            }
        }
        let d = dir(3);
        let mut s = Racy {
            store: MemoryStore::default(),
            dir: d,
            armed: false,
            conflicted: Default::default(),
        };
        let c = cps(&text(64 * 4, 7));
        let mut l = d.lookup(&mut s, &c, 10);
        d.record(&mut s, &mut l, &c, 0, 10, (0, 0));
        s.armed = true;
        let mut l = d.lookup(&mut s, &c, 20);
        d.record(&mut s, &mut l, &c, 1, 20, (0, 0));
        // The conflict came at every entry region 1 wrote...
        assert_eq!(
            s.conflicted.len(),
            c.len(),
            "entries whose write met another writer's update"
        );
        // ...and each entry holds both writers' stamps as well as the
        // first's: region 1's write retried on the other writer's entry,
        // not over it.
        s.armed = false;
        for cp in &c {
            let key = d.slot_key(cp.hash);
            let (value, _) = s.get(key.as_str()).unwrap().unwrap();
            let stamps: Vec<u64> = (0..3).map(|r| Directory::stamp(&value, r)).collect();
            assert_eq!(
                stamps,
                [10, 20, 15],
                "stamps of regions 0, 1, 2 at checkpoint {} (10: the first turn, 20: this write, 15: the other writer)",
                cp.blocks
            );
        }
        assert_eq!(d.lookup(&mut s, &c, 30).cached_blocks, vec![4, 4, 4]);
    }
}
