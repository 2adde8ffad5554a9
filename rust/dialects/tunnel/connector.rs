//! The connector's decisions, for every request it receives (spec/tunnel.md §6 and §11).
//!
//! [`Core::receive`] reads a `RequestTarget` and decides what happens to it: dropped when no
//! time is left (`expiresIn`), answered 404 when there is no such target, acknowledged at once
//! in mode ConnectorReceived, and otherwise handed to Python as a [`Request`] with what its
//! target needs: for a web target over plain HTTP, the request bytes ([`encode_target_request`]:
//! the message's fields less those of the hop to the relay, the acknowledge URL and tracing
//! fields, the inline body or the length of an outsourced one); for any other target (`$ping`,
//! `$echo`, https, a user's own) the method, URL, fields and body `Target.call` takes.
//! [`Core::answer`] and [`Core::fail`] end it: the `Deliver` (the target's status and fields
//! less the framing ones, `requestFailed` from the status, the body inline or only its
//! uploaded size, none when the client does not want it, the tracing duration), then a
//! ConnectorFinished `Acknowledge` (also after a failure), as masked frames for the next
//! write. [`Core::respond`] does that straight from a target connection's read when the bytes
//! are one whole answer, so the common request costs Python one call each way.
//!
//! Python (`dialects/tunnel/connector.py`) does the I/O: target connections, the body side
//! channels, the target timeout (it says which failure: 502 or 504 is decided here). Sans-I/O:
//! time is an argument (monotonic ns, for the tracing duration).

use std::borrow::Cow;

use crate::codec::http::{check_field, check_request_line, ResponseEvent, ResponseParser};
use crate::codec::ws::{frame_len, write_frame, MaskRng, MASK_SEED_LEN, OP_BINARY, OP_TEXT};
use crate::dialects::tunnel::wire::{
    begin_invocation, decode_kinds, end_invocation, FieldRef, Json, KindSet, Msgpack, Sink,
};
use crate::error::Result;

/// `RequestTarget`'s bit in a [`KindSet`] (the first of `wire::KINDS`).
const REQUEST_TARGET: KindSet = 1;

// ClientRequest's fields in `wire::CLIENT_REQUEST` order
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
const ACKNOWLEDGE_URL: usize = 15;

/// Acknowledgement modes (spec §11): the connector acknowledges modes 1 and 2.
const CONNECTOR_RECEIVED: i64 = 1;
const CONNECTOR_FINISHED: i64 = 2;

/// Request fields a connector does not pass on to any target: they describe the client's hop
/// to the relay (a web target gets its own Host, and a Content-Length for the body we send).
pub const SKIP: [&str; 5] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "expect",
];

fn skipped(name: &str) -> bool {
    SKIP.iter().any(|s| s.eq_ignore_ascii_case(name))
}

/// Response fields left out of a `Deliver`: the relay frames the body it sends itself.
fn framing(name: &str) -> bool {
    name.eq_ignore_ascii_case("content-length") || name.eq_ignore_ascii_case("transfer-encoding")
}

/// A target the connector serves, by its name as `str.upper()` gives it (targets are matched
/// case-insensitively); `web` for a web target over plain HTTP, whose requests are built here.
#[derive(Debug, Clone)]
pub struct Target {
    pub name: String,
    pub web: Option<WebTarget>,
}

/// A plain-HTTP web target: its Host header and its base URL's path.
#[derive(Debug, Clone)]
pub struct WebTarget {
    pub host: String,
    pub prefix: String,
}

