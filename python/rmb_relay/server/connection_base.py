"""What every TCP connection of the listener shares, whatever it speaks: its identity, its
transport, output batching and backpressure.

A connection starts as an `HttpConnection` (http_connection.py) and, when a dialect accepts a
websocket upgrade, hands its transport to a `WebSocketConnection` (ws_connection.py), which is
what the dialect sees as its `Peer`. Both build on `ConnectionBase`; the upgrade copies this
part across (same id, same transport, same `closed` future) and makes the websocket the
transport's protocol, so every later read goes straight to it.

Output is batched: while a connection processes one read, whatever any handler sends to any
connection is queued per destination and written with a single `transport.write` when the read
is done (`OutputBatcher`). Outside a read (timers, tasks) a send is written at once.

Backpressure: when a destination's transport goes over its high-water mark, every connection
that sends to it during a read pauses reading until the destination drains (`resume_writing`);
producers outside a read (mailbox drains, stream consumers) await `writable()` instead. A
connection that sends to *itself* (a pong, an error, an answer, a forward to its own key) is
no exception: every connection pays for what it causes, so one that asks for answers and never
reads them stops being read once its own output is over the mark, instead of filling memory
(`rmb_relay_reply_backpressure_pauses_total`; HTTP pipelining does the same in
http_connection.py).

Traffic counters (what `/monitor/connections` shows, monitoring/): each connection counts the
bytes it writes and stamps its last read or write here, once per `transport.write` and per
read, never per message; a websocket's messages and bytes in are counted by its Rust decoder,
and the messages put in an outbox by the outboxes (`Outboxes.sent`), so the fast path's
forwards cost two integer additions in Rust. The stamp is `ActivityClock.now`, a reading the
listener refreshes every `ActivityClock.PERIOD`: reading a clock costs ~150-200 ns on a VM
(a system call), copying an attribute ~20 (docs/monitoring.md "Costs").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest, Outboxes
    from rmb_relay.clock import Clock
    from rmb_relay.config import ListenerConfig
    from rmb_relay.dialects.base import (
        Dialect,
        HttpClient,
        HttpFastPath,
        HttpResponse,
        RequestBody,
    )
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

    __slots__ = ("depth", "dirty", "reader", "touched")

    def __init__(self) -> None:
        self.depth = 0
        self.dirty: list[ConnectionBase] = []
        self.reader: ConnectionBase | None = None
        #: outboxes the fast path may have forwarded into during this batch's reads
        self.touched: list[Outboxes] = []

    def flush(self) -> None:
        dirty = self.dirty
        if dirty:
            self.dirty = []
            for conn in dirty:
                conn.flush()
        touched = self.touched
        if touched:
            self.touched = []
            for outboxes in touched:
                for conn, data in outboxes.drain():
                    conn.write_taken(data)


class ActivityClock:
    """A coarse monotonic reading (ns) for activity stamps, refreshed every `PERIOD` seconds by
    a timer of the listener's loop while it serves (`start`, `stop`)."""

    __slots__ = ("_clock", "_timer", "now")

    #: seconds between refreshes: the error of an idle time
    PERIOD = 0.5

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self.now = clock()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop()
        self._tick(loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.now = self._clock()
        self._timer = loop.call_later(self.PERIOD, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


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

    @property
    def reply_pauses(self) -> Counter: ...

    @property
    def linger_aborts(self) -> Counter: ...


class ConnectionHost(Protocol):
    """What a connection needs of the listener, and nothing more."""

    @property
    def config(self) -> ListenerConfig: ...

    @property
    def batcher(self) -> OutputBatcher: ...

    @property
    def metrics(self) -> ConnectionMetrics: ...

    @property
    def activity(self) -> ActivityClock:
        """What connections stamp their opening and last activity with."""

    def dialect_for(self, path: str) -> Dialect | None:
        """The dialect serving websocket upgrades at this path."""

    async def dispatch(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        """Answer a plain HTTP request (the router reads `body` whole or hands it over)."""

    @property
    def http_fast_path(self) -> HttpFastPath | None:
        """What serves a client's read in the Rust core, if a dialect has that (the tunnel's
        hub, dialects/tunnel/hub.py)."""

    def connection_opened(self, conn: ConnectionBase) -> None: ...

    def connection_closed(self, conn: ConnectionBase) -> None: ...

    def websocket_opened(self, conn: ConnectionBase) -> None:
        """`conn` (a websocket) now holds the transport of the connection of the same id."""


class ConnectionBase(asyncio.Protocol):
    """One TCP connection's transport part: see the module docstring."""

    # Slots, not an instance dict: an idle relay holds one of these per connection. Past 30
    # attributes CPython stops sharing a class's instance-dict keys, and each connection paid
    # ~1.6 KB for a dict of its own (bench/README.md "Idle connections"). A new attribute
    # goes here (or in the subclass's slots) too.
    __slots__ = (
        "_activity",
        "_batcher",
        "_blocked_on",
        "_held_by_dialect",
        "_linger_timer",
        "_outboxes",
        "_queued",
        "_reading_paused",
        "_ready",
        "_waiting_senders",
        "_writable",
        "bytes_in",
        "bytes_out",
        "closed",
        "congested",
        "conn_id",
        "last_active",
        "messages_in",
        "messages_out",
        "opened_at",
        "ops_listener",
        "ops_only",
        "peer_host",
        "peer_port",
        "server",
        "state",
        "transport",
    )

    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        self.conn_id = next(_ids)
        self.state = State.HTTP
        self.transport: asyncio.Transport | None = None
        self.peer_host = ""
        self.peer_port = 0
        self._batcher = server.batcher
        self._activity = activity = server.activity
        #: monotonic ns (`ActivityClock`): accepted, last read or written (the monitor's age
        #: and idle time)
        self.opened_at = self.last_active = activity.now
        #: counted by Python: a websocket's reads are counted by its decoder instead
        #: (`traffic`), its messages out by its outbox when it has one
        self.bytes_in = 0
        self.bytes_out = 0
        self.messages_in = 0
        self.messages_out = 0
        #: the switch's outboxes when this connection's output is queued there (a websocket
        #: whose handler uses the fast path, or an HTTP client the tunnel's table serves)
        self._outboxes: Outboxes | None = None
        self._queued = False
        # backpressure: congested = our transport is over its high-water mark
        self.congested = False
        self._waiting_senders: set[ConnectionBase] = set()
        self._blocked_on = 0
        self._reading_paused = False
        #: the dialect holds reading (`hold_reading`), whatever the receivers' state
        self._held_by_dialect = False
        self._writable: asyncio.Future[None] | None = None
        #: drops the connection if its peer has not read what was left at its close
        #: (`_close_after_output`)
        self._linger_timer: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        # what writable() answers while not congested: one done future for the connection's
        # life instead of one per call (each costs a get_running_loop, i.e. a getpid syscall,
        # per delivered message on the paths outside a read)
        self._ready: asyncio.Future[None] = loop.create_future()
        self._ready.set_result(None)
        self.closed = loop.create_future()
        #: admitted over the connection cap: served /health and /metrics only (server/limits.py)
        self.ops_only = False
        #: accepted on the operations listener (`--metrics-listen`): ops routes only
        self.ops_listener = False

    def take_over(self, other: ConnectionBase) -> None:
        """Become the connection `other` was (an upgrade): the same id, transport, peer and
        `closed` future, so nothing outside sees two connections. (An upgrading connection
        blocks no sender and waits for none: it reads nothing while the dialect accepts.)"""
        self.conn_id = other.conn_id
        self.transport = other.transport
        self.peer_host = other.peer_host
        self.peer_port = other.peer_port
        self.closed = other.closed
        self.ops_only = other.ops_only
        self.ops_listener = other.ops_listener
        self.congested = other.congested
        self.opened_at = other.opened_at
        self.last_active = other.last_active
        # the upgrade's bytes count, its request and 101 are no messages of the websocket
        self.bytes_in = other.bytes_in
        self.bytes_out = other.bytes_out

    @property
    def id(self) -> int:
        return self.conn_id

    @property
    def dialect_name(self) -> str:
        """The `dialect` label of this connection's metrics."""
        return "http"

    def traffic(self) -> tuple[int, int, int, int]:
        """(messages in, bytes in, messages out, bytes out) since the connection opened."""
        messages_out, bytes_out = self.messages_out, self.bytes_out
        outboxes = self._outboxes
        if outboxes is not None:
            sent, sent_bytes = outboxes.sent(self.conn_id)
            messages_out += sent
            bytes_out += sent_bytes
        return self.messages_in, self.bytes_in, messages_out, bytes_out

    @property
    def reading_paused(self) -> bool:
        """Reading is paused: a receiver it sent to is congested, or its dialect holds it."""
        return self._reading_paused

    def write_waiting(self) -> int:
        """Bytes queued to be written: in the transport's buffer and in the outbox."""
        transport = self.transport
        waiting = transport.get_write_buffer_size() if transport is not None else 0
        outboxes = self._outboxes
        if outboxes is not None:
            waiting += outboxes.pending(self.conn_id)
        return waiting

    def writable(self) -> Awaitable[None]:
        """Resolves once the socket is under its high-water mark (at once if it is already, or
        when the connection is gone: a closed peer never blocks a producer)."""
        if not self.congested or self.state is State.CLOSED:
            return self._ready
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._writable)

    # ---- asyncio.Protocol (the parts both kinds share) --------------------------------------

    def pause_writing(self) -> None:
        self.congested = True
        if self._outboxes is not None:
            self._outboxes.set_congested(self.conn_id, True)

    def resume_writing(self) -> None:
        self.congested = False
        if self._outboxes is not None:
            self._outboxes.set_congested(self.conn_id, False)
        self._release_waiting_senders()
        self._wake_writable()

    def _wake_writable(self) -> None:
        waiter = self._writable
        if waiter is not None:
            self._writable = None
            if not waiter.done():
                waiter.set_result(None)

    def _close_after_output(self) -> None:
        """Close TCP once what is written has gone (`transport.close`), and drop it if its peer
        has not read that within `close_linger` (`--close-linger`): a peer that stops reading
        (a zero TCP window) acknowledges the kernel's probes, so TCP never gives up on it, and
        the connection would hold its buffer and its descriptor for ever. Every close of the
        listener's connections that may leave output behind comes here (HTTP and websocket)."""
        transport = self.transport
        if transport is None:
            return
        transport.close()
        if self._linger_timer is None and transport.get_write_buffer_size():
            self._linger_timer = self.closed.get_loop().call_later(
                self.server.config.close_linger, self._linger_over
            )

    def _linger_over(self) -> None:
        self._linger_timer = None
        transport = self.transport
        if transport is None or self.closed.done():
            return
        log.info(
            "dropping %s connection from %s: %d bytes not read %g s after its close",
            self.dialect_name,
            self.peer_host,
            transport.get_write_buffer_size(),
            self.server.config.close_linger,
        )
        self.server.metrics.linger_aborts.inc(1, self.dialect_name)
        transport.abort()

    def _lost(self) -> None:
        """The transport is gone: wake everything waiting on this connection."""
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._release_waiting_senders()
        self._wake_writable()
        self.server.connection_closed(self)
        if not self.closed.done():
            self.closed.set_result(None)

    # ---- output ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """See `Peer.batch` and `HttpClient.batch`: sends to any connection inside the block are
        written once per connection at its end, as inside a socket read. No sender is paused
        for a congested receiver in the block (there is no read to pause): the producer looks
        at `congested` itself."""
        batcher = self._batcher
        reader = batcher.reader
        batcher.reader = None
        batcher.depth += 1
        try:
            yield
        finally:
            batcher.depth -= 1
            batcher.reader = reader
            if batcher.depth == 0:
                batcher.flush()

    def _queue_in(self, batcher: OutputBatcher) -> None:
        """Have the read being processed flush us once at its end, and pause its sender while
        we are congested."""
        if not self._queued:
            self._queued = True
            batcher.dirty.append(self)
        if self.congested:
            reader = batcher.reader
            if reader is not None:
                reader._block_on(self)

    def flush(self) -> None:
        """Write what this read queued for this connection (`OutputBatcher`)."""
        self._queued = False
        outboxes = self._outboxes
        if outboxes is not None:
            taken = outboxes.take(self.conn_id)
            if taken is not None:
                self._write_outbox(taken)

    def write_taken(self, data: bytes | memoryview) -> None:
        """Write bytes taken from this connection's outbox (`Outboxes.drain`)."""
        self._write_outbox(data)

    def _write(self, data: bytes | memoryview) -> None:
        """Write bytes Python made (counted here)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            self.bytes_out += len(data)
            self.last_active = self._activity.now

    def _write_outbox(self, data: bytes | memoryview) -> None:
        """Write bytes taken from this connection's own outbox (the outbox counted them: a
        Python addition of a big int per write costs ~100 ns, the outbox's ~1)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            self.last_active = self._activity.now

    # ---- backpressure ----------------------------------------------------------------------

    def _block_on(self, destination: ConnectionBase) -> None:
        if self in destination._waiting_senders:
            return
        destination._waiting_senders.add(self)
        self._blocked_on += 1
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
            metrics = self.server.metrics
            pauses = metrics.reply_pauses if destination is self else metrics.backpressure_pauses
            pauses.inc(1, self.dialect_name)

    def hold_reading(self, held: bool) -> None:
        self._held_by_dialect = held
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if held and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif not held and self._reading_paused and self._blocked_on == 0:
            self._reading_paused = False
            transport.resume_reading()

    def _release_waiting_senders(self) -> None:
        waiting = self._waiting_senders
        if not waiting:
            return
        self._waiting_senders = set()
        for sender in waiting:
            sender._blocked_on -= 1
            if sender._blocked_on == 0 and sender._reading_paused and not sender._held_by_dialect:
                sender._reading_paused = False
                if sender.transport is not None and not sender.transport.is_closing():
                    sender.transport.resume_reading()
