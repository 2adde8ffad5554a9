//! WebSocket framing (RFC 6455 section 5): an incremental decoder and the frame encoders.
//!
//! Theory of operation: [`Decoder::feed`] parses frames straight out of the caller's bytes
//! and hands each event to a sink while the payload is still borrowed, so the Python wrapper
//! copies a payload exactly once (unmasking in the same pass, eight bytes at a time). Only a
//! frame that straddles two feeds is copied into the decoder's buffer, and that buffer never
//! holds more than that one frame. Fragments of a data message are unmasked into a separate
//! reassembly buffer. Every header is checked as soon as its bytes are there, before any of its
//! payload is buffered, so a peer cannot make us hold more than `max_message` bytes of one
//! message. The first violation (or close frame) ends the stream: the decoder reports it and
//! then ignores everything.
//!
//! Close codes of violations, in one place (as python-websockets does): protocol errors 1002,
//! invalid UTF-8 1007, over the size limit 1009 (RFC 6455 section 7.4.1).

use crate::codec::mask::{apply_mask, copy_masked, Payload};
use crate::error::{Error, Result};

// Opcodes (RFC 6455 section 5.2; 0x3-0x7 and 0xB-0xF are reserved).
pub const OP_CONTINUATION: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

// Close codes we produce (RFC 6455 section 7.4.1).
pub const CLOSE_NORMAL: u16 = 1000;
pub const CLOSE_PROTOCOL_ERROR: u16 = 1002;
pub const CLOSE_INVALID_DATA: u16 = 1007;
pub const CLOSE_TOO_BIG: u16 = 1009;

/// Default cap on one (reassembled) message: a security limit, since a peer could otherwise
/// make us buffer whatever it announces. RMB and SBD messages are far smaller.
pub const DEFAULT_MAX_MESSAGE: usize = 1024 * 1024;
/// Control frames carry at most 125 bytes and are never fragmented (RFC 6455 section 5.5).
pub const MAX_CONTROL_PAYLOAD: usize = 125;
/// A close reason fits in a control frame after the 2-byte code (RFC 6455 section 5.5.1).
pub const MAX_CLOSE_REASON: usize = MAX_CONTROL_PAYLOAD - 2;
/// Longest frame header: 2 bytes, 8-byte extended length, 4-byte mask (RFC 6455 section 5.2).
pub const MAX_HEADER_LEN: usize = 14;
/// Buffers that grew past this for one big message are released afterwards, so an idle
/// connection does not keep a megabyte it needed once.
const KEEP_CAPACITY: usize = 64 * 1024;

/// Close codes a peer may send (RFC 6455 section 7.4, IANA registry): 1000-1003 and
/// 1007-1014 are registered for use on the wire, 3000-4999 belong to libraries and
/// applications; 1004-1006 and 1015 are reserved or must never be sent, and everything
/// else below 3000 or from 5000 up is invalid.
pub fn is_valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// One decoded event, borrowing its payload from the input or the decoder.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// A complete (reassembled) data message.
    Message {
        is_text: bool,
        payload: Payload<'a>,
    },
    Ping(Payload<'a>),
    Pong(Payload<'a>),
    /// The peer's close frame; `code` is None when the frame had no body.
    Close {
        code: Option<u16>,
        reason: &'a str,
    },
    /// The peer broke the protocol or a limit: answer with close(code) and drop it.
    Violation {
        code: u16,
        reason: &'static str,
    },
}

/// An owned copy of an [`Event`], for tests and callers that keep events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnedEvent {
    Message { is_text: bool, data: Vec<u8> },
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    Close { code: Option<u16>, reason: String },
    Violation { code: u16, reason: &'static str },
}

impl From<Event<'_>> for OwnedEvent {
    fn from(ev: Event<'_>) -> Self {
        match ev {
            Event::Message { is_text, payload } => OwnedEvent::Message {
                is_text,
                data: payload.to_vec(),
            },
            Event::Ping(p) => OwnedEvent::Ping(p.to_vec()),
            Event::Pong(p) => OwnedEvent::Pong(p.to_vec()),
            Event::Close { code, reason } => OwnedEvent::Close {
                code,
                reason: reason.to_owned(),
            },
            Event::Violation { code, reason } => OwnedEvent::Violation { code, reason },
        }
    }
}

