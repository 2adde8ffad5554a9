//! Fuzz targets for the parsers that read bytes from the network: the HTTP request parser,
//! the websocket decoder, the RMB envelope scanner, the 신경 native frame reader and the tunnel
//! connector's response parser (what a target answers).
//!
//! Each target takes arbitrary bytes and checks the one contract a hostile peer relies on us
//! keeping: every input is accepted or rejected with a documented error (an HTTP status, a
//! close code, an envelope error) and never panics, and what the parser holds stays within
//! its limits. The same functions run three ways:
//!
//! - `cargo fuzz run <target>` (`fuzz/`, nightly, libFuzzer): `make fuzz`, for hours;
//! - `cargo test` (the tests below): every seed in `fuzz/corpus/<target>/` plus a few
//!   thousand deterministic mutations of them, so `make test` exercises the targets too;
//! - nowhere else: this module has no PyO3 glue and is not exported to Python.
//!
//! The first input byte chooses where the rest is split into two feeds, so incremental
//! parsing (a head or a frame cut anywhere) is fuzzed as well as whole inputs.

use crate::codec::http::{Event, Limits, StreamParser};
use crate::codec::http::{
    ResponseParser, DEFAULT_MAX_CHUNK_LINE, MAX_RESPONSE_HEAD, MAX_RESPONSE_TRAILERS,
};
use crate::codec::ws::{Decoder, OwnedEvent};
use crate::dialects::rmb::envelope;
use crate::dialects::singyeong::{
    self as singyeong, index::Client, query::Metadata, value::Value, Decision, Frame, Gateway,
    Limits as QueryLimits,
};
use crate::error::Error;
use crate::forward::outboxes::Outboxes;

/// HTTP statuses the request parser may refuse with (docs/http.md, "Limits and refusals").
pub const HTTP_STATUSES: [u16; 4] = [400, 413, 431, 501];
/// Close codes the websocket decoder may report (RFC 6455 section 7.4.1).
pub const WS_CLOSE_CODES: [u16; 3] = [1002, 1007, 1009];
/// The websocket message limit the decoder is fuzzed with (small, to reach it often).
pub const WS_MAX_MESSAGE: usize = 4096;

fn split(data: &[u8]) -> (&[u8], &[u8]) {
    match data.split_first() {
        Some((&cut, rest)) => rest.split_at(usize::from(cut).min(rest.len())),
        None => (&[], &[]),
    }
}

/// The HTTP request parser: events or one violation with a documented status, never a
/// panic; nothing more after a violation; buffered bytes bounded by the head limit.
pub fn http_request(data: &[u8]) {
    let limits = Limits::default();
    let mut parser = StreamParser::new(limits);
    let (first, second) = split(data);
    for part in [first, second] {
        let out = parser.feed(part);
        for event in &out.events {
            if let Event::Head(head) = event {
                assert!(!head.method.is_empty(), "a head without a method");
            }
        }
        match out.error {
            Some(Error::Http { status, .. }) => {
                assert!(
                    HTTP_STATUSES.contains(&status),
                    "undocumented status {status}"
                );
                let after = parser.feed(b"GET / HTTP/1.1\r\n\r\n");
                assert!(after.events.is_empty(), "events after a violation");
                return;
            }
            Some(other) => panic!("the HTTP parser raised a non-HTTP error: {other:?}"),
            None => {}
        }
        if parser.is_done() {
            return; // the caller answers before it starts the next request
        }
        assert!(
            parser.buffered() <= limits.max_head + limits.max_chunk_line + limits.max_trailers,
            "parser holds {} bytes",
            parser.buffered()
        );
    }
}

/// The websocket decoder (server mode): messages within the limit, or one violation with a
/// documented close code, never a panic; nothing more after a close or a violation.
pub fn ws_frames(data: &[u8]) {
    let mut decoder = Decoder::new(WS_MAX_MESSAGE, false);
    let (first, second) = split(data);
    let mut ended = false;
    for part in [first, second] {
        for event in decoder.feed_owned(part) {
            assert!(!ended, "an event after a close or a violation");
            match event {
                OwnedEvent::Message { is_text, data } => {
                    assert!(data.len() <= WS_MAX_MESSAGE, "message over the limit");
                    if is_text {
                        assert!(std::str::from_utf8(&data).is_ok(), "text that is not UTF-8");
                    }
                }
                OwnedEvent::Ping(payload) | OwnedEvent::Pong(payload) => {
                    assert!(payload.len() <= 125, "control frame over 125 bytes");
                }
                OwnedEvent::Close { .. } => ended = true,
                OwnedEvent::Violation { code, .. } => {
                    assert!(
                        WS_CLOSE_CODES.contains(&code),
                        "undocumented close code {code}"
                    );
                    ended = true;
                }
            }
        }
        assert!(
            decoder.buffered() <= 2 * (WS_MAX_MESSAGE + 14),
            "decoder holds {} bytes",
            decoder.buffered()
        );
    }
}

/// The RMB envelope scanner: routing fields borrowed from the input, or an envelope error,
/// never a panic.
pub fn rmb_envelope(data: &[u8]) {
    match envelope::scan(data) {
        Ok(fields) => {
            for text in [Some(fields.uid), fields.tags, fields.source_connection]
                .into_iter()
                .chain([fields.dest_connection])
                .flatten()
            {
                let range = data.as_ptr_range();
                assert!(
                    range.contains(&text.as_ptr()) || text.is_empty(),
                    "a field not borrowed from the envelope"
                );
            }
            let _ = fields.fail_fast();
        }
        Err(Error::Envelope(_)) => {}
        Err(other) => panic!("the scanner raised a non-envelope error: {other:?}"),
    }
}

