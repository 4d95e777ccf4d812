//! The trace format (JSONL, one request a line, sorted by time) and segment
//! expansion: how a request's `segments` become prompt text and a request
//! body. The live replayer (Python) expands segments the same way, byte for
//! byte, so a trace means the same prompts to the simulator and to real
//! engines.
//!
//! A segment `[id, n]` is `n` tokens of text derived from `id` alone:
//! `seed = FNV-1a 64 of id's UTF-8 bytes`; token k is 3 lowercase letters of
//! `mix(seed + k)` and a space, exactly 4 bytes. Two requests therefore share
//! a prompt prefix exactly when they share leading segments.

use serde::{Deserialize, Serialize};
use serde_json::json;

/// The `model` every generated request body names (the emulator's default).
pub const MODEL: &str = "emulated-model";

/// Bytes of text per segment token.
pub const BYTES_PER_TOKEN: usize = 4;

/// One line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// When the client sends the request, ms from the trace's start.
    pub t_ms: f64,
    /// Conversation (or agent run) the request belongs to.
    pub session: String,
    /// Where the client is; one of the fleet's `client_regions`.
    pub client_region: String,
    /// The caller's tier as the operator's auth layer would set it.
    pub tier: String,
    /// The prompt, in order: `[id, tokens]`.
    pub segments: Vec<(String, u32)>,
    /// `max_tokens` of the request; the engine generates exactly this many.
    pub output_tokens: u32,
}

impl TraceRequest {
    /// Prompt tokens as the segments count them.
    pub fn segment_tokens(&self) -> u64 {
        self.segments.iter().map(|(_, n)| u64::from(*n)).sum()
    }
}

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64's output function.
pub fn mix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Appends the text of segment `[id, tokens]` to `out`: 4 bytes per token.
pub fn push_segment_text(out: &mut String, id: &str, tokens: u32) {
    let seed = fnv1a64(id.as_bytes());
    out.reserve(tokens as usize * BYTES_PER_TOKEN);
    for k in 0..u64::from(tokens) {
        let x = mix(seed.wrapping_add(k));
        for shift in [0u32, 8, 16] {
            out.push(char::from(b'a' + ((x >> shift) % 26) as u8));
        }
        out.push(' ');
    }
}

/// The text of segment `[id, tokens]`.
pub fn segment_text(id: &str, tokens: u32) -> String {
    let mut s = String::new();
    push_segment_text(&mut s, id, tokens);
    s
}

/// The prompt: the segments' texts concatenated in order.
pub fn prompt_text(segments: &[(String, u32)]) -> String {
    let mut s = String::new();
    for (id, n) in segments {
        push_segment_text(&mut s, id, *n);
    }
    s
}

/// The OpenAI chat completion body sent for a request.
pub fn request_body(req: &TraceRequest) -> Vec<u8> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(&req.segments)}],
        "max_tokens": req.output_tokens,
        "stream": true,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Parses a trace; the error names the line and what is wrong with it.
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out: Vec<TraceRequest> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(line)
            .map_err(|e| format!("line {n}: not a trace request: {e}"))?;
        if !(r.t_ms.is_finite() && r.t_ms >= 0.0) {
            return Err(format!("line {n}: t_ms {} must be a number >= 0", r.t_ms));
        }
        if let Some(prev) = out.last() {
            if r.t_ms < prev.t_ms {
                return Err(format!(
                    "line {n}: t_ms {} is before the previous line's {}; the trace must be sorted by time",
                    r.t_ms, prev.t_ms
                ));
            }
        }
        if r.session.is_empty() {
            return Err(format!("line {n}: session must not be empty"));
        }
        if r.segments.is_empty() {
            return Err(format!("line {n}: segments must name at least one segment"));
        }
        if let Some((id, _)) = r.segments.iter().find(|(_, t)| *t == 0) {
            return Err(format!("line {n}: segment {id:?} has 0 tokens"));
        }
        if r.output_tokens == 0 {
            return Err(format!("line {n}: output_tokens must be at least 1"));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err("the trace holds no request".to_string());
    }
    Ok(out)
}

/// Serialises a trace as JSONL.
pub fn to_jsonl(trace: &[TraceRequest]) -> String {
    let mut s = String::new();
    for r in trace {
        s.push_str(&serde_json::to_string(r).unwrap_or_default());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_text_is_fixed_by_the_spec() {
        // Pinned bytes: the Python replayer checks itself against these.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let t = segment_text("sys-3", 4);
        assert_eq!(t.len(), 16);
        assert_eq!(t, FIRST_SYS3);
        assert!(t
            .as_bytes()
            .chunks(4)
            .all(|c| c[..3].iter().all(u8::is_ascii_lowercase) && c[3] == b' '));
        // A longer segment starts with the shorter one's text.
        assert!(segment_text("sys-3", 100).starts_with(&t));
        assert_ne!(segment_text("sys-4", 4), t);
    }

    const FIRST_SYS3: &str = "dvf pvu moc oxc ";

    #[test]
    fn shared_leading_segments_share_the_prefix_exactly() {
        let a = prompt_text(&[("sys-3".into(), 10), ("doc-1".into(), 20)]);
        let b = prompt_text(&[("sys-3".into(), 10), ("doc-2".into(), 20)]);
        assert_eq!(a.len(), 120);
        assert_eq!(a[..40], b[..40]);
        assert_ne!(a[40..44], b[40..44]);
    }

    #[test]
    fn body_is_an_openai_chat_completion() {
        let r = TraceRequest {
            t_ms: 0.0,
            session: "s1".into(),
            client_region: "na".into(),
            tier: "paid".into(),
            segments: vec![("sys-3".into(), 3)],
            output_tokens: 7,
        };
        let v: serde_json::Value = serde_json::from_slice(&request_body(&r)).unwrap();
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["stream"], true);
        assert_eq!(v["messages"][0]["role"], "user");
        assert_eq!(v["messages"][0]["content"], segment_text("sys-3", 3));
    }

    #[test]
    fn parse_checks_order_and_fields() {
        let line = |t: f64| {
            format!(
                r#"{{"t_ms": {t}, "session": "s1", "client_region": "na", "tier": "paid", "segments": [["sys-3", 1200], ["s1-u0", 181]], "output_tokens": 274}}"#
            )
        };
        let ok = parse(&format!("{}\n\n{}\n", line(1.5), line(1.5))).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok[0].segments[1], ("s1-u0".to_string(), 181));
        assert_eq!(parse(&to_jsonl(&ok)).unwrap(), ok);
        let e = parse(&format!("{}\n{}\n", line(2.0), line(1.0))).unwrap_err();
        assert!(e.starts_with("line 2: t_ms 1 is before"), "{e}");
        assert!(parse("{}").unwrap_err().starts_with("line 1:"));
        assert!(parse("").is_err());
    }
}
