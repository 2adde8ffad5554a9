//! Metadata and query values as the gateway compares them (spec decision 4): what Python's
//! decoders give (None, bool, int of any size, float, str, bytes, list, dict), held once in
//! Rust so that one matcher serves every query, from Python or from the fast path.
//!
//! Strings are WTF-8 bytes (Python's `surrogatepass`: a lone surrogate that JSON's `\ud800`
//! carries survives), so equality and order are Python's code-point ones. Integers outside
//! i64 are kept as their decimal text (`Big`) and compared exactly, also against floats.

use std::cmp::Ordering;

use crate::codec::json::{self, Kind, Reader, Span};

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    /// an integer outside i64, as canonical decimal text (`-` then digits, no leading zero)
    Big(Box<str>),
    Float(f64),
    Str(Box<[u8]>),
    Bytes(Box<[u8]>),
    List(Vec<Value>),
    /// (key, value) in insertion order; a repeated key replaced in place (Python's dict)
    Map(Vec<(Value, Value)>),
}

/// A number as compared: bools count as 0/1 only inside containers (Python's `==`).
#[derive(Debug, Clone, Copy)]
pub enum Num<'a> {
    I(i64),
    B(&'a str),
    F(f64),
}

impl Value {
    pub fn str(text: &str) -> Value {
        Value::Str(text.as_bytes().into())
    }

    /// The integer of decimal `text` (an optional `-`, digits).
    pub fn int_text(text: &str) -> Value {
        if let Ok(v) = text.parse::<i64>() {
            return Value::Int(v);
        }
        let (neg, digits) = text.strip_prefix('-').map_or((false, text), |d| (true, d));
        let digits = digits.trim_start_matches('0');
        Value::Big(format!("{}{digits}", if neg { "-" } else { "" }).into())
    }

    /// `get` of a map by a string key (Python's `dict.get("...")`).
    pub fn get(&self, key: &[u8]) -> Option<&Value> {
        match self {
            Value::Map(m) => m.iter().find_map(|(k, v)| match k {
                Value::Str(s) if &**s == key => Some(v),
                _ => None,
            }),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&[u8]> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Python's kinds that `$eq` keeps apart: b(ool), n(umber), s(tring), l(ist), m(ap), z.
    fn kind(&self) -> u8 {
        match self {
            Value::Bool(_) => b'b',
            Value::Int(_) | Value::Big(_) | Value::Float(_) => b'n',
            Value::Str(_) => b's',
            Value::List(_) => b'l',
            Value::Map(_) => b'm',
            Value::Null | Value::Bytes(_) => b'z',
        }
    }

    /// A number, bools excluded (`_number`'s kinds; NaN included).
    pub fn number(&self) -> Option<Num<'_>> {
        match self {
            Value::Int(i) => Some(Num::I(*i)),
            Value::Big(b) => Some(Num::B(b)),
            Value::Float(f) => Some(Num::F(*f)),
            _ => None,
        }
    }

    fn loose_number(&self) -> Option<Num<'_>> {
        match self {
            Value::Bool(b) => Some(Num::I(i64::from(*b))),
            _ => self.number(),
        }
    }

    pub fn is_nan(&self) -> bool {
        matches!(self, Value::Float(f) if f.is_nan())
    }
}

fn big_cmp(a: &str, b: &str) -> Ordering {
    let (an, ad) = a.strip_prefix('-').map_or((false, a), |d| (true, d));
    let (bn, bd) = b.strip_prefix('-').map_or((false, b), |d| (true, d));
    match (an, bn) {
        (false, true) => Ordering::Greater,
        (true, false) => Ordering::Less,
        _ => {
            let mag = ad.len().cmp(&bd.len()).then_with(|| ad.cmp(bd));
            if an {
                mag.reverse()
            } else {
                mag
            }
        }
    }
}

const TWO_63: f64 = 9_223_372_036_854_775_808.0;

/// Exact comparison of two numbers (None: a NaN).
pub fn num_cmp(a: Num<'_>, b: Num<'_>) -> Option<Ordering> {
    use Num::*;
    match (a, b) {
        (I(x), I(y)) => Some(x.cmp(&y)),
        (F(x), F(y)) => x.partial_cmp(&y),
        (B(x), B(y)) => Some(big_cmp(x, y)),
        (I(_), B(y)) => Some(if y.starts_with('-') {
            Ordering::Greater
        } else {
            Ordering::Less
        }),
        (B(_), I(_)) => num_cmp(b, a).map(Ordering::reverse),
        (I(x), F(y)) => {
            if y.is_nan() {
                None
            } else if y >= TWO_63 {
                Some(Ordering::Less)
            } else if y < -TWO_63 {
                Some(Ordering::Greater)
            } else {
                let floor = y.floor();
                Some(x.cmp(&(floor as i64)).then(if y > floor {
                    Ordering::Less
                } else {
                    Ordering::Equal
                }))
            }
        }
        (F(_), I(_)) | (F(_), B(_)) => num_cmp(b, a).map(Ordering::reverse),
        (B(x), F(y)) => {
            if y.is_nan() {
                None
            } else if y.is_infinite() || y.abs() >= TWO_63 {
                // floats this large are integers: their exact decimal text compares
                if y.is_infinite() {
                    Some(if y > 0.0 {
                        Ordering::Less
                    } else {
                        Ordering::Greater
                    })
                } else {
                    Some(big_cmp(x, &format!("{y:.0}")))
                }
            } else {
                Some(if x.starts_with('-') {
                    Ordering::Less
                } else {
                    Ordering::Greater
                })
            }
        }
    }
}