/// The 신경 fast path's frame reader and query parser (`dialects/singyeong/`): a frame is
/// read or left to Python, never a panic; what it copies into a DISPATCH is borrowed from the
/// frame; routing it through a small index writes to at most the index's clients.
pub fn sg_frame(data: &[u8]) {
    let within = |text: &[u8]| data.as_ptr_range().contains(&text.as_ptr()) || text.is_empty();
    match singyeong::read(data) {
        Some(Frame::Route(r)) => {
            assert!(within(r.payload), "a payload not borrowed from the frame");
            assert!(
                r.nonce == b"null" || within(r.nonce),
                "a nonce not borrowed"
            );
            let mut gw = Gateway::new(3, QueryLimits::default());
            let mut outboxes = Outboxes::new();
            for conn in 1..=3 {
                outboxes.open(conn);
                let mut meta = Metadata::new();
                meta.insert(b"id".as_slice().into(), (Value::Int(conn as i64), false));
                let id = format!("c{conn}").into_bytes().into();
                let client = Client {
                    app: b"a".as_slice().into(),
                    id,
                    conn: Some(conn),
                    json: true,
                    meta,
                    ..Client::default()
                };
                gw.index.add(conn, client);
            }
            match gw.deliver(&r, 1, &mut outboxes) {
                Decision::Delivered(n) => assert!((1..=3).contains(&n), "{n} receivers"),
                Decision::Python => {}
            }
        }
        Some(Frame::Queue(_)) | None => {}
    }
}

/// The response parser (a tunnel target's answer): events or one
/// `HttpResponse` error, never a panic; errors stay; the bytes held stay within the head,
/// chunk-line and trailer limits or the whole-body limit. The first byte chooses HEAD and the
/// whole-body limit, the second where the rest is cut; two responses are read when the
/// first ends.
pub fn http_response(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let whole_limit = [0, 16, 16 * 1024][usize::from(flags >> 1) % 3];
    let bound = MAX_RESPONSE_HEAD
        .max(MAX_RESPONSE_TRAILERS)
        .max(DEFAULT_MAX_CHUNK_LINE)
        .max(whole_limit);
    let mut parser = ResponseParser::new();
    parser
        .start(flags & 1 == 1, whole_limit)
        .expect("a fresh parser starts");
    let (first, second) = split(rest);
    let mut events = Vec::new();
    for part in [first, second] {
        match parser.feed(part, &mut events) {
            Ok(()) => assert!(
                parser.buffered() <= bound + part.len(),
                "held {} bytes",
                parser.buffered()
            ),
            Err(Error::HttpResponse(_)) => {
                assert!(
                    parser.feed(b"", &mut events).is_err(),
                    "an error that went away"
                );
                return;
            }
            Err(other) => panic!("undocumented error {other:?}"),
        }
        if parser.is_idle() && parser.keep_alive() {
            let _ = parser.start(false, whole_limit);
        }
    }
    match parser.feed_eof(&mut events) {
        Ok(_) | Err(Error::HttpResponse(_)) => {}
        Err(other) => panic!("undocumented error at EOF {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::path::Path;

    /// Mutations per seed in `cargo test` (the real runs are `make fuzz`).
    const MUTATIONS: usize = 2000;

    fn seeds(target: &str) -> Vec<Vec<u8>> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        let mut out: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .unwrap_or_else(|err| panic!("seed corpus {}: {err}", dir.display()))
            .map(|entry| std::fs::read(entry.expect("corpus entry").path()).expect("seed"))
            .collect();
        out.sort();
        assert!(!out.is_empty(), "no seeds in {}", dir.display());
        out
    }

    /// Byte flips, inserts, deletes, duplications and splices, as a fuzzer's first rounds.
    fn mutate(rng: &mut StdRng, seed: &[u8], other: &[u8]) -> Vec<u8> {
        let mut data = seed.to_vec();
        for _ in 0..rng.gen_range(1..8) {
            let at = if data.is_empty() {
                0
            } else {
                rng.gen_range(0..data.len())
            };
            match rng.gen_range(0..6) {
                0 if !data.is_empty() => data[at] ^= 1 << rng.gen_range(0..8),
                1 => data.insert(at, rng.gen()),
                2 if !data.is_empty() => {
                    data.remove(at);
                }
                3 => {
                    let end = (at + rng.gen_range(0..16)).min(data.len());
                    let copy = data[at..end].to_vec();
                    data.splice(at..at, copy);
                }
                4 if !other.is_empty() => {
                    let from = rng.gen_range(0..other.len());
                    data.truncate(at);
                    data.extend_from_slice(&other[from..]);
                }
                _ if !data.is_empty() => {
                    data[at] = [0, 0xff, b'\r', b'\n', b'0'][rng.gen_range(0..5)]
                }
                _ => data.push(rng.gen()),
            }
        }
        data
    }

    fn smoke(target: &str, run: fn(&[u8])) {
        let seeds = seeds(target);
        let mut rng = StdRng::seed_from_u64(9);
        for seed in &seeds {
            run(seed);
            for _ in 0..MUTATIONS {
                let other = &seeds[rng.gen_range(0..seeds.len())];
                run(&mutate(&mut rng, seed, other));
            }
        }
    }

    #[test]
    fn http_request_survives_its_corpus_and_mutations() {
        smoke("http_request", http_request);
    }

    #[test]
    fn ws_frames_survive_their_corpus_and_mutations() {
        smoke("ws_frames", ws_frames);
    }

    #[test]
    fn sg_frame_survives_its_corpus_and_mutations() {
        smoke("sg_frame", sg_frame);
    }

    #[test]
    fn http_response_survives_its_corpus_and_mutations() {
        smoke("http_response", http_response);
    }

    #[test]
    fn rmb_envelope_survives_its_corpus_and_mutations() {
        smoke("rmb_envelope", rmb_envelope);
    }
}
