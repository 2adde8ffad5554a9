//! Client side of HTTP/1.1, request direction: the target request of a tunnelled request
//! (the connector's web targets), built in one call from the message's header map.
//!
//! Why not `http::encode_request`: that one takes a flat list of pairs and refuses framing
//! fields, so the connector flattened the message's `{name: [values]}` map and filtered out
//! the hop-by-hop fields in Python, two list comprehensions per request. Here the map is read
//! where it is, the fields that describe the hop to the relay ([`SKIP`]) are left out, and
//! `Host` and `Content-Length` are ours.

use crate::codec::http::{check_field, check_request_line};
use crate::error::Result;

/// Request fields a connector does not pass on: they describe the client's hop to the relay
/// (the target gets its own Host, and a Content-Length for the body we send).
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

/// Appends `name: value\r\n` after checking both (no CR, LF or NUL: no injected fields).
fn field(out: &mut Vec<u8>, name: &str, value: &str) -> Result<()> {
    check_field(name, value)?;
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n");
    Ok(())
}

/// `METHOD target HTTP/1.1`, `Host`, the client's fields less [`SKIP`] (repeated names in
/// order), the `extra` fields (tracing, the acknowledge URL), `Content-Length` when there is
/// a body (`length`, or the body's own length), then the body. With `length` given and an
/// empty `body`, only the head is built: the body is streamed after it.
pub fn encode_target_request<'a>(
    method: &str,
    target: &str,
    host: &str,
    headers: impl Iterator<Item = (&'a str, &'a str)>,
    extra: &[(&str, &str)],
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
    for (name, value) in headers {
        if !skipped(name) {
            field(&mut out, name, value)?;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_fields_are_left_out_and_repeated_fields_kept_in_order() {
        let headers = [
            ("Host", "relay"),
            ("Accept", "a"),
            ("Connection", "keep-alive"),
            ("X-Multi", "1"),
            ("x-multi", "2"),
            ("content-length", "5"),
        ];
        let out = encode_target_request(
            "POST",
            "/api/x?y=1",
            "127.0.0.1:80",
            headers.iter().copied(),
            &[("RelayServer-RequestId", "r1")],
            b"hello",
            None,
        )
        .unwrap();
        assert_eq!(
            out,
            b"POST /api/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:80\r\nAccept: a\r\nX-Multi: 1\r\nx-multi: 2\r\nRelayServer-RequestId: r1\r\nContent-Length: 5\r\n\r\nhello"
        );
    }

    #[test]
    fn no_content_length_without_a_body_and_a_streamed_length() {
        let out =
            encode_target_request("GET", "/", "h", std::iter::empty(), &[], b"", None).unwrap();
        assert_eq!(out, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n");
        let out =
            encode_target_request("PUT", "/", "h", std::iter::empty(), &[], b"", Some(9)).unwrap();
        assert_eq!(
            out,
            b"PUT / HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\n"
        );
    }

    #[test]
    fn injection_is_refused() {
        for (name, value) in [("X-A", "a\r\nB: c"), ("X A", "v"), ("", "v")] {
            let headers = [(name, value)];
            assert!(encode_target_request(
                "GET",
                "/",
                "h",
                headers.iter().copied(),
                &[],
                b"",
                None
            )
            .is_err());
        }
        assert!(
            encode_target_request("GET", "/ x", "h", std::iter::empty(), &[], b"", None).is_err()
        );
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList, PyString};

    /// The target request bytes of a tunnelled request; `headers` is the message's
    /// `{name: [values]}` map, read in place.
    #[pyfunction]
    #[pyo3(signature = (method, target, host, headers, extra, body, length = None))]
    #[allow(clippy::too_many_arguments)]
    fn encode_target_request<'py>(
        py: Python<'py>,
        method: &str,
        target: &str,
        host: &str,
        headers: &Bound<'py, PyDict>,
        extra: Vec<(String, String)>,
        body: &[u8],
        length: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut pairs: Vec<(Bound<'py, PyString>, Bound<'py, PyString>)> = Vec::new();
        for (name, values) in headers.iter() {
            let name = name.downcast_into::<PyString>()?;
            for value in values.downcast::<PyList>()?.iter() {
                pairs.push((name.clone(), value.downcast_into::<PyString>()?));
            }
        }
        let texts = pairs
            .iter()
            .map(|(n, v)| Ok((n.to_str()?, v.to_str()?)))
            .collect::<PyResult<Vec<_>>>()?;
        let extra: Vec<(&str, &str)> = extra
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let out = super::encode_target_request(
            method,
            target,
            host,
            texts.into_iter(),
            &extra,
            body,
            length,
        )?;
        Ok(PyBytes::new(py, &out))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(encode_target_request, m)?)
    }
}
