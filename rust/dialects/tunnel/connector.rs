//! The connector's native per-request path: a `RequestTarget` message in, the target's
//! HTTP/1.1 request bytes out; the target's response bytes in, a masked websocket frame
//! carrying the `Deliver` out.
//!
//! Why: the Python connector spent ~12 µs of user CPU per small request decoding the
//! message into a dataclass, building the target request, turning the response head into
//! Python lists and dicts, building the `Deliver` dataclass and encoding it. Here each
//! direction is one call, and no per-request Python object is made beyond the request bytes,
//! the two ids the caller keeps for the uncommon outcomes, and a list for those outcomes.
//!
//! Only the common case comes here (see [`Core::request`]): acknowledgement mode Disabled,
//! ConnectorReceived or ConnectorFinished (its `Acknowledge` queued here too: at the start for
//! the first, after the `Deliver` for the second, as the Python path sends them), no
//! tracing, the answer wanted, the body inline, time left (`expiresIn` > 0 or absent), a web
//! target over plain HTTP, and an answer whose body comes whole with its head (Content-Length
//! up to the caller's limit). Everything else is `None` and goes through the Python path
//! (`dialects/tunnel/connector.py`), which decodes the same message again and words any error.
//! The codec is `wire.rs`'s (decoder, msgpack and JSON sinks); the frames are
//! `ws.rs`'s, masked as a client's must be.

use crate::codec::http::{ResponseEvent as Event, ResponseParser};
use crate::dialects::tunnel::wire::{self as tunnel_wire, FieldRef, Json, Msgpack, Sink};
use crate::http_client::encode_target_request;

/// A `RequestTarget`'s fields the common case looks at, borrowed from either decoder's output.
struct Common<'a> {
    request_id: &'a str,
    request_origin_id: &'a str,
    target: &'a str,
    method: &'a str,
    url: &'a str,
    acknowledge_mode: Option<i64>,
    /// where the acknowledgement goes (None: the request's origin)
    acknowledge_origin_id: Option<&'a str>,
    /// tracing on, or the answer not wanted
    flagged: bool,
    /// `expiresIn` present and not positive (or of another type)
    expired: bool,
    /// the inline body; None when it is outsourced
    body: Option<&'a [u8]>,
}
use crate::codec::ws::{frame_len, write_frame, MaskRng, OP_BINARY, OP_TEXT};

/// A web target the native path may serve: the name as `str.upper()` gives it (targets are
/// matched case-insensitively), the Host header and the base URL's path.
#[derive(Debug, Clone)]
pub struct WebTarget {
    pub name: String,
    pub host: String,
    pub prefix: String,
}

/// A request the native path took: which target, the bytes to write to one of its idle
/// connections, the ids the `Deliver` needs, and whether it is HEAD (no response body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    pub target: usize,
    pub wire: Vec<u8>,
    pub request_id: String,
    pub request_origin_id: String,
    pub head: bool,
    /// the acknowledge mode (0, 1 or 2) and the origin its `Acknowledge` names
    pub ack_mode: u8,
    pub ack_origin_id: String,
}

/// The connector's state for one websocket: the message format, the frame masks and the
/// frames waiting for the next write.
pub struct Core {
    binary: bool,
    targets: Vec<WebTarget>,
    rng: MaskRng,
    out: Vec<u8>,
}

// ClientRequest's fields in wire.py's dataclass order (tunnel_wire::CLIENT_REQUEST)
const REQUEST_ID: usize = 0;
const REQUEST_ORIGIN_ID: usize = 1;
const TARGET: usize = 2;
const HTTP_METHOD: usize = 4;
const URL: usize = 5;
const HTTP_HEADERS: usize = 6;
const ACKNOWLEDGE_MODE: usize = 7;
const ACKNOWLEDGE_ORIGIN_ID: usize = 8;
const BODY_SIZE: usize = 10;
const BODY_CONTENT: usize = 11;
const ENABLE_TRACING: usize = 12;
const DISCARD_CONNECTOR_RESPONSE: usize = 13;
const EXPIRES_IN: usize = 14;

