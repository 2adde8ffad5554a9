"""The connector (`rmb-relay connector`, decision 9): holds an outbound websocket to a relay and
runs the requests it receives against local targets.

Loop: get a token (`POST /tunnel/token`, client credentials), open `GET /tunnel/connector`,
serve until the socket closes, then reconnect: at once the first time, then after a random
delay in [min, max] (RelayServer's thundering-herd protection; the relay's `Configure` message
sets the range). The websocket is our own client (`sdk/websocket.py`, frames built by the Rust
core), kept alive as every client of ours is: a ping after 15 s of silence either way, the
connection dropped (and the reconnect begun) after 45 s with nothing heard. HTTP to the relay
(token, body side channels) goes through one aiohttp session.

Each `RequestTarget` runs as its own task (spec §6): refuse it when its `expiresIn` ran out,
find the target (404 when there is none), fetch an outsourced body from the relay while the
target reads it, run the target within `target_timeout` (504) catching its failures (502),
answer inline up to 16 KiB or upload the body with `POST /tunnel/body/response/{id}`, and
`Deliver`. Acknowledgements follow the request's mode (hub.py). The common small request
(mode 0, no tracing, a body in hand, a web target with an idle kept-alive connection) skips
the task: it is sent from the websocket callback and delivered from the target connection's
callback (`_start_fast`), with the same outcomes; with the native core (`_start_native`)
modes 1 and 2 skip it too, acknowledged by the core (mode 1 when the request comes, mode 2
after its `Deliver`) or after the `Deliver` that ends the exchange in Python. The `Deliver`s
and `Acknowledge`s of a loop turn go out in one websocket write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp

from rmb_relay._core import TunnelConnectorCore, WsDecoder, WsEvent, WsMessage
from rmb_relay.clock import nanos
from rmb_relay.dialects.tunnel.httpclient import (
    Head,
    HttpClientPool,
    TargetError,
    TargetReply,
    _Connection,
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
    AcknowledgeRequest,
    ClientRequest,
    ErrorMessage,
    TargetResponse,
    TenantConfig,
    WireError,
    decode,
    encode,
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


def _cancel_for_timeout(task: asyncio.Task[None], fired: list[bool]) -> None:
    """The target timeout: cancel the request's task and say why (`_run` answers 504)."""
    fired.append(True)
    task.cancel()