/// What running a request takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// A plain-HTTP web target: the request's bytes (its head and inline body; the head alone
    /// when the body is outsourced, streamed after it).
    Web { wire: Vec<u8> },
    /// Any other target: `Target.call`'s arguments (fields less [`SKIP`], then ours).
    Call {
        method: String,
        url: String,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// A request received, from its `RequestTarget` to its `Deliver`.
#[derive(Debug, Clone)]
pub struct Request {
    pub request_id: String,
    pub request_origin_id: String,
    /// the target's index in the core's list
    pub target: usize,
    /// why the core answered (404, 502) or dropped (expired) the request itself; None: run it
    pub refused: Option<String>,
    /// None when refused
    pub work: Option<Work>,
    /// a HEAD request (its answer has no body whatever its head says)
    pub head: bool,
    /// the body waits in the relay's body store (`bodySize` > 0, no `bodyContent`)
    pub outsourced: bool,
    pub body_size: i64,
    /// download the outsourced body with `delete=true` (mode Disabled: nothing will ask again)
    pub delete_body: bool,
    /// where the `Acknowledge` after the `Deliver` goes (ConnectorFinished), if one is owed
    end_ack: Option<String>,
    tracing: bool,
    /// the client does not want the answer (queue mode): a `Deliver` without body
    discard: bool,
    /// when it was received (ns)
    received: i64,
    answered: bool,
}

impl Request {
    /// Whether an answer with a body of `length` bytes (None: a stream) uploads its body to
    /// the relay's body store (else it goes inline, or not at all when not wanted).
    pub fn uploads(&self, length: Option<usize>, inline_limit: usize) -> bool {
        !self.discard && length.is_none_or(|n| n > inline_limit)
    }

    /// The `Deliver` was queued (a later answer is ignored).
    pub fn answered(&self) -> bool {
        self.answered
    }
}

/// The connector's state for one websocket: its targets, the message format, the frame
/// masks and the frames waiting for the next write.
pub struct Core {
    binary: bool,
    /// the relay's base URL (the acknowledge URL a target is given is relative to it)
    server: String,
    inline_limit: usize,
    targets: Vec<Target>,
    rng: MaskRng,
    out: Vec<u8>,
}

impl Core {
    pub fn new(
        binary: bool,
        seed: &[u8; MASK_SEED_LEN],
        server: String,
        inline_limit: usize,
        targets: Vec<Target>,
    ) -> Self {
        Core {
            binary,
            server,
            inline_limit,
            targets,
            rng: MaskRng::new(seed),
            out: Vec::new(),
        }
    }

    pub fn inline_limit(&self) -> usize {
        self.inline_limit
    }

    /// A `RequestTarget` as the request to run, or answered or dropped here (`refused`); None
    /// for any other message, or one that is not well formed (Python reads it, and words why).
    pub fn receive(&mut self, payload: &[u8], now: i64) -> Option<Request> {
        let (_, f) = decode_kinds(payload, self.binary, REQUEST_TARGET).ok()?;
        let text = |i: usize| f[i].as_str().unwrap_or_default();
        let (request_id, origin, target) =
            (text(REQUEST_ID), text(REQUEST_ORIGIN_ID), text(TARGET));
        let mode = f[ACKNOWLEDGE_MODE].as_int().unwrap_or_default();
        let ack_origin = f[ACKNOWLEDGE_ORIGIN_ID].as_str().unwrap_or(origin);
        let body_size = f[BODY_SIZE].as_int().unwrap_or_default();
        let (body, outsourced): (&[u8], bool) = match &f[BODY_CONTENT] {
            FieldRef::Bytes(b) => (b, false),
            _ => (b"", body_size > 0),
        };
        let tracing = matches!(f[ENABLE_TRACING], FieldRef::Bool(true));
        let method = text(HTTP_METHOD);
        let mut r = Request {
            request_id: request_id.to_owned(),
            request_origin_id: origin.to_owned(),
            target: 0,
            refused: None,
            work: None,
            head: method == "HEAD",
            outsourced,
            body_size,
            delete_body: mode == 0,
            end_ack: None,
            tracing,
            discard: matches!(f[DISCARD_CONNECTOR_RESPONSE], FieldRef::Bool(true)),
            received: now,
            answered: false,
        };
        // the connector starts a request the moment it arrives: no time left is expiresIn <= 0
        // (the relay drops it at its deadline; it is never run late, and never acknowledged)
        if matches!(f[EXPIRES_IN], FieldRef::Int(left) if left <= 0) {
            r.refused = Some("expired before it started".into());
            r.answered = true;
            return Some(r);
        }
        let owes_ack = mode == CONNECTOR_RECEIVED || mode == CONNECTOR_FINISHED;
        let Some(index) = self.targets.iter().position(|t| upper_is(&t.name, target)) else {
            r.refused = Some(format!("has no target {target:?} here"));
            r.end_ack = owes_ack.then(|| ack_origin.to_owned());
            self.answer(&mut r, 404, std::iter::empty(), None, 0, now);
            return Some(r);
        };
        r.target = index;
        match mode {
            CONNECTOR_RECEIVED => self.acknowledge(ack_origin, request_id, false),
            CONNECTOR_FINISHED => r.end_ack = Some(ack_origin.to_owned()),
            _ => {}
        }
        // ours after the client's: the manual acknowledge URL (whatever the mode) and tracing
        let mut extra: Vec<(&str, Cow<'_, str>)> = Vec::new();
        if let Some(url) = f[ACKNOWLEDGE_URL].as_str() {
            let absolute = format!("{}{url}", self.server);
            extra.push(("RelayServer-AcknowledgeUrl", absolute.into()));
        }
        if tracing {
            extra.push(("RelayServer-RequestId", request_id.into()));
            extra.push(("RelayServer-RequestOriginId", origin.into()));
        }
        let FieldRef::Headers(headers) = &f[HTTP_HEADERS] else {
            return None; // not reached: the decoder checked the field
        };
        let fields = headers
            .iter()
            .filter(|(name, _)| !skipped(name))
            .flat_map(|(n, values)| values.iter().map(move |v| (n.as_ref(), v.as_ref())));
        let url = text(URL);
        let work = match &self.targets[index].web {
            Some(web) => {
                let path = format!("{}/{}", web.prefix, url);
                let length = outsourced.then_some(body_size as u64);
                match encode_target_request(method, &path, &web.host, fields, &extra, body, length)
                {
                    Ok(wire) => Work::Web { wire },
                    Err(err) => {
                        r.refused = Some(format!("cannot be sent: {err}"));
                        self.answer(&mut r, 502, std::iter::empty(), None, 0, now);
                        return Some(r);
                    }
                }
            }
            None => Work::Call {
                method: method.to_owned(),
                url: url.to_owned(),
                headers: fields
                    .chain(extra.iter().map(|(n, v)| (*n, v.as_ref())))
                    .map(|(n, v)| (n.to_owned(), v.to_owned()))
                    .collect(),
                body: body.to_vec(),
            },
        };
        r.work = Some(work);
        Some(r)
    }

    /// The parser's events for a target connection's `data`; when they are exactly one whole
    /// answer, it is answered here and true returned (the exchange is over), else the events
    /// are the caller's.
    pub fn respond(
        &mut self,
        r: &mut Request,
        parser: &mut ResponseParser,
        events: &mut Vec<ResponseEvent>,
        data: &[u8],
        now: i64,
    ) -> Result<bool> {
        parser.feed(data, events)?;
        if let [ResponseEvent::Head {
            status,
            headers,
            body: Some(body),
        }, ResponseEvent::End] = events.as_slice()
        {
            let fields = headers.iter().map(|(n, v)| (n.as_str(), latin1(v)));
            let size = body.len() as i64;
            self.answer(r, i64::from(*status), fields, Some(body), size, now);
            events.clear();
            return Ok(true);
        }
        Ok(false)
    }

    /// The target's answer: `status`, its fields (repeated names grouped under their first
    /// place, the framing ones left out), the body inline (`body`) or uploaded (`size` bytes
    /// in the body store), as the `Deliver`; then a ConnectorFinished `Acknowledge`. Nothing
    /// when the request was answered already.
    pub fn answer<'h>(
        &mut self,
        r: &mut Request,
        status: i64,
        fields: impl Iterator<Item = (&'h str, Cow<'h, str>)>,
        body: Option<&[u8]>,
        size: i64,
        now: i64,
    ) {
        if r.answered {
            return;
        }
        r.answered = true;
        let (body, size) = match body {
            _ if r.discard => (None, 0),
            Some([]) => (None, size),
            other => (other, size),
        };
        let mut grouped: Vec<(&str, Vec<Cow<'h, str>>)> = Vec::new();
        for (name, value) in fields {
            if framing(name) {
                continue;
            }
            match grouped.iter_mut().find(|(n, _)| *n == name) {
                Some((_, values)) => values.push(value),
                None => grouped.push((name, vec![value])),
            }
        }
        if r.tracing {
            const DURATION: &str = "RelayServer-TargetDuration";
            let seconds = (now - r.received) as f64 / 1e9;
            let value = vec![Cow::Owned(format!("{seconds:.6}"))];
            match grouped.iter_mut().find(|(n, _)| *n == DURATION) {
                Some((_, values)) => *values = value,
                None => grouped.push((DURATION, value)),
            }
        }
        let deliver = Deliver {
            request_id: &r.request_id,
            request_origin_id: &r.request_origin_id,
            status,
            fields: &grouped,
            body,
            size,
        };
        let message = if self.binary {
            deliver.write(Msgpack::with_capacity(256 + body.map_or(0, <[u8]>::len)))
        } else {
            deliver.write(Json::with_capacity(
                384 + body.map_or(0, |b| b.len() * 4 / 3),
            ))
        };
        self.queue_frame(&message);
        if let Some(origin) = r.end_ack.take() {
            self.acknowledge(&origin, &r.request_id, true);
        }
    }

    /// The target failed (502: refused, reset, a malformed answer, a body transfer that broke)
    /// or did not answer in time (504).
    pub fn fail(&mut self, r: &mut Request, timed_out: bool, now: i64) {
        let status = if timed_out { 504 } else { 502 };
        self.answer(r, status, std::iter::empty(), None, 0, now);
    }

    /// Queue the `Acknowledge` of `request_id` to `origin_id`.
    fn acknowledge(&mut self, origin_id: &str, request_id: &str, remove_body: bool) {
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

    /// The frames queued since the last call (masked, as a client's must be), for one write.
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

/// latin-1 text of a header value (every byte one code point, as `bytes.decode("latin-1")`).
fn latin1(value: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(value) {
        Ok(text) if value.is_ascii() => Cow::Borrowed(text),
        _ => Cow::Owned(value.iter().map(|&b| b as char).collect()),
    }
}

/// Appends `name: value\r\n` after checking both (no CR, LF or NUL: no injected fields).
fn field(out: &mut Vec<u8>, name: &str, value: &str) -> Result<()> {
    check_field(name, value)?;
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
    Ok(())
}

/// A web target's request: `METHOD target HTTP/1.1`, `Host`, the client's fields (repeated
/// names in order), the `extra` fields, `Content-Length` when there is a body (`length`, or
/// the body's own length), then the body. With `length` given and an empty `body`, only the
/// head is built: the body is streamed after it. An error for a field or request line that
/// cannot be sent (CR, LF, NUL; a method that is no token).
pub fn encode_target_request<'a>(
    method: &str,
    target: &str,
    host: &str,
    fields: impl Iterator<Item = (&'a str, &'a str)>,
    extra: &[(&str, Cow<'_, str>)],
    body: &[u8],
    length: Option<u64>,
) -> Result<Vec<u8>> {
    check_request_line(method, target)?;
    let mut out = Vec::with_capacity(256 + target.len() + body.len());
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    field(&mut out, "Host", host)?;
    for (name, value) in fields {
        field(&mut out, name, value)?;
    }
    for (name, value) in extra {
        field(&mut out, name, value)?;
    }
    let length = length.unwrap_or(body.len() as u64);
    if length > 0 {
        out.extend_from_slice(b"Content-Length: ");
        out.extend_from_slice(length.to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    Ok(out)
}

/// wire.py's `AcknowledgeRequest` as the hub invocation `Acknowledge`.
fn acknowledge_message<S: Sink>(
    mut sink: S,
    origin_id: &str,
    request_id: &str,
    remove_body: bool,
) -> Vec<u8> {
    begin_invocation(&mut sink, "Acknowledge");
    sink.begin_map(3);
    sink.key("originId");
    sink.str(origin_id);
    sink.key("requestId");
    sink.str(request_id);
    sink.key("removeRequestBodyContent");
    sink.bool(remove_body);
    sink.end_map();
    end_invocation(sink)
}

/// wire.py's `TargetResponse` as the hub invocation `Deliver`.
struct Deliver<'a, 'h> {
    request_id: &'a str,
    request_origin_id: &'a str,
    status: i64,
    fields: &'a [(&'h str, Vec<Cow<'h, str>>)],
    body: Option<&'a [u8]>,
    size: i64,
}

impl Deliver<'_, '_> {
    fn write<S: Sink>(&self, mut sink: S) -> Vec<u8> {
        begin_invocation(&mut sink, "Deliver");
        sink.begin_map(11);
        sink.key("requestId");
        sink.str(self.request_id);
        sink.key("requestOriginId");
        sink.str(self.request_origin_id);
        sink.key("httpStatusCode");
        sink.int(self.status);
        sink.key("httpHeaders");
        sink.begin_map(self.fields.len());
        for (name, values) in self.fields {
            sink.key(name);
            sink.begin_array(values.len());
            for value in values {
                sink.element();
                sink.str(value);
            }
            sink.end_array();
        }
        sink.end_map();
        sink.key("originalBodySize");
        sink.int(self.size);
        sink.key("bodySize");
        sink.int(self.size);
        sink.key("bodyContent");
        match self.body {
            Some(body) => sink.body(body),
            None => sink.null(),
        }
        sink.key("requestFailed");
        sink.bool(self.status >= 400);
        for key in ["requestStart", "requestDuration", "connectionId"] {
            sink.key(key);
            sink.null();
        }
        sink.end_map();
        end_invocation(sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ws::{Decoder, OwnedEvent};
    use crate::dialects::tunnel::wire::{
        decode, encode_client_request, ClientRequestRef, FieldValue,
    };

    fn core(binary: bool) -> Core {
        Core::new(
            binary,
            &[7; 32],
            "http://relay:8080".into(),
            16 * 1024,
            vec![
                Target {
                    name: "API".into(),
                    web: Some(WebTarget {
                        host: "127.0.0.1:8000".into(),
                        prefix: "/base".into(),
                    }),
                },
                Target {
                    name: "$ECHO".into(),
                    web: None,
                },
            ],
        )
    }

    const HEADERS: &[(&str, &[&str])] = &[
        ("Accept", &["a"]),
        ("Host", &["relay"]),
        ("X-M", &["1", "2"]),
    ];

    fn default_headers() -> Vec<(String, Vec<String>)> {
        HEADERS
            .iter()
            .map(|(n, v)| (n.to_string(), v.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    /// A RequestTarget for `target` with the fields `change` sets.
    fn message(
        binary: bool,
        target: &str,
        change: impl FnOnce(&mut ClientRequestRef<'_>),
    ) -> Vec<u8> {
        message_with(binary, target, &default_headers(), change)
    }

    fn message_with<'a>(
        binary: bool,
        target: &'a str,
        headers: &'a [(String, Vec<String>)],
        change: impl FnOnce(&mut ClientRequestRef<'a>),
    ) -> Vec<u8> {
        let mut r = ClientRequestRef {
            request_id: "r1",
            request_origin_id: "o1",
            target,
            tenant_name: "t",
            http_method: "POST",
            url: "x?y=1",
            http_headers: headers,
            acknowledge_mode: 0,
            acknowledge_origin_id: None,
            original_body_size: 2,
            body_size: 2,
            body_content: Some(b"hi"),
            enable_tracing: false,
            discard_connector_response: false,
            expires_in: Some(1000),
            acknowledge_url: None,
        };
        change(&mut r);
        if binary {
            encode_client_request(Msgpack::default(), &r)
        } else {
            encode_client_request(Json::default(), &r)
        }
    }

    /// The messages in a core's output, decoded: (kind, fields).
    fn sent(c: &mut Core) -> Vec<(&'static str, Vec<FieldValue>)> {
        let out = c.take_output();
        let mut decoder = Decoder::new(1 << 20, false);
        decoder
            .feed_owned(&out)
            .into_iter()
            .map(|event| {
                let OwnedEvent::Message { data, .. } = event else {
                    panic!("{event:?}")
                };
                decode(&data, c.binary).unwrap()
            })
            .collect()
    }

    fn web_wire(r: &Request) -> &[u8] {
        let Some(Work::Web { wire }) = &r.work else {
            panic!("{r:?}")
        };
        wire
    }

    #[test]
    fn a_web_request_becomes_its_target_request() {
        for binary in [false, true] {
            let mut c = core(binary);
            let r = c.receive(&message(binary, "api", |_| {}), 0).unwrap();
            assert_eq!((r.target, r.refused.as_deref(), r.head), (0, None, false));
            assert_eq!(
                web_wire(&r),
                b"POST /base/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: a\r\nX-M: 1\r\nX-M: 2\r\nContent-Length: 2\r\n\r\nhi"
            );
            assert!(!c.has_output());
        }
    }

    #[test]
    fn ours_follow_the_clients_fields_for_every_target() {
        let mut c = core(true);
        let traced = |r: &mut ClientRequestRef<'_>| {
            r.enable_tracing = true;
            r.acknowledge_mode = 3;
            r.acknowledge_url = Some("/tunnel/acknowledge/o1/r1?token=t");
            r.body_size = 100_000;
            r.body_content = None;
        };
        let r = c.receive(&message(true, "Api", traced), 0).unwrap();
        assert!(r.outsourced && !r.delete_body);
        assert_eq!(
            String::from_utf8(web_wire(&r).to_vec()).unwrap(),
            "POST /base/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: a\r\nX-M: 1\r\nX-M: 2\r\n\
             RelayServer-AcknowledgeUrl: http://relay:8080/tunnel/acknowledge/o1/r1?token=t\r\n\
             RelayServer-RequestId: r1\r\nRelayServer-RequestOriginId: o1\r\n\
             Content-Length: 100000\r\n\r\n"
        );
        let r = c.receive(&message(true, "$echo", traced), 0).unwrap();
        let Some(Work::Call {
            method,
            url,
            headers,
            body,
        }) = &r.work
        else {
            panic!("{r:?}")
        };
        assert_eq!(
            (method.as_str(), url.as_str(), body.as_slice()),
            ("POST", "x?y=1", &b""[..])
        );
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "Accept",
                "X-M",
                "X-M",
                "RelayServer-AcknowledgeUrl",
                "RelayServer-RequestId",
                "RelayServer-RequestOriginId"
            ]
        );
        assert!(!c.has_output()); // manual mode: no acknowledgement of the connector's
    }

    #[test]
    fn expired_unknown_and_unsendable_requests_are_decided_here() {
        let mut c = core(false);
        let r = c
            .receive(&message(false, "api", |r| r.expires_in = Some(0)), 0)
            .unwrap();
        assert_eq!(r.refused.as_deref(), Some("expired before it started"));
        assert!(r.answered() && !c.has_output()); // not run, not answered, not acknowledged
        let r = c
            .receive(&message(false, "nope", |r| r.acknowledge_mode = 1), 0)
            .unwrap();
        assert_eq!(r.refused.as_deref(), Some("has no target \"nope\" here"));
        let out = sent(&mut c);
        assert_eq!(out[0].0, "Deliver");
        assert_eq!(out[0].1[2], FieldValue::Int(404));
        assert_eq!(out[0].1[7], FieldValue::Bool(true));
        // ConnectorReceived: acknowledged when nothing was run, removing the body
        assert_eq!(out[1].0, "Acknowledge");
        assert_eq!(out[1].1[2], FieldValue::Bool(true));
        let headers: Vec<(String, Vec<String>)> =
            vec![("X".into(), vec!["a\r\nInjected: 1".into()])];
        let r = c
            .receive(&message_with(false, "api", &headers, |_| {}), 0)
            .unwrap();
        assert!(r.refused.unwrap().starts_with("cannot be sent"));
        assert_eq!(sent(&mut c)[0].1[2], FieldValue::Int(502));
        assert!(c.receive(b"not json", 0).is_none());
        let configure = br#"{"target":"Configure","arguments":[{}]}"#;
        assert!(c.receive(configure, 0).is_none());
    }

    #[test]
    fn acknowledgements_follow_the_mode() {
        for binary in [false, true] {
            let mut c = core(binary);
            // ConnectorReceived: at once, the body kept; nothing after the Deliver
            let mut r = c
                .receive(&message(binary, "api", |r| r.acknowledge_mode = 1), 0)
                .unwrap();
            let out = sent(&mut c);
            assert_eq!(out.len(), 1);
            assert_eq!(
                out[0],
                (
                    "Acknowledge",
                    vec![
                        FieldValue::Str("o1".into()),
                        FieldValue::Str("r1".into()),
                        FieldValue::Bool(false)
                    ]
                )
            );
            c.answer(&mut r, 200, std::iter::empty(), Some(b"ok"), 2, 0);
            assert_eq!(sent(&mut c).len(), 1);
            // ConnectorFinished: after the Deliver, to the acknowledge origin, also on failure
            let mut r = c
                .receive(
                    &message(binary, "api", |r| {
                        r.acknowledge_mode = 2;
                        r.acknowledge_origin_id = Some("a1");
                    }),
                    0,
                )
                .unwrap();
            assert!(!c.has_output());
            c.fail(&mut r, true, 0);
            c.fail(&mut r, false, 0); // a second answer is ignored
            let out = sent(&mut c);
            assert_eq!(out.len(), 2);
            assert_eq!((out[0].0, &out[0].1[2]), ("Deliver", &FieldValue::Int(504)));
            assert_eq!(out[1].1[0], FieldValue::Str("a1".into()));
            assert_eq!(out[1].1[2], FieldValue::Bool(true));
        }
    }

    #[test]
    fn a_whole_answer_is_delivered_from_the_read() {
        let mut c = core(false);
        let mut r = c.receive(&message(false, "api", |_| {}), 0).unwrap();
        let mut parser = ResponseParser::new();
        parser.start(false, 16384).unwrap();
        let mut events = Vec::new();
        let wire = b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\nX-A: 1\r\nContent-Type: t\r\nx-a: \xe9\r\n\r\nno";
        assert!(c
            .respond(&mut r, &mut parser, &mut events, wire, 5)
            .unwrap());
        assert!(r.answered());
        let out = c.take_output();
        assert_eq!(out[0], 0x81); // FIN + text
        let mut decoder = Decoder::new(1 << 20, false);
        let events = decoder.feed_owned(&out);
        let OwnedEvent::Message { data, .. } = &events[0] else {
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
    fn a_streamed_answer_is_left_to_the_caller() {
        let mut c = core(true);
        let mut r = c.receive(&message(true, "api", |_| {}), 0).unwrap();
        let mut parser = ResponseParser::new();
        parser.start(false, 4).unwrap();
        let mut events = Vec::new();
        let wire = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc";
        assert!(!c
            .respond(&mut r, &mut parser, &mut events, wire, 0)
            .unwrap());
        assert_eq!(events.len(), 2);
        assert!(!c.has_output() && !r.answered());
    }

    #[test]
    fn uploaded_discarded_and_traced_answers() {
        let mut c = core(true);
        let mut r = c.receive(&message(true, "api", |_| {}), 0).unwrap();
        assert!(!r.uploads(Some(16 * 1024), c.inline_limit()));
        assert!(r.uploads(Some(16 * 1024 + 1), c.inline_limit()));
        assert!(r.uploads(None, c.inline_limit()));
        let fields = [
            ("Content-Length", "9"),
            ("Transfer-Encoding", "chunked"),
            ("X", "1"),
        ];
        c.answer(
            &mut r,
            200,
            fields.iter().map(|(n, v)| (*n, Cow::Borrowed(*v))),
            None,
            99_999,
            0,
        );
        let out = sent(&mut c);
        assert_eq!(
            out[0].1[3],
            FieldValue::Headers(vec![("X".into(), vec!["1".into()])])
        );
        assert_eq!(
            (&out[0].1[5], &out[0].1[6]),
            (&FieldValue::Int(99_999), &FieldValue::Null)
        );
        let mut r = c
            .receive(
                &message(true, "api", |r| r.discard_connector_response = true),
                0,
            )
            .unwrap();
        assert!(!r.uploads(None, c.inline_limit()));
        c.answer(&mut r, 200, std::iter::empty(), Some(b"body"), 4, 0);
        let out = sent(&mut c);
        assert_eq!(
            (&out[0].1[5], &out[0].1[6]),
            (&FieldValue::Int(0), &FieldValue::Null)
        );
        let mut r = c
            .receive(
                &message(true, "api", |r| r.enable_tracing = true),
                1_000_000_000,
            )
            .unwrap();
        c.answer(&mut r, 201, std::iter::empty(), Some(b""), 0, 3_500_000_000);
        let out = sent(&mut c);
        assert_eq!(
            out[0].1[3],
            FieldValue::Headers(vec![(
                "RelayServer-TargetDuration".into(),
                vec!["2.500000".into()]
            )])
        );
    }

    #[test]
    fn request_bytes_check_what_they_carry() {
        let fields = [("Connection", "x"), ("X-Multi", "1"), ("x-multi", "2")];
        let out =
            encode_target_request("GET", "/", "h", fields.iter().copied(), &[], b"", None).unwrap();
        assert_eq!(
            out,
            b"GET / HTTP/1.1\r\nHost: h\r\nConnection: x\r\nX-Multi: 1\r\nx-multi: 2\r\n\r\n"
        );
        let out =
            encode_target_request("PUT", "/", "h", std::iter::empty(), &[], b"", Some(9)).unwrap();
        assert_eq!(
            out,
            b"PUT / HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\n"
        );
        for (name, value) in [("X-A", "a\r\nB: c"), ("X A", "v"), ("", "v")] {
            let fields = [(name, value)];
            assert!(
                encode_target_request("GET", "/", "h", fields.iter().copied(), &[], b"", None)
                    .is_err()
            );
        }
        assert!(
            encode_target_request("GET", "/ x", "h", std::iter::empty(), &[], b"", None).is_err()
        );
        assert_eq!(
            REQUEST_TARGET,
            crate::dialects::tunnel::wire::kind_bit("RequestTarget")
        );
    }
}

pub mod py {
    //! `TunnelConnectorCore` and its `TunnelRequest`s, for `dialects/tunnel/connector.py`.
    use std::borrow::Cow;

    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    use super::{Core, Request, Target, WebTarget, Work};
    use crate::codec::http::py::{response_events_list, HttpResponseParser};
    use crate::codec::http::ResponseEvent;
    use crate::codec::ws::py::{event_to_py, ReadBytes, WsDecoder};
    use crate::codec::ws::{Event as WsEvent, MASK_SEED_LEN};
    use crate::error::Error;

    /// A request the core received (`rust/dialects/tunnel/connector.rs`).
    #[pyclass(module = "rmb_relay._core", name = "TunnelRequest")]
    pub struct TunnelRequest {
        inner: Request,
        /// a web target's request bytes, made a Python object once
        wire: Option<Py<PyBytes>>,
    }

    impl TunnelRequest {
        fn new(py: Python<'_>, mut inner: Request) -> Self {
            let wire = match inner.work.take() {
                Some(Work::Web { wire }) => Some(PyBytes::new(py, &wire).unbind()),
                other => {
                    inner.work = other;
                    None
                }
            };
            TunnelRequest { inner, wire }
        }
    }

    #[pymethods]
    impl TunnelRequest {
        #[getter]
        fn request_id(&self) -> &str {
            &self.inner.request_id
        }
        #[getter]
        fn target(&self) -> usize {
            self.inner.target
        }
        #[getter]
        fn refused(&self) -> Option<&str> {
            self.inner.refused.as_deref()
        }
        #[getter]
        fn wire(&self, py: Python<'_>) -> Option<Py<PyBytes>> {
            self.wire.as_ref().map(|w| w.clone_ref(py))
        }
        #[getter]
        fn head(&self) -> bool {
            self.inner.head
        }
        #[getter]
        fn outsourced(&self) -> bool {
            self.inner.outsourced
        }
        #[getter]
        fn body_size(&self) -> i64 {
            self.inner.body_size
        }
        #[getter]
        fn delete_body(&self) -> bool {
            self.inner.delete_body
        }
        #[getter]
        fn answered(&self) -> bool {
            self.inner.answered()
        }
        // what `Target.call` takes (empty for a web target's request)
        #[getter]
        fn method(&self) -> &str {
            match &self.inner.work {
                Some(Work::Call { method, .. }) => method,
                _ => "",
            }
        }
        #[getter]
        fn url(&self) -> &str {
            match &self.inner.work {
                Some(Work::Call { url, .. }) => url,
                _ => "",
            }
        }
        #[getter]
        fn headers(&self) -> Vec<(String, String)> {
            match &self.inner.work {
                Some(Work::Call { headers, .. }) => headers.clone(),
                _ => Vec::new(),
            }
        }
        #[getter]
        fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            match &self.inner.work {
                Some(Work::Call { body, .. }) => PyBytes::new(py, body),
                _ => PyBytes::new(py, b""),
            }
        }
    }

    /// The connector's decisions for one websocket (`rust/dialects/tunnel/connector.rs`).
    #[pyclass(module = "rmb_relay._core")]
    pub struct TunnelConnectorCore {
        core: Core,
        events: Vec<ResponseEvent>,
    }

    #[pymethods]
    impl TunnelConnectorCore {
        #[new]
        fn new(
            binary: bool,
            seed: &[u8],
            server: String,
            inline_limit: usize,
            targets: Vec<(String, Option<(String, String)>)>,
        ) -> PyResult<Self> {
            let seed: &[u8; MASK_SEED_LEN] = seed.try_into().map_err(|_| {
                Error::InvalidArgument(format!("seed must be {MASK_SEED_LEN} bytes"))
            })?;
            let targets = targets
                .into_iter()
                .map(|(name, web)| Target {
                    name,
                    web: web.map(|(host, prefix)| WebTarget { host, prefix }),
                })
                .collect();
            Ok(TunnelConnectorCore {
                core: Core::new(binary, seed, server, inline_limit, targets),
                events: Vec::new(),
            })
        }

        /// One message: a `TunnelRequest` for a well-formed `RequestTarget`, else None.
        fn request(
            &mut self,
            py: Python<'_>,
            payload: &[u8],
            now: i64,
        ) -> PyResult<Option<Py<TunnelRequest>>> {
            match self.core.receive(payload, now) {
                Some(r) => Ok(Some(Py::new(py, TunnelRequest::new(py, r))?)),
                None => Ok(None),
            }
        }

        /// A websocket read in one call: deframed with the connection's `decoder`, each
        /// `RequestTarget` as a `TunnelRequest`, every other event as `WsDecoder.feed` gives it.
        fn feed_ws<'py>(
            &mut self,
            py: Python<'py>,
            decoder: &Bound<'py, WsDecoder>,
            data: ReadBytes<'py>,
            now: i64,
        ) -> PyResult<Bound<'py, PyList>> {
            let data = data.as_slice();
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
                    if let Some(r) = self.core.receive(bytes, now) {
                        return out.append(Py::new(py, TunnelRequest::new(py, r))?);
                    }
                }
                if let Some(event) = event_to_py(py, ev, None, &mut true, 0)? {
                    out.append(event)?;
                }
                Ok::<(), PyErr>(())
            })?;
            Ok(out)
        }

        /// A target connection's bytes for `request`: None when they were its whole answer
        /// (delivered), else the parser's events as `HttpResponseParser.feed` gives them.
        fn respond<'py>(
            &mut self,
            py: Python<'py>,
            mut request: PyRefMut<'py, TunnelRequest>,
            parser: &Bound<'py, HttpResponseParser>,
            data: &[u8],
            now: i64,
        ) -> PyResult<Option<Bound<'py, PyList>>> {
            let mut parser = parser.borrow_mut();
            let mut events = std::mem::take(&mut self.events);
            events.clear();
            let done = self.core.respond(
                &mut request.inner,
                &mut parser.inner,
                &mut events,
                data,
                now,
            );
            let result = match done {
                Ok(true) => Ok(None),
                Ok(false) => response_events_list(py, &mut events).map(Some),
                Err(err) => Err(err.into()),
            };
            self.events = events;
            result
        }

        /// The target's answer: inline `body`, or (None) `size` bytes uploaded to the body
        /// store; nothing when the request was answered already.
        #[allow(clippy::too_many_arguments)]
        fn answer(
            &mut self,
            mut request: PyRefMut<'_, TunnelRequest>,
            status: i64,
            headers: Vec<(String, String)>,
            body: Option<&[u8]>,
            size: i64,
            now: i64,
        ) {
            let fields = headers
                .iter()
                .map(|(n, v)| (n.as_str(), Cow::Borrowed(v.as_str())));
            self.core
                .answer(&mut request.inner, status, fields, body, size, now);
        }

        /// The target failed (502) or did not answer in time (504).
        fn fail(&mut self, mut request: PyRefMut<'_, TunnelRequest>, timed_out: bool, now: i64) {
            self.core.fail(&mut request.inner, timed_out, now);
        }

        /// Whether an answer of `length` bytes (None: a stream) is uploaded to the body store.
        fn uploads(&self, request: PyRef<'_, TunnelRequest>, length: Option<usize>) -> bool {
            request.inner.uploads(length, self.core.inline_limit())
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
        m.add_class::<TunnelConnectorCore>()?;
        m.add_class::<TunnelRequest>()
    }
}
