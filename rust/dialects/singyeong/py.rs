//! The gateway core for Python: `SgQuery` (a parsed query), `SgIndex` (the clients, the
//! matcher, the routing decision) and `SgScanner` (the fast path of one JSON connection).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use pyo3::create_exception;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::index::{rendezvous_weight, Client};
use super::query::{self, Bound as Limit, Limits, Metadata, Query, QueryError};
use super::value::Value;
use super::{dispatch_text, read, Decision, Frame, Gateway, QueueFrame};
use crate::codec::mask::Payload;
use crate::codec::scanner::py::Scanner;
use crate::codec::scanner::{ScanFeed, Scanned};
use crate::codec::ws::py::{message_event, payload_bytes};
use crate::error::CoreError;
use crate::forward::outboxes::py::{open_outboxes, Outboxes};

create_exception!(
    _core,
    SgQueryError,
    CoreError,
    "A 신경 query the gateway cannot run; args = (message, limit): limit names the bound a well-formed query broke (\"depth\", \"ops\", \"list\") or is None."
);

fn query_error(err: QueryError) -> PyErr {
    SgQueryError::new_err((err.message, err.bound.map(Limit::name)))
}

fn text_bytes(s: &Bound<'_, PyString>) -> PyResult<Box<[u8]>> {
    match s.to_str() {
        Ok(t) => Ok(t.as_bytes().into()),
        // a lone surrogate (JSON's "\ud800"): its WTF-8 bytes, as the fast path reads them
        Err(_) => {
            let b = s.call_method1("encode", ("utf-8", "surrogatepass"))?;
            Ok(b.downcast::<PyBytes>()?.as_bytes().into())
        }
    }
}

/// A decoded frame's value (what the JSON, msgpack and ETF decoders give) as the matcher's.
pub fn value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(if obj.is_none() {
        Value::Null
    } else if let Ok(s) = obj.downcast::<PyString>() {
        Value::Str(text_bytes(s)?)
    } else if let Ok(b) = obj.downcast::<PyBool>() {
        Value::Bool(b.is_true())
    } else if obj.is_instance_of::<PyInt>() {
        match obj.extract::<i64>() {
            Ok(v) => Value::Int(v),
            Err(_) => Value::int_text(&obj.str()?.to_string()),
        }
    } else if let Ok(f) = obj.downcast::<PyFloat>() {
        Value::Float(f.value())
    } else if let Ok(d) = obj.downcast::<PyDict>() {
        let mut out = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            out.push((value(&k)?, value(&v)?));
        }
        Value::Map(out)
    } else if let Ok(l) = obj.downcast::<PyList>() {
        Value::List(l.iter().map(|i| value(&i)).collect::<PyResult<_>>()?)
    } else if let Ok(t) = obj.downcast::<PyTuple>() {
        Value::List(t.iter().map(|i| value(&i)).collect::<PyResult<_>>()?)
    } else if let Ok(b) = obj.downcast::<PyBytes>() {
        Value::Bytes(b.as_bytes().into())
    } else {
        let kind = obj.get_type().name()?;
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "no metadata or query value is a {kind}"
        )));
    })
}

/// `(values, types)` of Python's metadata dicts as entries (`version`: the type is version).
/// (key, value, the type is `version` when a type comes with it)
type Entries = Vec<(Box<[u8]>, Value, Option<bool>)>;

fn entries(values: &Bound<'_, PyDict>, types: &Bound<'_, PyDict>) -> PyResult<Entries> {
    let mut out = Vec::with_capacity(values.len());
    for (k, v) in values.iter() {
        let kind = types.get_item(&k)?;
        let version = kind.map(|t| {
            t.downcast::<PyString>()
                .is_ok_and(|t| t.to_str().is_ok_and(|t| t == "version"))
        });
        out.push((text_bytes(k.downcast::<PyString>()?)?, value(&v)?, version));
    }
    Ok(out)
}

