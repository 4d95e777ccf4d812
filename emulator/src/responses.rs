//! The Responses API as vLLM serves it, pure: reading a `POST /v1/responses`
//! body, the conversation the engine prefills (a stored previous response
//! continued), the `ResponsesResponse` body, the SSE events of a streamed
//! answer and the per-replica store of answers.
//!
//! Matched against vLLM's source (`vllm/entrypoints/openai/responses/`:
//! `api_router.py`, `serving.py`, `protocol.py`, `utils.py`,
//! `streaming_events.py`; older trees: `serving_responses.py`,
//! `api_server.py`, `protocol.py`). Routes vLLM serves:
//! `POST /v1/responses`, `GET /v1/responses/{response_id}` and
//! `POST /v1/responses/{response_id}/cancel`. It does NOT serve
//! `DELETE /v1/responses/{id}` (405 from Starlette: the path matches the GET
//! route) nor `GET /v1/responses/{id}/input_items` (404, no route); the
//! server answers those as Starlette does ([`crate::refusal`]). SGLang
//! (`python/sglang/srt/entrypoints/openai/serving_responses.py`,
//! `http_server.py`) serves the same three routes.
//!
//! What the emulator does not do: background mode (refused), tools (echoed,
//! never called), `GET ...?stream=true` replays, logprobs. vLLM keeps
//! nothing unless started with `VLLM_ENABLE_RESPONSES_API_STORE=1` (it then
//! silently treats `store` as false), and neither does the emulator in vLLM
//! mode unless `--responses-store` (or that variable) turns its store on,
//! bounded to [`STORE_CAPACITY`] answers; SGLang mode always stores.

use std::collections::{HashMap, VecDeque};

use serde_json::{json, Map, Value};

use crate::config::Mode;
use crate::openai::{DEFAULT_MAX_TOKENS, MAX_OUTPUT_TOKENS};
use crate::refusal::Refusal;

/// Answers kept per replica; the oldest is dropped beyond this.
pub const STORE_CAPACITY: usize = 4096;
/// And beyond this many bytes of JSON: each answer holds its whole
/// conversation, so long chains would otherwise grow the store
/// quadratically. The newest answer is always kept.
pub const STORE_BYTES: usize = 256 << 20;

/// Prefix of response ids (`resp_` + 32 hex digits, as vLLM's
/// `random_uuid()` gives them).
pub const ID_PREFIX: &str = "resp_";

const INVALID: &str = "invalid_request_error";

/// What a `POST /v1/responses` body asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// `model` as sent (SGLang names its answer after it).
    pub model: Option<String>,
    /// The new input as chat messages (vLLM's
    /// `construct_chat_messages_with_tool_call`).
    pub input: Vec<Value>,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    /// Keep the answer for `previous_response_id` and `GET` (default true).
    pub store: bool,
    pub stream: bool,
    /// `max_output_tokens` as sent (at least 1).
    pub max_output_tokens: Option<usize>,
    pub cache_salt: Option<String>,
    /// Request fields the response repeats.
    pub echo: Map<String, Value>,
}

/// A stored answer: its body, and the conversation it continued (what a
/// later turn's prompt starts from).
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub response: Value,
    /// The chat messages that were prefilled (vLLM's `msg_store` entry).
    pub messages: Vec<Value>,
    /// The assistant text that was generated.
    pub output_text: String,
}

impl Stored {
    /// Its size as JSON, what the store's byte budget counts.
    fn weight(&self) -> usize {
        let json_len = |v: &Value| serde_json::to_vec(v).map_or(0, |b| b.len());
        let messages: usize = self.messages.iter().map(json_len).sum();
        json_len(&self.response)
            .saturating_add(messages)
            .saturating_add(self.output_text.len())
    }
}

/// The per-replica store of answers, bounded in count and bytes: oldest
/// first out.
#[derive(Debug, Clone)]
pub struct Store {
    capacity: usize,
    max_bytes: usize,
    bytes: usize,
    /// Insertion order, with each entry's weight.
    order: VecDeque<(String, usize)>,
    entries: HashMap<String, Stored>,
}

impl Store {
    pub fn new(capacity: usize, max_bytes: usize) -> Store {
        Store {
            capacity: capacity.max(1),
            max_bytes,
            bytes: 0,
            order: VecDeque::new(),
            entries: HashMap::new(),
        }
    }

    pub fn get(&self, id: &str) -> Option<&Stored> {
        self.entries.get(id)
    }

