//! The HTTP tunnel's connector messages (`dialects/tunnel/wire.py`), JSON and msgpack, both
//! directions, byte-identical to the Python encoder.
//!
//! Why here: the relay and the connector spend most of their per-request CPU building and
//! parsing these messages; the native per-request path of the relay encodes `RequestTarget`
//! and decodes `Deliver` without touching Python objects.
//!
//! Byte identity with `wire.py` (checked by `tests/test_tunnel_wire_native.py`):
//! - msgpack as `msgpack.Packer(use_bin_type=True)`: the smallest int/str/bin/map/array form,
//!   floats as float64, bytes as bin;
//! - JSON as `json.JSONEncoder(separators=(",", ":"))`: `ensure_ascii` escapes (everything
//!   outside `' '..='~'`, lower-case hex, surrogate pairs), floats as Python's `repr`;
//!   bytes fields as standard base64 text.
//!
//! Decoding is deliberately narrower than Python's: anything this decoder does not take
//! (a lone surrogate, an integer beyond 64 bits, `NaN`, trailing bits in base64, a UTF-8
//! BOM, nesting deeper than `MAX_DEPTH`, ...) is a `TunnelWire` error, and `wire.py` then
//! runs its own decoder, which either accepts the message or words the exact error. So a
//! successful decode here always equals Python's, and error texts stay Python's.

use base64::Engine as _;

use crate::error::{Error, Result};

/// nesting a message may have (an invocation is 4 deep: object, list, object, headers);
/// deeper input is refused before it can exhaust the stack
pub const MAX_DEPTH: usize = 32;

fn wire_err(msg: impl Into<String>) -> Error {
    Error::TunnelWire(msg.into())
}

// ---- values ---------------------------------------------------------------------------------

/// A decoded JSON or msgpack value (the subset the tunnel's messages use).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Array(Vec<Value>),
    /// entries in wire order; duplicate keys are kept (lookups take the last, as a dict does)
    Map(Vec<(String, Value)>),
}

impl Value {
    /// The value of `key` in a map (the last one, as Python's dict keeps), else None.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

// ---- writers --------------------------------------------------------------------------------

/// One of the two encodings; the message encoders below are written once against it.
pub trait Sink {
    fn begin_map(&mut self, len: usize);
    fn end_map(&mut self);
    fn begin_array(&mut self, len: usize);
    fn end_array(&mut self);
    /// a map key (before its value)
    fn key(&mut self, key: &str);
    /// before each array element
    fn element(&mut self);
    fn null(&mut self);
    fn bool(&mut self, value: bool);
    fn int(&mut self, value: i64);
    /// an unsigned integer beyond i64 (msgpack only; JSON writes its digits)
    fn uint(&mut self, value: u64);
    fn float(&mut self, value: f64);
    fn str(&mut self, value: &str);
    /// a body: bin in msgpack, base64 text in JSON
    fn body(&mut self, value: &[u8]);
    fn into_bytes(self) -> Vec<u8>;
}

/// msgpack as `msgpack.Packer(use_bin_type=True)` writes it.
#[derive(Default)]
pub struct Msgpack {
    out: Vec<u8>,
}

impl Msgpack {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            out: Vec::with_capacity(capacity),
        }
    }

    fn len_header(
        &mut self,
        len: usize,
        fix: u8,
        fix_max: usize,
        m8: Option<u8>,
        m16: u8,
        m32: u8,
    ) {
        if len <= fix_max {
            self.out.push(fix | len as u8);
        } else if let (Some(m8), true) = (m8, len < 0x100) {
            self.out.push(m8);
            self.out.push(len as u8);
        } else if len < 0x1_0000 {
            self.out.push(m16);
            self.out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.out.push(m32);
            self.out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }
}

impl Sink for Msgpack {
    fn begin_map(&mut self, len: usize) {
        self.len_header(len, 0x80, 15, None, 0xde, 0xdf);
    }
    fn end_map(&mut self) {}
    fn begin_array(&mut self, len: usize) {
        self.len_header(len, 0x90, 15, None, 0xdc, 0xdd);
    }
    fn end_array(&mut self) {}
    fn key(&mut self, key: &str) {
        self.str(key);
    }
    fn element(&mut self) {}
    fn null(&mut self) {
        self.out.push(0xc0);
    }
    fn bool(&mut self, value: bool) {
        self.out.push(if value { 0xc3 } else { 0xc2 });
    }
    fn int(&mut self, v: i64) {
        let out = &mut self.out;
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            out.push(v as i8 as u8);
        } else if v >= -128 {
            out.push(0xd0);
            out.push(v as i8 as u8);
        } else if v >= -32768 {
            out.push(0xd1);
            out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= -(1 << 31) {
            out.push(0xd2);
            out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn uint(&mut self, v: u64) {
        let out = &mut self.out;
        if v < 0x80 {
            out.push(v as u8);
        } else if v < 0x100 {
            out.push(0xcc);
            out.push(v as u8);
        } else if v < 0x1_0000 {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v < 0x1_0000_0000 {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn float(&mut self, value: f64) {
        self.out.push(0xcb);
        self.out.extend_from_slice(&value.to_bits().to_be_bytes());
    }
    fn str(&mut self, value: &str) {
        self.len_header(value.len(), 0xa0, 31, Some(0xd9), 0xda, 0xdb);
        self.out.extend_from_slice(value.as_bytes());
    }
    fn body(&mut self, value: &[u8]) {
        let len = value.len();
        if len < 0x100 {
            self.out.push(0xc4);
            self.out.push(len as u8);
        } else if len < 0x1_0000 {
            self.out.push(0xc5);
            self.out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.out.push(0xc6);
            self.out.extend_from_slice(&(len as u32).to_be_bytes());
        }
        self.out.extend_from_slice(value);
    }
    fn into_bytes(self) -> Vec<u8> {
        self.out
    }
}

/// Compact JSON as `json.JSONEncoder(separators=(",", ":"))` writes it (`ensure_ascii`).
#[derive(Default)]
pub struct Json {
    out: Vec<u8>,
    /// per open container: whether an item was written (the next one needs a comma)
    items: Vec<bool>,
}

impl Json {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            out: Vec::with_capacity(capacity),
            items: Vec::new(),
        }
    }

    fn separator(&mut self) {
        if let Some(seen) = self.items.last_mut() {
            if *seen {
                self.out.push(b',');
            }
            *seen = true;
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn push_u_escape(out: &mut Vec<u8>, unit: u16) {
    out.extend_from_slice(b"\\u");
    for shift in [12, 8, 4, 0] {
        out.push(HEX[((unit >> shift) & 0xf) as usize]);
    }
}

/// `s` as a JSON string literal, escaped as Python's `ensure_ascii` encoder does.
pub fn json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\' {
            continue;
        }
        if b >= 0x80 && (b & 0xc0) == 0x80 {
            continue; // continuation byte: handled with its lead byte
        }
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b if b < 0x80 => push_u_escape(out, u16::from(b)),
            _ => {
                let width = match b {
                    0xc0..=0xdf => 2,
                    0xe0..=0xef => 3,
                    _ => 4,
                };
                let ch = s[i..i + width].chars().next().unwrap_or('\u{fffd}');
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    push_u_escape(out, *unit);
                }
                start = i + width;
            }
        }
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// A float as Python's `repr` (what `json` writes): shortest round-trip digits, fixed notation
/// for decimal exponents -4..=15 (always with a fractional part), else `d.ddde+XX`.
pub fn python_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .into();
    }
    let sci = format!("{value:e}"); // shortest digits: "-1.2345e-7"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!(
                "{sign}{digits}{}.0",
                "0".repeat(point as usize - digits.len())
            )
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{sign}{int}.{frac}")
        }
    } else {
        let frac = &digits[1..];
        let dot = if frac.is_empty() { "" } else { "." };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{dot}{frac}e{esign}{:02}", &digits[..1], exp.abs())
    }
}

