"""A lean HTTP/1.1 client for the connector's web targets over plain HTTP: keep-alive
connections per target, requests sent as the connector's core built them
(rust/dialects/tunnel/connector.rs), responses parsed in Rust (`HttpResponseParser`,
rust/codec/http.rs), bodies read as they arrive.

Why not aiohttp: the connector makes one target request per tunnelled request, and aiohttp's
client costs several times the rest of the connector's work per small request (measured with
`bench/tunnel.py` under cProfile). This client does what a reverse proxy needs and no more:
Content-Length, chunked and close-delimited response bodies; no redirects, cookies or
decompression (the client gets the target's bytes as sent); a response body is an async
iterator with flow control (reading pauses while more than `BUFFER_LIMIT` bytes wait), so a
body of any size costs bounded memory.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Protocol, cast

from rmb_relay._core import (
    HttpResponseError,
    HttpResponseParser,
    TunnelConnectorCore,
    TunnelRequest,
)
from rmb_relay.clock import Clock

__all__ = ["CoreExchange", "HttpClientPool", "TargetConnection", "TargetError", "TargetReply"]

#: a response head as the connection hands it over: status, headers (lower-case names,
#: latin-1 values, repeated ones in order), and the whole body when it was small enough to be
#: read with the head (else None: read it from the connection)
Head = tuple[int, list[tuple[str, str]], bytes | None]
#: told a connection's answer head (with the whole body when small), or the error
OnHead = Callable[["TargetConnection", Head | None, Exception | None], None]

#: unread response bytes above which the connection stops reading (and under half resumes)
BUFFER_LIMIT = 256 * 1024
#: idle keep-alive connections kept per target
MAX_IDLE = 64


class CoreExchange(Protocol):
    """A request of the connector's core on a connection (`connector.Exchange`): the bytes go
    through `core.respond`, which delivers a whole answer itself (`delivered`); any other
    outcome comes as a head or an error (the exchange is an OnHead too)."""

    core: TunnelConnectorCore
    request: TunnelRequest
    clock: Clock

    def delivered(self, conn: TargetConnection) -> None: ...

    def __call__(
        self, conn: TargetConnection, head: Head | None, err: Exception | None
    ) -> None: ...


class TargetError(ConnectionError):
    """The target broke the connection or sent something that is not HTTP/1.1."""


class TargetConnection(asyncio.Protocol):
    """One connection to a target; reads one response at a time, parsed by the Rust
    `HttpResponseParser` (one call per `data_received`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = HttpResponseParser()
        self.head: asyncio.Future[Head] | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        #: the current response is complete (its last byte parsed)
        self.done = False
        self.reusable = False
        self.error: Exception | None = None
        self.closed = False
        self.received_any = False
        self._writable = asyncio.Event()
        self._writable.set()
        #: the task streaming the current request's body, if any
        self.sender: asyncio.Task[None] | None = None
        #: told the head instead of `head` (an exchange of the connector's core)
        self.on_head: OnHead | None = None
        #: the core's exchange this connection serves, if any (`start_exchange`)
        self.exchange: CoreExchange | None = None

    # ---- asyncio -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        exchange = self.exchange
        try:
            if exchange is not None:
                events = exchange.core.respond(
                    exchange.request, self.parser, data, exchange.clock()
                )
                if events is None:  # a whole answer, its Deliver queued by the core
                    self.exchange = self.on_head = None
                    self.done = True
                    self.reusable = self.parser.keep_alive
                    exchange.delivered(self)
                    return
            else:
                events = self.parser.feed(data)
        except HttpResponseError as err:  # also: bytes while no request is out
            self._fail(TargetError(f"malformed target response: {err}"))
            return
        for event in events:
            if event is None:
                self._finish()
            elif type(event) is bytes:
                self._push(event)
            else:
                self._head_ready(cast(Head, event))

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()
        if self.done and self.parser.idle:
            return
        try:
            if self.parser.feed_eof():
                self._finish()  # a body delimited by the close
                self.reusable = False
                return
        except HttpResponseError:
            pass
        if not self.done:
            self._fail(TargetError(f"target closed the connection ({exc or 'EOF'})"))

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- response parsing ----------------------------------------------------------------

    def start(self, head_request: bool, whole_limit: int = 0) -> asyncio.Future[Head]:
        """Expect a response (no body for HEAD): its head resolves the returned future."""
        self.on_head = self.exchange = None
        self.head = head = asyncio.get_running_loop().create_future()
        self.parser.start(head_request, whole_limit)
        self.done = self.reusable = self.received_any = False
        return head

    def start_exchange(self, exchange: CoreExchange, whole_limit: int) -> None:
        """`start` for a request of the connector's core: the bytes go through its `respond`,
        and `exchange` hears the other outcomes."""
        self.on_head = exchange
        self.exchange = exchange
        self.head = None
        self.parser.start(exchange.request.head, whole_limit)
        self.done = self.reusable = self.received_any = False

    def detach(self) -> None:
        """Nobody waits for this connection's answer any more (a timed-out exchange)."""
        self.on_head = self.exchange = None

    def _head_ready(self, head: Head) -> None:
        self.exchange = None
        if head[2] is not None:  # the whole response (the parser sends no end after it)
            self.done = True
            self.reusable = self.parser.keep_alive
        on_head, self.on_head = self.on_head, None
        if on_head is not None:
            on_head(self, head, None)
        elif self.head is not None and not self.head.done():
            self.head.set_result(head)

    def _push(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.chunks.append(chunk)
        self.buffered += len(chunk)
        if self.buffered > BUFFER_LIMIT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self.reusable = self.parser.keep_alive
        self._wake()

    def _fail(self, err: Exception) -> None:
        self.error = err
        self.exchange = None
        self.reusable = False
        on_head, self.on_head = self.on_head, None
        if on_head is not None:
            on_head(self, None, err)
        elif self.head is not None and not self.head.done():
            self.head.set_exception(err)
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_chunk(self) -> bytes | None:
        """The next body piece, None at the end; raises TargetError."""
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.done:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= BUFFER_LIMIT // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    async def drain(self) -> None:
        await self._writable.wait()
        if self.closed:
            raise TargetError("target closed the connection while we sent the body")

    def abandon(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None and not sender.done():
            sender.cancel()
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    async def send_body(self, body: AsyncIterator[bytes]) -> None:
        """Stream a request body; a failure fails the exchange (the reader sees it)."""
        try:
            async for chunk in body:
                if self.transport is None or self.closed:
                    raise TargetError("target closed the connection while we sent the body")
                self.transport.write(chunk)
                await self.drain()
        except asyncio.CancelledError:
            self._fail(TargetError("request body not sent"))
            raise
        except Exception as err:
            self._fail(err if isinstance(err, TargetError) else TargetError(str(err)))


class TargetReply:
    """A target's response: status, headers (names lower-case), and the body to read (once)."""

    def __init__(
        self,
        pool: HttpClientPool,
        conn: TargetConnection,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        #: the whole body when it was read with the head (`request(whole_limit=...)`)
        self.body = body
        self._pool = pool
        self._conn: TargetConnection | None = conn

    @property
    def content_length(self) -> int | None:
        if self.body is not None:
            return len(self.body)
        if self._conn is not None and self._conn.done and not self._conn.chunks:
            return 0
        for name, value in self.headers:
            if name == "content-length":
                return int(value)
        return None

    async def read(self) -> bytes:
        if self.body is not None:
            self.release()
            return self.body
        parts = [chunk async for chunk in self.iter()]
        return b"".join(parts)

    async def iter(self) -> AsyncIterator[bytes]:
        if self.body is not None:
            self.release()
            if self.body:
                yield self.body
            return
        conn = self._conn
        if conn is None:
            return
        try:
            while (chunk := await conn.next_chunk()) is not None:
                yield chunk
        finally:
            self.release()

    def release(self) -> None:
        """Give the connection back (kept alive if the body was read to its end)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.put_back(conn)


class HttpClientPool:
    """Keep-alive connections to one target (host, port)."""

    def __init__(self, host: str, port: int, host_header: str) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header
        self._idle: list[TargetConnection] = []

    def put_back(self, conn: TargetConnection) -> None:
        sender, conn.sender = conn.sender, None
        sent = sender is None or (sender.done() and not sender.cancelled())
        if sender is not None and not sender.done():
            sender.cancel()  # the answer came before the whole body went: drop the connection
        usable = sent and conn.done and conn.reusable and not conn.closed and not conn.chunks
        if usable and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def take_idle(self) -> TargetConnection | None:
        """An idle kept-alive connection that is still open, or None (closed ones dropped)."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.abandon()  # the target closed it while it was idle
        return None

    async def _connect(self) -> TargetConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(TargetConnection, self.host, self.port)
        return protocol

    async def request(
        self,
        data: bytes,
        head_request: bool,
        body: AsyncIterator[bytes] | None = None,
        whole_limit: int = 0,
    ) -> TargetReply:
        """Send a request (`data`: its head and any body in hand; `body`: one streamed after
        the head, which must announce its length) and wait for the response head; raises
        TargetError or OSError. A response whose Content-Length is at most `whole_limit` is
        read whole first (its `body`): one wake-up per small exchange instead of a head, then
        body chunks."""
        for attempt in (0, 1):
            fresh = not self._idle
            conn = self._idle.pop() if self._idle else await self._connect()
            head = conn.start(head_request, whole_limit)
            transport = conn.transport
            assert transport is not None
            try:
                transport.write(data)
                if body is not None:
                    # the body goes out beside the response: a target that answers while it
                    # reads (an echo, a proxy) must not wait for us to read its answer first
                    conn.sender = asyncio.get_running_loop().create_task(conn.send_body(body))
                status, response_headers, whole = await head
            except TargetError:
                # a kept-alive connection the target had closed: once more on a new one
                if fresh or body is not None or conn.received_any or attempt:
                    raise
                continue
            except BaseException:
                # cancelled (the connector's target timeout) or failed: nobody will read a
                # late answer on this connection, so it must not be reused or leaked
                conn.abandon()
                raise
            return TargetReply(self, conn, status, response_headers, whole)
        raise TargetError("unreachable")  # pragma: no cover

    def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
