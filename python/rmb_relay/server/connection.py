"""One asyncio Protocol per TCP connection: it moves bytes and nothing else.

Theory of operation
-------------------
A connection starts in the HTTP state: every `data_received` goes to the Rust `HttpParser` in
one call. A complete request is handled in a task (reading is paused meanwhile, so pipelined
bytes simply wait in the parser). A websocket upgrade asks the matching dialect to `accept`;
on success the 101 is written, a Rust `WsDecoder` takes over and whatever the client sent after
its head is fed to it. From then on every `data_received` is exactly one `WsDecoder.feed` call,
and the dialect handler sees the decoded data messages.

Output is batched: while a connection processes one read, whatever any handler sends to any
connection is queued per destination and written with a single `transport.write` when the
read is done (`OutputBatcher`). Outside a read (timers, tasks) a send is written at once.

Backpressure: when a destination's transport goes over its high-water mark, every connection
that sends to it during a read pauses reading until the destination drains (`resume_writing`);
producers outside a read (mailbox drains, stream consumers) await `writable()` instead.

A `Connection` is the dialects' `Peer` (protocols/base.py) and sees the listener only through
the narrow `ConnectionHost` below.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, cast

from rmb_relay._core import (
    OP_PONG,
    OP_TEXT,
    HttpParseError,
    HttpParser,
    HttpRequest,
    WsClose,
    WsDecoder,
    WsMessage,
    WsPing,
    WsPong,
    WsViolation,
    encode_binary,
    encode_binary_batch,
    encode_close,
    encode_frame,
    encode_response,
    encode_switching_protocols,
    validate_websocket_upgrade,
)
from rmb_relay.errors import HttpReject
from rmb_relay.protocols.base import CloseCode, HttpResponse, reject_response

if TYPE_CHECKING:
    from rmb_relay._core import WsEvent
    from rmb_relay.clock import Clock
    from rmb_relay.config import ListenerConfig
    from rmb_relay.protocols.base import Dialect, HttpClient, WebSocketHandler
    from rmb_relay.telemetry.metrics import Counter

log = logging.getLogger("rmb_relay.server")

_ids = itertools.count(1)


class State(enum.Enum):
    HTTP = "http"
    UPGRADING = "upgrading"
    WEBSOCKET = "websocket"
    CLOSING = "closing"
    CLOSED = "closed"


class OutputBatcher:
    """Defers writes made while a read is processed; flushes each touched connection once.
    `reader` is the connection whose read is being processed (the one to pause when it sends
    to a congested destination)."""

    __slots__ = ("depth", "dirty", "reader")

    def __init__(self) -> None:
        self.depth = 0
        self.dirty: list[Connection] = []
        self.reader: Connection | None = None

    def flush(self) -> None:
        dirty = self.dirty
        if not dirty:
            return
        self.dirty = []
        for conn in dirty:
            conn.flush()


class ConnectionMetrics(Protocol):
    """The listener metrics a connection bumps."""

    @property
    def http_requests(self) -> Counter: ...

    @property
    def http_errors(self) -> Counter: ...

    @property
    def ws_violations(self) -> Counter: ...

    @property
    def dropped(self) -> Counter: ...

    @property
    def backpressure_pauses(self) -> Counter: ...


class ConnectionHost(Protocol):
    """What a connection needs of the listener, and nothing more."""

    @property
    def config(self) -> ListenerConfig: ...

    @property
    def batcher(self) -> OutputBatcher: ...

    @property
    def metrics(self) -> ConnectionMetrics: ...

    def dialect_for(self, path: str) -> Dialect | None:
        """The dialect serving websocket upgrades at this path."""

    async def dispatch(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        """Answer a plain HTTP request."""

    def connection_opened(self, conn: Connection) -> None: ...

    def connection_closed(self, conn: Connection) -> None: ...

    def websocket_opened(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """A TCP connection of the listener and a dialect's `Peer`; see the module docstring."""

    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        self.conn_id = next(_ids)
        self.state = State.HTTP
        self.transport: asyncio.Transport | None = None
        self.peer_host = ""
        self.peer_port = 0
        self.dialect: Dialect | None = None
        self.handler: WebSocketHandler | None = None
        self._batcher = server.batcher
        self._parser: HttpParser | None = HttpParser(
            max_head=server.config.max_http_head, max_body=server.config.max_message
        )
        self._decoder: WsDecoder | None = None
        self._scan_clock: Clock | None = None
        self._pending: list[bytes] = []
        self._queued = False
        self._peer_close_code: int | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        self._http_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        # backpressure: congested = our transport is over its high-water mark
        self.congested = False
        self._waiting_senders: set[Connection] = set()
        self._blocked_on = 0
        self._reading_paused = False
        self._writable: asyncio.Future[None] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    # ---- Peer ------------------------------------------------------------------------------

    @property
    def id(self) -> int:
        return self.conn_id

    @property
    def is_open(self) -> bool:
        return self.state is State.WEBSOCKET

    def writable(self) -> Awaitable[None]:
        """Resolves once the socket is under its high-water mark (at once if it is already, or
        when the connection is gone: a closed peer never blocks a producer)."""
        if not self.congested or self.state is State.CLOSED:
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._writable)

    # ---- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer_host, self.peer_port = str(peer[0]), int(peer[1])
        self.transport.set_write_buffer_limits(high=self.server.config.write_high_water)
        self.server.connection_opened(self)
        self._http_timer = asyncio.get_running_loop().call_later(
            self.server.config.http_idle_timeout, self._http_idle
        )

    def data_received(self, data: bytes) -> None:
        decoder = self._decoder
        if decoder is not None:
            batcher = self._batcher
            previous_reader = batcher.reader
            batcher.reader = self
            batcher.depth += 1
            try:
                clock = self._scan_clock
                self._on_ws_events(
                    decoder.feed(data) if clock is None else decoder.feed(data, clock())
                )
            finally:
                batcher.depth -= 1
                batcher.reader = previous_reader
                if batcher.depth == 0:
                    batcher.flush()
        elif self.state is State.HTTP:
            self._on_http_bytes(data)
        # UPGRADING: the parser kept earlier bytes; a well-behaved client sends nothing until
        # the 101, and reading is paused meanwhile. CLOSING/CLOSED: nothing more is read.

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        for timer in (self._close_timer, self._http_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._pending.clear()
        self._release_waiting_senders()
        self._wake_writable()
        handler = self.handler
        if handler is not None:
            try:
                handler.on_close(self._peer_close_code)
            except Exception:
                log.exception("dialect %s failed in on_close", self.dialect_name)
        self.server.connection_closed(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.congested = True

    def resume_writing(self) -> None:
        self.congested = False
        self._release_waiting_senders()
        self._wake_writable()

    def _wake_writable(self) -> None:
        waiter = self._writable
        if waiter is not None:
            self._writable = None
            if not waiter.done():
                waiter.set_result(None)

    # ---- websocket -------------------------------------------------------------------------

    @property
    def dialect_name(self) -> str:
        return self.dialect.name if self.dialect is not None else "http"

    def _on_ws_events(self, events: list[WsEvent]) -> None:
        handler = self.handler
        assert handler is not None
        for event in events:
            kind = type(event)
            if kind is WsMessage:
                if self.state is not State.WEBSOCKET:
                    continue  # closing: data after our close frame is discarded (RFC 6455 §5.5.1)
                try:
                    handler.on_message(event)  # type: ignore[arg-type]
                except Exception:
                    log.exception(
                        "dialect %s failed on a message from %s; closing with 1011",
                        self.dialect_name,
                        self.peer_host,
                    )
                    self.close(CloseCode.INTERNAL, "internal error")
                    return
            elif kind is WsPing:
                if self.state is State.WEBSOCKET:
                    self.send_frame(encode_frame(OP_PONG, event.data))  # type: ignore[union-attr]
            elif kind is WsPong:
                handler.on_pong(event.data)  # type: ignore[union-attr]
            elif kind is WsClose:
                self._on_peer_close(event)  # type: ignore[arg-type]
                return
            else:
                violation: WsViolation = event  # type: ignore[assignment]
                log.info(
                    "closing %s connection from %s: %s (%d)",
                    self.dialect_name,
                    self.peer_host,
                    violation.reason,
                    violation.code,
                )
                self.server.metrics.ws_violations.inc(1, self.dialect_name, str(violation.code))
                if self.dialect is not None and self.dialect.abort_on_violation:
                    self.abort()
                else:
                    self.close(violation.code, violation.reason, wait=False)
                return

    def _on_peer_close(self, event: WsClose) -> None:
        self._peer_close_code = event.code
        if self.state is State.WEBSOCKET:
            # echo the peer's code (RFC 6455 §5.5.1); a close without a code is answered with 1000
            self.flush()
            self._write(encode_close(event.code if event.code is not None else CloseCode.NORMAL))
        self.state = State.CLOSING
        if self.transport is not None:
            self.transport.close()  # the server closes TCP first (RFC 6455 §7.1.1)

    def send(self, payload: bytes) -> None:
        """Queue one binary message; written with the rest of this batch in one write."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(1, self.dialect_name, "connection closing")
            return
        self._pending.append(payload)
        batcher = self._batcher
        if batcher.depth:
            if not self._queued:
                self._queued = True
                batcher.dirty.append(self)
            if self.congested:
                reader = batcher.reader
                if reader is not None and reader is not self:
                    reader._block_on(self)
        else:
            self.flush()

    def send_many(self, payloads: list[bytes]) -> None:
        """Queue several binary messages in order (one write with the rest of the batch)."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(len(payloads), self.dialect_name, "connection closing")
            return
        self._pending.extend(payloads)
        batcher = self._batcher
        if batcher.depth:
            if not self._queued:
                self._queued = True
                batcher.dirty.append(self)
            if self.congested:
                reader = batcher.reader
                if reader is not None and reader is not self:
                    reader._block_on(self)
        else:
            self.flush()

    def send_text(self, text: bytes) -> None:
        """Write one text message after whatever is queued (keeps order)."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(1, self.dialect_name, "connection closing")
            return
        self.send_frame(encode_frame(OP_TEXT, text))

    def send_frame(self, frame: bytes) -> None:
        """Write an already-encoded frame after whatever is queued (keeps order)."""
        if self.state is State.CLOSED:
            return
        self.flush()
        self._write(frame)

    def flush(self) -> None:
        self._queued = False
        pending = self._pending
        if not pending:
            return
        data = encode_binary(pending[0]) if len(pending) == 1 else encode_binary_batch(pending)
        pending.clear()
        self._write(data)

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def close(self, code: int = CloseCode.NORMAL, reason: str = "", *, wait: bool = True) -> None:
        """Start the close handshake; `wait=False` closes TCP right after the close frame."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        transport = self.transport
        if self.state is State.WEBSOCKET:
            self.flush()
            self._write(encode_close(code, reason))
        self.state = State.CLOSING
        if transport is None:
            return
        if wait:
            self._close_timer = asyncio.get_running_loop().call_later(
                self.server.config.close_timeout, transport.abort
            )
        else:
            transport.close()

    def abort(self) -> None:
        """Drop the connection without a close frame (SBD violations demand exactly this)."""
        self.state = State.CLOSING
        self._pending.clear()
        if self.transport is not None:
            self.transport.abort()

    # ---- backpressure ----------------------------------------------------------------------

    def _block_on(self, destination: Connection) -> None:
        if self in destination._waiting_senders:
            return
        destination._waiting_senders.add(self)
        self._blocked_on += 1
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
            self.server.metrics.backpressure_pauses.inc(1, self.dialect_name)

    def _release_waiting_senders(self) -> None:
        waiting = self._waiting_senders
        if not waiting:
            return
        self._waiting_senders = set()
        for sender in waiting:
            sender._blocked_on -= 1
            if sender._blocked_on == 0 and sender._reading_paused:
                sender._reading_paused = False
                if sender.transport is not None and not sender.transport.is_closing():
                    sender.transport.resume_reading()

    # ---- HTTP ------------------------------------------------------------------------------

    def _on_http_bytes(self, data: bytes) -> None:
        parser = self._parser
        assert parser is not None
        try:
            request = parser.feed(data)
        except HttpParseError as err:
            reason, status = err.args
            log.info("bad HTTP request from %s: %s (%d)", self.peer_host, reason, status)
            self.server.metrics.http_errors.inc(1, str(status))
            self._respond(HttpResponse(int(status), str(reason).encode()), close=True)
            return
        if request is None:
            return
        if self.transport is not None:
            self.transport.pause_reading()
        self._task = asyncio.get_running_loop().create_task(self._handle_request(request))

    async def _handle_request(self, request: HttpRequest) -> None:
        try:
            if request.is_websocket_upgrade:
                await self._upgrade(request)
                return
            try:
                response = await self.server.dispatch(request, self)
            except HttpReject as reject:
                response = reject_response(reject)
            self.server.metrics.http_requests.inc(1, request.method, str(response.status))
            keep = request.keep_alive and response.status < 400
            self._respond(response, close=not keep)
            if keep and self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()
                self._on_http_bytes(b"")  # a pipelined request may already be buffered
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.path)
            self._respond(HttpResponse(500, b"internal server error"), close=True)

    async def _upgrade(self, request: HttpRequest) -> None:
        dialect = self.server.dialect_for(request.path)
        if dialect is None:
            self._respond(HttpResponse(404, b"no relay dialect serves this path"), close=True)
            return
        try:
            accept = validate_websocket_upgrade(request)
        except HttpParseError as err:
            reason, status = err.args
            self._respond(HttpResponse(int(status), str(reason).encode()), close=True)
            return
        self.state = State.UPGRADING
        self.dialect = dialect
        try:
            handler = await dialect.accept(request, self)
        except HttpReject as reject:
            log.info(
                "%s upgrade from %s refused: %d %s",
                dialect.name,
                self.peer_host,
                reject.status,
                reject.reason,
            )
            self.state = State.HTTP
            self._respond(reject_response(reject), close=True)
            return
        if self.state is not State.UPGRADING or self.transport is None:
            handler.on_close(None)  # the client left while we were authenticating
            return
        if self._http_timer is not None:
            self._http_timer.cancel()
            self._http_timer = None
        self._write(encode_switching_protocols(accept))
        parser = self._parser
        assert parser is not None
        rest = parser.take_rest()
        self._parser = None
        self._decoder = WsDecoder(max_message=dialect.max_message)
        self._scan_clock = dialect.scan_clock
        self.handler = handler
        handler.bind_decoder(self._decoder)
        self.state = State.WEBSOCKET
        self.server.websocket_opened(self)
        batcher = self._batcher
        batcher.depth += 1
        try:
            handler.on_open()
        finally:
            batcher.depth -= 1
            if batcher.depth == 0:
                batcher.flush()
        if rest:
            self.data_received(rest)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _respond(self, response: HttpResponse, *, close: bool) -> None:
        self._write(
            encode_response(response.status, response.header_list(), response.body, close=close)
        )
        if close and self.transport is not None:
            self.state = State.CLOSING
            self.transport.close()

    def _http_idle(self) -> None:
        if self.state in (State.HTTP, State.UPGRADING) and self.transport is not None:
            log.debug("closing idle HTTP connection from %s", self.peer_host)
            self.transport.close()
