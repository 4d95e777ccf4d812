//! Request understanding: which requests are inference requests, and what an
//! OpenAI-style body says that routing and the guard need. The body is read
//! in one pass with serde visitors that stream the canonical prompt text into
//! the prefix hasher, so nothing but the few scalars routing needs is
//! allocated (escaped strings are decoded into serde's scratch buffer).
//!
//! Canonical prompt text: for chat, each message as `role "\n" text "\n"`,
//! where text is `content` as a string, or the concatenation of its parts
//! (`text` of text parts, the URL of image/audio/file parts, else the part's
//! type); for completions, `prompt` as a string, or its elements joined by
//! "\n" (token ids as 4 little-endian bytes each); for the Responses API,
//! `instructions` as a `system` message followed by `input` (a string is a
//! `user` message; message items as chat messages; any other item as its
//! `type`, then its name, arguments, output and summary). A request's
//! cache namespace (the model, `cache_salt`, `prompt_cache_key`) enters every
//! block's chain hash, so prompts in different namespaces never look shared.

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use std::cell::Cell;
use std::fmt;

pub use crate::request::json_span::top_level_value_span;
use crate::request::prefix::{PromptHasher, PromptPrefix};
use crate::request::prompt_text::{duplicate, InputSeed, MessagesSeed, PromptSeed};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    /// `POST /v1/responses` (the Responses API).
    Responses,
}

impl Endpoint {
    /// The field that holds the prompt, for errors.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "messages",
            Endpoint::Completions => "prompt",
            Endpoint::Responses => "input",
        }
    }
}

/// The inference endpoint a request goes to, if it is one: `POST` to
/// `/v1/chat/completions`, `/v1/completions` or `/v1/responses` (query
/// string ignored).
pub fn endpoint(method: &str, path: &str) -> Option<Endpoint> {
    if method != "POST" {
        return None;
    }
    match strip_path(path) {
        "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/responses" => Some(Endpoint::Responses),
        _ => None,
    }
}

/// `path` without its query string and one trailing slash.
pub fn strip_path(path: &str) -> &str {
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    path.strip_suffix('/').unwrap_or(path)
}

/// How a complete request body is to be taken, the same in both filters
/// and in `explain`. Clients often send JSON with a wrong or missing
/// `content-type` (`curl -d` says form-urlencoded), so the body decides,
/// not the header: a body meant as JSON but malformed is a client error; a
/// body not meant as JSON is not a request the router understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Empty or only whitespace: an empty request, refused as such.
    Blank,
    /// Meant as JSON (first non-blank byte `{`): parsed; malformed is a
    /// client error.
    Json,
    /// Not meant as JSON: not an inference request the router understands;
    /// it goes to the default region untouched, where the engine judges it.
    Other,
}

pub fn body_kind(body: &[u8]) -> BodyKind {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => BodyKind::Blank,
        Some(b'{') => BodyKind::Json,
        Some(_) => BodyKind::Other,
    }
}

/// True when a `content-encoding` value means the body is compressed.
pub fn is_encoded(content_encoding: Option<&str>) -> bool {
    content_encoding
        .is_some_and(|v| !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("identity"))
}

/// What the router and the guard know about one inference request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferenceRequest {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub stream: bool,
    pub user: Option<String>,
    pub prompt: PromptPrefix,
    /// Responses API: the stored response this one continues.
    pub previous_response_id: Option<String>,
    /// Responses API: whether the engine keeps the response (`store`,
    /// default true).
    pub store: bool,
    /// `stream_options.include_usage`: the stream ends with a usage chunk.
    pub include_usage: bool,
}

/// A request body that is not a valid request; rendered as an OpenAI error.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestError {
    pub param: Option<&'static str>,
    pub message: String,
}

/// Parse a body for `endpoint`. `hasher` receives the canonical prompt text.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    hasher: PromptHasher,
) -> Result<InferenceRequest, RequestError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(RequestError {
            param: None,
            message: "request body is empty; expected a JSON object".into(),
        });
    }
    // JSON text is UTF-8 (RFC 8259 8.1). serde_json checks it only in the
    // strings it decodes, not in members it skips, so check the whole body
    // once; the string reader then skips the per-string check.
    let text = match std::str::from_utf8(body) {
        Ok(text) => text,
        Err(e) => {
            return Err(RequestError {
                param: None,
                message: format!(
                    "request body is not valid JSON: invalid UTF-8 at byte {}",
                    e.valid_up_to()
                ),
            })
        }
    };
    let param = Cell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let top = TopSeed {
        endpoint,
        hasher,
        param: &param,
    };
    let result = top.deserialize(&mut de).and_then(|r| de.end().map(|_| r));
    match result {
        Ok(r) => Ok(r),
        Err(e) => Err(RequestError {
            param: param.get(),
            message: describe(&e),
        }),
    }
}

