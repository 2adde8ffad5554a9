//! The RMB session scanner: what the fast path decides about each envelope a session sends,
//! while the websocket decoder still holds its bytes (codec/scanner.rs).
//!
//! For a bound session: the envelope's routing fields ([`envelope::scan`]), whether the source
//! is exactly that session, and which local connection holds the destination ([`scan_rmb`]);
//! then [`decide`]: forward it to a local connection whose outbox accepts it, queue it for the
//! instance holding its destination (a remote route), or hand it to Python (everything else:
//! pings, errors, the mailbox, federation, a congested receiver, a sender over its limit).
//! Everything above `py` is pure: the route table, the limiter and the time are arguments.
//!
//! Lookups see the table as it is at scan time: a whole read is scanned before the dialect
//! handles its first message, so a change the dialect makes while handling one message (a
//! session registering) is not seen by the later messages of that read.

use crate::dialects::rmb::envelope::{self, Kind, Routing};
use crate::error::Result;
use crate::forward::routes::{ConnId, Remote, Routes};
use crate::limiter::FixedWindow;

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

/// Whole seconds of a nanosecond clock reading (RMB's limiter counts in windows of seconds).
pub fn seconds(now: u64) -> u64 {
    now / 1_000_000_000
}

/// Whether the session is over its rate limit with this envelope (asked once per envelope, as
/// rmb-rs does; never without a limiter).
pub fn over_limit(
    limiter: Option<&mut FixedWindow<u32>>,
    twin: u32,
    size: usize,
    now: u64,
) -> bool {
    limiter.is_some_and(|l| !l.check(twin, size as u64, seconds(now)))
}

/// The envelopes the fast path may route at all: from the session itself, within its limit,
/// not a ping, with a destination.
fn routable(r: &RmbRouting<'_>, limited: bool) -> bool {
    let f = &r.fields;
    !limited && r.from_session && f.kind != Kind::Ping && f.dest_twin != 0
}

/// The local connection (and its twin) a scanned envelope may be forwarded to: routable and
/// its destination found in the route table. The fast path forwards to it when its outbox
/// accepts; otherwise Python does, and the route record is written for it either way.
pub fn local_destination(r: &RmbRouting<'_>, limited: bool) -> Option<(ConnId, u32)> {
    if !routable(r, limited) {
        return None;
    }
    r.dest_conn_id.map(|dest| (dest, r.fields.dest_twin))
}

/// Until when an envelope may wait in a mailbox (unix seconds; 0: never, fail-fast), as
/// `RmbDialect.store_deadline` and `Mailbox.deadline` say: its own expiry (from its timestamp,
/// or from now without one), at most the mailbox's TTL from now.
pub fn store_deadline(
    fail_fast: bool,
    timestamp: u64,
    expiration: u64,
    now_secs: u64,
    mailbox_ttl: u64,
) -> u64 {
    if fail_fast {
        return 0;
    }
    let own = if timestamp != 0 {
        timestamp.saturating_add(expiration)
    } else {
        now_secs.saturating_add(expiration)
    };
    own.min(now_secs.saturating_add(mailbox_ttl))
}

/// What the fast path does with one envelope of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision<'r> {
    /// forward to this local connection (its twin, for the route record)
    Local(ConnId, u32),
    /// queue for the instance holding the destination (an unexpired remote route)
    Cross(&'r Remote),
    /// hand to Python with what the scan found
    Python,
}

