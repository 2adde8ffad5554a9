"""Small test utilities: bounded waits, a hand-moved clock and a raw websocket client over a plain
socket."""

from __future__ import annotations

import asyncio
import base64
import inspect
import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

from aiohttp import web

from rmb_relay._core import (
    ClientFrameEncoder,
    WsDecoder,
    WsEvent,
    encode_request,
    parse_response_head,
)

WAIT = 10.0


class FakeClock:
    """Integer nanoseconds (`rmb_relay.clock`) the test moves by hand: by `advance(seconds)` or
    by setting `now`. Starts at 1,000 s unless told otherwise."""

    def __init__(self, now: int = 1_000_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1_000_000_000)


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout: float = WAIT
) -> None:
    """Wait until `predicate()` holds (it may be async), checking every few milliseconds;
    fail on timeout. For conditions no event announces (a metric, a Redis key, a buffer)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


class RawWebSocket:
    """A websocket client that can send anything, including frames a real client never would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = ClientFrameEncoder(os.urandom(32))
        self.decoder = WsDecoder(client_mode=True, max_message=64 << 20)
        self.events: list[WsEvent] = []

    @classmethod
    async def connect(
        cls, host: str, port: int, path: str, headers: list[tuple[str, str]] | None = None
    ) -> RawWebSocket:
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            encode_request(
                "GET",
                path,
                [
                    ("Host", f"{host}:{port}"),
                    ("Upgrade", "websocket"),
                    ("Connection", "Upgrade"),
                    ("Sec-WebSocket-Key", key),
                    ("Sec-WebSocket-Version", "13"),
                    *(headers or []),
                ],
            )
        )
        buffer = b""
        try:
            while True:
                chunk = await asyncio.wait_for(reader.read(65536), WAIT)
                if not chunk:
                    raise ConnectionError(f"closed during handshake: {buffer!r}")
                buffer += chunk
                head = parse_response_head(buffer)
                if head is not None:
                    break
            status, _, head_len = head
            if status != 101:
                raise ConnectionError(f"upgrade refused: {buffer!r}")
        except BaseException:
            writer.close()
            raise
        ws = cls(reader, writer)
        rest = buffer[head_len:]
        if rest:
            ws.events.extend(ws.decoder.feed(rest))
        return ws

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send_binary(self, payload: bytes) -> None:
        self.writer.write(self.encoder.binary(payload))

    async def next_event(self, timeout: float = WAIT) -> WsEvent:
        while not self.events:
            chunk = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not chunk:
                raise EOFError("connection closed")
            self.events.extend(self.decoder.feed(chunk))
        return self.events.pop(0)

    async def read_until_eof(self, timeout: float = WAIT) -> list[WsEvent]:
        """Every event until the server closes TCP."""
        while True:
            chunk = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not chunk:
                break
            self.events.extend(self.decoder.feed(chunk))
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.writer.close()


async def http_exchange(host: str, port: int, raw: bytes) -> bytes:
    """Send raw bytes, return everything the server sends until it closes."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(raw)
    data = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    return data


async def serve_app(stack: AsyncExitStack, app: web.Application) -> int:
    """Serve an aiohttp app (a test's HTTP target, key server, ...) on a free loopback port until
    `stack` closes; returns the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stack.push_async_callback(runner.cleanup)
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
