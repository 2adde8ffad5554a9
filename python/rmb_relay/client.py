"""The RMB client: the one implementation of "a twin talking to relays".

    key = identity.signing_key("<mnemonic>")
    async with await RmbClient.connect("ws://127.0.0.1:8080", twin=7, key=key, sid="app") as c:
        reply = await c.request(9, "calc.add", b"[1, 2]")

Everything that speaks RMB as a twin is built on this module, so login, signing, failover and
request matching exist once:

- the SDK (`RmbClient` directly; `RmbPeerClient` for programs that go through a local rmb-peer);
- the relay's tests;
- the load harness (`load/rmb.py`: a `RelayLink` per twin, envelope templates from `RmbClient`);
- rmb-peer (`peer/gateway.py`: an `RmbClient` on every `--relay`, with an inbound check that
  verifies and decrypts, and waiters that answer into Redis).

Layers, bottom up:

`RelayLink` is one relay connection: login with a fresh JWT (spec/rmb.md §1.2) on every
(re)connect, a websocket ping once nothing has been written for 20 s, the connection dropped
once nothing has arrived for 40 s, a reconnect 2 s after any loss (§5.3), and outgoing
envelopes batched into one write per event-loop turn.

`RmbClient` is a twin on one or more links. It builds and signs envelopes (§2.1), sends each
through the first link that is up and moves that link to the front when it was not (rmb-peer's
failover), matches replies to requests by uid through `Waiter`s, and serves incoming requests.
A relay that goes away may have swallowed requests, or the replies to them, so when a link is
lost every request still waiting for a reply is sent again through the links that are left (or
when one comes back), and once more a second later if still unanswered (the other side may have
answered through the dying relay before it noticed). Delivery is at-least-once: a service may
see a request twice, and a waiter takes one reply per destination, so the client does not.
A client made with `reconnect=True` keeps envelopes it cannot send yet until a link is up or
they expire; a plain client raises `ClientError` instead, and fails its pending requests when
its relay goes.

`RmbPeerClient` offers the same requests and services through rmb-peer's Redis msgbus JSON
(spec §5.4-§5.8) for programs that hold no keys themselves.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict, Unpack
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from rmb_relay._core import SigningKey, WsMessage
from rmb_relay.clock import NS, Clock, monotonic_clock, nanos, seconds, wall_clock
from rmb_relay.envelope import Envelope, address_text, sign
from rmb_relay.errors import (
    BadMessage,
    ClientError,
    RedisUnavailable,
    RemoteError,
    RequestTimeout,
)
from rmb_relay.identity import make_jwt
from rmb_relay.peer.msgbus import (
    BLOCK_SECONDS,
    LOCAL_QUEUE,
    REPLY_QUEUE,
    PeerReply,
    PeerRequest,
    command_queue,
    outgoing_response,
    parse_incoming_request,
    parse_incoming_response,
)
from rmb_relay.peer.resp import RespClient
from rmb_relay.wsclient import DEFAULT_CONNECT_TIMEOUT, WebSocketClient

log = logging.getLogger("rmb_relay.client")

#: rmb-peer's default request TTL (spec/rmb.md §5.6)
DEFAULT_EXPIRATION = 300
#: ping a relay we have written nothing to for this long; give up on one silent this long (§5.3)
PING_AFTER = 20.0
DEAD_AFTER = 40.0
#: wait this long after a lost or failed connection before the next attempt (§5.3)
RETRY_DELAY = 2.0
#: envelopes queued on a link in one loop turn that are written without waiting for its end
FLUSH_AT = 16
#: how often the keepalive runs and expired envelopes and waiters are swept
TICK = 1.0
#: after a relay is lost, requests still unanswered this much later are sent once more: the
#: other side may have answered through the lost relay before it noticed the loss
RESEND_SETTLE = 1.0

MessageCallback = Callable[[WsMessage], None]
LinkCallback = Callable[["RelayLink"], None]


class RelayLink:
    """One relay connection logged in as a twin; see the module docstring.

    `connect()` makes one attempt and raises; `start()` keeps the link up in a task until
    `close()`. `send` returns False while the link is down instead of raising, so the owner can
    try another link. Time for the keepalive comes from `clock` (monotonic nanoseconds); tests
    move a fake clock and call `keepalive()`.
    """

    def __init__(
        self,
        url: str,
        token: Callable[[], str],
        on_message: MessageCallback,
        *,
        on_up: LinkCallback | None = None,
        on_down: LinkCallback | None = None,
        clock: Clock = monotonic_clock,
        ping_after: float = PING_AFTER,
        dead_after: float = DEAD_AFTER,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        self.url = url.split("?", 1)[0]
        self.domain = urlsplit(self.url).hostname or ""
        self.token = token
        self.on_message = on_message
        self.on_up = on_up
        self.on_down = on_down
        self.clock = clock
        self.ping_after = nanos(ping_after)
        self.dead_after = nanos(dead_after)
        self.connect_timeout = connect_timeout
        self.ws: WebSocketClient | None = None
        self.closing = False
        self._out: list[bytes] = []
        self._runner: asyncio.Task[None] | None = None
        self._ticker: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<RelayLink {self.url} {'up' if self.connected else 'down'}>"

    @property
    def connected(self) -> bool:
        return self.ws is not None and self.ws.is_open

    async def connect(self) -> None:
        """One login attempt. Raises OSError, TimeoutError or ClientError (HandshakeError)."""
        ws = await WebSocketClient.connect(
            f"{self.url}?{self.token()}",
            on_message=self.on_message,
            timeout=self.connect_timeout,
            clock=self.clock,
        )
        self.ws = ws
        ws.closed.add_done_callback(lambda _: self._lost(ws))
        # the line operators and launch scripts wait for, exactly as rmb-peer prints it
        log.info('now connected to relay Some("%s")', self.domain)
        self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)
        if self.on_up is not None:
            self.on_up(self)

    def _lost(self, ws: WebSocketClient) -> None:
        if ws is not self.ws:
            return
        # frames not yet written die with the connection; the owner re-sends what matters
        self._out.clear()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if not self.closing:
            log.warning(
                "lost relay %s (%s %s)", self.url, ws.close_code or "-", ws.close_reason or ""
            )
        if self.on_down is not None:
            self.on_down(self)

    def start(self, retry_delay: float = RETRY_DELAY) -> None:
        """Keep the link up until `close()`: connect, and after any failure or loss wait
        `retry_delay` and connect again with a new token."""
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run(retry_delay))

    async def _run(self, retry_delay: float) -> None:
        while not self.closing:
            try:
                await self.connect()
            except (OSError, TimeoutError, ClientError) as err:
                log.warning("cannot connect to relay %s: %s", self.url, err or type(err).__name__)
            else:
                assert self.ws is not None
                await asyncio.shield(self.ws.closed)
            if not self.closing:
                await asyncio.sleep(retry_delay)

    # ---- sending ---------------------------------------------------------------------------

    def send(self, wire: bytes) -> bool:
        """Queue one envelope for this turn's write; False (nothing queued) if the link is down.
        Every FLUSH_AT envelopes leave at once, so a long batch does not hold the first ones
        back until its end (the relay and the other side start on them meanwhile)."""
        if not self.connected:
            return False
        out = self._out
        if not out:
            asyncio.get_running_loop().call_soon(self._flush)
        out.append(wire)
        if len(out) >= FLUSH_AT:
            self._flush()
        return True

    def _flush(self) -> None:
        out, self._out = self._out, []
        ws = self.ws
        if out and ws is not None and ws.is_open:
            if len(out) == 1:
                ws.send_binary(out[0])
            else:
                ws.send_binaries(out)

    @property
    def congested(self) -> bool:
        return self.ws is not None and self.ws.congested

    async def drain(self) -> None:
        if self.ws is not None:
            await self.ws.drain()

    # ---- keepalive -------------------------------------------------------------------------

    def _tick(self) -> None:
        self._ticker = None
        if not self.connected:
            return
        self.keepalive()
        if self.connected:
            self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)

    def keepalive(self) -> None:
        """Drop a connection nothing has arrived on for `dead_after` (the reconnect follows);
        ping one nothing has been written to or received on for `ping_after`, so the relay and
        any proxy between see traffic and the pong proves the relay alive."""
        ws = self.ws
        if ws is not None and not ws.keepalive(self.ping_after, self.dead_after):
            silent = (self.clock() - ws.last_received) // NS
            log.warning("relay %s silent for %ds: reconnecting", self.url, silent)

    async def close(self) -> None:
        self.closing = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        if self.ws is not None:
            await self.ws.close()


# ---- what a client hands back ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Address:
    twin: int
    sid: str | None = None

    def __str__(self) -> str:
        return str(self.twin) if self.sid is None else f"{self.twin}:{self.sid}"


def source_of(env: Envelope) -> Address:
    source = env.source
    return Address(source.twin, source.connection if source.HasField("connection") else None)


def payload_of(env: Envelope) -> bytes:
    """The payload bytes, plain or (for a client that does not decrypt) cipher."""
    data: bytes = env.plain if env.WhichOneof("payload") == "plain" else env.cipher
    return data


@dataclass(frozen=True, slots=True)
class Reply:
    """A response or error envelope answering one of our requests."""

    uid: str
    source: Address
    data: bytes
    error: tuple[int, str] | None = None
    schema: str | None = None

    @property
    def from_relay(self) -> bool:
        """Relay-built errors are unsigned and come from twin 0 (spec/rmb.md §2.4)."""
        return self.source.twin == 0

    @classmethod
    def of(cls, env: Envelope) -> Reply:
        error = (env.error.code, env.error.message) if env.HasField("error") else None
        schema = env.schema if env.HasField("schema") else None
        return cls(env.uid, source_of(env), payload_of(env), error, schema)


@dataclass(frozen=True, slots=True)
class IncomingRequest:
    uid: str
    source: Address
    command: str
    data: bytes
    schema: str | None
    expiration: int


Handler = Callable[[IncomingRequest], bytes | Awaitable[bytes]]
#: True: dispatch the envelope; False: drop it (the check handled it); or an awaitable of that
InboundCheck = Callable[[Envelope], bool | Awaitable[bool]]


class RequestOptions(TypedDict, total=False):
    """Envelope options of a request (all optional)."""

    dest_sid: str | None
    expiration: int
    tags: str | None
    schema: str | None


class Waiter:
    """What a client keeps for a request it sent until the replies are in.

    `RmbClient` calls `on_reply` with each reply carrying the request's uid (True: no more are
    expected, forget the waiter), `wires` for what to send again when a relay may have lost it,
    and `expire` once `deadline` (unix seconds) has passed with replies still missing; `sent`
    says whether the request ever left (else it expired waiting for a relay). `fail` ends the
    wait when the client is closed or loses its only relay for good.
    """

    __slots__ = ("deadline", "sent")

    def __init__(self, deadline: int) -> None:
        self.deadline = deadline
        self.sent = False

    def on_reply(self, env: Envelope) -> bool:
        raise NotImplementedError

    def wires(self) -> list[bytes]:
        raise NotImplementedError

    def expire(self) -> None:
        """The deadline passed; the default is to fail with RequestTimeout."""
        self.fail(RequestTimeout("no reply before the request expired"))

    def fail(self, error: ClientError) -> None:
        raise NotImplementedError


class _ReplyFuture(Waiter):
    """The SDK's waiter: one reply resolves one future."""

    __slots__ = ("future", "wire")

    def __init__(self, deadline: int, wire: bytes | None) -> None:
        super().__init__(deadline)
        self.wire = wire
        self.future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()

    def on_reply(self, env: Envelope) -> bool:
        if not self.future.done():
            self.future.set_result(Reply.of(env))
        return True

    def wires(self) -> list[bytes]:
        return [] if self.wire is None or self.future.done() else [self.wire]

    def fail(self, error: ClientError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


# ---- the client ------------------------------------------------------------------------------


class RmbClient:
    """A twin on one or more relays; see the module docstring.

    `accept` (optional) sees every incoming envelope before it is dispatched, in arrival order,
    and returns False to drop it, or an awaitable of that when it must wait (rmb-peer verifies
    and decrypts there, and looks a sender up when it is not cached). `on_request`
    replaces the built-in handlers for incoming requests, `on_unmatched` receives replies no
    waiter claims. Wall time (`clock`) stamps envelopes and JWTs and decides expiry; monotonic
    time (`monotonic`) drives the keepalive.
    """

    def __init__(
        self,
        twin: int,
        key: SigningKey,
        *,
        sid: str | None = None,
        sign: bool = True,
        clock: Clock = wall_clock,
        monotonic: Clock = monotonic_clock,
        reconnect: bool = False,
        retry_delay: float = RETRY_DELAY,
        accept: InboundCheck | None = None,
        on_request: Callable[[Envelope], None] | None = None,
        on_unmatched: Callable[[Envelope], None] | None = None,
    ) -> None:
        self.twin = twin
        self.key = key
        self.sid = sid
        self.sign = sign
        self.clock = clock
        self.monotonic = monotonic
        self.reconnect = reconnect
        self.retry_delay = retry_delay
        self.accept = accept
        self.on_request = on_request
        self.on_unmatched = on_unmatched
        self.links: list[RelayLink] = []
        self.closed = False
        self._pending: dict[str, Waiter] = {}
        #: fire-and-forget envelopes held while no relay is up: (wire, deadline, on_expired)
        self._outbox: deque[tuple[bytes, int | None, Callable[[], None] | None]] = deque()
        #: a relay was lost while no other was up: pending requests go again on the next one
        self._resend_on_up = False
        self._up = asyncio.Event()
        self._inbound: deque[tuple[Envelope, bool | Awaitable[bool] | None]] = deque()
        self._inbound_task: asyncio.Task[None] | None = None
        self._handlers: dict[str, Handler] = {}
        self._default_handler: Handler | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ticker: asyncio.TimerHandle | None = None

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str],
        twin: int,
        key: SigningKey,
        *,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        sid: str | None = None,
        sign: bool = True,
        clock: Clock = wall_clock,
        reconnect: bool = False,
    ) -> RmbClient:
        client = cls(twin, key, sid=sid, sign=sign, clock=clock, reconnect=reconnect)
        await client.open(url, timeout=timeout)
        return client

    async def open(
        self, url: str | Sequence[str], *, timeout: float = DEFAULT_CONNECT_TIMEOUT
    ) -> None:
        """Connect to every relay URL. A plain client connects now and raises if any relay
        refuses; a reconnecting one starts its links and returns (see `wait_connected`)."""
        urls = [url] if isinstance(url, str) else list(url)
        links = [
            RelayLink(
                u,
                self.login_token,
                self._on_message,
                on_up=self._link_up,
                on_down=self._link_down,
                clock=self.monotonic,
                connect_timeout=timeout,
            )
            for u in urls
        ]
        self.links.extend(links)
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)
        if self.reconnect:
            for link in links:
                link.start(self.retry_delay)
        else:
            # one after the other, in this task: a message that arrives with the upgrade is
            # dispatched before control returns to the caller, as with a single connect
            for link in links:
                await link.connect()

    async def wait_connected(self, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Wait until at least one relay is up; TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            await self._up.wait()

    def login_token(self) -> str:
        """A fresh login JWT for this twin and session (what every (re)connect uses)."""
        return make_jwt(self.key, self.twin, self.sid, seconds(self.clock()))

    async def __aenter__(self) -> RmbClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def address(self) -> Address:
        return Address(self.twin, self.sid)

    @property
    def ws(self) -> WebSocketClient | None:
        """The websocket of the preferred relay (tests reach under the client with it)."""
        return self.links[0].ws if self.links else None

    @property
    def connected(self) -> bool:
        return any(link.connected for link in self.links)

    # ---- building envelopes ----------------------------------------------------------------

    def envelope(
        self,
        dest: int,
        *,
        dest_sid: str | None = None,
        uid: str | None = None,
        expiration: int = DEFAULT_EXPIRATION,
        tags: str | None = None,
        schema: str | None = None,
    ) -> Envelope:
        """An envelope from this twin, stamped now; the caller sets the message and payload."""
        env = Envelope(
            uid=uid or str(uuid.uuid4()), timestamp=seconds(self.clock()), expiration=expiration
        )
        env.source.twin = self.twin
        if self.sid is not None:
            env.source.connection = self.sid
        env.destination.twin = dest
        if dest_sid is not None:
            env.destination.connection = dest_sid
        if tags is not None:
            env.tags = tags
        if schema is not None:
            env.schema = schema
        return env

    def seal(self, env: Envelope) -> bytes:
        """Sign (unless signing is off) and encode."""
        if self.sign:
            sign(env, self.key)
        return env.SerializeToString()

    def request_envelope(
        self, dest: int, command: str, data: bytes = b"", **options: Unpack[RequestOptions]
    ) -> tuple[str, bytes]:
        """(uid, signed wire bytes) of a request; sent by `send_request`, or by the caller."""
        env = self.envelope(dest, **options)
        env.request.command = command
        env.plain = data
        return env.uid, self.seal(env)

    # ---- sending ---------------------------------------------------------------------------

    def send(
        self,
        wire: bytes,
        *,
        deadline: int | None = None,
        on_expired: Callable[[], None] | None = None,
    ) -> bool:
        """Send an envelope that expects no reply (a response, an error) through the first relay
        that is up. With none up, a reconnecting client holds it until one is, or until
        `deadline` (unix seconds) passes, then calls `on_expired`; a plain client raises
        ClientError. True if it was written now."""
        if self._write(wire):
            return True
        if not self.reconnect or self.closed:
            raise ClientError("not connected to any relay")
        self._outbox.append((wire, deadline, on_expired))
        return False

    def _write(self, wire: bytes) -> bool:
        links = self.links
        for i, link in enumerate(links):
            if link.send(wire):
                if i:  # rmb-peer's failover: the relay that worked goes first from now on
                    links[0], links[i] = link, links[0]
                return True
        return False

    def send_expecting(self, uid: str, waiter: Waiter) -> None:
        """Send a request's envelopes (`waiter.wires()`) and route replies with `uid` to the
        waiter until it is done or expires. With no relay up a reconnecting client sends them
        when one comes up; a plain client raises ClientError."""
        if not self.connected and (not self.reconnect or self.closed):
            raise ClientError("not connected to any relay")
        self._pending[uid] = waiter
        self._send_waiter(waiter)

    def _send_waiter(self, waiter: Waiter) -> None:
        for wire in waiter.wires():
            if not self._write(wire):
                self._resend_on_up = True
                return
            waiter.sent = True

    async def writable(self) -> None:
        """Wait while the preferred relay's socket is over its write high-water mark: a
        producer reading from elsewhere (Redis) calls this to not outrun the relay."""
        for link in self.links:
            if link.connected:
                if link.congested:
                    await link.drain()
                return

    # ---- requests --------------------------------------------------------------------------

    def expect(self, uid: str, *, deadline: int | None = None) -> asyncio.Future[Reply]:
        """A future for the reply with this uid, for a request sent some other way."""
        waiter = _ReplyFuture(deadline or seconds(self.clock()) + DEFAULT_EXPIRATION, None)
        waiter.sent = True
        self._pending[uid] = waiter
        waiter.future.add_done_callback(lambda _: self._forget(uid, waiter))
        return waiter.future

    def _forget(self, uid: str, waiter: Waiter) -> None:
        if self._pending.get(uid) is waiter:
            del self._pending[uid]

    def send_request(
        self, dest: int, command: str, data: bytes = b"", **options: Unpack[RequestOptions]
    ) -> asyncio.Future[Reply]:
        """Send a request now; the future resolves with the reply (or the relay's error)."""
        env = self.envelope(dest, **options)
        env.request.command = command
        env.plain = data
        waiter = _ReplyFuture(env.timestamp + env.expiration, self.seal(env))
        uid = env.uid
        waiter.future.add_done_callback(lambda _: self._forget(uid, waiter))
        self.send_expecting(uid, waiter)
        return waiter.future

    async def request(
        self,
        dest: int,
        command: str,
        data: bytes = b"",
        *,
        timeout: float = 30.0,
        raise_on_error: bool = True,
        **options: Unpack[RequestOptions],
    ) -> Reply:
        """Send a request and wait for its reply. Raises RequestTimeout, RemoteError."""
        future = self.send_request(dest, command, data, **options)
        try:
            async with asyncio.timeout(timeout):
                reply = await future
        except TimeoutError:
            future.cancel()
            raise RequestTimeout(
                f"no reply to {command!r} from twin {dest} in {timeout}s"
            ) from None
        if raise_on_error and reply.error is not None:
            raise RemoteError(reply)
        return reply

    async def ping(self, timeout: float = 10.0) -> Reply:
        """An envelope-level ping; the relay answers with a pong (spec/rmb.md §2.3)."""
        env = self.envelope(self.twin, dest_sid=self.sid)
        env.ping.SetInParent()
        future = self.expect(env.uid)
        self.send(self.seal(env))
        async with asyncio.timeout(timeout):
            return await future

    # ---- receiving -------------------------------------------------------------------------

    def _on_message(self, message: WsMessage) -> None:
        if message.is_text:
            log.warning("dropping a text frame from the relay")
            return
        try:
            env = Envelope.FromString(message.data)
        except DecodeError as err:
            log.warning("dropping undecodable envelope from the relay: %s", err)
            return
        accept = self.accept
        if self._inbound:  # behind an envelope still being checked: keep the order
            self._inbound.append((env, None))
            return
        # a failure here must not escape into the websocket's data_received, which would drop
        # the relay connection (and every envelope behind this one in the read)
        try:
            verdict = True if accept is None else accept(env)
            if not inspect.isawaitable(verdict):
                if verdict:
                    self._dispatch(env)
                return
        except Exception:
            log.exception("failed to handle envelope %s from %s", env.uid, source_of(env))
            return
        self._inbound.append((env, verdict))
        if self._inbound_task is None:
            self._inbound_task = asyncio.get_running_loop().create_task(self._run_inbound())

    async def _run_inbound(self) -> None:
        """Checks that had to wait (a twin lookup), and every envelope that arrived behind
        them, in arrival order; the task ends when none are left."""
        accept, inbound = self.accept, self._inbound
        assert accept is not None
        try:
            while inbound:
                env, verdict = inbound[0]  # stays queued while awaited: later ones wait behind
                try:
                    if verdict is None:
                        verdict = accept(env)
                    ok = await verdict if inspect.isawaitable(verdict) else verdict
                    if ok:
                        self._dispatch(env)
                except Exception:
                    log.exception("failed to handle envelope %s from %s", env.uid, source_of(env))
                finally:
                    inbound.popleft()
        finally:
            self._inbound_task = None

    def _dispatch(self, env: Envelope) -> None:
        message = env.WhichOneof("message")
        if message == "request":
            if self.on_request is not None:
                self.on_request(env)
            else:
                self._serve(env)
            return
        if message not in ("response", "error", "pong"):
            log.debug("ignoring envelope %s without a request or reply", env.uid)
            return
        waiter = self._pending.get(env.uid)
        if waiter is None:
            if self.on_unmatched is not None:
                self.on_unmatched(env)
            else:
                log.debug("reply %s matches no pending request (late or duplicate)", env.uid)
            return
        if waiter.on_reply(env):
            self._forget(env.uid, waiter)

    # ---- serving ---------------------------------------------------------------------------

    def handle(self, command: str, handler: Handler) -> None:
        """Answer requests for `command` with `handler(request) -> bytes` (sync or async);
        an exception becomes an error response with code 500 and its message."""
        self._handlers[command] = handler

    def handle_all(self, handler: Handler) -> None:
        self._default_handler = handler

    def _serve(self, env: Envelope) -> None:
        handler = self._handlers.get(env.request.command, self._default_handler)
        request = IncomingRequest(
            env.uid,
            source_of(env),
            env.request.command,
            payload_of(env),
            env.schema if env.HasField("schema") else None,
            env.expiration,
        )
        if handler is None:
            self._respond(request, error=(404, f"no handler for command {request.command!r}"))
            return
        try:
            result = handler(request)
        except Exception as err:
            self._respond(request, error=(500, str(err)))
            return
        if inspect.isawaitable(result):
            task = asyncio.get_running_loop().create_task(self._finish(request, result))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._respond(request, data=result)

    async def _finish(self, request: IncomingRequest, result: Awaitable[bytes]) -> None:
        try:
            data = await result
        except Exception as err:
            self._respond(request, error=(500, str(err)))
            return
        self._respond(request, data=data)

    def _respond(
        self,
        request: IncomingRequest,
        *,
        data: bytes = b"",
        error: tuple[int, str] | None = None,
    ) -> None:
        env = self.envelope(request.source.twin, dest_sid=request.source.sid, uid=request.uid)
        if error is None:
            env.response.SetInParent()
            env.plain = data
        else:
            env.error.code, env.error.message = error
        try:
            self.send(self.seal(env), deadline=env.timestamp + env.expiration)
        except ClientError:
            log.info("reply to %s from %s dropped: no relay", request.uid, request.source)

    # ---- links coming and going ------------------------------------------------------------

    def _link_up(self, link: RelayLink) -> None:
        self._up.set()
        outbox, self._outbox = self._outbox, deque()
        for wire, deadline, on_expired in outbox:
            self.send(wire, deadline=deadline, on_expired=on_expired)
        if self._resend_on_up:
            self._resend_on_up = False
            self._resend()

    def _link_down(self, link: RelayLink) -> None:
        if self.connected:
            self._resend()
            if self._pending:
                snapshot = list(self._pending.items())
                asyncio.get_running_loop().call_later(RESEND_SETTLE, self._resend_again, snapshot)
            return
        self._up.clear()
        if self.reconnect and not self.closed:
            self._resend_on_up = True
        else:
            self._fail_pending(ClientError("connection to the relay closed"))

    def _resend(self) -> None:
        """Send every request still waiting for a reply again: the relay that went away may
        have held the request or its reply (duplicate replies are dropped by the waiters)."""
        if self._pending:
            log.info("re-sending %d requests still waiting for replies", len(self._pending))
        for waiter in list(self._pending.values()):
            self._send_waiter(waiter)

    def _resend_again(self, snapshot: list[tuple[str, Waiter]]) -> None:
        again = [w for uid, w in snapshot if self._pending.get(uid) is w]
        if again and not self.closed:
            log.info("re-sending %d requests still unanswered after a relay loss", len(again))
            for waiter in again:
                self._send_waiter(waiter)

    def _tick(self) -> None:
        self._ticker = asyncio.get_running_loop().call_later(TICK, self._tick)
        self.sweep()

    def sweep(self) -> None:
        """Expire held envelopes and waiters whose deadline has passed (runs every second)."""
        now = seconds(self.clock())
        if self._outbox:
            kept: deque[tuple[bytes, int | None, Callable[[], None] | None]] = deque()
            for item in self._outbox:
                deadline, on_expired = item[1], item[2]
                if deadline is not None and deadline <= now:
                    if on_expired is not None:
                        on_expired()
                else:
                    kept.append(item)
            self._outbox = kept
        expired = [(uid, w) for uid, w in self._pending.items() if w.deadline <= now]
        for uid, waiter in expired:
            self._forget(uid, waiter)
            waiter.expire()

    # ---- lifecycle -------------------------------------------------------------------------

    def _fail_pending(self, error: ClientError) -> None:
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.fail(error)

    async def close(self) -> None:
        self.closed = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for task in list(self._tasks):
            task.cancel()
        if self._inbound_task is not None:
            self._inbound_task.cancel()
        await asyncio.gather(*(link.close() for link in self.links))
        self._fail_pending(ClientError("client closed"))


# ---- through a local rmb-peer ----------------------------------------------------------------

#: items taken from a queue at once once the blocking pop has returned
POP_BATCH = 256


#: pause before popping again after Redis failed
POP_RETRY = 0.5


async def _pop(redis: RespClient, queue: bytes) -> list[bytes]:
    """What waits on a queue (oldest first), or [] after BLOCK_SECONDS of nothing: a blocking
    pop pipelined with a non-blocking one, which Redis runs as soon as the first returns, so
    one round trip takes everything queued. A Redis failure is logged and retried: a restart
    of Redis does not end a client or service."""
    try:
        popped, more = await redis.pipeline(
            [(b"BRPOP", queue, BLOCK_SECONDS), (b"RPOP", queue, POP_BATCH)]
        )
        if popped is None:
            return []
    except RedisUnavailable as err:
        log.warning("cannot pop %s: %s", queue.decode(errors="replace"), err)
        await asyncio.sleep(POP_RETRY)
        return []
    return [popped[1], *(more or ())]


PeerHandler = Callable[[PeerRequest], bytes | Awaitable[bytes]]


class RmbPeerClient:
    """Requests and services through a local rmb-peer, over its Redis msgbus.

        async with await RmbPeerClient.connect("redis://localhost:6379") as bus:
            replies = await bus.request([9], "calc.add", b"[1, 2]")

    Every client has its own reply queue (`ret`), read by one task; requests are matched to
    replies by the `ref` the client chose. A request to several twins resolves with one reply
    per destination (or fewer when the timeout ends it). Services: `serve(command, handler)`
    pops `msgbus.<command>` and answers on `msgbus.system.reply`.
    """

    def __init__(self, redis: RespClient, *, clock: Clock = wall_clock) -> None:
        self.redis = redis
        self.clock = clock
        self.queue = f"rmb-client.{uuid.uuid4()}"
        self._pending: dict[str, tuple[int, list[PeerReply], asyncio.Future[list[PeerReply]]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._services: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls, url: str = "redis://localhost:6379", *, clock: Clock = wall_clock
    ) -> RmbPeerClient:
        """A client on the peer's Redis; raises RedisUnavailable if it cannot be reached."""
        redis = RespClient(url)
        await redis.execute((b"PING",))
        return cls(redis, clock=clock)

    async def __aenter__(self) -> RmbPeerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def request(
        self,
        destinations: Sequence[int],
        command: str,
        data: bytes = b"",
        *,
        expiration: int = DEFAULT_EXPIRATION,
        schema: str | None = None,
        tags: str | None = None,
        timeout: float = 30.0,
    ) -> list[PeerReply]:
        """Send one request to every twin in `destinations`; the replies, one per twin, in
        arrival order. Raises RequestTimeout when none came in time."""
        ref = str(uuid.uuid4())
        message = {
            "ver": 1,
            "ref": ref,
            "cmd": command,
            "exp": expiration,
            "dat": base64.b64encode(data).decode(),
            "tag": tags,
            "dst": list(destinations),
            "ret": self.queue,
            "shm": schema,
            "now": seconds(self.clock()),
        }
        future: asyncio.Future[list[PeerReply]] = asyncio.get_running_loop().create_future()
        replies: list[PeerReply] = []
        self._pending[ref] = (len(destinations), replies, future)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        try:
            await self.redis.execute((b"LPUSH", LOCAL_QUEUE, json.dumps(message).encode()))
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            if replies:
                return replies
            raise RequestTimeout(
                f"no reply to {command!r} through rmb-peer in {timeout}s"
            ) from None
        finally:
            self._pending.pop(ref, None)

    async def _read_replies(self) -> None:
        blocking = self.redis.blocking()
        queue = self.queue.encode()
        try:
            while True:
                for raw in await _pop(blocking, queue):
                    try:
                        ref, reply = parse_incoming_response(raw)
                    except BadMessage as err:
                        log.warning("unreadable reply on %s: %s", self.queue, err)
                        continue
                    entry = self._pending.get(ref or "")
                    if entry is None:
                        continue
                    expected, replies, future = entry
                    replies.append(reply)
                    if len(replies) >= expected and not future.done():
                        future.set_result(replies)
        finally:
            await blocking.close()

    def serve(self, command: str, handler: PeerHandler) -> None:
        """Answer requests for `command` (popped from `msgbus.<command>`) with
        `handler(request) -> bytes`; an exception becomes an error reply with code 500."""
        task = asyncio.get_running_loop().create_task(self._serve(command, handler))
        self._services.append(task)

    async def _serve(self, command: str, handler: PeerHandler) -> None:
        blocking = self.redis.blocking()
        queue = command_queue(command)
        try:
            while True:
                answers = [self._answer(queue, raw, handler) for raw in await _pop(blocking, queue)]
                replies = [reply for reply in await asyncio.gather(*answers) if reply]
                try:
                    await self.redis.pipeline([(b"LPUSH", REPLY_QUEUE, r) for r in replies])
                except RedisUnavailable as err:
                    log.warning("lost %d replies to %s: %s", len(replies), command, err)
        finally:
            await blocking.close()

    async def _answer(self, queue: bytes, raw: bytes, handler: PeerHandler) -> bytes | None:
        try:
            request = parse_incoming_request(raw)
        except BadMessage as err:
            log.warning("unreadable request on %s: %s", queue.decode(), err)
            return None
        error: tuple[int, str] | None = None
        data = b""
        try:
            result = handler(request)
            data = await result if inspect.isawaitable(result) else result
        except Exception as err:
            error = (500, str(err))
        return outgoing_response(request, data, error, seconds(self.clock()))

    async def close(self) -> None:
        tasks = [*self._services, *([self._reader] if self._reader else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(ClientError("client closed"))
        await self.redis.close()


__all__ = [
    "DEFAULT_EXPIRATION",
    "Address",
    "Handler",
    "IncomingRequest",
    "PeerReply",
    "PeerRequest",
    "RelayLink",
    "Reply",
    "RequestOptions",
    "RmbClient",
    "RmbPeerClient",
    "Waiter",
    "address_text",
]
