//! The canonical-JSON reader of the 신경 native path (`singyeong.rs`): a strict reader of one
//! JSON text that also says whether Python's encoder would write the text read exactly so
//! (`clean`), and the float-repr rule that decides it for floats.

use super::{MAX_DECODED_INT_DIGITS, MAX_DEPTH, MAX_INT_DIGITS, MAX_KEYS, MAX_PAYLOAD_INT_DIGITS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Null,
    True,
    False,
    Int,
    Float,
    Str,
    Arr,
    Obj,
}

/// A value's kind and its text `b[start..end]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Val {
    pub(super) kind: Kind,
    pub(super) start: usize,
    pub(super) end: usize,
}

/// One object member: the key's raw text between the quotes (canonical, so raw bytes equal
/// iff the keys are equal) and the value.
pub(super) type Member<'a> = (&'a [u8], Val);

/// A strict reader of one JSON text. `None` from a method: not JSON, or not worth deciding
/// here (Python decides). `clean` turns false when the text read is valid JSON that Python's
/// encoder would write differently (whitespace, non-canonical escapes, floats, `-0`,
/// duplicate keys): such text must not be copied into a frame.
pub(super) struct Reader<'a> {
    pub(super) b: &'a [u8],
    pub(super) i: usize,
    pub(super) clean: bool,
}

impl<'a> Reader<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Reader {
            b,
            i: 0,
            clean: true,
        }
    }

    pub(super) fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return;
            }
            self.clean = false;
            self.i += 1;
        }
    }

    pub(super) fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    pub(super) fn word(&mut self, w: &[u8]) -> Option<()> {
        self.b[self.i..].starts_with(w).then(|| self.i += w.len())
    }

    pub(super) fn value(&mut self, depth: usize) -> Option<Val> {
        if depth > MAX_DEPTH {
            return None;
        }
        let start = self.i;
        let kind = match *self.b.get(self.i)? {
            b'{' => {
                self.members(depth, |_| Some(()))?;
                Kind::Obj
            }
            b'[' => {
                self.i += 1;
                self.ws();
                if self.eat(b']').is_none() {
                    loop {
                        self.value(depth + 1)?;
                        self.ws();
                        if self.eat(b',').is_some() {
                            self.ws();
                            continue;
                        }
                        self.eat(b']')?;
                        break;
                    }
                }
                Kind::Arr
            }
            b'"' => {
                self.string()?;
                Kind::Str
            }
            b't' => self.word(b"true").map(|_| Kind::True)?,
            b'f' => self.word(b"false").map(|_| Kind::False)?,
            b'n' => self.word(b"null").map(|_| Kind::Null)?,
            _ => self.number()?,
        };
        Some(Val {
            kind,
            start,
            end: self.i,
        })
    }

    /// An object at `self.i`; `each` sees every member in order. Answers whether its keys
    /// are distinct and clean; when not, the text is unclean too (Python keeps the last value
    /// of a duplicate key at the first one's place). Past `MAX_KEYS` members the check would
    /// cost more than Python's decode, so such an object is only left to Python.
    pub(super) fn members(
        &mut self,
        depth: usize,
        mut each: impl FnMut(Member<'a>) -> Option<()>,
    ) -> Option<bool> {
        self.eat(b'{')?;
        self.ws();
        if self.eat(b'}').is_some() {
            return Some(true);
        }
        let mut keys: Vec<&'a [u8]> = Vec::new();
        let mut keys_ok = true;
        loop {
            let before = self.clean;
            self.clean = true;
            let (ks, ke) = self.string()?;
            let key = &self.b[ks..ke];
            if !self.clean || keys.len() >= MAX_KEYS || keys.contains(&key) {
                keys_ok = false;
            }
            self.clean = before && keys_ok;
            keys.push(key);
            self.ws();
            self.eat(b':')?;
            self.ws();
            let v = self.value(depth + 1)?;
            each((key, v))?;
            self.ws();
            if self.eat(b',').is_some() {
                self.ws();
                continue;
            }
            self.eat(b'}')?;
            return Some(keys_ok);
        }
    }

    /// A string at `self.i`: the range between its quotes. Escapes other than the ones
    /// Python's encoder writes make it unclean; raw control characters and bad escapes are
    /// errors (Python's strict decoder refuses them too).
    pub(super) fn string(&mut self) -> Option<(usize, usize)> {
        self.eat(b'"')?;
        let start = self.i;
        loop {
            let c = *self.b.get(self.i)?;
            match c {
                b'"' => {
                    self.i += 1;
                    return Some((start, self.i - 1));
                }
                0..=0x1f => return None,
                b'\\' => {
                    let e = *self.b.get(self.i + 1)?;
                    self.i += 2;
                    match e {
                        b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f' => {}
                        b'/' => self.clean = false,
                        b'u' => {
                            let hex = self.b.get(self.i..self.i + 4)?;
                            let text = std::str::from_utf8(hex).ok()?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            let code = u16::from_str_radix(text, 16).ok()?;
                            self.i += 4;
                            // the encoder writes \u00XX (lower-case hex) for control
                            // characters without a short escape, and nothing else
                            let short = matches!(code, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d);
                            let canonical =
                                code < 0x20 && !short && !hex.iter().any(u8::is_ascii_uppercase);
                            if !canonical {
                                self.clean = false;
                            }
                        }
                        _ => return None,
                    }
                }
                _ => self.i += 1,
            }
        }
    }

    pub(super) fn number(&mut self) -> Option<Kind> {
        let start = self.i;
        let negative = self.eat(b'-').is_some();
        let digits_at = self.i;
        match *self.b.get(self.i)? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                    self.i += 1;
                }
            }
            _ => return None,
        }
        let digits = self.i - digits_at;
        if digits > MAX_DECODED_INT_DIGITS {
            return None; // Python's `int` refuses it: its error is Python's to word
        }
        let mut kind = Kind::Int;
        if self.eat(b'.').is_some() {
            kind = Kind::Float;
            let at = self.i;
            while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            if self.i == at {
                return None;
            }
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            kind = Kind::Float;
            self.i += 1;
            if matches!(self.b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            let at = self.i;
            while self.b.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            if self.i == at {
                return None;
            }
        }
        let negative_zero = negative && &self.b[start..self.i] == b"-0";
        let text = &self.b[start..self.i];
        // a float is clean when its text is Python's repr of the value (what its encoder
        // writes): `1.5`, `1e-05`, `1e+16`, not `1.50`, `1E5` or `0.1e1`
        let float_clean = kind == Kind::Float && python_float_repr(text).as_deref() == Some(text);
        if (kind == Kind::Float && !float_clean) || negative_zero || digits > MAX_PAYLOAD_INT_DIGITS
        {
            self.clean = false;
        }
        Some(kind)
    }

    /// The members of the object `v` (read again from its start), all clean keys.
    pub(super) fn object(&mut self, v: Val) -> Option<Vec<Member<'a>>> {
        if v.kind != Kind::Obj {
            return None;
        }
        let mut r = Reader::new(self.b);
        r.i = v.start;
        let mut out = Vec::new();
        let keys_ok = r.members(0, |m| {
            out.push(m);
            Some(())
        })?;
        // structural objects: a duplicate key or an unclean key (an escape) goes to Python
        keys_ok.then_some(out)
    }

    /// Whether the value's text is exactly what Python's encoder writes for it.
    pub(super) fn clean(&self, v: Val) -> bool {
        let mut r = Reader::new(&self.b[..v.end]);
        r.i = v.start;
        r.value(0).is_some() && r.clean
    }
}

