//! `POST /v1/embeddings` as vLLM answers it (SGLang's differences noted),
//! pure: reading the body into prompts of the engine's own tokens, a
//! deterministic embedding per prompt, and the response body.
//!
//! Matched against vLLM's `vllm/entrypoints/pooling/embed/` (`protocol.py`
//! `EmbeddingCompletionRequest`/`EmbeddingResponse`, `serving.py`,
//! `api_router.py`), `pooling_params.py` (`dimensions`) and
//! `engine/serving.py` (`create_error_response`, the input-length check),
//! and SGLang's `serving_embedding.py` (its input checks and wording).
//!
//! The emulated model is a Matryoshka model of `--embedding-dim` dimensions:
//! `dimensions` keeps the leading ones (vLLM slices, then normalizes), and
//! asking for more than the model has yields them all. The vector of a
//! prompt depends only on its tokens: each token, with the one before it,
//! seeds a pseudo-random contribution to every dimension.
//!
//! Not emulated: chat-style embedding requests (`messages`), the `bytes`
//! encodings, `embed_dtype`/`endianness` (base64 is float32 little-endian),
//! `truncate_prompt_tokens`.

use base64::Engine as _;
use serde_json::{json, Map, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::Mode;
use crate::refusal::Refusal;
use crate::tokenizer;

/// What a `POST /v1/embeddings` body asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingRequest {
    /// One prompt per embedding, in the engine's tokens.
    pub prompts: Vec<Vec<u32>>,
    pub base64: bool,
    pub dimensions: Option<usize>,
    /// `normalize` (default true).
    pub normalize: bool,
}

impl EmbeddingRequest {
    pub fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }
}

const EMPTY: &str = "please provide at least one prompt";
const BAD_INPUT: &str =
    "body.input: Input should be a valid string, a list of strings, a list of token ids or a list of lists of token ids";

/// SGLang's own checks of `input` (`_validate_request`), in its words.
fn sglang_input_check(input: &Value) -> Option<String> {
    match input {
        Value::String(s) if s.is_empty() => Some("Input cannot be empty".into()),
        Value::String(s) if s.trim().is_empty() => {
            Some("Input cannot be empty or whitespace only".into())
        }
        Value::Array(items) if items.is_empty() => Some("Input cannot be empty".into()),
        Value::Array(items) => match items.first() {
            Some(Value::String(_)) => items.iter().enumerate().find_map(|(i, item)| match item {
                Value::String(s) if s.trim().is_empty() => Some(format!(
                    "Input at index {i} cannot be empty or whitespace only"
                )),
                Value::String(_) => None,
                _ => Some("All items in input list must be strings".into()),
            }),
            Some(Value::Number(_)) => items.iter().enumerate().find_map(|(i, item)| {
                match (item.as_i64(), item.as_u64()) {
                    (Some(n), _) if n < 0 => {
                        Some(format!("Token ID at index {i} must be non-negative"))
                    }
                    (Some(_), _) | (_, Some(_)) => None,
                    _ => Some("All items in input list must be integers".into()),
                }
            }),
            _ => None,
        },
        _ => None,
    }
}

/// `input` as prompts: a string or each string of a list (special tokens
/// added, as vLLM's renderer does for embeddings); a list of token ids, or
/// each list of a list of lists.
fn prompts(mode: Mode, input: &Value) -> Result<Vec<Vec<u32>>, Refusal> {
    let tokenize =
        |v: &Value| tokenizer::completion(v).map_err(|m| Refusal::bad_request(mode, &m, None));
    match input {
        Value::String(_) => Ok(vec![tokenize(input)?]),
        Value::Array(items) if items.is_empty() => Err(Refusal::bad_request(mode, EMPTY, None)),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| tokenize(&Value::Array(vec![s.clone()])))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => Ok(vec![tokenize(input)?]),
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|ids| match ids {
                Value::Array(inner) if inner.is_empty() => {
                    Err(Refusal::bad_request(mode, EMPTY, None))
                }
                Value::Array(inner) if inner.iter().all(Value::is_number) => tokenize(ids),
                _ => Err(Refusal::schema(mode, BAD_INPUT, None)),
            })
            .collect(),
        _ => Err(Refusal::schema(mode, BAD_INPUT, None)),
    }
}

