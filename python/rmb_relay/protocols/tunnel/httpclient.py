"""A lean HTTP/1.1 client for the connector's web targets: keep-alive connections per target,
request heads encoded and response heads parsed in Rust (`encode_request`,
`parse_response_head`), bodies read as they arrive.

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
from typing import cast

from rmb_relay._core import HttpParseError, encode_request, parse_response_head

__all__ = ["HttpClientPool", "TargetError", "TargetReply"]

#: a response head as the connection hands it over: status, headers, and the whole body when
#: it was small enough to be read with the head (else None: read it from the connection)
Head = tuple[int, list[tuple[str, bytes]], bytes | None]
#: `HttpClientPool.try_send`'s callback: the head (with the whole body when small), or the error
OnHead = Callable[["_Connection", Head | None, Exception | None], None]

#: unread response bytes above which the connection stops reading (and under half resumes)
BUFFER_LIMIT = 256 * 1024
#: a response head larger than this is refused
MAX_HEAD = 64 * 1024
#: idle keep-alive connections kept per target
MAX_IDLE = 64


class TargetError(ConnectionError):
    """The target broke the connection or sent something that is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One connection; reads one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: asyncio.Future[Head] | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        #: 'idle', 'head', 'length', 'whole', 'chunk-size', 'chunk-data', 'chunk-crlf',
        #: 'trailers', 'eof'
        self.state = "idle"
        #: a Content-Length body up to this size is read whole before the head is handed over
        self.whole_limit = 0
        #: the head held back while its body is read whole
        self.held: tuple[int, list[tuple[str, bytes]]] | None = None
        self.remaining = 0
        self.no_body = False
        self.done = False
        self.reusable = False
        self.error: Exception | None = None
        self.closed = False
        self.received_any = False
        self._writable = asyncio.Event()
        self._writable.set()
        #: the task streaming the current request's body, if any
        self.sender: asyncio.Task[None] | None = None
        #: told the head instead of `head` (a request sent with `try_send`)
        self.on_head: OnHead | None = None

    # ---- asyncio -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.buffer += data
        try:
            self._process()
        except TargetError as err:
            self._fail(err)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._writable.set()
        if self.state == "eof":
            self.done = True
            self._wake()
        elif not self.done:
            self._fail(TargetError(f"target closed the connection ({exc or 'EOF'})"))

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # ---- response parsing ----------------------------------------------------------------

    def start(
        self, method: str, whole_limit: int = 0, on_head: OnHead | None = None
    ) -> asyncio.Future[Head] | None:
        """Expect a response: its head resolves the returned future, or goes to `on_head`."""
        self.on_head = on_head
        self.head = None if on_head is not None else asyncio.get_running_loop().create_future()
        self.state = "head"
        self.whole_limit = whole_limit
        self.no_body = method == "HEAD"
        self.done = False
        self.reusable = False
        self.received_any = False
        return self.head

    def _process(self) -> None:
        buffer = self.buffer
        while buffer or self.state == "eof":
            state = self.state
            if state == "head":
                try:
                    parsed = parse_response_head(bytes(buffer))
                except HttpParseError as err:
                    raise TargetError(f"malformed target response: {err}") from None
                if parsed is None:
                    if len(buffer) > MAX_HEAD:
                        raise TargetError("target response head too large")
                    return
                status, headers, length = parsed
                del buffer[:length]
                if 100 <= status < 200:
                    continue  # an interim response: the real one follows
                self._framing(status, headers)
                if self.state == "length" and self.remaining <= self.whole_limit:
                    # a small body: hand it over with the head (no stream, no waiter)
                    self.held = (status, headers)
                    self.state = "whole"
                else:
                    self._head_ready((status, headers, None))
            elif state == "whole":
                if len(buffer) < self.remaining:
                    return
                body = bytes(buffer[: self.remaining])
                del buffer[: self.remaining]
                self.remaining = 0
                self.state = "idle"
                self.done = True
                held, self.held = self.held, None
                if held is not None:
                    self._head_ready((held[0], held[1], body))
            elif state == "length":
                take = min(len(buffer), self.remaining)
                self._push(bytes(buffer[:take]))
                del buffer[:take]
                self.remaining -= take
                if not self.remaining:
                    self._finish()
            elif state == "chunk-size":
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 4096:
                        raise TargetError("chunk size line too long")
                    return
                try:
                    size = int(bytes(buffer[:end]).split(b";")[0].strip(), 16)
                except ValueError:
                    raise TargetError("malformed chunk size") from None
                del buffer[: end + 2]
                self.remaining = size
                self.state = "chunk-data" if size else "trailers"
            elif state == "chunk-data":
                take = min(len(buffer), self.remaining)
                self._push(bytes(buffer[:take]))
                del buffer[:take]
                self.remaining -= take
                if not self.remaining:
                    self.state = "chunk-crlf"
            elif state == "chunk-crlf":
                if len(buffer) < 2:
                    return
                if buffer[:2] != b"\r\n":
                    raise TargetError("chunk data not followed by CRLF")
                del buffer[:2]
                self.state = "chunk-size"
            elif state == "trailers":
                if buffer[:2] == b"\r\n":
                    del buffer[:2]
                    self._finish()
                else:
                    end = buffer.find(b"\r\n\r\n")
                    if end < 0:
                        return
                    del buffer[: end + 4]
                    self._finish()
            elif state == "eof":
                if buffer:
                    self._push(bytes(buffer))
                    buffer.clear()
                return
            else:  # idle: bytes nobody asked for
                raise TargetError("target sent data without a request")

    def _head_ready(self, head: Head) -> None:
        on_head, self.on_head = self.on_head, None
        if on_head is not None:
            on_head(self, head, None)
        elif self.head is not None and not self.head.done():
            self.head.set_result(head)

    def _framing(self, status: int, headers: list[tuple[str, bytes]]) -> None:
        keep = True
        chunked = False
        length: int | None = None
        for name, value in headers:
            if name == "content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise TargetError("malformed Content-Length") from None
            elif name == "transfer-encoding":
                chunked = value.strip().lower().endswith(b"chunked")
            elif name == "connection" and b"close" in value.lower():
                keep = False
        self.reusable = keep
        if self.no_body or status in (204, 304):
            self._finish()
        elif chunked:
            self.state = "chunk-size"
        elif length is not None:
            self.remaining = length
            self.state = "length"
            if not length:
                self._finish()
        else:
            self.state = "eof"
            self.reusable = False

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
        self.state = "idle"
        self.done = True
        self._wake()

    def _fail(self, err: Exception) -> None:
        self.error = err
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
        conn: _Connection,
        status: int,
        headers: list[tuple[str, bytes]],
        body: bytes | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        #: the whole body when it was read with the head (`request(whole_limit=...)`)
        self.body = body
        self._pool = pool
        self._conn: _Connection | None = conn

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


