//! The HTTP tunnel's connector messages (spec/tunnel.md, decision 2), JSON and msgpack, both
//! directions: the one codec of the relay and the connector (`dialects/tunnel/wire.py` is its
//! Python face).
//!
//! A message is a SignalR-shaped invocation, `{"target": NAME, "arguments": [OBJECT]}`, whose
//! object holds RelayServer's camelCase wire fields; [`KINDS`] lists each kind's fields with
//! their wire names, types and defaults (the order of wire.py's dataclasses). JSON travels in
//! text frames with bodies as base64, msgpack in binary frames with bodies as bin.
//!
//! Encoding ([`Sink`]: [`Msgpack`], [`Json`]) writes what Python's own libraries write for the
//! same values (`msgpack.Packer(use_bin_type=True)`; `json` with compact separators and
//! `ensure_ascii`, floats as Python's `repr`), so a message has one spelling whoever builds it.
//!
//! Decoding ([`decode_kinds`], [`decode_ref`]) checks the whole message, then every field of
//! its kind, and reads in place: strings, bodies and header values are slices of the message
//! where they can be (a JSON string with escapes and a base64 body are decoded into owned
//! values). JSON is read by the core's JSON reader (`codec/json.rs`). A refused message gets
//! an error that says what is wrong and names the field (`Deliver.httpStatusCode must be int,
//! got str`): the relay sends that text back to the connector in an `Error` message.

use std::borrow::Cow;

