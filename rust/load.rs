//! The load harness's per-message work (`rmb-load`), so that the generator costs less per
//! message than the relay it measures.
//!
//! Python paces the streams and owns the sockets; what it did per message moves here:
//! - [`StampedBatch`]: a send batch's bytes, every message its stream's template with the
//!   16-byte stamp (sequence number, send time) written in, framed and masked as a client must:
//!   one call and one `transport.write` per batch;
//! - [`stamp_of`]: where a received message carries its stamp (the tail of an RMB envelope's
//!   payload, behind an SBD forward's header), read while the websocket decoder still holds the
//!   bytes (`py::StampScanner`, a `codec/scanner.rs` scanner): one call per `data_received`
//!   decodes every frame of the read and records every latency in it;
//! - [`Recorder`]: the one latency recorder of every generator (deliveries per stream,
//!   duplicates, the latencies, the per-second timeline, the samples); generators that read
//!   their stamps in Python (신경, tunnel, peer) record through the same object;
//! - [`percentiles`]: the one percentile rule of the summary (nearest rank).
//!
//! Sans-I/O like the rest of the crate: the caller passes the clock readings in.

use crate::codec::mask::Payload;
use crate::codec::ws::{frame_len, write_frame, MaskRng, OP_BINARY, OP_TEXT};
use crate::crypto::{SigningKey, PREFIXED_SIGNATURE_LEN};
use crate::dialects::sbd::header::{parse_header, Header, HEADER_LEN};
use md5::{Digest, Md5};

/// sequence number then send time (ns), little-endian, as the Python generators write them
pub const STAMP_LEN: usize = 16;
/// a stream's duplicate check keeps one bit per sequence number up to this: a stamp beyond it
/// (which no run of ours reaches: 2^30 messages on one stream) is counted, not tracked, so a
/// relay answering garbage cannot make the generator allocate without bound
pub const MAX_TRACKED_SEQ: u64 = 1 << 30;
/// seconds the per-second timeline keeps (a later second is not counted in it)
pub const MAX_TIMELINE_SECONDS: usize = 1 << 20;

/// Write a stamp into the first 16 bytes of `out`.
pub fn write_stamp(out: &mut [u8], seq: u64, sent_ns: i64) {
    out[..8].copy_from_slice(&seq.to_le_bytes());
    out[8..STAMP_LEN].copy_from_slice(&sent_ns.to_le_bytes());
}

/// The stamp at byte `at` of a (possibly still masked) payload.
pub fn read_stamp(payload: Payload<'_>, at: usize) -> Option<(u64, i64)> {
    if payload.len() < at + STAMP_LEN {
        return None;
    }
    let mut stamp = [0u8; STAMP_LEN];
    payload.copy_range_to(at, &mut stamp);
    let (seq, sent) = stamp.split_at(8);
    Some((
        u64::from_le_bytes(seq.try_into().expect("8 bytes")),
        i64::from_le_bytes(sent.try_into().expect("8 bytes")),
    ))
}

/// Where a dialect's messages carry the stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampAt {
    /// RMB: the envelope's payload (`size` bytes, stamp first) is its last field on the wire
    PayloadTail { size: usize },
    /// SBD: right behind the 32-byte header of a forward (commands carry none)
    SbdForward,
    /// 신경: a DISPATCH's `payload` string opens with the ASCII stamp (stream, sequence
    /// number, send time: [`SG_STAMP_WIDTH`] digits); `json` or msgpack
    SingyeongDispatch { json: bool },
}

/// A received message's stamp; `stream` only where the message names it (신경: one
/// receiver gets the messages of every sender stream of its process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub stream: Option<u32>,
    pub seq: u64,
    pub sent_ns: i64,
}

/// 신경 stamps: stream index (6 digits), sequence number (12), send time ns (20), as
/// [`write_sg_stamp`] writes them
pub const SG_STAMP_WIDTH: usize = 38;
const SG_JSON_KEY: &[u8] = b"\"payload\"";
/// the msgpack fixstr key `payload`
const SG_MSGPACK_KEY: &[u8] = b"\xa7payload";

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn digits(text: &[u8]) -> Option<u128> {
    text.iter().try_fold(0u128, |n, &c| {
        c.is_ascii_digit().then(|| n * 10 + u128::from(c - b'0'))
    })
}

/// The stamp opening the `payload` string of a 신경 DISPATCH: in JSON behind the value's
/// opening quote (a gateway may write `"payload": "..."`), in msgpack behind the str header
/// after the key (fixstr, str8, str16 or str32). None for a frame without one (a heartbeat
/// ack, a payload that is not our digits).
pub fn singyeong_stamp(json: bool, body: &[u8]) -> Option<Stamp> {
    let start = if json {
        let at = find(body, SG_JSON_KEY)? + SG_JSON_KEY.len();
        at + body.get(at..)?.iter().position(|&c| c == b'"')? + 1
    } else {
        let at = find(body, SG_MSGPACK_KEY)? + SG_MSGPACK_KEY.len();
        let header = match *body.get(at)? {
            0xD9 => 2,
            0xDA => 3,
            0xDB => 5,
            _ => 1, // a fixstr's header is one byte
        };
        at + header
    };
    let text = body.get(start..start + SG_STAMP_WIDTH)?;
    Some(Stamp {
        stream: u32::try_from(digits(&text[..6])?).ok(),
        seq: u64::try_from(digits(&text[6..18])?).ok()?,
        sent_ns: i64::try_from(digits(&text[18..])?).ok()?,
    })
}

