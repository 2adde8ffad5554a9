//! Client side of HTTP/1.1: a sans-I/O parser for the responses of one kept-alive connection
//! (the tunnel connector's target connections, RFC 9112).
//!
//! Why in Rust: the connector parses one target response per tunnelled request, and the Python
//! state machine it replaces (head parse, framing headers, slicing the body out of a
//! bytearray) was a visible share of the connector's CPU per request. One `feed` per
//! `data_received` now returns the events of those bytes, and the common answer (head and a
//! small Content-Length body in one read) is a single event.
//!
//! Theory of operation, one response per [`ResponseParser::start`]:
//!
//! ```text
//!  state      on                                          emits                 next
//!  Idle       any byte                                    Err (unasked data)    Failed
//!  Head       1xx head                                    -                     Head
//!  Head       head, no body (HEAD, 204, 304, length 0)    Head(body=b""), End   Idle
//!  Head       head, Content-Length n <= whole_limit       -                     Whole(n)
//!  Head       head, Content-Length n > whole_limit        Head(body=None)       Length(n)
//!  Head       head, Transfer-Encoding ..., chunked        Head(body=None)       ChunkSize
//!  Head       head, neither (or another coding)           Head(body=None)       Eof
//!  Whole(n)   n bytes gathered                            Head(body), End       Idle
//!  Length(n)  bytes (up to n)                             Data                  Length(n-k) / End
//!  ChunkSize  `hex[;ext]CRLF` n > 0 / `0CRLF`             -                     ChunkData / Trailers
//!  ChunkData  bytes (up to n)                             Data                  ChunkData / ChunkEnd
//!  ChunkEnd   CRLF                                        -                     ChunkSize
//!  Trailers   fields up to an empty line                  End                   Idle
//!  Eof        bytes / `feed_eof`                          Data / End            - / Idle
//!  any        a framing or limit violation                Err                   Failed
//! ```
//!
//! Framing (RFC 9112 section 6.3): Transfer-Encoding wins over Content-Length; a
//! Transfer-Encoding whose last coding is not `chunked` is read to the end of the connection;
//! differing or malformed Content-Length values are an error (a response that could be read
//! two ways must not be passed on). The connection is reusable after `End` unless the response
//! said `Connection: close`, was HTTP/1.0 without `keep-alive`, or ran to EOF.
//!
//! Limits (the target is trusted more than a client, but a broken one must not make the
//! connector buffer without bound): the head under [`MAX_HEAD`] bytes and [`MAX_HEADERS`]
//! fields, a chunk-size line under [`MAX_CHUNK_LINE`], trailers under [`MAX_TRAILERS`]; body
//! bytes are handed out as they arrive, except the small body gathered whole (at most the
//! caller's `whole_limit`).

use crate::error::{Error, Result};

/// Largest response head accepted (status line and fields): generous for a reverse proxy's
/// upstream (cookies, CSP headers), and a bound on what a broken target makes us keep.
pub const MAX_HEAD: usize = 64 * 1024;
/// Most header fields in one response head.
pub const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (size, extensions, CRLF); a size is at most 16 hex digits.
pub const MAX_CHUNK_LINE: usize = 4096;
/// Largest trailer section kept while looking for its end.
pub const MAX_TRAILERS: usize = 16 * 1024;

/// Response header fields: lower-cased names, values as sent (latin-1 bytes).
pub type Fields = Vec<(String, Vec<u8>)>;

/// What a slice of the connection's bytes meant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
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
enum State {
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

fn bad(reason: impl Into<String>) -> Error {
    Error::HttpResponse(reason.into())
}

/// The responses of one connection, one at a time (see the module docs).
#[derive(Debug)]
pub struct ResponseParser {
    state: State,
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
            state: State::Idle,
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
        if self.state != State::Idle {
            return Err(Error::InvalidArgument(format!(
                "a response is still being read ({:?})",
                self.state
            )));
        }
        self.state = State::Head;
        self.head_request = head_request;
        self.whole_limit = whole_limit;
        self.keep_alive = false;
        Ok(())
    }