/// Python's `a == b` (inside containers too: `True == 1`, `1 == 1.0`, dicts by key lookup).
pub fn py_eq(a: &Value, b: &Value) -> bool {
    if let (Some(x), Some(y)) = (a.loose_number(), b.loose_number()) {
        return num_cmp(x, y) == Some(Ordering::Equal);
    }
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Str(x), Value::Str(y)) | (Value::Bytes(x), Value::Bytes(y)) => x == y,
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| py_eq(p, q))
        }
        (Value::Map(x), Value::Map(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.iter().any(|(k2, v2)| py_eq(k, k2) && py_eq(v, v2)))
        }
        _ => false,
    }
}

/// `$eq` of the matcher: values of one kind, equal (versions by precedence when `version`).
pub fn equal(a: &Value, b: &Value, version: bool) -> bool {
    if version {
        if let (Some(x), Some(y)) = (version_key(a), version_key(b)) {
            return x == y;
        }
    }
    a.kind() == b.kind() && py_eq(a, b)
}

/// The order of `a` against `b`: numbers, strings, or (version) semver; None across kinds.
pub fn order(a: &Value, b: &Value, version: bool) -> Option<Ordering> {
    if version {
        return Some(version_key(a)?.cmp(&version_key(b)?));
    }
    match (a, b) {
        (Value::Str(x), Value::Str(y)) => Some(x.cmp(y)),
        _ => num_cmp(a.number()?, b.number()?),
    }
}

// ---- semver ------------------------------------------------------------------------------

/// A numeric identifier: digits without leading zeros, compared by length then text.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digits(usize, Box<[u8]>);

/// A pre-release identifier: numeric ones sort before alphanumeric ones (semver 11.4).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PreId {
    Num(Digits),
    Alpha(Box<[u8]>),
}

/// Semver precedence: (major, minor, patch, release?, pre-release ids), build ignored.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VersionKey(Digits, Digits, Digits, bool, Vec<PreId>);

fn numeric(part: &[u8]) -> Option<Digits> {
    let ok = !part.is_empty()
        && part.iter().all(u8::is_ascii_digit)
        && (part.len() == 1 || part[0] != b'0');
    ok.then(|| Digits(part.len(), part.into()))
}

fn ident(part: &[u8]) -> bool {
    !part.is_empty() && part.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
}

/// The semver precedence of a string value, or None when it is not semver 2.0.
pub fn version_key(value: &Value) -> Option<VersionKey> {
    let mut text = value.as_str()?;
    // the pattern's `$` (Python's re) also matches before one final newline
    text = text.strip_suffix(b"\n").unwrap_or(text);
    let (rest, build) = match text.iter().position(|c| *c == b'+') {
        Some(at) => (&text[..at], Some(&text[at + 1..])),
        None => (text, None),
    };
    if let Some(build) = build {
        if !build.split(|c| *c == b'.').all(ident) {
            return None;
        }
    }
    let (core, pre) = match rest.iter().position(|c| *c == b'-') {
        Some(at) => (&rest[..at], Some(&rest[at + 1..])),
        None => (rest, None),
    };
    let mut parts = core.split(|c| *c == b'.');
    let major = numeric(parts.next()?)?;
    let minor = numeric(parts.next()?)?;
    let patch = numeric(parts.next()?)?;
    if parts.next().is_some() {
        return None;
    }
    let mut ids = Vec::new();
    if let Some(pre) = pre {
        for part in pre.split(|c| *c == b'.') {
            if !ident(part) {
                return None;
            }
            if part.iter().all(u8::is_ascii_digit) {
                ids.push(PreId::Num(numeric(part)?));
            } else {
                ids.push(PreId::Alpha(part.into()));
            }
        }
    }
    Some(VersionKey(major, minor, patch, pre.is_none(), ids))
}

// ---- from JSON text (the fast path reads targets this way) --------------------------------