use base64::alphabet;
use base64::engine::{GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;

use crate::codec::json;
use crate::error::{Error, Result};

/// Nesting a message may have (an invocation is 4 deep: object, list, object, headers);
/// deeper input is refused before it can exhaust the stack.
pub const MAX_DEPTH: usize = 32;

/// Base64 as Python's `binascii.a2b_base64(strict_mode=True)` reads it: the standard
/// alphabet, canonical padding, and any bits after the last full byte.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

fn wire_err(msg: impl Into<String>) -> Error {
    Error::TunnelWire(msg.into())
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
            .extend_from_slice(json::float_repr(value).as_bytes());
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

// ---- the RequestTarget message, from Rust data --------------------------------------------

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
#[rustfmt::skip]
pub const CLIENT_REQUEST: &[FieldSpec] = &[
    f("request_id", "requestId", K::Str, false, D::Required),
    f("request_origin_id", "requestOriginId", K::Str, false, D::Required),
    f("target", "target", K::Str, false, D::Required),
    f("tenant_name", "tenantName", K::Str, false, D::Required),
    f("http_method", "httpMethod", K::Str, false, D::Required),
    f("url", "url", K::Str, false, D::Required),
    f("http_headers", "httpHeaders", K::Headers, false, D::EmptyHeaders),
    f("acknowledge_mode", "acknowledgeMode", K::Int, false, D::Int(0)),
    f("acknowledge_origin_id", "acknowledgeOriginId", K::Str, true, D::Null),
    f("original_body_size", "originalBodySize", K::Int, false, D::Int(0)),
    f("body_size", "bodySize", K::Int, false, D::Int(0)),
    f("body_content", "bodyContent", K::Bytes, true, D::Null),
    f("enable_tracing", "enableTracing", K::Bool, false, D::Bool(false)),
    f("discard_connector_response", "discardConnectorResponse", K::Bool, false, D::Bool(false)),
    f("expires_in", "expiresIn", K::Int, true, D::Null),
    f("acknowledge_url", "acknowledgeUrl", K::Str, true, D::Null),
];

/// wire.py's TargetResponse
#[rustfmt::skip]
pub const TARGET_RESPONSE: &[FieldSpec] = &[
    f("request_id", "requestId", K::Str, false, D::Required),
    f("request_origin_id", "requestOriginId", K::Str, false, D::Required),
    f("http_status_code", "httpStatusCode", K::Int, false, D::Required),
    f("http_headers", "httpHeaders", K::Headers, false, D::EmptyHeaders),
    f("original_body_size", "originalBodySize", K::Int, false, D::Int(0)),
    f("body_size", "bodySize", K::Int, false, D::Int(0)),
    f("body_content", "bodyContent", K::Bytes, true, D::Null),
    f("request_failed", "requestFailed", K::Bool, false, D::Bool(false)),
    f("request_start", "requestStart", K::Str, true, D::Null),
    f("request_duration", "requestDuration", K::Str, true, D::Null),
    f("connection_id", "connectionId", K::Str, true, D::Null),
];

/// wire.py's AcknowledgeRequest
#[rustfmt::skip]
pub const ACKNOWLEDGE_REQUEST: &[FieldSpec] = &[
    f("origin_id", "originId", K::Str, false, D::Required),
    f("request_id", "requestId", K::Str, false, D::Required),
    f("remove_request_body_content", "removeRequestBodyContent", K::Bool, false, D::Bool(true)),
];

/// wire.py's TenantConfig
#[rustfmt::skip]
pub const TENANT_CONFIG: &[FieldSpec] = &[
    f("keep_alive_interval", "keepAliveInterval", K::Float, false, D::Float(15.0)),
    f("enable_tracing", "enableTracing", K::Bool, false, D::Bool(false)),
    f("reconnect_minimum_delay", "reconnectMinimumDelay", K::Float, false, D::Float(30.0)),
    f("reconnect_maximum_delay", "reconnectMaximumDelay", K::Float, false, D::Float(300.0)),
];

/// wire.py's ErrorMessage
#[rustfmt::skip]
pub const ERROR_MESSAGE: &[FieldSpec] = &[
    f("message", "message", K::Str, false, D::Required),
];

/// (invocation target name, fields) of every message kind
pub const KINDS: &[(&str, &[FieldSpec])] = &[
    ("RequestTarget", CLIENT_REQUEST),
    ("Deliver", TARGET_RESPONSE),
    ("Acknowledge", ACKNOWLEDGE_REQUEST),
    ("Configure", TENANT_CONFIG),
    ("Error", ERROR_MESSAGE),
];

/// The most fields a kind has ([`CLIENT_REQUEST`]'s).
const MAX_FIELDS: usize = 16;

/// A set of message kinds, one bit per entry of [`KINDS`], in its order.
pub type KindSet = u8;
/// Every kind.
pub const ALL_KINDS: KindSet = (1 << KINDS.len()) - 1;

/// The bit of kind `name` in a [`KindSet`] (0 for a name that is no kind).
pub fn kind_bit(name: &str) -> KindSet {
    KINDS
        .iter()
        .position(|(k, _)| *k == name)
        .map_or(0, |i| 1 << i)
}

impl Kind {
    /// The Python type a field of this kind holds (for error texts).
    fn py_name(self) -> &'static str {
        match self {
            K::Str => "str",
            K::Int => "int",
            K::Bool => "bool",
            K::Float => "float",
            K::Bytes => "bytes",
            K::Headers => "Headers",
        }
    }
}

/// A checked field of a decoded message, read in place where it can be.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldRef<'a> {
    Null,
    Str(Cow<'a, str>),
    Int(i64),
    Bool(bool),
    Float(f64),
    Bytes(Cow<'a, [u8]>),
    /// names in first-seen order, each with its (last) list of values: a dict of lists
    Headers(Vec<(Cow<'a, str>, Vec<Cow<'a, str>>)>),
}

/// A field's value, owned (what [`decode`] gives).
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

impl FieldRef<'_> {
    /// The owned value.
    pub fn to_owned_value(&self) -> FieldValue {
        match self {
            FieldRef::Null => FieldValue::Null,
            FieldRef::Str(s) => FieldValue::Str(s.to_string()),
            FieldRef::Int(v) => FieldValue::Int(*v),
            FieldRef::Bool(v) => FieldValue::Bool(*v),
            FieldRef::Float(v) => FieldValue::Float(*v),
            FieldRef::Bytes(b) => FieldValue::Bytes(b.to_vec()),
            FieldRef::Headers(h) => FieldValue::Headers(
                h.iter()
                    .map(|(n, v)| (n.to_string(), v.iter().map(|s| s.to_string()).collect()))
                    .collect(),
            ),
        }
    }

    /// A str field's text (None for any other value).
    pub fn as_str(&self) -> Option<&str> {
        match self {
            FieldRef::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An int field's value (None for any other value).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            FieldRef::Int(v) => Some(*v),
            _ => None,
        }
    }
}

/// A value as the field checks see it, in either format (a container by its length: its items
/// are walked with [`Values::members`] and [`Values::elements`]).
enum View<'a> {
    Null,
    Bool(bool),
    Int(i64),
    /// an integer beyond i64, as its nearest float
    BigInt(f64),
    Float(f64),
    Str(Cow<'a, str>),
    /// a JSON string that is not valid Unicode (a lone surrogate escape)
    BadStr,
    Bytes(&'a [u8]),
    Array(usize),
    Map(usize),
}

impl View<'_> {
    /// The Python type the value decodes to (for error texts).
    fn py_type(&self) -> &'static str {
        match self {
            View::Null => "NoneType",
            View::Bool(_) => "bool",
            View::Int(_) | View::BigInt(_) => "int",
            View::Float(_) => "float",
            View::Str(_) | View::BadStr => "str",
            View::Bytes(_) => "bytes",
            View::Array(_) => "list",
            View::Map(_) => "dict",
        }
    }

    /// Python's `repr` of a scalar, the type for a container (the unknown-target error).
    fn py_repr(&self) -> String {
        match self {
            View::Null => "None".into(),
            View::Bool(b) => if *b { "True" } else { "False" }.into(),
            View::Int(v) => v.to_string(),
            View::Float(v) | View::BigInt(v) => json::float_repr(*v),
            View::Str(s) => str_repr(s),
            other => format!("a {}", other.py_type()),
        }
    }
}

/// Python's `repr` of a str: single quotes unless it holds one and no double quote,
/// backslash escapes for the quote, the backslash and control characters.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\x7f' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// One message's values in one format, checked whole before any is looked at.
trait Values<'a> {
    type Handle: Copy;
    fn view(&self, at: Self::Handle) -> View<'a>;
    /// Each member of the map at `at` in order (its key None when not valid Unicode), while
    /// `each` says go on.
    fn members(
        &self,
        at: Self::Handle,
        each: impl FnMut(Option<Cow<'a, str>>, Self::Handle) -> bool,
    );
    /// Each element of the array at `at` in order, while `each` says go on.
    fn elements(&self, at: Self::Handle, each: impl FnMut(Self::Handle) -> bool);
}

/// A msgpack message; a handle is the bytes from a value's first byte on.
struct MsgpackValues;

impl<'a> Values<'a> for MsgpackValues {
    type Handle = &'a [u8];