/// Which of a process's streams a stamped delivery belongs to, and as which copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamOf {
    /// every stamped message of this connection is of one stream (RMB, SBD: a pair's receiver)
    One(u32),
    /// the stamp names the stream; `fanouts` (stream index, copies each message is delivered
    /// as) are this process's streams, `receiver` this connection's index among its receivers
    ByStamp {
        fanouts: Vec<(u32, u32)>,
        receiver: u32,
    },
}

impl StreamOf {
    /// (stream, copy) of a delivery, None for a stream not of this process. Each receiver
    /// sees each broadcast once: its copy is the receiver's; a message delivered once has
    /// copy 0.
    pub fn route(&self, stamp: &Stamp) -> Option<(u32, u32)> {
        match self {
            StreamOf::One(stream) => Some((*stream, 0)),
            StreamOf::ByStamp { fanouts, receiver } => {
                let stream = stamp.stream?;
                let &(_, fanout) = fanouts.iter().find(|(s, _)| *s == stream)?;
                Some((stream, if fanout > 1 { *receiver } else { 0 }))
            }
        }
    }
}

/// The stamp of a received message, None when it carries none (an error envelope, an SBD
/// command, a message too short).
pub fn stamp_of(at: StampAt, payload: Payload<'_>) -> Option<Stamp> {
    let binary = |(seq, sent_ns)| Stamp {
        stream: None,
        seq,
        sent_ns,
    };
    match at {
        StampAt::PayloadTail { size } => {
            let start = payload.len().checked_sub(size)?;
            read_stamp(payload, start).map(binary)
        }
        StampAt::SbdForward => match parse_header(&payload.prefix::<HEADER_LEN>()?) {
            Header::Command(_) => None,
            Header::Forward(_) => read_stamp(payload, HEADER_LEN).map(binary),
        },
        StampAt::SingyeongDispatch { json } => match payload.as_unmasked() {
            Some(body) => singyeong_stamp(json, body),
            None => singyeong_stamp(json, &payload.to_vec()),
        },
    }
}

/// A stream's messages as masked binary frames: its template with the stamp written at
/// `stamp_at`, one frame per message, all in one buffer.
#[derive(Debug, Clone)]
pub struct StampedBatch {
    template: Vec<u8>,
    stamp_at: usize,
    rng: MaskRng,
    signer: Option<Signer>,
}

/// Signs each stamped message (RMB federation: the receiving relay checks the signature, and
/// the stamp is in the signed payload). The challenge is MD5 of `before` + the payload (the
/// template from the stamp on) + `after` (spec/rmb.md §2.1; the SDK's `challenge_around_payload`
/// says which fields those are); the signature goes at `sig_at`, prefixed with its key type.
#[derive(Clone)]
pub struct Signer {
    key: SigningKey,
    before: Md5,
    after: Vec<u8>,
    sig_at: usize,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("sig_at", &self.sig_at)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// None when the signature at `sig_at` would not lie in the template before the stamp.
    pub fn new(
        key: SigningKey,
        before: &[u8],
        after: Vec<u8>,
        sig_at: usize,
        stamp_at: usize,
    ) -> Option<Self> {
        (sig_at + PREFIXED_SIGNATURE_LEN <= stamp_at).then(|| {
            let mut md5 = Md5::new();
            md5.update(before);
            Signer {
                key,
                before: md5,
                after,
                sig_at,
            }
        })
    }

    fn sign(&self, template: &mut [u8], stamp_at: usize) {
        let mut md5 = self.before.clone();
        md5.update(&template[stamp_at..]);
        md5.update(&self.after);
        let digest: [u8; 16] = md5.finalize().into();
        let sig = self.key.sign_prefixed(&digest);
        template[self.sig_at..self.sig_at + PREFIXED_SIGNATURE_LEN].copy_from_slice(&sig);
    }
}

impl StampedBatch {
    /// None when the template has no room for a stamp at `stamp_at`.
    pub fn new(template: Vec<u8>, stamp_at: usize, rng: MaskRng) -> Option<Self> {
        (stamp_at + STAMP_LEN <= template.len()).then_some(StampedBatch {
            template,
            stamp_at,
            rng,
            signer: None,
        })
    }

    /// Sign every message from now on.
    pub fn sign_with(&mut self, signer: Signer) {
        self.signer = Some(signer);
    }

    pub fn stamp_at(&self) -> usize {
        self.stamp_at
    }

    /// Bytes of `n` frames.
    pub fn batch_len(&self, n: usize) -> usize {
        n * frame_len(self.template.len(), true)
    }

    /// Messages `first_seq..first_seq + n` sent at `sent_ns`, framed into `out` (exactly
    /// `batch_len(n)` bytes).
    pub fn write(&mut self, out: &mut [u8], first_seq: u64, n: usize, sent_ns: i64) {
        let mut at = 0;
        for i in 0..n as u64 {
            write_stamp(&mut self.template[self.stamp_at..], first_seq + i, sent_ns);
            if let Some(signer) = &self.signer {
                signer.sign(&mut self.template, self.stamp_at);
            }
            let mask = self.rng.next_mask();
            at += write_frame(&mut out[at..], OP_BINARY, true, &self.template, Some(mask));
        }
        debug_assert_eq!(at, out.len());
    }
}

/// The largest stream index and sequence number a 신경 stamp's 6 and 12 digits hold.
pub const SG_MAX_STREAM: u32 = 999_999;
pub const SG_MAX_SEQ: u64 = 999_999_999_999;

/// Write a 신경 stamp (`SG_STAMP_WIDTH` ASCII digits) into `out`: stream, sequence number and
/// send time zero-padded; the caller keeps them in range.
pub fn write_sg_stamp(out: &mut [u8], stream: u32, seq: u64, sent_ns: i64) {
    fn digits(out: &mut [u8], mut n: u64) {
        for d in out.iter_mut().rev() {
            *d = b'0' + (n % 10) as u8;
            n /= 10;
        }
    }
    digits(&mut out[..6], u64::from(stream));
    digits(&mut out[6..18], seq);
    digits(&mut out[18..SG_STAMP_WIDTH], sent_ns.max(0) as u64);
}