fn describe(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof => format!("request body is not valid JSON: {e}"),
        _ => format!("invalid request: {e}"),
    }
}

struct TopSeed<'p> {
    endpoint: Endpoint,
    hasher: PromptHasher,
    param: &'p Cell<Option<&'static str>>,
}

enum Key {
    Model,
    Messages,
    Prompt,
    Input,
    Instructions,
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
    Stream,
    User,
    PreviousResponseId,
    Store,
    CacheSalt,
    CacheNamespace,
    StreamOptions,
    Other,
}

impl<'de> de::Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "model" => Key::Model,
                    "messages" => Key::Messages,
                    "prompt" => Key::Prompt,
                    "input" => Key::Input,
                    "instructions" => Key::Instructions,
                    "max_tokens" => Key::MaxTokens,
                    "max_completion_tokens" => Key::MaxCompletionTokens,
                    "max_output_tokens" => Key::MaxOutputTokens,
                    "stream" => Key::Stream,
                    "user" => Key::User,
                    "previous_response_id" => Key::PreviousResponseId,
                    "store" => Key::Store,
                    "cache_salt" => Key::CacheSalt,
                    "prompt_cache_key" => Key::CacheNamespace,
                    "stream_options" => Key::StreamOptions,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> DeserializeSeed<'de> for TopSeed<'_> {
    type Value = InferenceRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

/// Read the value of `field` once (a second occurrence is an error), with
/// `field` named as the error's `param` while it is read.
fn once<'de, A: MapAccess<'de>, T: de::Deserialize<'de>>(
    map: &mut A,
    param: &Cell<Option<&'static str>>,
    seen: &mut bool,
    field: &'static str,
) -> Result<T, A::Error> {
    param.set(Some(field));
    if std::mem::replace(seen, true) {
        return Err(duplicate(field));
    }
    map.next_value::<T>()
}

/// The cache namespace: the model (vLLM keys its blocks by the LoRA adapter
/// as well as the tokens, and two models never share a cache),
/// `cache_salt` and `prompt_cache_key`, as one seed.
fn namespace(model: Option<&str>, salt: Option<&str>, key: Option<&str>) -> Option<u64> {
    if model.is_none() && salt.is_none() && key.is_none() {
        return None;
    }
    let len = |p: Option<&str>| p.map_or(0, str::len);
    let mut bytes = Vec::with_capacity(27 + len(model) + len(salt) + len(key));
    for part in [model, salt, key] {
        match part {
            Some(v) => {
                bytes.push(1);
                bytes.extend_from_slice(&(v.len() as u64).to_le_bytes());
                bytes.extend_from_slice(v.as_bytes());
            }
            None => bytes.push(0),
        }
    }
    Some(xxhash_rust::xxh3::xxh3_64(&bytes))
}