    fn view(&self, at: &'a [u8]) -> View<'a> {
        // the whole message was walked and checked (`mp_skip`): read again without checks
        let Ok((raw, _)) = mp_head_known(at) else {
            return View::Null; // not reached
        };
        match raw {
            Raw::Null => View::Null,
            Raw::Bool(b) => View::Bool(b),
            Raw::Int(v) => View::Int(v),
            Raw::BigInt(v) => View::BigInt(v as f64),
            Raw::Float(v) => View::Float(v),
            Raw::Str(s) => View::Str(Cow::Borrowed(s)),
            Raw::Bytes(b) => View::Bytes(b),
            Raw::Array(n, _) => View::Array(n),
            Raw::Map(n, _) => View::Map(n),
        }
    }

    fn members(&self, at: &'a [u8], mut each: impl FnMut(Option<Cow<'a, str>>, &'a [u8]) -> bool) {
        if let Ok((Raw::Map(n, mut rest), _)) = mp_head_known(at) {
            for _ in 0..n {
                let Ok((key, value)) = mp_key_as::<false>(rest, 0) else {
                    return; // not reached
                };
                if !each(Some(Cow::Borrowed(key)), value) {
                    return;
                }
                rest = mp_skip_as::<false>(value, 0).unwrap_or_default();
            }
        }
    }

    fn elements(&self, at: &'a [u8], mut each: impl FnMut(&'a [u8]) -> bool) {
        if let Ok((Raw::Array(n, mut rest), _)) = mp_head_known(at) {
            for _ in 0..n {
                if !each(rest) {
                    return;
                }
                rest = mp_skip_as::<false>(rest, 0).unwrap_or_default();
            }
        }
    }
}

/// A JSON message read once by `codec/json.rs`, item by item, into an index of its values:
/// a handle is a value's place in `nodes`, a container's items a run of `items`.
struct JsonValues<'a> {
    reader: json::Reader<'a>,
    nodes: Vec<JsonNode>,
    items: Vec<JsonItem>,
}

#[derive(Clone, Copy)]
struct JsonNode {
    span: json::Span,
    /// a container's items: `items[first..first + len]`
    first: u32,
    len: u32,
}

#[derive(Clone, Copy)]
struct JsonItem {
    /// a member's key (None in an array)
    key: Option<json::Span>,
    node: u32,
}

impl<'a> JsonValues<'a> {
    /// The whole text checked and indexed in one pass; the top value is the last node.
    fn read(text: &'a [u8]) -> json::Result<Self> {
        let mut nodes = Vec::with_capacity(32);
        let mut items = Vec::with_capacity(32);
        let mut pending = Vec::with_capacity(32);
        let (reader, ()) = json::document_read(text, MAX_DEPTH, |r| {
            Self::index(r, 0, &mut nodes, &mut items, &mut pending).map(|_| ())
        })?;
        Ok(JsonValues {
            reader,
            nodes,
            items,
        })
    }

    fn index(
        r: &mut json::Reader<'a>,
        depth: usize,
        nodes: &mut Vec<JsonNode>,
        items: &mut Vec<JsonItem>,
        pending: &mut Vec<JsonItem>,
    ) -> json::Result<u32> {
        let start = r.at;
        let (kind, object) = match r.text.get(r.at) {
            Some(b'{') => (json::Kind::Obj, true),
            Some(b'[') => (json::Kind::Arr, false),
            _ => {
                let span = r.value(depth)?;
                nodes.push(JsonNode {
                    span,
                    first: 0,
                    len: 0,
                });
                return Ok(nodes.len() as u32 - 1);
            }
        };
        r.enter(depth)?;
        let mark = pending.len();
        let mut first = true;
        loop {
            let key = if object {
                match r.next_member(first)? {
                    Some(key) => Some(key),
                    None => break,
                }
            } else if r.next_element(first)? {
                None
            } else {
                break;
            };
            first = false;
            let node = Self::index(r, depth + 1, nodes, items, pending)?;
            pending.push(JsonItem { key, node });
        }
        let at = items.len() as u32;
        items.extend(pending.drain(mark..));
        nodes.push(JsonNode {
            span: json::Span {
                kind,
                start,
                end: r.at,
            },
            first: at,
            len: items.len() as u32 - at,
        });
        Ok(nodes.len() as u32 - 1)
    }

    fn items_of(&self, at: u32) -> &[JsonItem] {
        let node = self.nodes[at as usize];
        &self.items[node.first as usize..(node.first + node.len) as usize]
    }
}

impl<'a> Values<'a> for JsonValues<'a> {
    type Handle = u32;

    fn view(&self, at: u32) -> View<'a> {
        let r = &self.reader;
        let node = self.nodes[at as usize];
        let span = node.span;
        match span.kind {
            json::Kind::Null => View::Null,
            json::Kind::True => View::Bool(true),
            json::Kind::False => View::Bool(false),
            json::Kind::Int => match json::parse_i64(r, span) {
                Some(v) => View::Int(v),
                None => View::BigInt(json::parse_f64(r.slice(span))),
            },
            json::Kind::Float => View::Float(json::parse_f64(r.slice(span))),
            json::Kind::Str => json::decode_str(r, span).map_or(View::BadStr, View::Str),
            json::Kind::Arr => View::Array(node.len as usize),
            json::Kind::Obj => View::Map(node.len as usize),
        }
    }

    fn members(&self, at: u32, mut each: impl FnMut(Option<Cow<'a, str>>, u32) -> bool) {
        for item in self.items_of(at) {
            let key = item.key.and_then(|k| json::decode_str(&self.reader, k));
            if !each(key, item.node) {
                return;
            }
        }
    }

    fn elements(&self, at: u32, mut each: impl FnMut(u32) -> bool) {
        for item in self.items_of(at) {
            if !each(item.node) {
                return;
            }
        }
    }
}

