//! Outboxes: the pending output of every websocket connection of a switch, so that the decoder
//! of one connection can forward a message into another connection's output inside `feed`.
//!
//! Theory of operation: each websocket connection whose dialect forwards in Rust has one outbox
//! here, keyed by the same `ConnId` the route table maps addresses to. Everything the
//! connection is to write goes into it in order: frames the Rust fast path forwards (header +
//! payload unmasked straight off the wire, one copy, or text frames a scanner built) and
//! whatever Python sends it (`push`, `push_text`, `push_raw`). Python takes a connection's
//! bytes and writes them (one `transport.write` per destination per read); nothing here
//! touches a socket.
//!
//! The fast path may append to an outbox only while it [`accepts`](Outboxes::accepts): the
//! connection is open, its transport is not over its high-water mark (`congested`: the message
//! goes to Python, which pauses the sender, as for any congested receiver) and its dialect does
//! not hold it (`held`: e.g. a session whose mailbox is being delivered first). A message the
//! fast path does not take goes to Python as before, so policy stays there.
//!
//! What the fast path forwarded is counted by the *kind* of the receiving connection, a name
//! Python gives when it opens the outbox (its dialect's): the dialects' metrics add these to
//! what Python counted itself.
//!
//! The fast path marks the outboxes it appended to (`dirty`, once each until the next
//! [`drain`](Outboxes::drain)); Python's own sends do not: it flushes the connections it sent
//! to itself, and a flush takes everything buffered, fast-path frames included, in order.

use crate::codec::ws::{frame_len, write_header, OP_BINARY};
use crate::forward::crossing::{read_record, Crossing, Placed, MESSAGE};
use crate::forward::maps::IdMap;
use crate::forward::routes::{ConnId, Routes};
use crate::forward::Count;

/// A buffer that grew past this for a burst is not kept for reuse after it is written.
const KEEP_CAPACITY: usize = 256 << 10;

/// Buffers taken for writing come back here once written (the Python object that lends them
/// to the transport is dropped), and an outbox that has nothing buffered takes one when it
/// is next appended to: appending goes into memory already mapped and big enough, and an idle
/// connection holds no buffer at all. At most 32 buffers (one per connection written to in a
/// read is plenty) of at most `KEEP_CAPACITY` are kept (8 MiB).
pub type Spares = crate::lent::Spares<u8, 32, KEEP_CAPACITY>;

#[derive(Debug, Default)]
struct Outbox {
    buf: Vec<u8>,
    /// index of its kind in `Outboxes::kinds`
    kind: u8,
    open: bool,
    congested: bool,
    held: bool,
    /// listed in `dirty` since the last drain
    queued: bool,
    /// messages (frames, or raw pieces) appended and bytes taken for writing since it
    /// opened: what monitoring shows
    sent: u64,
    sent_bytes: u64,
}

impl Outbox {
    /// Whether the fast path may append to it: open, not congested, not held by Python.
    #[inline]
    fn accepts(&self) -> bool {
        self.open && !self.congested && !self.held
    }
}

/// Where a frame being received was unmasked before its destination was known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// the outbox it was written into (the destination guessed), or None: the scratch buffer
    pub at: Option<ConnId>,
    frame_start: usize,
    payload_start: usize,
    end: usize,
}

/// The outboxes of one switch's connections; see the module docs.
#[derive(Debug, Default)]
pub struct Outboxes {
    boxes: IdMap<Outbox>,
    dirty: Vec<ConnId>,
    /// a message is unmasked here when no destination can be guessed
    scratch: Vec<u8>,
    /// emptied buffers to take the place of those handed out for writing
    pub spares: Spares,
    /// the kinds of connection (named by Python when it opens one) and what the fast path
    /// forwarded to each: index 0 is the unnamed kind
    kinds: Vec<(Box<str>, Count)>,
    /// records for other instances' bus streams (`crossing.rs`)
    pub crossing: Crossing,
}

/// An outbox's buffer about to be appended to: a spare one if it has none.
fn ready<'b>(buf: &'b mut Vec<u8>, spares: &Spares) -> &'b mut Vec<u8> {
    if buf.capacity() == 0 {
        *buf = spares.get(0);
    }
    buf
}

/// Append one data frame (`opcode`: binary, or text for a text protocol) of
/// `len` payload bytes to `buf`, the payload written by `fill`; the range of the payload.
fn append_frame(
    buf: &mut Vec<u8>,
    opcode: u8,
    len: usize,
    fill: impl FnOnce(&mut [u8]),
) -> (usize, usize) {
    let start = buf.len();
    buf.resize(start + frame_len(len, false), 0);
    let header = write_header(&mut buf[start..], opcode, true, len, false);
    fill(&mut buf[start + header..]);
    (start, start + header)
}

impl Outboxes {
    pub fn new() -> Self {
        Self::default()
    }

