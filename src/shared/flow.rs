//! What the two HTTP filters have in common: the flow-control answer to
//! each event, and local replies in the OpenAI error format.

use crate::shared::openai_error::{self, Code};

/// A reply the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// An OpenAI-style error (`{"error": {message, type, param, code}}`).
    pub fn error(
        status: u32,
        kind: &str,
        code: &str,
        message: &str,
        param: Option<&str>,
        extra: &[(&'static str, String)],
    ) -> Reply {
        let mut headers = vec![("content-type", "application/json".to_string())];
        headers.extend_from_slice(extra);
        Reply {
            status,
            headers,
            body: openai_error::error_body(message, kind, param, Some(Code::Text(code))),
        }
    }

    /// `status` with a JSON body already made (an engine's own error).
    pub fn json_status(status: u32, body: Vec<u8>) -> Reply {
        Reply {
            status,
            headers: vec![("content-type", "application/json".to_string())],
            body,
        }
    }

    /// 200 with a JSON body.
    pub fn json(body: String) -> Reply {
        Reply {
            status: 200,
            headers: vec![("content-type", "application/json".to_string())],
            body: body.into_bytes(),
        }
    }
}

/// What the filter tells Envoy after an event.
#[derive(Debug, Clone, PartialEq)]
pub enum Flow {
    /// Go on to the next filter.
    Continue,
    /// Hold the stream (for the rest of the body).
    Pause,
    /// Answer with this and end the stream.
    Reply(Reply),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_reply_is_openai_json() {
        let r = Reply::error(
            429,
            "rate_limit_error",
            "degraded_mode_shed",
            "later",
            None,
            &[("retry-after", "3".into())],
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["code"], "degraded_mode_shed");
        assert_eq!(r.headers[1], ("retry-after", "3".to_string()));
    }
}
