//! What an engine's answer says about the prompt it served: `usage`, found
//! wherever it is in a response body, without parsing the body.
//!
//! vLLM and SGLang put `usage` after `choices` in a non-streamed answer,
//! and, in a stream that asks for it (`stream_options.include_usage`, or the
//! server's forced usage), in the last `data:` event before `data: [DONE]`
//! (with `continuous_usage_stats`, in every event). It is not always near the
//! end: a vLLM answer to a request with `return_token_ids` or
//! `prompt_logprobs` puts the prompt's token ids and logprobs after it, tens
//! or hundreds of KiB for a long prompt. So [`UsageScan`] looks at every byte
//! as it passes, once: it finds `"usage":` followed by an object, keeps the
//! object's bytes (at most [`UsageScan::OBJECT_MAX`]), and parses only the
//! last whole one, once the answer has ended.
//!
//! A `"usage":` inside generated text cannot match: in the body it is
//! escaped (`\"usage\":`). Outside strings, a JSON text holds `"usage":` only
//! as a key. Chat and completions report `prompt_tokens` and
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
    /// Tokens of the answer (`completion_tokens`, Responses'
    /// `output_tokens`); `None` when the usage does not say.
    pub completion_tokens: Option<u64>,
}

/// Reads a response body chunk by chunk for its `usage` objects, keeping
/// the last whole one. Its memory is bounded: a count of the key's bytes
/// carried over from one chunk to the next, and two buffers of at most
/// [`UsageScan::OBJECT_MAX`] bytes (the object being read, the last whole
/// one), each allocated once, when the first object starts.
#[derive(Debug, Clone, Default)]
pub struct UsageScan {
    state: State,
    /// In [`State::Seek`]: how many bytes of [`KEY`] end the bytes seen (a
    /// key cut by a chunk boundary).
    matched: u8,
    /// The object being read.
    reading: Vec<u8>,
    /// The last whole object that names the prompt's tokens; empty: none.
    last: Vec<u8>,
}

/// Where the scan is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    /// Looking for [`KEY`].
    #[default]
    Seek,
    /// Just after the key: whitespace, then an object (or `null`, as in a
    /// stream's token chunks).
    Value,
    /// Inside the object: braces open (a `}` in a string closes none), in a
    /// string or not, after a backslash in that string or not.
    Object {
        depth: u16,
        in_string: bool,
        escaped: bool,
    },
}

const KEY: &[u8] = b"\"usage\":";

/// How far the key search may move on when the last byte under the key's
/// window is `b` (Horspool): to align `b` with its last place in the key
/// before the `:`, or past the window when it is not there. In JSON most
/// bytes are not in `"usage`, so most steps skip eight bytes.
fn shift(b: u8) -> usize {
    match b {
        b'"' => 1,
        b'e' => 2,
        b'g' => 3,
        b'a' => 4,
        b's' => 5,
        b'u' => 6,
        _ => KEY.len(),
    }
}

/// The key's bytes matched after `b`, when `m` were before it (the search
/// across a chunk boundary, byte by byte).
fn next_matched(m: u8, b: u8) -> u8 {
    if KEY.get(usize::from(m)) == Some(&b) {
        return m + 1;
    }
    // On a mismatch the only shorter match to fall back on is the `"` that
    // ends `"usage"`, which may open the next key.
    if m == 7 && b == b'u' {
        2
    } else {
        u8::from(b == b'"')
    }
}

/// Whether the object names the prompt's tokens: one that does not cannot
/// be a usage (a tool's JSON schema with a `usage` property, say), and must
/// not hide the last one that does.
fn names_prompt_tokens(object: &[u8]) -> bool {
    let has = |needle: &[u8]| object.windows(needle.len()).any(|w| w == needle);
    has(b"\"prompt_tokens\":") || has(b"\"input_tokens\":")
}

impl UsageScan {
    /// The longest usage object read: a chat answer's is about 150 bytes;
    /// vLLM's Responses API one adds four figures per tool turn, so 4 KiB
    /// holds well over a hundred turns. A longer one is dropped, as if
    /// absent.
    pub const OBJECT_MAX: usize = 4096;

