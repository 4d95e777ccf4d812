//! HTTP/1.1 wire format, server side: parsing a request head and body
//! (Content-Length or chunked) from a buffered reader, and writing response
//! heads, fixed-length bodies and chunks. No sockets or routing here, so the
//! parser is testable on byte slices and every malformed input is an error
//! value, never a panic.

use std::io::{self, BufRead, Read, Write};

/// Request line plus headers; larger heads get 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// Request bodies beyond this get 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// A chunk-size line is a hex number plus optional extensions.
const MAX_CHUNK_LINE: usize = 4096;
/// Empty lines tolerated before a request line (RFC 9112 §2.2).
const MAX_LEADING_EMPTY_LINES: usize = 4;

#[derive(Debug)]
pub enum ReadError {
    /// The peer closed (or went idle past the read timeout) between requests.
    Closed,
    /// Transport failure mid-request; nothing sensible can be answered.
    Io(io::Error),
    /// 400: syntax or framing violation.
    Malformed(&'static str),
    /// 431: request line plus headers too large.
    HeadTooLarge,
    /// 413: body beyond the limit.
    BodyTooLarge,
    /// 501: a transfer coding other than chunked.
    Unsupported(&'static str),
}

impl ReadError {
    /// Status to answer with before closing, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            ReadError::Closed | ReadError::Io(_) => None,
            ReadError::Malformed(_) => Some(400),
            ReadError::HeadTooLarge => Some(431),
            ReadError::BodyTooLarge => Some(413),
            ReadError::Unsupported(_) => Some(501),
        }
    }

    pub fn message(&self) -> String {
        match self {
            ReadError::Closed => "connection closed".to_string(),
            ReadError::Io(e) => format!("i/o error: {e}"),
            ReadError::Malformed(m) => format!("malformed request: {m}"),
            ReadError::HeadTooLarge => "request head too large".to_string(),
            ReadError::BodyTooLarge => {
                format!("request body larger than {MAX_BODY_BYTES} bytes")
            }
            ReadError::Unsupported(m) => format!("not implemented: {m}"),
        }
    }
}

/// How the request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    None,
    Length(usize),
    Chunked,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Names lowercased, values with surrounding whitespace trimmed.
    pub headers: Vec<(String, String)>,
    pub body: BodyKind,
}

impl Head {
    pub fn header<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.header_values(name).next()
    }

    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn connection_has(&self, token: &str) -> bool {
        self.header_values("connection")
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    /// HTTP/1.1 defaults to persistent connections, HTTP/1.0 to close.
    pub fn keep_alive(&self) -> bool {
        if self.minor_version >= 1 {
            !self.connection_has("close")
        } else {
            self.connection_has("keep-alive")
        }
    }

    pub fn expects_continue(&self) -> bool {
        self.minor_version >= 1
            && self.body != BodyKind::None
            && self
                .header("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
    }

    /// Path without query string; absolute-form targets are reduced to it.
    pub fn path(&self) -> &str {
        let mut t = self.target.as_str();
        for scheme in ["http://", "https://"] {
            if let Some(rest) = t.strip_prefix(scheme) {
                t = rest.find('/').and_then(|i| rest.get(i..)).unwrap_or("/");
            }
        }
        t.split(['?', '#']).next().unwrap_or(t)
    }
}

/// Reads one line (LF or CRLF terminated) charging it against `budget`.
/// Ok(None) means clean EOF before any byte.
fn read_line<R: BufRead>(r: &mut R, budget: &mut usize) -> Result<Option<Vec<u8>>, ReadError> {
    let mut line = Vec::new();
    let limit = u64::try_from(*budget).unwrap_or(u64::MAX).saturating_add(1);
    let n = r
        .by_ref()
        .take(limit)
        .read_until(b'\n', &mut line)
        .map_err(ReadError::Io)?;
    if n == 0 {
        return Ok(None);
    }
    if n > *budget {
        return Err(ReadError::HeadTooLarge);
    }
    if line.last() != Some(&b'\n') {
        return Err(ReadError::Malformed("connection closed mid-line"));
    }
    *budget = budget.saturating_sub(n);
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    // Bare CR, NUL and other controls (except HTAB) enable request smuggling
    // tricks and never appear in legitimate heads.
    if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        return Err(ReadError::Malformed("control character in head"));
    }
    Ok(Some(line))
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// RFC 9110 token (method, header name).
pub fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// Reads a request line and headers and works out the body framing.
pub fn read_head<R: BufRead>(r: &mut R) -> Result<Head, ReadError> {
    let mut budget = MAX_HEAD_BYTES;
    let mut line = None;
    for _ in 0..=MAX_LEADING_EMPTY_LINES {
        match read_line(r, &mut budget)? {
            None => return Err(ReadError::Closed),
            Some(l) if l.is_empty() => continue,
            Some(l) => {
                line = Some(l);
                break;
            }
        }
    }
    let line = line.ok_or(ReadError::Malformed("no request line"))?;
    let line =
        String::from_utf8(line).map_err(|_| ReadError::Malformed("request line is not UTF-8"))?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(ReadError::Malformed("bad request line"));
    };
    if !is_token(method) {
        return Err(ReadError::Malformed("bad method"));
    }
    if target.is_empty() || !(target.starts_with('/') || target.contains("://") || target == "*") {
        return Err(ReadError::Malformed("bad request target"));
    }
    let minor_version = match version {
        "HTTP/1.1" => 1,
        "HTTP/1.0" => 0,
        _ => return Err(ReadError::Malformed("unsupported HTTP version")),
    };

    let mut headers = Vec::new();
    loop {
        let line =
            read_line(r, &mut budget)?.ok_or(ReadError::Malformed("connection closed in head"))?;
        if line.is_empty() {
            break;
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ReadError::HeadTooLarge);
        }
        headers.push(parse_header_line(&line)?);
    }

    let body = body_kind(&headers)?;
    Ok(Head {
        method: method.to_string(),
        target: target.to_string(),
        minor_version,
        headers,
        body,
    })
}