/// Decide an envelope: a routable one for a local connection whose outbox `accepts`; else,
/// when `cross` (the session's earlier envelopes are not still with Python, and the crossing
/// is open) and no local connection holds its destination, one another instance holds;
/// else Python.
pub fn decide<'r>(
    r: &RmbRouting<'_>,
    session: &RmbSession<'r>,
    limited: bool,
    accepts: impl Fn(ConnId) -> bool,
    cross: bool,
    now: u64,
) -> Decision<'r> {
    if let Some((dest, twin)) = local_destination(r, limited) {
        return if accepts(dest) {
            Decision::Local(dest, twin)
        } else {
            Decision::Python
        };
    }
    if cross && routable(r, limited) && r.dest_conn_id.is_none() {
        let f = &r.fields;
        if let Some(remote) = session
            .routes
            .lookup_remote(f.dest_twin, f.dest_connection, now)
        {
            return Decision::Cross(remote);
        }
    }
    Decision::Python
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialects::rmb::envelope::{Address, Envelope};
    use crate::error::Error;

    /// uid "u", source {7, "app"}, destination {9, "svc"}, request {command "c"}
    const GOLDEN_ENVELOPE: [u8; 26] = [
        0x0a, 0x01, b'u', // uid
        0x2a, 0x07, 0x08, 0x07, 0x12, 0x03, b'a', b'p', b'p', // source
        0x32, 0x07, 0x08, 0x09, 0x12, 0x03, b's', b'v', b'c', // destination
        0x3a, 0x03, 0x0a, 0x01, b'c', // request
    ];

    fn envelope(source: (u32, Option<&str>), dest: (u32, Option<&str>)) -> Vec<u8> {
        envelope_of(source, dest, Kind::Request)
    }

    fn envelope_of(source: (u32, Option<&str>), dest: (u32, Option<&str>), kind: Kind) -> Vec<u8> {
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
            kind,
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

    #[test]
    fn deadline_follows_the_mailbox_rule() {
        let now = 1_000;
        assert_eq!(store_deadline(true, 900, 300, now, 3600), 0, "fail-fast");
        assert_eq!(store_deadline(false, 900, 300, now, 3600), 1_200);
        assert_eq!(
            store_deadline(false, 0, 300, now, 3600),
            1_300,
            "no timestamp"
        );
        assert_eq!(
            store_deadline(false, 900, 10_000, now, 3600),
            4_600,
            "capped"
        );
        assert_eq!(store_deadline(false, u64::MAX, 1, now, 3600), 4_600);
    }

    // ---- decide ----

    fn session(routes: &Routes) -> RmbSession<'_> {
        RmbSession {
            routes,
            twin: 7,
            sid: Some("app"),
        }
    }

    fn decision_of(
        routes: &Routes,
        data: &[u8],
        limited: bool,
        accepts: bool,
        cross: bool,
    ) -> String {
        let s = session(routes);
        let r = scan_rmb(data, Some(&s)).unwrap();
        match decide(&r, &s, limited, |_| accepts, cross, 0) {
            Decision::Local(dest, twin) => format!("local {dest} {twin}"),
            Decision::Cross(remote) => format!("cross {}", remote.instance),
            Decision::Python => "python".to_owned(),
        }
    }

    #[test]
    fn a_routable_envelope_for_an_accepting_local_connection_is_forwarded() {
        let routes = routes_with_svc();
        let data = envelope((7, Some("app")), (9, Some("svc")));
        assert_eq!(decision_of(&routes, &data, false, true, true), "local 42 9");
    }

    #[test]
    fn a_congested_local_destination_goes_to_python_and_is_never_crossed() {
        let routes = routes_with_svc();
        let data = envelope((7, Some("app")), (9, Some("svc")));
        assert_eq!(decision_of(&routes, &data, false, false, true), "python");
    }

    #[test]
    fn limited_forged_and_ping_envelopes_go_to_python() {
        let routes = routes_with_svc();
        let ok = envelope((7, Some("app")), (9, Some("svc")));
        assert_eq!(decision_of(&routes, &ok, true, true, true), "python");
        let forged = envelope((8, Some("app")), (9, Some("svc")));
        assert_eq!(decision_of(&routes, &forged, false, true, true), "python");
        let ping = envelope_of((7, Some("app")), (9, Some("svc")), Kind::Ping);
        assert_eq!(decision_of(&routes, &ping, false, true, true), "python");
        let nowhere = envelope((7, Some("app")), (0, None));
        assert_eq!(decision_of(&routes, &nowhere, false, true, true), "python");
    }

    #[test]
    fn a_destination_another_instance_holds_is_crossed_only_when_allowed() {
        let mut routes = Routes::new();
        routes
            .set_remote(9, Some("svc"), 3, b"r:9:svc", (0, u64::MAX))
            .unwrap();
        let data = envelope((7, Some("app")), (9, Some("svc")));
        assert_eq!(decision_of(&routes, &data, false, true, true), "cross 3");
        assert_eq!(decision_of(&routes, &data, false, true, false), "python");
        assert_eq!(decision_of(&routes, &data, true, true, true), "python");
    }

    #[test]
    fn the_limiter_counts_whole_seconds_of_the_clock() {
        let mut limiter = FixedWindow::new(1, 1000, 60);
        assert!(!over_limit(Some(&mut limiter), 7, 10, 5_000_000_000));
        assert!(over_limit(Some(&mut limiter), 7, 10, 5_000_000_001));
        assert!(!over_limit(None, 7, 10, 0));
    }
}

