"""A websocket connection: the dialects' `Peer` (contract.py), made by an upgrade.

An `HttpConnection` that a dialect's `accept` admitted hands its transport over
(connection_base.py): from then on every `data_received` is exactly one `WsDecoder.feed` call,
and the dialect's handler sees the decoded data messages.

The fast path: an RMB, SBD or 신경 connection's output lives in the switch's Rust `Outboxes`
(its handler names them), and its decoder forwards local messages into other connections'
outboxes inside `feed`, without an event for Python. Everything else a handler sends to such a
connection is appended to the same outbox, so the order of what it receives is kept; after the
read, each connection the fast path touched is written once (`Outboxes.drain`). The connection
keeps the outbox's state current: open until the close starts, congested while the transport
is over its high-water mark (the fast path then hands the message to Python, which pauses the
sender; connection_base.py).

A connection's answers to itself count against its own output (connection_base.py): when
handling the messages of one read has put its own output over the write high-water mark, the
rest of that read waits, decoded but not handled (`_stalled`), and reading pauses; both resume
once the client has read its output (`resume_writing`). So an answer many times its question
(a 신경 QUERY_NODES, an error per bad metadata key) costs the relay at most the mark plus one
read, however many questions the read held. The check runs only after a message whose handler
queued output to this connection in this read: a connection that only forwards to others pays
nothing for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rmb_relay._core import (
    OP_PONG,
    OP_TEXT,
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
)
from rmb_relay.contract import CloseCode
from rmb_relay.server.connection_base import ConnectionBase, ConnectionHost, State

if TYPE_CHECKING:
    from rmb_relay._core import WsEvent
    from rmb_relay.clock import Clock
    from rmb_relay.dialects.base import Dialect, WebSocketHandler

log = logging.getLogger("rmb_relay.server")


class WebSocketConnection(ConnectionBase):
    """A websocket connection of the listener and a dialect's `Peer`; see the module docstring.

    Made while the dialect's `accept` runs (state UPGRADING: it is the `Peer` the dialect is
    handed), it starts reading at `start`, when the HTTP connection gives it the transport."""

    __slots__ = (
        "_close_timer",
        "_decoder",
        "_frames",
        "_peer_close_code",
        "_pending",
        "_scan_clock",
        "_stalled",
        "_unfed",
        "dialect",
        "handler",
    )

    def __init__(self, server: ConnectionHost, dialect: Dialect) -> None:
        super().__init__(server)
        self.state = State.UPGRADING
        self.dialect = dialect
        self.handler: WebSocketHandler | None = None
        self._decoder: WsDecoder | None = None
        self._scan_clock: Clock | None = None
        # what this read queued for this connection: encoded frames in order (text and control
        # frames), then binary payloads not yet framed (framed together at flush)
        self._frames: list[bytes] = []
        self._pending: list[bytes] = []
        self._peer_close_code: int | None = None
        self._close_timer: asyncio.TimerHandle | None = None
        #: the decoded rest of a read whose answers put our own output over the mark: handled
        #: once the client has read (`_resume_stalled`); None when nothing waits
        self._stalled: list[WsEvent] | None = None
        #: bytes read while `_stalled` waits (at most a read: reading is paused), fed after it
        self._unfed: list[bytes] = []

    def start(self, handler: WebSocketHandler) -> None:
        """The 101 is written and this connection is the transport's protocol: decode from
        now on, with the handler's scanner, and queue output in its outboxes if it has them."""
        dialect = self.dialect
        self._decoder = decoder = WsDecoder(max_message=dialect.max_message)
        self._scan_clock = dialect.scan_clock
        self.handler = handler
        handler.bind_decoder(decoder)
        outboxes = handler.outboxes
        if outboxes is not None:
            outboxes.open(self.conn_id, self, dialect.name)
            outboxes.set_congested(self.conn_id, self.congested)
            self._outboxes = outboxes
        self.state = State.WEBSOCKET

    # ---- Peer ------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.state is State.WEBSOCKET

    @property
    def dialect_name(self) -> str:
        return self.dialect.name

    def traffic(self) -> tuple[int, int, int, int]:
        """`ConnectionBase.traffic`, with what the decoder read (the upgrade's request is the
        HTTP part's)."""
        messages_in, bytes_in, messages_out, bytes_out = super().traffic()
        decoder = self._decoder
        if decoder is not None:
            messages_in += decoder.messages_in
            bytes_in += decoder.bytes_in
        return messages_in, bytes_in, messages_out, bytes_out

    # ---- asyncio.Protocol ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._stalled is not None:  # (reading is paused: at most the read under way)
            self._unfed.append(data)
            return
        self._read(data, None)

    def _read(self, data: bytes | None, stalled: list[WsEvent] | None) -> None:
        """Handle `stalled` (the rest of an earlier read), then decode and handle `data`, as one
        read: what the handlers send is written once per connection at its end."""
        decoder = self._decoder
        if decoder is None:
            return  # not started, or closed: nothing more is read
        batcher = self._batcher
        previous_reader = batcher.reader
        batcher.reader = self
        batcher.depth += 1
        outboxes = self._outboxes
        self.last_active = self._activity.now
        try:
            if stalled is not None:
                self._on_events(stalled)
            if data is not None:
                if self._stalled is not None:  # stalled again before it: it waits on
                    self._unfed.append(data)
                else:
                    clock = self._scan_clock
                    events = decoder.feed(data) if clock is None else decoder.feed(data, clock())
                    if events:
                        self._on_events(events)
        finally:
            batcher.depth -= 1
            batcher.reader = previous_reader
            if outboxes is not None and outboxes not in batcher.touched:
                batcher.touched.append(outboxes)
            if batcher.depth == 0:
                batcher.flush()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        decoder = self._decoder
        if decoder is not None:  # its counts stay the connection's (the listener sums them)
            self.messages_in += decoder.messages_in
            self.bytes_in += decoder.bytes_in
        self._decoder = None
        if self._close_timer is not None:
            self._close_timer.cancel()
        self._frames.clear()
        self._pending.clear()
        self._unfed.clear()
        stalled, self._stalled = self._stalled, None
        outboxes = self._outboxes
        if outboxes is not None:
            sent, sent_bytes = outboxes.sent(self.conn_id)
            self.messages_out += sent
            self.bytes_out += sent_bytes
            outboxes.remove(self.conn_id)
        handler = self.handler
        if handler is not None:
            for event in stalled or ():  # read but never handled
                if isinstance(event, WsMessage):
                    handler.on_discarded(event)
            try:
                handler.on_close(self._peer_close_code)
            except Exception:
                log.exception("dialect %s failed in on_close", self.dialect_name)
        self._lost()

    # ---- reading -----------------------------------------------------------------------------

    def _on_events(self, events: list[WsEvent]) -> None:
        handler = self.handler
        assert handler is not None
        remaining = iter(events)
        for event in remaining:
            kind = type(event)
            if kind is WsMessage:
                if self.state is not State.WEBSOCKET:
                    # closing: data after our close frame is discarded (RFC 6455 §5.5.1)
                    handler.on_discarded(event)  # type: ignore[arg-type]
                    continue
                try:
                    handler.on_message(event)  # type: ignore[arg-type]
                except Exception:
                    log.exception(
                        "dialect %s failed on a message from %s; closing with 1011",
                        self.dialect_name,
                        self.peer_host,
                    )
                    self.close(CloseCode.INTERNAL, "internal error")
                    for rest in remaining:
                        if type(rest) is WsMessage:
                            handler.on_discarded(rest)
                    return
                # (only once this read has answered us: a forward to others costs nothing)
                if self._queued and self._over_own_mark():
                    self._stall(list(remaining))
                    return
            elif kind is WsPing:
                if self.state is State.WEBSOCKET:
                    self.send_frame(encode_frame(OP_PONG, event.data))  # type: ignore[union-attr]
                    if self._over_own_mark():  # (a pong is the ping's size: rarely)
                        self._stall(list(remaining))
                        return
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
                if self.dialect.abort_on_violation:
                    self.abort()
                else:
                    self.close(violation.code, violation.reason, wait=False)
                return

    # ---- our own output's backpressure ---------------------------------------------------------

    def _over_own_mark(self) -> bool:
        """What waits to be written to this connection (outbox, this read's frames, the
        transport's buffer) is over the write high-water mark."""
        waiting = self.write_waiting()
        if self._outboxes is None:
            waiting += sum(map(len, self._frames)) + sum(map(len, self._pending))
        return waiting > self.server.config.write_high_water

    def _stall(self, rest: list[WsEvent]) -> None:
        """Keep the rest of this read for when the client has read our output, and read nothing
        more meanwhile (see the module docstring)."""
        if not rest:
            return  # nothing waits: the next read finds the transport congested (`_queue_in`)
        self._stalled = rest
        self._blocked_on += 1  # (what `hold_reading` and released senders look at)
        transport = self.transport
        if not self._reading_paused and transport is not None:
            self._reading_paused = True
            transport.pause_reading()
            self.server.metrics.reply_pauses.inc(1, self.dialect_name)
        # after this read's flush: resumes at once if the socket took it all, else when the
        # transport drains (`resume_writing`)
        asyncio.get_running_loop().call_soon(self._resume_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._resume_stalled()

    def _resume_stalled(self) -> None:
        stalled = self._stalled
        if stalled is None or self.congested:
            return  # done already, or `resume_writing` calls again
        self._stalled = None
        self._blocked_on -= 1
        unfed = self._unfed
        data = None
        if unfed:
            data = unfed[0] if len(unfed) == 1 else b"".join(unfed)
            unfed.clear()
        self._read(data, stalled)
        if (
            self._stalled is None
            and self._blocked_on == 0
            and self._reading_paused
            and not self._held_by_dialect
        ):
            transport = self.transport
            if transport is not None and not transport.is_closing():
                self._reading_paused = False
                transport.resume_reading()

    def _on_peer_close(self, event: WsClose) -> None:
        self._peer_close_code = event.code
        if self.state is State.WEBSOCKET:
            # echo the peer's code (RFC 6455 §5.5.1); a close without a code is answered with 1000
            self.flush()
            self._write(encode_close(event.code if event.code is not None else CloseCode.NORMAL))
        self._closing()
        self._close_after_output()  # the server closes TCP first (RFC 6455 §7.1.1)

    # ---- sending -----------------------------------------------------------------------------

    def _closing(self) -> None:
        """No more messages from or to this connection (a close frame went, or none will)."""
        if self.state is not State.CLOSED:
            self.state = State.CLOSING
        if self._outboxes is not None:
            self._outboxes.close(self.conn_id)

    def send(self, payload: bytes) -> None:
        """Queue one binary message; written with the rest of this batch in one write."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(1, self.dialect_name, "connection closing")
            return
        outboxes = self._outboxes
        if outboxes is not None:
            outboxes.push(self.conn_id, payload)
        else:
            self._pending.append(payload)
            self.messages_out += 1
        batcher = self._batcher
        if batcher.depth:
            self._queue_in(batcher)
        else:
            self.flush()

    def send_many(self, payloads: list[bytes]) -> None:
        """Queue several binary messages in order (one write with the rest of the batch)."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(len(payloads), self.dialect_name, "connection closing")
            return
        outboxes = self._outboxes
        if outboxes is not None:
            outboxes.push_many(self.conn_id, payloads)
        else:
            self._pending.extend(payloads)
            self.messages_out += len(payloads)
        batcher = self._batcher
        if batcher.depth:
            self._queue_in(batcher)
        else:
            self.flush()

    def send_text(self, text: bytes) -> None:
        """Write one text message after whatever is queued (keeps order)."""
        if self.state is not State.WEBSOCKET:
            self.server.metrics.dropped.inc(1, self.dialect_name, "connection closing")
            return
        outboxes = self._outboxes
        if outboxes is not None:  # framed in the outbox (a 신경 gateway's frames)
            outboxes.push_text(self.conn_id, text)
            batcher = self._batcher
            if batcher.depth:
                self._queue_in(batcher)
            else:
                self.flush()
            return
        self.send_frame(encode_frame(OP_TEXT, text))

    def send_frame(self, frame: bytes) -> None:
        """Queue an already-encoded frame after whatever is queued (keeps order); inside a read
        it goes out with the rest of the batch in one write (a 신경 JSON gateway sends text)."""
        if self.state is State.CLOSED:
            return
        batcher = self._batcher
        outboxes = self._outboxes
        if outboxes is not None:
            outboxes.push_raw(self.conn_id, frame)
            if batcher.depth:
                self._queue_in(batcher)
            else:
                self.flush()
            return
        self.messages_out += 1
        if batcher.depth:
            pending = self._pending
            if pending:
                self._frames.append(self._frame_pending(pending))
            self._frames.append(frame)
            self._queue_in(batcher)
        else:
            self.flush()
            self._write(frame)

    @staticmethod
    def _frame_pending(pending: list[bytes]) -> bytes:
        data = encode_binary(pending[0]) if len(pending) == 1 else encode_binary_batch(pending)
        pending.clear()
        return data

    def flush(self) -> None:
        if self._outboxes is not None:
            super().flush()
            return
        self._queued = False
        pending = self._pending
        frames = self._frames
        if frames:
            if pending:
                frames.append(self._frame_pending(pending))
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            frames.clear()
            self._write(data)
        elif pending:
            self._write(self._frame_pending(pending))

    def close(self, code: int = CloseCode.NORMAL, reason: str = "", *, wait: bool = True) -> None:
        """Start the close handshake; `wait=False` closes TCP right after the close frame."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        transport = self.transport
        if self.state is State.WEBSOCKET:
            self.flush()
            self._write(encode_close(code, reason))
        self._closing()
        if transport is None:
            return
        if wait:
            self._close_timer = asyncio.get_running_loop().call_later(
                self.server.config.close_timeout, self._close_timed_out
            )
        else:
            self._close_after_output()

    def _close_timed_out(self) -> None:
        """The peer has not answered our close frame in time. With nothing left to write, drop
        the connection; with output still waiting (a peer slow to read, a path being
        repaired: what a replaced session had queued, docs/faults.md b), close TCP after it
        instead of discarding it. Nothing is added once closing; the kernel gives up on a
        peer that stops acknowledging, and `--close-linger` on one that acknowledges and
        never reads (`_close_after_output`)."""
        transport = self.transport
        if transport is None:
            return
        if transport.get_write_buffer_size():
            self._close_after_output()
        else:
            transport.abort()

    def abort(self) -> None:
        """Drop the connection without a close frame (SBD violations demand exactly this)."""
        self._closing()
        self._frames.clear()
        self._pending.clear()
        if self._outboxes is not None:
            self._outboxes.take(self.conn_id)
        if self.transport is not None:
            self.transport.abort()