    /// Reads the next bytes of the body, whatever their number: each is
    /// looked at once, none is copied but an object's, nothing is allocated
    /// once the two buffers are.
    pub fn push(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while !rest.is_empty() {
            // Each step reads at least one byte, or changes state to one
            // that does.
            let used = match self.state {
                State::Seek => self.seek(rest),
                State::Value => self.value(rest),
                State::Object { .. } => self.object(rest),
            };
            rest = rest.get(used..).unwrap_or_default();
        }
    }

    /// Some of the body's bytes will not be seen (the host did not hand
    /// them over): what was begun before them is dropped, so that no key
    /// or object is joined across the hole.
    pub fn gap(&mut self) {
        self.state = State::Seek;
        self.matched = 0;
    }

    /// Looks for the key; the bytes used.
    fn seek(&mut self, data: &[u8]) -> usize {
        let mut at = 0;
        // A key the previous chunk began: byte by byte, until it is whole
        // or fails.
        while self.matched > 0 {
            let Some(&b) = data.get(at) else {
                return at;
            };
            at += 1;
            self.matched = next_matched(self.matched, b);
            if usize::from(self.matched) == KEY.len() {
                self.matched = 0;
                self.state = State::Value;
                return at;
            }
        }
        let last = KEY.len() - 1;
        while let Some(&b) = data.get(at + last) {
            if b == b':' && data.get(at..at + KEY.len()) == Some(KEY) {
                self.state = State::Value;
                return at + KEY.len();
            }
            at += shift(b);
        }
        // No key starts before `at`; the fewer than eight bytes from there
        // may begin one that the next chunk ends.
        for &b in data.get(at..).unwrap_or_default() {
            self.matched = next_matched(self.matched, b);
        }
        data.len()
    }

    /// After the key: the bytes used (whitespace); an object starts, or
    /// the search goes on from the byte that is not one.
    fn value(&mut self, data: &[u8]) -> usize {
        let blank = data.iter().take_while(|b| b.is_ascii_whitespace()).count();
        match data.get(blank) {
            Some(b'{') => {
                self.reading.clear();
                // Allocates only the first time each of the two buffers
                // reads an object (they swap as objects complete).
                self.reading.reserve_exact(Self::OBJECT_MAX);
                self.state = State::Object {
                    depth: 0,
                    in_string: false,
                    escaped: false,
                };
            }
            Some(_) => self.state = State::Seek,
            None => {}
        }
        blank
    }

