"""The fault lab's TCP proxy (tests/faultlab/proxy.py) on its own: the bandwidth cap's schedule
on a given clock, and bytes crossing a capped link intact and in order."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import WAIT
from tests.faultlab.proxy import FaultProxy, Wire


def test_a_capped_wire_serialises_chunks_of_every_connection() -> None:
    wire = Wire(1000.0)  # bytes a second
    assert wire.crossed(500, at=10.0) == 10.5
    # ready while the first still crosses: it waits its turn
    assert wire.crossed(1000, at=10.2) == 11.5
    # ready after the link went idle: only its own time
    assert wire.crossed(100, at=20.0) == pytest.approx(20.1)
    assert Wire().crossed(1 << 30, at=3.0) == 3.0  # no cap


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_bytes_cross_a_capped_link_intact_and_in_order() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[:2]
    proxy = await FaultProxy.start("127.0.0.1", target)
    proxy.bandwidth(1 << 20)
    payload = bytes(range(256)) * 1024  # 256 KiB
    try:
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(payload)
        writer.write_eof()
        echoed = await asyncio.wait_for(reader.read(-1), WAIT)
        writer.close()
        assert echoed == payload
    finally:
        await proxy.close()
        server.close()