/// Reads a `POST /v1/embeddings` body.
pub fn parse_request(mode: Mode, body: &[u8]) -> Result<EmbeddingRequest, Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::schema(mode, &format!("JSON decode error: {e}"), None))?;
    let obj = value
        .as_object()
        .ok_or_else(|| Refusal::schema(mode, "body: Input should be a valid dictionary", None))?;
    let input = obj
        .get("input")
        .ok_or_else(|| Refusal::schema(mode, "body.input: Field required", None))?;
    if mode == Mode::Sglang {
        if let Some(msg) = sglang_input_check(input) {
            return Err(Refusal::bad_request(mode, &msg, None));
        }
    }
    let base64 = match obj.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(Value::String(f)) if f == "bytes" || f == "bytes_only" => {
            let msg = format!("encoding_format '{f}' is not supported by the engine emulator");
            return Err(Refusal::bad_request(mode, &msg, Some("encoding_format")));
        }
        Some(_) => {
            let msg =
                "body.encoding_format: Input should be 'float', 'base64', 'bytes' or 'bytes_only'";
            return Err(Refusal::schema(mode, msg, None));
        }
    };
    let dimensions = match obj.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(v) => match (v.as_i64(), v.as_u64()) {
            // PoolingParams.verify, for a Matryoshka model without a list of
            // allowed sizes.
            (Some(n), _) if n < 1 => {
                return Err(Refusal::bad_request(
                    mode,
                    "Dimensions must be greater than 0",
                    None,
                ))
            }
            (_, Some(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => {
                let msg = "body.dimensions: Input should be a valid integer";
                return Err(Refusal::schema(mode, msg, None));
            }
        },
    };
    let normalize = match obj.get("normalize") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            let msg = "body.normalize: Input should be a valid boolean";
            return Err(Refusal::schema(mode, msg, None));
        }
    };
    Ok(EmbeddingRequest {
        prompts: prompts(mode, input)?,
        base64,
        dimensions,
        normalize,
    })
}

/// A prompt longer than the model takes, refused in the engine's words
/// (vLLM: more than `max_model_len`, the whole context being input here;
/// SGLang: at least its context length).
pub fn context_refusal(
    mode: Mode,
    req: &EmbeddingRequest,
    max_model_len: usize,
) -> Option<Refusal> {
    let longest = req.prompts.iter().map(Vec::len).max().unwrap_or(0);
    match mode {
        Mode::Vllm if longest > max_model_len => Some(Refusal::bad_request(
            mode,
            &format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {longest} tokens in the input for embedding generation. Please reduce the length of the input."
            ),
            None,
        )),
        Mode::Sglang if longest >= max_model_len => Some(Refusal::bad_request(
            mode,
            &format!(
                "The input ({longest} tokens) is longer than the model's context length ({max_model_len} tokens)."
            ),
            None,
        )),
        _ => None,
    }
}

const EMBED_SEED: u64 = 0xe5be_dd00;

