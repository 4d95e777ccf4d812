//! Envoy's shared data as the core sees it: a process-wide map of keys to
//! bytes with compare-and-swap versions. The host implements it over
//! proxy-wasm; tests, the simulator and the CLI use [`MemoryStore`].

/// A shared-data key `<prefix><slot>` built on the stack: a directory or
/// session lookup formats one per read, and a `String` each would be an
/// allocation per read on the request path.
pub struct SlotKey {
    buf: [u8; 64],
    len: usize,
}

impl SlotKey {
    /// `prefix` (at most 44 bytes) followed by `slot` in decimal.
    pub fn new(prefix: &str, slot: u64) -> SlotKey {
        let mut buf = [0u8; 64];
        let p = prefix.as_bytes();
        let plen = p.len().min(44);
        if let (Some(dst), Some(src)) = (buf.get_mut(..plen), p.get(..plen)) {
            dst.copy_from_slice(src);
        }
        let mut digits = [0u8; 20];
        let tail = decimal(slot, &mut digits);
        if let Some(dst) = buf.get_mut(plen..plen + tail.len()) {
            dst.copy_from_slice(tail);
        }
        SlotKey {
            buf,
            len: plen + tail.len(),
        }
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.buf.get(..self.len).unwrap_or_default()).unwrap_or_default()
    }
}

/// `n` in decimal, written into the end of `buf`; the digits are returned.
pub fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        if let Some(d) = buf.get_mut(i) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    buf.get(i..).unwrap_or_default()
}

/// Outcome of a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutcome {
    Stored,
    CasMismatch,
}

/// The shared-data operations the directory needs; the host implements it
/// over proxy-wasm, tests over a map. Errors are host failures: the
/// directory then degrades to "nothing known", never to a failed request.
pub trait SharedStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String>;
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String>;
}

/// A cheap hash for the in-memory store's short keys (SipHash, the std
/// default, resists flooding, which an in-process test store needs not).
#[derive(Debug, Default, Clone, Copy)]
pub struct FastHash;

#[derive(Debug, Default)]
pub struct FastHasher(u64);

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            if let Some(dst) = w.get_mut(..chunk.len()) {
                dst.copy_from_slice(chunk);
            }
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w))
                .wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// An in-memory [`SharedStore`] with Envoy's CAS semantics, for tests, the
/// CLI and benchmarks.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    pub map: std::collections::HashMap<String, (Vec<u8>, u32), FastHash>,
    pub gets: u64,
    pub sets: u64,
}

impl SharedStore for MemoryStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, String> {
        self.gets += 1;
        Ok(self.map.get(key).cloned())
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, String> {
        self.sets += 1;
        let current = self.map.get(key).map(|(_, c)| *c);
        if let (Some(want), Some(have)) = (cas, current) {
            if want != have {
                return Ok(SetOutcome::CasMismatch);
            }
        }
        let next = current.unwrap_or(0).wrapping_add(1).max(1);
        self.map.insert(key.to_string(), (value.to_vec(), next));
        Ok(SetOutcome::Stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_are_the_prefix_and_the_decimal_slot() {
        for slot in [0u64, 7, 10, 16383, u64::MAX] {
            assert_eq!(
                SlotKey::new("llm_geo_router.dir.", slot).as_str(),
                format!("llm_geo_router.dir.{slot}")
            );
        }
    }
}
