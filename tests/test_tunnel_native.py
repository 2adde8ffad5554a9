"""The connector's native per-request path (rust/tunnel_connector.rs, rust/http_response.rs,
rust/http_client.rs): the response parser against real target servers, malformed answers as
clear errors with the connector still serving, and the native and Python paths giving the
same results, end to end and byte for byte."""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack

import pytest

from rmb_relay._core import (
    HttpResponseError,
    HttpResponseParser,
    TunnelConnectorCore,
    WsDecoder,
    WsMessage,
)
from rmb_relay.dialects.tunnel.connector import Connector
from rmb_relay.dialects.tunnel.targets import WebTarget
from rmb_relay.dialects.tunnel.wire import ClientRequest, TargetResponse, encode
from tests.tunnel_fixtures import StartTunnel, pattern
from tests.tunnel_fixtures import start_tunnel as start_tunnel

pytestmark = pytest.mark.timeout(60)

LIMIT = 16 * 1024

#: canned answers of the raw target, by path; a malformed one closes the connection after it
ANSWERS: dict[str, bytes] = {
    "/repeated": b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-A: 1\r\nset-cookie: b=2\r\n"
    b"Content-Length: 2\r\n\r\nok",
    "/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
    "/empty": b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "/nocontent": b"HTTP/1.1 204 No Content\r\nX-B: 2\r\n\r\n",
    "/latin1": b"HTTP/1.1 200 OK\r\nX-Name: caf\xe9\r\nContent-Length: 1\r\n\r\nx",
    "/missing": b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 4\r\n\r\nnope",
    "/interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nyes",
}
for _size in (LIMIT - 1, LIMIT, LIMIT + 1):
    ANSWERS[f"/size/{_size}"] = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % _size + pattern(
        _size
    )
MALFORMED: dict[str, bytes] = {
    "/bad/status-line": b"NOT HTTP AT ALL\r\n\r\n",
    "/bad/content-length": b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n",
    "/bad/two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    "/bad/chunk-size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "/bad/cut-short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
}


async def raw_target(stack: AsyncExitStack) -> str:
    """A keep-alive HTTP/1.1 server answering `ANSWERS` (and `MALFORMED`, then closing)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                if path in MALFORMED:
                    writer.write(MALFORMED[path])
                    await writer.drain()
                    break
                writer.write(ANSWERS[path])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    stack.push_async_callback(server.wait_closed)
    stack.callback(server.close)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


Answer = tuple[int, list[tuple[str, str]], bytes]


def _seen(status: int, headers: list[tuple[str, str]], body: bytes) -> Answer:
    """What a client sees, less the relay's own fields (date, server)."""
    kept = [(k, v) for k, v in headers if k not in ("date", "server")]
    return status, kept, body


async def _fetch_all(start_tunnel: StartTunnel, native: bool, binary: bool) -> dict[str, Answer]:
    async with AsyncExitStack() as stack:
        url = await raw_target(stack)
        tunnel = await start_tunnel()
        connector = await tunnel.connect(
            targets={"raw": WebTarget(url, 10.0)}, binary=binary, native=native
        )
        seen: dict[str, Answer] = {}
        async with tunnel.client() as client:
            # twice each: the first may open the connection (the task path), the second
            # finds it idle (the task-less path: native or Python)
            for _ in (1, 2):
                for path in ANSWERS:
                    reply = await client.get(f"/relay/acme/raw{path}")
                    seen[path] = _seen(
                        reply.status_code, list(reply.headers.multi_items()), reply.content
                    )
        if native:
            assert connector.native_delivered > 0
        else:
            assert connector.native_delivered == 0
        return seen


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_native_and_python_paths_answer_the_same(
    start_tunnel: StartTunnel, binary: bool
) -> None:
    native = await _fetch_all(start_tunnel, True, binary)
    python = await _fetch_all(start_tunnel, False, binary)
    assert native == python
    status, headers, body = native["/repeated"]
    assert (status, body) == (200, b"ok")
    assert [v for k, v in headers if k == "set-cookie"] == ["a=1", "b=2"]
    assert native["/chunked"][2] == b"hello world"
    assert native["/empty"][::2] == (200, b"")
    assert native["/nocontent"][::2] == (204, b"")
    assert ("x-name", "café") in native["/latin1"][1]
    assert native["/missing"][::2] == (404, b"nope")
    assert native["/interim"][::2] == (200, b"yes")
    for size in (LIMIT - 1, LIMIT, LIMIT + 1):
        assert native[f"/size/{size}"][::2] == (200, pattern(size))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
async def test_a_head_answered_with_a_body_keeps_its_answer(
    start_tunnel: StartTunnel, native: bool
) -> None:
    """Bytes past a complete answer (here the body of a HEAD answer, as some servers send)
    leave the answer standing and the connection dropped, not a 502."""
    async with AsyncExitStack() as stack:
        url = await raw_target(stack)
        tunnel = await start_tunnel()
        await tunnel.connect(targets={"raw": WebTarget(url, 10.0)}, binary=True, native=native)
        async with tunnel.client() as client:
            for _ in range(3):  # warm, then on a kept-alive connection, then a fresh one
                reply = await client.head("/relay/acme/raw/size/16383")
                assert (reply.status_code, reply.content) == (200, b"")
                reply = await client.get("/relay/acme/raw/repeated")
                assert (reply.status_code, reply.content) == (200, b"ok")