/// A 신경 sender stream's messages: message i is template `i % templates` (the frame's bytes
/// before and after its payload string), the payload the stamp then `padding` bytes of `#`,
/// each a masked text (JSON) or binary (msgpack) frame, all in one buffer.
#[derive(Debug, Clone)]
pub struct SgBatch {
    templates: Vec<(Vec<u8>, Vec<u8>)>,
    padding: usize,
    stream: u32,
    opcode: u8,
    rng: MaskRng,
    message: Vec<u8>,
}

impl SgBatch {
    /// None without templates or with a stream index beyond six digits.
    pub fn new(
        templates: Vec<(Vec<u8>, Vec<u8>)>,
        padding: usize,
        stream: u32,
        text: bool,
        rng: MaskRng,
    ) -> Option<Self> {
        (!templates.is_empty() && stream <= SG_MAX_STREAM).then_some(SgBatch {
            templates,
            padding,
            stream,
            opcode: if text { OP_TEXT } else { OP_BINARY },
            rng,
            message: Vec::new(),
        })
    }

    fn template(&self, seq: u64) -> &(Vec<u8>, Vec<u8>) {
        &self.templates[(seq % self.templates.len() as u64) as usize]
    }

    fn message_len(&self, seq: u64) -> usize {
        let (before, after) = self.template(seq);
        before.len() + SG_STAMP_WIDTH + self.padding + after.len()
    }

    /// Bytes of the frames of messages `first_seq..first_seq + n`.
    pub fn batch_len(&self, first_seq: u64, n: usize) -> usize {
        (first_seq..first_seq + n as u64)
            .map(|seq| frame_len(self.message_len(seq), true))
            .sum()
    }

    /// Messages `first_seq..first_seq + n` sent at `sent_ns`, framed into `out` (exactly
    /// `batch_len(first_seq, n)` bytes); None when a sequence number passes 12 digits.
    pub fn write(&mut self, out: &mut [u8], first_seq: u64, n: usize, sent_ns: i64) -> Option<()> {
        if first_seq + n as u64 > SG_MAX_SEQ + 1 {
            return None;
        }
        let mut at = 0;
        let mut message = std::mem::take(&mut self.message);
        for seq in first_seq..first_seq + n as u64 {
            let (before, after) = self.template(seq);
            message.clear();
            message.extend_from_slice(before);
            let stamp_at = message.len();
            message.resize(stamp_at + SG_STAMP_WIDTH, 0);
            write_sg_stamp(&mut message[stamp_at..], self.stream, seq, sent_ns);
            message.resize(message.len() + self.padding, b'#');
            message.extend_from_slice(after);
            let mask = self.rng.next_mask();
            at += write_frame(&mut out[at..], self.opcode, true, &message, Some(mask));
        }
        self.message = message;
        debug_assert_eq!(at, out.len());
        Some(())
    }
}

/// What recording one delivery found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Delivered,
    /// a second copy of a (stream, copy, seq) already recorded
    Duplicate,
    /// a sequence number beyond [`MAX_TRACKED_SEQ`]: not a message of ours
    OutOfRange,
}

/// Every delivery of one generator process: counts per stream, duplicates, and with the run's
/// measuring window open, the latency, bytes and second of each (and its sample row).
#[derive(Debug, Default)]
pub struct Recorder {
    /// deliveries per stream index (fan-out copies one each), measuring or not
    delivered: Vec<u64>,
    /// one bit per sequence number seen, per stream and copy (`seen[stream][copy]`): a
    /// BROADCAST's receivers each see each message once (indexed, not hashed: it is looked up
    /// for every delivery)
    seen: Vec<Vec<Vec<u64>>>,
    measuring: bool,
    started_ns: i64,
    pub measured: u64,
    pub bytes_delivered: u64,
    pub duplicated: u64,
    pub out_of_range: u64,
    pub latencies_ns: Vec<i64>,
    /// deliveries per second since the measuring window opened
    pub timeline: Vec<u64>,
    /// (send time, stream, latency) triples, when kept
    pub samples: Option<Vec<i64>>,
}

impl Recorder {
    pub fn new(keep_samples: bool) -> Self {
        Recorder {
            samples: keep_samples.then(Vec::new),
            ..Recorder::default()
        }
    }

    /// Open the measuring window at `now_ns` (the timeline's second 0).
    pub fn start_measuring(&mut self, now_ns: i64) {
        self.measuring = true;
        self.started_ns = now_ns;
    }

    pub fn stop_measuring(&mut self) {
        self.measuring = false;
    }

    pub fn delivered(&self, stream: u32) -> u64 {
        self.delivered.get(stream as usize).copied().unwrap_or(0)
    }

    /// False when (stream, copy, seq) was seen before (or is out of range).
    fn first_time(&mut self, stream: u32, copy: u32, seq: u64) -> Recorded {
        if seq >= MAX_TRACKED_SEQ {
            self.out_of_range += 1;
            return Recorded::OutOfRange;
        }
        let (stream, copy) = (stream as usize, copy as usize);
        if stream >= self.seen.len() {
            self.seen.resize_with(stream + 1, Vec::new);
        }
        let copies = &mut self.seen[stream];
        if copy >= copies.len() {
            copies.resize_with(copy + 1, Vec::new);
        }
        let bits = &mut copies[copy];
        let (word, bit) = ((seq / 64) as usize, 1u64 << (seq % 64));
        if word >= bits.len() {
            let grown = (word + 1).max(bits.len() * 2);
            bits.resize(grown, 0);
        }
        if bits[word] & bit != 0 {
            self.duplicated += 1;
            return Recorded::Duplicate;
        }
        bits[word] |= bit;
        Recorded::Delivered
    }