    /// The connection carries messages from now on (its dialect's handshake is done).
    pub fn open(&mut self, id: ConnId) {
        self.open_as(id, "");
    }

    /// `open`, for a connection of kind `kind` (what its forwards are counted under).
    pub fn open_as(&mut self, id: ConnId, kind: &str) {
        let index = self.kind_index(kind);
        let b = self.boxes.entry(id).or_default();
        b.open = true;
        b.kind = index;
    }

    /// The index of `kind`, added when new (at most 255 kinds; more share the last).
    fn kind_index(&mut self, kind: &str) -> u8 {
        if self.kinds.is_empty() {
            self.kinds.push(("".into(), Count::default()));
        }
        if let Some(i) = self.kinds.iter().position(|(name, _)| &**name == kind) {
            return i as u8;
        }
        if self.kinds.len() <= usize::from(u8::MAX) {
            self.kinds.push((kind.into(), Count::default()));
        }
        (self.kinds.len() - 1) as u8
    }

    /// Count one message of `len` bytes the fast path forwarded to `dest`.
    #[inline]
    pub fn count(&mut self, dest: ConnId, len: usize) {
        if let Some(b) = self.boxes.get(&dest) {
            if let Some((_, count)) = self.kinds.get_mut(usize::from(b.kind)) {
                count.add(len);
            }
        }
    }

    /// What the fast path forwarded to connections of kind `kind`.
    pub fn forwarded(&self, kind: &str) -> Count {
        self.kinds
            .iter()
            .find(|(name, _)| &**name == kind)
            .map_or_else(Count::default, |(_, count)| *count)
    }

    /// The connection is closing: nothing more is appended by the fast path, and what it
    /// receives from the fast path is no longer forwarded.
    pub fn close(&mut self, id: ConnId) {
        if let Some(b) = self.boxes.get_mut(&id) {
            b.open = false;
        }
    }

    /// The connection is gone: its outbox and whatever it held.
    pub fn remove(&mut self, id: ConnId) {
        self.boxes.remove(&id);
    }

    pub fn set_congested(&mut self, id: ConnId, congested: bool) {
        if let Some(b) = self.boxes.get_mut(&id) {
            b.congested = congested;
        }
    }

    pub fn set_held(&mut self, id: ConnId, held: bool) {
        if let Some(b) = self.boxes.get_mut(&id) {
            b.held = held;
        }
    }

    pub fn is_open(&self, id: ConnId) -> bool {
        self.boxes.get(&id).is_some_and(|b| b.open)
    }

    /// Whether the fast path may append to this connection's outbox.
    #[inline]
    pub fn accepts(&self, id: ConnId) -> bool {
        self.boxes.get(&id).is_some_and(Outbox::accepts)
    }

    pub fn len(&self) -> usize {
        self.boxes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.boxes.is_empty()
    }

    /// Bytes waiting in this connection's outbox.
    pub fn pending(&self, id: ConnId) -> usize {
        self.boxes.get(&id).map_or(0, |b| b.buf.len())
    }

    /// Messages appended to this connection's outbox and bytes taken from it since it
    /// opened (zeros: unknown).
    pub fn sent(&self, id: ConnId) -> Count {
        self.boxes.get(&id).map_or_else(Count::default, |b| Count {
            messages: b.sent,
            bytes: b.sent_bytes,
        })
    }

    fn mark(&mut self, id: ConnId) {
        if let Some(b) = self.boxes.get_mut(&id) {
            if !b.queued {
                b.queued = true;
                self.dirty.push(id);
            }
        }
    }

