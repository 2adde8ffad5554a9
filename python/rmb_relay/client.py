"""The RMB SDK: a direct client of a relay, for applications, our tests and the load harness.

    key = identity.signing_key("<mnemonic>")
    async with await RmbClient.connect("ws://127.0.0.1:8080", twin=7, key=key, sid="app") as c:
        reply = await c.request(9, "calc.add", b"[1, 2]")

A client logs in with a fresh JWT, signs every envelope it sends (spec/rmb.md §2.1: MD5 of the
challenge, 65-byte prefixed signature), matches responses to requests by uid, and answers
incoming requests through handlers. It talks to the relay directly (no rmb-peer, no Redis), so
payloads are sent as `plain` (end-to-end encryption is rmb-peer's business).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict, Unpack

from rmb_relay._core import (
    MSG_ERROR,
    MSG_PING,
    MSG_PONG,
    MSG_REQUEST,
    MSG_RESPONSE,
    Envelope,
    EnvelopeError,
    SigningKey,
    WsMessage,
)
from rmb_relay.clock import Clock, seconds, wall_clock
from rmb_relay.errors import ClientError, RemoteError, RequestTimeout
from rmb_relay.identity import make_jwt
from rmb_relay.wsclient import WebSocketClient

log = logging.getLogger("rmb_relay.client")

#: rmb-peer's default request TTL (spec/rmb.md §5.6)
DEFAULT_EXPIRATION = 300


@dataclass(frozen=True, slots=True)
class Address:
    twin: int
    sid: str | None = None

    def __str__(self) -> str:
        return str(self.twin) if self.sid is None else f"{self.twin}:{self.sid}"


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


@dataclass(frozen=True, slots=True)
class IncomingRequest:
    uid: str
    source: Address
    command: str
    data: bytes
    schema: str | None
    expiration: int


Handler = Callable[[IncomingRequest], bytes | Awaitable[bytes]]


class RequestOptions(TypedDict, total=False):
    """Envelope options of a request (all optional)."""

    dest_sid: str | None
    expiration: int
    tags: str | None
    schema: str | None


class RmbClient:
    def __init__(
        self,
        twin: int,
        key: SigningKey,
        *,
        sid: str | None = None,
        sign: bool = True,
        clock: Clock = wall_clock,
    ) -> None:
        self.twin = twin
        self.key = key
        self.sid = sid
        self.sign = sign
        self.clock = clock
        self.ws: WebSocketClient | None = None
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self._handlers: dict[str, Handler] = {}
        self._default_handler: Handler | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        url: str,
        twin: int,
        key: SigningKey,
        *,
        sid: str | None = None,
        sign: bool = True,
        clock: Clock = wall_clock,
        timeout: float = 10.0,
    ) -> RmbClient:
        client = cls(twin, key, sid=sid, sign=sign, clock=clock)
        await client.open(url, timeout=timeout)
        return client

    async def open(self, url: str, *, timeout: float = 10.0) -> None:
        token = make_jwt(self.key, self.twin, self.sid, seconds(self.clock()))
        base = url.split("?", 1)[0]
        self.ws = await WebSocketClient.connect(
            f"{base}?{token}", on_message=self._on_message, timeout=timeout
        )
        self.ws.closed.add_done_callback(lambda _: self._fail_pending())

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
        env = Envelope(uid or str(uuid.uuid4()))
        env.timestamp = seconds(self.clock())
        env.expiration = expiration
        env.source_twin = self.twin
        env.source_connection = self.sid
        env.dest_twin = dest
        env.dest_connection = dest_sid
        env.tags = tags
        env.schema = schema
        return env

    def seal(self, env: Envelope) -> bytes:
        """Sign (unless signing is off) and encode."""
        if self.sign:
            env.signature = self.key.sign_prefixed(env.challenge())
        return env.encode()

    def request_envelope(
        self, dest: int, command: str, data: bytes = b"", **options: Unpack[RequestOptions]
    ) -> tuple[str, bytes]:
        """(uid, signed wire bytes) of a request; sent by `send_request`, or by the caller."""
        env = self.envelope(dest, **options)
        env.kind = MSG_REQUEST
        env.command = command
        env.plain = data
        return env.uid, self.seal(env)

    # ---- requests --------------------------------------------------------------------------

    def send_request(
        self, dest: int, command: str, data: bytes = b"", **options: Unpack[RequestOptions]
    ) -> asyncio.Future[Reply]:
        """Send a request now; the future resolves with the reply (or the relay's error)."""
        uid, wire = self.request_envelope(dest, command, data, **options)
        future = self._expect(uid)
        self._ws().send_binary(wire)
        return future

    def _expect(self, uid: str) -> asyncio.Future[Reply]:
        """A future for the reply with this uid, forgotten once it is done."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[uid] = future
        future.add_done_callback(lambda _: self._pending.pop(uid, None))
        return future

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
        env.kind = MSG_PING
        future = self._expect(env.uid)
        self._ws().send_binary(self.seal(env))
        async with asyncio.timeout(timeout):
            return await future

    # ---- serving ---------------------------------------------------------------------------

    def handle(self, command: str, handler: Handler) -> None:
        """Answer requests for `command` with `handler(request) -> bytes` (sync or async);
        an exception becomes an error response with code 500 and its message."""
        self._handlers[command] = handler

    def handle_all(self, handler: Handler) -> None:
        self._default_handler = handler

    def _on_message(self, message: WsMessage) -> None:
        try:
            env = Envelope.decode(message.data)
        except EnvelopeError as err:
            log.warning("dropping undecodable envelope from the relay: %s", err)
            return
        kind = env.kind
        if kind == MSG_REQUEST:
            self._serve(env)
            return
        future = self._pending.get(env.uid)
        if future is None or future.done():
            log.debug("reply %s matches no pending request (late or duplicate)", env.uid)
            return
        error = None
        if kind == MSG_ERROR:
            error = (env.error_code, env.error_message)
        elif kind not in (MSG_RESPONSE, MSG_PONG):
            return
        future.set_result(
            Reply(
                env.uid,
                Address(env.source_twin, env.source_connection),
                env.plain or env.cipher or b"",
                error,
                env.schema,
            )
        )

    def _serve(self, env: Envelope) -> None:
        handler = self._handlers.get(env.command or "", self._default_handler)
        request = IncomingRequest(
            env.uid,
            Address(env.source_twin, env.source_connection),
            env.command or "",
            env.plain or b"",
            env.schema,
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
            env.kind = MSG_RESPONSE
            env.plain = data
        else:
            env.kind = MSG_ERROR
            env.error_code, env.error_message = error
        ws = self.ws
        if ws is not None and not ws.closed.done():
            ws.send_binary(self.seal(env))

    # ---- lifecycle -------------------------------------------------------------------------

    def _ws(self) -> WebSocketClient:
        if self.ws is None:
            raise ClientError("not connected: call open() first")
        return self.ws

    def _fail_pending(self) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(ClientError("connection to the relay closed"))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.ws is not None:
            await self.ws.close()
