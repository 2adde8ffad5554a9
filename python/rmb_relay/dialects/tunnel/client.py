"""The client side: `/{relay|queue|trace}/{tenant}/{target}/{path}?{query}`, any method
(decision 1 of spec/tunnel.md).

A request is parsed, its tenant looked up (404), its bearer token checked when the tenant
requires one (401), its body read (inline up to 16 KiB, else streamed into the body store so a
body of any size costs one chunk of memory), and handed to the hub as a job. `queue` answers
202 right away and discards the connector's answer; `relay` and `trace` wait for it. Statuses
the relay produces itself: 404 unknown tenant or empty target, 401, 503 (no connector with
`--tunnel-require-connection`, connector lost, over the memory budget of waiting requests:
nothing is queued then), 408 (not taken within the TTL), 504 (no answer within
`--tunnel-response-timeout`). The connector's own are 404 (unknown target), 502 (target
failed) and 504 (target timeout).
"""

from __future__ import annotations

import asyncio
import logging
import platform
import secrets
from typing import TYPE_CHECKING
from urllib.parse import unquote

from rmb_relay import __version__
from rmb_relay._core import TUNNEL_HOP_BY_HOP, tunnel_request_headers
from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.hub import Job, Outcome, refusal_reason
from rmb_relay.dialects.tunnel.ids import request_id as new_request_id
from rmb_relay.dialects.tunnel.tokens import bearer
from rmb_relay.dialects.tunnel.wire import ClientRequest, TargetResponse
from rmb_relay.errors import AuthError, BudgetExceeded, ClusterUnavailable
from rmb_relay.lazy_errors import redis_error

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.base import HttpClient, RequestBody
    from rmb_relay.dialects.tunnel.dialect import TunnelDialect

log = logging.getLogger("rmb_relay.tunnel")

MODES = ("relay", "queue", "trace")
#: the acknowledgement mode whose URL carries a random token (hub.py)
MANUAL = 3
#: connection-level fields: they describe one hop, not the request (RFC 9110 §7.6.1), and the
#: framing ones each hop sets itself; the list lives beside the Rust codec (rust/tunnel_wire.rs)
HOP_BY_HOP = frozenset(TUNNEL_HOP_BY_HOP)
_MACHINE = platform.node()


def request_headers(request: HttpRequest) -> dict[str, list[str]]:
    """The request's fields as the tunnel's `httpHeaders`, hop-by-hop ones left out (built in
    Rust from the parsed head: no list of (name, value) tuples in between)."""
    return tunnel_request_headers(request)


def response_headers(response: TargetResponse) -> list[tuple[str, str]]:
    return [
        (name, value)
        for name, values in response.http_headers.items()
        if name.lower() not in HOP_BY_HOP
        for value in values
    ]


#: the reasons of the answers the relay makes itself when no answer came in time (504) and
#: when the connector holding the request left (503): the task, express and native paths'
NO_ANSWER_IN_TIME = "the connector did not answer in time"
CONNECTOR_UNAVAILABLE = "connector unavailable"


def target_url(parts: list[str], query: str | None) -> str:
    """What a client request's path split by `split("/", 4)` (`/mode/tenant/target/rest`) and
    query ask of the target: the rest, with the query."""
    url = parts[4] if len(parts) > 4 else ""
    return url if query is None else f"{url}?{query}"


def _status(status: int, reason: str) -> HttpResponse:
    return HttpResponse(status, reason.encode() + b"\n")


class _Record:
    """The route record of one tunnelled request (`--records`): destination `tenant/target`,
    no source (clients are anonymous), `relay_us` the whole exchange (connector included)."""

    __slots__ = ("channel", "dst", "route", "size", "started")

    def __init__(self, dialect: TunnelDialect) -> None:
        self.channel = dialect.records
        self.started = self.channel.clock() if self.channel is not None else None
        self.dst: str | None = None
        self.route = "none"
        self.size = 0

    @classmethod
    def local(
        cls, dialect: TunnelDialect, dst: str, size: int, started: int | None = None
    ) -> _Record | None:
        """The record of a request going to a connector here (the express path, a job the
        native table hands back), or None when not recording: `dst` is `tenant/target`,
        `started` when the relay got the request in the records' clock (default: now)."""
        if dialect.records is None:
            return None
        record = cls(dialect)
        record.dst = dst
        record.size = size
        record.route = "local"
        if started is not None:
            record.started = started
        return record

    def __call__(self, outcome: str, reason: str | None = None) -> None:
        if self.channel is not None:
            self.channel.add(
                None, self.dst, self.size, self.route, outcome, reason, received=self.started
            )


