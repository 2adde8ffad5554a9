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
//! Record layout (big-endian): kind (1), hops (1), deadline (8, unix seconds, 0 = never store),
//! name length (2), frame length (4), name, frame.

use crate::forward::Count;

/// `cluster/wire.py`'s `HEADER_BYTES`.
pub const RECORD_HEADER: usize = 16;
/// `cluster/wire.py`'s `MESSAGE` kind.
pub const MESSAGE: u8 = 0;

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

/// Until when an RMB envelope may wait in a mailbox (unix seconds; 0: never, fail-fast), as
/// `RmbDialect.store_deadline` and `Mailbox.deadline` say: its own expiry (from its timestamp,
/// or from now without one), at most the mailbox's TTL from now.
pub fn store_deadline(
    fail_fast: bool,
    timestamp: u64,
    expiration: u64,
    now_secs: u64,
    mailbox_ttl: u64,
) -> u64 {
    if fail_fast {
        return 0;
    }
    let own = if timestamp != 0 {
        timestamp.saturating_add(expiration)
    } else {
        now_secs.saturating_add(expiration)
    };
    own.min(now_secs.saturating_add(mailbox_ttl))
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
    /// `Mailbox.ttl`, for the deadline each record carries
    pub mailbox_ttl: u64,
    /// RMB envelopes the fast path queued for other instances
    pub rmb: Count,
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
    fn deadline_follows_the_mailbox_rule() {
        let now = 1_000;
        assert_eq!(store_deadline(true, 900, 300, now, 3600), 0, "fail-fast");
        assert_eq!(store_deadline(false, 900, 300, now, 3600), 1_200);
        assert_eq!(
            store_deadline(false, 0, 300, now, 3600),
            1_300,
            "no timestamp"
        );
        assert_eq!(
            store_deadline(false, 900, 10_000, now, 3600),
            4_600,
            "capped"
        );
        assert_eq!(store_deadline(false, u64::MAX, 1, now, 3600), 4_600);
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
}
