//! JSON text read in place, and Python's float `repr`: the one JSON reader of the core.
//!
//! [`Reader`] checks one JSON text (RFC 8259, the grammar Python's strict decoder takes) and
//! answers *spans*: a value's [`Kind`] and where its text lies. Callers walk objects and arrays
//! by span ([`Reader::members`], [`Reader::elements`]) and decode only the strings and numbers
//! they need, so a frame whose payload is copied verbatim is never turned into a tree.
//!
//! Why spans: the dialects forward most of what they read. The 신경 gateway copies a SEND's
//! payload into its receivers' frames as it arrived; it may do that only when the text is what
//! Python's encoder (`ensure_ascii=False`, compact separators) would write for the decoded
//! value, so that a frame is the same bytes whichever layer writes it. [`canonical`] answers
//! that for a span: no whitespace, escapes only where the encoder writes them, floats as
//! Python's `repr` ([`float_repr`]), no `-0`, no duplicate keys.
//!
//! Strings decode to WTF-8 ([`decode_string`]): a lone surrogate escape (`"\ud800"`, which
//! Python's decoder accepts) becomes the three bytes Python's `surrogatepass` codec gives, so
//! such text compares, sorts and round-trips as Python's `str` does. [`decode_str`] is the
//! UTF-8-only view.

use std::borrow::Cow;

/// Nesting deeper than this is refused unless the reader is told otherwise.
pub const MAX_DEPTH: usize = 64;
/// Integers of more digits are refused: Python's decoder refuses them too
/// (`sys.get_int_max_str_digits()`, 4300 by default).
pub const MAX_INT_DIGITS: usize = 4300;
/// Objects with more members than this are never [`canonical`]: the duplicate-key check is
/// quadratic, and real frames stay far below it.
const MAX_CHECKED_KEYS: usize = 64;

/// What JSON value a span holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Null,
    True,
    False,
    Int,
    Float,
    Str,
    Arr,
    Obj,
}

/// A value's kind and its text `text[start..end]` (a string's span includes its quotes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub kind: Kind,
    pub start: usize,
    pub end: usize,
}

/// Why a text is not JSON (or not JSON this reader takes), and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub at: usize,
    pub what: &'static str,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JSON: {} at byte {}", self.what, self.at)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// A reader over one JSON text. `canonical` turns false as soon as it reads something
/// Python's encoder would write differently (see the module docs).
pub struct Reader<'a> {
    pub text: &'a [u8],
    pub at: usize,
    pub canonical: bool,
    pub max_depth: usize,
}

impl<'a> Reader<'a> {
    pub fn new(text: &'a [u8]) -> Self {
        Reader {
            text,
            at: 0,
            canonical: true,
            max_depth: MAX_DEPTH,
        }
    }

    fn fail<T>(&self, what: &'static str) -> Result<T> {
        Err(Error { at: self.at, what })
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    /// Whitespace (never canonical inside a value).
    pub fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.canonical = false;
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.at += usize::from(hit);
        hit
    }

    fn word(&mut self, w: &[u8], kind: Kind) -> Result<Kind> {
        if self.text[self.at..].starts_with(w) {
            self.at += w.len();
            Ok(kind)
        } else {
            self.fail("unexpected input")
        }
    }

    /// The value at the reader's position (no whitespace before it).
    pub fn value(&mut self, depth: usize) -> Result<Span> {
        if depth > self.max_depth {
            return self.fail("nested too deeply");
        }
        let start = self.at;
        let kind = match self.peek() {
            Some(b'{') => {
                let mut keys: Vec<&[u8]> = Vec::new();
                let text = self.text;
                self.read_members(depth, |key, _| {
                    keys.push(&text[key.start..key.end]);
                    Ok(())
                })?;
                if !distinct(&keys) {
                    self.canonical = false;
                }
                Kind::Obj
            }
            Some(b'[') => {
                self.read_elements(depth, |_| Ok(()))?;
                Kind::Arr
            }
            Some(b'"') => {
                self.string()?;
                Kind::Str
            }
            Some(b't') => self.word(b"true", Kind::True)?,
            Some(b'f') => self.word(b"false", Kind::False)?,
            Some(b'n') => self.word(b"null", Kind::Null)?,
            Some(b'-' | b'0'..=b'9') => self.number()?,
            _ => return self.fail("unexpected input"),
        };
        Ok(Span {
            kind,
            start,
            end: self.at,
        })
    }