/// Python's `repr` of the float a JSON number text denotes (None: not finite): the shortest
/// digits that round-trip (Rust's `{:e}` gives the same shortest digits), laid out as
/// CPython's `float_repr_style = 'short'` does: positional while the decimal point falls
/// within -4 < point <= 16 (with `.0` added to an integral value), else `d.ddde±XX` with at
/// least two exponent digits.
pub fn python_float_repr(text: &[u8]) -> Option<Vec<u8>> {
    let x: f64 = std::str::from_utf8(text).ok()?.parse().ok()?;
    if !x.is_finite() {
        return None;
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e')?;
    let exp: i32 = exp.parse().ok()?;
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let point = exp + 1; // the value is 0.DIGITS x 10^point
    let mut out = String::with_capacity(digits.len() + 8);
    if x.is_sign_negative() {
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
        out.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
    }
    Some(out.into_bytes())
}

pub(super) fn get<'m>(members: &'m [Member<'_>], key: &[u8]) -> Option<&'m Val> {
    members.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
}

/// The decoded text of a string value.
pub(super) fn text(b: &[u8], v: Val) -> Option<String> {
    if v.kind != Kind::Str {
        return None;
    }
    unescape(&b[v.start + 1..v.end - 1])
}

/// A string's raw text between its quotes with the escapes undone (None: a surrogate escape,
/// which a Rust string cannot hold; Python decides those).
pub(super) fn unescape(raw: &[u8]) -> Option<String> {
    let raw = std::str::from_utf8(raw).ok()?;
    if !raw.contains('\\') {
        return Some(raw.to_owned());
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            '"' => '"',
            '\\' => '\\',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'u' => {
                let hex: String = chars.by_ref().take(4).collect();
                char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?
            }
            _ => return None,
        });
    }
    Some(out)
}

/// The canonical index bytes of a scalar `$eq` value (None: Python decides).
pub(super) fn scalar(b: &[u8], v: Val) -> Option<Vec<u8>> {
    match v.kind {
        Kind::True => Some(b"b1".to_vec()),
        Kind::False => Some(b"b0".to_vec()),
        Kind::Int => {
            let t = &b[v.start..v.end];
            let digits = t.iter().filter(|c| c.is_ascii_digit()).count();
            (digits <= MAX_INT_DIGITS && t != b"-0").then(|| [b"n", t].concat())
        }
        Kind::Str => {
            let mut r = Reader::new(&b[..v.end]);
            r.i = v.start;
            r.string()?;
            if !r.clean {
                return None;
            }
            Some([b"s", text(b, v)?.as_bytes()].concat())
        }
        _ => None,
    }
}
