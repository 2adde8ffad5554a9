//! SBD message framing (spec/sbd.md §1.2, §1.3, §1.6).
//!
//! Every SBD message is one websocket message starting with a 32-byte header. If the first 28
//! header bytes are zero it is a command whose 4-byte ASCII tag is bytes 28..32; otherwise the
//! header is a peer's ed25519 public key and the message is a forward. The relay rewrites a
//! forward's header from the destination key to the sender's key.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

use crate::error::{Error, Result};

/// defined by the sbd spec: header length
pub const HEADER_LEN: usize = 32;
/// defined by the sbd spec: a header whose first 28 bytes are zero is a command
pub const COMMAND_PREFIX_LEN: usize = 28;
/// defined by the sbd spec: max message size including the header
pub const MAX_MESSAGE: usize = 20_000;
/// base64url without padding of 32 bytes
pub const PUBKEY_PATH_LEN: usize = 43;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    Command { tag: &'a [u8], payload: &'a [u8] },
    Forward { peer: &'a [u8], payload: &'a [u8] },
}

/// What a header says on its own: a command and its tag, or a forward and its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    Command([u8; HEADER_LEN - COMMAND_PREFIX_LEN]),
    Forward([u8; HEADER_LEN]),
}

pub fn parse_header(header: &[u8; HEADER_LEN]) -> Header {
    let (prefix, tag) = header.split_at(COMMAND_PREFIX_LEN);
    if prefix.iter().all(|b| *b == 0) {
        Header::Command(tag.try_into().expect("4-byte tag"))
    } else {
        Header::Forward(*header)
    }
}

/// The error for a message without a whole header (the spec's minimum length).
pub fn too_short(len: usize) -> Error {
    Error::Sbd(format!(
        "message of {len} bytes is shorter than the {HEADER_LEN}-byte header"
    ))
}

pub fn classify(message: &[u8]) -> Result<Message<'_>> {
    if message.len() < HEADER_LEN {
        return Err(too_short(message.len()));
    }
    let (header, payload) = message.split_at(HEADER_LEN);
    if header[..COMMAND_PREFIX_LEN].iter().all(|b| *b == 0) {
        Ok(Message::Command {
            tag: &header[COMMAND_PREFIX_LEN..],
            payload,
        })
    } else {
        Ok(Message::Forward {
            peer: header,
            payload,
        })
    }
}

pub fn encode_command(tag: &[u8], payload: &[u8]) -> Result<Vec<u8>> {
    if tag.len() != HEADER_LEN - COMMAND_PREFIX_LEN {
        return Err(Error::InvalidArgument(format!(
            "command tag must be 4 bytes, got {}",
            tag.len()
        )));
    }
    let mut out = vec![0u8; HEADER_LEN + payload.len()];
    out[COMMAND_PREFIX_LEN..HEADER_LEN].copy_from_slice(tag);
    out[HEADER_LEN..].copy_from_slice(payload);
    Ok(out)
}

fn check_forward(message: &[u8], sender: &[u8]) -> Result<()> {
    if sender.len() != HEADER_LEN {
        return Err(Error::InvalidArgument(format!(
            "sender key must be {HEADER_LEN} bytes, got {}",
            sender.len()
        )));
    }
    if message.len() < HEADER_LEN {
        return Err(Error::Sbd("forward shorter than its header".into()));
    }
    Ok(())
}

/// `sender || message[32..]`.
pub fn rewrite_forward(message: &[u8], sender: &[u8]) -> Result<Vec<u8>> {
    check_forward(message, sender)?;
    let mut out = Vec::with_capacity(message.len());
    out.extend_from_slice(sender);
    out.extend_from_slice(&message[HEADER_LEN..]);
    Ok(out)
}

