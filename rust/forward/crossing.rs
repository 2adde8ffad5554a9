//! Crossing: bus records for other instances of this relay, built by the fast path.
//!
//! A message whose destination another instance holds (a remote route, `routes.rs`) used to
//! reach Python as an event and cost ~30 Python calls there before its record was queued for
//! that instance's bus stream. The scanner now appends the record itself, in the byte layout
//! of `cluster/wire.py` (so the far instance reads it as any other), into one buffer per
//! target instance; after the read Python takes the buffers (`Outboxes.drain`) and queues
//! each as one piece of that instance's next XADD. The buffer's bytes are kept by Python
//! until Redis answered, so a refused or gone stream re-handles each record on the slow path.
//!
//! The receiving instance reads an entry's records back in the same layout: `place` writes
//! each message for a session connected here (an address name the route table resolves,
//! `Routes::lookup_name`) straight into that connection's outbox (in order, and stopping at
//! the first record it cannot place: a congested or held receiver, an address not held here,
//! a notice, another kind of name), and Python handles that one record as before, then hands
//! the rest back (per-receiver order is the entry's order either way).
//!
//! Record layout (big-endian): kind (1), hops (1), deadline (8, unix seconds, 0 = never store),
//! name length (2), frame length (4), name, frame.

use crate::forward::Count;

/// `cluster/wire.py`'s `HEADER_BYTES`.
pub const RECORD_HEADER: usize = 16;
/// `cluster/wire.py`'s `MESSAGE` kind.
pub const MESSAGE: u8 = 0;
/// `cluster/wire.py`'s last kind (`MAIL`): kinds are 0..=LAST_KIND
const LAST_KIND: u8 = 2;

/// One record read from an entry, borrowing its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub kind: u8,
    pub name: &'a [u8],
    pub frame: &'a [u8],
    /// where the next record starts
    pub next: usize,
}

/// The record at `offset` of an entry, or why the entry is malformed (as `wire.decode` says).
pub fn read_record(data: &[u8], offset: usize) -> Result<Record<'_>, String> {
    let rest = &data[offset.min(data.len())..];
    if rest.len() < RECORD_HEADER {
        return Err(format!("truncated record header at byte {offset}"));
    }
    let kind = rest[0];
    if kind > LAST_KIND {
        return Err(format!("unknown record kind {kind} at byte {offset}"));
    }
    let name_len = usize::from(u16::from_be_bytes([rest[10], rest[11]]));
    let frame_len = u32::from_be_bytes([rest[12], rest[13], rest[14], rest[15]]) as usize;
    let body = &rest[RECORD_HEADER..];
    if body.len() < name_len + frame_len {
        return Err(format!("record at byte {offset} runs past the entry"));
    }
    Ok(Record {
        kind,
        name: &body[..name_len],
        frame: &body[name_len..name_len + frame_len],
        next: offset + RECORD_HEADER + name_len + frame_len,
    })
}

/// How many records an entry holds, or why it is malformed (truncated, an unknown kind, a
/// name that is not UTF-8): the checks of `wire.decode`, which a malformed entry fails whole.
pub fn check(data: &[u8]) -> Result<usize, String> {
    let (mut offset, mut count) = (0, 0);
    while offset < data.len() {
        let record = read_record(data, offset)?;
        if std::str::from_utf8(record.name).is_err() {
            return Err("address name is not UTF-8".into());
        }
        offset = record.next;
        count += 1;
    }
    Ok(count)
}

/// What `place` did: where it stopped, and what it wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// the offset of the first record not placed (the entry's length: all were)
    pub next: usize,
    pub records: u64,
    pub bytes: u64,
}

