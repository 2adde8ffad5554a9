//! The SBD connection scanner: the sender IP's byte-nanos charge, then command or forward from
//! the 32-byte header alone (the rest stays masked), and for a forward from a ready sender the
//! connection holding the destination key. [`write_forward`] writes the rewritten forward (the
//! sender's key, then the payload unmasked) in the same copy that takes it off the wire.
//! Everything above `py` is pure: the route table, the limiter and the time are arguments.
//!
//! Lookups see the table as it is at scan time: a handshake completing while Python handles one
//! message of a read is not seen by the later messages of that read.

use crate::codec::mask::Payload;
use crate::dialects::sbd::header::{self as sbd, Header, HEADER_LEN};
use crate::error::Result;
use crate::forward::routes::{ConnId, Routes};
use crate::limiter::ByteNanos;

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
    use crate::codec::mask::apply_mask;

    const MASK: [u8; 4] = [0x37, 0xfa, 0x21, 0x3d];

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

    use super::{write_forward, SbdKind};
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::py::payload_bytes;
    use crate::codec::mask::Payload;
    use crate::codec::ws::OP_BINARY;
    use crate::dialects::sbd::header::HEADER_LEN;
    use crate::error::Error;
    use crate::forward::outboxes::py::{open_outboxes, Outboxes};
    use crate::forward::routes::py::RouteTable;
    use crate::limiter::py::ByteNanosLimiter;
    use crate::records::py::RecordBuffer;

    /// Scanner of one SBD connection: limiter charge, classification, lookup, one-copy rewrite.
    #[pyclass(extends = Scanner, module = "rmb_relay._core")]
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
        ) -> PyResult<(Self, Scanner)> {
            let pubkey: [u8; HEADER_LEN] = pubkey.try_into().map_err(|_| {
                Error::InvalidArgument(format!(
                    "pubkey must be {HEADER_LEN} bytes, got {}",
                    pubkey.len()
                ))
            })?;
            let scanner = SbdScanner {
                routes,
                limiter,
                inner: super::SbdScanner::new(pubkey, ip),
                records,
                record_id: None,
                record_peer: None,
                outboxes,
                conn_id,
                active_at: 0,
            };
            Ok((scanner, Scanner::new(start_sbd)))
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

    /// An SBD connection's scanner with its table, limiter, records and outboxes borrowed for
    /// one `feed`.
    struct SbdFeed<'py> {
        scanner: PyRefMut<'py, SbdScanner>,
        routes: PyRef<'py, RouteTable>,
        limiter: Option<PyRefMut<'py, ByteNanosLimiter>>,
        records: Option<PyRefMut<'py, RecordBuffer>>,
        outboxes: Option<PyRefMut<'py, Outboxes>>,
    }

    fn start_sbd<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let py = scanner.py();
        let scanner = scanner.downcast::<SbdScanner>()?.try_borrow_mut()?;
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
        Ok(Box::new(SbdFeed {
            scanner,
            routes,
            limiter,
            records,
            outboxes,
        }))
    }

    impl ScanFeed for SbdFeed<'_> {
        fn message(
            &mut self,
            py: Python<'_>,
            _is_text: bool,
            payload: Payload<'_>,
            now: u64,
            fast: bool,
        ) -> PyResult<Option<Scanned>> {
            let limiter = self.limiter.as_mut().map(|l| &mut l.inner);
            // text frames count as their UTF-8 bytes (spec/sbd.md §1.2)
            let scanned = self
                .scanner
                .inner
                .scan(payload, &self.routes.inner, limiter, now);
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
            ) = (self.records.as_mut(), &routing.kind)
            {
                let records = &mut records.inner;
                let src = match self.scanner.record_id {
                    Some(id) => id,
                    None => {
                        let id = records.key_id(&self.scanner.inner.pubkey);
                        self.scanner.record_id = Some(id);
                        id
                    }
                };
                let dst = match self.scanner.record_peer {
                    Some((key, id)) if key == *peer => id,
                    _ => {
                        let id = records.key_id(peer);
                        self.scanner.record_peer = Some((*peer, id));
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
            ) = (self.outboxes.as_mut().filter(|_| fast), &routing.kind)
            {
                let sender = &self.scanner.inner.pubkey;
                let ob = &mut outboxes.inner;
                if ob.forward(*dest, OP_BINARY, payload.len(), |out| {
                    write_forward(out, payload, sender)
                }) {
                    ob.count(*dest, payload.len());
                    self.scanner.active_at = now;
                    return Ok(None);
                }
            }
            let (data, command) = match routing.kind {
                SbdKind::Forward { .. } => {
                    let sender = &self.scanner.inner.pubkey;
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

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<SbdScanner>()?;
        m.add_class::<SbdRouting>()
    }
}