fn metadata(values: &Bound<'_, PyDict>, types: &Bound<'_, PyDict>) -> PyResult<Metadata> {
    Ok(entries(values, types)?
        .into_iter()
        .map(|(k, v, ver)| (k, (v, ver.unwrap_or(false))))
        .collect())
}

fn text_of<'py>(py: Python<'py>, b: &[u8]) -> PyResult<Bound<'py, PyString>> {
    match std::str::from_utf8(b) {
        Ok(t) => Ok(PyString::new(py, t)),
        Err(_) => Ok(PyBytes::new(py, b)
            .call_method1("decode", ("utf-8", "surrogatepass"))?
            .downcast_into::<PyString>()?),
    }
}

/// A parsed query (`query.parse`); `raw` is the object as sent (echoed in op 3 `no_route`).
#[pyclass(frozen, module = "rmb_relay._core")]
pub struct SgQuery {
    pub(crate) inner: Arc<Query>,
    #[pyo3(get)]
    raw: Py<PyAny>,
}

#[pymethods]
impl SgQuery {
    /// Parse `raw` within the bounds; raises SgQueryError with the reason.
    #[new]
    #[pyo3(signature = (raw, max_depth = 32, max_ops = 1024, max_list = 1024))]
    fn new(
        raw: Bound<'_, PyAny>,
        max_depth: usize,
        max_ops: usize,
        max_list: usize,
    ) -> PyResult<Self> {
        let parsed = query::parse(
            &value(&raw)?,
            Limits {
                max_depth,
                max_ops,
                max_list,
            },
        )
        .map_err(query_error)?;
        Ok(SgQuery {
            inner: Arc::new(parsed),
            raw: raw.unbind(),
        })
    }

    #[getter]
    fn key<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyString>>> {
        self.inner
            .key
            .as_deref()
            .map(|a| text_of(py, a))
            .transpose()
    }

    #[getter]
    fn restricted(&self) -> bool {
        self.inner.restricted
    }

    #[getter]
    fn droppable(&self) -> bool {
        self.inner.droppable
    }

    #[getter]
    fn optional(&self) -> bool {
        self.inner.optional
    }

    /// One top-level `$eq` and nothing else: the hash index alone answers it.
    #[getter]
    fn exact(&self) -> bool {
        self.inner.exact
    }

    /// Whether `client` (a clients.Client: app_id, restricted, metadata, types) matches;
    /// an indexed client is cheaper through `SgIndex.matches`.
    fn matches(&self, client: &Bound<'_, PyAny>) -> PyResult<bool> {
        let app = text_bytes(client.getattr("app_id")?.downcast::<PyString>()?)?;
        let restricted = client.getattr("restricted")?.is_truthy()?;
        let meta = metadata(
            client.getattr("metadata")?.downcast()?,
            client.getattr("types")?.downcast()?,
        )?;
        Ok(self.inner.matches(&app, restricted, &meta))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("SgQuery({})", self.raw.bind(py).repr()?))
    }
}

/// The gateway's clients (this instance's and other instances' replicas) by handle, the
/// matcher and the routing decision (rust/dialects/singyeong/index.rs).
#[pyclass(module = "rmb_relay._core")]
pub struct SgIndex {
    pub(crate) inner: Gateway,
}

#[pymethods]
impl SgIndex {
    /// `seed` fixes the SEND receiver picks (the caller's rng: the core has no entropy of
    /// its own); the bounds are those of queries the fast path parses.
    #[new]
    #[pyo3(signature = (seed, max_depth = 32, max_ops = 1024, max_list = 1024))]
    fn new(seed: u64, max_depth: usize, max_ops: usize, max_list: usize) -> Self {
        SgIndex {
            inner: Gateway::new(
                seed,
                Limits {
                    max_depth,
                    max_ops,
                    max_list,
                },
            ),
        }
    }