    /// Between responses (a new request may be sent).
    pub fn is_idle(&self) -> bool {
        self.state == State::Idle
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
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<Event>) -> Result<()> {
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
            self.state = State::Failed;
            self.error = Some(err.clone());
        }
        result
    }

    /// The target closed the connection: ends a response delimited by the close (`End`,
    /// returns true); false when no response was under way; an error when one was cut short.
    pub fn feed_eof(&mut self, out: &mut Vec<Event>) -> Result<bool> {
        match self.state {
            State::Eof => {
                self.state = State::Idle;
                self.keep_alive = false;
                out.push(Event::End);
                Ok(true)
            }
            State::Idle => Ok(false),
            State::Failed => Err(self.error.clone().unwrap_or_else(|| bad("failed"))),
            state => {
                let err = bad(match state {
                    State::Head => "target closed the connection before its response head",
                    _ => "target closed the connection in the middle of its response body",
                });
                self.state = State::Failed;
                self.error = Some(err.clone());
                Err(err)
            }
        }
    }

    /// Consume what can be consumed of `w`; returns the bytes used.
    fn run(&mut self, w: &[u8], out: &mut Vec<Event>) -> Result<usize> {
        let mut i = 0;
        loop {
            let avail = &w[i..];
            match self.state {
                State::Idle => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let err = bad("target sent data without a request");
                    if out.len() > self.events_before {
                        // bytes past the end of an answer this read completed (a HEAD
                        // answered with a body, say): the answer stands, the connection is
                        // not trusted with another request (and later calls fail)
                        self.keep_alive = false;
                        self.state = State::Failed;
                        self.error = Some(err);
                        return Ok(w.len());
                    }
                    return Err(err);
                }
                State::Failed => return Ok(i),
                State::Head => match self.head(avail, out)? {
                    Some(n) => i += n,
                    None => return Ok(i),
                },
                State::Whole(n) => {
                    if avail.len() < n {
                        return Ok(i);
                    }
                    let (status, headers) = self.held.take().unwrap_or_default();
                    out.push(Event::Head {
                        status,
                        headers,
                        body: Some(avail[..n].to_vec()),
                    });
                    self.end(out);
                    i += n;
                }
                State::Length(left) => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    out.push(Event::Data(avail[..take].to_vec()));
                    i += take;
                    let left = left - take as u64;
                    if left == 0 {
                        self.end(out);
                    } else {
                        self.state = State::Length(left);
                    }
                }
                State::ChunkSize => {
                    let Some(nl) = avail.iter().position(|&b| b == b'\n') else {
                        if avail.len() > MAX_CHUNK_LINE {
                            return Err(bad("chunk size line too long"));
                        }
                        return Ok(i);
                    };
                    if nl + 1 > MAX_CHUNK_LINE {
                        return Err(bad("chunk size line too long"));
                    }
                    let size = parse_chunk_size(&avail[..nl])?;
                    i += nl + 1;
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::ChunkData(size)
                    };
                }
                State::ChunkData(left) => {
                    if avail.is_empty() {
                        return Ok(i);
                    }
                    let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    out.push(Event::Data(avail[..take].to_vec()));
                    i += take;
                    let left = left - take as u64;
                    self.state = if left == 0 {
                        State::ChunkEnd
                    } else {
                        State::ChunkData(left)
                    };
                }
                State::ChunkEnd => {
                    // CRLF after the chunk's data (a bare LF too, lenient as for heads)
                    match avail {
                        [] | [b'\r'] => return Ok(i),
                        [b'\n', ..] => i += 1,
                        [b'\r', b'\n', ..] => i += 2,
                        _ => return Err(bad("chunk data not followed by CRLF")),
                    }
                    self.state = State::ChunkSize;
                }
                State::Trailers => match trailers_end(avail)? {
                    Some(n) => {
                        i += n;
                        self.end(out);
                    }
                    None => return Ok(i),
                },
                State::Eof => {
                    if !avail.is_empty() {
                        out.push(Event::Data(avail.to_vec()));
                    }
                    return Ok(w.len());
                }
            }
        }
    }

    fn end(&mut self, out: &mut Vec<Event>) {
        self.state = State::Idle;
        out.push(Event::End);
    }

    /// A head at the start of `avail`: its length once complete (state moved on, events
    /// pushed), None while incomplete.
    fn head(&mut self, avail: &[u8], out: &mut Vec<Event>) -> Result<Option<usize>> {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut slots);
        let n = match resp.parse(avail) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => {
                if avail.len() > MAX_HEAD {
                    return Err(bad("target response head too large"));
                }
                return Ok(None);
            }
            Err(httparse::Error::TooManyHeaders) => {
                return Err(bad("too many target response headers"))
            }
            Err(err) => return Err(bad(format!("malformed target response head ({err})"))),
        };
        if n > MAX_HEAD {
            return Err(bad("target response head too large"));
        }
        let status = resp
            .code
            .ok_or_else(|| bad("malformed target response head"))?;
        if status < 100 {
            return Err(bad(format!("target response status {status} out of range")));
        }
        if status < 200 {
            return Ok(Some(n)); // interim (100 Continue, 103 Early Hints): the real one follows
        }
        let http10 = resp.version == Some(0);
        let mut keep = !http10;
        let mut chunked = false;
        let mut coded = false;
        let mut length: Option<u64> = None;
        let mut headers: Fields = Vec::with_capacity(resp.headers.len());
        for h in resp.headers.iter() {
            let name = h.name.to_ascii_lowercase();
            match name.as_str() {
                "content-length" => {
                    let value = parse_content_length(h.value)?;
                    if length.is_some_and(|known| known != value) {
                        return Err(bad("differing Content-Length values in target response"));
                    }
                    length = Some(value);
                }
                "transfer-encoding" => {
                    coded = true;
                    // the last coding decides (RFC 9112 section 6.3, item 4)
                    chunked = last_token(h.value).eq_ignore_ascii_case(b"chunked");
                }
                "connection" => {
                    for token in h.value.split(|&b| b == b',') {
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
            headers.push((name, h.value.to_vec()));
        }
        self.keep_alive = keep;
        let bodyless = self.head_request || status == 204 || status == 304;
        if bodyless || (!coded && length == Some(0)) {
            out.push(Event::Head {
                status,
                headers,
                body: Some(Vec::new()),
            });
            self.end(out);
        } else if coded {
            out.push(Event::Head {
                status,
                headers,
                body: None,
            });
            if chunked {
                self.state = State::ChunkSize;
            } else {
                self.state = State::Eof;
                self.keep_alive = false;
            }
        } else if let Some(len) = length {
            match usize::try_from(len) {
                Ok(small) if small <= self.whole_limit => {
                    self.held = Some((status, headers));
                    self.state = State::Whole(small);
                }
                _ => {
                    out.push(Event::Head {
                        status,
                        headers,
                        body: None,
                    });
                    self.state = State::Length(len);
                }
            }
        } else {
            out.push(Event::Head {
                status,
                headers,
                body: None,
            });
            self.state = State::Eof;
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
            return Err(bad("malformed Content-Length in target response"));
        }
        let n = digits
            .iter()
            .fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0'));
        if result.is_some_and(|known| known != n) {
            return Err(bad("differing Content-Length values in target response"));
        }
        result = Some(n);
    }
    result.ok_or_else(|| bad("malformed Content-Length in target response"))
}

fn last_token(value: &[u8]) -> &[u8] {
    value
        .rsplit(|&b| b == b',')
        .next()
        .unwrap_or_default()
        .trim_ascii()
}

/// `hex[;ext][CR]` (the LF already cut off).
fn parse_chunk_size(line: &[u8]) -> Result<u64> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let digits = line.split(|&b| b == b';').next().unwrap_or_default();
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad("malformed chunk size in target response"));
    }
    let mut size = 0u64;
    for d in digits {
        let v = (*d as char).to_digit(16).unwrap_or(0);
        size = size * 16 + u64::from(v);
    }
    Ok(size)
}