/// splitmix64: component `k` of the contribution seeded by `seed`.
fn component(seed: u64, k: u64) -> f64 {
    let mut z = seed.wrapping_add(k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    // 53 random bits to [-1, 1).
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// The embedding of `tokens`: the model's `dim` dimensions, the first
/// `dimensions` of them kept, then scaled to unit length if `normalize`.
pub fn vector(tokens: &[u32], dim: usize, dimensions: Option<usize>, normalize: bool) -> Vec<f32> {
    let len = dimensions.map_or(dim, |d| d.min(dim));
    let mut acc = vec![0f64; len];
    let mut prev = u32::MAX;
    for &t in tokens {
        let mut key = [0u8; 8];
        key[..4].copy_from_slice(&prev.to_le_bytes());
        key[4..].copy_from_slice(&t.to_le_bytes());
        let seed = xxh3_64_with_seed(&key, EMBED_SEED);
        for (k, x) in acc.iter_mut().enumerate() {
            *x += component(seed, k as u64);
        }
        prev = t;
    }
    if normalize {
        let norm = acc.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm > 0.0 {
            acc.iter_mut().for_each(|x| *x /= norm);
        }
    }
    acc.into_iter().map(|x| x as f32).collect()
}

/// The float32 little-endian bytes of `v`, base64 (vLLM's `base64`
/// encoding with the default `embed_dtype`).
pub fn base64_of(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Identity of one embedding response.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// vLLM's `EmbeddingResponse` (`embd-` id, `created`, usage with
/// `completion_tokens` 0); SGLang's has no id nor `created`.
pub fn response_body(
    mode: Mode,
    meta: &Meta,
    vectors: &[Vec<f32>],
    base64: bool,
    prompt_tokens: usize,
) -> Vec<u8> {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                json!(base64_of(v))
            } else {
                json!(v)
            };
            json!({"index": index, "object": "embedding", "embedding": embedding})
        })
        .collect();
    let usage = json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                       "completion_tokens": 0, "prompt_tokens_details": null});
    let mut body = Map::new();
    if mode == Mode::Vllm {
        body.insert("id".into(), json!(meta.id));
        body.insert("created".into(), json!(meta.created));
    }
    body.insert("object".into(), json!("list"));
    body.insert("model".into(), json!(meta.model));
    body.insert("data".into(), Value::Array(data));
    body.insert("usage".into(), usage);
    serde_json::to_vec(&Value::Object(body)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(mode: Mode, body: Value) -> Result<EmbeddingRequest, Refusal> {
        parse_request(mode, body.to_string().as_bytes())
    }

    fn err(r: &Refusal) -> Value {
        serde_json::from_slice(&r.body).unwrap()
    }

    #[test]
    fn inputs_become_prompts() {
        let r = parse(Mode::Vllm, json!({"input": "hello world"})).unwrap();
        assert_eq!(
            r.prompts,
            vec![tokenizer::completion(&json!("hello world")).unwrap()]
        );
        assert!(!r.base64 && r.normalize && r.dimensions.is_none());
        let r = parse(Mode::Vllm, json!({"input": ["a", "b c"]})).unwrap();
        assert_eq!(r.prompts.len(), 2);
        assert_eq!(r.prompts[1], tokenizer::completion(&json!("b c")).unwrap());
        let r = parse(
            Mode::Vllm,
            json!({"input": [1, 2, 3], "encoding_format": "base64",
                                         "dimensions": 8, "normalize": false}),
        )
        .unwrap();
        assert_eq!(r.prompts, vec![vec![1, 2, 3]]);
        assert_eq!(
            (r.base64, r.dimensions, r.normalize),
            (true, Some(8), false)
        );
        let r = parse(Mode::Vllm, json!({"input": [[1, 2], [3]]})).unwrap();
        assert_eq!(r.prompts, vec![vec![1, 2], vec![3]]);
        assert_eq!(r.prompt_tokens(), 3);
        // vLLM takes an empty string (the BOS token is its prompt).
        assert_eq!(
            parse(Mode::Vllm, json!({"input": ""}))
                .unwrap()
                .prompt_tokens(),
            1
        );
    }

    #[test]
    fn bad_inputs_are_400s() {
        for (body, kind, needle) in [
            (json!({}), "Bad Request", "Field required"),
            (json!({"input": 5}), "Bad Request", "body.input"),
            (json!({"input": [1, "a"]}), "Bad Request", "body.input"),
            (json!({"input": [[1], "a"]}), "Bad Request", "body.input"),
            (json!({"input": [[1, "x"]]}), "Bad Request", "body.input"),
            (json!({"input": []}), "BadRequestError", EMPTY),
            (json!({"input": [[]]}), "BadRequestError", EMPTY),
            (json!({"input": [-1]}), "BadRequestError", "non-negative"),
            (
                json!({"input": [999_999_999]}),
                "BadRequestError",
                "out of vocabulary",
            ),
            (
                json!({"input": "x", "encoding_format": "hex"}),
                "Bad Request",
                "encoding_format",
            ),
            (
                json!({"input": "x", "encoding_format": "bytes"}),
                "BadRequestError",
                "bytes",
            ),
            (
                json!({"input": "x", "dimensions": 0}),
                "BadRequestError",
                "Dimensions must be greater than 0",
            ),
            (
                json!({"input": "x", "dimensions": "8"}),
                "Bad Request",
                "dimensions",
            ),
            (
                json!({"input": "x", "normalize": 1}),
                "Bad Request",
                "normalize",
            ),
        ] {
            let e = parse(Mode::Vllm, body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            let v = err(&e);
            assert_eq!(v["error"]["type"], kind, "{body}");
            assert_eq!(v["error"]["code"], 400);
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{body}: {msg}");
        }
        assert_eq!(parse_request(Mode::Vllm, b"{oops").unwrap_err().status, 400);
        assert_eq!(parse_request(Mode::Vllm, b"[]").unwrap_err().status, 400);
    }

    #[test]
    fn sglang_refuses_in_its_words() {
        for (input, msg) in [
            (json!(""), "Input cannot be empty"),
            (json!("  "), "Input cannot be empty or whitespace only"),
            (json!([]), "Input cannot be empty"),
            (
                json!(["a", " "]),
                "Input at index 1 cannot be empty or whitespace only",
            ),
            (json!(["a", 1]), "All items in input list must be strings"),
            (json!([1, -2]), "Token ID at index 1 must be non-negative"),
            (json!([1, "a"]), "All items in input list must be integers"),
        ] {
            let e = parse(Mode::Sglang, json!({ "input": input })).unwrap_err();
            let v = err(&e);
            assert_eq!(
                (e.status, v["object"].as_str(), v["message"].as_str()),
                (400, Some("error"), Some(msg))
            );
        }
    }

    #[test]
    fn context_limit() {
        let r = parse(Mode::Vllm, json!({"input": [[1, 2, 3]]})).unwrap();
        assert!(context_refusal(Mode::Vllm, &r, 3).is_none());
        let e = context_refusal(Mode::Vllm, &r, 2).unwrap();
        assert_eq!(
            err(&e)["error"]["message"],
            "This model's maximum context length is 2 tokens. However, you requested 3 tokens in the input for embedding generation. Please reduce the length of the input."
        );
        assert!(context_refusal(Mode::Sglang, &r, 3).is_some());
    }

    #[test]
    fn vectors_are_deterministic_unit_and_matryoshka() {
        let a = tokenizer::completion(&json!("the cat sat")).unwrap();
        let b = tokenizer::completion(&json!("the dog ran")).unwrap();
        let va = vector(&a, 32, None, true);
        assert_eq!(va.len(), 32);
        assert_eq!(va, vector(&a, 32, None, true));
        assert_ne!(va, vector(&b, 32, None, true));
        let norm: f32 = va.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        // Matryoshka: the leading dimensions, renormalized; never more than
        // the model has.
        let short = vector(&a, 32, Some(8), true);
        let raw = vector(&a, 32, None, false);
        let raw8: Vec<f32> = raw.iter().take(8).copied().collect();
        let n8: f32 = raw8.iter().map(|x| x * x).sum::<f32>().sqrt();
        for (s, r) in short.iter().zip(&raw8) {
            assert!((s - r / n8).abs() < 1e-5);
        }
        assert_eq!(vector(&a, 32, Some(100), true).len(), 32);
        assert!(raw.iter().map(|x| x * x).sum::<f32>().sqrt() > 1.5);
    }

    #[test]
    fn bodies() {
        let meta = Meta {
            id: "embd-1".into(),
            created: 9,
            model: "m".into(),
        };
        let v = vec![vec![1.0f32, -0.5], vec![0.25, 0.0]];
        let body: Value =
            serde_json::from_slice(&response_body(Mode::Vllm, &meta, &v, false, 7)).unwrap();
        assert_eq!(body["id"], "embd-1");
        assert_eq!(body["object"], "list");
        assert_eq!(body["created"], 9);
        assert_eq!(body["data"][1]["index"], 1);
        assert_eq!(body["data"][0]["object"], "embedding");
        assert_eq!(body["data"][0]["embedding"], json!([1.0, -0.5]));
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0,
                   "prompt_tokens_details": null})
        );
        let b64: Value =
            serde_json::from_slice(&response_body(Mode::Vllm, &meta, &v, true, 7)).unwrap();
        // 1.0f32 = 00 00 80 3f, -0.5f32 = 00 00 00 bf.
        assert_eq!(b64["data"][0]["embedding"], "AACAPwAAAL8=");
        let sg: Value =
            serde_json::from_slice(&response_body(Mode::Sglang, &meta, &v, false, 7)).unwrap();
        assert!(sg.get("id").is_none() && sg.get("created").is_none());
        assert_eq!(sg["model"], "m");
    }
}