pub mod py {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    use super::{
        decide, local_destination, over_limit, scan_rmb, seconds, store_deadline, Decision,
        RmbRouting, RmbSession,
    };
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::py::payload_bytes;
    use crate::codec::mask::Payload;
    use crate::dialects::rmb::envelope::py::EnvelopeRouting;
    use crate::forward::outboxes::py::{open_outboxes, Outboxes};
    use crate::forward::routes::py::RouteTable;
    use crate::forward::routes::ConnId;
    use crate::limiter::py::FixedWindowLimiter;
    use crate::records::py::RecordBuffer;
    use crate::records::Records;

    /// Plain envelope scan of binary messages: no session, so no source check and no lookup.
    #[pyclass(extends = Scanner, frozen, module = "rmb_relay._core")]
    pub struct EnvelopeScanner;

    #[pymethods]
    impl EnvelopeScanner {
        #[new]
        fn new() -> (Self, Scanner) {
            (EnvelopeScanner, Scanner::new(start_envelope))
        }

        fn __repr__(&self) -> &'static str {
            "EnvelopeScanner()"
        }
    }

    /// Envelope scan for one RMB session: source check, rate limit, destination lookup, and
    /// the forward itself (see `decide`).
    #[pyclass(extends = Scanner, frozen, module = "rmb_relay._core")]
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
        ) -> (Self, Scanner) {
            let scanner = RmbScanner {
                routes,
                twin,
                sid,
                records,
                limiter,
                outboxes,
                conn_id,
                last_dest: AtomicU64::new(u64::MAX),
                slow: AtomicBool::new(false),
            };
            (scanner, Scanner::new(start_rmb))
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

    /// Plain envelope scan: binary messages are envelopes, text ones are passed on unscanned.
    struct EnvelopeFeed;

    fn start_envelope<'a>(_: &'a Bound<'_, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        Ok(Box::new(EnvelopeFeed))
    }

    impl ScanFeed for EnvelopeFeed {
        fn message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            _now: u64,
            _fast: bool,
        ) -> PyResult<Option<Scanned>> {
            let data = payload_bytes(py, payload)?;
            if is_text {
                return Ok(Some((data, None, None)));
            }
            let bound = data.bind(py);
            Ok(Some(match scan_rmb(bound.as_bytes(), None) {
                Ok(r) => {
                    let routing = EnvelopeRouting::new(bound, &r.fields, false, None);
                    (data, Some(Py::new(py, routing)?.into_any()), None)
                }
                Err(err) => (data, None, Some(err.to_string())),
            }))
        }
    }

    /// An RMB session's scanner with its table, limiter, records and outboxes borrowed for one
    /// `feed`.
    struct RmbFeed<'a, 'py> {
        routes: PyRef<'py, RouteTable>,
        twin: u32,
        sid: Option<&'a str>,
        records: Option<PyRefMut<'py, RecordBuffer>>,
        limiter: Option<PyRefMut<'py, FixedWindowLimiter>>,
        outboxes: Option<PyRefMut<'py, Outboxes>>,
        last_dest: &'a AtomicU64,
        /// envelopes may be queued for other instances (remote routes) in this feed
        cross: bool,
    }

    fn start_rmb<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let py = scanner.py();
        let s = scanner.downcast::<RmbScanner>()?.get();
        Ok(Box::new(RmbFeed {
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
        }))
    }

    impl ScanFeed for RmbFeed<'_, '_> {
        fn message(
            &mut self,
            py: Python<'_>,
            is_text: bool,
            payload: Payload<'_>,
            now: u64,
            fast: bool,
        ) -> PyResult<Option<Scanned>> {
            if is_text {
                // RMB has no text messages: Python closes the connection
                return Ok(Some((payload_bytes(py, payload)?, None, None)));
            }
            let session = RmbSession {
                routes: &self.routes.inner,
                twin: self.twin,
                sid: self.sid,
            };
            let limiter = self.limiter.as_mut().map(|l| &mut l.inner);
            let records = self.records.as_mut().map(|r| &mut r.inner);
            let Some(outboxes) = self.outboxes.as_mut().filter(|_| fast) else {
                let data = payload_bytes(py, payload)?.into_bound(py);
                let bytes = data.as_bytes();
                return Ok(Some(match scan_rmb(bytes, Some(&session)) {
                    Err(err) => (data.clone().unbind(), None, Some(err.to_string())),
                    Ok(r) => {
                        let limited = over_limit(limiter, session.twin, bytes.len(), now);
                        let local = local_destination(&r, limited);
                        rmb_python(
                            py,
                            &data,
                            bytes,
                            &r,
                            limited,
                            local,
                            records,
                            session.twin,
                            now,
                        )?
                    }
                }));
            };
            let ob = &mut outboxes.inner;
            // unmasked into the outbox of this sender's last destination (most senders keep to
            // one): when that is where it goes, copied once
            let guess = match self.last_dest.load(Relaxed) {
                u64::MAX => None,
                id => Some(id),
            };
            let staged = ob.stage(guess, payload.len(), |out| payload.copy_to(out));
            let size = payload.len();
            // scanned once: either forwarded here, queued for the instance holding its
            // destination, or handed to Python with what the scan found (a copy of the staged
            // bytes, the routing view of them)
            let cross = self.cross && ob.crossing.open;
            let ttl = ob.crossing.store_ttl;
            let decided = {
                let data = ob.staged(&staged);
                match scan_rmb(data, Some(&session)) {
                    Err(err) => Taken::Python((
                        PyBytes::new(py, data).unbind(),
                        None,
                        Some(err.to_string()),
                    )),
                    Ok(r) => {
                        let limited = over_limit(limiter, session.twin, size, now);
                        match decide(&r, &session, limited, |dest| ob.accepts(dest), cross, now) {
                            Decision::Local(dest, dest_twin) => {
                                if let Some(records) = records {
                                    let (src, dst) = (session.twin, dest_twin);
                                    records.push(now, i64::from(src), i64::from(dst), size);
                                }
                                self.last_dest.store(dest, Relaxed);
                                Taken::Local(dest)
                            }
                            Decision::Cross(remote) => {
                                let f = &r.fields;
                                let deadline = store_deadline(
                                    f.fail_fast(),
                                    f.timestamp,
                                    f.expiration,
                                    seconds(now),
                                    ttl,
                                );
                                Taken::Cross(remote.instance, &remote.name, deadline)
                            }
                            Decision::Python => {
                                let bytes = PyBytes::new(py, data);
                                let local = local_destination(&r, limited);
                                Taken::Python(rmb_python(
                                    py,
                                    &bytes,
                                    data,
                                    &r,
                                    limited,
                                    local,
                                    records,
                                    session.twin,
                                    now,
                                )?)
                            }
                        }
                    }
                }
            };
            match decided {
                Taken::Python(scanned) => {
                    ob.release(staged);
                    Ok(Some(scanned))
                }
                Taken::Local(dest) => {
                    ob.commit(staged, dest);
                    ob.count(dest, size);
                    Ok(None)
                }
                Taken::Cross(instance, name, deadline) => {
                    ob.cross(staged, instance, name, deadline);
                    Ok(None)
                }
            }
        }
    }

    /// What became of one staged envelope.
    enum Taken<'r> {
        Local(ConnId),
        Cross(u32, &'r [u8], u64),
        Python(Scanned),
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
        m.add_class::<RmbScanner>()
    }
}
