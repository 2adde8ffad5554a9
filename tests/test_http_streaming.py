"""Streaming HTTP end to end on real sockets: request bodies read as they arrive (chunked or
by length) with bounded memory, streamed responses, HEAD, `Expect: 100-continue`, the idle
timer and the request deadline, and malformed chunked bodies.

The test-only routes are registered on the listener's router from this module (`Routes`
is the same interface a dialect's `add_routes` gets). The client side is plain asyncio streams
with a small pure-Python response reader (its own chunked decoder, not our Rust one).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import sys
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from rmb_relay._core import HttpRequest, encode_chunk, encode_last_chunk, parse_response_head
from rmb_relay.dialects.base import HttpClient, HttpResponse, RequestBody
from rmb_relay.errors import HttpReject
from rmb_relay.server.http import BODY_BUFFER_LIMIT, IncomingBody
from rmb_relay.server.listener import RelayServer
from tests.conftest import WAIT, StartRelay
from tests.helpers import eventually

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """This process's resident set size in bytes, now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


# ---- a client that reads responses the way a strict HTTP/1.1 client does ----


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    trailers: dict[str, str] = field(default_factory=dict)


_wires: list[Wire] = []


@pytest.fixture(autouse=True)
async def _close_wires(caplog: pytest.LogCaptureFixture) -> AsyncIterator[None]:
    yield
    while _wires:
        _wires.pop().close()
    # a callback of the relay's Protocol that raised is logged by the loop, not seen by a test
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