/// The length of the trailer section at the start of `avail` (up to and including its empty
/// line) once complete.
fn trailers_end(avail: &[u8]) -> Result<Option<usize>> {
    let mut at = 0;
    loop {
        let Some(nl) = avail[at..].iter().position(|&b| b == b'\n') else {
            if avail.len() > MAX_TRAILERS {
                return Err(bad("target response trailers too large"));
            }
            return Ok(None);
        };
        let line = &avail[at..at + nl];
        at += nl + 1;
        if line.is_empty() || line == b"\r" {
            return Ok(Some(at));
        }
        if at > MAX_TRAILERS {
            return Err(bad("target response trailers too large"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(p: &mut ResponseParser, data: &[u8]) -> Result<Vec<Event>> {
        let mut out = Vec::new();
        p.feed(data, &mut out)?;
        Ok(out)
    }

    fn started(whole_limit: usize) -> ResponseParser {
        let mut p = ResponseParser::new();
        p.start(false, whole_limit).unwrap();
        p
    }

    fn head(status: u16, headers: &[(&str, &str)], body: Option<&[u8]>) -> Event {
        Event::Head {
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
        let mut p = started(16);
        let events = feed_all(
            &mut p,
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
        )
        .unwrap();
        assert_eq!(
            events,
            vec![
                head(
                    200,
                    &[("content-length", "5"), ("x-a", "1"), ("x-a", "2")],
                    Some(b"hello")
                ),
                Event::End
            ]
        );
        assert!(p.is_idle() && p.keep_alive());
    }

    #[test]
    fn split_at_every_byte_gives_the_same_events() {
        let wire = b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc";
        for cut in 0..wire.len() {
            let mut p = started(16);
            let mut events = feed_all(&mut p, &wire[..cut]).unwrap();
            events.extend(feed_all(&mut p, &wire[cut..]).unwrap());
            assert_eq!(
                events,
                vec![
                    head(201, &[("content-length", "3")], Some(b"abc")),
                    Event::End
                ],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_body_over_the_limit_streams() {
        let mut p = started(4);
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc").unwrap();
        assert_eq!(
            events,
            vec![
                head(200, &[("content-length", "6")], None),
                Event::Data(b"abc".to_vec())
            ]
        );
        let events = feed_all(&mut p, b"def").unwrap();
        assert_eq!(events, vec![Event::Data(b"def".to_vec()), Event::End]);
    }

    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let mut p = started(1024);
        let wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 1\r\n\r\n";
        let events = feed_all(&mut p, wire).unwrap();
        assert_eq!(
            events,
            vec![
                head(200, &[("transfer-encoding", "chunked")], None),
                Event::Data(b"abc".to_vec()),
                Event::Data(b"de".to_vec()),
                Event::End
            ]
        );
        assert!(p.is_idle() && p.keep_alive());
    }

    #[test]
    fn chunked_split_at_every_byte() {
        let wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        for cut in 0..wire.len() {
            let mut p = started(0);
            let mut events = feed_all(&mut p, &wire[..cut]).unwrap();
            events.extend(feed_all(&mut p, &wire[cut..]).unwrap());
            let body: Vec<u8> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Data(d) => Some(d.clone()),
                    _ => None,
                })
                .flatten()
                .collect();
            assert_eq!(body, b"abc", "cut at {cut}");
            assert_eq!(events.last(), Some(&Event::End), "cut at {cut}");
        }
    }

    #[test]
    fn no_body_for_head_204_304_and_interim_heads_are_skipped() {
        let mut p = ResponseParser::new();
        p.start(true, 0).unwrap();
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n").unwrap();
        assert_eq!(
            events,
            vec![
                head(200, &[("content-length", "100")], Some(b"")),
                Event::End
            ]
        );
        p.start(false, 0).unwrap();
        let events = feed_all(
            &mut p,
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
        )
        .unwrap();
        assert_eq!(events, vec![head(204, &[], Some(b"")), Event::End]);
    }

    #[test]
    fn close_delimited_body_ends_at_eof_and_is_not_reusable() {
        let mut p = started(1024);
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\n\r\nsome").unwrap();
        assert_eq!(
            events,
            vec![head(200, &[], None), Event::Data(b"some".to_vec())]
        );
        let mut out = Vec::new();
        assert!(p.feed_eof(&mut out).unwrap());
        assert_eq!(out, vec![Event::End]);
        assert!(!p.keep_alive());
    }

    #[test]
    fn connection_close_and_http10_are_not_kept_alive() {
        let mut p = started(16);
        feed_all(
            &mut p,
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        )
        .unwrap();
        assert!(!p.keep_alive());
        p.start(false, 16).unwrap();
        feed_all(&mut p, b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert!(!p.keep_alive());
        p.start(false, 16).unwrap();
        feed_all(
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
            let mut p = started(1024);
            let err = feed_all(&mut p, wire).unwrap_err();
            assert!(matches!(err, Error::HttpResponse(_)), "{err:?}");
            assert_eq!(feed_all(&mut p, b"").unwrap_err(), err);
        }
    }

    #[test]
    fn data_without_a_request_is_an_error() {
        let mut p = ResponseParser::new();
        assert!(feed_all(&mut p, b"HTTP/1.1 200 OK\r\n\r\n").is_err());
    }

    #[test]
    fn bytes_past_an_answer_keep_the_answer_and_condemn_the_connection() {
        // a HEAD answered with a body: the head is the answer, the body is not ours
        let mut p = ResponseParser::new();
        p.start(true, 16).unwrap();
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc").unwrap();
        assert_eq!(
            events,
            vec![head(200, &[("content-length", "3")], Some(b"")), Event::End]
        );
        assert!(!p.keep_alive());
        assert!(feed_all(&mut p, b"").is_err());
        assert!(p.start(false, 16).is_err());
    }

    #[test]
    fn eof_inside_a_response_is_an_error() {
        let mut p = started(1024);
        feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc").unwrap();
        assert!(p.feed_eof(&mut Vec::new()).is_err());
        let mut p = ResponseParser::new();
        assert!(!p.feed_eof(&mut Vec::new()).unwrap());
    }

    #[test]
    fn an_endless_head_is_refused() {
        let mut p = started(0);
        let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
        wire.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
        assert!(feed_all(&mut p, &wire).is_err());
    }

    #[test]
    fn two_responses_back_to_back_on_one_connection() {
        let mut p = started(16);
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na").unwrap();
        assert_eq!(events.len(), 2);
        p.start(false, 16).unwrap();
        let events = feed_all(&mut p, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb").unwrap();
        assert_eq!(events[0], head(200, &[("content-length", "1")], Some(b"b")));
    }
}

pub mod py {
    //! `HttpResponseParser`: one per target connection; events as plain Python values so the
    //! connector's callback does no attribute lookups on them.
    use super::{Event, ResponseParser};
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

    /// Parses the responses of one client connection (see `rust/http_response.rs`).
    #[pyclass(module = "rmb_relay._core", name = "HttpResponseParser")]
    pub struct HttpResponseParser {
        pub(crate) inner: ResponseParser,
        events: Vec<Event>,
    }

    /// latin-1 text of a header value (every byte one code point, as `bytes.decode("latin-1")`)
    fn latin1<'py>(py: Python<'py>, value: &[u8]) -> Bound<'py, PyString> {
        match std::str::from_utf8(value) {
            Ok(text) if value.is_ascii() => PyString::new(py, text),
            _ => PyString::new(py, &value.iter().map(|&b| b as char).collect::<String>()),
        }
    }

    fn to_py<'py>(py: Python<'py>, event: Event) -> PyResult<Bound<'py, PyAny>> {
        Ok(match event {
            Event::Head {
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
            Event::Data(data) => PyBytes::new(py, &data).into_any(),
            Event::End => py.None().into_bound(py),
        })
    }

    /// The events as Python values (drained from `events`); a head with its whole body is the
    /// whole response, so no End follows it.
    pub(crate) fn events_list<'py>(
        py: Python<'py>,
        events: &mut Vec<Event>,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        let mut whole = false;
        for event in events.drain(..) {
            if whole && event == Event::End {
                whole = false;
                continue;
            }
            whole = matches!(event, Event::Head { body: Some(_), .. });
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
            let list = events_list(py, &mut events);
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
        m.add_class::<HttpResponseParser>()
    }
}
