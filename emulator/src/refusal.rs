//! Error answers in the shapes the engines give them, for the endpoints
//! that follow the engines' wording closely (`/v1/responses...`,
//! `/v1/embeddings`). Pure.
//!
//! - vLLM's `ErrorResponse` (`vllm/entrypoints/openai/engine/protocol.py`,
//!   built by `OpenAIServing.create_error_response`) nests the error:
//!   `{"error": {"message", "type", "param", "code"}}`, `code` being the
//!   HTTP status; SGLang's Responses API handler builds the same shape.
//! - SGLang's other endpoints answer its flat `ErrorResponse`:
//!   `{"object": "error", "message", "type", "param", "code"}`.
//! - A body that does not fit the request schema is rejected by FastAPI
//!   before any handler runs; vLLM's `validation_exception_handler`
//!   (`api_server.py`) turns that into a 400 with type `"Bad Request"`.
//! - No route for the path, or a route for another method: Starlette's own
//!   `{"detail": "Not Found"}` (404) and `{"detail": "Method Not Allowed"}`
//!   (405, with `Allow`), which both engines' FastAPI apps answer.

use serde_json::{json, Value};

use crate::config::Mode;

/// An answer given instead of doing the work: status and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub body: Vec<u8>,
}

fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

impl Refusal {
    /// `{"error": {"message", "type", "param", "code": status}}`.
    pub fn nested(status: u16, message: &str, kind: &str, param: Option<&str>) -> Refusal {
        Refusal {
            status,
            body: to_bytes(&json!({
                "error": {"message": message, "type": kind, "param": param, "code": status}
            })),
        }
    }

    /// `{"object": "error", "message", "type", "param", "code": status}`.
    pub fn flat(status: u16, message: &str, kind: &str, param: Option<&str>) -> Refusal {
        Refusal {
            status,
            body: to_bytes(&json!({
                "object": "error", "message": message, "type": kind, "param": param,
                "code": status
            })),
        }
    }

    /// A 400 `BadRequestError` from the serving code, in the engine's own
    /// shape (vLLM nested, SGLang flat).
    pub fn bad_request(mode: Mode, message: &str, param: Option<&str>) -> Refusal {
        match mode {
            Mode::Vllm => Refusal::nested(400, message, "BadRequestError", param),
            Mode::Sglang => Refusal::flat(400, message, "BadRequestError", param),
        }
    }

    /// A body that does not fit the request schema (not JSON, a missing or
    /// mistyped field): 400 with type `"Bad Request"` (the status phrase,
    /// as vLLM's validation handler sets it). The message is the emulator's
    /// own: pydantic's error listing is not reproduced.
    pub fn schema(mode: Mode, message: &str, param: Option<&str>) -> Refusal {
        match mode {
            Mode::Vllm => Refusal::nested(400, message, "Bad Request", param),
            Mode::Sglang => Refusal::flat(400, message, "Bad Request", param),
        }
    }

    /// Starlette: no route matches the path.
    pub fn route_not_found() -> Refusal {
        Refusal {
            status: 404,
            body: to_bytes(&json!({"detail": "Not Found"})),
        }
    }

    /// Starlette: a route matches the path but not the method (the caller
    /// adds `Allow`).
    pub fn method_not_allowed() -> Refusal {
        Refusal {
            status: 405,
            body: to_bytes(&json!({"detail": "Method Not Allowed"})),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(r: &Refusal) -> Value {
        serde_json::from_slice(&r.body).unwrap()
    }

    #[test]
    fn shapes() {
        let n = Refusal::nested(404, "m", "invalid_request_error", Some("response_id"));
        assert_eq!(
            parse(&n),
            json!({"error": {"message": "m", "type": "invalid_request_error",
                              "param": "response_id", "code": 404}})
        );
        let f = Refusal::flat(400, "m", "BadRequestError", None);
        assert_eq!(
            parse(&f),
            json!({"object": "error", "message": "m", "type": "BadRequestError",
                   "param": null, "code": 400})
        );
        let s = Refusal::schema(Mode::Vllm, "bad", None);
        assert_eq!(
            (s.status, parse(&s)["error"]["type"].clone()),
            (400, json!("Bad Request"))
        );
        let b = Refusal::bad_request(Mode::Sglang, "x", None);
        assert_eq!(parse(&b)["object"], "error");
        assert_eq!(
            parse(&Refusal::route_not_found()),
            json!({"detail": "Not Found"})
        );
        let m = Refusal::method_not_allowed();
        assert_eq!(
            (m.status, parse(&m)),
            (405, json!({"detail": "Method Not Allowed"}))
        );
    }
}