    /// Keeps `stored` under a fresh `id` (ids are never reused), then drops
    /// the oldest answers beyond the bounds.
    pub fn insert(&mut self, id: String, stored: Stored) {
        let weight = stored.weight();
        if let Some(old) = self.entries.insert(id.clone(), stored) {
            // Not expected; keep the accounting right anyway.
            self.bytes = self.bytes.saturating_sub(old.weight());
            self.order.retain(|(k, _)| *k != id);
        }
        self.order.push_back((id, weight));
        self.bytes = self.bytes.saturating_add(weight);
        while self.entries.len() > self.capacity
            || (self.bytes > self.max_bytes && self.entries.len() > 1)
        {
            let Some((oldest, w)) = self.order.pop_front() else {
                break;
            };
            self.entries.remove(&oldest);
            self.bytes = self.bytes.saturating_sub(w);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn clear(&mut self) {
        self.order.clear();
        self.entries.clear();
        self.bytes = 0;
    }
}

impl Default for Store {
    fn default() -> Self {
        Store::new(STORE_CAPACITY, STORE_BYTES)
    }
}

// ---------------------------------------------------------------------------
// Errors (serving.py `_make_not_found_error`, `cancel_responses`; SGLang's
// `_make_invalid_id_error`).

/// `previous_response_id` or a path id this replica does not hold: 404.
pub fn not_found(id: &str) -> Refusal {
    let msg = format!("Response with id '{id}' not found.");
    Refusal::nested(404, &msg, INVALID, Some("response_id"))
}

/// SGLang refuses an id that does not start with `resp_` before looking
/// it up; vLLM just does not find it.
pub fn check_id(mode: Mode, id: &str) -> Result<(), Refusal> {
    match mode {
        Mode::Sglang if !id.starts_with(ID_PREFIX) => {
            let msg =
                format!("Invalid 'response_id': '{id}'. Expected an ID that begins with 'resp'.");
            Err(Refusal::nested(400, &msg, INVALID, Some("response_id")))
        }
        _ => Ok(()),
    }
}

/// `POST /v1/responses/{id}/cancel` on a stored answer: only queued or
/// in-progress background responses can be cancelled, and every answer the
/// emulator stores is finished, so this is the answer (400).
pub fn cannot_cancel(mode: Mode) -> Refusal {
    let param = match mode {
        Mode::Vllm => Some("response_id"),
        Mode::Sglang => None,
    };
    Refusal::nested(400, "Cannot cancel a synchronous response.", INVALID, param)
}

/// The context rule on `/v1/responses`. vLLM 0.32: its general rule
/// ([`crate::openai::vllm_context_refusal`]: an output limit above the
/// context, then a prompt longer than it), except that a prompt of exactly
/// the context is refused by the Responses code itself (serving.py
/// `_validate_generator_input`), in its own words. SGLang: its tokenizer
/// manager's refusal of a prompt that leaves no room.
pub fn context_refusal(
    mode: Mode,
    prompt_tokens: usize,
    max_output_tokens: Option<usize>,
    max_model_len: usize,
) -> Option<Refusal> {
    if mode == Mode::Vllm && prompt_tokens != max_model_len {
        let requested = max_output_tokens.map(|n| ("max_output_tokens", n));
        return crate::openai::vllm_context_refusal(prompt_tokens, requested, max_model_len);
    }
    if prompt_tokens < max_model_len {
        return None;
    }
    Some(match mode {
        Mode::Vllm => Refusal::nested(
            400,
            &format!(
                "The engine prompt length {prompt_tokens} exceeds the max_model_len {max_model_len}. Please reduce prompt."
            ),
            INVALID,
            Some("input"),
        ),
        Mode::Sglang => Refusal::nested(
            400,
            &format!(
                "The input ({prompt_tokens} tokens) is longer than the model's context length ({max_model_len} tokens)."
            ),
            INVALID,
            None,
        ),
    })
}

// ---------------------------------------------------------------------------
// Request.

fn field_error(mode: Mode, key: &str, what: &str) -> Refusal {
    Refusal::schema(mode, &format!("body.{key}: {what}"), None)
}

fn opt_string(mode: Mode, obj: &Map<String, Value>, key: &str) -> Result<Option<String>, Refusal> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(field_error(mode, key, "Input should be a valid string")),
    }
}

fn opt_bool(mode: Mode, obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, Refusal> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(field_error(mode, key, "Input should be a valid boolean")),
    }
}

fn opt_int(mode: Mode, obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, Refusal> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match (v.as_i64(), v.as_u64()) {
            (Some(n), _) => Ok(Some(n)),
            (None, Some(_)) => Ok(Some(i64::MAX)),
            _ => Err(field_error(mode, key, "Input should be a valid integer")),
        },
    }
}

fn opt_number(mode: Mode, obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, Refusal> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| field_error(mode, key, "Input should be a valid number")),
    }
}