fn parse_header_line(line: &[u8]) -> Result<(String, String), ReadError> {
    if line.first().is_some_and(|&b| b == b' ' || b == b'\t') {
        return Err(ReadError::Malformed("obsolete header line folding"));
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or(ReadError::Malformed("header without colon"))?;
    let (name, value) = line.split_at(colon);
    let name = std::str::from_utf8(name).map_err(|_| ReadError::Malformed("bad header name"))?;
    // "Name : v" is rejected too: whitespace before the colon is a smuggling vector.
    if !is_token(name) {
        return Err(ReadError::Malformed("bad header name"));
    }
    let value = String::from_utf8_lossy(value.get(1..).unwrap_or_default());
    Ok((
        name.to_ascii_lowercase(),
        value.trim_matches([' ', '\t']).to_string(),
    ))
}

/// Framing per RFC 9112 §6.3; ambiguous framing is rejected rather than
/// guessed, since a proxy in front might have guessed differently.
fn body_kind(headers: &[(String, String)]) -> Result<BodyKind, ReadError> {
    let codings: Vec<String> = headers
        .iter()
        .filter(|(n, _)| n == "transfer-encoding")
        .flat_map(|(_, v)| v.split(','))
        .map(|c| c.trim().to_ascii_lowercase())
        .filter(|c| !c.is_empty())
        .collect();
    let lengths: Vec<&str> = headers
        .iter()
        .filter(|(n, _)| n == "content-length")
        .flat_map(|(_, v)| v.split(','))
        .map(str::trim)
        .collect();
    let has_te = headers.iter().any(|(n, _)| n == "transfer-encoding");
    if has_te {
        if !lengths.is_empty() {
            return Err(ReadError::Malformed(
                "both transfer-encoding and content-length",
            ));
        }
        return match codings.as_slice() {
            [only] if only == "chunked" => Ok(BodyKind::Chunked),
            [.., last] if last == "chunked" => Err(ReadError::Unsupported("transfer coding")),
            _ => Err(ReadError::Malformed(
                "transfer-encoding must end with chunked",
            )),
        };
    }
    let Some(first) = lengths.first() else {
        return Ok(BodyKind::None);
    };
    if lengths.iter().any(|l| l != first) {
        return Err(ReadError::Malformed("conflicting content-length"));
    }
    if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ReadError::Malformed("bad content-length"));
    }
    // Too many digits for usize is simply "too large".
    first
        .parse::<usize>()
        .map(BodyKind::Length)
        .map_err(|_| ReadError::BodyTooLarge)
}

/// Reads the body announced by the head, up to `limit` bytes.
pub fn read_body<R: BufRead>(
    r: &mut R,
    kind: BodyKind,
    limit: usize,
) -> Result<Vec<u8>, ReadError> {
    match kind {
        BodyKind::None => Ok(Vec::new()),
        BodyKind::Length(n) => {
            if n > limit {
                return Err(ReadError::BodyTooLarge);
            }
            read_exact_vec(r, n)
        }
        BodyKind::Chunked => read_chunked(r, limit),
    }
}

