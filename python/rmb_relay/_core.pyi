"""Typed stubs of the Rust core `rmb_relay._core` (checked with mypy.stubtest in `make lint`).

Each section below belongs to one Rust file; keep it in step with that file.
"""

from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias, final

from typing_extensions import disjoint_base

# ---- error.rs ---------------------------------------------------------------------------

class CoreError(Exception): ...
class HttpParseError(CoreError): ...
class HttpResponseError(CoreError): ...
class WebSocketProtocolError(CoreError): ...
class EnvelopeError(CoreError): ...
class SbdError(CoreError): ...
class SignatureError(CoreError): ...
class TunnelWireError(CoreError): ...

class SgQueryError(CoreError):
    """A 신경 query the gateway cannot run; args = (message, limit | None)."""

# ---- codec/http.rs ----------------------------------------------------------------------
# PyO3 classes cannot be subclassed (hence @final) and are built by __new__ (no __init__).

@final
class HttpRequest:
    """One HTTP/1.x request head, with its body when it was gathered whole (`with_body`).
    From `HttpStreamParser` it is the first event of a request and `body` is b"": the body
    follows as HttpData events up to HttpEnd."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str:
        """The request target before any `?` (percent-escapes left as sent)."""
    @property
    def query(self) -> str | None:
        """Everything after the first `?`, raw; None when the target has no `?`."""
    @property
    def version(self) -> int:
        """Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1."""
    @property
    def headers(self) -> list[tuple[str, bytes]]:
        """Header names lower-cased, in arrival order."""
    @property
    def body(self) -> bytes: ...
    @property
    def keep_alive(self) -> bool: ...
    @property
    def is_websocket_upgrade(self) -> bool:
        """GET with `Upgrade: websocket` and a `Connection` header naming `upgrade`."""
    @property
    def content_length(self) -> int | None:
        """The announced body length: 0 when there is no body, None when chunked."""
    @property
    def chunked(self) -> bool:
        """`Transfer-Encoding: chunked` (the only transfer coding accepted)."""
    @property
    def has_body(self) -> bool:
        """Chunked, or a Content-Length above 0."""
    @property
    def expect_continue(self) -> bool:
        """`Expect: 100-continue` on an HTTP/1.1 request (ignored on 1.0, RFC 9110 10.1.1)."""
    def header(self, name: str) -> bytes | None:
        """First header of that name (case-insensitive), or None."""
    def header_count(self, name: str) -> int:
        """How many fields have this (lower-case) name, without building `headers`."""
    def with_body(self, body: bytes) -> HttpRequest:
        """The same head with this body (a body gathered from HttpData events)."""

@final
class HttpData:
    """Body bytes of the current request, de-chunked; never empty. The body bytes of one
    `feed` come out as one HttpData whatever their chunking."""

    @property
    def data(self) -> bytes: ...

@final
class HttpEnd:
    """The current request is complete."""

    @property
    def trailers(self) -> list[tuple[str, bytes]]:
        """Trailer fields of a chunked body (names lower-cased); empty otherwise."""

@final
class HttpViolation:
    """The peer broke HTTP/1.1 framing or a limit: answer with `status` (400, 413, 431, 501)
    and close. The parser returns nothing more after this event."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str: ...

HttpEvent = HttpRequest | HttpData | HttpEnd | HttpViolation

@final
class HttpStreamParser:
    """Incremental request parser returning events, h11 style: HttpRequest (the head) as soon
    as the head is complete, HttpData as body bytes arrive (Content-Length or chunked), HttpEnd.
    It then stops: bytes of a pipelined request stay buffered until `start_next_cycle()`.
    Memory is O(read + limits), never O(body). Limits: head <= max_head bytes with
    <= max_headers fields; a chunk-size line <= max_chunk_line bytes; trailers <= max_trailers
    bytes with <= max_headers fields."""

    def __new__(
        cls,
        *,
        max_head: int = 16384,
        max_headers: int = 64,
        max_chunk_line: int = 4096,
        max_trailers: int = 8192,
    ) -> HttpStreamParser: ...
    def feed(self, data: bytes) -> list[HttpEvent]:
        """Every event in the bytes fed so far, in order; an HttpViolation is the last one."""
    def start_next_cycle(self) -> None:
        """After HttpEnd (and the answer), parse the next request: `feed(b"")` then returns
        the events of whatever is buffered. ValueError before the request has ended."""
    def take_rest(self) -> bytes:
        """Every unparsed byte (after a websocket upgrade, the first frames); resets."""
    @property
    def buffered(self) -> int: ...
    @property
    def done(self) -> bool:
        """True from HttpEnd until `start_next_cycle()`."""

def websocket_accept(key: str | bytes) -> str:
    """`Sec-WebSocket-Accept` for a `Sec-WebSocket-Key` (RFC 6455 4.2.2)."""

def validate_websocket_upgrade(request: HttpRequest) -> str:
    """Check an upgrade request (GET, HTTP/1.1, version 13, 16-byte key) and return the
    accept value; raises HttpParseError with status 400 (or 426 for a wrong version)."""

def encode_response(
    status: int, headers: list[tuple[str, str]], body: bytes = b"", *, close: bool = False
) -> bytes:
    """A complete HTTP/1.1 response with Content-Length (and `Connection: close` if asked)."""

def encode_response_head(
    status: int,
    headers: list[tuple[str, str]],
    *,
    content_length: int | None = None,
    chunked: bool = False,
    close: bool = False,
) -> bytes:
    """The head of a response whose body the caller writes next: `content_length` bytes as
    they are, or (`chunked=True`) encode_chunk()s ended by encode_last_chunk(). Exactly one of
    the two, except for 1xx and 204 which take neither, and a body that ends when the
    connection closes (neither, with `close=True`: for HTTP/1.0 clients, which cannot read
    chunked). For HEAD, send this head alone."""

def encode_chunk(data: bytes) -> bytes:
    """One chunk of a chunked body; b"" for empty data (a zero-size chunk would end the body)."""

def encode_last_chunk(trailers: list[tuple[str, str]] | None = None) -> bytes:
    """The last chunk (and trailer fields) that end a chunked body."""

def encode_switching_protocols(accept: str, headers: list[tuple[str, str]] | None = None) -> bytes:
    """The 101 response that completes a websocket upgrade."""

def encode_request(
    method: str, target: str, headers: list[tuple[str, str]], body: bytes = b""
) -> bytes:
    """A client request (Content-Length added when body is non-empty); for our clients."""

def parse_response_head(data: bytes) -> tuple[int, list[tuple[str, bytes]], int] | None:
    """Client side: (status, headers, head length) once the head is complete, else None;
    HttpParseError (status 502) for a head that is not HTTP/1.x or over the response limits."""