/// The value of a JSON span as Python's decoder gives it; None for a string with a lone
/// surrogate's escape? No: WTF-8 keeps those. None only for numbers Python would read
/// differently (none today) — the reader has checked the text.
pub fn from_json(r: &Reader<'_>, span: Span) -> Value {
    match span.kind {
        Kind::Null => Value::Null,
        Kind::True => Value::Bool(true),
        Kind::False => Value::Bool(false),
        Kind::Int => Value::int_text(std::str::from_utf8(r.slice(span)).unwrap_or("0")),
        Kind::Float => Value::Float(json::parse_f64(r.slice(span))),
        Kind::Str => Value::Str(json::decode_string(r, span).into_owned().into()),
        Kind::Arr => Value::List(
            r.elements(span)
                .into_iter()
                .map(|s| from_json(r, s))
                .collect(),
        ),
        Kind::Obj => {
            let mut out: Vec<(Value, Value)> = Vec::new();
            for (k, v) in r.members(span) {
                let key = from_json(r, k);
                let value = from_json(r, v);
                match out.iter_mut().find(|(old, _)| *old == key) {
                    Some(slot) => slot.1 = value,
                    None => out.push((key, value)),
                }
            }
            Value::Map(out)
        }
    }
}

// ---- Python's repr, for error texts ----------------------------------------------------

/// `repr(value)` as Python writes it (error messages quote the offending part this way).
pub fn repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Int(i) => out.push_str(&i.to_string()),
        Value::Big(b) => out.push_str(b),
        Value::Float(f) => out.push_str(&match json::float_repr(*f).as_str() {
            "NaN" => "nan".into(),
            "Infinity" => "inf".into(),
            "-Infinity" => "-inf".into(),
            other => other.to_owned(),
        }),
        Value::Str(s) => {
            let text = String::from_utf8_lossy(s);
            let quote = if text.contains('\'') && !text.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(quote);
            for c in text.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        out.push_str(&format!("\\x{:02x}", c as u32))
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
        }
        Value::Bytes(b) => out.push_str(&format!("b{:?}", String::from_utf8_lossy(b))),
        Value::List(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        Value::Map(items) => {
            out.push('{');
            for (i, (k, v)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, k);
                out.push_str(": ");
                write_repr(out, v);
            }
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: &str) -> Value {
        Value::str(t)
    }

    #[test]
    fn numbers_compare_exactly_across_representations() {
        let big = Value::int_text("100000000000000000000");
        assert!(equal(&big, &Value::Float(1e20), false));
        assert!(!equal(
            &Value::int_text("100000000000000000001"),
            &Value::Float(1e20),
            false
        ));
        assert!(equal(&Value::Int(1), &Value::Float(1.0), false));
        assert!(!equal(&Value::Int(1), &Value::Bool(true), false));
        assert!(py_eq(
            &Value::List(vec![Value::Int(1)]),
            &Value::List(vec![Value::Bool(true)])
        ));
        assert_eq!(
            order(&Value::Int(3), &Value::Float(3.5), false),
            Some(Ordering::Less)
        );
        assert_eq!(order(&Value::Int(3), &Value::Float(f64::NAN), false), None);
        assert_eq!(
            order(&big, &Value::Int(i64::MAX), false),
            Some(Ordering::Greater)
        );
        assert_eq!(
            order(
                &Value::int_text("-100000000000000000000"),
                &Value::Float(f64::NEG_INFINITY),
                false
            ),
            Some(Ordering::Greater)
        );
        assert_eq!(order(&s("b"), &s("a"), false), Some(Ordering::Greater));
        assert_eq!(order(&s("b"), &Value::Int(1), false), None);
    }

    #[test]
    fn versions_order_by_precedence() {
        let v = |t| version_key(&s(t)).unwrap();
        assert!(v("1.0.0-alpha") < v("1.0.0-alpha.1"));
        assert!(v("1.0.0-alpha.1") < v("1.0.0-alpha.beta"));
        assert!(v("1.0.0-beta.2") < v("1.0.0-beta.11"));
        assert!(v("1.0.0-rc.1") < v("1.0.0"));
        assert!(v("1.9.0") < v("1.10.0"));
        assert_eq!(v("1.0.0+b"), v("1.0.0"));
        for bad in ["1.0", "01.0.0", "1.0.0-", "1.0.0-01", "a.b.c", "1.0.0+"] {
            assert!(version_key(&s(bad)).is_none(), "{bad}");
        }
        assert!(equal(&s("1.0.0"), &s("1.0.0+x"), true));
        assert!(!equal(&s("1.0.0"), &s("1.0.0+x"), false));
    }

    #[test]
    fn json_values_and_repr() {
        let (r, span) = json::document(
            br#"{"a":[1,2.5,"x\n",null,true],"a":{"'":1},"b":123456789012345678901}"#,
        )
        .unwrap();
        let v = from_json(&r, span);
        assert_eq!(repr(&v), r#"{'a': {"'": 1}, 'b': 123456789012345678901}"#);
        let (r, span) = json::document(br#"[1,2.5,"x\n",null,true]"#).unwrap();
        assert_eq!(repr(&from_json(&r, span)), r"[1, 2.5, 'x\n', None, True]");
    }
}
