"""The router of plain HTTP requests, by method and path pattern.

Operations endpoints (`/health`, `/metrics`) are registered by the listener; dialects add their
own through `Dialect.add_routes` (the RMB federation inbound `POST /`, SBD's `PUT
/authenticate`, a tunnel's `/relay/*`). Paths are `protocols/paths.py` patterns, matched most
specific first. Anything unmatched gets rmb-rs's `404 page not found`; a path served only for
other methods gets 405 with `Allow`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rmb_relay.errors import ConfigError
from rmb_relay.protocols.base import HttpClient, HttpResponse, RouteHandler
from rmb_relay.protocols.paths import PathPattern, PathTable

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest


class Router:
    """Implements `protocols.base.Routes` for the listener."""

    def __init__(self) -> None:
        self._paths: PathTable[dict[str, RouteHandler]] = PathTable()
        self._by_pattern: dict[PathPattern, dict[str, RouteHandler]] = {}

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        pattern = PathPattern.parse(path)
        methods = self._by_pattern.get(pattern)
        if methods is None:
            methods = self._by_pattern[pattern] = {}
            self._paths.add(pattern, methods)
        method = method.upper()
        if method in methods:
            raise ConfigError(f"route {method} {path} registered twice")
        methods[method] = handler
        if method == "GET" and "HEAD" not in methods:
            methods["HEAD"] = handler  # HEAD is GET without the body (RFC 9110 §9.3.2)

    def find(self, method: str, path: str) -> tuple[RouteHandler | None, list[str]]:
        """The handler for the request, or None and the methods the path allows (for 405)."""
        methods = self._paths.find(path)
        if methods is None:
            return None, []
        return methods.get(method), sorted(methods)

    async def dispatch(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        handler, allowed = self.find(request.method, request.path)
        if handler is not None:
            return await handler(request, client)
        if allowed:
            return HttpResponse(
                405, b"method not allowed", headers=(("Allow", ", ".join(allowed)),)
            )
        return HttpResponse(404, b"page not found")