impl<'de> Visitor<'de> for TopSeed<'_> {
    type Value = InferenceRequest;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let TopSeed {
            endpoint,
            mut hasher,
            param,
        } = self;
        let responses = endpoint == Endpoint::Responses;
        let mut out = InferenceRequest {
            store: true,
            ..InferenceRequest::default()
        };
        let (mut seen_model, mut seen_prompt, mut seen_max, mut seen_mct) =
            (false, false, false, false);
        let (mut seen_stream, mut seen_user, mut seen_prev, mut seen_store) =
            (false, false, false, false);
        let (mut seen_instr, mut seen_salt, mut seen_key, mut seen_opts) =
            (false, false, false, false);
        let mut salt: Option<String> = None;
        let mut cache_key: Option<String> = None;
        // Responses API: `instructions` comes first in the prompt wherever
        // it is in the body, so `input` is kept (unparsed) until the end.
        let mut instructions: Option<String> = None;
        let mut input: Option<&'de serde_json::value::RawValue> = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Model => out.model = Some(once(&mut map, param, &mut seen_model, "model")?),
                Key::Messages if endpoint == Endpoint::ChatCompletions => {
                    param.set(Some("messages"));
                    if std::mem::replace(&mut seen_prompt, true) {
                        return Err(duplicate("messages"));
                    }
                    map.next_value_seed(MessagesSeed(&mut hasher))?;
                }
                Key::Prompt if endpoint == Endpoint::Completions => {
                    param.set(Some("prompt"));
                    if std::mem::replace(&mut seen_prompt, true) {
                        return Err(duplicate("prompt"));
                    }
                    map.next_value_seed(PromptSeed(&mut hasher))?;
                }
                Key::Input if responses => {
                    input = Some(once(&mut map, param, &mut seen_prompt, "input")?);
                }
                Key::Instructions if responses => {
                    instructions = once(&mut map, param, &mut seen_instr, "instructions")?;
                }
                Key::MaxTokens if !responses => {
                    out.max_tokens = once(&mut map, param, &mut seen_max, "max_tokens")?;
                }
                Key::MaxOutputTokens if responses => {
                    out.max_tokens = once(&mut map, param, &mut seen_max, "max_output_tokens")?;
                }
                Key::MaxCompletionTokens if !responses => {
                    out.max_completion_tokens =
                        once(&mut map, param, &mut seen_mct, "max_completion_tokens")?;
                }
                Key::Stream => {
                    let v: Option<bool> = once(&mut map, param, &mut seen_stream, "stream")?;
                    out.stream = v.unwrap_or(false);
                }
                Key::User => out.user = once(&mut map, param, &mut seen_user, "user")?,
                Key::PreviousResponseId if responses => {
                    out.previous_response_id =
                        once(&mut map, param, &mut seen_prev, "previous_response_id")?;
                }
                Key::Store if responses => {
                    let v: Option<bool> = once(&mut map, param, &mut seen_store, "store")?;
                    out.store = v.unwrap_or(true);
                }
                Key::CacheSalt => salt = once(&mut map, param, &mut seen_salt, "cache_salt")?,
                Key::StreamOptions if !responses => {
                    let opts: Option<StreamOptions> =
                        once(&mut map, param, &mut seen_opts, "stream_options")?;
                    out.include_usage = opts.and_then(|o| o.include_usage).unwrap_or(false);
                }
                Key::CacheNamespace => {
                    cache_key = once(&mut map, param, &mut seen_key, "prompt_cache_key")?;
                }
                Key::Messages
                | Key::Prompt
                | Key::Input
                | Key::Instructions
                | Key::MaxTokens
                | Key::MaxCompletionTokens
                | Key::MaxOutputTokens
                | Key::PreviousResponseId
                | Key::Store
                | Key::StreamOptions
                | Key::Other => {
                    param.set(None);
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        param.set(None);
        if !seen_prompt {
            param.set(Some(endpoint.prompt_param()));
            return Err(de::Error::custom(format_args!(
                "missing required field `{}`",
                endpoint.prompt_param()
            )));
        }
        if responses {
            if let Some(text) = &instructions {
                hasher.feed(b"system\n");
                hasher.feed(text.as_bytes());
                hasher.feed(b"\n");
            }
            if let Some(raw) = input {
                param.set(Some("input"));
                let mut de = serde_json::Deserializer::from_str(raw.get());
                InputSeed(&mut hasher)
                    .deserialize(&mut de)
                    .map_err(de::Error::custom)?;
                param.set(None);
            }
        }
        out.prompt = hasher.finish();
        if let Some(ns) = namespace(out.model.as_deref(), salt.as_deref(), cache_key.as_deref()) {
            out.prompt.namespace(ns);
        }
        Ok(out)
    }
}

