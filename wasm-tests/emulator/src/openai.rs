//! The OpenAI wire format as the emulator speaks it: reading the fields that
//! matter from a request (canonical prompt text, output length, streaming)
//! and building response, stream-chunk, model-list and error bodies. Pure,
//! so a simulator can derive the same prompt text from the same requests.

use serde_json::{json, Map, Value};

/// Output length when the request does not say.
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Upper bound on output length, to keep a test from pinning a slot forever.
pub const MAX_OUTPUT_TOKENS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// The parts of an inference request the engine model needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InferenceRequest {
    pub kind: Kind,
    pub prompt_text: Vec<u8>,
    pub max_tokens: usize,
    pub stream: bool,
    pub include_usage: bool,
}

/// Parses a request body; the error is a message for a 400 response.
pub fn parse_request(kind: Kind, body: &[u8]) -> Result<InferenceRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| "request body must be a JSON object".to_string())?;
    let prompt_text = match kind {
        Kind::Chat => chat_text(
            obj.get("messages")
                .ok_or_else(|| "'messages' is required".to_string())?,
        )?,
        Kind::Completion => completion_text(
            obj.get("prompt")
                .ok_or_else(|| "'prompt' is required".to_string())?,
        )?,
    };
    // max_completion_tokens is the newer name; it wins when both are given.
    let max_tokens = match optional_count(obj, "max_completion_tokens")? {
        Some(n) => n,
        None => optional_count(obj, "max_tokens")?.unwrap_or(DEFAULT_MAX_TOKENS),
    }
    .clamp(1, MAX_OUTPUT_TOKENS);
    let stream = optional_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(opts)) => optional_bool(opts, "include_usage")?.unwrap_or(false),
        Some(_) => return Err("'stream_options' must be an object".to_string()),
    };
    Ok(InferenceRequest {
        kind,
        prompt_text,
        max_tokens,
        stream,
        include_usage,
    })
}

fn optional_count(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(usize::try_from(n).unwrap_or(usize::MAX)))
            .ok_or_else(|| format!("'{key}' must be a non-negative integer")),
    }
}

fn optional_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(format!("'{key}' must be a boolean")),
    }
}

/// Chat canonical text: per message `role\ntext\n`, where text is the content
/// string or the concatenated `text` of its `"type":"text"` parts.
pub fn chat_text(messages: &Value) -> Result<Vec<u8>, String> {
    let list = messages
        .as_array()
        .ok_or_else(|| "'messages' must be an array".to_string())?;
    let mut out = Vec::new();
    for msg in list {
        let msg = msg
            .as_object()
            .ok_or_else(|| "each message must be an object".to_string())?;
        if let Some(role) = msg.get("role").and_then(Value::as_str) {
            out.extend_from_slice(role.as_bytes());
        }
        out.push(b'\n');
        match msg.get("content") {
            Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
            Some(Value::Array(parts)) => {
                for part in parts {
                    if part.get("type").and_then(Value::as_str) == Some("text") {
                        if let Some(t) = part.get("text").and_then(Value::as_str) {
                            out.extend_from_slice(t.as_bytes());
                        }
                    }
                }
            }
            // Null/absent content (e.g. assistant tool calls) contributes nothing.
            _ => {}
        }
        out.push(b'\n');
    }
    Ok(out)
}

/// Completions canonical text: the prompt string; an array of strings joined
/// by "\n"; token ids as 4 little-endian bytes each (so one id = one token);
/// a batch of token-id arrays concatenated.
pub fn completion_text(prompt: &Value) -> Result<Vec<u8>, String> {
    const BAD: &str = "'prompt' must be a string, an array of strings, or token ids";
    match prompt {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Array(items) => {
            let mut out = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(s) => {
                        if i > 0 {
                            out.push(b'\n');
                        }
                        out.extend_from_slice(s.as_bytes());
                    }
                    Value::Number(_) => push_token_id(&mut out, item).ok_or(BAD)?,
                    Value::Array(ids) => {
                        for id in ids {
                            push_token_id(&mut out, id).ok_or(BAD)?;
                        }
                    }
                    _ => return Err(BAD.to_string()),
                }
            }
            Ok(out)
        }
        _ => Err(BAD.to_string()),
    }
}

fn push_token_id(out: &mut Vec<u8>, id: &Value) -> Option<()> {
    let id = u32::try_from(id.as_u64()?).ok()?;
    out.extend_from_slice(&id.to_le_bytes());
    Some(())
}

/// Filler vocabulary; token i is word i mod N, so output is deterministic.
const WORDS: [&str; 16] = [
    "the", "quick", "replica", "answers", "with", "steady", "tokens", "while", "routers",
    "measure", "latency", "across", "distant", "regions", "and", "caches",
];

/// Text of output token `i` (each word is one token, space-prefixed).
pub fn token_text(i: usize) -> String {
    let word = WORDS.get(i % WORDS.len()).copied().unwrap_or("token");
    format!(" {word}")
}

pub fn output_text(tokens: usize) -> String {
    (0..tokens).map(token_text).collect()
}