    /// An object at the reader's position; `each` gets every member's key and value spans,
    /// in order.
    fn read_members(
        &mut self,
        depth: usize,
        mut each: impl FnMut(Span, Span) -> Result<()>,
    ) -> Result<()> {
        self.at += 1; // '{'
        self.ws();
        if self.eat(b'}') {
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return self.fail("expected a key");
            }
            let key_at = self.at;
            self.string()?;
            let key = Span {
                kind: Kind::Str,
                start: key_at,
                end: self.at,
            };
            self.ws();
            if !self.eat(b':') {
                return self.fail("expected ':'");
            }
            self.ws();
            let value = self.value(depth + 1)?;
            each(key, value)?;
            self.ws();
            if self.eat(b',') {
                self.ws();
                continue;
            }
            if self.eat(b'}') {
                return Ok(());
            }
            return self.fail("expected ',' or '}'");
        }
    }

    fn read_elements(
        &mut self,
        depth: usize,
        mut each: impl FnMut(Span) -> Result<()>,
    ) -> Result<()> {
        self.at += 1; // '['
        self.ws();
        if self.eat(b']') {
            return Ok(());
        }
        loop {
            let value = self.value(depth + 1)?;
            each(value)?;
            self.ws();
            if self.eat(b',') {
                self.ws();
                continue;
            }
            if self.eat(b']') {
                return Ok(());
            }
            return self.fail("expected ',' or ']'");
        }
    }

    /// A string at the reader's position: the range between its quotes. Raw control
    /// characters and bad escapes are errors; escapes the encoder would not write are not
    /// canonical.
    pub fn string(&mut self) -> Result<(usize, usize)> {
        self.at += 1; // '"'
        let start = self.at;
        loop {
            match self.peek() {
                None => return self.fail("unterminated string"),
                Some(b'"') => {
                    self.at += 1;
                    return Ok((start, self.at - 1));
                }
                Some(0..=0x1f) => return self.fail("control character in a string"),
                Some(b'\\') => {
                    let escape = self.text.get(self.at + 1).copied();
                    self.at += 2;
                    match escape {
                        Some(b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f') => {}
                        Some(b'/') => self.canonical = false,
                        Some(b'u') => {
                            let code = self.hex4()?;
                            // the encoder writes \u00XX (lower-case hex) for control
                            // characters without a short escape, and nothing else
                            let raw = &self.text[self.at - 4..self.at];
                            let short = matches!(code, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d);
                            if code >= 0x20 || short || raw.iter().any(u8::is_ascii_uppercase) {
                                self.canonical = false;
                            }
                        }
                        _ => {
                            self.at -= 2;
                            return self.fail("bad escape");
                        }
                    }
                }
                Some(_) => self.at += 1,
            }
        }
    }

    fn hex4(&mut self) -> Result<u16> {
        let digits = self.text.get(self.at..self.at + 4);
        let code = digits
            .filter(|d| d.iter().all(u8::is_ascii_hexdigit))
            .and_then(|d| u16::from_str_radix(std::str::from_utf8(d).ok()?, 16).ok());
        match code {
            Some(code) => {
                self.at += 4;
                Ok(code)
            }
            None => self.fail("bad \\u escape"),
        }
    }

    /// A number: the grammar Python's scanner takes, `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`.
    pub fn number(&mut self) -> Result<Kind> {
        let start = self.at;
        self.eat(b'-');
        let int_at = self.at;
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return self.fail("bad number"),
        }
        if self.at - int_at > MAX_INT_DIGITS {
            return self.fail("integer longer than Python's digit limit");
        }
        let mut kind = Kind::Int;
        if self.peek() == Some(b'.') {
            self.at += 1;
            let at = self.at;
            self.digits();
            if self.at == at {
                return self.fail("bad number");
            }
            kind = Kind::Float;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            let at = self.at;
            self.digits();
            if self.at == at {
                return self.fail("bad number");
            }
            kind = Kind::Float;
        }
        let text = &self.text[start..self.at];
        let canonical = match kind {
            Kind::Int => text != b"-0",
            _ => float_repr(parse_f64(text)).as_bytes() == text,
        };
        self.canonical &= canonical;
        Ok(kind)
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.at += 1;
        }
    }

    /// The members of the object `span` (key, value), read again from its start.
    pub fn members(&self, span: Span) -> Vec<(Span, Span)> {
        let mut out = Vec::new();
        if span.kind == Kind::Obj {
            let mut r = self.at_span(span);
            // the text was read once already: it cannot fail now
            let _ = r.read_members(0, |key, value| {
                out.push((key, value));
                Ok(())
            });
        }
        out
    }

    /// The elements of the array `span`, read again from its start.
    pub fn elements(&self, span: Span) -> Vec<Span> {
        let mut out = Vec::new();
        if span.kind == Kind::Arr {
            let mut r = self.at_span(span);
            let _ = r.read_elements(0, |value| {
                out.push(value);
                Ok(())
            });
        }
        out
    }

    fn at_span(&self, span: Span) -> Reader<'a> {
        Reader {
            text: &self.text[..span.end],
            at: span.start,
            canonical: true,
            max_depth: usize::MAX,
        }
    }

    /// The text of `span`.
    pub fn slice(&self, span: Span) -> &'a [u8] {
        &self.text[span.start..span.end]
    }

    /// A string span's raw text between its quotes (escapes not undone): equal raw texts are
    /// equal strings when both are [`canonical`].
    pub fn raw(&self, span: Span) -> &'a [u8] {
        &self.text[span.start + 1..span.end - 1]
    }
}

