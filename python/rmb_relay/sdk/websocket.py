"""A lean asyncio websocket client on the Rust codec (client mode, masked frames).

Used by the SDK (`rmb_relay.client`), the load harness and tests. Like the server side, every
read is one call into Rust, and a batch of outgoing messages is one `transport.write`.

Reads land in a buffer the protocol hands the event loop (`asyncio.BufferedProtocol`), one per
thread and shared by its connections: a read is decoded (the decoder keeps a copy of a partial
frame) before the loop reads again, so no `bytes` object is made and copied per read.

`last_received` and `last_sent` (monotonic nanoseconds from the `clock` given) let the owner of a
long-lived connection decide when to ping and when to give up on a silent one (`RelayLink`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from rmb_relay._core import (
    ClientFrameEncoder,
    HttpParseError,
    WsClose,
    WsDecoder,
    WsEvent,
    WsMessage,
    WsPing,
    WsViolation,
    encode_request,
    parse_response_head,
    websocket_accept,
)
from rmb_relay.clock import Clock, monotonic_clock
from rmb_relay.contract import CloseCode
from rmb_relay.errors import ConnectionClosed, HandshakeError

#: what a client waits for the upgrade by default
DEFAULT_CONNECT_TIMEOUT = 10.0


MessageCallback = Callable[[WsMessage], None]
#: `WebSocketClient.on_data`: (decoder, bytes read) -> the events left to the client; the
#: view is the thread's read buffer, valid only during the call
DataHook = Callable[[WsDecoder, memoryview], list[WsEvent]]

#: the most one read takes: 64 KiB measured cheaper per message than 256 KiB (uvloop's own
#: buffer; an SBD generator spent 0.1-0.15 us/msg more with it, most of it in the kernel's copy)
READ_BUFFER = 64 * 1024
_thread = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer: its event loop reads one connection at a time into it."""
    view: memoryview | None = getattr(_thread, "read_buffer", None)
    if view is None:
        view = _thread.read_buffer = memoryview(bytearray(READ_BUFFER))
    return view


class _ClientProtocol(asyncio.BufferedProtocol):
    def __init__(self, client: WebSocketClient, request: bytes, key: str) -> None:
        self.client = client
        self.request = request
        self.expected_accept = websocket_accept(key)
        self.buffer = b""
        self.upgraded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.decoder: WsDecoder | None = None
        self.read_buffer = _read_buffer()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client.transport = cast(asyncio.Transport, transport)  # uvloop: not a subclass
        self.client.transport.write(self.request)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        client = self.client
        client.last_received = client.clock()
        data = self.read_buffer[:nbytes]
        decoder = self.decoder
        if decoder is not None:
            on_data = client.on_data
            events = decoder.feed(data) if on_data is None else on_data(decoder, data)
            if events:
                client._on_events(events)
            return
        self.buffer += data
        try:
            head = parse_response_head(self.buffer)
        except HttpParseError as err:
            self._fail(HandshakeError(0, str(err.args[0]).encode()))
            return
        if head is None:
            return
        status, headers, head_len = head
        if status != 101:
            self._fail(HandshakeError(status, self.buffer[head_len:]))
            return
        accept = next((v for k, v in headers if k == "sec-websocket-accept"), b"")
        if accept.decode(errors="replace") != self.expected_accept:
            self._fail(HandshakeError(status, b"wrong Sec-WebSocket-Accept"))
            return
        self.decoder = WsDecoder(client_mode=True, max_message=self.client.max_message)
        rest, self.buffer = self.buffer[head_len:], b""
        if not self.upgraded.done():
            self.upgraded.set_result(None)
        if rest:
            self.client._on_events(self.decoder.feed(rest))

    def _fail(self, err: Exception) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(err)
        if self.client.transport is not None:
            self.client.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.upgraded.done():
            self.upgraded.set_exception(ConnectionError(f"connection lost during upgrade: {exc}"))
        self.client._on_lost()

    def pause_writing(self) -> None:
        self.client._writable.clear()

    def resume_writing(self) -> None:
        self.client._writable.set()


