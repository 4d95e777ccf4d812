//! Finding a top-level member's value in a JSON body without parsing it
//! again: the byte range the guard rewrites (e.g. `max_tokens`).

/// Byte range of the value of top-level member `key` in a JSON object that
/// has already been validated by [`parse`](super::openai::parse). Keys are
/// compared after decoding escapes, so `"max\u005ftokens"` cannot hide from
/// the guard.
pub fn top_level_value_span(body: &[u8], key: &str) -> Option<std::ops::Range<usize>> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    s.eat(b'{')?;
    loop {
        s.ws();
        if s.peek()? == b'}' {
            return None;
        }
        let (ks, ke, escaped) = s.string()?;
        let k = body.get(ks..ke)?;
        let matches = if escaped {
            serde_json::from_slice::<String>(body.get(ks - 1..ke + 1)?)
                .map(|d| d == key)
                .unwrap_or(false)
        } else {
            k == key.as_bytes()
        };
        s.ws();
        s.eat(b':')?;
        s.ws();
        let vs = s.i;
        s.value()?;
        if matches {
            return Some(vs..s.i);
        }
        s.ws();
        match s.peek()? {
            b',' => s.i += 1,
            _ => return None,
        }
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }
    /// A string starting at `"`; returns the content range and whether it
    /// holds escapes.
    fn string(&mut self) -> Option<(usize, usize, bool)> {
        self.eat(b'"')?;
        let start = self.i;
        let mut escaped = false;
        loop {
            match self.peek()? {
                b'"' => {
                    let end = self.i;
                    self.i += 1;
                    return Some((start, end, escaped));
                }
                b'\\' => {
                    escaped = true;
                    self.i += 2;
                }
                _ => self.i += 1,
            }
        }
    }
    fn value(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            self.ws();
            match self.peek()? {
                b'"' => {
                    self.string()?;
                }
                b'{' | b'[' => {
                    depth += 1;
                    self.i += 1;
                    continue;
                }
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    self.i += 1;
                }
                b',' | b':' if depth > 0 => {
                    self.i += 1;
                    continue;
                }
                _ => {
                    while !matches!(
                        self.peek()?,
                        b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'
                    ) {
                        self.i += 1;
                    }
                }
            }
            if depth == 0 {
                return Some(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_spans() {
        let b = br#" { "a" : {"x":[1,"}"]}, "max\u005ftokens": 123 , "b":"q"}"#;
        let span = top_level_value_span(b, "max_tokens").unwrap();
        assert_eq!(&b[span], b"123");
        let span = top_level_value_span(b, "a").unwrap();
        assert_eq!(&b[span], br#"{"x":[1,"}"]}"#);
        let span = top_level_value_span(b, "b").unwrap();
        assert_eq!(&b[span], br#""q""#);
        assert_eq!(top_level_value_span(b, "zz"), None);
        assert_eq!(top_level_value_span(b"{}", "a"), None);
        let b = br#"{"m":null,"max_tokens":null}"#;
        assert_eq!(&b[top_level_value_span(b, "max_tokens").unwrap()], b"null");
    }
}
