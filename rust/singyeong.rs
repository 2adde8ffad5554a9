//! The 신경 (singyeong) gateway's native SEND/BROADCAST path: one JSON frame in, the
//! receivers' DISPATCH frames out, inside the decoder's `feed` (scan.rs), without a Python
//! event per message.
//!
//! Theory of operation
//! -------------------
//! Python stays the gateway (protocols/singyeong/): it identifies clients, validates metadata,
//! answers every other frame and owns every policy. What it hands this module is an *index*
//! kept in step on the rare events (identify, metadata applied, disconnect): for each
//! non-restricted local client, its connection, application, whether it speaks JSON, and its
//! top-level scalar metadata as canonical bytes (`s` + UTF-8 for strings, `n` + decimal text
//! for integers, `b0`/`b1` for booleans). Values whose `$eq` the index could not answer
//! exactly (floats, which equal integers; `version` strings, which compare by semver; integers
//! too long for the text form) are registered as *tainted*: a query on that application and
//! key goes to Python.
//!
//! [`route`] reads one frame and decides only what it can decide exactly as Python would
//! (dialect.py `_send`, query.py `parse`, clients.py `match`):
//! - a JSON object `{"op": 4, "t": "SEND"|"BROADCAST", "d": {"target": T, "payload": P,
//!   "nonce"?: N}}`, no duplicate keys;
//! - T has a string `application`, a non-empty `ops` of top-level `$eq`s on scalars (seed form
//!   `{"k": {"$eq": v}}` or path form `{"path": "/k", "op": "$eq", "to": {"value": v}}`), no
//!   `key`, `selector` or true `restricted` (decisions 5, 6); `droppable`/`optional` only
//!   matter without a match, which goes to Python;
//! - P and N are *canonical*: the text Python's encoder (ensure_ascii=False, compact, floats
//!   as `repr`) writes for the decoded value is the input text itself, so they are copied
//!   verbatim and the frame is byte for byte what `encode(JSON, frames.dispatch(t, P, ts, N))`
//!   gives;
//! - at least one receiver, every receiver speaks JSON and its outbox accepts (open, not
//!   congested): SEND picks one uniformly at random, as `resolve` does.
//!
//! Anything else — other ops and events, escapes or numbers the encoder would write
//! differently, whitespace inside P or N, no match, a congested receiver, msgpack/ETF
//! receivers — is
//! [`Decision::Python`]: the frame goes to Python unchanged, and so does every later frame of
//! the same read (scan.rs), so each connection's frames are still handled in order.

use std::collections::HashMap;

use crate::forward::{IdHasher, Outboxes};
use crate::routes::ConnId;
use std::hash::BuildHasherDefault;

/// Nesting deeper than this goes to Python (whose decoder takes ~1,000 levels).
const MAX_DEPTH: usize = 64;
/// More `ops` than this go to Python (its `MAX_CONDITIONS` counts them; ours stays far below).
const MAX_OPS: usize = 8;
/// Objects with more members than this are left to Python (the duplicate-key check is
/// quadratic; real payloads stay far below).
const MAX_KEYS: usize = 64;
/// Integers of more digits go to Python (its `int` parse has a digit limit of its own), and
/// index values of more digits are tainted: the canonical text must be the decimal one.
pub const MAX_INT_DIGITS: usize = 18;
/// Payload integers up to this many digits are copied verbatim (Python re-encodes them the
/// same); longer ones go to Python, which applies its own `int` digit limit.
const MAX_PAYLOAD_INT_DIGITS: usize = 300;
/// Python's default `sys.get_int_max_str_digits()` is 4300: a longer integer fails its
/// decode, so such frames go to Python whole, to be refused there.
const MAX_DECODED_INT_DIGITS: usize = 4000;
/// The gateway key whose value changes on every heartbeat: never indexed here (a query on it
/// goes to Python), so heartbeats cost no index update.
pub const VOLATILE_KEY: &str = "last_heartbeat_time";

type IdMap<V> = HashMap<ConnId, V, BuildHasherDefault<IdHasher>>;

// ---- JSON reading ------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
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
struct Val {
    kind: Kind,
    start: usize,
    end: usize,
}

/// One object member: the key's raw text between the quotes (canonical, so raw bytes equal
/// iff the keys are equal) and the value.
type Member<'a> = (&'a [u8], Val);