/// Reading a container one item at a time, for a caller that keeps its own view of a document
/// (an index of every container's items, made in one pass): after [`Reader::enter`] at an
/// object or array, [`Reader::next_member`] or [`Reader::next_element`] until it says the
/// container ended, reading each item's value in between (with [`Reader::value`], or by
/// entering it). The checks are those of [`Reader::value`].
impl Reader<'_> {
    /// Step into the object or array at the reader's position (nested at `depth`).
    pub fn enter(&mut self, depth: usize) -> Result<()> {
        if depth > self.max_depth {
            return self.fail("nested too deeply");
        }
        self.at += 1; // '{' or '['
        self.ws();
        Ok(())
    }

    /// The next member's key, the reader left at its value; None past the object's end.
    /// `first`: no member was read yet.
    pub fn next_member(&mut self, first: bool) -> Result<Option<Span>> {
        if !first {
            self.ws();
            if self.eat(b'}') {
                return Ok(None);
            }
            if !self.eat(b',') {
                return self.fail("expected ',' or '}'");
            }
            self.ws();
        } else if self.eat(b'}') {
            return Ok(None);
        }
        if self.peek() != Some(b'"') {
            return self.fail("expected a key");
        }
        let start = self.at;
        self.string()?;
        let key = Span {
            kind: Kind::Str,
            start,
            end: self.at,
        };
        self.ws();
        if !self.eat(b':') {
            return self.fail("expected ':'");
        }
        self.ws();
        Ok(Some(key))
    }

    /// Whether another element follows (the reader then at it); false past the array's end.
    /// `first`: no element was read yet.
    pub fn next_element(&mut self, first: bool) -> Result<bool> {
        if !first {
            self.ws();
            if self.eat(b']') {
                return Ok(false);
            }
            if !self.eat(b',') {
                return self.fail("expected ',' or ']'");
            }
            self.ws();
            return Ok(true);
        }
        Ok(!self.eat(b']'))
    }
}

