//! The relay's native express answer: a connector's `Deliver` (msgpack or JSON, body inline)
//! straight to the client's HTTP/1.1 response bytes, in one call.
//!
//! Why: on the express path (`dialects/tunnel/express.py`) the relay spent the reply half of
//! each request in Python: the message decoded into a `TargetResponse` dataclass, its fields
//! filtered into a header list (`client.response_headers`), an `HttpResponse` built, its
//! `header_list` completed and encoded. Here that is one pass over the message's bytes; Python
//! keeps only the job's bookkeeping (in flight, forgotten, metrics) and the write.
//!
//! The bytes are exactly `client.respond` + `Connection._send_whole` for a relay-mode request
//! kept alive: the target's fields in the message's order less `HOP_BY_HOP` (compared in lower
//! case), `Content-Type: text/plain; charset=utf-8` added when the target sent none and the
//! answer has a body or is not 202/204, and `http::encode_response` without `Connection:
//! close`. `None` for everything else, which Python then answers as before (and words the
//! errors): not a `Deliver`, a message this decoder leaves to wire.py, an outsourced body, a
//! status or field HTTP/1.1 cannot carry, a field name that is not ASCII (`str.lower` and
//! ASCII lower case may differ there).

use crate::codec::http::encode_response;
use crate::dialects::tunnel::wire::{self as tunnel_wire, FieldRef, FieldValue, HOP_BY_HOP};

// TargetResponse's fields in wire.py's dataclass order (tunnel_wire::TARGET_RESPONSE)
const REQUEST_ID: usize = 0;
const HTTP_STATUS_CODE: usize = 2;
const HTTP_HEADERS: usize = 3;
const BODY_SIZE: usize = 5;
const BODY_CONTENT: usize = 6;

/// What `HttpResponse` adds when the target named no content type (dialects/base.py).
const DEFAULT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// A `Deliver` answered natively: its request id, the target's status and the client's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub request_id: String,
    pub status: u16,
    pub bytes: Vec<u8>,
}

/// The response bytes for a Deliver's status, fields (name, value) and inline body.
fn encode<'a>(
    status: i64,
    fields: impl Iterator<Item = (&'a str, &'a str)>,
    body: &[u8],
) -> Option<(u16, Vec<u8>)> {
    let status = u16::try_from(status).ok()?;
    let mut headers: Vec<(&str, &str)> = Vec::new();
    let mut typed = false;
    for (name, value) in fields {
        if !name.is_ascii() {
            return None; // Python's str.lower() decides those
        }
        if HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name)) {
            continue;
        }
        typed |= name.eq_ignore_ascii_case("content-type");
        headers.push((name, value));
    }
    if !typed && (!body.is_empty() || (status != 202 && status != 204)) {
        headers.push(("Content-Type", DEFAULT_CONTENT_TYPE));
    }
    let bytes = encode_response(status, &headers, body, false).ok()?;
    Some((status, bytes))
}

