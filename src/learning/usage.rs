//! What an engine's answer says about the prompt it served: `usage` from the
//! end of a response body, found without parsing the body.
//!
//! vLLM and SGLang put `usage` at the end of a non-streamed answer (after
//! `choices`), and, in a stream that asks for it (`stream_options.
//! include_usage`, or the server's forced usage), in the last `data:` event
//! before `data: [DONE]`. [`Tail`] keeps the last [`Tail::CAP`] bytes of the
//! body as it passes: per chunk, only the bytes that can still be in the tail
//! are copied, and nothing is parsed until the answer ends. Then the last
//! `"usage":` followed by an object is read as one JSON value.
//!
//! A `"usage":` inside generated text cannot match: in the body it is
//! escaped (`\"usage\":`). Chat and completions report `prompt_tokens` and
//! `prompt_tokens_details.cached_tokens`; the Responses API `input_tokens`
//! and `input_tokens_details.cached_tokens`.

use serde_json::Value;

/// The prompt's figures as the engine counted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Tokens of the prompt, in the engine's tokenizer.
    pub prompt_tokens: u64,
    /// Of them, served from the engine's prefix cache; `None` when the
    /// answer does not say (vLLM without `--enable-prompt-tokens-details`,
    /// SGLang without `--enable-cache-report`).
    pub cached_tokens: Option<u64>,
}

/// The last bytes of a response body.
#[derive(Debug, Clone, Default)]
pub struct Tail {
    buf: Vec<u8>,
    /// Bytes of body seen in all.
    seen: u64,
}

const KEY: &[u8] = b"\"usage\":";

impl Tail {
    /// Enough for the usage object and what engines put after it
    /// (`prompt_logprobs`, `kv_transfer_params`, the SSE trailer).
    pub const CAP: usize = 4096;

    /// How many bytes at the end of a `len`-byte chunk can still matter:
    /// the caller reads only those.
    pub fn wanted(len: usize) -> usize {
        len.min(Self::CAP)
    }

    /// Appends the end of a chunk of `len` bytes, of which `end` are its
    /// last `end.len()` bytes (as [`Tail::wanted`] asked for).
    pub fn push(&mut self, len: usize, end: &[u8]) {
        self.seen = self.seen.saturating_add(len as u64);
        if end.len() >= Self::CAP {
            self.buf.clear();
            self.buf
                .extend_from_slice(end.get(end.len() - Self::CAP..).unwrap_or(end));
            return;
        }
        // Amortised: the buffer grows to twice the capacity before its
        // front is dropped, so a stream of small chunks moves each byte a
        // bounded number of times.
        if self.buf.len() + end.len() > 2 * Self::CAP {
            let keep = Self::CAP - end.len();
            self.buf.drain(..self.buf.len() - keep);
        }
        self.buf.extend_from_slice(end);
    }

    /// Bytes of body seen so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The usage the body ended with, if any: the last `"usage":` followed
    /// by an object holding a whole-number `prompt_tokens` (or
    /// `input_tokens`).
    pub fn usage(&self) -> Option<Usage> {
        let mut end = self.buf.len();
        while let Some(at) = rfind(self.buf.get(..end)?, KEY) {
            end = at;
            let rest = self.buf.get(at + KEY.len()..)?;
            let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
            if rest.get(start) != Some(&b'{') {
                continue; // `"usage": null` in a token chunk
            }
            let value = serde_json::Deserializer::from_slice(rest.get(start..)?)
                .into_iter::<Value>()
                .next()
                .and_then(Result::ok);
            if let Some(u) = value.as_ref().and_then(parse) {
                return Some(u);
            }
        }
        None
    }
}

fn parse(v: &Value) -> Option<Usage> {
    let (prompt, details) = match v.get("prompt_tokens") {
        Some(p) => (p, v.get("prompt_tokens_details")),
        None => (v.get("input_tokens")?, v.get("input_tokens_details")),
    };
    let prompt_tokens = prompt.as_u64()?;
    let cached_tokens = details
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64)
        .map(|c| c.min(prompt_tokens));
    Some(Usage {
        prompt_tokens,
        cached_tokens,
    })
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len())
        .rev()
        .find(|&i| hay.get(i..i + needle.len()) == Some(needle))
}

