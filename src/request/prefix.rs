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

/// The chain hash of one block: XXH3-64 of `block` with `seed`.
#[inline]
fn block_hash(block: &[u8], seed: u64) -> u64 {
    // Wasm has no 64x64->128 multiply: the library's u128 product is a call
    // to compiler-rt's `__multi3` (a 128x128 multiply), four per 64-byte
    // block; it was a tenth of the router's time in V8. The same function
    // with the product in 32-bit limbs is twice as fast there (the same
    // bits: tested against the library below). Natively the library is
    // faster.
    if cfg!(target_arch = "wasm32") && (17..=128).contains(&block.len()) {
        xxh3::hash_17_to_128(block, seed)
    } else {
        xxh3_64_with_seed(block, seed)
    }
}

/// XXH3-64 (v0.8) of 17 to 128 bytes with a seed, as the reference
/// computes it, with the 128-bit product in 32-bit limbs.
mod xxh3 {
    const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    /// The first 128 bytes of the reference's default secret (all this
    /// length range reads).
    const SECRET: [u8; 128] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    ];

    #[inline(always)]
    fn read64(b: &[u8], at: usize) -> u64 {
        b.get(at..at + 8)
            .and_then(|s| <[u8; 8]>::try_from(s).ok())
            .map_or(0, u64::from_le_bytes)
    }

    /// The 128-bit product's halves, folded by xor.
    #[inline(always)]
    fn mul128_fold64(a: u64, b: u64) -> u64 {
        let (al, ah) = (a & 0xffff_ffff, a >> 32);
        // The barrier keeps LLVM from seeing the schoolbook product and
        // turning it back into a `__multi3` call.
        let (bl, bh) = (b & 0xffff_ffff, std::hint::black_box(b >> 32));
        let ll = al * bl;
        let lh = al * bh;
        let hl = ah * bl;
        let hh = ah * bh;
        let cross = (ll >> 32) + (lh & 0xffff_ffff) + hl;
        let hi = hh + (lh >> 32) + (cross >> 32);
        let lo = (cross << 32) | (ll & 0xffff_ffff);
        lo ^ hi
    }

    #[inline(always)]
    fn mix16(input: &[u8], at: usize, secret: usize, seed: u64) -> u64 {
        mul128_fold64(
            read64(input, at) ^ read64(&SECRET, secret).wrapping_add(seed),
            read64(input, at + 8) ^ read64(&SECRET, secret + 8).wrapping_sub(seed),
        )
    }

    /// `input.len()` within 17..=128 (the caller checks).
    pub fn hash_17_to_128(input: &[u8], seed: u64) -> u64 {
        let len = input.len();
        let mut acc = (len as u64).wrapping_mul(PRIME64_1);
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    acc = acc.wrapping_add(mix16(input, 48, 96, seed));
                    acc = acc.wrapping_add(mix16(input, len - 64, 112, seed));
                }
                acc = acc.wrapping_add(mix16(input, 32, 64, seed));
                acc = acc.wrapping_add(mix16(input, len - 48, 80, seed));
            }
            acc = acc.wrapping_add(mix16(input, 16, 32, seed));
            acc = acc.wrapping_add(mix16(input, len - 32, 48, seed));
        }
        acc = acc.wrapping_add(mix16(input, 0, 0, seed));
        acc = acc.wrapping_add(mix16(input, len - 16, 16, seed));
        // The reference's avalanche.
        acc ^= acc >> 37;
        acc = acc.wrapping_mul(0x1656_6791_9E37_79F9);
        acc ^ (acc >> 32)
    }
}

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
    /// session's previous prompt can be matched exactly at any length;
    /// outside the namespace (`block_hash` applies it).
    pub hashes: Vec<u64>,
    /// The cache namespace applied to the hashes above, if any.
    pub namespace: Option<u64>,
}

impl PromptPrefix {
    /// Move the prompt into the cache namespace `ns` (a request's model,
    /// `cache_salt` / `prompt_cache_key`): `h → xxh3(h, seed = ns)`. The
    /// chain stays prefix-closed within a namespace and shares nothing
    /// with another, as if `ns` had seeded the chain (the namespace may be
    /// read after the prompt, so it is applied afterwards). The checkpoints
    /// and the first and last blocks are moved now; the per-block hashes
    /// only when read (`block_hash`), so a long prompt costs no pass.
    pub fn namespace(&mut self, ns: u64) {
        let f = |h: u64| xxh3_64_with_seed(&h.to_le_bytes(), ns);
        for c in &mut self.checkpoints {
            c.hash = f(c.hash);
        }
        self.first_block = self.first_block.map(f);
        self.last_block = self.last_block.map(f);
        self.namespace = Some(ns);
    }

    /// The chain hash of the first `i + 1` blocks, in the prompt's namespace.
    pub fn block_hash(&self, i: usize) -> Option<u64> {
        let h = *self.hashes.get(i)?;
        Some(match self.namespace {
            Some(ns) => xxh3_64_with_seed(&h.to_le_bytes(), ns),
            None => h,
        })
    }

    /// Every block's chain hash in the prompt's namespace (tests, tools).
    pub fn block_hashes(&self) -> Vec<u64> {
        (0..self.hashes.len())
            .filter_map(|i| self.block_hash(i))
            .collect()
    }
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

    /// Room for the hashes of up to `bytes` of text, so that a long prompt
    /// costs one allocation, not a doubling series.
    pub fn reserve_for(mut self, bytes: usize) -> Self {
        let blocks = bytes / self.block_bytes + 1;
        self.out.hashes.reserve(blocks);
        self.out
            .checkpoints
            .reserve(2 * (usize::BITS - blocks.leading_zeros()) as usize + 2);
        self
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
        let h = block_hash(block, self.seed ^ self.prev);
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
    fn the_limb_xxh3_is_the_reference_xxh3() {
        // Every length of its range, seeds that exercise the carries.
        let data: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut seed = 0x0123_4567_89ab_cdefu64;
        for len in 17..=128 {
            for start in [0, 1, 7, 300] {
                let input = &data[start..start + len];
                for s in [0, 1, u64::MAX, seed, !seed, 1 << 63, 0xffff_ffff] {
                    assert_eq!(
                        xxh3::hash_17_to_128(input, s),
                        xxh3_64_with_seed(input, s),
                        "len {len} seed {s:#x}"
                    );
                }
                seed = xxh3_64_with_seed(input, seed);
            }
        }
        let max = [0xffu8; 128];
        for len in 17..=128 {
            assert_eq!(
                xxh3::hash_17_to_128(&max[..len], u64::MAX),
                xxh3_64_with_seed(&max[..len], u64::MAX)
            );
        }
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
