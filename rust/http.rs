//! HTTP/1.x request parsing and response/request encoding (RFC 9110, RFC 9112) plus the
//! websocket opening handshake (RFC 6455 section 4).
//!
//! Theory of operation: [`Parser`] owns one byte buffer per connection. `feed` appends and
//! then tries to complete one request: first the head (located by scanning only the bytes
//! not scanned before for the empty line that ends it, so a head trickled in byte by byte
//! costs O(n), then parsed once with `httparse`), then the body by Content-Length. Bytes after
//! a complete request stay buffered for the next `feed` (pipelining) or for [`Parser::take_rest`]
//! after a websocket upgrade. Every limit also applies to incomplete input, so the buffer is
//! O(max_head + max_body) whatever the peer sends. After an error the parser is poisoned and
//! returns the same error again: the caller answers with the status and closes.
//!
//! Not supported (on purpose, for now): `Transfer-Encoding` of any kind (chunked bodies) is
//! answered with 501, which RFC 9112 section 6.1 allows for a coding the server does not
//! implement; `Expect: 100-continue` is not answered (the client sends the body after its
//! timeout anyway).

use crate::error::{Error, Result};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use sha1::{Digest, Sha1};

/// Default cap on the request head (request line + headers). 16 KiB is far above what any of
/// our clients send (an RMB JWT fits in 1 KiB) and bounds a slowloris that never ends its head.
pub const DEFAULT_MAX_HEAD: usize = 16 * 1024;
/// Default cap on the number of header fields; nginx and h11 sit in the same range.
pub const DEFAULT_MAX_HEADERS: usize = 64;
/// Default cap on a Content-Length body: a federation POST carries one envelope, and RMB
/// envelopes are limited well below 1 MiB.
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;
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

/// The parser limits; all three are part of the API (see the `DEFAULT_*` constants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_head: usize,
    pub max_headers: usize,
    pub max_body: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_head: DEFAULT_MAX_HEAD,
            max_headers: DEFAULT_MAX_HEADERS,
            max_body: DEFAULT_MAX_BODY,
        }
    }
}

/// A parsed request head. Header names are lower-cased, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    /// Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
    pub keep_alive: bool,
    pub is_websocket_upgrade: bool,
    body_len: usize,
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
}

/// A complete request with its body (the pure-Rust convenience form of [`Parser::feed_with`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub head: RequestHead,
    pub body: Vec<u8>,
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

/// Where a rescan must start so a terminator split across feeds is still found.
fn rescan_from(len: usize) -> usize {
    len.saturating_sub(2)
}

/// The body length announced by the Content-Length fields: identical repeats (as separate
/// fields or a list) are one value, anything else is 400 (RFC 9112 section 6.3, item 5).
fn content_length(head: &RequestHead, max_body: usize) -> Result<usize> {
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
    let Some(digits) = found else { return Ok(0) };
    // Digits only, so the only failure left is overflow, which is over any limit anyway.
    match std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
    {
        Some(n) if n <= max_body => Ok(n),
        _ => Err(http_error(
            STATUS_PAYLOAD_TOO_LARGE,
            "request body too large",
        )),
    }
}

fn strip_leading_zeros(digits: &[u8]) -> &[u8] {
    let zeros = digits.iter().take_while(|&&b| b == b'0').count();
    if zeros == digits.len() {
        b"0"
    } else {
        &digits[zeros..]
    }
}

/// Build the head from httparse's view of it and apply the framing rules.
fn head_from_parsed(req: &httparse::Request<'_, '_>, limits: &Limits) -> Result<RequestHead> {
    // httparse only reports Complete with all three set.
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(http_error(STATUS_BAD_REQUEST, "malformed request line"));
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_owned(), Some(q.to_owned())),
        None => (target.to_owned(), None),
    };
    let headers = req
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect();
    let mut head = RequestHead {
        method: method.to_owned(),
        path,
        query,
        version,
        headers,
        keep_alive: false,
        is_websocket_upgrade: false,
        body_len: 0,
    };
    // RFC 9112 section 9.3: 1.1 persists unless "close"; 1.0 only with "keep-alive".
    head.keep_alive = !head.has_token("connection", "close")
        && (version >= 1 || head.has_token("connection", "keep-alive"));
    // RFC 6455 section 4.2.1, items 1, 3 and 4.
    head.is_websocket_upgrade = head.method == "GET"
        && head.has_token("upgrade", "websocket")
        && head.has_token("connection", "upgrade");
    if head.headers_named("transfer-encoding").next().is_some() {
        return Err(http_error(
            STATUS_NOT_IMPLEMENTED,
            "transfer-encoding not supported",
        ));
    }
    head.body_len = content_length(&head, limits.max_body)?;
    Ok(head)
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