impl Sink for Json {
    fn begin_map(&mut self, _len: usize) {
        self.out.push(b'{');
        self.items.push(false);
    }
    fn end_map(&mut self) {
        self.items.pop();
        self.out.push(b'}');
    }
    fn begin_array(&mut self, _len: usize) {
        self.out.push(b'[');
        self.items.push(false);
    }
    fn end_array(&mut self) {
        self.items.pop();
        self.out.push(b']');
    }
    fn key(&mut self, key: &str) {
        self.separator();
        json_string(&mut self.out, key);
        self.out.push(b':');
    }
    fn element(&mut self) {
        self.separator();
    }
    fn null(&mut self) {
        self.out.extend_from_slice(b"null");
    }
    fn bool(&mut self, value: bool) {
        self.out
            .extend_from_slice(if value { b"true" as &[u8] } else { b"false" });
    }
    fn int(&mut self, value: i64) {
        self.out.extend_from_slice(value.to_string().as_bytes());
    }
    fn uint(&mut self, value: u64) {
        self.out.extend_from_slice(value.to_string().as_bytes());
    }
    fn float(&mut self, value: f64) {
        self.out
            .extend_from_slice(python_float_repr(value).as_bytes());
    }
    fn str(&mut self, value: &str) {
        json_string(&mut self.out, value);
    }
    fn body(&mut self, value: &[u8]) {
        self.out.push(b'"');
        let start = self.out.len();
        let encoded = base64::encoded_len(value.len(), true).unwrap_or(0);
        self.out.resize(start + encoded, 0);
        let written = base64::engine::general_purpose::STANDARD
            .encode_slice(value, &mut self.out[start..])
            .unwrap_or(0);
        self.out.truncate(start + written);
        self.out.push(b'"');
    }
    fn into_bytes(self) -> Vec<u8> {
        self.out
    }
}

/// Connection-level fields: they describe one hop, not the request (RFC 9110 §7.6.1), plus
/// the framing fields the relay and the connector set themselves (`Content-Length`,
/// `Expect`). The tunnel carries neither way (client.py's `HOP_BY_HOP` is this list).
pub const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "expect",
];

// ---- the RequestTarget message, from Rust data (the relay's native path) ---------------------

/// The fields of a `RequestTarget` (wire.py's ClientRequest), borrowed.
pub struct ClientRequestRef<'a> {
    pub request_id: &'a str,
    pub request_origin_id: &'a str,
    pub target: &'a str,
    pub tenant_name: &'a str,
    pub http_method: &'a str,
    pub url: &'a str,
    /// header names in first-seen order with all their values (a dict of lists)
    pub http_headers: &'a [(String, Vec<String>)],
    pub acknowledge_mode: i64,
    pub acknowledge_origin_id: Option<&'a str>,
    pub original_body_size: i64,
    pub body_size: i64,
    pub body_content: Option<&'a [u8]>,
    pub enable_tracing: bool,
    pub discard_connector_response: bool,
    pub expires_in: Option<i64>,
    pub acknowledge_url: Option<&'a str>,
}

fn opt_str<S: Sink>(sink: &mut S, value: Option<&str>) {
    match value {
        Some(v) => sink.str(v),
        None => sink.null(),
    }
}

/// The start of a hub invocation, `{"target": target, "arguments": [`: the caller writes its
/// one argument whole, then `end_invocation`.
pub fn begin_invocation<S: Sink>(sink: &mut S, target: &str) {
    sink.begin_map(2);
    sink.key("target");
    sink.str(target);
    sink.key("arguments");
    sink.begin_array(1);
    sink.element();
}

/// The end of the invocation `begin_invocation` started: the message's bytes.
pub fn end_invocation<S: Sink>(mut sink: S) -> Vec<u8> {
    sink.end_array();
    sink.end_map();
    sink.into_bytes()
}

/// The complete `RequestTarget` invocation, as `wire.encode(ClientRequest, binary)` writes it.
pub fn encode_client_request<S: Sink>(mut sink: S, r: &ClientRequestRef<'_>) -> Vec<u8> {
    begin_invocation(&mut sink, "RequestTarget");
    sink.begin_map(16);
    sink.key("requestId");
    sink.str(r.request_id);
    sink.key("requestOriginId");
    sink.str(r.request_origin_id);
    sink.key("target");
    sink.str(r.target);
    sink.key("tenantName");
    sink.str(r.tenant_name);
    sink.key("httpMethod");
    sink.str(r.http_method);
    sink.key("url");
    sink.str(r.url);
    sink.key("httpHeaders");
    sink.begin_map(r.http_headers.len());
    for (name, values) in r.http_headers {
        sink.key(name);
        sink.begin_array(values.len());
        for value in values {
            sink.element();
            sink.str(value);
        }
        sink.end_array();
    }
    sink.end_map();
    sink.key("acknowledgeMode");
    sink.int(r.acknowledge_mode);
    sink.key("acknowledgeOriginId");
    opt_str(&mut sink, r.acknowledge_origin_id);
    sink.key("originalBodySize");
    sink.int(r.original_body_size);
    sink.key("bodySize");
    sink.int(r.body_size);
    sink.key("bodyContent");
    match r.body_content {
        Some(body) => sink.body(body),
        None => sink.null(),
    }
    sink.key("enableTracing");
    sink.bool(r.enable_tracing);
    sink.key("discardConnectorResponse");
    sink.bool(r.discard_connector_response);
    sink.key("expiresIn");
    match r.expires_in {
        Some(v) => sink.int(v),
        None => sink.null(),
    }
    sink.key("acknowledgeUrl");
    opt_str(&mut sink, r.acknowledge_url);
    sink.end_map();
    end_invocation(sink)
}

// ---- readers --------------------------------------------------------------------------------

/// One msgpack value from the front of `data`; the rest is returned.
fn msgpack_value(data: &[u8], depth: usize) -> Result<(Value, &[u8])> {
    if depth > MAX_DEPTH {
        return Err(wire_err("msgpack nested too deep"));
    }
    let (&tag, rest) = data
        .split_first()
        .ok_or_else(|| wire_err("msgpack truncated"))?;
    fn take(data: &[u8], n: usize) -> Result<(&[u8], &[u8])> {
        if data.len() < n {
            return Err(wire_err("msgpack truncated"));
        }
        Ok(data.split_at(n))
    }
    fn be(data: &[u8], n: usize) -> Result<(u64, &[u8])> {
        let (head, rest) = take(data, n)?;
        Ok((
            head.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
            rest,
        ))
    }
    fn utf8(bytes: &[u8]) -> Result<String> {
        String::from_utf8(bytes.to_vec()).map_err(|_| wire_err("msgpack str is not UTF-8"))
    }
    match tag {
        0x00..=0x7f => Ok((Value::Int(i64::from(tag)), rest)),
        0xe0..=0xff => Ok((Value::Int(i64::from(tag as i8)), rest)),
        0xc0 => Ok((Value::Null, rest)),
        0xc2 => Ok((Value::Bool(false), rest)),
        0xc3 => Ok((Value::Bool(true), rest)),
        0xa0..=0xbf | 0xd9..=0xdb => {
            let (len, rest) = match tag {
                0xd9 => be(rest, 1)?,
                0xda => be(rest, 2)?,
                0xdb => be(rest, 4)?,
                _ => (u64::from(tag & 0x1f), rest),
            };
            let (s, rest) = take(rest, len as usize)?;
            Ok((Value::Str(utf8(s)?), rest))
        }
        0xc4..=0xc6 => {
            let (len, rest) = be(rest, 1 << (tag - 0xc4))?;
            let (b, rest) = take(rest, len as usize)?;
            Ok((Value::Bytes(b.to_vec()), rest))
        }
        0xcc..=0xcf => {
            let (v, rest) = be(rest, 1 << (tag - 0xcc))?;
            let v = i64::try_from(v).map_err(|_| wire_err("integer beyond 64 bits"))?;
            Ok((Value::Int(v), rest))
        }
        0xd0..=0xd3 => {
            let n = 1usize << (tag - 0xd0);
            let (v, rest) = be(rest, n)?;
            let shift = 64 - 8 * n as u32;
            Ok((Value::Int(((v << shift) as i64) >> shift), rest))
        }
        0xca => {
            let (v, rest) = be(rest, 4)?;
            Ok((Value::Float(f64::from(f32::from_bits(v as u32))), rest))
        }
        0xcb => {
            let (v, rest) = be(rest, 8)?;
            Ok((Value::Float(f64::from_bits(v)), rest))
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            let (len, mut rest) = match tag {
                0xdc => be(rest, 2)?,
                0xdd => be(rest, 4)?,
                _ => (u64::from(tag & 0x0f), rest),
            };
            if len as usize > rest.len() {
                return Err(wire_err("msgpack truncated"));
            }
            let mut items = Vec::with_capacity(len as usize);
            for _ in 0..len {
                let (item, after) = msgpack_value(rest, depth + 1)?;
                items.push(item);
                rest = after;
            }
            Ok((Value::Array(items), rest))
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let (len, mut rest) = match tag {
                0xde => be(rest, 2)?,
                0xdf => be(rest, 4)?,
                _ => (u64::from(tag & 0x0f), rest),
            };
            if len as usize > rest.len() {
                return Err(wire_err("msgpack truncated"));
            }
            let mut entries = Vec::with_capacity(len as usize);
            for _ in 0..len {
                let (key, after) = msgpack_value(rest, depth + 1)?;
                let Value::Str(key) = key else {
                    return Err(wire_err("msgpack map key is not a str"));
                };
                let (value, after) = msgpack_value(after, depth + 1)?;
                entries.push((key, value));
                rest = after;
            }
            Ok((Value::Map(entries), rest))
        }
        _ => Err(wire_err(format!("msgpack type 0x{tag:02x} not taken here"))),
    }
}

