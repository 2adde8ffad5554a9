"""The tunnel's native express table (rust/tunnel_native.rs) kept in step with the hub.

Why: the express path (express.py) still spent ~14 us of the relay's user time per request in
Python bookkeeping, and the relay is the tunnel's bottleneck. For the common case (relay mode,
a connector here; any acknowledge mode, round robin or least in flight, with or without a
concurrency limit, with or without route records) the job now lives in the Rust table: the
client's read is parsed and, when served, its `RequestTarget` is in the connector's outbox
(the switch's, shared with RMB, SBD and the 신경 gateway) without a Python object per request;
the connector's `Deliver` is written into the client's outbox the same way, by the connector
websocket's scanner (`TunnelScanner`) inside the decoder's one `feed` per read. What stays
here are the rare events, all with the express path's answers:

- a client that half-closes (its answer is then Python's) or goes away (its job runs on, the
  answer is dropped);
- the response deadline: a tick every `tick` seconds while the table has tenants answers 504
  to the clients whose TTL + response timeout passed (`Deadlines` does it per request on the
  Python path; here it is one call per tick, so a 504 may come up to one tick late);
- a connector that leaves: its clients are answered 503 (mode Disabled: the job is not
  redelivered, as on the Python path);
- a `Deliver` the table does not answer (a body in the store, a status >= 400, a field HTTP/1.1
  cannot carry): the job is taken out of the table and finished by the hub as an express job;
- the memory budget: a tenant registered here holds a lease of `LEASE` bytes of its budget
  (taken when its connector joins and the lease fits, given back when its last connector
  leaves); its jobs here are admitted against the lease, and a request over it goes to Python,
  which admits or refuses it against the rest of the budget as before;
- tenants' settings: a connected tenant whose settings change (management API, or the
  tenant cache's TTL) is set again at the next tick (one runs while any connector is
  connected): disabled here when it is gone, registered when its lease fits at last;
- route records (`--records`): the table keeps them in Rust, with every field, and the
  records' channel takes them at its flush (`_records`, `Channel.add_source`); one answered
  in Python keeps the table's start (`adopt`);
- the hub's own jobs of a tenant (`outside`, after each change the hub makes): a concurrency
  limit and least in flight count them with the table's, and while the hub has some queued
  the table leaves the tenant's new requests and answers to it, so the queue is served first
  and each answer sends the next queued job.

Counters the table keeps (answers by tenant/target/status, HTTP answers, requests taken,
answers written, declines by reason) are read at scrape through the same metric families.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import TYPE_CHECKING

from rmb_relay._core import NativeTunnel, TunnelScanner
from rmb_relay.clock import NS
from rmb_relay.dialects.tunnel.client import (
    CONNECTOR_UNAVAILABLE,
    NO_ANSWER_IN_TIME,
    _Record,
    _status,
    request_headers,
    target_url,
)
from rmb_relay.dialects.tunnel.tenants import normalize
from rmb_relay.dialects.tunnel.wire import ClientRequest

if TYPE_CHECKING:
    from rmb_relay._core import HttpStreamParser, Outboxes
    from rmb_relay._core import TunnelJobOut as JobOut
    from rmb_relay.dialects.base import HttpEvent, NativeClient
    from rmb_relay.dialects.tunnel.dialect import TunnelDialect
    from rmb_relay.dialects.tunnel.hub import ConnectorSession, Job
    from rmb_relay.dialects.tunnel.tenants import Tenant
    from rmb_relay.telemetry.record_process import FullRecord

log = logging.getLogger("rmb_relay.tunnel")


#: budget bytes a tenant's native jobs may hold here (~170 requests of 1 KiB in flight)
LEASE = 256 << 10
#: random bytes fetched at once for request ids (16 each); fetched again below half
ENTROPY = 16 * 4096
#: how often the deadlines and tenants' settings are looked at (at most; seconds)
TICK = 1.0
#: requests taken in one loop turn after which the connectors' outboxes are written at once
#: instead of at the turn's end: the connector starts on the first ones while the relay reads
#: the rest (two cores, four busy processes in the benchmark: 1 KiB x 64 went from a median
#: of 25,551 to 29,377 req/s and of 22,505 to 25,913 in two sets of five interleaved runs,
#: docs/tunnel.md). A request per wakeup at low load never reaches it.
PIPELINE = 8


class NativeExpress:
    """The table, the outboxes it writes into, and the events it leaves to Python."""

    __slots__ = (
        "_flushing",
        "_taken",
        "_timer",
        "clock",
        "dialect",
        "loop",
        "outboxes",
        "table",
        "tick",
        "tokens",
    )

    def __init__(self, dialect: TunnelDialect, outboxes: Outboxes) -> None:
        settings = dialect.settings
        hub = dialect.hub
        span = hub.ttl + int((settings.response_timeout) * 1e9)
        self.dialect = dialect
        self.outboxes = outboxes
        self.clock = hub.clock
        self.tokens = dialect.tokens
        self.table = NativeTunnel(outboxes, hub.origin_id, hub.ttl, span)
        self.table.refill(os.urandom(ENTROPY))
        self.tick = min(TICK, span / 4e9)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._flushing = False
        self._taken = 0
        self._timer: asyncio.TimerHandle | None = None
        table = self.table
        registry = dialect.registry
        # the families' `dialect="tunnel"` label comes first in their samples
        registry.add_read(
            "rmb_relay_tunnel_requests_total",
            lambda: [(("tunnel", *k), n) for k, n in table.requests()],
        )
        # taken here counts as taken by the express path; a decline here is not one of the
        # express path's (the request is offered to it next), so it has its own family
        registry.add_read(
            "rmb_relay_tunnel_express_total", lambda: [(("tunnel", "taken"), table.taken)]
        )
        registry.counter_of(
            "rmb_relay_tunnel_native_requests_total",
            "Client requests the native express table (Rust core) served (outcome taken), or "
            "left to the Python express path and why (request, path, tenant, auth, "
            "no connector, queued, limit, congested, budget, entropy)",
            lambda: [(("taken",), table.taken)] + [((why,), n) for why, n in table.declined()],
            ("outcome",),
            const={"dialect": "tunnel"},
        )
        registry.add_read(
            "rmb_relay_tunnel_native_answers_total", lambda: [(("tunnel",), table.answered)]
        )
        registry.add_read("rmb_relay_http_requests_total", table.http_answers)

    # ---- the hot path ----------------------------------------------------------------------

    def feed(
        self, conn: NativeClient, parser: HttpStreamParser, data: bytes
    ) -> list[HttpEvent] | None:
        """A client's read: None when the table served it, else the parser's events."""
        events = self.table.feed(
            parser,
            data,
            conn.conn_id,
            conn,
            self.clock(),
            self.tokens.clock() // NS,
        )
        if events is None:
            self._taken += 1
            if self._taken >= PIPELINE:
                self._flush()
            elif not self._flushing:
                self._flushing = True
                loop = self.loop
                if loop is None:
                    loop = self.loop = asyncio.get_running_loop()
                    self._arm()
                loop.call_soon(self._flush)
        return events

    def _flush(self) -> None:
        """The connectors' outboxes the requests since the last flush went into, each written
        once: at the end of the loop turn, or after `PIPELINE` requests."""
        self._flushing = False
        self._taken = 0
        for conn, data in self.outboxes.drain():
            conn.write_taken(data)
        if self.table.ids_left < ENTROPY // 32:
            self.table.refill(os.urandom(ENTROPY))

    # ---- connectors and tenants ------------------------------------------------------------

    def connector_joined(self, connector: ConnectorSession) -> None:
        """The table serves the connector's tenant (when `dialect.serves_locally`) when the
        tenant is known and its lease fits the budget; else the tick tries again while it is
        connected."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self._arm()
        channel = self.dialect.records  # (set after the dialect is built: looked at here)
        if channel is not None and not self.table.recording:
            self.table.recording = True
            channel.add_source(self._records)
        tenant = self.dialect.tenants.get(connector.tenant_name)
        if tenant is None or not self.dialect.serves_locally():
            return
        key = connector.tenant
        if not self.table.has_tenant(key):
            budget = self.dialect.hub.budget
            if budget.check(key, LEASE) is not None:
                # the Python path serves the tenant (and says why when it refuses a request;
                # the lease is not one, so no refusal is counted for it)
                return
            budget.take(key, LEASE)
            self._set_tenant(key, tenant, LEASE)
        self.table.add_connector(key, connector.peer.id, connector.binary)

    def _records(self) -> list[FullRecord]:
        """The table's route records since the last call, as `Channel.add` makes them (the
        channel's `add_source`): moved into the records' clock, route `local`."""
        channel = self.dialect.records
        taken = self.table.take_records()
        if channel is None or not taken:
            return []
        offset = channel.clock() - self.clock()
        return [
            (time + offset, None, dst, size, "local", outcome, reason, relay_ns, None)
            for time, dst, size, outcome, reason, relay_ns in taken
        ]

    def _set_tenant(self, key: str, tenant: Tenant, lease: int) -> None:
        dialect = self.dialect
        hub = dialect.hub
        self.table.set_tenant(
            key,
            tenant.name,
            tenant.require_authentication,
            lease,
            limit=hub.limit_of(tenant.max_concurrent),
            least_inflight=hub.least_inflight,
            ack_mode=dialect.ack_mode_of(tenant),
        )

    def outside(self, key: str, queued: bool, group: list[ConnectorSession] | None) -> None:
        """What the hub has of the tenant `key` (module docstring): jobs queued or not, and
        its connectors' jobs in flight on the Python path."""
        counts = [(c.peer.id, len(c.inflight)) for c in group if c.inflight] if group else []
        self.table.outside(key, queued, counts)

    def connector_left(self, connector: ConnectorSession) -> None:
        """Its clients whose jobs it acknowledged are answered 503; the jobs it had not
        acknowledged go to the hub's queue, first, to be sent again (at least once), each
        client still waiting for its answer (the hub pumps the queue next)."""
        conns, again, lease = self.table.connector_left(
            connector.tenant, connector.peer.id, self.clock()
        )
        _answer(conns, 503, CONNECTOR_UNAVAILABLE)
        hub = self.dialect.hub
        if lease:
            hub.budget.release(connector.tenant, lease)
        for request_id, got in reversed(again):
            hub.redeliver(self._hub_job(request_id, connector.tenant_name, got, again=True))

    def client_done(self, conn: NativeClient) -> None:
        self.table.client_done(conn.conn_id)

    def closed(self, conn: NativeClient, pending: bool) -> None:
        if pending:
            self.table.abandon(conn.conn_id)
        self.outboxes.remove(conn.conn_id)

    def inflight(self, key: str) -> int:
        return self.table.inflight(key)

    def unused_lease(self, key: str) -> int:
        """Budget bytes the table holds for the tenant that none of its jobs uses: the lease
        reserves them, nothing is held in them (`rmb_relay_tunnel_held_bytes` leaves them
        out, so an idle tenant reads 0, not the lease)."""
        table = self.table
        return table.lease(key) - table.held(key)

    # ---- answers Python finishes -----------------------------------------------------------

    def deliver(self, connector: ConnectorSession, data: bytes) -> bool:
        """A connector's message answered (or dropped) by the table: True."""
        return self.table.deliver(data, connector.binary, connector.peer.id, self.clock())

    def scanner(self, connector: ConnectorSession) -> TunnelScanner:
        """The decoder's scanner of `connector`'s websocket: `deliver` inside its `feed`."""
        return TunnelScanner(self.table, connector.peer.id, connector.binary)

    def adopt(self, connector: ConnectorSession, request_id: str) -> Job | None:
        """The table's job of `request_id`, taken out as a hub job waited for by an express
        reply (express.py), so the hub finishes it as it finishes its own; None: not ours."""
        got = self.table.take(request_id, connector.peer.id)
        if got is None:
            return None
        job = self._hub_job(request_id, connector.tenant_name, got, again=False)
        job.connector = connector
        job.attempts = 1
        self.dialect.hub.jobs[request_id] = job
        connector.inflight[request_id] = job
        if not job.acked:
            connector.unacked[request_id] = job
        return job

    def _hub_job(self, request_id: str, tenant_name: str, got: JobOut, *, again: bool) -> Job:
        """A job out of the table as the hub's: waited for by an express reply when its
        client still waits (its answer is then the express path's; `again`: the job is to be
        sent anew, within its TTL, and the reply gets a new response deadline), with the whole
        request while it is not acknowledged (the hub may have to send it again), the
        request's start kept for its route record."""
        from rmb_relay.dialects.tunnel.express import ExpressReply
        from rmb_relay.dialects.tunnel.hub import Job

        conn, request, key, target, _answer_due, started, size, ack_mode, acked, body, token = got
        dialect = self.dialect
        # the hub's deadline is the pickup one (TTL): a job sent again past it is 408
        deadline = started + dialect.hub.ttl
        reply = None
        if conn is not None and request is not None and conn.adopt_native(request):
            channel = dialect.records
            if channel is not None:  # (into the records' clock)
                started += channel.clock() - self.clock()
            dst = f"{tenant_name}/{target}"
            reply = ExpressReply(dialect, conn, _Record.local(dialect, dst, size, started))
            if again:
                dialect.express_deadlines.add(reply)
            else:
                dialect.express_deadlines.live += 1  # (its `_finish` counts it out)
        origin = dialect.hub.origin_id
        method = request.method if request is not None else "GET"
        if acked or request is None:  # (sent for good: all the hub reads of it)
            wire = ClientRequest(request_id, origin, target, tenant_name, method, "", {}, 0, origin)
        else:
            url = target_url(request.path.split("/", 4), request.query)
            content = body or b""
            wire = ClientRequest(
                request_id,
                origin,
                target,
                tenant_name,
                method,
                url,
                request_headers(request),
                ack_mode,
                origin,
                len(content),
                len(content),
                content or None,
            )
        tenant = dialect.tenants.get(tenant_name)
        limit = tenant.max_concurrent if tenant is not None else 0
        job = Job(wire, key, deadline, reply, limit, ack_token=token)
        if reply is not None:
            reply.job = job
        job.acked = acked
        return job

    # ---- deadlines, settings, shutdown -----------------------------------------------------

    def _arm(self) -> None:
        loop = self.loop
        if self._timer is None and loop is not None:
            self._timer = loop.call_later(self.tick, self._tick)

    def _tick(self) -> None:
        self._timer = None
        _answer(self.table.expired(self.clock()), 504, NO_ANSWER_IN_TIME)
        dialect = self.dialect
        connected = False
        for key, group in list(dialect.hub.connectors.items()):
            if not group:
                continue
            connected = True
            tenant = dialect.tenants.get(group[0].tenant_name)
            if tenant is None or not self.dialect.serves_locally():
                self.table.disable(key)  # its jobs in flight are still answered here
            elif self.table.has_tenant(key):
                self._set_tenant(key, tenant, 0)
            else:  # (its lease may fit now): as if its connectors joined
                for connector in group:
                    self.connector_joined(connector)
        if len(self.table) or connected:
            self._arm()

    def token_verified(self, token: str, tenant: str, until: float) -> None:
        """`TokenAuthority`'s news of a token that passed, good up to `until` (unix s)."""
        self.table.add_token(token, normalize(tenant), math.floor(until))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conns, _lease = self.table.close()  # (the budget goes with the hub)
        _answer(conns, 503, CONNECTOR_UNAVAILABLE)


def _answer(conns: list[tuple[NativeClient, str]], status: int, reason: str) -> None:
    """Python's answer to the table's clients `conns` (connection, request method)."""
    for conn, method in conns:
        conn.native_answer(_status(status, reason), method)
