"""The listener's connection caps over real sockets (issue 9, "connection caps"): a client IP
over its cap is answered 429 at once; over the global cap a few more connections still get
/health and /metrics (what a load balancer and Prometheus need), then everyone gets 503 at
once instead of the relay running out of file descriptors and `/health` hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rmb_relay.config import ListenerConfig
from rmb_relay.errors import ConfigError
from rmb_relay.server.limits import OPS_RESERVE
from tests.conftest import WAIT, StartRelay
from tests.dialects import EchoDialect
from tests.helpers import eventually, http_exchange
from tests.scrape import scrape

Socket = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest.fixture
async def sockets() -> AsyncIterator[list[Socket]]:
    opened: list[Socket] = []
    yield opened
    for _, writer in opened:
        writer.close()


async def idle(host: str, port: int, opened: list[Socket]) -> Socket:
    pair = await asyncio.open_connection(host, port)
    opened.append(pair)
    return pair


async def answered_at_once(host: str, port: int) -> bytes:
    """What the relay sends a connection that sends nothing, until it closes it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        return await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n".encode()


async def test_an_ip_over_its_cap_is_answered_429_at_once(
    start_relay: StartRelay, sockets: list[Socket]
) -> None:
    server = await start_relay([EchoDialect()], max_connections_per_ip=3)
    host, port = server.addresses[0]
    for _ in range(3):
        await idle(host, port, sockets)
    await eventually(lambda: server.limits.total == 3)
    reply = await answered_at_once(host, port)
    assert reply.startswith(b"HTTP/1.1 429 ")
    assert reply.endswith(b"too many connections from this address")
    _, writer = sockets.pop()
    writer.close()
    await eventually(lambda: server.limits.total == 2)
    assert (await http_exchange(host, port, get("/health"))).startswith(b"HTTP/1.1 200 ")
    assert server.limits.refused["per-ip limit"] == 1


async def test_over_the_cap_health_and_metrics_are_still_served_then_503(
    start_relay: StartRelay, sockets: list[Socket]
) -> None:
    server = await start_relay([EchoDialect()], max_connections=2)
    host, port = server.addresses[0]
    for _ in range(2):
        await idle(host, port, sockets)
    await eventually(lambda: server.limits.total == 2)
    # the reserved slots: operations only
    assert (await http_exchange(host, port, get("/health"))).startswith(b"HTTP/1.1 200 ")
    page = await scrape(host, port)
    assert page.status == 200
    refused = await http_exchange(host, port, get("/echo"))
    assert refused.startswith(b"HTTP/1.1 503 ")
    assert refused.endswith(b"only /health and /metrics are served")
    # fill the reserve: the next connection is refused without being read
    for _ in range(OPS_RESERVE):
        await idle(host, port, sockets)
    await eventually(lambda: server.limits.total == 2 + OPS_RESERVE)
    reply = await answered_at_once(host, port)
    assert reply.startswith(b"HTTP/1.1 503 ")
    assert reply.endswith(b"connection limit reached: try again later")
    for _, writer in sockets:
        writer.close()
    await eventually(lambda: server.limits.total == 0)
    page_after = await scrape(host, port)
    assert page_after.value("rmb_relay_connections_refused_total", reason="limit") == 1
    # served normally again: a plain GET of a websocket path is the router's 404
    assert (await http_exchange(host, port, get("/echo"))).startswith(b"HTTP/1.1 404 ")


def test_caps_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max-connections"):
        ListenerConfig(max_connections=0)
    with pytest.raises(ConfigError, match="max-connections"):
        ListenerConfig(max_connections_per_ip=0)
