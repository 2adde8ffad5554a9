//! Per-message routing decisions made by the websocket decoder while it still holds the bytes,
//! so one call into Rust per read covers decoding, scanning and route lookups of every message.
//!
//! A scanner belongs to one connection and knows its dialect; the frame decoder (ws.rs) knows
//! none. Everything here is pure: the route table, the limiter and the time are arguments.
//! - RMB ([`scan_rmb`]): the envelope's routing fields ([`envelope::scan`]) and, for a bound
//!   session, whether the source is exactly that session and which local connection holds the
//!   destination.
//! - SBD ([`SbdScanner`]): the sender IP's byte-nanos charge, then command or forward from the
//!   32-byte header alone (the rest stays masked), and for a forward from a ready sender the
//!   connection holding the destination key. [`write_forward`] writes the rewritten forward
//!   (the sender's key, then the payload unmasked) in the same copy that takes it off the wire.
//!
//! Lookups see the table as it is at scan time: a whole read is scanned before the dialect
//! handles its first message, so a change the dialect makes while handling one message (an SBD
//! handshake completing, a session registering) is not seen by the later messages of that read.

use crate::envelope::{self, Routing};
use crate::error::Result;
use crate::limiter::ByteNanos;
use crate::routes::{ConnId, Routes};
use crate::sbd::{self, Header, HEADER_LEN};
use crate::ws::Payload;

// ---- RMB -----------------------------------------------------------------------------------

/// The RMB session a connection carries, and the table its destinations are looked up in.
#[derive(Debug, Clone, Copy)]
pub struct RmbSession<'a> {
    pub routes: &'a Routes,
    pub twin: u32,
    pub sid: Option<&'a str>,
}

/// An envelope's routing fields (borrowed from its bytes) and the session's view of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RmbRouting<'a> {
    pub fields: Routing<'a>,
    /// the source is exactly the session: same twin, same connection (absent and empty differ)
    pub from_session: bool,
    /// the local connection holding (dest_twin, dest_connection) at scan time
    pub dest_conn_id: Option<ConnId>,
}

/// Scan an envelope; with a session also check its source and look up its destination.
pub fn scan_rmb<'a>(data: &'a [u8], session: Option<&RmbSession<'_>>) -> Result<RmbRouting<'a>> {
    let fields = envelope::scan(data)?;
    let (from_session, dest_conn_id) = match session {
        Some(s) => (
            fields.source_twin == s.twin && fields.source_connection == s.sid,
            s.routes
                .lookup_session(fields.dest_twin, fields.dest_connection),
        ),
        None => (false, None),
    };
    Ok(RmbRouting {
        fields,
        from_session,
        dest_conn_id,
    })
}

// ---- SBD -----------------------------------------------------------------------------------

/// An SBD message as the relay acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SbdKind {
    /// 28 zero bytes, then this tag; the command's payload is the message after the header
    Command { tag: [u8; 4] },
    /// to the peer whose key is the header; `dest_conn_id` is the connection registered for it,
    /// looked up only when asked (a ready sender within its budget)
    Forward {
        peer: [u8; HEADER_LEN],
        dest_conn_id: Option<ConnId>,
    },
}

/// Classify `message` from its header and, when `route` is set, look up a forward's destination.
/// A message shorter than the header is an error (spec/sbd.md §1.2).
pub fn scan_sbd(message: Payload<'_>, routes: &Routes, route: bool) -> Result<SbdKind> {
    let header = message
        .prefix::<HEADER_LEN>()
        .ok_or_else(|| sbd::too_short(message.len()))?;
    Ok(match sbd::parse_header(&header) {
        Header::Command(tag) => SbdKind::Command { tag },
        Header::Forward(peer) => SbdKind::Forward {
            peer,
            dest_conn_id: if route {
                routes.lookup_key(&peer)
            } else {
                None
            },
        },
    })
}

/// What the scanner makes of one SBD message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SbdRouting {
    pub kind: SbdKind,
    /// the sender had completed its handshake when the message was scanned; a forward from a
    /// sender that had not is reported, not routed
    pub sender_ready: bool,
    /// the limiter refused this message (or an earlier one of this connection)
    pub over_limit: bool,
}

/// `sender || message[32..]` into `out` (exactly `message.len()` bytes), unmasking as it copies.
pub fn write_forward(out: &mut [u8], message: Payload<'_>, sender: &[u8; HEADER_LEN]) {
    debug_assert!(message.len() >= HEADER_LEN && out.len() == message.len());
    let (head, tail) = out.split_at_mut(HEADER_LEN);
    head.copy_from_slice(sender);
    message.copy_range_to(HEADER_LEN, tail);
}

/// One SBD connection as its messages are scanned: its key, its IP (the limiter's key), whether
/// its handshake is done, and whether the limiter has refused it.
#[derive(Debug, Clone)]
pub struct SbdScanner {
    pub pubkey: [u8; HEADER_LEN],
    pub ip: String,
    pub ready: bool,
    refused: bool,
}

impl SbdScanner {
    pub fn new(pubkey: [u8; HEADER_LEN], ip: String) -> Self {
        SbdScanner {
            pubkey,
            ip,
            ready: false,
            refused: false,
        }
    }

    /// True once the limiter has refused a message: every later message is over the limit too
    /// (and no longer charged: the reference server has dropped the connection by then).
    pub fn refused(&self) -> bool {
        self.refused
    }

    /// Charge `size` bytes to the IP at `now` (every data message, commands, short and text
    /// ones included, spec/sbd.md §1.10); true if the message is over the limit.
    fn charge(&mut self, limiter: Option<&mut ByteNanos<String>>, size: usize, now: u64) -> bool {
        if !self.refused {
            if let Some(limiter) = limiter {
                self.refused = !limiter.check_str(&self.ip, size as u64, now);
            }
        }
        self.refused
    }

