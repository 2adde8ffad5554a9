//! The 신경 (singyeong) gateway's native SEND/BROADCAST path: one JSON frame in, the
//! receivers' DISPATCH frames out, inside the decoder's `feed` (scan.rs), without a Python
//! event per message.
//!
//! Theory of operation
//! -------------------
//! Python stays the gateway (dialects/singyeong/): it identifies clients, validates metadata,
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

use crate::forward::maps::IdMap;

/// More `ops` than this go to Python (its `MAX_CONDITIONS` counts them; ours stays far below).
const MAX_OPS: usize = 8;
/// Integers of more digits are tainted in the index: the canonical text must be the decimal one.
pub const MAX_INT_DIGITS: usize = 18;
/// The gateway key whose value changes on every heartbeat: never indexed here (a query on it
/// goes to Python), so heartbeats cost no index update.
pub const VOLATILE_KEY: &str = "last_heartbeat_time";

use crate::codec::json::{self, Kind, Reader, Span as Val};

/// The members of a structural object (`op`, `d`, a target, a condition): None when a key
/// repeats or is escaped (Python keeps the last of a duplicate key at the first one's place;
/// such frames are left to it).
fn object<'a>(r: &Reader<'a>, v: Val) -> Option<Vec<(&'a [u8], Val)>> {
    if v.kind != Kind::Obj {
        return None;
    }
    let members = r.members(v);
    let keys_ok = members.iter().enumerate().all(|(i, (k, _))| {
        json::canonical(r, *k) && !members[..i].iter().any(|(o, _)| r.raw(*o) == r.raw(*k))
    });
    keys_ok.then(|| members.iter().map(|(k, v)| (r.raw(*k), *v)).collect())
}

fn get<'m>(members: &'m [(&[u8], Val)], key: &[u8]) -> Option<&'m Val> {
    members.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
}

/// The decoded text of a string value (None: not a string, or a lone surrogate).
fn text(r: &Reader<'_>, v: Val) -> Option<String> {
    (v.kind == Kind::Str).then(|| json::decode_str(r, v).map(|t| t.into_owned()))?
}

