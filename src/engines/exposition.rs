//! The Prometheus text exposition format (0.0.4) as the engines print it:
//! a payload's numbered lines, one sample line read as name, labels, value
//! and timestamp, and the label-value escapes. It knows no metric names.

use std::borrow::Cow;

/// One physical line of a payload, without its `\n` or `\r\n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line<'a> {
    /// 1-based, as an editor or `sed -n` counts.
    pub number: usize,
    pub bytes: &'a [u8],
}

/// Iterator over the lines of a payload; borrows, never allocates.
#[derive(Debug, Clone)]
pub struct Lines<'a> {
    rest: Option<&'a [u8]>,
    number: usize,
}

/// Splits a payload into numbered lines, accepting `\n` and `\r\n` endings.
pub fn lines(text: &[u8]) -> Lines<'_> {
    Lines {
        rest: (!text.is_empty()).then_some(text),
        number: 0,
    }
}

impl<'a> Iterator for Lines<'a> {
    type Item = Line<'a>;

    fn next(&mut self) -> Option<Line<'a>> {
        let rest = self.rest?;
        let (line, tail) = match rest.iter().position(|&b| b == b'\n') {
            Some(end) => (rest.get(..end).unwrap_or_default(), rest.get(end + 1..)),
            None => (rest, None),
        };
        // A final newline ends the last line; it does not start an empty one.
        self.rest = tail.filter(|tail| !tail.is_empty());
        self.number += 1;
        Some(Line {
            number: self.number,
            bytes: line.strip_suffix(b"\r").unwrap_or(line),
        })
    }
}

/// One sample line, parsed: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub value: f64,
    /// Milliseconds since the epoch, when the exporter printed one.
    pub timestamp_ms: Option<i64>,
    /// The text between the braces, already checked; label values stay
    /// escaped until [`Sample::label`] asks for one.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// Parses one line of the text format; `None` for comments, blank lines
    /// and anything malformed. Blanks may surround every token.
    pub fn parse(line: &'a str) -> Option<Self> {
        let mut cursor = Cursor { rest: line };
        cursor.skip_blanks();
        let name = cursor.take_while(is_metric_name_byte);
        if !is_metric_name(name) {
            return None;
        }
        // The name must be followed by labels or a separator, not glued to
        // another token.
        if !matches!(cursor.peek(), Some(b'{' | b' ' | b'\t')) {
            return None;
        }
        cursor.skip_blanks();

        let mut labels = "";
        if cursor.eat(b'{') {
            let inside = cursor.rest;
            loop {
                cursor.skip_blanks();
                if cursor.peek() == Some(b'}') {
                    break;
                }
                cursor.label_pair()?;
                // A trailing comma before `}` is allowed by the format.
                if !cursor.eat(b',') && cursor.peek() != Some(b'}') {
                    return None;
                }
            }
            let inside_len = inside.len().checked_sub(cursor.rest.len())?;
            labels = inside.get(..inside_len)?;
            cursor.eat(b'}');
            cursor.skip_blanks();
        }

        let value = parse_value(cursor.take_token())?;
        cursor.skip_blanks();
        let timestamp_ms = match cursor.take_token() {
            "" => None,
            token => Some(token.parse::<i64>().ok()?),
        };
        cursor.skip_blanks();
        if !cursor.rest.is_empty() {
            return None;
        }
        Some(Sample {
            name,
            value,
            timestamp_ms,
            labels,
        })
    }

    /// The unescaped value of label `name`, if the series carries it.
    /// Borrows unless the value holds an escape sequence.
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        let mut cursor = Cursor { rest: self.labels };
        loop {
            let (label, raw_value) = cursor.label_pair()?;
            if label == name {
                return Some(unescape_label_value(raw_value));
            }
            cursor.eat(b',');
        }
    }
}

pub(crate) enum LineClass {
    Comment,
    Sample,
    Malformed,
}

pub(crate) fn classify(line: &[u8]) -> LineClass {
    match line.iter().find(|&&b| !is_blank(b)) {
        None | Some(b'#') => LineClass::Comment,
        Some(_) => match std::str::from_utf8(line).ok().and_then(Sample::parse) {
            Some(_) => LineClass::Sample,
            None => LineClass::Malformed,
        },
    }
}

/// The metric name a line starts with, or empty for comments, blank lines
/// and lines that start with anything else. Names are ASCII, so this works
/// on bytes before the line is known to be UTF-8.
pub(crate) fn leading_metric_name(line: &[u8]) -> &[u8] {
    let start = line
        .iter()
        .position(|&b| !is_blank(b))
        .unwrap_or(line.len());
    let rest = line.get(start..).unwrap_or_default();
    let end = rest
        .iter()
        .position(|&b| !is_metric_name_byte(b))
        .unwrap_or(rest.len());
    rest.get(..end).unwrap_or_default()
}

/// A value as Go's ParseFloat reads it, which is what the format specifies.
fn parse_value(token: &str) -> Option<f64> {
    match token {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => token.parse::<f64>().ok(),
    }
}