/// `stream_options`: only `include_usage` is read.
#[derive(serde::Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<InferenceRequest, RequestError> {
        parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            PromptHasher::new(64, 1),
        )
    }

    fn canon(endpoint: Endpoint, body: &str) -> PromptPrefix {
        parse(endpoint, body.as_bytes(), PromptHasher::new(16, 1))
            .unwrap()
            .prompt
    }

    fn text_prefix(text: &str) -> PromptPrefix {
        let mut h = PromptHasher::new(16, 1);
        h.feed(text.as_bytes());
        h.finish()
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint("POST", "/v1/chat/completions"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(
            endpoint("POST", "/v1/completions?x=1"),
            Some(Endpoint::Completions)
        );
        assert_eq!(endpoint("GET", "/v1/completions"), None);
        assert_eq!(endpoint("POST", "/v1/embeddings"), None);
        assert_eq!(body_kind(b"  {}"), BodyKind::Json);
        assert_eq!(body_kind(b"a=1"), BodyKind::Other);
        assert_eq!(body_kind(b""), BodyKind::Blank);
        assert_eq!(body_kind(b" \r\n\t"), BodyKind::Blank);
        assert!(is_encoded(Some("gzip")));
        assert!(!is_encoded(Some("identity")) && !is_encoded(None));
    }

    #[test]
    fn chat_fields_and_canonical_text() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
            {"content":"hi \"there\"","role":"user","name":"x"}],"max_tokens":7,"stream":true,
            "user":"u1","temperature":0.2,"tools":[{"a":[1,2,{"b":null}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.max_tokens, Some(7));
        assert!(r.stream);
        assert_eq!(r.user.as_deref(), Some("u1"));
        let expected = "system\nbe brief\nuser\nhi \"there\"\n";
        assert_eq!(r.prompt.bytes, expected.len() as u64);
        let p = parse(
            Endpoint::ChatCompletions,
            br#"{"messages":[{"role":"system","content":"be brief"},{"content":"hi \"there\"","role":"user"}]}"#,
            PromptHasher::new(16, 1),
        )
        .unwrap();
        assert_eq!(p.prompt, text_prefix(expected));
    }

    #[test]
    fn content_parts_are_canonicalised() {
        let p = canon(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"look at "},
            {"type":"image_url","image_url":{"url":"https://x/img.png","detail":"low"}},
            {"type":"text","text":"this"}]}]}"#,
        );
        assert_eq!(p, text_prefix("user\nlook at https://x/img.pnglowthis\n"));
    }

    #[test]
    fn completions_prompt_shapes() {
        let p = canon(
            Endpoint::Completions,
            r#"{"prompt":"abc","max_tokens":null}"#,
        );
        assert_eq!(p, text_prefix("abc"));
        let p = canon(Endpoint::Completions, r#"{"prompt":["a","b"]}"#);
        assert_eq!(p, text_prefix("a\nb"));
        let p = canon(Endpoint::Completions, r#"{"prompt":[1,2]}"#);
        assert_eq!(p.bytes, 8);
        let p = canon(Endpoint::Completions, r#"{"prompt":[[1,2],[3]]}"#);
        assert_eq!(p.bytes, 13);
    }

    fn resp(body: &str) -> Result<InferenceRequest, RequestError> {
        parse(
            Endpoint::Responses,
            body.as_bytes(),
            PromptHasher::new(16, 1),
        )
    }

    #[test]
    fn responses_input_is_canonicalised_like_chat() {
        assert_eq!(
            endpoint("POST", "/v1/responses/"),
            Some(Endpoint::Responses)
        );
        assert_eq!(endpoint("GET", "/v1/responses"), None);
        assert_eq!(endpoint("POST", "/v1/responses/resp_1/cancel"), None);
        let chat_form = canon(
            Endpoint::ChatCompletions,
            r#"{"messages":[{"role":"system","content":"Be terse, always."},{"role":"user","content":"What is the capital of France?"}]}"#,
        );
        // Instructions first in the prompt, wherever they are in the body.
        for body in [
            r#"{"instructions":"Be terse, always.","input":"What is the capital of France?"}"#,
            r#"{"input":"What is the capital of France?","instructions":"Be terse, always."}"#,
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"What is the capital of France?"}]}],"instructions":"Be terse, always."}"#,
            r#"{"input":[{"content":"What is the capital of France?","type":"message","role":"user"}],"instructions":"Be terse, always."}"#,
        ] {
            assert_eq!(resp(body).unwrap().prompt, chat_form, "{body}");
        }
        // Items other than messages: their type, then name, arguments,
        // output, summary, whatever the order of the fields.
        let r = resp(
            r#"{"input":[{"role":"user","content":"weather?"},
            {"arguments":"{\"city\":\"Paris\"}","type":"function_call","call_id":"c1","name":"get_weather","id":"fc_1"},
            {"type":"function_call_output","call_id":"c1","output":"sunny"},
            {"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"think"}]}],
            "max_output_tokens":64,"previous_response_id":"resp_1","store":false,"stream":true,"max_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            text_prefix(
                "user\nweather?\nfunction_call\nget_weather{\"city\":\"Paris\"}\nfunction_call_output\nsunny\nreasoning\nthink\n"
            )
        );
        assert_eq!(r.max_tokens, Some(64), "max_output_tokens, not max_tokens");
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert!(!r.store && r.stream);
        assert!(
            resp(r#"{"input":"x"}"#).unwrap().store,
            "store defaults to true"
        );
    }

    #[test]
    fn a_conversation_continued_through_items_extends_its_prefix() {
        let turn1 = r#"{"instructions":"You are a careful assistant who answers questions.","input":[{"role":"user","content":"Tell me about the history of the Roman aqueducts."}]}"#;
        let turn2 = r#"{"instructions":"You are a careful assistant who answers questions.","input":[{"role":"user","content":"Tell me about the history of the Roman aqueducts."},
            {"type":"message","role":"assistant","id":"msg_1","status":"completed","content":[{"type":"output_text","text":"They carried water for centuries.","annotations":[]}]},
            {"role":"user","content":"And how were they built?"}]}"#;
        let (a, b) = (resp(turn1).unwrap().prompt, resp(turn2).unwrap().prompt);
        assert!(a.blocks >= 4);
        assert_eq!(
            &b.block_hashes()[..a.blocks as usize],
            &a.block_hashes()[..]
        );
        assert!(b.blocks > a.blocks);
    }

    #[test]
    fn cache_namespaces_never_share_a_block() {
        let plain = chat(r#"{"messages":[{"role":"user","content":"the same long prompt text in every namespace, repeated so that it spans several blocks of sixty-four bytes each, which it now does"}]}"#).unwrap();
        let salted = |extra: &str| {
            chat(&format!(
                r#"{{"messages":[{{"role":"user","content":"the same long prompt text in every namespace, repeated so that it spans several blocks of sixty-four bytes each, which it now does"}}],{extra}}}"#
            ))
            .unwrap()
            .prompt
        };
        let a = salted(r#""cache_salt":"tenant-a""#);
        let a2 = salted(r#""cache_salt":"tenant-a","user":"x""#);
        let b = salted(r#""cache_salt":"tenant-b""#);
        let k = salted(r#""prompt_cache_key":"tenant-a""#);
        assert_eq!(a, a2, "the same namespace shares");
        for other in [&plain.prompt, &b, &k] {
            assert_eq!(other.bytes, a.bytes);
            let theirs = other.block_hashes();
            assert!(a.block_hashes().iter().all(|h| !theirs.contains(h)));
            assert_ne!(other.first_block, a.first_block);
        }
        let hashes = a.block_hashes();
        assert_eq!(a.first_block, hashes.first().copied());
        assert_eq!(a.last_block, hashes.last().copied());
        assert!(a
            .checkpoints
            .iter()
            .all(|c| hashes[c.blocks as usize - 1] == c.hash));
        // Prefix-closed within a namespace.
        let longer = chat(r#"{"messages":[{"role":"user","content":"the same long prompt text in every namespace, repeated so that it spans several blocks of sixty-four bytes each, which it now does, and more"}],"cache_salt":"tenant-a"}"#).unwrap().prompt;
        assert!(a.blocks >= 2);
        assert_eq!(
            &longer.block_hashes()[..hashes.len() - 1],
            &hashes[..hashes.len() - 1]
        );
        let e = chat(r#"{"messages":[{"role":"user","content":"x"}],"cache_salt":5}"#).unwrap_err();
        assert_eq!(e.param, Some("cache_salt"));
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"cache_salt":null}"#).is_ok());
        let e = resp(r#"{"input":"x","prompt_cache_key":"a","prompt_cache_key":"b"}"#).unwrap_err();
        assert!(e.message.contains("duplicate"));
    }

    #[test]
    fn two_models_or_adapters_never_share_a_block() {
        let text = "the same long prompt text for every adapter, ".repeat(8);
        let with = |model: &str| {
            chat(&format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"{text}"}}]}}"#
            ))
            .unwrap()
            .prompt
        };
        let (a, a2, b) = (with("base"), with("base"), with("base-lora-sql"));
        assert!(a.blocks >= 2);
        assert_eq!(a, a2, "the same model shares its prefixes");
        let theirs = b.block_hashes();
        assert!(a.block_hashes().iter().all(|h| !theirs.contains(h)));
        assert!(a.checkpoints.iter().all(|c| !b.checkpoints.contains(c)));
        assert_ne!(a.first_block, b.first_block);
        // The model field's place in the body does not matter.
        let after = chat(&format!(
            r#"{{"messages":[{{"role":"user","content":"{text}"}}],"model":"base"}}"#
        ))
        .unwrap()
        .prompt;
        assert_eq!(after, a);
    }

    #[test]
    fn invalid_responses_bodies_name_the_param() {
        for (body, param) in [
            (r#"{"model":"m"}"#, Some("input")),
            (r#"{"input":5}"#, Some("input")),
            (
                r#"{"input":[{"content":"no role or type"}]}"#,
                Some("input"),
            ),
            (r#"{"input":[{"role":"user","content":5}]}"#, Some("input")),
            (r#"{"input":"x","instructions":7}"#, Some("instructions")),
            (
                r#"{"input":"x","previous_response_id":1}"#,
                Some("previous_response_id"),
            ),
            (r#"{"input":"x","store":"yes"}"#, Some("store")),
            (
                r#"{"input":"x","max_output_tokens":-1}"#,
                Some("max_output_tokens"),
            ),
            (r#"{"input":"x","input":"y"}"#, Some("input")),
        ] {
            let e = resp(body).unwrap_err();
            assert_eq!(e.param, param, "{body}: {}", e.message);
        }
        // An empty list is valid (the prompt is then the instructions).
        assert!(resp(r#"{"input":[],"instructions":"hi"}"#).is_ok());
    }

    #[test]
    fn invalid_bodies_name_the_param() {
        let e = chat("{not json").unwrap_err();
        assert!(
            e.message.starts_with("request body is not valid JSON"),
            "{}",
            e.message
        );
        assert_eq!(chat("").unwrap_err().param, None);
        assert_eq!(
            chat(r#"{"model":"m"}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"messages":[]}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"messages":"hi"}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"messages":[{"content":"x"}]}"#).unwrap_err().param,
            Some("messages")
        );
        assert_eq!(
            chat(r#"{"messages":[{"role":"user","content":5}]}"#)
                .unwrap_err()
                .param,
            Some("messages")
        );
        let e =
            chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"9"}"#).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        let e =
            chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#).unwrap_err();
        assert_eq!(e.param, Some("max_tokens"));
        let e = chat(r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#).unwrap_err();
        assert_eq!(e.param, Some("stream"));
        let e = chat(r#"{"messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}]}"#)
            .unwrap_err();
        assert!(e.message.contains("duplicate field `messages`"));
        assert!(chat(r#"[1,2]"#).is_err());
        assert!(chat(r#"{"messages":[{"role":"user","content":"x"}]} trailing"#).is_err());
        let deep = "[".repeat(10_000);
        assert!(chat(&format!(
            r#"{{"messages":[{{"role":"user","content":"x"}}],"x":{deep}}}"#
        ))
        .is_err());
        assert!(parse(
            Endpoint::ChatCompletions,
            b"{\"messages\":[{\"role\":\"u\",\"content\":\"\xff\"}]}",
            PromptHasher::new(64, 1)
        )
        .is_err());
        // Found by fuzzing (fuzz/corpus/request/invalid-utf8-in-ignored-member):
        // invalid UTF-8 in a member the router skips was accepted.
        let e = parse(
            Endpoint::ChatCompletions,
            b"{\"messages\":[{\"role\":\"u\",\"content\":\"x\"}],\"tools\":[{\"\x9fype\":1}]}",
            PromptHasher::new(64, 1),
        )
        .unwrap_err();
        assert_eq!(e.param, None);
        assert!(
            e.message.contains("invalid UTF-8 at byte 52"),
            "{}",
            e.message
        );
        let e = parse(
            Endpoint::Completions,
            br#"{"prompt":[]}"#,
            PromptHasher::new(64, 1),
        )
        .unwrap_err();
        assert_eq!(e.param, Some("prompt"));
    }

    #[test]
    fn prompt_tokens_estimate() {
        let r = parse(
            Endpoint::Completions,
            br#"{"prompt":"abcdefghi"}"#,
            PromptHasher::counting_only(),
        )
        .unwrap();
        let tpb = crate::fleet::tokens::PRIOR_TOKENS_PER_BYTE;
        assert_eq!(crate::fleet::tokens::tokens_of(r.prompt.bytes, tpb), 3);
    }
}