    /// Fast path: one data frame of `len` bytes (written by `fill`) for `id`, which must
    /// [`accept`](Self::accepts) it; false (nothing written) if it does not. `opcode`:
    /// [`OP_BINARY`] or `OP_TEXT`.
    pub fn forward(
        &mut self,
        id: ConnId,
        opcode: u8,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> bool {
        match self.boxes.get_mut(&id) {
            Some(b) if b.accepts() => {
                append_frame(ready(&mut b.buf, &self.spares), opcode, len, fill);
                b.sent += 1;
                self.mark(id);
                true
            }
            _ => false,
        }
    }

    /// Python's send: one data frame of `payload` (ignored for an unknown connection).
    pub fn push(&mut self, id: ConnId, opcode: u8, payload: &[u8]) {
        if let Some(b) = self.boxes.get_mut(&id) {
            append_frame(
                ready(&mut b.buf, &self.spares),
                opcode,
                payload.len(),
                |out| out.copy_from_slice(payload),
            );
            b.sent += 1;
        }
    }

    /// One data frame of `payload` for `id` whatever its state (a dialect's own message to a
    /// congested connection still goes, after what is queued), and `id` listed for the next
    /// drain; false for an unknown connection.
    pub fn push_frame_marked(&mut self, id: ConnId, opcode: u8, payload: &[u8]) -> bool {
        if !self.boxes.contains_key(&id) {
            return false;
        }
        self.push(id, opcode, payload);
        self.mark(id);
        true
    }

    /// Python's send of an already-encoded frame (text, control), after what is queued.
    pub fn push_raw(&mut self, id: ConnId, frame: &[u8]) {
        if let Some(b) = self.boxes.get_mut(&id) {
            ready(&mut b.buf, &self.spares).extend_from_slice(frame);
            b.sent += 1;
        }
    }

    /// Bytes for `id` written whatever its state (e.g. a whole HTTP answer a dialect built),
    /// and `id` listed for the next drain.
    pub fn push_marked(&mut self, id: ConnId, bytes: &[u8]) {
        if let Some(b) = self.boxes.get_mut(&id) {
            ready(&mut b.buf, &self.spares).extend_from_slice(bytes);
            b.sent += 1;
            self.mark(id);
        }
    }

    /// The bytes buffered for `id` (None: nothing); the outbox is left without a buffer until
    /// it is next appended to. Give the buffer back to [`spares`](Self::spares) once written.
    pub fn take(&mut self, id: ConnId) -> Option<Vec<u8>> {
        let b = self.boxes.get_mut(&id)?;
        if b.buf.is_empty() {
            return None;
        }
        b.sent_bytes += b.buf.len() as u64;
        Some(std::mem::take(&mut b.buf))
    }

    /// The connections the fast path appended to since the last drain, each once, with
    /// `f` given the bytes still buffered for it (a connection flushed meanwhile by Python is
    /// skipped).
    pub fn drain(&mut self, mut f: impl FnMut(ConnId, Vec<u8>)) {
        let dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            if let Some(b) = self.boxes.get_mut(&id) {
                b.queued = false;
            }
            if let Some(bytes) = self.take(id) {
                f(id, bytes);
            }
        }
        // keep the list's allocation
        self.dirty = dirty;
        self.dirty.clear();
    }