/// What the router tells the probe about one answered request: what it
/// believed the region held and since when, what the region's engine
/// reported, and the prompt's size in the router's unit (canonical bytes).
/// On the observations queue (tagged, so it cannot be mistaken for a TTFT
/// observation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageReport {
    pub region: u16,
    /// When the request was routed (ms since the Unix epoch).
    pub routed_ms: u64,
    /// Bytes of canonical prompt text (what the router's token estimates
    /// are made from).
    pub prompt_bytes: u32,
    /// Bytes of the prompt the directory believed the region held (its
    /// checkpoint's blocks, within the region's cache horizon).
    pub believed_bytes: u32,
    /// Stamp of the oldest directory entry read as held there (about when
    /// the believed prefix was last served there); 0: none.
    pub held_ms: u64,
    /// Stamp of the newest entry the cache horizon set aside there (within
    /// the TTL but past the horizon); 0: none.
    pub cut_ms: u64,
    /// When the answer started, the prompt prefilled (the directory's stamp
    /// for it, and when the engine took in its uncached tokens); 0: not
    /// known.
    pub served_ms: u64,
    /// The engine's figures.
    pub prompt_tokens: u32,
    /// `None`: the answer did not say.
    pub cached_tokens: Option<u32>,
    /// The request's `model`, if it named one (at most [`MODEL_MAX`] bytes;
    /// longer names are not calibrated per model).
    pub model: Option<String>,
}

/// Longest model name reported.
pub const MODEL_MAX: usize = 128;

pub const REPORT_TAG: u8 = b'V';
const REPORT_FIXED: usize = 1 + 2 + 8 * 4 + 4 * 4;

