//! HTTP/1.x request parsing and response/request encoding (RFC 9110, RFC 9112) plus the
//! websocket opening handshake (RFC 6455 section 4).
//!
//! Theory of operation: [`StreamParser`] turns the bytes of one connection into events, h11
//! style: [`Event::Head`] as soon as a request head is complete, [`Event::Data`] for body bytes
//! as they arrive (Content-Length or chunked), then [`Event::End`] (with any trailer fields).
//! It then stops in `Done`: bytes of a pipelined request wait in its buffer until the caller
//! has answered and calls [`StreamParser::start_next_cycle`], or are handed to the websocket
//! decoder by [`StreamParser::take_rest`] after an upgrade.
//!
//! ```text
//!  state      on                                       emits          next
//!  Head       complete head, no body / length 0        Head, End      Done
//!  Head       complete head, Content-Length n > 0      Head           Body(n)
//!  Head       complete head, Transfer-Encoding chunked Head           ChunkSize
//!  Body(n)    bytes (up to n)                          Data           Body(n - k), or End -> Done
//!  ChunkSize  `hex[;ext]CRLF`, size n > 0               -              ChunkData(n)
//!  ChunkSize  `0[;ext]CRLF`                             -              Trailers
//!  ChunkData  bytes (up to n)                          Data           ChunkData(n - k) -> ChunkEnd
//!  ChunkEnd   CRLF                                      -              ChunkSize
//!  Trailers   fields up to an empty line               End(fields)    Done
//!  Done       anything (kept for the next cycle)       -              Head on start_next_cycle
//!  any        a framing or limit violation             Err(status)    Failed (nothing more)
//! ```
//!
//! Memory is O(read + limits), never O(body): body bytes are handed out as slices of the
//! bytes just fed (or of the leftover buffer), and only an incomplete head, chunk-size line
//! or trailer section is kept, each under its own limit. A head is located by scanning only
//! the bytes not scanned before, so a head trickled in byte by byte costs O(n).
//!
//! Framing rules (RFC 9112 section 6): `Transfer-Encoding` must end in `chunked` (else 400,
//! the length cannot be known), may not name `chunked` twice (400), may not come with
//! Content-Length (400: a smuggling attempt) nor in an HTTP/1.0 request (400, section 6.1);
//! any coding other than `chunked` before it is 501 (we implement none). Chunk extensions are
//! ignored; chunk lines must end in CRLF.

use crate::error::{Error, Result};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use sha1::{Digest, Sha1};

/// Default cap on the request head (request line + headers). 16 KiB is far above what any of
/// our clients send (an RMB JWT fits in 1 KiB) and bounds a slowloris that never ends its head.
pub const DEFAULT_MAX_HEAD: usize = 16 * 1024;
/// Default cap on the number of header fields (and of trailer fields); nginx and h11 sit in
/// the same range.
pub const DEFAULT_MAX_HEADERS: usize = 64;
/// Default cap on one chunk-size line with its extensions and CRLF. A size is at most 16 hex
/// digits; extensions are ignored, so a long line is only ever a way to make us buffer.
pub const DEFAULT_MAX_CHUNK_LINE: usize = 4096;
/// Default cap on the trailer section of a chunked body (bytes, CRLFs included); trailers are
/// rare and small (a checksum), so this is well below the head limit.
pub const DEFAULT_MAX_TRAILERS: usize = 8 * 1024;
/// Headers parsed on the stack before falling back to the heap (the default limit fits).
const STACK_HEADERS: usize = 64;
/// Compact the buffer once the consumed prefix is at least this big and half the buffer, so
/// pipelined requests are not shifted one by one.
const COMPACT_AT: usize = 4096;

/// The GUID appended to the key before hashing (RFC 6455 section 1.3).
const WEBSOCKET_GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// The only websocket version there is (RFC 6455 section 4.1, item 9).
const WEBSOCKET_VERSION: &[u8] = b"13";
/// Length of the decoded Sec-WebSocket-Key nonce (RFC 6455 section 4.1, item 7).
const WEBSOCKET_KEY_LEN: usize = 16;

// Statuses this module answers with (RFC 9110 section 15, RFC 6585 section 5).
pub const STATUS_BAD_REQUEST: u16 = 400;
pub const STATUS_PAYLOAD_TOO_LARGE: u16 = 413;
pub const STATUS_UPGRADE_REQUIRED: u16 = 426;
pub const STATUS_HEADERS_TOO_LARGE: u16 = 431;
pub const STATUS_NOT_IMPLEMENTED: u16 = 501;
/// A response we could not parse is the upstream's fault: 502 is what a proxy would answer.
pub const STATUS_BAD_GATEWAY: u16 = 502;

fn http_error(status: u16, reason: &str) -> Error {
    Error::Http {
        status,
        reason: reason.to_owned(),
    }
}

/// The parser limits, all part of the API (see the `DEFAULT_*` constants for why each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_head: usize,
    pub max_headers: usize,
    pub max_chunk_line: usize,
    pub max_trailers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head: DEFAULT_MAX_HEAD,
            max_headers: DEFAULT_MAX_HEADERS,
            max_chunk_line: DEFAULT_MAX_CHUNK_LINE,
            max_trailers: DEFAULT_MAX_TRAILERS,
        }
    }
}

/// How the body of a request is delimited (RFC 9112 section 6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Content-Length bytes; 0 also stands for "no body" (neither header sent).
    Length(u64),
    /// `Transfer-Encoding: chunked`: the length is known at the last chunk.
    Chunked,
}

/// Header and trailer fields: names lower-cased, in arrival order.
pub type Fields = Vec<(String, Vec<u8>)>;

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    pub headers: Fields,
    pub keep_alive: bool,
    pub is_websocket_upgrade: bool,
    pub framing: Framing,
    /// `Expect: 100-continue` on an HTTP/1.1 request (RFC 9110 section 10.1.1: a 1.0 client's
    /// expectation is ignored).
    pub expect_continue: bool,
}

impl RequestHead {
    /// The first header of that name (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    fn headers_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// True when any header of that name lists `token` (comma-separated, case-insensitive).
    fn has_token(&self, name: &str, token: &str) -> bool {
        self.headers_named(name)
            .flat_map(split_tokens)
            .any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
    }

    /// Whether a body follows the head.
    pub fn has_body(&self) -> bool {
        self.framing != Framing::Length(0)
    }
}

/// The comma-separated elements of a header list value, trimmed of optional whitespace
/// (RFC 9110 section 5.6.1), empty elements skipped.
fn split_tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(trim_ows)
        .filter(|t| !t.is_empty())
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// Index one past the empty line that ends a head (`\n\n` or `\n\r\n`), searching from
/// `from`; bare LF line ends are accepted like httparse does.
fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(off) = buf.get(i..)?.iter().position(|&b| b == b'\n') {
        let nl = i + off;
        match buf.get(nl + 1) {
            Some(b'\n') => return Some(nl + 2),
            Some(b'\r') if buf.get(nl + 2) == Some(&b'\n') => return Some(nl + 3),
            Some(_) => i = nl + 1,
            // The terminator may be split across feeds: rescan from this LF next time.
            None => return None,
        }
    }
    None
}

/// Refuse at once what can never become a request head, instead of waiting for its end until
/// the idle timeout or the head limit: a NUL anywhere, a CR followed by anything but LF, or a
/// first byte after the leading empty lines (RFC 9112 section 2.2 allows those) that cannot
/// start a method. `from` is where the previous feed's check stopped (the new bytes).
fn check_partial_head(avail: &[u8], from: usize) -> Result<()> {
    let fresh = &avail[from.min(avail.len())..];
    if fresh.contains(&0) {
        return Err(http_error(STATUS_BAD_REQUEST, "NUL in request head"));
    }
    let mut at = from.min(avail.len());
    while let Some(off) = avail[at..].iter().position(|&b| b == b'\r') {
        let cr = at + off;
        match avail.get(cr + 1) {
            Some(b'\n') | None => at = cr + 1,
            Some(_) => return Err(http_error(STATUS_BAD_REQUEST, "bare CR in request head")),
        }
    }
    let mut first = 0;
    loop {
        match &avail[first..] {
            [b'\r', b'\n', ..] => first += 2,
            [b'\n', ..] => first += 1,
            _ => break,
        }
    }
    match avail.get(first) {
        None | Some(b'\r') => Ok(()),
        Some(&b) if is_tchar(b) => Ok(()),
        Some(_) => Err(http_error(STATUS_BAD_REQUEST, "malformed request line")),
    }
}

/// Where a rescan must start so a terminator split across feeds is still found.
fn rescan_from(len: usize) -> usize {
    len.saturating_sub(2)
}

/// The body length announced by the Content-Length fields (None when there are none):
/// identical repeats (as separate fields or a list) are one value, anything else is 400
/// (RFC 9112 section 6.3, item 5). A value past u64 is 413: it is over any limit.
fn content_length(head: &RequestHead) -> Result<Option<u64>> {
    let mut found: Option<&[u8]> = None;
    for value in head.headers_named("content-length") {
        for item in value.split(|&b| b == b',').map(trim_ows) {
            if item.is_empty() || !item.iter().all(u8::is_ascii_digit) {
                return Err(http_error(STATUS_BAD_REQUEST, "invalid content-length"));
            }
            let item = strip_leading_zeros(item);
            match found {
                Some(prev) if prev != item => {
                    return Err(http_error(STATUS_BAD_REQUEST, "conflicting content-length"))
                }
                _ => found = Some(item),
            }
        }
    }
    let Some(digits) = found else { return Ok(None) };
    // Digits only, so the only failure left is overflow.
    std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| http_error(STATUS_PAYLOAD_TOO_LARGE, "request body too large"))
}

fn strip_leading_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&b| b == b'0').count();
    if zeros == digits.len() {
        b"0"
    } else {
        &digits[zeros..]
    }
}

/// The framing of a request (RFC 9112 sections 6.1 and 6.3); see the module comment.
fn framing(head: &RequestHead) -> Result<Framing> {
    let length = content_length(head)?;
    let mut codings = head
        .headers_named("transfer-encoding")
        .flat_map(split_tokens)
        .peekable();
    if codings.peek().is_none() {
        if head.headers_named("transfer-encoding").next().is_some() {
            // A field with no codings at all: chunked is not the final coding.
            return Err(http_error(
                STATUS_BAD_REQUEST,
                "transfer-encoding must end with chunked",
            ));
        }
        return Ok(Framing::Length(length.unwrap_or(0)));
    }
    if head.version == 0 {
        return Err(http_error(
            STATUS_BAD_REQUEST,
            "transfer-encoding in an HTTP/1.0 request",
        ));
    }
    if length.is_some() {
        return Err(http_error(
            STATUS_BAD_REQUEST,
            "both transfer-encoding and content-length",
        ));
    }
    let codings: Vec<&[u8]> = codings.collect();
    let is_chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
    match codings.split_last() {
        Some((last, _)) if !is_chunked(last) => Err(http_error(
            STATUS_BAD_REQUEST,
            "transfer-encoding must end with chunked",
        )),
        Some((_, before)) if before.iter().any(is_chunked) => Err(http_error(
            STATUS_BAD_REQUEST,
            "chunked applied more than once",
        )),
        Some((_, [])) => Ok(Framing::Chunked),
        _ => Err(http_error(
            STATUS_NOT_IMPLEMENTED,
            "transfer-coding not implemented",
        )),
    }
}

/// Build the head from httparse's view of it and apply the framing rules.
fn head_from_parsed(req: &httparse::Request<'_, '_>) -> Result<RequestHead> {
    // httparse only reports Complete with all three set.
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(http_error(STATUS_BAD_REQUEST, "malformed request line"));
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    };
    let mut head = RequestHead {
        method: method.to_owned(),
        path,
        query,
        version,
        headers: lowercase_fields(req.headers),
        keep_alive: false,
        is_websocket_upgrade: false,
        framing: Framing::Length(0),
        expect_continue: false,
    };
    // RFC 9112 section 9.3: 1.1 persists unless "close"; 1.0 only with "keep-alive".
    head.keep_alive = !head.has_token("connection", "close")
        && (version >= 1 || head.has_token("connection", "keep-alive"));
    // RFC 6455 section 4.2.1, items 1, 3 and 4.
    head.is_websocket_upgrade = head.method == "GET"
        && head.has_token("upgrade", "websocket")
        && head.has_token("connection", "upgrade");
    head.expect_continue = version >= 1 && head.has_token("expect", "100-continue");
    head.framing = framing(&head)?;
    Ok(head)
}

fn lowercase_fields(fields: &[httparse::Header<'_>]) -> Fields {
    fields
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect()
}

fn map_httparse_error(err: httparse::Error) -> Error {
    match err {
        httparse::Error::TooManyHeaders => {
            http_error(STATUS_HEADERS_TOO_LARGE, "too many request headers")
        }
        httparse::Error::HeaderName | httparse::Error::HeaderValue => {
            http_error(STATUS_BAD_REQUEST, "invalid header")
        }
        httparse::Error::Version => http_error(STATUS_BAD_REQUEST, "invalid http version"),
        _ => http_error(STATUS_BAD_REQUEST, "malformed request line"),
    }
}

/// Header slots for httparse: on the stack up to [`STACK_HEADERS`], else on the heap.
fn with_header_slots<'b, T>(max: usize, f: impl FnOnce(&mut [httparse::Header<'b>]) -> T) -> T {
    let mut stack: [httparse::Header<'b>; STACK_HEADERS] = [httparse::EMPTY_HEADER; STACK_HEADERS];
    if max <= STACK_HEADERS {
        f(&mut stack[..max])
    } else {
        f(&mut vec![httparse::EMPTY_HEADER; max])
    }
}

/// Parse a complete head (`bytes` ends with its empty line). `Ok(None)` means httparse wants
/// more (only blank lines so far).
fn parse_head(bytes: &[u8], limits: &Limits) -> Result<Option<RequestHead>> {
    with_header_slots(limits.max_headers, |slots| {
        let mut req = httparse::Request::new(slots);
        match req.parse(bytes) {
            Ok(httparse::Status::Complete(_)) => head_from_parsed(&req).map(Some),
            Ok(httparse::Status::Partial) => Ok(None),
            Err(e) => Err(map_httparse_error(e)),
        }
    })
}

/// The size in a chunk-size line (CRLF already removed): `1*HEXDIG [ext] [OWS]`, where the
/// extensions (`;name[=value]`, RFC 9112 section 7.1.1) are ignored but may hold no control
/// characters.
fn parse_chunk_size(line: &[u8]) -> Result<u64> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    let rest = trim_ows(&line[digits..]);
    if digits == 0 || !(rest.is_empty() || rest[0] == b';') {
        return Err(http_error(STATUS_BAD_REQUEST, "invalid chunk size"));
    }
    if rest.iter().any(|&b| (b < b' ' && b != b'\t') || b == 0x7f) {
        return Err(http_error(STATUS_BAD_REQUEST, "invalid chunk extension"));
    }
    line[..digits]
        .iter()
        .try_fold(0u64, |size, &b| {
            let digit = u64::from((b as char).to_digit(16)?);
            size.checked_mul(16)?.checked_add(digit)
        })
        .ok_or_else(|| http_error(STATUS_BAD_REQUEST, "chunk size too large"))
}

