//! Prompt prefix hashing: the canonical prompt text is cut into fixed blocks
//! and chain-hashed with xxh3 under a configured seed,
//! `h_i = xxh3_seeded(block_i, seed ⊕ h_{i-1})` (`h_0 = 0`), so a block's hash
//! names the whole prefix up to and including it. Chaining through the seed
//! rather than by concatenation hashes blocks in place, without copying them. Only full blocks are hashed (engines cache only
//! full blocks too).
//!
//! Not every block hash is kept: the prefix directory records prefixes at
//! *checkpoints*, block counts with at most two significant bits
//! (1, 2, 3, 4, 6, 8, 12, 16, 24, …). They are the same positions for every
//! prompt, so two prompts that share a prefix share its checkpoints; there are
//! about 2·log2(blocks) of them, and a known cached prefix is never
//! under-estimated by more than a third.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A hashed prefix: `blocks` full blocks whose chain hash is `hash`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub blocks: u32,
    pub hash: u64,
}

/// What routing needs to know about a prompt's text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptPrefix {
    /// Bytes of canonical prompt text.
    pub bytes: u64,
    /// Number of full blocks.
    pub blocks: u32,
    /// Chain hash of the first block (the rendezvous key of a conversation).
    pub first_block: Option<u64>,
    /// Checkpoints in increasing block order.
    pub checkpoints: Vec<Checkpoint>,
    /// The chain hash of the last full block (names the whole hashed prompt).
    pub last_block: Option<u64>,
    /// Every block's chain hash, in order (8 bytes per 64-byte block), so a
    /// session's previous prompt can be matched exactly at any length.
    pub hashes: Vec<u64>,
}

/// True for block counts with at most two significant bits.
pub fn is_checkpoint(blocks: u32) -> bool {
    if blocks == 0 {
        return false;
    }
    let bits = 32 - blocks.leading_zeros();
    if bits <= 2 {
        return true;
    }
    blocks & ((1u32 << (bits - 2)) - 1) == 0
}

/// Streaming chain hasher: feed the canonical text in pieces, in order.
pub struct PromptHasher {
    seed: u64,
    block_bytes: usize,
    hashing: bool,
    /// The partial block that spans two pieces fed.
    buf: Vec<u8>,
    prev: u64,
    out: PromptPrefix,
}

impl PromptHasher {
    pub fn new(block_bytes: u32, seed: u64) -> Self {
        let block_bytes = block_bytes.max(1) as usize;
        let buf = Vec::with_capacity(block_bytes);
        PromptHasher {
            seed,
            block_bytes,
            hashing: true,
            buf,
            prev: 0,
            out: PromptPrefix::default(),
        }
    }

    /// A hasher that only counts bytes (the guard needs lengths, not hashes).
    pub fn counting_only() -> Self {
        let mut h = PromptHasher::new(64, 0);
        h.hashing = false;
        h
    }

    pub fn feed(&mut self, mut bytes: &[u8]) {
        self.out.bytes = self.out.bytes.saturating_add(bytes.len() as u64);
        if !self.hashing {
            return;
        }
        while !bytes.is_empty() {
            if self.buf.is_empty() && bytes.len() >= self.block_bytes {
                // A whole block in this piece: hash it where it is.
                let (block, rest) = bytes.split_at(self.block_bytes);
                self.finish_block(block);
                bytes = rest;
                continue;
            }
            let take = (self.block_bytes - self.buf.len()).min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.buf.extend_from_slice(head);
            bytes = rest;
            if self.buf.len() == self.block_bytes {
                let block = std::mem::take(&mut self.buf);
                self.finish_block(&block);
                self.buf = block;
                self.buf.clear();
            }
        }
    }

    fn finish_block(&mut self, block: &[u8]) {
        let h = xxh3_64_with_seed(block, self.seed ^ self.prev);
        self.prev = h;
        self.out.blocks = self.out.blocks.saturating_add(1);
        let n = self.out.blocks;
        if n == 1 {
            self.out.first_block = Some(h);
        }
        if is_checkpoint(n) {
            self.out.checkpoints.push(Checkpoint { blocks: n, hash: h });
        }
        self.out.last_block = Some(h);
        self.out.hashes.push(h);
    }

    pub fn finish(self) -> PromptPrefix {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(text: &[u8], block: u32) -> PromptPrefix {
        let mut h = PromptHasher::new(block, 7);
        h.feed(text);
        h.finish()
    }

    #[test]
    fn checkpoints_have_two_significant_bits() {
        let cps: Vec<u32> = (1..=64).filter(|&n| is_checkpoint(n)).collect();
        assert_eq!(cps, vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]);
        // About 2·log2(n) checkpoints up to n.
        assert_eq!((1..=512).filter(|&n| is_checkpoint(n)).count(), 18);
        assert!(is_checkpoint(3 << 29) && is_checkpoint(1 << 31));
    }

    #[test]
    fn chain_hash_is_prefix_closed_and_split_independent() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let whole = hash(&text, 64);
        let mut h = PromptHasher::new(64, 7);
        for piece in text.chunks(7) {
            h.feed(piece);
        }
        assert_eq!(h.finish(), whole);
        assert_eq!(whole.blocks, 15);
        assert_eq!(whole.bytes, 1000);
        // A longer prompt with the same start shares every checkpoint of the shorter one.
        let mut longer = text.clone();
        longer.extend_from_slice(b"and then some more text that goes on for a while.....");
        let l = hash(&longer, 64);
        assert_eq!(
            &l.checkpoints[..whole.checkpoints.len()],
            &whole.checkpoints[..]
        );
        // A change in the first block changes every hash after it.
        let mut other = text.clone();
        other[3] ^= 1;
        let o = hash(&other, 64);
        assert!(o
            .checkpoints
            .iter()
            .zip(&whole.checkpoints)
            .all(|(a, b)| a.hash != b.hash));
    }

    #[test]
    fn seed_changes_hashes_and_partial_blocks_are_not_hashed() {
        let text = vec![b'x'; 100];
        let mut a = PromptHasher::new(64, 1);
        a.feed(&text);
        let mut b = PromptHasher::new(64, 2);
        b.feed(&text);
        let (a, b) = (a.finish(), b.finish());
        assert_eq!(a.blocks, 1);
        assert_ne!(a.first_block, b.first_block);
        assert_eq!(hash(&text[..63], 64).blocks, 0);
    }

    #[test]
    fn counting_only_counts() {
        let mut h = PromptHasher::counting_only();
        h.feed(&[0; 500]);
        let p = h.finish();
        assert_eq!((p.bytes, p.blocks), (500, 0));
        assert!(p.checkpoints.is_empty());
    }
}
