//! Context limits at the edge: what a region's engine says its context
//! limit is (in its `/v1/models`: vLLM's and SGLang's `max_model_len`,
//! llama.cpp's `meta.n_ctx`), the router's estimate of a request's prompt
//! tokens, which regions are candidates by their limit, and the 400 the
//! router answers, in the engine's own words, type, `param` and code, for
//! the one refusal it can be sure of.
//!
//! The router refuses only what every allowed region's engine is sure to
//! refuse whatever the prompt: an output asked for above the limit
//! ([`refuses_output`]). A prompt's length is the engine's to judge: the
//! estimate counts bytes of the router's canonical prompt text, not the
//! engine's tokens under its chat template, and is wrong both ways (digits
//! take twice the tokens of prose), so it only prefers the regions it
//! likely fits ([`fits`], lowered by `context.margin`), and when it fits
//! none, the region with the largest limit takes the request and its
//! engine answers. A region whose limit is unknown takes everything.

use serde_json::Value;

use crate::config::Config;
use crate::engines::metrics::EngineKind;
use crate::fleet::snapshot::{RegionState, Snapshot};
use crate::request::openai::{Endpoint, InferenceRequest};
use crate::shared::openai_error::Code;

/// Where a model card states the context limit, per engine family, as a
/// path of keys (also how messages name it).
fn limit_keys(engine: EngineKind) -> &'static [&'static str] {
    match engine {
        EngineKind::Vllm | EngineKind::Sglang => &["max_model_len"],
        // The context of one slot (`-c` / `--parallel`): what one request
        // can fill, and what llama-server refuses a prompt against.
        EngineKind::Llamacpp => &["meta", "n_ctx"],
    }
}

/// The field a model card states the limit in, as messages name it
/// (`max_model_len`, `meta.n_ctx`).
pub fn limit_field(engine: EngineKind) -> String {
    limit_keys(engine).join(".")
}

/// The context limit a `/v1/models` body states: the smallest limit among
/// its cards that state one, in the engine family's field
/// ([`limit_field`]). vLLM and SGLang list the served model with its limit;
/// LoRA adapters are listed with `max_model_len: null` and share the base
/// model's limit. llama.cpp lists its model with `meta.n_ctx`. The
/// smallest is taken so that a request the router lets through is one
/// every listed model can take.
pub fn parse_model_limit(engine: EngineKind, body: &[u8]) -> Result<u32, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("model list is not JSON: {e}"))?;
    let data = v
        .get("data")
        .ok_or("model list has no `data`")?
        .as_array()
        .ok_or("model list `data` is not an array")?;
    let field = limit_field(engine);
    let mut least: Option<u32> = None;
    for (i, card) in data.iter().enumerate() {
        let stated = limit_keys(engine)
            .iter()
            .try_fold(card, |v, key| v.get(key));
        let limit = match stated {
            None | Some(Value::Null) => continue,
            Some(Value::Number(n)) => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("data[{i}].{field} {n} is not a token count"))?,
            Some(other) => {
                return Err(format!(
                    "data[{i}].{field} is {}, not a number",
                    kind_of(other)
                ))
            }
        };
        least = Some(least.map_or(limit, |l| l.min(limit)));
    }
    least.ok_or_else(|| format!("none of the {} model cards has a {field}", data.len()))
}

/// The most models a region's list is kept with; a longer list (an engine
/// serving many adapters) is not kept, and the region is taken to serve
/// any model, as when its list is unknown.
pub const MAX_LISTED_MODELS: usize = 64;
/// The longest model id kept; a list with a longer one is not kept.
const MAX_MODEL_ID_BYTES: usize = 256;

