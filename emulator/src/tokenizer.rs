//! The engine's tokenizer and chat template. Chosen on purpose NOT to share
//! the plugin's assumptions: the plugin estimates 4 bytes per token over its
//! own canonical text (`role\ncontent\n` per message); the engine runs a real
//! BPE vocabulary (OpenAI's `o200k_base`, bundled in `tiktoken-rs`, no
//! download at run time) over a Llama-3-style chat template with special
//! tokens. Token counts, block boundaries and what two prompts share are
//! therefore the engine's own, and the router has to live with the gap.
//!
//! The template (Llama 3 Instruct, `add_generation_prompt`):
//! `<|begin_of_text|>` then per message
//! `<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|>`,
//! then `<|start_header_id|>assistant<|end_header_id|>\n\n`. The special
//! tokens get ids just above the vocabulary (`o200k_base` has none of them).

use std::sync::OnceLock;

use serde_json::Value;
use tiktoken_rs::CoreBPE;

/// Ids of the template's special tokens, above `o200k_base`'s ranks.
pub const BEGIN_OF_TEXT: u32 = 200_100;
pub const START_HEADER: u32 = 200_101;
pub const END_HEADER: u32 = 200_102;
pub const EOT: u32 = 200_103;

/// Largest token id a client may send in a token-id prompt (the vocabulary
/// plus the template's specials); vLLM refuses ids outside its vocabulary.
pub const MAX_TOKEN_ID: u32 = EOT;

static BPE: OnceLock<Option<CoreBPE>> = OnceLock::new();

/// The vocabulary, loaded once (about 0.1 s). `None` only if the bundled
/// file failed to parse, which a unit test rules out.
fn bpe() -> Option<&'static CoreBPE> {
    BPE.get_or_init(|| tiktoken_rs::o200k_base().ok()).as_ref()
}

/// Loads the vocabulary now, so the first request does not pay for it.
pub fn warm_up() -> Result<(), String> {
    bpe().map(|_| ()).ok_or_else(|| NO_VOCAB.to_string())
}

const NO_VOCAB: &str = "the tokenizer's vocabulary failed to load";

/// Plain text to token ids (no special tokens are recognised in it).
pub fn encode(text: &str) -> Result<Vec<u32>, String> {
    let bpe = bpe().ok_or_else(|| NO_VOCAB.to_string())?;
    Ok(bpe.encode_ordinary(text))
}

fn push_text(out: &mut Vec<u32>, text: &str) -> Result<(), String> {
    if !text.is_empty() {
        out.extend(encode(text)?);
    }
    Ok(())
}

/// A message's content as the template renders it: the string, or the
/// concatenated `text` of `"type":"text"` parts; then any tool calls as
/// `{"name": .., "parameters": ..}` JSON, as Llama 3.1's template does.
fn content_text(msg: &serde_json::Map<String, Value>) -> String {
    let mut text = match msg.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    if let Some(Value::Array(calls)) = msg.get("tool_calls") {
        for call in calls {
            let f = call.get("function");
            let name = f
                .and_then(|f| f.get("name"))
                .cloned()
                .unwrap_or(Value::Null);
            let args = f
                .and_then(|f| f.get("arguments"))
                .cloned()
                .unwrap_or(Value::Null);
            let rendered = serde_json::json!({"name": name, "parameters": args});
            text.push_str(&rendered.to_string());
        }
    }
    text
}

/// Chat messages to the token ids the engine prefills.
pub fn chat(messages: &Value) -> Result<Vec<u32>, String> {
    let list = messages
        .as_array()
        .ok_or_else(|| "'messages' must be an array".to_string())?;
    let mut out = vec![BEGIN_OF_TEXT];
    for msg in list {
        let msg = msg
            .as_object()
            .ok_or_else(|| "each message must be an object".to_string())?;
        let role = match msg.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => return Err("each message needs a string 'role'".to_string()),
        };
        out.push(START_HEADER);
        push_text(&mut out, role)?;
        out.push(END_HEADER);
        let mut body = String::from("\n\n");
        body.push_str(content_text(msg).trim());
        push_text(&mut out, &body)?;
        out.push(EOT);
    }
    out.push(START_HEADER);
    push_text(&mut out, "assistant")?;
    out.push(END_HEADER);
    push_text(&mut out, "\n\n")?;
    Ok(out)
}