@final
class HttpResponseParser:
    """The responses of one client connection, one per `start`. `feed` returns the events of
    the bytes given: a head `(status, [(name, value)], body)` (names lower-case, values
    latin-1 text, repeated fields in order; `body` is the whole body when it was gathered
    with the head, and then nothing follows for that response, else None and the body comes
    as bytes pieces), bytes (body pieces), None (the response is complete). Raises
    HttpResponseError for a malformed response or bytes while none is expected (and again
    on every later call)."""

    def __new__(cls) -> HttpResponseParser: ...
    def start(self, head_request: bool, whole_limit: int) -> None:
        """Expect the response to a request just sent (HEAD: no body); a Content-Length body
        up to `whole_limit` comes whole with its head. ValueError while one is unfinished."""
    def feed(
        self, data: bytes
    ) -> list[tuple[int, list[tuple[str, str]], bytes | None] | bytes | None]: ...
    def feed_eof(self) -> bool:
        """The peer closed: True when that ended a close-delimited response, False when none
        was under way; HttpResponseError when one was cut short."""
    @property
    def idle(self) -> bool: ...
    @property
    def keep_alive(self) -> bool: ...
    @property
    def buffered(self) -> int: ...

# ---- end codec/http.rs ----------------------------------------------------------------------

# ---- codec/ws.rs ------------------------------------------------------------------------
OP_CONTINUATION: Final[int]
OP_TEXT: Final[int]
OP_BINARY: Final[int]
OP_CLOSE: Final[int]
OP_PING: Final[int]
OP_PONG: Final[int]

@final
class WsMessage:
    """A complete (reassembled) data message."""

    @property
    def is_text(self) -> bool: ...
    @property
    def data(self) -> bytes:
        """The message as the dialect passes it on: an SBD forward scanned by an SbdScanner is
        already rewritten (the sender's key in place of the destination's)."""
    # A dialect knows which scanner it installed: it annotates the routing it reads (no
    # isinstance per message on the hot path).
    @property
    def routing(self) -> EnvelopeRouting | SbdRouting | list[_SgQueueFrame] | None:
        """With a scanner: what it made of the message, read in the same call as the frame:
        EnvelopeRouting (EnvelopeScanner, RmbScanner), SbdRouting (SbdScanner) or None. From
        an SgScanner: None, or for a message with no data, the queue frames it read since the
        previous event (`_SgQueueFrame`), to be handled in order before the next one."""
    @property
    def scan_error(self) -> str | None:
        """With a scanner: why the message has no routing (not an envelope, shorter than the
        SBD header)."""

@final
class WsPing:
    @property
    def data(self) -> bytes: ...

@final
class WsPong:
    @property
    def data(self) -> bytes: ...

@final
class WsClose:
    """The peer's close frame; code None when the frame had no body."""

    @property
    def code(self) -> int | None: ...
    @property
    def reason(self) -> str: ...

@final
class WsViolation:
    """The peer broke RFC 6455 (or a limit); answer with close(code) and drop the connection.
    The decoder returns nothing more after this event."""

    @property
    def code(self) -> int: ...
    @property
    def reason(self) -> str: ...

WsEvent = WsMessage | WsPing | WsPong | WsClose | WsViolation

@final
class WsDecoder:
    """Incremental RFC 6455 decoder. Server mode (default) requires masked frames; client
    mode requires unmasked ones. Messages larger than max_message end in WsViolation(1009).
    A scanner reads each data message's routing in the same call (see WsMessage)."""

    def __new__(
        cls,
        *,
        max_message: int = 1048576,
        client_mode: bool = False,
        scanner: Scanner | None = None,
    ) -> WsDecoder: ...
    def set_scanner(self, scanner: Scanner | None) -> None:
        """Scan the messages of later feeds with `scanner` (None: stop scanning)."""
    @property
    def scanner(self) -> Scanner | None: ...
    def feed(self, data: bytes | bytearray | memoryview, now: int = 0) -> list[WsEvent]:
        """Every complete event in the bytes fed so far, in order. `now` (the caller's clock,
        nanoseconds) is what an SbdScanner charges its limiter at. The scanner's route table
        (and limiter) are read during this call: lookups see the table as it is now, also for
        the later messages of the same read."""
    @property
    def buffered(self) -> int: ...
    @property
    def closed(self) -> bool:
        """True once a WsClose or WsViolation has been returned."""
    @property
    def messages_in(self) -> int:
        """Data messages decoded so far (the fast path's forwards included)."""
    @property
    def bytes_in(self) -> int:
        """Bytes fed so far."""

def encode_frame(
    opcode: int, payload: bytes, *, fin: bool = True, mask: bytes | None = None
) -> bytes:
    """One frame; `mask` (4 bytes) makes it a masked client frame."""

def encode_binary(payload: bytes) -> bytes:
    """A server binary frame."""

def encode_binary_batch(payloads: list[bytes]) -> bytes:
    """Server binary frames for every payload, concatenated for one transport.write."""

def encode_close(code: int, reason: str = "") -> bytes:
    """A server close frame."""

@final
class ClientFrameEncoder:
    """Masked client frames. Masks come from a PRNG seeded by the caller (os.urandom(32)),
    so the core stays free of I/O and the masks stay unpredictable to the server."""

    def __new__(cls, seed: bytes) -> ClientFrameEncoder: ...
    def binary(self, payload: bytes) -> bytes: ...
    def binary_batch(self, payloads: list[bytes]) -> bytes: ...
    def text(self, payload: str) -> bytes: ...
    def ping(self, payload: bytes = b"") -> bytes: ...
    def pong(self, payload: bytes = b"") -> bytes: ...
    def close(self, code: int = 1000, reason: str = "") -> bytes: ...

# ---- end codec/ws.rs ------------------------------------------------------------------------

# ---- dialects/sbd/header.rs -------------------------------------------------------------
SBD_HEADER_LEN: Final[int]
SBD_MAX_MESSAGE: Final[int]
SBD_COMMAND: Final[int]
SBD_FORWARD: Final[int]

@final
class SbdMessage:
    """A classified SBD message: a command (28 zero bytes + 4-byte tag) or a forward."""

    @property
    def kind(self) -> int:
        """SBD_COMMAND or SBD_FORWARD."""
    @property
    def tag(self) -> bytes:
        """The 4-byte command tag (b"" for forwards)."""
    @property
    def peer(self) -> bytes:
        """The 32-byte destination key of a forward (b"" for commands)."""
    @property
    def payload(self) -> bytes: ...

def sbd_classify(message: bytes) -> SbdMessage:
    """Raises SbdError for fewer than 32 bytes."""