fn distinct(keys: &[&[u8]]) -> bool {
    keys.len() <= MAX_CHECKED_KEYS && keys.iter().enumerate().all(|(i, k)| !keys[..i].contains(k))
}

/// A whole JSON text (UTF-8, whitespace around the value only): its reader and the value's
/// span. The reader's `canonical` says whether the *value* reads as the encoder writes it.
pub fn document(text: &[u8]) -> Result<(Reader<'_>, Span)> {
    document_within(text, MAX_DEPTH)
}

/// [`document`] with a nesting limit of the caller's.
pub fn document_within(text: &[u8], max_depth: usize) -> Result<(Reader<'_>, Span)> {
    document_read(text, max_depth, |r| r.value(0))
}

/// A whole JSON text whose one value `read` reads (from its first byte: with
/// [`Reader::value`], or item by item), with [`document_within`]'s checks around it.
pub fn document_read<'a, T>(
    text: &'a [u8],
    max_depth: usize,
    read: impl FnOnce(&mut Reader<'a>) -> Result<T>,
) -> Result<(Reader<'a>, T)> {
    if let Err(err) = std::str::from_utf8(text) {
        return Err(Error {
            at: err.valid_up_to(),
            what: "not UTF-8",
        });
    }
    let mut r = Reader::new(text);
    r.max_depth = max_depth;
    r.ws();
    r.canonical = true;
    let value = read(&mut r)?;
    let canonical = r.canonical;
    r.ws();
    if r.at != text.len() {
        return r.fail("extra data after the value");
    }
    r.canonical = canonical;
    Ok((r, value))
}

/// Whether the text of `span` is exactly what Python's encoder writes for its value.
pub fn canonical(r: &Reader<'_>, span: Span) -> bool {
    let mut again = r.at_span(span);
    again.value(0).is_ok() && again.canonical
}

/// The decoded bytes of a string span (WTF-8: see the module docs).
pub fn decode_string<'a>(r: &Reader<'a>, span: Span) -> Cow<'a, [u8]> {
    unescape(r.raw(span))
}

/// The decoded text of a string span, when it is valid Unicode (no lone surrogate).
pub fn decode_str<'a>(r: &Reader<'a>, span: Span) -> Option<Cow<'a, str>> {
    match decode_string(r, span) {
        Cow::Borrowed(b) => std::str::from_utf8(b).ok().map(Cow::Borrowed),
        Cow::Owned(v) => String::from_utf8(v).ok().map(Cow::Owned),
    }
}

/// A string's raw text between its quotes (already checked by [`Reader::string`]) with its
/// escapes undone; surrogate pairs join, lone surrogates become WTF-8.
pub fn unescape(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.contains(&b'\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    let hex = |at: usize| -> u32 {
        raw.get(at..at + 4)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .unwrap_or(0xfffd)
    };
    while i < raw.len() {
        if raw[i] != b'\\' {
            out.push(raw[i]);
            i += 1;
            continue;
        }
        let escape = raw.get(i + 1).copied().unwrap_or(b'\\');
        i += 2;
        let short = match escape {
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'u' => 0,
            other => other,
        };
        if escape != b'u' {
            out.push(short);
            continue;
        }
        let mut code = hex(i);
        i += 4;
        if (0xd800..0xdc00).contains(&code) && raw.get(i..i + 2) == Some(b"\\u") {
            let low = hex(i + 2);
            if (0xdc00..0xe000).contains(&low) {
                code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                i += 6;
            }
        }
        push_wtf8(&mut out, code);
    }
    Cow::Owned(out)
}