def _streamed_head(method: str, target: str, headers: list[tuple[str, str]], length: int) -> bytes:
    """A request head for a body sent after it (`encode_request` computes Content-Length from
    a body it holds; this one is streamed)."""
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
            raise TargetError(f"header {name!r} cannot be sent")
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpClientPool:
    """Keep-alive connections to one target (host, port)."""

    def __init__(self, host: str, port: int, host_header: str) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header
        self._idle: list[_Connection] = []

    def put_back(self, conn: _Connection) -> None:
        sender, conn.sender = conn.sender, None
        sent = sender is None or (sender.done() and not sender.cancelled())
        if sender is not None and not sender.done():
            sender.cancel()  # the answer came before the whole body went: drop the connection
        usable = sent and conn.done and conn.reusable and not conn.closed and not conn.chunks
        if usable and len(self._idle) < MAX_IDLE:
            conn.state = "idle"
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def try_send(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        whole_limit: int,
        on_head: OnHead,
    ) -> _Connection | None:
        """The callback form of `request` for a body in hand, on a kept-alive connection:
        sends at once and returns the connection, whose `on_head` is called from
        `data_received` with the head (and the whole body up to `whole_limit`) or the error;
        no task or future per exchange. None when no idle connection is at hand (use
        `request`). The caller puts the connection back (`put_back`) once it has the body,
        and retries with `request` an error on a connection that had received nothing (a
        kept-alive connection the target had closed)."""
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                break
            conn.abandon()  # the target closed it while it was idle
        else:
            return None
        conn.start(method, whole_limit, on_head)
        assert conn.transport is not None
        conn.transport.write(
            encode_request(method, target, [("Host", self.host_header), *headers], body)
        )
        return conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_Connection, self.host, self.port)
        return protocol

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes | AsyncIterator[bytes],
        length: int,
        whole_limit: int = 0,
    ) -> TargetReply:
        """Send the request and wait for the response head; raises TargetError or OSError. A
        response whose Content-Length is at most `whole_limit` is read whole first (its
        `body`): one wake-up per small exchange instead of a head, then body chunks."""
        headers = [("Host", self.host_header), *headers]
        streamed = not isinstance(body, bytes)
        for attempt in (0, 1):
            fresh = not self._idle
            conn = self._idle.pop() if self._idle else await self._connect()
            head = conn.start(method, whole_limit)
            assert head is not None
            transport = conn.transport
            assert transport is not None
            try:
                if isinstance(body, bytes):
                    transport.write(encode_request(method, target, headers, body))
                else:
                    # the body goes out beside the response: a target that answers while it
                    # reads (an echo, a proxy) must not wait for us to read its answer first
                    transport.write(_streamed_head(method, target, headers, length))
                    conn.sender = asyncio.get_running_loop().create_task(conn.send_body(body))
                status, response_headers, whole = await head
            except TargetError:
                # a kept-alive connection the target had closed: once more on a new one
                if fresh or streamed or conn.received_any or attempt:
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