/// The models a `/v1/models` body names: each card's `id`, in order (vLLM
/// lists its served names and LoRA adapters, SGLang its served name and
/// adapters, llama.cpp its model or alias). Empty when the list is longer
/// than [`MAX_LISTED_MODELS`] or an id longer than 256 bytes.
pub fn parse_model_ids(body: &[u8]) -> Result<Vec<String>, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("model list is not JSON: {e}"))?;
    let data = v
        .get("data")
        .and_then(Value::as_array)
        .ok_or("model list has no `data` array")?;
    if data.is_empty() {
        return Err("the model list is empty".to_string());
    }
    let mut ids = Vec::new();
    for (i, card) in data.iter().enumerate() {
        let id = card
            .get("id")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("data[{i}].id is not a string"))?;
        if data.len() > MAX_LISTED_MODELS || id.len() > MAX_MODEL_ID_BYTES {
            return Ok(Vec::new());
        }
        if !ids.iter().any(|m| m == id) {
            ids.push(id.to_string());
        }
    }
    Ok(ids)
}

/// Where a request naming `model` may go: `allowed` (the residency pin),
/// less every region whose engine's model list does not name the model,
/// when some allowed region's does. Such a region would answer 404; where
/// none names it, nothing is excluded and the engines answer in their own
/// words. A region whose list is unknown is never excluded. `None`: every
/// region, as `allowed` was. Allocates only when a region is excluded.
pub fn serving(
    cfg: &Config,
    model: Option<&str>,
    snapshot: &Snapshot,
    snapshot_index: &[Option<usize>],
    allowed: Option<Vec<bool>>,
) -> Option<Vec<bool>> {
    let Some(model) = model else {
        return allowed;
    };
    let n = cfg.regions.len();
    let is_allowed = |i: usize| {
        allowed
            .as_ref()
            .is_none_or(|a| a.get(i).copied().unwrap_or(false))
    };
    // Per region: Some(true) lists it, Some(false) lists others only,
    // None not known.
    let lists = |i: usize| {
        snapshot
            .region_at(snapshot_index, i)
            .filter(|s| !s.models.is_empty())
            .map(|s| s.models.iter().any(|m| m == model))
    };
    let listed_somewhere = (0..n).any(|i| is_allowed(i) && lists(i) == Some(true));
    let excludes = (0..n).any(|i| is_allowed(i) && lists(i) == Some(false));
    if !(listed_somewhere && excludes) {
        return allowed;
    }
    Some(
        (0..n)
            .map(|i| is_allowed(i) && lists(i) != Some(false))
            .collect(),
    )
}

/// Whether the engine counts the requested output against its limit for a
/// prompt it can take. SGLang does (prompt plus `max_new_tokens` must fit);
/// vLLM 0.32 does not (it serves any prompt that leaves room for one
/// token, cutting the output at the context with `finish_reason:
/// "length"`), nor does llama.cpp (it stops when the slot is full).
pub fn output_counts(engine: EngineKind) -> bool {
    match engine {
        EngineKind::Sglang => true,
        EngineKind::Vllm | EngineKind::Llamacpp => false,
    }
}