    /// One delivery (or one fan-out copy) of `size` bytes arrived at `now_ns`, sent at
    /// `sent_ns`; `seq` None: a message that cannot arrive twice (an HTTP response).
    pub fn record(
        &mut self,
        stream: u32,
        copy: u32,
        seq: Option<u64>,
        sent_ns: i64,
        now_ns: i64,
        size: u64,
    ) -> Recorded {
        if let Some(seq) = seq {
            let first = self.first_time(stream, copy, seq);
            if first != Recorded::Delivered {
                return first;
            }
        }
        let index = stream as usize;
        if index >= self.delivered.len() {
            self.delivered.resize(index + 1, 0);
        }
        self.delivered[index] += 1;
        if self.measuring {
            self.measured += 1;
            self.bytes_delivered += size;
            let latency = now_ns - sent_ns;
            self.latencies_ns.push(latency);
            let second = (now_ns - self.started_ns).max(0) / 1_000_000_000;
            let second = second as usize;
            if second < MAX_TIMELINE_SECONDS {
                if second >= self.timeline.len() {
                    self.timeline.resize(second + 1, 0);
                }
                self.timeline[second] += 1;
            }
            if let Some(samples) = self.samples.as_mut() {
                samples.extend([sent_ns, i64::from(stream), latency]);
            }
        }
        Recorded::Delivered
    }
}

