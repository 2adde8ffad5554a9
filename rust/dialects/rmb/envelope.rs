//! RMB envelopes (proto/types.proto) straight from protobuf wire bytes.
//!
//! Two uses, two shapes:
//! - [`scan`] reads only the routing fields a relay looks at, once per relayed message, and
//!   validates the whole message the way rmb-rs's decoder would, without building it: forwarded
//!   bytes are never decoded into an object nor re-encoded.
//! - [`Envelope`] is the full message for the SDK and for envelopes the relay builds itself
//!   (errors, pongs). [`Envelope::encode`] writes fields in rmb-rs's order so our bytes match
//!   its byte for byte: rmb-rs 1.5 serialises with rust-protobuf 3.2, which writes plain fields
//!   in declaration order, then the `message` oneof, then the `payload` oneof.

use crate::error::{Error, Result};
use md5::{Digest, Md5};

// field numbers (proto/types.proto): the wire contract
const F_UID: u32 = 1;
const F_TAGS: u32 = 2;
const F_TIMESTAMP: u32 = 3;
const F_EXPIRATION: u32 = 4;
const F_SOURCE: u32 = 5;
const F_DESTINATION: u32 = 6;
const F_REQUEST: u32 = 7;
const F_RESPONSE: u32 = 8;
const F_SIGNATURE: u32 = 9;
const F_SCHEMA: u32 = 10;
const F_FEDERATION: u32 = 11;
const F_ERROR: u32 = 12;
const F_PLAIN: u32 = 13;
const F_CIPHER: u32 = 14;
const F_PING: u32 = 15;
const F_PONG: u32 = 16;
const F_RELAYS: u32 = 17;

const WT_VARINT: u8 = 0;
const WT_FIXED64: u8 = 1;
const WT_LEN: u8 = 2;
const WT_FIXED32: u8 = 5;

/// defined by rmb-rs (build_error_envelope): relay error envelopes live 300 s
pub const ERROR_ENVELOPE_TTL: u64 = 300;
/// defined by rmb-rs (§2.3): the relay appends this to a ping's payload
pub const PONG_SUFFIX: &[u8] = b"hello world";
/// defined by rmb-rs (has_fail_fast): the tag that asks for an immediate error when offline
pub const FAIL_FAST_TAG: &str = "fail-fast";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kind {
    #[default]
    None = 0,
    Request = 1,
    Response = 2,
    Error = 3,
    Ping = 4,
    Pong = 5,
}

impl Kind {
    pub fn from_int(value: i64) -> Result<Self> {
        Ok(match value {
            0 => Kind::None,
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Error,
            4 => Kind::Ping,
            5 => Kind::Pong,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown message kind {value}"
                )))
            }
        })
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Envelope(msg.into())
}

// ---- wire reading --------------------------------------------------------------------------

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn done(&self) -> bool {
        self.pos >= self.buf.len()
    }

    /// One-byte varints (field keys, short lengths, small numbers) are the common case.
    #[inline]
    fn varint(&mut self) -> Result<u64> {
        if let Some(&byte) = self.buf.get(self.pos) {
            if byte < 0x80 {
                self.pos += 1;
                return Ok(u64::from(byte));
            }
        }
        self.varint_slow()
    }

    fn varint_slow(&mut self) -> Result<u64> {
        let mut value: u64 = 0;
        for i in 0..10 {
            let Some(&byte) = self.buf.get(self.pos) else {
                return Err(bad("truncated varint"));
            };
            self.pos += 1;
            if i == 9 && byte > 1 {
                return Err(bad("varint overflows 64 bits"));
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(bad("varint longer than 10 bytes"))
    }

    /// (field number, wire type)
    #[inline]
    fn key(&mut self) -> Result<(u32, u8)> {
        let key = self.varint()?;
        let field = key >> 3;
        if field == 0 || field > u64::from(u32::MAX >> 3) {
            return Err(bad(format!("invalid field number {field}")));
        }
        Ok((field as u32, (key & 7) as u8))
    }

    #[inline]
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let len = self.varint()?;
        let len = usize::try_from(len).map_err(|_| bad("length too large"))?;
        let end = self
            .pos
            .checked_add(len)
            .filter(|end| *end <= self.buf.len());
        let Some(end) = end else {
            return Err(bad("length-delimited field runs past the end"));
        };
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    #[inline]
    fn string(&mut self, what: &str) -> Result<&'a str> {
        let raw = self.bytes()?;
        std::str::from_utf8(raw).map_err(|_| bad(format!("{what} is not valid UTF-8")))
    }

    fn skip(&mut self, wire: u8) -> Result<()> {
        match wire {
            WT_VARINT => {
                self.varint()?;
            }
            WT_FIXED64 => self.advance(8)?,
            WT_LEN => {
                self.bytes()?;
            }
            WT_FIXED32 => self.advance(4)?,
            other => return Err(bad(format!("unsupported wire type {other}"))),
        }
        Ok(())
    }

    fn advance(&mut self, n: usize) -> Result<()> {
        if self.buf.len() - self.pos < n {
            return Err(bad("truncated fixed-width field"));
        }
        self.pos += n;
        Ok(())
    }
}

