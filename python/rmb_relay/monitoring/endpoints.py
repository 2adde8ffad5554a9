"""The `/monitor/` routes (the package docstring lists them): each answers JSON, built from
the listener's connections and its dialects' books at the moment it is asked."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from rmb_relay import __version__
from rmb_relay.clock import NS, wall_clock
from rmb_relay.dialects.base import HttpResponse
from rmb_relay.monitoring import connections as listing
from rmb_relay.monitoring import sections
from rmb_relay.monitoring.process import cpu_seconds, rss_bytes
from rmb_relay.server.traffic import FIELDS, Rates, totals

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.clock import Clock
    from rmb_relay.dialects.base import HttpClient
    from rmb_relay.server.http import Router
    from rmb_relay.server.listener import RelayServer

ROUTES = ("server", "connections", "federation", "tunnel", "cluster")
#: query-string parameters read at most (the head is bounded already; this bounds the work)
MAX_PARAMS = 32


def json_response(value: Any, status: int = 200) -> HttpResponse:
    body = json.dumps(value, separators=(",", ":"), default=str).encode() + b"\n"
    return HttpResponse(status, body, content_type="application/json")


def _params(request: HttpRequest) -> dict[str, str]:
    return dict(parse_qsl(request.query or "", max_num_fields=MAX_PARAMS))


class Monitor:
    """The views of one listener."""

    def __init__(self, server: RelayServer, *, wall: Clock = wall_clock) -> None:
        self.server = server
        self.wall = wall
        self.rates = Rates(server.started_at, cpu_seconds())

    def add_routes(self, router: Router) -> None:
        router.add("GET", "/monitor/", self._index)
        router.add("GET", "/monitor/server", self._server)
        router.add("GET", "/monitor/connections", self._connections)
        router.add("GET", "/monitor/federation", self._federation)
        router.add("GET", "/monitor/tunnel", self._tunnel)
        router.add("GET", "/monitor/cluster", self._cluster)

    async def _index(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return json_response({"routes": [f"/monitor/{name}" for name in ROUTES]})

    def summary(self) -> dict[str, Any]:
        """`/monitor/server`'s answer."""
        server = self.server
        now = server.clock()
        conns = server.connections.values()
        traffic = totals(conns, server.retired)
        cpu = cpu_seconds()
        rates = self.rates.sample(now, cpu, traffic)
        dialects = server.dialects
        by_dialect = {labels[0]: int(n) for labels, n in server.connection_counts()}
        return {
            "version": __version__,
            "pid": os.getpid(),
            "time": round(self.wall() / NS, 3),
            "uptime": round((now - server.started_at) / NS, 3),
            "cpu_seconds": round(cpu, 3),
            "cpu": rates.pop("cpu"),
            "rss_bytes": rss_bytes(),
            "connections": {
                "total": len(server.connections),
                "by_dialect": by_dialect,
                "congested": sum(1 for c in conns if c.congested),
                "paused": sum(1 for c in conns if c.reading_paused),
                "accept_paused": any(a.paused for a in server.acceptors),
            },
            "totals": dict(zip(FIELDS, traffic, strict=True)),
            "rates": rates,
            "mailbox": sections.mailbox_depth(dialects),
            "budgets": sections.budgets(
                dialects, server.limits.total, server.limits.max_connections
            ),
        }

    async def _server(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return json_response(self.summary())

    async def _connections(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        try:
            query = listing.Query.parse(_params(request))
        except (listing.QueryError, ValueError) as err:
            return json_response({"error": str(err)}, 400)
        server = self.server
        started = time.perf_counter()
        try:
            page = listing.listing(server.connections.values(), query, server.clock())
        except listing.QueryError as err:
            return json_response({"error": str(err)}, 400)
        page["took_ms"] = round((time.perf_counter() - started) * 1000, 3)
        return json_response(page)

    async def _federation(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return json_response(sections.federation(self.server.dialects, self.wall()))

    async def _tunnel(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return json_response(sections.tunnel(self.server.dialects))

    async def _cluster(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return json_response(await sections.cluster(self.server.dialects))
