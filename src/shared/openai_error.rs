//! OpenAI-style error bodies, the format every client of these endpoints
//! already parses: `{"error":{"message","type","param","code"}}`.

use serde::Serialize;

#[derive(Serialize)]
struct Body<'a> {
    error: Error<'a>,
}

#[derive(Serialize)]
struct Error<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<Code<'a>>,
}

/// An error's `code`: OpenAI's and SGLang's are strings
/// (`context_length_exceeded`); vLLM's is the HTTP status as a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Code<'a> {
    Text(&'a str),
    Status(u16),
}

/// SGLang's flat error body (its `ErrorResponse` outside the Responses
/// API): `{"object": "error", "message", "type", "param", "code"}`.
pub fn flat_error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<Code<'_>>,
) -> Vec<u8> {
    #[derive(Serialize)]
    struct Flat<'a> {
        object: &'static str,
        #[serde(flatten)]
        error: Error<'a>,
    }
    serde_json::to_vec(&Flat {
        object: "error",
        error: Error {
            message,
            kind,
            param,
            code,
        },
    })
    .unwrap_or_else(|_| {
        br#"{"object":"error","message":"error","type":"server_error","param":null,"code":null}"#
            .to_vec()
    })
}

/// An error body. `kind` is OpenAI's `type` (e.g. `invalid_request_error`).
pub fn error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<Code<'_>>,
) -> Vec<u8> {
    serde_json::to_vec(&Body {
        error: Error {
            message,
            kind,
            param,
            code,
        },
    })
    .unwrap_or_else(|_| {
        br#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#.to_vec()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn shape() {
        let b = super::error_body("bad \"x\"", "invalid_request_error", Some("messages"), None);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["message"], "bad \"x\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "messages");
        assert!(v["error"]["code"].is_null());
        let b = super::error_body("m", "BadRequestError", None, Some(super::Code::Status(400)));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], 400);
        let b = super::error_body("m", "x", None, Some(super::Code::Text("c")));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "c");
        let b =
            super::flat_error_body("m", "BadRequestError", None, Some(super::Code::Status(400)));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"object": "error", "message": "m", "type": "BadRequestError",
                               "param": null, "code": 400})
        );
    }
}