impl Core {
    pub fn new(
        binary: bool,
        seed: &[u8; crate::codec::ws::MASK_SEED_LEN],
        targets: Vec<WebTarget>,
    ) -> Self {
        Core {
            binary,
            targets,
            rng: MaskRng::new(seed),
            out: Vec::new(),
        }
    }

    /// A `RequestTarget` of the common case, as the request for its target; None for any
    /// other message or case (the Python path takes it). A msgpack message is read in place
    /// (`decode_request_target`: no value tree, no copies of its fields); JSON goes through
    /// `decode` (its strings may need unescaping, its body base64).
    pub fn request(&self, payload: &[u8]) -> Option<Started> {
        let request_target = tunnel_wire::kind_bit("RequestTarget");
        let (_, fields) = tunnel_wire::decode_kinds(payload, self.binary, request_target).ok()?;
        let FieldRef::Headers(headers) = &fields[HTTP_HEADERS] else {
            return None;
        };
        let pairs = headers
            .iter()
            .flat_map(|(n, values)| values.iter().map(move |v| (n.as_ref(), v.as_ref())));
        let str_at = |i: usize| fields[i].as_str();
        let common = Common {
            request_id: str_at(REQUEST_ID)?,
            request_origin_id: str_at(REQUEST_ORIGIN_ID)?,
            target: str_at(TARGET)?,
            method: str_at(HTTP_METHOD)?,
            url: str_at(URL)?,
            acknowledge_mode: fields[ACKNOWLEDGE_MODE].as_int(),
            acknowledge_origin_id: str_at(ACKNOWLEDGE_ORIGIN_ID),
            flagged: matches!(fields[ENABLE_TRACING], FieldRef::Bool(true))
                || matches!(fields[DISCARD_CONNECTOR_RESPONSE], FieldRef::Bool(true)),
            expired: match fields[EXPIRES_IN] {
                FieldRef::Null => false,
                FieldRef::Int(left) => left <= 0,
                _ => true,
            },
            body: match &fields[BODY_CONTENT] {
                FieldRef::Bytes(b) => Some(b),
                FieldRef::Null if !matches!(fields[BODY_SIZE], FieldRef::Int(n) if n > 0) => {
                    Some(&b""[..])
                }
                _ => None,
            },
        };
        self.start(&common, pairs)
    }

    /// The common case's checks and its target request, whichever decoder read the message.
    fn start<'a>(
        &self,
        c: &Common<'_>,
        pairs: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Option<Started> {
        let ack_mode = match c.acknowledge_mode {
            Some(mode @ 0..=2) => mode as u8,
            _ => return None, // manual acknowledgements (the acknowledge URL header)
        };
        if c.flagged || c.expired {
            return None; // tracing, no answer wanted, no time left
        }
        let body = c.body?; // None: outsourced, fetched from the relay's body store
        let index = self
            .targets
            .iter()
            .position(|t| upper_is(&t.name, c.target))?;
        let target = &self.targets[index];
        let path = format!("{}/{}", target.prefix, c.url);
        // a field that cannot be sent: the Python path answers 502
        let wire =
            encode_target_request(c.method, &path, &target.host, pairs, &[], body, None).ok()?;
        Some(Started {
            target: index,
            wire,
            request_id: c.request_id.to_owned(),
            request_origin_id: c.request_origin_id.to_owned(),
            head: c.method == "HEAD",
            ack_mode,
            ack_origin_id: c
                .acknowledge_origin_id
                .unwrap_or(c.request_origin_id)
                .to_owned(),
        })
    }

    /// Queue the `Acknowledge` of `request_id` (to `origin_id`) as one masked frame.
    pub fn acknowledge(&mut self, origin_id: &str, request_id: &str, remove_body: bool) {
        let message = if self.binary {
            acknowledge_message(
                Msgpack::with_capacity(96),
                origin_id,
                request_id,
                remove_body,
            )
        } else {
            acknowledge_message(Json::with_capacity(160), origin_id, request_id, remove_body)
        };
        self.queue_frame(&message);
    }

    fn queue_frame(&mut self, message: &[u8]) {
        let opcode = if self.binary { OP_BINARY } else { OP_TEXT };
        let at = self.out.len();
        self.out.resize(at + frame_len(message.len(), true), 0);
        let mask = self.rng.next_mask();
        write_frame(&mut self.out[at..], opcode, true, message, Some(mask));
    }