/// One message of a kind in `expected`: the kind's name and its fields in [`KINDS`] order,
/// read in place (see the module docs); an error whose text says what is wrong.
pub fn decode_kinds(
    data: &[u8],
    binary: bool,
    expected: KindSet,
) -> Result<(&'static str, Vec<FieldRef<'_>>)> {
    if binary {
        if !mp_skip(data, 0)?.is_empty() {
            return Err(mp_err("extra data after the message"));
        }
        return read_message(&MsgpackValues, data, binary, expected);
    }
    // a UTF-8 byte order mark first, as Python's `json.loads` takes it
    let text = data.strip_prefix(b"\xef\xbb\xbf").unwrap_or(data);
    let values = JsonValues::read(text)
        .map_err(|err| wire_err(format!("not JSON: {} at byte {}", err.what, err.at)))?;
    let top = values.nodes.len() as u32 - 1;
    read_message(&values, top, binary, expected)
}

/// [`decode_kinds`] for any kind.
pub fn decode_ref(data: &[u8], binary: bool) -> Result<(&'static str, Vec<FieldRef<'_>>)> {
    decode_kinds(data, binary, ALL_KINDS)
}

/// [`decode_ref`] with owned values.
pub fn decode(data: &[u8], binary: bool) -> Result<(&'static str, Vec<FieldValue>)> {
    let (kind, fields) = decode_ref(data, binary)?;
    Ok((kind, fields.iter().map(FieldRef::to_owned_value).collect()))
}

fn read_message<'a, V: Values<'a>>(
    values: &V,
    top: V::Handle,
    binary: bool,
    expected: KindSet,
) -> Result<(&'static str, Vec<FieldRef<'a>>)> {
    let View::Map(_) = values.view(top) else {
        return Err(wire_err(
            r#"a message must be an object {"target": ..., "arguments": [...]}"#,
        ));
    };
    let (mut target, mut arguments) = (None, None);
    values.members(top, |key, value| {
        match key.as_deref() {
            Some("target") => target = Some(value),
            Some("arguments") => arguments = Some(value),
            _ => {}
        }
        true
    });
    let name = target.map(|at| values.view(at));
    let index = match &name {
        Some(View::Str(name)) => KINDS
            .iter()
            .position(|(k, _)| k == name)
            .filter(|i| expected & (1 << i) != 0),
        _ => None,
    };
    let Some(index) = index else {
        let names: Vec<&str> = KINDS
            .iter()
            .enumerate()
            .filter(|(i, _)| expected & (1 << i) != 0)
            .map(|(_, (k, _))| *k)
            .collect();
        return Err(wire_err(format!(
            "unknown message target {} (expected {})",
            name.map_or_else(|| "None".into(), |n| n.py_repr()),
            names.join(", ")
        )));
    };
    let (kind, specs) = KINDS[index];
    let mut argument = None;
    if let Some(list) = arguments.filter(|at| matches!(values.view(*at), View::Array(1))) {
        values.elements(list, |item| {
            argument = Some(item);
            false
        });
    }
    let Some(argument) = argument else {
        return Err(wire_err(format!(
            "{kind}: arguments must be a list of one object"
        )));
    };
    let View::Map(_) = values.view(argument) else {
        return Err(wire_err(format!("{kind}: the argument must be an object")));
    };
    let mut found: [Option<V::Handle>; MAX_FIELDS] = [None; MAX_FIELDS];
    let mut next = 0; // fields usually come in their order: try the one after the last first
    values.members(argument, |key, value| {
        let Some(key) = key else {
            return true;
        };
        let i = match specs.get(next) {
            Some(spec) if spec.wire == key => Some(next),
            _ => specs.iter().position(|s| s.wire == key),
        };
        if let Some(i) = i {
            found[i] = Some(value); // a repeated key: the last one counts, as in a dict
            next = i + 1;
        }
        true
    });
    let fields = specs
        .iter()
        .zip(found)
        .map(|(spec, value)| check(values, kind, spec, value, binary))
        .collect::<Result<Vec<_>>>()?;
    Ok((kind, fields))
}

