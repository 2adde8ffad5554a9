"""Plain HTTP requests: responses, rejections and a small router by method and path.

Operations endpoints (`/health`, `/metrics`) are registered by the server; dialects add their
own (the RMB federation inbound `POST /`). Anything unmatched gets rmb-rs's `404 page not found`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.server.connection import Connection


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = field(default=())

    def header_list(self) -> list[tuple[str, str]]:
        headers = list(self.headers)
        if self.body or self.status not in (202, 204):
            headers.append(("Content-Type", self.content_type))
        return headers


class HttpReject(Exception):
    """Raised by a dialect's `accept` (or a route) to refuse with an HTTP status before upgrade.

    The reason is sent as the body and logged, so an operator and the client see the same text.
    """

    def __init__(self, status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers

    def response(self) -> HttpResponse:
        return HttpResponse(self.status, self.reason.encode(), headers=self.headers)


RouteHandler = Callable[["HttpRequest", "Connection"], Awaitable[HttpResponse]]


class Router:
    """Exact (method, path) matching; a path registered for another method answers 405."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], RouteHandler] = {}

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        key = (method.upper(), path)
        if key in self._routes:
            raise ValueError(f"route {method} {path} registered twice")
        self._routes[key] = handler

    async def dispatch(self, request: HttpRequest, conn: Connection) -> HttpResponse:
        handler = self._routes.get((request.method, request.path))
        if handler is not None:
            return await handler(request, conn)
        allowed = sorted(m for (m, p) in self._routes if p == request.path)
        if allowed:
            return HttpResponse(
                405, b"method not allowed", headers=(("Allow", ", ".join(allowed)),)
            )
        return HttpResponse(404, b"page not found")