    /// Inside the object: the bytes used, copied to `reading`, up to the
    /// object's end or its size limit.
    fn object(&mut self, data: &[u8]) -> usize {
        let State::Object {
            mut depth,
            mut in_string,
            mut escaped,
        } = self.state
        else {
            return 0;
        };
        let room = Self::OBJECT_MAX.saturating_sub(self.reading.len());
        let mut closed = None;
        for (i, &b) in data.iter().take(room).enumerate() {
            if in_string {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_string = false;
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'{' => depth = depth.saturating_add(1),
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        closed = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let used = closed.unwrap_or(data.len().min(room));
        self.reading
            .extend_from_slice(data.get(..used).unwrap_or_default());
        self.state = if closed.is_some() {
            if names_prompt_tokens(&self.reading) {
                std::mem::swap(&mut self.reading, &mut self.last);
            }
            State::Seek
        } else if used == room {
            // Too long to be a usage: dropped, and the search goes on
            // from the next byte.
            State::Seek
        } else {
            State::Object {
                depth,
                in_string,
                escaped,
            }
        };
        used
    }

    /// The usage the body gave last, if any: the last whole object after a
    /// `"usage":` that names a whole-number `prompt_tokens` (or
    /// `input_tokens`).
    pub fn usage(&self) -> Option<Usage> {
        if self.last.is_empty() {
            return None;
        }
        parse(&serde_json::from_slice::<Value>(&self.last).ok()?)
    }
}

fn parse(v: &Value) -> Option<Usage> {
    let (prompt, details, completion) = match v.get("prompt_tokens") {
        Some(p) => (
            p,
            v.get("prompt_tokens_details"),
            v.get("completion_tokens"),
        ),
        None => (
            v.get("input_tokens")?,
            v.get("input_tokens_details"),
            v.get("output_tokens"),
        ),
    };
    let prompt_tokens = prompt.as_u64()?;
    let cached_tokens = details
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64)
        .map(|c| c.min(prompt_tokens));
    Some(Usage {
        prompt_tokens,
        cached_tokens,
        completion_tokens: completion.and_then(Value::as_u64),
    })
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

    fn feed(chunks: &[&[u8]]) -> UsageScan {
        let mut t = UsageScan::default();
        for c in chunks {
            t.push(c);
        }
        t
    }

    /// Feeds `body` in chunks of the sizes `sizes` yields (the last one
    /// whatever is left).
    fn feed_sized(body: &[u8], mut sizes: impl FnMut() -> usize) -> Option<Usage> {
        let mut chunks: Vec<&[u8]> = Vec::new();
        let mut rest = body;
        while !rest.is_empty() {
            let (c, r) = rest.split_at(sizes().clamp(1, rest.len()));
            chunks.push(c);
            rest = r;
        }
        feed(&chunks).usage()
    }

    /// A deterministic source of chunk sizes (xorshift).
    fn random_sizes(seed: u64, max: usize) -> impl FnMut() -> usize {
        let mut x = seed.max(1);
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x % max as u64) as usize
        }
    }

    const VLLM_USAGE: Usage = Usage {
        prompt_tokens: 5210,
        cached_tokens: Some(4096),
        completion_tokens: Some(2),
    };

    /// A vLLM 0.32 chat answer to a request with `"prompt_logprobs": 5` and
    /// `"return_token_ids": true`: `usage` after `choices`, then the
    /// prompt's logprobs and token ids, about `trailer` bytes of them (a
    /// decoded token may itself read `"usage":{`, escaped).
    fn vllm_answer(content: &str, trailer: usize) -> Vec<u8> {
        let mut b = format!(
            r#"{{"id":"chatcmpl-9","object":"chat.completion","created":1,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}","refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],"reasoning_content":null}},"logprobs":null,"finish_reason":"stop","stop_reason":null,"token_ids":[9906,1917]}}],"service_tier":null,"system_fingerprint":null,"usage":{{"prompt_tokens":5210,"total_tokens":5212,"completion_tokens":2,"prompt_tokens_details":{{"cached_tokens":4096}}}},"prompt_logprobs":[null"#
        )
        .into_bytes();
        let start = b.len();
        let mut i = 0u32;
        while b.len() - start < trailer {
            b.extend_from_slice(
                format!(
                    r#",{{"{}":{{"logprob":-{}.25,"rank":{},"decoded_token":"tok{i}"}},"{}":{{"logprob":-0.5,"rank":1,"decoded_token":"\"usage\":{{\"prompt_tokens\":1}}"}}}}"#,
                    1000 + i % 30_000,
                    i % 9,
                    1 + i % 5,
                    7 + i % 100,
                )
                .as_bytes(),
            );
            i += 1;
        }
        b.extend_from_slice(b"],\"prompt_token_ids\":[128000");
        for t in 0..5209u32 {
            b.extend_from_slice(format!(",{}", 1000 + t * 7 % 120_000).as_bytes());
        }
        b.extend_from_slice(b"],\"kv_transfer_params\":null}");
        b
    }

    #[test]
    fn usage_before_200_kib_of_prompt_logprobs_is_found() {
        let body = vllm_answer("hi", 200 * 1024);
        assert!(body.len() > 200 * 1024);
        assert!(serde_json::from_slice::<Value>(&body).is_ok());
        assert_eq!(feed(&[&body]).usage(), Some(VLLM_USAGE));
        // As Envoy hands it over: 16 KiB slices.
        let chunks: Vec<&[u8]> = body.chunks(16 * 1024).collect();
        assert_eq!(feed(&chunks).usage(), Some(VLLM_USAGE));
    }

    #[test]
    fn any_chunking_finds_it() {
        let body = vllm_answer("hi", 200 * 1024);
        assert_eq!(feed_sized(&body, || 1), Some(VLLM_USAGE), "1-byte chunks");
        assert_eq!(feed_sized(&body, || 7), Some(VLLM_USAGE), "7-byte chunks");
        for seed in 1..=20 {
            for max in [3, 64, 5000] {
                assert_eq!(
                    feed_sized(&body, random_sizes(seed, max)),
                    Some(VLLM_USAGE),
                    "seed {seed}, chunks up to {max} bytes"
                );
            }
        }
    }

    #[test]
    fn a_usage_split_at_the_key_or_inside_the_object() {
        let body = vllm_answer("hi", 8 * 1024);
        let key = body.windows(KEY.len()).position(|w| w == KEY).unwrap();
        let end = key + body[key..].iter().position(|&b| b == b'[').unwrap();
        // Every cut from just before the key to just after the object, in
        // two chunks and in three (the key and the object apart).
        for cut in key - 1..=end {
            let (a, b) = body.split_at(cut);
            assert_eq!(feed(&[a, b]).usage(), Some(VLLM_USAGE), "cut at {cut}");
            for second in cut..=end {
                let (b, c) = b.split_at(second - cut);
                assert_eq!(
                    feed(&[a, b, c]).usage(),
                    Some(VLLM_USAGE),
                    "cuts at {cut} and {second}"
                );
            }
        }
    }

    #[test]
    fn a_stream_skips_usage_null_and_keeps_the_last_usage() {
        // `include_usage`: token chunks say `"usage":null`, the usage chunk
        // comes last; the role chunk (with `return_token_ids`) carries the
        // prompt's token ids.
        let mut s = String::from("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null,\"prompt_token_ids\":[1");
        for t in 0..3000 {
            s.push_str(&format!(",{t}"));
        }
        s.push_str("]}\n\n");
        for i in 0..300 {
            s.push_str(&format!("data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i}\"}}}}],\"usage\":null}}\n\n"));
        }
        s.push_str("data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3001,\"total_tokens\":3301,\"completion_tokens\":300,\"prompt_tokens_details\":{\"cached_tokens\":2048}}}\n\ndata: [DONE]\n\n");
        let want = Some(Usage {
            prompt_tokens: 3001,
            cached_tokens: Some(2048),
            completion_tokens: Some(300),
        });
        assert_eq!(feed(&[s.as_bytes()]).usage(), want);
        assert_eq!(feed_sized(s.as_bytes(), random_sizes(3, 40)), want);
        // `continuous_usage_stats`: every chunk carries the usage so far, the
        // role chunk too, before its token ids. A stream cut short (the
        // client went away) still teaches its prompt: the last whole usage.
        let mut s = String::from("data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":{\"prompt_tokens\":3001,\"total_tokens\":3001,\"completion_tokens\":0,\"prompt_tokens_details\":{\"cached_tokens\":1024}},\"prompt_token_ids\":[1");
        for t in 0..3000 {
            s.push_str(&format!(",{t}"));
        }
        s.push_str(
            "]}\n\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel",
        );
        let want = Some(Usage {
            prompt_tokens: 3001,
            cached_tokens: Some(1024),
            completion_tokens: Some(0),
        });
        assert_eq!(feed(&[s.as_bytes()]).usage(), want);
        assert_eq!(feed_sized(s.as_bytes(), || 1), want);
        // A later `"usage":null` does not erase it; a later usage replaces it.
        s.push_str("lo\"}}],\"usage\":null}\n\ndata: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":3001,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":2000}}}\n\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"}}],\"usage\":null}\n\ndata: [DONE]\n\n");
        let want = Some(Usage {
            prompt_tokens: 3001,
            cached_tokens: Some(2000),
            completion_tokens: Some(1),
        });
        assert_eq!(feed(&[s.as_bytes()]).usage(), want);
        assert_eq!(feed_sized(s.as_bytes(), || 7), want);
    }

    #[test]
    fn a_usage_in_generated_text_is_escaped_and_never_read() {
        // The model wrote `"usage":{"prompt_tokens":1}`; the body escapes it.
        let text = r#"here: \"usage\":{\"prompt_tokens\":1} and \"usage\": {\"input_tokens\":2}"#;
        let body = vllm_answer(text, 100 * 1024);
        assert_eq!(feed(&[&body]).usage(), Some(VLLM_USAGE));
        assert_eq!(feed_sized(&body, || 1), Some(VLLM_USAGE));
        // Without the real one, nothing.
        let body = format!(r#"{{"choices":[{{"message":{{"content":"{text}"}}}}],"usage":null}}"#);
        assert_eq!(feed(&[body.as_bytes()]).usage(), None);
        assert_eq!(feed_sized(body.as_bytes(), || 1), None);
    }

    #[test]
    fn an_oversized_or_endless_usage_is_not_read() {
        // A usage object of `size` bytes, in a body.
        let sized = |size: usize| {
            let object = |pad: &str| {
                format!(
                    r#"{{"prompt_tokens":12,"pad":"{pad}","prompt_tokens_details":{{"cached_tokens":4}}}}"#
                )
            };
            let pad = "x".repeat(size - object("").len());
            format!(r#"{{"choices":[],"usage":{}}}"#, object(&pad))
        };
        let want = Some(Usage {
            prompt_tokens: 12,
            cached_tokens: Some(4),
            completion_tokens: None,
        });
        // One as long as the buffer is read; one byte longer is abandoned.
        for (size, want) in [
            (3000, want),
            (UsageScan::OBJECT_MAX, want),
            (UsageScan::OBJECT_MAX + 1, None),
            (3 * UsageScan::OBJECT_MAX, None),
        ] {
            let body = sized(size);
            assert_eq!(feed(&[body.as_bytes()]).usage(), want, "{size}");
            assert_eq!(feed_sized(body.as_bytes(), || 7), want, "{size}");
        }
        // One that never closes, or opens without end: no panic, nothing.
        let mut endless = br#"{"usage":{"prompt_tokens":12,"a":"#.to_vec();
        endless.extend(std::iter::repeat_n(b'{', 100_000));
        assert_eq!(feed(&[&endless]).usage(), None);
        assert_eq!(feed_sized(&endless, random_sizes(5, 100)), None);
        // Garbage after a good usage leaves the good one.
        let mut body = vllm_answer("hi", 50 * 1024);
        body.extend_from_slice(br#"{"usage":{"prompt_tokens":"#);
        body.extend(std::iter::repeat_n(b'7', 10_000));
        assert_eq!(feed(&[&body]).usage(), Some(VLLM_USAGE));
    }

    #[test]
    fn a_truncated_body_teaches_the_usage_it_holds_whole() {
        let body = vllm_answer("hi", 200 * 1024);
        let key = body.windows(KEY.len()).position(|w| w == KEY).unwrap();
        // Cut in the prompt logprobs: the usage was whole.
        let cut = &body[..body.len() / 2];
        assert_eq!(feed(&[cut]).usage(), Some(VLLM_USAGE));
        assert_eq!(feed_sized(cut, random_sizes(9, 300)), Some(VLLM_USAGE));
        // Cut inside the usage: nothing.
        for at in [key + 3, key + KEY.len() + 1, key + 40] {
            assert_eq!(feed(&[&body[..at]]).usage(), None, "cut at {at}");
        }
    }

    #[test]
    fn a_non_streamed_answer_ends_with_its_usage() {
        let body = br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1200,"total_tokens":1210,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":1024}},"prompt_logprobs":null,"kv_transfer_params":null}"#;
        let u = feed(&[&body[..40], &body[40..]]).usage().unwrap();
        assert_eq!(
            u,
            Usage {
                prompt_tokens: 1200,
                cached_tokens: Some(1024),
                completion_tokens: Some(10),
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
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 31750,
                cached_tokens: Some(2448),
                completion_tokens: Some(50),
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
                cached_tokens: Some(256),
                completion_tokens: Some(5),
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

    /// What the scan must find, read from the whole body at once without
    /// any of its shortcuts: each key in turn, the object after it (skipped
    /// whole when read whole, or up to the size limit when too long).
    fn reference(body: &[u8]) -> Vec<u8> {
        let mut last = Vec::new();
        let mut i = 0;
        while let Some(p) = body[i..].windows(KEY.len()).position(|w| w == KEY) {
            let mut j = i + p + KEY.len();
            while body.get(j).is_some_and(u8::is_ascii_whitespace) {
                j += 1;
            }
            if body.get(j) != Some(&b'{') {
                i = j;
                continue;
            }
            let (mut depth, mut in_string, mut escaped) = (0, false, false);
            let mut end = None;
            for (k, &b) in body[j..].iter().enumerate().take(UsageScan::OBJECT_MAX) {
                match (in_string, escaped, b) {
                    (true, true, _) => escaped = false,
                    (true, false, b'\\') => escaped = true,
                    (true, false, b'"') => in_string = false,
                    (true, ..) => {}
                    (false, _, b'"') => in_string = true,
                    (false, _, b'{') => depth += 1,
                    (false, _, b'}') => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some(j + k + 1);
                            break;
                        }
                    }
                    _ => {}
                }
            }
            match end {
                Some(e) => {
                    if names_prompt_tokens(&body[j..e]) {
                        last = body[j..e].to_vec();
                    }
                    i = e;
                }
                None if body.len() - j > UsageScan::OBJECT_MAX => i = j + UsageScan::OBJECT_MAX,
                None => break,
            }
        }
        last
    }

    #[test]
    fn the_scan_agrees_with_a_whole_body_search_whatever_the_chunking() {
        // Bodies made of pieces of keys and objects, to cut keys, strings
        // and escapes in every way.
        let pieces: [&[u8]; 17] = [
            b"\"usage\":",
            b"usage\":",
            b"\"usage\": ",
            b"\"usa",
            b"ge\":",
            b"\"usage\"",
            b"{",
            b"}",
            b"\"",
            b"\\\"",
            b"\\",
            b"\"prompt_tokens\":7",
            b"\"input_tokens\":3,",
            b"null",
            b" ",
            b"x",
            b"{\"prompt_tokens\":12,\"a\":\"}\\\"{\"}",
        ];
        let mut next = random_sizes(77, 1 << 30);
        let mut found = 0;
        for round in 0..3000 {
            let mut body = Vec::new();
            let len = next() % 200;
            for _ in 0..len {
                body.extend_from_slice(pieces[next() % pieces.len()]);
            }
            if round % 100 == 0 {
                // Now and then an object past the size limit.
                body.extend_from_slice(b"\"usage\":{\"prompt_tokens\":1,\"p\":\"");
                body.extend(std::iter::repeat_n(b'{', UsageScan::OBJECT_MAX));
                body.extend_from_slice(b"\"}\"usage\":{\"prompt_tokens\":2}");
            }
            let want = reference(&body);
            found += usize::from(!want.is_empty());
            let whole = feed(&[&body]);
            assert_eq!(whole.last, want, "{}", String::from_utf8_lossy(&body));
            for max in [1, 2, 7, 9, 100] {
                let mut sizes = random_sizes(round + 1, max);
                let mut t = UsageScan::default();
                let mut rest = &body[..];
                while !rest.is_empty() {
                    let (c, r) = rest.split_at(sizes().min(rest.len()));
                    t.push(c);
                    rest = r;
                }
                assert_eq!(t.last, want, "{max}: {}", String::from_utf8_lossy(&body));
            }
        }
        assert!(found > 1000, "{found}");
    }

    #[test]
    fn the_shifts_are_the_keys() {
        let (body, last) = KEY.split_at(KEY.len() - 1);
        assert_eq!(last, b":");
        for b in 0..=255u8 {
            let want = body
                .iter()
                .rposition(|&k| k == b)
                .map_or(KEY.len(), |i| body.len() - i);
            assert_eq!(shift(b), want, "{}", b as char);
        }
    }

    #[test]
    fn memory_is_two_buffers_allocated_once() {
        let mut s = String::new();
        for i in 0..2000 {
            s.push_str(&format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}],\"usage\":{{\"prompt_tokens\":900,\"completion_tokens\":{i}}}}}\n\n"));
        }
        let mut t = UsageScan::default();
        let mut buffers = None;
        for (n, c) in s.as_bytes().chunks(61).enumerate() {
            t.push(c);
            assert!(t.reading.capacity() <= UsageScan::OBJECT_MAX);
            assert!(t.last.capacity() <= UsageScan::OBJECT_MAX);
            let mut now = [t.reading.as_ptr(), t.last.as_ptr()];
            now.sort();
            if n > 100 {
                // The same two buffers, swapped as objects complete.
                assert_eq!(*buffers.get_or_insert(now), now, "chunk {n}");
            }
        }
        assert_eq!(t.usage().unwrap().prompt_tokens, 900);
        assert!(t.last.ends_with(b"\"completion_tokens\":1999}"));
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