/// Undoes the three escapes the format defines (`\\`, `\"`, `\n`); any
/// other backslash is kept as written, as Prometheus itself does.
fn unescape_label_value(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut value = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            value.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => value.push('\n'),
            Some('\\') => value.push('\\'),
            Some('"') => value.push('"'),
            Some(other) => {
                value.push('\\');
                value.push(other);
            }
            None => value.push('\\'),
        }
    }
    Cow::Owned(value)
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn is_metric_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

pub(crate) fn is_metric_name(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && name.bytes().all(is_metric_name_byte)
}

pub(crate) fn is_label_name(name: &str) -> bool {
    name.bytes().next().is_some_and(|b| !b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A read position in one line. Every split is at an ASCII delimiter, so it
/// is a char boundary; `get` still guards it rather than trusting that.
#[derive(Debug)]
struct Cursor<'a> {
    rest: &'a str,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.rest.as_bytes().first().copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() != Some(byte) {
            return false;
        }
        self.rest = self.rest.get(1..).unwrap_or_default();
        true
    }

    fn skip_blanks(&mut self) {
        self.rest = self.rest.trim_start_matches([' ', '\t']);
    }

    fn take_while(&mut self, keep: impl Fn(u8) -> bool) -> &'a str {
        let end = self
            .rest
            .bytes()
            .position(|b| !keep(b))
            .unwrap_or(self.rest.len());
        self.split_at(end)
    }

    fn take_token(&mut self) -> &'a str {
        self.take_while(|b| !is_blank(b))
    }

    fn split_at(&mut self, at: usize) -> &'a str {
        match (self.rest.get(..at), self.rest.get(at..)) {
            (Some(head), Some(tail)) => {
                self.rest = tail;
                head
            }
            _ => "",
        }
    }

    /// `name = "value"` with optional blanks around each token; returns the
    /// name and the still-escaped value, and leaves the cursor after any
    /// blanks that follow the closing quote.
    fn label_pair(&mut self) -> Option<(&'a str, &'a str)> {
        self.skip_blanks();
        let name = self.take_while(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !is_label_name(name) {
            return None;
        }
        self.skip_blanks();
        if !self.eat(b'=') {
            return None;
        }
        self.skip_blanks();
        if !self.eat(b'"') {
            return None;
        }
        let value = self.quoted_rest()?;
        self.skip_blanks();
        Some((name, value))
    }

    /// The text up to the next unescaped `"`, which is consumed.
    fn quoted_rest(&mut self) -> Option<&'a str> {
        let bytes = self.rest.as_bytes();
        let mut end = 0;
        loop {
            match bytes.get(end)? {
                b'\\' => end += 2,
                b'"' => break,
                _ => end += 1,
            }
        }
        let value = self.rest.get(..end)?;
        self.rest = self.rest.get(end + 1..)?;
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_parse_reads_values_and_timestamps() {
        let cases: [(&str, f64, Option<i64>); 7] = [
            ("a 1", 1.0, None),
            ("a 1.5e-3 -12", 0.0015, Some(-12)),
            ("a{b=\"c\"} +Inf", f64::INFINITY, None),
            ("a -Inf", f64::NEG_INFINITY, None),
            ("a{} -0.5", -0.5, None),
            ("a\t7\t8", 7.0, Some(8)),
            ("a:b_c 1E3", 1000.0, None),
        ];
        for (line, value, timestamp) in cases {
            let sample = Sample::parse(line).unwrap();
            assert_eq!(sample.value, value, "{line}");
            assert_eq!(sample.timestamp_ms, timestamp, "{line}");
        }
        assert!(Sample::parse("a NaN").unwrap().value.is_nan());
        for bad in [
            "",
            "# HELP a b",
            "a",
            "a{",
            "a{b=\"c\"",
            "1a 1",
            "a=1",
            "a 1 2 3",
        ] {
            assert_eq!(Sample::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn sample_label_lookup_borrows_unless_escaped() {
        let sample = Sample::parse("m{a=\"plain\",b=\"q\\\"uote\"} 1").unwrap();
        assert!(matches!(sample.label("a"), Some(Cow::Borrowed("plain"))));
        assert_eq!(sample.label("b").as_deref(), Some("q\"uote"));
        assert_eq!(sample.label("c"), None);
        assert_eq!(unescape_label_value("x\\ty\\"), "x\\ty\\");
    }

    #[test]
    fn lines_are_numbered_and_stripped_of_line_ends() {
        let got: Vec<(usize, &[u8])> = lines(b"a\r\n\nb\rc\nd")
            .map(|line| (line.number, line.bytes))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, &b"a"[..]),
                (2, &b""[..]),
                (3, &b"b\rc"[..]),
                (4, &b"d"[..])
            ]
        );
        assert_eq!(lines(b"x\n").count(), 1);
        assert_eq!(lines(b"").count(), 0);
        assert_eq!(lines(b"\n").count(), 1);
    }
}
