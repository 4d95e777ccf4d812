//! What every policy's run needs to know about each trace request, computed
//! once per trace: the engine's own view of the prompt (the emulator's
//! parser and tokenization of the canonical chat text, so cached tokens are
//! counted exactly as the live emulator counts them), the output length the
//! engine will generate, what the engine holds once it has answered (prompt
//! and answer), and the segments as interned ids for the baselines' prefix
//! trees.

use crate::topology::Topology;
use crate::trace::{self, TraceRequest};
use engine_emulator::model::{Prompt, DEFAULT_BLOCK_TOKENS};
use engine_emulator::openai::{self, Kind};
use engine_emulator::tokenizer;
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompt: Prompt,
    /// Output tokens as the engine parses `max_tokens` (clamped to 1..=4096).
    pub output_tokens: u32,
    /// The prompt and the answer as one sequence, as the engine holds them
    /// once it has answered, when the trace shows the answer: the segment
    /// the session's next request adds right after this prompt, of exactly
    /// `output_tokens` (a conversation's next turn repeats the answer). A
    /// trace renders a conversation as one user message, so the sequence is
    /// that message's tokens up to the end of the answer's text (the
    /// template's end of turn and generation prompt left out).
    pub sequence: Option<Prompt>,
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
    pub fn new(fleet: &Topology, requests: Vec<TraceRequest>) -> Result<Workload, String> {
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut prepared = Vec::with_capacity(requests.len());
        let answers = answers(&requests);
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
                sequence: answers
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|answer| sequence(r, answer)),
                segments,
                segment_tokens: r.segment_tokens(),
                client,
            });
        }
        Ok(Workload { requests, prepared })
    }
}

/// Per request: its answer as a segment, when the session's next request
/// shows it (extends this prompt by a segment of `output_tokens`, then
/// goes on).
fn answers(requests: &[TraceRequest]) -> Vec<Option<&(String, u32)>> {
    let mut next_of: HashMap<&str, &TraceRequest> = HashMap::new();
    let mut out: Vec<Option<&(String, u32)>> = requests
        .iter()
        .rev()
        .map(|r| {
            let n = r.segments.len();
            let answer = next_of.get(r.session.as_str()).and_then(|next| {
                next.segments.get(n).filter(|a| {
                    next.segments.get(..n) == Some(r.segments.as_slice()) && a.1 == r.output_tokens
                })
            });
            next_of.insert(r.session.as_str(), r);
            answer
        })
        .collect();
    out.reverse();
    out
}

/// The engine's token sequence of `r`'s prompt followed by `answer`: the
/// prompt of `r` with the answer's segment added, parsed as the engine
/// parses every request, up to the end of its text.
fn sequence(r: &TraceRequest, answer: &(String, u32)) -> Option<Prompt> {
    let mut answered = r.clone();
    answered.segments.push(answer.clone());
    let mut tokens = openai::parse_request(Kind::Chat, &trace::request_body(&answered))
        .ok()?
        .prompt;
    let end = tokens.iter().rposition(|&t| t == tokenizer::EOT)?;
    tokens.truncate(end);
    Some(Prompt::from_tokens(&tokens, DEFAULT_BLOCK_TOKENS))
}
