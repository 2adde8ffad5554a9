"""A lean Redis client for the msgbus: commands pipelined on one asyncio connection, replies
parsed by hiredis (C).

Why not redis-py: rmb-peer moves every message through Redis two or three times, and redis-py
spends about 24 us of Python per pipelined command and 150 us per awaited one on this machine,
more than the rest of a message's work. Here a batch of commands is one `transport.write` and
one future, and hiredis parses the replies: about 2 us per command (measured with 20,000
LPUSH+LTRIM pairs against a local redis-server: 4 us a pair, redis-py 49 us).

Commands sent during one event-loop turn (by any number of callers) leave in one write at its
end, or as soon as FLUSH_AT of them are waiting. Only what the msgbus needs: RESP2 commands as
byte tuples, `redis://[user:password@]host[:port][/db]` URLs, and failure as
`RedisUnavailable`. A `RespClient` connects lazily and reconnects on the next call after its
connection is lost; blocking pops get their own client (`blocking()`) so they never hold up
the pipeline. Replies are hiredis's: bytes, int, None, lists; an error reply inside a pipeline
is a `hiredis.ReplyError` in the list, and `execute` raises it as RedisUnavailable.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis

from rmb_relay.errors import ConfigError, RedisUnavailable

__all__ = ["Command", "RespClient", "encode_command", "parse_redis_url"]

Command = Sequence[bytes | str | int]

#: how long a connection attempt may take
CONNECT_TIMEOUT = 5.0
#: commands queued in one loop turn that are written at once rather than at the turn's end
FLUSH_AT = 32


def encode_command(command: Command) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse_redis_url(url: str) -> tuple[str, int, int, str | None, str | None]:
    """(host, port, db, username, password) of `redis://[user:password@]host[:port][/db]`."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ConfigError(f"redis URL must be redis://HOST[:PORT][/DB], got {url!r}")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ConfigError(f"redis URL database must be a number, got {path!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ConfigError(f"redis URL has a bad port: {url!r}") from None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return parts.hostname or "localhost", port, int(path or 0), username, password


class _Protocol(asyncio.Protocol):
    """Replies are matched to batches in order: each batch is (future, reply count, replies)."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.batches: deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = deque()
        self.transport: asyncio.Transport | None = None
        self.error: RedisUnavailable | None = None
        #: commands of every batch sent during this loop turn: written at its end, in one call
        self._out: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop: not a subclass

    def data_received(self, data: bytes) -> None:
        reader, batches = self.reader, self.batches
        try:
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                future, count, replies = batches[0]
                replies.append(reply)
                if len(replies) == count:
                    batches.popleft()
                    if not future.done():
                        future.set_result(replies)
        except (hiredis.ProtocolError, IndexError) as err:
            self._fail(RedisUnavailable(f"unexpected data from redis: {err}"))
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisUnavailable(f"connection to redis lost: {exc or 'closed'}"))

    def _fail(self, error: RedisUnavailable) -> None:
        self.error = error
        while self.batches:
            future = self.batches.popleft()[0]
            if not future.done():
                future.set_exception(error)

    def send(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]]:
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        transport = self.transport
        if self.error is not None or transport is None or transport.is_closing():
            future.set_exception(self.error or RedisUnavailable("connection to redis closed"))
            return future
        self.batches.append((future, len(commands), []))
        out = self._out
        if not out:
            asyncio.get_running_loop().call_soon(self._flush)
        out.extend(map(encode_command, commands))
        if len(out) >= FLUSH_AT:  # enough for one write: do not hold it to the turn's end
            self._flush()
        return future

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))


class RespClient:
    """One lazily (re)connected Redis connection; see the module docstring."""

    def __init__(self, url: str, *, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.url = url
        self.host, self.port, self.db, self.username, self.password = parse_redis_url(url)
        self.connect_timeout = connect_timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        self._closed = False

    async def _connection(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.error is None:
            return protocol
        if self._closed:
            raise RedisUnavailable("redis client closed")
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(_Protocol, self.host, self.port)
                setup: list[Command] = []
                if self.password is not None:
                    auth = (self.username, self.password) if self.username else (self.password,)
                    setup.append((b"AUTH", *auth))
                if self.db:
                    setup.append((b"SELECT", self.db))
                if setup:
                    for reply in await protocol.send(setup):
                        if isinstance(reply, hiredis.ReplyError):
                            if protocol.transport is not None:
                                protocol.transport.close()
                            raise RedisUnavailable(f"redis refused the connection setup: {reply}")
        except (OSError, TimeoutError) as err:
            raise RedisUnavailable(
                f"cannot reach redis at {self.host}:{self.port}: {err or 'timed out'}"
            ) from None
        self._protocol = protocol
        return protocol

    def send_now(self, commands: Sequence[Command]) -> asyncio.Future[list[Any]] | None:
        """`pipeline` without a coroutine, when connected (None otherwise): for a writer
        that sends every loop turn and only wants a callback with the replies."""
        protocol = self._protocol
        if protocol is None or protocol.error is not None:
            return None
        return protocol.send(commands)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Every command in one write; their replies in order (error replies included as
        hiredis.ReplyError). Raises RedisUnavailable if the connection fails."""
        if not commands:
            return []
        protocol = await self._connection()
        return await protocol.send(commands)

    async def execute(self, command: Command) -> Any:
        """One command's reply; an error reply raises RedisUnavailable."""
        (reply,) = await self.pipeline((command,))
        if isinstance(reply, hiredis.ReplyError):
            raise RedisUnavailable(f"redis error on {command[0]!r}: {reply}")
        return reply

    def blocking(self) -> RespClient:
        """Another client on the same server, for commands that block (BRPOP)."""
        return RespClient(self.url, connect_timeout=self.connect_timeout)

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
