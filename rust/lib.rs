//! `rmb_relay._core`: the sans-I/O hot path of rmb-relay.
//!
//! Every concern lives in its own file with its pure-Rust core and unit tests; the
//! Python-facing wrappers sit in a `py` submodule at the bottom of that file and are
//! registered here. Nothing in this crate touches a socket, a clock or a thread:
//! time is always an argument.

use pyo3::prelude::*;

/// wire formats shared by several dialects (JSON)
pub mod codec;
pub mod crossing;
pub mod crypto;
pub mod envelope;
pub mod error;
pub mod forward;
/// fuzz targets of the network parsers (pure Rust; `fuzz/`, `make fuzz`)
pub mod fuzzing;
pub mod http;
pub mod http_client;
pub mod http_response;
/// buffers lent to Python without a copy, and their pool
pub mod lent;
pub mod limiter;
pub mod maps;
pub mod records;
pub mod routes;
pub mod sbd;
pub mod scan;
pub mod singyeong;
/// the connector's native per-request path (RequestTarget -> target request, answer -> Deliver)
pub mod tunnel_connector;
/// the relay's express answer: a connector's Deliver as the client's HTTP/1.1 bytes
pub mod tunnel_express;
/// the relay's native express table: the common tunnelled request with no Python object
pub mod tunnel_native;
/// the HTTP tunnel's connector messages, JSON and msgpack (wire.py's twin)
pub mod tunnel_wire;
pub mod ws;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    http::py::register(m)?;
    http_client::py::register(m)?;
    http_response::py::register(m)?;
    ws::py::register(m)?;
    sbd::py::register(m)?;
    envelope::py::register(m)?;
    limiter::py::register(m)?;
    scan::py::register(m)?;
    forward::py::register(m)?;
    crossing::py::register(m)?;
    routes::py::register(m)?;
    singyeong::py::register(m)?;
    crypto::py::register(m)?;
    records::py::register(m)?;
    tunnel_wire::py::register(m)?;
    tunnel_connector::py::register(m)?;
    tunnel_express::py::register(m)?;
    tunnel_native::py::register(m)?;
    Ok(())
}