/// Reads exactly `n` bytes without trusting `n` for the allocation size.
fn read_exact_vec<R: BufRead>(r: &mut R, n: usize) -> Result<Vec<u8>, ReadError> {
    let mut buf = Vec::with_capacity(n.min(1 << 20));
    let got = r
        .by_ref()
        .take(u64::try_from(n).unwrap_or(u64::MAX))
        .read_to_end(&mut buf)
        .map_err(ReadError::Io)?;
    if got != n {
        return Err(ReadError::Malformed("connection closed mid-body"));
    }
    Ok(buf)
}

fn read_chunked<R: BufRead>(r: &mut R, limit: usize) -> Result<Vec<u8>, ReadError> {
    let mut body = Vec::new();
    loop {
        let mut budget = MAX_CHUNK_LINE;
        let line = read_line(r, &mut budget)
            .map_err(|e| match e {
                ReadError::HeadTooLarge => ReadError::Malformed("chunk-size line too long"),
                other => other,
            })?
            .ok_or(ReadError::Malformed("connection closed mid-body"))?;
        let size_part = line.split(|&b| b == b';').next().unwrap_or_default();
        let size_str = std::str::from_utf8(size_part)
            .map_err(|_| ReadError::Malformed("bad chunk size"))?
            .trim_matches([' ', '\t']);
        if size_str.is_empty()
            || size_str.len() > 16
            || !size_str.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err(ReadError::Malformed("bad chunk size"));
        }
        let size = u64::from_str_radix(size_str, 16)
            .map_err(|_| ReadError::Malformed("bad chunk size"))?;
        if size == 0 {
            // Trailer section: read and ignore fields until the empty line.
            let mut budget = MAX_HEAD_BYTES;
            loop {
                let trailer = read_line(r, &mut budget)?
                    .ok_or(ReadError::Malformed("connection closed in trailers"))?;
                if trailer.is_empty() {
                    return Ok(body);
                }
            }
        }
        let size = usize::try_from(size).map_err(|_| ReadError::BodyTooLarge)?;
        if body.len().saturating_add(size) > limit {
            return Err(ReadError::BodyTooLarge);
        }
        let chunk = read_exact_vec(r, size)?;
        body.extend_from_slice(&chunk);
        let mut budget = 2;
        match read_line(r, &mut budget) {
            Ok(Some(l)) if l.is_empty() => {}
            Err(ReadError::Io(e)) => return Err(ReadError::Io(e)),
            _ => return Err(ReadError::Malformed("chunk not followed by CRLF")),
        }
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// How the response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Length(usize),
    Chunked,
    /// For HTTP/1.0 clients, which cannot read chunked: body ends at close.
    UntilClose,
}

/// Serializes a response head. `headers` must not contain framing or
/// connection headers; those are derived from `framing` and `keep_alive`.
pub fn head_bytes(
    status: u16,
    headers: &[(String, String)],
    framing: Framing,
    keep_alive: bool,
) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        out.push_str(name);
        out.push_str(": ");
        out.push_str(value);
        out.push_str("\r\n");
    }
    match framing {
        Framing::Length(n) => out.push_str(&format!("content-length: {n}\r\n")),
        Framing::Chunked => out.push_str("transfer-encoding: chunked\r\n"),
        Framing::UntilClose => {}
    }
    let keep_alive = keep_alive && framing != Framing::UntilClose;
    out.push_str(if keep_alive {
        "connection: keep-alive\r\n\r\n"
    } else {
        "connection: close\r\n\r\n"
    });
    out.into_bytes()
}

/// Writes a complete fixed-length response in one write.
pub fn write_response<W: Write>(
    w: &mut W,
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let mut out = head_bytes(status, headers, Framing::Length(body.len()), keep_alive);
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// Writes one chunk (empty data writes nothing: an empty chunk would end the body).
pub fn write_chunk<W: Write>(w: &mut W, data: &[u8]) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    w.write_all(&out)?;
    w.flush()
}

