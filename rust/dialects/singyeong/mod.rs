//! The 신경 (singyeong) gateway's core: the query engine, the client index and the routing
//! decision, written once (`value`, `query`, `index`), and the fast path that answers a JSON
//! connection's SEND/BROADCAST with them inside the websocket decoder's `feed` (`Gateway`,
//! the scanner in `py`).
//!
//! Python stays the gateway (dialects/singyeong/): it identifies clients, validates metadata
//! and answers every other frame. Every query it runs (SEND, BROADCAST, QUERY_NODES, QUEUE
//! targets, the HTTP API) is parsed and matched here, through the `py` binding; the fast
//! path runs the same [`Index::resolve`] on the same index, and only decides whether it can
//! also *write* the answer itself:
//! - the frame is a JSON object `{"op": 4, "t": "SEND"|"BROADCAST", "d": {"target": T,
//!   "payload": P, "nonce"?: N}}` with no repeated or escaped structural key;
//! - P and N are *canonical* (the text Python's encoder writes for the decoded value is the
//!   input text: `codec::json::canonical`), so they are copied verbatim and the DISPATCH is
//!   byte for byte what Python would send;
//! - T parses (else Python sends the op 3 the same parse words), at least one receiver is
//!   chosen, and every receiver is on this instance, speaks JSON and its outbox accepts.
//!
//! Anything else goes to Python unchanged, and so does every later frame of the same read
//! (codec/scanner.rs), so each connection's frames are still handled in order. QUEUE,
//! QUEUE_REQUEST and QUEUE_ACK frames are read here too (`QueueFrame`) and handed to Python
//! as tuples, without Python decoding the whole frame.

pub mod index;
pub mod py;
pub mod query;
pub mod value;

use std::collections::HashMap;
use std::sync::Arc;

use crate::codec::json::{self, Kind, Reader, Span as Val};
use crate::forward::outboxes::Outboxes;
pub use index::Index;
pub use query::{Limits, Query, QueryError};

/// Parsed targets are kept by their text (senders address the same targets message after
/// message; a parse costs a few microseconds, a lookup a tenth of one): texts up to
/// `CACHED_TARGET` bytes, at most `QUERY_CACHE` of them and `QUERY_CACHE_BYTES` of text in
/// all (a query holds a few times its text), the table starting over when full.
const CACHED_TARGET: usize = 1024;
const QUERY_CACHE: usize = 16_384;
const QUERY_CACHE_BYTES: usize = 1 << 20;
/// The longest queue name, in characters (queues.py's MAX_QUEUE_NAME).
pub const MAX_QUEUE_NAME: usize = 256;

/// The members of a structural object (`op`, `d`): None when a key repeats or is escaped.
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

fn text(r: &Reader<'_>, v: Val) -> Option<String> {
    (v.kind == Kind::Str).then(|| json::decode_str(r, v).map(|t| t.into_owned()))?
}

/// A SEND or BROADCAST the fast path may answer, borrowed from the frame's text.
#[derive(Debug, PartialEq, Eq)]
pub struct Routable<'a> {
    pub broadcast: bool,
    /// the target's JSON text (parsed by [`Gateway::query`])
    pub target: &'a [u8],
    /// the canonical text of the nonce (`null` when absent) and of the payload
    pub nonce: &'a [u8],
    pub payload: &'a [u8],
}