/// A whole msgpack message (nothing may follow the value).
pub fn parse_msgpack(data: &[u8]) -> Result<Value> {
    let (value, rest) = msgpack_value(data, 0)?;
    if !rest.is_empty() {
        return Err(wire_err("msgpack: extra data"));
    }
    Ok(value)
}

struct JsonReader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl JsonReader<'_> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.data.get(self.pos) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.data[self.pos..].starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value> {
        if depth > MAX_DEPTH {
            return Err(wire_err("JSON nested too deep"));
        }
        self.skip_ws();
        match self.data.get(self.pos) {
            Some(b'{') => {
                self.pos += 1;
                let mut entries = Vec::new();
                self.skip_ws();
                if self.eat(b"}") {
                    return Ok(Value::Map(entries));
                }
                loop {
                    self.skip_ws();
                    if self.data.get(self.pos) != Some(&b'"') {
                        return Err(wire_err("JSON: expected a key"));
                    }
                    let key = self.string()?;
                    self.skip_ws();
                    if !self.eat(b":") {
                        return Err(wire_err("JSON: expected ':'"));
                    }
                    let value = self.value(depth + 1)?;
                    entries.push((key, value));
                    self.skip_ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"}") {
                        return Ok(Value::Map(entries));
                    }
                    return Err(wire_err("JSON: expected ',' or '}'"));
                }
            }
            Some(b'[') => {
                self.pos += 1;
                let mut items = Vec::new();
                self.skip_ws();
                if self.eat(b"]") {
                    return Ok(Value::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.skip_ws();
                    if self.eat(b",") {
                        continue;
                    }
                    if self.eat(b"]") {
                        return Ok(Value::Array(items));
                    }
                    return Err(wire_err("JSON: expected ',' or ']'"));
                }
            }
            Some(b'"') => Ok(Value::Str(self.string()?)),
            Some(b't') if self.eat(b"true") => Ok(Value::Bool(true)),
            Some(b'f') if self.eat(b"false") => Ok(Value::Bool(false)),
            Some(b'n') if self.eat(b"null") => Ok(Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(wire_err("JSON: unexpected input")),
        }
    }

    fn number(&mut self) -> Result<Value> {
        // the grammar Python's scanner accepts: -?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?
        let start = self.pos;
        let d = self.data;
        let digits = |pos: &mut usize| {
            let from = *pos;
            while d.get(*pos).is_some_and(u8::is_ascii_digit) {
                *pos += 1;
            }
            *pos - from
        };
        let mut pos = self.pos;
        if d.get(pos) == Some(&b'-') {
            pos += 1;
        }
        if d.get(pos) == Some(&b'0') {
            pos += 1;
        } else if digits(&mut pos) == 0 {
            return Err(wire_err("JSON: bad number"));
        }
        let mut float = false;
        if d.get(pos) == Some(&b'.') && d.get(pos + 1).is_some_and(u8::is_ascii_digit) {
            pos += 1;
            digits(&mut pos);
            float = true;
        }
        if let Some(b'e' | b'E') = d.get(pos) {
            let mut p = pos + 1;
            if let Some(b'+' | b'-') = d.get(p) {
                p += 1;
            }
            if digits(&mut p) > 0 {
                pos = p;
                float = true;
            }
        }
        self.pos = pos;
        let text = std::str::from_utf8(&d[start..pos]).map_err(|_| wire_err("JSON: bad number"))?;
        if float {
            let v: f64 = text.parse().map_err(|_| wire_err("JSON: bad number"))?;
            if !v.is_finite() {
                return Err(wire_err("JSON: float out of range"));
            }
            Ok(Value::Float(v))
        } else {
            text.parse::<i64>()
                .map(Value::Int)
                .map_err(|_| wire_err("integer beyond 64 bits"))
        }
    }

    fn hex4(&mut self) -> Result<u16> {
        let h = self
            .data
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| wire_err("JSON: bad \\u escape"))?;
        let text = std::str::from_utf8(h).map_err(|_| wire_err("JSON: bad \\u escape"))?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(wire_err("JSON: bad \\u escape"));
        }
        self.pos += 4;
        u16::from_str_radix(text, 16).map_err(|_| wire_err("JSON: bad \\u escape"))
    }

    fn string(&mut self) -> Result<String> {
        self.pos += 1; // the opening quote
        let mut out = String::new();
        loop {
            let from = self.pos;
            while let Some(&b) = self.data.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            let chunk = std::str::from_utf8(&self.data[from..self.pos])
                .map_err(|_| wire_err("JSON is not UTF-8"))?;
            out.push_str(chunk);
            match self.data.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let esc = *self
                        .data
                        .get(self.pos)
                        .ok_or_else(|| wire_err("JSON: unterminated string"))?;
                    self.pos += 1;
                    match esc {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let unit = self.hex4()?;
                            let ch = if (0xd800..0xdc00).contains(&unit) && self.eat(b"\\u") {
                                let low = self.hex4()?;
                                if !(0xdc00..0xe000).contains(&low) {
                                    return Err(wire_err("JSON: lone surrogate"));
                                }
                                let c = 0x10000
                                    + ((u32::from(unit) - 0xd800) << 10)
                                    + (u32::from(low) - 0xdc00);
                                char::from_u32(c)
                            } else {
                                char::from_u32(u32::from(unit))
                            };
                            out.push(ch.ok_or_else(|| wire_err("JSON: lone surrogate"))?);
                        }
                        _ => return Err(wire_err("JSON: bad escape")),
                    }
                }
                _ => return Err(wire_err("JSON: unterminated string or control character")),
            }
        }
    }
}

/// A whole JSON message (UTF-8, no BOM; whitespace around the value only).
pub fn parse_json(data: &[u8]) -> Result<Value> {
    let mut reader = JsonReader { data, pos: 0 };
    let value = reader.value(0)?;
    reader.skip_ws();
    if reader.pos != data.len() {
        return Err(wire_err("JSON: extra data"));
    }
    Ok(value)
}

pub fn parse(data: &[u8], binary: bool) -> Result<Value> {
    if binary {
        parse_msgpack(data)
    } else {
        parse_json(data)
    }
}

// ---- message kinds (wire.py's dataclasses, field by field) ----------------------------------

/// A field's type as wire.py annotates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Str,
    Int,
    Bool,
    Float,
    Bytes,
    Headers,
}

/// An absent field's value (None when required: absence is an error).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Absent {
    Required,
    Null,
    Int(i64),
    Bool(bool),
    Float(f64),
    EmptyHeaders,
}

pub struct FieldSpec {
    /// the Python attribute
    pub attr: &'static str,
    /// the camelCase wire name
    pub wire: &'static str,
    pub kind: Kind,
    pub optional: bool,
    pub absent: Absent,
}

