"""Hostile connections against a real relay process (issue 33, "every connection pays for what
it causes"): a client that asks for answers and never reads them stops being read once its own
output is over the write high-water mark, so the relay's memory stays bounded; it is served
again once it reads, and loses nothing; honest clients in parallel are served all along; the
relay logs no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.conftest import WAIT
from tests.helpers import RawWebSocket, eventually, http_exchange
from tests.relay_process import RelayProcess
from tests.sbd_client import SbdClient
from tests.scrape import scrape

#: relay RSS growth allowed while a client does not read: the 1 MiB write high-water mark,
#: one read of its requests in the parser, the kernel's socket buffers are not ours, plus
#: the allocator's slack
RSS_GROWTH_MIB = 24
#: requests the greedy client pipelines: answered all, their /metrics pages are ~100 MiB that
#: an unbounded relay would have queued in memory
PIPELINED = 4000
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: relay\r\n\r\n"
STATUS_LINE = b"HTTP/1.1 200 OK\r\n"


@pytest.fixture
def relay() -> Iterator[RelayProcess]:
    process = RelayProcess("--sbd-disable-rate-limit")
    try:
        yield process
    finally:
        process.close()


async def _greedy_connection(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a small receive buffer, so the relay's output backs up at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock, limit=1 << 20)


async def _reply_pauses(relay: RelayProcess, dialect: str) -> bool:
    """Whether the relay has stopped reading a connection of `dialect` for its own output."""
    page = await scrape(*relay.address)
    try:
        return page.value("rmb_relay_reply_backpressure_pauses_total", dialect=dialect) > 0
    except KeyError:
        return False


async def _count(reader: asyncio.StreamReader, marker: bytes, wanted: int) -> int:
    """Read until `marker` has been seen `wanted` times (a marker split across reads counts)."""
    seen, tail = 0, b""
    while seen < wanted:
        chunk = await asyncio.wait_for(reader.read(1 << 20), WAIT)
        if not chunk:
            break
        data = tail + chunk
        seen += data.count(marker)
        tail = data[-(len(marker) - 1) :]
        seen -= tail.count(marker)  # (a tail shorter than the marker holds none)
    return seen


@contextlib.asynccontextmanager
async def honest_health(relay: RelayProcess) -> AsyncIterator[None]:
    """`/health` asked in a loop while the block runs: every answer must be 200."""
    stop = asyncio.Event()

    async def ask() -> list[bytes]:
        answers = []
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        while not stop.is_set():
            answers.append(await http_exchange(*relay.address, request))
        return answers

    task = asyncio.ensure_future(ask())
    try:
        yield
    finally:
        stop.set()
        answers = await asyncio.wait_for(task, WAIT)
    assert answers
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)


async def test_pipelined_requests_never_read_stop_being_read(relay: RelayProcess) -> None:
    async with honest_health(relay):
        await _pipeline_and_never_read(relay)
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def _pipeline_and_never_read(relay: RelayProcess) -> None:
    rss_before = relay.rss_mib()
    reader, writer = await _greedy_connection(*relay.address)
    writer.write(REQUEST * PIPELINED)
    await eventually(lambda: _reply_pauses(relay, "http"), timeout=WAIT)

    async def answered() -> float:
        page = await scrape(*relay.address)
        return page.value("rmb_relay_http_requests_total", method="GET", status="200")

    # the relay stays paused: what it has answered so far fits its high-water mark
    assert await answered() < PIPELINED / 2
    assert relay.rss_mib() - rss_before < RSS_GROWTH_MIB
    # once the client reads, every request is answered, in order
    assert await _count(reader, STATUS_LINE, PIPELINED) == PIPELINED
    writer.close()


async def test_pings_never_read_stop_the_websocket_being_read(relay: RelayProcess) -> None:
    async with honest_health(relay):
        await _ping_and_never_read(relay)
    assert relay.stop() == 0
    assert not relay.problems, relay.problems


async def _ping_and_never_read(relay: RelayProcess) -> None:
    greedy = await SbdClient.connect(*relay.address)
    ws: RawWebSocket = greedy.ws
    a = await SbdClient.connect(*relay.address)
    b = await SbdClient.connect(*relay.address)
    rss_before = relay.rss_mib()
    ping = ws.encoder.ping(b"p" * 125)
    sent = 100_000  # 12.7 MB of pongs: more than the kernel buffers between us
    ws.send_raw(ping * sent)
    await eventually(lambda: _reply_pauses(relay, "sbd"), timeout=WAIT)
    assert relay.rss_mib() - rss_before < RSS_GROWTH_MIB
    # honest SBD clients still forward to each other meanwhile
    a.ws.send_binary(b.pubkey + b"hello")
    assert await b.next_message() == a.pubkey + b"hello"
    # the greedy one reads: every ping was answered
    pong_frame = b"\x8a\x7d" + b"p" * 125
    assert await _count(ws.reader, pong_frame, sent) == sent
    for client in (greedy, a, b):
        client.ws.close()