/// A QUEUE, QUEUE_REQUEST or QUEUE_ACK read from a JSON frame, for Python to act on without
/// decoding the frame. Target, payload and nonce stay JSON text (Python decodes each alone).
#[derive(Debug, PartialEq, Eq)]
pub enum QueueFrame<'a> {
    Queue {
        name: String,
        nonce: Option<&'a str>,
        target: &'a str,
        payload: &'a str,
        /// the payload's text is what Python's encoder writes for it (copied, not re-encoded)
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

/// What the fast path makes of a frame (None: Python's).
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    Route(Routable<'a>),
    Queue(QueueFrame<'a>),
}

pub fn read(frame: &[u8]) -> Option<Frame<'_>> {
    let (r, top) = json::document(frame).ok()?;
    let top = object(&r, top)?;
    let op = get(&top, b"op")?;
    if op.kind != Kind::Int || r.slice(*op) != b"4" {
        return None;
    }
    let t = r.slice(*get(&top, b"t")?);
    let d = *get(&top, b"d")?;
    match t {
        b"\"SEND\"" => routable(&r, d, false).map(Frame::Route),
        b"\"BROADCAST\"" => routable(&r, d, true).map(Frame::Route),
        b"\"QUEUE\"" => queue(&r, d, 0).map(Frame::Queue),
        b"\"QUEUE_REQUEST\"" => queue(&r, d, 1).map(Frame::Queue),
        b"\"QUEUE_ACK\"" => queue(&r, d, 2).map(Frame::Queue),
        _ => None,
    }
}

fn routable<'a>(r: &Reader<'a>, d: Val, broadcast: bool) -> Option<Routable<'a>> {
    let d = object(r, d)?;
    let payload = *get(&d, b"payload")?;
    let nonce = get(&d, b"nonce").copied();
    if !json::canonical(r, payload) || !nonce.is_none_or(|n| json::canonical(r, n)) {
        return None;
    }
    Some(Routable {
        broadcast,
        target: r.slice(*get(&d, b"target")?),
        nonce: nonce.map_or(b"null".as_slice(), |n| r.slice(n)),
        payload: r.slice(payload),
    })
}

/// The queue frames in the shape Python's handlers take (`d` an object with a string `queue`
/// of 1 to `MAX_QUEUE_NAME` characters; QUEUE with `target` and `payload`; QUEUE_ACK with a
/// string `id`); anything else is Python's (whose op 3 quotes the frame's whole `d`).
fn queue<'a>(r: &Reader<'a>, d: Val, kind: u8) -> Option<QueueFrame<'a>> {
    let all = std::str::from_utf8(r.text).ok()?;
    let d = object(r, d)?;
    let name = get(&d, b"queue")?;
    if name.kind != Kind::Str || !json::canonical(r, *name) {
        return None;
    }
    let name = text(r, *name)?;
    if name.is_empty() || name.chars().count() > MAX_QUEUE_NAME {
        return None;
    }
    let slice = |v: &Val| &all[v.start..v.end];
    Some(match kind {
        0 => {
            let payload = get(&d, b"payload")?;
            QueueFrame::Queue {
                name,
                nonce: get(&d, b"nonce").map(slice),
                target: slice(get(&d, b"target")?),
                payload: slice(payload),
                payload_clean: json::canonical(r, *payload),
            }
        }
        1 => QueueFrame::Request { name },
        _ => {
            let id = get(&d, b"id")?;
            if id.kind != Kind::Str || !json::canonical(r, *id) {
                return None;
            }
            QueueFrame::Ack {
                name,
                id: text(r, *id)?,
            }
        }
    })
}