fn expect(wire: u8, want: u8, field: &str) -> Result<()> {
    if wire != want {
        return Err(bad(format!(
            "field {field} has wire type {wire}, expected {want}"
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Address {
    pub twin: u32,
    pub connection: Option<String>,
}

/// Merge an Address message into `addr` (protobuf: a repeated submessage merges).
fn merge_address_ref<'a>(data: &'a [u8], twin: &mut u32, conn: &mut Option<&'a str>) -> Result<()> {
    let mut r = Reader::new(data);
    while !r.done() {
        let (field, wire) = r.key()?;
        match field {
            1 => {
                expect(wire, WT_VARINT, "address.twin")?;
                *twin = r.varint()? as u32; // uint32: truncated as rust-protobuf and the protobuf package do
            }
            2 => {
                expect(wire, WT_LEN, "address.connection")?;
                *conn = Some(r.string("address.connection")?);
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(())
}

/// The submessage of the `message` oneof, validated as rmb-rs's decoder would.
fn check_message_body(field: u32, data: &[u8]) -> Result<(Option<&str>, u32, Option<&str>)> {
    let mut command = None;
    let mut code = 0u32;
    let mut message = None;
    let mut r = Reader::new(data);
    while !r.done() {
        let (f, wire) = r.key()?;
        match (field, f) {
            (F_REQUEST, 1) => {
                expect(wire, WT_LEN, "request.command")?;
                command = Some(r.string("request.command")?);
            }
            (F_ERROR, 1) => {
                expect(wire, WT_VARINT, "error.code")?;
                code = r.varint()? as u32;
            }
            (F_ERROR, 2) => {
                expect(wire, WT_LEN, "error.message")?;
                message = Some(r.string("error.message")?);
            }
            _ => r.skip(wire)?,
        }
    }
    Ok((command, code, message))
}

fn kind_of(field: u32) -> Kind {
    match field {
        F_REQUEST => Kind::Request,
        F_RESPONSE => Kind::Response,
        F_ERROR => Kind::Error,
        F_PING => Kind::Ping,
        _ => Kind::Pong,
    }
}

/// The routing fields of an envelope, borrowed from its bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing<'a> {
    pub uid: &'a str,
    pub tags: Option<&'a str>,
    pub timestamp: u64,
    pub expiration: u64,
    pub source_twin: u32,
    pub source_connection: Option<&'a str>,
    pub dest_twin: u32,
    pub dest_connection: Option<&'a str>,
    pub kind: Kind,
}

impl Routing<'_> {
    pub fn fail_fast(&self) -> bool {
        self.tags.is_some_and(|tags| {
            tags.split(|c: char| c == ',' || c.is_whitespace())
                .any(|t| t == FAIL_FAST_TAG)
        })
    }
}

/// Read the routing fields and validate the rest, without building the message.
pub fn scan(data: &[u8]) -> Result<Routing<'_>> {
    let mut out = Routing::default();
    let mut r = Reader::new(data);
    while !r.done() {
        let (field, wire) = r.key()?;
        match field {
            F_UID => {
                expect(wire, WT_LEN, "uid")?;
                out.uid = r.string("uid")?;
            }
            F_TAGS => {
                expect(wire, WT_LEN, "tags")?;
                out.tags = Some(r.string("tags")?);
            }
            F_TIMESTAMP => {
                expect(wire, WT_VARINT, "timestamp")?;
                out.timestamp = r.varint()?;
            }
            F_EXPIRATION => {
                expect(wire, WT_VARINT, "expiration")?;
                out.expiration = r.varint()?;
            }
            F_SOURCE => {
                expect(wire, WT_LEN, "source")?;
                merge_address_ref(r.bytes()?, &mut out.source_twin, &mut out.source_connection)?;
            }
            F_DESTINATION => {
                expect(wire, WT_LEN, "destination")?;
                merge_address_ref(r.bytes()?, &mut out.dest_twin, &mut out.dest_connection)?;
            }
            F_REQUEST | F_RESPONSE | F_ERROR | F_PING | F_PONG => {
                expect(wire, WT_LEN, "message")?;
                check_message_body(field, r.bytes()?)?;
                out.kind = kind_of(field);
            }
            F_SCHEMA | F_FEDERATION | F_RELAYS => {
                expect(wire, WT_LEN, "string field")?;
                r.string("string field")?;
            }
            F_SIGNATURE | F_PLAIN | F_CIPHER => {
                expect(wire, WT_LEN, "bytes field")?;
                r.bytes()?;
            }
            _ => r.skip(wire)?,
        }
    }
    Ok(out)
}

// ---- the full message ----------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Payload {
    #[default]
    None,
    Plain(Vec<u8>),
    Cipher(Vec<u8>),
}

/// A decoded Envelope. `source`/`destination` keep their presence so decode -> encode is exact.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Envelope {
    pub uid: String,
    pub tags: Option<String>,
    pub timestamp: u64,
    pub expiration: u64,
    pub source: Option<Address>,
    pub destination: Option<Address>,
    pub kind: Kind,
    pub command: String,
    pub error_code: u32,
    pub error_message: String,
    pub signature: Option<Vec<u8>>,
    pub schema: Option<String>,
    pub federation: Option<String>,
    pub payload: Payload,
    pub relays: Vec<String>,
}

impl Envelope {
    pub fn decode(data: &[u8]) -> Result<Self> {
        let mut env = Envelope::default();
        let mut r = Reader::new(data);
        while !r.done() {
            let (field, wire) = r.key()?;
            match field {
                F_UID => {
                    expect(wire, WT_LEN, "uid")?;
                    env.uid = r.string("uid")?.to_owned();
                }
                F_TAGS => {
                    expect(wire, WT_LEN, "tags")?;
                    env.tags = Some(r.string("tags")?.to_owned());
                }
                F_TIMESTAMP => {
                    expect(wire, WT_VARINT, "timestamp")?;
                    env.timestamp = r.varint()?;
                }
                F_EXPIRATION => {
                    expect(wire, WT_VARINT, "expiration")?;
                    env.expiration = r.varint()?;
                }
                F_SOURCE | F_DESTINATION => {
                    expect(wire, WT_LEN, "address")?;
                    let slot = if field == F_SOURCE {
                        &mut env.source
                    } else {
                        &mut env.destination
                    };
                    let addr = slot.get_or_insert_with(Address::default);
                    let mut conn = None;
                    merge_address_ref(r.bytes()?, &mut addr.twin, &mut conn)?;
                    if let Some(conn) = conn {
                        addr.connection = Some(conn.to_owned());
                    }
                }
                F_REQUEST | F_RESPONSE | F_ERROR | F_PING | F_PONG => {
                    expect(wire, WT_LEN, "message")?;
                    let (command, code, message) = check_message_body(field, r.bytes()?)?;
                    let kind = kind_of(field);
                    if kind != env.kind {
                        // another oneof member replaces the previous one
                        env.command.clear();
                        env.error_code = 0;
                        env.error_message.clear();
                    }
                    env.kind = kind;
                    if let Some(command) = command {
                        env.command = command.to_owned();
                    }
                    if kind == Kind::Error {
                        env.error_code = if code != 0 { code } else { env.error_code };
                        if let Some(message) = message {
                            env.error_message = message.to_owned();
                        }
                    }
                }
                F_SIGNATURE => {
                    expect(wire, WT_LEN, "signature")?;
                    env.signature = Some(r.bytes()?.to_vec());
                }
                F_SCHEMA => {
                    expect(wire, WT_LEN, "schema")?;
                    env.schema = Some(r.string("schema")?.to_owned());
                }
                F_FEDERATION => {
                    expect(wire, WT_LEN, "federation")?;
                    env.federation = Some(r.string("federation")?.to_owned());
                }
                F_PLAIN => {
                    expect(wire, WT_LEN, "plain")?;
                    env.payload = Payload::Plain(r.bytes()?.to_vec());
                }
                F_CIPHER => {
                    expect(wire, WT_LEN, "cipher")?;
                    env.payload = Payload::Cipher(r.bytes()?.to_vec());
                }
                F_RELAYS => {
                    expect(wire, WT_LEN, "relays")?;
                    env.relays.push(r.string("relays")?.to_owned());
                }
                _ => r.skip(wire)?,
            }
        }
        Ok(env)
    }

    /// Wire bytes in rmb-rs's field order (rust-protobuf 3: declaration order, oneofs last).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.payload_len() + self.uid.len());
        if !self.uid.is_empty() {
            put_bytes(&mut out, F_UID, self.uid.as_bytes());
        }
        if let Some(tags) = &self.tags {
            put_bytes(&mut out, F_TAGS, tags.as_bytes());
        }
        if self.timestamp != 0 {
            put_key(&mut out, F_TIMESTAMP, WT_VARINT);
            put_varint(&mut out, self.timestamp);
        }
        if self.expiration != 0 {
            put_key(&mut out, F_EXPIRATION, WT_VARINT);
            put_varint(&mut out, self.expiration);
        }
        for (field, addr) in [(F_SOURCE, &self.source), (F_DESTINATION, &self.destination)] {
            if let Some(addr) = addr {
                let mut body = Vec::new();
                if addr.twin != 0 {
                    put_key(&mut body, 1, WT_VARINT);
                    put_varint(&mut body, u64::from(addr.twin));
                }
                if let Some(conn) = &addr.connection {
                    put_bytes(&mut body, 2, conn.as_bytes());
                }
                put_bytes(&mut out, field, &body);
            }
        }
        if let Some(sig) = &self.signature {
            put_bytes(&mut out, F_SIGNATURE, sig);
        }
        if let Some(schema) = &self.schema {
            put_bytes(&mut out, F_SCHEMA, schema.as_bytes());
        }
        if let Some(federation) = &self.federation {
            put_bytes(&mut out, F_FEDERATION, federation.as_bytes());
        }
        for relay in &self.relays {
            put_bytes(&mut out, F_RELAYS, relay.as_bytes());
        }
        match self.kind {
            Kind::None => {}
            Kind::Request => {
                let mut body = Vec::new();
                if !self.command.is_empty() {
                    put_bytes(&mut body, 1, self.command.as_bytes());
                }
                put_bytes(&mut out, F_REQUEST, &body);
            }
            Kind::Error => {
                let mut body = Vec::new();
                if self.error_code != 0 {
                    put_key(&mut body, 1, WT_VARINT);
                    put_varint(&mut body, u64::from(self.error_code));
                }
                if !self.error_message.is_empty() {
                    put_bytes(&mut body, 2, self.error_message.as_bytes());
                }
                put_bytes(&mut out, F_ERROR, &body);
            }
            Kind::Response => put_bytes(&mut out, F_RESPONSE, b""),
            Kind::Ping => put_bytes(&mut out, F_PING, b""),
            Kind::Pong => put_bytes(&mut out, F_PONG, b""),
        }
        match &self.payload {
            Payload::None => {}
            Payload::Plain(data) => put_bytes(&mut out, F_PLAIN, data),
            Payload::Cipher(data) => put_bytes(&mut out, F_CIPHER, data),
        }
        out
    }

    fn payload_len(&self) -> usize {
        match &self.payload {
            Payload::None => 0,
            Payload::Plain(d) | Payload::Cipher(d) => d.len(),
        }
    }

    /// MD5 of the signature challenge (spec/rmb.md §2.1).
    pub fn challenge(&self) -> [u8; 16] {
        let mut md5 = Md5::new();
        md5.update(self.uid.as_bytes());
        if let Some(tags) = &self.tags {
            md5.update(tags.as_bytes());
        }
        md5.update(self.timestamp.to_string().as_bytes());
        md5.update(self.expiration.to_string().as_bytes());
        for addr in [&self.source, &self.destination] {
            let twin = addr.as_ref().map_or(0, |a| a.twin);
            md5.update(twin.to_string().as_bytes());
            if let Some(conn) = addr.as_ref().and_then(|a| a.connection.as_ref()) {
                md5.update(conn.as_bytes());
            }
        }
        match self.kind {
            Kind::Request => md5.update(self.command.as_bytes()),
            Kind::Error => {
                md5.update(self.error_code.to_string().as_bytes());
                md5.update(self.error_message.as_bytes());
            }
            _ => {}
        }
        if let Some(schema) = &self.schema {
            md5.update(schema.as_bytes());
        }
        if let Some(federation) = &self.federation {
            md5.update(federation.as_bytes());
        }
        match &self.payload {
            Payload::None => {}
            Payload::Plain(d) | Payload::Cipher(d) => md5.update(d),
        }
        for relay in &self.relays {
            md5.update(relay.as_bytes());
        }
        md5.finalize().into()
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    put_key(out, field, WT_LEN);
    put_varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// rmb-rs's relay error envelope: uid, stamped now, expiration 300, Error{code 0, message},
/// destination the session (when given), no source, no signature, no payload.
pub fn error_envelope(uid: &str, message: &str, now: u64, dest: Option<Address>) -> Vec<u8> {
    Envelope {
        uid: uid.to_owned(),
        timestamp: now,
        expiration: ERROR_ENVELOPE_TTL,
        destination: dest,
        kind: Kind::Error,
        error_message: message.to_owned(),
        ..Envelope::default()
    }
    .encode()
}

/// The relay's answer to an envelope ping (spec/rmb.md §2.3): message = pong, source and
/// destination swapped, `hello world` appended to a plain payload (a cipher one is replaced),
/// everything else kept, not re-signed.
pub fn pong(ping: &[u8]) -> Result<Vec<u8>> {
    let mut env = Envelope::decode(ping)?;
    env.kind = Kind::Pong;
    std::mem::swap(&mut env.source, &mut env.destination);
    env.payload = match std::mem::take(&mut env.payload) {
        Payload::Plain(mut data) => {
            data.extend_from_slice(PONG_SUFFIX);
            Payload::Plain(data)
        }
        _ => Payload::Plain(PONG_SUFFIX.to_vec()),
    };
    Ok(env.encode())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Envelope {
        Envelope {
            uid: "u-1".into(),
            tags: Some("a, fail-fast".into()),
            timestamp: 1_700_000_000,
            expiration: 300,
            source: Some(Address {
                twin: 7,
                connection: Some("s".into()),
            }),
            destination: Some(Address {
                twin: 9,
                connection: None,
            }),
            kind: Kind::Request,
            command: "calc.add".into(),
            signature: Some(vec![b's'; 65]),
            schema: Some("application/json".into()),
            payload: Payload::Plain(b"[1,2]".to_vec()),
            relays: vec!["r1".into()],
            ..Envelope::default()
        }
    }

    #[test]
    fn scan_reads_routing_fields() {
        let bytes = sample().encode();
        let r = scan(&bytes).unwrap();
        assert_eq!(r.uid, "u-1");
        assert_eq!((r.source_twin, r.source_connection), (7, Some("s")));
        assert_eq!((r.dest_twin, r.dest_connection), (9, None));
        assert_eq!(r.kind, Kind::Request);
        assert_eq!((r.timestamp, r.expiration), (1_700_000_000, 300));
        assert!(r.fail_fast());
    }

    #[test]
    fn fail_fast_needs_the_exact_token() {
        for (tags, want) in [
            ("fail-fast", true),
            ("x fail-fast", true),
            ("fail-faster", false),
            ("Fail-Fast", false),
        ] {
            let r = Routing {
                tags: Some(tags),
                ..Routing::default()
            };
            assert_eq!(r.fail_fast(), want, "{tags}");
        }
    }

    #[test]
    fn decode_encode_round_trip() {
        let env = sample();
        let bytes = env.encode();
        assert_eq!(Envelope::decode(&bytes).unwrap(), env);
        assert_eq!(Envelope::decode(&bytes).unwrap().encode(), bytes);
    }

    #[test]
    fn encode_uses_rmb_rs_field_order() {
        let bytes = sample().encode();
        let mut r = Reader::new(&bytes);
        let mut fields = vec![];
        while !r.done() {
            let (f, w) = r.key().unwrap();
            fields.push(f);
            r.skip(w).unwrap();
        }
        assert_eq!(fields, vec![1, 2, 3, 4, 5, 6, 9, 10, 17, 7, 13]);
    }

    #[test]
    fn error_envelope_golden_bytes() {
        let bytes = error_envelope(
            "ab",
            "no",
            5,
            Some(Address {
                twin: 7,
                connection: None,
            }),
        );
        // uid "ab" | timestamp 5 | expiration 300 | destination {twin 7} | error {message "no"}
        let want: Vec<u8> = vec![
            0x0a, 2, b'a', b'b', 0x18, 5, 0x20, 0xac, 0x02, 0x32, 2, 0x08, 7, 0x62, 4, 0x12, 2,
            b'n', b'o',
        ];
        assert_eq!(bytes, want);
    }

    #[test]
    fn pong_swaps_and_appends() {
        let mut ping = sample();
        ping.kind = Kind::Ping;
        let answer = Envelope::decode(&super::pong(&ping.encode()).unwrap()).unwrap();
        assert_eq!(answer.kind, Kind::Pong);
        assert_eq!(answer.source, ping.destination);
        assert_eq!(answer.destination, ping.source);
        assert_eq!(answer.payload, Payload::Plain(b"[1,2]hello world".to_vec()));
        assert_eq!(answer.signature, ping.signature);
        ping.payload = Payload::Cipher(vec![1, 2]);
        let answer = Envelope::decode(&super::pong(&ping.encode()).unwrap()).unwrap();
        assert_eq!(answer.payload, Payload::Plain(PONG_SUFFIX.to_vec()));
    }

    #[test]
    fn malformed_input_is_an_envelope_error() {
        let bytes = sample().encode();
        for cut in 1..bytes.len() {
            // every truncation either parses (cut at a field boundary) or fails cleanly
            let _ = scan(&bytes[..cut]);
        }
        assert!(scan(&[0x0a, 5, b'a']).is_err(), "length past end");
        assert!(scan(&[0x00]).is_err(), "field 0");
        assert!(scan(&[0x08, 1]).is_err(), "uid with varint wire type");
        assert!(scan(&[0x0a, 1, 0xff]).is_err(), "invalid utf-8");
        assert!(scan(&[0x18, 0x80]).is_err(), "truncated varint");
        assert!(scan(&[0x0b]).is_err(), "group wire type");
        assert!(
            scan(&[0x90, 0x01, 0x01]).is_ok(),
            "unknown varint field 18 is skipped"
        );
    }

    #[test]
    fn repeated_address_merges() {
        // source {twin 7} then source {connection "x"}: merged
        let bytes = [0x2a, 2, 0x08, 7, 0x2a, 3, 0x12, 1, b'x'];
        let r = scan(&bytes).unwrap();
        assert_eq!((r.source_twin, r.source_connection), (7, Some("x")));
        let env = Envelope::decode(&bytes).unwrap();
        assert_eq!(
            env.source,
            Some(Address {
                twin: 7,
                connection: Some("x".into())
            })
        );
    }

    #[test]
    fn challenge_covers_fields_in_order() {
        let env = sample();
        let stream = b"u-1a, fail-fast17000000003007s9calc.addapplication/json[1,2]r1";
        let want: [u8; 16] = Md5::digest(stream).into();
        assert_eq!(env.challenge(), want);
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyString};

    use super::{Address, Kind, Payload, Routing};

    /// Routing fields of an envelope. The strings stay in the envelope's own bytes (kept as
    /// offsets) and become Python strings only when read: most messages never need them.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct EnvelopeRouting {
        data: Py<PyBytes>,
        uid: (u32, u32),
        tags_span: Option<(u32, u32)>,
        source_span: Option<(u32, u32)>,
        dest_span: Option<(u32, u32)>,
        #[pyo3(get)]
        fail_fast: bool,
        #[pyo3(get)]
        timestamp: u64,
        #[pyo3(get)]
        expiration: u64,
        #[pyo3(get)]
        source_twin: u32,
        #[pyo3(get)]
        dest_twin: u32,
        #[pyo3(get)]
        kind: i64,
        /// scanned by an `RmbScanner`: the source is exactly its session (twin and sid)
        #[pyo3(get)]
        from_session: bool,
        /// scanned by an `RmbScanner`: the local connection holding the destination
        #[pyo3(get)]
        dest_conn_id: Option<u64>,
        /// index of this message's route record in the scanner's `RecordBuffer` (-1: none)
        #[pyo3(get)]
        pub record: i64,
        /// scanned by an `RmbScanner` with a limiter: the session is over its rate limit
        #[pyo3(get)]
        pub limited: bool,
    }

    /// Where `text` (a slice of `base`, or an empty default) sits in `base`.
    fn span(base: &[u8], text: &str) -> (u32, u32) {
        if text.is_empty() {
            return (0, 0); // e.g. an absent uid: the default "" is not inside `base`
        }
        let start = text.as_ptr() as usize - base.as_ptr() as usize;
        (start as u32, (start + text.len()) as u32)
    }

    impl EnvelopeRouting {
        /// Scan `data` (a Python bytes object) into a routing view of it.
        pub fn scan(data: &Bound<'_, PyBytes>) -> crate::error::Result<Self> {
            let r = super::scan(data.as_bytes())?;
            Ok(Self::new(data, &r, false, None))
        }

        /// The Python view of `r`, which was scanned from `data`'s own bytes (its strings
        /// stay there as offsets); `from_session` and `dest_conn_id` come from the scanner.
        pub fn new(
            data: &Bound<'_, PyBytes>,
            r: &Routing<'_>,
            from_session: bool,
            dest_conn_id: Option<u64>,
        ) -> Self {
            Self::with_base(data, data.as_bytes(), r, from_session, dest_conn_id)
        }

        /// `new` for a scan `r` of `base`, a buffer holding the same bytes as `data` (the
        /// fast path scans the staged copy in an outbox, Python gets a `bytes` copy of it):
        /// the fields' positions are the same in both.
        pub fn with_base(
            data: &Bound<'_, PyBytes>,
            bytes: &[u8],
            r: &Routing<'_>,
            from_session: bool,
            dest_conn_id: Option<u64>,
        ) -> Self {
            debug_assert_eq!(data.as_bytes(), bytes);
            Self {
                from_session,
                dest_conn_id,
                record: -1,
                limited: false,
                uid: span(bytes, r.uid),
                tags_span: r.tags.map(|t| span(bytes, t)),
                source_span: r.source_connection.map(|t| span(bytes, t)),
                dest_span: r.dest_connection.map(|t| span(bytes, t)),
                fail_fast: r.fail_fast(),
                timestamp: r.timestamp,
                expiration: r.expiration,
                source_twin: r.source_twin,
                dest_twin: r.dest_twin,
                kind: r.kind as i64,
                data: data.clone().unbind(),
            }
        }

        fn text<'py>(&self, py: Python<'py>, (start, end): (u32, u32)) -> Bound<'py, PyString> {
            let bytes = self.data.bind(py).as_bytes();
            // validated as UTF-8 by the scan
            let text = std::str::from_utf8(&bytes[start as usize..end as usize]).unwrap_or("");
            PyString::new(py, text)
        }
    }

    #[pymethods]
    impl EnvelopeRouting {
        #[getter]
        fn uid<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
            self.text(py, self.uid)
        }
        #[getter]
        fn tags<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyString>> {
            self.tags_span.map(|s| self.text(py, s))
        }
        #[getter]
        fn source_connection<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyString>> {
            self.source_span.map(|s| self.text(py, s))
        }
        #[getter]
        fn dest_connection<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyString>> {
            self.dest_span.map(|s| self.text(py, s))
        }

        fn __repr__(&self, py: Python<'_>) -> String {
            format!(
                "<EnvelopeRouting uid={:?} kind={} {}:{:?} -> {}:{:?}>",
                self.uid(py).to_string(),
                self.kind,
                self.source_twin,
                self.source_connection(py).map(|s| s.to_string()),
                self.dest_twin,
                self.dest_connection(py).map(|s| s.to_string()),
            )
        }
    }

    #[pyfunction]
    fn scan_envelope(data: &Bound<'_, PyBytes>) -> PyResult<EnvelopeRouting> {
        Ok(EnvelopeRouting::scan(data)?)
    }

    /// A fully decoded Envelope (SDK, relay-built replies).
    #[pyclass(module = "rmb_relay._core")]
    pub struct Envelope {
        inner: super::Envelope,
    }

    fn addr(slot: &mut Option<Address>) -> &mut Address {
        slot.get_or_insert_with(Address::default)
    }

    #[pymethods]
    impl Envelope {
        #[new]
        #[pyo3(signature = (uid = String::new()), text_signature = "(uid='')")]
        fn new(uid: String) -> Self {
            Self {
                inner: super::Envelope {
                    uid,
                    ..super::Envelope::default()
                },
            }
        }

        #[staticmethod]
        fn decode(data: &[u8]) -> PyResult<Self> {
            Ok(Self {
                inner: super::Envelope::decode(data)?,
            })
        }

        fn encode<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.encode())
        }

        fn challenge<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.challenge())
        }

        #[getter]
        fn uid(&self) -> &str {
            &self.inner.uid
        }
        #[setter]
        fn set_uid(&mut self, value: String) {
            self.inner.uid = value;
        }
        #[getter]
        fn tags(&self) -> Option<&str> {
            self.inner.tags.as_deref()
        }
        #[setter]
        fn set_tags(&mut self, value: Option<String>) {
            self.inner.tags = value;
        }
        #[getter]
        fn timestamp(&self) -> u64 {
            self.inner.timestamp
        }
        #[setter]
        fn set_timestamp(&mut self, value: u64) {
            self.inner.timestamp = value;
        }
        #[getter]
        fn expiration(&self) -> u64 {
            self.inner.expiration
        }
        #[setter]
        fn set_expiration(&mut self, value: u64) {
            self.inner.expiration = value;
        }
        #[getter]
        fn source_twin(&self) -> u32 {
            self.inner.source.as_ref().map_or(0, |a| a.twin)
        }
        #[setter]
        fn set_source_twin(&mut self, value: u32) {
            addr(&mut self.inner.source).twin = value;
        }
        #[getter]
        fn source_connection(&self) -> Option<&str> {
            self.inner
                .source
                .as_ref()
                .and_then(|a| a.connection.as_deref())
        }
        #[setter]
        fn set_source_connection(&mut self, value: Option<String>) {
            addr(&mut self.inner.source).connection = value;
        }
        #[getter]
        fn dest_twin(&self) -> u32 {
            self.inner.destination.as_ref().map_or(0, |a| a.twin)
        }
        #[setter]
        fn set_dest_twin(&mut self, value: u32) {
            addr(&mut self.inner.destination).twin = value;
        }
        #[getter]
        fn dest_connection(&self) -> Option<&str> {
            self.inner
                .destination
                .as_ref()
                .and_then(|a| a.connection.as_deref())
        }
        #[setter]
        fn set_dest_connection(&mut self, value: Option<String>) {
            addr(&mut self.inner.destination).connection = value;
        }
        #[getter]
        fn kind(&self) -> i64 {
            self.inner.kind as i64
        }
        #[setter]
        fn set_kind(&mut self, value: i64) -> PyResult<()> {
            self.inner.kind = Kind::from_int(value)?;
            Ok(())
        }
        #[getter]
        fn command(&self) -> Option<&str> {
            (self.inner.kind == Kind::Request).then_some(self.inner.command.as_str())
        }
        #[setter]
        fn set_command(&mut self, value: Option<String>) {
            self.inner.command = value.unwrap_or_default();
        }
        #[getter]
        fn error_code(&self) -> u32 {
            self.inner.error_code
        }
        #[setter]
        fn set_error_code(&mut self, value: u32) {
            self.inner.error_code = value;
        }
        #[getter]
        fn error_message(&self) -> &str {
            &self.inner.error_message
        }
        #[setter]
        fn set_error_message(&mut self, value: String) {
            self.inner.error_message = value;
        }
        #[getter]
        fn signature<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
            self.inner.signature.as_ref().map(|s| PyBytes::new(py, s))
        }
        #[setter]
        fn set_signature(&mut self, value: Option<Vec<u8>>) {
            self.inner.signature = value;
        }
        #[getter]
        fn schema(&self) -> Option<&str> {
            self.inner.schema.as_deref()
        }
        #[setter]
        fn set_schema(&mut self, value: Option<String>) {
            self.inner.schema = value;
        }
        #[getter]
        fn federation(&self) -> Option<&str> {
            self.inner.federation.as_deref()
        }
        #[setter]
        fn set_federation(&mut self, value: Option<String>) {
            self.inner.federation = value;
        }
        #[getter]
        fn plain<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
            match &self.inner.payload {
                Payload::Plain(d) => Some(PyBytes::new(py, d)),
                _ => None,
            }
        }
        #[setter]
        fn set_plain(&mut self, value: Option<Vec<u8>>) {
            match value {
                Some(data) => self.inner.payload = Payload::Plain(data),
                None if matches!(self.inner.payload, Payload::Plain(_)) => {
                    self.inner.payload = Payload::None
                }
                None => {}
            }
        }
        #[getter]
        fn cipher<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
            match &self.inner.payload {
                Payload::Cipher(d) => Some(PyBytes::new(py, d)),
                _ => None,
            }
        }
        #[setter]
        fn set_cipher(&mut self, value: Option<Vec<u8>>) {
            match value {
                Some(data) => self.inner.payload = Payload::Cipher(data),
                None if matches!(self.inner.payload, Payload::Cipher(_)) => {
                    self.inner.payload = Payload::None
                }
                None => {}
            }
        }
        #[getter]
        fn relays(&self) -> Vec<String> {
            self.inner.relays.clone()
        }
        #[setter]
        fn set_relays(&mut self, value: Vec<String>) {
            self.inner.relays = value;
        }

        fn __repr__(&self) -> String {
            format!(
                "<Envelope uid={:?} kind={}>",
                self.inner.uid, self.inner.kind as i64
            )
        }
    }

    #[pyfunction]
    #[pyo3(signature = (uid, message, now, dest_twin = None, dest_connection = None))]
    fn build_error_envelope<'py>(
        py: Python<'py>,
        uid: &str,
        message: &str,
        now: u64,
        dest_twin: Option<u32>,
        dest_connection: Option<String>,
    ) -> Bound<'py, PyBytes> {
        let dest = dest_twin.map(|twin| Address {
            twin,
            connection: dest_connection,
        });
        PyBytes::new(py, &super::error_envelope(uid, message, now, dest))
    }

    #[pyfunction]
    fn build_pong<'py>(py: Python<'py>, ping: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &super::pong(ping)?))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        for (name, kind) in [
            ("MSG_NONE", Kind::None),
            ("MSG_REQUEST", Kind::Request),
            ("MSG_RESPONSE", Kind::Response),
            ("MSG_ERROR", Kind::Error),
            ("MSG_PING", Kind::Ping),
            ("MSG_PONG", Kind::Pong),
        ] {
            m.add(name, kind as i64)?;
        }
        m.add_class::<EnvelopeRouting>()?;
        m.add_class::<Envelope>()?;
        m.add_function(wrap_pyfunction!(scan_envelope, m)?)?;
        m.add_function(wrap_pyfunction!(build_error_envelope, m)?)?;
        m.add_function(wrap_pyfunction!(build_pong, m)?)?;
        Ok(())
    }
}