/// Nearest-rank percentiles of `samples` (sorted in place) at `points` (0..100), then the
/// maximum; zeros when there are none. The rank of p is round(p/100 * n + 0.5) - 1, ties to
/// even, clamped to the samples.
pub fn percentiles(samples: &mut [i64], points: &[f64]) -> Vec<i64> {
    let n = samples.len();
    if n == 0 {
        return vec![0; points.len() + 1];
    }
    samples.sort_unstable();
    let mut out: Vec<i64> = points
        .iter()
        .map(|p| {
            let rank = (p / 100.0 * n as f64 + 0.5).round_ties_even() - 1.0;
            samples[(rank.max(0.0) as usize).min(n - 1)]
        })
        .collect();
    out.push(samples[n - 1]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ws::{Decoder, Event, MASK_SEED_LEN};

    fn rng() -> MaskRng {
        MaskRng::new(&[7; MASK_SEED_LEN])
    }

    #[test]
    fn a_signed_batch_carries_each_messages_own_signature() {
        // [signature slot][stamp + padding]: the challenge covers before + payload + after
        let mut template = vec![0u8; PREFIXED_SIGNATURE_LEN];
        template.extend_from_slice(b"0123456789abcdef-pad");
        let key = SigningKey::ed25519(&[3; 32]).unwrap();
        let mut batch = StampedBatch::new(template, PREFIXED_SIGNATURE_LEN, rng()).unwrap();
        batch.sign_with(Signer::new(key.clone(), b"head", b"tail".to_vec(), 0, 65).unwrap());
        assert!(Signer::new(key.clone(), b"", vec![], 1, 65).is_none());
        let mut out = vec![0; batch.batch_len(2)];
        batch.write(&mut out, 5, 2, 99);
        let mut server = Decoder::default();
        let mut signed = Vec::new();
        server
            .feed(&out, |ev| {
                if let Event::Message { payload, .. } = ev {
                    signed.push(payload.to_vec());
                }
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(signed.len(), 2);
        for message in &signed {
            let (sig, payload) = message.split_at(PREFIXED_SIGNATURE_LEN);
            let digest = Md5::digest([&b"head"[..], payload, b"tail"].concat());
            let ok = crate::crypto::verify_prefixed(&key.public_key(), &digest, sig).unwrap();
            assert!(ok);
        }
        assert_ne!(
            signed[0][..PREFIXED_SIGNATURE_LEN],
            signed[1][..PREFIXED_SIGNATURE_LEN]
        );
    }

    #[test]
    fn a_batch_decodes_to_its_stamped_messages() {
        let template = b"prefix-0123456789abcdef-padding".to_vec();
        let mut batch = StampedBatch::new(template.clone(), 7, rng()).unwrap();
        let mut out = vec![0; batch.batch_len(3)];
        batch.write(&mut out, 40, 3, 123_456);
        let mut server = Decoder::default(); // a server decoder insists on masked frames
        let mut seen = Vec::new();
        server
            .feed(&out, |ev| {
                if let Event::Message { is_text, payload } = ev {
                    assert!(!is_text);
                    let data = payload.to_vec();
                    assert_eq!(&data[..7], b"prefix-");
                    assert_eq!(&data[23..], b"-padding");
                    seen.push(read_stamp(payload, 7).unwrap());
                }
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(seen, vec![(40, 123_456), (41, 123_456), (42, 123_456)]);
    }

    #[test]
    fn a_template_without_room_for_the_stamp_is_refused() {
        assert!(StampedBatch::new(vec![0; 20], 5, rng()).is_none());
        assert!(StampedBatch::new(vec![0; 21], 5, rng()).is_some());
    }

    #[test]
    fn stamps_are_found_where_each_dialect_carries_them() {
        let mut envelope = b"envelope fields".to_vec();
        let mut payload = vec![0; 24];
        write_stamp(&mut payload, 9, -5);
        envelope.extend(&payload);
        let at = StampAt::PayloadTail { size: 24 };
        let nine = Some(Stamp {
            stream: None,
            seq: 9,
            sent_ns: -5,
        });
        assert_eq!(stamp_of(at, Payload::new(&envelope, None)), nine);
        assert_eq!(stamp_of(at, Payload::new(&envelope[..20], None)), None);

        let mut forward = vec![1; HEADER_LEN];
        forward.extend(&payload);
        let sbd = StampAt::SbdForward;
        assert_eq!(stamp_of(sbd, Payload::new(&forward, None)), nine);
        let mut command = vec![0; HEADER_LEN - 4];
        command.extend(b"lbrt");
        command.extend(&payload);
        assert_eq!(stamp_of(sbd, Payload::new(&command, None)), None);
        assert_eq!(stamp_of(sbd, Payload::new(&forward[..40], None)), None);
    }

    fn sg_stamp() -> Vec<u8> {
        format!("{:06}{:012}{:020}", 7, 42, 1_700_000_000_123_456_789i64).into_bytes()
    }

    #[test]
    fn a_singyeong_stamp_opens_the_payload_string_in_json_and_msgpack() {
        let want = Some(Stamp {
            stream: Some(7),
            seq: 42,
            sent_ns: 1_700_000_000_123_456_789,
        });
        let padded = [sg_stamp(), b"####".to_vec()].concat();
        for spacing in ["", " "] {
            let json = [
                format!(r#"{{"op":0,"t":"SEND","d":{{"nonce":null,"payload":{spacing}""#)
                    .into_bytes(),
                padded.clone(),
                br#""}}"#.to_vec(),
            ]
            .concat();
            assert_eq!(singyeong_stamp(true, &json), want);
            let at = StampAt::SingyeongDispatch { json: true };
            assert_eq!(stamp_of(at, Payload::new(&json, None)), want);
            let mask = [9, 8, 7, 6];
            let mut masked = json.clone();
            crate::codec::mask::apply_mask(&mut masked, mask);
            assert_eq!(stamp_of(at, Payload::new(&masked, Some(mask))), want);
        }
        // msgpack: fixstr, str8, str16, str32 headers behind the fixstr key
        for header in [
            vec![0xa0 | 42],
            vec![0xd9, 42],
            vec![0xda, 0, 42],
            vec![0xdb, 0, 0, 0, 42],
        ] {
            let body = [
                b"\x83\xa2op\x00\xa1d\x81\xa7payload".to_vec(),
                header,
                padded.clone(),
            ]
            .concat();
            assert_eq!(singyeong_stamp(false, &body), want);
        }
    }

    #[test]
    fn a_singyeong_frame_without_our_stamp_has_none() {
        assert_eq!(
            singyeong_stamp(true, br#"{"op":6,"d":{"client_id":"r"}}"#),
            None
        );
        let short = [br#"{"d":{"payload":""#.to_vec(), sg_stamp()[..37].to_vec()].concat();
        assert_eq!(singyeong_stamp(true, &short), None);
        let mut letters = [br#"{"d":{"payload":""#.to_vec(), sg_stamp()].concat();
        let n = letters.len();
        letters[n - 3] = b'x';
        assert_eq!(singyeong_stamp(true, &letters), None);
        assert_eq!(singyeong_stamp(true, br#"{"payload""#), None); // no value
        assert_eq!(singyeong_stamp(false, b"\xa7payload"), None); // no str header
                                                                  // 20 digits beyond i64: not a send time of ours
        let huge = [
            br#"{"payload":""#.to_vec(),
            b"000007000000000042".to_vec(),
            vec![b'9'; 20],
        ];
        assert_eq!(singyeong_stamp(true, &huge.concat()), None);
    }

    #[test]
    fn a_singyeong_batch_decodes_to_its_templates_with_stamps_the_reader_reads() {
        let templates = vec![
            (
                br#"{"t":"SEND","d":{"payload":""#.to_vec(),
                br#""}}"#.to_vec(),
            ),
            (
                br#"{"t":"SEND","d":{"k":1,"payload":""#.to_vec(),
                br#""}}"#.to_vec(),
            ),
        ];
        assert!(SgBatch::new(vec![], 4, 0, true, rng()).is_none());
        assert!(SgBatch::new(templates.clone(), 4, SG_MAX_STREAM + 1, true, rng()).is_none());
        let mut batch = SgBatch::new(templates.clone(), 4, 7, true, rng()).unwrap();
        let mut out = vec![0; batch.batch_len(41, 3)];
        batch
            .write(&mut out, 41, 3, 1_700_000_000_123_456_789)
            .unwrap();
        let mut server = Decoder::default();
        let mut seen = Vec::new();
        server
            .feed(&out, |ev| {
                if let Event::Message { is_text, payload } = ev {
                    assert!(is_text);
                    seen.push(payload.to_vec());
                }
                Ok::<(), ()>(())
            })
            .unwrap();
        assert_eq!(seen.len(), 3);
        for (message, seq) in seen.iter().zip(41u64..) {
            let (before, after) = &templates[(seq % 2) as usize];
            assert!(message.starts_with(before) && message.ends_with(after));
            assert!(message.ends_with(&[b"####".as_slice(), after].concat()));
            let stamp = singyeong_stamp(true, message).unwrap();
            assert_eq!(
                (stamp.stream, stamp.seq, stamp.sent_ns),
                (Some(7), seq, 1_700_000_000_123_456_789)
            );
        }
        let mut stamp = [0; SG_STAMP_WIDTH];
        write_sg_stamp(&mut stamp, 7, 42, 1_700_000_000_123_456_789);
        assert_eq!(&stamp[..], &sg_stamp()[..]);
        let mut tail = vec![0; batch.batch_len(SG_MAX_SEQ, 2)];
        assert!(batch.write(&mut tail, SG_MAX_SEQ, 2, 0).is_none());
    }

    #[test]
    fn a_stamped_delivery_goes_to_its_stream_and_a_broadcast_to_its_receivers_copy() {
        let stamp = |stream| Stamp {
            stream,
            seq: 1,
            sent_ns: 0,
        };
        assert_eq!(StreamOf::One(4).route(&stamp(None)), Some((4, 0)));
        let by_stamp = StreamOf::ByStamp {
            fanouts: vec![(2, 1), (3, 50)],
            receiver: 17,
        };
        assert_eq!(by_stamp.route(&stamp(Some(2))), Some((2, 0)));
        assert_eq!(by_stamp.route(&stamp(Some(3))), Some((3, 17)));
        assert_eq!(by_stamp.route(&stamp(Some(5))), None); // not this process's stream
        assert_eq!(by_stamp.route(&stamp(None)), None);
    }

    #[test]
    fn a_masked_payload_reads_the_same_stamp() {
        let mut data = vec![0; 40];
        write_stamp(&mut data[HEADER_LEN - 8..], 3, 77);
        let mask = [1, 2, 3, 4];
        let mut masked = data.clone();
        crate::codec::mask::apply_mask(&mut masked, mask);
        let at = HEADER_LEN - 8;
        assert_eq!(
            read_stamp(Payload::new(&masked, Some(mask)), at),
            Some((3, 77))
        );
    }

    #[test]
    fn the_recorder_counts_duplicates_per_copy_and_measures_only_in_the_window() {
        let mut r = Recorder::new(true);
        assert_eq!(r.record(0, 0, Some(1), 0, 10, 100), Recorded::Delivered);
        assert_eq!(r.measured, 0); // before the window: counted, not measured
        r.start_measuring(1_000_000_000);
        assert_eq!(r.record(0, 0, Some(1), 0, 10, 100), Recorded::Duplicate);
        assert_eq!(r.record(0, 1, Some(1), 0, 10, 100), Recorded::Delivered);
        assert_eq!(
            r.record(2, 0, Some(200), 2_000_000_000, 3_500_000_000, 50),
            Recorded::Delivered
        );
        assert_eq!(r.record(2, 0, None, 5, 8, 50), Recorded::Delivered);
        assert_eq!(
            r.record(2, 0, Some(MAX_TRACKED_SEQ), 0, 1, 1),
            Recorded::OutOfRange
        );
        assert_eq!((r.delivered(0), r.delivered(1), r.delivered(2)), (2, 0, 2));
        assert_eq!((r.measured, r.duplicated, r.out_of_range), (3, 1, 1));
        assert_eq!(r.bytes_delivered, 200);
        assert_eq!(r.latencies_ns, vec![10, 1_500_000_000, 3]);
        assert_eq!(r.timeline, vec![2, 0, 1]); // seconds since the window opened, >= 0
        assert_eq!(
            r.samples.as_deref().unwrap()[3..6],
            [2_000_000_000, 2, 1_500_000_000]
        );
        r.stop_measuring();
        r.record(3, 0, Some(0), 0, 1, 1);
        assert_eq!(r.measured, 3);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentiles(&mut [], &[50.0]), vec![0, 0]);
        let mut samples: Vec<i64> = (1..=100).rev().collect();
        assert_eq!(
            percentiles(&mut samples, &[50.0, 90.0, 99.0, 99.9]),
            vec![50, 90, 100, 100, 100] // as the Python rule: 99.5 rounds to 100
        );
        // ties round to even, as the Python rule did: n=2, p50 -> rank round(1.5)-1 = 1
        assert_eq!(percentiles(&mut [5, 1], &[50.0]), vec![5, 5]);
        assert_eq!(percentiles(&mut [3, 1, 2], &[50.0]), vec![2, 3]);
    }
}

pub mod py {
    use super::{
        percentiles, stamp_of, Recorded, Recorder, SgBatch, Signer, StampAt, StampedBatch, StreamOf,
    };
    use crate::codec::mask::Payload;
    use crate::codec::scanner::py::Scanner;
    use crate::codec::scanner::{ScanFeed, Scanned};
    use crate::codec::ws::{MaskRng, MASK_SEED_LEN};
    use crate::error::Error;
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;
    use std::collections::HashMap;

    /// The latency recorder of one generator process (see [`Recorder`]).
    #[pyclass(module = "rmb_relay._core")]
    pub struct LoadRecorder {
        inner: Recorder,
    }

    fn i64_bytes<'py>(py: Python<'py>, values: &[i64]) -> Bound<'py, PyBytes> {
        PyBytes::new_with(py, values.len() * 8, |out| {
            for (chunk, v) in out.chunks_exact_mut(8).zip(values) {
                chunk.copy_from_slice(&v.to_ne_bytes());
            }
            Ok(())
        })
        .expect("bytes of a known size")
    }

    #[pymethods]
    impl LoadRecorder {
        #[new]
        #[pyo3(signature = (keep_samples = false))]
        fn new(keep_samples: bool) -> Self {
            LoadRecorder {
                inner: Recorder::new(keep_samples),
            }
        }

        /// Record a delivery; False for a duplicate (or a sequence number out of range).
        #[pyo3(signature = (stream, sent_ns, now_ns, size, seq = None, copy = 0))]
        fn record(
            &mut self,
            stream: u32,
            sent_ns: i64,
            now_ns: i64,
            size: u64,
            seq: Option<u64>,
            copy: u32,
        ) -> bool {
            self.inner.record(stream, copy, seq, sent_ns, now_ns, size) == Recorded::Delivered
        }

        fn delivered(&self, stream: u32) -> u64 {
            self.inner.delivered(stream)
        }

        fn start_measuring(&mut self, now_ns: i64) {
            self.inner.start_measuring(now_ns);
        }

        fn stop_measuring(&mut self) {
            self.inner.stop_measuring();
        }

        #[getter]
        fn measured(&self) -> u64 {
            self.inner.measured
        }

        #[getter]
        fn bytes_delivered(&self) -> u64 {
            self.inner.bytes_delivered
        }

        #[getter]
        fn duplicated(&self) -> u64 {
            self.inner.duplicated
        }

        #[getter]
        fn out_of_range(&self) -> u64 {
            self.inner.out_of_range
        }

        #[getter]
        fn timeline(&self) -> Vec<u64> {
            self.inner.timeline.clone()
        }

        /// The measured latencies (ns) as native int64 bytes (`array("q").frombytes`).
        fn latencies<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
            i64_bytes(py, &self.inner.latencies_ns)
        }

        /// The (send time, stream, latency) triples as native int64 bytes; None unless kept.
        fn samples<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
            self.inner.samples.as_deref().map(|s| i64_bytes(py, s))
        }
    }

    /// Nearest-rank percentiles (ns) of native int64 `samples` at `points`, then the maximum.
    #[pyfunction]
    fn latency_percentiles(samples: &[u8], points: Vec<f64>) -> PyResult<Vec<i64>> {
        if !samples.len().is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "samples must be int64s, got {} bytes",
                samples.len()
            ))
            .into());
        }
        let mut values: Vec<i64> = samples
            .chunks_exact(8)
            .map(|c| i64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect();
        Ok(percentiles(&mut values, &points))
    }

    /// A `bytes` of `len` bytes that `fill` writes every byte of. `PyBytes::new_with` zeroes
    /// the buffer first: a memset of every send batch (2-3% of an SBD generator's CPU, perf).
    fn bytes_filled<'py>(
        py: Python<'py>,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> PyResult<()>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let size = pyo3::ffi::Py_ssize_t::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("a batch of {len} bytes")))?;
        // SAFETY: a new bytes object of `len` uninitialized bytes, owned here; `fill` writes
        // all of them (`batch_len` is exactly what `write` writes) before Python sees it, and
        // on an error it is dropped unseen
        unsafe {
            let ptr = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
            let bytes = Bound::from_owned_ptr_or_err(py, ptr)?.downcast_into_unchecked::<PyBytes>();
            let data = pyo3::ffi::PyBytes_AsString(bytes.as_ptr()) as *mut u8;
            fill(std::slice::from_raw_parts_mut(data, len))?;
            Ok(bytes)
        }
    }

    /// A stream's send batches (see [`StampedBatch`]).
    #[pyclass(name = "StampedBatch", module = "rmb_relay._core")]
    pub struct PyStampedBatch {
        inner: StampedBatch,
    }

    #[pymethods]
    impl PyStampedBatch {
        #[new]
        fn new(template: &[u8], stamp_at: usize, seed: &[u8]) -> PyResult<Self> {
            let seed: &[u8; MASK_SEED_LEN] = seed.try_into().map_err(|_| {
                Error::InvalidArgument(format!(
                    "seed must be {MASK_SEED_LEN} bytes (os.urandom({MASK_SEED_LEN})), got {}",
                    seed.len()
                ))
            })?;
            let inner = StampedBatch::new(template.to_vec(), stamp_at, MaskRng::new(seed))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "a {}-byte template has no room for a stamp at {stamp_at}",
                        template.len()
                    ))
                })?;
            Ok(PyStampedBatch { inner })
        }

        /// Sign every message from now on with `key`: MD5 of `before` + the payload + `after`
        /// (the SDK's challenge around the payload), written at `sig_at` of the template.
        fn sign_with(
            &mut self,
            key: &crate::crypto::py::SigningKey,
            before: &[u8],
            after: &[u8],
            sig_at: usize,
        ) -> PyResult<()> {
            let stamp_at = self.inner.stamp_at();
            let signer = Signer::new(key.key().clone(), before, after.to_vec(), sig_at, stamp_at)
                .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a signature at {sig_at} does not fit before the stamp at {stamp_at}"
                ))
            })?;
            self.inner.sign_with(signer);
            Ok(())
        }

        /// Masked frames of messages `first_seq..first_seq + n`, stamped `sent_ns`.
        fn frames<'py>(
            &mut self,
            py: Python<'py>,
            first_seq: u64,
            n: usize,
            sent_ns: i64,
        ) -> PyResult<Bound<'py, PyBytes>> {
            let inner = &mut self.inner;
            bytes_filled(py, inner.batch_len(n), |out| {
                inner.write(out, first_seq, n, sent_ns);
                Ok(())
            })
        }
    }

    /// A 신경 sender stream's frames (see [`SgBatch`]).
    #[pyclass(name = "SingyeongBatch", module = "rmb_relay._core")]
    pub struct PySgBatch {
        inner: SgBatch,
    }

    #[pymethods]
    impl PySgBatch {
        #[new]
        fn new(
            templates: Vec<(Vec<u8>, Vec<u8>)>,
            padding: usize,
            stream: u32,
            text: bool,
            seed: &[u8],
        ) -> PyResult<Self> {
            let seed: &[u8; MASK_SEED_LEN] = seed.try_into().map_err(|_| {
                Error::InvalidArgument(format!(
                    "seed must be {MASK_SEED_LEN} bytes (os.urandom({MASK_SEED_LEN})), got {}",
                    seed.len()
                ))
            })?;
            let inner = SgBatch::new(templates, padding, stream, text, MaskRng::new(seed))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "a batch needs templates and a stream index of at most {} (got {stream})",
                        super::SG_MAX_STREAM
                    ))
                })?;
            Ok(PySgBatch { inner })
        }

        /// Masked frames of messages `first_seq..first_seq + n`, stamped `sent_ns`.
        fn frames<'py>(
            &mut self,
            py: Python<'py>,
            first_seq: u64,
            n: usize,
            sent_ns: i64,
        ) -> PyResult<Bound<'py, PyBytes>> {
            let inner = &mut self.inner;
            bytes_filled(py, inner.batch_len(first_seq, n), |out| {
                inner.write(out, first_seq, n, sent_ns).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "sequence numbers past {} do not fit a stamp",
                        super::SG_MAX_SEQ
                    ))
                    .into()
                })
            })
        }
    }

    /// Records the stamp of every message of a read into a recorder, inside `WsDecoder.feed`
    /// (the decoder's `now` is the arrival time, ns on the generator's send clock); messages
    /// without a stamp reach Python. Every stamped message is taken, also after one went to
    /// Python (codec/scanner.rs's order rule keeps forwards behind what Python may close the
    /// connection over; a recorded latency leaves nothing behind to keep).
    #[pyclass(extends = Scanner, module = "rmb_relay._core")]
    pub struct StampScanner {
        recorder: Py<LoadRecorder>,
        streams: StreamOf,
        size: u64,
        at: StampAt,
    }

    /// The one stream of a connection, or (신경) this process's streams by index: their fan-out
    #[derive(FromPyObject)]
    enum Streams {
        One(u32),
        ByStamp(HashMap<u32, u32>),
    }

    impl StampScanner {
        fn take(&self, recorder: &mut Recorder, payload: Payload<'_>, now: u64) -> bool {
            let Some(stamp) = stamp_of(self.at, payload) else {
                return false;
            };
            let Some((stream, copy)) = self.streams.route(&stamp) else {
                return false;
            };
            recorder.record(
                stream,
                copy,
                Some(stamp.seq),
                stamp.sent_ns,
                now as i64,
                self.size,
            );
            true
        }
    }

    #[pymethods]
    impl StampScanner {
        /// `dialect` "rmb" (the stamp opens the envelope's `size`-byte payload, its last field)
        /// or "sbd" (behind a forward's header), with `streams` the connection's one stream;
        /// "singyeong-json" or "singyeong-msgpack" (the stamp opens a DISPATCH's payload string
        /// and names its stream), with `streams` {stream index: fan-out} of this process and
        /// `receiver` this connection's index; `size` is what a delivery counts as.
        #[new]
        #[pyo3(signature = (recorder, streams, size, dialect, receiver = 0))]
        fn new(
            recorder: Py<LoadRecorder>,
            streams: Streams,
            size: u64,
            dialect: &str,
            receiver: u32,
        ) -> PyResult<(Self, Scanner)> {
            let at = match dialect {
                "rmb" => StampAt::PayloadTail {
                    size: size as usize,
                },
                "sbd" => StampAt::SbdForward,
                "singyeong-json" => StampAt::SingyeongDispatch { json: true },
                "singyeong-msgpack" => StampAt::SingyeongDispatch { json: false },
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "no stamp reader for dialect {other:?} \
                         (rmb, sbd, singyeong-json, singyeong-msgpack)"
                    ))
                    .into())
                }
            };
            let streams = match (at, streams) {
                (StampAt::SingyeongDispatch { .. }, Streams::ByStamp(fanouts)) => {
                    let mut fanouts: Vec<(u32, u32)> = fanouts.into_iter().collect();
                    fanouts.sort_unstable();
                    StreamOf::ByStamp { fanouts, receiver }
                }
                (StampAt::SingyeongDispatch { .. }, Streams::One(_)) => {
                    return Err(Error::InvalidArgument(format!(
                        "{dialect} stamps name their stream: streams must be \
                         {{stream index: fan-out}}"
                    ))
                    .into())
                }
                (_, Streams::One(stream)) => StreamOf::One(stream),
                (_, Streams::ByStamp(_)) => {
                    return Err(Error::InvalidArgument(format!(
                        "{dialect} stamps carry no stream: streams must be one stream index"
                    ))
                    .into())
                }
            };
            let scanner = StampScanner {
                recorder,
                streams,
                size,
                at,
            };
            Ok((scanner, Scanner::new(start_stamps)))
        }

        /// Record `data` as a feed would; False when it carries no stamp.
        fn record_message(&self, py: Python<'_>, data: &[u8], now: u64) -> PyResult<bool> {
            let mut recorder = self.recorder.bind(py).try_borrow_mut()?;
            Ok(self.take(&mut recorder.inner, Payload::new(data, None), now))
        }
    }

    struct StampFeed<'py> {
        scanner: PyRef<'py, StampScanner>,
        recorder: PyRefMut<'py, LoadRecorder>,
    }

    fn start_stamps<'a, 'py>(scanner: &'a Bound<'py, PyAny>) -> PyResult<Box<dyn ScanFeed + 'a>> {
        let scanner = scanner.downcast::<StampScanner>()?.try_borrow()?;
        let recorder = scanner.recorder.bind(scanner.py()).try_borrow_mut()?;
        Ok(Box::new(StampFeed { scanner, recorder }))
    }

    impl ScanFeed for StampFeed<'_> {
        fn message(
            &mut self,
            py: Python<'_>,
            _is_text: bool,
            payload: Payload<'_>,
            now: u64,
            _fast: bool,
        ) -> PyResult<Option<Scanned>> {
            if self.scanner.take(&mut self.recorder.inner, payload, now) {
                return Ok(None);
            }
            let data = crate::codec::ws::py::payload_bytes(py, payload)?;
            Ok(Some((data, None, None)))
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<LoadRecorder>()?;
        m.add_class::<PyStampedBatch>()?;
        m.add_class::<StampScanner>()?;
        m.add_class::<PySgBatch>()?;
        m.add("STAMP_LEN", super::STAMP_LEN)?;
        m.add_function(wrap_pyfunction!(latency_percentiles, m)?)?;
        Ok(())
    }
}
