"""The express path of the client side: the common request served without a task.

Why: on the task path (client.py) most of the relay's CPU per tunnelled request went to the
machinery around the request rather than to it — a task, a timeout scope, the router's
coroutine chain, a future and the awaits through them (py-spy, issue #13). The common case
needs none of it: a small request whose head and body came in one read, for a tenant that
needs no token or with a token already verified, with a connector of that tenant here that
has room. It is encoded (the Rust codec, wire.py) into that connector's outbox while the
client's read is processed, and the connector's `Deliver` writes the client's answer at once,
from inside the connector's read.

Taken here (`offer` returns the abandon call) only when all of these hold, else declined
(None) and client.py serves the request as before, body untouched:

- mode `relay` (queue and trace stay on the task path), tenant and target segments present;
- the tenant is known (cache) and either does not require authentication or the request's
  bearer token is one the relay already verified, still good and for this tenant
  (`TokenAuthority.known`, verified.py); any other token (new, expired, badly signed, another
  tenant's, absent) is declined, and the task path checks it fully and answers 401 itself
  (or serves it and remembers it, so the next request with it comes here);
- a connector of the tenant is connected to this relay (shortcut on, or no Redis), none of the
  tenant's requests is queued, and the tenant is under its concurrency limit, so the job goes
  out at once and never waits in the queue;
- the memory budget admits it (over it, the task path answers 503 with the reason).

The semantics are the task path's: the same ClientRequest, job, deadline, acknowledgement mode
and metrics; the answer is `client.respond`'s; the client's wait is bounded by TTL + response
timeout (504), and a client that goes away abandons the job (`Hub.abandon`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from typing import TYPE_CHECKING
from urllib.parse import unquote

from rmb_relay._core import tunnel_express_answer, tunnel_express_request
from rmb_relay.budget import BudgetExceeded
from rmb_relay.dialects.base import HttpResponse
from rmb_relay.dialects.tunnel.client import (
    MANUAL,
    NO_ANSWER_IN_TIME,
    _Record,
    _status,
    request_headers,
    respond,
    target_url,
)
from rmb_relay.dialects.tunnel.hub import JOB_OVERHEAD, ConnectorSession, Hub, Job, Outcome
from rmb_relay.dialects.tunnel.ids import request_id as new_request_id
from rmb_relay.dialects.tunnel.tokens import bearer
from rmb_relay.dialects.tunnel.wire import ClientRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from rmb_relay._core import HttpRequest
    from rmb_relay.dialects.base import ExpressClient
    from rmb_relay.dialects.tunnel.dialect import TunnelDialect

log = logging.getLogger("rmb_relay.tunnel")

#: how early the deadline timer may fire and still time a reply out (timers fire to the ms)
SLACK = 0.005
#: finished replies the deadline queue may hold beyond twice the live ones before it is
#: rebuilt without them (a slow request at its head keeps later, finished ones in it)
SPARE = 1024


class Deadlines:
    """The express replies' response deadlines behind one timer, instead of a call_later and
    a cancel per request (1.8 us of the relay's ~40 per request). Each deadline is now + the
    same span (TTL + response timeout), so they are appended in order and the timer only ever
    waits for the oldest live one. Finished replies leave the queue from its head, or in a
    rebuild when they outnumber the live ones (memory stays O(requests in flight))."""

    __slots__ = ("live", "loop", "queue", "span", "timer")

    def __init__(self, span: float) -> None:
        self.span = span
        #: the running loop, found on the first `add` (asyncio.get_running_loop costs a
        #: getpid system call: 8% of the relay's CPU when it ran per request)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: collections.deque[tuple[float, ExpressReply]] = collections.deque()
        #: replies added and not finished
        self.live = 0
        self.timer: asyncio.TimerHandle | None = None

    def add(self, reply: ExpressReply) -> None:
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        queue = self.queue
        while queue and queue[0][1].finished:
            queue.popleft()
        if len(queue) > 2 * self.live + SPARE:
            self.queue = queue = collections.deque(e for e in queue if not e[1].finished)
        queue.append((loop.time() + self.span, reply))
        self.live += 1
        if self.timer is None:
            self.timer = loop.call_at(queue[0][0], self._fire)

    def _fire(self) -> None:
        self.timer = None
        loop = self.loop
        assert loop is not None
        now = loop.time()
        queue = self.queue
        while queue:
            when, reply = queue[0]
            if reply.finished:
                queue.popleft()
            elif when > now + SLACK:
                self.timer = loop.call_at(when, self._fire)
                return
            else:
                queue.popleft()
                reply.time_out()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ExpressReply:
    """The job's waiter (hub.Waiter): writes the client's answer when the outcome is set."""

    __slots__ = ("client", "dialect", "finished", "job", "record")

    def __init__(
        self, dialect: TunnelDialect, client: ExpressClient, record: _Record | None = None
    ) -> None:
        self.dialect = dialect
        self.client = client
        self.finished = False
        self.job: Job | None = None
        #: the request's route record (`--records`; None: not recording)
        self.record = record

    def done(self) -> bool:
        return self.finished

    def _finish(self) -> Job | None:
        """Mark it finished; the job, let go of (it points back here: no cycle for the
        garbage collector to find)."""
        self.finished = True
        self.dialect.express_deadlines.live -= 1
        job, self.job = self.job, None
        return job

    def set_result(self, outcome: Outcome, /) -> None:
        if self.finished:
            return
        job = self._finish()
        assert job is not None
        try:
            record = self.record if self.record is not None else _Record(self.dialect)
            response = respond(self.dialect, job, outcome, record)
        except Exception:
            # runs inside the connector's read: an answer we cannot build must cost this
            # client a 500 (as the task path's `_serve` gives), not the connector's session
            log.exception("tunnel: the answer to request %s could not be built", job.request_id)
            response = HttpResponse(500, b"internal server error")
        self.client.express_answer(response)

    def time_out(self) -> None:
        """Nobody answered within TTL + response timeout (client.py's 504)."""
        if self.finished:
            return
        job = self._finish()
        assert job is not None
        self.dialect.hub.abandon(job)
        self.dialect.metrics.requests.inc(1, job.request.tenant_name, "-", "504")
        if self.record is not None:
            self.record("expired", "no answer in time")  # (client.py's)
        self.client.express_answer(_status(504, NO_ANSWER_IN_TIME))

    def abandon(self) -> None:
        """The client went away first: a queued job is dropped, a running one's answer is
        discarded (as when the task path's task is cancelled)."""
        if self.finished:
            return
        job = self._finish()
        if job is not None:
            self.dialect.hub.abandon(job)


def deliver_native(hub: Hub, connector: ConnectorSession, data: bytes) -> bool:
    """A connector's message answered in the Rust core when it is the `Deliver` of a request
    this path took and its answer is the common one (`tunnel_express_answer`: body inline, a
    status and fields HTTP/1.1 carries; `express_answer_encoded`: kept alive, not HEAD):
    the client's bytes are written, the job's bookkeeping and metrics are `Hub.deliver`'s and
    `respond`'s. False, nothing done, for anything else: `on_message` then takes the message
    as before (and answers, counts or refuses it)."""
    got = tunnel_express_answer(data, connector.binary)
    if got is None:
        return False
    request_id, status, answer = got
    job = hub.jobs.get(request_id)
    if job is None or job.tenant != connector.tenant:
        return False
    reply = job.future
    if type(reply) is not ExpressReply or reply.finished:
        return False
    if not reply.client.express_answer_encoded(status, answer):
        return False
    reply._finish()
    if reply.record is not None:
        reply.record("delivered")  # (as `respond` records it)
    wire = job.request
    metrics = hub.metrics
    metrics.native_answers += 1
    metrics.requests.inc(1, wire.tenant_name, wire.target if status != 404 else "-", str(status))
    hub.delivered(connector, job)
    return True


def offer(
    dialect: TunnelDialect,
    request: HttpRequest,
    body: bytes,
    client: ExpressClient,
    native: bool = False,
) -> Callable[[], None] | None:
    """Take the request (returns what abandons it) or decline it (None): module docstring.
    `native`: its headers, budget size and message come from one Rust call
    (`tunnel_express_request`), encoded for the connector it goes to."""
    parts = request.path.split("/", 4)
    metrics = dialect.metrics
    if len(parts) < 4 or parts[1] != "relay":
        metrics.express.inc(1, "path")
        return None
    tenant_part = parts[2]
    target = parts[3]
    if "%" in tenant_part:
        tenant_part = unquote(tenant_part)
    if "%" in target:
        target = unquote(target)
    tenant = dialect.tenants.get(tenant_part) if tenant_part and target else None
    if tenant is None:
        metrics.express.inc(1, "tenant")
        return None
    if tenant.require_authentication:
        token = bearer(request.header("authorization"))
        known = dialect.tokens.known(token) if token is not None else None
        if known is None or known.upper() != tenant.normalized:
            metrics.express.inc(1, "auth")
            return None
    hub = dialect.hub
    key = tenant.normalized
    group = hub.connectors.get(key)
    if not group or not dialect.serves_locally():
        metrics.express.inc(1, "no connector")
        return None
    if key in hub.pending:
        metrics.express.inc(1, "queued")
        return None
    limit = hub.limit_of(tenant.max_concurrent)
    if limit and hub.inflight(key) >= limit:
        metrics.express.inc(1, "limit")
        return None
    url = target_url(parts, request.query)
    ack_mode = dialect.ack_mode_of(tenant)
    size = len(body)
    request_id = new_request_id()
    origin_id = hub.origin_id
    # only the manual mode's acknowledge URL carries the token (as client.py)
    ack_token = secrets.token_urlsafe(24) if ack_mode == MANUAL else ""
    # sent at once: the message `Hub._send` would encode, encoded here with the headers
    now = hub.clock()
    ttl = hub.ttl
    connector = hub.pick(key, group)
    expires_in = max(1, ttl // 1_000_000)
    ack_url = f"/tunnel/acknowledge/{origin_id}/{request_id}/{ack_token}" if ack_token else None
    if native:
        headers, text, message = tunnel_express_request(
            request,
            body,
            request_id,
            origin_id,
            target,
            tenant.name,
            url,
            ack_mode,
            expires_in,
            ack_url,
            connector.binary,
        )
    else:
        headers, text, message = request_headers(request), None, None
    wire = ClientRequest(
        request_id,
        origin_id,
        target,
        tenant.name,
        request.method,
        url,
        headers,
        ack_mode,
        None,
        size,
        size,
        body or None,
    )
    reply = ExpressReply(dialect, client, _Record.local(dialect, f"{tenant.name}/{target}", size))
    job = Job(wire, key, now + ttl, reply, tenant.max_concurrent, ack_token=ack_token)
    try:
        if text is None:
            hub.admit(job)
        else:
            hub.admit_sized(job, JOB_OVERHEAD + size + len(url) + text)
    except BudgetExceeded:
        metrics.express.inc(1, "budget")
        return None  # the task path refuses it with the reason
    reply.job = job
    metrics.express_taken += 1
    dialect.start_sweeper()
    dialect.express_deadlines.add(reply)
    hub.send_now(job, connector, now, message)
    return reply.abandon