/// A completions `prompt` to token ids: a string gets `<|begin_of_text|>`
/// and its tokens; an array of strings is joined by "\n" first (the emulator
/// serves one choice); token ids are taken as they are (a batch of id arrays
/// concatenated), each at most [`MAX_TOKEN_ID`].
pub fn completion(prompt: &Value) -> Result<Vec<u32>, String> {
    const BAD: &str = "'prompt' must be a string, an array of strings, or token ids";
    match prompt {
        Value::String(s) => {
            let mut out = vec![BEGIN_OF_TEXT];
            push_text(&mut out, s)?;
            Ok(out)
        }
        Value::Array(items) if items.iter().all(Value::is_string) => {
            let joined: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
            let mut out = vec![BEGIN_OF_TEXT];
            push_text(&mut out, &joined.join("\n"))?;
            Ok(out)
        }
        Value::Array(items) => {
            let mut out = Vec::new();
            for item in items {
                match item {
                    Value::Number(_) => out.push(token_id(item)?),
                    Value::Array(ids) => {
                        for id in ids {
                            out.push(token_id(id)?);
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

fn token_id(v: &Value) -> Result<u32, String> {
    let id = v
        .as_u64()
        .ok_or_else(|| "token ids must be non-negative integers".to_string())?;
    match u32::try_from(id) {
        Ok(id) if id <= MAX_TOKEN_ID => Ok(id),
        _ => Err(format!("Token id {id} is out of vocabulary")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vocabulary_loads_and_is_real_bpe() {
        warm_up().unwrap();
        // Common English words are single tokens; random letters are not
        // 4 bytes a token.
        assert_eq!(encode("hello").unwrap().len(), 1);
        let random = "dvf pvu moc oxc qzj xkw ";
        let n = encode(random).unwrap().len();
        assert!(n > random.len() / 4, "{n} tokens");
        assert!(encode("").unwrap().is_empty());
    }

    #[test]
    fn chat_template_has_llama3_structure() {
        let ids = chat(&json!([
            {"role": "system", "content": "  be brief "},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}
        ]))
        .unwrap();
        assert_eq!(ids.first(), Some(&BEGIN_OF_TEXT));
        assert_eq!(ids.iter().filter(|&&t| t == EOT).count(), 2);
        assert_eq!(ids.iter().filter(|&&t| t == START_HEADER).count(), 3);
        let mut expect = vec![BEGIN_OF_TEXT, START_HEADER];
        expect.extend(encode("system").unwrap());
        expect.push(END_HEADER);
        expect.extend(encode("\n\nbe brief").unwrap());
        expect.push(EOT);
        assert_eq!(ids[..expect.len()], expect[..]);
        // Ends with the generation prompt.
        let mut tail = vec![START_HEADER];
        tail.extend(encode("assistant").unwrap());
        tail.push(END_HEADER);
        tail.extend(encode("\n\n").unwrap());
        assert!(ids.ends_with(&tail));
    }

    #[test]
    fn shared_leading_messages_share_leading_tokens() {
        let sys = json!({"role": "system", "content": "You are a careful assistant. ".repeat(40)});
        let a = chat(&json!([sys, {"role": "user", "content": "first question"}])).unwrap();
        let b = chat(&json!([sys, {"role": "user", "content": "another one"}])).unwrap();
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(common > 200, "{common}");
    }

    #[test]
    fn chat_refuses_bad_shapes() {
        assert!(chat(&json!({})).is_err());
        assert!(chat(&json!([1])).is_err());
        assert!(chat(&json!([{"content": "x"}])).is_err());
        // Tool calls render; null content is fine.
        let ids = chat(&json!([{"role": "assistant", "content": null,
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]))
        .unwrap();
        assert!(ids.len() > 8);
    }

    #[test]
    fn completion_prompts() {
        let s = completion(&json!("hello world")).unwrap();
        assert_eq!(s[0], BEGIN_OF_TEXT);
        assert_eq!(s.len(), 3);
        assert_eq!(
            completion(&json!(["a", "b"])).unwrap(),
            completion(&json!("a\nb")).unwrap()
        );
        assert_eq!(completion(&json!([1, 2, 3])).unwrap(), vec![1, 2, 3]);
        assert_eq!(completion(&json!([[1, 2], [3]])).unwrap(), vec![1, 2, 3]);
        assert!(completion(&json!([MAX_TOKEN_ID + 1]))
            .unwrap_err()
            .contains("out of vocabulary"));
        assert!(completion(&json!([-1])).is_err());
        assert!(completion(&json!([true])).is_err());
        assert!(completion(&json!(3)).is_err());
    }
}
