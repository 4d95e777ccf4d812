//! Envoy's shared data as the core sees it: a process-wide map of keys to
//! bytes with compare-and-swap versions. The host implements it over
//! proxy-wasm; tests, the simulator and the CLI use [`MemoryStore`].

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

/// An in-memory [`SharedStore`] with Envoy's CAS semantics, for tests, the
/// CLI and benchmarks.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    pub map: std::collections::HashMap<String, (Vec<u8>, u32)>,
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