def sbd_encode_command(tag: bytes, payload: bytes = b"") -> bytes: ...
def sbd_rewrite_forward(message: bytes, sender: bytes) -> bytes:
    """`sender || message[32:]`: what the destination receives."""

def sbd_forward_frame(message: bytes, sender: bytes) -> bytes:
    """The rewritten forward already wrapped in a server binary websocket frame."""

def sbd_decode_pubkey_path(segment: str) -> bytes:
    """Strict base64url (no padding, canonical) of exactly 32 bytes whose first 28 bytes are
    not all zero; raises SbdError otherwise."""

# ---- end dialects/sbd/header.rs -------------------------------------------------------------

# ---- dialects/rmb/envelope.rs -----------------------------------------------------------
MSG_NONE: Final[int]
MSG_REQUEST: Final[int]
MSG_RESPONSE: Final[int]
MSG_ERROR: Final[int]
MSG_PING: Final[int]
MSG_PONG: Final[int]

@final
class EnvelopeRouting:
    """The routing fields of an RMB Envelope, read straight from its protobuf wire bytes."""

    @property
    def uid(self) -> str: ...
    @property
    def tags(self) -> str | None: ...
    @property
    def fail_fast(self) -> bool:
        """`fail-fast` is one of the tags (split on commas and whitespace)."""
    @property
    def timestamp(self) -> int: ...
    @property
    def expiration(self) -> int: ...
    @property
    def source_twin(self) -> int: ...
    @property
    def source_connection(self) -> str | None: ...
    @property
    def dest_twin(self) -> int: ...
    @property
    def dest_connection(self) -> str | None: ...
    @property
    def kind(self) -> int:
        """One of MSG_NONE, MSG_REQUEST, MSG_RESPONSE, MSG_ERROR, MSG_PING, MSG_PONG."""
    @property
    def from_session(self) -> bool:
        """Scanned by an RmbScanner: the source is exactly its session (else False)."""
    @property
    def dest_conn_id(self) -> int | None:
        """Scanned by an RmbScanner: the connection holding the destination at scan time, if
        it is connected to this process (else None)."""
    @property
    def record(self) -> int:
        """Index of this message's route record in the scanner's RecordBuffer: appended when
        the session sent it (`from_session`), within its limit, it is not a ping and
        `dest_conn_id` is set; -1 otherwise. Retract it if the message is not delivered."""
    @property
    def limited(self) -> bool:
        """Scanned by an RmbScanner with a limiter: the limiter refused this envelope (it was
        counted once, inside `feed`)."""

def scan_envelope(data: bytes) -> EnvelopeRouting:
    """Raises EnvelopeError for bytes that are not a valid Envelope."""

@final
class Envelope:
    """A fully decoded Envelope for the SDK and relay-built replies (never the forward path)."""

    uid: str
    tags: str | None
    timestamp: int
    expiration: int
    source_twin: int
    source_connection: str | None
    dest_twin: int
    dest_connection: str | None
    kind: int
    command: str | None
    error_code: int
    error_message: str
    signature: bytes | None
    schema: str | None
    federation: str | None
    plain: bytes | None
    cipher: bytes | None
    relays: list[str]

    def __new__(cls, uid: str = "") -> Envelope: ...
    @staticmethod
    def decode(data: bytes) -> Envelope: ...
    def encode(self) -> bytes:
        """Wire bytes in rmb-rs's field order (rust-protobuf 3): its output, byte for byte."""
    def challenge(self) -> bytes:
        """The 16-byte MD5 digest that is signed (spec/rmb.md 2.1)."""

def build_error_envelope(
    uid: str,
    message: str,
    now: int,
    dest_twin: int | None = None,
    dest_connection: str | None = None,
) -> bytes:
    """A relay error envelope byte-compatible with rmb-rs: unsigned, no source, code 0,
    expiration 300, timestamp now."""

def build_pong(ping: bytes) -> bytes:
    """The relay's answer to an envelope ping (spec/rmb.md 2.3)."""

# ---- end dialects/rmb/envelope.rs -----------------------------------------------------------

# ---- limiter.rs -------------------------------------------------------------------------
@final
class FixedWindowLimiter:
    """Count and byte budget per key per window (RMB semantics: every frame counts,
    also rejected ones, except one frame larger than `size`: refused before it is counted)."""

    def __new__(cls, count: int, size: int, window_secs: int = 60) -> FixedWindowLimiter: ...
    def check(self, key: int, size: int, now_secs: int) -> bool: ...
    def prune(self, now_secs: int) -> int:
        """Drop keys whose window has ended; returns how many."""
    def __len__(self) -> int: ...

@final
class ByteNanosLimiter:
    """A byte rate per key: one 'next allowed nanosecond' per key, burst in bytes (SBD's
    per-IP limit asks `check`, the tunnel's upload rate `delay`)."""

    def __new__(cls, nanos_per_byte: int, burst_bytes: int) -> ByteNanosLimiter: ...
    def check(self, key: str, size: int, now_nanos: int) -> bool: ...
    def delay(self, key: str, size: int, now_nanos: int) -> int:
        """Charge `size` bytes; nanoseconds from `now_nanos` until the key's debt is back
        within the burst (0: it is now)."""
    def prune(self, now_nanos: int, idle_nanos: int = 10000000000) -> int: ...
    def __len__(self) -> int: ...

# ---- end limiter.rs -------------------------------------------------------------------------