/// Append one `MESSAGE` record (no hops yet) to `out`. The name is at most 65535 bytes
/// (`Routes::set_remote` checks it) and a frame at most the websocket message limit.
pub fn encode_message(out: &mut Vec<u8>, name: &[u8], deadline: u64, frame: &[u8]) {
    debug_assert!(name.len() <= usize::from(u16::MAX));
    out.reserve(RECORD_HEADER + name.len() + frame.len());
    out.push(MESSAGE);
    out.push(0);
    out.extend_from_slice(&deadline.to_be_bytes());
    out.extend_from_slice(&(name.len() as u16).to_be_bytes());
    out.extend_from_slice(&(frame.len() as u32).to_be_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(frame);
}

/// The records waiting for one instance, and how many.
#[derive(Debug, Default)]
struct Batch {
    buf: Vec<u8>,
    records: u32,
}

/// The crossing buffers of one switch; see the module docs.
#[derive(Debug, Default)]
pub struct Crossing {
    /// indexed by instance number; empty ones hold no allocation
    batches: Vec<Batch>,
    /// instances with records, in the order they got their first
    dirty: Vec<u32>,
    /// Python lets the fast path cross only while the bus has room and the cluster runs
    pub open: bool,
    /// how long a record may wait in its receiver's store at most (`Mailbox.ttl`): the bound
    /// of the deadline each record carries
    pub store_ttl: u64,
    /// messages the fast path queued for other instances
    pub crossed: Count,
    /// messages from other instances `place` wrote to connections here
    pub placed: Count,
}

impl Crossing {
    /// Append a `MESSAGE` record for `instance`.
    pub fn push(&mut self, instance: u32, name: &[u8], deadline: u64, frame: &[u8]) {
        let at = instance as usize;
        if self.batches.len() <= at {
            self.batches.resize_with(at + 1, Batch::default);
        }
        let batch = &mut self.batches[at];
        if batch.records == 0 {
            self.dirty.push(instance);
        }
        encode_message(&mut batch.buf, name, deadline, frame);
        batch.records += 1;
    }

    /// Whether records wait to be taken.
    pub fn pending(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Every waiting batch, as (instance, records, how many), in the order they started.
    pub fn take(&mut self) -> Vec<(u32, Vec<u8>, u32)> {
        let mut out = Vec::with_capacity(self.dirty.len());
        for instance in self.dirty.drain(..) {
            let batch = &mut self.batches[instance as usize];
            out.push((instance, std::mem::take(&mut batch.buf), batch.records));
            batch.records = 0;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cluster/wire.py`'s `encode_message("r:9:svc", b"frame", 1700000300)`.
    const GOLDEN: &[u8] =
        b"\x00\x00\x00\x00\x00\x00\x65\x53\xf2\x2c\x00\x07\x00\x00\x00\x05r:9:svcframe";

    #[test]
    fn records_have_the_wire_layout() {
        let mut out = Vec::new();
        encode_message(&mut out, b"r:9:svc", 1_700_000_300, b"frame");
        assert_eq!(out, GOLDEN);
    }

    #[test]
    fn batches_per_instance_in_first_use_order() {
        let mut c = Crossing::default();
        assert!(!c.pending());
        c.push(3, b"r:1", 0, b"a");
        c.push(0, b"r:2", 5, b"bb");
        c.push(3, b"r:1", 0, b"c");
        assert!(c.pending());
        let taken = c.take();
        assert_eq!(
            taken.iter().map(|(i, _, n)| (*i, *n)).collect::<Vec<_>>(),
            [(3, 2), (0, 1)]
        );
        let mut want = Vec::new();
        encode_message(&mut want, b"r:1", 0, b"a");
        encode_message(&mut want, b"r:1", 0, b"c");
        assert_eq!(taken[0].1, want);
        assert!(!c.pending() && c.take().is_empty());
        c.push(0, b"r:2", 0, b"d");
        assert_eq!(c.take()[0].2, 1, "counted again from zero");
    }

    #[test]
    fn entries_are_checked_as_the_python_decoder_checks_them() {
        let mut entry = Vec::new();
        encode_message(&mut entry, b"r:1", 0, b"a");
        encode_message(&mut entry, b"r:2:x", 9, b"");
        assert_eq!(check(&entry), Ok(2));
        assert_eq!(check(b""), Ok(0));
        assert!(check(&entry[..entry.len() - 1])
            .unwrap_err()
            .contains("runs past"));
        assert!(check(&entry[..5]).unwrap_err().contains("truncated"));
        let mut bad = entry.clone();
        bad[0] = 3;
        assert!(check(&bad).unwrap_err().contains("unknown record kind 3"));
        let mut bad = Vec::new();
        encode_message(&mut bad, b"r:\xff", 0, b"");
        assert!(check(&bad).unwrap_err().contains("UTF-8"));
        let r = read_record(&entry, 0).unwrap();
        assert_eq!((r.kind, r.name, r.frame), (MESSAGE, &b"r:1"[..], &b"a"[..]));
        assert_eq!(read_record(&entry, r.next).unwrap().name, b"r:2:x");
    }

}

pub mod py {
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    /// How many records a bus entry holds; ValueError saying what is wrong when it is
    /// malformed (the checks of `cluster/wire.py`'s `decode`, without building the records).
    #[pyfunction]
    fn check_bus_records(data: &[u8]) -> PyResult<usize> {
        super::check(data).map_err(PyValueError::new_err)
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(check_bus_records, m)?)
    }
}
