//! The OpenAI wire format as the emulator speaks it: reading the fields that
//! matter from a request (the prompt's token ids through the engine's own
//! tokenizer and chat template, output length, streaming) and building
//! response, stream-chunk, model-list and error bodies, with `usage` as vLLM
//! or SGLang report it. Pure, so a simulator derives the same tokens from
//! the same requests.

use serde_json::{json, Map, Value};

use crate::config::Mode;
use crate::tokenizer;

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
    /// The prompt as the engine tokenizes it (template included).
    pub prompt: Vec<u32>,
    /// `max_completion_tokens` or `max_tokens` as the client sent it, for the
    /// context-length check.
    pub requested_max_tokens: Option<usize>,
    /// Output length generated: the request's, clamped.
    pub max_tokens: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// The `model` the request names, if a string.
    pub model: Option<String>,
}

/// Parses a request body; the error is a message for a 400 response.
pub fn parse_request(kind: Kind, body: &[u8]) -> Result<InferenceRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| "request body must be a JSON object".to_string())?;
    let prompt = match kind {
        Kind::Chat => tokenizer::chat(
            obj.get("messages")
                .ok_or_else(|| "'messages' is required".to_string())?,
        )?,
        Kind::Completion => tokenizer::completion(
            obj.get("prompt")
                .ok_or_else(|| "'prompt' is required".to_string())?,
        )?,
    };
    // max_completion_tokens is the newer name; it wins when both are given.
    let requested_max_tokens = match optional_count(obj, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => optional_count(obj, "max_tokens")?,
    };
    let max_tokens = requested_max_tokens
        .unwrap_or(DEFAULT_MAX_TOKENS)
        .clamp(1, MAX_OUTPUT_TOKENS);
    let stream = optional_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(opts)) => optional_bool(opts, "include_usage")?.unwrap_or(false),
        Some(_) => return Err("'stream_options' must be an object".to_string()),
    };
    let model = obj.get("model").and_then(Value::as_str).map(str::to_string);
    Ok(InferenceRequest {
        model,
        kind,
        prompt,
        requested_max_tokens,
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

/// The engine's refusal of a prompt that does not fit the context (HTTP
/// 400, `BadRequestError`), in its own words, or `None` when it fits. vLLM:
/// the prompt alone must leave room for one output token, and with an
/// explicit output length prompt plus output must fit. SGLang: the same two
/// checks, its wording.
pub fn context_error(req: &InferenceRequest, max_model_len: usize, mode: Mode) -> Option<String> {
    let input = req.prompt.len();
    if input >= max_model_len {
        return Some(match mode {
            Mode::Vllm => format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has {input} input tokens. Please reduce the length of the input messages."
            ),
            Mode::Sglang => format!(
                "The input ({input} tokens) is longer than the model's context length ({max_model_len} tokens)."
            ),
        });
    }
    match req.requested_max_tokens {
        Some(out) if input.saturating_add(out) > max_model_len => Some(match mode {
            Mode::Vllm => format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {out}. This model's maximum context length is {max_model_len} tokens and your request has {input} input tokens ({out} > {max_model_len} - {input})."
            ),
            Mode::Sglang => format!(
                "Requested token count exceeds the model's maximum context length of {max_model_len} tokens. You requested a total of {} tokens: {input} tokens from the input messages and {out} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                input.saturating_add(out)
            ),
        }),
        _ => None,
    }
}

/// The 400 body carrying a context-length refusal: vLLM's
/// `{"error": {...}}` or SGLang's flat `{"object": "error", ...}`, both
/// with `type` `BadRequestError` and `code` 400.
pub fn context_error_body(message: &str, mode: Mode) -> Vec<u8> {
    let inner = json!({"message": message, "type": "BadRequestError", "param": null, "code": 400});
    match mode {
        Mode::Vllm => to_bytes(&json!({ "error": inner })),
        Mode::Sglang => {
            let mut flat = inner;
            if let Value::Object(m) = &mut flat {
                m.insert("object".to_string(), json!("error"));
            }
            to_bytes(&flat)
        }
    }
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
    pub report: CacheReport,
}

/// Whether and how `usage` tells the client how many prompt tokens came
/// from the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheReport {
    /// Neither engine reports it by default.
    Off,
    /// vLLM `--enable-prompt-tokens-details`: `prompt_tokens_details:
    /// {cached_tokens}` when at least one token hit, absent otherwise.
    VllmPromptTokensDetails,
    /// SGLang `--enable-cache-report`: `prompt_tokens_details:
    /// {cached_tokens}` on every response, 0 included.
    SglangCacheReport,
}