/// Reads a `POST /v1/responses` body. Schema errors are FastAPI's 400s;
/// checks vLLM's model validators and sampling parameters make are worded
/// as they are.
pub fn parse_request(mode: Mode, body: &[u8]) -> Result<ResponsesRequest, Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::schema(mode, &format!("JSON decode error: {e}"), None))?;
    let obj = value
        .as_object()
        .ok_or_else(|| Refusal::schema(mode, "body: Input should be a valid dictionary", None))?;
    let input = match obj.get("input") {
        None => return Err(field_error(mode, "input", "Field required")),
        Some(v) => input_messages(v).map_err(|m| Refusal::schema(mode, &m, None))?,
    };
    let model = opt_string(mode, obj, "model")?;
    let instructions = opt_string(mode, obj, "instructions")?;
    let previous_response_id = opt_string(mode, obj, "previous_response_id")?;
    let store = opt_bool(mode, obj, "store")?.unwrap_or(true);
    let stream = opt_bool(mode, obj, "stream")?.unwrap_or(false);
    let background = opt_bool(mode, obj, "background")?.unwrap_or(false);
    let parallel_tool_calls = opt_bool(mode, obj, "parallel_tool_calls")?.unwrap_or(true);
    let temperature = opt_number(mode, obj, "temperature")?.unwrap_or(1.0);
    let top_p = opt_number(mode, obj, "top_p")?.unwrap_or(1.0);
    let max_tool_calls = opt_int(mode, obj, "max_tool_calls")?;
    let user = opt_string(mode, obj, "user")?;
    // protocol.py validators, in vLLM's words.
    if background && !store {
        let msg = "Value error, background can only be used when `store` is true";
        return Err(Refusal::schema(mode, msg, None));
    }
    if !matches!(obj.get("prompt"), None | Some(Value::Null)) {
        return Err(Refusal::schema(
            mode,
            "prompt template is not supported",
            Some("prompt"),
        ));
    }
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            let msg = "Value error, Parameter 'cache_salt' must be a non-empty string if provided.";
            return Err(Refusal::schema(mode, msg, None));
        }
    };
    let max_output_tokens = match opt_int(mode, obj, "max_output_tokens")? {
        None => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        // SamplingParams refuses it (a ValueError: 400 BadRequestError);
        // vLLM 0.32 names the parameter.
        Some(n) => {
            return Err(match mode {
                Mode::Vllm => {
                    let msg = format!(
                        "max_tokens must be at least 1, got {n}. (parameter=max_tokens, value={n})"
                    );
                    Refusal::nested(400, &msg, "BadRequestError", Some("max_tokens"))
                }
                Mode::Sglang => {
                    let msg = format!("max_tokens must be at least 1, got {n}.");
                    Refusal::nested(400, &msg, "BadRequestError", None)
                }
            });
        }
    };
    if background {
        // vLLM runs it as a task the store tracks; not emulated.
        let msg = "background mode is not supported by the engine emulator";
        return Err(Refusal::nested(400, msg, INVALID, Some("background")));
    }
    let truncation = match obj.get("truncation") {
        None | Some(Value::Null) => json!("disabled"),
        Some(v @ Value::String(s)) if s == "auto" || s == "disabled" => v.clone(),
        Some(_) => {
            let what = "Input should be 'auto' or 'disabled'";
            return Err(field_error(mode, "truncation", what));
        }
    };
    let pass = |key: &str, default: Value| obj.get(key).cloned().unwrap_or(default);
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("metadata".into(), pass("metadata", Value::Null));
    echo.insert("parallel_tool_calls".into(), json!(parallel_tool_calls));
    echo.insert("temperature".into(), json!(temperature));
    echo.insert("tool_choice".into(), pass("tool_choice", json!("auto")));
    echo.insert("tools".into(), pass("tools", json!([])));
    echo.insert("top_p".into(), json!(top_p));
    echo.insert("background".into(), json!(background));
    echo.insert("max_tool_calls".into(), json!(max_tool_calls));
    echo.insert("previous_response_id".into(), json!(previous_response_id));
    echo.insert("prompt".into(), Value::Null);
    echo.insert("reasoning".into(), pass("reasoning", Value::Null));
    echo.insert("service_tier".into(), pass("service_tier", json!("auto")));
    echo.insert("text".into(), pass("text", Value::Null));
    echo.insert("top_logprobs".into(), Value::Null);
    echo.insert("truncation".into(), truncation);
    echo.insert("user".into(), json!(user));
    echo.insert("input_messages".into(), Value::Null);
    echo.insert("output_messages".into(), Value::Null);
    Ok(ResponsesRequest {
        model,
        input,
        instructions,
        previous_response_id,
        store,
        stream,
        max_output_tokens,
        cache_salt,
        echo,
    })
}

const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// A message's content parts for the chat template: `input_text` and
/// `output_text` parts become `text` parts (vLLM's chat parser reads them
/// as text); other parts are kept (the template ignores them).
fn content_parts(at: &str, parts: &[Value]) -> Result<Vec<Value>, String> {
    parts
        .iter()
        .enumerate()
        .map(|(j, part)| {
            let kind = part
                .get("type")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("body.{at}.content.{j}.type: Field required"))?;
            match kind {
                "input_text" | "output_text" => match part.get("text") {
                    Some(Value::String(t)) => Ok(json!({"type": "text", "text": t})),
                    _ => Err(format!(
                        "body.{at}.content.{j}.text: Input should be a valid string"
                    )),
                },
                _ => Ok(part.clone()),
            }
        })
        .collect()
}

fn required_string<'a>(item: &'a Value, at: &str, key: &str) -> Result<&'a str, String> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("body.{at}.{key}: Input should be a valid string"))
}

fn last_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
}

