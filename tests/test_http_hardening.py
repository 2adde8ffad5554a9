"""The smaller HTTP items of issue 9 over real sockets: Host rules (RFC 9112 section 3.2), a
426 that names the websocket version (RFC 6455 section 4.4) and heads that can never complete
answered with 400 at once instead of at the idle timeout."""

from __future__ import annotations

import asyncio

import pytest

from rmb_relay.dialects.sbd import SbdDialect, SbdSettings
from rmb_relay.telemetry.metrics import Registry
from tests.conftest import WAIT, StartRelay
from tests.dialects import EchoDialect
from tests.helpers import http_exchange

#: far above every wait of these tests: an answer that comes is not the idle timer's
IDLE = 300.0


async def exchange(start_relay: StartRelay, raw: bytes) -> bytes:
    server = await start_relay([EchoDialect()], http_idle_timeout=IDLE)
    host, port = server.addresses[0]
    return await http_exchange(host, port, raw)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", b"missing Host header"),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"duplicate Host header"),
        (b"GET /health HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n", b"duplicate Host header"),
    ],
)
async def test_host_must_appear_exactly_once(
    start_relay: StartRelay, raw: bytes, reason: bytes
) -> None:
    reply = await exchange(start_relay, raw)
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert reply.endswith(b"\r\n\r\n" + reason)


async def test_http_1_0_may_leave_host_out(start_relay: StartRelay) -> None:
    reply = await exchange(start_relay, b"GET /health HTTP/1.0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ")


async def test_426_names_the_websocket_version_we_speak(start_relay: StartRelay) -> None:
    reply = await exchange(
        start_relay,
        b"GET /echo HTTP/1.1\r\nHost: relay\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 8\r\n\r\n",
    )
    head = reply.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0].startswith(b"HTTP/1.1 426 ")
    assert b"Sec-WebSocket-Version: 13" in head


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\r" * 64, b"bare CR in request head"),
        (b"\0" * 64, b"NUL in request head"),
        (b"GET /health HTTP/1.1\r\nHost: x\0", b"NUL in request head"),
        (b"\x16\x03\x01\x02\x05\x01", b"malformed request line"),  # TLS to a plain port
    ],
)
async def test_head_that_can_never_complete_is_400_at_once(
    start_relay: StartRelay, raw: bytes, reason: bytes
) -> None:
    """Before: the relay waited for the end of the head until the idle timeout (30 s)."""
    reply = await exchange(start_relay, raw)
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert reply.endswith(reason)


async def half_closed_exchange(start_relay: StartRelay, raw: bytes) -> bytes:
    """Send, shut the sending side (`nc -N`), read until the relay closes."""
    registry = Registry()
    server = await start_relay(
        [SbdDialect(SbdSettings(), registry)], registry=registry, http_idle_timeout=IDLE
    )
    reader, writer = await asyncio.open_connection(*server.addresses[0])
    writer.write(raw)
    writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()


async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(
    start_relay: StartRelay,
) -> None:
    """As `nc -N` does; before, the relay closed at the EOF and the answer was lost."""
    reply = await half_closed_exchange(start_relay, b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 ")
    assert reply.endswith(b"ok\n")


async def test_a_body_cut_short_by_a_half_close_is_400_not_a_wait(
    start_relay: StartRelay,
) -> None:
    reply = await half_closed_exchange(
        start_relay, b"PUT /authenticate HTTP/1.1\r\nHost: relay\r\nContent-Length: 50\r\n\r\nab"
    )
    assert reply.startswith(b"HTTP/1.1 400 ")
