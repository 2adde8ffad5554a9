//! What a tunnelled request carries to the connector and what its client gets back: the
//! request's fields as `httpHeaders`, and the connector's `Deliver` as the client's answer.
//!
//! Both directions drop the connection-level fields (`wire::HOP_BY_HOP`, compared without
//! ASCII case). The answer adds `Content-Type: text/plain; charset=utf-8` when the target
//! named none and there is a body or the status is not 202/204 (what `contract.HttpResponse`
//! adds to the relay's own answers), and, in trace mode, RelayServer's three tracing fields.
//! The hub writes the answer itself when HTTP/1.1 carries it kept alive ([`client_answer`]);
//! otherwise Python answers from the same fields ([`response_of`]).

use crate::codec::http::{encode_response, encode_response_head, is_bodyless, Framing};
use crate::dialects::tunnel::wire::HOP_BY_HOP;

/// A `Deliver`'s fields the hub uses.
#[derive(Debug)]
pub struct Delivered {
    pub request_id: String,
    pub status: i64,
    pub headers: Vec<(String, Vec<String>)>,
    /// inline body (None: none, or stored when `body_size` > 0)
    pub body: Option<Vec<u8>>,
    pub body_size: i64,
}

impl Delivered {
    pub fn stored(&self) -> bool {
        self.body.is_none() && self.body_size > 0
    }
}

/// What trace mode adds to an answer: the request's id and this relay's machine and version
/// (RelayServer's three tracing fields).
#[derive(Debug, Clone, Copy)]
pub struct Trace<'a> {
    pub request_id: &'a str,
    pub machine: &'a str,
    pub version: &'a str,
}

/// What `contract.HttpResponse` names when nothing else does.
const DEFAULT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// The connector's answer for Python: status, the client's fields, the inline body or the
/// size of the stored one, and (for another relay's waiter) the bus frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// the body is in the body store (the connector uploaded it), this long
    pub stored: Option<u64>,
    /// `r`/`j` + the connector's message, when the waiter is another relay
    pub message: Vec<u8>,
    pub request_id: String,
}

/// A client request's fields as `httpHeaders` (latin-1 text, names in first-seen order with
/// all their values, `HOP_BY_HOP` left out), and the characters they hold for the memory
/// budget (each name once per value, and the values).
pub fn request_headers<'a>(
    fields: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> (Vec<(String, Vec<String>)>, usize) {
    let mut headers: Vec<(String, Vec<String>)> = Vec::new();
    let mut size = 0;
    for (name, value) in fields {
        if HOP_BY_HOP.contains(&name) {
            continue;
        }
        let text: String = value.iter().map(|b| char::from(*b)).collect();
        size += name.chars().count() + value.len();
        match headers.iter_mut().find(|(n, _)| n == name) {
            Some((_, values)) => values.push(text),
            None => headers.push((name.to_owned(), vec![text])),
        }
    }
    (headers, size)
}

/// The client's fields of an answer (module docstring). `trace`: the request id and the
/// relay's settings, in trace mode.
pub fn answer_fields<'a>(
    status: u16,
    headers: &'a [(String, Vec<String>)],
    has_body: bool,
    trace: Option<Trace<'a>>,
) -> Vec<(&'a str, &'a str)> {
    let mut out: Vec<(&str, &str)> = Vec::with_capacity(headers.len() + 4);
    let mut typed = false;
    for (name, values) in headers {
        if HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name)) {
            continue;
        }
        typed |= name.eq_ignore_ascii_case("content-type");
        out.extend(values.iter().map(|v| (name.as_str(), v.as_str())));
    }
    if let Some(trace) = trace {
        out.push(("RelayServer-RequestId", trace.request_id));
        out.push(("RelayServer-Server-MachineName", trace.machine));
        out.push(("RelayServer-Server-Version", trace.version));
    }
    if !typed && (has_body || (status != 202 && status != 204)) {
        out.push(("Content-Type", DEFAULT_CONTENT_TYPE));
    }
    out
}