class WebSocketClient:
    """One client connection. Messages go to `on_message` if given, else to `recv()`."""

    def __init__(
        self,
        max_message: int,
        on_message: MessageCallback | None,
        clock: Clock = monotonic_clock,
    ) -> None:
        self.max_message = max_message
        self.on_message = on_message
        #: decodes each read instead of `WsDecoder.feed` when set, and returns the events it
        #: leaves to this client (the tunnel connector serves its common requests in the same
        #: Rust call that deframes them)
        self.on_data: DataHook | None = None
        self.clock = clock
        #: when anything (a message, a pong, a close) last arrived, and when we last wrote
        self.last_received = self.last_sent = clock()
        self.transport: asyncio.Transport | None = None
        self.encoder = ClientFrameEncoder(os.urandom(32))
        self._inbox: deque[WsMessage] = deque()
        self._inbox_ready = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.get_running_loop().create_future()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        headers: list[tuple[str, str]] | None = None,
        max_message: int = 64 << 20,
        on_message: MessageCallback | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        clock: Clock = monotonic_clock,
    ) -> WebSocketClient:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss"):
            raise ValueError(f"websocket URL must start with ws:// or wss://, got {url!r}")
        secure = parts.scheme == "wss"
        host = parts.hostname or "localhost"
        port = parts.port or (443 if secure else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        key = base64.b64encode(os.urandom(16)).decode()
        host_header = parts.netloc.rpartition("@")[2]
        request = encode_request(
            "GET",
            target,
            [
                ("Host", host_header),
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
                ("Sec-WebSocket-Key", key),
                ("Sec-WebSocket-Version", "13"),
                *(headers or []),
            ],
        )
        client = cls(max_message, on_message, clock)
        loop = asyncio.get_running_loop()
        if secure and ssl_context is None:
            ssl_context = ssl.create_default_context()
        async with asyncio.timeout(timeout):
            _, protocol = await loop.create_connection(
                lambda: _ClientProtocol(client, request, key),
                host,
                port,
                ssl=ssl_context if secure else None,
                server_hostname=host if secure else None,
            )
            await protocol.upgraded
        return client

    # ---- sending ---------------------------------------------------------------------------

    def send_binary(self, payload: bytes) -> None:
        self._write(self.encoder.binary(payload))

    def send_binaries(self, payloads: list[bytes]) -> None:
        """All payloads as binary frames in one write."""
        self._write(self.encoder.binary_batch(payloads))

    def send_frames(self, frames: bytes) -> None:
        """Frames encoded (and masked) by the caller, in one write: the tunnel connector's
        native path frames its messages in Rust together with their encoding."""
        self._write(frames)

    def send_text(self, text: str) -> None:
        self._write(self.encoder.text(text))

    def send_ping(self, data: bytes = b"") -> None:
        self._write(self.encoder.ping(data))

    def _write(self, frame: bytes) -> None:
        if self.closed.done() or self.transport is None or self.transport.is_closing():
            raise ConnectionClosed(self.close_code, self.close_reason or "connection closed")
        self.last_sent = self.clock()
        self.transport.write(frame)

    @property
    def is_open(self) -> bool:
        """Upgraded and not closing: a send now reaches the socket."""
        transport = self.transport
        return transport is not None and not transport.is_closing() and not self.closed.done()

    @property
    def congested(self) -> bool:
        """The socket's write buffer is over its high-water mark (`drain` would wait)."""
        return not self._writable.is_set()

    def abort(self) -> None:
        """Drop the connection at once (no close handshake): for a peer that went silent."""
        if self.transport is not None:
            self.transport.abort()

    async def drain(self) -> None:
        """Wait while the socket's write buffer is over its high-water mark."""
        await self._writable.wait()

    def keepalive(self, ping_after: int, dead_after: int) -> bool:
        """One keepalive step (nanoseconds, on this client's clock): drop the connection when
        nothing has arrived for `dead_after` and return False; ping when nothing has been
        written or received for `ping_after`, also while we keep writing: a link that only
        sends (a load generator, a peer pushing replies, a connector answering) hears nothing
        back otherwise and would take the server for dead. Every client of ours (RelayLink,
        the tunnel connector) keeps its connection alive with this."""
        if not self.is_open:
            return True
        now = self.clock()
        if now - self.last_received > dead_after:
            self.abort()
            return False
        if now - self.last_sent >= ping_after or now - self.last_received >= ping_after:
            self.send_ping()
        return True

    # ---- receiving -------------------------------------------------------------------------

    def _on_events(self, events: list[WsEvent]) -> None:
        for event in events:
            if isinstance(event, WsMessage):
                if self.on_message is not None:
                    self.on_message(event)
                else:
                    self._inbox.append(event)
                    self._inbox_ready.set()
            elif isinstance(event, WsPing):
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.write(self.encoder.pong(event.data))
            elif isinstance(event, WsClose):
                self.close_code, self.close_reason = event.code, event.reason
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.write(self.encoder.close(event.code or CloseCode.NORMAL))
                    self.transport.close()
            elif isinstance(event, WsViolation):
                self.close_code, self.close_reason = event.code, event.reason
                if self.transport is not None:
                    self.transport.write(self.encoder.close(event.code, event.reason))
                    self.transport.close()

    def _on_lost(self) -> None:
        self._writable.set()
        self._inbox_ready.set()
        if not self.closed.done():
            self.closed.set_result(None)

    async def recv(self) -> WsMessage:
        """The next message; raises ConnectionClosed once the connection is gone."""
        while not self._inbox:
            if self.closed.done():
                raise ConnectionClosed(self.close_code, self.close_reason or "connection closed")
            self._inbox_ready.clear()
            await self._inbox_ready.wait()
        return self._inbox.popleft()

    async def close(
        self, code: int = CloseCode.NORMAL, reason: str = "", timeout: float = 5.0
    ) -> None:
        """Close handshake: send our close frame, wait for the server to close TCP."""
        transport = self.transport
        if transport is None or self.closed.done():
            return
        if not transport.is_closing():
            transport.write(self.encoder.close(code, reason))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self.closed)
        except TimeoutError:
            transport.abort()
