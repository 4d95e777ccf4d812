//! What every policy's run needs to know about each trace request, computed
//! once per trace: the engine's own view of the prompt (the emulator's
//! parser and tokenization of the canonical chat text, so cached tokens are
//! counted exactly as the live emulator counts them), the output length the
//! engine will generate, and the segments as interned ids for the baselines'
//! prefix trees.

use crate::fleet::Fleet;
use crate::trace::{self, TraceRequest};
use engine_emulator::model::{Prompt, DEFAULT_BLOCK_TOKENS};
use engine_emulator::openai::{self, Kind};
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Prompt,
    /// Output tokens as the engine parses `max_tokens` (clamped to 1..=4096).
    pub output_tokens: u32,
    /// Segments as (interned id, tokens).
    pub segments: Vec<(u32, u32)>,
    /// Prompt tokens as the segments count them.
    pub segment_tokens: u64,
    pub client: usize,
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub requests: Vec<TraceRequest>,
    pub prepared: Vec<Prepared>,
}

impl Workload {
    /// Checks the trace against the fleet and prepares each request.
    pub fn new(fleet: &Fleet, requests: Vec<TraceRequest>) -> Result<Workload, String> {
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut prepared = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let client = fleet.client_index(&r.client_region).ok_or_else(|| {
                format!(
                    "request {} (line {}): client_region {:?} is not in the fleet's client_regions",
                    i,
                    i + 1,
                    r.client_region
                )
            })?;
            let body = trace::request_body(r);
            let parsed = openai::parse_request(Kind::Chat, &body)
                .map_err(|e| format!("request {i}: the emulator refuses its body: {e}"))?;
            let segments = r
                .segments
                .iter()
                .map(|(id, n)| {
                    let next = ids.len() as u32;
                    (*ids.entry(id.clone()).or_insert(next), *n)
                })
                .collect();
            prepared.push(Prepared {
                prompt: Prompt::from_tokens(&parsed.prompt, DEFAULT_BLOCK_TOKENS),
                output_tokens: u32::try_from(parsed.max_tokens).unwrap_or(u32::MAX),
                segments,
                segment_tokens: r.segment_tokens(),
                client,
            });
        }
        Ok(Workload { requests, prepared })
    }
}