/// Whether the engine refuses `output` requested tokens whatever the
/// prompt: the one context refusal the edge can be sure of, since it
/// needs no token count. vLLM (0.32, and the earlier releases, which
/// counted prompt plus output) refuses an output above `max_model_len`;
/// SGLang, whose prompt plus output must stay below its context, an output
/// of the whole context (a prompt has at least one token); llama.cpp
/// never refuses an output length.
pub fn refuses_output(engine: EngineKind, limit: u32, output: u64) -> bool {
    match engine {
        EngineKind::Vllm => output > u64::from(limit),
        EngineKind::Sglang => output >= u64::from(limit),
        EngineKind::Llamacpp => false,
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The router's estimate of the request's prompt tokens at a region. The
/// one place the edge turns prompt bytes into tokens for a context limit.
///
/// With the region's tokens per byte as the cost uses them: measured from
/// its engine's `usage.prompt_tokens` (for the request's model, where
/// measured), else 4 bytes per token ([`crate::fleet::tokens::PRIOR_TOKENS_PER_BYTE`]).
pub fn prompt_tokens(req: &InferenceRequest, state: Option<&RegionState>) -> u64 {
    crate::fleet::tokens::tokens_of(
        req.prompt.bytes,
        crate::fleet::tokens::tokens_per_byte(state, req.model.as_deref()),
    )
}

/// The output tokens the request asks for, as the engines read them
/// (`max_completion_tokens` before `max_tokens`).
pub fn requested_output(req: &InferenceRequest) -> Option<u64> {
    req.max_completion_tokens.or(req.max_tokens)
}

/// Whether a region with context limit `limit` is likely to take a prompt
/// estimated at `estimate` tokens asking for `output` tokens (`None`: the
/// output does not count there, see [`output_counts`]): the estimate
/// lowered by `margin` leaves room for one output token, or for the
/// output. Only a preference: the estimate counts bytes, not the engine's
/// tokens, so a region it passes over still takes the request when no
/// region is likely to, and the engine judges.
pub fn fits(margin: f64, limit: Option<u32>, estimate: u64, output: Option<u64>) -> bool {
    let Some(limit) = limit else {
        return true;
    };
    let lowered = (estimate as f64 * (1.0 - margin)).floor() as u64;
    lowered.saturating_add(output.unwrap_or(1).max(1)) <= u64::from(limit)
}

/// A request every allowed region's engine refuses for the output it asks
/// for ([`refuses_output`]): the region with the largest limit, that
/// limit, and the output asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Exceeded {
    pub region: usize,
    pub limit: u32,
    pub output: u64,
}

/// The context check of one request: per configured region (bit i) whether
/// it is a candidate by its context, and the refusal when every allowed
/// region's engine is sure to refuse.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Check {
    pub fits: u64,
    pub exceeded: Option<Exceeded>,
}

impl Check {
    /// Every region can take it (no snapshot, no known limits).
    pub const ALL_FIT: Check = Check {
        fits: u64::MAX,
        exceeded: None,
    };
}

/// Check a request against the regions' limits in the snapshot. `allowed`
/// is the residency pin (per configured region).
///
/// A region whose engine is sure to refuse the output asked for is no
/// candidate; when that is every allowed region, the request is refused
/// at the edge ([`Exceeded`]). Otherwise the candidates are the regions
/// the prompt estimate likely fits ([`fits`]); when it likely fits none
/// allowed, the allowed regions with the largest limit (or an unknown one)
/// stay candidates, and their engine answers: a prompt is never refused
/// on an estimate. No allocation: a few multiplications per region.
pub fn check(
    cfg: &Config,
    req: &InferenceRequest,
    snapshot: &Snapshot,
    snapshot_index: &[Option<usize>],
    allowed: Option<&[bool]>,
) -> Check {
    let requested = requested_output(req);
    let mut fits_mask = 0u64;
    let mut any_allowed_fits = false;
    // The allowed regions not sure to refuse with the largest limit
    // (`Some(None)`: unknown, larger than any).
    let mut takers = 0u64;
    let mut largest: Option<Option<u32>> = None;
    let mut refused: Option<Exceeded> = None;
    for (i, region) in cfg.regions.iter().enumerate().take(64) {
        let state = snapshot.region_at(snapshot_index, i);
        let limit = state.and_then(|s| s.max_model_len);
        let is_allowed = allowed.is_none_or(|a| a.get(i).copied().unwrap_or(false));
        let sure = limit
            .zip(requested)
            .filter(|&(l, o)| refuses_output(region.engine, l, o));
        if let Some((limit, output)) = sure {
            if is_allowed && refused.is_none_or(|r| limit > r.limit) {
                refused = Some(Exceeded {
                    region: i,
                    limit,
                    output,
                });
            }
            continue;
        }
        let output = requested.filter(|_| output_counts(region.engine));
        if fits(cfg.context.margin, limit, prompt_tokens(req, state), output) {
            fits_mask |= 1 << i;
            any_allowed_fits |= is_allowed;
        }
        if is_allowed {
            let larger = match (largest, limit) {
                (None, _) | (Some(Some(_)), None) => true,
                (Some(None), _) => false,
                (Some(Some(l)), Some(m)) => m > l,
            };
            if larger {
                takers = 0;
                largest = Some(limit);
            }
            if largest == Some(limit) {
                takers |= 1 << i;
            }
        }
    }
    if largest.is_none() {
        return Check {
            fits: fits_mask,
            exceeded: refused,
        };
    }
    Check {
        fits: if any_allowed_fits {
            fits_mask
        } else {
            fits_mask | takers
        },
        exceeded: None,
    }
}