/// `input` as chat messages: a string is one user message; items follow
/// vLLM's `construct_chat_messages_with_tool_call` (a function call joins
/// the assistant message before it, a function call output becomes a
/// `tool` message, an assistant message keeps its first part's text).
pub fn input_messages(input: &Value) -> Result<Vec<Value>, String> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        _ => return Err("body.input: Input should be a valid string or a list of items".into()),
    };
    let mut messages: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input.{i}");
        if !item.is_object() {
            return Err(format!("body.{at}: Input should be a valid dictionary"));
        }
        let kind = match item.get("type") {
            None | Some(Value::Null) => "message",
            Some(Value::String(t)) => t.as_str(),
            Some(_) => return Err(format!("body.{at}.type: Input should be a valid string")),
        };
        match kind {
            "message" => {
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .filter(|r| ROLES.contains(r))
                    .ok_or_else(|| {
                        format!(
                            "body.{at}.role: Input should be 'user', 'assistant', 'system' or 'developer'"
                        )
                    })?;
                let content = match item.get("content") {
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(Value::Array(parts)) => Value::Array(content_parts(&at, parts)?),
                    _ => {
                        return Err(format!(
                            "body.{at}.content: Input should be a valid string or a list of content parts"
                        ))
                    }
                };
                if role == "assistant" {
                    let text = match &content {
                        Value::String(s) => s.clone(),
                        Value::Array(parts) => parts
                            .first()
                            .and_then(|p| p.get("text"))
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                        _ => String::new(),
                    };
                    match last_assistant(&mut messages) {
                        Some(prev) if matches!(prev.get("content"), None | Some(Value::Null)) => {
                            prev.insert("content".into(), json!(text));
                        }
                        _ => messages.push(json!({"role": "assistant", "content": text})),
                    }
                } else {
                    messages.push(json!({"role": role, "content": content}));
                }
            }
            "function_call" => {
                let call = json!({
                    "id": required_string(item, &at, "call_id")?,
                    "type": "function",
                    "function": {
                        "name": required_string(item, &at, "name")?,
                        "arguments": required_string(item, &at, "arguments")?,
                    },
                });
                match last_assistant(&mut messages) {
                    Some(prev) => match prev.get_mut("tool_calls") {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => {
                            prev.insert("tool_calls".into(), json!([call]));
                        }
                    },
                    None => messages.push(json!({"role": "assistant", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = required_string(item, &at, "call_id")?;
                let output = match item.get("output") {
                    Some(o @ (Value::String(_) | Value::Array(_))) => o.clone(),
                    _ => return Err(format!("body.{at}.output: Input should be a valid string")),
                };
                messages.push(json!({"role": "tool", "content": output, "tool_call_id": call_id}));
            }
            "reasoning" => {
                let first_text = |key: &str| {
                    item.get(key)
                        .and_then(Value::as_array)
                        .and_then(|a| a.first())
                        .and_then(|p| p.get("text"))
                        .and_then(Value::as_str)
                };
                let text = first_text("content")
                    .or_else(|| first_text("summary"))
                    .unwrap_or_default()
                    .to_string();
                match last_assistant(&mut messages) {
                    Some(prev) if !prev.contains_key("reasoning") => {
                        prev.insert("reasoning".into(), json!(text));
                    }
                    _ => messages.push(json!({"role": "assistant", "reasoning": text})),
                }
            }
            other => {
                return Err(format!(
                    "body.{at}.type: input item type '{other}' is not supported"
                ))
            }
        }
    }
    Ok(messages)
}

/// The conversation the engine prefills. vLLM (`utils.py`
/// `construct_input_messages`): this request's instructions as a system
/// message first, then the previous turn's messages without their system
/// messages (instructions do not carry over), then its output as an
/// assistant message, then the new input. SGLang keeps the previous
/// system messages.
pub fn conversation(mode: Mode, req: &ResponsesRequest, prev: Option<&Stored>) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(instructions) = req.instructions.as_deref().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    if let Some(prev) = prev {
        let keep = |m: &&Value| {
            mode == Mode::Sglang || m.get("role").and_then(Value::as_str) != Some("system")
        };
        messages.extend(prev.messages.iter().filter(keep).cloned());
        messages.push(json!({"role": "assistant", "content": prev.output_text}));
    }
    messages.extend(req.input.iter().cloned());
    messages
}

/// Output length: what the request asks (or the emulator's default), within
/// the context left and the emulator's cap; and the limit the engine
/// applies (`max_output_tokens` in the response: vLLM's `get_max_tokens`,
/// the room left in the context unless the request asks for less).
pub fn output_budget(
    max_output_tokens: Option<usize>,
    prompt_tokens: usize,
    max_model_len: usize,
) -> (usize, usize) {
    let room = max_model_len.saturating_sub(prompt_tokens).max(1);
    let limit = max_output_tokens.map_or(room, |m| m.min(room));
    let tokens = max_output_tokens
        .unwrap_or(DEFAULT_MAX_TOKENS)
        .min(limit)
        .clamp(1, MAX_OUTPUT_TOKENS);
    (tokens, limit)
}

// ---------------------------------------------------------------------------
// Response.

/// One answer's numbers and identity.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub mode: Mode,
    pub id: String,
    pub msg_id: String,
    pub created_at: u64,
    pub model: String,
    pub text: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// vLLM's `cache_write_tokens` (see `model::PrefillPlan`).
    pub created_tokens: usize,
    pub output_tokens: usize,
    /// The output limit the engine applied (see [`output_budget`]).
    pub limit: usize,
    /// SGLang reports `input_tokens_details` only with
    /// `--enable-cache-report`; vLLM always does.
    pub cache_report: bool,
}

impl Answer {
    /// vLLM: a generation stopped by its length limit is `incomplete`
    /// (`incomplete_details.reason` `max_output_tokens`); SGLang always says
    /// `completed`.
    pub fn status(&self) -> &'static str {
        match self.mode {
            Mode::Vllm if self.output_tokens >= self.limit => "incomplete",
            _ => "completed",
        }
    }

    /// vLLM's `ResponseUsage` (per-turn lists empty, as its simple context
    /// leaves them); SGLang's `ResponseUsageInfo`.
    pub fn usage(&self) -> Value {
        let total = self.prompt_tokens.saturating_add(self.output_tokens);
        match self.mode {
            Mode::Vllm => json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": self.cached_tokens,
                    "cache_write_tokens": self.created_tokens,
                    "input_tokens_per_turn": [],
                    "cached_tokens_per_turn": [],
                },
                "output_tokens": self.output_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": 0,
                    "tool_output_tokens": 0,
                    "output_tokens_per_turn": [],
                    "tool_output_tokens_per_turn": [],
                },
                "total_tokens": total,
            }),
            Mode::Sglang => {
                let details = if self.cache_report {
                    json!({"cached_tokens": self.cached_tokens})
                } else {
                    Value::Null
                };
                json!({
                    "input_tokens": self.prompt_tokens,
                    "input_tokens_details": details,
                    "output_tokens": self.output_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": total,
                })
            }
        }
    }

    fn output_index(&self) -> usize {
        // SGLang counts the output item from 1 in a stream.
        match self.mode {
            Mode::Vllm => 0,
            Mode::Sglang => 1,
        }
    }

    fn text_part(&self, logprobs: Value) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs})
    }

    /// The finished text part of a stream's last events: vLLM says
    /// `logprobs: null`, SGLang leaves it out.
    fn done_part(&self) -> Value {
        match self.mode {
            Mode::Vllm => self.text_part(Value::Null),
            Mode::Sglang => json!({"type": "output_text", "text": self.text, "annotations": []}),
        }
    }

    /// The output message item; vLLM 0.32 adds `phase` (null).
    fn message(&self, status: &str, content: Vec<Value>) -> Value {
        let mut m = json!({"id": self.msg_id, "type": "message", "role": "assistant",
                           "status": status, "content": content});
        if let (Mode::Vllm, Value::Object(map)) = (self.mode, &mut m) {
            map.insert("phase".into(), Value::Null);
        }
        m
    }
}