/// `data` (a connector's message) as the client's answer, or None (module docstring).
pub fn answer(data: &[u8], binary: bool) -> Option<Answer> {
    if binary {
        let (kind, fields) = tunnel_wire::decode_ref(data, true).ok()?;
        if kind != "Deliver" {
            return None;
        }
        let FieldRef::Str(request_id) = &fields[REQUEST_ID] else {
            return None;
        };
        let FieldRef::Int(status) = fields[HTTP_STATUS_CODE] else {
            return None;
        };
        let FieldRef::Headers(headers) = &fields[HTTP_HEADERS] else {
            return None;
        };
        let body: &[u8] = match &fields[BODY_CONTENT] {
            FieldRef::Bytes(b) => b,
            _ if matches!(fields[BODY_SIZE], FieldRef::Int(n) if n > 0) => return None,
            _ => b"",
        };
        let pairs = headers
            .iter()
            .flat_map(|(n, values)| values.iter().map(move |v| (n.as_ref(), v.as_ref())));
        let (status, bytes) = encode(status, pairs, body)?;
        return Some(Answer {
            request_id: request_id.to_string(),
            status,
            bytes,
        });
    }
    let (kind, fields) = tunnel_wire::decode(data, false).ok()?;
    if kind != "Deliver" {
        return None;
    }
    let FieldValue::Str(request_id) = &fields[REQUEST_ID] else {
        return None;
    };
    let FieldValue::Int(status) = fields[HTTP_STATUS_CODE] else {
        return None;
    };
    let FieldValue::Headers(headers) = &fields[HTTP_HEADERS] else {
        return None;
    };
    let body: &[u8] = match &fields[BODY_CONTENT] {
        FieldValue::Bytes(b) => b,
        _ if matches!(fields[BODY_SIZE], FieldValue::Int(n) if n > 0) => return None,
        _ => b"",
    };
    let pairs = headers
        .iter()
        .flat_map(|(n, values)| values.iter().map(move |v| (n.as_str(), v.as_str())));
    let (status, bytes) = encode(status, pairs, body)?;
    Some(Answer {
        request_id: request_id.clone(),
        status,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON_DELIVER: &str = concat!(
        r#"{"target":"Deliver","arguments":[{"requestId":"r1","requestOriginId":"o",""#,
        r#"httpStatusCode":200,"httpHeaders":{"X-A":["1","2"],"Connection":["close"]},"#,
        r#""originalBodySize":2,"bodySize":2,"bodyContent":"aGk=","requestFailed":false}]}"#
    );

    #[test]
    fn json_deliver_becomes_the_clients_answer() {
        let got = answer(JSON_DELIVER.as_bytes(), false).unwrap();
        assert_eq!(got.request_id, "r1");
        assert_eq!(got.status, 200);
        assert_eq!(
            got.bytes,
            b"HTTP/1.1 200 OK\r\nX-A: 1\r\nX-A: 2\r\nContent-Type: text/plain; charset=utf-8\r\n\
              Content-Length: 2\r\n\r\nhi"
                .to_vec()
        );
    }

    #[test]
    fn outsourced_body_and_other_kinds_are_left_to_python() {
        let outsourced = JSON_DELIVER.replace(r#""bodyContent":"aGk=""#, r#""bodyContent":null"#);
        assert_eq!(answer(outsourced.as_bytes(), false), None);
        let ack = r#"{"target":"Acknowledge","arguments":[{"acknowledgeOriginId":"o","requestId":"r1"}]}"#;
        assert_eq!(answer(ack.as_bytes(), false), None);
        let status = JSON_DELIVER.replace("200", "70000");
        assert_eq!(answer(status.as_bytes(), false), None);
    }

    #[test]
    fn no_content_type_for_an_empty_204() {
        let empty = JSON_DELIVER
            .replace("200", "204")
            .replace(r#""bodyContent":"aGk=""#, r#""bodyContent":null"#)
            .replace(r#""bodySize":2"#, r#""bodySize":0"#);
        let got = answer(empty.as_bytes(), false).unwrap();
        assert_eq!(
            got.bytes,
            b"HTTP/1.1 204 No Content\r\nX-A: 1\r\nX-A: 2\r\n\r\n".to_vec()
        );
    }
}

/// A client request's fields as `httpHeaders` (`tunnel_request_headers`' rules: latin-1
/// text, names in first-seen order with all their values, `HOP_BY_HOP` left out), and the
/// characters they hold as `hub.held_size` counts them (each name once per value, the values).
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

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList, PyString};

    use crate::dialects::tunnel::wire::{encode_client_request, ClientRequestRef, Json, Msgpack};

    /// The express path's request in one call: `(httpHeaders, the characters they hold for
    /// the memory budget, the RequestTarget message)` for a relay-mode request sent at once
    /// (no tracing, the answer wanted, acknowledged by this relay, body inline), the bytes
    /// `wire.encode` gives the ClientRequest `Hub._send` completes.
    #[pyfunction]
    #[allow(clippy::too_many_arguments)]
    fn tunnel_express_request<'py>(
        py: Python<'py>,
        request: PyRef<'py, crate::codec::http::py::HttpRequest>,
        body: &[u8],
        request_id: &str,
        origin_id: &str,
        target: &str,
        tenant_name: &str,
        url: &str,
        ack_mode: i64,
        expires_in: i64,
        ack_url: Option<&str>,
        binary: bool,
    ) -> PyResult<(Bound<'py, PyDict>, usize, Bound<'py, PyBytes>)> {
        let (headers, size) = super::request_headers(
            request
                .fields()
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        let length = body.len() as i64;
        let fields = ClientRequestRef {
            request_id,
            request_origin_id: origin_id,
            target,
            tenant_name,
            http_method: request.method_str(),
            url,
            http_headers: &headers,
            acknowledge_mode: ack_mode,
            acknowledge_origin_id: Some(origin_id),
            original_body_size: length,
            body_size: length,
            body_content: (!body.is_empty()).then_some(body),
            enable_tracing: false,
            discard_connector_response: false,
            expires_in: Some(expires_in),
            acknowledge_url: ack_url,
        };
        let message = if binary {
            encode_client_request(Msgpack::with_capacity(256 + body.len()), &fields)
        } else {
            encode_client_request(Json::with_capacity(384 + body.len() * 4 / 3), &fields)
        };
        let dict = PyDict::new(py);
        for (name, values) in &headers {
            dict.set_item(name, PyList::new(py, values)?)?;
        }
        Ok((dict, size, PyBytes::new(py, &message)))
    }

    /// `(request id, status, the client's HTTP/1.1 answer kept alive)` for a `Deliver` the
    /// express path can answer natively, else None (Python's path takes the message).
    #[pyfunction]
    fn tunnel_express_answer<'py>(
        py: Python<'py>,
        data: &[u8],
        binary: bool,
    ) -> Option<(Bound<'py, PyString>, u16, Bound<'py, PyBytes>)> {
        let got = super::answer(data, binary)?;
        Some((
            PyString::new(py, &got.request_id),
            got.status,
            PyBytes::new(py, &got.bytes),
        ))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(tunnel_express_answer, m)?)?;
        m.add_function(wrap_pyfunction!(tunnel_express_request, m)?)?;
        Ok(())
    }
}