const fn f(
    attr: &'static str,
    wire: &'static str,
    kind: Kind,
    optional: bool,
    absent: Absent,
) -> FieldSpec {
    FieldSpec {
        attr,
        wire,
        kind,
        optional,
        absent,
    }
}

use Absent as D;
use Kind as K;

/// wire.py's ClientRequest
pub const CLIENT_REQUEST: &[FieldSpec] = &[
    f("request_id", "requestId", K::Str, false, D::Required),
    f(
        "request_origin_id",
        "requestOriginId",
        K::Str,
        false,
        D::Required,
    ),
    f("target", "target", K::Str, false, D::Required),
    f("tenant_name", "tenantName", K::Str, false, D::Required),
    f("http_method", "httpMethod", K::Str, false, D::Required),
    f("url", "url", K::Str, false, D::Required),
    f(
        "http_headers",
        "httpHeaders",
        K::Headers,
        false,
        D::EmptyHeaders,
    ),
    f(
        "acknowledge_mode",
        "acknowledgeMode",
        K::Int,
        false,
        D::Int(0),
    ),
    f(
        "acknowledge_origin_id",
        "acknowledgeOriginId",
        K::Str,
        true,
        D::Null,
    ),
    f(
        "original_body_size",
        "originalBodySize",
        K::Int,
        false,
        D::Int(0),
    ),
    f("body_size", "bodySize", K::Int, false, D::Int(0)),
    f("body_content", "bodyContent", K::Bytes, true, D::Null),
    f(
        "enable_tracing",
        "enableTracing",
        K::Bool,
        false,
        D::Bool(false),
    ),
    f(
        "discard_connector_response",
        "discardConnectorResponse",
        K::Bool,
        false,
        D::Bool(false),
    ),
    f("expires_in", "expiresIn", K::Int, true, D::Null),
    f("acknowledge_url", "acknowledgeUrl", K::Str, true, D::Null),
];

/// wire.py's TargetResponse
pub const TARGET_RESPONSE: &[FieldSpec] = &[
    f("request_id", "requestId", K::Str, false, D::Required),
    f(
        "request_origin_id",
        "requestOriginId",
        K::Str,
        false,
        D::Required,
    ),
    f(
        "http_status_code",
        "httpStatusCode",
        K::Int,
        false,
        D::Required,
    ),
    f(
        "http_headers",
        "httpHeaders",
        K::Headers,
        false,
        D::EmptyHeaders,
    ),
    f(
        "original_body_size",
        "originalBodySize",
        K::Int,
        false,
        D::Int(0),
    ),
    f("body_size", "bodySize", K::Int, false, D::Int(0)),
    f("body_content", "bodyContent", K::Bytes, true, D::Null),
    f(
        "request_failed",
        "requestFailed",
        K::Bool,
        false,
        D::Bool(false),
    ),
    f("request_start", "requestStart", K::Str, true, D::Null),
    f("request_duration", "requestDuration", K::Str, true, D::Null),
    f("connection_id", "connectionId", K::Str, true, D::Null),
];

/// wire.py's AcknowledgeRequest
pub const ACKNOWLEDGE_REQUEST: &[FieldSpec] = &[
    f("origin_id", "originId", K::Str, false, D::Required),
    f("request_id", "requestId", K::Str, false, D::Required),
    f(
        "remove_request_body_content",
        "removeRequestBodyContent",
        K::Bool,
        false,
        D::Bool(true),
    ),
];

/// wire.py's TenantConfig
pub const TENANT_CONFIG: &[FieldSpec] = &[
    f(
        "keep_alive_interval",
        "keepAliveInterval",
        K::Float,
        false,
        D::Float(15.0),
    ),
    f(
        "enable_tracing",
        "enableTracing",
        K::Bool,
        false,
        D::Bool(false),
    ),
    f(
        "reconnect_minimum_delay",
        "reconnectMinimumDelay",
        K::Float,
        false,
        D::Float(30.0),
    ),
    f(
        "reconnect_maximum_delay",
        "reconnectMaximumDelay",
        K::Float,
        false,
        D::Float(300.0),
    ),
];

/// wire.py's ErrorMessage
pub const ERROR_MESSAGE: &[FieldSpec] = &[f("message", "message", K::Str, false, D::Required)];

/// (invocation target name, fields) of every message kind
pub const KINDS: &[(&str, &[FieldSpec])] = &[
    ("RequestTarget", CLIENT_REQUEST),
    ("Deliver", TARGET_RESPONSE),
    ("Acknowledge", ACKNOWLEDGE_REQUEST),
    ("Configure", TENANT_CONFIG),
    ("Error", ERROR_MESSAGE),
];

/// A field's decoded value, checked against its kind (wire.py's `_check` rules).
#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    Null,
    Str(String),
    Int(i64),
    Bool(bool),
    Float(f64),
    Bytes(Vec<u8>),
    /// names in first-seen order (a dict: a repeated name keeps its place, takes the last list)
    Headers(Vec<(String, Vec<String>)>),
}

fn check(spec: &FieldSpec, value: Option<&Value>, binary: bool) -> Result<FieldValue> {
    let Some(value) = value else {
        return match spec.absent {
            D::Required => Err(wire_err(format!("{} is missing", spec.wire))),
            D::Null => Ok(FieldValue::Null),
            D::Int(v) => Ok(FieldValue::Int(v)),
            D::Bool(v) => Ok(FieldValue::Bool(v)),
            D::Float(v) => Ok(FieldValue::Float(v)),
            D::EmptyHeaders => Ok(FieldValue::Headers(Vec::new())),
        };
    };
    let bad = || wire_err(format!("{} has the wrong type", spec.wire));
    match (spec.kind, value) {
        (_, Value::Null) if spec.optional => Ok(FieldValue::Null),
        (K::Str, Value::Str(s)) => Ok(FieldValue::Str(s.clone())),
        (K::Int, Value::Int(v)) => Ok(FieldValue::Int(*v)),
        (K::Bool, Value::Bool(v)) => Ok(FieldValue::Bool(*v)),
        (K::Float, Value::Float(v)) => Ok(FieldValue::Float(*v)),
        (K::Float, Value::Int(v)) => Ok(FieldValue::Float(*v as f64)),
        (K::Bytes, Value::Bytes(b)) if binary => Ok(FieldValue::Bytes(b.clone())),
        (K::Bytes, Value::Str(s)) if !binary => base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(FieldValue::Bytes)
            .map_err(|_| wire_err(format!("{} is not valid base64", spec.wire))),
        (K::Headers, Value::Map(entries)) => {
            let mut headers: Vec<(String, Vec<String>)> = Vec::with_capacity(entries.len());
            for (name, values) in entries {
                let Value::Array(items) = values else {
                    return Err(bad());
                };
                let mut list = Vec::with_capacity(items.len());
                for item in items {
                    let Value::Str(s) = item else {
                        return Err(bad());
                    };
                    list.push(s.clone());
                }
                match headers.iter_mut().find(|(n, _)| n == name) {
                    Some(slot) => slot.1 = list,
                    None => headers.push((name.clone(), list)),
                }
            }
            Ok(FieldValue::Headers(headers))
        }
        _ => Err(bad()),
    }
}

/// One message: its kind's name and its fields in wire.py's dataclass order.
pub fn decode(data: &[u8], binary: bool) -> Result<(&'static str, Vec<FieldValue>)> {
    let invocation = parse(data, binary)?;
    let Some(Value::Str(name)) = invocation.get("target") else {
        return Err(wire_err("no message target"));
    };
    let Some(&(kind, specs)) = KINDS.iter().find(|(k, _)| k == name) else {
        return Err(wire_err(format!("unknown message target {name:?}")));
    };
    let Some(Value::Array(arguments)) = invocation.get("arguments") else {
        return Err(wire_err("arguments must be a list of one object"));
    };
    let [argument @ Value::Map(_)] = arguments.as_slice() else {
        return Err(wire_err("arguments must be a list of one object"));
    };
    let fields = specs
        .iter()
        .map(|spec| check(spec, argument.get(spec.wire), binary))
        .collect::<Result<Vec<_>>>()?;
    Ok((kind, fields))
}