impl Usage {
    fn to_json(self) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(self.completion_tokens),
            "completion_tokens": self.completion_tokens,
        });
        let details = match self.report {
            CacheReport::Off => false,
            CacheReport::VllmPromptTokensDetails => self.cached_tokens > 0,
            CacheReport::SglangCacheReport => true,
        };
        if let (true, Value::Object(map)) = (details, &mut usage) {
            map.insert(
                "prompt_tokens_details".to_string(),
                json!({"cached_tokens": self.cached_tokens}),
            );
        }
        usage
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

/// `GET /v1/models` body: the served model, then each LoRA adapter as
/// vLLM lists them (`parent` the model, no `max_model_len` of its own).
pub fn model_list(
    model: &str,
    loras: &[String],
    owned_by: &str,
    created: u64,
    max_model_len: usize,
) -> Vec<u8> {
    let mut data = vec![json!({"id": model, "object": "model", "created": created,
        "owned_by": owned_by, "root": model, "parent": null, "max_model_len": max_model_len})];
    data.extend(loras.iter().map(|l| {
        json!({"id": l, "object": "model", "created": created, "owned_by": owned_by,
               "root": l, "parent": model, "max_model_len": null})
    }));
    to_bytes(&json!({"object": "list", "data": data}))
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
    fn prompts_are_the_engines_tokens() {
        let messages = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "hello "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": null}
        ]);
        let r = chat(json!({ "messages": messages })).unwrap();
        assert_eq!(r.prompt, tokenizer::chat(&messages).unwrap());
        assert_eq!(
            (
                r.max_tokens,
                r.requested_max_tokens,
                r.stream,
                r.include_usage
            ),
            (16, None, false, false)
        );
        let c = parse_request(Kind::Completion, br#"{"prompt": [1, 258]}"#).unwrap();
        assert_eq!(c.prompt, vec![1, 258]);
    }

    #[test]
    fn context_limit_refused_in_vllms_words() {
        let r = |n: usize, max: Option<usize>| InferenceRequest {
            kind: Kind::Completion,
            prompt: vec![1; n],
            requested_max_tokens: max,
            max_tokens: 16,
            stream: false,
            include_usage: false,
            model: None,
        };
        let v = Mode::Vllm;
        assert_eq!(context_error(&r(99, None), 100, v), None);
        assert_eq!(context_error(&r(90, Some(10)), 100, v), None);
        assert_eq!(
            context_error(&r(100, None), 100, v).unwrap(),
            "This model's maximum context length is 100 tokens. However, your request has 100 input tokens. Please reduce the length of the input messages."
        );
        assert_eq!(
            context_error(&r(90, Some(11)), 100, v).unwrap(),
            "'max_tokens' or 'max_completion_tokens' is too large: 11. This model's maximum context length is 100 tokens and your request has 90 input tokens (11 > 100 - 90)."
        );
        let sg = context_error(&r(100, None), 100, Mode::Sglang).unwrap();
        assert_eq!(
            sg,
            "The input (100 tokens) is longer than the model's context length (100 tokens)."
        );
        assert!(context_error(&r(90, Some(11)), 100, Mode::Sglang)
            .unwrap()
            .contains("total of 101 tokens"));
        let b: Value = serde_json::from_slice(&context_error_body("m", v)).unwrap();
        assert_eq!(b["error"]["type"], "BadRequestError");
        assert_eq!(b["error"]["code"], 400);
        let b: Value = serde_json::from_slice(&context_error_body("m", Mode::Sglang)).unwrap();
        assert_eq!(
            (b["object"].as_str(), b["code"].as_u64()),
            (Some("error"), Some(400))
        );
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
            report: CacheReport::VllmPromptTokensDetails,
        };
        let v: Value =
            serde_json::from_slice(&full_response(Kind::Chat, &meta, " a b", usage)).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], " a b");
        assert_eq!(v["usage"]["total_tokens"], 12);
        // vLLM omits the details when nothing hit; SGLang always reports.
        assert!(v["usage"].get("prompt_tokens_details").is_none());
        let hit = Usage {
            cached_tokens: 8,
            ..usage
        };
        let v: Value = serde_json::from_slice(&full_response(Kind::Chat, &meta, "", hit)).unwrap();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        let off = Usage {
            report: CacheReport::Off,
            ..hit
        };
        let chunk = usage_chunk(Kind::Chat, &meta, off);
        let v: Value = serde_json::from_slice(&chunk[6..chunk.len() - 2]).unwrap();
        assert!(v["usage"].get("prompt_tokens_details").is_none());
        assert_eq!(v["choices"], json!([]));
        let sg = Usage {
            report: CacheReport::SglangCacheReport,
            ..usage
        };
        let v: Value = serde_json::from_slice(&full_response(Kind::Chat, &meta, "", sg)).unwrap();
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