# ---- forward/outboxes.rs ----------------------------------------------------------------
@final
class Outboxes:
    """The pending output of a switch's connections, by connection id.

    The decoders' scanners forward local messages into it during `feed` (binary frames,
    payload unmasked straight into the destination's buffer) and count them; Python appends
    everything else a connection sends (`push`, `push_many`, `push_raw`, in order with the
    forwards) and writes each connection's bytes once: `take` one connection, or `drain`
    every connection the fast path forwarded to since the last drain. The fast path appends
    only to an outbox that `accepts`: open, not congested, not held."""

    def __new__(cls) -> Outboxes: ...
    def open(self, conn_id: int, conn: object, kind: str = "") -> None:
        """`conn` carries messages from now on (`drain` hands it back with its bytes); what
        the fast path forwards to it is counted under `kind` (its dialect's name)."""
    def close(self, conn_id: int) -> None:
        """Closing: no more forwards from it or to it."""
    def remove(self, conn_id: int) -> None:
        """Gone: its outbox and what it held are dropped."""
    def set_congested(self, conn_id: int, congested: bool) -> None: ...
    def set_held(self, conn_id: int, held: bool) -> None:
        """The dialect holds the fast path back from this connection."""
    def accepts(self, conn_id: int) -> bool: ...
    def pending(self, conn_id: int) -> int:
        """Bytes buffered for the connection."""
    def sent(self, conn_id: int) -> tuple[int, int]:
        """(messages appended to the connection's outbox, by the fast path and by Python;
        bytes taken from it for writing) since it opened; zeros for an unknown connection."""
    def __len__(self) -> int: ...
    def push(self, conn_id: int, payload: bytes) -> None:
        """One binary frame of `payload` after what is buffered (an unknown id: ignored)."""
    def push_many(self, conn_id: int, payloads: list[bytes]) -> None: ...
    def push_text(self, conn_id: int, payload: bytes) -> None:
        """One text frame of `payload`, after whatever is queued."""
    def push_raw(self, conn_id: int, frame: bytes) -> None:
        """An encoded frame (text, control) after what is buffered."""
    def take(self, conn_id: int) -> memoryview | None:
        """Everything buffered for the connection (None: nothing), lent without a copy (a view
        of an `OutBytes`); the outbox starts over in a spare buffer."""
    def drain(self) -> list[tuple[Any, memoryview]]:
        """(conn, bytes) for each connection the fast path forwarded to since the last drain
        and that still has bytes buffered (as `take`). Records the fast path queued for other
        instances meanwhile go to the crossing sink first (`set_crossing_sink`)."""
    def take_crossing(self) -> list[tuple[int, bytes, int]]:
        """The records the fast path queued for other instances (crossing.rs), taken: one
        (instance, records in cluster/wire.py's layout, how many) per instance."""
    def set_crossing_sink(
        self, sink: Callable[[list[tuple[int, bytes, int]]], None] | None
    ) -> None:
        """`drain` calls `sink(batches)` (as `take_crossing` returns them) when there are any."""
    @property
    def crossing_open(self) -> bool:
        """Whether the fast path may queue envelopes for other instances (remote routes)."""
    @crossing_open.setter
    def crossing_open(self, open: bool) -> None: ...
    @property
    def store_ttl(self) -> int:
        """Seconds: how long a crossing record may wait in its receiver's store at most (the
        bound of the deadline it carries)."""
    @store_ttl.setter
    def store_ttl(self, ttl: int) -> None: ...
    def place_records(
        self, routes: RouteTable, data: bytes, offset: int, max_bytes: int
    ) -> tuple[int, int]:
        """Write the messages of a bus entry (`data`, cluster/wire.py's layout, from the record
        at `offset`) for sessions connected here (in `routes`) into their outboxes, in order,
        until a record it does not place (not a message, not a session here, an outbox that
        does not accept) or `max_bytes` were written; returns (the offset of the first record
        left, how many it wrote). `drain` lists the outboxes written to."""
    def forwarded(self, kind: str) -> tuple[int, int]:
        """(messages, bytes) the fast path forwarded to connections opened as `kind`."""
    @property
    def placed(self) -> tuple[int, int]:
        """(messages, bytes) from other instances `place_records` wrote here."""
    @property
    def crossed(self) -> tuple[int, int]:
        """(messages, bytes) the fast path queued for other instances."""
    def __repr__(self) -> str: ...