/// A field's value checked against its spec.
fn check<'a, V: Values<'a>>(
    values: &V,
    kind: &str,
    spec: &FieldSpec,
    value: Option<V::Handle>,
    binary: bool,
) -> Result<FieldRef<'a>> {
    let err = |what: &str| wire_err(format!("{kind}.{} {what}", spec.wire));
    let Some(value) = value else {
        return match spec.absent {
            D::Required => Err(err("is missing")),
            D::Null => Ok(FieldRef::Null),
            D::Int(v) => Ok(FieldRef::Int(v)),
            D::Bool(v) => Ok(FieldRef::Bool(v)),
            D::Float(v) => Ok(FieldRef::Float(v)),
            D::EmptyHeaders => Ok(FieldRef::Headers(Vec::new())),
        };
    };
    const HEADERS: &str = "must map header names to lists of strings";
    Ok(match (spec.kind, values.view(value)) {
        (_, View::Null) if spec.optional => FieldRef::Null,
        (_, View::Null) => return Err(err("must not be null")),
        (K::Str, View::Str(s)) => FieldRef::Str(s),
        (K::Str, View::BadStr) => return Err(err("is not valid Unicode")),
        (K::Int, View::Int(v)) => FieldRef::Int(v),
        (K::Int, View::BigInt(_)) => return Err(err("is out of range")),
        (K::Bool, View::Bool(v)) => FieldRef::Bool(v),
        (K::Float, View::Float(v) | View::BigInt(v)) => FieldRef::Float(v),
        (K::Float, View::Int(v)) => FieldRef::Float(v as f64),
        (K::Bytes, View::Bytes(b)) if binary => FieldRef::Bytes(Cow::Borrowed(b)),
        (K::Bytes, View::Str(s)) if !binary => match BASE64.decode(s.as_bytes()) {
            Ok(body) => FieldRef::Bytes(Cow::Owned(body)),
            Err(_) => return Err(err("is not valid base64")),
        },
        (K::Bytes, View::BadStr) if !binary => return Err(err("is not valid base64")),
        (K::Headers, View::Map(n)) => headers(values, value, n).ok_or_else(|| err(HEADERS))?,
        (K::Headers, _) => return Err(err(HEADERS)),
        (_, view) => {
            return Err(err(&format!(
                "must be {}, got {}",
                spec.kind.py_name(),
                view.py_type()
            )))
        }
    })
}

/// A headers field: every name a str, every value a list of strs (None otherwise).
fn headers<'a, V: Values<'a>>(values: &V, at: V::Handle, len: usize) -> Option<FieldRef<'a>> {
    let mut out: Vec<(Cow<'a, str>, Vec<Cow<'a, str>>)> = Vec::with_capacity(len);
    let mut ok = true;
    values.members(at, |name, list| {
        let (Some(name), View::Array(n)) = (name, values.view(list)) else {
            ok = false;
            return false;
        };
        let mut texts = Vec::with_capacity(n);
        values.elements(list, |item| match values.view(item) {
            View::Str(text) => {
                texts.push(text);
                true
            }
            _ => {
                ok = false;
                false
            }
        });
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = texts,
            None => out.push((name, texts)),
        }
        ok
    });
    ok.then_some(FieldRef::Headers(out))
}

// ---- msgpack, read in place -----------------------------------------------------------------

fn mp_err(what: &str) -> Error {
    wire_err(format!("not msgpack: {what}"))
}

/// One msgpack item as its head shows it: scalars whole, strings and binaries as slices of
/// the message, containers as their length and the bytes after their head.
#[derive(Debug, Clone, Copy)]
enum Raw<'a> {
    Null,
    Bool(bool),
    Int(i64),
    /// a uint 64 beyond i64
    BigInt(u64),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    Array(usize, &'a [u8]),
    Map(usize, &'a [u8]),
}

fn mp_take(data: &[u8], n: usize) -> Result<(&[u8], &[u8])> {
    if data.len() < n {
        return Err(mp_err("truncated"));
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

/// `mp_head` on bytes a checking walk (`mp_skip`) went over already: its strs are not
/// validated as UTF-8 again (validating each str every time a message is viewed was the
/// largest part of decoding a request in the connector). Only for slices of a message
/// `mp_skip` accepted whole.
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
    std::str::from_utf8(s).map_err(|_| mp_err("a str is not UTF-8"))
}

/// The head of the item at the front of `data` and what follows it (for a container, its
/// items); with `VALIDATE`, its strs are checked UTF-8.
#[inline(always)]
fn mp_head_as<const VALIDATE: bool>(data: &[u8]) -> Result<(Raw<'_>, &[u8])> {
    let (&tag, rest) = data.split_first().ok_or_else(|| mp_err("truncated"))?;
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
            match i64::try_from(v) {
                Ok(v) => (Raw::Int(v), rest),
                Err(_) => (Raw::BigInt(v), rest),
            }
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
                return Err(mp_err("truncated"));
            }
            if map {
                (Raw::Map(len as usize, rest), rest)
            } else {
                (Raw::Array(len as usize, rest), rest)
            }
        }
        _ => return Err(mp_err(&format!("type 0x{tag:02x} is not used here"))),
    })
}

/// A map key at `depth`: a str (`VALIDATE`: checked UTF-8).
fn mp_key_as<const VALIDATE: bool>(data: &[u8], depth: usize) -> Result<(&str, &[u8])> {
    if depth > MAX_DEPTH {
        return Err(mp_err("nested too deeply"));
    }
    match mp_head_as::<VALIDATE>(data)? {
        (Raw::Str(key), rest) => Ok((key, rest)),
        _ => Err(mp_err("a map key is not a str")),
    }
}

/// Past the item at the front of `data`, checking it whole (its strs UTF-8, its map keys
/// strs, its nesting within [`MAX_DEPTH`]) without building it.
fn mp_skip(data: &[u8], depth: usize) -> Result<&[u8]> {
    mp_skip_as::<true>(data, depth)
}

