"""The thinnest tunnel a Python (uvloop) relay and connector can be: the floor under issue 13's
half-load goal for any design in which Python orchestrates the connections, as ours does.

    bench/tunnel.py --routes direct python-floor tunnel ...   # run beside the real tunnel

`bench.tunnel_floor` measures the kernel's floor (C threads doing only the system calls). This
one adds what no Python-orchestrated relay can avoid, and nothing else: the event loop's turn,
one Python callback per read, one `transport.write` per socket written in a turn. It parses no
HTTP, speaks no websocket, checks no token, keeps no table: the relay prefixes each client
read with an 8-byte header (length, client number) and sends the frames of one loop turn to
the connector in one write; the connector writes each frame's bytes, unchanged, to a
keep-alive connection of its own to the target (one per client number, so one request at a
time each, as the tunnel's idle pool gives), and frames the target's bytes back the same
way. Correct for any byte stream (a read may hold part of a request or several), and for
nothing but a benchmark: it trusts its peer completely.

If this pair's CPU per request and half-load p99 are already at the goal's limit, no
per-request work in Python can be trimmed enough to meet it; what the real tunnel spends above
this pair is the part our code could still win back.

    python -m bench.tunnel_python_floor relay --port P --link-port L   # prints `listening`
    python -m bench.tunnel_python_floor connector --link-port L --target-port T  # `connected`
"""

from __future__ import annotations

import argparse
import asyncio
import struct
from typing import cast

import uvloop

HEADER = struct.Struct("<II")  # payload length, client number


class _Batch:
    """Frames bound for one link, written once per loop turn (as the tunnel's relay does)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.link: asyncio.Transport | None = None
        self.frames: list[bytes] = []

    def add(self, number: int, data: bytes) -> None:
        if not self.frames:
            self.loop.call_soon(self.flush)
        self.frames.append(HEADER.pack(len(data), number))
        self.frames.append(data)

    def flush(self) -> None:
        assert self.link is not None
        self.link.write(b"".join(self.frames))
        self.frames.clear()


class _Frames:
    """Splits a link's byte stream into (client number, payload) frames."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[tuple[int, memoryview]]:
        buffer = self.buffer + data if self.buffer else data
        view = memoryview(buffer)
        frames = []
        at, end = 0, len(buffer)
        while end - at >= 8:
            length, number = HEADER.unpack_from(buffer, at)
            if end - at - 8 < length:
                break
            frames.append((number, view[at + 8 : at + 8 + length]))
            at += 8 + length
        self.buffer = buffer[at:]
        return frames


class _Link(asyncio.Protocol):
    """One end of the relay-connector link: frames in, each handed to `deliver`."""

    def __init__(self, batch: _Batch, deliver: dict[int, asyncio.Transport]) -> None:
        self.batch = batch
        self.deliver = deliver
        self.frames = _Frames()
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.batch.link = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        for number, payload in self.frames.feed(data):
            self.deliver[number].write(payload)


class _Leg(asyncio.Protocol):
    """A client connection (at the relay) or a target connection (at the connector): its bytes
    go to the link as frames of its number."""

    def __init__(self, batch: _Batch, number: int, legs: dict[int, asyncio.Transport]) -> None:
        self.batch, self.number, self.legs = batch, number, legs

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.legs[self.number] = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.batch.add(self.number, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.legs.pop(self.number, None)


async def relay(port: int, link_port: int) -> None:
    loop = asyncio.get_running_loop()
    batch, clients = _Batch(loop), dict[int, asyncio.Transport]()
    link = _Link(batch, clients)
    numbers = iter(range(1 << 31))
    link_server = await loop.create_server(lambda: link, "127.0.0.1", link_port)
    server = await loop.create_server(
        lambda: _Leg(batch, next(numbers), clients), "127.0.0.1", port
    )
    print("listening", flush=True)
    async with link_server, server:
        await server.serve_forever()


class _Targets(dict[int, asyncio.Transport]):
    """The connector's target connections by client number, opened on first use: a frame for
    a number not yet connected waits for its connection (only the first request of each)."""

    def __init__(self, batch: _Batch, port: int) -> None:
        super().__init__()
        self.batch, self.port = batch, port
        self.waiting: dict[int, list[bytes]] = {}

    def hold(self, number: int, payload: memoryview) -> None:
        """A frame for a number not connected yet: kept until its connection is open."""
        if number not in self.waiting:
            self.waiting[number] = []
            asyncio.get_running_loop().create_task(self._open(number))
        self.waiting[number].append(bytes(payload))

    async def _open(self, number: int) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(
            lambda: _Leg(self.batch, number, self), "127.0.0.1", self.port
        )
        for payload in self.waiting.pop(number):
            transport.write(payload)


class _ConnectorLink(_Link):
    def __init__(self, batch: _Batch, targets: _Targets) -> None:
        super().__init__(batch, targets)
        self.targets = targets

    def data_received(self, data: bytes) -> None:
        targets = self.targets
        for number, payload in self.frames.feed(data):
            transport = targets.get(number)
            if transport is not None:
                transport.write(payload)
            else:
                targets.hold(number, payload)


async def connector(link_port: int, target_port: int) -> None:
    loop = asyncio.get_running_loop()
    batch = _Batch(loop)
    link = _ConnectorLink(batch, _Targets(batch, target_port))
    await loop.create_connection(lambda: link, "127.0.0.1", link_port)
    await link.ready
    print("connected", flush=True)
    await loop.create_future()  # serve until killed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="role", required=True)
    relay_args = sub.add_parser("relay")
    relay_args.add_argument("--port", type=int, required=True)
    relay_args.add_argument("--link-port", type=int, required=True)
    connector_args = sub.add_parser("connector")
    connector_args.add_argument("--link-port", type=int, required=True)
    connector_args.add_argument("--target-port", type=int, required=True)
    args = parser.parse_args()
    if args.role == "relay":
        uvloop.run(relay(args.port, args.link_port))
    else:
        uvloop.run(connector(args.link_port, args.target_port))


if __name__ == "__main__":
    main()