class _FastExchange:
    """One request of the task-less path in flight (`Connector._start_fast`, or the native
    `_start_native`): the target connection's callback. Its target timeout is a deadline
    checked by the connector's sweep (`_sweep_fast`), not a timer of its own: arming and
    cancelling a loop timer per request cost more than the rest of the callback.

    A native exchange keeps the message's bytes and ids instead of a decoded request: the
    whole answer is delivered by the Rust core (`delivered`), and only the uncommon outcomes
    (a streamed answer, a failure, the timeout) decode the message, in Python."""

    __slots__ = (
        "ack_origin_id",
        "conn",
        "connector",
        "core",
        "deadline",
        "over",
        "payload",
        "pool",
        "received",
        "request",
        "request_id",
        "request_origin_id",
    )

    def __init__(
        self,
        connector: Connector,
        request: ClientRequest | None,
        received: float,
        pool: HttpClientPool | None = None,
    ) -> None:
        self.connector = connector
        self.request = request
        self.received = received
        self.deadline = received + connector.target_timeout
        self.pool = pool
        self.conn: _Connection | None = None
        #: answered (or timed out): a late callback is ignored
        self.over = False
        # the native path's (set by `_start_native`)
        self.core: TunnelConnectorCore
        self.payload = b""
        self.request_id = ""
        self.request_origin_id = ""
        #: a ConnectorFinished request's acknowledgement origin (None: no acknowledgement
        #: after the answer; ConnectorReceived's went out when the request came)
        self.ack_origin_id: str | None = None

    def _request(self) -> ClientRequest:
        """The request, decoded from the message when the native path took it."""
        request = self.request
        if request is None:
            request = self.request = decode(self.payload, self.connector.binary, (ClientRequest,))
        return request

    def delivered(self, conn: _Connection) -> None:
        """The native core delivered the whole answer: the connection goes back, the frame
        out with this loop turn's write."""
        self.over = True
        connector = self.connector
        connector._fast.discard(self)
        connector.native_delivered += 1
        assert self.pool is not None
        self.pool.put_back(conn)
        connector._schedule_flush()

    def __call__(self, conn: _Connection, head: Head | None, err: Exception | None) -> None:
        if self.over:
            return
        self.over = True
        connector, pool = self.connector, self.pool
        connector._fast.discard(self)
        request = self._request()
        assert pool is not None
        if head is None:
            if not conn.received_any:
                # maybe a kept-alive connection the target had closed: the task path retries
                connector._start_task(request, self.received)
                return
            log.info("connector: target of %s failed: %s", request.request_id, err)
            connector._deliver_now(request, Reply(502))
            return
        status, headers, body = head
        if body is not None:
            pool.put_back(conn)
            connector._deliver_small(request, status, headers, body)
            return
        # a large or streamed answer: a task reads it as WebTarget.call does, then uploads
        # it if it is large
        task = asyncio.get_running_loop().create_task(
            connector._deliver_target_reply(
                request, TargetReply(pool, conn, status, headers), self.received
            )
        )
        connector._tasks.add(task)
        task.add_done_callback(connector._tasks.discard)

    def time_out(self) -> None:
        """The target took longer than `target_timeout`: 504, and the connection is dropped."""
        if self.over:
            return
        self.over = True
        self.connector._fast.discard(self)
        if self.conn is not None:
            self.conn.on_head = None
            self.conn.native = None
            self.conn.abandon()
        self.connector._deliver_now(self._request(), Reply(504))


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
        native: bool = True,
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
        #: serve the common request through the Rust core (TunnelConnectorCore); False keeps
        #: every request on the Python path (tests compare the two)
        self.native = native
        #: answers delivered by the native path (tests check it was taken)
        self.native_delivered = 0
        #: set while a websocket is open (tests and the CLI wait on it)
        self.connected = asyncio.Event()
        #: requests received from the relay (tests count which connector got them)
        self.requests_received = 0
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: WebSocketClient | None = None
        #: messages to the relay queued in this loop turn (`_send`)
        self._outbox: list[bytes] = []
        #: a `_flush` is scheduled for this loop turn
        self._flush_pending = False
        #: the loop `run` runs on (`asyncio.get_running_loop()` per request was measurable)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the native per-request path of the current websocket, and the pools of the web
        #: targets it serves (by the index it gives); None while disconnected
        self._core: TunnelConnectorCore | None = None
        self._native_pools: list[HttpClientPool] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: requests of the task-less path in flight (their deadlines: `_sweep_fast`)
        self._fast: set[_FastExchange] = set()
        self._stopping = False
        #: set by `stop`: ends the wait between reconnects at once
        self._stop = asyncio.Event()

    # ---- connection ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect and serve until `stop()`; reconnects on its own."""
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._loop = loop = asyncio.get_running_loop()
        sweep = loop.create_task(self._sweep_fast())
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
            await self._session.close()
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
        ws = await WebSocketClient.connect(
            url,
            headers=[("Authorization", f"Bearer {self._token}")],
            max_message=1 << 20,
            on_message=self._on_ws_message,
        )
        self._ws = ws
        if self.native:
            self._core = self._make_core()
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

    async def _sweep_fast(self) -> None:
        """Answer 504 for task-less requests past their target timeout. Checked a tenth of the
        timeout apart (at most 1 s, at least 10 ms): a request times out up to that much late,
        and no timer is armed per request."""
        tick = min(1.0, max(0.01, self.target_timeout / 10))
        while True:
            await asyncio.sleep(tick)
            if self._fast:
                now = time.monotonic()
                for exchange in [x for x in self._fast if x.deadline <= now]:
                    exchange.time_out()

    async def _keepalive(self, ws: WebSocketClient) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE_TICK)
            if not ws.keepalive(nanos(PING_AFTER), nanos(DEAD_AFTER)):
                log.warning("connector: relay silent for %.0f s: reconnecting", DEAD_AFTER)
                return

    def _make_core(self) -> TunnelConnectorCore:
        """The native path for a new websocket: the web targets over plain HTTP it may serve
        (by their `str.upper()` names, as the Python path matches them)."""
        pools: list[HttpClientPool] = []
        served: list[tuple[str, str, str]] = []
        for name, target in self.targets.items():
            pool = target.lean_pool if isinstance(target, WebTarget) else None
            if isinstance(target, WebTarget) and pool is not None:
                pools.append(pool)
                served.append((name, pool.host_header, target.prefix))
        self._native_pools = pools
        return TunnelConnectorCore(self.binary, os.urandom(32), served)

    def _on_ws_message(self, message: WsMessage) -> None:
        self._on_message(message.data)

    def _on_ws_data(self, decoder: WsDecoder, data: bytes) -> list[WsEvent]:
        """A websocket read (`WebSocketClient.on_data`): deframed and its common requests
        decoded and turned into target requests in one Rust call; every other event is left
        to the client (a message then reaches `_on_ws_message`)."""
        core = self._core
        if core is None:
            return decoder.feed(data)
        items = core.feed_ws(decoder, data)
        left: list[WsEvent] = []
        for item in items:
            if type(item) is tuple:
                if not self._start_native(core, item):
                    self._on_message(item[5])  # no idle connection: the Python path
            else:
                left.append(cast(WsEvent, item))
        if core.has_output:  # (ConnectorReceived acknowledgements)
            self._schedule_flush()
        return left

    def _start_native(
        self,
        core: TunnelConnectorCore,
        started: tuple[int, bytes, str, str, bool, bytes, int, str],
    ) -> bool:
        """The common request, decoded and turned into its target request by the Rust core:
        written to an idle kept-alive connection, whose bytes then go through the core (the
        whole answer comes back as a `Deliver` frame, built in Rust). False when the target
        has no idle connection (the Python path takes the message)."""
        index, wire, request_id, origin_id, head, payload, ack_mode, ack_origin_id = started
        pool = self._native_pools[index]
        conn = pool.take_idle()
        if conn is None:
            return False
        self.requests_received += 1
        exchange = _FastExchange(self, None, time.monotonic(), pool)
        exchange.core = core
        exchange.payload = payload
        exchange.request_id = request_id
        exchange.request_origin_id = origin_id
        if ack_mode == 2:
            exchange.ack_origin_id = ack_origin_id
        exchange.conn = conn
        conn.start_native(head, INLINE_LIMIT, exchange)
        assert conn.transport is not None
        conn.transport.write(wire)
        self._fast.add(exchange)
        return True

    def _on_message(self, data: bytes) -> None:
        try:
            message = decode(data, self.binary, (ClientRequest, TenantConfig, ErrorMessage))
        except WireError as err:
            log.warning("connector: bad message from the relay: %s", err)
            return
        if isinstance(message, ClientRequest):
            self.requests_received += 1
            if not self._start_fast(message):
                self._start_task(message, time.monotonic())
        elif isinstance(message, TenantConfig):
            self.reconnect = (message.reconnect_minimum_delay, message.reconnect_maximum_delay)
        elif isinstance(message, ErrorMessage):
            log.warning("connector: the relay refused a message: %s", message.message)

    async def _send(self, message: TargetResponse | AcknowledgeRequest) -> None:
        """Queue the message for this loop turn's write (all the `Deliver`s and `Acknowledge`s
        of a turn go out in one syscall, in order), and wait while the socket is congested."""
        ws = self._queue(message)
        if ws is not None and ws.congested:
            await ws.drain()

    def _queue(self, message: TargetResponse | AcknowledgeRequest) -> WebSocketClient | None:
        ws = self._ws
        if ws is None or not ws.is_open:
            return None
        self._outbox.append(encode(message, self.binary))
        self._schedule_flush()
        return ws

    def _schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """This loop turn's messages in one write: the native core's frames, then the Python
        path's messages."""
        self._flush_pending = False
        outbox, self._outbox = self._outbox, []
        ws, core = self._ws, self._core
        if ws is None or not ws.is_open:
            return  # the reconnect follows; the relay redelivers what was not acknowledged
        frames = core.take_output() if core is not None and core.has_output else b""
        if outbox:
            encoder = ws.encoder
            if self.binary:
                frames += encoder.binary_batch(outbox)
            else:
                frames += b"".join([encoder.text(data.decode()) for data in outbox])
        with contextlib.suppress(ConnectionClosed):
            ws.send_frames(frames)

    # ---- requests --------------------------------------------------------------------------

    def _start_task(self, request: ClientRequest, received: float) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(request, received))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_fast(self, request: ClientRequest) -> bool:
        """The common small request without a task: no acknowledgement, tracing or stored
        body, a web target with an idle kept-alive connection. The request goes out now; the
        answer (its body read whole when small) comes back through a callback from the target
        connection's `data_received` and is queued as `Deliver` in the same call. Anything
        else (a large or streamed answer, a failure on a connection that had received nothing,
        no idle connection) falls back to the task of `_handle`, with the same outcomes: 502
        on a target failure, 504 after `target_timeout`. Returns False when not taken."""
        if (
            request.acknowledge_mode
            or request.enable_tracing
            or request.discard_connector_response
            or request.outsourced
        ):
            return False
        target = self.targets.get(request.target.upper())
        if not isinstance(target, WebTarget):
            return False
        received = time.monotonic()
        exchange = _FastExchange(self, request, received)
        try:
            started = target.try_start(
                request.http_method,
                request.url,
                request.http_headers,
                request.body_content or b"",
                exchange,
            )
        except TargetError as err:
            log.info("connector: request %s cannot be sent: %s", request.request_id, err)
            self._deliver_now(request, Reply(502))
            return True
        if started is None:
            return False
        exchange.pool, exchange.conn = started
        self._fast.add(exchange)
        return True

    async def _deliver_target_reply(
        self, request: ClientRequest, reply: TargetReply, started: float
    ) -> None:
        try:
            await self._deliver(request, await reply_of(reply), started)
        except Exception:
            log.exception("connector: request %s failed", request.request_id)
        finally:
            self._ack_finished(request)

    def _ack_finished(self, request: ClientRequest) -> None:
        """A task-less exchange is over: a ConnectorFinished request is acknowledged after its
        `Deliver`, whatever the outcome (a ConnectorReceived one was when it came, by the native
        core; the task path, `_handle`, sends its own)."""
        if request.acknowledge_mode == 2:
            origin = request.acknowledge_origin_id or request.request_origin_id
            self._queue(AcknowledgeRequest(origin, request.request_id, True))

    def _deliver_now(self, request: ClientRequest, reply: Reply) -> None:
        """`_deliver` for a reply whose body is in hand and inline-sized (no upload, no wait)."""
        body = reply.body
        assert isinstance(body, bytes)
        response = _response(request, reply)
        response.body_content = body or None
        response.body_size = response.original_body_size = len(body)
        self._queue(response)
        self._ack_finished(request)

    def _deliver_small(
        self, request: ClientRequest, status: int, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        """`_deliver_now` for a target's answer read whole with its head: the `Deliver` is
        built from the parsed head as it is (names already lower-case), without a Reply."""
        fields: dict[str, list[str]] = {}
        for name, value in headers:
            if name != "content-length" and name != "transfer-encoding":
                known = fields.get(name)
                if known is None:
                    fields[name] = [value]
                else:
                    known.append(value)
        size = len(body)
        self._queue(
            TargetResponse(
                request.request_id,
                request.request_origin_id,
                status,
                fields,
                size,
                size,
                body or None,
                status >= 400,
            )
        )
        self._ack_finished(request)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"}

    async def _handle(self, request: ClientRequest, received: float) -> None:
        started = time.monotonic()
        if request.expires_in is not None and (started - received) * 1000 > request.expires_in:
            log.info("connector: request %s expired before it started", request.request_id)
            return
        mode = request.acknowledge_mode
        acked = False
        try:
            target = self.targets.get(request.target.upper())
            if target is None:
                reply = Reply(404)
            else:
                if mode == 1:
                    await self._ack(request, remove=False)
                    acked = True
                reply = await self._run(target, request)
            # ConnectorFinished: acknowledged (below) once the whole exchange is over, bodies
            # included; the target's answer head can come before it has read the request body
            await self._deliver(request, reply, started)
        except Exception:
            log.exception("connector: request %s failed", request.request_id)
        finally:
            if mode in (1, 2) and not acked:
                with contextlib.suppress(Exception):
                    await self._ack(request, remove=True)

    async def _ack(self, request: ClientRequest, remove: bool) -> None:
        origin = request.acknowledge_origin_id or request.request_origin_id
        await self._send(AcknowledgeRequest(origin, request.request_id, remove))

    async def _run(self, target: Target, request: ClientRequest) -> Reply:
        headers = [(k, v) for k, values in request.http_headers.items() for v in values]
        if request.acknowledge_url:
            headers.append(("RelayServer-AcknowledgeUrl", self.server + request.acknowledge_url))
        if request.enable_tracing:
            headers += [
                ("RelayServer-RequestId", request.request_id),
                ("RelayServer-RequestOriginId", request.request_origin_id),
            ]
        body: Body = request.body_content or b""
        if request.outsourced:
            body = self._download(request)
        # the target timeout is a plain timer cancelling this task (what asyncio.timeout does,
        # at a fraction of its cost per request)
        task = asyncio.current_task()
        assert task is not None
        fired: list[bool] = []
        timer = asyncio.get_running_loop().call_later(
            self.target_timeout, _cancel_for_timeout, task, fired
        )
        try:
            return await target.call(
                request.http_method, request.url, headers, body, request.body_size
            )
        except asyncio.CancelledError:
            if fired and task.uncancel() == 0:
                return Reply(504)
            raise
        except (aiohttp.ClientError, OSError) as err:  # TargetError is an OSError
            log.info("connector: target of %s failed: %s", request.request_id, err)
            return Reply(502)
        finally:
            timer.cancel()

    async def _download(self, request: ClientRequest) -> AsyncIterator[bytes]:
        assert self._session is not None
        delete = "true" if request.acknowledge_mode == 0 else "false"
        url = f"{self.server}/tunnel/body/request/{request.request_id}?delete={delete}"
        async with self._session.get(url, headers=self._auth()) as reply:
            if reply.status != 200:
                raise aiohttp.ClientError(f"request body not available ({reply.status})")
            async for chunk in reply.content.iter_chunked(CHUNK):
                yield chunk

    async def _deliver(self, request: ClientRequest, reply: Reply, started: float) -> None:
        response = _response(request, reply)
        try:
            body = reply.body
            if request.discard_connector_response:
                pass
            elif isinstance(body, bytes) and len(body) <= INLINE_LIMIT:
                response.body_content = body or None
                response.body_size = len(body)
            else:
                try:
                    response.body_size = await self._upload(request, body)
                except (aiohttp.ClientError, OSError) as err:
                    log.info("connector: upload of %s failed: %s", request.request_id, err)
                    response = TargetResponse(
                        request.request_id, request.request_origin_id, 502, request_failed=True
                    )
        finally:
            reply.done()
        response.original_body_size = response.body_size
        if request.enable_tracing:
            response.http_headers["RelayServer-TargetDuration"] = [
                f"{time.monotonic() - started:.6f}"
            ]
        await self._send(response)

    async def _upload(self, request: ClientRequest, body: Body) -> int:
        assert self._session is not None
        url = f"{self.server}/tunnel/body/response/{request.request_id}"
        data: Any = body
        async with self._session.post(url, data=data, headers=self._auth()) as reply:
            text = await reply.text()
            if reply.status != 200:
                raise aiohttp.ClientError(f"response body refused ({reply.status}): {text}")
            return int(text)


def _response(request: ClientRequest, reply: Reply) -> TargetResponse:
    """The answer to `request` with the target's status and headers (less the framing ones,
    which the relay sets for the body it sends); the body is the caller's to fill in."""
    headers: dict[str, list[str]] = {}
    for name, value in reply.headers:
        if name.lower() not in ("content-length", "transfer-encoding"):
            headers.setdefault(name, []).append(value)
    return TargetResponse(
        request_id=request.request_id,
        request_origin_id=request.request_origin_id,
        http_status_code=reply.status,
        request_failed=reply.status >= 400,
        http_headers=headers,
    )
