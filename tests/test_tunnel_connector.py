"""The connector's one request path (dialects/tunnel/connector.py over its Rust core,
rust/dialects/tunnel/connector.rs, and the response parser of rust/codec/http.rs): answers the
same whether a request ran in a task (a new target connection) or from a kept-alive
connection's read, malformed answers as clear 502s with the connector still serving, the
core's decisions (expired work, unknown targets, what a target is given) and its `Deliver`
bytes equal to the wire codec's, and targets of a user's own."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from rmb_relay._core import (
    HttpResponseError,
    HttpResponseParser,
    TunnelConnectorCore,
    TunnelRequest,
    WsDecoder,
    WsMessage,
)
from rmb_relay.dialects.tunnel.targets import Body, Reply, Target, WebTarget
from rmb_relay.dialects.tunnel.wire import (
    AcknowledgeRequest,
    ClientRequest,
    TargetResponse,
    decode,
    encode,
)
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


async def _fetch_all(start_tunnel: StartTunnel, binary: bool) -> list[dict[str, Answer]]:
    """Every answer twice: first each on a new target connection (a task), then on the
    connection kept alive (from its read, no task)."""
    async with AsyncExitStack() as stack:
        url = await raw_target(stack)
        tunnel = await start_tunnel()
        connector = await tunnel.connect(targets={"raw": WebTarget(url, 10.0)}, binary=binary)
        rounds: list[dict[str, Answer]] = []
        async with tunnel.client() as client:
            for _ in (1, 2):
                seen: dict[str, Answer] = {}
                for path in ANSWERS:
                    reply = await client.get(f"/relay/acme/raw{path}")
                    seen[path] = _seen(
                        reply.status_code, list(reply.headers.multi_items()), reply.content
                    )
                rounds.append(seen)
        assert connector.answers_without_task > 0
        return rounds


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
async def test_a_task_and_a_kept_alive_read_answer_the_same(
    start_tunnel: StartTunnel, binary: bool
) -> None:
    first, second = await _fetch_all(start_tunnel, binary)
    assert first == second
    status, headers, body = second["/repeated"]
    assert (status, body) == (200, b"ok")
    assert [v for k, v in headers if k == "set-cookie"] == ["a=1", "b=2"]
    assert second["/chunked"][2] == b"hello world"
    assert second["/empty"][::2] == (200, b"")
    assert second["/nocontent"][::2] == (204, b"")
    assert ("x-name", "café") in second["/latin1"][1]
    assert second["/missing"][::2] == (404, b"nope")
    assert second["/interim"][::2] == (200, b"yes")
    for size in (LIMIT - 1, LIMIT, LIMIT + 1):
        assert second[f"/size/{size}"][::2] == (200, pattern(size))


async def test_a_head_answered_with_a_body_keeps_its_answer(start_tunnel: StartTunnel) -> None:
    """Bytes past a complete answer (here the body of a HEAD answer, as some servers send)
    leave the answer standing and the connection dropped, not a 502."""
    async with AsyncExitStack() as stack:
        url = await raw_target(stack)
        tunnel = await start_tunnel()
        await tunnel.connect(targets={"raw": WebTarget(url, 10.0)}, binary=True)
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
        assert connector.answers_without_task >= 2


class Custom(Target):
    """A target of a user's own: answers a stream, fails on purpose, or is slow."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, list[tuple[str, str]], bytes]] = []

    async def call(
        self, method: str, url: str, headers: list[tuple[str, str]], body: Body, length: int
    ) -> Reply:
        data = body if isinstance(body, bytes) else b"".join([c async for c in body])
        self.seen.append((method, url, headers, data))
        if url.startswith("fail"):
            raise ValueError("a bug in the target")
        if url.startswith("slow"):
            await asyncio.sleep(3600)

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield pattern(LIMIT)

        if url.startswith("stream"):
            return Reply(201, [("X-Custom", "1"), ("Content-Length", "99")], stream(), None)
        return Reply(200, [("Content-Type", "text/plain")], data[::-1], len(data))


async def test_a_target_of_a_users_own_takes_the_same_path(start_tunnel: StartTunnel) -> None:
    """Through `Target.call`: the request's fields less the hop's, the trace fields, bodies
    either way around the inline limit, and any exception a 502 (a slow one a 504)."""
    custom = Custom()
    tunnel = await start_tunnel()
    await tunnel.connect(targets={"mine": custom}, binary=True, target_timeout=0.3)
    async with tunnel.client() as client:
        reply = await client.post("/trace/acme/MINE/echo?x=1", content=b"abc")
        assert (reply.status_code, reply.content) == (200, b"cba")
        assert reply.headers["RelayServer-TargetDuration"]
        method, url, headers, body = custom.seen[-1]
        assert (method, url, body) == ("POST", "echo?x=1", b"abc")
        names = [name.lower() for name, _ in headers]
        assert "host" not in names
        assert "content-length" not in names
        assert names[-2:] == ["relayserver-requestid", "relayserver-requestoriginid"]
        big = pattern(3 * LIMIT)
        assert (await client.post("/relay/acme/mine/echo", content=big)).content == big[::-1]
        reply = await client.get("/relay/acme/mine/stream")
        assert (reply.status_code, reply.content) == (201, pattern(LIMIT) * 3)
        assert reply.headers["x-custom"] == "1"
        assert (await client.get("/relay/acme/mine/fail")).status_code == 502
        assert (await client.get("/relay/acme/mine/slow")).status_code == 504
        assert (await client.get("/relay/acme/mine/ok")).status_code == 200


