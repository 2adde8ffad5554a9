"""A 신경 test client over a real websocket (the `websockets` library), in any encoding."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import websockets
from websockets.asyncio.client import ClientConnection

from rmb_relay.dialects.singyeong import etf

WAIT = 10.0


def encode(encoding: str, value: Any) -> bytes | str:
    if encoding == "json":
        return json.dumps(value)
    if encoding == "msgpack":
        return bytes(msgpack.packb(value))
    return etf.encode(value)


def decode(encoding: str, data: bytes | str) -> Any:
    if encoding == "json":
        assert isinstance(data, str), "json frames must be text"
        return json.loads(data)
    assert isinstance(data, bytes), f"{encoding} frames must be binary"
    if encoding == "msgpack":
        return msgpack.unpackb(data)
    return etf.decode(data)


class SgClient:
    def __init__(self, ws: ClientConnection, encoding: str) -> None:
        self.ws = ws
        self.encoding = encoding
        self.hello: dict[str, Any] = {}

    @classmethod
    async def connect(
        cls, host: str, port: int, encoding: str = "json", *, keepalive: bool = True
    ) -> SgClient:
        """`keepalive=False`: no websocket pings, so the client never gives a silent connection
        up on its own (the gateway's heartbeats, which the caller sends, still bound it)."""
        ws = await websockets.connect(
            f"ws://{host}:{port}/gateway/websocket?encoding={encoding}",
            max_size=None,
            ping_interval=20 if keepalive else None,
        )
        client = cls(ws, encoding)
        client.hello = await client.recv()
        assert client.hello["op"] == 0, client.hello
        return client

    async def send(self, op: int, d: Any = None, t: str | None = None) -> None:
        frame: dict[str, Any] = {"op": op, "d": d}
        if t is not None:
            frame["t"] = t
        await self.ws.send(encode(self.encoding, frame))

    async def dispatch(self, t: str, d: Any) -> None:
        await self.send(4, d, t)

    async def recv(self, timeout: float = WAIT) -> Any:
        data = await asyncio.wait_for(self.ws.recv(), timeout)
        return decode(self.encoding, data)

    async def expect(self, op: int, t: str | None = None) -> Any:
        frame = await self.recv()
        assert frame["op"] == op, frame
        if t is not None:
            assert frame["t"] == t, frame
        return frame

    async def identify(self, client_id: str, app_id: str = "app", **extra: Any) -> dict[str, Any]:
        await self.send(1, {"client_id": client_id, "application_id": app_id, **extra})
        frame: dict[str, Any] = await self.expect(2)
        return frame

    async def update(self, **values: tuple[str, Any]) -> None:
        await self.dispatch(
            "UPDATE_METADATA", {k: {"type": kind, "value": v} for k, (kind, v) in values.items()}
        )

    async def closed(self) -> int | None:
        """Wait for the server to close; the close code."""
        try:
            while True:
                await asyncio.wait_for(self.ws.recv(), WAIT)
        except websockets.ConnectionClosed as closed:
            return closed.rcvd.code if closed.rcvd is not None else None

    async def close(self) -> None:
        await self.ws.close()