/// `mp_skip`, or (not `VALIDATE`) past an item a checking walk accepted.
fn mp_skip_as<const VALIDATE: bool>(data: &[u8], depth: usize) -> Result<&[u8]> {
    if depth > MAX_DEPTH {
        return Err(mp_err("nested too deeply"));
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

    fn owned(fields: &[FieldRef<'_>]) -> Vec<FieldValue> {
        fields.iter().map(FieldRef::to_owned_value).collect()
    }

    fn error_of(data: &[u8], binary: bool) -> String {
        match decode_ref(data, binary) {
            Err(Error::TunnelWire(text)) => text,
            other => panic!("{other:?}"),
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

    /// Both encodings of one request decode to the same fields, read in place where they can
    /// be: msgpack strings and bodies borrowed, a JSON string borrowed unless it has escapes.
    #[test]
    fn both_formats_decode_to_the_same_fields() {
        let headers = vec![
            ("a".to_string(), vec!["1".to_string(), "2".to_string()]),
            ("b\"é".to_string(), vec!["\u{1}😀".to_string()]),
        ];
        let r = request(&headers, Some(b"\x00\xffbody"));
        let packed = encode_client_request(Msgpack::default(), &r);
        let text = encode_client_request(Json::default(), &r);
        assert_eq!(&packed[..2], &[0x82, 0xa6]);
        let (kind, m) = decode_ref(&packed, true).unwrap();
        let (kind_json, j) = decode_ref(&text, false).unwrap();
        assert_eq!((kind, kind_json), ("RequestTarget", "RequestTarget"));
        assert_eq!(owned(&m), owned(&j));
        assert_eq!(m[6].to_owned_value(), FieldValue::Headers(headers.clone()));
        assert_eq!(m[14], FieldRef::Int(119_998));
        assert!(matches!(&m[0], FieldRef::Str(Cow::Borrowed("r1"))));
        assert!(matches!(&m[11], FieldRef::Bytes(Cow::Borrowed(_))));
        assert!(matches!(&j[0], FieldRef::Str(Cow::Borrowed("r1"))));
        let FieldRef::Headers(h) = &j[6] else {
            panic!()
        };
        assert!(matches!(&h[1].0, Cow::Owned(name) if name == "b\"é"));
        // the owned form is the same
        assert_eq!(decode(&text, false).unwrap().1, owned(&m));
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
            let (Raw::Int(back), rest) = mp_head_as::<true>(bytes).unwrap() else {
                panic!()
            };
            assert_eq!((back, rest.len()), (v, 0));
        }
    }

    /// Absent fields take their defaults, a repeated key its last value, numbers the field's
    /// type where Python's would (an int for a float field), a BOM before JSON is skipped.
    #[test]
    fn defaults_repeats_and_numbers_as_python_reads_them() {
        let data = br#"{"target":"Deliver","arguments":[{"requestId":"r","requestOriginId":"o","httpStatusCode":1,"httpStatusCode":200,"httpHeaders":{"x":["1"],"y":[],"x":["2","3"]},"bodySize":2,"bodyContent":"QR=="}]}"#;
        let (kind, fields) = decode_ref(data, false).unwrap();
        assert_eq!(kind, "Deliver");
        assert_eq!(fields[2], FieldRef::Int(200));
        assert_eq!(
            fields[3].to_owned_value(),
            FieldValue::Headers(vec![
                ("x".into(), vec!["2".into(), "3".into()]),
                ("y".into(), vec![])
            ])
        );
        assert_eq!(fields[4], FieldRef::Int(0)); // originalBodySize: its default
        assert_eq!(fields[6].to_owned_value(), FieldValue::Bytes(b"A".to_vec())); // trailing bits
        assert_eq!(fields[7], FieldRef::Bool(false));
        assert_eq!(fields[8], FieldRef::Null);
        let configure = b"\xef\xbb\xbf{\"target\":\"Configure\",\"arguments\":[{\"keepAliveInterval\":5,\"reconnectMinimumDelay\":1e400}]}";
        let (_, fields) = decode_ref(configure, false).unwrap();
        assert_eq!(fields[0], FieldRef::Float(5.0));
        assert_eq!(fields[2], FieldRef::Float(f64::INFINITY));
        assert_eq!(fields[3], FieldRef::Float(300.0));
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        let deliver = |fields: &str| {
            format!(
                r#"{{"target":"Deliver","arguments":[{{"requestId":"r","requestOriginId":"o",{fields}}}]}}"#
            )
        };
        for (data, text) in [
            ("".to_string(), "not JSON: unexpected input at byte 0"),
            ("{} x".into(), "not JSON: extra data after the value at byte 3"),
            ("[]".into(), r#"a message must be an object {"target": ..., "arguments": [...]}"#),
            (r#"{"arguments":[{}]}"#.into(), "unknown message target None (expected RequestTarget, Deliver, Acknowledge, Configure, Error)"),
            (r#"{"target":"No'pe","arguments":[{}]}"#.into(), r#"unknown message target "No'pe" (expected RequestTarget, Deliver, Acknowledge, Configure, Error)"#),
            (r#"{"target":3}"#.into(), "unknown message target 3 (expected RequestTarget, Deliver, Acknowledge, Configure, Error)"),
            (r#"{"target":"Deliver","arguments":[]}"#.into(), "Deliver: arguments must be a list of one object"),
            (r#"{"target":"Deliver","arguments":[1]}"#.into(), "Deliver: the argument must be an object"),
            (deliver(r#""httpStatusCode":"200""#), "Deliver.httpStatusCode must be int, got str"),
            (deliver(r#""httpStatusCode":true"#), "Deliver.httpStatusCode must be int, got bool"),
            (deliver(r#""httpStatusCode":99999999999999999999"#), "Deliver.httpStatusCode is out of range"),
            (deliver(r#""httpStatusCode":null"#), "Deliver.httpStatusCode must not be null"),
            (deliver(r#""bodySize":1"#), "Deliver.httpStatusCode is missing"),
            (deliver(r#""httpStatusCode":1,"bodyContent":"!!""#), "Deliver.bodyContent is not valid base64"),
            (deliver(r#""httpStatusCode":1,"bodyContent":5"#), "Deliver.bodyContent must be bytes, got int"),
            (deliver(r#""httpStatusCode":1,"httpHeaders":{"x":"1"}"#), "Deliver.httpHeaders must map header names to lists of strings"),
            (deliver(r#""httpStatusCode":1,"httpHeaders":{"x":[null]}"#), "Deliver.httpHeaders must map header names to lists of strings"),
            (deliver(r#""httpStatusCode":1,"connectionId":"\ud800""#), "Deliver.connectionId is not valid Unicode"),
            (r#"{"target":"Configure","arguments":[{"keepAliveInterval":false}]}"#.into(), "Configure.keepAliveInterval must be float, got bool"),
            ("[".repeat(100) + &"]".repeat(100), "not JSON: nested too deeply at byte 33"),
        ] {
            assert_eq!(error_of(data.as_bytes(), false), text, "{data}");
        }
        // msgpack: the same checks, and the format's own refusals
        let mut m = Msgpack::default();
        m.begin_map(2);
        m.key("target");
        m.str("Acknowledge");
        m.key("arguments");
        m.begin_array(1);
        m.begin_map(2);
        m.key("originId");
        m.body(b"o");
        m.key("requestId");
        m.str("r");
        let wrong = m.into_bytes();
        assert_eq!(
            error_of(&wrong, true),
            "Acknowledge.originId must be str, got bytes"
        );
        assert_eq!(
            error_of(&[0x81, 0xc1], true),
            "not msgpack: type 0xc1 is not used here"
        );
        assert_eq!(error_of(&[0x92, 0x01], true), "not msgpack: truncated");
        assert_eq!(
            error_of(&[0x81, 0x01, 0x01], true),
            "not msgpack: a map key is not a str"
        );
        assert_eq!(
            error_of(&[0xc0, 0xc0], true),
            "not msgpack: extra data after the message"
        );
        assert_eq!(
            error_of(&[0xa1, 0xff], true),
            "not msgpack: a str is not UTF-8"
        );
        assert_eq!(
            error_of(&[0x91; 100], true),
            "not msgpack: nested too deeply"
        );
        // a kind not expected reads as an unknown one
        let request = encode_client_request(Msgpack::default(), &request(&[], None));
        let err = decode_kinds(
            &request,
            true,
            kind_bit("Deliver") | kind_bit("Acknowledge"),
        );
        assert_eq!(
            err.unwrap_err(),
            Error::TunnelWire(
                "unknown message target 'RequestTarget' (expected Deliver, Acknowledge)".into()
            )
        );
    }

    /// Encoded requests, then each mutated byte by byte (flips, truncations, insertions; a
    /// fixed-seed xorshift, so a failure reproduces): the decoder never panics, and what it
    /// accepts of a JSON text it accepts of the same message re-encoded as msgpack, field for
    /// field.
    #[test]
    fn mutated_messages_are_refused_or_read_alike() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut accepted = [0usize; 2];
        for case in 0..300 {
            let headers: Vec<(String, Vec<String>)> = (0..case % 6)
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
            for (binary, out) in [
                (true, encode_client_request(Msgpack::default(), &r)),
                (false, encode_client_request(Json::default(), &r)),
            ] {
                assert!(decode_ref(&out, binary).is_ok());
                for _ in 0..150 {
                    let mut m = out.clone();
                    let at = (next() as usize) % m.len();
                    match next() % 4 {
                        0 => m[at] ^= 1 << (next() % 8),
                        1 => m[at] = next() as u8,
                        2 => m.truncate(at),
                        _ => m.insert(at, next() as u8),
                    }
                    let Ok((kind, fields)) = decode_ref(&m, binary) else {
                        continue;
                    };
                    accepted[usize::from(binary)] += 1;
                    if binary || kind != "RequestTarget" {
                        continue;
                    }
                    let values = owned(&fields);
                    let again = reencode(&values);
                    let (_, back) = decode_ref(&again, true).unwrap();
                    assert_eq!(owned(&back), values);
                }
            }
        }
        assert!(accepted.iter().all(|n| *n > 100), "{accepted:?}");
    }

    /// A RequestTarget's decoded fields encoded again as msgpack.
    fn reencode(v: &[FieldValue]) -> Vec<u8> {
        let s = |i: usize| match &v[i] {
            FieldValue::Str(s) => Some(s.as_str()),
            _ => None,
        };
        let n = |i: usize| match v[i] {
            FieldValue::Int(n) => Some(n),
            _ => None,
        };
        let b = |i: usize| matches!(v[i], FieldValue::Bool(true));
        let FieldValue::Headers(headers) = &v[6] else {
            panic!()
        };
        let body = match &v[11] {
            FieldValue::Bytes(b) => Some(b.as_slice()),
            _ => None,
        };
        let r = ClientRequestRef {
            request_id: s(0).unwrap(),
            request_origin_id: s(1).unwrap(),
            target: s(2).unwrap(),
            tenant_name: s(3).unwrap(),
            http_method: s(4).unwrap(),
            url: s(5).unwrap(),
            http_headers: headers,
            acknowledge_mode: n(7).unwrap(),
            acknowledge_origin_id: s(8),
            original_body_size: n(9).unwrap(),
            body_size: n(10).unwrap(),
            body_content: body,
            enable_tracing: b(12),
            discard_connector_response: b(13),
            expires_in: n(14),
            acknowledge_url: s(15),
        };
        encode_client_request(Msgpack::default(), &r)
    }
}

pub mod py {
    //! `tunnel_encode`, `tunnel_decode` and `tunnel_request_headers` for wire.py.
    use pyo3::prelude::*;
    use pyo3::types::{
        PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
    };

    use super::{
        begin_invocation, end_invocation, FieldRef, Json, Kind, KindSet, Msgpack, Sink, ALL_KINDS,
        KINDS,
    };
    use crate::error::Error;

    /// A value of a message's field (the dataclasses hold str, int, float, bool, None, bytes,
    /// and dicts of lists of str); anything else is refused, naming the field.
    fn value<S: Sink>(sink: &mut S, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
        let refuse = |what: &str| -> PyErr { Error::TunnelWire(what.into()).into() };
        if depth > super::MAX_DEPTH {
            return Err(refuse("nested too deeply"));
        }
        if obj.is_none() {
            sink.null();
        } else if let Ok(s) = obj.downcast::<PyString>() {
            sink.str(s.to_str()?);
        } else if let Ok(b) = obj.downcast::<PyBool>() {
            sink.bool(b.is_true());
        } else if obj.is_instance_of::<PyInt>() {
            if let Ok(v) = obj.extract::<i64>() {
                sink.int(v);
            } else if let Ok(v) = obj.extract::<u64>() {
                sink.uint(v);
            } else {
                return Err(refuse("an integer beyond 64 bits"));
            }
        } else if let Ok(v) = obj.downcast::<PyFloat>() {
            sink.float(v.value());
        } else if let Ok(d) = obj.downcast::<PyDict>() {
            sink.begin_map(d.len());
            for (k, v) in d.iter() {
                let k = k
                    .downcast::<PyString>()
                    .map_err(|_| refuse("a key that is not a str"))?;
                sink.key(k.to_str()?);
                value(sink, &v, depth + 1)?;
            }
            sink.end_map();
        } else if let Ok(l) = obj.downcast::<PyList>() {
            sink.begin_array(l.len());
            for item in l.iter() {
                sink.element();
                value(sink, &item, depth + 1)?;
            }
            sink.end_array();
        } else {
            let kind = obj.get_type().name()?;
            return Err(refuse(&format!("a value of type {kind}")));
        }
        Ok(())
    }

    /// Every kind's attribute names as Python strings, made once: `getattr(&str)` built a
    /// new string per field and message (17 per RequestTarget, a fifth of this call's cost).
    static ATTRS: pyo3::sync::GILOnceCell<Vec<Vec<Py<PyString>>>> = pyo3::sync::GILOnceCell::new();

    fn encode_with<S: Sink>(mut sink: S, message: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
        let py = message.py();
        let name = message.getattr(pyo3::intern!(py, "NAME"))?;
        let name = name.downcast::<PyString>()?.to_str()?;
        let Some(index) = KINDS.iter().position(|(k, _)| *k == name) else {
            return Err(Error::TunnelWire(format!("no message kind {name:?}")).into());
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
        begin_invocation(&mut sink, kind);
        sink.begin_map(specs.len());
        for (spec, attr) in specs.iter().zip(&attrs[index]) {
            sink.key(spec.wire);
            let v = message.getattr(attr.bind(py))?;
            if spec.kind == Kind::Bytes {
                if let Ok(b) = v.downcast::<PyBytes>() {
                    sink.body(b.as_bytes());
                    continue;
                }
                if let Ok(b) = v.downcast::<PyByteArray>() {
                    sink.body(&b.to_vec());
                    continue;
                }
            }
            value(&mut sink, &v, 0).map_err(|err| {
                Error::TunnelWire(format!(
                    "cannot encode {kind}.{}: {}",
                    spec.wire,
                    err.value(py)
                ))
            })?;
        }
        sink.end_map();
        Ok(end_invocation(sink))
    }

    /// One websocket message: msgpack when `binary`, else UTF-8 JSON; TunnelWireError for a
    /// field holding a value no message can carry.
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

    /// A decoded field as the Python value wire.py's dataclasses hold.
    fn field_object<'py>(py: Python<'py>, v: &FieldRef<'_>) -> PyResult<Bound<'py, PyAny>> {
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
                    d.set_item(
                        name.as_ref(),
                        PyList::new(py, values.iter().map(|v| v.as_ref()))?,
                    )?;
                }
                d.into_any()
            }
        })
    }

    /// `(kind name, field values in dataclass order)` of a message of a kind in `expected`
    /// (bits in `KINDS` order); TunnelWireError saying what is wrong.
    #[pyfunction]
    #[pyo3(signature = (data, binary, expected = ALL_KINDS), text_signature = "(data, binary, expected=31)")]
    fn tunnel_decode<'py>(
        py: Python<'py>,
        data: &[u8],
        binary: bool,
        expected: KindSet,
    ) -> PyResult<(&'static str, Bound<'py, PyTuple>)> {
        let (kind, fields) = super::decode_kinds(data, binary, expected)?;
        let objects = fields
            .iter()
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
        let kinds: Vec<&str> = KINDS.iter().map(|(k, _)| *k).collect();
        m.add("TUNNEL_KINDS", PyTuple::new(m.py(), kinds)?)?;
        const _: () = assert!(ALL_KINDS == 31); // the text signature's default
        Ok(())
    }
}