async def handle(
    dialect: TunnelDialect, request: HttpRequest, body: RequestBody, client: HttpClient
) -> HttpResponse:
    body.lift_deadline()  # the TTL and the response timeout bound this request instead
    parts = request.path.split("/", 4)
    mode = parts[1].lower() if len(parts) > 1 else ""
    tenant_part = unquote(parts[2]) if len(parts) > 2 else ""
    target = unquote(parts[3]) if len(parts) > 3 else ""
    metrics = dialect.metrics
    record = _Record(dialect)
    if mode not in MODES or not tenant_part or not target:
        record("rejected", "bad path")
        return _status(404, "expected /{relay|queue|trace}/{tenant}/{target}/{path}")
    tenant = dialect.tenants.get(tenant_part)
    if tenant is None:
        record("rejected", "unknown tenant")
        return _status(404, f"unknown tenant {tenant_part}")
    name = tenant.name
    record.dst = f"{name}/{target}"
    if tenant.require_authentication:
        token = bearer(request.header("authorization"))
        try:
            if token is None:
                raise AuthError(401, "no bearer token")
            if (await dialect.tokens.verify(token)).upper() != tenant.normalized:
                raise AuthError(401, "the token is for another tenant")
        except AuthError as err:
            metrics.auth_failures.inc(1, "client")
            metrics.requests.inc(1, name, "-", "401")
            record("rejected", "unauthorized")
            return HttpResponse(401, f"{err}\n".encode(), headers=(("WWW-Authenticate", "Bearer"),))
    hub = dialect.hub
    if dialect.settings.require_connection and not await dialect.reachable(tenant.normalized):
        metrics.requests.inc(1, name, "-", "503")
        record("rejected", "no connector")
        return _status(503, f"no connector of tenant {name} is connected")
    request_id = new_request_id()
    url = target_url(parts, request.query)
    ack_mode = dialect.ack_mode_of(tenant)
    wire = ClientRequest(
        request_id=request_id,
        request_origin_id=hub.origin_id,
        target=target,
        tenant_name=name,
        http_method=request.method,
        url=url,
        http_headers=request_headers(request),
        acknowledge_mode=ack_mode,
        enable_tracing=mode == "trace",
        discard_connector_response=mode == "queue",
    )
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Outcome] | None = None if mode == "queue" else loop.create_future()
    job = Job(
        wire,
        tenant.normalized,
        hub.new_deadline(),
        future,
        limit=tenant.max_concurrent,
        # only the manual mode's acknowledge URL carries the token: no random bytes otherwise
        ack_token=secrets.token_urlsafe(24) if ack_mode == MANUAL else "",
    )
    if request.has_body:
        await _read_body(dialect, request, body, job)
    wire.original_body_size = wire.body_size
    record.size = wire.body_size or 0
    try:
        record.route = await dialect.submit(job)
    except (redis_error(), ClusterUnavailable) as err:
        log.warning("tunnel: cannot hand request %s to the other relays: %s", request_id, err)
        metrics.requests.inc(1, name, "-", "503")
        record("rejected", "transport failure")
        return _status(503, "transport failure")
    except BudgetExceeded as err:
        if job.body_name is not None:
            dialect.store.remove(job.body_name)  # nobody will fetch it
        metrics.requests.inc(1, name, "-", "503")
        record("rejected", "relay busy")
        return _status(503, refusal_reason(err, name))
    if future is None:
        metrics.requests.inc(1, name, target, "202")
        record("queued")
        return HttpResponse(202)
    # a plain timer that fails the future, not `asyncio.timeout` (~6x its cost per request)
    timer = loop.call_later(
        dialect.settings.request_ttl + dialect.settings.response_timeout, _time_out, future
    )
    try:
        outcome = await future
    except TimeoutError:
        hub.abandon(job)
        metrics.requests.inc(1, name, "-", "504")
        record("expired", "no answer in time")
        return _status(504, NO_ANSWER_IN_TIME)
    except asyncio.CancelledError:
        hub.abandon(job)  # the client went away
        raise
    finally:
        timer.cancel()
    return respond(dialect, job, outcome, record)


def respond(dialect: TunnelDialect, job: Job, outcome: Outcome, record: _Record) -> HttpResponse:
    """The client's answer for a job's outcome, counted in the metrics and route records (the
    task path above and the express path, express.py, end here alike)."""
    metrics = dialect.metrics
    wire = job.request
    name = wire.tenant_name
    if isinstance(outcome, int):
        metrics.requests.inc(1, name, "-", str(outcome))
        reason = {408: "request expired before a connector took it"}.get(
            outcome, CONNECTOR_UNAVAILABLE
        )
        record("expired" if outcome == 408 else "rejected", reason)
        return _status(outcome, reason)
    status = outcome.http_status_code
    metrics.requests.inc(1, name, wire.target if status != 404 else "-", str(status))
    record("delivered")
    request_id = wire.request_id
    headers = response_headers(outcome)
    if wire.enable_tracing:
        headers += [
            ("RelayServer-RequestId", request_id),
            ("RelayServer-Server-MachineName", _MACHINE),
            ("RelayServer-Server-Version", __version__),
        ]
    if outcome.outsourced:
        store = dialect.store
        return HttpResponse(
            status,
            headers=tuple(headers),
            stream=store.read(store.name("res", request_id), remove=True),
            length=outcome.body_size,
        )
    return HttpResponse(status, outcome.body_content or b"", headers=tuple(headers))


def _time_out(future: asyncio.Future[Outcome]) -> None:
    """Nobody answered within TTL + response timeout: the waiting handler gets TimeoutError."""
    if not future.done():
        future.set_exception(TimeoutError())


async def _read_body(
    dialect: TunnelDialect, request: HttpRequest, body: RequestBody, job: Job
) -> None:
    """Inline up to the limit; beyond it, the body goes to the store as it arrives."""
    limit = dialect.settings.inline_limit
    wire = job.request
    if request.content_length is not None and request.content_length <= limit:
        content = await body.read(limit)
        wire.body_content = content or None
        wire.body_size = len(content)
        return
    head = bytearray()
    iterator = body.__aiter__()
    async for chunk in iterator:
        head += chunk
        if len(head) > limit:
            break
    if len(head) <= limit:
        wire.body_content = bytes(head) or None
        wire.body_size = len(head)
        return
    store = dialect.store
    name = store.name("req", wire.request_id)
    job.body_name = name
    wire.body_size = await store.write(name, iterator, first=bytes(head))
