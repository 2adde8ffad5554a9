"""`RmbClient`: a twin on one or more relays (the package docstring says how it behaves).

It builds and signs envelopes (§2.1), sends each through the first link that is up and moves
that link to the front when it was not (rmb-peer's failover), matches replies to requests by
uid through `Waiter`s, and serves incoming requests.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict, Unpack

from google.protobuf.message import DecodeError

from rmb_relay._core import SigningKey, WsMessage
from rmb_relay.clock import Clock, monotonic_clock, seconds, wall_clock
from rmb_relay.errors import (
    ClientError,
    RemoteError,
    RequestTimeout,
)
from rmb_relay.identity import make_jwt
from rmb_relay.sdk.envelope import Envelope, sign
from rmb_relay.sdk.link import DEAD_AFTER, RETRY_DELAY, TICK, RelayLink
from rmb_relay.sdk.websocket import DEFAULT_CONNECT_TIMEOUT, WebSocketClient

log = logging.getLogger("rmb_relay.sdk")

#: rmb-peer's default request TTL (spec/rmb.md §5.6)
DEFAULT_EXPIRATION = 300
#: after a relay is lost, requests still unanswered this much later are sent once more: the
#: other side may have answered through the lost relay before it noticed the loss
RESEND_SETTLE = 1.0


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
        dead_after: float = DEAD_AFTER,
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
        #: a relay connection silent this long is given up (and still read: link.py)
        self.dead_after = dead_after
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
                dead_after=self.dead_after,
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