    /// Queue the `Deliver` of a target's whole answer as one masked frame.
    pub fn deliver(
        &mut self,
        request_id: &str,
        request_origin_id: &str,
        status: u16,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) {
        let message = if self.binary {
            deliver_message(
                Msgpack::with_capacity(256 + body.len()),
                request_id,
                request_origin_id,
                status,
                headers,
                body,
            )
        } else {
            deliver_message(
                Json::with_capacity(384 + body.len() * 4 / 3),
                request_id,
                request_origin_id,
                status,
                headers,
                body,
            )
        };
        self.queue_frame(&message);
    }

    /// The frames queued since the last call, for one write.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }
}

/// `upper == name.to_uppercase()`, without the allocation for an ASCII name.
fn upper_is(upper: &str, name: &str) -> bool {
    if name.is_ascii() {
        upper.len() == name.len()
            && upper
                .bytes()
                .zip(name.bytes())
                .all(|(u, n)| u == n.to_ascii_uppercase())
    } else {
        upper == name.to_uppercase()
    }
}

/// latin-1 text of a header value (every byte one code point, as the Python path decodes it).
fn latin1(value: &[u8]) -> std::borrow::Cow<'_, str> {
    if value.is_ascii() {
        // ASCII is valid UTF-8
        std::borrow::Cow::Borrowed(std::str::from_utf8(value).unwrap_or_default())
    } else {
        std::borrow::Cow::Owned(value.iter().map(|&b| b as char).collect())
    }
}

/// wire.py's `AcknowledgeRequest` as the hub invocation `Acknowledge`.
fn acknowledge_message<S: Sink>(
    mut sink: S,
    origin_id: &str,
    request_id: &str,
    remove_body: bool,
) -> Vec<u8> {
    tunnel_wire::begin_invocation(&mut sink, "Acknowledge");
    sink.begin_map(3);
    sink.key("originId");
    sink.str(origin_id);
    sink.key("requestId");
    sink.str(request_id);
    sink.key("removeRequestBodyContent");
    sink.bool(remove_body);
    sink.end_map();
    tunnel_wire::end_invocation(sink)
}

