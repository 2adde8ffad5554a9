"""The client side on Python's part: `/{relay|queue|trace}/{tenant}/{target}/{path}?{query}`,
any method (decision 1 of spec/tunnel.md), for the requests the hub's fast path did not take
from the read (a body that did not come whole or is over the inline limit, HEAD, `Expect`, a
tenant or token not known yet, a tenant served by another relay, ...).

Every decision is the hub's (`TunnelHub.step`, hub.py): this loop only does the I/O a step
asks for and steps again — load the tenant from the directory, verify a token, ask the
cluster whether a connector is reachable, read the body (inline up to 16 KiB, else streamed
into the body store, so a body of any size costs one chunk of memory), hand the request to
the cluster — then waits for the answer the hub resolves (its TTL and answer deadlines are
the hub's: 408, 504). Statuses the relay makes itself: 404 unknown tenant or bad path, 401,
503 (no connector with `--tunnel-require-connection`, connector lost, over the memory budget:
nothing is queued then, the cluster unreachable, a publish that failed and was withdrawn),
408, 504 (also: the relay cannot tell whether another relay took it); the connector's own are
404 (unknown target), 502 (target failed) and 504 (target timeout).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import TYPE_CHECKING

from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.hub import (
    ACCEPTED,
    BODY,
    HELD,
    LOAD,
    PUBLISH,
    REACH,
    REFUSE,
    VERIFY,
    status_response,
)
from rmb_relay.dialects.tunnel.tenants import normalize
from rmb_relay.dialects.tunnel.tokens import CLIENT_SCOPE
from rmb_relay.errors import AuthError, BodyTooLarge, ClusterUnavailable, WriteUncertain
from rmb_relay.lazy_errors import redis_error

if TYPE_CHECKING:
    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.base import HttpClient, RequestBody
    from rmb_relay.dialects.tunnel.host import TunnelHost

log = logging.getLogger("rmb_relay.tunnel")

MODES = ("relay", "queue", "trace")
#: steps one request may take at most: each I/O step is asked for once (a hub that asked
#: again would be a bug, answered 500 rather than looped on)
MAX_STEPS = 8
UNAUTHORIZED = (("WWW-Authenticate", "Bearer"),)
#: a queue-mode request whose fate the relay could not learn (scaleout.py)
UNKNOWN = "the relay could not tell whether the request was queued"


async def handle(
    dialect: TunnelHost, request: HttpRequest, body: RequestBody, client: HttpClient
) -> HttpResponse:
    body.lift_deadline()  # the hub's TTL and answer deadlines bound this request instead
    hub = dialect.hub
    core = hub.core
    token, future = hub.waiter()
    content: bytes | tuple[str, int] | None = None
    reachable: bool | None = None
    started = hub.clock()
    #: the hub (or the cluster) holds the request, stored body included
    kept = False
    try:
        for _ in range(MAX_STEPS):
            now, wall = hub.now()
            step = core.step(request, content, token, reachable, now, wall)
            hub.settle()
            kind = step[0]
            if kind == REFUSE:
                status, reason = step[1], step[2]
                if status == 401:
                    hub.auth_failures.inc(1, "client")
                    return HttpResponse(401, f"{reason}\n".encode(), headers=UNAUTHORIZED)
                return status_response(status, reason)
            if kind == LOAD:
                dialect.load_tenant(step[1])
            elif kind == VERIFY:
                try:
                    await dialect.tokens.verify(step[1], CLIENT_SCOPE)
                except AuthError as err:
                    hub.auth_failures.inc(1, "client")
                    _refused(dialect, request, 401, "unauthorized", started)
                    return HttpResponse(401, f"{err}\n".encode(), headers=UNAUTHORIZED)
            elif kind == REACH:
                reachable = await dialect.reachable(step[1])
            elif kind == BODY:
                try:
                    content = await read_body(dialect, request, body, client)
                except BodyTooLarge as err:
                    _refused(dialect, request, 413, "body too large", started)
                    return HttpResponse(413, f"{err}\n".encode())
            elif kind == ACCEPTED:
                kept = True
                return HttpResponse(202)
            elif kind == HELD:
                kept = True
                return hub.response(await future)
            else:  # PUBLISH
                assert kind == PUBLISH
                _, request_id, message, pickup = step
                queued = request.path.startswith("/queue/")
                try:
                    await dialect.publish(request_id, message, pickup, content)
                except (redis_error(), ClusterUnavailable) as err:
                    log.warning(
                        "tunnel: cannot hand request %s to the other relays: %s", request_id, err
                    )
                    core.unpublish(request_id)
                    _refused(dialect, request, 503, "transport failure", started)
                    return status_response(503, "transport failure")
                except WriteUncertain as err:
                    # refused only once it is sure not to run (scaleout.py: withdrawn)
                    log.warning(
                        "tunnel: handing request %s to the other relays failed (%s); "
                        "withdrawing it",
                        request_id,
                        err,
                    )
                    verdict = dialect.verdict(request_id) if queued else None
                    core.publish_failed(request_id)
                    hub.settle()
                    if verdict is not None:
                        taken = await verdict
                        if taken is False:
                            _refused(dialect, request, 503, "transport failure", started)
                            return status_response(503, "transport failure")
                        kept = True  # it may be fetched
                        if taken is None:
                            _refused(dialect, request, 504, "not known", started)
                            return status_response(504, UNKNOWN)
                        return HttpResponse(202)
                kept = True
                if queued:
                    # the relay that takes it removes its body once fetched; ours is tracked
                    # still, so the sweeper removes it after max_age if nobody took it
                    return HttpResponse(202)
                try:
                    return hub.response(await future)
                finally:
                    if isinstance(content, tuple):  # answered or given up: fetched, or never
                        dialect.store.remove(content[0])
        log.error("tunnel: request %s %s took too many steps", request.method, request.path)
        return HttpResponse(500, b"internal server error")
    except asyncio.CancelledError:
        if not future.done():
            hub.abandon(token)  # the client went away
        raise
    finally:
        if not future.done():
            hub.abandon(token)
        hub.waiting.pop(token, None)
        if isinstance(content, tuple) and not kept:
            dialect.store.remove(content[0])  # refused, or the client left: nobody fetches it


def _refused(
    dialect: TunnelHost, request: HttpRequest, status: int, why: str, started: int
) -> None:
    """An answer this side made itself, counted and recorded as the hub's are."""
    hub = dialect.hub
    parts = request.path.split("/", 4)
    tenant = dialect.tenant_name(parts[2]) if len(parts) > 3 else None
    dst = f"{tenant}/{parts[3]}" if tenant is not None else None
    hub.core.count_refusal(tenant or "-", dst, status, "rejected", why, started, hub.clock())


async def read_body(
    dialect: TunnelHost, request: HttpRequest, body: RequestBody, client: HttpClient
) -> bytes | tuple[str, int]:
    """Inline up to the limit; beyond it, the body goes to the store as it arrives (its name
    and size). Its bytes are charged to the client's address and the tenant's upload rate
    (`UploadRate`: a faster sender is read more slowly)."""
    limit = dialect.settings.inline_limit
    store = dialect.store
    owner = normalize(request.path.split("/", 3)[2])
    rate = dialect.upload_rate
    if rate.enabled:
        body.throttle(functools.partial(rate.charge, rate.key(client.peer_host), owner))
    if request.content_length is not None:
        store.refuse_size(request.content_length)
        if request.content_length <= limit:
            return await body.read(limit)
    head = bytearray()
    iterator = body.__aiter__()
    async for chunk in iterator:
        head += chunk
        if len(head) > limit:
            break
    if len(head) <= limit:
        return bytes(head)
    name = store.name("req", str(uuid.uuid4()))
    size = await store.write(name, iterator, first=bytes(head), owner=owner)
    return name, size
