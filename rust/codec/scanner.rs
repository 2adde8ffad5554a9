//! The one interface between the websocket decoder and a dialect: a *scanner* reads each data
//! message while the decoder still holds its bytes, so one call into Rust per read covers
//! decoding, routing-field reads and route lookups of every message, and the fast path can
//! forward a message without Python ever seeing it.
//!
//! The decoder (`ws::py::WsDecoder`) knows no dialect. It holds a [`py::Scanner`], the base
//! class every dialect's scanner extends, and once per `feed` asks it to [`py::Scanner::start`]:
//! the dialect borrows what its scan needs (its tables, limiter, outboxes) for the length of
//! that call and returns a [`ScanFeed`]. The decoder then hands it every data message of the
//! read, in order.
//!
//! One rule is kept here, for every dialect: once a message of a read goes to Python, every
//! later message of that read does too (`fast` is false for them). Python handles them after
//! it, in order, and may close the connection over it, after which what follows must not have
//! been forwarded.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::codec::mask::Payload;

/// A message's data as Python gets it, what the scanner made of it (its routing object, if
/// any), and why it has none.
pub type Scanned = (Py<PyBytes>, Option<Py<PyAny>>, Option<String>);

/// A dialect's scanner with its state borrowed for the length of one `feed`.
pub trait ScanFeed {
    /// Scan one data message. With `fast`, the scanner may take it (forward it into its
    /// destination's outbox): None, nothing for Python. Otherwise the message is copied out of
    /// the frame (exactly once) with its routing. `now` is the caller's clock in nanoseconds,
    /// for limiters and route records.
    fn message(
        &mut self,
        py: Python<'_>,
        is_text: bool,
        payload: Payload<'_>,
        now: u64,
        fast: bool,
    ) -> PyResult<Option<Scanned>>;

    /// An event the scanner made itself from messages it took (e.g. several small frames
    /// gathered into one for Python), to be handed up before the next event; None: none.
    fn take_made(&mut self, _py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        Ok(None)
    }
}

pub mod py {
    use super::ScanFeed;
    use pyo3::prelude::*;

    /// How a dialect's scanner starts one `feed`: `scanner` is the Python object (an instance
    /// of the dialect's subclass); the feed borrows from it for as long as `scanner` is borrowed.
    pub type Start = for<'a, 'py> fn(&'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>>;

    /// The base class of every scanner (`rmb_relay._core.Scanner`). A dialect's scanner is a
    /// subclass whose constructor passes its `Start`; the decoder calls it once per `feed`.
    #[pyclass(subclass, frozen, module = "rmb_relay._core")]
    pub struct Scanner {
        start: Start,
    }

    impl Scanner {
        pub fn new(start: Start) -> Self {
            Scanner { start }
        }

        /// Borrow what scanning needs for one `feed` of `scanner` (this class or a subclass).
        pub fn start<'a, 'py>(
            scanner: &'a Bound<'py, Scanner>,
        ) -> PyResult<Box<dyn ScanFeed + 'a>> {
            (scanner.get().start)(scanner.as_any())
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<Scanner>()
    }
}
