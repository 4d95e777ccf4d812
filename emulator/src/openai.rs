//! The OpenAI wire format as the emulator speaks it: reading the fields that
//! matter from a request (the prompt's token ids through the engine's own
//! tokenizer and chat template, output length, streaming) and building
//! response, stream-chunk, model-list and error bodies, with `usage` as vLLM
//! or SGLang report it. Pure, so a simulator derives the same tokens from
//! the same requests.

use serde_json::{json, Map, Value};

use crate::config::Mode;
use crate::refusal::Refusal;
use crate::tokenizer;

/// Output length when the request does not say.
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Upper bound on output length, to keep a test from pinning a slot forever.
pub const MAX_OUTPUT_TOKENS: usize = 4096;
/// vLLM 0.32's `system_fingerprint`: its version, then (here) the
/// emulator's mark where vLLM puts a hash of its configuration.
pub const SYSTEM_FINGERPRINT: &str = "vllm-0.32.0-emulated";

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
    /// Which of the two it was (vLLM names it in its refusals).
    pub max_tokens_field: &'static str,
    /// `cache_salt`: keys the prompt's blocks apart (vLLM).
    pub cache_salt: Option<String>,
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
    let (requested_max_tokens, max_tokens_field) =
        match optional_count(obj, "max_completion_tokens")? {
            Some(n) => (Some(n), "max_completion_tokens"),
            None => (optional_count(obj, "max_tokens")?, "max_tokens"),
        };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err("'cache_salt' must be a non-empty string".to_string()),
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
        max_tokens_field,
        cache_salt,
        max_tokens,
        stream,
        include_usage,
    })
}

/// Tokens generated: what the request asks (or the default), cut where
/// the context ends, as both engines cut a generation that reaches it
/// (`finish_reason` "length"); at least 1.
pub fn output_tokens(req: &InferenceRequest, max_model_len: usize) -> usize {
    let room = max_model_len.saturating_sub(req.prompt.len());
    req.max_tokens.min(room).max(1)
}

/// vLLM 0.32's context rule for a generating request of `prompt` tokens
/// asking for `requested` output tokens (the field the client used and
/// its value), or `None` when it is served: an output limit above the
/// context is refused first, then a prompt longer than the context (the
/// value vLLM reports is always `max_model_len + 1`: it stops counting
/// there); a prompt that leaves no room, or an explicit 0, gets
/// SamplingParams' "at least 1". Anything else is served, its output cut
/// at the context. Each refusal a 400 `BadRequestError` whose `param` is
/// the field at fault.
pub fn vllm_context_refusal(
    prompt: usize,
    requested: Option<(&str, usize)>,
    max_model_len: usize,
) -> Option<Refusal> {
    if let Some((field, n)) = requested.filter(|(_, n)| *n > max_model_len) {
        let msg = format!(
            "{field}={n} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens. (parameter={field}, value={n})"
        );
        return Some(Refusal::nested(400, &msg, "BadRequestError", Some(field)));
    }
    if prompt > max_model_len {
        let at_least = max_model_len.saturating_add(1);
        let msg = format!(
            "This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least {at_least} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={at_least})"
        );
        return Some(Refusal::nested(
            400,
            &msg,
            "BadRequestError",
            Some("input_tokens"),
        ));
    }
    if prompt == max_model_len || requested.is_some_and(|(_, n)| n == 0) {
        let msg = "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)";
        return Some(Refusal::nested(
            400,
            msg,
            "BadRequestError",
            Some("max_tokens"),
        ));
    }
    None
}

/// The engine's refusal of a request that does not fit the context, or
/// `None` when it is served: vLLM 0.32's rule ([`vllm_context_refusal`]),
/// or SGLang's ([`context_error`] in its flat shape).
pub fn context_refusal(
    req: &InferenceRequest,
    max_model_len: usize,
    mode: Mode,
) -> Option<Refusal> {
    match mode {
        Mode::Vllm => vllm_context_refusal(
            req.prompt.len(),
            req.requested_max_tokens.map(|n| (req.max_tokens_field, n)),
            max_model_len,
        ),
        Mode::Sglang => context_error(req, max_model_len, mode).map(|msg| Refusal {
            status: 400,
            body: context_error_body(&msg, mode),
        }),
    }
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

/// SGLang's refusal of a prompt that does not fit the context (HTTP 400,
/// `BadRequestError`), in its own words, or `None` when it fits: the prompt
/// alone must leave room for one output token, and with an explicit output
/// length prompt plus output must fit. (`Mode::Vllm` gives the wording of
/// vLLM before 0.32, which had the same rule; 0.32 is
/// [`vllm_context_refusal`].)
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
    /// vLLM 0.32's `created_cache_tokens`: the chat endpoint reports the
    /// tokens of the prompt's blocks this request added to the cache; the
    /// completions endpoint reports null (`None`).
    pub created_tokens: Option<usize>,
    pub report: CacheReport,
}