/// Token accounting reported in `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(self.completion_tokens),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Identity fields shared by every body of one response.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// Complete (non-streaming) response body.
pub fn full_response(kind: Kind, meta: &ResponseMeta, text: &str, usage: Usage) -> Vec<u8> {
    let (object, choice) = match kind {
        Kind::Chat => (
            "chat.completion",
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": "length"}),
        ),
        Kind::Completion => (
            "text_completion",
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}),
        ),
    };
    to_bytes(&json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [choice], "usage": usage.to_json(),
    }))
}

/// One SSE event carrying `text`; the first chat chunk also carries the role,
/// the last one the finish reason (as vLLM does).
pub fn stream_chunk(
    kind: Kind,
    meta: &ResponseMeta,
    text: &str,
    first: bool,
    last: bool,
) -> Vec<u8> {
    let finish = if last { json!("length") } else { Value::Null };
    let (object, choice) = match kind {
        Kind::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            (
                "chat.completion.chunk",
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            )
        }
        Kind::Completion => (
            "text_completion",
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
        ),
    };
    sse(&json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [choice],
    }))
}

/// The trailing usage-only event sent when `stream_options.include_usage`.
pub fn usage_chunk(kind: Kind, meta: &ResponseMeta, usage: Usage) -> Vec<u8> {
    let object = match kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    sse(&json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [], "usage": usage.to_json(),
    }))
}

pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

fn sse(v: &Value) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(&to_bytes(v));
    out.extend_from_slice(b"\n\n");
    out
}

/// `GET /v1/models` body.
pub fn model_list(model: &str, owned_by: &str, created: u64) -> Vec<u8> {
    to_bytes(&json!({
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": owned_by,
                  "root": model, "parent": null}],
    }))
}

/// OpenAI error body.
pub fn error_body(message: &str, kind: &str) -> Vec<u8> {
    to_bytes(&json!({
        "error": {"message": message, "type": kind, "param": null, "code": null}
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<InferenceRequest, String> {
        parse_request(Kind::Chat, body.to_string().as_bytes())
    }

    #[test]
    fn chat_canonical_text() {
        let r = chat(json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "hello "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": null}
        ]}))
        .unwrap();
        assert_eq!(
            r.prompt_text,
            b"system\nbe brief\nuser\nhello world\nassistant\n\n"
        );
        assert_eq!(
            (r.max_tokens, r.stream, r.include_usage),
            (16, false, false)
        );
    }

    #[test]
    fn completion_canonical_text() {
        let t = |p: Value| completion_text(&p).unwrap();
        assert_eq!(t(json!("abc")), b"abc");
        assert_eq!(t(json!(["a", "b"])), b"a\nb");
        assert_eq!(t(json!([1, 258])), vec![1, 0, 0, 0, 2, 1, 0, 0]);
        assert_eq!(t(json!([[1], [2]])), vec![1, 0, 0, 0, 2, 0, 0, 0]);
        assert!(completion_text(&json!(5)).is_err());
        assert!(completion_text(&json!([-1])).is_err());
    }

    #[test]
    fn output_length_and_flags() {
        let r = chat(json!({"messages": [], "max_tokens": 5, "stream": true,
                            "stream_options": {"include_usage": true}}))
        .unwrap();
        assert_eq!((r.max_tokens, r.stream, r.include_usage), (5, true, true));
        let r = chat(json!({"messages": [], "max_tokens": 5, "max_completion_tokens": 7})).unwrap();
        assert_eq!(r.max_tokens, 7);
        assert_eq!(
            chat(json!({"messages": [], "max_tokens": 100000}))
                .unwrap()
                .max_tokens,
            4096
        );
        assert_eq!(
            chat(json!({"messages": [], "max_tokens": 0}))
                .unwrap()
                .max_tokens,
            1
        );
    }

    #[test]
    fn invalid_requests_are_rejected() {
        assert!(parse_request(Kind::Chat, b"{not json").is_err());
        assert!(parse_request(Kind::Chat, b"[]").is_err());
        assert!(chat(json!({})).is_err());
        assert!(chat(json!({"messages": "hi"})).is_err());
        assert!(chat(json!({"messages": [1]})).is_err());
        assert!(chat(json!({"messages": [], "max_tokens": -1})).is_err());
        assert!(chat(json!({"messages": [], "max_tokens": 1.5})).is_err());
        assert!(chat(json!({"messages": [], "stream": "yes"})).is_err());
        assert!(parse_request(Kind::Completion, b"{\"messages\":[]}").is_err());
    }

    #[test]
    fn bodies_look_like_openai() {
        let meta = ResponseMeta {
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
        };
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 0,
        };
        let v: Value =
            serde_json::from_slice(&full_response(Kind::Chat, &meta, " a b", usage)).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], " a b");
        assert_eq!(v["usage"]["total_tokens"], 12);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let chunk = stream_chunk(Kind::Chat, &meta, " a", true, false);
        assert!(chunk.starts_with(b"data: {") && chunk.ends_with(b"}\n\n"));
        let v: Value = serde_json::from_slice(&chunk[6..chunk.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        let e: Value = serde_json::from_slice(&error_body("x", "invalid_request_error")).unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert!(e["error"]["code"].is_null());
        assert_eq!(output_text(2), " the quick");
    }
}