/// The `ResponsesResponse` body: `done` the finished answer, otherwise the
/// in-progress one a stream opens with (no output, no usage).
pub fn response_json(echo: &Map<String, Value>, a: &Answer, done: bool) -> Value {
    let mut r = echo.clone();
    let (status, output, usage) = if done {
        let item = a.message("completed", vec![a.text_part(Value::Null)]);
        (a.status(), json!([item]), a.usage())
    } else {
        ("in_progress", json!([]), Value::Null)
    };
    let incomplete = if status == "incomplete" {
        json!({"reason": "max_output_tokens"})
    } else {
        Value::Null
    };
    r.insert("id".into(), json!(a.id));
    r.insert("object".into(), json!("response"));
    r.insert("created_at".into(), json!(a.created_at));
    r.insert("model".into(), json!(a.model));
    r.insert("status".into(), json!(status));
    r.insert("incomplete_details".into(), incomplete);
    r.insert("output".into(), output);
    r.insert("usage".into(), usage);
    r.insert("max_output_tokens".into(), json!(a.limit));
    if a.mode == Mode::Vllm {
        // vLLM 0.32's sampling and disaggregation fields.
        r.insert("presence_penalty".into(), json!(0.0));
        r.insert("frequency_penalty".into(), json!(0.0));
        r.insert("kv_transfer_params".into(), Value::Null);
        r.insert("ec_transfer_params".into(), Value::Null);
    }
    Value::Object(r)
}

/// vLLM 0.32's `ResponsesResponse` field order.
const VLLM_ORDER: [&str; 32] = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "kv_transfer_params",
    "ec_transfer_params",
    "input_messages",
    "output_messages",
];

/// A response body as sent: in vLLM mode its top-level fields in vLLM's
/// order (any other after them), else as serde_json orders them.
pub fn response_bytes(mode: Mode, response: &Value) -> Vec<u8> {
    let Value::Object(map) = response else {
        return serde_json::to_vec(response).unwrap_or_default();
    };
    if mode == Mode::Sglang {
        return serde_json::to_vec(response).unwrap_or_default();
    }
    let mut pairs: Vec<(&str, Vec<u8>)> = VLLM_ORDER
        .iter()
        .filter_map(|k| Some((*k, crate::openai::j(map.get(*k)?.clone()))))
        .collect();
    for (k, v) in map {
        if !VLLM_ORDER.contains(&k.as_str()) {
            pairs.push((k.as_str(), crate::openai::j(v.clone())));
        }
    }
    crate::openai::ordered(&pairs)
}

/// One SSE event as both engines write them: `event: TYPE` and the JSON.
fn sse(kind: &str, seq: usize, mut event: Map<String, Value>) -> Vec<u8> {
    event.insert("type".into(), json!(kind));
    event.insert("sequence_number".into(), json!(seq));
    let data = serde_json::to_string(&Value::Object(event)).unwrap_or_default();
    format!("event: {kind}\ndata: {data}\n\n").into_bytes()
}