/// Parse a complete head (`bytes` ends with its empty line). `Ok(None)` means httparse wants
/// more (only blank lines so far).
fn parse_head(bytes: &[u8], limits: &Limits) -> Result<Option<RequestHead>> {
    let mut stack = [httparse::EMPTY_HEADER; STACK_HEADERS];
    let mut heap;
    let slots: &mut [httparse::Header<'_>] = if limits.max_headers <= STACK_HEADERS {
        &mut stack[..limits.max_headers]
    } else {
        heap = vec![httparse::EMPTY_HEADER; limits.max_headers];
        &mut heap
    };
    let mut req = httparse::Request::new(slots);
    match req.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => head_from_parsed(&req, limits).map(Some),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(e) => Err(map_httparse_error(e)),
    }
}

/// Incremental HTTP/1.x request parser; see the module comment.
#[derive(Debug)]
pub struct Parser {
    limits: Limits,
    buf: Vec<u8>,
    /// Start of the unconsumed bytes in `buf`.
    pos: usize,
    /// Offset (relative to `pos`) where the next head-terminator search starts.
    scan_from: usize,
    /// A head already parsed, waiting for its body.
    pending: Option<RequestHead>,
    failed: Option<Error>,
}

impl Parser {
    pub fn new(limits: Limits) -> Self {
        Parser {
            limits,
            buf: Vec::new(),
            pos: 0,
            scan_from: 0,
            pending: None,
            failed: None,
        }
    }

    /// Bytes received and not yet returned as part of a request.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Drain every buffered byte not yet returned (after an upgrade the rest of the stream
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
        self.pending = None;
        rest
    }

    /// Append `data` and return the next complete request, or None when more bytes are needed.
    pub fn feed(&mut self, data: &[u8]) -> Result<Option<Request>> {
        self.feed_with(data, |head, body| Request {
            head,
            body: body.to_vec(),
        })
    }

    /// Like [`Parser::feed`] but hands the body to `build` as a slice of the internal buffer,
    /// so the caller copies it exactly once (into its own object).
    pub fn feed_with<T>(
        &mut self,
        data: &[u8],
        build: impl FnOnce(RequestHead, &[u8]) -> T,
    ) -> Result<Option<T>> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        self.compact();
        self.buf.extend_from_slice(data);
        match self.advance() {
            Ok(Some(head)) => {
                let start = self.pos;
                self.pos += head.body_len;
                Ok(Some(build(head, &self.buf[start..self.pos])))
            }
            Ok(None) => Ok(None),
            Err(err) => {
                self.failed = Some(err.clone());
                self.buf = Vec::new();
                self.pos = 0;
                Err(err)
            }
        }
    }

    /// Try to complete a request; on success `pos` points at its body.
    fn advance(&mut self) -> Result<Option<RequestHead>> {
        while self.pending.is_none() {
            let avail = &self.buf[self.pos..];
            let Some(end) = find_head_end(avail, self.scan_from) else {
                if avail.len() > self.limits.max_head {
                    return Err(http_error(
                        STATUS_HEADERS_TOO_LARGE,
                        "request header fields too large",
                    ));
                }
                self.scan_from = rescan_from(avail.len());
                return Ok(None);
            };
            if end > self.limits.max_head {
                return Err(http_error(
                    STATUS_HEADERS_TOO_LARGE,
                    "request header fields too large",
                ));
            }
            match parse_head(&avail[..end], &self.limits)? {
                Some(head) => {
                    self.pos += end;
                    self.scan_from = 0;
                    self.pending = Some(head);
                }
                // Only blank lines so far: keep them and look for the next terminator.
                None => self.scan_from = end,
            }
        }
        let body_len = self.pending.as_ref().map_or(0, |h| h.body_len);
        if self.buf.len() - self.pos < body_len {
            return Ok(None);
        }
        Ok(self.pending.take())
    }

    /// Drop the consumed prefix when it is empty-rest or big enough to be worth a shift.
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

impl Default for Parser {
    fn default() -> Self {
        Parser::new(Limits::default())
    }
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

/// A header name must be a token (RFC 9110 section 5.6.2).
fn is_token(s: &str) -> bool {
    /// The `tchar` punctuation of RFC 9110 section 5.6.2.
    const TCHAR_PUNCT: &[u8] = b"!#$%&'*+-.^_`|~";
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || TCHAR_PUNCT.contains(&b))
}