// ---- the connector's borrowing decoder (msgpack RequestTarget) ------------------------------

/// One msgpack item as its head shows it: scalars whole, strings and binaries as slices of
/// the message, containers as their length and the bytes after their head.
#[derive(Debug, Clone, Copy)]
enum Raw<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    Array(usize, &'a [u8]),
    Map(usize, &'a [u8]),
}

fn mp_take(data: &[u8], n: usize) -> Result<(&[u8], &[u8])> {
    if data.len() < n {
        return Err(wire_err("msgpack truncated"));
    }
    Ok(data.split_at(n))
}

fn mp_be(data: &[u8], n: usize) -> Result<(u64, &[u8])> {
    let (head, rest) = mp_take(data, n)?;
    Ok((
        head.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        rest,
    ))
}

/// The head of the item at the front of `data` and what follows it (for a container, its
/// items); the same checks as `msgpack_value` makes at this level.
fn mp_head(data: &[u8]) -> Result<(Raw<'_>, &[u8])> {
    mp_head_as::<true>(data)
}

/// `mp_head` on bytes a checking walk (`mp_skip`) went over already: its strs are not
/// validated as UTF-8 again. Why: `decode_ref` walks a message's fields up to four times
/// (structure, field slices, header types, header values), and validating every str each
/// time was the largest part of decoding a request in the connector (perf: `from_utf8`
/// 3.6% of its CPU). Only for slices of a message `mp_skip` accepted whole.
fn mp_head_known(data: &[u8]) -> Result<(Raw<'_>, &[u8])> {
    mp_head_as::<false>(data)
}

/// A msgpack str's bytes as a str: the short ASCII names and values of the tunnel's messages
/// checked inline (`is_ascii` reads a word at a time) before the general validation.
#[inline(always)]
fn mp_utf8(s: &[u8]) -> Result<&str> {
    if s.is_ascii() {
        // SAFETY: ASCII is UTF-8
        return Ok(unsafe { std::str::from_utf8_unchecked(s) });
    }
    std::str::from_utf8(s).map_err(|_| wire_err("msgpack str is not UTF-8"))
}

#[inline(always)]
fn mp_head_as<const VALIDATE: bool>(data: &[u8]) -> Result<(Raw<'_>, &[u8])> {
    let (&tag, rest) = data
        .split_first()
        .ok_or_else(|| wire_err("msgpack truncated"))?;
    Ok(match tag {
        0x00..=0x7f => (Raw::Int(i64::from(tag)), rest),
        0xe0..=0xff => (Raw::Int(i64::from(tag as i8)), rest),
        0xc0 => (Raw::Null, rest),
        0xc2 => (Raw::Bool(false), rest),
        0xc3 => (Raw::Bool(true), rest),
        0xa0..=0xbf | 0xd9..=0xdb => {
            let (len, rest) = match tag {
                0xd9 => mp_be(rest, 1)?,
                0xda => mp_be(rest, 2)?,
                0xdb => mp_be(rest, 4)?,
                _ => (u64::from(tag & 0x1f), rest),
            };
            let (s, rest) = mp_take(rest, len as usize)?;
            let s = if VALIDATE {
                mp_utf8(s)?
            } else {
                // SAFETY: `mp_head_known` is only given bytes a validating walk (`mp_skip`,
                // which validated this very str) accepted; the slice is borrowed, unchanged
                unsafe { std::str::from_utf8_unchecked(s) }
            };
            (Raw::Str(s), rest)
        }
        0xc4..=0xc6 => {
            let (len, rest) = mp_be(rest, 1 << (tag - 0xc4))?;
            let (b, rest) = mp_take(rest, len as usize)?;
            (Raw::Bytes(b), rest)
        }
        0xcc..=0xcf => {
            let (v, rest) = mp_be(rest, 1 << (tag - 0xcc))?;
            let v = i64::try_from(v).map_err(|_| wire_err("integer beyond 64 bits"))?;
            (Raw::Int(v), rest)
        }
        0xd0..=0xd3 => {
            let n = 1usize << (tag - 0xd0);
            let (v, rest) = mp_be(rest, n)?;
            let shift = 64 - 8 * n as u32;
            (Raw::Int(((v << shift) as i64) >> shift), rest)
        }
        0xca => {
            let (v, rest) = mp_be(rest, 4)?;
            (Raw::Float(f64::from(f32::from_bits(v as u32))), rest)
        }
        0xcb => {
            let (v, rest) = mp_be(rest, 8)?;
            (Raw::Float(f64::from_bits(v)), rest)
        }
        0x90..=0x9f | 0xdc | 0xdd | 0x80..=0x8f | 0xde | 0xdf => {
            let map = matches!(tag, 0x80..=0x8f | 0xde | 0xdf);
            let (len, rest) = match tag {
                0xdc | 0xde => mp_be(rest, 2)?,
                0xdd | 0xdf => mp_be(rest, 4)?,
                _ => (u64::from(tag & 0x0f), rest),
            };
            if len as usize > rest.len() {
                return Err(wire_err("msgpack truncated"));
            }
            if map {
                (Raw::Map(len as usize, rest), rest)
            } else {
                (Raw::Array(len as usize, rest), rest)
            }
        }
        _ => return Err(wire_err(format!("msgpack type 0x{tag:02x} not taken here"))),
    })
}

/// A map key at `depth`: a str, checked as `msgpack_value` checks it.
fn mp_key(data: &[u8], depth: usize) -> Result<(&str, &[u8])> {
    mp_key_as::<true>(data, depth)
}

/// `mp_key` (`VALIDATE`) or, on bytes a checking walk accepted, its `mp_head_known` twin.
fn mp_key_as<const VALIDATE: bool>(data: &[u8], depth: usize) -> Result<(&str, &[u8])> {
    if depth > MAX_DEPTH {
        return Err(wire_err("msgpack nested too deep"));
    }
    match mp_head_as::<VALIDATE>(data)? {
        (Raw::Str(key), rest) => Ok((key, rest)),
        // refused, as `msgpack_value` refuses it (after walking it: an error either way)
        _ => Err(wire_err("msgpack map key is not a str")),
    }
}

/// Past the item at the front of `data`, checking it as `msgpack_value` would, without
/// building it.
fn mp_skip(data: &[u8], depth: usize) -> Result<&[u8]> {
    mp_skip_as::<true>(data, depth)
}

/// `mp_skip` (`VALIDATE`) or, on bytes a checking walk accepted, past an item without
/// validating its strs again (`mp_head_known`).
fn mp_skip_as<const VALIDATE: bool>(data: &[u8], depth: usize) -> Result<&[u8]> {
    if depth > MAX_DEPTH {
        return Err(wire_err("msgpack nested too deep"));
    }
    let (raw, mut rest) = mp_head_as::<VALIDATE>(data)?;
    match raw {
        Raw::Array(len, _) => {
            for _ in 0..len {
                rest = mp_skip_as::<VALIDATE>(rest, depth + 1)?;
            }
        }
        Raw::Map(len, _) => {
            for _ in 0..len {
                let (_, after) = mp_key_as::<VALIDATE>(rest, depth + 1)?;
                rest = mp_skip_as::<VALIDATE>(after, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(rest)
}

/// A checked field of a borrowed `RequestTarget` (`FieldValue` without the copies).
#[derive(Debug, Clone, PartialEq)]
pub enum FieldRef<'a> {
    Null,
    Str(&'a str),
    Int(i64),
    Bool(bool),
    Float(f64),
    Bytes(&'a [u8]),
    /// names in first-seen order, each with its (last) array of values, as checked strs
    Headers(Vec<(&'a str, HeaderValues<'a>)>),
}

/// A header's values: a checked msgpack array of strs, read in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderValues<'a> {
    len: usize,
    items: &'a [u8],
}

impl<'a> Iterator for HeaderValues<'a> {
    type Item = &'a str;
    fn next(&mut self) -> Option<&'a str> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        match mp_head_known(self.items) {
            Ok((Raw::Str(s), rest)) => {
                self.items = rest;
                Some(s)
            }
            _ => None, // not reached: checked when the field was decoded
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len, Some(self.len))
    }
}

impl ExactSizeIterator for HeaderValues<'_> {}

impl FieldRef<'_> {
    /// The owned value `decode` gives (for tests and the Python path).
    pub fn to_owned_value(&self) -> FieldValue {
        match self {
            FieldRef::Null => FieldValue::Null,
            FieldRef::Str(s) => FieldValue::Str((*s).to_owned()),
            FieldRef::Int(v) => FieldValue::Int(*v),
            FieldRef::Bool(v) => FieldValue::Bool(*v),
            FieldRef::Float(v) => FieldValue::Float(*v),
            FieldRef::Bytes(b) => FieldValue::Bytes(b.to_vec()),
            FieldRef::Headers(h) => FieldValue::Headers(
                h.iter()
                    .map(|(n, v)| ((*n).to_owned(), v.map(str::to_owned).collect()))
                    .collect(),
            ),
        }
    }
}

/// `check` on a field's msgpack bytes (already walked, and its strs validated, by `mp_skip`).
fn check_ref<'a>(spec: &FieldSpec, value: Option<&'a [u8]>) -> Result<FieldRef<'a>> {
    let Some(value) = value else {
        return match spec.absent {
            D::Required => Err(wire_err(format!("{} is missing", spec.wire))),
            D::Null => Ok(FieldRef::Null),
            D::Int(v) => Ok(FieldRef::Int(v)),
            D::Bool(v) => Ok(FieldRef::Bool(v)),
            D::Float(v) => Ok(FieldRef::Float(v)),
            D::EmptyHeaders => Ok(FieldRef::Headers(Vec::new())),
        };
    };
    let bad = || wire_err(format!("{} has the wrong type", spec.wire));
    let (raw, _) = mp_head_known(value)?;
    match (spec.kind, raw) {
        (_, Raw::Null) if spec.optional => Ok(FieldRef::Null),
        (K::Str, Raw::Str(s)) => Ok(FieldRef::Str(s)),
        (K::Int, Raw::Int(v)) => Ok(FieldRef::Int(v)),
        (K::Bool, Raw::Bool(v)) => Ok(FieldRef::Bool(v)),
        (K::Float, Raw::Float(v)) => Ok(FieldRef::Float(v)),
        (K::Float, Raw::Int(v)) => Ok(FieldRef::Float(v as f64)),
        (K::Bytes, Raw::Bytes(b)) => Ok(FieldRef::Bytes(b)),
        (K::Headers, Raw::Map(len, mut rest)) => {
            let mut headers: Vec<(&str, HeaderValues<'_>)> = Vec::with_capacity(len);
            for _ in 0..len {
                let (name, after) = mp_key_as::<false>(rest, 0)?;
                let (Raw::Array(n, items), _) = mp_head_known(after)? else {
                    return Err(bad());
                };
                let mut at = items;
                for _ in 0..n {
                    let (Raw::Str(_), next) = mp_head_known(at)? else {
                        return Err(bad());
                    };
                    at = next;
                }
                let list = HeaderValues { len: n, items };
                match headers.iter_mut().find(|(h, _)| *h == name) {
                    Some(slot) => slot.1 = list,
                    None => headers.push((name, list)),
                }
                rest = at;
            }
            Ok(FieldRef::Headers(headers))
        }
        _ => Err(bad()),
    }
}

/// A msgpack message's kind and fields in wire.py's dataclass order, as slices of `data`:
/// what `decode(data, true)` gives, without its value tree and copies; an error for every
/// message it refuses (property tested against it).
pub fn decode_ref(data: &[u8]) -> Result<(&'static str, Vec<FieldRef<'_>>)> {
    let (Raw::Map(len, mut rest), _) = mp_head(data)? else {
        mp_skip(data, 0)?;
        return Err(wire_err("no message target"));
    };
    let mut target = None;
    let mut arguments = None;
    for _ in 0..len {
        let (key, after) = mp_key(rest, 1)?;
        rest = mp_skip(after, 1)?;
        let value = &after[..after.len() - rest.len()];
        match key {
            "target" => target = Some(value),
            "arguments" => arguments = Some(value),
            _ => {}
        }
    }
    if !rest.is_empty() {
        return Err(wire_err("msgpack: extra data"));
    }
    // the whole message is walked and checked: what follows reads it without checking again
    let Some(Ok((Raw::Str(name), _))) = target.map(mp_head_known) else {
        return Err(wire_err("no message target"));
    };
    let Some(&(kind, specs)) = KINDS.iter().find(|(k, _)| *k == name) else {
        return Err(wire_err(format!("unknown message target {name:?}")));
    };
    let one_object = || wire_err("arguments must be a list of one object");
    let Some((Raw::Array(1, item), _)) = arguments.map(mp_head_known).transpose()? else {
        return Err(one_object());
    };
    let (Raw::Map(len, mut rest), _) = mp_head_known(item)? else {
        return Err(one_object());
    };
    // every kind has at most 16 fields (CLIENT_REQUEST, the largest)
    let mut found: [Option<&[u8]>; CLIENT_REQUEST.len()] = [None; CLIENT_REQUEST.len()];
    for _ in 0..len {
        let (key, after) = mp_key_as::<false>(rest, 0)?;
        rest = mp_skip_as::<false>(after, 0)?;
        if let Some(i) = specs.iter().position(|s| s.wire == key) {
            found[i] = Some(&after[..after.len() - rest.len()]);
        }
    }
    let fields = specs
        .iter()
        .zip(found)
        .map(|(spec, value)| check_ref(spec, value))
        .collect::<Result<Vec<_>>>()?;
    Ok((kind, fields))
}

/// A msgpack `RequestTarget` as `decode_ref` reads it; an error for any other kind.
pub fn decode_request_target(data: &[u8]) -> Result<Vec<FieldRef<'_>>> {
    match decode_ref(data)? {
        ("RequestTarget", fields) => Ok(fields),
        (kind, _) => Err(wire_err(format!("not a RequestTarget: {kind}"))),
    }
}