impl UsageReport {
    pub fn encode(&self) -> Vec<u8> {
        let model = self.model.as_deref().filter(|m| m.len() <= MODEL_MAX);
        let mut b = Vec::with_capacity(REPORT_FIXED + model.map_or(0, str::len));
        b.push(REPORT_TAG);
        b.extend_from_slice(&self.region.to_le_bytes());
        for v in [self.routed_ms, self.held_ms, self.cut_ms, self.served_ms] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            self.prompt_bytes,
            self.believed_bytes,
            self.prompt_tokens,
            self.cached_tokens.unwrap_or(u32::MAX),
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        if let Some(m) = model {
            b.extend_from_slice(m.as_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Option<UsageReport> {
        if b.first() != Some(&REPORT_TAG) || b.len() < REPORT_FIXED {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
        };
        let model = b.get(REPORT_FIXED..)?;
        if model.len() > MODEL_MAX {
            return None;
        }
        let cached = u32_at(47)?;
        Some(UsageReport {
            region: u16::from_le_bytes(b.get(1..3)?.try_into().ok()?),
            routed_ms: u64_at(3)?,
            held_ms: u64_at(11)?,
            cut_ms: u64_at(19)?,
            served_ms: u64_at(27)?,
            prompt_bytes: u32_at(35)?,
            believed_bytes: u32_at(39)?,
            prompt_tokens: u32_at(43)?,
            cached_tokens: (cached != u32::MAX).then_some(cached),
            model: if model.is_empty() {
                None
            } else {
                Some(std::str::from_utf8(model).ok()?.to_owned())
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[&[u8]]) -> Tail {
        let mut t = Tail::default();
        for c in chunks {
            let n = Tail::wanted(c.len());
            t.push(c.len(), &c[c.len() - n..]);
        }
        t
    }

    #[test]
    fn a_non_streamed_answer_ends_with_its_usage() {
        let body = br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1200,"total_tokens":1210,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":1024}},"prompt_logprobs":null,"kv_transfer_params":null}"#;
        let u = feed(&[&body[..40], &body[40..]]).usage().unwrap();
        assert_eq!(
            u,
            Usage {
                prompt_tokens: 1200,
                cached_tokens: Some(1024)
            }
        );
        // Without the details (vLLM without --enable-prompt-tokens-details).
        let body = br#"{"choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2,"prompt_tokens_details":null}}"#;
        assert_eq!(feed(&[body]).usage().unwrap().cached_tokens, None);
    }

    #[test]
    fn a_stream_ends_with_its_usage_chunk() {
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        for i in 0..500 {
            chunks.push(format!("data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \\\"usage\\\": {{\\\"prompt_tokens\\\": 9}}\"}}}}],\"usage\":null}}\n\n").into_bytes());
        }
        chunks.push(b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":31750,\"total_tokens\":31800,\"completion_tokens\":50,\"prompt_tokens_details\":{\"cached_tokens\":2448}}}\n\n".to_vec());
        chunks.push(b"data: [DONE]\n\n".to_vec());
        let refs: Vec<&[u8]> = chunks.iter().map(|c| c.as_slice()).collect();
        let t = feed(&refs);
        assert!(t.buf.len() <= 2 * Tail::CAP);
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 31750,
                cached_tokens: Some(2448)
            })
        );
        // Without the usage chunk: token chunks say `"usage":null`, and the
        // generated text's escaped "usage" never matches.
        let t = feed(&refs[..500]);
        assert_eq!(t.usage(), None);
    }

    #[test]
    fn the_responses_api_names_them_input_tokens() {
        let body = br#"{"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":256},"output_tokens":5,"total_tokens":305}}}"#;
        assert_eq!(
            feed(&[body]).usage(),
            Some(Usage {
                prompt_tokens: 300,
                cached_tokens: Some(256)
            })
        );
    }

    #[test]
    fn garbage_truncation_and_wrong_types_give_nothing() {
        for body in [
            &b""[..],
            b"not json at all",
            br#"{"usage":{"prompt_tokens":"12"}}"#,
            br#"{"usage":{"prompt_tokens":-3}}"#,
            br#"{"usage":{"prompt_tokens":12"#,
            br#"{"usage":[1,2]}"#,
            br#"{"usage":{}}"#,
        ] {
            assert_eq!(
                feed(&[body]).usage(),
                None,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // A cached count above the prompt is clamped to it.
        let body =
            br#"{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":99}}}"#;
        assert_eq!(feed(&[body]).usage().unwrap().cached_tokens, Some(10));
    }

    #[test]
    fn the_tail_keeps_only_its_capacity_whatever_the_chunking() {
        let body: Vec<u8> = (0..20_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        for step in [1, 7, 100, 4096, 5000, 20_000] {
            let chunks: Vec<&[u8]> = body.chunks(step).collect();
            let t = feed(&chunks);
            assert!(t.buf.len() >= Tail::CAP.min(body.len()) && t.buf.len() <= 2 * Tail::CAP);
            assert!(body.ends_with(&t.buf), "{step}");
            assert_eq!(t.seen(), body.len() as u64);
        }
    }

    #[test]
    fn a_report_round_trips_and_garbage_is_refused() {
        let r = UsageReport {
            region: 2,
            routed_ms: 1_700_000_000_000,
            prompt_bytes: 9000,
            believed_bytes: 4096,
            held_ms: 1_699_999_999_000,
            cut_ms: 0,
            served_ms: 1_700_000_000_350,
            prompt_tokens: 4100,
            cached_tokens: Some(2048),
            model: Some("meta-llama/Llama-3.1-8B".into()),
        };
        assert_eq!(UsageReport::decode(&r.encode()), Some(r.clone()));
        let r = UsageReport {
            cached_tokens: None,
            model: None,
            ..r
        };
        assert_eq!(UsageReport::decode(&r.encode()), Some(r.clone()));
        // A TTFT observation (22 bytes, no tag) and truncations are not reports.
        assert_eq!(UsageReport::decode(&[0u8; 22]), None);
        let bytes = r.encode();
        assert_eq!(UsageReport::decode(&bytes[..bytes.len() - 1]), None);
        let mut long = bytes.clone();
        long.extend(std::iter::repeat_n(b'm', MODEL_MAX + 1));
        assert_eq!(UsageReport::decode(&long), None);
        let mut bad = bytes;
        bad.extend_from_slice(&[0xff, 0xfe]);
        assert_eq!(UsageReport::decode(&bad), None);
    }
}