class Wire:
    """One client connection: send raw bytes, read whole responses (or just heads). Every
    wire is closed after its test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, server: RelayServer) -> Wire:
        host, port = server.addresses[0]
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        wire = cls(reader, writer)
        _wires.append(wire)
        return wire

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def head(self) -> Reply:
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT)
        parsed = parse_response_head(raw)
        assert parsed is not None
        status, headers, _ = parsed
        return Reply(status, {name: value.decode() for name, value in headers})

    async def reply(self, *, head_only: bool = False) -> Reply:
        reply = await self.head()
        if head_only or reply.status < 200 or reply.status in (204, 304):
            return reply
        if reply.headers.get("transfer-encoding") == "chunked":
            await asyncio.wait_for(self._chunked(reply), WAIT)
        elif "content-length" in reply.headers:
            length = int(reply.headers["content-length"])
            reply.body = await asyncio.wait_for(self.reader.readexactly(length), WAIT)
        else:  # delimited by the server closing the connection
            reply.body = await asyncio.wait_for(self.reader.read(), WAIT)
        return reply

    async def _chunked(self, reply: Reply) -> None:
        body = bytearray()
        while True:
            line = await self.reader.readuntil(b"\r\n")
            size = int(line.split(b";")[0], 16)
            if size == 0:
                break
            body += await self.reader.readexactly(size)
            assert await self.reader.readexactly(2) == b"\r\n"
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line[:-2].partition(b":")
            reply.trailers[name.decode().lower()] = value.strip().decode()
        reply.body = bytes(body)

    async def closed(self) -> bool:
        """True when the server closes the connection (with nothing more sent)."""
        return await asyncio.wait_for(self.reader.read(), WAIT) == b""

    def close(self) -> None:
        self.writer.close()


# ---- test-only routes ----


class Routes:
    """What the test routes saw, for the assertions."""

    def __init__(self) -> None:
        self.first_chunk = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.body: IncomingBody | None = None
        self.streamed: list[str] = []
        self.rss_peak = 0
        self.slow_delay = 0.0

    def register(self, server: RelayServer) -> None:
        router = server.router
        router.add_streaming("PUT", "/test/sink", self.sink)
        router.add_streaming("PUT", "/test/held", self.held)
        router.add_streaming("PUT", "/test/early", self.early)
        router.add("POST", "/test/whole", self.whole)
        router.add("GET", "/test/slow", self.slow)
        router.add("GET", "/test/stuck", self.stuck)
        router.add("GET", "/test/stream", self.stream)
        router.add("GET", "/test/sized", self.sized)
        router.add("GET", "/test/broken", self.broken)

    async def sink(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        """Reads the body as it arrives: byte count, CRC-32, trailers, RSS peak."""
        total = crc = pieces = 0
        async for chunk in body:
            if not pieces:
                self.first_chunk.set()
            pieces += 1
            total += len(chunk)
            crc = zlib.crc32(chunk, crc)
            if pieces % 16 == 0:
                self.rss_peak = max(self.rss_peak, rss())
        trailers = {name: value.decode() for name, value in body.trailers}
        answer = {"bytes": total, "crc32": crc, "trailers": trailers}
        return HttpResponse(200, json.dumps(answer).encode(), content_type="application/json")

    async def held(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        """Reads nothing until released, then all of it."""
        assert isinstance(body, IncomingBody)
        self.body = body
        await self.release.wait()
        return HttpResponse(200, str(len(await body.read(1 << 30))).encode())

    async def early(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        """Refuses without reading the body."""
        raise HttpReject(403, "not this one")

    async def whole(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return HttpResponse(200, b"got " + request.body)

    async def slow(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        await asyncio.sleep(self.slow_delay)  # the handler's work, slower than the idle timer
        return HttpResponse(200, b"done")

    async def stuck(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")

    async def _pieces(self) -> AsyncIterator[bytes]:
        try:
            for piece in (b"one ", b"", b"two ", b"three"):
                self.streamed.append(piece.decode())
                yield piece
        finally:
            self.streamed.append("closed")

    async def stream(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return HttpResponse(200, stream=self._pieces(), content_type="application/octet-stream")

    async def sized(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return HttpResponse(200, stream=self._pieces(), length=13)

    async def broken(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        async def pieces() -> AsyncIterator[bytes]:
            yield b"first"
            raise RuntimeError("backend went away")

        return HttpResponse(200, stream=pieces())


async def relay(start_relay: StartRelay, **config: float) -> tuple[RelayServer, Routes]:
    server = await start_relay(**config)
    routes = Routes()
    routes.register(server)
    return server, routes


def chunked_put(path: str, *extra: str) -> bytes:
    head = [f"PUT {path} HTTP/1.1", "Host: relay", "Transfer-Encoding: chunked", *extra, "", ""]
    return "\r\n".join(head).encode()


# ---- timers ----


async def test_keep_alive_client_is_served_well_past_the_idle_timeout(
    start_relay: StartRelay,
) -> None:
    server, _ = await relay(start_relay, http_idle_timeout=0.5)
    wire = await Wire.open(server)
    loop = asyncio.get_running_loop()
    start = loop.time()
    served = 0
    while loop.time() - start < 2.0:  # four idle timeouts on one connection
        wire.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
        reply = await wire.reply()
        assert (reply.status, reply.body) == (200, b"ok\n")
        served += 1
        await asyncio.sleep(0.2)  # pacing: requests come more often than the idle timeout
    assert served >= 8
    # at rest, the connection is closed by the idle timer, without a word
    assert await wire.closed()


async def test_partial_head_is_answered_408_by_the_idle_timer(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay, http_idle_timeout=0.3)
    wire = await Wire.open(server)
    wire.send(b"GET /health HTTP/1.1\r\nHost: relay\r\nHo")
    reply = await wire.reply()
    assert reply.status == 408
    assert await wire.closed()


async def test_handler_slower_than_the_idle_timeout_still_answers(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay, http_idle_timeout=0.3)
    routes.slow_delay = 0.9
    wire = await Wire.open(server)
    wire.send(b"GET /test/slow HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply()
    assert (reply.status, reply.body) == (200, b"done")
    wire.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")  # and the connection lives on
    assert (await wire.reply()).status == 200
    wire.close()


async def test_handler_past_the_request_deadline_gets_503(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay, http_request_timeout=0.3)
    wire = await Wire.open(server)
    wire.send(b"GET /test/stuck HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply()
    assert reply.status == 503
    assert reply.body == b"request not answered within 0.3 s"
    assert await wire.closed()
    await asyncio.wait_for(routes.cancelled.wait(), WAIT)


async def test_waiting_for_the_client_body_does_not_count_against_the_deadline(
    start_relay: StartRelay,
) -> None:
    server, _ = await relay(start_relay, http_request_timeout=0.4, http_idle_timeout=5.0)
    wire = await Wire.open(server)
    wire.send(chunked_put("/test/sink"))
    for _ in range(4):  # 1 s of upload, more than twice the deadline
        wire.send(encode_chunk(b"x" * 1000))
        await asyncio.sleep(0.25)  # pacing: a slow uploader
    wire.send(encode_last_chunk())
    reply = await wire.reply()
    assert reply.status == 200
    assert json.loads(reply.body)["bytes"] == 4000
    wire.close()


async def test_stalled_request_body_is_answered_408(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay, http_idle_timeout=0.3)
    wire = await Wire.open(server)
    wire.send(chunked_put("/test/sink") + encode_chunk(b"only this"))
    reply = await wire.reply()
    assert reply.status == 408
    assert reply.body == b"request body not received within 0.3 s"
    assert await wire.closed()


# ---- request bodies ----


async def test_chunked_upload_reaches_the_handler_before_it_ends(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(chunked_put("/test/sink") + encode_chunk(b"first;"))
    await asyncio.wait_for(routes.first_chunk.wait(), WAIT)  # the body is not over yet
    wire.send(encode_chunk(b"second;") + b"3;ext=ignored\r\nend\r\n")
    wire.send(encode_last_chunk([("Digest", "crc32")]))
    reply = await wire.reply()
    assert reply.status == 200
    assert json.loads(reply.body) == {
        "bytes": 16,
        "crc32": zlib.crc32(b"first;second;end"),
        "trailers": {"digest": "crc32"},
    }
    wire.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")  # keep-alive after a chunked body
    assert (await wire.reply()).status == 200
    wire.close()


async def test_whole_body_route_gets_a_chunked_body_whole(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    body = encode_chunk(b"fede") + encode_chunk(b"ration") + encode_last_chunk()
    wire.send(
        b"POST /test/whole HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    )
    reply = await wire.reply()
    assert (reply.status, reply.body) == (200, b"got federation")
    wire.close()


async def test_whole_body_over_max_message_is_413(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay, max_message=1024)
    wire = await Wire.open(server)
    body = encode_chunk(b"x" * 1000) + encode_chunk(b"y" * 100) + encode_last_chunk()
    wire.send(
        b"POST /test/whole HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    )
    reply = await wire.reply()
    assert (reply.status, reply.body) == (413, b"request body over 1024 bytes")
    assert await wire.closed()


async def test_pipelined_requests_with_bodies_are_answered_in_order(
    start_relay: StartRelay,
) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(
        chunked_put("/test/sink")
        + encode_chunk(b"abc")
        + encode_last_chunk()
        + b"POST /test/whole HTTP/1.1\r\nHost: relay\r\nContent-Length: 2\r\n\r\nhi"
        + b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n"
    )
    assert json.loads((await wire.reply()).body)["bytes"] == 3
    assert (await wire.reply()).body == b"got hi"
    assert (await wire.reply()).body == b"ok\n"
    wire.close()


async def test_unread_body_pauses_reading_at_the_buffer_limit(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay)
    wire = await Wire.open(server)
    total = 16 << 20
    wire.send(b"PUT /test/held HTTP/1.1\r\nHost: relay\r\nContent-Length: %d\r\n\r\n" % total)
    block = b"z" * (1 << 20)
    for _ in range(16):
        wire.send(block)  # far more than the relay will buffer; the rest waits in sockets
    await eventually(lambda: routes.body is not None and routes.body.buffered > BODY_BUFFER_LIMIT)
    body = routes.body
    assert body is not None
    received = body.received
    # reading is paused: nothing more arrives while the handler does not read
    for _ in range(20):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # pacing: give the loop real time to (not) read more
    assert body.received == received
    assert body.buffered < BODY_BUFFER_LIMIT + (1 << 20)
    routes.release.set()
    reply = await wire.reply()
    assert (reply.status, reply.body) == (200, str(total).encode())
    wire.close()


# ---- Expect: 100-continue ----


async def test_expect_continue_is_answered_when_the_handler_reads(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay)
    for path in (b"/test/sink", b"/test/whole"):
        method = b"PUT" if path == b"/test/sink" else b"POST"
        wire = await Wire.open(server)
        wire.send(
            method
            + b" "
            + path
            + b" HTTP/1.1\r\nHost: relay\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        interim = await wire.head()
        assert interim.status == 100
        wire.send(b"hello")
        reply = await wire.reply()
        assert reply.status == 200
        wire.close()


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (
            b"PUT /nowhere HTTP/1.1\r\nHost: relay\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n",
            404,
        ),
        (
            b"GET /test/whole HTTP/1.1\r\nHost: relay\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n",
            405,
        ),
        (
            b"POST /test/whole HTTP/1.1\r\nHost: relay\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5000\r\n\r\n",
            413,
        ),
        (
            b"PUT /test/early HTTP/1.1\r\nHost: relay\r\nExpect: 100-continue\r\n"
            b"Content-Length: 5\r\n\r\n",
            403,
        ),
    ],
)
async def test_request_refused_before_its_body_gets_no_100(
    start_relay: StartRelay, request_head: bytes, status: int
) -> None:
    server, _ = await relay(start_relay, max_message=1024)
    wire = await Wire.open(server)
    wire.send(request_head)
    reply = await wire.reply()
    assert reply.status == status  # the final status first: no 100 Continue before it
    assert await wire.closed()


# ---- responses ----


async def test_head_gets_the_head_alone(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(b"HEAD /health HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply(head_only=True)
    assert (reply.status, reply.headers["content-length"]) == (200, "3")
    wire.send(b"HEAD /test/stream HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply(head_only=True)
    assert (reply.status, reply.headers["transfer-encoding"]) == (200, "chunked")
    assert routes.streamed == []  # the stream was never started
    wire.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")  # no body bytes were left on the wire
    assert (await wire.reply()).body == b"ok\n"
    wire.close()


async def test_streamed_response_is_chunked_unless_its_length_is_known(
    start_relay: StartRelay,
) -> None:
    server, routes = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(b"GET /test/stream HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply()
    assert reply.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in reply.headers
    assert reply.body == b"one two three"
    assert routes.streamed[-1] == "closed"
    wire.send(b"GET /test/sized HTTP/1.1\r\nHost: relay\r\n\r\n")
    reply = await wire.reply()
    assert reply.headers["content-length"] == "13"
    assert "transfer-encoding" not in reply.headers
    assert reply.body == b"one two three"
    wire.close()


async def test_streamed_response_to_http_1_0_ends_with_the_connection(
    start_relay: StartRelay,
) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(b"GET /test/stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    reply = await wire.reply()
    assert "transfer-encoding" not in reply.headers  # a 1.0 client cannot read chunked
    assert reply.headers["connection"] == "close"
    assert reply.body == b"one two three"


async def test_stream_failing_midway_cuts_the_response(start_relay: StartRelay) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(b"GET /test/broken HTTP/1.1\r\nHost: relay\r\n\r\n")
    with pytest.raises(asyncio.IncompleteReadError):
        await wire.reply()  # no last chunk: the client knows the body is incomplete
    wire.close()


# ---- malformed bodies ----


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n",
        b"5\r\nhelloXX0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",
        b"3\r\nabc\r\n" + b"1;" + b"e" * 5000 + b"\r\n",
        b"0\r\nno colon here\r\n\r\n",
    ],
)
async def test_malformed_chunked_body_gets_400_and_the_relay_keeps_serving(
    start_relay: StartRelay, body: bytes
) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(chunked_put("/test/sink") + body)
    reply = await wire.reply()
    assert reply.status == 400
    assert await wire.closed()
    other = await Wire.open(server)
    other.send(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
    assert (await other.reply()).status == 200
    other.close()


@pytest.mark.parametrize(
    ("framing", "status"),
    [
        (b"Transfer-Encoding: chunked\r\nContent-Length: 3", 400),
        (b"Transfer-Encoding: gzip, chunked", 501),
        (b"Transfer-Encoding: gzip", 400),
    ],
)
async def test_refused_framing(start_relay: StartRelay, framing: bytes, status: int) -> None:
    server, _ = await relay(start_relay)
    wire = await Wire.open(server)
    wire.send(
        b"PUT /test/sink HTTP/1.1\r\nHost: relay\r\n" + framing + b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    assert (await wire.reply()).status == status
    assert await wire.closed()


# ---- the acceptance test: 1 GiB through bounded memory ----

#: the client, in its own process so it neither shares this process's memory nor its core
UPLOADER = r"""
import os, socket, sys, zlib
port, total, block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = os.urandom(block)
chunk = b"%x\r\n" % block + data + b"\r\n"
crc = 0
with socket.create_connection(("127.0.0.1", port)) as sock:
    sock.sendall(b"PUT /test/sink HTTP/1.1\r\nHost: relay\r\nTransfer-Encoding: chunked\r\n"
                 b"Connection: close\r\n\r\n")
    for _ in range(total // block):
        sock.sendall(chunk)
        crc = zlib.crc32(data, crc)
    sock.sendall(b"0\r\n\r\n")
    reply = b""
    while piece := sock.recv(65536):
        reply += piece
print(crc)
print(reply.decode())
"""


@pytest.mark.timeout(300)
async def test_one_gibibyte_chunked_upload_in_bounded_memory(start_relay: StartRelay) -> None:
    server, routes = await relay(start_relay)
    total, block = 1 << 30, 1 << 20
    gc.collect()
    baseline = rss()
    routes.rss_peak = baseline
    loop = asyncio.get_running_loop()
    started = loop.time()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        UPLOADER,
        str(server.addresses[0][1]),
        str(total),
        str(block),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 240)
    elapsed = loop.time() - started
    assert process.returncode == 0
    crc_line, reply = out.decode().split("\n", 1)
    assert reply.startswith("HTTP/1.1 200 ")
    answer = json.loads(reply.split("\r\n\r\n", 1)[1])
    assert answer["bytes"] == total
    assert answer["crc32"] == int(crc_line)
    growth = routes.rss_peak - baseline
    peak_rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"\n1 GiB chunked upload: {elapsed:.1f} s, {total / elapsed / 1e6:.0f} MB/s, "
        f"relay RSS growth {growth / 2**20:.1f} MiB (baseline {baseline / 2**20:.0f} MiB, "
        f"process peak {peak_rusage / 2**20:.0f} MiB)"
    )
    assert growth < 64 << 20