/// A decoded `Deliver` (wire.py's TargetResponse), for the relay's native path.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetResponse {
    pub request_id: String,
    pub http_status_code: i64,
    pub http_headers: Vec<(String, Vec<String>)>,
    pub body_size: i64,
    pub body_content: Option<Vec<u8>>,
    pub request_failed: bool,
}

/// `data` as a `Deliver` message, or an error (any other kind included).
pub fn decode_deliver(data: &[u8], binary: bool) -> Result<TargetResponse> {
    let (kind, fields) = decode(data, binary)?;
    if kind != "Deliver" {
        return Err(wire_err(format!("not a Deliver: {kind}")));
    }
    let mut it = fields.into_iter();
    let mut next = || it.next().unwrap_or(FieldValue::Null);
    let FieldValue::Str(request_id) = next() else {
        return Err(wire_err("requestId"));
    };
    next(); // requestOriginId
    let FieldValue::Int(http_status_code) = next() else {
        return Err(wire_err("httpStatusCode"));
    };
    let FieldValue::Headers(http_headers) = next() else {
        return Err(wire_err("httpHeaders"));
    };
    next(); // originalBodySize
    let FieldValue::Int(body_size) = next() else {
        return Err(wire_err("bodySize"));
    };
    let body_content = match next() {
        FieldValue::Bytes(b) => Some(b),
        _ => None,
    };
    let FieldValue::Bool(request_failed) = next() else {
        return Err(wire_err("requestFailed"));
    };
    Ok(TargetResponse {
        request_id,
        http_status_code,
        http_headers,
        body_size,
        body_content,
        request_failed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>(
        headers: &'a [(String, Vec<String>)],
        body: Option<&'a [u8]>,
    ) -> ClientRequestRef<'a> {
        ClientRequestRef {
            request_id: "r1",
            request_origin_id: "o",
            target: "api",
            tenant_name: "acme",
            http_method: "GET",
            url: "v1?x=1",
            http_headers: headers,
            acknowledge_mode: 0,
            acknowledge_origin_id: Some("o"),
            original_body_size: 0,
            body_size: 0,
            body_content: body,
            enable_tracing: false,
            discard_connector_response: false,
            expires_in: Some(119_998),
            acknowledge_url: None,
        }
    }

    #[test]
    fn json_request_golden_bytes() {
        let headers = vec![("accept".to_string(), vec!["*/*".to_string()])];
        let out = encode_client_request(Json::default(), &request(&headers, Some(b"hi")));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            concat!(
                r#"{"target":"RequestTarget","arguments":[{"requestId":"r1","requestOriginId":"o","#,
                r#""target":"api","tenantName":"acme","httpMethod":"GET","url":"v1?x=1","#,
                r#""httpHeaders":{"accept":["*/*"]},"acknowledgeMode":0,"acknowledgeOriginId":"o","#,
                r#""originalBodySize":0,"bodySize":0,"bodyContent":"aGk=","enableTracing":false,"#,
                r#""discardConnectorResponse":false,"expiresIn":119998,"acknowledgeUrl":null}]}"#
            )
        );
    }

    #[test]
    fn msgpack_request_round_trips() {
        let headers = vec![("a".to_string(), vec!["1".to_string(), "2".to_string()])];
        let out = encode_client_request(Msgpack::default(), &request(&headers, None));
        assert_eq!(&out[..2], &[0x82, 0xa6]);
        let (kind, fields) = decode(&out, true).unwrap();
        assert_eq!(kind, "RequestTarget");
        assert_eq!(fields[0], FieldValue::Str("r1".into()));
        assert_eq!(fields[6], FieldValue::Headers(headers));
        assert_eq!(fields[14], FieldValue::Int(119_998));
    }

    #[test]
    fn json_escapes_like_python() {
        let mut out = Vec::new();
        json_string(&mut out, "a\"\\\n\u{1}\u{7f}é😀");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#""a\"\\\n\u0001\u007f\u00e9\ud83d\ude00""#
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (v, s) in [
            (15.0, "15.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
        ] {
            assert_eq!(python_float_repr(v), s);
        }
    }

    #[test]
    fn msgpack_ints_take_the_smallest_form() {
        let cases: [(i64, &[u8]); 6] = [
            (5, &[0x05]),
            (200, &[0xcc, 200]),
            (-1, &[0xff]),
            (-33, &[0xd0, 0xdf]),
            (70000, &[0xce, 0, 1, 0x11, 0x70]),
            (-40000, &[0xd2, 0xff, 0xff, 0x63, 0xc0]),
        ];
        for (v, bytes) in cases {
            let mut m = Msgpack::default();
            m.int(v);
            assert_eq!(m.into_bytes(), bytes);
            assert_eq!(parse_msgpack(bytes).unwrap(), Value::Int(v));
        }
    }

    #[test]
    fn deliver_decodes_from_json() {
        let data = br#"{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o","httpStatusCode":200,"httpHeaders":{"x":["1"],"x":["2","3"]},"bodySize":2,"bodyContent":"aGk="}]}"#;
        let response = decode_deliver(data, false).unwrap();
        assert_eq!(response.http_status_code, 200);
        assert_eq!(response.body_content.as_deref(), Some(&b"hi"[..]));
        assert_eq!(
            response.http_headers,
            vec![("x".into(), vec!["2".into(), "3".into()])]
        );
    }

    /// `decode_request_target` accepts exactly what `decode` accepts as a `RequestTarget`,
    /// with the same fields: encoded requests, then each mutated byte by byte (flips,
    /// truncations, insertions; a fixed-seed xorshift, so a failure reproduces).
    #[test]
    fn borrowing_decoder_matches_decode() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let same = |data: &[u8]| {
            let old = match decode(data, true) {
                Ok(("RequestTarget", fields)) => Some(fields),
                _ => None,
            };
            let new = decode_request_target(data)
                .ok()
                .map(|f| f.iter().map(FieldRef::to_owned_value).collect::<Vec<_>>());
            assert_eq!(old, new, "{data:?}");
            let any_old = decode(data, true).ok();
            let any_new = decode_ref(data).ok().map(|(k, f)| {
                (
                    k,
                    f.iter().map(FieldRef::to_owned_value).collect::<Vec<_>>(),
                )
            });
            assert_eq!(any_old, any_new, "{data:?}");
            old.is_some()
        };
        let mut accepted = 0;
        for case in 0..400 {
            let headers: Vec<(String, Vec<String>)> = (0..case % 6)
                // (non-ASCII values too: mutations cut and flip their multi-byte sequences)
                .map(|i| {
                    (
                        format!("h{}", i % 4),
                        vec![["v", "é"][i % 2].repeat(i); i % 3],
                    )
                })
                .collect();
            let body = vec![b'x'; case % 40];
            let mut r = request(&headers, if case % 3 == 0 { None } else { Some(&body) });
            if case % 5 == 0 {
                r.expires_in = None;
            }
            let out = encode_client_request(Msgpack::default(), &r);
            accepted += usize::from(same(&out));
            for _ in 0..200 {
                let mut m = out.clone();
                let at = (next() as usize) % m.len();
                match next() % 4 {
                    0 => m[at] ^= 1 << (next() % 8),
                    1 => m[at] = next() as u8,
                    2 => m.truncate(at),
                    _ => m.insert(at, next() as u8),
                }
                accepted += usize::from(same(&m));
            }
        }
        let dup = {
            // a repeated key: the last one counts, for the message and for its fields
            let mut m = Msgpack::default();
            m.begin_map(3);
            m.key("target");
            m.str("Deliver");
            m.key("arguments");
            m.begin_array(1);
            m.begin_map(2);
            m.key("requestId");
            m.int(1);
            m.key("requestId");
            m.str("r");
            m.key("target");
            m.str("RequestTarget");
            m.into_bytes()
        };
        same(&dup);
        assert!(accepted > 400, "{accepted}");
        // the other kinds, through decode_ref: a Deliver and a Configure, each mutated
        let mut deliver = Msgpack::default();
        deliver.begin_map(2);
        deliver.key("target");
        deliver.str("Deliver");
        deliver.key("arguments");
        deliver.begin_array(1);
        deliver.begin_map(6);
        deliver.key("requestId");
        deliver.str("r");
        deliver.key("requestOriginId");
        deliver.str("o");
        deliver.key("httpStatusCode");
        deliver.int(200);
        deliver.key("httpHeaders");
        deliver.begin_map(1);
        deliver.key("a");
        deliver.begin_array(1);
        deliver.str("b");
        deliver.key("bodyContent");
        deliver.body(b"hi");
        deliver.key("requestFailed");
        deliver.bool(false);
        let deliver = deliver.into_bytes();
        let mut configure = Msgpack::default();
        configure.begin_map(2);
        configure.key("arguments");
        configure.begin_array(1);
        configure.begin_map(2);
        configure.key("keepAliveInterval");
        configure.int(5);
        configure.key("reconnectMinimumDelay");
        configure.float(0.5);
        configure.key("target");
        configure.str("Configure");
        let configure = configure.into_bytes();
        let mut others = 0;
        for out in [deliver, configure] {
            assert!(decode_ref(&out).is_ok());
            for _ in 0..20_000 {
                let mut m = out.clone();
                let at = (next() as usize) % m.len();
                match next() % 4 {
                    0 => m[at] ^= 1 << (next() % 8),
                    1 => m[at] = next() as u8,
                    2 => m.truncate(at),
                    _ => m.insert(at, next() as u8),
                }
                others += usize::from(same(&m) || decode(&m, true).is_ok());
            }
        }
        assert!(others > 0);
    }

    #[test]
    fn malformed_messages_are_errors() {
        for data in [
            &b""[..],
            b"{",
            b"[]",
            br#"{"target":"Deliver","arguments":[]}"#,
            br#"{"target":"Nope","arguments":[{}]}"#,
            br#"{"target":"Deliver","arguments":[{"requestId":1}]}"#,
            br#"{"target":"Deliver","arguments":[{"requestId":"\ud800","requestOriginId":"o","httpStatusCode":1}]}"#,
            b"{} x",
        ] {
            assert!(matches!(decode(data, false), Err(Error::TunnelWire(_))), "{data:?}");
        }
        assert!(decode(&[0x81, 0xc1], true).is_err());
        let deep = vec![0x91u8; 100];
        assert!(decode(&deep, true).is_err());
    }
}