    /// The client `handle` (replacing what it had): `conn` its connection here (None: another
    /// instance's), `json` whether that connection speaks JSON.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        handle: u64,
        app: &Bound<'_, PyString>,
        client_id: &Bound<'_, PyString>,
        restricted: bool,
        conn: Option<u64>,
        json: bool,
        values: &Bound<'_, PyDict>,
        types: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let client = Client {
            app: text_bytes(app)?,
            id: text_bytes(client_id)?,
            restricted,
            conn,
            json,
            meta: metadata(values, types)?,
            app_no: 0,
        };
        self.inner.index.add(handle, client);
        Ok(())
    }

    fn remove(&mut self, handle: u64) {
        self.inner.index.remove(handle);
    }

    /// Metadata values written (a shallow merge, later wins); `types` those that come with one.
    fn set_values(
        &mut self,
        handle: u64,
        values: &Bound<'_, PyDict>,
        types: &Bound<'_, PyDict>,
    ) -> PyResult<()> {
        let entries = entries(values, types)?;
        self.inner.index.set_values(handle, entries);
        Ok(())
    }

    /// Handles of every client `query` matches.
    fn matching(&self, query: &SgQuery) -> Vec<u64> {
        self.inner.index.matching(&query.inner)
    }

    /// The receivers of a SEND (one) or BROADCAST (all): match, `optional`, selector, key.
    fn resolve(&mut self, query: &SgQuery, broadcast: bool) -> Vec<u64> {
        self.inner.index.resolve(&query.inner, broadcast)
    }

    fn matches(&self, query: &SgQuery, handle: u64) -> bool {
        self.inner.index.matches(&query.inner, handle)
    }

    /// How many clients matching `query` reads (the index's narrowing, for tests).
    fn candidate_count(&self, query: &SgQuery) -> usize {
        self.inner.index.candidate_count(&query.inner)
    }

    /// The rendezvous weight of `key` for `handle` (None: no such client).
    fn rendezvous_weight(&self, key: &Bound<'_, PyString>, handle: u64) -> PyResult<Option<u64>> {
        let key = text_bytes(key)?;
        Ok(self
            .inner
            .index
            .clients
            .get(&handle)
            .map(|c| rendezvous_weight(&key, c)))
    }

    fn __len__(&self) -> usize {
        self.inner.index.clients.len()
    }

    /// (sends, broadcasts) the fast path answered (their DISPATCH frames: the outboxes' count).
    #[getter]
    fn counts(&self) -> (u64, u64) {
        (self.inner.sends, self.inner.broadcasts)
    }

    fn __repr__(&self) -> String {
        format!("SgIndex(clients={})", self.inner.index.clients.len())
    }
}

/// `frames.dispatch(t, payload, ts, nonce, **extra)` as JSON from the parts' JSON texts
/// (`t` unquoted; `extra` the text of the extra members, each `,"key":value`): the one
/// layout of a DISPATCH, the fast path's too.
#[pyfunction]
fn sg_dispatch_text<'py>(
    py: Python<'py>,
    t: &str,
    nonce: &str,
    payload: &str,
    extra: &str,
    ts_ms: u64,
) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(64 + payload.len() + extra.len());
    let quoted = format!("\"{t}\"");
    dispatch_text(
        &mut out,
        quoted.as_bytes(),
        nonce.as_bytes(),
        payload.as_bytes(),
        extra.as_bytes(),
        ts_ms,
    );
    PyBytes::new(py, &out)
}

/// Scanner of one JSON-encoded 신경 connection: its SEND/BROADCAST frames are answered from
/// `index` into `outboxes` inside `feed` once the client is `ready` (identified, not
/// restricted); queue frames are read for Python; everything else goes to Python in order.
#[pyclass(extends = Scanner, frozen, module = "rmb_relay._core")]
pub struct SgScanner {
    index: Py<SgIndex>,
    outboxes: Py<Outboxes>,
    #[pyo3(get)]
    conn_id: u64,
    ready: AtomicBool,
}

#[pymethods]
impl SgScanner {
    #[new]
    fn new(index: Py<SgIndex>, outboxes: Py<Outboxes>, conn_id: u64) -> (Self, Scanner) {
        (
            SgScanner {
                index,
                outboxes,
                conn_id,
                ready: AtomicBool::new(false),
            },
            Scanner::new(start_sg),
        )
    }