async def test_a_web_target_through_its_call_as_https_takes_it(start_tunnel: StartTunnel) -> None:
    """A web target without the lean client (as an https one is) runs `WebTarget.call`."""
    tunnel = await start_tunnel()
    web = WebTarget(tunnel.target.url, 10.0)
    web._pool = None  # (what an https base gives)
    await tunnel.connect(targets={"web": web})
    async with tunnel.client() as client:
        reply = await client.post("/relay/acme/web/echo", content=b"hi")
        assert (reply.status_code, reply.content) == (200, b"hi")
        big = pattern(3 * LIMIT)
        assert (await client.post("/relay/acme/web/echo", content=big)).content == big


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


def _core(binary: bool) -> TunnelConnectorCore:
    return TunnelConnectorCore(
        binary,
        os.urandom(32),
        "http://relay",
        LIMIT,
        [("RAW", ("127.0.0.1:9", "/base")), ("$ECHO", None)],
    )


def _request(core: TunnelConnectorCore, binary: bool, **fields: object) -> TunnelRequest | None:
    message = ClientRequest("id", "origin", "raw", "acme", "POST", "x?y=1", **fields)  # type: ignore[arg-type]
    return core.request(encode(message, binary), 0)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    "answer",
    [ANSWERS["/repeated"], ANSWERS["/latin1"], ANSWERS["/empty"], ANSWERS["/missing"]],
)
def test_the_cores_deliver_is_the_wire_codecs(binary: bool, answer: bytes) -> None:
    core = _core(binary)
    request = _request(core, binary, body_content=b"hi", body_size=2)
    assert request is not None
    parser = HttpResponseParser()
    parser.start(False, LIMIT)
    assert core.respond(request, parser, answer, 0) is None
    delivered = _frames_payload(core.take_output())
    # the same answer read by the parser alone, as the wire codec's TargetResponse
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
        "id", "origin", status, fields, size, size, body or None, status >= 400
    )
    assert delivered == encode(expected, binary)


def test_what_a_target_is_given() -> None:
    core = _core(True)
    request = _request(
        core,
        True,
        http_headers={"Host": ["relay"], "A": ["1", "2"]},
        body_size=2,
        body_content=b"hi",
    )
    assert request is not None
    assert (request.refused, request.target, request.head, request.outsourced) == (
        None,
        0,
        False,
        False,
    )
    assert request.wire == (
        b"POST /base/x?y=1 HTTP/1.1\r\nHost: 127.0.0.1:9\r\nA: 1\r\nA: 2\r\n"
        b"Content-Length: 2\r\n\r\nhi"
    )
    message = ClientRequest(
        "id", "origin", "$echo", "acme", "PUT", "u", {"Host": ["h"], "B": ["2"]}
    )
    message.enable_tracing = True
    message.body_size, message.acknowledge_mode = 100_000, 0
    echo = core.request(encode(message, True), 0)
    assert echo is not None
    assert (echo.wire, echo.method, echo.url, echo.outsourced, echo.delete_body) == (
        None,
        "PUT",
        "u",
        True,
        True,
    )
    assert echo.headers == [
        ("B", "2"),
        ("RelayServer-RequestId", "id"),
        ("RelayServer-RequestOriginId", "origin"),
    ]
    assert not core.has_output


def test_what_the_core_decides_alone() -> None:
    """Expired work is dropped unanswered and unacknowledged, an unknown target answered 404
    (acknowledged in modes 1 and 2), a request that cannot be sent answered 502; a message
    that is no RequestTarget is left to Python."""
    core = _core(False)
    expired = _request(core, False, expires_in=0, acknowledge_mode=2)
    assert expired is not None
    assert expired.refused == "expired before it started"
    assert not core.has_output
    message = ClientRequest("id", "origin", "nope", "acme", "GET", "", acknowledge_mode=2)
    unknown = core.request(encode(message, False), 0)
    assert unknown is not None
    assert unknown.refused == "has no target 'nope' here".replace("'", '"')
    sent = WsDecoder(client_mode=False, max_message=1 << 20).feed(core.take_output())
    kinds = [
        decode(m.data, False, (TargetResponse, AcknowledgeRequest))
        for m in sent
        if isinstance(m, WsMessage)
    ]
    assert isinstance(kinds[0], TargetResponse)
    assert kinds[0].http_status_code == 404
    assert kinds[1] == AcknowledgeRequest("origin", "id", True)
    bad = _request(core, False, http_headers={"X": ["a\r\nInjected: 1"]})
    assert bad is not None
    assert (bad.refused or "").startswith("cannot be sent")
    assert core.has_output
    assert core.request(b"\xc1", 0) is None  # Python words why (wire.decode)