pub mod py {
    //! `tunnel_encode(message, binary)` and `tunnel_decode(data, binary)` for wire.py.
    use pyo3::prelude::*;
    use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

    use super::{
        begin_invocation, end_invocation, FieldRef, FieldValue, Json, Kind, Msgpack, Sink, KINDS,
    };
    use crate::error::Error;

    fn unsupported(what: &str) -> PyErr {
        Error::TunnelWire(format!("not encoded here: {what}")).into()
    }

    /// Any value wire.py's encoder could meet, by exact type (a subclass is refused: Python
    /// encodes it, perhaps differently).
    fn value<S: Sink>(sink: &mut S, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
        if depth > super::MAX_DEPTH {
            return Err(unsupported("nesting"));
        }
        if obj.is_none() {
            sink.null();
        } else if let Ok(s) = obj.downcast_exact::<PyString>() {
            sink.str(s.to_str()?);
        } else if let Ok(b) = obj.downcast_exact::<PyBool>() {
            sink.bool(b.is_true());
        } else if obj.is_exact_instance_of::<PyInt>() {
            if let Ok(v) = obj.extract::<i64>() {
                sink.int(v);
            } else if let Ok(v) = obj.extract::<u64>() {
                sink.uint(v);
            } else {
                return Err(unsupported("integer beyond 64 bits"));
            }
        } else if let Ok(v) = obj.downcast_exact::<PyFloat>() {
            sink.float(v.value());
        } else if let Ok(d) = obj.downcast_exact::<PyDict>() {
            sink.begin_map(d.len());
            for (k, v) in d.iter() {
                let k = k
                    .downcast_exact::<PyString>()
                    .map_err(|_| unsupported("a non-str key"))?;
                sink.key(k.to_str()?);
                value(sink, &v, depth + 1)?;
            }
            sink.end_map();
        } else if let Ok(l) = obj.downcast_exact::<PyList>() {
            sink.begin_array(l.len());
            for item in l.iter() {
                sink.element();
                value(sink, &item, depth + 1)?;
            }
            sink.end_array();
        } else {
            return Err(unsupported("a value of another type"));
        }
        Ok(())
    }