/// A code point as UTF-8, surrogates included (as Python's `surrogatepass` writes them).
fn push_wtf8(out: &mut Vec<u8>, code: u32) {
    match code {
        0..=0x7f => out.push(code as u8),
        0x80..=0x7ff => {
            out.extend_from_slice(&[0xc0 | (code >> 6) as u8, 0x80 | (code & 0x3f) as u8])
        }
        0x800..=0xffff => out.extend_from_slice(&[
            0xe0 | (code >> 12) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]),
        _ => out.extend_from_slice(&[
            0xf0 | (code >> 18) as u8,
            0x80 | ((code >> 12) & 0x3f) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]),
    }
}

/// The value of a number span's text as Python's decoder reads a float (an integer's text
/// reads the same; too large is infinite).
pub fn parse_f64(text: &[u8]) -> f64 {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(f64::NAN)
}

/// An integer span as i64, when it fits.
pub fn parse_i64(r: &Reader<'_>, span: Span) -> Option<i64> {
    std::str::from_utf8(r.slice(span)).ok()?.parse().ok()
}

/// Python's `repr` of a float (what its JSON encoder writes; `NaN`, `Infinity`, `-Infinity`
/// as the encoder spells them): the shortest digits that round-trip (Rust's `{:e}` finds the
/// same ones), positional while the decimal point falls within -4 < point <= 16 (with `.0`
/// on an integral value), else `d.ddde±XX` with at least two exponent digits.
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{:e}", value.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let point = exp + 1; // the value is 0.DIGITS x 10^point
    let mut out = String::with_capacity(digits.len() + 8);
    if value.is_sign_negative() {
        out.push('-');
    }
    if -4 < point && point <= 16 {
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&digits);
        } else if (point as usize) < digits.len() {
            let (int, frac) = digits.split_at(point as usize);
            out.push_str(int);
            out.push('.');
            out.push_str(frac);
        } else {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', point as usize - digits.len()));
            out.push_str(".0");
        }
    } else {
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if exp < 0 { '-' } else { '+' };
        out.push_str(&format!("e{sign}{:02}", exp.abs()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical_text(text: &str) -> bool {
        let (r, span) = document(text.as_bytes()).unwrap();
        canonical(&r, span)
    }

    #[test]
    fn float_repr_is_python_s() {
        for (value, repr) in [
            (1.5, "1.5"),
            (100.0, "100.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (0.30000000000000004, "0.30000000000000004"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-2.5e-7, "-2.5e-07"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(float_repr(value), repr, "{value:e}");
        }
    }

    #[test]
    fn spans_walk_objects_and_arrays() {
        let text = br#" {"a": [1, "x\n", {"b": null}], "c": -2.5e3} "#;
        let (r, top) = document(text).unwrap();
        assert_eq!(top.kind, Kind::Obj);
        let members = r.members(top);
        let keys: Vec<&[u8]> = members.iter().map(|m| r.raw(m.0)).collect();
        assert_eq!(keys, [b"a", b"c"]);
        let items = r.elements(members[0].1);
        assert_eq!(
            items.iter().map(|s| s.kind).collect::<Vec<_>>(),
            [Kind::Int, Kind::Str, Kind::Obj]
        );
        assert_eq!(decode_string(&r, items[1]).as_ref(), b"x\n");
        assert_eq!(parse_i64(&r, items[0]), Some(1));
        assert_eq!(members[1].1.kind, Kind::Float);
        assert_eq!(parse_f64(r.slice(members[1].1)), -2500.0);
        assert!(!r.canonical, "whitespace inside the value");
    }

    #[test]
    fn canonical_is_what_python_s_encoder_writes() {
        for text in [
            r#"{"a":[1,"\n",true,null],"b":{"c":1.5}}"#,
            r#""\u0001\"\\""#,
            "\"é✓\u{7f}\"",
            "-12",
            "1e-05",
            "[]",
            "{}",
        ] {
            assert!(canonical_text(text), "{text}");
        }
        for text in [
            "[1, 2]",
            r#""\u0041""#,
            r#""a\/b""#,
            r#""\u001F""#,
            r#""\u000a""#,
            r#"{"a":1,"a":2}"#,
            "-0",
            "1.50",
            "1E5",
            "1e400",
            r#""\ud83d\ude00""#,
        ] {
            assert!(!canonical_text(text), "{text}");
        }
    }

    #[test]
    fn what_python_refuses_is_an_error() {
        for text in [
            "",
            "[1,]",
            r#"{"a":1,}"#,
            "01",
            "tru",
            "NaN",
            "\"\t\"",
            r#""\x""#,
            r#""\u12""#,
            "[1] x",
            "{\"a\" 1}",
        ] {
            assert!(document(text.as_bytes()).is_err(), "{text}");
        }
        assert!(document(b"\"\xff\"").is_err());
        let long = "1".repeat(MAX_INT_DIGITS + 1);
        assert!(document(long.as_bytes()).is_err());
        let deep = "[".repeat(MAX_DEPTH + 2) + &"]".repeat(MAX_DEPTH + 2);
        assert!(document(deep.as_bytes()).is_err());
        assert!(document_within(deep.as_bytes(), MAX_DEPTH + 2).is_ok());
    }

    /// Item by item, a document reads as `value` reads it: the same spans, the same refusals.
    #[test]
    fn containers_read_item_by_item() {
        fn walk(r: &mut Reader<'_>, depth: usize, out: &mut Vec<Span>) -> Result<()> {
            match r.text.get(r.at) {
                Some(b'{') => {
                    r.enter(depth)?;
                    let mut first = true;
                    while let Some(key) = r.next_member(first)? {
                        out.push(key);
                        walk(r, depth + 1, out)?;
                        first = false;
                    }
                }
                Some(b'[') => {
                    r.enter(depth)?;
                    let mut first = true;
                    while r.next_element(first)? {
                        walk(r, depth + 1, out)?;
                        first = false;
                    }
                }
                _ => out.push(r.value(depth)?),
            }
            Ok(())
        }
        let text = br#" {"a": [1, "x\n", {"b": null}, []], "c" : {}} "#;
        let (_, spans) = document_read(text, MAX_DEPTH, |r| {
            let mut out = Vec::new();
            walk(r, 0, &mut out).map(|()| out)
        })
        .unwrap();
        let (r, _) = document(text).unwrap();
        let texts: Vec<&[u8]> = spans.iter().map(|s| r.slice(*s)).collect();
        assert_eq!(
            texts,
            [
                &b"\"a\""[..],
                b"1",
                b"\"x\\n\"",
                b"\"b\"",
                b"null",
                b"\"c\""
            ]
        );
        for bad in [
            "[1,]",
            r#"{"a":1,}"#,
            "[1 2]",
            r#"{"a" 1}"#,
            "{1:2}",
            "[",
            "[1] x",
        ] {
            let walked = document_read(bad.as_bytes(), MAX_DEPTH, |r| walk(r, 0, &mut Vec::new()));
            assert!(walked.is_err(), "{bad}");
            assert!(document(bad.as_bytes()).is_err(), "{bad}");
        }
        let deep = "[".repeat(MAX_DEPTH + 2) + &"]".repeat(MAX_DEPTH + 2);
        let walked = document_read(deep.as_bytes(), MAX_DEPTH, |r| walk(r, 0, &mut Vec::new()));
        assert_eq!(walked.err().map(|e| e.what), Some("nested too deeply"));
    }

    #[test]
    fn strings_decode_to_wtf8() {
        let decode = |text: &str| {
            let (r, span) = document(text.as_bytes()).unwrap();
            decode_string(&r, span).into_owned()
        };
        assert_eq!(decode(r#""\ud83d\ude00""#), "😀".as_bytes());
        assert_eq!(decode(r#""\ud800x""#), [0xed, 0xa0, 0x80, b'x']);
        assert_eq!(decode(r#""\u00e9\/\b""#), "é/\u{8}".as_bytes());
        let (r, span) = document(br#""\udfff""#).unwrap();
        assert!(decode_str(&r, span).is_none());
    }
}