/// A violation: close code and a short operator-readable reason.
type Violation = (u16, &'static str);

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FrameHeader {
    fin: bool,
    opcode: u8,
    mask: Option<[u8; 4]>,
    header_len: usize,
    payload_len: usize,
}

impl FrameHeader {
    fn frame_len(&self) -> usize {
        self.header_len + self.payload_len
    }
}

/// Header length implied by the first two bytes (2 while fewer are known).
fn header_len_hint(bytes: &[u8]) -> usize {
    match bytes {
        [_, b1, ..] => {
            let ext = match b1 & 0x7f {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            2 + ext + if b1 & 0x80 != 0 { 4 } else { 0 }
        }
        _ => 2,
    }
}

/// Incremental RFC 6455 decoder; see the module comment.
#[derive(Debug)]
pub struct Decoder {
    max_message: usize,
    client_mode: bool,
    /// One frame that arrived only in part.
    buf: Vec<u8>,
    /// Unmasked payload of an unfinished fragmented message.
    frag: Vec<u8>,
    /// `Some(is_text)` while a fragmented message is unfinished.
    frag_text: Option<bool>,
    closed: bool,
    /// data messages decoded and bytes fed so far (what monitoring shows per connection:
    /// two additions per message and per read, the cheapest place that sees every one)
    messages: u64,
    bytes: u64,
}

impl Decoder {
    /// Server mode (`client_mode` false) requires masked frames, client mode unmasked ones
    /// (RFC 6455 section 5.1).
    pub fn new(max_message: usize, client_mode: bool) -> Self {
        Decoder {
            max_message,
            client_mode,
            buf: Vec::new(),
            frag: Vec::new(),
            frag_text: None,
            closed: false,
            messages: 0,
            bytes: 0,
        }
    }

    /// Data messages decoded so far (fragmented ones once).
    pub fn messages(&self) -> u64 {
        self.messages
    }

    /// Bytes fed so far (frames of every kind, with their headers).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes held: an incomplete frame plus the fragments of an unfinished message.
    pub fn buffered(&self) -> usize {
        self.buf.len() + self.frag.len()
    }

    /// True once a close frame or a violation has been reported.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Decode `data`, passing every complete event to `sink` in order. After a close or a
    /// violation nothing more is reported. A sink error stops decoding and is returned.
    pub fn feed<E>(
        &mut self,
        data: &[u8],
        mut sink: impl FnMut(Event<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.closed {
            return Ok(());
        }
        self.bytes += data.len() as u64;
        let mut input = data;
        if !self.buf.is_empty() {
            input = self.finish_buffered(input, &mut sink)?;
        }
        // Whole frames straight from the input; a trailing partial frame is buffered.
        while !input.is_empty() && !self.closed && self.buf.is_empty() {
            match self.check_header(input) {
                Err(v) => self.violate(v, &mut sink)?,
                Ok(None) => self.buf.extend_from_slice(input),
                Ok(Some(h)) if input.len() < h.frame_len() => {
                    // Within max_message, so reserving the whole frame up front is allowed.
                    self.buf.reserve_exact(h.frame_len());
                    self.buf.extend_from_slice(input);
                }
                Ok(Some(h)) => {
                    let (frame, rest) = input.split_at(h.frame_len());
                    input = rest;
                    self.process(&h, &frame[h.header_len..], &mut sink)?;
                }
            }
        }
        if self.closed {
            self.release();
        }
        Ok(())
    }

    /// Decode into owned events (convenience for tests and non-hot callers).
    pub fn feed_owned(&mut self, data: &[u8]) -> Vec<OwnedEvent> {
        let mut out = Vec::new();
        let _ = self.feed(data, |ev| {
            out.push(OwnedEvent::from(ev));
            Ok::<(), std::convert::Infallible>(())
        });
        out
    }

    /// Top up the buffered partial frame from `input`; process it once complete. Returns
    /// the input not used. The buffer only ever receives the bytes of that one frame.
    fn finish_buffered<'d, E>(
        &mut self,
        mut input: &'d [u8],
        sink: &mut impl FnMut(Event<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<&'d [u8], E> {
        loop {
            let (want, header) = match self.check_header(&self.buf) {
                Err(v) => {
                    self.violate(v, sink)?;
                    return Ok(input);
                }
                Ok(None) => (header_len_hint(&self.buf), None),
                Ok(Some(h)) => (h.frame_len(), Some(h)),
            };
            let take = (want - self.buf.len()).min(input.len());
            self.buf.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.buf.len() < want {
                return Ok(input);
            }
            if let Some(h) = header {
                let frame = std::mem::take(&mut self.buf);
                let result = self.process(&h, &frame[h.header_len..], sink);
                if frame.capacity() <= KEEP_CAPACITY {
                    self.buf = frame;
                    self.buf.clear();
                }
                result?;
                return Ok(input);
            }
        }
    }

    /// Check a frame header against RFC 6455 and our limits, using only the bytes needed:
    /// `Ok(None)` while the header is incomplete.
    fn check_header(&self, bytes: &[u8]) -> std::result::Result<Option<FrameHeader>, Violation> {
        let [b0, b1, ..] = *bytes else {
            return Ok(None);
        };
        let fin = b0 & 0x80 != 0;
        let opcode = b0 & 0x0f;
        let masked = b1 & 0x80 != 0;
        // RSV1-3 without a negotiated extension (section 5.2); we negotiate none.
        if b0 & 0x70 != 0 {
            return Err((CLOSE_PROTOCOL_ERROR, "reserved bits set"));
        }
        if !matches!(
            opcode,
            OP_CONTINUATION | OP_TEXT | OP_BINARY | OP_CLOSE | OP_PING | OP_PONG
        ) {
            return Err((CLOSE_PROTOCOL_ERROR, "unknown opcode"));
        }
        // Section 5.1: clients mask every frame, servers none.
        if masked == self.client_mode {
            return Err(if masked {
                (CLOSE_PROTOCOL_ERROR, "masked server frame")
            } else {
                (CLOSE_PROTOCOL_ERROR, "unmasked client frame")
            });
        }
        let len7 = b1 & 0x7f;
        let is_control = opcode & 0x08 != 0;
        if is_control {
            if !fin {
                return Err((CLOSE_PROTOCOL_ERROR, "fragmented control frame"));
            }
            if usize::from(len7) > MAX_CONTROL_PAYLOAD {
                return Err((CLOSE_PROTOCOL_ERROR, "control frame too long"));
            }
        } else if opcode == OP_CONTINUATION {
            // Section 5.4: a continuation only follows an unfinished message...
            if self.frag_text.is_none() {
                return Err((CLOSE_PROTOCOL_ERROR, "unexpected continuation frame"));
            }
        } else if self.frag_text.is_some() {
            // ...and a new message only starts after the previous one finished.
            return Err((CLOSE_PROTOCOL_ERROR, "expected continuation frame"));
        }
        let header_len = header_len_hint(bytes);
        if bytes.len() < header_len {
            return Ok(None);
        }
        let (len, mask_at) = match len7 {
            126 => (u64::from(u16::from_be_bytes([bytes[2], bytes[3]])), 4),
            127 => {
                let ext: [u8; 8] = bytes[2..10].try_into().expect("8 bytes");
                (u64::from_be_bytes(ext), 10)
            }
            n => (u64::from(n), 2),
        };
        // Section 5.2: the most significant bit of a 64-bit length must be 0.
        if len >> 63 != 0 {
            return Err((CLOSE_PROTOCOL_ERROR, "invalid frame length"));
        }
        if !is_control {
            let total = (self.frag.len() as u64).saturating_add(len);
            if total > self.max_message as u64 {
                return Err((CLOSE_TOO_BIG, "message too big"));
            }
        }
        let mask = masked.then(|| {
            [
                bytes[mask_at],
                bytes[mask_at + 1],
                bytes[mask_at + 2],
                bytes[mask_at + 3],
            ]
        });
        Ok(Some(FrameHeader {
            fin,
            opcode,
            mask,
            header_len,
            // Bounded by max_message or by 125 above, so it fits.
            payload_len: len as usize,
        }))
    }

    /// Act on one complete, header-checked frame.
    fn process<E>(
        &mut self,
        h: &FrameHeader,
        payload: &[u8],
        sink: &mut impl FnMut(Event<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let payload = Payload::new(payload, h.mask);
        match h.opcode {
            OP_PING => sink(Event::Ping(payload)),
            OP_PONG => sink(Event::Pong(payload)),
            OP_CLOSE => self.process_close(payload, sink),
            OP_TEXT | OP_BINARY if h.fin => {
                let is_text = h.opcode == OP_TEXT;
                if is_text && !payload.is_utf8() {
                    return self
                        .violate((CLOSE_INVALID_DATA, "invalid utf-8 in text message"), sink);
                }
                self.messages += 1;
                sink(Event::Message { is_text, payload })
            }
            OP_TEXT | OP_BINARY => {
                self.frag_text = Some(h.opcode == OP_TEXT);
                self.append_fragment(payload);
                Ok(())
            }
            _ => {
                // OP_CONTINUATION: check_header made sure a message is unfinished.
                self.append_fragment(payload);
                if !h.fin {
                    return Ok(());
                }
                let is_text = self.frag_text.take().unwrap_or(false);
                if is_text && std::str::from_utf8(&self.frag).is_err() {
                    return self
                        .violate((CLOSE_INVALID_DATA, "invalid utf-8 in text message"), sink);
                }
                self.messages += 1;
                let result = sink(Event::Message {
                    is_text,
                    payload: Payload::new(&self.frag, None),
                });
                self.frag.clear();
                if self.frag.capacity() > KEEP_CAPACITY {
                    self.frag = Vec::new();
                }
                result
            }
        }
    }

    fn append_fragment(&mut self, payload: Payload<'_>) {
        let start = self.frag.len();
        self.frag.extend_from_slice(payload.bytes);
        if let Some(mask) = payload.mask {
            apply_mask(&mut self.frag[start..], mask);
        }
    }

    /// Section 5.5.1: an empty body, or a 2-byte code plus a UTF-8 reason.
    fn process_close<E>(
        &mut self,
        payload: Payload<'_>,
        sink: &mut impl FnMut(Event<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut tmp = [0u8; MAX_CONTROL_PAYLOAD];
        let body = &mut tmp[..payload.len()];
        payload.copy_to(body);
        let event = match body {
            [] => Ok((None, "")),
            [_] => Err((CLOSE_PROTOCOL_ERROR, "invalid close frame length")),
            [hi, lo, reason @ ..] => {
                let code = u16::from_be_bytes([*hi, *lo]);
                if !is_valid_close_code(code) {
                    Err((CLOSE_PROTOCOL_ERROR, "invalid close code"))
                } else {
                    match std::str::from_utf8(reason) {
                        Ok(reason) => Ok((Some(code), reason)),
                        Err(_) => Err((CLOSE_INVALID_DATA, "invalid utf-8 in close reason")),
                    }
                }
            }
        };
        match event {
            Ok((code, reason)) => {
                self.closed = true;
                sink(Event::Close { code, reason })
            }
            Err(v) => self.violate(v, sink),
        }
    }

    fn violate<E>(
        &mut self,
        (code, reason): Violation,
        sink: &mut impl FnMut(Event<'_>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        self.closed = true;
        sink(Event::Violation { code, reason })
    }

    /// Nothing more will be decoded: give the memory back.
    fn release(&mut self) {
        self.buf = Vec::new();
        self.frag = Vec::new();
        self.frag_text = None;
    }
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new(DEFAULT_MAX_MESSAGE, false)
    }
}

/// Size of a frame with this payload (section 5.2 length encoding, plus the mask).
pub fn frame_len(payload_len: usize, masked: bool) -> usize {
    let ext = match payload_len {
        0..=125 => 0,
        126..=0xFFFF => 2,
        _ => 8,
    };
    2 + ext + if masked { 4 } else { 0 } + payload_len
}

/// Write a frame header (without the masking key) for `len` payload bytes into the start of
/// `out`; returns its length (2, 4 or 10). The outboxes write headers in front of payloads
/// they copy in themselves.
#[inline]
pub fn write_header(out: &mut [u8], opcode: u8, fin: bool, len: usize, masked: bool) -> usize {
    debug_assert!(opcode <= 0x0f);
    let masked_bit = if masked { 0x80 } else { 0 };
    out[0] = if fin { 0x80 } else { 0 } | (opcode & 0x0f);
    match len {
        0..=125 => {
            out[1] = masked_bit | len as u8;
            2
        }
        126..=0xFFFF => {
            out[1] = masked_bit | 126;
            out[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            4
        }
        _ => {
            out[1] = masked_bit | 127;
            out[2..10].copy_from_slice(&(len as u64).to_be_bytes());
            10
        }
    }
}

/// Write one frame into the start of `out` (at least `frame_len` bytes); returns its length.
/// No protocol checks beyond the 4-bit opcode: callers that build control frames keep them
/// within 125 bytes (the named encoders do).
pub fn write_frame(
    out: &mut [u8],
    opcode: u8,
    fin: bool,
    payload: &[u8],
    mask: Option<[u8; 4]>,
) -> usize {
    let at = write_header(out, opcode, fin, payload.len(), mask.is_some());
    let end = at + mask.map_or(0, |_| 4) + payload.len();
    match mask {
        Some(m) => {
            out[at..at + 4].copy_from_slice(&m);
            copy_masked(&mut out[at + 4..end], payload, m);
        }
        None => out[at..end].copy_from_slice(payload),
    }
    end
}

/// One frame as a new vector (see [`write_frame`]).
pub fn encode_frame(opcode: u8, payload: &[u8], fin: bool, mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = vec![0; frame_len(payload.len(), mask.is_some())];
    write_frame(&mut out, opcode, fin, payload, mask);
    out
}

/// Total size of one frame per payload, for a batch written into one allocation.
pub fn batch_len<'a>(payloads: impl IntoIterator<Item = &'a [u8]>, masked: bool) -> usize {
    payloads
        .into_iter()
        .map(|p| frame_len(p.len(), masked))
        .sum()
}

/// The body of a close frame: the code, then the reason cut to 123 bytes at a character
/// boundary (a reason is informational; sending a shortened one beats failing to close).
/// Codes that may not be sent (section 7.4) are rejected.
pub fn close_payload(code: u16, reason: &str) -> Result<([u8; MAX_CONTROL_PAYLOAD], usize)> {
    if !is_valid_close_code(code) {
        return Err(Error::InvalidArgument(format!(
            "close code {code} may not be sent"
        )));
    }
    let mut cut = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut body = [0u8; MAX_CONTROL_PAYLOAD];
    body[..2].copy_from_slice(&code.to_be_bytes());
    body[2..2 + cut].copy_from_slice(&reason.as_bytes()[..cut]);
    Ok((body, 2 + cut))
}

/// A server close frame.
pub fn encode_close(code: u16, reason: &str) -> Result<Vec<u8>> {
    let (body, n) = close_payload(code, reason)?;
    Ok(encode_frame(OP_CLOSE, &body[..n], true, None))
}

/// Reject a control payload that would not fit in a control frame.
pub fn check_control_payload(payload: &[u8]) -> Result<()> {
    if payload.len() > MAX_CONTROL_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "control frame payload is {} bytes, at most {MAX_CONTROL_PAYLOAD} allowed",
            payload.len()
        )));
    }
    Ok(())
}

/// Mask source for client frames: xoshiro256** seeded (through splitmix64) from 32 bytes
/// the caller takes from `os.urandom`.
///
/// Why a fast non-cryptographic generator is fine: masking exists so that a hostile script
/// cannot choose the bytes an intermediary sees (RFC 6455 section 10.3); the masks must be
/// unpredictable to the server and the network, not secret against an attacker who sees
/// many of them. Our clients are our own peer and load harness, not browsers running
/// foreign scripts, and the OS-random seed makes every encoder's sequence unpredictable.
/// The core itself stays free of I/O.
#[derive(Debug, Clone)]
pub struct MaskRng {
    s: [u64; 4],
}

/// Length of the seed [`MaskRng::new`] takes.
pub const MASK_SEED_LEN: usize = 32;

impl MaskRng {
    pub fn new(seed: &[u8; MASK_SEED_LEN]) -> Self {
        let mut s = [0u64; 4];
        for (i, (word, chunk)) in s.iter_mut().zip(seed.chunks_exact(8)).enumerate() {
            let x = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            *word = splitmix64(x.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN_GAMMA)));
        }
        // xoshiro's only bad state; unreachable in practice but cheap to rule out.
        if s == [0; 4] {
            s[0] = GOLDEN_GAMMA;
        }
        MaskRng { s }
    }

    /// xoshiro256** (Blackman and Vigna, 2018).
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = &mut self.s;
        let result = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = *s1 << 17;
        *s2 ^= *s0;
        *s3 ^= *s1;
        *s1 ^= *s2;
        *s0 ^= *s3;
        *s2 ^= t;
        *s3 = s3.rotate_left(45);
        result
    }

    /// Four mask bytes from the high half (the best-mixed bits of the output).
    pub fn next_mask(&mut self) -> [u8; 4] {
        ((self.next_u64() >> 32) as u32).to_ne_bytes()
    }
}