@pytest.mark.parametrize("path", sorted(MALFORMED))
async def test_a_malformed_answer_is_502_and_the_connector_keeps_serving(
    start_tunnel: StartTunnel, path: str
) -> None:
    async with AsyncExitStack() as stack:
        url = await raw_target(stack)
        tunnel = await start_tunnel()
        connector = await tunnel.connect(targets={"raw": WebTarget(url, 10.0)}, binary=True)
        async with tunnel.client() as client:
            assert (await client.get("/relay/acme/raw/empty")).status_code == 200  # warm
            assert (await client.get(f"/relay/acme/raw{path}")).status_code == 502
            for _ in range(3):
                reply = await client.get("/relay/acme/raw/repeated")
                assert (reply.status_code, reply.content) == (200, b"ok")
        assert connector.native_delivered >= 2


def test_parser_errors_are_http_response_errors_and_stay() -> None:
    parser = HttpResponseParser()
    parser.start(False, LIMIT)
    with pytest.raises(HttpResponseError, match="Content-Length"):
        parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")
    with pytest.raises(HttpResponseError):
        parser.feed(b"")
    idle = HttpResponseParser()
    with pytest.raises(HttpResponseError, match="without a request"):
        idle.feed(b"HTTP/1.1 200 OK\r\n\r\n")


def test_parser_events_for_whole_streamed_and_close_delimited_answers() -> None:
    parser = HttpResponseParser()
    parser.start(False, 4)
    assert parser.feed(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 3\r\n\r\nabc") == [
        (200, [("x-a", "1"), ("x-a", "2"), ("content-length", "3")], b"abc")
    ]
    assert parser.idle
    assert parser.keep_alive
    parser.start(False, 4)
    assert parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab") == [
        (200, [("content-length", "5")], None),
        b"ab",
    ]
    assert parser.feed(b"cde") == [b"cde", None]
    parser.start(False, 4)
    assert parser.feed(b"HTTP/1.0 200 OK\r\n\r\nto the end") == [(200, [], None), b"to the end"]
    assert parser.feed_eof() is True
    assert not parser.keep_alive


def _frames_payload(frames: bytes) -> bytes:
    """The one message in client-masked frames, as the relay reads it."""
    events = WsDecoder(client_mode=False, max_message=1 << 20).feed(frames)
    assert len(events) == 1
    assert isinstance(events[0], WsMessage)
    return events[0].data


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    "answer",
    [ANSWERS["/repeated"], ANSWERS["/latin1"], ANSWERS["/empty"], ANSWERS["/missing"]],
)
def test_native_deliver_bytes_equal_the_python_encoders(binary: bool, answer: bytes) -> None:
    core = TunnelConnectorCore(binary, os.urandom(32), [("RAW", "h", "")])
    parser = HttpResponseParser()
    parser.start(False, LIMIT)
    assert core.respond(parser, answer, "req-1", "origin-1") is None
    native = _frames_payload(core.take_output())
    # the Python path's Deliver for the same answer (Connector._deliver_small's fields)
    reference = HttpResponseParser()
    reference.start(False, LIMIT)
    [head] = reference.feed(answer)
    assert isinstance(head, tuple)
    status, headers, body = head
    assert body is not None
    fields: dict[str, list[str]] = {}
    for name, value in headers:
        if name not in ("content-length", "transfer-encoding"):
            fields.setdefault(name, []).append(value)
    size = len(body)
    expected = TargetResponse(
        "req-1", "origin-1", status, fields, size, size, body or None, status >= 400
    )
    assert native == encode(expected, binary)


def test_only_the_common_request_takes_the_native_path() -> None:
    core = TunnelConnectorCore(True, os.urandom(32), [("RAW", "127.0.0.1:9", "/base")])

    def message(**fields: object) -> bytes:
        request = ClientRequest("id", "origin", "raw", "acme", "POST", "x?y=1", **fields)  # type: ignore[arg-type]
        return encode(request, True)

    started = core.request(
        message(http_headers={"Host": ["relay"], "A": ["1", "2"]}, body_size=2, body_content=b"hi")
    )
    assert started == (
        0,
        b"POST /base/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\nA: 1\r\nA: 2\r\n"
        b"Content-Length: 2\r\n\r\nhi",
        "id",
        "origin",
        False,
    )
    for uncommon in (
        {"acknowledge_mode": 3},  # manual: the acknowledge URL header is the Python path's
        {"enable_tracing": True},
        {"discard_connector_response": True},
        {"expires_in": 0},
        {"body_size": 100_000},  # outsourced: no inline body
        {"http_headers": {"X": ["a\r\nInjected: 1"]}},
    ):
        assert core.request(message(**uncommon)) is None, uncommon
    assert core.request(b"\xc1") is None  # not msgpack: the Python path words the error


async def test_native_is_the_default() -> None:
    connector = Connector("http://127.0.0.1:1", "acme", "s", {})
    assert connector.native