/// The refused output's field, as the client named it.
pub fn output_param(endpoint: Endpoint, req: &InferenceRequest) -> &'static str {
    match (req.max_completion_tokens, endpoint) {
        (Some(_), _) => "max_completion_tokens",
        (None, Endpoint::Responses) => "max_output_tokens",
        (None, _) => "max_tokens",
    }
}

/// An engine's refusal as its clients see it: the OpenAI error's `type`,
/// `param` and `code` (vLLM's and SGLang's `code` is the status number),
/// its message, and whether the body is SGLang's flat one.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRefusal {
    pub error_type: &'static str,
    pub param: Option<&'static str>,
    pub code: Code<'static>,
    pub message: String,
    pub flat: bool,
}

impl EngineRefusal {
    /// The body the engine answers with.
    pub fn body(&self) -> Vec<u8> {
        let make = if self.flat {
            crate::shared::openai_error::flat_error_body
        } else {
            crate::shared::openai_error::error_body
        };
        make(&self.message, self.error_type, self.param, Some(self.code))
    }
}

/// The refusal of an output the region's engine is sure to refuse
/// ([`refuses_output`]), in that engine's words, type, `param` and code:
/// vLLM 0.32's, as wasm-tests/test_vllm.py checks against the real
/// engine; SGLang's flat body, as the emulator's SGLang mode has it. SGLang's
/// message states the prompt's tokens, which only the engine counts: the
/// edge says it estimated them. (llama.cpp refuses no
/// output length; were it asked, it answers as vLLM.)
pub fn refusal(
    engine: EngineKind,
    e: &Exceeded,
    param: &'static str,
    estimate: u64,
) -> EngineRefusal {
    let (limit, m) = (e.limit, e.output);
    match engine {
        EngineKind::Vllm | EngineKind::Llamacpp => EngineRefusal {
            error_type: "BadRequestError",
            param: Some(param),
            code: Code::Status(400),
            flat: false,
            message: format!(
                "{param}={m} cannot be greater than max_model_len={limit}. Please request fewer output tokens. (parameter={param}, value={m})"
            ),
        },
        EngineKind::Sglang => EngineRefusal {
            error_type: "BadRequestError",
            param: None,
            code: Code::Status(400),
            flat: true,
            message: format!(
                "Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a total of about {} tokens: about {estimate} tokens from the input messages (estimated at the edge) and {m} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                estimate.saturating_add(m)
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::openai;
    use crate::request::prefix::PromptHasher;

    #[test]
    fn the_models_are_the_cards_ids_and_a_huge_list_is_not_kept() {
        let vllm = br#"{"object":"list","data":[{"id":"m","max_model_len":32768},
            {"id":"sql-lora","max_model_len":null,"parent":"m"},{"id":"m"}]}"#;
        assert_eq!(parse_model_ids(vllm).unwrap(), ["m", "sql-lora"]);
        for bad in [
            &b"{}"[..],
            b"{\"data\":[]}",
            b"{\"data\":[{\"id\":1}]}",
            b"nope",
        ] {
            assert!(
                parse_model_ids(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let many: Vec<String> = (0..=MAX_LISTED_MODELS)
            .map(|i| format!(r#"{{"id":"a{i}"}}"#))
            .collect();
        let body = format!(r#"{{"data":[{}]}}"#, many.join(","));
        assert_eq!(
            parse_model_ids(body.as_bytes()).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_region_not_listing_the_model_is_excluded_only_while_another_lists_it() {
        let cfg = Config::parse(
            br#"{"regions":[{"name":"a","cluster":"a","capacity_rps":1},{"name":"b","cluster":"b","capacity_rps":1},{"name":"c","cluster":"c","capacity_rps":1}]}"#,
        )
        .unwrap();
        let mut snap = Snapshot::all_healthy(&cfg);
        let index: Vec<Option<usize>> = (0..3).map(Some).collect();
        snap.regions[0].models = vec!["base".into()];
        snap.regions[1].models = vec!["base".into(), "sql-lora".into()];
        // c's list is unknown: never excluded.
        let got = |model: Option<&str>, allowed: Option<Vec<bool>>| {
            serving(&cfg, model, &snap, &index, allowed)
        };
        assert_eq!(got(Some("sql-lora"), None), Some(vec![false, true, true]));
        assert_eq!(got(Some("base"), None), None);
        assert_eq!(got(None, None), None);
        // Nobody lists it: the engines answer in their own words.
        assert_eq!(got(Some("other"), None), None);
        // Only the allowed regions' lists count, and the pin stays.
        assert_eq!(
            got(Some("sql-lora"), Some(vec![true, false, false])),
            Some(vec![true, false, false])
        );
        assert_eq!(
            got(Some("sql-lora"), Some(vec![true, true, false])),
            Some(vec![false, true, false])
        );
    }

    #[test]
    fn the_limit_is_the_smallest_card_and_garbage_is_an_error() {
        let vllm = br#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768},
            {"id":"lora","object":"model","max_model_len":null,"parent":"m"}]}"#;
        assert_eq!(parse_model_limit(EngineKind::Vllm, vllm), Ok(32768));
        let two = br#"{"data":[{"max_model_len":8192},{"max_model_len":4096}]}"#;
        assert_eq!(parse_model_limit(EngineKind::Vllm, two), Ok(4096));
        for (body, says) in [
            (&b"\x00garbage{"[..], "not JSON"),
            (b"[]", "no `data`"),
            (br#"{"data":{"max_model_len":5}}"#, "not an array"),
            (br#"{"data":[]}"#, "none of the 0 model cards"),
            (
                br#"{"data":[{"id":"lora","max_model_len":null}]}"#,
                "none of the 1",
            ),
            (
                br#"{"data":[{"max_model_len":"32768"}]}"#,
                "data[0].max_model_len is a string",
            ),
            (br#"{"data":[{"max_model_len":-1}]}"#, "not a token count"),
            (br#"{"data":[{"max_model_len":0}]}"#, "not a token count"),
            (br#"{"data":[{"max_model_len":1.5}]}"#, "not a token count"),
            (
                br#"{"data":[{"max_model_len":99999999999}]}"#,
                "not a token count",
            ),
            (
                br#"{"data":[{"max_model_len":4096},{"max_model_len":true}]}"#,
                "data[1]",
            ),
        ] {
            let e = parse_model_limit(EngineKind::Sglang, body).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
        // Deeply nested: serde's recursion limit, an error and no overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_model_limit(EngineKind::Llamacpp, deep.as_bytes()).is_err());
    }

    #[test]
    fn llamacpp_states_its_limit_in_meta_n_ctx() {
        // As llama-server b11434 lists its model (`-c 16384 --parallel 4`):
        // no max_model_len; `meta.n_ctx` is one slot's context.
        let llama = br#"{"models":[{"name":"tiny.gguf","model":"tiny.gguf"}],"object":"list",
            "data":[{"id":"tiny.gguf","aliases":["tiny"],"tags":[],"object":"model","created":1764540000,
            "owned_by":"llamacpp","meta":{"vocab_type":2,"n_vocab":128256,"n_ctx":4096,
            "n_ctx_train":131072,"n_embd":64,"n_params":8409088,"size":33686528,"ftype":1}}]}"#;
        assert_eq!(parse_model_limit(EngineKind::Llamacpp, llama), Ok(4096));
        assert_eq!(limit_field(EngineKind::Llamacpp), "meta.n_ctx");
        // Read as vLLM's, the same list has no limit; and a vLLM list read
        // as llama.cpp's neither: each family's field only.
        let e = parse_model_limit(EngineKind::Vllm, llama).unwrap_err();
        assert_eq!(e, "none of the 1 model cards has a max_model_len");
        let vllm = br#"{"data":[{"id":"m","max_model_len":32768}]}"#;
        let e = parse_model_limit(EngineKind::Llamacpp, vllm).unwrap_err();
        assert_eq!(e, "none of the 1 model cards has a meta.n_ctx");
        for (body, says) in [
            (
                &br#"{"data":[{"meta":{"n_ctx":"4096"}}]}"#[..],
                "data[0].meta.n_ctx is a string, not a number",
            ),
            (
                br#"{"data":[{"meta":{"n_ctx":0}}]}"#,
                "data[0].meta.n_ctx 0 is not a token count",
            ),
            (
                br#"{"data":[{"meta":4096}]}"#,
                "none of the 1 model cards has a meta.n_ctx",
            ),
        ] {
            assert_eq!(
                parse_model_limit(EngineKind::Llamacpp, body).unwrap_err(),
                says
            );
        }
        let two = br#"{"data":[{"meta":{"n_ctx":8192}},{"meta":{"n_ctx":null}},{"meta":{"n_ctx":2048}}]}"#;
        assert_eq!(parse_model_limit(EngineKind::Llamacpp, two), Ok(2048));
    }

    #[test]
    fn a_region_is_passed_over_only_beyond_the_margin() {
        // 1000 estimated tokens, 10 % margin: 900 must fit with the output.
        assert!(fits(0.1, None, u64::MAX, Some(u64::MAX)));
        assert!(fits(0.1, Some(901), 1000, None));
        assert!(
            !fits(0.1, Some(900), 1000, None),
            "no room for one output token"
        );
        assert!(fits(0.1, Some(1000), 1000, Some(100)));
        assert!(!fits(0.1, Some(999), 1000, Some(100)));
        assert!(fits(0.0, Some(1001), 1000, Some(0)));
        assert!(!fits(0.0, Some(1000), 1000, None));
    }

    fn cfg() -> Config {
        Config::parse(
            br#"{"regions":[
              {"name":"near","cluster":"cn","capacity_rps":5,"rtt_ms":5},
              {"name":"mid","cluster":"cm","capacity_rps":5,"rtt_ms":40},
              {"name":"far","cluster":"cf","capacity_rps":5,"rtt_ms":120,"engine":"sglang"}]}"#,
        )
        .unwrap()
    }

    fn chat(bytes: usize, extra: &str) -> InferenceRequest {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}]{extra}}}"#,
            "x".repeat(bytes)
        );
        openai::parse(
            Endpoint::ChatCompletions,
            body.as_bytes(),
            PromptHasher::counting_only(),
        )
        .unwrap()
    }

    fn snap(c: &Config, limits: [Option<u32>; 3]) -> Snapshot {
        let mut s = Snapshot::all_healthy(c);
        for (r, l) in s.regions.iter_mut().zip(limits) {
            r.max_model_len = l;
        }
        s
    }

    #[test]
    fn only_an_output_the_engines_refuse_whatever_the_prompt_is_refused() {
        let c = cfg();
        let idx = [Some(0), Some(1), Some(2)];
        // 40,000 bytes of canonical text ("user\n" + content + "\n"): 10,000
        // tokens at 4 bytes per token, 9,000 after the 10 % margin.
        let req = chat(39_994, "");
        assert_eq!(prompt_tokens(&req, None), 10_000);
        let s = snap(&c, [Some(4096), Some(32768), None]);
        let k = check(&c, &req, &s, &idx, None);
        assert_eq!(
            k.fits, 0b110,
            "near likely cannot take it; far's limit is unknown"
        );
        assert_eq!(k.exceeded, None);
        // Every limit known and likely too small: never refused on an
        // estimate; the region with the largest limit takes it.
        let s = snap(&c, [Some(4096), Some(8192), Some(2048)]);
        let k = check(&c, &req, &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b010, None));
        // A pin whose only region likely cannot take it: it goes there.
        let s = snap(&c, [Some(4096), Some(32768), Some(32768)]);
        let k = check(&c, &req, &s, &idx, Some(&[true, false, false]));
        assert_eq!((k.fits & 0b001, k.exceeded), (0b001, None));
        // vLLM 0.32 serves a prompt that fits whatever max_tokens asks
        // (it cuts the answer at the context): 9,000 + 24,000 > 32,768,
        // still a candidate. SGLang counts the output: far is passed over.
        let long_answer = chat(39_994, r#","max_tokens":100,"max_completion_tokens":24000"#);
        let k = check(&c, &long_answer, &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b010, None));
        // An output above every limit: vLLM refuses it whatever the
        // prompt, SGLang from its whole context on; refused, naming the
        // largest limit.
        let s = snap(&c, [Some(4096), Some(8192), Some(8192)]);
        let huge = chat(100, r#","max_tokens":8193"#);
        let k = check(&c, &huge, &s, &idx, None);
        assert_eq!(
            k.exceeded,
            Some(Exceeded {
                region: 1,
                limit: 8192,
                output: 8193
            })
        );
        // Exactly the limit: vLLM serves it (cut at the context), SGLang
        // refuses it.
        let k = check(&c, &chat(100, r#","max_tokens":8192"#), &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b010, None));
        // An unknown limit takes any output.
        let s = snap(&c, [Some(4096), Some(8192), None]);
        let k = check(&c, &huge, &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b100, None));
        // A short prompt fits everywhere.
        let k = check(&c, &chat(100, ""), &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b111, None));
    }

    #[test]
    fn a_llamacpp_region_refuses_no_output_length() {
        let mut c = cfg();
        if let Some(r) = c.regions.get_mut(2) {
            r.engine = EngineKind::Llamacpp;
        }
        let idx = [Some(0), Some(1), Some(2)];
        let s = snap(&c, [Some(4096), Some(4096), Some(4096)]);
        // 8,000 tokens asked for: vLLM refuses it, llama.cpp serves it
        // until its slot's context is full.
        let req = chat(3_994, r#","max_tokens":8000"#);
        let k = check(&c, &req, &s, &idx, None);
        assert_eq!((k.fits, k.exceeded), (0b100, None));
        let k = check(&c, &req, &s, &idx, Some(&[true, true, false]));
        assert_eq!(k.exceeded.map(|e| (e.region, e.limit)), Some((0, 4096)));
    }

    #[test]
    fn the_refusal_is_the_engines_own() {
        let e = Exceeded {
            region: 0,
            limit: 4096,
            output: 5000,
        };
        // vLLM 0.32's answer to max_tokens 5000 over max_model_len 4096,
        // byte for byte as the real engine (wasm-tests/test_vllm.py).
        assert_eq!(
            refusal(EngineKind::Vllm, &e, "max_completion_tokens", 10),
            EngineRefusal {
                error_type: "BadRequestError",
                param: Some("max_completion_tokens"),
                code: Code::Status(400),
                message: "max_completion_tokens=5000 cannot be greater than max_model_len=4096. Please request fewer output tokens. (parameter=max_completion_tokens, value=5000)".into(),
                flat: false,
            }
        );
        let r = refusal(EngineKind::Sglang, &e, "max_tokens", 10);
        assert!(r.message.starts_with(
            "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of about 5010 tokens"
        ), "{}", r.message);
        let body: Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"object": "error", "message": r.message, "type": "BadRequestError",
                               "param": null, "code": 400})
        );
        let parse = |endpoint, body: &str| {
            openai::parse(endpoint, body.as_bytes(), PromptHasher::counting_only()).unwrap()
        };
        let p = |endpoint, body: &str| output_param(endpoint, &parse(endpoint, body));
        let m = r#""messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(
            p(
                Endpoint::ChatCompletions,
                &format!(r#"{{{m},"max_tokens":5}}"#)
            ),
            "max_tokens"
        );
        assert_eq!(
            p(
                Endpoint::ChatCompletions,
                &format!(r#"{{{m},"max_tokens":5,"max_completion_tokens":6}}"#)
            ),
            "max_completion_tokens"
        );
        assert_eq!(
            p(Endpoint::Completions, r#"{"prompt":"x","max_tokens":5}"#),
            "max_tokens"
        );
        assert_eq!(
            p(
                Endpoint::Responses,
                r#"{"input":"x","max_output_tokens":5}"#
            ),
            "max_output_tokens"
        );
    }
}