    /// Unmask an incoming message of `len` bytes (written by `fill`) behind a frame header,
    /// into the outbox of the destination guessed (`guess`, if it accepts) or else the scratch
    /// buffer, before its routing is read: when the guess is right, [`commit`](Self::commit)
    /// leaves it there and the payload was copied once.
    pub fn stage(
        &mut self,
        guess: Option<ConnId>,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> Staged {
        let at = guess.filter(|id| self.accepts(*id));
        let buf = match at.and_then(|id| self.boxes.get_mut(&id)) {
            Some(b) => ready(&mut b.buf, &self.spares),
            None => &mut self.scratch,
        };
        let (frame_start, payload_start) = append_frame(buf, OP_BINARY, len, fill);
        Staged {
            at,
            frame_start,
            payload_start,
            end: buf.len(),
        }
    }

    fn staged_buf(&self, s: &Staged) -> &[u8] {
        match s.at.and_then(|id| self.boxes.get(&id)) {
            Some(b) => &b.buf,
            None => &self.scratch,
        }
    }

    fn staged_buf_mut(&mut self, s: &Staged) -> &mut Vec<u8> {
        match s.at.and_then(|id| self.boxes.get_mut(&id)) {
            Some(b) => &mut b.buf,
            None => &mut self.scratch,
        }
    }

    /// The staged message's payload (unmasked).
    pub fn staged(&self, s: &Staged) -> &[u8] {
        &self.staged_buf(s)[s.payload_start..s.end]
    }

    /// Forward the staged message to `dest` (which accepts): left where it is when staged in
    /// `dest`'s outbox, else copied there. The staging space is released either way.
    pub fn commit(&mut self, s: Staged, dest: ConnId) {
        if s.at == Some(dest) {
            if let Some(b) = self.boxes.get_mut(&dest) {
                b.sent += 1;
            }
            self.mark(dest);
            return;
        }
        // the staging buffer (scratch, or the outbox guessed) is moved out while the frame is
        // appended to `dest`'s outbox, then put back without the frame: no copy of its own
        let mut source = std::mem::take(self.staged_buf_mut(&s));
        debug_assert_eq!(
            source.len(),
            s.end,
            "staged frames are committed last in, first out"
        );
        if let Some(b) = self.boxes.get_mut(&dest) {
            ready(&mut b.buf, &self.spares).extend_from_slice(&source[s.frame_start..s.end]);
            b.sent += 1;
        }
        source.truncate(s.frame_start);
        *self.staged_buf_mut(&s) = source;
        self.mark(dest);
    }

    /// Queue the staged message as a bus record for another instance (`crossing.rs`) and
    /// give back its staging space.
    pub fn cross(&mut self, s: Staged, instance: u32, name: &[u8], deadline: u64) {
        let buf = match s.at.and_then(|id| self.boxes.get(&id)) {
            Some(b) => &b.buf,
            None => &self.scratch,
        };
        let frame = &buf[s.payload_start..s.end];
        self.crossing.push(instance, name, deadline, frame);
        self.crossing.crossed.add(frame.len());
        self.release(s);
    }

    /// Give back the staging space of a message that is not forwarded here.
    pub fn release(&mut self, s: Staged) {
        let buf = self.staged_buf_mut(&s);
        debug_assert_eq!(
            buf.len(),
            s.end,
            "staged frames are released last in, first out"
        );
        buf.truncate(s.frame_start);
    }

    /// Write the messages of a bus entry (crossing.rs records) (from `offset`) for sessions connected here into their
    /// outboxes, in order, until a record that cannot be placed or `max_bytes` were written (the
    /// caller writes them out and looks at its receivers' congestion before going on). The entry
    /// was `check`ed; a malformed record stops it like any other it cannot place.
    pub fn place_crossed(
        &mut self,
        routes: &Routes,
        data: &[u8],
        offset: usize,
        max_bytes: usize,
    ) -> Placed {
        let mut placed = Placed {
            next: offset,
            records: 0,
            bytes: 0,
        };
        while placed.next < data.len() && (placed.bytes as usize) < max_bytes {
            let Ok(record) = read_record(data, placed.next) else {
                break;
            };
            if record.kind != MESSAGE {
                break;
            }
            let Some(dest) = routes.lookup_name(record.name) else {
                break;
            };
            let frame = record.frame;
            if !self.forward(dest, OP_BINARY, frame.len(), |out| {
                out.copy_from_slice(frame)
            }) {
                break;
            }
            self.crossing.placed.add(frame.len());
            placed.records += 1;
            placed.bytes += frame.len() as u64;
            placed.next = record.next;
        }
        placed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ws::{encode_frame, OP_TEXT};
    use crate::forward::crossing::encode_message;

    fn taken(o: &mut Outboxes, id: ConnId) -> Vec<u8> {
        o.take(id).unwrap_or_default()
    }

    fn drained(o: &mut Outboxes) -> Vec<(ConnId, Vec<u8>)> {
        let mut out = Vec::new();
        o.drain(|id, b| out.push((id, b)));
        out
    }

    #[test]
    fn text_frames_match_the_encoder_and_the_fast_path_needs_acceptance() {
        let mut o = Outboxes::new();
        o.open(1);
        o.push(1, OP_TEXT, b"{\"a\":1}");
        assert!(o.forward(1, OP_TEXT, 3, |out| out.copy_from_slice(b"[2]")));
        o.push(1, OP_BINARY, b"bin");
        let mut want = encode_frame(OP_TEXT, b"{\"a\":1}", true, None);
        want.extend(encode_frame(OP_TEXT, b"[2]", true, None));
        want.extend(encode_frame(OP_BINARY, b"bin", true, None));
        assert_eq!(taken(&mut o, 1), want);
        o.set_congested(1, true);
        assert!(!o.forward(1, OP_TEXT, 1, |out| out[0] = b'x'));
        assert!(!o.forward(2, OP_TEXT, 1, |out| out[0] = b'x'), "no outbox");
        assert_eq!(o.pending(1), 0);
    }

    #[test]
    fn written_buffers_are_reused() {
        let mut o = Outboxes::new();
        o.open(1);
        o.push(1, OP_BINARY, &[7; 1000]);
        let first = o.take(1).unwrap();
        o.spares.give(first);
        assert_eq!(o.spares.len(), 1);
        assert_eq!(o.pending(1), 0);
        o.push(1, OP_BINARY, b"x");
        assert_eq!(
            o.spares.len(),
            0,
            "the outbox took the spare when appended to"
        );
        let second = o.take(1).unwrap();
        assert_eq!(second.len(), 3);
        assert!(second.capacity() >= 1000, "appended into the reused buffer");
        o.push(1, OP_BINARY, b"y");
        assert_eq!(taken(&mut o, 1).len(), 3, "no spare left: a new buffer");
        o.spares.give(vec![0; KEEP_CAPACITY + 1]);
        assert!(o.spares.is_empty(), "big buffers are not kept");
    }

    #[test]
    fn frames_and_raw_bytes_keep_their_order() {
        let mut o = Outboxes::new();
        o.open(1);
        o.push(1, OP_BINARY, b"a");
        assert!(o.forward(1, OP_BINARY, 2, |out| out.copy_from_slice(b"bc")));
        o.push_raw(1, b"RAW");
        let want = [
            encode_frame(OP_BINARY, b"a", true, None),
            encode_frame(OP_BINARY, b"bc", true, None),
            b"RAW".to_vec(),
        ]
        .concat();
        assert_eq!(taken(&mut o, 1), want);
        assert_eq!(o.pending(1), 0);
        assert_eq!(
            o.sent(1),
            Count {
                messages: 3,
                bytes: want.len() as u64
            },
            "every message appended, every byte taken"
        );
        assert_eq!(o.sent(2), Count::default(), "unknown connection");
    }

    #[test]
    fn headers_match_the_encoder_at_every_length_boundary() {
        for len in [0, 125, 126, 0xFFFF, 0x10000] {
            let mut o = Outboxes::new();
            o.open(7);
            let payload = vec![0xA5; len];
            assert!(o.forward(7, OP_BINARY, len, |out| out.copy_from_slice(&payload)));
            assert_eq!(
                taken(&mut o, 7),
                encode_frame(OP_BINARY, &payload, true, None),
                "{len}"
            );
        }
    }

    #[test]
    fn fast_path_appends_only_where_accepted() {
        let mut o = Outboxes::new();
        assert!(!o.forward(1, OP_BINARY, 0, |_| ()), "unknown connection");
        o.open(1);
        o.set_congested(1, true);
        assert!(!o.accepts(1) && !o.forward(1, OP_BINARY, 0, |_| ()));
        o.set_congested(1, false);
        o.set_held(1, true);
        assert!(!o.accepts(1));
        o.set_held(1, false);
        assert!(o.accepts(1));
        o.close(1);
        assert!(!o.accepts(1) && !o.is_open(1));
        o.remove(1);
        assert!(o.is_empty());
    }

    #[test]
    fn drain_lists_each_fast_path_destination_once() {
        let mut o = Outboxes::new();
        for id in [1, 2, 3] {
            o.open(id);
        }
        for id in [1, 2, 1, 1] {
            o.forward(id, OP_BINARY, 1, |out| out[0] = id as u8);
        }
        o.push(3, OP_BINARY, b"python"); // Python flushes its own sends
        let got = drained(&mut o);
        assert_eq!(got.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(got[0].1.len(), 9);
        assert!(drained(&mut o).is_empty());
        // taken by a Python flush before the drain: nothing left to drain
        o.forward(2, OP_BINARY, 1, |out| out[0] = 0);
        taken(&mut o, 2);
        assert!(drained(&mut o).is_empty());
        o.forward(2, OP_BINARY, 1, |out| out[0] = 0);
        assert_eq!(drained(&mut o).len(), 1, "listed again after a drain");
    }

    #[test]
    fn staged_in_the_guessed_outbox_is_copied_once() {
        let mut o = Outboxes::new();
        o.open(1);
        o.push(1, OP_BINARY, b"first");
        let before = o.pending(1);
        let s = o.stage(Some(1), 3, |out| out.copy_from_slice(b"xyz"));
        assert_eq!(s.at, Some(1));
        assert_eq!(o.staged(&s), b"xyz");
        o.commit(s, 1);
        let want = [
            encode_frame(OP_BINARY, b"first", true, None),
            encode_frame(OP_BINARY, b"xyz", true, None),
        ]
        .concat();
        assert_eq!(o.pending(1), before + 5);
        assert_eq!(
            o.sent(1).messages,
            2,
            "a message staged in place is counted once committed"
        );
        assert_eq!(drained(&mut o), [(1, want)]);
    }

    #[test]
    fn staged_elsewhere_moves_to_the_destination_or_is_released() {
        let mut o = Outboxes::new();
        o.open(1);
        o.open(2);
        // guessed wrong: moved from 1's outbox to 2's, and 1's is as it was
        let s = o.stage(Some(1), 2, |out| out.copy_from_slice(b"hi"));
        o.commit(s, 2);
        assert_eq!(o.pending(1), 0);
        assert_eq!(taken(&mut o, 2), encode_frame(OP_BINARY, b"hi", true, None));
        // no guess (or one that does not accept): the scratch buffer
        o.set_held(1, true);
        let s = o.stage(Some(1), 2, |out| out.copy_from_slice(b"yo"));
        assert_eq!(s.at, None);
        o.commit(s, 2);
        assert_eq!(taken(&mut o, 2), encode_frame(OP_BINARY, b"yo", true, None));
        // not forwarded at all
        let s = o.stage(Some(2), 2, |out| out.copy_from_slice(b"no"));
        assert_eq!(o.staged(&s), b"no");
        o.release(s);
        assert_eq!(o.pending(2), 0);
        assert!(o.scratch.is_empty());
    }

    #[test]
    fn crossed_messages_become_records_and_leave_the_outboxes_as_they_were() {
        let mut o = Outboxes::new();
        o.open(1);
        o.push(1, OP_BINARY, b"first");
        let before = o.pending(1);
        for guess in [Some(1), None] {
            let s = o.stage(guess, 3, |out| out.copy_from_slice(b"env"));
            o.cross(s, 2, b"r:9", 7);
        }
        assert_eq!(o.pending(1), before);
        assert!(o.scratch.is_empty());
        assert_eq!(
            o.crossing.crossed,
            Count {
                messages: 2,
                bytes: 6
            }
        );
        let mut want = Vec::new();
        crate::forward::crossing::encode_message(&mut want, b"r:9", 7, b"env");
        crate::forward::crossing::encode_message(&mut want, b"r:9", 7, b"env");
        assert_eq!(o.crossing.take(), [(2, want, 2)]);
        assert!(drained(&mut o).is_empty(), "nothing for a connection");
    }

    #[test]
    fn place_writes_in_order_and_stops_at_what_it_cannot_place() {
        let mut routes = Routes::new();
        routes.register_session(1, None, 10);
        routes.register_session(2, Some("x"), 20);
        let mut o = Outboxes::new();
        o.open(10);
        o.open(20);
        let mut entry = Vec::new();
        encode_message(&mut entry, b"r:1", 0, b"one");
        encode_message(&mut entry, b"r:2:x", 0, b"two");
        encode_message(&mut entry, b"r:3", 0, b"nobody here");
        encode_message(&mut entry, b"r:1", 0, b"after");
        let p = o.place_crossed(&routes, &entry, 0, usize::MAX);
        assert_eq!((p.records, p.bytes), (2, 6));
        let third = read_record(&entry, p.next).unwrap();
        assert_eq!(third.frame, b"nobody here");
        // Python handles that one, then hands the rest back
        let p = o.place_crossed(&routes, &entry, third.next, usize::MAX);
        assert_eq!((p.next, p.records), (entry.len(), 1));
        assert_eq!(
            o.crossing.placed,
            Count {
                messages: 3,
                bytes: 11
            }
        );
        let frames = |payloads: &[&[u8]]| {
            payloads
                .iter()
                .flat_map(|p| {
                    crate::codec::ws::encode_frame(crate::codec::ws::OP_BINARY, p, true, None)
                })
                .collect::<Vec<u8>>()
        };
        assert_eq!(o.take(10).unwrap(), frames(&[b"one", b"after"]));
        assert_eq!(o.take(20).unwrap(), frames(&[b"two"]));
        // a receiver that does not accept (congested, held) stops it before its record
        o.set_congested(20, true);
        let p = o.place_crossed(&routes, &entry, 0, usize::MAX);
        assert_eq!(p.records, 1);
        assert_eq!(read_record(&entry, p.next).unwrap().frame, b"two");
        // and so does the byte bound, after the record that reached it
        o.set_congested(20, false);
        let p = o.place_crossed(&routes, &entry, 0, 1);
        assert_eq!(p.records, 1);
        // notices are Python's
        let mut notice = entry.clone();
        notice[0] = 1;
        assert_eq!(o.place_crossed(&routes, &notice, 0, usize::MAX).records, 0);
    }
}

pub mod py {
    use std::ffi::c_int;

    use pyo3::ffi;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList, PyMemoryView, PyTuple};

    use super::Spares;
    use crate::codec::ws::{OP_BINARY, OP_TEXT};
    use crate::lent::py::fill_read_only_view;
    use crate::forward::maps::IdMap;
    use crate::forward::routes::py::RouteTable;
    use crate::forward::routes::ConnId;

    /// A taken outbox's bytes, lent to the transport through the buffer protocol (no copy);
    /// the buffer goes back to the outboxes' spares when the transport lets go of it.
    #[pyclass(module = "rmb_relay._core", frozen)]
    pub struct OutBytes {
        bytes: Vec<u8>,
        spares: Spares,
    }

    impl Drop for OutBytes {
        fn drop(&mut self) {
            self.spares.give(std::mem::take(&mut self.bytes));
        }
    }

    #[pymethods]
    impl OutBytes {
        fn __len__(&self) -> usize {
            self.bytes.len()
        }

        /// The bytes, read-only, for as long as a view holds them.
        unsafe fn __getbuffer__(
            slf: Bound<'_, Self>,
            view: *mut ffi::Py_buffer,
            flags: c_int,
        ) -> PyResult<()> {
            let (data, len) = (slf.get().bytes.as_ptr(), slf.get().bytes.len());
            // SAFETY: the object is frozen (nothing changes `bytes`, so the Vec is never
            // reallocated) and owns the bytes until the view lets go of it.
            unsafe { fill_read_only_view(slf.into_any(), view, flags, data, len, "outbox bytes") }
        }

        fn __repr__(&self) -> String {
            format!("OutBytes(len={})", self.bytes.len())
        }
    }

    /// Crossing batches as Python gets them: [(instance, records, count)].
    fn crossing_list(
        py: Python<'_>,
        batches: Vec<(u32, Vec<u8>, u32)>,
    ) -> PyResult<Bound<'_, PyList>> {
        let out = PyList::empty(py);
        for (instance, records, count) in batches {
            out.append((instance, PyBytes::new(py, &records), count))?;
        }
        Ok(out)
    }

    /// `bytes` as a memoryview over an `OutBytes` (what every transport's `write` takes).
    fn lend<'py>(
        py: Python<'py>,
        bytes: Vec<u8>,
        spares: &Spares,
    ) -> PyResult<Bound<'py, PyMemoryView>> {
        let owner = Bound::new(
            py,
            OutBytes {
                bytes,
                spares: spares.clone(),
            },
        )?;
        PyMemoryView::from(owner.as_any())
    }

    /// The pending output of a switch's connections (see the module docs): the decoders
    /// forward into it during `feed`, Python takes and writes it.
    #[pyclass(module = "rmb_relay._core")]
    #[derive(Default)]
    pub struct Outboxes {
        pub(crate) inner: super::Outboxes,
        /// the Python connection of each outbox (what `drain` hands back to write to)
        conns: IdMap<Py<PyAny>>,
        /// told the crossing batches (`crossing.rs`) at each `drain`
        crossing_sink: Option<Py<PyAny>>,
    }

    impl Outboxes {
        /// The connection `conn_id`'s outbox was opened with, while it is open or closing (a
        /// dialect that answers HTTP clients in Rust hands them back to Python this way).
        pub(crate) fn conn(&self, py: Python<'_>, conn_id: ConnId) -> Option<Py<PyAny>> {
            self.conns.get(&conn_id).map(|c| c.clone_ref(py))
        }
    }

    #[pymethods]
    impl Outboxes {
        #[new]
        fn new() -> Self {
            Self::default()
        }

        /// `conn` carries messages from now on; `drain` names it when it has output; what the
        /// fast path forwards to it is counted under `kind` (its dialect's name). (Rust callers
        /// too: a dialect that answers HTTP clients in Rust opens their outboxes.)
        #[pyo3(signature = (conn_id, conn, kind = ""))]
        pub(crate) fn open(&mut self, conn_id: ConnId, conn: Py<PyAny>, kind: &str) {
            self.inner.open_as(conn_id, kind);
            self.conns.insert(conn_id, conn);
        }

        /// Closing: the fast path neither forwards from nor to it any more.
        fn close(&mut self, conn_id: ConnId) {
            self.inner.close(conn_id);
        }

        /// Gone: its outbox and what it held are dropped.
        fn remove(&mut self, conn_id: ConnId) {
            self.inner.remove(conn_id);
            self.conns.remove(&conn_id);
        }

        fn set_congested(&mut self, conn_id: ConnId, congested: bool) {
            self.inner.set_congested(conn_id, congested);
        }

        /// The dialect holds the fast path back from this connection (its messages go to Python).
        fn set_held(&mut self, conn_id: ConnId, held: bool) {
            self.inner.set_held(conn_id, held);
        }

        fn accepts(&self, conn_id: ConnId) -> bool {
            self.inner.accepts(conn_id)
        }

        fn pending(&self, conn_id: ConnId) -> usize {
            self.inner.pending(conn_id)
        }

        /// (messages appended to the connection's outbox, by the fast path and by Python;
        /// bytes taken from it for writing) since it opened; zeros for an unknown connection.
        fn sent(&self, conn_id: ConnId) -> (u64, u64) {
            let count = self.inner.sent(conn_id);
            (count.messages, count.bytes)
        }

        fn __len__(&self) -> usize {
            self.inner.len()
        }

        /// One binary frame of `payload`, after whatever is queued.
        fn push(&mut self, conn_id: ConnId, payload: &[u8]) {
            self.inner.push(conn_id, OP_BINARY, payload);
        }

        /// One binary frame per payload, in order.
        fn push_many(&mut self, conn_id: ConnId, payloads: &Bound<'_, PyList>) -> PyResult<()> {
            for p in payloads.iter() {
                self.inner
                    .push(conn_id, OP_BINARY, p.downcast::<PyBytes>()?.as_bytes());
            }
            Ok(())
        }

        /// One text frame of `payload`, after whatever is queued: framed here, without an
        /// encoded frame object of its own.
        fn push_text(&mut self, conn_id: ConnId, payload: &[u8]) {
            self.inner.push(conn_id, OP_TEXT, payload);
        }

        /// An encoded frame (text, control), after whatever is queued.
        fn push_raw(&mut self, conn_id: ConnId, frame: &[u8]) {
            self.inner.push_raw(conn_id, frame);
        }

        /// Everything buffered for the connection, lent without a copy (None: nothing).
        fn take<'py>(
            &mut self,
            py: Python<'py>,
            conn_id: ConnId,
        ) -> PyResult<Option<Bound<'py, PyMemoryView>>> {
            match self.inner.take(conn_id) {
                Some(bytes) => Ok(Some(lend(py, bytes, &self.inner.spares)?)),
                None => Ok(None),
            }
        }

        /// (connection, bytes) for every connection the fast path forwarded to since the last
        /// drain and whose output Python has not taken since: write each once.
        ///
        /// Records the fast path queued for other instances since the last drain go to the
        /// crossing sink first, as one list of (instance, records, count), once the outboxes
        /// are no longer borrowed (the sink may use them).
        fn drain<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
            let py = slf.py();
            let (out, crossed) = {
                let mut this = slf.try_borrow_mut()?;
                let this = &mut *this;
                let crossed = if this.inner.crossing.pending() {
                    let sink = this.crossing_sink.as_ref().map(|s| s.clone_ref(py));
                    Some((this.inner.crossing.take(), sink))
                } else {
                    None
                };
                let out = PyList::empty(py);
                let conns = &this.conns;
                let spares = this.inner.spares.clone();
                let mut result = Ok(());
                this.inner
                    .drain(|id, bytes| match (conns.get(&id), &result) {
                        (Some(conn), Ok(())) => {
                            result = lend(py, bytes, &spares)
                                .and_then(|view| {
                                    PyTuple::new(py, [conn.bind(py).clone(), view.into_any()])
                                })
                                .and_then(|t| out.append(t));
                        }
                        _ => spares.give(bytes),
                    });
                (result.map(|()| out), crossed)
            };
            if let Some((batches, Some(sink))) = crossed {
                // the connections' bytes are taken already: a failing sink must not lose them
                if let Err(err) = crossing_list(py, batches).and_then(|b| sink.call1(py, (b,))) {
                    err.write_unraisable(py, Some(sink.bind(py)));
                }
            }
            out
        }

        /// The crossing batches waiting (what `drain` hands the sink), taken.
        fn take_crossing<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            crossing_list(py, self.inner.crossing.take())
        }

        /// `sink(batches)` is called by `drain` with the records queued for other instances.
        fn set_crossing_sink(&mut self, sink: Option<Py<PyAny>>) {
            self.crossing_sink = sink;
        }

        /// Whether the fast path may queue records for other instances (the bus has room).
        #[getter]
        fn crossing_open(&self) -> bool {
            self.inner.crossing.open
        }

        #[setter]
        fn set_crossing_open(&mut self, open: bool) {
            self.inner.crossing.open = open;
        }

        /// How long (seconds) a crossing record may wait in a receiver's store at most: the
        /// bound of the deadline each record carries.
        #[getter]
        fn store_ttl(&self) -> u64 {
            self.inner.crossing.store_ttl
        }

        #[setter]
        fn set_store_ttl(&mut self, ttl: u64) {
            self.inner.crossing.store_ttl = ttl;
        }

        /// Write the messages of a bus entry (`data`, from `offset`) for sessions connected
        /// here into their outboxes, in order, until one it cannot place or `max_bytes` were
        /// written (`Outboxes::place_crossed`); returns (the offset of the first record left, how
        /// many it wrote). The outboxes written to are listed for `drain`.
        fn place_records(
            &mut self,
            routes: PyRef<'_, RouteTable>,
            data: &[u8],
            offset: usize,
            max_bytes: usize,
        ) -> (usize, u64) {
            let placed = self.inner.place_crossed(&routes.inner, data, offset, max_bytes);
            (placed.next, placed.records)
        }

        /// (messages, bytes) the fast path forwarded to connections opened as `kind`.
        fn forwarded(&self, kind: &str) -> (u64, u64) {
            let count = self.inner.forwarded(kind);
            (count.messages, count.bytes)
        }

        /// (messages, bytes) from other instances `place_records` wrote to connections here.
        #[getter]
        fn placed(&self) -> (u64, u64) {
            let count = self.inner.crossing.placed;
            (count.messages, count.bytes)
        }

        /// (messages, bytes) the fast path queued for other instances.
        #[getter]
        fn crossed(&self) -> (u64, u64) {
            let count = self.inner.crossing.crossed;
            (count.messages, count.bytes)
        }

        fn __repr__(&self) -> String {
            format!("Outboxes(len={})", self.inner.len())
        }
    }

    /// The outboxes, borrowed for one `feed`, when the fast path may forward this connection's
    /// messages: it has them and it is open (data after our close frame is only discarded).
    pub fn open_outboxes<'py>(
        py: Python<'py>,
        outboxes: Option<&Py<Outboxes>>,
        conn_id: u64,
    ) -> PyResult<Option<PyRefMut<'py, Outboxes>>> {
        match outboxes {
            Some(o) => {
                let o = o.bind(py).try_borrow_mut()?;
                Ok(o.inner.is_open(conn_id).then_some(o))
            }
            None => Ok(None),
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<Outboxes>()?;
        m.add_class::<OutBytes>()
    }
}
