"""The connector (`rmb-relay connector`, decision 9): holds an outbound websocket to a relay and
runs the requests it receives against local targets.

Loop: get a token (`POST /tunnel/token`, client credentials), open `GET /tunnel/connector`,
serve until the socket closes, then reconnect: at once the first time, then after a random
delay in [min, max] (RelayServer's thundering-herd protection; the relay's `Configure` message
sets the range). The websocket is our own client (`sdk/websocket.py`, frames built by the Rust
core), kept alive as every client of ours is: a ping after 15 s of silence either way, the
connection dropped (and the reconnect begun) after 45 s with nothing heard. HTTP to the relay
(token, body side channels) goes through one aiohttp session.

Every request takes one path. The Rust core (`TunnelConnectorCore`,
rust/dialects/tunnel/connector.rs) reads each `RequestTarget` of a websocket read and makes
every decision: expired work is dropped, an unknown target answered 404, a ConnectorReceived
request acknowledged, the target's request built; then `Deliver` and any ConnectorFinished
`Acknowledge` when the answer or the failure comes. This module does the I/O the decisions
need: a request for a web target over plain HTTP goes out on an idle kept-alive connection at
once and, when the target's bytes are one whole answer, is delivered from that connection's
read without a task (`Exchange`); anything else (no idle connection, a body to fetch from the
relay, a streamed or large answer to upload, any other target: `$ping`, `$echo`, https, a
user's own) runs in a task. The target timeout is one sweep over the requests waiting for an
answer, not a timer each. Everything a loop turn queues goes out in one websocket write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp

from rmb_relay._core import TunnelConnectorCore, TunnelRequest, WsDecoder, WsEvent, WsMessage
from rmb_relay.clock import Clock, monotonic_clock, nanos
from rmb_relay.dialects.tunnel.httpclient import (
    Head,
    HttpClientPool,
    TargetConnection,
    TargetReply,
)
from rmb_relay.dialects.tunnel.settings import INLINE_LIMIT
from rmb_relay.dialects.tunnel.targets import (
    Body,
    EchoTarget,
    PingTarget,
    Reply,
    Target,
    WebTarget,
    reply_of,
)
from rmb_relay.dialects.tunnel.wire import (
    ClientRequest,
    ErrorMessage,
    TenantConfig,
    WireError,
    decode,
)
from rmb_relay.errors import ConnectionClosed, HandshakeError
from rmb_relay.sdk.websocket import WebSocketClient

log = logging.getLogger("rmb_relay.connector")

#: RelayServer's default target timeout (seconds)
DEFAULT_TARGET_TIMEOUT = 100.0
CHUNK = 256 * 1024
#: ping the relay after this much silence either way; give it up after this long unheard
PING_AFTER = 15.0
DEAD_AFTER = 45.0
KEEPALIVE_TICK = 5.0


def reconnect_delay(attempt: int, low: float, high: float, rng: random.Random) -> float:
    """Seconds before reconnect attempt `attempt` (1 = the first after a loss): at once, then a
    random time in [low, high] so that connectors a relay lost together do not all return in
    the same second (RelayServer's DiscoveryDocumentRetryPolicy)."""
    return 0.0 if attempt <= 1 else rng.uniform(low, high)


class Exchange:
    """One request the core handed over, until its answer. While it waits for the target's
    answer head it is in the connector's `_waiting` set, whose sweep times it out. On a
    kept-alive connection (`conn`) it is that connection's callback: `delivered` when the core
    answered from the read, `__call__` for anything else; in a task (`task`) the task ends it."""

    __slots__ = ("clock", "conn", "connector", "core", "deadline", "pool", "request", "task")

    def __init__(
        self,
        connector: Connector,
        core: TunnelConnectorCore,
        request: TunnelRequest,
        pool: HttpClientPool | None,
        deadline: int,
    ) -> None:
        self.connector = connector
        self.core = core
        self.request = request
        self.pool = pool
        self.clock = connector.clock
        self.deadline = deadline
        self.conn: TargetConnection | None = None
        self.task: asyncio.Task[None] | None = None

    def delivered(self, conn: TargetConnection) -> None:
        """The core delivered the whole answer from the connection's read."""
        connector = self.connector
        connector._waiting.discard(self)
        connector.answers_without_task += 1
        assert self.pool is not None
        self.pool.put_back(conn)
        connector._schedule_flush()

    def __call__(self, conn: TargetConnection, head: Head | None, err: Exception | None) -> None:
        """Any other outcome on the connection: a failure, or a head whose body is not whole."""
        connector, pool = self.connector, self.pool
        assert pool is not None
        self.conn = None
        if head is None:
            if not conn.received_any:
                # maybe a kept-alive connection the target had closed: once more, in a task
                connector._spawn(self, connector._run(self))
                return
            connector._waiting.discard(self)
            log.info("connector: target of %s failed: %s", self.request.request_id, err)
            connector._fail(self, timed_out=False)
            return
        connector._waiting.discard(self)
        status, headers, body = head
        if body is not None:
            pool.put_back(conn)
            connector._answer(self, status, headers, body, len(body))
            return
        # a large or streamed answer: a task reads it and uploads it if it is large
        connector._spawn(self, connector._finish(self, TargetReply(pool, conn, status, headers)))

    def time_out(self) -> None:
        """No answer within the target timeout: 504, and the request's work stops."""
        self.connector._waiting.discard(self)
        if self.task is not None:
            self.task.cancel(msg=TIMED_OUT)  # `_run` answers
            return
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.detach()
            conn.abandon()
        self.connector._fail(self, timed_out=True)


#: the cancel message of a task the target timeout stopped
TIMED_OUT = "target timeout"


class Connector:
    def __init__(
        self,
        server: str,
        tenant: str,
        secret: str,
        targets: dict[str, Target],
        *,
        binary: bool = False,
        target_timeout: float = DEFAULT_TARGET_TIMEOUT,
        reconnect: tuple[float, float] = (1.0, 30.0),
        rng: random.Random | None = None,
        clock: Clock = monotonic_clock,
    ) -> None:
        self.server = server.rstrip("/")
        self.tenant = tenant
        self.secret = secret
        self.targets = {"$PING": PingTarget(), "$ECHO": EchoTarget()}
        self.targets.update({name.upper(): target for name, target in targets.items()})
        self.binary = binary
        self.target_timeout = target_timeout
        self.reconnect = reconnect
        self.rng = rng or random.Random()
        self.clock = clock
        #: answers the core delivered from a target connection's read, without a task
        self.answers_without_task = 0
        #: set while a websocket is open (tests and the CLI wait on it)
        self.connected = asyncio.Event()
        #: requests received from the relay (tests count which connector got them)
        self.requests_received = 0
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: WebSocketClient | None = None
        #: a `_flush` is scheduled for this loop turn
        self._flush_pending = False
        #: the loop `run` runs on (`asyncio.get_running_loop()` per request was measurable)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the decisions for the current websocket (a new core per connection)
        self._core: TunnelConnectorCore | None = None
        #: the targets by the index the core gives, and the lean pools of plain-http ones
        self._by_index: list[Target] = list(self.targets.values())
        self._pools: list[HttpClientPool | None] = [
            target.pool if isinstance(target, WebTarget) else None for target in self._by_index
        ]
        self._tasks: set[asyncio.Task[None]] = set()
        #: requests waiting for their target's answer (their deadlines: `_sweep`)
        self._waiting: set[Exchange] = set()
        self._stopping = False
        #: set by `stop`: ends the wait between reconnects at once
        self._stop = asyncio.Event()

    # ---- connection ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect and serve until `stop()`; reconnects on its own."""
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._loop = loop = asyncio.get_running_loop()
        sweep = loop.create_task(self._sweep())
        attempt = 0
        try:
            while not self._stopping:
                try:
                    await self._connect_and_serve()
                    attempt = 0
                except (
                    aiohttp.ClientError,
                    OSError,
                    WireError,
                    HandshakeError,
                    ConnectionClosed,
                ) as err:
                    log.warning("connector: %s", err)
                    attempt += 1
                if self._stopping:
                    break
                low, high = self.reconnect
                delay = reconnect_delay(attempt, low, high, self.rng)
                log.info("connector: reconnecting in %.1f s", delay)
                # not a plain sleep: a SIGTERM during the delay (up to the reconnect maximum)
                # must end the connector now, not when the delay is over
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                attempt = max(attempt, 1)
        finally:
            sweep.cancel()
            for task in list(self._tasks):
                task.cancel()
            # shielded: a cancel of `run` itself must not leave sessions and sockets open
            await asyncio.shield(self._close(self._session))

    async def _close(self, session: aiohttp.ClientSession) -> None:
        await session.close()
        for target in self.targets.values():
            await target.close()

    async def stop(self) -> None:
        self._stopping = True
        self._stop.set()
        if self._ws is not None:
            await self._ws.close()

    async def _fetch_token(self) -> str:
        assert self._session is not None
        form = {
            "grant_type": "client_credentials",
            "client_id": self.tenant,
            "client_secret": self.secret,
            "scope": "connector",
        }
        async with self._session.post(f"{self.server}/tunnel/token", data=form) as reply:
            payload = await reply.json(content_type=None)
            if reply.status != 200:
                raise aiohttp.ClientError(f"token refused ({reply.status}): {payload}")
            token = payload["access_token"]
            assert isinstance(token, str)
            return token

    async def _connect_and_serve(self) -> None:
        assert self._session is not None
        self._token = await self._fetch_token()
        url = "ws" + self.server.removeprefix("http") + "/tunnel/connector"
        if self.binary:
            url += "?protocol=msgpack"
        # the core first: messages in the upgrade's own read reach `_on_ws_message` at once
        self._core = self._make_core()
        try:
            ws = await WebSocketClient.connect(
                url,
                headers=[("Authorization", f"Bearer {self._token}")],
                max_message=1 << 20,
                on_message=self._on_ws_message,
            )
        except BaseException:
            self._core = None
            raise
        self._ws = ws
        ws.on_data = self._on_ws_data
        if self._stopping:  # stop() came while we connected
            await ws.close()
            return
        self.connected.set()
        keepalive = asyncio.get_running_loop().create_task(self._keepalive(ws))
        try:
            await ws.closed
        finally:
            keepalive.cancel()
            self.connected.clear()
            self._ws = None
            self._core = None

    def _make_core(self) -> TunnelConnectorCore:
        """The decisions for a new websocket: every target by its `str.upper()` name (as
        requests match them), with the Host and base path of the plain-http web targets."""
        targets: list[tuple[str, tuple[str, str] | None]] = []
        for (name, target), pool in zip(self.targets.items(), self._pools, strict=True):
            web = None
            if pool is not None and isinstance(target, WebTarget):
                web = (pool.host_header, target.prefix)
            targets.append((name, web))
        return TunnelConnectorCore(self.binary, os.urandom(32), self.server, INLINE_LIMIT, targets)

    async def _sweep(self) -> None:
        """Answer 504 for requests past their target timeout. Checked a tenth of the timeout
        apart (at most 1 s, at least 10 ms): a request times out up to that much late, and no
        timer is armed per request."""
        tick = min(1.0, max(0.01, self.target_timeout / 10))
        while True:
            await asyncio.sleep(tick)
            if self._waiting:
                now = self.clock()
                for exchange in [x for x in self._waiting if x.deadline <= now]:
                    exchange.time_out()

    async def _keepalive(self, ws: WebSocketClient) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_TICK)
            if not ws.keepalive(nanos(PING_AFTER), nanos(DEAD_AFTER)):
                log.warning("connector: relay silent for %.0f s: reconnecting", DEAD_AFTER)
                return

    # ---- messages --------------------------------------------------------------------------

    def _on_ws_data(self, decoder: WsDecoder, data: memoryview) -> list[WsEvent]:
        """A websocket read (`WebSocketClient.on_data`): deframed, and its requests read and
        decided, in one Rust call; every other event is left to the client (a message then
        reaches `_on_ws_message`)."""
        core = self._core
        if core is None:
            return decoder.feed(data)
        items = core.feed_ws(decoder, data, self.clock())
        left: list[WsEvent] = []
        for item in items:
            if type(item) is TunnelRequest:
                self._start(core, item)
            else:
                left.append(item)
        if core.has_output:  # (answers and acknowledgements the core made itself)
            self._schedule_flush()
        return left

    def _on_ws_message(self, message: WsMessage) -> None:
        data = message.data
        core = self._core
        request = core.request(data, self.clock()) if core is not None else None
        if request is not None:
            assert core is not None
            self._start(core, request)
            if core.has_output:
                self._schedule_flush()
            return
        try:
            decoded = decode(data, self.binary, (ClientRequest, TenantConfig, ErrorMessage))
        except WireError as err:
            log.warning("connector: bad message from the relay: %s", err)
            return
        if isinstance(decoded, TenantConfig):
            self.reconnect = (decoded.reconnect_minimum_delay, decoded.reconnect_maximum_delay)
        elif isinstance(decoded, ErrorMessage):
            log.warning("connector: the relay refused a message: %s", decoded.message)

    def _schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """This loop turn's messages in one write."""
        self._flush_pending = False
        ws, core = self._ws, self._core
        if ws is None or not ws.is_open or core is None or not core.has_output:
            return  # (after a loss the relay redelivers what was not acknowledged)
        with contextlib.suppress(ConnectionClosed):
            ws.send_frames(core.take_output())

    # ---- requests --------------------------------------------------------------------------

    def _start(self, core: TunnelConnectorCore, request: TunnelRequest) -> None:
        """Run a request the core handed over: on an idle kept-alive connection of its web
        target when it has its body in hand, else in a task."""
        self.requests_received += 1
        refused = request.refused
        if refused is not None:  # answered (404, 502) or dropped (expired) by the core
            log.info("connector: request %s %s", request.request_id, refused)
            return
        index = request.target
        pool = self._pools[index]
        exchange = Exchange(self, core, request, pool, self.clock() + nanos(self.target_timeout))
        self._waiting.add(exchange)
        if pool is not None and not request.outsourced:
            conn = pool.take_idle()
            if conn is not None:
                wire = request.wire
                assert wire is not None
                assert conn.transport is not None
                exchange.conn = conn
                conn.start_exchange(exchange, INLINE_LIMIT)
                conn.transport.write(wire)
                return
        self._spawn(exchange, self._run(exchange))

    def _spawn(self, exchange: Exchange, work: Coroutine[Any, Any, None]) -> None:
        exchange.task = task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        """A request in a task: its target's answer within the timeout (504 beyond it), any
        failure a 502, then the answer delivered."""
        request = exchange.request
        try:
            reply = await self._call(exchange)
        except asyncio.CancelledError as err:
            task = asyncio.current_task()
            if err.args == (TIMED_OUT,) and task is not None and task.uncancel() == 0:
                self._fail(exchange, timed_out=True)
                return
            raise
        except Exception as err:
            self._waiting.discard(exchange)
            if isinstance(err, (aiohttp.ClientError, OSError)):  # TargetError is an OSError
                log.info("connector: target of %s failed: %s", request.request_id, err)
            else:
                log.exception("connector: target of %s failed", request.request_id)
            self._fail(exchange, timed_out=False)
            return
        self._waiting.discard(exchange)
        await self._deliver(exchange, reply)

    async def _call(self, exchange: Exchange) -> Reply:
        """The target's answer: the core's request bytes on a plain-http web target's pool,
        else the target's `call`."""
        request = exchange.request
        pool = exchange.pool
        if pool is not None:
            wire = request.wire
            assert wire is not None
            body = self._download(request) if request.outsourced else None
            reply = await pool.request(wire, request.head, body, whole_limit=INLINE_LIMIT)
            return await reply_of(reply)
        target = self._by_index[request.target]
        content: Body = self._download(request) if request.outsourced else request.body
        return await target.call(
            request.method, request.url, request.headers, content, request.body_size
        )

    async def _finish(self, exchange: Exchange, reply: TargetReply) -> None:
        """An answer whose head came on a kept-alive connection and whose body did not."""
        try:
            whole = await reply_of(reply)
        except OSError as err:
            log.info("connector: target of %s failed: %s", exchange.request.request_id, err)
            reply.release()
            self._fail(exchange, timed_out=False)
            return
        await self._deliver(exchange, whole)

    async def _deliver(self, exchange: Exchange, reply: Reply) -> None:
        """The answer: inline, or its body uploaded first when the core says so."""
        request = exchange.request
        try:
            body = reply.body
            length = len(body) if isinstance(body, bytes) else None
            if not exchange.core.uploads(request, length):
                inline = body if isinstance(body, bytes) else None
                self._answer(exchange, reply.status, reply.headers, inline, length or 0)
            else:
                try:
                    size = await self._upload(request, body)
                except (aiohttp.ClientError, OSError) as err:
                    log.info("connector: upload of %s failed: %s", request.request_id, err)
                    self._fail(exchange, timed_out=False)
                else:
                    self._answer(exchange, reply.status, reply.headers, None, size)
        except Exception:
            log.exception("connector: request %s failed", request.request_id)
            self._fail(exchange, timed_out=False)
        finally:
            reply.done()
        ws = self._ws
        if ws is not None and ws.congested:
            await ws.drain()

    def _answer(
        self,
        exchange: Exchange,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes | None,
        size: int,
    ) -> None:
        exchange.core.answer(exchange.request, status, headers, body, size, self.clock())
        self._schedule_flush()

    def _fail(self, exchange: Exchange, *, timed_out: bool) -> None:
        exchange.core.fail(exchange.request, timed_out, self.clock())
        self._schedule_flush()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    async def _download(self, request: TunnelRequest) -> AsyncIterator[bytes]:
        """An outsourced request body from the relay's body store, as the target reads it."""
        assert self._session is not None
        delete = "true" if request.delete_body else "false"
        url = f"{self.server}/tunnel/body/request/{request.request_id}?delete={delete}"
        async with self._session.get(url, headers=self._auth()) as reply:
            if reply.status != 200:
                raise aiohttp.ClientError(f"request body not available ({reply.status})")
            async for chunk in reply.content.iter_chunked(CHUNK):
                yield chunk

    async def _upload(self, request: TunnelRequest, body: Body) -> int:
        """A response body into the relay's body store; its size as the relay counted it."""
        assert self._session is not None
        url = f"{self.server}/tunnel/body/response/{request.request_id}"
        data: Any = body
        async with self._session.post(url, data=data, headers=self._auth()) as reply:
            text = await reply.text()
            if reply.status != 200:
                raise aiohttp.ClientError(f"response body refused ({reply.status}): {text}")
            return int(text)
