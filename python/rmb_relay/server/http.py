"""Plain HTTP requests: the router (by method and path pattern) and the request body a handler
reads as it arrives.

Operations endpoints (`/health`, `/metrics`) are registered by the listener; dialects add their
own through `Dialect.add_routes` (the RMB federation inbound `POST /`, SBD's `PUT
/authenticate`, a tunnel's `/relay/*`). Paths are `dialects/paths.py` patterns, matched most
specific first. Anything unmatched gets rmb-rs's `404 page not found`; a path served only for
other methods gets 405 with `Allow`. `HEAD` is served by the `GET` handler (the connection
sends the head alone).

A route registered with `add` gets its body whole (bounded by `max_message`, 413 beyond); one
registered with `add_streaming` reads it from an `IncomingBody` as the connection receives it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import (
    HttpClient,
    HttpResponse,
    RequestBody,
    RouteHandler,
    StreamingRouteHandler,
)
from rmb_relay.dialects.paths import PathPattern, PathTable
from rmb_relay.errors import ConfigError, HttpReject

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest

#: unread request-body bytes above which the connection stops reading its socket (and under
#: half of which it reads again): what one upload costs in memory, however big it is
BODY_BUFFER_LIMIT = 256 * 1024


@dataclass(frozen=True, slots=True)
class _Whole:
    """A route that gets its body whole, in `request.body`."""

    handler: RouteHandler


@dataclass(frozen=True, slots=True)
class _Streaming:
    """A route that reads its body as it arrives."""

    handler: StreamingRouteHandler


_Route = _Whole | _Streaming


class Router:
    """Implements `dialects.base.Routes` for the listener."""

    def __init__(self) -> None:
        self._paths: PathTable[dict[str, _Route]] = PathTable()
        self._by_pattern: dict[PathPattern, dict[str, _Route]] = {}

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        self._add(method, path, _Whole(handler))

    def add_streaming(self, method: str, path: str, handler: StreamingRouteHandler) -> None:
        self._add(method, path, _Streaming(handler))

    def _add(self, method: str, path: str, route: _Route) -> None:
        pattern = PathPattern.parse(path)
        methods = self._by_pattern.get(pattern)
        if methods is None:
            methods = self._by_pattern[pattern] = {}
            self._paths.add(pattern, methods)
        method = method.upper()
        if method in methods:
            raise ConfigError(f"route {method} {path} registered twice")
        methods[method] = route
        if method == "GET" and "HEAD" not in methods:
            methods["HEAD"] = route  # HEAD is GET without the body (RFC 9110 §9.3.2)

    def _find(self, method: str, path: str) -> tuple[_Route | None, list[str]]:
        methods = self._paths.find(path)
        if methods is None:
            return None, []
        return methods.get(method), sorted(methods)

    def find(
        self, method: str, path: str
    ) -> tuple[RouteHandler | StreamingRouteHandler | None, list[str]]:
        """The handler for the request, or None and the methods the path allows (for 405)."""
        route, allowed = self._find(method, path)
        return (route.handler if route is not None else None), allowed

    async def dispatch(
        self, request: HttpRequest, body: RequestBody, client: HttpClient
    ) -> HttpResponse:
        route, allowed = self._find(request.method, request.path)
        if isinstance(route, _Streaming):
            return await route.handler(request, body, client)
        if route is not None:
            if request.has_body:
                request = request.with_body(await body.read())
            return await route.handler(request, client)
        # refused before its body is read: an `Expect: 100-continue` client never sends it
        if allowed:
            return HttpResponse(
                405, b"method not allowed", headers=(("Allow", ", ".join(allowed)),)
            )
        return HttpResponse(404, b"page not found")


class IncomingBody:
    """The body of the request a connection is serving (`dialects.base.RequestBody`).

    The connection `feed`s it the bytes of each read and `finish`es it at the end of the
    request; the handler iterates it. Whenever the handler takes bytes or starts waiting for
    them, `on_read` tells the connection, which then sends `100 Continue` (first time, if the
    client asked and nothing has arrived yet) and resumes reading once `buffered` is under half
    of `BODY_BUFFER_LIMIT`. While the handler waits for the client, the request `deadline` is
    suspended; each wait is bounded by `idle_timeout` instead (HttpReject 408), not counting
    time the connection held reading for the body's upload rate (`throttle`: `paused` while it
    does, `pauses` counts how often).
    """

    __slots__ = (
        "_chunks",
        "_idle_timeout",
        "_on_read",
        "_waiter",
        "buffered",
        "charge",
        "charged",
        "deadline",
        "finished",
        "length",
        "limit",
        "paused",
        "pauses",
        "received",
        "trailers",
    )

    def __init__(
        self,
        length: int | None,
        *,
        limit: int,
        idle_timeout: float,
        on_read: Callable[[IncomingBody], None],
    ) -> None:
        self.length = length
        #: default limit of `read()`
        self.limit = limit
        self.trailers: list[tuple[str, bytes]] = []
        #: bytes received and not yet taken by the handler
        self.buffered = 0
        #: bytes received in all
        self.received = 0
        #: the whole body has been received
        self.finished = length == 0
        #: the request deadline, suspended while the handler waits for the client
        self.deadline: asyncio.Timeout | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        #: the upload rate the handler charges this body to (`throttle`), and bytes charged
        self.charge: Callable[[int], float] | None = None
        self.charged = 0
        #: the connection is not reading for the upload rate; times it paused so
        self.paused = False
        self.pauses = 0
        self._idle_timeout = idle_timeout
        self._on_read = on_read
        self._waiter: asyncio.Future[None] | None = None

    # ---- the connection's side ---------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        self.received += len(data)
        self._wake()

    def finish(self, trailers: list[tuple[str, bytes]]) -> None:
        self.finished = True
        self.trailers = trailers
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- the handler's side ------------------------------------------------------------------

    def __aiter__(self) -> IncomingBody:
        return self

    async def __anext__(self) -> bytes:
        chunks = self._chunks
        while not chunks:
            if self.finished:
                raise StopAsyncIteration
            await self._wait()
        chunk = chunks.popleft()
        self.buffered -= len(chunk)
        self._on_read(self)
        return chunk

    async def read(self, limit: int | None = None) -> bytes:
        if limit is None:
            limit = self.limit
        if self.length is not None and self.length > limit:
            raise HttpReject(413, f"request body over {limit} bytes")
        parts = []
        total = 0
        async for chunk in self:
            total += len(chunk)
            if total > limit:
                raise HttpReject(413, f"request body over {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def lift_deadline(self) -> None:
        """The handler bounds its own waits from here on (a tunnel: request TTL and response
        timeout, which outlast `http_request_timeout`)."""
        deadline = self.deadline
        if deadline is not None:
            deadline.reschedule(None)

    def throttle(self, charge: Callable[[int], float]) -> None:
        self.charge = charge

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._on_read(self)  # the handler wants bytes: 100 Continue, resume reading
        deadline = self.deadline
        when = deadline.when() if deadline is not None else None
        if deadline is not None and when is not None:
            deadline.reschedule(None)
        started = loop.time()
        try:
            while True:
                pauses = self.pauses
                try:
                    async with asyncio.timeout(self._idle_timeout):
                        await waiter
                    break
                except TimeoutError:
                    if not self.paused and self.pauses == pauses:
                        raise HttpReject(
                            408, f"request body not received within {self._idle_timeout:g} s"
                        ) from None
                    # the relay held reading meanwhile (the upload rate): not the client idling
                    self._waiter = waiter = loop.create_future()
        finally:
            self._waiter = None
            # (the connection unsets `deadline` when the handler has answered)
            if deadline is not None and when is not None and self.deadline is deadline:
                deadline.reschedule(when + (loop.time() - started))
