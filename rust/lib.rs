//! `rmb_relay._core`: the sans-I/O hot path of rmb-relay.
//!
//! The layers, bottom up (a module imports only from its own layer and the ones below, and no
//! two modules import each other, even through others: `tests/test_layers.py` checks both):
//! - `error`, `limiter`, `crypto`, `records`, `lent` (buffers lent to Python without a copy):
//!   shared pieces that know no dialect;
//! - `codec/`: HTTP/1.1, websocket frames and their masking, JSON, and the scanner interface
//!   through which a dialect reads the websocket decoder's messages (`codec/scanner.rs`);
//! - `forward/`: every connection's pending output, the route table, what crosses to other
//!   instances;
//! - `dialects/`: each dialect's wire format and scanner (the fast path's decisions), and the
//!   tunnel's and the 신경 gateway's cores.
//!
//! Each concern's pure-Rust core and unit tests live in its file, its Python-facing wrapper in
//! a `py` submodule at the bottom of that file, registered here. Nothing in this crate touches
//! a socket, a clock or a thread: time is always an argument.

use pyo3::prelude::*;

pub mod codec;
pub mod crypto;
pub mod dialects;
pub mod error;
pub mod forward;
/// fuzz targets of the network parsers (pure Rust; `fuzz/`, `make fuzz`)
pub mod fuzzing;
pub mod lent;
pub mod limiter;
/// the load harness's per-message work (rmb-load's stamps, batches, latency recorder)
pub mod load;
pub mod records;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    codec::http::py::register(m)?;
    codec::ws::py::register(m)?;
    codec::scanner::py::register(m)?;
    dialects::sbd::header::py::register(m)?;
    dialects::sbd::scanner::py::register(m)?;
    dialects::rmb::envelope::py::register(m)?;
    dialects::rmb::scanner::py::register(m)?;
    limiter::py::register(m)?;
    forward::outboxes::py::register(m)?;
    forward::crossing::py::register(m)?;
    forward::routes::py::register(m)?;
    dialects::singyeong::py::register(m)?;
    crypto::py::register(m)?;
    records::py::register(m)?;
    load::py::register(m)?;
    dialects::tunnel::wire::py::register(m)?;
    dialects::tunnel::connector::py::register(m)?;
    dialects::tunnel::hub::py::register(m)?;
    Ok(())
}