/// The splitmix64 increment (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function (Steele, Lea, Flood 2014): a bijection that spreads any seed.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::mask::UTF8_CHUNK;
    use rand::{Rng, SeedableRng};

    const MASK: [u8; 4] = [0x37, 0xfa, 0x21, 0x3d];

    fn server() -> Decoder {
        Decoder::default()
    }

    fn client() -> Decoder {
        Decoder::new(DEFAULT_MAX_MESSAGE, true)
    }

    fn msg(is_text: bool, data: &[u8]) -> OwnedEvent {
        OwnedEvent::Message {
            is_text,
            data: data.to_vec(),
        }
    }

    fn violation(code: u16, reason: &'static str) -> OwnedEvent {
        OwnedEvent::Violation { code, reason }
    }

    fn masked(opcode: u8, payload: &[u8], fin: bool) -> Vec<u8> {
        encode_frame(opcode, payload, fin, Some(MASK))
    }

    /// A header only (no payload), masked, with a 64-bit length.
    fn header64(opcode: u8, len: u64) -> Vec<u8> {
        let mut h = vec![0x80 | opcode, 0x80 | 127];
        h.extend_from_slice(&len.to_be_bytes());
        h.extend_from_slice(&MASK);
        h
    }

    // ---- golden bytes (RFC 6455 section 5.7) ----

    #[test]
    fn golden_unmasked_text() {
        let frame = [0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f];
        assert_eq!(encode_frame(OP_TEXT, b"Hello", true, None), frame);
        assert_eq!(client().feed_owned(&frame), vec![msg(true, b"Hello")]);
    }

    #[test]
    fn golden_masked_text() {
        let frame = [
            0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        assert_eq!(encode_frame(OP_TEXT, b"Hello", true, Some(MASK)), frame);
        assert_eq!(server().feed_owned(&frame), vec![msg(true, b"Hello")]);
    }

    #[test]
    fn golden_fragmented_unmasked_text() {
        let first = [0x01, 0x03, 0x48, 0x65, 0x6c];
        let last = [0x80, 0x02, 0x6c, 0x6f];
        assert_eq!(encode_frame(OP_TEXT, b"Hel", false, None), first);
        assert_eq!(encode_frame(OP_CONTINUATION, b"lo", true, None), last);
        let mut d = client();
        assert_eq!(d.feed_owned(&first), vec![]);
        assert_eq!(d.buffered(), 3);
        assert_eq!(d.feed_owned(&last), vec![msg(true, b"Hello")]);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn golden_ping_and_masked_pong() {
        let ping = [0x89, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f];
        assert_eq!(encode_frame(OP_PING, b"Hello", true, None), ping);
        assert_eq!(
            client().feed_owned(&ping),
            vec![OwnedEvent::Ping(b"Hello".to_vec())]
        );
        let pong = [
            0x8a, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        assert_eq!(encode_frame(OP_PONG, b"Hello", true, Some(MASK)), pong);
        assert_eq!(
            server().feed_owned(&pong),
            vec![OwnedEvent::Pong(b"Hello".to_vec())]
        );
    }

    #[test]
    fn golden_256_byte_binary() {
        let payload = vec![0xab; 256];
        let frame = encode_frame(OP_BINARY, &payload, true, None);
        assert_eq!(frame[..4], [0x82, 0x7e, 0x01, 0x00]);
        assert_eq!(frame.len(), 4 + 256);
        assert_eq!(client().feed_owned(&frame), vec![msg(false, &payload)]);
    }

    #[test]
    fn golden_64k_binary() {
        let payload = vec![0xcd; 65536];
        let frame = encode_frame(OP_BINARY, &payload, true, None);
        assert_eq!(
            frame[..10],
            [0x82, 0x7f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00]
        );
        assert_eq!(frame.len(), 10 + 65536);
        assert_eq!(client().feed_owned(&frame), vec![msg(false, &payload)]);
    }

    #[test]
    fn length_encoding_boundaries() {
        for (len, header) in [(125, 2), (126, 4), (0xFFFF, 4), (0x10000, 10)] {
            assert_eq!(frame_len(len, false), header + len);
            assert_eq!(frame_len(len, true), header + 4 + len);
            let payload = vec![7u8; len];
            let frame = masked(OP_BINARY, &payload, true);
            assert_eq!(frame.len(), header + 4 + len);
            assert_eq!(server().feed_owned(&frame), vec![msg(false, &payload)]);
        }
    }

    #[test]
    fn non_minimal_length_encodings_are_accepted() {
        let mut frame = vec![0x82, 0x80 | 126, 0x00, 0x03];
        frame.extend_from_slice(&MASK);
        frame.extend(b"abc".iter().zip(MASK).map(|(b, m)| b ^ m));
        assert_eq!(server().feed_owned(&frame), vec![msg(false, b"abc")]);
        let mut frame = header64(OP_BINARY, 3);
        frame[0] = 0x82;
        frame.extend(b"abc".iter().zip(MASK).map(|(b, m)| b ^ m));
        assert_eq!(server().feed_owned(&frame), vec![msg(false, b"abc")]);
    }

    // ---- masking ----

    #[test]
    fn mask_functions_match_bytewise_xor() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for len in 0..70 {
            let src: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let expect: Vec<u8> = src
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ MASK[i % 4])
                .collect();
            let mut in_place = src.clone();
            apply_mask(&mut in_place, MASK);
            assert_eq!(in_place, expect, "len {len}");
            let mut copied = vec![0; len];
            copy_masked(&mut copied, &src, MASK);
            assert_eq!(copied, expect, "len {len}");
        }
    }

    #[test]
    fn payload_ranges_unmask_from_any_offset() {
        let plain: Vec<u8> = (0u8..40).collect();
        let mut masked_bytes = plain.clone();
        apply_mask(&mut masked_bytes, MASK);
        for p in [
            Payload::new(&masked_bytes, Some(MASK)),
            Payload::new(&plain, None),
        ] {
            for start in 0..plain.len() {
                for len in [0, 1, 3, 8, 9, plain.len() - start] {
                    let len = len.min(plain.len() - start);
                    let mut out = vec![0; len];
                    p.copy_range_to(start, &mut out);
                    assert_eq!(out, plain[start..start + len], "start {start} len {len}");
                }
            }
            assert_eq!(p.prefix::<4>(), Some([0, 1, 2, 3]));
            assert_eq!(p.prefix::<40>().map(|a| a.to_vec()), Some(plain.clone()));
            assert_eq!(p.prefix::<41>(), None);
        }
    }

    #[test]
    fn masked_utf8_check_spans_chunks() {
        // A 3-byte character straddling every position around the chunk boundary.
        for pad in UTF8_CHUNK - 4..UTF8_CHUNK + 4 {
            let mut text = "a".repeat(pad);
            text.push('€');
            text.push_str("tail");
            let mut bytes = text.clone().into_bytes();
            apply_mask(&mut bytes, MASK);
            assert!(Payload::new(&bytes, Some(MASK)).is_utf8(), "pad {pad}");
            // Cut the character short at the very end: invalid.
            let mut cut = text.as_bytes()[..pad + 2].to_vec();
            apply_mask(&mut cut, MASK);
            assert!(!Payload::new(&cut, Some(MASK)).is_utf8(), "pad {pad}");
        }
        let mut bad = b"ok\xffok".to_vec();
        apply_mask(&mut bad, MASK);
        assert!(!Payload::new(&bad, Some(MASK)).is_utf8());
    }

    // ---- violations, each with its close code ----

    fn assert_violation(d: &mut Decoder, data: &[u8], code: u16, reason: &'static str) {
        assert_eq!(d.feed_owned(data), vec![violation(code, reason)]);
        assert!(d.closed());
        assert_eq!(d.buffered(), 0);
        assert_eq!(d.feed_owned(&masked(OP_BINARY, b"x", true)), vec![]);
    }

    #[test]
    fn server_rejects_unmasked_frame() {
        let frame = encode_frame(OP_BINARY, b"x", true, None);
        assert_violation(&mut server(), &frame, 1002, "unmasked client frame");
    }

    #[test]
    fn client_rejects_masked_frame() {
        let frame = masked(OP_BINARY, b"x", true);
        let mut d = client();
        assert_eq!(
            d.feed_owned(&frame),
            vec![violation(1002, "masked server frame")]
        );
        assert!(d.closed());
    }

    #[test]
    fn reserved_bits_are_rejected() {
        for rsv in [0x40, 0x20, 0x10] {
            let mut frame = masked(OP_BINARY, b"x", true);
            frame[0] |= rsv;
            assert_violation(&mut server(), &frame, 1002, "reserved bits set");
        }
    }

    #[test]
    fn unknown_opcodes_are_rejected() {
        for op in [3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF] {
            let frame = masked(op, b"", true);
            assert_violation(&mut server(), &frame, 1002, "unknown opcode");
        }
    }

    #[test]
    fn fragmented_control_frames_are_rejected() {
        for op in [OP_PING, OP_PONG, OP_CLOSE] {
            let frame = masked(op, b"", false);
            assert_violation(&mut server(), &frame, 1002, "fragmented control frame");
        }
    }

    #[test]
    fn control_frames_over_125_bytes_are_rejected() {
        let ok = masked(OP_PING, &[1; 125], true);
        assert_eq!(
            server().feed_owned(&ok),
            vec![OwnedEvent::Ping(vec![1; 125])]
        );
        for op in [OP_PING, OP_PONG, OP_CLOSE] {
            // Detected from the first two bytes alone.
            let frame = masked(op, &[0; 126], true);
            assert_violation(&mut server(), &frame[..2], 1002, "control frame too long");
        }
    }

    #[test]
    fn continuation_without_a_message_is_rejected() {
        let frame = masked(OP_CONTINUATION, b"x", true);
        assert_violation(&mut server(), &frame, 1002, "unexpected continuation frame");
        let mut d = server();
        let mut data = masked(OP_BINARY, b"done", true);
        data.extend(masked(OP_CONTINUATION, b"x", true));
        assert_eq!(
            d.feed_owned(&data),
            vec![
                msg(false, b"done"),
                violation(1002, "unexpected continuation frame")
            ]
        );
    }

    #[test]
    fn messages_and_bytes_fed_are_counted() {
        let mut d = server();
        let mut data = masked(OP_BINARY, b"one", true);
        data.extend(masked(OP_PING, b"p", true));
        data.extend(masked(OP_TEXT, b"tw", false));
        let split = data.len() - 2;
        d.feed_owned(&data[..split]);
        d.feed_owned(&data[split..]);
        d.feed_owned(&masked(OP_CONTINUATION, b"o", true));
        assert_eq!(
            d.messages(),
            2,
            "a ping is no message, a fragmented one counts once"
        );
        assert_eq!(d.bytes(), data.len() as u64 + 7);
    }

    #[test]
    fn new_message_during_fragmented_one_is_rejected() {
        for op in [OP_TEXT, OP_BINARY] {
            let mut d = server();
            assert_eq!(d.feed_owned(&masked(OP_BINARY, b"a", false)), vec![]);
            let frame = masked(op, b"b", true);
            assert_violation(&mut d, &frame, 1002, "expected continuation frame");
        }
    }

    #[test]
    fn length_with_high_bit_is_rejected() {
        let frame = header64(OP_BINARY, 1 << 63);
        assert_violation(&mut server(), &frame, 1002, "invalid frame length");
    }

    #[test]
    fn close_frame_with_one_byte_is_rejected() {
        let frame = masked(OP_CLOSE, &[0x03], true);
        assert_violation(&mut server(), &frame, 1002, "invalid close frame length");
    }

    #[test]
    fn invalid_close_codes_are_rejected() {
        for code in [
            0, 1, 999, 1004, 1005, 1006, 1015, 1016, 1100, 2000, 2999, 5000, 65535,
        ] {
            let frame = masked(OP_CLOSE, &u16::to_be_bytes(code), true);
            assert_violation(&mut server(), &frame, 1002, "invalid close code");
        }
    }

    #[test]
    fn valid_close_codes_are_accepted() {
        for code in [
            1000u16, 1001, 1002, 1003, 1007, 1010, 1011, 1012, 1013, 1014, 3000, 4999,
        ] {
            let mut body = code.to_be_bytes().to_vec();
            body.extend_from_slice("bye ✓".as_bytes());
            let mut d = server();
            assert_eq!(
                d.feed_owned(&masked(OP_CLOSE, &body, true)),
                vec![OwnedEvent::Close {
                    code: Some(code),
                    reason: "bye ✓".to_owned()
                }]
            );
            assert!(d.closed());
        }
    }

    #[test]
    fn empty_close_has_no_code() {
        assert_eq!(
            server().feed_owned(&masked(OP_CLOSE, b"", true)),
            vec![OwnedEvent::Close {
                code: None,
                reason: String::new()
            }]
        );
    }

    #[test]
    fn close_reason_invalid_utf8_is_1007() {
        let frame = masked(OP_CLOSE, b"\x03\xe8\xff", true);
        assert_violation(&mut server(), &frame, 1007, "invalid utf-8 in close reason");
    }

    #[test]
    fn text_invalid_utf8_is_1007() {
        let frame = masked(OP_TEXT, b"ok\xc3\x28", true);
        assert_violation(&mut server(), &frame, 1007, "invalid utf-8 in text message");
        let mut data = masked(OP_TEXT, b"ok", false);
        data.extend(masked(OP_CONTINUATION, b"\xed\xa0\x80", true)); // a lone surrogate
        assert_violation(&mut server(), &data, 1007, "invalid utf-8 in text message");
        // Binary messages are not checked.
        let frame = masked(OP_BINARY, b"\xff", true);
        assert_eq!(server().feed_owned(&frame), vec![msg(false, b"\xff")]);
    }

    #[test]
    fn text_character_split_across_fragments_is_valid() {
        let euro = "€".as_bytes();
        let mut data = masked(OP_TEXT, &euro[..1], false);
        data.extend(masked(OP_CONTINUATION, &euro[1..2], false));
        data.extend(masked(OP_CONTINUATION, &euro[2..], true));
        assert_eq!(server().feed_owned(&data), vec![msg(true, euro)]);
    }

    #[test]
    fn oversized_frame_is_1009_from_the_header_alone() {
        let mut d = Decoder::new(1000, false);
        let frame = header64(OP_BINARY, 1001);
        assert_violation(&mut d, &frame, 1009, "message too big");
        // 16-bit length too, with no payload byte sent.
        let mut d = Decoder::new(1000, false);
        let frame = masked(OP_BINARY, &[0; 1001], true);
        assert_violation(&mut d, &frame[..8], 1009, "message too big");
        // A header trickled in byte by byte.
        let mut d = Decoder::new(1000, false);
        let mut events = Vec::new();
        for b in header64(OP_BINARY, u64::MAX >> 1) {
            events.extend(d.feed_owned(&[b]));
        }
        assert_eq!(events, vec![violation(1009, "message too big")]);
    }

    #[test]
    fn message_exactly_at_limit_is_accepted() {
        let mut d = Decoder::new(1000, false);
        let mut data = masked(OP_BINARY, &[1; 600], false);
        data.extend(masked(OP_CONTINUATION, &[2; 400], true));
        data.extend(masked(OP_BINARY, &[3; 1000], true));
        let events = d.feed_owned(&data);
        assert_eq!(events.len(), 2);
        assert!(!d.closed());
    }

    #[test]
    fn reassembled_message_over_limit_is_1009() {
        let mut d = Decoder::new(1000, false);
        assert_eq!(d.feed_owned(&masked(OP_BINARY, &[1; 600], false)), vec![]);
        let next = masked(OP_CONTINUATION, &[2; 401], true);
        // Rejected from the continuation's header, before its payload is buffered.
        assert_violation(&mut d, &next[..8], 1009, "message too big");
    }

    #[test]
    fn control_frames_do_not_count_toward_the_limit() {
        let mut d = Decoder::new(10, false);
        let mut data = masked(OP_BINARY, &[1; 10], false);
        data.extend(masked(OP_PING, &[9; 100], true));
        data.extend(masked(OP_CONTINUATION, b"", true));
        assert_eq!(
            d.feed_owned(&data),
            vec![OwnedEvent::Ping(vec![9; 100]), msg(false, &[1; 10])]
        );
    }

    // ---- reassembly, ordering, splitting ----

    #[test]
    fn control_frames_interleave_with_fragments() {
        let mut data = masked(OP_TEXT, b"one ", false);
        data.extend(masked(OP_PING, b"p1", true));
        data.extend(masked(OP_CONTINUATION, b"two ", false));
        data.extend(masked(OP_PONG, b"p2", true));
        data.extend(masked(OP_PING, b"", true));
        data.extend(masked(OP_CONTINUATION, b"three", true));
        data.extend(masked(OP_BINARY, b"next", true));
        assert_eq!(
            server().feed_owned(&data),
            vec![
                OwnedEvent::Ping(b"p1".to_vec()),
                OwnedEvent::Pong(b"p2".to_vec()),
                OwnedEvent::Ping(vec![]),
                msg(true, b"one two three"),
                msg(false, b"next"),
            ]
        );
    }

    #[test]
    fn empty_messages() {
        let mut data = masked(OP_BINARY, b"", true);
        data.extend(masked(OP_TEXT, b"", false));
        data.extend(masked(OP_CONTINUATION, b"", true));
        assert_eq!(
            server().feed_owned(&data),
            vec![msg(false, b""), msg(true, b"")]
        );
    }

    #[test]
    fn nothing_after_close_is_decoded() {
        let mut data = masked(OP_BINARY, b"before", true);
        data.extend(masked(OP_CLOSE, &[0x03, 0xe8], true));
        data.extend(masked(OP_BINARY, b"after", true));
        let mut d = server();
        assert_eq!(
            d.feed_owned(&data),
            vec![
                msg(false, b"before"),
                OwnedEvent::Close {
                    code: Some(1000),
                    reason: String::new()
                }
            ]
        );
        assert_eq!(d.buffered(), 0);
        assert_eq!(d.feed_owned(&masked(OP_BINARY, b"later", true)), vec![]);
    }

    #[test]
    fn events_before_a_violation_are_kept() {
        let mut data = masked(OP_BINARY, b"a", true);
        data.extend(masked(OP_PING, b"b", true));
        data.extend(encode_frame(OP_BINARY, b"unmasked", true, None));
        data.extend(masked(OP_BINARY, b"never", true));
        assert_eq!(
            server().feed_owned(&data),
            vec![
                msg(false, b"a"),
                OwnedEvent::Ping(b"b".to_vec()),
                violation(1002, "unmasked client frame")
            ]
        );
    }

    /// A stream with every frame kind and size class, plus the events it must decode to.
    fn sample_stream() -> (Vec<u8>, Vec<OwnedEvent>) {
        let mut rng = MaskRng::new(&[5; 32]);
        let mut data = Vec::new();
        let mut expect = Vec::new();
        let mut add = |op: u8, payload: &[u8], fin: bool| {
            data.extend(encode_frame(op, payload, fin, Some(rng.next_mask())));
        };
        add(OP_BINARY, b"", true);
        expect.push(msg(false, b""));
        add(OP_TEXT, "héllo".as_bytes(), true);
        expect.push(msg(true, "héllo".as_bytes()));
        let big: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
        add(OP_BINARY, &big, true);
        expect.push(msg(false, &big));
        add(OP_BINARY, &big[..300], false);
        add(OP_PING, b"ping", true);
        expect.push(OwnedEvent::Ping(b"ping".to_vec()));
        add(OP_CONTINUATION, &big[300..1000], true);
        expect.push(msg(false, &big[..1000]));
        add(OP_PONG, &[0xff; 125], true);
        expect.push(OwnedEvent::Pong(vec![0xff; 125]));
        add(OP_CLOSE, &[0x0f, 0xa0, b'o', b'k'], true);
        expect.push(OwnedEvent::Close {
            code: Some(4000),
            reason: "ok".to_owned(),
        });
        (data, expect)
    }

    #[test]
    fn any_two_way_split_gives_the_same_events() {
        let (data, expect) = sample_stream();
        assert_eq!(server().feed_owned(&data), expect);
        // Every cut near a frame boundary or inside a header, plus a stride through payloads.
        for cut in (0..data.len()).filter(|c| c % 97 == 0 || *c < 200 || data.len() - c < 200) {
            let mut d = server();
            let mut events = d.feed_owned(&data[..cut]);
            events.extend(d.feed_owned(&data[cut..]));
            assert_eq!(events, expect, "cut {cut}");
        }
    }

    #[test]
    fn random_chunkings_give_the_same_events() {
        let (data, expect) = sample_stream();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Fewer rounds of the tiny chunk sizes: they cost one feed per byte or two.
        let plan = [
            (1, 2),
            (3, 4),
            (16, 20),
            (200, 40),
            (5000, 60),
            (100_000, 60),
        ];
        for (round, max_chunk) in plan
            .iter()
            .flat_map(|&(size, rounds)| std::iter::repeat_n(size, rounds))
            .enumerate()
        {
            let mut d = server();
            let mut events = Vec::new();
            let mut rest = &data[..];
            while !rest.is_empty() {
                let n = rng.gen_range(0..=max_chunk.min(rest.len()));
                events.extend(d.feed_owned(&rest[..n]));
                rest = &rest[n..];
            }
            assert_eq!(events, expect, "round {round}");
        }
    }

    #[test]
    fn partial_frame_buffer_holds_one_frame_only() {
        let a = masked(OP_BINARY, &[1; 300], true);
        let b = masked(OP_BINARY, &[2; 10], true);
        let mut d = server();
        assert_eq!(d.feed_owned(&a[..100]), vec![]);
        assert_eq!(d.buffered(), 100);
        let mut rest = a[100..].to_vec();
        rest.extend_from_slice(&b[..5]);
        assert_eq!(d.feed_owned(&rest), vec![msg(false, &[1; 300])]);
        assert_eq!(d.buffered(), 5);
        assert_eq!(d.feed_owned(&b[5..]), vec![msg(false, &[2; 10])]);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn garbage_and_mutated_streams_end_in_documented_events() {
        // A poor man's fuzz target: whatever arrives, the decoder never panics, reports only
        // the documented close codes, and reports nothing after a close or violation.
        let (valid, _) = sample_stream();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for round in 0..300 {
            let data: Vec<u8> = if round % 2 == 0 {
                (0..rng.gen_range(0..400)).map(|_| rng.gen()).collect()
            } else {
                let mut d = valid[..rng.gen_range(0..2000)].to_vec();
                for _ in 0..rng.gen_range(1..6) {
                    if !d.is_empty() {
                        let i = rng.gen_range(0..d.len());
                        d[i] ^= 1 << rng.gen_range(0..8);
                    }
                }
                d
            };
            for client_mode in [false, true] {
                let mut d = Decoder::new(4096, client_mode);
                let mut events = Vec::new();
                for chunk in data.chunks(rng.gen_range(1..64)) {
                    events.extend(d.feed_owned(chunk));
                }
                for (i, ev) in events.iter().enumerate() {
                    let last = i + 1 == events.len();
                    match ev {
                        OwnedEvent::Violation { code, .. } => {
                            assert!([1002, 1007, 1009].contains(code));
                            assert!(last && d.closed());
                        }
                        OwnedEvent::Close { .. } => assert!(last && d.closed()),
                        OwnedEvent::Message { data, .. } => assert!(data.len() <= 4096),
                        _ => {}
                    }
                }
                assert!(d.buffered() <= 4096 + MAX_HEADER_LEN + 4096);
            }
        }
    }

    // ---- encoders ----

    #[test]
    fn encode_close_golden_and_checks() {
        assert_eq!(encode_close(1000, "").unwrap(), [0x88, 0x02, 0x03, 0xe8]);
        assert_eq!(
            encode_close(1001, "bye").unwrap(),
            [0x88, 0x05, 0x03, 0xe9, b'b', b'y', b'e']
        );
        for code in [0, 999, 1005, 1006, 1015, 5000] {
            assert!(matches!(
                encode_close(code, ""),
                Err(Error::InvalidArgument(_))
            ));
        }
        // Reasons are cut to 123 bytes without splitting a character.
        let long = "é".repeat(100);
        let frame = encode_close(1000, &long).unwrap();
        assert_eq!(frame[1], 2 + 122);
        let events = client().feed_owned(&frame);
        assert_eq!(
            events,
            vec![OwnedEvent::Close {
                code: Some(1000),
                reason: "é".repeat(61)
            }]
        );
    }

    #[test]
    fn control_payload_limit() {
        assert!(check_control_payload(&[0; 125]).is_ok());
        assert!(check_control_payload(&[0; 126]).is_err());
    }

    #[test]
    fn batch_len_matches_concatenation() {
        let payloads: Vec<Vec<u8>> = [0, 1, 125, 126, 65535, 65536]
            .iter()
            .map(|&n| vec![9u8; n])
            .collect();
        let mut concat = Vec::new();
        for p in &payloads {
            concat.extend(encode_frame(OP_BINARY, p, true, None));
        }
        assert_eq!(
            batch_len(payloads.iter().map(Vec::as_slice), false),
            concat.len()
        );
        let events = client().feed_owned(&concat);
        assert_eq!(events.len(), payloads.len());
    }

    #[test]
    fn mask_rng_is_deterministic_per_seed_and_varied() {
        let mut a = MaskRng::new(&[1; 32]);
        let mut b = MaskRng::new(&[1; 32]);
        let mut c = MaskRng::new(&[2; 32]);
        let xs: Vec<[u8; 4]> = (0..1000).map(|_| a.next_mask()).collect();
        let ys: Vec<[u8; 4]> = (0..1000).map(|_| b.next_mask()).collect();
        let zs: Vec<[u8; 4]> = (0..1000).map(|_| c.next_mask()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
        let distinct: std::collections::HashSet<_> = xs.iter().collect();
        assert!(distinct.len() > 990);
        // An all-zero seed still gives a working generator.
        let mut z = MaskRng::new(&[0; 32]);
        assert_ne!(z.next_u64(), z.next_u64());
    }

    #[test]
    fn close_code_validity_table() {
        let valid: Vec<u16> = (0..=u16::MAX).filter(|&c| is_valid_close_code(c)).collect();
        assert_eq!(valid.len(), 4 + 8 + 2000);
        assert!(!is_valid_close_code(1015));
        assert!(is_valid_close_code(1014));
    }
}

pub mod py {
    use super::{
        batch_len, check_control_payload, close_payload, frame_len, write_frame, Decoder, Event,
        MaskRng, Payload, DEFAULT_MAX_MESSAGE, MASK_SEED_LEN, OP_BINARY, OP_CLOSE, OP_PING,
        OP_PONG, OP_TEXT,
    };
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::ScanFeed;
    use crate::error::Error;
    use pyo3::buffer::PyBuffer;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList};

    /// Bytes read from a socket: a `bytes` object, or any C-contiguous buffer (a memoryview of
    /// the reusable read buffer a client's `get_buffer` hands out: no `bytes` per read).
    pub(crate) enum ReadBytes<'py> {
        Bytes(Bound<'py, PyBytes>),
        Buffer(PyBuffer<u8>),
    }

    impl<'py> FromPyObject<'py> for ReadBytes<'py> {
        fn extract_bound(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
            if let Ok(bytes) = obj.downcast::<PyBytes>() {
                return Ok(ReadBytes::Bytes(bytes.clone()));
            }
            let buffer = PyBuffer::<u8>::get(obj)?;
            if !buffer.is_c_contiguous() {
                return Err(
                    Error::InvalidArgument("a read must be contiguous bytes".into()).into(),
                );
            }
            Ok(ReadBytes::Buffer(buffer))
        }
    }

    impl ReadBytes<'_> {
        pub(crate) fn as_slice(&self) -> &[u8] {
            match self {
                ReadBytes::Bytes(bytes) => bytes.as_bytes(),
                // SAFETY: a C-contiguous buffer of `len_bytes` bytes at `buf_ptr`, held (and so
                // neither freed nor resized) while `self` lives; the decoder copies what it
                // keeps, and nothing writes the buffer during the call that reads it
                ReadBytes::Buffer(buffer) => unsafe {
                    std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes())
                },
            }
        }
    }

    /// A complete (reassembled) data message.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct WsMessage {
        #[pyo3(get)]
        is_text: bool,
        /// the message as the dialect passes it on (rewritten by its scanner, if it does)
        #[pyo3(get)]
        data: Py<PyBytes>,
        /// with a scanner: what it made of the message (its routing object), in the same call
        /// that decoded it (one call into Rust per read)
        #[pyo3(get)]
        routing: Option<Py<PyAny>>,
        /// with a scanner: why the message has no routing (not an envelope, too short)
        #[pyo3(get)]
        scan_error: Option<String>,
    }

    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct WsPing {
        #[pyo3(get)]
        data: Py<PyBytes>,
    }

    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct WsPong {
        #[pyo3(get)]
        data: Py<PyBytes>,
    }

    /// The peer's close frame; code None when the frame had no body.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct WsClose {
        #[pyo3(get)]
        code: Option<u16>,
        #[pyo3(get)]
        reason: String,
    }

    /// The peer broke RFC 6455 (or a limit); answer with close(code) and drop the connection.
    #[pyclass(frozen, module = "rmb_relay._core")]
    pub struct WsViolation {
        #[pyo3(get)]
        code: u16,
        #[pyo3(get)]
        reason: String,
    }

    #[pymethods]
    impl WsMessage {
        fn __repr__(&self, py: Python<'_>) -> String {
            let n = self.data.bind(py).as_bytes().len();
            format!("WsMessage(is_text={}, len={n})", self.is_text)
        }
    }

    #[pymethods]
    impl WsPing {
        fn __repr__(&self, py: Python<'_>) -> String {
            format!("WsPing(len={})", self.data.bind(py).as_bytes().len())
        }
    }

    #[pymethods]
    impl WsPong {
        fn __repr__(&self, py: Python<'_>) -> String {
            format!("WsPong(len={})", self.data.bind(py).as_bytes().len())
        }
    }

    #[pymethods]
    impl WsClose {
        fn __repr__(&self) -> String {
            format!("WsClose(code={:?}, reason={:?})", self.code, self.reason)
        }
    }

    #[pymethods]
    impl WsViolation {
        fn __repr__(&self) -> String {
            format!("WsViolation(code={}, reason={:?})", self.code, self.reason)
        }
    }

    /// The unmasked payload as new `bytes`, copied (and unmasked) exactly once.
    pub(crate) fn payload_bytes(py: Python<'_>, p: Payload<'_>) -> PyResult<Py<PyBytes>> {
        let bytes = match p.as_unmasked() {
            Some(b) => PyBytes::new(py, b),
            None => PyBytes::new_with(py, p.len(), |out| {
                p.copy_to(out);
                Ok(())
            })?,
        };
        Ok(bytes.unbind())
    }

    /// A data message event for Python: `data` as the dialect passes it on, with what its
    /// scanner made of it (`routing`) or why it made nothing (`scan_error`). Scanners build
    /// the events they make themselves (`ScanFeed::take_made`) with it too.
    pub fn message_event(
        py: Python<'_>,
        is_text: bool,
        data: Py<PyBytes>,
        routing: Option<Py<PyAny>>,
        scan_error: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        Ok(Py::new(
            py,
            WsMessage {
                is_text,
                data,
                routing,
                scan_error,
            },
        )?
        .into_any())
    }

    /// The event for Python; None for a message the scanner's fast path forwarded itself.
    /// `fast` goes false once a message of this read goes to Python (codec/scanner.rs).
    pub(crate) fn event_to_py(
        py: Python<'_>,
        ev: Event<'_>,
        feed: Option<&mut (dyn ScanFeed + '_)>,
        fast: &mut bool,
        now: u64,
    ) -> PyResult<Option<Py<PyAny>>> {
        Ok(Some(match ev {
            Event::Message { is_text, payload } => {
                let scanned = match feed {
                    Some(feed) => feed.message(py, is_text, payload, now, *fast)?,
                    None => Some((payload_bytes(py, payload)?, None, None)),
                };
                let Some((data, routing, scan_error)) = scanned else {
                    return Ok(None);
                };
                *fast = false;
                message_event(py, is_text, data, routing, scan_error)?
            }
            Event::Ping(p) => Py::new(
                py,
                WsPing {
                    data: payload_bytes(py, p)?,
                },
            )?
            .into_any(),
            Event::Pong(p) => Py::new(
                py,
                WsPong {
                    data: payload_bytes(py, p)?,
                },
            )?
            .into_any(),
            Event::Close { code, reason } => Py::new(
                py,
                WsClose {
                    code,
                    reason: reason.to_owned(),
                },
            )?
            .into_any(),
            Event::Violation { code, reason } => Py::new(
                py,
                WsViolation {
                    code,
                    reason: reason.to_owned(),
                },
            )?
            .into_any(),
        }))
    }

    /// Incremental RFC 6455 decoder (server mode by default), with an optional scanner that
    /// reads each data message's routing in the same call (codec/scanner.rs).
    #[pyclass(module = "rmb_relay._core")]
    pub struct WsDecoder {
        /// borrowed by Rust callers that decode a client's frames themselves
        pub(crate) inner: Decoder,
        scanner: Option<Py<Scanner>>,
    }

    #[pymethods]
    impl WsDecoder {
        #[new]
        #[pyo3(signature = (*, max_message = 1048576, client_mode = false, scanner = None))]
        fn new(max_message: usize, client_mode: bool, scanner: Option<Py<Scanner>>) -> Self {
            WsDecoder {
                inner: Decoder::new(max_message, client_mode),
                scanner,
            }
        }

        /// Scan the messages of later feeds with `scanner` (None: no scanning).
        #[pyo3(signature = (scanner))]
        fn set_scanner(&mut self, scanner: Option<Py<Scanner>>) {
            self.scanner = scanner;
        }

        #[getter]
        fn scanner(&self, py: Python<'_>) -> Option<Py<Scanner>> {
            self.scanner.as_ref().map(|s| s.clone_ref(py))
        }

        /// Decode `data`; `now` (the caller's clock, nanoseconds) goes to the scanner.
        #[pyo3(signature = (data, now = 0))]
        fn feed<'py>(
            &mut self,
            py: Python<'py>,
            data: ReadBytes<'py>,
            now: u64,
        ) -> PyResult<Bound<'py, PyList>> {
            let data = data.as_slice();
            let mut events = Vec::new();
            let scanner = self.scanner.as_ref().map(|s| s.bind(py).clone());
            let mut feed = match &scanner {
                Some(scanner) => Some(Scanner::start(scanner)?),
                None => None,
            };
            let mut fast = true;
            self.inner.feed(data, |ev| {
                let event = event_to_py(py, ev, feed.as_deref_mut(), &mut fast, now)?;
                if let Some(event) = event {
                    // what the scanner made from messages it took before this event goes first
                    if let Some(made) = feed.as_deref_mut().map(|f| f.take_made(py)).transpose()? {
                        events.extend(made);
                    }
                    events.push(event);
                }
                Ok::<(), PyErr>(())
            })?;
            if let Some(made) = feed.as_deref_mut().map(|f| f.take_made(py)).transpose()? {
                events.extend(made);
            }
            drop(feed);
            PyList::new(py, events)
        }

        #[getter]
        fn buffered(&self) -> usize {
            self.inner.buffered()
        }

        #[getter]
        fn closed(&self) -> bool {
            self.inner.closed()
        }

        /// Data messages decoded so far (the fast path's forwards included).
        #[getter]
        fn messages_in(&self) -> u64 {
            self.inner.messages()
        }

        /// Bytes fed so far.
        #[getter]
        fn bytes_in(&self) -> u64 {
            self.inner.bytes()
        }
    }

    fn parse_mask(mask: Option<&[u8]>) -> PyResult<Option<[u8; 4]>> {
        match mask {
            None => Ok(None),
            Some(m) => Ok(Some(m.try_into().map_err(|_| {
                Error::InvalidArgument(format!("mask must be 4 bytes, got {}", m.len()))
            })?)),
        }
    }

    /// One frame of `payload` in a new bytes object, built in place.
    fn frame_bytes<'py>(
        py: Python<'py>,
        opcode: u8,
        payload: &[u8],
        mask: Option<[u8; 4]>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        PyBytes::new_with(py, frame_len(payload.len(), mask.is_some()), |out| {
            write_frame(out, opcode, true, payload, mask);
            Ok(())
        })
    }

    /// Binary frames for every payload in one bytes object: sized first, allocated once.
    fn batch_bytes<'py>(
        py: Python<'py>,
        payloads: &[Bound<'py, PyBytes>],
        mut next_mask: impl FnMut() -> Option<[u8; 4]>,
        masked: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let total = batch_len(payloads.iter().map(|p| p.as_bytes()), masked);
        PyBytes::new_with(py, total, |out| {
            let mut at = 0;
            for p in payloads {
                at += write_frame(&mut out[at..], OP_BINARY, true, p.as_bytes(), next_mask());
            }
            Ok(())
        })
    }

    #[pyfunction]
    #[pyo3(signature = (opcode, payload, *, fin = true, mask = None))]
    fn encode_frame<'py>(
        py: Python<'py>,
        opcode: u32,
        payload: &[u8],
        fin: bool,
        mask: Option<&[u8]>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let opcode = u8::try_from(opcode)
            .ok()
            .filter(|op| *op <= 0x0f)
            .ok_or_else(|| Error::InvalidArgument(format!("opcode {opcode} is not 4 bits")))?;
        let mask = parse_mask(mask)?;
        PyBytes::new_with(py, frame_len(payload.len(), mask.is_some()), |out| {
            write_frame(out, opcode, fin, payload, mask);
            Ok(())
        })
    }

    #[pyfunction]
    fn encode_binary<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        frame_bytes(py, OP_BINARY, payload, None)
    }

    #[pyfunction]
    fn encode_binary_batch<'py>(
        py: Python<'py>,
        payloads: Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        batch_bytes(py, &payloads, || None, false)
    }

    fn close_code(code: u32) -> PyResult<u16> {
        Ok(u16::try_from(code)
            .map_err(|_| Error::InvalidArgument(format!("close code {code} may not be sent")))?)
    }

    #[pyfunction]
    #[pyo3(signature = (code, reason = ""))]
    fn encode_close<'py>(
        py: Python<'py>,
        code: u32,
        reason: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (body, n) = close_payload(close_code(code)?, reason)?;
        frame_bytes(py, OP_CLOSE, &body[..n], None)
    }

    /// Masked client frames, masks from a PRNG seeded by the caller (os.urandom(32)).
    #[pyclass(module = "rmb_relay._core")]
    pub struct ClientFrameEncoder {
        rng: MaskRng,
    }

    #[pymethods]
    impl ClientFrameEncoder {
        #[new]
        fn new(seed: &[u8]) -> PyResult<Self> {
            let seed: &[u8; MASK_SEED_LEN] = seed.try_into().map_err(|_| {
                Error::InvalidArgument(format!(
                    "seed must be {MASK_SEED_LEN} bytes (os.urandom({MASK_SEED_LEN})), got {}",
                    seed.len()
                ))
            })?;
            Ok(ClientFrameEncoder {
                rng: MaskRng::new(seed),
            })
        }

        fn binary<'py>(
            &mut self,
            py: Python<'py>,
            payload: &[u8],
        ) -> PyResult<Bound<'py, PyBytes>> {
            frame_bytes(py, OP_BINARY, payload, Some(self.rng.next_mask()))
        }

        fn binary_batch<'py>(
            &mut self,
            py: Python<'py>,
            payloads: Vec<Bound<'py, PyBytes>>,
        ) -> PyResult<Bound<'py, PyBytes>> {
            let rng = &mut self.rng;
            batch_bytes(py, &payloads, || Some(rng.next_mask()), true)
        }

        fn text<'py>(&mut self, py: Python<'py>, payload: &str) -> PyResult<Bound<'py, PyBytes>> {
            frame_bytes(py, OP_TEXT, payload.as_bytes(), Some(self.rng.next_mask()))
        }

        #[pyo3(signature = (payload = b"".as_slice()), text_signature = "($self, payload=b'')")]
        fn ping<'py>(&mut self, py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
            check_control_payload(payload)?;
            frame_bytes(py, OP_PING, payload, Some(self.rng.next_mask()))
        }

        #[pyo3(signature = (payload = b"".as_slice()), text_signature = "($self, payload=b'')")]
        fn pong<'py>(&mut self, py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
            check_control_payload(payload)?;
            frame_bytes(py, OP_PONG, payload, Some(self.rng.next_mask()))
        }

        #[pyo3(signature = (code = 1000, reason = ""))]
        fn close<'py>(
            &mut self,
            py: Python<'py>,
            code: u32,
            reason: &str,
        ) -> PyResult<Bound<'py, PyBytes>> {
            let (body, n) = close_payload(close_code(code)?, reason)?;
            frame_bytes(py, OP_CLOSE, &body[..n], Some(self.rng.next_mask()))
        }
    }

    // Python signatures spell defaults as literals (so `inspect.signature` and stubtest see
    // them; PyO3 renders a bytes default as `...`, hence the explicit text signatures); these keep the literals equal to the named constants.
    const _: () = assert!(DEFAULT_MAX_MESSAGE == 1048576);
    const _: () = assert!(super::CLOSE_NORMAL == 1000);

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("OP_CONTINUATION", super::OP_CONTINUATION)?;
        m.add("OP_TEXT", OP_TEXT)?;
        m.add("OP_BINARY", OP_BINARY)?;
        m.add("OP_CLOSE", OP_CLOSE)?;
        m.add("OP_PING", OP_PING)?;
        m.add("OP_PONG", OP_PONG)?;
        m.add_class::<WsMessage>()?;
        m.add_class::<WsPing>()?;
        m.add_class::<WsPong>()?;
        m.add_class::<WsClose>()?;
        m.add_class::<WsViolation>()?;
        m.add_class::<WsDecoder>()?;
        m.add_class::<ClientFrameEncoder>()?;
        // The stub's `WsEvent` alias, real at runtime so `isinstance(ev, WsEvent)` works.
        let py = m.py();
        let mut event_union = py.get_type::<WsMessage>().into_any();
        for t in [
            py.get_type::<WsPing>(),
            py.get_type::<WsPong>(),
            py.get_type::<WsClose>(),
            py.get_type::<WsViolation>(),
        ] {
            event_union = event_union.call_method1("__or__", (t,))?;
        }
        m.add("WsEvent", event_union)?;
        m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
        m.add_function(wrap_pyfunction!(encode_binary, m)?)?;
        m.add_function(wrap_pyfunction!(encode_binary_batch, m)?)?;
        m.add_function(wrap_pyfunction!(encode_close, m)?)?;
        Ok(())
    }
}
