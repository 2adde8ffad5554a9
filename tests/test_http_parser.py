"""rmb_relay._core HTTP codec (rust/http.rs) through the Python binding: request parsing with
its limits and status codes, pipelining, the websocket handshake, and the encoders."""

from __future__ import annotations

import pytest

from rmb_relay._core import (
    ClientFrameEncoder,
    HttpParseError,
    HttpParser,
    HttpRequest,
    WsDecoder,
    WsMessage,
    encode_request,
    encode_response,
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


def parse(data: bytes, **limits: int) -> HttpRequest:
    request = HttpParser(**limits).feed(data)
    assert request is not None
    return request


def status_of(data: bytes, **limits: int) -> int:
    with pytest.raises(HttpParseError) as info:
        HttpParser(**limits).feed(data)
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
    parser = HttpParser()
    assert parser.feed(b"POST / HTTP/1.1\r\nContent-Le") is None
    assert parser.feed(b"ngth: 5\r\n\r\nab") is None
    assert parser.buffered == 2
    request = parser.feed(b"cde")
    assert request is not None
    assert request.body == b"abcde"
    assert parser.buffered == 0


def test_request_fed_byte_by_byte() -> None:
    parser = HttpParser()
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
    parser = HttpParser()
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


def test_body_over_limit_is_413_without_waiting_for_it() -> None:
    assert status_of(b"POST / HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n") == 413
    assert status_of(b"POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n", max_body=10) == 413
    assert parse(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n" + b"x" * 10, max_body=10)


def test_chunked_transfer_encoding_is_501() -> None:
    assert status_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") == 501


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
    parser = HttpParser()
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
    parser = HttpParser()
    request = parser.feed(UPGRADE + frames)
    assert request is not None
    assert request.is_websocket_upgrade
    rest = parser.take_rest()
    assert rest == frames
    assert parser.buffered == 0
    assert parser.take_rest() == b""
    events = WsDecoder().feed(rest)
    assert [ev.data for ev in events if isinstance(ev, WsMessage)] == [b"early", b"frames"]


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
    with pytest.raises(HttpParseError):
        parse_response_head(b"x" * 20000)
