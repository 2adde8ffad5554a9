"""rmb_relay._core HTTP codec (rust/codec/http.rs) through the Python binding: request parsing
with its limits and status codes, the event parser (streamed and chunked bodies), pipelining,
the websocket handshake, the encoders, and the client side's response head."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rmb_relay._core import (
    ClientFrameEncoder,
    HttpData,
    HttpEnd,
    HttpEvent,
    HttpParseError,
    HttpRequest,
    HttpStreamParser,
    HttpViolation,
    WsDecoder,
    WsMessage,
    encode_chunk,
    encode_last_chunk,
    encode_request,
    encode_response,
    encode_response_head,
    encode_switching_protocols,
    parse_response_head,
    validate_websocket_upgrade,
    websocket_accept,
)

UPGRADE = (
    b"GET /?eyJhbGciOi HTTP/1.1\r\n"
    b"Host: relay.example\r\n"
    b"Upgrade: websocket\r\n"
    b"Connection: keep-alive, Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n"
    b"\r\n"
)
RFC6455_ACCEPT = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455 section 1.3


class Whole:
    """The event parser read a whole request at a time, its body gathered (what a connection's
    handler sees); a violation raised as HttpParseError, and again on every later call."""

    def __init__(self, **limits: int) -> None:
        self.parser = HttpStreamParser(**limits)
        self.head: HttpRequest | None = None
        self.body = b""
        self.failed: HttpParseError | None = None

    def feed(self, data: bytes) -> HttpRequest | None:
        if self.failed is not None:
            raise self.failed
        if self.parser.done:
            self.parser.start_next_cycle()
        for event in self.parser.feed(data):
            if isinstance(event, HttpRequest):
                self.head = event
            elif isinstance(event, HttpData):
                self.body += event.data
            elif isinstance(event, HttpEnd):
                assert self.head is not None
                request, self.body = self.head.with_body(self.body), b""
                return request
            else:
                self.failed = HttpParseError(event.reason, event.status)
                raise self.failed
        return None

    @property
    def buffered(self) -> int:
        return 0 if self.failed is not None else self.parser.buffered + len(self.body)

    def take_rest(self) -> bytes:
        return self.parser.take_rest()


def parse(data: bytes, **limits: int) -> HttpRequest:
    request = Whole(**limits).feed(data)
    assert request is not None
    return request


def status_of(data: bytes, **limits: int) -> int:
    with pytest.raises(HttpParseError) as info:
        Whole(**limits).feed(data)
    message, status = info.value.args
    assert isinstance(message, str)
    return int(status)


# ---- parsing ----


def test_parses_request_line_and_headers() -> None:
    request = parse(b"GET /a/b?x=1&y HTTP/1.1\r\nHost: h\r\nX-Thing: V\r\nx-thing: W\r\n\r\n")
    assert request.method == "GET"
    assert request.path == "/a/b"
    assert request.query == "x=1&y"
    assert request.version == 1
    assert request.headers == [("host", b"h"), ("x-thing", b"V"), ("x-thing", b"W")]
    assert request.header("X-THING") == b"V"
    assert request.header("missing") is None
    assert request.body == b""
    assert request.keep_alive
    assert not request.is_websocket_upgrade
    assert repr(request) == "<HttpRequest GET /a/b?x=1&y HTTP/1.1>"


def test_query_is_none_without_question_mark() -> None:
    assert parse(b"GET /x HTTP/1.1\r\n\r\n").query is None
    assert parse(b"GET /x? HTTP/1.1\r\n\r\n").query == ""


def test_incomplete_request_returns_none_until_complete() -> None:
    parser = Whole()
    assert parser.feed(b"POST / HTTP/1.1\r\nContent-Le") is None
    assert parser.feed(b"ngth: 5\r\n\r\nab") is None
    assert parser.buffered == 2
    request = parser.feed(b"cde")
    assert request is not None
    assert request.body == b"abcde"
    assert parser.buffered == 0


def test_request_fed_byte_by_byte() -> None:
    parser = Whole()
    results = [parser.feed(UPGRADE[i : i + 1]) for i in range(len(UPGRADE))]
    assert results[:-1] == [None] * (len(UPGRADE) - 1)
    assert results[-1] is not None
    assert results[-1].is_websocket_upgrade


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", True),
    ],
)
def test_keep_alive_follows_version_and_connection(head: bytes, keep_alive: bool) -> None:
    assert parse(head).keep_alive is keep_alive


@pytest.mark.parametrize(
    ("head", "upgrade"),
    [
        (UPGRADE, True),
        (b"GET / HTTP/1.1\r\nUpgrade: WebSocket\r\nConnection: UPGRADE\r\n\r\n", True),
        (b"POST / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n", False),
    ],
)
def test_websocket_upgrade_detection(head: bytes, upgrade: bool) -> None:
    assert parse(head).is_websocket_upgrade is upgrade


# ---- limits and status codes ----


def test_head_over_limit_is_431_before_it_ends() -> None:
    parser = Whole()
    assert parser.feed(b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 16000) is None
    with pytest.raises(HttpParseError) as info:
        parser.feed(b"a" * 1000)
    assert info.value.args == ("request header fields too large", 431)
    assert parser.buffered == 0
    with pytest.raises(HttpParseError):
        parser.feed(b"\r\n\r\n")


def test_head_limit_is_configurable() -> None:
    head = b"GET / HTTP/1.1\r\nX: " + b"a" * 100 + b"\r\n\r\n"
    assert status_of(head, max_head=100) == 431
    assert parse(head, max_head=len(head)).header("x") == b"a" * 100


def test_too_many_headers_is_431() -> None:
    def request(n: int) -> bytes:
        return b"GET / HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(n)) + b"\r\n"

    assert len(parse(request(64)).headers) == 64
    assert status_of(request(65)) == 431
    assert status_of(request(11), max_headers=10) == 431


def test_a_length_beyond_64_bits_is_413_without_waiting_for_it() -> None:
    assert status_of(b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n") == 413


def test_chunked_body_is_gathered_whole() -> None:
    data = (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    )
    request = parse(data)
    assert (request.body, request.chunked, request.content_length) == (b"abcde", True, None)


@pytest.mark.parametrize(
    ("codings", "status"),
    [
        (b"Transfer-Encoding: gzip, chunked", 501),
        (b"Transfer-Encoding: gzip", 400),
        (b"Transfer-Encoding: chunked, chunked", 400),
        (b"Transfer-Encoding: chunked\r\nContent-Length: 5", 400),
    ],
)
def test_transfer_codings_we_refuse(codings: bytes, status: int) -> None:
    assert status_of(b"POST / HTTP/1.1\r\n" + codings + b"\r\n\r\n0\r\n\r\n") == status


@pytest.mark.parametrize(
    "head",
    [
        b"GET\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
    ],
)
def test_malformed_head_is_400(head: bytes) -> None:
    assert status_of(head) == 400


@pytest.mark.parametrize(
    "lengths",
    [b"Content-Length: 3\r\nContent-Length: 4", b"Content-Length: 3, 4", b"Content-Length: -1"],
)
def test_conflicting_or_invalid_content_length_is_400(lengths: bytes) -> None:
    assert status_of(b"POST / HTTP/1.1\r\n" + lengths + b"\r\n\r\nabcd") == 400


def test_repeated_identical_content_length_is_one_value() -> None:
    data = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc"
    assert parse(data).body == b"abc"


# ---- pipelining and upgrade hand-off ----


def test_pipelined_requests_come_out_one_per_feed() -> None:
    parser = Whole()
    data = (
        b"GET /1 HTTP/1.1\r\n\r\n"
        + b"POST /2 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"
        + b"GET /3 HTTP/1.1\r\n\r\nGET /4 HT"
    )
    first = parser.feed(data)
    assert first is not None
    assert first.path == "/1"
    second = parser.feed(b"")
    assert second is not None
    assert (second.path, second.body) == ("/2", b"abc")
    third = parser.feed(b"")
    assert third is not None
    assert third.path == "/3"
    assert parser.feed(b"") is None
    assert parser.buffered == len(b"GET /4 HT")
    fourth = parser.feed(b"TP/1.1\r\n\r\n")
    assert fourth is not None
    assert fourth.path == "/4"


def test_take_rest_hands_bytes_after_upgrade_to_the_decoder() -> None:
    frames = ClientFrameEncoder(b"s" * 32).binary_batch([b"early", b"frames"])
    parser = Whole()
    request = parser.feed(UPGRADE + frames)
    assert request is not None
    assert request.is_websocket_upgrade
    rest = parser.take_rest()
    assert rest == frames
    assert parser.buffered == 0
    assert parser.take_rest() == b""
    events = WsDecoder().feed(rest)
    assert [ev.data for ev in events if isinstance(ev, WsMessage)] == [b"early", b"frames"]


# ---- the event parser ----


def summary(events: list[HttpEvent]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples, adjacent data merged (its split follows the input's)."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, HttpRequest):
            out.append(("head", event.method, event.path, event.content_length, event.chunked))
        elif isinstance(event, HttpData):
            if out and out[-1][0] == "data":
                out[-1] = ("data", out[-1][1] + event.data)
            else:
                out.append(("data", event.data))
        elif isinstance(event, HttpEnd):
            out.append(("end", event.trailers))
        else:
            out.append(("violation", event.status, event.reason))
    return out


def drive(pieces: list[bytes]) -> list[tuple[Any, ...]]:
    """Feed the pieces, starting the next cycle whenever a request has ended."""
    parser = HttpStreamParser()
    events: list[HttpEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
        while parser.done:
            parser.start_next_cycle()
            events += parser.feed(b"")
    return summary(events)


CHUNKED = (
    b"PUT /upload HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n"
    b"Expect: 100-continue\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nDigest: sha-256=x\r\n\r\n"
)
PIPELINE = (
    CHUNKED
    + b"POST / HTTP/1.1\r\nContent-Length: 8\r\n\r\nenvelope"
    + b"GET /health HTTP/1.1\r\n\r\n"
)
PIPELINE_EVENTS = [
    ("head", "PUT", "/upload", None, True),
    ("data", b"hello world"),
    ("end", [("digest", b"sha-256=x")]),
    ("head", "POST", "/", 8, False),
    ("data", b"envelope"),
    ("end", []),
    ("head", "GET", "/health", 0, False),
    ("end", []),
]


def test_stream_parser_golden_events() -> None:
    parser = HttpStreamParser()
    events = parser.feed(CHUNKED + b"GET / HTTP/1.1\r\n\r\n")
    head, data, end = events
    assert isinstance(head, HttpRequest)
    assert (head.method, head.path, head.chunked, head.has_body) == ("PUT", "/upload", True, True)
    assert head.expect_continue
    assert head.body == b""
    assert isinstance(data, HttpData)
    assert data.data == b"hello world"  # the chunks of one read come out as one HttpData
    assert isinstance(end, HttpEnd)
    assert end.trailers == [("digest", b"sha-256=x")]
    # stopped at the end of the request: the next one waits for start_next_cycle
    assert parser.done
    assert parser.feed(b"") == []
    assert parser.buffered == len(b"GET / HTTP/1.1\r\n\r\n")
    parser.start_next_cycle()
    assert summary(parser.feed(b"")) == [("head", "GET", "/", 0, False), ("end", [])]


def test_body_arrives_as_it_is_read() -> None:
    parser = HttpStreamParser()
    assert summary(parser.feed(b"POST / HTTP/1.1\r\nContent-Length: 6\r\n\r\nab")) == [
        ("head", "POST", "/", 6, False),
        ("data", b"ab"),
    ]
    assert summary(parser.feed(b"cd")) == [("data", b"cd")]
    assert summary(parser.feed(b"ef")) == [("data", b"ef"), ("end", [])]
    assert parser.buffered == 0


def test_start_next_cycle_before_the_end_is_refused() -> None:
    parser = HttpStreamParser()
    parser.feed(b"POST / HTTP/1.1\r\nContent-Length: 6\r\n\r\nab")
    with pytest.raises(ValueError, match="not ended"):
        parser.start_next_cycle()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(PIPELINE)), max_size=20))
def test_any_split_of_the_input_gives_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(PIPELINE)]
    pieces = [PIPELINE[a:b] for a, b in itertools.pairwise(bounds)]
    assert drive(pieces) == PIPELINE_EVENTS


def test_byte_by_byte_gives_the_same_events() -> None:
    assert drive([PIPELINE[i : i + 1] for i in range(len(PIPELINE))]) == PIPELINE_EVENTS


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"zz\r\n", "invalid chunk size"),
        (b"5\nhello\r\n", "chunk size line must end with CRLF"),
        (b"5\r\nhelloXY", "chunk data not followed by CRLF"),
        (b"5;\x00\r\n", "invalid chunk extension"),
        (b"1" * 17 + b"\r\n", "chunk size too large"),
        (b"1;" + b"e" * 5000, "chunk size line too long"),
        (b"0\r\nbad trailer\r\n\r\n", "invalid trailer field"),
        (b"0\r\nX: 1\n\n", "trailer line must end with CRLF"),
    ],
)
def test_malformed_chunked_body_is_a_400_violation(body: bytes, reason: str) -> None:
    parser = HttpStreamParser()
    events = parser.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    violation = events[-1]
    assert isinstance(violation, HttpViolation)
    assert (violation.status, violation.reason) == (400, reason)
    assert parser.feed(b"GET / HTTP/1.1\r\n\r\n") == []  # silent from then on


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 20000, 431),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: br, chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nT: " + b"v" * 9000, 431),
    ],
)
def test_stream_parser_violations(data: bytes, status: int) -> None:
    events = HttpStreamParser().feed(data)
    assert isinstance(events[-1], HttpViolation)
    assert events[-1].status == status


def test_stream_parser_limits_are_configurable() -> None:
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    events = HttpStreamParser(max_chunk_line=8).feed(head + b"1;abcdef\r\n")
    assert isinstance(events[-1], HttpViolation)
    events = HttpStreamParser(max_trailers=8).feed(head + b"0\r\nA: 1234\r\n\r\n")
    assert isinstance(events[-1], HttpViolation)
    assert events[-1].status == 431
    events = HttpStreamParser(max_trailers=16).feed(head + b"0\r\nA: 1234\r\n\r\n")
    assert isinstance(events[-1], HttpEnd)


def test_large_body_is_never_buffered() -> None:
    parser = HttpStreamParser()
    parser.feed(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = encode_chunk(b"x" * 65536)
    total = 0
    for _ in range(64):
        for event in parser.feed(piece):
            assert isinstance(event, HttpData)
            total += len(event.data)
        assert parser.buffered == 0
    assert isinstance(parser.feed(encode_last_chunk())[-1], HttpEnd)
    assert total == 64 * 65536


def test_stream_take_rest_after_upgrade() -> None:
    frames = ClientFrameEncoder(b"s" * 32).binary_batch([b"early"])
    parser = HttpStreamParser()
    head, end = parser.feed(UPGRADE + frames)
    assert isinstance(head, HttpRequest)
    assert head.is_websocket_upgrade
    assert isinstance(end, HttpEnd)
    assert parser.take_rest() == frames
    assert parser.buffered == 0


def test_with_body_keeps_the_head() -> None:
    (head, _) = HttpStreamParser().feed(b"GET /x?y HTTP/1.1\r\nA: b\r\n\r\n")
    assert isinstance(head, HttpRequest)
    whole = head.with_body(b"gathered")
    assert (whole.path, whole.query, whole.headers, whole.body) == (
        "/x",
        "y",
        [("a", b"b")],
        b"gathered",
    )
    assert head.body == b""


def test_expect_continue_is_ignored_on_http_1_0() -> None:
    data = b"PUT / HTTP/1.%d\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n"
    assert parse(data % 1 + b"x").expect_continue
    assert not parse(data % 0 + b"x").expect_continue


# ---- websocket handshake ----


def test_websocket_accept_rfc6455_example() -> None:
    assert websocket_accept("dGhlIHNhbXBsZSBub25jZQ==") == RFC6455_ACCEPT
    assert websocket_accept(b"dGhlIHNhbXBsZSBub25jZQ==") == RFC6455_ACCEPT
    with pytest.raises(TypeError):
        websocket_accept(123)  # type: ignore[arg-type]


def test_validate_websocket_upgrade_returns_accept() -> None:
    assert validate_websocket_upgrade(parse(UPGRADE)) == RFC6455_ACCEPT


@pytest.mark.parametrize(
    ("old", "new", "status"),
    [
        (b"Sec-WebSocket-Version: 13", b"Sec-WebSocket-Version: 8", 426),
        (b"Sec-WebSocket-Version: 13\r\n", b"", 426),
        (b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b"", 400),
        (b"dGhlIHNhbXBsZSBub25jZQ==", b"c2hvcnQ=", 400),
        (b"dGhlIHNhbXBsZSBub25jZQ==", b"not base64 at all!!!!!!!", 400),
        (b"HTTP/1.1", b"HTTP/1.0", 400),
        (b"Upgrade: websocket\r\n", b"", 400),
        (b"GET", b"PUT", 400),
    ],
)
def test_validate_websocket_upgrade_rejections(old: bytes, new: bytes, status: int) -> None:
    request = parse(UPGRADE.replace(old, new, 1))
    with pytest.raises(HttpParseError) as info:
        validate_websocket_upgrade(request)
    assert info.value.args[1] == status


# ---- encoders ----


def test_encode_response_golden_bytes() -> None:
    assert encode_response(200, [("Content-Type", "text/plain")], b"hi") == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nhi"
    )
    assert encode_response(404, []) == b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
    assert encode_response(431, [], close=True) == (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    assert encode_response(204, []) == b"HTTP/1.1 204 No Content\r\n\r\n"


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (200, [("X", "a\r\nInjected: yes")], b""),
        (200, [("Bad Name", "v")], b""),
        (200, [("Content-Length", "9")], b""),
        (204, [], b"body"),
        (42, [], b""),
    ],
)
def test_encode_response_rejects_bad_arguments(
    status: int, headers: list[tuple[str, str]], body: bytes
) -> None:
    with pytest.raises(ValueError, match=r"."):
        encode_response(status, headers, body)


def test_encode_response_head_golden_bytes() -> None:
    headers = [("Content-Type", "application/octet-stream")]
    assert encode_response_head(200, headers, chunked=True) == (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    assert encode_response_head(200, [], content_length=12, close=True) == (
        b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\n"
    )
    assert encode_response_head(100, []) == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert encode_response_head(204, []) == b"HTTP/1.1 204 No Content\r\n\r\n"
    assert encode_response_head(200, [], close=True) == (
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("status", "kwargs"),
    [
        (200, {}),
        (200, {"content_length": 1, "chunked": True}),
        (204, {"content_length": 0}),
        (100, {"chunked": True}),
        (1000, {"chunked": True}),
    ],
)
def test_encode_response_head_rejects_bad_framing(status: int, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"."):
        encode_response_head(status, [], **kwargs)


def test_encode_chunks_golden_bytes_and_round_trip() -> None:
    assert encode_chunk(b"hello") == b"5\r\nhello\r\n"
    assert encode_chunk(b"x" * 255)[:4] == b"ff\r\n"
    assert encode_chunk(b"") == b""
    assert encode_last_chunk() == b"0\r\n\r\n"
    assert encode_last_chunk([("Digest", "x")]) == b"0\r\nDigest: x\r\n\r\n"
    with pytest.raises(ValueError, match="invalid"):
        encode_last_chunk([("X", "a\nb")])
    body = b"".join(encode_chunk(p) for p in [b"a", b"", b"bc" * 1000]) + encode_last_chunk()
    request = parse(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert request.body == b"a" + b"bc" * 1000


def test_encode_switching_protocols_golden_bytes() -> None:
    base = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + RFC6455_ACCEPT.encode() + b"\r\n"
    )
    assert encode_switching_protocols(RFC6455_ACCEPT) == base + b"\r\n"
    assert encode_switching_protocols(RFC6455_ACCEPT, [("X-Relay", "a")]) == (
        base + b"X-Relay: a\r\n\r\n"
    )


def test_encode_request_round_trips_through_the_parser() -> None:
    data = encode_request("POST", "/", [("Host", "relay")], b"envelope")
    assert data == b"POST / HTTP/1.1\r\nHost: relay\r\nContent-Length: 8\r\n\r\nenvelope"
    request = parse(data)
    assert (request.method, request.path, request.body) == ("POST", "/", b"envelope")
    assert encode_request("GET", "/health", []) == b"GET /health HTTP/1.1\r\n\r\n"
    with pytest.raises(ValueError, match="target"):
        encode_request("GET", "/a b", [])


def test_parse_response_head_is_incremental() -> None:
    head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nX-A: b\r\n\r\n"
    for cut in range(len(head)):
        assert parse_response_head(head[:cut]) is None
    assert parse_response_head(head + b"\x82\x00") == (
        101,
        [("upgrade", b"websocket"), ("x-a", b"b")],
        len(head),
    )


def test_parse_response_head_errors_are_502() -> None:
    with pytest.raises(HttpParseError) as info:
        parse_response_head(b"HTTP/1.1 abc\r\n\r\n")
    assert info.value.args[1] == 502
    with pytest.raises(HttpParseError, match="too large"):
        parse_response_head(b"HTTP/1.1 200 OK\r\nX: " + b"x" * 70000)