/// The canonical index bytes of a scalar `$eq` value (None: Python decides).
fn scalar(r: &Reader<'_>, v: Val) -> Option<Vec<u8>> {
    match v.kind {
        Kind::True => Some(b"b1".to_vec()),
        Kind::False => Some(b"b0".to_vec()),
        Kind::Int => {
            let t = r.slice(v);
            let digits = t.iter().filter(|c| c.is_ascii_digit()).count();
            (digits <= MAX_INT_DIGITS && t != b"-0").then(|| [b"n", t].concat())
        }
        Kind::Str if json::canonical(r, v) => Some([b"s", text(r, v)?.as_bytes()].concat()),
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
fn condition(r: &Reader<'_>, entry: Val) -> Option<(String, Vec<u8>)> {
    let members = object(r, entry)?;
    if let Some(op) = get(&members, b"op") {
        // path form: `op` must be "$eq" (any other string starting with `$` is another
        // operator; anything else makes the entry a seed-form key named "op")
        if r.slice(*op) != b"\"$eq\"" {
            return None;
        }
        let path = text(r, *get(&members, b"path")?)?;
        let key = path.strip_prefix('/')?;
        if key.is_empty() || key.contains('/') {
            return None;
        }
        let to = object(r, *get(&members, b"to")?)?;
        let value = scalar(r, *get(&to, b"value")?)?;
        return Some((key.to_owned(), value));
    }
    let [(key, spec)] = members.as_slice() else {
        return None;
    };
    let key = String::from_utf8(json::unescape(key).into_owned()).ok()?;
    if key.is_empty() || key.starts_with('$') || key.starts_with('/') {
        return None;
    }
    let spec = object(r, *spec)?;
    let [(op, value)] = spec.as_slice() else {
        return None;
    };
    if *op != b"$eq" {
        return None;
    }
    Some((key, scalar(r, *value)?))
}

/// A dispatch frame's reader (the whole frame checked to be one JSON value), its `t` text
/// (quoted) and its `d`; None for any other frame.
fn dispatch_parts(frame: &[u8]) -> Option<(Reader<'_>, &[u8], Val)> {
    let (r, top) = json::document(frame).ok()?;
    let top = object(&r, top)?;
    let op = get(&top, b"op")?;
    if op.kind != Kind::Int || r.slice(*op) != b"4" {
        return None;
    }
    let t = r.slice(*get(&top, b"t")?);
    let d = *get(&top, b"d")?;
    Some((r, t, d))
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

fn routable_from<'a>(r: Reader<'a>, d: Val, broadcast: bool) -> Option<Routable<'a>> {
    let d = object(&r, d)?;
    let payload = *get(&d, b"payload")?;
    let nonce = get(&d, b"nonce").copied();
    if !json::canonical(&r, payload) || !nonce.is_none_or(|n| json::canonical(&r, n)) {
        return None;
    }
    let target = object(&r, *get(&d, b"target")?)?;
    let application = text(&r, *get(&target, b"application")?)?;
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
    let entries = r.elements(*ops);
    if entries.is_empty() || entries.len() > MAX_OPS {
        return None;
    }
    let mut conditions = Vec::with_capacity(entries.len());
    for entry in entries {
        let (key, value) = condition(&r, entry)?;
        if key == VOLATILE_KEY {
            return None;
        }
        conditions.push((key, value));
    }
    Some(Routable {
        broadcast,
        application,
        conditions,
        nonce: nonce.map_or(b"null".as_slice(), |n| r.slice(n)),
        payload: r.slice(payload),
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

fn queue_from(r: Reader<'_>, d: Val, kind: QueueKind) -> Option<QueueFrame<'_>> {
    // the frame was checked to be UTF-8 and spans sit on character boundaries
    let all = std::str::from_utf8(r.text).ok()?;
    let d = object(&r, d)?;
    let name = get(&d, b"queue")?;
    if name.kind != Kind::Str || !json::canonical(&r, *name) {
        return None;
    }
    let name = text(&r, *name)?;
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
                payload_clean: json::canonical(&r, *payload),
            }
        }
        QueueKind::Request => QueueFrame::Request { name },
        QueueKind::Ack => {
            let id = get(&d, b"id")?;
            if id.kind != Kind::Str || !json::canonical(&r, *id) {
                return None;
            }
            QueueFrame::Ack {
                name,
                id: text(&r, *id)?,
            }
        }
    })
}

#[path = "sg_index.rs"]
mod index;
pub use index::{Decision, Index};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::outboxes::Outboxes;

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
            "1".repeat(json::MAX_INT_DIGITS + 1)
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
        let want = crate::codec::ws::encode_frame(
            crate::codec::ws::OP_TEXT,
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
        assert_eq!(ob.forwarded("").messages, 2);
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
    use pyo3::types::{PyBytes, PyList};

    use super::{dispatch_text, routable, Decision, Frame, Index, QueueFrame};
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::py::{message_event, payload_bytes};
    use crate::codec::mask::Payload;
    use crate::forward::outboxes::py::{open_outboxes, Outboxes};

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
    #[pyclass(extends = Scanner, frozen, module = "rmb_relay._core")]
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
        fn new(index: Py<SgIndex>, outboxes: Py<Outboxes>, conn_id: u64) -> (Self, Scanner) {
            let scanner = SgScanner {
                index,
                outboxes,
                conn_id,
                ready: AtomicBool::new(false),
            };
            (scanner, Scanner::new(start_sg))
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

    /// A 신경 JSON connection's scanner for one `feed`: SEND/BROADCAST answered by the index
    /// while `outboxes` is set (the client is ready); queue frames gathered for Python.
    struct SgFeed<'py> {
        index: PyRefMut<'py, SgIndex>,
        outboxes: Option<PyRefMut<'py, Outboxes>>,
        /// the message unmasked, reused across the feed's messages
        scratch: Vec<u8>,
        /// queue frames read since the last event, for Python as one message (`take_made`)
        batch: Vec<Py<PyAny>>,
    }

    fn start_sg<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let py = scanner.py();
        let s = scanner.downcast::<SgScanner>()?.get();
        Ok(Box::new(SgFeed {
            index: s.index.bind(py).try_borrow_mut()?,
            outboxes: if s.ready.load(Relaxed) {
                open_outboxes(py, Some(&s.outboxes), s.conn_id)?
            } else {
                None
            },
            scratch: Vec::new(),
            batch: Vec::new(),
        }))
    }

    /// A queue frame as the tuple `SgSession` acts on (see `_core.pyi`, `_SgQueueFrame`):
    /// (QUEUE, queue, nonce text | None, target text, payload text, the frame's size, payload
    /// text is canonical), (QUEUE_REQUEST, queue) or (QUEUE_ACK, queue, id), the kinds as
    /// their numbers.
    fn queue_tuple(py: Python<'_>, q: &QueueFrame<'_>, size: usize) -> PyResult<Py<PyAny>> {
        let kind = q.kind() as u8;
        Ok(match q {
            QueueFrame::Queue {
                name,
                nonce,
                target,
                payload,
                payload_clean,
            } => (kind, name, *nonce, *target, *payload, size, *payload_clean)
                .into_pyobject(py)?
                .into_any()
                .unbind(),
            QueueFrame::Request { name } => (kind, name).into_pyobject(py)?.into_any().unbind(),
            QueueFrame::Ack { name, id } => (kind, name, id).into_pyobject(py)?.into_any().unbind(),
        })
    }

    impl ScanFeed for SgFeed<'_> {
        fn message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            now: u64,
            fast: bool,
        ) -> PyResult<Option<Scanned>> {
            let Some(ob) = self.outboxes.as_mut().filter(|_| is_text && fast) else {
                return Ok(Some((payload_bytes(py, payload)?, None, None)));
            };
            let scratch = &mut self.scratch;
            scratch.clear();
            scratch.resize(payload.len(), 0);
            payload.copy_to(scratch);
            let python = || Ok(Some((PyBytes::new(py, scratch).unbind(), None, None)));
            match super::read(scratch) {
                // `now` is the wall clock here (the dialect's scan_clock): `ts` in ms
                // queue frames wait for Python (the batch) and go before this one: answered
                // here, it would overtake them (a DISPATCH before the QUEUE_CONFIRM, or after
                // an op 8 close over the batch)
                Some(Frame::Route(_)) if !self.batch.is_empty() => python(),
                Some(Frame::Route(r)) => {
                    match self.index.inner.deliver(&r, now / 1_000_000, &mut ob.inner) {
                        Decision::Delivered(_) => Ok(None),
                        Decision::Python => python(),
                    }
                }
                Some(Frame::Queue(q)) => {
                    self.batch.push(queue_tuple(py, &q, scratch.len())?);
                    Ok(None)
                }
                None => python(),
            }
        }

        /// Queue frames read since the last event, as one text message with no data whose
        /// `routing` is the list of their tuples (the session acts on them in order).
        fn take_made(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
            if self.batch.is_empty() {
                return Ok(None);
            }
            let batch = PyList::new(py, std::mem::take(&mut self.batch))?;
            let empty = PyBytes::new(py, b"").unbind();
            message_event(py, true, empty, Some(batch.into_any().unbind()), None).map(Some)
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