fn fields(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// Sequence number of output token `i`'s delta: four events come first.
const FIRST_DELTA_SEQ: usize = 4;

/// The events before the first delta: `response.created`,
/// `response.in_progress`, `response.output_item.added`,
/// `response.content_part.added` (vLLM `responses_stream_generator` and
/// `emit_simple_content_open`).
pub fn stream_head(echo: &Map<String, Value>, a: &Answer) -> Vec<u8> {
    let initial = response_json(echo, a, false);
    let out = a.output_index();
    let mut bytes = sse("response.created", 0, fields(json!({"response": initial})));
    bytes.extend(sse(
        "response.in_progress",
        1,
        fields(json!({"response": initial})),
    ));
    bytes.extend(sse(
        "response.output_item.added",
        2,
        fields(json!({"output_index": out, "item": a.message("in_progress", vec![])})),
    ));
    let empty = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
    bytes.extend(sse(
        "response.content_part.added",
        3,
        fields(
            json!({"output_index": out, "item_id": a.msg_id, "content_index": 0,
                      "part": empty}),
        ),
    ));
    bytes
}

/// `response.output_text.delta` of output token `i`.
pub fn stream_delta(a: &Answer, i: usize, delta: &str) -> Vec<u8> {
    sse(
        "response.output_text.delta",
        FIRST_DELTA_SEQ.saturating_add(i),
        fields(
            json!({"output_index": a.output_index(), "item_id": a.msg_id,
                      "content_index": 0, "delta": delta, "logprobs": []}),
        ),
    )
}

/// The events after the last delta: `response.output_text.done`,
/// `response.content_part.done`, `response.output_item.done` (vLLM
/// `emit_simple_content_done`), then `response.completed` with the whole
/// response, usage included. vLLM sends `response.completed` whatever the
/// final status; no `[DONE]` follows.
pub fn stream_tail(echo: &Map<String, Value>, a: &Answer) -> Vec<u8> {
    let seq = FIRST_DELTA_SEQ.saturating_add(a.output_tokens);
    let out = a.output_index();
    let part = a.done_part();
    let mut bytes = sse(
        "response.output_text.done",
        seq,
        fields(
            json!({"output_index": out, "item_id": a.msg_id, "content_index": 0,
                      "text": a.text, "logprobs": []}),
        ),
    );
    bytes.extend(sse(
        "response.content_part.done",
        seq.saturating_add(1),
        fields(
            json!({"output_index": out, "item_id": a.msg_id, "content_index": 0,
                      "part": part}),
        ),
    ));
    bytes.extend(sse(
        "response.output_item.done",
        seq.saturating_add(2),
        fields(json!({"output_index": out, "item": a.message("completed", vec![part])})),
    ));
    bytes.extend(sse(
        "response.completed",
        seq.saturating_add(3),
        fields(json!({"response": response_json(echo, a, true)})),
    ));
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: Value) -> Result<ResponsesRequest, Refusal> {
        parse_request(Mode::Vllm, body.to_string().as_bytes())
    }

    fn err_json(r: &Refusal) -> Value {
        serde_json::from_slice(&r.body).unwrap()
    }

    fn answer(mode: Mode, tokens: usize, limit: usize) -> Answer {
        Answer {
            mode,
            id: "resp_1".into(),
            msg_id: "msg_1".into(),
            created_at: 5,
            model: "m".into(),
            text: crate::openai::output_text(tokens),
            prompt_tokens: 40,
            cached_tokens: 32,
            created_tokens: 0,
            output_tokens: tokens,
            limit,
            cache_report: false,
        }
    }

    #[test]
    fn request_defaults_and_echo() {
        let r = req(json!({"model": "m", "input": "hi"})).unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.input, vec![json!({"role": "user", "content": "hi"})]);
        assert!(r.store && !r.stream);
        assert_eq!((r.max_output_tokens, r.cache_salt.as_deref()), (None, None));
        assert_eq!(r.echo["tool_choice"], "auto");
        assert_eq!(r.echo["truncation"], "disabled");
        assert_eq!(r.echo["temperature"], 1.0);
        let r = req(
            json!({"input": [], "store": false, "stream": true, "max_output_tokens": 7,
                           "instructions": "be brief", "previous_response_id": "resp_x",
                           "cache_salt": "s", "metadata": {"k": "v"}}),
        )
        .unwrap();
        assert!(!r.store && r.stream);
        assert_eq!(r.max_output_tokens, Some(7));
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_x"));
        assert_eq!(r.echo["metadata"], json!({"k": "v"}));
        assert_eq!(r.echo["instructions"], "be brief");
        assert!(r.input.is_empty());
    }

    #[test]
    fn items_become_chat_messages_as_vllm_builds_them() {
        let input = json!([
            {"role": "user", "content": "what is the weather?"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "in Paris"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "It is sunny."}]},
        ]);
        let m = input_messages(&input).unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(
            m[1]["content"],
            json!([{"type": "text", "text": "in Paris"}])
        );
        // Both calls join one assistant message.
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2]["tool_calls"][1]["function"]["name"], "time");
        assert_eq!(
            m[3],
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"})
        );
        assert_eq!(
            m[4],
            json!({"role": "assistant", "content": "It is sunny."})
        );
        // The chat template takes all of it.
        assert!(crate::tokenizer::chat(&Value::Array(m)).unwrap().len() > 20);
    }

    #[test]
    fn bad_bodies_are_400s_in_vllm_shape() {
        for (body, needle) in [
            (b"{nope".to_vec(), "JSON"),
            (b"[1]".to_vec(), "dictionary"),
            (br#"{"model":"m"}"#.to_vec(), "input: Field required"),
            (br#"{"input": 3}"#.to_vec(), "body.input"),
            (br#"{"input": [1]}"#.to_vec(), "input.0"),
            (
                br#"{"input": [{"role": "robot", "content": "x"}]}"#.to_vec(),
                "role",
            ),
            (br#"{"input": [{"role": "user"}]}"#.to_vec(), "content"),
            (
                br#"{"input": [{"role": "user", "content": [{"type": "input_text"}]}]}"#.to_vec(),
                "text",
            ),
            (
                br#"{"input": [{"type": "function_call", "name": "f"}]}"#.to_vec(),
                "call_id",
            ),
            (
                br#"{"input": [{"type": "web_search_call"}]}"#.to_vec(),
                "not supported",
            ),
            (br#"{"input": "x", "stream": "yes"}"#.to_vec(), "stream"),
            (br#"{"input": "x", "store": 1}"#.to_vec(), "store"),
            (
                br#"{"input": "x", "max_output_tokens": "9"}"#.to_vec(),
                "max_output_tokens",
            ),
            (
                br#"{"input": "x", "max_output_tokens": 1.5}"#.to_vec(),
                "max_output_tokens",
            ),
            (
                br#"{"input": "x", "instructions": 5}"#.to_vec(),
                "instructions",
            ),
            (
                br#"{"input": "x", "previous_response_id": []}"#.to_vec(),
                "previous_response_id",
            ),
            (
                br#"{"input": "x", "cache_salt": ""}"#.to_vec(),
                "cache_salt",
            ),
            (
                br#"{"input": "x", "prompt": {"id": "p"}}"#.to_vec(),
                "prompt template",
            ),
            (
                br#"{"input": "x", "background": true, "store": false}"#.to_vec(),
                "background",
            ),
            (
                br#"{"input": "x", "truncation": "maybe"}"#.to_vec(),
                "truncation",
            ),
        ] {
            let e = parse_request(Mode::Vllm, &body).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(&body));
            let v = err_json(&e);
            assert_eq!(v["error"]["type"], "Bad Request");
            assert_eq!(v["error"]["code"], 400);
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{msg} lacks {needle}");
        }
        let e = req(json!({"input": "x", "max_output_tokens": 0})).unwrap_err();
        assert_eq!(
            err_json(&e)["error"],
            json!({"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                   "type": "BadRequestError", "param": "max_tokens", "code": 400})
        );
        let e = req(json!({"input": "x", "background": true})).unwrap_err();
        assert_eq!(
            (e.status, err_json(&e)["error"]["param"].clone()),
            (400, json!("background"))
        );
        // SGLang: the flat shape.
        let e = parse_request(Mode::Sglang, b"{}").unwrap_err();
        assert_eq!(err_json(&e)["object"], "error");
    }

    #[test]
    fn lookup_errors_in_each_engines_words() {
        let e = not_found("resp_abc");
        assert_eq!(e.status, 404);
        assert_eq!(
            err_json(&e),
            json!({"error": {"message": "Response with id 'resp_abc' not found.",
                             "type": "invalid_request_error", "param": "response_id",
                             "code": 404}})
        );
        assert!(check_id(Mode::Vllm, "abc").is_ok());
        assert!(check_id(Mode::Sglang, "resp_abc").is_ok());
        let e = check_id(Mode::Sglang, "abc").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(
            err_json(&e)["error"]["message"],
            "Invalid 'response_id': 'abc'. Expected an ID that begins with 'resp'."
        );
        let c = cannot_cancel(Mode::Vllm);
        assert_eq!(c.status, 400);
        assert_eq!(
            err_json(&c)["error"],
            json!({"message": "Cannot cancel a synchronous response.",
                   "type": "invalid_request_error", "param": "response_id", "code": 400})
        );
        assert!(err_json(&cannot_cancel(Mode::Sglang))["error"]["param"].is_null());
        assert!(context_refusal(Mode::Vllm, 99, None, 100).is_none());
        // vLLM 0.32: a prompt of exactly the context, in the Responses
        // code's words ...
        let c = context_refusal(Mode::Vllm, 100, None, 100).unwrap();
        assert_eq!(
            err_json(&c)["error"],
            json!({"message": "The engine prompt length 100 exceeds the max_model_len 100. Please reduce prompt.",
                   "type": "invalid_request_error", "param": "input", "code": 400})
        );
        // ... a longer one in the general rule's, and an output limit above
        // the context first, named as sent.
        let c = context_refusal(Mode::Vllm, 101, Some(5), 100).unwrap();
        assert_eq!(err_json(&c)["error"]["param"], "input_tokens");
        let c = context_refusal(Mode::Vllm, 101, Some(101), 100).unwrap();
        assert_eq!(
            err_json(&c)["error"],
            json!({"message": "max_output_tokens=101 cannot be greater than max_model_len=100. Please request fewer output tokens. (parameter=max_output_tokens, value=101)",
                   "type": "BadRequestError", "param": "max_output_tokens", "code": 400})
        );
        // A fitting prompt with a large limit is served (cut at the context).
        assert!(context_refusal(Mode::Vllm, 90, Some(100), 100).is_none());
        assert!(context_refusal(Mode::Sglang, 100, None, 100).is_some());
        assert!(context_refusal(Mode::Sglang, 90, Some(100), 100).is_none());
    }

    #[test]
    fn conversation_continues_without_old_instructions() {
        let prev = Stored {
            response: json!({}),
            messages: vec![
                json!({"role": "system", "content": "old rules"}),
                json!({"role": "user", "content": "first"}),
            ],
            output_text: " answer".into(),
        };
        let mut r = req(json!({"input": "second", "instructions": "new rules"})).unwrap();
        let m = conversation(Mode::Vllm, &r, Some(&prev));
        assert_eq!(
            m,
            vec![
                json!({"role": "system", "content": "new rules"}),
                json!({"role": "user", "content": "first"}),
                json!({"role": "assistant", "content": " answer"}),
                json!({"role": "user", "content": "second"}),
            ]
        );
        // SGLang keeps the previous system message.
        assert_eq!(conversation(Mode::Sglang, &r, Some(&prev)).len(), 5);
        r.instructions = Some(String::new());
        assert_eq!(conversation(Mode::Vllm, &r, None).len(), 1);
    }

    #[test]
    fn budget_and_status() {
        assert_eq!(output_budget(None, 10, 100), (16, 90));
        assert_eq!(output_budget(Some(5), 10, 100), (5, 5));
        assert_eq!(output_budget(Some(500), 10, 100), (90, 90));
        assert_eq!(output_budget(None, 95, 100), (5, 5));
        assert_eq!(
            output_budget(Some(100_000), 0, 1 << 20).0,
            MAX_OUTPUT_TOKENS
        );
        assert_eq!(answer(Mode::Vllm, 16, 90).status(), "completed");
        assert_eq!(answer(Mode::Vllm, 5, 5).status(), "incomplete");
        assert_eq!(answer(Mode::Sglang, 5, 5).status(), "completed");
    }

    #[test]
    fn response_body_is_vllms() {
        let echo = req(json!({"input": "x", "previous_response_id": "resp_0"}))
            .unwrap()
            .echo;
        let a = answer(Mode::Vllm, 3, 90);
        let v = response_json(&echo, &a, true);
        assert_eq!(v["id"], "resp_1");
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "completed");
        assert_eq!(v["previous_response_id"], "resp_0");
        assert!(v["incomplete_details"].is_null());
        assert_eq!(v["output"][0]["type"], "message");
        assert_eq!(v["output"][0]["id"], "msg_1");
        assert_eq!(v["output"][0]["content"][0]["text"], a.text);
        assert_eq!(v["output"][0]["content"][0]["annotations"], json!([]));
        assert_eq!(v["usage"]["input_tokens"], 40);
        assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"], 32);
        assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
        assert_eq!(v["usage"]["total_tokens"], 43);
        let cut = response_json(&echo, &answer(Mode::Vllm, 5, 5), true);
        assert_eq!(cut["status"], "incomplete");
        assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
        let open = response_json(&echo, &a, false);
        assert_eq!(
            (
                open["status"].clone(),
                open["output"].clone(),
                open["usage"].clone()
            ),
            (json!("in_progress"), json!([]), Value::Null)
        );
        // SGLang: details only with --enable-cache-report.
        let sg = answer(Mode::Sglang, 3, 90);
        assert!(sg.usage()["input_tokens_details"].is_null());
        let sg = Answer {
            cache_report: true,
            ..sg
        };
        assert_eq!(sg.usage()["input_tokens_details"]["cached_tokens"], 32);
    }

    /// (event line type, data) of each SSE event.
    fn events(bytes: &[u8]) -> Vec<(String, Value)> {
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let (ev, data) = e.split_once('\n').unwrap();
                let kind = ev.strip_prefix("event: ").unwrap().to_string();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                (kind, data)
            })
            .collect()
    }

    #[test]
    fn stream_events_in_vllms_order() {
        let echo = req(json!({"input": "x"})).unwrap().echo;
        let a = answer(Mode::Vllm, 2, 90);
        let mut bytes = stream_head(&echo, &a);
        bytes.extend(stream_delta(&a, 0, " the"));
        bytes.extend(stream_delta(&a, 1, " quick"));
        bytes.extend(stream_tail(&echo, &a));
        let ev = events(&bytes);
        let kinds: Vec<&str> = ev.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (kind, data)) in ev.iter().enumerate() {
            assert_eq!(data["type"], kind.as_str());
            assert_eq!(data["sequence_number"], i);
        }
        assert_eq!(ev[0].1["response"]["status"], "in_progress");
        assert!(ev[0].1["response"]["usage"].is_null());
        assert_eq!(ev[4].1["delta"], " the");
        assert_eq!(ev[4].1["item_id"], "msg_1");
        assert_eq!(ev[6].1["text"], " the quick");
        assert_eq!(ev[8].1["item"]["status"], "completed");
        let done = &ev[9].1["response"];
        assert_eq!(done["id"], ev[0].1["response"]["id"]);
        assert_eq!(done["usage"]["output_tokens"], 2);
        assert_eq!(done["output"][0]["content"][0]["text"], " the quick");
    }

    #[test]
    fn store_keeps_the_newest() {
        let entry = |n: u32| Stored {
            response: json!({ "n": n }),
            messages: vec![],
            output_text: String::new(),
        };
        let mut s = Store::new(2, 1 << 20);
        s.insert("a".into(), entry(1));
        s.insert("b".into(), entry(2));
        s.insert("c".into(), entry(3));
        assert_eq!(s.len(), 2);
        assert!(s.get("a").is_none());
        assert_eq!(s.get("b").unwrap().response["n"], 2);
        assert_eq!(s.get("c").unwrap().response["n"], 3);
        // A replaced entry moves to the back.
        s.insert("b".into(), entry(4));
        s.insert("d".into(), entry(5));
        assert!(s.get("c").is_none());
        assert_eq!(s.get("b").unwrap().response["n"], 4);
        s.clear();
        assert!(s.is_empty());
        assert_eq!(
            (Store::default().capacity, Store::default().max_bytes),
            (STORE_CAPACITY, STORE_BYTES)
        );

        // The byte budget: each entry weighs its JSON.
        let big = |n: u32| Stored {
            response: json!({ "n": n }),
            messages: vec![json!({"role": "user", "content": "x".repeat(100)})],
            output_text: "y".repeat(50),
        };
        let w = big(1).weight();
        assert!(w > 150, "{w}");
        let mut s = Store::new(100, 2 * w + w / 2);
        for n in 0..5 {
            s.insert(format!("r{n}"), big(n));
        }
        assert_eq!(s.len(), 2);
        assert!(s.get("r3").is_some() && s.get("r4").is_some());
        assert_eq!(s.bytes, 2 * w);
        // The newest stays even if it alone is over budget.
        let mut s = Store::new(100, 10);
        s.insert("x".into(), big(0));
        s.insert("y".into(), big(1));
        assert_eq!((s.len(), s.get("y").is_some()), (1, true));
    }
}