/// Reject what would let a caller inject a header or split the message (CR, LF, NUL).
fn check_headers(headers: &[(&str, &str)]) -> Result<()> {
    for (name, value) in headers {
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
        if name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("transfer-encoding")
        {
            return Err(Error::InvalidArgument(
                "content-length is computed; do not pass it".to_owned(),
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

/// A complete HTTP/1.1 response. Content-Length is always computed here, except for 1xx and
/// 204 which must not carry one (RFC 9110 section 8.6) and so must have no body.
pub fn encode_response(
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    close: bool,
) -> Result<Vec<u8>> {
    if !(100..=999).contains(&status) {
        return Err(Error::InvalidArgument(format!(
            "status {status} is not three digits"
        )));
    }
    check_headers(headers)?;
    let bodyless = status < 200 || status == 204;
    if bodyless && !body.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "status {status} cannot have a body"
        )));
    }
    let phrase = reason_phrase(status);
    let mut out = Vec::with_capacity(64 + phrase.len() + headers_len(headers) + body.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(phrase.as_bytes());
    out.extend_from_slice(b"\r\n");
    write_headers(&mut out, headers);
    if !bodyless {
        out.extend_from_slice(b"Content-Length: ");
        out.extend_from_slice(body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if close {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
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

/// A client request; Content-Length is added when the body is non-empty.
pub fn encode_request(
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Vec<u8>> {
    if !is_token(method) {
        return Err(Error::InvalidArgument(format!("invalid method {method:?}")));
    }
    if target.is_empty() || target.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(Error::InvalidArgument(format!(
            "invalid request target {target:?}"
        )));
    }
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

/// A parsed response head: status, lower-cased headers, and the head length in bytes.
pub type ResponseHead = (u16, Vec<(String, Vec<u8>)>, usize);

/// Client side: the response head once complete (`Ok(None)` until then), under the same
/// default head and header-count limits as requests; errors carry 502.
pub fn parse_response_head(data: &[u8]) -> Result<Option<ResponseHead>> {
    let bad = |reason: &str| http_error(STATUS_BAD_GATEWAY, reason);
    let Some(end) = find_head_end(data, 0) else {
        return if data.len() > DEFAULT_MAX_HEAD {
            Err(bad("response head too large"))
        } else {
            Ok(None)
        };
    };
    if end > DEFAULT_MAX_HEAD {
        return Err(bad("response head too large"));
    }
    let mut slots = [httparse::EMPTY_HEADER; DEFAULT_MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    match resp.parse(&data[..end]) {
        Ok(httparse::Status::Complete(n)) => {
            let status = resp.code.ok_or_else(|| bad("malformed response"))?;
            let headers = resp
                .headers
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect();
            Ok(Some((status, headers, n)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(bad("too many response headers")),
        Err(_) => Err(bad("malformed response")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parser() -> Parser {
        Parser::default()
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
        let req = Parser::new(limits).feed(&data).unwrap().unwrap();
        assert_eq!(req.head.headers.len(), 150);
    }

    #[test]
    fn body_over_limit_is_413_before_it_arrives() {
        let limits = Limits {
            max_body: 10,
            ..Limits::default()
        };
        let mut p = Parser::new(limits);
        let err = p
            .feed(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n")
            .unwrap_err();
        assert_eq!(status_of(err), 413);
        let err = Parser::new(limits)
            .feed(b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n")
            .unwrap_err();
        assert_eq!(status_of(err), 413);
        let req = Parser::new(limits)
            .feed(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789")
            .unwrap()
            .unwrap();
        assert_eq!(req.body.len(), 10);
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
    fn transfer_encoding_is_501() {
        for te in ["chunked", "gzip, chunked", "identity"] {
            let data = format!("POST / HTTP/1.1\r\nTransfer-Encoding: {te}\r\n\r\n");
            assert_eq!(status_of(parser().feed(data.as_bytes()).unwrap_err()), 501);
        }
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
        let (status, headers, n) = parse_response_head(data).unwrap().unwrap();
        assert_eq!(status, 101);
        assert_eq!(n, head_len);
        assert_eq!(
            headers[1],
            ("sec-websocket-accept".to_owned(), b"abc".to_vec())
        );
    }

    #[test]
    fn parse_response_head_errors_are_502() {
        assert_eq!(
            status_of(parse_response_head(b"HTTP/1.1 abc\r\n\r\n").unwrap_err()),
            502
        );
        let big = vec![b'a'; DEFAULT_MAX_HEAD + 1];
        assert_eq!(status_of(parse_response_head(&big).unwrap_err()), 502);
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=DEFAULT_MAX_HEADERS {
            many.extend_from_slice(format!("h{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(status_of(parse_response_head(&many).unwrap_err()), 502);
    }

    #[test]
    fn garbage_and_mutated_requests_end_in_documented_outcomes() {
        // A poor man's fuzz target: never a panic, only documented statuses, and the
        // buffer stays within the limits.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let limits = Limits {
            max_head: 512,
            max_headers: 8,
            max_body: 256,
        };
        let valid = b"POST /x?y HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nbody";
        for round in 0..2000 {
            let data: Vec<u8> = if round % 2 == 0 {
                (0..rng.gen_range(0..700)).map(|_| rng.gen()).collect()
            } else {
                let mut d = valid.to_vec();
                for _ in 0..rng.gen_range(1..4) {
                    let i = rng.gen_range(0..d.len());
                    d[i] = rng.gen();
                }
                d
            };
            let mut p = Parser::new(limits);
            for chunk in data.chunks(rng.gen_range(1..50)) {
                match p.feed(chunk) {
                    Ok(Some(req)) => assert!(req.body.len() <= limits.max_body),
                    Ok(None) => {}
                    Err(Error::Http { status, .. }) => {
                        assert!([400, 413, 431, 501].contains(&status), "{status}");
                        break;
                    }
                    Err(other) => panic!("undocumented error {other:?}"),
                }
                assert!(p.buffered() <= data.len());
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
}

pub mod py {
    use super::{Limits, Parser, RequestHead};
    use pyo3::exceptions::PyTypeError;
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

    /// One parsed HTTP/1.x request: head fields plus the Content-Length body.
    #[pyclass(frozen, module = "rmb_relay._core", name = "HttpRequest")]
    pub struct HttpRequest {
        head: RequestHead,
        #[pyo3(get)]
        body: Py<PyBytes>,
    }

    fn headers_list<'py>(
        py: Python<'py>,
        headers: &[(String, Vec<u8>)],
    ) -> PyResult<Bound<'py, PyList>> {
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
        fn header<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyBytes>> {
            self.head.header(name).map(|v| PyBytes::new(py, v))
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

    /// Incremental request parser: head <= max_head bytes, <= max_headers, body by Content-Length.
    #[pyclass(module = "rmb_relay._core", name = "HttpParser")]
    pub struct HttpParser {
        inner: Parser,
    }

    #[pymethods]
    impl HttpParser {
        #[new]
        #[pyo3(signature = (*, max_head = 16384, max_headers = 64, max_body = 1048576))]
        fn new(max_head: usize, max_headers: usize, max_body: usize) -> Self {
            HttpParser {
                inner: Parser::new(Limits {
                    max_head,
                    max_headers,
                    max_body,
                }),
            }
        }

        fn feed(&mut self, py: Python<'_>, data: &[u8]) -> PyResult<Option<HttpRequest>> {
            let built = self.inner.feed_with(data, |head, body| HttpRequest {
                head,
                body: PyBytes::new(py, body).unbind(),
            })?;
            Ok(built)
        }

        fn take_rest<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
            PyBytes::new(py, &self.inner.take_rest())
        }

        #[getter]
        fn buffered(&self) -> usize {
            self.inner.buffered()
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
        match super::parse_response_head(data)? {
            Some((status, headers, n)) => Ok(Some((status, headers_list(py, &headers)?, n))),
            None => Ok(None),
        }
    }

    // Python signatures spell defaults as literals (so `inspect.signature` and stubtest see
    // them; PyO3 renders a bytes default as `...`, hence the explicit text signatures); these keep the literals equal to the named constants.
    const _: () = assert!(super::DEFAULT_MAX_HEAD == 16384);
    const _: () = assert!(super::DEFAULT_MAX_HEADERS == 64);
    const _: () = assert!(super::DEFAULT_MAX_BODY == 1048576);

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<HttpRequest>()?;
        m.add_class::<HttpParser>()?;
        m.add_function(wrap_pyfunction!(websocket_accept, m)?)?;
        m.add_function(wrap_pyfunction!(validate_websocket_upgrade, m)?)?;
        m.add_function(wrap_pyfunction!(encode_response, m)?)?;
        m.add_function(wrap_pyfunction!(encode_switching_protocols, m)?)?;
        m.add_function(wrap_pyfunction!(encode_request, m)?)?;
        m.add_function(wrap_pyfunction!(parse_response_head, m)?)?;
        Ok(())
    }
}
