//! The one internal error type of the core, converted once at the boundary into the
//! Python exception hierarchy below (re-exported and drawn in `rmb_relay.errors`).
//!
//! ```text
//! CoreError                       anything the core rejects
//!  ├─ HttpParseError              malformed or over-limit HTTP head/body; args = (message, status)
//!  ├─ HttpResponseError           a response (of a server we are the client of) that is not HTTP/1.1
//!  ├─ WebSocketProtocolError      a frame the peer had no right to send; args = (message, close_code)
//!  ├─ EnvelopeError               RMB envelope bytes that are not a valid protobuf Envelope
//!  ├─ SbdError                    an SBD message that breaks the SBD framing rules
//!  ├─ SignatureError              a key or signature of the wrong shape (a wrong signature is `False`, not an error)
//!  └─ TunnelWireError             a malformed tunnel connector message (wire.py raises it as WireError)
//! ```

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _core,
    CoreError,
    PyException,
    "Base of every error raised by the Rust core."
);
create_exception!(
    _core,
    HttpParseError,
    CoreError,
    "Malformed or over-limit HTTP request; args are (message, status)."
);
create_exception!(
    _core,
    HttpResponseError,
    CoreError,
    "A response from a server we are the client of (a tunnel target) that breaks HTTP/1.1; args = (message,)."
);
create_exception!(
    _core,
    WebSocketProtocolError,
    CoreError,
    "WebSocket protocol violation; args are (message, close_code)."
);
create_exception!(
    _core,
    EnvelopeError,
    CoreError,
    "Bytes that are not a valid RMB protobuf Envelope."
);
create_exception!(
    _core,
    SbdError,
    CoreError,
    "An SBD message that breaks the SBD framing rules."
);
create_exception!(
    _core,
    SignatureError,
    CoreError,
    "A key or signature of the wrong shape or an unknown scheme."
);

create_exception!(
    _core,
    TunnelWireError,
    CoreError,
    "A malformed tunnel connector message, or a value no message can carry; the text says what is wrong (wire.py raises it as WireError)."
);

/// Every failure the core can report. Pure-Rust code returns this; the `py` wrappers
/// convert it with `?` into the matching Python exception.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("{reason}")]
    Http { status: u16, reason: String },
    #[error("{0}")]
    HttpResponse(String),
    #[error("{reason}")]
    WebSocket { code: u16, reason: String },
    #[error("{0}")]
    Envelope(String),
    #[error("{0}")]
    Sbd(String),
    #[error("{0}")]
    Signature(String),
    #[error("{0}")]
    TunnelWire(String),
    #[error("{0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            Error::Http { status, reason } => HttpParseError::new_err((reason, status)),
            Error::HttpResponse(msg) => HttpResponseError::new_err(msg),
            Error::WebSocket { code, reason } => WebSocketProtocolError::new_err((reason, code)),
            Error::Envelope(msg) => EnvelopeError::new_err(msg),
            Error::Sbd(msg) => SbdError::new_err(msg),
            Error::Signature(msg) => SignatureError::new_err(msg),
            Error::TunnelWire(msg) => TunnelWireError::new_err(msg),
            Error::InvalidArgument(msg) => pyo3::exceptions::PyValueError::new_err(msg),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CoreError", py.get_type::<CoreError>())?;
    m.add("HttpParseError", py.get_type::<HttpParseError>())?;
    m.add("HttpResponseError", py.get_type::<HttpResponseError>())?;
    m.add(
        "WebSocketProtocolError",
        py.get_type::<WebSocketProtocolError>(),
    )?;
    m.add("EnvelopeError", py.get_type::<EnvelopeError>())?;
    m.add("SbdError", py.get_type::<SbdError>())?;
    m.add("SignatureError", py.get_type::<SignatureError>())?;
    m.add("TunnelWireError", py.get_type::<TunnelWireError>())?;
    Ok(())
}