/// The rewritten forward inside a server binary websocket frame, in one allocation.
pub fn forward_frame(message: &[u8], sender: &[u8]) -> Result<Vec<u8>> {
    check_forward(message, sender)?;
    let len = message.len();
    let mut out = Vec::with_capacity(len + 10);
    out.push(0x82); // FIN + binary (RFC 6455 §5.2)
    if len < 126 {
        out.push(len as u8);
    } else if len <= 0xffff {
        out.push(126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(sender);
    out.extend_from_slice(&message[HEADER_LEN..]);
    Ok(out)
}

/// The URL path segment of an SBD connection: strict base64url (no padding, canonical) of 32
/// bytes that do not look like a command header (spec/sbd.md pitfalls 1-2).
pub fn decode_pubkey_path(segment: &str) -> Result<[u8; HEADER_LEN]> {
    if segment.len() != PUBKEY_PATH_LEN {
        return Err(Error::Sbd(format!(
            "public key must be {PUBKEY_PATH_LEN} base64url characters, got {}",
            segment.len()
        )));
    }
    let bytes = URL_SAFE_NO_PAD
        .decode(segment)
        .map_err(|err| Error::Sbd(format!("public key is not canonical base64url: {err}")))?;
    let key: [u8; HEADER_LEN] = bytes
        .try_into()
        .map_err(|_| Error::Sbd("public key must decode to 32 bytes".into()))?;
    if key[..COMMAND_PREFIX_LEN].iter().all(|b| *b == 0) {
        return Err(Error::Sbd("public key looks like a command header".into()));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeros_then(tag: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut v = vec![0u8; 28];
        v.extend_from_slice(tag);
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn golden_commands() {
        assert_eq!(
            encode_command(b"lbrt", &8000i32.to_be_bytes()).unwrap(),
            zeros_then(b"lbrt", &[0, 0, 0x1f, 0x40])
        );
        assert_eq!(
            encode_command(b"lidl", &10000i32.to_be_bytes()).unwrap(),
            zeros_then(b"lidl", &[0, 0, 0x27, 0x10])
        );
        assert_eq!(encode_command(b"srdy", b"").unwrap().len(), 32);
        assert!(encode_command(b"toolong", b"").is_err());
    }

    #[test]
    fn classify_commands_and_forwards() {
        let keep = zeros_then(b"keep", b"");
        assert_eq!(
            classify(&keep).unwrap(),
            Message::Command {
                tag: b"keep",
                payload: b""
            }
        );
        let mut fwd = vec![1u8; 32];
        fwd.extend_from_slice(b"hi");
        assert_eq!(
            classify(&fwd).unwrap(),
            Message::Forward {
                peer: &[1u8; 32],
                payload: b"hi"
            }
        );
        assert!(classify(&[0u8; 31]).is_err());
    }

    #[test]
    fn header_alone_says_command_or_forward() {
        let mut header = [0u8; 32];
        header[28..].copy_from_slice(b"ares");
        assert_eq!(parse_header(&header), Header::Command(*b"ares"));
        header[27] = 1; // one non-zero byte in the prefix makes it a key
        assert_eq!(parse_header(&header), Header::Forward(header));
    }

    #[test]
    fn forward_rewrite_and_frame() {
        let mut msg = vec![2u8; 32];
        msg.extend_from_slice(&[9u8; 200]);
        let sender = [3u8; 32];
        let rewritten = rewrite_forward(&msg, &sender).unwrap();
        assert_eq!(&rewritten[..32], &sender);
        assert_eq!(&rewritten[32..], &msg[32..]);
        let frame = forward_frame(&msg, &sender).unwrap();
        assert_eq!(&frame[..4], &[0x82, 126, 0, 232]);
        assert_eq!(&frame[4..], &rewritten[..]);
        let small = forward_frame(&[5u8; 32], &sender).unwrap();
        assert_eq!(&small[..2], &[0x82, 32]);
    }

    #[test]
    fn pubkey_path_is_strict() {
        let key = [7u8; 32];
        let text = URL_SAFE_NO_PAD.encode(key);
        assert_eq!(decode_pubkey_path(&text).unwrap(), key);
        assert!(decode_pubkey_path(&format!("{text}=")).is_err(), "padding");
        assert!(decode_pubkey_path("bad-pubkey-path").is_err());
        let mut non_canonical = text.clone();
        non_canonical.pop();
        non_canonical.push('9'); // low bits set in the last char
        assert!(decode_pubkey_path(&non_canonical).is_err());
        let commandish = URL_SAFE_NO_PAD.encode([0u8; 32]);
        assert!(decode_pubkey_path(&commandish).is_err());
    }
}

pub mod py {
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    use super::Message;

    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct SbdMessage {
        #[pyo3(get)]
        kind: i64,
        #[pyo3(get)]
        tag: Py<PyBytes>,
        #[pyo3(get)]
        peer: Py<PyBytes>,
        #[pyo3(get)]
        payload: Py<PyBytes>,
    }

    #[pymethods]
    impl SbdMessage {
        fn __repr__(&self, py: Python<'_>) -> String {
            let kind = if self.kind == 0 { "command" } else { "forward" };
            format!(
                "<SbdMessage {kind} tag={:?} payload={} bytes>",
                String::from_utf8_lossy(self.tag.as_bytes(py)),
                self.payload.as_bytes(py).len()
            )
        }
    }

    #[pyfunction]
    fn sbd_classify(py: Python<'_>, message: &[u8]) -> PyResult<SbdMessage> {
        let empty = PyBytes::new(py, b"").unbind();
        Ok(match super::classify(message)? {
            Message::Command { tag, payload } => SbdMessage {
                kind: 0,
                tag: PyBytes::new(py, tag).unbind(),
                peer: empty,
                payload: PyBytes::new(py, payload).unbind(),
            },
            Message::Forward { peer, payload } => SbdMessage {
                kind: 1,
                tag: empty,
                peer: PyBytes::new(py, peer).unbind(),
                payload: PyBytes::new(py, payload).unbind(),
            },
        })
    }

    #[pyfunction]
    #[pyo3(signature = (tag, payload = b"".as_slice()), text_signature = "(tag, payload=b'')")]
    fn sbd_encode_command<'py>(
        py: Python<'py>,
        tag: &[u8],
        payload: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &super::encode_command(tag, payload)?))
    }

    #[pyfunction]
    fn sbd_rewrite_forward<'py>(
        py: Python<'py>,
        message: &[u8],
        sender: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &super::rewrite_forward(message, sender)?))
    }

    #[pyfunction]
    fn sbd_forward_frame<'py>(
        py: Python<'py>,
        message: &[u8],
        sender: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &super::forward_frame(message, sender)?))
    }

    #[pyfunction]
    fn sbd_decode_pubkey_path<'py>(
        py: Python<'py>,
        segment: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &super::decode_pubkey_path(segment)?))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("SBD_HEADER_LEN", super::HEADER_LEN)?;
        m.add("SBD_MAX_MESSAGE", super::MAX_MESSAGE)?;
        m.add("SBD_COMMAND", 0)?;
        m.add("SBD_FORWARD", 1)?;
        m.add_class::<SbdMessage>()?;
        m.add_function(wrap_pyfunction!(sbd_classify, m)?)?;
        m.add_function(wrap_pyfunction!(sbd_encode_command, m)?)?;
        m.add_function(wrap_pyfunction!(sbd_rewrite_forward, m)?)?;
        m.add_function(wrap_pyfunction!(sbd_forward_frame, m)?)?;
        m.add_function(wrap_pyfunction!(sbd_decode_pubkey_path, m)?)?;
        Ok(())
    }
}