@final
class OutBytes:
    """A taken outbox's bytes behind a read-only buffer: the transport writes them without a
    copy, and the buffer is reused for later output once the last view of it is gone."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __repr__(self) -> str: ...

def check_bus_records(data: bytes) -> int:
    """How many records a bus entry (cluster/wire.py's layout) holds; ValueError saying what is
    wrong when it is malformed (wire.decode's checks)."""

# ---- forward/routes.rs ------------------------------------------------------------------
@final
class RouteTable:
    """Session (twin, sid) -> connection id and 32-byte pubkey -> connection id."""

    def __new__(cls) -> RouteTable: ...
    def register_session(self, twin: int, sid: str | None, conn_id: int) -> int | None:
        """Map the session to conn_id; returns the connection it displaced, if any."""
    def lookup_session(self, twin: int, sid: str | None) -> int | None: ...
    def unregister_session(self, twin: int, sid: str | None, conn_id: int) -> bool:
        """Remove only if still mapped to conn_id: a replaced connection must not evict
        its successor."""
    def register_pubkey(self, pubkey: bytes, conn_id: int) -> int | None: ...
    def lookup_pubkey(self, pubkey: bytes) -> int | None: ...
    def unregister_pubkey(self, pubkey: bytes, conn_id: int) -> bool: ...
    @property
    def session_count(self) -> int: ...
    @property
    def pubkey_count(self) -> int: ...
    def set_remote(
        self, twin: int, sid: str | None, instance: int, name: bytes, since: int, expires: int
    ) -> None:
        """Route the session to another instance (`instance`, the caller's number of it; `name`
        its address name in bus records, at most 65535 bytes) from `since` until `expires`
        (the scan clock, ns): RMB scanners queue its envelopes in `Outboxes`' crossing
        batches."""
    def lookup_remote(self, twin: int, sid: str | None, now: int) -> int | None:
        """The instance of the session's remote route at `now` (None: none, or `now` is not
        within its time)."""
    def forget_remote(self, twin: int, sid: str | None) -> bool: ...
    def forget_instance(self, instance: int) -> int:
        """Drop every remote route to `instance`; how many there were."""
    def clear_remote(self) -> None: ...
    @property
    def remote_count(self) -> int: ...

# ---- end forward/routes.rs ------------------------------------------------------------------

# ---- scanners: codec/scanner.rs, dialects/*/scanner.rs ------------------------
# A scanner reads each data message's routing inside WsDecoder.feed (one call per read).
@disjoint_base
class Scanner:
    """The base of every scanner a `WsDecoder` holds (rust/codec/scanner.rs): a dialect's
    scanner reads each data message inside `feed`, and may forward it itself."""

@final
class EnvelopeScanner(Scanner):
    """Scan binary messages as RMB envelopes, with no session: `from_session` is False and
    `dest_conn_id` None (client-mode decoders). Text messages are not scanned."""

    def __new__(cls) -> EnvelopeScanner: ...

@final
class RmbScanner(Scanner):
    """Scan binary messages as RMB envelopes for one session: `from_session` (the source is
    exactly (twin, sid); an absent and an empty sid differ) and `dest_conn_id` (the connection
    holding the destination in `routes` at scan time). Text messages are not scanned.

    With `limiter`, each envelope is counted against the session's twin at the `now` passed
    to `feed` (whole seconds of it) and `EnvelopeRouting.limited` says the answer. With
    `outboxes` (and this connection's `conn_id` open in them), an envelope within the limit,
    from the session, not a ping, for a local connection whose outbox accepts it is framed into
    that outbox and produces no event (the fast path); one for a session with a remote route
    in `routes` (and no local connection) is queued as a bus record in the outboxes' crossing
    batches, while they are open and this session's `slow` is off; the rest reach Python as
    before."""

    def __new__(
        cls,
        routes: RouteTable,
        twin: int,
        sid: str | None,
        records: RecordBuffer | None = None,
        limiter: FixedWindowLimiter | None = None,
        outboxes: Outboxes | None = None,
        conn_id: int = 0,
    ) -> RmbScanner: ...
    @property
    def routes(self) -> RouteTable: ...
    @property
    def limiter(self) -> FixedWindowLimiter | None: ...
    @property
    def outboxes(self) -> Outboxes | None: ...
    @property
    def conn_id(self) -> int: ...
    @property
    def records(self) -> RecordBuffer | None:
        """Where the scan appends a route record (time, twin, dest_twin, size) for each
        message routed to a local connection (see EnvelopeRouting.record)."""
    @property
    def twin(self) -> int: ...
    @property
    def sid(self) -> str | None: ...
    def set_slow(self, slow: bool) -> None:
        """Python is routing earlier envelopes of this session: none is queued for another
        instance by the scan meanwhile (it would overtake them)."""
    @property
    def slow(self) -> bool: ...

@final
class SbdScanner(Scanner):
    """Scan the messages (binary and text) of one SBD connection whose key is `pubkey`.

    Per message: charge its full length to `limiter` under `ip` (when there is a limiter),
    classify it, and for a forward from a ready sender within budget look up the destination
    key in `routes`. A forward's `WsMessage.data` is the rewritten message (`pubkey` in place
    of the destination key), built in the one copy that unmasks it. A message shorter than
    the 32-byte header has no routing, only a `scan_error` (it is charged all the same).

    With `outboxes` (and this connection's `conn_id` open in them), a forward that found its
    destination is written, rewritten, straight into that connection's outbox when it accepts
    it, and produces no event (the fast path; `active_at` notes when)."""

    def __new__(
        cls,
        routes: RouteTable,
        pubkey: bytes,
        limiter: ByteNanosLimiter | None = None,
        ip: str = "",
        records: RecordBuffer | None = None,
        outboxes: Outboxes | None = None,
        conn_id: int = 0,
    ) -> SbdScanner: ...
    @property
    def outboxes(self) -> Outboxes | None: ...
    @property
    def conn_id(self) -> int: ...
    @property
    def active_at(self) -> int:
        """The `now` of the last forward the fast path made for this connection (0: none)."""
    @property
    def ready(self) -> bool:
        """Set when the handshake completes: only then are forwards routed."""
    @ready.setter
    def ready(self, value: bool) -> None: ...
    @property
    def over_limit(self) -> bool:
        """The limiter has refused a message of this connection; every later message is
        reported over the limit too (and charged no more)."""
    @property
    def pubkey(self) -> bytes: ...
    @property
    def ip(self) -> str: ...
    @property
    def routes(self) -> RouteTable: ...
    @property
    def limiter(self) -> ByteNanosLimiter | None: ...
    @property
    def records(self) -> RecordBuffer | None:
        """Where the scan appends a route record (time, key id of `pubkey`, key id of the
        destination, size) for each forward routed to a local connection."""

@final
class SbdRouting:
    """What an SbdScanner made of one message."""

    @property
    def kind(self) -> int:
        """SBD_COMMAND or SBD_FORWARD."""
    @property
    def tag(self) -> bytes:
        """A command's 4-byte tag (b"" for forwards)."""
    @property
    def payload(self) -> bytes:
        """A command's payload after the header (b"" for forwards: see WsMessage.data)."""
    @property
    def peer(self) -> bytes:
        """A forward's 32-byte destination key as sent (b"" for commands)."""
    @property
    def dest_conn_id(self) -> int | None:
        """A forward's destination connection: set only for a ready sender within budget
        whose destination key is registered."""
    @property
    def sender_ready(self) -> bool:
        """The scanner was `ready` when it scanned this message. A forward scanned before the
        handshake completed is not routed; if the handshake completed earlier in the same read,
        the dialect looks the destination up itself."""
    @property
    def over_limit(self) -> bool:
        """The limiter refused this message (or an earlier one of this connection): drop the
        connection and block the IP."""
    @property
    def record(self) -> int:
        """Index of this forward's route record in the scanner's RecordBuffer (set when
        `dest_conn_id` is); -1 otherwise."""

#: the longest 신경 queue name, in characters (longer ones are refused)
SG_MAX_QUEUE_NAME: Final[int]

@final
class SgQuery:
    """A parsed 신경 query (rust/dialects/singyeong/query.rs, the one implementation)."""

    def __new__(
        cls, raw: Any, max_depth: int = 32, max_ops: int = 1024, max_list: int = 1024
    ) -> SgQuery:
        """Raises SgQueryError (message, limit) for a malformed query or one over a bound."""
    @property
    def raw(self) -> Any: ...
    @property
    def key(self) -> str | None: ...
    @property
    def restricted(self) -> bool: ...
    @property
    def droppable(self) -> bool: ...
    @property
    def optional(self) -> bool: ...
    @property
    def exact(self) -> bool:
        """One top-level `$eq` and nothing else: the hash index alone answers it."""
    def matches(self, client: Any) -> bool:
        """Whether a clients.Client (app_id, restricted, metadata, types) matches."""

@final
class SgIndex:
    """The 신경 gateway's clients by handle (local ones and replicas), the matcher and the
    routing decision (rust/dialects/singyeong/index.rs); `SgScanner`s answer from it."""

    def __new__(
        cls, seed: int, max_depth: int = 32, max_ops: int = 1024, max_list: int = 1024
    ) -> SgIndex:
        """`seed` (64 bits) fixes the SEND picks; the bounds hold queries the scanner parses."""
    def add(
        self,
        handle: int,
        app: str,
        client_id: str,
        restricted: bool,
        conn: int | None,
        json: bool,
        values: dict[str, Any],
        types: dict[str, str],
    ) -> None:
        """The client `handle` (`conn`: its connection here, None for a replica; `json`: that
        connection speaks JSON) with its metadata. Replaces what the handle had."""
    def remove(self, handle: int) -> None: ...
    def set_values(self, handle: int, values: dict[str, Any], types: dict[str, str]) -> None:
        """Metadata values written (later wins); `types` for those that come with one."""
    def matching(self, query: SgQuery) -> list[int]:
        """The handles of every client `query` matches."""
    def resolve(self, query: SgQuery, broadcast: bool) -> list[int]:
        """A SEND's receiver (one) or a BROADCAST's (all): match, optional, selector, key."""
    def matches(self, query: SgQuery, handle: int) -> bool: ...
    def candidate_count(self, query: SgQuery) -> int:
        """How many clients matching `query` reads."""
    def rendezvous_weight(self, key: str, handle: int) -> int | None: ...
    def __len__(self) -> int: ...
    @property
    def counts(self) -> tuple[int, int]:
        """(sends, broadcasts) the scanners answered (their DISPATCH frames are
        `Outboxes.forwarded("singyeong")`)."""

def sg_dispatch_text(t: str, nonce: str, payload: str, extra: str, ts_ms: int) -> bytes:
    """A 신경 DISPATCH as JSON from its parts' JSON texts (`extra`: `,"key":value`...)."""

# The queue frames an SgScanner reads (rust/dialects/singyeong/mod.rs, QueueFrame). Plain
# tuples at run time: private here (no run-time name for stubtest to find).
#: QUEUE: (0, queue, nonce JSON | None, target JSON, payload JSON, the frame's size in bytes,
#: the payload JSON is what Python's encoder writes)
_SgQueue = tuple[Literal[0], str, str | None, str, str, int, bool]
#: QUEUE_REQUEST: (1, queue)
_SgQueueRequest = tuple[Literal[1], str]
#: QUEUE_ACK: (2, queue, id)
_SgQueueAck = tuple[Literal[2], str, str]
_SgQueueFrame = _SgQueue | _SgQueueRequest | _SgQueueAck

@final
class SgScanner(Scanner):
    """Scanner of one JSON 신경 connection: once `ready`, its SEND/BROADCAST frames whose
    answer `index` resolves to JSON receivers here are written into their `outboxes` inside
    `feed` (no event), and its QUEUE / QUEUE_REQUEST / QUEUE_ACK frames come as
    `_SgQueueFrame` tuples in batches (`WsMessage.routing`); every other frame, and every later
    one of the same read, goes to Python as it came. The decoder's `now` must be the wall clock
    (ns): it stamps the frames' `ts`."""

    def __new__(cls, index: SgIndex, outboxes: Outboxes, conn_id: int) -> SgScanner: ...
    @property
    def conn_id(self) -> int: ...
    @property
    def ready(self) -> bool: ...
    @ready.setter
    def ready(self, value: bool) -> None: ...

@final
class TunnelScanner(Scanner):
    """Scanner of one tunnel connector's websocket: each message the hub handles without
    Python (a `Deliver` for a fast-path client, an `Acknowledge`) is taken inside `feed`;
    every other message, and every later one of the same read, goes to Python as it came."""

    def __new__(cls, hub: TunnelHub, conn_id: int, binary: bool) -> TunnelScanner:
        """Writing into the hub's outboxes."""
    @property
    def conn_id(self) -> int: ...
    @property
    def binary(self) -> bool: ...

@final
class StampScanner(Scanner):
    """The load harness's receiver (rust/load.rs): every stamped data message of a read is
    recorded into `recorder` inside `feed` (its `now`: the arrival time on the clock the
    senders stamp with) and produces no event, also after one that went to Python; messages
    without a stamp (an error envelope, an SBD command, one too short) reach Python as they
    came. `dialect` "rmb": the stamp opens the envelope's `size`-byte payload, its last field
    on the wire; "sbd": it follows a forward's 32-byte header; both with `streams` the
    connection's one stream. "singyeong-json", "singyeong-msgpack": the 38-digit stamp opens a
    DISPATCH's `payload` string and names its stream; `streams` maps this process's stream
    indices to their fan-out, and a delivery of a stream with fan-out > 1 is copy `receiver`
    (else 0); a stamp of another stream is not recorded (it reaches Python)."""

    def __new__(
        cls,
        recorder: LoadRecorder,
        streams: int | dict[int, int],
        size: int,
        dialect: str,
        receiver: int = 0,
    ) -> StampScanner: ...
    def record_message(self, data: bytes, now: int) -> bool:
        """Record `data` as `feed` would; False when it carries no stamp."""

# ---- end scanners: codec/scanner.rs, dialects/*/scanner.rs ------------------------

# ---- crypto.rs --------------------------------------------------------------------------
def verify_ed25519(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """RFC 8032 (non-strict, as ed25519-dalek `verify`); SignatureError on wrong lengths."""

def verify_sr25519(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """schnorrkel with the substrate signing context; SignatureError on wrong lengths."""

def verify_prefixed(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """65-byte RMB signature: b"e" (ed25519) or b"s" (sr25519) then 64 bytes."""

@final
class SigningKey:
    """A private key for signing JWTs and envelopes (SDK, peer, load harness)."""

    @staticmethod
    def ed25519(seed: bytes) -> SigningKey: ...
    @staticmethod
    def sr25519(mini_secret: bytes) -> SigningKey:
        """Substrate expansion (ExpansionMode::Ed25519) of a 32-byte mini secret."""
    @property
    def key_type(self) -> str:
        """ "ed25519" or "sr25519"."""
    @property
    def public_key(self) -> bytes: ...
    def sign(self, message: bytes) -> bytes:
        """64-byte signature."""
    def sign_prefixed(self, message: bytes) -> bytes:
        """65-byte RMB form: type prefix then signature."""

# ---- end crypto.rs --------------------------------------------------------------------------

# ---- load.rs ----------------------------------------------------------------------------

STAMP_LEN: Final[int]
"""Bytes of a load message's stamp: sequence number, then send time (ns), little-endian."""

@final
class LoadRecorder:
    """Every delivery of one load generator process: counts per stream, duplicates per
    (stream, copy), and while measuring the latency, bytes, second (since `start_measuring`)
    and, with `keep_samples`, the (send time, stream, latency) row of each."""

    def __new__(cls, keep_samples: bool = False) -> LoadRecorder: ...
    def record(
        self,
        stream: int,
        sent_ns: int,
        now_ns: int,
        size: int,
        seq: int | None = None,
        copy: int = 0,
    ) -> bool:
        """One delivery (or fan-out copy `copy`); False for a second arrival of `seq` (counted
        in `duplicated`) or a `seq` of 2^30 or more (`out_of_range`, not tracked)."""
    def delivered(self, stream: int) -> int: ...
    def start_measuring(self, now_ns: int) -> None: ...
    def stop_measuring(self) -> None: ...
    @property
    def measured(self) -> int: ...
    @property
    def bytes_delivered(self) -> int: ...
    @property
    def duplicated(self) -> int: ...
    @property
    def out_of_range(self) -> int: ...
    @property
    def timeline(self) -> list[int]:
        """Deliveries per second of the measuring window."""
    def latencies(self) -> bytes:
        """The measured latencies (ns), native int64s."""
    def samples(self) -> bytes | None:
        """The sample triples as native int64s; None without `keep_samples`."""

@final
class SingyeongBatch:
    """A 신경 sender stream's messages (rust/load.rs): message i is template `i % len` (the
    frame's bytes before and after its payload string) around the 38-digit stamp (stream,
    sequence number, send time ns) and `padding` bytes of "#", each a masked text frame
    (`text`: JSON) or binary frame (msgpack). ValueError without templates, for a stream past
    999999, a seed that is not 32 bytes, or a sequence number past 12 digits."""

    def __new__(
        cls,
        templates: list[tuple[bytes, bytes]],
        padding: int,
        stream: int,
        text: bool,
        seed: bytes,
    ) -> SingyeongBatch: ...
    def frames(self, first_seq: int, n: int, sent_ns: int) -> bytes:
        """Masked frames of messages `first_seq..first_seq + n`, stamped `sent_ns`."""

@final
class StampedBatch:
    """One stream's send batches: `template` with the stamp written at `stamp_at`, as masked
    binary frames (masks from a PRNG seeded with os.urandom(32), as ClientFrameEncoder)."""

    def __new__(cls, template: bytes, stamp_at: int, seed: bytes) -> StampedBatch: ...
    def sign_with(self, key: SigningKey, before: bytes, after: bytes, sig_at: int) -> None:
        """Sign every message from now on: MD5 of `before` + its payload (the template from the
        stamp on) + `after`, written at `sig_at`, prefixed with the key type (ValueError when
        it does not fit before the stamp)."""
    def frames(self, first_seq: int, n: int, sent_ns: int) -> bytes:
        """Messages first_seq..first_seq + n, all stamped `sent_ns`, in one bytes object."""

def latency_percentiles(samples: bytes, points: list[float]) -> list[int]:
    """Nearest-rank percentiles (ns) of native int64 `samples` at `points`, then the maximum
    (zeros when there are none)."""

# ---- end load.rs ----------------------------------------------------------------------------

# ---- records.rs -------------------------------------------------------------------------

@final
class Column:
    """One column of route records taken from a RecordBuffer: native-endian int64 values
    behind a read-only buffer (`numpy.frombuffer(column, numpy.int64)`, `pyarrow.py_buffer`),
    viewed without a copy."""

    def __len__(self) -> int:
        """Values (not bytes)."""
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class RecordBuffer:
    """Route records of the fast path, appended by the scanners that hold this buffer inside
    `WsDecoder.feed` at the `now` passed to it (plus `offset`), kept as four int64 columns
    (time in microseconds, source, destination, size). Addresses are integers: RMB twin ids,
    SBD keys interned in order of first use. Python takes them once per flush."""

    def __new__(cls) -> RecordBuffer: ...
    @property
    def offset(self) -> int:
        """Nanoseconds added to `now` (the wall clock minus the scan clock)."""
    @offset.setter
    def offset(self, value: int) -> None: ...
    def push(self, time: int, src: int, dst: int, size: int) -> int:
        """Append one record as a scanner does (`time`: ns of the scan clock); its index."""
    def key_id(self, key: bytes) -> int:
        """The id a 32-byte SBD key is recorded as (interned as the scanner does)."""
    def retract(self, index: int) -> bool:
        """Mark the record at `index` as not delivered (its size becomes -1); False if no such
        record is buffered (taken already, retracted already, or never appended)."""
    def take(self) -> tuple[Column, Column, Column, Column, list[bytes]]:
        """(time_us, src, dst, size, keys): every record since the last take but the
        retracted ones, as four columns, and the SBD keys first used since the last take, in
        id order. The buffer starts over; record indexes keep counting."""
    def __len__(self) -> int: ...

# ---- dialects/tunnel/wire.rs ---------------------------------------------------------------

def tunnel_encode(message: object, binary: bool) -> bytes:
    """A tunnel message (wire.py's dataclasses) as msgpack or compact JSON, as Python's
    msgpack and json libraries write the same fields; TunnelWireError for a field holding a
    value no message can carry."""

def tunnel_decode(data: bytes, binary: bool, expected: int = 31) -> tuple[str, tuple[Any, ...]]:
    """(kind name, field values in dataclass order) of a message of a kind in `expected` (one
    bit per entry of TUNNEL_KINDS); TunnelWireError saying what is wrong, naming the field."""

def tunnel_request_headers(request: HttpRequest) -> dict[str, list[str]]:
    """The request's fields as `httpHeaders`: name -> values (latin-1 text), names in
    first-seen order, without TUNNEL_HOP_BY_HOP."""

TUNNEL_HOP_BY_HOP: Final[tuple[str, ...]]
#: the message kinds (invocation names) in the order of `tunnel_decode`'s bits
TUNNEL_KINDS: Final[tuple[str, ...]]

# ---- dialects/tunnel/hub.rs ----------------------------------------------------------------

#: an outcome: (status, the relay's reason or None, the connector's fields, its inline body,
#: the size of a stored body or None, the request id)
_TunnelOutcome: TypeAlias = tuple[
    int, str | None, list[tuple[str, str]] | None, bytes | None, int | None, str | None
]

@final
class TunnelHub:
    """The tunnel's hub: every decision about a tunnelled request (dialects/tunnel/hub.py)."""

    def __new__(
        cls,
        outboxes: Outboxes,
        origin_id: str,
        instance: str,
        *,
        ttl: int,
        span: int,
        inline_limit: int,
        default_limit: int,
        default_ack_mode: int,
        least_inflight: bool,
        require_connection: bool,
        shortcut: bool,
        clustered: bool,
        tenant_bytes: int,
        total_bytes: int,
        tenant_ttl: int,
        tenant_max: int,
        machine: str,
        version: str,
    ) -> TunnelHub:
        """ValueError for an acknowledge mode beyond 3."""
    def feed(
        self,
        parser: HttpStreamParser,
        data: bytes,
        client: int,
        conn: object,
        now: int,
        wall: int,
    ) -> list[HttpRequest | HttpData | HttpEnd | HttpViolation] | None:
        """A client's read: None when the hub took its request, else the parser's events."""
    def step(
        self,
        request: HttpRequest,
        body: bytes | tuple[str, int] | None,
        token: int,
        reachable: bool | None,
        now: int,
        wall: int,
    ) -> tuple[Any, ...]:
        """The request's next step: (kind, ...) as dialects/tunnel/hub.py names the kinds."""
    def take_effects(self) -> list[tuple[Any, ...]]:
        """What Python must do now: (kind, ...) as dialects/tunnel/hub.py names the kinds."""
    @property
    def has_effects(self) -> bool: ...
    def set_tenant(
        self, key: str, settings: tuple[str, bool, int, int | None, bool] | None, now: int
    ) -> None:
        """The directory's answer for a tenant: (name, require_auth, max_concurrent, ack_mode,
        forward_authorization)."""
    def cached(self, key: str, now: int) -> str | None | None:
        """None: not cached (or stale); else its stored name (None: no such tenant)."""
    def forget_tenant(self, key: str) -> None: ...
    @property
    def tenants_cached(self) -> int: ...
    def add_token(self, token: str, tenant: str, until: int, roles: int, /) -> None: ...
    def known_token(self, token: str, wall: int, /) -> tuple[str, int] | None: ...
    def forget_tokens(self, key: str) -> None: ...
    def refill(self, entropy: bytes) -> None: ...
    @property
    def ids_left(self) -> int: ...
    def add_connector(self, key: str, conn_id: int, binary: bool, now: int) -> None: ...
    def remove_connector(self, conn_id: int, now: int) -> None: ...
    def connector_message(self, conn_id: int, data: bytes, binary: bool, now: int) -> str | None:
        """None when handled, else the text of the `Error` it is answered with."""
    def expire(self, now: int, slack: int) -> None: ...
    @property
    def next_deadline(self) -> int | None: ...
    def abandon_client(self, conn_id: int) -> None: ...
    def abandon_task(self, token: int) -> None: ...
    def client_done(self, conn_id: int) -> None: ...
    def acknowledge_manual(self, request_id: str, token: str) -> bool: ...
    def take_remote(
        self, key: str, message: bytes, pickup: int, origin: str, stored: str | None, now: int
    ) -> bool: ...
    def remote_reply(self, request_id: str, frame: bytes, now: int) -> None: ...
    def instance_gone(self, instance: str, now: int) -> None: ...
    def unpublish(self, request_id: str) -> None: ...
    def publish_failed(self, request_id: str) -> None: ...
    def withdrawn(self, request_id: str, now: int) -> None: ...
    def taken_by(self, request_id: str, instance: str) -> None: ...
    def request_body(self, request_id: str, key: str) -> tuple[str, bool] | None: ...
    def body_fetched(self, request_id: str) -> None: ...
    def tenant_of(self, request_id: str) -> str | None: ...
    def has_connector(self, key: str) -> bool: ...
    def published(self) -> list[tuple[str, str | None]]: ...
    def stored_bodies(self) -> list[str]: ...
    def count_refusal(
        self,
        name: str,
        dst: str | None,
        status: int,
        outcome: str,
        reason: str,
        started: int,
        now: int,
    ) -> None: ...
    def close(self, now: int) -> None: ...
    def __len__(self) -> int: ...
    def requests(self) -> list[tuple[tuple[str, str, str], int]]: ...
    def http_answers(self) -> list[tuple[tuple[str, str], int]]: ...
    def fast_path(self) -> list[tuple[str, int]]: ...
    @property
    def expired(self) -> int: ...
    @property
    def redelivered(self) -> int: ...
    @property
    def refused(self) -> tuple[int, int]: ...
    def tenant_gauges(self) -> list[tuple[str, str, int, int, int, int]]: ...
    @property
    def held_total(self) -> int: ...
    recording: bool
    def take_records(
        self,
    ) -> list[tuple[int, str | None, int, str, str, str | None, int]]: ...

# ---- dialects/tunnel/connector.rs ---------------------------------------------------------

@final
class TunnelRequest:
    """A `RequestTarget` the connector's core received: `refused` when the core answered it
    (404, 502) or dropped it (expired) itself, else what running it takes: `wire` (the request
    bytes) for a plain-http web target, `method`/`url`/`headers`/`body` for any other."""

    @property
    def request_id(self) -> str: ...
    @property
    def target(self) -> int:
        """The target's index in the list the core was made with."""
    @property
    def refused(self) -> str | None: ...
    @property
    def wire(self) -> bytes | None: ...
    @property
    def head(self) -> bool:
        """A HEAD request: its answer has no body."""
    @property
    def outsourced(self) -> bool:
        """The body waits in the relay's body store (download it)."""
    @property
    def body_size(self) -> int: ...
    @property
    def delete_body(self) -> bool:
        """Download the outsourced body with `delete=true`."""
    @property
    def answered(self) -> bool: ...
    @property
    def method(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def headers(self) -> list[tuple[str, str]]:
        """The client's fields less those of its hop to the relay, then the acknowledge URL
        and tracing fields."""
    @property
    def body(self) -> bytes: ...

@final
class TunnelConnectorCore:
    """The connector's decisions for one websocket (`targets`: each target's `str.upper()`
    name with `(Host, base path)` for a plain-http web target, else None): which requests run,
    their target requests, their `Deliver`s and `Acknowledge`s as masked frames."""

    def __new__(
        cls,
        binary: bool,
        seed: bytes,
        server: str,
        inline_limit: int,
        targets: list[tuple[str, tuple[str, str] | None]],
    ) -> TunnelConnectorCore: ...
    def request(self, payload: bytes, now: int) -> TunnelRequest | None:
        """One message: its TunnelRequest, or None for a message that is no well-formed
        RequestTarget. `now`: monotonic ns."""
    def feed_ws(
        self, decoder: WsDecoder, data: bytes | bytearray | memoryview, now: int
    ) -> list[TunnelRequest | WsEvent]:
        """A websocket read in one call: deframed by `decoder`, each RequestTarget as a
        TunnelRequest, every other event as `WsDecoder.feed` gives it."""
    def respond(
        self, request: TunnelRequest, parser: HttpResponseParser, data: bytes, now: int
    ) -> list[tuple[int, list[tuple[str, str]], bytes | None] | bytes | None] | None:
        """None when `data` completed the request's whole answer (delivered), else the
        parser's events as `HttpResponseParser.feed` gives them; HttpResponseError."""
    def answer(
        self,
        request: TunnelRequest,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes | None,
        size: int,
        now: int,
    ) -> None:
        """The target's answer: `body` inline, or (None) `size` bytes uploaded; nothing when
        the request was answered already."""
    def fail(self, request: TunnelRequest, timed_out: bool, now: int) -> None:
        """The target failed (502) or did not answer in time (504)."""
    def uploads(self, request: TunnelRequest, length: int | None) -> bool:
        """Whether an answer of `length` body bytes (None: a stream) is uploaded first."""
    def take_output(self) -> bytes:
        """The frames queued since the last call, masked, for one write."""
    @property
    def has_output(self) -> bool: ...

# ---- end dialects/tunnel/connector.rs -----------------------------------------------------