/// The DISPATCH text receivers get: `frames.dispatch(t, payload, ts, nonce)` as JSON, from
/// the texts of its parts (`t` quoted). Python's JSON path writes SEND, BROADCAST and queue
/// dispatches through it too (`sg_dispatch_text`): one layout of the envelope.
pub fn dispatch_text(
    out: &mut Vec<u8>,
    t: &[u8],
    nonce: &[u8],
    payload: &[u8],
    extra: &[u8],
    ts_ms: u64,
) {
    out.clear();
    out.extend_from_slice(br#"{"op":4,"d":{"target":null,"nonce":"#);
    out.extend_from_slice(nonce);
    out.extend_from_slice(br#","payload":"#);
    out.extend_from_slice(payload);
    out.extend_from_slice(extra);
    out.extend_from_slice(br#"},"t":"#);
    out.extend_from_slice(t);
    out.extend_from_slice(br#","ts":"#);
    out.extend_from_slice(ts_ms.to_string().as_bytes());
    out.push(b'}');
}

/// What the fast path did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// written to this many receivers' outboxes
    Delivered(usize),
    /// not answered here: the frame goes to Python
    Python,
}

/// One gateway's index, query limits and parsed-target cache.
#[derive(Debug)]
pub struct Gateway {
    pub index: Index,
    pub limits: Limits,
    cache: HashMap<Box<[u8]>, Arc<Query>>,
    cached_bytes: usize,
    text: Vec<u8>,
    conns: Vec<crate::forward::routes::ConnId>,
    /// SENDs and BROADCASTs the fast path answered (Python adds them to its metrics)
    pub sends: u64,
    pub broadcasts: u64,
}

impl Gateway {
    pub fn new(seed: u64, limits: Limits) -> Self {
        Gateway {
            index: Index::new(seed),
            limits,
            cache: HashMap::new(),
            cached_bytes: 0,
            text: Vec::new(),
            conns: Vec::new(),
            sends: 0,
            broadcasts: 0,
        }
    }

    /// The parsed query of a target's JSON text (None: Python parses it and says why).
    pub fn query(&mut self, target: &[u8]) -> Option<Arc<Query>> {
        if let Some(q) = self.cache.get(target) {
            return Some(q.clone());
        }
        let (r, span) = json::document(target).ok()?;
        let q = Arc::new(query::parse(&value::from_json(&r, span), self.limits).ok()?);
        if target.len() <= CACHED_TARGET {
            if self.cache.len() >= QUERY_CACHE
                || self.cached_bytes + target.len() > QUERY_CACHE_BYTES
            {
                self.cache.clear();
                self.cached_bytes = 0;
            }
            self.cached_bytes += target.len();
            self.cache.insert(target.into(), q.clone());
        }
        Some(q)
    }

    /// Write a SEND/BROADCAST's DISPATCH into its receivers' outboxes, or leave it to Python.
    pub fn deliver(&mut self, r: &Routable<'_>, ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        let Some(q) = self.query(r.target) else {
            return Decision::Python;
        };
        let receivers = self.index.resolve(&q, r.broadcast);
        let mut conns = std::mem::take(&mut self.conns);
        conns.clear();
        for h in &receivers {
            match self.index.clients.get(h) {
                Some(c) if c.json && c.conn.is_some_and(|id| outboxes.accepts(id)) => {
                    conns.push(c.conn.expect("local"))
                }
                _ => {
                    self.conns = conns;
                    return Decision::Python;
                }
            }
        }
        if conns.is_empty() {
            self.conns = conns;
            return Decision::Python;
        }
        let mut text = std::mem::take(&mut self.text);
        let t: &[u8] = if r.broadcast {
            b"\"BROADCAST\""
        } else {
            b"\"SEND\""
        };
        dispatch_text(&mut text, t, r.nonce, r.payload, b"", ts_ms);
        for &conn in &conns {
            if outboxes.forward(conn, crate::codec::ws::OP_TEXT, text.len(), |out| {
                out.copy_from_slice(&text)
            }) {
                outboxes.count(conn, text.len());
            }
        }
        self.text = text;
        let n = conns.len();
        self.conns = conns;
        if r.broadcast {
            self.broadcasts += 1;
        } else {
            self.sends += 1;
        }
        Decision::Delivered(n)
    }

    /// [`Gateway::deliver`] of a whole frame (tests; the scanner reads frames with [`read`]).
    pub fn route(&mut self, frame: &[u8], ts_ms: u64, outboxes: &mut Outboxes) -> Decision {
        match read(frame) {
            Some(Frame::Route(r)) => self.deliver(&r, ts_ms, outboxes),
            _ => Decision::Python,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::index::Client;
    use super::value::Value;
    use super::*;

    fn gateway() -> Gateway {
        let mut gw = Gateway::new(7, Limits::default());
        for n in 1..=3u64 {
            let mut meta = query::Metadata::new();
            meta.insert(b"id".as_slice().into(), (Value::Int(n as i64), false));
            if n > 1 {
                meta.insert(b"g".as_slice().into(), (Value::str("x"), false));
            }
            gw.index.add(
                n,
                Client {
                    app: b"app".as_slice().into(),
                    id: format!("c{n}").into_bytes().into(),
                    conn: Some(n),
                    json: true,
                    meta,
                    ..Client::default()
                },
            );
        }
        gw
    }

    #[test]
    fn canonical_frames_are_routable_and_the_rest_is_python_s() {
        let f = br#"{"op":4,"t":"SEND","d":{"target":{"application":"app","ops":[{"id":{"$eq":2}}]},"payload":{"a":[1,"\n",true]},"nonce":"n"}}"#;
        let Some(Frame::Route(r)) = read(f) else {
            panic!()
        };
        assert_eq!(r.payload, br#"{"a":[1,"\n",true]}"#);
        let mut out = Vec::new();
        dispatch_text(&mut out, b"\"SEND\"", r.nonce, r.payload, b"", 5);
        assert_eq!(out, br#"{"op":4,"d":{"target":null,"nonce":"n","payload":{"a":[1,"\n",true]}},"t":"SEND","ts":5}"#);
        for f in [
            r#"{"op":4,"t":"SEND","d":{"target":{},"payload":1.50}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{},"payload":[1, 2]}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{},"payload":"\u0041"}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{},"payload":-0}}"#,
            r#"{"op":4,"op":4,"t":"SEND","d":{"target":{},"payload":1}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{}}}"#,
            r#"{"op":4,"t":"SEND","d":{"target":{},"payload":1}} x"#,
        ] {
            assert!(!matches!(read(f.as_bytes()), Some(Frame::Route(_))), "{f}");
        }
    }

    #[test]
    fn queue_frames_are_read_and_odd_ones_left_to_python() {
        let f = br#"{"op":4,"t":"QUEUE","d":{"queue":"q","target":{"ops":[]},"nonce":null,"payload":[1, 2.5]}}"#;
        assert_eq!(
            read(f),
            Some(Frame::Queue(QueueFrame::Queue {
                name: "q".into(),
                nonce: Some("null"),
                target: r#"{"ops":[]}"#,
                payload: "[1, 2.5]",
                payload_clean: false
            }))
        );
        let f = br#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"q\n","id":"a-1"}}"#;
        assert_eq!(
            read(f),
            Some(Frame::Queue(QueueFrame::Ack {
                name: "q\n".into(),
                id: "a-1".into()
            }))
        );
        for f in [
            r#"{"op":4,"t":"QUEUE","d":{"queue":"q","payload":1}}"#,
            r#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"q","id":5}}"#,
            r#"{"op":4,"t":"QUEUE_ACK","d":{"queue":"\u0071","id":"x"}}"#,
            r#"{"op":4,"t":"QUEUE_REQUEST","d":{"queue":"q","queue":"r"}}"#,
            r#"{"op":5,"t":"QUEUE_REQUEST","d":{"queue":"q"}}"#,
        ] {
            assert!(read(f.as_bytes()).is_none(), "{f}");
        }
        let named = |n: &str| format!(r#"{{"op":4,"t":"QUEUE_REQUEST","d":{{"queue":"{n}"}}}}"#);
        assert!(read(named("").as_bytes()).is_none());
        assert!(read(named(&"é".repeat(MAX_QUEUE_NAME + 1)).as_bytes()).is_none());
        assert!(read(named(&"é".repeat(MAX_QUEUE_NAME)).as_bytes()).is_some());
    }

    #[test]
    fn route_writes_one_text_frame_per_receiver_or_leaves_it_to_python() {
        let mut gw = gateway();
        let mut ob = Outboxes::new();
        for conn in 1..=3 {
            ob.open(conn);
        }
        let f = br#"{"op":4,"t":"BROADCAST","d":{"target":{"application":"app","ops":[{"g":{"$eq":"x"}}]},"payload":[1]}}"#;
        assert_eq!(gw.route(f, 9, &mut ob), Decision::Delivered(2));
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
            gw.route(f, 9, &mut ob),
            Decision::Python,
            "a receiver that does not accept"
        );
        assert_eq!(ob.take(2), None, "nothing written when Python decides");
        let bad = br#"{"op":4,"t":"SEND","d":{"target":{"ops":[{"id":{"$in":1}}]},"payload":1}}"#;
        assert_eq!(
            gw.route(bad, 9, &mut ob),
            Decision::Python,
            "op 3 comes from Python"
        );
        let none = br#"{"op":4,"t":"SEND","d":{"target":{"ops":[{"id":{"$eq":7}}]},"payload":1}}"#;
        assert_eq!(
            gw.route(none, 9, &mut ob),
            Decision::Python,
            "no_route comes from Python"
        );
        gw.index.clients.get_mut(&1).unwrap().json = false;
        let send = br#"{"op":4,"t":"SEND","d":{"target":{"ops":[{"id":{"$eq":1}}]},"payload":1}}"#;
        assert_eq!(
            gw.route(send, 9, &mut ob),
            Decision::Python,
            "not a JSON receiver"
        );
        let range = br#"{"op":4,"t":"SEND","d":{"target":{"ops":[{"id":{"$gte":2}},{"id":{"$lt":3}}]},"payload":1}}"#;
        assert_eq!(gw.route(range, 9, &mut ob), Decision::Delivered(1));
        assert_eq!((gw.sends, gw.broadcasts), (1, 1));
    }
}