/// The client's HTTP/1.1 answer kept alive, or None when HTTP/1.1 cannot carry it as it is
/// (a status or a field it refuses: Python then answers 500).
pub fn client_answer(
    status: u16,
    headers: &[(String, Vec<String>)],
    body: &[u8],
    trace: Option<Trace<'_>>,
) -> Option<Vec<u8>> {
    let fields = answer_fields(status, headers, !body.is_empty(), trace);
    encode_response(status, &fields, body, false).ok()
}

/// Whether HTTP/1.1 carries the connector's answer to a client: a final status (200-599: a
/// 1xx, a 101 above all, would let a connector switch the client's connection to another
/// protocol behind a front proxy), no body where its status allows none, fields that encode.
pub fn carried(d: &Delivered, trace: Option<Trace<'_>>) -> bool {
    let Ok(status) = u16::try_from(d.status) else {
        return false;
    };
    let length = d
        .body
        .as_ref()
        .map_or(d.body_size.max(0) as u64, |b| b.len() as u64);
    if !(200..=599).contains(&status) || (length > 0 && (status == 204 || status == 304)) {
        return false;
    }
    let fields = answer_fields(status, &d.headers, length > 0, trace);
    let framing = (!is_bodyless(status)).then_some(Framing::Length(length));
    encode_response_head(status, &fields, framing, false).is_ok()
}

/// The connector's answer for Python to write (module docstring); only answers [`carried`]
/// accepts get here.
pub fn response_of(d: &Delivered, trace: Option<Trace<'_>>, message: Vec<u8>) -> Response {
    let stored = (d.body.is_none() && d.body_size > 0).then_some(d.body_size as u64);
    let status = u16::try_from(d.status).unwrap_or(u16::MAX);
    let has_body = stored.is_some() || d.body.as_ref().is_some_and(|b| !b.is_empty());
    let headers = answer_fields(status, &d.headers, has_body, trace)
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect();
    Response {
        status,
        headers,
        body: d.body.clone().unwrap_or_default(),
        stored,
        message,
        request_id: d.request_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &[&str])]) -> Vec<(String, Vec<String>)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.iter().map(|s| (*s).to_owned()).collect()))
            .collect()
    }

    #[test]
    fn hop_by_hop_fields_are_dropped_and_repeated_ones_kept_in_order() {
        let fields = h(&[
            ("X-A", &["1", "2"]),
            ("Connection", &["close"]),
            ("content-type", &["a/b"]),
        ]);
        let out = answer_fields(200, &fields, true, None);
        assert_eq!(
            out,
            vec![("X-A", "1"), ("X-A", "2"), ("content-type", "a/b")]
        );
    }

    #[test]
    fn a_content_type_is_named_unless_an_empty_202_or_204() {
        assert_eq!(answer_fields(204, &[], false, None), vec![]);
        assert_eq!(answer_fields(202, &[], false, None), vec![]);
        assert_eq!(
            answer_fields(200, &[], false, None),
            vec![("Content-Type", DEFAULT_CONTENT_TYPE)]
        );
    }

    #[test]
    fn the_answer_is_kept_alive_and_refuses_what_http_cannot_carry() {
        let bytes = client_answer(200, &h(&[("X-A", &["1"])]), b"hi", None).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nhi"));
        assert!(!text.to_ascii_lowercase().contains("connection: close"));
        assert!(client_answer(200, &h(&[("Bad Name", &["1"])]), b"", None).is_none());
        assert!(client_answer(1000, &[], b"", None).is_none());
    }

    #[test]
    fn request_headers_group_values_and_count_characters() {
        let raw: Vec<(String, Vec<u8>)> = vec![
            ("x-a".into(), b"1".to_vec()),
            ("connection".into(), b"keep-alive".to_vec()),
            ("x-a".into(), b"\xe9".to_vec()),
        ];
        let (headers, size) = request_headers(raw.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        assert_eq!(headers, h(&[("x-a", &["1", "\u{e9}"])]));
        assert_eq!(size, 3 + 1 + 3 + 1);
    }
}