pub fn write_last_chunk<W: Write>(w: &mut W) -> io::Result<()> {
    w.write_all(b"0\r\n\r\n")?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn parse(raw: &[u8]) -> Result<(Head, Vec<u8>), ReadError> {
        let mut r = Cursor::new(raw.to_vec());
        let head = read_head(&mut r)?;
        let body = read_body(&mut r, head.body, MAX_BODY_BYTES)?;
        Ok((head, body))
    }

    fn status_of(raw: &[u8]) -> Option<u16> {
        parse(raw).err().and_then(|e| e.status())
    }

    #[test]
    fn content_length_body() {
        let (h, b) = parse(b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nX-Id:  7 \r\n\r\nhello").unwrap();
        assert_eq!(
            (h.method.as_str(), h.path(), h.minor_version),
            ("POST", "/v1/completions", 1)
        );
        assert_eq!(h.header("x-id"), Some("7"));
        assert_eq!(h.header("HOST"), Some("a"));
        assert_eq!(b, b"hello");
        assert!(h.keep_alive());
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let raw = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n";
        let (h, b) = parse(raw).unwrap();
        assert_eq!(h.body, BodyKind::Chunked);
        assert_eq!(b, b"hello world");
    }

    #[test]
    fn chunked_body_errors() {
        assert_eq!(
            status_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            Some(400)
        );
        assert_eq!(
            status_of(
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcd\r\n0\r\n\r\n"
            ),
            Some(400)
        );
        assert_eq!(
            status_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"),
            Some(400)
        );
        assert_eq!(
            status_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"),
            Some(501)
        );
        assert_eq!(
            status_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
            Some(400)
        );
        assert_eq!(
            status_of(
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
            ),
            Some(400)
        );
        let mut r = Cursor::new(b"ffffffff\r\n".to_vec());
        assert!(matches!(
            read_chunked(&mut r, 1024),
            Err(ReadError::BodyTooLarge)
        ));
    }

    #[test]
    fn keep_alive_two_requests_on_one_stream() {
        let raw = b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhiGET /b HTTP/1.1\r\nConnection: close\r\n\r\n";
        let mut r = Cursor::new(raw.to_vec());
        let h1 = read_head(&mut r).unwrap();
        assert_eq!(read_body(&mut r, h1.body, 100).unwrap(), b"hi");
        assert!(h1.keep_alive());
        let h2 = read_head(&mut r).unwrap();
        assert_eq!((h2.method.as_str(), h2.path()), ("GET", "/b"));
        assert!(!h2.keep_alive());
        assert!(matches!(read_head(&mut r), Err(ReadError::Closed)));
    }

    #[test]
    fn http10_defaults_to_close() {
        let (h, _) = parse(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        assert!(!h.keep_alive());
        let (h, _) = parse(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").unwrap();
        assert!(h.keep_alive());
    }

    #[test]
    fn malformed_heads() {
        for raw in [
            &b"GARBAGE\r\n\r\n"[..],
            b"GET /\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1 x\r\n\r\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"G(T / HTTP/1.1\r\n\r\n",
            b"GET nopath HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET / HTTP/1.1\r\nName : v\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\r\n folded\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\rc\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n",
            b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
            b"GET / HTTP/1.1\r\nHost: a\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort",
            b"\xff\xfe / HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(
                status_of(raw),
                Some(400),
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn limits() {
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES));
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(status_of(&big), Some(431));
        let raw = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        let mut r = Cursor::new(raw.into_bytes());
        let h = read_head(&mut r).unwrap();
        assert!(matches!(
            read_body(&mut r, h.body, MAX_BODY_BYTES),
            Err(ReadError::BodyTooLarge)
        ));
        assert_eq!(
            status_of(b"GET / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"),
            Some(413)
        );
    }

    #[test]
    fn empty_input_is_clean_close_and_leading_crlf_ok() {
        assert!(matches!(parse(b""), Err(ReadError::Closed)));
        assert!(parse(b"\r\nGET / HTTP/1.1\r\n\r\n").is_ok());
        assert!(parse(b"GET / HTTP/1.1\n\n").is_ok());
    }

    #[test]
    fn expect_continue_and_absolute_form() {
        let (h, _) = parse(b"POST http://x:1/v1/models?a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert!(h.expects_continue());
        assert_eq!(h.path(), "/v1/models");
    }

    #[test]
    fn writes_responses_and_chunks() {
        let mut out = Vec::new();
        write_response(&mut out, 200, &[("x-a".into(), "1".into())], b"ok", true).unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok"
        );
        let mut out = head_bytes(200, &[], Framing::Chunked, false);
        write_chunk(&mut out, b"hello world!!!!!").unwrap();
        write_chunk(&mut out, b"").unwrap();
        write_last_chunk(&mut out).unwrap();
        assert!(out.ends_with(b"connection: close\r\n\r\n10\r\nhello world!!!!!\r\n0\r\n\r\n"));
        assert!(
            String::from_utf8(head_bytes(200, &[], Framing::UntilClose, true))
                .unwrap()
                .contains("connection: close")
        );
    }
}