    /// Charge, classify and (for a forward from a ready sender within budget) route `message`.
    pub fn scan(
        &mut self,
        message: Payload<'_>,
        routes: &Routes,
        limiter: Option<&mut ByteNanos<String>>,
        now: u64,
    ) -> Result<SbdRouting> {
        let over_limit = self.charge(limiter, message.len(), now);
        let kind = scan_sbd(message, routes, self.ready && !over_limit)?;
        Ok(SbdRouting {
            kind,
            sender_ready: self.ready,
            over_limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{Address, Envelope, Kind};
    use crate::error::Error;
    use crate::ws::apply_mask;

    const MASK: [u8; 4] = [0x37, 0xfa, 0x21, 0x3d];

    // ---- RMB ----

    /// uid "u", source {7, "app"}, destination {9, "svc"}, request {command "c"}
    const GOLDEN_ENVELOPE: [u8; 26] = [
        0x0a, 0x01, b'u', // uid
        0x2a, 0x07, 0x08, 0x07, 0x12, 0x03, b'a', b'p', b'p', // source
        0x32, 0x07, 0x08, 0x09, 0x12, 0x03, b's', b'v', b'c', // destination
        0x3a, 0x03, 0x0a, 0x01, b'c', // request
    ];

    fn envelope(source: (u32, Option<&str>), dest: (u32, Option<&str>)) -> Vec<u8> {
        Envelope {
            uid: "u".into(),
            source: Some(Address {
                twin: source.0,
                connection: source.1.map(str::to_owned),
            }),
            destination: Some(Address {
                twin: dest.0,
                connection: dest.1.map(str::to_owned),
            }),
            kind: Kind::Request,
            command: "c".into(),
            ..Envelope::default()
        }
        .encode()
    }

    fn routes_with_svc() -> Routes {
        let mut routes = Routes::new();
        routes.register_session(9, Some("svc"), 42);
        routes
    }

    #[test]
    fn golden_envelope_both_ways() {
        assert_eq!(
            envelope((7, Some("app")), (9, Some("svc"))),
            GOLDEN_ENVELOPE
        );
        let r = scan_rmb(&GOLDEN_ENVELOPE, None).unwrap();
        assert_eq!(r.fields, envelope::scan(&GOLDEN_ENVELOPE).unwrap());
        assert_eq!(
            (r.fields.uid, r.fields.kind, r.fields.dest_connection),
            ("u", Kind::Request, Some("svc"))
        );
    }

    #[test]
    fn without_a_session_nothing_is_checked_or_looked_up() {
        let r = scan_rmb(&GOLDEN_ENVELOPE, None).unwrap();
        assert_eq!((r.from_session, r.dest_conn_id), (false, None));
    }

    #[test]
    fn session_sees_its_own_source_and_the_local_destination() {
        let routes = routes_with_svc();
        let session = RmbSession {
            routes: &routes,
            twin: 7,
            sid: Some("app"),
        };
        let r = scan_rmb(&GOLDEN_ENVELOPE, Some(&session)).unwrap();
        assert_eq!((r.from_session, r.dest_conn_id), (true, Some(42)));
    }

    #[test]
    fn source_must_match_twin_and_connection_exactly() {
        let routes = routes_with_svc();
        let session = RmbSession {
            routes: &routes,
            twin: 7,
            sid: Some("app"),
        };
        for source in [
            (7, Some("other")),
            (8, Some("app")),
            (7, None),
            (7, Some("")),
        ] {
            let data = envelope(source, (9, Some("svc")));
            let r = scan_rmb(&data, Some(&session)).unwrap();
            assert!(!r.from_session, "{source:?}");
            assert_eq!(
                r.dest_conn_id,
                Some(42),
                "the lookup does not depend on the source"
            );
        }
        // a session without a sid: only an absent source connection is that session
        let bare = RmbSession {
            sid: None,
            ..session
        };
        let data = envelope((7, None), (9, Some("svc")));
        assert!(scan_rmb(&data, Some(&bare)).unwrap().from_session);
        let data = envelope((7, Some("")), (9, Some("svc")));
        assert!(!scan_rmb(&data, Some(&bare)).unwrap().from_session);
    }

    #[test]
    fn destination_is_the_exact_session_registered_at_scan_time() {
        let mut routes = routes_with_svc();
        routes.register_session(9, None, 43);
        let lookup = |routes: &Routes, dest: (u32, Option<&str>)| {
            let session = RmbSession {
                routes,
                twin: 7,
                sid: Some("app"),
            };
            scan_rmb(&envelope((7, Some("app")), dest), Some(&session))
                .unwrap()
                .dest_conn_id
        };
        assert_eq!(lookup(&routes, (9, Some("svc"))), Some(42));
        assert_eq!(lookup(&routes, (9, None)), Some(43));
        assert_eq!(lookup(&routes, (9, Some(""))), None);
        assert_eq!(lookup(&routes, (10, Some("svc"))), None);
        routes.unregister_session(9, Some("svc"), 42);
        assert_eq!(lookup(&routes, (9, Some("svc"))), None);
    }

    #[test]
    fn invalid_envelope_is_an_envelope_error() {
        let routes = Routes::new();
        let session = RmbSession {
            routes: &routes,
            twin: 7,
            sid: None,
        };
        let err = scan_rmb(&GOLDEN_ENVELOPE[..5], Some(&session)).unwrap_err();
        assert!(matches!(err, Error::Envelope(_)), "{err:?}");
    }

    // ---- SBD ----

    const Z: [u8; 28] = [0; 28];
    const SENDER: [u8; 32] = [2; 32];
    const DEST: [u8; 32] = [1; 32];

    fn command(tag: &[u8; 4], payload: &[u8]) -> Vec<u8> {
        [&Z[..], tag, payload].concat()
    }

    fn forward(payload: &[u8]) -> Vec<u8> {
        [&DEST[..], payload].concat()
    }

    fn masked(message: &[u8]) -> Vec<u8> {
        let mut out = message.to_vec();
        apply_mask(&mut out, MASK);
        out
    }

    /// Scan `message` both as sent by a client (masked) and as already unmasked: same answer.
    fn scan_both(scanner: &SbdScanner, message: &[u8], routes: &Routes) -> Result<SbdRouting> {
        let wire = masked(message);
        let ra = scanner
            .clone()
            .scan(Payload::new(&wire, Some(MASK)), routes, None, 0);
        let rb = scanner
            .clone()
            .scan(Payload::new(message, None), routes, None, 0);
        assert_eq!(ra, rb);
        ra
    }

    fn ready_scanner() -> SbdScanner {
        let mut s = SbdScanner::new(SENDER, "::ffff:10.0.0.1".into());
        s.ready = true;
        s
    }

    fn routes_with_dest() -> Routes {
        let mut routes = Routes::new();
        routes.register_pubkey(&DEST, 5).unwrap();
        routes
    }

    #[test]
    fn golden_commands_are_commands_with_their_tag() {
        let routes = routes_with_dest();
        // spec/sbd.md §1.3: `keep` = Z 6b656570, `lbrt 8000` = Z 6c627274 00001f40
        let keep = [&Z[..], &[0x6b, 0x65, 0x65, 0x70]].concat();
        assert_eq!(keep, command(b"keep", b""));
        let lbrt = [&Z[..], &[0x6c, 0x62, 0x72, 0x74, 0x00, 0x00, 0x1f, 0x40]].concat();
        for (message, tag) in [(keep, *b"keep"), (lbrt, *b"lbrt")] {
            for scanner in [ready_scanner(), SbdScanner::new(SENDER, String::new())] {
                let r = scan_both(&scanner, &message, &routes).unwrap();
                assert_eq!(r.kind, SbdKind::Command { tag });
                assert!(!r.over_limit);
            }
        }
    }

    #[test]
    fn forward_from_a_ready_sender_finds_the_destination() {
        let routes = routes_with_dest();
        let r = scan_both(&ready_scanner(), &forward(b"hi"), &routes).unwrap();
        assert_eq!(
            r,
            SbdRouting {
                kind: SbdKind::Forward {
                    peer: DEST,
                    dest_conn_id: Some(5)
                },
                sender_ready: true,
                over_limit: false,
            }
        );
    }

    #[test]
    fn forward_to_an_unknown_key_has_no_destination() {
        let routes = Routes::new();
        let r = scan_both(&ready_scanner(), &forward(b"hi"), &routes).unwrap();
        assert_eq!(
            r.kind,
            SbdKind::Forward {
                peer: DEST,
                dest_conn_id: None
            }
        );
    }

    #[test]
    fn forward_from_a_sender_not_ready_is_reported_not_routed() {
        let routes = routes_with_dest();
        let scanner = SbdScanner::new(SENDER, String::new());
        let r = scan_both(&scanner, &forward(b"hi"), &routes).unwrap();
        assert!(!r.sender_ready);
        assert_eq!(
            r.kind,
            SbdKind::Forward {
                peer: DEST,
                dest_conn_id: None
            }
        );
    }

    #[test]
    fn header_only_forward_is_valid_and_short_messages_are_errors() {
        let routes = routes_with_dest();
        let r = scan_both(&ready_scanner(), &DEST, &routes).unwrap();
        assert!(matches!(r.kind, SbdKind::Forward { .. }));
        for len in [0, 1, 31] {
            let err = scan_both(&ready_scanner(), &DEST[..len], &routes).unwrap_err();
            assert_eq!(err, sbd::too_short(len));
        }
    }

    #[test]
    fn scan_sbd_looks_up_only_when_asked() {
        let routes = routes_with_dest();
        let message = forward(b"");
        let p = Payload::new(&message, None);
        let found = |route| match scan_sbd(p, &routes, route).unwrap() {
            SbdKind::Forward { dest_conn_id, .. } => dest_conn_id,
            other => panic!("{other:?}"),
        };
        assert_eq!((found(true), found(false)), (Some(5), None));
    }

    #[test]
    fn forward_is_rewritten_to_the_sender_in_one_copy() {
        let message = forward(b"hello, peer");
        let want = [&SENDER[..], b"hello, peer"].concat();
        let wire = masked(&message);
        for p in [
            Payload::new(&wire, Some(MASK)),
            Payload::new(&message, None),
        ] {
            let mut out = vec![0; message.len()];
            write_forward(&mut out, p, &SENDER);
            assert_eq!(out, want);
            // the same bytes the standalone rewrite gives
            assert_eq!(out, sbd::rewrite_forward(&message, &SENDER).unwrap());
        }
    }

    #[test]
    fn every_message_is_charged_its_full_length() {
        // 10 ns per byte, burst 100 bytes: 100 bytes at t=0 pass, one more byte does not
        let routes = routes_with_dest();
        let mut limiter = ByteNanos::new(10, 100);
        let mut scanner = ready_scanner();
        let keep = command(b"keep", b"");
        let fwd = forward(&[7; 36]); // 68 bytes
        let r = scanner
            .scan(Payload::new(&keep, None), &routes, Some(&mut limiter), 0)
            .unwrap();
        assert!(!r.over_limit, "32 bytes");
        let r = scanner
            .scan(Payload::new(&fwd, None), &routes, Some(&mut limiter), 0)
            .unwrap();
        assert!(!r.over_limit, "100 bytes: exactly the burst");
        // the same IP from another connection shares the bucket
        let mut other = SbdScanner::new([3; 32], scanner.ip.clone());
        let r = other
            .scan(Payload::new(&keep, None), &routes, Some(&mut limiter), 0)
            .unwrap();
        assert!(r.over_limit, "the IP's bucket is full");
    }

    #[test]
    fn refused_forward_is_not_routed_and_refusal_sticks() {
        let routes = routes_with_dest();
        let mut limiter = ByteNanos::new(10, 100);
        let mut scanner = ready_scanner();
        let big = forward(&[7; 100]); // 132 bytes > burst
        let r = scanner
            .scan(Payload::new(&big, None), &routes, Some(&mut limiter), 0)
            .unwrap();
        assert_eq!(
            r,
            SbdRouting {
                kind: SbdKind::Forward {
                    peer: DEST,
                    dest_conn_id: None
                },
                sender_ready: true,
                over_limit: true,
            }
        );
        assert!(scanner.refused());
        // long after the debt is paid the connection is still refused, and charges nothing
        let later = 1_000_000_000;
        let small = forward(b"");
        let r = scanner
            .scan(
                Payload::new(&small, None),
                &routes,
                Some(&mut limiter),
                later,
            )
            .unwrap();
        assert!(r.over_limit);
        assert!(
            limiter.check_str(&scanner.ip, 100, later),
            "the refused message was not charged again"
        );
    }

    #[test]
    fn short_messages_are_charged_too() {
        let routes = Routes::new();
        let mut limiter = ByteNanos::new(10, 20);
        let mut scanner = ready_scanner();
        let err = scanner
            .scan(Payload::new(&[9; 31], None), &routes, Some(&mut limiter), 0)
            .unwrap_err();
        assert_eq!(err, sbd::too_short(31));
        assert!(scanner.refused(), "31 bytes over a 20-byte burst");
    }

    #[test]
    fn without_a_limiter_nothing_is_over_the_limit() {
        let routes = routes_with_dest();
        let mut scanner = ready_scanner();
        let big = forward(&[0; 19_968]);
        for now in [0, 0, 0] {
            let r = scanner
                .scan(Payload::new(&big, None), &routes, None, now)
                .unwrap();
            assert!(!r.over_limit);
        }
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

    use super::{scan_rmb, write_forward, RmbRouting, RmbSession, SbdKind};
    use crate::crossing::store_deadline;
    use crate::envelope::py::EnvelopeRouting;
    use crate::envelope::Kind;
    use crate::error::Error;
    use crate::forward::py::Outboxes;
    use crate::limiter::py::{ByteNanosLimiter, FixedWindowLimiter};
    use crate::limiter::FixedWindow;
    use crate::records::py::RecordBuffer;
    use crate::records::Records;
    use crate::routes::py::RouteTable;
    use crate::routes::{ConnId, Remote};
    use crate::sbd::HEADER_LEN;
    use crate::singyeong::py::{SgIndex, SgScanner};
    use crate::singyeong::{self, Decision, Frame, QueueFrame};
    use crate::tunnel_native::py::{NativeTunnel, TunnelScanner, TUNNEL_DECLINED};
    use crate::ws::py::payload_bytes;
    use crate::ws::Payload;

    /// Plain envelope scan of binary messages: no session, so no source check and no lookup.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct EnvelopeScanner;

    #[pymethods]
    impl EnvelopeScanner {
        #[new]
        fn new() -> Self {
            EnvelopeScanner
        }

        fn __repr__(&self) -> &'static str {
            "EnvelopeScanner()"
        }
    }

    /// Envelope scan for one RMB session: source check and destination lookup.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct RmbScanner {
        routes: Py<RouteTable>,
        #[pyo3(get)]
        twin: u32,
        #[pyo3(get)]
        sid: Option<String>,
        /// route records of the messages the scan routes to a local connection (or None)
        records: Option<Py<RecordBuffer>>,
        /// the session's rate limit, checked once per envelope inside `feed` (or None)
        limiter: Option<Py<FixedWindowLimiter>>,
        /// with `outboxes`, local forwards are made inside `feed` (the fast path)
        outboxes: Option<Py<Outboxes>>,
        /// this connection's outbox
        #[pyo3(get)]
        conn_id: u64,
        /// the destination of the last forward (u64::MAX: none): the next envelope is
        /// unmasked straight into its outbox
        last_dest: AtomicU64,
        /// Python is still routing earlier envelopes of this session (its slow path): none
        /// of its envelopes is queued for another instance here meanwhile, or it would
        /// overtake them (per-sender order)
        slow: AtomicBool,
    }

    #[pymethods]
    impl RmbScanner {
        #[new]
        #[pyo3(signature = (routes, twin, sid, records = None, limiter = None, outboxes = None, conn_id = 0))]
        fn new(
            routes: Py<RouteTable>,
            twin: u32,
            sid: Option<String>,
            records: Option<Py<RecordBuffer>>,
            limiter: Option<Py<FixedWindowLimiter>>,
            outboxes: Option<Py<Outboxes>>,
            conn_id: u64,
        ) -> Self {
            RmbScanner {
                routes,
                twin,
                sid,
                records,
                limiter,
                outboxes,
                conn_id,
                last_dest: AtomicU64::new(u64::MAX),
                slow: AtomicBool::new(false),
            }
        }

        /// Python's slow path holds envelopes of this session (see `slow`).
        fn set_slow(&self, slow: bool) {
            self.slow.store(slow, Relaxed);
        }

        #[getter]
        fn slow(&self) -> bool {
            self.slow.load(Relaxed)
        }

        #[getter]
        fn outboxes(&self, py: Python<'_>) -> Option<Py<Outboxes>> {
            self.outboxes.as_ref().map(|o| o.clone_ref(py))
        }

        #[getter]
        fn limiter(&self, py: Python<'_>) -> Option<Py<FixedWindowLimiter>> {
            self.limiter.as_ref().map(|l| l.clone_ref(py))
        }

        #[getter]
        fn records(&self, py: Python<'_>) -> Option<Py<RecordBuffer>> {
            self.records.as_ref().map(|r| r.clone_ref(py))
        }

        #[getter]
        fn routes(&self, py: Python<'_>) -> Py<RouteTable> {
            self.routes.clone_ref(py)
        }

        fn __repr__(&self) -> String {
            format!("RmbScanner(twin={}, sid={:?})", self.twin, self.sid)
        }
    }

    /// Scanner of one SBD connection: limiter charge, classification, lookup, one-copy rewrite.
    #[pyclass(module = "rmb_relay._core")]
    pub struct SbdScanner {
        routes: Py<RouteTable>,
        limiter: Option<Py<ByteNanosLimiter>>,
        inner: super::SbdScanner,
        /// route records of the forwards the scan routes to a local connection (or None)
        records: Option<Py<RecordBuffer>>,
        /// this connection's key in `records` (interned on its first record)
        record_id: Option<i64>,
        /// the last destination key recorded and its id: a connection mostly sends to the
        /// same peer, and comparing 32 bytes costs less than hashing them (~25 ns a forward)
        record_peer: Option<([u8; HEADER_LEN], i64)>,
        /// with `outboxes`, forwards to local keys are made inside `feed` (the fast path)
        outboxes: Option<Py<Outboxes>>,
        /// this connection's outbox
        #[pyo3(get)]
        conn_id: u64,
        /// the clock reading of the last forward made by the fast path (0: none): activity
        /// Python did not see message by message (the idle timeout reads it)
        #[pyo3(get)]
        active_at: u64,
    }

    #[pymethods]
    impl SbdScanner {
        #[new]
        #[pyo3(
            signature = (routes, pubkey, limiter = None, ip = String::new(), records = None, outboxes = None, conn_id = 0),
            text_signature = "(routes, pubkey, limiter=None, ip='', records=None, outboxes=None, conn_id=0)"
        )]
        fn new(
            routes: Py<RouteTable>,
            pubkey: &[u8],
            limiter: Option<Py<ByteNanosLimiter>>,
            ip: String,
            records: Option<Py<RecordBuffer>>,
            outboxes: Option<Py<Outboxes>>,
            conn_id: u64,
        ) -> PyResult<Self> {
            let pubkey: [u8; HEADER_LEN] = pubkey.try_into().map_err(|_| {
                Error::InvalidArgument(format!(
                    "pubkey must be {HEADER_LEN} bytes, got {}",
                    pubkey.len()
                ))
            })?;
            Ok(SbdScanner {
                routes,
                limiter,
                inner: super::SbdScanner::new(pubkey, ip),
                records,
                record_id: None,
                record_peer: None,
                outboxes,
                conn_id,
                active_at: 0,
            })
        }

        #[getter]
        fn outboxes(&self, py: Python<'_>) -> Option<Py<Outboxes>> {
            self.outboxes.as_ref().map(|o| o.clone_ref(py))
        }

        #[getter]
        fn records(&self, py: Python<'_>) -> Option<Py<RecordBuffer>> {
            self.records.as_ref().map(|r| r.clone_ref(py))
        }

        #[getter]
        fn ready(&self) -> bool {
            self.inner.ready
        }

        #[setter]
        fn set_ready(&mut self, ready: bool) {
            self.inner.ready = ready;
        }

        #[getter]
        fn over_limit(&self) -> bool {
            self.inner.refused()
        }

        #[getter]
        fn pubkey<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.pubkey)
        }

        #[getter]
        fn ip(&self) -> &str {
            &self.inner.ip
        }

        #[getter]
        fn routes(&self, py: Python<'_>) -> Py<RouteTable> {
            self.routes.clone_ref(py)
        }

        #[getter]
        fn limiter(&self, py: Python<'_>) -> Option<Py<ByteNanosLimiter>> {
            self.limiter.as_ref().map(|l| l.clone_ref(py))
        }

        fn __repr__(&self) -> String {
            format!(
                "SbdScanner(ip={:?}, ready={}, over_limit={})",
                self.inner.ip,
                self.inner.ready,
                self.inner.refused()
            )
        }
    }

    /// What an `SbdScanner` made of one message.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct SbdRouting {
        routing: super::SbdRouting,
        /// a command's whole message: its payload is read from here when asked
        command: Option<Py<PyBytes>>,
        /// index of this message's route record in the scanner's `RecordBuffer` (-1: none)
        #[pyo3(get)]
        record: i64,
    }

    #[pymethods]
    impl SbdRouting {
        #[getter]
        fn kind(&self) -> i64 {
            match self.routing.kind {
                SbdKind::Command { .. } => 0,
                SbdKind::Forward { .. } => 1,
            }
        }

        #[getter]
        fn tag<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            match &self.routing.kind {
                SbdKind::Command { tag } => PyBytes::new(py, tag),
                SbdKind::Forward { .. } => PyBytes::new(py, b""),
            }
        }

        #[getter]
        fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            match &self.command {
                Some(data) => PyBytes::new(py, &data.as_bytes(py)[HEADER_LEN..]),
                None => PyBytes::new(py, b""),
            }
        }

        #[getter]
        fn peer<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            match &self.routing.kind {
                SbdKind::Forward { peer, .. } => PyBytes::new(py, peer),
                SbdKind::Command { .. } => PyBytes::new(py, b""),
            }
        }

        #[getter]
        fn dest_conn_id(&self) -> Option<u64> {
            match self.routing.kind {
                SbdKind::Forward { dest_conn_id, .. } => dest_conn_id,
                SbdKind::Command { .. } => None,
            }
        }

        #[getter]
        fn over_limit(&self) -> bool {
            self.routing.over_limit
        }

        #[getter]
        fn sender_ready(&self) -> bool {
            self.routing.sender_ready
        }

        fn __repr__(&self) -> String {
            match self.routing.kind {
                SbdKind::Command { tag } => format!(
                    "<SbdRouting command {:?} over_limit={}>",
                    String::from_utf8_lossy(&tag),
                    self.routing.over_limit
                ),
                SbdKind::Forward { dest_conn_id, .. } => format!(
                    "<SbdRouting forward dest_conn_id={dest_conn_id:?} sender_ready={} over_limit={}>",
                    self.routing.sender_ready, self.routing.over_limit
                ),
            }
        }
    }

    /// The scanner a decoder holds, as Python passed it.
    #[derive(FromPyObject)]
    pub enum Scanner {
        Envelope(Py<EnvelopeScanner>),
        Rmb(Py<RmbScanner>),
        Sbd(Py<SbdScanner>),
        Sg(Py<SgScanner>),
        Tunnel(Py<TunnelScanner>),
    }

    impl Scanner {
        pub fn object(&self, py: Python<'_>) -> Py<PyAny> {
            match self {
                Scanner::Envelope(s) => s.clone_ref(py).into_any(),
                Scanner::Rmb(s) => s.clone_ref(py).into_any(),
                Scanner::Sbd(s) => s.clone_ref(py).into_any(),
                Scanner::Sg(s) => s.clone_ref(py).into_any(),
                Scanner::Tunnel(s) => s.clone_ref(py).into_any(),
            }
        }

        /// Borrow what scanning needs, once per `feed` (the table as it is during that feed).
        pub fn start<'a, 'py>(&'a self, py: Python<'py>) -> PyResult<Feed<'a, 'py>> {
            Ok(match self {
                Scanner::Envelope(_) => Feed::Envelope,
                Scanner::Rmb(s) => {
                    let s = s.get();
                    Feed::Rmb {
                        routes: s.routes.bind(py).try_borrow()?,
                        twin: s.twin,
                        sid: s.sid.as_deref(),
                        records: match &s.records {
                            Some(r) => Some(r.bind(py).try_borrow_mut()?),
                            None => None,
                        },
                        limiter: match &s.limiter {
                            Some(l) => Some(l.bind(py).try_borrow_mut()?),
                            None => None,
                        },
                        outboxes: open_outboxes(py, s.outboxes.as_ref(), s.conn_id)?,
                        last_dest: &s.last_dest,
                        cross: !s.slow.load(Relaxed),
                    }
                }
                Scanner::Sbd(s) => {
                    let scanner = s.bind(py).try_borrow_mut()?;
                    let routes = scanner.routes.bind(py).try_borrow()?;
                    let limiter = match &scanner.limiter {
                        Some(l) => Some(l.bind(py).try_borrow_mut()?),
                        None => None,
                    };
                    let records = match &scanner.records {
                        Some(r) => Some(r.bind(py).try_borrow_mut()?),
                        None => None,
                    };
                    let outboxes = open_outboxes(py, scanner.outboxes.as_ref(), scanner.conn_id)?;
                    Feed::Sbd {
                        scanner,
                        routes,
                        limiter,
                        records,
                        outboxes,
                    }
                }
                Scanner::Sg(s) => {
                    let s = s.get();
                    Feed::Sg {
                        index: s.index.bind(py).try_borrow_mut()?,
                        outboxes: if s.ready.load(Relaxed) {
                            open_outboxes(py, Some(&s.outboxes), s.conn_id)?
                        } else {
                            None
                        },
                        scratch: Vec::new(),
                        batch: Vec::new(),
                    }
                }
                Scanner::Tunnel(s) => {
                    let s = s.get();
                    Feed::Tunnel {
                        table: s.table.bind(py).try_borrow_mut()?,
                        outboxes: open_outboxes(py, Some(&s.outboxes), s.conn_id)?,
                        connector: s.conn_id,
                        binary: s.binary,
                        scratch: Vec::new(),
                    }
                }
            })
        }
    }

    /// The outboxes, borrowed for one `feed`, when the fast path may forward this connection's
    /// messages: it has them and it is open (data after our close frame is only discarded).
    fn open_outboxes<'py>(
        py: Python<'py>,
        outboxes: Option<&Py<Outboxes>>,
        conn_id: u64,
    ) -> PyResult<Option<PyRefMut<'py, Outboxes>>> {
        match outboxes {
            Some(o) => {
                let o = o.bind(py).try_borrow_mut()?;
                Ok(o.inner.is_open(conn_id).then_some(o))
            }
            None => Ok(None),
        }
    }

    /// A scanner with its table (and limiter) borrowed for the length of one `feed`.
    pub enum Feed<'a, 'py> {
        Envelope,
        Rmb {
            routes: PyRef<'py, RouteTable>,
            twin: u32,
            sid: Option<&'a str>,
            records: Option<PyRefMut<'py, RecordBuffer>>,
            limiter: Option<PyRefMut<'py, FixedWindowLimiter>>,
            outboxes: Option<PyRefMut<'py, Outboxes>>,
            last_dest: &'a AtomicU64,
            /// envelopes may be queued for other instances (remote routes) in this feed
            cross: bool,
        },
        Sbd {
            scanner: PyRefMut<'py, SbdScanner>,
            routes: PyRef<'py, RouteTable>,
            limiter: Option<PyRefMut<'py, ByteNanosLimiter>>,
            records: Option<PyRefMut<'py, RecordBuffer>>,
            outboxes: Option<PyRefMut<'py, Outboxes>>,
        },
        /// a 신경 JSON connection: SEND/BROADCAST answered by the index (`singyeong.rs`)
        /// while `outboxes` is set (the client is ready and nothing went to Python yet)
        Sg {
            index: PyRefMut<'py, SgIndex>,
            outboxes: Option<PyRefMut<'py, Outboxes>>,
            /// the message unmasked, reused across the feed's messages
            scratch: Vec<u8>,
            /// queue frames read since the last event, for Python as one batch (`take_batch`)
            batch: Vec<Py<PyAny>>,
        },
        /// a tunnel connector: its `Deliver`s answered by the native express table
        /// (`tunnel_native.rs`) while `outboxes` is set
        Tunnel {
            table: PyRefMut<'py, NativeTunnel>,
            outboxes: Option<PyRefMut<'py, Outboxes>>,
            connector: u64,
            /// msgpack in binary frames, else JSON in text frames
            binary: bool,
            /// the message unmasked, reused across the feed's messages
            scratch: Vec<u8>,
        },
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

    /// A message's data as Python gets it, its routing, and why it has none.
    pub type Scanned = (Py<PyBytes>, Option<Py<PyAny>>, Option<String>);

    impl Feed<'_, '_> {
        /// Scan one message and, when the fast path takes it, forward it into its
        /// destination's outbox (None: nothing for Python); else copy it out of the frame
        /// (exactly once) for Python with its routing. `now` is the caller's clock in
        /// nanoseconds, for the limiters and the route records.
        ///
        /// Once a message of this feed goes to Python, the later ones do too: Python handles
        /// them after it, in order, and may close the connection over it (a text frame, an
        /// invalid envelope), after which what follows must not have been forwarded.
        pub fn message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            now: u64,
        ) -> PyResult<Option<Scanned>> {
            let scanned = self.scan_message(py, is_text, payload, now)?;
            if scanned.is_some() {
                match self {
                    Feed::Envelope => {}
                    Feed::Rmb { outboxes, .. }
                    | Feed::Sbd { outboxes, .. }
                    | Feed::Sg { outboxes, .. }
                    | Feed::Tunnel { outboxes, .. } => *outboxes = None,
                }
            }
            Ok(scanned)
        }

        /// Queue frames read since the last event (None: none), to go before it.
        pub fn take_batch(&mut self) -> Option<Vec<Py<PyAny>>> {
            match self {
                Feed::Sg { batch, .. } if !batch.is_empty() => Some(std::mem::take(batch)),
                _ => None,
            }
        }

        fn scan_message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            now: u64,
        ) -> PyResult<Option<Scanned>> {
            match self {
                Feed::Envelope => envelope_message(py, is_text, payload).map(Some),
                Feed::Tunnel {
                    table,
                    outboxes,
                    connector,
                    binary,
                    scratch,
                } => {
                    // a frame of the other kind is Python's (it answers the error)
                    let Some(ob) = outboxes.as_mut().filter(|_| is_text != *binary) else {
                        return Ok(Some((payload_bytes(py, payload)?, None, None)));
                    };
                    scratch.clear();
                    scratch.resize(payload.len(), 0);
                    payload.copy_to(scratch);
                    // `now`: the dialect's scan clock, the hub's (route records' times)
                    let now = now as i64;
                    if table.deliver_into(scratch, *binary, *connector, now, &mut ob.inner) {
                        Ok(None)
                    } else {
                        let declined = Some(TUNNEL_DECLINED.to_owned());
                        Ok(Some((PyBytes::new(py, scratch).unbind(), None, declined)))
                    }
                }
                Feed::Sg {
                    index,
                    outboxes,
                    scratch,
                    batch,
                } => {
                    let Some(ob) = outboxes.as_mut().filter(|_| is_text) else {
                        return Ok(Some((payload_bytes(py, payload)?, None, None)));
                    };
                    scratch.clear();
                    scratch.resize(payload.len(), 0);
                    payload.copy_to(scratch);
                    let python = || Ok(Some((PyBytes::new(py, scratch).unbind(), None, None)));
                    match singyeong::read(scratch) {
                        // `now` is the wall clock here (the dialect's scan_clock): `ts` in ms
                        // queue frames wait for Python (the batch) and go before this one:
                        // answered here, it would overtake them (a DISPATCH before the
                        // QUEUE_CONFIRM, or after an op 8 close over the batch)
                        Some(Frame::Route(_)) if !batch.is_empty() => python(),
                        Some(Frame::Route(r)) => {
                            match index.inner.deliver(&r, now / 1_000_000, &mut ob.inner) {
                                Decision::Delivered(_) => Ok(None),
                                Decision::Python => python(),
                            }
                        }
                        Some(Frame::Queue(q)) => {
                            batch.push(queue_tuple(py, &q, scratch.len())?);
                            Ok(None)
                        }
                        None => python(),
                    }
                }
                Feed::Rmb {
                    routes,
                    twin,
                    sid,
                    records,
                    limiter,
                    outboxes,
                    last_dest,
                    cross,
                } => {
                    if is_text {
                        // RMB has no text messages: Python closes the connection
                        return Ok(Some((payload_bytes(py, payload)?, None, None)));
                    }
                    let session = RmbSession {
                        routes: &routes.inner,
                        twin: *twin,
                        sid: *sid,
                    };
                    let limiter = limiter.as_mut().map(|l| &mut l.inner);
                    let records = records.as_mut().map(|r| &mut r.inner);
                    let Some(outboxes) = outboxes.as_mut() else {
                        let data = payload_bytes(py, payload)?.into_bound(py);
                        let bytes = data.as_bytes();
                        return Ok(Some(match scan_rmb(bytes, Some(&session)) {
                            Err(err) => (data.clone().unbind(), None, Some(err.to_string())),
                            Ok(r) => {
                                let limited = over_limit(limiter, &session, bytes.len(), now);
                                let local = local_destination(&r, limited);
                                let twin = session.twin;
                                rmb_python(
                                    py, &data, bytes, &r, limited, local, records, twin, now,
                                )?
                            }
                        }));
                    };
                    let ob = &mut outboxes.inner;
                    // unmasked into the outbox of this sender's last destination (most
                    // senders keep to one): when that is where it goes, copied once
                    let guess = match last_dest.load(Relaxed) {
                        u64::MAX => None,
                        id => Some(id),
                    };
                    let staged = ob.stage(guess, payload.len(), |out| payload.copy_to(out));
                    let size = payload.len();
                    // scanned once: either forwarded here, queued for the instance holding
                    // its destination, or handed to Python with what the scan found (a copy of
                    // the staged bytes, the routing view of them)
                    let cross = *cross && ob.crossing.open;
                    let ttl = ob.crossing.mailbox_ttl;
                    let decided = {
                        let data = ob.staged(&staged);
                        match scan_rmb(data, Some(&session)) {
                            Err(err) => Decided::Python((
                                PyBytes::new(py, data).unbind(),
                                None,
                                Some(err.to_string()),
                            )),
                            Ok(r) => {
                                let limited = over_limit(limiter, &session, size, now);
                                let local = local_destination(&r, limited);
                                let remote = if cross && local.is_none() {
                                    remote_destination(&r, limited, &session, now)
                                } else {
                                    None
                                };
                                match (local.filter(|(dest, _)| ob.accepts(*dest)), remote) {
                                    (Some((dest, dest_twin)), _) => {
                                        if let Some(records) = records {
                                            let (src, dst) = (session.twin, dest_twin);
                                            records.push(now, i64::from(src), i64::from(dst), size);
                                        }
                                        last_dest.store(dest, Relaxed);
                                        Decided::Local
                                    }
                                    (None, Some(remote)) => {
                                        let f = &r.fields;
                                        let deadline = store_deadline(
                                            f.fail_fast(),
                                            f.timestamp,
                                            f.expiration,
                                            seconds(now),
                                            ttl,
                                        );
                                        Decided::Cross(remote, deadline)
                                    }
                                    (None, None) => {
                                        let bytes = PyBytes::new(py, data);
                                        let twin = session.twin;
                                        Decided::Python(rmb_python(
                                            py, &bytes, data, &r, limited, local, records, twin,
                                            now,
                                        )?)
                                    }
                                }
                            }
                        }
                    };
                    match decided {
                        Decided::Python(scanned) => {
                            ob.release(staged);
                            Ok(Some(scanned))
                        }
                        Decided::Local => {
                            let dest = last_dest.load(Relaxed);
                            ob.commit(staged, dest);
                            ob.rmb.add(size);
                            Ok(None)
                        }
                        Decided::Cross(remote, deadline) => {
                            ob.cross(staged, remote.instance, &remote.name, deadline);
                            Ok(None)
                        }
                    }
                }
                Feed::Sbd {
                    scanner,
                    routes,
                    limiter,
                    records,
                    outboxes,
                } => {
                    let limiter = limiter.as_mut().map(|l| &mut l.inner);
                    // text frames count as their UTF-8 bytes (spec/sbd.md §1.2)
                    let scanned = scanner.inner.scan(payload, &routes.inner, limiter, now);
                    let routing = match scanned {
                        Err(err) => {
                            return Ok(Some((
                                payload_bytes(py, payload)?,
                                None,
                                Some(err.to_string()),
                            )))
                        }
                        Ok(routing) => routing,
                    };
                    let mut record = -1;
                    if let (
                        Some(records),
                        SbdKind::Forward {
                            peer,
                            dest_conn_id: Some(_),
                        },
                    ) = (records.as_mut(), &routing.kind)
                    {
                        let records = &mut records.inner;
                        let src = match scanner.record_id {
                            Some(id) => id,
                            None => {
                                let id = records.key_id(&scanner.inner.pubkey);
                                scanner.record_id = Some(id);
                                id
                            }
                        };
                        let dst = match scanner.record_peer {
                            Some((key, id)) if key == *peer => id,
                            _ => {
                                let id = records.key_id(peer);
                                scanner.record_peer = Some((*peer, id));
                                id
                            }
                        };
                        record = records.push(now, src, dst, payload.len());
                    }
                    // the fast path: a forward from a ready sender within its budget (only
                    // those were looked up) to a key connected here
                    if let (
                        Some(outboxes),
                        SbdKind::Forward {
                            dest_conn_id: Some(dest),
                            ..
                        },
                    ) = (outboxes.as_mut(), &routing.kind)
                    {
                        let sender = &scanner.inner.pubkey;
                        let ob = &mut outboxes.inner;
                        if ob.forward(*dest, crate::ws::OP_BINARY, payload.len(), |out| {
                            write_forward(out, payload, sender)
                        }) {
                            ob.sbd.add(payload.len());
                            scanner.active_at = now;
                            return Ok(None);
                        }
                    }
                    let (data, command) = match routing.kind {
                        SbdKind::Forward { .. } => {
                            let sender = &scanner.inner.pubkey;
                            let data = PyBytes::new_with(py, payload.len(), |out| {
                                write_forward(out, payload, sender);
                                Ok(())
                            })?;
                            (data.unbind(), None)
                        }
                        SbdKind::Command { .. } => {
                            let data = payload_bytes(py, payload)?;
                            let command = data.clone_ref(py);
                            (data, Some(command))
                        }
                    };
                    let routing = Py::new(
                        py,
                        SbdRouting {
                            routing,
                            command,
                            record,
                        },
                    )?;
                    Ok(Some((data, Some(routing.into_any()), None)))
                }
            }
        }
    }

    /// What the fast path does with one RMB envelope.
    enum Decided<'r> {
        /// forwarded to a local connection
        Local,
        /// queued for another instance (its remote route), with the deadline it carries
        Cross(&'r Remote, u64),
        /// handed to Python
        Python(Scanned),
    }

    /// The remote route an envelope may be queued on by the session that sent it: as for a
    /// local destination (its own source, within its limit, not a ping, a destination
    /// given), no local connection holds the destination, and another instance does (an
    /// unexpired remote route). What Python's `RmbDialect.forward_now` would queue.
    fn remote_destination<'r>(
        r: &RmbRouting<'_>,
        limited: bool,
        session: &RmbSession<'r>,
        now: u64,
    ) -> Option<&'r Remote> {
        let f = &r.fields;
        if limited
            || !r.from_session
            || f.kind == Kind::Ping
            || f.dest_twin == 0
            || r.dest_conn_id.is_some()
        {
            return None;
        }
        session
            .routes
            .lookup_remote(f.dest_twin, f.dest_connection, now)
    }

    /// Whole seconds of a nanosecond clock reading (RMB's limiter counts in windows of seconds).
    fn seconds(now: u64) -> u64 {
        now / 1_000_000_000
    }

    /// Binary messages are envelopes; text ones are passed on unscanned. No session: no
    /// source check, no lookup.
    fn envelope_message(py: Python<'_>, is_text: bool, payload: Payload<'_>) -> PyResult<Scanned> {
        let data = payload_bytes(py, payload)?;
        if is_text {
            return Ok((data, None, None));
        }
        let bound = data.bind(py);
        match scan_rmb(bound.as_bytes(), None) {
            Ok(r) => {
                let routing = EnvelopeRouting::new(bound, &r.fields, false, None);
                Ok((data, Some(Py::new(py, routing)?.into_any()), None))
            }
            Err(err) => Ok((data, None, Some(err.to_string()))),
        }
    }

    /// Whether the session is over its rate limit with this envelope (asked once per
    /// envelope, as rmb-rs does; never without a limiter).
    fn over_limit(
        limiter: Option<&mut FixedWindow<u32>>,
        session: &RmbSession<'_>,
        size: usize,
        now: u64,
    ) -> bool {
        limiter.is_some_and(|l| !l.check(session.twin, size as u64, seconds(now)))
    }

    /// The local connection (and its twin) a scanned envelope may be forwarded to by the
    /// session that sent it: its own source, within its limit, not a ping, a destination given
    /// and found in the route table. The fast path forwards to it when it takes the message;
    /// otherwise Python does, and the route record is written here for it either way.
    fn local_destination(r: &RmbRouting<'_>, limited: bool) -> Option<(ConnId, u32)> {
        let f = &r.fields;
        if limited || !r.from_session || f.kind == Kind::Ping || f.dest_twin == 0 {
            return None;
        }
        r.dest_conn_id.map(|dest| (dest, f.dest_twin))
    }

    /// An RMB session's envelope for Python: `data` (the bytes `base` was scanned from, or a
    /// copy of them), the routing view of scan `r` with the limiter's answer and, with
    /// `records` and a `local` destination, the route record at `now` (Python retracts it if
    /// the destination is gone by the time it routes the message).
    #[allow(clippy::too_many_arguments)]
    fn rmb_python(
        py: Python<'_>,
        data: &Bound<'_, PyBytes>,
        base: &[u8],
        r: &RmbRouting<'_>,
        limited: bool,
        local: Option<(ConnId, u32)>,
        records: Option<&mut Records>,
        twin: u32,
        now: u64,
    ) -> PyResult<Scanned> {
        let mut routing =
            EnvelopeRouting::with_base(data, base, &r.fields, r.from_session, r.dest_conn_id);
        routing.limited = limited;
        if let (Some(records), Some((_, dest_twin))) = (records, local) {
            routing.record = records.push(now, i64::from(twin), i64::from(dest_twin), base.len());
        }
        let routing = Py::new(py, routing)?.into_any();
        Ok((data.clone().unbind(), Some(routing), None))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<EnvelopeScanner>()?;
        m.add_class::<RmbScanner>()?;
        m.add_class::<SbdScanner>()?;
        m.add_class::<SbdRouting>()?;
        // The stub's `Scanner` alias, real at runtime so `isinstance(s, Scanner)` works.
        let py = m.py();
        let union = py
            .get_type::<EnvelopeScanner>()
            .into_any()
            .call_method1("__or__", (py.get_type::<RmbScanner>(),))?
            .call_method1("__or__", (py.get_type::<SbdScanner>(),))?
            .call_method1("__or__", (py.get_type::<SgScanner>(),))?
            .call_method1("__or__", (py.get_type::<TunnelScanner>(),))?;
        m.add("Scanner", union)?;
        Ok(())
    }
}