/// A strict reader of one JSON text. `None` from a method: not JSON, or not worth deciding
/// here (Python decides). `clean` turns false when the text read is valid JSON that Python's
/// encoder would write differently (whitespace, non-canonical escapes, floats, `-0`,
/// duplicate keys): such text must not be copied into a frame.
struct Reader<'a> {
    b: &'a [u8],
    i: usize,
    clean: bool,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8]) -> Self {
        Reader {
            b,
            i: 0,
            clean: true,
        }
    }

    fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return;
            }
            self.clean = false;
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.b.get(self.i) == Some(&c)).then(|| self.i += 1)
    }

    fn word(&mut self, w: &[u8]) -> Option<()> {
        self.b[self.i..].starts_with(w).then(|| self.i += w.len())
    }

    fn value(&mut self, depth: usize) -> Option<Val> {
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
    fn members(
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
    fn string(&mut self) -> Option<(usize, usize)> {
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

    fn number(&mut self) -> Option<Kind> {
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
    fn object(&mut self, v: Val) -> Option<Vec<Member<'a>>> {
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
    fn clean(&self, v: Val) -> bool {
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

fn get<'m>(members: &'m [Member<'_>], key: &[u8]) -> Option<&'m Val> {
    members.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
}

/// The decoded text of a string value.
fn text(b: &[u8], v: Val) -> Option<String> {
    if v.kind != Kind::Str {
        return None;
    }
    unescape(&b[v.start + 1..v.end - 1])
}

/// A string's raw text between its quotes with the escapes undone (None: a surrogate escape,
/// which a Rust string cannot hold; Python decides those).
fn unescape(raw: &[u8]) -> Option<String> {
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
fn scalar(b: &[u8], v: Val) -> Option<Vec<u8>> {
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

// ---- reading a frame ---------------------------------------------------------------------

/// A SEND or BROADCAST this module can answer, borrowed from the frame's text.
#[derive(Debug, PartialEq, Eq)]
pub struct Routable<'a> {
    pub broadcast: bool,
    pub application: String,
    /// (top-level key, canonical value): all must hold
    pub conditions: Vec<(String, Vec<u8>)>,
    /// the canonical text of the nonce (`null` when absent) and of the payload
    pub nonce: &'a [u8],
    pub payload: &'a [u8],
}

/// One `ops` entry as (key, canonical value), or None.
fn condition(r: &mut Reader<'_>, entry: Val) -> Option<(String, Vec<u8>)> {
    let b = r.b;
    let members = r.object(entry)?;
    if let Some(op) = get(&members, b"op") {
        // path form: `op` must be "$eq" (any other string starting with `$` is another
        // operator; anything else makes the entry a seed-form key named "op")
        if &b[op.start..op.end] != b"\"$eq\"" {
            return None;
        }
        let path = text(b, *get(&members, b"path")?)?;
        let key = path.strip_prefix('/')?;
        if key.is_empty() || key.contains('/') {
            return None;
        }
        let to = r.object(*get(&members, b"to")?)?;
        let value = scalar(b, *get(&to, b"value")?)?;
        return Some((key.to_owned(), value));
    }
    let [(key, spec)] = members.as_slice() else {
        return None;
    };
    let key = unescape(key)?;
    if key.is_empty() || key.starts_with('$') || key.starts_with('/') {
        return None;
    }
    let spec = r.object(*spec)?;
    let [(op, value)] = spec.as_slice() else {
        return None;
    };
    if *op != b"$eq" {
        return None;
    }
    Some((key, scalar(b, *value)?))
}

/// A dispatch frame's reader (the whole frame checked to be one JSON value), its `t` text
/// (quoted) and its `d`; None for any other frame.
fn dispatch_parts(frame: &[u8]) -> Option<(Reader<'_>, &[u8], Val)> {
    std::str::from_utf8(frame).ok()?;
    let mut r = Reader::new(frame);
    r.ws();
    let top = r.value(0)?;
    r.ws();
    if r.i != frame.len() {
        return None;
    }
    let top = r.object(top)?;
    let op = get(&top, b"op")?;
    if op.kind != Kind::Int || &frame[op.start..op.end] != b"4" {
        return None;
    }
    let t = get(&top, b"t")?;
    let d = *get(&top, b"d")?;
    Some((r, &frame[t.start..t.end], d))
}

/// What the native path makes of a frame it reads.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    Route(Routable<'a>),
    Queue(QueueFrame<'a>),
}

/// The frame as the native path acts on it (one read of it), or None: Python's.
pub fn read(frame: &[u8]) -> Option<Frame<'_>> {
    let (r, t, d) = dispatch_parts(frame)?;
    match t {
        b"\"SEND\"" => routable_from(r, d, false).map(Frame::Route),
        b"\"BROADCAST\"" => routable_from(r, d, true).map(Frame::Route),
        b"\"QUEUE\"" => queue_from(r, d, QueueKind::Queue).map(Frame::Queue),
        b"\"QUEUE_REQUEST\"" => queue_from(r, d, QueueKind::Request).map(Frame::Queue),
        b"\"QUEUE_ACK\"" => queue_from(r, d, QueueKind::Ack).map(Frame::Queue),
        _ => None,
    }
}

/// The frame, if it is a SEND/BROADCAST this module answers (see the module docs).
pub fn routable(frame: &[u8]) -> Option<Routable<'_>> {
    match read(frame)? {
        Frame::Route(r) => Some(r),
        Frame::Queue(_) => None,
    }
}

fn routable_from<'a>(mut r: Reader<'a>, d: Val, broadcast: bool) -> Option<Routable<'a>> {
    let frame = r.b;
    let d = r.object(d)?;
    let payload = *get(&d, b"payload")?;
    let nonce = get(&d, b"nonce").copied();
    if !r.clean(payload) || !nonce.is_none_or(|n| r.clean(n)) {
        return None;
    }
    let target = r.object(*get(&d, b"target")?)?;
    let application = text(frame, *get(&target, b"application")?)?;
    for absent in [b"key".as_slice(), b"selector"] {
        if get(&target, absent).is_some_and(|v| v.kind != Kind::Null) {
            return None;
        }
    }
    if get(&target, b"restricted").is_some_and(|v| !matches!(v.kind, Kind::Null | Kind::False)) {
        return None;
    }
    let ops = get(&target, b"ops")?;
    if ops.kind != Kind::Arr {
        return None;
    }
    let mut entries = Vec::new();
    {
        let mut a = Reader::new(frame);
        a.i = ops.start + 1;
        a.ws();
        if a.eat(b']').is_none() {
            loop {
                entries.push(a.value(1)?);
                if entries.len() > MAX_OPS {
                    return None;
                }
                a.ws();
                if a.eat(b',').is_some() {
                    a.ws();
                    continue;
                }
                a.eat(b']')?;
                break;
            }
        }
    }
    if entries.is_empty() {
        return None;
    }
    let mut conditions = Vec::with_capacity(entries.len());
    for entry in entries {
        let (key, value) = condition(&mut r, entry)?;
        if key == VOLATILE_KEY {
            return None;
        }
        conditions.push((key, value));
    }
    Some(Routable {
        broadcast,
        application,
        conditions,
        nonce: nonce.map_or(b"null".as_slice(), |n| &frame[n.start..n.end]),
        payload: &frame[payload.start..payload.end],
    })
}

/// The DISPATCH text the receivers get: `frames.dispatch(t, payload, ts, nonce)` as JSON.
pub fn dispatch_text(out: &mut Vec<u8>, r: &Routable<'_>, ts_ms: u64) {
    out.clear();
    out.extend_from_slice(br#"{"op":4,"d":{"target":null,"nonce":"#);
    out.extend_from_slice(r.nonce);
    out.extend_from_slice(br#","payload":"#);
    out.extend_from_slice(r.payload);
    out.extend_from_slice(if r.broadcast {
        br#"},"t":"BROADCAST","ts":"#.as_slice()
    } else {
        br#"},"t":"SEND","ts":"#.as_slice()
    });
    out.extend_from_slice(ts_ms.to_string().as_bytes());
    out.push(b'}');
}

// ---- queue frames ------------------------------------------------------------------------

/// The longest queue name, in characters (queues.py's MAX_QUEUE_NAME): longer ones, and
/// empty ones, get Python's op 3.
pub const MAX_QUEUE_NAME: usize = 256;

/// A QUEUE, QUEUE_REQUEST or QUEUE_ACK read from a JSON frame, for Python to act on without
/// decoding the frame or walking its dispatch chain (the three frames each queued message
/// costs). Values Python needs as values (target, payload, nonce) stay JSON text, checked
/// valid here; Python decodes them alone (and caches targets by their text).
#[derive(Debug, PartialEq, Eq)]
pub enum QueueFrame<'a> {
    Queue {
        name: String,
        /// the nonce's text (None: absent)
        nonce: Option<&'a str>,
        target: &'a str,
        payload: &'a str,
        /// the payload's text is what Python's encoder writes for it: the QUEUE dispatch may
        /// copy it instead of encoding the value again
        payload_clean: bool,
    },
    Request {
        name: String,
    },
    Ack {
        name: String,
        id: String,
    },
}

/// The three queue frames, with the numbers Python tells them apart by (the first item of
/// the tuples `scan.rs` hands over; native.py's QUEUE, QUEUE_REQUEST, QUEUE_ACK).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueueKind {
    Queue = 0,
    Request = 1,
    Ack = 2,
}

impl QueueFrame<'_> {
    pub fn kind(&self) -> QueueKind {
        match self {
            QueueFrame::Queue { .. } => QueueKind::Queue,
            QueueFrame::Request { .. } => QueueKind::Request,
            QueueFrame::Ack { .. } => QueueKind::Ack,
        }
    }
}

/// The frame, if it is one of the three queue frames in the shape Python's handlers take
/// (`d` an object with a string `queue`; QUEUE with `target` and `payload`; QUEUE_ACK with a
/// string `id`, a queue name of 1 to `MAX_QUEUE_NAME` characters); anything else, including
/// every malformed frame, is Python's (whose op 3 quotes the frame's whole `d`).
pub fn queue_frame(frame: &[u8]) -> Option<QueueFrame<'_>> {
    match read(frame)? {
        Frame::Queue(q) => Some(q),
        Frame::Route(_) => None,
    }
}

fn queue_from(mut r: Reader<'_>, d: Val, kind: QueueKind) -> Option<QueueFrame<'_>> {
    let frame = r.b;
    let all = std::str::from_utf8(frame).ok()?;
    let d = r.object(d)?;
    let name = get(&d, b"queue")?;
    if name.kind != Kind::Str || !r.clean(*name) {
        return None;
    }
    let name = text(frame, *name)?;
    if name.is_empty() || name.chars().count() > MAX_QUEUE_NAME {
        return None;
    }
    let slice = |v: &Val| &all[v.start..v.end];
    Some(match kind {
        QueueKind::Queue => {
            let payload = get(&d, b"payload")?;
            QueueFrame::Queue {
                name,
                nonce: get(&d, b"nonce").map(slice),
                target: slice(get(&d, b"target")?),
                payload: slice(payload),
                payload_clean: r.clean(*payload),
            }
        }
        QueueKind::Request => QueueFrame::Request { name },
        QueueKind::Ack => {
            let id = get(&d, b"id")?;
            if id.kind != Kind::Str || !r.clean(*id) {
                return None;
            }
            QueueFrame::Ack {
                name,
                id: text(frame, *id)?,
            }
        }
    })
}

// ---- the index ---------------------------------------------------------------------------

#[derive(Debug)]
struct Client {
    app: String,
    json: bool,
    /// (key, canonical value; None: tainted)
    values: Vec<(String, Option<Vec<u8>>)>,
}

/// `len(app) app len(key) key`: unambiguous for any strings.
fn app_key(out: &mut Vec<u8>, app: &str, key: &str) {
    out.clear();
    out.extend_from_slice(&(app.len() as u32).to_le_bytes());
    out.extend_from_slice(app.as_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

/// The non-restricted local clients by (application, key, canonical value); see module docs.
#[derive(Debug, Default)]
pub struct Index {
    clients: IdMap<Client>,
    buckets: HashMap<Vec<u8>, Vec<ConnId>>,
    taint: HashMap<Vec<u8>, u32>,
    rng: u64,
    key: Vec<u8>,
    found: Vec<ConnId>,
    text: Vec<u8>,
    /// SENDs and BROADCASTs answered here (each one frame in; the DISPATCH frames written
    /// are the outboxes' `sg` count, as RMB's and SBD's are): Python adds them to its metrics
    pub sends: u64,
    pub broadcasts: u64,
}

/// What [`Index::route`] did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// written to this many receivers' outboxes
    Delivered(usize),
    /// not answered here: the frame goes to Python
    Python,
}

impl Index {
    pub fn new(seed: u64) -> Self {
        Index {
            rng: seed | 1,
            ..Index::default()
        }
    }

    pub fn len(&self) -> usize {
        self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The client on `conn` is `app` with these values (replacing what it had).
    pub fn set(
        &mut self,
        conn: ConnId,
        app: String,
        json: bool,
        values: Vec<(String, Option<Vec<u8>>)>,
    ) {
        self.remove(conn);
        let mut key = std::mem::take(&mut self.key);
        for (k, v) in &values {
            app_key(&mut key, &app, k);
            match v {
                None => *self.taint.entry(key.clone()).or_default() += 1,
                Some(v) => {
                    key.extend_from_slice(v);
                    self.buckets.entry(key.clone()).or_default().push(conn);
                }
            }
        }
        self.key = key;
        self.clients.insert(conn, Client { app, json, values });
    }

    /// The client on `conn` is gone (or restricted, or closing).
    pub fn remove(&mut self, conn: ConnId) {
        let Some(client) = self.clients.remove(&conn) else {
            return;
        };
        let mut key = std::mem::take(&mut self.key);
        for (k, v) in &client.values {
            app_key(&mut key, &client.app, k);
            match v {
                None => {
                    if let Some(n) = self.taint.get_mut(&key) {
                        *n -= 1;
                        if *n == 0 {
                            self.taint.remove(&key);
                        }
                    }
                }
                Some(v) => {
                    key.extend_from_slice(v);
                    if let Some(members) = self.buckets.get_mut(&key) {
                        if let Some(at) = members.iter().position(|c| *c == conn) {
                            members.swap_remove(at);
                        }
                        if members.is_empty() {
                            self.buckets.remove(&key);
                        }
                    }
                }
            }
        }
        self.key = key;
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: uniform enough to pick one receiver among the matches
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The connections every condition matches (into `self.found`); false: Python decides
    /// (a tainted key). The smallest bucket of the conditions is read; its members meet
    /// that condition by construction, so only the others are checked on them (a lone `$eq`,
    /// the usual target, costs two hash lookups and a copy).
    fn matching(&mut self, app: &str, conditions: &[(String, Vec<u8>)]) -> bool {
        self.found.clear();
        let mut key = std::mem::take(&mut self.key);
        let mut smallest: Option<(usize, usize)> = None;
        for (at, (k, v)) in conditions.iter().enumerate() {
            app_key(&mut key, app, k);
            if !self.taint.is_empty() && self.taint.contains_key(&key) {
                self.key = key;
                return false;
            }
            if conditions.len() == 1 {
                smallest = Some((0, 0));
                break;
            }
            key.extend_from_slice(v);
            let size = self.buckets.get(&key).map_or(0, Vec::len);
            if smallest.is_none_or(|(s, _)| size < s) {
                smallest = Some((size, at));
            }
        }
        let Some((_, chosen)) = smallest else {
            self.key = key;
            return true;
        };
        let (k, v) = &conditions[chosen];
        app_key(&mut key, app, k);
        key.extend_from_slice(v);
        if let Some(members) = self.buckets.get(&key) {
            if conditions.len() == 1 {
                self.found.extend_from_slice(members);
            } else {
                for &conn in members {
                    let Some(client) = self.clients.get(&conn) else {
                        continue;
                    };
                    let all = conditions.iter().enumerate().all(|(at, (k, v))| {
                        at == chosen
                            || client
                                .values
                                .iter()
                                .any(|(ck, cv)| ck == k && cv.as_deref() == Some(v.as_slice()))
                    });
                    if all {
                        self.found.push(conn);
                    }
                }
            }
        }
        self.key = key;
        true
    }

    /// The receivers of `frame` as this module would pick them (SEND: one at random), or
    /// None when Python decides. `accepts` says whether a connection's outbox takes frames.
    pub fn receivers(
        &mut self,
        r: &Routable<'_>,
        accepts: impl Fn(ConnId) -> bool,
    ) -> Option<Vec<ConnId>> {
        if !self.matching(&r.application, &r.conditions) || self.found.is_empty() {
            return None;
        }
        let chosen = if r.broadcast {
            std::mem::take(&mut self.found)
        } else {
            let at = (self.next_random() % self.found.len() as u64) as usize;
            vec![self.found[at]]
        };
        let ok = chosen
            .iter()
            .all(|c| self.clients.get(c).is_some_and(|cl| cl.json) && accepts(*c));
        ok.then_some(chosen)
    }

    /// Answer `frame` into the outboxes (see the module docs), or leave it to Python.
    pub fn route(&mut self, frame: &[u8], ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        match routable(frame) {
            Some(r) => self.deliver(&r, ts_ms, outboxes),
            None => Decision::Python,
        }
    }

    /// Write a routable SEND/BROADCAST's DISPATCH into its receivers' outboxes, or leave it
    /// to Python (no receiver, or one that is not JSON or does not accept).
    pub fn deliver(&mut self, r: &Routable<'_>, ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        let Some(receivers) = self.receivers(r, |c| outboxes.accepts(c)) else {
            return Decision::Python;
        };
        let mut text = std::mem::take(&mut self.text);
        dispatch_text(&mut text, r, ts_ms);
        for &conn in &receivers {
            if outboxes.forward(conn, crate::ws::OP_TEXT, text.len(), |out| {
                out.copy_from_slice(&text)
            }) {
                outboxes.sg.add(text.len());
            }
        }
        self.text = text;
        let n = receivers.len();
        if r.broadcast {
            self.broadcasts += 1;
        } else {
            self.sends += 1;
        }
        if r.broadcast {
            self.found = receivers;
        }
        Decision::Delivered(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Option<Vec<u8>> {
        Some([b"s", v.as_bytes()].concat())
    }

    fn index() -> Index {
        let mut ix = Index::new(7);
        ix.set(
            1,
            "app".into(),
            true,
            vec![("id".into(), Some(b"n1".to_vec()))],
        );
        ix.set(
            2,
            "app".into(),
            true,
            vec![("id".into(), Some(b"n2".to_vec())), ("g".into(), s("x"))],
        );
        ix.set(
            3,
            "app".into(),
            true,
            vec![("id".into(), Some(b"n3".to_vec())), ("g".into(), s("x"))],
        );
        ix
    }

    #[test]
    fn canonical_frames_are_routable() {
        let f = br#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":{"a":[1,"\n",true]},"nonce":"n"}}"#;
        let r = routable(f).unwrap();
        assert_eq!(r.conditions, vec![("id".to_owned(), b"n2".to_vec())]);
        assert_eq!(r.payload, br#"{"a":[1,"\n",true]}"#);
        assert_eq!(r.nonce, br#""n""#);
        let mut out = Vec::new();
        dispatch_text(&mut out, &r, 5);
        assert_eq!(
            out,
            br#"{"op":4,"d":{"target":null,"nonce":"n","payload":{"a":[1,"\n",true]}},"t":"SEND","ts":5}"#
        );
    }

    #[test]
    fn path_form_and_whitespace_outside_the_payload() {
        let f = br#" { "op" : 4, "t": "BROADCAST", "d": {"payload": 1, "target": {"application": "app", "ops": [{"path": "/g", "op": "$eq", "to": {"value": "x"}}]}}} "#;
        let r = routable(f).unwrap();
        assert!(r.broadcast);
        assert_eq!(r.conditions, vec![("g".to_owned(), s("x").unwrap())]);
        assert_eq!(r.nonce, b"null");
    }

    #[test]
    fn what_python_would_write_differently_is_not_routable() {
        for f in [
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1.50}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1E5}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":[1, 2]}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":"\u0041"}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":{"a":1,"a":2}}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":-0}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2.0}}]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}],"key":"k"},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$ne":2}}]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"ops":[{"id":{"$eq":2}}]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}],"restricted":true},"payload":1}}"#,
            r#"{"op":4,"t":"QUEUE","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1}}"#,
            r#"{"op":4,"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1}} x"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":"a	b"}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"last_heartbeat_time":{"$eq":2}}]},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]}}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":1"#,
        ] {
            assert!(routable(f.as_bytes()).is_none(), "{f}");
        }
    }

    #[test]
    fn index_matches_every_condition_and_skips_tainted_keys() {
        let mut ix = index();
        let f = br#"{"op":4,"t":"BROADCAST","d":{"target":{"application":"app","ops":[{"g":{"$eq":"x"}}]},"payload":1}}"#;
        let r = routable(f).unwrap();
        let mut got = ix.receivers(&r, |_| true).unwrap();
        got.sort_unstable();
        assert_eq!(got, vec![2, 3]);
        let f = br#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"g":{"$eq":"x"}},{"id":{"$eq":3}}]},"payload":1}}"#;
        assert_eq!(ix.receivers(&routable(f).unwrap(), |_| true), Some(vec![3]));
        assert_eq!(ix.receivers(&routable(f).unwrap(), |c| c != 3), None);
        ix.set(4, "app".into(), true, vec![("g".into(), None)]);
        assert_eq!(ix.receivers(&r, |_| true), None);
        ix.remove(4);
        ix.remove(2);
        assert_eq!(ix.receivers(&r, |_| true), Some(vec![3]));
        ix.remove(3);
        assert_eq!(ix.receivers(&r, |_| true), None);
        assert!(ix.buckets.keys().all(|k| !k.ends_with(b"sx")));
    }

    #[test]
    fn queue_frames_are_read_and_odd_ones_left_to_python() {
        let f = br#"{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"ops":[]},"nonce":null,"payload":[1, 2.5]}}"#;
        assert_eq!(
            queue_frame(f),
            Some(QueueFrame::Queue {
                name: "q".into(),
                nonce: Some("null"),
                target: r#"{"ops":[]}"#,
                payload: "[1, 2.5]",
                payload_clean: false,
            })
        );
        let f = br#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"q\n","id":"a-1"}}"#;
        assert_eq!(
            queue_frame(f),
            Some(QueueFrame::Ack {
                name: "q\n".into(),
                id: "a-1".into()
            })
        );
        let f = br#"{"t":"QUEUE_REQUEST","op":4,"d":{"queue":"q"}}"#;
        assert_eq!(
            queue_frame(f),
            Some(QueueFrame::Request { name: "q".into() })
        );
        for f in [
            r#"{"op":4,"t":"QUEUE","d":{"queue":"q","payload":1}}"#,
            r#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"q","id":5}}"#,
            r#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"\u0071","id":"x"}}"#,
            r#"{"op":4,"t":"QUEUE_REQUEST","d":{"queue":1}}"#,
            r#"{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q","queue":"r"}}"#,
            r#"{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q"}"#,
            r#"{"op":5,"t":"QUEUE_REQUEST","d":{"queue":"q"}}"#,
            r#"{"op":4,"t":"QUEUE","d":{"queue":"q","target":{},"payload":NaN}}"#,
        ] {
            assert!(queue_frame(f.as_bytes()).is_none(), "{f}");
        }
        let long = format!(
            r#"{{"op":4,"t":"QUEUE","d":{{"queue":"q","target":{{}},"payload":{}}}}}"#,
            "1".repeat(MAX_DECODED_INT_DIGITS + 1)
        );
        assert!(queue_frame(long.as_bytes()).is_none());
        // names Python refuses (its op 3 quotes the whole `d`), counted in characters
        let named = |n: &str| format!(r#"{{"op":4,"t":"QUEUE_REQUEST","d":{{"queue":"{n}"}}}}"#);
        assert!(queue_frame(named("").as_bytes()).is_none());
        assert!(queue_frame(named(&"é".repeat(MAX_QUEUE_NAME + 1)).as_bytes()).is_none());
        assert!(queue_frame(named(&"é".repeat(MAX_QUEUE_NAME)).as_bytes()).is_some());
    }

    #[test]
    fn route_writes_one_text_frame_per_receiver_and_counts_it() {
        let mut ix = index();
        let mut ob = Outboxes::new();
        for conn in 1..=3 {
            ob.open(conn);
        }
        let f = br#"{"op":4,"t":"BROADCAST","d":{"target":{"application":"app","ops":[{"g":{"$eq":"x"}}]},"payload":[1]}}"#;
        assert_eq!(ix.route(f, 9, &mut ob), Decision::Delivered(2));
        let want = crate::ws::encode_frame(
            crate::ws::OP_TEXT,
            br#"{"op":4,"d":{"target":null,"nonce":null,"payload":[1]},"t":"BROADCAST","ts":9}"#,
            true,
            None,
        );
        assert_eq!(ob.take(2), Some(want.clone()));
        assert_eq!(ob.take(3), Some(want));
        assert_eq!(ob.take(1), None);
        ob.set_congested(3, true);
        assert_eq!(
            ix.route(f, 9, &mut ob),
            Decision::Python,
            "a receiver that does not accept"
        );
        assert_eq!(ob.take(2), None, "nothing written when Python decides");
        ix.set(
            4,
            "app".into(),
            false,
            vec![("id".into(), Some(b"n9".to_vec()))],
        );
        ob.open(4);
        let send = br#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":9}}]},"payload":1}}"#;
        assert_eq!(
            ix.route(send, 9, &mut ob),
            Decision::Python,
            "not a JSON receiver"
        );
        assert_eq!((ix.sends, ix.broadcasts), (0, 1));
        assert_eq!(ob.sg.messages, 2);
    }

    #[test]
    fn float_texts_are_clean_only_as_python_writes_them() {
        for (text, repr) in [
            ("1.5", "1.5"),
            ("100.0", "100.0"),
            ("1e2", "100.0"),
            ("0.0001", "0.0001"),
            ("0.00001", "1e-05"),
            ("1e16", "1e+16"),
            ("1e15", "1000000000000000.0"),
            ("-0.0", "-0.0"),
            ("0.30000000000000004", "0.30000000000000004"),
            ("1.2345678901234568e17", "1.2345678901234568e+17"),
            ("5e-324", "5e-324"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
        ] {
            let got = python_float_repr(text.as_bytes()).unwrap();
            assert_eq!(String::from_utf8(got).unwrap(), repr, "{text}");
        }
        assert!(python_float_repr(b"1e400").is_none());
    }

    #[test]
    fn escaped_strings_decode_for_the_index() {
        let f = br#"{"op":4,"t":"SEND","d":{"target":{"application":"a\"p","ops":[{"k\n":{"$eq":"\u0001\\"}}]},"payload":1}}"#;
        let r = routable(f).unwrap();
        assert_eq!(r.application, "a\"p");
        assert_eq!(
            r.conditions,
            vec![("k\n".to_owned(), s("\u{1}\\").unwrap())]
        );
    }
}

pub mod py {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    use super::{dispatch_text, routable, Index};
    use crate::forward::py::Outboxes;

    /// The native SEND/BROADCAST path's index of one gateway (see `singyeong.rs`): Python
    /// keeps it in step on identify, metadata applied and disconnect.
    #[pyclass(module = "rmb_relay._core")]
    pub struct SgIndex {
        pub(crate) inner: Index,
    }

    #[pymethods]
    impl SgIndex {
        /// `seed` fixes the SEND receiver picks: the caller's (the dialect's rng), so that
        /// the core stays sans-I/O (no clock or entropy of its own) and tests replay.
        #[new]
        fn new(seed: u64) -> Self {
            SgIndex {
                inner: Index::new(seed),
            }
        }

        /// The client on `conn_id` (non-restricted, identified) is `app`; `json` whether it
        /// speaks JSON; `values` its top-level scalars as (key, canonical bytes or None when
        /// tainted). Replaces what the connection had.
        fn set(
            &mut self,
            conn_id: u64,
            app: String,
            json: bool,
            values: Vec<(String, Option<Bound<'_, PyBytes>>)>,
        ) {
            let values = values
                .into_iter()
                .map(|(k, v)| (k, v.map(|b| b.as_bytes().to_vec())))
                .collect();
            self.inner.set(conn_id, app, json, values);
        }

        /// The connection's client is gone from the index (closed, or restricted).
        fn remove(&mut self, conn_id: u64) {
            self.inner.remove(conn_id);
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }

        /// (sends, broadcasts) answered natively so far (their DISPATCH frames: the
        /// outboxes' `sg_dispatches`).
        #[getter]
        fn counts(&self) -> (u64, u64) {
            (self.inner.sends, self.inner.broadcasts)
        }

        /// The DISPATCH text the native path writes for `frame` at `ts_ms` (None: the frame
        /// goes to Python), whatever the index holds: what tests hold to Python's encoding.
        fn dispatch_text<'py>(
            &self,
            py: Python<'py>,
            frame: &[u8],
            ts_ms: u64,
        ) -> Option<Bound<'py, PyBytes>> {
            let r = routable(frame)?;
            let mut out = Vec::new();
            dispatch_text(&mut out, &r, ts_ms);
            Some(PyBytes::new(py, &out))
        }

        /// The connections the native path would write `frame` to, every outbox accepting
        /// (SEND: one, picked at random); None: the frame goes to Python.
        fn receivers(&mut self, frame: &[u8]) -> Option<Vec<u64>> {
            let r = routable(frame)?;
            self.inner.receivers(&r, |_| true)
        }

        fn __repr__(&self) -> String {
            format!("SgIndex(clients={})", self.inner.len())
        }
    }

    /// Scanner of one JSON-encoded 신경 connection: its SEND/BROADCAST frames are answered by
    /// `index` into `outboxes` inside `feed` once the client is `ready` (identified, not
    /// restricted); everything else goes to Python in order.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct SgScanner {
        pub(crate) index: Py<SgIndex>,
        pub(crate) outboxes: Py<Outboxes>,
        #[pyo3(get)]
        pub(crate) conn_id: u64,
        pub(crate) ready: AtomicBool,
    }

    #[pymethods]
    impl SgScanner {
        #[new]
        fn new(index: Py<SgIndex>, outboxes: Py<Outboxes>, conn_id: u64) -> Self {
            SgScanner {
                index,
                outboxes,
                conn_id,
                ready: AtomicBool::new(false),
            }
        }

        #[getter]
        fn ready(&self) -> bool {
            self.ready.load(Relaxed)
        }

        /// The client identified (and is not restricted): its frames may be answered natively.
        #[setter]
        fn set_ready(&self, ready: bool) {
            self.ready.store(ready, Relaxed);
        }

        fn __repr__(&self) -> String {
            format!(
                "SgScanner(conn_id={}, ready={})",
                self.conn_id,
                self.ready()
            )
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<SgIndex>()?;
        m.add_class::<SgScanner>()?;
        // the limits Python must agree with, defined here once
        m.add("SG_VOLATILE_KEY", super::VOLATILE_KEY)?;
        m.add("SG_MAX_INT_DIGITS", super::MAX_INT_DIGITS)?;
        m.add("SG_MAX_QUEUE_NAME", super::MAX_QUEUE_NAME)?;
        Ok(())
    }
}