/// Parse a complete trailer section (CRLF-terminated lines ending with an empty line).
fn parse_trailers(section: &[u8], max_fields: usize) -> Result<Fields> {
    if section == b"\r\n" {
        return Ok(Vec::new());
    }
    with_header_slots(max_fields, |slots| {
        match httparse::parse_headers(section, slots) {
            Ok(httparse::Status::Complete((_, fields))) => Ok(lowercase_fields(fields)),
            Ok(httparse::Status::Partial) => {
                Err(http_error(STATUS_BAD_REQUEST, "invalid trailer field"))
            }
            Err(httparse::Error::TooManyHeaders) => Err(http_error(
                STATUS_HEADERS_TOO_LARGE,
                "too many trailer fields",
            )),
            Err(_) => Err(http_error(STATUS_BAD_REQUEST, "invalid trailer field")),
        }
    })
}

/// What [`StreamParser::feed`] found in the bytes so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a> {
    /// A complete request head; its body (if any) follows as `Data`.
    Head(RequestHead),
    /// Body bytes, de-chunked. Never empty.
    Data(&'a [u8]),
    /// The end of the request, with the trailer fields of a chunked body (else empty).
    End(Fields),
}

/// One `feed`'s result: the events, then the violation that stopped parsing, if any. After
/// a violation the caller answers with its status and closes; the parser stays silent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output<'a> {
    pub events: Vec<Event<'a>>,
    pub error: Option<Error>,
}

/// Where the parser is; the transition table is in the module comment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Head,
    Body(u64),
    ChunkSize,
    ChunkData(u64),
    ChunkEnd,
    Trailers,
    Done,
    Failed,
}

/// An event whose data is a range of the bytes being parsed (turned into slices at the end
/// of `feed`, once the buffer no longer changes).
enum RawEvent {
    Head(RequestHead),
    Data(usize, usize),
    End(Fields),
}

/// Incremental HTTP/1.x request parser emitting events; see the module comment.
#[derive(Debug)]
pub struct StreamParser {
    limits: Limits,
    buf: Vec<u8>,
    /// Start of the unparsed bytes in `buf`.
    pos: usize,
    /// Offset (relative to `pos`) where the next search for a line end starts.
    scan_from: usize,
    state: State,
}

impl StreamParser {
    pub fn new(limits: Limits) -> Self {
        StreamParser {
            limits,
            buf: Vec::new(),
            pos: 0,
            scan_from: 0,
            state: State::Head,
        }
    }

    /// Bytes received and not yet parsed (a partial line, or what follows a complete request).
    pub fn buffered(&self) -> usize {
        if self.state == State::Failed {
            return 0;
        }
        self.buf.len() - self.pos
    }

    /// True once the current request has ended (until `start_next_cycle`).
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// After the request ended (and was answered), parse the next one; `feed(b"")` then
    /// returns the events of whatever is already buffered (pipelining).
    pub fn start_next_cycle(&mut self) -> Result<()> {
        if self.state != State::Done {
            return Err(Error::InvalidArgument(
                "start_next_cycle: the current request has not ended".to_owned(),
            ));
        }
        self.state = State::Head;
        self.scan_from = 0;
        Ok(())
    }

    /// Drain every buffered byte not yet parsed (after an upgrade the rest of the stream
    /// belongs to the websocket decoder). The parser starts afresh afterwards.
    pub fn take_rest(&mut self) -> Vec<u8> {
        let rest = if self.pos == 0 {
            std::mem::take(&mut self.buf)
        } else {
            let rest = self.buf[self.pos..].to_vec();
            self.buf.clear();
            rest
        };
        self.pos = 0;
        self.scan_from = 0;
        self.state = State::Head;
        rest
    }

    /// Parse `data` (after whatever is buffered) as far as it goes.
    pub fn feed<'a>(&'a mut self, data: &'a [u8]) -> Output<'a> {
        if self.state == State::Failed {
            self.buf = Vec::new();
            self.pos = 0;
            return Output {
                events: Vec::new(),
                error: None,
            };
        }
        self.compact();
        let mut raw = Vec::new();
        if self.pos == self.buf.len() {
            // Nothing buffered: parse the caller's bytes in place, keep only the tail.
            let (used, error) = self.run(data, &mut raw);
            if error.is_none() {
                self.buf.extend_from_slice(&data[used..]);
            }
            Self::output(data, raw, error)
        } else {
            self.buf.extend_from_slice(data);
            let buf = std::mem::take(&mut self.buf);
            let start = self.pos;
            let (used, error) = self.run(&buf[start..], &mut raw);
            self.buf = buf;
            self.pos += used;
            Self::output(&self.buf[start..], raw, error)
        }
    }

    fn output(bytes: &[u8], raw: Vec<RawEvent>, error: Option<Error>) -> Output<'_> {
        let events = raw
            .into_iter()
            .map(|ev| match ev {
                RawEvent::Head(head) => Event::Head(head),
                RawEvent::Data(from, to) => Event::Data(&bytes[from..to]),
                RawEvent::End(trailers) => Event::End(trailers),
            })
            .collect();
        Output { events, error }
    }

    /// Advance the state machine over `w`; returns how many bytes were consumed.
    fn run(&mut self, w: &[u8], out: &mut Vec<RawEvent>) -> (usize, Option<Error>) {
        let mut i = 0;
        let result = loop {
            match self.step(w, &mut i, out) {
                Ok(true) => {}
                Ok(false) => break None,
                Err(err) => break Some(err),
            }
        };
        if result.is_some() {
            self.state = State::Failed;
        }
        (i, result)
    }

    /// One transition; Ok(false) when more bytes are needed (or the request is done).
    fn step(&mut self, w: &[u8], i: &mut usize, out: &mut Vec<RawEvent>) -> Result<bool> {
        let avail = &w[*i..];
        match self.state {
            State::Head => {
                let Some(end) = find_head_end(avail, self.scan_from) else {
                    if avail.len() > self.limits.max_head {
                        return Err(head_too_large());
                    }
                    check_partial_head(avail, self.scan_from)?;
                    self.scan_from = rescan_from(avail.len());
                    return Ok(false);
                };
                if end > self.limits.max_head {
                    return Err(head_too_large());
                }
                let Some(head) = parse_head(&avail[..end], &self.limits)? else {
                    // Only blank lines so far: keep them and look for the next terminator.
                    self.scan_from = end;
                    return Ok(true);
                };
                *i += end;
                self.scan_from = 0;
                self.state = match head.framing {
                    Framing::Length(0) => State::Done,
                    Framing::Length(n) => State::Body(n),
                    Framing::Chunked => State::ChunkSize,
                };
                out.push(RawEvent::Head(head));
                if self.state == State::Done {
                    out.push(RawEvent::End(Vec::new()));
                }
            }
            State::Body(left) => {
                let n = take_data(avail, left, *i, out);
                *i += n;
                if left == n as u64 {
                    out.push(RawEvent::End(Vec::new()));
                    self.state = State::Done;
                } else {
                    self.state = State::Body(left - n as u64);
                    return Ok(false);
                }
            }
            State::ChunkSize => {
                let max = self.limits.max_chunk_line;
                let Some(nl) = find_byte(avail, self.scan_from, b'\n') else {
                    if avail.len() >= max {
                        return Err(http_error(STATUS_BAD_REQUEST, "chunk size line too long"));
                    }
                    self.scan_from = avail.len();
                    return Ok(false);
                };
                if nl + 1 > max {
                    return Err(http_error(STATUS_BAD_REQUEST, "chunk size line too long"));
                }
                let Some(line) = avail[..nl].strip_suffix(b"\r") else {
                    return Err(http_error(
                        STATUS_BAD_REQUEST,
                        "chunk size line must end with CRLF",
                    ));
                };
                let size = parse_chunk_size(line)?;
                *i += nl + 1;
                self.scan_from = 0;
                self.state = if size == 0 {
                    State::Trailers
                } else {
                    State::ChunkData(size)
                };
            }
            State::ChunkData(left) => {
                let n = take_data(avail, left, *i, out);
                *i += n;
                if left == n as u64 {
                    self.state = State::ChunkEnd;
                } else {
                    self.state = State::ChunkData(left - n as u64);
                    return Ok(false);
                }
            }
            State::ChunkEnd => match avail {
                [b'\r', b'\n', ..] => {
                    *i += 2;
                    self.state = State::ChunkSize;
                }
                [] | [b'\r'] => return Ok(false),
                _ => {
                    return Err(http_error(
                        STATUS_BAD_REQUEST,
                        "chunk data not followed by CRLF",
                    ))
                }
            },
            State::Trailers => {
                let max = self.limits.max_trailers;
                loop {
                    let line_start = self.scan_from;
                    let Some(nl) = find_byte(avail, line_start, b'\n') else {
                        if avail.len() >= max {
                            return Err(trailers_too_large());
                        }
                        return Ok(false);
                    };
                    if nl == line_start || avail[nl - 1] != b'\r' {
                        return Err(http_error(
                            STATUS_BAD_REQUEST,
                            "trailer line must end with CRLF",
                        ));
                    }
                    if nl + 1 > max {
                        return Err(trailers_too_large());
                    }
                    self.scan_from = nl + 1;
                    if nl == line_start + 1 {
                        // The empty line: the section is complete.
                        let trailers = parse_trailers(&avail[..=nl], self.limits.max_headers)?;
                        *i += nl + 1;
                        self.scan_from = 0;
                        self.state = State::Done;
                        out.push(RawEvent::End(trailers));
                        break;
                    }
                }
            }
            State::Done | State::Failed => return Ok(false),
        }
        Ok(true)
    }

    /// Drop the consumed prefix when nothing is left or it is big enough to be worth a shift.
    fn compact(&mut self) {
        if self.pos == 0 {
            return;
        }
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos >= COMPACT_AT && self.pos * 2 >= self.buf.len() {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
    }
}

impl Default for StreamParser {
    fn default() -> Self {
        StreamParser::new(Limits::default())
    }
}

fn head_too_large() -> Error {
    http_error(STATUS_HEADERS_TOO_LARGE, "request header fields too large")
}

fn trailers_too_large() -> Error {
    http_error(STATUS_HEADERS_TOO_LARGE, "trailer section too large")
}

/// Emit up to `left` body bytes from the front of `avail` (at offset `at` of the parsed
/// bytes); returns how many.
fn take_data(avail: &[u8], left: u64, at: usize, out: &mut Vec<RawEvent>) -> usize {
    let n = usize::try_from(left).map_or(avail.len(), |l| l.min(avail.len()));
    if n > 0 {
        out.push(RawEvent::Data(at, at + n));
    }
    n
}

fn find_byte(buf: &[u8], from: usize, byte: u8) -> Option<usize> {
    buf.get(from..)?
        .iter()
        .position(|&b| b == byte)
        .map(|off| from + off)
}

/// `Sec-WebSocket-Accept` for a key (RFC 6455 section 4.2.2, item 5.4).
pub fn websocket_accept(key: &[u8]) -> String {
    let mut sha = Sha1::new();
    sha.update(key);
    sha.update(WEBSOCKET_GUID);
    BASE64.encode(sha.finalize())
}

/// The single value of a header that must appear once (RFC 6455 section 11.3).
fn single_header<'a>(head: &'a RequestHead, name: &'a str) -> Result<Option<&'a [u8]>> {
    let mut values = head.headers_named(name);
    let first = values.next();
    if values.next().is_some() {
        return Err(http_error(STATUS_BAD_REQUEST, "duplicate websocket header"));
    }
    Ok(first)
}

/// Check a websocket opening handshake (RFC 6455 section 4.2.1) and return the accept value.
/// A wrong version is 426 (section 4.4: the reply should carry `Sec-WebSocket-Version: 13`);
/// anything else wrong is 400.
pub fn validate_websocket_upgrade(head: &RequestHead) -> Result<String> {
    if head.method != "GET" {
        return Err(http_error(
            STATUS_BAD_REQUEST,
            "websocket upgrade requires GET",
        ));
    }
    if head.version < 1 {
        return Err(http_error(
            STATUS_BAD_REQUEST,
            "websocket upgrade requires HTTP/1.1",
        ));
    }
    if !head.is_websocket_upgrade {
        return Err(http_error(STATUS_BAD_REQUEST, "not a websocket upgrade"));
    }
    let version = single_header(head, "sec-websocket-version")?;
    if version.map(trim_ows) != Some(WEBSOCKET_VERSION) {
        return Err(http_error(
            STATUS_UPGRADE_REQUIRED,
            "unsupported websocket version",
        ));
    }
    let key = single_header(head, "sec-websocket-key")?
        .map(trim_ows)
        .ok_or_else(|| http_error(STATUS_BAD_REQUEST, "missing websocket key"))?;
    match BASE64.decode(key) {
        Ok(nonce) if nonce.len() == WEBSOCKET_KEY_LEN => Ok(websocket_accept(key)),
        _ => Err(http_error(STATUS_BAD_REQUEST, "invalid websocket key")),
    }
}

/// The reason phrase we send for a status (RFC 9110 section 15; RFC 6585 for 428-431, 511).
/// Unknown statuses get an empty phrase, which RFC 9112 section 4 allows.
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        206 => "Partial Content",
        301 => "Moved Permanently",
        302 => "Found",
        303 => "See Other",
        304 => "Not Modified",
        307 => "Temporary Redirect",
        308 => "Permanent Redirect",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        511 => "Network Authentication Required",
        _ => "",
    }
}

