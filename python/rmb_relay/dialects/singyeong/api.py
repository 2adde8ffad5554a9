"""The gateway's HTTP API (spec §11, decision 13) on the shared listener.

| route | auth | what |
|---|---|---|
| `GET /api/version` | no | `{"singyeong": "0.0.1", "api": "v1"}` |
| `POST /api/v1/query` | yes | body = a query; the matching clients of every instance |
| `POST /api/v1/proxy` | yes | an HTTP request to a client picked by a query (proxy.py) |
| `GET /api/v1/queues/dead-letters?queue=NAME&after=C` | yes | dead letters, paged |
| `POST /api/v1/queues/requeue` | yes | `{"queue": NAME, "ids": [...]}` back in (no ids: all) |

The dead-letter listing is paged (issue 33: an answer must not grow with what a stranger can
fill): letters in (queue, id) order, at most `--sg-dead-letters-page` of them and
`DEAD_PAGE_BYTES` of JSON; a cut answer carries `Link: <...&after=CURSOR>; rel="next"` (and
`X-Sg-Next: CURSOR`), and an answer without it is the last page.

Auth: with `--sg-auth`, the `Authorization` header must be the password verbatim (no
"Bearer"), as the public server; else 401 `{"status":"error","error":"not authorized"}`.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlencode

from rmb_relay.dialects.base import HttpClient, HttpResponse, Routes
from rmb_relay.dialects.singyeong.query import QueryError, parse
from rmb_relay.dialects.singyeong.queues import DeadPage
from rmb_relay.dialects.singyeong.settings import API_VERSION

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.singyeong.clients import ClientIndex
    from rmb_relay.dialects.singyeong.metrics import SgMetrics
    from rmb_relay.dialects.singyeong.proxy import Proxy
    from rmb_relay.dialects.singyeong.queues import Queues
    from rmb_relay.dialects.singyeong.redis_queues import RedisQueues
    from rmb_relay.dialects.singyeong.settings import SgSettings

JSON = "application/json"


def _json(status: int, value: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(value, separators=(",", ":")).encode(), JSON)


def _query_param(query: str | None, name: str) -> str | None:
    values = parse_qs(query or "").get(name)
    return values[0] if values else None


class ApiHost(Protocol):
    """What the API needs of the gateway (dialect.py's `SingyeongDialect`, which imports
    this module: a protocol, so that nothing here imports it back)."""

    @property
    def settings(self) -> SgSettings: ...

    @property
    def index(self) -> ClientIndex: ...

    @property
    def queues(self) -> Queues | RedisQueues: ...

    @property
    def proxy(self) -> Proxy: ...

    @property
    def metrics(self) -> SgMetrics: ...

    def too_many_results(self, matched: int) -> str | None: ...


class SgApi:
    def __init__(self, dialect: ApiHost) -> None:
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
        after = _query_param(request.query, "after")
        try:
            page = DeadPage(after, self.dialect.settings.dead_letters_page)
        except ValueError as err:
            return _json(400, {"errors": [str(err)]})
        await self.dialect.queues.list_dead(name, page)
        headers: tuple[tuple[str, str], ...] = ()
        if page.cursor is not None:
            # the rest is on the next page (RFC 8288 rel=next, as GitHub's API pages)
            self.dialect.metrics.refused.inc(1, "dead_letters_page")
            params = (
                {"after": page.cursor} if name is None else {"queue": name, "after": page.cursor}
            )
            headers = (
                ("Link", f'<{request.path}?{urlencode(params)}>; rel="next"'),
                ("X-Sg-Next", page.cursor),
            )
        return HttpResponse(200, page.body(), JSON, headers=headers)

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
