"""The gateway's HTTP API (spec §11, decision 13) on the shared listener.

| route | auth | what |
|---|---|---|
| `GET /api/version` | no | `{"singyeong": "0.0.1", "api": "v1"}` |
| `POST /api/v1/query` | yes | body = a query; the matching clients of every instance |
| `POST /api/v1/proxy` | yes | an HTTP request to a client picked by a query (proxy.py) |
| `GET /api/v1/queues/dead-letters?queue=NAME` | yes | dead letters (of one queue, or all) |
| `POST /api/v1/queues/requeue` | yes | `{"queue": NAME, "ids": [...]}` back in (no ids: all) |

Auth: with `--sg-auth`, the `Authorization` header must be the password verbatim (no
"Bearer"), as the public server; else 401 `{"status":"error","error":"not authorized"}`.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any

from rmb_relay.dialects.base import HttpClient, HttpResponse, Routes
from rmb_relay.dialects.singyeong.query import QueryError, parse
from rmb_relay.dialects.singyeong.settings import API_VERSION

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.singyeong.dialect import SingyeongDialect

JSON = "application/json"


def _json(status: int, value: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(value, separators=(",", ":")).encode(), JSON)


def _query_param(query: str | None, name: str) -> str | None:
    from urllib.parse import parse_qs

    values = parse_qs(query or "").get(name)
    return values[0] if values else None


class SgApi:
    def __init__(self, dialect: SingyeongDialect) -> None:
        self.dialect = dialect

    def add_routes(self, router: Routes) -> None:
        router.add("GET", "/api/version", self.version)
        router.add("POST", "/api/v1/query", self.query)
        router.add("GET", "/api/v1/queues/dead-letters", self.dead_letters)
        router.add("POST", "/api/v1/queues/requeue", self.requeue)
        router.add("POST", "/api/v1/proxy", self.proxy)

    def authorized(self, request: HttpRequest) -> bool:
        password = self.dialect.settings.auth
        if password is None:
            return True
        header = request.header("authorization")
        return header is not None and hmac.compare_digest(header, password.encode())

    @staticmethod
    def refused() -> HttpResponse:
        return _json(401, {"status": "error", "error": "not authorized"})

    @staticmethod
    def body(request: HttpRequest) -> Any:
        try:
            return json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as err:
            raise QueryError(f"body is not JSON: {err}") from None

    async def version(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        return _json(200, API_VERSION)

    async def query(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        if not self.authorized(request):
            return self.refused()
        try:
            query = parse(self.body(request), self.dialect.settings.query_limits)
        except QueryError as err:
            return _json(400, {"errors": [str(err)]})
        matches = self.dialect.index.match(query)
        too_many = self.dialect.too_many_results(len(matches))
        if too_many is not None:
            return _json(400, {"errors": [too_many]})
        return _json(200, [c.describe() for c in matches])

    async def proxy(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        if not self.authorized(request):
            return self.refused()
        return await self.dialect.proxy.handle(request.body)

    async def dead_letters(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        if not self.authorized(request):
            return self.refused()
        name = _query_param(request.query, "queue")
        return _json(200, await self.dialect.queues.list_dead(name))

    async def requeue(self, request: HttpRequest, client: HttpClient) -> HttpResponse:
        if not self.authorized(request):
            return self.refused()
        try:
            body = self.body(request)
        except QueryError as err:
            return _json(400, {"errors": [str(err)]})
        name = body.get("queue") if isinstance(body, dict) else None
        ids = body.get("ids") if isinstance(body, dict) else None
        if not isinstance(name, str) or not (
            ids is None or (isinstance(ids, list) and all(isinstance(i, str) for i in ids))
        ):
            return _json(400, {"errors": ['expected {"queue": NAME, "ids": [ID, ...] | null}']})
        moved = await self.dialect.queues.requeue_dead(name, ids)
        return _json(200, {"requeued": moved})