    #[getter]
    fn ready(&self) -> bool {
        self.ready.load(Relaxed)
    }

    #[setter]
    fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Relaxed);
    }

    fn __repr__(&self) -> String {
        format!(
            "SgScanner(conn_id={}, ready={})",
            self.conn_id,
            self.ready()
        )
    }
}

struct SgFeed<'py> {
    index: PyRefMut<'py, SgIndex>,
    outboxes: Option<PyRefMut<'py, Outboxes>>,
    scratch: Vec<u8>,
    /// queue frames read since the last event, for Python as one message (`take_made`)
    batch: Vec<Py<PyAny>>,
}

fn start_sg<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
    let py = scanner.py();
    let s = scanner.downcast::<SgScanner>()?.get();
    let ready = s.ready.load(Relaxed);
    Ok(Box::new(SgFeed {
        index: s.index.bind(py).try_borrow_mut()?,
        outboxes: if ready {
            open_outboxes(py, Some(&s.outboxes), s.conn_id)?
        } else {
            None
        },
        scratch: Vec::new(),
        batch: Vec::new(),
    }))
}

/// A queue frame as the tuple `SgSession` acts on (`_core.pyi`, `_SgQueueFrame`).
fn queue_tuple(py: Python<'_>, q: &QueueFrame<'_>, size: usize) -> PyResult<Py<PyAny>> {
    Ok(match q {
        QueueFrame::Queue {
            name,
            nonce,
            target,
            payload,
            payload_clean,
        } => (0u8, name, *nonce, *target, *payload, size, *payload_clean)
            .into_pyobject(py)?
            .into_any()
            .unbind(),
        QueueFrame::Request { name } => (1u8, name).into_pyobject(py)?.into_any().unbind(),
        QueueFrame::Ack { name, id } => (2u8, name, id).into_pyobject(py)?.into_any().unbind(),
    })
}

impl ScanFeed for SgFeed<'_> {
    fn message(
        &mut self,
        py: Python<'_>,
        is_text: bool,
        payload: Payload<'_>,
        now: u64,
        fast: bool,
    ) -> PyResult<Option<Scanned>> {
        let Some(ob) = self.outboxes.as_mut().filter(|_| is_text && fast) else {
            return Ok(Some((payload_bytes(py, payload)?, None, None)));
        };
        let scratch = &mut self.scratch;
        scratch.clear();
        scratch.resize(payload.len(), 0);
        payload.copy_to(scratch);
        let python = || Ok(Some((PyBytes::new(py, scratch).unbind(), None, None)));
        match read(scratch) {
            // queue frames wait for Python (the batch) and go before this one: answered here,
            // it would overtake them
            Some(Frame::Route(_)) if !self.batch.is_empty() => python(),
            // `now` is the wall clock here (the dialect's scan_clock): `ts` in ms
            Some(Frame::Route(r)) => {
                match self.index.inner.deliver(&r, now / 1_000_000, &mut ob.inner) {
                    Decision::Delivered(_) => Ok(None),
                    Decision::Python => python(),
                }
            }
            Some(Frame::Queue(q)) => {
                self.batch.push(queue_tuple(py, &q, scratch.len())?);
                Ok(None)
            }
            None => python(),
        }
    }

    /// Queue frames read since the last event, as one text message with no data whose
    /// `routing` is the list of their tuples (the session acts on them in order).
    fn take_made(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if self.batch.is_empty() {
            return Ok(None);
        }
        let batch = PyList::new(py, std::mem::take(&mut self.batch))?;
        let empty = PyBytes::new(py, b"").unbind();
        message_event(py, true, empty, Some(batch.into_any().unbind()), None).map(Some)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SgQuery>()?;
    m.add_class::<SgIndex>()?;
    m.add_class::<SgScanner>()?;
    m.add("SgQueryError", m.py().get_type::<SgQueryError>())?;
    m.add_function(wrap_pyfunction!(sg_dispatch_text, m)?)?;
    m.add("SG_MAX_QUEUE_NAME", super::MAX_QUEUE_NAME)?;
    Ok(())
}