/// Whether and how `usage` tells the client how many prompt tokens came
/// from the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheReport {
    /// SGLang without `--enable-cache-report`: no details.
    Off,
    /// vLLM without `--enable-prompt-tokens-details`: `prompt_tokens_details`
    /// null (absent in a stream, which leaves nulls out).
    VllmOff,
    /// vLLM 0.32 `--enable-prompt-tokens-details`: `prompt_tokens_details:
    /// {cached_tokens, created_cache_tokens, multimodal_tokens}` on every
    /// answer, 0 included (a stream leaves the nulls out).
    VllmPromptTokensDetails,
    /// SGLang `--enable-cache-report`: `prompt_tokens_details:
    /// {cached_tokens}` on every response, 0 included.
    SglangCacheReport,
}

impl CacheReport {
    /// The vLLM dialect (vLLM 0.32's answer and chunk fields).
    pub fn is_vllm(self) -> bool {
        matches!(
            self,
            CacheReport::VllmOff | CacheReport::VllmPromptTokensDetails
        )
    }
}

impl Usage {
    /// `usage` as a complete answer carries it; `streamed`: as a stream's
    /// last chunk does (vLLM leaves nulls out there).
    fn to_json(self, streamed: bool) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(self.completion_tokens),
            "completion_tokens": self.completion_tokens,
        });
        let Value::Object(map) = &mut usage else {
            return usage;
        };
        let details = match (self.report, streamed) {
            (CacheReport::Off, _) | (CacheReport::VllmOff, true) => None,
            (CacheReport::VllmOff, false) => Some(Value::Null),
            (CacheReport::VllmPromptTokensDetails, false) => Some(json!({
                "cached_tokens": self.cached_tokens,
                "created_cache_tokens": self.created_tokens,
                "multimodal_tokens": null,
            })),
            (CacheReport::VllmPromptTokensDetails, true) => {
                let mut d = json!({"cached_tokens": self.cached_tokens});
                if let (Some(n), Value::Object(m)) = (self.created_tokens, &mut d) {
                    m.insert("created_cache_tokens".to_string(), json!(n));
                }
                Some(d)
            }
            (CacheReport::SglangCacheReport, _) => {
                Some(json!({"cached_tokens": self.cached_tokens}))
            }
        };
        if let Some(d) = details {
            map.insert("prompt_tokens_details".to_string(), d);
        }
        if self.report.is_vllm() && !streamed {
            map.insert("completion_tokens_details".to_string(), Value::Null);
        }
        usage
    }
}

/// A JSON object with its keys in the order given, each value already
/// serialized (the emulator's serde_json sorts a map's keys; vLLM's
/// pydantic models keep their field order, which a client reading a body
/// as it arrives can see: `usage` before `prompt_token_ids`, say).
pub fn ordered(pairs: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = b"{".to_vec();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend(to_bytes(&json!(k)));
        out.push(b':');
        out.extend_from_slice(v);
    }
    out.push(b'}');
    out
}

/// A value, serialized for [`ordered`].
pub fn j(v: Value) -> Vec<u8> {
    to_bytes(&v)
}

/// A one-element array of a serialized value.
fn one(item: Vec<u8>) -> Vec<u8> {
    let mut out = b"[".to_vec();
    out.extend(item);
    out.push(b']');
    out
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

/// Complete (non-streaming) response body; in vLLM's dialect (by
/// `usage.report`) with vLLM 0.32's fields, in its order.
pub fn full_response(kind: Kind, meta: &ResponseMeta, text: &str, usage: Usage) -> Vec<u8> {
    if usage.report.is_vllm() {
        return vllm_full_response(kind, meta, text, usage);
    }
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
        "choices": [choice], "usage": usage.to_json(false),
    }))
}