/// The `tchar` punctuation of RFC 9110 section 5.6.2.
const TCHAR_PUNCT: &[u8] = b"!#$%&'*+-.^_`|~";

/// One byte of a token (RFC 9110 section 5.6.2): methods and header names.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || TCHAR_PUNCT.contains(&b)
}

/// A method or header name must be a token (RFC 9110 section 5.6.2).
pub(crate) fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// Reject a field that would let a caller inject a header or split the message: a name that
/// is no token, a value with CR, LF or NUL. Both directions' encoders check with it.
pub(crate) fn check_field(name: &str, value: &str) -> Result<()> {
    if !is_token(name) {
        return Err(Error::InvalidArgument(format!(
            "invalid header name {name:?}"
        )));
    }
    if value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Err(Error::InvalidArgument(format!(
            "invalid value for header {name:?}"
        )));
    }
    Ok(())
}

/// [`check_field`] for each field, and no framing fields (they are computed here).
fn check_headers(headers: &[(&str, &str)]) -> Result<()> {
    for (name, value) in headers {
        check_field(name, value)?;
        if name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding")
        {
            return Err(Error::InvalidArgument(
                "content-length and transfer-encoding are computed; do not pass them".to_owned(),
            ));
        }
    }
    Ok(())
}

fn write_headers(out: &mut Vec<u8>, headers: &[(&str, &str)]) {
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

fn headers_len(headers: &[(&str, &str)]) -> usize {
    headers.iter().map(|(n, v)| n.len() + v.len() + 4).sum()
}

fn check_status(status: u16) -> Result<()> {
    if (100..=999).contains(&status) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "status {status} is not three digits"
        )))
    }
}

/// 1xx and 204 responses never have content nor Content-Length (RFC 9110 section 8.6).
pub fn is_bodyless(status: u16) -> bool {
    status < 200 || status == 204
}

/// Status line, caller's headers, framing header, `Connection: close`, empty line.
fn write_response_head(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(&str, &str)],
    framing: Option<Framing>,
    close: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(reason_phrase(status).as_bytes());
    out.extend_from_slice(b"\r\n");
    write_headers(out, headers);
    match framing {
        Some(Framing::Length(n)) => {
            out.extend_from_slice(b"Content-Length: ");
            out.extend_from_slice(n.to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Some(Framing::Chunked) => out.extend_from_slice(b"Transfer-Encoding: chunked\r\n"),
        None => {}
    }
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// A complete HTTP/1.1 response. Content-Length is always computed here, except for 1xx and
/// 204 which must not carry one (RFC 9110 section 8.6) and so must have no body.
pub fn encode_response(
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    close: bool,
) -> Result<Vec<u8>> {
    check_status(status)?;
    check_headers(headers)?;
    let bodyless = is_bodyless(status);
    if bodyless && !body.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "status {status} cannot have a body"
        )));
    }
    let framing = (!bodyless).then_some(Framing::Length(body.len() as u64));
    let mut out = Vec::with_capacity(80 + headers_len(headers) + body.len());
    write_response_head(&mut out, status, headers, framing, close);
    out.extend_from_slice(body);
    Ok(out)
}

/// The head of a response whose body the caller writes next: `Some(Length(n))` for n bytes
/// as they are, `Some(Chunked)` for [`encode_chunk`]s ended by [`encode_last_chunk`], `None`
/// for the bodyless 1xx and 204, or, with `close`, for a body that ends when the connection
/// closes (RFC 9112 section 6.3, item 8: how an HTTP/1.0 client, which cannot read chunked,
/// gets a body of unknown length). A response to HEAD is this head alone, with the framing a
/// GET would have had.
pub fn encode_response_head(
    status: u16,
    headers: &[(&str, &str)],
    framing: Option<Framing>,
    close: bool,
) -> Result<Vec<u8>> {
    check_status(status)?;
    check_headers(headers)?;
    match (is_bodyless(status), framing) {
        (true, Some(_)) => Err(Error::InvalidArgument(format!(
            "status {status} cannot have a body: give neither content_length nor chunked"
        ))),
        (false, None) if !close => Err(Error::InvalidArgument(format!(
            "status {status} has a body: give content_length or chunked (or close)"
        ))),
        _ => {
            let mut out = Vec::with_capacity(80 + headers_len(headers));
            write_response_head(&mut out, status, headers, framing, close);
            Ok(out)
        }
    }
}

/// One chunk of a chunked body (RFC 9112 section 7.1): size in hex, CRLF, data, CRLF. Empty
/// data encodes to nothing, since a zero-size chunk would end the body.
pub fn encode_chunk(data: &[u8]) -> Vec<u8> {
    if data.is_empty() {
        return Vec::new();
    }
    let size = format!("{:x}\r\n", data.len());
    let mut out = Vec::with_capacity(size.len() + data.len() + 2);
    out.extend_from_slice(size.as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

/// The last chunk and trailer section that end a chunked body (RFC 9112 section 7.1.2).
pub fn encode_last_chunk(trailers: &[(&str, &str)]) -> Result<Vec<u8>> {
    check_headers(trailers)?;
    let mut out = Vec::with_capacity(5 + headers_len(trailers));
    out.extend_from_slice(b"0\r\n");
    write_headers(&mut out, trailers);
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

/// The 101 response completing a websocket handshake (RFC 6455 section 4.2.2, item 5).
pub fn encode_switching_protocols(accept: &str, headers: &[(&str, &str)]) -> Result<Vec<u8>> {
    check_headers(&[("Sec-WebSocket-Accept", accept)])?;
    check_headers(headers)?;
    let mut out = Vec::with_capacity(128 + accept.len() + headers_len(headers));
    out.extend_from_slice(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n",
    );
    write_headers(&mut out, &[("Sec-WebSocket-Accept", accept)]);
    write_headers(&mut out, headers);
    out.extend_from_slice(b"\r\n");
    Ok(out)
}

/// A request line we may send: the method a token, the target without spaces or controls
/// (which would split the line). Both request encoders (this file's and the tunnel connector's).
pub(crate) fn check_request_line(method: &str, target: &str) -> Result<()> {
    if !is_token(method) {
        return Err(Error::InvalidArgument(format!("invalid method {method:?}")));
    }
    if target.is_empty() || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(Error::InvalidArgument(format!(
            "invalid request target {target:?}"
        )));
    }
    Ok(())
}

/// A client request; Content-Length is added when the body is non-empty.
pub fn encode_request(
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Vec<u8>> {
    check_request_line(method, target)?;
    check_headers(headers)?;
    let mut out =
        Vec::with_capacity(64 + method.len() + target.len() + headers_len(headers) + body.len());
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    write_headers(&mut out, headers);
    if !body.is_empty() {
        out.extend_from_slice(b"Content-Length: ");
        out.extend_from_slice(body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    Ok(out)
}

// ---- client side: responses ----------------------------------------------------------------
//
// The responses of one kept-alive connection we are the client of (the tunnel connector's
// target connections; the websocket client's upgrade reads its head alone), RFC 9112, one
// response per [`ResponseParser::start`]:
//
// ```text
//  state      on                                          emits                 next
//  Idle       any byte                                    Err (unasked data)    Failed
//  Head       1xx head                                    -                     Head
//  Head       head, no body (HEAD, 204, 304, length 0)    Head(body=b""), End   Idle
//  Head       head, Content-Length n <= whole_limit       -                     Whole(n)
//  Head       head, Content-Length n > whole_limit        Head(body=None)       Length(n)
//  Head       head, Transfer-Encoding ..., chunked        Head(body=None)       ChunkSize
//  Head       head, neither (or another coding)           Head(body=None)       Eof
//  Whole(n)   n bytes gathered                            Head(body), End       Idle
//  Length(n)  bytes (up to n)                             Data                  Length(n-k) / End
//  ChunkSize  `hex[;ext]CRLF` n > 0 / `0CRLF`             -                     ChunkData / Trailers
//  ChunkData  bytes (up to n)                             Data                  ChunkData / ChunkEnd
//  ChunkEnd   CRLF                                        -                     ChunkSize
//  Trailers   fields up to an empty line                  End                   Idle
//  Eof        bytes / `feed_eof`                          Data / End            - / Idle
//  any        a framing or limit violation                Err                   Failed
// ```
//
// Framing (RFC 9112 section 6.3): Transfer-Encoding wins over Content-Length; a
// Transfer-Encoding whose last coding is not `chunked` is read to the end of the connection;
// differing or malformed Content-Length values are an error (a response that could be read
// two ways must not be passed on). The connection is reusable after `End` unless the response
// said `Connection: close`, was HTTP/1.0 without `keep-alive`, or ran to EOF.
//
// Limits (a server is trusted more than a client, but a broken one must not make us buffer
// without bound): the head under [`MAX_RESPONSE_HEAD`] bytes and [`MAX_RESPONSE_HEADERS`]
// fields, a chunk-size line under [`DEFAULT_MAX_CHUNK_LINE`], trailers under
// [`MAX_RESPONSE_TRAILERS`]; body bytes are handed out as they arrive, except the small body
// gathered whole (at most the caller's `whole_limit`). Errors are `Error::HttpResponse`.

/// Largest response head accepted (status line and fields): generous for a reverse proxy's
/// upstream (cookies, CSP headers), and a bound on what a broken server makes us keep.
pub const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// Most header fields in one response head.
pub const MAX_RESPONSE_HEADERS: usize = 128;
/// Largest trailer section kept while looking for its end.
pub const MAX_RESPONSE_TRAILERS: usize = 16 * 1024;

/// A response head: status, HTTP/1.0 or not, fields (names lower-cased, values as sent), and
/// its length in bytes (1xx heads included: a caller that skips them skips their bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub http10: bool,
    pub fields: Fields,
    pub len: usize,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::HttpResponse(reason.into())
}

/// The response head at the start of `data` once complete (None until then), within
/// [`MAX_RESPONSE_HEAD`] and [`MAX_RESPONSE_HEADERS`]: the one response-head parser (the
/// websocket client's upgrade and [`ResponseParser`]).
pub fn parse_response_head(data: &[u8]) -> Result<Option<ResponseHead>> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    let len = match resp.parse(data) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if data.len() > MAX_RESPONSE_HEAD {
                return Err(bad("response head too large"));
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => return Err(bad("too many response header fields")),
        Err(err) => return Err(bad(format!("malformed response head ({err})"))),
    };
    if len > MAX_RESPONSE_HEAD {
        return Err(bad("response head too large"));
    }
    let status = resp.code.ok_or_else(|| bad("malformed response head"))?;
    if status < 100 {
        return Err(bad(format!("response status {status} out of range")));
    }
    Ok(Some(ResponseHead {
        status,
        http10: resp.version == Some(0),
        fields: lowercase_fields(resp.headers),
        len,
    }))
}

/// What a slice of a response connection's bytes meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseEvent {
    /// The final (non-1xx) head; `body` is the whole body when it was gathered with the head
    /// (a Content-Length body within `whole_limit`, or none at all), else the body follows as
    /// `Data` events.
    Head {
        status: u16,
        headers: Fields,
        body: Option<Vec<u8>>,
    },
    /// Body bytes of a streamed response.
    Data(Vec<u8>),
    /// The response is complete; [`ResponseParser::keep_alive`] says if the connection may
    /// carry another request.
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResponseState {
    Idle,
    Head,
    Whole(usize),
    Length(u64),
    ChunkSize,
    ChunkData(u64),
    ChunkEnd,
    Trailers,
    Eof,
    Failed,
}

/// The responses of one connection, one at a time (see the module docs).
#[derive(Debug)]
pub struct ResponseParser {
    state: ResponseState,
    /// bytes received and not yet consumed (an incomplete head, chunk line, small body)
    buf: Vec<u8>,
    whole_limit: usize,
    /// the request was HEAD: no body whatever the head says
    head_request: bool,
    keep_alive: bool,
    /// the head held back while its small body is gathered
    held: Option<(u16, Fields)>,
    error: Option<Error>,
    /// events in the caller's list when this `feed` began
    events_before: usize,
}

impl Default for ResponseParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ResponseParser {
    pub fn new() -> Self {
        ResponseParser {
            state: ResponseState::Idle,
            buf: Vec::new(),
            whole_limit: 0,
            head_request: false,
            keep_alive: false,
            held: None,
            error: None,
            events_before: 0,
        }
    }

    /// Expect the response to a request just sent: `head_request` for HEAD (no body), and
    /// a Content-Length body up to `whole_limit` bytes is gathered and handed over with the
    /// head. Errors when the previous response is not over (a caller bug).
    pub fn start(&mut self, head_request: bool, whole_limit: usize) -> Result<()> {
        if self.state != ResponseState::Idle {
            return Err(Error::InvalidArgument(format!(
                "a response is still being read ({:?})",
                self.state
            )));
        }
        self.state = ResponseState::Head;
        self.head_request = head_request;
        self.whole_limit = whole_limit;
        self.keep_alive = false;
        Ok(())
    }

    /// Between responses (a new request may be sent).
    pub fn is_idle(&self) -> bool {
        self.state == ResponseState::Idle
    }

    /// The last complete response allows another request on this connection.
    pub fn keep_alive(&self) -> bool {
        self.keep_alive
    }

    /// Bytes held (an incomplete head, chunk line or small body).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The events of `data`, appended to `out`. After an error every later call returns it
    /// again: the connection must be dropped.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<ResponseEvent>) -> Result<()> {
        if let Some(err) = &self.error {
            return Err(err.clone());
        }
        self.events_before = out.len();
        let result = if self.buf.is_empty() {
            // the common case: nothing held over, parse the new bytes where they are
            self.run(data, out).map(|used| {
                if used < data.len() {
                    self.buf.extend_from_slice(&data[used..]);
                }
            })
        } else {
            let mut buf = std::mem::take(&mut self.buf);
            buf.extend_from_slice(data);
            self.run(&buf, out).map(|used| {
                buf.drain(..used);
                self.buf = buf;
            })
        };
        if let Err(err) = &result {
            self.state = ResponseState::Failed;
            self.error = Some(err.clone());
        }
        result
    }

    /// The target closed the connection: ends a response delimited by the close (`End`,
    /// returns true); false when no response was under way; an error when one was cut short.
    pub fn feed_eof(&mut self, out: &mut Vec<ResponseEvent>) -> Result<bool> {
        match self.state {
            ResponseState::Eof => {
                self.state = ResponseState::Idle;
                self.keep_alive = false;
                out.push(ResponseEvent::End);
                Ok(true)
            }
            ResponseState::Idle => Ok(false),
            ResponseState::Failed => Err(self.error.clone().unwrap_or_else(|| bad("failed"))),
            state => {
                let err = bad(match state {
                    ResponseState::Head => "the connection closed before the response head",
                    _ => "the connection closed in the middle of the response body",
                });
                self.state = ResponseState::Failed;
                self.error = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Consume what can be consumed of `w`; returns the bytes used.
    fn run(&mut self, w: &[u8], out: &mut Vec<ResponseEvent>) -> Result<usize> {
        let mut i = 0;
        loop {
            let avail = &w[i..];
            match self.state {
                ResponseState::Idle => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let err = bad("data without a request");
                    if out.len() > self.events_before {
                        // bytes past the end of an answer this read completed (a HEAD
                        // answered with a body, say): the answer stands, the connection is
                        // not trusted with another request (and later calls fail)
                        self.keep_alive = false;
                        self.state = ResponseState::Failed;
                        self.error = Some(err);
                        return Ok(w.len());
                    }
                    return Err(err);
                }
                ResponseState::Failed => return Ok(i),
                ResponseState::Head => match self.head(avail, out)? {
                    Some(n) => i += n,
                    None => return Ok(i),
                },
                ResponseState::Whole(n) => {
                    if avail.len() < n {
                        return Ok(i);
                    }
                    let (status, headers) = self.held.take().unwrap_or_default();
                    out.push(ResponseEvent::Head {
                        status,
                        headers,
                        body: Some(avail[..n].to_vec()),
                    });
                    self.end(out);
                    i += n;
                }
                ResponseState::Length(left) => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    out.push(ResponseEvent::Data(avail[..take].to_vec()));
                    i += take;
                    let left = left - take as u64;
                    if left == 0 {
                        self.end(out);
                    } else {
                        self.state = ResponseState::Length(left);
                    }
                }
                ResponseState::ChunkSize => {
                    let Some(nl) = avail.iter().position(|&b| b == b'\n') else {
                        if avail.len() > DEFAULT_MAX_CHUNK_LINE {
                            return Err(bad("chunk size line too long"));
                        }
                        return Ok(i);
                    };
                    if nl + 1 > DEFAULT_MAX_CHUNK_LINE {
                        return Err(bad("chunk size line too long"));
                    }
                    let line = &avail[..nl];
                    let line = line.strip_suffix(b"\r").unwrap_or(line);
                    let size = parse_chunk_size(line)
                        .map_err(|err| bad(format!("{err} in the response")))?;
                    i += nl + 1;
                    self.state = if size == 0 {
                        ResponseState::Trailers
                    } else {
                        ResponseState::ChunkData(size)
                    };
                }
                ResponseState::ChunkData(left) => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    out.push(ResponseEvent::Data(avail[..take].to_vec()));
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        ResponseState::ChunkEnd
                    } else {
                        ResponseState::ChunkData(left)
                    };
                }
                ResponseState::ChunkEnd => {
                    // CRLF after the chunk's data (a bare LF too, lenient as for heads)
                    match avail {
                        [] | [b'\r'] => return Ok(i),
                        [b'\n', ..] => i += 1,
                        [b'\r', b'\n', ..] => i += 2,
                        _ => return Err(bad("chunk data not followed by CRLF")),
                    }
                    self.state = ResponseState::ChunkSize;
                }
                ResponseState::Trailers => match trailers_end(avail)? {
                    Some(n) => {
                        i += n;
                        self.end(out);
                    }
                    None => return Ok(i),
                },
                ResponseState::Eof => {
                    if !avail.is_empty() {
                        out.push(ResponseEvent::Data(avail.to_vec()));
                    }
                    return Ok(w.len());
                }
            }
        }
    }

    fn end(&mut self, out: &mut Vec<ResponseEvent>) {
        self.state = ResponseState::Idle;
        out.push(ResponseEvent::End);
    }

    /// A head at the start of `avail`: its length once complete (state moved on, events
    /// pushed), None while incomplete.
    fn head(&mut self, avail: &[u8], out: &mut Vec<ResponseEvent>) -> Result<Option<usize>> {
        let Some(ResponseHead {
            status,
            http10,
            fields,
            len: n,
        }) = parse_response_head(avail)?
        else {
            return Ok(None);
        };
        if status < 200 {
            return Ok(Some(n)); // interim (100 Continue, 103 Early Hints): the real one follows
        }
        let mut keep = !http10;
        let mut chunked = false;
        let mut coded = false;
        let mut length: Option<u64> = None;
        for (name, value) in &fields {
            match name.as_str() {
                "content-length" => {
                    let value = parse_content_length(value)?;
                    if length.is_some_and(|known| known != value) {
                        return Err(bad("differing Content-Length values in the response"));
                    }
                    length = Some(value);
                }
                "transfer-encoding" => {
                    coded = true;
                    // the last coding decides (RFC 9112 section 6.3, item 4)
                    chunked = last_token(value).eq_ignore_ascii_case(b"chunked");
                }
                "connection" => {
                    for token in value.split(|&b| b == b',') {
                        let token = token.trim_ascii();
                        if token.eq_ignore_ascii_case(b"close") {
                            keep = false;
                        } else if token.eq_ignore_ascii_case(b"keep-alive") && http10 {
                            keep = true;
                        }
                    }
                }
                _ => {}
            }
        }
        let headers = fields;
        self.keep_alive = keep;
        let bodyless = self.head_request || status == 204 || status == 304;
        if bodyless || (!coded && length == Some(0)) {
            out.push(ResponseEvent::Head {
                status,
                headers,
                body: Some(Vec::new()),
            });
            self.end(out);
        } else if coded {
            out.push(ResponseEvent::Head {
                status,
                headers,
                body: None,
            });
            if chunked {
                self.state = ResponseState::ChunkSize;
            } else {
                self.state = ResponseState::Eof;
                self.keep_alive = false;
            }
        } else if let Some(len) = length {
            match usize::try_from(len) {
                Ok(small) if small <= self.whole_limit => {
                    self.held = Some((status, headers));
                    self.state = ResponseState::Whole(small);
                }
                _ => {
                    out.push(ResponseEvent::Head {
                        status,
                        headers,
                        body: None,
                    });
                    self.state = ResponseState::Length(len);
                }
            }
        } else {
            out.push(ResponseEvent::Head {
                status,
                headers,
                body: None,
            });
            self.state = ResponseState::Eof;
            self.keep_alive = false;
        }
        Ok(Some(n))
    }
}

/// Digits only, no sign or spaces inside; a list of equal values (`5, 5`) is one value.
fn parse_content_length(value: &[u8]) -> Result<u64> {
    let mut result: Option<u64> = None;
    for part in value.split(|&b| b == b',') {
        let digits = part.trim_ascii();
        if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
            return Err(bad("malformed Content-Length in the response"));
        }
        let n = digits
            .iter()
            .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0'));
        if result.is_some_and(|known| known != n) {
            return Err(bad("differing Content-Length values in the response"));
        }
        result = Some(n);
    }
    result.ok_or_else(|| bad("malformed Content-Length in the response"))
}