/// `wire.encode(TargetResponse(...))` for a target's answer read whole: the response fields
/// (names lower-case as parsed, repeated ones grouped under their first place, framing fields
/// left out: the relay sets its own), the body inline, `requestFailed` from the status.
fn deliver_message<S: Sink>(
    mut sink: S,
    request_id: &str,
    request_origin_id: &str,
    status: u16,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Vec<u8> {
    let mut names: Vec<&str> = Vec::with_capacity(headers.len());
    for (name, _) in headers {
        if name != "content-length"
            && name != "transfer-encoding"
            && !names.contains(&name.as_str())
        {
            names.push(name);
        }
    }
    let size = body.len() as i64;
    tunnel_wire::begin_invocation(&mut sink, "Deliver");
    sink.begin_map(11);
    sink.key("requestId");
    sink.str(request_id);
    sink.key("requestOriginId");
    sink.str(request_origin_id);
    sink.key("httpStatusCode");
    sink.int(i64::from(status));
    sink.key("httpHeaders");
    sink.begin_map(names.len());
    for name in &names {
        sink.key(name);
        let values: Vec<&[u8]> = headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect();
        sink.begin_array(values.len());
        for value in values {
            sink.element();
            sink.str(&latin1(value));
        }
        sink.end_array();
    }
    sink.end_map();
    sink.key("originalBodySize");
    sink.int(size);
    sink.key("bodySize");
    sink.int(size);
    sink.key("bodyContent");
    if body.is_empty() {
        sink.null();
    } else {
        sink.body(body);
    }
    sink.key("requestFailed");
    sink.bool(status >= 400);
    sink.key("requestStart");
    sink.null();
    sink.key("requestDuration");
    sink.null();
    sink.key("connectionId");
    sink.null();
    sink.end_map();
    tunnel_wire::end_invocation(sink)
}

/// The parser's events for `data`; when they are exactly one whole answer, its `Deliver` is
/// queued on `core` and None is returned (the exchange is over), else the events are the
/// caller's.
pub fn respond(
    core: &mut Core,
    parser: &mut ResponseParser,
    events: &mut Vec<Event>,
    data: &[u8],
    request_id: &str,
    request_origin_id: &str,
) -> crate::error::Result<bool> {
    parser.feed(data, events)?;
    if let [Event::Head {
        status,
        headers,
        body: Some(body),
    }, Event::End] = events.as_slice()
    {
        core.deliver(request_id, request_origin_id, *status, headers, body);
        events.clear();
        return Ok(true);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialects::tunnel::wire::FieldValue;

    fn core(binary: bool) -> Core {
        Core::new(
            binary,
            &[7; 32],
            vec![WebTarget {
                name: "API".into(),
                host: "127.0.0.1:8000".into(),
                prefix: "/base".into(),
            }],
        )
    }

    fn request_message(binary: bool, extra: &str) -> Vec<u8> {
        let json = format!(
            r#"{{"target":"RequestTarget","arguments":[{{"requestId":"r1","requestOriginId":"o1","target":"api","tenantName":"t","httpMethod":"POST","url":"x?y=1","httpHeaders":{{"Accept":["a"],"Host":["relay"],"X-M":["1","2"]}},"bodySize":2,"bodyContent":"aGk="{extra}}}]}}"#
        );
        if !binary {
            return json.into_bytes();
        }
        // the same message as msgpack
        let (_, f) = tunnel_wire::decode(json.as_bytes(), false).unwrap();
        let s = |i: usize| match &f[i] {
            FieldValue::Str(s) => Some(s.as_str()),
            _ => None,
        };
        let n = |i: usize| match f[i] {
            FieldValue::Int(n) => Some(n),
            _ => None,
        };
        let FieldValue::Headers(headers) = &f[HTTP_HEADERS] else {
            panic!()
        };
        let FieldValue::Bytes(body) = &f[BODY_CONTENT] else {
            panic!()
        };
        let r = tunnel_wire::ClientRequestRef {
            request_id: s(0).unwrap(),
            request_origin_id: s(1).unwrap(),
            target: s(2).unwrap(),
            tenant_name: s(3).unwrap(),
            http_method: s(4).unwrap(),
            url: s(5).unwrap(),
            http_headers: headers,
            acknowledge_mode: n(7).unwrap(),
            acknowledge_origin_id: s(8),
            original_body_size: 0,
            body_size: 2,
            body_content: Some(body),
            enable_tracing: matches!(f[ENABLE_TRACING], FieldValue::Bool(true)),
            discard_connector_response: matches!(
                f[DISCARD_CONNECTOR_RESPONSE],
                FieldValue::Bool(true)
            ),
            expires_in: n(EXPIRES_IN),
            acknowledge_url: None,
        };
        tunnel_wire::encode_client_request(Msgpack::default(), &r)
    }

    #[test]
    fn a_common_request_becomes_its_target_request() {
        for binary in [false, true] {
            let started = core(binary).request(&request_message(binary, "")).unwrap();
            assert_eq!(started.target, 0);
            assert_eq!(
                (
                    started.request_id.as_str(),
                    started.request_origin_id.as_str()
                ),
                ("r1", "o1")
            );
            assert_eq!(
                started.wire,
                b"POST /base/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: a\r\nX-M: 1\r\nX-M: 2\r\nContent-Length: 2\r\n\r\nhi"
            );
        }
    }

    #[test]
    fn uncommon_requests_are_left_to_python() {
        let c = core(false);
        for extra in [
            r#","acknowledgeMode":3"#,
            r#","enableTracing":true"#,
            r#","discardConnectorResponse":true"#,
            r#","expiresIn":0"#,
        ] {
            assert!(
                c.request(&request_message(false, extra)).is_none(),
                "{extra}"
            );
        }
        let other_target = String::from_utf8(request_message(false, ""))
            .unwrap()
            .replace("\"api\"", "\"nope\"");
        assert!(c.request(other_target.as_bytes()).is_none());
        let outsourced = String::from_utf8(request_message(false, ""))
            .unwrap()
            .replace("\"aGk=\"", "null");
        assert!(c.request(outsourced.as_bytes()).is_none());
        assert!(c.request(b"not json").is_none());
    }

    #[test]
    fn a_whole_answer_is_delivered_as_one_masked_frame() {
        let mut c = core(false);
        let mut parser = ResponseParser::new();
        parser.start(false, 16384).unwrap();
        let mut events = Vec::new();
        let wire = b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nX-A: 1\r\nContent-Type: t\r\nx-a: \xe9\r\n\r\nno";
        assert!(respond(&mut c, &mut parser, &mut events, wire, "r1", "o1").unwrap());
        let out = c.take_output();
        assert_eq!(out[0], 0x81); // FIN + text
        let mut decoder = crate::codec::ws::Decoder::new(1 << 20, false);
        let events = decoder.feed_owned(&out);
        let crate::codec::ws::OwnedEvent::Message { data, .. } = &events[0] else {
            panic!("{events:?}");
        };
        assert_eq!(
            String::from_utf8(data.clone()).unwrap(),
            concat!(
                r#"{"target":"Deliver","arguments":[{"requestId":"r1","requestOriginId":"o1","httpStatusCode":404,"#,
                r#""httpHeaders":{"x-a":["1","\u00e9"],"content-type":["t"]},"originalBodySize":2,"bodySize":2,"#,
                r#""bodyContent":"bm8=","requestFailed":true,"requestStart":null,"requestDuration":null,"connectionId":null}]}"#
            )
        );
    }

    #[test]
    fn acknowledgements_are_masked_frames_both_decoders_read() {
        for binary in [false, true] {
            let mut c = core(binary);
            let started = c
                .request(&request_message(
                    binary,
                    r#","acknowledgeMode":2,"acknowledgeOriginId":"a1""#,
                ))
                .expect("modes 1 and 2 are the native path's");
            assert_eq!(
                (started.ack_mode, started.ack_origin_id.as_str()),
                (2, "a1")
            );
            c.acknowledge(&started.ack_origin_id, &started.request_id, true);
            let out = c.take_output();
            let mut decoder = crate::codec::ws::Decoder::new(1 << 20, false);
            let events = decoder.feed_owned(&out);
            let crate::codec::ws::OwnedEvent::Message { data, .. } = &events[0] else {
                panic!("{events:?}");
            };
            let (kind, fields) = tunnel_wire::decode(data, binary).unwrap();
            assert_eq!(kind, "Acknowledge");
            assert_eq!(
                fields,
                vec![
                    FieldValue::Str("a1".into()),
                    FieldValue::Str("r1".into()),
                    FieldValue::Bool(true)
                ]
            );
        }
        // no acknowledge origin: the request's
        let c = core(false);
        let started = c
            .request(&request_message(false, r#","acknowledgeMode":1"#))
            .unwrap();
        assert_eq!(
            (started.ack_mode, started.ack_origin_id.as_str()),
            (1, "o1")
        );
    }

    #[test]
    fn a_streamed_answer_is_left_to_the_caller() {
        let mut c = core(true);
        let mut parser = ResponseParser::new();
        parser.start(false, 4).unwrap();
        let mut events = Vec::new();
        let wire = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc";
        assert!(!respond(&mut c, &mut parser, &mut events, wire, "r", "o").unwrap());
        assert_eq!(events.len(), 2);
        assert!(!c.has_output());
    }
}

pub mod py {
    //! `TunnelConnectorCore` for `dialects/tunnel/connector.py`.
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    use super::{Core, WebTarget};
    use crate::codec::http::py::{response_events_list as events_list, HttpResponseParser};
    use crate::codec::ws::py::{event_to_py, WsDecoder};
    use crate::codec::ws::{Event as WsEvent, MASK_SEED_LEN};
    use crate::error::Error;

    /// The connector's native per-request path for one websocket (`rust/dialects/tunnel/connector.rs`).
    #[pyclass(module = "rmb_relay._core")]
    pub struct TunnelConnectorCore {
        core: Core,
        events: Vec<crate::codec::http::ResponseEvent>,
    }

    #[pymethods]
    impl TunnelConnectorCore {
        #[new]
        fn new(
            binary: bool,
            seed: &[u8],
            targets: Vec<(String, String, String)>,
        ) -> PyResult<Self> {
            let seed: &[u8; MASK_SEED_LEN] = seed.try_into().map_err(|_| {
                Error::InvalidArgument(format!("seed must be {MASK_SEED_LEN} bytes"))
            })?;
            let targets = targets
                .into_iter()
                .map(|(name, host, prefix)| WebTarget { name, host, prefix })
                .collect();
            Ok(TunnelConnectorCore {
                core: Core::new(binary, seed, targets),
                events: Vec::new(),
            })
        }

        /// `(target index, request bytes, request id, origin id, is HEAD)` for a common
        /// `RequestTarget`, else None.
        #[allow(clippy::type_complexity)]
        fn request<'py>(
            &self,
            py: Python<'py>,
            payload: &[u8],
        ) -> Option<(usize, Bound<'py, PyBytes>, String, String, bool)> {
            let s = self.core.request(payload)?;
            Some((
                s.target,
                PyBytes::new(py, &s.wire),
                s.request_id,
                s.request_origin_id,
                s.head,
            ))
        }

        /// A websocket read in one call: deframed with the connection's `decoder`, each
        /// common `RequestTarget` as `(target index, request bytes, request id, origin id, is
        /// HEAD, message, acknowledge mode, acknowledge origin id)` (the message for the Python
        /// path should the exchange need it; a ConnectorReceived request's `Acknowledge` is
        /// queued already), every other event as `WsDecoder.feed` gives it.
        fn feed_ws<'py>(
            &mut self,
            py: Python<'py>,
            decoder: &Bound<'py, WsDecoder>,
            data: &[u8],
        ) -> PyResult<Bound<'py, PyList>> {
            let mut decoder = decoder.borrow_mut();
            let out = PyList::empty(py);
            decoder.inner.feed(data, |ev| {
                if let WsEvent::Message { payload, .. } = ev {
                    let owned;
                    let bytes = match payload.as_unmasked() {
                        Some(bytes) => bytes,
                        None => {
                            owned = payload.to_vec();
                            &owned
                        }
                    };
                    if let Some(s) = self.core.request(bytes) {
                        if s.ack_mode == 1 {
                            self.core
                                .acknowledge(&s.ack_origin_id, &s.request_id, false);
                        }
                        let item = (
                            s.target,
                            PyBytes::new(py, &s.wire),
                            s.request_id,
                            s.request_origin_id,
                            s.head,
                            PyBytes::new(py, bytes),
                            s.ack_mode,
                            s.ack_origin_id,
                        );
                        return out.append(item);
                    }
                }
                if let Some(event) = event_to_py(py, ev, None, &mut true, 0)? {
                    out.append(event)?;
                }
                Ok::<(), PyErr>(())
            })?;
            Ok(out)
        }

        /// Feed a target connection's bytes to its parser: None when they completed a whole
        /// answer (its `Deliver` is queued, then, with `ack_origin_id`, its ConnectorFinished
        /// `Acknowledge`), else the parser's events as `feed` gives them.
        #[pyo3(signature = (parser, data, request_id, request_origin_id, ack_origin_id = None))]
        fn respond<'py>(
            &mut self,
            py: Python<'py>,
            parser: &Bound<'py, HttpResponseParser>,
            data: &[u8],
            request_id: &str,
            request_origin_id: &str,
            ack_origin_id: Option<&str>,
        ) -> PyResult<Option<Bound<'py, PyList>>> {
            let mut parser = parser.borrow_mut();
            let mut events = std::mem::take(&mut self.events);
            events.clear();
            let done = super::respond(
                &mut self.core,
                &mut parser.inner,
                &mut events,
                data,
                request_id,
                request_origin_id,
            );
            let result = match done {
                Ok(true) => {
                    if let Some(origin) = ack_origin_id {
                        self.core.acknowledge(origin, request_id, true);
                    }
                    Ok(None)
                }
                Ok(false) => events_list(py, &mut events).map(Some),
                Err(err) => Err(err.into()),
            };
            self.events = events;
            result
        }

        /// The frames queued since the last call (masked, ready for the socket).
        fn take_output<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.core.take_output())
        }

        #[getter]
        fn has_output(&self) -> bool {
            self.core.has_output()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<TunnelConnectorCore>()
    }
}