fn head(meta: &ResponseMeta, object: &str) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("id", j(json!(meta.id))),
        ("object", j(json!(object))),
        ("created", j(json!(meta.created))),
        ("model", j(json!(meta.model))),
    ]
}

const NULL: &[u8] = b"null";

fn null() -> Vec<u8> {
    NULL.to_vec()
}

fn vllm_full_response(kind: Kind, meta: &ResponseMeta, text: &str, usage: Usage) -> Vec<u8> {
    let mut fields = match kind {
        Kind::Chat => {
            let message = ordered(&[
                ("role", j(json!("assistant"))),
                ("content", j(json!(text))),
                ("refusal", null()),
                ("annotations", null()),
                ("audio", null()),
                ("function_call", null()),
                ("reasoning", null()),
            ]);
            let choice = ordered(&[
                ("index", j(json!(0))),
                ("message", message),
                ("logprobs", null()),
                ("finish_reason", j(json!("length"))),
                ("stop_reason", null()),
                ("token_ids", null()),
                ("routed_experts", null()),
            ]);
            let mut f = head(meta, "chat.completion");
            f.push(("choices", one(choice)));
            f
        }
        Kind::Completion => {
            let choice = ordered(&[
                ("index", j(json!(0))),
                ("text", j(json!(text))),
                ("logprobs", null()),
                ("finish_reason", j(json!("length"))),
                ("stop_reason", null()),
                ("token_ids", null()),
                ("prompt_logprobs", null()),
                ("prompt_token_ids", null()),
                ("routed_experts", null()),
            ]);
            let mut f = head(meta, "text_completion");
            f.push(("choices", one(choice)));
            f
        }
    };
    fields.push(("service_tier", null()));
    fields.push(("system_fingerprint", j(json!(SYSTEM_FINGERPRINT))));
    fields.push(("usage", j(usage.to_json(false))));
    if kind == Kind::Chat {
        fields.push(("prompt_logprobs", null()));
        fields.push(("prompt_token_ids", null()));
        fields.push(("prompt_text", null()));
    }
    fields.push(("kv_transfer_params", null()));
    fields.push(("ec_transfer_params", null()));
    fields.push(("metrics", null()));
    ordered(&fields)
}

/// The chunks of output token `i` of a vLLM 0.32 stream: a chat stream
/// opens with a chunk of its own carrying the role and no text; each
/// token chunk has `token_ids`, the last one the finish reason and
/// `stop_reason`, and `system_fingerprint` when no usage chunk follows
/// (`closes`).
pub fn vllm_stream_chunks(
    kind: Kind,
    meta: &ResponseMeta,
    text: &str,
    first: bool,
    last: bool,
    closes: bool,
) -> Vec<u8> {
    let mut out = Vec::new();
    let finish = if last { j(json!("length")) } else { null() };
    match kind {
        Kind::Chat => {
            if first {
                let choice = ordered(&[
                    ("index", j(json!(0))),
                    ("delta", j(json!({"role": "assistant", "content": ""}))),
                    ("logprobs", null()),
                    ("finish_reason", null()),
                ]);
                let mut f = head(meta, "chat.completion.chunk");
                f.push(("choices", one(choice)));
                f.push(("prompt_token_ids", null()));
                f.push(("prompt_text", null()));
                out.extend(sse_bytes(&ordered(&f)));
            }
            let mut choice = vec![
                ("index", j(json!(0))),
                ("delta", j(json!({"content": text}))),
                ("logprobs", null()),
                ("finish_reason", finish),
            ];
            if last {
                choice.push(("stop_reason", null()));
            }
            choice.push(("token_ids", null()));
            let mut f = head(meta, "chat.completion.chunk");
            f.push(("choices", one(ordered(&choice))));
            if last && closes {
                f.push(("system_fingerprint", j(json!(SYSTEM_FINGERPRINT))));
            }
            out.extend(sse_bytes(&ordered(&f)));
        }
        Kind::Completion => {
            let choice = ordered(&[
                ("index", j(json!(0))),
                ("text", j(json!(text))),
                ("logprobs", null()),
                ("finish_reason", finish),
                ("stop_reason", null()),
                ("prompt_token_ids", null()),
                ("token_ids", null()),
            ]);
            let mut f = head(meta, "text_completion");
            f.push(("choices", one(choice)));
            if last && closes {
                f.push(("system_fingerprint", j(json!(SYSTEM_FINGERPRINT))));
            }
            out.extend(sse_bytes(&ordered(&f)));
        }
    }
    out
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
    if usage.report.is_vllm() {
        let mut f = head(meta, object);
        f.push(("choices", b"[]".to_vec()));
        f.push(("usage", j(usage.to_json(true))));
        f.push(("system_fingerprint", j(json!(SYSTEM_FINGERPRINT))));
        return sse_bytes(&ordered(&f));
    }
    sse(&json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [], "usage": usage.to_json(true),
    }))
}

pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

fn sse(v: &Value) -> Vec<u8> {
    sse_bytes(&to_bytes(v))
}

fn sse_bytes(json: &[u8]) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(json);
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
    let mut card = json!({"id": model, "object": "model", "created": created,
        "owned_by": owned_by, "root": model, "parent": null, "max_model_len": max_model_len});
    if let (Value::Object(m), "vllm") = (&mut card, owned_by) {
        // vLLM's ModelPermission, as it fills it for every card.
        m.insert(
            "permission".to_string(),
            json!([{"id": "modelperm-emulated", "object": "model_permission",
                "created": created, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null,
                "is_blocking": false}]),
        );
    }
    let mut data = vec![card];
    data.extend(loras.iter().map(|l| {
        json!({"id": l, "object": "model", "created": created, "owned_by": owned_by,
               "root": l, "parent": model, "max_model_len": null})
    }));
    to_bytes(&json!({"object": "list", "data": data}))
}

/// OpenAI error body, `code` the HTTP status (as vLLM sets it).
pub fn error_body(status: u16, message: &str, kind: &str) -> Vec<u8> {
    to_bytes(&json!({
        "error": {"message": message, "type": kind, "param": null, "code": status}
    }))
}

/// A request naming a model the engine does not serve: vLLM's 404.
pub fn unknown_model(model: &str, aliases: &[&str]) -> Refusal {
    let msg = format!(
        "The model `{model}` does not exist. Valid aliases: {}.",
        aliases.join(", ")
    );
    Refusal::nested(404, &msg, "NotFoundError", Some("model"))
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
            max_tokens_field: "max_tokens",
            cache_salt: None,
            max_tokens: max.unwrap_or(16).clamp(1, MAX_OUTPUT_TOKENS),
            stream: false,
            include_usage: false,
            model: None,
        };
        let err =
            |r: Option<Refusal>| -> Value { serde_json::from_slice(&r.unwrap().body).unwrap() };
        let v = Mode::Vllm;
        // vLLM 0.32: a fitting prompt is served whatever the output asks,
        // cut at the context ...
        assert!(context_refusal(&r(99, None), 100, v).is_none());
        assert!(context_refusal(&r(90, Some(100)), 100, v).is_none());
        assert_eq!(output_tokens(&r(90, Some(100)), 100), 10);
        assert_eq!(output_tokens(&r(99, None), 100), 1);
        assert_eq!(output_tokens(&r(10, None), 100), 16);
        // ... an output limit above the context is refused first, named as
        // the client named it ...
        let mut big = r(200, Some(101));
        big.max_tokens_field = "max_completion_tokens";
        assert_eq!(
            err(context_refusal(&big, 100, v))["error"],
            json!({"message": "max_completion_tokens=101 cannot be greater than max_model_len=100. Please request fewer output tokens. (parameter=max_completion_tokens, value=101)",
                   "type": "BadRequestError", "param": "max_completion_tokens", "code": 400})
        );
        // ... then a prompt longer than the context (reported as limit + 1) ...
        assert_eq!(
            err(context_refusal(&r(250, Some(5)), 100, v))["error"],
            json!({"message": "This model's maximum context length is 100 tokens. However, your prompt contains at least 101 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=101)",
                   "type": "BadRequestError", "param": "input_tokens", "code": 400})
        );
        // ... and a prompt that leaves no room, or an explicit 0.
        for req in [r(100, None), r(10, Some(0))] {
            assert_eq!(
                err(context_refusal(&req, 100, v))["error"],
                json!({"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                       "type": "BadRequestError", "param": "max_tokens", "code": 400})
            );
        }
        // SGLang keeps its rule: prompt plus explicit output must fit.
        assert!(context_refusal(&r(90, Some(11)), 100, Mode::Sglang).is_some());
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
        let zero = chat(json!({"messages": [], "max_tokens": 0})).unwrap();
        assert_eq!((zero.max_tokens, zero.requested_max_tokens), (1, Some(0)));
        assert_eq!(r.max_tokens_field, "max_completion_tokens");
        let salted = chat(json!({"messages": [], "cache_salt": "s"})).unwrap();
        assert_eq!(
            (salted.cache_salt.as_deref(), salted.max_tokens_field),
            (Some("s"), "max_tokens")
        );
        assert!(chat(json!({"messages": [], "cache_salt": ""})).is_err());
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
            created_tokens: Some(0),
            report: CacheReport::VllmPromptTokensDetails,
        };
        let body = full_response(Kind::Chat, &meta, " a b", usage);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], " a b");
        assert_eq!(v["usage"]["total_tokens"], 12);
        // vLLM 0.32 reports the details on every answer, 0 included.
        assert_eq!(
            v["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 0, "created_cache_tokens": 0, "multimodal_tokens": null})
        );
        assert!(v["usage"]["completion_tokens_details"].is_null());
        assert_eq!(v["system_fingerprint"], SYSTEM_FINGERPRINT);
        // Its field order: usage before prompt_token_ids.
        let text = String::from_utf8(body).unwrap();
        assert!(text.starts_with(r#"{"id":"chatcmpl-1","object":"chat.completion","#));
        assert!(text.find("\"usage\"").unwrap() < text.find("\"prompt_token_ids\"").unwrap());
        let hit = Usage {
            cached_tokens: 8,
            created_tokens: None,
            ..usage
        };
        let v: Value =
            serde_json::from_slice(&full_response(Kind::Completion, &meta, "", hit)).unwrap();
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert!(v["usage"]["prompt_tokens_details"]["created_cache_tokens"].is_null());
        // A stream's usage chunk leaves the nulls out.
        let chunk = usage_chunk(Kind::Completion, &meta, hit);
        let v: Value = serde_json::from_slice(&chunk[6..chunk.len() - 2]).unwrap();
        assert_eq!(
            v["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 8})
        );
        assert!(v["usage"].get("completion_tokens_details").is_none());
        assert_eq!(v["choices"], json!([]));
        // vLLM without --enable-prompt-tokens-details: null, absent when streamed.
        let vllm_off = Usage {
            report: CacheReport::VllmOff,
            ..hit
        };
        let v: Value =
            serde_json::from_slice(&full_response(Kind::Chat, &meta, "", vllm_off)).unwrap();
        assert!(v["usage"]["prompt_tokens_details"].is_null());
        let chunk = usage_chunk(Kind::Chat, &meta, vllm_off);
        let v: Value = serde_json::from_slice(&chunk[6..chunk.len() - 2]).unwrap();
        assert!(v["usage"].get("prompt_tokens_details").is_none());
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
        let e: Value =
            serde_json::from_slice(&error_body(400, "x", "invalid_request_error")).unwrap();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["code"], 400);
        // vLLM 0.32's stream: a role chunk, then token chunks; the last one
        // has the finish reason and, closing the stream, the fingerprint.
        let first = vllm_stream_chunks(Kind::Chat, &meta, " a", true, false, true);
        let events: Vec<Value> = first
            .split(|b| *b == b'\n')
            .filter(|l| l.starts_with(b"data: "))
            .map(|l| serde_json::from_slice(&l[6..]).unwrap())
            .collect();
        assert_eq!(events.len(), 2);
        assert_eq!(
            events[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert!(events[0]["prompt_token_ids"].is_null());
        assert_eq!(events[1]["choices"][0]["delta"], json!({"content": " a"}));
        let last = vllm_stream_chunks(Kind::Chat, &meta, " b", false, true, true);
        let v: Value = serde_json::from_slice(&last[6..last.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["system_fingerprint"], SYSTEM_FINGERPRINT);
        let last = vllm_stream_chunks(Kind::Completion, &meta, " b", false, true, false);
        let v: Value = serde_json::from_slice(&last[6..last.len() - 2]).unwrap();
        assert!(v.get("system_fingerprint").is_none());
        assert_eq!(
            unknown_model("x", &["m", "lora"]).body,
            br#"{"error":{"code":404,"message":"The model `x` does not exist. Valid aliases: m, lora.","param":"model","type":"NotFoundError"}}"#
        );
        assert_eq!(output_text(2), " the quick");
    }
}