    /// Every kind's attribute names as Python strings, made once: `getattr(&str)` built a
    /// new string per field and message (17 per RequestTarget, a fifth of this call's cost).
    static ATTRS: pyo3::sync::GILOnceCell<Vec<Vec<Py<PyString>>>> = pyo3::sync::GILOnceCell::new();

    fn encode_with<S: Sink>(mut sink: S, message: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
        let py = message.py();
        let name_attr = pyo3::intern!(py, "NAME");
        let name = message.getattr(name_attr)?;
        let name = name.downcast::<PyString>()?.to_str()?;
        let Some(index) = KINDS.iter().position(|(k, _)| *k == name) else {
            return Err(unsupported("message kind"));
        };
        let (kind, specs) = KINDS[index];
        let attrs = ATTRS.get_or_init(py, || {
            KINDS
                .iter()
                .map(|(_, specs)| {
                    specs
                        .iter()
                        .map(|s| PyString::intern(py, s.attr).unbind())
                        .collect()
                })
                .collect()
        });
        let attrs = &attrs[index];
        begin_invocation(&mut sink, kind);
        sink.begin_map(specs.len());
        for (spec, attr) in specs.iter().zip(attrs) {
            sink.key(spec.wire);
            let v = message.getattr(attr.bind(py))?;
            if spec.kind == Kind::Bytes {
                if let Ok(b) = v.downcast_exact::<PyBytes>() {
                    sink.body(b.as_bytes());
                    continue;
                }
            }
            value(&mut sink, &v, 0)?;
        }
        sink.end_map();
        Ok(end_invocation(sink))
    }

    /// One websocket message: msgpack when `binary`, else UTF-8 JSON; TunnelWireError for a
    /// value this encoder leaves to wire.py.
    #[pyfunction]
    fn tunnel_encode<'py>(
        py: Python<'py>,
        message: &Bound<'py, PyAny>,
        binary: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let out = if binary {
            encode_with(Msgpack::with_capacity(256), message)?
        } else {
            encode_with(Json::with_capacity(384), message)?
        };
        Ok(PyBytes::new(py, &out))
    }

    pub(crate) fn field_object<'py>(py: Python<'py>, v: FieldValue) -> PyResult<Bound<'py, PyAny>> {
        Ok(match v {
            FieldValue::Null => py.None().into_bound(py),
            FieldValue::Str(s) => PyString::new(py, &s).into_any(),
            FieldValue::Int(i) => i.into_pyobject(py)?.into_any(),
            FieldValue::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
            FieldValue::Float(x) => PyFloat::new(py, x).into_any(),
            FieldValue::Bytes(b) => PyBytes::new(py, &b).into_any(),
            FieldValue::Headers(h) => {
                let d = PyDict::new(py);
                for (name, values) in h {
                    d.set_item(name, PyList::new(py, values)?)?;
                }
                d.into_any()
            }
        })
    }

    /// `field_object` of a borrowed field (msgpack: Python objects made from the message's
    /// bytes directly, no Rust copy in between).
    fn field_ref_object<'py>(py: Python<'py>, v: &FieldRef<'_>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match v {
            FieldRef::Null => py.None().into_bound(py),
            FieldRef::Str(s) => PyString::new(py, s).into_any(),
            FieldRef::Int(i) => i.into_pyobject(py)?.into_any(),
            FieldRef::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
            FieldRef::Float(x) => PyFloat::new(py, *x).into_any(),
            FieldRef::Bytes(b) => PyBytes::new(py, b).into_any(),
            FieldRef::Headers(h) => {
                let d = PyDict::new(py);
                for (name, values) in h {
                    d.set_item(name, PyList::new(py, *values)?)?;
                }
                d.into_any()
            }
        })
    }

    /// `(kind name, field values in wire.py's dataclass order)`; TunnelWireError for anything
    /// this decoder leaves to wire.py (which then accepts it or words the exact error).
    #[pyfunction]
    fn tunnel_decode<'py>(
        py: Python<'py>,
        data: &[u8],
        binary: bool,
    ) -> PyResult<(&'static str, Bound<'py, PyTuple>)> {
        if binary {
            let (kind, fields) = super::decode_ref(data)?;
            let objects = fields
                .iter()
                .map(|v| field_ref_object(py, v))
                .collect::<PyResult<Vec<_>>>()?;
            return Ok((kind, PyTuple::new(py, objects)?));
        }
        let (kind, fields) = super::decode(data, binary)?;
        let objects = fields
            .into_iter()
            .map(|v| field_object(py, v))
            .collect::<PyResult<Vec<_>>>()?;
        Ok((kind, PyTuple::new(py, objects)?))
    }

    /// A client request's fields as `httpHeaders`: name -> values (latin-1 text, as
    /// `bytes.decode("latin-1")`), names in first-seen order, without `HOP_BY_HOP`.
    #[pyfunction]
    fn tunnel_request_headers<'py>(
        py: Python<'py>,
        request: PyRef<'py, crate::codec::http::py::HttpRequest>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let headers = PyDict::new(py);
        for (name, value) in request.fields() {
            if super::HOP_BY_HOP.contains(&name.as_str()) {
                continue;
            }
            let text: String = value.iter().map(|b| char::from(*b)).collect();
            match headers.get_item(name)? {
                Some(values) => values.downcast::<PyList>()?.append(text)?,
                None => headers.set_item(name, PyList::new(py, [text])?)?,
            }
        }
        Ok(headers)
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(tunnel_encode, m)?)?;
        m.add_function(wrap_pyfunction!(tunnel_decode, m)?)?;
        m.add_function(wrap_pyfunction!(tunnel_request_headers, m)?)?;
        m.add(
            "TUNNEL_HOP_BY_HOP",
            PyTuple::new(m.py(), super::HOP_BY_HOP)?,
        )?;
        Ok(())
    }
}
