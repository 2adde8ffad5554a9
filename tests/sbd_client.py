"""A small SBD client for tests, written on the Rust codec's client mode."""

from __future__ import annotations

import base64
import os

from rmb_relay._core import (
    SBD_COMMAND,
    SigningKey,
    WsClose,
    WsMessage,
    sbd_classify,
    sbd_encode_command,
)
from tests.helpers import RawWebSocket


def key_path(public_key: bytes) -> str:
    return "/" + base64.urlsafe_b64encode(public_key).rstrip(b"=").decode()


class SbdClient:
    def __init__(self, ws: RawWebSocket, key: SigningKey) -> None:
        self.ws = ws
        self.key = key
        self.pubkey = key.public_key
        self.lbrt: list[int] = []
        self.lidl: int | None = None
        self.trace: list[bytes] = []  # command tags in arrival order

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        key: SigningKey | None = None,
        headers: list[tuple[str, str]] | None = None,
        handshake: bool = True,
    ) -> SbdClient:
        key = key or SigningKey.ed25519(os.urandom(32))
        ws = await RawWebSocket.connect(host, port, key_path(key.public_key), headers)
        client = cls(ws, key)
        if handshake:
            await client.handshake()
        return client

    async def next_message(self) -> bytes:
        event = await self.ws.next_event()
        if isinstance(event, WsClose):
            raise EOFError(f"closed with {event.code}")
        assert isinstance(event, WsMessage)
        return event.data

    def _note(self, data: bytes) -> bytes | None:
        """Record a command; returns its tag (None for a forward)."""
        message = sbd_classify(data)
        if message.kind != SBD_COMMAND:
            return None
        self.trace.append(message.tag)
        if message.tag == b"lbrt":
            self.lbrt.append(int.from_bytes(message.payload, "big", signed=True))
        elif message.tag == b"lidl":
            self.lidl = int.from_bytes(message.payload, "big", signed=True)
        return message.tag

    async def handshake(self) -> None:
        while True:
            data = await self.next_message()
            tag = self._note(data)
            if tag is None:
                raise AssertionError("forward before srdy")
            if tag == b"areq":
                nonce = sbd_classify(data).payload
                self.send(sbd_encode_command(b"ares", self.key.sign(nonce)))
            elif tag == b"srdy":
                return

    def send(self, message: bytes) -> None:
        self.ws.send_binary(message)

    def forward(self, dest: bytes, payload: bytes) -> None:
        self.send(dest + payload)

    async def next_lbrt(self) -> int:
        """The next `lbrt` the server sends (forwards meanwhile are not expected)."""
        seen = len(self.lbrt)
        while len(self.lbrt) == seen:
            self._note(await self.next_message())
        return self.lbrt[seen]

    async def receive_forward(self) -> tuple[bytes, bytes]:
        """(sender key, payload) of the next forward; commands are recorded and skipped."""
        while True:
            data = await self.next_message()
            if self._note(data) is None:
                return data[:32], data[32:]

    async def dropped_without_close_frame(self) -> bool:
        """Read to EOF; True if the server closed TCP without sending a close frame."""
        try:
            events = await self.ws.read_until_eof()
        except ConnectionResetError:
            return True
        for event in events:
            if isinstance(event, WsMessage):
                self._note(event.data)
        return not any(isinstance(e, WsClose) for e in events)

    async def closed_by_server(self) -> int | None:
        """Read until the server's close frame, answer it, wait for EOF; returns the code."""
        while True:
            event = await self.ws.next_event()
            if isinstance(event, WsClose):
                self.ws.send_raw(self.ws.encoder.close(event.code or 1000))
                await self.ws.read_until_eof()
                return event.code
            if isinstance(event, WsMessage):
                self._note(event.data)

    def close(self) -> None:
        self.ws.close()
