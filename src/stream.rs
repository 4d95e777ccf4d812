//! What the two HTTP filters have in common: the request headers as one host
//! call returns them, the flow-control answer to each event, and local
//! replies in the OpenAI error format.

use crate::openai;

/// The request headers, as Envoy hands them over in one call (names
/// lowercase, pseudo-headers included). A lookup scans them: a request has
/// a few dozen at most, and one scan is far cheaper than a host call each.
#[derive(Debug, Clone, Default)]
pub struct Headers {
    pairs: Vec<(String, String)>,
}

impl Headers {
    pub fn new(pairs: Vec<(String, String)>) -> Headers {
        Headers { pairs }
    }

    /// The first value of header `name` (lowercase).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn has(&self, name: &str) -> bool {
        self.pairs.iter().any(|(n, _)| n == name)
    }

    pub fn method(&self) -> &str {
        self.get(":method").unwrap_or_default()
    }

    pub fn path(&self) -> &str {
        self.get(":path").unwrap_or_default()
    }
}

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
            body: openai::error_body(message, kind, param, Some(code)),
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
    fn headers_are_found_by_exact_lowercase_name() {
        let h = Headers::new(vec![
            (":method".into(), "POST".into()),
            (":path".into(), "/v1/completions".into()),
            ("x-a".into(), "1".into()),
            ("x-a".into(), "2".into()),
        ]);
        assert_eq!(h.get("x-a"), Some("1"));
        assert_eq!(h.get("X-A"), None);
        assert!(h.has("x-a") && !h.has("x-b"));
        assert_eq!((h.method(), h.path()), ("POST", "/v1/completions"));
        assert_eq!(Headers::default().method(), "");
    }

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