fn last_token(value: &[u8]) -> &[u8] {
    value
        .rsplit(|&b| b == b',')
        .next()
        .unwrap_or_default()
        .trim_ascii()
}

/// The length of the trailer section at the start of `avail` (up to and including its empty
/// line) once complete.
fn trailers_end(avail: &[u8]) -> Result<Option<usize>> {
    let mut at = 0;
    loop {
        let Some(nl) = avail[at..].iter().position(|&b| b == b'\n') else {
            if avail.len() > MAX_RESPONSE_TRAILERS {
                return Err(bad("response trailers too large"));
            }
            return Ok(None);
        };
        let line = &avail[at..at + nl];
        at += nl + 1;
        if line.is_empty() || line == b"\r" {
            return Ok(Some(at));
        }
        if at > MAX_RESPONSE_TRAILERS {
            return Err(bad("response trailers too large"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request with its body, as [`Whole`] gathers it.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Request {
        head: RequestHead,
        body: Vec<u8>,
    }

    /// The stream parser read a whole request at a time, its body gathered: what a
    /// connection's handler sees of the events, for tests that look at whole requests.
    struct Whole {
        inner: StreamParser,
        head: Option<RequestHead>,
        body: Vec<u8>,
        failed: Option<Error>,
    }

    impl Whole {
        fn new(limits: Limits) -> Self {
            Whole {
                inner: StreamParser::new(limits),
                head: None,
                body: Vec::new(),
                failed: None,
            }
        }

        /// The next whole request, None while more bytes are needed; after an error, that
        /// error again.
        fn feed(&mut self, data: &[u8]) -> Result<Option<Request>> {
            if let Some(err) = &self.failed {
                return Err(err.clone());
            }
            if self.inner.is_done() {
                self.inner.start_next_cycle()?;
            }
            let out = self.inner.feed(data);
            let mut request = None;
            for event in out.events {
                match event {
                    Event::Head(head) => self.head = Some(head),
                    Event::Data(bytes) => self.body.extend_from_slice(bytes),
                    Event::End(_) => {
                        let head = self.head.take().expect("End follows Head");
                        let body = std::mem::take(&mut self.body);
                        request = Some(Request { head, body });
                    }
                }
            }
            if let Some(err) = out.error {
                self.failed = Some(err.clone());
                return Err(err);
            }
            Ok(request)
        }

        fn buffered(&self) -> usize {
            self.inner.buffered() + self.body.len()
        }

        fn take_rest(&mut self) -> Vec<u8> {
            self.inner.take_rest()
        }
    }

    fn parser() -> Whole {
        Whole::new(Limits::default())
    }

    fn status_of(err: Error) -> u16 {
        match err {
            Error::Http { status, .. } => status,
            other => panic!("not an http error: {other:?}"),
        }
    }

    const UPGRADE: &[u8] = b"GET /?jwt HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\n\
        Connection: keep-alive, Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
        Sec-WebSocket-Version: 13\r\n\r\n";

    #[test]
    fn parses_simple_get() {
        let req = parser()
            .feed(b"GET /a/b?x=1&y HTTP/1.1\r\nHost: h\r\nX-Thing: V\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(req.head.method, "GET");
        assert_eq!(req.head.path, "/a/b");
        assert_eq!(req.head.query.as_deref(), Some("x=1&y"));
        assert_eq!(req.head.version, 1);
        assert_eq!(
            req.head.headers,
            vec![
                ("host".to_owned(), b"h".to_vec()),
                ("x-thing".to_owned(), b"V".to_vec())
            ]
        );
        assert_eq!(req.head.header("X-THING"), Some(&b"V"[..]));
        assert_eq!(req.head.header("missing"), None);
        assert!(req.body.is_empty());
        assert!(req.head.keep_alive);
        assert!(!req.head.is_websocket_upgrade);
    }

    #[test]
    fn query_is_none_without_question_mark_and_empty_with_one() {
        let req = parser().feed(b"GET /p HTTP/1.1\r\n\r\n").unwrap().unwrap();
        assert_eq!(req.head.query, None);
        let req = parser().feed(b"GET /p? HTTP/1.1\r\n\r\n").unwrap().unwrap();
        assert_eq!(req.head.query.as_deref(), Some(""));
    }

    #[test]
    fn body_by_content_length_across_feeds() {
        let mut p = parser();
        assert_eq!(
            p.feed(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n01234")
                .unwrap(),
            None
        );
        assert_eq!(p.buffered(), 5);
        let req = p.feed(b"56789").unwrap().unwrap();
        assert_eq!(req.body, b"0123456789");
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn head_split_at_every_byte_gives_the_same_request() {
        let whole = parser().feed(UPGRADE).unwrap().unwrap();
        for cut in 0..UPGRADE.len() {
            let mut p = parser();
            assert_eq!(p.feed(&UPGRADE[..cut]).unwrap(), None, "cut {cut}");
            assert_eq!(p.feed(&UPGRADE[cut..]).unwrap().as_ref(), Some(&whole));
        }
        let mut p = parser();
        let mut got = None;
        for b in UPGRADE {
            if let Some(r) = p.feed(std::slice::from_ref(b)).unwrap() {
                got = Some(r);
            }
        }
        assert_eq!(got, Some(whole));
    }

    #[test]
    fn bare_lf_line_ends_are_accepted() {
        let req = parser()
            .feed(b"GET / HTTP/1.1\nHost: h\n\n")
            .unwrap()
            .unwrap();
        assert_eq!(req.head.header("host"), Some(&b"h"[..]));
    }

    #[test]
    fn a_head_that_can_never_complete_is_refused_at_once() {
        for junk in [
            &b"\r\r\r\r"[..],
            b"\0\0\0\0",
            b"GET / HTTP/1.1\r\nHost: x\0",
            b"GET /\rx",
            b" GET / HTTP/1.1",
            b"\r\n\x16\x03\x01",
            b"{\"json\": 1}",
        ] {
            let err = parser()
                .feed(junk)
                .expect_err("refused before the head ends");
            assert_eq!(status_of(err), STATUS_BAD_REQUEST, "{junk:?}");
        }
        // byte by byte too: the check covers what each feed added
        let mut p = parser();
        assert_eq!(p.feed(b"GET / HTTP/1.1\r").unwrap(), None);
        assert_eq!(status_of(p.feed(b"\r").unwrap_err()), STATUS_BAD_REQUEST);
        // and still waits for what may yet become a request
        let mut p = parser();
        for part in [
            &b"\r"[..],
            b"\n",
            b"\r",
            b"\nG",
            b"ET / HTTP/1.1\r",
            b"\n\r\n",
        ] {
            if let Some(req) = p.feed(part).unwrap() {
                assert_eq!(req.head.method, "GET");
                return;
            }
        }
        panic!("the request was not parsed");
    }

    #[test]
    fn leading_blank_lines_are_ignored() {
        let mut p = parser();
        assert_eq!(p.feed(b"\r\n\r\n").unwrap(), None);
        let req = p.feed(b"GET /x HTTP/1.1\r\n\r\n").unwrap().unwrap();
        assert_eq!(req.head.path, "/x");
        let req = parser()
            .feed(b"\r\n\r\nGET /y HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(req.head.path, "/y");
    }

    #[test]
    fn pipelined_requests_stay_buffered() {
        let mut p = parser();
        let data = b"GET /1 HTTP/1.1\r\n\r\nPOST /2 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcGET /3 HTTP/1.1\r\n\r\nGET /4";
        assert_eq!(p.feed(data).unwrap().unwrap().head.path, "/1");
        let second = p.feed(b"").unwrap().unwrap();
        assert_eq!(
            (second.head.path.as_str(), &second.body[..]),
            ("/2", &b"abc"[..])
        );
        assert_eq!(p.feed(b"").unwrap().unwrap().head.path, "/3");
        assert_eq!(p.feed(b"").unwrap(), None);
        assert_eq!(p.buffered(), 6);
        assert_eq!(
            p.feed(b" HTTP/1.1\r\n\r\n").unwrap().unwrap().head.path,
            "/4"
        );
    }

    #[test]
    fn many_pipelined_requests_compact_the_buffer() {
        let mut p = parser();
        let one = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n";
        let mut data = Vec::new();
        for _ in 0..1000 {
            data.extend_from_slice(one);
        }
        let mut n = 0;
        let mut next = p.feed(&data).unwrap();
        while let Some(req) = next {
            assert_eq!(req.head.path, "/x");
            n += 1;
            next = p.feed(b"").unwrap();
        }
        assert_eq!(n, 1000);
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn take_rest_drains_bytes_after_upgrade() {
        let mut p = parser();
        let mut data = UPGRADE.to_vec();
        data.extend_from_slice(b"\x82\x80frame");
        let req = p.feed(&data).unwrap().unwrap();
        assert!(req.head.is_websocket_upgrade);
        assert_eq!(p.take_rest(), b"\x82\x80frame");
        assert_eq!(p.buffered(), 0);
        assert_eq!(p.take_rest(), b"");
    }

    #[test]
    fn head_over_limit_is_431_even_when_incomplete() {
        let mut p = parser();
        let mut head = b"GET / HTTP/1.1\r\nX: ".to_vec();
        head.resize(DEFAULT_MAX_HEAD, b'a');
        assert_eq!(p.feed(&head).unwrap(), None);
        assert_eq!(status_of(p.feed(b"a").unwrap_err()), 431);
        // Poisoned: the same error again, nothing buffered.
        assert_eq!(status_of(p.feed(b"\r\n\r\n").unwrap_err()), 431);
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn head_exactly_at_limit_is_accepted() {
        let mut head = b"GET / HTTP/1.1\r\nX: ".to_vec();
        head.resize(DEFAULT_MAX_HEAD - 4, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        assert_eq!(head.len(), DEFAULT_MAX_HEAD);
        assert!(parser().feed(&head).unwrap().is_some());
        head.insert(20, b'a');
        assert_eq!(status_of(parser().feed(&head).unwrap_err()), 431);
    }

    #[test]
    fn too_many_headers_is_431() {
        let mut data = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..DEFAULT_MAX_HEADERS {
            data.extend_from_slice(format!("h{i}: v\r\n").as_bytes());
        }
        let mut ok = data.clone();
        ok.extend_from_slice(b"\r\n");
        assert_eq!(
            parser().feed(&ok).unwrap().unwrap().head.headers.len(),
            DEFAULT_MAX_HEADERS
        );
        data.extend_from_slice(b"one-more: v\r\n\r\n");
        assert_eq!(status_of(parser().feed(&data).unwrap_err()), 431);
    }

    #[test]
    fn header_limit_above_stack_size_uses_heap() {
        let limits = Limits {
            max_headers: 200,
            ..Limits::default()
        };
        let mut data = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..150 {
            data.extend_from_slice(format!("h{i}: v\r\n").as_bytes());
        }
        data.extend_from_slice(b"\r\n");
        let req = Whole::new(limits).feed(&data).unwrap().unwrap();
        assert_eq!(req.head.headers.len(), 150);
    }

    #[test]
    fn a_length_beyond_64_bits_is_413_before_the_body() {
        let data = b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n";
        assert_eq!(status_of(parser().feed(data).unwrap_err()), 413);
    }

    #[test]
    fn content_length_rules() {
        let cases: &[(&[u8], Option<usize>)] = &[
            (b"Content-Length: 3\r\n", Some(3)),
            (b"Content-Length: 3\r\nContent-Length: 3\r\n", Some(3)),
            (b"Content-Length: 3, 003\r\n", Some(3)),
            (b"Content-Length: 0\r\n", Some(0)),
            (b"Content-Length: 3\r\nContent-Length: 4\r\n", None),
            (b"Content-Length: 3, 4\r\n", None),
            (b"Content-Length: -3\r\n", None),
            (b"Content-Length: +3\r\n", None),
            (b"Content-Length: 3x\r\n", None),
            (b"Content-Length: \r\n", None),
            (b"Content-Length: 3,\r\n", None),
        ];
        for (headers, expect) in cases {
            let mut data = b"POST / HTTP/1.1\r\n".to_vec();
            data.extend_from_slice(headers);
            data.extend_from_slice(b"\r\nabcd");
            let got = parser().feed(&data);
            match expect {
                Some(n) => assert_eq!(got.unwrap().unwrap().body.len(), *n),
                None => assert_eq!(status_of(got.unwrap_err()), 400, "{headers:?}"),
            }
        }
    }

    #[test]
    fn transfer_encoding_framing_rules() {
        // RFC 9112 sections 6.1 and 6.3: (headers, status or None when accepted as chunked)
        let cases: &[(&str, Option<u16>)] = &[
            ("Transfer-Encoding: chunked\r\n", None),
            ("Transfer-Encoding: Chunked\r\n", None),
            (
                "Transfer-Encoding: \r\nTransfer-Encoding: chunked\r\n",
                None,
            ),
            ("Transfer-Encoding: gzip, chunked\r\n", Some(501)),
            (
                "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
                Some(501),
            ),
            ("Transfer-Encoding: x-custom, chunked\r\n", Some(501)),
            ("Transfer-Encoding: gzip\r\n", Some(400)),
            ("Transfer-Encoding: identity\r\n", Some(400)),
            ("Transfer-Encoding: chunked, gzip\r\n", Some(400)),
            ("Transfer-Encoding: chunked, chunked\r\n", Some(400)),
            ("Transfer-Encoding: chunked;q=1\r\n", Some(400)),
            ("Transfer-Encoding: \r\n", Some(400)),
            (
                "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n",
                Some(400),
            ),
            (
                "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
                Some(400),
            ),
        ];
        for (headers, expect) in cases {
            let data = format!("POST / HTTP/1.1\r\n{headers}\r\n3\r\nabc\r\n0\r\n\r\n");
            let got = parser().feed(data.as_bytes());
            match expect {
                None => assert_eq!(got.unwrap().unwrap().body, b"abc", "{headers:?}"),
                Some(status) => assert_eq!(status_of(got.unwrap_err()), *status, "{headers:?}"),
            }
        }
        let data = b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(status_of(parser().feed(data).unwrap_err()), 400);
    }

    #[test]
    fn malformed_heads_are_400() {
        let cases: &[&[u8]] = &[
            b"GET\r\n\r\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"GET / FOO/1.1\r\n\r\n",
            b"G@T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
            b"GET / HTTP/1.1\r\n: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            b"GET /a b HTTP/1.1\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n",
        ];
        for case in cases {
            let err = parser().feed(case).unwrap_err();
            assert_eq!(status_of(err), 400, "{:?}", String::from_utf8_lossy(case));
        }
    }

    #[test]
    fn keep_alive_by_version_and_connection() {
        let cases: &[(&[u8], bool)] = &[
            (b"GET / HTTP/1.1\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", false),
            (
                b"GET / HTTP/1.1\r\nConnection: Upgrade, CLOSE\r\n\r\n",
                false,
            ),
            (b"GET / HTTP/1.0\r\n\r\n", false),
            (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", true),
            (
                b"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n",
                false,
            ),
        ];
        for (data, expect) in cases {
            let req = parser().feed(data).unwrap().unwrap();
            assert_eq!(
                req.head.keep_alive,
                *expect,
                "{:?}",
                String::from_utf8_lossy(data)
            );
        }
    }

    #[test]
    fn websocket_upgrade_detection() {
        let cases: &[(&[u8], bool)] = &[
            (UPGRADE, true),
            (b"GET / HTTP/1.1\r\nUpgrade: WebSocket\r\nConnection: UPGRADE\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nUpgrade: h2c, websocket\r\nConnection: x\r\nConnection: upgrade\r\n\r\n", true),
            (b"POST / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", false),
            (b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n", false),
            (b"GET / HTTP/1.1\r\nConnection: upgrade\r\n\r\n", false),
            (b"GET / HTTP/1.1\r\nUpgrade: websockets\r\nConnection: upgrade\r\n\r\n", false),
            (b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgraded\r\n\r\n", false),
        ];
        for (data, expect) in cases {
            let req = parser().feed(data).unwrap().unwrap();
            assert_eq!(
                req.head.is_websocket_upgrade,
                *expect,
                "{:?}",
                String::from_utf8_lossy(data)
            );
        }
    }

    #[test]
    fn websocket_accept_rfc6455_vector() {
        // RFC 6455 section 1.3 (the value printed there; cross-checked with hashlib).
        assert_eq!(
            websocket_accept(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn validate_upgrade_accepts_rfc_example() {
        let req = parser().feed(UPGRADE).unwrap().unwrap();
        assert_eq!(
            validate_websocket_upgrade(&req.head).unwrap(),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn validate_upgrade_rejections() {
        let base = std::str::from_utf8(UPGRADE).unwrap();
        let cases = [
            (
                base.replace("Sec-WebSocket-Version: 13", "Sec-WebSocket-Version: 8"),
                426,
            ),
            (base.replace("Sec-WebSocket-Version: 13\r\n", ""), 426),
            (
                base.replace("Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", ""),
                400,
            ),
            (
                base.replace("dGhlIHNhbXBsZSBub25jZQ==", "dGhlIHNhbXBsZSBub25jZQ"),
                400,
            ),
            (base.replace("dGhlIHNhbXBsZSBub25jZQ==", "c2hvcnQ="), 400),
            (
                base.replace("dGhlIHNhbXBsZSBub25jZQ==", "!!!!!!!!!!!!!!!!!!!!!!!="),
                400,
            ),
            (base.replace("HTTP/1.1", "HTTP/1.0"), 400),
            (base.replace("Upgrade: websocket\r\n", ""), 400),
            (
                base.replace(
                    "Sec-WebSocket-Version: 13\r\n",
                    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: AAAAAAAAAAAAAAAAAAAAAA==\r\n",
                ),
                400,
            ),
        ];
        for (data, status) in cases {
            let req = parser().feed(data.as_bytes()).unwrap().unwrap();
            let err = validate_websocket_upgrade(&req.head).unwrap_err();
            assert_eq!(status_of(err), status, "{data:?}");
        }
        let mut post = parser()
            .feed(base.replacen("GET", "POST", 1).as_bytes())
            .unwrap()
            .unwrap();
        assert_eq!(
            status_of(validate_websocket_upgrade(&post.head).unwrap_err()),
            400
        );
        post.head.is_websocket_upgrade = true;
        assert_eq!(
            status_of(validate_websocket_upgrade(&post.head).unwrap_err()),
            400
        );
    }

    #[test]
    fn encode_response_golden() {
        let out = encode_response(200, &[("Content-Type", "text/plain")], b"hi", false).unwrap();
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nhi"
        );
        let out = encode_response(431, &[], b"", true).unwrap();
        assert_eq!(
            out,
            &b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"[..]
        );
        let out = encode_response(204, &[], b"", false).unwrap();
        assert_eq!(out, b"HTTP/1.1 204 No Content\r\n\r\n");
        let out = encode_response(599, &[], b"", false).unwrap();
        assert_eq!(out, b"HTTP/1.1 599 \r\nContent-Length: 0\r\n\r\n");
    }

    #[test]
    fn encode_response_rejects_bad_arguments() {
        type Case<'a> = (u16, &'a [(&'a str, &'a str)], &'a [u8]);
        let bad: &[Case<'_>] = &[
            (99, &[], b""),
            (1000, &[], b""),
            (204, &[], b"x"),
            (200, &[("X", "a\r\nInjected: 1")], b""),
            (200, &[("Bad Name", "v")], b""),
            (200, &[("", "v")], b""),
            (200, &[("content-length", "5")], b""),
            (200, &[("Transfer-Encoding", "chunked")], b""),
        ];
        for (status, headers, body) in bad {
            assert!(matches!(
                encode_response(*status, headers, body, false),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn encode_switching_protocols_golden() {
        let out = encode_switching_protocols("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=", &[("X-Relay", "1")])
            .unwrap();
        assert_eq!(
            out,
            &b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
               Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nX-Relay: 1\r\n\r\n"[..]
        );
        assert!(encode_switching_protocols("a\nb", &[]).is_err());
    }

    #[test]
    fn encode_request_golden_and_parses_back() {
        let out = encode_request("POST", "/", &[("Host", "relay")], b"body").unwrap();
        assert_eq!(
            out,
            b"POST / HTTP/1.1\r\nHost: relay\r\nContent-Length: 4\r\n\r\nbody"
        );
        let req = parser().feed(&out).unwrap().unwrap();
        assert_eq!(req.body, b"body");
        let out = encode_request("GET", "/?x", &[], b"").unwrap();
        assert_eq!(out, b"GET /?x HTTP/1.1\r\n\r\n");
        assert!(encode_request("G T", "/", &[], b"").is_err());
        assert!(encode_request("GET", "/a b", &[], b"").is_err());
        assert!(encode_request("GET", "", &[], b"").is_err());
    }

    #[test]
    fn parse_response_head_incremental() {
        let data = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nSec-WebSocket-Accept: abc\r\n\r\n\x81\x00";
        let head_len = data.len() - 2;
        for cut in 0..head_len {
            assert_eq!(
                parse_response_head(&data[..cut]).unwrap(),
                None,
                "cut {cut}"
            );
        }
        let head = parse_response_head(data).unwrap().unwrap();
        assert_eq!((head.status, head.len, head.http10), (101, head_len, false));
        assert_eq!(
            head.fields[1],
            ("sec-websocket-accept".to_owned(), b"abc".to_vec())
        );
    }

    #[test]
    fn parse_response_head_refusals() {
        let refused = |data: &[u8]| match parse_response_head(data) {
            Err(Error::HttpResponse(reason)) => reason,
            other => panic!("{other:?}"),
        };
        assert!(refused(b"HTTP/1.1 abc\r\n\r\n").starts_with("malformed response head"));
        let mut big = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
        big.resize(MAX_RESPONSE_HEAD + 1, b'a');
        assert_eq!(refused(&big), "response head too large");
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_RESPONSE_HEADERS {
            many.extend_from_slice(format!("h{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(refused(&many), "too many response header fields");
        assert_eq!(
            refused(b"HTTP/1.1 099 x\r\n\r\n"),
            "response status 99 out of range"
        );
    }

    #[test]
    fn garbage_and_mutated_requests_end_in_documented_outcomes() {
        // A poor man's fuzz target: never a panic, only documented statuses, and what the
        // stream parser keeps stays under its limits (body bytes are never kept).
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let limits = Limits {
            max_head: 512,
            max_headers: 8,
            max_chunk_line: 32,
            max_trailers: 64,
        };
        let valid: [&[u8]; 2] = [
            b"POST /x?y HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nbody",
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4;a=b\r\nbody\r\n2\r\n!!\r\n0\r\nT: v\r\n\r\n",
        ];
        for round in 0..3000 {
            let data: Vec<u8> = if round % 3 == 0 {
                (0..rng.gen_range(0..700)).map(|_| rng.gen()).collect()
            } else {
                let mut d = valid[round % 3 - 1].to_vec();
                for _ in 0..rng.gen_range(1..4) {
                    let i = rng.gen_range(0..d.len());
                    d[i] = rng.gen();
                }
                d
            };
            let step = rng.gen_range(1..50);
            let mut p = Whole::new(limits);
            for chunk in data.chunks(step) {
                match p.feed(chunk) {
                    Ok(_) => {}
                    Err(Error::Http { status, .. }) => {
                        assert!([400, 413, 431, 501].contains(&status), "{status}");
                        break;
                    }
                    Err(other) => panic!("undocumented error {other:?}"),
                }
                assert!(p.buffered() <= data.len());
            }
            let mut s = StreamParser::new(limits);
            for chunk in data.chunks(step) {
                let out = s.feed(chunk);
                if let Some(err) = out.error {
                    assert!(matches!(
                        err,
                        Error::Http {
                            status: 400 | 413 | 431 | 501,
                            ..
                        }
                    ));
                    break;
                }
                let done = out.events.iter().any(|e| matches!(e, Event::End(_)));
                if !done && !s.is_done() {
                    assert!(s.buffered() <= limits.max_head + step, "{}", s.buffered());
                }
            }
        }
    }

    #[test]
    fn find_head_end_handles_split_terminators() {
        assert_eq!(find_head_end(b"a\r\n\r\n", 0), Some(5));
        assert_eq!(find_head_end(b"a\n\n", 0), Some(3));
        assert_eq!(find_head_end(b"a\r\n\r", 0), None);
        assert_eq!(find_head_end(b"a\r\n", 0), None);
        assert_eq!(find_head_end(b"a\r\nb\r\n\r\nc", 3), Some(8));
    }

    // ---- the event parser ----

    /// An owned view of events, with adjacent Data merged (how data is split depends only on
    /// how the input was split) and a violation as its status.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Ev {
        Head(String, String, Framing, bool),
        Data(Vec<u8>),
        End(Fields),
        Violation(u16),
    }

    fn collect(out: Output<'_>, into: &mut Vec<Ev>) -> bool {
        for event in out.events {
            match event {
                Event::Head(h) => {
                    into.push(Ev::Head(h.method, h.path, h.framing, h.expect_continue))
                }
                Event::Data(d) => match into.last_mut() {
                    Some(Ev::Data(prev)) => prev.extend_from_slice(d),
                    _ => into.push(Ev::Data(d.to_vec())),
                },
                Event::End(t) => into.push(Ev::End(t)),
            }
        }
        match out.error {
            Some(err) => {
                into.push(Ev::Violation(status_of(err)));
                false
            }
            None => true,
        }
    }

    /// Feed the pieces in order, starting the next cycle as soon as a request ends (as a
    /// server does once it has answered), and return every event.
    fn drive(limits: Limits, pieces: &[&[u8]]) -> Vec<Ev> {
        let mut p = StreamParser::new(limits);
        let mut got = Vec::new();
        for piece in pieces {
            let mut data: &[u8] = piece;
            loop {
                if !collect(p.feed(data), &mut got) {
                    return got;
                }
                data = b"";
                if !p.is_done() {
                    break;
                }
                p.start_next_cycle().unwrap();
                if p.buffered() == 0 {
                    break;
                }
            }
        }
        got
    }

    fn fields(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    const CHUNKED: &[u8] =
        b"POST /up HTTP/1.1\r\nTransfer-Encoding: chunked\r\nExpect: 100-Continue\r\n\r\n\
        5;name=val\r\nhello\r\n6 ; x\r\n world\r\n0\r\nChecksum: abc\r\nX-Other: 1\r\n\r\n";

    #[test]
    fn stream_parser_golden_events() {
        let mut p = StreamParser::default();
        let mut data = CHUNKED.to_vec();
        data.extend_from_slice(b"GET /next HTTP/1.1\r\n\r\n");
        let out = p.feed(&data);
        assert_eq!(out.error, None);
        let [Event::Head(head), Event::Data(a), Event::Data(b), Event::End(trailers)] =
            &out.events[..]
        else {
            panic!("{:?}", out.events);
        };
        assert_eq!((head.method.as_str(), head.path.as_str()), ("POST", "/up"));
        assert_eq!(head.framing, Framing::Chunked);
        assert!(head.expect_continue && head.has_body());
        assert_eq!((*a, *b), (&b"hello"[..], &b" world"[..]));
        assert_eq!(trailers, &fields(&[("checksum", "abc"), ("x-other", "1")]));
        // The pipelined request waits for the next cycle.
        assert!(p.is_done());
        assert_eq!(p.feed(b"").events, vec![]);
        assert_eq!(p.buffered(), 22);
        p.start_next_cycle().unwrap();
        let out = p.feed(b"");
        let [Event::Head(next), Event::End(t)] = &out.events[..] else {
            panic!("{:?}", out.events);
        };
        assert_eq!(next.path, "/next");
        assert_eq!(next.framing, Framing::Length(0));
        assert!(!next.has_body() && t.is_empty());
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn content_length_body_streams_as_it_arrives() {
        let mut p = StreamParser::default();
        let out = p.feed(b"PUT /f HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123");
        assert!(
            matches!(&out.events[..], [Event::Head(h), Event::Data(b"0123")] if h.framing == Framing::Length(10))
        );
        assert_eq!(p.feed(b"456").events, vec![Event::Data(b"456")]);
        assert_eq!(
            p.feed(b"789GET").events,
            vec![Event::Data(b"789"), Event::End(vec![])]
        );
        assert_eq!(p.buffered(), 3);
        assert!(p.is_done());
    }

    #[test]
    fn body_bytes_are_slices_of_the_input_and_never_kept() {
        let mut p = StreamParser::default();
        let out = p.feed(b"PUT /f HTTP/1.1\r\nContent-Length: 1048576\r\n\r\n");
        assert_eq!(out.events.len(), 1);
        let piece = vec![7u8; 65536];
        for _ in 0..16 {
            let out = p.feed(&piece);
            let Event::Data(d) = out.events[0] else {
                panic!()
            };
            assert_eq!(
                d.as_ptr(),
                piece.as_ptr(),
                "no copy when nothing is buffered"
            );
            assert_eq!(p.buffered(), 0);
        }
        assert!(p.is_done());
        // Chunked: only an incomplete size line is kept.
        let mut p = StreamParser::default();
        p.feed(b"PUT /f HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
        let mut total = 0;
        for _ in 0..16 {
            let mut piece = b"ffff\r\n".to_vec();
            piece.resize(6 + 0xffff, b'x');
            piece.extend_from_slice(b"\r\n1");
            let out = p.feed(&piece);
            assert_eq!(out.error, None);
            total += out
                .events
                .iter()
                .map(|e| match e {
                    Event::Data(d) => d.len(),
                    _ => 0,
                })
                .sum::<usize>();
            assert!(p.buffered() <= 1, "{}", p.buffered());
            p.feed(b"\r\nx\r\n");
        }
        assert_eq!(total, 16 * 0xffff);
    }

    /// Messages whose events must not depend on how the bytes are split.
    fn split_corpus() -> Vec<u8> {
        let mut data = CHUNKED.to_vec();
        data.extend_from_slice(b"POST /cl HTTP/1.1\r\nContent-Length: 7\r\n\r\nabcdefg");
        data.extend_from_slice(b"\r\n\r\nGET /blank-lines-first HTTP/1.1\r\n\r\n");
        data.extend_from_slice(
            b"PUT /c HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n000A\r\n0123456789\r\n1\r\nZ\r\n0\r\n\r\n",
        );
        data.extend_from_slice(b"DELETE /x HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
        data
    }

    #[test]
    fn any_split_of_the_input_gives_the_same_events() {
        use rand::{Rng, SeedableRng};
        let data = split_corpus();
        let whole = drive(Limits::default(), &[&data]);
        assert_eq!(
            whole,
            vec![
                Ev::Head("POST".into(), "/up".into(), Framing::Chunked, true),
                Ev::Data(b"hello world".to_vec()),
                Ev::End(fields(&[("checksum", "abc"), ("x-other", "1")])),
                Ev::Head("POST".into(), "/cl".into(), Framing::Length(7), false),
                Ev::Data(b"abcdefg".to_vec()),
                Ev::End(vec![]),
                Ev::Head(
                    "GET".into(),
                    "/blank-lines-first".into(),
                    Framing::Length(0),
                    false
                ),
                Ev::End(vec![]),
                Ev::Head("PUT".into(), "/c".into(), Framing::Chunked, false),
                Ev::Data(b"0123456789Z".to_vec()),
                Ev::End(vec![]),
                Ev::Head("DELETE".into(), "/x".into(), Framing::Length(0), false),
                Ev::End(vec![]),
            ]
        );
        let bytewise: Vec<&[u8]> = data.chunks(1).collect();
        assert_eq!(drive(Limits::default(), &bytewise), whole);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..500 {
            let mut cuts: Vec<usize> = (0..rng.gen_range(1..12))
                .map(|_| rng.gen_range(0..=data.len()))
                .collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([data.len()]) {
                pieces.push(&data[from..cut]);
                from = cut;
            }
            assert_eq!(drive(Limits::default(), &pieces), whole, "{pieces:?}");
        }
    }

    #[test]
    fn malformed_chunked_bodies_are_400() {
        let cases: &[&[u8]] = &[
            b"zz\r\n",
            b"\r\n",
            b" 5\r\nhello\r\n",
            b"5 5\r\nhello\r\n",
            b"-5\r\nhello\r\n",
            b"0x5\r\nhello\r\n",
            b"5\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"5\r\nhello\n0\r\n\r\n",
            b"5;a\x01b\r\nhello\r\n",
            b"5\r\r\nhello\r\n",
            b"10000000000000000\r\n",
            b"0\r\nBad Name: v\r\n\r\n",
            b"0\r\nX: v\n\r\n",
            b"0\r\n\n",
            b"0\r\nX: a\r\n folded\r\n\r\n",
        ];
        for body in cases {
            let mut data = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            data.extend_from_slice(body);
            let got = drive(Limits::default(), &[&data]);
            assert_eq!(
                got.last(),
                Some(&Ev::Violation(400)),
                "{:?} -> {got:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn chunk_line_and_trailer_limits() {
        let limits = Limits {
            max_chunk_line: 16,
            max_trailers: 32,
            max_headers: 2,
            ..Limits::default()
        };
        let head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        let with = |body: &[u8]| {
            let mut d = head.clone();
            d.extend_from_slice(body);
            d
        };
        // A 16-byte line (CRLF included) is fine; 17 is not, even before its CRLF arrives.
        let ok = drive(limits, &[&with(b"1;aaaaaaaaaaaa\r\nx\r\n0\r\n\r\n")]);
        assert_eq!(ok.last(), Some(&Ev::End(vec![])));
        let long = drive(limits, &[&with(b"1;aaaaaaaaaaaaa\r\n")]);
        assert_eq!(long.last(), Some(&Ev::Violation(400)));
        let unended = drive(limits, &[&with(b"1;aaaaaaaaaaaaaaaaaaa")]);
        assert_eq!(unended.last(), Some(&Ev::Violation(400)));
        // Trailers: 32 bytes in all, at most max_headers fields.
        let ok = drive(limits, &[&with(b"0\r\nA: 1\r\nB: 2\r\n\r\n")]);
        assert_eq!(ok.last(), Some(&Ev::End(fields(&[("a", "1"), ("b", "2")]))));
        let many = drive(limits, &[&with(b"0\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n")]);
        assert_eq!(many.last(), Some(&Ev::Violation(431)));
        let big = drive(
            limits,
            &[&with(b"0\r\nA: 0123456789012345678901234567\r\n\r\n")],
        );
        assert_eq!(big.last(), Some(&Ev::Violation(431)));
        let trickle = drive(
            limits,
            &[&with(b"0\r\nA: 0123456789"), b"0123456789012345678"],
        );
        assert_eq!(trickle.last(), Some(&Ev::Violation(431)));
    }

    #[test]
    fn after_a_violation_the_parser_is_silent() {
        let mut p = StreamParser::default();
        let out =
            p.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n");
        assert_eq!(out.events.len(), 2);
        assert_eq!(out.error.map(status_of), Some(400));
        let out = p.feed(b"GET / HTTP/1.1\r\n\r\n");
        assert_eq!((out.events.len(), out.error), (0, None));
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn start_next_cycle_before_the_end_is_a_caller_error() {
        let mut p = StreamParser::default();
        assert!(matches!(
            p.start_next_cycle(),
            Err(Error::InvalidArgument(_))
        ));
        p.feed(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\na");
        assert!(matches!(
            p.start_next_cycle(),
            Err(Error::InvalidArgument(_))
        ));
        p.feed(b"b");
        p.start_next_cycle().unwrap();
    }

    #[test]
    fn stream_take_rest_after_upgrade() {
        let mut p = StreamParser::default();
        let mut data = UPGRADE.to_vec();
        data.extend_from_slice(b"\x82\x80frame");
        let out = p.feed(&data);
        assert!(
            matches!(&out.events[..], [Event::Head(h), Event::End(_)] if h.is_websocket_upgrade)
        );
        assert_eq!(p.take_rest(), b"\x82\x80frame");
        assert_eq!(p.buffered(), 0);
    }

    #[test]
    fn expect_continue_only_for_http_1_1() {
        let cases: &[(&[u8], bool)] = &[
            (
                b"PUT / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
                true,
            ),
            (
                b"PUT / HTTP/1.1\r\nexpect: 100-CONTINUE\r\nContent-Length: 1\r\n\r\n",
                true,
            ),
            (
                b"PUT / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
                false,
            ),
            (
                b"PUT / HTTP/1.1\r\nExpect: something-else\r\nContent-Length: 1\r\n\r\n",
                false,
            ),
            (b"PUT / HTTP/1.1\r\nContent-Length: 1\r\n\r\n", false),
        ];
        for (data, expect) in cases {
            let mut p = StreamParser::default();
            let out = p.feed(data);
            let Event::Head(head) = &out.events[0] else {
                panic!()
            };
            assert_eq!(head.expect_continue, *expect);
        }
    }

    // ---- streaming encoders ----

    #[test]
    fn encode_response_head_golden() {
        let h = &[("Content-Type", "text/plain")];
        assert_eq!(
            encode_response_head(200, h, Some(Framing::Chunked), false).unwrap(),
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"[..]
        );
        assert_eq!(
            encode_response_head(200, &[], Some(Framing::Length(5)), true).unwrap(),
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"[..]
        );
        assert_eq!(
            encode_response_head(100, &[], None, false).unwrap(),
            b"HTTP/1.1 100 Continue\r\n\r\n"
        );
        // Delimited by the connection closing (for HTTP/1.0 clients).
        assert_eq!(
            encode_response_head(200, &[], None, true).unwrap(),
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
        );
        assert_eq!(
            encode_response(100, &[], b"", false).unwrap(),
            b"HTTP/1.1 100 Continue\r\n\r\n"
        );
        for (status, framing) in [
            (200, None),
            (204, Some(Framing::Length(0))),
            (100, Some(Framing::Chunked)),
            (42, Some(Framing::Chunked)),
        ] {
            assert!(matches!(
                encode_response_head(status, &[], framing, false),
                Err(Error::InvalidArgument(_))
            ));
        }
        let te = &[("Transfer-Encoding", "chunked")];
        assert!(encode_response_head(200, te, Some(Framing::Chunked), false).is_err());
    }

    #[test]
    fn encode_chunks_golden_and_parse_back() {
        assert_eq!(encode_chunk(b"hello"), b"5\r\nhello\r\n");
        assert_eq!(encode_chunk(&[0u8; 26])[..4], b"1a\r\n"[..]);
        assert_eq!(encode_chunk(b""), b"");
        assert_eq!(encode_last_chunk(&[]).unwrap(), b"0\r\n\r\n");
        assert_eq!(
            encode_last_chunk(&[("Checksum", "abc")]).unwrap(),
            b"0\r\nChecksum: abc\r\n\r\n"
        );
        assert!(encode_last_chunk(&[("X", "a\r\nb")]).is_err());
        // What we send, our parser reads back.
        let mut data = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for piece in [&b"a"[..], &[b'b'; 300][..], b"", b"c"] {
            data.extend_from_slice(&encode_chunk(piece));
        }
        data.extend_from_slice(&encode_last_chunk(&[("T", "1")]).unwrap());
        let got = drive(Limits::default(), &[&data]);
        let mut body = b"a".to_vec();
        body.extend_from_slice(&[b'b'; 300]);
        body.push(b'c');
        assert_eq!(got[1..], [Ev::Data(body), Ev::End(fields(&[("t", "1")]))]);
    }

    // ---- responses ----

    fn feed_response(p: &mut ResponseParser, data: &[u8]) -> Result<Vec<ResponseEvent>> {
        let mut out = Vec::new();
        p.feed(data, &mut out)?;
        Ok(out)
    }

    fn started_response(whole_limit: usize) -> ResponseParser {
        let mut p = ResponseParser::new();
        p.start(false, whole_limit).unwrap();
        p
    }

    fn response_head(status: u16, headers: &[(&str, &str)], body: Option<&[u8]>) -> ResponseEvent {
        ResponseEvent::Head {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect(),
            body: body.map(<[u8]>::to_vec),
        }
    }

    #[test]
    fn small_content_length_body_comes_whole_with_its_head() {
        let mut p = started_response(16);
        let events = feed_response(
            &mut p,
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
        )
        .unwrap();
        assert_eq!(
            events,
            vec![
                response_head(
                    200,
                    &[("content-length", "5"), ("x-a", "1"), ("x-a", "2")],
                    Some(b"hello")
                ),
                ResponseEvent::End
            ]
        );
        assert!(p.is_idle() && p.keep_alive());
    }

    #[test]
    fn split_at_every_byte_gives_the_same_events() {
        let wire = b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc";
        for cut in 0..wire.len() {
            let mut p = started_response(16);
            let mut events = feed_response(&mut p, &wire[..cut]).unwrap();
            events.extend(feed_response(&mut p, &wire[cut..]).unwrap());
            assert_eq!(
                events,
                vec![
                    response_head(201, &[("content-length", "3")], Some(b"abc")),
                    ResponseEvent::End
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_body_over_the_limit_streams() {
        let mut p = started_response(4);
        let events =
            feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc").unwrap();
        assert_eq!(
            events,
            vec![
                response_head(200, &[("content-length", "6")], None),
                ResponseEvent::Data(b"abc".to_vec())
            ]
        );
        let events = feed_response(&mut p, b"def").unwrap();
        assert_eq!(
            events,
            vec![ResponseEvent::Data(b"def".to_vec()), ResponseEvent::End]
        );
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let mut p = started_response(1024);
        let wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 1\r\n\r\n";
        let events = feed_response(&mut p, wire).unwrap();
        assert_eq!(
            events,
            vec![
                response_head(200, &[("transfer-encoding", "chunked")], None),
                ResponseEvent::Data(b"abc".to_vec()),
                ResponseEvent::Data(b"de".to_vec()),
                ResponseEvent::End
            ]
        );
        assert!(p.is_idle() && p.keep_alive());
    }

    #[test]
    fn chunked_split_at_every_byte() {
        let wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        for cut in 0..wire.len() {
            let mut p = started_response(0);
            let mut events = feed_response(&mut p, &wire[..cut]).unwrap();
            events.extend(feed_response(&mut p, &wire[cut..]).unwrap());
            let body: Vec<u8> = events
                .iter()
                .filter_map(|e| match e {
                    ResponseEvent::Data(d) => Some(d.clone()),
                    _ => None,
                })
                .flatten()
                .collect();
            assert_eq!(body, b"abc", "cut at {cut}");
            assert_eq!(events.last(), Some(&ResponseEvent::End), "cut at {cut}");
        }
    }

    #[test]
    fn no_body_for_head_204_304_and_interim_heads_are_skipped() {
        let mut p = ResponseParser::new();
        p.start(true, 0).unwrap();
        let events =
            feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n").unwrap();
        assert_eq!(
            events,
            vec![
                response_head(200, &[("content-length", "100")], Some(b"")),
                ResponseEvent::End
            ]
        );
        p.start(false, 0).unwrap();
        let events = feed_response(
            &mut p,
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            events,
            vec![response_head(204, &[], Some(b"")), ResponseEvent::End]
        );
    }

    #[test]
    fn close_delimited_body_ends_at_eof_and_is_not_reusable() {
        let mut p = started_response(1024);
        let events = feed_response(&mut p, b"HTTP/1.1 200 OK\r\n\r\nsome").unwrap();
        assert_eq!(
            events,
            vec![
                response_head(200, &[], None),
                ResponseEvent::Data(b"some".to_vec())
            ]
        );
        let mut out = Vec::new();
        assert!(p.feed_eof(&mut out).unwrap());
        assert_eq!(out, vec![ResponseEvent::End]);
        assert!(!p.keep_alive());
    }

    #[test]
    fn connection_close_and_http10_are_not_kept_alive() {
        let mut p = started_response(16);
        feed_response(
            &mut p,
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        assert!(!p.keep_alive());
        p.start(false, 16).unwrap();
        feed_response(&mut p, b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert!(!p.keep_alive());
        p.start(false, 16).unwrap();
        feed_response(
            &mut p,
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        assert!(p.keep_alive());
    }

    #[test]
    fn malformed_responses_are_errors_and_stay_errors() {
        let cases: &[&[u8]] = &[
            b"garbage\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXX",
        ];
        for wire in cases {
            let mut p = started_response(1024);
            let err = feed_response(&mut p, wire).unwrap_err();
            assert!(matches!(err, Error::HttpResponse(_)), "{err:?}");
            assert_eq!(feed_response(&mut p, b"").unwrap_err(), err);
        }
    }

    #[test]
    fn data_without_a_request_is_an_error() {
        let mut p = ResponseParser::new();
        assert!(feed_response(&mut p, b"HTTP/1.1 200 OK\r\n\r\n").is_err());
    }

    #[test]
    fn bytes_past_an_answer_keep_the_answer_and_condemn_the_connection() {
        // a HEAD answered with a body: the head is the answer, the body is not ours
        let mut p = ResponseParser::new();
        p.start(true, 16).unwrap();
        let events =
            feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc").unwrap();
        assert_eq!(
            events,
            vec![
                response_head(200, &[("content-length", "3")], Some(b"")),
                ResponseEvent::End
            ]
        );
        assert!(!p.keep_alive());
        assert!(feed_response(&mut p, b"").is_err());
        assert!(p.start(false, 16).is_err());
    }

    #[test]
    fn eof_inside_a_response_is_an_error() {
        let mut p = started_response(1024);
        feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc").unwrap();
        assert!(p.feed_eof(&mut Vec::new()).is_err());
        let mut p = ResponseParser::new();
        assert!(!p.feed_eof(&mut Vec::new()).unwrap());
    }

    #[test]
    fn an_endless_head_is_refused() {
        let mut p = started_response(0);
        let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
        wire.extend(std::iter::repeat_n(b'a', MAX_RESPONSE_HEAD + 10));
        assert!(feed_response(&mut p, &wire).is_err());
    }

    #[test]
    fn two_responses_back_to_back_on_one_connection() {
        let mut p = started_response(16);
        let events =
            feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na").unwrap();
        assert_eq!(events.len(), 2);
        p.start(false, 16).unwrap();
        let events =
            feed_response(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb").unwrap();
        assert_eq!(
            events[0],
            response_head(200, &[("content-length", "1")], Some(b"b"))
        );
    }
}

pub mod py {
    use super::{
        Event, Fields, Framing, Limits, RequestHead, ResponseEvent, ResponseParser, StreamParser,
    };
    use pyo3::exceptions::PyTypeError;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

    /// One HTTP/1.x request head, with its body when it was gathered whole (`HttpParser`,
    /// `with_body`); from `HttpStreamParser` the body follows as events and `body` is b"".
    #[pyclass(frozen, module = "rmb_relay._core", name = "HttpRequest")]
    pub struct HttpRequest {
        head: RequestHead,
        #[pyo3(get)]
        body: Py<PyBytes>,
    }

    fn headers_list<'py>(py: Python<'py>, headers: &Fields) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            headers
                .iter()
                .map(|(n, v)| {
                    PyTuple::new(
                        py,
                        [
                            n.into_pyobject(py)?.into_any(),
                            PyBytes::new(py, v).into_any(),
                        ],
                    )
                })
                .collect::<PyResult<Vec<_>>>()?,
        )
    }

    impl HttpRequest {
        /// A request of this head with no body (the tunnel's hub gives Python back the head of
        /// a request its fast path took, when Python must answer it after all).
        pub(crate) fn from_head(py: Python<'_>, head: RequestHead) -> Self {
            HttpRequest {
                head,
                body: empty_bytes(py),
            }
        }
        /// The request's head, for other Rust modules (the tunnel's hub reads it whole).
        pub(crate) fn head(&self) -> &RequestHead {
            &self.head
        }
        /// The head's fields (lower-case names, raw values), for other Rust modules.
        pub(crate) fn fields(&self) -> &Fields {
            &self.head.headers
        }
    }

    #[pymethods]
    impl HttpRequest {
        #[getter]
        fn method(&self) -> &str {
            &self.head.method
        }
        #[getter]
        fn path(&self) -> &str {
            &self.head.path
        }
        #[getter]
        fn query(&self) -> Option<&str> {
            self.head.query.as_deref()
        }
        #[getter]
        fn version(&self) -> u8 {
            self.head.version
        }
        #[getter]
        fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            headers_list(py, &self.head.headers)
        }
        #[getter]
        fn keep_alive(&self) -> bool {
            self.head.keep_alive
        }
        #[getter]
        fn is_websocket_upgrade(&self) -> bool {
            self.head.is_websocket_upgrade
        }
        /// The announced body length: 0 without a body, None when chunked.
        #[getter]
        fn content_length(&self) -> Option<u64> {
            match self.head.framing {
                Framing::Length(n) => Some(n),
                Framing::Chunked => None,
            }
        }
        #[getter]
        fn chunked(&self) -> bool {
            self.head.framing == Framing::Chunked
        }
        #[getter]
        fn has_body(&self) -> bool {
            self.head.has_body()
        }
        #[getter]
        fn expect_continue(&self) -> bool {
            self.head.expect_continue
        }
        fn header<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
            self.head.header(name).map(|v| PyBytes::new(py, v))
        }
        /// How many fields have this (lower-case) name, without building `headers`.
        fn header_count(&self, name: &str) -> usize {
            self.head.headers.iter().filter(|(n, _)| n == name).count()
        }
        /// The same head with this body (for a body gathered from `HttpData` events).
        fn with_body(&self, body: Py<PyBytes>) -> HttpRequest {
            HttpRequest {
                head: self.head.clone(),
                body,
            }
        }
        fn __repr__(&self) -> String {
            let target = match &self.head.query {
                Some(q) => format!("{}?{}", self.head.path, q),
                None => self.head.path.clone(),
            };
            format!(
                "<HttpRequest {} {} HTTP/1.{}>",
                self.head.method, target, self.head.version
            )
        }
    }

    /// Body bytes of the current request (de-chunked), as they arrived.
    #[pyclass(frozen, module = "rmb_relay._core", name = "HttpData")]
    pub struct HttpData {
        #[pyo3(get)]
        data: Py<PyBytes>,
    }

    #[pymethods]
    impl HttpData {
        fn __repr__(&self, py: Python<'_>) -> String {
            format!("HttpData(len={})", self.data.bind(py).as_bytes().len())
        }
    }

    /// The end of the current request, with the trailer fields of a chunked body.
    #[pyclass(frozen, module = "rmb_relay._core", name = "HttpEnd")]
    pub struct HttpEnd {
        trailers: Fields,
    }

    #[pymethods]
    impl HttpEnd {
        #[getter]
        fn trailers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            headers_list(py, &self.trailers)
        }
        fn __repr__(&self) -> String {
            format!("HttpEnd(trailers={})", self.trailers.len())
        }
    }

    /// The peer broke HTTP/1.1 framing or a limit: answer with `status` and close. The parser
    /// returns nothing more after this event.
    #[pyclass(frozen, module = "rmb_relay._core", name = "HttpViolation")]
    pub struct HttpViolation {
        #[pyo3(get)]
        status: u16,
        #[pyo3(get)]
        reason: String,
    }

    #[pymethods]
    impl HttpViolation {
        fn __repr__(&self) -> String {
            format!(
                "HttpViolation(status={}, reason={:?})",
                self.status, self.reason
            )
        }
    }

    /// A parser's output as Python events (what `HttpStreamParser.feed` returns; the tunnel's
    /// hub hands a read its fast path does not take back this way, dialects/tunnel/hub.rs).
    pub(crate) fn events_list<'py>(
        py: Python<'py>,
        out: super::Output<'_>,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut events: Vec<Py<PyAny>> = Vec::with_capacity(out.events.len() + 1);
        let mut pending: Vec<&[u8]> = Vec::new();
        let flush = |pending: &mut Vec<&[u8]>, events: &mut Vec<Py<PyAny>>| -> PyResult<()> {
            if pending.is_empty() {
                return Ok(());
            }
            let len = pending.iter().map(|s| s.len()).sum();
            let bytes = PyBytes::new_with(py, len, |buf| {
                let mut at = 0;
                for s in pending.iter() {
                    buf[at..at + s.len()].copy_from_slice(s);
                    at += s.len();
                }
                Ok(())
            })?;
            pending.clear();
            events.push(
                Py::new(
                    py,
                    HttpData {
                        data: bytes.unbind(),
                    },
                )?
                .into_any(),
            );
            Ok(())
        };
        for event in out.events {
            match event {
                Event::Data(d) => pending.push(d),
                Event::Head(head) => {
                    flush(&mut pending, &mut events)?;
                    events.push(Py::new(py, HttpRequest::from_head(py, head))?.into_any());
                }
                Event::End(trailers) => {
                    flush(&mut pending, &mut events)?;
                    events.push(Py::new(py, HttpEnd { trailers })?.into_any());
                }
            }
        }
        flush(&mut pending, &mut events)?;
        match out.error {
            Some(super::Error::Http { status, reason }) => {
                events.push(Py::new(py, HttpViolation { status, reason })?.into_any());
            }
            Some(other) => return Err(other.into()),
            None => {}
        }
        PyList::new(py, events)
    }

    /// Incremental request parser returning events (head, body data, end).
    #[pyclass(module = "rmb_relay._core", name = "HttpStreamParser")]
    pub struct HttpStreamParser {
        pub(crate) inner: StreamParser,
    }

    fn empty_bytes(py: Python<'_>) -> Py<PyBytes> {
        PyBytes::new(py, b"").unbind()
    }

    #[pymethods]
    impl HttpStreamParser {
        #[new]
        #[pyo3(signature = (*, max_head = 16384, max_headers = 64, max_chunk_line = 4096, max_trailers = 8192))]
        fn new(
            max_head: usize,
            max_headers: usize,
            max_chunk_line: usize,
            max_trailers: usize,
        ) -> Self {
            HttpStreamParser {
                inner: StreamParser::new(Limits {
                    max_head,
                    max_headers,
                    max_chunk_line,
                    max_trailers,
                }),
            }
        }

        /// Every event in the bytes fed so far. Adjacent body slices (the chunks of one read)
        /// come out as one HttpData, so a read costs one object however it was chunked.
        fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
            events_list(py, self.inner.feed(data))
        }

        fn start_next_cycle(&mut self) -> PyResult<()> {
            Ok(self.inner.start_next_cycle()?)
        }

        fn take_rest<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.take_rest())
        }

        #[getter]
        fn buffered(&self) -> usize {
            self.inner.buffered()
        }

        #[getter]
        fn done(&self) -> bool {
            self.inner.is_done()
        }
    }

    #[pyfunction]
    fn websocket_accept(key: &Bound<'_, PyAny>) -> PyResult<String> {
        if let Ok(s) = key.downcast::<PyString>() {
            Ok(super::websocket_accept(s.to_str()?.as_bytes()))
        } else if let Ok(b) = key.downcast::<PyBytes>() {
            Ok(super::websocket_accept(b.as_bytes()))
        } else {
            Err(PyTypeError::new_err("key must be str or bytes"))
        }
    }

    #[pyfunction]
    fn validate_websocket_upgrade(request: &HttpRequest) -> PyResult<String> {
        Ok(super::validate_websocket_upgrade(&request.head)?)
    }

    fn borrow_headers(headers: &[(String, String)]) -> Vec<(&str, &str)> {
        headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect()
    }

    #[pyfunction]
    #[pyo3(
        signature = (status, headers, body = b"".as_slice(), *, close = false),
        text_signature = "(status, headers, body=b'', *, close=False)"
    )]
    fn encode_response<'py>(
        py: Python<'py>,
        status: u16,
        headers: Vec<(String, String)>,
        body: &[u8],
        close: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let out = super::encode_response(status, &borrow_headers(&headers), body, close)?;
        Ok(PyBytes::new(py, &out))
    }

    #[pyfunction]
    #[pyo3(signature = (status, headers, *, content_length = None, chunked = false, close = false))]
    fn encode_response_head<'py>(
        py: Python<'py>,
        status: u16,
        headers: Vec<(String, String)>,
        content_length: Option<u64>,
        chunked: bool,
        close: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let framing = match (content_length, chunked) {
            (Some(_), true) => {
                return Err(super::Error::InvalidArgument(
                    "give content_length or chunked, not both".to_owned(),
                )
                .into())
            }
            (Some(n), false) => Some(Framing::Length(n)),
            (None, true) => Some(Framing::Chunked),
            (None, false) => None,
        };
        let out = super::encode_response_head(status, &borrow_headers(&headers), framing, close)?;
        Ok(PyBytes::new(py, &out))
    }

    #[pyfunction]
    fn encode_chunk<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &super::encode_chunk(data))
    }

    #[pyfunction]
    #[pyo3(signature = (trailers = None))]
    fn encode_last_chunk<'py>(
        py: Python<'py>,
        trailers: Option<Vec<(String, String)>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let trailers = trailers.unwrap_or_default();
        let out = super::encode_last_chunk(&borrow_headers(&trailers))?;
        Ok(PyBytes::new(py, &out))
    }

    #[pyfunction]
    #[pyo3(signature = (accept, headers = None))]
    fn encode_switching_protocols<'py>(
        py: Python<'py>,
        accept: &str,
        headers: Option<Vec<(String, String)>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let headers = headers.unwrap_or_default();
        let out = super::encode_switching_protocols(accept, &borrow_headers(&headers))?;
        Ok(PyBytes::new(py, &out))
    }

    #[pyfunction]
    #[pyo3(
        signature = (method, target, headers, body = b"".as_slice()),
        text_signature = "(method, target, headers, body=b'')"
    )]
    fn encode_request<'py>(
        py: Python<'py>,
        method: &str,
        target: &str,
        headers: Vec<(String, String)>,
        body: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let out = super::encode_request(method, target, &borrow_headers(&headers), body)?;
        Ok(PyBytes::new(py, &out))
    }

    #[pyfunction]
    fn parse_response_head<'py>(
        py: Python<'py>,
        data: &[u8],
    ) -> PyResult<Option<(u16, Bound<'py, PyList>, usize)>> {
        // its callers (the websocket client's upgrade) take a refusal as HttpParseError, 502:
        // the answer of a server that does not speak HTTP
        let head = super::parse_response_head(data).map_err(|err| match err {
            super::Error::HttpResponse(reason) => {
                super::http_error(super::STATUS_BAD_GATEWAY, &reason)
            }
            other => other,
        })?;
        match head {
            Some(h) => Ok(Some((h.status, headers_list(py, &h.fields)?, h.len))),
            None => Ok(None),
        }
    }

    // Python signatures spell defaults as literals (so `inspect.signature` and stubtest see
    // them; PyO3 renders a bytes default as `...`, hence the explicit text signatures); these
    // keep the literals equal to the named constants.
    const _: () = assert!(super::DEFAULT_MAX_HEAD == 16384);
    const _: () = assert!(super::DEFAULT_MAX_HEADERS == 64);
    const _: () = assert!(super::DEFAULT_MAX_CHUNK_LINE == 4096);
    const _: () = assert!(super::DEFAULT_MAX_TRAILERS == 8192);

    /// Parses the responses of one connection we are the client of (a tunnel target's).
    #[pyclass(module = "rmb_relay._core", name = "HttpResponseParser")]
    pub struct HttpResponseParser {
        pub(crate) inner: ResponseParser,
        events: Vec<ResponseEvent>,
    }

    /// latin-1 text of a header value (every byte one code point, as `bytes.decode("latin-1")`)
    fn latin1<'py>(py: Python<'py>, value: &[u8]) -> Bound<'py, PyString> {
        match std::str::from_utf8(value) {
            Ok(text) if value.is_ascii() => PyString::new(py, text),
            _ => PyString::new(py, &value.iter().map(|&b| b as char).collect::<String>()),
        }
    }

    fn to_py<'py>(py: Python<'py>, event: ResponseEvent) -> PyResult<Bound<'py, PyAny>> {
        Ok(match event {
            ResponseEvent::Head {
                status,
                headers,
                body,
            } => {
                let list = PyList::empty(py);
                for (name, value) in &headers {
                    list.append((PyString::new(py, name), latin1(py, value)))?;
                }
                let body = body.map(|b| PyBytes::new(py, &b));
                PyTuple::new(
                    py,
                    [
                        status.into_pyobject(py)?.into_any(),
                        list.into_any(),
                        body.into_pyobject(py)?.into_any(),
                    ],
                )?
                .into_any()
            }
            ResponseEvent::Data(data) => PyBytes::new(py, &data).into_any(),
            ResponseEvent::End => py.None().into_bound(py),
        })
    }

    /// The events as Python values (drained from `events`); a head with its whole body is the
    /// whole response, so no End follows it.
    pub(crate) fn response_events_list<'py>(
        py: Python<'py>,
        events: &mut Vec<ResponseEvent>,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        let mut whole = false;
        for event in events.drain(..) {
            if whole && event == ResponseEvent::End {
                whole = false;
                continue;
            }
            whole = matches!(event, ResponseEvent::Head { body: Some(_), .. });
            list.append(to_py(py, event)?)?;
        }
        Ok(list)
    }

    #[pymethods]
    impl HttpResponseParser {
        #[new]
        fn new() -> Self {
            HttpResponseParser {
                inner: ResponseParser::new(),
                events: Vec::new(),
            }
        }

        fn start(&mut self, head_request: bool, whole_limit: usize) -> PyResult<()> {
            Ok(self.inner.start(head_request, whole_limit)?)
        }

        fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
            let mut events = std::mem::take(&mut self.events);
            let result = self.inner.feed(data, &mut events);
            let list = response_events_list(py, &mut events);
            self.events = events;
            result?;
            list
        }

        fn feed_eof(&mut self) -> PyResult<bool> {
            let mut events = Vec::new();
            Ok(self.inner.feed_eof(&mut events)?)
        }

        #[getter]
        fn idle(&self) -> bool {
            self.inner.is_idle()
        }

        #[getter]
        fn keep_alive(&self) -> bool {
            self.inner.keep_alive()
        }

        #[getter]
        fn buffered(&self) -> usize {
            self.inner.buffered()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<HttpRequest>()?;
        m.add_class::<HttpData>()?;
        m.add_class::<HttpEnd>()?;
        m.add_class::<HttpViolation>()?;
        m.add_class::<HttpStreamParser>()?;
        m.add_class::<HttpResponseParser>()?;
        // The stub's `HttpEvent` alias, real at runtime so `isinstance(ev, HttpEvent)` works.
        let py = m.py();
        let mut event_union = py.get_type::<HttpRequest>().into_any();
        for t in [
            py.get_type::<HttpData>(),
            py.get_type::<HttpEnd>(),
            py.get_type::<HttpViolation>(),
        ] {
            event_union = event_union.call_method1("__or__", (t,))?;
        }
        m.add("HttpEvent", event_union)?;
        m.add_function(wrap_pyfunction!(websocket_accept, m)?)?;
        m.add_function(wrap_pyfunction!(validate_websocket_upgrade, m)?)?;
        m.add_function(wrap_pyfunction!(encode_response, m)?)?;
        m.add_function(wrap_pyfunction!(encode_response_head, m)?)?;
        m.add_function(wrap_pyfunction!(encode_chunk, m)?)?;
        m.add_function(wrap_pyfunction!(encode_last_chunk, m)?)?;
        m.add_function(wrap_pyfunction!(encode_switching_protocols, m)?)?;
        m.add_function(wrap_pyfunction!(encode_request, m)?)?;
        m.add_function(wrap_pyfunction!(parse_response_head, m)?)?;
        Ok(())
    }
}
